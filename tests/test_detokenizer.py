"""Detokenizer: incremental text, multi-byte characters, stop strings, finishing."""

from __future__ import annotations

import functools
from typing import Any

import hypothesis.strategies as st
import pytest
import tokenizers
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from trio_llm.actors.detokenizer import Detokenizer, StopStrings, run_detokenizer
from trio_llm.actors.messages import (
    Request,
    RequestOutput,
    SamplingOptions,
    SamplingParams,
    StopStringHit,
    TokenBatch,
    TokenDelta,
    TokenLogprobs,
    Track,
)
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.gpu.builtin import train_tiny_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello again, and hello once more.",
    "Stop here. Stop there. Never stop the music.",
    "A naïve café serves crème brûlée.",
    "東京は日本の首都です。日本語の文章。",
    "Emoji are fun 😀 🎉 👍 and so are flags 🇫🇷.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.cache
def byte_level_tokenizer() -> Tokenizer:
    """A small byte-level BPE: multi-byte characters split over several tokens,
    plus a non-special added token holding a space (outside the byte alphabet)."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(CORPUS * 4, trainer)
    backend.add_tokens([AddedToken("<tool call>", special=False, normalized=False)])
    return Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>"}, chat_template=None,
                     generation_eos_ids=[])


@functools.cache
def sentencepiece_tokenizer() -> Tokenizer:
    """A "▁"-piece tokenizer with byte fallback and a strip-leading-space decoder,
    the way sentencepiece models are converted."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{value:02X}>" for value in range(256)),
              "▁Hello", "▁world", ",", "▁the", "▁end", "!", "▁", "s"]
    vocab = {piece: token_id for token_id, piece in enumerate(pieces)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                              byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, special_tokens={"eos_token": "</s>"}, chat_template=None,
                     generation_eos_ids=[])


def make_request(prompt_token_ids: list[int], *, request_id: str = "r", arrival_time: float = 0.0,
                 **params: Any) -> Request:
    sampling_params = SamplingParams(**params)
    sampling = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                               num_logprobs=sampling_params.logprobs,
                               min_tokens=sampling_params.min_tokens, banned_token_ids=[])
    return Request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                   params=sampling_params, sampling=sampling, stop_token_ids=[],
                   max_tokens=sampling_params.max_tokens, priority=0, arrival_index=0,
                   arrival_time=arrival_time)


def delta(token_ids: list[int], finish_reason: Any = None, *, request_id: str = "r",
          stop_reason: int | None = None,
          logprobs: list[TokenLogprobs | None] | None = None) -> TokenBatch:
    return TokenBatch(deltas=[TokenDelta(request_id=request_id, token_ids=token_ids,
                                         logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=stop_reason)])


def stream_tokens(detokenizer: Detokenizer, token_ids: list[int], *, chunk: int = 1,
                  finish_reason: Any = "length",
                  request_id: str = "r") -> tuple[list[RequestOutput], list[str]]:
    """Feed tokens ``chunk`` at a time, the last delta finishing the request."""
    outputs: list[RequestOutput] = []
    stopped: list[str] = []
    chunks = [token_ids[start:start + chunk] for start in range(0, len(token_ids), chunk)] or [[]]
    for index, token_chunk in enumerate(chunks):
        reason = finish_reason if index == len(chunks) - 1 else None
        new_outputs, new_stopped = detokenizer.process(delta(token_chunk, reason,
                                                             request_id=request_id))
        outputs += new_outputs
        stopped += new_stopped
    return outputs, stopped


def joined_text(outputs: list[RequestOutput]) -> str:
    return "".join(output.text for output in outputs)


def joined_token_ids(outputs: list[RequestOutput]) -> list[int]:
    return [token_id for output in outputs for token_id in output.token_ids]


def tracked(tokenizer: Tokenizer, prompt: str = "Hello", **params: Any) -> Detokenizer:
    detokenizer = Detokenizer(tokenizer)
    detokenizer.track(make_request(tokenizer.encode(prompt), **params), now=0.0)
    return detokenizer


# -- multi-byte characters ---------------------------------------------------------


@pytest.mark.parametrize("text", ["Hi 😀 日本語 ok", "🇫🇷🎉👍", "crème brûlée 東京", "é"])
def test_multibyte_characters_split_over_tokens_never_stream_replacement_characters(
        text: str) -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode(text)
    detokenizer = tracked(tokenizer)
    outputs, _ = stream_tokens(detokenizer, token_ids)
    assert all("\ufffd" not in output.text for output in outputs)
    assert joined_text(outputs) == text
    assert joined_token_ids(outputs) == token_ids


