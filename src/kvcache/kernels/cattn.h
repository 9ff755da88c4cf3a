/* Canonical-order attention over float32 KV pages (cattn.c): the planning and the parallel part,
 * for the fused kernels of dattn.c, which run it inside their own parallel region. */
#ifndef KV_CATTN_H
#define KV_CATTN_H

#include <stdint.h>

#include "qgemm.h"

#define KV_CH 128 /* keys per chunk, at fixed positions: chunk c holds keys c * KV_CH .. */

typedef struct CAttn CAttn;

/* 0, 1 for bad sizes, 3 for a page outside the pool (pages wholly before every new row's window are
 * not read, and may be holes). W: a sliding window (a row at position p sees keys p - W + 1 .. p),
 * 0 for none. */
KV_HIDDEN int cattn_check(int B, int hkv, int g, int D, int ps, int64_t S, const int64_t *tables, int max_pages,
                          const int64_t *row0, const int64_t *nnew, const int64_t *lens, int64_t W,
                          int64_t n_rows);
/* The work items of one call (NULL when memory runs out); q rows ldq apart (pre-scaled), out [N, hkv * g * D].
 * A plan serves every pool layer of the same shape (the layers of a group). */
KV_HIDDEN CAttn *cattn_plan(int B, int hkv, int g, int D, int ps, int64_t S, const float *q, int64_t ldq,
                            const int64_t *tables, int max_pages, const int64_t *row0,
                            const int64_t *nnew, const int64_t *lens, int64_t W, float *out);
/* gpt-oss's learned sinks: sinks [hkv * g], one logit a query head that joins each row's softmax
 * with no value (NULL: none, the default). */
KV_HIDDEN void cattn_set_sinks(CAttn *a, const float *sinks);
/* Attention over the pool layer kv [2, hkv, S, D] as planned; every thread of a parallel region calls
 * it; *bad = 1 when a thread's scratch cannot be had. */
KV_HIDDEN void cattn_in_region(const CAttn *a, const float *kv, int *bad);
KV_HIDDEN void cattn_free(CAttn *a);

#endif
