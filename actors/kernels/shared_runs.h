/* Shared-prefix runs (actors/attention/shared_prefix.py): a run of blocks that several decodes
 * share, attended once for all of them. Included by paged_decode.c and paged_decode_bf16.c
 * after paged_decode_attend.h (ELEM, LOAD, STORE, as_float, ATTEND_INLINE).
 *
 * A run is read by every query row of its members that reads one kv head: members x heads
 * per kv head rows (48 for 16 decodes of a 9-head, 3-kv-head model) against the same keys, a
 * small matrix product, not the decode kernel's one row at a time (whose per-key dot products
 * and reductions reach about half the FMA peak; torch's flash kernel does no better on 48
 * rows and costs a call per run). Here both products run as register tiles of 8 x 16 floats
 * (8 accumulators, so FMAs are never waiting on one another) whose operands come straight
 * from memory: one broadcast element and one 16-float row per step, no transposed copy of a
 * key or value block:
 *   scores^T [keys, rows] = K [keys, dim] . Q^T [dim, rows]   (Q^T: the item's rows, once)
 *   out [rows, dim]       = W [rows, keys] . V [keys, dim]    (W read from scores^T)
 * with the exact max-subtracted softmax of each row between them, in float32, each row's
 * log-sum-exp written for the merge with the decode's own keys.
 *
 * With AVX-512 (32 vector registers) both products take larger tiles of 24 accumulators
 * (run_scores: 8 keys x 48 rows, run_values: 6 rows x 64 columns; the 8 x 16 tile loads a
 * broadcast per FMA), summing in the same order (the same floats as the 8 x 16 tile). Each
 * run's blocks are prefetched AHEAD blocks before they are read, as the decode kernel's.
 *
 * Work is split over (run, kv head, slab of at most RUN_SLAB rows) items on OpenMP threads.
 * Plain C the compiler vectorizes (the tiles' constant trip counts), as the decode kernel.
 */
#include <string.h>

#define RUN_TILE 8   /* tile rows: keys of scores^T, query rows of out */
#define RUN_WIDTH 16 /* tile columns: query rows of scores^T, value columns of out */
#define RUN_SLAB 64  /* query rows per work item (a multiple of RUN_WIDTH) */
#define RUN_BIG 0    /* 1: the AVX-512 tiles below */

/* c[r][x] += sum over k < kn of a[r * ar + k * ak] * b[k * ldb + x], for r < nr (RUN_TILE
 * or 1: a constant where inlined), x < RUN_WIDTH; c's rows ldc apart. With GNU C's vector
 * type (any CPU: the compiler splits it into its vector registers) the accumulators are
 * registers; plain loops (measured 4x slower with gcc 12: it vectorized the wrong loop) on
 * other compilers. */
#if defined(__GNUC__)
typedef float run_vec __attribute__((vector_size(RUN_WIDTH * sizeof(float))));
ATTEND_INLINE void run_tile(const float *restrict a, int64_t ar, int64_t ak,
                            const float *restrict b, int64_t ldb, int64_t kn, float *restrict c,
                            int64_t ldc, const int nr) {
    run_vec acc[RUN_TILE];
    for (int r = 0; r < nr; r++) memcpy(&acc[r], c + r * ldc, sizeof(run_vec));
    for (int64_t k = 0; k < kn; k++) {
        run_vec bk;
        memcpy(&bk, b + k * ldb, sizeof bk);
        for (int r = 0; r < nr; r++) acc[r] += a[r * ar + k * ak] * bk;
    }
    for (int r = 0; r < nr; r++) memcpy(c + r * ldc, &acc[r], sizeof(run_vec));
}
#else
ATTEND_INLINE void run_tile(const float *restrict a, int64_t ar, int64_t ak,
                            const float *restrict b, int64_t ldb, int64_t kn, float *restrict c,
                            int64_t ldc, const int nr) {
    for (int64_t k = 0; k < kn; k++)
        for (int r = 0; r < nr; r++)
            for (int x = 0; x < RUN_WIDTH; x++) c[r * ldc + x] += a[r * ar + k * ak] * b[k * ldb + x];
}
#endif

