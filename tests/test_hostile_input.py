"""Hostile input: every field's cost is bounded, request-sized work leaves the
event loop, and a failure that belongs to one request ends that request alone."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from test_intake import make_intake, submit

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.detokenizer import Detokenizer, StopStrings
from trio_llm.actors.errors import RequestFailed, RequestRejected
from trio_llm.actors.intake import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    run_intake,
)
from trio_llm.actors.messages import Admit, SamplingParams
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.api.engine import Engine

CONFIG = EngineConfig(model="tiny", num_kv_blocks=128, block_size=16, max_num_seqs=16,
                      max_num_batched_tokens=256)
TIMEOUT = 120


def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


# -- stop strings: no prefix set, bounded --------------------------------------------------


def held_by_definition(stops: list[str], text: str) -> int:
    """The longest end of ``text`` that is a proper prefix of a stop string, the slow way."""
    prefixes = {stop[:length] for stop in stops for length in range(1, len(stop))}
    return max((len(text) - start for start in range(len(text)) if text[start:] in prefixes),
               default=0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=5),
       st.text("abcd", max_size=12))
def test_held_back_text_is_the_longest_end_that_begins_a_stop_string(stops: list[str],
                                                                     text: str) -> None:
    assert StopStrings(stops).num_held_chars(text) == held_by_definition(stops, text)


def test_the_longest_allowed_stop_strings_cost_memory_linear_in_their_size() -> None:
    stops = [chr(ord("a") + index % 26) * MAX_STOP_STRING_CHARS
             for index in range(MAX_STOP_STRINGS)]
    tracemalloc.start()
    try:
        stop_strings = StopStrings(stops)
        # The worst text for matching: every position could begin a stop string.
        text = "a" * (MAX_STOP_STRING_CHARS - 1)
        assert stop_strings.num_held_chars(text) == MAX_STOP_STRING_CHARS - 1
        assert stop_strings.find(text + "a", len(text)) == (0, "a" * MAX_STOP_STRING_CHARS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total_chars = sum(map(len, stops))
    # A prefix set would hold about total_chars * MAX_STOP_STRING_CHARS / 2 characters.
    assert peak < 4 * total_chars + 200_000


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)),
         f"at most {MAX_STOP_STRINGS} stop strings"),
        (SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]),
         f"at most {MAX_STOP_STRING_CHARS} characters"),
        (SamplingParams(stop="x" * 1_000_000), "not 1000000"),  # type: ignore[arg-type]
    ],
)
def test_stop_strings_over_the_bounds_are_refused_at_once(params: SamplingParams,
                                                          words: str) -> None:
    started = time.perf_counter()
    with pytest.raises(RequestRejected) as caught:
        make_intake().admit(submit(params=params))
    assert time.perf_counter() - started < 1.0  # the prefix set took 90 s and 15 GB
    assert (caught.value.param, words in caught.value.message) == ("stop", True)


# -- sampling values decided deliberately ----------------------------------------------------


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_sampling_values_are_refused(name: str, value: float) -> None:
    with pytest.raises(RequestRejected) as caught:
        make_intake().admit(submit(params=SamplingParams(**{name: value})))
    assert caught.value.param == name


def test_values_the_device_cannot_hold_map_to_ones_that_sample_the_same() -> None:
    intake = make_intake()
    request = intake.admit(submit(params=SamplingParams(top_k=2**63, top_p=1e-300,
                                                        temperature=1e308)))
    assert request.sampling.top_k == 0  # a whole vocabulary or more: off
    assert request.sampling.top_p == 0.5 / intake.vocab_size
    assert request.sampling.temperature == MAX_TEMPERATURE
    ordinary = intake.admit(submit(params=SamplingParams(top_k=5, top_p=0.5, temperature=0.7)))
    assert (ordinary.sampling.top_k, ordinary.sampling.top_p) == (5, 0.5)
    assert ordinary.sampling.temperature == 0.7


async def test_a_tiny_top_p_samples_the_greedy_tokens() -> None:
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            greedy_ids = await collect(engine, "hello there", greedy(8))
            tiny_top_p = SamplingParams(max_tokens=8, ignore_eos=True, top_p=1e-300, seed=3)
            assert await collect(engine, "hello there", tiny_top_p) == greedy_ids


async def test_a_huge_temperature_still_keeps_min_tokens_stop_tokens_out() -> None:
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            stop_ids = list(range(0, 2000, 2))
            params = SamplingParams(max_tokens=6, min_tokens=6, temperature=1e308,
                                    stop_token_ids=stop_ids, ignore_eos=True, seed=5)
            token_ids = await collect(engine, "hello there", params)
            assert len(token_ids) == 6
            assert not set(token_ids) & set(stop_ids)


# -- request-sized work leaves the event loop, in arrival order --------------------------------


class BlockingTokenizer(Tokenizer):
    """Encoding a prompt that starts with "slow" waits until the test lets it go."""

    def __init__(self, inner: Tokenizer, release: threading.Event) -> None:
        super().__init__(inner.backend, special_tokens=inner.special_tokens,
                         chat_template=inner.chat_template,
                         generation_eos_ids=inner.eos_token_ids)
        self.release = release

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        if text.startswith("slow") and not self.release.wait(timeout=10):
            raise RuntimeError("encode ran on the event loop: the test could never release it")
        return super().encode(text, **kwargs)


async def test_tokenizing_runs_off_the_event_loop_and_keeps_arrival_order() -> None:
    release = threading.Event()
    tokenizer = BlockingTokenizer(make_intake().tokenizer, release)
    intake = make_intake(tokenizer=tokenizer)
    streams = RequestStreams()
    inbox_send, inbox = trio.open_memory_channel[Any](8)
    queue_outbox, admitted = trio.open_memory_channel[Any](8)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_intake, inbox, queue_outbox, streams, intake)
            for request_id, prompt in [("first", "slow Hello"), ("second", "Hello"),
                                       ("third", "world")]:
                streams.open(request_id)
                await inbox_send.send(submit(prompt, request_id=request_id))
            # The loop runs while the first prompt is being encoded in a thread.
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            messages = [await admitted.receive() for _ in range(3)]
            order = [message.request for message in messages if isinstance(message, Admit)]
            nursery.cancel_scope.cancel()
    assert [request.request_id for request in order] == ["first", "second", "third"]
    assert [request.arrival_index for request in order] == [0, 1, 2]


def test_a_prompt_over_the_context_is_refused_from_its_token_count() -> None:
    intake = make_intake()
    with pytest.raises(RequestRejected) as caught:
        intake.admit(submit("Hello world " * 50))
    assert caught.value.param == "prompt"
    assert "maximum context length is 64 tokens, but the prompt has 150 tokens" in str(
        caught.value)


def test_encoding_a_long_prompt_releases_the_gil() -> None:
    tokenizer = make_intake().tokenizer
    text = "Hello world, the quick brown fox. " * 60_000  # 2 MB
    done = threading.Event()
    num_ticks = 0

    def encode() -> None:
        tokenizer.encode(text)
        done.set()

    thread = threading.Thread(target=encode)
    thread.start()
    while not done.is_set():
        num_ticks += 1  # runs only while the encoding thread lets go of the GIL
        done.wait(0.001)
    thread.join()
    assert num_ticks > 10


# -- failure isolation: each per-request stage ----------------------------------------------------


async def collect(engine: Engine, prompt: str | list[int], params: SamplingParams,
                  **kwargs: Any) -> list[int]:
    token_ids: list[int] = []
    async for output in engine.generate(prompt, params, **kwargs):
        token_ids += output.token_ids
    return token_ids


PROMPTS = [[(index * 37 + offset) % 1500 + 3 for offset in range(6 + index)]
           for index in range(8)]


@contextmanager
def injected(monkeypatch: pytest.MonkeyPatch, stage: str) -> Iterator[None]:
    """Make one per-request stage raise for the request marked "victim" only."""
    original_encode = Tokenizer.encode
    original_template = Tokenizer.apply_chat_template
    original_new_decoder = Detokenizer._new_decoder
    original_find = StopStrings.find

    def encode(self: Tokenizer, text: str, **kwargs: Any) -> list[int]:
        if "victim" in text:
            raise ValueError("injected tokenizer failure")
        return original_encode(self, text, **kwargs)

    def apply_chat_template(self: Tokenizer, messages: list[dict[str, str]],
                            **kwargs: Any) -> str:
        if any("victim" in message["content"] for message in messages):
            raise TypeError("injected chat template failure")
        return original_template(self, messages, **kwargs)

    def new_decoder(self: Detokenizer, request: Any) -> Any:
        decoder = original_new_decoder(self, request)
        if request.request_id != "victim":
            return decoder
        if stage == "detokenizer-track":
            raise RuntimeError("injected detokenizer failure at track")
        return FailingDecoder(decoder)

    def find(self: StopStrings, text: str, num_old_chars: int) -> Any:
        if "victim-stop" in self.stops:
            raise RuntimeError("injected stop string failure")
        return original_find(self, text, num_old_chars)

    patches = {"tokenizer": (Tokenizer, "encode", encode),
               "chat-template": (Tokenizer, "apply_chat_template", apply_chat_template),
               "detokenizer-track": (Detokenizer, "_new_decoder", new_decoder),
               "detokenizer-step": (Detokenizer, "_new_decoder", new_decoder),
               "stop-strings": (StopStrings, "find", find)}
    owner, name, replacement = patches[stage]
    monkeypatch.setattr(owner, name, replacement)
    yield


class FailingDecoder:
    """Decodes three tokens, then raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_steps = 0

    def step(self, token_id: int) -> str:
        self.num_steps += 1
        if self.num_steps > 3:
            raise RuntimeError("injected detokenizer failure mid-stream")
        return str(self.inner.step(token_id))

    def flush(self) -> str:
        return str(self.inner.flush())


