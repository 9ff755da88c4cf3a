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

#endif
