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
 * degree-6 polynomial (relative error about 2e-7); exactly 0 below -87 and for -inf. One definition
 * for every vector type V (I: its int32 twin), so each lane takes the same steps at any width. */
#define KV_VEXP(name, V, I) KV_VEXP_MADD(name, V, I, KV_MADD_CONTRACT)
/* a * b + c, left to the compiler (one rounding where it contracts, as FMA builds do) */
#define KV_MADD_CONTRACT(a, b, c) ((a) * (b) + (c))
/* exp with every multiply-add taken by MADD(a, b, c) */
#define KV_VEXP_MADD(name, V, I, MADD)                                                                  \
    static inline V name(V x) {                                                                         \
        const I under = x < -87.f; /* -1 in lanes that underflow (-inf included) */                     \
        x = (V)(((I)x & ~under) | ((I)((V){0} - 87.f) & under));                                        \
        const V t = x * 1.44269504088896341f;                                                           \
        const I n = __builtin_convertvector(t - 0.5f, I); /* t <= 0: truncation gives round(t) */       \
        const V fn = __builtin_convertvector(n, V);                                                     \
        const V r = MADD(fn, (V){0} + 2.12194440e-4f, MADD(fn, (V){0} - 0.693359375f, x));             \
        V p = (V){0} + 1.f / 720;                                                                       \
        p = MADD(p, r, (V){0} + 1.f / 120);                                                             \
        p = MADD(p, r, (V){0} + 1.f / 24);                                                              \
        p = MADD(p, r, (V){0} + 1.f / 6);                                                               \
        p = MADD(p, r, (V){0} + 0.5f);                                                                  \
        p = MADD(p, r, (V){0} + 1.f);                                                                   \
        p = MADD(p, r, (V){0} + 1.f);                                                                   \
        const V out = p * (V)((n + 127) << 23);                                                         \
        return (V)((I)out & ~under);                                                                    \
    }

KV_VEXP(vexp, vec, ivec)

#endif
