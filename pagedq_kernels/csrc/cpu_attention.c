/* Paged attention on the CPU, reading K/V in place: single-token (decode) queries, and the causal
 * prefill chunks of a step (paged_prefill_attention_f32, at the end of this file).
 *
 * Gathering each sequence's context into a contiguous tensor costs more than the attention itself
 * on a CPU (advanced indexing moves data at a fraction of memory bandwidth), so this kernel walks the
 * block table and reads every K/V row once per step, block by block, for all the query heads that
 * share its kv head (GQA/MQA). float32 queries and arithmetic (caches float32 or bfloat16, below); the
 * caller falls back to torch otherwise.
 * Where many decode sequences start with the same blocks (a cached prompt prefix), those are attended
 * once for all of them (cascade attention, see decode_cascade_blocks) and merged into each.
 *
 * Layouts: q [*, H, D] with strides (q_tok, q_head, 1); out [N, H, D] contiguous;
 * k_cache, v_cache [num_blocks, block_size, KVH, D] contiguous; block_tables [S, max_blocks] (decode: max_blocks
 * 0 gives every sequence the same table, prefill_as_decodes' rows).
 *
 * The caches hold float32, or bfloat16 with kv_bf16 set (half the bytes a step reads, and twice the
 * blocks in the same memory). In the avx512 build, decode reads the cache in place, either dtype
 * (task_in_place: bf16 widened in registers), and prefill an fp32 cache (flash_rows_km); elsewhere every K/V
 * row passes through kv_block (or flash_rows' copies) on its way in: bf16 rows are widened to fp32 there, into the L1-resident staging the fp32 path
 * already copies through. Either way the arithmetic is fp32, and widening is exact (a bf16 is the top
 * half of a float), so a bf16 cache gives what the fp32 kernels give on the same values, to float
 * rounding (the order of the sums differs between tasks). The one exception: over a bf16 cache where
 * AVX512-bf16 runs (use_dp, from pagedq_kernels/cpu_attention.py dp_attention_enabled;
 * PAGEDQ_DISABLE_DP_ATTENTION=1 turns it off), both kernels do their products on bf16 dot products
 * (VDPBF16PS: decode's task_in_place_dp, prefill's flash_rows_dp): q and the softmax numerators rounded
 * to bf16 as bf16 flash attention rounds them, K/V read as they are, fp32 sums and softmax. Prefill runs
 * ~2x the fp32 path's speed there; decode, memory bound, ~10-20% (most in a verify step's 9 queries).
 *
 * Below the avx512 build, two implementations of one (sequence, kv head) task: an AVX2/FMA one for
 * head_dim % 8 == 0 (every model pagedq ships for) and a portable one. The AVX2 one computes 4 scores for up to 3
 * query rows of a kv head at a time, 12 independent FMA chains folded by horizontal-add trees, and exponentiates 8
 * lanes at a time: the
 * portable loop's per-row horizontal reductions and scalar expf ran at 2.6 GB/s of KV, a fraction
 * of what memory delivers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* The tiles here multiply L1-resident scratch: prefetching ahead of a packed weight panel would
   only pull unrelated lines into L1. */
#define PF 0
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
    const void *k_cache, *v_cache; float *out;
    const int64_t *rows; const int32_t *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t num_seqs;
    /* Cascade: blocks 0..prefix_blocks-1 of every table are the same physical blocks; their partial
       attention (unnormalised output [S, H, D], running max and sum [S, H]) is computed once for all
       sequences (prefix_task) and each task merges it with its own positions. 0: no shared prefix. */
    int64_t prefix_blocks;
    float *prefix_o, *prefix_m, *prefix_l;
    int kv_bf16;
    /* Query tokens per sequence (NULL: one each). Sequence s's q_lens[s] queries are rows rows[s]... at its
       last q_lens[s] positions, causal among themselves: the verification rows of speculative drafts, or a
       short prefill chunk. Only task_in_place takes more than one (paged_decode_multi_query_supported). */
    const int32_t *q_lens;
} attn_args;

/* One block's rows 0..n-1 (row stride rs floats) of `cache`, columns col0..col0+cols-1 needed, as fp32.
 * fp32 without `copy_to`: read in place. With it: copied there in memory order (fp32) or widened (bf16),
 * at the same offsets, and the next block (`next`, -1: none) is prefetched meanwhile, into L2 (prefetch_lines'
 * comment), when whole rows are copied. bf16 always needs `copy_to`. Returns the block's row 0, column 0. */
static inline const float *kv_block(const void *cache, int bf16, int64_t block, int64_t next, int64_t block_stride,
                                    int64_t n, int64_t rs, int64_t col0, int64_t cols, float *copy_to)
{
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const char *rows = (const char *)cache + (size_t)(block * block_stride) * elem;
    if (!copy_to) return (const float *)rows;
    if (!bf16) {
        memcpy(copy_to, rows, sizeof(float) * n * rs);
    } else if (cols == rs) {
        bf16_to_f32((const uint16_t *)rows, copy_to, n * rs);
    } else {
        for (int64_t t = 0; t < n; t++)
            bf16_to_f32((const uint16_t *)rows + t * rs + col0, copy_to + t * rs + col0, cols);
    }
    if (next >= 0 && cols == rs) {
        const char *nb = (const char *)cache + (size_t)(next * block_stride) * elem;
        for (size_t off = 0; off < (size_t)block_stride * elem; off += 64) __builtin_prefetch(nb + off, 0, 1);
    }
    return copy_to;
}

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

/* Portable task: any head_dim. `scores` holds group * len floats, `qs` group * head_dim, `staging` (a bf16
 * cache's widened block) block_size * KVH * head_dim. */
static void task_generic(const attn_args *a, int64_t s, int64_t h, float *scores, float *qs, float *staging)
{
    const task_view tv = view_of(a, s, h);
    const int64_t group = tv.group, head_dim = a->head_dim, block_size = a->block_size;
    const int64_t row_stride = tv.rs, block_stride = tv.block_stride, len = tv.len, nblocks = tv.nblocks;
    const int32_t *table = tv.table;
    float *acc = tv.acc;
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) qs[g * head_dim + d] = tv.qg[g * a->q_head + d] * a->scale;

    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const float *kb = kv_block(a->k_cache, a->kv_bf16, table[b], -1, block_stride, n, row_stride, h * head_dim,
                                   head_dim, a->kv_bf16 ? staging : NULL) + h * head_dim;
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
        const int64_t n = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const float *vb = kv_block(a->v_cache, a->kv_bf16, table[b], -1, block_stride, n, row_stride, h * head_dim,
                                   head_dim, a->kv_bf16 ? staging : NULL) + h * head_dim;
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

/* A block's lines requested a few at a time, spread over the work on the block before it (the walk keeps
 * its row and line counters: no division per line), into L2 (locality 1: PREFETCHT2), not L1. On a 2-vCPU
 * AMD EPYC Zen 4 (family 25 model 17) a prefetch into L1 (PREFETCHT0) held an L1 miss buffer per line until
 * it landed, and the kernel's own loads queued behind a block's worth of them: ops/bench/kernel_timing.py
 * --only decode, 64 seqs x 350 over 30 layers' caches (random block tables), ms, T0 -> T2: bf16 cache
 * avx512_bf16 1.038 -> 0.661 (16.6 -> 26 GB/s of K/V), avx512 1.024 -> 0.648, avx2 (staging, kv_block's
 * whole-block prefetch) 1.884 -> 1.295; fp32 cache avx512 1.758 -> 1.147 (19.6 -> 30 GB/s), 64 x 700
 * 2.806 -> 1.495. A pure 2-thread read of random 6 KB blocks there: no prefetch 13.3 GB/s, T0 one block
 * ahead 11.4, T1 18.8, T2 20.1 (NTA: as slow as none). In the compass bench's engine (no drafts; its
 * blocks more often adjacent, so the hardware prefetchers help either way), decode attention, s, T0 vs T2
 * in interleaved runs: bf16 3.33 / 3.47 / 3.13 vs 2.93 / 3.27 / 3.03; fp32 4.55 / 4.84 / 5.37 vs 5.44 /
 * 4.55 / 4.64 (the host's noise). On the Xeon (family 6 model 167) T2 measured within the noise of T0. */
typedef struct {
    const char *row;               /* the current row's first byte of the task's columns */
    int64_t row_stride;            /* bytes between rows */
    int64_t lines_per_row, col, left; /* lines per row, the next line within the row, lines still to request */
} prefetcher;

/* Rows 0..n-1 of `block` (NULL: nothing to fetch), columns col0..col0+cols-1 of rs per row (whole rows:
 * one contiguous range). */
static inline prefetcher prefetch_plan(const void *block, int64_t n, int64_t rs, int64_t col0, int64_t cols,
                                       int64_t esize)
{
    prefetcher p;
    int64_t row_bytes;
    p.row = block ? (const char *)block + col0 * esize : NULL;
    if (cols == rs) { row_bytes = n * rs * esize; p.row_stride = 0; n = 1; }
    else { row_bytes = cols * esize; p.row_stride = rs * esize; }
    p.lines_per_row = (row_bytes + 63) / 64;
    p.left = block ? p.lines_per_row * n : 0;
    p.col = 0;
    return p;
}

static inline void prefetch_lines(prefetcher *p, int64_t k)
{
    for (; k > 0 && p->left > 0; k--, p->left--) {
        __builtin_prefetch(p->row + p->col * 64, 0, 1);
        if (++p->col == p->lines_per_row) { p->col = 0; p->row += p->row_stride; }
    }
}

#ifdef PAGEDQ_AVX2
/* Scores of NQ (<= 3) query rows (qq, qq + D, ...) that share one kv head against its 4 key rows k0 + u * rs:
 * each key vector loaded once feeds the NQ rows' FMAs (12 chains, 3 query vectors: 16 ymm), and row i's 4
 * scores go to sc[i * stride + 0..3]. */
static inline __attribute__((always_inline)) void scores_gqa4(const int NQ, const float *qq, int64_t D, const float *k0,
                                                              int64_t rs, float *sc, int64_t stride)
{
    __m256 acc[3][4];
    for (int i = 0; i < NQ; i++)
        for (int u = 0; u < 4; u++) acc[i][u] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
        __m256 q[3];
        for (int i = 0; i < NQ; i++) q[i] = _mm256_loadu_ps(qq + i * D + c);
        for (int u = 0; u < 4; u++) {
            const __m256 k = _mm256_loadu_ps(k0 + u * rs + c);
            for (int i = 0; i < NQ; i++) acc[i][u] = _mm256_fmadd_ps(q[i], k, acc[i][u]);
        }
    }
    for (int i = 0; i < NQ; i++) _mm_storeu_ps(sc + i * stride, hsum4x8(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
}

/* The same for one key row: row i's score to sc[i * stride]. */
static inline __attribute__((always_inline)) void scores_gqa1(const int NQ, const float *qq, int64_t D, const float *k0,
                                                              float *sc, int64_t stride)
{
    __m256 acc[3];
    for (int i = 0; i < NQ; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
        const __m256 k = _mm256_loadu_ps(k0 + c);
        for (int i = 0; i < NQ; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qq + i * D + c), k, acc[i]);
    }
    for (int i = 0; i < NQ; i++) sc[i * stride] = hsum1(acc[i]);
}

/* o rows i < NQ (stride D), columns c..c+8W-1: += sum over t < n of p[i * stride + t] * v_t[c..], the value
 * rows v0 + t * rs. Each value vector loaded once feeds the NQ rows; the NQ x W sums stay in registers across
 * the block's rows. */
static inline __attribute__((always_inline)) void values_gqa(const int NQ, const int W, const float *p, int64_t stride,
                                                             const float *v0, int64_t rs, int64_t n, float *o, int64_t D)
{
    __m256 acc[3][2];
    for (int i = 0; i < NQ; i++)
        for (int w = 0; w < W; w++) acc[i][w] = _mm256_loadu_ps(o + i * D + 8 * w);
    for (int64_t t = 0; t < n; t++) {
        __m256 v[2];
        for (int w = 0; w < W; w++) v[w] = _mm256_loadu_ps(v0 + t * rs + 8 * w);
        for (int i = 0; i < NQ; i++) {
            const __m256 pt = _mm256_broadcast_ss(p + i * stride + t);
            for (int w = 0; w < W; w++) acc[i][w] = _mm256_fmadd_ps(pt, v[w], acc[i][w]);
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int w = 0; w < W; w++) _mm256_storeu_ps(o + i * D + 8 * w, acc[i][w]);
}

/* One block's scores for the query rows r0..r0+nq-1 (nq <= 3) of one kv head: keys kh + t * rs, t < n. */
static void block_scores_gqa(int64_t nq, const float *qq, int64_t D, const float *kh, int64_t rs, int64_t n, float *sc,
                             int64_t stride, prefetcher *pf, int64_t per_step)
{
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        prefetch_lines(pf, per_step);
        if (nq == 3) scores_gqa4(3, qq, D, kh + t * rs, rs, sc + t, stride);
        else if (nq == 2) scores_gqa4(2, qq, D, kh + t * rs, rs, sc + t, stride);
        else scores_gqa4(1, qq, D, kh + t * rs, rs, sc + t, stride);
    }
    for (; t < n; t++) {
        if (nq == 3) scores_gqa1(3, qq, D, kh + t * rs, sc + t, stride);
        else if (nq == 2) scores_gqa1(2, qq, D, kh + t * rs, sc + t, stride);
        else scores_gqa1(1, qq, D, kh + t * rs, sc + t, stride);
    }
}

/* One block's values into the output rows r0..r0+nq-1 (nq <= 3) of one kv head, 16 columns at a time. */
static void block_values_gqa(int64_t nq, const float *p, int64_t stride, const float *vh, int64_t rs, int64_t n, float *o,
                             int64_t D, prefetcher *pf, int64_t per_step)
{
    for (int64_t c = 0; c < D; c += 16) {
        prefetch_lines(pf, per_step);
        const int two = c + 16 <= D;
#define VALUES(NQ)                                                          \
    if (two) values_gqa(NQ, 2, p, stride, vh + c, rs, n, o + c, D);        \
    else values_gqa(NQ, 1, p, stride, vh + c, rs, n, o + c, D);
        if (nq == 3) { VALUES(3) }
        else if (nq == 2) { VALUES(2) }
        else { VALUES(1) }
#undef VALUES
    }
}
#endif

