"""A Llama decoder's CPU forward as one list of prepared C kernel calls, made back to back.

The module forward (:class:`~engine.models.llama.LlamaForCausalLM`) makes the same kernel calls, but each
behind a Python wrapper that checks shapes, allocates its output and looks up its library: ~12 us of Python
per call on top of ctypes' own ~3 us, and a step of SmolLM2 (30 layers) makes about 200 calls. Measured on a
2-vCPU AMD EPYC Zen 4, that was ~6 ms of a 17 ms single-sequence decode step, paid again by every step of a
batch. Here a step allocates its buffers once (two residual streams and two normed ones, used alternately,
the qkv, attention and activation rows, one bf16 buffer every bf16 matmul rounds its input into), binds every
call's arguments (:mod:`pagedq_kernels.kernel_call`) and then only calls.

The calls are the module forward's own, in its order, on the same operands: the floats are the same, bit for
bit (``tests/test_cpu_plan.py``). Where any piece of a model or of a step is something only the module forward
runs (W8A8 or any linear on oneDNN, Qwen3's per-head norms, tensor parallelism, a torch attention path, hooks
that must see module calls: a model not yet packed has no plan), :meth:`LlamaCpuPlan.forward` answers None
and the module forward runs instead. ``PAGEDQ_DISABLE_CPU_PLAN=1`` switches it off (for A/B runs).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention import TorchAttention
from engine.attention_metadata import AttentionMetadata
from engine.layers import Linear
from pagedq_kernels import cpu_linear, cpu_ops, int8_linear, kernel_call, w8a8_linear

if TYPE_CHECKING:
    from engine.models.llama import KVCache, LlamaAttention, LlamaForCausalLM

DISABLE_ENV = "PAGEDQ_DISABLE_CPU_PLAN"
# Step frames (_StepFrame) are kept for steps of up to this many rows (decode steps, short chunks), the least
# recently used dropped past FRAME_CACHE_ROWS_KEPT rows in all (~29 KB a row for SmolLM2: ~30 MB).
FRAME_CACHE_ROWS = 256
FRAME_CACHE_ROWS_KEPT = 1024


Packed = cpu_linear.PackedWeight | int8_linear.PackedInt8 | w8a8_linear.PackedW8A8


def _c_packed(weight: Packed | None) -> Packed | None:
    """``weight`` where it has a C kernel call (:func:`_linear_call`), else None."""
    if isinstance(weight, cpu_linear.PackedWeight):
        return weight if weight.kind in cpu_linear.CALL_KINDS else None
    if isinstance(weight, w8a8_linear.PackedW8A8):
        return weight if weight.kind == "vnni" else None
    return weight


def _rounds_to_bf16(weight: Packed) -> bool:
    """Whether the weight's kernel rounds x into the step's bf16 buffer (bf16 weights, int8 on AMX tiles)."""
    if isinstance(weight, cpu_linear.PackedWeight):
        return weight.kind in cpu_linear.BF16_KINDS
    return isinstance(weight, int8_linear.PackedInt8) and weight.amx


@dataclass(frozen=True)
class _Projection:
    """A packed linear (float, int8 or W8A8 on the VNNI kernel), its bias as the kernels read it (contiguous fp32),
    and its kernel's call builder (``cpu_linear.linear_call``, ``int8_linear.linear_call`` or
    ``w8a8_linear.linear_call`` with the weight bound: x, out, bias, the bf16 buffer, threads)."""

    packed: Packed
    bias: torch.Tensor | None
    call: Callable[..., kernel_call.KernelCall]

    @classmethod
    def of(cls, packed: Packed | None, bias: torch.Tensor | None = None) -> _Projection | None:
        packed = _c_packed(packed)
        if packed is None:
            return None
        if isinstance(packed, cpu_linear.PackedWeight):
            call = functools.partial(cpu_linear.linear_call, packed)
        elif isinstance(packed, w8a8_linear.PackedW8A8):
            call = functools.partial(w8a8_linear.linear_call, packed)
        else:
            call = functools.partial(int8_linear.linear_call, packed)
        return cls(packed, bias.detach().float().contiguous() if bias is not None else None, call)

    @classmethod
    def of_linear(cls, linear: Linear) -> _Projection | None:
        return cls.of(linear.packed or linear.int8_packed or linear.w8a8, linear.bias)


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor  # contiguous fp32
    eps: float


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights as its calls read them; ``next_norm``: the next layer's input norm (or
    the final norm), which the layer's last call applies."""

    qkv: _Projection
    o: _Projection
    post_attention_norm: _Norm
    gate_up: _Projection  # packed with its SiLU-and-mul fused (glu)
    down: _Projection
    next_norm: _Norm


