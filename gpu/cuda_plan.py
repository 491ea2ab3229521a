"""The CUDA executor's step planning, on the host: each request's block-table row and
upload values, and one pass over a ScheduledBatch into a HostStep (the layout
gpu/step_packing.py packs).

A decode row takes the token sampled for it last step from device memory while
that step may still run: the planner remembers where each request's latest
token is (``LAUNCH_SHIFT``) and which launches are still readable.
"""

from __future__ import annotations

import numpy as np

from trio_llm.actors.config import MAX_CHUNKED_SEQS, MAX_PIPELINE_DEPTH
from trio_llm.actors.messages import NewRequestData, ScheduledBatch
from trio_llm.gpu.cuda_sampler import is_plain, plain_row_values
from trio_llm.gpu.executor import MIN_VECTORIZED_SLOTS, kv_slot_array, kv_slots
from trio_llm.gpu.pooling import pooling_chunk
from trio_llm.gpu.request_table import RequestState, RequestTable
from trio_llm.gpu.sampler import SamplingRow
from trio_llm.gpu.step_packing import HostStep

# One input slot per step in flight.
NUM_SLOTS = MAX_PIPELINE_DEPTH
# Where a request's latest sampled token is, as one int (no tuple per row and step):
# the launch number above this many bits, its row in the flat [slot, row] buffer below.
LAUNCH_SHIFT = 32
ROW_MASK = (1 << LAUNCH_SHIFT) - 1


