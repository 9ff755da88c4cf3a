/* Attention over float32 KV pages in one canonical order: every query row's result is the same bits
 * whatever else is computed beside it (the batch, the other new tokens of its forward, the number
 * of threads, a decode or a prefill, a prefix hit or a recompute). Built into the qgemm library;
 * dattn.c (decode and extend fused with the projections) and kv_paged_attend use it.
 *
 * The order, for one query row at position p of a sequence (it sees keys 0 .. p, or p - W + 1 .. p
 * with a sliding window of W):
 *   - keys go in chunks of CH at fixed positions: chunk c holds keys c*CH .. c*CH + CH - 1;
 *   - in a chunk, each score is one fused multiply-add chain over the head dimension, d = 0 .. D-1,
 *     of the query (scale applied beforehand) and the key; the chunk's maximum m, exp(s - m) by
 *     vexp, their sum l in key order, and the value sum acc, one multiply-add chain per output
 *     element in key order (keys past p or before the window are masked to -inf: they add exact
 *     zeros, so a call may start or end a chunk's range at any masked key: a row's bits stay);
 *   - chunks merge in order 0, 1, 2, ...: a running (M, L, O) takes each chunk that sees a key
 *     (``merge_into``), and the output is O / L (``finish``).
 * The functions doing each step are compiled once (noinline), so every caller runs the same
 * instructions. How work is spread does not enter the arithmetic: a sequence with a few new
 * tokens (decodes) splits its chunks over the threads and merges the stored partials in order; one
 * with many (prefill) gives each thread blocks of RB rows that run their chunks in order. Both
 * sides tile like a GEMM: the g * rows query rows sharing a KV head are the columns of a transposed
 * query block QT [D, Gp]; each key row is loaded once for them, each value row once per tile. A
 * block of at most 8 rows (a decode's GQA group) scores with 8-lane vectors on AVX-512 and its value
 * tiles hold 4 rows where they can: a lane's chain is the same at any vector width, so the bits are.
 * With a window, keys before the window of a call's first new row are never read (their pages may
 * have gone back to the pool: holes in the table).
 *
 * Layouts (S = slots in the pool = pages * ps, Hq = hkv * g, query head h * g + i uses KV head h):
 *   q      [N, ...] float, row n's head k at q + n * ldq + k * D; sequence b's new tokens are rows
 *          row0[b] .. row0[b] + nnew[b] - 1; lens[b] counts its tokens, the new ones included
 *   kv     [2, hkv, S, D] float (the pool layer's flat view: K then V)
 *   tables [B, max_pages] int64
 *   out    [N, Hq * D] float
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cattn.h"
#include "vmath.h"

#define NK 6      /* keys per score tile */
#define NRV 6     /* query rows per value tile */
#define CV 4      /* vectors per tile row */
#define RB 32     /* new tokens per row block of a prefill work item */
#define SPLIT 8   /* sequences with at most this many new tokens split their chunks over the threads */
#define GP(rows) (((int64_t)(rows) + VL - 1) / VL * VL) /* query rows padded to whole vectors */
#define NOINLINE __attribute__((noinline))

static inline int64_t slot(const int64_t *table, int ps, int64_t j) { return table[j / ps] * ps + j % ps; }

/* st[j - j0][v0 .. v0 + nv * VL) = K[j] . QT[:, v0 ..) for keys j0 .. j1-1 (nv constant where inlined). */
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
                for (int v = 0; v < nv; v++) acc[kk][v] = vmadd((vec){0} + x, w[v], acc[kk][v]);
            }
        }
        for (int kk = 0; kk < nk; kk++)
            for (int v = 0; v < nv; v++) *(vec *)(st + (j - j0 + kk) * Gp + v0 + VL * v) = acc[kk][v];
    }
}

#if VL == 16
/* score_cols for at most 8 query rows (a decode's GQA group): half-width vectors, the same chain
 * per lane (a lane's score does not depend on the vector width), half the work on CPUs that split
 * 512-bit operations; the upper 8 lanes of st are written as zeros. */
