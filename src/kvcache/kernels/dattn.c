/* Attention fused with the steps around it, for a batch of sequences that each feed one or more
 * new tokens over fp32 pages with full visibility or a sliding window (decodes, extends after a
 * prefix hit, prefill chunks, verifying forwards). Built into the quantized-weights library (qgemm).
 *
 * kv_decode_attend: from each row of the fused q|k|v projection, the q and k heads get their
 * per-head RMSNorm (when the model has one: Qwen3, Gemma 3) and their rotary embedding (HF's
 * rotate-half convention; ``sin`` carries rotate_half's sign, as models/layers.py's Rotary tables
 * do; dims past ``rot`` are left alone), the q heads the softmax scale, k and v are written into
 * the pool at the token's slot, and the query heads attend over the sequence's pages (cattn.c: one
 * canonical order, so a row's result does not depend on what else the call computes).
 * kv_q_attn_block: the whole attention half of a layer with quantized weights: the input norm and
 * the q|k|v projection, the above, the output projection and the residual (through Gemma 3's
 * post-attention norm when it has one), in one parallel region.
 * kv_q_layers: every layer of a forward (kv_q_attn_block's steps, then kv_q_mlp's, or a mixture of
 * experts' routing and experts as dmoe.c runs them) in one parallel region, the threads never leaving it between
 * layers.
 *
 * Layouts (N rows in all; S = slots in the pool = pages * ps):
 *   qkv    [N, (hq + 2 hkv) * D] float, rows ldq apart (q and k heads are rotated in place)
 *   cos, sin [N, rot] float      qk_norm [hq + hkv, D] float or NULL
 *   kv     [2, hkv, S, D] float: the pool layer, K then V
 *   slots  [N] int64: where each new token's K/V go; tables [B, max_pages] int64; row0, nnew,
 *          lens [B] int64: sequence b's rows are row0[b] .. row0[b] + nnew[b] - 1 and it holds
 *          lens[b] tokens, the new ones included
 *   window 0, or W: a row at position p sees keys p - W + 1 .. p only
 *   sinks  [hq] float or NULL: gpt-oss's learned logit per query head in every softmax (kv_decode_attend)
 *   out    [N, hq * D] float
 * Returns 0, 1 for bad sizes, 2 (or 4) when memory runs out, 3 for a slot or page outside the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cattn.h"
#include "qgemm.h"
#include "vmath.h"

#define MAXD 1024

typedef struct { /* the per-row steps before attention */
    int N, hq, hkv, D, rot;
    int64_t S, ldq;
    float *qkv, *kv, scale, eps;
    const float *cos, *sin, *qk_norm;
    const int64_t *slots;
} Prep;

static int check_rows(const Prep *p, int B, int ps, int max_pages, const int64_t *tables, const int64_t *row0,
                      const int64_t *nnew, const int64_t *lens, int64_t window) {
    if (p->N < 1 || p->hkv < 1 || p->hq < p->hkv || p->hq % p->hkv || p->D < 1 || p->D > MAXD || p->rot < 0 ||
        p->rot > p->D || p->rot % 2 || p->ldq < (int64_t)(p->hq + 2 * p->hkv) * p->D)
        return 1;
    for (int n = 0; n < p->N; n++)
        if (p->slots[n] < 0 || p->slots[n] >= p->S) return 3;
    int64_t rows = 0;
    for (int b = 0; b < B; b++) rows += nnew[b];
    if (rows != p->N) return 1;
    return cattn_check(B, p->hkv, p->hq / p->hkv, p->D, ps, p->S, tables, max_pages, row0, nnew, lens, window,
                       p->N);
}

