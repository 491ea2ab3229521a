"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat endpoint's path.

A request is translated into the chat request it means
(api/responses_protocol.py) and from there into engine arguments by the chat
endpoint's own functions (tool plan, messages, sampling parameters, template
variables), so the same conversation gives the same tokens on both endpoints.
Its outputs are parsed as chat's are (``ChatOutputParser``: reasoning, then tool
calls) and become output items: a ``reasoning`` item, a ``message`` with one
``output_text`` part, then one ``function_call`` item per call.

Streamed, the response is OpenAI's event sequence, each event with its
``sequence_number``: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its content part's ``added``, its deltas
(``response.reasoning_text.delta``, ``response.output_text.delta`` or
``response.function_call_arguments.delta``), their ``done``, the part's ``done``
and ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it off, or
``response.failed`` when the engine failed mid-stream). The stream owns its
engine request as chat's does: leaving it, or the client going away, aborts it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import msgspec
import trio
from quart import request
from quart_trio.wrappers.response import TrioResponse as Response

from trio_llm.actors.errors import EngineError, RequestRejected
from trio_llm.actors.generation_defaults import GenerationDefaults
from trio_llm.actors.messages import RequestOutput, SamplingParams, TokenLogprobs
from trio_llm.api import protocol
from trio_llm.api.responses_protocol import (
    LOGPROBS_INCLUDE,
    REFUSED_RESPONSES_FIELDS,
    ChatTranslation,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseBody,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
    TokenLogprob,
    TopLogprob,
    chat_translation,
    wants_logprobs,
)
from trio_llm.api.streaming import build_whole, closing, event_stream, observe
from trio_llm.api.tool_calls import (
    ChatOutputParser,
    ParsedOutput,
    ToolPlan,
    ToolServingOptions,
    plan_tool_calls,
    reasoning_parser_for,
)

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from trio_llm.api.engine import Engine
    from trio_llm.api.metrics import RequestTimer, ServerMetrics
    from trio_llm.api.request_fields import Refusal

BodyT = TypeVar("BodyT")
ResultT = TypeVar("ResultT")

RESPONSES_PATH = "/v1/responses"


class Handlers(Protocol):
    """What this module uses of the app's handlers (api/server.py's OpenAIServer,
    which registers these routes: a Protocol, so that this module does not
    import it back)."""

    engine: Engine
    model_name: str
    tool_options: ToolServingOptions
    metrics: ServerMetrics

    async def _decoded_body(self, kind: type[BodyT],
                            refused: dict[str, Refusal] | None = None) -> BodyT: ...

    def _check_model(self, model: str | None) -> None: ...

    async def _converted(self, convert: Callable[[BodyT], ResultT], body: BodyT) -> ResultT: ...

    def _logged(self, timer: RequestTimer, route: str, request_id: str
                ) -> AbstractContextManager[None]: ...

    def _token_text(self, token_id: int) -> str: ...

    def _json(self, body: msgspec.Struct, *, status: int = 200) -> Response: ...


def register_routes(app: QuartTrio, api: Handlers) -> None:
    """Serve POST /v1/responses from ``app``, with ``api``'s engine and settings."""
    async def create_response() -> Response:
        return await respond(api)

    app.add_url_rule(RESPONSES_PATH, view_func=create_response, methods=["POST"],
                     endpoint=f"POST {RESPONSES_PATH}")


# -- the request ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the chat endpoint would submit for the same conversation."""

    translation: ChatTranslation
    tool_plan: ToolPlan
    messages: list[dict[str, Any]]
    params: SamplingParams

    def template_variables(self) -> dict[str, Any]:
        """``tools`` and ``chat_template_kwargs`` as the chat handler passes them."""
        chat = self.translation.request
        variables: dict[str, Any] = {}
        if chat.tools:
            variables["tools"] = [msgspec.to_builtins(tool) for tool in chat.tools]
        if chat.chat_template_kwargs:
            variables["chat_template_kwargs"] = protocol.checked_template_kwargs(
                chat.chat_template_kwargs)
        return variables


def engine_request(body: ResponsesRequest, *, options: ToolServingOptions,
                   defaults: GenerationDefaults) -> EngineRequest:
    """The engine's arguments for ``body``, at a cost linear in it: the chat
    endpoint's conversion of the translated request."""
    translation = chat_translation(body)
    chat = translation.request
    tool_plan = plan_tool_calls(chat.tools, chat.tool_choice,
                                parallel_tool_calls=chat.parallel_tool_calls, options=options)
    params = protocol.chat_sampling_params(chat, max_tokens=protocol.requested_max_tokens(chat),
                                           tool_constraint=tool_plan.constraint,
                                           defaults=defaults)
    return EngineRequest(translation=translation, tool_plan=tool_plan,
                         messages=translation.messages(), params=params)