#ifdef PAGEDQ_AVX2
/* AVX2 task: kv heads h0..h1-1 of sequence s, head_dim % 8 == 0. `scratch` holds
 * nh * (len + D + 2) floats, nh = (h1 - h0) * group query heads, and for a bf16 cache block_size * KVH * D
 * more, where each block is widened to fp32 before use.
 *
 * An fp32 cache is read in place, and the next block (after the last K block, V's first) is prefetched a
 * few lines per step of the work on the current one, as in the avx512 build's task_in_place: a table's
 * blocks lie anywhere in the pool, so no hardware prefetcher runs ahead of them. What ran before copied
 * each block (whole rows, in memory order) into staging and prefetched the next block all at once: the
 * copy's sequential reads beat reading one kv head's 256 B of every 768 B row in place (pure reads on a
 * 2-core AMD EPYC: 7.3-8.2 GB/s head by head, 13.7-14.6 whole rows in order), but wrote and re-read every
 * byte. Measured there (family 25 model 1, Zen 3, 2 threads, ops/bench/kernel_timing.py, fp32 cache, SmolLM2's
 * heads, ms, staged -> in place): 64 sequences x 350 positions 2.647 -> 1.702, 64 x 700 5.799 -> 3.797, 64 x 350
 * over 30 layers' caches in turn 2.961 -> 2.218 (11.6 -> 15.5 GB/s of K/V), head_dim 80 1.544 -> 0.80-1.03;
 * compass in fp32 without speculation (README run 27): attention 19.8 -> 13.9-15.2 s, 99.1 -> 114.2 tok/s.
 *
 * The query rows that share a kv head go through each block together, up to 3 at a time (block_scores_gqa,
 * block_values_gqa): every K/V vector loaded once feeds their FMAs, where one row at a time loaded it once per
 * row (9 loads per 8 FMAs in the scores, the output reloaded and stored every 4 positions in the values). On a
 * Zen 3 with 191 GFLOP/s of fp32 peak and a 44.5 GB/s pure 2-thread read (README run 38, ms, row by row -> shared):
 * 64 x 350 0.932 -> 0.805, 64 x 700 2.017 -> 1.878, 1 x 2000 0.117 -> 0.096, head_dim 80 0.556 -> 0.495; over
 * 30 layers' caches, where the scattered blocks come from memory, 1.31 -> 1.28 (26.5 GB/s of K/V), and compass
 * end to end within its noise (216-218 tok/s both): in a real step decode attention waits on memory. */
static void task_avx2(const attn_args *a, int64_t s, int64_t h0, int64_t h1, float *scratch)
{
    const task_view tv = view_of(a, s, h0);
    const int64_t group = tv.group, D = a->head_dim, block_size = a->block_size, nh = (h1 - h0) * group;
    const int64_t rs = tv.rs, block_stride = tv.block_stride, nblocks = tv.nblocks;
    const int64_t b0 = a->prefix_blocks, first = b0 * block_size, len = tv.len - first; /* own positions */
    const int32_t *table = tv.table;
    float *acc = tv.acc;  /* nh contiguous output rows: query heads h0 * group ... */
    float *scores = scratch, *qs = scores + nh * len, *mxs = qs + nh * D, *sums = mxs + nh;
    float *copy_to = a->kv_bf16 ? sums + nh : NULL; /* bf16: widened into staging; fp32: read in place */
    const char *kc = (const char *)a->k_cache, *vc = (const char *)a->v_cache;
    const int64_t esize = 4, col0 = h0 * D, cols = (h1 - h0) * D;
    /* Prefetched only where the task reads whole rows (one contiguous range per block): a one-kv-head task
       (fewer sequences than threads) ran slower with it, 1 x 2000 positions 0.108 -> 0.137 ms (0.122 without). */
    const int fetch = !copy_to && cols == rs;
    const int64_t kv_lines = prefetch_plan(kc, block_size, rs, col0, cols, esize).left;
    const int64_t chunks = (h1 - h0) * ((group + 2) / 3); /* (kv head, up to 3 of its query rows) pairs */
    const int64_t k_steps = chunks * ((block_size + 3) / 4), k_per_step = (kv_lines + k_steps - 1) / k_steps;
    const int64_t v_steps = chunks * ((D + 15) / 16), v_per_step = (kv_lines + v_steps - 1) / v_steps;
    const __m256 vscale = _mm256_set1_ps(a->scale);
    for (int64_t r = 0; r < nh; r++)
        for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(qs + r * D + c, _mm256_mul_ps(_mm256_loadu_ps(tv.qg + r * a->q_head + c), vscale));

    for (int64_t b = b0; b < nblocks; b++) {
        const int64_t base = b * block_size - first;
        const int64_t n = base + block_size <= len ? block_size : len - base;
        const float *kb = kv_block(a->k_cache, a->kv_bf16, table[b], b + 1 < nblocks ? table[b + 1] : -1, block_stride,
                                   n, rs, h0 * D, (h1 - h0) * D, copy_to) + h0 * D;
        /* fp32: the next block, or after the last, V's first */
        prefetcher pf = prefetch_plan(!fetch ? NULL : b + 1 < nblocks ? kc + table[b + 1] * block_stride * esize
                                                                        : vc + table[b0] * block_stride * esize,
                                      block_size, rs, col0, cols, esize);
        for (int64_t j = 0; j < h1 - h0; j++)
            for (int64_t i = 0; i < group; i += 3) {
                const int64_t r0 = j * group + i;
                block_scores_gqa(group - i < 3 ? group - i : 3, qs + r0 * D, D, kb + j * D, rs, n, scores + r0 * len + base,
                                 len, &pf, k_per_step);
            }
        prefetch_lines(&pf, pf.left); /* what a short block left */
    }
    /* Softmax numerators; the 1/sum is applied to the output at the end. */
    for (int64_t r = 0; r < nh; r++) {
        float *sc = scores + r * len;
        __m256 vmx = _mm256_set1_ps(-INFINITY);
        int64_t pos = 0;
        for (; pos + 8 <= len; pos += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + pos));
        float mx = hmax1(vmx);
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
        mxs[r] = mx;
        sums[r] = sum;
    }
    memset(acc, 0, sizeof(float) * nh * D);
    for (int64_t b = b0; b < nblocks; b++) {
        const int64_t base = b * block_size - first;
        const int64_t n = base + block_size <= len ? block_size : len - base;
        const float *vb = kv_block(a->v_cache, a->kv_bf16, table[b], b + 1 < nblocks ? table[b + 1] : -1, block_stride,
                                   n, rs, h0 * D, (h1 - h0) * D, copy_to) + h0 * D;
        prefetcher pf = prefetch_plan(!fetch || b + 1 >= nblocks ? NULL : vc + table[b + 1] * block_stride * esize,
                                      block_size, rs, col0, cols, esize);
        for (int64_t j = 0; j < h1 - h0; j++)
            for (int64_t i = 0; i < group; i += 3) {
                const int64_t r0 = j * group + i;
                block_values_gqa(group - i < 3 ? group - i : 3, scores + r0 * len + base, len, vb + j * D, rs, n,
                                 acc + r0 * D, D, &pf, v_per_step);
            }
        prefetch_lines(&pf, pf.left);
    }
    for (int64_t r = 0; r < nh; r++) {
        if (b0 == 0) {
            const __m256 vi = _mm256_set1_ps(1.f / sums[r]);
            for (int64_t c = 0; c < D; c += 8)
                _mm256_storeu_ps(acc + r * D + c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + c), vi));
            continue;
        }
        /* Merge with the shared prefix's partial result, rescaled to the larger running max. */
        const int64_t i = s * a->num_heads + h0 * group + r;
        const float mx = fmaxf(mxs[r], a->prefix_m[i]);
        const float wo = expf(mxs[r] - mx), wp = expf(a->prefix_m[i] - mx);
        const float inv = 1.f / (sums[r] * wo + a->prefix_l[i] * wp);
        const __m256 vo = _mm256_set1_ps(wo * inv), vp = _mm256_set1_ps(wp * inv);
        const float *po = a->prefix_o + i * D;
        for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(acc + r * D + c, _mm256_fmadd_ps(_mm256_loadu_ps(acc + r * D + c), vo,
                                                              _mm256_mul_ps(_mm256_loadu_ps(po + c), vp)));
    }
}
#endif

#ifdef PAGEDQ_AVX512
/* Rows 0..nh-1 of `scores` (len each) -> softmax numerators; their max and sum into mxs, sums. Row r sees
 * the first len - hidden(r) positions, hidden(r) = nq - 1 - (r % gq) / group (its query token's place among
 * the task's nq; 0 for every row of a decode task): the numerators past them are stored as 0, so the sums
 * over V may run over the whole context. */
static void softmax_rows512(float *scores, int64_t len, int64_t nh, float *mxs, float *sums, int64_t gq,
                            int64_t group, int64_t nq)
{
    for (int64_t r = 0; r < nh; r++) {
        float *sc = scores + r * len;
        const int64_t vis = len - (nq - 1 - (r % gq) / group);
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        for (int64_t pos = 0; pos < vis; pos += 16)
            vmx = _mm512_mask_max_ps(vmx, lanes16(vis - pos), vmx, _mm512_maskz_loadu_ps(lanes16(vis - pos), sc + pos));
        const float mx = _mm512_reduce_max_ps(vmx);
        const __m512 vm = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t pos = 0; pos < len; pos += 16) {
            const __mmask16 m = lanes16(vis - pos > 0 ? vis - pos : 0);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + pos), vm)));
            _mm512_mask_storeu_ps(sc + pos, lanes16(len - pos), e);
            vsum = _mm512_add_ps(vsum, e);
        }
        mxs[r] = mx;
        sums[r] = _mm512_reduce_add_ps(vsum);
    }
}

/* The nh accumulated output rows `acc` of query heads r0... of sequence s, divided by their sums, or
 * merged with the shared prefix's partial results (`prefix`), rescaled to the larger running max. */
static void finish_rows512(const attn_args *a, int64_t s, int64_t r0, int64_t nh, int prefix, const float *mxs,
                           const float *sums, float *acc)
{
    const int64_t D = a->head_dim;
    for (int64_t r = 0; r < nh; r++) {
        float wo = 1.f / sums[r], wp = 0.f;
        const float *po = acc + r * D; /* no prefix: wp = 0 */
        if (prefix) {
            const int64_t i = s * a->num_heads + r0 + r;
            const float mx = fmaxf(mxs[r], a->prefix_m[i]);
            const float eo = expf(mxs[r] - mx), ep = expf(a->prefix_m[i] - mx);
            const float inv = 1.f / (sums[r] * eo + a->prefix_l[i] * ep);
            wo = eo * inv; wp = ep * inv;
            po = a->prefix_o + i * D;
        }
        const __m512 vo = _mm512_set1_ps(wo), vp = _mm512_set1_ps(wp);
        for (int64_t c = 0; c < D; c += 16) {
            const __mmask16 m = lanes16(D - c);
            _mm512_mask_storeu_ps(acc + r * D + c, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, acc + r * D + c), vo,
                                                                      _mm512_mul_ps(_mm512_maskz_loadu_ps(m, po + c), vp)));
        }
    }
}

/* ---- AVX-512: K/V read in place, bf16 or fp32. */

/* Lane i of the result = the sum of the 16 lanes of a[i]: a transpose-and-add tree of 45 single-uop
 * shuffles and adds, where folding each zmm to 8 lanes and an 8x8 hadd tree took 74 (its hadds are 3 uops). */
static inline __m512 hsum16x16(const __m512 a[16])
{
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit block: a0+a2, b0+b2, a1+a3, b1+b3 of (a, b) = a[2i], a[2i+1] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit block: the block's sums of a[4i] ... a[4i+3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

/* 32 bf16 values (the low `m` of them; the rest read as 0) widened in two registers: *even gets values
 * 0, 2, ..., 30 and *odd 1, 3, ..., 31, a shift and an and, where widening in order takes a shuffle and a
 * shift per 16 (the 512-bit ports are the kernel's bottleneck with K/V in the caches). The dot products
 * and output sums below work in this order: q permuted once per task, the outputs restored at the end. */
static inline void widen32_bf16(const uint16_t *p, __mmask32 m, __m512 *even, __m512 *odd)
{
    const __m512i x = _mm512_maskz_loadu_epi16(m, p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline __mmask32 lanes32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1u); }

/* Values i..i+31 of a K/V row (the low `m` of them; the rest read as 0) as two fp32 vectors in the task's
 * column order: a bf16 row widened even/odd (widen32_bf16), an fp32 row as it lies (columns 0-15, 16-31).
 * `fp32` is a constant in every caller (they are always_inline), so each task gets its own loads. */
static inline __attribute__((always_inline)) void load32_kv(const void *p, int64_t i, __mmask32 m, const int fp32,
                                                            __m512 *a, __m512 *b)
{
    if (fp32) {
        *a = _mm512_maskz_loadu_ps((__mmask16)m, (const float *)p + i);
        *b = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), (const float *)p + i + 16);
    } else {
        widen32_bf16((const uint16_t *)p + i, m, a, b);
    }
}

/* Scores of NQ (<= 4) query rows (qs, qs + D32, ...: scaled, fp32, in load32_kv's column order) against 4
 * keys kr[0..3] (bf16 or fp32, in place): 16 accumulator chains, one per (row, key), reduced by
 * hsum16x16; row g's 4 scores go to sc[g * stride + 0..nk-1]. */
static inline __attribute__((always_inline)) void scores_4keys(const int NQ, const int fp32, const float *qs, int64_t D,
                                                               int64_t D32, const void *const kr[4], float *sc,
                                                               int64_t stride, int64_t nk)
{
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 32) {
        const __mmask32 m = lanes32(D - c);
        __m512 ke[4], ko[4];
        for (int i = 0; i < 4; i++) load32_kv(kr[i], c, m, fp32, &ke[i], &ko[i]);
        for (int g = 0; g < NQ; g++) {
            const __m512 qe = _mm512_loadu_ps(qs + g * D32 + c), qo = _mm512_loadu_ps(qs + g * D32 + c + 16);
            for (int i = 0; i < 4; i++)
                acc[4 * g + i] = _mm512_fmadd_ps(qo, ko[i], _mm512_fmadd_ps(qe, ke[i], acc[4 * g + i]));
        }
    }
    const __m512 w = hsum16x16(acc);
    const __mmask8 keys = (__mmask8)((1u << nk) - 1u);
    for (int g = 0; g < NQ; g++)  /* block g of w -> lanes 0..3 */
        _mm_mask_storeu_ps(sc + g * stride, keys,
                           _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * g),
                                                                                          _mm512_setr_epi32(0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)), w)));
}

/* o[g] += sum over rows t < n of p[g * stride + t] * v_t, for NQ (<= 4) query rows, over columns
 * c0..c0+63 (nc <= 2 chunks of 32, the last masked by mlast) of the rows vr + t * rs (bf16 or fp32, in
 * place); o rows of D32 floats in load32_kv's order. The NQ x 4 output vectors stay in registers. */
