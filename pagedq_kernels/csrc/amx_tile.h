/* What pagedq's AMX code shares: the tile-data permission and tile configuration (also used by the ISA
 * probe, isa_probe.c, built for baseline x86-64), and, in the avx512 build only (PAGEDQ_AVX512, from
 * simd_math.h), the pieces of the bf16-tile matmuls (cpu_int8_amx.c: int8 weights widened per call;
 * cpu_bf16_amx.c: bf16 weights loaded as they are): x rounded to bf16 rows, the 2 x 2 tile block and the
 * fp32 epilogue (scale, bias, or silu(gate) * up). cpu_bf16_dp.c (AVX512-bf16 dot products, no tiles) reads
 * the same weight order and rounds x with round_rows.
 *
 * Both kernels' weights use one B-tile order: per column block of 32 outputs (with glu: 16 gate + the 16
 * matching up columns, 16 outputs) and per 32-deep K chunk, two tiles (columns 0-15, 16-31) of 16 rows of
 * k-pairs x 16 columns x the pair, bf16 [K / 32][2][16][16][2]: 1 KB per tile, a 64-byte tile row. */
#ifndef PAGEDQ_AMX_TILE_H
#define PAGEDQ_AMX_TILE_H

#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* ask the kernel for an XSAVE feature's state (AMX tile data) */
#define XFEATURE_XTILEDATA 18

/* The LDTILECFG operand (64 bytes). */
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* This process's permission for AMX tile data (Linux grants it once per process; asking again is
 * harmless). 0, or -1 if refused: then any tile instruction faults. */
static inline int amx_request_permission(void)
{
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

/* Palette 1 with tiles 0..count-1 each 16 rows x 64 bytes (16 fp32, 32 bf16, or 16 bf16 pairs). */
static inline void tile_config_fill(struct tile_config *cfg, int count)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->palette_id = 1;
    for (int t = 0; t < count; t++) {
        cfg->rows[t] = 16;
        cfg->colsb[t] = 64;
    }
}

#if defined(PAGEDQ_AVX512) /* simd_math.h, included first by the kernels */
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")
#include <immintrin.h>

/* Tile config is per thread: the x and accumulator tiles (tmm0-5) `height` rows (1..16), the weight tiles
 * (tmm6-7) 16 k-pairs; every tile row 64 bytes (16 fp32, 32 bf16, or 16 bf16 pairs). */
static inline void configure_tiles(int height)
{
    struct tile_config cfg;
    tile_config_fill(&cfg, 8);
    for (int t = 0; t < 6; t++)
        cfg.rows[t] = (uint8_t)height;
    _tile_loadconfig(&cfg);
}

/* xb [rows] = bf16(x rows), round to nearest even (vcvtneps2bf16, as oneDNN's bf16 path; it flushes fp32
 * denormals to zero); rows past m zeroed. k a multiple of 32. A worksharing loop: call it inside the
 * parallel region (it ends in a barrier, so every row is ready after it). */
static inline void round_rows(const float *x, int64_t ldx, uint16_t *xb, int64_t m, int64_t padded, int64_t k)
{
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < padded; r++) {
        uint16_t *dst = xb + r * k;
        if (r >= m) {
            memset(dst, 0, (size_t)k * sizeof(uint16_t));
            continue;
        }
        const float *src = x + r * ldx;
        for (int64_t i = 0; i < k; i += 32) {
            const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
            _mm512_storeu_si512((__m512i *)(dst + i), (__m512i)b);
        }
    }
}

/* A column block's int8 weight (cpu_int8_amx.c's packing) widened to bf16 in the B-tile order, exactly (for
 * both int8 kernels: cpu_int8_amx.c on the tiles, cpu_bf16_dp.c gemm_int8_dp on VDPBF16PS): int8 -> int32 -> fp32 is exact and an fp32 holding at most 8
 * significant bits is its own bf16, its top 16 bits. The pack stores each 32-byte tile row as the 16 first
 * elements of the column pairs, then the 16 second ones, so one 32-bit lane of fp32 bits makes one
 * pair: (second & 0xFFFF0000) | (first >> 16), one vpternlogd, no pack across lanes. 2 vpmovsxbd, 2
 * vcvtdq2ps, a shift and a ternlog per 32 weights: 5-10 % faster at 36-256 rows than vcvtne2ps2bf16 on
 * [p][j][e]-ordered bytes (a contended 2-vCPU Xeon). n a multiple of 32. */
