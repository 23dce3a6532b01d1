"""pagedq's decoder for Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 checkpoints.

These architectures differ only in details that :class:`~engine.model_config.ModelConfig` turns
into flags (q/k/v and o biases, Qwen3's per-head q/k RMSNorm, tied embeddings, rope scaling), so
one module covers them all.

The forward pass runs over the *flattened* batch: every scheduled sequence's new tokens
concatenated into ``N`` rows, prefill chunks and decode tokens alike, with no padding. Only
attention needs to know where one sequence ends and the next begins (``AttentionMetadata``); every
other op is row-wise. For CPU speed the q/k/v projections are one matmul and gate/up another, and
residual adds are fused into the RMSNorms.

Under tensor parallelism (``tp``, :mod:`engine.parallel_layers`) each rank builds the same modules with
its share of the heads and of the MLP's width: qkv and gate_up are column-parallel, o_proj and down
row-parallel, the embedding and lm_head vocab-parallel. With one rank those are the plain layers.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.kernel_dispatch import Ops
from engine.layers import Linear, RMSNorm, RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.llama_cpu_plan import LlamaCpuPlan
from engine.parallel_layers import (
    SINGLE,
    AttentionShards,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    gather_logits,
)
from pagedq_kernels import argmax_screen, cpu_linear, cpu_ops, int8_linear, w8a8_linear

KVCache = tuple[torch.Tensor, torch.Tensor]
LM_HEAD_INT8_ROWS = 6
"""The most rows a GGUF's int8 lm_head copy takes (within the int8 kernel's fused path): measured beside
LlamaForCausalLM.prepack_cpu_weights."""
LM_HEAD_INT8_DP_ROWS = 8
"""The same under a bf16 model on the AVX512-bf16 dot products (``int8_linear`` there: gemm_int8_dp, its rows
widened in registers): measured beside LlamaForCausalLM.prepack_cpu_weights."""


class LlamaAttention(nn.Module):
    """Self-attention: merged qkv projection, rotary, paged attention through the ops' backend."""

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.shards = shards = AttentionShards.of(config, tp)  # this rank's heads (all of them on one rank)
        self.num_heads = shards.num_heads
        self.num_kv_heads = shards.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = shards.q_size
        self.kv_size = shards.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device, tp
        )
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, config.o_bias, dtype, device, tp)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, dtype, device)
        # One cos/sin table per model, shared by every layer (module dedup keeps it stored once).
        self.rotary_emb = rotary

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(positions, hidden, kv_cache, meta))

    def attend(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention's output ``[N, q_size]`` before ``o_proj`` (which the layer fuses with what follows)."""
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3: RMSNorm over each head's vector, before rotary. Flattened to 2-D rows so any
            # row-wise RMSNorm kernel applies.
            q = self.q_norm(q.reshape(n * self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(n * self.num_kv_heads, self.head_dim))
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)  # a view: the cache writers take token strides
        q, k = self.rotary_emb(positions, q, k)
        k_cache, v_cache = kv_cache
        out = self.ops.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return out.reshape(n, self.q_size)


class LlamaMLP(nn.Module):
    """Gated SiLU MLP with gate and up projections merged into one matmul."""

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = tp.split(config.intermediate_size, "intermediate_size")  # this rank's band
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, 2 * self.intermediate_size, False, dtype, device, tp
        )
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, False, dtype, device, tp)
        self.gated: cpu_linear.PackedWeight | None = None  # CPU: gate_up with the SiLU-and-mul fused in
        self.gated_int8: int8_linear.PackedInt8 | None = None  # the same, for an int8 gate_up
        self.gated_w8a8: w8a8_linear.PackedW8A8 | None = None  # the same, for a W8A8 gate_up on the VNNI kernel

    def prepack_gated(self, dtype: torch.dtype | None = None) -> bool:
        """Pack gate_up with its activation fused (``cpu_linear.pack_gated``: fp32 panels, or bf16 on the AMX
        kernel where it runs; or the int8 kernel's glu panels for an int8 gate_up); False where unsupported
        (e.g. bf16 without AMX: gate_up is then packed as a plain oneDNN linear)."""
        if self.gate_up_proj.w8a8 is not None:  # the VNNI kernel's glu epilogue; oneDNN's stays a plain product
            self.gated_w8a8 = w8a8_linear.gated(self.gate_up_proj.w8a8)
            if self.gated_w8a8 is None:
                return False
            self.gate_up_proj.w8a8 = None
            return True
        quantised = self.gate_up_proj.int8
        if quantised is not None:
            self.gated_int8 = int8_linear.pack(quantised, glu=True, matmul_dtype=dtype)  # bf16: AMX tiles
            if self.gated_int8 is None:
                return False
            self.gate_up_proj.int8 = None
            return True
        self.gated = cpu_linear.pack_gated(self.gate_up_proj.weight, dtype)
        if self.gated is None:
            return False
        self.gate_up_proj.weight.data = self.gate_up_proj.weight.data.new_empty(0)
        return True

    def gate_up_act(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ gate.T) * (x @ up.T)``: one fused matmul when packed gated, else matmul then op."""
        if self.gated is not None:
            return cpu_linear.linear(x, self.gated, None)
        if self.gate_up_proj.w8a8 is not None:  # the per-token scale applied inside the SiLU-and-mul pass
            product, row_scales = w8a8_linear.matmul_unscaled(x, self.gate_up_proj.w8a8)
            return cpu_ops.silu_and_mul_cpu(product, row_scale=row_scales).view(*x.shape[:-1], -1)
        if self.gated_int8 is not None:
            return int8_linear.linear(x, self.gated_int8, None)
        if self.gated_w8a8 is not None:
            return w8a8_linear.linear(x, self.gated_w8a8, None)
        return self.ops.silu_and_mul(self.gate_up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_act(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. The residual travels separately so each norm can fuse the add before it."""

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops, rotary, dtype, device, tp)
        self.mlp = LlamaMLP(config, ops, dtype, device, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,
        normed: torch.Tensor,
        residual: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        next_norm: RMSNorm,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``normed``: this layer's input after its ``input_layernorm``; ``residual``: the stream before it.
        Returns ``next_norm``'s output (the next layer's ``input_layernorm``, or the final norm) and the new
        residual. Each projection that ends a block (``o_proj``, ``down``) runs with the residual add and the
        norm after it in one kernel call where its kernel can (:meth:`RMSNorm.forward_after`).

        ``rows``: only these rows go on past attention (the last layer's, when only some rows get logits):
        every row's K/V is written, and each row after attention is computed on its own, so the rows kept come
        out as they would have."""
        attn = self.self_attn.attend(positions, normed, kv_cache, meta)
        if rows is not None:
            attn, residual = attn.index_select(0, rows), residual.index_select(0, rows)
            if not rows.numel():
                return attn.new_empty((0, residual.shape[1])), residual
        hidden, residual = self.post_attention_layernorm.forward_after(self.self_attn.o_proj, attn, residual)
        return next_norm.forward_after(self.mlp.down_proj, self.mlp.gate_up_act(hidden), residual)


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus lm_head. Parameters are uninitialized until the loader fills them."""

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            ops,
            device,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, ops, self.rotary_emb, dtype, device, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        # Tied checkpoints share one tensor: no copy, and the loader fills it once. Under tensor
        # parallelism the lm_head holds the same vocabulary band as the embedding.
        self.lm_head_weight: nn.Parameter = (
            self.embed_tokens.weight
            if config.tie_word_embeddings
            else nn.Parameter(
                torch.empty(self.embed_tokens.weight.shape, dtype=dtype, device=device),
                requires_grad=False,
            )
        )
        self.lm_head_packed: cpu_linear.PackedWeight | None = None
        # A GGUF's quantised lm_head (or tied embedding) as int8 (the loader sets it), packed beside the dense
        # copy: calls of up to lm_head_int8_rows rows run on it (a lone sequence's decode step streams a quarter
        # of an fp32 head's bytes, half a bf16 one's), larger ones on the dense head, whose greedy argmax needs
        # no logits. Set for an fp32 head on the fused int8 panels, a bf16 one on the AVX512-bf16 kernel.
        self.lm_head_int8: int8_linear.Int8Weight | None = None
        self.lm_head_int8_packed: int8_linear.PackedInt8 | None = None
        self.lm_head_int8_rows = 0
        # The greedy argmax over an fp32 lm_head, screened in int8 or bf16 (pagedq_kernels/argmax_screen.py), or None.
        self.lm_head_screen: argmax_screen.ScreenedHead | None = None
        # The forward as prepared C kernel calls, once every weight is packed for them (prepack_cpu_weights).
        self.cpu_plan: LlamaCpuPlan | None = None
        self.source_quantization: str | None = None  # the checkpoint's own (a GGUF loader sets "gguf:Q4_1")

    def prepack_cpu_weights(self, dtype: torch.dtype | None = None) -> int:
        """Pack every matmul weight for the CPU kernels (after loading), stored in ``dtype`` (default:
        the model's; bf16 for bf16 matmuls under fp32 activations); returns how many were.

        Each MLP's gate_up is packed with its SiLU-and-mul fused in where the panel (fp32) or AMX (bf16)
        kernel runs. The lm_head gets its own packed copy, since a tied embedding table must stay dense for
        the token lookups.
        """
        count = sum(m.prepack_gated(dtype) for m in self.modules() if isinstance(m, LlamaMLP))
        count += sum(
            m.prepack(dtype)
            for m in self.modules()
            if isinstance(m, Linear) and (m.weight.numel() or m.int8 is not None)
        )
        self.lm_head_packed = cpu_linear.pack(self.lm_head_weight, dtype=dtype)
        fp32_head = self.lm_head_weight.dtype == torch.float32 and dtype in (None, torch.float32)
        if self.lm_head_int8 is not None and self.tp.size == 1 and self.lm_head_packed is not None:
            if fp32_head:
                # Within the fused path, and at most 6 rows: past that the dense head's panels (no dequantisation)
                # win even where the fused path goes on (AVX-512: 12 rows), the head being one large weight that a
                # 260 MB L3 can hold. Intel Xeon family 6 model 207, 2 threads, ms per call at 1 / 4 / 7 / 8 / 12
                # rows, int8 fused against dense fp32: 1.24 / 1.93 / 2.62 / 3.67 / 5.37 against 2.39 / 4.48 / 3.63
                # / 3.35 / 5.12.
                self.lm_head_int8_rows = min(int8_linear.fused_rows(), LM_HEAD_INT8_ROWS)
                if self.lm_head_int8_rows:
                    self.lm_head_int8_packed = int8_linear.pack(self.lm_head_int8)
            elif self.lm_head_packed.kind == "dpbf16":
                # A bf16 model on the dot products: the int8 kernel multiplies the GGUF's dequantised weight rounded
                # to bf16, which is what the dense bf16 head holds, so its logits are the dense head's floats, bit
                # for bit, from half the bytes. Up to 8 rows it (logits, then torch's argmax) beats the dense head's
                # argmax epilogue, not past them: 2-vCPU AMD EPYC Zen 5 (family 26 model 2), 2 threads, a Q8_0
                # 49152 x 576 head evicted from the caches before each call, best of 7 interleaved, ms at 1 / 2 / 4
                # / 8 / 12 / 16 rows: 1.22 / 1.31 / 1.49 / 1.42 / 2.11 / 3.14 against 1.80 / 2.12 / 1.86 / 1.65 /
                # 1.65 / 1.99.
                packed = int8_linear.pack(self.lm_head_int8, matmul_dtype=torch.bfloat16)
                if packed is not None and packed.dp_kernels is not None:
                    self.lm_head_int8_packed, self.lm_head_int8_rows = packed, LM_HEAD_INT8_DP_ROWS
        self.lm_head_int8 = None
        if self.tp.size == 1:  # compute_greedy's only case; built before a dense lm_head is freed
            self.lm_head_screen = argmax_screen.build(self.lm_head_weight, self.lm_head_packed)
        if self.lm_head_packed is not None and not self.config.tie_word_embeddings:
            self.lm_head_weight.data = self.lm_head_weight.data.new_empty(0)
        self.cpu_plan = LlamaCpuPlan.build(self)
        return count + (self.lm_head_packed is not None)

    def int8_fused_rows(self) -> int:
        """Rows a step may have while its decoder linears stay on the int8 kernel's fused path (dequantised in
        registers; ``int8_linear.fused_rows``), or 0 where they are not int8 panels. Past it each call writes
        and re-reads an fp32 copy of every panel: the engine keeps a lone sequence's drafts within it."""
        packs: list[int8_linear.PackedInt8 | None] = []
        for module in self.layers:
            layer = cast(LlamaDecoderLayer, module)
            mlp = layer.mlp
            gate_up = mlp.gated_int8 if mlp.gated_int8 is not None else mlp.gate_up_proj.int8_packed
            packs += [layer.self_attn.qkv_proj.int8_packed, layer.self_attn.o_proj.int8_packed, gate_up]
            packs.append(mlp.down_proj.int8_packed)
        if not packs or any(p is None or p.amx for p in packs):
            return 0
        return int8_linear.fused_rows()

    def quantize_int8(self, int8_activations: bool = False) -> int:
        """Every decoder linear to symmetric per-output-channel int8 (``quantization="int8"``), before
        :meth:`prepack_cpu_weights`; returns how many. The lm_head (and the embedding it may share) stays in
        the activation dtype: it is one matmul of many, and the logits are what sampling reads directly.

        ``int8_activations`` (``quantization="w8a8"``): each linear also quantises its input per token and
        multiplies in int8 (:mod:`pagedq_kernels.w8a8_linear`); a ValueError names why where that cannot run."""
        if int8_activations:
            if self.embed_tokens.weight.device.type != "cpu":
                raise ValueError("quantization='w8a8' runs on CPU only; use 'int8' (weight-only) on CUDA")
            if not w8a8_linear.available():
                raise ValueError(
                    f"quantization='w8a8' cannot run here: {w8a8_linear.unavailable_reason()}; 'int8' (weight-only) can"
                )
        linears = [m for m in self.layers.modules() if isinstance(m, Linear) and m.weight.numel()]
        for linear in linears:
            linear.quantize_int8(int8_activations)
        return len(linears)

    def weight_bytes(self) -> int:
        """Bytes held for weights in every form: dense parameters, packed copies and int8 layouts (the
        lm_head's packed copy of a tied embedding counts too: it is memory the process holds)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for module in self.modules():
            if isinstance(module, Linear):
                total += module.weight_bytes - sum(
                    t.numel() * t.element_size() for t in (module.weight, module.bias) if t is not None
                )
            elif isinstance(module, LlamaMLP):
                if module.gated is not None:
                    total += module.gated.data.numel() * module.gated.data.element_size()
                if module.gated_int8 is not None:
                    total += module.gated_int8.nbytes
                if module.gated_w8a8 is not None:
                    total += module.gated_w8a8.nbytes
        if self.lm_head_packed is not None:
            total += self.lm_head_packed.data.numel() * self.lm_head_packed.data.element_size()
        if self.lm_head_screen is not None:
            total += self.lm_head_screen.nbytes
        if self.lm_head_int8_packed is not None:
            total += self.lm_head_int8_packed.nbytes
        return total

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[N, hidden]`` of the flattened batch, or of its ``output_rows`` only
        (int64 row indices: ``[len(output_rows), hidden]``, in their order).

        The caller runs ``model.ops.attention.prepare(meta)`` once per step first (the backend's
        per-step planning, shared by all layers; the model runner owns the step). Writes every new
        token's K/V into ``kv_caches`` (one ``(k_cache, v_cache)`` per layer) as a side effect.
        Logits are left to :meth:`compute_logits` so the caller computes them only for the rows it
        samples from.

        Why ``output_rows``: a prompt's rows need the last layer only up to its K/V (the next steps attend to
        it); past attention, only the rows that get logits matter. So the last layer's o_proj and MLP run on
        those rows alone: for SmolLM2 (30 layers) that is 2.8 % of a prompt token's matmul FLOPs, none of
        which touch a row that is kept (each row past attention is computed on its own), so the rows kept are
        the same bit for bit.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        if self.cpu_plan is not None:  # the same kernel calls, prepared: None where this step needs the modules
            planned = self.cpu_plan.forward(input_ids, positions, kv_caches, meta, output_rows)
            if planned is not None:
                return planned
        hidden = self.embed_tokens(input_ids)
        layers = cast(list[LlamaDecoderLayer], list(self.layers))
        if not layers:
            normed = self.norm(hidden)
            return normed if output_rows is None else normed.index_select(0, output_rows)
        residual = hidden
        hidden = layers[0].input_layernorm(hidden)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            last = i + 1 == len(layers)
            next_norm = self.norm if last else layers[i + 1].input_layernorm
            rows = output_rows if last else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, next_norm, rows)
        return hidden

    def compute_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``compute_logits(hidden).max(dim=1)`` (values, indices) without the logits, where the lm_head's
        kernel has that epilogue (``cpu_linear.argmax_linear``; one rank); else None. An fp32 lm_head with a bf16
        screen (``argmax_screen``) gives the same answer in less time."""
        if self.lm_head_packed is None or self.tp.size != 1 or self._int8_head(hidden) is not None:
            return None
        screen = self.lm_head_screen
        if screen is not None and hidden.dim() == 2:
            return argmax_screen.argmax(hidden, screen)
        return cpu_linear.argmax_linear(hidden, self.lm_head_packed)

    def _int8_head(self, hidden: torch.Tensor) -> int8_linear.PackedInt8 | None:
        """The int8 lm_head where it serves ``hidden``'s rows (see ``lm_head_int8``), else None."""
        rows = hidden.shape[0] if hidden.dim() == 2 else 0
        return self.lm_head_int8_packed if 1 <= rows <= self.lm_head_int8_rows else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [M, hidden]`` -> float32 logits ``[M, vocab]`` (matmul in the model dtype, like HF).

        Under tensor parallelism each rank computes its vocabulary band and rank 0 gathers them all
        (the other ranks get an empty tensor: only rank 0 samples)."""
        if (int8_head := self._int8_head(hidden)) is not None:
            logits = int8_linear.linear(hidden, int8_head, None).float()  # the same floats as the dense panels
        elif self.lm_head_packed is not None:
            logits = cpu_linear.linear(hidden, self.lm_head_packed, None).float()
        else:
            logits = F.linear(hidden, self.lm_head_weight).float()
        return gather_logits(logits, self.tp, self.config.vocab_size)
