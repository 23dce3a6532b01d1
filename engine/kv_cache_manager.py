"""KV cache manager: which blocks a sequence holds, prefix-cache lookups, and counters.

Mechanism for the scheduler's policy: ``allocate`` answers whether a sequence can grow by some
tokens (and does it), never whom to preempt. Full blocks are named by a hash chained over their
parent's hash, their tokens and a salt (anything else that changes their KV, such as the model and
dtype); lookups verify the parent block and the tokens, so a collision costs a miss, not wrong KV.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import xxhash

from engine.block_pool import BlockPool, KVBlock, NoFreeBlocks
from engine.sequence import Sequence

# The most blocks reserved (softly: BlockPool.allocate's room) for one run of a sequence's blocks: 512
# tokens at 16 per block, a whole compass sequence. Runs of 8 blocks already read at 92 % of the speed of
# one run (engine/block_pool.py); a longer reservation would only spread the other sequences' runs apart.
RUN_BLOCKS = 32


def hash_block(parent_hash: int, token_ids: list[int], salt: bytes) -> int:
    data = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(salt + data)


@dataclass(frozen=True)
class ForkResult:
    """What a fork leaves the model runner to do: ``copy`` is the ``(src, dst)`` block copy (the parent's
    partly filled last block into the child's own), None when the parent held full blocks only."""

    copy: tuple[int, int] | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, salt: str = "") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._salt = salt.encode()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by live sequences (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def _extend_hashes(self, seq: Sequence) -> list[int]:
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else 0
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], self._salt))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest chain of cached blocks matching the sequence's leading tokens.

        Never covers every token: the last one must go through the model to be sampled from, and
        recomputing a whole block (rather than rewriting one slot of a shared block) keeps shared
        blocks read-only.
        """
        if not self.enable_caching:
            return []
        bs = self.block_size
        hits: list[KVBlock] = []
        parent_id = -1
        for i, block_hash in enumerate(self._extend_hashes(seq)):
            block = self.pool.lookup(block_hash, parent_id, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
            parent_id = block.block_id
        if hits and len(hits) * bs >= seq.num_tokens:
            hits.pop()
        return hits

    def pending_hashes(self, seqs: list[Sequence]) -> set[int]:
        """Hashes of the full prompt blocks ``seqs`` hold but have not computed yet (mid-prefill).

        Once computed they will be in the cache, so a waiting sequence that needs one of them is
        better off waiting a step than computing a private copy alongside.
        """
        if not self.enable_caching:
            return set()
        pending: set[int] = set()
        for seq in seqs:
            num_full = seq.num_tokens // self.block_size
            if seq.num_computed_tokens // self.block_size < num_full:
                pending.update(self._extend_hashes(seq)[seq.num_committed_blocks : num_full])
        return pending

    def next_block_hash(self, seq: Sequence, num_cached_blocks: int) -> int | None:
        """Hash of the first full block past the cached ones, if the sequence has one."""
        hashes = self._extend_hashes(seq)
        return hashes[num_cached_blocks] if num_cached_blocks < len(hashes) else None

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens (after ``cached`` blocks); False if it can't."""
        cached = cached or []
        bs = self.block_size
        held = len(seq.block_table) + len(cached)
        num_tokens = seq.num_computed_tokens + len(cached) * bs + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens // bs) - held)
        revived = sum(1 for block in cached if block.ref_count == 0)
        if num_new_blocks + revived > self.pool.num_free_blocks:
            return False
        if seq.num_computed_tokens == 0 and not seq.block_table:
            # A fresh admission: the hit-rate counters see each admission once, however many
            # times the scheduler looked the prefix up before the sequence got in.
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(cached) * bs
        if cached:
            self.pool.touch(cached)
            seq.block_table.extend(block.block_id for block in cached)
            seq.num_committed_blocks = len(cached)
        if num_new_blocks:
            # Room for the run: the blocks the sequence still expects to fill (its max_tokens, at most
            # RUN_BLOCKS; the pool makes it num_new_blocks at least), so its decode blocks can follow in memory.
            expected = -(-(seq.num_prompt_tokens + seq.params.max_tokens) // bs) - held
            room = min(expected, RUN_BLOCKS)
            after = seq.block_table[-1] if seq.block_table else -1
            seq.block_table.extend(block.block_id for block in self.pool.allocate(num_new_blocks, after, room))
        return True

    def commit(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed, computed blocks to the prefix cache."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_committed_blocks:
            return
        bs = self.block_size
        hashes = self._extend_hashes(seq)
        blocks = self.pool.blocks
        for i in range(seq.num_committed_blocks, num_full):
            parent_id = self._canonical_parent(seq, i)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(blocks[seq.block_table[i]], hashes[i], parent_id, tokens)
        seq.num_committed_blocks = num_full

    def _canonical_parent(self, seq: Sequence, i: int) -> int:
        """The block id a lookup walk would reach for block ``i - 1`` (a twin computed concurrently
        may hold the cache entry instead of this sequence's own block)."""
        if i == 0:
            return -1
        own = self.pool.blocks[seq.block_table[i - 1]]
        if own.block_hash is not None:
            return own.block_id
        holder = self.pool.lookup(
            seq.block_hashes[i - 1],
            self._canonical_parent(seq, i - 1) if i - 1 else -1,
            tuple(seq.token_ids[(i - 1) * self.block_size : i * self.block_size]),
        )
        return holder.block_id if holder is not None else own.block_id

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_committed_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> ForkResult:
        """Let ``child`` share ``parent``'s computed blocks.

        Full blocks are shared by reference; a partly filled last block is copied, since both will
        write into it. Raises :class:`NoFreeBlocks`, with nothing changed, when there is no free block
        for the copy.
        """
        bs = self.block_size
        num_full = parent.num_computed_tokens // bs
        partial = len(parent.block_table) > num_full
        if partial and self.pool.num_free_blocks < 1:
            raise NoFreeBlocks("no free KV block for the copy of a forked sample's last block")
        shared = [self.pool.blocks[b] for b in parent.block_table[:num_full]]
        self.pool.touch(shared)
        child.block_table = [b.block_id for b in shared]
        child.num_committed_blocks = min(parent.num_committed_blocks, num_full)
        child.block_hashes = list(parent.block_hashes[:num_full])
        if not partial:
            return ForkResult()
        (copy,) = self.pool.allocate(1)
        child.block_table.append(copy.block_id)
        return ForkResult((parent.block_table[num_full], copy.block_id))

    def filled_slots(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(slots holding computed KV, slots allocated) over the distinct blocks of ``seqs``: how much of
        the memory the blocks hold is used (a block shared by forks or a prefix counts once)."""
        bs = self.block_size
        filled: dict[int, int] = {}
        for seq in seqs:
            num_computed = seq.num_computed_tokens
            for i, block_id in enumerate(seq.block_table):
                fill = min(bs, max(0, num_computed - i * bs))
                if fill > filled.get(block_id, -1):
                    filled[block_id] = fill
        return sum(filled.values()), len(filled) * bs

    def reset_counters(self) -> None:
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
