/* Decode attention straight from a quantized KV cache (KIVI layout), no fp32 copy of the cache.
 *
 * One query row per query head (decode). For every KV head the pages are split into chunks that
 * run in parallel (OpenMP); each chunk scores its tokens (keys dequantized in registers: the
 * per-channel scale folded into the query, the minimum into one dot product per key group),
 * then accumulates softmax-weighted value rows; chunks merge by log-sum-exp. The fp32 tail (the
 * latest tokens, not yet quantized) is one more chunk.
 *
 * Layouts (P = pages in the pool, ps = page size, G = group, Dp = D * bits / 8):
 *   q    [hkv, g, D] float, already multiplied by the softmax scale
 *   kc   [hkv, P, ps / G, D, G * bits / 8] uint8 (channel-major)   ks, km [hkv, P, ps / G, D] half
 *   vc   [hkv, P, ps, Dp] uint8   vs, vm [hkv, P, ps, D / G] half
 * Scales and minimums are IEEE half floats (uint16_t bits), widened here one group at a time.
 *   tk, tv [hkv, n_tail, D] float     out [hkv, g, D] float
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXG 32
#define MAXD 512
#define MAXGROUP 512

/* IEEE binary16 bits -> float, exactly (normals, subnormals, zeros, infinities, NaN). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline void unpack_row(const uint8_t *src, int D, int bits, float *dst) {
    if (bits == 8) {
        for (int c = 0; c < D; c++) dst[c] = (float)src[c];
    } else if (bits == 4) {
        for (int c = 0; c < D / 2; c++) {
            dst[2 * c] = (float)(src[c] & 15);
            dst[2 * c + 1] = (float)(src[c] >> 4);
        }
    } else {
        for (int c = 0; c < D / 4; c++) {
            uint8_t b = src[c];
            dst[4 * c] = (float)(b & 3);
            dst[4 * c + 1] = (float)((b >> 2) & 3);
            dst[4 * c + 2] = (float)((b >> 4) & 3);
            dst[4 * c + 3] = (float)(b >> 6);
        }
    }
}

typedef struct {
    float m[MAXG], l[MAXG];
    float acc[MAXG * MAXD];
} part_t;

static void run_pages(int h, int g, int D, int ps, int G, int bits, const float *q, const int64_t *pages,
                      int p0, int p1, const uint8_t *kc, const uint16_t *ks, const uint16_t *km, const uint8_t *vc,
                      const uint16_t *vs, const uint16_t *vm, int64_t P, part_t *out) {
    const int Dp = D * bits / 8, Gp = G * bits / 8, ng = ps / G, vg = D / G;
    const int n_tok = (p1 - p0) * ps;
    float *scores = (float *)malloc(sizeof(float) * (size_t)g * (n_tok > 0 ? n_tok : 1));
    float qs[MAXG * MAXD], zt[MAXG], row[MAXD], s[MAXD], z[MAXD];
    for (int i = 0; i < g; i++) { out->m[i] = -INFINITY; out->l[i] = 0.f; }
    memset(out->acc, 0, sizeof(float) * (size_t)g * D);
    int t = 0;
    for (int pi = p0; pi < p1; pi++) {
        const int64_t page = pages[pi];
        for (int kg = 0; kg < ng; kg++) {
            const uint16_t *s16 = ks + (((int64_t)h * P + page) * ng + kg) * D;
            const uint16_t *z16 = km + (((int64_t)h * P + page) * ng + kg) * D;
            for (int c = 0; c < D; c++) { s[c] = half_to_float(s16[c]); z[c] = half_to_float(z16[c]); }
            for (int i = 0; i < g; i++) {
                float acc = 0.f;
                for (int c = 0; c < D; c++) {
                    qs[i * D + c] = q[i * D + c] * s[c];
                    acc += q[i * D + c] * z[c];
                }
                zt[i] = acc;
            }
            /* scores of the group's G tokens, a channel at a time: no horizontal sums */
            const uint8_t *codes = kc + (((int64_t)h * P + page) * ng + kg) * D * Gp;
            float acc[MAXG * MAXGROUP];
            for (int i = 0; i < g; i++)
                for (int r = 0; r < G; r++) acc[i * G + r] = zt[i];
            for (int c = 0; c < D; c++) {
                unpack_row(codes + (int64_t)c * Gp, G, bits, row);
                for (int i = 0; i < g; i++) {
                    const float w = qs[i * D + c];
                    float *a = acc + i * G;
                    for (int r = 0; r < G; r++) a[r] += w * row[r];
                }
            }
            for (int i = 0; i < g; i++) memcpy(scores + (int64_t)i * n_tok + t, acc + i * G, sizeof(float) * G);
            t += G;
        }
    }
    for (int i = 0; i < g; i++) {
        float *sc = scores + (int64_t)i * n_tok;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int k = 0; k < n_tok; k++) m = fmaxf(m, sc[k]);
        float l = 0.f;