def test_a_token_completing_no_character_streams_its_id_with_no_text() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("😀")
    assert len(token_ids) > 1, "the emoji must span several tokens for this test"
    outputs, _ = stream_tokens(tracked(tokenizer), token_ids)
    assert [output.text for output in outputs[:-1]] == [""] * (len(token_ids) - 1)
    assert outputs[-1].text == "😀"


def test_an_incomplete_character_at_the_end_is_flushed_as_the_tokenizer_decodes_it() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("ok") + tokenizer.encode("😀")[:-1]
    outputs, _ = stream_tokens(tracked(tokenizer), token_ids)
    assert joined_text(outputs) == tokenizer.decode(token_ids)
    assert joined_text(outputs).endswith("\ufffd")
    assert "\ufffd" not in joined_text(outputs[:-1])


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip_special_tokens=st.booleans(), chunk=st.integers(1, 4))
def test_the_stream_joins_to_the_tokenizers_decode_of_all_output_tokens(
        data: st.DataObject, skip_special_tokens: bool, chunk: int) -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=24))
    detokenizer = tracked(tokenizer, skip_special_tokens=skip_special_tokens)
    outputs, _ = stream_tokens(detokenizer, token_ids, chunk=chunk)
    expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert joined_text(outputs) == expected
    assert joined_token_ids(outputs) == token_ids
    assert detokenizer.num_tracked == 0


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_builtin_tiny_tokenizer_streams_exactly_its_decode(data: st.DataObject) -> None:
    tokenizer = builtin_tokenizer()
    token_ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=24))
    outputs, _ = stream_tokens(tracked(tokenizer), token_ids)
    assert joined_text(outputs) == tokenizer.decode(token_ids)


@functools.cache
def builtin_tokenizer() -> Tokenizer:
    backend = train_tiny_tokenizer()
    return Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>"}, chat_template=None,
                     generation_eos_ids=[])


def test_special_tokens_are_skipped_or_kept_as_asked() -> None:
    tokenizer = byte_level_tokenizer()
    im_start = tokenizer.backend.token_to_id("<|im_start|>")
    tool_call = tokenizer.backend.token_to_id("<tool call>")
    token_ids = [im_start, *tokenizer.encode("Hello"), tool_call]
    skipped, _ = stream_tokens(tracked(tokenizer), token_ids)
    kept, _ = stream_tokens(tracked(tokenizer, skip_special_tokens=False), token_ids)
    assert joined_text(skipped) == "Hello<tool call>"
    assert joined_text(kept) == "<|im_start|>Hello<tool call>"


# -- sentencepiece-style tokenizers ----------------------------------------------------


def piece_ids(tokenizer: Tokenizer, pieces: list[str]) -> list[int]:
    ids = [tokenizer.backend.token_to_id(piece) for piece in pieces]
    assert None not in ids
    return ids  # type: ignore[return-value]


def test_sentencepiece_output_keeps_the_space_it_has_after_the_prompt() -> None:
    tokenizer = sentencepiece_tokenizer()
    prompt = piece_ids(tokenizer, ["<s>", "▁Hello"])
    # 日 is E6 97 A5: three byte-fallback tokens.
    output = piece_ids(tokenizer, ["▁world", ",", "▁", "<0xE6>", "<0x97>", "<0xA5>", "▁the",
                                   "▁end", "!"])
    detokenizer = Detokenizer(tokenizer)
    detokenizer.track(make_request(prompt), now=0.0)
    outputs, _ = stream_tokens(detokenizer, output)
    assert joined_text(outputs) == " world, 日 the end!"
    assert all("\ufffd" not in out.text for out in outputs)
    full = tokenizer.decode(prompt + output)
    assert joined_text(outputs) == full[len(tokenizer.decode(prompt)):]


def test_sentencepiece_held_bytes_are_flushed_at_the_end() -> None:
    tokenizer = sentencepiece_tokenizer()
    output = piece_ids(tokenizer, ["▁world", "<0xE6>", "<0x97>"])
    detokenizer = Detokenizer(tokenizer)
    detokenizer.track(make_request(piece_ids(tokenizer, ["▁Hello"])), now=0.0)
    outputs, _ = stream_tokens(detokenizer, output)
    assert [out.text for out in outputs[:-1]] == [" world", ""]
    assert outputs[-1].text.startswith("\ufffd")


