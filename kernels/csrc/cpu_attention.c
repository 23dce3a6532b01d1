/* Paged attention on the CPU, reading K/V in place: single-token (decode) queries, and the causal
 * prefill chunks of a step (paged_prefill_attention_f32, at the end of this file).
 *
 * Gathering each sequence's context into a contiguous tensor costs more than the attention itself
 * on a CPU (advanced indexing moves data at a fraction of memory bandwidth), so this kernel walks the
 * block table and reads every K/V row where it lies, once per (sequence, kv head), for all the query
 * heads that share that kv head (GQA/MQA). float32 only; the caller falls back to torch otherwise.
 *
 * Layouts: q [*, H, D] with strides (q_tok, q_head, 1); out [N, H, D] contiguous;
 * k_cache, v_cache [num_blocks, block_size, KVH, D] contiguous; block_tables [S, max_blocks].
 *
 * Two implementations of one (sequence, kv head) task: an AVX2/FMA one for head_dim % 8 == 0 (every
 * model pagedq ships for) and a portable one. The AVX2 one computes 8 scores at a time with 8
 * independent FMA chains folded by a horizontal-add tree, and exponentiates 8 lanes at a time: the
 * portable loop's per-row horizontal reductions and scalar expf ran at 2.6 GB/s of KV, a fraction
 * of what memory delivers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gemm_tile.h"
#include "simd_math.h"

/* Dot products of one query row with 4 key rows at once: 4 independent accumulator chains. */
static inline void dot4(const float *restrict qq, const float *restrict k0, const float *restrict k1,
                        const float *restrict k2, const float *restrict k3, int64_t n, float *restrict r)
{
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    #pragma omp simd reduction(+:a0, a1, a2, a3)
    for (int64_t d = 0; d < n; d++) {
        a0 += qq[d] * k0[d]; a1 += qq[d] * k1[d]; a2 += qq[d] * k2[d]; a3 += qq[d] * k3[d];
    }
    r[0] = a0; r[1] = a1; r[2] = a2; r[3] = a3;
}

static inline float dot1(const float *restrict qq, const float *restrict k, int64_t n)
{
    float a = 0.f;
    #pragma omp simd reduction(+:a)
    for (int64_t d = 0; d < n; d++) a += qq[d] * k[d];
    return a;
}

typedef struct {
    const float *q; int64_t q_tok, q_head;
    const float *k_cache, *v_cache; float *out;
    const int64_t *rows; const int32_t *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} attn_args;

/* Where one (sequence s, kv head h) task reads and writes. */
typedef struct {
    int64_t group, len, nblocks, rs, block_stride;
    const int32_t *table;  /* the sequence's block table */
    float *acc;            /* out rows of the group's query heads */
    const float *qg;       /* q of the group's first query head */
} task_view;

static inline task_view view_of(const attn_args *a, int64_t s, int64_t h)
{
    task_view v;
    v.group = a->num_heads / a->num_kv_heads;
    v.len = a->seq_lens[s];
    v.nblocks = (v.len + a->block_size - 1) / a->block_size;
    v.rs = a->num_kv_heads * a->head_dim;
    v.block_stride = a->block_size * v.rs;
    v.table = a->block_tables + s * a->max_blocks;
    v.acc = a->out + (a->rows[s] * a->num_heads + h * v.group) * a->head_dim;
    v.qg = a->q + a->rows[s] * a->q_tok + h * v.group * a->q_head;
    return v;
}

