/* Decode attention over raypack's paged KV cache in bfloat16: bf16 query, caches and output,
 * float32 arithmetic. The same layout and algorithm as paged_decode.c (read that first; the
 * shared code is paged_decode_attend.h), in its own library.
 *
 * Each bf16 element is widened to float32 where it is read (a shift: bf16 is the top half of
 * a float32). Scores, the max-subtracted softmax and the weighted sum of V accumulate in
 * float32; the output is rounded to bf16 (nearest, ties to even: what torch's float32 ->
 * bfloat16 conversion does). Reading bf16 halves the bytes.
 *
 * `window` (> 0: the last `window` keys only) and `softcap` (> 0: softcap * tanh(s / softcap)
 * on each scaled score) as in paged_decode.c.
 *
 * `lse`, when not NULL, receives each head's log-sum-exp of its scaled scores (float32,
 * [num_seqs, num_heads]), for merging with attention over other keys.
 */
#include "bf16.h"

#define ELEM uint16_t
#define ELEM_FLOAT 0
#define LOAD(x) widen(x)
#define STORE(f) narrow(f)
#include "paged_decode_attend.h"
#include "shared_runs.h"

/* Returns 0, or 1 when scratch memory could not be allocated. lse may be NULL; window 0: none;
 * softcap 0: none. */
int raypack_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *seq_lens, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int64_t window, float softcap,
                              uint16_t *out, float *lse, int64_t num_threads) {
    return attend_all(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, num_seqs,
                      num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, out,
                      lse, num_threads);
}

/* Shared-prefix runs (shared_runs.h): returns 0, 1 when scratch memory could not be allocated,
 * 2 for a head_dim that is not a multiple of 16 or rows not alike per kv head. */
int raypack_shared_runs_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
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
