/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias), or silu(gate) * up, for a bf16 weight on AVX512-bf16 dot products
 * (VDPBF16PS), on CPUs that have them without AMX (AMD Zen 4/5, Intel Cooper Lake).
 *
 * Why: there every bf16 linear went through oneDNN (pagedq_kernels/cpu_linear.py, kind "onednn"), which pays three
 * torch ops and three passes over the rows per call (x.to(bfloat16), _linear_pointwise, .to(float32)) and a
 * separate SiLU-and-mul pass for the gated MLP: the costs cpu_bf16_amx.c removed on AMX. This is the same
 * kernel for the dot-product instruction: x rounded to bf16 inside the OpenMP region, fp32 sums, fp32 rows
 * (bias added in fp32) written straight into y, silu(gate) * up in the epilogue.
 *
 * Layout: the AMX kernels' B-tile order (amx_tile.h, packed by pagedq_kernels/cpu_linear.py _pack_amx), so one
 * packing serves both: per column block of 32 outputs (glu: 16 gate + the 16 matching up columns) and per
 * 32-deep K chunk, two 1 KB "tiles" (columns 0-15, 16-31) of 16 rows; row p of a tile is k-pair p of its 16
 * columns, 16 x 2 bf16 = 64 bytes, which is exactly VDPBF16PS's weight operand. A k-pair of one x row,
 * broadcast as a 32-bit lane, is the other: one instruction adds x[2p] w[2p] + x[2p+1] w[2p+1] into 16
 * columns' fp32 sums.
 *
 * Register tile: up to 12 rows x 32 columns, 24 zmm accumulators; per k-pair 2 weight loads and 12
 * broadcast operands (folded into the instruction as {1to16}) feed 24 VDPBF16PS, so the two 512-bit FMA
 * pipes, not the loads, set the pace (as gemm_tile.h's tile_pair for fp32, at twice the products per
 * instruction). Rows are spread evenly over a row block's tiles (13 rows: 7 + 6, not 12 + 1): a tile of
 * r rows runs 2r independent sum chains, and under ~6 rows the instruction's latency, not its throughput,
 * bounds it. Per thread a static share of the column blocks (each thread streams one contiguous range of
 * the weight), every MB-row pass of x over them; a block's K x 64 bytes (36 KB at K=576, 96 KB at 1536)
 * stay in L1/L2 for its row tiles after the first.
 *
 * Products on fp32 FMAs (bf16_dp_use_fma): where VDPBF16PS multiplies at half the FMAs' rate (Intel Xeon family 6
 * model 207, AMX not exposed: isa_probe bf16_rate 0.50), each k-pair's weights are widened in registers (the odd
 * k's bf16 is a lane's bits masked, the even one's shifted up: two ALU ops per 32 products, shared by the tile's
 * rows) and x's rounded rows are widened once per call, and two FMAs per lane add the odd product, then the even
 * one: VDPBF16PS's defined sequence (each product of two bf16 is exact in fp32), under its own denormal rule (FTZ
 * and DAZ set in MXCSR for the tile loop), so the floats are the instruction's, bit for bit on that Xeon. The
 * same tile, layout, prefetch and epilogues. Measured there (2 threads, 30 cold copies of each weight, best of 3
 * interleaved, GFLOP/s VDPBF16PS -> FMAs through cpu_linear.linear, identical outputs):
 *                  M:     8    36   256  2048
 *   qkv 576x960          92 -> 124   120 -> 165   137 -> 195   143 -> 248
 *   o 576x576           104 -> 136   141 -> 211   153 -> 247   161 -> 261
 *   gate_up glu         149 -> 228   153 -> 250   158 -> 252   157 -> 269
 *   down 1536x576       100 -> 122   127 -> 186   144 -> 214   153 -> 253
 * (one row: within 5 % either way, the weight's stream). That puts bf16 weights at the fp32 panels' FLOP rate
 * with half their bytes: compass without drafts in bf16 237.6 tok/s with the products moved (fp32: 207.7), 276.5
 * with attention's products on FMAs too (cpu_attention.dp_attention_enabled), so dtype=auto takes bf16 there.
 *
 * Only the avx512 build (pagedq_kernels/c_build.py) holds the kernel, compiled with the bf16 target on top; Python
 * calls it only where pagedq_kernels/cpu_isa.py probed AVX512-bf16 runnable under the PAGEDQ_CPU_ISA cap (and AMX
 * does not run: that kernel is faster where it does). Other builds export a stub that refuses.
 *
 * Measured (2-vCPU KVM AMD EPYC, family 26 model 2 = Zen 5, 1 MB L2 per core, 2 threads, another process's
 * tests running beside it; GFLOP/s through the Python entry points, x fp32 in and out, each call on the next
 * of 30 copies of the weight so that it comes from memory as in a model step; oneDNN = the "onednn" kind, its
 * x.to(bfloat16) and .to(float32) included, gate_up followed by the C SiLU-and-mul pass as the engine ran it;
 * python -m ops.bench.kernel_timing --linears --rounds 2):
 *                  M:     8    36    64   256  2048
 *   qkv 576x960   this  373   624   691   816   749 | oneDNN  183   437   481   694   771
 *   o 576x576           309   597   662   760   807 |         179   378   455   703   788
 *   gate_up glu         410   740   801   854   770 |         248   534   640   654   368
 *   down 1536x576       300   685   768   821   623 |         191   496   572   720   397
 *   lm_head 576x49152   549   666   675   442   334 |         262   540   598   576   292
 * Software prefetch of the weight DP_PF elements ahead (two lines per k-pair, one per tile) is what makes
 * the small products a stream (no prefetch / 4 KB ahead / 8 KB ahead, interleaved builds in one process,
 * same machine, GFLOP/s at 8, 36, 64 rows): qkv 154 415 525 / 312 655 714 / 352 701 736; down 186 474 579 /
 * 348 707 761 / 416 778 788; gate_up 190 466 588 / 338 711 768 / 335 793 814. Tried and dropped: the next
 * column block prefetched into L2 in shares spread over the current block's row tiles (so that the row
 * tiles after the first, which read the block from L1, also keep memory busy): within the noise.
 * The prefetch goes into L2 (DP_PF_HINT T1), not L1: on a 2-vCPU AMD EPYC Zen 4 (family 25 model 17, 1 MB L2
 * per core) a PREFETCHT0 holds an L1 miss buffer per line until it lands and the tile's own loads queue
 * behind them, as decode attention found (cpu_attention.c prefetch_lines). A decode step's four projections
 * over 30 layers' distinct weights plus the lm_head's argmax (270 MB of bf16, cold as in a model step;
 * builds interleaved in one process, best of 5 rounds, ms per step at 1 / 8 / 32 / 64 rows): T0 14.8 / 16.4 /
 * 29.0 / 48.5 -> T1 10.2 / 9.5 / 23.8 / 43.4; T1 4 KB or 16 KB ahead and T2 within noise of it, NTA as T0.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"
#include "amx_tile.h" /* round_rows (x to bf16 rows) and the bf16 target; no tile instruction is used here */

#if defined(PAGEDQ_AVX512)

#define DP_MR 12 /* rows per register tile: 24 accumulators + 2 weight vectors + a broadcast of 32 zmm */
#ifndef MB
#define MB 256 /* rows of x per pass over the column blocks (MB x K bf16: 768 KB at K=1536, in L2) */
#endif
#ifndef DP_PF
#define DP_PF 4096 /* weight elements to prefetch ahead: 8 KB, four K chunks (measured above) */
#endif
/* gemm_int8_dp widens an int8 weight in registers, tile by tile (dp_tile with a dp_q8_block), up to these rows,
 * and into a per-thread buffer read by every row tile above them (measured at gemm_int8_dp). */
#ifndef FUSED_INT8_ROWS
#define FUSED_INT8_ROWS 128 /* per channel: six vector ops per 32 weights (widen_row) */
#endif
#ifndef FUSED_GROUPED_ROWS
#define FUSED_GROUPED_ROWS 24 /* group-wise: six more (scale, offset, rounding to bf16, pairing) */
#endif
#ifndef DP_PF_HINT
#define DP_PF_HINT _MM_HINT_T1 /* into L2 (measured above) */
#endif

/* One thread's running argmax over the columns it has multiplied so far (gemm_bf16_dp_argmax), per row:
 * per lane the largest value and its column (16 lanes; a strict > keeps a lane's first), and the first NaN's
 * column (-1: none yet). */
typedef struct {
    float *best;     /* [m][16] */
    int32_t *col;    /* [m][16] */
    int64_t *nan_at; /* [m] */
} dp_argmax;

#ifndef SCREEN_CAP
#define SCREEN_CAP 128 /* candidates kept per row per thread before its row is left to every column */
#endif

/* One thread's part of a certified screen (gemm_bf16_dp_screen_argmax), per row: the bound's two per-row
 * factors, the largest lower bound a - e seen so far per lane and over the lanes (the floor), and the columns
 * whose upper bound a + e reached the floor when they were seen (a count of -1: the row overflowed). */
typedef struct {
    const float *row_norm;      /* [blocks * 32]: ||w_v||, rounded up; 0 past n */
    const float *rounding_norm; /* [blocks * 32]: ||bf16(w_v) - w_v||, rounded up; 0 past n */
    const float *scale;         /* [m][2]: the row's factors of row_norm and rounding_norm in e */
    float *floor_lanes;         /* [m][16] */
    float *floor;               /* [m] */
    int32_t *cand_col;          /* [m][cap] */
    float *cand_hi;             /* [m][cap] */
    int32_t *count;             /* [m] */
    int32_t cap;                /* candidates kept per row (the lists' stride): SCREEN_CAP or INT8_SCREEN_CAP */
} dp_screen;

