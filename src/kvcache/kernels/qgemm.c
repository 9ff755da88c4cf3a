/* Quantized projections: y = x @ W^T (+ bias) for a weight in one of kvcache's repacked formats
 * (qformat.h), for one row (decode) and for many (prefill, batched decode, extends).
 *
 * kv_q_act quantizes the activations per block of 32 to int8 (scale amax / 127, and d * sum of
 * each 16-half for the minimums); with a norm weight it multiplies the input by it first, and it
 * returns 1 / rms(x) per row so that an RMSNorm before the projection is folded in: the products
 * are scale-free per block, and the caller's row scale multiplies the result.
 *
 * kv_q_matmul: work items are groups of 8 output columns; each unpacks a block of its integer
 * weights into four registers once and multiplies them by RT rows of activations with integer
 * dot products, then scales per block:
 *   AVX512-VNNI  vpdpbusd on 64 bytes (8 columns x 8 inputs); signed weights are offset by 128 and
 *                the offset taken back through the block sums
 *   AVX-VNNI     the same on 32 bytes (4 columns), two halves per group
 *   AVX2         vpmaddubsw + vpmaddwd; signed weights through the sign trick
 *   generic      plain C over the same layout (other CPUs)
 * Rows go in chunks of RCHUNK so a chunk's activations stay in cache while every group passes.
 * Which of these a build holds depends on its compile flags; kernels/__init__.py builds one
 * library per variant and loads the best one the CPU can run.
 *
 * Layouts: x [n, K] float, rows ldx apart; q [n, K] int8; da [n, K/32], sa [n, K/16] float;
 * qs, d, m as qformat.h; bias [out] float or NULL; rscale [n] or NULL; y [n, out], rows ldy apart.
 */
#include "qformat.h"
#include "qgemm.h"
#include "vmath.h"

#include <math.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ISA 3
#define RT 8
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA 2
#define RT 4
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA 1
#define RT 4
#else
#define ISA 0
#define RT 4
#endif
/* software prefetch distance in bytes of weights: the hardware's own prefetchers alone left the
 * products well short of the memory's bandwidth (measured: 29 -> 38 GB/s for Q4_1, 38 -> 41+ for
 * Q8_0 with one call over 70-120 MB) */
#define PF 3072

const char *kv_q_isa(void) {
    static const char *names[] = {"generic", "avx2", "avxvnni", "avx512vnni"};
    return names[ISA];
}

/* -- activations -------------------------------------------------------------------------------- */
/* Lane-wise select and the horizontal reductions the loops below need. */
static inline vec vsel(ivec m, vec a, vec b) { return (vec)(((ivec)a & m) | ((ivec)b & ~m)); }
static inline vec vabs(vec a) { return (vec)((ivec)a & 0x7fffffff); }

/* One row: inv[r] = 1 / rms (eps >= 0) or 1; q, da, sa of (x * g) per block of 32, each value
 * rounded to the nearest step (halves away from zero). */
KV_HIDDEN void act_row(int r, int K, const float *x, int64_t ldx, const float *g, float eps, int8_t *q, float *da,
                    float *sa, float *inv) {
    const int nb = K / 32, nv = 32 / VL;
    const float *xr = x + (int64_t)r * ldx;
    if (eps >= 0.f) {
        vec acc = {0};
        for (int k = 0; k < K; k += VL) acc += *(const vec *)(xr + k) * *(const vec *)(xr + k);
        float ss = 0.f;
        for (int l = 0; l < VL; l++) ss += acc[l];
        inv[r] = 1.f / sqrtf(ss / (float)K + eps);
    } else {
        inv[r] = 1.f;
    }
    for (int b = 0; b < nb; b++) {
        vec v[32 / VL], m = {0};
        for (int j = 0; j < nv; j++) {
            v[j] = *(const vec *)(xr + 32 * b + VL * j);
            if (g) v[j] *= *(const vec *)(g + 32 * b + VL * j);
            const vec a = vabs(v[j]);
            m = vsel(a > m, a, m);
        }
        float amax = 0.f;
        for (int l = 0; l < VL; l++) amax = m[l] > amax ? m[l] : amax;
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int s[2] = {0, 0};
        int8_t *qb = q + (int64_t)r * K + 32 * b;
        for (int j = 0; j < nv; j++) {
            const vec t = v[j] * id;
            const vec half = (vec)(((ivec)t & (int32_t)0x80000000) | (ivec)((vec){0} + 0.5f));
            ivec qi = __builtin_convertvector(t + half, ivec); /* |t| <= 127 by construction */
            qi = (qi & (qi <= 127)) | (127 & ~(qi <= 127));
            qi = (qi & (qi >= -127)) | (-127 & ~(qi >= -127));
            for (int l = 0; l < VL; l++) {
                qb[VL * j + l] = (int8_t)qi[l];
                s[(VL * j + l) >> 4] += qi[l];
            }
        }
        da[(int64_t)r * nb + b] = d;
        sa[(int64_t)r * 2 * nb + 2 * b] = d * (float)s[0];
        sa[(int64_t)r * 2 * nb + 2 * b + 1] = d * (float)s[1];
    }
}

