/* Fused row-wise ops of the decoder on the CPU: RMSNorm (+ residual add), neox rotary (in place),
 * SiLU-and-mul. float32, OpenMP over rows.
 *
 * In torch each of these is 3-7 separate elementwise kernels, each a full pass over the activations
 * plus a dispatch; at decode batch sizes the dispatches dominate (RMSNorm on 128 x 576 took ~0.6 ms,
 * 50x its memory traffic), and at prefill sizes the extra passes do. One pass per row here.
 * The math follows the torch references in pagedq_kernels/ op for op; only summation order differs.
 *
 * Per instruction-set variant: the RMSNorm and rotary loops are left to the compiler, which in the
 * avx512 build (-mprefer-vector-width=512) already vectorises them in zmm; hand-written AVX-512 versions
 * (masked tails, two accumulators) measured the same on an Intel Xeon (family 6 model 167, 2 threads;
 * ops/bench/kernel_timing.py): RMSNorm+residual 128x576 0.019 -> 0.018 ms, 2048x576 0.368 -> 0.367 ms;
 * rotary 128 tokens 0.014 -> 0.013 ms, 2048 tokens 0.156 -> 0.159 ms, so they were not kept.
 * SiLU-and-mul's exp is hand-written (the compiler does not vectorise expf): 16 lanes there measured
 * 128x1536 0.049 -> 0.038 ms and 2048x1536 0.832 -> 0.733 ms against the 8-lane AVX2 loop in the
 * same build (0.047 and 0.825 ms in the avx2 build).
 */
#include <math.h>
#include <stdint.h>

#include "simd_math.h"

/* Below this many elements a parallel region costs more than it saves. */
#define PAR_MIN 32768

/* out[i] = w * (r / rms(r)) with r = x[i] (+ residual[i], also stored to res_out[i]). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, const float *w,
                  float *out, float *res_out, int64_t n, int64_t h, float eps, int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * h >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * x_stride;
        float *o = out + i * h;
        if (residual) {
            add_rms_norm_row(xr, residual + i * h, w, o, res_out + i * h, h, eps);
            continue;
        }
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < h; j++) ss += xr[j] * xr[j];
        const float inv = 1.f / sqrtf(ss / (float)h + eps);
        #pragma omp simd
        for (int64_t j = 0; j < h; j++) o[j] = w[j] * (xr[j] * inv);
    }
}

/* Neox rotary in place on q [n, nh, d] and k [n, nkv, d] (row strides given, unit last stride):
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves, cos|sin rows of cos_sin. */
void rotary_neox_f32(float *q, int64_t q_tok, int64_t q_head, int64_t nh,
                     float *k, int64_t k_tok, int64_t k_head, int64_t nkv,
                     const int64_t *positions, const float *cos_sin, int64_t n, int64_t d, int num_threads)
{
    const int64_t half = d / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * (nh + nkv) * d >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *cs = cos_sin + positions[i] * d;
        const float *c = cs, *s = cs + half;
        for (int64_t hh = 0; hh < nh + nkv; hh++) {
            float *x = hh < nh ? q + i * q_tok + hh * q_head : k + i * k_tok + (hh - nh) * k_head;
            float *x1 = x, *x2 = x + half;
            #pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                const float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
}

/* out [n, m] = silu(x[:, :m]) * x[:, m:] with x rows of stride x_stride; silu(g) = g / (1 + e^-g).
 * row_scale (or NULL): x's rows are first multiplied by row_scale[i], a W8A8 gate_up's per-token activation
 * scale (pagedq_kernels/w8a8_linear): applied here, on values already in registers, instead of one more pass over
 * the 2m-wide product (that pass cost half the matmul at 2048 x 3072 on an Intel Xeon, 0.89 vs 1.76 ms). */
void silu_and_mul_f32(const float *x, int64_t x_stride, const float *row_scale, float *out, int64_t n, int64_t m,
                      int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * m >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *g = x + i * x_stride, *u = g + m;
        const float rs = row_scale ? row_scale[i] : 1.f;
        float *o = out + i * m;
        int64_t j = 0;
#if defined(PAGEDQ_AVX512)
        const __m512 one16 = _mm512_set1_ps(1.f), rs16 = _mm512_set1_ps(rs);
        for (; j < m; j += 16) {
            const __mmask16 k = lanes16(m - j);
            const __m512 gv = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, g + j), rs16);
            const __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(one16, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_mask_storeu_ps(o + j, k, _mm512_mul_ps(sg, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, u + j), rs16)));
        }
#elif defined(PAGEDQ_AVX2)
        const __m256 one = _mm256_set1_ps(1.f), rs8 = _mm256_set1_ps(rs);
        for (; j + 8 <= m; j += 8) {
            const __m256 gv = _mm256_mul_ps(_mm256_loadu_ps(g + j), rs8);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(sg, _mm256_mul_ps(_mm256_loadu_ps(u + j), rs8)));
        }