/* Keeps the columns col + l (l in `keep`) of row i with their upper bounds; when the row's list is full, the
 * entries the floor has passed go first, and a list still full marks the row overflowed. */
static void screen_push(dp_screen *sc, int64_t i, __m512 hi, __mmask16 keep, int64_t col)
{
    float his[16];
    _mm512_storeu_ps(his, hi);
    int32_t *cols = sc->cand_col + i * sc->cap;
    float *highs = sc->cand_hi + i * sc->cap;
    const float bar = sc->floor[i];
    int32_t n = sc->count[i];
    while (keep) {
        const int l = __builtin_ctz(keep);
        keep &= keep - 1;
        if (n == sc->cap) {
            int32_t kept = 0;
            for (int32_t j = 0; j < n; j++)
                if (highs[j] >= bar) { cols[kept] = cols[j]; highs[kept] = highs[j]; kept++; }
            n = kept;
            if (n == sc->cap) { sc->count[i] = -1; return; }
        }
        cols[n] = (int32_t)(col + l);
        highs[n] = his[l];
        n++;
    }
    sc->count[i] = n;
}

/* The screen's epilogue over a tile's rows x 32 approximate logits a (ncols valid): e = row_norm * S +
 * rounding_norm * T bounds |a - exact| per column; the floor rises to the largest a - e, and a column whose
 * a + e reaches it is kept. A column left out has a + e below some other column's a - e, so its exact value is
 * below that column's: it cannot be the argmax. */
static inline __attribute__((always_inline)) void screen_epilogue(const __m512 *acc0, const __m512 *acc1, int rows,
                                                                  int ncols, dp_screen *sc, int64_t row0, int64_t col)
{
    const __mmask16 m0 = lanes16(ncols), m1 = lanes16(ncols > 16 ? ncols - 16 : 0);
    const __m512 nw0 = _mm512_loadu_ps(sc->row_norm + col), nw1 = _mm512_loadu_ps(sc->row_norm + col + 16);
    const __m512 nd0 = _mm512_loadu_ps(sc->rounding_norm + col), nd1 = _mm512_loadu_ps(sc->rounding_norm + col + 16);
    const __m512 tiny = _mm512_set1_ps(0x1p-100f); /* flushed denormals (DAZ/FTZ in VDPBF16PS) */
    for (int r = 0; r < DP_MR; r++) {
        if (r >= rows) break;
        const int64_t i = row0 + r;
        if (sc->count[i] < 0) continue;
        const __m512 s = _mm512_set1_ps(sc->scale[2 * i]), t = _mm512_set1_ps(sc->scale[2 * i + 1]);
        const __m512 e0 = _mm512_fmadd_ps(nw0, s, _mm512_fmadd_ps(nd0, t, tiny));
        const __m512 e1 = _mm512_fmadd_ps(nw1, s, _mm512_fmadd_ps(nd1, t, tiny));
        __m512 lanes = _mm512_loadu_ps(sc->floor_lanes + i * 16);
        lanes = _mm512_mask_max_ps(lanes, m0, lanes, _mm512_sub_ps(acc0[r], e0));
        lanes = _mm512_mask_max_ps(lanes, m1, lanes, _mm512_sub_ps(acc1[r], e1));
        _mm512_storeu_ps(sc->floor_lanes + i * 16, lanes);
        const float bar = _mm512_reduce_max_ps(lanes);
        sc->floor[i] = bar;
        const __m512 f = _mm512_set1_ps(bar), hi0 = _mm512_add_ps(acc0[r], e0), hi1 = _mm512_add_ps(acc1[r], e1);
        const __mmask16 k0 = _mm512_mask_cmp_ps_mask(m0, hi0, f, _CMP_GE_OQ);
        const __mmask16 k1 = _mm512_mask_cmp_ps_mask(m1, hi1, f, _CMP_GE_OQ);
        if (k0) screen_push(sc, i, hi0, k0, col);
        if (k1 && sc->count[i] >= 0) screen_push(sc, i, hi1, k1, col + 16);
    }
}

/* Whether the products run on fp32 FMAs rather than VDPBF16PS (bf16_dp_use_fma): set by Python once, from the
 * probe's timing of the two (pagedq_kernels/cpu_linear.py _dp_lib), before any call. */
static int dp_products_on_fma = 0;

/* Sets where the products run (nonzero: fp32 FMAs) and returns the previous setting. The same floats either way
 * (dp_tile): only the speed differs. */
int bf16_dp_use_fma(int on)
{
    const int was = dp_products_on_fma;
    dp_products_on_fma = on != 0;
    return was;
}

/* Room for x's rounded rows widened to fp32 where the products run on FMAs, else NULL (and NULL where memory
 * could not be had: VDPBF16PS then runs, the same floats). */
static float *fma_rows(int64_t m, int64_t k)
{
    return dp_products_on_fma && m > 0 ? (float *)malloc(sizeof(float) * m * k) : NULL;
}

/* xw [m, k] = the bf16 rows x [m, k] widened to fp32 (exactly: a bf16 is an fp32's upper half); a barrier at
 * the end (every row ready). */
static void widen_rows(const uint16_t *x, float *xw, int64_t m, int64_t k)
{
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i += 16) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(x + r * k + i));
            _mm512_storeu_si512((void *)(xw + r * k + i), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        }
}

/* k-pair p of a 32-deep chunk of a column block: its two 64-byte weight rows (columns 0-15, 16-31), the weight
 * DP_PF elements ahead prefetched meanwhile (measured in the header). */
static inline __attribute__((always_inline)) void kpair_weights(const uint16_t *chunk, int p, __m512i *w0, __m512i *w1)
{
    if (DP_PF) {
        _mm_prefetch((const char *)(chunk + DP_PF + p * 32), DP_PF_HINT);
        _mm_prefetch((const char *)(chunk + DP_PF + 512 + p * 32), DP_PF_HINT);
    }
    *w0 = _mm512_loadu_si512((const void *)(chunk + p * 32));
    *w1 = _mm512_loadu_si512((const void *)(chunk + 512 + p * 32));
}

/* An int8 column block that dp_tile widens in registers (gemm_int8_dp up to FUSED_INT8_ROWS or FUSED_GROUPED_ROWS
 * rows): the block's values in cpu_int8_amx.c's packing and, group-wise, its scales and offsets ([k / group][32]);
 * NULL in dp_tile for a bf16 weight, or a widened buffer. */
typedef struct {
    const int8_t *values;
    const float *scales;  /* group-wise only (per-channel scales go to the epilogue) */
    const float *offsets; /* NULL: none */
    int64_t group;        /* == k without offsets: per channel, widened exactly */
} dp_q8_block;

/* One packed int8 row (16 columns' first k of a pair, then their second) as VDPBF16PS's weight operand: lane j
 * = (first_j, second_j) in bf16. Per channel exactly (widen_block's sequence); group-wise scale * q (+ offset),
 * each rounded to fp32 (the _round_ forms: no contraction into an FMA, which would round once instead of twice),
 * then rounded to nearest-even bf16 (one vcvtne2ps2bf16 and a word permute that pairs its two halves): what
 * Int8Weight.dequantize() gives, rounded to bf16. Also widen_block_dequantised's row, for the buffer. */
