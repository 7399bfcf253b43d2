/* The decode attention both kernels share (paged_decode.c: float32, paged_decode_bf16.c:
 * bfloat16), included by each after it defines
 *   ELEM        the query, cache and output element type;
 *   ELEM_FLOAT  1 when ELEM is float (rows are read in place), else 0 (widened first);
 *   LOAD(x)     an ELEM widened to float;
 *   STORE(f)    a float rounded to an ELEM.
 * Read paged_decode.c first for the layout and the semantics (window, softcap, lse).
 *
 * Work is split over (sequence, kv head) pairs: a pair's query heads (the `group` that read
 * that kv head) are attended together, block by block, so each key and value row comes from
 * memory once for the whole group, then from L1 for its other heads (the old kernel took one
 * head at a time through every row). Two passes per pair: every score (q . k: with head_dim a
 * compile-time constant for the common sizes, a few vector FMAs and one reduction per key and
 * head, no per-key division or branch) and the exact max-subtracted softmax over the pair's
 * scores, then the weighted sum of V into float32 accumulators of the group's heads. bf16
 * rows are widened once per block into a float scratch, not once per head.
 *
 * What bounds it is memory: the blocks lie anywhere in the cache, so the hardware's stream
 * prefetchers cannot guess the next one; the kernel asks for each block's rows AHEAD blocks
 * before it reads them, and for the next pair's first keys while it sums this pair's last
 * values (measured: benchmarks/bench_decode_kernel.py, docs/benchmarks-peers.md).
 *
 * Plain C the compiler vectorizes (-O3 -march=native -ffast-math): the same source builds on
 * any CPU with a C compiler. Where the CPU has AVX-512 (`__AVX512F__` under -march=native),
 * a head_dim that is a multiple of 16 takes the intrinsics below instead (scores 16 keys at a
 * time, one reduction tree for them; V sums in registers); the plain path stays tested
 * (tests/actors/test_kernel_paths.py builds with -mno-avx512f). Only GNU builtins (gcc,
 * clang): `always_inline`, without which the specialization by head_dim is left to the
 * optimizer, and `__builtin_prefetch`, without which there is no prefetch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__GNUC__)
#define ATTEND_INLINE static inline __attribute__((always_inline))
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define ATTEND_INLINE static inline
#define PREFETCH(p) ((void)(p))
#endif
#define AHEAD 2 /* blocks prefetched ahead (1 to 8 measured alike; none: ~1.2-2x slower) */

/* One (sequence, kv head) pair's keys and values: positions first .. end - 1 of its block
 * table; k and v point at this kv head's part of the caches' first row. */
struct span {
    const ELEM *k, *v;
    const int64_t *table;
    int64_t first, end;
};

/* What every pair shares: its number of query heads, the cache's geometry, the softcap. */
struct shape {
    int64_t group, block_size, token_stride;
    float softcap;
};

/* Block b of a span holds its keys lo .. hi - 1 */
ATTEND_INLINE int64_t block_lo(const struct span *sp, int64_t b, int64_t block_size) {
    return b * block_size > sp->first ? b * block_size : sp->first;
}
ATTEND_INLINE int64_t block_hi(const struct span *sp, int64_t b, int64_t block_size) {
    return (b + 1) * block_size < sp->end ? (b + 1) * block_size : sp->end;
}

/* The first of block b's rows in `cache` (sp->k or sp->v); sets *lo, *n: its keys */
ATTEND_INLINE const ELEM *block_rows(const struct span *sp, const ELEM *cache, int64_t b,
                                     const struct shape *sh, int64_t *lo, int64_t *n) {
    *lo = block_lo(sp, b, sh->block_size);
    *n = block_hi(sp, b, sh->block_size) - *lo;
    return cache + (sp->table[b] * sh->block_size + *lo % sh->block_size) * sh->token_stride;
}

/* Ask the memory for block b's rows of `cache` (this kv head's part of each), if the span
 * (or NULL: none) has that block. */
