/* The AVX512-VNNI products of a tile (included by qgemm.c, which defines RT, NGMAX, PF and the
 * Acts and word helpers): 16 columns a register, one 32-bit lane per column holding 4 inputs. */

/* Bits 4 and 5 of step s's values in a 6-bit group-block, in place (the pair at bits 2 (s & 3)). */
static inline __attribute__((always_inline)) __m512i six_bits(const uint8_t *wb, int s) {
    const __m512i v = _mm512_loadu_si512(wb + 256 + 64 * (s >> 2));
    const int k = s & 3;
    const __m512i t = k == 2 ? v : k < 2 ? _mm512_slli_epi16(v, 4 - 2 * k) : _mm512_srli_epi16(v, 2 * k - 4);
    return _mm512_and_si512(t, _mm512_set1_epi8(0x30));
}

/* MXFP4's codes (bytes 0 .. 15) as the bytes they stand for (qformat.h's KVQ_MX4_U), a shuffle. */
static inline __attribute__((always_inline)) __m512i mx4_bytes(__m512i codes) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVQ_MX4_U)), codes);
}

/* The weights of step s (inputs 4 s .. 4 s + 3 of every column) of group-block wb as u8 lanes;
 * NIB 2: nibble codes through KVQ_MX4_U. */
static inline __attribute__((always_inline)) __m512i step_w(const int NIB, const int HI, const int SGN,
                                                            const uint8_t *wb, int s) {
    __m512i v;
    if (NIB) {
        v = _mm512_loadu_si512(wb + 64 * (s & 3));
        if (s >= 4) v = _mm512_srli_epi16(v, 4);
        v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
        if (NIB == 2) v = mx4_bytes(v);
        if (HI == 2) v = _mm512_or_si512(v, six_bits(wb, s));
        else if (HI) { /* the fifth bits: one mask bit per byte lane, 0x10 where set */
            uint64_t hm;
            memcpy(&hm, wb + 256 + 8 * s, 8);
            v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(hm, _mm512_set1_epi8(0x10)));
        }
    } else {
        v = _mm512_loadu_si512(wb + 64 * s);
        if (SGN) v = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    return v;
}

#include "qscale512.h"

/* Step s of block b: rows 0 .. nr - 1 of the int8 activations q (K apart) times the step's weights
 * of NG groups (group-blocks wb0, wb1), into each row's integer sums s0 (and s1), each row's 4
 * inputs broadcast once for both groups. */
static inline __attribute__((always_inline)) void step_rows(const int NIB, const int HI, const int SGN, const int NG,
                                                            int nr, const int8_t *q, int K, int64_t b, int s,
                                                            const uint8_t *wb0, const uint8_t *wb1, __m512i s0[RT],
                                                            __m512i s1[RT]) {
    const __m512i W0 = step_w(NIB, HI, SGN, wb0, s);
    const __m512i W1 = NG == 2 ? step_w(NIB, HI, SGN, wb1, s) : W0;
#pragma GCC unroll 16
    for (int r = 0; r < RT; r++) {
        if (r < nr) {
            const __m512i x = _mm512_set1_epi32(word(q + (int64_t)r * K + 32 * b + 4 * s));
            s0[r] = _mm512_dpbusd_epi32(s0[r], W0, x);
            if (NG == 2) s1[r] = _mm512_dpbusd_epi32(s1[r], W1, x);
        }
    }
}

