/* The register tile shared by the panel GEMM (cpu_gemm.c) and prefill attention (cpu_attention.c):
 * y[rows, 0:16] = x[rows, 0:k] @ panel[0:k, 0:16] with rows <= MR, x rows at stride ldx, panel rows at
 * stride ldw (16 for a packed weight panel). Epilogue: + bias, or with glu, silu(lanes 0-7) * lanes 8-15.
 * Two builds (pagedq_kernels/c_build.py variants): AVX-512 when the compiler targets it, a 12x16 tile of one zmm
 * accumulator per row; else AVX2/FMA, a 6x16 tile of two ymm per row. Without AVX2 neither user runs (the
 * matmuls stay on oneDNN, and prefill attention decodes row by row). The panel layout (NR = 16 columns) is the
 * same in both, so a weight packed by one variant runs on the other. */
#ifndef PAGEDQ_GEMM_TILE_H
#define PAGEDQ_GEMM_TILE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

#define NR 16
#ifdef PAGEDQ_AVX512 /* simd_math.h */
/* 12 rows: 12 accumulators + the weight vector + a broadcast use 14 of the 32 zmm registers. One weight
 * load and 12 broadcasts feed 12 FMAs, so the loads (2-3 per cycle) keep both 512-bit FMA ports near full;
 * more rows would leave the panel block (MB rows) too few row tiles at decode sizes. */
#define MR 12
#else
#define MR 6
#endif
#ifndef PF
#define PF 128 /* k-rows ahead to prefetch (8 KB): DRAM latency is ~300 cycles of a few FMAs each */
#endif
#ifndef PF_HINT
/* Where the tile's prefetch of its panel puts the lines: L1 for a panel already in L2 (int8's dequantised
 * panel, prefill attention's copies of K/V), L2 for a weight streamed from memory (cpu_gemm.c sets T1 and
 * says why). */
#define PF_HINT _MM_HINT_T0
#endif

#if defined(PAGEDQ_AVX512) || defined(PAGEDQ_AVX2)
/* One k step's part of a tile's `ahead` prefetch: ahead_lines / k cache lines of *ahead per step, by a running
 * count in *due (no divide), into L2 (the next work item's panels, cpu_gemm.c ahead_share; NULL, 0: none). */
static inline __attribute__((always_inline)) void ahead_step(const char **ahead, int64_t *due, int64_t ahead_lines,
                                                             int64_t k)
{
    for (*due += ahead_lines; *due >= k; *due -= k, *ahead += 64)
        _mm_prefetch(*ahead, _MM_HINT_T1);
}
#endif

#ifdef PAGEDQ_AVX2
static inline __m256 silu_mul8(__m256 g, __m256 u)
{
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}
#endif

#ifdef PAGEDQ_AVX512

/* The tile's epilogue: rows of acc (+ bias) into y, ncols valid columns; with glu, 8 outputs per row:
 * silu(gate lanes 0-7) * up lanes 8-15, no bias. */
