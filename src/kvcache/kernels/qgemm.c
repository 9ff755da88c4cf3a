/* Quantized projections: y = x @ W^T (+ bias) for a weight in one of kvcache's repacked formats
 * (qformat.h), for one row (decode) and for many (prefill, batched decode, extends).
 *
 * act_row quantizes a row of activations per block of 32 to int8 (scale amax / 127) and keeps the
 * integer sums of each 16-half (for offset and signed weights) and their scaled sums (for
 * minimums); for K-quant weights (Q4_K, Q5_K, Q6_K) it quantizes per super-block of 256 instead
 * (their order: see "the K-quant formats' order" below); with a norm weight it multiplies the
 * input by it first, and it gives 1 / rms(x) so that an RMSNorm before the projection is folded
 * in: the products are scale-free per block, and the row scale multiplies the result.
 *
 * The product: work items are groups of 16 output columns; a tile of up to RT rows unpacks one
 * block of a group's integer weights into registers (one 32-bit lane per column, 4 inputs in it:
 * the layout of the int8 dot-product instructions) and multiplies every row of the tile by them:
 *   AVX512-VNNI  vpdpbusd on 64 bytes (16 columns x 4 inputs), the activations broadcast from
 *                memory; signed weights are offset by 128, and every offset (Q4_0's 8, Q5_0's 16,
 *                the 128) is taken back by starting a block's integer sum at -offset * the sum of
 *                its activations
 *   AVX-VNNI     the same on 32 bytes (8 columns), two halves per group
 *   AVX2         vpmaddubsw + vpmaddwd; signed weights through the sign trick
 *   generic      plain C over the same layout (other CPUs)
 * then converts each block's integer sums to float once, times the activation step and the
 * weight scale. Every output element is reduced in one fixed order (block by block, the same
 * instructions) whatever the number of rows in its tile, so a row's result does not depend on
 * the batch it came in (batch invariance).
 * Rows go in chunks of RCHUNK so a chunk's activations stay in cache while every group passes.
 * Which of these a build holds depends on its compile flags; kernels/__init__.py builds one
 * library per variant and loads the best one the CPU can run.
 *
 * Layouts: x [n, K] float, rows ldx apart; activations as qgemm.h's Scratch; qs, d, m as
 * qformat.h; bias [out] float or NULL; rscale [n] or NULL; y [n, out], rows ldy apart.
 */
#include "qformat.h"
#include "qgemm.h"
#include "vmath.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ISA 3
#ifndef NGMAX
#define NGMAX 2 /* column groups in a tile */
#endif
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA 1
#else
#define ISA 0
#endif
/* rows in a tile and column groups a tile (NGMAX above 1 with AVX-512 only); both may be set at
 * build time (CC='gcc -DRT=8 -DNGMAX=1') to try other tile shapes: 4 x 2, 8 x 1, 6 x 2 and 5 x 2
 * were within 2% of each other for Q4_K on a Zen4 */
#ifndef RT
#define RT 4
#endif
#ifndef NGMAX
#define NGMAX 1
#endif
/* software prefetch distance in bytes of weights: the hardware's own prefetchers alone left the
 * products well short of the memory's bandwidth (measured: 29 -> 38 GB/s for Q4_1, 38 -> 41+ for
 * Q8_0 with one call over 70-120 MB) */
#ifndef PF
#define PF 3072
#endif

const char *kv_q_isa(void) {
    static const char *names[] = {"generic", "avx2", "avxvnni", "avx512vnni"};
    return names[ISA];
}

/* -- activations -------------------------------------------------------------------------------- */
/* Lane-wise select and the horizontal reductions the loops below need. */
static inline vec vsel(ivec m, vec a, vec b) { return (vec)(((ivec)a & m) | ((ivec)b & ~m)); }
static inline vec vabs(vec a) { return (vec)((ivec)a & 0x7fffffff); }

/* x * id rounded to the nearest integer (halves away from zero) within -127 .. 127, lane by lane. */
static inline ivec round_step(vec x, float id) {
    const vec t = x * id;
    const vec half = (vec)(((ivec)t & (int32_t)0x80000000) | (ivec)((vec){0} + 0.5f));
    ivec qi = __builtin_convertvector(t + half, ivec); /* |t| <= 127 by construction */
    qi = (qi & (qi <= 127)) | (127 & ~(qi <= 127));
    return (qi & (qi >= -127)) | (-127 & ~(qi >= -127));
}

/* qi's lanes stored as int8 at q; returns their sum. Whole vectors at once (lane by lane, these
 * stores and sums took about 3% of a 1.5B model's prefill). */