/* One block of a group's weights, all 8 steps unpacked (W[s]: step s as u8 lanes). */
static inline __attribute__((always_inline)) void block_w(const int NIB, const int HI, const int SGN,
                                                          const uint8_t *wb, __m512i W[8]) {
    if (NIB) {
        for (int h = 0; h < 4; h++) {
            const __m512i v = _mm512_loadu_si512(wb + 64 * h);
            W[h] = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
            W[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
        }
        if (NIB == 2)
            for (int s = 0; s < 8; s++) W[s] = mx4_bytes(W[s]);
        if (HI == 2) {
            for (int s = 0; s < 8; s++) W[s] = _mm512_or_si512(W[s], six_bits(wb, s));
        } else if (HI) {
            uint64_t hm[8];
            memcpy(hm, wb + 256, 64);
            for (int s = 0; s < 8; s++) W[s] = _mm512_or_si512(W[s], _mm512_maskz_mov_epi8(hm[s], _mm512_set1_epi8(0x10)));
        }
    } else {
        for (int s = 0; s < 8; s++) W[s] = step_w(0, 0, SGN, wb, s);
    }
}

/* One row (a decode) times NG groups, each block's weights unpacked at once and the integer sums
 * split in two chains (latency: the weights stream in faster than one chain runs): what the tile
 * below computes for a row, in the same order (integer sums are exact; the float steps are the
 * same instructions). */
static inline __attribute__((always_inline)) void row1(const int NIB, const int HI, const int SGN, const int F16,
                                                       const int NS, const int OFS, const int NG, Acts a,
                                                       const uint8_t *w, int64_t gq, const void *dv,
                                                       const void *mv, int64_t gs, float *out) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int qb = NIB ? 256 + 64 * HI : 512, ofs = SGN ? 128 : OFS, steps = 8 / NS;
    for (int b = 0; b < a.nb; b++) {
        __m512i W[2][8];
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) {
            const uint8_t *wb = w + g * gq + (int64_t)b * qb;
            for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(wb + PF + l), _MM_HINT_T0);
            block_w(NIB, HI, SGN, wb, W[g]);
        }
        const int32_t *is = a.is + 2 * b;
        const __m512 da = _mm512_set1_ps(a.da[b]);
        __m512 t[2], mws[2][2];
        _Pragma("GCC unroll 2") for (int h = 0; h < NS; h++) {
            const __m512i init = _mm512_set1_epi32(-ofs * (NS == 1 ? is[0] + is[1] : is[h]));
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) {
                __m512i s0 = init, s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int st = 0; st < steps; st += 2) {
                    const int s = steps * h + st;
                    s0 = _mm512_dpbusd_epi32(s0, W[g][s], _mm512_set1_epi32(word(a.q + 32 * b + 4 * s)));
                    s1 = _mm512_dpbusd_epi32(s1, W[g][s + 1], _mm512_set1_epi32(word(a.q + 32 * b + 4 * s + 4)));
                }
                __m512 dw, mw = _mm512_setzero_ps();
                scales16(F16, !ofs, (const char *)dv + g * gs, mv ? (const char *)mv + g * gs : NULL, b, NS, h, &dw, &mw);
                const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                if (NS == 1) {
                    acc[g] = _mm512_fmadd_ps(_mm512_mul_ps(f, da), dw, acc[g]);
                    if (!ofs) acc[g] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sa[3 * b]), acc[g]);
                } else { /* the two halves' sums combined, then one activation step (closed below) */
                    t[g] = h == 0 ? _mm512_mul_ps(f, dw) : _mm512_fmadd_ps(f, dw, t[g]);
                    mws[g][h] = mw;
                }
            }
        }
        if (NS == 2)
            for (int g = 0; g < NG; g++) {
                acc[g] = _mm512_fmadd_ps(t[g], da, acc[g]);
                if (!ofs) {
                    acc[g] = _mm512_fmadd_ps(mws[g][0], _mm512_set1_ps(a.sa[3 * b + 1]), acc[g]);
                    acc[g] = _mm512_fmadd_ps(mws[g][1], _mm512_set1_ps(a.sa[3 * b + 2]), acc[g]);
                }
            }
    }
    for (int g = 0; g < NG; g++) _mm512_storeu_ps(out + KVQ_NC * g, acc[g]);
}

/* NG groups (16 NG columns) x up to RT rows: w, dv, mv at the first group; the next group's arrays
 * follow at gq bytes (qs) and gs bytes (d, m). Rows step together through each block's 8
 * steps (independent chains), each step's activations broadcast once for every group. */
