"""Run-time instruction-set dispatch (pagedq_kernels/cpu_isa.py, pagedq_kernels/c_build.py): what the probe finds, the
``PAGEDQ_CPU_ISA`` cap, and that each kernel variant is a build of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedq_kernels import c_build, cpu_isa, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_isa.is_x86_64(), reason="instruction-set variants are x86-64's")

CPUINFO_FLAG = {"avx2": "avx2", "avx512": "avx512f", "avx512_bf16": "avx512_bf16", "amx": "amx_tile"}


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_the_probe_finds_an_ordered_chain_of_levels_the_cpu_claims() -> None:
    probed = cpu_isa.probe()
    assert probed == cpu_isa.LEVELS[1 : 1 + len(probed)]  # a prefix of the chain, in order
    flags = _cpuinfo_flags()
    for level in probed:  # running is stricter than the flags: the probe never finds more than they claim
        assert CPUINFO_FLAG[level] in flags, level
    if "avx2" in flags and "fma" in flags:
        assert "avx2" in probed  # every AVX2 CPU of the last decade runs it; a failure here is the probe's


def test_the_probe_program_runs_each_level_it_reports_and_refuses_unknown_names() -> None:
    exe = c_build.build_executable("isa_probe")
    assert exe is not None
    for level in cpu_isa.probe():
        assert subprocess.run([str(exe), level], timeout=10).returncode == 0
    assert subprocess.run([str(exe), "sse9"], timeout=10).returncode == 64


@pytest.mark.parametrize("cap", cpu_isa.LEVELS)
def test_the_cap_limits_levels_and_the_kernel_variant(cap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_isa.ENV_CAP, cap.upper())  # case-insensitive, as an operator may type it
    isa = cpu_isa.current()
    assert isa.cap == cap
    assert all(cpu_isa.LEVELS.index(level) <= cpu_isa.LEVELS.index(cap) for level in isa.levels)
    assert set(isa.levels) <= set(cpu_isa.probe())
    expected = "avx512" if "avx512" in isa.levels else "avx2" if "avx2" in isa.levels else "generic"
    assert isa.kernel_variant == expected == c_build.variant()
    assert isa.bf16_matmul == ("avx512_bf16" in isa.levels)
    assert isa.describe()["kernel_variant"] == expected


def test_bf16_dot_products_are_timed_against_fp32_fmas() -> None:
    """Where AVX512-bf16 runs, the probe times its dot products against fp32 FMAs (a ratio of FLOP rates, near 2
    on AMD Zen 4/5, 0.5 on an Intel Xeon without AMX); elsewhere there is no rate, and the probe refuses the
    timing on a CPU that cannot run the instruction rather than dying of it."""
    rate = cpu_isa.bf16_dot_rate()
    if "avx512_bf16" not in cpu_isa.probe():
        assert rate is None
        exe = c_build.build_executable("isa_probe")
        if exe is not None and "avx512" in cpu_isa.probe():  # runs AVX-512 but not bf16: refused in the child
            assert subprocess.run([str(exe), "bf16_rate"], capture_output=True, timeout=10).returncode != 0
        pytest.skip("AVX512-bf16 does not run here")
    assert rate is not None and 0.1 < rate < 8
    assert cpu_isa.current().describe()["bf16_dot_rate"] == rate
    isa = cpu_isa.current()
    amx = "amx" in isa.levels
    assert isa.bf16_products_on_fma == (isa.bf16_matmul and not amx and rate < cpu_isa.BF16_RATE_FLOOR)


@pytest.mark.parametrize("cap", ["avx2", "avx512"])
def test_the_cores_fma_rate_is_timed_at_the_widest_level_in_use(cap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fma_gflops``: one probe child per thread at once, each timing register-only FMAs at the widest level the
    cap allows, summed (the bench's "the cores' fp32 FMAs alone"); a level the CPU does not run is refused in the
    child, not run into a SIGILL, and nothing to time gives None."""
    if cap not in cpu_isa.probe():
        exe = c_build.build_executable("isa_probe")
        assert exe is not None
        assert subprocess.run([str(exe), f"fma_rate_{cap}"], capture_output=True, timeout=10).returncode != 0
        pytest.skip(f"{cap} does not run here")
    monkeypatch.setenv(cpu_isa.ENV_CAP, cap)
    ran: list[list[str]] = []
    popen = subprocess.Popen

    def spy(args: list[str], *rest: object, **kwargs: object) -> subprocess.Popen[str]:
        ran.append(list(args))
        return popen(args, *rest, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "Popen", spy)
    one, two = cpu_isa.fma_gflops(1), cpu_isa.fma_gflops(2)
    assert one is not None and one > 0 and two is not None and two > 0
    assert [args[1:] for args in ran] == [[f"fma_rate_{cap}"]] * 3  # one child, then two at once
    assert cpu_isa.fma_gflops(0) is None


