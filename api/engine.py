"""The in-process API: the Engine facade over the actors.

    async with Engine.open(EngineConfig(model="tiny")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")

Cancellation belongs to the caller: leaving a `generate` stream early, or a
cancel scope around it, aborts the request; its KV blocks are free within one
engine step.

The same facade fronts both layouts (docs/architecture.md, "Processes"):
``Engine.open`` runs every actor in this process; ``Engine.open_front`` runs
intake and detokenizer here, in front of an engine core in another process
(api/processes.py), reached over a local socket.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import EngineDead, EngineError
from trio_llm.actors.fronts import CoreReady, CoreToFront
from trio_llm.actors.messages import Abort, RequestOutput, SamplingParams, Submit
from trio_llm.actors.runner import LoadedExecutor
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.supervisor import (
    EngineActors,
    EngineStatistics,
    run_front_supervisor,
    run_supervisor,
)
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.actors.wire import WireError, open_wire_channel

if TYPE_CHECKING:
    from trio_llm.gpu.executor import ModelExecutor
    from trio_llm.gpu.tp_executor import TensorParallelExecutor

logger = logging.getLogger(__name__)

# Sending an Abort only waits for room in the intake's inbox; bound it anyway,
# since it runs shielded in cleanup.
ABORT_SEND_TIMEOUT = 5.0

__all__ = ["Engine", "EngineConfig", "EngineStatistics", "RequestOutput", "SamplingParams"]


class Engine:
    """A running engine. Create it with ``Engine.open(config)``."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, actors: EngineActors,
                 streams: RequestStreams, *, max_model_len: int,
                 request_id_prefix: str = "req-") -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or config.model
        self.max_model_len = max_model_len
        self._actors = actors
        self._streams = streams
        self._request_counter = itertools.count()
        # Ids are unique across the API servers of one engine core: each has its own prefix.
        self._request_id_prefix = request_id_prefix
        self._aborted: set[str] = set()
        self._draining = False

    @classmethod
    @asynccontextmanager
    async def open(cls, config: EngineConfig | None = None, *,
                   executor: LoadedExecutor | None = None) -> AsyncIterator[Engine]:
        """Load the model, start the actors, and shut them down on exit.

        On exit: stop taking requests, let in-flight ones finish for up to
        ``config.shutdown_grace_seconds``, then cancel. Raises EngineDead at
        exit if an actor failed while the engine ran. ``executor`` replaces the
        model executor built from the config (benchmarks, fault injection).
        """
        config = config or EngineConfig()
        async with created_executor(config, executor) as executor:
            tokenizer = Tokenizer.from_dir(config.tokenizer or executor.model_path)
            streams = RequestStreams()
            async with trio.open_nursery() as nursery:
                actors = await nursery.start(partial(
                    run_supervisor, config, executor, tokenizer, streams,
                    max_model_len=executor.max_model_len, num_kv_blocks=executor.num_kv_blocks,
                    vocab_size=executor.vocab_size,
                ))
                engine = cls(config, tokenizer, actors, streams,
                             max_model_len=executor.max_model_len)
                async with engine._running(nursery.cancel_scope):
                    yield engine
        if actors.error is not None:
            raise actors.error

    @classmethod
    @asynccontextmanager
    async def open_front(cls, config: EngineConfig,
                         core_stream: trio.SocketStream) -> AsyncIterator[Engine]:
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
            tokenizer = await trio.to_thread.run_sync(
                Tokenizer.from_dir, config.tokenizer or ready.model_path)
            streams = RequestStreams()
            async with trio.open_nursery() as nursery:
                actors = await nursery.start(partial(
                    run_front_supervisor, config, tokenizer, streams, ready, core))
                engine = cls(config, tokenizer, actors, streams,
                             max_model_len=ready.max_model_len,
                             request_id_prefix=f"req-{ready.front_index}-")
                async with engine._running(nursery.cancel_scope):
                    yield engine
        if actors.error is not None:
            raise actors.error

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
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the output of one request, as deltas; the last has ``finished``.
        Only requests with the same ``cache_salt`` share prefix-cache blocks."""
        text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        submit = Submit(request_id=request_id or self._new_request_id(), prompt=text,
                        prompt_token_ids=token_ids, params=params or SamplingParams(),
                        priority=priority, arrival_time=trio.current_time(),
                        cache_salt=cache_salt)
        return self._run(submit)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             priority: int = 0, request_id: str | None = None,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Like generate, for a conversation rendered with the model's chat template
        (with ``tools`` and ``chat_template_kwargs``, when given, as template variables)."""
        submit = Submit(request_id=request_id or self._new_request_id(), messages=messages,
                        tools=tools, chat_template_kwargs=chat_template_kwargs,
                        params=params or SamplingParams(), priority=priority,
                        arrival_time=trio.current_time(), cache_salt=cache_salt)
        return self._run(submit)

    async def abort(self, request_id: str) -> None:
        """End a running or waiting request; its stream finishes with reason "abort"."""
        if request_id in self._streams and request_id not in self._aborted:
            self._aborted.add(request_id)
            await self._actors.intake_outbox.send(Abort(request_id=request_id))

    async def _run(self, submit: Submit) -> AsyncIterator[RequestOutput]:
        self._check_accepting()
        request_id = submit.request_id
        stream = self._streams.open(request_id)
        finished = False
        try:
            await self._actors.intake_outbox.send(submit)
            while not finished:
                output = await stream.receive()
                finished = output.finished
                yield output
        except EngineError:
            finished = True  # rejected, or the engine died: nothing left to abort
            raise
        finally:
            self._streams.close(request_id)
            if not finished and request_id not in self._aborted and not self._actors.dead.is_set():
                with trio.move_on_after(ABORT_SEND_TIMEOUT, shield=True):
                    await self._actors.intake_outbox.send(Abort(request_id=request_id))
            self._aborted.discard(request_id)

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
        """False once the engine is dead or draining."""
        return not self._draining and self._actors.error is None

    @property
    def num_open_requests(self) -> int:
        """Requests whose output stream a caller still holds."""
        return len(self._streams)

    def begin_drain(self) -> None:
        """Take no new requests; those in flight go on."""
        self._draining = True

    async def wait_dead(self) -> None:
        """Return once an actor failed and the engine stopped."""
        await self._actors.dead.wait()

    async def drain(self, grace_seconds: float | None = None) -> None:
        """The one drain, shared by this facade's exit and the HTTP server's stop:
        take no new requests, let open ones finish for up to ``grace_seconds``
        (default ``config.shutdown_grace_seconds``), then end the rest with
        EngineDead. Their callers see the error at once; nothing waits longer."""
        self.begin_drain()
        if grace_seconds is None:
            grace_seconds = self.config.shutdown_grace_seconds
        with trio.move_on_after(grace_seconds, shield=True):
            await self._streams.wait_empty()
        if len(self._streams):
            logger.warning("shutting down with %d requests still open", len(self._streams))
            self._streams.fail_all(EngineDead("the engine shut down"))


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


def create_executor(config: EngineConfig) -> ModelExecutor | TensorParallelExecutor:
    """The model executor for ``config`` (trio_llm.gpu.executor). Imported on
    use: an API server of the served layout never loads a model, and so never
    imports torch."""
    from trio_llm.gpu.executor import create_executor as create

    return create(config)
