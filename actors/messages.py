"""Every message that crosses a channel between the engine's actors.

Messages carry ids, counts, block ids and token lists only: no tensors, no
callables. Each inbox has one tagged union, dispatched with ``match``.

Flow (see docs/architecture.md):

    facade --Submit/Abort--> intake --Admit/Abort--> queue <--Pull/Requeue/AbortOutcome-- scheduler
    queue --Pulled/Abort--> scheduler --ScheduledBatch--> runner --StepResult--> scheduler
    scheduler --Track/TokenBatch--> detokenizer --StopStringHit--> scheduler
"""

from __future__ import annotations

import array
import math
import sys
import threading
from typing import Annotated, Any, Literal

import msgspec

from trio_llm.actors.errors import RequestRejected

FinishReason = Literal["stop", "length", "abort"]

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
# OpenAI's ranges: presence and frequency penalties -2..2, a logit bias -100..100.
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]


# -- structured outputs (grammar constraints) ----------------------------------


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on a request's output, as vLLM's ``structured_outputs``: exactly
    one of ``json`` (a JSON Schema, serialised), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, xgrammar's
    dialect of GBNF). Compiled by trio_llm.actors.grammar; the scheduler masks every
    sampled token with it."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """What a caller asks of one request; field names follow vLLM's SamplingParams.

    ``max_tokens`` None means as many as fit: the rest of the context window
    (and of the KV cache). ``top_k`` 0 or -1 and ``top_p`` 1.0 disable those
    filters; ``temperature`` 0 is greedy. ``seed`` None draws a seed from the
    engine's own seed at intake, so every request samples from randomness keyed
    by (seed, output position).

    Penalties as vLLM defines them: ``presence_penalty`` is subtracted from the
    logit of every token already in the output, ``frequency_penalty`` times the
    number of times it is there; ``repetition_penalty`` divides the positive
    logits (multiplies the negative ones) of every token in the prompt or the
    output. ``logit_bias`` (OpenAI's) adds to the logits of token ids;
    ``allowed_token_ids`` (vLLM's) keeps only those tokens. ``prompt_logprobs``
    (vLLM's): the logprob of every prompt token after the first, with that many
    alternatives (the request then never starts from cached blocks: every prompt
    position must be computed). ``truncate_prompt_tokens`` (vLLM's): keep only the
    prompt's last k tokens (-1: as many as the context holds), after the chat
    template when there is one. ``add_special_tokens`` (vLLM's): whether the
    tokenizer adds its special tokens (BOS and the like) to the prompt's text; None
    is the default, true for a text prompt, false for a chat template's output
    (which wrote them already).
    """

    max_tokens: PositiveInt | None = 16
    min_tokens: NonNegativeInt = 0
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = 0
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: NonNegativeInt | None = None  # at most EngineConfig.max_logprobs
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    logit_bias: dict[int, LogitBias] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    add_special_tokens: bool | None = None

    def __post_init__(self) -> None:
        check_sampling_params(self)


# A seed is a signed 64-bit integer.
MAX_SEED = 2**63 - 1
MIN_SEED = -(2**63)
_checking = threading.local()


def check_sampling_params(params: SamplingParams) -> None:
    """The one definition of what makes sampling parameters valid on their own,
    applied at construction and again at intake: each field within its range,
    then the rules across fields. Raises RequestRejected naming the field (a 400
    over HTTP). What needs the engine (the vocabulary, --max-logprobs, stop
    string limits) intake checks. A single stop string becomes a list (vLLM's)."""
    if getattr(_checking, "active", False):
        return  # the conversion below constructs the struct again
    if isinstance(params.stop, str):
        msgspec.structs.force_setattr(params, "stop", [params.stop])
    fields = msgspec.structs.asdict(params)
    _checking.active = True
    try:
        msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as error:
        raise rejection_from(error, fields) from None
    finally:
        _checking.active = False
    _check_sampling_rules(params)


def _check_sampling_rules(params: SamplingParams) -> None:
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise RequestRejected(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
            f"({params.max_tokens})", param="min_tokens")
    if params.seed is not None and not MIN_SEED <= params.seed <= MAX_SEED:
        raise RequestRejected(f"seed {params.seed} does not fit in a signed 64-bit integer",
                              param="seed")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise RequestRejected(f"{name} must be a finite number", param=name)


def rejection_from(error: msgspec.ValidationError, fields: dict[str, object]
                   ) -> RequestRejected:
    """'Expected `int` >= 1 - at `$.max_tokens`' -> a rejection naming max_tokens and its value."""
    message = str(error)
    expected, _, location = message.rpartition(" - at ")
    field = location.strip("`").removeprefix("$.").split("[")[0].split(".")[0]
    if not expected or field not in fields:
        return RequestRejected(f"invalid sampling parameters: {message}")
    expected = expected.replace("`", "")
    return RequestRejected(f"invalid {field}={fields[field]!r}: {expected}", param=field)


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True):
    """What a caller asks of an embedding request (vLLM's PoolingParams): the
    engine runs the prompt and returns its pooled hidden state instead of
    generating. ``dimensions`` keeps the vector's first n entries (Matryoshka
    truncation, before normalising), only where the model declares it may;
    ``normalize`` None is the model's default (its sentence-transformers config,
    else true). ``truncate_prompt_tokens`` and ``add_special_tokens`` as in
    SamplingParams."""

    dimensions: PositiveInt | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    add_special_tokens: bool | None = None


PoolingType = Literal["last", "mean"]


class PoolingOptions(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """An embedding request, resolved by intake for the scheduler and the runner:
    which hidden states to pool (the last prompt token's, or the mean over every
    prompt token), whether to normalise (L2), and how many leading dimensions to
    keep (None: all). The runner pools after the model's final norm."""

    pooling_type: PoolingType
    normalize: bool
    dimensions: int | None = None


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The part of a request the runner needs to sample its tokens.

    ``seed`` is always resolved. ``banned_token_ids`` are masked to -inf while the
    output position is below ``min_tokens`` (vLLM's min_tokens semantics: EOS and
    stop token ids cannot end the request early). ``logit_bias_token_ids`` and
    ``logit_bias_values`` are SamplingParams.logit_bias as two parallel lists;
    ``allowed_token_ids`` None allows every token.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    num_logprobs: int | None
    min_tokens: int
    banned_token_ids: list[int]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias_token_ids: list[int] = []
    logit_bias_values: list[float] = []
    allowed_token_ids: list[int] | None = None
    num_prompt_logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the counts of the tokens before (sampler.PenaltyCounts)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """An admitted request, as intake validated and tokenized it.

    ``stop_token_ids`` already holds EOS ids unless ``ignore_eos``; ``max_tokens``
    is resolved (never over max_model_len minus the prompt). ``cache_salt``
    (vLLM's field) keeps its prefix-cache blocks apart from other salts'.
    ``pooling`` (an embedding request): ``max_tokens`` is 0, and the request
    finishes with its pooled hidden state once its last prompt chunk ran.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingOptions
    stop_token_ids: list[int]
    max_tokens: int
    priority: int
    arrival_index: int
    arrival_time: float
    cache_salt: str | None = None
    # the HTTP request it is one choice of (n, best_of, batched prompts): one group's
    # requests share at most --max-seq-share of the seats while others wait
    group_id: str | None = None
    pooling: PoolingOptions | None = None


# -- facade -> intake ---------------------------------------------------------


class ChatTemplateOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How a conversation is rendered (vLLM's request fields of the same names):
    ``add_generation_prompt`` opens the assistant's turn after the messages;
    ``continue_final_message`` leaves the last message open instead (no end of
    turn), for the model to continue it. The two exclude each other."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


class Submit(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A new request from the facade. Exactly one of prompt, prompt_token_ids, messages.
    ``cache_salt``: only requests with the same salt share prefix-cache blocks.

    ``tools`` (OpenAI function definitions), ``documents`` (for retrieval-augmented
    templates) and ``chat_template_kwargs`` reach the chat template with
    ``messages``; a message may carry ``tool_calls`` or ``tool_call_id``.
    ``pooling`` makes it an embedding request (``params`` then unused): only an
    engine with the pooling runner takes it.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    template_options: ChatTemplateOptions = msgspec.field(default_factory=ChatTemplateOptions)
    params: SamplingParams
    priority: int = 0
    arrival_time: float
    cache_salt: str | None = None
    group_id: str | None = None  # see Request.group_id
    pooling: PoolingParams | None = None


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """End a request early (caller left, or engine.abort). Forwarded along the graph."""

    request_id: str


IntakeInbox = Submit | Abort


# -- intake -> queue, scheduler -> queue --------------------------------------


class Admit(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A validated request enters the waiting set."""

    request: Request


class Pull(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The scheduler asks for up to ``max_requests`` waiting requests, best first.

    With ``wait`` the queue answers only once at least one request is waiting
    (the scheduler is idle); otherwise it answers at once, possibly empty.
    ``group_seats``: how many more requests of each group (Request.group_id) with
    requests running may start now (a group not named: its whole share).
    """

    max_requests: int
    wait: bool
    group_seats: dict[str, int] = {}


class Requeue(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Requests go back to the waiting set: preempted, or pulled but not admitted.

    A preempted request carries the output it already has and is recomputed
    from prompt + output when it runs again.
    """

    requests: list[WaitingRequest]


class AbortOutcome(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The scheduler's answer to an Abort the queue forwarded: lets the queue
    forget the abort, after any Requeue of that request sent earlier has arrived."""

    request_id: str


QueueInbox = Admit | Abort | Pull | Requeue | AbortOutcome


class WaitingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request in the waiting set, with the output it had when preempted."""

    request: Request
    output_token_ids: list[int] = []
    num_preemptions: int = 0


# -- queue -> scheduler, runner -> scheduler, detokenizer -> scheduler --------


class Pulled(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The queue's answer to Pull: requests in (priority, arrival) or FCFS order."""

    requests: list[WaitingRequest]
    num_waiting: int


class ScheduledRequest(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One request's share of a step.

    ``token_ids`` are this step's input tokens (a prefill chunk, or one decode
    token). When ``input_from_previous_step`` is set the single input token is
    the one the runner sampled for this request in the previous step, not yet
    known to the scheduler (depth-2 pipelining), and ``token_ids`` is empty.
    ``new_block_ids`` extend the request's block table. ``sample`` is false for
    a prefill chunk that does not reach the end of the prompt;
    ``output_index`` is the position in the output of the token sampled now.
    ``token_bitmask`` (constrained requests only, when ``sample`` is set) holds
    the tokens the grammar allows now: little-endian int32 words, bit j of word
    w set when token 32 * w + j may be sampled. ``bitmask_follows``: a constrained
    request decoding on a placeholder, whose bitmask depends on the token still in
    flight; it arrives in a StepBitmasks for this step, and the runner samples the
    step only then. ``prompt_logprob_token_ids`` (a request with prompt logprobs):
    the prompt tokens that follow this chunk's first positions, one per position
    whose logprob the runner reports (StepResult.prompt_logprobs). ``pool``: the
    last prompt chunk of an embedding request, which returns the pooled hidden
    state (StepResult.pooled) instead of sampling.
    """

    request_id: str
    token_ids: list[int]
    input_from_previous_step: bool
    num_computed_tokens: int
    new_block_ids: list[int]
    sample: bool
    output_index: int
    token_bitmask: bytes | None = None
    bitmask_follows: bool = False
    prompt_logprob_token_ids: list[int] = []
    pool: bool = False


class NewRequestData(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Sent once, the first step a request (or a recomputed one) runs.

    A request with penalties (``sampling.has_penalties``) brings the tokens they
    count: its output so far (a recomputed request's) and, with a repetition
    penalty, its prompt. The runner counts every token it samples after that
    itself, so the counts never wait for the host (depth 2). An embedding request
    brings its ``pooling``: every chunk of a mean-pooled one adds to its sum.
    """

    request_id: str
    sampling: SamplingOptions
    prompt_token_ids: list[int] = []
    output_token_ids: list[int] = []
    pooling: PoolingOptions | None = None
    # A model with linear-attention layers (the hybrid family): the request's slot
    # in the state cache, given at admission, its until the request leaves.
    state_slot: int | None = None


class ScheduledBatch(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """One engine step for the runner to execute exactly.

    ``finished_request_ids``: the runner drops their state before this step
    (finished, aborted, preempted since the previous batch). ``state_copies``
    (hybrid models): (source slot, destination slot) pairs of the state cache the
    runner copies, in order, before the step's forward: a running request's state
    saved for the prefix cache, or a cached prefix's state restored into a newly
    admitted request's slot.
    """

    step_id: int
    new_requests: list[NewRequestData]
    requests: list[ScheduledRequest]
    finished_request_ids: list[str]
    num_tokens: int
    state_copies: list[tuple[int, int]] = []


class StepBitmasks(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The token bitmasks of step ``step_id``'s rows that had ``bitmask_follows``, in
    batch order. Sent as soon as the step before it is reconciled: the step's forward
    pass may already run, only its sampling waits for these."""

    step_id: int
    token_bitmasks: list[bytes]


RunnerInbox = ScheduledBatch | StepBitmasks


def needs_bitmasks(batch: ScheduledBatch) -> bool:
    """Whether some row of ``batch`` samples only once its StepBitmasks arrive."""
    return any(scheduled.bitmask_follows for scheduled in batch.requests)


def with_bitmasks(batch: ScheduledBatch, token_bitmasks: list[bytes]) -> ScheduledBatch:
    """``batch`` with the bitmasks that followed it in place."""
    bitmasks = iter(token_bitmasks)
    requests = [msgspec.structs.replace(scheduled, token_bitmask=next(bitmasks),
                                        bitmask_follows=False)
                if scheduled.bitmask_follows else scheduled for scheduled in batch.requests]
    assert next(bitmasks, None) is None, "one bitmask per row that waited for one"
    return msgspec.structs.replace(batch, requests=requests)


class TokenLogprobs(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Log-probability of the sampled token and of the top alternatives (raw model distribution)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One chunk's prompt logprobs: for each of its ``prompt_logprob_token_ids``, that
    token's logprob (and the best alternatives) at the position before it."""

    request_id: str
    logprobs: list[TokenLogprobs]


class PooledOutput(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """An embedding request's vector: float32 values, little-endian, as bytes (no
    tensor crosses a channel; bytes cost msgpack a copy, where a list of floats
    costs a Python object per dimension). Truncated and normalised as asked."""

    request_id: str
    data: bytes


class StepResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The runner's answer to one ScheduledBatch: one sampled token for each
    request that had ``sample`` set, in batch order; one pooled vector for each
    that had ``pool`` set."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[PromptLogprobs] = []
    pooled: list[PooledOutput] = []


class StopStringHit(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The detokenizer found a stop string: the scheduler frees the request."""

    request_id: str


SchedulerInbox = Pulled | Abort | StepResult | StopStringHit


# -- scheduler -> detokenizer -------------------------------------------------


class Track(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Start decoding a request's output (sent when it first runs)."""

    request: Request


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """New output tokens of one request, and its finish reason once it finished.

    ``stop_reason`` is the stop token id that ended it, if one did. Made once
    per running request in every step and holding no reference back to
    anything, it stays out of the garbage collector's sight (``gc=False``).
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None
    finish_reason: FinishReason | None
    stop_reason: int | None = None
    # with the first output token of a request with prompt logprobs: one per prompt
    # token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # an embedding request's vector (PooledOutput.data), with its finish
    embedding: bytes | None = None


class TokenBatch(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Every request's new tokens from one step, plus aborts and finishes."""

    deltas: list[TokenDelta]


DetokenizerInbox = Track | TokenBatch


# -- detokenizer -> request streams (not a channel: see actors/streams.py) ----


class RequestOutput(msgspec.Struct, kw_only=True, gc=False):
    """A delta of one request's output, as its caller sees it.

    ``text`` and ``token_ids`` are new since the previous output; several step
    deltas may be coalesced into one when the caller reads slowly.
    ``queue_time`` (seconds from arrival to first scheduled) is set on the
    first output; the ``num_*`` counts are running totals. Like TokenDelta,
    made per request and step and never part of a cycle: ``gc=False``.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    queue_time: float | None = None
    # on the first output: the prompt's token ids as the model saw them (after the
    # chat template and truncate_prompt_tokens); with SamplingParams.prompt_logprobs,
    # their logprobs too (None for the first)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # an embedding request's vector, on its one (finished) output: float32 values,
    # little-endian (``embedding_values`` reads them)
    embedding: bytes | None = None


def embedding_values(data: bytes) -> list[float]:
    """An embedding's float32 little-endian bytes as Python floats."""
    values = array.array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
