/* Sixteen-lane primitives of the attention kernels over quantized and 16-bit pages (qattn.c):
 * every lane takes the same steps at every vector width (GCC vectors of sixteen floats: one
 * AVX-512 register, two AVX2 ones, four SSE ones), every multiply-add rounds once (the FMA
 * instruction, or fmaf in the generic build), sums over lanes go by one fixed tree, so every
 * kernel variant gives the same bits. Included by qattn.c only. */
#ifndef KV_QLANES_H
#define KV_QLANES_H

#if defined(__FMA__)
/* FMA builds: MADD below is a * b + c, fused by the compiler (in AVX2 builds a sixteen-float vector
 * has no register, and the compiler splits plain arithmetic on it best). Nothing else in these
 * kernels is written as a product feeding a sum, so nothing else fuses: test_qattn and
 * test_variants compare the bits with the generic build's fmaf. */
#pragma GCC optimize("fp-contract=fast")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vmath.h"

#define ALWAYS __attribute__((always_inline)) inline
#define NOINLINE __attribute__((noinline))

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1), may_alias));
typedef uint64_t u64x2 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
/* a * b + c with one rounding in every variant (fused by the compiler in FMA builds, vmath.h's
 * madd16 lane by lane in the generic build; fmaf for one float) */
#if defined(__FMA__)
#define MADD(a, b, c) ((a) * (b) + (c))
#else
#define MADD(a, b, c) madd16((v16){0} + (a), (v16){0} + (b), (c))
#endif
#define MADDF(a, b, c) kv_fmaf((a), (b), (c))
KV_VEXP_MADD(vexp16, v16, i16, MADD)

#define CH 256          /* keys per chunk */
#define NR 4            /* query rows per tile */
#if defined(__AVX512F__)
#define NM 8            /* rows per tile where many rows take a chunk (a prefill): 16 sums or chains in registers */
#else
#define NM NR           /* (sixteen ymm registers: no room for more sums) */
#endif
#define SPLIT_ROWS 16   /* at most this many rows per KV head: chunks spread over the threads */
#define RB 128          /* rows per work item otherwise */
#define MAXD 512
#if defined(__AVX512F__)
#define SLAB 4          /* value vectors accumulated at once (NR * SLAB registers) */
#else
#define SLAB 1
#endif

/* IEEE binary16 bits -> float, exactly (normals, subnormals, zeros, infinities, NaN). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static void halves(const uint16_t *h, int n, float *out) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(h[i]);
}

/* Sixteen bytes widened to int32 lanes. */
static ALWAYS i16 widen16(u8x16 raw) {
#if defined(__AVX512F__)
    return (i16)_mm512_cvtepu8_epi32((__m128i)raw);
#elif defined(__AVX2__)
    union { __m256i h[2]; i16 v; } u;
    u.h[0] = _mm256_cvtepu8_epi32((__m128i)raw);
    u.h[1] = _mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)raw, 8));
    return u.v;
#else
    i16 x;
    for (int i = 0; i < 16; i++) x[i] = raw[i];
    return x;
#endif
}

/* Lanes 16v .. 16v + 15 of a block of G codes of `bits` bits packed in nb = G * bits / 8 bytes (code
 * j of a byte at bits j * bits ..): lane L holds code (L % nb) * (8 / bits) + L / nb. */
static ALWAYS v16 unpack16(const uint8_t *src, int bits, int G, int v) {
    const int nb = G * bits / 8, L0 = 16 * v;
    u8x16 raw;
    if (nb >= 16) {
        memcpy(&raw, src + L0 % nb, 16);
    } else if (nb == 8) { /* the block repeated: one broadcast, no partial stores to reload */
        uint64_t w;
        memcpy(&w, src, 8);
        raw = (u8x16)((u64x2){w, w});
    } else {
        uint32_t w;
        memcpy(&w, src, 4);
        raw = (u8x16)((u32x4){w, w, w, w});
    }
    i16 x = widen16(raw);
    if (bits < 8) {
        i16 sh;
        for (int i = 0; i < 16; i++) sh[i] = ((L0 + i) / nb) * bits;
        x = (x >> sh) & ((1 << bits) - 1);
    }
    return __builtin_convertvector(x, v16);
}

/* unpack16's lanes as bytes. */
static ALWAYS u8x16 codes16(const uint8_t *src, int bits, int G, int v) {
    const int nb = G * bits / 8, L0 = 16 * v;
    const uint64_t m = bits == 8 ? ~0ull : bits == 4 ? 0x0f0f0f0f0f0f0f0full : 0x0303030303030303ull;
    if (nb >= 16) { /* every lane shifted alike */
        u64x2 w;
        memcpy(&w, src + L0 % nb, 16);
        const int s = L0 / nb * bits;
        return (u8x16)((w >> s) & m);
    }
    if (nb == 8) { /* lanes 0-7 and 8-15: the same eight bytes, two shifts */
        uint64_t w;
        memcpy(&w, src, 8);
        return (u8x16)((u64x2){(w >> (2 * v * bits)) & m, (w >> ((2 * v + 1) * bits)) & m});
    }
    uint32_t w; /* nb == 4 (two bits, G = 16): four shifts of four bytes */
    memcpy(&w, src, 4);
    const uint32_t m4 = (uint32_t)m;
    return (u8x16)((u32x4){w & m4, (w >> 2) & m4, (w >> 4) & m4, (w >> 6) & m4});
}

typedef int16_t s16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* Two rows of sixteen codes taken about the middle code mid, paired: 32-bit lane i of out holds
 * a[i] - mid (low half) and b[i] - mid (high half) as 16-bit integers (two channels of token i for
 * keys, two tokens of element i for values). */
