"""The tool-call and reasoning parsers as plain functions, and ChatBuilder streaming
them: whatever way the text is cut into deltas, the stream reassembles into exactly
the non-streamed message."""

from __future__ import annotations

import json

import pytest

from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.messages import RequestOutput
from trio_llm.api.protocol import ChatBuilder, NamedFunction, NamedToolChoice, decode_request
from trio_llm.api.protocol import ChatCompletionRequest as Chat
from trio_llm.api.reasoning_parsers import Qwen3ReasoningParser
from trio_llm.api.tool_calls import ChatOutputParser, ToolServingOptions, plan_tool_calls
from trio_llm.api.tool_parsers import (
    HermesToolParser,
    NamedToolCallParser,
    RequiredToolCallsParser,
    json_value_end,
)

HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Pa\\"ris}", "days": [1, {"x": "]"}]}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_json_value_end_matches_brackets_strings_and_escapes() -> None:
    assert json_value_end('{"a": "}"} tail', 0) == 10
    assert json_value_end('  [1, [2], "]"]x', 0) == 15
    assert json_value_end('"a\\"b" ', 0) == 6
    assert json_value_end("123, ", 0) == 3
    assert json_value_end('{"a": [1', 0) is None
    assert json_value_end("12", 0) is None, "a number may go on"


def test_hermes_parses_calls_and_the_content_before_them() -> None:
    parsed = HermesToolParser().parse(HERMES, is_final=True)
    assert parsed.content == "I will check.\n"
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        ("get_weather", {"city": 'Pa"ris}', "days": [1, {"x": "]"}]}), ("get_time", {})]
    assert all(call.is_complete for call in parsed.calls)


def test_hermes_holds_back_a_partial_tag_and_keeps_unreadable_blocks_as_text() -> None:
    parser = HermesToolParser()
    assert parser.parse("Hello <tool_c", is_final=False).content == "Hello "
    assert parser.parse("Hello <tool_c", is_final=True).content == "Hello <tool_c"
    broken = "Hi <tool_call>not json</tool_call>"
    assert parser.parse(broken, is_final=True).content == broken
    assert parser.parse(broken, is_final=True).calls == []


def test_required_and_named_forms() -> None:
    text = '[{"name": "a", "parameters": {"x": [1]}}, {"name": "b", "parameters": {}}]'
    calls = RequiredToolCallsParser().parse(text, is_final=True).calls
    assert [(call.name, call.arguments) for call in calls] == [("a", '{"x": [1]}'), ("b", "{}")]
    named = NamedToolCallParser("f").parse('{"q": 1}', is_final=True)
    assert [(call.name, call.arguments) for call in named.calls] == [("f", '{"q": 1}')]


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>a plan</think>\n\nThe answer.", "a plan", "\n\nThe answer."),
    ("<think>cut off", "cut off", ""),
    ("No thinking here.", "", "No thinking here."),
    ("<thi", "", "<thi"),
])
def test_qwen3_reasoning_split(text: str, reasoning: str, content: str) -> None:
    split = Qwen3ReasoningParser().split(text, is_final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


def outputs_cut_every(text: str, size: int, finish_reason: str) -> list[RequestOutput]:
    pieces = [text[start:start + size] for start in range(0, len(text), size)] or [""]
    return [RequestOutput(request_id="r", token_ids=[1], text=piece,
                          finished=index == len(pieces) - 1,
                          finish_reason=finish_reason if index == len(pieces) - 1 else None)
            for index, piece in enumerate(pieces)]


def builder(parser: ChatOutputParser) -> ChatBuilder:
    return ChatBuilder(response_id="chatcmpl-x", model="m", token_text=str, parser=parser)


def streamed_message(parser_factory, text: str, size: int) -> dict:
    """The message a client puts together from the stream's deltas."""
    chat = builder(parser_factory())
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for output in outputs_cut_every(text, size, "stop"):
        chunk = chat.chunk(output)
        if chunk is None:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        message["content"] += delta.content or ""
        message["reasoning_content"] += delta.reasoning_content or ""
        assert delta.reasoning == delta.reasoning_content
        for call in delta.tool_calls or []:
            entry = message["tool_calls"].setdefault(call.index, {"name": None, "arguments": ""})
            if call.id is not None:
                entry["name"] = call.function.name
            entry["arguments"] += call.function.arguments or ""
    message["finish_reason"] = finish
    return message


def whole_message(parser_factory, text: str) -> dict:
    chat = builder(parser_factory())
    for output in outputs_cut_every(text, len(text) or 1, "stop"):
        chat.add(output)
    choice = chat.response().choices[0]
    return {"content": choice.message.content or "",
            "reasoning_content": choice.message.reasoning_content or "",
            "tool_calls": {index: {"name": call.function.name,
                                   "arguments": call.function.arguments}
                           for index, call in enumerate(choice.message.tool_calls or [])},
            "finish_reason": choice.finish_reason}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_deltas_reassemble_into_the_whole_message(size: int) -> None:
    thinking = "<think>weather first</think>\n" + HERMES
    cases = [
        (lambda: ChatOutputParser(tools=HermesToolParser()), HERMES),
        (lambda: ChatOutputParser(reasoning=Qwen3ReasoningParser(), tools=HermesToolParser()),
         thinking),
        (lambda: ChatOutputParser(tools=RequiredToolCallsParser()),
         '[{"name": "a", "parameters": {"x": "y"}}]'),
        (lambda: ChatOutputParser(tools=NamedToolCallParser("f")), '{"k": [1, 2]}'),
        (lambda: ChatOutputParser(reasoning=Qwen3ReasoningParser()), "<think>hm</think>ok"),
        (lambda: ChatOutputParser(tools=HermesToolParser()), "plain <tool_ text"),
    ]
    for factory, text in cases:
        whole = whole_message(factory, text)
        assert streamed_message(factory, text, size) == whole, text
    assert whole_message(cases[0][0], HERMES)["finish_reason"] == "tool_calls"
    assert whole_message(cases[4][0], "<think>hm</think>ok")["finish_reason"] == "stop"


def test_tool_choice_plans() -> None:
    tools = decode_request(json.dumps({"messages": [], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g"}}]}).encode(), Chat).tools
    auto = ToolServingOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert plan_tool_calls(tools, "none", parallel_tool_calls=True, options=auto).parser is None
    assert isinstance(plan_tool_calls(tools, None, parallel_tool_calls=True, options=auto).parser,
                      HermesToolParser)
    required = plan_tool_calls(tools, "required", parallel_tool_calls=False, options=auto)
    assert required.constraint is not None and required.constraint.json is not None
    schema = json.loads(required.constraint.json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = plan_tool_calls(tools, NamedToolChoice(type="function",
                                                   function=NamedFunction(name="g")),
                            parallel_tool_calls=True, options=auto)
    assert named.constraint is not None
    assert json.loads(named.constraint.json or "") == {"type": "object", "properties": {}}
    single = plan_tool_calls(tools, "auto", parallel_tool_calls=False, options=auto)
    assert single.max_calls == 1
    parser = ChatOutputParser(tools=single.parser, max_calls=single.max_calls)
    assert [call.name for call in parser.parse(HERMES, is_final=True).calls] == ["get_weather"]
    with pytest.raises(RequestRejected, match="--enable-auto-tool-choice"):
        plan_tool_calls(tools, "auto", parallel_tool_calls=True, options=ToolServingOptions())
    with pytest.raises(RequestRejected, match="unique"):
        plan_tool_calls([tools[0], tools[0]], "required", parallel_tool_calls=True,
                        options=auto)
