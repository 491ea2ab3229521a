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
