"""Pooling: an embedding request's vector from the hidden states of its prompt.

The executor hands over, for each step, the rows of its embedding requests'
chunks (``PoolingChunk``): the hidden states after the model's final norm, as
transformers' ``last_hidden_state``. Last-token pooling takes the final prompt
token's row, in the last chunk. Mean pooling adds every chunk's rows to the
request's running sum (``MeanPool``, kept by the executor between steps), so a
prompt prefilled in several chunks pools what it would in one. Then the vector
is cut to ``dimensions`` (Matryoshka) and L2-normalised, in float32, and leaves
as float32 little-endian bytes (no tensor crosses a channel).

The sum is float64 and, on the CPU, added one row after another (a cumulative
sum runs in row order there): the same additions in the same order however the
prompt was chunked, so chunked and unchunked prefills give the same bits. On
CUDA each chunk is summed in parallel, which changes low float64 bits only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from trio_llm.actors.messages import PooledOutput, PoolingOptions, ScheduledRequest


class MeanPool:
    """The running sum of one mean-pooled request's hidden states, over its chunks."""

    __slots__ = ("total", "num_rows")

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.num_rows = 0

    def add(self, rows: torch.Tensor) -> None:
        self.num_rows += rows.shape[0]
        rows = rows.to(torch.float64)
        if rows.device.type != "cpu":
            # a parallel sum: chunking changes its low float64 bits only
            chunk_total = rows.sum(dim=0)
            self.total = chunk_total if self.total is None else self.total + chunk_total
            return
        if self.total is not None:
            rows = torch.cat([self.total.unsqueeze(0), rows])
        self.total = rows.cumsum(dim=0)[-1]  # row after row, whatever the chunks

    def mean(self) -> torch.Tensor:
        assert self.total is not None and self.num_rows > 0, "a chunk was added"
        return (self.total / self.num_rows).to(torch.float32)


def new_mean_pool(pooling: PoolingOptions | None) -> MeanPool | None:
    """An empty sum for a request that pools the mean; None for any other."""
    return MeanPool() if pooling is not None and pooling.pooling_type == "mean" else None


@dataclass(slots=True)
class PoolingChunk:
    """One embedding request's rows in a step's hidden states: ``start`` to ``end - 1``.
    ``is_last``: its prompt's last chunk, which gives the vector. ``mean_pool`` (mean
    pooling) is the request's sum so far."""

    request_id: str
    options: PoolingOptions
    start: int
    end: int
    is_last: bool
    mean_pool: MeanPool | None = None


def pooling_chunk(scheduled: ScheduledRequest, options: PoolingOptions,
                  mean_pool: MeanPool | None, start: int) -> PoolingChunk | None:
    """The chunk of an embedding request starting at row ``start`` of the step, if it
    is pooled from: every chunk of a mean-pooled request, the last of any other."""
    if mean_pool is None and not scheduled.pool:
        return None
    return PoolingChunk(scheduled.request_id, options, start, start + len(scheduled.token_ids),
                        scheduled.pool, mean_pool)


def pool(hidden: torch.Tensor, chunks: list[PoolingChunk]) -> list[PooledOutput]:
    """``pooled_vectors`` as the StepResult carries them."""
    return [pooled_output(request_id, vector)
            for request_id, vector in pooled_vectors(hidden, chunks)]


def pooled_vectors(hidden: torch.Tensor, chunks: list[PoolingChunk]
                   ) -> list[tuple[str, torch.Tensor]]:
    """(request id, vector) of each request whose last chunk is in ``hidden``, in chunk
    order, on the device (enqueued on the current stream); every mean-pooled chunk is
    added to its request's sum first."""
    vectors = []
    for chunk in chunks:
        if chunk.mean_pool is not None:
            chunk.mean_pool.add(hidden[chunk.start:chunk.end])
            if chunk.is_last:
                vectors.append((chunk.request_id, _finished(chunk, chunk.mean_pool.mean())))
        elif chunk.is_last:
            vectors.append((chunk.request_id,
                            _finished(chunk, hidden[chunk.end - 1].to(torch.float32))))
    return vectors


def _finished(chunk: PoolingChunk, vector: torch.Tensor) -> torch.Tensor:
    """Cut to ``dimensions``, then normalised: vLLM's order (and sentence-transformers')."""
    options = chunk.options
    if options.dimensions is not None:
        vector = vector[:options.dimensions]
    if options.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector


def pooled_output(request_id: str, vector: torch.Tensor) -> PooledOutput:
    """A vector as float32 little-endian bytes (waits for the device if it is there)."""
    data = vector.cpu().numpy().astype(np.dtype("<f4"), copy=False).tobytes()
    return PooledOutput(request_id=request_id, data=data)