#if defined(__GNUC__) && defined(__AVX512F__)
/* With 32 vector registers of 16 floats, larger tiles: the 8 x 16 tile above loads one
 * broadcast per FMA (load-bound at ~26 % of the FMA peak, measured); these hold 24
 * accumulators, 3 (or 4) row loads and 8 (or 6) broadcasts per 24 FMAs. */
#undef RUN_BIG
#define RUN_BIG 1
#define RUN_KEYS 8 /* keys per scores tile */
#define RUN_ROWS 6 /* query rows per values tile */

/* c[r * ldc + 16 v + x] = sum over d < dim of k[r * stride + d] * qt[d * w + 16 v + x], for
 * keys r < nk, row vectors v < nv (written, not added) */
ATTEND_INLINE void run_scores(const float *restrict k, int64_t stride, const float *restrict qt,
                              int64_t w, int64_t dim, float *restrict c, int64_t ldc,
                              const int nk, const int nv) {
    run_vec acc[RUN_KEYS][3] = {{{0}}};
    for (int64_t d = 0; d < dim; d++) {
        run_vec b[3];
        for (int v = 0; v < nv; v++) memcpy(&b[v], qt + d * w + v * RUN_WIDTH, sizeof b[v]);
        for (int r = 0; r < nk; r++) {
            const float a = k[r * stride + d];
            for (int v = 0; v < nv; v++) acc[r][v] += a * b[v];
        }
    }
    for (int r = 0; r < nk; r++)
        for (int v = 0; v < nv; v++) memcpy(c + r * ldc + v * RUN_WIDTH, &acc[r][v], sizeof(run_vec));
}

/* c[r * ldc + 16 v + x] += sum over j < kn of s[j * w + r] * vb[j * stride + 16 v + x], for
 * rows r < nr, column vectors v < nv */
