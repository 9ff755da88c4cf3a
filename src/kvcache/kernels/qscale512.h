/* The scales of a column group's sub-block as the AVX-512 kernels take them (qtile512.h's VNNI
 * tiles and qamx.c's AMX tiles): one definition, so both multiply by the very same values. Needs
 * immintrin.h and qformat.h, and an AVX-512 build. */
#ifndef KV_QSCALE512_H
#define KV_QSCALE512_H

/* The 16 columns' scales (and minimums when MIN) of sub-block h of block b; dv, mv at the group's
 * arrays. Scale kinds (F16): 0 fp32, 1 fp16, 2 and 3 the file's K-quant integers times its fp16 d
 * (and dmin), exact (qgemm.c's scale_at). */
static inline __attribute__((always_inline)) void scales16(const int F16, const int MIN, const void *dv,
                                                           const void *mv, int b, int NS, int h, __m512 *dw,
                                                           __m512 *mw) {
    if (F16 == 3) { /* signed scales per 16 times the fp16 d (exact) */
        const uint8_t *sb = (const uint8_t *)dv + (int64_t)(b >> 3) * KVQ_KSB;
        *dw = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + (b & 7) * 32 + 16 * h)))),
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 256))));
        return;
    }
    if (F16 == 2) {
        const uint8_t *sb = (const uint8_t *)dv + (int64_t)(b >> 3) * KVQ_KSB, *sj = sb + (b & 7) * 32;
        *dw = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sj))),
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 256))));
        *mw = _mm512_sub_ps(_mm512_setzero_ps(),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sj + 16)))),
                                          _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 288)))));
        return;
    }
    const int64_t at = ((int64_t)b * NS + h) * KVQ_NC;
    *dw = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)dv + at)))
              : _mm512_loadu_ps((const float *)dv + at);
    if (MIN)
        *mw = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)mv + at)))
                  : _mm512_loadu_ps((const float *)mv + at);
}

/* The K-quant order's steps (qgemm.c), shared in the same way. */
static inline __attribute__((always_inline)) int32_t ks_pair16(const int16_t *p) { /* two sums as one lane */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Column c's integer scales of sub-block h of block j, sixteen columns as int32 lanes. */
static inline __attribute__((always_inline)) __m512i ks_scales16(const int KS, const uint8_t *sp, int j, int h) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(sp + 32 * j + 16 * h));
    return KS == 2 ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

/* The minimums of blocks 2 p and 2 p + 1 as 16-bit pairs, a column a lane (vpdpwssd's layout). */
static inline __attribute__((always_inline)) __m512i ks_min_pair(const uint8_t *sp, int p) {
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sp + 64 * p + 16)));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sp + 64 * p + 48)));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* The super-block's two float steps for one row and group: acc (+)= dk d S - dk dmin M. */
static inline __attribute__((always_inline)) __m512 ks_close(const int KS, __m512 acc, __m512i S, const uint8_t *sp,
                                                             float dk, const int16_t *k32, const __m512i mp[4]) {
    const __m512 da = _mm512_set1_ps(dk);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(da, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + 256)))),
                          _mm512_cvtepi32_ps(S), acc);
    if (KS == 1) {
        __m512i M = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) M = _mm512_dpwssd_epi32(M, mp[p], _mm512_set1_epi32(ks_pair16(k32 + 2 * p)));
        acc = _mm512_fnmadd_ps(_mm512_mul_ps(da, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + 288)))),
                               _mm512_cvtepi32_ps(M), acc);
    }
    return acc;
}

#endif
