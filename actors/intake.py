"""The intake actor: the engine's front door.

Every Submit is validated, tokenized (chat messages through the model's chat
template) and resolved into a Request: stop token ids with EOS, a seed for
every request, sampling options for the runner. A request that could never be
served is refused here with a RequestRejected naming the field at fault, so
nothing waits in the queue forever. Known bad input is a rejection, and so is
a failure of the tokenizer or the chat template on one request's input (it
belongs to that request, as vLLM answers it with a 400); any other bug raises
and takes the engine down loudly (the supervisor fails every request).

Admission runs in a worker thread, one request at a time in arrival order:
tokenizing and rendering cost time linear in the request's size, and must not
stall the event loop that streams every other request.

A constraint (structured outputs) is checked here against the engine's limits on
its shape (actors/constraint_cost.py), which bound what compiling it can cost;
it compiles later, once, where the queue is (actors/queue.py), so that in the
served layout the API server never compiles what the engine core compiles again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.constraint_cost import (
    ConstraintTooCostly,
    check_constraint,
    constraint_limits,
)
from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.grammar import constraint_kind
from trio_llm.actors.messages import (
    Abort,
    Admit,
    ChatTemplateOptions,
    IntakeInbox,
    PoolingParams,
    QueueInbox,
    Request,
    SamplingOptions,
    SamplingParams,
    Submit,
    check_sampling_params,
    rejection_from,
)
from trio_llm.actors.pooling import PoolingConfig
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.tokenizer import Tokenizer, TooManyTokens

T = TypeVar("T")

# Stop strings are matched on every step of their request, in a window as
# long as the longest of them; vLLM bounds neither their number nor their
# length, so these bounds are ours (OpenAI's API allows 4). At the bounds a
# step's matching costs at most about 0.1 ms (docs/http-api.md).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
# The device samples in float32: a larger temperature cannot be divided by,
# and any temperature this large already means a uniform choice.
MAX_TEMPERATURE = 3.4028234663852886e38
# OpenAI documents no bound on logit_bias entries; this one is ours, so a request
# cannot make every step scatter a vocabulary's worth of biases.
MAX_LOGIT_BIAS_ENTRIES = 1024
_MASK_64 = 2**64 - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def derive_seed(engine_seed: int, arrival_index: int) -> int:
    """A 63-bit seed for a request that brought none: a SplitMix64 mix of the
    engine's seed and the request's arrival index, so a rerun of the same
    requests in the same order samples the same tokens."""
    mixed = (engine_seed + (arrival_index + 1) * _GOLDEN_GAMMA) & _MASK_64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (mixed ^ (mixed >> 31)) >> 1


class Intake:
    """Turns a Submit into a Request, or refuses it with RequestRejected.

    ``num_kv_tokens`` is the whole KV cache in tokens: a request whose prompt
    plus max_tokens exceeds it could never be scheduled. Owns the arrival
    counter (one per admitted request). ``pooling`` (the pooling runner: the
    model serves embeddings) makes it admit embedding requests only.
    """

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, *, max_model_len: int,
                 num_kv_tokens: int, vocab_size: int, serves_constraints: bool = True,
                 pooling: PoolingConfig | None = None) -> None:
        self.config = config
        self.pooling = pooling
        self.serves_constraints = serves_constraints
        self.constraint_limits = constraint_limits(config)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.num_kv_tokens = num_kv_tokens
        self.vocab_size = vocab_size
        self.num_admitted = 0
        # A text longer than this holds more than max_model_len tokens whatever it says:
        # refused without tokenizing it (a 7 MB prompt took 1.6 GB to tokenize).
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)

    def admit(self, submit: Submit) -> Request:
        """Validate and tokenize one request. Raises RequestRejected(message, param=...)."""
        if not isinstance(submit.priority, int):
            raise RequestRejected(f"priority must be an integer, not {submit.priority!r}",
                                  param="priority")
        if submit.priority != 0 and self.config.scheduling_policy != "priority":
            # vLLM refuses it too: under fcfs it could only be accepted and ignored
            raise RequestRejected(
                f"priority {submit.priority} needs the priority scheduling policy "
                "(--scheduling-policy priority); this engine schedules first come, "
                "first served", param="priority")
        if submit.pooling is not None or self.pooling is not None:
            return self._admit_for_pooling(submit)
        params = self._validated_params(submit.params)
        _check_cache_salt(submit.cache_salt)
        prompt_token_ids = self._prompt_token_ids(submit, params)
        max_tokens = self._max_tokens(len(prompt_token_ids), params, _prompt_param(submit))
        stop_token_ids = self._stop_token_ids(params)
        _check_allowed_after_bans(params, stop_token_ids)
        arrival_index = self.num_admitted
        self.num_admitted += 1
        return Request(
            request_id=submit.request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            sampling=self._sampling_options(params, stop_token_ids, arrival_index),
            stop_token_ids=stop_token_ids,
            max_tokens=max_tokens,
            priority=submit.priority,
            arrival_index=arrival_index,
            arrival_time=submit.arrival_time,
            cache_salt=submit.cache_salt,
            group_id=submit.group_id,
        )

    # -- embedding requests (the pooling runner) -------------------------------

    def _admit_for_pooling(self, submit: Submit) -> Request:
        """An embedding request: its prompt, run once, finishes with its pooled
        hidden state (max_tokens 0, nothing sampled)."""
        model_name = self.config.served_model_name or self.config.model
        if self.pooling is None:
            raise RequestRejected(
                f"model {model_name!r} is not served as an embedding model: start the server "
                f"with --runner pooling (or --task embed) to serve embeddings", param="model")
        if submit.pooling is None:
            raise RequestRejected(
                f"model {model_name!r} is served as an embedding model (--runner pooling): it "
                f"generates no text; ask /v1/embeddings (Engine.embed), or serve it without "
                f"--runner pooling to generate")
        pooling = self._validated_pooling(submit.pooling)
        options = self.pooling.options(pooling, model_name)
        prompt_params = SamplingParams(truncate_prompt_tokens=pooling.truncate_prompt_tokens,
                                       add_special_tokens=pooling.add_special_tokens)
        _check_cache_salt(submit.cache_salt)
        prompt_token_ids = self._prompt_token_ids(submit, prompt_params)
        if len(prompt_token_ids) > self.max_model_len:  # token ids, or a rendered chat
            raise self._over_the_context(len(prompt_token_ids), _prompt_param(submit))
        if len(prompt_token_ids) > self.num_kv_tokens:
            raise RequestRejected(
                f"the KV cache holds {self.num_kv_tokens} tokens in all, but the input has "
                f"{len(prompt_token_ids)} tokens: it could never be scheduled",
                param=_prompt_param(submit))
        arrival_index = self.num_admitted
        self.num_admitted += 1
        return Request(
            request_id=submit.request_id, prompt_token_ids=prompt_token_ids,
            params=prompt_params, sampling=self._sampling_options(prompt_params, [], 0),
            stop_token_ids=[], max_tokens=0, priority=submit.priority,
            arrival_index=arrival_index, arrival_time=submit.arrival_time,
            cache_salt=submit.cache_salt, pooling=options)

    @staticmethod
    def _validated_pooling(pooling: PoolingParams) -> PoolingParams:
        if not isinstance(pooling, PoolingParams):
            raise RequestRejected(f"pooling parameters must be a PoolingParams, not "
                                  f"{type(pooling).__name__}")
        fields = msgspec.structs.asdict(pooling)
        try:
            return msgspec.convert(fields, PoolingParams)
        except msgspec.ValidationError as error:
            raise rejection_from(error, fields) from None

    # -- sampling parameters --------------------------------------------------

    def _validated_params(self, params: SamplingParams) -> SamplingParams:
        """Check every field against its msgspec constraints (a Struct's
        constructor does not), then the rules that span fields."""
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"sampling parameters must be a SamplingParams, not "
                                  f"{type(params).__name__}")
        # Checked at construction already, unless built around the constructor
        # (msgspec.structs.replace, a decoder): again, by the same definition.
        check_sampling_params(params)
        self._check_sampling_rules(params)
        return self._normalized(params)

    def _normalized(self, params: SamplingParams) -> SamplingParams:
        """Values the device could not hold, mapped to ones that sample the same."""
        changes: dict[str, object] = {}
        if params.top_k == -1 or params.top_k >= self.vocab_size:
            changes["top_k"] = 0  # -1, 0 and a whole vocabulary all mean off (vLLM's)
        # top_p is float32 on the device, where 1e-300 is 0 and would keep no
        # token. Any top_p up to the likeliest token's probability (at least
        # 1/vocab_size) keeps that token alone; half of that is one, in float32.
        min_top_p = 0.5 / self.vocab_size
        if params.top_p < min_top_p:
            changes["top_p"] = min_top_p
        if params.temperature > MAX_TEMPERATURE:
            changes["temperature"] = MAX_TEMPERATURE
        return msgspec.structs.replace(params, **changes) if changes else params

    def _check_sampling_rules(self, params: SamplingParams) -> None:
        """The rules that need the engine (check_sampling_params has the rest)."""
        self._check_stop_strings(params.stop)
        self._check_structured_outputs(params)
        self._check_logprobs(params.logprobs)
        self._check_in_vocabulary(params.stop_token_ids, "stop_token_ids")
        self._check_penalties(params)

    def _check_in_vocabulary(self, token_ids: list[int], param: str) -> None:
        bad_ids = [token_id for token_id in token_ids if not 0 <= token_id < self.vocab_size]
        if bad_ids:
            raise RequestRejected(
                f"{param} {bad_ids[:8]} are outside the vocabulary "
                f"(ids 0 to {self.vocab_size - 1})", param=param)

    def _check_penalties(self, params: SamplingParams) -> None:
        if params.logit_bias is not None:
            if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise RequestRejected(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} "
                                      f"entries, not {len(params.logit_bias)}",
                                      param="logit_bias")
            self._check_in_vocabulary(list(params.logit_bias), "logit_bias")
        if params.allowed_token_ids is not None:
            if not params.allowed_token_ids:
                raise RequestRejected("allowed_token_ids must not be empty",
                                      param="allowed_token_ids")
            if len(params.allowed_token_ids) > self.vocab_size:
                raise RequestRejected("allowed_token_ids has more ids than the vocabulary",
                                      param="allowed_token_ids")
            self._check_in_vocabulary(params.allowed_token_ids, "allowed_token_ids")
            if params.structured_outputs is not None:
                # the grammar may allow none of them: nothing could be sampled
                raise RequestRejected("allowed_token_ids cannot be combined with structured "
                                      "outputs", param="allowed_token_ids")

    def _check_logprobs(self, num_logprobs: int | None) -> None:
        limit = self.config.max_logprobs
        if limit == -1:
            limit = self.vocab_size
        if num_logprobs is not None and num_logprobs > limit:
            # vLLM's message
            raise RequestRejected(f"Requested sample logprobs of {num_logprobs}, which is "
                                  f"greater than max allowed: {limit}", param="logprobs")

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """What a constraint cannot be combined with: the grammar decides when the
        output may end, so EOS must end it and may not be banned before min_tokens."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        if not self.serves_constraints:
            raise RequestRejected("this engine serves no structured outputs",
                                  param="structured_outputs")
        for name in ("ignore_eos", "min_tokens"):
            if getattr(params, name):
                raise RequestRejected(f"{name} cannot be combined with structured outputs "
                                      f"(the grammar decides where the output ends)",
                                      param=name)
        kinds = constraint_kind(constraint)
        if len(kinds) != 1:
            raise RequestRejected(f"give exactly one constraint of json, json_object, regex, "
                                  f"choice, grammar (got {', '.join(kinds) or 'none'})",
                                  param="structured_outputs")
        try:  # before any compile: what compiling it may cost is bounded
            check_constraint(constraint, self.constraint_limits)
        except ConstraintTooCostly as error:
            raise RequestRejected(f"structured_outputs.{kinds[0]}: {error}",
                                  param="structured_outputs") from None

    def _check_stop_strings(self, stops: list[str]) -> None:
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestRejected(f"at most {MAX_STOP_STRINGS} stop strings are allowed, "
                                  f"not {len(stops)}", param="stop")
        for stop in stops:
            if not stop:
                raise RequestRejected("stop strings must not be empty", param="stop")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise RequestRejected(f"a stop string may have at most {MAX_STOP_STRING_CHARS} "
                                      f"characters, not {len(stop)}", param="stop")

    # -- the prompt -------------------------------------------------------------

    def _keep_last(self, params: SamplingParams) -> int | None:
        """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps
        (vLLM's: -1 is the context length); None keeps them all."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return None
        if keep == 0:  # below -1 msgspec's bound already refused
            raise RequestRejected(f"truncate_prompt_tokens must be at least 1, or -1 (the "
                                  f"context length), not {keep}", param="truncate_prompt_tokens")
        if keep > self.max_model_len:
            raise RequestRejected(
                f"truncate_prompt_tokens ({keep}) is over the model's maximum context "
                f"length ({self.max_model_len})", param="truncate_prompt_tokens")
        return self.max_model_len if keep == -1 else keep

    def _prompt_token_ids(self, submit: Submit, params: SamplingParams) -> list[int]:
        """The prompt's token ids, only the last ``truncate_prompt_tokens`` if set."""
        keep_last = self._keep_last(params)
        add_special_tokens = params.add_special_tokens
        given = [name for name in ("prompt", "prompt_token_ids", "messages")
                 if getattr(submit, name) is not None]
        if len(given) != 1:
            raise RequestRejected(
                "give exactly one of prompt, prompt_token_ids, messages "
                f"(got {', '.join(given) or 'none'})", param="prompt")
        if submit.messages is not None:
            return self._chat_token_ids(
                submit.messages, _template_variables(submit), submit.template_options,
                keep_last=keep_last, add_special_tokens=bool(add_special_tokens))
        if submit.prompt_token_ids is not None:
            token_ids = self._checked_token_ids(submit.prompt_token_ids)
            return token_ids if keep_last is None else token_ids[-keep_last:]
        assert submit.prompt is not None
        return self._text_token_ids(submit.prompt, keep_last,
                                    add_special_tokens=add_special_tokens is not False)

    def _text_token_ids(self, prompt: str, keep_last: int | None = None, *,
                        add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise RequestRejected(f"the prompt must be a string, not {type(prompt).__name__}",
                                  param="prompt")
        token_ids = []
        if prompt:
            token_ids = self._encoded(prompt, "prompt", add_special_tokens=add_special_tokens,
                                      keep_last=keep_last)
        if not token_ids:
            raise RequestRejected("the prompt is empty", param="prompt")
        return token_ids

    def _checked_token_ids(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise RequestRejected("the prompt is empty: no token ids", param="prompt")
        bad_ids = [token_id for token_id in token_ids
                   if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size]
        if bad_ids:
            raise RequestRejected(
                f"prompt token ids {bad_ids[:8]} are outside the vocabulary "
                f"(ids 0 to {self.vocab_size - 1})", param="prompt")
        return list(token_ids)

    def _chat_token_ids(self, messages: list[dict[str, Any]],
                        template_variables: dict[str, Any] | None = None,
                        options: ChatTemplateOptions | None = None, *,
                        keep_last: int | None = None,
                        add_special_tokens: bool = False) -> list[int]:
        if not messages:
            raise RequestRejected("the conversation is empty: no messages", param="messages")
        for index, message in enumerate(messages):
            if not _is_chat_message(message):
                raise RequestRejected(
                    f"message {index} must have a string 'role' and a string 'content'",
                    param="messages")
        options = options or ChatTemplateOptions()
        if options.add_generation_prompt and options.continue_final_message:
            raise RequestRejected("continue_final_message and add_generation_prompt exclude "
                                  "each other", param="continue_final_message")
        text = _scoped_to_request("chat template", "messages",
                                  self.tokenizer.apply_chat_template, messages,
                                  add_generation_prompt=options.add_generation_prompt,
                                  continue_final_message=options.continue_final_message,
                                  **(template_variables or {}))
        # The template already wrote every special token the model expects, unless
        # the request asks for the tokenizer's too (vLLM's add_special_tokens).
        token_ids = self._encoded(text, "messages", add_special_tokens=add_special_tokens,
                                  keep_last=keep_last)
        if not token_ids:
            raise RequestRejected("the chat template rendered an empty prompt", param="messages")
        return token_ids

    def _encoded(self, text: str, param: str, *, add_special_tokens: bool,
                 keep_last: int | None = None) -> list[int]:
        """The text's token ids (only the last ``keep_last`` if set); else a prompt
        over the context is refused from its count, without building its list of ids."""
        if keep_last is None and len(text) > self.max_prompt_chars:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {len(text)} characters: more tokens than that whatever they are "
                "(no token of this tokenizer spans more than "
                f"{self.max_prompt_chars // self.max_model_len} characters)", param=param)
        if keep_last is not None:
            token_ids = _scoped_to_request("tokenizer", param, self.tokenizer.encode, text,
                                           add_special_tokens=add_special_tokens)
            return token_ids[-keep_last:]
        try:
            return _scoped_to_request("tokenizer", param, self.tokenizer.encode, text,
                                      add_special_tokens=add_special_tokens,
                                      max_num_tokens=self.max_model_len)
        except TooManyTokens as error:
            raise self._over_the_context(error.num_tokens, param) from None

    # -- lengths ----------------------------------------------------------------

    def _over_the_context(self, num_prompt_tokens: int, prompt_param: str) -> RequestRejected:
        if self.pooling is not None:  # an embedding request: no output to leave room for
            return RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"input has {num_prompt_tokens} tokens; shorten it, or set "
                f"truncate_prompt_tokens", param=prompt_param)
        return RequestRejected(
            f"This model's maximum context length is {self.max_model_len} tokens, but the "
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for output",
            param=prompt_param)

    def _max_tokens(self, num_prompt_tokens: int, params: SamplingParams,
                    prompt_param: str) -> int:
        """The request's output limit, resolved. Refuses what could never
        finish: over the context window, or over the whole KV cache (it would
        wait in the queue forever)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise self._over_the_context(num_prompt_tokens, prompt_param)
        if params.max_tokens is not None:
            self._check_total(num_prompt_tokens, params.max_tokens, prompt_param)
            return params.max_tokens
        # No limit given: the rest of the context window, and of the KV cache.
        max_tokens = min(limit, self.num_kv_tokens) - num_prompt_tokens
        self._check_total(num_prompt_tokens, max(max_tokens, 1), prompt_param)
        if params.min_tokens > max_tokens:
            raise RequestRejected(
                f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens "
                f"left after the prompt", param="min_tokens")
        return max_tokens

    def _check_total(self, num_prompt_tokens: int, max_tokens: int, prompt_param: str) -> None:
        limit = self.max_model_len
        num_total_tokens = num_prompt_tokens + max_tokens
        if num_total_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens, but {num_total_tokens}"
                f" were requested ({num_prompt_tokens} in the prompt, max_tokens "
                f"{max_tokens}); lower max_tokens to at most {limit - num_prompt_tokens}",
                param="max_tokens")
        if num_total_tokens > self.num_kv_tokens:
            param = prompt_param if num_prompt_tokens >= self.num_kv_tokens else "max_tokens"
            raise RequestRejected(
                f"the KV cache holds {self.num_kv_tokens} tokens in all, but this request "
                f"needs {num_total_tokens} ({num_prompt_tokens} in the prompt, max_tokens "
                f"{max_tokens}): it could never be scheduled", param=param)

    # -- resolution ---------------------------------------------------------------

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        token_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            token_ids += self.tokenizer.eos_token_ids
        return list(dict.fromkeys(token_ids))

    def _sampling_options(self, params: SamplingParams, stop_token_ids: list[int],
                          arrival_index: int) -> SamplingOptions:
        seed = params.seed
        if seed is None:
            seed = derive_seed(self.config.seed, arrival_index)
        return SamplingOptions(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=seed,
            num_logprobs=params.logprobs,
            min_tokens=params.min_tokens,
            # Below min_tokens no stop token may be sampled (vLLM's semantics).
            banned_token_ids=stop_token_ids if params.min_tokens > 0 else [],
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias_token_ids=list(params.logit_bias or {}),
            logit_bias_values=list((params.logit_bias or {}).values()),
            allowed_token_ids=(sorted(set(params.allowed_token_ids))
                               if params.allowed_token_ids is not None else None),
            num_prompt_logprobs=params.prompt_logprobs,
        )


# A word-level unknown token may stand for a whole word (WordPiece's [UNK] for up
# to 100 characters): no token is taken to span fewer characters than this.
MIN_TOKEN_SPAN_CHARS = 128


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token can stand for: its vocabulary's longest entry
    (byte-level vocabularies spell each byte as one character), at least
    MIN_TOKEN_SPAN_CHARS."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(MIN_TOKEN_SPAN_CHARS, max((len(token) for token in vocab), default=0))


def _check_allowed_after_bans(params: SamplingParams, stop_token_ids: list[int]) -> None:
    """Below min_tokens the stop token ids are banned: some allowed id must remain."""
    allowed = params.allowed_token_ids
    if allowed is not None and params.min_tokens > 0 and set(allowed) <= set(stop_token_ids):
        raise RequestRejected("every allowed token is a stop token, which min_tokens bans: "
                              "nothing could be sampled", param="allowed_token_ids")


def _check_cache_salt(cache_salt: object) -> None:
    """vLLM's rule: a salt, if given, is a non-empty string."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RequestRejected("cache_salt must be a non-empty string if given",
                              param="cache_salt")


