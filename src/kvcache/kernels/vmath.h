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

/* a * b + c rounded once, as C's fmaf. Where the build has a fused multiply-add instruction (FMA
 * builds, and the targets whose every CPU has one: aarch64, ...) the compiler inlines fmaf as it.
 * The generic build on x86 has none. There libm's fmaf is the FMA instruction behind a call on CPUs
 * that have it (glibc picks it at load), and on those that do not (the CPUs the generic build is
 * for) a software path that saves and restores the floating-point environment: 2 prompt tokens a
 * second for the bundled model. So where the CPU has no FMA, kv_fmaf does that arithmetic inline
 * (11 a second): a * b is exact in double (24 + 24 bits), the sum is rounded to odd (to nearest,
 * then, where that was inexact, to whichever neighbour has an odd last bit, found by the sum's exact
 * error), and a sum rounded to odd with 53 >= 24 + 2 bits rounds to float correctly: the same bits
 * as fmaf for every input (tests/test_kernels.py holds it to libm's on random and edge operands,
 * KV_FMAF_INLINE taking the inline path on any CPU). */
#if !defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
#define KV_FMAF_SOFT 1
#ifndef KV_FMAF_INLINE
static int kv_fma_cpu; /* this CPU has FMA (set when the library loads, a copy per source file) */
__attribute__((constructor)) static void kv_fma_probe(void) {
    __builtin_cpu_init(); /* a constructor may run before libgcc's own has read the CPU */
    kv_fma_cpu = __builtin_cpu_supports("fma");
}
#endif
#endif

static KV_ALWAYS float kv_fmaf(float a, float b, float c) {
#ifndef KV_FMAF_SOFT
    return fmaf(a, b, c);
#else
#ifndef KV_FMAF_INLINE
    if (__builtin_expect(kv_fma_cpu, 1)) return fmaf(a, b, c);
#endif
    const double p = (double)a * (double)b, x = (double)c;
    double s = p + x;
    if (!__builtin_isfinite(s)) return (float)s; /* an infinity or a NaN: as fmaf's */
    const double z = s - p, err = (p - (s - z)) + (x - z); /* p + x - s, exactly (the two-sum) */
    if (err != 0.0) {
        uint64_t u;
        memcpy(&u, &s, 8);
        if (!(u & 1)) { /* the neighbour on err's side: one step of the bits, up in magnitude or down */
            u += (err > 0.0) == (s > 0.0) ? 1 : (uint64_t)-1;
            memcpy(&s, &u, 8);
        }
    }
    return (float)s;
#endif
}

/* a * b + c lane by lane with kv_fmaf where the build has no FMA, two FMA instructions on halves for
 * a sixteen-float vector in AVX2 builds */
#define KV_LANE_FMA(name, V, N)                                          \
    static KV_ALWAYS V name(V a, V b, V c) {                             \
        V r;                                                             \
        for (int i = 0; i < (N); i++) r[i] = kv_fmaf(a[i], b[i], c[i]);  \
        return r;                                                        \
    }

/* The build contracts nothing (-ffp-contract=off) and never reassociates: every fused multiply-add
 * is written out. An FMA build takes its FMA instruction (intrinsics: the compiler keeps the
 * operands in registers), the generic build kv_fmaf lane by lane. So each one rounds once in every
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
    for (int l = 0; k + l < n; l++) t[l] = kv_fmaf(x[k + l], y[k + l], t[l]);
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
