"""Penalties, logit bias and allowed tokens: the logit changes that come before sampling.

Penalties as vLLM defines them (its ``apply_penalties``), in this order on float32
logits, for the tokens a request has seen:

1. ``repetition_penalty`` r, over the prompt and the output: a seen token's logit
   is multiplied by ``1 / r`` where it is positive, by ``r`` where it is not;
2. ``frequency_penalty`` f, over the output: minus ``f * count``;
3. ``presence_penalty`` p, over the output: minus ``p`` if the count is not 0.

The counts live on the logits' device, in ``PenaltyCounts``: one row of int32
output counts and one of int8 prompt presence per running request that has a
penalty, so a step never needs the host to know the token sampled the step before
(depth 2). The executor fills a row when the request starts (its prompt, and the
output a recomputed request already has) and adds each token it samples after
that, on the device, right after sampling it. Rows are taken only by requests
with a penalty, so an engine that never sees one allocates nothing; the pool
doubles as needed and is at most one row per running request (with 256 running
on a 151,936-token vocabulary, 5 bytes per token: 194 MB).

Every function here is plain torch ops on any device; the fused Triton kernel
(gpu/kernels/triton_sampling.py) computes the penalties in registers with the same float32
operations in the same order, so both give the same bits.
"""

from __future__ import annotations

import torch


class PenaltyCounts:
    """The token counts of the requests with penalties, one pool row each."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros((0, vocab_size), dtype=torch.int8, device=device)
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []

    @property
    def num_slots(self) -> int:
        return self.output_counts.shape[0]

    def slot(self, request_id: str) -> int:
        """The request's pool row; -1 for a request without penalties."""
        return self._slots.get(request_id, -1)

    def register(self, request_id: str, prompt_token_ids: torch.Tensor,
                 output_token_ids: torch.Tensor) -> int:
        """Take a row for a request and fill it: ``prompt_token_ids`` (empty without a
        repetition penalty) and the output it already has, int64 on the pool's device.
        On CUDA call it on the stream that samples: it is ordered with the sampling."""
        self.release(request_id)
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self._slots[request_id] = slot
        self.output_counts[slot].zero_()
        self.prompt_seen[slot].zero_()
        if prompt_token_ids.numel():
            self.prompt_seen[slot].index_fill_(0, prompt_token_ids, 1)
        if output_token_ids.numel():
            ones = torch.ones_like(output_token_ids, dtype=torch.int32)
            self.output_counts[slot].index_put_((output_token_ids,), ones, accumulate=True)
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per row: ``slots`` distinct (one row per request)."""
        if slots.numel():
            self.output_counts[slots, token_ids] += 1

    def _grow(self) -> None:
        old_size = self.num_slots
        new_size = max(4, 2 * old_size)
        output_counts = torch.zeros((new_size, self.vocab_size), dtype=torch.int32,
                                    device=self.device)
        prompt_seen = torch.zeros((new_size, self.vocab_size), dtype=torch.int8,
                                  device=self.device)
        output_counts[:old_size].copy_(self.output_counts)
        prompt_seen[:old_size].copy_(self.prompt_seen)
        self.output_counts, self.prompt_seen = output_counts, prompt_seen
        self._free_slots = list(range(new_size - 1, old_size - 1, -1)) + self._free_slots


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                    presences: torch.Tensor, frequencies: torch.Tensor,
                    repetitions: torch.Tensor, counts: PenaltyCounts) -> torch.Tensor:
    """``logits`` (a copy) with the penalties of ``rows`` applied; ``slots`` their pool
    rows, ``presences``, ``frequencies``, ``repetitions`` float32 per row of ``rows``."""
    output_counts = counts.output_counts.index_select(0, slots)
    in_output = output_counts > 0
    seen = in_output | (counts.prompt_seen.index_select(0, slots) != 0)
    selected = logits.index_select(0, rows)
    penalty = torch.where(seen, repetitions.unsqueeze(1), 1.0)
    scaling = torch.where(selected > 0, 1.0 / penalty, penalty)
    selected = selected * scaling
    selected = selected - frequencies.unsqueeze(1) * output_counts.to(torch.float32)
    selected = selected - presences.unsqueeze(1) * in_output.to(torch.float32)
    return logits.index_copy(0, rows, selected)


def add_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                   values: torch.Tensor) -> torch.Tensor:
    """``logits`` (a copy) plus ``values`` at (``rows``, ``token_ids``): pairs distinct."""
    biased = logits.clone()
    biased[rows, token_ids] = logits[rows, token_ids] + values
    return biased


def keep_allowed_tokens(logits: torch.Tensor, rows: torch.Tensor, local_rows: torch.Tensor,
                        token_ids: torch.Tensor) -> torch.Tensor:
    """``logits`` (a copy) with every token of ``rows`` at -inf but the allowed ones:
    (``local_rows``, ``token_ids``) pairs, ``local_rows`` indexing into ``rows``."""
    allowed = torch.zeros((rows.shape[0], logits.shape[1]), dtype=torch.bool,
                          device=logits.device)
    allowed[local_rows, token_ids] = True
    kept = logits.clone()
    kept[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return kept
