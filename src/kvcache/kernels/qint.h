/* The integer products of attention over quantized pages (qattn.c): query rows against a chunk of
 * quantized keys and values, with exact integer sums, so only the float steps around them decide
 * the bits, and they are the same in every variant. Included by qattn.c only (after qlanes.h and
 * qrows.h).
 *
 * Codes are taken about their middle code K = 2^(bits-1) (c - K, signed), which keeps a rounding's
 * error about the middle of the values, where minimum and codes would otherwise cancel.
 * Scores, per key group (G tokens; per channel c a scale s_c and a minimum m_c): q * s is rounded to
 * 16-bit integers against one scale a = max |q * s| / top (ties to even; top = 32767, less where D
 * would let a sum leave 32 bits), and score = a * sum_c qh_c (code_c - K) + q . (m + K s), one
 * multiply-add (q . (m + K s) by a sixteen-lane chain and hsum16's tree; m + K s by fmaf).
 * Values, per row and group of G elements: the chunk's weights times each token's scale, w * s, are
 * rounded to 16-bit integers against one scale b = max / top, and acc = b * sum_t wh_t (code_t - K)
 * + w . (m + K s) (a sixteen-lane chain in the chunk's order, then the tree). */
#ifndef KV_QINT_H
#define KV_QINT_H

#include "qrows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FAST512 1 /* groups of 32 and D a multiple of 64 read their codes in place (below) */
#else
#define FAST512 0
#endif

/* A quantized chunk made ready (qattn.c's prep_int) in the thread's scratch. */
typedef struct {
    int n, G, bits, fast;     /* keys (whole pages), group, code width; fast: codes read in place */
    const uint32_t *KI;       /* [n / G, D / 2, G] a key group's codes less K, two channels of a token a lane */
    const uint32_t *VI;       /* [n / 2, D] value codes less K, two tokens of an element a lane */
    const uint8_t *const *kg; /* fast: [n / G] each key group's codes [D, G * bits / 8] */
    const uint8_t *const *vr; /* fast: [n] each token's value codes [D * bits / 8] */
    const float *ks, *kz;     /* [n / G, D] each key group's per-channel scale and minimum + K scale */
    const float *vs, *vz;     /* [D / G, n] each token's value scale and minimum + K scale, per group */
    uint32_t *wd;             /* [D / G, NM, ws] room for the rows' rounded weights (wrow) */
    int ws;                   /* a row's stride there: CH / 2 for a chunk of at most CH keys, else n / 2 */
    float *u;                 /* [n] room for a row's weights times one group's scales */
    const int *chan;          /* [D] the element each value lane holds */
} ichunk_t;

/* Row r's rounded weight pairs for value group gr (ws: ck->ws, a constant where it is known). */
static ALWAYS uint32_t *wrow(const ichunk_t *ck, int r, int gr, int ws) {
    return ck->wd + ((int64_t)gr * NM + r) * ws;
}

/* hsum16's tree (8 pairs, 4, 2, 1) on vector registers where the build has AVX-512: the same sums. */
static ALWAYS float tree16(v16 x) {
#if FAST512
    const __m512 v = (__m512)x;
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b)); /* b0 + b2, b1 + b3 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
#else
    return hsum16(x);
#endif
}

static ALWAYS v16 vmax16(v16 a, v16 b) { /* (never given a NaN) */
#if FAST512
    return (v16)_mm512_max_ps((__m512)a, (__m512)b);
#endif
    const i16 gt = a > b;
    return (v16)(((i16)a & gt) | ((i16)b & ~gt));
}

/* The largest of sixteen lanes (exact in any order). */
static ALWAYS float lanes_max(v16 m) {
#if FAST512
    return _mm512_reduce_max_ps((__m512)m);
#endif
    float top = m[0];
    for (int i = 1; i < 16; i++) top = m[i] > top ? m[i] : top;
    return top;
}

/* The largest 16-bit magnitude whose sums over `terms` products by codes less K (|c - K| <= 128) stay
 * within 32 bits. */
static ALWAYS float top_for(int terms) {
    const int64_t most = (int64_t)2147483647 / ((int64_t)128 * terms);
    return most < 32767 ? (float)most : 32767.f;
}

