"""The fp32 lm_head's argmax screened in int8 or bf16 (pagedq_kernels/argmax_screen.py, csrc/cpu_bf16_dp.c
gemm_int8_screen_argmax and gemm_bf16_dp_screen_argmax): bit for bit the fp32 panel kernel's argmax, where columns
are near-tied in ways the screen cannot tell apart, where the screen cannot narrow a row (too many ties, inputs too
large for its bound), for NaN, and for hidden states with a few massive channels (the int8 screen keeps the step's
largest in fp32); a tiny fp32 model generates the same tokens with it as without. Runs where AVX512-bf16 (and so
VNNI) does."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM
from pagedq_kernels import argmax_screen, cpu_isa, cpu_linear
from schemas.sampling import SamplingParams
from tests.epilogue_checks import check_argmax_epilogue


@pytest.fixture(autouse=True, params=["int8", "bf16-dot-products", "bf16-fma"])
def screen_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[argmax_screen.Kind]:
    """The suite caps the ISA below bf16 (tests/conftest.py): lifted here, as tests/test_bf16_linear.py does.
    Every test runs with the int8 screen, and with the bf16 one with its products on VDPBF16PS and on fp32 FMAs
    (cpu_linear.dp_products), whichever this CPU's rate chose; the model's screen takes the kind from the
    environment, as a user's does."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    for switch in ("PAGEDQ_DISABLE_DP_LINEAR", "PAGEDQ_DISABLE_SCREENED_ARGMAX"):
        monkeypatch.delenv(switch, raising=False)
    if cpu_linear.dp_library() is None:
        pytest.skip(f"AVX512-bf16 not runnable here (probed: {list(cpu_isa.current().probed)})")
    kind: argmax_screen.Kind = "int8" if request.param == "int8" else "bf16"
    monkeypatch.setenv(argmax_screen.KIND_ENV, kind)
    with cpu_linear.dp_products(request.param == "bf16-fma"):
        yield kind


def _screened(w: torch.Tensor) -> argmax_screen.ScreenedHead:
    head = argmax_screen.build(w, cpu_linear.pack(w, "panels"))
    assert head is not None
    assert head.kind == os.environ[argmax_screen.KIND_ENV]
    return head


def _same_as_panels(x: torch.Tensor, head: argmax_screen.ScreenedHead) -> None:
    values, indices = argmax_screen.argmax(x, head)
    want = cpu_linear.argmax_linear(x, head.exact)
    assert want is not None
    assert torch.equal(indices, want[1]), (indices, want[1])
    torch.testing.assert_close(values, want[0], rtol=0, atol=0, equal_nan=True)


