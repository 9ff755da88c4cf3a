/* Attention over a quantized KV cache (KIVI layout: cache/qpool.py) read in place, and the fp32
 * tokens after it, in one canonical order: a query row's result is the same bits whatever else is
 * computed beside it (its sequence's other new tokens, a decode or a prefill, the number of threads).
 *
 * The order, for one query row of KV head h (it sees every quantized key, then the fp32 "rest"
 * up to itself):
 *   - keys go in chunks at fixed places: CH tokens' worth of whole pages of the quantized part
 *     (chunk c holds pages c * CP .. c * CP + CP - 1), then chunks of CH tokens of the rest;
 *   - an int8 chunk takes integer products (qint.h): per key group and row, q times the group's key
 *     scales rounded to 16-bit integers, exact sums against the codes taken about their middle,
 *     one multiply-add to a score; per row and group of value elements, the chunk's softmax weights
 *     times the tokens' value scales rounded to 16-bit integers, exact sums against the codes, one
 *     multiply-add; so the instruction set (VNNI's dpwssd, AVX2's pmaddwd, plain C) changes no bit;
 *   - an int4 or int2 chunk's codes are widened to floats in a fixed lane order (unpack16: sixteen
 *     lanes, the same at every vector width); a key group's score lane starts at q . min and takes
 *     one multiply-add per channel, c = 0 .. D-1, of (q * scale)[c] and the code; the rest's keys,
 *     transposed sixteen at a time, start at 0 and take q[c] and the key;
 *   - the chunk's maximum m, exp(s - m) by vexp16, their sum l over sixteen lanes (key k in lane
 *     k % 16) reduced by one fixed tree; but for int8 chunks, the value sum acc, one multiply-add
 *     chain per output element over the chunk's keys in the chunk's order (a value row is
 *     code * scale + min);
 *   - partials merge in chunk order (merge); with ``rotate`` the quantized chunks saw the query
 *     turned by the normalized Hadamard transform of the pages (cache/rotation.py), so their merged
 *     sum is turned back (fwht) before the rest's chunks join.
 * 16-bit float pages (kv_half_attend: fp16 or bf16, no quantized part) are a rest of L keys read
 * through the slots, widened exactly; a decode's rows (at most NR a KV head) take the same steps on
 * the rows read in place (half_rows), prefill's on the chunk widened into the scratch once.
 * How work is spread does not enter the arithmetic. A call with few query rows per KV head (decode,
 * speculation) spreads its chunks over the threads and merges the stored partials in order; one
 * with many (prefill) gives each thread blocks of rows that run the chunks in order.
 *
 * Layouts (P = pages in the pool, ps = page size, G = group, nb = G * bits / 8, Dp = D * bits / 8):
 *   q    [T, hkv * g, D] float, the softmax scale applied; query head h * g + i uses KV head h
 *   kc   [hkv, P, ps / G, D, nb] uint8 (a channel's G token codes together)   ks, km [hkv, P, ps / G, D] half
 *   vc   [hkv, P, ps, Dp] uint8    vs, vm [hkv, P, ps, D / G] half
 *   tk, tv [hkv, n_rest, D] float: the tokens after the pages; the last T are the new ones (row t
 *          of the call sees rest tokens 0 .. n_rest - T + t)
 *   out  [T, hkv * g, D] float
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qlanes.h"
#include "qrows.h"
#include "qint.h"

/* The narrowest code width whose chunks take the integer products (qint.h): 8. Narrower codes keep
 * the float products (codes widened to floats), which the integer ones did not match closely
 * enough on held-out text (EVAL.md, "Integer attention products"); a build with
 * -DKV_INT_MIN_BITS=2 (CC="gcc -DKV_INT_MIN_BITS=2") gives them the integer products to measure. */
#ifndef KV_INT_MIN_BITS
#define KV_INT_MIN_BITS 8
#endif

typedef struct {
    int hkv, g, D, ps, G, bits, T, n_pages, n_rest, rotate, cp, nq, nr;
    int64_t P;
    const float *q, *qrot, *tk, *tv;
    const int64_t *pages;
    const uint8_t *kc, *vc;
    const uint16_t *ks, *km, *vs, *vm;
    float *out;
    /* 16-bit float pages (no quantized part): K and V [hkv, S, D] (fp16 or bf16), slot of each position */
    const uint16_t *hk, *hv;
    const int64_t *slots;
    int64_t first_slot, S;
    int bf16;
} job_t;

typedef struct { /* a thread's scratch */
    float *KT, *V, *ks, *kz, *st;
    int chan[MAXD];
} scratch_t;

/* Keys of a chunk at most: whole pages of CH keys, or one page where a page is longer. */
static int chunk_keys(const job_t *j) { return j->cp * j->ps > CH ? j->cp * j->ps : CH; }

/* Floats of the scratch's value region: a chunk's value rows widened, or (prep_int) its value codes
 * as pairs, their scales and minimums, then NM rows' rounded weights and one row's products. */
static size_t value_floats(const job_t *j) {
    const size_t n = (size_t)chunk_keys(j), D = (size_t)j->D, vg = D / 16; /* G >= 16 */
    const size_t codes = n * D / 2 + 2 * n * vg + (size_t)NM * vg * (n / 2) + n; /* n >= CH: ws = n / 2 */
    return codes > n * D ? codes : n * D;
}