static inline __attribute__((always_inline)) void accumulate_block(const int NQ, const int fp32, const float *p,
                                                                   int64_t stride, const void *vr, int64_t rs,
                                                                   int64_t n, float *o, int64_t D32, int nc,
                                                                   __mmask32 mlast, prefetcher *pf, int64_t pf_per_row)
{
    __m512 acc[4][4];
    for (int g = 0; g < NQ; g++)
        for (int j = 0; j < 4; j++) acc[g][j] = j < 2 * nc ? _mm512_loadu_ps(o + g * D32 + 16 * j) : _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        prefetch_lines(pf, pf_per_row);
        const void *v = (const char *)vr + t * rs * (fp32 ? 4 : 2);
        __m512 vv[4];
        load32_kv(v, 0, nc == 1 ? mlast : 0xFFFFFFFFu, fp32, &vv[0], &vv[1]);
        if (nc == 2) load32_kv(v, 32, mlast, fp32, &vv[2], &vv[3]);
        else vv[2] = vv[3] = _mm512_setzero_ps();
        for (int g = 0; g < NQ; g++) {
            const __m512 pv = _mm512_set1_ps(p[g * stride + t]);
            for (int j = 0; j < 4; j++)
                if (j < 2 * nc) acc[g][j] = _mm512_fmadd_ps(pv, vv[j], acc[g][j]);
        }
    }
    for (int g = 0; g < NQ; g++)
        for (int j = 0; j < 4; j++)
            if (j < 2 * nc) _mm512_storeu_ps(o + g * D32 + 16 * j, acc[g][j]);
}

/* The walk both in-place tasks (task_in_place, task_in_place_dp) share: one task's rows, its scratch split
 * into scores, staged q, output rows, maxima and sums, and the prefetch plan's share per step. */
typedef struct {
    task_view tv;
    int64_t nq, group, gq;           /* query tokens, query heads per kv head, rows per kv head (group * nq) */
    int64_t D, D32, block_size, nh;  /* nh rows in all, each staged in D32 (a multiple of 32) floats */
    int64_t b0, first, len;          /* blocks from b0 (after a cascade's shared prefix), len positions from first */
    int64_t esize, col0, cols, gchunks, kv_lines, k_per_step, v_per_row;
    const char *kc, *vc;
    float *scores, *qs, *os, *mxs, *sums;
} in_place_plan;

static inline in_place_plan plan_in_place(const attn_args *a, int64_t s, int64_t h0, int64_t h1, float *scratch,
                                          int64_t esize)
{
    in_place_plan p;
    p.tv = view_of(a, s, h0);
    p.nq = a->q_lens ? a->q_lens[s] : 1;
    p.group = p.tv.group;
    p.gq = p.group * p.nq;
    p.D = a->head_dim;
    p.D32 = (p.D + 31) / 32 * 32;
    p.block_size = a->block_size;
    p.nh = (h1 - h0) * p.gq;
    p.b0 = a->prefix_blocks;
    p.first = p.b0 * p.block_size;
    p.len = p.tv.len - p.first;
    p.esize = esize;
    p.kc = (const char *)a->k_cache;
    p.vc = (const char *)a->v_cache;
    p.scores = scratch;
    p.qs = p.scores + p.nh * p.len;
    p.os = p.qs + p.nh * p.D32;
    p.mxs = p.os + p.nh * p.D32;
    p.sums = p.mxs + p.nh;
    p.col0 = h0 * p.D;
    p.cols = (h1 - h0) * p.D;
    p.gchunks = (p.gq + 3) / 4;
    p.kv_lines = prefetch_plan(p.kc, p.block_size, p.tv.rs, p.col0, p.cols, esize).left;
    const int64_t k_steps = (h1 - h0) * p.gchunks * ((p.block_size + 3) / 4);
    const int64_t v_steps = (h1 - h0) * p.gchunks * ((p.D + 63) / 64) * p.block_size;
    p.k_per_step = (p.kv_lines + k_steps - 1) / k_steps;
    p.v_per_row = (p.kv_lines + v_steps - 1) / v_steps;
    return p;
}

/* Block b's positions (n of them, from base) and the prefetch of what comes after it: in the K pass the next
 * K block, or after the last, V's first; in the V pass the next V block. */
static inline int64_t block_rows(const in_place_plan *p, int64_t b, int64_t *base)
{
    *base = b * p->block_size - p->first;
    return *base + p->block_size <= p->len ? p->block_size : p->len - *base;
}

static inline prefetcher k_pass_prefetch(const in_place_plan *p, int64_t b)
{
    const int32_t *table = p->tv.table;
    const int64_t bs = p->tv.block_stride * p->esize;
    return prefetch_plan(b + 1 < p->tv.nblocks ? p->kc + table[b + 1] * bs : p->vc + table[p->b0] * bs,
                         p->block_size, p->tv.rs, p->col0, p->cols, p->esize);
}

static inline prefetcher v_pass_prefetch(const in_place_plan *p, int64_t b)
{
    const int64_t bs = p->tv.block_stride * p->esize;
    return prefetch_plan(b + 1 < p->tv.nblocks ? p->vc + p->tv.table[b + 1] * bs : NULL, p->block_size, p->tv.rs,
                         p->col0, p->cols, p->esize);
}

/* The output rows back to column order (each 32-column chunk's two vectors through lo_idx / hi_idx, or as
 * they are with `in_order`), divided by their sums into their places in out, or merged with the cascade's
 * shared-prefix results. */
static inline void store_rows512(const attn_args *a, const in_place_plan *p, int64_t s, int64_t h0, int in_order,
                                 __m512i lo_idx, __m512i hi_idx)
{
    const int64_t D = p->D, D32 = p->D32, gq = p->gq, group = p->group;
    const int prefix = p->b0 > 0; /* merged by finish_rows512 (nq is 1 then); else divided by the sum here */
    for (int64_t r = 0; r < p->nh; r++) {
        const int64_t i = r % gq / group, head = r / gq * group + r % group; /* token, head - h0 * group */
        float *dst = p->tv.acc + (i * a->num_heads + head) * D;
        const __m512 inv = _mm512_set1_ps(prefix ? 1.f : 1.f / p->sums[r]);
        for (int64_t c = 0; c < D; c += 32) {
            const __m512 oa = _mm512_loadu_ps(p->os + r * D32 + c), ob = _mm512_loadu_ps(p->os + r * D32 + c + 16);
            const __m512 lo = in_order ? oa : _mm512_permutex2var_ps(oa, lo_idx, ob);
            const __m512 hi = in_order ? ob : _mm512_permutex2var_ps(oa, hi_idx, ob);
            _mm512_mask_storeu_ps(dst + c, lanes16(D - c), _mm512_mul_ps(lo, inv));
            _mm512_mask_storeu_ps(dst + c + 16, lanes16(D - c - 16 < 0 ? 0 : D - c - 16), _mm512_mul_ps(hi, inv));
        }
    }
    if (prefix) finish_rows512(a, s, h0 * group, p->nh, 1, p->mxs, p->sums, p->tv.acc);
}

/* Kv heads h0..h1-1 of sequence s over a bf16 (fp32 = 0) or fp32 cache, any head_dim and group. `scratch`
 * holds nh * (len + 2 * D32 + 2) floats (D32: head_dim rounded up to 32).
 *
 * The other tasks copy (fp32) or widen (bf16) each block into staging and compute from the copy: a pass
 * that writes the bytes it reads and reads them back. Here K and V are read in place (bf16 widened in
 * registers) as the dot
 * products and the output sums consume them (the same fp32 arithmetic on the same values), each K/V
 * vector is loaded once for up to 4 query heads sharing it, and the next block is prefetched a few
 * lines per step of the work on the current one (the last K block fetches V's first): a table's blocks
 * lie anywhere in the pool, so no hardware prefetcher runs ahead of them, and the out-of-order window
 * alone, filled with arithmetic, keeps too few lines in flight.
 *
 * Measured on an Intel Xeon (family 6 model 167, 2 threads), SmolLM2-135M's heads (9 query, 3 kv,
 * head_dim 64), 64 sequences x 350 positions, 30 layers' caches in turn so that K/V come from memory
 * as in a model step (ops/bench/kernel_timing.py; a pure 2-thread read of 6 KB blocks in random order,
 * the bf16 K or V block of this shape, runs at 20.5-21 GB/s here, a sequential one at 25):
 *   AVX2 task on widened staging (what ran before)        1.48-1.54 ms  11.2-11.6 GB/s of K/V
 *   this task, no software prefetch                       1.48-1.52 ms  11.3-11.6 GB/s
 *   + whole blocks 1-3 ahead prefetched at a block's start 1.34-1.47 ms  11.7-12.8 GB/s
 *   + prefetch spread over the block's steps (kept)       1.04-1.09 ms  15.8-16.5 GB/s
 *   prefetching 2 blocks ahead, or into L2 only (T2): within the noise (1.06-1.14 ms); rows in memory
 *   order (all kv heads of 4 rows, then the next 4) instead of head by head: the same.
 * With K/V in the caches (one layer, called again and again) the task ran at 23 GB/s (was 16), and at
 * 30 GB/s (0.73 -> 0.57 ms) once widen32_bf16 halved the widening work; from memory, the same 16 GB/s.
 * The whole kernel_timing decode table, avx512 build, bf16, ms, main -> this task: 64 x 350 1.084 -> 0.594,
 * 64 x 700 2.312 -> 1.157, 64 x 350 over 30 layers 1.51 -> 0.978, 1 x 2000 0.107 -> 0.059, head_dim 80
 * (32 x 350) 0.626 -> 0.398, head_dim 20 0.292 -> 0.146. In the compass bench (bf16, no speculation,
 * 7710 calls) the kernel's time fell from 5.93-5.96 s (12.4 GB/s of K/V) to 4.07-4.15 s (18 GB/s).
 * The same task over an fp32 cache, against the AVX2 task on staging it replaced there (and the masked
 * AVX-512 staging task for head_dim % 8 != 0), 30 layers' caches, ms: 64 x 350 2.555 -> 2.200, 64 x 700
 * 4.974 -> 4.197, 1 x 2000 0.232 -> 0.201, head_dim 20 (32 x 350) 0.336 -> 0.228, head_dim 80 1.157 ->
 * 0.936; results within 5e-7 of the staged ones.
 * On an AMD EPYC (family 26 model 2 = Zen 5, 2 threads), bf16 cache, this task -> task_in_place_dp (its
 * VDPBF16PS twin, below), ms: 64 x 350 over 30 layers 0.540-0.562 -> 0.536-0.560 (32 GB/s of K/V either way,
 * where a pure 2-thread read of the same 6 KB blocks in the same order, prefetched one block ahead, takes
 * 0.517-0.529 ms, 33 GB/s: memory-bound, the arithmetic hidden behind it); with K/V in the caches the
 * arithmetic shows: 64 x 350 0.286-0.301 -> 0.250-0.257, 64 x 700 0.833 -> 0.713, head_dim 80 0.196 -> 0.167,
 * and 9 verification queries per sequence over 30 layers 1.98-2.03 -> 1.55-1.61. */
static inline __attribute__((always_inline)) void task_in_place(const attn_args *a, int64_t s, int64_t h0,
                                                                  int64_t h1, float *scratch, const int fp32)
{
    /* nq query tokens (a->q_lens): gq = group * nq rows per kv head, row (h - h0) * gq + i * group + g the
       query of token i for head h * group + g; every 4 consecutive rows share each K/V vector load. */
    const in_place_plan pl = plan_in_place(a, s, h0, h1, scratch, fp32 ? 4 : 2);
    const int64_t group = pl.group, gq = pl.gq, D = pl.D, D32 = pl.D32, len = pl.len, nh = pl.nh;
    const int64_t rs = pl.tv.rs, block_stride = pl.tv.block_stride, esize = pl.esize;
    const int32_t *table = pl.tv.table;
    float *scores = pl.scores, *qs = pl.qs, *os = pl.os;
    const __m512 vscale = _mm512_set1_ps(a->scale);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t r = 0; r < nh; r++)  /* scaled, in load32_kv's column order (bf16: even/odd per 32) */
        for (int64_t c = 0; c < D; c += 32) {
            const int64_t i = r % gq / group, head = r / gq * group + r % group; /* token, head - h0 * group */
            const float *src = pl.tv.qg + i * a->q_tok + head * a->q_head + c;
            const __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes16(D - c), src), vscale);
            const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes16(D - c - 16 < 0 ? 0 : D - c - 16), src + 16), vscale);
            _mm512_storeu_ps(qs + r * D32 + c, fp32 ? lo : _mm512_permutex2var_ps(lo, even, hi));
            _mm512_storeu_ps(qs + r * D32 + c + 16, fp32 ? hi : _mm512_permutex2var_ps(lo, odd, hi));
        }
    for (int64_t b = pl.b0; b < pl.tv.nblocks; b++) {
        int64_t base;
        const int64_t n = block_rows(&pl, b, &base);
        prefetcher pf = k_pass_prefetch(&pl, b);
        const char *kb = pl.kc + table[b] * block_stride * esize;
        for (int64_t h = h0; h < h1; h++)
            for (int64_t g0 = 0; g0 < gq; g0 += 4) {
                const int nr = gq - g0 < 4 ? (int)(gq - g0) : 4;
                const int64_t r = (h - h0) * gq + g0;
                for (int64_t t = 0; t < n; t += 4) {
                    prefetch_lines(&pf, pl.k_per_step);
                    const int64_t nk = n - t < 4 ? n - t : 4;
                    const void *kr[4]; /* a short block's missing keys: row 0 again, its scores not stored */
                    for (int j = 0; j < 4; j++) kr[j] = kb + (h * D + (j < nk ? t + j : 0) * rs) * esize;
                    float *sc = scores + r * len + base + t;
                    switch (nr) {
                    case 1: scores_4keys(1, fp32, qs + r * D32, D, D32, kr, sc, len, nk); break;
                    case 2: scores_4keys(2, fp32, qs + r * D32, D, D32, kr, sc, len, nk); break;
                    case 3: scores_4keys(3, fp32, qs + r * D32, D, D32, kr, sc, len, nk); break;
                    default: scores_4keys(4, fp32, qs + r * D32, D, D32, kr, sc, len, nk); break;
                    }
                }
            }
        prefetch_lines(&pf, pf.left); /* what a short block left */
    }
    softmax_rows512(scores, len, nh, pl.mxs, pl.sums, gq, group, pl.nq);
    memset(os, 0, sizeof(float) * nh * D32);
    for (int64_t b = pl.b0; b < pl.tv.nblocks; b++) {
        int64_t base;
        const int64_t n = block_rows(&pl, b, &base);
        prefetcher pf = v_pass_prefetch(&pl, b);
        const char *vb = pl.vc + table[b] * block_stride * esize;
        for (int64_t h = h0; h < h1; h++)
            for (int64_t g0 = 0; g0 < gq; g0 += 4) {
                const int nr = gq - g0 < 4 ? (int)(gq - g0) : 4;
                const int64_t r = (h - h0) * gq + g0;
                for (int64_t c0 = 0; c0 < D; c0 += 64) {
                    const int nc = D - c0 > 32 ? 2 : 1;
                    const __mmask32 mlast = lanes32(D - c0 - 32 * (nc - 1));
                    const float *p = scores + r * len + base;
                    const void *vr = vb + (h * D + c0) * esize;
                    float *o = os + r * D32 + c0;
                    const int64_t vp = pl.v_per_row;
                    switch (nr) {
                    case 1: accumulate_block(1, fp32, p, len, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    case 2: accumulate_block(2, fp32, p, len, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    case 3: accumulate_block(3, fp32, p, len, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    default: accumulate_block(4, fp32, p, len, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    }
                }
            }
    }
    /* bf16: load32_kv's even/odd order back to columns */
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    store_rows512(a, &pl, s, h0, fp32, lo_idx, _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8)));
}

static void task_bf16_avx512(const attn_args *a, int64_t s, int64_t h0, int64_t h1, float *scratch)
{
    task_in_place(a, s, h0, h1, scratch, 0);
}

static void task_f32_avx512(const attn_args *a, int64_t s, int64_t h0, int64_t h1, float *scratch)
{
    task_in_place(a, s, h0, h1, scratch, 1);
}

/* ---- AVX512-bf16: the bf16-cache task on VDPBF16PS (task_in_place_dp), where that instruction runs.
 *
 * task_in_place widens every K and V value to fp32 in registers and multiplies in fp32: per (query row, key,
 * 32 columns) a widen and 2 FMAs for the scores, per token a widen and 4 FMAs per query row and 64 columns
 * for the output, all on the 512-bit ports that bound it once K/V sit in the caches. VDPBF16PS takes the
 * bf16 cache as it lies: one instruction per (row, key, 32 columns) on the raw K row, and over token pairs
 * (V rows t and t+1 interleaved per column by one unpack per 32 columns, shared by the group's rows) half
 * the output instructions. Its inputs are bf16, so q (after scaling) is rounded to bf16 once per task and the
 * softmax numerators P once after the softmax, as bf16 flash attention kernels round their operands; max,
 * sum, normalisation, the cascade merge and every sum stay fp32. Results differ from task_in_place's by that
 * rounding: against float64 on the same bf16 K/V (N(0, 1) q, K, V; head_dim 20-128) at most 2-4e-3; the tests
 * hold it to 2e-2 there and to 2e-4 against a float64 emulation of exactly this rounding.
 * Compiled with the bf16 target for these functions only: the rest of the avx512 build runs on AVX-512 CPUs
 * without it, and Python passes use_dp only where pagedq_kernels/cpu_isa.py probed AVX512-bf16 runnable under the
 * PAGEDQ_CPU_ISA cap and PAGEDQ_DISABLE_DP_ATTENTION is unset (pagedq_kernels/cpu_attention.py dp_attention_enabled).
 * Measured on an AMD EPYC (family 26 model 2 = Zen 5, 2 threads; ops/bench/kernel_timing.py --kv-dtype
 * bfloat16, the avx512 column against avx512_bf16, SmolLM2-135M's heads; ms): K/V from memory (64 x 350
 * over 30 layers) 0.540-0.562 -> 0.536-0.560, memory-bound at 32 GB/s (task_in_place's comment); in the
 * caches 64 x 350 0.286-0.301 -> 0.250-0.257, 64 x 700 0.833 -> 0.713, 1 x 2000 0.041 -> 0.038, head_dim 80
 * 0.196 -> 0.167, head_dim 20 0.105 -> 0.096; 9 verification queries per sequence over 30 layers 1.98-2.03
 * -> 1.55-1.61 (the group's rows share each K/V load, so the arithmetic, not the bytes, sets that pace).
 * Tried and dropped: prefetching 2 or 3 blocks ahead instead of 1 (0.559, 0.571 ms over 30 layers): with
 * the arithmetic shorter, one block ahead still covers memory's latency. */
#pragma GCC push_options
#pragma GCC target("avx512bf16")

/* Lanes 0..3 of block g of w (hsum16x16's sums, row g's 4 keys) -> sc[g * stride + 0..nk-1], g < NQ. */
static inline __attribute__((always_inline)) void store_scores_dp(const int NQ, __m512 w, float *sc, int64_t stride,
                                                                  int64_t nk)
{
    const __mmask8 keys = (__mmask8)((1u << nk) - 1u);
    const __m512i first4 = _mm512_setr_epi32(0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int g = 0; g < NQ; g++)
        _mm_mask_storeu_ps(sc + g * stride, keys,
                           _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * g),
                                                                                          first4), w)));
}

