"""Sampling fields and several choices over HTTP, through the official `openai` client
against the real engine and the tiny model: penalties and logit_bias, ``n`` and
``best_of`` (seeded children, index order, summed usage, shared prompt blocks),
batched prompts (each choice its solo run), ``echo``; and what is refused."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import openai
import pytest
import trio
from test_http_openai import LAYOUTS, served_engine
from test_http_support import openai_clients, running_server

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.intake import derive_seed
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine

TIMEOUT = 120
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
# prompts of several blocks (block_size 16), so that children can share full blocks
LONG_PROMPT = list(range(40, 90))
# The tiny model is so peaked that seeded draws at temperature 1 often coincide.
SAMPLED = {"model": "tiny", "temperature": 5.0, "max_tokens": 8,
           "extra_body": {"ignore_eos": True}}


async def engine_text(engine: Engine, prompt: str | list[int], params: SamplingParams) -> str:
    return "".join([output.text async for output in engine.generate(prompt, params)])


def sampled_params(seed: int, **fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=5.0, seed=seed, ignore_eos=True, **fields)


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_n_seeded_children_differ_are_reproducible_and_in_index_order(layout) -> None:
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served, openai_clients(served.url) as (client, _):
            first = await client.completions.create(prompt=PROMPT, n=4, seed=7, **SAMPLED)
            again = await client.completions.create(prompt=PROMPT, n=4, seed=7, **SAMPLED)
            solo = [await engine_text(served.engine, PROMPT, sampled_params(seed))
                    for seed in (7, derive_seed(7, 1))]
            one = await client.completions.create(prompt=PROMPT, n=1, seed=7, **SAMPLED)
    texts = [choice.text for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2, 3]
    assert texts == [choice.text for choice in again.choices]
    assert len(set(texts)) == 4, "seeded children differ"
    assert texts[:2] == solo  # child 0 keeps the seed, child i samples with a derived one
    assert one.choices[0].text == texts[0]
    assert first.usage is not None and one.usage is not None
    assert first.usage.completion_tokens == 4 * 8
    assert first.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once


async def test_children_share_the_prompts_cached_blocks() -> None:
    with trio.fail_after(TIMEOUT):
        async with served_engine("in-process") as served, openai_clients(served.url) as (client, _):
            before = served.engine.statistics()
            await client.completions.create(prompt=LONG_PROMPT, n=4, seed=1, **SAMPLED)
            after = served.engine.statistics()
    num_queried = after.num_prefix_cache_queries - before.num_prefix_cache_queries
    num_hits = after.num_prefix_cache_hits - before.num_prefix_cache_hits
    assert num_queried == 4 * len(LONG_PROMPT)
    # the first child computes the prompt's three full blocks, the others find them
    assert num_hits == 3 * 3 * 16
    assert after.num_free_blocks == after.num_total_blocks


async def test_stream_chunks_name_their_choice() -> None:
    """Streamed with n=3: each choice's chunks, joined by index, are the non-streamed
    choice; the chat stream's first chunk of each choice carries the role."""

    def stream(create: Any, **fields: Any) -> list[Any]:
        with create(stream=True, stream_options={"include_usage": True}, **fields) as chunks:
            return list(chunks)

    with trio.fail_after(TIMEOUT):
        async with (served_engine("in-process") as served,
                    openai_clients(served.url) as (client, sync)):
            whole = await client.completions.create(prompt=PROMPT, n=3, seed=5, **SAMPLED)
            chunks = await trio.to_thread.run_sync(lambda: stream(
                sync.completions.create, prompt=PROMPT, n=3, seed=5, **SAMPLED))
            chat = await client.chat.completions.create(messages=MESSAGES, n=3, seed=5,
                                                        **SAMPLED)
            chat_chunks = await trio.to_thread.run_sync(lambda: stream(
                sync.chat.completions.create, messages=MESSAGES, n=3, seed=5, **SAMPLED))
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[index] for index in range(3)] == [choice.text for choice in whole.choices]
    assert chunks[-1].usage.completion_tokens == 24
    contents: dict[int, str] = defaultdict(str)
    roles: dict[int, list[str | None]] = defaultdict(list)
    for chunk in chat_chunks:
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
            roles[choice.index].append(choice.delta.role)
    assert [contents[index] for index in range(3)] == [c.message.content for c in chat.choices]
    assert all(roles[index][0] == "assistant" for index in range(3))
    assert chat.usage is not None and chat.usage.completion_tokens == 24


