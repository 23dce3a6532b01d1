"""Decode steps replayed as CUDA graphs (vLLM's ``capture_graph``).

A decode step launches a few hundred small kernels; on a GPU, Python's cost of launching them
exceeds their run time at small batch sizes. At start-up the runner captures one graph per batch
size of a ladder (1, 2, 4, 8, 16, 32, ...) over static input buffers; a decode-only step is padded to
the next captured size and replayed. Padding rows write their K/V to slot -1 (skipped by the cache
write) and attend one token of block 0, and their outputs are dropped. Prefill and mixed steps, and
batches above the largest size, run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from engine.attention_metadata import AttentionMetadata

ModelFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    ladder = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32)]
    return [s for s in ladder if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(
        self, model_fn: ModelFn, device: torch.device, max_num_seqs: int, max_model_len: int, block_size: int
    ) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = self._meta(size)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: triton compiles and autotunes outside capture
                model_fn(self.input_ids[:size], self.positions[:size], meta)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model_fn(self.input_ids[:size], self.positions[:size], meta)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(device)

    def _meta(self, size: int) -> AttentionMetadata:
        # Grids are sized from the host ints: capture for the longest context a sequence can have.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
        )

    def can_run(self, num_seqs: int, max_query_len: int) -> bool:
        return max_query_len == 1 and num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy a decode-only batch into the static buffers, replay the padded graph, return its rows."""
        num = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, num)]
        width = meta.block_tables.shape[1]
        self.input_ids[:num].copy_(input_ids, non_blocking=True)
        self.positions[:num].copy_(positions, non_blocking=True)
        self.slot_mapping[:num].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[num:size].fill_(-1)
        self.seq_lens[:num].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[num:size].fill_(1)
        self.block_tables[:num, :width].copy_(meta.block_tables, non_blocking=True)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:num]