async def respond(api: Handlers) -> Response:
    body = await api._decoded_body(ResponsesRequest, REFUSED_RESPONSES_FIELDS)
    api._check_model(body.model)
    prepared = await api._converted(partial(
        engine_request, options=api.tool_options,
        defaults=api.engine.generation_defaults), body)
    parser = _output_parser(api.tool_options, prepared.tool_plan,
                            returns_logprobs=wants_logprobs(body))
    response_id = f"resp_{uuid.uuid4().hex}"
    chat = prepared.translation.request
    outputs = api.engine.chat(prepared.messages, prepared.params, priority=chat.priority,
                              request_id=response_id, cache_salt=chat.cache_salt,
                              template_options=protocol.template_options(chat),
                              **prepared.template_variables())
    builder = ResponseBuilder(template=_template(response_id, api.model_name, body,
                                                 prepared.params),
                              parser=parser, token_text=api._token_text,
                              returns_logprobs=wants_logprobs(body))
    timer = api.metrics.timer(trio.current_time())
    log_line = partial(api._logged, timer, f"POST {request.path}", response_id)
    if not body.stream:
        await build_whole(outputs, builder, timer, log_line)
        return api._json(builder.response())
    return await event_stream(_events(outputs, builder, timer, log_line))


def _output_parser(options: ToolServingOptions, tool_plan: ToolPlan, *,
                   returns_logprobs: bool) -> ChatOutputParser | None:
    """The chat endpoint's parser of the output (reasoning, then tool calls), if any."""
    reasoning = reasoning_parser_for(options)
    if reasoning is None and tool_plan.parser is None:
        return None
    if returns_logprobs:
        # a token's text may land in reasoning or a call rather than the message
        raise RequestRejected(f"include {LOGPROBS_INCLUDE!r} is not supported with a "
                              "reasoning parser or tool calls", param="include")
    return ChatOutputParser(reasoning=reasoning, tools=tool_plan.parser,
                            max_calls=tool_plan.max_calls)


def _template(response_id: str, model: str, body: ResponsesRequest,
              params: SamplingParams) -> ResponseBody:
    """The response before any output: the request's settings echoed, as OpenAI's."""
    text = ({"format": msgspec.to_builtins(body.text.format)}
            if body.text is not None and body.text.format is not None
            else {"format": {"type": "text"}})
    return ResponseBody(
        id=response_id, created_at=int(time.time()), status="in_progress", model=model,
        instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        parallel_tool_calls=body.parallel_tool_calls, temperature=params.temperature,
        top_p=params.top_p, text=text, tools=body.tools or [],
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        user=body.user, metadata=body.metadata, max_tool_calls=body.max_tool_calls,
        top_logprobs=body.top_logprobs or 0)


async def _events(outputs: AsyncIterator[RequestOutput], builder: ResponseBuilder,
                  timer: RequestTimer, log_line: Callable[[], AbstractContextManager[None]]
                  ) -> AsyncGenerator[bytes, None]:
    """The SSE body, as the chat endpoint's: nothing is sent before the first output
    (so a refused request gets its HTTP status), and however it ends, ``closing``
    ends the engine request."""
    with log_line():
        async with closing(outputs):
            output = await anext(outputs)
            for event in builder.start():
                yield _sse(event)
            try:
                while True:
                    observe(timer, output)
                    for event in builder.feed(output):
                        yield _sse(event)
                    if output.finished:
                        break
                    output = await anext(outputs)
            except StopAsyncIteration:
                pass  # ended without a last output: nothing more to say
            except EngineError as error:
                timer.summary = f"failed in the stream: {error}"
                yield _sse(builder.failed(str(error) or type(error).__name__))


def _sse(event: dict[str, Any]) -> bytes:
    """One event, named as OpenAI names them (the SDK reads the data's type)."""
    return (b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event)
            + b"\n\n")


# -- outputs -> items and events --------------------------------------------------------

ItemKind = Literal["reasoning", "message", "function_call"]
_ITEM_ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


