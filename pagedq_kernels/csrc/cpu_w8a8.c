/* y[m, n] = xs[i] ws[c] sum_k xq[i, k] wq[c, k] (+ bias[c]): the W8A8 linear (pagedq_kernels/w8a8_linear.py) on
 * AVX512-VNNI dot products (VPDPBUSD: 4 products of u8 x s8 summed into each 32-bit lane), for CPUs where oneDNN's
 * int8 linear does not run a real kernel.
 *
 * Why: quantization="w8a8" multiplied through oneDNN's int8 linear only, and on a 2-vCPU AMD EPYC Zen 5 (family 26
 * model 2; AVX512-VNNI, no AMX) oneDNN answered it exactly but from its reference loop, ~1500x slower than fp32
 * (w8a8_linear._trial_fast), so W8A8 could not run there at all. VPDPBUSD multiplies 64 byte pairs per instruction,
 * twice VDPBF16PS's 32 bf16 pairs (cpu_bf16_dp.c), with a quarter of fp32's weight bytes.
 *
 * Numbers: the same integer sums as oneDNN's and the reference's (exact in int32: |sum| <= 255 * 127 * k < 2^31
 * for k < 66000), then fp32 scaling, (float)sum * ws[c] * xs[i], where the reference scales in float64 (a few
 * fp32 roundings apart, as oneDNN is).
 *
 * One call per linear: x's fp32 rows are quantised per token inside the parallel region (simd_math.h
 * quantize_row_s8, what cpu_ops.c quantize_rows_s8 and the torch reference compute, bit for bit), then multiplied,
 * and the epilogue applies both scales and the bias, or for a gated MLP's gate_up silu(gate) * up: no torch op
 * and no second pass over the product between the linears of a step (the whole-step CPU plan,
 * engine/models/llama_cpu_plan.py, calls it as it calls the float kernels).
 *
 * Signs: VPDPBUSD's first factor is unsigned. The weight is that one, packed as q + 128 (u8, at load), and x's
 * codes (s8) are the signed factor: a 32-bit group of 4 codes broadcast from memory into every lane ({1to16}).
 * The + 128 comes off as 128 sum_k xq[i, k], one int32 per row computed with the codes.
 *
 * Layout (pagedq_kernels/w8a8_linear.py _pack_vnni): per column block of 32 outputs (glu: the 16 gate columns
 * then the 16 matching up columns) and per k-quad, two 64-byte rows, columns 0-15 then 16-31, each 32-bit lane
 * the 4 codes k..k+3 of one column: exactly VPDPBUSD's other operand. k a multiple of 4; the columns past n are
 * zero codes (128) with scale 0.
 *
 * Register tile: up to 12 rows x 32 columns, 24 zmm int32 accumulators, 2 weight vectors; per k-quad 2 weight loads
 * and 24 VPDPBUSD with the x operand folded in as a broadcast load. Rows spread evenly over a row block's tiles;
 * each thread a static share of the column blocks (one contiguous range of the weight), every MB-row pass of x over
 * them; a block (k x 32 bytes: 18 KB at k=576, 48 KB at 1536) stays in L1/L2 for its row tiles after the first.
 * The weight is prefetched into L2 W8_PF bytes ahead, as the bf16 tile's is (cpu_bf16_dp.c measured why). The
 * VPDPBUSD is inline asm for the reason cpu_bf16_dp.c's int8 screen gives: gcc 12 copies each intrinsic's
 * accumulator through the stack every step.
 *
 * Measured (2-vCPU KVM AMD EPYC Zen 5, family 26 model 2, 2 threads; python -m ops.bench.kernel_timing --linears
 * --rounds 2: each call on the next of 30 copies of the weight, x fp32 in and out, its quantisation included;
 * integer GOP/s against the bf16 kernels' GFLOP/s on the same shapes, same process):
 *                  M:     8    36    64   256  2048
 *   qkv 576x960   W8A8  401   773   855  1042  1104 | dpbf16  293   569   657   793   735 | oneDNN bf16 137 .. 686
 *   o 576x576           284   626   774   935  1049 |         221   463   541   652   656 |            133 .. 688
 *   gate_up glu         704  1325  1157  1244  1239 |         364   675   756   825   816 |            208 .. 595
 *   down 1536x576       764  1201  1359  1528  1372 |         333   729   777   868   737 |            236 .. 757
 * End to end (pagedq bench --systems pagedq,pagedq-w8a8 --workloads compass --repeat 2, the same machine): W8A8
 * 1011.9 / 1170.9 tok/s against bf16's 803.8 (best rounds), where oneDNN's reference loop could not run it.
 *
 * Only the avx512 build holds the kernel (compiled with the VNNI target on top); Python calls it only where
 * pagedq_kernels/cpu_isa.py probed the avx512_bf16 level (whose probe runs VPDPBUSD too) under the PAGEDQ_CPU_ISA
 * cap. Other builds export a stub that refuses (-2). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h"

#if defined(PAGEDQ_AVX512)

#define W8_MR 12 /* rows per register tile: 24 accumulators + 2 weight vectors */
#ifndef W8_MB
#define W8_MB 256 /* rows of x per pass over the column blocks (256 x k bytes: 384 KB at k=1536, in L2) */
#endif
#ifndef W8_PF
#define W8_PF 8192 /* weight bytes to prefetch ahead: the bf16 tile's 8 KB */
#endif