typedef int8_t bvec __attribute__((vector_size(VL), aligned(1), may_alias));
static inline int put_sum(int8_t *q, ivec qi) {
    const bvec b = __builtin_convertvector(qi, bvec);
    memcpy(q, &b, VL);
    ivec t = qi;
    int s = 0;
#if VL == 16
    t += __builtin_shufflevector(t, t, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    t += __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    t += __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    s = t[0] + t[1];
#else
    for (int l = 0; l < VL; l++) s += t[l];
#endif
    return s;
}

/* The largest |v| of n vectors (lanes), as a float. */
static inline float amax_of(const vec *v, int n) {
    vec m = {0};
    for (int j = 0; j < n; j++) {
        const vec a = vabs(v[j]);
        m = vsel(a > m, a, m);
    }
    float amax = 0.f;
    for (int l = 0; l < VL; l++) amax = m[l] > amax ? m[l] : amax;
    return amax;
}

/* Row r of x: inv[r] = 1 / rms (eps >= 0) or 1; the int8 activations of (x * g) in the orders sc->need
 * asks for: per block of 32 and per super-block of 256 (one step each, amax / 127), each value
 * rounded to the nearest step (halves away from zero), with their integer sums. */
KV_HIDDEN void act_row(const Scratch *sc, int r, int K, const float *x, int64_t ldx, const float *g, float eps) {
    const int nb = K / 32, nv = 32 / VL;
    const float *xr = x + (int64_t)r * ldx;
    if (eps >= 0.f) {
        sc->inv[r] = 1.f / sqrtf(kv_dot(xr, xr, K) / (float)K + eps);
    } else {
        sc->inv[r] = 1.f;
    }
    if (sc->need & ACT_BLOCK)
        for (int b = 0; b < nb; b++) {
            vec v[32 / VL];
            for (int j = 0; j < nv; j++) {
                v[j] = *(const vec *)(xr + 32 * b + VL * j);
                if (g) v[j] *= *(const vec *)(g + 32 * b + VL * j);
            }
            const float amax = amax_of(v, nv), d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            int s[2] = {0, 0};
            int8_t *qb = sc->q + (int64_t)r * K + 32 * b;
            for (int j = 0; j < nv; j++) {
                s[(VL * j) >> 4] += put_sum(qb + VL * j, round_step(v[j], id)); /* VL <= 16: one sub-block's */
            }
            const int64_t at = (int64_t)r * nb + b;
            sc->da[at] = d;
            sc->sa[3 * at] = d * (float)(s[0] + s[1]);
            sc->sa[3 * at + 1] = d * (float)s[0];
            sc->sa[3 * at + 2] = d * (float)s[1];
            sc->is[2 * at] = s[0];
            sc->is[2 * at + 1] = s[1];
        }
    if (sc->need & ACT_SUPER)
        for (int sb = 0; sb < K / 256; sb++) {
            vec v[256 / VL];
            for (int j = 0; j < 256 / VL; j++) {
                v[j] = *(const vec *)(xr + 256 * sb + VL * j);
                if (g) v[j] *= *(const vec *)(g + 256 * sb + VL * j);
            }
            const float amax = amax_of(v, 256 / VL), id = amax > 0.f ? 127.f / amax : 0.f;
            int s[16] = {0};
            int8_t *qb = sc->kq + (int64_t)r * K + 256 * sb;
            for (int j = 0; j < 256 / VL; j++) {
                s[(VL * j) >> 4] += put_sum(qb + VL * j, round_step(v[j], id)); /* VL <= 16: one sub-block's */
            }
            if (sc->kt) /* the tile order's copy: four 64-byte rows of row tile r / 16 */
                for (int kk = 0; kk < 4; kk++)
                    memcpy(sc->kt + (int64_t)(r / 16) * 16 * K + 1024 * (4 * sb + kk) + 64 * (r % 16), qb + 64 * kk, 64);
            sc->dk[(int64_t)r * (K / 256) + sb] = amax / 127.f;
            int16_t *k16 = sc->k16 + (int64_t)r * (K / 16) + 16 * sb, *k32 = sc->k32 + (int64_t)r * nb + 8 * sb;
            for (int i = 0; i < 16; i++) k16[i] = (int16_t)s[i];
            for (int i = 0; i < 8; i++) k32[i] = (int16_t)(s[2 * i] + s[2 * i + 1]);
        }
}

/* -- one group of 16 columns x up to RT rows ----------------------------------------------------- */
typedef struct { /* the activations of a tile's first row (Scratch's arrays from there on) */
    const int8_t *q;
    const float *da, *sa;
    const int32_t *is;
    int K, nb;
    const int8_t *kq; /* the super-block order (K-quant weights) */
    const float *dk;
    const int16_t *k16, *k32;
} Acts;

/* Row r's activations from a tile's (Acts a of its first row). */
static inline Acts acts_row(Acts a, int r) {
    const Acts o = {a.q + (int64_t)r * a.K, a.da + (int64_t)r * a.nb, a.sa + (int64_t)r * 3 * a.nb,
                    a.is + (int64_t)r * 2 * a.nb, a.K, a.nb, a.kq + (int64_t)r * a.K,
                    a.dk + (int64_t)r * (a.nb / 8), a.k16 + (int64_t)r * 2 * a.nb, a.k32 + (int64_t)r * a.nb};
    return o;
}

/* Scale kinds (the F16 parameter below): 0 fp32, 1 fp16 (the K-quant formats take their own
 * order, below). Column c's scale and minimum of sub-block h of block b; dv, mv at the group's
 * arrays. */
static inline void scale_at(const int F16, const void *dv, const void *mv, int b, int NS, int h, int c, float *d,
                            float *m) {
    const int64_t i = ((int64_t)b * NS + h) * KVQ_NC + c;
    *d = F16 ? kvq_h2f(((const uint16_t *)dv)[i]) : ((const float *)dv)[i];
    if (mv) *m = F16 ? kvq_h2f(((const uint16_t *)mv)[i]) : ((const float *)mv)[i];
}

static inline int32_t word(const int8_t *p) { /* four activations as one 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* -- the K-quant formats' order: one float step per super-block ---------------------------------
 * Q4_KS, Q5_KS, Q6_KS and Q2_KS (qformat.h) take the activations per super-block of 256 inputs
 * (Scratch's kq, dk, k16, k32: one step dk, llama.cpp's order for its K-quants) and compute each
 * output (row, column) of a super-block as two integers, exact in int32:
 *   S = sum over the sub-blocks h (8 of 32 inputs; Q6_KS, Q2_KS 16 of 16) of
 *       sc_h * (sum q a - OFS * sum a)
 *   M = sum over the sub-blocks of mn_h * (sum of a over the sub-block)   (Q4_KS, Q5_KS, Q2_KS)
 * (sc, mn the file's integer scales and minimums, Q6_K's signed eight-bit scales; OFS 32 for Q6_KS,
 * else 0; |S| < 2^29), then two float steps: acc = fma(dk * d, (float) S, acc) and, with minimums,
 * acc = fma(-(dk * dmin), (float) M, acc), d and dmin the column's fp16 super-block scales. Every
 * variant computes those integers, in whatever order (they are exact), and those float steps, so
 * the bits agree; a row's result is the same in any tile. */
static inline int ks_scale(const uint8_t *sp, int KS, int j, int h, int c) {
    return KS == 2 ? (int)(int8_t)sp[32 * j + 16 * h + c] : KS == 1 ? kvq_ks1_scale(sp, j, c) : (int)sp[32 * j + 16 * h + c];
}

#if ISA == 3
#include "qtile512.h"
#elif ISA == 1 || ISA == 2
#include "qtile256.h"
#else
static inline __attribute__((always_inline)) void group(const int NIB, const int HI, const int SGN, const int F16,
                                                        const int NS, const int OFS, int nr, Acts a, const uint8_t *w,
                                                        const void *dv, const void *mv, float out[RT][NGMAX * KVQ_NC]) {
    const int qb = NIB ? 256 + 64 * HI : 512;
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < KVQ_NC; c++) out[r][c] = 0.f;
    for (int b = 0; b < a.nb; b++) {
        for (int c = 0; c < KVQ_NC; c++) {
            int wq[32];
            for (int k = 0; k < 32; k++) {
                int high, pos = kvq_pos(NIB, c, k, &high);
                const uint8_t byte = w[(int64_t)b * qb + pos];
                wq[k] = NIB ? (high ? byte >> 4 : byte & 15) : SGN ? (int8_t)byte : byte;
                if (NIB == 2) wq[k] = KVQ_MX4_U[wq[k]]; /* MXFP4's codes through the table */
                if (HI == 2) {
                    int sh, hp = kvq_six_pos(c, k, &sh);
                    wq[k] |= ((w[(int64_t)b * qb + hp] >> sh) & 3) << 4;
                } else if (HI) {
                    int bit, hp = kvq_high_pos(c, k, &bit);
                    wq[k] |= ((w[(int64_t)b * qb + hp] >> bit) & 1) << 4;
                }
            }
            float dw[2], mw[2] = {0.f, 0.f};
            for (int h = 0; h < NS; h++) scale_at(F16, dv, mv, b, NS, h, c, &dw[h], &mw[h]);
            for (int r = 0; r < nr; r++) {
                const int64_t at = (int64_t)r * a.nb + b;
                const int8_t *ar = a.q + (int64_t)r * a.K + 32 * b;
                int s[2] = {-OFS * a.is[2 * at], -OFS * a.is[2 * at + 1]};
                for (int k = 0; k < 32; k++) s[k >> 4] += wq[k] * ar[k];
                const float *sa = a.sa + 3 * at;
                float v = out[r][c]; /* the SIMD tiles' steps (qtile256.h, qtile512.h), one rounding each */
                if (NS == 1) {
                    v = kv_fmaf((float)(s[0] + s[1]) * a.da[at], dw[0], v);
                    if (!SGN && !OFS) v = kv_fmaf(mw[0], sa[0], v);
                } else {
                    v = kv_fmaf(kv_fmaf((float)s[1], dw[1], (float)s[0] * dw[0]), a.da[at], v);
                    if (!SGN && !OFS) {
                        v = kv_fmaf(mw[0], sa[1], v);
                        v = kv_fmaf(mw[1], sa[2], v);
                    }
                }
                out[r][c] = v;
            }
        }
    }
}

/* The K-quant order (above) for 16 columns x nr rows in plain C. */
static inline __attribute__((always_inline)) void ks_group(const int HI, const int KS, int nr, Acts a,
                                                           const uint8_t *w, const uint8_t *dv,
                                                           float out[RT][NGMAX * KVQ_NC]) {
    const int qb = 256 + 64 * HI, NS = kvq_ks_ns(KS), ofs = KS == 2 ? 32 : 0, nsb = a.nb / 8, len = 32 / NS;
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *sp = dv + (int64_t)sb * kvq_ksb(KS);
        for (int c = 0; c < KVQ_NC; c++) {
            int32_t S[RT] = {0}, M[RT] = {0};
            for (int j = 0; j < 8; j++) {
                const int64_t b = 8 * sb + j;
                int wq[32];
                for (int k = 0; k < 32; k++) {
                    int high, pos = kvq_pos(1, c, k, &high);
                    const uint8_t byte = w[b * qb + pos];
                    wq[k] = high ? byte >> 4 : byte & 15;
                    if (HI == 2) {
                        int sh, hp = kvq_six_pos(c, k, &sh);
                        wq[k] |= ((w[b * qb + hp] >> sh) & 3) << 4;
                    } else if (HI) {
                        int bit, hp = kvq_high_pos(c, k, &bit);
                        wq[k] |= ((w[b * qb + hp] >> bit) & 1) << 4;
                    }
                }
                for (int r = 0; r < nr; r++) {
                    const Acts ar = acts_row(a, r);
                    for (int h = 0; h < NS; h++) {
                        int32_t t = -ofs * ar.k16[2 * b + h];
                        for (int k = len * h; k < len * (h + 1); k++) t += wq[k] * ar.kq[32 * b + k];
                        S[r] += ks_scale(sp, KS, j, h, c) * t;
                        if (KS == 3) M[r] += (int32_t)sp[256 + 32 * j + 16 * h + c] * ar.k16[2 * b + h];
                    }
                    if (KS == 1) M[r] += (int32_t)kvq_ks1_min(sp, j, c) * ar.k32[b];
                    if (KS == KVQ_KS_WIDE) M[r] += (int32_t)sp[32 * j + 16 + c] * ar.k32[b];
                }
            }
            uint16_t hd, hm;
            memcpy(&hd, sp + kvq_ks_d(KS) + 2 * c, 2);
            memcpy(&hm, sp + kvq_ks_dmin(KS) + 2 * c, 2);
            const float d = kvq_h2f(hd), dmin = kvq_h2f(hm);
            for (int r = 0; r < nr; r++) {
                const float da = a.dk[(int64_t)r * nsb + sb];
                float v = kv_fmaf(da * d, (float)S[r], sb ? out[r][c] : 0.f);
                if (KS != 2) v = kv_fmaf(-(da * dmin), (float)M[r], v);
                out[r][c] = v;
            }
        }
    }
}
#endif

