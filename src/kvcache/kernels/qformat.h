/* kvcache's repacked quantized-weight formats, shared by qpack.c (repack from GGUF blocks,
 * dequantize) and qgemm.c (products).
 *
 * A weight [out, K] (an nn.Linear's orientation: out rows of K inputs, K a multiple of 32) is cut
 * into groups of 16 output rows ("columns" of the product) and blocks of 32 inputs. For group g and
 * block b the arrays hold the integer values in the layout of the int8 dot-product instructions
 * (one 32-bit lane per column, four consecutive inputs in it; step s covers inputs 4 s .. 4 s + 3):
 *   qs  bytes formats: 512 bytes, byte (s * 64 + c * 4 + t) = value (c, 4 s + t)   (s 0..7: step,
 *       c 0..15: row of the group, t 0..3);
 *       nibble formats: 256 bytes, byte (h * 64 + c * 4 + t) = value (c, 4 h + t) | value (c, 16 + 4 h + t) << 4
 *       (h 0..3; the low 4 bits of each value: the low nibbles are step h, the high ones step h + 4);
 *       5-bit formats add 64 bytes, the fifth bits: bit (c * 4 + t) of the little-endian 64-bit word s
 *       (bytes 256 + 8 s ..) = bit 4 of value (c, 4 s + t);
 *       6-bit formats add 128 bytes, bits 4 and 5: byte (256 + 64 q + c * 4 + t) holds them for steps
 *       4 q .. 4 q + 3 (q 0..1), step 4 q + k at bits 2 k and 2 k + 1
 *   d   NS x 16 scales (NS = 2 for 16-input sub-blocks, else 1), fp16 or fp32 by format
 *   m   NS x 16 minimums of unsigned formats (same dtype), absent for signed and offset ones
 * K-quant formats (Q4_KS, Q5_KS: GGUF's Q4_K and Q5_K at the file's density) keep the file's scales
 * instead, in as many bytes as the file: per super-block of 256 inputs (8 blocks) 256 bytes, a
 * column's six-bit scale sc and minimum mn of block j (0..7) split in two places: their low four
 * bits in byte 16 j + c (sc in bits 0..3, mn in bits 4..7), their bits 4 and 5 in byte
 * 128 + 16 (j % 4) + c (sc's at bits 0..1, mn's at bits 2..3, shifted up by 4 for j >= 4); then
 * 16 fp16 super-block scales d (bytes 192 ..) and 16 fp16 dmin (bytes 224 ..), a column each; the
 * weight is d * sc * q - dmin * mn, both products exact in fp32 (kvq_ks1_scale and kvq_ks1_min
 * below read them, kvq_ks1_scales128 and kvq_ks1_mins128 sixteen columns at once). Q6_KS (GGUF's
 * Q6_K, and Q3_K: its values -4 .. 3 and six-bit scales less 32 fit) holds six-bit values offset
 * by 32 and, per super-block, 288 bytes: per block j, 32 signed eight-bit scales (bytes
 * 32 j + 16 h + c: sub-block h of 16 inputs), then one fp16 d per column (bytes 256 ..):
 * d * sc * (q - 32). Q2_KS (GGUF's Q2_K) holds
 * values 0 .. 3 as nibbles and, per super-block, 576 bytes: for block j and sub-block h of 16 inputs
 * the four-bit scale (bytes 32 j + 16 h + c) and minimum (bytes 256 + 32 j + 16 h + c) as bytes, then
 * 16 fp16 d (bytes 512 ..) and 16 fp16 dmin (bytes 544 ..): d * sc * q - dmin * mn.
 * m is absent.
 * MX4_F16 (GGUF's MXFP4) holds each weight's four-bit code as the nibble formats hold values, and an
 * fp16 d per 32 inputs, the block's scale 2^(e - 128) (exact for the exponents kvcache takes): a
 * code stands for the integer KVQ_MX4_U[code] - 12 (-12 .. 12: twice FP4 E2M1's value), which every
 * kernel reads through that table after the nibble (one byte shuffle a register), so the
 * weight is d * (KVQ_MX4_U[code] - 12): an offset format whose values come through the table.
 * so that weight (c, k) = d * q + m (unsigned), d * q (signed) or d * (q - OFFSET) (offset formats:
 * GGUF's Q4_0 and Q5_0, whose minimum is -8 d or -16 d, kept without storing it), with the scale
 * of k's sub-block.
 * Arrays: qs [G, nb, QB] uint8, d and m [G, nb, NS, 16] (K-quant formats: d [G, nb / 8, 320] uint8),
 * G = ceil(out / 16), nb = K / 32; rows of the last group past ``out`` hold zeros.
 *
 * Value ranges the products rely on (AVX2 sums two u8 x s8 pair products in int16): unsigned
 * formats hold q < 32, signed ones -128 <= q <= 127.
 */