class StepPlanner:
    """The host-side state of the CUDA executor's requests beside the RequestTable, and
    the planning of each step from it."""

    def __init__(self, table: RequestTable, *, vocab_size: int, max_blocks_per_seq: int,
                 num_table_rows: int, num_state_slots: int = 0) -> None:
        self.table = table
        # a model with linear-attention layers: every request has one of these slots
        self.num_state_slots = num_state_slots
        self.penalty_counts = table.penalty_counts
        self.vocab_size = vocab_size
        self.block_size = table.block_size
        self._max_positions = table.max_positions
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_table_rows = num_table_rows
        self._free_table_rows = list(range(num_table_rows - 1, -1, -1))
        self._table_rows: dict[str, int] = {}
        # request id -> its latest sampled token's launch number and flat row
        # (LAUNCH_SHIFT) in the device's [slot, row] buffer
        self._sampled_on_device: dict[str, int] = {}
        # request id -> the values its sampling rows upload (cuda_sampler.plain_row_values);
        # and the requests whose rows need the full sampling plan (penalties, logit bias,
        # allowed or banned ids, logprobs: cuda_sampler.is_plain)
        self._row_values: dict[str, tuple[float, float, float, int, int]] = {}
        self._special_requests: set[str] = set()
        self._num_launches = 0

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.table.states

    @property
    def num_launches(self) -> int:
        return self._num_launches

    def register(self, new_request: NewRequestData) -> None:
        """A new request (or a restarted one, whose earlier state goes)."""
        request_id = new_request.request_id
        self.forget(request_id)
        state = self.table.add(new_request)
        if self.num_state_slots:  # refused here, before any step uses it
            self.table.state_slot(request_id, state, self.num_state_slots)
        if not self._free_table_rows:  # the executor grows its table to num_table_rows
            self._free_table_rows = list(range(2 * self.num_table_rows - 1,
                                               self.num_table_rows - 1, -1))
            self.num_table_rows *= 2
        self._table_rows[request_id] = self._free_table_rows.pop()
        self._row_values[request_id] = plain_row_values(new_request.sampling, self.vocab_size)
        if not is_plain(new_request.sampling):
            self._special_requests.add(request_id)

    def forget(self, request_id: str) -> None:
        self.table.remove(request_id)
        self._sampled_on_device.pop(request_id, None)
        self._row_values.pop(request_id, None)
        self._special_requests.discard(request_id)
        row = self._table_rows.pop(request_id, None)
        if row is not None:
            self._free_table_rows.append(row)

    def widen_sampled(self, old_width: int, new_width: int) -> None:
        """The device's [slot, row] buffer of sampled ids widened from ``old_width`` rows a
        slot to ``new_width``: every id still to be read keeps its (slot, row)."""
        for request_id, location in self._sampled_on_device.items():
            slot_index, row = divmod(location & ROW_MASK, old_width)
            self._sampled_on_device[request_id] = (location - (location & ROW_MASK)
                                                   + slot_index * new_width + row)

    def plan(self, batch: ScheduledBatch) -> HostStep:
        """The step's inputs, in one pass over its requests: new blocks (block-table
        updates), tokens, positions, slots, per-sequence layout and sampling rows.

        A decode row takes the token sampled for it last step: from device memory
        (its id then names the row there, step_packing) while that step may still be
        running, from the host once it was collected.

        This is the hot loop of a step (hundreds of requests, every step): one function
        with its lists bound to locals, since a call or a lookup per request and list
        adds up to a good share of the host's time per step. A sampled row costs two
        appends and a lookup of its request's upload values; SamplingRows are built
        only for a step that has a row needing the full plan (``_sampling_rows``)."""
        step = HostStep(step_id=batch.step_id)
        ints = step.ints
        token_ids, positions = ints["token_ids"], ints["positions"]
        slot_mapping, context_lens = ints["slot_mapping"], ints["context_lens"]
        query_start_loc, table_rows = ints["query_start_loc"], ints["table_rows"]
        state_slots = ints["state_slots"] if self.num_state_slots else None
        step.state_copies = batch.state_copies
        logits_indices, row_values = ints["logits_indices"], step.row_values
        output_indices, sampled_request_ids = ints["output_indices"], step.sampled_request_ids
        requests, rows_by_id, block_size = self.requests, self._table_rows, self.block_size
        values_by_id, special = self._row_values, self._special_requests
        on_device = self._sampled_on_device
        oldest_readable = (self._num_launches - NUM_SLOTS) << LAUNCH_SHIFT
        max_positions, num_single_token_rows, num_from_device = self._max_positions, 0, 0
        num_special = 0
        query_start_loc.append(0)
        for scheduled in batch.requests:
            request_id = scheduled.request_id
            state = requests.get(request_id) or self.table.state(request_id)
            row = rows_by_id[request_id]
            if scheduled.new_block_ids:
                self._add_blocks(step, request_id, state, row, scheduled.new_block_ids)
            start = scheduled.num_computed_tokens
            if scheduled.input_from_previous_step:
                location = on_device.get(request_id)
                if location is not None and location >= oldest_readable:
                    # sampled by a step that may still run: read on the device
                    token_ids.append(-1 - (location & ROW_MASK))
                    num_from_device += 1
                else:
                    token_ids.append(self._last_sampled(request_id, state))
                num_single_token_rows += 1
                context_len = start + 1
                positions.append(start)
            else:
                if scheduled.prompt_logprob_token_ids:  # the chunk's first positions
                    step.prompt_logprob_rows.add(request_id, len(token_ids),
                                                 scheduled.prompt_logprob_token_ids,
                                                 state.sampling.num_prompt_logprobs or 0)
                if state.pooling is not None:  # an embedding request
                    chunk = pooling_chunk(scheduled, state.pooling, state.mean_pool,
                                          len(token_ids))
                    if chunk is not None:
                        step.pooling_chunks.append(chunk)
                token_ids += scheduled.token_ids
                context_len = start + len(scheduled.token_ids)
                if context_len - start < MIN_VECTORIZED_SLOTS:
                    positions += range(start, context_len)
                # at depth 1 a decode row's token comes from the host, as a 1-token chunk
                num_single_token_rows += len(scheduled.token_ids) == 1
            blocks = state.block_ids
            if context_len > len(blocks) * block_size or context_len > max_positions:
                self.table.check_capacity(request_id, state, context_len)  # raises
            if context_len == start + 1:  # a decode row: its one slot, without a call
                slot_mapping.append(blocks[start // block_size] * block_size
                                    + start % block_size)
            elif context_len - start < MIN_VECTORIZED_SLOTS:
                slot_mapping += kv_slots(blocks, block_size, start, context_len)
            else:  # its positions too
                self._insert_long_chunk(step, blocks, start, context_len)
            context_lens.append(context_len)
            if state_slots is not None:
                state_slots.append(state.state_slot)  # type: ignore[arg-type]  # registered
            query_start_loc.append(len(token_ids))
            table_rows.append(row)
            if scheduled.sample:
                logits_indices.append(len(token_ids) - 1)
                if scheduled.bitmask_follows:
                    step.rows_awaiting_bitmasks.append(len(sampled_request_ids))
                    num_special += 1
                elif scheduled.token_bitmask is not None or request_id in special:
                    num_special += 1
                row_values.append(values_by_id[request_id])
                output_indices.append(scheduled.output_index)
                sampled_request_ids.append(request_id)
        step.num_seqs = len(batch.requests)
        step.num_tokens = len(token_ids)
        step.num_single_token_rows = num_single_token_rows
        if self.num_state_slots and step.num_seqs - num_single_token_rows > MAX_CHUNKED_SEQS:
            # the chunked kernel has that many seats: more would lose states (never silently)
            raise ValueError(
                f"step {batch.step_id} has {step.num_seqs - num_single_token_rows} sequences "
                f"of two tokens or more; a model with linear-attention layers takes at most "
                f"{MAX_CHUNKED_SEQS} (MAX_CHUNKED_SEQS, which the scheduler keeps to)")
        step.num_tokens_from_device = num_from_device
        if num_special:
            step.sampling_rows = self._sampling_rows(batch)
        return step

    def _sampling_rows(self, batch: ScheduledBatch) -> list[SamplingRow]:
        """Every sampled row's SamplingRow, for the full sampling plan."""
        requests, penalty_counts = self.requests, self.penalty_counts
        return [SamplingRow(requests[scheduled.request_id].sampling, scheduled.output_index,
                            scheduled.token_bitmask, penalty_counts.slot(scheduled.request_id))
                for scheduled in batch.requests if scheduled.sample]

    def _insert_long_chunk(self, step: HostStep, block_ids: list[int], start: int,
                           end: int) -> None:
        """A long chunk's positions and slots, as arrays inserted where they belong."""
        inserts = step.inserts
        inserts["positions"].append((len(step.ints["positions"]),
                                     np.arange(start, end, dtype=np.int64)))
        inserts["slot_mapping"].append((len(step.ints["slot_mapping"]),
                                        kv_slot_array(block_ids, self.block_size, start, end)))

    def _add_blocks(self, step: HostStep, request_id: str, state: RequestState, row: int,
                    block_ids: list[int]) -> None:
        """Extend a request's blocks; the device's block table gets them with the step."""
        first_column = len(state.block_ids)
        if first_column + len(block_ids) > self.max_blocks_per_seq:
            raise ValueError(f"request {request_id!r} needs more than "
                             f"{self.max_blocks_per_seq} blocks (max_model_len)")
        ints = step.ints
        first_index = row * self.max_blocks_per_seq + first_column  # in the flat table
        ints["update_indices"] += range(first_index, first_index + len(block_ids))
        ints["update_block_ids"] += block_ids
        state.block_ids.extend(block_ids)

    @staticmethod
    def _last_sampled(request_id: str, state: RequestState) -> int:
        """The token sampled for a request by a step already collected."""
        if state.last_sampled_token_id is None:
            raise ValueError(f"request {request_id!r} takes its input from the previous step, "
                             f"but nothing was sampled for it")
        return state.last_sampled_token_id

    def remember_sampled(self, step: HostStep, first_row: int) -> None:
        """The step's sampled ids will be at flat rows ``first_row``... of the device's
        [slot, row] buffer; count the launch."""
        first = (self._num_launches << LAUNCH_SHIFT) + first_row
        request_ids = step.sampled_request_ids
        self._sampled_on_device.update(zip(request_ids,
                                           range(first, first + len(request_ids)), strict=True))
        self._num_launches += 1

