/* The AVX-VNNI and AVX2 products of a tile (included by qgemm.c, which defines ISA, RT, PF and the
 * Acts and word helpers): 8 columns a register, two halves per group of 16. */

/* s + the products of 32 weight bytes (8 columns x 4 inputs, u8 or, on AVX2 with SGN, s8) and 4
 * activation bytes repeated: one int32 lane per column. */
static inline __attribute__((always_inline)) __m256i dot(const int SGN, __m256i s, __m256i w, __m256i x) {
#if ISA == 2
    (void)SGN; /* signed weights arrive offset by 128 */
    return _mm256_dpbusd_avx_epi32(s, w, x);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (SGN) return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                                                                _mm256_sign_epi8(x, w)), ones));
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
#endif
}

/* s + the products of 4 steps (weights W[0..3], activations at p): with AVX2 and unsigned weights
 * (q < 32: a pair product stays under 7874) the four steps' int16 pairs are added before widening,
 * one vpmaddwd instead of four; the integer sum is the same. */
static inline __attribute__((always_inline)) __m256i dot4(const int SGN, __m256i s, const __m256i *W, const int8_t *p) {
#if ISA == 1
    if (!SGN) {
        __m256i t = _mm256_maddubs_epi16(W[0], _mm256_set1_epi32(word(p)));
        for (int st = 1; st < 4; st++) t = _mm256_add_epi16(t, _mm256_maddubs_epi16(W[st], _mm256_set1_epi32(word(p + 4 * st))));
        return _mm256_add_epi32(s, _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
    }
#endif
    for (int st = 0; st < 4; st++) s = dot(SGN, s, W[st], _mm256_set1_epi32(word(p + 4 * st)));
    return s;
}

/* 32 mask bits -> 32 bytes, 0x10 where the bit is set (bit j of the mask -> byte j) */
static inline __m256i fifth_bits(uint32_t m) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                          3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), shuf);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, sel), sel), _mm256_set1_epi8(0x10));
}

/* Columns 8 hf .. 8 hf + 7 of a nibble format's group-block wb, all 8 steps as bytes (W[s]: step s):
 * the nibbles, with the fifth bits (HI 1) or bits 4 and 5 (HI 2, the pair of step s at bits
 * 2 (s & 3) of its byte). */
static inline __attribute__((always_inline)) void nibble_half(const int HI, const uint8_t *wb, int hf, __m256i W[8]) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 4; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * h + 32 * hf));
        W[h] = _mm256_and_si256(v, lo4);
        W[h + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
    }
    if (HI == 2) {
        for (int s = 0; s < 8; s++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 256 + 64 * (s >> 2) + 32 * hf));
            const int k = s & 3;
            const __m256i t = k == 2 ? v : k < 2 ? _mm256_slli_epi16(v, 4 - 2 * k) : _mm256_srli_epi16(v, 2 * k - 4);
            W[s] = _mm256_or_si256(W[s], _mm256_and_si256(t, _mm256_set1_epi8(0x30)));
        }
    } else if (HI) {
        uint64_t hm[8];
        memcpy(hm, wb + 256, 64);
        for (int s = 0; s < 8; s++) W[s] = _mm256_or_si256(W[s], fifth_bits((uint32_t)(hm[s] >> (32 * hf))));
    }
}