/* Row n: per-head norm and RoPE of the q and k heads, the scale on q, then k and v into the pool. */
static void prepare(const Prep *a, int n) {
    float tmp[MAXD];
    float *row = a->qkv + (int64_t)n * a->ldq;
    const float *cs = a->cos + (int64_t)n * a->rot, *sn = a->sin + (int64_t)n * a->rot;
    const int D = a->D, half = a->rot / 2;
    for (int h = 0; h < a->hq + a->hkv; h++) {
        float *x = row + (int64_t)h * D;
        if (a->qk_norm) {
            const float inv = 1.f / sqrtf(kv_dot(x, x, D) / (float)D + a->eps);
            const float *w = a->qk_norm + (int64_t)h * D;
            for (int c = 0; c < D; c++) x[c] = x[c] * inv * w[c];
        }
        if (a->rot) {
            for (int c = 0; c < a->rot; c++) tmp[c] = x[c] * cs[c] + x[c < half ? c + half : c - half] * sn[c];
            memcpy(x, tmp, sizeof(float) * (size_t)a->rot);
        }
        if (h < a->hq)
            for (int c = 0; c < D; c++) x[c] *= a->scale;
    }
    for (int h = 0; h < a->hkv; h++) {
        memcpy(a->kv + ((int64_t)h * a->S + a->slots[n]) * D, row + (int64_t)(a->hq + h) * D, sizeof(float) * D);
        memcpy(a->kv + ((int64_t)(a->hkv + h) * a->S + a->slots[n]) * D, row + (int64_t)(a->hq + a->hkv + h) * D,
               sizeof(float) * D);
    }
}

/* The attention steps inside a parallel region (every thread calls it). */
static void attend_in_region(const Prep *p, const CAttn *c, int *bad) {
#pragma omp for schedule(static)
    for (int n = 0; n < p->N; n++) prepare(p, n);
    cattn_in_region(c, p->kv, bad);
}

int kv_decode_attend(int N, int hq, int hkv, int D, int rot, float *qkv, int64_t ldq, const float *cos,
                     const float *sin, const float *qk_norm, float eps, float *kv, int ps, int64_t S,
                     const int64_t *slots, const int64_t *tables, int max_pages, int B, const int64_t *row0,
                     const int64_t *nnew, const int64_t *lens, int64_t window, float scale, const float *sinks,
                     float *out, int n_threads) {
    Prep p = {N, hq, hkv, D, rot, S, ldq, qkv, kv, scale, eps, cos, sin, qk_norm, slots};
    if (n_threads < 1 || B < 1) return 1;
    int rc = check_rows(&p, B, ps, max_pages, tables, row0, nnew, lens, window);
    if (rc) return rc;
    CAttn *c = cattn_plan(B, hkv, hq / hkv, D, ps, S, qkv, ldq, tables, max_pages, row0, nnew, lens, window,
                          out);
    if (!c) return 2;
    cattn_set_sinks(c, sinks);
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    attend_in_region(&p, c, &bad);
    cattn_free(c);
    return bad ? 2 : 0;
}

/* The attention half of a layer with quantized weights (see the top of the file) for N rows: its
 * weights, scratch and attention steps. */
typedef struct {
    QProj wqkv;
    QW wo;
    int N, H;
    const float *g_in, *qkv_b, *o_b, *post_w;
    float eps, post_eps;
    Scratch sx, so;
    float *att, *y;
} AttnHalf;

static size_t attn_bytes(int N, int H, int QKV, int HD, int post) {
    return scratch_bytes(N, H) + scratch_bytes(N, HD) +
           ((size_t)N * QKV + (size_t)N * HD + (post ? (size_t)N * H : 0)) * sizeof(float) + 128;
}

/* The half's scratch laid out in buf for weights [QKV, H] and [H, HD] (the output's staging rows y
 * when post); *qkv: where the projection's rows go (the attention's q rows). The weights, norms and
 * biases are the caller's to fill in. */
static AttnHalf attn_at(char *buf, int N, int H, int QKV, int HD, int post, float **qkv) {
    const size_t s1 = scratch_bytes(N, H), s2 = scratch_bytes(N, HD);
    AttnHalf a = {{0}, {0}, N, H, NULL, NULL, NULL, NULL, -1.f, -1.f, scratch_at(buf, N, H),
                  scratch_at(buf + s1, N, HD), NULL, NULL};
    *qkv = (float *)(buf + ((s1 + s2 + 63) & ~(size_t)63));
    a.att = *qkv + (size_t)N * QKV;
    a.y = post ? a.att + (size_t)N * HD : NULL;
    return a;
}