/* ng groups of columns (ng <= NGMAX) over rows r0 .. r0 + nr - 1 (nr <= RT) of one format. */
#if ISA == 3
#define GROUP_FN(name, NIB, HI, SGN, F16, NS, OFS) \
    static void name(int ng, int nr, const Acts *ap, int r0, const uint8_t *w, int64_t gq, const void *dv, \
                     const void *mv, int64_t gs, float out[RT][NGMAX * KVQ_NC]) { \
        const Acts a = acts_row(*ap, r0); \
        if (ng == 2 && nr == RT) /* a whole tile: every row's sums in registers */ \
            tile(NIB, HI, SGN, F16, NS, OFS, 2, RT, a, w, gq, dv, mv, gs, out); \
        else if (nr == 1) /* a decode: one group after the other (one stream of weights) */ \
            for (int g = 0; g < ng; g++) \
                row1(NIB, HI, SGN, F16, NS, OFS, 1, a, w + g * gq, gq, (const char *)dv + g * gs, \
                     mv ? (const char *)mv + g * gs : NULL, gs, out[0] + KVQ_NC * g); \
        else if (nr == 2) /* two rows (a short verifying forward): each as a decode, the group's */ \
            for (int g = 0; g < ng; g++) /* weights read again from the first level cache */ \
                for (int r = 0; r < 2; r++) { \
                    const Acts ar = {a.q + (int64_t)r * a.K, a.da + (int64_t)r * a.nb, a.sa + (int64_t)r * 3 * a.nb, \
                                     a.is + (int64_t)r * 2 * a.nb, a.K, a.nb}; \
                    row1(NIB, HI, SGN, F16, NS, OFS, 1, ar, w + g * gq, gq, (const char *)dv + g * gs, \
                         mv ? (const char *)mv + g * gs : NULL, gs, out[r] + KVQ_NC * g); \
                } \
        else if (ng == 2) \
            tile(NIB, HI, SGN, F16, NS, OFS, 2, nr, a, w, gq, dv, mv, gs, out); \
        else \
            tile(NIB, HI, SGN, F16, NS, OFS, 1, nr, a, w, gq, dv, mv, gs, out); \
    }