/* Portable task: any head_dim. `scores` holds group * len floats, `qs` group * head_dim. */
static void task_generic(const attn_args *a, int64_t s, int64_t h, float *scores, float *qs)
{
    const task_view tv = view_of(a, s, h);
    const int64_t group = tv.group, head_dim = a->head_dim, block_size = a->block_size;
    const int64_t row_stride = tv.rs, block_stride = tv.block_stride, len = tv.len, nblocks = tv.nblocks;
    const int32_t *table = tv.table;
    float *acc = tv.acc;
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) qs[g * head_dim + d] = tv.qg[g * a->q_head + d] * a->scale;

    for (int64_t b = 0; b < nblocks; b++) {
        const float *kb = a->k_cache + (int64_t)table[b] * block_stride + h * head_dim;
        const int64_t n = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const int64_t base = b * block_size;
        for (int64_t g = 0; g < group; g++) {
            const float *qq = qs + g * head_dim;
            float *sc = scores + g * len + base;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4)
                dot4(qq, kb + t * row_stride, kb + (t + 1) * row_stride, kb + (t + 2) * row_stride,
                     kb + (t + 3) * row_stride, head_dim, sc + t);
            for (; t < n; t++) sc[t] = dot1(qq, kb + t * row_stride, head_dim);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sc = scores + g * len;
        float mx = -INFINITY;
        for (int64_t pos = 0; pos < len; pos++) mx = sc[pos] > mx ? sc[pos] : mx;
        float sum = 0.f;
        for (int64_t pos = 0; pos < len; pos++) { sc[pos] = expf(sc[pos] - mx); sum += sc[pos]; }
        const float inv = 1.f / sum;
        for (int64_t pos = 0; pos < len; pos++) sc[pos] *= inv;
    }
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int64_t b = 0; b < nblocks; b++) {
        const float *vb = a->v_cache + (int64_t)table[b] * block_stride + h * head_dim;
        const int64_t n = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const int64_t base = b * block_size;
        for (int64_t g = 0; g < group; g++) {
            const float *sc = scores + g * len + base;
            float *restrict o = acc + g * head_dim;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {
                const float p0 = sc[t], p1 = sc[t + 1], p2 = sc[t + 2], p3 = sc[t + 3];
                const float *v0 = vb + t * row_stride, *v1 = v0 + row_stride;
                const float *v2 = v1 + row_stride, *v3 = v2 + row_stride;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
            }
            for (; t < n; t++) {
                const float p = sc[t];
                const float *v = vb + t * row_stride;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * v[d];
            }
        }
    }
}

