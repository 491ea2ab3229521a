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
from trio_llm.gpu.model import AttentionMetadata, CausalLM, KVCache
from trio_llm.gpu.step_packing import Segments

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
        with lane.context(), torch.inference_mode():
            forward()  # compiles and loads the kernels outside the capture
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=lane.torch_stream):
                self.logits = forward()

    def replay(self) -> torch.Tensor:
        """The logits; a graph's buffer is rewritten by its next replay."""
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class DecodeGraphs:
    """Decode steps by batch size; static inputs [4, max_batch]: token ids, positions,
    slots, context lengths (a decode step's first four segments)."""

    def __init__(self, model: CausalLM, kv_caches: list[KVCache], max_batch: int,
                 max_blocks_per_seq: int) -> None:
        device = model.device
        self._model, self._kv_caches = model, kv_caches
        self.per_token = torch.zeros((4, max_batch), dtype=torch.int64, device=device)
        self.per_token[2].fill_(-1)  # slot -1: padding writes nothing
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32,
                                        device=device)
        self.graphs: dict[int, CapturedStep] = {}

    def batch_size_for(self, num_seqs: int) -> int | None:
        return next((size for size in sorted(self.graphs) if size >= num_seqs), None)

    def capture(self, batch_size: int, lane: Lane, pool: Any) -> None:
        self.graphs[batch_size] = CapturedStep(lambda: self._forward(batch_size), lane, pool)

    def _forward(self, batch_size: int) -> torch.Tensor:
        token_ids, positions, slot_mapping, context_lens = self.per_token[:, :batch_size]
        metadata = AttentionMetadata(slot_mapping=slot_mapping,
                                     block_tables=self.block_tables[:batch_size],
                                     context_lens=context_lens,
                                     query_start_loc=self.query_start_loc[:batch_size + 1])
        hidden = self._model(token_ids, positions, self._kv_caches, metadata)
        return self._model.compute_logits(hidden)

    def load(self, batch_size: int, ints: Segments, block_table: torch.Tensor) -> torch.Tensor:
        """Copy a padded decode step's inputs in; returns the static token ids."""
        self.per_token[:, :batch_size].copy_(ints.leading_rows(4))
        torch.index_select(block_table, 0, ints["table_rows"],
                           out=self.block_tables[:batch_size])
        return self.per_token[0, :batch_size]


class VarlenGraphs:
    """Steps with prefill tokens by token count; static inputs: [3, max_tokens] token
    ids, positions, slots, and per sequence slot its context length, query start,
    block-table row, and per logits row the token it reads."""

    def __init__(self, model: CausalLM, kv_caches: list[KVCache], max_tokens: int,
                 max_num_seqs: int, max_blocks_per_seq: int) -> None:
        device = model.device
        self._model, self._kv_caches = model, kv_caches
        self.max_num_seqs = max_num_seqs
        max_seq_slots = max_num_seqs + 1

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.per_token = zeros(3, max_tokens)
        self.per_token[2].fill_(-1)
        self.context_lens = zeros(max_seq_slots)
        self.query_start_loc = zeros(max_seq_slots + 1)
        self.logits_indices = zeros(max_num_seqs)
        self.block_tables = zeros(max_seq_slots, max_blocks_per_seq, dtype=torch.int32)
        self.graphs: dict[int, CapturedStep] = {}

    def num_seq_slots(self, num_tokens: int) -> int:
        """Sequence slots of the graph of ``num_tokens`` tokens: one more than it can
        have sequences (the padding sequence that owns the padding tokens)."""
        return min(num_tokens, self.max_num_seqs) + 1

    def num_tokens_for(self, num_tokens: int, num_seqs: int) -> int | None:
        if num_seqs > self.max_num_seqs:
            return None
        return next((size for size in sorted(self.graphs) if size >= num_tokens), None)

    def capture(self, num_tokens: int, lane: Lane, pool: Any) -> None:
        # an empty step: every sequence slot empty, the last one owning every token
        self.query_start_loc[self.num_seq_slots(num_tokens)] = num_tokens
        self.graphs[num_tokens] = CapturedStep(lambda: self._forward(num_tokens), lane, pool)

    def _forward(self, num_tokens: int) -> torch.Tensor:
        num_slots = self.num_seq_slots(num_tokens)
        token_ids, positions, slot_mapping = self.per_token[:, :num_tokens]
        metadata = AttentionMetadata(slot_mapping=slot_mapping,
                                     block_tables=self.block_tables[:num_slots],
                                     context_lens=self.context_lens[:num_slots],
                                     query_start_loc=self.query_start_loc[:num_slots + 1])
        hidden = self._model(token_ids, positions, self._kv_caches, metadata)
        return self._model.compute_logits(
            hidden.index_select(0, self.logits_indices[:num_slots - 1]))

    def load(self, num_tokens: int, ints: Segments, block_table: torch.Tensor) -> torch.Tensor:
        """Copy a padded step's inputs in; returns the static token ids."""
        num_slots = self.num_seq_slots(num_tokens)
        self.per_token[:, :num_tokens].copy_(ints.leading_rows(3))
        self.context_lens[:num_slots].copy_(ints["context_lens"])
        self.query_start_loc[:num_slots + 1].copy_(ints["query_start_loc"])
        self.logits_indices[:num_slots - 1].copy_(ints["logits_indices"])
        torch.index_select(block_table, 0, ints["table_rows"], out=self.block_tables[:num_slots])
        return self.per_token[0, :num_tokens]
