"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests are decoded straight into Structs whose constraints mirror
SamplingParams, so a bad value fails at decode time with the field named.
What the engine does not support (several choices, echo) is
rejected with a 400 naming the field, never silently ignored.

Everything here is synchronous: the server's handlers decode, convert with
``*_sampling_params`` and build responses with the ``*Builder`` classes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.generation_defaults import GenerationDefaults
from trio_llm.actors.intake import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from trio_llm.actors.messages import (
    MAX_SEED,
    MIN_SEED,
    ChatTemplateOptions,
    PositiveInt,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
    TokenLogprobs,
)
from trio_llm.api.tool_calls import ChatOutputParser, ParsedOutput, visible_content

T = TypeVar("T")

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
NumLogprobs = Annotated[int, msgspec.Meta(ge=0)]  # at most --max-logprobs (intake)
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0)]
LogitBiasValue = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
Seed = Annotated[int, msgspec.Meta(ge=MIN_SEED, le=MAX_SEED)]
# Stop strings are bounded (vLLM does not bound them): see docs/http-api.md.
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)]

# Token ids in a prompt: one prompt as a list of ints; a list of one string or
# of one list of ints is accepted too, since clients send batches of one.
PromptItem = int | str | list[int]


# -- requests -------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    """``include_usage`` adds a last chunk with no choices and the token counts;
    vLLM's ``continuous_usage_stats`` adds its choice's counts so far to every
    chunk as well. Alone it would do nothing (vLLM ignores it): refused."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    def __post_init__(self) -> None:
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage: usage is only "
                             "streamed with it")


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format.json_schema``. The schema is always enforced
    exactly, ``strict`` or not (constrained decoding has no loose mode)."""

    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format``: text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` field: exactly one of these constraints.
    Unknown keys are refused rather than ignored."""

    json: dict[str, Any] | bool | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _GenerationFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    n: PositiveInt = 1
    best_of: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, LogitBiasValue] | None = None
    allowed_token_ids: list[NonNegativeInt] | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    add_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None


class CompletionRequest(_GenerationFields, kw_only=True):
    """POST /v1/completions. ``logprobs`` is the number of alternatives per token."""

    prompt: str | list[PromptItem]
    logprobs: NumLogprobs | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """``tool_calls`` (an assistant's earlier calls) and ``tool_call_id`` (a tool's
    answer) go to the chat template as they came; an assistant's ``reasoning`` (or
    ``reasoning_content``, the name responses carry) goes as both names."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


# Tools per request: OpenAI's documented bound. Each tool is a branch of the
# constraint tool_choice "required" compiles (docs/reliability.md: 128 small tools
# compile in 0.2 s, 512 in 2.3 s on the CI machine) and text in every prompt.
MAX_TOOLS = 128


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A function the model may call; ``parameters`` a JSON Schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_GenerationFields, kw_only=True):
    """POST /v1/chat/completions. ``logprobs`` is a flag, ``top_logprobs`` the count."""

    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: Annotated[list[ToolDefinition], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat-template options. add_generation_prompt None: true, unless
    # continue_final_message (which cannot be combined with it).
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: exactly one of ``prompt`` and ``messages``; a conversation
    is rendered as a chat request with the same template fields would be."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    return_token_strs: bool = False
    tools: Annotated[list[ToolDefinition], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[NonNegativeInt]


# -- responses ------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """The legacy completions logprobs shape: parallel lists, one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


