/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a symmetric per-output-channel int8 weight on AMX bf16 tiles.
 *
 * Why: quantization="int8" halves the bytes a bf16 step streams, but the fp32 kernel it ran on
 * (cpu_int8_gemm.c: int8 -> fp32 panels, fp32 FMAs) is bound by arithmetic at compass-sized steps (~100
 * rows), where ~300 GFLOP/s of fp32 FMAs lose to oneDNN's bf16 AMX matmul (1-2.7 TFLOP/s). Where the
 * model multiplies in bf16 anyway (EngineConfig.matmul_weight_dtype), this kernel multiplies the int8
 * weight on the same AMX tiles:
 *   w[n, k] = scale[n] * q[n, k], so y[m, n] = scale[n] * sum_k bf16(x[m, k]) * q[n, k].
 * The scale factors out of the K sum and every int8 value is a bf16 (8 significant bits), so widening q to
 * bf16 is exact: the only rounding is x to bf16 (what the bf16 path does) and the fp32 sum's order.
 *
 * Layout (packed in pagedq_kernels/int8_linear.py, K a multiple of 32): ceil(N / 32) column blocks of 32 outputs
 * (with glu: 16 gate and the 16 matching up columns, 16 outputs), each int8 [K / 32][2][16][16][2] = per
 * 32-deep K chunk two B tiles (columns 0-15, 16-31), each 16 rows of k-pairs x 16 columns x the pair: the
 * tile's VNNI order, except that within a tile row the first elements of the 16 pairs come first, then the
 * second ones (see widen_block), so the per-call dequantisation is a cheap int8 -> bf16 widening. Scales
 * fp32 [blocks][32].
 *
 * Per thread and column block: the block's K x 32 weight is widened once into a private bf16 buffer (K=1536:
 * 96 KB, L2-resident), then reused by every 32-row block of x (MB rows at a time): a 2 x 2 tile block
 * (amx_tile.h, shared with the bf16-weight kernel cpu_bf16_amx.c),
 * 4 fp32 accumulator tiles (tmm0-3), 2 x tiles (tmm4-5), 2 weight tiles (tmm6-7): 4 tile loads per 4
 * TDPBF16PS. The accumulators go through a 4 KB fp32 scratch to the epilogue (scale, bias or
 * silu(gate) * up), which writes fp32 rows straight into y.
 *
 * Measured (2-vCPU Xeon, family 6 model 167, 2 threads, shared with other work; GFLOP/s through the
 * Python entry points, x fp32 in and out; oneDNN bf16 = torch.ops.mkldnn._linear_pointwise on a
 * _reorder_linear_weight bf16 weight, its x.to(bfloat16) included):
 *                  M:     8    64   256  2048
 *   qkv 576x960 oneDNN   268   921  1404  1791 | int8 fp32 panels  144  263  285  261 | this  184   952  1594  1364
 *   o 576x576   oneDNN   186   709  1047  1480 | int8 fp32 panels  126  247  277  274 | this  145   764  1246  1214
 *   gate_up 576x3072     345  1250  1783  1574 |                   172  262  275  247 |       263  1142  1632  1492
 *   down 1536x576        352  1090  1058  1696 |                   146  252  266  262 |       234  1050  1441  1394
 * (gate_up here is the plain linear; with glu the SiLU-and-mul rides in the epilogue, where the bf16 path
 * runs it as a separate pass: a compass-like run spent 0.82 s in the fused int8 gate_up against 1.30 s in
 * oneDNN's.) The kernel alone (no Python): 2.0-2.5 TFLOP/s at 192-256 rows, ~1 TFLOP/s at 36; widening the
 * weight is ~15 % of its time at 256 rows, ~40 % at 36 and ~60 % at 8 (the same call with widening skipped),
 * so small steps stay below oneDNN's bf16 and the int8 weight's win is its bytes and the fused epilogue.
 * MB = 1024 instead of 256 changed nothing measurable at 2048 rows.
 * The compass workload (pagedq bench, SmolLM2-135M, 64 requests, one quiet round 11:19-11:30 UTC
 * 2026-12-02): int8 here 550 and 540 tok/s; fp32 217; bf16 (no quantisation) 454; int8 on the fp32-panel
 * kernel (PAGEDQ_CPU_ISA=avx512_bf16) 262. So 2.5x fp32 and 1.2x bf16. Contended rounds that day ran
 * 317-513 (int8 here) against 134-224 (fp32) and 255-442 (bf16).
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
/* Rows of x per block: the bf16 rows a block reads (MB x K x 2 bytes: 768 KB at K=1536) stay in the 2 MB
 * L2 across the column blocks, and the widening is paid once per MB rows (at most ~10 % of the tile time
 * at K=1536, 256 rows). */
#define MB 256
#endif

/* The kernel's permission for AMX tile data in this process (once; idempotent). 0, or -1 if refused. */
int int8_amx_init(void) { return amx_request_permission(); }

/* y [m, n] (row stride ldy) = x @ W^T * scale + bias; x fp32 [m, k] (row stride ldx), k a multiple of 32;
 * with glu y [m, n] = silu(gate) * up and no bias. xb: room for x in bf16, [ceil(m / 16) * 16, k]: x is
 * rounded here, inside the parallel region (a torch op in between would wake torch's own OpenMP pool, whose
 * spinning threads then compete with this one's: 30-50 % slower at 36-256 rows). Returns 0, or -1 if a
 * buffer could not be had. int8_amx_init must have succeeded in this process. */
int gemm_int8_amx(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const int8_t *values, const float *scales,
                  const float *bias, float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    const int64_t width = glu ? 16 : 32; /* outputs per column block */
    const int64_t blocks = (n + width - 1) / width;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (blocks > 1)
    {
        round_rows(x_f32, ldx, x, m, (m + 15) / 16 * 16, k); /* ends in a barrier: every row ready */
        uint16_t *panel = aligned_alloc(64, (size_t)(k * 32 * (int64_t)sizeof(uint16_t)));
        float *acc = aligned_alloc(64, 32 * 32 * sizeof(float));
        if (!panel || !acc) {
            #pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles(16);
        }
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t m1 = m0 + MB < m ? m0 + MB : m;
            #pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) {
                if (!panel || !acc)
                    continue;
                const int64_t col = b * width;
                const int ncols = (int)(n - col < width ? n - col : width);
                widen_block(values + b * k * 32, panel, k * 32);
                for (int64_t r0 = m0; r0 < m1; r0 += 32) {
                    const int rows = (int)(m1 - r0 < 32 ? m1 - r0 : 32);
                    tile_block(x + r0 * k, k, panel, rows, 16, NULL, acc, 32);
                    tile_epilogue(acc, rows, scales + b * 32, bias && !glu ? bias + col : NULL, y + r0 * ldy + col,
                                  ldy, ncols, glu);
                }
            }
        }
        if (panel && acc)
            _tile_release();
        free(panel);
        free(acc);
    }
    return failed ? -1 : 0;
}

#else /* not the avx512 build: no AMX here */

int int8_amx_init(void) { return -1; }

int gemm_int8_amx(const float *x_f32, int64_t ldx, uint16_t *x, int64_t m, const int8_t *values, const float *scales,
                  const float *bias, float *y, int64_t ldy, int64_t n, int64_t k, int glu, int num_threads)
{
    (void)x_f32, (void)ldx, (void)x, (void)m, (void)values, (void)scales, (void)bias, (void)y, (void)ldy, (void)n, (void)k, (void)glu;
    (void)num_threads;
    return -2;
}

#endif