ATTEND_INLINE void run_values(const float *restrict s, int64_t w, const float *restrict vb,
                              int64_t stride, int64_t kn, float *restrict c, int64_t ldc,
                              const int nr, const int nv) {
    run_vec acc[RUN_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) memcpy(&acc[r][v], c + r * ldc + v * RUN_WIDTH, sizeof(run_vec));
    for (int64_t j = 0; j < kn; j++) {
        run_vec b[4];
        for (int v = 0; v < nv; v++) memcpy(&b[v], vb + j * stride + v * RUN_WIDTH, sizeof b[v]);
        for (int r = 0; r < nr; r++) {
            const float a = s[j * w + r];
            for (int v = 0; v < nv; v++) acc[r][v] += a * b[v];
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) memcpy(c + r * ldc + v * RUN_WIDTH, &acc[r][v], sizeof(run_vec));
}

/* A block's n keys (rows `stride` apart) against Q^T (dim x w) into st (n x w) */
ATTEND_INLINE void run_block_scores(const float *k, int64_t stride, int64_t n,
                                    const float *qt, int64_t w, int64_t dim, float *st) {
    for (int64_t x = 0; x < w; x += 3 * RUN_WIDTH) {
        const int64_t left = (w - x) / RUN_WIDTH;
        for (int64_t j = 0; j < n; j += RUN_KEYS) {
            const float *kj = k + j * stride, *q = qt + x;
            float *c = st + j * w + x;
            if (j + RUN_KEYS <= n) {
                if (left >= 3) run_scores(kj, stride, q, w, dim, c, w, RUN_KEYS, 3);
                else if (left == 2) run_scores(kj, stride, q, w, dim, c, w, RUN_KEYS, 2);
                else run_scores(kj, stride, q, w, dim, c, w, RUN_KEYS, 1);
            } else
                for (int64_t t = 0; t < n - j; t++) {
                    if (left >= 3) run_scores(kj + t * stride, stride, q, w, dim, c + t * w, w, 1, 3);
                    else if (left == 2) run_scores(kj + t * stride, stride, q, w, dim, c + t * w, w, 1, 2);
                    else run_scores(kj + t * stride, stride, q, w, dim, c + t * w, w, 1, 1);
                }
        }
    }
}

/* acc (w x dim) += the block's weights s (n x w) . its values (n x dim, rows `stride` apart) */
ATTEND_INLINE void run_block_values(const float *s, int64_t w, const float *vb, int64_t stride,
                                    int64_t n, int64_t dim, float *acc) {
    for (int64_t x = 0; x < dim; x += 4 * RUN_WIDTH) {
        const int64_t left = (dim - x) / RUN_WIDTH;
        for (int64_t r = 0; r < w; r += RUN_ROWS) {
            const float *sr = s + r, *v = vb + x;
            float *c = acc + r * dim + x;
            if (r + RUN_ROWS <= w) {
                switch (left) {
                case 1: run_values(sr, w, v, stride, n, c, dim, RUN_ROWS, 1); break;
                case 2: run_values(sr, w, v, stride, n, c, dim, RUN_ROWS, 2); break;
                case 3: run_values(sr, w, v, stride, n, c, dim, RUN_ROWS, 3); break;
                default: run_values(sr, w, v, stride, n, c, dim, RUN_ROWS, 4);
                }
            } else
                for (int64_t t = 0; t < w - r; t++) {
                    switch (left) {
                    case 1: run_values(sr + t, w, v, stride, n, c + t * dim, dim, 1, 1); break;
                    case 2: run_values(sr + t, w, v, stride, n, c + t * dim, dim, 1, 2); break;
                    case 3: run_values(sr + t, w, v, stride, n, c + t * dim, dim, 1, 3); break;
                    default: run_values(sr + t, w, v, stride, n, c + t * dim, dim, 1, 4);
                    }
                }
        }
    }
}
#endif

/* Ask the memory for block b (of `blocks`) of a run's `cache` rows (this kv head's part) */
ATTEND_INLINE void run_prefetch(const ELEM *cache, const int64_t *table, int64_t b,
                                int64_t blocks, const struct shape *sh, int64_t dim) {
    if (b >= blocks) return;
    const char *row = (const char *)(cache + table[b] * sh->block_size * sh->token_stride);
    const int64_t stride = sh->token_stride * (int64_t)sizeof(ELEM);
    for (int64_t j = 0; j < sh->block_size; j++, row += stride)
        for (int64_t x = 0; x < dim * (int64_t)sizeof(ELEM); x += 64) PREFETCH(row + x);
}

/* One item: `rows` query rows q (rows x dim, ELEM, `rows` <= RUN_SLAB) against keys 0 ..
 * len - 1 of the run's blocks `table` (k, v: this kv head's part of the caches' first row),
 * into out (rows x dim, float32) and lse (rows). Scratch: qt (dim x RUN_SLAB), st (len x RUN_SLAB),
 * acc (RUN_SLAB x dim), buf (block_size x dim), top and sum (RUN_SLAB each). */
ATTEND_INLINE void attend_run(const ELEM *q, int64_t rows, const ELEM *k, const ELEM *v,
                              const int64_t *table, int64_t len, const struct shape *sh,
                              const int64_t dim, float scale, float *restrict qt,
                              float *restrict st, float *restrict acc, float *restrict buf,
                              float *restrict top, float *restrict sum, float *out,
                              float *lse) {
    const int64_t bs = sh->block_size, w = (rows + RUN_WIDTH - 1) / RUN_WIDTH * RUN_WIDTH;
    /* Q^T, scaled (as the decode kernel scales q), its padding rows zero */
    for (int64_t d = 0; d < dim; d++)
        for (int64_t r = 0; r < w; r++) qt[d * w + r] = r < rows ? LOAD(q[r * dim + d]) * scale : 0.f;
#if !RUN_BIG
    for (int64_t i = 0; i < len * w; i++) st[i] = 0.f;
#endif
    const int64_t blocks = (len + bs - 1) / bs;
    for (int64_t b = 0; b < AHEAD; b++) run_prefetch(k, table, b, blocks, sh, dim);
    for (int64_t b = 0, lo = 0; lo < len; b++, lo += bs) {
        const int64_t n = len - lo < bs ? len - lo : bs;
        if (b + AHEAD < blocks) /* this pass's keys, then the next one's first values */
            run_prefetch(k, table, b + AHEAD, blocks, sh, dim);
        else
            run_prefetch(v, table, b + AHEAD - blocks, blocks, sh, dim);
        int64_t stride;
        const float *kb = as_float(k + table[b] * bs * sh->token_stride, n, sh->token_stride, dim,
                                   buf, &stride);
#if RUN_BIG
        run_block_scores(kb, stride, n, qt, w, dim, st + lo * w);
#else
        for (int64_t j = 0; j < n; j += RUN_TILE)
            for (int64_t x = 0; x < w; x += RUN_WIDTH) {
                float *c = st + (lo + j) * w + x;
                if (j + RUN_TILE <= n)
                    run_tile(kb + j * stride, stride, 1, qt + x, w, dim, c, w, RUN_TILE);
                else
                    for (int64_t t = j; t < n; t++)
                        run_tile(kb + t * stride, stride, 1, qt + x, w, dim, c + (t - j) * w, w, 1);
            }
#endif
    }
    /* the softmax of each row (a column of st), as the decode kernel's */
    if (sh->softcap > 0.f) {
        const float cap = sh->softcap, inner = 1.f / cap;
        for (int64_t i = 0; i < len * w; i++) st[i] = cap * tanhf(st[i] * inner);
    }
    for (int64_t r = 0; r < w; r++) top[r] = st[r], sum[r] = 0.f;
    for (int64_t j = 1; j < len; j++)
        for (int64_t r = 0; r < w; r++) top[r] = st[j * w + r] > top[r] ? st[j * w + r] : top[r];
    for (int64_t j = 0; j < len; j++)
        for (int64_t r = 0; r < w; r++) {
            const float x = st[j * w + r] - top[r];
            st[j * w + r] = x < -87.f ? 0.f : expf(x); /* see attend_pair */
            sum[r] += st[j * w + r];
        }
    for (int64_t i = 0; i < w * dim; i++) acc[i] = 0.f;
    for (int64_t b = 0, lo = 0; lo < len; b++, lo += bs) {
        const int64_t n = len - lo < bs ? len - lo : bs;
        run_prefetch(v, table, b + AHEAD, blocks, sh, dim);
        int64_t stride;
        const float *vb = as_float(v + table[b] * bs * sh->token_stride, n, sh->token_stride, dim,
                                   buf, &stride);
#if RUN_BIG
        run_block_values(st + lo * w, w, vb, stride, n, dim, acc);
#else
        for (int64_t r = 0; r < w; r += RUN_TILE)
            for (int64_t x = 0; x < dim; x += RUN_WIDTH)
                run_tile(st + lo * w + r, 1, w, vb + x, stride, n, acc + r * dim + x, dim,
                         RUN_TILE);
#endif
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.f / sum[r];
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = acc[r * dim + d] * inv;
        lse[r] = top[r] + logf(sum[r]);
    }
}

/* attend_run with head_dim a constant for the sizes models use (a multiple of RUN_WIDTH) */
static void attend_run_any(const ELEM *q, int64_t rows, const ELEM *k, const ELEM *v,
                           const int64_t *table, int64_t len, const struct shape *sh,
                           int64_t dim, float scale, float *qt, float *st, float *acc,
                           float *buf, float *top, float *sum, float *out, float *lse) {
    switch (dim) {
    case 64: attend_run(q, rows, k, v, table, len, sh, 64, scale, qt, st, acc, buf, top, sum, out, lse); break;
    case 128: attend_run(q, rows, k, v, table, len, sh, 128, scale, qt, st, acc, buf, top, sum, out, lse); break;
    default: attend_run(q, rows, k, v, table, len, sh, dim, scale, qt, st, acc, buf, top, sum, out, lse);
    }
}

/* Every run: run r's query rows are q's rows row_start[r] .. row_start[r + 1] - 1 ([kv_heads,
 * rows_r, head_dim], kv head by kv head), its keys run_keys[r], its blocks tables[r]; out
 * alike in float32 (merged in float32, never rounded to ELEM), lse one float per row. Returns 0, 1 when scratch memory could not be allocated, 2
 * when head_dim is not a multiple of RUN_WIDTH or a run's rows are not kv_heads alike. */
static int attend_runs(const ELEM *q, const ELEM *k_cache, const ELEM *v_cache,
                       const int64_t *tables, int64_t max_blocks, const int64_t *run_keys,
                       const int64_t *row_start, int64_t num_runs, int64_t kv_heads,
                       int64_t head_dim, int64_t block_size, float scale, float softcap,
                       float *out, float *lse, int64_t num_threads) {
    if (head_dim % RUN_WIDTH) return 2;
    const struct shape sh = {0, block_size, kv_heads * head_dim, softcap};
    int64_t items = 0, longest = 1;
    for (int64_t r = 0; r < num_runs; r++) {
        const int64_t all = row_start[r + 1] - row_start[r];
        if (all % kv_heads) return 2;
        items += kv_heads * ((all / kv_heads + RUN_SLAB - 1) / RUN_SLAB);
        longest = run_keys[r] > longest ? run_keys[r] : longest;
    }
    int64_t *item_run = malloc(sizeof(int64_t) * (size_t)(items + 1));
    if (!item_run) return 1;
    for (int64_t r = 0, i = 0; r < num_runs; r++) {
        const int64_t per = (row_start[r + 1] - row_start[r]) / kv_heads;
        for (int64_t x = 0; x < kv_heads * ((per + RUN_SLAB - 1) / RUN_SLAB); x++) item_run[i++] = r;
    }
    int failed = 0;
#pragma omp parallel num_threads((int)num_threads) if (num_threads > 1 && items > 1)
    {
        const size_t floats = (size_t)((head_dim + longest + head_dim + 2) * RUN_SLAB +
                                       block_size * head_dim);
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            /* item i: its run, and its place among the run's items (kv head, slab) */
            const int64_t r = item_run[i];
            int64_t first = i;
            while (first > 0 && item_run[first - 1] == r) first--;
            const int64_t per = (row_start[r + 1] - row_start[r]) / kv_heads;
            const int64_t slabs = (per + RUN_SLAB - 1) / RUN_SLAB;
            const int64_t g = (i - first) / slabs, s0 = (i - first) % slabs * RUN_SLAB;
            const int64_t rows = per - s0 < RUN_SLAB ? per - s0 : RUN_SLAB;
            const int64_t row = row_start[r] + g * per + s0;
            if (scratch) {
                float *qt = scratch, *acc = qt + head_dim * RUN_SLAB;
                float *top = acc + head_dim * RUN_SLAB, *sum = top + RUN_SLAB;
                float *buf = sum + RUN_SLAB, *st = buf + block_size * head_dim;
                attend_run_any(q + row * head_dim, rows, k_cache + g * head_dim,
                               v_cache + g * head_dim, tables + r * max_blocks, run_keys[r], &sh,
                               head_dim, scale, qt, st, acc, buf, top, sum,
                               out + row * head_dim, lse + row);
            }
        }
        free(scratch);
    }
    free(item_run);
    return failed;
}
