"""One step's inputs on the host, and their layout in the upload buffers.

The host flattens a ScheduledBatch into named int64 and float32 segments, each
starting at a multiple of SEGMENT_ALIGNMENT elements of one pinned buffer, which
one copy uploads. Views into the device copy are taken by name (``Segments``).

The per-token layout: the first segments are TOKEN_SEGMENTS, one value per input
token each (token id, position, KV-cache slot), then the per-sequence ones. A token
id ``-1 - i`` stands for the token a step still in flight sampled into row ``i`` of
the executor's flat [slot, row] buffer of sampled ids: the device reads it there
(``cuda_graphs.with_previous_tokens``), inside the graph. The float32 segments
follow the int64 ones in the same buffer, so that one copy uploads a step. A
step that replays a CUDA graph is padded on the host to the graph's sizes, so
that these segments have exactly the graph's token count (a multiple of
SEGMENT_ALIGNMENT) and one copy of the upload's start fills the graph's static
inputs (``cuda_graphs.StaticInputs``):
padding tokens have token id 0, position 0 and slot -1 (the cache is not written)
and belong to a padding sequence of context 0 (attention gives zeros).
"""

from __future__ import annotations

from array import array as typed_array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trio_llm.gpu.cuda_streams import Event
from trio_llm.gpu.pooling import PoolingChunk
from trio_llm.gpu.sampler import PromptLogprobRows, SamplingRow

# One value per input token, in this order, at the start of the upload.
TOKEN_SEGMENTS = ("token_ids", "positions", "slot_mapping")
# One value per sequence (query_start_loc: one more); state_slots only for a model with
# linear-attention layers (empty otherwise), right after context_lens so that a decode
# graph's static inputs are the first five segments.
SEQUENCE_SEGMENTS = ("context_lens", "state_slots", "query_start_loc", "table_rows")
# Host-side int64 segments of one step's upload, in order.
INT_SEGMENTS = (*TOKEN_SEGMENTS, *SEQUENCE_SEGMENTS, "logits_indices",
                "update_indices", "update_block_ids", "top_ks", "seed_keys",
                "output_indices", "banned_rows", "banned_token_ids", "bitmask_rows",
                "bitmask_words", "allowed_rows", "allowed_local_rows", "allowed_token_ids",
                "logit_bias_rows", "logit_bias_token_ids", "penalty_rows", "penalty_slots",
                "prompt_logprob_rows")
FLOAT_SEGMENTS = ("temperatures", "top_ps", "min_ps", "logit_bias_values", "presences",
                  "frequencies", "repetitions")
# Segments start at multiples of this many elements (16 bytes or more). Triton compiles
# a kernel variant per pattern of 16-byte-aligned pointer arguments: views at arbitrary
# offsets would compile new variants in the middle of a run.
SEGMENT_ALIGNMENT = 4


@dataclass(slots=True)
class HostStep:
    """One step's inputs, built on the host from a ScheduledBatch. ``graph_key`` names
    the captured graph it replays (None: eager)."""

    step_id: int
    ints: dict[str, list[int]] = field(default_factory=lambda: {name: [] for name in
                                                                INT_SEGMENTS})
    num_tokens: int = 0
    num_seqs: int = 0
    num_single_token_rows: int = 0  # sequences of one query token: decode rows
    graph_key: tuple[str, int] | None = None
    # per sampled row, its request's upload values (cuda_sampler.plain_row_values);
    # SamplingRows only where a row needs the full sampling plan (else empty)
    row_values: list[tuple[float, float, float, int, int]] = field(default_factory=list)
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    sampled_request_ids: list[str] = field(default_factory=list)
    # decode rows whose token id names a row of the device's sampled ids (negative)
    num_tokens_from_device: int = 0
    # indices into sampling_rows of the rows whose bitmasks follow (supply_bitmasks)
    rows_awaiting_bitmasks: list[int] = field(default_factory=list)
    # positions whose prompt logprobs are asked (the step then runs eagerly), and
    # their hidden states once computed
    prompt_logprob_rows: PromptLogprobRows = field(
        default_factory=lambda: PromptLogprobRows([], [], []))
    prompt_hidden: torch.Tensor | None = None
    # embedding requests' chunks (the step then runs eagerly), and the vectors of those
    # whose last chunk it is, on the device once computed (gpu/pooling.py)
    pooling_chunks: list[PoolingChunk] = field(default_factory=list)
    pooled: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # Long chunks' positions and slots stay NumPy arrays (a list of thousands of ints
    # costs tens of nanoseconds an element to build and again to copy into the upload):
    # segment name -> (index into ``ints[name]`` the array goes before, the array).
    inserts: dict[str, list[tuple[int, np.ndarray]]] = field(
        default_factory=lambda: {"positions": [], "slot_mapping": []})
    # (source, destination) state slots copied, in order, before the forward
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    def segment_length(self, name: str) -> int:
        """``ints[name]``'s length with the arrays inserted in it."""
        length = len(self.ints[name])
        for _, array in self.inserts.get(name, ()):
            length += len(array)
        return length

    @property
    def kind(self) -> str:
        """decode (one token per sequence), prefill (no decode row) or mixed. (A prompt's
        last chunk of one token counts as a decode row.)"""
        if self.num_tokens == self.num_seqs:
            return "decode"
        return "mixed" if self.num_single_token_rows else "prefill"


