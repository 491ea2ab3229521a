"""Tool calls out of generated text: the hermes format, Qwen3-Coder's and Qwen3.5's
XML format (qwen3_coder), and the two forms that constrained decoding produces for
``tool_choice`` "required" and a named function.

Every parser reads the whole text generated so far and says what it holds:
content, and tool calls whose arguments may still be growing (``is_complete``
false). Parsing the text so far rather than deltas keeps streaming and
non-streaming identical: the streamed deltas are the differences between
successive parses (protocol.ToolCallStreamer), and the last parse is the
non-streamed message.

A parser for another model family is a class with ``parse``, made for each request
from its tools' parameter schemas by the factory registered in TOOL_PARSERS under the
name ``--tool-call-parser`` takes.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


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


# -- qwen3_coder: <tool_call><function=NAME><parameter=ARG>VALUE</parameter></function> ---

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
# What may follow a value's </parameter> (after whitespace): a "</parameter>" followed
# by anything else is text inside the value (code that writes the format, say).
_AFTER_PARAMETER = (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
# A function name with one of these is template text or prose, not a call.
_NOT_IN_FUNCTION_NAMES = frozenset("{}<>\"' \t\r\n")
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_BOOLEAN_TYPES = frozenset({"boolean", "bool", "binary"})
_CONTAINER_TYPES = frozenset({"object", "array", "arr"})
_NULL_WORDS = frozenset({"null", "none"})


class _Undecided:
    """A block whose first characters could still open a call."""


_UNDECIDED = _Undecided()


class Qwen3CoderToolParser:
    """Qwen3-Coder and Qwen3.5 / Qwen3.6: each call a ``<function=NAME>`` block of
    ``<parameter=ARG>`` values inside <tool_call> tags; content is the text before the
    first call. Values are text: each becomes the JSON type its parameter declares
    (``_json_value``), and the arguments are their JSON object, written as vLLM
    writes it (``{"a": 1, "b": "x"}``).

    Streamed, a call appears once its name is complete, with arguments ``{``; each
    parameter's value joins them once it is complete (a value is converted whole),
    and ``}`` once ``</function>`` comes: the deltas vLLM sends. A value ends at the
    first ``</parameter>`` that whitespace and another tag follow (or the end of the
    output), so a value may hold the format's own tags.
    """

    def __init__(self, schemas: ToolSchemas) -> None:
        self._properties = {name: _properties(schema) for name, schema in schemas.items()}
        # a finished value's JSON text, by (function, parameter, value): each parse
        # reads the whole text again, but converts each value once
        self._fragments: dict[tuple[str, str, str], str] = {}

    def parse(self, text: str, *, is_final: bool) -> ParsedText:
        calls: list[ParsedCall] = []
        content_end: int | None = None
        position = 0
        while (start := text.find(TOOL_CALL_START, position)) >= 0:
            block = self._call_at(text, start + len(TOOL_CALL_START), is_final=is_final)
            if block is None:  # a <tool_call> tag in prose: text, look further
                position = start + len(TOOL_CALL_START)
                continue
            if content_end is None:
                content_end = start
            if isinstance(block, _Undecided):
                break
            call, position = block
            calls.append(call)
            if not call.is_complete:
                break
        if content_end is None:
            return ParsedText(content=text if is_final else _without_partial_tag(text))
        return ParsedText(content=text[:content_end], calls=calls)

    def _call_at(self, text: str, index: int, *, is_final: bool
                 ) -> tuple[ParsedCall, int] | _Undecided | None:
        """The call whose block starts at ``index`` (after <tool_call>) and the index
        past it; undecided while the text could still open one; None if it is none."""
        index = _skip_whitespace(text, index)
        if not text.startswith(FUNCTION_START, index):
            rest = text[index:index + len(FUNCTION_START)]
            could_open = len(rest) < len(FUNCTION_START) and FUNCTION_START.startswith(rest)
            return _UNDECIDED if could_open and not is_final else None
        name_start = index + len(FUNCTION_START)
        name_end = text.find(">", name_start)
        name = text[name_start:] if name_end < 0 else text[name_start:name_end]
        if _NOT_IN_FUNCTION_NAMES.intersection(name) or (name_end >= 0 and not name):
            return None
        if name_end < 0:
            return None if is_final else _UNDECIDED
        return self._body(text, name_end + 1, name, is_final=is_final)

    def _body(self, text: str, index: int, name: str, *, is_final: bool
              ) -> tuple[ParsedCall, int]:
        """The call ``name`` from its parameters at ``index`` on, and the index past it."""
        fragments: list[str] = []
        while True:
            index = _skip_whitespace(text, index)
            if text.startswith(FUNCTION_END, index):
                end = _skip_whitespace(text, index + len(FUNCTION_END))
                end = end + len(TOOL_CALL_END) if text.startswith(TOOL_CALL_END, end) else end
                return ParsedCall(name=name, arguments=_json_object(fragments, closed=True),
                                  is_complete=True), end
            if not text.startswith(PARAMETER_START, index):
                break  # the text so far ends here, or the block is malformed: no more
            parameter = self._parameter_at(text, index + len(PARAMETER_START), name,
                                           is_final=is_final)
            if parameter is None:
                break
            fragment, index = parameter
            fragments.append(fragment)
        # cut off (max_tokens) or malformed: the object is closed once the output ends
        return ParsedCall(name=name, arguments=_json_object(fragments, closed=is_final),
                          is_complete=is_final), len(text)

    def _parameter_at(self, text: str, index: int, function: str, *, is_final: bool
                      ) -> tuple[str, int] | None:
        """The JSON text ``"name": value`` of the parameter whose name starts at
        ``index``, and the index after it; None while it is incomplete."""
        name_end = text.find(">", index)
        if name_end < 0:
            return None
        name = text[index:name_end]
        value_start = name_end + 1
        if text.startswith("\n", value_start):
            value_start += 1
        value_end = _value_end(text, value_start, is_final=is_final)
        if value_end is not None:
            after = value_end + len(PARAMETER_END)
        elif is_final:  # no </parameter>: the value runs to </function> or the end
            value_end = after = _function_end(text, value_start)
        else:
            return None
        value = text[value_start:value_end]
        return self._fragment(function, name, value.removesuffix("\n")), after

    def _fragment(self, function: str, name: str, value: str) -> str:
        key = (function, name, value)
        fragment = self._fragments.get(key)
        if fragment is None:
            schema = self._properties.get(function, {}).get(name)
            fragment = f"{_json_text(name)}: {_json_text(_json_value(value, schema), value)}"
            self._fragments[key] = fragment
        return fragment


def _value_end(text: str, start: int, *, is_final: bool) -> int | None:
    """Where the value starting at ``start`` ends (its ``</parameter>``); None while
    that is not known yet, or when no ``</parameter>`` ends it."""
    search = start
    while (close := text.find(PARAMETER_END, search)) >= 0:
        after = _skip_whitespace(text, close + len(PARAMETER_END))
        if text.startswith(_AFTER_PARAMETER, after):
            return close
        tail = text[after:]
        if any(tag.startswith(tail) for tag in _AFTER_PARAMETER):
            # a tag may be arriving; where the output ended there, it is the end
            return close if is_final else None
        search = close + len(PARAMETER_END)
    return None


def _function_end(text: str, start: int) -> int:
    """The ``</function>`` after ``start`` that closes the call (whitespace, then
    </tool_call> or the end, follow it), else the end of the text."""
    search = start
    while (end := text.find(FUNCTION_END, search)) >= 0:
        after = _skip_whitespace(text, end + len(FUNCTION_END))
        if after == len(text) or text.startswith(TOOL_CALL_END, after):
            return end
        search = end + len(FUNCTION_END)
    return len(text)


def _json_object(fragments: list[str], *, closed: bool) -> str:
    return "{" + ", ".join(fragments) + ("}" if closed else "")


def _json_text(value: Any, fallback: str | None = None) -> str:
    """``value`` as JSON (vLLM's spacing, non-ASCII kept); ``fallback`` as a JSON string
    where ``value`` has no JSON form (a set or a NaN from a Python literal)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return json.dumps(fallback, ensure_ascii=False)


def _properties(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    properties = schema.get("properties")
    return properties if isinstance(properties, Mapping) else {}


def _declared_type(schema: Any) -> tuple[str, bool]:
    """The type a parameter's schema declares (the first that is not null, lower
    case; "string" where none is) and whether null is allowed."""
    if not isinstance(schema, Mapping):
        return "string", False
    declared = schema.get("type")
    if declared is None and isinstance(schema.get("anyOf"), list):
        declared = [option.get("type") for option in schema["anyOf"]
                    if isinstance(option, Mapping)]
    options = [str(option).strip().lower() for option in
               (declared if isinstance(declared, list) else [declared]) if option is not None]
    concrete = [option for option in options if option != "null"]
    return (concrete[0] if concrete else "string"), "null" in options


def _json_value(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for; the text
    itself where it is not one (an undeclared parameter's, or an integer that does
    not parse). As vLLM's parser does, except that a boolean that is not true or
    false stays text (vLLM makes it false)."""
    if schema is None:
        return value
    declared, nullable = _declared_type(schema)
    if nullable and value.lower() in _NULL_WORDS:
        return None
    if declared in _STRING_TYPES:
        return value
    if value.lower() in _NULL_WORDS:
        return None
    if declared.startswith(("int", "uint", "long", "short", "unsigned")):
        return _parsed(int, value)
    if declared.startswith(("num", "float")):
        return _number(value)
    if declared in _BOOLEAN_TYPES:
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    is_container = declared in _CONTAINER_TYPES or declared.startswith(("dict", "list"))
    return _structured(value, is_container=is_container)


def _parsed(parse: Callable[[str], Any], value: str) -> Any:
    try:
        return parse(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def _number(value: str) -> Any:
    number = _parsed(float, value)
    if not isinstance(number, float) or not math.isfinite(number):
        return value
    return int(number) if number.is_integer() else number


def _structured(value: str, *, is_container: bool) -> Any:
    """An object or array (JSON, or a Python literal as models trained on a template
    that wrote ``str(dict)`` give); any other type: a Python literal, else the text."""
    if is_container:
        parsed = _parsed(json.loads, value)
        if parsed is not value:
            # JSON of a Python literal's text ("{'k': 'v'}" in quotes): one more parse
            return _parsed(ast.literal_eval, parsed) if isinstance(parsed, str) else parsed
    parsed = _parsed(ast.literal_eval, value)
    if is_container and isinstance(parsed, str) and parsed is not value:
        return _parsed(ast.literal_eval, parsed)
    return parsed


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


ToolSchemas = Mapping[str, Mapping[str, Any]]
"""The request's tools: each function's name and the JSON Schema of its parameters."""

ToolParserFactory = Callable[[ToolSchemas], ToolParser]


def _hermes(_: ToolSchemas) -> ToolParser:
    return HermesToolParser()  # JSON arguments need no schema


TOOL_PARSERS: dict[str, ToolParserFactory] = {
    "hermes": _hermes,
    "qwen3_coder": Qwen3CoderToolParser,
    # vLLM's second parser of the same format: the same calls come out
    "qwen3_xml": Qwen3CoderToolParser,
}