# With vLLM's return_token_ids only: absent (not null) otherwise.
TokenIds = list[int] | msgspec.UnsetType


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: TokenIds = msgspec.UNSET
    token_ids: TokenIds = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A whole completion, or (object still "text_completion") one streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] = []


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed tool call: its first delta has id, type and name; later ones
    carry argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatResponseMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``reasoning_content`` and ``reasoning`` (vLLM's two names for it) only with a
    reasoning parser, ``tool_calls`` only when there are calls."""

    role: str
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: TokenIds = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: TokenIds = msgspec.UNSET


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: TokenIds = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: TokenIds = msgspec.UNSET


class VersionResponse(msgspec.Struct, kw_only=True):
    """GET /version, as vLLM answers it."""

    version: str


class ModelCard(msgspec.Struct, kw_only=True):
    """One served model. ``vocab_size`` is ours (not in OpenAI's or vLLM's card):
    the serving benchmark draws random prompt token ids below it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trio-llm"
    root: str
    parent: str | None = None
    max_model_len: int
    vocab_size: int


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


# -- decoding -------------------------------------------------------------------

_PATH_PATTERN = re.compile(r"at `\$\.?([^`]*)`")
_MISSING_PATTERN = re.compile(r"missing required field `([^`]+)`")


def decode_request(body: bytes | str, kind: type[T]) -> T:
    """Decode a JSON body into ``kind``; RequestRejected names the field at fault."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        raise RequestRejected(str(error), param=param_of_validation_error(str(error))) from None
    except msgspec.DecodeError as error:
        raise RequestRejected(f"the body is not valid JSON: {error}") from None
    except RecursionError:
        # msgspec raises this, not DecodeError, on JSON nested too deeply.
        raise RequestRejected("the body nests JSON arrays or objects too deeply") from None


def param_of_validation_error(message: str) -> str | None:
    """The dotted field path a msgspec validation message points at, if any.

    "Expected `int` >= 1 - at `$.max_tokens`" -> "max_tokens";
    "Object missing required field `role` - at `$.messages[0]`" -> "messages[0].role".
    """
    path_match = _PATH_PATTERN.search(message)
    path = path_match.group(1) if path_match else ""
    missing = _MISSING_PATTERN.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


# -- requests -> engine arguments -------------------------------------------------


# Batched prompts: OpenAI documents no bound; this one is ours (each prompt is a
# request of the engine, times n or best_of: api/choices.py bounds the product).
MAX_BATCHED_PROMPTS = 256


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, as text or token ids: one string or one
    list of ids, or a batch of them (a list of strings or of lists of ids)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestRejected("prompt must not be an empty list", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [[int(item) for item in prompt]]  # type: ignore[arg-type]
    if len(prompt) > MAX_BATCHED_PROMPTS:
        raise RequestRejected(f"at most {MAX_BATCHED_PROMPTS} prompts per request, "
                              f"not {len(prompt)}", param="prompt")
    prompts: list[str | list[int]] = []
    for index, item in enumerate(prompt):
        if isinstance(item, int):
            raise RequestRejected("prompt mixes token ids with strings or lists",
                                  param=f"prompt[{index}]")
        prompts.append(item)
    return prompts


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text parts joined, one string each
    (with an assistant's tool calls and a tool answer's call id when they have them)."""
    if not messages:
        raise RequestRejected("messages must not be empty", param="messages")
    return [_template_message(message, index) for index, message in enumerate(messages)]


# Template variables the server sets itself; chat_template_kwargs may not.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools",
                                         "documents"})


def checked_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise RequestRejected(f"chat_template_kwargs may not set {', '.join(reserved)}",
                              param="chat_template_kwargs")
    return kwargs


def template_options(request: ChatCompletionRequest | TokenizeRequest) -> ChatTemplateOptions:
    """How the chat template renders the conversation (vLLM's request fields)."""
    if request.continue_final_message and request.add_generation_prompt:
        raise RequestRejected("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.", param="continue_final_message")
    add_generation_prompt = (not request.continue_final_message
                             if request.add_generation_prompt is None
                             else request.add_generation_prompt)
    return ChatTemplateOptions(add_generation_prompt=add_generation_prompt,
                               continue_final_message=request.continue_final_message)


