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

/* A projection of up to KV_MAXPARTS weights side by side (a fused q|k|v or gate|up whose tensors have
 * different formats): part i's out columns start at column off[i] of the product; all take K inputs. */
#define KV_MAXPARTS 3
typedef struct {
    int n, out, K;
    QW p[KV_MAXPARTS];
    int off[KV_MAXPARTS];
} QProj;

typedef struct { /* int8 activations of n rows of K inputs, in two orders, each made only when `need`
                  asks for it (ACT_BLOCK, ACT_SUPER; scratch_at asks for both):
                  per block of 32 (nb = K / 32 blocks a row), for every format but the K-quants:
                  q [n, K] values, da [n, nb] steps, sa [n, nb, 3] step * (sum of a block's values, of its
                  first 16, of its last 16), is [n, nb, 2] the integer sums of the two halves;
                  per super-block of 256 (K-quant weights, K a multiple of 256): kq [n, K] values,
                  dk [n, K / 256] steps, k16 [n, K / 16] the integer sums of each 16 values, k32 [n, nb]
                  of each 32;
                  inv [n] row scales (either order);
                  kt: the super-block order's values again in the tile order of qamx.c (16-row tiles,
                  each 64 inputs of its 16 rows as 1 KiB: kt[(r / 16) K 16 + 1024 (k / 64) + 64 (r % 16)
                  + k % 64]), made only where scratch_at found mm_tile_acts asking for them, else NULL */
    int8_t *q;
    float *da, *sa;
    int32_t *is;
    int8_t *kq, *kt;
    float *dk;
    int16_t *k16, *k32;
    float *inv;
    int need;
} Scratch;
enum { ACT_BLOCK = 1, ACT_SUPER = 2 };

/* A projection as the fused calls take it from Python, KVP_N int64 fields: its number of parts (1 to
 * KV_MAXPARTS), each part's format, arrays (qs, d, m: addresses) and columns, then its bias
 * (an address or 0). */
enum { KVP_PARTS = 0, KVP_PART = 1 /* fmt, qs, d, m, out: 5 a part */, KVP_BIAS = 1 + 5 * KV_MAXPARTS, KVP_N };

KV_HIDDEN int qw_valid(const QW *w);
/* qproj1: a projection of one weight; qproj_valid: 1 when every part is valid, of the same K, and
 * the parts fill out side by side; proj_of: the projection in fields f taking K inputs (n 0, invalid,
 * when its part count is out of range), proj_bias its bias */
KV_HIDDEN QProj qproj1(const QW *w);
KV_HIDDEN int qproj_valid(const QProj *w);
KV_HIDDEN QProj proj_of(const int64_t *f, int K);
KV_HIDDEN const float *proj_bias(const int64_t *f);
KV_HIDDEN size_t scratch_bytes(int n, int K);
KV_HIDDEN Scratch scratch_at(char *p, int n, int K);
/* the activation orders (ACT_BLOCK, ACT_SUPER) a projection's parts take */
KV_HIDDEN int proj_acts(const QProj *w);
/* the calling thread's scratch memory of at least n bytes, kept for its next call (qgemm.c), or NULL */
KV_HIDDEN char *scratch_take(size_t n);
/* row r of x [., K] (times g; 1 / rms into s->inv[r] when eps >= 0) -> row r of s's activations */
KV_HIDDEN void act_row(const Scratch *s, int r, int K, const float *x, int64_t ldx, const float *g, float eps);
/* tile column t (the column groups a tile covers: one, or two with AVX-512), rows r0 .. r1 - 1:
 * y (+)= products * rscale + bias */
KV_HIDDEN void mm_group(const QW *wt, int t, int r0, int r1, const Scratch *s, const float *bias,
                        const float *rscale, float *y, int64_t ldy, int accumulate);
/* nr rows of cols products (res, rows ldr apart) into y (rows ldy apart): y (+)= res * rscale + bias
 * (rscale, bias NULL: 1, 0), the last step of every product kernel */
KV_HIDDEN void mm_store(int nr, int cols, const float *res, int ldr, const float *rscale, const float *bias, float *y,
                        int64_t ldy, int accumulate);
/* A tile path for mm_group: the first rows of r0 .. r1 - 1 of wt's tile column t as mm_group computes
 * them, the very bits; returns how many rows from r0 it did (0: none; mm_group calls it first and does
 * the rest). NULL: none. AMX tiles (qamx.c) set it when the library is loaded, in a build whose
 * variant has them; they decline while AMX is unusable here, failed its self-check or does not suit
 * the format. The products know no tile path by name. */
typedef int (*TileGroupFn)(const QW *wt, int t, int r0, int r1, const Scratch *s, const float *bias,
                           const float *rscale, float *y, int64_t ldy, int accumulate);