#else
#define GROUP_FN(name, NIB, HI, SGN, F16, NS, OFS) \
    static void name(int ng, int nr, const Acts *ap, int r0, const uint8_t *w, int64_t gq, const void *dv, \
                     const void *mv, int64_t gs, float out[RT][NGMAX * KVQ_NC]) { \
        const Acts a = acts_row(*ap, r0); \
        (void)ng, (void)gq, (void)gs; /* one group a tile */ \
        if (nr == 1) /* a decode: the row loop folds away */ \
            group(NIB, HI, SGN, F16, NS, OFS, 1, a, w, dv, mv, out); \
        else if (nr == RT) /* a whole tile */ \
            group(NIB, HI, SGN, F16, NS, OFS, RT, a, w, dv, mv, out); \
        else \
            group(NIB, HI, SGN, F16, NS, OFS, nr, a, w, dv, mv, out); \
    }
#endif
GROUP_FN(g_q4_f16, 1, 0, 0, 1, 1, 0)
GROUP_FN(g_q4_f32, 1, 0, 0, 0, 1, 0)
GROUP_FN(g_s8_f16, 0, 0, 1, 1, 1, 0)
GROUP_FN(g_s8_f32_16, 0, 0, 1, 0, 2, 0)
GROUP_FN(g_u8_f16, 0, 0, 0, 1, 1, 0)
GROUP_FN(g_u8_f32, 0, 0, 0, 0, 1, 0)
GROUP_FN(g_u8_f32_16, 0, 0, 0, 0, 2, 0)
GROUP_FN(g_q5_f16, 1, 1, 0, 1, 1, 0)
GROUP_FN(g_q5_f32, 1, 1, 0, 0, 1, 0)
GROUP_FN(g_q4o_f16, 1, 0, 0, 1, 1, 8)
GROUP_FN(g_q5o_f16, 1, 1, 0, 1, 1, 16)
GROUP_FN(g_mx4_f16, 2, 0, 0, 1, 1, KVQ_MX4_OFS) /* NIB 2: the nibbles are codes (KVQ_MX4_U) */
/* The K-quant formats: their own order (above). */
#if ISA == 3
#define KS_FN(name, HI, KS) \
    static void name(int ng, int nr, const Acts *ap, int r0, const uint8_t *w, int64_t gq, const void *dv, \
                     const void *mv, int64_t gs, float out[RT][NGMAX * KVQ_NC]) { \
        const Acts a = acts_row(*ap, r0); \
        (void)mv; \
        if (nr <= 2) /* a decode, or two rows: each as a decode, a group's weights read again from cache */ \
            for (int g = 0; g < ng; g++) \
                for (int r = 0; r < nr; r++) \
                    ks_row1(HI, KS, acts_row(a, r), w + g * gq, (const uint8_t *)dv + g * gs, out[r] + KVQ_NC * g); \
        else if (ng == 2 && nr == RT) \
            ks_tile(HI, KS, 2, RT, a, w, gq, (const uint8_t *)dv, gs, out); \
        else if (ng == 2) \
            ks_tile(HI, KS, 2, nr, a, w, gq, (const uint8_t *)dv, gs, out); \
        else \
            ks_tile(HI, KS, 1, nr, a, w, gq, (const uint8_t *)dv, gs, out); \
    }
