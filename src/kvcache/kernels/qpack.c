/* GGUF quantized blocks -> kvcache's repacked formats (qformat.h), and back to fp32.
 *
 * kv_q_repack decodes rows of a GGUF tensor (its own block type) into integer values with a scale
 * and a minimum per sub-block, exactly: value = d * q + m, the same numbers the file stands for,
 * and stores them into the rows ``dst_rows`` of a repacked weight. A GGUF type may go into any
 * format that holds its values: Q4_0 into Q4O_F16 (its minimum -8 d implied, not stored), or
 * beside other 4-bit parts Q4_F16 or Q4_F32; Q8_0 into S8_F16 or S8_F32_16; and so on. kv_q_dequant turns repacked rows back into fp32 (tied embeddings read
 * the rows they need; the tests use it as the reference).
 *
 * GGUF types (ggml ids): Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11, Q4_K 12,
 * Q5_K 13, Q6_K 14, MXFP4 39 (into MX4_F16 only: its codes kept, its scale byte e as the fp16
 * 2^(e - 128)). Not hot: plain C, one variant for every CPU.
 */
#include "qformat.h"

#include <math.h>
#include <stdlib.h>

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static float h2f(const uint8_t *p) { return kvq_h2f(rd16(p)); }

/* float -> IEEE half, round to nearest even (exact for every value a half can hold). */
static uint16_t f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* overflow */
    if (ax < 0x38800000) { /* subnormal half (or zero) */
        if (ax < 0x33000000) return (uint16_t)sign;
        uint32_t man = (ax & 0x7fffff) | 0x800000, shift = 113 - (ax >> 23) + 13;
        uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((ax >> 23) - 112) << 10 | ((ax >> 13) & 0x3ff), rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

/* Block geometry of a GGUF type: values per block, bytes per block; 0 when not supported. */
static int geometry(int gtype, int *bytes) {
    switch (gtype) {
    case 2: *bytes = 18; return 32;
    case 3: *bytes = 20; return 32;
    case 6: *bytes = 22; return 32;
    case 7: *bytes = 24; return 32;
    case 8: *bytes = 34; return 32;
    case 10: *bytes = 84; return 256;
    case 11: *bytes = 110; return 256;
    case 12: *bytes = 144; return 256;
    case 13: *bytes = 176; return 256;
    case 14: *bytes = 210; return 256;
    case 39: *bytes = 17; return 32;
    default: *bytes = 0; return 0;
    }
}

static void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* The exponents e of an MXFP4 scale byte whose 2^(e - 128) an fp16 holds exactly (subnormals
 * included); a block of another e is taken only when all its codes are zeros. */
#define MX4_EMIN 104
#define MX4_EMAX 143

/* One block of a GGUF row -> q[bs] (signed values as int; MXFP4: its codes), per sub-block d and m
 * (sub = 32 or 16). */
static void decode_block(int gtype, const uint8_t *b, int *q, float *d, float *m, int *sub) {
    switch (gtype) {
    case 39: { /* MXFP4: e, qs[16] (element j the low nibble of byte j, j + 16 its high one) */
        const int e = b[0] < MX4_EMIN ? MX4_EMIN : b[0] > MX4_EMAX ? MX4_EMAX : b[0];
        d[0] = ldexpf(1.f, e - 128);
        m[0] = 0.f;
        for (int j = 0; j < 16; j++) {
            q[j] = b[1 + j] & 15;
            q[j + 16] = b[1 + j] >> 4;
        }
        *sub = 32;
        return;
    }
    case 2: case 3: { /* Q4_0: d, qs[16]; Q4_1: d, m, qs[16] */
        const uint8_t *qs = b + (gtype == 2 ? 2 : 4);
        d[0] = h2f(b);
        m[0] = gtype == 2 ? -8.f * d[0] : h2f(b + 2);
        for (int j = 0; j < 16; j++) {
            q[j] = qs[j] & 15;
            q[j + 16] = qs[j] >> 4;
        }
        *sub = 32;
        return;
    }
    case 6: case 7: { /* Q5_0: d, qh[4], qs[16]; Q5_1: d, m, qh[4], qs[16] */
        const uint8_t *qh = b + (gtype == 6 ? 2 : 4), *qs = qh + 4;
        uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        d[0] = h2f(b);
        m[0] = gtype == 6 ? -16.f * d[0] : h2f(b + 2);
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 15) | ((h >> j) & 1) << 4;
            q[j + 16] = (qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4;
        }
        *sub = 32;
        return;
    }
    case 8: /* Q8_0: d, qs[32] int8 */
        d[0] = h2f(b);
        m[0] = 0.f;
        for (int j = 0; j < 32; j++) q[j] = (int8_t)b[2 + j];
        *sub = 32;
        return;
    case 10: { /* Q2_K: scales[16], qs[64], d, dmin */
        const uint8_t *sc = b, *qs = b + 16;
        float dd = h2f(b + 80), dmin = h2f(b + 82);
        for (int j = 0; j < 16; j++) {
            d[j] = dd * (float)(sc[j] & 0xF);
            m[j] = -(dmin * (float)(sc[j] >> 4));
        }
        for (int e = 0; e < 256; e++) q[e] = (qs[32 * (e >> 7) + (e & 31)] >> (2 * ((e >> 5) & 3))) & 3;
        *sub = 16;
        return;
    }
    case 11: { /* Q3_K: hmask[32], qs[64], scales[12], d */
        const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
        float dd = h2f(b + 108);
        for (int j = 0; j < 16; j++) {
            int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4, hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
            d[j] = dd * (float)((lo | hi << 4) - 32);
            m[j] = 0.f;
        }
        for (int e = 0; e < 256; e++) {
            int ql = (qs[32 * (e >> 7) + (e & 31)] >> (2 * ((e >> 5) & 3))) & 3;
            int qh = (hm[e & 31] >> (e >> 5)) & 1;
            q[e] = ql - ((qh ^ 1) << 2);
        }
        *sub = 16;
        return;
    }
    case 12: case 13: { /* Q4_K: d, dmin, scales[12], qs[128]; Q5_K: ... qh[32] before qs */
        const uint8_t *s = b + 4, *qh = b + 16, *qs = b + (gtype == 12 ? 16 : 48);
        float dd = h2f(b), dmin = h2f(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k_scale_min(s, j, &sc, &mn);
            d[j] = dd * (float)sc;
            m[j] = -(dmin * (float)mn);
        }
        for (int e = 0; e < 256; e++) {
            int v = (qs[32 * (e >> 6) + (e & 31)] >> (4 * ((e >> 5) & 1))) & 15;
            if (gtype == 13) v |= ((qh[e & 31] >> (e >> 5)) & 1) << 4;
            q[e] = v;
        }
        *sub = 32;
        return;
    }
    case 14: { /* Q6_K: ql[128], qh[64], scales[16] int8, d */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float dd = h2f(b + 208);
        for (int j = 0; j < 16; j++) {
            d[j] = dd * (float)sc[j];
            m[j] = 0.f;
        }
        for (int e = 0; e < 256; e++) {
            int lo = (ql[64 * (e >> 7) + (e & 63)] >> (4 * ((e >> 6) & 1))) & 15;
            int hi = (qh[32 * (e >> 7) + (e & 31)] >> (2 * ((e >> 5) & 3))) & 3;
            q[e] = (lo | hi << 4) - 32;
        }
        *sub = 16;
        return;
    }
    }
}

