"""Grammar token bitmasks in the samplers: the reference sampler (gpu/sampler.py) and
the device-input sampler (gpu/cuda_sampler.py, on the CPU here and on CUDA when there
is one) only ever pick allowed tokens, leave unconstrained rows alone, and agree."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from trio_llm.actors.messages import (
    NewRequestData,
    SamplingOptions,
    ScheduledBatch,
    ScheduledRequest,
)
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
from trio_llm.gpu.cuda_sampler import DeviceSamplingInputs, SamplingPlan, sample_on_device
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.sampler import SamplingRow, sample
from trio_llm.gpu.testing import run_with_bitmasks_following, with_bitmasks_following

VOCAB_SIZE = 3000  # not a multiple of 32: the last word is partly padding


def options(temperature: float, **overrides) -> SamplingOptions:
    fields = dict(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=5,
                  num_logprobs=None, min_tokens=0, banned_token_ids=[])
    fields.update(overrides)
    return SamplingOptions(**fields)


def bitmask(allowed: list[int]) -> bytes:
    bits = np.zeros((VOCAB_SIZE + 31) // 32 * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").tobytes()


ALLOWED = [[7], [0, 31, 32, 2999], list(range(100, 200)), [1234, 2500], [5, 6]]


def rows_with_masks() -> list[SamplingRow]:
    return [
        SamplingRow(options(0.0), 0, bitmask(ALLOWED[0])),
        SamplingRow(options(1.0, seed=9), 3, bitmask(ALLOWED[1])),
        SamplingRow(options(0.8), 1),  # unconstrained, between constrained rows
        SamplingRow(options(0.7, top_k=20, top_p=0.9), 2, bitmask(ALLOWED[2])),
        SamplingRow(options(0.0), 4),
        SamplingRow(options(1.2, min_p=0.1), 0, bitmask(ALLOWED[3])),
        SamplingRow(options(0.9, min_tokens=2, banned_token_ids=[5]), 0, bitmask(ALLOWED[4])),
    ]


def device_inputs(plan: SamplingPlan, device: str) -> DeviceSamplingInputs:
    def tensor(values, dtype=torch.int64) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device)

    return DeviceSamplingInputs(
        temperatures=tensor(plan.temperatures, torch.float32),
        top_ps=tensor(plan.top_ps, torch.float32), min_ps=tensor(plan.min_ps, torch.float32),
        top_ks=tensor(plan.top_ks), seed_keys=tensor(plan.seed_keys),
        output_indices=tensor(plan.output_indices), banned_rows=tensor(plan.banned_rows),
        banned_token_ids=tensor(plan.banned_token_ids), bitmask_rows=tensor(plan.bitmask_rows),
        bitmask_words=tensor(plan.bitmask_words.copy()))


def logits_for(seed: int, rows: list[SamplingRow]) -> torch.Tensor:
    logits = 3 * torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))
    logits[0, 8] = 100.0  # the greedy row's favourite is forbidden
    return logits


def test_the_reference_sampler_picks_allowed_tokens_only() -> None:
    rows = rows_with_masks()
    unconstrained = [index for index, row in enumerate(rows) if row.token_bitmask is None]
    for seed in range(8):
        logits = logits_for(seed, rows)
        token_ids = sample(logits, rows).token_ids.tolist()
        constrained = [token_id for index, token_id in enumerate(token_ids)
                       if index not in unconstrained]
        assert constrained[0] == 7
        assert constrained[1] in ALLOWED[1] and constrained[2] in ALLOWED[2]
        assert constrained[3] in ALLOWED[3]
        assert constrained[4] == 6, "5 is allowed by the grammar but banned below min_tokens"
        plain = sample(logits[unconstrained], [rows[index] for index in unconstrained])
        assert [token_ids[index] for index in unconstrained] == plain.token_ids.tolist()


def test_logprobs_stay_those_of_the_raw_distribution() -> None:
    row = SamplingRow(options(0.0, num_logprobs=1), 0, bitmask([42]))
    logits = logits_for(0, [row])
    output = sample(logits, [row])
    assert output.token_ids.tolist() == [42]
    assert output.logprobs is not None and output.logprobs[0] is not None
    expected = logits.log_softmax(dim=-1)[0, 42].item()
    assert output.logprobs[0].logprob == pytest.approx(expected)


def check_device_sampler(device: str) -> None:
    rows = rows_with_masks()
    plan = SamplingPlan.from_rows(rows, VOCAB_SIZE, can_fuse=device == "cuda")
    assert plan.bitmask_rows == [0, 1, 3, 5, 6]
    for seed in range(8):
        logits = logits_for(seed, rows)
        expected = sample(logits, rows).token_ids.tolist()
        got = sample_on_device(logits.to(device), plan, device_inputs(plan, device))
        assert got.tolist() == expected


def test_the_device_sampler_masks_like_the_reference_on_the_cpu() -> None:
    check_device_sampler("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_sampler_masks_like_the_reference_on_cuda() -> None:
    check_device_sampler("cuda")
    # rows without filters take the fused Triton kernel after the mask
    rows = [SamplingRow(options(1.0, seed=seed), seed, bitmask(ALLOWED[seed % 5]))
            for seed in range(6)]
    plan = SamplingPlan.from_rows(rows, VOCAB_SIZE, can_fuse=True)
    assert plan.use_fused_kernel
    logits = logits_for(3, rows)
    got = sample_on_device(logits.cuda(), plan, device_inputs(plan, "cuda")).tolist()
    assert got == sample(logits, rows).token_ids.tolist()


# -- through the executors ------------------------------------------------------------


def constrained_batches(vocab_size: int) -> list[ScheduledBatch]:
    """A greedy and a sampled request, each masked to a few tokens every step, beside an
    unconstrained one."""
    def mask(step: int, row: int) -> bytes:
        bits = np.zeros((vocab_size + 31) // 32 * 32, dtype=np.uint8)
        bits[[(step * 97 + row * 13 + offset * 211) % vocab_size for offset in range(3)]] = 1
        return np.packbits(bits, bitorder="little").tobytes()

    def request(request_id: str, token_ids: list[int], computed: int, step: int, row: int,
                blocks: list[int], constrained: bool) -> ScheduledRequest:
        return ScheduledRequest(request_id=request_id, token_ids=token_ids,
                                input_from_previous_step=not token_ids,
                                num_computed_tokens=computed, new_block_ids=blocks, sample=True,
                                output_index=step, token_bitmask=mask(step, row)
                                if constrained else None)

    new = [NewRequestData(request_id="g", sampling=options(0.0)),
           NewRequestData(request_id="s", sampling=options(1.0, seed=4)),
           NewRequestData(request_id="u", sampling=options(0.7))]
    batches = []
    for step in range(4):
        prefill = step == 0
        batches.append(ScheduledBatch(
            step_id=step, new_requests=new if prefill else [], finished_request_ids=[],
            requests=[request(name, [5, 6, 7] if prefill else [], 0 if prefill else 2 + step,
                              step, row, [row * 4, row * 4 + 1] if prefill else [],
                              constrained=name != "u")
                      for row, name in enumerate("gsu")],
            num_tokens=9 if prefill else 3))
    return batches


def tiny_pipelined_executor(device: str) -> CudaModelExecutor:
    """The tiny model's pipelined executor on ``device`` (graphs and fused kernels on CUDA)."""
    path = resolve_model("tiny")
    model = load_model(path, dtype=torch.float32, device=torch.device(device))
    executor = CudaModelExecutor(model, model_path=path, num_kv_blocks=16, block_size=4,
                                 max_model_len=64)
    executor.start(CudaExecutorOptions(max_num_seqs=4, use_cuda_graphs=device == "cuda",
                                       use_fused_kernels=device == "cuda"))
    return executor


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_the_pipelined_executor_masks_like_the_plain_one(device: str) -> None:
    path = resolve_model("tiny")

    def build(executor_class):
        model = load_model(path, dtype=torch.float32, device=torch.device(device))
        return executor_class(model, model_path=path, num_kv_blocks=16, block_size=4,
                              max_model_len=64)

    batches = constrained_batches(build(ModelExecutor).vocab_size)
    plain = build(ModelExecutor) if device == "cpu" else None
    pipelined = build(CudaModelExecutor)
    pipelined.start(CudaExecutorOptions(max_num_seqs=4, use_cuda_graphs=device == "cuda",
                                        use_fused_kernels=device == "cuda"))
    results = [pipelined.collect(pipelined.launch(batch)) for batch in batches]
    for batch, result in zip(batches, results, strict=True):
        for scheduled, token_id in zip(batch.requests, result.sampled_token_ids, strict=True):
            if scheduled.token_bitmask is not None:
                allowed = np.unpackbits(np.frombuffer(scheduled.token_bitmask, np.uint8),
                                        bitorder="little")
                assert allowed[token_id], (scheduled.request_id, token_id)
    if plain is not None:
        expected = [plain.execute(batch) for batch in batches]
        assert [r.sampled_token_ids for r in results] == [r.sampled_token_ids for r in expected]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_bitmasks_that_follow_a_launched_step_sample_like_inline_ones(device: str) -> None:
    """Depth 2's deferred sampling (launch, then supply_bitmasks once the previous step
    is collected) gives the tokens of the same masks sent inline at depth 1."""
    inline = constrained_batches(tiny_pipelined_executor(device).vocab_size)
    deferred = with_bitmasks_following(inline)
    reference = tiny_pipelined_executor(device)
    expected = [reference.collect(reference.launch(batch)) for batch in inline]
    executor = tiny_pipelined_executor(device)
    results = run_with_bitmasks_following(executor, inline)
    assert any(s.bitmask_follows for batch in deferred for s in batch.requests)
    assert [r.sampled_token_ids for r in results] == [r.sampled_token_ids for r in expected]


