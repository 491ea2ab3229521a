"""OpenAI's Responses API (POST /v1/responses): its request and response bodies as
msgspec Structs, and the translation of a request into the chat request it means.

A Responses request is a conversation: ``instructions`` and the ``input`` items
(messages, earlier function calls and their outputs, earlier reasoning). It is
translated into a ``protocol.ChatCompletionRequest`` that the chat endpoint's own
functions turn into engine arguments, so the same conversation gives the same
prompt tokens and the same sampling on both endpoints (api/responses.py).

Input items become chat messages as vLLM makes them:

- a message (``type`` "message" or no type): its role (user, system, developer,
  assistant) and its text parts joined (``input_text``; ``output_text`` for an
  assistant);
- a ``function_call``: an assistant message's tool call (appended to the
  assistant message right before it, so an answer's text and its calls are one
  message, as chat has them);
- a ``function_call_output``: a tool message with the call's ``tool_call_id``;
- a ``reasoning`` item: ``reasoning_content`` of the assistant message after it,
  for templates that render earlier reasoning (Qwen3's drops it but for the turn
  in progress).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from trio_llm.actors.errors import RequestRejected
from trio_llm.api import protocol
from trio_llm.api.request_fields import Refusal

# -- requests -----------------------------------------------------------------------


class TextFormat(msgspec.Struct, kw_only=True):
    """``text.format``: plain text, any JSON object, or a document of a JSON Schema
    (always enforced exactly, ``strict`` or not)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema: dict[str, Any] | bool | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """``reasoning``: null values only (see REFUSED_REASONING_FIELDS)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    include_obfuscation: bool = False


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses: OpenAI's fields trio-llm honours, then vLLM's extras
    (those its Responses endpoint shares with chat)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: protocol.PositiveInt | None = None
    temperature: protocol.Temperature | None = None
    top_p: protocol.TopP | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: protocol.NonNegativeInt | None = None
    # accepted without effect: see docs/http-api.md
    max_tool_calls: protocol.NonNegativeInt | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    # vLLM's extras (its ResponsesRequest has them), as on chat
    top_k: protocol.TopK | None = None
    min_p: protocol.MinP | None = None
    seed: protocol.Seed | None = None
    stop: protocol.StopString | protocol.StopStrings | None = None
    ignore_eos: bool = False
    repetition_penalty: protocol.RepetitionPenalty | None = None
    presence_penalty: protocol.Penalty | None = None
    frequency_penalty: protocol.Penalty | None = None
    logit_bias: dict[str, protocol.LogitBiasValue] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    structured_outputs: protocol.StructuredOutputsRequest | None = None
    chat_template_kwargs: dict[str, Any] | None = None


_STATELESS = ("trio-llm keeps no responses: send store false (the default here) and the "
              "whole conversation in input")

# What trio-llm does not do; as request_fields does for chat (null is always accepted).
REFUSED_RESPONSES_FIELDS: dict[str, Refusal] = {
    "previous_response_id": Refusal((), _STATELESS),
    "conversation": Refusal((), _STATELESS),
    "background": Refusal((False,), "responses are not run in the background: nothing is "
                                    "stored to fetch later"),
    "background_options": Refusal((), "responses are not run in the background"),
    "prompt": Refusal((), "stored prompt templates are not supported; send instructions "
                          "and input"),
    "context_management": Refusal(([],), "the context is never compacted"),
    "moderation": Refusal((), "trio-llm runs no moderation"),
    "access_programs": Refusal((), "trio-llm has no access programs"),
    "image": Refusal((), "trio-llm serves text models only"),
    "prompt_cache_options": Refusal((), "the prefix cache takes no options (prompt_cache_key "
                                        "is accepted)"),
    "prompt_cache_retention": Refusal(("in_memory",), "the prefix cache lives in memory only"),
    # vLLM's
    "request_id": Refusal((), "the server names each response itself (its id)"),
    "enable_response_messages": Refusal((False,), "responses carry output items only"),
    "previous_input_messages": Refusal((), _STATELESS),
    "mm_processor_kwargs": Refusal((), "trio-llm serves text models only"),
    "media_io_kwargs": Refusal((), "trio-llm serves text models only"),
    "kv_transfer_params": Refusal((), "trio-llm has no disaggregated prefill"),
    "vllm_xargs": Refusal((), "trio-llm has no request extensions"),
    "logits_processors": Refusal((), "trio-llm runs no custom logits processors"),
}


# -- input items ------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class MessageItem(msgspec.Struct, kw_only=True):
    """``id`` and ``status`` (on output items sent back as input) change nothing."""

    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(msgspec.Struct, kw_only=True):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ContentPart] = []
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """A function the model may call (Responses' flat form of chat's tool)."""

    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_KINDS: dict[str, type[InputItem]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
# Text parts each role may send: what the model wrote is output_text.
_TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",),
               "developer": ("input_text",), "assistant": ("output_text", "input_text")}


def _converted(value: Any, kind: type[Any], param: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as error:
        # the error's path is within the item: make it the body's
        message = (str(error).replace("`$", f"`$.{param}") if "`$" in str(error)
                   else f"{error} - at `$.{param}`")
        path = protocol.param_of_validation_error(str(error))
        raise RequestRejected(message, param=f"{param}.{path}" if path else param) from None


def input_items(items: list[dict[str, Any]]) -> list[InputItem]:
    """The ``input`` list's items, each checked against its type's fields."""
    checked = []
    for index, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(kind, str) or kind not in _ITEM_KINDS:
            raise RequestRejected(
                f"input items of type {kind!r} are not supported by trio-llm: it takes "
                f"{', '.join(sorted(_ITEM_KINDS))} items (item_reference needs stored "
                "responses, which trio-llm does not keep)", param=f"input[{index}].type")
        checked.append(_converted(item, _ITEM_KINDS[kind], f"input[{index}]"))
    return checked


# -- the chat request a Responses request means ----------------------------------------


@dataclass(slots=True)
class _Conversation:
    """Chat messages being built, and the reasoning to attach to some of them."""

    messages: list[protocol.ChatMessage] = field(default_factory=list)
    reasoning: dict[int, str] = field(default_factory=dict)
    pending_reasoning: str | None = None

    def append(self, message: protocol.ChatMessage) -> None:
        if message.role == "assistant" and self.pending_reasoning is not None:
            self.reasoning[len(self.messages)] = self.pending_reasoning
            self.pending_reasoning = None
        self.messages.append(message)

    def add_call(self, item: FunctionCallItem) -> None:
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        last = self.messages[-1] if self.messages else None
        if (last is not None and last.role == "assistant" and self.pending_reasoning is None):
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            self.append(protocol.ChatMessage(role="assistant", content=None, tool_calls=[call]))

    def finish(self) -> None:
        if self.pending_reasoning is not None:
            # reasoning that no answer followed: an assistant turn of reasoning only
            self.append(protocol.ChatMessage(role="assistant", content=""))


@dataclass(frozen=True, slots=True)
class ChatTranslation:
    """The chat request, and the reasoning of its assistant messages by index."""

    request: protocol.ChatCompletionRequest
    reasoning: dict[int, str]

    def messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (``protocol.chat_messages``),
        earlier reasoning added as ``reasoning_content``."""
        messages = protocol.chat_messages(self.request.messages)
        for index, reasoning in self.reasoning.items():
            messages[index]["reasoning_content"] = reasoning
        return messages