static size_t scratch_floats(const job_t *j) {
    const int n = chunk_keys(j);
    return (size_t)n * j->D + value_floats(j) + (size_t)2 * (n / 16 + 1) * j->D + (size_t)NM * n + 64;
}

static void scratch_bind(const job_t *j, float *mem, scratch_t *sc) {
    const int n = chunk_keys(j);
    sc->KT = mem;
    sc->V = sc->KT + (size_t)n * j->D;
    sc->ks = sc->V + value_floats(j);
    sc->kz = sc->ks + (size_t)(n / 16 + 1) * j->D;
    sc->st = sc->kz + (size_t)(n / 16 + 1) * j->D;
}

/* Quantized chunk c of KV head h widened into the scratch (bits and G constants where inlined). */
static ALWAYS void prep_wide(const job_t *j, int h, int c, scratch_t *sc, chunk_t *ck, int bits, int G) {
    const int D = j->D, nb = G * bits / 8, ng = j->ps / G, Dp = D * bits / 8;
    const int p0 = c * j->cp, p1 = p0 + j->cp < j->n_pages ? p0 + j->cp : j->n_pages;
    const int n = (p1 - p0) * j->ps;
    int tok[512];
    for (int L = 0; L < G; L++) tok[L] = lane_item(L, bits, G);
    for (int i = 0; i < D; i++) sc->chan[i] = i / G * G + lane_item(i % G, bits, G);
    for (int pi = p0; pi < p1; pi++) {
        const int64_t page = j->pages[pi], base = (int64_t)h * j->P + page;
        for (int kgi = 0; kgi < ng; kgi++) {
            const int t0 = (pi - p0) * j->ps + kgi * G;
            const uint8_t *codes = j->kc + (base * ng + kgi) * D * nb;
            halves(j->ks + (base * ng + kgi) * D, D, sc->ks + (int64_t)(t0 / G) * D);
            halves(j->km + (base * ng + kgi) * D, D, sc->kz + (int64_t)(t0 / G) * D);
            for (int ch = 0; ch < D; ch++)
                for (int v = 0; v < G / 16; v++)
                    *(v16 *)(sc->KT + (int64_t)ch * n + t0 + 16 * v) = unpack16(codes + (int64_t)ch * nb, bits, G, v);
            for (int L = 0; L < G; L++) {
                const int64_t row = base * j->ps + kgi * G + tok[L];
                float s[MAXD / 16], z[MAXD / 16];
                halves(j->vs + row * (D / G), D / G, s);
                halves(j->vm + row * (D / G), D / G, z);
                float *dst = sc->V + (int64_t)(t0 + L) * D;
                for (int gr = 0; gr < D / G; gr++)
                    for (int v = 0; v < G / 16; v++)
                        *(v16 *)(dst + gr * G + 16 * v) = MADD(unpack16(j->vc + row * Dp + gr * nb, bits, G, v), s[gr], (v16){0} + z[gr]);
            }
        }
    }
    *ck = (chunk_t){n, G, sc->KT, sc->ks, sc->kz, sc->V, sc->chan};
}

/* Output elements d0 .. d0 + 16 * ns - 1 of rows 0 .. nr-1: the weights st [NR, n] times the value
 * rows of chunk pages p0 .. p1-1 widened in registers (code * scale + min), token after token in the
 * chunk's order; ns constant where inlined (the accumulators stay in registers). */
static ALWAYS void value_slab(const job_t *j, int h, int p0, int p1, int d0, int ns, const int *tok, const float *st,
                              int n, int nr, const float *vs, const float *vz, const int *chan, part_t *const *parts,
                              int bits, int G) {
    const int D = j->D, nb = G * bits / 8, ng = j->ps / G, Dp = D * bits / 8, vg = D / G, ps = j->ps;
    v16 acc[NR][SLAB];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < ns; v++) acc[r][v] = (v16){0};
    const float *w[NR];
    for (int r = 0; r < NR; r++) w[r] = st + (int64_t)(r < nr ? r : 0) * n;
    for (int pi = p0; pi < p1; pi++) {
        const uint8_t *page = j->vc + ((int64_t)h * j->P + j->pages[pi]) * ps * Dp;
        const float *ps_s = vs + (int64_t)(pi - p0) * ps * vg, *ps_z = vz + (int64_t)(pi - p0) * ps * vg;
        for (int kgi = 0; kgi < ng; kgi++)
            for (int L = 0; L < G; L++) {
                const int t = (pi - p0) * ps + kgi * G + L, in_page = kgi * G + tok[L];
                const uint8_t *row = page + (int64_t)in_page * Dp;
                const float *sr = ps_s + (int64_t)in_page * vg, *zr = ps_z + (int64_t)in_page * vg;
#pragma GCC unroll 4
                for (int v = 0; v < ns; v++) {
                    /* d0 is a multiple of 16 * SLAB: where G divides that, the sub-block is a constant */
                    const int d = d0 + 16 * v, gr = d / G, sub = (16 * SLAB) % G ? d % G / 16 : 16 * v % G / 16;
                    const v16 x = MADD(unpack16(row + gr * nb, bits, G, sub), sr[gr], (v16){0} + zr[gr]);
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++) acc[r][v] = MADD(w[r][t], x, acc[r][v]);
                }
            }
    }
    for (int v = 0; v < ns; v++) {
        v16 a[NR];
        for (int r = 0; r < NR; r++) a[r] = acc[r][v];
        store_out(a, nr, d0 + 16 * v, chan, parts);
    }
}