def test_sentencepiece_stream_equals_decode_with_the_prompt_as_context() -> None:
    tokenizer = sentencepiece_tokenizer()
    prompt = piece_ids(tokenizer, ["▁Hello", "<0xE6>"])  # the prompt ends inside a character
    output = piece_ids(tokenizer, ["▁world", "s", "!"])
    detokenizer = Detokenizer(tokenizer)
    detokenizer.track(make_request(prompt), now=0.0)
    outputs, _ = stream_tokens(detokenizer, output)
    assert joined_text(outputs) == " worlds!"


# -- stop strings ----------------------------------------------------------------


def test_a_stop_string_spanning_tokens_is_never_partially_streamed() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("The quick brown fox jumps")
    detokenizer = tracked(tokenizer, stop=["brown fox"])
    outputs, stopped = stream_tokens(detokenizer, token_ids, finish_reason=None)
    assert joined_text(outputs) == "The quick "
    assert "b" not in joined_text(outputs[:-1]).removeprefix("The quick ")
    final = outputs[-1]
    assert (final.finished, final.finish_reason, final.stop_reason) == (True, "stop", "brown fox")
    assert stopped == ["r"]
    kept = joined_token_ids(outputs)
    assert "brown fox" in tokenizer.decode(kept)
    assert "brown fox" not in tokenizer.decode(kept[:-1])
    assert final.num_output_tokens == len(kept)


def test_a_false_start_of_a_stop_string_is_released_once_it_diverges() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = tracked(tokenizer, stop=["Stop now"])
    streamed = ""
    for token_id in tokenizer.encode("Stop here. Stop there."):
        outputs, _ = detokenizer.process(delta([token_id]))
        streamed += joined_text(outputs)
        assert "Stop here. Stop there.".startswith(streamed)
    assert streamed.startswith("Stop here. ")
    outputs, _ = detokenizer.process(delta([], "length"))
    assert streamed + joined_text(outputs) == "Stop here. Stop there."


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = tracked(tokenizer, stop=["brown"], include_stop_str_in_output=True)
    outputs, _ = stream_tokens(detokenizer, tokenizer.encode("The quick brown fox jumps"),
                               chunk=3, finish_reason=None)
    assert joined_text(outputs) == "The quick brown"
    assert outputs[-1].stop_reason == "brown"


def test_tokens_after_the_stop_string_in_the_same_delta_are_not_reported() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("Hello world, hello again")
    detokenizer = tracked(tokenizer, stop=["world"])
    outputs, stopped = detokenizer.process(delta(token_ids))
    (output,) = outputs
    assert output.text == "Hello "
    assert len(output.token_ids) < len(token_ids)
    assert tokenizer.decode(output.token_ids).endswith("world")
    assert stopped == ["r"]


def test_stop_strings_count_only_after_min_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("hello world, hello again")
    num_first = len(tokenizer.encode("hello world"))
    detokenizer = tracked(tokenizer, stop=["hello"], min_tokens=num_first)
    outputs, stopped = stream_tokens(detokenizer, token_ids, finish_reason=None)
    assert joined_text(outputs) == "hello world, "
    assert outputs[-1].stop_reason == "hello"
    assert stopped == ["r"]


def test_min_tokens_covering_the_whole_output_ignores_stop_strings() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("hello world")
    detokenizer = tracked(tokenizer, stop=["world"], min_tokens=len(token_ids))
    outputs, stopped = stream_tokens(detokenizer, token_ids)
    assert joined_text(outputs) == "hello world"
    assert outputs[-1].finish_reason == "length"
    assert stopped == []


def test_the_earliest_of_several_stop_strings_wins() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = tracked(tokenizer, stop=["lazy", "fox", "jumps over"])
    outputs, _ = detokenizer.process(delta(tokenizer.encode("The quick brown fox jumps over "
                                                            "the lazy dog")))
    assert outputs[-1].text == "The quick brown "
    assert outputs[-1].stop_reason == "fox"


@settings(max_examples=150, deadline=None)
@given(text=st.text("ab c", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=4),
                                                        min_size=1, max_size=3),
       chunk=st.integers(1, 3))
def test_streamed_text_is_always_a_prefix_of_the_text_before_the_first_stop_string(
        text: str, stops: list[str], chunk: int) -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode(text)
    detokenizer = tracked(tokenizer, stop=stops)
    outputs, _ = stream_tokens(detokenizer, token_ids, chunk=chunk)
    streamed = joined_text(outputs)
    assert text.startswith(streamed)
    assert not any(stop in streamed for stop in stops)
    if outputs[-1].finish_reason == "stop":
        assert text[len(streamed):].startswith(str(outputs[-1].stop_reason))
    else:
        assert streamed == text