static NOINLINE void score_cols8(const float *K, const int64_t *table, int ps, int D, int64_t j0, int64_t j1,
                                 const float *qt, int Gp, float *st) {
    for (int64_t j = j0; j < j1; j += NK) {
        const int nk = j1 - j < NK ? (int)(j1 - j) : NK;
        const float *kr[NK];
        for (int kk = 0; kk < NK; kk++) kr[kk] = K + slot(table, ps, kk < nk ? j + kk : j) * D;
        v8 acc[NK];
        for (int kk = 0; kk < NK; kk++) acc[kk] = (v8){0};
        for (int c = 0; c < D; c++) {
            const v8 w = *(const v8 *)(qt + (int64_t)c * Gp);
            for (int kk = 0; kk < NK; kk++) acc[kk] = vmadd8((v8){0} + kr[kk][c], w, acc[kk]);
        }
        for (int kk = 0; kk < nk; kk++) {
            float *o = st + (j - j0 + kk) * Gp;
            *(v8 *)o = acc[kk];
            *(v8 *)(o + 8) = (v8){0};
        }
    }
}
#endif

/* o[r][d0 .. d0 + nv * VL) = sum_j p[j][r] V[j][d0 ..) for rows r0 .. r0 + nr - 1, NR >= nr of them
 * computed (nv and NR constant). */
