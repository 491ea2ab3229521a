"""The state cache's slots, as the scheduler sees them (models with linear-attention
layers: the hybrid family). The runner holds the conv and recurrent states; the
scheduler only hands out slot ids, as it hands out KV block ids.

A slot is in one of four states:

- *running*: a running sequence's own, from its admission until it leaves
  (finished, aborted, stopped by a stop string, preempted). ``max_num_seqs``
  slots are kept for them: a sequence admitted under the seat limit always
  gets one, so slots never limit admission beyond seats.
- *snapshot*: the state at the end of a cached prefix (prefix caching), keyed by
  the chained hash of the prefix's last full KV block (actors/kv_blocks.py), in
  least-recently-used order; at most ``num_slots - max_num_seqs`` of them. A
  snapshot is registered when its save copy is planned (ScheduledBatch.state_copies:
  copies run before their batch's forward, in order, so any later copy or step
  reads the saved state).
- *pending*: a decoding request's state at the last block boundary its decode
  reached, copied there while its blocks are not hashed yet (the decode hot path
  never hashes). One per running request at most; when it stops, the scheduler
  registers it as a snapshot under the hash of the block that ended there, or frees
  it. Pending slots come out of the snapshots' share: snapshots plus pending slots
  are at most ``num_slots - max_num_seqs``.
- *free*: none of these, on a stack (the most recently freed is handed out first).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    """Allocates running slots and keeps the prefix cache's state snapshots.

    ``allocate``/``free`` for running sequences; ``save_snapshot``,
    ``snapshot_slot`` and ``forget_snapshot`` for the snapshots; ``take_pending``,
    ``register_pending`` and ``free_pending`` for decoding requests' pending
    snapshots. Every operation is O(1).
    """

    def __init__(self, num_slots: int, num_running_slots: int) -> None:
        if num_slots < num_running_slots:
            raise ValueError(f"the state cache has {num_slots} slots, fewer than max_num_seqs "
                             f"({num_running_slots}): every running sequence needs one")
        self.num_total_slots = num_slots
        self.num_running_slots = num_running_slots
        self.max_num_snapshots = num_slots - num_running_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._running_slots: set[int] = set()
        # block hash of the prefix's end -> its slot, least recently used first
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()
        self._pending_slots: set[int] = set()
        self.num_snapshot_evictions = 0

    @property
    def num_running(self) -> int:
        return len(self._running_slots)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_pending(self) -> int:
        return len(self._pending_slots)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    # -- running sequences ----------------------------------------------------------

    def allocate(self) -> int:
        """A slot for a sequence that starts running. The caller keeps to the seat limit."""
        assert len(self._running_slots) < self.num_running_slots, "more sequences than seats"
        slot = self._free_slots.pop()  # never empty: snapshots leave the seats' share
        self._running_slots.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """The sequence holding ``slot`` left. Freeing a slot nobody holds is a bug."""
        assert slot in self._running_slots, f"state slot {slot} freed twice"
        self._running_slots.remove(slot)
        self._free_slots.append(slot)

    # -- snapshots -------------------------------------------------------------------

    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._snapshots

    def snapshot_slot(self, block_hash: bytes) -> int | None:
        """The slot of the snapshot at the end of the prefix ``block_hash`` ends, if
        any; a hit makes it the most recently used."""
        slot = self._snapshots.get(block_hash)
        if slot is not None:
            self._snapshots.move_to_end(block_hash)
        return slot

    def save_snapshot(self, block_hash: bytes) -> int | None:
        """The slot to copy the state at the end of ``block_hash``'s prefix into, now
        registered under it; the least recently used snapshot makes room when all
        are taken. None when there is nothing to do: no snapshot slots at all, all
        of them pending, or that prefix has one already (it becomes the most
        recently used)."""
        if not self.max_num_snapshots:
            return None
        if block_hash in self._snapshots:
            self._snapshots.move_to_end(block_hash)
            return None
        slot = self._take_snapshot_share_slot()
        if slot is not None:
            self._snapshots[block_hash] = slot
        return slot

    def forget_snapshot(self, block_hash: bytes) -> None:
        """Drop a snapshot whose save copy was never sent (no batch carried it). One that
        a later save of the same batch evicted is gone already, its slot that save's."""
        slot = self._snapshots.pop(block_hash, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _take_snapshot_share_slot(self) -> int | None:
        """A slot of the snapshots' share: a free one while the share is not used up,
        else the least recently used snapshot's; None when every slot of the share
        is pending (or there is no share)."""
        if len(self._snapshots) + len(self._pending_slots) < self.max_num_snapshots:
            return self._free_slots.pop()
        if not self._snapshots:
            return None
        _, slot = self._snapshots.popitem(last=False)
        self.num_snapshot_evictions += 1
        return slot

    # -- pending snapshots (decoding requests) -----------------------------------------

    def take_pending(self) -> int | None:
        """A slot for a decoding request's pending snapshot (see the module), evicting
        the least recently used snapshot when the share is used up; None when there
        is no share or all of it is pending."""
        slot = self._take_snapshot_share_slot()
        if slot is not None:
            self._pending_slots.add(slot)
        return slot

    def register_pending(self, slot: int, block_hash: bytes) -> bool:
        """Make a pending slot the snapshot of ``block_hash``'s prefix (the most
        recently used); False, and the slot freed, when that prefix has one already
        (the existing one stays: it holds the same state)."""
        self._pending_slots.remove(slot)
        if block_hash in self._snapshots:
            self._snapshots.move_to_end(block_hash)
            self._free_slots.append(slot)
            return False
        self._snapshots[block_hash] = slot
        return True

    def free_pending(self, slot: int) -> None:
        """A pending snapshot that will not be registered."""
        assert slot in self._pending_slots, f"state slot {slot} is not pending"
        self._pending_slots.remove(slot)
        self._free_slots.append(slot)
