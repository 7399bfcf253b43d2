/* bfloat16 <-> float32 as torch converts them: bf16 is the top half of a float32, so widening
 * is a shift; narrowing rounds to nearest, ties to even (NaN stays NaN). */
#ifndef RAYPACK_BF16_H
#define RAYPACK_BF16_H
#include <stdint.h>
#include <string.h>

static inline float widen(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#endif
