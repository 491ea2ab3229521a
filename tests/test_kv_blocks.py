"""BlockManager: allocation, reuse, accounting and the double-free guard; prefix
caching's shared, cached and evictable blocks, checked against a model by a
hypothesis state machine."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from trio_llm.actors.kv_blocks import (
    BlockManager,
    chain_block_hashes,
    next_block_hash,
    root_block_hash,
)


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


# -- prefix caching: shared, cached and evictable blocks ---------------------------------


def test_a_freed_cached_block_is_found_again_and_revived():
    blocks = BlockManager(num_blocks=4, block_size=2)
    held = blocks.allocate(2)
    assert blocks.cache_block(held[0], b"a") and blocks.cache_block(held[1], b"b")
    blocks.free(held)
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 2
    assert blocks.cached_block_id(b"a") == held[0]
    assert blocks.can_allocate(3, [held[0]]) and not blocks.can_allocate(4, [held[0]])
    taken = blocks.allocate(1, [held[0]])
    assert taken[0] == held[0] and blocks.ref_count(held[0]) == 1
    assert blocks.num_free_blocks == 2


def test_a_shared_block_is_freed_by_its_last_holder():
    blocks = BlockManager(num_blocks=4, block_size=2)
    first = blocks.allocate(1)
    blocks.cache_block(first[0], b"a")
    second = blocks.allocate(1, first)
    assert second[0] == first[0] and blocks.ref_count(first[0]) == 2
    assert blocks.num_free_blocks == 2
    blocks.free(first[:1])
    assert blocks.num_free_blocks == 2
    blocks.free(second)
    assert blocks.num_free_blocks == 4


def test_free_blocks_go_before_cached_ones_and_the_oldest_cached_is_evicted_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    old = blocks.allocate(2)
    blocks.cache_block(old[0], b"old0")
    blocks.cache_block(old[1], b"old1")
    blocks.free(old)  # the request's last block is evicted before its first
    new = blocks.allocate(1)
    blocks.cache_block(new[0], b"new")
    blocks.free(new)
    anonymous = blocks.allocate(1)
    assert anonymous[0] not in old + new and blocks.num_evictions == 0
    assert blocks.allocate(1) == [old[1]] and blocks.num_evictions == 1
    assert blocks.cached_block_id(b"old1") is None
    assert blocks.allocate(1) == [old[0]] and blocks.cached_block_id(b"old0") is None
    assert blocks.cached_block_id(b"new") == new[0]
    assert blocks.num_free_blocks == 1


def test_a_hash_already_cached_leaves_the_second_block_anonymous():
    blocks = BlockManager(num_blocks=4, block_size=2)
    first, second = blocks.allocate(2)
    assert blocks.cache_block(first, b"same")
    assert not blocks.cache_block(second, b"same")
    blocks.free([second])
    assert blocks.allocate(1) == [second]  # it went back to the anonymous free blocks


def test_caching_an_unused_block_is_a_bug():
    blocks = BlockManager(num_blocks=2, block_size=2)
    with pytest.raises(AssertionError, match="unused"):
        blocks.cache_block(0, b"a")


def test_block_hashes_chain_and_salt():
    root = root_block_hash("tiny", None)
    assert root != root_block_hash("tiny", "tenant") != root_block_hash("other", None)
    assert root_block_hash("tiny", "") != root
    first = next_block_hash(root, [1, 2])
    assert next_block_hash(root, [1, 2]) == first
    assert next_block_hash(first, [3, 4]) != next_block_hash(root, [3, 4])
    assert next_block_hash(root, [2, 1]) != first
    assert next_block_hash(root, [2**32 - 1, 5]) != next_block_hash(root, [0, 5])


def test_chained_hashes_are_the_block_by_block_hashes():
    root = root_block_hash("tiny", None)
    token_ids = list(range(100, 112))
    first = next_block_hash(root, token_ids[:4])
    second = next_block_hash(first, token_ids[4:8])
    third = next_block_hash(second, token_ids[8:])
    assert chain_block_hashes(root, token_ids, 4) == [first, second, third]
    with pytest.raises(AssertionError, match="full blocks"):
        chain_block_hashes(root, token_ids[:5], 4)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate (with prefix hits), cache, free and evict against a model:
    which holder has which blocks, which hash each cached block has."""

    NUM_BLOCKS = 10

    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockManager(num_blocks=self.NUM_BLOCKS, block_size=2)
        self.holders: list[list[int]] = []
        self.hash_of: dict[int, bytes] = {}  # the model of cached content
        self.next_hash = 0

    @rule(num_blocks=st.integers(0, 4), num_hits=st.integers(0, 3), data=st.data())
    def allocate(self, num_blocks, num_hits, data):
        cached = sorted(self.hash_of)
        hits = data.draw(st.lists(st.sampled_from(cached), max_size=num_hits,
                                  unique=True)) if cached else []
        if not self.blocks.can_allocate(num_blocks, hits):
            num_needed = num_blocks + sum(self.blocks.ref_count(b) == 0 for b in hits)
            assert num_needed > self.blocks.num_free_blocks
            return
        taken = self.blocks.allocate(num_blocks, hits)
        assert taken[:len(hits)] == hits and len(taken) == len(hits) + num_blocks
        for block_id in taken[len(hits):]:
            self.hash_of.pop(block_id, None)  # evicted (if it was cached): content gone
        self.holders.append(taken)

    @rule(data=st.data())
    def cache(self, data):
        anonymous = sorted({b for held in self.holders for b in held} - set(self.hash_of))
        if not anonymous:
            return
        block_id = data.draw(st.sampled_from(anonymous))
        block_hash = self.next_hash.to_bytes(4, "little")
        self.next_hash += 1
        assert self.blocks.cache_block(block_id, block_hash)
        self.hash_of[block_id] = block_hash

    @rule(data=st.data())
    def free(self, data):
        if self.holders:
            index = data.draw(st.integers(0, len(self.holders) - 1))
            self.blocks.free(self.holders.pop(index))

    @invariant()
    def every_block_is_in_exactly_one_state(self):
        references = [0] * self.NUM_BLOCKS
        for held in self.holders:
            assert len(held) == len(set(held)), "a holder got one block twice"
            for block_id in held:
                references[block_id] += 1
        num_referenced = sum(1 for count in references if count)
        assert num_referenced + self.blocks.num_free_blocks == self.NUM_BLOCKS
        for block_id, count in enumerate(references):
            assert self.blocks.ref_count(block_id) == count
        for block_id, block_hash in self.hash_of.items():
            assert self.blocks.cached_block_id(block_hash) == block_id
        assert self.blocks.num_cached_blocks == len(self.hash_of)

    def teardown(self):
        while self.holders:
            self.blocks.free(self.holders.pop())
        assert self.blocks.num_free_blocks == self.NUM_BLOCKS, "a block leaked"
        assert self.blocks.can_allocate(self.NUM_BLOCKS)
        assert len(set(self.blocks.allocate(self.NUM_BLOCKS))) == self.NUM_BLOCKS


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=40,
                                            deadline=None)