ATTEND_INLINE void prefetch_block(const struct span *sp, const ELEM *cache, int64_t b,
                                  const struct shape *sh, int64_t dim) {
    if (!sp || b * sh->block_size >= sp->end) return;
    int64_t lo, n;
    const char *row = (const char *)block_rows(sp, cache, b, sh, &lo, &n);
    const int64_t stride = sh->token_stride * (int64_t)sizeof(ELEM);
    for (int64_t j = 0; j < n; j++, row += stride)
        for (int64_t x = 0; x < dim * (int64_t)sizeof(ELEM); x += 64) PREFETCH(row + x);
}

/* n rows of dim elements, `stride` apart, as float rows: in place for float (*fstride set to
 * stride), else widened into buf (dim apart). */
ATTEND_INLINE const float *as_float(const ELEM *rows, int64_t n, int64_t stride, int64_t dim,
                                    float *restrict buf, int64_t *fstride) {
#if ELEM_FLOAT
    (void)n, (void)dim, (void)buf;
    *fstride = stride;
    return (const float *)rows;
#else
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < dim; d++) buf[j * dim + d] = LOAD(rows[j * stride + d]);
    *fstride = dim;
    return buf;
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* With AVX-512 and a head_dim that is a multiple of 16, a block's scores are taken 16 keys
 * at a time: 16 vectors of partial dot products (independent FMA chains), then one vector of
 * their 16 sums by a transposing tree (15 adds, 30 shuffles), not one horizontal reduction
 * per key; and each head's sums of V stay in registers for the whole block. (measured:
 * benchmarks/bench_decode_kernel.py, docs/benchmarks-peers.md) */
#define ATTEND_AVX512 1

/* lane j of the result: the sum of p[j]'s 16 lanes */
ATTEND_INLINE __m512 sum16(const __m512 p[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: p2i p2i+1 p2i p2i+1, half sums */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                             _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: keys 4i .. 4i + 3, that lane's sums */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* lanes: keys 8i .. 8i + 3 (lanes 0+1, 2+3), 8i + 4 .. */
        c[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* s[j] = q . k_j for the block's n <= 16 keys (rows `stride` apart), dim % 16 == 0. Past n
 * the last key is read again (no branch: the 16 chains stay in registers), not stored. */
ATTEND_INLINE void scores16(const float *restrict q, const float *restrict k, int64_t stride,
                            int64_t n, const int64_t dim, float *restrict s) {
    __m512 p[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const float *kj = k + (j < n ? j : n - 1) * stride;
        p[j] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kj));
        for (int64_t d = 16; d < dim; d += 16)
            p[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kj + d), p[j]);
    }
    _mm512_mask_storeu_ps(s, (__mmask16)((1u << n) - 1u), sum16(p));
}

/* a[0 .. dim) += sum over j < n of w[j] v_j (rows `stride` apart), in registers 4 vectors
 * at a time, dim % 16 == 0 */
ATTEND_INLINE void values16(const float *restrict w, const float *restrict v, int64_t stride,
                            int64_t n, const int64_t dim, float *restrict a) {
    for (int64_t x = 0; x < dim; x += 64) {
        const int nv = dim - x >= 64 ? 4 : (int)((dim - x) / 16);
        __m512 acc[4];
        for (int i = 0; i < nv; i++) acc[i] = _mm512_loadu_ps(a + x + 16 * i);
        for (int64_t j = 0; j < n; j++) {
            const __m512 wj = _mm512_set1_ps(w[j]);
            for (int i = 0; i < nv; i++)
                acc[i] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(v + j * stride + x + 16 * i), acc[i]);
        }
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(a + x + 16 * i, acc[i]);
    }
}
#else
#define ATTEND_AVX512 0
#endif

/* One pair: its `group` query heads q (group x dim, float, already scaled) over the span,
 * into out (group x dim) and lse (group floats, or NULL). scores has room for group x
 * (end - first) floats, acc for group x dim, rows for block_size x dim. `next` (or NULL):
 * the pair this thread likely takes next, whose first keys are asked for early. */