static inline __attribute__((always_inline)) void tile_store(const __m512 *acc, int rows, float *y, int64_t ldy,
                                                             const float *bias, int ncols, int glu)
{
    const __mmask16 cols = (__mmask16)((1u << ncols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
    for (int r = 0; r < MR; r++) {
        if (r >= rows) break;
        float *yr = y + r * ldy;
        if (glu) {
            const __m256 v = silu_mul8(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
            _mm256_mask_storeu_ps(yr, (__mmask8)cols, v);
            continue;
        }
        _mm512_mask_storeu_ps(yr, cols, _mm512_add_ps(acc[r], b));
    }
}

/* rows x 16 tile, one zmm accumulator per row; partial column counts use masked stores (no bounce). */
static inline __attribute__((always_inline)) void tile(int rows, const float *x, int64_t ldx,
                                                       const float *panel, int64_t ldw, int64_t k, float *y,
                                                       int64_t ldy, const float *bias, int ncols, int glu,
                                                       const char *ahead, int64_t ahead_lines)
{
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
                *x5 = x + 5 * ldx, *x6 = x + 6 * ldx, *x7 = x + 7 * ldx, *x8 = x + 8 * ldx, *x9 = x + 9 * ldx,
                *x10 = x + 10 * ldx, *x11 = x + 11 * ldx;
#define ROW(r) \
    if (rows > r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(x##r[kk]), w, c##r);
    int64_t due = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *wp = panel + kk * ldw;
        _mm_prefetch((const char *)(wp + PF * ldw), PF_HINT);
        ahead_step(&ahead, &due, ahead_lines, k);
        const __m512 w = _mm512_loadu_ps(wp);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
    }
#undef ROW
    const __m512 acc[MR] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
    tile_store(acc, rows, y, ldy, bias, ncols, glu);
}

/* Two panels at once (rows x 32 columns, 24 accumulators; rows of both at stride ldw): each broadcast of
 * x feeds two FMAs, so a k step issues 12 broadcasts + 2 weight loads + 2 prefetches for 24 FMAs where two
 * single-panel tiles issue 26 + 2 for the same work: the load ports, not the FMA units, bound the single
 * tile. panel1's outputs go to y1 (its ncols1, its own bias slice). Measured in cpu_gemm.c's header and
 * beside flash_rows (cpu_attention.c). `ahead` (or NULL): ahead_lines cache lines from there are prefetched
 * into L2 over the k steps, evenly (the next work item's panels, cpu_gemm.c ahead_share). */
static inline __attribute__((always_inline)) void tile_pair(int rows, const float *x, int64_t ldx,
                                                            const float *panel0, const float *panel1, int64_t ldw,
                                                            int64_t k, float *y0, float *y1, int64_t ldy,
                                                            const float *bias0, const float *bias1, int ncols0,
                                                            int ncols1, int glu, const char *ahead,
                                                            int64_t ahead_lines)
{
    __m512 c0a = _mm512_setzero_ps(), c1a = c0a, c2a = c0a, c3a = c0a, c4a = c0a, c5a = c0a;
    __m512 c6a = c0a, c7a = c0a, c8a = c0a, c9a = c0a, c10a = c0a, c11a = c0a;
    __m512 c0b = c0a, c1b = c0a, c2b = c0a, c3b = c0a, c4b = c0a, c5b = c0a;
    __m512 c6b = c0a, c7b = c0a, c8b = c0a, c9b = c0a, c10b = c0a, c11b = c0a;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
                *x5 = x + 5 * ldx, *x6 = x + 6 * ldx, *x7 = x + 7 * ldx, *x8 = x + 8 * ldx, *x9 = x + 9 * ldx,
                *x10 = x + 10 * ldx, *x11 = x + 11 * ldx;
#define ROW(r)                                          \
    if (rows > r) {                                     \
        const __m512 xb = _mm512_set1_ps(x##r[kk]);     \
        c##r##a = _mm512_fmadd_ps(xb, w0, c##r##a);     \
        c##r##b = _mm512_fmadd_ps(xb, w1, c##r##b);     \
    }
    int64_t due = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *wp0 = panel0 + kk * ldw, *wp1 = panel1 + kk * ldw;
        _mm_prefetch((const char *)(wp0 + PF * ldw), PF_HINT);
        _mm_prefetch((const char *)(wp1 + PF * ldw), PF_HINT);
        ahead_step(&ahead, &due, ahead_lines, k);
        const __m512 w0 = _mm512_loadu_ps(wp0), w1 = _mm512_loadu_ps(wp1);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
    }
#undef ROW
    const __m512 acc0[MR] = {c0a, c1a, c2a, c3a, c4a, c5a, c6a, c7a, c8a, c9a, c10a, c11a};
    const __m512 acc1[MR] = {c0b, c1b, c2b, c3b, c4b, c5b, c6b, c7b, c8b, c9b, c10b, c11b};
    tile_store(acc0, rows, y0, ldy, bias0, ncols0, glu);
    tile_store(acc1, rows, y1, ldy, bias1, ncols1, glu);
}

#elif defined(PAGEDQ_AVX2)

/* The tile's epilogue: rows of acc (+ bias) into y, ncols valid columns; with glu, 8 outputs per row:
 * silu(gate lanes 0-7) * up lanes 8-15, no bias. Shared with the int8 kernel's fused tile (cpu_int8_gemm.c). */
static inline __attribute__((always_inline)) void tile_store(const __m256 acc[MR][2], int rows, float *y, int64_t ldy,
                                                             const float *bias, int ncols, int glu)
{
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

/* rows x 16 tile: acc[r] += x[r, :] * panel[:, 0:16], then stored (+bias) into y (ncols valid). `ahead` (or
 * NULL): ahead_lines cache lines from there prefetched into L2 over the k steps, as tile_pair's. */
static inline __attribute__((always_inline)) void tile(int rows, const float *x, int64_t ldx,
                                                       const float *panel, int64_t ldw, int64_t k, float *y,
                                                       int64_t ldy, const float *bias, int ncols, int glu,
                                                       const char *ahead, int64_t ahead_lines)
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
    int64_t due = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *wp = panel + kk * ldw;
        _mm_prefetch((const char *)(wp + PF * ldw), PF_HINT);
        ahead_step(&ahead, &due, ahead_lines, k);
        const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
        ROW(0, c0a, c0b) ROW(1, c1a, c1b) ROW(2, c2a, c2b) ROW(3, c3a, c3b) ROW(4, c4a, c4b) ROW(5, c5a, c5b)
    }
#undef ROW
    const __m256 acc[MR][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b}, {c3a, c3b}, {c4a, c4b}, {c5a, c5b}};
    tile_store(acc, rows, y, ldy, bias, ncols, glu);
}

#endif

#if defined(PAGEDQ_AVX512) || defined(PAGEDQ_AVX2)
/* One tile call per row count: constant row counts let the compiler keep every accumulator in a
 * register (a runtime count spills them), so each count up to MR gets its own inlined copy. */
static inline void tile_rows(int rows, const float *x, int64_t ldx, const float *panel, int64_t ldw, int64_t k, float *y,
                             int64_t ldy, const float *bias, int ncols, int glu, const char *ahead, int64_t ahead_lines)
{
#define TILE_CASE(n) case n: tile(n, x, ldx, panel, ldw, k, y, ldy, bias, ncols, glu, ahead, ahead_lines); break;
    switch (rows) {
#if MR > 6
    TILE_CASE(12) TILE_CASE(11) TILE_CASE(10) TILE_CASE(9) TILE_CASE(8) TILE_CASE(7)
#endif
    TILE_CASE(6) TILE_CASE(5) TILE_CASE(4) TILE_CASE(3) TILE_CASE(2)
    default: tile(1, x, ldx, panel, ldw, k, y, ldy, bias, ncols, glu, ahead, ahead_lines); break;
    }
#undef TILE_CASE
}
#endif

#ifdef PAGEDQ_AVX512
/* tile_pair, one inlined copy per row count (as tile_rows). */
static inline void tile_pair_rows(int rows, const float *x, int64_t ldx, const float *panel0, const float *panel1,
                                  int64_t ldw, int64_t k, float *y0, float *y1, int64_t ldy, const float *bias0,
                                  const float *bias1, int ncols0, int ncols1, int glu, const char *ahead,
                                  int64_t ahead_lines)
{
#define PAIR_CASE(n) \
    case n: \
        tile_pair(n, x, ldx, panel0, panel1, ldw, k, y0, y1, ldy, bias0, bias1, ncols0, ncols1, glu, ahead, \
                  ahead_lines); \
        break;
    switch (rows) {
    PAIR_CASE(12) PAIR_CASE(11) PAIR_CASE(10) PAIR_CASE(9) PAIR_CASE(8) PAIR_CASE(7)
    PAIR_CASE(6) PAIR_CASE(5) PAIR_CASE(4) PAIR_CASE(3) PAIR_CASE(2)
    default:
        tile_pair(1, x, ldx, panel0, panel1, ldw, k, y0, y1, ldy, bias0, bias1, ncols0, ncols1, glu, ahead,
                  ahead_lines);
        break;
    }
#undef PAIR_CASE
}

/* Three panels at once for many rows (cpu_gemm.c panel_items, from TRIPLE_MIN_ROWS): rows <= TR x 48 columns, 24
 * accumulators, each k step 8 broadcasts + 3 weight loads for 24 FMAs (tile_pair: 12 + 2). panel1 and panel2 follow
 * panel0 at k x NR floats each; their outputs go to y + width and y + 2 * width (width: a panel's output columns,
 * NR or with glu NR / 2), their biases likewise. Every output is the same chain of FMAs over k as in tile_pair, so
 * the floats are the same. A panel is read once from memory and then from L2 by every later row tile.
 *
 * Hence the prefetches: every row tile pulls its panels from L2 into L1 TRIPLE_L1_PF k rows ahead (the three
 * panels, 110 KB at k = 576, do not stay in a 48 KB L1 from one row tile to the next); in a block of few rows
 * (decode steps, cpu_gemm.c TRIPLE_AHEAD_ROWS) each row tile also prefetches its share of the next item's panels
 * into L2 (`ahead`, as tile_pair's), and otherwise the block's first row tile (from_memory) streams them from
 * memory into L2 PF rows ahead. Before, every row tile
 * prefetched PF rows ahead into L2, where the later ones found their lines already: L1 misses stalled them.
 * Measured on the 2-vCPU Intel Xeon (family 6 model 207), 30 layers' distinct weights, the four projections in
 * order, builds interleaved in one process, best of 4-5, GFLOP/s before -> after: 256 rows 293 -> 296, 512 rows
 * 275 -> 298 and 203 -> 216-226, 1024 rows 237 -> 264, 2048 rows 206 -> 238 and 235 -> 253-276 (L1 distance 24
 * / 32 / 48 / 64 rows alike; without any prefetch 2-14 % over before, under this). */
#define TR 8
#ifndef TRIPLE_L1_PF
#define TRIPLE_L1_PF 32
#endif
static inline __attribute__((always_inline)) void tile_triple(int rows, const float *x, int64_t ldx,
                                                              const float *panel0, int64_t k, float *y, int64_t ldy,
                                                              const float *bias, int64_t width, int ncols0,
                                                              int ncols1, int ncols2, int glu, int from_memory,
                                                              const char *ahead, int64_t ahead_lines)
{
    __m512 a[TR], b[TR], c[TR];
    int64_t due = 0;
    for (int r = 0; r < TR; r++) {
        a[r] = _mm512_setzero_ps();
        b[r] = a[r];
        c[r] = a[r];
    }
    const float *panel1 = panel0 + k * NR, *panel2 = panel1 + k * NR;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *wp0 = panel0 + kk * NR, *wp1 = panel1 + kk * NR, *wp2 = panel2 + kk * NR;
        _mm_prefetch((const char *)(wp0 + TRIPLE_L1_PF * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp1 + TRIPLE_L1_PF * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp2 + TRIPLE_L1_PF * NR), _MM_HINT_T0);
        if (from_memory) { /* PF_HINT: where the includer streams a weight from memory (cpu_gemm.c: L2) */
            _mm_prefetch((const char *)(wp0 + PF * NR), PF_HINT);
            _mm_prefetch((const char *)(wp1 + PF * NR), PF_HINT);
            _mm_prefetch((const char *)(wp2 + PF * NR), PF_HINT);
        }
        ahead_step(&ahead, &due, ahead_lines, k);
        const __m512 w0 = _mm512_loadu_ps(wp0), w1 = _mm512_loadu_ps(wp1), w2 = _mm512_loadu_ps(wp2);
#pragma GCC unroll 8
        for (int r = 0; r < TR; r++) {
            if (r < rows) { /* a constant per inlined copy (tile_triple_rows) */
                const __m512 xb = _mm512_set1_ps(x[r * ldx + kk]);
                a[r] = _mm512_fmadd_ps(xb, w0, a[r]);
                b[r] = _mm512_fmadd_ps(xb, w1, b[r]);
                c[r] = _mm512_fmadd_ps(xb, w2, c[r]);
            }
        }
    }
    tile_store(a, rows, y, ldy, bias, ncols0, glu);
    tile_store(b, rows, y + width, ldy, bias ? bias + width : NULL, ncols1, glu);
    tile_store(c, rows, y + 2 * width, ldy, bias ? bias + 2 * width : NULL, ncols2, glu);
}

/* tile_triple, one inlined copy per row count (as tile_rows). */
static inline void tile_triple_rows(int rows, const float *x, int64_t ldx, const float *panel0, int64_t k, float *y,
                                    int64_t ldy, const float *bias, int64_t width, int ncols0, int ncols1, int ncols2,
                                    int glu, int from_memory, const char *ahead, int64_t ahead_lines)
{
#define TRIPLE_CASE(n) \
    case n: \
        tile_triple(n, x, ldx, panel0, k, y, ldy, bias, width, ncols0, ncols1, ncols2, glu, from_memory, ahead, \
                    ahead_lines); \
        break;
    switch (rows) {
    TRIPLE_CASE(8) TRIPLE_CASE(7) TRIPLE_CASE(6) TRIPLE_CASE(5) TRIPLE_CASE(4) TRIPLE_CASE(3) TRIPLE_CASE(2)
    default:
        tile_triple(1, x, ldx, panel0, k, y, ldy, bias, width, ncols0, ncols1, ncols2, glu, from_memory, ahead,
                    ahead_lines);
        break;
    }
#undef TRIPLE_CASE
}
#endif

#endif /* PAGEDQ_GEMM_TILE_H */
