"""The device-input sampler (gpu/cuda_sampler.py, torch path) gives the reference sampler's
tokens, edge cases included: near-zero temperature, top-k past the vocabulary, top-p,
min-p, banned ids (some outside the vocabulary) while under min_tokens."""

from __future__ import annotations

import torch

from trio_llm.actors.messages import SamplingOptions
from trio_llm.gpu.cuda_sampler import DeviceSamplingInputs, SamplingPlan, sample_on_device
from trio_llm.gpu.sampler import SamplingRow, sample

VOCAB_SIZE = 3000


def options(temperature, **overrides):
    fields = dict(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=3,
                  num_logprobs=None, min_tokens=0, banned_token_ids=[])
    fields.update(overrides)
    return SamplingOptions(**fields)


def device_inputs(plan: SamplingPlan) -> DeviceSamplingInputs:
    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype)

    return DeviceSamplingInputs(
        temperatures=tensor(plan.temperatures, torch.float32),
        top_ps=tensor(plan.top_ps, torch.float32), min_ps=tensor(plan.min_ps, torch.float32),
        top_ks=tensor(plan.top_ks), seed_keys=tensor(plan.seed_keys),
        output_indices=tensor(plan.output_indices), banned_rows=tensor(plan.banned_rows),
        banned_token_ids=tensor(plan.banned_token_ids))


def test_edge_cases_match_the_reference_sampler():
    rows = [SamplingRow(options(1e-7), 0),
            SamplingRow(options(0.7, top_k=5000, seed=11), 2),
            SamplingRow(options(0.9, min_tokens=3, banned_token_ids=[1, 99999, 5]), 1),
            SamplingRow(options(0.5, top_p=0.9, seed=2**40), 4),
            SamplingRow(options(1.3, min_p=0.05), 9),
            SamplingRow(options(0.0, min_tokens=1, banned_token_ids=[7]), 0)]
    for seed in range(5):
        logits = torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))
        logits *= 3
        logits[5, 7] = 100.0  # the greedy row's best token is banned
        plan = SamplingPlan.from_rows(rows, VOCAB_SIZE, can_fuse=False)
        expected = sample(logits, rows).token_ids
        assert sample_on_device(logits, plan, device_inputs(plan)).tolist() == expected.tolist()


def test_a_plan_from_plain_rows_is_the_plan_from_their_sampling_rows():
    """The executor plans the usual step (no row with penalties, bias, allowed or banned
    ids, logprobs or a grammar) from per-request values; the plan must be the one the
    rows give, field by field, whichever filters the rows' options turn on."""
    from trio_llm.gpu.cuda_sampler import is_plain, plain_row_values

    choices = [options(0.0), options(1e-7, top_k=3), options(0.7, top_k=5000, seed=11),
               options(0.8, top_k=40, seed=2**40), options(0.5, top_p=0.9, seed=7),
               options(1.3, min_p=0.05), options(0.9, min_tokens=3),
               options(0.6, banned_token_ids=[5])]
    mixes = [[0], [0, 1], [2, 0, 6, 7], [3, 0], [4, 1], [5, 2, 0], list(range(len(choices)))]
    for mix in mixes:
        sampling = [choices[index] for index in mix]
        assert all(is_plain(option) for option in sampling)
        output_indices = [3 * index + 1 for index in range(len(mix))]
        rows = [SamplingRow(option, output_index)
                for option, output_index in zip(sampling, output_indices, strict=True)]
        for can_fuse in (False, True):
            expected = SamplingPlan.from_rows(rows, VOCAB_SIZE, can_fuse=can_fuse)
            plain = SamplingPlan.from_plain_rows(
                [plain_row_values(option, VOCAB_SIZE) for option in sampling],
                output_indices, VOCAB_SIZE, can_fuse=can_fuse)
            for name in SamplingPlan.__slots__:
                if name == "bitmask_words":
                    assert plain.bitmask_words.tolist() == expected.bitmask_words.tolist()
                else:
                    assert getattr(plain, name) == getattr(expected, name), (mix, name)
    empty = SamplingPlan.from_plain_rows([], [], VOCAB_SIZE, can_fuse=True)
    assert empty.temperatures == [] and not empty.any_sampled


def test_rows_that_need_the_full_plan_are_not_plain():
    from trio_llm.gpu.cuda_sampler import is_plain

    assert not is_plain(options(0.7, presence_penalty=0.5))
    assert not is_plain(options(0.7, repetition_penalty=1.2))
    assert not is_plain(options(0.7, logit_bias_token_ids=[3], logit_bias_values=[1.0]))
    assert not is_plain(options(0.7, allowed_token_ids=[3, 4]))
    assert not is_plain(options(0.7, num_logprobs=0))
    assert not is_plain(options(0.7, min_tokens=2, banned_token_ids=[1]))
    assert is_plain(options(0.7, min_tokens=2))
