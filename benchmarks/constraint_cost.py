"""What compiling a constraint costs, against its shape: the figures behind the
structured-output limits (actors/grammar.py, ConstraintLimits; docs/reliability.md).

    python benchmarks/constraint_cost.py            # every shape, a few sizes each
    python benchmarks/constraint_cost.py enum depth # some shapes

Each case compiles in a fresh process, with xgrammar as the engine drives it (the
tiny model's vocabulary, JSON without free whitespace, xgrammar's cache off) and
prints the compile's seconds, the compiled grammar's own size (xgrammar's
``memory_size_bytes``), the growth of the process's peak RSS over the compile,
and whether the engine's pre-check (``check_constraint``, default limits) admits
it. A figure, not a test.
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from trio_llm.actors.constraint_cost import DEFAULT_LIMITS, ConstraintTooCostly, check_constraint
from trio_llm.actors.messages import StructuredOutputsParams

VOCAB_SIZE = 2048  # the tiny model's


def enum_schema(size: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps({"enum": [f"value-{i}-of-the-enum"
                                                             for i in range(size)]}))


def choice_list(size: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=[f"choice number {i}" for i in range(size)])


def nested_schema(depth: int) -> StructuredOutputsParams:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return StructuredOutputsParams(json=json.dumps(schema))


def wide_schema(num_properties: int) -> StructuredOutputsParams:
    properties = {f"p{i}": {"type": "integer"} for i in range(num_properties)}
    return StructuredOutputsParams(json=json.dumps(
        {"type": "object", "properties": properties, "required": list(properties)[:8]}))


def optional_properties(num_properties: int) -> StructuredOutputsParams:
    """All optional: xgrammar's rules for which may follow which grow fastest here."""
    properties = {f"p{i}": {"type": "string", "maxLength": 4} for i in range(num_properties)}
    return StructuredOutputsParams(json=json.dumps({"type": "object",
                                                    "properties": properties}))


def ref_fan_out(num_definitions: int) -> StructuredOutputsParams:
    """Each definition refers to the next twice: a tree of references 2^n wide if expanded."""
    defs: dict[str, Any] = {f"d{num_definitions}": {"type": "integer"}}
    for i in range(num_definitions - 1, -1, -1):
        child = {"$ref": f"#/$defs/d{i + 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"l": child, "r": child},
                         "required": ["l", "r"]}
    return StructuredOutputsParams(json=json.dumps({"$ref": "#/$defs/d0", "$defs": defs}))


def any_of(num_branches: int) -> StructuredOutputsParams:
    branches = [{"type": "object", "properties": {"kind": {"const": f"k{i}"},
                                                  "v": {"type": "integer"}},
                 "required": ["kind", "v"]} for i in range(num_branches)]
    return StructuredOutputsParams(json=json.dumps({"anyOf": branches}))


def tools(num_tools: int) -> StructuredOutputsParams:
    """tool_choice "required" over ``num_tools`` small functions (api/tool_calls.py's schema)."""
    calls = [{"type": "object", "properties": {
        "name": {"const": f"function_{i}"},
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}},
                       "required": ["city"]}}, "required": ["name", "parameters"]}
             for i in range(num_tools)]
    return StructuredOutputsParams(json=json.dumps(
        {"type": "array", "minItems": 1, "items": {"anyOf": calls}}))


def regex_repeat(count: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"[a-z0-9]{{{count}}}")