/* scores_4keys for the dp task: NQ (<= 4) query rows qb, qb + D32, ... (scaled, rounded to bf16, columns in
 * order) against 4 bf16 key rows kr[0..3] in place, one VDPBF16PS per (row, key, 32 columns): each lane
 * sums the products of a column pair, the 16 chains are reduced by hsum16x16 as there. */
static inline __attribute__((always_inline)) void scores_4keys_dp(const int NQ, const uint16_t *qb, int64_t D,
                                                                  int64_t D32, const void *const kr[4], float *sc,
                                                                  int64_t stride, int64_t nk)
{
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 32) {
        const __mmask32 m = lanes32(D - c);
        __m512bh k[4];
        for (int i = 0; i < 4; i++) k[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)kr[i] + c);
        for (int g = 0; g < NQ; g++) {
            const __m512bh q = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * D32 + c));
            for (int i = 0; i < 4; i++) acc[4 * g + i] = _mm512_dpbf16_ps(acc[4 * g + i], q, k[i]);
        }
    }
    store_scores_dp(NQ, hsum16x16(acc), sc, stride, nk);
}

/* One step of accumulate_block_dp: tokens t and t + 1 (`two`; else t alone, its partner's V and P read as 0).
 * V rows interleaved per column pair by unpacklo/unpackhi_epi16, which work within 128-bit lanes: of a
 * 32-column chunk, the lo vector holds columns 0-3, 8-11, 16-19, 24-27, the hi vector 4-7, 12-15, 20-23,
 * 28-31 (dp_order; the outputs are restored at the end of the task). */
static inline __attribute__((always_inline)) void pair_step_dp(const int NQ, const int two, const uint16_t *p,
                                                               int64_t stride, const uint16_t *v, int64_t rs,
                                                               int nc, __mmask32 mlast, __m512 acc[4][4])
{
    const __mmask32 m0 = nc == 1 ? mlast : 0xFFFFFFFFu;
    const __m512i a0 = _mm512_maskz_loadu_epi16(m0, v);
    const __m512i b0 = two ? _mm512_maskz_loadu_epi16(m0, v + rs) : _mm512_setzero_si512();
    __m512bh w[4];
    w[0] = (__m512bh)_mm512_unpacklo_epi16(a0, b0);
    w[1] = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
    if (nc == 2) {
        const __m512i a1 = _mm512_maskz_loadu_epi16(mlast, v + 32);
        const __m512i b1 = two ? _mm512_maskz_loadu_epi16(mlast, v + rs + 32) : _mm512_setzero_si512();
        w[2] = (__m512bh)_mm512_unpacklo_epi16(a1, b1);
        w[3] = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
    } else {
        w[2] = w[3] = (__m512bh)_mm512_setzero_si512();
    }
    for (int g = 0; g < NQ; g++) {
        uint32_t pair = p[g * stride]; /* P_t in the low half, P_t+1 in the high */
        if (two) memcpy(&pair, p + g * stride, sizeof pair);
        const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int j = 0; j < 4; j++)
            if (j < 2 * nc) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], pv, w[j]);
    }
}

/* accumulate_block for the dp task: o[g] += sum over rows t < n of P[g * stride + t] * v_t, P rounded to
 * bf16, two tokens per VDPBF16PS; o rows of D32 floats in dp_order. The block's prefetch share is taken
 * per token as there (two shares a step). */
static inline __attribute__((always_inline)) void accumulate_block_dp(const int NQ, const uint16_t *p, int64_t stride,
                                                                      const uint16_t *vr, int64_t rs, int64_t n,
                                                                      float *o, int64_t D32, int nc, __mmask32 mlast,
                                                                      prefetcher *pf, int64_t pf_per_row)
{
    __m512 acc[4][4];
    for (int g = 0; g < NQ; g++)
        for (int j = 0; j < 4; j++) acc[g][j] = j < 2 * nc ? _mm512_loadu_ps(o + g * D32 + 16 * j) : _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
        prefetch_lines(pf, 2 * pf_per_row);
        pair_step_dp(NQ, 1, p + t, stride, vr + t * rs, rs, nc, mlast, acc);
    }
    if (t < n) {
        prefetch_lines(pf, pf_per_row);
        pair_step_dp(NQ, 0, p + t, stride, vr + t * rs, rs, nc, mlast, acc);
    }
    for (int g = 0; g < NQ; g++)
        for (int j = 0; j < 4; j++)
            if (j < 2 * nc) _mm512_storeu_ps(o + g * D32 + 16 * j, acc[g][j]);
}

/* task_in_place over a bf16 cache on VDPBF16PS: the same walk (rows of the task's query heads and tokens 4
 * at a time, blocks in table order, the same prefetch plan spread over each block's steps, the same causal
 * masking of a multi-query task and the same cascade merge), the same scratch. q is stored rounded to bf16
 * (in qs's space), P rounded to bf16 over its own row of scores after the softmax. */
static void task_in_place_dp(const attn_args *a, int64_t s, int64_t h0, int64_t h1, float *scratch)
{
    const in_place_plan pl = plan_in_place(a, s, h0, h1, scratch, 2);
    const int64_t group = pl.group, gq = pl.gq, D = pl.D, D32 = pl.D32, len = pl.len, nh = pl.nh;
    const int64_t rs = pl.tv.rs, block_stride = pl.tv.block_stride, esize = pl.esize;
    const int32_t *table = pl.tv.table;
    float *scores = pl.scores, *os = pl.os;
    uint16_t *qb = (uint16_t *)pl.qs; /* nh rows of D32 bf16 */
    const __m512 vscale = _mm512_set1_ps(a->scale);
    for (int64_t r = 0; r < nh; r++)  /* scaled, rounded to nearest even, columns in order, zero past D */
        for (int64_t c = 0; c < D; c += 32) {
            const int64_t i = r % gq / group, head = r / gq * group + r % group; /* token, head - h0 * group */
            const float *src = pl.tv.qg + i * a->q_tok + head * a->q_head + c;
            const __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes16(D - c), src), vscale);
            const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes16(D - c - 16 < 0 ? 0 : D - c - 16), src + 16), vscale);
            _mm512_storeu_si512((void *)(qb + r * D32 + c), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    for (int64_t b = pl.b0; b < pl.tv.nblocks; b++) {
        int64_t base;
        const int64_t n = block_rows(&pl, b, &base);
        prefetcher pf = k_pass_prefetch(&pl, b);
        const char *kb = pl.kc + table[b] * block_stride * esize;
        for (int64_t h = h0; h < h1; h++)
            for (int64_t g0 = 0; g0 < gq; g0 += 4) {
                const int nr = gq - g0 < 4 ? (int)(gq - g0) : 4;
                const int64_t r = (h - h0) * gq + g0;
                for (int64_t t = 0; t < n; t += 4) {
                    prefetch_lines(&pf, pl.k_per_step);
                    const int64_t nk = n - t < 4 ? n - t : 4;
                    const void *kr[4];
                    for (int j = 0; j < 4; j++) kr[j] = kb + (h * D + (j < nk ? t + j : 0) * rs) * esize;
                    float *sc = scores + r * len + base + t;
                    switch (nr) {
                    case 1: scores_4keys_dp(1, qb + r * D32, D, D32, kr, sc, len, nk); break;
                    case 2: scores_4keys_dp(2, qb + r * D32, D, D32, kr, sc, len, nk); break;
                    case 3: scores_4keys_dp(3, qb + r * D32, D, D32, kr, sc, len, nk); break;
                    default: scores_4keys_dp(4, qb + r * D32, D, D32, kr, sc, len, nk); break;
                    }
                }
            }
        prefetch_lines(&pf, pf.left);
    }
    softmax_rows512(scores, len, nh, pl.mxs, pl.sums, gq, group, pl.nq);
    /* P to bf16, each row over the front half of its own fp32 row (a store never reaches a float not yet
       read): row r's P at pb + r * 2 * len. */
    uint16_t *pb = (uint16_t *)scores;
    for (int64_t r = 0; r < nh; r++)
        for (int64_t pos = 0; pos < len; pos += 16) {
            const __mmask16 m = lanes16(len - pos);
            const __m256i p16 = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, scores + r * len + pos));
            _mm256_mask_storeu_epi16(pb + r * 2 * len + pos, m, p16);
        }
    memset(os, 0, sizeof(float) * nh * D32);
    for (int64_t b = pl.b0; b < pl.tv.nblocks; b++) {
        int64_t base;
        const int64_t n = block_rows(&pl, b, &base);
        prefetcher pf = v_pass_prefetch(&pl, b);
        const uint16_t *vb = (const uint16_t *)(pl.vc + table[b] * block_stride * esize);
        for (int64_t h = h0; h < h1; h++)
            for (int64_t g0 = 0; g0 < gq; g0 += 4) {
                const int nr = gq - g0 < 4 ? (int)(gq - g0) : 4;
                const int64_t r = (h - h0) * gq + g0;
                for (int64_t c0 = 0; c0 < D; c0 += 64) {
                    const int nc = D - c0 > 32 ? 2 : 1;
                    const __mmask32 mlast = lanes32(D - c0 - 32 * (nc - 1));
                    const uint16_t *p = pb + r * 2 * len + base;
                    const uint16_t *vr = vb + h * D + c0;
                    float *o = os + r * D32 + c0;
                    const int64_t ps = 2 * len, vp = pl.v_per_row;
                    switch (nr) {
                    case 1: accumulate_block_dp(1, p, ps, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    case 2: accumulate_block_dp(2, p, ps, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    case 3: accumulate_block_dp(3, p, ps, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    default: accumulate_block_dp(4, p, ps, vr, rs, n, o, D32, nc, mlast, &pf, vp); break;
                    }
                }
            }
    }
    /* dp_order -> columns: column k of a 32-column chunk (128-bit lane k / 8, place k % 8) lies in the lo
       vector at 4 * (k / 8) + k % 8 if k % 8 < 4, else in the hi vector at 4 * (k / 8) + k % 8 - 4. */
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    store_rows512(a, &pl, s, h0, 0, lo_idx, _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8)));
}
#pragma GCC pop_options
#endif

/* ---- Flash-style attention of a tile of query rows over a range of cached positions, shared by
 * prefill chunks and by the shared-prefix pass of decode steps.
 *
 * Keys go in chunks of KC; S = Q K^T and P V run through the GEMM register tile (gemm_tile.h) on a
 * transposed copy of the chunk's keys and a copy of its values, with an online softmax in between: a
 * tile of R rows reads each K/V row once. torch's CPU flash SDPA ran these shapes at ~40 GFLOP/s on 2
 * EPYC cores and needed each context gathered out of the cache first; chunks of 64 keys instead of 16
 * measured 59 -> 78 GFLOP/s over 512-token contexts (the per-row max/rescale is paid per chunk). In the
 * avx512 build both products take 32 columns per register tile (tile_pair): SmolLM2's heads on an Intel
 * Xeon (family 6 model 167, 2 threads), bf16 cache, 4 x 256 / 4 x 512 / 1 x 2000 tokens: 2.28 -> 2.03,
 * 8.29 -> 7.47, 29.5 -> 26.4 ms (fp32 cache: 2.27 -> 1.99, 8.76 -> 7.50, 28.6 -> 26.5). AVX2
 * and head_dim % 16 == 0 only (prefill_flash_tiles): elsewhere prefill decodes each row alone
 * (prefill_as_decodes) and decode steps read the shared prefix per sequence. */
