/* Portable SIMD math for the kernels (GCC vector extensions: one register of VL floats: 16 with
 * AVX-512, 8 with AVX, 4 otherwise): the vector types, the canonical multiply-add and reductions,
 * and exp for non-positive arguments. Every step here takes the same rounding in every kernel
 * variant (generic, AVX2, AVX-VNNI, AVX-512): the bits do not depend on the CPU. */
#ifndef KV_VMATH_H
#define KV_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

typedef float vec __attribute__((vector_size(VL * 4), aligned(4), may_alias));

typedef int32_t ivec __attribute__((vector_size(VL * 4), aligned(4), may_alias));

/* Sixteen floats at every width (one AVX-512 register, two AVX2 ones, four SSE ones): the lanes of
 * the canonical reductions, so a sum takes the same steps whatever vector the build has. */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16 __attribute__((vector_size(64), aligned(4), may_alias));

#define KV_ALWAYS __attribute__((always_inline)) inline

typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));

/* a * b + c lane by lane with fmaf: libm's correctly rounded fmaf where the build has no FMA, two
 * FMA instructions on halves for a sixteen-float vector in AVX2 builds */
#define KV_LANE_FMA(name, V, N)                                          \
    static KV_ALWAYS V name(V a, V b, V c) {                             \
        V r;                                                             \
        for (int i = 0; i < (N); i++) r[i] = fmaf(a[i], b[i], c[i]);     \
        return r;                                                        \
    }

/* The build contracts nothing (-ffp-contract=off) and never reassociates: every fused multiply-add
 * is written out. An FMA build takes its FMA instruction (intrinsics: the compiler keeps the
 * operands in registers), the generic build fmaf lane by lane. So each one rounds once in every
 * variant. */
#if defined(__FMA__)
#include <immintrin.h>
static KV_ALWAYS v8 vmadd8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#if defined(__AVX512F__)
static KV_ALWAYS v16 madd16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
KV_LANE_FMA(madd16, v16, 16)
#endif
#else
KV_LANE_FMA(vmadd8, v8, 8)
KV_LANE_FMA(madd16, v16, 16)
#endif
#if VL == 16
#define vmadd madd16
#elif VL == 8
#define vmadd vmadd8
#else
KV_LANE_FMA(vmadd, vec, VL)
#endif

/* The lanes of x summed by one fixed tree (8 pairs, 4, 2, 1). */
static KV_ALWAYS float hsum16(v16 x) {
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = x[i] + x[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* sum x[k] y[k], k < n: lane k % 16 takes a multiply-add chain in k's order, then hsum16's tree.
 * One order at every vector width (norms, the canonical dot products). The sixteen lanes are kept
 * as two halves of 8: a 64-byte vector has no register in AVX2 builds and would live in memory. */
static KV_ALWAYS float kv_dot(const float *x, const float *y, int n) {
    v8 lo = {0}, hi = {0};
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        lo = vmadd8(*(const v8 *)(x + k), *(const v8 *)(y + k), lo);
        hi = vmadd8(*(const v8 *)(x + k + 8), *(const v8 *)(y + k + 8), hi);
    }
    float t[16];
    memcpy(t, &lo, sizeof(lo));
    memcpy(t + 8, &hi, sizeof(hi));
    for (int l = 0; k + l < n; l++) t[l] = fmaf(x[k + l], y[k + l], t[l]);
    v16 all;
    memcpy(&all, t, sizeof(all));
    return hsum16(all);
}

#define KV_VEXP(name, V, I) KV_VEXP_MADD(name, V, I, vmadd)
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

/* exp(x) for x <= 0 of one float, the very steps of vexp's lanes (the merges of partial sums) */
static inline float kv_exp1(float x) {
    vec v = {0};
    v[0] = x;
    return vexp(v)[0];
}

#endif