/* x [n] (n a multiple of 16, amax = max |x|) rounded to 16-bit integers against one scale, two to a
 * lane: out[i] holds x[2i], x[2i + 1] as round(x * (top / amax)), ties to even. Returns the scale,
 * amax / top (0 where amax is 0: integers 0). */
static ALWAYS float round_pairs(const float *x, int n, float amax, float top, uint32_t *out) {
    const float inv = amax > 0.f ? top / amax : 0.f;
#if FAST512
    for (int t = 0; t < n; t += 16) {
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + t), _mm512_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(out + t / 2), _mm512_cvtepi32_epi16(r));
    }
#else
    for (int t = 0; t < n; t += 2)
        out[t / 2] = (uint32_t)round_half(x[t] * inv) | (uint32_t)round_half(x[t + 1] * inv) << 16;
#endif
    return amax / top;
}

/* One key group's terms for rows qr (``rows``, the extra ones copies of row 0): zt = q . kz (a
 * sixteen-lane chain, then the tree), and q * scale rounded (round_pairs) into qd with its scale a. */
static ALWAYS void key_terms(const float *const *qr, int nr, int rows, int D, const float *s, const float *z,
                             float *qs, float *zt, uint32_t qd[][MAXD / 2], float *a) {
    for (int r = 0; r < rows; r++) {
        const float *q = qr[r < nr ? r : 0];
        v16 acc = (v16){0}, mx = (v16){0};
        for (int c = 0; c < D; c += 16) {
            const v16 x = *(const v16 *)(q + c), y = x * *(const v16 *)(s + c);
            acc = MADD(x, *(const v16 *)(z + c), acc);
            *(v16 *)(qs + c) = y;
            mx = vmax16((v16)(*(const i16 *)&y & 0x7fffffff), mx);
        }
        zt[r] = tree16(acc);
        a[r] = round_pairs(qs, D, lanes_max(mx), top_for(D), qd[r]);
    }
}

#if FAST512
/* A key group's value scales s and minimums z [G, vg] (page order) to lane order per element group:
 * vs[gr * n + L] = s[tok[L] * vg + gr], vz the same of z + K s (fmaf), L < 32. */
static ALWAYS void value_scales512(const float *s, const float *z, const int *tok, int vg, int n, float mid,
                                   float *vs, float *vz) {
    for (int v = 0; v < 2; v++) {
        const __m512i at = _mm512_mullo_epi32(_mm512_loadu_si512(tok + 16 * v), _mm512_set1_epi32(vg));
        for (int gr = 0; gr < vg; gr++) {
            const __m512i i = _mm512_add_epi32(at, _mm512_set1_epi32(gr));
            const __m512 sv = _mm512_i32gather_ps(i, s, 4), zv = _mm512_i32gather_ps(i, z, 4);
            _mm512_storeu_ps(vs + (int64_t)gr * n + 16 * v, sv);
            _mm512_storeu_ps(vz + (int64_t)gr * n + 16 * v, _mm512_fmadd_ps(_mm512_set1_ps(mid), sv, zv));
        }
    }
}

/* Codes of channels 2cp, 2cp + 1 for the 32 tokens of a key group, less K, as 16-bit pairs: *p0
 * holds tokens 0-3 8-11 16-19 24-27, *p1 tokens 4-7 12-15 20-23 28-31 (a token: its codes16 lane). */
static ALWAYS void key_pairs(const uint8_t *codes, int cp, int bits, __m512i *p0, __m512i *p1) {
    __m512i x, y; /* two channels' 32 codes as 16-bit integers */
    const __m512i mid = _mm512_set1_epi16((short)(1 << (bits - 1)));
    if (bits == 8) {
        x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 64 * cp)));
        y = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 64 * cp + 32)));
    } else if (bits == 4) { /* words 0-15: the first channel's bytes, 16-31 the second's */
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * cp)));
        const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi16(15)), hi = _mm512_srli_epi16(w, 4);
        x = _mm512_shuffle_i64x2(lo, hi, 0x44);
        y = _mm512_shuffle_i64x2(lo, hi, 0xee);
    } else { /* words 0-7: the first channel's bytes, 8-15 the second's; lane c: bits 2c */
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16 * cp)));
        const __m512i sh = _mm512_setr_epi64(0, 0, 0x0002000200020002, 0x0002000200020002, 0x0004000400040004,
                                             0x0004000400040004, 0x0006000600060006, 0x0006000600060006);
        const __m512i m = _mm512_set1_epi16(3);
        x = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i32x4(_mm256_castsi256_si128(w)), sh), m);
        y = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i32x4(_mm256_extracti128_si256(w, 1)), sh), m);
    }
    x = _mm512_sub_epi16(x, mid);
    y = _mm512_sub_epi16(y, mid);
    *p0 = _mm512_unpacklo_epi16(x, y);
    *p1 = _mm512_unpackhi_epi16(x, y);
}