#else
#define KS_FN(name, HI, KS) \
    static void name(int ng, int nr, const Acts *ap, int r0, const uint8_t *w, int64_t gq, const void *dv, \
                     const void *mv, int64_t gs, float out[RT][NGMAX * KVQ_NC]) { \
        const Acts a = acts_row(*ap, r0); \
        (void)ng, (void)gq, (void)gs, (void)mv; /* one group a tile */ \
        if (nr == 1) \
            ks_group(HI, KS, 1, a, w, (const uint8_t *)dv, out); \
        else if (nr == RT) \
            ks_group(HI, KS, RT, a, w, (const uint8_t *)dv, out); \
        else \
            ks_group(HI, KS, nr, a, w, (const uint8_t *)dv, out); \
    }
#endif
KS_FN(g_q4_ks, 0, 1)
KS_FN(g_q5_ks, 1, 1)
KS_FN(g_q6_ks, 2, 2)
KS_FN(g_q2_ks, 0, 3)
KS_FN(g_q4_ksw, 0, KVQ_KS_WIDE)
KS_FN(g_q5_ksw, 1, KVQ_KS_WIDE)
typedef void (*GroupFn)(int, int, const Acts *, int, const uint8_t *, int64_t, const void *, const void *, int64_t,
                        float[RT][NGMAX * KVQ_NC]);
static const GroupFn GROUPS[KVQ_NFMT] = {g_q4_f16, g_q4_f32, g_s8_f16, g_s8_f32_16, g_u8_f16, g_u8_f32, g_u8_f32_16,
                                         g_q5_f16, g_q5_f32, g_q4o_f16, g_q5o_f16, g_q4_ks, g_q5_ks,
                                         g_q6_ks, g_q2_ks, g_mx4_f16};

/* nr rows of cols products (res, rows ldr apart) into y: y (+)= res * rscale + bias, each element's
 * steps in this order (every product kernel ends here, so they round alike). */
KV_HIDDEN void mm_store(int nr, int cols, const float *res, int ldr, const float *rscale, const float *bias, float *y,
                        int64_t ldy, int accumulate) {
    for (int i = 0; i < nr; i++) {
        float *yr = y + (int64_t)i * ldy;
        const float rs = rscale ? rscale[i] : 1.f;
        for (int c = 0; c < cols; c++) {
            const float v = res[(int64_t)i * ldr + c] * rs + (bias ? bias[c] : 0.f);
            yr[c] = accumulate ? yr[c] + v : v;
        }
    }
}

KV_HIDDEN TileGroupFn mm_tiles = NULL;
KV_HIDDEN TileActsFn mm_tile_acts = NULL;

#define WIDE_SB 96 /* super-blocks of widened scales at most (K <= 24576), 60 KiB of stack */

/* Column groups NGMAX t .. (the tile column t) of rows r0 .. r1 - 1: y (+)= products * rscale + bias. */
KV_HIDDEN void mm_group(const QW *wt, int t, int r0, int r1, const Scratch *s, const float *bias,
                        const float *rscale, float *y, int64_t ldy, int accumulate) {
    const int K = wt->K, nb = K / 32, qb = kvq_qbytes(wt->fmt), g = NGMAX * t;
    const int G = (wt->out + KVQ_NC - 1) / KVQ_NC, ng = G - g < NGMAX ? G - g : NGMAX;
    const int64_t gq = (int64_t)nb * qb, sc = g * kvq_group_scale_bytes(wt->fmt, nb);
    int64_t gs = kvq_group_scale_bytes(wt->fmt, nb);
    const uint8_t *w = wt->qs + g * gq;
    const void *dv = (const char *)wt->d + sc, *mv = wt->m ? (const char *)wt->m + sc : NULL;
    const int c0 = KVQ_NC * g, cols = wt->out - c0 < KVQ_NC * ng ? wt->out - c0 : KVQ_NC * ng;
    if (mm_tiles) {
        r0 += mm_tiles(wt, t, r0, r1, s, bias, rscale, y, ldy, accumulate);
        if (r0 >= r1) return;
    }
    GroupFn fn = GROUPS[wt->fmt];
    /* kind 1's packed scales widened once for all the row tiles of these columns (qformat.h's kind
     * 4), not unpacked again in each tile */
    uint8_t wide[NGMAX * WIDE_SB * 320] __attribute__((aligned(64)));
    if (KVQ_KS[wt->fmt] == 1 && r1 - r0 > RT && nb / 8 <= WIDE_SB) {
        const int nsb = nb / 8;
        for (int gi = 0; gi < ng; gi++)
            for (int sb = 0; sb < nsb; sb++)
                kvq_ks1_widen((const uint8_t *)dv + gi * gs + (int64_t)sb * kvq_ksb(1),
                              wide + ((int64_t)gi * nsb + sb) * kvq_ksb(KVQ_KS_WIDE));
        dv = wide;
        gs = (int64_t)nsb * kvq_ksb(KVQ_KS_WIDE);
        fn = KVQ_HIGH[wt->fmt] ? g_q5_ksw : g_q4_ksw;
    }
    const Acts a0 = {s->q, s->da, s->sa, s->is, K, nb, s->kq, s->dk, s->k16, s->k32}; /* by address: a copy
                                                   made for each call cost ~5% of a prefill on a Zen4 */
    for (int r = r0; r < r1; r += RT) {
        const int nr = r1 - r < RT ? r1 - r : RT;
        float res[RT][NGMAX * KVQ_NC];
        fn(ng, nr, &a0, r, w, gq, dv, mv, gs, res);
        mm_store(nr, cols, res[0], NGMAX * KVQ_NC, rscale ? rscale + r : NULL, bias ? bias + c0 : NULL,
                 y + (int64_t)r * ldy + c0, ldy, accumulate);
    }
}

