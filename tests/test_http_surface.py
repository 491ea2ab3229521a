"""The request surface a vLLM user expects: no silently ignored field, the chat-template
options, defaults from the checkpoint, --max-logprobs, CORS, the request and stats log
lines, positional MODEL and --log-level after the command. Through the official `openai`
client where the field is OpenAI's, on the tiny model or the scripted FakeEngine."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing
from msgspec.structs import replace
from test_http_support import FakeEngine, running_server

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.generation_defaults import GenerationDefaults, read_generation_defaults
from trio_llm.actors.messages import ChatTemplateOptions, SamplingParams, Submit
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.api.engine import Engine
from trio_llm.api.stats_log import StatsLine, log_stats_every
from trio_llm.gpu.builtin import resolve_model

TIMEOUT = 120
CONFIG = EngineConfig(model="tiny", num_kv_blocks=64, block_size=16, max_num_seqs=4,
                      max_num_batched_tokens=128, max_model_len=256)
MESSAGES = [{"role": "user", "content": "hi"}]
# A template that shows what it was given: documents, and the generation prompt.
TEMPLATE = ("{%- if documents %}{{ 'DOCS ' + (documents | map(attribute='title') | join(','))"
            " + '\\n' }}{%- endif %}"
            "{%- for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
            "{{ ' END\\n' }}{%- endfor %}{%- if add_generation_prompt %}assistant:{%- endif %}")


@asynccontextmanager
async def openai_client(engine: Any, **server_options: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    async with running_server(engine, **server_options) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield client
        finally:
            await client.close()


async def refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as raised:
        await call
    assert isinstance(raised.value.body, dict)
    return raised.value.body


# -- no silently ignored field -----------------------------------------------------------


async def test_openai_and_vllm_fields_not_honoured_are_a_400_naming_them() -> None:
    engine = FakeEngine()
    chat = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2}
    with trio.fail_after(TIMEOUT):
        async with openai_client(engine) as client:
            create = client.chat.completions.create
            refused = {
                "store": await refusal(create(store=True, **chat)),
                "modalities": await refusal(create(modalities=["text", "audio"], **chat)),
                "service_tier": await refusal(create(service_tier="flex", **chat)),
                "reasoning_effort": await refusal(create(reasoning_effort="low", **chat)),
                "use_beam_search": await refusal(create(extra_body={"use_beam_search": True},
                                                        **chat)),
                "guided_json": await refusal(create(extra_body={"guided_json": {}}, **chat)),
                "chat_template": await refusal(create(extra_body={"chat_template": "x"},
                                                      **chat)),
            }
            usage_stats = await refusal(client.completions.create(
                model="fake-model", prompt="x", max_tokens=2, stream=True,
                stream_options={"continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert usage_stats["param"] == "stream_options"
    assert "continuous_usage_stats needs include_usage" in usage_stats["message"]
    for name, body in refused.items():
        assert body["param"] == name
        assert f"{name} is not supported by trio-llm" in body["message"]
    assert engine.submitted == []  # none reached the engine


async def test_continuous_usage_stats_put_each_choices_counts_so_far_in_every_chunk() -> None:
    """vLLM's stream option: every chunk with a choice carries that choice's usage
    so far; the last chunk (no choices) the request's, as without the option."""
    every_chunk = {"include_usage": True, "continuous_usage_stats": True}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine, openai_client(engine) as client:
            completion = [chunk async for chunk in await client.completions.create(
                model="tiny", prompt="Once upon a time", max_tokens=6, stream=True,
                stream_options=every_chunk,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True})]
            chat = [chunk async for chunk in await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=5, n=2, stream=True,
                stream_options=every_chunk,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True})]
    for chunks, num_choices, max_tokens in ((completion, 1, 6), (chat, 2, 5)):
        *with_choices, last = chunks
        assert last.choices == [] and last.usage is not None
        counts: dict[int, list[int]] = {index: [] for index in range(num_choices)}
        for chunk in with_choices:
            assert chunk.usage is not None and len(chunk.choices) == 1
            assert chunk.usage.prompt_tokens == last.usage.prompt_tokens  # n shares one prompt
            assert chunk.usage.total_tokens == (chunk.usage.prompt_tokens
                                                + chunk.usage.completion_tokens)
            counts[chunk.choices[0].index].append(chunk.usage.completion_tokens)
        for so_far in counts.values():
            assert so_far == sorted(so_far) and so_far[0] >= 1 and so_far[-1] == max_tokens
        assert last.usage.completion_tokens == num_choices * max_tokens


