/* Mixture-of-experts steps, built into the quantized-weights library (qgemm).
 *
 * kv_moe_route: for each of n rows x, the post-attention RMSNorm h = x * post_w / rms(x), the
 * router's logits l = h @ R (R [H, Ep] fp32, the router matrix transposed and its E columns padded
 * with zeros to Ep, a multiple of 16: each logit one multiply-add chain over the inputs in order, so
 * every variant gives the same bits whatever its vector width or row tile), the row's k largest
 * logits (larger first, equal ones by lower expert id), then put in increasing expert id order,
 * and their weights: softmax probabilities p = exp(l - max) / S, S the sum of all E exponentials
 * in expert order, renormalised p_j / (p_0 + ... + p_{k-1}) in that id order when `norm`. Every
 * sum over a row's experts below takes the id order too (transformers' too: it adds its experts'
 * outputs expert by expert). A row's results depend on that row alone.
 * kv_q_experts_row: one row's chosen experts, y_j = down(act(gate) * up) of [gate | up] =
 * gate_up_j(h), combined as out = ((y_0 * w_0) + y_1 * w_1) + ... (each product and sum rounding
 * once, in that order): the bits of kv_q_expert's outputs weighted and summed one by one. The k
 * experts' products are shared out together: every gate_up tile of every expert in one loop, every
 * down tile in another (four barriers a row instead of five an expert).
 * kv_q_moe_row: a decode row's whole sparse half, x += the mixture of its experts, route and experts
 * in one parallel region (the steps of kv_moe_route then kv_q_experts_row, so the same bits).
 * kv_q_moe_rows: the same for any number of rows after kv_moe_route: each chosen expert once over
 * all the rows that chose it, the experts in id order, so each row's sum takes its terms in its
 * own order (the same bits again) into one [n, H] buffer: one expert's outputs held at a time.
 *
 * Layouts: x [n, H] rows ldx apart; post_w [H]; wt [H, Ep]; h [n, H]; w [n, k] float and e [n, k]
 * int64 (the chosen weights and expert ids, ids increasing along a row); gu, dn: qgemm.h's KVP_N fields of each
 * expert's gate_up and down (kv_q_experts_row: the k chosen ones in order; kv_q_moe_row: all E).
 * Returns 0, 1 for bad arguments, 4 when scratch memory cannot be had.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "vmath.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define KMAX 32 /* experts a row */
#if VL == 16
#define RR 4 /* rows of a router tile */
#else
#define RR 2
#endif
#define CV 4 /* vectors of logits a router tile */

typedef struct {
    int H, E, Ep, k, norm;
    const float *post_w, *wt;
    float eps;
} Route;

static int route_valid(const Route *r) {
    return r->H >= 1 && r->E >= 1 && r->k >= 1 && r->k <= KMAX && r->k <= r->E && r->Ep >= r->E && r->Ep % 16 == 0 &&
           r->post_w && r->wt && r->eps >= 0.f;
}

/* h = x * post_w / rms(x), one row */
static void norm_row(const Route *r, const float *x, float *h) {
    const float inv = 1.f / sqrtf(kv_dot(x, x, r->H) / (float)r->H + r->eps);
    for (int c = 0; c < r->H; c++) h[c] = x[c] * inv * r->post_w[c];
}

/* logits of nr <= RR rows (h[i], l[i]) for the nv vectors of experts from vector v0 on; nv is a
 * constant at each call site, so the sums stay in registers */
static inline __attribute__((always_inline)) void logits_tile(const Route *r, int nr, int nv, float *const *h,
                                                              float *const *l, int v0) {
    vec acc[RR][CV];
    for (int i = 0; i < RR; i++)
        for (int c = 0; c < nv; c++) acc[i][c] = (vec){0};
    for (int k = 0; k < r->H; k++) {
        const float *wk = r->wt + (int64_t)k * r->Ep + (int64_t)v0 * VL;
        vec w[CV];
        for (int c = 0; c < nv; c++) w[c] = *(const vec *)(wk + VL * c);
        for (int i = 0; i < RR; i++)
            if (i < nr) {
                const vec s = (vec){0} + h[i][k];
                for (int c = 0; c < nv; c++) acc[i][c] = vmadd(s, w[c], acc[i][c]);
            }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nv; c++) *(vec *)(l[i] + (int64_t)(v0 + c) * VL) = acc[i][c];
}

