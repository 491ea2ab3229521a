"""Penalties, logit bias and allowed token ids: vLLM's and OpenAI's definitions, the same
tokens from the reference sampler, the device-input sampler (torch path and the fused
Triton kernel, through its interpreter on the CPU), both executors at depth 1 and 2,
and the engine (batched, preempted, with and without prefix caching)."""

from __future__ import annotations

from contextlib import aclosing

import msgspec
import pytest
import torch
import trio

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.actors.config import EngineConfig  # noqa: E402
from trio_llm.actors.errors import RequestRejected  # noqa: E402
from trio_llm.actors.messages import (  # noqa: E402
    NewRequestData,
    SamplingOptions,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
    StructuredOutputsParams,
)
from trio_llm.api.engine import Engine  # noqa: E402
from trio_llm.gpu.builtin import resolve_model  # noqa: E402
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor  # noqa: E402
from trio_llm.gpu.cuda_sampler import (  # noqa: E402
    DeviceSamplingInputs,
    SamplingPlan,
    record_on_device,
    sample_on_device,
)
from trio_llm.gpu.executor import ModelExecutor  # noqa: E402
from trio_llm.gpu.kernels import triton_sampling  # noqa: E402
from trio_llm.gpu.loader import load_model  # noqa: E402
from trio_llm.gpu.penalties import PenaltyCounts  # noqa: E402
from trio_llm.gpu.sampler import SamplingRow, record_sampled, sample  # noqa: E402
from trio_llm.gpu.testing import (  # noqa: E402
    device_sampling_inputs,
    record_logits,
    run_depth_1,
    run_depth_2,
    run_with_bitmasks_following,
)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# several programs of the kernel per row, and a vocabulary that does not end on a block
VOCAB_SIZE = 2 * triton_sampling.VOCAB_PER_PROGRAM + 300
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]


def options(temperature: float, **fields) -> SamplingOptions:
    base = dict(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=3,
                num_logprobs=None, min_tokens=0, banned_token_ids=[])
    base.update(fields)
    return SamplingOptions(**base)


def reference_penalized(logits: torch.Tensor, prompt: list[int], output: list[int],
                        presence: float, frequency: float, repetition: float) -> torch.Tensor:
    """vLLM's apply_penalties for one row, written out on its own (float32)."""
    vocab_size = logits.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab_size)
    in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
    in_prompt[torch.tensor(prompt, dtype=torch.int64)] = True
    seen = in_prompt | (counts > 0)
    result = logits.clone()
    positive = seen & (logits > 0)
    negative = seen & ~(logits > 0)
    result[positive] = logits[positive] * (1.0 / torch.tensor(repetition))
    result[negative] = logits[negative] * repetition
    result = result - frequency * counts.to(torch.float32)
    return result - presence * (counts > 0).to(torch.float32)


def pool_with(requests: list[tuple[list[int], list[int]]], device=DEVICE) -> PenaltyCounts:
    counts = PenaltyCounts(VOCAB_SIZE, device)
    for index, (prompt, output) in enumerate(requests):
        counts.register(f"r{index}", torch.tensor(prompt, dtype=torch.int64, device=device),
                        torch.tensor(output, dtype=torch.int64, device=device))
    return counts


# -- the samplers ---------------------------------------------------------------


def penalized_rows() -> tuple[list[SamplingRow], list[tuple[list[int], list[int]]]]:
    """Greedy and seeded rows with every kind of penalty, a logit bias, allowed ids,
    and one row without anything (its slot -1) between them."""
    histories = [([5, 6, 7, 7], [9, 9, 9, 11]), ([1, 2], [3, 4, 3]), ([8] * 3, []),
                 ([100, 8000, 16500], [16500, 16500, 8000])]
    rows = [
        SamplingRow(options(0.0, repetition_penalty=1.7), 4, penalty_slot=0),
        SamplingRow(options(0.8, seed=11, frequency_penalty=1.5, presence_penalty=-0.5), 3,
                    penalty_slot=1),
        SamplingRow(options(0.7, seed=2, logit_bias_token_ids=[3, 16650],
                            logit_bias_values=[40.0, -7.5]), 0),
        SamplingRow(options(1.2, seed=5, repetition_penalty=0.6, presence_penalty=2.0,
                            frequency_penalty=-2.0), 0, penalty_slot=2),
        SamplingRow(options(0.0, presence_penalty=1.0, frequency_penalty=0.25,
                            repetition_penalty=1.3, logit_bias_token_ids=[16500],
                            logit_bias_values=[3.0]), 3, penalty_slot=3),
        SamplingRow(options(0.9, seed=8, allowed_token_ids=[4, 12, 8191, 8192, 16600]), 2),
    ]
    return rows, histories