#ifndef KV_QFORMAT_H
#define KV_QFORMAT_H

#include <stdint.h>
#include <string.h>

#define KVQ_NC 16 /* output rows in a group */

enum {
    KVQ_Q4_F16 = 0,  /* nibbles 0..15, fp16 d and m per 32 (GGUF Q4_0, Q4_1; kvcache q4) */
    KVQ_Q4_F32 = 1,  /* nibbles, fp32 d and m per 32 (Q4_K) */
    KVQ_S8_F16 = 2,  /* signed bytes, fp16 d per 32 (Q8_0; kvcache q8) */
    KVQ_S8_F32_16 = 3, /* signed bytes, fp32 d per 16 (Q6_K, Q3_K) */
    KVQ_U8_F16 = 4,  /* bytes 0..31, fp16 d and m per 32 (Q5_0, Q5_1) */
    KVQ_U8_F32 = 5,  /* bytes 0..31, fp32 d and m per 32 (Q5_K) */
    KVQ_U8_F32_16 = 6, /* bytes 0..3, fp32 d and m per 16 (Q2_K) */
    KVQ_Q5_F16 = 7,  /* nibbles + fifth bits (0..31), fp16 d and m per 32 (Q5_0, Q5_1) */
    KVQ_Q5_F32 = 8,  /* nibbles + fifth bits, fp32 d and m per 32 (Q5_K) */
    KVQ_Q4O_F16 = 9, /* nibbles 0..15 offset by 8: fp16 d per 32, the minimum -8 d implied (Q4_0) */
    KVQ_Q5O_F16 = 10, /* nibbles + fifth bits offset by 16: fp16 d per 32, minimum -16 d implied (Q5_0) */
    KVQ_Q4_KS = 11,  /* nibbles, the file's six-bit scales and minimums with fp16 d, dmin per 256 (Q4_K) */
    KVQ_Q5_KS = 12,  /* nibbles + fifth bits, the same scales (Q5_K, or Q4_K beside it) */
    KVQ_Q6_KS = 13,  /* nibbles + bits 4 and 5 offset by 32, the file's eight-bit scales per 16, fp16 d (Q6_K, Q3_K) */
    KVQ_Q2_KS = 14,  /* nibbles 0..3, the file's four-bit scales and minimums per 16, fp16 d, dmin (Q2_K) */
    KVQ_MX4_F16 = 15, /* MXFP4's nibble codes through KVQ_MX4_U, offset by 12, fp16 d per 32 (MXFP4) */
    KVQ_NFMT = 16
};