/* Lanes of two vectors laid out as key_pairs' back in order: 0-15 (i = 0) or 16-31 (i = 1). */
static ALWAYS __m512i unpair(__m512i a, __m512i b, int i) {
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    return _mm512_permutex2var_epi32(a, i ? hi : lo, b);
}

/* The integer score sums of rows 0 .. NR-1 over a key group of 32 tokens read in place, in lane order. */
static ALWAYS void key_sums512(const uint8_t *codes, int D, int bits, const uint32_t qd[NR][MAXD / 2],
                               __m512i out[NR][2]) {
    __m512i a0[NR], a1[NR];
    for (int r = 0; r < NR; r++) a0[r] = a1[r] = _mm512_setzero_si512();
    for (int cp = 0; cp < D / 2; cp++) {
        __m512i p0, p1;
        _mm_prefetch((const char *)codes + (int64_t)D * 4 * bits + 64 * cp, _MM_HINT_T0); /* the next group's */
        key_pairs(codes, cp, bits, &p0, &p1);
        for (int r = 0; r < NR; r++) {
            const __m512i b = _mm512_set1_epi32((int)qd[r][cp]);
            a0[r] = _mm512_dpwssd_epi32(a0[r], p0, b);
            a1[r] = _mm512_dpwssd_epi32(a1[r], p1, b);
        }
    }
    for (int r = 0; r < NR; r++) {
        out[r][0] = unpair(a0[r], a1[r], 0);
        out[r][1] = unpair(a0[r], a1[r], 1);
    }
}

/* One token's value codes for the elements 64s .. 64s + 63, less K, as 16-bit integers: e[0] and e[1]
 * (the order below, undone by value_sums512). */
static ALWAYS void value_words(const uint8_t *row, int s, int bits, __m512i *e) {
    const __m512i mid = _mm512_set1_epi16((short)(1 << (bits - 1)));
    if (bits == 8) { /* e[0] elements 0-31, e[1] 32-63 */
        e[0] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 64 * s)));
        e[1] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 64 * s + 32)));
    } else if (bits == 4) { /* e[0] words: elements 0-15, 32-47; e[1]: 16-31, 48-63 */
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * s)));
        e[0] = _mm512_and_si512(w, _mm512_set1_epi16(15));
        e[1] = _mm512_srli_epi16(w, 4);
    } else { /* e[0] elements 0-31, e[1] 32-63 */
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + 16 * s)));
        const __m512i sh = _mm512_setr_epi64(0, 0, 0x0002000200020002, 0x0002000200020002, 0x0004000400040004,
                                             0x0004000400040004, 0x0006000600060006, 0x0006000600060006);
        const __m512i m = _mm512_set1_epi16(3);
        e[0] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i32x4(_mm256_castsi256_si128(w)), sh), m);
        e[1] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i32x4(_mm256_extracti128_si256(w, 1)), sh), m);
    }
    e[0] = _mm512_sub_epi16(e[0], mid);
    e[1] = _mm512_sub_epi16(e[1], mid);
}

/* The integer value sums of rows 0 .. NR-1 (wd[r][g]: row r's weight pairs of group 2s + g) over the
 * chunk's n tokens (vr: each token's codes) for the value lanes 64s .. 64s + 63 (groups 2s, 2s + 1
 * of 32), into out[r] [4] (sixteen lanes each, in order). */