def random_logits(num_rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, VOCAB_SIZE, generator=generator) * 4).to(DEVICE)


def test_the_reference_sampler_applies_vllms_penalties() -> None:
    """Greedy rows pick the argmax of vLLM's penalized logits (computed here on its own)."""
    histories = [([5, 6, 7], [9, 9, 9, 11]), ([1, 2], [3, 4, 3])]
    rows = [SamplingRow(options(0.0, repetition_penalty=1.8), 4, penalty_slot=0),
            SamplingRow(options(0.0, frequency_penalty=1.9, presence_penalty=1.1), 3,
                        penalty_slot=1)]
    counts = pool_with(histories, torch.device("cpu"))
    for seed in range(20):
        logits = torch.randn(2, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))
        # the tokens seen are the best ones unless penalised
        logits[0, [5, 6, 7, 9, 11]] += torch.tensor([6.0, 5.0, -0.1, 7.0, 6.5])
        logits[1, [3, 4]] += 8.0
        expected = [int(reference_penalized(logits[0], *histories[0], 0.0, 0.0, 1.8).argmax()),
                    int(reference_penalized(logits[1], *histories[1], 1.1, 1.9, 1.0).argmax())]
        assert sample(logits, rows, counts).token_ids.tolist() == expected
    unpenalized = [SamplingRow(row.options, row.output_index) for row in rows]
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[:, 20] = 2.0  # a token never seen
    logits[0, 9], logits[1, 3] = 3.0, 3.0
    assert sample(logits, unpenalized).token_ids.tolist() == [9, 3]
    assert sample(logits, rows, counts).token_ids.tolist() == [20, 20]


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.zeros(3, VOCAB_SIZE)
    logits[:, 10] = 5.0
    rows = [SamplingRow(options(0.0, logit_bias_token_ids=[42, 10],
                                logit_bias_values=[4.5, -1.0]), 0),
            SamplingRow(options(0.0, logit_bias_token_ids=[42], logit_bias_values=[-100.0]), 0),
            SamplingRow(options(0.0, allowed_token_ids=[7, 300]), 0)]
    logits[2, 300] = 1.0
    assert sample(logits, rows).token_ids.tolist() == [42, 10, 300]
    seeded = [SamplingRow(options(1.0, seed=seed, allowed_token_ids=[7, 300, 9000]), 0)
              for seed in range(40)]
    tokens = sample(torch.zeros(40, VOCAB_SIZE), seeded).token_ids.tolist()
    assert set(tokens) == {7, 300, 9000}


def device_inputs(plan: SamplingPlan) -> DeviceSamplingInputs:
    return device_sampling_inputs(plan, torch.device(DEVICE))


@pytest.mark.parametrize("can_fuse", [False, True], ids=["torch", "triton"])
def test_the_device_samplers_match_the_reference_with_penalties(can_fuse: bool) -> None:
    """The device-input sampler (torch ops, or the fused kernel: interpreted on the CPU,
    compiled on CUDA) picks the reference sampler's tokens, and counts them the same."""
    rows, histories = penalized_rows()
    plan = SamplingPlan.from_rows(rows, VOCAB_SIZE, can_fuse=can_fuse)
    assert plan.use_fused_kernel == can_fuse
    for seed in range(3):
        logits = random_logits(len(rows), seed)
        logits[0, [5, 9]] = 30.0  # seen tokens that lead unless penalised
        logits[3, 8] = -0.5
        logits[4, 16500] = 12.0
        reference_counts, device_counts = pool_with(histories), pool_with(histories)
        expected = sample(logits, rows, reference_counts).token_ids
        inputs = device_inputs(plan)
        tokens = sample_on_device(logits, plan, inputs, device_counts)
        assert tokens.tolist() == expected.tolist()
        record_sampled(reference_counts, rows, expected)
        record_on_device(device_counts, plan, inputs, tokens)
        assert torch.equal(reference_counts.output_counts, device_counts.output_counts)


