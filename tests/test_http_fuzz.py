"""Bad input never yields a 500: random bodies, random field values, through
one server on a loopback port (in a thread, shared by every example) over the
scripted engine. (Quart's test client
would not do: it buffers at most 10 body chunks before the test reads any, so
a longer stream deadlocks it.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_http_support import FakeEngine, ServerInAThread


def mostly(valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any]) -> Any:
    """Valid three times in four: a request must get deep into the server to find bugs."""
    return st.one_of(valid, valid, valid, invalid)


counts = mostly(st.integers(1, 6), st.integers(-2, 0))
probabilities = mostly(st.floats(0.05, 1.0), st.floats(-0.5, 2.5))
token_ids = mostly(st.lists(st.integers(0, 255), min_size=1, max_size=4),
                   st.lists(st.integers(-1, 300), max_size=4))
content_parts = st.lists(st.fixed_dictionaries(
    {"type": mostly(st.just("text"), st.just("image_url")), "text": st.text(max_size=4)}),
    max_size=2)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]),
     "content": mostly(st.text(max_size=6) | content_parts, st.none())}), max_size=3)
# Values of the right shape, for each field; wild ones now and then.
TYPED_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": mostly(st.just("fake-model"), st.sampled_from(["other", ""])),
    "prompt": mostly(st.text(max_size=8) | token_ids, st.lists(st.text(max_size=3), max_size=2)),
    "messages": messages,
    "max_tokens": counts, "max_completion_tokens": counts,
    "min_tokens": mostly(st.integers(0, 2), st.integers(-1, 9)),
    "temperature": mostly(st.floats(0.0, 2.0), st.floats(-1.0, 0.0)),
    "top_p": probabilities, "min_p": probabilities,
    "top_k": mostly(st.integers(-1, 5), st.integers(-3, -2)),
    "seed": mostly(st.integers(0, 2**32), st.integers(-(2**65), 2**65)),
    "n": mostly(st.just(1), counts), "best_of": mostly(st.just(1), counts),
    "logprobs": st.booleans() | st.integers(-1, 22),
    "top_logprobs": mostly(st.integers(0, 20), st.integers(-1, 22)),
    "priority": st.integers(-3, 3),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(max_size=3), max_size=2),
    "stop_token_ids": token_ids, "tokens": token_ids, "user": st.text(max_size=3),
    "ignore_eos": st.booleans(), "stream": st.booleans(),
    "echo": mostly(st.just(False), st.just(True)),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "tools": mostly(st.sampled_from([[], [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]]), st.just([{"type": "function"}])),
    "response_format": mostly(st.sampled_from([
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]),
        st.just({"type": "json_schema"})),
    "structured_outputs": mostly(st.sampled_from([
        {"choice": ["a", "b"]}, {"regex": "a+"}, {"json": {"type": "object"}},
        {"grammar": 'root ::= "a"'}, {"json_object": True}]),
        st.dictionaries(st.sampled_from(["json", "regex", "choice", "x"]), st.text(max_size=3),
                        max_size=2)),
    "tool_choice": mostly(st.sampled_from(["none", "auto", "required", {
        "type": "function", "function": {"name": "f"}}]), st.text(max_size=3)),
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": mostly(st.just({"enable_thinking": False}),
                                   st.just({"messages": []})),
    "presence_penalty": mostly(st.just(0.0), probabilities),
    "frequency_penalty": mostly(st.floats(-2.0, 2.0), st.floats(-9.0, 9.0)),
    "repetition_penalty": mostly(st.floats(0.1, 2.0), st.floats(-1.0, 0.1)),
    "allowed_token_ids": mostly(st.lists(st.integers(0, 200), min_size=1, max_size=3),
                                st.lists(st.integers(-3, 10**6), max_size=3)),
    "logit_bias": mostly(st.just({}), st.dictionaries(st.text(max_size=2), probabilities,
                                                       max_size=1)),
    "return_token_strs": st.booleans(), "add_special_tokens": st.booleans(),
}
wild_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(TYPED_FIELDS)), max_size=6, unique=True))
    return {name: draw(TYPED_FIELDS[name] if draw(st.integers(0, 9)) else wild_values)
            for name in names}


# Each path with a valid minimal body, which the random fields then amend.
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hello"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [104, 105]},
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeEngine, httpx.Client]]:
    """One server for every example (in its own thread), and a client for it."""
    engine = FakeEngine()
    with ServerInAThread(engine) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield engine, client


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(sorted(BASES)), body=bodies())
def test_random_fields_get_200_or_a_400(served: tuple[FakeEngine, httpx.Client], path: str,
                                        body: dict[str, Any]) -> None:
    """(Or a 404 naming ``model``, for a model the server does not serve.)"""
    engine, client = served
    payload = json.dumps({**BASES[path], **body})
    response = client.post(path, content=payload, headers={"Content-Type": "application/json"})
    assert response.status_code in (200, 400, 404), (payload, response.text)
    if response.status_code == 404:
        assert response.json()["error"]["param"] == "model"
    if response.status_code in (400, 404):
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert not engine.running


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64) | st.text(max_size=32).map(str.encode))
def test_random_bytes_get_a_400(served: tuple[FakeEngine, httpx.Client], raw: bytes) -> None:
    _, client = served
    assert client.post("/v1/completions", content=raw).status_code == 400
