/* Attention of a few new tokens per sequence over its float32 KV pages, read in place through the
 * page table (no gathered copy): the "extend" step after a prefix-cache hit or a chat turn, and
 * chunked prefill. Visibility is full and causal: new token t of a sequence holding L tokens (its
 * own T new ones included) sees keys 0 .. L - T + t. No window, no sinks: callers check.
 *
 * Both products are register-tiled like a GEMM. The g * T query rows that share a KV head are
 * columns of a transposed query block QT [D, Gp]; scores come out key-major, st [keys, Gp], so
 * the softmax runs along keys with whole vectors of query rows. Values are then accumulated into
 * [rows, D] tiles with each value row loaded once for several query rows. Keys are split into
 * chunks (work items: sequence x KV head x chunk, run in parallel with OpenMP) whose partial
 * results merge by log-sum-exp.
 *
 * Layouts (S = slots in the pool = pages * ps, Hq = hkv * g, query head h * g + i uses KV head h):
 *   q      [N, Hq, D] float, softmax scale applied; sequence b's rows are row0[b] .. row0[b] + T[b] - 1
 *   kv     [2, hkv, S, D] float (the pool layer's flat view: K then V)
 *   tables [B, max_pages] int64    row0, nnew, lens [B] int64
 *   out    [N, Hq, D] float
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmath.h"

#define NK 6      /* keys per score tile */
#define NRV 6     /* query rows per value tile */
#define CV 4      /* vectors per tile row */
#define CHUNK 256 /* most keys per work item */

#define GP(rows) (((int64_t)(rows) + VL - 1) / VL * VL) /* query rows padded to whole vectors */


typedef struct {
    int64_t b, h, j0, j1;
} item_t;

static inline int64_t slot(const int64_t *table, int ps, int64_t j) { return table[j / ps] * ps + j % ps; }

/* st[j - j0][v0 .. v0 + nv * VL) = K[j] . QT[:, v0 ..) for keys j0 .. j1-1; nv is a constant where
 * this is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void score_cols(int nv, const float *K, const int64_t *table, int ps,
                                                             int D, int64_t j0, int64_t j1, const float *qt,
                                                             int Gp, int v0, float *st) {
    for (int64_t j = j0; j < j1; j += NK) {
        const int nk = j1 - j < NK ? (int)(j1 - j) : NK;
        const float *kr[NK];
        for (int kk = 0; kk < NK; kk++) kr[kk] = K + slot(table, ps, kk < nk ? j + kk : j) * D;
        vec acc[NK][CV];
        for (int kk = 0; kk < NK; kk++)
            for (int v = 0; v < nv; v++) acc[kk][v] = (vec){0};
        for (int c = 0; c < D; c++) {
            vec w[CV];
            for (int v = 0; v < nv; v++) w[v] = *(const vec *)(qt + (int64_t)c * Gp + v0 + VL * v);
            for (int kk = 0; kk < NK; kk++) {
                const float x = kr[kk][c];
                for (int v = 0; v < nv; v++) acc[kk][v] += x * w[v];
            }
        }
        for (int kk = 0; kk < nk; kk++)
            for (int v = 0; v < nv; v++) *(vec *)(st + (j - j0 + kk) * Gp + v0 + VL * v) = acc[kk][v];
    }
}

static void scores(const float *K, const int64_t *table, int ps, int D, int64_t j0, int64_t j1, const float *qt,
                   int Gp, float *st) {
    for (int v0 = 0; v0 < Gp; v0 += VL * CV) {
        switch ((Gp - v0) / VL < CV ? (Gp - v0) / VL : CV) {
        case 1: score_cols(1, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
        case 2: score_cols(2, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
        case 3: score_cols(3, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
        default: score_cols(CV, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
        }
    }
}

/* o[r][d0 .. d0 + nv * VL) = sum_j p[j][r] V[j][d0 ..) for rows r0 .. r0 + nr - 1 (nv constant where
 * inlined). */