int kv_q_act(int n, int K, const float *x, int64_t ldx, const float *g, float eps, int8_t *q, float *da,
             float *sa, float *inv, int n_threads) {
    if (n < 1 || K < 32 || K % 32 || ldx < K) return 1;
#pragma omp parallel for schedule(static) num_threads(n_threads) if (n > 8)
    for (int r = 0; r < n; r++) act_row(r, K, x, ldx, g, eps, q, da, sa, inv);
    return 0;
}

/* -- one group of 8 columns x up to RT rows ------------------------------------------------------ */
typedef struct {
    const int8_t *q;
    const float *da, *sa;
    int K, nb;
} Acts;

static inline float scale_at(const int F16, const void *p, int64_t i) {
    return F16 ? kvq_h2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if ISA == 3
static inline __attribute__((always_inline)) void group(const int NIB, const int HI, const int SGN, const int F16,
                                                        const int NS, const int OFS, int nr, Acts a, const uint8_t *w,
                                                        const void *dv, const void *mv, float out[RT][8]) {
    __m512 acc[RT];
    __m256 accm[RT];
    for (int r = 0; r < RT; r++) {
        acc[r] = _mm512_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    const __m512i lo4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const int qb = NIB ? (HI ? 160 : 128) : 256;
    for (int b = 0; b < a.nb; b++) {
        const uint8_t *wb = w + (int64_t)b * qb;
        for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(wb + PF + l), _MM_HINT_T0);
        __m512i w0, w1, w2, w3;
        if (NIB) {
            const __m512i v0 = _mm512_loadu_si512(wb), v1 = _mm512_loadu_si512(wb + 64);
            w0 = _mm512_and_si512(v0, lo4);
            w1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), lo4);
            w2 = _mm512_and_si512(v1, lo4);
            w3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), lo4);
            if (HI) { /* the fifth bits: one mask bit per byte lane, 0x10 where set */
                uint64_t hm[4];
                memcpy(hm, wb + 128, 32);
                const __m512i b4 = _mm512_set1_epi8(0x10);
                w0 = _mm512_or_si512(w0, _mm512_maskz_mov_epi8(hm[0], b4));
                w1 = _mm512_or_si512(w1, _mm512_maskz_mov_epi8(hm[1], b4));
                w2 = _mm512_or_si512(w2, _mm512_maskz_mov_epi8(hm[2], b4));
                w3 = _mm512_or_si512(w3, _mm512_maskz_mov_epi8(hm[3], b4));
            }
        } else {
            w0 = _mm512_loadu_si512(wb);
            w1 = _mm512_loadu_si512(wb + 64);
            w2 = _mm512_loadu_si512(wb + 128);
            w3 = _mm512_loadu_si512(wb + 192);
            if (SGN) {
                w0 = _mm512_xor_si512(w0, flip);
                w1 = _mm512_xor_si512(w1, flip);
                w2 = _mm512_xor_si512(w2, flip);
                w3 = _mm512_xor_si512(w3, flip);
            }
        }
        __m256 ds[2], ms[2];
        __m512 dd[2];
        for (int h = 0; h < NS; h++) {
            const int64_t at = ((int64_t)b * NS + h) * 8;
            ds[h] = F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)dv + at)))
                        : _mm256_loadu_ps((const float *)dv + at);
            dd[h] = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(ds[h]));
            if (!SGN && !OFS)
                ms[h] = F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)mv + at)))
                            : _mm256_loadu_ps((const float *)mv + at);
        }
        for (int r = 0; r < RT; r++) {
            if (r < nr) {
                const int8_t *ar = a.q + (int64_t)r * a.K + 32 * b;
                int64_t t[4];
                memcpy(t, ar, 32);
                const __m512i a0 = _mm512_set1_epi64(t[0]), a1 = _mm512_set1_epi64(t[1]);
                const __m512i a2 = _mm512_set1_epi64(t[2]), a3 = _mm512_set1_epi64(t[3]);
                const __m512 sda = _mm512_set1_ps(a.da[(int64_t)r * a.nb + b]);
                const float s0 = a.sa[(int64_t)r * 2 * a.nb + 2 * b], s1 = a.sa[(int64_t)r * 2 * a.nb + 2 * b + 1];
                if (NS == 1) { /* two short chains of dot products rather than one long one */
                    const __m512i s = _mm512_add_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w0, a0), w1, a1),
                                                       _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w2, a2), w3, a3));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dd[0], sda), acc[r]);
                    if (SGN) accm[r] = _mm256_fnmadd_ps(ds[0], _mm256_set1_ps(128.f * (s0 + s1)), accm[r]);
                    else if (OFS) accm[r] = _mm256_fnmadd_ps(ds[0], _mm256_set1_ps((float)OFS * (s0 + s1)), accm[r]);
                    else accm[r] = _mm256_fmadd_ps(ms[0], _mm256_set1_ps(s0 + s1), accm[r]);
                } else {
                    const __m512i t0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w0, a0), w1, a1);
                    const __m512i t1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w2, a2), w3, a3);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t0), _mm512_mul_ps(dd[0], sda), acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t1), _mm512_mul_ps(dd[1], sda), acc[r]);
                    if (SGN || OFS) {
                        const float o = SGN ? 128.f : (float)OFS;
                        accm[r] = _mm256_fnmadd_ps(ds[0], _mm256_set1_ps(o * s0), accm[r]);
                        accm[r] = _mm256_fnmadd_ps(ds[1], _mm256_set1_ps(o * s1), accm[r]);
                    } else {
                        accm[r] = _mm256_fmadd_ps(ms[0], _mm256_set1_ps(s0), accm[r]);
                        accm[r] = _mm256_fmadd_ps(ms[1], _mm256_set1_ps(s1), accm[r]);
                    }
                }
            }
        }
    }
    const __m512i even = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int r = 0; r < nr; r++) {
        const __m256 e = _mm512_castps512_ps256(_mm512_permutexvar_ps(even, acc[r]));
        const __m256 o = _mm512_castps512_ps256(_mm512_permutexvar_ps(odd, acc[r]));
        _mm256_storeu_ps(out[r], _mm256_add_ps(_mm256_add_ps(e, o), accm[r]));
    }
}

