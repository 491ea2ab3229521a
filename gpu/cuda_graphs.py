"""CUDA graphs of whole steps: the forward and the logits of one step, replayed.

Two families, captured at start-up (largest first, into one memory pool):

- decode graphs, one per batch size (``DECODE_BATCH_SIZES``): one token per
  sequence, so the attention takes the decode kernel (split-KV for small batches);
- varlen graphs, one per token count (``VARLEN_GRAPH_TOKENS``), for every other
  step (prefill chunks and decode rows together): the attention takes the varlen
  kernel, whose grid depends on the token and sequence counts only. A graph of
  ``num_tokens`` tokens has ``min(num_tokens, max_num_seqs) + 1`` sequence slots:
  the step's sequences, then padding sequences, the last owning the padding tokens
  (gpu/step_packing.py); its logits cover ``min(num_tokens, max_num_seqs)`` rows.

Each family reads static device buffers that a step's inputs are copied into
before its replay. On the CPU nothing is captured: a "graph" runs the same
function on the same padded buffers eagerly, so the padding is tested in CI.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trio_llm.gpu.cuda_streams import Lane
from trio_llm.gpu.models.base import CausalLM, LayerCache, StateCache
from trio_llm.gpu.models.cuda_hybrid import CudaStepMetadata
from trio_llm.gpu.step_packing import INT_SEGMENTS, Segments, end, offsets

# Decode batch sizes that get a CUDA graph; a decode step runs the smallest that fits.
DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                      320, 384, 448, 512)
# Token counts that get a varlen graph (multiples of 16: the upload's alignment, and
# no ragged last tile in the matmuls); a step runs the smallest that fits. Steps of a
# few hundred tokens (decodes plus a prompt or two) are where the host's launch cost
# is largest against the device's work, so they are spaced closest.
VARLEN_GRAPH_TOKENS = (16, 32, 64, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536,
                       2048, 2560, 3072, 4096, 5120, 6144, 8192)


@contextmanager
def no_garbage_collection() -> Iterator[None]:
    """Collect now, then not until the block ends. A collection inside a capture can
    free what unreachable objects held (an earlier executor's pinned buffers and their
    events): CUDA calls that invalidate the capture, so a graph failed to capture
    depending on what ran before it in the process."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CapturedStep:
    """``forward`` (which returns logits) captured as one graph on ``lane``'s stream;
    on the CPU, kept and run eagerly."""

    def __init__(self, forward: Callable[[], torch.Tensor], lane: Lane, pool: Any) -> None:
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._forward = forward
        if lane.torch_stream is None:
            return
        lane.torch_stream.wait_stream(torch.cuda.current_stream())  # the static inputs' setup
        with lane.context(), torch.inference_mode():
            forward()  # compiles and loads the kernels outside the capture
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=lane.torch_stream):
                self.logits = forward()
            # the first launch of a graph uploads it to the device (milliseconds for a
            # whole forward): at start-up, not in the first step that replays it
            self.graph.replay()
        # The next capture rewrites the static inputs, in its own size's layout, from the
        # host's stream: this replay must have read them by then (a replay still running
        # would read the next size's -1 slots as its positions or context lengths: the
        # likely cause of an illegal memory access seen once at qwen3-8b's start-up).
        lane.torch_stream.synchronize()

    def replay(self) -> torch.Tensor:
        """The logits; a graph's buffer is rewritten by its next replay."""
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        assert self.logits is not None
        return self.logits