static ALWAYS void value_sums512(const uint8_t *const *vr, int n, int s, int bits, const uint32_t *const wd[NR][2],
                                 __m512i out[NR][4]) {
    __m512i acc[4][NR];
    for (int k = 0; k < 4; k++)
        for (int r = 0; r < NR; r++) acc[k][r] = _mm512_setzero_si512();
    /* p[0], p[1]: e[0]'s pairs (unpacklo, unpackhi), p[2], p[3]: e[1]'s; int8 and int2: p0 p1 group 2s,
     * p2 p3 group 2s + 1; int4: 128-bit lanes 0 1 group 2s, 2 3 group 2s + 1 */
    const __mmask16 hi = 0xff00;
    for (int tp = 0; tp < n / 2; tp++) {
        __m512i x[2], y[2], p[4];
        if (2 * tp + 16 < n) { /* rows sixteen tokens ahead */
            _mm_prefetch((const char *)vr[2 * tp + 16] + 8 * bits * s, _MM_HINT_T0);
            _mm_prefetch((const char *)vr[2 * tp + 17] + 8 * bits * s, _MM_HINT_T0);
        }
        value_words(vr[2 * tp], s, bits, x);
        value_words(vr[2 * tp + 1], s, bits, y);
        for (int i = 0; i < 2; i++) {
            p[2 * i] = _mm512_unpacklo_epi16(x[i], y[i]);
            p[2 * i + 1] = _mm512_unpackhi_epi16(x[i], y[i]);
        }
        for (int r = 0; r < NR; r++) {
            const __m512i g0 = _mm512_set1_epi32((int)wd[r][0][tp]), g1 = _mm512_set1_epi32((int)wd[r][1][tp]);
            if (bits == 4) {
                const __m512i b = _mm512_mask_mov_epi32(g0, hi, g1);
                for (int k = 0; k < 4; k++) acc[k][r] = _mm512_dpwssd_epi32(acc[k][r], p[k], b);
            } else {
                acc[0][r] = _mm512_dpwssd_epi32(acc[0][r], p[0], g0);
                acc[1][r] = _mm512_dpwssd_epi32(acc[1][r], p[1], g0);
                acc[2][r] = _mm512_dpwssd_epi32(acc[2][r], p[2], g1);
                acc[3][r] = _mm512_dpwssd_epi32(acc[3][r], p[3], g1);
            }
        }
    }
    for (int r = 0; r < NR; r++) {
        if (bits == 4) { /* p[0] p[1]: elements 0-15 (lanes 0 1), 32-47 (2 3); p[2] p[3]: 16-31, 48-63 */
            out[r][0] = unpair(acc[0][r], acc[1][r], 0);
            out[r][1] = unpair(acc[2][r], acc[3][r], 0);
            out[r][2] = unpair(acc[0][r], acc[1][r], 1);
            out[r][3] = unpair(acc[2][r], acc[3][r], 1);
        } else {
            out[r][0] = unpair(acc[0][r], acc[1][r], 0);
            out[r][1] = unpair(acc[0][r], acc[1][r], 1);
            out[r][2] = unpair(acc[2][r], acc[3][r], 0);
            out[r][3] = unpair(acc[2][r], acc[3][r], 1);
        }
    }
}
#endif

/* One row's value terms for a chunk whose weights st [n] it has: per value group gr, the weights
 * times the tokens' scales rounded (round_pairs) into wd with their scale b[gr], and zs[gr] =
 * weights . (m + K s) (a sixteen-lane chain, then the tree). */
static ALWAYS void value_terms(const ichunk_t *ck, int vg, const float *w, uint32_t *const *wd, float *b,
                               float *zs) {
    const int n = ck->n;
    const float top = top_for(n);
    float *u = ck->u;
    for (int gr = 0; gr < vg; gr++) {
        const float *s = ck->vs + (int64_t)gr * n, *z = ck->vz + (int64_t)gr * n;
        v16 m = (v16){0}, mx = (v16){0};
        for (int t = 0; t < n; t += 16) {
            const v16 x = *(const v16 *)(w + t), y = x * *(const v16 *)(s + t);
            *(v16 *)(u + t) = y;
            mx = vmax16(y, mx); /* the weights and the scales are not negative */
            m = MADD(x, *(const v16 *)(z + t), m);
        }
        zs[gr] = tree16(m);
        b[gr] = round_pairs(u, n, lanes_max(mx), top, wd[gr]);
    }
}

/* Rows 0 .. nr-1's scores st [nr, n] (every key visible) -> their softmax weights (m and l to parts),
 * then each row's value terms (value_terms) into its rows of the weights' room, b and zs. */