def test_the_kernel_alone_gives_the_torch_penalties() -> None:
    """Only penalties (no bias, no mask) through the kernel's registers, on logits built
    so that the penalized values are near ties (0.5 plus noise of 1e-3 everywhere): any
    term computed otherwise than in torch changes the token."""
    repetition, frequency, presence = 1.13, 0.37, 0.11
    generator = torch.Generator().manual_seed(9)
    histories, all_logits = [], []
    for _ in range(4):
        counts = torch.randint(0, 4, (VOCAB_SIZE,), generator=generator)
        counts[torch.rand(VOCAB_SIZE, generator=generator) < 0.7] = 0
        in_prompt = torch.rand(VOCAB_SIZE, generator=generator) < 0.3
        output = torch.repeat_interleave(torch.arange(VOCAB_SIZE), counts).tolist()
        histories.append((torch.nonzero(in_prompt).flatten().tolist(), output))
        target = 0.5 + 1e-3 * torch.randn(VOCAB_SIZE, generator=generator)
        seen = in_prompt | (counts > 0)
        before = target + frequency * counts + presence * (counts > 0)
        all_logits.append(torch.where(seen, before * repetition, before))
    logits = torch.stack(all_logits).to(torch.float32).to(DEVICE)
    rows = [SamplingRow(options(temperature, seed=seed, repetition_penalty=repetition,
                                frequency_penalty=frequency, presence_penalty=presence), 5,
                        penalty_slot=index)
            for index, (temperature, seed) in enumerate([(0.0, 0), (0.3, 1), (1.0, 2),
                                                         (0.0, 3)])]
    plan = SamplingPlan.from_rows(rows, VOCAB_SIZE, can_fuse=True)
    expected = sample(logits, rows, pool_with(histories)).token_ids
    got = sample_on_device(logits, plan, device_inputs(plan), pool_with(histories))
    assert got.tolist() == expected.tolist()
    unpenalized = sample(logits, [SamplingRow(row.options, 5) for row in rows]).token_ids
    assert unpenalized.tolist() != expected.tolist()


def test_counts_rebuild_and_grow() -> None:
    counts = PenaltyCounts(50, torch.device("cpu"))
    for index in range(6):  # beyond the first four rows: the pool doubles
        counts.register(f"r{index}", torch.tensor([index]), torch.tensor([1, 1, index]))
    assert counts.num_slots == 8
    assert counts.output_counts[counts.slot("r5"), [1, 5]].tolist() == [2, 1]
    assert counts.output_counts[counts.slot("r0"), [0, 1]].tolist() == [1, 2]
    counts.release("r0")
    assert counts.slot("r0") == -1
    counts.register("again", torch.tensor([], dtype=torch.int64), torch.tensor([3]))
    again = counts.slot("again")
    assert counts.output_counts[again].sum() == 1 and counts.prompt_seen[again].sum() == 0


# -- the executors ------------------------------------------------------------------


def build(executor_class, device, **start_options):
    path = resolve_model("tiny")
    model = load_model(path, dtype=torch.float32, device=device)
    executor = executor_class(model, model_path=path, num_kv_blocks=64, block_size=4,
                              max_model_len=256)
    if start_options:
        executor.start(CudaExecutorOptions(max_num_seqs=4, **start_options))
    return executor


PROMPTS = {"a": [11, 12, 13, 12, 11], "b": [40, 41, 42], "c": [7, 7, 7, 7, 8, 9]}
SAMPLINGS = {"a": options(0.0, repetition_penalty=1.6, frequency_penalty=0.3),
             "b": options(0.9, seed=4, presence_penalty=1.5, logit_bias_token_ids=[3],
                          logit_bias_values=[2.0]),
             "c": options(0.0)}


def decode_batches(num_steps: int) -> list[ScheduledBatch]:
    """Three requests prefilled in step 0, then decoding on the previous step's tokens."""
    new = [NewRequestData(request_id=name, sampling=SAMPLINGS[name],
                          prompt_token_ids=PROMPTS[name]) for name in PROMPTS]
    batches = []
    for step in range(num_steps):
        requests = []
        for row, (name, prompt) in enumerate(PROMPTS.items()):
            computed = 0 if step == 0 else len(prompt) + step - 1
            blocks = [row * 16 + block for block in range(16)] if step == 0 else []
            requests.append(ScheduledRequest(
                request_id=name, token_ids=prompt if step == 0 else [],
                input_from_previous_step=step > 0, num_computed_tokens=computed,
                new_block_ids=blocks, sample=True, output_index=step))
        batches.append(ScheduledBatch(step_id=step, new_requests=new if step == 0 else [],
                                      requests=requests, finished_request_ids=[],
                                      num_tokens=sum(len(r.token_ids) or 1 for r in requests)))
    return batches