KV_HIDDEN int qw_valid(const QW *w) {
    return w->fmt >= 0 && w->fmt < KVQ_NFMT && w->K >= 32 && w->K % 32 == 0 && w->out >= 1 &&
           (KVQ_SIGNED[w->fmt] || KVQ_OFFSET[w->fmt] || KVQ_KS[w->fmt] || w->m != NULL) &&
           (!KVQ_KS[w->fmt] || w->K % 256 == 0);
}

/* whole row tiles of the tile order's copy (Scratch's kt) of n rows and its alignment, where it can be made */
static size_t kt_bytes(int n, int K) { return n >= 16 && K % 256 == 0 ? (size_t)(n + 15) / 16 * 16 * K + 64 : 0; }

KV_HIDDEN size_t scratch_bytes(int n, int K) {
    const size_t q = ((size_t)n * K + 63) & ~(size_t)63, nb = (size_t)n * (K / 32);
    return 2 * q + kt_bytes(n, K) + nb * (4 * sizeof(float) + 2 * sizeof(int32_t)) + /* both orders' values; the blocks' */
           (size_t)n * (K / 256) * sizeof(float) + ((size_t)n * (K / 16) + nb) * sizeof(int16_t) + /* super-blocks' */
           (size_t)n * sizeof(float) + 64;
}

/* The calling thread's scratch memory, kept from call to call: each chunk of a prefill (tens of MiB
 * at 1B) would otherwise map fresh pages and fault them in again (measured: ~4% of a 1B prefill's
 * time in page faults and page clearing). kv_scratch_release gives it back (the engine calls it
 * once idle, and after an offline generate). Calls do not nest: each exported entry point takes it
 * once. Returns NULL when the memory cannot be had. */
static __thread char *tl_buf;
static __thread size_t tl_cap;
/* the key whose destructor frees a thread's kept memory when the thread ends */
static pthread_key_t tl_key;
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;
static void tl_make_key(void) { pthread_key_create(&tl_key, free); }

/* p as the calling thread's kept memory */
static void tl_keep(void *p) {
    pthread_once(&tl_once, tl_make_key);
    pthread_setspecific(tl_key, p);
}

KV_HIDDEN char *scratch_take(size_t n) {
    if (n > tl_cap) {
        free(tl_buf);
        tl_cap = n + n / 8; /* some room: chunk sizes vary from step to step */
        tl_buf = malloc(tl_cap);
        if (tl_buf == NULL) tl_cap = 0;
        tl_keep(tl_buf);
    }
    return tl_buf;
}

/* Frees the calling thread's scratch memory (the next call allocates it again). */
void kv_scratch_release(void) {
    free(tl_buf);
    tl_buf = NULL;
    tl_cap = 0;
    tl_keep(NULL);
}

KV_HIDDEN Scratch scratch_at(char *p, int n, int K) {
    Scratch s;
    const size_t q = ((size_t)n * K + 63) & ~(size_t)63, nb = (size_t)n * (K / 32);
    s.q = (int8_t *)p;
    s.kq = (int8_t *)(p + q);
    s.da = (float *)(p + 2 * q);
    s.sa = s.da + nb;
    s.is = (int32_t *)(s.sa + 3 * nb);
    s.dk = (float *)(s.is + 2 * nb);
    s.inv = s.dk + (size_t)n * (K / 256);
    s.k16 = (int16_t *)(s.inv + n);
    s.k32 = s.k16 + (size_t)n * (K / 16);
    /* after the rest, 64-byte aligned: the int16 sums end on an even address */
    s.kt = kt_bytes(n, K) && mm_tile_acts && mm_tile_acts(n)
               ? (int8_t *)(((uintptr_t)(s.k32 + (size_t)n * (K / 32)) + 63) & ~(uintptr_t)63)
               : NULL;
    s.need = ACT_BLOCK | ACT_SUPER;
    return s;
}

KV_HIDDEN int proj_acts(const QProj *w) {
    int need = 0;
    for (int i = 0; i < w->n; i++) need |= KVQ_KS[w->p[i].fmt] ? ACT_SUPER : ACT_BLOCK;
    return need;
}

/* y (+)= (x * g) @ W^T * rscale + bias, where rscale is 1 / rms(x) when eps >= 0 (an RMSNorm whose
 * weight g the caller folded in) and 1 otherwise.
 * Returns 0, 1 for bad arguments, 4 when scratch memory cannot be had. */
int kv_q_linear(int fmt, int n, int K, int out, const float *x, int64_t ldx, const float *g, float eps,
                const uint8_t *qs, const void *d, const void *m, const float *bias, float *y, int64_t ldy,
                int accumulate, int n_threads) {
    const QW wt = {fmt, out, K, qs, d, m};
    if (n < 1 || !qw_valid(&wt) || ldx < K || ldy < out) return 1;
    char *buf = scratch_take(scratch_bytes(n, K));
    if (buf == NULL) return 4;
    Scratch a = scratch_at(buf, n, K);
    const QProj p = qproj1(&wt);
    a.need = proj_acts(&p);
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) act_row(&a, r, K, x, ldx, g, eps);
        mm_rows(&wt, n, &a, bias, eps >= 0.f ? a.inv : NULL, y, ldy, accumulate);
    }
    return 0;
}