static ALWAYS void chunk_weights(const ichunk_t *ck, int vg, int ws, float *st, int nr, part_t *const *parts,
                                 float b[][MAXD / 16], float zs[][MAXD / 16]) {
    int vis[NM];
    for (int r = 0; r < nr; r++) vis[r] = ck->n;
    softmax_rows(st, ck->n, vis, nr, parts);
    for (int r = 0; r < nr; r++) {
        uint32_t *wd[MAXD / 16];
        for (int gr = 0; gr < vg; gr++) wd[gr] = wrow(ck, r, gr, ws);
        value_terms(ck, vg, st + (int64_t)r * ck->n, wd, b[r], zs[r]);
    }
}

/* Rows qr[0 .. nr-1] (NR computed, the extra ones copies of row 0) against a quantized chunk, every
 * key visible: the scores, the softmax, the value sums (the header's arithmetic). */
static NOINLINE void tile_int(const ichunk_t *ck, int D, const float *const *qr, int nr, float *st,
                              part_t *const *parts) {
    const int n = ck->n, G = ck->G, ng = n / G, vg = D / G, D2 = D / 2, ws = ck->ws;
    float qs[MAXD], zt[NR], a[NR];
    uint32_t qd[NR][MAXD / 2];
    for (int gi = 0; gi < ng; gi++) {
        key_terms(qr, nr, NR, D, ck->ks + (int64_t)gi * D, ck->kz + (int64_t)gi * D, qs, zt, qd, a);
#if FAST512
        if (ck->fast) {
            __m512i sums[NR][2];
            key_sums512(ck->kg[gi], D, ck->bits, qd, sums);
            for (int r = 0; r < NR; r++)
                for (int v = 0; v < 2; v++)
                    *(v16 *)(st + (int64_t)r * n + gi * G + 16 * v) =
                        MADD(__builtin_convertvector((i16)sums[r][v], v16), a[r], (v16){0} + zt[r]);
            continue;
        }
#endif
        const uint32_t *K = ck->KI + (int64_t)gi * D2 * G;
        for (int v = 0; v < G; v += 16) {
            i16 acc[NR];
            for (int r = 0; r < NR; r++) acc[r] = (i16){0};
            for (int cp = 0; cp < D2; cp++)
                for (int r = 0; r < NR; r++) acc[r] = dot2(acc[r], K + (int64_t)cp * G + v, qd[r][cp]);
            for (int r = 0; r < NR; r++)
                *(v16 *)(st + (int64_t)r * n + gi * G + v) =
                    MADD(__builtin_convertvector(acc[r], v16), a[r], (v16){0} + zt[r]);
        }
    }
    float b[NR][MAXD / 16], zs[NR][MAXD / 16];
    chunk_weights(ck, vg, ws, st, nr, parts, b, zs);
#if FAST512
    if (ck->fast) {
        for (int s = 0; s < D / 64; s++) {
            const uint32_t *wd[NR][2];
            __m512i sums[NR][4];
            for (int r = 0; r < NR; r++)
                for (int i = 0; i < 2; i++) wd[r][i] = wrow(ck, r < nr ? r : 0, 2 * s + i, ws);
            value_sums512(ck->vr, n, s, ck->bits, wd, sums);
            for (int m = 0; m < 4; m++) {
                const int d0 = 64 * s + 16 * m, gr = d0 / G;
                v16 o[NR];
                for (int r = 0; r < nr; r++)
                    o[r] = MADD(__builtin_convertvector((i16)sums[r][m], v16), b[r][gr], (v16){0} + zs[r][gr]);
                store_out(o, nr, d0, ck->chan, parts);
            }
        }
        return;
    }
#endif
    for (int d0 = 0; d0 < D; d0 += 16) {
        const int gr = d0 / G;
        const uint32_t *wr[NR];
        for (int r = 0; r < NR; r++) wr[r] = wrow(ck, r < nr ? r : 0, gr, ws);
        i16 acc[NR];
        for (int r = 0; r < NR; r++) acc[r] = (i16){0};
        for (int tp = 0; tp < n / 2; tp++) {
            const uint32_t *x = ck->VI + (int64_t)tp * D + d0;
            for (int r = 0; r < NR; r++) acc[r] = dot2(acc[r], x, wr[r][tp]);
        }
        v16 o[NR];
        for (int r = 0; r < nr; r++) o[r] = MADD(__builtin_convertvector(acc[r], v16), b[r][gr], (v16){0} + zs[r][gr]);
        store_out(o, nr, d0, ck->chan, parts);
    }
}

