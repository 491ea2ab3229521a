"""The paged KV cache's blocks, as the scheduler sees them: ids and who is free.

The runner holds the KV tensors; the scheduler only hands out block ids. A
request's block table is the list of ids it was given, in order; block ``i``
holds its tokens ``i * block_size`` to ``(i + 1) * block_size - 1``.

Freed blocks are reused last-in first-out: the most recently used memory is
handed out first. Blocks carry no content identity yet; prefix caching would
add a hash per full block here and keep freed blocks findable by it.
"""

from __future__ import annotations


class BlockManager:
    """Allocates and frees KV blocks; asserts that no block is freed twice.

    Every operation costs O(number of blocks it touches), never O(cache size),
    so the scheduler can call it for each request in every step.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.block_size = block_size
        self._num_total_blocks = num_blocks
        # A stack: pop() takes from the end, so block 0 is handed out first.
        self._free_block_ids = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_total_blocks(self) -> int:
        return self._num_total_blocks

    def blocks_needed(self, num_tokens_total: int, num_blocks_held: int) -> int:
        """How many more blocks a request holding ``num_blocks_held`` needs so
        that ``num_tokens_total`` tokens fit."""
        num_blocks_total = -(-num_tokens_total // self.block_size)
        return max(0, num_blocks_total - num_blocks_held)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks; the caller checked ``can_allocate``."""
        assert 0 <= num_blocks <= len(self._free_block_ids), "not enough free KV blocks"
        if num_blocks == 0:
            return []
        block_ids = self._free_block_ids[-num_blocks:]
        del self._free_block_ids[-num_blocks:]
        block_ids.reverse()
        for block_id in block_ids:
            self._is_free[block_id] = 0
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Give blocks back. Freeing a block that is already free is a bug."""
        for block_id in block_ids:
            assert not self._is_free[block_id], f"KV block {block_id} freed twice"
            self._is_free[block_id] = 1
        # Reversed, so a request's first block is the next one handed out.
        self._free_block_ids.extend(reversed(block_ids))
