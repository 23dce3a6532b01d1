/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias), or silu(gate) * up, for a bf16 weight on AMX bf16 tiles.
 *
 * Why: under bf16 matmuls (EngineConfig.matmul_weight_dtype) the activations stay fp32 and every linear
 * went through oneDNN (pagedq_kernels/cpu_linear.py, kind "onednn"): x.to(bfloat16), _linear_pointwise, the
 * product .to(float32), three torch ops and three passes over the rows (a compass profile: 4.3 s of
 * aten::copy_ in 85k calls beside 8.4 s of decoder linears), and the gated MLP's SiLU-and-mul as a fourth.
 * The int8 AMX kernel (cpu_int8_amx.c) showed the shape of the fix: x rounded to bf16 inside the OpenMP
 * region, fp32 rows written straight into y, SiLU-and-mul in the epilogue. A bf16 weight is already what
 * a B tile holds, so this kernel loads the tiles straight from the packed weight: no widening (~40 % of
 * the int8 kernel's time at 36 rows), no private copy.
 *
 * Layout (packed in pagedq_kernels/cpu_linear.py, K a multiple of 32): ceil(N / 32) column blocks of 32 outputs
 * (with glu: 16 gate and the 16 matching up columns, 16 outputs), each bf16 [K / 32][2][16][16][2], the
 * B-tile VNNI order of amx_tile.h: per 32-deep K chunk two tiles (columns 0-15, 16-31) of 16 k-pairs x 16
 * columns x the pair, loaded with a 64-byte stride. Padding columns are zero.
 *
 * Per thread and column block (a static share of the blocks: each thread streams one contiguous range of
 * the weight), every row block of x (MB rows at a time) runs amx_tile.h's 2 x 2 tile block on it; the
 * block's K x 64 bytes (36 KB at K=576, 96 KB at 1536) stay in L1/L2 for the row blocks after the first.
 * The x tiles are as tall as m spread over the fewest 16-row tiles (36 rows: 3 tiles of 12, not 16 + 16 +
 * 4; see tile_height). Without glu, a block whose tiles hold only y's rows and columns starts its
 * accumulators from the bias and stores them straight into y; the others go through a 4 KB fp32 scratch to
 * tile_epilogue (bias, or silu(gate) * up), which writes fp32 rows straight into y.
 *
 * Measured (2-vCPU KVM Xeon, family 6 model 167, 2 threads, 2 MB L2 per core, shared with another agent's
 * work; GFLOP/s through the Python entry points, x fp32 in and out, each call on the next of 30 copies of
 * the weight so that it comes from memory as in a model step; oneDNN bf16 = the "onednn" kind, its
 * x.to(bfloat16) and .to(float32) included; gate_up: fused SiLU-and-mul here, oneDNN's product then the C
 * SiLU-and-mul pass as the engine ran it; python -m ops.bench.kernel_timing --linears, fastest of 4):
 *                  M:     8    36    64   256  2048
 *   qkv 576x960   this  277   859  1287  1811  1841 | oneDNN  196   691   975  1494  1931
 *   o 576x576           218   727  1113  1678  1615 |         151   531   806  1307  1708
 *   gate_up glu         296   889  1318  1895  2280 |         149   538   698  1385  1553
 *   down 1536x576       316   975  1388  1651  1812 |         243   713  1044  1163  1868
 *   lm_head 576x49152   430  1305  1866  1305   684 |         345  1298  1644  1497   607
 * So the decoder's projections run 1.2-2x oneDNN's GFLOP/s at decode sizes (8-64 rows; the lm_head 1.0-1.25x)
 * and 1.2-1.4x at 256; at 2048 rows 0.95x on qkv, o and down (the 2 x 2 block's tile loads come from L2
 * there: ~20 ns per TDPBF16PS against ~10 with both operands in L1), 1.5x on the fused gate_up. The lm_head
 * at 256+ rows writes 50+ MB of logits per call, which bounds both (0.9-1.2x over runs).
 * The kernel alone (C, no Python; weight from memory): 40-47 GB/s of weight at 1-16 rows (qkv: 24-33 us per
 * call, ~5 us of it the OpenMP region and tile config), 26 GB/s at 36. The bias-initialised direct store:
 * +3-5 % at 256-2048 rows on qkv, level elsewhere. What was tried and dropped, each measured in C:
 * software prefetch of the next 1-4 blocks' tiles (_MM_HINT_T1, 2 KB per K chunk): 5-10 % slower at 1-64
 * rows; rows-outer order (one row block over every column block, MB = 32): 5-10 % slower at 64-256 rows;
 * MB = 1024: no change; for blocks of <= 16 rows, the K chunks split over 4 accumulators (4 TDPBF16PS
 * chains, not 2): 5-10 % slower, so the small blocks are not latency bound; a tile config switched per
 * block for a short tail (LDTILECFG costs ~0.4 us): slower at 36 rows, hence one height per call.
 * The compass workload (pagedq bench, SmolLM2-135M bf16, 64 requests, 13:44-13:48 UTC 2026-12-02, the
 * same machine, interleaved): no speculation 511.6 and 509.6 tok/s against 400.8 and 442.3 with
 * PAGEDQ_DISABLE_AMX_LINEAR=1 (oneDNN); speculation on 568.0 and 559.8 against 445.4 and 416.6.
 *
 * Only the avx512 build (pagedq_kernels/c_build.py) holds the kernel, compiled with the AMX targets on top; Python
 * calls it only where pagedq_kernels/cpu_isa.py probed AMX runnable and the PAGEDQ_CPU_ISA cap allows "amx". Other
 * builds export stubs that refuse.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"
#include "amx_tile.h" /* the permission, tile config, round_rows, tile_block, tile_epilogue */

#if defined(PAGEDQ_AVX512)

#ifndef MB
#define MB 256 /* rows of x per pass over the column blocks (MB x K bf16: 768 KB at K=1536, in L2) */
#endif

/* The kernel's permission for AMX tile data in this process (once; idempotent). 0, or -1 if refused. */
int bf16_amx_init(void) { return amx_request_permission(); }

/* Rows per x tile for an m-row product: m spread evenly over the fewest 16-row tiles (36 rows: 3 tiles of
 * 12, not 16 + 16 + 4). A TDPBF16PS costs about in proportion to its rows (16: ~10 ns, 12: 8, 8: 6.7,
 * 4-1: ~6 here, one thread, weight in L2), and a short tail tile would cost a full one; the tile config
 * is loaded once per call (an LDTILECFG per column block to switch heights cost more than it saved).
 * Measured in C on qkv with its weight in L2: 1 row 12.7 -> 7.7 us, 8 rows 13.5 -> 10.4, 33 rows 38 -> 30;
 * with the weight from memory the 1-16-row calls gain little (the stream bounds them). */
static inline int tile_height(int64_t m)
{
    const int64_t tiles = (m + 15) / 16;
    return (int)((m + tiles - 1) / tiles);
}

/* y [m, n] (row stride ldy) = x @ W^T + bias; x fp32 [m, k] (row stride ldx), k a multiple of 32; with glu
 * y [m, n] = silu(gate) * up and no bias. w: the packed bf16 weight (layout above). xb: room for x in bf16,
 * [ceil(m / 16) * 16, k]: x is rounded here, inside the parallel region (a torch op in between would wake
 * torch's own OpenMP pool, whose spinning threads then compete with this one's: 30-50 % slower at 36-256
 * rows, measured on the int8 kernel). Returns 0. bf16_amx_init must have succeeded in this process. */
int gemm_bf16_amx(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, const float *bias,
                  float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    const int64_t width = glu ? 16 : 32; /* outputs per column block */
    const int64_t blocks = (n + width - 1) / width;
    const int64_t block_elems = k * 32;
    const int height = tile_height(m);
    const int64_t mb = MB / (2 * height) * (2 * height); /* whole row blocks per pass */
    /* Without glu, a block whose tiles hold only y's rows and columns (all but a partial last row or column
     * block) starts its accumulators from the bias and stores them straight into y: no fp32 scratch. */
    const int direct = !glu;
    #pragma omp parallel num_threads(num_threads) if (blocks > 1)
    {
        round_rows(x_f32, ldx, x, m, (m + 15) / 16 * 16, k); /* ends in a barrier: every row ready */
        float acc[32 * 32] __attribute__((aligned(64)));
        configure_tiles(height);
        for (int64_t m0 = 0; m0 < m; m0 += mb) {
            const int64_t m1 = m0 + mb < m ? m0 + mb : m;
            #pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t col = b * width;
                const int ncols = (int)(n - col < width ? n - col : width);
                const uint16_t *panel = w + b * block_elems;
                for (int64_t r0 = m0; r0 < m1; r0 += 2 * height) {
                    const int rows = (int)(m1 - r0 < 2 * height ? m1 - r0 : 2 * height);
                    float *out = y + r0 * ldy + col;
                    if (direct && ncols == 32 && (rows == height || rows == 2 * height)) {
                        tile_block(x + r0 * k, k, panel, rows, height, bias ? bias + col : NULL, out, ldy);
                        continue;
                    }
                    tile_block(x + r0 * k, k, panel, rows, height, NULL, acc, 32);
                    tile_epilogue(acc, rows, NULL, bias && !glu ? bias + col : NULL, out, ldy, ncols, glu);
                }
            }
        }
        _tile_release();
    }
    return 0;
}

#else /* not the avx512 build: no AMX here */

int bf16_amx_init(void) { return -1; }

int gemm_bf16_amx(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const uint16_t *w, const float *bias,
                  float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    (void)x_f32, (void)ldx, (void)x, (void)m, (void)w, (void)bias, (void)y, (void)ldy, (void)n, (void)k, (void)glu;
    (void)num_threads;
    return -2;
}

#endif