/* x [N, H] += o_proj(attention(qkv_proj(x * g_in / rms(x)))), inside a parallel region; p holds the
 * q|k|v rows (p->qkv) and the pool layer (p->kv), c the attention's plan over them. */
static void attn_in_region(const AttnHalf *a, const Prep *p, const CAttn *c, float *x, int64_t ldx, int *bad) {
    const int N = a->N, HD = a->wo.K;
    const QProj o = qproj1(&a->wo);
    Scratch sx = a->sx, so = a->so; /* the activation orders the projections take */
    sx.need = proj_acts(&a->wqkv), so.need = proj_acts(&o);
#pragma omp for schedule(static)
    for (int r = 0; r < N; r++) act_row(&sx, r, a->H, x, ldx, a->g_in, a->eps);
    mm_proj(&a->wqkv, N, &sx, a->qkv_b, a->eps >= 0.f ? sx.inv : NULL, p->qkv, a->wqkv.out, 0);
    attend_in_region(p, c, bad);
#pragma omp for schedule(static)
    for (int r = 0; r < N; r++) act_row(&so, r, HD, a->att, HD, NULL, -1.f);
    mm_residual(&a->wo, N, &so, a->o_b, x, ldx, a->y, a->post_w, a->post_eps);
}

/* The attention half of a layer with quantized weights (see the top of the file), N rows:
 * x [N, H] += o_proj(attention(qkv_proj(x * g_in / rms(x)))), the output through an RMSNorm of
 * weight post_w first when given; qkv_w and o_w: the projections' fields (qgemm.h's KVP_; o in one
 * part). Returns as kv_decode_attend, or 4 when scratch cannot be had. */
int kv_q_attn_block(int N, int H, float *x, int64_t ldx, const float *g_in, float eps, const int64_t *qkv_w,
                    int hq, int hkv, int D, int rot, const float *cos, const float *sin, const float *qk_norm,
                    float *kv, int ps, int64_t S, const int64_t *slots, const int64_t *tables, int max_pages, int B,
                    const int64_t *row0, const int64_t *nnew, const int64_t *lens, int64_t window, float scale,
                    const int64_t *o_w, const float *post_w, float post_eps, int n_threads) {
    const int QKV = (hq + 2 * hkv) * D, HD = hq * D;
    const QProj wqkv = proj_of(qkv_w, H), wo = proj_of(o_w, HD);
    if (N < 1 || B < 1 || n_threads < 1 || ldx < H || !qproj_valid(&wqkv) || wqkv.out != QKV || wo.n != 1 ||
        !qw_valid(&wo.p[0]) || wo.out != H)
        return 1;
    char *buf = scratch_take(attn_bytes(N, H, QKV, HD, post_w != NULL));
    if (!buf) return 4;
    float *qkv;
    AttnHalf a = attn_at(buf, N, H, QKV, HD, post_w != NULL, &qkv);
    a.wqkv = wqkv, a.wo = wo.p[0], a.g_in = g_in, a.eps = eps, a.qkv_b = proj_bias(qkv_w), a.o_b = proj_bias(o_w);
    a.post_w = post_w, a.post_eps = post_eps;
    Prep p = {N, hq, hkv, D, rot, S, QKV, qkv, kv, scale, eps, cos, sin, qk_norm, slots};
    int rc = check_rows(&p, B, ps, max_pages, tables, row0, nnew, lens, window);
    CAttn *c = rc ? NULL : cattn_plan(B, hkv, hq / hkv, D, ps, S, qkv, QKV, tables, max_pages, row0, nnew,
                                      lens, window, a.att);
    if (!rc && !c) rc = 4;
    if (rc) return rc;
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    attn_in_region(&a, &p, c, x, ldx, &bad);
    cattn_free(c);
    return bad ? 2 : 0;
}