# The kernel runs on the CPU only in Triton's interpreter, which is on only without a GPU.
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                 reason="Triton's interpreter is off")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_in_place_kernel_masks_like_the_torch_version(device: str) -> None:
    """gpu/kernels/triton_bitmask.py (Triton's interpreter on the CPU) leaves the logits
    gpu/sampler.apply_token_bitmasks returns, unconstrained rows untouched."""
    from trio_llm.gpu.kernels.triton_bitmask import apply_token_bitmasks_inplace
    from trio_llm.gpu.sampler import apply_token_bitmasks

    masks = [bitmask(allowed) for allowed in ALLOWED]
    words = torch.from_numpy(np.frombuffer(b"".join(masks), dtype=np.int32).copy())
    words = words.view(len(masks), -1).to(device)
    row_indices = torch.tensor([6, 0, 3, 1, 4], device=device)
    logits = logits_for(1, [None] * 8).to(device)  # type: ignore[list-item]
    expected = apply_token_bitmasks(logits, row_indices, words)
    apply_token_bitmasks_inplace(logits, row_indices, words)
    assert torch.equal(logits, expected)
    for index, allowed in zip(row_indices.tolist(), ALLOWED, strict=True):
        assert torch.isfinite(logits[index]).nonzero().flatten().tolist() == sorted(allowed)
    assert torch.isfinite(logits[[2, 5, 7]]).all()