KV_HIDDEN extern TileGroupFn mm_tiles;
/* Whether the tile path wants the activations of n rows in its own order too (Scratch's kt): set with
 * mm_tiles; asked by scratch_at, before a product's activations are made. NULL: never. */
typedef int (*TileActsFn)(int n);
KV_HIDDEN extern TileActsFn mm_tile_acts;
/* x += rms_norm(y) * w, one row of H */
KV_HIDDEN void add_normed(int H, const float *y, const float *w, float eps, float *x);
/* Called inside a parallel region (the loops are shared with `omp for`):
 * mm_rows: every column group of wt over rows 0 .. n - 1 of s's activations, RCHUNK rows at a time;
 * mm_residual: x += o, or x += rms_norm(o) * post_w when post_w is given (o staged in y [n, wt->out]),
 * where o is wt times s's activations: an output projection and its residual. */
KV_HIDDEN void mm_rows(const QW *wt, int n, const Scratch *s, const float *bias, const float *rscale, float *y,
                       int64_t ldy, int accumulate);
/* mm_rows over every part of a projection, the parts' column groups shared out as one loop */
KV_HIDDEN void mm_proj(const QProj *w, int n, const Scratch *s, const float *bias, const float *rscale, float *y,
                       int64_t ldy, int accumulate);
/* proj_tiles: the tile columns of a projection (its parts' side by side); proj_tile: tile column t
 * of them over rows r0 .. r1 - 1 of s's activations, the very steps mm_proj shares out with `omp for` */
KV_HIDDEN int proj_tiles(const QProj *w);
KV_HIDDEN void proj_tile(const QProj *w, int t, int r0, int r1, const Scratch *s, const float *bias,
                         const float *rscale, float *y, int64_t ldy, int accumulate);
/* act(gate) * up for one row of [gate | up] (I each, a multiple of VL): silu (act 0) or the tanh
 * GELU (1), written over the gate half */
KV_HIDDEN void glu_row(int act, int I, float *h);
KV_HIDDEN void mm_residual(const QW *wt, int n, const Scratch *s, const float *bias, float *x, int64_t ldx, float *y,
                           const float *post_w, float post_eps);

/* A gated MLP of n rows (kv_q_mlp): its weights, steps and scratch. mlp_bytes: the scratch it needs;
 * mlp_at: laid out in buf; mlp_in_region: x (+)= post_norm(down(act(gate) * up)), every thread of a
 * parallel region calls it; mlp_valid: the weights fit H and I, act is 0 (silu) or 1 (tanh GELU). */
typedef struct {
    QProj gu;
    QW dn;
    int n, H, I, act;
    const float *g_in;
    float eps;
    const float *gu_b, *dn_b, *post_w;
    float post_eps;
    Scratch a, b;
    float *h, *y;
} Mlp;
KV_HIDDEN size_t mlp_bytes(int n, int H, int I, int post);
KV_HIDDEN Mlp mlp_at(char *buf, int n, int H, int I, const QProj *gu, const QW *dn, const float *g_in, float eps,
                     const float *gu_b, const float *dn_b, int act, const float *post_w, float post_eps);
KV_HIDDEN void mlp_in_region(const Mlp *m, float *x, int64_t ldx);
KV_HIDDEN int mlp_valid(const QProj *gu, const QW *dn, int H, int I, int act);

/* A decode row's sparse half (dmoe.c; kv_q_moe_row is it in a call of its own): x [H] += the mixture
 * of its k chosen experts of E, after the post-attention norm (post_w) and the router (wt [H, Ep]);
 * gu, dn: every expert's fields [E, KVP_N]. moe_row_bytes: the scratch it takes; moe_row_in_region:
 * every thread of a parallel region calls it with the same buf (shared) and refused (set, and x left
 * as it was, when a chosen expert does not fit H, I and act: nothing runs once it is set). */
typedef struct {
    int H, I, E, Ep, k, norm, act;
    float eps;
    const float *post_w, *wt;
    const int64_t *gu, *dn;
} MoeRow;
KV_HIDDEN int moe_row_valid(const MoeRow *m);
KV_HIDDEN size_t moe_row_bytes(const MoeRow *m);
KV_HIDDEN void moe_row_in_region(const MoeRow *m, float *x, char *buf, int *refused);
/* n rows of x (ldx apart) += each one's mixture, the same bits as kv_q_moe_row gives each alone: a
 * single row as moe_row_in_region, more grouped by expert (kv_moe_route's then kv_q_moe_rows'
 * steps). moe_bytes: the scratch it takes in a region of n_threads threads; moe_in_region: every
 * thread of that region calls it with the same buf and refused (set, and x left as it was, when a
 * chosen expert does not fit or an id is out of range). */
KV_HIDDEN size_t moe_bytes(const MoeRow *m, int n, int n_threads);
KV_HIDDEN void moe_in_region(const MoeRow *m, int n, float *x, int64_t ldx, char *buf, int n_threads, int *refused);

#endif
