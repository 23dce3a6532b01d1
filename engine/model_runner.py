"""Turns a scheduled batch into one forward pass over the flattened tokens, and owns the KV cache.

Inputs are built with a handful of tensor ops (no Python loop over tokens): token ids are sliced
per sequence, positions and slot mappings come from cumulative query lengths and block tables.
Logits are computed only for the rows that will be sampled.

Under tensor parallelism every rank has a ModelRunner over its shard of the model (``tp``): its KV cache
holds only its own KV heads, with the same number of blocks on every rank (the smallest any rank can
afford), so the block tables rank 0's block manager hands out mean the same slots everywhere.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import smoothing
from engine.attention_metadata import AttentionMetadata
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.parallel_layers import SINGLE, AttentionShards, TensorParallel
from engine.sampler import GreedyChoice
from engine.scheduler import ScheduledBatch
from engine.step_stats import StepStats
from pagedq_kernels import host_memory


@dataclass
class HostInputs:
    """One step's flattened batch on the host: what the forward needs, and all that tensor-parallel
    rank 0 sends the other ranks each step (``engine/distributed.py``)."""

    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    slot_mapping: torch.Tensor  # int64 [N]
    query_lens_cpu: list[int]  # the same lengths as Python ints, for the attention backends' planning
    seq_lens_cpu: list[int]
    prompt_chunks_cpu: list[bool]  # per sequence: its new tokens hold prompt tokens (AttentionMetadata's)


def logit_rows(batch: ScheduledBatch, sample_rows: list[int], num_logits: list[int] | None) -> list[int]:
    """Rows of the flattened batch that get logits: each sampled sequence's last ``num_logits[i]``."""
    if not sample_rows:
        return []
    ends = list(itertools.accumulate(batch.num_new_tokens))  # one past each sequence's last row
    counts = num_logits or [1] * len(sample_rows)
    return [r for i, c in zip(sample_rows, counts, strict=True) for r in range(ends[i] - c, ends[i])]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        stats: StepStats | None = None,
        tp: TensorParallel = SINGLE,
        device: torch.device | None = None,
        agree: Callable[[int], int] | None = None,
        calibration_ids: list[int] | None = None,
    ) -> None:
        """``stats``: where :meth:`execute` adds its input-preparation and forward times (the engine's own).
        ``tp``: this rank's place under tensor parallelism; ``device``: its device (default the config's);
        ``agree``: turns this rank's affordable KV block count into the one every rank uses;
        ``calibration_ids``: tokens for W8A8's activation smoothing (:mod:`engine.smoothing`)."""
        self.config = config
        self.tp = tp
        self.stats = stats if stats is not None else StepStats()
        self.device = device if device is not None else config.torch_device
        self.dtype = config.activation_dtype  # the model's (fp32 under CPU bf16 matmuls)
        self.kv_dtype = config.kv_cache_dtype  # the KV cache's (bf16 under CPU bf16 matmuls: half the bytes)
        self.model, self.model_config = load_model(model_path, self.dtype, self.device, config.backend, tp)
        # A GGUF's linears arrive int8 already; quantization="int8" then quantises any left in float.
        self.quantization = self.model.source_quantization or config.quantization
        if config.quantization in ("int8", "w8a8"):
            if config.quantization == "w8a8" and calibration_ids:
                # SmoothQuant: the activations' outlier channels moved into the weights before quantising.
                amax = smoothing.input_amax(self.model, calibration_ids, self.kv_dtype)
                smoothing.smooth(self.model, amax)
            self.model.quantize_int8(int8_activations=config.quantization == "w8a8")
        if self.device.type == "cpu" and config.cpu_weight_prepack:
            self.model.prepack_cpu_weights(config.matmul_weight_dtype)
        self.block_size = config.block_size
        mc = self.model_config
        self.num_kv_heads = AttentionShards.of(mc, tp).num_kv_heads  # this rank's (all of them on one rank)
        self.num_blocks = self._num_kv_blocks(mc)
        if agree is not None:
            self.num_blocks = agree(self.num_blocks)
        shape = (mc.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = host_memory.zeros(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        self.graphs: DecodeGraphs | None = None
        # Memory honesty (llm.stats(), the worker's heartbeat): what the weights hold, every form counted.
        self.weight_bytes = self.model.weight_bytes()

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """On CUDA with graphs enabled: capture the decode ladder (after the KV cache exists)."""
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return

        def model_fn(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            self.model.ops.attention.prepare(meta)
            return self.model(ids, pos, self.kv_caches, meta)

        with torch.inference_mode():
            self.graphs = DecodeGraphs(model_fn, self.device, max_num_seqs, max_model_len, self.block_size)

    def kv_bytes_per_block(self, mc: ModelConfig) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * mc.num_layers * self.block_size * self.num_kv_heads * mc.head_dim * elem

    def _num_kv_blocks(self, mc: ModelConfig) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block(mc)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
            if self.config.kv_cache_bytes is not None:
                budget = min(budget, self.config.kv_cache_bytes)
        else:
            budget = self.config.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={budget} is smaller than one KV block ({per_block} bytes for this model)")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(
        self,
        batch: ScheduledBatch,
        sample_rows: list[int],
        num_logits: list[int] | None = None,
        greedy: bool = False,
    ) -> torch.Tensor | GreedyChoice | None:
        """Run the batch; returns float32 logits for the sequences at ``sample_rows`` (batch order),
        or None when every sequence was a mid-prompt chunk (its KV still had to be written).

        ``num_logits[i]``: how many of that sequence's last positions need logits (1, or 1 + its
        draft tokens when speculating); the rows come out sequence by sequence, positions in order.
        ``greedy``: every row will be sampled as plain greedy (``sampler.plain_greedy``), so their argmax
        will do: a :class:`GreedyChoice` comes back where the model computes it without the logits.
        """
        t0 = time.perf_counter()
        input_ids, positions, meta = self.prepare_inputs(batch)
        t1 = time.perf_counter()
        logits = self.run(input_ids, positions, meta, logit_rows(batch, sample_rows, num_logits), greedy)
        t2 = time.perf_counter()
        self.stats.phase_s["prepare_inputs"] += t1 - t0
        self.stats.phase_s["forward"] += t2 - t1
        return logits

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rows: list[int],
        greedy: bool = False,
    ) -> torch.Tensor | GreedyChoice | None:
        """The forward over prepared inputs; float32 logits of ``rows`` (None when there are none), or with
        ``greedy`` their :class:`GreedyChoice` where the model has one."""
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        if self.graphs is not None and self.graphs.can_run(meta.num_seqs, meta.max_query_len):
            selected = self.graphs.run(input_ids, positions, meta).index_select(0, index)
        else:
            self.model.ops.attention.prepare(meta)
            # Only the rows that get logits go through the last layer past its attention (LlamaForCausalLM.forward).
            every_row = len(rows) == input_ids.shape[0] and rows == list(range(len(rows)))
            output_rows = None if every_row else index
            selected = self.model(input_ids, positions, self.kv_caches, meta, output_rows)
        logits: torch.Tensor | GreedyChoice | None = None
        if rows:
            choice = self.model.compute_greedy(selected) if greedy else None
            logits = GreedyChoice(*choice) if choice is not None else self.model.compute_logits(selected)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits

    def prepare_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return self.device_inputs(self.host_inputs(batch))

    def host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        """The batch flattened into host tensors (token ids, positions, slots, block tables)."""
        seqs, q_lens = batch.seqs, batch.num_new_tokens
        token_ids: list[int] = []
        computed: list[int] = []
        seq_lens: list[int] = []
        prompt_chunks: list[bool] = []
        for seq, n in zip(seqs, q_lens, strict=True):
            c = seq.num_computed_tokens
            ids = seq.token_ids[c : c + n]
            token_ids.extend(ids)
            prompt_chunks.append(c < seq.num_prompt_tokens)
            if len(ids) < n:  # speculative decoding: the drafts follow the last real token
                token_ids.extend(seq.spec_token_ids[: n - len(ids)])
            computed.append(c)
            seq_lens.append(c + n)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs]

        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(q_lens_t, 0, out=cu[1:])
        offsets = torch.tensor(computed, dtype=torch.long) - cu[:-1].long()
        num_tokens = len(token_ids)
        positions = torch.arange(num_tokens, dtype=torch.long) + torch.repeat_interleave(
            offsets, q_lens_t.long(), output_size=num_tokens
        )
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens_t.long(), output_size=num_tokens)
        block_tables = torch.tensor(tables, dtype=torch.int32)
        bs = self.block_size
        slots = block_tables[seq_index, positions // bs].long() * bs + positions % bs

        return HostInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long),
            positions=positions,
            query_start_loc=cu,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            slot_mapping=slots,
            query_lens_cpu=list(q_lens),
            seq_lens_cpu=seq_lens,
            prompt_chunks_cpu=prompt_chunks,
        )

    def device_inputs(self, host: HostInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``host`` moved to this runner's device, with the attention metadata."""
        dev = self.device
        q_lens, seq_lens = host.query_lens_cpu, host.seq_lens_cpu
        meta = AttentionMetadata(
            query_start_loc=host.query_start_loc.to(dev),
            seq_lens=host.seq_lens.to(dev),
            block_tables=host.block_tables.to(dev),
            slot_mapping=host.slot_mapping.to(dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            prompt_chunks_cpu=host.prompt_chunks_cpu,
        )
        return host.input_ids.to(dev), host.positions.to(dev), meta

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer) for forked samples that will write into their own copy."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def close(self) -> None:
        """Nothing to release on one device (the multi-rank runner stops its ranks here)."""
