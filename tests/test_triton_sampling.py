"""The one-pass Triton sampling kernel gives the torch sampler's tokens.

Interpreter mode on the CPU (a small vocabulary over several programs), compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.actors.messages import SamplingOptions  # noqa: E402
from trio_llm.gpu.cuda_sampler import seed_key  # noqa: E402
from trio_llm.gpu.kernels import triton_sampling  # noqa: E402
from trio_llm.gpu.sampler import SamplingRow, sample  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
VOCAB_SIZE = 151936 if HAS_CUDA else 2 * triton_sampling.VOCAB_PER_PROGRAM + 300


def row(temperature, seed, output_index):
    options = SamplingOptions(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
                              num_logprobs=None, min_tokens=0, banned_token_ids=[])
    return SamplingRow(options, output_index)


def fused(logits, rows):
    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return triton_sampling.sample_without_filters(
        logits, column([r.options.temperature for r in rows], torch.float32),
        column([seed_key(r.options.seed) for r in rows], torch.int64),
        column([r.output_index for r in rows], torch.int64))


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_sampled_and_greedy_rows_match_the_torch_sampler(scale):
    generator = torch.Generator().manual_seed(int(scale))
    rows = [row(0.6, 0, 0), row(1.0, 12345, 7), row(0.0, 3, 1), row(2.5, 2**40 + 9, 1023),
            row(0.6, 0, 1), row(0.05, 77, 3)]
    logits = (torch.randn(len(rows), VOCAB_SIZE, generator=generator) * scale).to(DEVICE)
    logits[1, :100] = float("-inf")  # banned ids arrive as -inf
    expected = sample(logits, rows).token_ids
    assert fused(logits, rows).tolist() == expected.tolist()


def test_seeded_draws_spread_over_the_vocabulary():
    """Flat logits: the noise alone decides, so draws for many positions must differ."""
    rows = [row(1.0, 5, index) for index in range(16)]
    logits = torch.zeros(len(rows), VOCAB_SIZE, device=DEVICE)
    tokens = fused(logits, rows).tolist()
    assert tokens == sample(logits, rows).token_ids.tolist()
    assert len(set(tokens)) > 12
