"""The pool of KV cache blocks: reference counts, the free list in LRU order, and the prefix-cache map.

This is mechanism only (vLLM V1's split): it never decides who gets blocks, it hands them out and
takes them back. A block whose last user is gone keeps its cached content and goes to the tail of the
free list; allocation takes from the head, evicting the least recently freed cached block first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocks(RuntimeError):
    """Fewer free KV blocks than an operation needs; raised before anything was changed."""


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Prefix-cache identity, set once the block is full and its KV computed. The hash finds the
    # block; the parent block id and the token ids verify it, so a hash collision is only a miss.
    block_hash: int | None = None
    parent_block_id: int = -1
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free list (caller checked there are enough)."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add a user to blocks found in the prefix cache, taking free ones off the free list."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one user of each block; pass a sequence's blocks tail first so its head is evicted last."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"KV block {block_id} freed more often than allocated")
            if block.ref_count == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: int, parent_block_id: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.parent_block_id != parent_block_id or block.token_ids != token_ids:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: int, parent_block_id: int, token_ids: tuple[int, ...]) -> None:
        """Register a full, computed block; an occupied hash (a twin or a collision) keeps its holder."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.parent_block_id = parent_block_id
        block.token_ids = token_ids
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.parent_block_id = -1
            block.token_ids = ()

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
            block.parent_block_id = -1
            block.token_ids = ()
        self._cached.clear()
