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

void paged_decode_attention_f32(
    const float *q, int64_t q_tok, int64_t q_head,
    const float *k_cache, const float *v_cache, float *out,
    const int64_t *rows, const int32_t *seq_lens, const int32_t *block_tables,
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim;          /* one token's K (or V) in a block */
    const int64_t block_stride = block_size * row_stride;

    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t len = seq_lens[s];
            const int32_t *table = block_tables + s * max_blocks;
            float *scores = (float *)malloc(sizeof(float) * group * (len > 0 ? len : 1));
            float *acc = out + (rows[s] * num_heads + h * group) * head_dim;
            const float *qg = q + rows[s] * q_tok + h * group * q_head;

            for (int64_t pos = 0; pos < len; pos++) {
                const float *k = k_cache + (int64_t)table[pos / block_size] * block_stride
                                 + (pos % block_size) * row_stride + h * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float *qq = qg + g * q_head;
                    float dot = 0.f;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qq[d] * k[d];
                    scores[g * len + pos] = dot * scale;
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
                memset(acc + g * head_dim, 0, sizeof(float) * head_dim);
            }
            for (int64_t pos = 0; pos < len; pos++) {
                const float *v = v_cache + (int64_t)table[pos / block_size] * block_stride
                                 + (pos % block_size) * row_stride + h * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * len + pos];
                    float *o = acc + g * head_dim;
                    #pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] += p * v[d];
                }
            }
            free(scores);
        }
    }
}