/* tile_int's arithmetic for up to NM rows over a chunk widened into the scratch (a prefill's): the
 * integer sums are exact, so taking two code vectors at a time for NM rows (sixteen sums in
 * registers) changes no bit. ws constant where inlined. */
static ALWAYS void tile_int_rows(const ichunk_t *ck, int D, const float *const *qr, int nr, float *st,
                                 part_t *const *parts, int ws) {
    const int n = ck->n, G = ck->G, ng = n / G, vg = D / G, D2 = D / 2;
    float qs[MAXD], zt[NM], a[NM];
    uint32_t qd[NM][MAXD / 2];
    for (int gi = 0; gi < ng; gi++) {
        key_terms(qr, nr, NM, D, ck->ks + (int64_t)gi * D, ck->kz + (int64_t)gi * D, qs, zt, qd, a);
        const uint32_t *K = ck->KI + (int64_t)gi * D2 * G;
        for (int v = 0; v < G; v += 32) {
            const int two = v + 32 <= G; /* two vectors of sixteen tokens, or the group's last one */
            i16 acc0[NM], acc1[NM];
            for (int r = 0; r < NM; r++) acc0[r] = acc1[r] = (i16){0};
            for (int cp = 0; cp < D2; cp++) {
                const uint32_t *k = K + (int64_t)cp * G + v;
                for (int r = 0; r < NM; r++) {
                    acc0[r] = dot2(acc0[r], k, qd[r][cp]);
                    if (two) acc1[r] = dot2(acc1[r], k + 16, qd[r][cp]);
                }
            }
            for (int r = 0; r < NM; r++) {
                *(v16 *)(st + (int64_t)r * n + gi * G + v) =
                    MADD(__builtin_convertvector(acc0[r], v16), a[r], (v16){0} + zt[r]);
                if (two)
                    *(v16 *)(st + (int64_t)r * n + gi * G + v + 16) =
                        MADD(__builtin_convertvector(acc1[r], v16), a[r], (v16){0} + zt[r]);
            }
        }
    }
    float b[NM][MAXD / 16], zs[NM][MAXD / 16];
    chunk_weights(ck, vg, ws, st, nr, parts, b, zs);
    for (int r = nr; r < NM; r++) /* a last tile's missing rows: sums of zeros, never stored */
        for (int gr = 0; gr < vg; gr++) memset(wrow(ck, r, gr, ws), 0, sizeof(uint32_t) * (size_t)(n / 2));
    for (int d0 = 0; d0 < D; d0 += 32) {
        const int two = d0 + 32 <= D, g0 = d0 / G, g1 = two ? (d0 + 16) / G : g0;
        const uint32_t *w0 = wrow(ck, 0, g0, ws), *w1 = wrow(ck, 0, g1, ws); /* row r: + r * ws */
        i16 acc0[NM], acc1[NM];
        for (int r = 0; r < NM; r++) acc0[r] = acc1[r] = (i16){0};
        for (int tp = 0; tp < n / 2; tp++) {
            const uint32_t *x = ck->VI + (int64_t)tp * D + d0;
            for (int r = 0; r < NM; r++) {
                acc0[r] = dot2(acc0[r], x, w0[(int64_t)r * ws + tp]);
                if (two) acc1[r] = dot2(acc1[r], x + 16, w1[(int64_t)r * ws + tp]);
            }
        }
        v16 o[NM];
        for (int r = 0; r < nr; r++) o[r] = MADD(__builtin_convertvector(acc0[r], v16), b[r][g0], (v16){0} + zs[r][g0]);
        store_out(o, nr, d0, ck->chan, parts);
        if (two) {
            for (int r = 0; r < nr; r++)
                o[r] = MADD(__builtin_convertvector(acc1[r], v16), b[r][g1], (v16){0} + zs[r][g1]);
            store_out(o, nr, d0 + 16, ck->chan, parts);
        }
    }
}

/* Up to NM rows of a prefill over a chunk widened once into the scratch. */
static NOINLINE void tile_int_many(const ichunk_t *ck, int D, const float *const *qr, int nr, float *st,
                                   part_t *const *parts) {
    if (ck->ws == CH / 2)
        tile_int_rows(ck, D, qr, nr, st, parts, CH / 2);
    else
        tile_int_rows(ck, D, qr, nr, st, parts, ck->ws);
}

#endif