/* Rows qr[0 .. nr-1] (nr <= NR: a decode's query heads) against quantized chunk c of KV head h, read
 * straight from the codes: tile()'s arithmetic on the values prep_quant would have widened. */
static ALWAYS void fused_quant(const job_t *j, int h, int c, const float *const *qr, int nr, scratch_t *sc,
                               part_t *const *parts, int bits, int G) {
    const int D = j->D, nb = G * bits / 8, ng = j->ps / G, Dp = D * bits / 8, vg = D / G, ps = j->ps;
    const int p0 = c * j->cp, p1 = p0 + j->cp < j->n_pages ? p0 + j->cp : j->n_pages;
    const int n = (p1 - p0) * ps;
    float qs[NR][MAXD], zt[NR], ks[MAXD], kz[MAXD];
    float *st = sc->st, *vs = sc->ks, *vz = sc->kz; /* value scales [n, vg] in token order */
    int tok[512], vis[NR];
    for (int L = 0; L < G; L++) tok[L] = lane_item(L, bits, G);
    for (int i = 0; i < D; i++) sc->chan[i] = i / G * G + lane_item(i % G, bits, G);
    for (int r = 0; r < NR; r++) vis[r] = n;
    for (int pi = p0; pi < p1; pi++) {
        const int64_t base = (int64_t)h * j->P + j->pages[pi];
        halves(j->vs + base * ps * vg, ps * vg, vs + (int64_t)(pi - p0) * ps * vg);
        halves(j->vm + base * ps * vg, ps * vg, vz + (int64_t)(pi - p0) * ps * vg);
        for (int kgi = 0; kgi < ng; kgi++) {
            const int t0 = (pi - p0) * ps + kgi * G;
            halves(j->ks + (base * ng + kgi) * D, D, ks);
            halves(j->km + (base * ng + kgi) * D, D, kz);
            group_terms(qr, nr, NR, D, ks, kz, qs, zt);
            const uint8_t *codes = j->kc + (base * ng + kgi) * D * nb;
            for (int v = 0; v < G / 16; v++) {
                v16 acc[NR];
                for (int r = 0; r < NR; r++) acc[r] = (v16){0} + zt[r];
                for (int ch = 0; ch < D; ch++) {
                    const v16 kv = unpack16(codes + (int64_t)ch * nb, bits, G, v);
                    for (int r = 0; r < NR; r++) acc[r] = MADD(qs[r][ch], kv, acc[r]);
                }
                for (int r = 0; r < NR; r++) *(v16 *)(st + (int64_t)r * n + t0 + 16 * v) = acc[r];
            }
        }
    }
    softmax_rows(st, n, vis, nr, parts);
    for (int d0 = 0; d0 < D; d0 += 16 * SLAB) {
        switch ((D - d0) / 16 < SLAB ? (D - d0) / 16 : SLAB) {
        case 1: value_slab(j, h, p0, p1, d0, 1, tok, st, n, nr, vs, vz, sc->chan, parts, bits, G); break;
#if SLAB > 1
        case 2: value_slab(j, h, p0, p1, d0, 2, tok, st, n, nr, vs, vz, sc->chan, parts, bits, G); break;
        case 3: value_slab(j, h, p0, p1, d0, 3, tok, st, n, nr, vs, vz, sc->chan, parts, bits, G); break;
        default: value_slab(j, h, p0, p1, d0, SLAB, tok, st, n, nr, vs, vz, sc->chan, parts, bits, G); break;
#endif
        }
    }
}

#define WIDE(B, GG)                                                                                      \
    static NOINLINE void wide_##B##_##GG(const job_t *j, int h, int c, scratch_t *sc, chunk_t *ck) {          \
        prep_wide(j, h, c, sc, ck, B, GG);                                                                 \
    }                                                                                                       \
    static NOINLINE void fused_##B##_##GG(const job_t *j, int h, int c, const float *const *qr, int nr,        \
                                          scratch_t *sc, part_t *const *parts) {                            \
        fused_quant(j, h, c, qr, nr, sc, parts, B, GG);                                                     \
    }
WIDE(4, 16) WIDE(4, 32) WIDE(4, 64) WIDE(2, 16) WIDE(2, 32) WIDE(2, 64)

/* fused_quant for this job's bits and group (4 or 2 bits). */
static void fused(const job_t *j, int h, int c, const float *const *qr, int nr, scratch_t *sc, part_t *const *parts) {
    switch (j->bits * 1000 + j->G) {
    case 4016: fused_4_16(j, h, c, qr, nr, sc, parts); return;
    case 4032: fused_4_32(j, h, c, qr, nr, sc, parts); return;
    case 4064: fused_4_64(j, h, c, qr, nr, sc, parts); return;
    case 2016: fused_2_16(j, h, c, qr, nr, sc, parts); return;
    case 2032: fused_2_32(j, h, c, qr, nr, sc, parts); return;
    case 2064: fused_2_64(j, h, c, qr, nr, sc, parts); return;
    default: fused_quant(j, h, c, qr, nr, sc, parts, j->bits, j->G); return;
    }
}