async def test_best_of_returns_the_highest_cumulative_logprob() -> None:
    with trio.fail_after(TIMEOUT):
        async with served_engine("in-process") as served, openai_clients(served.url) as (client, _):
            candidates = await client.completions.create(prompt=PROMPT, n=4, seed=3,
                                                         logprobs=0, **SAMPLED)
            best = await client.completions.create(prompt=PROMPT, n=2, best_of=4, seed=3,
                                                   **SAMPLED)
            with pytest.raises(openai.BadRequestError) as streamed:
                await client.completions.create(prompt=PROMPT, best_of=2, stream=True,
                                                **SAMPLED)
    totals = [sum(choice.logprobs.token_logprobs) for choice in candidates.choices]
    ranked = sorted(range(4), key=lambda index: -totals[index])
    assert [choice.text for choice in best.choices] == [
        candidates.choices[index].text for index in ranked[:2]]
    assert [choice.index for choice in best.choices] == [0, 1]
    assert all(choice.logprobs is None for choice in best.choices)  # not asked for
    assert streamed.value.body["param"] == "best_of"  # type: ignore[index]


async def test_batched_prompts_are_each_their_solo_run() -> None:
    prompts = ["Once upon a time", "The cat", "In a land far away"]
    token_prompts = [[5, 6, 7], [40, 41], [9, 9, 9, 9]]
    greedy = {"model": "tiny", "temperature": 0.0, "max_tokens": 6,
              "extra_body": {"ignore_eos": True}}
    with trio.fail_after(TIMEOUT):
        async with served_engine("in-process") as served, openai_clients(served.url) as (client, _):
            batch = await client.completions.create(prompt=prompts, **greedy)
            token_batch = await client.completions.create(prompt=token_prompts, **greedy)
            seeded = await client.completions.create(prompt=prompts, n=2, seed=11, **SAMPLED)
            solo = [(await client.completions.create(prompt=prompt, **greedy)).choices[0].text
                    for prompt in prompts]
            token_solo = [await engine_text(served.engine, prompt, SamplingParams(
                max_tokens=6, temperature=0.0, ignore_eos=True)) for prompt in token_prompts]
            seeded_solo = [await engine_text(served.engine, prompt, sampled_params(11))
                           for prompt in prompts]
    assert [choice.text for choice in batch.choices] == solo
    assert [choice.index for choice in batch.choices] == [0, 1, 2]
    assert [choice.text for choice in token_batch.choices] == token_solo
    assert batch.usage is not None and batch.usage.completion_tokens == 18
    assert token_batch.usage is not None and token_batch.usage.prompt_tokens == 9
    # choices prompt by prompt, n each: child 0 of each prompt keeps the seed
    assert [choice.text for choice in seeded.choices][::2] == seeded_solo
    assert len(seeded.choices) == 6


async def test_echo_prepends_the_prompt() -> None:
    greedy = {"model": "tiny", "temperature": 0.0, "max_tokens": 5,
              "extra_body": {"ignore_eos": True}}
    with trio.fail_after(TIMEOUT):
        async with (served_engine("in-process") as served,
                    openai_clients(served.url) as (client, sync)):
            plain = await client.completions.create(prompt=PROMPT, **greedy)
            echoed = await client.completions.create(prompt=PROMPT, echo=True, **greedy)
            batch = await client.completions.create(prompt=[PROMPT, [5, 6, 7]], echo=True,
                                                    **greedy)

            def stream() -> list[Any]:
                with sync.completions.create(prompt=PROMPT, echo=True, stream=True,
                                             **greedy) as chunks:
                    return list(chunks)

            chunks = await trio.to_thread.run_sync(stream)
            with_logprobs = await client.completions.create(prompt=PROMPT, echo=True,
                                                            logprobs=1, **greedy)
            decoded = served.engine.tokenizer.decode([5, 6, 7], skip_special_tokens=False)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(chunk.choices[0].text for chunk in chunks) == echoed.choices[0].text
    assert batch.choices[0].text == echoed.choices[0].text
    assert batch.choices[1].text.startswith(decoded)
    # the prompt's tokens first, the first one's logprob null (tests/test_prompt_logprobs.py)
    echoed_logprobs = with_logprobs.choices[0].logprobs
    assert echoed_logprobs is not None and echoed_logprobs.token_logprobs is not None
    assert echoed_logprobs.token_logprobs[0] is None
    assert len(echoed_logprobs.token_logprobs) == with_logprobs.usage.total_tokens


