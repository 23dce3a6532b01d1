"""The attention kernel as an ARM server builds and runs it (c_build's ``native`` variant: the portable decode task,
and prefill a row at a time through it), cross-compiled for AArch64 and executed under qemu's user-mode emulation,
its results checked against torch on this host: the same reference, tolerances and bit-for-bit properties the x86
builds are held to in tests/test_cpu_attention.py. Needs Debian's ``gcc-aarch64-linux-gnu`` and
``qemu-user-static`` (``.ci/run`` installs both); skipped without them."""

from __future__ import annotations

import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from pagedq_kernels import c_build
from pagedq_kernels.paged_attention import paged_attention_torch

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


def paged_caches(
    seq_lens: list[int], kv_heads: int, head_dim: int, kv_dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches holding every position of each sequence, blocks scattered over the pool, and the tables."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    counts = [-(-n // BLOCK) for n in seq_lens]
    free = list(range(sum(counts) + 3))
    rng.shuffle(free)
    width = max(counts)
    tables = torch.tensor([[free.pop() for _ in range(c)] + [0] * (width - c) for c in counts], dtype=torch.int32)
    shape = (sum(counts) + 3, BLOCK, kv_heads, head_dim)
    return torch.randn(shape).to(kv_dtype), torch.randn(shape).to(kv_dtype), tables


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_lens: list[int],
    seq_lens: list[int],
    tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (starts, lens, tables, scale, max(q_lens), max(seq_lens))
    return paged_attention_torch(q, k_cache.float(), v_cache.float(), *args)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 20)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_arm_attention_matches_torch_and_a_cached_prefix_changes_no_row(
    harness: Path, tmp_path: Path, heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> None:
    """Prefill of a whole 70-token prompt and of its tails of 1, 5 and 16 rows (what a prefix-cache hit leaves): the
    rows bit for bit the same, each equal to decoding that row alone, all near torch's attention; then a decode
    step of five sequences and a prefill step of three chunks after cached positions, against torch."""
    scale = head_dim**-0.5
    total = 70
    k_cache, v_cache, tables = paged_caches([total], kv_heads, head_dim, kv_dtype, seed=head_dim)
    q = torch.randn(total, heads, head_dim)
    lens = torch.tensor([total], dtype=torch.int32)

    def prefill(start: int) -> torch.Tensor:
        rows = q[start:]
        q_lens = torch.tensor([total - start], dtype=torch.int32)
        return run_arm(harness, tmp_path, rows, k_cache, v_cache, torch.zeros(1), lens, tables, scale, q_lens)

    whole = prefill(0)
    torch.testing.assert_close(whole, reference(q, k_cache, v_cache, [total], [total], tables, scale))
    for tail in (1, 5, 16):
        assert torch.equal(prefill(total - tail), whole[total - tail :]), tail
    for pos in (0, 41, total - 1):
        upto = torch.tensor([pos + 1], dtype=torch.int32)
        one = run_arm(harness, tmp_path, q[pos : pos + 1], k_cache, v_cache, torch.zeros(1), upto, tables, scale)
        assert torch.equal(one[0], whole[pos]), pos

    decode_lens = [1, 17, 33, 64, 90]
    k_cache, v_cache, tables = paged_caches(decode_lens, kv_heads, head_dim, kv_dtype, seed=head_dim + 1)
    q = torch.randn(len(decode_lens), heads, head_dim)
    out = run_arm(
        harness, tmp_path, q, k_cache, v_cache, torch.arange(len(decode_lens)), torch.tensor(decode_lens), tables, scale
    )
    ones = [1] * len(decode_lens)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, ones, decode_lens, tables, scale))

    prefill_lens, chunks = [40, 75, 19], [40, 23, 6]
    k_cache, v_cache, tables = paged_caches(prefill_lens, kv_heads, head_dim, kv_dtype, seed=head_dim + 2)
    q = torch.randn(sum(chunks), heads, head_dim)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(chunks), 0).tolist()[:-1]])
    lens = torch.tensor(prefill_lens)
    out = run_arm(harness, tmp_path, q, k_cache, v_cache, starts, lens, tables, scale, torch.tensor(chunks))
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, chunks, prefill_lens, tables, scale))
