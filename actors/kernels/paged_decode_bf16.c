/* Decode attention over raypack's paged KV cache in bfloat16: bf16 query, caches and output,
 * float32 arithmetic. The same layout and algorithm as paged_decode.c (read that first);
 * kept in its own file so the float32 kernel stays as it is.
 *
 * Each token's K row (all kv heads) is widened to float32 once into a small scratch row,
 * then dotted with every query head that reads it; V likewise. Scores, the max-subtracted
 * softmax and the weighted sum of V accumulate in float32; the output is rounded to bf16
 * (nearest, ties to even: what torch's float32 -> bfloat16 conversion does). Reading bf16
 * halves the bytes, and decode attention is bound by those bytes, not by arithmetic.
 *
 * `window` (> 0: the last `window` keys only) and `softcap` (> 0: softcap * tanh(s / softcap)
 * on each scaled score) as in paged_decode.c.
 *
 * `lse`, when not NULL, receives each head's log-sum-exp of its scaled scores (float32,
 * [num_seqs, num_heads]), for merging with attention over other keys.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float widen(uint16_t x) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)x << 16};
    return v.f;
}

static inline uint16_t narrow(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

static void widen_row(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = widen(src[i]);
}

static void attend(const uint16_t *q16, const uint16_t *k_cache, const uint16_t *v_cache,
                   const int64_t *table, int64_t first, int64_t end, int64_t num_heads,
                   int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,
                   float scale, float softcap, float *scores, float *q, float *row, float *acc,
                   uint16_t *out, float *lse) {
    const int64_t len = end - first; /* keys attended: positions first .. end - 1 */
    widen_row(q16, q, num_heads * head_dim);
    for (int64_t i = 0; i < len; i++) {
        const int64_t t = first + i;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        widen_row(k_cache + slot * token_stride, row, token_stride);
        for (int64_t h = 0; h < num_heads; h++) {
            const float *kh = row + (h / group) * head_dim;
            const float *qh = q + h * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
            const float s = dot * scale;
            scores[h * len + i] = softcap > 0.f ? softcap * tanhf(s / softcap) : s;
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * len;
        float top = s[0];
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        float sum = 0.f;
        for (int64_t t = 0; t < len; t++) {
            const float x = s[t] - top; /* below e^-87: 0, as in paged_decode.c */
            s[t] = x < -87.f ? 0.f : expf(x);
            sum += s[t];
        }
        if (lse) lse[h] = top + logf(sum);
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(num_heads * head_dim));
    for (int64_t i = 0; i < len; i++) {
        const int64_t t = first + i;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        widen_row(v_cache + slot * token_stride, row, token_stride);
        for (int64_t h = 0; h < num_heads; h++) {
            const float *vh = row + (h / group) * head_dim;
            const float w = scores[h * len + i];
            float *o = acc + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] += w * vh[d];
        }
    }
    for (int64_t i = 0; i < num_heads * head_dim; i++) out[i] = narrow(acc[i]);
}

/* Returns 0, or 1 when scratch memory could not be allocated. lse may be NULL; window 0: none;
 * softcap 0: none. */
int raypack_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *seq_lens, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int64_t window, float softcap,
                              uint16_t *out, float *lse, int64_t num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t width = num_heads * head_dim;
    int64_t longest = 1;
    for (int64_t i = 0; i < num_seqs; i++)
        if (seq_lens[i] > longest) longest = seq_lens[i];
    int failed = 0;
#pragma omp parallel num_threads((int)num_threads) if (num_threads > 1 && num_seqs > 1)
    {
        /* scores [heads, longest], then the widened query, one K/V row, the output sums */
        float *scratch = malloc(sizeof(float) * (size_t)(num_heads * longest + 2 * width +
                                                         token_stride));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        float *scores = scratch, *q32 = NULL, *acc = NULL, *row = NULL;
        if (scratch) {
            q32 = scratch + num_heads * longest;
            acc = q32 + width;
            row = acc + width;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < num_seqs; i++) {
            const int64_t first = window > 0 && seq_lens[i] > window ? seq_lens[i] - window : 0;
            if (scratch)
                attend(q + i * width, k_cache, v_cache, block_tables + i * max_blocks, first,
                       seq_lens[i], num_heads, group, head_dim, block_size, token_stride, scale,
                       softcap, scores, q32, row, acc, out + i * width,
                       lse ? lse + i * num_heads : NULL);
        }
        free(scratch);
    }
    return failed;
}