def template_variables(request: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The chat template's variables a request sets: its chat_template_kwargs
    (checked), then tools and documents."""
    variables = dict(checked_template_kwargs(request.chat_template_kwargs or {}))
    if request.tools:
        variables["tools"] = [msgspec.to_builtins(tool) for tool in request.tools]
    if request.documents is not None:
        variables["documents"] = request.documents
    return variables


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": _message_text(message, index)}
    if message.tool_calls is not None:
        rendered["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if message.role == "assistant" and reasoning is not None:
        # Qwen's templates read reasoning_content, newer ones reasoning (as vLLM passes both)
        rendered["reasoning"] = rendered["reasoning_content"] = reasoning
    return rendered


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call as templates read it: arguments as an object where they parse
    (Qwen's templates print ``arguments | tojson`` unless it is a string)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = msgspec.json.decode(arguments)
        except msgspec.DecodeError:
            pass
    return {**call, "function": function}


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    for part_index, part in enumerate(content):
        param = f"messages[{index}].content[{part_index}]"
        if part.type != "text":
            raise refused_content_part(part.type, ("text",), param)
        if part.text is None:
            raise RequestRejected("a content part of type 'text' needs text",
                                  param=f"{param}.text")
    return "".join(part.text or "" for part in content)


# Content parts that carry media, chat's and Responses' names, and what they carry.
_MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
                "video_url": "video", "video": "video", "input_video": "video",
                "input_audio": "audio", "audio_url": "audio", "audio": "audio",
                "file": "file", "input_file": "file"}


def refused_content_part(part_type: str, accepted: tuple[str, ...], param: str
                         ) -> RequestRejected:
    """The 400 for a content part trio-llm does not take: a media part says that
    trio-llm serves the text model (a multimodal checkpoint, such as Qwen3.5's, is
    served without its vision encoder), another names the types it takes."""
    media = _MEDIA_PARTS.get(part_type)
    if media in ("image", "video"):
        return RequestRejected(
            f"{media} inputs are not supported: trio-llm serves the text model only (a "
            f"multimodal checkpoint's vision encoder is not loaded); content part of type "
            f"{part_type!r}", param=param)
    if media is not None:
        return RequestRejected(f"{media} inputs are not supported: trio-llm serves text "
                               f"models only; content part of type {part_type!r}",
                               param=param)
    return RequestRejected(f"content parts of type {part_type!r} are not supported here; "
                           f"trio-llm takes text ({', '.join(accepted)})", param=param)


def completion_sampling_params(request: CompletionRequest,
                               defaults: GenerationDefaults | None = None) -> SamplingParams:
    """SamplingParams of a completion request (max_tokens defaults to 16, as OpenAI's);
    ``defaults`` (the checkpoint's) fill what the request leaves out."""
    _reject_unsupported(request)
    if request.suffix is not None:
        raise RequestRejected("suffix is not supported", param="suffix")
    defaults = defaults or GenerationDefaults()
    params = _sampling_params(request, max_tokens=defaults.capped_max_tokens(
                                  request.max_tokens or 16),
                              num_logprobs=request.logprobs,
                              structured_outputs=structured_outputs_of(request),
                              defaults=defaults)
    if request.echo and request.truncate_prompt_tokens is not None:
        # the echo would be the prompt as sent, the model's prompt only its end
        raise RequestRejected("echo and truncate_prompt_tokens exclude each other",
                              param="truncate_prompt_tokens")
    if request.echo and request.logprobs is not None:
        # the echoed prompt's tokens come with their logprobs too (OpenAI's echo)
        params = msgspec.structs.replace(params, prompt_logprobs=request.logprobs)
    return params


def requested_max_tokens(request: ChatCompletionRequest) -> int | None:
    """The chat request's output limit, if it sets one (max_completion_tokens wins)."""
    return request.max_completion_tokens or request.max_tokens


def chat_sampling_params(request: ChatCompletionRequest, *, max_tokens: int | None,
                         tool_constraint: StructuredOutputsParams | None = None,
                         defaults: GenerationDefaults | None = None) -> SamplingParams:
    """SamplingParams of a chat request. ``max_tokens`` None (no limit asked)
    lets the reply fill what is left of the context, as OpenAI's does: the
    engine's intake resolves it once it has the prompt's length.
    ``tool_constraint``: what tool_choice required or named constrains it to.
    ``defaults`` (the checkpoint's) fill what the request leaves out."""
    defaults = defaults or GenerationDefaults()
    max_tokens = defaults.capped_max_tokens(max_tokens)
    _reject_unsupported(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise RequestRejected("top_logprobs needs logprobs set to true", param="top_logprobs")
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    constraint = structured_outputs_of(request)
    if constraint is not None and tool_constraint is not None:
        raise RequestRejected("a required or named tool_choice already constrains the output; "
                              "drop response_format / structured_outputs", param="tool_choice")
    return _sampling_params(request, max_tokens=max_tokens, num_logprobs=num_logprobs,
                            structured_outputs=constraint or tool_constraint, defaults=defaults)


def structured_outputs_of(request: _GenerationFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from ``response_format`` or vLLM's
    ``structured_outputs`` (not both); None for plain text."""
    from_format = _response_format_constraint(request.response_format)
    given = request.structured_outputs
    if given is None:
        return from_format
    if from_format is not None:
        raise RequestRejected("give response_format or structured_outputs, not both",
                              param="structured_outputs")
    return StructuredOutputsParams(
        json=_schema_text(given.json, "structured_outputs.json"),
        json_object=bool(given.json_object), regex=given.regex, choice=given.choice,
        grammar=given.grammar)


def _response_format_constraint(response_format: ResponseFormat | None
                                ) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.schema is None:
        raise RequestRejected("response_format of type json_schema needs json_schema.schema",
                              param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=_schema_text(response_format.json_schema.schema,
                                                     "response_format.json_schema.schema"))


def _schema_text(schema: dict[str, Any] | bool | str | None, param: str) -> str | None:
    """A JSON Schema as the grammar compiler takes it: serialised JSON."""
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            msgspec.json.decode(schema)
        except msgspec.DecodeError as error:
            raise RequestRejected(f"{param} is not valid JSON: {error}", param=param) from None
        return schema
    return msgspec.json.encode(schema).decode()


def _sampling_params(request: _GenerationFields, *, max_tokens: int | None,
                     num_logprobs: int | None,
                     structured_outputs: StructuredOutputsParams | None = None,
                     defaults: GenerationDefaults) -> SamplingParams:
    if max_tokens is not None and request.min_tokens > max_tokens:
        raise RequestRejected(f"min_tokens ({request.min_tokens}) is over max_tokens "
                              f"({max_tokens})", param="min_tokens")
    # SamplingParams' defaults, with the checkpoint's where it has them
    default = defaults.sampling_params()
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=_or(request.temperature, default.temperature),
        top_p=_or(request.top_p, default.top_p),
        top_k=_or(request.top_k, default.top_k),
        min_p=_or(request.min_p, default.min_p),
        seed=request.seed,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=num_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        structured_outputs=structured_outputs,
        presence_penalty=_or(request.presence_penalty, default.presence_penalty),
        frequency_penalty=_or(request.frequency_penalty, default.frequency_penalty),
        repetition_penalty=_or(request.repetition_penalty, default.repetition_penalty),
        logit_bias=logit_bias_of(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        add_special_tokens=request.add_special_tokens,
    )


def logit_bias_of(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) keyed by int; the engine's
    intake checks the ids against the vocabulary and bounds the count."""
    if not logit_bias:
        return None
    biases: dict[int, float] = {}
    for key, value in logit_bias.items():
        if not key.isascii() or not key.isdigit() or len(key) > 18:
            raise RequestRejected(f"logit_bias keys must be token ids, not {key[:32]!r}",
                                  param="logit_bias")
        biases[int(key)] = value
    return biases


# OpenAI's bound on n; best_of shares it (vLLM bounds neither).
MAX_CHOICES = 128


def check_choice_counts(n: int, best_of: int | None, *, stream: bool) -> None:
    """vLLM's rules for ``n`` and ``best_of`` (best_of at least n, never streamed)."""
    if n > MAX_CHOICES:
        raise RequestRejected(f"n must be at most {MAX_CHOICES}, not {n}", param="n")
    if best_of is None:
        return
    if best_of > MAX_CHOICES:
        raise RequestRejected(f"best_of must be at most {MAX_CHOICES}, not {best_of}",
                              param="best_of")
    if best_of < n:
        raise RequestRejected(f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if stream and best_of > 1:
        raise RequestRejected("best_of is not supported with stream (as in vLLM)",
                              param="best_of")


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _reject_unsupported(request: _GenerationFields) -> None:
    check_choice_counts(request.n, request.best_of, stream=request.stream)
    if request.stream_options is not None and not request.stream:
        raise RequestRejected("stream_options is only allowed when stream is true",
                              param="stream_options")


# -- engine outputs -> responses ------------------------------------------------

TokenText = Callable[[int], str]


def output_options(request: _GenerationFields) -> dict[str, bool]:
    """What the request asks of its output builders (see ``_OutputBuilder``)."""
    return {"usage_in_every_chunk": (request.stream_options is not None
                                     and request.stream_options.continuous_usage_stats),
            "returns_token_ids": bool(request.return_token_ids),
            "labels_token_ids": bool(request.return_tokens_as_token_ids)}


def usage_of(output: RequestOutput) -> Usage:
    return Usage(prompt_tokens=output.num_prompt_tokens,
                 completion_tokens=output.num_output_tokens,
                 total_tokens=output.num_prompt_tokens + output.num_output_tokens)


def error_response(message: str, *, error_type: str, status: int,
                   param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param,
                                         code=status))


def _now() -> int:
    return int(time.time())


@dataclass(kw_only=True)
class _OutputBuilder:
    """What both builders share: the response's identity, the text so far (for
    a non-streamed response) and the last output (for its finish and usage).

    ``token_text`` renders a token id: for logprobs, and for a reasoning parser the
    prompt's last few tokens (where the template may open the think block).
    ``index`` is the choice's (api/choices.py builds one builder per choice).
    ``usage_in_every_chunk``: each streamed chunk carries the choice's counts so far
    (``continuous_usage_stats``). ``returns_token_ids``
    (vLLM's ``return_token_ids``): the prompt's token ids once (a stream's first
    chunk) and the output's (each chunk's new ones). ``labels_token_ids`` (vLLM's
    ``return_tokens_as_token_ids``): logprobs name each token "token_id:{id}"; the
    text offsets and bytes stay those of its text.
    """

    response_id: str
    model: str
    token_text: TokenText
    created: int = field(default_factory=_now)
    index: int = 0
    usage_in_every_chunk: bool = False
    returns_token_ids: bool = False
    labels_token_ids: bool = False
    _text_parts: list[str] = field(default_factory=list, init=False)
    _last: RequestOutput | None = field(default=None, init=False)
    _prompt_token_ids: list[int] | None = field(default=None, init=False)
    _prompt_ids_sent: bool = field(default=False, init=False)
    _token_ids: list[int] = field(default_factory=list, init=False)

    def _require_last(self) -> RequestOutput:
        if self._last is None:
            raise RuntimeError("no output was added")
        return self._last

    def _label(self, token_id: int, text: str | None = None) -> str:
        """How logprobs name a token: its text, or its id when asked."""
        if self.labels_token_ids:
            return f"token_id:{token_id}"
        return self.token_text(token_id) if text is None else text

    def _chunk_usage(self, output: RequestOutput) -> Usage | None:
        return usage_of(output) if self.usage_in_every_chunk else None

    def _chunk_token_ids(self, output: RequestOutput) -> tuple[TokenIds, TokenIds]:
        """A chunk's (prompt, output) token ids: the prompt's in the first chunk only."""
        if not self.returns_token_ids:
            return msgspec.UNSET, msgspec.UNSET
        prompt: TokenIds = msgspec.UNSET
        if output.prompt_token_ids is not None and not self._prompt_ids_sent:
            prompt, self._prompt_ids_sent = output.prompt_token_ids, True
        return prompt, output.token_ids

    def _gather_token_ids(self, output: RequestOutput) -> None:
        """For a whole response: the prompt's token ids and the output's so far."""
        if self.returns_token_ids:
            if self._prompt_token_ids is None:
                self._prompt_token_ids = output.prompt_token_ids
            self._token_ids += output.token_ids

    def _whole_token_ids(self) -> tuple[TokenIds, TokenIds]:
        """A whole response's (prompt, output) token ids."""
        if not self.returns_token_ids:
            return msgspec.UNSET, msgspec.UNSET
        prompt = self._prompt_token_ids
        return (msgspec.UNSET if prompt is None else prompt), self._token_ids

    def prompt_token_ids_returned(self) -> TokenIds:
        return self._whole_token_ids()[0]


@dataclass(kw_only=True)
class CompletionBuilder(_OutputBuilder):
    """Turns one request's outputs into /v1/completions chunks or one response.
    ``echo_text`` (the prompt, with ``echo``) comes before the output's text."""

    echo_text: str = ""
    _num_chars: int = field(default=0, init=False)
    _logprobs: CompletionLogprobs | None = field(default=None, init=False)
    _echoed: bool = field(default=False, init=False)

    def _echo(self) -> str:
        """The echo text the first time, then nothing."""
        if self._echoed:
            return ""
        self._echoed = True
        self._num_chars += len(self.echo_text)
        return self.echo_text

    def chunk(self, output: RequestOutput) -> CompletionResponse | None:
        """The chunk to stream for ``output``; None when it carries nothing to send."""
        echo = self._echo()
        logprobs = self._take(output)
        prompt_ids, token_ids = self._chunk_token_ids(output)
        if not (echo or output.text or output.finished or logprobs or prompt_ids or token_ids):
            return None
        choice = CompletionChoice(index=self.index, text=echo + output.text, logprobs=logprobs,
                                  finish_reason=output.finish_reason,
                                  stop_reason=output.stop_reason,
                                  prompt_token_ids=prompt_ids, token_ids=token_ids)
        return self._response([choice], usage=self._chunk_usage(output))

    def add(self, output: RequestOutput) -> None:
        """Accumulate ``output`` for a non-streamed response."""
        echo = self._echo()
        logprobs = self._take(output)
        self._gather_token_ids(output)
        self._text_parts.append(echo + output.text)
        if logprobs is not None:
            self._logprobs = _extend_completion_logprobs(self._logprobs, logprobs)

    def _take(self, output: RequestOutput) -> CompletionLogprobs | None:
        """Record ``output``; its logprobs, offset by the text before it."""
        self._last = output
        logprobs = self._delta_logprobs(output)
        self._num_chars += len(output.text)
        return logprobs

    def response(self) -> CompletionResponse:
        last = self._require_last()
        prompt_ids, token_ids = self._whole_token_ids()
        choice = CompletionChoice(index=self.index, text="".join(self._text_parts),
                                  logprobs=self._logprobs, finish_reason=last.finish_reason,
                                  stop_reason=last.stop_reason, prompt_token_ids=prompt_ids,
                                  token_ids=token_ids)
        return self._response([choice], usage=usage_of(last))

    def usage_chunk(self, usage: Usage | None = None) -> CompletionResponse:
        """The last chunk of a stream with ``include_usage``: no choices, the counts
        (``usage``: several choices' together)."""
        return self._response([], usage=usage or usage_of(self._require_last()))

    def _response(self, choices: list[CompletionChoice],
                  usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)

    def _delta_logprobs(self, output: RequestOutput) -> CompletionLogprobs | None:
        prompt = self._prompt_logprobs(output)
        if output.logprobs is None:
            return prompt
        logprobs = prompt or CompletionLogprobs()
        self._append_logprobs(logprobs, output.token_ids, output.logprobs, self._num_chars)
        return logprobs

    def _prompt_logprobs(self, output: RequestOutput) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (the first output of an ``echo`` request with
        ``logprobs``): the first token's is null, as in OpenAI's."""
        if output.prompt_logprobs is None or output.prompt_token_ids is None:
            return None
        logprobs = CompletionLogprobs()
        self._append_logprobs(logprobs, output.prompt_token_ids, output.prompt_logprobs, 0)
        return logprobs

    def _append_logprobs(self, logprobs: CompletionLogprobs, token_ids: Sequence[int],
                         entries: Sequence[TokenLogprobs | None], offset: int) -> None:
        """One entry per token, its text starting at character ``offset``."""
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self.token_text(token_id)
            label = self._label(token_id, text)
            logprobs.tokens.append(label)
            logprobs.token_logprobs.append(None if entry is None else entry.logprob)
            logprobs.top_logprobs.append(self._top_dict(label, entry))
            logprobs.text_offset.append(offset)
            offset += len(text)

    def _top_dict(self, token: str, entry: TokenLogprobs | None) -> dict[str, float] | None:
        if entry is None:
            return None
        top = {self._label(token_id): logprob
               for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=False)}
        top.setdefault(token, entry.logprob)
        return top


def _chat_finish_reason(finish_reason: str | None, calls: Sequence[object]) -> str | None:
    """"tool_calls" for a message that ended by itself with calls in it."""
    return "tool_calls" if finish_reason == "stop" and calls else finish_reason


def _extend_completion_logprobs(total: CompletionLogprobs | None,
                                delta: CompletionLogprobs) -> CompletionLogprobs:
    if total is None:
        return delta
    total.tokens += delta.tokens
    total.token_logprobs += delta.token_logprobs
    total.top_logprobs += delta.top_logprobs
    total.text_offset += delta.text_offset
    return total


@dataclass(kw_only=True)
class ChatBuilder(_OutputBuilder):
    """Turns one request's outputs into /v1/chat/completions chunks or one response.

    The first chunk carries the role, as OpenAI's streams do. With a ``parser``
    (reasoning and/or tool calls, api/tool_calls.py) each chunk carries what the
    parse of the whole text so far adds to the previous one, so the stream
    reassembles into exactly the non-streamed message.
    """

    parser: ChatOutputParser | None = None
    _logprobs: ChatLogprobs | None = field(default=None, init=False)
    _sent_role: bool = field(default=False, init=False)
    _text: str = field(default="", init=False)
    _num_reasoning_sent: int = field(default=0, init=False)
    _num_content_sent: int = field(default=0, init=False)
    _num_arguments_sent: list[int] = field(default_factory=list, init=False)

    def chunk(self, output: RequestOutput) -> ChatCompletionChunk | None:
        """The chunk to stream for ``output``; None when it carries nothing to send."""
        self._last = output
        logprobs = self._delta_logprobs(output)
        prompt_ids, token_ids = self._chunk_token_ids(output)
        if self.parser is not None:
            return self._parsed_chunk(output, logprobs, prompt_ids, token_ids)
        if not (output.text or output.finished or logprobs or not self._sent_role
                or token_ids):
            return None
        delta = ChatDelta(content=output.text)
        if not self._sent_role:
            delta.role, self._sent_role = "assistant", True
        choice = ChatChunkChoice(index=self.index, delta=delta, logprobs=logprobs,
                                 finish_reason=output.finish_reason,
                                 stop_reason=output.stop_reason, token_ids=token_ids)
        return self._chunk([choice], usage=self._chunk_usage(output), prompt_token_ids=prompt_ids)

    def _parsed_chunk(self, output: RequestOutput, logprobs: ChatLogprobs | None,
                      prompt_ids: TokenIds, token_ids: TokenIds) -> ChatCompletionChunk | None:
        assert self.parser is not None
        if output.prompt_token_ids is not None:
            self.parser.note_prompt(output.prompt_token_ids, self.token_text)
        self._text += output.text
        parsed = self.parser.parse(self._text, is_final=output.finished)
        delta = self._delta_since_last(parsed, is_final=output.finished)
        is_empty = delta == ChatDelta()
        if not self._sent_role:
            delta.role, self._sent_role = "assistant", True
        elif is_empty and not (output.finished or logprobs or token_ids):
            return None
        finish_reason = _chat_finish_reason(output.finish_reason, parsed.calls)
        choice = ChatChunkChoice(index=self.index, delta=delta, logprobs=logprobs,
                                 finish_reason=finish_reason, stop_reason=output.stop_reason,
                                 token_ids=token_ids)
        return self._chunk([choice], usage=self._chunk_usage(output), prompt_token_ids=prompt_ids)

    def _delta_since_last(self, parsed: ParsedOutput, *, is_final: bool) -> ChatDelta:
        assert self.parser is not None
        delta = ChatDelta()
        reasoning = parsed.reasoning or ""
        if len(reasoning) > self._num_reasoning_sent:
            delta.reasoning_content = delta.reasoning = reasoning[self._num_reasoning_sent:]
            self._num_reasoning_sent = len(reasoning)
        # blank text before tool calls is no content (visible_content): hold it back
        shown = parsed.content if (parsed.content.strip()
                                   or (is_final and not parsed.calls)) else ""
        if len(shown) > self._num_content_sent:
            delta.content = shown[self._num_content_sent:]
            self._num_content_sent = len(shown)
        calls = [call_delta for index, call in enumerate(parsed.calls)
                 if (call_delta := self._call_delta(index, call.name, call.arguments))]
        if calls:
            delta.tool_calls = calls
        return delta

    def _call_delta(self, index: int, name: str, arguments: str) -> ToolCallDelta | None:
        assert self.parser is not None
        sent = self._num_arguments_sent
        if index == len(sent):
            sent.append(len(arguments))
            return ToolCallDelta(index=index, id=self.parser.call_id(index), type="function",
                                 function=FunctionCallDelta(name=name, arguments=arguments))
        if len(arguments) <= sent[index]:
            return None
        fragment, sent[index] = arguments[sent[index]:], len(arguments)
        return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=fragment))

    def add(self, output: RequestOutput) -> None:
        """Accumulate ``output`` for a non-streamed response."""
        self._last = output
        self._text_parts.append(output.text)
        self._gather_token_ids(output)
        if self.parser is not None and output.prompt_token_ids is not None:
            self.parser.note_prompt(output.prompt_token_ids, self.token_text)
        logprobs = self._delta_logprobs(output)
        if logprobs is not None:
            self._logprobs = self._logprobs or ChatLogprobs()
            self._logprobs.content += logprobs.content

    def response(self) -> ChatCompletionResponse:
        last = self._require_last()
        text = "".join(self._text_parts)
        finish_reason: str | None = last.finish_reason
        if self.parser is None:
            message = ChatResponseMessage(role="assistant", content=text)
        else:
            parsed = self.parser.parse(text, is_final=True)
            message = ChatResponseMessage(
                role="assistant", content=visible_content(parsed),
                reasoning_content=parsed.reasoning, reasoning=parsed.reasoning,
                tool_calls=[ToolCall(id=self.parser.call_id(index),
                                     function=FunctionCall(name=call.name,
                                                           arguments=call.arguments))
                            for index, call in enumerate(parsed.calls)] or None)
            finish_reason = _chat_finish_reason(finish_reason, parsed.calls)
        prompt_ids, token_ids = self._whole_token_ids()
        choice = ChatChoice(index=self.index, message=message, logprobs=self._logprobs,
                            finish_reason=finish_reason, stop_reason=last.stop_reason,
                            token_ids=token_ids)
        return ChatCompletionResponse(id=self.response_id, created=self.created,
                                      model=self.model, choices=[choice], usage=usage_of(last),
                                      prompt_token_ids=prompt_ids)

    def usage_chunk(self, usage: Usage | None = None) -> ChatCompletionChunk:
        """The last chunk of a stream with ``include_usage``: no choices, the counts
        (``usage``: several choices' together)."""
        return self._chunk([], usage=usage or usage_of(self._require_last()))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
               prompt_token_ids: TokenIds = msgspec.UNSET) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage,
                                   prompt_token_ids=prompt_token_ids)

    def _delta_logprobs(self, output: RequestOutput) -> ChatLogprobs | None:
        if output.logprobs is None:
            return None
        content = [self._token_logprob(token_id, entry)
                   for token_id, entry in zip(output.token_ids, output.logprobs, strict=False)
                   if entry is not None]
        return ChatLogprobs(content=content)

    def _token_logprob(self, token_id: int, entry: TokenLogprobs) -> ChatTokenLogprob:
        token = self.token_text(token_id)
        top = [TopLogprob(token=self._label(top_id, text := self.token_text(top_id)),
                          logprob=logprob, bytes=list(text.encode()))
               for top_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=False)]
        return ChatTokenLogprob(token=self._label(token_id, token), logprob=entry.logprob,
                                bytes=list(token.encode()), top_logprobs=top)
