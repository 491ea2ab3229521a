"""StateSlots: running slots kept for max_num_seqs sequences, snapshots in the
rest (a segmented LRU: speculative ones out first, shared ones at most half, pending
ones at most a quarter); checked against a model by a hypothesis state machine."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_llm.actors.state_slots import StateSlots


def test_running_slots_are_distinct_and_reused_after_free():
    slots = StateSlots(num_slots=4, num_running_slots=3)
    held = [slots.allocate() for _ in range(3)]
    assert sorted(held) == [0, 1, 2] and slots.num_running == 3
    slots.free(held[1])
    assert slots.allocate() == held[1]


def test_more_sequences_than_seats_is_a_bug():
    slots = StateSlots(num_slots=4, num_running_slots=2)
    slots.allocate()
    slots.allocate()
    with pytest.raises(AssertionError, match="more sequences than seats"):
        slots.allocate()


def test_double_free_is_caught():
    slots = StateSlots(num_slots=2, num_running_slots=2)
    slot = slots.allocate()
    slots.free(slot)
    with pytest.raises(AssertionError, match="freed twice"):
        slots.free(slot)


def test_fewer_slots_than_seats_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="3 slots, fewer than max_num_seqs \\(4\\)"):
        StateSlots(num_slots=3, num_running_slots=4)


def test_snapshots_never_take_the_seats_share():
    slots = StateSlots(num_slots=4, num_running_slots=2)
    for index in range(5):
        slots.save_snapshot(bytes([index]))
    assert slots.num_snapshots == 2 and slots.num_snapshot_evictions == 3
    snapshot_slots = {slots.snapshot_slot(bytes([3])), slots.snapshot_slot(bytes([4]))}
    running = {slots.allocate(), slots.allocate()}
    assert len(running) == 2 and not running & snapshot_slots and slots.num_free_slots == 0


def test_a_snapshot_is_found_under_its_hash_only():
    slots = StateSlots(num_slots=3, num_running_slots=1)
    slot = slots.save_snapshot(b"a")
    assert slot is not None
    assert slots.snapshot_slot(b"a") == slot and slots.has_snapshot(b"a")
    assert slots.snapshot_slot(b"b") is None and not slots.has_snapshot(b"b")


def test_saving_an_existing_snapshot_copies_nothing():
    slots = StateSlots(num_slots=3, num_running_slots=1)
    assert slots.save_snapshot(b"a") is not None
    assert slots.save_snapshot(b"a") is None and slots.num_snapshots == 1


def test_without_snapshot_slots_nothing_is_saved():
    slots = StateSlots(num_slots=2, num_running_slots=2)
    assert slots.save_snapshot(b"a") is None and slots.num_snapshots == 0


def test_the_least_recently_used_snapshot_is_evicted_and_its_slot_reused():
    slots = StateSlots(num_slots=3, num_running_slots=1)
    slot_a = slots.save_snapshot(b"a")
    slot_b = slots.save_snapshot(b"b")
    assert slots.save_snapshot(b"a") is None  # a save of an existing one refreshes it
    assert slots.save_snapshot(b"c") == slot_b  # "b" is now the oldest
    assert not slots.has_snapshot(b"b") and slots.snapshot_slot(b"a") == slot_a
    assert slots.num_snapshot_evictions == 1


def test_a_hit_keeps_a_snapshot_over_speculative_ones():
    slots = StateSlots(num_slots=5, num_running_slots=1)  # a share of 4, 2 of them shared
    slot_a = slots.save_snapshot(b"a")
    for key in b"bcdefgh":  # prompt ends, one after another, none hit
        slots.save_snapshot(bytes([key]))
    assert not slots.has_snapshot(b"a")  # one LRU order: the oldest goes
    slot_a = slots.save_snapshot(b"a")
    assert slots.snapshot_slot(b"a") == slot_a and slots.num_shared_snapshots == 1
    for key in b"ijklmnop":
        slots.save_snapshot(bytes([key]))
    assert slots.snapshot_slot(b"a") == slot_a  # the hit one stayed
    assert slots.num_snapshots == 4 and slots.num_shared_snapshots == 1


def test_a_branch_point_is_kept_from_its_save():
    slots = StateSlots(num_slots=5, num_running_slots=1)
    slot = slots.save_snapshot(b"branch", shared=True)
    for key in range(10):
        slots.save_snapshot(bytes([key]))
    assert slots.snapshot_slot(b"branch") == slot
    slots.save_snapshot(b"0", shared=True)  # a speculative one a second prompt reached
    assert slots.num_shared_snapshots == 2


def test_shared_snapshots_hold_at_most_half_the_share():
    slots = StateSlots(num_slots=5, num_running_slots=1)  # half of 4: 2
    slots.save_snapshot(b"x")
    for key in b"abc":
        slots.save_snapshot(bytes([key]), shared=True)
    assert slots.num_shared_snapshots == 2 and slots.num_snapshots == 4
    # "a", the oldest shared, went back among the speculative ones as their newest
    assert slots.save_snapshot(b"e") is not None
    assert not slots.has_snapshot(b"x") and slots.has_snapshot(b"a")
    slots.save_snapshot(b"f")
    assert not slots.has_snapshot(b"a") and slots.has_snapshot(b"b")

    slots = StateSlots(num_slots=2, num_running_slots=1)  # a share of one: plain LRU
    slots.save_snapshot(b"a", shared=True)
    assert slots.num_shared_snapshots == 0 and slots.has_snapshot(b"a")


def test_a_forgotten_snapshot_frees_its_slot():
    slots = StateSlots(num_slots=2, num_running_slots=1)
    slots.save_snapshot(b"a")
    assert slots.num_free_slots == 1
    slots.forget_snapshot(b"a")
    assert slots.num_free_slots == 2 and not slots.has_snapshot(b"a")
    assert slots.save_snapshot(b"a") is not None  # saved again, copied again


def test_forgetting_a_snapshot_a_later_save_evicted_leaves_that_saves_slot():
    slots = StateSlots(num_slots=2, num_running_slots=1)  # a share of one snapshot
    slot = slots.save_snapshot(b"a")
    assert slots.save_snapshot(b"b") == slot  # "a" evicted, its slot "b"'s
    slots.forget_snapshot(b"a")
    assert slots.has_snapshot(b"b") and slots.num_free_slots == 1
    slots.forget_snapshot(b"b")
    assert slots.num_snapshots == 0 and slots.num_free_slots == 2


def test_pending_slots_share_the_snapshots_budget():
    slots = StateSlots(num_slots=6, num_running_slots=2)  # a share of 4, 1 of it pending
    slot_a = slots.save_snapshot(b"a")
    for key in b"bc":
        slots.save_snapshot(bytes([key]))
    pending = slots.take_pending()
    assert pending is not None and pending != slot_a and slots.num_pending == 1
    assert slots.take_pending() is None and slots.num_snapshots == 3  # at the limit
    slots.free_pending(pending)
    slots.save_snapshot(b"d")
    assert slots.take_pending() == slot_a  # the share is used up: "a" is evicted
    assert not slots.has_snapshot(b"a") and slots.num_snapshot_evictions == 1
    assert StateSlots(num_slots=2, num_running_slots=2).take_pending() is None


def test_pending_slots_take_at_most_a_quarter_of_the_share():
    slots = StateSlots(num_slots=20, num_running_slots=8)  # a share of 12: 3 pending
    taken = [slots.take_pending() for _ in range(8)]  # eight requests decode
    assert sum(slot is not None for slot in taken) == 3
    for key in range(9):  # a save never finds the share taken by pending slots
        assert slots.save_snapshot(bytes([key]), shared=True) is not None


def test_a_pending_slot_is_registered_or_freed():
    slots = StateSlots(num_slots=13, num_running_slots=1)  # a share of 12: 3 pending
    first, second, third = slots.take_pending(), slots.take_pending(), slots.take_pending()
    assert first is not None and second is not None and third is not None
    assert slots.register_pending(first, b"a") and slots.snapshot_slot(b"a") == first
    assert not slots.register_pending(second, b"a")  # the existing one stays
    assert slots.snapshot_slot(b"a") == first
    slots.free_pending(third)
    assert slots.num_pending == 0 and slots.num_snapshots == 1 and slots.num_free_slots == 12
    with pytest.raises(AssertionError, match="not pending"):
        slots.free_pending(third)


class StateSlotsMachine(RuleBasedStateMachine):
    """Random allocations, frees, saves (speculative and shared), hits and pending
    snapshots (taken, then registered or freed) against a plain model of the
    segmented LRU: running, pending and snapshot slots are distinct, the running ones
    never short of the seats, and each kind of snapshot in the modelled order."""

    NUM_SLOTS = 11
    NUM_RUNNING_SLOTS = 4
    SHARE = NUM_SLOTS - NUM_RUNNING_SLOTS  # 7: at most 3 shared, at most 2 pending

    def __init__(self) -> None:
        super().__init__()
        self.slots = StateSlots(self.NUM_SLOTS, self.NUM_RUNNING_SLOTS)
        self.running: list[int] = []
        self.pending: list[int] = []
        self.shared: list[bytes] = []  # least recently used first
        self.speculative: list[bytes] = []
        self.slot_of: dict[bytes, int] = {}

    @precondition(lambda self: len(self.running) < self.NUM_RUNNING_SLOTS)
    @rule()
    def allocate(self):
        self.running.append(self.slots.allocate())

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        slot = data.draw(st.sampled_from(self.running))
        self.running.remove(slot)
        self.slots.free(slot)

    @rule(key=st.integers(0, 9), shared=st.booleans())
    def save(self, key, shared):
        block_hash = bytes([key])
        slot = self.slots.save_snapshot(block_hash, shared)
        if self._has(block_hash):
            assert slot is None
            self._refresh(block_hash, shared)
        elif self._take_share_slot(slot):
            self.slot_of[block_hash] = slot
            if shared:
                self._keep_shared(block_hash)
            else:
                self.speculative.append(block_hash)

    @rule()
    def take_pending(self):
        slot = self.slots.take_pending()
        if len(self.pending) >= -(-self.SHARE // 4):
            assert slot is None
        elif self._take_share_slot(slot):
            self.pending.append(slot)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), key=st.integers(0, 9), register=st.booleans())
    def stop_pending(self, data, key, register):
        slot = data.draw(st.sampled_from(self.pending))
        self.pending.remove(slot)
        if not register:
            self.slots.free_pending(slot)
            return
        block_hash = bytes([key])
        registered = self.slots.register_pending(slot, block_hash)
        assert registered == (not self._has(block_hash))
        if registered:
            self.slot_of[block_hash] = slot
            self.speculative.append(block_hash)
        else:
            self._refresh(block_hash, shared=False)

    @rule(key=st.integers(0, 9))
    def hit(self, key):
        block_hash = bytes([key])
        slot = self.slots.snapshot_slot(block_hash)
        assert (slot is not None) == self._has(block_hash)
        if slot is not None:
            assert slot == self.slot_of[block_hash]
            self._refresh(block_hash, shared=True)

    def _has(self, block_hash):
        return block_hash in self.shared or block_hash in self.speculative

    def _refresh(self, block_hash, shared):
        if block_hash in self.shared:
            self.shared.remove(block_hash)
            self.shared.append(block_hash)
        elif shared:
            self.speculative.remove(block_hash)
            self._keep_shared(block_hash)
        else:
            self.speculative.remove(block_hash)
            self.speculative.append(block_hash)

    def _keep_shared(self, block_hash):
        self.shared.append(block_hash)
        if len(self.shared) > self.SHARE // 2:
            self.speculative.append(self.shared.pop(0))

    def _take_share_slot(self, slot):
        """Check a slot taken from the share: a free one while the share lasts, else
        the oldest speculative snapshot's, else the oldest shared one's, else none."""
        num_taken = len(self.shared) + len(self.speculative) + len(self.pending)
        if num_taken < self.SHARE:
            assert slot is not None
        elif self.speculative or self.shared:
            oldest = (self.speculative or self.shared).pop(0)
            assert slot == self.slot_of.pop(oldest)
        else:
            assert slot is None
        assert slot not in self.running and slot not in self.pending
        return slot is not None

    @invariant()
    def slots_are_accounted_for(self):
        # white-box: each kind's order as modelled, read without refreshing anything
        assert list(self.slots._shared.items()) == [(h, self.slot_of[h]) for h in self.shared]
        assert (list(self.slots._speculative.items())
                == [(h, self.slot_of[h]) for h in self.speculative])
        snapshot_slots = [self.slot_of[h] for h in self.shared + self.speculative]
        held = self.running + self.pending + snapshot_slots
        assert len(set(held)) == len(held)
        assert len(self.shared) <= self.SHARE // 2
        assert self.slots.num_pending == len(self.pending)
        assert self.slots.num_free_slots + len(held) == self.NUM_SLOTS


TestStateSlotsMachine = StateSlotsMachine.TestCase
TestStateSlotsMachine.settings = settings(max_examples=100, stateful_step_count=50,
                                          deadline=None)