static inline __attribute__((always_inline)) __m512i widen_row(const int8_t *q, int grouped, __m512 s, __m512 o,
                                                               int offsets)
{
    const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    if (!grouped) /* 0xCA: high ? second : first >> 16, bit by bit (exact: |q| <= 128 fits bf16) */
        return _mm512_ternarylogic_epi32(_mm512_set1_epi32((int)0xFFFF0000u), _mm512_castps_si512(second),
                                         _mm512_srli_epi32(_mm512_castps_si512(first), 16), 0xCA);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 a = _mm512_mul_round_ps(first, s, rn), b = _mm512_mul_round_ps(second, s, rn);
    if (offsets) {
        a = _mm512_add_round_ps(a, o, rn);
        b = _mm512_add_round_ps(b, o, rn);
    }
    /* cvtne2ps: a's 16 bf16 in words 0-15, b's in 16-31; the permute interleaves them as pairs */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* rows x 32 outputs of one column block: acc = x rows (bf16, stride k) @ the block's weight, times the block's 32
 * per-column scales where given (an int8 weight widened: gemm_int8_dp), then + bias, or with glu silu(columns
 * 0-15) * columns 16-31 (16 outputs), ncols of them valid. With `am` (column `col`, first row `row0`), nothing is
 * stored: the rows' running argmax takes the block's ncols values instead. */
static inline __attribute__((always_inline)) void dp_tile(int rows, const uint16_t *x, const float *xw, int64_t k,
                                                          const uint16_t *panel, const dp_q8_block *q8,
                                                          const float *scale,
                                                          const float *bias, float *y, int64_t ldy, int ncols, int glu,
                                                          dp_argmax *am, dp_screen *sc, int64_t row0, int64_t col)
{
    __m512 c0a = _mm512_setzero_ps(), c1a = c0a, c2a = c0a, c3a = c0a, c4a = c0a, c5a = c0a;
    __m512 c6a = c0a, c7a = c0a, c8a = c0a, c9a = c0a, c10a = c0a, c11a = c0a;
    __m512 c0b = c0a, c1b = c0a, c2b = c0a, c3b = c0a, c4b = c0a, c5b = c0a;
    __m512 c6b = c0a, c7b = c0a, c8b = c0a, c9b = c0a, c10b = c0a, c11b = c0a;
    /* x rows as 32-bit k-pairs */
    const int32_t *x0 = (const int32_t *)x, *x1 = (const int32_t *)(x + k), *x2 = (const int32_t *)(x + 2 * k),
                  *x3 = (const int32_t *)(x + 3 * k), *x4 = (const int32_t *)(x + 4 * k),
                  *x5 = (const int32_t *)(x + 5 * k), *x6 = (const int32_t *)(x + 6 * k),
                  *x7 = (const int32_t *)(x + 7 * k), *x8 = (const int32_t *)(x + 8 * k),
                  *x9 = (const int32_t *)(x + 9 * k), *x10 = (const int32_t *)(x + 10 * k),
                  *x11 = (const int32_t *)(x + 11 * k);
#define ROW(r)                                                            \
    if (rows > r) {                                                       \
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(x##r[kp]);        \
        c##r##a = _mm512_dpbf16_ps(c##r##a, xb, w0);                      \
        c##r##b = _mm512_dpbf16_ps(c##r##b, xb, w1);                      \
    }
    if (!xw && !q8) {
        for (int64_t kc = 0; kc < k; kc += 32) {
            const uint16_t *chunk = panel + kc * 32;
            for (int p = 0; p < 16; p++) {
                const int64_t kp = kc / 2 + p;
                __m512i raw0, raw1;
                kpair_weights(chunk, p, &raw0, &raw1);
                const __m512bh w0 = (__m512bh)raw0, w1 = (__m512bh)raw1;
                ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
            }
        }
    }
    /* An int8 block widened in registers, k-pair by k-pair (dp_q8_block): the same operands as the widened
       buffer's, at half the bytes streamed and without the buffer's store and reload. The prefetch runs the
       same chunks ahead (a chunk is 1 KB of int8: one line per two k-pairs). */
    if (!xw && q8) {
        const int offsets = q8->offsets != NULL, grouped = q8->group != k || offsets; /* dp_blocks' per_channel */
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, o0 = s0, o1 = s0;
        for (int64_t kc = 0; kc < k; kc += 32) {
            const int8_t *chunk = q8->values + kc * 32;
            if (grouped && kc % q8->group == 0) {
                const int64_t g = kc / q8->group;
                s0 = _mm512_loadu_ps(q8->scales + g * 32), s1 = _mm512_loadu_ps(q8->scales + g * 32 + 16);
                if (offsets)
                    o0 = _mm512_loadu_ps(q8->offsets + g * 32), o1 = _mm512_loadu_ps(q8->offsets + g * 32 + 16);
            }
            for (int p = 0; p < 16; p++) {
                const int64_t kp = kc / 2 + p;
                if (DP_PF && !(p & 1)) {
                    _mm_prefetch((const char *)(chunk + DP_PF + p * 32), DP_PF_HINT);
                    _mm_prefetch((const char *)(chunk + DP_PF + 512 + p * 32), DP_PF_HINT);
                }
                const __m512bh w0 = (__m512bh)widen_row(chunk + p * 32, grouped, s0, o0, offsets);
                const __m512bh w1 = (__m512bh)widen_row(chunk + 512 + p * 32, grouped, s1, o1, offsets);
                ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
            }
        }
    }
#undef ROW
    /* The same sums on fp32 FMAs (dp_products_on_fma): a k-pair's weights widened in registers (the high bf16 of
       a lane, k odd, is its bits masked; the low one, k even, shifted up), x's rounded rows already widened (xw,
       stride k), and per lane the odd product added first, then the even one, as VDPBF16PS does. */
#define ROW(r)                                                                \
    if (rows > r) {                                                           \
        const __m512 xo = _mm512_set1_ps(xw##r[2 * kp + 1]);                  \
        const __m512 xe = _mm512_set1_ps(xw##r[2 * kp]);                      \
        c##r##a = _mm512_fmadd_ps(xe, w0e, _mm512_fmadd_ps(xo, w0o, c##r##a)); \
        c##r##b = _mm512_fmadd_ps(xe, w1e, _mm512_fmadd_ps(xo, w1o, c##r##b)); \
    }
    if (xw) {
        const float *xw0 = xw, *xw1 = xw + k, *xw2 = xw + 2 * k, *xw3 = xw + 3 * k, *xw4 = xw + 4 * k,
                    *xw5 = xw + 5 * k, *xw6 = xw + 6 * k, *xw7 = xw + 7 * k, *xw8 = xw + 8 * k,
                    *xw9 = xw + 9 * k, *xw10 = xw + 10 * k, *xw11 = xw + 11 * k;
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int64_t kc = 0; kc < k; kc += 32) {
            const uint16_t *chunk = panel + kc * 32;
            for (int p = 0; p < 16; p++) {
                const int64_t kp = kc / 2 + p;
                __m512i w0, w1;
                kpair_weights(chunk, p, &w0, &w1);
                const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
                const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
                const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
                const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
                ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
            }
        }
    }
#undef ROW
    __m512 acc0[DP_MR] = {c0a, c1a, c2a, c3a, c4a, c5a, c6a, c7a, c8a, c9a, c10a, c11a};
    __m512 acc1[DP_MR] = {c0b, c1b, c2b, c3b, c4b, c5b, c6b, c7b, c8b, c9b, c10b, c11b};
    if (scale) { /* w = scale * q: the scale factors out of the K sum */
        const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
        for (int r = 0; r < DP_MR; r++) {
            if (r >= rows) break;
            acc0[r] = _mm512_mul_ps(acc0[r], s0);
            acc1[r] = _mm512_mul_ps(acc1[r], s1);
        }
    }
    if (sc) {
        screen_epilogue(acc0, acc1, rows, ncols, sc, row0, col);
        return;
    }
    if (am) { /* lane l sees columns col + l, then col + 16 + l: in order, so a strict > keeps its first */
        const __mmask16 m0 = lanes16(ncols), m1 = lanes16(ncols > 16 ? ncols - 16 : 0);
        const __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32((int)col),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        const __m512i c1 = _mm512_add_epi32(c0, _mm512_set1_epi32(16));
        for (int r = 0; r < DP_MR; r++) {
            if (r >= rows) break;
            float *bp = am->best + (row0 + r) * 16;
            int32_t *cp = am->col + (row0 + r) * 16;
            __m512 best = _mm512_loadu_ps(bp);
            __m512i at = _mm512_loadu_si512((const void *)cp);
            __mmask16 gt = _mm512_mask_cmp_ps_mask(m0, acc0[r], best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, acc0[r]);
            at = _mm512_mask_mov_epi32(at, gt, c0);
            gt = _mm512_mask_cmp_ps_mask(m1, acc1[r], best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, acc1[r]);
            at = _mm512_mask_mov_epi32(at, gt, c1);
            _mm512_storeu_ps(bp, best);
            _mm512_storeu_si512((void *)cp, at);
            const __mmask16 n0 = _mm512_mask_cmp_ps_mask(m0, acc0[r], acc0[r], _CMP_UNORD_Q);
            const __mmask16 n1 = _mm512_mask_cmp_ps_mask(m1, acc1[r], acc1[r], _CMP_UNORD_Q);
            if ((n0 | n1) && am->nan_at[row0 + r] < 0)
                am->nan_at[row0 + r] = col + (n0 ? __builtin_ctz(n0) : 16 + __builtin_ctz(n1));
        }
        return;
    }
    if (glu) {
        const __mmask16 mask = lanes16(ncols);
        const __m512 one = _mm512_set1_ps(1.f);
        for (int r = 0; r < DP_MR; r++) {
            if (r >= rows) break;
            const __m512 g = acc0[r];
            const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_mul_ps(_mm512_mul_ps(g, sig), acc1[r]));
        }
        return;
    }
    const __mmask16 m0 = lanes16(ncols), m1 = lanes16(ncols > 16 ? ncols - 16 : 0);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < DP_MR; r++) {
        if (r >= rows) break;
        _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(acc0[r], b0));
        if (m1)
            _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_add_ps(acc1[r], b1));
    }
}

/* dp_tile, one inlined copy per row count: constant counts keep every accumulator in a register. */
static inline void dp_tile_rows(int rows, const uint16_t *x, const float *xw, int64_t k, const uint16_t *panel,
                                const dp_q8_block *q8, const float *scale, const float *bias, float *y, int64_t ldy,
                                int ncols, int glu, dp_argmax *am, dp_screen *sc, int64_t row0, int64_t col)
{
#define DP_CASE(n) case n: dp_tile(n, x, xw, k, panel, q8, scale, bias, y, ldy, ncols, glu, am, sc, row0, col); break;
    switch (rows) {
    DP_CASE(12) DP_CASE(11) DP_CASE(10) DP_CASE(9) DP_CASE(8) DP_CASE(7)
    DP_CASE(6) DP_CASE(5) DP_CASE(4) DP_CASE(3) DP_CASE(2)
    default: dp_tile(1, x, xw, k, panel, q8, scale, bias, y, ldy, ncols, glu, am, sc, row0, col); break;
    }
#undef DP_CASE
}