@pytest.mark.gpu
def test_the_device_sampler_keeps_the_raw_logits_when_a_row_wants_logprobs() -> None:
    rows = [SamplingRow(options(0.0, num_logprobs=1), 0, bitmask([42])),
            SamplingRow(options(1.0), 0, bitmask([7, 8]))]
    plan = SamplingPlan.from_rows(rows, VOCAB_SIZE, can_fuse=True)
    logits = logits_for(2, rows).cuda()
    raw = logits.clone()
    got = sample_on_device(logits, plan, device_inputs(plan, "cuda")).tolist()
    assert got[0] == 42 and got[1] in (7, 8)
    assert torch.equal(logits, raw)


def late_constrained_batches(vocab_size: int) -> list[ScheduledBatch]:
    """constrained_batches with a constrained request "late" that starts at step 2: its
    first token's mask comes inline with the batch, beside decode rows whose masks follow
    (three masked rows then: an odd count of row indices before the masks)."""
    batches = constrained_batches(vocab_size)
    bits = np.zeros((vocab_size + 31) // 32 * 32, dtype=np.uint8)
    bits[[11, 400, 1500]] = 1
    first_mask = np.packbits(bits, bitorder="little").tobytes()
    late = ScheduledRequest(request_id="late", token_ids=[9, 10], input_from_previous_step=False,
                            num_computed_tokens=0,
                            new_block_ids=[12, 13], sample=True, output_index=0,
                            token_bitmask=first_mask)
    batches[2] = msgspec.structs.replace(
        batches[2], requests=[*batches[2].requests, late],
        new_requests=[NewRequestData(request_id="late", sampling=options(0.9, seed=2))])
    return batches


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_first_tokens_inline_mask_and_masks_that_follow_share_a_step(device: str) -> None:
    """supply_bitmasks merges the masks that came with the batch (a request's first
    token) with those that followed, by row, into one upload: the tokens are those of
    every mask sent inline."""
    inline = late_constrained_batches(tiny_pipelined_executor(device).vocab_size)
    deferred = with_bitmasks_following(inline)
    assert any(s.bitmask_follows for s in deferred[2].requests)
    assert deferred[2].requests[-1].token_bitmask is not None  # "late" keeps its own
    reference = tiny_pipelined_executor(device)
    expected = [reference.collect(reference.launch(batch)) for batch in inline]
    results = run_with_bitmasks_following(tiny_pipelined_executor(device), inline)
    assert [r.sampled_token_ids for r in results] == [r.sampled_token_ids for r in expected]
    late_token = expected[2].sampled_token_ids[-1]
    assert late_token in (11, 400, 1500)
