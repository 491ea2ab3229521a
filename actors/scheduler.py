"""The scheduler actor: the one place that decides what runs in each engine step.

Policy (``Scheduler``, synchronous): continuous batching with chunked prefill
under a token budget, paged KV blocks, preemption by recompute, policies fcfs
and priority (with optional priority preemption), and depth-2 pipelining.

One step is planned in three phases:

1. ``_admit_by_priority``: with policy "priority" and a threshold set, a
   pulled request whose priority value is lower than a running one's by at
   least the threshold (and at least 1, so equals never evict each other)
   evicts it when seats or blocks are short, and is scheduled first, leaving
   room for the running requests ranked above it.
2. ``_schedule_running``: running requests, best first; a decode takes one
   token, an unfinished prefill a chunk of what is left of the budget (at most
   ``long_prefill_token_threshold`` tokens, where set: vLLM's flag). A
   request that cannot get a KV block preempts the worst running request
   not yet scheduled in this step (possibly itself). Running requests are
   kept best first, so the victims always come from the end.
3. ``_admit_waiting``: pulled requests, in order, while budget, seats and
   blocks allow; the rest go back to the queue.

Prefix caching (on by default): a request starts after the longest run of
cached full blocks its prompt begins with (``_find_cached_prefix``), never
the whole prompt, so at least one token is computed and sampled from. The
blocks a request fills are cached (``_cache_full_blocks``) after each prefill
chunk, and the blocks its decodes filled when it stops (finished, aborted,
preempted): the decode hot path never hashes. A step that reads a cached block
always runs after (or is) the step that writes it: the runner executes steps
in order and every layer writes its KV before attending.

A model with linear-attention layers (``num_state_slots`` > 0; the hybrid family)
also needs a state per running sequence: a slot (actors/state_slots.py), taken at
admission and given back wherever its KV blocks are. Its prefix cache needs the
state at a cached prefix's end as well: a hit is the longest run of cached blocks
whose end has a state snapshot (``_with_snapshot``), restored by a copy in the
admitting batch (``ScheduledBatch.state_copies``). Prefill chunks end where a
snapshot is wanted (``snapshot_cuts``: the branch point past the best snapshot, the
prompt's last full block), and the next batch saves the state there
(``_save_snapshots``: first among its copies, so admissions of that batch can
restore it). A decode that completes a block at a multiple of
``decode_snapshot_interval`` tokens has the next batch copy the state into
the request's one pending snapshot slot (``_save_decode_snapshots``: last among its
copies), registered when the request stops under the hash of the block that ended
there (``_register_pending_snapshot``), so the next turn of a conversation starts
past the answer too. A step of such a model holds at most ``MAX_CHUNKED_SEQS``
chunks of two tokens or more (``_StepBuilder.prefill_budget``: later chunks get one
token; with prefix caching on, a request that would start with one waits for a seat,
``_waits_for_a_chunk_seat``). docs/architecture.md, "Models with linear-attention
layers".

An embedding request (``Request.pooling``, the pooling runner) is a prefill like any
other whose last chunk pools (``pool``) instead of sampling; it finishes, and frees its
blocks, when that chunk's vector arrives in the StepResult. Mean pooling needs every
position's hidden state, so a mean-pooled request never starts from cached blocks.

Depth 2: the next batch is planned while the previous one runs. A decoding
request whose last token was sampled in the batch in flight takes it as input
straight from the runner (``input_from_previous_step``); the scheduler counts
that token as a placeholder and reconciles when the StepResult arrives.

A constrained request starts only with its grammar compiled (the queue compiles
it, actors/queue.py); one pulled without it (its grammar left the cache since)
goes back to the queue, which compiles it again: the scheduler never compiles.

Seat shares: the requests of one group (the choices of one HTTP request) hold at
most ``max_group_seats`` seats (``--max-seq-share`` of ``--max-num-seqs``); the
Pull says how many more each group may start, and the queue passes over the rest.

Constrained requests (structured outputs) carry a grammar: each sampled token
is masked by what the grammar allows after the confirmed output. Every sampled
row of a constrained request is scheduled with ``bitmask_follows``: its mask is
computed once every step before it is reconciled (at depth 2, when the step in
flight returns; otherwise at once) and sent to the runner as StepBitmasks
(``ready_bitmasks``), before the runner samples that step. The shell fills the
masks on the event loop, the moment they can be filled, in one call of xgrammar's
batch matcher (which works without the GIL; docs/architecture.md says why not in a
worker thread). Its tokens are those of depth 1.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any, cast

import msgspec
import trio

from trio_llm.actors.config import MAX_CHUNKED_SEQS, EngineConfig
from trio_llm.actors.grammar import Grammars, GrammarState, accept_tokens, fill_bitmasks
from trio_llm.actors.kv_blocks import (
    BlockManager,
    chain_block_hashes,
    next_block_hash,
    root_block_hash,
)
from trio_llm.actors.messages import (
    Abort,
    AbortOutcome,
    DetokenizerInbox,
    FinishReason,
    NewRequestData,
    Pull,
    Pulled,
    QueueInbox,
    Requeue,
    RunnerInbox,
    ScheduledBatch,
    ScheduledRequest,
    SchedulerInbox,
    StepBitmasks,
    StepResult,
    StopStringHit,
    TokenBatch,
    TokenDelta,
    TokenLogprobs,
    Track,
    WaitingRequest,
)
from trio_llm.actors.state_slots import StateSlots

# The empty token and block id lists of every decode: nobody mutates a message,
# and one shared list spares the garbage collector two objects per request and
# step (at batch 256, most of the collections the engine would otherwise run).
_NO_IDS: list[int] = []
_NO_HASHES: list[bytes] = []


class SchedulerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the scheduler's counters (running totals since start)."""

    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    # In tokens, for requests starting for the first time (vLLM's
    # prefix_cache_queries and prefix_cache_hits; recomputes are not counted).
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # Models with linear-attention layers: the state cache's slots (0 otherwise), the
    # free ones, those holding prefix-cache snapshots, and those holding decoding
    # requests' pending snapshots (registered or freed when the request stops).
    num_total_state_slots: int = 0
    num_free_state_slots: int = 0
    num_state_snapshots: int = 0
    num_pending_state_snapshots: int = 0


class CachedPrefix:
    """The cached full blocks a request's tokens start with: their ids and
    hashes, and the root hash (model and cache salt) their chain starts from.

    A model with linear-attention layers also needs the state at the prefix's
    end: ``snapshot_slot`` holds it (None: no state, the prefix is empty), and
    ``matched_block_hashes`` are the hashes of every cached block that matched
    before the prefix was cut back to the longest with a snapshot (where a new
    snapshot would help)."""

    __slots__ = ("root_hash", "block_ids", "block_hashes", "snapshot_slot",
                 "matched_block_hashes")

    def __init__(self, root_hash: bytes | None, block_ids: list[int],
                 block_hashes: list[bytes], snapshot_slot: int | None = None,
                 matched_block_hashes: list[bytes] | None = None) -> None:
        self.root_hash = root_hash
        self.block_ids = block_ids
        self.block_hashes = block_hashes
        self.snapshot_slot = snapshot_slot
        self.matched_block_hashes = (block_hashes if matched_block_hashes is None
                                     else matched_block_hashes)

    @property
    def num_matched_blocks(self) -> int:
        return len(self.matched_block_hashes)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


# With prefix caching off, every request starts from this (never mutated).
_NO_PREFIX = CachedPrefix(None, [], [])


