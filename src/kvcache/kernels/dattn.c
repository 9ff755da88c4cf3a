/* Decode attention fused with the steps around it, for a batch of sequences that each feed one new
 * token over fp32 pages with full visibility. Built into the quantized-weights library (qgemm).
 *
 * kv_decode_attend: from each sequence's row of the fused q|k|v projection, the q and k heads get
 * their per-head RMSNorm (when the model has one: Qwen3, Gemma 3) and their rotary embedding (HF's
 * rotate-half convention; ``sin`` carries rotate_half's sign, as models/layers.py's Rotary tables
 * do; dims past ``rot`` are left alone), k and v are written into the pool at the token's slot,
 * and the query heads attend over the sequence's pages, the new token included.
 * kv_q_attn_block: the whole attention half of a layer with quantized weights: the input norm and
 * the q|k|v projection, the above, the output projection and the residual (through Gemma 3's
 * post-attention norm when it has one), in one parallel region.
 *
 * Attention work items are (sequence, KV head, chunk of keys): chunks keep every thread busy even
 * for one sequence of a few heads and merge by log-sum-exp; each item makes two passes (scores,
 * a key row read once for the g query heads sharing it; then softmax-weighted values).
 *
 * Layouts (S = slots in the pool = pages * ps):
 *   qkv    [B, (hq + 2 hkv) * D] float, rows ldq apart (q and k heads are rotated in place)
 *   cos, sin [B, rot] float      qk_norm [hq + hkv, D] float or NULL
 *   kv     [2, hkv, S, D] float: the pool layer, K then V
 *   slots  [B] int64: where each new token's K/V go; tables [B, max_pages] int64; lens [B] int64
 *          (tokens each query attends to, its own included)
 *   out    [B, hq * D] float
 * Returns 0, 1 for bad sizes, 2 (or 4) when memory runs out, 3 for a slot or page outside the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pspan.h"
#include "qgemm.h"

#define CHUNK 256 /* keys per work item at most */
#define MAXG 32
#define MAXD 1024

typedef struct {
    int b, h;
    int64_t j0, j1;
} item_t;

typedef struct { /* what one decode-attention call reads and writes */
    int B, hq, hkv, D, rot, ps, max_pages;
    int64_t S, ldq;
    float *qkv, *kv, *out, scale, eps;
    const float *cos, *sin, *qk_norm;
    const int64_t *slots, *tables, *lens;
    /* the work items: nch[b] chunks per head of sequence b; part: per item m [g], l [g], acc [g, D] */
    int64_t items, *nch;
    item_t *its;
    float *part;
} Attn;

static int check(const Attn *a) {
    if (a->B < 1 || a->hkv < 1 || a->hq < a->hkv || a->hq % a->hkv || a->hq / a->hkv > MAXG || a->D < 1 ||
        a->D > MAXD || a->rot < 0 || a->rot > a->D || a->rot % 2 || a->ps < 1 || a->S < a->ps || a->max_pages < 1 ||
        a->ldq < (int64_t)(a->hq + 2 * a->hkv) * a->D)
        return 1;
    for (int b = 0; b < a->B; b++) { /* every slot and page the call touches lies in the pool */
        const int64_t pages = (a->lens[b] + a->ps - 1) / a->ps;
        if (a->lens[b] < 1 || pages > a->max_pages || a->slots[b] < 0 || a->slots[b] >= a->S) return 3;
        for (int64_t i = 0; i < pages; i++) {
            const int64_t page = a->tables[(int64_t)b * a->max_pages + i];
            if (page < 0 || page >= a->S / a->ps) return 3;
        }
    }
    return 0;
}