#pragma GCC push_options
#pragma GCC target("avx512vnni")

/* rows x 32 columns of one column block: the int32 sums of x's codes (row stride ldq) with the block's u8 weight,
 * less each row's 128 sum, scaled by ws and xs, plus bias, stored masked to ncols; glu: silu(gate) * up, ncols of
 * them. */
static inline __attribute__((always_inline)) void w8_tile(const int rows, const int8_t *xq, int64_t ldq,
                                                          const int32_t *row_off, const float *xs, int64_t k,
                                                          const uint8_t *block, const float *ws, const float *bias,
                                                          float *y, int64_t ldy, int ncols, int glu)
{
    __m512i c0a = _mm512_setzero_si512(), c1a = c0a, c2a = c0a, c3a = c0a, c4a = c0a, c5a = c0a;
    __m512i c6a = c0a, c7a = c0a, c8a = c0a, c9a = c0a, c10a = c0a, c11a = c0a;
    __m512i c0b = c0a, c1b = c0a, c2b = c0a, c3b = c0a, c4b = c0a, c5b = c0a;
    __m512i c6b = c0a, c7b = c0a, c8b = c0a, c9b = c0a, c10b = c0a, c11b = c0a;
    const int32_t *x0 = (const int32_t *)xq, *x1 = (const int32_t *)(xq + ldq), *x2 = (const int32_t *)(xq + 2 * ldq),
                  *x3 = (const int32_t *)(xq + 3 * ldq), *x4 = (const int32_t *)(xq + 4 * ldq),
                  *x5 = (const int32_t *)(xq + 5 * ldq), *x6 = (const int32_t *)(xq + 6 * ldq),
                  *x7 = (const int32_t *)(xq + 7 * ldq), *x8 = (const int32_t *)(xq + 8 * ldq),
                  *x9 = (const int32_t *)(xq + 9 * ldq), *x10 = (const int32_t *)(xq + 10 * ldq),
                  *x11 = (const int32_t *)(xq + 11 * ldq);
#define W8_ROW(r)                                                                                        \
    if (rows > r) {                                                                                      \
        __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(c##r##a) : [w] "v"(w0), [x] "m"(x##r[kq])); \
        __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(c##r##b) : [w] "v"(w1), [x] "m"(x##r[kq])); \
    }
    for (int64_t kq = 0; kq < k / 4; kq++) {
        const uint8_t *wp = block + kq * 128;
        _mm_prefetch((const char *)(wp + W8_PF), _MM_HINT_T1);
        _mm_prefetch((const char *)(wp + W8_PF + 64), _MM_HINT_T1);
        const __m512i w0 = _mm512_loadu_si512((const void *)wp), w1 = _mm512_loadu_si512((const void *)(wp + 64));
        W8_ROW(0) W8_ROW(1) W8_ROW(2) W8_ROW(3) W8_ROW(4) W8_ROW(5)
        W8_ROW(6) W8_ROW(7) W8_ROW(8) W8_ROW(9) W8_ROW(10) W8_ROW(11)
    }
#undef W8_ROW
    const __m512i sums0[W8_MR] = {c0a, c1a, c2a, c3a, c4a, c5a, c6a, c7a, c8a, c9a, c10a, c11a};
    const __m512i sums1[W8_MR] = {c0b, c1b, c2b, c3b, c4b, c5b, c6b, c7b, c8b, c9b, c10b, c11b};
    const __m512 ws0 = _mm512_loadu_ps(ws), ws1 = _mm512_loadu_ps(ws + 16);
    __m512 v0[W8_MR], v1[W8_MR];
#pragma GCC unroll 12
    for (int r = 0; r < W8_MR; r++) {
        if (r < rows) {
            const __m512i off = _mm512_set1_epi32(row_off[r]);
            const __m512 s = _mm512_set1_ps(xs[r]);
            v0[r] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums0[r], off)), ws0), s);
            v1[r] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums1[r], off)), ws1), s);
        }
    }
    if (glu) { /* v0: 16 gate columns, v1: the matching up columns; silu as cpu_bf16_dp.c's epilogue has it */
        const __mmask16 mask = lanes16(ncols);
        const __m512 one = _mm512_set1_ps(1.f);
#pragma GCC unroll 12
        for (int r = 0; r < W8_MR; r++) {
            if (r < rows) {
                const __m512 g = v0[r];
                const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_mul_ps(_mm512_mul_ps(g, sig), v1[r]));
            }
        }
        return;
    }
    const __mmask16 m0 = lanes16(ncols), m1 = lanes16(ncols > 16 ? ncols - 16 : 0);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < W8_MR; r++) {
        if (r < rows) {
            _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(v0[r], b0));
            if (m1) _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_add_ps(v1[r], b1));
        }
    }
}