static int holds(int gtype, int fmt) {
    if (KVQ_LUT[fmt] || gtype == 39) return KVQ_LUT[fmt] && gtype == 39; /* MXFP4's codes: its own format */
    if (KVQ_KS[fmt] == 3) return gtype == 10;
    if (KVQ_KS[fmt] == 2) return gtype == 14 || gtype == 11; /* the file's own scales (Q3_K's as Q6_K's) */
    if (KVQ_KS[fmt]) return gtype == 12 || (KVQ_HIGH[fmt] && gtype == 13);
    int nib = gtype == 2 || gtype == 3 || gtype == 12, sgn = gtype == 8 || gtype == 11 || gtype == 14;
    int five = gtype == 6 || gtype == 7 || gtype == 13;
    if (KVQ_HIGH[fmt]) nib = nib || five; /* 5-bit formats hold 4- and 5-bit types */
    int ns16 = gtype == 10 || gtype == 11 || gtype == 14, f16 = gtype == 2 || gtype == 3 || gtype == 6 || gtype == 7 || gtype == 8;
    if (KVQ_SIGNED[fmt] != sgn) return 0;
    if (KVQ_OFFSET[fmt] == 8 && gtype != 2) return 0;  /* only Q4_0 has the implied minimum -8 d */
    if (KVQ_OFFSET[fmt] == 16 && gtype != 6) return 0; /* only Q5_0 has -16 d */
    if (KVQ_NIBBLES[fmt] && !nib) return 0;
    if (KVQ_F16[fmt] && !f16) return 0;
    if (ns16 && KVQ_NS[fmt] != 2) return 0;
    return 1; /* unsigned bytes formats hold every unsigned type (values < 32) */
}

static void put_scale(int fmt, void *arr, int64_t idx, float v) {
    if (KVQ_F16[fmt]) ((uint16_t *)arr)[idx] = f2h(v);
    else ((float *)arr)[idx] = v;
}

/* Rows of GGUF type ``gtype`` (each ``src_stride`` bytes apart, K values) -> rows dst_rows[r] of
 * a repacked weight with ``out`` rows. Returns 0, or 1 for bad arguments, 2 when ``fmt`` cannot hold
 * ``gtype``'s values, 3 when a value is outside the format's range. */
