"""The in-process API: the Engine facade over the actors.

    async with Engine.open(EngineConfig(model="tiny")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")

    # a model served as an embedding model: EngineConfig(..., runner="pooling")
    vector = (await engine.embed("Hello")).embedding

Cancellation belongs to the caller: leaving a `generate` stream early (a
``break``, ``aclose()``, the end of an ``async with`` around it), or a cancel
scope around it, aborts the request; its KV blocks are free within one engine
step (RequestOutputStream says how).

The same facade fronts both layouts (docs/architecture.md, "Processes"):
``Engine.open`` runs every actor in this process; ``Engine.open_front`` runs
intake and detokenizer here, in front of an engine core in another process
(api/processes.py), reached over a local socket.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import EngineDead, EngineError, RequestFailed, RequestRejected
from trio_llm.actors.fronts import CoreReady, CoreToFront
from trio_llm.actors.generation_defaults import GenerationDefaults, read_generation_defaults
from trio_llm.actors.messages import (
    Abort,
    ChatTemplateOptions,
    PoolingParams,
    RequestOutput,
    SamplingParams,
    Submit,
    embedding_values,
)
from trio_llm.actors.pooling import PoolingConfig, read_pooling_config
from trio_llm.actors.runner import LoadedExecutor
from trio_llm.actors.streams import RequestStream, RequestStreams, StreamGroup
from trio_llm.actors.supervisor import (
    EngineActors,
    EngineStatistics,
    run_front_supervisor,
    run_supervisor,
)
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.actors.wire import WireError, open_wire_channel

if TYPE_CHECKING:
    from trio_llm.api.warm_up import WarmUpPlan
    from trio_llm.gpu.cuda_executor import CudaModelExecutor
    from trio_llm.gpu.executor import ModelExecutor
    from trio_llm.gpu.tp_executor import TensorParallelExecutor

logger = logging.getLogger(__name__)

# Sending an Abort only waits for room in the intake's inbox; bound it anyway,
# since it runs shielded in cleanup.
ABORT_SEND_TIMEOUT = 5.0

__all__ = ["EmbeddingOutput", "Engine", "EngineConfig", "EngineStatistics", "PoolingParams",
           "RequestOutput", "RequestOutputStream", "SamplingParams"]


class EmbeddingOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One embedding request's result (vLLM's EmbeddingRequestOutput, flattened):
    ``embedding`` as floats, ``data`` the same float32 values as little-endian bytes
    (what base64 encodes), the prompt's token ids as the model saw them."""

    request_id: str
    embedding: list[float]
    data: bytes
    prompt_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Engine:
    """A running engine. Create it with ``Engine.open(config)``."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, actors: EngineActors,
                 streams: RequestStreams, *, max_model_len: int,
                 request_id_prefix: str = "req-",
                 generation_defaults: GenerationDefaults | None = None,
                 pooling: PoolingConfig | None = None) -> None:
        self.config = config
        # the pooling runner's pooling (the model serves embeddings), else None
        self.pooling = pooling
        self.tokenizer = tokenizer
        # the checkpoint's default sampling parameters (--generation-config)
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.model_name = config.served_model_name or config.model
        self.max_model_len = max_model_len
        self._actors = actors
        self._streams = streams
        self._request_counter = itertools.count()
        # Ids are unique across the API servers of one engine core: each has its own prefix.
        self._request_id_prefix = request_id_prefix
        self._aborted: set[str] = set()
        self._draining = False
        self._is_drain_started = False
        self._ready = trio.Event()
        # A drain ends the warm-up at once: its requests are nobody's.
        self._warm_up_scope = trio.CancelScope()
        self._drained = trio.Event()
        self._trio_token = trio.lowlevel.current_trio_token()

    @classmethod
    @asynccontextmanager
    async def open(cls, config: EngineConfig | None = None, *,
                   executor: LoadedExecutor | None = None,
                   warm_up: WarmUpPlan | None = None) -> AsyncIterator[Engine]:
        """Load the model, start the actors, and shut them down on exit.

        ``warm_up``: run the warm-up requests (api/warm_up.py) in the background
        first; the engine is not healthy (``is_healthy``, /health) until they
        have run (``wait_ready``). Without it, it is ready at once.

        On exit: stop taking requests, let in-flight ones finish for up to
        ``config.shutdown_grace_seconds``, then cancel. Raises EngineDead at
        exit if an actor failed while the engine ran. ``executor`` replaces the
        model executor built from the config (benchmarks, fault injection).
        """
        config = config or EngineConfig()
        async with created_executor(config, executor) as executor:
            tokenizer = Tokenizer.from_dir(config.tokenizer or executor.model_path,
                                           chat_template=config.chat_template)
            defaults = read_generation_defaults(config.generation_config, executor.model_path)
            pooling = pooling_config(config, executor.model_path)
            streams = RequestStreams()
            async with trio.open_nursery() as nursery:
                actors = await nursery.start(partial(
                    run_supervisor, config, executor, tokenizer, streams,
                    max_model_len=executor.max_model_len, num_kv_blocks=executor.num_kv_blocks,
                    vocab_size=executor.vocab_size, pooling=pooling,
                ))
                engine = cls(config, tokenizer, actors, streams,
                             max_model_len=executor.max_model_len,
                             generation_defaults=defaults, pooling=pooling)
                engine._start_warm_up(nursery, warm_up)
                async with engine._running(nursery.cancel_scope):
                    yield engine
        if actors.error is not None:
            raise actors.error

    @classmethod
    @asynccontextmanager
    async def open_front(cls, config: EngineConfig, core_stream: trio.SocketStream, *,
                         warm_up: WarmUpPlan | None = None) -> AsyncIterator[Engine]:
        """The facade of one API server: intake and detokenizer here, in front of
        the engine core at the other end of ``core_stream`` (served layout).

        Waits for the core's CoreReady (the model is loaded), then behaves as
        ``Engine.open`` does, drain and failures included: if the core fails or
        goes away, every open request gets EngineDead and EngineDead is raised
        at exit. Closing the socket on exit tells the core this front has gone.
        """
        async with core_stream:
            core = open_wire_channel(core_stream, CoreToFront)
            ready = await _wait_core_ready(core[1])
            tokenizer = await trio.to_thread.run_sync(partial(
                Tokenizer.from_dir, config.tokenizer or ready.model_path,
                chat_template=config.chat_template))
            defaults = read_generation_defaults(config.generation_config, ready.model_path)
            pooling = pooling_config(config, ready.model_path)
            streams = RequestStreams()
            async with trio.open_nursery() as nursery:
                actors = await nursery.start(partial(
                    run_front_supervisor, config, tokenizer, streams, ready, core,
                    pooling=pooling))
                engine = cls(config, tokenizer, actors, streams,
                             max_model_len=ready.max_model_len,
                             request_id_prefix=f"req-{ready.front_index}-",
                             generation_defaults=defaults, pooling=pooling)
                engine._start_warm_up(nursery, warm_up)
                async with engine._running(nursery.cancel_scope):
                    yield engine
        if actors.error is not None:
            raise actors.error

    def _start_warm_up(self, nursery: trio.Nursery, plan: WarmUpPlan | None) -> None:
        if plan is None:
            self._ready.set()
            return

        async def warm_up_then_ready() -> None:
            from trio_llm.api.warm_up import warm_up

            with self._warm_up_scope:
                seconds = await warm_up(self, plan)
                if not plan.front_only and not self._draining:  # they were not traffic
                    with contextlib.suppress(EngineError):  # a dead engine has no totals
                        await self._actors.restart_counters()
                if not self._draining:
                    logger.info("warmed up in %.1f s: ready", seconds)
                    self._ready.set()

        nursery.start_soon(warm_up_then_ready)

    @asynccontextmanager
    async def _running(self, actors_scope: trio.CancelScope) -> AsyncIterator[None]:
        """The engine's lifetime as its caller holds it; on the way out, the one
        drain, then the actors are cancelled."""
        # Everything allocated so far lives as long as the engine: keep it
        # out of the collector's generations, so full collections stay short.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await self.drain()
            actors_scope.cancel()
            gc.unfreeze()

    # -- requests -------------------------------------------------------------

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                 priority: int = 0, request_id: str | None = None,
                 cache_salt: str | None = None) -> RequestOutputStream:
        """Stream the output of one request, as deltas; the last has ``finished``.
        Only requests with the same ``cache_salt`` share prefix-cache blocks.
        ``params`` None: ``default_sampling_params()``."""
        text, token_ids = _prompt_fields(prompt)
        submit = Submit(request_id=request_id or self._new_request_id(), prompt=text,
                        prompt_token_ids=token_ids,
                        params=params or self.default_sampling_params(),
                        priority=priority, arrival_time=trio.current_time(),
                        cache_salt=cache_salt)
        return self._run(submit)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             priority: int = 0, request_id: str | None = None,
             tools: list[dict[str, Any]] | None = None,
             documents: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             template_options: ChatTemplateOptions | None = None,
             cache_salt: str | None = None) -> RequestOutputStream:
        """Like generate, for a conversation rendered with the model's chat template
        (with ``tools``, ``documents`` and ``chat_template_kwargs``, when given, as
        template variables; ``template_options``: add_generation_prompt or
        continue_final_message)."""
        submit = Submit(request_id=request_id or self._new_request_id(), messages=messages,
                        tools=tools, documents=documents,
                        chat_template_kwargs=chat_template_kwargs,
                        template_options=template_options or ChatTemplateOptions(),
                        params=params or self.default_sampling_params(), priority=priority,
                        arrival_time=trio.current_time(), cache_salt=cache_salt)
        return self._run(submit)

    def generate_many(self, prompts: Sequence[tuple[str | list[int], SamplingParams]], *,
                      priority: int = 0, request_id: str | None = None,
                      cache_salt: str | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several requests read as one stream of (index, output) deltas, in the order
        their output comes: the choices of one HTTP request (``n``, ``best_of``,
        batched prompts). Request ``index`` is named ``{request_id}-{index}``; each is
        exactly the request ``generate`` would run. Leaving the stream early aborts
        every request not finished yet."""
        base_id = request_id or self._new_request_id()
        submits = []
        for index, (prompt, params) in enumerate(prompts):
            text, token_ids = _prompt_fields(prompt)
            submits.append(Submit(request_id=f"{base_id}-{index}", group_id=base_id, prompt=text,
                                  prompt_token_ids=token_ids, params=params, priority=priority,
                                  arrival_time=trio.current_time(), cache_salt=cache_salt))
        return self._run_many(submits)

    def chat_many(self, messages: list[dict[str, Any]], params: Sequence[SamplingParams], *,
                  priority: int = 0, request_id: str | None = None,
                  tools: list[dict[str, Any]] | None = None,
                  documents: list[dict[str, Any]] | None = None,
                  chat_template_kwargs: dict[str, Any] | None = None,
                  template_options: ChatTemplateOptions | None = None,
                  cache_salt: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Like generate_many, for one conversation answered once per ``params``
        (the template arguments as in ``chat``)."""
        base_id = request_id or self._new_request_id()
        submits = [Submit(request_id=f"{base_id}-{index}", group_id=base_id,
                          messages=messages, tools=tools, documents=documents,
                          chat_template_kwargs=chat_template_kwargs,
                          template_options=template_options or ChatTemplateOptions(),
                          params=choice_params,
                          priority=priority, arrival_time=trio.current_time(),
                          cache_salt=cache_salt)
                   for index, choice_params in enumerate(params)]
        return self._run_many(submits)

    # -- embeddings (the pooling runner) ------------------------------------------

    async def embed(self, prompt: str | list[int], pooling: PoolingParams | None = None, *,
                    priority: int = 0, request_id: str | None = None,
                    cache_salt: str | None = None) -> EmbeddingOutput:
        """The embedding of one prompt (vLLM's ``LLM.embed``), on an engine with
        ``runner="pooling"``: a prefill-only request through the same engine, batched
        with the others. Cancelling the call aborts it."""
        submit = self._embedding_submit(prompt, pooling, request_id or self._new_request_id(),
                                        priority, cache_salt)
        async with self._run(submit) as stream:
            async for output in stream:
                if output.finished:
                    return _embedding_output(output)
        raise AssertionError("a request stream ends with a finished output")

    async def embed_many(self, prompts: Sequence[str | list[int]],
                         pooling: PoolingParams | None = None, *, priority: int = 0,
                         request_id: str | None = None,
                         cache_salt: str | None = None) -> list[EmbeddingOutput]:
        """The embeddings of several prompts, in their order: one request each
        (``{request_id}-{index}``), all submitted at once and read as one stream. The
        first refusal ends the call (the others are aborted)."""
        base_id = request_id or self._new_request_id()
        submits = [self._embedding_submit(prompt, pooling, f"{base_id}-{index}", priority,
                                          cache_salt)
                   for index, prompt in enumerate(prompts)]
        results: list[EmbeddingOutput | None] = [None] * len(submits)
        # (an async generator: closed here if a result raises, which aborts the rest)
        many = cast(AsyncGenerator[tuple[int, RequestOutput], None], self._run_many(submits))
        async with contextlib.aclosing(many) as outputs:
            async for index, output in outputs:
                if output.finished:
                    results[index] = _embedding_output(output)
        assert all(result is not None for result in results), "every request finished"
        return results  # type: ignore[return-value]

    def _embedding_submit(self, prompt: str | list[int], pooling: PoolingParams | None,
                          request_id: str, priority: int, cache_salt: str | None) -> Submit:
        text, token_ids = _prompt_fields(prompt)
        return Submit(request_id=request_id, prompt=text, prompt_token_ids=token_ids,
                      params=SamplingParams(), pooling=pooling or PoolingParams(),
                      priority=priority, arrival_time=trio.current_time(),
                      cache_salt=cache_salt)

    async def _run_many(self, submits: list[Submit]
                        ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """``_run`` for several requests read by one task through a StreamGroup."""
        self._check_accepting()
        request_ids = [submit.request_id for submit in submits]
        is_open = [False] * len(submits)
        streams = []
        try:
            for index, submit in enumerate(submits):
                streams.append(self._streams.open(submit.request_id))
                is_open[index] = True
            group = StreamGroup(streams)
            for submit in submits:
                await self._actors.intake_outbox.send(submit)
            while any(is_open):
                try:
                    index, output = await group.receive(is_open)
                except EngineError:
                    # this one was rejected (the others are aborted) or the engine died
                    is_open[group.last_index] = False
                    raise
                is_open[index] = not output.finished
                yield index, output
        finally:
            for request_id in request_ids:
                self._streams.close(request_id)
            await self._abort_unfinished(
                [request_id for request_id, still_open in zip(request_ids, is_open, strict=True)
                 if still_open])

    async def _abort_unfinished(self, request_ids: list[str]) -> None:
        if self._actors.dead.is_set():
            return
        with trio.move_on_after(ABORT_SEND_TIMEOUT, shield=True):
            for request_id in request_ids:
                if request_id not in self._aborted:
                    await self._actors.intake_outbox.send(Abort(request_id=request_id))
        for request_id in request_ids:
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """End a running or waiting request; its stream finishes with reason "abort"."""
        if request_id in self._streams and request_id not in self._aborted:
            self._aborted.add(request_id)
            await self._actors.intake_outbox.send(Abort(request_id=request_id))

    def _run(self, submit: Submit) -> RequestOutputStream:
        return RequestOutputStream(self, submit)

    def _check_abort(self, request_id: str) -> Abort | None:
        """The Abort to send for a request whose caller left before it finished;
        None when there is nothing to abort (aborted already, or the engine is dead)."""
        self._streams.close(request_id)
        if request_id in self._aborted:
            self._aborted.discard(request_id)
            return None
        return None if self._actors.dead.is_set() else Abort(request_id=request_id)

    async def _send_abort(self, abort: Abort) -> None:
        with trio.move_on_after(ABORT_SEND_TIMEOUT, shield=True):
            try:
                await self._actors.intake_outbox.send(abort)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the engine has stopped: nothing runs any more

    def _abandon_soon(self, request_id: str) -> None:
        """Abort a request whose stream was dropped unfinished: from any thread (a
        garbage collection may run in one), at the trio loop's next turn."""
        def abort_in_the_loop() -> None:
            abort = self._check_abort(request_id)
            if abort is not None:
                trio.lowlevel.spawn_system_task(self._send_abort, abort)

        with contextlib.suppress(trio.RunFinishedError):
            self._trio_token.run_sync_soon(abort_in_the_loop)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's defaults (``--generation-config``),
        as vLLM's ``get_default_sampling_params``."""
        return self.generation_defaults.sampling_params()

    def _new_request_id(self) -> str:
        return f"{self._request_id_prefix}{next(self._request_counter)}"

    def _check_accepting(self) -> None:
        if self._actors.error is not None:
            raise self._actors.error
        if self._draining:
            raise EngineDead("the engine is shutting down and takes no new requests")

    # -- state ----------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's counters (running, waiting, KV blocks,
        totals). In-process only: an API server asks the core with
        ``fetch_statistics``."""
        return self._actors.statistics()

    async def fetch_statistics(self) -> EngineStatistics:
        """A snapshot of the engine's counters, in either layout."""
        return await self._actors.fetch_statistics()

    @property
    def is_healthy(self) -> bool:
        """False until warmed up (``Engine.open``'s ``warm_up``), and once the engine
        is dead or draining."""
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """Why the engine is not healthy (what /health's 503 says); None when it is."""
        if self._actors.error is not None:
            return "the engine is dead"
        if self._draining:
            return "the engine is shutting down"
        if not self._ready.is_set():
            return "the engine is warming up (its CUDA graphs and first steps); retry shortly"
        return None

    async def wait_ready(self) -> None:
        """Return once the warm-up has run (at once without one)."""
        await self._ready.wait()

    @property
    def num_open_requests(self) -> int:
        """Requests whose output stream a caller still holds."""
        return len(self._streams)

    def begin_drain(self) -> None:
        """Take no new requests; those in flight go on (a warm-up's end now)."""
        self._draining = True
        self._warm_up_scope.cancel()

    async def wait_dead(self) -> None:
        """Return once an actor failed and the engine stopped."""
        await self._actors.dead.wait()

    async def drain(self) -> None:
        """The one drain, shared by this facade's exit and the HTTP server's stop
        (whichever comes first runs it; a later call waits for it): take no new
        requests, let open ones finish for up to ``config.shutdown_grace_seconds``,
        then end the rest with EngineDead. Their callers see the error at once;
        nothing waits longer."""
        if self._is_drain_started:
            with trio.CancelScope(shield=True):  # bounded by the first call's grace
                await self._drained.wait()
            return
        self._is_drain_started = True
        self.begin_drain()
        with trio.move_on_after(self.config.shutdown_grace_seconds, shield=True):
            await self._streams.wait_empty()
        if len(self._streams):
            logger.warning("shutting down with %d requests still open", len(self._streams))
            self._streams.fail_all(EngineDead("the engine shut down"))
        self._drained.set()


class RequestOutputStream:
    """One request's outputs, as deltas; the last has ``finished``. The request
    is sent to the engine on the first ``anext``, and ends when the stream does.

    Use it as a loop, or (to end the request at a known point) as its own
    async context manager::

        async for output in engine.generate(prompt, params):
            ...

        async with engine.generate(prompt, params) as stream:
            async for output in stream:
                if enough(output):
                    break  # the request is aborted here, on the way out

    Leaving before the last output aborts the request and frees its KV blocks
    within an engine step, however the caller leaves: ``aclose()`` (which the
    ``async with`` calls), a cancelled ``anext``, or a loop left early: each
    ``async for`` iterates through its own iterator, which aborts the request
    when the loop drops it, even while the stream itself is still held in a
    variable. A stream dropped unfinished is aborted when it is collected, as
    a last resort. (So one loop consumes the stream: a second ``async for``
    after a ``break`` finds it ended.)
    """

    def __init__(self, engine: Engine, submit: Submit) -> None:
        self._engine = engine
        self._submit = submit
        self.request_id = submit.request_id
        self._is_started = False
        self._is_done = False  # finished, failed, or closed by the caller
        self._stream: RequestStream | None = None

    async def __aenter__(self) -> RequestOutputStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return _StreamLoop(self)

    async def __anext__(self) -> RequestOutput:
        if self._is_done:
            raise StopAsyncIteration
        if not self._is_started:
            await self._start()
        assert self._stream is not None
        try:
            output = await self._stream.receive()
        except EngineError:
            self._end()  # rejected, or the engine died: nothing left to abort
            raise
        except BaseException:
            await self.aclose()  # cancelled: the request ends with the caller
            raise
        if output.finished:
            self._end()
        return output

    async def _start(self) -> None:
        engine = self._engine
        engine._check_accepting()
        self._is_started = True
        self._stream = engine._streams.open(self.request_id)
        try:
            await engine._actors.intake_outbox.send(self._submit)
        except BaseException:
            await self.aclose()
            raise

    def _end(self) -> None:
        """The request is over (finished or failed): only its stream to close."""
        self._is_done = True
        self._engine._streams.close(self.request_id)
        self._engine._aborted.discard(self.request_id)

    async def aclose(self) -> None:
        """End the request now, if it has not ended (shielded, time-bounded)."""
        if self._is_done or not self._is_started:
            self._is_done = True
            return
        self._is_done = True
        abort = self._engine._check_abort(self.request_id)
        if abort is not None:
            await self._engine._send_abort(abort)

    def _abandon(self) -> None:
        """The caller dropped the stream (or its loop) unfinished: abort it soon."""
        if self._is_started and not self._is_done:
            self._is_done = True
            self._engine._abandon_soon(self.request_id)

    def __del__(self) -> None:
        self._abandon()


class _StreamLoop:
    """The iterator of one ``async for`` over a stream: dropped by a loop left
    early, it aborts the request (see RequestOutputStream)."""

    def __init__(self, stream: RequestOutputStream) -> None:
        self._stream = stream

    def __aiter__(self) -> _StreamLoop:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._stream.__anext__()

    def __del__(self) -> None:
        self._stream._abandon()


def _prompt_fields(prompt: str | Sequence[int]) -> tuple[str | None, list[int] | None]:
    """A prompt as Submit's (text, token ids); anything else refused, naming it."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list | tuple) and all(isinstance(token_id, int) for token_id in prompt):
        return None, list(prompt)
    raise RequestRejected(f"the prompt must be a string or a list of token ids, not "
                          f"{type(prompt).__name__}", param="prompt")


def _embedding_output(output: RequestOutput) -> EmbeddingOutput:
    if output.embedding is None:
        raise RequestFailed(f"request {output.request_id!r} ended ({output.finish_reason}) "
                            f"before its embedding was computed", stage="embed")
    return EmbeddingOutput(request_id=output.request_id,
                           embedding=embedding_values(output.embedding), data=output.embedding,
                           prompt_token_ids=output.prompt_token_ids or [])


def pooling_config(config: EngineConfig, model_path: str | Path) -> PoolingConfig | None:
    """The checkpoint's pooling where the engine runs it as an embedding model."""
    if config.runner != "pooling":
        return None
    return read_pooling_config(model_path)


async def _wait_core_ready(wire: trio.abc.ReceiveChannel[CoreToFront]) -> CoreReady:
    try:
        message = await wire.receive()
    except (trio.EndOfChannel, WireError) as error:
        raise EngineDead("the engine core went away before it was ready") from error
    if not isinstance(message, CoreReady):
        raise EngineDead(f"the engine core sent {type(message).__name__} before CoreReady")
    return message


@asynccontextmanager
async def created_executor(config: EngineConfig, executor: LoadedExecutor | None
                            ) -> AsyncIterator[LoadedExecutor]:
    """``executor``, or one created for ``config`` and closed on exit (a tensor-parallel
    executor stops its worker processes then); the caller closes an executor it gave."""
    if executor is not None:
        yield executor
        return
    created = await trio.to_thread.run_sync(create_executor, config)
    try:
        yield created
    finally:
        close = getattr(created, "close", None)
        if close is not None:
            # bounded by close itself (it kills ranks that do not stop)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(close)


def create_executor(config: EngineConfig
                    ) -> ModelExecutor | CudaModelExecutor | TensorParallelExecutor:
    """The model executor for ``config`` (trio_llm.gpu.factory). Imported on
    use: an API server of the served layout never loads a model, and so never
    imports torch."""
    from trio_llm.gpu.factory import create_executor as create

    return create(config)
