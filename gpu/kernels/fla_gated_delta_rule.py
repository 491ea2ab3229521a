"""The gated delta rule of a step with prefill chunks: its one-token sequences in
place, its longer ones through fla-core's chunked kernel, compacted.

fla-core (the ``gpu`` extra) is imported on first use only: the CPU path never
imports it. fla loads an initial state and stores a final one for every sequence
it is given, however short (2 MB each a layer at qwen3.5-35b-a3b's sizes), and a
varlen graph of N tokens has ``min(N, max_num_seqs) + 1`` sequence slots, most of
them decode rows or padding in a served mixed step. So ``mixed_gated_delta_rule``
splits the step on the device, with static shapes and no host read:

- each sequence of exactly one token with a slot (a decode row, a one-token
  prefill chunk) runs ``gated_delta_rule_decode`` in its varlen mode: its state
  updated in place in its slot, read and written once;
- the sequences of two tokens or more, at most ``num_seats`` of them (the
  scheduler's ``MAX_CHUNKED_SEQS``, actors/config.py; the CUDA executor's plan
  refuses a step with more), are given seats in order (``chunked_seats``): their
  rows gathered into compact buffers of the step's token count, a compact
  ``cu_seqlens`` with zero-length empty seats, and fla runs on those seats alone.
  Their states are gathered from their slots (zeros when they computed nothing
  yet, and for empty seats) and the final ones scattered back to the real slots
  (gpu/kernels/triton_linear_attention.py's ``gather_states`` / ``scatter_states``);
  the outputs go back to the step's rows by the inverse index.

fla 0.6.0 computes its chunk index (which chunk of which sequence each program
takes) from ``cu_seqlens`` with a host synchronisation, and caches it by the
identity of the ``cu_seqlens`` tensor. Neither survives a CUDA graph: a graph
replays with the same tensors and new values. So the chunk index is built here,
on the device, with a size fixed by the compact layout's token and seat counts
(``max_num_chunks``); the rows past the real chunks name chunks past the end of
the last seat, which fla's kernels read as empty and write nothing for (their
loads and stores are bounded by the sequence's length). And the ``cu_seqlens``
handed to fla is a new tensor object per call, so fla's identity cache never
returns what an earlier step (or the warm-up before a capture) computed.

Steps of one token per sequence take ``gated_delta_rule_decode`` alone
(gpu/models/cuda_hybrid.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trio_llm.gpu.kernels.triton_linear_attention import (
    gated_delta_rule_decode,
    gather_states,
    gdn_gates,
    scatter_states,
)

# fla's chunk size for the gated delta rule (its default)
CHUNK_SIZE = 64


def max_num_chunks(num_tokens: int, num_seqs: int) -> int:
    """An upper bound on the chunks of ``num_seqs`` sequences of ``num_tokens`` tokens
    in all (each sequence's last chunk may be partial), plus one: the index always
    ends with a row past every sequence."""
    return (num_tokens + num_seqs * (CHUNK_SIZE - 1)) // CHUNK_SIZE + 1


def chunk_index(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """fla's chunk index [num_rows, 2] (sequence, chunk within it), built on the device
    without a host synchronisation; rows beyond the real chunks continue the last
    sequence past its end."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    num_chunks = (lengths + CHUNK_SIZE - 1) // CHUNK_SIZE
    chunk_starts = torch.nn.functional.pad(num_chunks.cumsum(0), (1, 0))
    rows = torch.arange(num_rows, device=cu_seqlens.device, dtype=chunk_starts.dtype)
    sequences = (torch.searchsorted(chunk_starts, rows, right=True) - 1).clamp(
        max=lengths.shape[0] - 1)
    return torch.stack([sequences, rows - chunk_starts[sequences]], 1).to(cu_seqlens.dtype)


@dataclass(frozen=True, slots=True)
class ChunkedSeats:
    """Where a step's sequences of two tokens or more sit in the compact layout fla
    runs (device tensors of static shapes). ``cu_seqlens`` [seats + 1] int64 with
    ``context_lens`` and ``slots`` [seats] (an empty seat: length 0, slot -1);
    ``source_rows`` [tokens]: the step's row each compact row reads (row 0 past the
    seats' tokens); ``compact_rows`` [tokens]: the compact row each of the step's
    rows takes its output from, where ``is_chunked_row`` [tokens] (0 elsewhere)."""

    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor
    source_rows: torch.Tensor
    compact_rows: torch.Tensor
    is_chunked_row: torch.Tensor


def chunked_seats(query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                  slots: torch.Tensor, num_tokens: int, num_seats: int) -> ChunkedSeats:
    """The seats of the step's sequences of two tokens or more with a slot, in order
    (``num_seats`` >= 1; a sequence past the last seat gets none: the host plan
    refuses such a step), through cumsums and sorted searches: no host read."""
    starts = query_start_loc.to(torch.int64).view(-1)
    device = starts.device
    lengths = starts[1:] - starts[:-1]
    num_seqs = lengths.shape[0]
    counts = ((lengths >= 2) & (slots >= 0)).cumsum(0)  # chunked sequences so far
    # seat j holds the first sequence with more than j chunked ones up to it (none: past
    # the last sequence)
    sequence_of_seat = torch.searchsorted(counts, torch.arange(num_seats, device=device),
                                          right=True)
    occupied = sequence_of_seat < num_seqs
    sequence_of_seat = sequence_of_seat.clamp(max=num_seqs - 1)
    seat_lengths = torch.where(occupied, lengths[sequence_of_seat], 0)
    cu_seqlens = torch.nn.functional.pad(seat_lengths.cumsum(0), (1, 0))
    rows = torch.arange(num_tokens, device=device)
    # compact row -> its seat -> the step's row
    seat_of_row = torch.searchsorted(cu_seqlens[1:], rows, right=True).clamp(max=num_seats - 1)
    source_rows = torch.where(rows < cu_seqlens[-1], starts[sequence_of_seat[seat_of_row]]
                              + rows - cu_seqlens[seat_of_row], 0)
    # the step's row -> its sequence -> that sequence's seat -> the compact row
    sequence_of_row = torch.searchsorted(starts[1:], rows, right=True).clamp(max=num_seqs - 1)
    row_seat = counts[sequence_of_row] - 1
    is_chunked_row = ((lengths[sequence_of_row] >= 2) & (slots[sequence_of_row] >= 0)
                      & (row_seat < num_seats) & (rows < starts[-1]))
    compact_rows = torch.where(is_chunked_row, cu_seqlens[row_seat.clamp(0, num_seats - 1)]
                               + rows - starts[sequence_of_row], 0)
    return ChunkedSeats(
        cu_seqlens=cu_seqlens,
        context_lens=torch.where(occupied, context_lens[sequence_of_seat], 0),
        slots=torch.where(occupied, slots[sequence_of_seat], -1), source_rows=source_rows,
        compact_rows=compact_rows, is_chunked_row=is_chunked_row)


def mixed_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                           b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                           recurrent_state: torch.Tensor, query_start_loc: torch.Tensor,
                           context_lens: torch.Tensor, slots: torch.Tensor, scale: float,
                           max_chunked_seqs: int) -> torch.Tensor:
    """The gated delta rule of a step of any layout (the arguments as
    ``gated_delta_rule_decode``'s, plus the step's ``query_start_loc``): one-token
    sequences in place, the others (at most ``max_chunked_seqs``) through fla on
    their seats (the module's docstring). -> [tokens, value heads, value dim]; zeros
    for padding rows."""
    out = gated_delta_rule_decode(q, k, v, a, b, a_log, dt_bias, recurrent_state,
                                  context_lens, slots, scale, query_start_loc=query_start_loc)
    num_tokens, num_seqs = q.shape[0], slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    seats = chunked_seats(query_start_loc, context_lens, slots, num_tokens,
                          min(max_chunked_seqs, num_seqs))
    rows = seats.source_rows
    decay, beta = gdn_gates(a.index_select(0, rows), b.index_select(0, rows), a_log, dt_bias)
    chunked = chunked_gated_delta_rule(
        q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows), decay,
        beta, recurrent_state, seats.cu_seqlens, seats.context_lens, seats.slots, scale)
    return torch.where(seats.is_chunked_row[:, None, None],
                       chunked.index_select(0, seats.compact_rows), out)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             g: torch.Tensor, beta: torch.Tensor,
                             recurrent_state: torch.Tensor, query_start_loc: torch.Tensor,
                             context_lens: torch.Tensor, slots: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """The gated delta rule of the sequences packed by ``query_start_loc`` (q, k
    [tokens, key heads, K], v [tokens, value heads, V], g float32 and beta [tokens,
    value heads]), q and k l2-normalised in the kernel, each sequence continuing its
    slot of ``recurrent_state`` [slots, value heads, K, V] float32 (zeros where it
    computed nothing yet) and leaving its final state there. -> [tokens, value heads,
    V]. Every sequence given costs fla a state loaded and stored, whatever its length:
    a step's layout comes here compacted (``mixed_gated_delta_rule``)."""
    if q.device.type != "cuda":
        return _recurrent_on_the_cpu(q, k, v, g, beta, recurrent_state, query_start_loc,
                                     context_lens, slots)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    num_tokens, num_seqs = q.shape[0], slots.shape[0]
    cu_seqlens = query_start_loc.to(torch.int64).view(-1)  # a new object (docstring)
    initial = gather_states(recurrent_state, query_start_loc, context_lens, slots)
    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_index(cu_seqlens, max_num_chunks(num_tokens, num_seqs)))
    scatter_states(final, recurrent_state, slots)
    return out[0]


def _recurrent_on_the_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, recurrent_state: torch.Tensor,
                          query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
    """The same function without fla (whose chunked kernels need CUDA: Triton's
    interpreter cannot run them), so that the CUDA executor's hybrid path runs on the
    CPU in the tests: the torch layer's recurrence, sequence by sequence, reading the
    layout on the host (the scale is the recurrence's own, 1/sqrt(key dim))."""
    from trio_llm.gpu.layers.linear_attention import gated_delta_rule

    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    starts = query_start_loc.tolist()
    for index, (slot, context_len) in enumerate(zip(slots.tolist(), context_lens.tolist(),
                                                    strict=True)):
        rows = slice(starts[index], starts[index + 1])
        if slot < 0 or rows.start == rows.stop:
            continue
        continues = context_len > rows.stop - rows.start
        out[rows] = gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                     recurrent_state[slot], continues)
    return out