def pad_tokens(step: HostStep, num_tokens: int) -> None:
    """Padding tokens up to ``num_tokens``: no cache write (slot -1)."""
    num_padding = num_tokens - step.num_tokens
    ints = step.ints
    ints["token_ids"] += [0] * num_padding
    ints["positions"] += [0] * num_padding
    ints["slot_mapping"] += [-1] * num_padding


def pad_decode_sequences(step: HostStep, num_seqs: int) -> None:
    """A decode graph's padding: one padding token per padding sequence, context 0."""
    pad_tokens(step, num_seqs)
    num_padding = num_seqs - step.num_seqs
    step.ints["context_lens"] += [0] * num_padding
    step.ints["table_rows"] += [0] * num_padding
    pad_state_slots(step, num_padding)


def pad_varlen_sequences(step: HostStep, num_tokens: int, num_seqs: int,
                         num_logits_rows: int) -> None:
    """A mixed graph's padding: empty padding sequences, the last of which owns every
    padding token; context 0 for all. Logits rows beyond the sampled ones read token 0."""
    assert num_seqs > step.num_seqs and num_tokens >= step.num_tokens
    pad_tokens(step, num_tokens)
    num_padding = num_seqs - step.num_seqs
    ints = step.ints
    ints["context_lens"] += [0] * num_padding
    ints["table_rows"] += [0] * num_padding
    pad_state_slots(step, num_padding)
    ints["query_start_loc"] += [step.num_tokens] * (num_padding - 1) + [num_tokens]
    ints["logits_indices"] += [0] * (num_logits_rows - len(ints["logits_indices"]))


def pad_state_slots(step: HostStep, num_padding: int) -> None:
    """Padding sequences' state slot -1 (their states are read as zeros and never
    written), for a model with state slots (its steps have one per sequence)."""
    if step.ints["state_slots"]:
        step.ints["state_slots"] += [-1] * num_padding


def upload_capacity(max_num_tokens: int, max_num_seqs: int, block_size: int) -> tuple[int, int]:
    """(int64s, float32s) that a step of up to ``max_num_tokens`` tokens and ``max_num_seqs``
    sequences needs in its upload (a graph's padding included), bar banned token ids and
    grammar bitmasks, which vary with the requests. Slots start this large: growing one
    waits for the device, which in a timed run made a mixed step's launch take tens of
    milliseconds."""
    num_seq_slots = max_num_seqs + 1  # a varlen graph's padding sequence
    # each request's new blocks: those its tokens fill, and one it starts
    num_updates = max_num_tokens // block_size + 2 * max_num_seqs
    lengths = {
        "token_ids": max_num_tokens, "positions": max_num_tokens,
        "slot_mapping": max_num_tokens, "context_lens": num_seq_slots,
        "state_slots": num_seq_slots, "query_start_loc": num_seq_slots + 1,
        "table_rows": num_seq_slots,
        "logits_indices": max_num_seqs, "update_indices": num_updates,
        "update_block_ids": num_updates, "top_ks": max_num_seqs, "seed_keys": max_num_seqs,
        "output_indices": max_num_seqs, "bitmask_rows": max_num_seqs}
    assert set(lengths) <= set(INT_SEGMENTS)
    num_ints = sum(aligned(length) for length in lengths.values())
    return num_ints + SEGMENT_ALIGNMENT * len(INT_SEGMENTS), aligned(max_num_seqs) * 3