/* kv_q_layers: every layer of a model with quantized weights over fp32 pages, in one parallel
 * region (no thread leaves it between layers; the same steps as kv_q_attn_block then kv_q_mlp per
 * layer, so the same bits). layers [L, KVL_N] int64: each layer's weights (the KVL_ fields below:
 * a pointer, a format, a size or an index in each); a projection is qgemm.h's KVP_N fields (parts
 * side by side: a fused q|k|v or gate|up whose tensors came in different types). kvs [L, 2] int64: each layer's pool layer
 * [2, hkv, S, D] and group; groups [G, KVG_N] int64: each layer group's slots, page tables,
 * lengths, window and pool shape (the layers of a group share them); cos0/sin0 (and cos1/sin1: a
 * second rotary table, Gemma 3's local layers) [N, rot]. E > 0: each layer's MLP is a mixture of E
 * experts of size I, k a row (norm: their weights renormalised): one row as kv_q_moe_row runs it,
 * more grouped by expert as kv_moe_route then kv_q_moe_rows run them (the same bits): its router [H, Ep] at KVL_ROUTER, every expert's gate_up
 * and down fields [E, KVP_N] at KVL_EXPERTS_GU and KVL_EXPERTS_DN, the router's norm weight at
 * KVL_G_MLP; KVL_GU and KVL_DN unused. Returns as kv_q_attn_block (1 also when a chosen expert
 * does not fit: the layers before it are done). */
enum {
    KVL_QKV = 0, /* the fused q|k|v projection */
    KVL_O = KVP_N, /* the output projection (one part) */
    KVL_GU = 2 * KVP_N, /* gate|up */
    KVL_DN = 3 * KVP_N, /* down (one part) */
    KVL_G_ATTN = 4 * KVP_N, /* the input norm's weight (the q|k|v product's input scale) or 0 */
    KVL_QK_NORM, /* [hq + hkv, D] or 0 */
    KVL_POST_ATTN, /* the attention output's RMSNorm weight or 0 */
    KVL_G_MLP, /* the MLP's input norm weight or 0 */
    KVL_POST_FF, /* the MLP output's RMSNorm weight or 0 */
    KVL_ROPE, /* 0: cos0/sin0, 1: cos1/sin1 */
    KVL_ROUTER, /* a mixture's router [H, Ep] (E > 0) */
    KVL_EXPERTS_GU, /* its experts' gate_up fields [E, KVP_N] */
    KVL_EXPERTS_DN, /* and down fields [E, KVP_N] */
    KVL_N
};
enum { KVG_SLOTS = 0, KVG_TABLES, KVG_MAX_PAGES, KVG_LENS, KVG_WINDOW, KVG_S, KVG_PS, KVG_N };

#define P(v) ((const void *)(intptr_t)(v))

