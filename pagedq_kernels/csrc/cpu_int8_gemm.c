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
 * tile's epilogue emits silu(gate) * up. Decode-sized calls (one to six rows on AVX2, to twelve on AVX-512: a
 * lone sequence's step with its drafts) skip the buffer and dequantise in registers (fused_tile, below).
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

#if defined(PAGEDQ_AVX2) && !defined(PAGEDQ_AVX512)
/* One k row of a panel, 16 codes, as two vectors of 8 weights: scale * q + offset. Shared by the buffer and the
 * fused path, so both compute each weight alike. The codes come in as two 8-byte loads folded into their sign
 * extensions (vpmovsxbd ymm, m64), no shuffle: 30 layers at one row on the fused path 8.7-9.5 -> 8.0 ms against
 * one 16-byte load and a shift. */
static inline __attribute__((always_inline)) void dequant_row(const int8_t *q, __m256 s0, __m256 s1, __m256 o0,
                                                              __m256 o1, __m256 *w0, __m256 *w1)
{
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
    *w0 = _mm256_add_ps(_mm256_mul_ps(q0, s0), o0);
    *w1 = _mm256_add_ps(_mm256_mul_ps(q1, s1), o1);
}
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
            __m256 w0, w1;
            dequant_row(q + kk * NR, s0, s1, o0, o1, &w0, &w1);
            _mm256_storeu_ps(buf + kk * NR, w0);
            _mm256_storeu_ps(buf + kk * NR + 8, w1);
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

#if defined(PAGEDQ_AVX512)
/* The AVX-512 build's fused path (the AVX2 one below says why a decode-sized call skips the buffer): one zmm of
 * 16 weights per k row, widened from one 16-byte load, and one zmm accumulator per row of x, up to FUSED_ROWS
 * rows (FUSED_ROWS accumulators + weight, scale, offset and a broadcast stay within the 32 zmm registers).
 * Each weight is dequant_panel's AVX-512 scale * q + offset (a multiply then an add, not an FMA) and each
 * output sums x * w over k in order, ending in tile_store, so both paths give the same floats. Measured on a
 * 2-vCPU Intel Xeon (family 6 model 207, AVX-512, 2 threads): SmolLM2's four linears over 30 layers' distinct
 * Q4_1-style weights (groups of 32 with offsets), ms per call set, buffered -> fused, identical outputs: one row
 * 13.2 -> 7.2, two 14.6 -> 7.1, four 13.9 -> 8.7, six 19.2 -> 11.0, eight 20.1 -> 13.2, ten 24.5 -> 16.7,
 * twelve 28.0 -> 19.8 (dense fp32 panels: 21.4 at one row, 26.7 at twelve); 13 rows buffered 33.0. */
#ifndef FUSED_ROWS
#define FUSED_ROWS 12
#endif

static inline __attribute__((always_inline)) void fused_tile(int rows, const float *x, int64_t ldx,
                                                             const int8_t *q, const float *scales,
                                                             const float *offsets, int64_t k, int64_t group,
                                                             float *y, int64_t ldy, const float *bias, int ncols,
                                                             int glu)
{
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
                *x5 = x + 5 * ldx, *x6 = x + 6 * ldx, *x7 = x + 7 * ldx, *x8 = x + 8 * ldx, *x9 = x + 9 * ldx,
                *x10 = x + 10 * ldx, *x11 = x + 11 * ldx;
#define ROW(r) \
    if (rows > r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(x##r[kk]), w, c##r);
    for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, gi++) {
        const int64_t g1 = g0 + group < k ? g0 + group : k;
        const __m512 vs = _mm512_loadu_ps(scales + gi * NR);
        const __m512 vo = offsets ? _mm512_loadu_ps(offsets + gi * NR) : _mm512_setzero_ps();
        for (int64_t kk = g0; kk < g1; kk++) {
            _mm_prefetch((const char *)(q + (kk + PF) * NR), _MM_HINT_T0);
            const __m128i raw = _mm_loadu_si128((const __m128i *)(q + kk * NR));
            const __m512 w = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), vs), vo);
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
        }
    }
#undef ROW
    const __m512 acc[MR] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
    tile_store(acc, rows, y, ldy, bias, ncols, glu); /* the tile's own epilogue */
}
#endif