#elif ISA == 1 || ISA == 2
/* Products of 32 weight bytes (4 columns x 8 inputs, u8 or, with SGN, s8) and 8 activation bytes
 * repeated: 8 int32 lanes, two per column. */
static inline __attribute__((always_inline)) __m256i dot4(const int SGN, __m256i w, __m256i x) {
#if ISA == 2
    (void)SGN; /* signed weights arrive offset by 128 */
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (SGN) return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
#endif
}

/* 32 mask bits -> 32 bytes, 0x10 where the bit is set (bit j of the mask -> byte j) */
static inline __m256i fifth_bits(uint32_t m) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                          3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), shuf);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, sel), sel), _mm256_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) void half(const int NIB, const int HI, const int SGN, const int F16,
                                                       const int NS, const int OFS, int hf, int nr, Acts a,
                                                       const uint8_t *w,
                                                       const void *dv, const void *mv, float out[RT][8]) {
    __m256 acc[RT];
    __m128 accm[RT];
    for (int r = 0; r < RT; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm_setzero_ps();
    }
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const __m256i dup = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    const int qb = NIB ? (HI ? 160 : 128) : 256;
    /* AVX-VNNI takes signed weights offset by 128 (u8) and the offset back through the sums */
    const int OFF = SGN && ISA == 2;
    for (int b = 0; b < a.nb; b++) {
        const uint8_t *wb = w + (int64_t)b * qb + 32 * hf;
        if (hf == 0) /* the second half reads what the first brought into cache */
            for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(wb + PF + l), _MM_HINT_T0);
        __m256i wv[4];
        if (NIB) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)wb), v1 = _mm256_loadu_si256((const __m256i *)(wb + 64));
            wv[0] = _mm256_and_si256(v0, lo4);
            wv[1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4);
            wv[2] = _mm256_and_si256(v1, lo4);
            wv[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4);
            if (HI) {
                uint64_t hm[4];
                memcpy(hm, w + (int64_t)b * qb + 128, 32);
                for (int st = 0; st < 4; st++) wv[st] = _mm256_or_si256(wv[st], fifth_bits((uint32_t)(hm[st] >> (32 * hf))));
            }
        } else {
            for (int s = 0; s < 4; s++) {
                wv[s] = _mm256_loadu_si256((const __m256i *)(wb + 64 * s));
                if (OFF) wv[s] = _mm256_xor_si256(wv[s], _mm256_set1_epi8((char)0x80));
            }
        }
        __m128 ds[2], ms[2];
        __m256 dd[2];
        for (int h = 0; h < NS; h++) {
            const int64_t at = ((int64_t)b * NS + h) * 8 + 4 * hf;
            ds[h] = F16 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)dv + at)))
                        : _mm_loadu_ps((const float *)dv + at);
            dd[h] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ds[h]), dup);
            if (!SGN && !OFS)
                ms[h] = F16 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)mv + at)))
                            : _mm_loadu_ps((const float *)mv + at);
        }
        for (int r = 0; r < RT; r++) {
            if (r < nr) {
                const int8_t *ar = a.q + (int64_t)r * a.K + 32 * b;
                int64_t t[4];
                memcpy(t, ar, 32);
                const __m256 sda = _mm256_set1_ps(a.da[(int64_t)r * a.nb + b]);
                const float s0 = a.sa[(int64_t)r * 2 * a.nb + 2 * b], s1 = a.sa[(int64_t)r * 2 * a.nb + 2 * b + 1];
                __m256i p[4];
                for (int s = 0; s < 4; s++) p[s] = dot4(SGN && !OFF, wv[s], _mm256_set1_epi64x(t[s]));
                if (NS == 1) {
                    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dd[0], sda), acc[r]);
                    if (OFF) accm[r] = _mm_fnmadd_ps(ds[0], _mm_set1_ps(128.f * (s0 + s1)), accm[r]);
                    else if (OFS) accm[r] = _mm_fnmadd_ps(ds[0], _mm_set1_ps((float)OFS * (s0 + s1)), accm[r]);
                    else if (!SGN) accm[r] = _mm_fmadd_ps(ms[0], _mm_set1_ps(s0 + s1), accm[r]);
                } else {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p[0], p[1])), _mm256_mul_ps(dd[0], sda), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p[2], p[3])), _mm256_mul_ps(dd[1], sda), acc[r]);
                    if (OFF || OFS) {
                        const float o = OFF ? 128.f : (float)OFS;
                        accm[r] = _mm_fnmadd_ps(ds[0], _mm_set1_ps(o * s0), accm[r]);
                        accm[r] = _mm_fnmadd_ps(ds[1], _mm_set1_ps(o * s1), accm[r]);
                    } else if (!SGN) {
                        accm[r] = _mm_fmadd_ps(ms[0], _mm_set1_ps(s0), accm[r]);
                        accm[r] = _mm_fmadd_ps(ms[1], _mm_set1_ps(s1), accm[r]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        float v[8], mm[4];
        _mm256_storeu_ps(v, acc[r]);
        _mm_storeu_ps(mm, accm[r]);
        for (int c = 0; c < 4; c++) out[r][4 * hf + c] = v[2 * c] + v[2 * c + 1] + mm[c];
    }
}

