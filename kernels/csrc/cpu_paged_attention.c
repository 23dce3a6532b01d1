/* Paged attention for single-token (decode) queries on the CPU, reading K/V in place.
 *
 * Gathering each sequence's context into a contiguous tensor costs more than the attention itself
 * on a CPU (advanced indexing moves data at a fraction of memory bandwidth), so this kernel walks the
 * block table and reads every K/V row where it lies, once per (sequence, kv head), for all the query
 * heads that share that kv head (GQA/MQA). float32 only; the caller falls back to torch otherwise.
 *
 * Layouts: q [*, H, D] with strides (q_tok, q_head, 1); out [N, H, D] contiguous;
 * k_cache, v_cache [num_blocks, block_size, KVH, D] contiguous; block_tables [S, max_blocks].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

void paged_decode_attention_f32(
    const float *q, int64_t q_tok, int64_t q_head,
    const float *k_cache, const float *v_cache, float *out,
    const int64_t *rows, const int32_t *seq_lens, const int32_t *block_tables,
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * row_stride;

    /* One task per (sequence, kv head): the G query heads sharing that kv head are done together,
       so each K/V row is read once; 4 positions per inner step give the FMAs independent chains. */
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t len = seq_lens[s];
            if (len <= 0) continue;
            const int32_t *table = block_tables + s * max_blocks;
            float *scores = (float *)malloc(sizeof(float) * (group * len + group * head_dim));
            float *qs = scores + group * len;
            float *acc = out + (rows[s] * num_heads + h * group) * head_dim;
            const float *qg = q + rows[s] * q_tok + h * group * q_head;
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < head_dim; d++) qs[g * head_dim + d] = qg[g * q_head + d] * scale;

            const int64_t nblocks = (len + block_size - 1) / block_size;
            for (int64_t b = 0; b < nblocks; b++) {
                const float *kb = k_cache + (int64_t)table[b] * block_stride + h * head_dim;
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
                const float *vb = v_cache + (int64_t)table[b] * block_stride + h * head_dim;
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
            free(scores);
        }
    }
}
