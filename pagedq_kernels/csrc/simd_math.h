/* Shared SIMD helpers of pagedq's C kernels: AVX2/FMA when the compiler targets them (the
 * avx2 and avx512 builds of pagedq_kernels/c_build.py), and their 512-bit twins in the avx512 build
 * (PAGEDQ_AVX512). Also the bf16 <-> fp32 conversions of the bf16 KV cache, at every level. */
#ifndef PAGEDQ_SIMD_MATH_H
#define PAGEDQ_SIMD_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDQ_AVX2 1

/* exp for 8 lanes: Cephes-style range reduction and degree-5 polynomial (~1 ulp on [-87, 88]). */
static inline __m256 exp8(__m256 x)
{
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Lane u of the result = the horizontal sum of a_u. */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline float hsum1(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* In-place transpose of the 8x8 matrix whose rows are r[0..7]. */
static inline void transpose8(__m256 r[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

static inline float hmax1(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

#endif /* AVX2 */

#if defined(PAGEDQ_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define PAGEDQ_AVX512 1

/* exp8's polynomial on 16 lanes. */
static inline __m512 exp16(__m512 x)
{
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
    x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* exp for softmax numerators (cpu_attention.c's key-major prefill paths): 2^(x log2 e) as 2^n (vscalefps) times a
 * degree-5 polynomial of the fraction f (fitted on [-0.5, 0.5]: 3.1e-7 relative, ~3 ulp, against exp16's ~1), 9
 * vector operations instead of exp16's 17 (no clamping, exponent arithmetic or two-step reduction: vscalefps takes
 * a large n to 0 or inf itself, and f = x log2 e - n comes out of one fused multiply-subtract). With exp16 the
 * softmax took ~3.0 of 10.5 ms of 1 x 2048 tokens on the bf16 dot products (SmolLM2's heads, 2 threads, the phases
 * timed by skipping each). */
static inline __m512 exp16_scalef(__m512 x)
{
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_fmsub_ps(x, log2e, n); /* [-0.5, 0.5] */
    __m512 y = _mm512_set1_ps(1.3262854190e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6708433703e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5507130921e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022212625e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314700365e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}

/* The low `n` lanes (0 <= n, all 16 when n >= 16): the mask of a loop's last, partial vector. */
static inline __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* bf16 -> fp32 is exact: the 16 bits are the top half of the float. */
static inline __m512 load16_bf16(const uint16_t *p, __mmask16 m)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif /* AVX512 */

#ifdef PAGEDQ_AVX2
static inline __m256 load8_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* n bf16 values widened to fp32 (exact); the caches' rows go through here into L1-resident scratch. */
static inline void bf16_to_f32(const uint16_t *restrict src, float *restrict dst, int64_t n)
{
    int64_t i = 0;
#if defined(PAGEDQ_AVX512)
    for (; i < n; i += 16) _mm512_mask_storeu_ps(dst + i, lanes16(n - i), load16_bf16(src + i, lanes16(n - i)));
#elif defined(PAGEDQ_AVX2)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8_bf16(src + i));
#endif
    for (; i < n; i++) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, sizeof bits);
    }
}

/* fp32 -> bf16 rounded to nearest, ties to even, as torch rounds (the KV cache written here holds what
 * k.to(bfloat16) holds, bit for bit; NaN stays a quiet NaN: 0x7FC0, as c10's scalar conversion gives; ATen's
 * vector path gives 0xFFFF). Integer arithmetic, which gcc vectorises at every level. */
static inline void f32_to_bf16(const float *restrict src, uint16_t *restrict dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, src + i, sizeof bits);
        const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        dst[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)rounded;
    }
}

/* One row of RMSNorm after a residual add: ro = x + r (ro may be x itself), o = w * (ro / rms(ro)). The row
 * body of cpu_ops.c's rms_norm_f32 and of the matmul kernels' add-and-norm epilogues (cpu_gemm.c,
 * cpu_bf16_dp.c): one definition, so that the fused and the separate passes compute the same floats. */
static inline void add_rms_norm_row(const float *x, const float *r, const float *w, float *o, float *ro, int64_t h,
                                    float eps)
{
    #pragma omp simd
    for (int64_t j = 0; j < h; j++) ro[j] = x[j] + r[j];
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int64_t j = 0; j < h; j++) ss += ro[j] * ro[j];
    const float inv = 1.f / sqrtf(ss / (float)h + eps);
    #pragma omp simd
    for (int64_t j = 0; j < h; j++) o[j] = w[j] * (ro[j] * inv);
}

/* Symmetric int8 of one row of k floats: returns its scale amax / 127 and writes q[j] = round-half-even(x[j] *
 * (127 / amax)), the dynamic per-token activation quantisation of a W8A8 linear (pagedq_kernels/w8a8_linear; its
 * torch reference is op for op the same: one fp32 multiply by the reciprocal, so both round identically). A zero
 * row gets scale 0 and zeros. |x * 127/amax| <= 127 up to one rounding, so the saturating pack never clips. One
 * read of the row (its max), then a second from L1. */
static inline float quantize_row_s8(const float *xr, int8_t *qr, int64_t k)
{
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
    return amax / 127.f;
}

#endif /* PAGEDQ_SIMD_MATH_H */