/* An int8 weight in cpu_int8_amx.c's packing (per column block K x 32 int8), multiplied here: each block widened
 * into `wide` (this thread's K x 32 bf16) once per MB-row pass, then the tiles read it. Per-channel (group == k,
 * no offsets): scales [blocks][32], q widened exactly and the scale applied to the sums (dp_tile). Group-wise
 * (GGUF's formats: a group a multiple of 32, k / group groups): scales and offsets [blocks][k / group][32], each
 * weight dequantised as Int8Weight.dequantize() does it (scale * q, then + offset, each rounded to fp32) and
 * rounded to bf16 (widen_block_dequantised): a bf16 weight, what the bf16 model of the dequantised checkpoint
 * multiplies. */
typedef struct {
    const int8_t *values;
    const float *scales;
    const float *offsets; /* NULL: none */
    int64_t group;
    uint16_t *wide;
} dp_int8;

/* A column block's group-wise int8 weight (K x 32, the AMX int8 packing: per 32-deep chunk two tiles of 16 rows,
 * each row the 16 columns' first k of the pair, then their second) dequantised and rounded to bf16 into the
 * B-tile order, each 32-bit lane one column's k-pair: widen_row, row by row, with the group's scales and offsets. */
static void widen_block_dequantised(const int8_t *src, const float *scales, const float *offsets, int64_t group,
                                    uint16_t *dst, int64_t k)
{
    for (int64_t c = 0; c < k / 32; c++) {
        const int64_t g = c * 32 / group;
        for (int t = 0; t < 2; t++) {
            const __m512 s = _mm512_loadu_ps(scales + g * 32 + t * 16);
            const __m512 o = offsets ? _mm512_loadu_ps(offsets + g * 32 + t * 16) : _mm512_setzero_ps();
            for (int p = 0; p < 16; p++) {
                const int64_t row = (c * 2 + t) * 16 + p;
                _mm512_store_si512((__m512i *)(dst + row * 32), widen_row(src + row * 32, 1, s, o, offsets != NULL));
            }
        }
    }
}

/* The column blocks of this thread's static share, every MB-row pass of x over them (inside the caller's
 * parallel region, after round_rows): stored into y, or taken by the thread's running argmax `am`. The static
 * schedule hands each thread one contiguous range of blocks, the same in every pass, in thread order. `q8`: the
 * weight is int8 (w unused), else NULL. */
static void dp_blocks(const uint16_t *x, float *xw, int64_t m, const uint16_t *w, const dp_int8 *q8,
                      const float *bias, float *y, int64_t ldy, int64_t n, int64_t k, int glu, dp_argmax *am,
                      dp_screen *sc)
{
    const int64_t width = glu ? 16 : 32; /* outputs per column block */
    const int64_t blocks = (n + width - 1) / width;
    const int64_t block_elems = k * 32;
    const unsigned int csr = _mm_getcsr();
    if (xw) {
        widen_rows(x, xw, m, k); /* ends in a barrier */
        _mm_setcsr(csr | 0x8040); /* FTZ and DAZ: VDPBF16PS's own denormal rule, for the FMAs that stand in for it */
    }
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const int64_t m1 = m0 + MB < m ? m0 + MB : m;
        const int64_t tiles = (m1 - m0 + DP_MR - 1) / DP_MR;
        #pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t col = b * width;
            const int ncols = (int)(n - col < width ? n - col : width);
            const int per_channel = q8 && q8->group == k && !q8->offsets;
            const float *block_scales = q8 ? q8->scales + b * (k / q8->group) * 32 : NULL;
            const float *block_offsets = q8 && q8->offsets ? q8->offsets + b * (k / q8->group) * 32 : NULL;
            const dp_q8_block fused = {q8 ? q8->values + b * block_elems : NULL, block_scales, block_offsets,
                                       q8 ? q8->group : 0};
            const uint16_t *panel = q8 ? q8->wide : w + b * block_elems;
            if (q8 && !q8->wide) /* widened in registers by each row tile (gemm_int8_dp's FUSED_ limits) */
                panel = NULL;
            else if (per_channel)
                widen_block(fused.values, q8->wide, block_elems);
            else if (q8)
                widen_block_dequantised(fused.values, block_scales, block_offsets, q8->group, q8->wide, k);
            const float *scale = per_channel ? block_scales : NULL;
            const float *bp = bias && !glu ? bias + col : NULL;
            int64_t r0 = m0;
            for (int64_t t = tiles; t > 0; t--) { /* the rows left spread evenly over the tiles left */
                const int rows = (int)((m1 - r0 + t - 1) / t);
                dp_tile_rows(rows, x + r0 * k, xw ? xw + r0 * k : NULL, k, panel, panel ? NULL : &fused, scale, bp,
                             am || sc ? NULL : y + r0 * ldy + col, ldy, ncols, glu, am, sc, r0, col);
                r0 += rows;
            }
        }
    }
    _mm_setcsr(csr);
}

/* y [m, n] (row stride ldy) = x @ W^T + bias; x fp32 [m, k] (row stride ldx), k a multiple of 32; with glu
 * y [m, n] = silu(gate) * up and no bias. w: the packed bf16 weight (layout above). xb: room for x in bf16,
 * [m, k]: x is rounded here, inside the parallel region (a torch op in between would wake torch's own OpenMP
 * pool, whose spinning threads then compete with this one's). Returns 0. */
int gemm_bf16_dp(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, const float *bias,
                 float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    const int64_t blocks = (n + (glu ? 16 : 32) - 1) / (glu ? 16 : 32);
    float *xw = fma_rows(m, k);
    #pragma omp parallel num_threads(num_threads) if (blocks > 1)
    {
        round_rows(x_f32, ldx, x, m, m, k); /* ends in a barrier: every row ready */
        dp_blocks(x, xw, m, w, NULL, bias, y, ldy, n, k, glu, NULL, NULL);
    }
    free(xw);
    return 0;
}

/* gemm_bf16_dp for an int8 weight in cpu_int8_amx.c's packing (values int8 per column block of K x 32; dp_int8
 * above for the scales, offsets and group): where AMX does not run, the int8 weight of a model that multiplies in
 * bf16 (quantization="int8", or a GGUF, under dtype bf16 or auto) on these dot products. Up to FUSED_INT8_ROWS
 * rows (FUSED_GROUPED_ROWS for group-wise weights) each row tile widens the block's int8 in registers (widen_row),
 * k-pair by k-pair; above them each column block is widened into a thread's K x 32 bf16 buffer once per MB-row pass
 * and the tiles read it as they read a bf16 weight. The same operands either way (bit for bit: tests/test_int8_amx.py
 * crosses the boundary). Measured (2-vCPU KVM AMD EPYC Zen 5, family 26 model 2; 2 threads, 30 cold copies of each
 * weight, builds with the thresholds at 0 and at infinity interleaved in one process, best of 3, us per call,
 * buffer -> registers, through int8_linear.linear with the packed weight's dp_kernels swapped per build):
 *                      M:      1           8          24          64         128         256
 *   qkv  per channel    25.5 -> 18.4  28.8 -> 22.0  61.1 -> 41.7  116.8 -> 98.9  201 -> 187  371 -> 421
 *   qkv  Q4_1-like      38.7 -> 21.6  36.8 -> 30.4  80.0 -> 70.5  134.8 -> 168   227 -> 329  407 -> 635
 *   gate_up per channel 92.4 -> 45.5  119  -> 55.7  324  -> 238   366   -> 309   674 -> 607  1242 -> 1388
 *   gate_up Q4_1-like   133  -> 51.5  146  -> 78.2  239  -> 223   432   -> 566   708 -> 1064 1290 -> 2002
 *   down per channel    38.6 -> 24.3  52.9 -> 33.5  100  -> 65.6  193   -> 168   330 -> 311  588 -> 669
 *   down Q4_1-like      65.4 -> 29.6  59.5 -> 46.8  117  -> 106   209   -> 284   361 -> 482  588 -> 974
 * (M = 36: Q4_1-like already 5-10 % slower in registers). At decode sizes the buffer's store and reload, its
 * allocation per call and the per-block widening pass cost more than the widening itself; once many row tiles
 * share a block the buffer's one widening wins, sooner for group-wise weights, whose widening is dearer.
 * Per-channel: exactly (widen_block, amx_tile.h: every int8 is a bf16), the scale multiplying the fp32 sums before
 * bias or SiLU-and-mul: y = scale * sum_k bf16(x) q, what cpu_int8_amx.c computes on the tiles. Group-wise: the
 * dequantised weight rounded to bf16 (widen_block_dequantised). It replaced the fp32 kernel there (cpu_int8_gemm.c:
 * q widened to fp32, x kept fp32), whose FMAs ran compass below the fp32 model's speed on a Zen 5: int8 404-420 ->
 * 684 tok/s (bf16 675 in that run), the Q4_1 GGUF 418-460 -> see the README's run 52. Returns 0, or -1 if a buffer
 * could not be had, -3 for a group that is not a multiple of 32 dividing k. */
