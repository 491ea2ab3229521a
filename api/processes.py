"""The served layout's processes: one engine core, N API servers, one supervisor.

    trio-llm serve --model qwen3-0.6b --api-server-count 2

The supervisor (the process `trio-llm serve` runs in) opens everything the
children share before it starts them: one listening socket (bound by
`trio-llm serve` before anything starts, without SO_REUSEPORT, so a busy port
fails at once and no other process can share it), which every API server
accepts on, and one local socket pair per API server for its wire channel to
the engine core. It passes each child its ends (file descriptors), closes its
own copies, and watches:

- the engine core exits (it died): every API server notices its socket end,
  fails its open requests and exits non-zero; the supervisor waits for them
  (killing any that hang) and exits 1;
- an API server exits: the core aborts its requests and frees their blocks;
  the others go on accepting on the shared socket. With none left, the core
  is stopped and the supervisor exits 1;
- SIGTERM or SIGINT: each API server is sent SIGTERM (it drains, then exits
  0); then the core is stopped; exit 0 if every child exited 0. A second
  signal is passed on too (the API servers then stop at once).

Children run in their own session (a terminal's Ctrl-C reaches only the
supervisor, which passes it on once). None is orphaned: each API server holds
the read end of a pipe whose write end only the supervisor holds; when the
supervisor dies, however it dies, the pipe ends and the API server stops as on
SIGTERM; the core stops once every API server has gone. (PR_SET_PDEATHSIG would
not do: it fires when the *thread* that started the child exits, and trio
starts processes from worker threads.)

``open_served_layout`` runs the same layout inside one process (core and
fronts as tasks, the same wire channels over real socket pairs): the tests
drive it, and it is the layout without process start-up.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

import msgspec
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import EngineDead
from trio_llm.actors.fronts import FrontToCore
from trio_llm.actors.runner import LoadedExecutor
from trio_llm.actors.supervisor import run_core_supervisor
from trio_llm.actors.wire import open_wire_channel
from trio_llm.api.engine import Engine, created_executor
from trio_llm.api.metrics import MULTIPROCESS_DIR_VARIABLE
from trio_llm.api.server import ServerConfig
from trio_llm.api.serving import fault_line, receiving_stop_signals, serve, stop_on_signals
from trio_llm.api.warm_up import WarmUpPlan

logger = logging.getLogger(__name__)

# After the core died, API servers fail their requests and exit at once; one
# that has not exited after this long is killed.
CHILD_EXIT_SECONDS = 30.0
# How long the core may take to stop once every API server has gone, and
# again after SIGTERM (then it is killed).
CORE_STOP_SECONDS = 10.0


# -- the layout in one process ------------------------------------------------------------


async def run_engine_core(config: EngineConfig, front_streams: list[trio.SocketStream], *,
                          executor: LoadedExecutor | None = None,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Load the model (unless ``executor`` is given) and run the engine core for
    the fronts at the other end of ``front_streams``; returns once all have gone.
    Raises EngineDead if an actor of the core failed."""
    async with created_executor(config, executor) as executor:
        # As Engine.open does: what was allocated so far lives as long as the core,
        # and is collectable again once it stops (the core may be a task of a longer
        # process: open_served_layout).
        gc.collect()
        gc.freeze()
        try:
            fronts = [open_wire_channel(stream, FrontToCore) for stream in front_streams]
            async with AsyncExitStack() as streams:
                for stream in front_streams:
                    await streams.enter_async_context(stream)
                await run_core_supervisor(
                    config, executor, fronts, model_path=str(executor.model_path),
                    max_model_len=executor.max_model_len, num_kv_blocks=executor.num_kv_blocks,
                    vocab_size=executor.vocab_size, task_status=task_status)
        finally:
            gc.unfreeze()


@asynccontextmanager
async def open_served_layout(config: EngineConfig, num_fronts: int, *,
                             executor: LoadedExecutor | None = None) -> AsyncIterator[list[Engine]]:
    """The served layout in this process: an engine core task and ``num_fronts``
    front facades, joined by wire channels over socket pairs. Yields the fronts;
    on exit each drains and disconnects, and the core stops."""
    pairs = [trio.socket.socketpair() for _ in range(num_fronts)]
    core_error: list[EngineDead] = []

    async def run_core(task_status: trio.TaskStatus[None]) -> None:
        # As a process would: a core that dies does not take the fronts with it;
        # they learn it over the wire. Its error is raised once they are closed.
        try:
            await run_engine_core(config, [trio.SocketStream(core_end) for core_end, _ in pairs],
                                  executor=executor, task_status=task_status)
        except EngineDead as error:
            core_error.append(error)

    async with trio.open_nursery() as nursery:
        await nursery.start(run_core)
        async with AsyncExitStack() as stack:
            fronts = [await stack.enter_async_context(
                Engine.open_front(config, trio.SocketStream(front_end))) for _, front_end in pairs]
            yield fronts
    if core_error:
        raise core_error[0]