#define QT 16 /* prefill queries per tile; also the decode sequences per tile of the prefix pass */
#ifdef PAGEDQ_AVX512
#define PAIR 2 /* 16-column panels per register tile (gemm_tile.h tile_pair) */
#else
#define PAIR 1
#endif
#define KC 64 /* keys per chunk */

/* Whether paged_prefill_attention_f32 takes the flash tiles for this head size; the decode kernel's cascade
 * (its shared-prefix pass runs on the same tiles) runs where this holds. */
int prefill_flash_tiles(int64_t head_dim)
{
#ifdef PAGEDQ_AVX2
    return head_dim % NR == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

#ifdef PAGEDQ_AVX2
/* One thread's tile: R query rows Qs [R, D] (already scaled) of kv head h, the running output O [R, D]
 * (unnormalised), max m and sum l [R]; work space S [R, KC], alpha [R], Kt [D, KC], Vc [KC, D], T [R, D]. */
typedef struct {
    int64_t R;
    float *Qs, *O, *m, *l, *S, *alpha, *Kt, *Vc, *T, *Kc; /* Kc [KC, D]: a bf16 chunk's keys widened */
} flash_tile;

static flash_tile flash_tile_in(float *scratch, int64_t R, int64_t D)
{
    flash_tile t;
    t.R = R;
    t.Qs = scratch; t.O = t.Qs + R * D; t.T = t.O + R * D; t.S = t.T + R * D;
    t.m = t.S + R * KC; t.l = t.m + R; t.alpha = t.l + R; t.Kt = t.alpha + R; t.Vc = t.Kt + D * KC;
    t.Kc = t.Vc + KC * D;
    for (int64_t r = 0; r < R; r++) { t.m[r] = -INFINITY; t.l[r] = 0.f; }
    return t; /* O: flash_rows zeroes it; flash_rows_dp and flash_rows_km write it whole at their end */
}

static size_t flash_tile_floats(int64_t R, int64_t D) { return (size_t)(3 * R * D + R * KC + 3 * R + 3 * D * KC + 16); }

/* off[j]: where position c0 + j's K/V row of kv head h starts in the cache (elements), j < nk; one division
 * per block, not two per position (a chunk's 128 divisions were ~3k cycles, a tenth of a short prompt's
 * attention in the key-major path). */
static inline void chunk_offsets(int64_t *off, const int32_t *table, int64_t bs, int64_t rs, int64_t h, int64_t D,
                                 int64_t c0, int64_t nk)
{
    for (int64_t j = 0; j < nk;) {
        const int64_t pos = c0 + j, block = pos / bs, in = pos - block * bs;
        const int64_t run = bs - in < nk - j ? bs - in : nk - j;
        const int64_t first = ((int64_t)table[block] * bs + in) * rs + h * D;
        for (int64_t e = 0; e < run; e++) off[j + e] = first + e * rs;
        j += run;
    }
}

/* Row r of the chunk's scores S (KC keys) -> softmax numerators under the row's running max, updating
 * its max m, sum l and the rescale alpha of what it accumulated before. With `masked`, keys past
 * `last` (the row's last visible key, relative to the chunk) count as -inf.
 * AVX-512: 4 zmm per row and the causal mask as a k-register instead of compares and blends; with the
 * O rescale below in zmm, prefill of 4 x 256 tokens (SmolLM2-135M's heads) measured 2.51 -> 2.11 ms in
 * the avx512 build (2.61-2.69 ms in the avx2 build), Intel Xeon family 6 model 167, 2 threads. */
static inline void chunk_softmax(flash_tile *t, int64_t r, int64_t last, int masked)
{
    float *sr = t->S + r * KC;
#ifdef PAGEDQ_AVX512
    __m512 sv[KC / 16];
    __mmask16 ok[KC / 16];
    __m512 vmax = _mm512_set1_ps(t->m[r]);
    for (int v = 0; v < KC / 16; v++) {
        const int64_t visible = last + 1 - 16 * v;
        ok[v] = masked ? lanes16(visible < 0 ? 0 : visible) : (__mmask16)0xFFFF;
        sv[v] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), ok[v], sr + 16 * v);
        vmax = _mm512_max_ps(vmax, sv[v]);
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int v = 0; v < KC / 16; v++) {
        const __m512 pv = _mm512_maskz_mov_ps(ok[v], exp16(_mm512_sub_ps(sv[v], vm)));
        _mm512_storeu_ps(sr + 16 * v, pv);
        vsum = _mm512_add_ps(vsum, pv);
    }
    const float sum = _mm512_reduce_add_ps(vsum);
#else
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 sv[KC / 8], ok[KC / 8];
    __m256 vmax = _mm256_set1_ps(t->m[r]);
    const __m256 lim = _mm256_set1_ps((float)last);
    for (int v = 0; v < KC / 8; v++) {
        sv[v] = _mm256_loadu_ps(sr + 8 * v);
        ok[v] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        if (masked) {
            ok[v] = _mm256_cmp_ps(_mm256_add_ps(iota, _mm256_set1_ps(8.f * v)), lim, _CMP_LE_OQ);
            sv[v] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv[v], ok[v]);
        }
        vmax = _mm256_max_ps(vmax, sv[v]);
    }
    const float mx = hmax1(vmax);
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (int v = 0; v < KC / 8; v++) {
        const __m256 pv = _mm256_and_ps(exp8(_mm256_sub_ps(sv[v], vm)), ok[v]);
        _mm256_storeu_ps(sr + 8 * v, pv);
        vsum = _mm256_add_ps(vsum, pv);
    }
    const float sum = hsum1(vsum);
#endif
    t->alpha[r] = t->m[r] == -INFINITY ? 0.f : expf(t->m[r] - mx);
    t->l[r] = t->l[r] * t->alpha[r] + sum;
    t->m[r] = mx;
}

/* Accumulate positions 0..end-1 (through `table`, blocks of bs, K/V rows of stride rs) into the tile.
 * Causal when nq > 0: row r is the query at position p0 + r % nq and sees keys up to it. */
static void flash_rows(flash_tile *t, const void *k_cache, const void *v_cache, int bf16, const int32_t *table,
                       int64_t bs, int64_t rs, int64_t h, int64_t D, int64_t end, int64_t p0, int64_t nq)
{
    const int64_t R = t->R;
    float *S = t->S, *Kt = t->Kt, *Vc = t->Vc;
    memset(t->O, 0, sizeof(float) * R * D);
    for (int64_t c0 = 0; c0 < end; c0 += KC) {
        const int64_t nk = end - c0 < KC ? end - c0 : KC;
        const int64_t nk16 = (nk + NR - 1) / NR * NR; /* keys computed (a short last chunk stops early) */
        int64_t offs[KC];
        chunk_offsets(offs, table, bs, rs, h, D, c0, nk);
        for (int64_t j0 = 0; j0 < nk16; j0 += 8) {  /* Kt = the chunk's keys transposed, 8x8 at a time */
            const float *kr[8];
            for (int64_t j = j0; j < j0 + 8; j++) {
                if (j >= nk) { kr[j - j0] = NULL; continue; }
                const int64_t off = offs[j];
                if (bf16) {
                    bf16_to_f32((const uint16_t *)k_cache + off, t->Kc + j * D, D);
                    bf16_to_f32((const uint16_t *)v_cache + off, Vc + j * D, D);
                    kr[j - j0] = t->Kc + j * D;
                } else {
                    kr[j - j0] = (const float *)k_cache + off;
                    memcpy(Vc + j * D, (const float *)v_cache + off, sizeof(float) * D);
                }
            }
            for (int64_t d0 = 0; d0 < D; d0 += 8) {
                __m256 m8[8];
                for (int i = 0; i < 8; i++) m8[i] = kr[i] ? _mm256_loadu_ps(kr[i] + d0) : _mm256_setzero_ps();
                transpose8(m8);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(Kt + (d0 + i) * KC + j0, m8[i]);
            }
        }
        for (int64_t c = 0; c < nk16; c += PAIR * NR) { /* S = Qs Kt, 16 keys at a time (or 32: tile_pair) */
            for (int64_t r = 0; r < R; r += MR) {
                const int rows = (int)(R - r < MR ? R - r : MR);
#ifdef PAGEDQ_AVX512
                if (c + NR < nk16) {
                    tile_pair_rows(rows, t->Qs + r * D, D, Kt + c, Kt + c + NR, KC, D, S + r * KC + c,
                                   S + r * KC + c + NR, KC, NULL, NULL, NR, NR, 0, NULL, 0);
                    continue;
                }
#endif
                tile_rows(rows, t->Qs + r * D, D, Kt + c, KC, D, S + r * KC + c, KC, NULL, NR, 0, NULL, 0);
            }
        }
        /* Some key of the chunk is past some query (the chunk's padding keys count as past). */
        const int masked = nq > 0 ? c0 + KC - 1 > p0 : nk < KC;
        for (int64_t r = 0; r < R; r++)  /* key c0 + j visible iff c0 + j <= the row's last visible position */
            chunk_softmax(t, r, (nq > 0 ? p0 + r % nq : end - 1) - c0, masked);
        for (int64_t c = 0; c < D; c += PAIR * NR) { /* T = P Vc, 16 output dims at a time (or 32) */
            for (int64_t r = 0; r < R; r += MR) {
                const int rows = (int)(R - r < MR ? R - r : MR);
#ifdef PAGEDQ_AVX512
                if (c + NR < D) {
                    tile_pair_rows(rows, S + r * KC, KC, Vc + c, Vc + c + NR, D, nk, t->T + r * D + c,
                                   t->T + r * D + c + NR, D, NULL, NULL, NR, NR, 0, NULL, 0);
                    continue;
                }
#endif
                tile_rows(rows, S + r * KC, KC, Vc + c, D, nk, t->T + r * D + c, D, NULL, NR, 0, NULL, 0);
            }
        }
        for (int64_t r = 0; r < R; r++) {  /* O = O * alpha + T */
            float *o = t->O + r * D;
#ifdef PAGEDQ_AVX512
            const __m512 al = _mm512_set1_ps(t->alpha[r]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), al, _mm512_loadu_ps(t->T + r * D + d)));
#else
            const __m256 al = _mm256_set1_ps(t->alpha[r]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_loadu_ps(o + d), al, _mm256_loadu_ps(t->T + r * D + d)));
#endif
        }
    }
}

#ifdef PAGEDQ_AVX512
/* ---- What the two key-major prefill paths share (flash_rows_dp on bf16 dot products, flash_rows_km on fp32
 * FMAs, both below): the tile's rows are the vector lanes, 16 per vector (R rounded up to Rp); a register tile
 * holds LANE_TILE_KEYS broadcast operands (keys for S^T, output dims for O^T) x up to LANE_TILE_VECS row
 * vectors, 24 accumulators; the online softmax runs down the keys, 16 rows at a time. */
#define LANE_TILE_KEYS 8
#define LANE_TILE_VECS 3

/* A register tile's accumulators at its start: out[i][rows] * alpha[rows] (the O^T rescale folded in), or zeros
 * where alpha is NULL (S^T, or a tile's first chunk). */
static inline __attribute__((always_inline)) void lane_tile_start(const int NV, __m512 acc[][LANE_TILE_VECS],
                                                                  const float *out, int64_t Rp, const float *alpha)
{
    for (int v = 0; v < NV; v++) {
        const __m512 al = alpha ? _mm512_load_ps(alpha + 16 * v) : _mm512_setzero_ps();
        for (int i = 0; i < LANE_TILE_KEYS; i++)
            acc[i][v] = alpha ? _mm512_mul_ps(_mm512_load_ps(out + i * Rp + 16 * v), al) : _mm512_setzero_ps();
    }
}

static inline __attribute__((always_inline)) void lane_tile_store(const int NV, __m512 acc[][LANE_TILE_VECS],
                                                                  float *out, int64_t Rp)
{
    for (int i = 0; i < LANE_TILE_KEYS; i++)
        for (int v = 0; v < NV; v++) _mm512_store_ps(out + i * Rp + 16 * v, acc[i][v]);
}

/* The running max m_old of 16 rows carried down keys 0..nk-1 of the scores St (key j at St + j * Rp). MASKED:
 * key j counts only in the rows whose lastv (last visible key, relative to the chunk) >= j. */
static inline __attribute__((always_inline)) __m512 keys_max(const int MASKED, const float *St, int64_t Rp, int64_t nk,
                                                             __m512i lastv, __m512 m_old)
{
    __m512 mx = m_old;
    for (int64_t j = 0; j < nk; j++) {
        const __m512 sj = _mm512_load_ps(St + j * Rp);
        if (MASKED) mx = _mm512_mask_max_ps(mx, _mm512_cmpge_epi32_mask(lastv, _mm512_set1_epi32((int)j)), mx, sj);
        else mx = _mm512_max_ps(mx, sj);
    }
    return mx;
}

/* 16 rows' softmax state after a chunk whose numerators (under the new max mx) sum to `sum`: alpha, the rescale
 * of what they held, exp(m_old - mx); l = l * alpha + sum; m = mx. */
static inline __attribute__((always_inline)) void rows_rescale(__m512 m_old, __m512 mx, __m512 sum, float *m, float *l,
                                                               float *alpha)
{
    /* a row's first chunk always sees key 0, so mx is finite from then on */
    const __m512 al = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                          exp16_scalef(_mm512_sub_ps(m_old, mx)));
    _mm512_store_ps(alpha, al);
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), al, sum));
    _mm512_store_ps(m, mx);
}

/* ---- The bf16 cache's products on AVX512-bf16 dot products (VDPBF16PS): flash_rows_dp.
 *
 * flash_rows widens every key and value of a chunk to fp32 and runs both products through the fp32 register
 * tile: over a bf16 cache, an fp32 cache's arithmetic plus the widening, ~185 GFLOP/s in the compass run
 * (SmolLM2-135M, 2048-token prefill steps) where this CPU's bf16 dot products peak near 850 (fp32 FMA ~446).
 * Here the tile's scaled queries and the softmax numerators P are rounded to bf16 (to nearest even,
 * vcvtne2ps2bf16, as bf16 flash attention does elsewhere) and each product is one VDPBF16PS per pair of
 * reduction steps: K and V stay bf16 as the cache holds them, the sums and the online softmax are fp32.
 *
 * Layout: the tile's rows are the vector lanes throughout (R rounded up to Rp, a multiple of 16).
 *   S^T = K Q^T: one operand the queries transposed once per tile, Qt [D/2][Rp] (row r's (q[2p], q[2p+1]) as
 *     one 32-bit pair); the other a key's d-pair broadcast straight from the cache row, so no key is copied
 *     or transposed (flash_rows copies and transposes every chunk's keys).
 *   The online softmax then runs down the keys, 16 rows per vector: max and sum without horizontal
 *     reductions, the causal mask as a compare of each row's last position, and only on the chunks that need
 *     it. P is written as key pairs of 16 rows, Pp [KC/2][Rp].
 *   O^T = O^T alpha + V^T P^T: one operand Pp, the other a d of two value rows as one pair, broadcast from Vp
 *     [KC/2][D] (rows 2j and 2j + 1 interleaved, one permute per 16 d); O^T [D][Rp] stays in the scratch
 *     (alpha a vector per 16 rows) and goes back to the tile's O once, at the end.
 * Both products run the same register tile (dp_lanes): 8 broadcasts x up to 3 row vectors, 24 accumulators.
 * Measured (AMD EPYC, family 26 model 2 = Zen 5, 2 threads, SmolLM2-135M's heads, bf16 cache, ms, flash_rows
 * -> this; python -m ops.bench.kernel_timing --kv-dtype bfloat16 --only prefill): see the table beside
 * paged_prefill_attention_f32. Results differ from flash_rows' by bf16's rounding of q and P (checked at bf16
 * tolerance in tests/test_cpu_attention.py). pagedq_kernels/cpu_attention.py turns it on (use_dp) only where
 * pagedq_kernels/cpu_isa.py probed AVX512-bf16 runnable under the PAGEDQ_CPU_ISA cap; PAGEDQ_DISABLE_DP_ATTENTION=1
 * keeps flash_rows. The decode cascade's prefix_task stays on flash_rows: its results are checked at fp32
 * tolerance, and the decode entry point takes no such flag. */