int kv_q_layers(int N, int H, float *x, int64_t ldx, int L, const int64_t *layers, const int64_t *kvs, int hq,
                int hkv, int D, int rot, int I, int act, int E, int Ep, int topk, int norm, const float *cos0, const float *sin0, const float *cos1,
                const float *sin1, float eps, float scale, int G, const int64_t *groups, int B,
                const int64_t *row0, const int64_t *nnew, int n_threads) {
    enum { MAXG = 4 };
    const int QKV = (hq + 2 * hkv) * D, HD = hq * D;
    if (N < 1 || B < 1 || L < 1 || G < 1 || G > MAXG || n_threads < 1 || ldx < H || hkv < 1 || hq % hkv) return 1;
    if (E < 0) return 1;
    int post = 0;
    MoeRow moe = {H, I, E, Ep, topk, norm, act, eps, NULL, NULL, NULL, NULL};
    for (int l = 0; l < L; l++) {
        const int64_t *f = layers + (int64_t)l * KVL_N;
        const QProj wqkv = proj_of(f + KVL_QKV, H), wo = proj_of(f + KVL_O, HD), gu = proj_of(f + KVL_GU, H),
                    dn = proj_of(f + KVL_DN, I);
        moe.post_w = P(f[KVL_G_MLP]), moe.wt = P(f[KVL_ROUTER]);
        moe.gu = P(f[KVL_EXPERTS_GU]), moe.dn = P(f[KVL_EXPERTS_DN]);
        const int mlp_ok = E ? moe_row_valid(&moe) : dn.n == 1 && mlp_valid(&gu, &dn.p[0], H, I, act);
        if (!qproj_valid(&wqkv) || wqkv.out != QKV || wo.n != 1 || !qw_valid(&wo.p[0]) || wo.out != H ||
            !mlp_ok || !kvs[2 * l] ||
            kvs[2 * l + 1] < 0 || kvs[2 * l + 1] >= G || f[KVL_ROPE] < 0 || f[KVL_ROPE] > 1 ||
            (f[KVL_ROPE] && rot && (!cos1 || !sin1)))
            return 1;
        post |= f[KVL_POST_ATTN] != 0 || f[KVL_POST_FF] != 0;
    }
    const size_t ab = attn_bytes(N, H, QKV, HD, post), mb = E ? moe_bytes(&moe, N, n_threads) : mlp_bytes(N, H, I, post);
    char *buf = scratch_take(ab > mb ? ab : mb);
    if (!buf) return 4;
    float *qkv;
    AttnHalf a0 = attn_at(buf, N, H, QKV, HD, post, &qkv);
    a0.eps = eps, a0.post_eps = eps;
    /* each group's rows checked and its attention planned once, for all its layers */
    Prep pg[MAXG];
    CAttn *plan[MAXG] = {NULL};
    int rc = 0;
    for (int g = 0; g < G && !rc; g++) {
        const int64_t *q = groups + (int64_t)g * KVG_N;
        pg[g] = (Prep){N, hq, hkv, D, rot, q[KVG_S], QKV, qkv, NULL, scale, eps, cos0, sin0, NULL, P(q[KVG_SLOTS])};
        rc = check_rows(&pg[g], B, (int)q[KVG_PS], (int)q[KVG_MAX_PAGES], P(q[KVG_TABLES]), row0, nnew,
                        P(q[KVG_LENS]), q[KVG_WINDOW]);
        if (!rc && !(plan[g] = cattn_plan(B, hkv, hq / hkv, D, (int)q[KVG_PS], q[KVG_S], qkv, QKV, P(q[KVG_TABLES]),
                                          (int)q[KVG_MAX_PAGES], row0, nnew, P(q[KVG_LENS]), q[KVG_WINDOW], a0.att)))
            rc = 4;
    }
    int bad = 0, refused = 0;
    if (!rc) {
#pragma omp parallel num_threads(n_threads)
        for (int l = 0; l < L; l++) {
            const int64_t *f = layers + (int64_t)l * KVL_N;
            AttnHalf a = a0;
            a.wqkv = proj_of(f + KVL_QKV, H), a.wo = proj_of(f + KVL_O, HD).p[0];
            a.g_in = P(f[KVL_G_ATTN]), a.qkv_b = proj_bias(f + KVL_QKV), a.o_b = proj_bias(f + KVL_O);
            a.post_w = P(f[KVL_POST_ATTN]);
            Prep p = pg[kvs[2 * l + 1]];
            p.kv = (float *)(intptr_t)kvs[2 * l], p.qk_norm = P(f[KVL_QK_NORM]);
            if (f[KVL_ROPE]) p.cos = cos1, p.sin = sin1;
            attn_in_region(&a, &p, plan[kvs[2 * l + 1]], x, ldx, &bad);
            if (E) {
                MoeRow m = moe;
                m.post_w = P(f[KVL_G_MLP]), m.wt = P(f[KVL_ROUTER]);
                m.gu = P(f[KVL_EXPERTS_GU]), m.dn = P(f[KVL_EXPERTS_DN]);
                moe_in_region(&m, N, x, ldx, buf, n_threads, &refused);
                continue;
            }
            const QProj gu = proj_of(f + KVL_GU, H), dn = proj_of(f + KVL_DN, I);
            const Mlp m = mlp_at(buf, N, H, I, &gu, &dn.p[0], P(f[KVL_G_MLP]), eps, proj_bias(f + KVL_GU),
                                 proj_bias(f + KVL_DN), act, P(f[KVL_POST_FF]), eps);
            mlp_in_region(&m, x, ldx);
        }
    }
    for (int g = 0; g < G; g++) cattn_free(plan[g]);
    return rc ? rc : bad ? 2 : refused;
}