async def run_victim(engine: Engine, stage: str) -> BaseException:
    params = greedy(40)
    try:
        if stage == "chat-template":
            async for _ in engine.chat([{"role": "user", "content": "victim"}], params):
                pass
        elif stage == "tokenizer":
            await collect(engine, "the victim prompt", params)
        elif stage == "stop-strings":
            await collect(engine, PROMPTS[0], greedy(40, stop=["victim-stop"]))
        else:
            await collect(engine, PROMPTS[0], params, request_id="victim")
    except (RequestRejected, RequestFailed) as error:
        return error
    raise AssertionError("the victim request did not fail")


@pytest.mark.parametrize("stage", ["tokenizer", "chat-template", "detokenizer-track",
                                   "detokenizer-step", "stop-strings"])
async def test_a_failure_in_one_request_ends_that_request_alone(
        monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            reference = [await collect(engine, prompt, greedy(24)) for prompt in PROMPTS]
            with injected(monkeypatch, stage):
                results: dict[int, list[int]] = {}
                victim_error: list[BaseException] = []

                async def run(index: int) -> None:
                    results[index] = await collect(engine, PROMPTS[index], greedy(24))

                async def victim() -> None:
                    victim_error.append(await run_victim(engine, stage))

                async with trio.open_nursery() as nursery:
                    for index in range(len(PROMPTS)):
                        nursery.start_soon(run, index)
                    nursery.start_soon(victim)
            assert [results[index] for index in range(len(PROMPTS))] == reference
            (error,) = victim_error
            expected_kind = RequestRejected if stage in ("tokenizer", "chat-template") else (
                RequestFailed)
            assert isinstance(error, expected_kind)
            assert "injected" in str(error)
            assert engine.is_healthy
            assert await collect(engine, PROMPTS[1], greedy(24)) == reference[1]
            stats = engine.statistics()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert stats.num_free_blocks == stats.num_total_blocks