@dataclass(slots=True)
class InputSlot:
    """Pinned host and device buffers for one step in flight, and the events guarding them.
    ``host_floats`` and ``device_floats`` are float32 views of the int64 buffers: a step's
    float segments follow its int ones, and one copy uploads both."""

    index: int
    host_ints: torch.Tensor
    host_floats: torch.Tensor
    device_ints: torch.Tensor
    device_floats: torch.Tensor
    host_sampled: torch.Tensor
    upload_done: Event | None = None
    compute_done: Event | None = None
    download_done: Event | None = None


def new_slot(index: int, device: torch.device, num_ints: int, num_floats: int,
             num_sampled: int) -> InputSlot:
    pin = device.type == "cuda"

    def host(size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, pin_memory=pin)

    def on_device(size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, device=device)

    num_words = num_ints + (num_floats + 1) // 2
    host_ints, device_ints = host(num_words, torch.int64), on_device(num_words, torch.int64)
    return InputSlot(index=index, host_ints=host_ints,
                     host_floats=host_ints.view(torch.float32),
                     device_ints=device_ints, device_floats=device_ints.view(torch.float32),
                     host_sampled=host(num_sampled, torch.int64))


class Segments:
    """Views into a flat device buffer by segment name."""

    def __init__(self, buffer: torch.Tensor, offsets: dict[str, tuple[int, int]]) -> None:
        self._buffer = buffer
        self._offsets = offsets

    def __getitem__(self, name: str) -> torch.Tensor:
        start, length = self._offsets[name]
        return self._buffer[start:start + length]

    def length(self, name: str) -> int:
        return self._offsets[name][1]

    def offset(self, name: str) -> tuple[int, int]:
        """(start, length) of a segment in ``buffer``."""
        return self._offsets[name]

    @property
    def buffer(self) -> torch.Tensor:
        return self._buffer


def offsets(lengths: dict[str, int], start: int = 0) -> dict[str, tuple[int, int]]:
    """(start, length) of each segment from ``start`` on, starts aligned."""
    result: dict[str, tuple[int, int]] = {}
    for name, length in lengths.items():
        result[name] = (start, length)
        start += aligned(length)
    return result


def aligned(length: int) -> int:
    return -(-length // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT


def end(segment_offsets: dict[str, tuple[int, int]]) -> int:
    return max((start + length for start, length in segment_offsets.values()), default=0)


def layout(int_lengths: dict[str, int], float_lengths: dict[str, int]
           ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]], int]:
    """Offsets of the int64 segments, of the float32 ones (in float32 elements of the
    same buffer, after the ints), and the int64 words the upload copies."""
    int_offsets = offsets(int_lengths)
    num_int_words = aligned(end(int_offsets))
    float_offsets = offsets(float_lengths, 2 * num_int_words)
    num_float_values = end(float_offsets) - 2 * num_int_words
    return int_offsets, float_offsets, num_int_words + (max(num_float_values, 0) + 1) // 2


def fill(target: np.ndarray, segment_offsets: dict[str, tuple[int, int]],
         values: dict[str, list[Any]],
         inserts: dict[str, list[tuple[int, np.ndarray]]] | None = None) -> None:
    """Write each segment at its offset; ``inserts`` (HostStep.inserts) go in between
    the list's items."""
    for name, (start, length) in segment_offsets.items():
        if not length:
            continue
        pieces = inserts.get(name) if inserts else None
        if not pieces:
            target[start:start + length] = as_array(values[name], target.dtype)
            continue
        items, position, taken = values[name], start, 0
        for index, array in pieces:
            target[position:position + index - taken] = items[taken:index]
            position += index - taken
            target[position:position + len(array)] = array
            position += len(array)
            taken = index
        target[position:start + length] = items[taken:]


# Past this many values an int list goes into the upload through the array module: its
# conversion costs about half of NumPy's from a list (8,192 token ids: 223 -> 121 us on
# the development machine); below about a thousand NumPy's is as fast or faster.
MIN_ARRAY_CONVERSION = 1024


def as_array(values: Any, dtype: np.dtype) -> Any:
    """``values`` ready to assign into an int64 segment: long int lists as an array."""
    if dtype == np.int64 and isinstance(values, list) and len(values) >= MIN_ARRAY_CONVERSION:
        return np.frombuffer(typed_array("q", values), dtype=np.int64)
    return values