static inline void widen_block(const int8_t *src, uint16_t *dst, int64_t n)
{
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t i = 0; i < n; i += 32) {
        const __m128i first = _mm_loadu_si128((const __m128i *)(src + i));
        const __m128i second = _mm_loadu_si128((const __m128i *)(src + i + 16));
        const __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)));
        const __m512i hi = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)));
        /* 0xCA: high ? hi : lo >> 16, bit by bit */
        _mm512_store_si512((__m512i *)(dst + i), _mm512_ternarylogic_epi32(high, hi, _mm512_srli_epi32(lo, 16), 0xCA));
    }
}

/* out [2 height][32] fp32 (row stride ldo floats) = init + x rows (two tiles of `height` rows, or one when
 * rows <= height; x rows at stride k) @ a column block's weight (the B-tile order above: tile t of chunk kc
 * at panel + kc * 32 + 512 t). 4 accumulators (tmm0-3), 2 x tiles (tmm4-5), 2 weight tiles (tmm6-7): 4 tile
 * loads per 4 TDPBF16PS. `height`: the rows configure_tiles gave the x and accumulator tiles. init: NULL
 * (zeros) or 32 fp32 every row starts from (a bias: loaded with a zero stride). out: an fp32 scratch for an
 * epilogue (ldo 32), or y itself where every stored row and column is y's. */
static inline void tile_block(const uint16_t *x, int64_t k, const uint16_t *panel, int rows, int height,
                              const float *init, float *out, int64_t ldo)
{
    const int64_t stride = k * (int64_t)sizeof(uint16_t), ldo_bytes = ldo * (int64_t)sizeof(float);
    const int two = rows > height;
    if (init) {
        _tile_loadd(0, init, 0);
        _tile_loadd(1, init + 16, 0);
        if (two) {
            _tile_loadd(2, init, 0);
            _tile_loadd(3, init + 16, 0);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
    }
    for (int64_t kc = 0; kc < k; kc += 32) {
        _tile_loadd(4, x + kc, stride);
        _tile_loadd(6, panel + kc * 32, 64);
        _tile_loadd(7, panel + kc * 32 + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + height * k + kc, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (two) {
        _tile_stored(2, out + height * ldo, ldo_bytes);
        _tile_stored(3, out + height * ldo + 16, ldo_bytes);
    }
    _tile_stored(0, out, ldo_bytes);
    _tile_stored(1, out + 16, ldo_bytes);
}

/* y rows = acc rows * scale (+ bias), or silu(gate * scale) * (up * scale) with glu; ncols valid outputs.
 * scales: the block's 32 per-column factors, or NULL for none (a bf16 weight: times 1, exact). */
static inline void tile_epilogue(const float *acc, int rows, const float *scales, const float *bias, float *y,
                                 int64_t ldy, int ncols, int glu)
{
    const __m512 s0 = scales ? _mm512_loadu_ps(scales) : _mm512_set1_ps(1.f);
    const __m512 s1 = scales ? _mm512_loadu_ps(scales + 16) : _mm512_set1_ps(1.f);
    if (glu) {
        const __mmask16 mask = lanes16(ncols);
        const __m512 one = _mm512_set1_ps(1.f);
        for (int r = 0; r < rows; r++) {
            const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(acc + r * 32), s0);
            const __m512 u = _mm512_mul_ps(_mm512_loadu_ps(acc + r * 32 + 16), s1);
            const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
        }
        return;
    }
    const __mmask16 m0 = lanes16(ncols), m1 = lanes16(ncols > 16 ? ncols - 16 : 0);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_fmadd_ps(_mm512_loadu_ps(acc + r * 32), s0, b0));
        if (m1)
            _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_fmadd_ps(_mm512_loadu_ps(acc + r * 32 + 16), s1, b1));
    }
}

#endif /* PAGEDQ_AVX512 */
#endif /* PAGEDQ_AMX_TILE_H */