#ifdef PAGEDQ_AVX2
/* AVX2 task: head_dim % 8 == 0. */
static void task_avx2(const attn_args *a, int64_t s, int64_t h, float *scores, float *qs)
{
    const task_view tv = view_of(a, s, h);
    const int64_t group = tv.group, D = a->head_dim, block_size = a->block_size;
    const int64_t rs = tv.rs, block_stride = tv.block_stride, len = tv.len, nblocks = tv.nblocks;
    const int32_t *table = tv.table;
    float *acc = tv.acc;
    const float *qg = tv.qg;
    const __m256 vscale = _mm256_set1_ps(a->scale);
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(qs + g * D + c, _mm256_mul_ps(_mm256_loadu_ps(qg + g * a->q_head + c), vscale));

    for (int64_t b = 0; b < nblocks; b++) {
        const float *kb = a->k_cache + (int64_t)table[b] * block_stride + h * D;
        const int64_t n = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const int64_t base = b * block_size;
        for (int64_t g = 0; g < group; g++) {
            const float *qq = qs + g * D;
            float *sc = scores + g * len + base;
            int64_t t = 0;
            for (; t + 8 <= n; t += 8) {
                const float *k0 = kb + t * rs;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int64_t c = 0; c < D; c += 8) {
                    const __m256 qv = _mm256_loadu_ps(qq + c);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + rs + c), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * rs + c), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * rs + c), a3);
                    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 4 * rs + c), a4);
                    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 5 * rs + c), a5);
                    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 6 * rs + c), a6);
                    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 7 * rs + c), a7);
                }
                _mm256_storeu_ps(sc + t, hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7));
            }
            for (; t < n; t++) {
                const float *kr = kb + t * rs;
                __m256 a0 = _mm256_setzero_ps();
                for (int64_t c = 0; c < D; c += 8)
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qq + c), _mm256_loadu_ps(kr + c), a0);
                sc[t] = hsum1(a0);
            }
        }
    }
    /* Softmax numerators; the 1/sum is applied to the output at the end. */
    float inv[64];
    for (int64_t g = 0; g < group; g++) {
        float *sc = scores + g * len;
        __m256 vmx = _mm256_set1_ps(-INFINITY);
        int64_t pos = 0;
        for (; pos + 8 <= len; pos += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + pos));
        float mx = -INFINITY;
        {
            float lanes[8];
            _mm256_storeu_ps(lanes, vmx);
            for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
        }
        for (; pos < len; pos++) mx = sc[pos] > mx ? sc[pos] : mx;
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        pos = 0;
        for (; pos + 8 <= len; pos += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + pos), vm));
            _mm256_storeu_ps(sc + pos, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum1(vsum);
        for (; pos < len; pos++) { sc[pos] = expf(sc[pos] - mx); sum += sc[pos]; }
        inv[g] = 1.f / sum;
    }
    memset(acc, 0, sizeof(float) * group * D);
    for (int64_t b = 0; b < nblocks; b++) {
        const float *vb = a->v_cache + (int64_t)table[b] * block_stride + h * D;
        const int64_t n = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const int64_t base = b * block_size;
        for (int64_t g = 0; g < group; g++) {
            const float *sc = scores + g * len + base;
            float *o = acc + g * D;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {
                const __m256 p0 = _mm256_set1_ps(sc[t]), p1 = _mm256_set1_ps(sc[t + 1]);
                const __m256 p2 = _mm256_set1_ps(sc[t + 2]), p3 = _mm256_set1_ps(sc[t + 3]);
                const float *v0 = vb + t * rs;
                for (int64_t c = 0; c < D; c += 8) {
                    __m256 x = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + c), _mm256_loadu_ps(o + c));
                    __m256 y = _mm256_mul_ps(p1, _mm256_loadu_ps(v0 + rs + c));
                    x = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v0 + 2 * rs + c), x);
                    y = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v0 + 3 * rs + c), y);
                    _mm256_storeu_ps(o + c, _mm256_add_ps(x, y));
                }
            }
            for (; t < n; t++) {
                const __m256 p = _mm256_set1_ps(sc[t]);
                const float *v = vb + t * rs;
                for (int64_t c = 0; c < D; c += 8)
                    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c), _mm256_loadu_ps(o + c)));
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const __m256 vi = _mm256_set1_ps(inv[g]);
        for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(acc + g * D + c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + c), vi));
    }
}
#endif

void paged_decode_attention_f32(
    const float *q, int64_t q_tok, int64_t q_head,
    const float *k_cache, const float *v_cache, float *out,
    const int64_t *rows, const int32_t *seq_lens, const int32_t *block_tables,
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int num_threads)
{
    const attn_args a = {q, q_tok, q_head, k_cache, v_cache, out, rows, seq_lens, block_tables,
                         max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale};
    const int64_t group = num_heads / num_kv_heads;
    int use_avx2 = 0;
#ifdef PAGEDQ_AVX2
    use_avx2 = head_dim % 8 == 0 && group <= 64;
#endif
    int64_t max_len = 0;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;

    /* One task per (sequence, kv head): the G query heads sharing that kv head are done together,
       so each K/V row is read from memory once. (Measured: one task per sequence, and software
       prefetching of the next block, changed nothing beyond noise; the hardware prefetchers cope.)
       Scratch is per thread, sized for the longest context. */
    #pragma omp parallel num_threads(num_threads)
    {
        float *scratch = (float *)malloc(sizeof(float) * (group * max_len + group * head_dim + 8));
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                if (seq_lens[s] <= 0) continue;
                float *scores = scratch, *qs = scratch + group * max_len;
#ifdef PAGEDQ_AVX2
                if (use_avx2) { task_avx2(&a, s, h, scores, qs); continue; }
#endif
                (void)use_avx2;
                task_generic(&a, s, h, scores, qs);
            }
        }
        free(scratch);
    }
}