def test_an_unknown_cap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx1024")
    with pytest.raises(ValueError, match="PAGEDQ_CPU_ISA='avx1024' is not one of generic, avx2"):
        cpu_isa.current()


def test_each_variant_is_its_own_build(isa_variant: str) -> None:
    """The variant loaded is the one the cap asks for, compiled for it (not -march=native): a generic build
    has no AVX instruction in its code, so a kernel cache shared with an older CPU stays runnable."""
    lib = cpu_ops._load()
    assert lib is not None, c_build.error("cpu_ops")
    key = ("cpu_ops", isa_variant)
    assert c_build._loaded[key] is lib
    path = Path(lib._name)
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True).stdout
    if not text:
        pytest.skip("objdump is not installed")
    uses_zmm, uses_ymm = "%zmm" in text, "%ymm" in text
    if isa_variant == "generic":
        assert not uses_ymm and not uses_zmm
    elif isa_variant == "avx2":
        assert uses_ymm and not uses_zmm
    else:
        assert uses_zmm


def test_onednn_is_capped_where_listed_amx_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest that lists AMX but faults on it: oneDNN (which trusts cpuid) is held to the last level that ran."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    listed = "amx_tile" in Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    cpu_isa._cap_onednn(("avx2", "avx512", "avx512_bf16", "amx"))  # AMX ran: nothing to cap
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") is None
    cpu_isa._cap_onednn(("avx2", "avx512", "avx512_bf16"))
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == ("AVX512_CORE_BF16" if listed else None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the operator's own cap wins
    cpu_isa._cap_onednn(("avx2", "avx512"))
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_the_cpu_model_is_read_as_lscpu_reads_it() -> None:
    """Vendor, family and model (tuning choices measured per core design key on them, e.g. the panel kernel's tile
    rule, cpu_linear.triple_tile_max_rows) match what ``lscpu`` prints for this machine."""
    model = cpu_isa.cpu_model()
    assert model is not None
    if shutil.which("lscpu") is None:
        pytest.skip("lscpu is not installed")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lscpu.splitlines())}
    if "CPU family" not in fields:
        pytest.skip("lscpu names no family here")
    expected = (fields["Vendor ID"], int(fields["CPU family"]), int(fields["Model"]))
    assert (model.vendor, model.family, model.model) == expected


# What an ARM server (AWS Graviton 2 / 3: Neoverse N1 / V1, the second with SVE) builds: the one `native` variant.
# The attention, fused ops and int8 kernels have portable paths and must compile there; the fp32 panel kernel
# refuses (its packed weights then go to oneDNN, cpu_linear.py); the bf16, AMX and probe sources never load there.
ARM_KERNELS = {"cpu_attention": True, "cpu_ops": True, "cpu_int8_gemm": True, "cpu_gemm": False}
EM_AARCH64 = 183  # the ELF header's e_machine for AArch64


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64 cross compiler")
@pytest.mark.parametrize("cpu", ["neoverse-n1", "neoverse-v1"])
@pytest.mark.parametrize("name", sorted(ARM_KERNELS))
def test_the_kernels_arm_loads_compile_for_arm(name: str, cpu: str, tmp_path: Path) -> None:
    """Cross-compiled as c_build compiles the native variant (``-mcpu=`` the core instead of ``native``), so an x86
    intrinsic outside its ISA's #ifdef fails here rather than on a user's ARM server (where the kernel would
    silently fall back to torch). Compiling only: nothing here runs ARM code."""
    flags = c_build.kernel_flags([f"-mcpu={cpu}"])
    command = c_build.compile_command("aarch64-linux-gnu-gcc", name, flags, tmp_path / f"{name}.so")
    result = subprocess.run(command, capture_output=True, text=True)
    if ARM_KERNELS[name]:
        assert result.returncode == 0, result.stderr
        header = (tmp_path / f"{name}.so").read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64
    else:
        assert result.returncode != 0 and "needs AVX2/FMA" in result.stderr
