"""Schemathesis against /openapi.json, over the real tiny engine on a loopback
port: bounded examples and time, no 5xx, every error in the OpenAI shape, and
responses that match the schema."""

from __future__ import annotations

import queue
import threading
from typing import Any

import httpx
import pytest
import schemathesis
import trio
from hypothesis import HealthCheck, settings
from test_http_support import running_server

from trio_llm.actors.config import EngineConfig
from trio_llm.api.engine import Engine

THREAD_TIMEOUT = 300
# A small cache and context: generated requests are refused or finish fast.
CONFIG = EngineConfig(model="tiny", num_kv_blocks=64, block_size=16, max_num_seqs=8,
                      max_model_len=256, max_waiting_requests=64)
NUM_EXAMPLES = 30


class EngineServerInAThread:
    """The real engine and its server in their own thread and trio run: the
    schemathesis client is synchronous."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._started: queue.Queue[tuple[str, trio.lowlevel.TrioToken, trio.Event]] = (
            queue.Queue())
        self._thread = threading.Thread(target=trio.run, args=(self._serve,), daemon=True)

    async def _serve(self) -> None:
        stop = trio.Event()
        with trio.fail_after(THREAD_TIMEOUT):
            async with Engine.open(self._config) as engine, running_server(engine) as url:
                self._started.put((url, trio.lowlevel.current_trio_token(), stop))
                await stop.wait()
                stats = engine.statistics()
                assert (stats.num_running, stats.num_waiting) == (0, 0)

    def __enter__(self) -> str:
        self._thread.start()
        url, self._token, self._stop = self._started.get(timeout=THREAD_TIMEOUT)
        return url

    def __exit__(self, *exc_info: object) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(THREAD_TIMEOUT)
        assert not self._thread.is_alive()


@pytest.fixture(scope="module")
def server_url() -> Any:
    with EngineServerInAThread(CONFIG) as url:
        yield url


def _schema_document() -> dict[str, Any]:
    from trio_llm.api.openapi import openapi_document

    return openapi_document("tiny")


schema = schemathesis.openapi.from_dict(_schema_document())


@schemathesis.check
def errors_in_the_openai_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code < 400:
        return None
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == response.status_code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return None


@schema.parametrize()
@settings(max_examples=NUM_EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_the_api_matches_its_schema_and_never_answers_5xx(case: Any, server_url: str) -> None:
    # Streams are checked by the streaming tests; the schema describes JSON bodies.
    if isinstance(case.body, dict) and case.body.get("stream") is True:
        case.body["stream"] = False
    case.call_and_validate(
        base_url=server_url, timeout=30,
        checks=[schemathesis.checks.not_a_server_error, errors_in_the_openai_shape,
                schemathesis.checks.status_code_conformance,
                schemathesis.checks.response_schema_conformance])


def test_the_server_still_answers_exactly_afterwards(server_url: str) -> None:
    request = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{server_url}/v1/completions", json=request, timeout=30)
    second = httpx.post(f"{server_url}/v1/completions", json=request, timeout=30)
    assert first.status_code == 200
    assert first.json()["choices"] == second.json()["choices"]
