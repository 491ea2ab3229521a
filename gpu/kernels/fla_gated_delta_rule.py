"""The gated delta rule over a step's sequences, through fla-core's chunked kernel.

fla-core (the ``gpu`` extra) is imported on first use only: the CPU path never
imports it. A step's sequences (prefill chunks and decode rows, packed by
``query_start_loc``) run as one varlen call: each sequence's initial state is
gathered from its slot (zeros when it has computed nothing yet, or is a padding
sequence), and its final state is scattered back into the slot
(gpu/kernels/triton_linear_attention.py's ``gather_states`` / ``scatter_states``).

fla 0.6.0 computes its chunk index (which chunk of which sequence each program
takes) from ``cu_seqlens`` with a host synchronisation, and caches it by the
identity of the ``cu_seqlens`` tensor. Neither survives a CUDA graph: a graph
replays with the same tensors and new values. So the chunk index is built here,
on the device, with a size fixed by the step's token and sequence counts
(``max_num_chunks``); the rows past the real chunks name chunks past the end of
the last sequence, which fla's kernels read as empty and write nothing for
(their loads and stores are bounded by the sequence's length). And the
``cu_seqlens`` handed to fla is a new tensor object per call, so fla's identity
cache never returns what an earlier step (or the warm-up before a capture) computed.

Steps of one token per sequence take ``gated_delta_rule_decode`` instead (in
place, no gather or scatter: the states are 2 MB a layer a request at
qwen3.5-35b-a3b's sizes, read and written once).
"""

from __future__ import annotations

import torch

from trio_llm.gpu.kernels.triton_linear_attention import gather_states, scatter_states

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


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             g: torch.Tensor, beta: torch.Tensor,
                             recurrent_state: torch.Tensor, query_start_loc: torch.Tensor,
                             context_lens: torch.Tensor, slots: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """The gated delta rule of the step's sequences (q, k [tokens, key heads, K], v
    [tokens, value heads, V], g float32 and beta [tokens, value heads]), q and k
    l2-normalised in the kernel, each sequence continuing its slot of
    ``recurrent_state`` [slots, value heads, K, V] float32 (zeros where it computed
    nothing yet) and leaving its final state there. -> [tokens, value heads, V]."""
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
