"""The Qwen3.5 family's chat over HTTP, through the official `openai` client: its
chat template (tests/data/qwen35_chat_template.jinja behaves as the published one
does) with thinking on and off, the qwen3 reasoning parser, the qwen3_coder tool-call
parser, streamed and not, and image parts refused. The tiny model has random weights:
a grammar (structured outputs) makes it write what the family writes."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from test_http_support import openai_clients, running_server, serve_process

from trio_llm.actors.config import EngineConfig
from trio_llm.api.engine import Engine
from trio_llm.gpu.builtin import resolve_model

TIMEOUT = 180
TEMPLATE = Path(__file__).parent / "data" / "qwen35_chat_template.jinja"
SERVING = {"enable_auto_tool_choice": True, "tool_call_parser": "qwen3_coder",
           "reasoning_parser": "qwen3"}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}}}}]
# Thinking on: the prompt opened <think>, so the output starts inside it.
THINK_THEN_CALL = (r'root ::= [a-z ]{3,20} "\n</think>\n\n<tool_call>\n<function=get_weather>'
                   r'\n<parameter=city>\n" [A-Z] [a-z]{1,7} "\n</parameter>\n<parameter=days>\n"'
                   r' [1-7] "\n</parameter>\n</function>\n</tool_call>"')
PLAIN_ANSWER = r'root ::= [a-z]{1,8} " " [a-z]{1,8}'


@asynccontextmanager
async def qwen35_clients(tmp_path: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI,
                                                                 openai.OpenAI, str]]:
    """The tiny model with the Qwen3.5-style template, served with the family's parsers."""
    model_dir = tmp_path / "tiny-qwen35"
    shutil.copytree(resolve_model("tiny"), model_dir)
    shutil.copy(TEMPLATE, model_dir / "chat_template.jinja")
    config = EngineConfig(model=str(model_dir), served_model_name="tiny-qwen35",
                          num_kv_blocks=256, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=512, max_model_len=1024)
    async with (Engine.open(config) as engine, running_server(engine, **SERVING) as url,
                openai_clients(url) as (client, sync_client)):
        yield client, sync_client, url


async def stream_chat(sync_client: openai.OpenAI, **fields: Any) -> list[Any]:
    def read() -> list[Any]:
        with sync_client.chat.completions.create(stream=True, **fields) as stream:
            return list(stream)

    return await trio.to_thread.run_sync(read)


def reassembled(chunks: list[Any]) -> dict[str, Any]:
    """The message a client puts together from the stream's deltas."""
    message: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            message["finish"] = choice.finish_reason or message["finish"]
            message["reasoning"] += getattr(choice.delta, "reasoning_content", None) or ""
            message["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    message["calls"][call.index] = [call.function.name, ""]
                message["calls"][call.index][1] += call.function.arguments or ""
    return message


def whole(response: Any) -> dict[str, Any]:
    choice = response.choices[0]
    message = choice.message
    return {"reasoning": getattr(message, "reasoning_content", None) or "",
            "content": message.content or "",
            "calls": {index: [call.function.name, call.function.arguments]
                      for index, call in enumerate(message.tool_calls or [])},
            "finish": choice.finish_reason}


async def prompt_text(url: str, response: Any) -> str:
    """The prompt the chat template rendered for ``response`` (return_token_ids)."""
    async with httpx.AsyncClient(base_url=url) as http:
        reply = await http.post("/detokenize", json={"tokens": response.prompt_token_ids})
    return str(reply.json()["prompt"])


async def test_thinking_on_then_a_tool_call_streamed_or_not(tmp_path: Path) -> None:
    fields: dict[str, Any] = {
        "model": "tiny-qwen35", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200,
        "temperature": 1.0, "seed": 7,
        "extra_body": {"structured_outputs": {"grammar": THINK_THEN_CALL},
                       "return_token_ids": True}}
    with trio.fail_after(TIMEOUT):
        async with qwen35_clients(tmp_path) as (client, sync_client, url):
            response = await client.chat.completions.create(**fields)
            chunks = await stream_chat(sync_client, **fields)
            prompt = await prompt_text(url, response)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n"), "thinking is on by default"
    tools_listed = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["parameters"] for line in tools_listed] == [
        tool["function"]["parameters"] for tool in TOOLS]
    message = whole(response)
    assert message["finish"] == "tool_calls"
    assert message["reasoning"].endswith("\n") and 4 <= len(message["reasoning"]) <= 21
    assert set(message["reasoning"]) <= set("abcdefghijklmnopqrstuvwxyz \n")
    assert response.choices[0].message.content is None, "only blank text before the call"
    ((name, arguments),) = message["calls"].values()
    parsed = json.loads(arguments)
    assert name == "get_weather" and set(parsed) == {"city", "days"}
    assert parsed["city"].isalpha() and parsed["city"][0].isupper()
    assert isinstance(parsed["days"], int) and 1 <= parsed["days"] <= 7, "typed by the schema"
    assert reassembled(chunks) == message


