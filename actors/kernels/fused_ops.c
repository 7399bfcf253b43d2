/* A Llama layer's element-wise work in one pass each: residual add + RMSNorm, and rotary on q
 * and k in place. float32 and bfloat16 (float32 arithmetic, bf16 storage, as torch does it).
 *
 * Why by hand: at a decode step of ~175 rows each of these torch ops touches a few hundred KB,
 * so its time is dispatch and an OpenMP region, not arithmetic; transformers' norm is 6 ops in
 * float32 and 8 in bfloat16, the rotary 4 (actors/rotary_attention.py), and nothing in torch
 * fuses them without a compiler (docs/benchmarks-peers.md, session 7).
 *
 * Every element is the same rounded result as transformers' op sequence, bit for bit:
 * - compiled WITHOUT -ffast-math and with -ffp-contract=off (no FMA), so each product and sum
 *   rounds where torch's separate ops round;
 * - the norm's sum of squares adds in the order of torch's CPU `sum` (aten SumKernel.cpp,
 *   `vectorized_inner_sum`: `lanes`-wide vectors, four interleaved accumulators, a cascade
 *   every 2^level_power vectors, then the lanes in order); `lanes` is the width of torch's
 *   Vectorized<float> on this CPU (actors/kernels/fused.py checks the whole result against
 *   torch's own ops before using it);
 * - the mean divides by the width (`sum(...).div_(n)`, torch's CPU mean), then `+ eps`, then
 *   `1 / sqrt` (torch's rsqrt), the product, the rounding to bf16, the weight's product.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define MAX_LANES 16
#define LEVELS 4 /* torch's multi_row_sum: num_levels */
#define ILP 4    /* torch's row_sum: ilp_factor */
#define PARALLEL_MIN 16384 /* elements below which one thread does it all */

static int64_t ceil_log2(int64_t x) { /* torch's utils::CeilLog2 */
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) ++bits;
    return bits;
}

/* sum of v[j] * v[j] over j < n, in the order of torch's `x.pow(2).sum(-1)` on a contiguous
 * row (vectorized_inner_sum when n >= lanes, else the scalar row_sum: lanes 1). */
static float sum_squares(const float *v, int64_t n, int64_t lanes) {
    if (n < lanes) lanes = 1;
    const int64_t vec_size = n / lanes, size_ilp = vec_size / ILP;
    int64_t level_power = ceil_log2(size_ilp) / LEVELS;
    if (level_power < 4) level_power = 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][MAX_LANES] = {{{0}}};
    int64_t i = 0;
    while (i + level_step <= size_ilp) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int64_t k = 0; k < ILP; ++k) {
                const float *x = v + (i * ILP + k) * lanes;
                for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += x[l] * x[l];
            }
        for (int64_t lev = 1; lev < LEVELS; ++lev) {
            for (int64_t k = 0; k < ILP; ++k)
                for (int64_t l = 0; l < lanes; ++l) {
                    acc[lev][k][l] += acc[lev - 1][k][l];
                    acc[lev - 1][k][l] = 0.0f;
                }
            if (i & (level_mask << (lev * level_power))) break;
        }
    }
    for (; i < size_ilp; ++i)
        for (int64_t k = 0; k < ILP; ++k) {
            const float *x = v + (i * ILP + k) * lanes;
            for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += x[l] * x[l];
        }
    for (int64_t lev = 1; lev < LEVELS; ++lev)
        for (int64_t k = 0; k < ILP; ++k)
            for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[lev][k][l];
    for (i = size_ilp * ILP; i < vec_size; ++i) /* row_sum's tail of whole vectors */
        for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += v[i * lanes + l] * v[i * lanes + l];
    for (int64_t k = 1; k < ILP; ++k)
        for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t j = vec_size * lanes; j < n; ++j) total += v[j] * v[j];
    if (lanes == 1) return total + acc[0][0][0];
    for (int64_t l = 0; l < lanes; ++l) total += acc[0][0][l];
    return total;
}

static float inverse_rms(const float *v, int64_t n, int64_t lanes, float eps) {
    const float variance = sum_squares(v, n, lanes) / (float)n + eps;
    return 1.0f / sqrtf(variance);
}

/* x: [rows, width]; when residual is not NULL, x += residual first (x then holds the sum, the
 * layer's new residual stream); out = norm(x) * weight. wide: rows * width floats of scratch
 * owned by the caller (the widened row), or NULL in float32. Returns 0. */
int raypack_rms_norm_f32(float *x, const float *residual, const float *weight, float *out,
                         int64_t rows, int64_t width, float eps, int64_t lanes,
                         int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * width >= PARALLEL_MIN && num_threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        float *row = x + r * width;
        if (residual)
            for (int64_t j = 0; j < width; ++j) row[j] += residual[r * width + j];
        const float scale = inverse_rms(row, width, lanes, eps);
        float *o = out + r * width;
        for (int64_t j = 0; j < width; ++j) o[j] = (row[j] * scale) * weight[j];
    }
    return 0;
}

