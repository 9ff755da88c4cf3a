/* A read of memory at the machine's speed, to measure it: the sum of n floats (n a multiple of
 * 4096) split over n_threads, four vector accumulators a thread and software prefetch ahead, as
 * the quantized products read weights. Built into the qgemm library; bench/measure.py times it. */
#include <stdint.h>

#include "vmath.h"

#define BLOCK 4096
#define AHEAD 4096 /* floats prefetched ahead (16 KiB) */

float kv_stream_sum(const float *x, int64_t n, int n_threads) {
    float total = 0.f;
    if (n < BLOCK || n % BLOCK || n_threads < 1) return 0.f;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(n_threads)
    for (int64_t b = 0; b < n / BLOCK; b++) {
        const float *p = x + b * BLOCK;
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int i = 0; i < BLOCK; i += 8 * VL) {
            for (int l = 0; l < 8 * VL; l += 32) __builtin_prefetch(p + i + AHEAD + l);
            a0 += *(const vec *)(p + i) + *(const vec *)(p + i + 4 * VL);
            a1 += *(const vec *)(p + i + VL) + *(const vec *)(p + i + 5 * VL);
            a2 += *(const vec *)(p + i + 2 * VL) + *(const vec *)(p + i + 6 * VL);
            a3 += *(const vec *)(p + i + 3 * VL) + *(const vec *)(p + i + 7 * VL);
        }
        const vec s = (a0 + a1) + (a2 + a3);
        for (int j = 0; j < VL; j++) total += s[j];
    }
    return total;
}

/* The int8 multiply-accumulate peak, to measure it: ``iters`` rounds of 8 independent chains of
 * the variant's int8 dot-product instruction per thread (AVX512-VNNI vpdpbusd on 64 bytes,
 * AVX-VNNI on 32, AVX2 four vpmaddubsw on 32 added in int16 and one vpmaddwd, as the products do;
 * plain C otherwise), on registers only.
 * Returns the multiply-adds done (the caller times the call); the sum keeps the work alive. */
#if defined(__x86_64__)
#include <immintrin.h>
#endif

int64_t kv_int8_peak(int64_t iters, int n_threads, int64_t *sink) {
    int64_t macs = 0, keep = 0;
#pragma omp parallel num_threads(n_threads) reduction(+ : macs, keep)
    {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        __m512i a[8], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1);
        for (int k = 0; k < 8; k++) a[k] = _mm512_set1_epi32(k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < 8; k++) a[k] = _mm512_dpbusd_epi32(a[k], w, x);
        for (int k = 1; k < 8; k++) a[0] = _mm512_add_epi32(a[0], a[k]);
        keep += _mm512_reduce_add_epi32(a[0]);
        macs += iters * 8 * 64;
#elif defined(__AVXVNNI__)
        __m256i a[8], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(1);
        for (int k = 0; k < 8; k++) a[k] = _mm256_set1_epi32(k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < 8; k++) a[k] = _mm256_dpbusd_avx_epi32(a[k], w, x);
        for (int k = 1; k < 8; k++) a[0] = _mm256_add_epi32(a[0], a[k]);
        keep += _mm256_extract_epi32(a[0], 0);
        macs += iters * 8 * 32;
#elif defined(__AVX2__)
        /* the products' own mix (qtile256.h's dot4): four steps' u8 x s8 pairs added in int16, then
         * one vpmaddwd and one add a chain: 128 multiply-adds for 9 instructions */
        __m256i a[8], w[8], x[4], ones = _mm256_set1_epi16(1);
        for (int k = 0; k < 8; k++) a[k] = _mm256_set1_epi32(k), w[k] = _mm256_set1_epi8((char)(3 + k));
        for (int m = 0; m < 4; m++) x[m] = _mm256_set1_epi8((char)(1 + m));
        for (int64_t i = 0; i < iters; i++) {
            /* the operands as new values each round: no product can be hoisted or shared */
            __asm__("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(w[3]), "+x"(w[4]), "+x"(w[5]), "+x"(w[6]), "+x"(w[7]));
            __asm__("" : "+x"(x[0]), "+x"(x[1]), "+x"(x[2]), "+x"(x[3]));
            for (int k = 0; k < 8; k++) {
                const __m256i p = _mm256_maddubs_epi16(w[k], x[0]), q = _mm256_maddubs_epi16(w[k], x[1]);
                const __m256i r = _mm256_maddubs_epi16(w[k], x[2]), t = _mm256_maddubs_epi16(w[k], x[3]);
                a[k] = _mm256_add_epi32(a[k], _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p, q),
                                                                                 _mm256_add_epi16(r, t)), ones));
            }
        }
        for (int k = 1; k < 8; k++) a[0] = _mm256_add_epi32(a[0], a[k]);
        keep += _mm256_extract_epi32(a[0], 0);
        macs += iters * 8 * 128;
#else
        int32_t a[8] = {0};
        volatile int8_t wv = 3, xv = 1;
        const int8_t w = wv, x = xv;
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < 8; k++) a[k] += (int32_t)w * x;
        for (int k = 0; k < 8; k++) keep += a[k];
        macs += iters * 8;
#endif
    }
    *sink = keep;
    return macs;
}