/* x += rms_norm(y) * w for one row of H values (a post-norm before the residual). */
KV_HIDDEN void add_normed(int H, const float *y, const float *w, float eps, float *x) {
    const float inv = 1.f / sqrtf(kv_dot(y, y, H) / (float)H + eps);
    for (int k = 0; k < H; k++) x[k] += y[k] * inv * w[k];
}

KV_HIDDEN QProj qproj1(const QW *w) {
    QProj p = {1, w->out, w->K, {*w}, {0}};
    return p;
}

KV_HIDDEN int qproj_valid(const QProj *w) {
    if (w->n < 1 || w->n > KV_MAXPARTS) return 0;
    int at = 0;
    for (int i = 0; i < w->n; i++) {
        if (!qw_valid(&w->p[i]) || w->p[i].K != w->K || w->off[i] != at) return 0;
        at += w->p[i].out;
    }
    return at == w->out;
}

KV_HIDDEN QProj proj_of(const int64_t *f, int K) {
    QProj w = {0};
    if (f[KVP_PARTS] < 1 || f[KVP_PARTS] > KV_MAXPARTS) return w;
    w.n = (int)f[KVP_PARTS], w.K = K;
    for (int i = 0; i < w.n; i++) {
        const int64_t *q = f + KVP_PART + 5 * i;
        w.p[i] = (QW){(int)q[0], (int)q[4], K, (const uint8_t *)(intptr_t)q[1], (const void *)(intptr_t)q[2],
                      (const void *)(intptr_t)q[3]};
        w.off[i] = w.out;
        w.out += (int)q[4];
    }
    return w;
}

KV_HIDDEN const float *proj_bias(const int64_t *f) { return (const float *)(intptr_t)f[KVP_BIAS]; }

KV_HIDDEN int proj_tiles(const QProj *w) {
    int T = 0;
    for (int i = 0; i < w->n; i++) T += (w->p[i].out + NGMAX * KVQ_NC - 1) / (NGMAX * KVQ_NC);
    return T;
}

KV_HIDDEN void proj_tile(const QProj *w, int t, int r0, int r1, const Scratch *s, const float *bias,
                         const float *rscale, float *y, int64_t ldy, int accumulate) {
    int i = 0;
    for (int tiles; i + 1 < w->n && t >= (tiles = (w->p[i].out + NGMAX * KVQ_NC - 1) / (NGMAX * KVQ_NC)); i++)
        t -= tiles;
    const int o = w->off[i];
    mm_group(&w->p[i], t, r0, r1, s, bias ? bias + o : NULL, rscale, y + o, ldy, accumulate);
}

KV_HIDDEN void mm_proj(const QProj *w, int n, const Scratch *s, const float *bias, const float *rscale, float *y,
                       int64_t ldy, int accumulate) {
    const int T = proj_tiles(w);
    for (int r0 = 0; r0 < n; r0 += RCHUNK) {
        const int r1 = n - r0 < RCHUNK ? n : r0 + RCHUNK;
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) proj_tile(w, t, r0, r1, s, bias, rscale, y, ldy, accumulate);
    }
}

KV_HIDDEN void mm_rows(const QW *wt, int n, const Scratch *s, const float *bias, const float *rscale, float *y,
                       int64_t ldy, int accumulate) {
    const QProj p = qproj1(wt);
    mm_proj(&p, n, s, bias, rscale, y, ldy, accumulate);
}

KV_HIDDEN void mm_residual(const QW *wt, int n, const Scratch *s, const float *bias, float *x, int64_t ldx, float *y,
                           const float *post_w, float post_eps) {
    if (!post_w) {
        mm_rows(wt, n, s, bias, NULL, x, ldx, 1);
        return;
    }
    const int H = wt->out;
    mm_rows(wt, n, s, bias, NULL, y, H, 0);
#pragma omp for schedule(static)
    for (int r = 0; r < n; r++) add_normed(H, y + (size_t)r * H, post_w, post_eps, x + (int64_t)r * ldx);
}

/* act(gate) * up for one row of [gate | up] (I each, a multiple of VL): silu (act 0), the tanh
 * GELU (1), or gpt-oss's clamped SwiGLU (2: g = min(gate, 7), u = up clamped to +/- 7, then
 * g * sigmoid(1.702 g) * (u + 1), the constants llama.cpp's gpt-oss takes), each from exp of
 * non-positive numbers (vmath.h), written over the gate half. */
KV_HIDDEN void glu_row(int act, int I, float *h) {
    const vec lim = (vec){0} + 7.f;
    for (int i = 0; i < I; i += VL) {
        const vec x = *(const vec *)(h + i), up = *(const vec *)(h + I + i);
        vec a;
        if (act == 0) {
            const vec e = vexp(-vabs(x)), s = 1.f / (1.f + e);
            a = x * vsel(x >= 0.f, s, e * s);
        } else if (act == 2) {
            const vec g = vsel(x < lim, x, lim), u0 = vsel(up < lim, up, lim), u = vsel(u0 > -lim, u0, -lim);
            const vec z = 1.702f * g, e = vexp(-vabs(z)), s = 1.f / (1.f + e);
            *(vec *)(h + i) = (g * vsel(z >= 0.f, s, e * s)) * (u + 1.f);
            continue;
        } else {
            const vec z = 0.7978845608f * (x + 0.044715f * x * x * x);
            const vec e = vexp(-2.f * vabs(z)), t = (1.f - e) / (1.f + e);
            a = 0.5f * x * (1.f + vsel(z >= 0.f, t, -t));
        }
        *(vec *)(h + i) = a * up;
    }
}

