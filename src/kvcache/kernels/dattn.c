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
 *
 * Layouts (N rows in all; S = slots in the pool = pages * ps):
 *   qkv    [N, (hq + 2 hkv) * D] float, rows ldq apart (q and k heads are rotated in place)
 *   cos, sin [N, rot] float      qk_norm [hq + hkv, D] float or NULL
 *   kv     [2, hkv, S, D] float: the pool layer, K then V
 *   slots  [N] int64: where each new token's K/V go; tables [B, max_pages] int64; row0, nnew,
 *          lens [B] int64: sequence b's rows are row0[b] .. row0[b] + nnew[b] - 1 and it holds
 *          lens[b] tokens, the new ones included
 *   window 0, or W: a row at position p sees keys p - W + 1 .. p only
 *   out    [N, hq * D] float
 * Returns 0, 1 for bad sizes, 2 (or 4) when memory runs out, 3 for a slot or page outside the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cattn.h"
#include "qgemm.h"

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
            float ss = 0.f;
            for (int c = 0; c < D; c++) ss += x[c] * x[c];
            const float inv = 1.f / sqrtf(ss / (float)D + a->eps);
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
    cattn_in_region(c, bad);
}

int kv_decode_attend(int N, int hq, int hkv, int D, int rot, float *qkv, int64_t ldq, const float *cos,
                     const float *sin, const float *qk_norm, float eps, float *kv, int ps, int64_t S,
                     const int64_t *slots, const int64_t *tables, int max_pages, int B, const int64_t *row0,
                     const int64_t *nnew, const int64_t *lens, int64_t window, float scale, float *out,
                     int n_threads) {
    Prep p = {N, hq, hkv, D, rot, S, ldq, qkv, kv, scale, eps, cos, sin, qk_norm, slots};
    if (n_threads < 1 || B < 1) return 1;
    int rc = check_rows(&p, B, ps, max_pages, tables, row0, nnew, lens, window);
    if (rc) return rc;
    CAttn *c = cattn_plan(B, hkv, hq / hkv, D, ps, S, qkv, ldq, kv, tables, max_pages, row0, nnew, lens, window,
                          out);
    if (!c) return 2;
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    attend_in_region(&p, c, &bad);
    cattn_free(c);
    return bad ? 2 : 0;
}

/* The attention half of a layer with quantized weights (see the top of the file), N rows:
 * x [N, H] += o_proj(attention(qkv_proj(x * g_in / rms(x)))), the output through an RMSNorm of
 * weight post_w first when given. Returns as kv_decode_attend, or 4 when scratch cannot be had. */
int kv_q_attn_block(int N, int H, float *x, int64_t ldx, const float *g_in, float eps, int qkv_fmt,
                    const uint8_t *qkv_qs, const void *qkv_d, const void *qkv_m, const float *qkv_b, int hq,
                    int hkv, int D, int rot, const float *cos, const float *sin, const float *qk_norm, float *kv,
                    int ps, int64_t S, const int64_t *slots, const int64_t *tables, int max_pages, int B,
                    const int64_t *row0, const int64_t *nnew, const int64_t *lens, int64_t window, float scale,
                    int o_fmt,
                    const uint8_t *o_qs, const void *o_d, const void *o_m, const float *o_b, const float *post_w,
                    float post_eps, int n_threads) {
    const int QKV = (hq + 2 * hkv) * D, HD = hq * D;
    const QW wqkv = {qkv_fmt, QKV, H, qkv_qs, qkv_d, qkv_m}, wo = {o_fmt, H, HD, o_qs, o_d, o_m};
    if (N < 1 || B < 1 || n_threads < 1 || ldx < H || !qw_valid(&wqkv) || !qw_valid(&wo)) return 1;
    const size_t s1 = scratch_bytes(N, H), s2 = scratch_bytes(N, HD);
    const size_t fl = ((size_t)N * QKV + (size_t)N * HD + (post_w ? (size_t)N * H : 0)) * sizeof(float);
    char *buf = scratch_take(s1 + s2 + fl + 128);
    if (!buf) return 4;
    const Scratch sx = scratch_at(buf, N, H), so = scratch_at(buf + s1, N, HD);
    float *qkv = (float *)(buf + ((s1 + s2 + 63) & ~(size_t)63)), *att = qkv + (size_t)N * QKV;
    float *y = post_w ? att + (size_t)N * HD : NULL;
    Prep p = {N, hq, hkv, D, rot, S, QKV, qkv, kv, scale, eps, cos, sin, qk_norm, slots};
    int rc = check_rows(&p, B, ps, max_pages, tables, row0, nnew, lens, window);
    CAttn *c = rc ? NULL : cattn_plan(B, hkv, hq / hkv, D, ps, S, qkv, QKV, kv, tables, max_pages, row0, nnew,
                                      lens, window, att);
    if (!rc && !c) rc = 4;
    if (rc) return rc;
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < N; r++) act_row(&sx, r, H, x, ldx, g_in, eps);
        mm_rows(&wqkv, N, &sx, qkv_b, eps >= 0.f ? sx.inv : NULL, qkv, QKV, 0);
        attend_in_region(&p, c, &bad);
#pragma omp for schedule(static)
        for (int r = 0; r < N; r++) act_row(&so, r, HD, att, HD, NULL, -1.f);
        mm_residual(&wo, N, &so, o_b, x, ldx, y, post_w, post_eps);
    }
    cattn_free(c);
    return bad ? 2 : 0;
}
