"""A scheduler stand-in that drives a ModelExecutor directly, for tests and experiments.

It builds ScheduledBatch messages by hand: every running request takes part in
every step (prefill chunks and decodes mixed), prompts are split into chunks by
a per-request plan, block ids come from a shuffled free list, and requests can
arrive late or be preempted and recomputed; a model with linear-attention layers
gets each registered request a state slot from a free list (given back when it
finishes or is preempted). Nothing here is the engine's real scheduling policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import torch

from trio_llm.actors.messages import (
    NewRequestData,
    SamplingOptions,
    ScheduledBatch,
    ScheduledRequest,
    StepResult,
    TokenLogprobs,
)
from trio_llm.gpu.cuda_sampler import DeviceSamplingInputs, SamplingPlan
from trio_llm.gpu.executor import ModelExecutor

GREEDY = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                         num_logprobs=None, min_tokens=0, banned_token_ids=[])

DecodeInput = Literal["explicit", "previous_step"]


@dataclass(slots=True)
class DriverRequest:
    """One request as the driver tracks it. ``chunk_sizes`` is the prefill plan: the
    sizes of successive chunks (the last one repeats); decodes are one token."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingOptions = GREEDY
    chunk_sizes: list[int] = field(default_factory=lambda: [1 << 30])
    arrival_step: int = 0
    preempt_at_steps: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    num_chunks: int = 0
    is_registered: bool = False
    sampled_last_step: bool = False

    @property
    def known_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens


class ExecutorDriver:
    """Runs requests to completion on an executor, one ScheduledBatch per step."""

    def __init__(self, executor: ModelExecutor, *, seed: int = 0,
                 decode_input: DecodeInput = "explicit") -> None:
        self.executor = executor
        self.decode_input = decode_input
        self.free_block_ids = list(range(executor.num_kv_blocks))
        random.Random(seed).shuffle(self.free_block_ids)
        # every state slot serves running requests: the driver keeps no snapshots
        self.free_state_slots = list(range(getattr(executor, "num_state_slots", 0)))
        random.Random(seed).shuffle(self.free_state_slots)
        self.step_id = 0
        self.finished_request_ids: list[str] = []
        self.results: list[StepResult] = []

    def run(self, requests: Sequence[DriverRequest]) -> list[DriverRequest]:
        """Step until every request finished; returns them with their outputs filled."""
        while not all(request.is_finished for request in requests):
            self.step(requests)
        return list(requests)

    def step(self, requests: Sequence[DriverRequest]) -> StepResult:
        """Preempt the requests due this step, then run one step of every active request."""
        self._preempt_due(requests)
        active = [request for request in requests
                  if request.arrival_step <= self.step_id and not request.is_finished]
        new_requests = [NewRequestData(request_id=request.request_id, sampling=request.sampling,
                                       state_slot=self._take_state_slot(request))
                        for request in active if not request.is_registered]
        scheduled = [self._schedule(request) for request in active]
        batch = ScheduledBatch(step_id=self.step_id, new_requests=new_requests,
                               requests=scheduled, finished_request_ids=self.finished_request_ids,
                               num_tokens=sum(_num_input_tokens(item) for item in scheduled))
        self.finished_request_ids = []
        result = self.executor.execute(batch)
        self._apply(active, scheduled, result)
        self.step_id += 1
        self.results.append(result)
        return result

    def _preempt_due(self, requests: Sequence[DriverRequest]) -> None:
        """Free the blocks of requests preempted at this step: they recompute from scratch."""
        for request in requests:
            if self.step_id in request.preempt_at_steps and request.is_registered:
                self._release(request)
                request.num_computed_tokens = 0

    def _schedule(self, request: DriverRequest) -> ScheduledRequest:
        request.is_registered = True
        known = request.known_token_ids
        start = request.num_computed_tokens
        is_decode = start == len(known) - 1 and bool(request.output_token_ids)
        chunk_size = 1 if is_decode else self._next_chunk_size(request)
        token_ids = known[start:start + chunk_size]
        end = start + len(token_ids)
        from_previous_step = (is_decode and request.sampled_last_step
                              and self.decode_input == "previous_step")
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=[] if from_previous_step else token_ids,
            input_from_previous_step=from_previous_step,
            num_computed_tokens=start,
            new_block_ids=self._allocate(request, end),
            sample=end == len(known),
            output_index=len(request.output_token_ids),
        )

    def _take_state_slot(self, request: DriverRequest) -> int | None:
        if self.free_state_slots:
            request.state_slot = self.free_state_slots.pop()
        return request.state_slot

    @staticmethod
    def _next_chunk_size(request: DriverRequest) -> int:
        plan = request.chunk_sizes
        size = plan[min(request.num_chunks, len(plan) - 1)]
        request.num_chunks += 1
        return size

    def _allocate(self, request: DriverRequest, num_tokens: int) -> list[int]:
        block_size = self.executor.block_size
        num_needed = -(-num_tokens // block_size) - len(request.block_ids)
        new_block_ids = [self.free_block_ids.pop() for _ in range(num_needed)]
        request.block_ids += new_block_ids
        return new_block_ids

    def _release(self, request: DriverRequest) -> None:
        self.free_block_ids += request.block_ids
        request.block_ids = []
        if request.state_slot is not None:
            self.free_state_slots.append(request.state_slot)
            request.state_slot = None
        request.is_registered = False
        request.num_chunks = 0
        self.finished_request_ids.append(request.request_id)

    def _apply(self, active: list[DriverRequest], scheduled: list[ScheduledRequest],
               result: StepResult) -> None:
        sampled = dict(zip(result.request_ids, result.sampled_token_ids, strict=True))
        logprobs = dict(zip(result.request_ids, result.logprobs or [], strict=False))
        for request, item in zip(active, scheduled, strict=True):
            request.num_computed_tokens += _num_input_tokens(item)
            request.sampled_last_step = item.request_id in sampled
            if item.request_id in sampled:
                request.output_token_ids.append(sampled[item.request_id])
                request.logprobs.append(logprobs.get(item.request_id))
            if request.is_finished:
                self._release(request)


def _num_input_tokens(scheduled: ScheduledRequest) -> int:
    """A request with no explicit tokens takes one: the token sampled for it last step."""
    return len(scheduled.token_ids) or 1


def record_logits(executor: ModelExecutor) -> dict[tuple[str, int], torch.Tensor]:
    """From now on, keep the logits of every sampled row of ``executor``, keyed by
    (request id, output index). Wraps the instance's methods; nothing else changes."""
    recorded: dict[tuple[str, int], torch.Tensor] = {}
    execute, compute_logits = executor.execute, executor.model.compute_logits
    sampled_now: list[ScheduledRequest] = []

    def recording_execute(batch: ScheduledBatch) -> StepResult:
        sampled_now[:] = [request for request in batch.requests if request.sample]
        return execute(batch)

    def recording_compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        for request, row in zip(sampled_now, logits, strict=True):
            recorded[(request.request_id, request.output_index)] = row.clone()
        return logits

    executor.execute = recording_execute  # type: ignore[method-assign]
    executor.model.compute_logits = recording_compute_logits  # type: ignore[method-assign]
    return recorded


def run_depth_1(executor: ModelExecutor, batches: Sequence[ScheduledBatch]) -> list[StepResult]:
    """Each step executed and collected before the next."""
    return [executor.execute(batch) for batch in batches]


def with_bitmasks_following(batches: Sequence[ScheduledBatch]) -> list[ScheduledBatch]:
    """``batches`` with each decode row's grammar mask taken out, to follow its step."""
    return [msgspec.structs.replace(batch, requests=[
        msgspec.structs.replace(scheduled, token_bitmask=None, bitmask_follows=True)
        if scheduled.token_bitmask is not None and scheduled.input_from_previous_step
        else scheduled for scheduled in batch.requests]) for batch in batches]


def run_with_bitmasks_following(executor: Any, batches: Sequence[ScheduledBatch]
                                ) -> list[StepResult]:
    """``run_depth_2`` of ``with_bitmasks_following(batches)``, each step's masks supplied
    after it launched, as the scheduler's StepBitmasks come."""
    results, previous = [], None
    for batch, with_masks in zip(with_bitmasks_following(batches), batches, strict=True):
        pending = executor.launch(batch)
        if previous is not None:
            results.append(executor.collect(previous))
        follows = [original.token_bitmask or b"" for scheduled, original in
                   zip(batch.requests, with_masks.requests, strict=True)
                   if scheduled.bitmask_follows]
        if follows:
            executor.supply_bitmasks(pending, follows)
        previous = pending
    results.append(executor.collect(previous))
    return results


def run_depth_2(executor: Any, batches: Sequence[ScheduledBatch]) -> list[StepResult]:
    """Launch each step before collecting the previous one, as the runner does at depth 2
    (``executor``: gpu/cuda_executor.py's CudaModelExecutor, on any device)."""
    results, pending = [], None
    for batch in batches:
        launched = executor.launch(batch)
        if pending is not None:
            results.append(executor.collect(pending))
        pending = launched
    results.append(executor.collect(pending))
    return results


def device_sampling_inputs(plan: SamplingPlan, device: torch.device) -> DeviceSamplingInputs:
    """``plan``'s inputs as device tensors, uploaded one by one (tests, benchmarks; the
    executor packs them into its upload instead)."""
    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return DeviceSamplingInputs(
        temperatures=floats(plan.temperatures), top_ps=floats(plan.top_ps),
        min_ps=floats(plan.min_ps), top_ks=ints(plan.top_ks), seed_keys=ints(plan.seed_keys),
        output_indices=ints(plan.output_indices), banned_rows=ints(plan.banned_rows),
        banned_token_ids=ints(plan.banned_token_ids), allowed_rows=ints(plan.allowed_rows),
        allowed_local_rows=ints(plan.allowed_local_rows),
        allowed_token_ids=ints(plan.allowed_token_ids),
        logit_bias_rows=ints(plan.logit_bias_rows),
        logit_bias_token_ids=ints(plan.logit_bias_token_ids),
        logit_bias_values=floats(plan.logit_bias_values), penalty_rows=ints(plan.penalty_rows),
        penalty_slots=ints(plan.penalty_slots), presences=floats(plan.presences),
        frequencies=floats(plan.frequencies), repetitions=floats(plan.repetitions))


def assert_graph_replays_plain_results(step: Any, x: torch.Tensor,
                                       inputs: Sequence[torch.Tensor], change: Any) -> None:
    """``step`` run plainly on each of ``inputs`` (copied into ``x``); then ``change()``
    (what the test varies), ``step`` captured in a CUDA graph (after a call outside the
    capture, which compiles) and replayed on each input: the plain results, bit for
    bit."""
    expected = []
    for values in inputs:
        x.copy_(values)
        expected.append(step())
    change()
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for values, bits in zip(inputs, expected, strict=True):
        x.copy_(values)
        graph.replay()
        assert torch.equal(out, bits)
