"""What a constraint may cost to compile: limits on its shape, checked before any compile.

xgrammar's compile time and memory grow with a constraint's shape, not its size
in bytes: a 31 KB schema nested 400 deep, an object of 2,000 optional properties
(71 KB) or an enum of 8,000 strings took tens of seconds and hundreds of MB on
the 2-core CI machine (benchmarks/constraint_cost.py; docs/reliability.md has the
table). ``check_constraint`` walks the constraint's text once (a JSON decode and
a walk, or a scan of a regex or grammar: milliseconds) and refuses one beyond a
limit, naming the limit and its flag, before a worker thread is asked for
anything. The limits are set so that the costliest constraint they admit
compiles in about a second and 100 MB on that machine with the tiny model's
vocabulary (the cost of a grammar's token masks grows with the vocabulary:
larger models pay more per constraint, within the compile deadline).

``estimated_cost`` sorts admitted constraints into the compile lanes
(actors/queue.py): cheap ones never wait behind a costly one.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import StructuredOutputsParams


class ConstraintLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The largest constraint shape a request may ask for (EngineConfig's
    ``structured_outputs_max_*``; docs/http-api.md lists them with their flags)."""

    max_bytes: int  # the constraint's text: schema, regex, grammar or choices
    max_depth: int  # nesting of a JSON schema's subschemas
    max_nodes: int  # subschemas of a JSON schema, in all
    max_properties: int  # optional object properties (not in required), in all
    max_alternatives: int  # enum and const values, choices, regex alternatives, in all
    # a bounded repetition ({n,m}, maxLength, maxItems...), nested ones multiplied
    max_repeat: int


def constraint_limits(config: EngineConfig) -> ConstraintLimits:
    """The engine's limits on a constraint's shape, from its config."""
    return ConstraintLimits(
        max_bytes=config.structured_outputs_max_bytes,
        max_depth=config.structured_outputs_max_depth,
        max_nodes=config.structured_outputs_max_nodes,
        max_properties=config.structured_outputs_max_properties,
        max_alternatives=config.structured_outputs_max_alternatives,
        max_repeat=config.structured_outputs_max_repeat)


DEFAULT_LIMITS = constraint_limits(EngineConfig())


class ConstraintTooCostly(ValueError):
    """A constraint beyond a limit: ``limit_name`` is the flag that sets it."""

    def __init__(self, message: str, *, limit_name: str) -> None:
        super().__init__(message)
        self.limit_name = limit_name


def check_constraint(params: StructuredOutputsParams, limits: ConstraintLimits) -> int:
    """Refuse ``params`` beyond ``limits`` (ConstraintTooCostly); else its estimated
    cost, in schema nodes, alternatives and repetitions (a rough unit: the lanes use it)."""
    if params.json is not None:
        _check_bytes(len(params.json.encode()), "the JSON schema", limits)
        return _SchemaWalk(limits).check(params.json)
    if params.regex is not None:
        _check_bytes(len(params.regex.encode()), "the regex", limits)
        # an alternation compiles like a list of choices (a bound from above: a
        # "|" escaped or in a class counts too)
        _check_alternatives(params.regex.count("|") + 1, "the regex", limits)
        return _check_repeat(regex_repeat(params.regex), "the regex", limits) + (
            params.regex.count("|"))
    if params.choice is not None:
        _check_bytes(sum(len(choice.encode()) for choice in params.choice), "the choices", limits)
        _check_alternatives(len(params.choice), "the choices", limits)
        return len(params.choice)
    if params.grammar is not None:
        _check_bytes(len(params.grammar.encode()), "the grammar", limits)
        _check_alternatives(params.grammar.count("|") + 1, "the grammar", limits)
        return _check_repeat(regex_repeat(params.grammar), "the grammar", limits) + (
            params.grammar.count("::=") + params.grammar.count("|"))
    return 1  # json_object: one builtin grammar


def _too_costly(what: str, amount: str, limit: int, flag: str) -> ConstraintTooCostly:
    return ConstraintTooCostly(f"{what} {amount}; at most {limit} can be compiled "
                               f"(--structured-outputs-{flag})",
                               limit_name=f"--structured-outputs-{flag}")


def _check_bytes(num_bytes: int, what: str, limits: ConstraintLimits) -> None:
    if num_bytes > limits.max_bytes:
        raise _too_costly(what, f"has {num_bytes} bytes", limits.max_bytes, "max-bytes")


def _check_alternatives(num: int, what: str, limits: ConstraintLimits) -> None:
    if num > limits.max_alternatives:
        raise _too_costly(what, f"list {num} alternatives (enum, const and choice values)",
                          limits.max_alternatives, "max-alternatives")


def _check_repeat(repeat: int, what: str, limits: ConstraintLimits) -> int:
    if repeat > limits.max_repeat:
        raise _too_costly(what, f"repeats something {repeat} times", limits.max_repeat,
                          "max-repeat")
    return repeat


