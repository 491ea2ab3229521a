"""Structured outputs on the tiny model, whose random weights know nothing of JSON:
every valid document below is the grammar's doing.

20 JSON schemas of different shapes, regex and choice constraints, an EBNF grammar,
max_tokens ending a constrained request with "length", depth 1 equal to depth 2
(alone and batched with unconstrained requests, preempted, through the CPU runner
and through the pipelined executor's deferred sampling), the scheduler sending a
pipelined request's bitmask after reconcile, and constraints the engine cannot
compile refused with the problem named.
"""

from __future__ import annotations

import json
import re
from contextlib import aclosing
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
import trio
from msgspec.structs import replace

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.grammar import Grammars, accept_tokens, fill_bitmasks
from trio_llm.actors.intake import Intake
from trio_llm.actors.messages import (
    SamplingParams,
    StepResult,
    StructuredOutputsParams,
    Submit,
    WaitingRequest,
)
from trio_llm.actors.scheduler import Scheduler
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.api.engine import Engine
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
from trio_llm.gpu.loader import load_model

CONFIG = EngineConfig(model="tiny", num_kv_blocks=512, block_size=16, max_num_seqs=32,
                      max_num_batched_tokens=512, max_model_len=512)
TIMEOUT = 300
PROMPT = "Write it down:"
SHORT = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": SHORT}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"role": {"enum": ["admin", "user", "guest"]}},
     "required": ["role"]},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
     "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                         "maximum": 999}, "tag": SHORT},
                 "required": ["id", "tag"]}}, "required": ["user"]},
    {"type": "object", "properties": {
        "points": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                   "maximum": 9},
                                             "y": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
            "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "object", "properties": {"a": SHORT, "b": {"type": "boolean"},
                                      "c": {"type": "null"}}, "required": ["a", "b", "c"]},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "boolean"},
    {"type": "object", "properties": {"kind": {"const": "circle"},
                                      "radius": {"type": "integer", "minimum": 1,
                                                 "maximum": 50}},
     "required": ["kind", "radius"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["none"]}]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT,
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "label": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["level", "label"]},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 3},
                                      {"enum": ["a", "b"]}],
     "items": False, "minItems": 2},
    {"type": "object", "properties": {"deep": {"type": "object", "properties": {
        "deeper": {"type": "object", "properties": {"deepest": {"type": "boolean"}},
                   "required": ["deepest"]}}, "required": ["deeper"]}},
     "required": ["deep"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "count": {"type": "integer", "minimum": 0,
                                                "maximum": 7}},
     "required": ["code", "count"]},
]


def constrained(seed: int, max_tokens: int = 160, **constraint: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                          structured_outputs=StructuredOutputsParams(**constraint))


async def generate(engine: Engine, params: SamplingParams,
                   prompt: str | list[int] = PROMPT) -> tuple[str, list[int], str | None]:
    text, token_ids, finish_reason = "", [], None
    async for output in engine.generate(prompt, params):
        text += output.text
        token_ids += output.token_ids
        finish_reason = output.finish_reason
    return text, token_ids, finish_reason


async def generate_all(engine: Engine, requests: list[tuple[Any, SamplingParams]]
                       ) -> list[tuple[str, list[int], str | None]]:
    results: list[Any] = [None] * len(requests)

    async def one(index: int) -> None:
        prompt, params = requests[index]
        results[index] = await generate(engine, params, prompt)

    async with trio.open_nursery() as nursery:
        for index in range(len(requests)):
            nursery.start_soon(one, index)
    return results


async def test_twenty_json_schemas_each_yield_valid_documents() -> None:
    assert len(SCHEMAS) == 20
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    requests = [(PROMPT, constrained(index, json=json.dumps(schema)))
                for index, schema in enumerate(SCHEMAS)]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            results = await generate_all(engine, requests)
    for schema, (text, _, finish_reason) in zip(SCHEMAS, results, strict=True):
        assert finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
        assert "  " not in text and "\n" not in text, "whitespace is bounded"