/* Split every (sequence, head) into chunks: enough items for every thread, none over CHUNK keys. */
static int plan(Attn *a, int n_threads) {
    const int g = a->hq / a->hkv;
    const int64_t want = (4 * (int64_t)n_threads + (int64_t)a->B * a->hkv - 1) / ((int64_t)a->B * a->hkv);
    a->nch = malloc(sizeof(int64_t) * (size_t)a->B);
    if (!a->nch) return 2;
    a->items = 0;
    for (int b = 0; b < a->B; b++) {
        const int64_t by_size = (a->lens[b] + CHUNK - 1) / CHUNK, by_keys = (a->lens[b] + 31) / 32;
        a->nch[b] = by_size > want ? by_size : (want < by_keys ? want : by_keys);
        if (a->nch[b] < 1) a->nch[b] = 1;
        a->items += a->nch[b] * a->hkv;
    }
    a->its = malloc(sizeof(item_t) * (size_t)a->items);
    a->part = malloc(sizeof(float) * (size_t)a->items * g * (a->D + 2));
    if (!a->its || !a->part) return 2;
    int64_t n = 0;
    for (int b = 0; b < a->B; b++)
        for (int h = 0; h < a->hkv; h++)
            for (int64_t c = 0; c < a->nch[b]; c++, n++) {
                a->its[n].b = b;
                a->its[n].h = h;
                a->its[n].j0 = a->lens[b] * c / a->nch[b];
                a->its[n].j1 = a->lens[b] * (c + 1) / a->nch[b];
            }
    return 0;
}

static void release(Attn *a) {
    free(a->nch);
    free(a->its);
    free(a->part);
}

/* Row b: per-head norm and RoPE of the q and k heads, then k and v into the pool. */
static void prepare(const Attn *a, int b) {
    float tmp[MAXD];
    float *row = a->qkv + (int64_t)b * a->ldq;
    const float *cs = a->cos + (int64_t)b * a->rot, *sn = a->sin + (int64_t)b * a->rot;
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
    }
    for (int h = 0; h < a->hkv; h++) {
        memcpy(a->kv + ((int64_t)h * a->S + a->slots[b]) * D, row + (int64_t)(a->hq + h) * D, sizeof(float) * D);
        memcpy(a->kv + ((int64_t)(a->hkv + h) * a->S + a->slots[b]) * D, row + (int64_t)(a->hq + a->hkv + h) * D,
               sizeof(float) * D);
    }
}

/* Work item i: the g query heads of its KV head over its keys; scores is scratch [g, CHUNK]. */
static void run_item(const Attn *a, int64_t i, float *scores) {
    const item_t *it = a->its + i;
    const int g = a->hq / a->hkv, D = a->D, ps = a->ps;
    float *m = a->part + i * g * (D + 2), *l = m + g, *acc = m + 2 * g;
    const int64_t n = it->j1 - it->j0;
    const float *q = a->qkv + (int64_t)it->b * a->ldq + (int64_t)it->h * g * D;
    const float *K = a->kv + (int64_t)it->h * a->S * D, *V = a->kv + ((int64_t)a->hkv + it->h) * a->S * D;
    const int64_t *table = a->tables + (int64_t)it->b * a->max_pages;
    span_attend(g, D, ps, q, K, V, table, it->j0, n, a->scale, scores, m, l, acc);
}

