"""Activation smoothing before W8A8 (SmoothQuant): move the activations' outlier channels into the weights.

Per-token int8 activations share one scale per row, so a few channels that run 10-100x larger than the
rest (LLMs have them, in the same channels for every token) leave the rest a handful of codes. SmoothQuant
(Xiao et al., 2023) divides input channel ``k`` by ``s_k`` and multiplies the weight's column ``k`` by
``s_k``: the product is unchanged, the activations' range evens out and the weights, which quantise per
output channel, absorb it. ``s_k = amax_x[k] ** alpha / amax_w[k] ** (1 - alpha)``.

The division is folded into whatever produces the input, so it costs nothing at run time:

- qkv's input is ``input_layernorm``'s output, gate_up's is ``post_attention_layernorm``'s: the norm's
  weight (gamma) is divided by ``s``;
- down's input is ``silu(gate) * up``: the up rows of gate_up are divided by ``s`` (an elementwise
  product, so exactly);
- o_proj's input is the attention output, per head a weighted mix of that head's V rows: V's output rows
  are divided by ``s`` (the same ``s`` for every query head of a GQA group, which shares one V head).

``amax_x`` comes from running the dense model over a short fixed calibration text
(:data:`CALIBRATION_TEXT`, prose and code, unrelated to the perplexity text the README scores).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.layers import Linear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

ALPHA = 0.65
"""Migration strength. SmolLM2-135M's perplexity under W8A8 (README, "Quantisation"; fp32 8.7912, no smoothing
9.0851): alpha 0.35 -> 8.9588, 0.5 -> 8.8982, 0.6 -> 8.8985, 0.65 -> 8.8886, 0.7 -> 8.9004, 0.8 -> 9.0459."""

CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the quarterly report. Revenue grew by 12 percent, driven mostly "
    "by subscriptions in Europe and Asia, while hardware sales fell slightly. The board asked for a clearer "
    "plan for the next two years, including hiring, office space and the migration of the billing system to "
    "the new platform. Several members raised concerns about security and the time needed to train staff.\n\n"
    "def merge_intervals(intervals):\n"
    '    """Merge overlapping [start, end] pairs and return them sorted."""\n'
    "    result = []\n"
    "    for start, end in sorted(intervals):\n"
    "        if result and start <= result[-1][1]:\n"
    "            result[-1][1] = max(result[-1][1], end)\n"
    "        else:\n"
    "            result.append([start, end])\n"
    "    return result\n\n"
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, water and "
    "carbon dioxide are turned into glucose and oxygen; the oxygen is released into the air. Animals, in turn, "
    "breathe that oxygen and return carbon dioxide, closing a cycle that has shaped the atmosphere for more "
    "than two billion years. Q: What is the capital of Japan? A: Tokyo. Q: How many legs does a spider have? "
    "A: Eight. SELECT name, COUNT(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;"
)
CALIBRATION_TOKENS = 512  # one prefill of the text (repeated if the tokenizer makes it shorter)
_BLOCK = 16


def calibration_ids(encode: Callable[[str], list[int]]) -> list[int]:
    """The calibration text's token ids, ``CALIBRATION_TOKENS`` long (the text repeated as needed)."""
    ids = encode(CALIBRATION_TEXT)
    if not ids:
        raise ValueError("the tokenizer turned the calibration text into no tokens")
    return (ids * (-(-CALIBRATION_TOKENS // len(ids))))[:CALIBRATION_TOKENS]


@torch.no_grad()
def input_amax(model: LlamaForCausalLM, token_ids: list[int], kv_dtype: torch.dtype) -> dict[Linear, torch.Tensor]:
    """Each decoder linear's per-input-channel ``max |x|`` over one prefill of ``token_ids`` (dense model)."""
    config = model.config
    device = model.embed_tokens.weight.device
    n = len(token_ids)
    if not len(model.layers) or not n:
        return {}
    blocks = -(-n // _BLOCK)
    first = model.layers[0]
    assert isinstance(first, LlamaDecoderLayer)
    shape = (blocks, _BLOCK, first.self_attn.num_kv_heads, config.head_dim)
    kv_caches = [
        (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
        for _ in model.layers
    ]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None, :],
        slot_mapping=torch.arange(n, dtype=torch.long, device=device),
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    found: dict[Linear, torch.Tensor] = {}
    hooks = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(module, Linear)
        found[module] = args[0].detach().abs().reshape(-1, module.in_features).amax(dim=0).float()

    for module in model.layers.modules():
        if isinstance(module, Linear):
            hooks.append(module.register_forward_pre_hook(record))
    # Dense and not yet packed, every linear (down_proj included) runs as a module call: every hook fires.
    try:
        model.ops.attention.prepare(meta)
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        model(ids, torch.arange(n, dtype=torch.long, device=device), kv_caches, meta)
    finally:
        for hook in hooks:
            hook.remove()
    return found


def _balance(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s = x ** alpha / w ** (1 - alpha)``, kept within 1e-3..1e3 (a dead channel stays sane)."""
    s = x_amax.clamp(min=1e-5).pow(alpha) / w_amax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-3, max=1e3)


def _scales(x_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    return _balance(x_amax, weight.detach().abs().amax(dim=0).float(), alpha)


@torch.no_grad()
def smooth(model: LlamaForCausalLM, amax: dict[Linear, torch.Tensor], alpha: float | None = None) -> int:
    """Fold the smoothing scales into the dense weights (before quantisation); returns how many linears.
    ``alpha``: default :data:`ALPHA`."""
    alpha = ALPHA if alpha is None else alpha
    count = 0
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        pairs = (
            (attn.qkv_proj, layer.input_layernorm.weight),
            (mlp.gate_up_proj, layer.post_attention_layernorm.weight),
        )
        for linear, gamma in pairs:
            if linear not in amax or not linear.weight.numel():
                continue
            s = _scales(amax[linear], linear.weight, alpha)
            gamma.div_(s.to(gamma.dtype))
            linear.weight.mul_(s.to(linear.weight.dtype)[None, :])
            count += 1
        down, gate_up = mlp.down_proj, mlp.gate_up_proj
        if down in amax and down.weight.numel() and gate_up.weight.numel():
            s = _scales(amax[down], down.weight, alpha)
            _divide_rows(gate_up, mlp.intermediate_size, s)  # the up half
            down.weight.mul_(s.to(down.weight.dtype)[None, :])
            count += 1
        o_proj, qkv = attn.o_proj, attn.qkv_proj
        if o_proj in amax and o_proj.weight.numel() and qkv.weight.numel():
            # Channel (head h, dim d) of o_proj's input comes from V head h // group: one scale per (V head, d),
            # from the largest activation and weight column over the group's query heads.
            kv_heads, dim = attn.num_kv_heads, attn.head_dim
            group = attn.num_heads // kv_heads
            x_amax = amax[o_proj].view(kv_heads, group, dim).amax(dim=1)
            w_amax = o_proj.weight.detach().abs().amax(dim=0).float().view(kv_heads, group, dim).amax(dim=1)
            s_kv = _balance(x_amax, w_amax, alpha).reshape(-1)
            _divide_rows(qkv, attn.q_size + attn.kv_size, s_kv)  # the V rows
            s = s_kv.view(kv_heads, 1, dim).expand(kv_heads, group, dim).reshape(-1)
            o_proj.weight.mul_(s.to(o_proj.weight.dtype)[None, :])
            count += 1
    return count


def _divide_rows(linear: Linear, start: int, s: torch.Tensor) -> None:
    """Output rows ``start : start + len(s)`` of ``linear`` (and their bias) divided by ``s``."""
    end = start + s.numel()
    linear.weight[start:end].div_(s.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias[start:end].div_(s.to(linear.bias.dtype))