/* logits of nr rows over the expert vectors [v0, v1) */
static void logits_rows(const Route *r, int nr, float *const *h, float *const *l, int v0, int v1) {
    int v = v0;
    for (; v + CV <= v1; v += CV) logits_tile(r, nr, CV, h, l, v);
    for (; v < v1; v++) logits_tile(r, nr, 1, h, l, v);
}

/* a row's top k of its logits l [E] in increasing expert id order, and their weights; ex [Ep]: scratch */
static void pick(const Route *r, const float *l, float *ex, float *w, int64_t *e) {
    int sel[KMAX], n = 0;
    for (int x = 0; x < r->E; x++) {
        if (n < r->k) {
            n++;
        } else if (!(l[x] > l[sel[r->k - 1]])) {
            continue;
        }
        int p = n - 1;
        for (; p > 0 && l[x] > l[sel[p - 1]]; p--) sel[p] = sel[p - 1];
        sel[p] = x;
    }
    const float m = l[sel[0]];
    for (int j = 1; j < r->k; j++) { /* the chosen experts in increasing id order: the order of every sum below */
        const int v = sel[j];
        int p = j;
        for (; p > 0 && sel[p - 1] > v; p--) sel[p] = sel[p - 1];
        sel[p] = v;
    }
    int x = 0;
    for (; x + VL <= r->E; x += VL) *(vec *)(ex + x) = vexp(*(const vec *)(l + x) - m);
    for (; x < r->E; x++) ex[x] = kv_exp1(l[x] - m);
    float s = ex[0];
    for (x = 1; x < r->E; x++) s = s + ex[x];
    float p[KMAX], t = 0.f;
    for (int j = 0; j < r->k; j++) {
        p[j] = ex[sel[j]] / s;
        t = j == 0 ? p[j] : t + p[j];
    }
    for (int j = 0; j < r->k; j++) {
        w[j] = r->norm ? p[j] / t : p[j];
        e[j] = sel[j];
    }
}

/* the routing scratch of n_threads threads: each one's logits and exponentials of RR rows */
static size_t route_bytes(int Ep, int n_threads) {
    return ((size_t)2 * Ep * sizeof(float) * RR + 64) * (size_t)n_threads + 64;
}

/* Inside a parallel region: rows 0 .. n - 1 of x normed into h, their chosen experts' weights and
 * ids into w and e, in tiles of RR rows shared out; buf: route_bytes of this region's threads. */
static void route_in_region(const Route *r, int n, const float *x, int64_t ldx, float *h, float *w, int64_t *e,
                            char *buf) {
    const size_t per = (size_t)2 * r->Ep * sizeof(float);
    int me = 0;
#ifdef _OPENMP
    me = omp_get_thread_num();
#endif
    float *mine = (float *)(((uintptr_t)(buf + (per * RR + 64) * (size_t)me) + 63) & ~(uintptr_t)63);
    const int tiles = (n + RR - 1) / RR, nvec = r->Ep / VL;
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int r0 = t * RR, nr = n - r0 < RR ? n - r0 : RR;
        float *hs[RR], *ls[RR];
        for (int i = 0; i < nr; i++) {
            hs[i] = h + (int64_t)(r0 + i) * r->H;
            ls[i] = mine + (size_t)i * 2 * r->Ep;
            norm_row(r, x + (int64_t)(r0 + i) * ldx, hs[i]);
        }
        logits_rows(r, nr, hs, ls, 0, nvec);
        for (int i = 0; i < nr; i++)
            pick(r, ls[i], ls[i] + r->Ep, w + (int64_t)(r0 + i) * r->k, e + (int64_t)(r0 + i) * r->k);
    }
}

