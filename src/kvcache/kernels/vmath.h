/* Portable SIMD math for the kernels (GCC vector extensions: one register of VL floats: 16 with
 * AVX-512, 8 with AVX, 4 otherwise): the vector types and exp for non-positive arguments. */
#ifndef KV_VMATH_H
#define KV_VMATH_H

#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

typedef float vec __attribute__((vector_size(VL * 4), aligned(4), may_alias));

typedef int32_t ivec __attribute__((vector_size(VL * 4), aligned(4), may_alias));

/* exp(x) for x <= 0 (softmax after subtracting the maximum): 2^n * p(r) with |r| <= ln2 / 2 and a
 * degree-6 polynomial (relative error about 2e-7); exactly 0 below -87 and for -inf. */
static inline vec vexp(vec x) {
    const ivec under = x < -87.f;  /* -1 in lanes that underflow (-inf included) */
    x = (vec)(((ivec)x & ~under) | ((ivec)((vec){0} - 87.f) & under));
    const vec t = x * 1.44269504088896341f;
    const ivec n = __builtin_convertvector(t - 0.5f, ivec);  /* t <= 0: truncation gives round(t) */
    const vec fn = __builtin_convertvector(n, vec);
    const vec r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    vec p = (vec){0} + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const vec out = p * (vec)((n + 127) << 23);
    return (vec)((ivec)out & ~under);
}

#endif
