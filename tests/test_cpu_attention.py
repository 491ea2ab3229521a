"""The CPU attention kernel (gpu/kernels/cpu_attention.py) against the torch reference.

Close to the float64 reference in value; bitwise the same for a row whatever
else the step holds: alone or batched, prefilled in one chunk or several,
decoded, with any block size or block ids.
"""

import random

import numpy as np
import pytest
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.attention import (
    default_attention_backend,
    float64_paged_attention,
    write_kv_cache,
)
from trio_llm.gpu.kernels import cpu_attention

# (num_heads, num_kv_heads, head_dim): tiny's, the benchmark model's, no GQA, wide groups.
SHAPES = [(4, 2, 16), (8, 4, 32), (4, 4, 32), (8, 1, 64)]


def _filled_cache(keys: torch.Tensor, values: torch.Tensor, *, block_size: int, seed: int,
                  num_blocks: int = 64) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A cache holding one sequence's keys and values in shuffled blocks; the rest is NaN,
    so a kernel that read a slot it should not would show it."""
    shape = (num_blocks, block_size, keys.shape[1], keys.shape[2])
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    block_ids = list(range(num_blocks))
    random.Random(seed).shuffle(block_ids)
    block_ids = block_ids[:-(-len(keys) // block_size)]
    positions = torch.arange(len(keys))
    slots = torch.tensor(block_ids)[positions // block_size] * block_size + positions % block_size
    write_kv_cache(keys, values, k_cache, v_cache, slots)
    return k_cache, v_cache, block_ids


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_ids: list[list[int]], context_lens: list[int], num_queries: list[int],
            function=cpu_attention.paged_attention) -> torch.Tensor:
    width = max(len(row) for row in block_ids)
    tables = torch.tensor([row + [0] * (width - len(row)) for row in block_ids],
                          dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(num_queries).cumsum(0).tolist()], dtype=torch.int32)
    return function(query, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32),
                    starts, query.shape[-1] ** -0.5)


def _sequence(num_tokens: int, shape: tuple[int, int, int], seed: int):
    num_heads, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, num_heads, head_dim, generator=generator),
            torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator),
            torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator))


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_float64_reference(shape):
    lengths, num_queries = [1, 37, 70, 5, 130], [1, 37, 3, 1, 16]
    # One cache for all: every sequence gets its own blocks; unwritten slots are NaN.
    queries, tables = [], []
    num_blocks, block_size = 64, 16
    num_heads, num_kv_heads, head_dim = shape
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = list(range(num_blocks))
    random.Random(3).shuffle(free)
    for index, (length, count) in enumerate(zip(lengths, num_queries, strict=True)):
        query, key, value = _sequence(length, shape, seed=index)
        block_ids = [free.pop() for _ in range(-(-length // block_size))]
        positions = torch.arange(length)
        slots = (torch.tensor(block_ids)[positions // block_size] * block_size
                 + positions % block_size)
        write_kv_cache(key, value, k_cache, v_cache, slots)
        queries.append(query[length - count:])
        tables.append(block_ids)
    query = torch.cat(queries)
    output = _attend(query, k_cache, v_cache, tables, lengths, num_queries)
    expected = _attend(query, k_cache, v_cache, tables, lengths, num_queries,
                       function=float64_paged_attention)
    assert not output.isnan().any()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_does_not_depend_on_its_company(shape):
    """Each position of a 90-token sequence: prefilled whole, in odd chunks, decoded one
    by one, beside other sequences, with block size 16 or 1: the same bits."""
    length = 90
    query, key, value = _sequence(length, shape, seed=11)
    k_cache, v_cache, block_ids = _filled_cache(key, value, block_size=16, seed=1)
    whole = _attend(query, k_cache, v_cache, [block_ids], [length], [length])

    # Odd chunks: each chunk sees the cache up to its own end.
    chunked, start = [], 0
    for size in (1, 13, 2, 31, 43):
        end = start + size
        chunked.append(_attend(query[start:end], k_cache, v_cache, [block_ids], [end], [size]))
        start = end
    assert torch.equal(torch.cat(chunked), whole)

    # Decoded one position at a time, with block size 1 and other block ids.
    k_small, v_small, small_ids = _filled_cache(key, value, block_size=1, seed=2,
                                                num_blocks=128)
    for position in (0, 1, 15, 16, 17, 63, 89):
        row = _attend(query[position:position + 1], k_small, v_small, [small_ids],
                      [position + 1], [1])
        assert torch.equal(row[0], whole[position]), f"position {position} differs"

    # Beside other sequences (a decode before it, a prefill after it) in one call.
    other_query, other_key, other_value = _sequence(50, shape, seed=12)
    k_both = torch.cat([k_cache, torch.full_like(k_cache, float("nan"))])
    v_both = torch.cat([v_cache, torch.full_like(v_cache, float("nan"))])
    other_ids = [64 + index for index in range(4)]
    positions = torch.arange(50)
    slots = torch.tensor(other_ids)[positions // 16] * 16 + positions % 16
    write_kv_cache(other_key, other_value, k_both, v_both, slots)
    batched = _attend(torch.cat([other_query[49:], query[40:], other_query[:20]]),
                      k_both, v_both, [other_ids, block_ids, other_ids], [50, length, 20],
                      [1, 50, 20])
    assert torch.equal(batched[1:51], whole[40:])


def test_other_dtypes_take_the_float64_reference():
    query, key, value = _sequence(20, (4, 2, 16), seed=5)
    k_cache, v_cache, block_ids = _filled_cache(key, value, block_size=16, seed=4)
    half = [tensor.to(torch.bfloat16) for tensor in (query, k_cache, v_cache)]
    assert not cpu_attention.can_use_kernel(half[0], half[1])
    output = _attend(*half, [block_ids], [20], [20])
    expected = _attend(*half, [block_ids], [20], [20], function=float64_paged_attention)
    assert output.dtype == torch.bfloat16
    assert torch.equal(output, expected)


def test_is_the_cpu_default():
    assert default_attention_backend(torch.device("cpu")).name == "cpu"


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("num_cores", "num_threads_before", "expected"),
                         [(1, 1, 1), (2, 2, 1), (8, 8, 7), (8, 2, 2)])
def test_the_executor_leaves_one_core_to_the_trio_thread(monkeypatch, restore_threads,
                                                         num_cores, num_threads_before,
                                                         expected):
    import os

    from trio_llm.gpu.executor import configure_cpu_threads

    torch.set_num_threads(num_threads_before)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(num_cores)),
                        raising=False)
    assert configure_cpu_threads() == expected
    assert torch.get_num_threads() == expected


def test_omp_num_threads_wins(monkeypatch, restore_threads):
    import os

    from trio_llm.gpu.executor import configure_cpu_threads

    torch.set_num_threads(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert configure_cpu_threads() == 3


def test_the_executor_warms_the_kernel_up(monkeypatch, restore_threads):
    from trio_llm.gpu import attention
    from trio_llm.gpu.executor import ModelExecutor

    calls = []
    monkeypatch.setattr(cpu_attention, "warm_up", lambda: calls.append("warm"))
    # the backend is built anew, with the recording warm-up
    monkeypatch.delitem(attention.ATTENTION_BACKENDS, "cpu", raising=False)
    executor = ModelExecutor.create(EngineConfig(model="tiny", device="cpu", num_kv_blocks=8))
    assert executor.model.attention_backend.name == "cpu"
    assert calls == ["warm"]


def test_warm_up_compiles_the_kernel():
    cpu_attention.warm_up()
    assert cpu_attention._attend_rows.signatures


def test_split_by_work_balances_contiguous_runs():
    import numpy as np

    decode = cpu_attention.split_by_work(np.full(64, 300), np.arange(65), 2)
    assert decode == [(0, 32), (32, 64)]
    uneven = cpu_attention.split_by_work(np.array([900, 100, 100, 900]),
                                         np.array([0, 900, 1000, 1100, 2000]), 2)
    assert uneven == [(0, 2), (2, 4)]
    assert cpu_attention.split_by_work(np.full(3, 10), np.arange(4), 2) == [(0, 3)]  # too small
    assert cpu_attention.split_by_work(np.array([], dtype=np.int32), np.array([0]), 2) == [(0, 0)]


def test_threads_change_no_bits():
    shape = (8, 4, 32)
    lengths = [300, 1, 250, 90, 400, 33]
    num_queries = [1, 1, 250, 1, 40, 33]
    num_blocks = [-(-length // 16) for length in lengths]
    # each sequence gets its own window of the blocks written
    query, key, value = _sequence(16 * sum(num_blocks), shape, seed=21)
    k_cache, v_cache, ids = _filled_cache(key, value, block_size=16, seed=8, num_blocks=128)
    tables, queries, first_block = [], [], 0
    for length, count, blocks in zip(lengths, num_queries, num_blocks, strict=True):
        tables.append(ids[first_block:first_block + blocks])
        start = 16 * first_block
        queries.append(query[start + length - count:start + length])
        first_block += blocks
    batch = torch.cat(queries)
    starts = torch.tensor([0, *torch.tensor(num_queries).cumsum(0).tolist()])
    assert len(cpu_attention.split_by_work(torch.tensor(lengths).numpy(), starts.numpy(),
                                           2)) == 2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _attend(batch, k_cache, v_cache, tables, lengths, num_queries)
        torch.set_num_threads(2)
        threaded = _attend(batch, k_cache, v_cache, tables, lengths, num_queries)
    finally:
        torch.set_num_threads(before)
    assert not alone.isnan().any()
    assert torch.equal(threaded, alone)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_queries": [1, 5]}, "query_start_loc"),
    ({"context_lens": [3, 2]}, "fewer cached tokens"),
    ({"block_ids": [[0], [99]]}, "block id"),
    ({"context_lens": [3, 40]}, "block table"),
])
def test_inconsistent_layouts_are_refused(change, message):
    """The kernel trusts its indices: the wrapper refuses what would read or write
    outside the tensors."""
    query, key, value = _sequence(4, (4, 2, 16), seed=1)
    k_cache, v_cache, _ = _filled_cache(key, value, block_size=16, seed=1, num_blocks=4)
    layout = {"block_ids": [[0], [1]], "context_lens": [3, 4], "num_queries": [1, 3]}
    layout |= change
    with pytest.raises(ValueError, match=message):
        _attend(query, k_cache, v_cache, layout["block_ids"], layout["context_lens"],
                layout["num_queries"])


# -- the kernel's arithmetic, written down: numpy in float32 does each step as the kernel

LANES = cpu_attention.LANES


def _lane_sum(values: np.ndarray) -> np.float32:
    """The kernel's order for a sum: element i into lane i % 16, in order from 0, then the
    lanes folded pairwise (lane i plus lane i + width, the width halving)."""
    lanes = np.zeros(LANES, dtype=np.float32)
    padded = np.concatenate([values, np.zeros(-len(values) % LANES, dtype=np.float32)])
    for first in range(0, len(padded), LANES):
        lanes = lanes + padded[first:first + LANES]
    width = LANES
    while width > 1:
        width //= 2
        lanes = lanes[:width] + lanes[width:2 * width]
    return lanes[0]


def _kernel_exp(values: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    cpu_attention._exp_array(values, out)
    return out


def _emulated_row(query_row, keys, values, scale):
    """One head of one query over ``keys``/``values`` [num_keys, head_dim], step by step
    in the kernel's order."""
    scores = np.array([_lane_sum(query_row * key) * np.float32(scale) for key in keys],
                      dtype=np.float32)
    weights = _kernel_exp(scores - scores.max())
    total = _lane_sum(weights)
    accumulator = np.zeros(keys.shape[1], dtype=np.float32)
    for weight, value in zip(weights, values, strict=True):
        accumulator = accumulator + weight * value
    return accumulator * (np.float32(1.0) / total)


