/* Projections of several rows against packed weights: y = x @ W (+ bias), fp32.
 *
 * The weights are kvcache's packed layout (models/layers.py): an nn.Linear weight [out, in] stored
 * as k column blocks, w [k, in, part], block b holding output columns b*part .. b*part+part-1.
 * Output rows are written in the plain layout y [n, k * part].
 *
 * Register tiles of NR rows x TW columns: for every input channel i the tile's TW weights are
 * loaded once and multiplied by NR broadcast inputs, so each weight read from memory serves NR
 * rows (a one-row product reads every weight for one multiply and is left to the caller's BLAS).
 * Work items are (block, column tile) pairs run in parallel (OpenMP); a column tile's weight panel
 * [in, TW] stays in the core's cache while every row of a row chunk passes over it. Row chunks keep
 * the inputs they read in cache too.
 *
 * Vectors are vmath.h's: with AVX-512 a vector is one register of 16 floats and a tile is 6 x 64;
 * otherwise 8 floats (4 without AVX) and 4 x 24 (or 4 x 12). Columns past the last whole tile go
 * through the same loop in single vectors, then one by one. Each output is one multiply-add chain
 * over the inputs in order (one rounding a step), so every variant gives the same bits.
 *
 * Layouts:
 *   x    [n, in] float, rows ldx apart (ldx >= in)
 *   w    [k, in, part] float contiguous
 *   bias [k, part] float contiguous, or NULL
 *   y    [n, k * part] float contiguous
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vmath.h"

#if VL == 16
#define NR 6
#define CW 4
#else
#define NR 4
#define CW 3
#endif
#define TW (VL * CW)
#define ROW_CHUNK (NR * 32)

/* NR (or fewer) rows x nc vectors of columns; nc is a constant at every call site, so the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(int nc, int nr, int in, const float *x, int64_t ldx,
                                                       const float *w, int64_t ldw, const float *bias,
                                                       float *y, int64_t ldy) {
    vec acc[NR][CW];
    for (int c = 0; c < nc; c++) {
        vec b0 = bias ? *(const vec *)(bias + VL * c) : (vec){0};
        for (int r = 0; r < NR; r++) acc[r][c] = b0;
    }
    for (int i = 0; i < in; i++) {
        const float *wi = w + (int64_t)i * ldw;
        vec wv[CW];
        for (int c = 0; c < nc; c++) wv[c] = *(const vec *)(wi + VL * c);
        for (int r = 0; r < NR; r++) {
            if (r < nr) {
                const float s = x[(int64_t)r * ldx + i];
                for (int c = 0; c < nc; c++) acc[r][c] = vmadd((vec){0} + s, wv[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) *(vec *)(y + (int64_t)r * ldy + VL * c) = acc[r][c];
}

/* Rows r0..r1 of one block's columns c0..c0+width-1 (width < TW: the block's last columns). */
static void rest(int r0, int r1, int in, const float *x, int64_t ldx, const float *w, int64_t ldw,
                 const float *bias, float *y, int64_t ldy, int width) {
    int c = 0;
    for (; c + VL <= width; c += VL)
        for (int r = r0; r < r1; r += NR)
            tile(1, r1 - r < NR ? r1 - r : NR, in, x + (int64_t)r * ldx, ldx, w + c, ldw, bias ? bias + c : 0,
                 y + (int64_t)r * ldy + c, ldy);
    for (; c < width; c++)
        for (int r = r0; r < r1; r++) {
            float s = bias ? bias[c] : 0.f;
            for (int i = 0; i < in; i++) s = kv_fmaf(x[(int64_t)r * ldx + i], w[(int64_t)i * ldw + c], s);
            y[(int64_t)r * ldy + c] = s;
        }
}

int kv_packed_matmul(int n, int in, int k, int part, const float *x, int64_t ldx, const float *w,
                     const float *bias, float *y, int n_threads) {
    if (n < 1 || in < 1 || k < 1 || part < 1 || ldx < in) return 1;
    const int full = part / TW, tiles = full + (part % TW != 0);
    const int64_t ldy = (int64_t)k * part;
    for (int r0 = 0; r0 < n; r0 += ROW_CHUNK) {
        const int r1 = n - r0 < ROW_CHUNK ? n : r0 + ROW_CHUNK;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads)
        for (int b = 0; b < k; b++) {
            for (int t = 0; t < tiles; t++) {
                const float *wb = w + (int64_t)b * in * part + (int64_t)t * TW;
                const float *bb = bias ? bias + (int64_t)b * part + (int64_t)t * TW : 0;
                float *yb = y + (int64_t)b * part + (int64_t)t * TW;
                if (t == full) {
                    rest(r0, r1, in, x, ldx, wb, part, bb, yb, ldy, part - full * TW);
                    continue;
                }
                for (int r = r0; r < r1; r += NR)
                    tile(CW, r1 - r < NR ? r1 - r : NR, in, x + (int64_t)r * ldx, ldx, wb, part, bb,
                         yb + (int64_t)r * ldy, ldy);
            }
        }
    }
    return 0;
}