class RunningRequest:
    """A request holding a seat and KV blocks.

    Its token sequence is prompt + ``output_token_ids`` + placeholders (tokens
    sampled in a batch still in flight). A request that was preempted restarts
    with a prefill over prompt + the output it had then.
    """

    __slots__ = ("request", "request_id", "sort_key", "stop_token_ids", "max_tokens",
                 "min_tokens", "output_token_ids", "num_preemptions", "prefill_token_ids",
                 "num_prefill_tokens", "num_computed_tokens", "num_placeholders", "block_ids",
                 "start_step_id", "scheduled_step_id", "root_hash", "block_hashes", "grammar",
                 "prompt_logprobs", "state_slot", "snapshot_cuts", "num_shared_tokens",
                 "pending_snapshot_slot",
                 "num_pending_snapshot_tokens")

    def __init__(self, waiting: WaitingRequest, sort_key: tuple[int, ...], step_id: int,
                 prefix: CachedPrefix = _NO_PREFIX, num_cached_tokens: int = 0) -> None:
        request = waiting.request
        self.request = request
        self.request_id = request.request_id
        self.sort_key = sort_key
        self.stop_token_ids = frozenset(request.stop_token_ids)
        self.max_tokens = request.max_tokens
        self.min_tokens = request.sampling.min_tokens
        self.output_token_ids = list(waiting.output_token_ids)
        self.num_preemptions = waiting.num_preemptions
        self.prefill_token_ids = request.prompt_token_ids + self.output_token_ids
        self.num_prefill_tokens = len(self.prefill_token_ids)
        # The cached prefix counts as computed; its blocks come with the first chunk.
        self.num_computed_tokens = num_cached_tokens
        self.num_placeholders = 0
        self.block_ids: list[int] = []
        # The hashes of its first full blocks (prefix caching): block i's parent
        # is block i - 1's hash, block 0's is root_hash.
        self.root_hash = prefix.root_hash
        self.block_hashes = list(prefix.block_hashes)
        # Results of steps before this one belong to an earlier life of the request.
        self.start_step_id = step_id
        self.scheduled_step_id: int | None = None
        self.grammar: GrammarState | None = None
        # the prompt logprobs gathered chunk by chunk, until they go out with the first
        # output token (None: not asked for, or already sent before a preemption)
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if request.params.prompt_logprobs is not None and not self.output_token_ids
            else None)
        # A model with linear-attention layers: its slot in the state cache, and the
        # block-aligned positions where a prefill chunk ends so that the state there
        # is saved as a prefix-cache snapshot (ascending, past what it computed).
        self.state_slot: int | None = None
        self.snapshot_cuts: list[int] = _NO_IDS
        # how far its prompt was known at admission to be shared (its KV blocks cached
        # by an earlier request, or a request pulled behind it starting the same): a
        # snapshot up to there is of a prefix known to be shared
        self.num_shared_tokens = 0
        # Its pending snapshot (decode snapshots): a slot holding its state after its
        # first ``num_pending_snapshot_tokens`` tokens, the last block boundary its
        # decodes reached whose copy a sent batch carries; registered when it stops.
        self.pending_snapshot_slot: int | None = None
        self.num_pending_snapshot_tokens = 0

    @property
    def num_known_tokens(self) -> int:
        """Prompt and confirmed output: the tokens whose ids the scheduler knows."""
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """The known token ids at positions ``start`` to ``end - 1``."""
        prompt_token_ids = self.request.prompt_token_ids
        num_prompt_tokens = len(prompt_token_ids)
        if end <= num_prompt_tokens:
            return prompt_token_ids[start:end]
        output_token_ids = self.output_token_ids
        if start >= num_prompt_tokens:
            return output_token_ids[start - num_prompt_tokens:end - num_prompt_tokens]
        return prompt_token_ids[start:] + output_token_ids[:end - num_prompt_tokens]

    @property
    def can_decode(self) -> bool:
        """False while its last output token is still to come from a step in flight."""
        return len(self.output_token_ids) + self.num_placeholders < self.max_tokens

    def schedule_prefill(self, num_tokens: int, new_block_ids: list[int],
                         step_id: int) -> ScheduledRequest:
        """The next ``num_tokens`` of its prefill run in step ``step_id``; the
        last chunk samples its next output token, or (an embedding request) pools."""
        self.block_ids += new_block_ids
        start = self.num_computed_tokens
        is_last_chunk = start + num_tokens == self.num_prefill_tokens
        pool = is_last_chunk and self.request.pooling is not None
        sample = is_last_chunk and not pool
        self.num_computed_tokens = start + num_tokens
        self.num_placeholders += is_last_chunk  # its token, or its vector, is to come
        self.scheduled_step_id = step_id
        return ScheduledRequest(
            request_id=self.request_id, token_ids=self.prefill_token_ids[start:start + num_tokens],
            input_from_previous_step=False, num_computed_tokens=start,
            new_block_ids=new_block_ids, sample=sample, output_index=len(self.output_token_ids),
            bitmask_follows=sample and self.grammar is not None,
            prompt_logprob_token_ids=self._prompt_logprob_targets(start, start + num_tokens),
            pool=pool,
        )

    def _prompt_logprob_targets(self, start: int, end: int) -> list[int]:
        """The prompt tokens whose logprobs positions ``start`` to ``end - 1`` give:
        position i gives token i + 1's (the last prompt position samples instead)."""
        if self.prompt_logprobs is None:
            return _NO_IDS
        prompt_token_ids = self.request.prompt_token_ids
        return prompt_token_ids[start + 1:min(end, len(prompt_token_ids) - 1) + 1]

    def schedule_decode(self, new_block_ids: list[int], step_id: int) -> ScheduledRequest:
        """Its last token runs in step ``step_id`` and samples the next one. The
        last token is a placeholder when it comes from the step in flight."""
        if new_block_ids:
            self.block_ids += new_block_ids
        num_computed_tokens = self.num_computed_tokens
        num_placeholders = self.num_placeholders
        self.num_computed_tokens = num_computed_tokens + 1
        self.num_placeholders = num_placeholders + 1
        self.scheduled_step_id = step_id
        return ScheduledRequest(
            request_id=self.request_id,
            token_ids=_NO_IDS if num_placeholders else [self.output_token_ids[-1]],
            input_from_previous_step=num_placeholders > 0,
            num_computed_tokens=num_computed_tokens, new_block_ids=new_block_ids, sample=True,
            output_index=len(self.output_token_ids) + num_placeholders,
            bitmask_follows=self.grammar is not None,  # StepBitmasks brings its mask
        )

    def accept_token(self, token_id: int) -> FinishReason | None:
        """Take the token sampled for the oldest placeholder; the finish reason
        if it ends the request ("stop": ``token_id`` is the stop reason)."""
        assert self.num_placeholders > 0, "a token it did not ask for"
        self.num_placeholders -= 1
        output_token_ids = self.output_token_ids
        output_token_ids.append(token_id)  # (its grammar accepts it with the step's others)
        # A stop token only counts from output index min_tokens on: the
        # runner masks it before that; the rule holds here too.
        if token_id in self.stop_token_ids and len(output_token_ids) > self.min_tokens:
            return "stop"
        if len(output_token_ids) >= self.max_tokens:
            return "length"
        return None

    def to_waiting(self) -> WaitingRequest:
        """What goes back to the queue on preemption: confirmed output only;
        placeholders are recomputed (sampling is keyed by output index)."""
        return WaitingRequest(request=self.request, output_token_ids=self.output_token_ids,
                              num_preemptions=self.num_preemptions + 1)


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What one call to ``Scheduler.schedule`` asks the shell to send."""

    tracks: list[Track]
    requeue: Requeue | None
    batch: ScheduledBatch | None


class _StepBuilder:
    """The batch being planned, and what is left of its token budget."""

    def __init__(self, step_id: int, max_num_tokens: int, num_chunk_seats: int,
                 decode_snapshot_interval: int = 0, max_chunk_tokens: int = 0) -> None:
        self.step_id = step_id
        self.max_num_tokens = max_num_tokens
        self.budget = max_num_tokens
        # the most tokens one prefill chunk takes (--long-prefill-token-threshold)
        self.max_chunk_tokens = max_chunk_tokens or max_num_tokens
        # chunks of two tokens or more the step may still take (``prefill_budget``)
        self.num_free_chunk_seats = num_chunk_seats
        self.requests: list[ScheduledRequest] = []
        self.new_requests: list[NewRequestData] = []
        self.tracks: list[Track] = []
        self.num_prompt_tokens = 0
        # constrained requests whose mask follows in StepBitmasks, in batch order
        self.bitmasks_follow: list[RunningRequest] = []
        # (source slot, destination slot): states saved as snapshots, then snapshots
        # restored into admitted requests
        self.state_copies: list[tuple[int, int]] = []
        # (request, block hash, shared): chunks of this step that end where a snapshot is
        # wanted (shared: a prefix known to be shared, RunningRequest.num_shared_tokens)
        self.snapshots_wanted: list[tuple[RunningRequest, bytes, bool]] = []
        # Decode snapshots: their interval in tokens, whole blocks (0: none taken), and
        # (request, its computed tokens) for each decode of this step that reaches
        # one, whose state the next batch copies into the request's pending snapshot
        self.decode_snapshot_interval = decode_snapshot_interval
        self.decode_snapshots_wanted: list[tuple[RunningRequest, int]] = []

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled so far: whatever the budget lost."""
        return self.max_num_tokens - self.budget

    @property
    def prefill_budget(self) -> int:
        """Tokens the next prefill chunk may take: one once the chunk seats are taken
        (a one-token chunk updates its state in place, beside them)."""
        if not self.num_free_chunk_seats:
            return min(self.budget, 1)
        return min(self.budget, self.max_chunk_tokens)

    def add_prefill(self, running: RunningRequest, num_tokens: int,
                    new_block_ids: list[int]) -> None:
        scheduled = running.schedule_prefill(num_tokens, new_block_ids, self.step_id)
        self.requests.append(scheduled)
        self.budget -= num_tokens
        self.num_free_chunk_seats -= num_tokens > 1
        self.num_prompt_tokens += num_tokens
        if scheduled.bitmask_follows:
            self.bitmasks_follow.append(running)

    def add_decode(self, running: RunningRequest, new_block_ids: list[int]) -> None:
        scheduled = running.schedule_decode(new_block_ids, self.step_id)
        self.requests.append(scheduled)
        self.budget -= 1
        if scheduled.bitmask_follows:
            self.bitmasks_follow.append(running)
        interval = self.decode_snapshot_interval
        if interval and running.num_computed_tokens % interval == 0:
            self.decode_snapshots_wanted.append((running, running.num_computed_tokens))


