/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for float32 on the CPU, with W packed once into panels.
 *
 * Why: a decode step multiplies a handful of rows by every weight of the model, so it is a stream
 * of the weights from memory. oneDNN's blocked kernels read them at 5-7 GB/s for 1-16 rows on a
 * 2-core EPYC (a plain sum streams 16), which made the tail of a batch (the last few long requests)
 * cost 3x its bandwidth bound. Here W is stored as panels of 16 output columns, each panel
 * contiguous over K ([N/16][K][16]), so every thread reads its panels front to back exactly once
 * for up to MB rows of x at a time; the 6x16 register tile (12 accumulators, BLIS's Haswell shape) keeps
 * the FMA units busy once rows are many.
 *
 * In the avx512 build two adjacent panels go through one tile (gemm_tile.h tile_pair: 12 rows x 32
 * columns), so each broadcast of x feeds two FMAs: measured on an Intel Xeon (family 6 model 167, 2
 * threads), SmolLM2-135M's four projections over 30 layers' weights (cold at m <= 64), GFLOP/s, one panel
 * per tile -> two (oneDNN's fp32 in the same runs): m=8 99 -> 112 (71-72), 36: 181 -> 233 (174-188),
 * 64: 206 -> 261 (202-216), 256: 239 -> 358 (322-369), 2048: 233 -> 334 (325-358). compass in fp32 without
 * speculation: 213.8 tok/s (README run 25) -> 240.0.
 *
 * A work item's first row tile reads its panels from memory and the later ones from L2, so with the weight
 * streamed only by the first (8 KB ahead), memory sat idle through the later tiles and the first ran at
 * memory speed: at 36 rows an fp32 pair of panels needs 128 B per 24 FMAs, ~74 GB/s for both cores against
 * the ~39 GB/s two threads read on a Zen 5. So every row tile of an item, when there are two or more, also
 * prefetches its share of the next item's panels into L2 (ahead_share), spreading the stream over the whole
 * item. Measured on a 2-vCPU AMD EPYC Zen 5 (family 26 model 2; 30 copies of each weight, 2 threads,
 * interleaved builds, GFLOP/s at 8 / 36 / 64 / 256 rows, without -> with): qkv 191 / 390 / 382 / 442 ->
 * 194 / 438 / 432 / 442; o 255 / 393 / 417 / 460 -> 244 / 434 / 440 / 468; gate_up 154 / 363 / 381 / 440
 * -> 156 / 433 / 422 / 446; down 316 / 437 / 450 / 460 -> 311 / 436 / 451 / 448; the lm_head's argmax 146 /
 * 347 / 396 / 416 -> 142 / 429 / 415 / 421. One row tile (<= 12 rows) gains nothing consistent from it
 * (its own prefetch already streams), so it keeps none. The avx2 build's single-panel items (6-row tiles) do
 * the same; its build on that Zen 5 (7 rounds, GFLOP/s at 8 / 36 / 64 / 256 rows, without -> with): qkv 151 /
 * 231 / 239 / 253 -> 170 / 232 / 243 / 254; gate_up 152 / 223 / 233 / 235 -> 170 / 239 / 240 / 240; o and down
 * within +-3 %. Not yet measured on an AVX2-only CPU (Zen 3), whose memory is slower per FMA, where it
 * should matter more.
 *
 * From TRIPLE_MIN_ROWS rows (prefill steps, decode steps of 16 rows or more) the avx512 build's work items are three
 * panels through an 8-row tile (gemm_tile.h tile_triple: 8 broadcasts + 3 weight loads for 24 FMAs, where
 * tile_pair issues 12 + 2), the same chain of FMAs per output, so a row's floats do not depend on its step's size
 * (tests/test_cpu_kernels.py). Intel
 * Xeon family 6 model 207, 2 threads, SmolLM2's shapes, interleaved builds, best of 5, GFLOP/s pair -> triple:
 * 2048 rows qkv 197 -> 208, o 197 -> 209, gate_up 195 -> 244, down 261 -> 281; 512 rows qkv 200 -> 210, o 204
 * -> 207, gate_up 193 -> 198, down 183 -> 206; 256 rows 235 -> 239, 226 -> 249, 192 -> 200, 200 -> 217 (oneDNN
 * there: 237-260 at 2048 rows). compass fp32 without drafts, old and new in alternating processes: its eight
 * 2048-token prefill steps 21.5 / 20.2 s -> 19.0 / 19.3 s, 192.9 / 202.4 -> 215.5 / 206.6 tok/s. Its later row
 * tiles read an item's panels from L2, so they prefetch them into L1 a few k rows ahead, and only a block's first
 * row tile streams them from memory into L2 (tile_triple's from_memory; 4-15 % at 512-2048 rows, measured there).
 * With that prefetch the triple tile also wins from 96 rows (a decode step that verifies drafts has a row per
 * draft: 32 sequences with 3 drafts each are 128), so TRIPLE_MIN_ROWS went from 256 to 96. The same machine, the
 * 30-layer pass, builds interleaved, best of 7, GFLOP/s pair -> triple (two copies of each build): 96 rows 182 /
 * 162 -> 194 / 195, 128 rows 195 / 213 -> 215 / 220, 192 rows 193 / 193 -> 215 / 218; at 64 rows 185 / 195 -> 196
 * / 187 and at 40-56 rows within +-3 %. In compass fp32 with drafts the steps of 96-255 rows spent 2.1-2.3 s in
 * their matmuls (of ~25 s) before and after: the host's minute does not resolve it.
 * What the triple lacked at decode sizes was the pair's ahead prefetch: a block of few rows has few row tiles, and
 * only its first streamed the panels from memory. With each row tile prefetching its share of the next triple
 * (blocks up to TRIPLE_AHEAD_ROWS rows) the triple wins from 16 rows, so TRIPLE_MIN_ROWS went from 96 to 16. The
 * same machine and pass, two copies of each build interleaved, best of 7, GFLOP/s before -> after: 16 rows 148.6 /
 * 147.0 -> 158.1 / 158.9, 24 rows 196.5 / 192.1 -> 210.8 / 209.7, 36 rows 243.8 / 241.5 -> 247.6 / 247.5, 48 rows
 * 271.6 / 266.4 -> 267.4 / 269.7, 64 rows 257.5 / 272.1 -> 278.1 / 271.7, 96 rows 271.8 / 271.6 -> 290.3 / 291.6,
 * 128 rows 279.0 / 272.2 -> 292.5 / 295.2 (the ahead prefetch at 192-384 rows: 0-2 % slower, so not there);
 * from 1 row, the triple ran 1 row 7 % slower and 4-12 rows alike.
 *
 * Layout of a packed weight: ceil(N/16) panels of K x 16 floats; columns past N are zero. The
 * register tile lives in gemm_tile.h (prefill attention runs on it too); with glu, the merged
 * gate/up weight is packed so the tile's epilogue emits silu(gate) * up directly.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* The tile prefetches its panels into L2, not L1: a PREFETCHT0 holds an L1 miss buffer per line until it lands,
 * and the tile's own loads queue behind them (cpu_bf16_dp.c measured it for its tile). 30 layers' projections + the
 * lm_head's argmax, cold, builds interleaved in one process, best of 4-5 rounds, ms per step at 1 / 8 / 32-36 / 64
 * rows, 2-vCPU AMD EPYC Zen 4 (family 25 model 17): avx512 build T0 16.0 / 18.6 / 45.3 / 85.0 -> T1 16.1 / 16.6 /
 * 44.5 / 83.4; avx2 build 18.6 / 19.5 / 51.5 / 96.0 -> 18.8 / 20.6 / 49.3 / 86.9. (The int8 kernel's tile reads
 * a panel it dequantised into L2 itself, and keeps T0: T1 there measured 0-10 % slower at 1-64 rows.) */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#include "gemm_tile.h"

#ifndef PAGEDQ_AVX2
#error "cpu_gemm needs AVX2/FMA: without them the packed weights go to oneDNN (pagedq_kernels/cpu_linear.py)"
#endif
#ifndef TRIPLE_MIN_ROWS
#define TRIPLE_MIN_ROWS 16 /* rows from which the avx512 build's items are three panels (measured in the header) */
#endif
#ifndef TRIPLE_AHEAD_ROWS
#define TRIPLE_AHEAD_ROWS 128 /* blocks of up to this many rows prefetch the next triple's panels (the header) */
#endif
/* Rows up to which the avx512 build's items are triples (gemm_panels_triple_rows; tile_pair's pairs above): the
 * triple's edge is the Intel core's, not an AMD Zen 5's. That Zen 5 (family 26 model 2, 2 threads), the 30-layer
 * pass (SmolLM2's four projections, 30 distinct copies of each weight, in order), builds interleaved in one
 * process, two copies of each, best of 7, GFLOP/s triple -> pair: 96 rows 457 / 454 -> 467 / 468, 192: 444 / 456
 * -> 486 / 486, 384: 450 / 446 -> 474 / 475, 1024: 439 / 436 -> 473 / 463, 2048: 430 / 432 -> 450 / 442; best of
 * 9 at decode sizes: 16 rows 306 / 303 -> 302 / 295, 20: 331 / 338 -> 352 / 355, 24: 403 / 411 -> 420 / 424, 32:
 * 424 / 425 -> 431 / 429, 40: 454 / 450 -> 437 / 434, 48: 444 / 444 -> 460 / 454, 56: 469 / 471 -> 481 / 483, 64:
 * 479 / 474 -> 479 / 484 (the 8-row tile wins where the rows split into 8s better than 12s). compass fp32 without
 * drafts, one engine, the settings interleaved, median wall: triples from 16 rows 20.61 s against pairs 19.54 s (4
 * rounds); triples up to 63 rows 20.06 s against pairs 19.21 s (6 rounds). So there pagedq_kernels/cpu_linear.py
 * sets 0 (pairs only); the floats are the same either way. A Zen 4 (family 25 model 17) measured the same way too
 * (cpu_linear.triple_tile_max_rows), so AMD's cores all take pairs. */
static int64_t triple_max_rows = INT64_MAX;

/* Sets the rows up to which the triple serves (max_rows >= 0; a negative value only asks) and returns the last. */
int64_t gemm_panels_triple_rows(int64_t max_rows)
{
    const int64_t before = triple_max_rows;
    if (max_rows >= 0)
        triple_max_rows = max_rows;
    return before;
}

#ifndef MB
#define MB 384 /* rows of x per block (measured 256-384 best here): the block is reused across every panel */
#endif

void pack_panels_f32(const float *w, int64_t n, int64_t k, float *out)
{
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.f;
            }
    }
}

/* Gate/up weight [2i, k] (gate rows first, like the merged gate_up projection) packed so panel p
 * holds gate columns 8p..8p+7 in lanes 0-7 and the matching up columns in lanes 8-15: one tile then
 * has both halves of 8 outputs of silu(gate) * up, and the 2i-wide intermediate is never stored. */
void pack_glu_panels_f32(const float *w, int64_t i, int64_t k, float *out)
{
    const int64_t panels = (i + NR / 2 - 1) / (NR / 2);
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR / 2; j++) {
                const int64_t col = p * (NR / 2) + j;
                dst[kk * NR + j] = col < i ? w[col * k + kk] : 0.f;
                dst[kk * NR + NR / 2 + j] = col < i ? w[(i + col) * k + kk] : 0.f;
            }
    }
}