class LlamaCpuPlan:
    """Binds and makes one step's kernel calls for a packed fp32-activation Llama on CPU (see the module)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: LlamaAttention,
        attention: TorchAttention,
        layers: list[_Layer],
        first_norm: _Norm,
    ) -> None:
        self.embed_tokens = model.embed_tokens  # not the model itself: the model holds the plan
        self.layers = layers
        self.first_norm = first_norm
        self.attention = attention
        self.q_size, self.kv_size, self.scale = attn.q_size, attn.kv_size, attn.scale
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden_size = model.config.hidden_size
        self.intermediate_size = layers[0].gate_up.packed.out_features
        self.cos_sin_cache = model.rotary_emb.cos_sin_cache
        weights = [p.packed for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.rounds_to_bf16 = any(_rounds_to_bf16(w) for w in weights)
        self.max_in_features = max(w.in_features for w in weights)
        self._frames: OrderedDict[tuple[int, int], _StepFrame] = OrderedDict()  # (rows, threads): LRU order

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> LlamaCpuPlan | None:
        """The plan for ``model`` once its weights are packed, or None where it has parts only the module
        forward runs (listed in the module docstring)."""
        from engine.models.llama import LlamaDecoderLayer

        ops = model.ops
        blocks = [layer for layer in model.layers if isinstance(layer, LlamaDecoderLayer)]
        eligible = (
            not os.environ.get(DISABLE_ENV)
            and blocks
            and len(blocks) == len(model.layers)
            and model.tp.size == 1
            and model.embed_tokens.weight.device.type == "cpu"
            and model.embed_tokens.weight.dtype == torch.float32
            and ops.name == "torch"
            and isinstance(ops.attention, TorchAttention)
            and ops.rotary_embedding is cpu_ops.rotary_embedding_cpu
            and cpu_ops.available()
            and model.rotary_emb.cos_sin_cache.dtype == torch.float32
        )
        if not eligible:
            return None
        norms = [_Norm(b.input_layernorm.weight.detach(), b.input_layernorm.eps) for b in blocks]
        norms.append(_Norm(model.norm.weight.detach(), model.norm.eps))
        if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms):
            return None
        layers: list[_Layer] = []
        for i, block in enumerate(blocks):
            attn, mlp = block.self_attn, block.mlp
            qkv, o, down = (_Projection.of_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.down_proj))
            gated = _Projection.of(mlp.gated or mlp.gated_int8 or mlp.gated_w8a8)
            post = block.post_attention_layernorm
            if qkv is None or o is None or down is None or attn.q_norm is not None:
                return None
            if gated is None or post.weight.dtype != torch.float32:
                return None
            post_norm = _Norm(post.weight.detach().contiguous(), post.eps)
            layers.append(_Layer(qkv, o, post_norm, gated, down, norms[i + 1]))
        assert isinstance(ops.attention, TorchAttention)
        return cls(model, blocks[0].self_attn, ops.attention, layers, norms[0])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The module forward's result (final-normed hidden states ``[N, hidden]``, or of ``output_rows`` only;
        the KV written), or None where this step needs a path only the module forward has (then nothing was
        computed or written).

        With ``output_rows``, the last layer runs to its attention on every row (its K/V), and past it on a
        frame of the kept rows alone, as the module forward does: the rows gathered into that frame (attention's
        output and the residual) are the operands those rows' calls read, so the floats are the same."""
        n = input_ids.shape[0]
        if not n or positions.dtype != torch.int64:
            return None
        threads = torch.get_num_threads()
        frame = self._frame(n, threads)
        attention = self.attention.kernel_calls(frame.q, frame.k, frame.v, kv_caches, frame.attended, meta, self.scale)
        if attention is None:
            return None
        kept = n if output_rows is None else output_rows.numel()
        tail = self._frame(kept, threads) if 0 < kept < n else None  # the kept rows' frame, past attention
        frame.hidden.copy_(self.embed_tokens(input_ids))
        frame.positions.copy_(positions)
        layers = list(zip(frame.before_attention, attention, frame.after_attention, strict=True))
        if kept == n:
            kernel_call.run(itertools.chain(frame.first, *(itertools.chain(*layer) for layer in layers)))
            out = frame.out if output_rows is None else frame.out.index_select(0, output_rows)
            # A kept frame is the next step's of as many rows: what the caller holds must not change under it.
            return out.clone() if output_rows is None and _keeps_frame(n) else out
        assert output_rows is not None
        before_last, attention_last, _ = layers.pop()
        before = (itertools.chain(*layer) for layer in layers)
        kernel_call.run(itertools.chain(frame.first, *before, before_last, attention_last))
        if tail is None:  # no row gets logits (every sequence a mid-prompt chunk): the K/V was all
            return frame.out.new_empty((0, self.hidden_size))
        torch.index_select(frame.attended.view(n, -1), 0, output_rows, out=tail.attended.view(kept, -1))
        torch.index_select(frame.last_residual, 0, output_rows, out=tail.last_residual)
        kernel_call.run(tail.after_attention[-1])
        return tail.out.clone() if _keeps_frame(kept) else tail.out

    def _frame(self, n: int, threads: int) -> _StepFrame:
        """The step frame for ``n`` rows: a kept one, or a new one (kept where ``n`` is a decode step's size)."""
        key = (n, threads)
        frame = self._frames.get(key)
        if frame is not None:
            self._frames.move_to_end(key)
            return frame
        frame = self._build_frame(n, threads)
        if _keeps_frame(n):
            self._frames[key] = frame
            while sum(rows for rows, _ in self._frames) > FRAME_CACHE_ROWS_KEPT:
                self._frames.popitem(last=False)
        return frame

    def _build_frame(self, n: int, threads: int) -> _StepFrame:
        rows = (n, self.hidden_size)
        hidden = torch.empty(rows)  # the embedding's rows, copied in per step
        positions = torch.empty(n, dtype=torch.int64)  # copied in per step
        residuals = (torch.empty(rows), torch.empty(rows))  # after attention, after the MLP: each layer alike
        normed = (torch.empty(rows), torch.empty(rows))  # a layer's input, its MLP's input
        qkv_rows = torch.empty((n, self.q_size + 2 * self.kv_size))
        q, k, v = qkv_rows.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attended = torch.empty((n, self.num_heads, self.head_dim))
        attended_rows = attended.view(n, self.q_size)
        activated = torch.empty((n, self.intermediate_size))
        o_rows = torch.empty(rows)  # only where o_proj's kernel has no add-and-norm epilogue (amx)
        x_bf16 = None
        if self.rounds_to_bf16:  # rows padded to an AMX tile's 16: enough for every kind
            x_bf16 = torch.empty((cpu_linear.bf16_rows("amx", n), self.max_in_features), dtype=torch.bfloat16)
        scratch = _Scratch(o_rows, x_bf16, threads)
        first_norm = self.first_norm
        first = [cpu_ops.rms_norm_call(hidden, first_norm.weight, first_norm.eps, None, normed[0], None, threads)]
        rotary = cpu_ops.rotary_call(positions, q, k, self.cos_sin_cache, threads)
        before: list[list[kernel_call.KernelCall]] = []
        after: list[list[kernel_call.KernelCall]] = []
        residual = last_residual = hidden  # what each layer's o_proj adds to: the embedding, then residuals[1]
        for layer in self.layers:
            before.append([layer.qkv.call(normed[0], qkv_rows, layer.qkv.bias, x_bf16, threads), rotary])
            post = layer.post_attention_norm
            calls = _add_norm(layer.o, attended_rows, residual, post, residuals[0], normed[1], scratch)
            calls.append(layer.gate_up.call(normed[1], activated, None, x_bf16, threads))
            mlp_out = (residuals[1], normed[0])
            calls += _add_norm(layer.down, activated, residuals[0], layer.next_norm, *mlp_out, scratch)
            after.append(calls)
            last_residual, residual = residual, residuals[1]
        kept = (*residuals, normed[1], qkv_rows, activated, o_rows, *((x_bf16,) if x_bf16 is not None else ()))
        return _StepFrame(hidden, positions, q, k, v, attended, last_residual, normed[0], first, before, after, kept)


