/* Decode attention over raypack's paged KV cache: float32, CPU, one query token per sequence.
 *
 * Layout (actors/kv_cache.py): k_cache and v_cache are [num_blocks, block_size, kv_heads,
 * head_dim]; block_tables is [num_seqs, max_blocks] (int64, padded); seq_lens holds each
 * sequence's key count including its new token, whose K/V is already written. q and out are
 * [num_seqs, num_heads, head_dim], contiguous; query head h reads kv head h / (num_heads /
 * kv_heads) (grouped-query attention).
 *
 * Why by hand: torch has no paged attention on CPU; gathering each sequence's blocks into a
 * padded batch for SDPA copies every key and value once more than attention needs, and that
 * copy, not arithmetic, bounds decode attention. Here each token's K row (all kv heads,
 * contiguous in its block) is read once, then its V row once, straight from the blocks.
 * Two passes per sequence: scores and an exact max-subtracted softmax, then the weighted sum
 * of V. Sequences are split over OpenMP threads (torch's own libgomp when loaded by torch).
 *
 * A layer with a sliding window (`window` > 0) attends to its last `window` keys only (Hugging
 * Face's: keys at positions > position - window); one with a logit softcap (`softcap` > 0)
 * turns each scaled score s into softcap * tanh(s / softcap) before the softmax (Gemma 2).
 *
 * `raypack_paged_decode_lse_f32` also writes each head's log-sum-exp of its scaled scores
 * (max + log(sum)), [num_seqs, num_heads]: what merging this attention with another over
 * other keys needs (the shared-prefix backend, actors/attention/shared_prefix.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void attend(const float *q, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t first, int64_t end, int64_t num_heads,
                   int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,
                   float scale, float softcap, float *scores, float *out, float *lse) {
    const int64_t len = end - first; /* keys attended: positions first .. end - 1 */
    for (int64_t i = 0; i < len; i++) {
        const int64_t t = first + i;
        const float *k = k_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *kh = k + (h / group) * head_dim;
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
            /* Below e^-87 a weight is subnormal in float32: 0 instead, as flush-to-zero would
               give, without the slow subnormal arithmetic (the process keeps IEEE floats). */
            const float x = s[t] - top;
            s[t] = x < -87.f ? 0.f : expf(x);
            sum += s[t];
        }
        if (lse) lse[h] = top + logf(sum);
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(out, 0, sizeof(float) * (size_t)(num_heads * head_dim));
    for (int64_t i = 0; i < len; i++) {
        const int64_t t = first + i;
        const float *v = v_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *vh = v + (h / group) * head_dim;
            const float w = scores[h * len + i];
            float *o = out + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] += w * vh[d];
        }
    }
}

/* Returns 0, or 1 when scratch memory could not be allocated. lse may be NULL; window 0: none;
 * softcap 0: none. */
int raypack_paged_decode_lse_f32(const float *q, const float *k_cache, const float *v_cache,
                                 const int64_t *block_tables, int64_t max_blocks,
                                 const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, float softcap, float *out,
                                 float *lse, int64_t num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    int64_t longest = 1;
    for (int64_t i = 0; i < num_seqs; i++)
        if (seq_lens[i] > longest) longest = seq_lens[i];
    int failed = 0;
#pragma omp parallel num_threads((int)num_threads) if (num_threads > 1 && num_seqs > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * longest));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < num_seqs; i++) {
            const int64_t first = window > 0 && seq_lens[i] > window ? seq_lens[i] - window : 0;
            if (scores)
                attend(q + i * num_heads * head_dim, k_cache, v_cache,
                       block_tables + i * max_blocks, first, seq_lens[i], num_heads, group,
                       head_dim, block_size, token_stride, scale, softcap, scores,
                       out + i * num_heads * head_dim, lse ? lse + i * num_heads : NULL);
        }
        free(scores);
    }
    return failed;
}
