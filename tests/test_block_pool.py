"""The block pool and KV cache manager: reference counts, LRU eviction, collision safety, forks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import kv_cache_manager as kvm
from engine.block_pool import NoFreeBlocks
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence
from schemas.sampling import SamplingParams


class _NoDetok:
    """Sequences here never decode text; the manager never touches the detokenizer."""


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(
        request_id=rid,
        index=0,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        priority=0,
        detokenizer=_NoDetok(),  # type: ignore[arg-type]
    )


def run_prefill(kv: KVCacheManager, seq: Sequence) -> int:
    cached = kv.find_cached_prefix(seq)
    n_cached = len(cached) * kv.block_size
    assert kv.allocate(seq, seq.num_tokens - n_cached, cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit(seq)
    return n_cached


def test_prefix_hit_after_free_and_lru_eviction() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_seq(list(range(10)))  # 2 full blocks + 1 partial
    assert run_prefill(kv, a) == 0
    kv.free(a)
    assert kv.num_free_blocks == 8
    b = make_seq(list(range(10)))
    assert run_prefill(kv, b) == 8  # both full blocks reused
    kv.free(b)
    # Fill the cache with other content: the old blocks are evicted in LRU order.
    c = make_seq(list(range(100, 132)))
    assert run_prefill(kv, c) == 0
    kv.free(c)
    d = make_seq(list(range(10)))
    assert run_prefill(kv, d) == 0
    kv.free(d)
    assert kv.num_free_blocks == 8


def test_full_hit_leaves_last_block_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_seq(list(range(8)))
    run_prefill(kv, a)
    b = make_seq(list(range(8)))
    assert run_prefill(kv, b) == 4
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvm, "hash_block", lambda parent, tokens, salt: 42)
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(kv, a)
    b = make_seq([9, 9, 9, 9, 5])  # same (fake) hash, other tokens
    assert run_prefill(kv, b) == 0
    c = make_seq([1, 2, 3, 4, 5, 6])
    assert run_prefill(kv, c) == 4
    # Second block of a chain with a colliding hash but another parent: also a miss.
    d = make_seq([9, 9, 9, 9, 1, 2, 3, 4, 0])
    assert run_prefill(kv, d) == 0


def test_allocate_refuses_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    a = make_seq(list(range(12)))
    assert not kv.allocate(a, 12)
    assert a.block_table == [] and kv.num_free_blocks == 2


def test_fork_shares_full_blocks_and_copies_partial() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    parent = make_seq(list(range(6)))
    run_prefill(kv, parent)
    child = make_seq(list(range(6)))
    forked = kv.fork(parent, child)
    assert forked.copy is not None and forked.copy == (parent.block_table[1], child.block_table[1])
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert kv.pool.blocks[parent.block_table[0]].ref_count == 2
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_fork_of_full_blocks_needs_no_copy() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    parent = make_seq(list(range(8)))
    run_prefill(kv, parent)
    child = make_seq(list(range(8)))
    assert kv.fork(parent, child) == kvm.ForkResult(copy=None)
    assert child.block_table == parent.block_table


def test_fork_without_a_block_for_the_copy_raises_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=True)
    parent = make_seq(list(range(6)))  # one full block + one partial: every block in use
    run_prefill(kv, parent)
    child = make_seq(list(range(6)))
    with pytest.raises(NoFreeBlocks):
        kv.fork(parent, child)
    assert child.block_table == [] and kv.pool.blocks[parent.block_table[0]].ref_count == 1


# ---- Placement: empty blocks before cached ones, and each sequence's blocks in runs (engine/block_pool.py).


def grow(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> None:
    """Decode ``num_tokens`` more tokens into ``seq``: room for each, then computed, as the scheduler does."""
    for _ in range(num_tokens):
        seq.token_ids.append(7)
        assert kv.allocate(seq, 1)
        seq.num_computed_tokens += 1


def test_sequences_decoding_side_by_side_keep_their_blocks_in_runs() -> None:
    # Three prompts admitted together, then decoded in lockstep: every new block lands right after the
    # sequence's last one, in the room left after its prompt, not after whichever sequence asked last.
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    seqs = [make_seq(list(range(100 * i, 100 * i + 6)), rid=str(i)) for i in range(3)]
    for seq in seqs:
        seq.params = SamplingParams(max_tokens=10)  # 16 tokens in all: 4 blocks each
        run_prefill(kv, seq)
    for _ in range(10):
        for seq in seqs:
            grow(kv, seq, 1)
    for seq in seqs:
        assert len(seq.block_table) == 4
        assert seq.block_table == list(range(seq.block_table[0], seq.block_table[0] + 4))
    assert sorted(seq.block_table[0] for seq in seqs) == [0, 4, 8]


def test_a_run_grows_past_its_room_where_the_next_block_is_empty() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    seq = make_seq(list(range(4)))
    seq.params = SamplingParams(max_tokens=1)  # expects 2 blocks, then outgrows them
    run_prefill(kv, seq)
    grow(kv, seq, 12)
    assert seq.block_table == [0, 1, 2, 3]


def test_empty_blocks_go_before_cached_ones() -> None:
    # A finished prompt's full blocks stay cached while any empty block remains, wherever the empty one
    # was freed; with none left, the least recently freed cached block goes first (a sequence's tail).
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_seq(list(range(8)))  # 2 full blocks
    run_prefill(kv, a)
    b = make_seq([50, 51, 52])  # 1 partly filled block: nothing to cache
    run_prefill(kv, b)
    a_blocks, b_block = list(a.block_table), b.block_table[0]
    kv.free(a)
    kv.free(b)  # freed after a's blocks, yet empty
    c = make_seq(list(range(100, 111)))  # 3 blocks: the 2 empty ones, then a's tail evicted
    run_prefill(kv, c)
    assert b_block in c.block_table[:2]
    assert set(c.block_table) == ({0, 1, 2, 3} - {a_blocks[0]})
    kv.free(c)
    assert run_prefill(kv, make_seq([0, 1, 2, 3, 9])) == 4  # a's head block still hits


def test_pool_keeps_its_books_under_any_interleaving() -> None:
    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 20)), max_size=60))
    def check(actions: list[tuple[int, int, int]]) -> None:
        # Actions on up to 6 sequences over a 24-block pool: admit (prompt of n tokens, prefix-cache
        # lookups on a small vocabulary so that hits happen), decode n tokens, free, reset the cache.
        kv = KVCacheManager(num_blocks=24, block_size=4, enable_caching=True)
        live: dict[int, Sequence] = {}
        for kind, slot, n in actions:
            seq = live.get(slot)
            if kind == 0 and seq is None:
                seq = make_seq([(slot + j) % 3 for j in range(n)], rid=str(slot))
                seq.params = SamplingParams(max_tokens=n)
                cached = kv.find_cached_prefix(seq)
                if kv.allocate(seq, seq.num_tokens - len(cached) * kv.block_size, cached):
                    seq.num_computed_tokens = seq.num_tokens
                    kv.commit(seq)
                    live[slot] = seq
            elif kind == 1 and seq is not None:
                for _ in range(n):
                    seq.token_ids.append(slot % 3)
                    if not kv.allocate(seq, 1):
                        seq.token_ids.pop()
                        break
                    seq.num_computed_tokens += 1
                    kv.commit(seq)
            elif kind == 2 and seq is not None:
                kv.free(live.pop(slot))
            elif kind == 3:
                kv.pool.reset_prefix_cache()
            held = [b for s in live.values() for b in s.block_table]
            users = {b: held.count(b) for b in held}
            pool = kv.pool
            for block in pool.blocks:
                assert block.ref_count == users.get(block.block_id, 0)
            assert pool.num_free_blocks == pool.num_blocks - len(users)
            for s in live.values():  # each sequence's own blocks are distinct
                assert len(set(s.block_table)) == len(s.block_table)

    check()