def outputs_by_request(results) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {name: [] for name in PROMPTS}
    for result in results:
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids,
                                        strict=True):
            outputs[request_id].append(token_id)
    return outputs


def test_the_executor_matches_a_torch_reference_decode() -> None:
    """Greedy with penalties, step by step: each token the argmax of vLLM's penalized
    logits of the model's own logits for the tokens so far (recorded as it runs)."""
    executor = build(ModelExecutor, torch.device("cpu"))
    recorded = record_logits(executor)
    outputs = outputs_by_request(run_depth_1(executor, decode_batches(12)))
    for step, token_id in enumerate(outputs["a"]):
        logits = recorded[("a", step)]
        expected = reference_penalized(logits, PROMPTS["a"], outputs["a"][:step], 0.0, 0.3, 1.6)
        assert token_id == int(expected.argmax()), step
    plain = build(ModelExecutor, torch.device("cpu"))
    unpenalized = [msgspec.structs.replace(batch, new_requests=[
        msgspec.structs.replace(new, sampling=options(0.0), prompt_token_ids=[])
        for new in batch.new_requests]) for batch in decode_batches(12)]
    assert outputs_by_request(run_depth_1(plain, unpenalized))["a"] != outputs["a"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_penalties_at_depth_2_give_depth_1s_tokens(device: str) -> None:
    """The pipelined executor decodes on tokens still on the device and counts them
    there: launched before the previous step is collected, it samples the tokens of
    each step collected before the next (on the CPU also the plain executor's). On
    CUDA with and without graphs and fused kernels (the fused sampling kernel applies
    the penalties in registers): fused layers change the logits' low bits, so each
    configuration is compared with itself at depth 1."""
    torch_device = torch.device(device)
    on_cuda = device == "cuda"
    configurations = ([{"use_cuda_graphs": False, "use_fused_kernels": False}]
                      + ([{"use_cuda_graphs": True, "use_fused_kernels": True}] if on_cuda
                         else []))
    if not on_cuda:
        plain = outputs_by_request(run_depth_1(build(ModelExecutor, torch_device),
                                               decode_batches(10)))
    for options in configurations:
        expected = outputs_by_request(run_depth_1(build(CudaModelExecutor, torch_device,
                                                        **options), decode_batches(10)))
        if not on_cuda:
            assert expected == plain
        pipelined = build(CudaModelExecutor, torch_device, **options)
        assert outputs_by_request(run_depth_2(pipelined, decode_batches(10))) == expected


def test_a_restarted_request_rebuilds_its_counts() -> None:
    """Preempted after four tokens and registered again with its output so far (as the
    scheduler sends it), a request samples the tokens it would have without the restart."""
    executor = build(ModelExecutor, torch.device("cpu"))
    expected = outputs_by_request(run_depth_1(executor, decode_batches(8)))["a"]
    restarted = build(ModelExecutor, torch.device("cpu"))
    first = outputs_by_request(run_depth_1(restarted, decode_batches(4)))["a"]
    known = PROMPTS["a"] + first
    again = NewRequestData(request_id="a", sampling=SAMPLINGS["a"], prompt_token_ids=PROMPTS["a"],
                           output_token_ids=first)
    token_ids = []
    batch = ScheduledBatch(step_id=10, new_requests=[again], finished_request_ids=["a"],
                           requests=[ScheduledRequest(
                               request_id="a", token_ids=known, input_from_previous_step=False,
                               num_computed_tokens=0, new_block_ids=list(range(48, 64)),
                               sample=True, output_index=len(first))], num_tokens=len(known))
    token_ids.append(restarted.execute(batch).sampled_token_ids[0])
    for step in range(3):
        token_ids.append(restarted.execute(ScheduledBatch(
            step_id=11 + step, new_requests=[], finished_request_ids=[],
            requests=[ScheduledRequest(request_id="a", token_ids=[],
                                       input_from_previous_step=True,
                                       num_computed_tokens=len(known) + step, new_block_ids=[],
                                       sample=True, output_index=len(first) + 1 + step)],
            num_tokens=1)).sampled_token_ids[0])
    assert first + token_ids == expected


# -- the engine ---------------------------------------------------------------------


async def collect(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    token_ids: list[int] = []
    async for output in engine.generate(prompt, params):
        token_ids += output.token_ids
    return token_ids


ENGINE = EngineConfig(model="tiny", num_kv_blocks=256, block_size=4, max_num_seqs=8,
                      max_num_batched_tokens=64)
ENGINE_PROMPTS = [[20 + (index * 7 + offset) % 50 for offset in range(3 + index * 5)]
                  for index in range(6)]
ENGINE_PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.2,
                   presence_penalty=0.4),
    SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True,
                   presence_penalty=1.0, logit_bias={5: 3.0, 6: -100.0}),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True, top_k=20,
                   repetition_penalty=0.8, frequency_penalty=-0.5),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                   allowed_token_ids=[30, 31, 32, 33], repetition_penalty=2.0),
]