#endif
        for (; j < m; j++) {
            const float gj = g[j] * rs;
            o[j] = gj / (1.f + expf(-gj)) * (u[j] * rs);
        }
    }
}

/* The dynamic per-token activation quantisation of a W8A8 linear (pagedq_kernels/w8a8_linear), row by row
 * (simd_math.h quantize_row_s8, which cpu_w8a8.c's fused entry point shares); torch took 5 passes (0.95 ms at
 * 2048 x 576). */
void quantize_rows_s8(const float *x, int64_t x_stride, int8_t *q, float *scales, int64_t n, int64_t k,
                      int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) scales[i] = quantize_row_s8(x + i * x_stride, q + i * k, k);
}

/* The lanes' best values `vals` and their first indices `idx` (width lanes) -> the row's maximum and the
 * smallest index holding it: a strict > per lane kept each lane's first occurrence, so the first overall is
 * the least index among the lanes that reached the maximum. */
static inline int64_t first_of_lanes(const float *vals, const int32_t *idx, int width, float *best)
{
    float mx = vals[0];
    int64_t at = idx[0];
    for (int l = 1; l < width; l++)
        if (vals[l] > mx || (vals[l] == mx && idx[l] < at)) { mx = vals[l]; at = idx[l]; }
    *best = mx;
    return at;
}

/* Per row of x [n, v] (row stride x_stride): its largest value into best[i] and the index of that value's
 * first occurrence into idx[i], which is torch.max(dim=1)'s answer, NaN included: a row holding a NaN has
 * NaN as its maximum, at the first NaN's index. The greedy sampler's argmax over the logits (engine/sampler.py):
 * torch's max took 1.17 ms over 64 x 49152 on 2 threads (AMD EPYC Zen 5), ~30 us a row where a row is 196 KB
 * still in the caches from the lm_head, and a speculative step verifies 9 rows per sequence.
 * One pass: per lane the running maximum and its index (a strict > keeps the lane's first), NaNs noted on the
 * way; a row with a NaN (rare: the sampler then fails the row) is scanned again for the first. Indices in
 * int32 lanes: v < 2^31. Measured there: 0.26 ms at 64 rows on 2 threads (12.6 MB read from L3: a second
 * chain of compare-and-blend changed nothing), 0.015 ms for one row (torch 0.03-0.05). */
void argmax_rows_f32(const float *x, int64_t x_stride, int64_t n, int64_t v, float *best, int64_t *idx,
                     int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * v >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * x_stride;
        int nan = 0;
        float mx = -INFINITY;
        int64_t at = 0;
#if defined(PAGEDQ_AVX512)
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 vm = ninf;
        __m512i vi = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = 0;
        for (int64_t j = 0; j < v; j += 16) {
            const __m512 val = _mm512_mask_loadu_ps(ninf, lanes16(v - j), r + j);
            const __mmask16 gt = _mm512_cmp_ps_mask(val, vm, _CMP_GT_OQ);
            vm = _mm512_mask_mov_ps(vm, gt, val);
            vi = _mm512_mask_mov_epi32(vi, gt, cur);
            unordered |= _mm512_cmp_ps_mask(val, val, _CMP_UNORD_Q);
            cur = _mm512_add_epi32(cur, step);
        }
        float vals[16];
        int32_t ids[16];
        _mm512_storeu_ps(vals, vm);
        _mm512_storeu_si512((void *)ids, vi);
        at = first_of_lanes(vals, ids, 16, &mx);
        nan = unordered != 0;
#elif defined(PAGEDQ_AVX2)
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        __m256 vm = ninf;
        __m256i vi = _mm256_setzero_si256(), cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(8);
        __m256 unordered = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= v; j += 8) {
            const __m256 val = _mm256_loadu_ps(r + j);
            const __m256 gt = _mm256_cmp_ps(val, vm, _CMP_GT_OQ);
            vm = _mm256_blendv_ps(vm, val, gt);
            vi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vi), _mm256_castsi256_ps(cur), gt));
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(val, val, _CMP_UNORD_Q));
            cur = _mm256_add_epi32(cur, step);
        }
        float vals[8];
        int32_t ids[8];
        _mm256_storeu_ps(vals, vm);
        _mm256_storeu_si256((__m256i *)ids, vi);
        at = first_of_lanes(vals, ids, 8, &mx);
        nan = _mm256_movemask_ps(unordered) != 0;
        for (; j < v; j++) {  /* the tail: later indices, so only a strictly larger value moves the answer */
            if (r[j] != r[j]) nan = 1;
            else if (r[j] > mx) { mx = r[j]; at = j; }
        }
#else
        for (int64_t j = 0; j < v; j++) {
            if (r[j] != r[j]) { nan = 1; break; }
            if (r[j] > mx) { mx = r[j]; at = j; }
        }
#endif
        if (nan) {
            for (int64_t j = 0; j < v; j++)
                if (r[j] != r[j]) { mx = r[j]; at = j; break; }
        }
        best[i] = mx;
        idx[i] = at;
    }
}
