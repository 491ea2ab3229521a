"""Serving: the HTTP app (api/server.py) on Hypercorn's trio worker, for as long
as the engine lives, and the stop signals of every process layout.

Lifetimes nest: the engine's nursery (Engine.open) holds the server's, which
holds Hypercorn's.

Shutdown: SIGINT or SIGTERM runs the engine's one drain (``Engine.drain``:
new requests get 503 with Retry-After, /health turns 503, the socket still
answers; open requests finish for up to the engine's
``shutdown_grace_seconds``, the rest end with an error), then stops Hypercorn.
A second signal stops at once.

``stop_on_signals`` is the one handler of SIGINT and SIGTERM, in every process
of every layout: the single process and an API server (graceful stop, then at
once), the supervisor (passes each signal on, api/processes.py) and the engine
core (stops). Only the process a terminal's Ctrl-C reaches first (the single
process, the supervisor) listens to SIGINT; children ignore it, since the
supervisor passes it on once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from functools import partial
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

from trio_llm.actors.config import EngineConfig
from trio_llm.api.connections import CompletedResponseGuard
from trio_llm.api.framing import StrictFraming, strictly_framed
from trio_llm.api.server import ServerConfig, create_app
from trio_llm.api.stats_log import log_stats_every

if TYPE_CHECKING:
    from trio_llm.api.engine import Engine

logger = logging.getLogger(__name__)

# After the drain, Hypercorn lets responses being written go out for this long.
STRAGGLER_SECONDS = 1.0
# An idle keep-alive connection is closed after this long. Hypercorn's default (5 s)
# equals the idle expiry of httpx's pool (and so of the OpenAI client): a client
# reuses a connection idle for just under 5 s while the server closes it, and the
# request on it fails ("Server disconnected without sending a response"); under
# load, with the loops lagging, about 1% of requests did (docs/performance.md,
# "Process layouts"). A server must keep idle connections longer than its clients
# do (nginx's default: 75 s). A graceful stop closes idle connections at once.
KEEP_ALIVE_SECONDS = 75.0
# Connections the kernel may hold for the server before it accepts them, as
# uvicorn's (vLLM's) default. Hypercorn listens with 100, on a socket it is handed
# too: of a burst of more new connections than that (a benchmark's 256 at once),
# the kernel drops the rest, and their clients retry only a second later.
LISTEN_BACKLOG = 2048
# After a second signal the server stops at once; should a send that cannot be
# cancelled still hold it this long later, the process exits (EXIT_FORCED).
FORCED_STOP_SECONDS = 2.0
EXIT_FORCED = 3


# -- stop signals ---------------------------------------------------------------------


@contextmanager
def receiving_stop_signals(*, takes_sigint: bool) -> Iterator[AsyncIterator[int]]:
    """SIGTERM, and SIGINT where ``takes_sigint`` (the process a terminal's Ctrl-C
    is for); a child of the supervisor ignores SIGINT (the supervisor passes it on)."""
    if takes_sigint:
        stop_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_signals = (signal.SIGTERM,)
    with trio.open_signal_receiver(*stop_signals) as signals:
        yield signals


async def stop_on_signals(signals: AsyncIterator[int], who: str, *,
                          stop: Callable[[], None], stop_now: Callable[[], None]) -> None:
    """The one handler of stop signals: the first calls ``stop`` (graceful), any
    later one ``stop_now``."""
    is_stopping = False
    async for signal_number in signals:
        name = signal.Signals(signal_number).name
        if is_stopping:
            logger.warning("%s again: %s stops now", name, who)
            stop_now()
        else:
            logger.info("%s: %s stops gracefully (again to stop at once)", name, who)
            is_stopping = True
            stop()


def exit_unless_stopped_within(seconds: float) -> None:
    """The last resort of a second signal: Hypercorn sends with the connection's
    task shielded from cancellation, so a client that stops reading keeps a
    cancelled server from ever ending (benchmarks/slow_reader_shutdown.py). A
    daemon timer ends the process, non-zero, if it is still running then."""
    def exit_now() -> None:
        logger.error("still not stopped %.0f s after the second signal (a client that "
                     "does not read holds a send): exiting without cleanup", seconds)
        logging.shutdown()
        os._exit(EXIT_FORCED)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


# -- the listening socket and start-up faults ---------------------------------------------


def listening_socket(host: str, port: int) -> socket.socket:
    """The one socket every API server of this server accepts on, bound before the
    engine starts, so that a busy port fails at once. No SO_REUSEPORT: no other
    process may take a share of this port's connections. Port 0 picks a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a port held only by connections of a server that has gone (TIME_WAIT) is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def fault_line(error: BaseException) -> str:
    """A fault as one line: the first error inside exception groups (trio's
    nurseries wrap them), without the cancellations it caused."""
    while isinstance(error, BaseExceptionGroup):
        leaves = [leaf for leaf in error.exceptions if not isinstance(leaf, trio.Cancelled)]
        error = (leaves or list(error.exceptions))[0]
    return f"{type(error).__name__}: {error}"


# -- Hypercorn ------------------------------------------------------------------------