async def test_truncate_prompt_tokens_answers_as_the_prompts_end_alone() -> None:
    prompt = [(7 * index + 3) % 200 + 10 for index in range(40)]
    greedy = {"max_tokens": 4, "temperature": 0.0}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine, openai_client(engine) as client:
            cut = await client.completions.create(
                model="tiny", prompt=prompt, extra_body={"truncate_prompt_tokens": 9}, **greedy)
            alone = await client.completions.create(model="tiny", prompt=prompt[-9:], **greedy)
            chat = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, extra_body={"truncate_prompt_tokens": 3},
                **greedy)
            with_echo = await refusal(client.completions.create(
                model="tiny", prompt=prompt, echo=True,
                extra_body={"truncate_prompt_tokens": 9}, **greedy))
    assert cut.choices[0].text == alone.choices[0].text
    assert cut.usage is not None and alone.usage is not None and chat.usage is not None
    assert cut.usage.prompt_tokens == alone.usage.prompt_tokens == 9
    assert chat.usage.prompt_tokens == 3
    assert with_echo["param"] == "truncate_prompt_tokens"


def extra(item: Any, name: str) -> Any:
    """A field the openai SDK's models do not declare (vLLM's), or None."""
    return (item.model_extra or {}).get(name)


async def test_return_token_ids_gives_the_prompts_and_the_outputs_token_ids() -> None:
    """vLLM's return_token_ids: the prompt's ids once (a stream's first chunk), the
    output's in every chunk; absent without it."""
    asked = {"max_tokens": 6, "temperature": 0.0,
             "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine, openai_client(engine) as client:
            prompt_ids = engine.tokenizer.encode("Once upon a time")
            whole = await client.completions.create(model="tiny", prompt="Once upon a time",
                                                    **asked)
            chunks = [chunk async for chunk in await client.completions.create(
                model="tiny", prompt="Once upon a time", stream=True, **asked)]
            chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, **asked)
            chat_chunks = [chunk async for chunk in await client.chat.completions.create(
                model="tiny", messages=MESSAGES, stream=True, **asked)]
            pair = await client.chat.completions.create(model="tiny", messages=MESSAGES, n=2,
                                                        **asked)
            plain = await client.completions.create(model="tiny", prompt="Once upon a time",
                                                    max_tokens=2)
            decode = engine.tokenizer.decode
    choice = whole.choices[0]
    assert whole.usage is not None and chat.usage is not None
    assert extra(choice, "prompt_token_ids") == prompt_ids
    assert len(extra(choice, "token_ids")) == whole.usage.completion_tokens == 6
    assert decode(extra(choice, "token_ids")) == choice.text
    assert extra(chunks[0].choices[0], "prompt_token_ids") == prompt_ids
    assert all(extra(chunk.choices[0], "prompt_token_ids") is None for chunk in chunks[1:])
    assert [token_id for chunk in chunks
            for token_id in extra(chunk.choices[0], "token_ids")] == extra(choice, "token_ids")

    chat_prompt_ids = extra(chat, "prompt_token_ids")
    assert len(chat_prompt_ids) == chat.usage.prompt_tokens
    chat_ids = extra(chat.choices[0], "token_ids")
    assert len(chat_ids) == 6 and decode(chat_ids) == chat.choices[0].message.content
    assert extra(chat_chunks[0], "prompt_token_ids") == chat_prompt_ids
    assert all(extra(chunk, "prompt_token_ids") is None for chunk in chat_chunks[1:])
    assert [token_id for chunk in chat_chunks for choice in chunk.choices
            for token_id in extra(choice, "token_ids")] == chat_ids
    assert extra(pair, "prompt_token_ids") == chat_prompt_ids  # n shares one prompt
    assert [extra(choice, "token_ids") for choice in pair.choices] == [chat_ids, chat_ids]
    assert extra(plain.choices[0], "token_ids") is None
    assert extra(plain.choices[0], "prompt_token_ids") is None