/* Block b of columns 8 hf .. 8 hf + 7 of the group, for nr rows: acc[r] += the block's products. */
static inline __attribute__((always_inline)) void half_block(const int NIB, const int HI, const int SGN, const int F16,
                                                             const int NS, const int OFS, int hf, int nr, Acts a,
                                                             const uint8_t *w, const void *dv, const void *mv, int b,
                                                             __m256 acc[RT]) {
    const int qb = NIB ? 256 + 64 * HI : 512;
    /* AVX-VNNI takes signed weights offset by 128 (u8), AVX2 through the sign trick */
    const int OFF = SGN && ISA == 2, ofs = OFF ? 128 : OFS, MIN = !SGN && !OFS;
    const uint8_t *wb = w + (int64_t)b * qb;
    __m256i W[8];
    if (NIB) {
        nibble_half(HI, wb, hf, W);
        if (NIB == 2) { /* MXFP4's codes as the bytes they stand for (KVQ_MX4_U), a shuffle each */
            const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVQ_MX4_U));
            for (int s = 0; s < 8; s++) W[s] = _mm256_shuffle_epi8(lut, W[s]);
        }
    } else {
        for (int s = 0; s < 8; s++) {
            W[s] = _mm256_loadu_si256((const __m256i *)(wb + 64 * s + 32 * hf));
            if (OFF) W[s] = _mm256_xor_si256(W[s], _mm256_set1_epi8((char)0x80));
        }
    }
    __m256 dw[2], mw[2];
    _Pragma("GCC unroll 2") for (int h = 0; h < NS; h++) {
        const int64_t at = ((int64_t)b * NS + h) * KVQ_NC + 8 * hf;
        dw[h] = F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)dv + at)))
                    : _mm256_loadu_ps((const float *)dv + at);
        if (MIN)
            mw[h] = F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)mv + at)))
                        : _mm256_loadu_ps((const float *)mv + at);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RT; r++) {
        if (r < nr) {
            const int64_t at = (int64_t)r * a.nb + b;
            const int8_t *ar = a.q + (int64_t)r * a.K + 32 * b;
            const int32_t *is = a.is + 2 * at;
            const float *sa = a.sa + 3 * at;
            if (NS == 1) {
                __m256i s = _mm256_set1_epi32(-ofs * (is[0] + is[1]));
                s = dot4(SGN && !OFF, dot4(SGN && !OFF, s, W, ar), W + 4, ar + 16);
                const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a.da[at]));
                acc[r] = _mm256_fmadd_ps(p, dw[0], acc[r]);
                if (MIN) acc[r] = _mm256_fmadd_ps(mw[0], _mm256_set1_ps(sa[0]), acc[r]);
            } else {
                __m256i s0 = _mm256_set1_epi32(-ofs * is[0]), s1 = _mm256_set1_epi32(-ofs * is[1]);
                s0 = dot4(SGN && !OFF, s0, W, ar);
                s1 = dot4(SGN && !OFF, s1, W + 4, ar + 16);
                const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), dw[1],
                                                 _mm256_mul_ps(_mm256_cvtepi32_ps(s0), dw[0]));
                acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(a.da[at]), acc[r]);
                if (MIN) {
                    acc[r] = _mm256_fmadd_ps(mw[0], _mm256_set1_ps(sa[1]), acc[r]);
                    acc[r] = _mm256_fmadd_ps(mw[1], _mm256_set1_ps(sa[2]), acc[r]);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void prefetch_block(const int NIB, const int HI, const uint8_t *w,
                                                                 int b) {
    const int qb = NIB ? 256 + 64 * HI : 512;
    for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(w + (int64_t)b * qb + PF + l), _MM_HINT_T0);
}

/* Up to RT rows: each half of the group through every block in turn, the second half reading what
 * the first brought into cache. A single row (a decode) takes both halves block by block instead,
 * so the weights stream from memory without a pause between the halves; every output element
 * sees the same steps in the same order either way. */
static inline __attribute__((always_inline)) void group(const int NIB, const int HI, const int SGN, const int F16,
                                                        const int NS, const int OFS, int nr, Acts a, const uint8_t *w,
                                                        const void *dv, const void *mv, float out[RT][NGMAX * KVQ_NC]) {
    __m256 acc[2][RT];
    for (int r = 0; r < RT; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    if (nr == 1) {
        for (int b = 0; b < a.nb; b++) {
            prefetch_block(NIB, HI, w, b);
            half_block(NIB, HI, SGN, F16, NS, OFS, 0, 1, a, w, dv, mv, b, acc[0]);
            half_block(NIB, HI, SGN, F16, NS, OFS, 1, 1, a, w, dv, mv, b, acc[1]);
        }
    } else {
        for (int hf = 0; hf < 2; hf++)
            for (int b = 0; b < a.nb; b++) {
                if (hf == 0) prefetch_block(NIB, HI, w, b);
                half_block(NIB, HI, SGN, F16, NS, OFS, hf, nr, a, w, dv, mv, b, acc[hf]);
            }
    }
    for (int hf = 0; hf < 2; hf++)
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out[r] + 8 * hf, acc[hf][r]);
}

/* -- the K-quant order (qgemm.c) on 8 columns a register: integer sums per block of 32 (16 for
 * Q6_KS), times the file's integer scales into one int32 sum a super-block, and two float steps a
 * super-block. */

/* s + the products of n steps (n 4 or 8; weights W[0..n - 1] of values below 2^HIB, activations at
 * p). AVX2 adds the steps' int16 pair products before widening as far as they cannot overflow: four
 * steps for 5-bit values (8 products under 31 x 127), two for 6-bit ones. */
static inline __attribute__((always_inline)) __m256i ks_dot(const int HI, int n, __m256i s, const __m256i *W,
                                                            const int8_t *p) {
#if ISA == 2
    (void)HI;
    for (int st = 0; st < n; st++) s = _mm256_dpbusd_avx_epi32(s, W[st], _mm256_set1_epi32(word(p + 4 * st)));
    return s;
#else
    const int run = HI == 2 ? 2 : 4;
    for (int s0 = 0; s0 < n; s0 += run) {
        __m256i t = _mm256_maddubs_epi16(W[s0], _mm256_set1_epi32(word(p + 4 * s0)));
        for (int st = s0 + 1; st < s0 + run; st++)
            t = _mm256_add_epi16(t, _mm256_maddubs_epi16(W[st], _mm256_set1_epi32(word(p + 4 * st))));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
    }
    return s;
#endif
}

/* Super-block sb of columns 8 hf .. 8 hf + 7 of the group in the K-quant order, for nr rows:
 * out[r] (+)= its products. */
