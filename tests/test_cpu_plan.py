"""The decoder's forward as prepared C kernel calls (``engine/models/llama_cpu_plan.py``) against the module
forward it replaces: the same kernels in the same order, so the hidden states and the KV cache written must be
equal bit for bit, on every packed kind this machine runs (fp32 panels under each instruction-set build, bf16
on the AVX512-bf16 or AMX kernel), over a step that mixes every attention path (prefill chunks, a chunk
continuing a cached prefix, speculative-sized query runs, single decode tokens, a shared prefix the decode
kernel attends once)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.attention import TorchAttention
from engine.attention_metadata import AttentionMetadata
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_cpu_plan import DISABLE_ENV, LlamaCpuPlan
from pagedq_kernels import cpu_attention, cpu_isa, w8a8_linear

BLOCK = 16
# (context length after the step, new tokens): a whole prompt, a chunk after a cached prefix, query runs the
# size of a drafted verification (1 + 4) and of a short prefill tail (12: the decode kernel's multi-query
# task over fp32, the prefill kernel over bf16), single decode tokens; the last three share their first two
# blocks (the decode kernel's cascade over a shared prefix).
STEP = [(37, 37), (70, 23), (45, 5), (61, 12), (50, 1), (75, 1), (33, 1), (90, 1)]
DECODE_STEP = [s for s in STEP if s[1] == 1]
SHARED = 3  # the last SHARED sequences' tables start with the same two blocks


def _step(step: list[tuple[int, int]], num_blocks: int, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of ``step`` (as :data:`STEP`), each sequence on its own blocks past the shared two."""
    tables, next_block = [], 2
    width = max(-(-s // BLOCK) for s, _ in step)
    for i, (seq_len, _) in enumerate(step):
        blocks = -(-seq_len // BLOCK)
        shared = i >= len(step) - SHARED
        own = list(range(next_block, next_block + blocks - (2 if shared else 0)))
        next_block += len(own)
        tables.append(([0, 1] if shared else []) + own + [0] * (width - blocks))
    assert next_block <= num_blocks
    table = torch.tensor(tables, dtype=torch.int32)
    positions = torch.cat([torch.arange(s - q, s) for s, q in step])
    seq_of = torch.cat([torch.full((q,), i) for i, (_, q) in enumerate(step)])
    slots = table[seq_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    q_lens = [q for _, q in step]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in step], dtype=torch.int32),
        block_tables=table,
        slot_mapping=slots,
        max_query_len=max(q_lens),
        max_seq_len=max(s for s, _ in step),
        query_lens_cpu=q_lens,
        seq_lens_cpu=[s for s, _ in step],
    )
    return positions.to(device), meta


def _both_forwards(
    llm: LLM, step: list[tuple[int, int]] = STEP, seed: int = 0, output_rows: list[int] | None = None
) -> torch.Tensor:
    """One step through the plan and through the modules, from the same random cache: equal outputs and caches.
    Returns the plan's output (of ``output_rows`` only, where given)."""
    runner = llm.engine.runner
    model = runner.model
    assert isinstance(runner, ModelRunner) and isinstance(model, LlamaForCausalLM)
    plan = model.cpu_plan
    assert plan is not None, "this model packs for the C kernels: it should have a plan"
    torch.manual_seed(seed)
    cache = runner.kv_cache
    cache.copy_(torch.randn(cache.shape).to(cache.dtype))  # the cached prefixes the chunks continue
    start = cache.clone()
    positions, meta = _step(step, cache.shape[2], cache.device)
    ids = torch.randint(0, model.config.vocab_size, (positions.shape[0],))
    with torch.inference_mode():
        model.ops.attention.prepare(meta)
        split = TorchAttention._split(meta.backend_state, runner.kv_caches[0][0])
        assert split.decode.rows.numel()
        if step is STEP:  # every attention kernel, in one step
            assert split.prefill_batch is not None
            assert split.verify is not None or not cpu_attention.multi_query_supported(cache.dtype)
        rows = None if output_rows is None else torch.tensor(output_rows, dtype=torch.long)
        planned = plan.forward(ids, positions, runner.kv_caches, meta, rows)
        planned_cache = cache.clone()
        cache.copy_(start)
        model.cpu_plan = None
        try:
            moduled = model(ids, positions, runner.kv_caches, meta, rows)
        finally:
            model.cpu_plan = plan
    assert planned is not None
    assert torch.equal(planned, moduled)
    assert torch.equal(planned_cache, cache)
    assert not torch.equal(cache, start)  # the step did write its K/V
    return planned


@pytest.mark.parametrize(
    ("arch", "quantization"),
    [
        ("llama_gqa", "none"),
        ("qwen2", "none"),
        ("llama_tp_odd_vocab", "none"),
        ("llama_gqa", "int8"),
        ("qwen2", "int8"),
    ],
)
def test_plan_equals_the_module_forward_fp32(
    arch: str, quantization: str, isa_variant: str, tiny_model: Callable[[str], Path]
) -> None:
    """fp32 panels, or int8 weights on their kernel (no add-and-norm epilogue: the projection, then the norm),
    under each instruction-set build (qwen2: q/k/v biases; the odd-vocab model: 96 wide, 6 KV heads). The generic
    build has no fp32 panel kernel: those weights go to oneDNN, and no plan is made."""
    llm = LLM(str(tiny_model(arch)), dtype="float32", quantization=quantization, num_kv_blocks=64, block_size=BLOCK)
    model = llm.engine.runner.model
    if isa_variant == "generic" and quantization == "none":
        assert model.cpu_plan is None
        return
    _both_forwards(llm, STEP)


def test_a_kept_step_frame_serves_the_next_step_of_as_many_rows(tiny_model: Callable[[str], Path]) -> None:
    """A decode-sized step's buffers and bound calls are kept (the plan's step frames): a second step of as many
    rows, other tokens and cache, again equals the module forward, through the same frame, and leaves the first
    step's result (the caller's own copy) as it was."""
    llm = LLM(str(tiny_model("llama_gqa")), dtype="float32", num_kv_blocks=64, block_size=BLOCK)
    plan = llm.engine.runner.model.cpu_plan
    if plan is None:
        pytest.skip("no fp32 panel kernel in this build: no plan")
    first = _both_forwards(llm, DECODE_STEP, seed=0)
    held = first.clone()
    key = (len(DECODE_STEP), torch.get_num_threads())
    frame = plan._frames[key]
    second = _both_forwards(llm, DECODE_STEP, seed=1)
    assert plan._frames[key] is frame
    assert torch.equal(first, held)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_the_rows_kept_go_past_the_last_layers_attention(
    dtype: str, monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[[str], Path]
) -> None:
    """``output_rows``: the plan and the module forward both give those rows of the whole step's output, bit for
    bit, and write the whole step's K/V (the equal caches are checked in _both_forwards against the module
    forward, and here against the whole step's): each sequence's last row (the rows that get logits), rows in
    any order, none at all (every sequence a mid-prompt chunk), and every row. bf16: where the CPU runs one of
    pagedq's bf16 kernels."""
    if dtype == "bfloat16":
        monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
        if not cpu_isa.current().bf16_matmul:
            pytest.skip(f"this CPU multiplies no bf16 in hardware (probed: {list(cpu_isa.current().probed)})")
    llm = LLM(str(tiny_model("llama_gqa")), dtype=dtype, num_kv_blocks=64, block_size=BLOCK)
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner)
    if runner.model.cpu_plan is None:
        pytest.skip("no fp32 panel kernel in this build: no plan")
    step = STEP
    cache = runner.kv_cache
    whole = _both_forwards(llm, step)
    whole_cache = cache.clone()
    ends = torch.tensor([q for _, q in step]).cumsum(0)
    n = int(ends[-1])
    for rows in ((ends - 1).tolist(), [n - 1, 3, 0, 40 % n], [], list(range(n))):
        kept = _both_forwards(llm, step, output_rows=rows)
        assert kept.shape == (len(rows), whole.shape[1])
        assert torch.equal(kept, whole[rows])
        assert torch.equal(cache, whole_cache)