async def run_alone(config: EngineConfig) -> list[list[int]]:
    async with Engine.open(config) as engine:
        return [await collect(engine, prompt, params)
                for prompt, params in zip(ENGINE_PROMPTS, ENGINE_PARAMS, strict=True)]


async def run_together(config: EngineConfig) -> tuple[list[list[int]], int]:
    results: list[list[int]] = [[] for _ in ENGINE_PROMPTS]
    async with Engine.open(config) as engine:

        async def one(index: int) -> None:
            results[index] = await collect(engine, ENGINE_PROMPTS[index], ENGINE_PARAMS[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(ENGINE_PROMPTS)):
                nursery.start_soon(one, index)
        num_preemptions = engine.statistics().num_preemptions
    return results, num_preemptions


async def test_the_engine_gives_the_same_penalized_tokens_in_every_layout() -> None:
    """Alone at depth 1 is the reference: batched at depth 1 and 2, with prefix caching
    off, and with a KV cache so small that requests are preempted and recomputed."""
    with trio.fail_after(300):
        reference = await run_alone(msgspec.structs.replace(ENGINE, pipeline_depth=1))
        for depth in (1, 2):
            together, _ = await run_together(msgspec.structs.replace(ENGINE,
                                                                     pipeline_depth=depth))
            assert together == reference, depth
        uncached, _ = await run_together(msgspec.structs.replace(
            ENGINE, enable_prefix_caching=False))
        assert uncached == reference
        tight, num_preemptions = await run_together(msgspec.structs.replace(
            ENGINE, num_kv_blocks=24))
        assert num_preemptions > 0
        assert tight == reference
    assert all(token_id in (30, 31, 32, 33) for token_id in reference[5])
    assert 6 not in reference[2]


def repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


async def test_penalties_move_greedy_output_the_expected_way() -> None:
    prompt = ENGINE_PROMPTS[2]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with trio.fail_after(120):
        async with Engine.open(ENGINE) as engine:
            plain = await collect(engine, prompt, greedy)
            frequent = await collect(engine, prompt,
                                     msgspec.structs.replace(greedy, frequency_penalty=2.0))
            present = await collect(engine, prompt,
                                    msgspec.structs.replace(greedy, presence_penalty=2.0))
            repeated = await collect(engine, prompt,
                                     msgspec.structs.replace(greedy, repetition_penalty=3.0))
            rewarded = await collect(engine, prompt,
                                     msgspec.structs.replace(greedy, repetition_penalty=0.2))
    assert repeats(plain) > 0, "the unpenalized greedy output repeats itself"
    assert repeats(frequent) < repeats(plain)
    assert repeats(present) < repeats(plain)
    in_prompt = set(prompt)
    assert (sum(t in in_prompt for t in repeated) < sum(t in in_prompt for t in plain)
            or repeats(repeated) < repeats(plain))
    assert sum(t in in_prompt for t in rewarded) >= sum(t in in_prompt for t in plain)


@pytest.mark.parametrize(("fields", "param"), [
    ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"allowed_token_ids": [3], "structured_outputs": StructuredOutputsParams(regex="a+")},
     "allowed_token_ids"),
    ({"allowed_token_ids": [0], "min_tokens": 1, "stop_token_ids": [0]}, "allowed_token_ids"),
])
async def test_bad_penalty_fields_are_refused_by_name(fields, param) -> None:
    with trio.fail_after(60):
        async with Engine.open(ENGINE) as engine:
            with pytest.raises(RequestRejected) as raised:
                await collect(engine, [1, 2, 3], SamplingParams(max_tokens=2, **fields))
            assert raised.value.param is not None and raised.value.param.startswith(param)
            assert await collect(engine, [1, 2, 3], SamplingParams(max_tokens=2))