static inline __attribute__((always_inline)) void ks_half(const int HI, const int KS, int hf, int sb, int nr, Acts a,
                                                          const uint8_t *w, const uint8_t *dv,
                                                          float out[RT][NGMAX * KVQ_NC]) {
    const int qb = 256 + 64 * HI, NS = kvq_ks_ns(KS), steps = 8 / NS, ofs = KS == 2 ? 32 : 0, nsb = a.nb / 8;
    const uint8_t *sp = dv + (int64_t)sb * kvq_ksb(KS);
    __m256i S[RT];
#pragma GCC unroll 16
    for (int r = 0; r < RT; r++) S[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const int64_t b = 8 * sb + j;
        const uint8_t *wb = w + b * qb;
        if (hf == 0)
            for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(wb + PF + l), _MM_HINT_T0);
        __m256i W[8];
        nibble_half(HI, wb, hf, W);
        _Pragma("GCC unroll 2") for (int h = 0; h < NS; h++) {
            const __m128i sv = KS == 1 ? (hf ? _mm_srli_si128(kvq_ks1_scales128(sp, j), 8) : kvq_ks1_scales128(sp, j))
                                       : _mm_loadl_epi64((const __m128i *)(sp + 32 * j + 16 * h + 8 * hf));
            const __m256i sc = KS == 2 ? _mm256_cvtepi8_epi32(sv) : _mm256_cvtepu8_epi32(sv);
#pragma GCC unroll 16
            for (int r = 0; r < RT; r++) {
                if (r < nr) {
                    const int16_t *k16 = a.k16 + (int64_t)r * 2 * a.nb + 2 * b;
                    const __m256i s = ks_dot(HI, steps, _mm256_set1_epi32(-ofs * k16[h]), W + steps * h,
                                             a.kq + (int64_t)r * a.K + 32 * b + 4 * steps * h);
                    S[r] = _mm256_add_epi32(S[r], _mm256_mullo_epi32(s, sc));
                }
            }
        }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + kvq_ks_d(KS) + 16 * hf)));
    /* the minimums' pairs (qformat.h's kvq_ks_pairs) */
    const int npairs = kvq_ks_pairs(KS);
    __m256i mp[8];
    __m256 dm = _mm256_setzero_ps();
    if (KS != 2) {
        dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + kvq_ks_dmin(KS) + 16 * hf)));
        for (int p = 0; p < npairs; p++) {
            __m128i l = KS == 1 ? kvq_ks1_mins128(sp, 2 * p) : _mm_loadu_si128((const __m128i *)(sp + kvq_ks_min(KS, p)));
            __m128i h = KS == 1 ? kvq_ks1_mins128(sp, 2 * p + 1)
                                : _mm_loadu_si128((const __m128i *)(sp + kvq_ks_min(KS, p) + kvq_ks_min_gap(KS)));
            if (hf) {
                l = _mm_srli_si128(l, 8);
                h = _mm_srli_si128(h, 8);
            }
            mp[p] = _mm256_or_si256(_mm256_cvtepu8_epi32(l), _mm256_slli_epi32(_mm256_cvtepu8_epi32(h), 16));
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RT; r++) {
        if (r < nr) {
            const __m256 da = _mm256_set1_ps(a.dk[(int64_t)r * nsb + sb]);
            float *o = out[r] + 8 * hf;
            __m256 acc = _mm256_fmadd_ps(_mm256_mul_ps(da, d), _mm256_cvtepi32_ps(S[r]), _mm256_loadu_ps(o));
            if (KS != 2) {
                const int16_t *ks = kvq_ks_sums(KS, a.k16 + (int64_t)r * 2 * a.nb, a.k32 + (int64_t)r * a.nb, sb);
                __m256i M = _mm256_setzero_si256();
                for (int p = 0; p < npairs; p++) {
#if ISA == 2
                    M = _mm256_dpwssd_avx_epi32(M, mp[p], _mm256_set1_epi32(kvq_pair16(ks + 2 * p)));
#else
                    M = _mm256_add_epi32(M, _mm256_madd_epi16(mp[p], _mm256_set1_epi32(kvq_pair16(ks + 2 * p))));
#endif
                }
                acc = _mm256_fnmadd_ps(_mm256_mul_ps(da, dm), _mm256_cvtepi32_ps(M), acc);
            }
            _mm256_storeu_ps(o, acc);
        }
    }
}

/* Up to RT rows of one group in the K-quant order: each super-block's two halves in turn (the
 * second reads the super-block's weights from cache). */
static inline __attribute__((always_inline)) void ks_group(const int HI, const int KS, int nr, Acts a,
                                                           const uint8_t *w, const uint8_t *dv,
                                                           float out[RT][NGMAX * KVQ_NC]) {
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < KVQ_NC; c++) out[r][c] = 0.f;
    for (int sb = 0; sb < a.nb / 8; sb++)
        for (int hf = 0; hf < 2; hf++) ks_half(HI, KS, hf, sb, nr, a, w, dv, out);
}