async def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id() -> None:
    asked = {"max_tokens": 5, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    by_id = {"max_tokens": 5, "temperature": 0.0,
             "extra_body": {"ignore_eos": True, "return_token_ids": True,
                            "return_tokens_as_token_ids": True}}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine, openai_client(engine) as client:
            named = await client.completions.create(model="tiny", prompt="Once", logprobs=2,
                                                    **asked)
            numbered = await client.completions.create(model="tiny", prompt="Once", logprobs=2,
                                                       **by_id)
            chat_named = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=2, **asked)
            chat_numbered = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=2, **by_id)
    labels = [f"token_id:{token_id}" for token_id in extra(numbered.choices[0], "token_ids")]
    named_logprobs, numbered_logprobs = named.choices[0].logprobs, numbered.choices[0].logprobs
    assert named_logprobs is not None and numbered_logprobs is not None
    assert numbered_logprobs.tokens == labels
    assert numbered_logprobs.text_offset == named_logprobs.text_offset  # of the text
    assert numbered_logprobs.token_logprobs == named_logprobs.token_logprobs
    assert all(label in top and all(key.startswith("token_id:") for key in top)
               for label, top in zip(labels, numbered_logprobs.top_logprobs or [], strict=True))
    chat_labels = [f"token_id:{token_id}"
                   for token_id in extra(chat_numbered.choices[0], "token_ids")]
    chat_named_logprobs = chat_named.choices[0].logprobs
    chat_numbered_logprobs = chat_numbered.choices[0].logprobs
    assert chat_named_logprobs is not None and chat_numbered_logprobs is not None
    named_content = chat_named_logprobs.content or []
    numbered_content = chat_numbered_logprobs.content or []
    assert [entry.token for entry in numbered_content] == chat_labels
    assert [entry.bytes for entry in numbered_content] == [entry.bytes for entry in named_content]
    assert all(top.token.startswith("token_id:")
               for entry in numbered_content for top in entry.top_logprobs)


async def test_a_refused_fields_default_or_null_is_accepted() -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with openai_client(engine) as client:
            response = await client.chat.completions.create(
                model="fake-model", messages=MESSAGES, max_tokens=2, store=False,
                modalities=["text"], service_tier="auto",
                extra_body={"use_beam_search": False, "length_penalty": 1.0,
                            "add_special_tokens": False, "request_id": None,
                            "prompt_cache_key": "k", "metadata": {"a": "b"}})
    assert response.choices[0].finish_reason == "length"


async def test_a_field_of_neither_schema_is_ignored_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with openai_client(engine) as client:
            with caplog.at_level(logging.WARNING, logger="trio_llm.api.request_fields"):
                response = await client.completions.create(
                    model="fake-model", prompt="x", max_tokens=2,
                    extra_body={"my_extension": 1, "another": {"x": 1}})
    assert response.choices[0].finish_reason == "length"
    warnings = [record.getMessage() for record in caplog.records
                if record.name == "trio_llm.api.request_fields"]
    assert warnings == ["The following fields were present in the request but ignored: "
                        "another, my_extension"]


# -- the chat template's options ----------------------------------------------------------


def _tokenizer(template: str = TEMPLATE) -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("tiny"), chat_template=template)


def test_the_template_options_render_as_transformers_does() -> None:
    tokenizer = _tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    assert tokenizer.apply_chat_template(messages) == "user: hi END\nassistant: Sure,  END\n" \
        "assistant:"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "user: hi END\nassistant: Sure,  END\n")
    # continued: the text stops where the last message does, its end of turn cut
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                         continue_final_message=True) == (
        "user: hi END\nassistant: Sure, ")
    documents = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    assert tokenizer.apply_chat_template(messages[:1], documents=documents).startswith(
        "DOCS a,b\n")


def test_chat_template_flag_takes_a_file_or_the_template_inline(tmp_path: Path) -> None:
    from trio_llm.actors.tokenizer import load_chat_template

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    from trio_llm.api.cli import _build_parser, engine_config_from_args

    args = _build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match="neither a file"):
        engine_config_from_args(args)