#pragma GCC push_options
#pragma GCC target("avx512bf16")

/* Prefill queries per tile on this path. 32 (R = 96 rows for SmolLM2's groups of 3) measured 1 x 2048 tokens
 * 8.59 -> 8.06 ms but 8 x 256 1.47 -> 1.50 (the diagonal chunk's masked keys grow with the tile): kept at 16. */
#define DP_QT 16

typedef struct {
    int64_t Rp;            /* rows rounded up to 16 */
    float *St;             /* [KC][Rp] scores, key-major */
    uint32_t *Qt, *Pp, *Vp; /* [D/2][Rp] queries, [KC/2][Rp] numerators, [KC/2][D] values: bf16 pairs */
    float *m, *l, *alpha;  /* [Rp] running max, sum, this chunk's rescale */
    int32_t *last;         /* [Rp] each row's last visible position */
    uint16_t *zero;        /* [D] a zero row: keys past the chunk's end */
    float *Ot;             /* [D][Rp] the running output, transposed (t->O on return) */
} dp_scratch;

static size_t dp_scratch_floats(int64_t R, int64_t D)
{
    const int64_t Rp = (R + 15) / 16 * 16;
    return (size_t)(KC * Rp + Rp * D / 2 + KC / 2 * Rp + KC / 2 * D + 4 * Rp + D / 2 + D * Rp + 64);
}

static dp_scratch dp_scratch_in(float *scratch, int64_t R, int64_t D)
{
    dp_scratch s;
    s.Rp = (R + 15) / 16 * 16;
    s.St = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); /* every array below starts on a line */
    s.Qt = (uint32_t *)(s.St + KC * s.Rp);
    s.Pp = s.Qt + s.Rp * D / 2;
    s.Vp = s.Pp + KC / 2 * s.Rp;
    s.m = (float *)(s.Vp + KC / 2 * D);
    s.l = s.m + s.Rp; s.alpha = s.l + s.Rp;
    s.last = (int32_t *)(s.alpha + s.Rp);
    s.zero = (uint16_t *)(s.last + s.Rp);
    memset(s.zero, 0, sizeof(uint16_t) * D);
    s.Ot = (float *)(s.zero + D + 32); /* past the zero row, on a line */
    s.Ot = (float *)(((uintptr_t)s.Ot + 63) & ~(uintptr_t)63);
    memset(s.Ot, 0, sizeof(float) * D * s.Rp);
    return s;
}

/* out[i][rows] (i < LANE_TILE_KEYS, row stride Rp) = init + sum over p < n of the bf16 pair a[i][p * as], broadcast,
 * times the pairs b[p][rows] of NV vectors of 16 rows (b, out, alpha already offset to the first). Both products:
 * S^T (a: key rows in the cache, as = 1; b: Qt; init 0) and T^T (a: Vp columns, as = D; b: Pp; init: out times
 * the rows' alpha, the O^T rescale folded in). */
static inline __attribute__((always_inline)) void dp_lanes(const int NV, const uint32_t *const *a, int64_t as,
                                                           const uint32_t *b, int64_t Rp, int64_t n, float *out,
                                                           const float *alpha)
{
    __m512 acc[LANE_TILE_KEYS][LANE_TILE_VECS];
    lane_tile_start(NV, acc, out, Rp, alpha);
    for (int64_t p = 0; p < n; p++) {
        __m512bh bv[LANE_TILE_VECS];
        for (int v = 0; v < NV; v++) bv[v] = (__m512bh)_mm512_load_si512((const void *)(b + p * Rp + 16 * v));
        for (int i = 0; i < LANE_TILE_KEYS; i++) {
            const __m512bh ab = (__m512bh)_mm512_set1_epi32((int)a[i][p * as]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ab, bv[v]);
        }
    }
    lane_tile_store(NV, acc, out, Rp);
}

/* One vector of 16 rows of the chunk's scores St (key j at St + j * Rp, nk keys) -> P as key pairs (Pp), their
 * running max m, sum l and rescale alpha updated, as chunk_softmax does per row. MASKED: key j counts only in
 * the rows whose lastv (last visible key, relative to the chunk) >= j; else every key is visible and nk even. */
static inline __attribute__((always_inline)) void dp_softmax(const int MASKED, const float *St, uint32_t *Pp,
                                                             int64_t Rp, int64_t nk, __m512i lastv, float *m, float *l,
                                                             float *alpha)
{
    /* P's two keys (cvtne2ps: key 2j in bf16 lanes 0-15, key 2j + 1 in 16-31) as one pair per row */
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 m_old = _mm512_load_ps(m);
    const __m512 mx = keys_max(MASKED, St, Rp, nk, lastv, m_old);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < (nk + 1) / 2; j++) {
        __m512 pj[2];
        for (int e = 0; e < 2; e++) {
            const int64_t key = 2 * j + e;
            pj[e] = exp16_scalef(_mm512_sub_ps(_mm512_load_ps(St + key * Rp), mx));
            if (MASKED)
                pj[e] = _mm512_maskz_mov_ps(key < nk ? _mm512_cmpge_epi32_mask(lastv, _mm512_set1_epi32((int)key)) : 0,
                                            pj[e]);
            sum = _mm512_add_ps(sum, pj[e]);
        }
        const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(pj[1], pj[0]);
        _mm512_store_si512((void *)(Pp + j * Rp), _mm512_permutexvar_epi16(pair_idx, packed));
    }
    rows_rescale(m_old, mx, sum, m, l, alpha);
}

/* dp_lanes over all NV row vectors, LANE_TILE_VECS at a time (one inlined copy per count). */
static void dp_lanes_all(int64_t NV, const uint32_t *const *a, int64_t as, const uint32_t *b, int64_t Rp, int64_t n,
                         float *out, const float *alpha)
{
    for (int64_t v0 = 0; v0 < NV; v0 += LANE_TILE_VECS) {
        const int64_t nv = NV - v0 < LANE_TILE_VECS ? NV - v0 : LANE_TILE_VECS;
        const float *al = alpha ? alpha + 16 * v0 : NULL;
        if (nv == 3) dp_lanes(3, a, as, b + 16 * v0, Rp, n, out + 16 * v0, al);
        else if (nv == 2) dp_lanes(2, a, as, b + 16 * v0, Rp, n, out + 16 * v0, al);
        else dp_lanes(1, a, as, b + 16 * v0, Rp, n, out + 16 * v0, al);
    }
}

/* flash_rows (same arguments, same O, m, l on return) for a bf16 cache, on dot products. */
static void flash_rows_dp(flash_tile *t, float *dp_space, const void *k_cache, const void *v_cache,
                          const int32_t *table, int64_t bs, int64_t rs, int64_t h, int64_t D, int64_t end, int64_t p0,
                          int64_t nq)
{
    const int64_t R = t->R, pairs = D / 2;
    dp_scratch s = dp_scratch_in(dp_space, R, D);
    const int64_t Rp = s.Rp, NV = Rp / 16;
    const uint16_t *kc = (const uint16_t *)k_cache, *vc = (const uint16_t *)v_cache;
    /* Qt: the scaled queries rounded to bf16 once per tile; rows past R are zeros (their results unused). */
    for (int64_t r = 0; r < Rp; r++) {
        s.m[r] = -INFINITY; s.l[r] = 0.f;
        s.last[r] = (int32_t)(r < R && nq > 0 ? p0 + r % nq : end - 1);
        for (int64_t d = 0; d < D; d += 32) {
            const __mmask16 lo = lanes16(D - d), hi = lanes16(D - d - 16);
            const __m512 a = r < R ? _mm512_maskz_loadu_ps(lo, t->Qs + r * D + d) : _mm512_setzero_ps();
            const __m512 b = r < R && hi ? _mm512_maskz_loadu_ps(hi, t->Qs + r * D + d + 16) : _mm512_setzero_ps();
            uint32_t pr[16];
            _mm512_storeu_si512((void *)pr, (__m512i)_mm512_cvtne2ps_pbh(b, a)); /* bf16 d..d+31 = 16 pairs */
            for (int i = 0; i < 16 && d / 2 + i < pairs; i++) s.Qt[(d / 2 + i) * Rp + r] = pr[i];
        }
    }
    /* Pairs of 16 lanes interleaved: (a[i], b[i]) as 32-bit lane i; of two value rows, d..d+15 and d+16..d+31. */
    const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i inter_hi = _mm512_add_epi16(inter, _mm512_set1_epi16(16));
    for (int64_t c0 = 0; c0 < end; c0 += KC) {
        const int64_t nk = end - c0 < KC ? end - c0 : KC;
        const int64_t nk8 = (nk + LANE_TILE_KEYS - 1) / LANE_TILE_KEYS * LANE_TILE_KEYS, kpairs = (nk + 1) / 2;
        const uint32_t *kp[KC];
        const uint16_t *vp[KC];
        int64_t offs[KC];
        chunk_offsets(offs, table, bs, rs, h, D, c0, nk);
        for (int64_t j = 0; j < nk8; j++) {
            if (j >= nk) { kp[j] = (const uint32_t *)s.zero; vp[j] = s.zero; continue; }
            kp[j] = (const uint32_t *)(kc + offs[j]);
            vp[j] = vc + offs[j];
        }
        /* S^T = K Qt, LANE_TILE_KEYS keys x up to LANE_TILE_VECS row vectors per register tile */
        for (int64_t j0 = 0; j0 < nk8; j0 += LANE_TILE_KEYS)
            dp_lanes_all(NV, kp + j0, 1, s.Qt, Rp, pairs, s.St + j0 * Rp, NULL);
        /* Vp: value rows 2j and 2j + 1 interleaved (a chunk's odd last key pairs with zeros) */
        for (int64_t j = 0; j < kpairs; j++) {
            const uint16_t *va = vp[2 * j], *vb = 2 * j + 1 < nk ? vp[2 * j + 1] : s.zero;
            for (int64_t d = 0; d < D; d += 32) {
                const __mmask32 m = lanes32(D - d);
                const __m512i a = _mm512_maskz_loadu_epi16(m, va + d), b = _mm512_maskz_loadu_epi16(m, vb + d);
                _mm512_storeu_si512((void *)(s.Vp + j * D + d), _mm512_permutex2var_epi16(a, inter, b));
                if (D - d > 16)
                    _mm512_storeu_si512((void *)(s.Vp + j * D + d + 16), _mm512_permutex2var_epi16(a, inter_hi, b));
            }
        }
        /* Online softmax across keys, 16 rows per vector: key c0 + j visible to row r iff c0 + j <= last[r]. */
        for (int64_t v = 0; v < NV; v++) {
            const __m512i lastv = _mm512_sub_epi32(_mm512_load_si512((const void *)(s.last + 16 * v)),
                                                   _mm512_set1_epi32((int)c0));
            float *sv = s.St + 16 * v;
            uint32_t *pv = s.Pp + 16 * v;
            if (_mm512_reduce_min_epi32(lastv) >= nk - 1 && nk % 2 == 0) /* every row sees every key */
                dp_softmax(0, sv, pv, Rp, nk, lastv, s.m + 16 * v, s.l + 16 * v, s.alpha + 16 * v);
            else
                dp_softmax(1, sv, pv, Rp, nk, lastv, s.m + 16 * v, s.l + 16 * v, s.alpha + 16 * v);
        }
        /* O^T = O^T * alpha + (P V)^T, LANE_TILE_KEYS output dims x up to LANE_TILE_VECS row vectors per register tile */
        for (int64_t d0 = 0; d0 < D; d0 += LANE_TILE_KEYS) {
            const uint32_t *cols[LANE_TILE_KEYS];
            for (int i = 0; i < LANE_TILE_KEYS; i++) cols[i] = s.Vp + d0 + i;
            dp_lanes_all(NV, cols, D, s.Pp, Rp, kpairs, s.Ot + d0 * Rp, s.alpha);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        t->m[r] = s.m[r]; t->l[r] = s.l[r];
        for (int64_t d = 0; d < D; d++) t->O[r * D + d] = s.Ot[d * Rp + r];
    }
}

#pragma GCC pop_options

/* ---- An fp32 cache's products key-major: flash_rows_km.
 *
 * flash_rows_dp's layout with fp32 arithmetic, for the avx512 build over an fp32 cache: the tile's rows are the
 * vector lanes (R rounded up to Rp), S^T = K Q^T broadcasts each key's d straight from its cache row against the
 * queries transposed once per tile (Qt [D][Rp]), the online softmax runs down the keys 16 rows at a time (no
 * horizontal max or sum, no per-row mask set-up), and O^T = O^T alpha + V^T P^T broadcasts each value's d straight
 * from its cache row against the numerators (St, overwritten in place). flash_rows instead transposes every
 * chunk's keys and copies its values for every tile that reads them (a 512-token prompt's early chunks once per
 * later tile of 16 queries), and reduces each row's max and sum across lanes. The same arithmetic up to the order
 * of the sums and the exp (exp16_scalef, ~3 ulp, where flash_rows' exp16 is ~1): fp32 tolerance in
 * tests/test_cpu_attention.py. Measured in the table beside paged_prefill_attention_f32. */
typedef struct {
    int64_t Rp;           /* rows rounded up to 16 */
    float *St;            /* [KC][Rp] scores, then the softmax numerators, key-major */
    float *Qt, *Ot;       /* [D][Rp] the scaled queries and the running output, transposed */
    float *m, *l, *alpha; /* [Rp] running max, sum, this chunk's rescale */
    int32_t *last;        /* [Rp] each row's last visible position */
    float *zero;          /* [D] a zero row: the keys that pad a chunk to LANE_TILE_KEYS */
} km_scratch;

static size_t km_scratch_floats(int64_t R, int64_t D)
{
    const int64_t Rp = (R + 15) / 16 * 16;
    return (size_t)(KC * Rp + 2 * D * Rp + 4 * Rp + D + 64);
}

static km_scratch km_scratch_in(float *scratch, int64_t R, int64_t D)
{
    km_scratch s;
    s.Rp = (R + 15) / 16 * 16;
    s.St = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); /* Rp, a multiple of 16: every array on a line */
    s.Qt = s.St + KC * s.Rp;
    s.Ot = s.Qt + D * s.Rp;
    s.m = s.Ot + D * s.Rp;
    s.l = s.m + s.Rp; s.alpha = s.l + s.Rp;
    s.last = (int32_t *)(s.alpha + s.Rp);
    s.zero = (float *)(s.last + s.Rp);
    memset(s.zero, 0, sizeof(float) * D);
    return s; /* Ot: the first chunk's products write it */
}

