"""POST /v1/responses through the official `openai` client (``responses.create``,
``responses.stream``, ``responses.parse``) on the tiny model, whose random weights
write tool calls and thinking only when a grammar makes them (as in
test_http_structured.py); a scripted engine for disconnects and refusals. Streams
are read by the sync client in a worker thread, as in test_http_openai.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pydantic
import pytest
import trio
from msgspec.structs import replace
from test_http_openai import _wait_engine_idle, served_engine
from test_http_support import (
    FakeEngine,
    open_raw_request,
    openai_clients,
    receive_until,
    running_server,
    wait_until,
)

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.messages import RequestOutput, SamplingParams
from trio_llm.api.engine import Engine
from trio_llm.api.responses import ResponseBuilder
from trio_llm.api.responses_protocol import ResponseBody, ResponsesRequest, chat_translation
from trio_llm.api.tool_calls import ChatOutputParser
from trio_llm.gpu.builtin import resolve_model

CONFIG = EngineConfig(model="tiny", num_kv_blocks=128, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=256, max_model_len=512)
TIMEOUT = 180
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
         {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
HERMES_CALL = (r'root ::= "Checking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": '
               r'{\"zone\": \"" ("UTC" | "CET") "\"}}\n</tool_call>"')
THINKING = r'root ::= "<think>" [a-z ]{3,20} "</think>" [a-z]{1,8}'
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0.0,
                          "extra_body": {"ignore_eos": True}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)


@asynccontextmanager
async def clients(config: EngineConfig = CONFIG, **server_options: Any
                  ) -> AsyncIterator[tuple[openai.AsyncOpenAI, openai.OpenAI]]:
    async with (Engine.open(config) as engine, running_server(engine, **server_options) as url,
                openai_clients(url) as pair):
        yield pair


async def stream_events(sync_client: openai.OpenAI, **fields: Any) -> list[Any]:
    """Every event of a streamed ``responses.create``."""
    def read() -> list[Any]:
        with sync_client.responses.create(stream=True, **fields) as stream:
            return list(stream)

    return await trio.to_thread.run_sync(read)


def check_sequence(events: list[Any]) -> None:
    """Numbered from 0 without gaps; created and in_progress first; one end, last;
    every item added before its deltas and done after them."""
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created",
                                                    "response.in_progress"]
    ends = [event.type for event in events if event.type in (
        "response.completed", "response.incomplete", "response.failed")]
    assert len(ends) == 1 and events[-1].type == ends[0]
    opened: set[int] = set()
    done: set[int] = set()
    for event in events:
        index = getattr(event, "output_index", None)
        if event.type == "response.output_item.added":
            assert index not in opened
            opened.add(index)
        elif event.type == "response.output_item.done":
            done.add(index)
        elif index is not None:
            assert index in opened and index not in done, event.type
    assert opened == done


def deltas(events: list[Any], kind: str) -> str:
    return "".join(event.delta for event in events if event.type == kind)


@pytest.mark.parametrize("layout", ["in-process", "served"])
async def test_text_streamed_or_not_is_what_the_engine_generates(layout: str) -> None:
    fields: dict[str, Any] = {**GREEDY, "input": "Tell me a story.", "max_output_tokens": 8}
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served:
            # in the served layout, through another front than the server's
            expected = "".join([output.text async for output in served.engine.chat(
                [{"role": "user", "content": "Tell me a story."}],
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])
            async with openai_clients(served.url) as (client, sync_client):
                response = await client.responses.create(**fields)
                events = await stream_events(sync_client, **fields)
    assert response.output_text == expected and len(expected) > 0
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 8
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    check_sequence(events)
    assert len([event for event in events if event.type == "response.output_text.delta"]) > 1
    assert deltas(events, "response.output_text.delta") == expected
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.output_text == expected
    assert final.usage == response.usage
    types = [event.type for event in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]


@pytest.mark.parametrize("layout", ["in-process", "served"])
async def test_dropped_connections_free_their_kv_blocks(layout: str) -> None:
    """As on chat: a stream left after its first delta, and a whole response whose
    client went away, end their engine requests and free every block."""
    request = {"model": "tiny", "input": "Tell me a story.", "max_output_tokens": 200,
               "ignore_eos": True}
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served:
            engine, url = served.engine, served.url
            connection = await open_raw_request(url, "/v1/responses",
                                                {**request, "stream": True})
            await receive_until(connection, b"response.output_text.delta")
            assert (await engine.fetch_statistics()).num_running == 1
            await connection.aclose()
            await _wait_engine_idle(served)
            after_stream = await engine.fetch_statistics()
            connection = await open_raw_request(url, "/v1/responses", request)
            await wait_until(lambda: served.http_engine.num_open_requests == 1)
            await connection.aclose()
            await _wait_engine_idle(served)
            after_whole = await engine.fetch_statistics()
    for snapshot in (after_stream, after_whole):
        assert snapshot.num_running == 0
        assert snapshot.num_free_blocks == snapshot.num_total_blocks
    assert after_whole.num_generation_tokens < 200, "neither ran to its 200 tokens"


async def test_the_stream_helper_and_a_completed_response() -> None:
    fields: dict[str, Any] = {
        "model": "tiny", "input": "Pick one.", "max_output_tokens": 20, "temperature": 1.0,
        "extra_body": {"seed": 3, "structured_outputs": {"choice": ["sunny", "rainy"]}}}
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, sync_client):
            whole = await client.responses.create(**fields)

            def read() -> tuple[list[Any], Any]:
                with sync_client.responses.stream(**fields) as stream:
                    return list(stream), stream.get_final_response()

            events, final = await trio.to_thread.run_sync(read)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.output_text in ("sunny", "rainy")
    assert final.output_text == whole.output_text, "same seed: the same text, streamed"
    assert deltas(events, "response.output_text.delta") == whole.output_text
    check_sequence(events)
    assert events[-1].type == "response.completed"


async def test_the_same_conversation_gives_the_same_tokens_on_chat_and_responses() -> None:
    sampling: dict[str, Any] = {"model": "tiny", "temperature": 1.0, "top_p": 0.9}
    vllm_fields = {"seed": 11, "ignore_eos": True}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "developer", "content": "Answer in one word."},
                {"role": "user", "content": "Another?"}]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": "Another?"}]
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, _):
            chat = await client.chat.completions.create(
                messages=messages, max_completion_tokens=12,  # type: ignore[arg-type]
                extra_body={**vllm_fields, "return_token_ids": True}, **sampling)
            response = await client.responses.create(
                instructions="Be brief.", input=items, max_output_tokens=12,  # type: ignore[arg-type]
                extra_body=vllm_fields, **sampling)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.temperature == 1.0 and response.top_p == 0.9


async def test_logprobs_of_the_message_are_chats() -> None:
    question = "Name a colour."
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, sync_client):
            chat = await client.chat.completions.create(
                messages=[{"role": "user", "content": question}], max_tokens=6,
                logprobs=True, top_logprobs=2, **GREEDY)
            fields: dict[str, Any] = {**GREEDY, "input": question, "max_output_tokens": 6,
                                      "include": ["message.output_text.logprobs"],
                                      "top_logprobs": 2}
            response = await client.responses.create(**fields)
            events = await stream_events(sync_client, **fields)
        async with clients(reasoning_parser="qwen3") as (client, _):
            refused = None
            try:
                await client.responses.create(**fields)
            except openai.BadRequestError as error:
                refused = error.body
    expected = [(entry.token, entry.logprob, [(top.token, top.logprob)
                                              for top in entry.top_logprobs])
                for entry in chat.choices[0].logprobs.content]  # type: ignore[union-attr]
    (message,) = response.output
    part = message.content[0]  # type: ignore[union-attr]
    got = [(entry.token, entry.logprob, [(top.token, top.logprob) for top in entry.top_logprobs])
           for entry in part.logprobs]
    assert len(got) == 6 and got == expected
    streamed = [entry for event in events if event.type == "response.output_text.delta"
                for entry in event.logprobs]
    assert [(entry.token, entry.logprob) for entry in streamed] == [
        (token, logprob) for token, logprob, _ in expected]
    assert response.top_logprobs == 2
    assert refused is not None and refused["param"] == "include"


async def test_a_json_schema_output_validates_streamed_or_not() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 50}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    fields: dict[str, Any] = {
        "model": "tiny", "input": "Answer in JSON.", "max_output_tokens": 60,
        "temperature": 1.0, "extra_body": {"seed": 1},
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema,
                            "strict": True}}}
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, sync_client):
            response = await client.responses.create(**fields)
            events = await stream_events(sync_client, **fields)
            parsed = await client.responses.parse(
                model="tiny", input="Who?", max_output_tokens=60, text_format=Person,
                extra_body={"seed": 2})
            json_object = await client.responses.create(
                model="tiny", input="JSON!", max_output_tokens=60,
                text={"format": {"type": "json_object"}}, extra_body={"seed": 4})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format.type == "json_schema"
    assert deltas(events, "response.output_text.delta") == response.output_text
    assert isinstance(parsed.output_parsed, Person)
    # any JSON object, which random weights may not close within 60 tokens
    assert json_object.output_text.startswith("{")
    assert json_object.text is not None and json_object.text.format.type == "json_object"


TOOL_TEMPLATE = (
    "{%- if tools %}{{ 'TOOLS ' + (tools | map(attribute='function') "
    "| map(attribute='name') | join(',')) + '\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ ' CALL ' + call['id'] + ' ' + call['function']['name'] + ' ' "
    "+ (call['function']['arguments'] | tojson) }}{%- endfor %}"
    "{%- if message.tool_call_id %}{{ ' FOR ' + message.tool_call_id }}{%- endif %}"
    "{%- if message.reasoning_content %}{{ ' THOUGHT ' + message.reasoning_content }}"
    "{%- endif %}{{ '\\n' }}{%- endfor %}assistant:")


async def test_a_tool_loop_with_the_hermes_parser(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-with-tools"
    shutil.copytree(resolve_model("tiny"), model_dir)
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    config = replace(CONFIG, model=str(model_dir))
    question = {"role": "user", "content": "What time is it?"}
    forced: dict[str, Any] = {
        "model": str(model_dir), "input": [question], "tools": TOOLS, "max_output_tokens": 80,
        "temperature": 1.0, "extra_body": {"seed": 3, "structured_outputs": {
            "grammar": HERMES_CALL}}}
    with trio.fail_after(TIMEOUT):
        async with (Engine.open(config) as engine,
                    running_server(engine, enable_auto_tool_choice=True,
                                   tool_call_parser="hermes") as url,
                    openai_clients(url) as (client, sync_client)):
            called = await client.responses.create(**forced)
            events = await stream_events(sync_client, **forced)
            message, call = called.output
            assert call.type == "function_call"
            loop_input = [question, *[item.model_dump(exclude_none=True)
                                      for item in called.output],
                          {"type": "function_call_output", "call_id": call.call_id,
                           "output": "12:00"}]
            answer = await client.responses.create(
                model=str(model_dir), input=loop_input, tools=TOOLS,  # type: ignore[arg-type]
                max_output_tokens=6, **{k: v for k, v in GREEDY.items() if k != "model"})
            chat = await client.chat.completions.create(
                model=str(model_dir), max_tokens=6, messages=[  # type: ignore[arg-type]
                    question,
                    {"role": "assistant", "content": "Checking.\n", "tool_calls": [{
                        "id": call.call_id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}],
                tools=[{"type": "function", "function": {"name": tool["name"],
                                                         "parameters": tool["parameters"],
                                                         "strict": True}}
                       for tool in TOOLS],  # type: ignore[misc]
                **{k: v for k, v in GREEDY.items() if k != "model"})
            async with httpx.AsyncClient() as http_client:
                tokenized = (await http_client.post(f"{url}/tokenize", json={
                    "model": str(model_dir), "messages": [
                        question, {"role": "assistant", "content": "Checking.\n",
                                   "tool_calls": [{"id": call.call_id, "type": "function",
                                                   "function": {"name": call.name,
                                                                "arguments": call.arguments}}]},
                        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}],
                    "tools": [{"type": "function", "function": {
                        "name": tool["name"], "parameters": tool["parameters"],
                        "strict": True}} for tool in TOOLS]})).json()
    assert called.status == "completed"
    assert message.type == "message" and called.output_text == "Checking.\n"
    assert call.name == "get_time" and call.call_id.startswith("call_")
    assert call.id is not None and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TIME)
    check_sequence(events)
    streamed_calls = [event for event in events
                      if event.type == "response.function_call_arguments.done"]
    assert len(streamed_calls) == 1
    assert deltas(events, "response.function_call_arguments.delta") == call.arguments
    assert streamed_calls[0].arguments == call.arguments
    # the loop: the call and its output reach the template, as chat's would
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens == tokenized["count"]
    assert answer.output_text == chat.choices[0].message.content
    assert [item.type for item in answer.output] == ["message"]


async def test_required_and_named_tool_choice_give_valid_calls() -> None:
    fields: dict[str, Any] = {"model": "tiny", "input": "Weather?", "tools": TOOLS,
                              "max_output_tokens": 100, "temperature": 1.0,
                              "extra_body": {"seed": 7}}
    with trio.fail_after(TIMEOUT):
        async with clients() as (client, sync_client):
            required = await client.responses.create(tool_choice="required",
                                                     parallel_tool_calls=False, **fields)
            named = await client.responses.create(
                tool_choice={"type": "function", "name": "get_weather"}, **fields)
            events = await stream_events(
                sync_client, tool_choice={"type": "function", "name": "get_weather"}, **fields)
            none = await client.responses.create(tool_choice="none", **fields)
            refused = None
            try:
                await client.responses.create(**fields)
            except openai.BadRequestError as error:
                refused = error.body
    (call,) = required.output
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), {t["name"]: t["parameters"]
                                                     for t in TOOLS}[call.name])
    (named_call,) = named.output
    assert named_call.type == "function_call" and named_call.name == "get_weather"
    jsonschema.validate(json.loads(named_call.arguments), WEATHER)
    (streamed,) = [event.item for event in events if event.type == "response.output_item.done"]
    assert streamed.arguments == named_call.arguments, "same seed: the same call, streamed"
    assert [item.type for item in none.output] == ["message"]
    assert refused is not None and "--enable-auto-tool-choice" in refused["message"]


async def test_reasoning_items_with_the_qwen3_parser() -> None:
    fields: dict[str, Any] = {"model": "tiny", "input": "Think first.",
                              "max_output_tokens": 60, "temperature": 1.0,
                              "extra_body": {"seed": 5, "structured_outputs": {
                                  "grammar": THINKING}}}
    with trio.fail_after(TIMEOUT):
        async with clients(reasoning_parser="qwen3") as (client, sync_client):
            response = await client.responses.create(**fields)
            events = await stream_events(sync_client, **fields)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None
    (part,) = reasoning.content
    assert 3 <= len(part.text) <= 20 and set(part.text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert message.type == "message" and response.output_text.isalpha()
    assert "<think>" not in response.output_text
    usage = response.usage
    assert usage is not None
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    check_sequence(events)
    assert deltas(events, "response.reasoning_text.delta") == part.text
    (done,) = [event for event in events if event.type == "response.reasoning_text.done"]
    assert done.text == part.text
    assert deltas(events, "response.output_text.delta") == response.output_text
    types = [event.type for event in events]
    assert types.index("response.output_item.done") < types.index(
        "response.output_text.delta"), "the reasoning item closes before the message opens"


def test_input_items_become_the_chat_messages_they_mean() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    body = ResponsesRequest(instructions="Sys.", input=[
        {"role": "user", "content": "Q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}]},
        call, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "2"}]}])
    messages = chat_translation(body).messages()
    assert [message["role"] for message in messages] == ["system", "user", "assistant",
                                                         "tool", "tool"]
    assistant = messages[2]
    assert assistant["content"] == "Let me see." and assistant["reasoning_content"] == "hmm"
    assert [call["id"] for call in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {}
    assert messages[4] == {"role": "tool", "content": "2", "tool_call_id": "call_2"}
    only_calls = chat_translation(ResponsesRequest(input=[call])).messages()
    assert only_calls == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]
    with pytest.raises(RequestRejected) as refused:
        chat_translation(ResponsesRequest(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "x"}]}]))
    assert refused.value.param == "input[0].content[0]"


# -- the scripted engine: disconnects and refusals ----------------------------------------


async def test_a_client_leaving_a_stream_aborts_its_request() -> None:
    engine = FakeEngine(gated=True, max_model_len=256)
    with trio.fail_after(30):
        async with running_server(engine) as url:
            stream = await open_raw_request(url, "/v1/responses", {
                "model": "fake-model", "input": "hi", "stream": True, "max_output_tokens": 50})
            engine.allow_steps(3)
            received = await receive_until(stream, b"response.output_text.delta")
            assert received.startswith(b"HTTP/1.1 200")
            assert len(engine.running) == 1
            await stream.aclose()
            await wait_until(lambda: not engine.running)
    assert len(engine.aborted) == 1 and not engine.finished


async def test_a_streamed_response_reassembles_on_the_scripted_engine() -> None:
    engine = FakeEngine(max_model_len=256)
    with trio.fail_after(30):
        async with running_server(engine) as url, httpx.AsyncClient() as client:
            whole = (await client.post(f"{url}/v1/responses", json={
                "input": "hi", "max_output_tokens": 5, "instructions": "Be nice."})).json()
            streamed = await client.post(f"{url}/v1/responses", json={
                "input": "hi", "max_output_tokens": 5, "stream": True})
    assert whole["output"][0]["content"][0]["text"] == "abcde"
    assert whole["usage"]["output_tokens"] == 5 and whole["status"] == "incomplete"
    assert engine.submitted[0]["prompt"] == "<system>Be nice.<user>hi<assistant>"
    names = [line.removeprefix("event: ") for line in streamed.text.splitlines()
             if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
            if line.startswith("data: ")]
    assert names == [event["type"] for event in data]
    assert "".join(event["delta"] for event in data
                   if event["type"] == "response.output_text.delta") == "abcde"
    assert data[-1]["response"]["usage"]["total_tokens"] == data[-1]["response"]["usage"][
        "input_tokens"] + 5


async def test_an_engine_failure_mid_stream_ends_it_with_response_failed() -> None:
    engine = FakeEngine(max_model_len=256, fail_after_tokens=2)
    with trio.fail_after(30):
        async with running_server(engine) as url, httpx.AsyncClient() as client:
            streamed = await client.post(f"{url}/v1/responses", json={
                "input": "hi", "max_output_tokens": 5, "stream": True})
    data = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
            if line.startswith("data: ")]
    assert streamed.status_code == 200
    assert [event["sequence_number"] for event in data] == list(range(len(data)))
    assert data[-1]["type"] == "response.failed"
    failed = data[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "the engine died" in failed["error"]["message"]
    assert not engine.running


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"store": True}, "store", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]},
     "include[1]", "encrypted"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "chat_template_kwargs"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "reasoning_text"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"top_logprobs": 3}, "top_logprobs", "needs include"),
    ({"service_tier": "flex"}, "service_tier", "one service tier"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "built-in"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "allowed_tools"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]", "input_file"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
     "input[0].encrypted_content", "encrypted"),
    ({"input": []}, "input", "empty"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation", "padded"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "memory"),
    ({"context_management": [{"type": "compaction"}]}, "context_management", "compacted"),
    ({"request_id": "mine"}, "request_id", "names each response"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text", "needs text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "`$.input[0]`"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "`$.input[0].role`"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
     "tool_choice.name", "needs the name"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "schema"),
]


async def test_refused_fields_are_a_400_naming_them() -> None:
    engine = FakeEngine(max_model_len=256)
    errors = []
    with trio.fail_after(30):
        async with running_server(engine) as url, httpx.AsyncClient() as client:
            for fields, _, _ in REFUSED:
                answer = await client.post(f"{url}/v1/responses",
                                           json={"input": "hi", **fields})
                errors.append((answer.status_code, answer.json()["error"]))
            defaults = await client.post(f"{url}/v1/responses", json={
                "input": "hi", "max_output_tokens": 2, "store": False, "background": False,
                "previous_response_id": None, "include": [], "truncation": "disabled",
                "top_logprobs": 0, "service_tier": "auto", "user": "u", "metadata": {"a": "b"},
                "prompt_cache_key": "k", "safety_identifier": "s", "max_tool_calls": 3,
                "reasoning": {}, "prompt_cache_retention": "in_memory"})
    for (status, error), (fields, param, words) in zip(errors, REFUSED, strict=True):
        assert status == 400, fields
        assert error["param"] == param, (fields, error)
        assert words in error["message"], (fields, error)
    assert defaults.status_code == 200, defaults.text
    body = defaults.json()
    assert body["store"] is False and body["metadata"] == {"a": "b"}
    assert body["user"] == "u" and body["max_tool_calls"] == 3


def test_every_field_of_openais_request_schema_has_a_status() -> None:
    """Honoured (declared), refused, or without effect: none is silently ignored."""
    from typing import get_type_hints

    from openai.types.responses.response_create_params import (
        ResponseCreateParamsNonStreaming,
        ResponseCreateParamsStreaming,
    )

    from trio_llm.api.request_fields import NO_EFFECT_FIELDS
    from trio_llm.api.responses_protocol import REFUSED_RESPONSES_FIELDS

    openai_fields = (set(get_type_hints(ResponseCreateParamsStreaming))
                     | set(get_type_hints(ResponseCreateParamsNonStreaming)))
    known = (set(ResponsesRequest.__struct_fields__) | set(REFUSED_RESPONSES_FIELDS)
             | NO_EFFECT_FIELDS)
    assert openai_fields - known == set()
    assert {"input", "store", "previous_response_id", "tools"} <= openai_fields


THINK_THEN_CALL = ('<think>look it up</think>On it.<tool_call>\n{"name": "get_time", '
                   '"arguments": {"zone": "UTC"}}\n</tool_call><tool_call>\n{"name": '
                   '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def _builder() -> ResponseBuilder:
    from trio_llm.api.reasoning_parsers import Qwen3ReasoningParser
    from trio_llm.api.tool_parsers import HermesToolParser

    template = ResponseBody(id="resp_1", created_at=0, status="in_progress", model="m")
    parser = ChatOutputParser(reasoning=Qwen3ReasoningParser(), tools=HermesToolParser())
    return ResponseBuilder(template=template, parser=parser, token_text=lambda _: "x")


@pytest.mark.parametrize("chunk", [1, 3, 7, len(THINK_THEN_CALL)])
def test_streamed_items_are_the_whole_responses_whatever_the_chunks(chunk: int) -> None:
    """Reasoning, then a message, then two calls: the items the events build are
    the non-streamed response's, however the text arrives."""
    pieces = [THINK_THEN_CALL[start:start + chunk]
              for start in range(0, len(THINK_THEN_CALL), chunk)]
    outputs = [RequestOutput(request_id="r", token_ids=[1], text=piece,
                             finished=index == len(pieces) - 1,
                             finish_reason="stop" if index == len(pieces) - 1 else None,
                             num_prompt_tokens=3, num_output_tokens=index + 1)
               for index, piece in enumerate(pieces)]
    streamed, whole = _builder(), _builder()
    events = streamed.start()
    for output in outputs:
        events += streamed.feed(output)
        whole.add(output)
    response = msgspec.to_builtins(whole.response())
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    done = [msgspec.to_builtins(event["item"]) for event in events
            if event["type"] == "response.output_item.done"]
    final = msgspec.to_builtins(events[-1]["response"])
    assert events[-1]["type"] == "response.completed"
    without_ids = [{**item, "id": None, "call_id": None} for item in done]
    assert without_ids == [{**item, "id": None, "call_id": None}
                           for item in response["output"]]
    assert final["output"] == done
    assert [item["type"] for item in done] == ["reasoning", "message", "function_call",
                                               "function_call"]
    assert done[0]["content"] == [{"type": "reasoning_text", "text": "look it up"}]
    assert done[1]["content"][0]["text"] == "On it."
    assert [(item["name"], json.loads(item["arguments"])) for item in done[2:]] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]
    arguments = "".join(event["delta"] for event in events
                        if event["type"] == "response.function_call_arguments.delta")
    assert arguments == done[2]["arguments"] + done[3]["arguments"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
