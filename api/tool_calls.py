"""Tool calling and reasoning on /v1/chat/completions: what a request's ``tools`` and
``tool_choice`` ask of the engine, and how its output becomes a message.

``tool_choice``, as vLLM serves it:

- ``none`` (or no tools): plain text; the tools still reach the chat template.
- ``auto`` (the default with tools): the model decides; the server's
  ``--tool-call-parser`` finds calls in the text (only the first with
  ``parallel_tool_calls`` false). Refused unless the server runs with
  ``--enable-auto-tool-choice --tool-call-parser NAME``.
- ``required``: constrained decoding to a JSON array of ``{"name", "parameters"}``
  objects, one of the tools each (at most one with ``parallel_tool_calls`` false).
- a named function: constrained decoding to that function's parameters schema;
  the whole output is its arguments.

In the constrained cases the arguments always validate against the function's schema.
A message with calls finishes with ``"tool_calls"`` (unless cut off by max_tokens).

``ChatOutputParser`` splits reasoning (``--reasoning-parser``) from the answer, then
tool calls from the answer, over the whole text so far; ``stream_delta`` turns two
successive parses into one OpenAI stream delta.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.messages import StructuredOutputsParams
from trio_llm.api.reasoning_parsers import REASONING_PARSERS, Qwen3ReasoningParser
from trio_llm.api.tool_parsers import (
    TOOL_PARSERS,
    NamedToolCallParser,
    ParsedCall,
    RequiredToolCallsParser,
    ToolParser,
)


class ToolServingOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The server's flags for tools and reasoning (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools need: a constraint on its output, a parser of it,
    and how many calls the message may carry (None: any)."""

    constraint: StructuredOutputsParams | None
    parser: ToolParser | None
    max_calls: int | None = None


def plan_tool_calls(tools: list[Any] | None, tool_choice: Any, *, parallel_tool_calls: bool,
                    options: ToolServingOptions) -> ToolPlan:
    """The ToolPlan of a request's ``tools`` and ``tool_choice`` (protocol Structs)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestRejected("tool_choice needs tools", param="tool_choice")
        return ToolPlan(constraint=None, parser=None)
    _check_unique_names(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(constraint=None, parser=None)
    if choice == "auto":
        return ToolPlan(constraint=None, parser=_auto_parser(options, tools),
                        max_calls=None if parallel_tool_calls else 1)
    if choice == "required":
        schema = _required_schema(tools, parallel_tool_calls=parallel_tool_calls)
        return ToolPlan(constraint=StructuredOutputsParams(json=schema),
                        parser=RequiredToolCallsParser())
    assert not isinstance(choice, str), f"tool_choice {choice!r} passed decoding"
    name = choice.function.name
    tool = next((tool for tool in tools if tool.function.name == name), None)
    if tool is None:
        raise RequestRejected(f"tool_choice names {name!r}, which is not among the tools",
                              param="tool_choice")
    return ToolPlan(constraint=StructuredOutputsParams(json=_parameters_json(tool)),
                    parser=NamedToolCallParser(name))


def _check_unique_names(tools: list[Any]) -> None:
    names = [tool.function.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RequestRejected(f"tool names must be unique: {', '.join(duplicates)}",
                              param="tools")


def _auto_parser(options: ToolServingOptions, tools: list[Any]) -> ToolParser:
    if not options.enable_auto_tool_choice or options.tool_call_parser is None:
        raise RequestRejected('"auto" tool choice requires the server to run with '
                              "--enable-auto-tool-choice and --tool-call-parser",
                              param="tool_choice")
    # the parser learns each parameter's declared type (qwen3_coder converts values)
    schemas = {tool.function.name: _parameters(tool) for tool in tools}
    return TOOL_PARSERS[options.tool_call_parser](schemas)


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _parameters_json(tool: Any) -> str:
    return msgspec.json.encode(_parameters(tool)).decode()


def _required_schema(tools: list[Any], *, parallel_tool_calls: bool) -> str:
    calls = [{"type": "object",
              "properties": {"name": {"const": tool.function.name},
                             "parameters": _parameters(tool)},
              "required": ["name", "parameters"]} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return msgspec.json.encode(schema).decode()


def reasoning_parser_for(options: ToolServingOptions) -> Qwen3ReasoningParser | None:
    if options.reasoning_parser is None:
        return None
    return REASONING_PARSERS[options.reasoning_parser]()


def check_serving_options(options: ToolServingOptions) -> None:
    """Refuse unknown parser names at start-up (ValueError naming the known ones)."""
    if options.tool_call_parser is not None and options.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown --tool-call-parser {options.tool_call_parser!r}; "
                         f"known: {', '.join(sorted(TOOL_PARSERS))}")
    if options.reasoning_parser is not None and options.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown --reasoning-parser {options.reasoning_parser!r}; "
                         f"known: {', '.join(sorted(REASONING_PARSERS))}")


# -- output -> message ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    reasoning: str | None
    content: str
    calls: list[ParsedCall]


# Enough of the prompt's last tokens to hold "<think>\n" even where a tokenizer has no
# token of its own for the tag (one a character at worst).
NUM_PROMPT_TAIL_TOKENS = 16


@dataclass(slots=True)
class ChatOutputParser:
    """Splits one request's text into reasoning, answer and tool calls."""

    reasoning: Qwen3ReasoningParser | None = None
    tools: ToolParser | None = None
    max_calls: int | None = None
    call_ids: list[str] = field(default_factory=list)

    def note_prompt(self, prompt_token_ids: list[int], token_text: Callable[[int], str]) -> None:
        """Called with the prompt's token ids before the first parse: whether the chat
        template opened the think block decides where the reasoning starts."""
        if self.reasoning is not None:
            tail = prompt_token_ids[-NUM_PROMPT_TAIL_TOKENS:]
            self.reasoning.note_prompt_end("".join(map(token_text, tail)))

    def parse(self, text: str, *, is_final: bool) -> ParsedOutput:
        reasoning = None
        if self.reasoning is not None:
            split = self.reasoning.split(text, is_final=is_final)
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return ParsedOutput(reasoning=reasoning, content=text, calls=[])
        parsed = self.tools.parse(text, is_final=is_final)
        return ParsedOutput(reasoning=reasoning, content=parsed.content,
                            calls=parsed.calls[:self.max_calls])

    def call_id(self, index: int) -> str:
        """The id of the ``index``-th call, made when first asked (streamed or not)."""
        while len(self.call_ids) <= index:
            self.call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self.call_ids[index]


def visible_content(parsed: ParsedOutput) -> str | None:
    """The message's content: None where only tool calls (blank text before them is
    none) or only reasoning came (output cut off while thinking), as vLLM sends it."""
    if parsed.calls and not parsed.content.strip():
        return None
    if parsed.reasoning and not parsed.content:
        return None
    return parsed.content