class _Screened:
    """The screen as the argmax of the shared epilogue checks: packs keep their screened heads, and a packed
    weight without one (a non-finite weight, which build refuses) goes to the panels, as the model's does."""

    def __init__(self) -> None:
        self.heads: dict[int, argmax_screen.ScreenedHead] = {}

    def pack(self, w: torch.Tensor) -> cpu_linear.PackedWeight | None:
        packed = cpu_linear.pack(w, "panels")
        head = argmax_screen.build(w, packed)
        if head is not None and packed is not None:
            self.heads[id(packed)] = head
        return packed

    def argmax(self, x: torch.Tensor, packed: cpu_linear.PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
        head = self.heads.get(id(packed))
        return cpu_linear.argmax_linear(x, packed) if head is None else argmax_screen.argmax(x, head)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_shared_argmax_checks_hold_for_the_screen(threads: int) -> None:
    """tests/epilogue_checks.py (ties across threads and inside a block, all-zero rows, NaN rows, a partial last
    block, no rows) with the screen answering; its NaN-weight case has no screen (build refuses a non-finite
    weight) and goes to the panels, as the model does."""
    screened = _Screened()
    check_argmax_epilogue(screened.pack, threads, screened.argmax)
    assert len(screened.heads) == 1  # the NaN weight got none
    nan = torch.randn(64, 64)
    nan[3, 5] = float("inf")
    assert argmax_screen.build(nan, cpu_linear.pack(nan, "panels")) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_near_ties_bf16_cannot_tell_apart_are_settled_in_fp32(threads: int) -> None:
    """Rows of the weight a hair apart (2^-12 relative: they round to the same bf16), so bf16 logits tie or
    invert the fp32 order: the screen keeps them all and fp32 decides, as the panel kernel does. Columns
    straddle blocks (1000 wide, the last block partial) and the threads' ranges."""
    g = torch.Generator().manual_seed(3)
    n, k = 1000, 96
    w = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(40, k, generator=g)
    for row in range(x.shape[0]):  # per row of x, its best column and near copies of it spread over the vocab
        best = int((x[row] @ w.T).argmax())
        for copy in (best + 1, (best + 331) % n, (best + 733) % n, n - 1):
            w[copy] = w[best] * (1 + 2**-12 * torch.randn(k, generator=g))
    head = _screened(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = argmax_screen.counts.columns
        for rows in (1, 7, 13, 40):
            _same_as_panels(x[:rows], head)
        assert argmax_screen.counts.columns - start > 61 * 2  # more than one column settled for most rows
    finally:
        torch.set_num_threads(before)


def test_rows_the_screen_cannot_narrow_are_settled_over_every_column() -> None:
    """More tied columns than a thread keeps per row (the bf16 screen's SCREEN_CAP = 128, the int8 screen's 512),
    and inputs so large that a sum could overflow (the bound no longer holds; infinities and NaN appear): those rows
    go over every column in fp32, with the panels' answer (first tie, first NaN), and the other rows of the same
    call are screened."""
    g = torch.Generator().manual_seed(5)
    n, k = 2048, 64
    w = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(6, k, generator=g)
    w[100:1800] = w[50]  # 1701 identical columns, over 512 in each thread's half
    x[0] = w[50] * 10  # row 0: its best column is 50, tied with 1700 others
    x[1] = 3e37  # row 1: |x| |w| beyond the bound's reach: products overflow to infinity
    x[2, 0] = float("inf")  # row 2: infinity in, NaN out where weights of both signs meet it
    head = _screened(w)
    start = argmax_screen.counts.full_rows
    _same_as_panels(x, head)
    assert argmax_screen.counts.full_rows - start == 3
    assert int(argmax_screen.argmax(x[:1], head)[1][0]) == 50


def test_a_tiny_fp32_model_generates_the_same_tokens_with_the_screen(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's greedy path (``compute_greedy``) takes the screen for an fp32 lm_head on the panels, and the
    tokens are those of the same model without it."""
    path = tiny_model("llama_gqa")
    g = torch.Generator().manual_seed(0)
    prompts: list[list[int]] = [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    screened = LLM(str(path), dtype="float32", num_kv_blocks=64)
    model = screened.engine.runner.model
    assert model.lm_head_packed is not None and model.lm_head_packed.kind == "panels"
    assert model.lm_head_screen is not None
    start = argmax_screen.counts.rows
    with_screen = [o.outputs[0].token_ids for o in screened.generate(prompts, params)]
    assert argmax_screen.counts.rows - start >= 16 * 8
    monkeypatch.setenv("PAGEDQ_DISABLE_SCREENED_ARGMAX", "1")
    plain = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert plain.engine.runner.model.lm_head_screen is None
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == with_screen


def test_a_built_screen_keeps_running_after_the_isa_cap_moves_below_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The screen holds the AVX512-bf16 build it was made with, as dpbf16 weights do: a live engine whose
    ``PAGEDQ_CPU_ISA`` cap drops to avx2 keeps answering (the panels' own answer, from their avx2 build)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(700, 64, generator=g)
    head = _screened(w)
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx2")
    assert cpu_linear.dp_library() is None
    _same_as_panels(torch.randn(9, 64, generator=g), head)


@pytest.mark.parametrize("threads", [1, 2])
def test_hidden_states_with_massive_channels_are_screened_narrowly(threads: int) -> None:
    """A final hidden state's few channels ~20x its rms (what SmolLM2's are): the int8 screen keeps the step's
    largest channels in fp32, so its bound stays narrow (few columns settled per row, none left to every column)
    and the answer is still the panels'. The bf16 screen narrows them too."""
    g = torch.Generator().manual_seed(11)
    n, k = 4000, 256
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(36, k, generator=g)
    massive = torch.tensor([3, 77, 150, 201])
    x[:, massive] *= 20
    x[5, 9] = 60  # one row's own outlier, outside the step's common ones
    head = _screened(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        columns, full_rows = argmax_screen.counts.columns, argmax_screen.counts.full_rows
        _same_as_panels(x, head)
        assert argmax_screen.counts.full_rows == full_rows
        assert argmax_screen.counts.columns - columns < 36 * 20
    finally:
        torch.set_num_threads(before)


def test_the_int8_screen_refuses_shapes_it_cannot_pack_and_unknown_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 needs in_features from 32 to 1024 (its sums exact in fp32): past it the default is the bf16 screen and
    an explicit int8 is None; within it the default is int8 where this CPU's bf16 products run on its FMAs or it
    is an AMD Zen 4; a misspelt kind is an error that names both."""
    g = torch.Generator().manual_seed(13)
    wide = torch.randn(64, 1056, generator=g)
    assert argmax_screen.build(wide, cpu_linear.pack(wide, "panels"), "int8") is None
    monkeypatch.delenv(argmax_screen.KIND_ENV)
    head = argmax_screen.build(wide, cpu_linear.pack(wide, "panels"))
    assert head is not None and head.kind == "bf16"
    narrow = wide[:, :1024].contiguous()
    head = argmax_screen.build(narrow, cpu_linear.pack(narrow, "panels"))
    model = cpu_isa.cpu_model()
    zen4 = model is not None and (model.vendor, model.family) == ("AuthenticAMD", argmax_screen.ZEN4_FAMILY)
    assert head is not None and head.kind == ("int8" if cpu_isa.current().bf16_products_on_fma or zen4 else "bf16")
    monkeypatch.setenv(argmax_screen.KIND_ENV, "fp8")
    with pytest.raises(ValueError, match="int8 and bf16"):
        argmax_screen.build(wide, cpu_linear.pack(wide, "panels"))


@pytest.mark.parametrize(("vendor", "family"), [("AuthenticAMD", 25), ("AuthenticAMD", 26), ("GenuineIntel", 6)])
def test_the_default_screen_follows_the_core_it_was_measured_on(
    vendor: str, family: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 by default on AMD Zen 4 (family 25) and wherever the bf16 products run on the FMAs, else bf16 (a tie on
    Zen 5); past the int8 kernel's 1024 inputs bf16 on every core (argmax_screen._default_kind)."""
    monkeypatch.setattr(cpu_isa, "cpu_model", lambda: cpu_isa.CpuModel(vendor, family, 17))
    on_fma = cpu_isa.current().bf16_products_on_fma
    expected = "int8" if on_fma or (vendor, family) == ("AuthenticAMD", 25) else "bf16"
    assert argmax_screen._default_kind(576) == expected
    assert argmax_screen._default_kind(2048) == "bf16"
