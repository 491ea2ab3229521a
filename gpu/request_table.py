"""What an executor remembers of each running request between steps.

Both executors (the CPU's, gpu/executor.py, and the pipelined CUDA one,
gpu/cuda_executor.py) hold one RequestTable: each request's sampling options,
its KV blocks and the token it sampled last, and the token counts of the
requests with penalties (gpu/penalties.py). The CUDA executor keeps what only
it needs (block-table rows, where a request's last token sits on the device)
beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trio_llm.actors.messages import (
    NewRequestData,
    PoolingOptions,
    SamplingOptions,
    ScheduledBatch,
)
from trio_llm.gpu.penalties import PenaltyCounts
from trio_llm.gpu.pooling import MeanPool, new_mean_pool


@dataclass(slots=True)
class RequestState:
    """What the executor remembers of one running request between steps."""

    sampling: SamplingOptions
    block_ids: list[int] = field(default_factory=list)
    last_sampled_token_id: int | None = None
    # an embedding request: how it pools, and (mean pooling) its sum so far
    pooling: PoolingOptions | None = None
    mean_pool: MeanPool | None = None
    # a model with linear-attention layers: the request's slot in the state caches
    state_slot: int | None = None


class RequestTable:
    """The running requests' states and penalty counts, by request id."""

    def __init__(self, *, vocab_size: int, device: torch.device, block_size: int,
                 max_positions: int) -> None:
        self.states: dict[str, RequestState] = {}
        self.penalty_counts = PenaltyCounts(vocab_size, device)
        self.block_size = block_size
        self.max_positions = max_positions

    def add(self, new_request: NewRequestData) -> RequestState:
        """A new request's state (replacing what a restarted one had)."""
        state = self.states[new_request.request_id] = RequestState(
            sampling=new_request.sampling, pooling=new_request.pooling,
            mean_pool=new_mean_pool(new_request.pooling), state_slot=new_request.state_slot)
        return state

    def register_penalties(self, new_request: NewRequestData,
                           to_device: Callable[[list[int]], torch.Tensor]) -> None:
        """Give a request with penalties its counts (``release`` on a restart)."""
        self.penalty_counts.release(new_request.request_id)
        if new_request.sampling.has_penalties:
            self.penalty_counts.register(new_request.request_id,
                                         to_device(new_request.prompt_token_ids),
                                         to_device(new_request.output_token_ids))

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.penalty_counts.release(request_id)

    def state(self, request_id: str) -> RequestState:
        state = self.states.get(request_id)
        if state is None:
            raise ValueError(f"request {request_id!r} was scheduled but never registered "
                             f"in new_requests (or already finished)")
        return state

    @staticmethod
    def state_slot(request_id: str, state: RequestState, num_state_slots: int) -> int:
        """The request's state slot; a model with linear-attention layers runs no request
        without one."""
        slot = state.state_slot
        if slot is None or not 0 <= slot < num_state_slots:
            raise ValueError(f"request {request_id!r} has state slot {slot}: a model with "
                             f"linear-attention layers needs one in 0..{num_state_slots - 1} "
                             f"(NewRequestData.state_slot)")
        return slot

    def check_capacity(self, request_id: str, state: RequestState, context_len: int) -> None:
        """Refuse a step that would write past a request's blocks or its positions."""
        if context_len > len(state.block_ids) * self.block_size:
            raise ValueError(f"request {request_id!r} needs {context_len} slots but has "
                             f"{len(state.block_ids)} blocks of {self.block_size}")
        if context_len > self.max_positions:
            raise ValueError(f"request {request_id!r} reaches position {context_len - 1}, "
                             f"beyond the model's {self.max_positions} positions")

    def check_restored_states(self, batch: ScheduledBatch) -> None:
        """A request admitted with computed tokens (a prefix-cache hit) continues from
        its slot's state: the batch must restore one into it (ScheduledBatch.state_copies),
        or its output would follow another request's state (models with linear-attention
        layers; both executors check it before the forward)."""
        restored = {destination for _, destination in batch.state_copies}
        new_ids = {new_request.request_id for new_request in batch.new_requests}
        for scheduled in batch.requests:
            if scheduled.request_id not in new_ids or not scheduled.num_computed_tokens:
                continue
            slot = self.state(scheduled.request_id).state_slot
            if slot not in restored:
                raise ValueError(
                    f"request {scheduled.request_id!r} is admitted with "
                    f"{scheduled.num_computed_tokens} computed tokens, but no state was "
                    f"restored into its state slot {slot} (ScheduledBatch.state_copies): a "
                    f"model with linear-attention layers cannot reuse cached KV blocks alone")
