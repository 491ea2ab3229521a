"""BlockManager: allocation, reuse, accounting and the double-free guard."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_llm.actors.kv_blocks import BlockManager


def test_allocate_hands_out_distinct_blocks_until_none_are_left():
    blocks = BlockManager(num_blocks=4, block_size=16)
    first = blocks.allocate(3)
    assert blocks.num_free_blocks == 1
    assert blocks.can_allocate(1) and not blocks.can_allocate(2)
    last = blocks.allocate(1)
    assert sorted(first + last) == [0, 1, 2, 3]
    assert blocks.num_free_blocks == 0 and blocks.num_total_blocks == 4


def test_allocate_zero_blocks_takes_nothing():
    blocks = BlockManager(num_blocks=2, block_size=4)
    assert blocks.allocate(0) == []
    assert blocks.num_free_blocks == 2


def test_freed_blocks_are_reused_most_recent_first():
    blocks = BlockManager(num_blocks=8, block_size=4)
    held = blocks.allocate(3)
    blocks.allocate(2)
    blocks.free(held)
    assert blocks.allocate(3) == held


def test_allocating_more_than_is_free_is_a_bug():
    blocks = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(AssertionError):
        blocks.allocate(3)


def test_double_free_is_caught():
    blocks = BlockManager(num_blocks=4, block_size=4)
    held = blocks.allocate(2)
    blocks.free(held)
    with pytest.raises(AssertionError, match="freed twice"):
        blocks.free(held[:1])


def test_freeing_a_block_never_allocated_is_caught():
    blocks = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(AssertionError):
        blocks.free([2])


@pytest.mark.parametrize(
    ("num_tokens_total", "num_blocks_held", "expected"),
    [(0, 0, 0), (1, 0, 1), (16, 0, 1), (17, 0, 2), (17, 1, 1), (32, 2, 0), (33, 2, 1), (5, 3, 0)],
)
def test_blocks_needed(num_tokens_total, num_blocks_held, expected):
    assert BlockManager(num_blocks=8, block_size=16).blocks_needed(
        num_tokens_total, num_blocks_held) == expected


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60))
def test_blocks_are_conserved(operations):
    blocks = BlockManager(num_blocks=12, block_size=2)
    held: list[list[int]] = []
    for is_allocation, amount in operations:
        if is_allocation and blocks.can_allocate(amount):
            held.append(blocks.allocate(amount))
        elif not is_allocation and held:
            blocks.free(held.pop(amount % len(held)))
        owned = [block_id for group in held for block_id in group]
        assert len(owned) == len(set(owned))
        assert len(owned) + blocks.num_free_blocks == 12
