/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for float32 on the CPU, with W packed once into panels.
 *
 * Why: a decode step multiplies a handful of rows by every weight of the model, so it is a stream
 * of the weights from memory. oneDNN's blocked kernels read them at 5-7 GB/s for 1-16 rows on a
 * 2-core EPYC (a plain sum streams 16), which made the tail of a batch (the last few long requests)
 * cost 3x its bandwidth bound. Here W is stored as panels of 16 output columns, each panel
 * contiguous over K ([N/16][K][16]), so every thread reads its panels front to back exactly once
 * for up to MB rows of x at a time; the 6x16 register tile (12 accumulators, BLIS's Haswell shape) keeps
 * the FMA units busy once rows are many.
 *
 * Layout of a packed weight: ceil(N/16) panels of K x 16 floats; columns past N are zero.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

#define NR 16
#define MR 6
#ifndef PF
#define PF 128 /* k-rows ahead to prefetch (8 KB): DRAM latency is ~300 cycles of a few FMAs each */
#endif
#ifndef MB
#define MB 384 /* rows of x per block (measured 256-384 best here): the block is reused across every panel */
#endif

void pack_panels_f32(const float *w, int64_t n, int64_t k, float *out)
{
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.f;
            }
    }
}

/* Gate/up weight [2i, k] (gate rows first, like the merged gate_up projection) packed so panel p
 * holds gate columns 8p..8p+7 in lanes 0-7 and the matching up columns in lanes 8-15: one tile then
 * has both halves of 8 outputs of silu(gate) * up, and the 2i-wide intermediate is never stored. */
void pack_glu_panels_f32(const float *w, int64_t i, int64_t k, float *out)
{
    const int64_t panels = (i + NR / 2 - 1) / (NR / 2);
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR / 2; j++) {
                const int64_t col = p * (NR / 2) + j;
                dst[kk * NR + j] = col < i ? w[col * k + kk] : 0.f;
                dst[kk * NR + NR / 2 + j] = col < i ? w[(i + col) * k + kk] : 0.f;
            }
    }
}

#ifdef PAGEDQ_AVX2

