/* Batched decode attention straight from float32 KV pages: one query token per sequence, every
 * sequence with its own page table, no gathered copy of the cache.
 *
 * Work items are (sequence, KV head) pairs, run in parallel (OpenMP). Each scores its g query
 * heads against the sequence's keys page by page, takes the softmax and accumulates the value
 * rows. Visibility is full (no window, no sinks): the caller uses this only then.
 *
 * Layouts (S = slots in the pool = pages * ps):
 *   q     [B, hkv, g, D] float, already multiplied by the softmax scale
 *   kv    [2, hkv, S, D] float (the pool layer's flat view: K then V)
 *   tables[B, max_pages] int64 (pool page of each logical page)
 *   lens  [B] int64 (tokens to attend to, the query's own included)
 *   out   [B, hkv, g, D] float
 * Returns 0, 1 for bad sizes, 2 when memory runs out, 3 for a page-table entry outside the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pspan.h"

#define MAXG 32

static void one(int hkv, int g, int D, int ps, int64_t S, const float *q, const float *kv,
                const int64_t *table, int64_t len, int h, float *out, float *scores) {
    const float *K = kv + (int64_t)h * S * D;
    const float *V = kv + ((int64_t)hkv + h) * S * D;
    float m[MAXG], l[MAXG];
    span_attend(g, D, ps, q, K, V, table, 0, len, 1.f, scores, m, l, out);
    for (int i = 0; i < g; i++) {
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int c = 0; c < D; c++) out[(int64_t)i * D + c] *= inv;
    }
}

int kv_paged_decode(int B, int hkv, int g, int D, int ps, int64_t S, const float *q, const float *kv,
                    const int64_t *tables, int max_pages, const int64_t *lens, float *out, int n_threads) {
    if (B < 1 || hkv < 1 || g < 1 || g > MAXG || D < 1 || ps < 1 || S < ps || max_pages < 1) return 1;
    int64_t longest = 1;
    for (int b = 0; b < B; b++) {
        if (lens[b] < 1 || (lens[b] + ps - 1) / ps > max_pages) return 1;
        for (int64_t i = 0; i < (lens[b] + ps - 1) / ps; i++) { /* every page read lies in the pool */
            const int64_t page = tables[(int64_t)b * max_pages + i];
            if (page < 0 || page >= S / ps) return 3;
        }
        if (lens[b] > longest) longest = lens[b];
    }
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)g * (size_t)longest);
        if (!scores) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < B * hkv; w++) {
            if (!scores) continue;
            const int b = w / hkv, h = w % hkv;
            one(hkv, g, D, ps, S, q + ((int64_t)b * hkv + h) * g * D, kv, tables + (int64_t)b * max_pages,
                lens[b], h, out + ((int64_t)b * hkv + h) * g * D, scores);
        }
        free(scores);
    }
    return bad ? 2 : 0;
}