def chat_translation(body: ResponsesRequest) -> ChatTranslation:
    """The chat request ``body`` means (see the module docstring)."""
    check_refused_values(body)
    conversation = _Conversation()
    if body.instructions is not None:
        conversation.append(protocol.ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        conversation.append(protocol.ChatMessage(role="user", content=body.input))
    else:
        for index, item in enumerate(input_items(body.input)):
            _add_item(conversation, item, index)
    conversation.finish()
    if not conversation.messages:
        raise RequestRejected("input must not be empty", param="input")
    request = protocol.ChatCompletionRequest(
        messages=conversation.messages, model=body.model,
        max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop,
        ignore_eos=body.ignore_eos, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        logit_bias=body.logit_bias, skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, priority=body.priority,
        cache_salt=body.cache_salt, structured_outputs=body.structured_outputs,
        response_format=_response_format(body.text), tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        chat_template_kwargs=body.chat_template_kwargs, logprobs=wants_logprobs(body),
        top_logprobs=body.top_logprobs if wants_logprobs(body) else None)
    return ChatTranslation(request=request, reasoning=conversation.reasoning)


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def wants_logprobs(body: ResponsesRequest) -> bool:
    """The message's tokens come with their logprobs (and ``top_logprobs`` alternatives)."""
    return LOGPROBS_INCLUDE in (body.include or [])


def check_refused_values(body: ResponsesRequest) -> None:
    """Values of declared fields that ask for what trio-llm does not do."""
    if body.store:
        raise RequestRejected(f"store true is not supported by trio-llm: {_STATELESS}",
                              param="store")
    if body.stream_options is not None:
        if not body.stream:
            raise RequestRejected("stream_options is only allowed when stream is true",
                                  param="stream_options")
        if body.stream_options.include_obfuscation:
            raise RequestRejected("stream_options.include_obfuscation is not supported by "
                                  "trio-llm: stream events are not padded",
                                  param="stream_options.include_obfuscation")
    if body.truncation not in (None, "disabled"):
        raise RequestRejected(f"truncation {body.truncation!r} is not supported by trio-llm: "
                              'only "disabled"; a conversation over the context is refused, '
                              "never cut", param="truncation")
    if body.top_logprobs and not wants_logprobs(body):
        raise RequestRejected(f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]",
                              param="top_logprobs")
    if body.service_tier not in (None, "auto", "default"):
        raise RequestRejected(f"service_tier {body.service_tier!r} is not supported by "
                              "trio-llm: it has one service tier", param="service_tier")
    for index, included in enumerate(body.include or []):
        if included != LOGPROBS_INCLUDE:
            raise RequestRejected(f"include {included!r} is not supported by trio-llm: it "
                                  f"includes only {LOGPROBS_INCLUDE!r} (no encrypted "
                                  "reasoning, no results of built-in tools)",
                                  param=f"include[{index}]")
    if body.text is not None and body.text.verbosity is not None:
        raise RequestRejected("text.verbosity is not supported by trio-llm; say it in the "
                              "instructions", param="text.verbosity")
    _check_reasoning(body.reasoning)
    if (body.structured_outputs is not None and body.text is not None
            and body.text.format is not None and body.text.format.type != "text"):
        raise RequestRejected("give text.format or structured_outputs, not both",
                              param="structured_outputs")