#ifndef AHEAD_MIN_TILES
#define AHEAD_MIN_TILES 2 /* row tiles an item needs before its tiles prefetch the next item (measured above) */
#endif
/* The row tile (`height` rows: MR, or TR for tile_triple) at row offset `r0` of a block of `rows` over the work
 * item of `step` panels from panel p (of `panels`, each k x NR floats: k cache lines) prefetches this share of the
 * next item's panels into L2, when there is a next item: sets *ahead and returns its line count (0: none). */
static inline int64_t ahead_share(const float *panel, int64_t p, int64_t step, int64_t panels, int64_t k,
                                  int has_next, int64_t r0, int64_t rows, int64_t height, const char **ahead)
{
    const int64_t tiles = (rows + height - 1) / height, tile = r0 / height;
    *ahead = NULL;
    if (!has_next || tiles < AHEAD_MIN_TILES) return 0;
    const int64_t next_panels = panels - p - step < step ? panels - p - step : step;
    const int64_t lines = next_panels * k; /* one 64-byte line per k row of a panel */
    const int64_t share = (lines + tiles - 1) / tiles, first = tile * share;
    if (first >= lines) return 0;
    *ahead = (const char *)(panel + step * k * NR) + first * 64;
    return lines - first < share ? lines - first : share;
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T + bias for this thread's static share of the
 * panels, every MB-row block of x over them (inside the caller's parallel region; no barrier at the end). */
static void panel_items(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                        int64_t m, int64_t n, int64_t k, int glu)
{
    const int64_t width = glu ? NR / 2 : NR; /* output columns per panel */
    const int64_t panels = (n + width - 1) / width;
#ifdef PAGEDQ_AVX512
    /* panels per work item: tile_triple's three from TRIPLE_MIN_ROWS rows where that leaves two items or more (a
     * last one or two panels through tile_pair or alone) up to triple_max_rows, else tile_pair's two (a last odd
     * one alone) */
    const int64_t step = m >= TRIPLE_MIN_ROWS && m <= triple_max_rows && panels >= 6 ? 3 : 2;
#else
    const int64_t step = 1;
#endif
    const int64_t items = (panels + step - 1) / step;
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const int64_t m1 = m0 + MB < m ? m0 + MB : m;
        #pragma omp for schedule(static) nowait
        for (int64_t item = 0; item < items; item++) {
            const int64_t p = item * step;
            const float *panel = packed + p * k * NR;
            const int64_t col = p * width;
            const int ncols = (int)(n - col < width ? n - col : width);
            const float *bp = bias && !glu ? bias + col : NULL;
#ifdef PAGEDQ_AVX512
            if (step == 3 && p + 2 < panels) { /* a last item of one or two panels goes on below, as with step 2 */
                const int ncols1 = (int)(n - col - width < width ? n - col - width : width);
                const int ncols2 = (int)(n - col - 2 * width < width ? n - col - 2 * width : width);
                const int next = item + 1 < items && m1 - m0 <= TRIPLE_AHEAD_ROWS;
                for (int64_t r = m0; r < m1; r += TR) {
                    const int rows = (int)(m1 - r < TR ? m1 - r : TR);
                    const char *ahead;
                    const int64_t ahead_lines = ahead_share(panel, p, step, panels, k, next, r - m0, m1 - m0, TR, &ahead);
                    tile_triple_rows(rows, x + r * ldx, ldx, panel, k, y + r * ldy + col, ldy, bp, width, ncols,
                                     ncols1, ncols2, glu, r == m0 && !ahead_lines, ahead, ahead_lines);
                }
                continue;
            }
            if (p + 1 < panels) {
                const int64_t col1 = col + width;
                const int ncols1 = (int)(n - col1 < width ? n - col1 : width);
                for (int64_t r = m0; r < m1; r += MR) {
                    const int rows = (int)(m1 - r < MR ? m1 - r : MR);
                    const char *ahead;
                    const int64_t ahead_lines = ahead_share(panel, p, step, panels, k, item + 1 < items, r - m0, m1 - m0, MR, &ahead);
                    tile_pair_rows(rows, x + r * ldx, ldx, panel, panel + k * NR, NR, k, y + r * ldy + col,
                                   y + r * ldy + col1, ldy, bp, bp ? bp + width : NULL, ncols, ncols1, glu, ahead,
                                   ahead_lines);
                }
                continue;
            }
#endif
            for (int64_t r = m0; r < m1; r += MR) {
                const int rows = (int)(m1 - r < MR ? m1 - r : MR);
                const char *ahead;
                const int64_t ahead_lines = ahead_share(panel, p, step, panels, k, item + 1 < items, r - m0, m1 - m0, MR, &ahead);
                tile_rows(rows, x + r * ldx, ldx, panel, NR, k, y + r * ldy + col, ldy, bp, ncols, glu, ahead,
                          ahead_lines);
            }
        }
    }
}

static int64_t panel_work_items(int64_t n, int glu)
{
    const int64_t panels = (n + (glu ? NR / 2 : NR) - 1) / (glu ? NR / 2 : NR);
#ifdef PAGEDQ_AVX512
    return (panels + 1) / 2;
#else
    return panels;
#endif
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T + bias, W packed by pack_panels_f32;
 * with glu, W packed by pack_glu_panels_f32 and y [m, n] = silu(x @ gate^T) * (x @ up^T), no bias. */
void gemm_panels_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int glu, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (panel_work_items(n, glu) > 1)
    panel_items(x, ldx, packed, bias, y, ldy, m, n, k, glu);
}

/* The residual add and the RMSNorm after a projection (o_proj, down): y [m, n] = x @ W^T + bias + residual (the
 * new residual stream), normed [m, n] = norm_w * y / rms(y), each row by add_rms_norm_row as cpu_ops.c's
 * rms_norm_f32 computes it (the same floats). One call instead of two: a decode step runs 60 such norms, ~10-30 us
 * each in their own call (Python, ctypes) for a few microseconds of work.
 *
 * From ADD_NORM_SPLIT_ROWS rows the product (gemm_panels_f32) and the row pass run as two parallel regions; below
 * that, as one with a barrier between them. Measured on a 2-vCPU AMD EPYC Zen 4 (family 25 model 17), 8 copies of
 * each weight, builds interleaved in one process, GFLOP/s one region -> two (the plain product alone): o 576x576
 * at 8 / 16 / 64 / 256 / 2048 rows 198 / 204 / 215 / 213 / 206 -> 194 / 206 / 221 / 221 / 217 (207 / 217 / 229 /
 * 230 / 227), down 1536x576 207 / 210 / 216 / 216 / 214 -> 205 / 213 / 223 / 225 / 223. A region holding the
 * product alone, with neither barrier nor row pass, still ran 3-4 % under gemm_panels_f32's own (why is not
 * known). The same split in the bf16 kernel (cpu_bf16_dp.c) gained nothing. Also tried, no faster: the residual
 * added in the tile's registers with per-panel sums of squares and each thread scaling its own columns (the
 * residual's misses then stalled the tile until prefetched), and product-then-norm in 128-row blocks. */
#ifndef ADD_NORM_SPLIT_ROWS
#define ADD_NORM_SPLIT_ROWS 16
#endif
void gemm_panels_add_norm_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
                              int64_t m, int64_t n, int64_t k, const float *residual, const float *norm_w, float eps,
                              float *normed, int num_threads)
{
    if (m >= ADD_NORM_SPLIT_ROWS) {
        gemm_panels_f32(x, ldx, packed, bias, y, n, m, n, k, 0, num_threads);
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t i = 0; i < m; i++)
            add_rms_norm_row(y + i * n, residual + i * n, norm_w, normed + i * n, y + i * n, n, eps);
        return;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        panel_items(x, ldx, packed, bias, y, n, m, n, k, 0);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            add_rms_norm_row(y + i * n, residual + i * n, norm_w, normed + i * n, y + i * n, n, eps);
    }
}