# Names the chat template gets from the engine itself; chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools",
                                          "documents"})


def _template_variables(submit: Submit) -> dict[str, Any]:
    """``tools``, ``documents`` and ``chat_template_kwargs`` as the chat template's
    variables."""
    variables = dict(submit.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & set(variables))
    if reserved:
        raise RequestRejected(f"chat_template_kwargs may not set {', '.join(reserved)}",
                              param="chat_template_kwargs")
    if submit.tools:
        variables["tools"] = submit.tools
    if submit.documents is not None:
        variables["documents"] = submit.documents
    return variables
def _scoped_to_request(stage: str, param: str, function: Callable[..., T], *args: object,
                       **kwargs: object) -> T:
    """Call the tokenizer or the chat template on one request's input; if it
    raises, that request alone is refused, naming the stage and the error."""
    try:
        return function(*args, **kwargs)
    except (RequestRejected, TooManyTokens):
        raise
    except Exception as error:
        raise RequestRejected(f"the {stage} failed on this request: "
                              f"{type(error).__name__}: {error}", param=param) from error


def _prompt_param(submit: Submit) -> str:
    """The request field a prompt-length error points at."""
    return "messages" if submit.messages is not None else "prompt"


def _is_chat_message(message: object) -> bool:
    return (isinstance(message, dict) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str))