# -- the supervisor -----------------------------------------------------------------------


class _Child:
    """A child process and what the supervisor knows of it."""

    def __init__(self, name: str, process: trio.Process) -> None:
        self.name = name
        self.process = process
        self.exited = trio.Event()

    @property
    def is_running(self) -> bool:
        return self.process.returncode is None

    def signal(self, signal_number: int) -> None:
        if self.is_running:
            self.process.send_signal(signal_number)

    async def wait(self) -> None:
        await self.process.wait()
        self.exited.set()


def run_served(engine_config: EngineConfig, server_config: ServerConfig,
               listener: socket.socket, *, num_api_servers: int) -> int:
    """`trio-llm serve --api-server-count N` on ``listener`` (the socket every API
    server accepts on): 0 after a graceful stop, 1 otherwise."""
    return trio.run(_supervise, engine_config, server_config, listener, num_api_servers)


async def _supervise(engine_config: EngineConfig, server_config: ServerConfig,
                     listener: socket.socket, num_api_servers: int) -> int:
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
             for _ in range(num_api_servers)]
    lifeline_read, lifeline_write = os.pipe()  # see the module docstring
    metrics_dir = tempfile.mkdtemp(prefix="trio-llm-metrics-")
    port = listener.getsockname()[1]
    logger.info("engine core and %d API servers for port %d", num_api_servers, port)
    stopping = False
    try:
        with receiving_stop_signals(takes_sigint=True) as signals:
            core = await _start_core(engine_config, [core_end for core_end, _ in pairs])
            api_servers = [await _start_api_server(index, engine_config, server_config,
                                                   front_end, listener, metrics_dir,
                                                   lifeline_read)
                           for index, (_, front_end) in enumerate(pairs)]
            for sock in [listener, *(end for pair in pairs for end in pair)]:
                sock.close()  # the children hold them now; a dead child's must really close
            os.close(lifeline_read)
            async with trio.open_nursery() as nursery:
                for child in (core, *api_servers):
                    nursery.start_soon(child.wait)

                def stop_api_servers() -> None:
                    nonlocal stopping
                    stopping = True
                    for api_server in api_servers:
                        api_server.signal(signal.SIGTERM)

                # Each signal is passed on: a second one stops the API servers at once.
                nursery.start_soon(partial(stop_on_signals, signals, "every process",
                                           stop=stop_api_servers, stop_now=stop_api_servers))
                await _watch(core, api_servers)
                nursery.cancel_scope.cancel()
    finally:
        os.close(lifeline_write)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    codes = [child.process.returncode for child in (core, *api_servers)]
    logger.info("exit codes: engine core %s, API servers %s", codes[0], codes[1:])
    return 0 if stopping and all(code == 0 for code in codes) else 1


async def _watch(core: _Child, api_servers: list[_Child]) -> None:
    """Return once every child has exited, stopping the rest as the module
    docstring says."""
    async with trio.open_nursery() as nursery:
        async def when_core_exits() -> None:
            await core.exited.wait()
            if core.process.returncode != 0:
                logger.error("the engine core exited with %s: the API servers stop",
                             core.process.returncode)
            with trio.move_on_after(CHILD_EXIT_SECONDS):
                for api_server in api_servers:
                    await api_server.exited.wait()
            for api_server in api_servers:
                api_server.signal(signal.SIGKILL)

        async def when_api_servers_exit() -> None:
            for api_server in api_servers:
                nursery.start_soon(_report_exit, api_server)
            for api_server in api_servers:
                await api_server.exited.wait()
            # The core stops by itself once every API server has gone; a
            # signal is only for one that does not.
            for stop_signal in (signal.SIGTERM, signal.SIGKILL):
                with trio.move_on_after(CORE_STOP_SECONDS):
                    await core.exited.wait()
                core.signal(stop_signal)

        nursery.start_soon(when_core_exits)
        nursery.start_soon(when_api_servers_exit)
    await core.exited.wait()
    for api_server in api_servers:
        await api_server.exited.wait()


async def _report_exit(child: _Child) -> None:
    await child.exited.wait()
    code = child.process.returncode
    if code != 0:
        logger.error("%s exited with %s", child.name, code)


async def _start_core(engine_config: EngineConfig, core_ends: list[socket.socket]) -> _Child:
    fds = [sock.fileno() for sock in core_ends]
    command = [*_child_command("core", engine_config), "--fds", ",".join(map(str, fds))]
    process = await trio.lowlevel.open_process(command, pass_fds=fds, start_new_session=True)
    logger.info("engine core: pid %d", process.pid)
    return _Child("the engine core", process)