async def test_thinking_off_and_cut_off_thinking(tmp_path: Path) -> None:
    base: dict[str, Any] = {"model": "tiny-qwen35", "messages": MESSAGES, "temperature": 1.0,
                            "seed": 3}
    off: dict[str, Any] = {**base, "max_tokens": 40, "extra_body": {
        "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True,
        "structured_outputs": {"grammar": PLAIN_ANSWER}}}
    cut: dict[str, Any] = {**base, "max_tokens": 6, "extra_body": {
        "structured_outputs": {"grammar": r"root ::= [a-z ]{30,40}"}}}
    with trio.fail_after(TIMEOUT):
        async with qwen35_clients(tmp_path) as (client, sync_client, url):
            answer = await client.chat.completions.create(**off)
            answer_chunks = await stream_chat(sync_client, **off)
            prompt = await prompt_text(url, answer)
            thinking = await client.chat.completions.create(**cut)
            thinking_chunks = await stream_chat(sync_client, **cut)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = whole(answer)
    assert message["reasoning"] == "" and message["calls"] == {}
    first, second = message["content"].split(" ")
    assert first.isalpha() and second.isalpha()
    assert reassembled(answer_chunks) == message
    # thinking on, cut off by max_tokens inside the think block: all reasoning
    cut_off = whole(thinking)
    assert cut_off["finish"] == "length" and thinking.choices[0].message.content is None
    assert len(cut_off["reasoning"]) >= 6 and not cut_off["reasoning"].strip(
        "abcdefghijklmnopqrstuvwxyz ")
    assert reassembled(thinking_chunks) == cut_off


async def test_responses_split_reasoning_and_a_call(tmp_path: Path) -> None:
    tools = [{"type": "function", "name": tool["function"]["name"],
              "parameters": tool["function"]["parameters"]} for tool in TOOLS]
    fields: dict[str, Any] = {
        "model": "tiny-qwen35", "input": MESSAGES, "tools": tools, "max_output_tokens": 200,
        "temperature": 1.0, "extra_body": {"structured_outputs": {"grammar": THINK_THEN_CALL},
                                           "seed": 7}}
    thinking_off: dict[str, Any] = {
        "model": "tiny-qwen35", "input": MESSAGES, "max_output_tokens": 40,
        "temperature": 1.0, "extra_body": {
            "structured_outputs": {"grammar": PLAIN_ANSWER}, "seed": 7,
            "chat_template_kwargs": {"enable_thinking": False}}}
    with trio.fail_after(TIMEOUT):
        async with qwen35_clients(tmp_path) as (client, _, _):
            response = await client.responses.create(**fields)
            answer = await client.responses.create(**thinking_off)
    (message,) = answer.output
    assert message.type == "message" and len(answer.output_text.split(" ")) == 2
    assert answer.usage is not None and answer.usage.output_tokens_details.reasoning_tokens == 0
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    assert reasoning.content and reasoning.content[0].text.endswith("\n")
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["days"], int)
    usage = response.usage
    assert usage is not None
    reasoning_tokens = usage.output_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < usage.output_tokens, "counted up to </think> only"


async def test_the_served_layout_splits_reasoning_as_one_process_does() -> None:
    # the API servers learn where the prompt left the think block from the prompt's
    # token ids, which cross from the engine core with the first output
    fields: dict[str, Any] = {
        "model": "tiny", "messages": MESSAGES, "max_tokens": 60, "temperature": 1.0,
        "seed": 5, "extra_body": {"structured_outputs": {
            "grammar": r'root ::= [a-z ]{3,20} "\n</think>\n\n" [a-z]{1,8}'}}}
    flags = ("--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3")
    with trio.fail_after(TIMEOUT):
        async with (serve_process(*flags, num_api_servers=2) as server,
                    openai_clients(server.url) as (client, sync_client)):
            response = await client.chat.completions.create(**fields)
            chunks = await stream_chat(sync_client, **fields)
    message = whole(response)
    assert message["reasoning"].endswith("\n") and "</think>" not in message["reasoning"]
    assert message["content"].startswith("\n\n") and message["content"].strip().isalpha()
    assert reassembled(chunks) == message


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("stream", [False, True])
async def test_image_parts_are_refused_saying_why(tmp_path: Path, stream: bool) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             IMAGE]}]
    refusals = []
    with trio.fail_after(TIMEOUT):
        async with qwen35_clients(tmp_path) as (client, _, url):
            with pytest.raises(openai.BadRequestError) as chat:
                await client.chat.completions.create(model="tiny-qwen35", messages=messages,
                                                     max_tokens=4, stream=stream)
            refusals.append((chat.value.body, "messages[0].content[1]"))
            with pytest.raises(openai.BadRequestError) as responses:
                await client.responses.create(model="tiny-qwen35", stream=stream, input=[
                    {"role": "user", "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": IMAGE["image_url"]["url"]}]}])
            refusals.append((responses.value.body, "input[0].content[1]"))
            async with httpx.AsyncClient(base_url=url) as http:
                tokenize = await http.post("/tokenize", json={"messages": messages})
            refusals.append((tokenize.json()["error"], "messages[0].content[1]"))
    assert tokenize.status_code == 400
    for body, param in refusals:
        assert isinstance(body, dict) and body["param"] == param
        assert body["message"].startswith("image inputs are not supported: trio-llm serves "
                                          "the text model only"), body
