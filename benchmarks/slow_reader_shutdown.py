"""Shows that a client which stops reading keeps `trio-llm serve` from exiting.

    python benchmarks/slow_reader_shutdown.py

Starts `trio-llm serve --model tiny --shutdown-grace-seconds 3`, opens three
streams of 400 tokens with 20 logprobs each into 4 KiB receive buffers and
never reads them, then sends SIGTERM, then SIGINT, then closes the clients,
printing the server's return code after each. Hypercorn 0.18 sends with the
task shielded from cancellation and closes a connection only after its app
task has ended, so a send into a full socket buffer blocks the graceful stop;
a second signal ends the process with code 3 two seconds later
(docs/reliability.md, "Not solved").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_reliability import (  # noqa: E402
    SERVE_COMMAND,
    drain,
    greedy_request,
    open_connection,
    receive_until,
    request_bytes,
)

GRACE_SECONDS = "3"


async def wait_briefly(process: trio.Process, seconds: float) -> int | None:
    with trio.move_on_after(seconds):
        await process.wait()
    return process.returncode


async def main() -> None:
    command = [GRACE_SECONDS if part == "60" else part for part in SERVE_COMMAND]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, env=env)
    assert process.stderr is not None
    log = b""
    while not (match := re.search(rb"serving 'tiny' at (http://\S+)", log)):
        log += await process.stderr.receive_some(4096)
    url = match.group(1).decode()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain, process.stderr)
        streams = []
        for index in range(3):
            stream = await open_connection(url, receive_buffer=4096)
            head, body = request_bytes(greedy_request(index, 400, stream=True, logprobs=20))
            await stream.send_all(head + body)
            await receive_until(stream, b"data: ")
            streams.append(stream)
        await trio.sleep(10)  # the server's sends fill the buffers
        process.send_signal(signal.SIGTERM)
        print("15 s after SIGTERM: return code", await wait_briefly(process, 15))
        process.send_signal(signal.SIGINT)
        print("10 s after a second signal: return code", await wait_briefly(process, 10))
        for stream in streams:
            await stream.aclose()
        print("10 s after the clients closed: return code", await wait_briefly(process, 10))
        if process.returncode is None:
            process.kill()
            await process.wait()
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