int kv_q_repack(int gtype, int fmt, int rows, int K, const uint8_t *src, int64_t src_stride,
                const int64_t *dst_rows, int out, uint8_t *qs, void *d, void *m) {
    int bbytes, bs = geometry(gtype, &bbytes);
    if (fmt < 0 || fmt >= KVQ_NFMT || rows < 0 || K < 32 || K % 32 || out < 1) return 1;
    if (!bs || K % bs) return 2;
    if (!holds(gtype, fmt)) return 2;
    const int nib = KVQ_NIBBLES[fmt], ns = KVQ_NS[fmt], qb = kvq_qbytes(fmt), nb = K / 32;
    int q[256];
    float dd[16], mm[16];
    for (int r = 0; r < rows; r++) {
        const int64_t row = dst_rows[r];
        if (row < 0 || row >= out) return 1;
        const int64_t g = row / KVQ_NC;
        const int c = (int)(row % KVQ_NC);
        for (int blk = 0; blk < K / bs; blk++) {
            int sub = 32;
            const uint8_t *gb = src + r * src_stride + (int64_t)blk * bbytes;
            decode_block(gtype, gb, q, dd, mm, &sub);
            if (gtype == 39 && (gb[0] < MX4_EMIN || gb[0] > MX4_EMAX))
                for (int e = 0; e < 32; e++)
                    if (q[e] & 7) return 3; /* a scale no fp16 holds, on weights that are not zeros */
            for (int e = 0; e < bs; e++) {
                const int k = blk * bs + e, b = k >> 5, kk = k & 31;
                int v = q[e] + (KVQ_KS[fmt] == 2 ? KVQ_OFFSET[fmt] : 0); /* Q6_K decodes to q - 32, Q3_K to -4 .. 3 */
                const int vmax = nib ? (16 << KVQ_HIGH[fmt]) - 1 : 31;
                if (KVQ_SIGNED[fmt] ? (v < -128 || v > 127) : (v < 0 || v > vmax)) return 3;
                int high, pos = kvq_pos(nib, c, kk, &high);
                uint8_t *blk_q = qs + (g * nb + b) * qb, *dst = blk_q + pos;
                if (KVQ_HIGH[fmt] == 2) {
                    int sh, hp = kvq_six_pos(c, kk, &sh);
                    blk_q[hp] = (uint8_t)((blk_q[hp] & ~(3 << sh)) | ((v >> 4) & 3) << sh);
                    v &= 15;
                } else if (KVQ_HIGH[fmt]) {
                    int bit, hp = kvq_high_pos(c, kk, &bit);
                    blk_q[hp] = (uint8_t)((blk_q[hp] & ~(1 << bit)) | ((v >> 4) & 1) << bit);
                    v &= 15;
                }
                if (nib) *dst = (uint8_t)(high ? (*dst & 0x0F) | (v << 4) : (*dst & 0xF0) | v);
                else *dst = (uint8_t)(v & 0xFF);
            }
            if (KVQ_KS[fmt]) { /* the super-block's scales as the file holds them (qformat.h) */
                const uint8_t *sb = src + r * src_stride + (int64_t)blk * bbytes;
                uint8_t *dst_s = (uint8_t *)d + (g * (nb / 8) + blk) * kvq_ksb(KVQ_KS[fmt]);
                if (KVQ_KS[fmt] == 3) { /* Q2_K: scales[16] (scale | minimum << 4), d at 80, dmin at 82 */
                    for (int j = 0; j < 16; j++) {
                        dst_s[32 * (j >> 1) + 16 * (j & 1) + c] = sb[j] & 0xF;
                        dst_s[256 + 32 * (j >> 1) + 16 * (j & 1) + c] = sb[j] >> 4;
                    }
                    memcpy(dst_s + 512 + 2 * c, sb + 80, 2);
                    memcpy(dst_s + 544 + 2 * c, sb + 82, 2);
                    continue;
                }
                if (KVQ_KS[fmt] == 2 && gtype == 11) { /* Q3_K: six-bit scales less 32 at 96, d at 108 */
                    const uint8_t *s3 = sb + 96;
                    for (int j = 0; j < 16; j++) {
                        const int lo = j < 8 ? s3[j] & 0xF : s3[j - 8] >> 4, hi = (s3[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
                        dst_s[32 * (j >> 1) + 16 * (j & 1) + c] = (uint8_t)(int8_t)((lo | hi << 4) - 32);
                    }
                    memcpy(dst_s + 256 + 2 * c, sb + 108, 2);
                    continue;
                }
                if (KVQ_KS[fmt] == 2) { /* Q6_K: scales[16] int8 at 192, d at 208 */
                    for (int j = 0; j < 16; j++) dst_s[32 * (j >> 1) + 16 * (j & 1) + c] = sb[192 + j];
                    memcpy(dst_s + 256 + 2 * c, sb + 208, 2);
                    continue;
                }
                for (int j = 0; j < 8; j++) {
                    int sc, mn;
                    k_scale_min(sb + 4, j, &sc, &mn);
                    kvq_ks1_put(dst_s, j, c, sc, mn);
                }
                memcpy(dst_s + kvq_ks_d(1) + 2 * c, sb, 2);
                memcpy(dst_s + kvq_ks_dmin(1) + 2 * c, sb + 2, 2);
                continue;
            }
            /* scales: per sub-block of the format (32 or 16 values) */
            const int per = 32 / ns;
            for (int e = 0; e < bs; e += per) {
                const int k = blk * bs + e, b = k >> 5, h = (k & 31) / per;
                const int64_t idx = ((g * nb + b) * ns + h) * KVQ_NC + c;
                const int src_sub = e / sub;
                put_scale(fmt, d, idx, dd[src_sub]);
                if (!KVQ_SIGNED[fmt] && !KVQ_OFFSET[fmt]) put_scale(fmt, m, idx, mm[src_sub]);
            }
        }
    }
    return 0;
}

/* Output rows ``rows[i]`` (0 <= row < out) of a repacked weight as fp32 [n, K] (y rows ldy apart). */
int kv_q_dequant(int fmt, int K, int out, const uint8_t *qs, const void *d, const void *m, const int64_t *rows,
                 int n, float *y, int64_t ldy) {
    if (fmt < 0 || fmt >= KVQ_NFMT || K < 32 || K % 32 || ldy < K) return 1;
    const int nib = KVQ_NIBBLES[fmt], ns = KVQ_NS[fmt], qb = kvq_qbytes(fmt), nb = K / 32;
    for (int i = 0; i < n; i++) {
        const int64_t row = rows[i];
        if (row < 0 || row >= out) return 1;
        const int64_t g = row / KVQ_NC;
        const int c = (int)(row % KVQ_NC);
        for (int k = 0; k < K; k++) {
            const int b = k >> 5, kk = k & 31, h = kk / (32 / ns);
            const uint8_t *blk_q = qs + (g * nb + b) * qb;
            int high, pos = kvq_pos(nib, c, kk, &high);
            const uint8_t byte = blk_q[pos];
            int qv = nib ? (high ? byte >> 4 : byte & 15) : KVQ_SIGNED[fmt] ? (int8_t)byte : byte;
            if (KVQ_LUT[fmt]) qv = KVQ_MX4_U[qv];
            if (KVQ_HIGH[fmt] == 2) {
                int sh, hp = kvq_six_pos(c, kk, &sh);
                qv |= ((blk_q[hp] >> sh) & 3) << 4;
            } else if (KVQ_HIGH[fmt]) {
                int bit, hp = kvq_high_pos(c, kk, &bit);
                qv |= ((blk_q[hp] >> bit) & 1) << 4;
            }
            /* the scale and minimum of (c, k): weight = sd * (q - OFFSET) + sm */
            float sd, sm = 0.f;
            if (KVQ_KS[fmt]) {
                const int ks = KVQ_KS[fmt];
                const uint8_t *sb = (const uint8_t *)d + (g * (nb / 8) + (b >> 3)) * kvq_ksb(ks), *sj = sb + (b & 7) * 32;
                if (ks == 3) {
                    sd = kvq_h2f(rd16(sb + 512 + 2 * c)) * (float)sj[16 * h + c];
                    sm = -(kvq_h2f(rd16(sb + 544 + 2 * c)) * (float)sj[256 + 16 * h + c]);
                } else if (ks == 2) {
                    sd = kvq_h2f(rd16(sb + 256 + 2 * c)) * (float)(int8_t)sj[16 * h + c];
                } else {
                    sd = kvq_h2f(rd16(sb + kvq_ks_d(1) + 2 * c)) * (float)kvq_ks1_scale(sb, b & 7, c);
                    sm = -(kvq_h2f(rd16(sb + kvq_ks_dmin(1) + 2 * c)) * (float)kvq_ks1_min(sb, b & 7, c));
                }
            } else {
                const int64_t idx = ((g * nb + b) * ns + h) * KVQ_NC + c;
                sd = KVQ_F16[fmt] ? kvq_h2f(((const uint16_t *)d)[idx]) : ((const float *)d)[idx];
                if (m) sm = KVQ_F16[fmt] ? kvq_h2f(((const uint16_t *)m)[idx]) : ((const float *)m)[idx];
            }
            y[i * ldy + k] = sd * (float)(qv - KVQ_OFFSET[fmt]) + sm;
        }
    }
    return 0;
}