static inline __attribute__((always_inline)) void group(const int NIB, const int HI, const int SGN, const int F16,
                                                        const int NS, const int OFS, int nr, Acts a, const uint8_t *w,
                                                        const void *dv, const void *mv, float out[RT][8]) {
    half(NIB, HI, SGN, F16, NS, OFS, 0, nr, a, w, dv, mv, out);
    half(NIB, HI, SGN, F16, NS, OFS, 1, nr, a, w, dv, mv, out);
}

#else
static inline __attribute__((always_inline)) void group(const int NIB, const int HI, const int SGN, const int F16,
                                                        const int NS, const int OFS, int nr, Acts a, const uint8_t *w,
                                                        const void *dv, const void *mv, float out[RT][8]) {
    const int qb = NIB ? (HI ? 160 : 128) : 256;
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 8; c++) out[r][c] = 0.f;
    for (int b = 0; b < a.nb; b++) {
        for (int c = 0; c < 8; c++) {
            for (int r = 0; r < nr; r++) {
                const int8_t *ar = a.q + (int64_t)r * a.K + 32 * b;
                int s[2] = {0, 0};
                for (int k = 0; k < 32; k++) {
                    int high, pos = kvq_pos(NIB, c, k, &high);
                    const uint8_t byte = w[(int64_t)b * qb + pos];
                    int qv = NIB ? (high ? byte >> 4 : byte & 15) : SGN ? (int8_t)byte : byte;
                    if (HI) {
                        int bit, hp = kvq_high_pos(c, k, &bit);
                        qv |= ((w[(int64_t)b * qb + hp] >> bit) & 1) << 4;
                    }
                    s[k >> 4] += qv * ar[k];
                }
                const float dA = a.da[(int64_t)r * a.nb + b];
                for (int h = 0; h < NS; h++) {
                    const int64_t at = ((int64_t)b * NS + h) * 8 + c;
                    const float sd = scale_at(F16, dv, at);
                    const int si = NS == 1 ? s[0] + s[1] : s[h];
                    const float sumq = NS == 1 ? a.sa[(int64_t)r * 2 * a.nb + 2 * b] + a.sa[(int64_t)r * 2 * a.nb + 2 * b + 1]
                                               : a.sa[(int64_t)r * 2 * a.nb + 2 * b + h];
                    const float mn = SGN ? 0.f : OFS ? -(float)OFS * sd : scale_at(F16, mv, at);
                    out[r][c] += sd * dA * (float)si + mn * sumq;
                }
            }
        }
    }
}
#endif