/* ---- Prefill: causal attention of each sequence's chunk of new queries over its cached context.
 *
 * Sequence i's q_lens[i] queries are the flattened rows q_starts[i]... at positions
 * seq_lens[i] - q_lens[i] ... seq_lens[i] - 1, and attend to cache positions 0..their own (the
 * chunk's K/V are already in the cache). One task = (sequence, kv head, tile of QT positions): the
 * G query heads sharing the kv head give R = G * QT rows, so every K/V row is read once per tile.
 * Flash-style: keys in chunks of KC = 16; S = Q K^T and P V run through the GEMM register tile
 * (gemm_tile.h) on a transposed copy of the chunk's keys and a copy of its values, with an online
 * softmax in between. torch's CPU flash SDPA ran these shapes at ~40 GFLOP/s on 2 EPYC cores and
 * needed each context gathered out of the cache first. AVX2 and head_dim % 16 == 0 only: the caller
 * keeps torch's SDPA otherwise (paged_prefill_attention_supported). */
#define QT 16
#define KC 16

int paged_prefill_attention_supported(int64_t head_dim)
{
#ifdef PAGEDQ_AVX2
    return head_dim % KC == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

#ifdef PAGEDQ_AVX2
typedef struct {
    const float *q; int64_t q_tok, q_head;
    const float *k_cache, *v_cache; float *out;
    const int64_t *q_starts; const int32_t *q_lens, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} prefill_args;

/* Scratch of one thread, for R rows: Qs, O, T [R, D]; S [R, KC]; m, l, alpha [R]; Kt [D, KC]; Vc [KC, D]. */
static void prefill_task(const prefill_args *a, int64_t s, int64_t h, int64_t t0, float *scratch)
{
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads, bs = a->block_size;
    const int64_t rs = a->num_kv_heads * D, q_len = a->q_lens[s];
    const int64_t nq = q_len - t0 < QT ? q_len - t0 : QT, R = G * nq;
    const int64_t p0 = a->seq_lens[s] - q_len + t0, p_last = p0 + nq - 1;
    const int32_t *table = a->block_tables + s * a->max_blocks;
    float *Qs = scratch, *O = Qs + R * D, *T = O + R * D, *S = T + R * D;
    float *m = S + R * KC, *l = m + R, *alpha = l + R, *Kt = alpha + R, *Vc = Kt + D * KC;

    for (int64_t g = 0; g < G; g++)  /* row r = g * nq + i: query i of head h * G + g */
        for (int64_t i = 0; i < nq; i++) {
            const float *src = a->q + (a->q_starts[s] + t0 + i) * a->q_tok + (h * G + g) * a->q_head;
            float *dst = Qs + (g * nq + i) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * a->scale;
        }
    for (int64_t r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    memset(O, 0, sizeof(float) * R * D);
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_ps(8.f);

    for (int64_t c0 = 0; c0 <= p_last; c0 += KC) {
        const int64_t nk = p_last + 1 - c0 < KC ? p_last + 1 - c0 : KC;
        for (int64_t j = 0; j < KC; j++) {
            if (j < nk) {
                const int64_t pos = c0 + j;
                const int64_t off = ((int64_t)table[pos / bs] * bs + pos % bs) * rs + h * D;
                const float *kr = a->k_cache + off;
                for (int64_t d = 0; d < D; d++) Kt[d * KC + j] = kr[d];
                memcpy(Vc + j * D, a->v_cache + off, sizeof(float) * D);
            } else {
                for (int64_t d = 0; d < D; d++) Kt[d * KC + j] = 0.f;
                memset(Vc + j * D, 0, sizeof(float) * D);
            }
        }
        for (int64_t r = 0; r < R; r += MR)  /* S = Qs Kt */
            tile_rows((int)(R - r < MR ? R - r : MR), Qs + r * D, D, Kt, KC, D, S + r * KC, KC, NULL, KC, 0);
        const int masked = c0 + KC - 1 > p0;  /* some key of the chunk is past some query */
        for (int64_t r = 0; r < R; r++) {
            float *sr = S + r * KC;
            __m256 s0 = _mm256_loadu_ps(sr), s1 = _mm256_loadu_ps(sr + 8);
            __m256 ok0 = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), ok1 = ok0;
            if (masked) {  /* key c0 + j visible to the query at position p iff c0 + j <= p */
                const __m256 lim = _mm256_set1_ps((float)(p0 + r % nq - c0));
                ok0 = _mm256_cmp_ps(iota, lim, _CMP_LE_OQ);
                ok1 = _mm256_cmp_ps(_mm256_add_ps(iota, eight), lim, _CMP_LE_OQ);
                s0 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s0, ok0);
                s1 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s1, ok1);
            }
            float lanes[8], mx = m[r];
            _mm256_storeu_ps(lanes, _mm256_max_ps(s0, s1));
            for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
            const __m256 vm = _mm256_set1_ps(mx);
            const __m256 p0v = _mm256_and_ps(exp8(_mm256_sub_ps(s0, vm)), ok0);
            const __m256 p1v = _mm256_and_ps(exp8(_mm256_sub_ps(s1, vm)), ok1);
            _mm256_storeu_ps(sr, p0v);
            _mm256_storeu_ps(sr + 8, p1v);
            alpha[r] = m[r] == -INFINITY ? 0.f : expf(m[r] - mx);
            l[r] = l[r] * alpha[r] + hsum1(_mm256_add_ps(p0v, p1v));
            m[r] = mx;
        }
        for (int64_t c = 0; c < D; c += KC)  /* T = P Vc, 16 output dims at a time */
            for (int64_t r = 0; r < R; r += MR)
                tile_rows((int)(R - r < MR ? R - r : MR), S + r * KC, KC, Vc + c, D, KC, T + r * D + c, D, NULL, KC, 0);
        for (int64_t r = 0; r < R; r++) {  /* O = O * alpha + T */
            const __m256 al = _mm256_set1_ps(alpha[r]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(O + r * D + d, _mm256_fmadd_ps(_mm256_loadu_ps(O + r * D + d), al,
                                                                _mm256_loadu_ps(T + r * D + d)));
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t r = g * nq + i;
            float *dst = a->out + ((a->q_starts[s] + t0 + i) * a->num_heads + h * G + g) * D;
            const __m256 inv = _mm256_set1_ps(1.f / l[r]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(O + r * D + d), inv));
        }
}
#endif