def _check_reasoning(reasoning: ReasoningConfig | None) -> None:
    if reasoning is None:
        return
    if reasoning.effort is not None:
        raise RequestRejected("reasoning.effort is not supported by trio-llm: send it in "
                              "chat_template_kwargs (e.g. enable_thinking) if the model's "
                              "chat template reads it", param="reasoning.effort")
    for name in ("summary", "generate_summary", "context", "mode"):
        if getattr(reasoning, name) is not None:
            raise RequestRejected(f"reasoning.{name} is not supported by trio-llm: reasoning "
                                  "comes whole, as reasoning_text content, with "
                                  "--reasoning-parser", param=f"reasoning.{name}")


def _add_item(conversation: _Conversation, item: InputItem, index: int) -> None:
    match item:
        case MessageItem():
            text = _item_text(item.content, _TEXT_PARTS[item.role], f"input[{index}].content")
            conversation.append(protocol.ChatMessage(role=item.role, content=text))
        case FunctionCallItem():
            conversation.add_call(item)
        case FunctionCallOutputItem():
            output = _item_text(item.output, ("input_text", "output_text"),
                                f"input[{index}].output")
            conversation.append(protocol.ChatMessage(role="tool", content=output,
                                                     tool_call_id=item.call_id))
        case ReasoningItem():
            conversation.pending_reasoning = _reasoning_text(item, index)