async def _start_api_server(index: int, engine_config: EngineConfig,
                            server_config: ServerConfig, front_end: socket.socket,
                            listener: socket.socket, metrics_dir: str,
                            lifeline_fd: int) -> _Child:
    fds = [front_end.fileno(), listener.fileno(), lifeline_fd]
    if index > 0:
        # One stats line for the engine, not one per API server: API server 0's.
        server_config = msgspec.structs.replace(server_config, disable_log_stats=True)
    command = [*_child_command("api-server", engine_config), "--index", str(index),
               "--server-config", msgspec.json.encode(server_config).decode(),
               "--core-fd", str(fds[0]), "--listen-fd", str(fds[1]),
               "--lifeline-fd", str(lifeline_fd)]
    env = {**os.environ, MULTIPROCESS_DIR_VARIABLE: metrics_dir}
    process = await trio.lowlevel.open_process(command, pass_fds=fds, env=env,
                                               start_new_session=True)
    logger.info("API server %d: pid %d", index, process.pid)
    return _Child(f"API server {index}", process)


def _child_command(role: str, engine_config: EngineConfig) -> list[str]:
    return [sys.executable, "-m", "trio_llm.api.processes", role,
            "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            "--engine-config", msgspec.json.encode(engine_config).decode()]


# -- the children -------------------------------------------------------------------------


def _stream_of(fd: int) -> trio.SocketStream:
    return trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))


async def _run_core(engine_config: EngineConfig, fds: list[int]) -> int:
    # The supervisor stops the core (SIGTERM) only once the API servers are gone:
    # nothing is left to drain, so it stops at once.
    with receiving_stop_signals(takes_sigint=False) as signals:
        async with trio.open_nursery() as nursery:
            cancel = nursery.cancel_scope.cancel
            nursery.start_soon(partial(stop_on_signals, signals, "the engine core",
                                       stop=cancel, stop_now=cancel))
            try:
                await run_engine_core(engine_config, [_stream_of(fd) for fd in fds])
            except EngineDead as error:
                logger.error("the engine core died: %s", error)
                return 1
            nursery.cancel_scope.cancel()
    return 0


async def _run_api_server(engine_config: EngineConfig, server_config: ServerConfig, index: int,
                          core_fd: int, listen_fd: int, lifeline_fd: int) -> int:
    # API server 0 warms the engine core up; each of the others its own process.
    open_engine = partial(Engine.open_front, engine_config, _stream_of(core_fd),
                          warm_up=WarmUpPlan(front_only=index > 0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_when_orphaned, lifeline_fd)
        try:
            await serve(engine_config, server_config, open_engine=open_engine,
                        listen_fd=listen_fd, takes_sigint=False)
        except EngineDead as error:
            logger.error("the engine died: %s", error)
            return 1
        finally:
            nursery.cancel_scope.cancel()
    return 0


async def _stop_when_orphaned(lifeline_fd: int) -> None:
    """Stop as on SIGTERM once the supervisor is gone (its end of the pipe closed)."""
    await trio.lowlevel.wait_readable(lifeline_fd)
    logger.error("the supervisor is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """A child's entry point: `python -m trio_llm.api.processes core|api-server ...`."""
    parser = argparse.ArgumentParser(prog="trio_llm.api.processes")
    parser.add_argument("role", choices=["core", "api-server"])
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--engine-config", required=True)
    parser.add_argument("--fds", default="")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--server-config", default="{}")
    parser.add_argument("--core-fd", type=int, default=-1)
    parser.add_argument("--listen-fd", type=int, default=-1)
    parser.add_argument("--lifeline-fd", type=int, default=-1)
    args = parser.parse_args(argv)
    name = "core" if args.role == "core" else f"api-server-{args.index}"
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s [{name}] %(name)s %(message)s")
    engine_config = msgspec.json.decode(args.engine_config, type=EngineConfig)
    try:
        if args.role == "core":
            fds = [int(fd) for fd in args.fds.split(",") if fd]
            return trio.run(_run_core, engine_config, fds)
        server_config = msgspec.json.decode(args.server_config, type=ServerConfig)
        return trio.run(_run_api_server, engine_config, server_config, args.index,
                        args.core_fd, args.listen_fd, args.lifeline_fd)
    except Exception as error:
        # One line, as `trio-llm` itself writes a failure (api/cli.py main): a model
        # the core cannot load is a user's problem, not a traceback.
        if args.log_level.upper() == "DEBUG":
            raise
        logger.error("%s failed: %s (--log-level debug shows where)",
                     "the engine core" if args.role == "core" else f"API server {args.index}",
                     fault_line(error))
        return 1


if __name__ == "__main__":
    sys.exit(main())