/* One group of columns over rows r0 .. r0 + nr - 1 (nr <= RT) of one format. */
#define GROUP_FN(name, NIB, HI, SGN, F16, NS, OFS) \
    static void name(int nr, Acts a, const uint8_t *w, const void *dv, const void *mv, float out[RT][8]) { \
        if (nr == 1) /* a decode: the row loop folds away */ \
            group(NIB, HI, SGN, F16, NS, OFS, 1, a, w, dv, mv, out); \
        else \
            group(NIB, HI, SGN, F16, NS, OFS, nr, a, w, dv, mv, out); \
    }
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
typedef void (*GroupFn)(int, Acts, const uint8_t *, const void *, const void *, float[RT][8]);
static const GroupFn GROUPS[KVQ_NFMT] = {g_q4_f16, g_q4_f32, g_s8_f16, g_s8_f32_16, g_u8_f16, g_u8_f32, g_u8_f32_16,
                                         g_q5_f16, g_q5_f32, g_q4o_f16, g_q5o_f16};

/* Columns 8g .. 8g + 7 of rows r0 .. r1 - 1: y (+)= products * rscale + bias. */
KV_HIDDEN void mm_group(const QW *wt, int g, int r0, int r1, const int8_t *q, const float *da, const float *sa,
                     const float *bias, const float *rscale, float *y, int64_t ldy, int accumulate) {
    const int K = wt->K, nb = K / 32, qb = kvq_qbytes(wt->fmt), ns = KVQ_NS[wt->fmt];
    const size_t es = KVQ_F16[wt->fmt] ? 2 : 4;
    const uint8_t *w = wt->qs + (int64_t)g * nb * qb;
    const void *dv = (const char *)wt->d + (size_t)g * nb * ns * 8 * es;
    const void *mv = wt->m ? (const char *)wt->m + (size_t)g * nb * ns * 8 * es : NULL;
    const int cols = wt->out - 8 * g < 8 ? wt->out - 8 * g : 8;
    for (int r = r0; r < r1; r += RT) {
        const int nr = r1 - r < RT ? r1 - r : RT;
        float res[RT][8];
        Acts a = {q + (int64_t)r * K, da + (int64_t)r * nb, sa + (int64_t)r * 2 * nb, K, nb};
        GROUPS[wt->fmt](nr, a, w, dv, mv, res);
        for (int i = 0; i < nr; i++) {
            float *yr = y + (int64_t)(r + i) * ldy + 8 * g;
            const float rs = rscale ? rscale[r + i] : 1.f;
            for (int c = 0; c < cols; c++) {
                float v = res[i][c] * rs + (bias ? bias[8 * g + c] : 0.f);
                yr[c] = accumulate ? yr[c] + v : v;
            }
        }
    }
}