/* w8_tile, one inlined copy per row count: constant counts keep every accumulator in a register. */
static inline void w8_tile_rows(int rows, const int8_t *xq, int64_t ldq, const int32_t *row_off, const float *xs,
                                int64_t k, const uint8_t *block, const float *ws, const float *bias, float *y,
                                int64_t ldy, int ncols, int glu)
{
#define W8_CASE(n) case n: w8_tile(n, xq, ldq, row_off, xs, k, block, ws, bias, y, ldy, ncols, glu); break;
    switch (rows) {
    W8_CASE(12) W8_CASE(11) W8_CASE(10) W8_CASE(9) W8_CASE(8) W8_CASE(7)
    W8_CASE(6) W8_CASE(5) W8_CASE(4) W8_CASE(3) W8_CASE(2)
    default: w8_tile(1, xq, ldq, row_off, xs, k, block, ws, bias, y, ldy, ncols, glu); break;
    }
#undef W8_CASE
}

/* y [m, n] (row stride ldy) = xs[i] ws[c] sum_k xq[i, k] wq[c, k] + bias[c], where xq, xs are x's rows quantised
 * per token here; x fp32 [m, k] (row stride ldx), k a multiple of 4. glu: y [m, n] = silu(gate) * up and no bias.
 * w: the packed u8 weight (layout above); ws: [blocks * 32] per-column scales in the packing's order, 0 past n;
 * bias: [n] or NULL. Returns 0, -1 when scratch memory could not be had, -3 for a k not a multiple of 4. */
int gemm_w8a8_vnni(const float *x, int64_t ldx, int64_t m, const uint8_t *w, const float *ws, const float *bias,
                   float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    if (k % 4) return -3;
    const int64_t rows_held = m > 0 ? m : 1;
    int8_t *xq = (int8_t *)malloc((size_t)(rows_held * k));
    float *xs = (float *)malloc(sizeof(float) * rows_held);
    int32_t *row_off = (int32_t *)malloc(sizeof(int32_t) * rows_held);
    if (!xq || !xs || !row_off) {
        free(xq), free(xs), free(row_off);
        return -1;
    }
    const int64_t width = glu ? 16 : 32; /* outputs per column block */
    const int64_t blocks = (n + width - 1) / width;
    #pragma omp parallel num_threads(num_threads) if (blocks > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) { /* the codes, the scale, and 128 sum_k xq[i, k] (the weight's + 128) */
            int8_t *codes = xq + i * k;
            xs[i] = quantize_row_s8(x + i * ldx, codes, k);
            int32_t total = 0;
            for (int64_t c = 0; c < k; c++) total += codes[c];
            row_off[i] = 128 * total;
        } /* a barrier: every row ready */
        for (int64_t r0 = 0; r0 < m; r0 += W8_MB) {
            const int64_t r1 = r0 + W8_MB < m ? r0 + W8_MB : m;
            const int64_t tiles = (r1 - r0 + W8_MR - 1) / W8_MR;
            #pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t col = b * width;
                const int ncols = (int)(n - col < width ? n - col : width);
                int64_t row = r0;
                for (int64_t t = tiles; t > 0; t--) { /* the rows left spread evenly over the tiles left */
                    const int rows = (int)((r1 - row + t - 1) / t);
                    w8_tile_rows(rows, xq + row * k, k, row_off + row, xs + row, k, w + b * k * 32, ws + b * 32,
                                 bias && !glu ? bias + col : NULL, y + row * ldy + col, ldy, ncols, glu);
                    row += rows;
                }
            }
        }
    }
    free(xq), free(xs), free(row_off);
    return 0;
}

#pragma GCC pop_options

#else

int gemm_w8a8_vnni(const float *x, int64_t ldx, int64_t m, const uint8_t *w, const float *ws, const float *bias,
                   float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    (void)x, (void)ldx, (void)m, (void)w, (void)ws, (void)bias, (void)y, (void)ldy, (void)n, (void)k, (void)glu;
    (void)num_threads;
    return -2;
}

#endif
