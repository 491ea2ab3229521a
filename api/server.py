"""The OpenAI-compatible HTTP app: a Quart-Trio app over a running engine, its
handlers, and their SSE streams. api/serving.py serves it (Hypercorn, signals,
the drain); api/cli.py turns flags into its ServerConfig.

A streamed response is an async generator that owns its engine request:
however it ends (finished, client gone, shutdown), the request's output
stream is closed in a shielded, time-bounded ``finally`` and the engine aborts
it within one step.

Routes: ``create_app`` registers each endpoint module's routes on the app
(``register_routes``); a new endpoint module adds its own line there.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Sequence,
)
from contextlib import (
    AbstractContextManager,
    contextmanager,
)
from functools import partial
from importlib.metadata import version as package_version
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, cast

import msgspec
import quart_cors
import trio
from quart import has_request_context, request
from quart_trio import QuartTrio
from quart_trio.wrappers.response import TrioResponse as Response
from werkzeug.exceptions import HTTPException

from trio_llm.actors.errors import (
    EngineError,
    ModelNotFound,
    QueueFull,
    RequestFailed,
    RequestRejected,
)
from trio_llm.actors.generation_defaults import GenerationDefaults
from trio_llm.actors.messages import RequestOutput, SamplingParams, StructuredOutputsParams
from trio_llm.api import embeddings, protocol, request_fields, responses
from trio_llm.api.choices import ChoiceOutputs, ChoicePlan, combined_chat, combined_completion
from trio_llm.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trio_llm.api.metrics import RequestTimer, ServerMetrics
from trio_llm.api.openapi import openapi_document
from trio_llm.api.stats_log import DEFAULT_STATS_INTERVAL_SECONDS, log_request
from trio_llm.api.streaming import build_whole, closing, event_stream, observe
from trio_llm.api.tool_calls import (
    ChatOutputParser,
    ToolServingOptions,
    check_serving_options,
    plan_tool_calls,
    reasoning_parser_for,
)

if TYPE_CHECKING:
    from trio_llm.api.engine import Engine

logger = logging.getLogger(__name__)

BodyT = TypeVar("BodyT")
ResultT = TypeVar("ResultT")

# Request bodies are small JSON; 8 MiB leaves room for a long prompt of token ids.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# A client gets this long to send its request body (HTTP 408 after that).
BODY_TIMEOUT_SECONDS = 60.0
# Worker threads for converting generation requests, and for /tokenize and
# /detokenize: limiters of their own. With trio's shared default limiter,
# enough large requests at once could hold every thread and hold up the
# runner's steps, stalling every stream; and slow /tokenize calls must not
# hold up generation requests.
NUM_CONVERSION_THREADS = 8
# Converting a generation request costs time linear in its body; a body up to
# this size is converted on the loop (at most about 0.2 ms), sparing the
# thread round trip that most requests would otherwise pay.
MAX_INLINE_CONVERSION_BYTES = 16 * 1024
NUM_TOKENIZER_THREADS = 8
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/version", "/ping"})
# OpenAI endpoints trio-llm does not serve: a clear 404 instead of "URL not found".
NOT_SUPPORTED_PATHS = ("/v1/audio/<path:rest>",
                       "/v1/images/<path:rest>", "/v1/moderations", "/v1/rerank",
                       "/v1/score", "/pooling", "/classify")
SSE_DONE = b"data: [DONE]\n\n"
JSON_CONTENT_TYPE = "application/json"


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the HTTP server listens and guards itself. ``port`` 0 picks a free port.

    What the engine holds is read from its config, not repeated here: the
    served model name and the shutdown grace period (EngineConfig).
    """

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    api_key: str | None = None
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_BODY_BYTES
    retry_after_seconds: Annotated[int, msgspec.Meta(ge=0)] = 1
    # tool calling and reasoning (api/tool_calls.py), vLLM's flags
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # the path prefix a proxy in front strips (ASGI root_path), vLLM's --root-path
    root_path: str = ""
    # CORS: off unless origins are given (vLLM allows every origin by default)
    allowed_origins: list[str] = []
    allow_credentials: bool = False
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    # logging: a line per request, a stats line every log_stats_interval seconds
    disable_log_requests: bool = False
    disable_log_stats: bool = False
    log_stats_interval: Annotated[float, msgspec.Meta(gt=0.0)] = DEFAULT_STATS_INTERVAL_SECONDS
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"