#if defined(PAGEDQ_AVX2) && !defined(PAGEDQ_AVX512)
/* Decode-sized calls (m <= FUSED_ROWS): the panel is dequantised in registers as the tile walks it, with no
 * fp32 buffer. Why: at one to six rows the buffer path is bound by writing and re-reading a panel of fp32
 * per call (four times the int8 bytes), not by the weights' memory traffic; 30 layers of SmolLM2's linears
 * at one row took 12.4 ms against 8.5 ms for the same weights dense in fp32 (cache-warm). Streamed from
 * memory (30 distinct layers, 133 MB of codes, scales and offsets), 2-vCPU AMD EPYC Zen 3, buffered ->
 * fused: one row 13.5-13.7 -> 8.0 ms, two 13.8 -> 8.4, four 14.4-15.2 -> 10.2, five 15.1-15.5 -> 11.2, six
 * 16.4-16.6 -> 13.0-13.2; eight rows stay buffered (21 ms either way). Six rows hold 12 accumulators and two
 * weight vectors in the 16 ymm registers; the scales and offsets are read from L1 as operands. Same
 * arithmetic, same order: each weight is dequant_row's scale * q + offset, as dequant_panel writes it, and each
 * output sums x * w over k in order into one accumulator and ends in the tile's epilogue (tile_store), as the
 * tile does, so both paths give the same floats.
 * The AVX-512 build has its own fused tile (above). */
#ifndef FUSED_ROWS
#define FUSED_ROWS 6
#endif

static inline __attribute__((always_inline)) void fused_tile(int rows, const float *x, int64_t ldx,
                                                             const int8_t *q, const float *scales,
                                                             const float *offsets, int64_t k, int64_t group,
                                                             float *y, int64_t ldy, const float *bias, int ncols,
                                                             int glu)
{
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a, c3a = c0a, c3b = c0a;
    __m256 c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
#define ROW(r, ca, cb)                                   \
    if (rows > r) {                                      \
        const __m256 b = _mm256_broadcast_ss(x##r + kk); \
        ca = _mm256_fmadd_ps(b, w0, ca);                 \
        cb = _mm256_fmadd_ps(b, w1, cb);                 \
    }
    for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, gi++) {
        const int64_t g1 = g0 + group < k ? g0 + group : k;
        const float *s = scales + gi * NR;
        const float *o = offsets ? offsets + gi * NR : NULL;
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        const __m256 o0 = o ? _mm256_loadu_ps(o) : _mm256_setzero_ps(), o1 = o ? _mm256_loadu_ps(o + 8) : o0;
        for (int64_t kk = g0; kk < g1; kk++) {
            _mm_prefetch((const char *)(q + (kk + PF) * NR), _MM_HINT_T0);
            __m256 w0, w1;
            dequant_row(q + kk * NR, s0, s1, o0, o1, &w0, &w1);
            ROW(0, c0a, c0b) ROW(1, c1a, c1b) ROW(2, c2a, c2b) ROW(3, c3a, c3b) ROW(4, c4a, c4b) ROW(5, c5a, c5b)
        }
    }
#undef ROW
    const __m256 acc[MR][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b}, {c3a, c3b}, {c4a, c4b}, {c5a, c5b}};
    tile_store(acc, rows, y, ldy, bias, ncols, glu); /* the tile's own epilogue */
}

#endif

#if defined(PAGEDQ_AVX2)
/* One inlined copy per row count (constant counts keep the accumulators in registers, as tile_rows). */
static void fused_rows(int rows, const float *x, int64_t ldx, const int8_t *q, const float *scales,
                       const float *offsets, int64_t k, int64_t group, float *y, int64_t ldy, const float *bias,
                       int ncols, int glu)
{
    switch (rows) {
#if defined(PAGEDQ_AVX512)
    case 12: fused_tile(12, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 11: fused_tile(11, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 10: fused_tile(10, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 9: fused_tile(9, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 8: fused_tile(8, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 7: fused_tile(7, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
#endif
    case 6: fused_tile(6, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 5: fused_tile(5, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 4: fused_tile(4, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 3: fused_tile(3, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    case 2: fused_tile(2, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    default: fused_tile(1, x, ldx, q, scales, offsets, k, group, y, ldy, bias, ncols, glu); break;
    }
}
#endif

/* The most rows a call takes on the fused path (0: this build has none): a caller choosing between this layout
 * and a dense one for a given row count asks it (LlamaForCausalLM's lm_head). */
int gemm_int8_fused_rows(void)
{
#if defined(PAGEDQ_AVX2)
    return FUSED_ROWS;
#else
    return 0;
#endif
}

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
#if defined(PAGEDQ_AVX2)
    if (m >= 1 && m <= FUSED_ROWS) {
        #pragma omp parallel for num_threads(num_threads) schedule(static) if (panels > 1)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t col = p * width;
            const int ncols = (int)(n - col < width ? n - col : width);
            fused_rows((int)m, x, ldx, values + p * k * NR, scales + p * groups * NR,
                       offsets ? offsets + p * groups * NR : NULL, k, group, y + col, ldy,
                       bias && !glu ? bias + col : NULL, ncols, glu);
        }
        return 0;
    }
#endif
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