static ALWAYS void pair16(u8x16 a, u8x16 b, int mid, uint32_t *out) {
    const s16x16 x = __builtin_convertvector(a, s16x16) - (int16_t)mid;
    const s16x16 y = __builtin_convertvector(b, s16x16) - (int16_t)mid;
    const u32x16 lo = __builtin_convertvector((__builtin_convertvector(x, i16) & 0xffff), u32x16);
    const u32x16 hi = __builtin_convertvector(__builtin_convertvector(y, i16), u32x16) << 16;
    const u32x16 r = lo | hi;
    memcpy(out, &r, 64);
}

/* acc + the sums of two products per 32-bit lane: the 16-bit halves of a's lanes times the two
 * halves of b (one pair for every lane). Exact in every variant (callers keep the sums in 32 bits). */
static ALWAYS i16 dot2(i16 acc, const uint32_t *a, uint32_t b) {
#if defined(__AVX512VNNI__)
    return (i16)_mm512_dpwssd_epi32((__m512i)acc, _mm512_loadu_si512(a), _mm512_set1_epi32((int)b));
#elif defined(__AVXVNNI__)
    union { __m256i h[2]; i16 v; } u = {.v = acc};
    const __m256i bb = _mm256_set1_epi32((int)b);
    u.h[0] = _mm256_dpwssd_avx_epi32(u.h[0], _mm256_loadu_si256((const __m256i *)a), bb);
    u.h[1] = _mm256_dpwssd_avx_epi32(u.h[1], _mm256_loadu_si256((const __m256i *)(a + 8)), bb);
    return u.v;
#elif defined(__AVX2__)
    union { __m256i h[2]; i16 v; } u = {.v = acc};
    const __m256i bb = _mm256_set1_epi32((int)b);
    for (int k = 0; k < 2; k++)
        u.h[k] = _mm256_add_epi32(u.h[k], _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a + 8 * k)), bb));
    return u.v;
#else
    const int32_t b0 = (int16_t)(b & 0xffff), b1 = (int16_t)(b >> 16);
    for (int i = 0; i < 16; i++) acc[i] += (int16_t)(a[i] & 0xffff) * b0 + (int16_t)(a[i] >> 16) * b1;
    return acc;
#endif
}

/* x rounded to the nearest integer, ties to even, as a 16-bit integer (|x| <= 32767 by construction). */
static inline uint16_t round_half(float x) { return (uint16_t)(int16_t)(int32_t)nearbyintf(x); }

/* Sixteen fp16 (bf16 = 0) or bf16 values widened to float, exactly. */
static ALWAYS v16 wide16(const uint16_t *p, int bf16) {
    if (bf16) { /* a bfloat16 is a float's upper half */
#if defined(__AVX512F__)
        return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
        union { __m256i h[2]; v16 v; } u;
        u.h[0] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
        u.h[1] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8))), 16);
        return u.v;
#endif
        i16 x;
        for (int i = 0; i < 16; i++) x[i] = (int32_t)((uint32_t)p[i] << 16);
        return (v16)x;
    }
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    union { __m256 h[2]; v16 v; } u;
    u.h[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    u.h[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return u.v;
#else
    v16 x;
    for (int i = 0; i < 16; i++) x[i] = half_to_float(p[i]);
    return x;
#endif
}

/* The element of a packed block that lane L holds (unpack16's order). */
static int lane_item(int L, int bits, int G) {
    const int nb = G * bits / 8;
    return (L % nb) * (8 / bits) + L / nb;
}

/* m[i] lane j <- m[j] lane i (a 16 x 16 block transposed in four stages of two-input shuffles). */
static ALWAYS void transpose16(v16 *m) {
    const i16 s1l = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 s1h = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 s2l = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i16 s2h = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i16 s3l = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i16 s3h = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i16 s4l = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i16 s4h = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    v16 u[16], v[16];
    for (int a = 0; a < 8; a++) {
        u[a] = __builtin_shuffle(m[a], m[a + 8], s1l);
        u[a + 8] = __builtin_shuffle(m[a], m[a + 8], s1h);
    }
    for (int b = 0; b < 16; b += 8)
        for (int a = b; a < b + 4; a++) {
            v[a] = __builtin_shuffle(u[a], u[a + 4], s2l);
            v[a + 4] = __builtin_shuffle(u[a], u[a + 4], s2h);
        }
    for (int b = 0; b < 16; b += 4)
        for (int a = b; a < b + 2; a++) {
            u[a] = __builtin_shuffle(v[a], v[a + 2], s3l);
            u[a + 2] = __builtin_shuffle(v[a], v[a + 2], s3h);
        }
    for (int b = 0; b < 16; b += 2) {
        m[b] = __builtin_shuffle(u[b], u[b + 1], s4l);
        m[b + 1] = __builtin_shuffle(u[b], u[b + 1], s4h);
    }
}

static ALWAYS float hmax16(v16 x) {
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* The normalized Walsh-Hadamard transform of x [D] in place, over blocks of the largest power of two
 * dividing D (its own inverse). */
static void fwht(float *x, int D) {
    int B = D & -D;
    const float norm = 1.f / sqrtf((float)B);
    for (int b0 = 0; b0 < D; b0 += B) {
        float *y = x + b0;
        for (int h = 1; h < B; h *= 2)
            for (int i = 0; i < B; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float a = y[j], c = y[j + h];
                    y[j] = a + c;
                    y[j + h] = a - c;
                }
        for (int i = 0; i < B; i++) y[i] *= norm;
    }
}

#endif