static inline __attribute__((always_inline)) void value_cols(int nv, const float *V, const int64_t *table, int ps,
                                                             int D, int64_t j0, int64_t j1, const float *p,
                                                             int Gp, int r0, int nr, int d0, float *o) {
    vec acc[NRV][CV];
    for (int r = 0; r < NRV; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = (vec){0};
    for (int64_t j = j0; j < j1; j++) {
        const float *vr = V + slot(table, ps, j) * D + d0;
        const float *pj = p + (j - j0) * Gp + r0;
        vec w[CV];
        for (int v = 0; v < nv; v++) w[v] = *(const vec *)(vr + VL * v);
        for (int r = 0; r < NRV; r++) {
            const float x = pj[r];  /* rows past nr read other columns of p: their sums are never stored */
            for (int v = 0; v < nv; v++) acc[r][v] += x * w[v];
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) *(vec *)(o + (int64_t)(r0 + r) * D + d0 + VL * v) = acc[r][v];
}

/* o[r][0 .. D) = sum_j p[j][r] V[j] for rows 0 .. G-1 (D a multiple of VL). */
static void values(const float *V, const int64_t *table, int ps, int D, int64_t j0, int64_t j1, const float *p,
                   int Gp, int G, float *o) {
    for (int r0 = 0; r0 < G; r0 += NRV) {
        const int nr = G - r0 < NRV ? G - r0 : NRV;
        for (int d0 = 0; d0 < D; d0 += VL * CV) {
            switch ((D - d0) / VL < CV ? (D - d0) / VL : CV) {
            case 1: value_cols(1, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
            case 2: value_cols(2, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
            case 3: value_cols(3, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
            default: value_cols(CV, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
            }
        }
    }
}

/* One work item: partial softmax state m, l [G] and unnormalized output acc [G, D]. */
static void run_item(const item_t *it, int hkv, int g, int D, int ps, int64_t S, const float *q, const float *kv,
                     const int64_t *tables, int max_pages, const int64_t *row0, const int64_t *nnew,
                     const int64_t *lens, int Gp, float *m, float *l, float *acc, float *qt, float *st) {
    const int64_t b = it->b, h = it->h, T = nnew[b], L = lens[b], Hq = (int64_t)hkv * g;
    const int G = (int)(g * T);
    const int64_t *table = tables + b * max_pages;
    const float *K = kv + h * S * D, *V = kv + (hkv + h) * S * D;
    memset(qt, 0, sizeof(float) * (size_t)D * Gp);
    for (int i = 0; i < g; i++)
        for (int64_t t = 0; t < T; t++) {
            const float *qr = q + ((row0[b] + t) * Hq + h * g + i) * D;
            for (int c = 0; c < D; c++) qt[(int64_t)c * Gp + i * T + t] = qr[c];
        }
    const int64_t j0 = it->j0, j1 = it->j1, first_new = L - T;
    scores(K, table, ps, D, j0, j1, qt, Gp, st);
    for (int r = 0; r < Gp; r++) m[r] = -INFINITY;
    for (int64_t j = j0; j < j1; j++) {
        float *sj = st + (j - j0) * Gp;
        if (j >= first_new) /* causal among the new tokens: row r is new token r % T */
            for (int r = 0; r < G; r++)
                if (j - first_new > r % T) sj[r] = -INFINITY;
        for (int r = 0; r < Gp; r++) m[r] = sj[r] > m[r] ? sj[r] : m[r];
    }
    /* a row that sees no key of this chunk keeps shift 0: its exps are 0 and so is its sum l */
    for (int r = 0; r < Gp; r++) m[r] = m[r] == -INFINITY ? 0.f : m[r];
    for (int r = 0; r < Gp; r++) l[r] = 0.f;
    for (int64_t j = j0; j < j1; j++) {
        float *sj = st + (j - j0) * Gp;
        for (int v = 0; v < Gp; v += VL) {
            const vec e = vexp(*(vec *)(sj + v) - *(vec *)(m + v));
            *(vec *)(sj + v) = e;
            *(vec *)(l + v) += e;
        }
    }
    values(V, table, ps, D, j0, j1, st, Gp, G, acc);
}

int kv_paged_extend(int B, int hkv, int g, int D, int ps, int64_t S, const float *q, const float *kv,
                    const int64_t *tables, int max_pages, const int64_t *row0, const int64_t *nnew,
                    const int64_t *lens, float *out, int n_threads) {
    if (D % VL || B < 1 || n_threads < 1 || hkv < 1 || g < 1 || ps < 1 || S < ps || max_pages < 1) return 1;
    int64_t maxT = 1, items = 0;
    for (int b = 0; b < B; b++) {
        if (nnew[b] < 1 || lens[b] < nnew[b] || row0[b] < 0 || (lens[b] + ps - 1) / ps > max_pages) return 1;
        for (int64_t i = 0; i < (lens[b] + ps - 1) / ps; i++) { /* every page read lies in the pool */
            const int64_t page = tables[(int64_t)b * max_pages + i];
            if (page < 0 || page >= S / ps) return 3;
        }
        if (nnew[b] > maxT) maxT = nnew[b];
    }
    const int Gp = (int)GP(g * maxT);  /* the widest sequence's rows: the per-thread buffers */
    /* chunks: at most CHUNK keys, and enough items to keep every thread busy */
    const int64_t want = (4 * (int64_t)n_threads + (int64_t)B * hkv - 1) / ((int64_t)B * hkv);
    int64_t *nch = (int64_t *)malloc(sizeof(int64_t) * B);
    if (!nch) return 2;
    for (int b = 0; b < B; b++) {
        int64_t by_size = (lens[b] + CHUNK - 1) / CHUNK, by_items = (lens[b] + 63) / 64;
        nch[b] = by_size > want ? by_size : (want < by_items ? want : by_items);
        if (nch[b] < 1) nch[b] = 1;
        items += nch[b] * hkv;
    }
    /* each item's partial result (m, l [Gb], acc [Gb, D]) is sized by its own sequence's rows */
    item_t *its = (item_t *)malloc(sizeof(item_t) * (size_t)items);
    int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(items + 1));
    if (!its || !off) {
        free(nch); free(its); free(off);
        return 2;
    }
    int64_t n_it = 0;
    off[0] = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < hkv; h++)
            for (int64_t c = 0; c < nch[b]; c++) {
                its[n_it].b = b; its[n_it].h = h;
                its[n_it].j0 = lens[b] * c / nch[b];
                its[n_it].j1 = lens[b] * (c + 1) / nch[b];
                off[n_it + 1] = off[n_it] + GP(g * nnew[b]) * (D + 2);
                n_it++;
            }
    float *part = (float *)malloc(sizeof(float) * (size_t)off[items]);
    if (!part) {
        free(nch); free(its); free(off);
        return 2;
    }
    int64_t longest = 1;
    for (int64_t i = 0; i < items; i++)
        if (its[i].j1 - its[i].j0 > longest) longest = its[i].j1 - its[i].j0;
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    {
        float *qt = (float *)malloc(sizeof(float) * (size_t)D * Gp);
        float *st = (float *)malloc(sizeof(float) * (size_t)(longest + NK) * Gp);
        if (!qt || !st) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!qt || !st) continue;
            const int gb = (int)GP(g * nnew[its[i].b]);
            float *pm = part + off[i];
            run_item(its + i, hkv, g, D, ps, S, q, kv, tables, max_pages, row0, nnew, lens, gb, pm, pm + gb,
                     pm + 2 * gb, qt, st);
        }
        free(qt);
        free(st);
    }
    if (!bad) {
        const int64_t Hq = (int64_t)hkv * g;
        int64_t first = 0;
        for (int b = 0; b < B; b++) {
            const int64_t T = nnew[b], gb = GP(g * T);
            for (int h = 0; h < hkv; h++, first += nch[b]) {
                for (int r = 0; r < g * T; r++) {
                    float M = -INFINITY, Lsum = 0.f;
                    for (int64_t c = 0; c < nch[b]; c++) {
                        const float *pm = part + off[first + c];
                        if (pm[gb + r] > 0.f && pm[r] > M) M = pm[r];
                    }
                    float *o = out + ((row0[b] + r % T) * Hq + h * g + r / T) * D;
                    memset(o, 0, sizeof(float) * D);
                    for (int64_t c = 0; c < nch[b]; c++) {
                        const float *pm = part + off[first + c];
                        if (!(pm[gb + r] > 0.f)) continue;  /* nothing visible in this chunk */
                        const float w = expf(pm[r] - M);
                        Lsum += w * pm[gb + r];
                        const float *a = pm + 2 * gb + (int64_t)r * D;
                        for (int d = 0; d < D; d++) o[d] += w * a[d];
                    }
                    const float inv = Lsum > 0.f ? 1.f / Lsum : 0.f; /* nothing visible: zeros */
                    for (int d = 0; d < D; d++) o[d] *= inv;
                }
            }
        }
    }
    free(nch);
    free(its);
    free(off);
    free(part);
    return bad ? 2 : 0;
}
