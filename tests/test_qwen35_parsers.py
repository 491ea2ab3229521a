"""Chat output of the Qwen3.5 family as plain functions: the qwen3_coder tool-call
parser (XML calls, values typed by the tools' schemas) and the qwen3 reasoning parser
with the think block opened by the prompt (Qwen3.5's template, thinking on) or closed
in it (thinking off). Streamed through ChatBuilder cut every way, the deltas always
reassemble into exactly the non-streamed message."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from trio_llm.actors.messages import RequestOutput
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.api.cli import add_serve_arguments, server_config_from_args
from trio_llm.api.protocol import ChatBuilder, chat_messages, decode_request
from trio_llm.api.protocol import ChatCompletionRequest as Chat
from trio_llm.api.reasoning_parsers import Qwen3ReasoningParser
from trio_llm.api.tool_calls import (
    ChatOutputParser,
    ToolServingOptions,
    check_serving_options,
    plan_tool_calls,
)
from trio_llm.api.tool_parsers import Qwen3CoderToolParser
from trio_llm.gpu.builtin import resolve_model

TEMPLATE = Path(__file__).parent / "data" / "qwen35_chat_template.jinja"

SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "verbose": {"type": "boolean"},
        "options": {"type": "object"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "limit": {"type": ["integer", "null"]},
        "zone": {"enum": ["UTC", "CET"]}}},
    "get_time": {"type": "object", "properties": {}},
}

WEATHER_CALL = ("<tool_call>\n<function=get_weather>\n"
                "<parameter=city>\nNew York\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n"
                "<parameter=ratio>\n0.5\n</parameter>\n"
                "<parameter=verbose>\nTrue\n</parameter>\n"
                "<parameter=options>\n{\"units\": \"metric\", \"alerts\": [1, 2]}\n</parameter>\n"
                "<parameter=hours>\n[6, 12]\n</parameter>\n"
                "</function>\n</tool_call>")
TIME_CALL = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
TWO_CALLS = "Let me look that up.\n\n" + WEATHER_CALL + "\n" + TIME_CALL


def parse(text: str, *, is_final: bool = True, schemas: dict[str, Any] = SCHEMAS
          ) -> tuple[str, list[tuple[str, Any]]]:
    parsed = Qwen3CoderToolParser(schemas).parse(text, is_final=is_final)
    return parsed.content, [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def one_value(parameter: str, value: str) -> Any:
    text = (f"<tool_call>\n<function=get_weather>\n<parameter={parameter}>\n{value}\n"
            "</parameter>\n</function>\n</tool_call>")
    _, [(_, arguments)] = parse(text)
    return arguments[parameter]


# -- qwen3_coder, whole ------------------------------------------------------------------


def test_calls_and_the_content_before_them() -> None:
    parsed = Qwen3CoderToolParser(SCHEMAS).parse(TWO_CALLS, is_final=True)
    assert parsed.content == "Let me look that up.\n\n"
    assert [call.name for call in parsed.calls] == ["get_weather", "get_time"]
    assert all(call.is_complete for call in parsed.calls)
    weather = json.loads(parsed.calls[0].arguments)
    assert weather == {"city": "New York", "days": 3, "ratio": 0.5, "verbose": True,
                       "options": {"units": "metric", "alerts": [1, 2]}, "hours": [6, 12]}
    # written as vLLM writes the arguments: json.dumps's spacing, in the model's order
    assert parsed.calls[0].arguments == json.dumps(weather, ensure_ascii=False)
    assert parsed.calls[1].arguments == "{}"


@pytest.mark.parametrize(("parameter", "value", "expected"), [
    ("city", "123", "123"),  # a string stays a string, whatever it looks like
    ("city", "null", "null"),
    ("zone", "UTC", "UTC"),  # no declared type: text
    ("days", "-7", -7),
    ("days", "seven", "seven"),  # not an integer: the text
    ("ratio", "2.0", 2),  # an integral number is written as an integer (as vLLM does)
    ("ratio", "1e3", 1000),
    ("ratio", "nan", "nan"),  # no JSON form: the text
    ("ratio", "1e999", "1e999"),
    ("verbose", "false", False),
    ("verbose", "TRUE", True),
    ("verbose", "yes", "yes"),  # neither: the text (vLLM makes it false)
    ("options", "{'units': 'metric'}", {"units": "metric"}),  # a Python literal
    ("options", "\"{'a': 1}\"", {"a": 1}),  # a JSON string of one
    ("options", "{1, 2}", "{1, 2}"),  # a Python set has no JSON form
    ("options", "{broken", "{broken"),
    ("hours", "[1, 2,", "[1, 2,"),
    ("note", "None", None),  # nullable: null or None is null
    ("note", "later", "later"),
    ("limit", "null", None),
    ("limit", "5", 5),
    ("undeclared", "42", "42"),  # a parameter the schema does not name: text
])
def test_values_take_the_declared_json_type(parameter: str, value: str, expected: Any) -> None:
    assert one_value(parameter, value) == expected


def test_multi_line_values_keep_their_lines_and_only_one_newline_is_trimmed() -> None:
    code = "def f():\n    return '</parameter>'\n\n"
    text = (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n\n{code}\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    _, [(_, arguments)] = parse(text)
    # the value's own </parameter> is followed by text, so it is no end of the value
    assert arguments == {"city": "\n" + code, "days": 2}


def test_an_unknown_function_is_called_with_text_values() -> None:
    text = ("<tool_call>\n<function=send_mail>\n<parameter=to>\nme\n</parameter>\n"
            "<parameter=count>\n2\n</parameter>\n</function>\n</tool_call>")
    assert parse(text) == ("", [("send_mail", {"to": "me", "count": "2"})])


@pytest.mark.parametrize("text", [
    "Use <tool_call> tags to call tools.",
    'Hermes form: <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "<tool_call>\n<function={{ tool.name }}>\n</function>\n</tool_call>",  # template text
    "<tool_call>\n<function=get time>\n</function>\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "A bare <function=get_time></function> is no call.",
    "<tool_call>\n<funct",
])
def test_text_that_opens_no_call_is_content(text: str) -> None:
    assert parse(text) == (text, [])


def test_a_tag_in_prose_before_a_real_call_stays_in_the_content() -> None:
    text = "I will use a <tool_call> tag.\n" + TIME_CALL
    assert parse(text) == ("I will use a <tool_call> tag.\n", [("get_time", {})])


def test_malformed_calls_are_read_as_far_as_they_go() -> None:
    no_close = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
                "</function>\n</tool_call>")
    assert parse(no_close) == ("", [("get_weather", {"city": "Rome"})])
    cut_off = "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n<para"
    assert parse(cut_off) == ("", [("get_weather", {"days": 4})])
    cut_in_value = "<tool_call>\n<function=get_weather>\n<parameter=city>\nMad"
    assert parse(cut_in_value) == ("", [("get_weather", {"city": "Mad"})])
    junk_in_body = "<tool_call>\n<function=get_time>\nnow please\n</function>\n</tool_call>"
    assert parse(junk_in_body) == ("", [("get_time", {})])


# -- qwen3_coder, as the text grows --------------------------------------------------------


def test_while_streaming_a_call_grows_one_whole_value_at_a_time() -> None:
    parser = Qwen3CoderToolParser(SCHEMAS)
    seen: list[tuple[str, list[str]]] = []
    for end in range(len(TWO_CALLS) + 1):
        parsed = parser.parse(TWO_CALLS[:end], is_final=False)
        state = (parsed.content, [call.arguments for call in parsed.calls])
        if not seen or seen[-1] != state:
            seen.append(state)
    contents = [content for content, _ in seen]
    assert all(not content.endswith(("<", "<tool", "<tool_call")) for content in contents)
    assert contents[-1] == "Let me look that up.\n\n"
    weather = [calls[0] for _, calls in seen if calls]
    assert weather[0] == "{", "a call shows as soon as its name is complete"
    assert weather[1] == '{"city": "New York"'
    assert weather[-1].endswith("}") and json.loads(weather[-1])["hours"] == [6, 12]
    for earlier, later in zip(weather, weather[1:], strict=False):
        assert later.startswith(earlier), "arguments only grow"
    # the last state: both calls, the second complete
    assert [json.loads(arguments) for arguments in seen[-1][1]][1] == {}


def test_a_value_waits_for_the_tag_after_its_end() -> None:
    parser = Qwen3CoderToolParser(SCHEMAS)
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>"
    for tail in ("", "\n", "\n<", "\n<para", "\n</func"):
        (call,) = parser.parse(head + tail, is_final=False).calls
        assert call.arguments == "{", tail
    (call,) = parser.parse(head + "\n<parameter=", is_final=False).calls
    assert call.arguments == '{"city": "Oslo"'
    # "</parameter>" followed by text is part of the value
    (call,) = parser.parse(head + " and more", is_final=False).calls
    assert call.arguments == "{"


# -- reasoning -----------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt_end", "text", "reasoning", "content"), [
    # Qwen3.5, thinking on: the prompt opened the block
    ("<think>\n", "plan it\n</think>\n\nThe answer.", "plan it\n", "\n\nThe answer."),
    ("<think>\n", "cut off mid-thought", "cut off mid-thought", ""),
    ("<think>\n", "<think>again</think>ok", "again", "ok"),
    ("<think>\n", "thinking " + TIME_CALL, "thinking ", TIME_CALL),  # a call ends it
    ("<think>\n", "a <tool_call> tag</think>done", "a <tool_call> tag", "done"),
    # thinking off: the prompt closed an empty block
    ("<think>\n\n</think>\n\n", "The answer.", "", "The answer."),
    ("<think>\n\n</think>\n\n", "a</think>b", "", "a</think>b"),
    # Qwen3 hybrid: the model opens the block itself
    ("<|im_start|>assistant\n", "<think>hm</think>yes", "hm", "yes"),
    ("<|im_start|>assistant\n", "no block", "", "no block"),
])
def test_the_prompt_says_whether_the_output_starts_in_the_think_block(
        prompt_end: str, text: str, reasoning: str, content: str) -> None:
    parser = Qwen3ReasoningParser()
    parser.note_prompt_end("<|im_start|>user\nhi<|im_end|>\n" + prompt_end)
    split = parser.split(text, is_final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_reasoning_is_held_back_while_a_tag_may_be_arriving() -> None:
    parser = Qwen3ReasoningParser()
    parser.note_prompt_end("<think>\n")
    assert parser.split("step one </thi", is_final=False).reasoning == "step one "
    assert parser.split("step one <tool_call>\n<func", is_final=False).reasoning == "step one "
    assert parser.split("step one <tool_call> x", is_final=False).reasoning == (
        "step one <tool_call> x")
    assert parser.split("<thi", is_final=False).reasoning == ""
    assert parser.split("a <</thi", is_final=False).reasoning == "a <"
    end = parser.split("ab</think>c", is_final=True).end
    assert end == len("ab</think>")


# -- ChatBuilder: streamed = whole -------------------------------------------------------


def prompt_ids(text: str) -> list[int]:
    return [ord(character) for character in text]  # token_text=chr reads them back


def outputs(prompt_end: str, text: str, size: int, finish_reason: str) -> list[RequestOutput]:
    pieces = [text[start:start + size] for start in range(0, len(text), size)] or [""]
    return [RequestOutput(request_id="r", token_ids=[1], text=piece,
                          finished=index == len(pieces) - 1,
                          finish_reason=finish_reason if index == len(pieces) - 1 else None,
                          prompt_token_ids=prompt_ids(prompt_end) if index == 0 else None)
            for index, piece in enumerate(pieces)]


def new_parser() -> ChatOutputParser:
    return ChatOutputParser(reasoning=Qwen3ReasoningParser(),
                            tools=Qwen3CoderToolParser(SCHEMAS))


def streamed(prompt_end: str, text: str, size: int, finish_reason: str = "stop"
             ) -> dict[str, Any]:
    builder = ChatBuilder(response_id="c", model="m", token_text=chr, parser=new_parser())
    message: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for output in outputs(prompt_end, text, size, finish_reason):
        chunk = builder.chunk(output)
        if chunk is None:
            continue
        choice = chunk.choices[0]
        message["finish"] = choice.finish_reason or message["finish"]
        message["content"] += choice.delta.content or ""
        message["reasoning"] += choice.delta.reasoning_content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in message["calls"], "one first delta per call"
                message["calls"][call.index] = [call.function.name, ""]
            message["calls"][call.index][1] += call.function.arguments or ""
    return message


def whole(prompt_end: str, text: str, finish_reason: str = "stop") -> dict[str, Any]:
    builder = ChatBuilder(response_id="c", model="m", token_text=chr, parser=new_parser())
    for output in outputs(prompt_end, text, 10_000, finish_reason):
        builder.add(output)
    choice = builder.response().choices[0]
    message = choice.message
    return {"content": message.content or "", "reasoning": message.reasoning_content or "",
            "calls": {index: [call.function.name, call.function.arguments]
                      for index, call in enumerate(message.tool_calls or [])},
            "finish": choice.finish_reason}


THINKING_ON = "<|im_start|>assistant\n<think>\n"
THINKING_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
CUT_OFF_CALL = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n"
                "</parameter>\n<parameter=city>\nLi")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 10_000])
@pytest.mark.parametrize(("prompt_end", "text", "finish_reason"), [
    (THINKING_ON, "The user wants weather.\n</think>\n\n" + TWO_CALLS, "stop"),
    (THINKING_ON, "Weather, then time. " + WEATHER_CALL, "stop"),  # no </think>
    (THINKING_ON, "still thinking about <tool_call> tags", "length"),
    (THINKING_OFF, TWO_CALLS, "stop"),
    (THINKING_OFF, "Plain <tool_call> talk, <function=x> too.", "stop"),
    (THINKING_OFF, CUT_OFF_CALL, "length"),
])
def test_streamed_deltas_reassemble_into_the_whole_message(
        size: int, prompt_end: str, text: str, finish_reason: str) -> None:
    assert streamed(prompt_end, text, size, finish_reason) == whole(prompt_end, text,
                                                                     finish_reason)


def test_the_whole_messages() -> None:
    on = whole(THINKING_ON, "The user wants weather.\n</think>\n\n" + TWO_CALLS)
    assert on["reasoning"] == "The user wants weather.\n"
    assert on["content"] == "\n\nLet me look that up.\n\n"  # as vLLM leaves it
    assert [name for name, _ in on["calls"].values()] == ["get_weather", "get_time"]
    assert on["finish"] == "tool_calls"
    off = whole(THINKING_OFF, TWO_CALLS)
    assert off["reasoning"] == "" and off["calls"] == on["calls"]
    cut = whole(THINKING_OFF, CUT_OFF_CALL, "length")
    assert cut["finish"] == "length", "cut off by max_tokens: not a finished call"
    assert json.loads(cut["calls"][0][1]) == {"days": 2, "city": "Li"}
    only_calls = whole(THINKING_OFF, WEATHER_CALL)
    assert only_calls["content"] == "" and only_calls["finish"] == "tool_calls"


def test_streamed_calls_arrive_as_vllm_sends_them() -> None:
    builder = ChatBuilder(response_id="c", model="m", token_text=chr, parser=new_parser())
    fragments = []
    for output in outputs(THINKING_OFF, WEATHER_CALL, 1, "stop"):
        chunk = builder.chunk(output)
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk else []:
            fragments.append((call.id is not None, call.function.name,
                              call.function.arguments))
    assert fragments[0] == (True, "get_weather", "{")
    assert fragments[1] == (False, None, '"city": "New York"')
    assert fragments[2] == (False, None, ', "days": 3')
    assert fragments[-1][2].endswith("}") and len(fragments) == 7


# -- serving -------------------------------------------------------------------------------


def test_the_qwen3_coder_flag_and_plan() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                              "--reasoning-parser", "qwen3"])
    config = server_config_from_args(args)
    assert config.tool_call_parser == "qwen3_coder"
    options = ToolServingOptions(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    check_serving_options(options)
    tools = decode_request(json.dumps({"messages": [], "tools": [
        {"type": "function", "function": {"name": name, "parameters": schema}}
        for name, schema in SCHEMAS.items()]}).encode(), Chat).tools
    plan = plan_tool_calls(tools, "auto", parallel_tool_calls=False, options=options)
    assert isinstance(plan.parser, Qwen3CoderToolParser) and plan.max_calls == 1
    calls = ChatOutputParser(tools=plan.parser, max_calls=1).parse(TWO_CALLS, is_final=True)
    # the plan gave the parser the schemas: days is an integer
    assert [json.loads(call.arguments)["days"] for call in calls.calls] == [3]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_assistant_s_reasoning_reaches_the_template(field: str) -> None:
    body = decode_request(json.dumps({"messages": [
        {"role": "user", "content": "What time is it?", field: "not an assistant's"},
        {"role": "assistant", "content": "", field: "I need the clock.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "content": "noon", "tool_call_id": "c1"}]}).encode(), Chat)
    messages = chat_messages(body.messages)
    assert "reasoning" not in messages[0]
    assert messages[1]["reasoning"] == messages[1]["reasoning_content"] == "I need the clock."
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"), chat_template=str(TEMPLATE))
    prompt = tokenizer.apply_chat_template(messages)
    # the turn after the last query keeps its reasoning; its call is written back in
    # the format the model writes (arguments decoded to an object first)
    assert ("<|im_start|>assistant\n<think>\nI need the clock.\n</think>\n\n<tool_call>\n"
            "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n") in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nnoon\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n<think>\n")