def hypercorn_config(config: ServerConfig, *, listen_fd: int | None = None) -> HypercornConfig:
    """Hypercorn's settings; ``listen_fd`` serves a socket already listening
    (an API server of the served layout) instead of binding host:port."""
    hyper = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hyper.bind = [f"fd://{listen_fd}" if listen_fd is not None else f"{host}:{config.port}"]
    # The drain happens before Hypercorn is told to stop (see serve_app); this
    # only lets responses being written at that moment go out.
    hyper.graceful_timeout = STRAGGLER_SECONDS
    hyper.keep_alive_timeout = KEEP_ALIVE_SECONDS
    hyper.backlog = LISTEN_BACKLOG
    # vLLM's --uvicorn-log-level: the web server's own logger; at debug (or
    # trace) its access log too, beside the request lines the app writes.
    level = logging.DEBUG if config.uvicorn_log_level == "trace" else (
        config.uvicorn_log_level.upper())
    for name in ("hypercorn.error", "hypercorn.access"):
        logging.getLogger(name).setLevel(level)
    hyper.accesslog = (logging.getLogger("hypercorn.access")
                       if config.uvicorn_log_level in ("debug", "trace") else None)
    hyper.errorlog = logging.getLogger("hypercorn.error")  # our handlers, not its own
    return hyper


async def serve_app(engine: Engine, config: ServerConfig, *,
                    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                    listen_fd: int | None = None,
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the app over ``engine`` until cancelled or until a graceful stop.

    Reports the bound URL (``http://host:port``) through ``task_status`` once
    the socket listens. When ``shutdown_trigger`` returns: the engine's one
    drain (``Engine.drain``: new requests get 503 + Retry-After, /health 503,
    the socket still answers; open requests may finish for up to the engine's
    ``shutdown_grace_seconds``, the rest end with an error), then Hypercorn
    stops, letting responses being written go out.
    """
    app = create_app(engine, config)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        guard = CompletedResponseGuard(app)
        guarded_app = RootPath(guard, config.root_path) if config.root_path else guard
        binds = await nursery.start(partial(
            _serve_then_cancel, strictly_framed(guarded_app),
            hypercorn_config(config, listen_fd=listen_fd),
            stop, nursery.cancel_scope))
        url = binds[0]
        if not config.disable_log_stats:
            nursery.start_soon(log_stats_every, config.log_stats_interval,
                               engine.fetch_statistics)
        logger.info("trio-llm serving %r at %s", app.extensions["trio_llm"].model_name, url)
        if shutdown_trigger is not None:
            nursery.start_soon(_drain_then_stop, engine, shutdown_trigger, stop)
        task_status.started(url)


class RootPath:
    """``--root-path`` as uvicorn (and so vLLM) has it: the server sits behind a
    proxy that strips the prefix, so ``/v1/models`` is served, and the app sees
    it under the prefix (ASGI's root_path). A request that still carries the
    prefix (no proxy in front) is served too."""

    def __init__(self, app: CompletedResponseGuard, root_path: str) -> None:
        self.app = app
        self.root_path = "/" + root_path.strip("/")

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable,
                       send: ASGISendCallable) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if not (path == self.root_path or path.startswith(self.root_path + "/")):
                path = self.root_path + path
            scope = {**scope, "root_path": self.root_path, "path": path}
        await self.app(scope, receive, send)


async def _serve_then_cancel(app: StrictFraming, config: HypercornConfig,
                             stop: trio.Event, scope: trio.CancelScope, *,
                             task_status: trio.TaskStatus[list[str]]) -> None:
    """Hypercorn until it stops, then the tasks beside it (the stats line)."""
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
    scope.cancel()


async def _drain_then_stop(engine: Engine, shutdown_trigger: Callable[[], Awaitable[None]],
                           stop: trio.Event) -> None:
    await shutdown_trigger()
    logger.info("draining %d open requests for up to %.1f s", engine.num_open_requests,
                engine.config.shutdown_grace_seconds)
    await engine.drain()
    stop.set()


# -- one server process ---------------------------------------------------------------

EngineOpener = Callable[[], AbstractAsyncContextManager["Engine"]]


async def serve(engine_config: EngineConfig, config: ServerConfig, *,
                open_engine: EngineOpener | None = None, listen_fd: int | None = None,
                takes_sigint: bool = True,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Open the engine and serve it until SIGINT/SIGTERM (graceful) or the engine dies.

    ``open_engine`` opens the facade (default: ``Engine.open(engine_config)``
    warming up before it is ready, the in-process layout; an API server passes
    its ``Engine.open_front``, and ``takes_sigint`` False). Raises EngineDead if
    the engine died.
    """
    from trio_llm.api.engine import Engine
    from trio_llm.api.warm_up import WarmUpPlan

    if open_engine is None:
        open_engine = partial(Engine.open, engine_config, warm_up=WarmUpPlan())
    with receiving_stop_signals(takes_sigint=takes_sigint) as signals:
        async with open_engine() as engine:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(
                    stop_on_signals, signals, "the server", stop=stop.set,
                    stop_now=partial(_stop_now, nursery.cancel_scope)))
                nursery.start_soon(_stop_when_dead, engine, stop)
                url = await nursery.start(_serve_then_stop_watchers, engine, config, stop,
                                          nursery.cancel_scope, listen_fd)
                task_status.started(url)


def _stop_now(scope: trio.CancelScope) -> None:
    scope.cancel()
    exit_unless_stopped_within(FORCED_STOP_SECONDS)


async def _serve_then_stop_watchers(engine: Engine, config: ServerConfig, stop: trio.Event,
                                    watchers: trio.CancelScope, listen_fd: int | None, *,
                                    task_status: trio.TaskStatus[str]) -> None:
    await serve_app(engine, config, shutdown_trigger=stop.wait, listen_fd=listen_fd,
                    task_status=task_status)
    watchers.cancel()


async def _stop_when_dead(engine: Engine, stop: trio.Event) -> None:
    await engine.wait_dead()
    logger.error("the engine died: stopping the server")
    stop.set()