/* Sequence b's query heads of KV head h: merge its chunks into out. first: its first item. */
static void merge(const Attn *a, int b, int h, int64_t first) {
    const int g = a->hq / a->hkv, D = a->D;
    for (int j = 0; j < g; j++) {
        float M = -INFINITY, L = 0.f;
        for (int64_t c = 0; c < a->nch[b]; c++) {
            const float mc = a->part[(first + c) * g * (D + 2) + j];
            if (mc > M) M = mc;
        }
        float *o = a->out + (int64_t)b * a->hq * D + ((int64_t)h * g + j) * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        for (int64_t c = 0; c < a->nch[b]; c++) {
            const float *p = a->part + (first + c) * g * (D + 2);
            if (!(p[g + j] > 0.f)) continue;
            const float w = expf(p[j] - M);
            L += w * p[g + j];
            const float *acc = p + 2 * g + (int64_t)j * D;
            for (int d = 0; d < D; d++) o[d] += w * acc[d];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

/* The attention steps inside a parallel region (every thread calls it). */
static void attend_in_region(const Attn *a, int *bad) {
    const int g = a->hq / a->hkv;
#pragma omp for schedule(static)
    for (int b = 0; b < a->B; b++) prepare(a, b);
    float *scores = malloc(sizeof(float) * (size_t)g * CHUNK);
    if (!scores) {
#pragma omp atomic write
        *bad = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a->items; i++)
        if (scores) run_item(a, i, scores);
    free(scores);
#pragma omp for schedule(static)
    for (int w = 0; w < a->B * a->hkv; w++) {
        const int b = w / a->hkv, h = w % a->hkv;
        int64_t first = 0;
        for (int bb = 0; bb < b; bb++) first += a->nch[bb] * a->hkv;
        merge(a, b, h, first + h * a->nch[b]);
    }
}

int kv_decode_attend(int B, int hq, int hkv, int D, int rot, float *qkv, int64_t ldq, const float *cos,
                     const float *sin, const float *qk_norm, float eps, float *kv, int ps, int64_t S,
                     const int64_t *slots, const int64_t *tables, int max_pages, const int64_t *lens, float scale,
                     float *out, int n_threads) {
    Attn a = {B, hq, hkv, D, rot, ps, max_pages, S, ldq, qkv, kv, out, scale, eps, cos, sin, qk_norm,
              slots, tables, lens, 0, NULL, NULL, NULL};
    if (n_threads < 1) return 1;
    int rc = check(&a);
    if (rc) return rc;
    if (plan(&a, n_threads)) {
        release(&a);
        return 2;
    }
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    attend_in_region(&a, &bad);
    release(&a);
    return bad ? 2 : 0;
}

/* The attention half of a decode layer with quantized weights (see the top of the file):
 * x [B, H] += o_proj(attention(qkv_proj(x * g_in / rms(x)))), the output through an RMSNorm of
 * weight post_w first when given. Returns as kv_decode_attend, or 4 when scratch cannot be had. */
int kv_q_attn_block(int B, int H, float *x, int64_t ldx, const float *g_in, float eps, int qkv_fmt,
                    const uint8_t *qkv_qs, const void *qkv_d, const void *qkv_m, const float *qkv_b, int hq,
                    int hkv, int D, int rot, const float *cos, const float *sin, const float *qk_norm, float *kv,
                    int ps, int64_t S, const int64_t *slots, const int64_t *tables, int max_pages,
                    const int64_t *lens, float scale, int o_fmt, const uint8_t *o_qs, const void *o_d,
                    const void *o_m, const float *o_b, const float *post_w, float post_eps, int n_threads) {
    const int QKV = (hq + 2 * hkv) * D, HD = hq * D;
    const QW wqkv = {qkv_fmt, QKV, H, qkv_qs, qkv_d, qkv_m}, wo = {o_fmt, H, HD, o_qs, o_d, o_m};
    if (B < 1 || n_threads < 1 || ldx < H || !qw_valid(&wqkv) || !qw_valid(&wo)) return 1;
    const size_t s1 = scratch_bytes(B, H), s2 = scratch_bytes(B, HD);
    const size_t fl = ((size_t)B * QKV + (size_t)B * HD + (post_w ? (size_t)B * H : 0)) * sizeof(float);
    char *buf = malloc(s1 + s2 + fl + 128);
    if (!buf) return 4;
    const Scratch sx = scratch_at(buf, B, H), so = scratch_at(buf + s1, B, HD);
    float *qkv = (float *)(buf + ((s1 + s2 + 63) & ~(size_t)63)), *att = qkv + (size_t)B * QKV;
    float *y = post_w ? att + (size_t)B * HD : NULL;
    Attn a = {B, hq, hkv, D, rot, ps, max_pages, S, QKV, qkv, kv, att, scale, eps, cos, sin, qk_norm,
              slots, tables, lens, 0, NULL, NULL, NULL};
    int rc = check(&a);
    if (!rc && plan(&a, n_threads)) rc = 4;
    if (rc) {
        release(&a);
        free(buf);
        return rc;
    }
    int bad = 0;
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < B; r++) act_row(r, H, x, ldx, g_in, eps, sx.q, sx.da, sx.sa, sx.inv);
        mm_rows(&wqkv, B, &sx, qkv_b, eps >= 0.f ? sx.inv : NULL, qkv, QKV, 0);
        attend_in_region(&a, &bad);
#pragma omp for schedule(static)
        for (int r = 0; r < B; r++) act_row(r, HD, att, HD, NULL, -1.f, so.q, so.da, so.sa, so.inv);
        mm_residual(&wo, B, &so, o_b, x, ldx, y, post_w, post_eps);
    }
    release(&a);
    free(buf);
    return bad ? 2 : 0;
}