def test_stop_strings_hold_back_only_what_could_start_one() -> None:
    stops = StopStrings(["abc", "xy"])
    assert stops.num_held_chars("zzab") == 2
    assert stops.num_held_chars("zzx") == 1
    assert stops.num_held_chars("zzabd") == 0
    assert stops.num_held_chars("") == 0
    assert stops.find("zabcxy", 0) == (1, "abc")
    assert stops.find("zabcxy", 4) == (4, "xy")


# -- finishing ------------------------------------------------------------------------


def test_the_eos_token_id_is_reported_but_its_text_is_not() -> None:
    tokenizer = byte_level_tokenizer()
    eos = tokenizer.eos_token_ids[0]
    detokenizer = tracked(tokenizer, skip_special_tokens=False)
    detokenizer.process(delta(tokenizer.encode("Hello")))
    outputs, stopped = detokenizer.process(delta([eos], "stop"))
    (output,) = outputs
    assert output.token_ids == [eos]
    assert (output.text, output.finish_reason, output.num_output_tokens) == ("", "stop", 2)
    assert stopped == [], "the scheduler finished it already"


def test_a_stop_token_id_text_is_excluded_unless_include_stop_str_in_output() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("Hello world")
    stop_token = token_ids[-1]
    excluded, _ = stream_tokens(tracked(tokenizer), token_ids, finish_reason="stop")
    included, _ = stream_tokens(tracked(tokenizer, include_stop_str_in_output=True), token_ids,
                                finish_reason="stop")
    assert joined_text(excluded) == tokenizer.decode(token_ids[:-1])
    assert joined_text(included) == "Hello world"
    assert joined_token_ids(excluded)[-1] == stop_token


def test_stop_reason_from_the_scheduler_is_passed_on() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = tracked(tokenizer)
    outputs, _ = detokenizer.process(delta([5], "stop", stop_reason=5))
    assert (outputs[0].finish_reason, outputs[0].stop_reason) == ("stop", 5)


def test_tokens_arriving_after_a_stop_string_finish_are_dropped() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = tracked(tokenizer, stop=["world"])
    outputs, stopped = detokenizer.process(delta(tokenizer.encode("Hello world")))
    assert outputs[-1].finished and stopped == ["r"]
    assert detokenizer.num_tracked == 0
    late = detokenizer.process(delta(tokenizer.encode(" again")))
    assert late == ([], [])
    assert detokenizer.process(delta([], "abort")) == ([], [])


def test_a_stop_string_on_the_last_token_wins_over_length_without_a_hit_report() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = tracked(tokenizer, stop=["world"])
    outputs, stopped = detokenizer.process(delta(tokenizer.encode("Hello world"), "length"))
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", "world")
    assert stopped == []


def test_abort_flushes_held_back_text_and_forgets_the_request() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = tracked(tokenizer, stop=["Hello world!"])
    outputs, _ = detokenizer.process(delta(tokenizer.encode("Hello world")))
    assert joined_text(outputs) == ""
    outputs, stopped = detokenizer.process(delta([], "abort"))
    (output,) = outputs
    assert (output.text, output.finished, output.finish_reason) == ("Hello world", True, "abort")
    assert output.token_ids == [] and stopped == []
    assert detokenizer.num_tracked == 0


def test_deltas_for_untracked_requests_are_dropped() -> None:
    detokenizer = Detokenizer(byte_level_tokenizer())
    assert detokenizer.process(delta([1, 2], "length", request_id="nobody")) == ([], [])


def test_tracking_again_keeps_the_decoding_state() -> None:
    tokenizer = byte_level_tokenizer()
    request = make_request(tokenizer.encode("Hi"), stop=["fox"])
    detokenizer = Detokenizer(tokenizer)
    detokenizer.track(request, now=1.0)
    detokenizer.process(delta(tokenizer.encode("brown f")))
    detokenizer.track(request, now=5.0)  # recomputed after a preemption
    outputs, _ = detokenizer.process(delta(tokenizer.encode("ox")))
    assert outputs[-1].stop_reason == "fox"


# -- counts, queue time, logprobs --------------------------------------------------------------


def test_counts_are_running_totals_and_queue_time_comes_once() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = Detokenizer(tokenizer)
    detokenizer.track(make_request([1, 2, 3], arrival_time=10.0), now=12.5)
    first, _ = detokenizer.process(delta([40, 41]))
    second, _ = detokenizer.process(delta([42], "length"))
    assert (first[0].num_prompt_tokens, first[0].num_output_tokens) == (3, 2)
    assert (second[0].num_prompt_tokens, second[0].num_output_tokens) == (3, 3)
    assert first[0].queue_time == pytest.approx(2.5)
    assert second[0].queue_time is None