async def test_regex_choice_grammar_and_json_object() -> None:
    pattern = r"[a-z]{2,6}@[0-9]{1,3}\.(com|org)"
    choices = ["yes", "no", "maybe so"]
    requests = [(PROMPT, constrained(seed, regex=pattern)) for seed in range(3)]
    requests += [(PROMPT, constrained(seed, choice=choices)) for seed in range(3)]
    requests += [(PROMPT, constrained(0, grammar='root ::= ("ab" | "cd")+ "!"'))]
    requests += [(PROMPT, constrained(0, max_tokens=300, json_object=True))]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            results = await generate_all(engine, requests)
    texts = [text for text, _, _ in results]
    assert all(finish_reason in ("stop", "length") for _, _, finish_reason in results)
    for text, _, finish_reason in results[:7]:
        assert finish_reason == "stop", text
    assert all(re.fullmatch(pattern, text) for text in texts[:3]), texts[:3]
    assert all(text in choices for text in texts[3:6]), texts[3:6]
    assert re.fullmatch(r"(ab|cd)+!", texts[6]), texts[6]
    text, _, finish_reason = results[7]
    assert text.startswith("{")
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


async def test_max_tokens_ends_a_constrained_request_with_length() -> None:
    schema = {"type": "object", "properties": {"text": {"type": "string"}},
              "required": ["text"]}
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            text, token_ids, finish_reason = await generate(
                engine, constrained(0, max_tokens=5, json=json.dumps(schema)))
    assert finish_reason == "length" and len(token_ids) == 5
    # cut off: a beginning of the schema's document (however the model spelled it in
    # five tokens), not yet a document
    compact = "".join(text.split())
    assert compact.startswith('{"text"') or '{"text"'.startswith(compact)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def mixed_workload() -> list[tuple[list[int], SamplingParams]]:
    """Constrained and unconstrained requests, greedy and sampled."""
    workload: list[tuple[list[int], SamplingParams]] = []
    for index in range(12):
        prompt = [3 + (index * 37 + offset * 11) % 900 for offset in range(5 + index * 3)]
        if index % 3 == 0:
            params = SamplingParams(max_tokens=12 + index, temperature=0.8, seed=index,
                                    ignore_eos=True)
        else:
            schema = SCHEMAS[index % len(SCHEMAS)]
            params = constrained(index, max_tokens=40 + index, json=json.dumps(schema))
            if index % 4 == 1:
                params = replace(params, temperature=0.0)
        workload.append((prompt, params))
    return workload


async def test_depth_one_equals_depth_two_alone_batched_and_preempted() -> None:
    workload = mixed_workload()
    depth_1 = replace(CONFIG, pipeline_depth=1)
    # 12 blocks of 8 tokens: the batch does not fit, requests are preempted and recomputed
    cramped = replace(CONFIG, num_kv_blocks=12, block_size=8, max_model_len=96)
    with trio.fail_after(TIMEOUT):
        async with Engine.open(depth_1) as engine:
            alone = [(await generate(engine, params, prompt))[1] for prompt, params in workload]
        async with Engine.open(CONFIG) as engine:
            batched = [token_ids for _, token_ids, _ in await generate_all(engine, workload)]
        async with Engine.open(depth_1) as engine:
            batched_depth_1 = [token_ids for _, token_ids, _ in
                               await generate_all(engine, workload)]
        async with Engine.open(cramped) as engine:
            preempted = [token_ids for _, token_ids, _ in await generate_all(engine, workload)]
            num_preemptions = engine.statistics().num_preemptions
    assert all(alone)
    assert batched == alone
    assert batched_depth_1 == alone
    assert num_preemptions > 0
    assert preempted == alone


