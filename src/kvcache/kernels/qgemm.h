/* What qgemm.c shares with the fused kernels built into the same library (dattn.c): a repacked
 * weight, activation scratch, and the row and column-group steps of a quantized product. None of
 * it is exported from the library. */
#ifndef KV_QGEMM_H
#define KV_QGEMM_H

#include <stddef.h>
#include <stdint.h>

#define KV_HIDDEN __attribute__((visibility("hidden")))
#define RCHUNK 64 /* rows whose activations stay in cache while every column group passes */

typedef struct { /* a repacked weight [out, K] (qformat.h) */
    int fmt, out, K;
    const uint8_t *qs;
    const void *d, *m;
} QW;

typedef struct { /* int8 activations of n rows of K inputs, nb = K / 32 blocks a row: q [n, K] values,
                  da [n, nb] steps, sa [n, nb, 3] step * (sum of a block's values, of its first 16, of its
                  last 16), is [n, nb, 2] the integer sums of the two halves, inv [n] row scales */
    int8_t *q;
    float *da, *sa;
    int32_t *is;
    float *inv;
} Scratch;

KV_HIDDEN int qw_valid(const QW *w);
KV_HIDDEN size_t scratch_bytes(int n, int K);
KV_HIDDEN Scratch scratch_at(char *p, int n, int K);
/* the calling thread's scratch memory of at least n bytes, kept for its next call (qgemm.c), or NULL */
KV_HIDDEN char *scratch_take(size_t n);
/* row r of x [., K] (times g; 1 / rms into s->inv[r] when eps >= 0) -> row r of s's activations */
KV_HIDDEN void act_row(const Scratch *s, int r, int K, const float *x, int64_t ldx, const float *g, float eps);
/* tile column t (the column groups a tile covers: one, or two with AVX-512), rows r0 .. r1 - 1:
 * y (+)= products * rscale + bias */
KV_HIDDEN void mm_group(const QW *wt, int t, int r0, int r1, const Scratch *s, const float *bias,
                        const float *rscale, float *y, int64_t ldy, int accumulate);
/* x += rms_norm(y) * w, one row of H */
KV_HIDDEN void add_normed(int H, const float *y, const float *w, float eps, float *x);
/* Called inside a parallel region (the loops are shared with `omp for`):
 * mm_rows: every column group of wt over rows 0 .. n - 1 of s's activations, RCHUNK rows at a time;
 * mm_residual: x += o, or x += rms_norm(o) * post_w when post_w is given (o staged in y [n, wt->out]),
 * where o is wt times s's activations: an output projection and its residual. */
KV_HIDDEN void mm_rows(const QW *wt, int n, const Scratch *s, const float *bias, const float *rscale, float *y,
                       int64_t ldy, int accumulate);
KV_HIDDEN void mm_residual(const QW *wt, int n, const Scratch *s, const float *bias, float *x, int64_t ldx, float *y,
                           const float *post_w, float post_eps);

/* A gated MLP of n rows (kv_q_mlp): its weights, steps and scratch. mlp_bytes: the scratch it needs;
 * mlp_at: laid out in buf; mlp_in_region: x (+)= post_norm(down(act(gate) * up)), every thread of a
 * parallel region calls it; mlp_valid: the weights fit H and I, act is 0 (silu) or 1 (tanh GELU). */
typedef struct {
    QW gu, dn;
    int n, H, I, act;
    const float *g_in;
    float eps;
    const float *gu_b, *dn_b, *post_w;
    float post_eps;
    Scratch a, b;
    float *h, *y;
} Mlp;
KV_HIDDEN size_t mlp_bytes(int n, int H, int I, int post);
KV_HIDDEN Mlp mlp_at(char *buf, int n, int H, int I, const QW *gu, const QW *dn, const float *g_in, float eps,
                     const float *gu_b, const float *dn_b, int act, const float *post_w, float post_eps);
KV_HIDDEN void mlp_in_region(const Mlp *m, float *x, int64_t ldx);
KV_HIDDEN int mlp_valid(const QW *gu, const QW *dn, int H, int I, int act);

#endif
