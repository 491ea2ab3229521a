"""The paged KV cache's blocks, as the scheduler sees them: ids, reference counts,
and the content identity of full blocks (automatic prefix caching).

The runner holds the KV tensors; the scheduler only hands out block ids. A
request's block table is the list of ids it was given, in order; block ``i``
holds its tokens ``i * block_size`` to ``(i + 1) * block_size - 1``.

A full block can be *cached*: registered under a hash of its tokens chained
with its parent block's hash (``next_block_hash``), the first block's parent
being a root hash of everything else that shapes the KV (``root_block_hash``:
the model and the request's ``cache_salt``). Equal hashes mean equal token
prefixes, so a new request whose prompt starts with cached blocks shares them
(a reference each) instead of computing them again.

Every block is in exactly one of three states:

- *referenced*: held by one or more requests (reference count > 0);
- *free*: no reference and no content identity, on a stack (the most recently
  freed is handed out first, so warm memory is reused);
- *evictable*: no reference but cached, in least-recently-freed order. A hit
  revives it; when the free stack is empty, allocation evicts the oldest (its
  hash is forgotten) and hands it out.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

_ROOT_PREFIX = b"trio-llm kv root\x00"
_TOKEN_ID_BYTES = 4  # token ids are vocabulary indices, packed as little-endian uint32


def root_block_hash(model_identity: str, cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: the model identity (whatever
    makes the same tokens give other KV values) and the request's cache salt."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hashlib.sha256(_ROOT_PREFIX + model_identity.encode() + b"\x00" + salt).digest()


def next_block_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its token ids chained with its parent's hash.

    SHA-256, not Python's ``hash``: a collision would hand one request another
    request's KV, and tenants choose their prompts (vLLM hashes with SHA-256 by
    default for the same reason). The input is the 32-byte parent hash, then the
    tokens, so it never has the shape of a root hash's input.
    """
    return chain_block_hashes(parent_hash, token_ids, len(token_ids))[0]


def chain_block_hashes(parent_hash: bytes, token_ids: Sequence[int],
                       block_size: int) -> list[bytes]:
    """The hashes of consecutive full blocks of ``token_ids`` (a multiple of
    ``block_size`` long), the first one's parent being ``parent_hash``: the same
    as ``next_block_hash`` block by block, with the tokens packed once."""
    assert len(token_ids) % block_size == 0, "only full blocks are hashed"
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    stride = block_size * _TOKEN_ID_BYTES
    sha256 = hashlib.sha256
    block_hashes = []
    for start in range(0, len(packed), stride):
        parent_hash = sha256(parent_hash + packed[start:start + stride]).digest()
        block_hashes.append(parent_hash)
    return block_hashes


class BlockManager:
    """Allocates, shares and frees KV blocks; keeps cached blocks findable.

    Every operation costs O(number of blocks it touches), never O(cache size),
    so the scheduler can call it for each request in every step.
    ``can_allocate(n, cached_block_ids)`` and ``allocate(n, cached_block_ids)``
    go in pairs: whether, then take, the cached blocks of a prefix hit and ``n``
    new ones.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.block_size = block_size
        self._num_total_blocks = num_blocks
        # A stack: pop() takes from the end, so block 0 is handed out first.
        self._free_block_ids = list(range(num_blocks - 1, -1, -1))
        self._ref_counts = [0] * num_blocks
        # Unreferenced cached blocks, oldest first: the order they are evicted in.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._cached_block_ids: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now: free ones and evictable cached ones."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_total_blocks(self) -> int:
        return self._num_total_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a content identity, referenced or evictable."""
        return len(self._cached_block_ids)

    def blocks_needed(self, num_tokens_total: int, num_blocks_held: int) -> int:
        """How many more blocks a request holding ``num_blocks_held`` needs so
        that ``num_tokens_total`` tokens fit."""
        num_blocks_total = -(-num_tokens_total // self.block_size)
        return max(0, num_blocks_total - num_blocks_held)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- the prefix cache ------------------------------------------------------------

    def cached_block_id(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, referenced or evictable, if any."""
        return self._cached_block_ids.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Make a full, referenced block findable by ``block_hash``. False (and the
        block stays anonymous) when another block already holds that content."""
        assert self._ref_counts[block_id] > 0, f"KV block {block_id} is cached while unused"
        assert self._block_hashes[block_id] is None, f"KV block {block_id} is cached twice"
        if block_hash in self._cached_block_ids:
            return False
        self._cached_block_ids[block_hash] = block_id
        self._block_hashes[block_id] = block_hash
        return True

    def num_revived(self, cached_block_ids: Sequence[int]) -> int:
        """How many of these cached blocks a hit would take out of the evictable set."""
        ref_counts = self._ref_counts
        return sum(1 for block_id in cached_block_ids if not ref_counts[block_id])

    # -- allocation ----------------------------------------------------------------------

    def can_allocate(self, num_blocks: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Whether ``allocate(num_blocks, cached_block_ids)`` can succeed now."""
        num_revived = self.num_revived(cached_block_ids) if cached_block_ids else 0
        return num_blocks + num_revived <= self.num_free_blocks

    def allocate(self, num_blocks: int, cached_block_ids: Sequence[int] = ()) -> list[int]:
        """Take a reference to each of ``cached_block_ids`` (a prefix hit), then
        ``num_blocks`` new blocks; returns them all, cached first. The caller
        checked ``can_allocate`` with the same arguments."""
        block_ids = list(cached_block_ids)
        for block_id in block_ids:
            self._take_reference(block_id)
        assert 0 <= num_blocks <= self.num_free_blocks, "not enough free KV blocks"
        free_block_ids = self._free_block_ids
        if num_blocks <= len(free_block_ids):
            new_block_ids = free_block_ids[len(free_block_ids) - num_blocks:]
            del free_block_ids[len(free_block_ids) - num_blocks:]
            new_block_ids.reverse()
        else:
            new_block_ids = [self._take_new_block() for _ in range(num_blocks)]
        ref_counts = self._ref_counts
        for block_id in new_block_ids:
            ref_counts[block_id] = 1
        return block_ids + new_block_ids if block_ids else new_block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. A block nobody holds becomes free, or
        evictable if cached. Freeing a block nobody holds is a bug."""
        ref_counts = self._ref_counts
        block_hashes = self._block_hashes
        # Last block first: a request's later blocks are worth less (a hit needs
        # every block before them), so they are evicted first and reused last.
        for block_id in reversed(block_ids):
            assert ref_counts[block_id] > 0, f"KV block {block_id} freed twice"
            ref_counts[block_id] -= 1
            if ref_counts[block_id]:
                continue
            if block_hashes[block_id] is None:
                self._free_block_ids.append(block_id)
            else:
                self._evictable[block_id] = None

    # -- helpers ---------------------------------------------------------------------

    def _take_reference(self, block_id: int) -> None:
        assert self._block_hashes[block_id] is not None, f"KV block {block_id} is not cached"
        if not self._ref_counts[block_id]:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _take_new_block(self) -> int:
        """A free block, or else the least recently freed evictable one, forgotten."""
        if self._free_block_ids:
            return self._free_block_ids.pop()
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._block_hashes[block_id]
        assert block_hash is not None
        del self._cached_block_ids[block_hash]
        self._block_hashes[block_id] = None
        self.num_evictions += 1
        return block_id