@pytest.mark.parametrize(("constraint", "named"), [
    ({"json": '{"type": "objec"}'}, "objec"),
    ({"regex": "[0-9"}, "Unclosed"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ({"choice": []}, "at least one"),
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
])
async def test_uncompilable_constraints_are_refused_naming_the_problem(
        constraint: dict[str, Any], named: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            with pytest.raises(RequestRejected) as caught:
                await generate(engine, constrained(0, **constraint))
            # the engine goes on serving
            text, _, finish_reason = await generate(engine, constrained(1, choice=["fine"]))
    assert named in caught.value.message
    assert caught.value.param == "structured_outputs"
    assert (text, finish_reason) == ("fine", "stop")


@pytest.mark.parametrize("field", ["ignore_eos", "min_tokens"])
async def test_fields_that_contradict_a_grammar_are_refused(field: str) -> None:
    params = replace(constrained(0, choice=["a"]), **{field: 1 if field == "min_tokens" else True})
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            with pytest.raises(RequestRejected) as caught:
                await generate(engine, params)
    assert caught.value.param == field


async def test_choices_with_quotes_backslashes_and_accents_come_out_verbatim() -> None:
    choices = ['say "hi"', "back\\slash", "café", "naïve"]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            results = await generate_all(engine, [(PROMPT, constrained(seed, choice=choices))
                                                  for seed in range(8)])
    assert all(finish_reason == "stop" for _, _, finish_reason in results)
    assert {text for text, _, _ in results} <= set(choices)


# -- depth 2 keeps constrained requests in every step ---------------------------------


def allowed_ids(token_bitmask: bytes) -> set[int]:
    bits = np.unpackbits(np.frombuffer(token_bitmask, dtype=np.uint8), bitorder="little")
    return {int(token_id) for token_id in np.flatnonzero(bits)}


def test_a_steps_masks_filled_in_one_call_are_each_matchers_own() -> None:
    """fill_bitmasks (xgrammar's batch fill, the JSON rows narrowed at once) gives every
    row the mask its matcher fills alone, narrowed as its own; a terminated matcher's
    row allows everything; accept_tokens advances each matcher as accept does."""
    import xgrammar

    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    grammars = Grammars(tokenizer, vocab_size=2048)
    constraints = [StructuredOutputsParams(json=json.dumps(SCHEMAS[index])) for index in (0, 6)]
    constraints.append(StructuredOutputsParams(regex="[a-c]{1,3}"))
    states = [grammars.start(constraints[index % 3]) for index in range(9)]
    twins = [grammars.start(constraints[index % 3]) for index in range(9)]
    for step in range(6):  # each row walks on, by its own mask, a different number of steps
        walking = [index for index, state in enumerate(states)
                   if index > step and not state.is_terminated]
        masks = fill_bitmasks([states[index] for index in walking])
        token_ids = [sorted(allowed_ids(mask))[(step + index) % len(allowed_ids(mask))]
                     for index, mask in zip(walking, masks, strict=True)]
        assert all(accept_tokens([states[index] for index in walking], token_ids))
        for index, token_id in zip(walking, token_ids, strict=True):
            assert twins[index].accept(token_id)
    terminated = grammars.start(StructuredOutputsParams(choice=["a"]))
    assert terminated.accept(tokenizer.encode("a")[0])
    assert terminated.accept(tokenizer.eos_token_ids[0]) and terminated.is_terminated
    states.append(terminated)
    twins.append(terminated)
    masks = fill_bitmasks(states)
    json_rows = [index for index in range(9) if index % 3 != 2]  # all narrowed at once
    assert fill_bitmasks([states[index] for index in json_rows]) == [
        masks[index] for index in json_rows]
    for mask, twin in zip(masks, twins, strict=True):
        own = xgrammar.allocate_token_bitmask(1, 2048)
        if twin.is_terminated:
            assert mask == b"\xff" * len(mask)
            continue
        twin._matcher.fill_next_token_bitmask(own, 0)
        words = own.numpy()[0]
        if twin._allowed_words is not None:  # a JSON row: no control characters
            words &= twin._allowed_words
        assert mask == words.tobytes()


def test_the_scheduler_hands_out_each_steps_grammars_once_every_step_before_is_reconciled(
        ) -> None:
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    grammars = Grammars(tokenizer, vocab_size=2048)
    scheduler = Scheduler(CONFIG, 64, grammars)
    params = constrained(0, choice=["yes", "no"])
    intake = Intake(CONFIG, tokenizer, max_model_len=512, num_kv_tokens=64 * 16,
                    vocab_size=2048)
    request = intake.admit(Submit(request_id="r", prompt_token_ids=[5, 6, 7], params=params,
                                  arrival_time=0.0))
    grammars.compile(params.structured_outputs)  # type: ignore[arg-type]  # the queue's part
    first = scheduler.schedule([WaitingRequest(request=request)]).batch
    assert first is not None and first.requests[0].bitmask_follows
    assert first.requests[0].token_bitmask is None, "masks never ride in the batch"
    ready = scheduler.ready_bitmasks()
    assert ready is not None and ready[0] == first.step_id, "nothing before it: at once"
    (first_grammar,) = ready[1]
    first_allowed = allowed_ids(fill_bitmasks([first_grammar])[0])
    assert scheduler.ready_bitmasks() is None, "each step once"
    # planned while step 0 is in flight: it runs on the placeholder, its mask follows
    second = scheduler.schedule([]).batch
    assert second is not None
    (scheduled,) = second.requests
    assert scheduled.input_from_previous_step and scheduled.bitmask_follows
    assert scheduled.token_bitmask is None
    assert scheduler.ready_bitmasks() is None, "not before step 0's result"
    token_id = min(first_allowed)
    scheduler.on_step_result(StepResult(step_id=first.step_id, request_ids=["r"],
                                        sampled_token_ids=[token_id]))
    ready = scheduler.ready_bitmasks()
    assert ready is not None and ready[0] == second.step_id
    (mask,) = fill_bitmasks(ready[1])
    expected = grammars.start(params.structured_outputs)  # type: ignore[arg-type]
    assert allowed_ids(expected.next_bitmask()) == first_allowed
    assert expected.accept(token_id)
    assert allowed_ids(mask) == allowed_ids(expected.next_bitmask())
    assert scheduler.ready_bitmasks() is None, "sent once"


async def test_the_pipelined_executor_at_depth_two_gives_depth_one_tokens() -> None:
    """The CUDA executor's launch / supply_bitmasks / collect path (on the CPU its
    streams are no-ops), driven by the pipelined runner, against depth 1."""
    workload = mixed_workload()
    path = resolve_model("tiny")
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    executor = CudaModelExecutor(model, model_path=path, num_kv_blocks=CONFIG.num_kv_blocks or 0,
                                 block_size=CONFIG.block_size,
                                 max_model_len=CONFIG.max_model_len or 0)
    executor.start(CudaExecutorOptions(max_num_seqs=CONFIG.max_num_seqs,
                                       use_cuda_graphs=False, use_fused_kernels=False))
    supplied: list[int] = []
    supply_bitmasks = executor.supply_bitmasks

    def counting_supply(pending: Any, token_bitmasks: list[bytes]) -> None:
        supplied.append(len(token_bitmasks))
        supply_bitmasks(pending, token_bitmasks)

    executor.supply_bitmasks = counting_supply  # type: ignore[method-assign]
    with trio.fail_after(TIMEOUT):
        # on the CPU too where a GPU is: the pipelined executor above runs there
        async with Engine.open(replace(CONFIG, pipeline_depth=1, device="cpu")) as engine:
            alone = [(await generate(engine, params, prompt))[1] for prompt, params in workload]
        async with Engine.open(CONFIG, executor=executor) as engine:
            pipelined = [token_ids for _, token_ids, _ in await generate_all(engine, workload)]
    assert pipelined == alone
    assert len(supplied) > 10 and max(supplied) > 1, "constrained rows ran on placeholders"


async def test_aborting_constrained_requests_mid_flight_disturbs_no_one() -> None:
    schema = json.dumps({"type": "object", "properties": {"text": {"type": "string"}},
                         "required": ["text"]})
    survivor = constrained(99, max_tokens=30, json=json.dumps(SCHEMAS[7]))
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            expected = await generate(engine, survivor)

            async def leave_after(num_outputs: int, seed: int) -> None:
                async with aclosing(engine.generate(PROMPT, constrained(
                        seed, max_tokens=200, json=schema))) as outputs:
                    async for _ in outputs:
                        num_outputs -= 1
                        if num_outputs <= 0:
                            break

            results: list[Any] = []

            async def survive() -> None:
                results.append(await generate(engine, survivor))

            async with trio.open_nursery() as nursery:
                for index in range(8):
                    nursery.start_soon(leave_after, 1 + index % 4, index)
                nursery.start_soon(survive)
            # channels are FIFO: once a later request finished, every abort was handled
            await generate(engine, constrained(0, choice=["ok"]))
            stats = engine.statistics()
    assert results == [expected]
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("num_fillers", [0, 300])
def test_the_vocabulary_view_is_the_one_xgrammar_builds_through_transformers(
        num_fillers: int) -> None:
    """actors/grammar.py reads xgrammar's TokenizerInfo off the tokenizers backend;
    xgrammar's own path wraps it in a transformers tokenizer first (12 s for the
    built-in qwen3-0.6b's 150k added fillers, which the padded case imitates)."""
    from tokenizers import AddedToken

    from trio_llm.actors.grammar import _tokenizer_info_through_transformers, tokenizer_info

    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    tokenizer.backend.add_tokens([AddedToken(f"<|filler_{index}|>", special=False,
                                             normalized=False) for index in range(num_fillers)])
    vocab_size = 2048 + num_fillers + 5  # the model's vocabulary may be larger
    direct = tokenizer_info(tokenizer, vocab_size)
    through = _tokenizer_info_through_transformers(tokenizer, vocab_size)
    assert direct.vocab_type == through.vocab_type
    assert direct.add_prefix_space == through.add_prefix_space
    assert direct.vocab_size == through.vocab_size == vocab_size
    assert direct.stop_token_ids == through.stop_token_ids
    assert direct.special_token_ids == through.special_token_ids
    assert direct.decoded_vocab == through.decoded_vocab


async def test_the_scheduler_actor_never_compiles_and_sends_masks_after_batches() -> None:
    """A pulled request whose grammar is not compiled (the queue compiles; a grammar
    may leave the cache before its request starts) goes back to the queue at once:
    the scheduler never compiles. Once compiled, a step's masks are filled at once, in
    one call on the event loop (xgrammar works without the GIL; a worker thread waited
    for the GIL to start), and reach the runner right after its batch."""
    import threading

    from trio_llm.actors import scheduler as scheduler_module
    from trio_llm.actors.messages import Pull, Pulled, Requeue, ScheduledBatch, StepBitmasks
    from trio_llm.actors.scheduler import run_scheduler

    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    grammars = Grammars(tokenizer, vocab_size=2048)
    params = constrained(0, choice=["yes", "no"])
    constraint = params.structured_outputs
    assert constraint is not None and not grammars.is_compiled(constraint)
    event_loop_thread = threading.current_thread()
    filled_on = []
    compile, fill = grammars.compile, scheduler_module.fill_bitmasks

    def refused_compile(params: Any) -> Any:
        raise AssertionError("the scheduler compiled")

    def recording_fill(states: Any) -> list[bytes]:
        filled_on.append(threading.current_thread())
        return fill(states)

    grammars.compile = refused_compile  # type: ignore[method-assign]
    intake = Intake(CONFIG, tokenizer, max_model_len=512, num_kv_tokens=512 * 16,
                    vocab_size=2048)
    request = intake.admit(Submit(request_id="r", prompt_token_ids=[5, 6, 7], params=params,
                                  arrival_time=0.0))
    inbox_send, inbox = trio.open_memory_channel[Any](8)
    queue_outbox, from_scheduler = trio.open_memory_channel[Any](8)
    runner_outbox, to_runner = trio.open_memory_channel[Any](8)
    detokenizer_outbox, to_detokenizer = trio.open_memory_channel[Any](8)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            scheduler_module.fill_bitmasks = recording_fill
            try:
                await nursery.start(run_scheduler, inbox, queue_outbox, runner_outbox,
                                    detokenizer_outbox, Scheduler(CONFIG, 512, grammars))
                assert isinstance(await from_scheduler.receive(), Pull)
                pulled = Pulled(requests=[WaitingRequest(request=request)], num_waiting=0)
                await inbox_send.send(pulled)
                requeue = await from_scheduler.receive()
                assert isinstance(requeue, Requeue) and requeue.requests == pulled.requests
                assert isinstance(await from_scheduler.receive(), Pull)
                compile(constraint)  # as the queue does, in its worker thread
                await inbox_send.send(pulled)
                batch = await to_runner.receive()
                assert isinstance(batch, ScheduledBatch) and batch.requests[0].bitmask_follows
                bitmasks = await to_runner.receive()
                assert isinstance(bitmasks, StepBitmasks) and bitmasks.step_id == batch.step_id
                (mask,) = bitmasks.token_bitmasks
                expected = grammars.start(constraint, grammars.lookup(constraint))
                assert allowed_ids(mask) == allowed_ids(expected.next_bitmask())
            finally:
                scheduler_module.fill_bitmasks = fill
            nursery.cancel_scope.cancel()
    assert filled_on == [event_loop_thread]


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
async def test_on_cuda_twenty_schemas_yield_valid_documents_through_graphs_and_kernels(
        depth: int) -> None:
    """The whole engine on the device (CUDA graphs, the fused sampling kernel, masks
    uploaded after the forward pass at depth 2): every document validates, and no
    request stalls."""
    config = replace(CONFIG, device="cuda", dtype="float32", pipeline_depth=depth)
    requests = [(PROMPT, constrained(index, json=json.dumps(schema)))
                for index, schema in enumerate(SCHEMAS)]
    requests += [(PROMPT, SamplingParams(max_tokens=64, temperature=0.8, seed=index,
                                         ignore_eos=True)) for index in range(12)]
    with trio.fail_after(120):
        async with Engine.open(config) as engine:
            results = await generate_all(engine, requests)
    for schema, (text, _, finish_reason) in zip(SCHEMAS, results, strict=False):
        assert finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert all(len(token_ids) == 64 for _, token_ids, _ in results[len(SCHEMAS):])


class BlockedCompiles:
    """Holds every grammar compile in its worker thread until ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        from trio_llm.actors import grammar

        self.released = threading.Event()
        self.started = trio.Event()
        self.num_started = 0
        compile_with = grammar.Grammars._compile_with

        def blocked(compiler: Any, params: StructuredOutputsParams) -> Any:
            self.num_started += 1
            trio.from_thread.run_sync(self.started.set)
            self.released.wait(60)
            return compile_with(compiler, params)

        monkeypatch.setattr(grammar.Grammars, "_compile_with", staticmethod(blocked))

    def release(self) -> None:
        self.released.set()


async def test_a_request_behind_a_compiling_constraint_is_not_held_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue compiles a new constraint in a worker thread: the requests
    submitted after it are pulled and run meanwhile; it runs once compiled."""
    compiles = BlockedCompiles(monkeypatch)
    schema = {"type": "object", "properties": {"held": {"type": "boolean"}},
              "required": ["held"]}
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results: dict[str, Any] = {}
    try:
        with trio.fail_after(TIMEOUT):
            async with Engine.open(CONFIG) as engine:
                async def held() -> None:
                    results["held"] = await generate(engine, constrained(0, json=json.dumps(
                        schema)))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(held)
                    await compiles.started.wait()
                    _, token_ids, _ = await generate(engine, plain)
                    assert len(token_ids) == 8 and "held" not in results
                    compiles.release()
    finally:
        compiles.release()
    text, _, finish_reason = results["held"]
    assert finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


async def test_an_abort_while_its_constraint_compiles_is_not_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An Abort for a request whose constraint still compiles removes it from the
    queue: it never runs (a long regex would keep it running for hundreds of
    tokens), nothing is left behind."""
    compiles = BlockedCompiles(monkeypatch)
    long_output = constrained(0, max_tokens=400, regex="[a-z]{300}")
    try:
        with trio.fail_after(TIMEOUT):
            async with Engine.open(CONFIG) as engine:
                with trio.CancelScope() as scope:
                    async def cancel_once_compiling() -> None:
                        await compiles.started.wait()
                        scope.cancel()  # the caller leaves: the facade sends Abort

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(cancel_once_compiling)
                        await generate(engine, long_output)
                assert scope.cancelled_caught and compiles.num_started == 1
                compiles.release()
                # compiled after the first (one compile at a time in a lane)
                text, _, _ = await generate(engine, constrained(1, choice=["ok"]))
                stats = engine.statistics()
    finally:
        compiles.release()
    assert text == "ok"
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_generation_tokens < 20, "the aborted request stopped at once"