static inline __attribute__((always_inline)) void tile(const int NIB, const int HI, const int SGN, const int F16,
                                                       const int NS, const int OFS, const int NG, int nr, Acts a,
                                                       const uint8_t *w, int64_t gq, const void *dv, const void *mv,
                                                       int64_t gs, float out[RT][NGMAX * KVQ_NC]) {
    __m512 acc0[RT], acc1[RT]; /* the two groups' sums, as separate arrays so they stay in registers */
    for (int r = 0; r < RT; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    const int qb = NIB ? 256 + 64 * HI : 512, ofs = SGN ? 128 : OFS, steps = 8 / NS;
    const uint8_t *w1 = w + gq;
    for (int b = 0; b < a.nb; b++) {
        const uint8_t *wb0 = w + (int64_t)b * qb, *wb1 = w1 + (int64_t)b * qb;
        for (int l = 0; l < qb; l += 64) {
            _mm_prefetch((const char *)(wb0 + PF + l), _MM_HINT_T0);
            if (NG == 2) _mm_prefetch((const char *)(wb1 + PF + l), _MM_HINT_T0);
        }
        __m512 t0[RT], t1[RT], mh0[2], mh1[2]; /* NS 2: the halves' sums combined, and their minimums */
        _Pragma("GCC unroll 2") for (int h = 0; h < NS; h++) {
            __m512 dw0, dw1 = _mm512_setzero_ps(), mw0 = _mm512_setzero_ps(), mw1 = _mm512_setzero_ps();
            scales16(F16, !ofs, dv, mv, b, NS, h, &dw0, &mw0);
            if (NG == 2)
                scales16(F16, !ofs, (const char *)dv + gs, mv ? (const char *)mv + gs : NULL, b, NS, h, &dw1, &mw1);
            __m512i s0[RT], s1[RT];
#pragma GCC unroll 16
            for (int r = 0; r < RT; r++) {
                if (r < nr) {
                    const int32_t *is = a.is + 2 * ((int64_t)r * a.nb + b);
                    s0[r] = s1[r] = _mm512_set1_epi32(-ofs * (NS == 1 ? is[0] + is[1] : is[h]));
                }
            }
#pragma GCC unroll 8
            for (int st = 0; st < steps; st++) {
                step_rows(NIB, HI, SGN, NG, nr, a.q, a.K, b, steps * h + st, wb0, wb1, s0, s1);
            }
            if (NS == 2) { /* row1's order: t = s_0 dw_0, t += s_1 dw_1, then one activation step */
                mh0[h] = mw0, mh1[h] = mw1;
#pragma GCC unroll 16
                for (int r = 0; r < RT; r++) {
                    if (r < nr) {
                        const __m512 f0 = _mm512_cvtepi32_ps(s0[r]), f1 = _mm512_cvtepi32_ps(s1[r]);
                        t0[r] = h == 0 ? _mm512_mul_ps(f0, dw0) : _mm512_fmadd_ps(f0, dw0, t0[r]);
                        if (NG == 2) t1[r] = h == 0 ? _mm512_mul_ps(f1, dw1) : _mm512_fmadd_ps(f1, dw1, t1[r]);
                    }
                }
                continue;
            }
#pragma GCC unroll 16
            for (int r = 0; r < RT; r++) {
                if (r < nr) {
                    const int64_t at = (int64_t)r * a.nb + b;
                    const __m512 da = _mm512_set1_ps(a.da[at]);
                    acc0[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s0[r]), da), dw0, acc0[r]);
                    if (NG == 2) acc1[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s1[r]), da), dw1, acc1[r]);
                    if (!ofs) {
                        const __m512 sa = _mm512_set1_ps(a.sa[3 * at]);
                        acc0[r] = _mm512_fmadd_ps(mw0, sa, acc0[r]);
                        if (NG == 2) acc1[r] = _mm512_fmadd_ps(mw1, sa, acc1[r]);
                    }
                }
            }
        }
        if (NS == 2) {
#pragma GCC unroll 16
            for (int r = 0; r < RT; r++) {
                if (r < nr) {
                    const int64_t at = (int64_t)r * a.nb + b;
                    const __m512 da = _mm512_set1_ps(a.da[at]);
                    acc0[r] = _mm512_fmadd_ps(t0[r], da, acc0[r]);
                    if (NG == 2) acc1[r] = _mm512_fmadd_ps(t1[r], da, acc1[r]);
                    if (!ofs)
                        for (int h = 0; h < 2; h++) {
                            const __m512 sa = _mm512_set1_ps(a.sa[3 * at + 1 + h]);
                            acc0[r] = _mm512_fmadd_ps(mh0[h], sa, acc0[r]);
                            if (NG == 2) acc1[r] = _mm512_fmadd_ps(mh1[h], sa, acc1[r]);
                        }
                }
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm512_storeu_ps(out[r], acc0[r]);
        if (NG == 2) _mm512_storeu_ps(out[r] + KVQ_NC, acc1[r]);
    }
}

/* -- the K-quant order (qgemm.c): integer sums per block of 32 (16 for Q6_KS), times the file's
 * integer scales (vpmulld) into one int32 sum a super-block, the minimums' sum as 16-bit pairs
 * (vpdpwssd), and two float steps a super-block. */

/* One row (a decode) times one group in the K-quant order: each block's weights unpacked at once,
 * the integer sums in two chains. */