# -- the app ------------------------------------------------------------------------


def create_app(engine: Engine, config: ServerConfig) -> QuartTrio:
    """The Quart-Trio app over a running engine."""
    app = QuartTrio(__name__)
    # Streams last as long as generation does: no response timeout. A client
    # that goes away ends its request through the disconnect, not a timer.
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=BODY_TIMEOUT_SECONDS,
                      MAX_CONTENT_LENGTH=config.max_body_bytes)
    api = OpenAIServer(engine, config)
    app.extensions["trio_llm"] = api
    # Each endpoint module registers its routes on the app.
    register_routes(app, api)
    responses.register_routes(app, api)
    embeddings.register_routes(app, api)
    app.before_request(api.check_api_key)
    if config.allowed_origins:
        quart_cors.cors(app, allow_origin=config.allowed_origins,
                        allow_credentials=config.allow_credentials,
                        allow_methods=config.allowed_methods,
                        allow_headers=config.allowed_headers)
    app.register_error_handler(EngineError, api.engine_error)
    app.register_error_handler(HTTPException, api.http_error)
    app.register_error_handler(Exception, api.internal_error)
    return app


# A route: (path, view, method).
Route = tuple[str, Callable[..., Awaitable[Response]], str]


def add_routes(app: QuartTrio, routes: Sequence[Route]) -> None:
    """Register ``routes`` on ``app``, each under its own endpoint name."""
    for path, view, method in routes:
        app.add_url_rule(path, view_func=view, methods=[method], endpoint=f"{method} {path}")


def register_routes(app: QuartTrio, api: OpenAIServer) -> None:
    """This module's endpoints, and a clear 404 for the OpenAI ones trio-llm lacks."""
    add_routes(app, [
        ("/v1/completions", api.completions, "POST"),
        ("/v1/chat/completions", api.chat_completions, "POST"),
        ("/v1/models", api.models, "GET"),
        ("/v1/models/<path:model_id>", api.model, "GET"),
        ("/health", api.health, "GET"),
        ("/metrics", api.metrics_text, "GET"),
        ("/tokenize", api.tokenize, "POST"),
        ("/detokenize", api.detokenize, "POST"),
        ("/openapi.json", api.openapi, "GET"),
        ("/version", api.version, "GET"),
        ("/ping", api.ping, "GET"),
        ("/ping", api.ping, "POST"),
    ])
    for path in NOT_SUPPORTED_PATHS:
        app.add_url_rule(path, view_func=api.not_supported, methods=["GET", "POST"],
                         endpoint=f"not supported {path}")