KV_HIDDEN int qw_valid(const QW *w) {
    return w->fmt >= 0 && w->fmt < KVQ_NFMT && w->K >= 32 && w->K % 32 == 0 && w->out >= 1 &&
           (KVQ_SIGNED[w->fmt] || KVQ_OFFSET[w->fmt] || w->m != NULL);
}

int kv_q_matmul(int fmt, int n, int K, int out, const int8_t *q, const float *da, const float *sa,
                const uint8_t *qs, const void *d, const void *m, const float *bias, const float *rscale, float *y,
                int64_t ldy, int accumulate, int n_threads) {
    const QW wt = {fmt, out, K, qs, d, m};
    if (!qw_valid(&wt) || n < 1 || ldy < out) return 1;
    const int G = (out + 7) / 8;
    for (int r0 = 0; r0 < n; r0 += RCHUNK) {
        const int r1 = n - r0 < RCHUNK ? n : r0 + RCHUNK;
#pragma omp parallel for schedule(static) num_threads(n_threads) if (G > 1)
        for (int g = 0; g < G; g++) mm_group(&wt, g, r0, r1, q, da, sa, bias, rscale, y, ldy, accumulate);
    }
    return 0;
}

KV_HIDDEN size_t scratch_bytes(int n, int K) {
    return (((size_t)n * K + 63) & ~(size_t)63) + (size_t)n * (K / 32) * 3 * sizeof(float) + (size_t)n * sizeof(float);
}

KV_HIDDEN Scratch scratch_at(char *p, int n, int K) {
    Scratch s;
    s.q = (int8_t *)p;
    s.da = (float *)(p + (((size_t)n * K + 63) & ~(size_t)63));
    s.sa = s.da + (size_t)n * (K / 32);
    s.inv = s.sa + (size_t)n * 2 * (K / 32);
    return s;
}

/* kv_q_act then kv_q_matmul in one call: y (+)= (x * g) @ W^T * rscale + bias, where rscale is
 * 1 / rms(x) when eps >= 0 (an RMSNorm whose weight g the caller folded in) and 1 otherwise.
 * Returns 0, 1 for bad arguments, 4 when scratch memory cannot be had. */
int kv_q_linear(int fmt, int n, int K, int out, const float *x, int64_t ldx, const float *g, float eps,
                const uint8_t *qs, const void *d, const void *m, const float *bias, float *y, int64_t ldy,
                int accumulate, int n_threads) {
    if (n < 1 || K < 32 || K % 32) return 1;
    char *buf = malloc(scratch_bytes(n, K));
    if (buf == NULL) return 4;
    const Scratch a = scratch_at(buf, n, K);
    int rc = kv_q_act(n, K, x, ldx, g, eps, a.q, a.da, a.sa, a.inv, n_threads);
    if (rc == 0)
        rc = kv_q_matmul(fmt, n, K, out, a.q, a.da, a.sa, qs, d, m, bias, eps >= 0.f ? a.inv : NULL, y, ldy,
                         accumulate, n_threads);
    free(buf);
    return rc;
}