/* prep_wide for this job's bits and group (4 or 2 bits). */
static void wide(const job_t *j, int h, int c, scratch_t *sc, chunk_t *ck) {
    switch (j->bits * 1000 + j->G) {
    case 4016: wide_4_16(j, h, c, sc, ck); return;
    case 4032: wide_4_32(j, h, c, sc, ck); return;
    case 4064: wide_4_64(j, h, c, sc, ck); return;
    case 2016: wide_2_16(j, h, c, sc, ck); return;
    case 2032: wide_2_32(j, h, c, sc, ck); return;
    case 2064: wide_2_64(j, h, c, sc, ck); return;
    default: prep_wide(j, h, c, sc, ck, j->bits, j->G); return;
    }
}

/* Quantized chunk c of KV head h rearranged for the integer products: token t of the chunk is key
 * group t / G's lane t % G (unpack16's order), its value row the page's token kgi * G + tok[L]; bits
 * and G constants where inlined. */
static ALWAYS void prep_int(const job_t *j, int h, int c, scratch_t *sc, ichunk_t *ck, int bits, int G) {
    const int D = j->D, nb = G * bits / 8, ng = j->ps / G, Dp = D * bits / 8, vg = D / G, ps = j->ps;
    const int p0 = c * j->cp, p1 = p0 + j->cp < j->n_pages ? p0 + j->cp : j->n_pages;
    /* codes read in place (fast) where few rows take them; many rows (a prefill's) widen them once */
    const int n = (p1 - p0) * ps, fast = FAST512 && G == 32 && D % 64 == 0 && j->T * j->g <= SPLIT_ROWS;
    const int mid = 1 << (bits - 1);
    uint32_t *KI = (uint32_t *)sc->KT, *VI = (uint32_t *)sc->V;
    const uint8_t **vr = (const uint8_t **)sc->KT, **kg = vr + n; /* fast: pointers instead of copies */
    float *vs = sc->V + (int64_t)n * D / 2, *vz = vs + (int64_t)n * vg;
    int tok[512];
    for (int L = 0; L < G; L++) tok[L] = lane_item(L, bits, G);
    for (int i = 0; i < D; i++) sc->chan[i] = i / G * G + lane_item(i % G, bits, G);
    for (int pi = p0; pi < p1; pi++) {
        const int64_t base = (int64_t)h * j->P + j->pages[pi];
        for (int kgi = 0; kgi < ng; kgi++) {
            const int t0 = (pi - p0) * ps + kgi * G, gi = t0 / G;
            const uint8_t *codes = j->kc + (base * ng + kgi) * D * nb;
            float *ks = sc->ks + (int64_t)gi * D, *kz = sc->kz + (int64_t)gi * D;
            halves(j->ks + (base * ng + kgi) * D, D, ks);
            halves(j->km + (base * ng + kgi) * D, D, kz);
            for (int ch = 0; ch < D; ch++) /* the minimum moved to the middle code */
                kz[ch] = MADDF((float)mid, ks[ch], kz[ch]);
            float s[MAXD], z[MAXD]; /* the group's value scales and minimums in page order (G * vg = D) */
            halves(j->vs + (base * ps + kgi * G) * vg, G * vg, s);
            halves(j->vm + (base * ps + kgi * G) * vg, G * vg, z);
#if FAST512
            if (fast) { /* the codes stay where they are */
                value_scales512(s, z, tok, vg, n, (float)mid, vs + t0, vz + t0);
                kg[gi] = codes;
                for (int L = 0; L < G; L++) vr[t0 + L] = j->vc + (base * ps + kgi * G + tok[L]) * Dp;
                continue;
            }
#endif
            for (int L = 0; L < G; L++)
                for (int gr = 0; gr < vg; gr++) {
                    const int64_t at = (int64_t)gr * n + t0 + L;
                    vs[at] = s[tok[L] * vg + gr];
                    vz[at] = MADDF((float)mid, s[tok[L] * vg + gr], z[tok[L] * vg + gr]);
                }
            for (int cp = 0; cp < D / 2; cp++) {
                const uint8_t *k = codes + (int64_t)2 * cp * nb;
                for (int v = 0; v < G / 16; v++)
                    pair16(codes16(k, bits, G, v), codes16(k + nb, bits, G, v), mid,
                           KI + ((int64_t)gi * (D / 2) + cp) * G + 16 * v);
            }
            for (int L = 0; L < G; L += 2) {
                const uint8_t *r0 = j->vc + (base * ps + kgi * G + tok[L]) * Dp;
                const uint8_t *r1 = j->vc + (base * ps + kgi * G + tok[L + 1]) * Dp;
                uint32_t *dst = VI + (int64_t)(t0 + L) / 2 * D;
                for (int gr = 0; gr < vg; gr++)
                    for (int v = 0; v < G / 16; v++)
                        pair16(codes16(r0 + gr * nb, bits, G, v), codes16(r1 + gr * nb, bits, G, v), mid,
                               dst + gr * G + 16 * v);
            }
        }
    }
    uint32_t *wd = (uint32_t *)(vz + (int64_t)n * vg);
    const int ws = (n > CH ? n : CH) / 2;
    *ck = (ichunk_t){n, G, bits, fast, KI, VI, kg, vr, sc->ks, sc->kz, vs, vz, wd, ws,
                     (float *)(wd + (int64_t)NM * vg * ws), sc->chan};
}