/* Per row of x @ W^T (W packed by pack_panels_f32, no bias): its largest value into best[i] and the first
 * column holding it into idx[i], torch.max(dim=1)'s answer (a NaN anywhere is the maximum, at the first NaN),
 * without writing the product: the greedy sampler's argmax over the lm_head's logits
 * (pagedq_kernels/cpu_linear.argmax_linear), which are rows x vocab fp32 (12.6 MB at 64 rows of SmolLM2, 113 MB in a
 * speculative step's 576) written by the matmul and read back. Each work item's tiles go to a thread-local
 * block of up to MB rows x 32 columns (in L1/L2), which the thread's running per-row maximum then reads, in
 * ascending columns: each thread's static range of items ascends with its number, so the threads' answers
 * merge in thread order (on a tie the earlier thread's column is the first). Returns 0, or -1 without
 * scratch memory. */
int gemm_panels_argmax_f32(const float *x, int64_t ldx, const float *packed, int64_t m, int64_t n, int64_t k,
                           float *best, int64_t *idx, int num_threads)
{
    const int64_t panels = (n + NR - 1) / NR;
#ifdef PAGEDQ_AVX512
    const int64_t step = 2;
#else
    const int64_t step = 1;
#endif
    const int64_t items = (panels + step - 1) / step;
    const int teams = num_threads > 0 ? num_threads : 1;
    float *thread_best = (float *)malloc(sizeof(float) * teams * m);
    int64_t *thread_col = (int64_t *)malloc(sizeof(int64_t) * teams * m);
    int64_t *nan_at = (int64_t *)malloc(sizeof(int64_t) * teams * m);
    int status = thread_best && thread_col && nan_at ? 0 : -1;
    int used = 1;
    if (status == 0) {
        #pragma omp parallel num_threads(teams) if (items > 1)
        {
            const int t = omp_get_thread_num();
            #pragma omp single
            used = omp_get_num_threads();
            float *mx = thread_best + (int64_t)t * m;
            int64_t *at = thread_col + (int64_t)t * m, *first_nan = nan_at + (int64_t)t * m;
            for (int64_t i = 0; i < m; i++) { mx[i] = -INFINITY; at[i] = 0; first_nan[i] = -1; }
            float *block = (float *)aligned_alloc(64, sizeof(float) * MB * 2 * NR);
            for (int64_t m0 = 0; block && m0 < m; m0 += MB) {
                const int64_t m1 = m0 + MB < m ? m0 + MB : m;
                #pragma omp for schedule(static) nowait
                for (int64_t item = 0; item < items; item++) {
                    const int64_t p = item * step, col = p * NR;
                    const float *panel = packed + p * k * NR;
                    const int ncols = (int)(n - col < NR ? n - col : NR);
                    int cols = ncols;
#ifdef PAGEDQ_AVX512
                    if (p + 1 < panels) {
                        const int ncols1 = (int)(n - col - NR < NR ? n - col - NR : NR);
                        for (int64_t r = m0; r < m1; r += MR) {
                            const int rows = (int)(m1 - r < MR ? m1 - r : MR);
                            float *out = block + (r - m0) * 2 * NR;
                            const char *ahead;
                            const int64_t ahead_lines = ahead_share(panel, p, step, panels, k, item + 1 < items, r - m0, m1 - m0, MR, &ahead);
                            tile_pair_rows(rows, x + r * ldx, ldx, panel, panel + k * NR, NR, k, out, out + NR, 2 * NR,
                                           NULL, NULL, ncols, ncols1, 0, ahead, ahead_lines);
                        }
                        cols = NR + ncols1;
                    } else
#endif
                    {
                        for (int64_t r = m0; r < m1; r += MR) {
                            const int rows = (int)(m1 - r < MR ? m1 - r : MR);
                            const char *ahead;
                            const int64_t ahead_lines = ahead_share(panel, p, step, panels, k, item + 1 < items, r - m0, m1 - m0, MR, &ahead);
                            tile_rows(rows, x + r * ldx, ldx, panel, NR, k, block + (r - m0) * 2 * NR, 2 * NR, NULL,
                                      ncols, 0, ahead, ahead_lines);
                        }
                    }
                    for (int64_t r = m0; r < m1; r++) {
                        const float *v = block + (r - m0) * 2 * NR;
                        for (int c = 0; c < cols; c++) {
                            if (v[c] > mx[r]) { mx[r] = v[c]; at[r] = col + c; }
                            else if (v[c] != v[c] && first_nan[r] < 0) first_nan[r] = col + c;
                        }
                    }
                }
            }
            if (!block) {
                #pragma omp atomic write
                status = -1;
            }
            free(block);
        }
        for (int64_t i = 0; status == 0 && i < m; i++) { /* the threads in order: the first NaN, else a strict > */
            float v = thread_best[i];
            int64_t at = thread_col[i], first_nan = -1;
            for (int t = 0; t < used; t++) {
                const int64_t nan_col = nan_at[(int64_t)t * m + i];
                if (nan_col >= 0 && (first_nan < 0 || nan_col < first_nan)) first_nan = nan_col;
                if (t && thread_best[(int64_t)t * m + i] > v) { v = thread_best[(int64_t)t * m + i]; at = thread_col[(int64_t)t * m + i]; }
            }
            best[i] = first_nan >= 0 ? NAN : v;
            idx[i] = first_nan >= 0 ? first_nan : at;
        }
    }
    free(thread_best); free(thread_col); free(nan_at);
    return status;
}
