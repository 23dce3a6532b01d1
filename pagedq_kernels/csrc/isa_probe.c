/* Run-time instruction-set probe: `isa_probe <feature>` executes instructions of that feature and exits 0.
 * It is run in a child process, so an instruction the CPU (or the hypervisor, or the kernel) refuses kills
 * only the child with SIGILL: flags in /proc/cpuinfo are not proof. Seen on a KVM guest that listed
 * amx_tile: llama.cpp built for AMX died on `tilezero`. Each probe sits in a function compiled for its own
 * target, so nothing else in this program assumes more than baseline x86-64. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "amx_tile.h" /* the tile-data permission and config the kernels use (this build: nothing else of it) */

static volatile float sink;

__attribute__((target("avx2,fma"), noinline)) static int probe_avx2(void)
{
    __m256 a = _mm256_set1_ps(sink + 1.f), b = _mm256_set1_ps(2.f);
    __m256i i = _mm256_add_epi32(_mm256_set1_epi32((int)sink), _mm256_set1_epi32(3));
    a = _mm256_fmadd_ps(a, b, _mm256_cvtepi32_ps(i));
    sink = _mm256_cvtss_f32(a);
    return 0;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"), noinline)) static int probe_avx512(void)
{
    __m512 a = _mm512_set1_ps(sink + 1.f), b = _mm512_set1_ps(2.f);
    __m512i i = _mm512_add_epi16(_mm512_set1_epi16((short)sink), _mm512_set1_epi16(3));
    a = _mm512_fmadd_ps(a, b, _mm512_cvtepi32_ps(i));
    sink = _mm512_reduce_add_ps(a);
    return 0;
}

__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"), noinline)) static int probe_avx512_bf16(void)
{
    __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(sink + 1.f), _mm512_set1_ps(2.f));
    sink = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x, x));
    return 0;
}

__attribute__((target("amx-tile,amx-bf16"), noinline)) static int probe_amx(void)
{
    if (amx_request_permission() != 0)
        return 2; /* the kernel refuses tile data: AMX unusable in this process */
    struct tile_config cfg;
    tile_config_fill(&cfg, 3);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_dpbf16ps(0, 1, 2);
    float out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
    sink = out[0];
    return out[0] == 0.f ? 0 : 3;
}

int main(int argc, char **argv)
{
    if (argc != 2) return 64;
    if (!strcmp(argv[1], "avx2")) return probe_avx2();
    if (!strcmp(argv[1], "avx512")) return probe_avx512();
    if (!strcmp(argv[1], "avx512_bf16")) return probe_avx512_bf16();
    if (!strcmp(argv[1], "amx")) return probe_amx();
    return 64;
}
