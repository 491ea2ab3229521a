"""The state cache's slots, as the scheduler sees them (models with linear-attention
layers: the hybrid family). The runner holds the conv and recurrent states; the
scheduler only hands out slot ids, as it hands out KV block ids.

A slot is in one of four states:

- *running*: a running sequence's own, from its admission until it leaves
  (finished, aborted, stopped by a stop string, preempted). ``max_num_seqs``
  slots are kept for them: a sequence admitted under the seat limit always
  gets one, so slots never limit admission beyond seats.
- *snapshot*: the state at the end of a cached prefix (prefix caching), keyed by
  the chained hash of the prefix's last full KV block (actors/kv_blocks.py); at most
  ``num_slots - max_num_seqs`` of them (the *share*). A snapshot is registered when
  its save copy is planned (ScheduledBatch.state_copies: copies run before their
  batch's forward, in order, so any later copy or step reads the saved state).
- *pending*: a decoding request's state at the last block boundary its decode
  reached, copied there while its blocks are not hashed yet (the decode hot path
  never hashes). One per running request at most, and at most a quarter of the
  share (rounded up) in all; when it stops, the scheduler registers it as a
  snapshot under the hash of the block that ended there, or frees it. Pending
  slots come out of the share: snapshots plus pending slots are at most the share.
- *free*: none of these, on a stack (the most recently freed is handed out first).

Which snapshot makes room (a segmented LRU): snapshots known to be *shared* (a
branch point: the end of a prefix another prompt is known to share; or one hit since
it was saved) are kept
over *speculative* ones (a prompt's or an answer's end, not hit yet), each kind in
least-recently-used order. Shared ones hold at most half the share: one more moves
the least recently used back among the speculative ones, as their most recent. A
burst of requests on shared prefixes (vLLM's prefix_repetition) saves a prompt's
end and an answer's boundary for each request; with one LRU order those would push
out the branch points every later request starts from, and pending slots would take
the whole share while many requests decode.
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
        self.max_num_shared = self.max_num_snapshots // 2
        self.max_num_pending = -(-self.max_num_snapshots // 4)
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._running_slots: set[int] = set()
        # block hash of the prefix's end -> its slot, least recently used first
        self._shared: OrderedDict[bytes, int] = OrderedDict()
        self._speculative: OrderedDict[bytes, int] = OrderedDict()
        self._pending_slots: set[int] = set()
        self.num_snapshot_evictions = 0

    @property
    def num_running(self) -> int:
        return len(self._running_slots)

    @property
    def num_snapshots(self) -> int:
        return len(self._shared) + len(self._speculative)

    @property
    def num_shared_snapshots(self) -> int:
        return len(self._shared)

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
        return block_hash in self._shared or block_hash in self._speculative

    def snapshot_slot(self, block_hash: bytes) -> int | None:
        """The slot of the snapshot at the end of the prefix ``block_hash`` ends, if
        any; a hit makes it a shared one, the most recently used."""
        slot = self._shared.get(block_hash, self._speculative.get(block_hash))
        if slot is not None:
            self._refresh(block_hash, shared=True)
        return slot

    def save_snapshot(self, block_hash: bytes, shared: bool = False) -> int | None:
        """The slot to copy the state at the end of ``block_hash``'s prefix into, now
        registered under it (``shared``: a branch point, known to be shared); a
        speculative snapshot, else a shared one, makes room when the share is used
        up (the module says which). None when there is nothing to do: no share at
        all, all of it pending, or that prefix has a snapshot already (it becomes the
        most recently used of its kind, or shared)."""
        if not self.max_num_snapshots:
            return None
        if self.has_snapshot(block_hash):
            self._refresh(block_hash, shared)
            return None
        slot = self._take_share_slot()
        if slot is not None:
            if shared:
                self._keep_shared(block_hash, slot)
            else:
                self._speculative[block_hash] = slot
        return slot

    def forget_snapshot(self, block_hash: bytes) -> None:
        """Drop a snapshot whose save copy was never sent (no batch carried it). One that
        a later save of the same batch evicted is gone already, its slot that save's."""
        slot = self._shared.pop(block_hash, None)
        if slot is None:
            slot = self._speculative.pop(block_hash, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _refresh(self, block_hash: bytes, shared: bool) -> None:
        if block_hash in self._shared:
            self._shared.move_to_end(block_hash)
        elif shared:
            self._keep_shared(block_hash, self._speculative.pop(block_hash))
        else:
            self._speculative.move_to_end(block_hash)

    def _keep_shared(self, block_hash: bytes, slot: int) -> None:
        """Make it the most recently used shared snapshot; past half the share, the
        least recently used shared one becomes the most recent speculative one."""
        self._shared[block_hash] = slot
        if len(self._shared) > self.max_num_shared:
            demoted_hash, demoted_slot = self._shared.popitem(last=False)
            self._speculative[demoted_hash] = demoted_slot

    def _take_share_slot(self) -> int | None:
        """A slot of the share: a free one while the share is not used up, else the
        least recently used speculative snapshot's, else the least recently used
        shared one's; None when every slot of the share is pending (or there is none)."""
        if self.num_snapshots + len(self._pending_slots) < self.max_num_snapshots:
            return self._free_slots.pop()
        for snapshots in (self._speculative, self._shared):
            if snapshots:
                _, slot = snapshots.popitem(last=False)
                self.num_snapshot_evictions += 1
                return slot
        return None

    # -- pending snapshots (decoding requests) -----------------------------------------

    def take_pending(self) -> int | None:
        """A slot for a decoding request's pending snapshot (see the module), making
        room as a save does; None when a quarter of the share is pending already, or
        all of it is, or there is no share."""
        if len(self._pending_slots) >= self.max_num_pending:
            return None
        slot = self._take_share_slot()
        if slot is not None:
            self._pending_slots.add(slot)
        return slot

    def register_pending(self, slot: int, block_hash: bytes) -> bool:
        """Make a pending slot the speculative snapshot of ``block_hash``'s prefix (the
        most recently used); False, and the slot freed, when that prefix has one
        already (the existing one stays: it holds the same state)."""
        self._pending_slots.remove(slot)
        if self.has_snapshot(block_hash):
            self._refresh(block_hash, shared=False)
            self._free_slots.append(slot)
            return False
        self._speculative[block_hash] = slot
        return True

    def free_pending(self, slot: int) -> None:
        """A pending snapshot that will not be registered."""
        assert slot in self._pending_slots, f"state slot {slot} is not pending"
        self._pending_slots.remove(slot)
        self._free_slots.append(slot)