def _keeps_frame(rows: int) -> bool:
    """Whether a step of this many rows keeps its frame (forward then hands the caller a copy of its output)."""
    return rows <= FRAME_CACHE_ROWS


@dataclass(frozen=True)
class _StepFrame:
    """A step's buffers for its number of rows and every call but attention's, bound to them: made once and
    reused by each step of as many rows. Binding a one-sequence step of SmolLM2 (~210 calls, timed with the calls
    not made) took 0.53 ms of Python, 0.07 ms with its frame kept (the step itself is ~10 ms); attention's calls
    read the step's own metadata and are bound per step."""

    hidden: torch.Tensor  # [n, hidden] the embedding's rows, written per step
    positions: torch.Tensor  # [n] int64, written per step (rotary reads it)
    q: torch.Tensor  # [n, H, D], views of the qkv rows
    k: torch.Tensor  # [n, KVH, D]
    v: torch.Tensor
    attended: torch.Tensor  # [n, H, D] attention's output
    last_residual: torch.Tensor  # [n, hidden] the residual stream the last layer's o_proj adds to
    out: torch.Tensor  # [n, hidden] the final norm's output
    first: list[kernel_call.KernelCall]  # the first layer's input norm
    before_attention: list[list[kernel_call.KernelCall]]  # per layer: qkv, rotary
    after_attention: list[list[kernel_call.KernelCall]]  # per layer: o (+ residual and norm), gate_up, down (+ ...)
    buffers: tuple[torch.Tensor, ...]  # the rest the calls read and write: held here, since calls hold addresses only