static inline __m256 silu_mul8(__m256 g, __m256 u)
{
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

/* rows x 16 tile: acc[r] += x[r, :] * panel[:, 0:16], then stored (+bias) into y (ncols valid). */
static inline __attribute__((always_inline)) void tile(int rows, const float *x, int64_t ldx,
                                                       const float *panel, int64_t k, float *y,
                                                       int64_t ldy, const float *bias, int ncols, int glu)
{
    /* Named accumulators, not an array: gcc spills an accumulator array to the stack every step. */
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
    __m256 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
                *x5 = x + 5 * ldx;
#define ROW(r, ca, cb)                                          \
    if (rows > r) {                                             \
        const __m256 b = _mm256_broadcast_ss(x##r + kk);        \
        ca = _mm256_fmadd_ps(b, w0, ca);                        \
        cb = _mm256_fmadd_ps(b, w1, cb);                        \
    }
    for (int64_t kk = 0; kk < k; kk++) {
        const float *wp = panel + kk * NR;
        _mm_prefetch((const char *)(wp + PF * NR), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
        ROW(0, c0a, c0b) ROW(1, c1a, c1b) ROW(2, c2a, c2b) ROW(3, c3a, c3b) ROW(4, c4a, c4b) ROW(5, c5a, c5b)
    }
#undef ROW
    const __m256 acc[MR][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b}, {c3a, c3b}, {c4a, c4b}, {c5a, c5b}};
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    float tmp[NR];
    if (bias) {
        if (ncols == NR) {
            b0 = _mm256_loadu_ps(bias);
            b1 = _mm256_loadu_ps(bias + 8);
        } else {
            memset(tmp, 0, sizeof tmp);
            memcpy(tmp, bias, (size_t)ncols * sizeof(float));
            b0 = _mm256_loadu_ps(tmp);
            b1 = _mm256_loadu_ps(tmp + 8);
        }
    }
    for (int r = 0; r < MR; r++) {
        if (r >= rows) break;
        float *yr = y + r * ldy;
        if (glu) { /* 8 outputs: silu(gate lanes) * up lanes; no bias (the MLPs pagedq runs have none) */
            const __m256 v = silu_mul8(acc[r][0], acc[r][1]);
            if (ncols == NR / 2) {
                _mm256_storeu_ps(yr, v);
            } else {
                _mm256_storeu_ps(tmp, v);
                memcpy(yr, tmp, (size_t)ncols * sizeof(float));
            }
            continue;
        }
        const __m256 v0 = _mm256_add_ps(acc[r][0], b0), v1 = _mm256_add_ps(acc[r][1], b1);
        if (ncols == NR) {
            _mm256_storeu_ps(yr, v0);
            _mm256_storeu_ps(yr + 8, v1);
        } else {
            _mm256_storeu_ps(tmp, v0);
            _mm256_storeu_ps(tmp + 8, v1);
            memcpy(yr, tmp, (size_t)ncols * sizeof(float));
        }
    }
}

static void tile_rows(int rows, const float *x, int64_t ldx, const float *panel, int64_t k, float *y,
                      int64_t ldy, const float *bias, int ncols, int glu)
{
    switch (rows) { /* constant row counts let the compiler keep every accumulator in a register */
    case 6: tile(6, x, ldx, panel, k, y, ldy, bias, ncols, glu); break;
    case 5: tile(5, x, ldx, panel, k, y, ldy, bias, ncols, glu); break;
    case 4: tile(4, x, ldx, panel, k, y, ldy, bias, ncols, glu); break;
    case 3: tile(3, x, ldx, panel, k, y, ldy, bias, ncols, glu); break;
    case 2: tile(2, x, ldx, panel, k, y, ldy, bias, ncols, glu); break;
    default: tile(1, x, ldx, panel, k, y, ldy, bias, ncols, glu); break;
    }
}

#else

static void tile_rows(int rows, const float *x, int64_t ldx, const float *panel, int64_t k, float *y,
                      int64_t ldy, const float *bias, int ncols, int glu)
{
    for (int r = 0; r < rows; r++) {
        float acc[NR] = {0};
        for (int64_t kk = 0; kk < k; kk++) {
            const float b = x[r * ldx + kk];
            for (int j = 0; j < NR; j++) acc[j] += b * panel[kk * NR + j];
        }
        for (int j = 0; j < ncols; j++) {
            const float g = acc[j];
            y[r * ldy + j] = glu ? g / (1.f + expf(-g)) * acc[NR / 2 + j] : g + (bias ? bias[j] : 0.f);
        }
    }
}

#endif

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T + bias, W packed by pack_panels_f32;
 * with glu, W packed by pack_glu_panels_f32 and y [m, n] = silu(x @ gate^T) * (x @ up^T), no bias. */
void gemm_panels_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int glu, int num_threads)
{
    const int64_t width = glu ? NR / 2 : NR; /* output columns per panel */
    const int64_t panels = (n + width - 1) / width;
    #pragma omp parallel num_threads(num_threads) if (panels > 1)
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const int64_t m1 = m0 + MB < m ? m0 + MB : m;
        #pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            const float *panel = packed + p * k * NR;
            const int64_t col = p * width;
            const int ncols = (int)(n - col < width ? n - col : width);
            const float *bp = bias && !glu ? bias + col : NULL;
            for (int64_t r = m0; r < m1; r += MR) {
                const int rows = (int)(m1 - r < MR ? m1 - r : MR);
                tile_rows(rows, x + r * ldx, ldx, panel, k, y + r * ldy + col, ldy, bp, ncols, glu);
            }
        }
    }
}

/* 1 when built with the AVX2/FMA tile (the fast path), 0 for the portable loop. */
int gemm_panels_simd(void)
{
#ifdef PAGEDQ_AVX2
    return 1;
#else
    return 0;
#endif
}