@dataclass(slots=True)
class _Item:
    """One output item as it grows: its text (reasoning, message, or arguments)."""

    kind: ItemKind
    output_index: int
    item_id: str
    text: str = ""
    name: str = ""
    call_id: str = ""
    status: str = "in_progress"
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def output(self) -> OutputItem:
        match self.kind:
            case "reasoning":
                return OutputReasoning(id=self.item_id, status=self.status,
                                       content=[ReasoningText(text=self.text)]
                                       if self.status != "in_progress" else [])
            case "message":
                return OutputMessage(id=self.item_id, status=self.status,
                                     content=[OutputText(text=self.text, logprobs=self.logprobs)]
                                     if self.status != "in_progress" else [])
            case "function_call":
                return OutputFunctionCall(id=self.item_id, call_id=self.call_id,
                                          name=self.name, status=self.status,
                                          arguments=self.text)

    def part(self) -> OutputText | ReasoningText:
        return (ReasoningText(text=self.text) if self.kind == "reasoning"
                else OutputText(text=self.text, logprobs=self.logprobs))


@dataclass(kw_only=True)
class ResponseBuilder:
    """Turns one request's outputs into output items: stream events as they grow
    (``start``, ``feed``), or the whole response (``add``, ``response``).

    Both parse the whole text so far and open, grow and close items in the same
    order (reasoning, message, calls), so a stream's items are exactly the
    non-streamed response's.
    """

    template: ResponseBody
    parser: ChatOutputParser | None
    token_text: Callable[[int], str]
    # include ["message.output_text.logprobs"]: only without a parser (see respond)
    returns_logprobs: bool = False
    _items: list[_Item] = field(default_factory=list)
    _pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    _text: str = ""
    _last: RequestOutput | None = None
    # (text offset where the output starts, its token ids): to count reasoning tokens
    _outputs: list[tuple[int, list[int]]] = field(default_factory=list)
    _num_events: int = 0

    # -- streamed ------------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        body = self._body("in_progress")
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def feed(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events ``output`` makes: deltas, items opened and closed, and after
        the last output, the response's end."""
        self._take(output)
        events = self._advance(self._parsed(is_final=output.finished), is_final=output.finished)
        if output.finished:
            events += self._finish()
        return events

    def failed(self, message: str) -> dict[str, Any]:
        body = self._body("failed")
        body.error = ResponseError(code="server_error", message=message)
        return self._event("response.failed", response=body)

    # -- whole ---------------------------------------------------------------------

    def add(self, output: RequestOutput) -> None:
        self._take(output)

    def response(self) -> ResponseBody:
        self._advance(self._parsed(is_final=True), is_final=True)
        self._finish()
        return self._final_body()

    # -- both ----------------------------------------------------------------------

    def _take(self, output: RequestOutput) -> None:
        if self.parser is not None and output.prompt_token_ids is not None:
            self.parser.note_prompt(output.prompt_token_ids, self.token_text)
        if self.parser is not None and self.parser.reasoning is not None:
            self._outputs.append((len(self._text), output.token_ids))
        self._last = output
        self._text += output.text
        if self.returns_logprobs and output.logprobs is not None:
            self._pending_logprobs += [
                self._token_logprob(token_id, entry) for token_id, entry in zip(
                    output.token_ids, output.logprobs, strict=False) if entry is not None]

    def _token_logprob(self, token_id: int, entry: TokenLogprobs) -> TokenLogprob:
        top = [TopLogprob(token=(text := self.token_text(top_id)), bytes=list(text.encode()),
                          logprob=logprob)
               for top_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=False)]
        token = self.token_text(token_id)
        return TokenLogprob(token=token, bytes=list(token.encode()), logprob=entry.logprob,
                            top_logprobs=top)

    def _take_logprobs(self, item: _Item) -> list[TokenLogprob]:
        """The message's logprobs not sent yet, now its item's."""
        taken, self._pending_logprobs = self._pending_logprobs, []
        item.logprobs += taken
        return taken

    def _parsed(self, *, is_final: bool) -> ParsedOutput:
        if self.parser is None:
            return ParsedOutput(reasoning=None, content=self._text, calls=[])
        return self.parser.parse(self._text, is_final=is_final)

    def _advance(self, parsed: ParsedOutput, *, is_final: bool) -> list[dict[str, Any]]:
        """Open, grow and close items to match ``parsed``."""
        events = self._grow("reasoning", parsed.reasoning or "")
        # blank text before tool calls is no message: hold it back (as chat does)
        shown = parsed.content if parsed.content.strip() or (
            is_final and not parsed.calls) else ""
        if shown or (is_final and not parsed.calls and not self._items):
            events += self._grow("message", shown)
        for index, call in enumerate(parsed.calls):
            calls = [item for item in self._items if item.kind == "function_call"]
            if index == len(calls):
                assert self.parser is not None
                events += self._open("function_call", name=call.name,
                                     call_id=self.parser.call_id(index))
            events += self._grow("function_call", call.arguments, index=index)
        return events

    def _grow(self, kind: ItemKind, text: str, *, index: int = 0) -> list[dict[str, Any]]:
        """Events for the ``index``-th item of ``kind`` now holding ``text`` (opened
        first if it is new and ``text`` is not empty, except for a message)."""
        items = [item for item in self._items if item.kind == kind]
        events: list[dict[str, Any]] = []
        if len(items) <= index:
            if not text and kind == "reasoning":
                return events
            events += self._open(kind)
            items = [item for item in self._items if item.kind == kind]
        item = items[index]
        if len(text) > len(item.text):
            delta, item.text = text[len(item.text):], text
            events.append(self._delta(item, delta))
        return events

    def _open(self, kind: ItemKind, *, name: str = "", call_id: str = "") -> list[dict[str, Any]]:
        """Close what is open, then open an item of ``kind`` after it."""
        events = self._close_open("completed")
        item = _Item(kind=kind, output_index=len(self._items),
                     item_id=f"{_ITEM_ID_PREFIXES[kind]}_{uuid.uuid4().hex}", name=name,
                     call_id=call_id)
        self._items.append(item)
        events.append(self._event("response.output_item.added",
                                  output_index=item.output_index, item=item.output()))
        if kind != "function_call":
            events.append(self._event("response.content_part.added", **self._at(item),
                                      part=item.part()))
        return events

    def _delta(self, item: _Item, delta: str) -> dict[str, Any]:
        if item.kind == "function_call":
            return self._event("response.function_call_arguments.delta",
                               item_id=item.item_id, output_index=item.output_index,
                               delta=delta)
        if item.kind == "reasoning":
            return self._event("response.reasoning_text.delta", **self._at(item), delta=delta)
        return self._event("response.output_text.delta", **self._at(item), delta=delta,
                           logprobs=self._take_logprobs(item))

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        events = []
        for item in self._items:
            if item.status == "in_progress":
                item.status = status
                events += self._done(item)
        return events

    def _done(self, item: _Item) -> list[dict[str, Any]]:
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done",
                                  item_id=item.item_id, output_index=item.output_index,
                                  name=item.name, arguments=item.text)]
        elif item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **self._at(item),
                                  text=item.text)]
        else:
            self._take_logprobs(item)
            events = [self._event("response.output_text.done", **self._at(item),
                                  text=item.text, logprobs=item.logprobs)]
        if item.kind != "function_call":
            events.append(self._event("response.content_part.done", **self._at(item),
                                      part=item.part()))
        events.append(self._event("response.output_item.done",
                                  output_index=item.output_index, item=item.output()))
        return events

    def _finish(self) -> list[dict[str, Any]]:
        """Close what is open (incomplete if the output was cut off) and end."""
        status = self._status()
        events = self._close_open("completed" if status == "completed" else "incomplete")
        name = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(name, response=self._final_body()))
        return events

    def _status(self) -> str:
        last = self._require_last()
        return "completed" if last.finish_reason == "stop" else "incomplete"

    def _final_body(self) -> ResponseBody:
        last = self._require_last()
        body = self._body(self._status())
        if last.finish_reason == "length":
            body.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        body.output = [item.output() for item in self._items]
        body.usage = ResponseUsage(
            input_tokens=last.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=0),
            output_tokens=last.num_output_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=self._num_reasoning_tokens()),
            total_tokens=last.num_prompt_tokens + last.num_output_tokens)
        return body

    def _num_reasoning_tokens(self) -> int:
        """The output tokens up to the end of the reasoning (``</think>`` included)."""
        reasoning = next((item for item in self._items if item.kind == "reasoning"), None)
        if reasoning is None or self.parser is None or self.parser.reasoning is None:
            return 0
        end = self.parser.reasoning.split(self._text, is_final=True).end
        count = 0
        for start, token_ids in self._outputs:
            if start >= end:
                break
            for token_id in token_ids:
                if start >= end:
                    break
                count += 1
                start += len(self.token_text(token_id))
        return count

    def _require_last(self) -> RequestOutput:
        if self._last is None:
            raise RuntimeError("no output was added")
        return self._last

    def _body(self, status: str) -> ResponseBody:
        return msgspec.structs.replace(self.template, status=status, output=[])

    @staticmethod
    def _at(item: _Item) -> dict[str, Any]:
        return {"item_id": item.item_id, "output_index": item.output_index,
                "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        return event