#pragma omp simd reduction(+ : l)
        for (int k = 0; k < n_tok; k++) { sc[k] = expf(sc[k] - m); l += sc[k]; }
        out->m[i] = m;
        out->l[i] = l;
    }
    t = 0;
    for (int pi = p0; pi < p1; pi++) {
        const int64_t page = pages[pi];
        for (int r = 0; r < ps; r++, t++) {
            const int64_t tok = ((int64_t)h * P + page) * ps + r;
            unpack_row(vc + tok * Dp, D, bits, row);
            const uint16_t *vs16 = vs + tok * vg, *vm16 = vm + tok * vg;
            for (int gr = 0; gr < vg; gr++) {
                const float sg = half_to_float(vs16[gr]), zg = half_to_float(vm16[gr]);
                float *rg = row + gr * G;
                for (int c = 0; c < G; c++) rg[c] = rg[c] * sg + zg;
            }
            for (int i = 0; i < g; i++) {
                const float w = scores[i * n_tok + t];
                float *a = out->acc + i * D;
                for (int c = 0; c < D; c++) a[c] += w * row[c];
            }
        }
    }
    free(scores);
}

static void run_tail(int h, int g, int D, const float *q, const float *tk, const float *tv, int n_tail, part_t *out) {
    for (int i = 0; i < g; i++) { out->m[i] = -INFINITY; out->l[i] = 0.f; }
    memset(out->acc, 0, sizeof(float) * (size_t)g * D);
    float *scores = (float *)malloc(sizeof(float) * (size_t)g * (n_tail > 0 ? n_tail : 1));
    for (int i = 0; i < g; i++) {
        float m = -INFINITY;
        for (int k = 0; k < n_tail; k++) {
            const float *kr = tk + ((int64_t)h * n_tail + k) * D;
            float acc = 0.f;
            for (int c = 0; c < D; c++) acc += q[i * D + c] * kr[c];
            scores[i * n_tail + k] = acc;
            m = acc > m ? acc : m;
        }
        float l = 0.f;
        for (int k = 0; k < n_tail; k++) { float w = expf(scores[i * n_tail + k] - m); scores[i * n_tail + k] = w; l += w; }
        out->m[i] = m;
        out->l[i] = l;
        float *a = out->acc + i * D;
        for (int k = 0; k < n_tail; k++) {
            const float *vr = tv + ((int64_t)h * n_tail + k) * D;
            const float w = scores[i * n_tail + k];
            for (int c = 0; c < D; c++) a[c] += w * vr[c];
        }
    }
    free(scores);
}

int kv_quant_decode(int hkv, int g, int D, int ps, int G, int bits, const float *q, const int64_t *pages,
                    int n_pages, const uint8_t *kc, const uint16_t *ks, const uint16_t *km, const uint8_t *vc,
                    const uint16_t *vs, const uint16_t *vm, int64_t P, const float *tk, const float *tv, int n_tail,
                    float *out, int n_threads) {
    if (g < 1 || g > MAXG || D < 1 || D > MAXD || G < 1 || G > MAXGROUP || ps % G || D % G || (D * bits) % 8 ||
        (G * bits) % 8 || n_pages < 0 || n_tail < 0 || hkv < 1 || (bits != 2 && bits != 4 && bits != 8))
        return 1;
    for (int i = 0; i < n_pages; i++) /* every page read lies in the pool */
        if (pages[i] < 0 || pages[i] >= P) return 3;
    int chunks = n_threads * 2;
    if (chunks > n_pages) chunks = n_pages > 0 ? n_pages : 1;
    const int per_head = chunks + 1;  /* the tail is the last part */
    part_t *parts = (part_t *)malloc(sizeof(part_t) * (size_t)hkv * per_head);
    if (!parts) return 2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int item = 0; item < hkv * per_head; item++) {
        const int h = item / per_head, c = item % per_head;
        const float *qh = q + (int64_t)h * g * D;
        if (c == chunks) {
            run_tail(h, g, D, qh, tk, tv, n_tail, &parts[item]);
        } else {
            const int p0 = (int)((int64_t)n_pages * c / chunks), p1 = (int)((int64_t)n_pages * (c + 1) / chunks);
            run_pages(h, g, D, ps, G, bits, qh, pages, p0, p1, kc, ks, km, vc, vs, vm, P, &parts[item]);
        }
    }
    for (int h = 0; h < hkv; h++) {
        for (int i = 0; i < g; i++) {
            float M = -INFINITY;
            for (int c = 0; c < per_head; c++) M = parts[h * per_head + c].m[i] > M ? parts[h * per_head + c].m[i] : M;
            float L = 0.f;
            float *o = out + ((int64_t)h * g + i) * D;
            memset(o, 0, sizeof(float) * D);
            for (int c = 0; c < per_head; c++) {
                const part_t *pt = &parts[h * per_head + c];
                if (pt->l[i] == 0.f) continue;
                const float f = expf(pt->m[i] - M);
                L += pt->l[i] * f;
                for (int d = 0; d < D; d++) o[d] += pt->acc[i * D + d] * f;
            }
            const float inv = L > 0.f ? 1.f / L : 0.f; /* nothing visible: zeros */
            for (int d = 0; d < D; d++) o[d] *= inv;
        }
    }
    free(parts);
    return 0;
}