int raypack_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                          uint16_t *out, float *wide, int64_t rows, int64_t width, float eps,
                          int64_t lanes, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * width >= PARALLEL_MIN && num_threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t *row = x + r * width;
        float *w = wide + r * width;
        if (residual)
            for (int64_t j = 0; j < width; ++j) {
                row[j] = narrow(widen(row[j]) + widen(residual[r * width + j]));
                w[j] = widen(row[j]);
            }
        else
            for (int64_t j = 0; j < width; ++j) w[j] = widen(row[j]);
        const float scale = inverse_rms(w, width, lanes, eps);
        uint16_t *o = out + r * width;
        for (int64_t j = 0; j < width; ++j)
            o[j] = narrow(widen(narrow(w[j] * scale)) * widen(weight[j]));
    }
    return 0;
}

/* Rotary on `heads` heads of each token, in place: qk is [tokens, row_stride] with the heads
 * [heads, head_dim] at the start of each row (q's then k's heads of a fused q/k/v output); cos
 * and sin are [tokens, head_dim]. transformers: x * cos + rotate_half(x) * sin, rotate_half(x)
 * = cat(-x2, x1); (-b) * s == -(b * s) exactly, so `a*c - b*s` rounds as HF's ops do. */
int raypack_rotary_f32(float *qk, int64_t row_stride, int64_t tokens, int64_t heads,
                       int64_t head_dim, const float *cos, const float *sin,
                       int64_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN && num_threads > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            float *x = qk + t * row_stride + h * head_dim;
            for (int64_t d = 0; d < half; ++d) {
                const float a = x[d], b = x[d + half];
                const float lo_c = a * c[d], lo_s = b * s[d];
                const float hi_c = b * c[d + half], hi_s = a * s[d + half];
                x[d] = lo_c - lo_s;
                x[d + half] = hi_c + hi_s;
            }
        }
    }
    return 0;
}

int raypack_rotary_bf16(uint16_t *qk, int64_t row_stride, int64_t tokens, int64_t heads,
                        int64_t head_dim, const uint16_t *cos, const uint16_t *sin,
                        int64_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN && num_threads > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            uint16_t *x = qk + t * row_stride + h * head_dim;
            for (int64_t d = 0; d < half; ++d) {
                const float a = widen(x[d]), b = widen(x[d + half]);
                const float lo_c = widen(narrow(a * widen(c[d])));
                const float lo_s = widen(narrow(b * widen(s[d])));
                const float hi_c = widen(narrow(b * widen(c[d + half])));
                const float hi_s = widen(narrow(a * widen(s[d + half])));
                x[d] = narrow(lo_c - lo_s);
                x[d + half] = narrow(hi_c + hi_s);
            }
        }
    }
    return 0;
}

/* A bf16's bits as a signed 16-bit key whose integer order is the floats' order (negative
 * values' magnitude bits flipped; -0 keyed as +0, so the two compare equal as floats do).
 * NaNs are found apart (`is_nan_bits`). Integer keys let the compiler vectorize the block
 * maxima below without -ffast-math. */
static inline int16_t order_key(uint16_t bits) {
    if (bits == 0x8000u) bits = 0;
    return (int16_t)((bits & 0x8000u) ? bits ^ 0x7FFFu : bits);
}

static inline int is_nan_bits(uint16_t bits) { return (bits & 0x7FFFu) > 0x7F80u; }

#define ARGMAX_BLOCK 256

/* The index of each row's largest value, as torch's argmax over the rows widened to float32
 * (exact: a bf16 is a float32's top half): the first largest, or the first NaN if any. logits
 * is [rows, cols], rows `row_stride` elements apart; out is [rows] int64. Reading the bf16
 * rows once replaces widening them to a float32 copy and reading that. Each block's largest
 * key and NaN flag come from one vectorized pass; only a block whose maximum beats the best
 * so far (or that holds a NaN) is read again, for its first such index. */
int raypack_argmax_bf16(const uint16_t *logits, int64_t rows, int64_t cols, int64_t row_stride,
                        int64_t *out, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * cols >= PARALLEL_MIN && num_threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *row = logits + r * row_stride;
        int64_t best = 0;
        int16_t best_key = order_key(row[0]);
        for (int64_t start = 0; start < cols; start += ARGMAX_BLOCK) {
            const int64_t n = cols - start < ARGMAX_BLOCK ? cols - start : ARGMAX_BLOCK;
            const uint16_t *block = row + start;
            int16_t top = INT16_MIN;
            int nan = 0;
            for (int64_t j = 0; j < n; ++j) {
                const int16_t key = order_key(block[j]);
                top = key > top ? key : top;
                nan |= is_nan_bits(block[j]);
            }
            if (nan) { /* torch's argmax takes the first NaN */
                int64_t j = 0;
                while (!is_nan_bits(block[j])) ++j;
                best = start + j;
                break;
            }
            if (top > best_key) { /* strictly: an equal value later is not the first */
                int64_t j = 0;
                while (order_key(block[j]) != top) ++j;
                best = start + j;
                best_key = top;
            }
        }
        out[r] = best;
    }
    return 0;
}