#define PREP(B, GG)                                                                                      \
    static NOINLINE void prep_##B##_##GG(const job_t *j, int h, int c, scratch_t *sc, ichunk_t *ck) {         \
        prep_int(j, h, c, sc, ck, B, GG);                                                                   \
    }
PREP(8, 16) PREP(8, 32) PREP(8, 64) PREP(4, 16) PREP(4, 32) PREP(4, 64) PREP(2, 16) PREP(2, 32) PREP(2, 64)

/* prep_int for this job's bits and group. */
static void prep_quant(const job_t *j, int h, int c, scratch_t *sc, ichunk_t *ck) {
    switch (j->bits * 1000 + j->G) {
    case 8016: prep_8_16(j, h, c, sc, ck); return;
    case 8032: prep_8_32(j, h, c, sc, ck); return;
    case 8064: prep_8_64(j, h, c, sc, ck); return;
    case 4016: prep_4_16(j, h, c, sc, ck); return;
    case 4032: prep_4_32(j, h, c, sc, ck); return;
    case 4064: prep_4_64(j, h, c, sc, ck); return;
    case 2016: prep_2_16(j, h, c, sc, ck); return;
    case 2032: prep_2_32(j, h, c, sc, ck); return;
    case 2064: prep_2_64(j, h, c, sc, ck); return;
    default: prep_int(j, h, c, sc, ck, j->bits, j->G); return;
    }
}

/* Chunk c (c >= nq) of KV head h: the fp32 rest, or 16-bit pages. */
static void prepare(const job_t *j, int h, int c, scratch_t *sc, chunk_t *ck) {
    const int D = j->D;
    const int r0 = (c - j->nq) * CH, cnt = j->n_rest - r0 < CH ? j->n_rest - r0 : CH, n = (cnt + 15) / 16 * 16;
    const float *V = j->tv + ((int64_t)h * j->n_rest + r0) * D;
    const float *kf[CH];      /* the rest: each token's key row */
    const uint16_t *kh[CH], *vh[CH]; /* 16-bit pages: each token's key and value rows */
    for (int t = 0; t < cnt; t++) {
        if (j->hk) {
            const int64_t row = (int64_t)h * j->S + (j->slots ? j->slots[r0 + t] : j->first_slot + r0 + t);
            kh[t] = j->hk + row * D;
            vh[t] = j->hv + row * D;
        } else {
            kf[t] = j->tk + ((int64_t)h * j->n_rest + r0 + t) * D;
        }
    }
    if (j->hk) V = sc->V; /* value rows widened into the scratch below */
    for (int t0 = 0; t0 < n; t0 += 16) { /* keys transposed sixteen at a time (past cnt: zeros) */
        for (int d = 0; d < D; d += 16) {
            v16 m[16];
            for (int i = 0; i < 16; i++) {
                const int t = t0 + i;
                m[i] = t >= cnt ? (v16){0} : j->hk ? wide16(kh[t] + d, j->bf16) : *(const v16 *)(kf[t] + d);
            }
            transpose16(m);
            for (int i = 0; i < 16; i++) *(v16 *)(sc->KT + (int64_t)(d + i) * n + t0) = m[i];
        }
        if (j->hk)
            for (int t = t0; t < t0 + 16 && t < cnt; t++)
                for (int d = 0; d < D; d += 16) *(v16 *)(sc->V + (int64_t)t * D + d) = wide16(vh[t] + d, j->bf16);
    }
    *ck = (chunk_t){n, n, sc->KT, NULL, NULL, V, NULL};
}

/* Rows qr[0 .. nr-1] (nr <= NR: a decode's query heads) against chunk c (c >= nq) of 16-bit pages,
 * read in place: tile()'s arithmetic on the values prepare() would have widened into the scratch
 * (each sixteen tokens' keys transposed in registers, their scores taken at once; value rows
 * widened as the weights take them), so the chunk never goes through the scratch. bf16 constant
 * where inlined. */
