/* Run-time instruction-set probe: `isa_probe <feature>` executes instructions of that feature and exits 0.
 * It is run in a child process, so an instruction the CPU (or the hypervisor, or the kernel) refuses kills
 * only the child with SIGILL: flags in /proc/cpuinfo are not proof. Seen on a KVM guest that listed
 * amx_tile: llama.cpp built for AMX died on `tilezero`. Each probe sits in a function compiled for its own
 * target, so nothing else in this program assumes more than baseline x86-64. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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

/* The avx512_bf16 level also runs AVX512-VNNI (VPDPBUSD: the lm_head's int8 screen, cpu_bf16_dp.c), which every
 * CPU with AVX512-bf16 has (Cooper Lake, Sapphire Rapids and later, Zen 4 and later): both are run here. */
__attribute__((target("avx512bf16,avx512vnni,avx512f,avx512bw,avx512vl"), noinline)) static int probe_avx512_bf16(void)
{
    __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(sink + 1.f), _mm512_set1_ps(2.f));
    const __m512i b = _mm512_set1_epi8((char)(sink + 3.f));
    const __m512i d = _mm512_dpbusd_epi32(_mm512_set1_epi32((int)sink), b, b);
    sink = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_cvtepi32_ps(d), x, x));
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

/* `isa_probe bf16_rate`: how fast AVX512-bf16 dot products multiply against fp32 FMAs on this core, printed as
 * the ratio of their FLOP rates. Why: the instruction's presence says nothing of its speed. On AMD Zen 4 and 5 the
 * bench measured bf16 matmuls at about twice the fp32 peak (README runs 29-37); on an Intel Xeon (family 6 model
 * 207, AMX not exposed) this times 0.50: one VDPBF16PS issues a quarter as often as an FMA, so bf16 there only
 * halved the weight bytes, and pagedq ran 11-13 % slower in bf16 than in fp32 (README run 42). Twelve independent
 * chains per loop (enough to cover either instruction's latency on two pipes), distinct starting values so that
 * no two chains can be merged, the best of seven interleaved rounds of a few hundred microseconds each. */
#define RATE_CHAINS(VEC, SET1, ADD, OP)                                                                         \
    VEC a0 = SET1(0.f), a1 = SET1(1.f), a2 = SET1(2.f), a3 = SET1(3.f), a4 = SET1(4.f), a5 = SET1(5.f),           \
        a6 = SET1(6.f), a7 = SET1(7.f), a8 = SET1(8.f), a9 = SET1(9.f), a10 = SET1(10.f), a11 = SET1(11.f);       \
    for (long i = 0; i < n; i++) {                                                                             \
        OP(a0) OP(a1) OP(a2) OP(a3) OP(a4) OP(a5) OP(a6) OP(a7) OP(a8) OP(a9) OP(a10) OP(a11)                  \
        __asm__ volatile("" : "+v"(x)); /* x may change: the loop stays a loop */                              \
    }                                                                                                          \
    const VEC total = ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))),                   \
                          ADD(ADD(a8, a9), ADD(a10, a11)));

__attribute__((target("avx512f,fma"), noinline)) static void fma_chains(long n)
{
    __m512 x = _mm512_set1_ps(1e-7f);
#define FMA_STEP(acc) acc = _mm512_fmadd_ps(x, x, acc);
    RATE_CHAINS(__m512, _mm512_set1_ps, _mm512_add_ps, FMA_STEP)
#undef FMA_STEP
    sink = _mm512_reduce_add_ps(total);
}

__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"), noinline)) static void dp_chains(long n)
{
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3380); /* bf16 ~6e-8: the sums stay finite */
#define DP_STEP(acc) acc = _mm512_dpbf16_ps(acc, x, x);
    RATE_CHAINS(__m512, _mm512_set1_ps, _mm512_add_ps, DP_STEP)
#undef DP_STEP
    sink = _mm512_reduce_add_ps(total);
}

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int bf16_rate(void)
{
    const long n = 20000; /* 240k instructions a loop: ~0.1-0.3 ms */
    double fma = 1e9, dp = 1e9;
    fma_chains(n / 10); /* warm the 512-bit units up */
    for (int round = 0; round < 7; round++) {
        double t = seconds();
        fma_chains(n);
        const double f = seconds() - t;
        t = seconds();
        dp_chains(n);
        const double d = seconds() - t;
        fma = f < fma ? f : fma;
        dp = d < dp ? d : dp;
    }
    /* a dot product does 64 FLOP (32 products, 32 sums) where a 16-lane FMA does 32 */
    printf("%.3f\n", (64.0 / dp) / (32.0 / fma));
    return 0;
}

/* `isa_probe fma_rate_avx512` / `fma_rate_avx2`: the GFLOP/s of fp32 FMAs on registers alone, on one core (the
 * bench runs one probe per thread at once and sums them): the core's own peak, beside the matmul peak that the bench
 * measures over the model's shapes. Why: on a shared VM host the matmul peak moved 204 -> 284 GFLOP/s within the
 * hour while this loop ran 334-344 on both cores every time (Intel Xeon family 6 model 207, README run 45): what
 * moves is the caches and memory the host shares, not the cores, and the report can say which. Rounds of ~20 ms,
 * long enough for the probes of all threads to overlap; the best of seven. */
__attribute__((target("avx2,fma"), noinline)) static void fma_chains256(long n)
{
    __m256 x = _mm256_set1_ps(1e-7f);
#define FMA256_STEP(acc) acc = _mm256_fmadd_ps(x, x, acc);
    RATE_CHAINS(__m256, _mm256_set1_ps, _mm256_add_ps, FMA256_STEP)
#undef FMA256_STEP
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    sink = lanes[0] + lanes[7];
}

static int fma_rate(int wide)
{
    const long n = 400000; /* 4.8M FMA instructions a round: ~10-20 ms */
    double best = 1e9;
    if (wide) fma_chains(n / 10); else fma_chains256(n / 10); /* warm the vector units up */
    for (int round = 0; round < 7; round++) {
        const double t = seconds();
        if (wide) fma_chains(n); else fma_chains256(n);
        const double dt = seconds() - t;
        best = dt < best ? dt : best;
    }
    printf("%.2f\n", 12.0 * (double)n * (wide ? 16 : 8) * 2 / best / 1e9);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) return 64;
    if (!strcmp(argv[1], "bf16_rate")) return probe_avx512_bf16() || bf16_rate();
    if (!strcmp(argv[1], "fma_rate_avx512")) return probe_avx512() || fma_rate(1);
    if (!strcmp(argv[1], "fma_rate_avx2")) return probe_avx2() || fma_rate(0);
    if (!strcmp(argv[1], "avx2")) return probe_avx2();
    if (!strcmp(argv[1], "avx512")) return probe_avx512();
    if (!strcmp(argv[1], "avx512_bf16")) return probe_avx512_bf16();
    if (!strcmp(argv[1], "amx")) return probe_amx();
    return 64;
}
