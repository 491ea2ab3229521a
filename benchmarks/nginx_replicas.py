"""Two trio-llm servers behind nginx, on loopback: the checks docs/operations.md reports.

Starts two CPU servers on the tiny model and nginx in front of them (a temporary
prefix, no root needed; the configuration is docs/operations.md's), then checks:

1. requests through nginx reach both servers (each one's request counter grows);
2. a stream through nginx arrives incrementally: the first event comes long before
   the last (proxy_buffering off);
3. a client that disconnects from nginx mid-stream ends the request on its server:
   that server's /metrics show it running with KV blocks in use, then (well before
   it could have generated its max_tokens) none running and no KV blocks in use;
4. with one server stopped (SIGTERM: it drains, then exits), every request through
   nginx still succeeds on the other.

Prints one JSON object with the figures and exits non-zero if a check fails.

    python benchmarks/nginx_replicas.py --nginx /path/to/sbin/nginx

(nginx from Debian's package without installing it: `apt-get download nginx
nginx-common && dpkg -x nginx_*.deb root && dpkg -x nginx-common_*.deb root`, then
`--nginx root/usr/sbin/nginx`.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

NGINX_CONF = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
{body}
}}
"""

# What docs/operations.md gives as the configuration (there with fixed ports).
HTTP_BODY = """\
    upstream trio_llm {{
        least_conn;                     # long streams: count open requests, not turns
        server 127.0.0.1:{port_a} max_fails=1 fail_timeout=5s;
        server 127.0.0.1:{port_b} max_fails=1 fail_timeout=5s;
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 16m;       # at least the servers' --max-body-bytes
        location / {{
            proxy_pass http://trio_llm;
            proxy_http_version 1.1;     # keep-alive to the servers
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering off;        # stream each SSE event as it comes
            proxy_cache off;
            proxy_read_timeout 3600s;   # a long generation is not a dead server
            proxy_send_timeout 3600s;
            # a refused connection or a 503 (a draining or dead server answers it
            # before doing anything) goes to the other server, POST included
            proxy_next_upstream error timeout http_503 non_idempotent;
        }}
    }}"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} never became healthy")


def metrics(url: str) -> dict[str, float]:
    """The server's /metrics samples, by name with labels."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric(url: str, prefix: str, label: str = "") -> float:
    """The sum of the samples whose name starts with ``prefix`` and whose labels hold
    ``label`` (e.g. 'finished_reason="abort"')."""
    return sum(value for name, value in metrics(url).items()
               if name.startswith(prefix) and label in name)


def wait_metric(url: str, prefix: str, predicate, seconds: float = 30.0) -> float:
    deadline = time.monotonic() + seconds
    while True:
        value = metric(url, prefix)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@contextlib.contextmanager
def server(port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "trio_llm.api.cli", "serve", "--model", "tiny",
               "--port", str(port), "--num-kv-blocks", "512"]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


@contextlib.contextmanager
def nginx(binary: str, prefix: Path, body: str) -> Iterator[None]:
    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / name).mkdir(exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=prefix, body=body))
    process = subprocess.Popen([binary, "-p", str(prefix), "-c", str(conf),
                                "-g", "daemon off; master_process off;"])
    try:
        yield
    finally:
        process.terminate()
        process.wait(timeout=10)


def completion(url: str, max_tokens: int, *, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}


def check_spread(proxy: str, backends: list[str], num_requests: int) -> dict:
    before = [metric(url, "trio_llm:request_success_total") for url in backends]
    for _ in range(num_requests):
        response = httpx.post(f"{proxy}/v1/completions", json=completion(proxy, 4), timeout=60)
        response.raise_for_status()
    after = [metric(url, "trio_llm:request_success_total") for url in backends]
    served = [int(b - a) for a, b in zip(before, after, strict=True)]
    return {"requests": num_requests, "served_by_each": served,
            "ok": sum(served) == num_requests and all(served)}


def check_streaming(proxy: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    event_times = []
    with httpx.stream("POST", f"{proxy}/v1/completions",
                      json=completion(proxy, max_tokens, stream=True), timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event_times.append(time.perf_counter() - started)
    first, last = event_times[0], event_times[-1]
    return {"events": len(event_times), "first_event_seconds": round(first, 3),
            "last_event_seconds": round(last, 3),
            "ok": len(event_times) >= max_tokens and first < last / 4}


def check_disconnect(proxy: str, backends: list[str], max_tokens: int) -> dict:
    tokens_before = [metric(url, "trio_llm:generation_tokens_total") for url in backends]
    with httpx.stream("POST", f"{proxy}/v1/completions",
                      json=completion(proxy, max_tokens, stream=True), timeout=120) as response:
        # held in a name: a generator closed on ``break`` would close the connection now
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        running = [metric(url, "trio_llm:num_requests_running") for url in backends]
        usage = [metric(url, "trio_llm:kv_cache_usage_perc") for url in backends]
    # leaving the block closed the client's connection to nginx mid-stream
    closed = time.perf_counter()
    owner = running.index(max(running))
    url = backends[owner]
    running_after = wait_metric(url, "trio_llm:num_requests_running", lambda v: v == 0)
    usage_after = wait_metric(url, "trio_llm:kv_cache_usage_perc", lambda v: v == 0)
    seconds_to_free = time.perf_counter() - closed
    num_tokens = int(metric(url, "trio_llm:generation_tokens_total") - tokens_before[owner])
    return {"running_while_streaming": running, "kv_usage_while_streaming": usage,
            "running_after": running_after, "kv_usage_after": usage_after,
            "seconds_to_free": round(seconds_to_free, 3),
            "tokens_generated_of_max_tokens": [num_tokens, max_tokens],
            "ok": running[owner] == 1 and usage[owner] > 0 and running_after == 0
            and usage_after == 0 and num_tokens < max_tokens}


def check_one_down(proxy: str, stopped: subprocess.Popen[bytes], num_requests: int) -> dict:
    stopped.send_signal(signal.SIGTERM)
    statuses = []
    for _ in range(num_requests):
        response = httpx.post(f"{proxy}/v1/completions", json=completion(proxy, 4), timeout=60)
        statuses.append(response.status_code)
    stopped.wait(timeout=30)
    return {"requests": num_requests, "statuses": sorted(set(statuses)),
            "ok": statuses == [200] * num_requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nginx", default="nginx", help="the nginx binary")
    args = parser.parse_args()
    ports = [free_port() for _ in range(3)]
    backends = [f"http://127.0.0.1:{port}" for port in ports[:2]]
    proxy = f"http://127.0.0.1:{ports[2]}"
    body = HTTP_BODY.format(port_a=ports[0], port_b=ports[1], port=ports[2])
    with tempfile.TemporaryDirectory(prefix="trio-llm-nginx-") as directory:
        prefix = Path(directory)
        with server(ports[0], prefix / "a.log") as first, server(ports[1], prefix / "b.log"), \
                nginx(args.nginx, prefix, body):
            for url in backends:
                wait_healthy(url)
            wait_healthy(proxy)
            results = {"spread": check_spread(proxy, backends, 8),
                       "streaming": check_streaming(proxy, 200),
                       "disconnect": check_disconnect(proxy, backends, 3000),
                       "one_server_stopped": check_one_down(proxy, first, 8)}
        results["nginx"] = subprocess.run([args.nginx, "-v"], capture_output=True,
                                          text=True).stderr.strip()
    results["ok"] = all(result["ok"] for result in results.values() if isinstance(result, dict))
    json.dump(results, sys.stdout, indent=2)
    print()
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