static ALWAYS void half_rows(const job_t *j, int h, int c, const float *const *qr, int nr, const int *vis,
                             float *st, part_t *const *parts, int bf16) {
    const int D = j->D;
    const int r0 = (c - j->nq) * CH, cnt = j->n_rest - r0 < CH ? j->n_rest - r0 : CH, n = (cnt + 15) / 16 * 16;
    const uint16_t *kh[CH], *vh[CH];
    for (int t = 0; t < cnt; t++) {
        const int64_t row = (int64_t)h * j->S + (j->slots ? j->slots[r0 + t] : j->first_slot + r0 + t);
        kh[t] = j->hk + row * D;
        vh[t] = j->hv + row * D;
    }
    float qs[NR][MAXD], zt[NR];
    group_terms(qr, nr, NR, D, NULL, NULL, qs, zt);
    { /* the next chunk's rows asked for now, to be near when its turn comes (1 thread: 10.4 -> 9.2-9.7
       * ms a layer at 32k tokens) */
        const int r1 = r0 + CH, cnt1 = j->n_rest - r1 < CH ? j->n_rest - r1 : CH;
        for (int t = 0; t < cnt1; t++) {
            const int64_t row = (int64_t)h * j->S + (j->slots ? j->slots[r1 + t] : j->first_slot + r1 + t);
            for (int b = 0; b < D * 2; b += 64) {
                __builtin_prefetch((const char *)(j->hk + row * D) + b, 0, 2);
                __builtin_prefetch((const char *)(j->hv + row * D) + b, 0, 2);
            }
        }
    }
    for (int t0 = 0; t0 < n; t0 += 16) {
        v16 a[NR];
        for (int r = 0; r < NR; r++) a[r] = (v16){0} + zt[r];
        for (int d = 0; d < D; d += 16) {
            v16 m[16];
            for (int i = 0; i < 16; i++) m[i] = t0 + i < cnt ? wide16(kh[t0 + i] + d, bf16) : (v16){0};
            transpose16(m);
            for (int i = 0; i < 16; i++)
                for (int r = 0; r < NR; r++) a[r] = MADD(qs[r][d + i], m[i], a[r]);
        }
        for (int r = 0; r < NR; r++) *(v16 *)(st + (int64_t)r * n + t0) = a[r];
    }
    const int top = softmax_rows(st, n, vis, nr, parts);
    for (int d0 = 0; d0 < D; d0 += 16 * SLAB) {
        const int ns = (D - d0) / 16 < SLAB ? (D - d0) / 16 : SLAB;
        v16 acc[NR][SLAB];
        for (int r = 0; r < NR; r++)
            for (int v = 0; v < SLAB; v++) acc[r][v] = (v16){0};
        for (int t = 0; t < top; t++)
            for (int v = 0; v < ns; v++) {
                const v16 x = wide16(vh[t] + d0 + 16 * v, bf16);
                for (int r = 0; r < NR; r++) acc[r][v] = MADD(st[(int64_t)(r < nr ? r : 0) * n + t], x, acc[r][v]);
            }
        for (int v = 0; v < ns; v++) {
            v16 o[NR];
            for (int r = 0; r < NR; r++) o[r] = acc[r][v];
            store_out(o, nr, d0 + 16 * v, NULL, parts);
        }
    }
}

static NOINLINE void half_rows_f16(const job_t *j, int h, int c, const float *const *qr, int nr, const int *vis,
                                   float *st, part_t *const *parts) {
    half_rows(j, h, c, qr, nr, vis, st, parts, 0);
}

static NOINLINE void half_rows_bf16(const job_t *j, int h, int c, const float *const *qr, int nr, const int *vis,
                                    float *st, part_t *const *parts) {
    half_rows(j, h, c, qr, nr, vis, st, parts, 1);
}

/* Row r's query (new token r / g, query head h * g + r % g), turned for the quantized chunks. */
static const float *row_q(const job_t *j, int h, int c, int r) {
    const float *q = c < j->nq && j->rotate ? j->qrot : j->q;
    return q + (((int64_t)(r / j->g) * j->hkv + h) * j->g + r % j->g) * j->D;
}

/* Rows a .. b-1 of KV head h (row r: new token r / g, query head h * g + r % g) against chunk c,
 * made ready in the scratch first; row r's partial goes to parts[r - a]. */
static void run_rows(const job_t *j, int h, int c, scratch_t *sc, int a, int b, part_t *const *parts) {
    chunk_t ck;
    ichunk_t ik;
    const int integer = c < j->nq && j->bits >= KV_INT_MIN_BITS;
    if (integer)
        prep_quant(j, h, c, sc, &ik);
    else if (c < j->nq)
        wide(j, h, c, sc, &ck);
    else
        prepare(j, h, c, sc, &ck);
    const int step = b - a > NR && !(integer && ik.fast) ? NM : NR; /* rows a tile takes */
    for (int r0 = a; r0 < b; r0 += step) {
        const int nr = b - r0 < step ? b - r0 : step;
        const float *qr[NM];
        int vis[NM];
        for (int r = 0; r < nr; r++) {
            qr[r] = row_q(j, h, c, r0 + r);
            vis[r] = c < j->nq ? ck.n : j->n_rest - j->T + (r0 + r) / j->g + 1 - (c - j->nq) * CH;
        }
        if (integer)
            (step == NR ? tile_int : tile_int_many)(&ik, j->D, qr, nr, sc->st, parts + (r0 - a));
        else
            (step == NR ? tile : tile_many)(&ck, j->D, qr, vis, nr, sc->st, parts + (r0 - a));
    }
}

/* *mem grown to at least ``need`` floats (64-byte aligned), kept from call to call by its thread;
 * NULL without memory. */
static float *kept(float **mem, size_t *cap, size_t need) {
    if (*cap < need) {
        free(*mem);
        *mem = (float *)aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        *cap = *mem ? need : 0;
    }
    return *mem;
}

static __thread float *t_mem, *t_parts;
static __thread size_t t_cap, t_parts_cap;

/* The calling thread's scratch, grown to the job's size. */
static int scratch_get(const job_t *j, scratch_t *sc) {
    if (!kept(&t_mem, &t_cap, scratch_floats(j))) return 1;
    scratch_bind(j, t_mem, sc);
    return 0;
}

/* The state after the quantized chunks, turned back from the rotated space. */
static void unrotate(const job_t *j, part_t *S) {
    if (j->rotate && j->nq && S->m != -INFINITY) fwht(S->acc, j->D);
}

static void finish(const job_t *j, int h, int r, const part_t *S) {
    const int t = r / j->g, i = r % j->g;
    float *o = j->out + (((int64_t)t * j->hkv + h) * j->g + i) * j->D;
    const float inv = S->l > 0.f ? 1.f / S->l : 0.f; /* nothing visible: zeros */
    for (int d = 0; d < j->D; d++) o[d] = S->acc[d] * inv;
}