/* x += rms_norm(y) * w for one row of H values (a post-norm before the residual). */
KV_HIDDEN void add_normed(int H, const float *y, const float *w, float eps, float *x) {
    float ss = 0.f;
    for (int k = 0; k < H; k++) ss += y[k] * y[k];
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    for (int k = 0; k < H; k++) x[k] += y[k] * inv * w[k];
}

KV_HIDDEN void mm_rows(const QW *wt, int n, const Scratch *s, const float *bias, const float *rscale, float *y,
                       int64_t ldy, int accumulate) {
    const int G = (wt->out + 7) / 8;
    for (int r0 = 0; r0 < n; r0 += RCHUNK) {
        const int r1 = n - r0 < RCHUNK ? n : r0 + RCHUNK;
#pragma omp for schedule(static)
        for (int g = 0; g < G; g++) mm_group(wt, g, r0, r1, s->q, s->da, s->sa, bias, rscale, y, ldy, accumulate);
    }
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

/* act(gate) * up for one row of [gate | up] (I each, a multiple of VL): silu (act 0) or the tanh
 * GELU (1), both from exp of non-positive numbers (vmath.h), written over the gate half. */
static void glu_row(int act, int I, float *h) {
    for (int i = 0; i < I; i += VL) {
        const vec x = *(const vec *)(h + i), up = *(const vec *)(h + I + i);
        vec a;
        if (act == 0) {
            const vec e = vexp(-vabs(x)), s = 1.f / (1.f + e);
            a = x * vsel(x >= 0.f, s, e * s);
        } else {
            const vec z = 0.7978845608f * (x + 0.044715f * x * x * x);
            const vec e = vexp(-2.f * vabs(z)), t = (1.f - e) / (1.f + e);
            a = 0.5f * x * (1.f + vsel(z >= 0.f, t, -t));
        }
        *(vec *)(h + i) = a * up;
    }
}

/* A gated MLP in one call: x (+)= post_norm(down(act(gate) * up)), where [gate | up] = the gate_up
 * projection of (x * g_in / rms(x)) (eps >= 0; a folded RMSNorm) and post_norm is an RMSNorm with
 * weight post_w (Gemma 3's post-feedforward norm) or nothing (post_w NULL). x [n, H], rows ldx apart.
 * Returns 0, 1 for bad arguments, 4 when scratch memory cannot be had. */
int kv_q_mlp(int n, int H, int I, float *x, int64_t ldx, const float *g_in, float eps, int gu_fmt,
             const uint8_t *gu_qs, const void *gu_d, const void *gu_m, const float *gu_b, int dn_fmt,
             const uint8_t *dn_qs, const void *dn_d, const void *dn_m, const float *dn_b, int act,
             const float *post_w, float post_eps, int n_threads) {
    const QW gu = {gu_fmt, 2 * I, H, gu_qs, gu_d, gu_m}, dn = {dn_fmt, H, I, dn_qs, dn_d, dn_m};
    if (n < 1 || !qw_valid(&gu) || !qw_valid(&dn) || ldx < H || (act != 0 && act != 1) || I % VL) return 1;
    const size_t s1 = scratch_bytes(n, H), s2 = scratch_bytes(n, I);
    const size_t hb = (size_t)n * 2 * I * sizeof(float), yb = post_w ? (size_t)n * H * sizeof(float) : 0;
    char *buf = malloc(s1 + s2 + hb + yb + 64);
    if (buf == NULL) return 4;
    const Scratch a = scratch_at(buf, n, H), b = scratch_at(buf + s1, n, I);
    float *h = (float *)(buf + ((s1 + s2 + 63) & ~(size_t)63)), *y = post_w ? h + (size_t)n * 2 * I : NULL;
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) act_row(r, H, x, ldx, g_in, eps, a.q, a.da, a.sa, a.inv);
        mm_rows(&gu, n, &a, gu_b, eps >= 0.f ? a.inv : NULL, h, 2 * I, 0);
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) { /* act(gate) * up into the gate half, then its int8 activations */
            float *hr = h + (size_t)r * 2 * I;
            glu_row(act, I, hr);
            act_row(r, I, h, 2 * I, NULL, -1.f, b.q, b.da, b.sa, b.inv);
        }
        mm_residual(&dn, n, &b, dn_b, x, ldx, y, post_w, post_eps);
    }
    free(buf);
    return 0;
}