int kv_moe_route(int n, int H, const float *x, int64_t ldx, const float *post_w, float eps, const float *wt, int E,
                 int Ep, int k, int norm, float *h, float *w, int64_t *e, int n_threads) {
    const Route r = {H, E, Ep, k, norm, post_w, wt, eps};
    if (n < 1 || ldx < H || n_threads < 1 || !route_valid(&r)) return 1;
    char *buf = scratch_take(route_bytes(Ep, n_threads));
    if (!buf) return 4;
#pragma omp parallel num_threads(n_threads)
    route_in_region(&r, n, x, ldx, h, w, e, buf);
    return 0;
}

/* One row's k experts (see the top of the file): their weights, scratch and tile counts. */
typedef struct {
    int H, I, k, act;
    QProj gu[KMAX];
    QW dn[KMAX];
    const float *gu_b[KMAX], *dn_b[KMAX];
    float w[KMAX];
    int ga[KMAX + 1], gd[KMAX + 1]; /* expert j's gate_up tiles are ga[j] .. ga[j + 1] - 1; down's gd */
    Scratch a, b[KMAX]; /* the row's activations (every gate_up takes them); each expert's down input */
    float *hh[KMAX], *y[KMAX]; /* [2I] each: gate | up, then act(gate) * up; [H] each: its output */
} Row;

static size_t row_bytes(int k, int H, int I) {
    return scratch_bytes(1, H) + (size_t)k * (scratch_bytes(1, I) + (size_t)(2 * I + H) * sizeof(float) + 192) + 64;
}

