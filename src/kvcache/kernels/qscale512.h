/* The scales of a column group's sub-block as the AVX-512 kernels take them (qtile512.h's VNNI
 * tiles and qamx.c's AMX tiles): one definition, so both multiply by the very same values. Needs
 * immintrin.h and qformat.h, and an AVX-512 build. */
#ifndef KV_QSCALE512_H
#define KV_QSCALE512_H

/* The 16 columns' scales (and minimums when MIN) of sub-block h of block b; dv, mv at the group's
 * arrays. Scale kinds (F16): 0 fp32, 1 fp16. */
static inline __attribute__((always_inline)) void scales16(const int F16, const int MIN, const void *dv,
                                                           const void *mv, int b, int NS, int h, __m512 *dw,
                                                           __m512 *mw) {
    const int64_t at = ((int64_t)b * NS + h) * KVQ_NC;
    *dw = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)dv + at)))
              : _mm512_loadu_ps((const float *)dv + at);
    if (MIN)
        *mw = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)mv + at)))
                  : _mm512_loadu_ps((const float *)mv + at);
}

/* The K-quant order's steps (qgemm.c), shared in the same way. */

/* Column c's integer scales of sub-block h of block j (h 0 for 32-input sub-blocks), sixteen columns
 * as int32 lanes. */
static inline __attribute__((always_inline)) __m512i ks_scales16(const int KS, const uint8_t *sp, int j, int h) {
    if (KS == 1) return _mm512_cvtepu8_epi32(kvq_ks1_scales128(sp, j));
    const __m128i v = _mm_loadu_si128((const __m128i *)(sp + 32 * j + 16 * h));
    return KS == 2 ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

/* Minimum pair p (qformat.h's kvq_ks_pairs) as 16-bit pairs, a column a lane. */
static inline __attribute__((always_inline)) __m512i ks_min_pair(const int KS, const uint8_t *sp, int p) {
    const __m128i l = KS == 1 ? kvq_ks1_mins128(sp, 2 * p) : _mm_loadu_si128((const __m128i *)(sp + kvq_ks_min(KS, p)));
    const __m128i h = KS == 1 ? kvq_ks1_mins128(sp, 2 * p + 1)
                              : _mm_loadu_si128((const __m128i *)(sp + kvq_ks_min(KS, p) + kvq_ks_min_gap(KS)));
    return _mm512_or_si512(_mm512_cvtepu8_epi32(l), _mm512_slli_epi32(_mm512_cvtepu8_epi32(h), 16));
}

/* The super-block's fp16 d (dmin: its minimums' step), sixteen columns as floats. */
static inline __attribute__((always_inline)) __m512 ks_d16(const int KS, const uint8_t *sp, int dmin) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + (dmin ? kvq_ks_dmin(KS) : kvq_ks_d(KS)))));
}

/* The two float steps themselves, from the integer sums S and the minimums' sum M (MIN: the format
 * has minimums), d and dmin as ks_d16 has them and the row's step dk. */
static inline __attribute__((always_inline)) __m512 ks_steps(const int MIN, __m512 acc, __m512i S, __m512i M, float dk,
                                                             __m512 d, __m512 dmin) {
    const __m512 da = _mm512_set1_ps(dk);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(da, d), _mm512_cvtepi32_ps(S), acc);
    if (MIN) acc = _mm512_fnmadd_ps(_mm512_mul_ps(da, dmin), _mm512_cvtepi32_ps(M), acc);
    return acc;
}

/* The super-block's two float steps for one row and group: acc (+)= dk d S - dk dmin M, with M the
 * minimums' pairs mp times the row's activation sums ks (k32 for KS 1, k16 for KS 3, at the
 * super-block). */
static inline __attribute__((always_inline)) __m512 ks_close(const int KS, __m512 acc, __m512i S, const uint8_t *sp,
                                                             float dk, const int16_t *ks, const __m512i mp[8]) {
    __m512i M = _mm512_setzero_si512();
    if (KS != 2)
        for (int p = 0; p < kvq_ks_pairs(KS); p++)
            M = _mm512_dpwssd_epi32(M, mp[p], _mm512_set1_epi32(kvq_pair16(ks + 2 * p)));
    return ks_steps(KS != 2, acc, S, M, dk, ks_d16(KS, sp, 0), KS != 2 ? ks_d16(KS, sp, 1) : _mm512_setzero_ps());
}

#endif