ATTEND_INLINE void attend_pair(const float *restrict q, const struct span *sp,
                               const struct span *next, const struct shape *sh, const int64_t dim,
                               float *restrict scores, float *restrict acc, float *restrict rows,
                               ELEM *restrict out, float *restrict lse) {
    const int64_t group = sh->group, bs = sh->block_size, first = sp->first;
    const int64_t len = sp->end - first, b0 = first / bs, b1 = (sp->end - 1) / bs + 1;
    const int64_t n0 = next ? next->first / bs : 0;
    for (int64_t b = b0; b < b0 + AHEAD; b++) prefetch_block(sp, sp->k, b, sh, dim);
    /* scores[h * len + i] = q_h . k_(first + i), block by block */
    for (int64_t b = b0; b < b1; b++) {
        if (b + AHEAD < b1)
            prefetch_block(sp, sp->k, b + AHEAD, sh, dim);
        else /* the first values next */
            prefetch_block(sp, sp->v, b0 + b + AHEAD - b1, sh, dim);
        int64_t lo, n, stride;
        const ELEM *block = block_rows(sp, sp->k, b, sh, &lo, &n);
        const float *k = as_float(block, n, sh->token_stride, dim, rows, &stride);
        float *s = scores + (lo - first);
#if ATTEND_AVX512
        if (dim % 16 == 0) {
            for (int64_t j = 0; j < n; j += 16)
                for (int64_t h = 0; h < group; h++)
                    scores16(q + h * dim, k + j * stride, stride, n - j < 16 ? n - j : 16, dim,
                             s + h * len + j);
            continue;
        }
#endif
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + h * dim;
            for (int64_t j = 0; j < n; j++) {
                const float *kj = k + j * stride;
                float dot = 0.f;
                for (int64_t d = 0; d < dim; d++) dot += qh[d] * kj[d];
                s[h * len + j] = dot;
            }
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *s = scores + h * len;
        if (sh->softcap > 0.f) {
            const float cap = sh->softcap, inner = 1.f / cap;
            for (int64_t i = 0; i < len; i++) s[i] = cap * tanhf(s[i] * inner);
        }
        float top = s[0];
        for (int64_t i = 1; i < len; i++) top = s[i] > top ? s[i] : top;
        float sum = 0.f;
        for (int64_t i = 0; i < len; i++) {
            /* Below e^-87 a weight is subnormal in float32: 0 instead, as flush-to-zero would
               give, without the slow subnormal arithmetic (the process keeps IEEE floats). */
            const float x = s[i] - top;
            s[i] = x < -87.f ? 0.f : expf(x);
            sum += s[i];
        }
        if (lse) lse[h] = top + logf(sum);
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < len; i++) s[i] *= inv;
    }
    for (int64_t i = 0; i < group * dim; i++) acc[i] = 0.f;
    for (int64_t b = b0; b < b1; b++) {
        if (b + AHEAD < b1)
            prefetch_block(sp, sp->v, b + AHEAD, sh, dim);
        else
            prefetch_block(next, next ? next->k : NULL, n0 + b + AHEAD - b1, sh, dim);
        int64_t lo, n, stride;
        const ELEM *block = block_rows(sp, sp->v, b, sh, &lo, &n);
        const float *v = as_float(block, n, sh->token_stride, dim, rows, &stride);
        const float *w = scores + (lo - first);
#if ATTEND_AVX512
        if (dim % 16 == 0) {
            for (int64_t h = 0; h < group; h++)
                values16(w + h * len, v, stride, n, dim, acc + h * dim);
            continue;
        }
#endif
        for (int64_t h = 0; h < group; h++) {
            float *a = acc + h * dim;
            for (int64_t j = 0; j < n; j++) {
                const float *vj = v + j * stride;
                const float wj = w[h * len + j];
                for (int64_t d = 0; d < dim; d++) a[d] += wj * vj[d];
            }
        }
    }
    for (int64_t i = 0; i < group * dim; i++) out[i] = STORE(acc[i]);
}