def with_previous_tokens(token_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """``token_ids`` with each negative id ``-1 - i`` replaced by ``sampled.view(-1)[i]``:
    the token a step still in flight sampled (the executor's [slot, row] ids on the
    device). Inside a graph this costs the host nothing; eagerly, a few launches."""
    previous = sampled.view(-1).index_select(0, (-1 - token_ids).clamp(min=0))
    return torch.where(token_ids < 0, previous, token_ids)


class StaticInputs:
    """The leading int64 segments of a graph step's upload (step_packing.INT_SEGMENTS
    from the first on), laid out as the upload lays them out for that graph's sizes,
    in one static device buffer: loading a step is one copy of its upload's start."""

    def __init__(self, max_lengths: dict[str, int], device: torch.device) -> None:
        self.buffer = torch.zeros(end(offsets(max_lengths)), dtype=torch.int64, device=device)
        self._layouts: dict[int, dict[str, tuple[int, int]]] = {}

    def views(self, size: int, lengths: dict[str, int]) -> Segments:
        """Views of the graph of ``size`` (its segments' ``lengths``, in upload order)."""
        assert tuple(lengths) == INT_SEGMENTS[:len(lengths)]
        self._layouts[size] = offsets(lengths)
        return Segments(self.buffer, self._layouts[size])

    def segments(self, size: int) -> Segments:
        """The views of a captured size (benchmarks fill them directly)."""
        return Segments(self.buffer, self._layouts[size])

    def load(self, size: int, ints: Segments) -> None:
        segment_offsets = self._layouts[size]
        assert all(ints.offset(name) == offset for name, offset in segment_offsets.items())
        num_words = end(segment_offsets)
        self.buffer[:num_words].copy_(ints.buffer[:num_words])


def has_state_slots(caches: list[LayerCache]) -> bool:
    """Whether the model has linear-attention layers (its steps carry state slots)."""
    return any(isinstance(cache, StateCache) for cache in caches)


class DecodeGraphs:
    """Decode steps by batch size; static inputs: token ids, positions, slots, context
    lengths and, for a model with linear-attention layers, state slots (a decode step's
    first five segments, all of the batch size; the last empty for other models)."""

    def __init__(self, model: CausalLM, kv_caches: list[LayerCache], max_batch: int,
                 max_blocks_per_seq: int, sampled: torch.Tensor) -> None:
        device = model.device
        self._model, self._kv_caches, self._sampled = model, kv_caches, sampled
        self.has_state_slots = has_state_slots(kv_caches)
        self.inputs = StaticInputs(self._lengths(max_batch), device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32,
                                        device=device)
        self.graphs: dict[int, CapturedStep] = {}

    def _lengths(self, batch_size: int) -> dict[str, int]:
        lengths = dict.fromkeys(INT_SEGMENTS[:5], batch_size)
        lengths["state_slots"] = batch_size if self.has_state_slots else 0
        return lengths

    def batch_size_for(self, num_seqs: int) -> int | None:
        return next((size for size in sorted(self.graphs) if size >= num_seqs), None)

    def capture(self, batch_size: int, lane: Lane, pool: Any) -> None:
        views = self.inputs.views(batch_size, self._lengths(batch_size))
        # an empty step (what a larger size's capture left there would be read as one)
        self.inputs.buffer.zero_()
        views["slot_mapping"].fill_(-1)  # slot -1: writes nothing
        views["state_slots"].fill_(-1)  # nor into a state slot
        self.graphs[batch_size] = CapturedStep(lambda: self._forward(batch_size, views),
                                               lane, pool)

    def _forward(self, batch_size: int, views: Segments) -> torch.Tensor:
        metadata = CudaStepMetadata(
            slot_mapping=views["slot_mapping"], block_tables=self.block_tables[:batch_size],
            context_lens=views["context_lens"],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            state_slot_ids=views["state_slots"] if self.has_state_slots else None,
            is_decode=True)
        token_ids = with_previous_tokens(views["token_ids"], self._sampled)
        hidden = self._model(token_ids, views["positions"], self._kv_caches, metadata)
        return self._model.compute_logits(hidden)

    def load(self, batch_size: int, ints: Segments, block_table: torch.Tensor) -> None:
        """Copy a padded decode step's inputs in."""
        self.inputs.load(batch_size, ints)
        torch.index_select(block_table, 0, ints["table_rows"],
                           out=self.block_tables[:batch_size])


class VarlenGraphs:
    """Steps with prefill tokens by token count; static inputs: token ids, positions,
    slots, and per sequence slot its context length, state slot (a model with
    linear-attention layers; empty otherwise), query start, block-table row, and per
    logits row the token it reads (a padded step's first eight segments)."""

    def __init__(self, model: CausalLM, kv_caches: list[LayerCache], max_tokens: int,
                 max_num_seqs: int, max_blocks_per_seq: int, sampled: torch.Tensor) -> None:
        device = model.device
        self._model, self._kv_caches, self._sampled = model, kv_caches, sampled
        self.has_state_slots = has_state_slots(kv_caches)
        self.max_num_seqs = max_num_seqs
        self.inputs = StaticInputs(self._lengths(max_tokens, max_num_seqs + 1), device)
        self.block_tables = torch.zeros((max_num_seqs + 1, max_blocks_per_seq),
                                        dtype=torch.int32, device=device)
        self.graphs: dict[int, CapturedStep] = {}

    def _lengths(self, num_tokens: int, num_slots: int) -> dict[str, int]:
        return {"token_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
                "context_lens": num_slots,
                "state_slots": num_slots if self.has_state_slots else 0,
                "query_start_loc": num_slots + 1, "table_rows": num_slots,
                "logits_indices": num_slots - 1}

    def num_seq_slots(self, num_tokens: int) -> int:
        """Sequence slots of the graph of ``num_tokens`` tokens: one more than it can
        have sequences (the padding sequence that owns the padding tokens)."""
        return min(num_tokens, self.max_num_seqs) + 1

    def num_tokens_for(self, num_tokens: int, num_seqs: int) -> int | None:
        if num_seqs > self.max_num_seqs:
            return None
        return next((size for size in sorted(self.graphs) if size >= num_tokens), None)

    def capture(self, num_tokens: int, lane: Lane, pool: Any) -> None:
        num_slots = self.num_seq_slots(num_tokens)
        views = self.inputs.views(num_tokens, self._lengths(num_tokens, num_slots))
        self.inputs.buffer.zero_()
        views["slot_mapping"].fill_(-1)
        views["state_slots"].fill_(-1)
        # an empty step: every sequence slot empty, the last one owning every token
        views["query_start_loc"][num_slots] = num_tokens
        self.graphs[num_tokens] = CapturedStep(lambda: self._forward(num_slots, views),
                                               lane, pool)

    def _forward(self, num_slots: int, views: Segments) -> torch.Tensor:
        metadata = CudaStepMetadata(
            slot_mapping=views["slot_mapping"], block_tables=self.block_tables[:num_slots],
            context_lens=views["context_lens"], query_start_loc=views["query_start_loc"],
            state_slot_ids=views["state_slots"] if self.has_state_slots else None)
        token_ids = with_previous_tokens(views["token_ids"], self._sampled)
        hidden = self._model(token_ids, views["positions"], self._kv_caches, metadata)
        return self._model.compute_logits(hidden.index_select(0, views["logits_indices"]))

    def load(self, num_tokens: int, ints: Segments, block_table: torch.Tensor) -> None:
        """Copy a padded step's inputs in."""
        self.inputs.load(num_tokens, ints)
        torch.index_select(block_table, 0, ints["table_rows"],
                           out=self.block_tables[:self.num_seq_slots(num_tokens)])