static part_t *part_at(float *base, int64_t index, int D) { return (part_t *)(base + index * PART_FLOATS(D)); }

/* Ask the memory for quantized chunk c of KV head h (its pages' key and value codes and scales)
 * into the second-level cache: a decode's threads take chunks in runs of 16, so the next one's
 * pages (scattered over the pool) arrive while this one is scored. Reads nothing; changes no bit.
 * (Runs rather than two fixed halves: a thread the host preempts keeps only its current run.) */
static void prefetch_chunk(const job_t *j, int h, int c) {
    const int D = j->D, ps = j->ps, ng = ps / j->G, vg = D / j->G;
    const int64_t codes = (int64_t)ps * D * j->bits / 8; /* a page's key codes, and its value codes */
    const int p0 = c * j->cp, p1 = p0 + j->cp < j->n_pages ? p0 + j->cp : j->n_pages;
    for (int pi = p0; pi < p1; pi++) {
        const int64_t base = (int64_t)h * j->P + j->pages[pi];
        const char *k = (const char *)(j->kc + base * codes), *v = (const char *)(j->vc + base * codes);
        for (int64_t b = 0; b < codes; b += 64) {
            __builtin_prefetch(k + b, 0, 2);
            __builtin_prefetch(v + b, 0, 2);
        }
        for (int64_t b = 0; b < (int64_t)ng * D * 2; b += 64) {
            __builtin_prefetch((const char *)(j->ks + base * ng * D) + b, 0, 2);
            __builtin_prefetch((const char *)(j->km + base * ng * D) + b, 0, 2);
        }
        for (int64_t b = 0; b < (int64_t)ps * vg * 2; b += 64) {
            __builtin_prefetch((const char *)(j->vs + base * ps * vg) + b, 0, 2);
            __builtin_prefetch((const char *)(j->vm + base * ps * vg) + b, 0, 2);
        }
    }
}

/* Few rows per KV head: items (h, chunk) store partials, then rows merge them in chunk order. The
 * partials' buffer is the calling thread's, kept from call to call (a decode layer's call at 32k
 * tokens stores a MiB of them: a fresh one faulted its pages in again every call). */
static int run_split(const job_t *j, int n_threads) {
    const int R = j->T * j->g, nc = j->nq + j->nr, D = j->D;
    float *parts = kept(&t_parts, &t_parts_cap, (size_t)j->hkv * nc * R * PART_FLOATS(D));
    if (!parts) return 2;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 16) num_threads(n_threads) reduction(| : bad)
    for (int item = 0; item < j->hkv * nc; item++) {
        scratch_t sc;
        if (scratch_get(j, &sc)) { bad = 1; continue; }
        const int h = item / nc, c = item % nc;
        if (c + 1 < j->nq) prefetch_chunk(j, h, c + 1);
        part_t *ps[SPLIT_ROWS];
        for (int r = 0; r < R; r++) ps[r] = part_at(parts, (int64_t)item * R + r, D);
        if (c < j->nq && j->bits < KV_INT_MIN_BITS && R <= NR) { /* a float decode: codes read in place */
            const float *qr[NR];
            for (int r = 0; r < R; r++) qr[r] = row_q(j, h, c, r);
            fused(j, h, c, qr, R, &sc, ps);
        } else if (c >= j->nq && j->hk && R <= NR) { /* a decode over 16-bit pages: read in place */
            const float *qr[NR];
            int vis[NR];
            for (int r = 0; r < R; r++) {
                qr[r] = row_q(j, h, c, r);
                vis[r] = j->n_rest - j->T + r / j->g + 1 - (c - j->nq) * CH;
            }
            (j->bf16 ? half_rows_bf16 : half_rows_f16)(j, h, c, qr, R, vis, sc.st, ps);
        } else {
            run_rows(j, h, c, &sc, 0, R, ps);
        }
    }
    if (!bad) {
#pragma omp parallel for num_threads(n_threads)
        for (int hr = 0; hr < j->hkv * R; hr++) {
            const int h = hr / R, r = hr % R;
            float mem[PART_FLOATS(MAXD)];
            part_t *S = (part_t *)mem;
            S->m = -INFINITY;
            S->l = 0.f;
            for (int c = 0; c < nc; c++) {
                if (c == j->nq) unrotate(j, S);
                merge(D, S, part_at(parts, ((int64_t)h * nc + c) * R + r, D));
            }
            if (nc == j->nq) unrotate(j, S);
            finish(j, h, r, S);
        }
    }
    return bad ? 2 : 0;
}