/* attend_pair with head_dim a constant for the sizes models use, any other size generic */
static void attend_any(const float *q, const struct span *sp, const struct span *next,
                       const struct shape *sh, int64_t dim, float *scores, float *acc,
                       float *rows, ELEM *out, float *lse) {
    switch (dim) {
    case 64: attend_pair(q, sp, next, sh, 64, scores, acc, rows, out, lse); break;
    case 128: attend_pair(q, sp, next, sh, 128, scores, acc, rows, out, lse); break;
    case 96: attend_pair(q, sp, next, sh, 96, scores, acc, rows, out, lse); break;
    case 256: attend_pair(q, sp, next, sh, 256, scores, acc, rows, out, lse); break;
    default: attend_pair(q, sp, next, sh, dim, scores, acc, rows, out, lse);
    }
}

/* Pair p: sequence p / kv_heads, kv head p % kv_heads */
static struct span pair_span(const ELEM *k_cache, const ELEM *v_cache,
                             const int64_t *block_tables, int64_t max_blocks,
                             const int64_t *seq_lens, int64_t window, int64_t kv_heads,
                             int64_t head_dim, int64_t p) {
    const int64_t i = p / kv_heads, g = p % kv_heads;
    const int64_t first = window > 0 && seq_lens[i] > window ? seq_lens[i] - window : 0;
    const struct span sp = {k_cache + g * head_dim, v_cache + g * head_dim,
                            block_tables + i * max_blocks, first, seq_lens[i]};
    return sp;
}

/* Every (sequence, kv head) pair over OpenMP threads (so even one sequence uses them all when
 * it has as many kv heads); returns 0, or 1 when scratch memory could not be allocated. lse
 * may be NULL; window 0: none; softcap 0: none. */
static int attend_all(const ELEM *q, const ELEM *k_cache, const ELEM *v_cache,
                      const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                      int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int64_t window, float softcap, ELEM *out,
                      float *lse, int64_t num_threads) {
    const int64_t group = num_heads / kv_heads, pairs = num_seqs * kv_heads;
    const struct shape sh = {group, block_size, kv_heads * head_dim, softcap};
    const int64_t width = group * head_dim; /* one pair's query and output */
    int64_t longest = 1;
    for (int64_t i = 0; i < num_seqs; i++)
        if (seq_lens[i] > longest) longest = seq_lens[i];
    int failed = 0;
#pragma omp parallel num_threads((int)num_threads) if (num_threads > 1 && pairs > 1)
    {
        /* scores [group, longest], the scaled query and the sums of V [group, dim], one
           block's rows as floats [block_size, dim] */
        const size_t floats = (size_t)(group * longest + 2 * width + block_size * head_dim);
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t p = 0; p < pairs; p++) {
            const struct span sp = pair_span(k_cache, v_cache, block_tables, max_blocks,
                                             seq_lens, window, kv_heads, head_dim, p);
            const struct span next = pair_span(k_cache, v_cache, block_tables, max_blocks,
                                               seq_lens, window, kv_heads, head_dim,
                                               p + 1 < pairs ? p + 1 : p);
            if (scratch) {
                float *q32 = scratch + group * longest, *acc = q32 + width, *rows = acc + width;
                const ELEM *qp = q + p * width; /* the pair's heads: consecutive in q and out */
                /* the scale on q, not on each score: exact for a power-of-two scale (head_dim
                   64 or 256), else one rounding moved */
                for (int64_t x = 0; x < width; x++) q32[x] = LOAD(qp[x]) * scale;
                attend_any(q32, &sp, p + 1 < pairs ? &next : NULL, &sh, head_dim, scratch, acc,
                           rows, out + p * width, lse ? lse + p * group : NULL);
            }
        }
        free(scratch);
    }
    return failed;
}