def test_logprobs_are_passed_when_asked_and_cut_with_the_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("Hello world, hello")
    logprobs: list[TokenLogprobs | None] = [
        TokenLogprobs(logprob=-float(index), top_token_ids=[], top_logprobs=[])
        for index in range(len(token_ids))]
    with_logprobs = tracked(tokenizer, logprobs=2, stop=["world"])
    outputs, _ = with_logprobs.process(delta(token_ids, logprobs=logprobs))
    assert outputs[0].logprobs == logprobs[:len(outputs[0].token_ids)]
    without = tracked(tokenizer)
    outputs, _ = without.process(delta(token_ids, logprobs=logprobs))
    assert outputs[0].logprobs is None


def test_many_requests_in_one_batch_are_decoded_independently() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = Detokenizer(tokenizer)
    texts = {f"r{index}": text for index, text in enumerate(CORPUS)}
    for request_id in texts:
        detokenizer.track(make_request([1], request_id=request_id), now=0.0)
    encoded = {request_id: tokenizer.encode(text) for request_id, text in texts.items()}
    streamed = dict.fromkeys(texts, "")
    for step in range(max(len(ids) for ids in encoded.values())):
        deltas = [TokenDelta(request_id=request_id, token_ids=ids[step:step + 1], logprobs=None,
                             finish_reason="length" if step == len(ids) - 1 else None)
                  for request_id, ids in encoded.items() if step < len(ids)]
        outputs, _ = detokenizer.process(TokenBatch(deltas=deltas))
        for output in outputs:
            streamed[output.request_id] += output.text
    assert streamed == texts
    assert detokenizer.num_tracked == 0


# -- the actor ----------------------------------------------------------------------------


async def test_run_detokenizer_publishes_outputs_and_reports_stop_strings(
        autojump_clock: trio.testing.MockClock) -> None:
    tokenizer = byte_level_tokenizer()
    streams = RequestStreams()
    inbox_send, inbox_receive = trio.open_memory_channel[Any](8)
    scheduler_send, scheduler_receive = trio.open_memory_channel[Any](8)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_detokenizer, inbox_receive, scheduler_send, streams,
                                Detokenizer(tokenizer))
            arrival_time = trio.current_time()
            await trio.sleep(3)
            stream = streams.open("r")
            request = make_request([1, 2], arrival_time=arrival_time, stop=["world"])
            await inbox_send.send(Track(request=request))
            await inbox_send.send(delta(tokenizer.encode("Hello world again")))
            output = await stream.receive()
            assert (output.text, output.finish_reason, output.stop_reason) == (
                "Hello ", "stop", "world")
            assert output.queue_time == pytest.approx(3.0)
            assert await scheduler_receive.receive() == StopStringHit(request_id="r")
            await inbox_send.aclose()
    with pytest.raises(trio.EndOfChannel):
        await scheduler_receive.receive()


def sentencepiece_units(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """A piece, or a whole character spelled in byte-fallback tokens."""
    byte_ids = piece_ids(tokenizer, [f"<0x{value:02X}>" for value in range(256)])
    pieces = [token_id for token_id in range(tokenizer.vocab_size) if token_id not in byte_ids]
    character = st.characters(codec="utf-8", exclude_characters="\ufffd").map(
        lambda char: [byte_ids[value] for value in char.encode("utf-8")])
    return st.one_of(st.sampled_from(pieces).map(lambda token_id: [token_id]), character)


def flat(units: list[list[int]]) -> list[int]:
    return [token_id for unit in units for token_id in unit]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_sentencepiece_stream_equals_the_decode_it_adds_to_the_prompt(
        data: st.DataObject, skip_special_tokens: bool) -> None:
    # Whole characters only: with invalid bytes, byte fallback turns earlier
    # valid bytes of the same run into U+FFFD, which no stream can take back.
    tokenizer = sentencepiece_tokenizer()
    units = sentencepiece_units(tokenizer)
    prompt = flat(data.draw(st.lists(units, min_size=1, max_size=6)))
    output = flat(data.draw(st.lists(units, max_size=10)))
    detokenizer = Detokenizer(tokenizer)
    detokenizer.track(make_request(prompt, skip_special_tokens=skip_special_tokens), now=0.0)
    outputs, _ = stream_tokens(detokenizer, output)
    assert all("\ufffd" not in out.text for out in outputs)
    decoded_prompt = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    assert joined_text(outputs) == full[len(decoded_prompt):]
