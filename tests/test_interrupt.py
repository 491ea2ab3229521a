"""Ctrl-C ends any `trio-llm` command with one line, not tracebacks: a real process
gets SIGINT while it works."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
import trio

from trio_llm.api.cli import EXIT_INTERRUPTED, is_interrupt

TIMEOUT = 120


@pytest.fixture(autouse=True)
def _sigint_not_ignored():
    """A test runner started with SIGINT ignored (a background job of a shell without job
    control) passes the ignoring on to every child through exec, and Python then installs
    no Ctrl-C handler in the command under test. A Python handler here is reset to the
    default in the child instead."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


async def _read_all(stream: trio.abc.ReceiveStream, into: bytearray, marker: bytes,
                    seen: trio.Event) -> None:
    async for chunk in stream:
        into += chunk
        if marker in into:
            seen.set()


async def _interrupted_while_working(command: list[str], *, stdout_marker: bytes = b"",
                                     stderr_marker: bytes = b"") -> tuple[int, str]:
    """Start ``command``, SIGINT it once a marker shows on stdout or stderr (it is
    working then), and return its exit code and stderr."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # a session of its own: what it starts (bench serve's client processes, which ignore
    # Ctrl-C) is ended with it below should the interrupt not stop it
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, env=env,
                                               start_new_session=True)
    assert process.stdout is not None and process.stderr is not None
    stdout, stderr, working = bytearray(), bytearray(), trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_all, process.stdout, stdout, stdout_marker or b"\0",
                               working)
            nursery.start_soon(_read_all, process.stderr, stderr, stderr_marker or b"\0",
                               working)
            await working.wait()
            process.send_signal(signal.SIGINT)
            await process.wait()
    finally:
        # the command and all it started, if any is left (none, the usual case)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stderr.decode()


def _assert_one_line(returncode: int, stderr: str) -> None:
    assert returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr
    # the last line (a progress bar may share it, not ended by a newline)
    assert stderr.strip().split("\n")[-1].endswith("trio-llm: interrupted")
    assert stderr.count("trio-llm: interrupted") == 1


async def test_ctrl_c_ends_generate_with_one_line() -> None:
    command = [sys.executable, "-m", "trio_llm.api.cli", "--log-level", "WARNING", "generate",
               "Once upon a time", "--model", "tiny", "--max-tokens", "1500",
               "--ignore-eos", "--max-model-len", "2048", "--num-kv-blocks", "256"]
    with trio.fail_after(TIMEOUT):
        returncode, stderr = await _interrupted_while_working(command, stdout_marker=b" ")
    _assert_one_line(returncode, stderr)


async def test_ctrl_c_ends_bench_throughput_with_one_line() -> None:
    command = [sys.executable, "-m", "trio_llm.api.cli", "bench", "throughput",
               "--model", "tiny", "--num-prompts", "2000", "--max-output-len", "200"]
    with trio.fail_after(TIMEOUT):
        # its progress bar counts tokens: the engine is generating
        returncode, stderr = await _interrupted_while_working(command, stderr_marker=b"tok/s")
    _assert_one_line(returncode, stderr)


def test_interrupts_are_told_from_other_errors_in_groups() -> None:
    assert is_interrupt(KeyboardInterrupt())
    assert is_interrupt(BaseExceptionGroup("x", [KeyboardInterrupt(),
                                                 BaseExceptionGroup("y", [KeyboardInterrupt()])]))
    assert not is_interrupt(BaseExceptionGroup("x", [KeyboardInterrupt(), ValueError()]))
    assert not is_interrupt(ValueError())
    with pytest.raises(ValueError):
        raise ValueError


@pytest.mark.parametrize("num_client_processes", [1, 2])
async def test_ctrl_c_ends_bench_serve_with_one_line(num_client_processes: int) -> None:
    from test_http_support import FakeEngine, running_server

    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(max_model_len=4096)) as url:
            command = [sys.executable, "-m", "trio_llm.api.cli", "bench", "serve",
                       "--base-url", url, "--num-prompts", "100000", "--random-input-len", "4",
                       "--random-output-len", "2000", "--max-concurrency", "8",
                       "--num-client-processes", str(num_client_processes)]
            # its progress bar is up (one process), or the clients are (several)
            marker = b"it/s" if num_client_processes == 1 else b"client processes started"
            returncode, stderr = await _interrupted_while_working(command,
                                                                  stderr_marker=marker)
    _assert_one_line(returncode, stderr)


class Interrupted(BaseException):
    """Stands in for KeyboardInterrupt (which would stop pytest itself)."""


async def test_an_interrupt_as_the_client_processes_start_stops_every_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupt of the two-client case above may land anywhere, even while the
    line it waits for is being logged: the client processes ignore Ctrl-C, so any
    left running would outlive the command (and the command hang at exit, joining them)."""
    import multiprocessing

    from test_http_support import FakeEngine, running_server

    import trio_llm.api.bench_serve as bench_serve

    real_info = bench_serve.logger.info

    def info(message: str, *args: object) -> None:
        real_info(message, *args)
        if "client processes started" in message:
            raise Interrupted

    monkeypatch.setattr(bench_serve.logger, "info", info)
    try:
        with trio.fail_after(TIMEOUT):
            async with running_server(FakeEngine(max_model_len=4096)) as url:
                options = bench_serve.BenchServeOptions(
                    base_url=url, num_prompts=100000, random_input_len=4,
                    random_output_len=2000, max_concurrency=8, num_client_processes=2,
                    show_progress=False)
                with pytest.raises(Interrupted):
                    await trio.to_thread.run_sync(bench_serve.run_benchmark_in_processes,
                                                  options)
        still_running = multiprocessing.active_children()
    finally:
        for child in multiprocessing.active_children():
            child.kill()
            child.join()
    assert still_running == []
