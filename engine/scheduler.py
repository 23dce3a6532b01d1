"""Iteration-level scheduling policy (continuous batching with chunked prefill).

Every step spends one token budget (``max_num_batched_tokens``) over running sequences first
(their decode token, or the next chunk of a prompt being prefilled), then over waiting ones in
priority order, so decodes never stall behind a long prompt. When the KV cache cannot grow a
running sequence, the lowest-priority, latest-arrived sequence is preempted by recompute: its
blocks go back to the pool and it rejoins the waiting queue with every token it has generated, so
nothing is lost (with prefix caching, most of its recompute is a cache hit).

A decoding sequence with draft tokens (speculative decoding, proposed by the engine) is scheduled
for ``1 + drafts`` tokens, the drafts trimmed to the budget and dropped first when blocks run out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key
        self.num_preemptions = 0

    def check_n(self, n: int) -> None:
        """Refuse a request whose ``n`` samples could never run: they are admitted together (the prompt is
        computed once, then forked), and ``schedule`` waits until ``len(running) + n`` fits ``max_num_seqs``,
        which for n > max_num_seqs is never, so the request would stall every request queued behind it."""
        if n > self.max_num_seqs:
            raise ValueError(
                f"n={n} is larger than max_num_seqs={self.max_num_seqs}: a request's samples run together, "
                "so it could never be scheduled; lower n or raise max_num_seqs"
            )

    def add(self, seq: Sequence) -> None:
        # Every way into the waiting queue passes here (new requests, preempted and unforked samples), so
        # this is the one guard against a sequence schedule() could never admit.
        self.check_n(seq.params.n if seq.pending_fork else 1)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample that already holds its blocks joins the running set directly."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and give its blocks back at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        scheduled: set[int] = set()

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = seq.spec_token_ids
            if drafts:  # speculative decoding: verify the drafts in the same step, budget permitting
                del drafts[budget - 1 if seq.is_decoding else 0 :]
                num_new += len(drafts)
            while not self.kv.allocate(seq, num_new):
                if drafts:  # no room for the drafts: drop them before evicting anyone
                    num_new -= len(drafts)
                    drafts.clear()
                    continue
                victim = self._pick_victim(exclude=scheduled)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            scheduled.add(id(seq))
            budget -= num_new

        # Admitting new work while others were just evicted for lack of blocks would thrash.
        pending: set[int] | None = None
        index = 0
        while index < len(self.waiting) and budget > 0 and not preempted:
            seq = self.waiting[index]
            width = seq.params.n if seq.pending_fork else 1
            if len(self.running) + width > self.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            if self.kv.enable_caching and seq.num_computed_tokens == 0:
                # Its next block is being prefilled by a running sequence (requests sharing a
                # prompt prefix that arrive together): wait for it to land in the cache rather
                # than compute the same prefix twice. It keeps its place in the queue.
                if pending is None:
                    pending = self.kv.pending_hashes(self.running)
                if self.kv.next_block_hash(seq, len(cached)) in pending:
                    index += 1
                    continue
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate(seq, num_new, cached):
                break
            if seq.num_computed_tokens == 0 and seq.num_output_tokens == 0:
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens += num_cached
            self.waiting.pop(index)
            self.add_running(seq)
            if pending is not None:
                pending |= self.kv.pending_hashes([seq])
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _pick_victim(self, exclude: set[int]) -> Sequence:
        """Lowest priority, then latest arrival; sequences already in this step's batch go last."""
        candidates = [s for s in self.running if id(s) not in exclude] or self.running
        return max(candidates, key=Sequence.sort_key)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        self.num_preemptions += 1
        self.add(seq)