static char *align64(char *p) { return (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* The row's experts from their fields (gu, dn: k of KVP_N each, or the table and the ids e), laid
 * out in buf; 0 when some expert does not fit H, I and act. */
static int row_at(Row *rw, char *buf, int H, int I, int k, const int64_t *gu, const int64_t *dn, const int64_t *e,
                  const float *w, int act) {
    rw->H = H, rw->I = I, rw->k = k, rw->act = act;
    rw->ga[0] = rw->gd[0] = 0;
    int need = 0;
    buf = align64(buf);
    rw->a = scratch_at(buf, 1, H);
    buf = align64(buf + scratch_bytes(1, H));
    for (int j = 0; j < k; j++) {
        const int64_t at = (e ? e[j] : j) * (int64_t)KVP_N;
        const QProj g = proj_of(gu + at, H), d = proj_of(dn + at, I);
        if (d.n != 1 || !mlp_valid(&g, &d.p[0], H, I, act)) return 0;
        rw->gu[j] = g, rw->dn[j] = d.p[0], rw->gu_b[j] = proj_bias(gu + at), rw->dn_b[j] = proj_bias(dn + at);
        rw->w[j] = w[j];
        need |= proj_acts(&g);
        const QProj d1 = qproj1(&rw->dn[j]);
        rw->ga[j + 1] = rw->ga[j] + proj_tiles(&g);
        rw->gd[j + 1] = rw->gd[j] + proj_tiles(&d1);
        rw->b[j] = scratch_at(buf, 1, I);
        rw->b[j].need = proj_acts(&d1);
        buf = align64(buf + scratch_bytes(1, I));
        rw->hh[j] = (float *)buf;
        buf = align64(buf + (size_t)2 * I * sizeof(float));
        rw->y[j] = (float *)buf;
        buf = align64(buf + (size_t)H * sizeof(float));
    }
    rw->a.need = need;
    return 1;
}

static int expert_of(const int *first, int t) {
    int j = 0;
    while (t >= first[j + 1]) j++;
    return j;
}

/* Inside a parallel region, with the row's activations made (rw->a): out = the mixture (accumulate
 * 0) or out += it (1). */
static void experts_in_region(const Row *rw, float *out, int accumulate) {
    const int k = rw->k, H = rw->H, I = rw->I;
#pragma omp for schedule(static)
    for (int t = 0; t < rw->ga[k]; t++) {
        const int j = expert_of(rw->ga, t);
        proj_tile(&rw->gu[j], t - rw->ga[j], 0, 1, &rw->a, rw->gu_b[j], NULL, rw->hh[j], 2 * I, 0);
    }
#pragma omp for schedule(static)
    for (int j = 0; j < k; j++) {
        glu_row(rw->act, I, rw->hh[j]);
        act_row(&rw->b[j], 0, I, rw->hh[j], 2 * I, NULL, -1.f);
    }
#pragma omp for schedule(static)
    for (int t = 0; t < rw->gd[k]; t++) {
        const int j = expert_of(rw->gd, t);
        const QProj d = qproj1(&rw->dn[j]);
        proj_tile(&d, t - rw->gd[j], 0, 1, &rw->b[j], rw->dn_b[j], NULL, rw->y[j], H, 0);
    }
#pragma omp for schedule(static)
    for (int c = 0; c < H; c++) {
        float o = rw->y[0][c] * rw->w[0];
        for (int j = 1; j < k; j++) {
            const float t = rw->y[j][c] * rw->w[j];
            o = o + t;
        }
        out[c] = accumulate ? out[c] + o : o;
    }
}

int kv_q_experts_row(int H, int I, const float *x, int k, const int64_t *gu, const int64_t *dn, const float *w,
                     int act, float *out, int n_threads) {
    if (k < 1 || k > KMAX || n_threads < 1) return 1;
    char *buf = scratch_take(row_bytes(k, H, I));
    if (buf == NULL) return 4;
    Row rw;
    if (!row_at(&rw, buf, H, I, k, gu, dn, NULL, w, act)) return 1;
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp single
        act_row(&rw.a, 0, H, x, H, NULL, -1.f);
        experts_in_region(&rw, out, 0);
    }
    return 0;
}

KV_HIDDEN int moe_row_valid(const MoeRow *m) {
    const Route r = {m->H, m->E, m->Ep, m->k, m->norm, m->post_w, m->wt, m->eps};
    return route_valid(&r) && m->I >= 1 && m->gu && m->dn;
}

/* the scratch a row takes: its Row, then h [H], the logits [Ep], the exponentials [Ep], the chosen
 * weights [k] and ids [k], then row_at's buffers */
KV_HIDDEN size_t moe_row_bytes(const MoeRow *m) {
    return sizeof(Row) + ((size_t)m->H + 16 + 2 * (size_t)m->Ep + (size_t)m->k) * sizeof(float) +
           (size_t)m->k * sizeof(int64_t) + 4 * 64 + row_bytes(m->k, m->H, m->I);
}

static float *moe_row_h(char *buf) { return (float *)align64((char *)((Row *)align64(buf) + 1)); }

static float *moe_row_w(const MoeRow *m, char *buf) { return moe_row_h(buf) + ((m->H + 15) & ~15) + 2 * m->Ep; }

static int64_t *moe_row_e(const MoeRow *m, char *buf) { return (int64_t *)align64((char *)(moe_row_w(m, buf) + m->k)); }

KV_HIDDEN void moe_row_in_region(const MoeRow *m, float *x, char *buf, int *refused) {
    const Route r = {m->H, m->E, m->Ep, m->k, m->norm, m->post_w, m->wt, m->eps};
    Row *rw = (Row *)align64(buf);
    float *h = moe_row_h(buf), *l = h + ((m->H + 15) & ~15), *ex = l + m->Ep, *w = moe_row_w(m, buf);
    int64_t *e = moe_row_e(m, buf);
    char *rest = align64((char *)(e + m->k));
    const int nvec = m->Ep / VL, chunks = (nvec + CV - 1) / CV;
    float *hs[1] = {h}, *ls[1] = {l};
#pragma omp single
    norm_row(&r, x, h);
#pragma omp for schedule(static)
    for (int c = 0; c < chunks; c++) logits_rows(&r, 1, hs, ls, c * CV, (c + 1) * CV < nvec ? (c + 1) * CV : nvec);
#pragma omp single
    {
        pick(&r, l, ex, w, e);
        if (row_at(rw, rest, m->H, m->I, m->k, m->gu, m->dn, e, w, m->act))
            act_row(&rw->a, 0, m->H, h, m->H, NULL, -1.f);
        else
            *refused = 1;
    }
    if (!*refused) experts_in_region(rw, x, 1);
}

int kv_q_moe_row(int H, int I, float *x, const float *post_w, float eps, const float *wt, int E, int Ep, int k,
                 int norm, const int64_t *gu, const int64_t *dn, int act, float *w, int64_t *e, int n_threads) {
    const MoeRow m = {H, I, E, Ep, k, norm, act, eps, post_w, wt, gu, dn};
    if (n_threads < 1 || !moe_row_valid(&m)) return 1;
    char *buf = scratch_take(moe_row_bytes(&m));
    if (buf == NULL) return 4;
    int refused = 0;
#pragma omp parallel num_threads(n_threads)
    moe_row_in_region(&m, x, buf, &refused);
    memcpy(w, moe_row_w(&m, buf), sizeof(float) * (size_t)k);
    memcpy(e, moe_row_e(&m, buf), sizeof(int64_t) * (size_t)k);
    return refused;
}

/* The rows of a step grouped by expert (kv_q_moe_rows; kv_q_layers' mixtures of more than one row):
 * count [E + 1] (expert j's first grouped position count[j]), slot [n k] (grouped position -> slot,
 * row s / k), acc [n, H] each row's sum so far, and one expert's scratch for up to cmax rows. */
typedef struct {
    int n, k, E, H, I, act;
    const int64_t *gu, *dn;
    int *count;
    int32_t *slot;
    float *acc, *hh, *ys;
    Scratch a, b;
} Groups;

/* the grouping's arrays and one expert's scratch for cmax rows */
static size_t groups_bytes(int n, int k, int E, int H, int I, int cmax) {
    return ((size_t)E + 1) * sizeof(int) + (size_t)n * k * sizeof(int32_t) + (size_t)n * H * sizeof(float) +
           scratch_bytes(cmax, H) + scratch_bytes(cmax, I) + (size_t)cmax * (2 * I + H) * sizeof(float) + 8 * 64;
}

static Groups groups_at(char *buf, int n, int k, int E, int H, int I, int cmax, const int64_t *gu,
                        const int64_t *dn, int act) {
    Groups g = {n, k, E, H, I, act, gu, dn, NULL, NULL, NULL, NULL, NULL, {0}, {0}};
    g.count = (int *)align64(buf);
    g.slot = (int32_t *)align64((char *)(g.count + E + 1));
    g.acc = (float *)align64((char *)(g.slot + (size_t)n * k));
    char *eb = align64((char *)(g.acc + (size_t)n * H));
    g.a = scratch_at(eb, cmax, H);
    eb = align64(eb + scratch_bytes(cmax, H));
    g.b = scratch_at(eb, cmax, I);
    g.hh = (float *)align64(eb + scratch_bytes(cmax, I));
    g.ys = (float *)align64((char *)(g.hh + (size_t)cmax * 2 * I)); /* [cmax, H] one expert's outputs */
    return g;
}

/* The rows' chosen experts e [n, k] counted and grouped (g->count, g->slot), the experts that some
 * row chose checked against H, I and act: the most rows an expert has, or -1 for an id outside
 * 0 .. E - 1, a row's ids not increasing, or an expert that does not fit. at [E]: scratch. */
static int group_rows(Groups *g, const int64_t *e, int *at) {
    const int64_t slots = (int64_t)g->n * g->k;
    int cmax = 0;
    memset(g->count, 0, sizeof(int) * ((size_t)g->E + 1));
    for (int64_t s = 0; s < slots; s++) {
        if (e[s] < 0 || e[s] >= g->E || (s % g->k && e[s] <= e[s - 1])) return -1;
        g->count[e[s] + 1]++;
    }
    for (int j = 0; j < g->E; j++) {
        if (g->count[j + 1] > cmax) cmax = g->count[j + 1];
        if (g->count[j + 1]) {
            const QProj gp = proj_of(g->gu + (int64_t)j * KVP_N, g->H), d = proj_of(g->dn + (int64_t)j * KVP_N, g->I);
            if (d.n != 1 || !mlp_valid(&gp, &d.p[0], g->H, g->I, g->act)) return -1;
        }
        g->count[j + 1] += g->count[j];
    }
    memcpy(at, g->count, sizeof(int) * (size_t)g->E);
    for (int64_t s = 0; s < slots; s++) g->slot[at[e[s]]++] = (int32_t)s; /* grouped by expert, slots in order */
    return cmax;
}

/* Inside a parallel region, after group_rows: x [n, H] += each row's mixture (h [n, H] its normed
 * rows, w [n, k] its weights), every chosen expert once over the rows that chose it, in id order. */
static void groups_in_region(const Groups *gr, const float *h, const float *w, float *x, int64_t ldx) {
    const int k = gr->k, H = gr->H, I = gr->I;
    for (int j = 0; j < gr->E; j++) {
        const int c = gr->count[j + 1] - gr->count[j], p0 = gr->count[j];
        if (!c) continue;
        const QProj g = proj_of(gr->gu + (int64_t)j * KVP_N, H), d = proj_of(gr->dn + (int64_t)j * KVP_N, I);
        const QW down = d.p[0];
        const QProj d1 = qproj1(&down);
        Scratch sa = gr->a, sb = gr->b;
        sa.need = proj_acts(&g), sb.need = proj_acts(&d1);
#pragma omp for schedule(static)
        for (int i = 0; i < c; i++) act_row(&sa, i, H, h + (int64_t)(gr->slot[p0 + i] / k) * H, 0, NULL, -1.f);
        mm_proj(&g, c, &sa, proj_bias(gr->gu + (int64_t)j * KVP_N), NULL, gr->hh, 2 * I, 0);
#pragma omp for schedule(static)
        for (int i = 0; i < c; i++) {
            glu_row(gr->act, I, gr->hh + (size_t)i * 2 * I);
            act_row(&sb, i, I, gr->hh, 2 * I, NULL, -1.f);
        }
        mm_rows(&down, c, &sb, proj_bias(gr->dn + (int64_t)j * KVP_N), NULL, gr->ys, H, 0);
#pragma omp for schedule(static)
        for (int i = 0; i < c; i++) { /* a row chose this expert once: its row of acc is this thread's */
            const int64_t s = gr->slot[p0 + i];
            const float wt = w[s], *y = gr->ys + (size_t)i * H;
            float *o = gr->acc + (size_t)(s / k) * H;
            if (s % k == 0) {
                for (int q = 0; q < H; q++) o[q] = y[q] * wt;
            } else {
                for (int q = 0; q < H; q++) {
                    const float t = y[q] * wt;
                    o[q] = o[q] + t;
                }
            }
        }
    }
#pragma omp for schedule(static)
    for (int r = 0; r < gr->n; r++) {
        const float *o = gr->acc + (size_t)r * H;
        float *xr = x + (int64_t)r * ldx;
        for (int q = 0; q < H; q++) xr[q] = xr[q] + o[q];
    }
}

/* kv_q_moe_rows: x [n, H] += the mixture of each row's k experts (e, w [n, k] from kv_moe_route:
 * a row's experts in increasing id order; h [n, H] its normed rows), every chosen expert once over
 * all the rows that chose it (each row's products its own bits, as kv_q_expert's), the experts in id
 * order, so each row's sum takes its terms in its own order, as kv_q_experts_row combines them: the
 * first term's product, then adds, into one [n, H] buffer that joins x at the end. Only one expert's
 * outputs are held at a time. gu, dn: every expert's fields [E, KVP_N]. Returns 0, 1 for bad
 * arguments (an expert id outside 0 .. E - 1, or a row's ids not increasing), 4 without memory. */
int kv_q_moe_rows(int n, int H, int I, float *x, int64_t ldx, const float *h, const float *w, const int64_t *e,
                  int k, int E, const int64_t *gu, const int64_t *dn, int act, int n_threads) {
    if (n < 1 || k < 1 || k > KMAX || E < 1 || ldx < H || n_threads < 1) return 1;
    /* counted first in a small allocation of their own, so one expert's scratch is sized to the most rows one has */
    char *head = malloc(groups_bytes(n, k, E, H, I, 0) + sizeof(int) * (size_t)E);
    if (!head) return 4;
    Groups g0 = groups_at(head, n, k, E, H, I, 0, gu, dn, act);
    const int cmax = group_rows(&g0, e, (int *)(head + groups_bytes(n, k, E, H, I, 0)));
    char *buf = cmax < 0 ? NULL : scratch_take(groups_bytes(n, k, E, H, I, cmax));
    if (cmax < 0 || !buf) {
        free(head);
        return cmax < 0 ? 1 : 4;
    }
    Groups g = groups_at(buf, n, k, E, H, I, cmax, gu, dn, act);
    memcpy(g.count, g0.count, sizeof(int) * ((size_t)E + 1));
    memcpy(g.slot, g0.slot, sizeof(int32_t) * (size_t)n * k);
    free(head);
#pragma omp parallel num_threads(n_threads)
    groups_in_region(&g, h, w, x, ldx);
    return 0;
}

/* The mixture of n rows inside kv_q_layers' parallel region (qgemm.h): a decode row's own steps
 * (moe_row_in_region), or for more rows the router's tiles, the grouping (one thread) and every
 * chosen expert once over its rows (kv_moe_route then kv_q_moe_rows: the same bits). Scratch: the
 * normed rows h [n, H], the weights w and ids e [n, k], the router's per-thread scratch, group_rows'
 * at [E], then the groups sized for n rows. */
KV_HIDDEN size_t moe_bytes(const MoeRow *m, int n, int n_threads) {
    if (n == 1) return moe_row_bytes(m);
    return (size_t)n * m->H * sizeof(float) + (size_t)n * m->k * (sizeof(float) + sizeof(int64_t)) +
           route_bytes(m->Ep, n_threads) + (size_t)m->E * sizeof(int) + groups_bytes(n, m->k, m->E, m->H, m->I, n) +
           6 * 64;
}

KV_HIDDEN void moe_in_region(const MoeRow *m, int n, float *x, int64_t ldx, char *buf, int n_threads, int *refused) {
    if (n == 1) {
        moe_row_in_region(m, x, buf, refused);
        return;
    }
    const Route r = {m->H, m->E, m->Ep, m->k, m->norm, m->post_w, m->wt, m->eps};
    float *h = (float *)align64(buf), *w = (float *)align64((char *)(h + (size_t)n * m->H));
    int64_t *e = (int64_t *)align64((char *)(w + (size_t)n * m->k));
    char *rb = align64((char *)(e + (size_t)n * m->k));
    int *at = (int *)align64(rb + route_bytes(m->Ep, n_threads));
    Groups g = groups_at(align64((char *)(at + m->E)), n, m->k, m->E, m->H, m->I, n, m->gu, m->dn, m->act);
    route_in_region(&r, n, x, ldx, h, w, e, rb);
#pragma omp single
    if (group_rows(&g, e, at) < 0) *refused = 1;
    if (!*refused) groups_in_region(&g, h, w, x, ldx);
}