int gemm_int8_dp(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const int8_t *values, const float *scales,
                 const float *offsets, int64_t group, const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                 int glu, int num_threads)
{
    if (group <= 0 || group % 32 || k % group) return -3;
    const int64_t blocks = (n + (glu ? 16 : 32) - 1) / (glu ? 16 : 32);
    float *xw = fma_rows(m, k);
    const int grouped = group != k || offsets != NULL;
    const int fused = !xw && m <= (grouped ? FUSED_GROUPED_ROWS : FUSED_INT8_ROWS); /* registers, no buffer */
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (blocks > 1)
    {
        uint16_t *wide = fused ? NULL : (uint16_t *)aligned_alloc(64, (size_t)(k * 32) * sizeof(uint16_t));
        round_rows(x_f32, ldx, x, m, m, k); /* ends in a barrier: every row ready */
        if (!wide && !fused) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            const dp_int8 q8 = {values, scales, offsets, group, wide};
            dp_blocks(x, xw, m, NULL, &q8, bias, y, ldy, n, k, glu, NULL, NULL);
        }
        free(wide);
    }
    free(xw);
    return failed ? -1 : 0;
}

/* gemm_bf16_dp (not glu) followed, in the same parallel region, by the residual add and the RMSNorm after the
 * projection: y [m, n] = x @ W^T + bias + residual (the new residual stream), normed = norm_w * y / rms(y), row
 * by row as cpu_ops.c's rms_norm_f32 (add_rms_norm_row), the same floats. One call and one parallel region
 * instead of two (cpu_gemm.c gemm_panels_add_norm_f32 says why). Returns 0. */
int gemm_bf16_dp_add_norm(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, const float *bias,
                          float *y, int64_t n, int64_t k, const float *residual, const float *norm_w, float eps,
                          float *normed, int num_threads)
{
    float *xw = fma_rows(m, k);
    #pragma omp parallel num_threads(num_threads)
    {
        round_rows(x_f32, ldx, x, m, m, k); /* ends in a barrier: every row ready */
        dp_blocks(x, xw, m, w, NULL, bias, y, n, n, k, 0, NULL, NULL);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            add_rms_norm_row(y + i * n, residual + i * n, norm_w, normed + i * n, y + i * n, n, eps);
    }
    free(xw);
    return 0;
}

/* Per row of x @ W^T (no bias, not glu): its largest value into best[i] and the first column holding it into
 * idx[i], torch.max(dim=1)'s answer (a NaN anywhere is the maximum, at the first NaN), without writing the
 * product: the greedy sampler's argmax over the lm_head's logits (pagedq_kernels/cpu_linear.argmax_linear). The
 * logits of a decode step are rows x 49152 fp32 for SmolLM2 (12.6 MB at 64 rows, 113 MB for a speculative
 * step's 576), written by the matmul and read back by the argmax; here each thread keeps per row a running
 * maximum over the columns of its blocks (16 lanes, dp_tile's epilogue), and the threads' answers merge in
 * thread order (the static schedule's ranges ascend with the thread number, so on a tie the earlier thread's
 * column is the first). Returns 0, or -1 when scratch memory could not be had. */
int gemm_bf16_dp_argmax(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, int64_t n,
                        int64_t k, float *best, int64_t *idx, int num_threads)
{
    const int64_t blocks = (n + 31) / 32;
    const int teams = num_threads > 0 ? num_threads : 1;
    float *lane_best = (float *)malloc(sizeof(float) * teams * m * 16);
    int32_t *lane_col = (int32_t *)malloc(sizeof(int32_t) * teams * m * 16);
    int64_t *nan_at = (int64_t *)malloc(sizeof(int64_t) * teams * m);
    float *thread_best = (float *)malloc(sizeof(float) * teams * m);
    int64_t *thread_col = (int64_t *)malloc(sizeof(int64_t) * teams * m);
    float *xw = fma_rows(m, k);
    int status = lane_best && lane_col && nan_at && thread_best && thread_col ? 0 : -1;
    int used = 1;
    if (status == 0) {
        #pragma omp parallel num_threads(teams) if (blocks > 1)
        {
            const int t = omp_get_thread_num();
            #pragma omp single
            used = omp_get_num_threads();
            dp_argmax am = {lane_best + (int64_t)t * m * 16, lane_col + (int64_t)t * m * 16, nan_at + (int64_t)t * m};
            for (int64_t i = 0; i < m * 16; i++) { am.best[i] = -INFINITY; am.col[i] = 0; }
            for (int64_t i = 0; i < m; i++) am.nan_at[i] = -1;
            round_rows(x_f32, ldx, x, m, m, k); /* ends in a barrier: every row ready */
            dp_blocks(x, xw, m, w, NULL, NULL, NULL, 0, n, k, 0, &am, NULL);
            for (int64_t i = 0; i < m; i++) { /* this thread's 16 lanes -> its maximum and first column */
                float mx = am.best[i * 16];
                int64_t at = am.col[i * 16];
                for (int l = 1; l < 16; l++) {
                    const float v = am.best[i * 16 + l];
                    const int64_t c = am.col[i * 16 + l];
                    if (v > mx || (v == mx && c < at)) { mx = v; at = c; }
                }
                thread_best[(int64_t)t * m + i] = mx;
                thread_col[(int64_t)t * m + i] = at;
            }
        }
        for (int64_t i = 0; i < m; i++) { /* the threads in order: the first NaN, else a strict > */
            float mx = thread_best[i];
            int64_t at = thread_col[i], first_nan = -1;
            for (int t = 0; t < used; t++) {
                const int64_t nan_col = nan_at[(int64_t)t * m + i];
                if (nan_col >= 0 && (first_nan < 0 || nan_col < first_nan)) first_nan = nan_col;
                if (t && thread_best[(int64_t)t * m + i] > mx) { mx = thread_best[(int64_t)t * m + i]; at = thread_col[(int64_t)t * m + i]; }
            }
            best[i] = first_nan >= 0 ? NAN : mx;
            idx[i] = first_nan >= 0 ? first_nan : at;
        }
    }
    free(lane_best); free(lane_col); free(nan_at); free(thread_best); free(thread_col); free(xw);
    return status;
}

/* x [k] @ the fp32 panel of column `col` (pagedq_kernels/cpu_linear.py kind "panels": 16 columns per panel, k rows
 * of 16): the value the panel kernel (gemm_tile.h tile, tile_pair; either build) computes for it, since each lane's
 * sum runs the same chain of fused multiply-adds from zero in ascending k. */
static float panel_value(const float *x, const float *panels, int64_t k, int64_t col)
{
    const float *panel = panels + (col / 16) * k * 16;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(x[kk]), _mm512_loadu_ps(panel + kk * 16), acc);
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    return lanes[col % 16];
}

/* A screen's scratch for m rows and `teams` threads: the rows' bound factors (scale [m][2]) and each thread's
 * floors and candidate lists (cap per row). */
typedef struct {
    float *scale, *floor_lanes, *floors, *cand_hi;
    int32_t *cand_col, *count;
    int32_t cap;
} screen_scratch;

static void screen_scratch_free(screen_scratch *sc)
{
    free(sc->scale); free(sc->floor_lanes); free(sc->floors); free(sc->cand_col); free(sc->cand_hi); free(sc->count);
}

/* 0, or -1 (nothing held) when memory could not be had. */
static int screen_scratch_alloc(screen_scratch *sc, int teams, int64_t m, int32_t cap)
{
    sc->cap = cap;
    sc->scale = (float *)malloc(sizeof(float) * m * 2);
    sc->floor_lanes = (float *)malloc(sizeof(float) * teams * m * 16);
    sc->floors = (float *)malloc(sizeof(float) * teams * m);
    sc->cand_col = (int32_t *)malloc(sizeof(int32_t) * teams * m * cap);
    sc->cand_hi = (float *)malloc(sizeof(float) * teams * m * cap);
    sc->count = (int32_t *)malloc(sizeof(int32_t) * teams * m);
    if (sc->scale && sc->floor_lanes && sc->floors && sc->cand_col && sc->cand_hi && sc->count) return 0;
    screen_scratch_free(sc);
    return -1;
}

/* Thread t's screen over the scratch, its floors at -inf and its lists empty (a row whose scale is NaN, which
 * the screen cannot narrow, marked overflowed from the start). After every row's scale is set. */
static dp_screen screen_start(const screen_scratch *s, const float *row_norm, const float *rounding_norm, int t,
                              int64_t m)
{
    dp_screen sc = {row_norm, rounding_norm, s->scale, s->floor_lanes + (int64_t)t * m * 16, s->floors + (int64_t)t * m,
                    s->cand_col + (int64_t)t * m * s->cap, s->cand_hi + (int64_t)t * m * s->cap,
                    s->count + (int64_t)t * m, s->cap};
    for (int64_t i = 0; i < m; i++) {
        for (int l = 0; l < 16; l++) sc.floor_lanes[i * 16 + l] = -INFINITY;
        sc.floor[i] = -INFINITY;
        sc.count[i] = s->scale[2 * i] == s->scale[2 * i] ? 0 : -1;
    }
    return sc;
}

/* Settles each row from the `used` threads' candidate lists (a worksharing loop: inside the parallel region,
 * after a barrier): the candidates whose upper bound reaches the highest floor, each valued as the panel kernel
 * values it (panel_value), the largest winning, the first column on a tie. A row some thread overflowed gets
 * best NAN and idx -1 (every column, by the caller). Adds the columns valued and the rows left into *settled and
 * *full_rows (atomically). */