static const int KVQ_NIBBLES[KVQ_NFMT] = {1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1};
/* bits above the nibble: 1 (a fifth bit) or 2 (bits 4 and 5) */
static const int KVQ_HIGH[KVQ_NFMT] = {0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 0, 1, 2, 0, 0};
static const int KVQ_SIGNED[KVQ_NFMT] = {0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static const int KVQ_F16[KVQ_NFMT] = {1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1};
static const int KVQ_NS[KVQ_NFMT] = {1, 1, 1, 2, 1, 1, 2, 1, 1, 1, 1, 1, 1, 2, 2, 1};
/* offset formats store no minimums: weight = d * (q - OFFSET), that is m = -OFFSET * d */
static const int KVQ_OFFSET[KVQ_NFMT] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 16, 0, 0, 32, 0, 12};
/* formats whose nibbles are codes read through KVQ_MX4_U (the kernels' NIB parameter 2) */
static const int KVQ_LUT[KVQ_NFMT] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
/* MXFP4's sixteen codes as the unsigned bytes the kernels take: twice the E2M1 value, plus 12
 * (codes 8 .. 15 are the negatives of 0 .. 7; 8 is -0) */
static const uint8_t KVQ_MX4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#define KVQ_MX4_OFS 12

/* K-quant formats: the file's integer scales (see above): 1 with minimums per 32 (Q4_K, Q5_K), 2 signed
 * per 16 (Q6_K), 3 with minimums per 16 (Q2_K) */
static const int KVQ_KS[KVQ_NFMT] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3, 0};

/* Kind 4 is no format of its own: kind 1's scales widened for a product's rows (qgemm.c's mm_group
 * makes it when several row tiles take the same columns): per super-block 320 bytes, block j's
 * sixteen scales as bytes at 32 j, its minimums at 32 j + 16, then d at 256 and dmin at 288. */
#define KVQ_KS_WIDE 4

/* bytes of scales per super-block of a group in a K-quant format (KVQ_KS kind), where its fp16 d
 * and dmin start (kind 2 has no dmin), and its sub-blocks a block (16 inputs for kinds 2 and 3) */
static inline int kvq_ksb(int ks) { return ks == 3 ? 576 : ks == 2 ? 288 : ks == KVQ_KS_WIDE ? 320 : 256; }
static inline int kvq_ks_d(int ks) { return ks == 3 ? 512 : ks == 2 || ks == KVQ_KS_WIDE ? 256 : 192; }
static inline int kvq_ks_dmin(int ks) { return ks == 3 ? 544 : ks == KVQ_KS_WIDE ? 288 : 224; }
static inline int kvq_ks_ns(int ks) { return ks == 2 || ks == 3 ? 2 : 1; }

/* Kind 1's scale and minimum of block j, column c, and their writer. */
static inline int kvq_ks1_scale(const uint8_t *sp, int j, int c) {
    return (sp[16 * j + c] & 15) | ((sp[128 + 16 * (j & 3) + c] >> (4 * (j >> 2))) & 3) << 4;
}
static inline int kvq_ks1_min(const uint8_t *sp, int j, int c) {
    return (sp[16 * j + c] >> 4) | ((sp[128 + 16 * (j & 3) + c] >> (4 * (j >> 2) + 2)) & 3) << 4;
}
static inline void kvq_ks1_put(uint8_t *sp, int j, int c, int sc, int mn) {
    const int sh = 4 * (j >> 2);
    uint8_t *hi = sp + 128 + 16 * (j & 3) + c;
    sp[16 * j + c] = (uint8_t)((sc & 15) | (mn & 15) << 4);
    *hi = (uint8_t)((*hi & ~(15 << sh)) | (((sc >> 4) & 3) | ((mn >> 4) & 3) << 2) << sh);
}

/* The minimums of K-quant kinds 1, 3 and 4 as the SIMD kernels take them, two sub-blocks a 32-bit
 * lane (vpdpwssd): kvq_ks_pairs pairs a super-block; pair p's are blocks 2 p and 2 p + 1 for
 * kinds 1 (kvq_ks1_mins128) and 4, block p's two halves for kind 3 (kinds 3 and 4: the first at
 * byte kvq_ks_min(ks, p) of the super-block's scales, the second kvq_ks_min_gap further), and a
 * row's activation sums of the same sub-blocks at kvq_ks_sums (k32 or k16 of Scratch, at
 * super-block sb), two as one lane by kvq_pair16. */