@dataclass(frozen=True)
class _Scratch:
    """What a step's calls share: o_proj's rows where its kernel has no add-and-norm epilogue, the bf16 buffer
    the bf16 matmuls round their input into, the thread count."""

    o_rows: torch.Tensor
    x_bf16: torch.Tensor | None
    threads: int


def _add_norm(
    projection: _Projection,
    x: torch.Tensor,
    residual: torch.Tensor,
    norm: _Norm,
    out: torch.Tensor,
    normed: torch.Tensor,
    scratch: _Scratch,
) -> list[kernel_call.KernelCall]:
    """``out = x @ W.T + bias + residual`` and ``normed = rms_norm(out)``: one call where the kernel has the
    epilogue (:meth:`engine.layers.RMSNorm.forward_after`'s choice), else the projection into the scratch rows
    and the norm with its residual add."""
    packed, bias, x_bf16, threads = projection.packed, projection.bias, scratch.x_bf16, scratch.threads
    if isinstance(packed, cpu_linear.PackedWeight) and cpu_linear.has_add_norm(packed):
        call = cpu_linear.linear_add_norm_call(
            packed, x, out, bias, x_bf16, residual, norm.weight, norm.eps, normed, threads
        )
        return [call]
    return [
        projection.call(x, scratch.o_rows, bias, x_bf16, threads),
        cpu_ops.rms_norm_call(scratch.o_rows, norm.weight, norm.eps, residual, normed, out, threads),
    ]