/* S^T rows of LANE_TILE_KEYS keys: out[i][rows] = sum over d < D of key[i][d] (broadcast) times Qt[d][rows], for NV
 * vectors of 16 rows (Qt and out already offset to the first). */
static inline __attribute__((always_inline)) void km_scores(const int NV, const float *const *key, const float *Qt,
                                                            int64_t Rp, int64_t D, float *out)
{
    __m512 acc[LANE_TILE_KEYS][LANE_TILE_VECS];
    lane_tile_start(NV, acc, out, Rp, NULL);
    for (int64_t d = 0; d < D; d++) {
        __m512 qv[LANE_TILE_VECS];
        for (int v = 0; v < NV; v++) qv[v] = _mm512_load_ps(Qt + d * Rp + 16 * v);
        for (int i = 0; i < LANE_TILE_KEYS; i++) {
            const __m512 kd = _mm512_set1_ps(key[i][d]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(kd, qv[v], acc[i][v]);
        }
    }
    lane_tile_store(NV, acc, out, Rp);
}

/* O^T rows of LANE_TILE_KEYS output dims d0..: out[i][rows] = out[i][rows] * alpha[rows] (nothing where alpha is NULL:
 * the first chunk) + sum over j < nk of value[j][d0 + i] (broadcast) times P[j][rows], for NV vectors of 16 rows
 * (P, out, alpha already offset). */
static inline __attribute__((always_inline)) void km_values(const int NV, const float *const *value, int64_t d0,
                                                            const float *P, int64_t Rp, int64_t nk, float *out,
                                                            const float *alpha)
{
    __m512 acc[LANE_TILE_KEYS][LANE_TILE_VECS];
    lane_tile_start(NV, acc, out, Rp, alpha);
    for (int64_t j = 0; j < nk; j++) {
        __m512 pv[LANE_TILE_VECS];
        const float *vr = value[j] + d0;
        for (int v = 0; v < NV; v++) pv[v] = _mm512_load_ps(P + j * Rp + 16 * v);
        for (int i = 0; i < LANE_TILE_KEYS; i++) {
            const __m512 vd = _mm512_set1_ps(vr[i]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(vd, pv[v], acc[i][v]);
        }
    }
    lane_tile_store(NV, acc, out, Rp);
}

/* One vector of 16 rows of the chunk's scores St (key j at St + j * Rp, nk keys) -> the numerators in place,
 * the rows' running max m, sum l and rescale alpha updated (chunk_softmax's arithmetic, down the keys).
 * MASKED: key j counts only in the rows whose lastv (last visible key, relative to the chunk) >= j. */
static inline __attribute__((always_inline)) void km_softmax(const int MASKED, float *St, int64_t Rp, int64_t nk,
                                                             __m512i lastv, float *m, float *l, float *alpha)
{
    const __m512 m_old = _mm512_load_ps(m);
    const __m512 mx = keys_max(MASKED, St, Rp, nk, lastv, m_old);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        __m512 pj = exp16_scalef(_mm512_sub_ps(_mm512_load_ps(St + j * Rp), mx));
        if (MASKED) pj = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(lastv, _mm512_set1_epi32((int)j)), pj);
        _mm512_store_ps(St + j * Rp, pj);
        sum = _mm512_add_ps(sum, pj);
    }
    rows_rescale(m_old, mx, sum, m, l, alpha);
}

/* flash_rows (same arguments, same O, m, l on return) for an fp32 cache, key-major. */
static void flash_rows_km(flash_tile *t, float *km_space, const float *k_cache, const float *v_cache,
                          const int32_t *table, int64_t bs, int64_t rs, int64_t h, int64_t D, int64_t end, int64_t p0,
                          int64_t nq)
{
    const int64_t R = t->R;
    km_scratch s = km_scratch_in(km_space, R, D);
    const int64_t Rp = s.Rp, NV = Rp / 16;
    for (int64_t r = 0; r < Rp; r++) {
        s.m[r] = -INFINITY; s.l[r] = 0.f;
        s.last[r] = (int32_t)(r < R && nq > 0 ? p0 + r % nq : end - 1);
    }
    for (int64_t r0 = 0; r0 < Rp; r0 += 8) /* Qt: 8 x 8 blocks transposed; rows past R zeros (results unused) */
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 m8[8];
            for (int i = 0; i < 8; i++)
                m8[i] = r0 + i < R ? _mm256_loadu_ps(t->Qs + (r0 + i) * D + d0) : _mm256_setzero_ps();
            transpose8(m8);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(s.Qt + (d0 + i) * Rp + r0, m8[i]);
        }
    for (int64_t c0 = 0; c0 < end; c0 += KC) {
        const int64_t nk = end - c0 < KC ? end - c0 : KC;
        const int64_t nk8 = (nk + LANE_TILE_KEYS - 1) / LANE_TILE_KEYS * LANE_TILE_KEYS;
        const float *kp[KC], *vp[KC];
        int64_t offs[KC];
        chunk_offsets(offs, table, bs, rs, h, D, c0, nk);
        for (int64_t j = 0; j < nk8; j++) {
            if (j >= nk) { kp[j] = s.zero; continue; }
            kp[j] = k_cache + offs[j];
            vp[j] = v_cache + offs[j];
        }
        for (int64_t j0 = 0; j0 < nk8; j0 += LANE_TILE_KEYS) /* S^T = K Qt */
            for (int64_t v0 = 0; v0 < NV; v0 += LANE_TILE_VECS) {
                const int64_t nv = NV - v0 < LANE_TILE_VECS ? NV - v0 : LANE_TILE_VECS;
                float *out = s.St + j0 * Rp + 16 * v0;
                if (nv == 3) km_scores(3, kp + j0, s.Qt + 16 * v0, Rp, D, out);
                else if (nv == 2) km_scores(2, kp + j0, s.Qt + 16 * v0, Rp, D, out);
                else km_scores(1, kp + j0, s.Qt + 16 * v0, Rp, D, out);
            }
        for (int64_t v = 0; v < NV; v++) { /* key c0 + j visible to row r iff c0 + j <= last[r] */
            const __m512i lastv = _mm512_sub_epi32(_mm512_load_si512((const void *)(s.last + 16 * v)),
                                                   _mm512_set1_epi32((int)c0));
            float *sv = s.St + 16 * v;
            if (_mm512_reduce_min_epi32(lastv) >= nk - 1) /* every row sees every key */
                km_softmax(0, sv, Rp, nk, lastv, s.m + 16 * v, s.l + 16 * v, s.alpha + 16 * v);
            else
                km_softmax(1, sv, Rp, nk, lastv, s.m + 16 * v, s.l + 16 * v, s.alpha + 16 * v);
        }
        for (int64_t d0 = 0; d0 < D; d0 += LANE_TILE_KEYS) /* O^T = O^T alpha + V^T P^T */
            for (int64_t v0 = 0; v0 < NV; v0 += LANE_TILE_VECS) {
                const int64_t nv = NV - v0 < LANE_TILE_VECS ? NV - v0 : LANE_TILE_VECS;
                const float *P = s.St + 16 * v0, *al = c0 ? s.alpha + 16 * v0 : NULL;
                float *out = s.Ot + d0 * Rp + 16 * v0;
                if (nv == 3) km_values(3, vp, d0, P, Rp, nk, out, al);
                else if (nv == 2) km_values(2, vp, d0, P, Rp, nk, out, al);
                else km_values(1, vp, d0, P, Rp, nk, out, al);
            }
    }
    for (int64_t r = 0; r < R; r++) { t->m[r] = s.m[r]; t->l[r] = s.l[r]; }
    for (int64_t r0 = 0; r0 < R; r0 += 8) /* O from O^T, 8 x 8 blocks */
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 m8[8];
            for (int i = 0; i < 8; i++) m8[i] = _mm256_loadu_ps(s.Ot + (d0 + i) * Rp + r0);
            transpose8(m8);
            for (int i = 0; i < 8 && r0 + i < R; i++) _mm256_storeu_ps(t->O + (r0 + i) * D + d0, m8[i]);
        }
}
#endif

/* Cascade, first half: the queries of up to QT decode sequences (for one kv head) over the shared
 * prefix, as one tile of QT * G rows instead of one pass over the prefix per sequence. Leaves the
 * unnormalised output, max and sum of every (sequence, query head) in the prefix_* arrays. */
static void prefix_task(const attn_args *a, int64_t h, int64_t s0, float *scratch)
{
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads, H = a->num_heads;
    const int64_t ns = a->num_seqs - s0 < QT ? a->num_seqs - s0 : QT;
    flash_tile t = flash_tile_in(scratch, ns * G, D);
    for (int64_t j = 0; j < ns; j++)  /* row j * G + g: query head h * G + g of sequence s0 + j */
        for (int64_t g = 0; g < G; g++) {
            const float *src = a->q + a->rows[s0 + j] * a->q_tok + (h * G + g) * a->q_head;
            float *dst = t.Qs + (j * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * a->scale;
        }
    flash_rows(&t, a->k_cache, a->v_cache, a->kv_bf16, a->block_tables + s0 * a->max_blocks, a->block_size,
               a->num_kv_heads * D, h, D, a->prefix_blocks * a->block_size, 0, 0);
    for (int64_t j = 0; j < ns; j++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t i = (s0 + j) * H + h * G + g, r = j * G + g;
            memcpy(a->prefix_o + i * D, t.O + r * D, sizeof(float) * D);
            a->prefix_m[i] = t.m[r];
            a->prefix_l[i] = t.l[r];
        }
}
#endif

/* Blocks that start every sequence's table (the same physical blocks, so the same K/V) and lie wholly
 * before every sequence's last position: what cascade attention can read once for all of them. */
static int64_t shared_prefix_blocks(const int32_t *seq_lens, const int32_t *block_tables, int64_t num_seqs,
                                    int64_t max_blocks, int64_t block_size)
{
    int64_t n = max_blocks;
    for (int64_t s = 0; s < num_seqs && n > 0; s++) {
        const int64_t own = (seq_lens[s] - 1) / block_size; /* full blocks before the last position */
        n = own < n ? own : n;
        const int32_t *t = block_tables + s * max_blocks;
        for (int64_t b = 0; b < n; b++)
            if (t[b] != block_tables[b]) { n = b; break; }
    }
    return n > 0 ? n : 0;
}

/* With cascade set and at least CASCADE_MIN_SEQS sequences whose tables start with the same blocks
 * (a shared system prompt or instruction, a forked prompt), the attention over those blocks is
 * computed once for all of them as one GEMM-shaped tile per kv head (prefix_task) and merged into each
 * sequence's own part: the prefix is read once per step instead of once per sequence. AVX2 and
 * head_dim % 16 == 0 only (the same results otherwise, by per-sequence reads). */
#define CASCADE_MIN_SEQS 4

/* How many leading blocks paged_decode_attention_f32 attends once for all sequences (0: none). */
int64_t decode_cascade_blocks(const int32_t *seq_lens, const int32_t *block_tables, int64_t num_seqs,
                              int64_t max_blocks, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim)
{
#ifdef PAGEDQ_AVX2
    if (num_seqs >= CASCADE_MIN_SEQS && head_dim % NR == 0 && num_heads / num_kv_heads <= 64)
        return shared_prefix_blocks(seq_lens, block_tables, num_seqs, max_blocks, block_size);
#else
    (void)seq_lens; (void)block_tables; (void)num_seqs; (void)max_blocks; (void)block_size;
    (void)num_heads; (void)num_kv_heads; (void)head_dim;
#endif
    return 0;
}

/* The step's new K/V rows into the caches: token i's k row (KVH * D contiguous floats at k + i * k_tok, and
 * likewise v) to slot slots[i], rounded to bf16 (f32_to_bf16: torch's rounding) for a bf16 cache. One call
 * for what torch did in four ops (two conversions, two index_copy_), ~55 us per layer at decode sizes, and
 * k, v are read in place as strided views of the qkv projection's output. Negative slots are skipped. */
void write_kv_cache_f32(const float *k, int64_t k_tok, const float *v, int64_t v_tok, void *k_cache, void *v_cache,
                        const int64_t *slots, int64_t n, int64_t row, int kv_bf16)
{
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue; /* a padding token's slot (-1): nothing to store */
        const int64_t at = slots[i] * row;
        if (kv_bf16) {
            f32_to_bf16(k + i * k_tok, (uint16_t *)k_cache + at, row);
            f32_to_bf16(v + i * v_tok, (uint16_t *)v_cache + at, row);
        } else {
            memcpy((float *)k_cache + at, k + i * k_tok, sizeof(float) * row);
            memcpy((float *)v_cache + at, v + i * v_tok, sizeof(float) * row);
        }
    }
}

/* Whether paged_decode_attention_f32 takes q_lens (several query tokens per sequence) for this cache: the
 * avx512 build, either cache dtype (task_in_place). Measured beside the prefill kernel in
 * paged_decode_attention_f32's comment. */
int paged_decode_multi_query_supported(int kv_bf16)
{
#ifdef PAGEDQ_AVX512
    (void)kv_bf16;
    return 1;
#else
    (void)kv_bf16;
    return 0;
#endif
}

/* Decode: one query token per sequence, or q_lens[s] of them (NULL: one each) where
 * paged_decode_multi_query_supported(kv_bf16); returns -1 (nothing written) for q_lens it does not take.
 * q_lens route the short query chunks of a step here rather than to the prefill kernel: the verification
 * rows of speculative drafts (2-9 tokens) over a whole context, where the prefill kernel's flash tiles,
 * one kv head per task, copy and transpose every K/V chunk for a handful of rows. Measured on an Intel Xeon
 * (family 6 model 167, 2 threads), SmolLM2-135M's heads over a bf16 cache, 64 sequences x 350 positions,
 * 30 layers' caches in turn, ms per layer, this kernel vs the prefill kernel on the same queries:
 *   queries per sequence   1      2      3      5      9      16     24
 *   this kernel          1.163  1.357  1.662  2.185  3.635  6.093  8.616
 *   prefill kernel         -    2.746  2.994  3.673  4.593  5.807  8.305
 * so engine/attention.py sends chunks of up to 10 here (later, with the prefill kernel's products on paired
 * panels, 64 x 350 again: 9 queries 4.14 vs 4.92 ms, 12: 5.37 vs 5.19; over an fp32 cache 9: 4.27 vs 5.57,
 * 12: 5.29 vs 6.01, 16: 6.79 vs 7.20, so up to 16 there). In the compass bench (bf16, speculation on) the
 * step's attention fell from 5.4 s to 4.2 s (verification 4.4 s in the prefill kernel -> 2.4 s with the
 * single-token decodes).
 * use_dp (avx512 build, bf16 cache; the caller's promise that AVX512-bf16 runs here): task_in_place_dp. */
