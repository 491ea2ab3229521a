"""Sampler: filters, per-request counter-based randomness, logprobs."""

import numpy as np
import pytest
import torch

from trio_llm.actors.messages import SamplingOptions
from trio_llm.gpu.sampler import SamplingRow, exponential_noise, mix32, mix32_int, sample

VOCAB_SIZE = 50


def _options(**changes) -> SamplingOptions:
    values = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, num_logprobs=None,
                  min_tokens=0, banned_token_ids=[])
    return SamplingOptions(**(values | changes))


def _logits(num_rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits_row: torch.Tensor, num_draws: int, **changes) -> list[int]:
    """One draw per seed: the same distribution sampled ``num_draws`` times independently."""
    rows = [SamplingRow(_options(seed=seed, **changes), 0) for seed in range(num_draws)]
    return sample(logits_row.expand(num_draws, -1).contiguous(), rows).token_ids.tolist()


def _fmix32_numpy(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's finaliser in wrapping uint32 arithmetic: an independent reference."""
    values = values.astype(np.uint32)
    with np.errstate(over="ignore"):
        values ^= values >> np.uint32(16)
        values *= np.uint32(0x85EBCA6B)
        values ^= values >> np.uint32(13)
        values *= np.uint32(0xC2B2AE35)
        values ^= values >> np.uint32(16)
    return values


def test_hash_matches_reference_on_host_and_tensor():
    values = np.concatenate([np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint64),
                             np.random.default_rng(0).integers(0, 2**32, 2000, dtype=np.uint64)])
    expected = _fmix32_numpy(values).astype(np.int64)
    tensor_result = mix32(torch.from_numpy(values.astype(np.int64)))
    assert tensor_result.tolist() == expected.tolist()
    assert [mix32_int(int(value)) for value in values] == expected.tolist()


def test_noise_of_a_row_does_not_depend_on_the_batch():
    rows = [SamplingRow(_options(seed=seed), index) for seed, index in
            [(5, 0), (5, 1), (6, 0), (2**63 + 17, 40), (-3, 7)]]
    together = exponential_noise(rows, VOCAB_SIZE, device=torch.device("cpu"))
    for position, row in enumerate(rows):
        alone = exponential_noise([row], VOCAB_SIZE, device=torch.device("cpu"))
        assert torch.equal(together[position], alone[0])
    assert len({tuple(row.tolist()) for row in together}) == len(rows)
    assert (together > 0).all() and torch.isfinite(together).all()


def test_greedy_ignores_seed_and_filters():
    logits = _logits(4)
    rows = [SamplingRow(_options(temperature=0.0, seed=seed, top_k=3, top_p=0.2), seed)
            for seed in range(4)]
    assert sample(logits, rows).token_ids.tolist() == logits.argmax(-1).tolist()


def test_same_seed_and_position_same_token_in_any_row():
    logits = _logits(1).expand(6, -1).contiguous()
    rows = [SamplingRow(_options(seed=42), 3)] * 6
    assert len(set(sample(logits, rows).token_ids.tolist())) == 1
    moved = [SamplingRow(_options(seed=seed), 0) for seed in range(5)]
    moved.insert(2, SamplingRow(_options(seed=42), 3))
    assert sample(logits, moved).token_ids[2] == sample(logits[:1], rows[:1]).token_ids[0]


def test_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * (VOCAB_SIZE - 5))
    num_draws = 6000
    draws = torch.tensor(_draws(logits, num_draws, temperature=0.7))
    frequencies = torch.bincount(draws, minlength=VOCAB_SIZE).float() / num_draws
    expected = torch.softmax(logits / 0.7, dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.025)


def test_top_k_keeps_the_best_k():
    logits = _logits(1)[0]
    allowed = set(logits.topk(3).indices.tolist())
    draws = _draws(logits, 300, top_k=3, temperature=5.0)
    assert set(draws) == allowed
    assert set(_draws(logits, 50, top_k=1)) == {logits.argmax().item()}


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([3.0, 2.0, 1.0] + [-30.0] * (VOCAB_SIZE - 3))
    probs = torch.softmax(logits, -1)
    # The first token holds less than 0.8, the first two more: both are kept.
    assert probs[0] < 0.8 < probs[:2].sum()
    assert set(_draws(logits, 400, top_p=0.8)) == {0, 1}
    assert set(_draws(logits, 400, top_p=0.99)) == {0, 1, 2}
    assert set(_draws(logits, 200, top_p=float(probs[0]) * 0.99)) == {0}


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([2.0, 1.5, 0.0] + [-1.0] * (VOCAB_SIZE - 3))
    probs = torch.softmax(logits, -1)
    min_p = float(probs[2] / probs[0]) * 1.01  # token 2 falls just below the threshold
    assert set(_draws(logits, 400, min_p=min_p)) == {0, 1}


def test_banned_ids_until_min_tokens():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 7] = 50.0
    banned = _options(temperature=0.0, min_tokens=2, banned_token_ids=[7, 8])
    assert sample(logits, [SamplingRow(banned, 1)]).token_ids.item() != 7
    assert sample(logits, [SamplingRow(banned, 2)]).token_ids.item() == 7
    sampled = _draws(logits[0], 100, min_tokens=1, banned_token_ids=[7, 8])
    assert not {7, 8} & set(sampled)


def test_logprobs_are_raw_and_only_where_asked():
    logits = _logits(3)
    rows = [SamplingRow(_options(temperature=0.5, top_k=2, num_logprobs=3), 0),
            SamplingRow(_options(), 0),
            SamplingRow(_options(temperature=0.0, num_logprobs=0), 0)]
    output = sample(logits, rows)
    assert output.logprobs is not None
    first, second, third = output.logprobs
    expected = logits.log_softmax(-1)
    token_id = output.token_ids[0].item()
    assert first.logprob == pytest.approx(expected[0, token_id].item())
    assert first.top_token_ids == expected[0].topk(3).indices.tolist()
    assert first.top_logprobs == pytest.approx(expected[0].topk(3).values.tolist())
    assert second is None
    assert (third.top_token_ids, third.top_logprobs) == ([], [])
    assert third.logprob == pytest.approx(expected[2].max().item())
    assert sample(logits, [SamplingRow(_options(), 0)] * 3).logprobs is None


@pytest.mark.gpu
def test_cuda_draws_the_same_noise_and_tokens():
    rows = [SamplingRow(_options(seed=seed, top_k=20, top_p=0.9), seed % 4) for seed in range(16)]
    cpu_noise = exponential_noise(rows, 4096, device=torch.device("cpu"))
    cuda_noise = exponential_noise(rows, 4096, device=torch.device("cuda"))
    torch.testing.assert_close(cuda_noise.cpu(), cpu_noise, rtol=1e-12, atol=0)
    logits = torch.randn(16, 4096, generator=torch.Generator().manual_seed(0)) * 4
    assert (sample(logits.cuda(), rows).token_ids.cpu().tolist()
            == sample(logits, rows).token_ids.tolist())


def test_extreme_values_are_safe():
    logits = _logits(3)
    rows = [SamplingRow(_options(temperature=1e-30, seed=1), 0),
            SamplingRow(_options(top_k=10 * VOCAB_SIZE, seed=2), 0),
            SamplingRow(_options(temperature=0.0, min_tokens=1,
                                 banned_token_ids=[VOCAB_SIZE + 5, -1]), 0)]
    token_ids = sample(logits, rows).token_ids.tolist()
    assert token_ids[0] == logits[0].argmax().item()
    assert 0 <= token_ids[1] < VOCAB_SIZE
    assert token_ids[2] == logits[2].argmax().item()
