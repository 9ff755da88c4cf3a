/* One chunk of keys against a tile of query rows, and the merge of chunks in order: the steps
 * every path of qattn.c shares, so a row's bits do not depend on which path ran it. Included by
 * qattn.c only (after qlanes.h). */
#ifndef KV_QROWS_H
#define KV_QROWS_H

#include "qlanes.h"

/* One chunk made ready for the tiles: keys as floats channel-major, values as float rows. */
typedef struct {
    int n;            /* keys (a multiple of 16) */
    int kg;           /* keys per key group (quantized: G; rest: n) */
    float *KT;        /* [D, n] keys' codes (quantized) or keys (rest), lane order per group */
    float *ks, *kz;   /* [n / kg, D] each group's per-channel scale and minimum; NULL for the rest */
    const float *V;   /* [n, D] value rows */
    const int *chan;  /* [D] the channel each element of a value row holds; NULL: in order */
} chunk_t;

typedef struct {      /* one row's share of a chunk, or the running state of a row */
    float m, l;
    float acc[];      /* [D] */
} part_t;

#define PART_FLOATS(D) (2 + (D))

/* One key group's query terms for rows qr (``rows``, the extra ones copies of row 0): qs = q * scale
 * per channel, zt = q . min (one sixteen-lane chain and the fixed tree); the rest's: q and 0. */
static ALWAYS void group_terms(const float *const *qr, int nr, int rows, int D, const float *s, const float *z,
                               float qs[][MAXD], float *zt) {
    for (int r = 0; r < rows; r++) {
        const float *q = qr[r < nr ? r : 0];
        if (s) {
            v16 a = (v16){0};
            for (int c = 0; c < D; c += 16) a = MADD(*(const v16 *)(q + c), *(const v16 *)(z + c), a);
            zt[r] = hsum16(a);
            for (int c = 0; c < D; c++) qs[r][c] = q[c] * s[c];
        } else {
            zt[r] = 0.f;
            memcpy(qs[r], q, sizeof(float) * (size_t)D);
        }
    }
}

/* Scores st [NR, n] -> exp(s - m) for rows 0 .. nr-1, row r seeing its first vis[r] keys; each row's
 * m and l go to parts[r] (l = 0: it saw none). Returns the most keys any row sees. */
static ALWAYS int softmax_rows(float *st, int n, const int *vis, int nr, part_t *const *parts) {
    int top = 0;
    for (int r = 0; r < nr; r++) {
        float *s = st + (int64_t)r * n;
        const int see = vis[r] < n ? vis[r] : n;
        top = see > top ? see : top;
        for (int t = see < 0 ? 0 : see; t < n; t++) s[t] = -INFINITY;
        part_t *p = parts[r];
        v16 mx = (v16){0} - INFINITY;
        for (int t = 0; t < n; t += 16) {
            const v16 x = *(const v16 *)(s + t);
            const i16 gt = x > mx;
            mx = (v16)(((i16)x & gt) | ((i16)mx & ~gt));
        }
        p->m = hmax16(mx);
        if (p->m == -INFINITY) {
            p->l = 0.f;
            continue;
        }
        v16 sum = (v16){0};
        for (int t = 0; t < n; t += 16) {
            const v16 e = vexp16(*(const v16 *)(s + t) - p->m);
            *(v16 *)(s + t) = e;
            sum += e;
        }
        p->l = hsum16(sum);
    }
    return top;
}

/* Sixteen output elements d .. d + 15 of rows 0 .. nr-1 into their channels. */
static ALWAYS void store_out(const v16 *a, int nr, int d, const int *chan, part_t *const *parts) {
    for (int r = 0; r < nr; r++) {
        if (chan)
            for (int i = 0; i < 16; i++) parts[r]->acc[chan[d + i]] = a[r][i];
        else
            memcpy(parts[r]->acc + d, &a[r], sizeof(v16));
    }
}

/* Rows qr[0 .. nr-1] (``rows`` computed, the extra ones copies of row 0; NR or NM, constant where
 * inlined) against a chunk made ready in the scratch; row r sees its first vis[r] keys. Each row's
 * (m, l, acc) goes to parts[r]. A row's multiply-adds run in the same order whatever ``rows`` is:
 * more rows only give the vector units more chains at once. */
static ALWAYS void tile_rows(const chunk_t *ck, int D, const float *const *qr, const int *vis, int nr, float *st,
                             part_t *const *parts, int rows) {
    const int n = ck->n;
    float qs[NM][MAXD], zt[NM];
    for (int g0 = 0; g0 < n; g0 += ck->kg) {
        const int64_t gi = g0 / ck->kg;
        group_terms(qr, nr, rows, D, ck->ks ? ck->ks + gi * D : NULL, ck->ks ? ck->kz + gi * D : NULL, qs, zt);
        for (int v = 0; v < ck->kg; v += 16) {
            v16 a[NM];
            for (int r = 0; r < rows; r++) a[r] = (v16){0} + zt[r];
            const float *k = ck->KT + g0 + v;
            for (int c = 0; c < D; c++) {
                const v16 kv = *(const v16 *)(k + (int64_t)c * n);
                for (int r = 0; r < rows; r++) a[r] = MADD(qs[r][c], kv, a[r]);
            }
            for (int r = 0; r < rows; r++) *(v16 *)(st + (int64_t)r * n + g0 + v) = a[r];
        }
    }
    const int top = softmax_rows(st, n, vis, nr, parts);
    for (int r = nr; r < rows; r++) /* a last tile's missing rows take weights of zero, never stored */
        memset(st + (int64_t)r * n, 0, sizeof(float) * (size_t)top);
    for (int d = 0; d < D; d += 32) {
        const int two = d + 32 <= D;
        v16 a[NM], b[NM];
        for (int r = 0; r < rows; r++) a[r] = b[r] = (v16){0};
        for (int t = 0; t < top; t++) {
            const v16 x = *(const v16 *)(ck->V + (int64_t)t * D + d);
            const v16 y = two ? *(const v16 *)(ck->V + (int64_t)t * D + d + 16) : x;
            for (int r = 0; r < rows; r++) {
                a[r] = MADD(st[(int64_t)r * n + t], x, a[r]);
                if (two) b[r] = MADD(st[(int64_t)r * n + t], y, b[r]);
            }
        }
        store_out(a, nr, d, ck->chan, parts);
        if (two) store_out(b, nr, d + 16, ck->chan, parts);
    }
}

static NOINLINE void tile(const chunk_t *ck, int D, const float *const *qr, const int *vis, int nr, float *st,
                          part_t *const *parts) {
    tile_rows(ck, D, qr, vis, nr, st, parts, NR);
}

/* Up to NM rows (a prefill's). */
static NOINLINE void tile_many(const chunk_t *ck, int D, const float *const *qr, const int *vis, int nr, float *st,
                               part_t *const *parts) {
    tile_rows(ck, D, qr, vis, nr, st, parts, NM);
}

/* The running state S takes partial p (chunk order). */
static NOINLINE void merge(int D, part_t *S, const part_t *p) {
    if (!(p->l > 0.f)) return;
    if (S->m == -INFINITY) {
        S->m = p->m;
        S->l = p->l;
        memcpy(S->acc, p->acc, sizeof(float) * (size_t)D);
        return;
    }
    const float mx = p->m > S->m ? p->m : S->m, wo = expf(S->m - mx), wn = expf(p->m - mx);
    S->l = MADDF(S->l, wo, p->l * wn);
    for (int d = 0; d < D; d++) S->acc[d] = MADDF(S->acc[d], wo, p->acc[d] * wn);
    S->m = mx;
}

#endif
