/* Fused row-wise ops of the decoder on the CPU: RMSNorm (+ residual add), neox rotary (in place),
 * SiLU-and-mul. float32, OpenMP over rows.
 *
 * In torch each of these is 3-7 separate elementwise kernels, each a full pass over the activations
 * plus a dispatch; at decode batch sizes the dispatches dominate (RMSNorm on 128 x 576 took ~0.6 ms,
 * 50x its memory traffic), and at prefill sizes the extra passes do. One pass per row here.
 * The math follows the torch references in kernels/ op for op; only summation order differs.
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
        const float *r = xr;
        if (residual) {
            float *ro = res_out + i * h;
            const float *rr = residual + i * h;
            #pragma omp simd
            for (int64_t j = 0; j < h; j++) ro[j] = xr[j] + rr[j];
            r = ro;
        }
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < h; j++) ss += r[j] * r[j];
        const float inv = 1.f / sqrtf(ss / (float)h + eps);
        #pragma omp simd
        for (int64_t j = 0; j < h; j++) o[j] = w[j] * (r[j] * inv);
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
 * scale (kernels/w8a8_linear): applied here, on values already in registers, instead of one more pass over
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

/* Symmetric per-row int8: scales[i] = amax_i / 127, q[i, j] = round-half-even(x[i, j] * (127 / amax_i)),
 * the dynamic per-token activation quantisation of a W8A8 linear (kernels/w8a8_linear; its torch reference
 * is op for op the same: one fp32 multiply by the reciprocal, so both round identically). A zero row gets
 * scale 0 and zeros. |x * 127/amax| <= 127 up to one rounding, so the saturating pack never clips.
 * One read of each row (the max) then a second from L1; torch took 5 passes (0.95 ms at 2048 x 576). */
void quantize_rows_s8(const float *x, int64_t x_stride, int8_t *q, float *scales, int64_t n, int64_t k,
                      int num_threads)
{
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * x_stride;
        int8_t *qr = q + i * k;
        float amax = 0.f;
        int64_t j = 0;
#if defined(PAGEDQ_AVX512)
        __m512 vmax = _mm512_setzero_ps();
        for (; j < k; j += 16)
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes16(k - j), xr + j)));
        amax = _mm512_reduce_max_ps(vmax);
#else
        for (; j < k; j++) amax = fmaxf(amax, fabsf(xr[j]));
#endif
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        scales[i] = amax / 127.f;
        j = 0;
#if defined(PAGEDQ_AVX512)
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; j < k; j += 16) {
            const __mmask16 m = lanes16(k - j);
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), vinv));
            _mm_mask_storeu_epi8(qr + j, m, _mm512_cvtsepi32_epi8(v));
        }
#elif defined(PAGEDQ_AVX2)
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; j + 8 <= k; j += 8) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + j), vinv));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i *)(qr + j), _mm_packs_epi16(w, w));
        }
#endif
        for (; j < k; j++) qr[j] = (int8_t)lrintf(xr[j] * inv);
    }
}
