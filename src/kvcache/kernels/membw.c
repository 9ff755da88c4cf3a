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