def test_the_exponential_is_within_one_ulp():
    values = -np.random.default_rng(0).random(200_000).astype(np.float32) * 87.3
    values = np.concatenate([values, np.float32([0.0, -1e-30, -87.33, -87.34, -100.0,
                                                 -np.inf])])
    exact = np.exp(values.astype(np.float64))
    out = _kernel_exp(values)
    normal = values >= np.float32(-87.33654)
    ulps = np.abs(out[normal] - exact[normal]) / np.spacing(exact[normal].astype(np.float32))
    assert ulps.max() <= 1.0
    assert out[values == 0.0][0] == 1.0
    assert (out[~normal] == 0.0).all()


@pytest.mark.parametrize("head_dim", [16, 32, 128])
def test_dot_products_keep_the_written_order(head_dim):
    generator = np.random.default_rng(head_dim)
    left = generator.standard_normal((300, head_dim)).astype(np.float32)
    right = generator.standard_normal((300, head_dim)).astype(np.float32)
    out = np.empty(300, dtype=np.float32)
    cpu_attention._lane_dot_array(left, right, out)
    expected = np.array([_lane_sum(a * b) for a, b in zip(left, right, strict=True)])
    assert np.array_equal(out.view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("shape", [(4, 2, 16), (8, 4, 32)])
def test_a_row_is_the_written_arithmetic_bit_for_bit(shape):
    """The kernel (vectorized) gives the bits of its arithmetic done step by step in
    numpy: no reassociation, no fused multiply-add, in decode and in a chunk alike."""
    num_heads, num_kv_heads, head_dim = shape
    length = 45
    query, key, value = _sequence(length, shape, seed=31)
    k_cache, v_cache, block_ids = _filled_cache(key, value, block_size=16, seed=3)
    scale = head_dim ** -0.5
    chunk = _attend(query[30:], k_cache, v_cache, [block_ids], [length], [15])
    for position in (30, 37, 44):
        for head in range(num_heads):
            kv_head = head // (num_heads // num_kv_heads)
            expected = _emulated_row(query[position, head].numpy(),
                                     key[:position + 1, kv_head].numpy(),
                                     value[:position + 1, kv_head].numpy(), scale)
            assert np.array_equal(chunk[position - 30, head].numpy().view(np.int32),
                                  expected.view(np.int32)), (position, head)


def test_heads_of_other_sizes_take_the_float64_reference():
    query, key, value = _sequence(20, (4, 2, 24), seed=6)
    k_cache, v_cache, block_ids = _filled_cache(key, value, block_size=16, seed=4)
    assert not cpu_attention.can_use_kernel(query, k_cache)
    output = _attend(query, k_cache, v_cache, [block_ids], [20], [20])
    expected = _attend(query, k_cache, v_cache, [block_ids], [20], [20],
                       function=float64_paged_attention)
    assert torch.equal(output, expected)