# A counted repetition: {n}, {n,} or {n,m}.
_COUNTER = re.compile(r"\{\s*(\d{1,9})\s*(?:,\s*(\d{0,9})\s*)?\}")


def regex_repeat(pattern: str) -> int:
    """The largest count a bounded repetition in ``pattern`` expands to, nested
    counts multiplied: ``(a{10}){20}`` is 200. A scan, not a parse: character
    classes and escapes are skipped, alternatives and unbounded repeats add nothing."""
    stack = [1]  # per open group: the largest expansion inside it so far
    last_atom = 1  # the expansion of the atom a counter would apply to
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            last_atom = 1
            continue
        if char == "[":
            index = _end_of_class(pattern, index)
            last_atom = 1
            continue
        if char == "(":
            stack.append(1)
        elif char == ")" and len(stack) > 1:
            last_atom = stack.pop()
            stack[-1] = max(stack[-1], last_atom)
        elif char == "{" and (counter := _COUNTER.match(pattern, index)):
            count = int(counter.group(2) or counter.group(1))
            stack[-1] = max(stack[-1], last_atom * max(count, 1))
            last_atom = stack[-1]
            index = counter.end()
            continue
        else:
            last_atom = 1
        index += 1
    return max(stack)


def _end_of_class(pattern: str, start: int) -> int:
    """The index after the character class opening at ``start``."""
    index = start + 1
    if index < len(pattern) and pattern[index] == "^":
        index += 1
    if index < len(pattern) and pattern[index] == "]":
        index += 1
    while index < len(pattern) and pattern[index] != "]":
        index += 2 if pattern[index] == "\\" else 1
    return index + 1


# Keywords whose value is a count a compiled grammar may unroll.
_COUNT_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties",
                   "minProperties")
# Keywords holding one subschema, a list of them, or a name -> subschema map.
_ONE_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


class _SchemaWalk:
    """One walk of a JSON schema's subschemas, counting what the limits bound."""

    def __init__(self, limits: ConstraintLimits) -> None:
        self.limits = limits
        self.num_nodes = 0
        self.num_properties = 0
        self.num_alternatives = 0
        self.max_repeat = 1

    def check(self, schema_text: str) -> int:
        try:
            schema = msgspec.json.decode(schema_text)
        except (msgspec.DecodeError, RecursionError):
            return 1  # not JSON (or nested past the decoder): the compile says why, at once
        self._walk(schema, 1)
        return self.num_nodes + self.num_properties + self.num_alternatives + self.max_repeat

    def _walk(self, schema: Any, depth: int) -> None:
        if not isinstance(schema, dict):
            return  # true, false, or not a schema (the compile refuses that)
        limits = self.limits
        if depth > limits.max_depth:
            raise _too_costly("the JSON schema", f"nests deeper than {limits.max_depth} levels",
                              limits.max_depth, "max-depth")
        self.num_nodes += 1
        if self.num_nodes > limits.max_nodes:
            raise _too_costly("the JSON schema", f"has more than {limits.max_nodes} subschemas",
                              limits.max_nodes, "max-nodes")
        self._count_values(schema)
        for name, subschema in self._subschemas(schema):
            self._walk(subschema, depth + (name != "$defs"))

    def _count_values(self, schema: dict[str, Any]) -> None:
        limits = self.limits
        enum = schema.get("enum")
        self.num_alternatives += (len(enum) if isinstance(enum, list) else 0) + (
            "const" in schema)
        _check_alternatives(self.num_alternatives, "the JSON schema", limits)
        for keyword in _COUNT_KEYWORDS:
            count = schema.get(keyword)
            if isinstance(count, int) and not isinstance(count, bool):
                self.max_repeat = max(self.max_repeat, _check_repeat(
                    count, f"the JSON schema's {keyword}", limits))
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            self.max_repeat = max(self.max_repeat, _check_repeat(
                regex_repeat(pattern), "the JSON schema's pattern", limits))
        properties = schema.get("properties")
        if isinstance(properties, dict):
            # optional ones cost: xgrammar's rules for which may follow which
            required = schema.get("required")
            names = {name for name in required if isinstance(name, str)} if isinstance(
                required, list) else set()
            num_required = len(names & properties.keys())
            self.num_properties += len(properties) - num_required
            if self.num_properties > limits.max_properties:
                raise _too_costly("the JSON schema", f"has more than {limits.max_properties} "
                                  "optional object properties", limits.max_properties,
                                  "max-properties")

    @staticmethod
    def _subschemas(schema: dict[str, Any]) -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = []
        for keyword in _ONE_SUBSCHEMA:
            if keyword in schema:
                found.append((keyword, schema[keyword]))
        for keyword in _SUBSCHEMA_LISTS:
            value = schema.get(keyword)
            if isinstance(value, list):
                found += [(keyword, item) for item in value]
        for keyword in _SUBSCHEMA_MAPS:
            value = schema.get(keyword)
            if isinstance(value, dict):
                found += [(keyword, item) for item in value.values()]
        return found