static inline int kvq_ks_pairs(int ks) { return ks == 3 ? 8 : 4; }
static inline int kvq_ks_min(int ks, int p) { return ks == 3 ? 256 + 32 * p : 64 * p + 16; }
static inline int kvq_ks_min_gap(int ks) { return ks == 3 ? 16 : 32; }
static inline const int16_t *kvq_ks_sums(int ks, const int16_t *k16, const int16_t *k32, int sb) {
    return ks == 3 ? k16 + 16 * sb : k32 + 8 * sb;
}
static inline int32_t kvq_pair16(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* Kind 1's scales (and minimums) of block j for the sixteen columns, a byte each. */
static inline __attribute__((always_inline)) __m128i kvq_ks1_high128(const uint8_t *sp, int j) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(sp + 128 + 16 * (j & 3)));
    return j >= 4 ? _mm_srli_epi16(h, 4) : h;
}
static inline __attribute__((always_inline)) __m128i kvq_ks1_scales128(const uint8_t *sp, int j) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)(sp + 16 * j)), h = kvq_ks1_high128(sp, j);
    return _mm_or_si128(_mm_and_si128(lo, _mm_set1_epi8(15)), _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(3)), 4));
}
static inline __attribute__((always_inline)) __m128i kvq_ks1_mins128(const uint8_t *sp, int j) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)(sp + 16 * j)), h = kvq_ks1_high128(sp, j);
    return _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), _mm_set1_epi8(15)),
                        _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(12)), 2));
}
#endif

/* Kind 1's super-block sp widened into kind 4's 320 bytes at dst. */
static inline void kvq_ks1_widen(const uint8_t *sp, uint8_t *dst) {
    for (int j = 0; j < 8; j++) {
#if defined(__SSE2__)
        _mm_storeu_si128((__m128i *)(dst + 32 * j), kvq_ks1_scales128(sp, j));
        _mm_storeu_si128((__m128i *)(dst + 32 * j + 16), kvq_ks1_mins128(sp, j));
#else
        for (int c = 0; c < 16; c++) {
            dst[32 * j + c] = (uint8_t)kvq_ks1_scale(sp, j, c);
            dst[32 * j + 16 + c] = (uint8_t)kvq_ks1_min(sp, j, c);
        }
#endif
    }
    memcpy(dst + 256, sp + 192, 64);
}

/* Bytes of the scale array (d) a group takes for nb blocks, and of one element of it. */
static inline int64_t kvq_group_scale_bytes(int fmt, int64_t nb) {
    return KVQ_KS[fmt] ? nb / 8 * kvq_ksb(KVQ_KS[fmt]) : nb * KVQ_NS[fmt] * KVQ_NC * (KVQ_F16[fmt] ? 2 : 4);
}

static inline int kvq_qbytes(int fmt) { return KVQ_NIBBLES[fmt] ? 256 + 64 * KVQ_HIGH[fmt] : 512; }

/* Bits 4 and 5 of value (c, k) in a 6-bit group-block: the byte, and the shift of the pair in it. */
static inline int kvq_six_pos(int c, int k, int *shift) {
    *shift = 2 * ((k >> 2) & 3);
    return 256 + 64 * (k >> 4) + c * 4 + (k & 3);
}

/* Bit 4 of value (c, k) in a 5-bit group-block: the byte and the bit within it. */
static inline int kvq_high_pos(int c, int k, int *bit) {
    const int lane = c * 4 + (k & 3);
    *bit = lane & 7;
    return 256 + (k >> 2) * 8 + (lane >> 3);
}

/* IEEE half <-> float without hardware support (repack and dequantize are not hot). */
static inline float kvq_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Position of value (c, k) of a group-block inside qs, and whether it is the high nibble. */
static inline int kvq_pos(int nib, int c, int k, int *high) {
    if (!nib) {
        *high = 0;
        return (k >> 2) * 64 + c * 4 + (k & 3);
    }
    *high = k >> 4;
    return ((k & 15) >> 2) * 64 + c * 4 + (k & 3);
}

#endif