static void screen_settle(const screen_scratch *s, int used, const float *x_f32, int64_t ldx, int64_t m, int64_t k,
                          const float *exact_panels, float *best, int64_t *idx, int64_t *settled, int64_t *full_rows)
{
    int64_t valued = 0, left = 0;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x_f32 + i * ldx;
        float lo = -INFINITY, mx = -INFINITY;
        int64_t at = -1;
        int full = 0;
        for (int t = 0; t < used; t++) {
            full |= s->count[(int64_t)t * m + i] < 0;
            if (s->floors[(int64_t)t * m + i] > lo) lo = s->floors[(int64_t)t * m + i];
        }
        for (int t = 0; t < used && !full; t++) {
            const int32_t *cols = s->cand_col + ((int64_t)t * m + i) * s->cap;
            const float *highs = s->cand_hi + ((int64_t)t * m + i) * s->cap;
            for (int32_t j = 0; j < s->count[(int64_t)t * m + i]; j++) {
                if (!(highs[j] >= lo)) continue;
                const float v = panel_value(xr, exact_panels, k, cols[j]);
                valued++;
                if (v > mx || (v == mx && cols[j] < at)) { mx = v; at = cols[j]; }
            }
        }
        if (full || at < 0) { /* at < 0 cannot happen: the floor's own column reaches it */
            best[i] = NAN;
            idx[i] = -1;
            left++;
        } else {
            best[i] = mx;
            idx[i] = at;
        }
    }
    #pragma omp atomic
    *settled += valued;
    #pragma omp atomic
    *full_rows += left;
}

/* Per row of x @ W^T, W fp32 (no bias): gemm_panels_argmax_f32's answer, bit for bit (the same largest value,
 * the first column holding it, NaN first), from a bf16 screen and an fp32 settling: the greedy sampler's argmax
 * over an fp32 lm_head (pagedq_kernels/argmax_screen.py), at about half the fp32 kernel's time.
 *
 * Screen: x rounded to bf16 times the bf16-rounded weight `w` (this file's layout) gives a per column. Its
 * distance from the panel kernel's fp32 value r is bounded, per row and column, by
 *   |a - r| <= g (|w~| |x~| + |w| |x|) + |w~ - w| |x~| + |w| |x~ - x|   (Cauchy-Schwarz; ~: rounded to bf16)
 * where g bounds the relative error of a k-term fp32 sum (both kernels' sums). With |w~| <= |w| + |w~ - w|
 * that is e = row_norm * S + rounding_norm * T, the per-column norms given (rounded up), S and T per row
 * (computed here in double, from the rounded row itself, inflated for fp32 rounding of a, e and a +- e).
 * The exact argmax v* has r_v* >= r_u for every u, so a_v* + e_v* >= a_u - e_u: it is among the columns
 * whose a + e reaches the largest a - e, the floor (screen_epilogue). On SmolLM2's lm_head and compass
 * prompts that leaves 1 column at the median, 17 at the 99th percentile, 38 at most.
 * Settle: each kept column's value is the panel kernel's own (panel_value, from the fp32 panels
 * `exact_panels`), and the largest wins, the first column on a tie; so the answer is the panel kernel's.
 * A row whose norms are not finite or so large that a sum could overflow (|x| |w| > 1e30: then NaN or
 * infinity may arise), or whose candidates overflow SCREEN_CAP, is left to gemm_panels_argmax_f32 over every
 * column: idx[i] = -1 marks it (the caller runs those rows there).
 *
 * counts[0] += columns settled from the screen, counts[1] += rows left unsettled. Returns 0, or -1 when
 * scratch memory could not be had. */
int gemm_bf16_dp_screen_argmax(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w,
                               const float *exact_panels, const float *row_norm, const float *rounding_norm,
                               float max_row_norm, int64_t n, int64_t k, float *best, int64_t *idx, int64_t *counts,
                               int num_threads)
{
    const int64_t blocks = (n + 31) / 32;
    const int teams = num_threads > 0 ? num_threads : 1;
    screen_scratch scr;
    if (screen_scratch_alloc(&scr, teams, m, SCREEN_CAP) != 0) return -1;
    float *xw = fma_rows(m, k);
    /* g: k terms, twice fp32's unit roundoff (margin for the dot product's two adds per instruction) */
    const double u = 0x1p-23 * (double)(k + 2), g = u / (1.0 - u), rho = 0x1p-20, inflate = 1.0 + 0x1p-16;
    int64_t settled = 0, full_rows = 0;
    #pragma omp parallel num_threads(teams) if (blocks > 1)
    {
        const int t = omp_get_thread_num(), used = omp_get_num_threads();
        round_rows(x_f32, ldx, x, m, m, k); /* ends in a barrier: every row ready */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            const float *xr = x_f32 + i * ldx;
            const uint16_t *xt = x + i * k;
            double nx = 0, nt = 0, nd = 0;
            for (int64_t kk = 0; kk < k; kk++) {
                union { uint32_t bits; float value; } rounded = {(uint32_t)xt[kk] << 16};
                const double a = xr[kk], b = rounded.value;
                nx += a * a, nt += b * b, nd += (b - a) * (b - a);
            }
            nx = sqrt(nx), nt = sqrt(nt), nd = sqrt(nd);
            const double s = (g * (nt + nx) + nd + rho * nt) * inflate, tt = (g * nt + nt + rho * nt) * inflate;
            const int narrow = isfinite(nx) && isfinite(nt) && nx * (double)max_row_norm <= 1e30 &&
                               nt * (double)max_row_norm <= 1e30;
            scr.scale[2 * i] = narrow ? (float)(s * (1.0 + 0x1p-20)) : NAN; /* rounded up */
            scr.scale[2 * i + 1] = narrow ? (float)(tt * (1.0 + 0x1p-20)) : NAN;
        } /* a barrier: every row's scale ready */
        dp_screen sc = screen_start(&scr, row_norm, rounding_norm, t, m);
        dp_blocks(x, xw, m, w, NULL, NULL, NULL, 0, n, k, 0, NULL, &sc);
        #pragma omp barrier
        screen_settle(&scr, used, x_f32, ldx, m, k, exact_panels, best, idx, &settled, &full_rows);
    }
    counts[0] += settled;
    counts[1] += full_rows;
    screen_scratch_free(&scr);
    free(xw);
    return 0;
}

/* ---- The int8 screen (gemm_int8_screen_argmax): gemm_bf16_dp_screen_argmax's answer with its screen on
 * AVX512-VNNI (VPDPBUSD, 4 products of u8 x s8 per 32-bit lane), which every CPU with AVX512-bf16 also has.
 *
 * Why: where VDPBF16PS runs at half the FMAs' rate (Intel Xeon family 6 model 207) the bf16 screen's products run
 * on the FMAs, and the lm_head's argmax stays near the fp32 panels' time at decode batch sizes (36 rows: 7.9 ms
 * against 8.6; 2.2 s of compass fp32's 35 s). VPDPBUSD there retires 4.7 G instructions a second per core, 64
 * products each, 3.7x the FMAs' products; and the int8 weight is a quarter of the fp32 one's bytes.
 *
 * Screen: per column v, w~_v = sw_v q_v (q_v int8, sw_v = max|w_v| / 127, packed in Python). Per step, NOUT
 * channels (columns of x) are "outliers" (pick_outliers: a hidden state's few massive activations, ~19x its rms at
 * the median on SmolLM2, and each row's own largest): they stay fp32, multiplied by the fp32 panels' rows; the rest
 * R of each row i is rounded to int8, x~_R = sx_i p (sx_i = max_R |x_i| / 127). Then
 *   a = fl(sx sw_v) S + sum_{k in O} x_k w_vk   (S = sum_R p_k q_vk, exact in int32 and in fp32: |S| < 2^24)
 * and |a - r_v| <= ||w_v|| S_i + ||w~_v - w_v|| T_i, r_v the panel kernel's value, with
 *   S_i = (g + rho) ||x~_R|| + ||x~_R - x_R|| + g ||x_O|| + g ||x||,  T_i = (g + rho) ||x~_R|| + ||x~_R - x_R|| + ||x_R||
 * (Cauchy-Schwarz on x~_R w~_v - x_R w_v = (x~_R - x_R) w~_v + x_R (w~_v - w_v), ||w~_v|| <= ||w_v|| + ||w~_v -
 * w_v||; g: fp32 sums of k terms, rho: the two roundings of fl(sx sw_v) S), the same form as the bf16 screen's,
 * so its epilogue, candidate lists and settling serve unchanged (the lists longer: INT8_SCREEN_CAP). On SmolLM2's
 * lm_head and 110 decode rows of compass prompts, columns left to settle per row, median / p90 / max, from the
 * bound in float64: per-row int8 without outliers 35300 / 49075 / 49152 (useless: one channel 19x the rms sets
 * the step), x in int8 groups of 16 instead 6 / 843 / 4257, 16 outliers 2 / 239 / 1492, 32 outliers 2 / 80 / 625;
 * in this kernel, 36 rows a step, 495 columns in all, no row left to every column (SCREEN_CAP's 128 left 12: the
 * lists fill before the floor rises).
 * VPDPBUSD multiplies unsigned by signed bytes: x's rows go in as p + 128 and the packing's 128 sum_k q_vk
 * (colsum128) comes off the int32 sums.
 *
 * Measured (that Xeon, 2 threads, SmolLM2's head evicted from the caches before each call, 110 real decode rows
 * cycled, best of 7 interleaved, every answer checked against the panels', ms int8 / bf16 screen / fp32 panels):
 *   1 row 1.74 / 2.37 / 3.93; 8: 2.69 / 3.10 / 5.57; 16: 3.70 / 5.60 / 7.38; 36: 5.57 / 9.78 / 11.34;
 *   64: 8.06 / 15.87 / 17.91.
 * Of the 36-row time, ~1.4 ms is the outliers' fp32 rows: scattered lines of the fp32 panels (64 per block), each
 * a miss; the first row tile of a block prefetches the next block's (5.54 -> 5.12 ms). NOUT 16: 4.36 ms, but
 * more rows then overflow their lists. gcc 12 copied each VPDPBUSD accumulator through the stack every step
 * (7.1 ms at 36 rows): the instruction is inline asm. */