PENALTY_CONFIG = EngineConfig(model="tiny", num_kv_blocks=64, block_size=16, max_num_seqs=8,
                              max_num_batched_tokens=256, max_model_len=256)


async def test_penalty_fields_do_what_the_engine_does() -> None:
    """Each penalty field over HTTP gives the in-process engine's tokens for the same
    params, and changes the greedy output (nothing accepted and ignored)."""
    greedy = {"model": "tiny", "temperature": 0.0, "max_tokens": 24}
    fields = [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
              {"extra_body": {"repetition_penalty": 1.8}},
              {"logit_bias": {"43": 100}},
              {"extra_body": {"allowed_token_ids": [30, 31, 32]}}]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(PENALTY_CONFIG) as engine, running_server(engine) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            try:
                plain = await client.completions.create(prompt=PROMPT,
                                                        extra_body={"ignore_eos": True},
                                                        **greedy)
                results = []
                for extra in fields:
                    body = dict(extra.get("extra_body", {}), ignore_eos=True)
                    named = {key: value for key, value in extra.items() if key != "extra_body"}
                    response = await client.completions.create(prompt=PROMPT, extra_body=body,
                                                               **named, **greedy)
                    chat = await client.chat.completions.create(
                        messages=MESSAGES, extra_body=body, **named, **greedy)
                    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                            **_engine_fields(extra))
                    results.append((response.choices[0].text,
                                    await engine_text(engine, PROMPT, params),
                                    chat.choices[0].message.content,
                                    "".join([o.text async for o in engine.chat(MESSAGES,
                                                                               params)])))
            finally:
                await client.close()
    for over_http, in_process, chat, in_process_chat in results:
        assert over_http == in_process and chat == in_process_chat
        assert over_http != plain.choices[0].text
    assert set(results[3][0]) <= set(_text_of(43))


def _engine_fields(extra: dict[str, Any]) -> dict[str, Any]:
    fields = {key: value for key, value in extra.items() if key != "extra_body"}
    fields.update(extra.get("extra_body", {}))
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(key): value for key, value in fields["logit_bias"].items()}
    return fields


def _text_of(token_id: int) -> str:
    from trio_llm.actors.tokenizer import Tokenizer
    from trio_llm.gpu.builtin import resolve_model

    return Tokenizer.from_dir(resolve_model("tiny")).decode([token_id])


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_sampling_fields_cross_the_process_boundary(layout: str) -> None:
    """Penalties, logit_bias and echoed prompt logprobs give the in-process engine's
    results in the served layout too (the request crosses the wire to the core)."""
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served, openai_clients(served.url) as (client, _):
            response = await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0, echo=True,
                logprobs=1, logit_bias={"44": 5.0}, presence_penalty=0.5,
                extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                    logit_bias={44: 5.0}, presence_penalty=0.5,
                                    repetition_penalty=1.3, logprobs=1, prompt_logprobs=1)
            outputs = [output async for output in served.engine.generate(PROMPT, params)]
    assert response.choices[0].text == PROMPT + "".join(output.text for output in outputs)
    first = outputs[0]
    assert first.prompt_logprobs is not None and response.choices[0].logprobs is not None
    num_prompt_tokens = len(first.prompt_logprobs)
    assert response.choices[0].logprobs.token_logprobs[1:num_prompt_tokens] == pytest.approx(
        [entry.logprob for entry in first.prompt_logprobs[1:] if entry is not None], abs=1e-6)
