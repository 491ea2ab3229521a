"""Structured outputs, tool calls and reasoning over HTTP, through the official `openai`
client, on the tiny model (random weights: every valid document and call below is the
constraints' doing). Streams are read by the sync client in a worker thread, as in
test_http_openai.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
import trio
from msgspec.structs import replace
from test_http_support import openai_clients, running_server

from trio_llm.actors.config import EngineConfig
from trio_llm.api.engine import Engine
from trio_llm.gpu.builtin import resolve_model

CONFIG = EngineConfig(model="tiny", num_kv_blocks=128, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=256, max_model_len=512)
TIMEOUT = 180
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    admin: bool


@asynccontextmanager
async def clients(config: EngineConfig = CONFIG, **server_options: Any
                  ) -> AsyncIterator[tuple[openai.AsyncOpenAI, openai.OpenAI]]:
    async with (Engine.open(config) as engine, running_server(engine, **server_options) as url,
                openai_clients(url) as pair):
        yield pair


async def stream_chat(sync_client: openai.OpenAI, **fields: Any) -> list[Any]:
    def read() -> list[Any]:
        with sync_client.chat.completions.create(stream=True, **fields) as stream:
            return list(stream)

    return await trio.to_thread.run_sync(read)


def reassembled_calls(chunks: list[Any]) -> list[tuple[str, str]]:
    """(name, arguments) per call, put together from streamed deltas as clients do."""
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index not in ids, "one id per call, in its first delta"
                    ids[delta.index] = delta.id
                    assert delta.function.name and delta.type == "function"
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


def finish_reasons(chunks: list[Any]) -> list[str]:
    return [choice.finish_reason for chunk in chunks for choice in chunk.choices
            if choice.finish_reason is not None]


async def test_response_format_and_structured_outputs_on_both_endpoints() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 50},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}
    fields: dict[str, Any] = {"model": "tiny", "temperature": 1.0, "max_tokens": 60}
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, sync_client):
            by_schema = await client.chat.completions.create(
                messages=MESSAGES, seed=1, response_format={  # type: ignore[arg-type]
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": schema, "strict": True}},
                **fields)
            streamed = await stream_chat(
                sync_client, messages=MESSAGES, seed=1, response_format={
                    "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
                **fields)
            parsed = await client.chat.completions.parse(
                messages=MESSAGES, seed=2, response_format=Person, **fields)  # type: ignore[arg-type]
            choice = await client.chat.completions.create(
                messages=MESSAGES, seed=3, extra_body={"structured_outputs": {
                    "choice": ["sunny", "rainy"]}}, **fields)  # type: ignore[arg-type]
            regex = await client.completions.create(
                prompt="Code:", seed=4, extra_body={"structured_outputs": {
                    "regex": "[A-Z]{3}-[0-9]{2}"}}, **fields)
            streamed_completion = await trio.to_thread.run_sync(lambda: list(
                sync_client.completions.create(
                    prompt="Code:", seed=4, stream=True, extra_body={"structured_outputs": {
                        "regex": "[A-Z]{3}-[0-9]{2}"}}, **fields)))
            completion_schema = await client.completions.create(
                prompt="Data:", seed=6, extra_body={"response_format": {
                    "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                **fields)
    message = by_schema.choices[0].message
    assert by_schema.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content or ""), schema)
    streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed
                            if chunk.choices)
    assert streamed_text == message.content, "same seed: the same document, streamed"
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    assert choice.choices[0].message.content in ("sunny", "rainy")
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    assert "".join(chunk.choices[0].text for chunk in streamed_completion
                   if chunk.choices) == regex.choices[0].text
    jsonschema.validate(json.loads(completion_schema.choices[0].text), schema)


async def test_bad_constraints_are_a_400_naming_the_problem() -> None:
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, _):
            errors = []
            for body in ({"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "x",
                                                              "schema": {"type": "objec"}}}},
                         {"structured_outputs": {"regex": "(unclosed"}},
                         {"structured_outputs": {"regex": "a", "choice": ["b"]}},
                         {"structured_outputs": {"jsn": {}}},
                         {"response_format": {"type": "json_schema"}},
                         {"structured_outputs": {"choice": ["a"]},
                          "response_format": {"type": "json_object"}}):
                try:
                    await client.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=4,  # type: ignore[arg-type]
                        extra_body=body)
                except openai.BadRequestError as error:
                    errors.append(error.body)
            fine = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                extra_body={"structured_outputs": {"choice": ["still fine"]}})
    assert len(errors) == 6
    assert "objec" in errors[0]["message"]
    assert errors[0]["param"] == "structured_outputs"
    assert "(unclosed" in errors[1]["message"] or "paren" in errors[1]["message"].lower()
    assert "exactly one" in errors[2]["message"]
    assert "jsn" in errors[3]["message"]
    assert errors[4]["param"] == "response_format.json_schema.schema"
    assert "not both" in errors[5]["message"]
    assert fine.choices[0].message.content == "still fine"


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_tool_choice_yields_valid_calls_streamed_or_not(parallel: bool) -> None:
    fields: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                              "tool_choice": "required", "temperature": 1.0, "seed": 7,
                              "max_tokens": 120, "parallel_tool_calls": parallel}
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, sync_client):
            response = await client.chat.completions.create(**fields)
            chunks = await stream_chat(sync_client, **fields)
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    assert calls and (parallel or len(calls) == 1)
    # One call must end; parallel calls are an array the random model may go on
    # filling until max_tokens, whose last call is then cut short.
    assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length")
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
    assert choice.message.content is None
    assert reassembled_calls(chunks) == [(call.function.name, call.function.arguments)
                                         for call in calls]
    assert finish_reasons(chunks) == [choice.finish_reason]


async def test_named_tool_choice_yields_arguments_that_validate() -> None:
    fields: dict[str, Any] = {
        "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0,
        "max_tokens": 80, "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}}}
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, sync_client):
            responses = [await client.chat.completions.create(seed=seed, **fields)
                         for seed in range(4)]
            chunks = await stream_chat(sync_client, seed=0, **fields)
            unknown = None
            try:
                await client.chat.completions.create(seed=0, **{**fields, "tool_choice": {
                    "type": "function", "function": {"name": "nope"}}})
            except openai.BadRequestError as error:
                unknown = error.body
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    first = responses[0].choices[0].message.tool_calls[0]  # type: ignore[index]
    assert reassembled_calls(chunks) == [("get_weather", first.function.arguments)]
    assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls
                ]) > 2, "arguments arrive in fragments"
    assert unknown is not None and unknown["param"] == "tool_choice"


HERMES_CALL = (r'root ::= "Checking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": '
               r'{\"zone\": \"" ("UTC" | "CET") "\"}}\n</tool_call>"')


async def test_auto_tool_choice_parses_hermes_calls() -> None:
    fields: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                              "max_tokens": 80, "temperature": 1.0, "seed": 3}
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, _):
            refused = None
            try:
                await client.chat.completions.create(**fields)
            except openai.BadRequestError as error:
                refused = error.body
        async with clients(enable_auto_tool_choice=True,
                           tool_call_parser="hermes") as (client, sync_client):
            plain = await client.chat.completions.create(**fields)
            # the tiny model never writes a call by itself: a grammar makes it
            forced = {**fields, "extra_body": {"structured_outputs": {"grammar": HERMES_CALL}}}
            called = await client.chat.completions.create(**forced)
            chunks = await stream_chat(sync_client, **forced)
    assert refused is not None and "--enable-auto-tool-choice" in refused["message"]
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking.\n"
    (call,) = message.tool_calls or []
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    assert reassembled_calls(chunks) == [("get_time", call.function.arguments)]
    streamed_content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks
                               if chunk.choices)
    assert streamed_content == "Checking.\n"


THINKING = r'root ::= "<think>" [a-z ]{3,20} "</think>" [a-z]{1,8}'


async def test_the_qwen3_reasoning_parser_splits_thinking_streamed_or_not() -> None:
    fields: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60,
                              "temperature": 1.0, "seed": 5,
                              "extra_body": {"structured_outputs": {"grammar": THINKING}}}
    with trio.fail_after(TIMEOUT):
        async with clients(reasoning_parser="qwen3") as (client, sync_client):
            response = await client.chat.completions.create(**fields)
            chunks = await stream_chat(sync_client, **fields)
            raw = await client.chat.completions.with_raw_response.create(**fields)
    message = response.choices[0].message
    body = json.loads(raw.text)["choices"][0]["message"]
    assert body["reasoning_content"] == body["reasoning"]
    reasoning, content = body["reasoning_content"], message.content or ""
    assert 3 <= len(reasoning) <= 20 and set(reasoning) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert content.isalpha() and "<think>" not in content
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    streamed_reasoning = "".join(getattr(delta, "reasoning_content", None) or ""
                                 for delta in deltas)
    assert streamed_reasoning == reasoning
    assert "".join(delta.content or "" for delta in deltas) == content


TEMPLATE = ("{%- if tools %}{{ 'TOOLS ' + (tools | map(attribute='function') "
            "| map(attribute='name') | join(',')) + '\\n' }}{%- endif %}"
            "{%- for message in messages %}"
            "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
            "{%- endfor %}{%- if enable_thinking is defined and not enable_thinking %}"
            "{{ 'no thinking\\n' }}{%- endif %}assistant:")


async def test_tools_and_chat_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-with-tools"
    shutil.copytree(resolve_model("tiny"), model_dir)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    config = replace(CONFIG, model=str(model_dir))
    fields: dict[str, Any] = {"model": str(model_dir), "messages": MESSAGES, "max_tokens": 1}
    with trio.fail_after(TIMEOUT):
        async with clients(config) as (client, _):
            plain = await client.chat.completions.create(**fields)
            with_tools = await client.chat.completions.create(tools=TOOLS, tool_choice="none",
                                                              **fields)
            no_thinking = await client.chat.completions.create(
                extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **fields)
            refused = None
            try:
                await client.chat.completions.create(
                    extra_body={"chat_template_kwargs": {"messages": []}}, **fields)
            except openai.BadRequestError as error:
                refused = error.body
    assert plain.usage and with_tools.usage and no_thinking.usage
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert no_thinking.usage.prompt_tokens > plain.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None
    assert refused is not None and refused["param"] == "chat_template_kwargs"