class OpenAIServer:
    """The handlers of one app, and what they share: engine, config, metrics."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_name = engine.model_name  # --served-model-name, else the model
        self.accepted_model_names = {self.model_name, engine.config.model}
        self.metrics = ServerMetrics(self.model_name, max_model_len=engine.max_model_len)
        self.created = int(time.time())
        self._api_key = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        self.tool_options = ToolServingOptions(
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)
        check_serving_options(self.tool_options)
        self._openapi_json = msgspec.json.encode(openapi_document(self.model_name))
        self._conversion_threads = trio.CapacityLimiter(NUM_CONVERSION_THREADS)
        self._tokenizer_threads = trio.CapacityLimiter(NUM_TOKENIZER_THREADS)

    # -- generation ---------------------------------------------------------------

    async def _decoded_body(self, kind: type[BodyT],
                            refused: dict[str, request_fields.Refusal] | None = None) -> BodyT:
        """The request's JSON body as ``kind``; a 400 naming what is wrong: a field
        of the OpenAI or vLLM schema that ``kind`` does not honour (``refused``)
        among them. Fields of neither schema are ignored, with a warning. The
        check reads the body's top level again: a large body's in a worker
        thread (docs/performance.md, "Request field check")."""
        body, data = await _decoded_body(kind)
        check = partial(request_fields.check_fields, data, kind, refused or {})
        if len(data) <= MAX_INLINE_CONVERSION_BYTES:
            check()
        else:
            await trio.to_thread.run_sync(check, limiter=self._conversion_threads)
        return body

    async def completions(self) -> Response:
        body = await self._decoded_body(protocol.CompletionRequest,
                                        request_fields.REFUSED_COMPLETION_FIELDS)
        self._check_model(body.model)
        prompts, params, echo_texts = await self._converted(self._completion_arguments, body)
        plan = ChoicePlan.of(len(prompts), body.n, body.best_of,
                             max_waiting_requests=self.engine.config.max_waiting_requests,
                             max_children=self.engine.config.max_request_choices)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        builders = [protocol.CompletionBuilder(
            response_id=response_id, model=self.model_name, token_text=self._token_text,
            index=index, echo_text=echo_texts[plan.prompt_of(index)],
            **protocol.output_options(body))
            for index in range(plan.num_children)]
        if plan.is_single:
            outputs = self.engine.generate(prompts[0], params, priority=body.priority,
                                           request_id=response_id, cache_salt=body.cache_salt)
            return await self.respond(outputs, builders[0], body)
        children = [(prompt, child_params) for prompt in prompts
                    for child_params in plan.child_params(params)]
        choice_outputs = self.engine.generate_many(children, priority=body.priority,
                                                   request_id=response_id,
                                                   cache_salt=body.cache_salt)
        return await self.respond_choices(choice_outputs, builders, body,
                                          ChoiceOutputs(plan, strips_logprobs=body.logprobs
                                                        is None))

    def _echo_text(self, body: protocol.CompletionRequest, prompt: str | list[int]) -> str:
        """The text ``echo`` puts before the output: a token-id prompt decoded."""
        if not body.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        return self.engine.tokenizer.decode(prompt, skip_special_tokens=False)

    async def chat_completions(self) -> Response:
        body = await self._decoded_body(protocol.ChatCompletionRequest,
                                        request_fields.REFUSED_CHAT_FIELDS)
        self._check_model(body.model)
        tool_plan = plan_tool_calls(body.tools, body.tool_choice,
                                    parallel_tool_calls=body.parallel_tool_calls,
                                    options=self.tool_options)
        messages, params = await self._converted(
            partial(_chat_arguments, tool_constraint=tool_plan.constraint,
                    defaults=self.engine.generation_defaults), body)
        reasoning = reasoning_parser_for(self.tool_options)
        parser = (ChatOutputParser(reasoning=reasoning, tools=tool_plan.parser,
                                   max_calls=tool_plan.max_calls)
                  if reasoning is not None or tool_plan.parser is not None else None)
        builder = protocol.ChatBuilder(
            response_id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model_name,
            token_text=self._token_text, parser=parser, **protocol.output_options(body))
        template_variables: dict[str, Any] = {}
        if body.tools:
            template_variables["tools"] = [msgspec.to_builtins(tool) for tool in body.tools]
        if body.chat_template_kwargs:
            template_variables["chat_template_kwargs"] = protocol.checked_template_kwargs(
                body.chat_template_kwargs)
        plan = ChoicePlan.of(1, body.n, body.best_of,
                             max_waiting_requests=self.engine.config.max_waiting_requests,
                             max_children=self.engine.config.max_request_choices)
        if not plan.is_single:
            builders = [dataclasses.replace(builder, index=index, parser=(
                ChatOutputParser(reasoning=reasoning_parser_for(self.tool_options),
                                 tools=tool_plan.parser, max_calls=tool_plan.max_calls)
                if parser is not None else None)) for index in range(plan.num_children)]
            choice_outputs = self.engine.chat_many(
                messages, plan.child_params(params), priority=body.priority,
                request_id=builder.response_id, cache_salt=body.cache_salt,
                documents=body.documents, template_options=protocol.template_options(body),
                **template_variables)
            return await self.respond_choices(choice_outputs, builders, body,
                                              ChoiceOutputs(plan,
                                                            strips_logprobs=not body.logprobs))
        outputs = self.engine.chat(messages, params, priority=body.priority,
                                   request_id=builder.response_id, cache_salt=body.cache_salt,
                                   documents=body.documents,
                                   template_options=protocol.template_options(body),
                                   **template_variables)
        return await self.respond(outputs, builder, body)

    async def _converted(self, convert: Callable[[BodyT], ResultT], body: BodyT) -> ResultT:
        """``convert(body)``: on the loop for a small body, else in a worker thread."""
        num_body_bytes = request.content_length
        if num_body_bytes is not None and num_body_bytes <= MAX_INLINE_CONVERSION_BYTES:
            return convert(body)
        return await trio.to_thread.run_sync(convert, body, limiter=self._conversion_threads)

    def _completion_arguments(self, body: protocol.CompletionRequest
                              ) -> tuple[list[str | list[int]], SamplingParams, list[str]]:
        """The engine's arguments (one prompt, or a batch) and each prompt's echo text,
        at a cost linear in the body."""
        prompt = body.prompt
        token_lists = ([prompt] if prompt and isinstance(prompt[0], int) else
                       [item for item in prompt if isinstance(item, list)]) if isinstance(
                           prompt, list) else []
        for token_ids in token_lists:
            if len(token_ids) > self.engine.max_model_len:
                # Refused before anything walks a list the engine would refuse anyway.
                raise RequestRejected(
                    f"This model's maximum context length is {self.engine.max_model_len} "
                    f"tokens, but the prompt has {len(token_ids)} tokens",
                    param="prompt")
        prompts = protocol.completion_prompts(body)
        params = protocol.completion_sampling_params(
            body, self.engine.generation_defaults)
        return prompts, params, [self._echo_text(body, prompt) for prompt in prompts]

    async def respond(self, outputs: AsyncIterator[RequestOutput],
                      builder: protocol.CompletionBuilder | protocol.ChatBuilder,
                      body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
                      ) -> Response:
        """The response to a generation request: one JSON body, or an SSE stream
        that owns ``outputs`` from here on (closing the body ends the request)."""
        timer = self.metrics.timer(trio.current_time())
        route = f"{request.method} {request.path}" if has_request_context() else "-"
        log_line = partial(self._logged, timer, route, builder.response_id)
        if not body.stream:
            await build_whole(outputs, builder, timer, log_line)
            return self._json(builder.response())
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = self._events(outputs, builder, timer, log_line, include_usage=include_usage)
        return await event_stream(events)

    async def respond_choices(self, outputs: AsyncIterator[tuple[int, RequestOutput]],
                              builders: Sequence[protocol.CompletionBuilder]
                              | Sequence[protocol.ChatBuilder],
                              body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
                              collected: ChoiceOutputs) -> Response:
        """``respond`` for several choices (api/choices.py): one JSON body with every
        choice in index order, or one SSE stream whose chunks name their choice's
        ``index``, as OpenAI streams them."""
        now = trio.current_time()
        timers = [self.metrics.timer(now) for _ in builders]
        route = f"{request.method} {request.path}" if has_request_context() else "-"
        # one log line per HTTP request, with the first choice's figures
        log_line = partial(self._logged, timers[0], route, builders[0].response_id)
        if not body.stream:
            with log_line():
                async with closing(outputs):
                    async for index, output in outputs:
                        observe(timers[index], output)
                        builders[index].add(collected.take(index, output))
            if isinstance(body, protocol.CompletionRequest):
                return self._json(combined_completion(
                    cast(Sequence[protocol.CompletionBuilder], builders), collected))
            return self._json(combined_chat(cast(Sequence[protocol.ChatBuilder], builders),
                                            collected))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = self._choice_events(outputs, builders, collected, timers, log_line,
                                     include_usage=include_usage)
        return await event_stream(events)

    async def _choice_events(self, outputs: AsyncIterator[tuple[int, RequestOutput]],
                             builders: Sequence[protocol.CompletionBuilder]
                             | Sequence[protocol.ChatBuilder],
                             collected: ChoiceOutputs, timers: list[RequestTimer],
                             log_line: Callable[[], AbstractContextManager[None]], *,
                             include_usage: bool) -> AsyncGenerator[bytes, None]:
        """``_events`` for several choices: chunks in the order their output comes."""
        with log_line():
            async with closing(outputs):
                index, output = await anext(outputs)
                try:
                    while True:
                        observe(timers[index], output)
                        chunk = builders[index].chunk(collected.take(index, output))
                        if chunk is not None:
                            yield _sse_event(chunk)
                        index, output = await anext(outputs)
                except StopAsyncIteration:
                    pass
                except EngineError as error:
                    timers[0].summary = f"failed in the stream: {error}"
                    yield _error_event(error)
                    yield SSE_DONE
                    return
                if include_usage:
                    yield _sse_event(builders[0].usage_chunk(
                        collected.usage(collected.returned())))
                yield SSE_DONE

    async def _events(self, outputs: AsyncIterator[RequestOutput],
                      builder: protocol.CompletionBuilder | protocol.ChatBuilder,
                      timer: RequestTimer,
                      log_line: Callable[[], AbstractContextManager[None]], *,
                      include_usage: bool) -> AsyncGenerator[bytes, None]:
        """The SSE body: one event per output, as soon as it is produced.

        An error before the first output is raised; after it, it is sent as an
        error event followed by [DONE]. If the client goes away, Quart closes
        this generator (GeneratorExit at a yield) or cancels it (Cancelled while
        waiting for output); either way ``closing`` ends the engine request.
        """
        with log_line():
            async with closing(outputs):
                output = await anext(outputs)
                try:
                    while True:
                        observe(timer, output)
                        chunk = builder.chunk(output)
                        if chunk is not None:
                            yield _sse_event(chunk)
                        if output.finished:
                            break
                        output = await anext(outputs)
                except StopAsyncIteration:
                    pass
                except EngineError as error:
                    timer.summary = f"failed in the stream: {error}"
                    yield _error_event(error)
                    yield SSE_DONE
                    return
                if include_usage:
                    yield _sse_event(builder.usage_chunk())
                yield SSE_DONE

    @contextmanager
    def _logged(self, timer: RequestTimer, route: str, request_id: str) -> Iterator[None]:
        """The request's log line once it has ended, however it ends; an error
        raised out of it is logged by the error handler instead (engine_error)."""
        try:
            yield
        except EngineError:
            raise
        except BaseException:
            self._log_end(timer, route, request_id)
            raise
        self._log_end(timer, route, request_id)

    def _log_end(self, timer: RequestTimer, route: str, request_id: str) -> None:
        if self.config.disable_log_requests:
            return
        detail = timer.summary or (f"ended early after {timer.num_output_tokens} output "
                                   "tokens (client gone or cancelled)")
        log_request(route, 200, request_id, detail)

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names:
            # vLLM's message, and its 404; ours adds what is served instead.
            raise ModelNotFound(f"The model `{model}` does not exist. This server serves "
                                f"`{self.model_name}`.", param="model")

    # -- the rest of the API ------------------------------------------------------

    async def models(self) -> Response:
        return self._json(protocol.ModelList(data=[self._model_card()]))

    async def model(self, model_id: str) -> Response:
        """One model's card (the openai SDK's ``models.retrieve``); 404 for another."""
        self._check_model(model_id)
        return self._json(self._model_card())

    def _model_card(self) -> protocol.ModelCard:
        return protocol.ModelCard(id=self.model_name, created=self.created,
                                  root=self.engine.config.model,
                                  max_model_len=self.engine.max_model_len,
                                  vocab_size=self.engine.tokenizer.vocab_size)

    async def health(self) -> Response:
        problem = self.engine.health_problem
        if problem is None:
            return Response(b"", status=200)
        return self._error(503, problem)

    async def metrics_text(self) -> Response:
        try:
            statistics = await self.engine.fetch_statistics()
        except EngineError:
            statistics = None  # a dead engine has no counters; the histograms remain
        return Response(self.metrics.render(statistics), content_type=METRICS_CONTENT_TYPE)

    async def tokenize(self) -> Response:
        body = await self._decoded_body(protocol.TokenizeRequest)
        self._check_model(body.model)
        return self._json(await trio.to_thread.run_sync(self._tokenized, body,
                                                        limiter=self._tokenizer_threads))

    def _tokenized(self, body: protocol.TokenizeRequest) -> protocol.TokenizeResponse:
        """In a worker thread: tokenizing costs time linear in the text."""
        tokenizer = self.engine.tokenizer
        # As the engine's intake does: a rendered conversation already holds its
        # special tokens, so the tokenizer adds its own only when asked to.
        add_special_tokens = (body.messages is None if body.add_special_tokens is None
                              else body.add_special_tokens)
        token_ids = tokenizer.encode(self._tokenize_text(body),
                                     add_special_tokens=add_special_tokens)
        token_strs = None
        if body.return_token_strs:
            token_strs = [self._token_text(token_id) for token_id in token_ids]
        return protocol.TokenizeResponse(count=len(token_ids),
                                         max_model_len=self.engine.max_model_len,
                                         tokens=token_ids, token_strs=token_strs)

    def _tokenize_text(self, body: protocol.TokenizeRequest) -> str:
        if (body.prompt is None) == (body.messages is None):
            raise RequestRejected("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            return body.prompt
        assert body.messages is not None
        options = protocol.template_options(body)
        return self.engine.tokenizer.apply_chat_template(
            protocol.chat_messages(body.messages),
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **protocol.template_variables(body))

    async def detokenize(self) -> Response:
        body = await self._decoded_body(protocol.DetokenizeRequest)
        self._check_model(body.model)
        return self._json(await trio.to_thread.run_sync(self._detokenized, body,
                                                        limiter=self._tokenizer_threads))

    def _detokenized(self, body: protocol.DetokenizeRequest) -> protocol.DetokenizeResponse:
        """In a worker thread: decoding costs time linear in the token ids."""
        tokenizer = self.engine.tokenizer
        if any(token_id >= tokenizer.vocab_size for token_id in body.tokens):
            raise RequestRejected(f"token ids must be below {tokenizer.vocab_size}",
                                  param="tokens")
        return protocol.DetokenizeResponse(
            prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))

    async def openapi(self) -> Response:
        return Response(self._openapi_json, content_type=JSON_CONTENT_TYPE)

    async def version(self) -> Response:
        return self._json(protocol.VersionResponse(version=package_version("trio-llm")))

    async def ping(self) -> Response:
        """vLLM's (and SageMaker's) liveness probe: /health by another name."""
        return await self.health()

    async def not_supported(self, **_: object) -> Response:
        """Endpoints of the OpenAI API that trio-llm does not serve: say so, rather
        than a bare "URL not found"."""
        return self._error(404, f"{request.path} is not supported by trio-llm: it serves "
                                "/v1/completions, /v1/chat/completions and /v1/responses "
                                "(docs/http-api.md)")

    # -- guards and errors --------------------------------------------------------

    async def check_api_key(self) -> Response | None:
        """401 unless the request carries the API key (when one is set).

        /health and /metrics stay open for probes and scrapers.
        """
        if self._api_key is None or request.path in OPEN_PATHS:
            return None
        if request.method == "OPTIONS":
            return None  # a CORS preflight never carries credentials
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, self._api_key):
            return None
        return self._error(401, "missing or wrong API key (Authorization: Bearer <key>)")

    async def engine_error(self, error: EngineError) -> Response:
        status, message, param = _error_info(error)
        if not self.config.disable_log_requests:
            log_request(f"{request.method} {request.path}", status, "-", message)
        return self._error(status, message, param=param)

    async def http_error(self, error: HTTPException) -> Response:
        status = error.code or 500
        response = self._error(status, error.description or error.name)
        if status in BODY_LEFT_UNREAD_STATUSES:
            # The rest of the body was never read: this connection cannot
            # carry another request, so say so (the server closes it).
            response.headers["Connection"] = "close"
        if status == 405 and error.get_headers():
            response.headers.update({k: v for k, v in error.get_headers() if k == "Allow"})
        return response

    async def internal_error(self, error: Exception) -> Response:
        logger.exception("internal error while serving %s %s", request.method, request.path,
                         exc_info=error)
        return self._error(500, "internal server error")

    def _error(self, status: int, message: str, *, param: str | None = None) -> Response:
        response = self._json(_error_body(status, message, param), status=status)
        if status == 503:
            response.headers["Retry-After"] = str(self.config.retry_after_seconds)
        return response

    def _json(self, body: msgspec.Struct, *, status: int = 200) -> Response:
        return Response(msgspec.json.encode(body), status=status, content_type=JSON_CONTENT_TYPE)


# -- error mapping --------------------------------------------------------------------

# Statuses sent before the whole request body was read.
BODY_LEFT_UNREAD_STATUSES = frozenset({408, 413})
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


def _error_info(error: EngineError) -> tuple[int, str, str | None]:
    """HTTP status, message and param of an engine error."""
    match error:
        case QueueFull():
            return 503, error.message, None
        case ModelNotFound():
            return 404, error.message, error.param
        case RequestRejected():
            return 400, error.message, error.param
        case RequestFailed():
            return 500, error.message, None
        case _:
            return 503, str(error) or type(error).__name__, None


def _error_body(status: int, message: str, param: str | None) -> protocol.ErrorResponse:
    error_type = ERROR_TYPES.get(status, "invalid_request_error")
    return protocol.error_response(message, error_type=error_type, status=status, param=param)


# -- request bodies --------------------------------------------------------------------

# What vLLM (FastAPI) parses as a JSON body: no Content-Type, or a JSON one.
JSON_SUBTYPE_SUFFIX = "+json"


async def _decoded_body(kind: type[BodyT]) -> tuple[BodyT, bytes | str]:
    """The request's JSON body as ``kind``, and its bytes; a 400 naming what is
    wrong otherwise."""
    _check_content_type(request.mimetype)
    data = await request.get_data()
    return protocol.decode_request(data, kind), data


def _check_content_type(mimetype: str) -> None:
    if not mimetype or mimetype == JSON_CONTENT_TYPE:
        return
    if mimetype.startswith("application/") and mimetype.endswith(JSON_SUBTYPE_SUFFIX):
        return
    raise RequestRejected(f"the body must be JSON (Content-Type: application/json), "
                          f"not {mimetype}", param="Content-Type")


def _chat_arguments(body: protocol.ChatCompletionRequest, *,
                    tool_constraint: StructuredOutputsParams | None = None,
                    defaults: GenerationDefaults | None = None,
                    ) -> tuple[list[dict[str, Any]], SamplingParams]:
    """The engine's arguments, at a cost linear in the body."""
    messages = protocol.chat_messages(body.messages)
    max_tokens = protocol.requested_max_tokens(body)
    return messages, protocol.chat_sampling_params(body, max_tokens=max_tokens,
                                                   tool_constraint=tool_constraint,
                                                   defaults=defaults)


# -- streaming and request tracking ---------------------------------------------------


def _sse_event(body: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def _error_event(error: EngineError) -> bytes:
    return _sse_event(_error_body(*_error_info(error)))
