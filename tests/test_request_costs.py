"""What one request may cost (issue 22), as plain policy tests: the limits on a
constraint's shape, checked before any compile; the queue holding requests whose
grammar compiles while others are pulled; the grammar cache bounded in bytes; one
request's choices held to their share of the seats."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.constraint_cost import (
    DEFAULT_LIMITS,
    ConstraintTooCostly,
    check_constraint,
    regex_repeat,
)
from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.grammar import Grammars
from trio_llm.actors.intake import Intake
from trio_llm.actors.messages import (
    Pull,
    Request,
    SamplingOptions,
    SamplingParams,
    StructuredOutputsParams,
    Submit,
    WaitingRequest,
)
from trio_llm.actors.queue import WaitingQueue
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.gpu.builtin import resolve_model

LIMITS = DEFAULT_LIMITS


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def json_constraint(schema: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(schema))


# One constraint just past each limit, and the flag its refusal names.
PAST_EACH_LIMIT: dict[str, tuple[StructuredOutputsParams, str]] = {
    "bytes": (StructuredOutputsParams(regex="a" * (LIMITS.max_bytes + 1)), "max-bytes"),
    "depth": (json_constraint(nested(LIMITS.max_depth + 1)), "max-depth"),
    "nodes": (json_constraint({"anyOf": [{"type": "integer"}] * LIMITS.max_nodes}),
              "max-nodes"),
    "properties": (json_constraint({"type": "object", "properties": {
        f"p{i}": {} for i in range(LIMITS.max_properties + 1)}}), "max-properties"),
    "properties in all": (json_constraint({"type": "object", "properties": {
        f"o{j}": {"type": "object", "properties": {f"p{i}": {} for i in range(
            LIMITS.max_properties // 2)}} for j in range(3)}}), "max-properties"),
    "enum": (json_constraint({"enum": list(range(LIMITS.max_alternatives + 1))}),
             "max-alternatives"),
    "choices": (StructuredOutputsParams(choice=[str(i) for i in range(
        LIMITS.max_alternatives + 1)]), "max-alternatives"),
    "regex alternation": (StructuredOutputsParams(regex="|".join(
        "x" * (LIMITS.max_alternatives + 1))), "max-alternatives"),
    "nested repeat": (StructuredOutputsParams(regex="(a{64}){64}"), "max-repeat"),
    "maxLength": (json_constraint({"type": "string", "maxLength": LIMITS.max_repeat + 1}),
                  "max-repeat"),
    "pattern": (json_constraint({"type": "string", "pattern": "[a-z]{5000}"}), "max-repeat"),
    "grammar": (StructuredOutputsParams(grammar='root ::= "a"{2000}'), "max-repeat"),
}

# One constraint at each limit: admitted.
AT_EACH_LIMIT: dict[str, StructuredOutputsParams] = {
    "depth": json_constraint(nested(LIMITS.max_depth)),
    "nodes": json_constraint({"anyOf": [{"type": "integer"}] * (LIMITS.max_nodes - 1)}),
    "properties": json_constraint({"type": "object", "properties": {
        f"p{i}": {} for i in range(LIMITS.max_properties)}}),
    "enum": json_constraint({"enum": list(range(LIMITS.max_alternatives))}),
    "choices": StructuredOutputsParams(choice=[str(i) for i in range(LIMITS.max_alternatives)]),
    "repeat": StructuredOutputsParams(regex=f"(a{{32}}){{{LIMITS.max_repeat // 32}}}"),
}


@pytest.mark.parametrize("name", list(PAST_EACH_LIMIT))
def test_a_constraint_past_each_limit_is_refused_naming_its_flag(name: str) -> None:
    constraint, flag = PAST_EACH_LIMIT[name]
    with pytest.raises(ConstraintTooCostly) as refused:
        check_constraint(constraint, LIMITS)
    assert refused.value.limit_name == f"--structured-outputs-{flag}"
    assert f"--structured-outputs-{flag}" in str(refused.value)


@pytest.mark.parametrize("name", list(AT_EACH_LIMIT))
def test_a_constraint_at_each_limit_is_admitted(name: str) -> None:
    assert check_constraint(AT_EACH_LIMIT[name], LIMITS) > 0


@pytest.mark.parametrize(("pattern", "repeat"), [
    ("[a-z]{300}", 300), ("(a{10}){20}", 200), ("x{3,}", 3), ("(ab|c){5}d{7}", 7),
    (r"\{5000\}", 1), ("[{]{9}", 9), ("a{2,40}", 40), ("((a{2}){3}){4}", 24), ("no counts", 1),
])
def test_regex_repeat_multiplies_nested_counts_and_skips_escapes_and_classes(
        pattern: str, repeat: int) -> None:
    assert regex_repeat(pattern) == repeat


def make_intake(**config: Any) -> Intake:
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    return Intake(EngineConfig(**config), tokenizer, max_model_len=256, num_kv_tokens=4096,
                  vocab_size=2048)


def test_intake_refuses_past_a_limit_as_structured_outputs_and_honours_the_flag() -> None:
    constraint = json_constraint(nested(LIMITS.max_depth + 1))
    params = SamplingParams(max_tokens=4, structured_outputs=constraint)
    submit = Submit(request_id="r", prompt="hi", params=params, arrival_time=0.0)
    with pytest.raises(RequestRejected) as refused:
        make_intake().admit(submit)
    assert refused.value.param == "structured_outputs"
    assert "structured_outputs.json" in refused.value.message
    assert "--structured-outputs-max-depth" in refused.value.message
    deeper = make_intake(structured_outputs_max_depth=LIMITS.max_depth + 1).admit(submit)
    assert deeper.params.structured_outputs == constraint


def make_request(request_id: str, arrival_index: int, *, group_id: str | None = None,
                 constraint: StructuredOutputsParams | None = None) -> Request:
    sampling = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                               num_logprobs=None, min_tokens=0, banned_token_ids=[])
    return Request(request_id=request_id, prompt_token_ids=[1, 2, 3],
                   params=SamplingParams(structured_outputs=constraint), sampling=sampling,
                   stop_token_ids=[], max_tokens=4, priority=0, arrival_index=arrival_index,
                   arrival_time=0.0, group_id=group_id)


def ids(requests: list[WaitingRequest]) -> list[str]:
    return [waiting.request.request_id for waiting in requests]


def test_a_groups_requests_are_pulled_only_up_to_its_seats_and_keep_their_place() -> None:
    queue = WaitingQueue(EngineConfig(max_num_seqs=8, max_seq_share=0.5))  # 4 seats a group
    for index in range(8):
        queue.admit(make_request(f"n{index}", index, group_id="big"))
    queue.admit(make_request("witness", 8))
    assert ids(queue.pop_best(8, Pull(max_requests=8, wait=False))) == [
        "n0", "n1", "n2", "n3", "witness"]
    # two of its requests run: two more seats
    pulled = queue.pop_best(8, Pull(max_requests=8, wait=False, group_seats={"big": 2}))
    assert ids(pulled) == ["n4", "n5"]
    assert ids(queue.pop_best(8, Pull(max_requests=8, wait=False, group_seats={"big": 0}))) == []
    assert len(queue) == 2
    assert ids(queue.pop_best(8)) == ["n6", "n7"], "a pop without a Pull passes over no one"


class FakeGrammars:
    """Grammars as the queue sees them: compiled or not."""

    def __init__(self) -> None:
        self.compiled: set[str] = set()

    def is_compiled(self, params: StructuredOutputsParams) -> bool:
        return params.regex in self.compiled


def test_a_request_whose_grammar_compiles_waits_while_later_ones_are_pulled() -> None:
    grammars = FakeGrammars()
    queue = WaitingQueue(EngineConfig(max_waiting_requests=3), grammars)  # type: ignore[arg-type]
    slow = StructuredOutputsParams(regex="slow")
    queue.admit(make_request("first", 0, constraint=slow))
    queue.admit(make_request("twin", 1, constraint=slow))
    queue.admit(make_request("plain", 2))
    assert queue.take_compiles() == [slow], "one compile for the two"
    assert queue.take_compiles() == []
    assert queue.statistics().num_compiling == 2
    assert not queue.admit(make_request("over", 3)), "compiling requests count in the bound"
    queue.remember_pull(Pull(max_requests=8, wait=True))
    pulled = queue.answer_pull()
    assert pulled is not None and ids(pulled.requests) == ["plain"]
    queue.remember_pull(Pull(max_requests=8, wait=True))
    assert queue.answer_pull() is None, "a waiting Pull is not answered with nothing"
    assert queue.abort("twin"), "aborted while compiling: it never ran"
    grammars.compiled.add("slow")
    assert queue.on_compiled(slow, None) == ([], [])
    pulled = queue.answer_pull()
    assert pulled is not None and ids(pulled.requests) == ["first"]
    assert queue.statistics().num_compiling == 0


def test_a_constraint_that_does_not_compile_fails_its_requests_and_aborts_preempted_ones(
        ) -> None:
    queue = WaitingQueue(EngineConfig(), FakeGrammars())  # type: ignore[arg-type]
    bad = StructuredOutputsParams(regex="bad")
    queue.admit(make_request("new", 0, constraint=bad))
    queue.requeue([WaitingRequest(request=make_request("old", 1, constraint=bad),
                                  output_token_ids=[7], num_preemptions=1)])
    assert queue.take_compiles() == [bad]
    never_ran, preempted = queue.on_compiled(bad, RequestRejected("no", param="x"))
    assert (never_ran, preempted) == (["new"], ["old"])
    assert len(queue) == 0
    queue.forget_abort("old")  # the scheduler's AbortOutcome: nothing is left behind
    assert not queue.requeue([]) and queue.pop_best(8) == []


def test_the_grammar_cache_keeps_its_bound_in_bytes_least_recently_used_first() -> None:
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    probe = Grammars(tokenizer, 2048)
    one = probe.compile(StructuredOutputsParams(choice=["w0", "x0"]))
    bound = 3 * int(one.memory_size_bytes) + 1
    grammars = Grammars(tokenizer, 2048, cache_bytes=bound)
    constraints = [StructuredOutputsParams(choice=[f"w{i}", f"x{i}"]) for i in range(40)]
    for constraint in constraints:
        grammars.compile(constraint)
        grammars.lookup(constraints[0])  # kept in use: never the least recently used
        assert grammars.num_cached_bytes <= bound
    assert 2 <= grammars.num_cached <= 3  # (sizes differ by a few bytes)
    assert grammars.is_compiled(constraints[0]) and grammars.is_compiled(constraints[-1])
    assert not grammars.is_compiled(constraints[1])


def test_a_prompt_too_long_for_any_tokenization_is_refused_without_tokenizing_it() -> None:
    intake = make_intake()
    encoded: list[int] = []
    encode = intake.tokenizer.encode

    def counting_encode(text: str, **kwargs: Any) -> list[int]:
        encoded.append(len(text))
        return encode(text, **kwargs)

    intake.tokenizer.encode = counting_encode  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4)
    for text in ("x" * (intake.max_prompt_chars + 1), "x" * 7_000_000):
        with pytest.raises(RequestRejected) as refused:
            intake.admit(Submit(request_id="r", prompt=text, params=params, arrival_time=0.0))
        assert refused.value.param == "prompt" and "maximum context length" in str(
            refused.value)
    assert encoded == []
    with pytest.raises(RequestRejected):  # just under: tokenized, then refused by its count
        intake.admit(Submit(request_id="r", prompt="ab " * 2000, params=params,
                            arrival_time=0.0))
    assert encoded == [6000]