/* Many rows: items (h, block of RB rows) run every chunk in order, merging as they go. */
static int run_blocks(const job_t *j, int n_threads) {
    const int R = j->T * j->g, nb = (R + RB - 1) / RB, nc = j->nq + j->nr, D = j->D;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) reduction(| : bad)
    for (int item = 0; item < j->hkv * nb; item++) {
        scratch_t sc;
        if (scratch_get(j, &sc)) { bad = 1; continue; }
        const int h = item / nb, a = item % nb * RB, b = a + RB < R ? a + RB : R;
        float *mem = (float *)malloc(sizeof(float) * (size_t)2 * RB * PART_FLOATS(D));
        if (!mem) { bad = 1; continue; }
        part_t *S[RB], *p[RB];
        for (int r = 0; r < b - a; r++) {
            S[r] = part_at(mem, r, D);
            p[r] = part_at(mem, RB + r, D);
            S[r]->m = -INFINITY;
            S[r]->l = 0.f;
        }
        for (int c = 0; c < nc; c++) {
            if (c == j->nq)
                for (int r = 0; r < b - a; r++) unrotate(j, S[r]);
            run_rows(j, h, c, &sc, a, b, p);
            for (int r = 0; r < b - a; r++) merge(D, S[r], p[r]);
        }
        for (int r = 0; r < b - a; r++) {
            if (nc == j->nq) unrotate(j, S[r]);
            finish(j, h, a + r, S[r]);
        }
        free(mem);
    }
    return bad ? 2 : 0;
}

/* The job with its work spread one way: 0 the kernel's choice, 1 chunks over the threads (at most
 * SPLIT_ROWS rows a KV head), 2 blocks of rows (tests force each; the bits are the same). */
static int run_job(const job_t *j, int way, int n_threads) {
    if (way < 0 || way > 2 || (way == 1 && j->T * j->g > SPLIT_ROWS)) return 1;
    if (way == 0) way = j->T * j->g <= SPLIT_ROWS ? 1 : 2;
    return way == 1 ? run_split(j, n_threads) : run_blocks(j, n_threads);
}

/* The shapes the kernel takes: whole sixteen-lane blocks of codes (G and D multiples of 16, a
 * group's packed bytes a multiple or a divisor of 16), D at most MAXD. */
int kv_quant_fits(int D, int G, int bits, int ps) {
    const int nb = G * bits / 8;
    return (bits == 2 || bits == 4 || bits == 8) && D >= 16 && D <= MAXD && D % 16 == 0 && G >= 16 && G <= 512 &&
           G % 16 == 0 && D % G == 0 && ps % G == 0 && (nb % 16 == 0 || nb == 8 || nb == 4);
}

int kv_quant_attend(int hkv, int g, int D, int ps, int G, int bits, int T, const float *q, const int64_t *pages,
                    int n_pages, const uint8_t *kc, const uint16_t *ks, const uint16_t *km, const uint8_t *vc,
                    const uint16_t *vs, const uint16_t *vm, int64_t P, const float *tk, const float *tv, int n_rest,
                    int rotate, int way, float *out, int n_threads) {
    if (!kv_quant_fits(D, G, bits, ps) || hkv < 1 || g < 1 || T < 1 || n_pages < 0 || n_rest < T || P < 0)
        return 1;
    for (int i = 0; i < n_pages; i++) /* every page read lies in the pool */
        if (pages[i] < 0 || pages[i] >= P) return 3;
    const int cp = CH / ps > 0 ? CH / ps : 1;
    job_t j = {.hkv = hkv, .g = g, .D = D, .ps = ps, .G = G, .bits = bits, .T = T, .n_pages = n_pages,
               .n_rest = n_rest, .rotate = rotate != 0, .cp = cp, .nq = (n_pages + cp - 1) / cp,
               .nr = (n_rest + CH - 1) / CH, .P = P, .q = q, .tk = tk, .tv = tv, .pages = pages, .kc = kc,
               .vc = vc, .ks = ks, .km = km, .vs = vs, .vm = vm, .out = out};
    float *qrot = NULL;
    if (j.rotate && j.nq) {
        const int64_t rows = (int64_t)T * hkv * g;
        qrot = (float *)malloc(sizeof(float) * (size_t)(rows * D));
        if (!qrot) return 2;
        memcpy(qrot, q, sizeof(float) * (size_t)(rows * D));
        for (int64_t r = 0; r < rows; r++) fwht(qrot + r * D, D);
        j.qrot = qrot;
    }
    const int rc = run_job(&j, way, n_threads);
    free(qrot);
    return rc;
}

/* Causal attention of T new rows over 16-bit float pages (fp16, or bf16 when bf16 != 0) read in
 * place: kv [2, hkv, S, D]; position p of the sequence lies in slot slots[p] (or first_slot + p
 * when slots is NULL); L positions, the T new ones last. A job with no quantized part: the rest's
 * canonical order, 256-key chunks from position 0 (keys transposed sixteen at a time), merged in
 * order. */
int kv_half_attend(int hkv, int g, int D, int bf16, int T, const float *q, const uint16_t *kv, int64_t S,
                   const int64_t *slots, int64_t first_slot, int L, int way, float *out, int n_threads) {
    if (hkv < 1 || g < 1 || D < 16 || D > MAXD || D % 16 || T < 1 || L < T || S < 1) return 1;
    if (slots) {
        for (int i = 0; i < L; i++) /* every slot read lies in the pool */
            if (slots[i] < 0 || slots[i] >= S) return 3;
    } else if (first_slot < 0 || first_slot + L > S) {
        return 3;
    }
    const job_t j = {.hkv = hkv, .g = g, .D = D, .ps = CH, .T = T, .n_rest = L, .cp = 1, .nr = (L + CH - 1) / CH,
                     .q = q, .out = out, .hk = kv, .hv = kv + (int64_t)hkv * S * D, .slots = slots,
                     .first_slot = first_slot, .S = S, .bf16 = bf16 != 0};
    return run_job(&j, way, n_threads);
}