def regex_length(num_chars: int) -> StructuredOutputsParams:
    words = "|".join(f"w{i:05d}" for i in range(num_chars // 7))
    return StructuredOutputsParams(regex=f"({words})")


def string_length(max_length: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps({"type": "string", "minLength": max_length,
                                                    "maxLength": max_length}))


def grammar_rules(num_rules: int) -> StructuredOutputsParams:
    rules = [f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(num_rules)]
    rules.append(f'r{num_rules} ::= "z"')
    return StructuredOutputsParams(grammar="root ::= r0\n" + "\n".join(rules))


def nested_repeat(count: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"([a-z]{{{count}}}){{{count}}}")


def _at_limits() -> list[StructuredOutputsParams]:
    """The costliest constraints the default limits admit, one per limit (and mixes)."""
    limits = DEFAULT_LIMITS
    long_string = {"type": "string", "maxLength": limits.max_repeat}
    return [
        nested_schema(limits.max_depth - 1),
        StructuredOutputsParams(json=json.dumps({"anyOf": [
            {"type": "object", "properties": {"k": {"const": i}, "v": {"type": "integer"}},
             "required": ["k", "v"]} for i in range(limits.max_nodes // 4)]})),
        optional_properties(limits.max_properties),
        wide_schema(limits.max_properties),
        StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {
            f"o{j}": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                       for i in range(254)}}
            for j in range(2)}})),
        enum_schema(limits.max_alternatives),
        choice_list(limits.max_alternatives),
        tools(128),
        StructuredOutputsParams(json=json.dumps({"type": "array", "maxItems": limits.max_repeat,
                                                 "items": long_string})),
        nested_repeat(32),
        regex_length(limits.max_bytes - 1000),
    ]


def at_limits(index: int) -> StructuredOutputsParams:
    return _at_limits()[index]


SHAPES: dict[str, tuple[Callable[[int], StructuredOutputsParams], list[int]]] = {
    "at_limits": (at_limits, list(range(11))),
    "nested_repeat": (nested_repeat, [16, 32, 64]),
    "enum": (enum_schema, [1000, 2000, 4000, 8000, 16000]),
    "choice": (choice_list, [1000, 2000, 4000, 8000]),
    "depth": (nested_schema, [16, 32, 64, 128, 256]),
    "properties": (wide_schema, [100, 500, 1000, 2000]),
    "optional": (optional_properties, [128, 256, 384, 512]),
    "refs": (ref_fan_out, [8, 16, 32, 64]),
    "anyof": (any_of, [100, 500, 1000, 2000]),
    "tools": (tools, [64, 128, 256, 512, 1024]),
    "regex_repeat": (regex_repeat, [64, 256, 1024, 4096]),
    "regex_chars": (regex_length, [1000, 4000, 16000, 64000]),
    "string_length": (string_length, [256, 1024, 4096]),
    "grammar_rules": (grammar_rules, [100, 500, 1000, 2000]),
}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measure(shape: str, size: int, results: Any) -> None:
    """In a fresh process: one compile's seconds, grammar bytes and peak RSS growth."""
    from trio_llm.actors.grammar import Grammars
    from trio_llm.actors.tokenizer import Tokenizer
    from trio_llm.gpu.builtin import resolve_model

    grammars = Grammars(Tokenizer.from_dir(str(resolve_model("tiny"))), VOCAB_SIZE)
    params = SHAPES[shape][0](size)
    grammars.compile(StructuredOutputsParams(regex="warm"))  # the compiler, built once
    before = _peak_rss_mib()
    started = time.perf_counter()
    try:
        compiled = grammars.compile(params)
        outcome = f"{compiled.memory_size_bytes / 2**20:8.1f}"
    except Exception as error:  # an xgrammar refusal is a figure too
        outcome = f"error: {str(error)[:40]}"
    seconds = time.perf_counter() - started
    results.put((seconds, outcome, _peak_rss_mib() - before))


def measure(shape: str, size: int) -> tuple[float, str, float]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_measure, args=(shape, size, results))
    process.start()
    outcome = results.get()
    process.join()
    return outcome


def pre_check(shape: str, size: int) -> str:
    try:
        check_constraint(SHAPES[shape][0](size), DEFAULT_LIMITS)
        return "admitted"
    except ConstraintTooCostly as error:
        return f"refused ({error.limit_name})"


def cases(names: list[str]) -> Iterator[tuple[str, int]]:
    for name in names or list(SHAPES):
        for size in SHAPES[name][1]:
            yield name, size


def main() -> None:
    print(f"{'shape':<14} {'size':>6} {'bytes':>8} {'compile s':>10} {'grammar MiB':>12} "
          f"{'peak RSS +MiB':>14}  pre-check")
    for shape, size in cases(sys.argv[1:]):
        params = SHAPES[shape][0](size)
        num_bytes = len(msgspec.json.encode(params))
        seconds, grammar_mib, rss_mib = measure(shape, size)
        print(f"{shape:<14} {size:>6} {num_bytes:>8} {seconds:>10.3f} {grammar_mib:>12} "
              f"{rss_mib:>14.1f}  {pre_check(shape, size)}", flush=True)


if __name__ == "__main__":
    main()
