"""StateSlots: running slots kept for max_num_seqs sequences, snapshots in the
rest, least recently used first out; checked against a model by a hypothesis
state machine."""

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
    slots.save_snapshot(b"b")
    assert slots.snapshot_slot(b"a") == slot_a  # a hit: "b" is now the oldest
    slot_b = slots.snapshot_slot(b"b")
    assert slots.save_snapshot(b"a") is None  # a save of an existing one refreshes it too
    assert slots.save_snapshot(b"c") == slot_b
    assert not slots.has_snapshot(b"b") and slots.has_snapshot(b"a")
    assert slots.num_snapshot_evictions == 1


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
    slots = StateSlots(num_slots=4, num_running_slots=2)
    slot_a = slots.save_snapshot(b"a")
    pending = slots.take_pending()
    assert pending is not None and pending != slot_a and slots.num_pending == 1
    assert slots.take_pending() == slot_a  # the share is used up: "a" is evicted
    assert not slots.has_snapshot(b"a") and slots.num_snapshot_evictions == 1
    assert slots.take_pending() is None  # every slot of the share is pending
    assert slots.save_snapshot(b"b") is None
    assert StateSlots(num_slots=2, num_running_slots=2).take_pending() is None


def test_a_pending_slot_is_registered_or_freed():
    slots = StateSlots(num_slots=4, num_running_slots=1)
    first, second, third = slots.take_pending(), slots.take_pending(), slots.take_pending()
    assert first is not None and second is not None and third is not None
    assert slots.register_pending(first, b"a") and slots.snapshot_slot(b"a") == first
    assert not slots.register_pending(second, b"a")  # the existing one stays
    assert slots.snapshot_slot(b"a") == first
    slots.free_pending(third)
    assert slots.num_pending == 0 and slots.num_snapshots == 1 and slots.num_free_slots == 3
    with pytest.raises(AssertionError, match="not pending"):
        slots.free_pending(third)


class StateSlotsMachine(RuleBasedStateMachine):
    """Random allocations, frees, saves, hits and pending snapshots (taken, then
    registered or freed) against a plain model: running, pending and snapshot slots
    are distinct, and the running ones never short of the seats."""

    NUM_SLOTS = 7
    NUM_RUNNING_SLOTS = 4

    def __init__(self) -> None:
        super().__init__()
        self.slots = StateSlots(self.NUM_SLOTS, self.NUM_RUNNING_SLOTS)
        self.running: list[int] = []
        self.pending: list[int] = []
        self.snapshot_order: list[bytes] = []  # least recently used first
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

    @rule(key=st.integers(0, 5))
    def save(self, key):
        block_hash = bytes([key])
        slot = self.slots.save_snapshot(block_hash)
        if block_hash in self.snapshot_order:
            assert slot is None
            self.snapshot_order.remove(block_hash)
        elif not self._take_share_slot(slot):
            return
        else:
            self.slot_of[block_hash] = slot
        self.snapshot_order.append(block_hash)

    @rule()
    def take_pending(self):
        slot = self.slots.take_pending()
        if self._take_share_slot(slot):
            self.pending.append(slot)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), key=st.integers(0, 5), register=st.booleans())
    def stop_pending(self, data, key, register):
        slot = data.draw(st.sampled_from(self.pending))
        self.pending.remove(slot)
        if not register:
            self.slots.free_pending(slot)
            return
        block_hash = bytes([key])
        registered = self.slots.register_pending(slot, block_hash)
        assert registered == (block_hash not in self.snapshot_order)
        if block_hash in self.snapshot_order:
            self.snapshot_order.remove(block_hash)
        else:
            self.slot_of[block_hash] = slot
        self.snapshot_order.append(block_hash)

    def _take_share_slot(self, slot):
        """Check a slot taken from the snapshots' share: a free one while the share
        lasts, else the least recently used snapshot's, else none (all pending)."""
        if len(self.snapshot_order) + len(self.pending) < self.NUM_SLOTS - self.NUM_RUNNING_SLOTS:
            assert slot is not None
        elif self.snapshot_order:
            assert slot == self.slot_of.pop(self.snapshot_order.pop(0))
        else:
            assert slot is None
        assert slot not in self.running and slot not in self.pending
        return slot is not None

    @rule(key=st.integers(0, 5))
    def hit(self, key):
        block_hash = bytes([key])
        slot = self.slots.snapshot_slot(block_hash)
        assert (slot is not None) == (block_hash in self.snapshot_order)
        if slot is not None:
            self.snapshot_order.remove(block_hash)
            self.snapshot_order.append(block_hash)

    @invariant()
    def slots_are_accounted_for(self):
        snapshot_slots = {self.slots.snapshot_slot(h) for h in list(self.snapshot_order)}
        # (reading refreshed them in their own order: the order stays as modelled)
        assert snapshot_slots == {self.slot_of[h] for h in self.snapshot_order}
        held = self.running + self.pending + list(snapshot_slots)
        assert len(set(held)) == len(held)
        assert self.slots.num_snapshots == len(self.snapshot_order) == len(snapshot_slots)
        assert self.slots.num_pending == len(self.pending)
        assert self.slots.num_free_slots + len(held) == self.NUM_SLOTS


TestStateSlotsMachine = StateSlotsMachine.TestCase
TestStateSlotsMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)
