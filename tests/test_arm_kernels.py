"""The attention kernel as an ARM server builds and runs it (c_build's ``native`` variant: the portable decode task,
and prefill a row at a time through it), cross-compiled for AArch64 and executed under qemu's user-mode emulation,
its results checked against torch on this host: the same reference, tolerances and bit-for-bit properties the x86
builds are held to in tests/test_cpu_attention.py. Needs Debian's ``gcc-aarch64-linux-gnu`` and
``qemu-user-static`` (``.ci/run`` installs both); skipped without them."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from pagedq_kernels import c_build
from pagedq_kernels.paged_attention import paged_attention_torch
from tests.test_cpu_attention import make_batch, reference_args

CROSS_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")  # the cross toolchain's loader and libgomp, for qemu's -L
HARNESS = Path(__file__).parent / "arm_attention_harness.c"
BLOCK = 16

pytestmark = pytest.mark.skipif(
    CROSS_CC is None or QEMU is None, reason="no aarch64 cross compiler or qemu user-mode emulator"
)


@pytest.fixture(scope="module", params=["neoverse-n1", "neoverse-v1"])
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The harness linked with cpu_attention.c, built with the flags c_build gives the native variant (the core
    named instead of ``native``): Graviton 2's NEON, Graviton 3's SVE."""
    assert CROSS_CC is not None
    out = tmp_path_factory.mktemp("arm") / f"harness-{request.param}"
    flags = [f for f in c_build.kernel_flags([f"-mcpu={request.param}"]) if f not in ("-shared", "-fPIC")]
    command = c_build.compile_command(CROSS_CC, "cpu_attention", [*flags, str(HARNESS)], out)
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


def run_arm(
    harness: Path,
    tmp_path: Path,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    q_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One kernel call under qemu: decode (``starts`` = each sequence's row) or, with ``q_lens``, prefill."""
    n, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    bf16 = k_cache.dtype == torch.bfloat16
    (scale_bits,) = struct.unpack("<i", struct.pack("<f", scale))
    header = [int(q_lens is not None), n, heads, kv_heads, head_dim, num_blocks, block_size, len(seq_lens)]
    header += [tables.shape[1], int(bf16), 2, scale_bits]
    parts = [struct.pack("<12q", *header), q.contiguous().numpy().tobytes()]
    for cache in (k_cache, v_cache):
        parts.append((cache.view(torch.int16) if bf16 else cache).contiguous().numpy().tobytes())
    parts.append(starts.to(torch.int64).numpy().tobytes())
    if q_lens is not None:
        parts.append(q_lens.to(torch.int32).numpy().tobytes())
    parts += [seq_lens.to(torch.int32).numpy().tobytes(), tables.to(torch.int32).contiguous().numpy().tobytes()]
    (tmp_path / "in.bin").write_bytes(b"".join(parts))
    command = [str(QEMU), "-L", str(SYSROOT), str(harness), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32)
    return out.view(n, heads, head_dim)


def batch(
    seq_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tests/test_cpu_attention.py's random step (scattered blocks), its caches in ``kv_dtype``, and torch's attention
    over it (the caches widened): metadata, q, k_cache, v_cache, reference."""
    meta, q, _, _, k_cache, v_cache = make_batch(seq_lens, q_lens, heads, kv_heads, head_dim, BLOCK)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    reference = paged_attention_torch(q, k_cache.float(), v_cache.float(), *reference_args(meta, head_dim**-0.5))
    return meta, q, k_cache, v_cache, reference


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 20)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_arm_attention_matches_torch_and_a_cached_prefix_changes_no_row(
    harness: Path, tmp_path: Path, heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> None:
    """Prefill of a whole 70-token prompt and of its tails of 1, 5 and 16 rows (what a prefix-cache hit leaves): the
    rows bit for bit the same, each equal to decoding that row alone, all near torch's attention; then a decode
    step of five sequences and a prefill step of three chunks after cached positions, against torch."""
    torch.manual_seed(head_dim)
    scale = head_dim**-0.5
    total = 70
    meta, q, k_cache, v_cache, ref = batch([total], [total], heads, kv_heads, head_dim, kv_dtype)
    tables, lens = meta.block_tables, meta.seq_lens

    def prefill(start: int) -> torch.Tensor:
        rows = q[start:]
        q_lens = torch.tensor([total - start], dtype=torch.int32)
        return run_arm(harness, tmp_path, rows, k_cache, v_cache, torch.zeros(1), lens, tables, scale, q_lens)

    whole = prefill(0)
    torch.testing.assert_close(whole, ref)
    for tail in (1, 5, 16):
        assert torch.equal(prefill(total - tail), whole[total - tail :]), tail
    for pos in (0, 41, total - 1):
        upto = torch.tensor([pos + 1], dtype=torch.int32)
        one = run_arm(harness, tmp_path, q[pos : pos + 1], k_cache, v_cache, torch.zeros(1), upto, tables, scale)
        assert torch.equal(one[0], whole[pos]), pos

    decode_lens = [1, 17, 33, 64, 90]
    meta, q, k_cache, v_cache, ref = batch(decode_lens, [1] * 5, heads, kv_heads, head_dim, kv_dtype)
    out = run_arm(harness, tmp_path, q, k_cache, v_cache, torch.arange(5), meta.seq_lens, meta.block_tables, scale)
    torch.testing.assert_close(out, ref)

    chunks = [40, 23, 6]
    meta, q, k_cache, v_cache, ref = batch([40, 75, 19], chunks, heads, kv_heads, head_dim, kv_dtype)
    starts, q_lens = meta.query_start_loc[:-1], torch.tensor(chunks)
    out = run_arm(harness, tmp_path, q, k_cache, v_cache, starts, meta.seq_lens, meta.block_tables, scale, q_lens)
    torch.testing.assert_close(out, ref)