#ifndef INT8_SCREEN_CAP
#define INT8_SCREEN_CAP 512 /* SCREEN_CAP for the int8 screen, whose bound is looser */
#endif
#ifndef NOUT
#define NOUT 32 /* outlier channels kept fp32 per step (measured above) */
#endif
#pragma GCC push_options
#pragma GCC target("avx512vnni")

/* rows x 32 columns of one column block: the int32 sums of x's u8 rows (stride k) with the block's int8 weight
 * (per k-quad two 64-byte rows: columns 0-15, then 16-31, each lane 4 k), scaled to fp32, plus the outlier
 * channels' fp32 products from the fp32 panels, then the screen's epilogue. */
static inline __attribute__((always_inline)) void i8_tile(int rows, const uint8_t *xq, int64_t k, const int8_t *block,
                                                          const float *sw, const int32_t *colsum128,
                                                          const float *sx, const float *x_f32, int64_t ldx,
                                                          const float *panels, const int32_t *outliers, int nout,
                                                          int ncols, dp_screen *sc, int64_t row0, int64_t col,
                                                          const float *ahead)
{
    __m512i c0a = _mm512_setzero_si512(), c1a = c0a, c2a = c0a, c3a = c0a, c4a = c0a, c5a = c0a;
    __m512i c6a = c0a, c7a = c0a, c8a = c0a, c9a = c0a, c10a = c0a, c11a = c0a;
    __m512i c0b = c0a, c1b = c0a, c2b = c0a, c3b = c0a, c4b = c0a, c5b = c0a;
    __m512i c6b = c0a, c7b = c0a, c8b = c0a, c9b = c0a, c10b = c0a, c11b = c0a;
    const int32_t *x0 = (const int32_t *)xq, *x1 = (const int32_t *)(xq + k), *x2 = (const int32_t *)(xq + 2 * k),
                  *x3 = (const int32_t *)(xq + 3 * k), *x4 = (const int32_t *)(xq + 4 * k),
                  *x5 = (const int32_t *)(xq + 5 * k), *x6 = (const int32_t *)(xq + 6 * k),
                  *x7 = (const int32_t *)(xq + 7 * k), *x8 = (const int32_t *)(xq + 8 * k),
                  *x9 = (const int32_t *)(xq + 9 * k), *x10 = (const int32_t *)(xq + 10 * k),
                  *x11 = (const int32_t *)(xq + 11 * k);
/* inline asm: gcc 12's _mm512_dpbusd_epi32 copies each accumulator through another register and the stack
   every step here (measured: a third of VPDPBUSD's rate) */
#define ROW(r)                                                                                  \
    if (rows > r) {                                                                             \
        const __m512i xb = _mm512_set1_epi32(x##r[kq]);                                         \
        __asm__("vpdpbusd %[w], %[x], %[acc]" : [acc] "+v"(c##r##a) : [x] "v"(xb), [w] "v"(w0)); \
        __asm__("vpdpbusd %[w], %[x], %[acc]" : [acc] "+v"(c##r##b) : [x] "v"(xb), [w] "v"(w1)); \
    }
    for (int64_t kq = 0; kq < k / 4; kq++) {
        const int8_t *wp = block + kq * 128;
        _mm_prefetch((const char *)(wp + 2 * DP_PF), DP_PF_HINT); /* as many bytes ahead as the bf16 tile */
        _mm_prefetch((const char *)(wp + 2 * DP_PF + 64), DP_PF_HINT);
        if (ahead && kq < 2 * nout) /* the next block's outlier rows of its two fp32 panels, one line a step */
            _mm_prefetch((const char *)(ahead + (kq & 1) * k * 16 + outliers[kq >> 1] * 16), DP_PF_HINT);
        const __m512i w0 = _mm512_loadu_si512((const void *)wp), w1 = _mm512_loadu_si512((const void *)(wp + 64));
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
    }
#undef ROW
    const __m512i sums0[DP_MR] = {c0a, c1a, c2a, c3a, c4a, c5a, c6a, c7a, c8a, c9a, c10a, c11a};
    const __m512i sums1[DP_MR] = {c0b, c1b, c2b, c3b, c4b, c5b, c6b, c7b, c8b, c9b, c10b, c11b};
    const __m512i off0 = _mm512_loadu_si512((const void *)colsum128), off1 = _mm512_loadu_si512((const void *)(colsum128 + 16));
    const __m512 sw0 = _mm512_loadu_ps(sw), sw1 = _mm512_loadu_ps(sw + 16);
    __m512 acc0[DP_MR], acc1[DP_MR];
#pragma GCC unroll 12
    for (int r = 0; r < DP_MR; r++) {
        if (r < rows) {
            const __m512 s = _mm512_set1_ps(sx[r]);
            acc0[r] = _mm512_mul_ps(_mm512_mul_ps(s, sw0), _mm512_cvtepi32_ps(_mm512_sub_epi32(sums0[r], off0)));
            acc1[r] = _mm512_mul_ps(_mm512_mul_ps(s, sw1), _mm512_cvtepi32_ps(_mm512_sub_epi32(sums1[r], off1)));
        }
    }
    const float *panel0 = panels + (col / 16) * k * 16, *panel1 = panel0 + k * 16;
    const int second = ncols > 16; /* a last block of 16 columns or fewer has no second panel */
    for (int j = 0; j < nout; j++) {
        const int64_t kk = outliers[j];
        const __m512 w0 = _mm512_loadu_ps(panel0 + kk * 16);
        const __m512 w1 = second ? _mm512_loadu_ps(panel1 + kk * 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
        for (int r = 0; r < DP_MR; r++) {
            if (r < rows) {
                const __m512 xv = _mm512_set1_ps(x_f32[r * ldx + kk]);
                acc0[r] = _mm512_fmadd_ps(xv, w0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(xv, w1, acc1[r]);
            }
        }
    }
    screen_epilogue(acc0, acc1, rows, ncols, sc, row0, col);
}

static inline void i8_tile_rows(int rows, const uint8_t *xq, int64_t k, const int8_t *block, const float *sw,
                                const int32_t *colsum128, const float *sx, const float *x_f32, int64_t ldx,
                                const float *panels, const int32_t *outliers, int nout, int ncols, dp_screen *sc,
                                int64_t row0, int64_t col, const float *ahead)
{
#define I8_CASE(n) \
    case n: i8_tile(n, xq, k, block, sw, colsum128, sx, x_f32, ldx, panels, outliers, nout, ncols, sc, row0, col, ahead); break;
    switch (rows) {
    I8_CASE(12) I8_CASE(11) I8_CASE(10) I8_CASE(9) I8_CASE(8) I8_CASE(7)
    I8_CASE(6) I8_CASE(5) I8_CASE(4) I8_CASE(3) I8_CASE(2)
    default: i8_tile(1, xq, k, block, sw, colsum128, sx, x_f32, ldx, panels, outliers, nout, ncols, sc, row0, col, ahead); break;
    }
#undef I8_CASE
}

/* Row xr's largest |x| outside the chosen channels, relative to the row's norm, and where it is (*at); -1 where
 * there is none, or for a zero or non-finite row, which so goes last (its bound is moot: it is settled or left to
 * every column either way). */
static float relative_top(const float *xr, int64_t k, const uint8_t *chosen, int64_t *at)
{
    double norm = 0;
    float top = -1.f;
    int64_t where = -1;
    for (int64_t c = 0; c < k; c++) {
        const float v = fabsf(xr[c]);
        norm += (double)v * v;
        if (!chosen[c] && v > top) { top = v; where = c; }
    }
    *at = where >= 0 ? where : 0;
    return where >= 0 && norm > 0 && isfinite(norm) ? (float)(top / sqrt(norm)) : -1.f;
}

/* The step's outlier channels, nout <= k of them, ascending: greedily, the row whose largest |x| outside the
 * channels chosen so far is the largest relative to its norm (the row whose int8 rounding would bound worst)
 * gives up that channel. A row's bound grows with its int8 step, max_R |x_i| / 127, against logit gaps that
 * grow with ||x_i||; so the worst row sets the step's fallbacks. A hidden state's massive activations sit in
 * the same few channels in every row, so nout = 32 covers them and each row's own. One thread: m x k to start,
 * then k per row whose largest was taken (microseconds at decode sizes). row_top [m] and top_at [m] scratch;
 * chosen [k] bytes of scratch. */
static void pick_outliers(const float *x, int64_t ldx, int64_t m, int64_t k, int nout, int32_t *out, float *row_top,
                          int64_t *top_at, uint8_t *chosen)
{
    memset(chosen, 0, (size_t)k);
    for (int64_t i = 0; i < m; i++)
        row_top[i] = relative_top(x + i * ldx, k, chosen, &top_at[i]);
    for (int j = 0; j < nout; j++) {
        int64_t worst = -1;
        for (int64_t i = 0; i < m; i++)
            if (worst < 0 || row_top[i] > row_top[worst]) worst = i;
        int64_t c = worst >= 0 && row_top[worst] >= 0 ? top_at[worst] : -1;
        if (c < 0 || chosen[c]) /* rows exhausted: the lowest channels not yet chosen */
            for (c = 0; chosen[c]; c++) {}
        chosen[c] = 1;
        for (int64_t i = 0; i < m; i++) /* rows whose largest was c: their next largest outside the chosen */
            if (top_at[i] == c && row_top[i] >= 0)
                row_top[i] = relative_top(x + i * ldx, k, chosen, &top_at[i]);
    }
    for (int64_t c = 0, j = 0; c < k; c++)
        if (chosen[c]) out[j++] = (int32_t)c;
}

/* gemm_bf16_dp_screen_argmax's contract (best, idx with -1 for a row left to every column, counts) with the int8
 * screen above. w8: the int8 weight, per column block of 32 and k-quad two 64-byte rows (columns 0-15, 16-31, 4 k
 * per lane); sw [blocks * 32] its per-column scales (0 past n), colsum128 [blocks * 32] 128 x each column's sum
 * of q; row_norm ||w_v|| and rounding_norm ||sw_v q_v - w_v||, rounded up. k a multiple of 4, at most 1024 (so
 * |S| < 2^24: exact in fp32), and >= NOUT. Returns 0, or -1 when scratch memory could not be had. */
int gemm_int8_screen_argmax(const float *x_f32, int64_t ldx, int64_t m, const int8_t *w8, const float *sw,
                            const int32_t *colsum128, const float *exact_panels, const float *row_norm,
                            const float *rounding_norm, float max_row_norm, int64_t n, int64_t k, float *best,
                            int64_t *idx, int64_t *counts, int num_threads)
{
    if (k % 4 || k > 1024 || k < NOUT) return -2;
    const int64_t blocks = (n + 31) / 32;
    const int teams = num_threads > 0 ? num_threads : 1;
    screen_scratch scr;
    if (screen_scratch_alloc(&scr, teams, m, INT8_SCREEN_CAP) != 0) return -1;
    uint8_t *xq = (uint8_t *)malloc((size_t)(m * k));
    float *sx = (float *)malloc(sizeof(float) * m);
    float *row_top = (float *)malloc(sizeof(float) * m);
    int64_t *top_at = (int64_t *)malloc(sizeof(int64_t) * m);
    uint8_t *chosen = (uint8_t *)malloc((size_t)k);
    int32_t outliers[NOUT];
    const int status = xq && sx && row_top && top_at && chosen ? 0 : -1;
    const double u = 0x1p-23 * (double)(k + 2), g = u / (1.0 - u), rho = 0x1p-20, inflate = 1.0 + 0x1p-16;
    int64_t settled = 0, full_rows = 0;
    if (status == 0) {
        #pragma omp parallel num_threads(teams) if (blocks > 1)
        {
            const int t = omp_get_thread_num(), used = omp_get_num_threads();
            #pragma omp single
            pick_outliers(x_f32, ldx, m, k, NOUT, outliers, row_top, top_at, chosen); /* a barrier at its end */
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) {
                const float *xr = x_f32 + i * ldx;
                uint8_t *q = xq + i * k;
                float top = 0.f;
                int o = 0;
                for (int64_t c = 0; c < k; c++) { /* the largest |x| outside the outliers */
                    if (o < NOUT && outliers[o] == c) { o++; continue; }
                    const float v = fabsf(xr[c]);
                    if (v > top) top = v;
                }
                const float step = top / 127.f; /* 0 where the rest is all zeros (then so is every p) */
                double nx = 0, nr = 0, no = 0, nt = 0, nd = 0;
                o = 0;
                for (int64_t c = 0; c < k; c++) {
                    const double a = xr[c];
                    nx += a * a;
                    if (o < NOUT && outliers[o] == c) { o++; no += a * a; q[c] = 128; continue; }
                    const float p = step > 0.f ? nearbyintf(xr[c] / step) : 0.f; /* |p| <= 127 */
                    q[c] = (uint8_t)((int)p + 128);
                    const double b = (double)p * (double)step;
                    nr += a * a, nt += b * b, nd += (b - a) * (b - a);
                }
                sx[i] = step;
                nx = sqrt(nx), nr = sqrt(nr), no = sqrt(no), nt = sqrt(nt), nd = sqrt(nd);
                const double s = ((g + rho) * nt + nd + g * no + g * nx) * inflate;
                const double tt = ((g + rho) * nt + nd + nr) * inflate;
                const int narrow = isfinite(nx) && isfinite(step) && nx * (double)max_row_norm <= 1e30;
                scr.scale[2 * i] = narrow ? (float)(s * (1.0 + 0x1p-20)) : NAN; /* rounded up */
                scr.scale[2 * i + 1] = narrow ? (float)(tt * (1.0 + 0x1p-20)) : NAN;
            } /* a barrier: every row's int8 rows and scales ready */
            dp_screen sc = screen_start(&scr, row_norm, rounding_norm, t, m);
            const int64_t tiles = (m + DP_MR - 1) / DP_MR;
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t col = b * 32;
                const int ncols = (int)(n - col < 32 ? n - col : 32);
                int64_t r0 = 0;
                for (int64_t tl = tiles; tl > 0; tl--) { /* the rows left spread evenly over the tiles left */
                    const int rows = (int)((m - r0 + tl - 1) / tl);
                    /* the first row tile of a block prefetches the next block's outlier rows (scattered lines, which
                       the hardware prefetcher does not fetch ahead) */
                    const float *ahead = r0 == 0 && b + 1 < blocks && col + 32 < n ? exact_panels + (col + 32) / 16 * k * 16 : NULL;
                    i8_tile_rows(rows, xq + r0 * k, k, w8 + b * 32 * k, sw + col, colsum128 + col, sx + r0,
                                 x_f32 + r0 * ldx, ldx, exact_panels, outliers, NOUT, ncols, &sc, r0, col, ahead);
                    r0 += rows;
                }
            } /* a barrier: every thread's candidates ready */
            screen_settle(&scr, used, x_f32, ldx, m, k, exact_panels, best, idx, &settled, &full_rows);
        }
        counts[0] += settled;
        counts[1] += full_rows;
    }
    screen_scratch_free(&scr);
    free(xq); free(sx); free(row_top); free(top_at); free(chosen);
    return status;
}
#pragma GCC pop_options

#else /* not the avx512 build: no AVX512-bf16 code here */

int bf16_dp_use_fma(int on)
{
    (void)on;
    return 0;
}

int gemm_bf16_dp(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, const float *bias,
                 float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    (void)x_f32, (void)ldx, (void)x, (void)m, (void)w, (void)bias, (void)y, (void)ldy, (void)n, (void)k, (void)glu;
    (void)num_threads;
    return -2;
}

int gemm_int8_dp(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const int8_t *values, const float *scales,
                 const float *offsets, int64_t group, const float *bias, float *y, int64_t ldy, int64_t n, int64_t k,
                 int glu, int num_threads)
{
    (void)x_f32, (void)ldx, (void)x, (void)m, (void)values, (void)scales, (void)offsets, (void)group, (void)bias;
    (void)y, (void)ldy, (void)n, (void)k, (void)glu, (void)num_threads;
    return -2;
}

int gemm_bf16_dp_argmax(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, int64_t n,
                        int64_t k, float *best, int64_t *idx, int num_threads)
{
    (void)x_f32, (void)ldx, (void)x, (void)m, (void)w, (void)n, (void)k, (void)best, (void)idx, (void)num_threads;
    return -2;
}

int gemm_bf16_dp_add_norm(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, const float *bias,
                          float *y, int64_t n, int64_t k, const float *residual, const float *norm_w, float eps,
                          float *normed, int num_threads)
{
    (void)x_f32, (void)ldx, (void)x, (void)m, (void)w, (void)bias, (void)y, (void)n, (void)k, (void)residual;
    (void)norm_w, (void)eps, (void)normed, (void)num_threads;
    return -2;
}

int gemm_bf16_dp_screen_argmax(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w,
                               const float *exact_panels, const float *row_norm, const float *rounding_norm,
                               float max_row_norm, int64_t n, int64_t k, float *best, int64_t *idx, int64_t *counts,
                               int num_threads)
{
    (void)x_f32, (void)ldx, (void)x, (void)m, (void)w, (void)exact_panels, (void)row_norm, (void)rounding_norm;
    (void)max_row_norm, (void)n, (void)k, (void)best, (void)idx, (void)counts, (void)num_threads;
    return -2;
}

int gemm_int8_screen_argmax(const float *x_f32, int64_t ldx, int64_t m, const int8_t *w8, const float *sw,
                            const int32_t *colsum128, const float *exact_panels, const float *row_norm,
                            const float *rounding_norm, float max_row_norm, int64_t n, int64_t k, float *best,
                            int64_t *idx, int64_t *counts, int num_threads)
{
    (void)x_f32, (void)ldx, (void)m, (void)w8, (void)sw, (void)colsum128, (void)exact_panels, (void)row_norm;
    (void)rounding_norm, (void)max_row_norm, (void)n, (void)k, (void)best, (void)idx, (void)counts, (void)num_threads;
    return -2;
}

#endif
