/* One call of pagedq's CPU attention kernel (pagedq_kernels/csrc/cpu_attention.c) from a file, for
 * tests/test_arm_kernels.py: cross-compiled for AArch64 with the kernel and run under qemu, so the build an ARM
 * server loads (c_build's `native` variant) is executed and its results checked against torch on this host.
 *
 *   harness IN OUT
 *
 * IN: 12 int64 (kind: 0 decode, 1 prefill; tokens N; heads H; kv heads KVH; head_dim D; cache blocks NB;
 * block_size BS; sequences S; max_blocks MB; kv_bf16; threads; scale as float bits), then q [N, H, D] float32,
 * k_cache and v_cache [NB, BS, KVH, D] (float32, or bf16 bits when kv_bf16), rows or q_starts int64 [S],
 * q_lens int32 [S] (prefill only), seq_lens int32 [S], block_tables int32 [S, MB]. OUT: out [N, H, D] float32.
 * Exit status 0, or 2 with a line on stderr. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int paged_decode_attention_f32(const float *q, int64_t q_tok, int64_t q_head, const void *k_cache,
                               const void *v_cache, float *out, const int64_t *rows, const int32_t *seq_lens,
                               const int32_t *block_tables, const int32_t *q_lens, int64_t num_seqs,
                               int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale, int kv_bf16, int use_dp, int cascade,
                               int num_threads);
void paged_prefill_attention_f32(const float *q, int64_t q_tok, int64_t q_head, const void *k_cache,
                                 const void *v_cache, float *out, const int64_t *q_starts, const int32_t *q_lens,
                                 const int32_t *seq_lens, const int32_t *block_tables, int64_t num_seqs,
                                 int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int kv_bf16, int use_dp, int num_threads);

static void *read_exactly(FILE *f, size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "harness: input ended early\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: harness IN OUT\n");
        return 2;
    }
    FILE *in = fopen(argv[1], "rb");
    if (!in) {
        fprintf(stderr, "harness: cannot open %s\n", argv[1]);
        return 2;
    }
    int64_t *h = (int64_t *)read_exactly(in, 12 * sizeof(int64_t));
    const int64_t kind = h[0], n = h[1], heads = h[2], kvh = h[3], d = h[4], nb = h[5], bs = h[6], s = h[7];
    const int64_t mb = h[8], kv_bf16 = h[9], threads = h[10];
    float scale;
    const int32_t scale_bits = (int32_t)h[11];
    memcpy(&scale, &scale_bits, sizeof scale);
    const size_t cache_bytes = (size_t)(nb * bs * kvh * d) * (kv_bf16 ? 2 : 4);
    float *q = (float *)read_exactly(in, sizeof(float) * n * heads * d);
    void *k_cache = read_exactly(in, cache_bytes), *v_cache = read_exactly(in, cache_bytes);
    int64_t *rows = (int64_t *)read_exactly(in, sizeof(int64_t) * s);
    int32_t *q_lens = kind == 1 ? (int32_t *)read_exactly(in, sizeof(int32_t) * s) : NULL;
    int32_t *seq_lens = (int32_t *)read_exactly(in, sizeof(int32_t) * s);
    int32_t *tables = (int32_t *)read_exactly(in, sizeof(int32_t) * s * mb);
    fclose(in);
    float *out = (float *)calloc((size_t)(n * heads * d), sizeof(float));
    if (kind == 1)
        paged_prefill_attention_f32(q, heads * d, d, k_cache, v_cache, out, rows, q_lens, seq_lens, tables, s, mb,
                                    heads, kvh, d, bs, scale, (int)kv_bf16, 0, (int)threads);
    else if (paged_decode_attention_f32(q, heads * d, d, k_cache, v_cache, out, rows, seq_lens, tables, NULL, s, mb,
                                        heads, kvh, d, bs, scale, (int)kv_bf16, 0, 1, (int)threads) != 0) {
        fprintf(stderr, "harness: the decode kernel refused the call\n");
        return 2;
    }
    FILE *o = fopen(argv[2], "wb");
    if (!o || fwrite(out, sizeof(float), (size_t)(n * heads * d), o) != (size_t)(n * heads * d)) {
        fprintf(stderr, "harness: cannot write %s\n", argv[2]);
        return 2;
    }
    fclose(o);
    return 0;
}