int paged_decode_attention_f32(
    const float *q, int64_t q_tok, int64_t q_head,
    const void *k_cache, const void *v_cache, float *out,
    const int64_t *rows, const int32_t *seq_lens, const int32_t *block_tables, const int32_t *q_lens,
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int kv_bf16, int use_dp, int cascade, int num_threads)
{
#ifndef PAGEDQ_AVX512
    (void)use_dp; /* the dp task exists only in the avx512 build */
#endif
    if (q_lens && !paged_decode_multi_query_supported(kv_bf16)) return -1;
    int64_t max_q = 1;
    for (int64_t s = 0; q_lens && s < num_seqs; s++) max_q = q_lens[s] > max_q ? q_lens[s] : max_q;
    if (max_q > 1) cascade = 0; /* the shared-prefix pass takes one query per sequence */
    const int64_t group = num_heads / num_kv_heads;
    int use_avx2 = 0;
#if defined(PAGEDQ_AVX512)
    use_avx2 = 1; /* task_in_place: any head_dim */
#elif defined(PAGEDQ_AVX2)
    use_avx2 = head_dim % 8 == 0;
#endif
    int64_t prefix_blocks = cascade ? decode_cascade_blocks(seq_lens, block_tables, num_seqs, max_blocks, block_size,
                                                            num_heads, num_kv_heads, head_dim) : 0;
    float *prefix = prefix_blocks ? (float *)malloc(sizeof(float) * num_seqs * num_heads * (head_dim + 2)) : NULL;
    if (!prefix) prefix_blocks = 0;
    const attn_args a = {q, q_tok, q_head, k_cache, v_cache, out, rows, seq_lens, block_tables,
                         max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale, num_seqs,
                         prefix_blocks, prefix, prefix ? prefix + num_seqs * num_heads * head_dim : NULL,
                         prefix ? prefix + num_seqs * num_heads * (head_dim + 1) : NULL, kv_bf16, q_lens};
    int64_t max_len = 0;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int64_t prefix_tiles = prefix_blocks ? (num_seqs + QT - 1) / QT : 0;

    /* One task per sequence (all its kv heads: each block it reads, and prefetches, is one contiguous
       range), or per (sequence, kv head) when there are fewer sequences than threads; either way
       the G query heads sharing a kv head are done together, so each K/V row is read from memory
       once. Scratch is per thread, sized for the longest context and the prefix pass's tile. */
    const int64_t per_task = use_avx2 && num_seqs >= num_threads ? num_kv_heads : 1;
    const int64_t parts = num_kv_heads / per_task;
    #pragma omp parallel num_threads(num_threads)
    {
#ifdef PAGEDQ_AVX512
        /* task_in_place: per row its scores, q and output in rows of head_dim rounded up to 32, max and sum */
        size_t floats = (size_t)(per_task * group * max_q * (max_len + 2 * ((head_dim + 31) / 32 * 32) + 2) + 8);
#else
        const int64_t staging = kv_bf16 ? block_size * num_kv_heads * head_dim : 0; /* bf16 widened (task_avx2) */
        size_t floats = (size_t)(per_task * group * (max_len + head_dim + 2) + staging + 8);
#endif
#ifdef PAGEDQ_AVX2
        if (prefix_tiles && flash_tile_floats(QT * group, head_dim) > floats) floats = flash_tile_floats(QT * group, head_dim);
#endif
        float *scratch = (float *)malloc(sizeof(float) * floats);
#ifdef PAGEDQ_AVX2
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t i = 0; i < prefix_tiles; i++) prefix_task(&a, h, i * QT, scratch);
#endif
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t part = 0; part < parts; part++) {
                if (seq_lens[s] <= 0) continue;
#ifdef PAGEDQ_AVX512
                /* read in place, either cache dtype (task_in_place's comment, measurements) */
                if (kv_bf16 && use_dp) task_in_place_dp(&a, s, part * per_task, (part + 1) * per_task, scratch);
                else if (kv_bf16) task_bf16_avx512(&a, s, part * per_task, (part + 1) * per_task, scratch);
                else task_f32_avx512(&a, s, part * per_task, (part + 1) * per_task, scratch);
                continue;
#endif
#ifdef PAGEDQ_AVX2
                if (use_avx2) { task_avx2(&a, s, part * per_task, (part + 1) * per_task, scratch); continue; }
#endif
                task_generic(&a, s, part, scratch, scratch + group * max_len, scratch + group * (max_len + head_dim));
            }
        }
        free(scratch);
    }
    free(prefix);
    return 0;
}

/* ---- Prefill: causal attention of each sequence's chunk of new queries over its cached context.
 *
 * Sequence i's q_lens[i] queries are the flattened rows q_starts[i]... at positions
 * seq_lens[i] - q_lens[i] ... seq_lens[i] - 1, and attend to cache positions 0..their own (the
 * chunk's K/V are already in the cache). One task = (sequence, kv head, tile of QT positions): the
 * G query heads sharing the kv head give R = G * QT rows, so every K/V row is read once per tile. */
#ifdef PAGEDQ_AVX2
typedef struct {
    const float *q; int64_t q_tok, q_head;
    const void *k_cache, *v_cache; float *out;
    const int64_t *q_starts; const int32_t *q_lens, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int kv_bf16;
    int use_dp;         /* a bf16 cache's products on VDPBF16PS (flash_rows_dp); the avx512 build only */
    int key_major;      /* an fp32 cache's products key-major (flash_rows_km); the avx512 build only */
    int64_t qt;         /* queries per tile */
    int64_t aux_offset; /* where flash_rows_dp's or flash_rows_km's scratch starts in a thread's scratch (floats) */
} prefill_args;

static void prefill_task(const prefill_args *a, int64_t s, int64_t h, int64_t t0, float *scratch)
{
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads, q_len = a->q_lens[s];
    const int64_t nq = q_len - t0 < a->qt ? q_len - t0 : a->qt;
    const int64_t p0 = a->seq_lens[s] - q_len + t0;
    flash_tile t = flash_tile_in(scratch, G * nq, D);
    for (int64_t g = 0; g < G; g++)  /* row r = g * nq + i: query i of head h * G + g */
        for (int64_t i = 0; i < nq; i++) {
            const float *src = a->q + (a->q_starts[s] + t0 + i) * a->q_tok + (h * G + g) * a->q_head;
            float *dst = t.Qs + (g * nq + i) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * a->scale;
        }
#ifdef PAGEDQ_AVX512
    if (a->use_dp)
        flash_rows_dp(&t, scratch + a->aux_offset, a->k_cache, a->v_cache, a->block_tables + s * a->max_blocks,
                      a->block_size, a->num_kv_heads * D, h, D, p0 + nq, p0, nq);
    else if (a->key_major)
        flash_rows_km(&t, scratch + a->aux_offset, (const float *)a->k_cache, (const float *)a->v_cache,
                      a->block_tables + s * a->max_blocks, a->block_size, a->num_kv_heads * D, h, D, p0 + nq, p0, nq);
    else
#endif
    flash_rows(&t, a->k_cache, a->v_cache, a->kv_bf16, a->block_tables + s * a->max_blocks, a->block_size,
               a->num_kv_heads * D, h, D, p0 + nq, p0, nq);
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t r = g * nq + i;
            float *dst = a->out + ((a->q_starts[s] + t0 + i) * a->num_heads + h * G + g) * D;
            const __m256 inv = _mm256_set1_ps(1.f / t.l[r]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(t.O + r * D + d), inv));
        }
}
#endif

/* Prefill without flash tiles (the generic build, the native one on other architectures; a head_dim they do not
 * take): each prompt row is decoded as a sequence of its own, over the positions up to and with its own (the same
 * block table), so its floats are what decoding that token gives and never depend on the chunk it came in.
 * Before, these builds prefilled through torch's SDPA, whose floats on an AMD EPYC Zen 5 (family 26 model 2)
 * depended on the query chunk's length: a prompt whose head came from the prefix cache got logprobs that moved in
 * the last bit. Cost, there (2 threads; 9 q / 3 kv heads, blocks of 16; the engine's attention forward, fastest
 * of 5, ms, this vs torch's SDPA, which is not capped to the build's instruction set): generic build, head_dim
 * 64, 4 x 256 tokens 8.1 vs 4.4, 1 x 512 7.1 vs 3.8, 1 x 2048 118 vs 41; head_dim 20, avx512 build
 * (task_in_place) 1 x 512 1.20 vs 1.76, 1 x 2048 18.2 vs 17.1; avx2 build (the portable task) 5.2 vs 1.7 and 82
 * vs 17. The floats first: the generic build serves CPUs without AVX2, and no model pagedq ships has a head size
 * that is not a multiple of 16 (the native build, on ARM, is not measured). */
static void prefill_as_decodes(const float *q, int64_t q_tok, int64_t q_head, const void *k_cache,
                               const void *v_cache, float *out, const int64_t *q_starts, const int32_t *q_lens,
                               const int32_t *seq_lens, const int32_t *block_tables, int64_t num_seqs,
                               int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale, int kv_bf16, int use_dp, int num_threads)
{
    int64_t most = 0;
    for (int64_t s = 0; s < num_seqs; s++) most = q_lens[s] > most ? q_lens[s] : most;
    if (most == 0) return;
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * most);
    int32_t *lens = (int32_t *)malloc(sizeof(int32_t) * most);
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t n = q_lens[s];
        for (int64_t r = 0; r < n; r++) { /* the latest rows (the longest contexts) first, as tasks are taken */
            rows[r] = q_starts[s] + n - 1 - r;
            lens[r] = seq_lens[s] - (int32_t)r;
        }
        /* One decode call per sequence, its table at stride 0: every row reads the sequence's one table. */
        if (n > 0)
            paged_decode_attention_f32(q, q_tok, q_head, k_cache, v_cache, out, rows, lens,
                                       block_tables + s * max_blocks, NULL, n, 0, num_heads, num_kv_heads, head_dim,
                                       block_size, scale, kv_bf16, use_dp, 0, num_threads);
    }
    free(lens);
    free(rows);
}

/* out [N, H, D] contiguous; q, caches as for decode. Any head_dim (flash tiles or prefill_as_decodes).
 * use_dp: a bf16 cache's products on AVX512-bf16 dot products (flash_rows_dp, tiles of DP_QT queries); the
 * caller sets it only where that instruction runs, and it is ignored outside the avx512 build or over fp32.
 * Measured with it (AMD EPYC, family 26 model 2 = Zen 5, 2 threads, SmolLM2-135M's heads (9 q / 3 kv, D 64,
 * blocks of 16), bf16 cache; python -m ops.bench.kernel_timing --kv-dtype bfloat16 --only prefill, fastest of
 * 5 interleaved rounds; ms and GFLOP/s of causal attention, flash_rows -> flash_rows_dp):
 *   4 x 256 tokens           1.157 -> 0.705   262 -> 430
 *   8 x 256                  2.344 -> 1.387   259 -> 437
 *   256 after 256 cached     0.798 -> 0.392   284 -> 579
 *   1 x 2048                17.278 -> 8.176   280 -> 591
 * (the phases of 1 x 2048, each timed by skipping it: S and P V ~3 ms each, the softmax ~1.4, the rest ~0.5).
 * An fp32 cache in the avx512 build takes flash_rows_km. Measured on an AMD EPYC (family 25 model 17 = Zen 4,
 * 2 threads), the same heads and command with --kv-dtype float32, two interleaved rounds each, flash_rows ->
 * flash_rows_km, ms (GFLOP/s of causal attention; this CPU's fp32 FMA peak ~229):
 *   4 x 256 tokens           2.09 -> 1.78-1.81   145 -> 170
 *   8 x 256                  4.28-4.43 -> 3.60-3.80
 *   256 after 256 cached     1.43 -> 1.20
 *   1 x 2048                30.25-30.37 -> 25.32-25.65   160 -> 191
 * (phases of 1 x 2048 there: S^T ~11 ms and P V ~11, both near the FMA peak; the softmax ~2.6 with exp16, ~1.0
 * with exp16_scalef; the rest ~0.5). In the compass bench (fp32, no drafts) the step's prefill attention went
 * from 1.51 to 1.30 s. */
void paged_prefill_attention_f32(
    const float *q, int64_t q_tok, int64_t q_head,
    const void *k_cache, const void *v_cache, float *out,
    const int64_t *q_starts, const int32_t *q_lens, const int32_t *seq_lens, const int32_t *block_tables,
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int kv_bf16, int use_dp, int num_threads)
{
    if (!prefill_flash_tiles(head_dim)) {
        prefill_as_decodes(q, q_tok, q_head, k_cache, v_cache, out, q_starts, q_lens, seq_lens, block_tables,
                           num_seqs, max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale, kv_bf16,
                           use_dp, num_threads);
        return;
    }
#ifdef PAGEDQ_AVX2
    int64_t tile_q = QT;
#ifdef PAGEDQ_AVX512
    use_dp = use_dp && kv_bf16;
    if (use_dp) tile_q = DP_QT;
    const int key_major = !kv_bf16; /* an fp32 cache: flash_rows_km */
#else
    use_dp = 0;
    const int key_major = 0;
#endif
    const int64_t G = num_heads / num_kv_heads;
    const size_t tile_floats = flash_tile_floats(G * tile_q, head_dim);
    const prefill_args a = {q, q_tok, q_head, k_cache, v_cache, out, q_starts, q_lens, seq_lens,
                            block_tables, max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale, kv_bf16,
                            use_dp, key_major, tile_q, (int64_t)tile_floats};
    int64_t num_tasks = 0;
    for (int64_t s = 0; s < num_seqs; s++) num_tasks += num_kv_heads * ((q_lens[s] + tile_q - 1) / tile_q);
    int64_t *tasks = (int64_t *)malloc(sizeof(int64_t) * 3 * (num_tasks ? num_tasks : 1));
    int64_t t = 0;
    /* Latest tiles first: they attend to the most keys, and dynamic scheduling then balances the rest. */
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t0 = ((q_lens[s] + tile_q - 1) / tile_q - 1) * tile_q; t0 >= 0; t0 -= tile_q)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                tasks[3 * t] = s; tasks[3 * t + 1] = h; tasks[3 * t + 2] = t0; t++;
            }
    #pragma omp parallel num_threads(num_threads)
    {
        size_t floats = tile_floats;
#ifdef PAGEDQ_AVX512
        if (use_dp) floats += dp_scratch_floats(G * tile_q, head_dim);
        if (key_major) floats += km_scratch_floats(G * tile_q, head_dim);
#endif
        float *scratch = (float *)malloc(sizeof(float) * floats);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++) prefill_task(&a, tasks[3 * i], tasks[3 * i + 1], tasks[3 * i + 2], scratch);
        free(scratch);
    }
    free(tasks);
#endif
}