# -- several requests read as one stream (Engine.generate_many) ---------------------


async def test_leaving_a_group_early_aborts_every_child() -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with trio.fail_after(120):
        async with Engine.open(ENGINE) as engine:
            seen = set()
            async with aclosing(engine.generate_many(
                    [([5, 6, 7], params), ([8, 9], params), ([5, 6, 7], params)])) as outputs:
                async for index, output in outputs:
                    seen.add(index)
                    assert not output.finished
                    if len(seen) == 3:
                        break
            # an Abort travels intake -> queue -> scheduler: a request after it sees it done
            await collect(engine, [1, 2], SamplingParams(max_tokens=1))
            stats = engine.statistics()
            assert engine.num_open_requests == 0
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


async def test_a_rejected_child_fails_the_group_and_aborts_the_others() -> None:
    good = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(max_tokens=50, logit_bias={10**8: 1.0})
    with trio.fail_after(120):
        async with Engine.open(ENGINE) as engine:
            with pytest.raises(RequestRejected) as raised:
                async with aclosing(engine.generate_many(
                        [([5, 6, 7], good), ([8, 9], bad)])) as outputs:
                    async for _ in outputs:
                        pass
            assert raised.value.param == "logit_bias"
            await collect(engine, [1, 2], SamplingParams(max_tokens=1))
            stats = engine.statistics()
            assert engine.num_open_requests == 0
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


async def test_a_group_gives_each_requests_solo_tokens() -> None:
    with trio.fail_after(120):
        reference = await run_alone(ENGINE)
        async with Engine.open(ENGINE) as engine:
            tokens: list[list[int]] = [[] for _ in ENGINE_PROMPTS]
            async with aclosing(engine.generate_many(
                    list(zip(ENGINE_PROMPTS, ENGINE_PARAMS, strict=True)))) as outputs:
                async for index, output in outputs:
                    tokens[index] += output.token_ids
    assert tokens == reference


# -- with grammar bitmasks ------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_penalties_compose_with_bitmasks_that_follow(device: str) -> None:
    """Constrained rows with penalties: the deferred sampling of depth 2 (launch, then
    supply_bitmasks) counts its tokens as inline sampling does, and obeys the masks."""
    from test_token_bitmask import constrained_batches

    torch_device = torch.device(device)
    penalized = {"g": options(0.0, repetition_penalty=1.4, presence_penalty=0.5),
                 "s": options(1.0, seed=4, frequency_penalty=1.0),
                 "u": options(0.7, seed=2, repetition_penalty=0.7)}

    def with_penalties(batch: ScheduledBatch) -> ScheduledBatch:
        return msgspec.structs.replace(batch, new_requests=[
            msgspec.structs.replace(new, sampling=penalized[new.request_id],
                                    prompt_token_ids=[5, 6, 7])
            for new in batch.new_requests])

    def pipelined() -> CudaModelExecutor:
        executor = build(CudaModelExecutor, torch_device, use_cuda_graphs=device == "cuda",
                         use_fused_kernels=device == "cuda")
        return executor

    inline = [with_penalties(batch) for batch in
              constrained_batches(build(ModelExecutor, torch_device).vocab_size)]
    reference = pipelined()
    expected = [reference.collect(reference.launch(batch)) for batch in inline]
    executor = pipelined()
    results = run_with_bitmasks_following(executor, inline)
    assert [r.sampled_token_ids for r in results] == [r.sampled_token_ids for r in expected]
    if device == "cpu":
        plain = build(ModelExecutor, torch_device)
        assert [plain.execute(batch).sampled_token_ids for batch in inline] == [
            r.sampled_token_ids for r in expected]
    unpenalized = pipelined()
    assert [unpenalized.collect(unpenalized.launch(batch)).sampled_token_ids
            for batch in constrained_batches(plain.vocab_size if device == "cpu"
                                             else reference.vocab_size)] != [
        r.sampled_token_ids for r in expected]