/* out [N, H, D] contiguous; q, caches as for decode. Requires paged_prefill_attention_supported(). */
void paged_prefill_attention_f32(
    const float *q, int64_t q_tok, int64_t q_head,
    const float *k_cache, const float *v_cache, float *out,
    const int64_t *q_starts, const int32_t *q_lens, const int32_t *seq_lens, const int32_t *block_tables,
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int num_threads)
{
#ifdef PAGEDQ_AVX2
    const prefill_args a = {q, q_tok, q_head, k_cache, v_cache, out, q_starts, q_lens, seq_lens,
                            block_tables, max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale};
    const int64_t G = num_heads / num_kv_heads, R = G * QT, D = head_dim;
    int64_t num_tasks = 0;
    for (int64_t s = 0; s < num_seqs; s++) num_tasks += num_kv_heads * ((q_lens[s] + QT - 1) / QT);
    int64_t *tasks = (int64_t *)malloc(sizeof(int64_t) * 3 * (num_tasks ? num_tasks : 1));
    int64_t t = 0;
    /* Latest tiles first: they attend to the most keys, and dynamic scheduling then balances the rest. */
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t0 = ((q_lens[s] + QT - 1) / QT - 1) * QT; t0 >= 0; t0 -= QT)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                tasks[3 * t] = s; tasks[3 * t + 1] = h; tasks[3 * t + 2] = t0; t++;
            }
    #pragma omp parallel num_threads(num_threads)
    {
        float *scratch = (float *)malloc(sizeof(float) * (3 * R * D + R * KC + 3 * R + 2 * D * KC + 16));
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++) prefill_task(&a, tasks[3 * i], tasks[3 * i + 1], tasks[3 * i + 2], scratch);
        free(scratch);
    }
    free(tasks);
#else
    (void)q; (void)q_tok; (void)q_head; (void)k_cache; (void)v_cache; (void)out; (void)q_starts;
    (void)q_lens; (void)seq_lens; (void)block_tables; (void)num_seqs; (void)max_blocks; (void)num_heads;
    (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)num_threads;
#endif
}
