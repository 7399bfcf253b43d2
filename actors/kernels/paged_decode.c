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
 * copy, not arithmetic, bounds decode attention. Here each key and value row is read once per
 * kv head, straight from the blocks, for all the query heads that share it. Two passes per
 * (sequence, kv head): scores and an exact max-subtracted softmax, then the weighted sum of V.
 * The pairs are split over OpenMP threads (torch's own libgomp when loaded by torch). The
 * algorithm, shared with the bfloat16 kernel, is in paged_decode_attend.h.
 *
 * A layer with a sliding window (`window` > 0) attends to its last `window` keys only (Hugging
 * Face's: keys at positions > position - window); one with a logit softcap (`softcap` > 0)
 * turns each scaled score s into softcap * tanh(s / softcap) before the softmax (Gemma 2).
 *
 * `raypack_paged_decode_lse_f32` also writes each head's log-sum-exp of its scaled scores
 * (max + log(sum)), [num_seqs, num_heads]: what merging this attention with another over
 * other keys needs (the shared-prefix backend, actors/attention/shared_prefix.py).
 */
#include <stdint.h>

#define ELEM float
#define ELEM_FLOAT 1
#define LOAD(x) (x)
#define STORE(f) (f)
#include "paged_decode_attend.h"
#include "shared_runs.h"

/* Returns 0, or 1 when scratch memory could not be allocated. lse may be NULL; window 0: none;
 * softcap 0: none. */
int raypack_paged_decode_lse_f32(const float *q, const float *k_cache, const float *v_cache,
                                 const int64_t *block_tables, int64_t max_blocks,
                                 const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, float softcap, float *out,
                                 float *lse, int64_t num_threads) {
    return attend_all(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs,
                      num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, out,
                      lse, num_threads);
}

/* Shared-prefix runs (shared_runs.h): returns 0, 1 when scratch memory could not be allocated,
 * 2 for a head_dim that is not a multiple of 16 or rows not alike per kv head. */
int raypack_shared_runs_f32(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *tables, int64_t max_blocks, const int64_t *run_keys,
                            const int64_t *row_start, int64_t num_runs, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float softcap,
                            float *out, float *lse, int64_t num_threads) {
    return attend_runs(q, k_cache, v_cache, tables, max_blocks, run_keys, row_start, num_runs,
                       kv_heads, head_dim, block_size, scale, softcap, out, lse, num_threads);
}

/* 1 where the runs take the AVX-512 tiles, 0 on the plain path (the engine's default uses the
 * runs only with the tiles: EngineConfig.shared_prefix_attention). */
int raypack_shared_runs_tiled(void) { return RUN_BIG; }
