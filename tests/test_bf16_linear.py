"""bf16 weights on pagedq's own kernels (pagedq_kernels/cpu_linear kinds "amx", pagedq_kernels/csrc/cpu_bf16_amx.c, and
"dpbf16", pagedq_kernels/csrc/cpu_bf16_dp.c: one packed layout, two instructions), each that runs here: against a
float64 reference on bf16-rounded inputs, every partial tile and block, bias, the fused SiLU-and-mul; the next
kind under the ISA cap and the switches, oneDNN for in_features the layout cannot take; a bf16 tiny model
end to end against itself on oneDNN."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.layers import Linear
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.sampler import GreedyChoice, Sampler, SamplerOutput, SamplingRow
from pagedq_kernels import cpu_isa, cpu_linear
from schemas.sampling import SamplingParams
from tests.epilogue_checks import check_add_norm_epilogue, check_argmax_epilogue
from tests.tiny_models import random_linear
from worker.__main__ import kernel_path
from worker.settings import Settings

ROWS = (1, 5, 16, 17, 31, 33, 36, 100, 300)  # AMX tile heights 1, 5, 16, 9, 16, 11, 12, 15, 16; dpbf16: 1-12
SWITCH = {"amx": "PAGEDQ_DISABLE_AMX_LINEAR", "dpbf16": "PAGEDQ_DISABLE_DP_LINEAR"}


@pytest.fixture(autouse=True, params=["amx", "dpbf16", "dpbf16-fma"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The kernel under test, preferred for bf16 weights. The suite caps the ISA below bf16
    (tests/conftest.py): lifted here, as tests/test_bf16.py does. dpbf16 runs where AMX does not, so on an
    AMX machine AMX is switched off for it; it runs once with its products on VDPBF16PS and once on fp32 FMAs
    over widened weights ("dpbf16-fma", cpu_linear.dp_products), whichever this CPU's rate chose."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    for switch in SWITCH.values():
        monkeypatch.delenv(switch, raising=False)
    probed = list(cpu_isa.current().probed)
    if request.param == "amx" and not cpu_linear.amx_available():
        pytest.skip(f"AMX not runnable here (probed: {probed})")
    if request.param == "amx":
        yield "amx"
        return
    monkeypatch.setenv(SWITCH["amx"], "1")
    if not cpu_linear.dp_available():
        pytest.skip(f"AVX512-bf16 not runnable here (probed: {probed})")
    with cpu_linear.dp_products(request.param == "dpbf16-fma"):
        yield "dpbf16"


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product of bf16-rounded x and weight (float64), plus the fp32 bias."""
    b = bias.double() if bias is not None else None
    return F.linear(x.bfloat16().double(), w.bfloat16().double(), b)


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """Products of two bf16 are exact in fp32: only the fp32 sum's rounding and order differ, an error that
    grows with the sum's length and the terms' size (unit normal here), not with the result's."""
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6 * k, rtol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(40, 32), (200, 576), (33, 576)])
def test_kernel_matches_float64_on_bf16_inputs(kind: str, n: int, k: int) -> None:
    # n: one partial block, several with a partial last one, a last block of one column (none a multiple of 32)
    g = torch.Generator().manual_seed(n * k)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_linear.pack(w, dtype=torch.bfloat16)
    assert packed is not None and packed.kind == kind and not packed.glu
    assert packed.data.dtype == torch.bfloat16 and packed.data.numel() == -(-n // 32) * 32 * k  # padded block
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        _close(cpu_linear.linear(x, packed, bias), _reference(x, w, bias), k)
        _close(cpu_linear.linear(x, packed, None), _reference(x, w, None), k)
    assert cpu_linear.linear(torch.empty(0, k), packed, None).shape == (0, n)
    strided = torch.randn(3, 2, k + 10, generator=g)[..., 5 : 5 + k]  # leading dims and a column slice
    _close(cpu_linear.linear(strided, packed, None), _reference(strided, w, None), k)
    as_bf16 = torch.randn(7, k, generator=g).bfloat16()  # bf16 activations: widened, the result handed back in bf16
    out = cpu_linear.linear(as_bf16, packed, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(as_bf16, w, bias), atol=2e-6 * k, rtol=1 / 128)
    with pytest.raises(ValueError, match="features"):
        cpu_linear.linear(torch.randn(2, k + 1), packed, None)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def _dot_product_sums(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T as VDPBF16PS is defined (Intel's pseudo-code): x and W rounded to bf16, and per output, from zero,
    each k-pair's odd product added to the fp32 sum, then its even one (products of two bf16 are exact in fp32, so
    each step is one fp32 add), then the bias."""
    xb, wb = x.bfloat16().float(), w.bfloat16().float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for pair in range(x.shape[1] // 2):
        for kk in (2 * pair + 1, 2 * pair):
            acc = acc + xb[:, kk : kk + 1] * wb[:, kk][None, :]
    return acc + bias if bias is not None else acc


@pytest.mark.parametrize(("n", "k"), [(40, 64), (70, 96)])
def test_the_dot_product_kernel_runs_the_defined_sums(kind: str, n: int, k: int) -> None:
    """The dpbf16 kernel's floats are VDPBF16PS's defined sums exactly, on the FMAs at every row count (each tile
    height, partial blocks); on the instruction itself where it follows Intel's definition (Intel CPUs: AMD's may
    round its pairs otherwise, and is held to the float64 tolerance above). So the rate-driven choice between the
    two (CpuIsa.bf16_products_on_fma) moves no bit on Intel."""
    if kind != "dpbf16":
        pytest.skip("the AMX tiles' sums run in their own order")
    lib = cpu_linear.dp_library()
    assert lib is not None
    on_fma = bool(lib.bf16_dp_use_fma(0))
    lib.bf16_dp_use_fma(int(on_fma))
    if not on_fma and "GenuineIntel" not in _cpuinfo():
        pytest.skip("VDPBF16PS's own rounding outside Intel is not pinned down")
    g = torch.Generator().manual_seed(n + k)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_linear.pack(w, dtype=torch.bfloat16)
    assert packed is not None and packed.kind == "dpbf16"
    for rows in (1, 5, 12, 13, 25, 36):
        x = torch.randn(rows, k, generator=g)
        assert torch.equal(cpu_linear.linear(x, packed, bias), _dot_product_sums(x, w, bias)), rows
        assert torch.equal(cpu_linear.linear(x, packed, None), _dot_product_sums(x, w, None)), rows


def test_a_packed_weight_keeps_its_kernel_when_the_cap_moves(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both kernels live in the avx512 build only (the others hold a stub that refuses): a weight packed for one
    keeps running on it when the ``PAGEDQ_CPU_ISA`` cap later selects another build for new work."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 64, generator=g), torch.randn(5, 64, generator=g)
    packed = cpu_linear.pack(w, dtype=torch.bfloat16)
    assert packed is not None and packed.kind == kind
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx2")
    _close(cpu_linear.linear(x, packed, None), _reference(x, w, None), 64)


@pytest.mark.parametrize(("inter", "k"), [(40, 32), (24, 576)])
def test_kernel_gated_matches_silu_gate_times_up(kind: str, inter: int, k: int) -> None:
    g = torch.Generator().manual_seed(inter * k)
    gate_up = torch.randn(2 * inter, k, generator=g)
    packed = cpu_linear.pack_gated(gate_up, torch.bfloat16)
    assert packed is not None and packed.kind == kind and packed.glu and packed.out_features == inter
    assert packed.data.numel() == -(-inter // 16) * 32 * k  # 16 gate + 16 up columns per block
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        product = _reference(x, gate_up, None)
        want = F.silu(product[:, :inter]) * product[:, inter:]
        got = cpu_linear.linear(x, packed, None)
        assert got.dtype == torch.float32 and got.shape == (rows, inter)
        # |silu(g) * u| ~ k: the sums' error (~1e-6 k) scaled by the other factor, and exp16's few ulp
        torch.testing.assert_close(got.double(), want, atol=1e-5 * k, rtol=1e-5)
    with pytest.raises(ValueError, match="glu"):
        cpu_linear.linear(torch.randn(2, k), packed, torch.zeros(inter))


def test_next_kind_where_the_kernel_may_not_or_cannot_run(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(48, 64)
    assert cpu_linear.available_kinds(torch.bfloat16)[0] == kind
    packed = cpu_linear.pack(w, dtype=torch.bfloat16)
    assert packed is not None and packed.kind == kind
    odd_k = cpu_linear.pack(torch.randn(48, 48), dtype=torch.bfloat16)  # K not a multiple of a tile row's 32
    assert odd_k is not None and odd_k.kind == "onednn"
    assert cpu_linear.pack_gated(torch.randn(48, 48), torch.bfloat16) is None  # the caller keeps the unfused pair
    fp32 = cpu_linear.pack(w)
    assert fp32 is not None and fp32.kind not in cpu_linear.BF16_KINDS  # fp32 weights: the exact fp32 kernels
    if kind == "amx":  # the operator's cap keeps AMX off: the dot-product kernel, then oneDNN
        monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512_bf16")
        assert not cpu_linear.amx_available() and cpu_linear.available_kinds(torch.bfloat16) == ["dpbf16", "onednn"]
        capped = cpu_linear.pack(w, dtype=torch.bfloat16)
        assert capped is not None and capped.kind == "dpbf16"
    else:  # capped below AVX512-bf16: no bf16 product runs at all (emulated bf16 would be slower than fp32)
        monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512")
        assert not cpu_linear.dp_available() and cpu_linear.available_kinds(torch.bfloat16) == []
        assert cpu_linear.pack(w, dtype=torch.bfloat16) is None
        assert cpu_linear.pack_gated(torch.randn(96, 64), torch.bfloat16) is None
    monkeypatch.delenv(cpu_isa.ENV_CAP)
    for switch in SWITCH.values():  # the switches, for comparisons
        monkeypatch.setenv(switch, "1")
    assert cpu_linear.available_kinds(torch.bfloat16) == ["onednn"]
    assert cpu_linear.pack_gated(torch.randn(96, 64), torch.bfloat16) is None


def test_worker_reports_the_kernel_as_the_c_path(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker.kernels line names the kernel bf16 matmuls run on, and counts it as the fast (C) path."""
    bf16_cpu = Settings.model_validate({"dtype": "bfloat16", "device": "cpu"})
    fast, fields = kernel_path(bf16_cpu)
    assert fast and fields["matmul"] == f"{kind}-bf16" and fields["path"] == "c", fields  # the C kernels built here
    for switch in SWITCH.values():
        monkeypatch.setenv(switch, "1")
    assert kernel_path(bf16_cpu)[1]["matmul"] == "onednn-bf16"


def test_linear_layer_packs_for_the_kernel_under_bf16(kind: str) -> None:
    torch.manual_seed(3)
    layer = random_linear(96, 50, True)
    x = torch.randn(7, 96)
    want = _reference(x, layer.weight, layer.bias)
    assert layer.prepack(torch.bfloat16)
    assert layer.packed is not None and layer.packed.kind == kind
    assert layer.weight_bytes == 2 * 32 * 96 * 2 + 50 * 4  # two padded bf16 blocks and the fp32 bias
    _close(layer(x), want, 96)


def test_tiny_bf16_model_on_the_kernel_generates_as_on_onednn(
    kind: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every decoder linear, the fused gate_up and the lm_head of a bf16 model run on the kernel, and greedy
    tokens match the same model on oneDNN (same bf16 weights and rounded inputs; only the fp32 sums' order,
    the bias's rounding and the fused SiLU's exp differ, so a thin argmax gap may flip: the share is the
    measure)."""
    path = tiny_model("llama_gqa")
    own = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    model = own.engine.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, Linear) and m.packed is not None]
    mlps = [m for m in model.layers.modules() if isinstance(m, LlamaMLP)]
    assert len(linears) == 3 * len(mlps) and all(m.packed.kind == kind for m in linears)  # type: ignore[union-attr]
    assert all(m.gated is not None and m.gated.kind == kind for m in mlps)  # SiLU-and-mul fused
    assert model.lm_head_packed is not None and model.lm_head_packed.kind == kind
    for switch in SWITCH.values():
        monkeypatch.setenv(switch, "1")
    onednn = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    assert onednn.engine.runner.model.lm_head_packed.kind == "onednn"  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(0)
    prompts: list[list[int]] = [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    on_kernel = [o.outputs[0].token_ids for o in own.generate(prompts, params)]
    on_onednn = [o.outputs[0].token_ids for o in onednn.generate(prompts, params)]
    # tokens up to each sequence's first disagreement (after one, the contexts differ)
    same = 0
    for a, b in zip(on_kernel, on_onednn, strict=True):
        same += next((i for i, (s, t) in enumerate(zip(a, b, strict=True)) if s != t), len(a))
    share = same / (8 * len(prompts))
    print(f"{kind} vs oneDNN: {share:.3f} of greedy tokens agree before a sequence's first difference")
    assert share >= 0.85, share


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_epilogue_is_the_argmax_of_the_product(kind: str, threads: int) -> None:
    """The dpbf16 kernel's argmax epilogue (tests/epilogue_checks.py); the AMX kernel has none (None: the caller
    computes the logits)."""
    if kind != "dpbf16":
        packed = cpu_linear.pack(torch.randn(64, 64), dtype=torch.bfloat16)
        assert packed is not None and cpu_linear.argmax_linear(torch.randn(2, 64), packed) is None
        return
    check_argmax_epilogue(lambda w: cpu_linear.pack(w, dtype=torch.bfloat16), threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_add_norm_epilogue_is_the_projection_then_the_norm(kind: str, threads: int) -> None:
    """The dpbf16 kernel's residual add and RMSNorm after the product (tests/epilogue_checks.py); the AMX
    kernel has none (None: the model runs the projection, then the norm)."""
    if kind != "dpbf16":
        packed = cpu_linear.pack(torch.randn(64, 64), dtype=torch.bfloat16)
        assert packed is not None
        x, residual = torch.randn(2, 64), torch.randn(2, 64)
        assert cpu_linear.linear_add_norm(x, packed, None, residual, torch.ones(64), 1e-5) is None
        return
    check_add_norm_epilogue(lambda w: cpu_linear.pack(w, dtype=torch.bfloat16), threads)


def test_greedy_steps_skip_the_logits_and_sample_the_same_tokens(
    kind: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps whose rows are all plain greedy take the head's argmax without its logits (a GreedyChoice) where
    the kernel has the epilogue; tokens are those of the logits path, with drafts too. A request with logprobs
    in the batch sends its steps through the logits."""
    path = tiny_model("llama_gqa")
    g = torch.Generator().manual_seed(1)
    prompts: list[list[int]] = [torch.randint(3, 500, (12,), generator=g).tolist() * 2 for _ in range(12)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    params = [greedy] * 11 + [with_logprobs]
    choices: list[bool] = []
    original = Sampler.sample

    def counting(self: Sampler, logits: torch.Tensor | GreedyChoice, rows: list[SamplingRow]) -> SamplerOutput:
        choices.append(isinstance(logits, GreedyChoice))
        return original(self, logits, rows)

    monkeypatch.setattr(Sampler, "sample", counting)
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(LlamaForCausalLM, "compute_greedy", lambda self, hidden: None)
        llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128, num_speculative_tokens=3)
        choices.clear()
        runs[fused, "all"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        fused_steps = sum(choices)
        choices.clear()
        mixed = llm.generate(prompts, params)
        runs[fused, "mixed"] = [o.outputs[0].token_ids for o in mixed]
        assert mixed[-1].outputs[0].logprobs is not None
        assert not any(choices[:1])  # the first steps sample the logprobs request's rows too
        assert fused_steps > 0 if fused and kind == "dpbf16" else fused_steps == 0
    assert runs[True, "all"] == runs[False, "all"]
    assert runs[True, "mixed"] == runs[False, "mixed"]