def _item_text(content: str | list[ContentPart], part_types: tuple[str, ...],
               param: str) -> str:
    if isinstance(content, str):
        return content
    for part_index, part in enumerate(content):
        if part.type not in part_types:
            raise protocol.refused_content_part(part.type, part_types,
                                                f"{param}[{part_index}]")
        if part.text is None:
            raise RequestRejected(f"a content part of type {part.type!r} needs text",
                                  param=f"{param}[{part_index}].text")
    return "".join(part.text or "" for part in content)


def _reasoning_text(item: ReasoningItem, index: int) -> str:
    """An earlier reasoning item's text: its reasoning_text content, else its summary."""
    if item.encrypted_content is not None:
        raise RequestRejected("encrypted reasoning is not supported by trio-llm",
                              param=f"input[{index}].encrypted_content")
    if item.content:
        return _item_text(item.content, ("reasoning_text",), f"input[{index}].content")
    return _item_text(item.summary, ("summary_text",), f"input[{index}].summary")


def _response_format(text: TextConfig | None) -> protocol.ResponseFormat | None:
    if text is None or text.format is None:
        return None
    given = text.format
    if given.type != "json_schema":
        return protocol.ResponseFormat(type=given.type)
    if given.schema is None:
        raise RequestRejected("text.format of type json_schema needs schema",
                              param="text.format.schema")
    return protocol.ResponseFormat(type="json_schema", json_schema=protocol.JsonSchemaFormat(
        name=given.name, description=given.description, schema=given.schema,
        strict=given.strict))


def _tools(tools: list[dict[str, Any]] | None) -> list[protocol.ToolDefinition] | None:
    if tools is None:
        return None
    definitions = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestRejected(
                f"tools of type {kind!r} are not supported by trio-llm: it runs no built-in "
                "tools; function tools are called by the client", param=f"tools[{index}].type")
        function = _converted(tool, FunctionTool, f"tools[{index}]")
        definitions.append(protocol.ToolDefinition(type="function", function=(
            protocol.FunctionDefinition(name=function.name, description=function.description,
                                        parameters=function.parameters,
                                        strict=function.strict))))
    return definitions


def _tool_choice(choice: str | dict[str, Any] | None) -> protocol.ToolChoice | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice  # type: ignore[return-value]
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise RequestRejected('tool_choice of type "function" needs the name of one of '
                                  "the tools", param="tool_choice.name")
        return protocol.NamedToolChoice(type="function",
                                        function=protocol.NamedFunction(name=choice["name"]))
    shown = choice if isinstance(choice, str) else choice.get("type")
    raise RequestRejected(f"tool_choice {shown!r} is not supported by trio-llm: it takes "
                          '"none", "auto", "required" or {"type": "function", "name": ...}',
                          param="tool_choice")


# -- responses ----------------------------------------------------------------------------


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True):
    """A token of the message, its logprob and its ``top_logprobs`` likeliest
    alternatives (OpenAI's ``Logprob``)."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob] = []


class OutputText(msgspec.Struct, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[TokenLogprob] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: str
    content: list[OutputText]


class ReasoningText(msgspec.Struct, kw_only=True):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: str


class OutputFunctionCall(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class ResponseBody(msgspec.Struct, kw_only=True):
    """The response object: whole, or inside a stream's lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"effort": None, "summary": None})
    store: bool = False
    background: bool = False
    service_tier: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[Any] = []
    top_logprobs: int = 0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    max_tool_calls: int | None = None