class Scheduler:
    """Decides every step: which requests run, how many tokens each computes,
    which KV blocks they get, who is preempted. Driven by ``run_scheduler``
    (and directly by tests); it never waits and never sends anything itself."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 grammars: Grammars | None = None, *, num_state_slots: int = 0) -> None:
        self.config = config
        self.grammars = grammars
        self.block_manager = BlockManager(num_kv_blocks, config.block_size)
        # A model with linear-attention layers (num_state_slots > 0): each running
        # sequence holds a slot of the state cache; the slots beyond max_num_seqs hold
        # prefix-cache snapshots (actors/state_slots.py).
        self.state_slots = (StateSlots(num_state_slots, config.max_num_seqs)
                            if num_state_slots else None)
        # Chunks that ended where a snapshot is wanted, in a batch already sent: the
        # next batch copies each state out, before its forward (``_save_snapshots``).
        self._snapshots_wanted: list[tuple[RunningRequest, bytes, bool]] = []
        # Decodes that completed a block, in the batch sent last: the next batch copies
        # each state into its request's pending snapshot (``_save_decode_snapshots``).
        self._decode_snapshots_wanted: list[tuple[RunningRequest, int]] = []
        self.pipeline_depth = config.pipeline_depth
        self._orders_by_priority = config.scheduling_policy == "priority"
        # A waiting request evicts only a strictly worse one: with equals
        # allowed (threshold 0), two requests could evict each other forever.
        self._preemption_threshold = (max(config.priority_preemption_threshold, 1)
                                      if self._orders_by_priority
                                      and config.priority_preemption_threshold is not None
                                      else None)
        # Best first: (priority, arrival_index) or (arrival_index,); the worst
        # is at the end, which is where preemption takes its victims.
        self._running: list[RunningRequest] = []
        self._running_by_id: dict[str, RunningRequest] = {}
        self._in_flight_step_ids: deque[int] = deque()
        self._stopped_request_ids: list[str] = []
        self._preempted: list[WaitingRequest] = []
        # Preempted and not running again yet: the detokenizer still tracks
        # them, so an abort of one is finished here, not by the queue.
        self._preempted_request_ids: set[str] = set()
        # preempted requests a stop string ended while they waited: dropped when pulled
        self._stopped_while_waiting: set[str] = set()
        self._next_step_id = 0
        self._caches_prefixes = config.enable_prefix_caching
        self._takes_snapshots = (self._caches_prefixes and self.state_slots is not None
                                 and self.state_slots.max_num_snapshots > 0)
        block_size = self.block_manager.block_size
        # decodes save their state every this many tokens (whole blocks); 0: never
        self._decode_snapshot_interval = (
            -(-config.decode_snapshot_interval // block_size) * block_size
            if self._takes_snapshots else 0)
        self._model_identity = model_identity(config)
        self._unsalted_root_hash = root_block_hash(self._model_identity, None)
        # step id -> its constrained requests whose bitmasks follow, in batch order
        self._bitmasks_follow: dict[int, list[RunningRequest]] = {}
        # group id -> its running requests (only groups with some)
        self._num_running_by_group: dict[str, int] = {}
        self.max_group_seats = config.max_group_seats
        # the compiled grammars of this step's pulled requests (held: none can be evicted)
        self._compiled_grammars: dict[str, Any] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    def restart_counters(self) -> None:
        """Zero the traffic totals (tokens, preemptions, prefix cache queries and hits):
        the warm-up's requests (api/warm_up.py) are not traffic, and vLLM's counters
        start at its first request too."""
        self.num_preemptions = self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_prefix_cache_queries = self.num_prefix_cache_hits = 0

    def statistics(self) -> SchedulerStatistics:
        state_slots = self.state_slots
        return SchedulerStatistics(
            num_running=len(self._running),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_total_blocks,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_prefix_cache_queries=self.num_prefix_cache_queries,
            num_prefix_cache_hits=self.num_prefix_cache_hits,
            num_total_state_slots=state_slots.num_total_slots if state_slots else 0,
            num_free_state_slots=state_slots.num_free_slots if state_slots else 0,
            num_state_snapshots=state_slots.num_snapshots if state_slots else 0,
            num_pending_state_snapshots=state_slots.num_pending if state_slots else 0,
        )

    # -- what the shell asks ------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        return not self._running and not self._in_flight_step_ids

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight_step_ids)

    def can_plan_step(self) -> bool:
        return len(self._in_flight_step_ids) < self.pipeline_depth

    def next_pull(self) -> Pull | None:
        """The Pull to send before planning, or None when nothing could be admitted.

        Asks for no more requests than could possibly start: each needs a
        seat, a KV block and a token of budget left after the running ones.
        """
        num_admissible = min(
            self.config.max_num_seqs - len(self._running),
            self.block_manager.num_free_blocks,
            self.config.max_num_batched_tokens - len(self._running),
        )
        is_idle = self.is_idle
        if self._preemption_threshold is not None or is_idle:
            num_admissible = max(num_admissible, 1)
        if num_admissible <= 0:
            return None
        return Pull(max_requests=num_admissible, wait=is_idle,
                    group_seats={group_id: self.max_group_seats - num_running
                                 for group_id, num_running in self._num_running_by_group.items()})

    def schedule(self, pulled: list[WaitingRequest]) -> StepPlan:
        """Plan the next step from the running requests and the ``pulled`` ones."""
        assert self.can_plan_step()
        max_num_tokens = self.config.max_num_batched_tokens
        # a model with state slots runs them through a kernel with MAX_CHUNKED_SEQS seats
        step = _StepBuilder(self._next_step_id, max_num_tokens,
                            MAX_CHUNKED_SEQS if self.state_slots is not None else max_num_tokens,
                            self._decode_snapshot_interval,
                            self.config.long_prefill_token_threshold)
        saved = self._save_snapshots(step) if self._snapshots_wanted else _NO_HASHES
        waiting = deque(w for w in pulled if not self._was_stopped_while_waiting(w))
        not_compiled = self._hold_compiled_grammars(waiting)
        if self._preemption_threshold is not None:
            self._admit_by_priority(waiting, step)
        self._schedule_running(step)
        self._admit_waiting(waiting, step)
        requeued = self._preempted + not_compiled + list(waiting)
        self._preempted = []
        self._compiled_grammars.clear()
        batch = self._finish_batch(step) if step.requests else None
        if batch is None and saved:  # their copies never go: the next batch saves them
            assert self.state_slots is not None
            for block_hash in saved:
                self.state_slots.forget_snapshot(block_hash)
        assert batch is not None or self._in_flight_step_ids or not self._running, \
            "running requests but nothing to run"
        requeue = Requeue(requests=requeued) if requeued else None
        return StepPlan(tracks=step.tracks, requeue=requeue, batch=batch)

    def on_step_result(self, result: StepResult) -> TokenBatch | None:
        """Reconcile the placeholders of one finished step; the tokens to emit."""
        expected_step_id = self._in_flight_step_ids.popleft()
        assert result.step_id == expected_step_id, "step results arrive in order"
        running_by_id = self._running_by_id
        all_logprobs = result.logprobs
        for chunk in result.prompt_logprobs:
            running = running_by_id.get(chunk.request_id)
            if (running is not None and running.start_step_id <= expected_step_id
                    and running.prompt_logprobs is not None):
                running.prompt_logprobs += chunk.logprobs
        deltas = []
        grammars: list[GrammarState] = []
        grammar_token_ids: list[int] = []
        sampled = zip(result.request_ids, result.sampled_token_ids, strict=True)
        for index, (request_id, token_id) in enumerate(sampled):
            running = running_by_id.get(request_id)
            if running is None or running.start_step_id > expected_step_id:
                continue  # finished, aborted or preempted since: its token is dropped
            if running.grammar is not None:
                grammars.append(running.grammar)
                grammar_token_ids.append(token_id)
            finish_reason = running.accept_token(token_id)
            prompt_logprobs: list[TokenLogprobs | None] | None = None
            if running.prompt_logprobs is not None:  # its first token
                prompt_logprobs = [None, *running.prompt_logprobs]
                running.prompt_logprobs = None
            deltas.append(TokenDelta(
                request_id=request_id, token_ids=[token_id],
                logprobs=None if all_logprobs is None else [all_logprobs[index]],
                finish_reason=finish_reason,
                stop_reason=token_id if finish_reason == "stop" else None,
                prompt_logprobs=prompt_logprobs))
            if finish_reason is not None:
                self._stop(running)
        # the step's constrained rows in one call (nothing reads a grammar meanwhile)
        accepted = accept_tokens(grammars, grammar_token_ids)
        assert all(accepted), "the sampler obeys the grammar's mask"
        self.num_generation_tokens += len(deltas)
        if result.pooled:
            deltas += self._finish_pooled(result)
        return TokenBatch(deltas=deltas) if deltas else None

    def _finish_pooled(self, result: StepResult) -> list[TokenDelta]:
        """Embedding requests whose last chunk ran in ``result``'s step: each finishes
        with its vector, and its blocks are free for the next step."""
        deltas = []
        for pooled in result.pooled:
            running = self._running_by_id.get(pooled.request_id)
            if running is None or running.start_step_id > result.step_id:
                continue  # aborted or preempted since: its vector is dropped
            running.num_placeholders -= 1
            deltas.append(TokenDelta(request_id=pooled.request_id, token_ids=[], logprobs=None,
                                     finish_reason="stop", embedding=pooled.data))
            self._stop(running)
        return deltas

    def ready_bitmasks(self) -> tuple[int, list[GrammarState]] | None:
        """(step id, the grammars of its rows whose masks follow, in batch order) of the
        oldest step whose masks can be filled now: every step before it is reconciled,
        so each grammar stands at its request's confirmed output. Each step once. A
        request that finished or left since is filled all the same: its token is
        dropped. The shell fills them (``fill_bitmasks``) and sends StepBitmasks."""
        if not self._bitmasks_follow:
            return None
        step_id = next(iter(self._bitmasks_follow))
        if self._in_flight_step_ids and self._in_flight_step_ids[0] < step_id:
            return None  # a token its masks depend on is still to come
        grammars = [running.grammar for running in self._bitmasks_follow.pop(step_id)]
        assert all(grammars), "only constrained rows wait for a mask"
        return step_id, cast(list[GrammarState], grammars)

    def _hold_compiled_grammars(self, waiting: deque[WaitingRequest]) -> list[WaitingRequest]:
        """Take each constrained request's compiled grammar out of the cache for this
        step; remove from ``waiting`` and return those whose grammar is not there
        (evicted since the queue compiled it: the queue compiles it again)."""
        if self.grammars is None:
            return []
        not_compiled: list[WaitingRequest] = []
        for request in list(waiting):
            constraint = request.request.params.structured_outputs
            if constraint is None:
                continue
            compiled = self.grammars.lookup(constraint)
            if compiled is None:
                waiting.remove(request)
                not_compiled.append(request)
            else:
                self._compiled_grammars[request.request.request_id] = compiled
        return not_compiled

    def abort(self, request_id: str) -> TokenBatch | None:
        """Stop a running request, or forget a preempted one; its final (empty)
        delta, or None if the scheduler does not know it (it never ran, or it
        finished)."""
        running = self._running_by_id.get(request_id)
        if running is not None:
            self._stop(running)
        elif request_id in self._preempted_request_ids:
            self._preempted_request_ids.remove(request_id)
        else:
            self._stopped_while_waiting.discard(request_id)  # the queue dropped it
            return None
        return TokenBatch(deltas=[TokenDelta(request_id=request_id, token_ids=[], logprobs=None,
                                             finish_reason="abort")])

    def on_stop_string_hit(self, request_id: str) -> None:
        """The detokenizer already finished the request: just free it. One that was
        preempted waits in the queue (or travels there): it is dropped when pulled,
        never recomputed into a closed stream."""
        running = self._running_by_id.get(request_id)
        if running is not None:
            self._stop(running)
        elif request_id in self._preempted_request_ids:
            self._preempted_request_ids.remove(request_id)
            self._stopped_while_waiting.add(request_id)

    def _was_stopped_while_waiting(self, waiting: WaitingRequest) -> bool:
        request_id = waiting.request.request_id
        if request_id not in self._stopped_while_waiting:
            return False
        self._stopped_while_waiting.remove(request_id)
        return True

    # -- the three phases ---------------------------------------------------------

    def _admit_by_priority(self, waiting: deque[WaitingRequest], step: _StepBuilder) -> None:
        """Admit pulled requests that evict running ones at least the threshold worse."""
        while waiting:
            admission = self._plan_admission(waiting[0], step.prefill_budget)
            victims = self._victims_for(waiting[0], admission, step)
            if not victims:
                return  # it fits without evicting anyone, or it may evict no one
            for victim in victims:
                self._preempt(victim)
            admitted = self._try_admit(waiting[0], step, admission)
            assert admitted, "the evicted requests made room"
            waiting.popleft()

    def _schedule_running(self, step: _StepBuilder) -> None:
        """Give every running request its next tokens, best first."""
        block_size = self.block_manager.block_size
        step_id = step.step_id
        running_requests = self._running  # preemption shrinks it in place
        index = 0
        # Victims are taken from the end, never before ``index``: the requests
        # already scheduled in this step never move.
        while index < len(running_requests) and step.budget > 0:
            running = running_requests[index]
            index += 1
            if running.scheduled_step_id == step_id:
                continue  # admitted by priority in this step
            num_computed_tokens = running.num_computed_tokens
            is_decoding = num_computed_tokens >= running.num_prefill_tokens
            if is_decoding and num_computed_tokens % block_size:
                # The hot path: a decode whose token fits in its last block.
                if running.can_decode:
                    step.add_decode(running, _NO_IDS)
                continue
            if is_decoding:
                scheduled = self._schedule_decode(running, step)
            else:
                scheduled = self._schedule_prefill_chunk(running, step)
            if not scheduled:
                index -= 1  # it preempted itself: the next one took its place

    def _schedule_prefill_chunk(self, running: RunningRequest, step: _StepBuilder) -> bool:
        """Schedule as much of its prefill as the budget allows, up to its next
        snapshot cut; False if it was preempted."""
        num_computed_tokens = running.num_computed_tokens
        end = (running.snapshot_cuts[0] if running.snapshot_cuts
               else running.num_prefill_tokens)
        num_tokens = min(end - num_computed_tokens, step.prefill_budget)
        num_blocks = self.block_manager.blocks_needed(
            num_computed_tokens + num_tokens, len(running.block_ids))
        if not self._make_room(running, num_blocks, step.step_id):
            return False
        self._add_prefill(step, running, num_tokens, self.block_manager.allocate(num_blocks))
        return True

    def _add_prefill(self, step: _StepBuilder, running: RunningRequest, num_tokens: int,
                     block_ids: list[int]) -> None:
        """Schedule a prefill chunk; cache the blocks it fills; if it ends at the
        request's next snapshot cut, want a snapshot of the state there."""
        step.add_prefill(running, num_tokens, block_ids)
        if not self._caches_prefixes:
            return
        self._cache_full_blocks(running)
        cuts = running.snapshot_cuts
        if cuts and running.num_computed_tokens == cuts[0]:
            running.snapshot_cuts = cuts[1:]
            num_blocks = cuts[0] // self.block_manager.block_size
            step.snapshots_wanted.append((running, running.block_hashes[num_blocks - 1],
                                          cuts[0] <= running.num_shared_tokens))

    def _schedule_decode(self, running: RunningRequest, step: _StepBuilder) -> bool:
        """Schedule one decode token into a new block; False if it was preempted.

        Blocks hold exactly the computed tokens, so a decode needs a new block
        when its last block is full.
        """
        if not running.can_decode:
            return True
        if not self._make_room(running, 1, step.step_id):
            return False
        step.add_decode(running, self.block_manager.allocate(1))
        return True

    def _admit_waiting(self, waiting: deque[WaitingRequest], step: _StepBuilder) -> None:
        """Start pulled requests in order while budget, seats and blocks allow (and, with
        state snapshots, while neither a state this batch saves nor waiting for a chunk
        seat would give the next one a longer hit)."""
        while waiting and step.budget > 0 and len(self._running) < self.config.max_num_seqs:
            admission = self._plan_admission(waiting[0], step.prefill_budget,
                                             followers=itertools.islice(waiting, 1, None))
            if self._takes_snapshots and (self._waits_for_a_chunk_seat(waiting[0], admission, step)
                                          or self._waits_for_a_saved_state(admission.prefix, step)):
                return  # it starts in a later batch, from a longer hit; the order stays
            if not self._try_admit(waiting[0], step, admission):
                return  # keep the order: nothing overtakes the request that did not fit
            waiting.popleft()

    # -- helpers ------------------------------------------------------------------

    def _plan_admission(self, waiting: WaitingRequest, budget: int,
                        followers: Iterable[WaitingRequest] = ()) -> _Admission:
        """What starting ``waiting`` now would take: its cached prefix, the tokens
        of its first chunk and the new blocks they need (``followers``: the requests
        pulled behind it, whose prompts may share a prefix with its own)."""
        prefix = self._find_cached_prefix(waiting) if self._caches_prefixes else _NO_PREFIX
        block_size = self.block_manager.block_size
        num_cached_tokens = prefix.num_blocks * block_size
        snapshot_cuts, num_shared_tokens = _NO_IDS, 0
        if self._takes_snapshots:
            num_shared_behind = _num_tokens_shared(waiting, followers, block_size)
            snapshot_cuts = self._snapshot_cuts(waiting, prefix, num_shared_behind)
            num_shared_tokens = max(prefix.num_matched_blocks * block_size, num_shared_behind)
        end = snapshot_cuts[0] if snapshot_cuts else _num_prefill_tokens(waiting)
        num_tokens = min(end - num_cached_tokens, budget)
        num_new_blocks = self.block_manager.blocks_needed(num_cached_tokens + num_tokens,
                                                          prefix.num_blocks)
        return _Admission(prefix, num_cached_tokens, num_tokens, num_new_blocks, snapshot_cuts,
                          num_shared_tokens)

    def _try_admit(self, waiting: WaitingRequest, step: _StepBuilder,
                   admission: _Admission | None = None) -> bool:
        """Start ``waiting`` with its first chunk (after its cached prefix) if it fits."""
        if admission is None:
            admission = self._plan_admission(waiting, step.prefill_budget)
        prefix = admission.prefix
        if admission.num_tokens <= 0 or not self.block_manager.can_allocate(
                admission.num_new_blocks, prefix.block_ids):
            return False
        running = RunningRequest(waiting, self._sort_key(waiting), step.step_id, prefix,
                                 admission.num_cached_tokens)
        running.grammar = self._start_grammar(waiting)
        if self.state_slots is not None:
            running.state_slot = self.state_slots.allocate()
            running.snapshot_cuts = admission.snapshot_cuts
            running.num_shared_tokens = admission.num_shared_tokens
            if prefix.snapshot_slot is not None:  # the state at its cached prefix's end
                step.state_copies.append((prefix.snapshot_slot, running.state_slot))
        self._preempted_request_ids.discard(running.request_id)
        bisect.insort(self._running, running, key=_sort_key_of)
        self._running_by_id[running.request_id] = running
        group_id = running.request.group_id
        if group_id is not None:
            self._num_running_by_group[group_id] = self._num_running_by_group.get(group_id, 0) + 1
        step.new_requests.append(_new_request_data(running))
        if waiting.num_preemptions == 0:
            step.tracks.append(Track(request=running.request))
            if self._caches_prefixes:
                self.num_prefix_cache_queries += running.num_prefill_tokens
                self.num_prefix_cache_hits += admission.num_cached_tokens
        block_ids = self.block_manager.allocate(admission.num_new_blocks, prefix.block_ids)
        self._add_prefill(step, running, admission.num_tokens, block_ids)
        return True

    def _start_grammar(self, waiting: WaitingRequest) -> GrammarState | None:
        """A constrained request's grammar, advanced past the output it already has
        (a preempted request resumes where it was)."""
        constraint = waiting.request.params.structured_outputs
        if constraint is None:
            return None
        assert self.grammars is not None, "intake admits constraints only with grammars"
        compiled = self._compiled_grammars[waiting.request.request_id]
        grammar = self.grammars.start(constraint, compiled)
        for token_id in waiting.output_token_ids:
            accepted = grammar.accept(token_id)
            assert accepted, "its output was sampled under this grammar"
        return grammar

    def _make_room(self, running: RunningRequest, num_blocks: int, step_id: int) -> bool:
        """Preempt the worst requests not yet scheduled in this step until
        ``num_blocks`` are free; False if ``running`` itself had to go."""
        while not self.block_manager.can_allocate(num_blocks):
            victim = self._worst_unscheduled(step_id)
            assert victim is not None
            self._preempt(victim)
            if victim is running:
                return False
        return True

    def _victims_for(self, waiting: WaitingRequest, admission: _Admission,
                     step: _StepBuilder) -> list[RunningRequest]:
        """The running requests ``waiting`` must evict to start now, worst first:
        empty if it fits anyway, or if the requests it may evict do not make room.

        Room includes what the running requests that rank above ``waiting`` take
        in this step: admitted first, it must not make one of them preempt
        itself (at depth 2 the two could then take turns evicting each other
        before either's sampled token arrives, and neither would progress)."""
        assert self._preemption_threshold is not None
        if admission.num_tokens <= 0:
            return []  # no budget left: it cannot start whoever makes room
        cached_block_ids = admission.prefix.block_ids
        # A hit on an evictable block takes it from the free ones, like a new block.
        num_blocks = (admission.num_new_blocks + self.block_manager.num_revived(cached_block_ids)
                      + self._num_blocks_wanted_by_better(waiting, step))
        num_free_blocks = self.block_manager.num_free_blocks
        num_free_seats = self.config.max_num_seqs - len(self._running)
        released = _ReleasedBlocks(self.block_manager, cached_block_ids)
        victims: list[RunningRequest] = []
        for running in reversed(self._running):
            if num_free_blocks >= num_blocks and num_free_seats >= 1:
                break
            if running.scheduled_step_id == step.step_id:
                continue
            if running.request.priority - waiting.request.priority < self._preemption_threshold:
                return []  # the rest rank higher still
            victims.append(running)
            num_free_blocks += released.release(running.block_ids)
            num_free_seats += 1
        if num_free_blocks < num_blocks or num_free_seats < 1:
            return []
        return victims

    def _num_blocks_wanted_by_better(self, waiting: WaitingRequest, step: _StepBuilder) -> int:
        """New blocks the running requests ranked above ``waiting`` and not yet
        scheduled may need in this step: a decode that opens a block, a prefill
        chunk (at most the budget, and the chunk cap)."""
        sort_key = self._sort_key(waiting)
        block_manager = self.block_manager
        num_blocks = 0
        for running in self._running:  # best first
            if running.sort_key >= sort_key:
                break
            if running.scheduled_step_id == step.step_id:
                continue
            num_computed_tokens = running.num_computed_tokens
            if num_computed_tokens >= running.num_prefill_tokens:
                num_blocks += (num_computed_tokens % block_manager.block_size == 0
                               and running.can_decode)
            else:
                num_tokens = min(running.num_prefill_tokens - num_computed_tokens, step.budget,
                                 step.max_chunk_tokens)
                num_blocks += block_manager.blocks_needed(num_computed_tokens + num_tokens,
                                                          len(running.block_ids))
        return num_blocks

    def _worst_unscheduled(self, step_id: int) -> RunningRequest | None:
        for running in reversed(self._running):
            if running.scheduled_step_id != step_id:
                return running
        return None

    def _preempt(self, running: RunningRequest) -> None:
        self._stop(running)
        self._preempted.append(running.to_waiting())
        self._preempted_request_ids.add(running.request_id)
        self.num_preemptions += 1

    def _stop(self, running: RunningRequest) -> None:
        """It leaves the running set (finished, aborted, preempted): free its
        blocks now, and tell the runner in the next batch."""
        if self._caches_prefixes:
            self._cache_full_blocks(running)  # what its decodes filled, for later requests
        self.block_manager.free(running.block_ids)
        if running.state_slot is not None:
            assert self.state_slots is not None
            self.state_slots.free(running.state_slot)
            if running.pending_snapshot_slot is not None:
                self._register_pending_snapshot(running)
        index = bisect.bisect_left(self._running, running.sort_key, key=_sort_key_of)
        assert self._running[index] is running
        del self._running[index]
        del self._running_by_id[running.request_id]
        group_id = running.request.group_id
        if group_id is not None:
            num_running = self._num_running_by_group.pop(group_id) - 1
            if num_running:
                self._num_running_by_group[group_id] = num_running
        self._stopped_request_ids.append(running.request_id)

    def _finish_batch(self, step: _StepBuilder) -> ScheduledBatch:
        if self._decode_snapshots_wanted:
            self._save_decode_snapshots(step)
        self._snapshots_wanted = step.snapshots_wanted
        self._decode_snapshots_wanted = step.decode_snapshots_wanted
        batch = ScheduledBatch(step_id=step.step_id, new_requests=step.new_requests,
                               requests=step.requests,
                               finished_request_ids=self._stopped_request_ids,
                               num_tokens=step.num_tokens, state_copies=step.state_copies)
        self._stopped_request_ids = []
        if step.bitmasks_follow:
            self._bitmasks_follow[step.step_id] = step.bitmasks_follow
        self._in_flight_step_ids.append(step.step_id)
        self._next_step_id += 1
        self.num_steps += 1
        self.num_prompt_tokens += step.num_prompt_tokens
        return batch

    def _sort_key(self, waiting: WaitingRequest) -> tuple[int, ...]:
        request = waiting.request
        if self._orders_by_priority:
            return (request.priority, request.arrival_index)
        return (request.arrival_index,)

    # -- prefix caching -------------------------------------------------------------

    def _find_cached_prefix(self, waiting: WaitingRequest) -> CachedPrefix:
        """The longest run of cached full blocks its tokens start with, short of
        its last token (which must be computed to sample from). Hashes only up
        to the first miss."""
        request = waiting.request
        token_ids = request.prompt_token_ids
        if waiting.output_token_ids:
            token_ids = token_ids + waiting.output_token_ids
        root_hash = self._root_hash(request.cache_salt)
        if request.params.prompt_logprobs is not None and not waiting.output_token_ids:
            # every prompt position must be computed for its logprobs (vLLM's rule too)
            return CachedPrefix(root_hash, [], [])
        if request.pooling is not None and request.pooling.pooling_type == "mean":
            return CachedPrefix(root_hash, [], [])  # every position's state is pooled
        block_size = self.block_manager.block_size
        block_ids: list[int] = []
        block_hashes: list[bytes] = []
        parent_hash = root_hash
        for start in range(0, len(token_ids) - block_size, block_size):
            block_hash = next_block_hash(parent_hash, token_ids[start:start + block_size])
            block_id = self.block_manager.cached_block_id(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
            block_hashes.append(block_hash)
            parent_hash = block_hash
        prefix = CachedPrefix(root_hash, block_ids, block_hashes)
        return prefix if self.state_slots is None else self._with_snapshot(prefix)

    def _save_snapshots(self, step: _StepBuilder) -> list[bytes]:
        """Save the states wanted by chunks of the previous batch: a copy each into a
        snapshot slot, first in this batch's copies; the hashes newly registered.

        This batch is the first after that chunk's, so its copies, which run before
        its forward, see the state exactly at the chunk's end, even at depth 2 (the
        copies wait for the step in flight). A request that left meanwhile is
        passed over: its slot may be another's now. Registered before admissions,
        a snapshot serves requests admitted in this very batch: their restore
        copies come after the save's. One that this save evicts is gone before
        any lookup, so no copy of this batch reads a slot a save overwrites."""
        state_slots = self.state_slots
        assert state_slots is not None
        saved = []
        running_by_id = self._running_by_id
        for running, block_hash, shared in self._snapshots_wanted:
            if running_by_id.get(running.request_id) is not running:
                continue
            snapshot_slot = state_slots.save_snapshot(block_hash, shared)
            if snapshot_slot is not None:
                assert running.state_slot is not None
                step.state_copies.append((running.state_slot, snapshot_slot))
                saved.append(block_hash)
        return saved

    def _save_decode_snapshots(self, step: _StepBuilder) -> None:
        """Copy the states that decodes of the previous batch left at a block boundary,
        each into its request's pending snapshot slot (taken at its first boundary),
        last among this batch's copies.

        As with ``_save_snapshots``, this batch is the first after the decode's, so the
        copy sees the state right after the boundary token. Planned only once the batch
        exists (a pending snapshot must never claim a copy that was not sent), and last:
        the slot a pending snapshot takes by evicting a snapshot may still be read by a
        restore of this batch. A request that left meanwhile is passed over."""
        state_slots = self.state_slots
        assert state_slots is not None
        running_by_id = self._running_by_id
        for running, num_tokens in self._decode_snapshots_wanted:
            if running_by_id.get(running.request_id) is not running:
                continue
            if running.pending_snapshot_slot is None:
                running.pending_snapshot_slot = state_slots.take_pending()
                if running.pending_snapshot_slot is None:
                    continue  # pending slots are at their limit: no snapshot, no harm
            assert running.state_slot is not None
            step.state_copies.append((running.state_slot, running.pending_snapshot_slot))
            running.num_pending_snapshot_tokens = num_tokens

    def _register_pending_snapshot(self, running: RunningRequest) -> None:
        """It stops: its pending snapshot becomes the snapshot of the prefix its last
        saved boundary ends, under the hash of the block that ended there (hashed by
        ``_cache_full_blocks`` just before); freed if that block has no hash or the
        prefix has a snapshot already."""
        state_slots = self.state_slots
        slot = running.pending_snapshot_slot
        assert state_slots is not None and slot is not None
        running.pending_snapshot_slot = None
        num_blocks = running.num_pending_snapshot_tokens // self.block_manager.block_size
        if len(running.block_hashes) < num_blocks:
            state_slots.free_pending(slot)
            return
        state_slots.register_pending(slot, running.block_hashes[num_blocks - 1])

    def _snapshot_cuts(self, waiting: WaitingRequest, prefix: CachedPrefix,
                       num_shared_behind: int) -> list[int]:
        """Where its prefill should end a chunk so that the state there is saved:
        the end of its cached blocks when they reach past its best snapshot (the
        branch point of prompts that share a prefix: the next one with that prefix
        starts there), the end of the longest prefix it shares with a request
        pulled behind it (``num_shared_behind``: the same branch point, found before
        any of it is cached, so a burst of such prompts computes the shared part
        once), and the end of its prompt's last full block (the next turn of a
        conversation starts there)."""
        block_size = self.block_manager.block_size
        num_cached_tokens = prefix.num_blocks * block_size
        num_prefill_tokens = _num_prefill_tokens(waiting)
        cuts = {prefix.num_matched_blocks * block_size,
                num_shared_behind,
                len(waiting.request.prompt_token_ids) // block_size * block_size}
        return sorted(cut for cut in cuts if num_cached_tokens < cut <= num_prefill_tokens)

    def _with_snapshot(self, prefix: CachedPrefix) -> CachedPrefix:
        """The longest part of ``prefix`` whose end has a state snapshot: a model with
        linear-attention layers can start after cached blocks only with the state
        there (never a state that does not match its prefix: the snapshot is keyed
        by the chained hash of every token before it)."""
        state_slots = self.state_slots
        assert state_slots is not None
        block_hashes = prefix.block_hashes
        for num_blocks in range(prefix.num_blocks, 0, -1):
            if state_slots.has_snapshot(block_hashes[num_blocks - 1]):
                return CachedPrefix(prefix.root_hash, prefix.block_ids[:num_blocks],
                                    block_hashes[:num_blocks],
                                    state_slots.snapshot_slot(block_hashes[num_blocks - 1]),
                                    block_hashes)
        return CachedPrefix(prefix.root_hash, [], [], None, block_hashes)

    def _waits_for_a_chunk_seat(self, waiting: WaitingRequest, admission: _Admission,
                                step: _StepBuilder) -> bool:
        """Whether it could start only with a one-token chunk (this batch's chunk seats
        are taken) while a whole block of its prompt is left before its last token.
        Started so, it would compute its whole prompt, a token a batch, from whatever
        was cached now; waiting for a seat, it starts after what the chunks ahead of it
        cache meanwhile (in vLLM's prefix_repetition, a burst of requests would
        otherwise all miss their prefix). A shorter rest could never start from a
        longer hit: it starts at once, a token a batch."""
        num_left = _num_prefill_tokens(waiting) - 1 - admission.num_cached_tokens
        return not step.num_free_chunk_seats and num_left >= self.block_manager.block_size

    def _waits_for_a_saved_state(self, prefix: CachedPrefix, step: _StepBuilder) -> bool:
        """Whether a chunk of this batch ends where ``prefix``'s cached blocks reach past
        its best snapshot. The state there is saved first thing in the next batch, and a
        request admitted then starts there instead of recomputing the shared part (in
        vLLM's prefix_repetition, every request admitted beside the one that cuts at the
        branch point would): so it waits a batch, and those behind it with it."""
        if not step.snapshots_wanted or prefix.num_matched_blocks <= prefix.num_blocks:
            return False
        past_best = set(prefix.matched_block_hashes[prefix.num_blocks:])
        return any(block_hash in past_best for _, block_hash, _ in step.snapshots_wanted)

    def _cache_full_blocks(self, running: RunningRequest) -> None:
        """Cache its blocks that are full of known tokens and scheduled, and not
        hashed yet: O(new full blocks). (A block ending in a placeholder, a token
        the step in flight is still sampling, is left out: its id is unknown.)"""
        block_size = self.block_manager.block_size
        num_full_blocks = min(running.num_computed_tokens, running.num_known_tokens) // block_size
        block_hashes = running.block_hashes
        num_hashed = len(block_hashes)
        if num_full_blocks <= num_hashed:
            return
        parent_hash = block_hashes[-1] if block_hashes else running.root_hash
        assert parent_hash is not None
        new_hashes = chain_block_hashes(
            parent_hash, running.token_ids_between(num_hashed * block_size,
                                                   num_full_blocks * block_size), block_size)
        cache_block = self.block_manager.cache_block
        for block_id, block_hash in zip(running.block_ids[num_hashed:num_full_blocks],
                                        new_hashes, strict=True):
            cache_block(block_id, block_hash)
        block_hashes += new_hashes

    def _root_hash(self, cache_salt: str | None) -> bytes:
        if cache_salt is None:
            return self._unsalted_root_hash
        return root_block_hash(self._model_identity, cache_salt)


def _sort_key_of(running: RunningRequest) -> tuple[int, ...]:
    return running.sort_key


class _Admission:
    """What starting a pulled request now would take (``Scheduler._plan_admission``)."""

    __slots__ = ("prefix", "num_cached_tokens", "num_tokens", "num_new_blocks",
                 "snapshot_cuts", "num_shared_tokens")

    def __init__(self, prefix: CachedPrefix, num_cached_tokens: int, num_tokens: int,
                 num_new_blocks: int, snapshot_cuts: list[int], num_shared_tokens: int) -> None:
        self.prefix = prefix
        self.num_cached_tokens = num_cached_tokens
        self.num_tokens = num_tokens
        self.num_new_blocks = num_new_blocks
        self.snapshot_cuts = snapshot_cuts
        # how far its prompt is known to be shared (RunningRequest.num_shared_tokens)
        self.num_shared_tokens = num_shared_tokens


class _ReleasedBlocks:
    """Counts the blocks that preempting some requests would free, shared blocks
    included (a block is freed when its last holder goes). ``kept`` blocks (the
    waiting request's own cache hits) count as taken, not freed."""

    def __init__(self, block_manager: BlockManager, kept_block_ids: list[int]) -> None:
        self._block_manager = block_manager
        self._kept_block_ids = set(kept_block_ids)
        self._num_released: dict[int, int] = {}

    def release(self, block_ids: list[int]) -> int:
        """Release one holder's references; how many blocks that frees."""
        num_freed = 0
        for block_id in block_ids:
            num_released = self._num_released.get(block_id, 0) + 1
            self._num_released[block_id] = num_released
            if (num_released == self._block_manager.ref_count(block_id)
                    and block_id not in self._kept_block_ids):
                num_freed += 1
        return num_freed


def model_identity(config: EngineConfig) -> str:
    """What besides the tokens decides a block's KV values: the model and how it
    is loaded (dummy weights come from the seed). Salts every block hash."""
    identity = "|".join((config.model, config.dtype, config.load_format, str(config.seed)))
    identity += f"|{config.quantization}" if config.quantization else ""
    return identity + (f"|kv-{config.kv_cache_dtype}" if config.kv_cache_dtype != "auto" else "")


def _num_prefill_tokens(waiting: WaitingRequest) -> int:
    return len(waiting.request.prompt_token_ids) + len(waiting.output_token_ids)


def _num_tokens_shared(waiting: WaitingRequest, followers: Iterable[WaitingRequest],
                       block_size: int) -> int:
    """The longest whole-block prefix of its prompt that a follower's prompt (with the
    same cache salt) starts with. Slices compare in C; a follower that cannot beat the
    best so far costs one block's comparison (the block past the best, where prompts of
    another prefix or of the same one diverge), so a burst costs a block per follower."""
    tokens = waiting.request.prompt_token_ids
    salt = waiting.request.cache_salt
    num_shared_blocks = 0
    for follower in followers:
        other = follower.request.prompt_token_ids
        low = num_shared_blocks + 1  # fewest blocks that beat the best so far
        high = min(len(tokens), len(other)) // block_size
        start = (low - 1) * block_size
        if (follower.request.cache_salt != salt or low > high
                or tokens[start:start + block_size] != other[start:start + block_size]
                or tokens[:start] != other[:start]):
            continue
        while low < high:  # the most blocks both start with, in [low, high]
            middle = (low + high + 1) // 2
            if tokens[:middle * block_size] == other[:middle * block_size]:
                low = middle
            else:
                high = middle - 1
        num_shared_blocks = low
    return num_shared_blocks * block_size


# -- the actor ------------------------------------------------------------------


async def _send_ready_bitmasks(scheduler: Scheduler,
                               runner: trio.MemorySendChannel[Any]) -> None:
    """Fill and send the StepBitmasks of every step whose masks can be filled now.

    On the event loop, at once: at depth 2 the device waits for these masks once the
    step's forward pass is done, so they go before anything else the loop has to do.
    One call into xgrammar fills a step's rows (about 0.8 ms for 64 rows of a 150k
    vocabulary on the H200's host, without the GIL); a worker thread had to win the GIL
    back from the busy loop to start and to finish, and that wait made the step later,
    not earlier (docs/performance.md, "Structured outputs"). Sent right after its batch
    (or after the result that made it ready), so each StepBitmasks follows its batch in
    the runner's inbox. No checkpoint when nothing is ready: unconstrained steps keep
    the scheduler's interleaving exactly as it is without grammars."""
    while (step := scheduler.ready_bitmasks()) is not None:
        step_id, grammars = step
        await runner.send(StepBitmasks(step_id=step_id,
                                       token_bitmasks=fill_bitmasks(grammars)))


class _Outboxes:
    """The scheduler actor's three outboxes, passed around as one."""

    def __init__(self, queue: trio.MemorySendChannel[Any], runner: trio.MemorySendChannel[Any],
                 detokenizer: trio.MemorySendChannel[Any]) -> None:
        self.queue = queue
        self.runner = runner
        self.detokenizer = detokenizer


async def run_scheduler(
    inbox: trio.MemoryReceiveChannel[SchedulerInbox],
    queue_outbox: trio.MemorySendChannel[QueueInbox],
    runner_outbox: trio.MemorySendChannel[RunnerInbox],
    detokenizer_outbox: trio.MemorySendChannel[DetokenizerInbox],
    scheduler: Scheduler,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consume Pulled, StepResult, Abort and StopStringHit; emit Pull, Requeue
    and AbortOutcome to the queue, ScheduledBatch and StepBitmasks to the runner, Track and
    TokenBatch to the detokenizer.

    Plans a step whenever fewer than the pipeline depth are in flight; waits
    on its inbox otherwise, but only while a step is in flight: with none, no
    message is bound to come, so an idle scheduler waits in the queue instead
    (a Pull that waits for a request). Runs until cancelled; closes its
    outboxes then.
    """
    task_status.started()
    async with queue_outbox, runner_outbox, detokenizer_outbox:
        outboxes = _Outboxes(queue_outbox, runner_outbox, detokenizer_outbox)
        while True:
            if scheduler.can_plan_step():
                pulled = await _pull(inbox, scheduler, outboxes)
                plan = scheduler.schedule(pulled)
                await _send_plan(plan, outboxes)
                await _send_ready_bitmasks(scheduler, outboxes.runner)
                # Nothing planned and nothing in flight: the last request finished
                # while a Pull that does not wait was answered. Ask again, waiting.
                if plan.batch is not None or not scheduler.num_in_flight:
                    continue
            await _handle(await inbox.receive(), scheduler, outboxes)


async def _pull(inbox: trio.MemoryReceiveChannel[SchedulerInbox], scheduler: Scheduler,
                outboxes: _Outboxes) -> list[WaitingRequest]:
    """Ask the queue for requests; handle what else arrives meanwhile."""
    pull = scheduler.next_pull()
    if pull is None:
        return []
    await outboxes.queue.send(pull)
    while True:
        message = await inbox.receive()
        if isinstance(message, Pulled):
            return message.requests
        await _handle(message, scheduler, outboxes)


async def _send_plan(plan: StepPlan, outboxes: _Outboxes) -> None:
    for track in plan.tracks:
        await outboxes.detokenizer.send(track)
    if plan.requeue is not None:
        await outboxes.queue.send(plan.requeue)
    if plan.batch is not None:
        await outboxes.runner.send(plan.batch)


async def _handle(message: SchedulerInbox, scheduler: Scheduler, outboxes: _Outboxes) -> None:
    match message:
        case StepResult():
            tokens = scheduler.on_step_result(message)
            await _send_ready_bitmasks(scheduler, outboxes.runner)  # the runner waits
            if tokens is not None:
                await outboxes.detokenizer.send(tokens)
        case Abort(request_id=request_id):
            aborted = scheduler.abort(request_id)
            if aborted is not None:
                await outboxes.detokenizer.send(aborted)
            await outboxes.queue.send(AbortOutcome(request_id=request_id))
        case StopStringHit(request_id=request_id):
            scheduler.on_stop_string_hit(request_id)
        case Pulled():
            raise AssertionError("Pulled without an outstanding Pull")


def _new_request_data(running: RunningRequest) -> NewRequestData:
    """What the runner learns of a request that starts (or restarts): its sampling
    options and, with penalties, the tokens they count so far."""
    request = running.request
    sampling = request.sampling
    if not sampling.has_penalties:
        return NewRequestData(request_id=running.request_id, sampling=sampling,
                              pooling=request.pooling, state_slot=running.state_slot)
    prompt_token_ids = request.prompt_token_ids if sampling.repetition_penalty != 1.0 else []
    return NewRequestData(request_id=running.request_id, sampling=sampling,
                          prompt_token_ids=prompt_token_ids,
                          output_token_ids=list(running.output_token_ids),
                          state_slot=running.state_slot)
