/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a group-wise int8 weight, dequantised inside the tile.
 *
 * Why: a decode step streams every weight once, so int8 weights read a quarter of fp32's bytes. The
 * weight is w[n, k] = scale[n, g] * q[n, k] + offset[n, g] for g = k / group: one layout that holds
 * symmetric per-output-channel int8 (group = K, no offset) and GGUF's Q8_0 / Q4_0 / Q4_1 blocks
 * (group = 32) exactly (pagedq_kernels/int8_linear.py). Activations stay fp32 and the products accumulate in
 * fp32 (weight-only, W8A32).
 *
 * Layout (packed in Python): ceil(N / 16) panels, each int8 [K][16] (columns past N are zero), its scales
 * and offsets fp32 [K / group][16]. Per panel and block of MB rows of x, each thread dequantises the
 * panel once into a private fp32 [K][16] buffer (L1/L2-resident) and runs gemm_tile.h's register tile
 * over it: the tile is the one the fp32 panel kernel uses, and the dequantisation is paid once per MB
 * rows, not per tile. With glu the panel holds 8 gate and 8 up columns (cpu_gemm.c's glu layout) and the
 * tile's epilogue emits silu(gate) * up.
 *
 * Three builds (pagedq_kernels/c_build.py): AVX-512 (16 int8 widened per instruction), AVX2 (two halves of 8)
 * and a generic one (plain C the compiler vectorises for SSE2) so every x86-64 runs the int8 layout.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "gemm_tile.h"

#ifndef MB
#define MB 384 /* rows of x per block, as cpu_gemm.c: the dequantised panel is reused across them */
#endif

/* buf[kk][0:16] = scale * q + offset for one panel; offsets may be NULL (symmetric). */
static void dequant_panel(const int8_t *q, const float *scales, const float *offsets, int64_t k, int64_t group,
                          float *buf)
{
    for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, gi++) {
        const int64_t g1 = g0 + group < k ? g0 + group : k;
        const float *s = scales + gi * NR;
        const float *o = offsets ? offsets + gi * NR : NULL;
#if defined(PAGEDQ_AVX512)
        const __m512 vs = _mm512_loadu_ps(s), vo = o ? _mm512_loadu_ps(o) : _mm512_setzero_ps();
        for (int64_t kk = g0; kk < g1; kk++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(q + kk * NR));
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
            _mm512_storeu_ps(buf + kk * NR, _mm512_add_ps(_mm512_mul_ps(w, vs), vo));
        }
#elif defined(PAGEDQ_AVX2)
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        const __m256 o0 = o ? _mm256_loadu_ps(o) : _mm256_setzero_ps(), o1 = o ? _mm256_loadu_ps(o + 8) : o0;
        for (int64_t kk = g0; kk < g1; kk++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(q + kk * NR));
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
            _mm256_storeu_ps(buf + kk * NR, _mm256_add_ps(_mm256_mul_ps(w0, s0), o0));
            _mm256_storeu_ps(buf + kk * NR + 8, _mm256_add_ps(_mm256_mul_ps(w1, s1), o1));
        }
#else
        for (int64_t kk = g0; kk < g1; kk++)
            for (int j = 0; j < NR; j++)
                buf[kk * NR + j] = (float)q[kk * NR + j] * s[j] + (o ? o[j] : 0.f);
#endif
    }
}

#if !defined(PAGEDQ_AVX2)
/* The generic build's tile: any number of rows, one accumulator row of 16 the compiler vectorises. */
static void tile_rows_generic(int rows, const float *x, int64_t ldx, const float *panel, int64_t k, float *y,
                              int64_t ldy, const float *bias, int ncols, int glu)
{
    for (int r = 0; r < rows; r++) {
        float acc[NR] = {0};
        const float *xr = x + r * ldx;
        for (int64_t kk = 0; kk < k; kk++) {
            const float xv = xr[kk];
            for (int j = 0; j < NR; j++)
                acc[j] += xv * panel[kk * NR + j];
        }
        float *yr = y + r * ldy;
        for (int j = 0; j < ncols; j++) {
            if (glu) {
                const float g = acc[j];
                yr[j] = g / (1.f + expf(-g)) * acc[NR / 2 + j];
            } else {
                yr[j] = acc[j] + (bias ? bias[j] : 0.f);
            }
        }
    }
}
#endif

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T + bias, W as described above; with glu,
 * y [m, n] = silu(x @ gate^T) * (x @ up^T) and no bias. Returns 0, or -1 if a buffer could not be had. */
int gemm_int8_panels(const float *x, int64_t ldx, const int8_t *values, const float *scales, const float *offsets,
                     int64_t group, const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                     int glu, int num_threads)
{
    const int64_t width = glu ? NR / 2 : NR; /* output columns per panel */
    const int64_t panels = (n + width - 1) / width;
    const int64_t groups = (k + group - 1) / group;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (panels > 1)
    {
        float *buf = aligned_alloc(64, (size_t)((k * NR * (int64_t)sizeof(float) + 63) / 64 * 64));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t m1 = m0 + MB < m ? m0 + MB : m;
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                if (!buf)
                    continue;
                const int64_t col = p * width;
                const int ncols = (int)(n - col < width ? n - col : width);
                const float *bp = bias && !glu ? bias + col : NULL;
                dequant_panel(values + p * k * NR, scales + p * groups * NR, offsets ? offsets + p * groups * NR : NULL,
                              k, group, buf);
#if defined(PAGEDQ_AVX2)
                for (int64_t r = m0; r < m1; r += MR) {
                    const int rows = (int)(m1 - r < MR ? m1 - r : MR);
                    tile_rows(rows, x + r * ldx, ldx, buf, NR, k, y + r * ldy + col, ldy, bp, ncols, glu, NULL, 0);
                }
#else
                tile_rows_generic((int)(m1 - m0), x + m0 * ldx, ldx, buf, k, y + m0 * ldy + col, ldy, bp, ncols, glu);
#endif
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
