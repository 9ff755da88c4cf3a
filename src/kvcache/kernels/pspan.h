/* Attention of g query heads (one KV head) over a span of a sequence's keys read straight from
 * float32 pages: positions j0 .. j0 + n - 1 through the page table (ps tokens a page), K and V
 * [S, D] the KV head's slots. Writes the scores q.k * scale into scores [g, n] and then
 * exp(score - m) in their place, the maximum into m [g], the sum of the exponentials into l [g] and
 * the unnormalized sum of value rows into acc [g, D]: the caller divides by l (one span) or merges
 * spans by their m and l. Shared by pattn.c (one span: the whole sequence) and dattn.c (chunks). */
#ifndef KV_PSPAN_H
#define KV_PSPAN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline void span_attend(int g, int D, int ps, const float *q, const float *K, const float *V,
                               const int64_t *table, int64_t j0, int64_t n, float scale, float *scores, float *m,
                               float *l, float *acc) {
    for (int j = 0; j < g; j++) m[j] = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const int64_t p = j0 + t;
        const float *k = K + (table[p / ps] * ps + p % ps) * D;
        for (int j = 0; j < g; j++) {
            const float *qj = q + (int64_t)j * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int c = 0; c < D; c++) s += qj[c] * k[c];
            s *= scale;
            scores[(int64_t)j * n + t] = s;
            if (s > m[j]) m[j] = s;
        }
    }
    for (int j = 0; j < g; j++) {
        float sum = 0.f, *sj = scores + (int64_t)j * n;
        for (int64_t t = 0; t < n; t++) {
            sj[t] = expf(sj[t] - m[j]);
            sum += sj[t];
        }
        l[j] = sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)g * D);
    for (int64_t t = 0; t < n; t++) {
        const int64_t p = j0 + t;
        const float *v = V + (table[p / ps] * ps + p % ps) * D;
        for (int j = 0; j < g; j++) {
            const float w = scores[(int64_t)j * n + t];
            float *o = acc + (int64_t)j * D;
#pragma omp simd
            for (int c = 0; c < D; c++) o[c] += w * v[c];
        }
    }
}

#endif