async def run_intake(
    inbox: trio.MemoryReceiveChannel[IntakeInbox],
    queue_outbox: trio.MemorySendChannel[QueueInbox],
    streams: RequestStreams,
    intake: Intake,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consume Submit and Abort; emit Admit (and forward Abort) to the queue.

    Each Submit is admitted in a worker thread, one at a time, so arrival
    order (and with it every derived seed) is kept and an Abort never
    overtakes the Submit before it. A rejected request fails its stream at
    once and never reaches the queue. Closes the queue outbox when the inbox
    closes.
    """
    # A thread of its own: trio's shared default limiter could be exhausted by
    # other work, and admission would wait behind it.
    admit_thread = trio.CapacityLimiter(1)
    task_status.started()
    async with queue_outbox:
        async for message in inbox:
            match message:
                case Submit():
                    await _submit(message, queue_outbox, streams, intake, admit_thread)
                case Abort():
                    await queue_outbox.send(message)


async def _submit(submit: Submit, queue_outbox: trio.MemorySendChannel[QueueInbox],
                  streams: RequestStreams, intake: Intake,
                  admit_thread: trio.CapacityLimiter) -> None:
    # Abandoned on cancellation: shutdown does not wait for a long prompt.
    outcome = await trio.to_thread.run_sync(_admit_or_rejection, intake, submit,
                                            abandon_on_cancel=True, limiter=admit_thread)
    if isinstance(outcome, RequestRejected):
        streams.fail(submit.request_id, outcome)
    else:
        await queue_outbox.send(Admit(request=outcome))


def _admit_or_rejection(intake: Intake, submit: Submit) -> Request | RequestRejected:
    """In the worker thread: the admitted request, or why it was refused."""
    try:
        return intake.admit(submit)
    except RequestRejected as rejection:
        return rejection
