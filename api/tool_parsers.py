"""Tool calls out of generated text: the hermes format, and the two forms that
constrained decoding produces for ``tool_choice`` "required" and a named function.

Every parser reads the whole text generated so far and says what it holds:
content, and tool calls whose arguments may still be growing (``is_complete``
false). Parsing the text so far rather than deltas keeps streaming and
non-streaming identical: the streamed deltas are the differences between
successive parses (protocol.ToolCallStreamer), and the last parse is the
non-streamed message.

A parser for another model family is a class with ``parse`` registered in
TOOL_PARSERS under the name ``--tool-call-parser`` takes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call: its function's name and its arguments' JSON text (so far)."""

    name: str
    arguments: str
    is_complete: bool


@dataclass(frozen=True, slots=True)
class ParsedText:
    """Text split into what the user reads and the tool calls it carries.

    ``content`` only ever grows as text arrives: text that may turn out to open a
    tool call is held back until it is known not to.
    """

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, *, is_final: bool) -> ParsedText:
        """What ``text`` (all output so far) holds; ``is_final`` once generation ended."""
        ...


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value starting at ``text[start]`` (after any
    whitespace), or None while the value is incomplete. Objects, arrays and strings
    are matched by their brackets and quotes; a scalar ends at a delimiter."""
    index = _skip_whitespace(text, start)
    if index >= len(text):
        return None
    if text[index] not in "{[\"":
        match = re.compile(r"[^,\]\}\s]*").match(text, index)
        assert match is not None
        return match.end() if match.end() < len(text) else None
    depth, in_string, escaped = 0, False, False
    for position in range(index, len(text)):
        character = text[position]
        if in_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                in_string = False
                if depth == 0:
                    return position + 1
        elif character == '"':
            in_string = True
        elif character in "{[":
            depth += 1
        elif character in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
    return None


def _skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


# -- hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> --------------------

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesToolParser:
    """Qwen2.5 / Qwen3 / Hermes: each call a JSON object between <tool_call> tags;
    content is the text before the first tag. A call whose JSON does not parse as
    ``{"name": ..., "arguments": ...}`` stays in the content, as vLLM's parser does."""

    def parse(self, text: str, *, is_final: bool) -> ParsedText:
        first = text.find(TOOL_CALL_START)
        if first < 0:
            return ParsedText(content=text if is_final else _without_partial_tag(text))
        calls: list[ParsedCall] = []
        start = first
        while start >= 0:
            call = self._call_at(text, start + len(TOOL_CALL_START))
            if call is None:
                break
            calls.append(call)
            if not call.is_complete:
                break
            start = text.find(TOOL_CALL_START, start + len(TOOL_CALL_START))
        if not calls and is_final:
            return ParsedText(content=text)  # the tag opened nothing readable: plain text
        return ParsedText(content=text[:first], calls=calls)

    @staticmethod
    def _call_at(text: str, start: int) -> ParsedCall | None:
        head = _HERMES_HEAD.match(text, start)
        if head is None:
            return None
        name = head.group(1)
        end = json_value_end(text, head.end())
        if end is None:
            arguments = text[_skip_whitespace(text, head.end()):]
            return ParsedCall(name=name, arguments=_before_tag(arguments), is_complete=False)
        arguments = text[_skip_whitespace(text, head.end()):end]
        return ParsedCall(name=name, arguments=arguments, is_complete=True)


def _without_partial_tag(text: str) -> str:
    """``text`` less a tail that could be the start of <tool_call>."""
    for length in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return text[:-length]
    return text


def _before_tag(arguments: str) -> str:
    cut = arguments.find(TOOL_CALL_END)
    return arguments if cut < 0 else arguments[:cut]


# -- constrained forms ------------------------------------------------------------------


class NamedToolCallParser:
    """tool_choice naming a function: the whole output is that call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, *, is_final: bool) -> ParsedText:
        if not text and not is_final:
            return ParsedText(content="")
        return ParsedText(content="", calls=[ParsedCall(name=self.name, arguments=text,
                                                        is_complete=is_final)])


_REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


class RequiredToolCallsParser:
    """tool_choice "required": a JSON array of ``{"name": ..., "parameters": ...}``
    (the form vLLM constrains it to), its objects taken as calls in order."""

    def parse(self, text: str, *, is_final: bool) -> ParsedText:
        calls: list[ParsedCall] = []
        index = _skip_whitespace(text, 0)
        if index >= len(text) or text[index] != "[":
            return ParsedText(content="")
        index += 1
        while True:
            head = _REQUIRED_HEAD.match(text, index)
            if head is None:
                break
            start = _skip_whitespace(text, head.end())
            end = json_value_end(text, head.end())
            if end is None:
                calls.append(ParsedCall(name=head.group(1), arguments=text[start:],
                                        is_complete=False))
                break
            calls.append(ParsedCall(name=head.group(1), arguments=text[start:end],
                                    is_complete=True))
            separator = re.compile(r"\s*\}\s*,?").match(text, end)
            if separator is None or separator.end() == end:
                break
            index = separator.end()
        return ParsedText(content="", calls=calls)


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