async def test_template_options_over_http_reach_the_engine_chat_template() -> None:
    config = replace(CONFIG, chat_template=TEMPLATE)
    tokenizer = _tokenizer()

    def num_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    prefilled = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    documents = [{"title": "a", "text": "x"}]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine, openai_client(engine) as client:
            async def prompt_tokens(messages: list[dict[str, str]], **extra: Any) -> int:
                response = await client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=1,  # type: ignore[arg-type]
                    extra_body=extra)
                assert response.usage is not None
                return response.usage.prompt_tokens

            counts = {
                "default": await prompt_tokens(MESSAGES),
                "no generation prompt": await prompt_tokens(MESSAGES,
                                                            add_generation_prompt=False),
                "continued": await prompt_tokens(prefilled, continue_final_message=True),
                "documents": await prompt_tokens(MESSAGES, documents=documents),
            }
            async with httpx.AsyncClient(base_url=str(client.base_url).removesuffix("/v1/")
                                         ) as http:
                tokenized = (await http.post("/tokenize", json={
                    "messages": prefilled, "continue_final_message": True,
                    "documents": documents})).json()
            both = await refusal(client.chat.completions.create(
                model="tiny", messages=prefilled, max_tokens=1,  # type: ignore[arg-type]
                extra_body={"continue_final_message": True, "add_generation_prompt": True}))
    assert counts == {
        "default": num_tokens("user: hi END\nassistant:"),
        "no generation prompt": num_tokens("user: hi END\n"),
        "continued": num_tokens("user: hi END\nassistant: Sure"),
        "documents": num_tokens("DOCS a\nuser: hi END\nassistant:"),
    }
    assert both["param"] == "continue_final_message"
    # /tokenize renders a conversation with the same fields (vLLM's)
    assert tokenized["tokens"] == tokenizer.encode("DOCS a\nuser: hi END\nassistant: Sure",
                                                   add_special_tokens=False)


# -- defaults from the checkpoint, --max-logprobs -----------------------------------------


def _write_generation_config(directory: Path, **fields: Any) -> None:
    (directory / "generation_config.json").write_text(json.dumps(fields))


def test_generation_config_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    _write_generation_config(tmp_path, temperature=0.6, top_p=0.95, top_k=20,
                             repetition_penalty=1.1, max_new_tokens=64, eos_token_id=[1, 2])
    defaults = read_generation_defaults("auto", tmp_path)
    assert defaults == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20,
                                          repetition_penalty=1.1, max_tokens=64)
    assert read_generation_defaults("vllm", tmp_path) == GenerationDefaults()
    assert read_generation_defaults(str(tmp_path), "/nowhere") == defaults
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        read_generation_defaults(str(tmp_path / "empty"), tmp_path)
    # transformers' own defaults are no recommendation (vLLM drops them too)
    _write_generation_config(tmp_path, temperature=1.0, top_k=50, top_p=1.0)
    assert read_generation_defaults("auto", tmp_path) == GenerationDefaults()
    params = defaults.sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        0.6, 0.95, 20, 64)
    assert defaults.capped_max_tokens(None) == 64 and defaults.capped_max_tokens(100) == 64
    assert defaults.capped_max_tokens(10) == 10