static inline __attribute__((always_inline)) void ks_row1(const int HI, const int KS, Acts a, const uint8_t *w,
                                                          const uint8_t *dv, float *out) {
    const int qb = 256 + 64 * HI, NS = kvq_ks_ns(KS), steps = 8 / NS, ofs = KS == 2 ? 32 : 0;
    __m512 acc = _mm512_setzero_ps();
    for (int sb = 0; sb < a.nb / 8; sb++) {
        const uint8_t *sp = dv + (int64_t)sb * kvq_ksb(KS);
        __m512i S = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * sb + j;
            const uint8_t *wb = w + b * qb;
            for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(wb + PF + l), _MM_HINT_T0);
            __m512i W[8];
            block_w(1, HI, 0, wb, W);
            const int8_t *x = a.kq + 32 * b;
            _Pragma("GCC unroll 2") for (int h = 0; h < NS; h++) {
                __m512i s0 = _mm512_set1_epi32(-ofs * a.k16[2 * b + h]), s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int st = 0; st < steps; st += 2) {
                    const int s = steps * h + st;
                    s0 = _mm512_dpbusd_epi32(s0, W[s], _mm512_set1_epi32(word(x + 4 * s)));
                    s1 = _mm512_dpbusd_epi32(s1, W[s + 1], _mm512_set1_epi32(word(x + 4 * s + 4)));
                }
                S = _mm512_add_epi32(S, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), ks_scales16(KS, sp, j, h)));
            }
        }
        __m512i mp[8];
        if (KS != 2)
            for (int p = 0; p < kvq_ks_pairs(KS); p++) mp[p] = ks_min_pair(KS, sp, p);
        acc = ks_close(KS, acc, S, sp, a.dk[sb], kvq_ks_sums(KS, a.k16, a.k32, sb), mp);
    }
    _mm512_storeu_ps(out, acc);
}

/* NG groups x up to RT rows in the K-quant order: the rows step together through each block's
 * steps, each step's activations broadcast once for every group; a super-block's int32 sums stay
 * in registers, the float sums in out between super-blocks. */
static inline __attribute__((always_inline)) void ks_tile(const int HI, const int KS, const int NG, int nr, Acts a,
                                                          const uint8_t *w, int64_t gq, const uint8_t *dv, int64_t gs,
                                                          float out[RT][NGMAX * KVQ_NC]) {
    const int qb = 256 + 64 * HI, NS = kvq_ks_ns(KS), steps = 8 / NS, ofs = KS == 2 ? 32 : 0, nsb = a.nb / 8;
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < NG; g++) _mm512_storeu_ps(out[r] + KVQ_NC * g, _mm512_setzero_ps());
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *sp0 = dv + (int64_t)sb * kvq_ksb(KS), *sp1 = sp0 + gs;
        __m512i S0[RT], S1[RT];
#pragma GCC unroll 16
        for (int r = 0; r < RT; r++) S0[r] = S1[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * sb + j;
            const uint8_t *wb0 = w + b * qb, *wb1 = wb0 + gq;
            for (int l = 0; l < qb; l += 64) {
                _mm_prefetch((const char *)(wb0 + PF + l), _MM_HINT_T0);
                if (NG == 2) _mm_prefetch((const char *)(wb1 + PF + l), _MM_HINT_T0);
            }
            _Pragma("GCC unroll 2") for (int h = 0; h < NS; h++) {
                __m512i s0[RT], s1[RT];
#pragma GCC unroll 16
                for (int r = 0; r < RT; r++)
                    if (r < nr) s0[r] = s1[r] = _mm512_set1_epi32(-ofs * a.k16[(int64_t)r * 2 * a.nb + 2 * b + h]);
#pragma GCC unroll 8
                for (int st = 0; st < steps; st++) {
                    step_rows(1, HI, 0, NG, nr, a.kq, a.K, b, steps * h + st, wb0, wb1, s0, s1);
                }
                const __m512i c0 = ks_scales16(KS, sp0, j, h), c1 = NG == 2 ? ks_scales16(KS, sp1, j, h) : c0;
#pragma GCC unroll 16
                for (int r = 0; r < RT; r++) {
                    if (r < nr) {
                        S0[r] = _mm512_add_epi32(S0[r], _mm512_mullo_epi32(s0[r], c0));
                        if (NG == 2) S1[r] = _mm512_add_epi32(S1[r], _mm512_mullo_epi32(s1[r], c1));
                    }
                }
            }
        }
        __m512i mp0[8], mp1[8];
        if (KS != 2)
            for (int p = 0; p < kvq_ks_pairs(KS); p++) {
                mp0[p] = ks_min_pair(KS, sp0, p);
                if (NG == 2) mp1[p] = ks_min_pair(KS, sp1, p);
            }
#pragma GCC unroll 16
        for (int r = 0; r < RT; r++) {
            if (r < nr) {
                const float dk = a.dk[(int64_t)r * nsb + sb];
                const int16_t *ks = kvq_ks_sums(KS, a.k16 + (int64_t)r * 2 * a.nb, a.k32 + (int64_t)r * a.nb, sb);
                _mm512_storeu_ps(out[r], ks_close(KS, _mm512_loadu_ps(out[r]), S0[r], sp0, dk, ks, mp0));
                if (NG == 2)
                    _mm512_storeu_ps(out[r] + KVQ_NC,
                                     ks_close(KS, _mm512_loadu_ps(out[r] + KVQ_NC), S1[r], sp1, dk, ks, mp1));
            }
        }
    }
}
