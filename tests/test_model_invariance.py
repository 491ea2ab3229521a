"""Batch invariance on the CPU: a request's results do not depend on its company.

Logits are compared bitwise: alone or in a batch of many, prefilled in one
chunk or in odd chunks, with block sizes 1 or 16, preempted and recomputed or
not, with its decode input passed explicitly or taken from the previous step.
"""

import random

import pytest
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingOptions
from trio_llm.gpu import attention
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.testing import GREEDY, DriverRequest, ExecutorDriver, record_logits

NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRIO_LLM_CACHE", str(tmp_path_factory.mktemp("cache")))
        return str(resolve_model("tiny"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 2048) for _ in range(length)]
            for length in (1, 9, 33, 70, 140, 5, 64, 17)]


def _executor(tiny_path: str, block_size: int = 16) -> ModelExecutor:
    return ModelExecutor.create(EngineConfig(model=tiny_path, block_size=block_size,
                                             num_kv_blocks=2048 // block_size * 4,
                                             device="cpu", dtype="float32"))


def _requests(prompts, *, sampling=GREEDY, chunk_plans=None, arrivals=None, preemptions=None):
    return [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                          max_tokens=NUM_NEW_TOKENS,
                          sampling=sampling if isinstance(sampling, SamplingOptions)
                          else sampling[index],
                          chunk_sizes=(chunk_plans or {}).get(index, [1 << 30]),
                          arrival_step=(arrivals or {}).get(index, 0),
                          preempt_at_steps=(preemptions or {}).get(index, []))
            for index, prompt in enumerate(prompts)]


def _run_alone(tiny_path, prompts, *, sampling=GREEDY):
    """Each request on its own fresh executor, in one chunk: the reference."""
    outputs, logits = [], {}
    for index, prompt in enumerate(prompts):
        executor = _executor(tiny_path)
        recorded = record_logits(executor)
        options = sampling if isinstance(sampling, SamplingOptions) else sampling[index]
        (request,) = ExecutorDriver(executor).run(_requests([prompt], sampling=options))
        outputs.append(request.output_token_ids)
        logits |= {(f"r{index}", position): row for (_, position), row in recorded.items()}
    return outputs, logits


def _run_together(tiny_path, prompts, *, block_size=16, decode_input="explicit", **options):
    executor = _executor(tiny_path, block_size)
    recorded = record_logits(executor)
    driver = ExecutorDriver(executor, seed=block_size, decode_input=decode_input)
    requests = driver.run(_requests(prompts, **options))
    return [request.output_token_ids for request in requests], recorded


def _assert_bitwise_equal(logits, expected):
    assert logits.keys() == expected.keys()
    for key, row in expected.items():
        assert torch.equal(logits[key], row), f"logits of {key} differ"


ODD_CHUNKS = {2: [5, 1, 27], 3: [13, 2], 4: [31, 31, 9, 50], 6: [1, 62], 7: [3]}
STAGGERED = {1: 1, 3: 2, 5: 4, 7: 6}


def test_a_row_is_the_same_alone_and_in_a_batch(tiny_path, prompts):
    expected_outputs, expected_logits = _run_alone(tiny_path, prompts)
    outputs, logits = _run_together(tiny_path, prompts, arrivals=STAGGERED)
    assert outputs == expected_outputs
    _assert_bitwise_equal(logits, expected_logits)


def test_prefill_chunking_does_not_change_logits(tiny_path, prompts):
    expected_outputs, expected_logits = _run_alone(tiny_path, prompts)
    outputs, logits = _run_together(tiny_path, prompts, chunk_plans=ODD_CHUNKS,
                                    arrivals=STAGGERED)
    assert outputs == expected_outputs
    _assert_bitwise_equal(logits, expected_logits)


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_size_preemption_and_pipelined_input(tiny_path, prompts, block_size):
    expected_outputs, expected_logits = _run_alone(tiny_path, prompts)
    outputs, logits = _run_together(tiny_path, prompts, block_size=block_size,
                                    decode_input="previous_step", chunk_plans=ODD_CHUNKS,
                                    arrivals=STAGGERED, preemptions={0: [3], 4: [5, 9], 6: [2]})
    assert outputs == expected_outputs
    _assert_bitwise_equal(logits, expected_logits)


def test_seeded_sampling_is_the_same_in_any_batch(tiny_path, prompts):
    sampling = [SamplingOptions(temperature=0.9, top_p=0.95, top_k=(0, 40)[index % 2],
                                min_p=(0.0, 0.02)[index % 3 == 0], seed=1000 + index,
                                num_logprobs=2, min_tokens=0, banned_token_ids=[])
                for index in range(len(prompts))]
    expected_outputs, _ = _run_alone(tiny_path, prompts, sampling=sampling)
    outputs, _ = _run_together(tiny_path, prompts, sampling=sampling, chunk_plans=ODD_CHUNKS,
                               arrivals=STAGGERED, decode_input="previous_step",
                               preemptions={1: [4], 5: [6]})
    assert outputs == expected_outputs
    greedy_outputs, _ = _run_together(tiny_path, prompts)
    assert outputs != greedy_outputs  # the sampling really sampled


def test_logprobs_are_the_raw_model_distribution(tiny_path, prompts):
    sampling = SamplingOptions(temperature=0.5, top_p=1.0, top_k=5, min_p=0.0, seed=3,
                               num_logprobs=4, min_tokens=0, banned_token_ids=[])
    executor = _executor(tiny_path)
    recorded = record_logits(executor)
    requests = ExecutorDriver(executor).run(_requests(prompts[:3], sampling=sampling))
    for request in requests:
        for position, (token_id, logprobs) in enumerate(
                zip(request.output_token_ids, request.logprobs, strict=True)):
            expected = recorded[(request.request_id, position)].log_softmax(-1)
            top = expected.topk(4)
            assert logprobs.top_token_ids == top.indices.tolist()
            assert logprobs.top_logprobs == pytest.approx(top.values.tolist())
            assert logprobs.logprob == pytest.approx(expected[token_id].item())
            assert token_id in expected.topk(5).indices.tolist()  # top_k=5 held


def test_many_decoding_rows(tiny_path):
    """More rows than one GEMM chunk holds: rows land in different chunks and offsets."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2048) for _ in range(rng.randint(1, 6))] for _ in range(37)]
    expected_outputs, expected_logits = _run_alone(tiny_path, prompts)
    arrivals = {index: index % 5 for index in range(len(prompts))}
    outputs, logits = _run_together(tiny_path, prompts, arrivals=arrivals)
    assert outputs == expected_outputs
    _assert_bitwise_equal(logits, expected_logits)


def test_attention_query_tiles_do_not_change_logits(tiny_path, prompts, monkeypatch):
    expected_outputs, expected_logits = _run_alone(tiny_path, prompts)
    # About 8 queries per tile for the longest prompt: many tiles per prefill chunk.
    monkeypatch.setattr(attention, "SCORES_BUDGET_BYTES", 8 * 4 * 140 * 8)
    outputs, logits = _run_together(tiny_path, prompts, chunk_plans=ODD_CHUNKS)
    assert outputs == expected_outputs
    _assert_bitwise_equal(logits, expected_logits)