async def test_generation_config_defaults_fill_what_a_request_leaves_out(
        tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-with-defaults"
    shutil.copytree(resolve_model("tiny"), model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    _write_generation_config(model_dir, **generation, temperature=0.0, max_new_tokens=3)
    with trio.fail_after(TIMEOUT):
        async with Engine.open(replace(CONFIG, model=str(model_dir))) as engine:
            assert engine.default_sampling_params().temperature == 0.0
            async with openai_client(engine) as client:
                chat = await client.chat.completions.create(model=str(model_dir),
                                                            messages=MESSAGES)  # type: ignore
                capped = await client.completions.create(model=str(model_dir), prompt="a b",
                                                         max_tokens=10)
                greedy = [await client.completions.create(
                    model=str(model_dir), prompt="a b", max_tokens=2, seed=seed)
                    for seed in (1, 2)]
                hot = await client.completions.create(
                    model=str(model_dir), prompt="a b", max_tokens=3, temperature=1.0)
        async with Engine.open(replace(CONFIG, model=str(model_dir),
                                       generation_config="vllm")) as engine:
            assert engine.default_sampling_params() == SamplingParams()
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    assert capped.usage is not None and capped.usage.completion_tokens == 3
    # temperature 0 from the checkpoint: greedy, whatever the seed
    assert greedy[0].choices[0].text == greedy[1].choices[0].text
    assert hot.usage is not None and hot.usage.completion_tokens == 3


async def test_max_logprobs_bounds_what_a_request_may_ask() -> None:
    with trio.fail_after(TIMEOUT):
        async with Engine.open(replace(CONFIG, max_logprobs=2)) as engine:
            async with openai_client(engine) as client:
                allowed = await client.completions.create(model="tiny", prompt="a", max_tokens=1,
                                                          logprobs=2)
                over = await refusal(client.completions.create(model="tiny", prompt="a",
                                                               max_tokens=1, logprobs=3))
        async with Engine.open(replace(CONFIG, max_logprobs=-1)) as engine:
            async with openai_client(engine) as client:
                many = await client.completions.create(model="tiny", prompt="a", max_tokens=1,
                                                       logprobs=30)
    assert allowed.choices[0].logprobs is not None
    assert "greater than max allowed: 2" in over["message"] and over["param"] == "logprobs"
    top = many.choices[0].logprobs
    assert top is not None and top.top_logprobs is not None
    # over the default cap of 20 (tokens that decode alike share one key of the dict)
    assert len(top.top_logprobs[0]) > 20


# -- CORS, the log lines --------------------------------------------------------------------


async def test_cors_is_off_by_default_and_follows_allowed_origins() -> None:
    origin = {"Origin": "https://app.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url, httpx.AsyncClient(base_url=url) as http:
            off = await http.get("/v1/models", headers=origin)
        async with running_server(FakeEngine(), allowed_origins=["https://app.example"],
                                  api_key="k") as url, httpx.AsyncClient(base_url=url) as http:
            allowed = await http.get("/v1/models", headers={**origin,
                                                            "Authorization": "Bearer k"})
            other = await http.get("/v1/models", headers={"Origin": "https://evil.example",
                                                          "Authorization": "Bearer k"})
            options = await http.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers
    # a preflight carries no credentials: it is answered, API key or not
    assert options.status_code == 200
    assert options.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in options.headers["access-control-allow-methods"] or (
        options.headers["access-control-allow-methods"] == "*")


async def test_a_log_line_per_request_unless_disabled(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(TIMEOUT), caplog.at_level(logging.INFO, logger="trio_llm.requests"):
        async with openai_client(FakeEngine()) as client:
            await client.completions.create(model="fake-model", prompt="ab", max_tokens=3)
            stream = await client.completions.create(model="fake-model", prompt="ab",
                                                     max_tokens=2, stream=True)
            async for _ in stream:
                pass
            await refusal(client.completions.create(model="fake-model", prompt="x",
                                                    max_tokens=2, extra_body={"min_tokens": 5}))
        lines = [record.getMessage() for record in caplog.records
                 if record.name == "trio_llm.requests"]
        caplog.clear()
        async with openai_client(FakeEngine(), disable_log_requests=True) as client:
            await client.completions.create(model="fake-model", prompt="ab", max_tokens=3)
        quiet = [record for record in caplog.records if record.name == "trio_llm.requests"]
    assert len(lines) == 3
    assert lines[0].startswith("POST /v1/completions 200 cmpl-")
    assert "finished (length), 2 prompt + 3 output tokens" in lines[0]
    assert "2 prompt + 2 output tokens" in lines[1]
    assert lines[2].startswith("POST /v1/completions 400 -: min_tokens")
    assert quiet == []


class Snapshot:
    def __init__(self, **counts: float) -> None:
        self.num_running, self.num_waiting = int(counts.get("running", 0)), 0
        self.kv_cache_usage = counts.get("kv", 0.0)
        self.num_prompt_tokens = int(counts.get("prompt", 0))
        self.num_generation_tokens = int(counts.get("generated", 0))
        self.num_prefix_cache_queries = int(counts.get("queries", 0))
        self.num_prefix_cache_hits = int(counts.get("hits", 0))


def test_the_stats_line_is_vllms_and_quiet_when_idle() -> None:
    line = StatsLine(Snapshot(), now=0.0)
    level, text = line.next(Snapshot(running=2, kv=0.25, prompt=100, generated=50, queries=80,
                                     hits=20), now=10.0)
    assert level == logging.INFO
    assert text == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: "
                    "5.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%")
    # the first idle interval after work is still told; then it goes quiet (DEBUG)
    idle = Snapshot(prompt=100, generated=50, queries=80, hits=20)
    assert line.next(idle, now=20.0)[0] == logging.INFO
    assert line.next(idle, now=30.0)[0] == logging.DEBUG


def test_a_line_after_the_counters_restart_counts_from_zero() -> None:
    """The warm-up's end zeroes the engine's totals: the line after counts what grew
    since then, never a negative rate."""
    line = StatsLine(Snapshot(prompt=900, generated=500, queries=900, hits=700), now=0.0)
    _, text = line.next(Snapshot(prompt=40, generated=20, queries=40, hits=10), now=10.0)
    assert text.startswith("Avg prompt throughput: 4.0 tokens/s, "
                           "Avg generation throughput: 2.0 tokens/s")
    assert text.endswith("Prefix cache hit rate: 25.0%")


async def test_stats_are_logged_every_interval(autojump_clock: trio.testing.MockClock,
                                               caplog: pytest.LogCaptureFixture) -> None:
    counts = {"generated": 0}

    async def fetch() -> Snapshot:
        counts["generated"] += 30
        return Snapshot(generated=counts["generated"])

    with caplog.at_level(logging.INFO, logger="trio_llm.stats"):
        with trio.move_on_after(16.0):
            await log_stats_every(5.0, fetch)
    lines = [record.getMessage() for record in caplog.records if record.name == "trio_llm.stats"]
    assert len(lines) == 3  # at 5, 10 and 15 s
    assert all("Avg generation throughput: 6.0 tokens/s" in line for line in lines)


# -- the command line -------------------------------------------------------------------------


def test_serve_takes_the_model_positionally_and_its_own_log_level() -> None:
    from trio_llm.api.cli import _build_parser, engine_config_from_args, server_config_from_args

    parser = _build_parser()
    args = parser.parse_args(["serve", "tiny", "--log-level", "debug", "--root-path", "/llm",
                              "--allowed-origins", '["https://a.example"]',
                              "--disable-log-requests", "--log-stats-interval", "2",
                              "--uvicorn-log-level", "warning", "--generation-config", "vllm",
                              "--max-logprobs", "5"])
    config, server = engine_config_from_args(args), server_config_from_args(args)
    assert (config.model, config.generation_config, config.max_logprobs) == ("tiny", "vllm", 5)
    assert args.command_log_level == "debug"
    assert (server.root_path, server.allowed_origins, server.disable_log_requests) == (
        "/llm", ["https://a.example"], True)
    assert (server.log_stats_interval, server.uvicorn_log_level) == (2.0, "warning")
    comma = parser.parse_args(["serve", "--allowed-origins", "https://a.example, https://b"])
    assert server_config_from_args(comma).allowed_origins == ["https://a.example", "https://b"]
    twice = parser.parse_args(["serve", "tiny", "--model", "qwen3-0.6b"])
    with pytest.raises(SystemExit, match="given twice"):
        engine_config_from_args(twice)
    assert isinstance(args, argparse.Namespace)


def test_intake_renders_template_options_into_the_prompt() -> None:
    from trio_llm.actors.intake import Intake

    tokenizer = _tokenizer()
    intake = Intake(EngineConfig(), tokenizer, max_model_len=256, num_kv_tokens=1024,
                    vocab_size=tokenizer.vocab_size)
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    request = intake.admit(Submit(
        request_id="r", messages=messages, params=SamplingParams(), arrival_time=0.0,
        template_options=ChatTemplateOptions(add_generation_prompt=False,
                                             continue_final_message=True)))
    assert tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False) == (
        "user: hi END\nassistant: Sure")


async def test_root_path_serves_behind_a_proxy_that_strips_it_and_without_one() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(), root_path="/llm/") as url, \
                httpx.AsyncClient(base_url=url) as http:
            stripped = await http.get("/v1/models")
            prefixed = await http.get("/llm/v1/models")
            elsewhere = await http.get("/other/v1/models")
    assert stripped.status_code == prefixed.status_code == 200
    assert stripped.json()["data"][0]["id"] == "fake-model"
    assert elsewhere.status_code == 404


def test_a_model_id_not_in_the_cache_is_one_line_saying_where_it_looked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    from trio_llm.api.cli import _build_parser, engine_config_from_args

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = _build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--revision", "main"])
    with pytest.raises(SystemExit) as raised:
        engine_config_from_args(args)
    message = str(raised.value)
    assert message.startswith("trio-llm: model 'Qwen/Qwen3-0.6B' at revision 'main' is not "
                              f"in the local Hugging Face cache ({tmp_path}")
    assert "hf download Qwen/Qwen3-0.6B" in message
