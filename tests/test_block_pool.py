"""The block pool and KV cache manager: reference counts, LRU eviction, collision safety, forks."""

from __future__ import annotations

import pytest

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