/* The scratch a gated MLP of n rows needs (kv_q_mlp, kv_q_layers), and its parts laid out in buf. */
KV_HIDDEN size_t mlp_bytes(int n, int H, int I, int post) {
    return scratch_bytes(n, H) + scratch_bytes(n, I) + (size_t)n * 2 * I * sizeof(float) +
           (post ? (size_t)n * H * sizeof(float) : 0) + 64;
}

KV_HIDDEN Mlp mlp_at(char *buf, int n, int H, int I, const QProj *gu, const QW *dn, const float *g_in, float eps,
                     const float *gu_b, const float *dn_b, int act, const float *post_w, float post_eps) {
    const size_t s1 = scratch_bytes(n, H), s2 = scratch_bytes(n, I);
    Mlp m = {*gu, *dn, n, H, I, act, g_in, eps, gu_b, dn_b, post_w, post_eps, scratch_at(buf, n, H),
             scratch_at(buf + s1, n, I), NULL, NULL};
    const QProj d = qproj1(dn);
    m.a.need = proj_acts(gu), m.b.need = proj_acts(&d);
    m.h = (float *)(buf + ((s1 + s2 + 63) & ~(size_t)63));
    m.y = post_w ? m.h + (size_t)n * 2 * I : NULL;
    return m;
}

KV_HIDDEN void mlp_in_region(const Mlp *m, float *x, int64_t ldx) {
    const int n = m->n, H = m->H, I = m->I;
#pragma omp for schedule(static)
    for (int r = 0; r < n; r++) act_row(&m->a, r, H, x, ldx, m->g_in, m->eps);
    mm_proj(&m->gu, n, &m->a, m->gu_b, m->eps >= 0.f ? m->a.inv : NULL, m->h, 2 * I, 0);
#pragma omp for schedule(static)
    for (int r = 0; r < n; r++) { /* act(gate) * up into the gate half, then its int8 activations */
        float *hr = m->h + (size_t)r * 2 * I;
        glu_row(m->act, I, hr);
        act_row(&m->b, r, I, m->h, 2 * I, NULL, -1.f);
    }
    mm_residual(&m->dn, n, &m->b, m->dn_b, x, ldx, m->y, m->post_w, m->post_eps);
}

KV_HIDDEN int mlp_valid(const QProj *gu, const QW *dn, int H, int I, int act) {
    return qproj_valid(gu) && qw_valid(dn) && gu->K == H && gu->out == 2 * I && dn->K == I && dn->out == H &&
           act >= 0 && act <= 2 && I % VL == 0;
}

/* One expert of a mixture in one call: y = down(act(gate) * up), [gate | up] = the gate_up projection
 * of x as it is (no norm: the rows come normed). x [n, H] rows ldx apart, y [n, H] overwritten. The
 * steps of kv_q_mlp in its order, each row's alone: a row's y is the same bits among any rows.
 * Returns 0, 1 for bad arguments, 4 when scratch memory cannot be had. */
int kv_q_expert(int n, int H, int I, const float *x, int64_t ldx, const int64_t *gu, const int64_t *dn, int act,
                float *y, int n_threads) {
    const QProj g = proj_of(gu, H), d = proj_of(dn, I);
    if (n < 1 || d.n != 1 || !mlp_valid(&g, &d.p[0], H, I, act) || ldx < H || n_threads < 1) return 1;
    char *buf = scratch_take(mlp_bytes(n, H, I, 0));
    if (buf == NULL) return 4;
    const Mlp m = mlp_at(buf, n, H, I, &g, &d.p[0], NULL, -1.f, proj_bias(gu), proj_bias(dn), act, NULL, 0.f);
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) act_row(&m.a, r, H, x, ldx, NULL, -1.f);
        mm_proj(&m.gu, n, &m.a, m.gu_b, NULL, m.h, 2 * I, 0);
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) {
            float *hr = m.h + (size_t)r * 2 * I;
            glu_row(m.act, I, hr);
            act_row(&m.b, r, I, m.h, 2 * I, NULL, -1.f);
        }
        mm_rows(&m.dn, n, &m.b, m.dn_b, NULL, y, H, 0);
    }
    return 0;
}

/* A gated MLP in one call: x (+)= post_norm(down(act(gate) * up)), where [gate | up] = the gate_up
 * projection of (x * g_in / rms(x)) (eps >= 0; a folded RMSNorm) and post_norm is an RMSNorm with
 * weight post_w (Gemma 3's post-feedforward norm) or nothing (post_w NULL). x [n, H], rows ldx apart;
 * gu and dn: the projections' fields (qgemm.h's KVP_; down in one part).
 * Returns 0, 1 for bad arguments, 4 when scratch memory cannot be had. */
int kv_q_mlp(int n, int H, int I, float *x, int64_t ldx, const float *g_in, float eps, const int64_t *gu,
             const int64_t *dn, int act, const float *post_w, float post_eps, int n_threads) {
    const QProj g = proj_of(gu, H), d = proj_of(dn, I);
    if (n < 1 || d.n != 1 || !mlp_valid(&g, &d.p[0], H, I, act) || ldx < H || n_threads < 1) return 1;
    char *buf = scratch_take(mlp_bytes(n, H, I, post_w != NULL));
    if (buf == NULL) return 4;
    const Mlp m = mlp_at(buf, n, H, I, &g, &d.p[0], g_in, eps, proj_bias(gu), proj_bias(dn), act, post_w, post_eps);
#pragma omp parallel num_threads(n_threads)
    mlp_in_region(&m, x, ldx);
    return 0;
}