@pytest.mark.parametrize(("arch", "quantization"), [("llama_gqa", "none"), ("qwen2", "none"), ("llama_gqa", "int8")])
def test_plan_equals_the_module_forward_bf16(
    arch: str, quantization: str, monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[[str], Path]
) -> None:
    """bf16 weights on pagedq's own bf16 kernel (AMX, else AVX512-bf16) and a bf16 cache, where the CPU runs one;
    int8 weights of a bf16 model (on AMX tiles where AMX runs)."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    if not cpu_isa.current().bf16_matmul:
        pytest.skip(f"this CPU multiplies no bf16 in hardware (probed: {list(cpu_isa.current().probed)})")
    llm = LLM(str(tiny_model(arch)), dtype="bfloat16", quantization=quantization, num_kv_blocks=64, block_size=BLOCK)
    _both_forwards(llm)


def test_plan_equals_the_module_forward_w8a8(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[[str], Path]
) -> None:
    """W8A8 on the VNNI kernel (the ISA cap lifted: it needs the avx512_bf16 level): every decoder linear in the plan,
    gate_up through the kernel's glu epilogue, the same floats as the module forward."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    kinds = w8a8_linear.available_kinds()
    if not kinds or kinds[0] != "vnni":
        pytest.skip(f"W8A8 runs {kinds or 'nowhere'} here, not first on the VNNI kernel")
    llm = LLM(str(tiny_model("llama_gqa")), dtype="float32", quantization="w8a8", num_kv_blocks=64, block_size=BLOCK)
    _both_forwards(llm, STEP)
    _both_forwards(llm, DECODE_STEP, seed=1)


def test_models_the_plan_cannot_run_keep_the_module_forward(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[[str], Path]
) -> None:
    """Qwen3's per-head norms, W8A8 on oneDNN's int8 matmul (where it runs; the suite's ISA cap keeps the VNNI
    kernel off) and the switch: no plan, and the engine still generates."""
    archs = [("qwen3", "none")] + ([("llama_gqa", "w8a8")] if w8a8_linear.available() else [])
    for arch, quantization in archs:
        llm = LLM(str(tiny_model(arch)), dtype="float32", quantization=quantization, num_kv_blocks=64)
        assert llm.engine.runner.model.cpu_plan is None
        assert len(llm.generate([[5, 6, 7]])[0].outputs[0].token_ids) > 0
    monkeypatch.setenv(DISABLE_ENV, "1")
    llm = LLM(str(tiny_model("llama_gqa")), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.cpu_plan is None
    monkeypatch.delenv(DISABLE_ENV)
    assert LlamaCpuPlan.build(llm.engine.runner.model) is not None