static inline __attribute__((always_inline)) void value_cols(int nv, int NR, const float *V, const int64_t *table,
                                                             int ps, int D, int64_t j0, int64_t j1, const float *p,
                                                             int Gp, int r0, int nr, int d0, float *o) {
    vec acc[NRV][CV];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = (vec){0};
    for (int64_t j = j0; j < j1; j++) {
        const float *vr = V + slot(table, ps, j) * D + d0;
        const float *pj = p + (j - j0) * Gp + r0;
        vec w[CV];
        for (int v = 0; v < nv; v++) w[v] = *(const vec *)(vr + VL * v);
        for (int r = 0; r < NR; r++) {
            const float x = pj[r]; /* rows past nr read other columns of p: their sums are never stored */
            for (int v = 0; v < nv; v++) acc[r][v] = vmadd((vec){0} + x, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) *(vec *)(o + (int64_t)(r0 + r) * D + d0 + VL * v) = acc[r][v];
}

/* value_cols with nv made a constant (1 .. CV vectors of the head dimension) for NR tile rows. */
static inline __attribute__((always_inline)) void value_tile(int nv, int NR, const float *V, const int64_t *table,
                                                             int ps, int D, int64_t j0, int64_t j1, const float *p,
                                                             int Gp, int r0, int nr, int d0, float *o) {
    switch (nv) {
    case 1: value_cols(1, NR, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
    case 2: value_cols(2, NR, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
    case 3: value_cols(3, NR, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
    default: value_cols(CV, NR, V, table, ps, D, j0, j1, p, Gp, r0, nr, d0, o); break;
    }
}

/* One chunk (keys j0 .. j1 - 1) for the G query rows in qt [D, Gp]: row r is new token r % nt,
 * whose position is first + r % nt (it sees keys up to it, and with a window W > 0 none before
 * first + r % nt - W + 1). Out: m, l [Gp], acc [G, D]; a row that sees no key here gets l = 0.
 * st: scratch [(j1 - j0 + NK), Gp]. */
static NOINLINE void chunk_partial(const float *K, const float *V, const int64_t *table, int ps, int D, int64_t j0,
                                   int64_t j1, const float *qt, int Gp, int G, int nt, int64_t first, int64_t W,
                                   float *st, float *m, float *l, float *acc) {
#if VL == 16
    if (G <= 8)
        score_cols8(K, table, ps, D, j0, j1, qt, Gp, st);
    else
#endif
        for (int v0 = 0; v0 < Gp; v0 += VL * CV) {
            switch ((Gp - v0) / VL < CV ? (Gp - v0) / VL : CV) {
            case 1: score_cols(1, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
            case 2: score_cols(2, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
            case 3: score_cols(3, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
            default: score_cols(CV, K, table, ps, D, j0, j1, qt, Gp, v0, st); break;
            }
        }
    for (int r = 0; r < Gp; r++) m[r] = -INFINITY;
    for (int64_t j = j0; j < j1; j++) {
        float *sj = st + (j - j0) * Gp;
        if (j > first) /* causal among the new tokens */
            for (int r = 0; r < G; r++)
                if (j - first > r % nt) sj[r] = -INFINITY;
        if (W && j <= first + nt - 1 - W) /* before some row's window */
            for (int r = 0; r < G; r++)
                if (first + r % nt - j >= W) sj[r] = -INFINITY;
        for (int r = 0; r < Gp; r++) m[r] = sj[r] > m[r] ? sj[r] : m[r];
    }
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
    for (int r0 = 0; r0 < G; r0 += NRV) {
        const int nr = G - r0 < NRV ? G - r0 : NRV;
        for (int d0 = 0; d0 < D; d0 += VL * CV) {
            const int nv = (D - d0) / VL < CV ? (D - d0) / VL : CV;
            if (nr <= 4) /* a decode's group of 4 (GQA): no tile rows past it */
                value_tile(nv, 4, V, table, ps, D, j0, j1, st, Gp, r0, nr, d0, acc);
            else
                value_tile(nv, NRV, V, table, ps, D, j0, j1, st, Gp, r0, nr, d0, acc);
        }
    }
}

/* The running state (M, L [G], O [G, D]; M = -inf before the first chunk) takes one chunk's partial. */
static NOINLINE void merge_into(int G, int D, float *M, float *L, float *O, const float *m, const float *l,
                                const float *acc) {
    for (int r = 0; r < G; r++) {
        if (!(l[r] > 0.f)) continue; /* the row sees no key of this chunk */
        float *o = O + (int64_t)r * D;
        const float *a = acc + (int64_t)r * D;
        if (M[r] == -INFINITY) {
            M[r] = m[r];
            L[r] = l[r];
            memcpy(o, a, sizeof(float) * (size_t)D);
            continue;
        }
        const float mx = m[r] > M[r] ? m[r] : M[r], wo = kv_exp1(M[r] - mx), wn = kv_exp1(m[r] - mx);
        L[r] = L[r] * wo + l[r] * wn;
        for (int d = 0; d < D; d++) o[d] = o[d] * wo + a[d] * wn;
        M[r] = mx;
    }
}

/* Row r of the state (head i = r / nt of KV head h, new token t = r % nt) divided by its sum, into out.
 * With sinks (gpt-oss: a logit per query head, already on the scaled scores' scale) the sum takes
 * exp(sink - M) too and no value: O / (L + exp(sink - M)), or, where the sink is above the row's
 * maximum, (O w) / (L w + 1) with w = exp(M - sink), so every exp is of a non-positive number. */
static NOINLINE void finish(int G, int D, int nt, int g, int h, const float *M, const float *L, const float *O,
                            const float *sinks, float *out, int64_t ldo) {
    for (int r = 0; r < G; r++) {
        float inv = L[r] > 0.f ? 1.f / L[r] : 0.f; /* nothing visible: zeros */
        float *o = out + (int64_t)(r % nt) * ldo + ((int64_t)h * g + r / nt) * D;
        const float *s = O + (int64_t)r * D;
        if (sinks && L[r] > 0.f) {
            const float z = sinks[(int64_t)h * g + r / nt];
            if (z <= M[r]) {
                inv = 1.f / (L[r] + kv_exp1(z - M[r]));
            } else {
                const float w = kv_exp1(M[r] - z);
                inv = 1.f / (L[r] * w + 1.f);
                for (int d = 0; d < D; d++) o[d] = (s[d] * w) * inv;
                continue;
            }
        }
        for (int d = 0; d < D; d++) o[d] = s[d] * inv;
    }
}

typedef struct {
    int b, h, nt, split;
    int64_t t0, c0, c1;
} item_t;

struct CAttn {
    int B, hkv, g, D, ps, max_pages;
    int64_t S, ldq, W;
    const float *q, *kv;
    const int64_t *tables, *row0, *nnew, *lens;
    float *out;
    const float *sinks; /* [hkv * g] a logit per query head that joins each softmax, or NULL */
    int64_t items, scratch_gp;
    item_t *its;
    int64_t *off; /* split items: where each one's partial (m, l [Gp], acc [Gp, D]) lies in part */
    float *part;
    int64_t *first; /* per (sequence, KV head) of a split sequence: its first item */
};

static int64_t chunks_of(int64_t keys) { return (keys + KV_CH - 1) / KV_CH; }

/* The first key a row at position p reads: 0, or the start of its window. */
static int64_t first_key(int64_t p, int64_t W) { return W && p - W + 1 > 0 ? p - W + 1 : 0; }

int cattn_check(int B, int hkv, int g, int D, int ps, int64_t S, const int64_t *tables, int max_pages,
                const int64_t *row0, const int64_t *nnew, const int64_t *lens, int64_t W, int64_t n_rows) {
    if (D % VL || B < 1 || hkv < 1 || g < 1 || ps < 1 || S < ps || max_pages < 1 || W < 0) return 1;
    for (int b = 0; b < B; b++) {
        if (nnew[b] < 1 || lens[b] < nnew[b] || row0[b] < 0 || row0[b] + nnew[b] > n_rows ||
            (lens[b] + ps - 1) / ps > max_pages)
            return 1;
        /* every page read lies in the pool */
        for (int64_t i = first_key(lens[b] - nnew[b], W) / ps; i < (lens[b] + ps - 1) / ps; i++) {
            const int64_t page = tables[(int64_t)b * max_pages + i];
            if (page < 0 || page >= S / ps) return 3;
        }
    }
    return 0;
}

CAttn *cattn_plan(int B, int hkv, int g, int D, int ps, int64_t S, const float *q, int64_t ldq,
                  const int64_t *tables, int max_pages, const int64_t *row0, const int64_t *nnew,
                  const int64_t *lens, int64_t W, float *out) {
    CAttn *a = calloc(1, sizeof(CAttn));
    if (!a) return NULL;
    *a = (CAttn){B, hkv, g, D, ps, max_pages, S, ldq, W, q, NULL, tables, row0, nnew, lens, out, NULL, 0, VL,
                 NULL, NULL, NULL, NULL};
    int64_t items = 0, parts = 0;
    for (int b = 0; b < B; b++) {
        const int64_t T = nnew[b];
        if (T <= SPLIT) {
            items += hkv * (chunks_of(lens[b]) - first_key(lens[b] - T, W) / KV_CH);
            if (GP(g * T) > a->scratch_gp) a->scratch_gp = GP(g * T);
        } else {
            for (int64_t t0 = 0; t0 < T; t0 += RB) items += hkv;
            const int64_t rows = T < RB ? T : RB;
            if (GP(g * rows) > a->scratch_gp) a->scratch_gp = GP(g * rows);
        }
    }
    a->its = malloc(sizeof(item_t) * (size_t)items);
    a->off = malloc(sizeof(int64_t) * (size_t)(items + 1));
    a->first = malloc(sizeof(int64_t) * (size_t)B * hkv);
    if (!a->its || !a->off || !a->first) {
        cattn_free(a);
        return NULL;
    }
    int64_t n = 0;
    for (int b = 0; b < B; b++) {
        const int64_t T = nnew[b], L = lens[b];
        for (int h = 0; h < hkv; h++) {
            a->first[(int64_t)b * hkv + h] = n;
            if (T <= SPLIT) {
                for (int64_t c = first_key(L - T, W) / KV_CH; c < chunks_of(L); c++, n++) {
                    a->its[n] = (item_t){b, h, (int)T, 1, 0, c, c + 1};
                    a->off[n] = parts;
                    parts += GP(g * T) * (D + 2);
                }
            } else {
                for (int64_t t0 = 0; t0 < T; t0 += RB, n++) {
                    const int nt = (int)(T - t0 < RB ? T - t0 : RB);
                    a->its[n] = (item_t){b, h, nt, 0, t0, first_key(L - T + t0, W) / KV_CH,
                                         chunks_of(L - T + t0 + nt)};
                    a->off[n] = -1;
                }
            }
        }
    }
    a->items = n;
    a->part = malloc(sizeof(float) * (size_t)(parts > 0 ? parts : 1));
    if (!a->part) {
        cattn_free(a);
        return NULL;
    }
    return a;
}

void cattn_free(CAttn *a) {
    if (!a) return;
    free(a->its);
    free(a->off);
    free(a->first);
    free(a->part);
    free(a);
}

/* Item i: its rows' queries into qt, then its chunk (split) or all its chunks merged in order. */
static void run_item(const CAttn *a, int64_t i, float *qt, float *st, float *st8) {
    const item_t *it = a->its + i;
    const int g = a->g, D = a->D, nt = it->nt, G = g * nt, Gp = (int)GP(G);
    const int64_t b = it->b, h = it->h, L = a->lens[b], first = L - a->nnew[b] + it->t0;
    const int64_t *table = a->tables + b * a->max_pages;
    const float *K = a->kv + h * a->S * D, *V = a->kv + (a->hkv + h) * a->S * D;
    memset(qt, 0, sizeof(float) * (size_t)D * Gp);
    for (int k = 0; k < g; k++)
        for (int t = 0; t < nt; t++) {
            const float *qr = a->q + (a->row0[b] + it->t0 + t) * a->ldq + (h * g + k) * D;
            for (int c = 0; c < D; c++) qt[(int64_t)c * Gp + k * nt + t] = qr[c];
        }
    const int64_t lo = first_key(first, a->W); /* no key before it is read */
    if (it->split) {
        float *m = a->part + a->off[i], *l = m + Gp, *acc = m + 2 * Gp;
        const int64_t c0 = it->c0 * KV_CH, j0 = c0 > lo ? c0 : lo, j1 = c0 + KV_CH < L ? c0 + KV_CH : L;
        chunk_partial(K, V, table, a->ps, D, j0, j1, qt, Gp, G, nt, first, a->W, st, m, l, acc);
        return;
    }
    /* st8: the running state M, L [Gp], O [Gp, D], then the chunk's m, l [Gp], acc [Gp, D] */
    float *M = st8, *Ls = M + Gp, *O = Ls + Gp, *m = O + (int64_t)Gp * D, *l = m + Gp, *acc = l + Gp;
    for (int r = 0; r < Gp; r++) {
        M[r] = -INFINITY;
        Ls[r] = 0.f;
    }
    const int64_t last = first + nt; /* keys the block's last row sees */
    for (int64_t c = it->c0; c < it->c1; c++) {
        const int64_t c0 = c * KV_CH, j0 = c0 > lo ? c0 : lo, j1 = c0 + KV_CH < last ? c0 + KV_CH : last;
        chunk_partial(K, V, table, a->ps, D, j0, j1, qt, Gp, G, nt, first, a->W, st, m, l, acc);
        merge_into(G, D, M, Ls, O, m, l, acc);
    }
    finish(G, D, nt, g, (int)h, M, Ls, O, a->sinks, a->out + (a->row0[b] + it->t0) * (int64_t)a->hkv * g * D,
           (int64_t)a->hkv * g * D);
}

/* A split sequence's KV head: its chunks' partials merged in order, into out. */
static void merge_split(const CAttn *a, int b, int h, float *st8) {
    const int g = a->g, D = a->D, nt = (int)a->nnew[b], G = g * nt, Gp = (int)GP(G);
    const int64_t first = a->first[(int64_t)b * a->hkv + h],
                  n = chunks_of(a->lens[b]) - first_key(a->lens[b] - nt, a->W) / KV_CH;
    float *M = st8, *Ls = M + Gp, *O = Ls + Gp;
    for (int r = 0; r < Gp; r++) {
        M[r] = -INFINITY;
        Ls[r] = 0.f;
    }
    for (int64_t c = 0; c < n; c++) {
        const float *m = a->part + a->off[first + c];
        merge_into(G, D, M, Ls, O, m, m + Gp, m + 2 * Gp);
    }
    finish(G, D, nt, g, h, M, Ls, O, a->sinks, a->out + a->row0[b] * (int64_t)a->hkv * g * D,
           (int64_t)a->hkv * g * D);
}

void cattn_set_sinks(CAttn *a, const float *sinks) { a->sinks = sinks; }

void cattn_in_region(const CAttn *plan, const float *kv, int *bad) {
    CAttn c = *plan; /* this call's pool layer; the rest is the plan's */
    c.kv = kv;
    const CAttn *a = &c;
    const int64_t gp = a->scratch_gp, D = a->D;
    float *qt = malloc(sizeof(float) * (size_t)(D * gp + (KV_CH + NK) * gp + 2 * gp * (D + 2)));
    if (!qt) {
#pragma omp atomic write
        *bad = 1;
    }
    float *st = qt + D * gp, *st8 = st + (KV_CH + NK) * gp;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a->items; i++)
        if (qt) run_item(a, i, qt, st, st8);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < (int64_t)a->B * a->hkv; w++) {
        const int b = (int)(w / a->hkv), h = (int)(w % a->hkv);
        if (qt && a->nnew[b] <= SPLIT) merge_split(a, b, h, st8);
    }
    free(qt);
}

int kv_paged_attend(int B, int hkv, int g, int D, int ps, int64_t S, const float *q, const float *kv,
                    const int64_t *tables, int max_pages, const int64_t *row0, const int64_t *nnew,
                    const int64_t *lens, int64_t window, float *out, int64_t n_rows, int n_threads) {
    if (n_threads < 1) return 1;
    int rc = cattn_check(B, hkv, g, D, ps, S, tables, max_pages, row0, nnew, lens, window, n_rows);
    if (rc) return rc;
    CAttn *a = cattn_plan(B, hkv, g, D, ps, S, q, (int64_t)hkv * g * D, tables, max_pages, row0, nnew, lens,
                          window, out);
    if (!a) return 2;
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    cattn_in_region(a, kv, &bad);
    cattn_free(a);
    return bad ? 2 : 0;
}
