/* AMX tiles for the int8 quantized products of many rows (prefill, batched steps): the integer sums
 * of qtile512.h's AVX512-VNNI tile taken by the tile unit, 16 rows x 16 columns x one block of 32
 * inputs an instruction, then that tile's very float steps, so every output has the same bits
 * either way (and a row's bits still do not depend on the batch it came in).
 *
 * Used only where all of these hold, found out once per process (the first product of 16 rows or
 * more, or kv_amx_status):
 *   the AVX512-VNNI build (the other variants have no AMX path) from a compiler with the AMX
 *   intrinsics (GCC 11, clang 12 on); KVCACHE_AMX is not 0;
 *   the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, subleaf 0: EDX bits 24 and 25), the OS saves
 *   tile state (CPUID 1 ECX bit 27 OSXSAVE; XCR0 bits 17 XTILECFG and 18 XTILEDATA) and grants
 *   this process tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA);
 *   a self-check, on a thread of its own: probe weights in every format (pseudo-random values and
 *   scales, several blocks, column counts that leave part of a group, row ranges that leave rows
 *   over, bias, row scale and accumulation), their products through mm_group with the tiles and
 *   without them, are memcmp-equal.
 * kv_amx_status says which, and why.
 *
 * One call (amx_group: tile column t of a weight, rows r0 .. r1 - 1) takes the whole multiples of
 * 16 rows, up to MAXR at a time (a pass); the rows over are mm_group's. For each block of 32 inputs:
 *   B  each column group's weights, 8 rows of 64 bytes (row s, bytes 4 c .. 4 c + 3: column c's
 *      inputs 4 s .. 4 s + 3), which is qformat.h's byte layout: byte formats are loaded in place,
 *      nibble formats unpacked to bytes once a block for every row of the pass;
 *   A  16 rows' int8 activations, 32 bytes each, K bytes apart;
 *   C  16 x 16 int32 sums of a row tile and a column group. Row tiles take turns between two sets
 *      (C 0, 1 from A 4; C 2, 3 from A 5; B of the two groups in 6, 7), so one's stores overlap the
 *      other's products. Formats with scales per 16 inputs take each half on its own (A of 16
 *      bytes, B of 4 rows).
 * Signed weights go through TDPBSSD, unsigned ones through TDPBSUD; offset formats are unpacked as
 * signed bytes q - offset (TDPBSSD): the sums are the VNNI tile's, which takes offset * the
 * activations' sum back (integer sums are exact). The C tiles are stored; block b + 1's sums are
 * taken before block b's float steps, which each row's accumulators take in qtile512.h's order with
 * the same intrinsics; a pass ends in mm_store, every kernel's tail. The K-quant formats take their
 * own order (qgemm.c) and more of it (amx_ksf_run): the file's integer scales go into the B tiles
 * (in parts whose bytes hold the products), so the tile unit sums a whole super-block of 64-input
 * tiles into the very int32 sum that VNNI's block sums times the scales make, and only the
 * super-block's two float steps remain; its A tiles read the activations rounded per 256 in a copy
 * laid out as the tiles load them (Scratch's kt). The tile configuration is loaded at the start of
 * every call and released at its end: a thread's tile state is never assumed.
 *
 * Speed, kv_q_linear of 512 rows at 2048 x 8192 (python -m kvcache.bench.amx_check): on a 2-core
 * Xeon VM (AMX, no second thread a core), one thread: Q4_K 1.9-2.1x the VNNI kernels', Q6_K 1.6-1.7x,
 * Q4_0 and Q8_0 (their float steps every 32 inputs) 1.1-1.45x. On a 16-vCPU Xeon VM (8 cores with two
 * threads each), before the K-quants' folding: eight threads on eight cores 1.0-1.4x, all sixteen
 * about even (0.85-1.05x): two threads of a core share its tile unit. So a call from a parallel
 * region of more threads than the process has cores takes the VNNI kernels (amx_cores).
 *
 * KV_AMX_EMULATE (tests only) builds the tile instructions as plain C after Intel's definitions,
 * checking what the hardware would fault on, so the whole path runs on CPUs without AMX.
 */
#define _GNU_SOURCE /* sched_getaffinity, cpu_set_t */
#include "qformat.h"
#include "qgemm.h"

#include <errno.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kv_q_isa(void); /* qgemm.c: this build's variant */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__x86_64__)
#define AMX_ISA 1
#else
#define AMX_ISA 0
#endif

/* column groups in a tile column: as qgemm.c has it */
#ifndef NGMAX
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define NGMAX 2
#else
#define NGMAX 1
#endif
#endif

#if AMX_ISA && NGMAX <= 2 && \
    (defined(KV_AMX_EMULATE) || (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11))
#define AMX_CODE 1
#else
#define AMX_CODE 0
#endif

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static char amx_why[320]; /* kv_amx_status's line */

#if AMX_CODE
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* rows a pass: 32 keep a pass's buffers (sums, accumulators: 13 KiB, 21 with scales per 16) in the
 * first-level cache beside a second hardware thread's; 64 were as fast on one thread a core and
 * slower on two (measured on a 16-thread Xeon VM) */
#define MAXR 32
#define NCOL (2 * KVQ_NC)   /* columns a pass holds: two groups */
#define AMX_PF 3072         /* prefetch distance in bytes of weights (qgemm.c's PF) */

static int amx_on; /* the tiles are used (set once, under amx_once) */
/* Physical cores among the CPUs this process may run on (set under amx_once): a parallel region of
 * more threads than that puts two on a core, which share its one tile unit, and there the VNNI
 * kernels were as fast or faster (see Speed above), so such calls leave the tiles alone. */
static int amx_cores = 1 << 30;

/* Distinct (package, core) pairs of the CPUs in this process's affinity set (sysfs topology), or
 * the CPUs themselves where the topology cannot be read. */
static int physical_cores(void) {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1 << 30;
    int64_t seen[CPU_SETSIZE];
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &set)) continue;
        int64_t ids[2] = {-1, -1};
        const char *what[2] = {"physical_package_id", "core_id"};
        for (int i = 0; i < 2; i++) {
            char path[96];
            snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/%s", c, what[i]);
            FILE *f = fopen(path, "r");
            long v;
            if (f && fscanf(f, "%ld", &v) == 1) ids[i] = v;
            if (f) fclose(f);
        }
        if (ids[0] < 0 || ids[1] < 0) return CPU_COUNT(&set); /* no topology: every CPU a core */
        const int64_t key = ids[0] << 32 | ids[1];
        int k = 0;
        while (k < n && seen[k] != key) k++;
        if (k == n) seen[n++] = key;
    }
    return n > 0 ? n : 1 << 30;
#else
    return 1 << 30;
#endif
}

/* The self-check's thread: 1 while it computes the reference (amx_group declines), 2 while it
 * computes with the tiles (amx_group works without asking amx_once, which is running). */
static __thread int tl_probe;
static __thread int64_t tl_rows; /* rows this thread's tiles took (the self-check counts them) */

/* The palette 1 configuration: 64 bytes, tile i is rows[i] rows of colsb[i] bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileCfg;
_Static_assert(sizeof(TileCfg) == 64, "a tile configuration is 64 bytes");

/* C tiles 0-3: 16 rows x 16 int32; A tiles 4, 5: 16 rows x KD bytes; B tiles 6, 7: KD / 4 rows x 64 bytes
 * (KD: inputs a product takes, 32, or 16 for formats with scales per 16) */
#define TILE_CFG(KD) {1, 0, {0}, {64, 64, 64, 64, KD, KD, 64, 64}, {16, 16, 16, 16, 16, 16, (KD) / 4, (KD) / 4}}
/* by KVQ_NS (32 or 16 inputs a product), then 64 inputs (two blocks) for the folded K-quants */
static const TileCfg CFG[3] __attribute__((aligned(64))) = {TILE_CFG(32), TILE_CFG(16), TILE_CFG(64)};

/* GCC's tile intrinsics are asm statements that name no memory: a barrier on buffer p orders its
 * ordinary stores and loads around them */
#define MEMBAR(p) __asm__ volatile("" : : "r"(p) : "memory")

#ifdef KV_AMX_EMULATE
/* The tile instructions in C (Intel's definitions), aborting where the hardware would fault. */
static __thread struct {
    int on;
    TileCfg cfg;
    uint8_t t[8][16][64];
} emu;

static void emu_fail(const char *what) {
    fprintf(stderr, "qamx emulation: %s\n", what);
    abort();
}

static void emu_cfg(const void *p) {
    memcpy(&emu.cfg, p, 64);
    const TileCfg *c = &emu.cfg;
    if (c->palette != 1 || c->start_row) emu_fail("palette 1, start_row 0 expected");
    for (int i = 0; i < 14; i++)
        if (c->reserved[i]) emu_fail("reserved configuration bytes set");
    for (int i = 0; i < 16; i++) {
        if (i >= 8 && (c->rows[i] || c->colsb[i])) emu_fail("tiles 8-15 configured");
        if (c->rows[i] > 16 || c->colsb[i] > 64 || (!c->rows[i]) != (!c->colsb[i])) emu_fail("bad tile shape");
    }
    memset(emu.t, 0, sizeof(emu.t));
    emu.on = 1;
}

static void emu_release(void) {
    emu.on = 0;
    memset(&emu.cfg, 0, sizeof(emu.cfg));
    memset(emu.t, 0, sizeof(emu.t));
}

static void emu_tile(int t) {
    if (!emu.on) emu_fail("tile used without a configuration");
    if (t < 0 || t > 7 || !emu.cfg.rows[t]) emu_fail("tile not configured");
}

static void emu_zero(int t) {
    emu_tile(t);
    memset(emu.t[t], 0, sizeof(emu.t[t]));
}

static void emu_load(int t, const void *base, int64_t stride) {
    emu_tile(t);
    memset(emu.t[t], 0, sizeof(emu.t[t]));
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy(emu.t[t][r], (const char *)base + r * stride, emu.cfg.colsb[t]);
}

static void emu_store(int t, void *base, int64_t stride) {
    emu_tile(t);
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy((char *)base + r * stride, emu.t[t][r], emu.cfg.colsb[t]);
}

/* TDPBSUD (b unsigned) or TDPBSSD (b signed): c += a (signed bytes) . b, groups of 4 */
static void emu_dp(int c, int a, int b, int b_signed) {
    emu_tile(c), emu_tile(a), emu_tile(b);
    const TileCfg *f = &emu.cfg;
    if (c == a || c == b || a == b) emu_fail("dot product of overlapping tiles");
    if (f->colsb[c] % 4 || f->colsb[a] % 4 || f->colsb[c] != f->colsb[b] || f->colsb[a] / 4 != f->rows[b] ||
        f->rows[c] != f->rows[a])
        emu_fail("dot product of mismatched shapes");
    for (int m = 0; m < f->rows[c]; m++)
        for (int n = 0; n < f->colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &emu.t[c][m][4 * n], 4);
            for (int k = 0; k < f->colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t bv = emu.t[b][k][4 * n + i];
                    acc += (int32_t)(int8_t)emu.t[a][m][4 * k + i] * (b_signed ? (int32_t)(int8_t)bv : (int32_t)bv);
                }
            memcpy(&emu.t[c][m][4 * n], &acc, 4);
        }
}

#define T_CFG(p) emu_cfg(p)
#define T_RELEASE() emu_release()
#define T_ZERO(t) emu_zero(t)
#define T_LOAD(t, p, s) emu_load(t, p, s)
#define T_STORE(t, p, s) emu_store(t, p, s)
#define T_DPSU(c, a, b) emu_dp(c, a, b, 0)
#define T_DPSS(c, a, b) emu_dp(c, a, b, 1)
#define AMX_TARGET
#else
#define T_CFG(p) _tile_loadconfig(p)
#define T_RELEASE() _tile_release()
#define T_ZERO(t) _tile_zero(t)
#define T_LOAD(t, p, s) _tile_loadd(t, p, s)
#define T_STORE(t, p, s) _tile_stored(t, p, s)
#define T_DPSU(c, a, b) _tile_dpbsud(c, a, b)
#define T_DPSS(c, a, b) _tile_dpbssd(c, a, b)
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#endif
/* c += a . b, b signed (SGN) or unsigned: tile numbers must be constants */
#define T_DP(SGN, c, a, b) \
    do { \
        if (SGN) T_DPSS(c, a, b); \
        else T_DPSU(c, a, b); \
    } while (0)

#define ALWAYS __attribute__((always_inline)) inline

#include "qscale512.h"

/* Row s of one block of a nibble format's group as bytes, the B tile's layout: byte 4 c + t =
 * value (c, 4 s + t) (qtile512.h's step_w for step s). HI: 1 the fifth bits (words hm), 2 bits 4 and 5. */
static ALWAYS __m512i amx_row(const int HI, const uint8_t *wb, const uint64_t *hm, int s) {
    __m512i v = _mm512_loadu_si512(wb + 64 * (s & 3)); /* low nibbles: step s; high ones: step s + 4 */
    if (s >= 4) v = _mm512_srli_epi16(v, 4);
    v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    if (HI == 2) { /* bits 4 and 5: the pair at bits 2 (s & 3) of bytes 256 + 64 (s >> 2) + 4 c + t */
        const __m512i u = _mm512_loadu_si512(wb + 256 + 64 * (s >> 2));
        const int k = s & 3;
        const __m512i t = k == 2 ? u : k < 2 ? _mm512_slli_epi16(u, 4 - 2 * k) : _mm512_srli_epi16(u, 2 * k - 4);
        v = _mm512_or_si512(v, _mm512_and_si512(t, _mm512_set1_epi8(0x30)));
    } else if (HI) { /* the fifth bits: bit (4 c + t) of word s */
        v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(hm[s], _mm512_set1_epi8(0x10)));
    }
    return v;
}

/* One block (HI 0 or 1) as amx_row's eight rows at out, less OFS (then signed); NIB 2: the nibbles
 * are MXFP4's codes, read through KVQ_MX4_U first. */
static ALWAYS void amx_unpack(const int NIB, const int HI, const int OFS, const uint8_t *wb, uint8_t *out) {
    uint64_t hm[8];
    if (HI == 1) memcpy(hm, wb + 256, 64);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVQ_MX4_U));
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        __m512i v = amx_row(HI, wb, hm, s);
        if (NIB == 2) v = _mm512_shuffle_epi8(lut, v);
        if (OFS) v = _mm512_sub_epi8(v, _mm512_set1_epi8((char)OFS)); /* q - OFFSET as signed bytes */
        _mm512_storeu_si512(out + 64 * s, v);
    }
}

typedef struct { /* a pass's activations from its first row on (Scratch's arrays): the per-32 order's
                  q, da, sa (amx_pass), or the K-quant order's kq as q, dk, k16, k32 (amx_ksf_run) */
    const int8_t *q;
    const float *da, *sa;
    int K, nb;
    const float *dk;
    const int16_t *k16, *k32;
} Rows;

/* The integer sums of block b for the np rows of a pass (np a multiple of 16) into C [NS][MAXR][NCOL]:
 * B tiles of the NG groups (b0, b1: the block's bytes), A tiles of 16 rows, row tiles taking turns
 * between two sets of tiles; SGN: signed weights. */
static ALWAYS AMX_TARGET void amx_sums(const int SGN, const int NS, const int NG, int np, Rows a, int b,
                                       const uint8_t *b0, const uint8_t *b1, int32_t C[][MAXR][NCOL]) {
    const int KD = 32 / NS, nt = np / 16;
    for (int h = 0; h < NS; h++) {
        T_LOAD(6, b0 + 256 * h, 64);
        if (NG == 2) T_LOAD(7, b1 + 256 * h, 64);
        for (int i = 0; i < nt; i += 2) {
            const int8_t *a0 = a.q + (int64_t)16 * i * a.K + 32 * b + KD * h;
            int32_t *c0 = &C[h][16 * i][0];
            T_ZERO(0);
            if (NG == 2) T_ZERO(1);
            T_LOAD(4, a0, a.K);
            T_DP(SGN, 0, 4, 6);
            if (NG == 2) T_DP(SGN, 1, 4, 7);
            T_STORE(0, c0, 4 * NCOL);
            if (NG == 2) T_STORE(1, c0 + KVQ_NC, 4 * NCOL);
            if (i + 1 < nt) {
                T_ZERO(2);
                if (NG == 2) T_ZERO(3);
                T_LOAD(5, a0 + (int64_t)16 * a.K, a.K);
                T_DP(SGN, 2, 5, 6);
                if (NG == 2) T_DP(SGN, 3, 5, 7);
                T_STORE(2, c0 + 16 * NCOL, 4 * NCOL);
                if (NG == 2) T_STORE(3, c0 + 16 * NCOL + KVQ_NC, 4 * NCOL);
            }
        }
    }
    MEMBAR(C); /* the stored sums are read as memory from here */
}

/* Block b's weights of the NG groups as B tiles: in place (byte formats) or unpacked into buf. */
static ALWAYS void amx_weights(const int NIB, const int HI, const int OFS, const int NG, const uint8_t *w,
                               int64_t gq, int b, uint8_t buf[2][512], const uint8_t **b0, const uint8_t **b1) {
    const int qb = NIB ? 256 + 64 * HI : 512;
    for (int g = 0; g < NG; g++) {
        const uint8_t *wb = w + g * gq + (int64_t)b * qb;
        for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(wb + AMX_PF + l), _MM_HINT_T0);
        if (NIB) amx_unpack(NIB, HI, OFS, wb, buf[g]);
        *(g ? b1 : b0) = NIB ? buf[g] : wb;
    }
    if (NG == 1) *b1 = *b0;
    MEMBAR(buf); /* the unpacked bytes are in memory before the tiles load them */
}

/* The np rows of a pass times NG groups into acc [np][NCOL] (columns 16 g ..): qtile512.h's tile,
 * its float steps in its order, the integer sums from the tile unit. Block b + 1's sums are taken
 * before block b's float steps (C holds two blocks) so the two units overlap. */
static ALWAYS AMX_TARGET void amx_pass(const int NIB, const int HI, const int SGN, const int F16, const int NS,
                                       const int OFS, const int NG, int np, Rows a, const uint8_t *w, int64_t gq,
                                       const void *dv, const void *mv, int64_t gs, float acc[MAXR][NCOL]) {
    const int MIN = !SGN && !OFS; /* the format has minimums */
    uint8_t buf[2][512] __attribute__((aligned(64)));
    int32_t C[4][MAXR][NCOL] __attribute__((aligned(64))); /* [NS x block parity + half][row][column] */
    for (int r = 0; r < np; r++)
        for (int c = 0; c < NCOL; c++) acc[r][c] = 0.f;
    const uint8_t *b0, *b1;
    amx_weights(NIB, HI, OFS, NG, w, gq, 0, buf, &b0, &b1);
    amx_sums(SGN || OFS, NS, NG, np, a, 0, b0, b1, C);
    for (int b = 0; b < a.nb; b++) {
        if (b + 1 < a.nb) {
            amx_weights(NIB, HI, OFS, NG, w, gq, b + 1, buf, &b0, &b1);
            amx_sums(SGN || OFS, NS, NG, np, a, b + 1, b0, b1, C + NS * ((b + 1) & 1));
        }
        int32_t(*S)[MAXR][NCOL] = C + NS * (b & 1);
        __m512 dw[2][2], mw[2][2];
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++)
#pragma GCC unroll 2
            for (int h = 0; h < NS; h++) {
                mw[g][h] = _mm512_setzero_ps();
                scales16(F16, MIN, (const char *)dv + g * gs, mv ? (const char *)mv + g * gs : NULL, b, NS, h,
                           &dw[g][h], &mw[g][h]);
            }
        for (int r = 0; r < np; r++) {
            const int64_t at = (int64_t)r * a.nb + b;
            const __m512 da = _mm512_set1_ps(a.da[at]);
            const float *sa = a.sa + 3 * at;
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) {
                __m512 v = _mm512_loadu_ps(&acc[r][KVQ_NC * g]);
                if (NS == 1) {
                    const __m512i s = _mm512_loadu_si512(&S[0][r][KVQ_NC * g]);
                    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), da), dw[g][0], v);
                    if (MIN) v = _mm512_fmadd_ps(mw[g][0], _mm512_set1_ps(sa[0]), v);
                } else { /* the halves' sums combined, then one activation step */
                    const __m512i s0 = _mm512_loadu_si512(&S[0][r][KVQ_NC * g]);
                    const __m512i s1 = _mm512_loadu_si512(&S[1][r][KVQ_NC * g]);
                    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s0), dw[g][0]);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), dw[g][1], t);
                    v = _mm512_fmadd_ps(t, da, v);
                    if (MIN) {
                        v = _mm512_fmadd_ps(mw[g][0], _mm512_set1_ps(sa[1]), v);
                        v = _mm512_fmadd_ps(mw[g][1], _mm512_set1_ps(sa[2]), v);
                    }
                }
                _mm512_storeu_ps(&acc[r][KVQ_NC * g], v);
            }
        }
        MEMBAR(S); /* block b's sums read before the tiles store block b + 2's over them */
    }
}

/* The folded K-quants (amx_ksf_run): their integer scales go into the B tiles, in parts whose products
 * with the values fit a byte. Q2_KS: the value times the scale (at most 3 x 15), one part. Q4_KS and
 * Q5_KS: the scale's low bits and the rest (Q4_KS four and two: 15 x 15, 15 x 3; Q5_KS three and
 * three: 31 x 7). Q6_KS: its signed eight-bit scale as three base-4 digits and a top one of -2 .. 1
 * (sc = d0 + 4 d1 + 16 d2 + 64 d3), each times the value less 32 (-96 .. 93, signed bytes). */

/* Each int32 lane's value (below 2^16) in both of its 16-bit words: fold_mul's factor for the four
 * bytes of a column. */
static ALWAYS __m512i fold_words(__m512i v) { return _mm512_or_si512(v, _mm512_slli_epi32(v, 16)); }

/* Sixteen columns' integer scales (int32 lanes), the bits lo .. lo + n - 1 of each, as fold_words. */
static ALWAYS __m512i fold_factor(__m512i sc, int lo, int n) {
    return fold_words(_mm512_and_si512(_mm512_srli_epi32(sc, lo), _mm512_set1_epi32((1 << n) - 1)));
}

/* Bytes v (values below 32) times their column's factor f (fold_factor) where every product is
 * below 256: one 16-bit multiply takes both bytes of a word, since the low byte's product does not
 * carry into the high one and the high one's wraps at 2^16 exactly above its own byte. */
static ALWAYS __m512i fold_mul(__m512i v, __m512i f) { return _mm512_mullo_epi16(v, f); }

/* The low byte of each int32 lane repeated in the lane's four bytes. */
static ALWAYS __m512i fold_bytes4z(__m512i v) {
    return _mm512_shuffle_epi8(v, _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0x00000000));
}

/* Sixteen bytes (one a column) each repeated in the four bytes of its column's lane. */
static ALWAYS __m512i fold_bytes4(__m128i b) { return fold_bytes4z(_mm512_cvtepu8_epi32(b)); }

/* One super-block of one group as the B tiles of amx_ksf_run: NP parts x 4 pairs of blocks x 16 rows
 * of 64 bytes (row 8 (j & 1) + s of pair j >> 1: qformat.h's byte layout of block j's inputs 4 s ..
 * 4 s + 3). Q4_KS, Q5_KS: the values times the scale's low SH bits, and times the rest; Q2_KS: the
 * values times the scale, and the block's minimums (each half's) in every byte; Q6_KS: the values
 * less 32 times each digit of the scale (above). sp at the super-block's scales. */
static ALWAYS void ksf_build(const int HI, const int KS, const uint8_t *wg, const uint8_t *sp, int sb,
                             uint8_t B[][4][1024]) {
    const int SH = HI == 1 ? 3 : 4, qb = 256 + 64 * HI, NS = kvq_ks_ns(KS);
    for (int j = 0; j < 8; j++) {
        const uint8_t *wb = wg + (int64_t)(8 * sb + j) * qb;
        for (int l = 0; l < qb; l += 64) _mm_prefetch((const char *)(wb + AMX_PF + l), _MM_HINT_T0);
        /* [half of the block (scales per 16)][part]: the parts' factors (or Q2_KS's minimums' bytes),
         * and Q6_KS's bytes to take off: 32 d0 .. 32 d2, and 32 (d3 + 2) - 64 */
        __m512i f[2][4], o[2][4];
#pragma GCC unroll 2
        for (int h = 0; h < NS; h++) {
            const __m512i sc = ks_scales16(KS, sp, j, h);
            if (KS == 2) {
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const __m512i dg = k < 3 ? _mm512_and_si512(_mm512_srai_epi32(sc, 2 * k), _mm512_set1_epi32(3))
                                             : _mm512_add_epi32(_mm512_srai_epi32(sc, 6), _mm512_set1_epi32(2));
                    f[h][k] = fold_words(dg);
                    o[h][k] = fold_bytes4z(_mm512_sub_epi32(_mm512_slli_epi32(dg, 5), _mm512_set1_epi32(k < 3 ? 0 : 64)));
                }
            } else {
                f[h][0] = fold_factor(sc, 0, KS == 3 ? 8 : SH);
                f[h][1] = KS == 1 ? fold_factor(sc, SH, 6 - SH)
                                  : fold_bytes4(_mm_loadu_si128((const __m128i *)(sp + kvq_ks_min(KS, j) + kvq_ks_min_gap(KS) * h)));
            }
        }
        if (NS == 1)
            for (int k = 0; k < 2; k++) f[1][k] = f[0][k];
        uint64_t hm[8];
        if (HI == 1) memcpy(hm, wb + 256, 64);
        const int at = 512 * (j & 1);
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m512i v = amx_row(HI, wb, hm, s);
            uint8_t *row = B[0][j >> 1] + at + 64 * s;
            const int h = s >> 2;
            if (KS == 2) { /* (v - 32) d = v d - 32 d; the top digit as d3 + 2, less 2 v */
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m512i b = _mm512_sub_epi8(fold_mul(v, f[h][k]), o[h][k]);
                    if (k == 3) b = _mm512_sub_epi8(b, _mm512_add_epi8(v, v));
                    _mm512_store_si512(row + 4096 * k, b);
                }
            } else {
                _mm512_store_si512(row, fold_mul(v, f[h][0]));
                _mm512_store_si512(row + 4096, KS == 1 ? fold_mul(v, f[h][1]) : f[h][1]);
            }
        }
    }
}

/* one part's B tiles of a super-block (ksf_build): 4 pairs of blocks x 16 rows of 64 bytes */
typedef uint8_t KsfPart[4][1024];

static const int32_t ZEROS[16 * KVQ_NC] __attribute__((aligned(64))); /* a C tile of zeros, loaded: tilezero
                                                                         before a product chain is slower */

#define KSF_ROWS 256 /* rows a folded super-block's B tiles serve (amx_ksf_run): its float sums, 16 KiB */

/* Row tiles 2 i and 2 i + 1 (two: whether the second is there) of super-block sb: both parts' sums
 * into C [part][row][column] (C 0, 1: row tile 0's parts, 2, 3 row tile 1's; A 4, 5 the row tiles'
 * 64 inputs; B 6, 7 the parts; SGN: signed parts). q: the first row tile's activations, in the tile
 * order (Scratch's kt; T 1) or by rows (kq; T 0), of K inputs a row. */
static ALWAYS AMX_TARGET void ksf_tiles(const int T, const int SGN, const int8_t *q, int64_t K, int sb, int two,
                                        KsfPart *Bs, int32_t C[][32][KVQ_NC]) {
    const int64_t lda = T ? 64 : K; /* bytes from a row to the next in an A tile */
    T_LOAD(0, ZEROS, 4 * KVQ_NC);
    T_LOAD(1, ZEROS, 4 * KVQ_NC);
    if (two) {
        T_LOAD(2, ZEROS, 4 * KVQ_NC);
        T_LOAD(3, ZEROS, 4 * KVQ_NC);
    }
#pragma GCC unroll 4
    for (int kk = 0; kk < 4; kk++) {
        const int8_t *a0 = q + (T ? 1024 : 64) * (4 * sb + kk); /* the second row tile's 16 K bytes on */
        T_LOAD(6, Bs[0][kk], 64);
        T_LOAD(4, a0, lda);
        T_DP(SGN, 0, 4, 6);
        T_LOAD(7, Bs[1][kk], 64);
        T_DP(SGN, 1, 4, 7);
        if (two) {
            T_LOAD(5, a0 + 16 * K, lda);
            T_DP(SGN, 2, 5, 6);
            T_DP(SGN, 3, 5, 7);
        }
    }
    T_STORE(0, &C[0][0][0], 4 * KVQ_NC);
    T_STORE(1, &C[1][0][0], 4 * KVQ_NC);
    if (two) {
        T_STORE(2, &C[0][16][0], 4 * KVQ_NC);
        T_STORE(3, &C[1][16][0], 4 * KVQ_NC);
    }
    MEMBAR(C); /* the stored sums are read as memory from here */
}

/* The float steps of super-block sb for the nr rows of a row tile pair (rows r .. of a's), from the
 * parts' sums C [part][row][column]: S = part 0 + (part 1 << SH) (Q4_KS, Q5_KS), part 0 (Q2_KS), or
 * the digits' parts times 1, 4, 16, 64 (Q6_KS); M part 1 (Q2_KS) or the activation sums' pairs times
 * the minimums' (Q4_KS, Q5_KS: qtile512.h's), none for Q6_KS; then ks_steps into acc. */
static ALWAYS void ksf_close(const int SH, const int KS, int nr, int r, Rows a, int sb, const uint8_t *sp,
                             int32_t C[][32][KVQ_NC], float acc[][KVQ_NC]) {
    const int nsb = a.nb / 8;
    __m512i mp[8];
    if (KS == 1)
        for (int p = 0; p < kvq_ks_pairs(KS); p++) mp[p] = ks_min_pair(KS, sp, p);
    const __m512 d = ks_d16(KS, sp, 0), dmin = KS != 2 ? ks_d16(KS, sp, 1) : _mm512_setzero_ps();
    for (int i = 0; i < nr; i++) {
        const int64_t row = r + i; /* of a and of acc */
        __m512i S = _mm512_load_si512(&C[0][i][0]), M = _mm512_setzero_si512();
        if (KS == 1) {
            S = _mm512_add_epi32(S, _mm512_slli_epi32(_mm512_load_si512(&C[1][i][0]), SH));
            const int16_t *ks = kvq_ks_sums(KS, a.k16 + row * 2 * a.nb, a.k32 + row * a.nb, sb);
            for (int p = 0; p < kvq_ks_pairs(KS); p++)
                M = _mm512_dpwssd_epi32(M, mp[p], _mm512_set1_epi32(kvq_pair16(ks + 2 * p)));
        } else if (KS == 3) {
            M = _mm512_load_si512(&C[1][i][0]);
        } else {
            S = _mm512_add_epi32(S, _mm512_slli_epi32(_mm512_load_si512(&C[1][i][0]), 2));
            S = _mm512_add_epi32(S, _mm512_slli_epi32(_mm512_load_si512(&C[2][i][0]), 4));
            S = _mm512_add_epi32(S, _mm512_slli_epi32(_mm512_load_si512(&C[3][i][0]), 6));
        }
        _mm512_store_ps(acc[row], ks_steps(KS != 2, _mm512_load_ps(acc[row]), S, M, a.dk[row * nsb + sb], d, dmin));
    }
}

/* The K-quant order (qgemm.c) with the file's integer scales in the weights' bytes (the folded
 * formats, above): for each group of the tile column and each window of up to KSF_ROWS rows, each
 * super-block is built once as B tiles of 64 inputs (ksf_build), and the tile unit sums every part
 * over the whole super-block against A tiles of 64 inputs of the activations rounded per 256, two
 * row tiles and two parts at a time (ksf_tiles). S and the minimums' sum M are the very int32 sums
 * of qtile512.h's K-quant order (integer sums are exact in every order), and ks_steps the same two
 * float steps (ksf_close). A row tile pair's tiles are issued before the pair before it takes its
 * float steps (two sets of sums), and the next super-block is built after the first pair's tiles, so
 * the tile unit and the vector units overlap. */
static ALWAYS AMX_TARGET void amx_ksf_run(const int HI, const int KS, const QW *wt, int t, int r0, int n, const Scratch *s,
                                          const float *bias, const float *rscale, float *y, int64_t ldy, int accumulate) {
    const int NP = KS == 2 ? 4 : 2, SH = HI == 1 ? 3 : 4, K = wt->K, nb = K / 32, nsb = nb / 8, ksb = kvq_ksb(KS);
    const int G = (wt->out + KVQ_NC - 1) / KVQ_NC, g0 = NGMAX * t, ng = G - g0 < NGMAX ? G - g0 : NGMAX;
    const int64_t gq = (int64_t)nb * kvq_qbytes(wt->fmt), gs = kvq_group_scale_bytes(wt->fmt, nb);
    uint8_t B[2][NP][4][1024] __attribute__((aligned(64))); /* [super-block parity][part][pair of blocks][row] */
    int32_t C[2][NP][32][KVQ_NC] __attribute__((aligned(64))); /* [pair parity][part][row][column] */
    float acc[KSF_ROWS][KVQ_NC] __attribute__((aligned(64)));
    T_CFG(&CFG[2]);
    for (int p = r0; p < r0 + n; p += KSF_ROWS) {
        const int np = r0 + n - p < KSF_ROWS ? r0 + n - p : KSF_ROWS, npair = (np + 31) / 32;
        const Rows a = {s->kq + (int64_t)p * K, NULL, NULL, K, nb, s->dk + (int64_t)p * nsb,
                        s->k16 + (int64_t)p * 2 * nb, s->k32 + (int64_t)p * nb}; /* from row p on */
        /* the tile order's copy from row p on, where there is one and p starts a row tile of it */
        const int8_t *kt = s->kt && p % 16 == 0 ? s->kt + (int64_t)p * K : NULL;
        for (int g = g0; g < g0 + ng; g++) {
            const uint8_t *wg = wt->qs + g * gq, *sg = (const uint8_t *)wt->d + g * gs;
            const int c0 = KVQ_NC * g, cols = wt->out - c0 < KVQ_NC ? wt->out - c0 : KVQ_NC;
            for (int r = 0; r < np; r++) _mm512_store_ps(acc[r], _mm512_setzero_ps());
            ksf_build(HI, KS, wg, sg, 0, B[0]);
            for (int sb = 0; sb < nsb; sb++) {
                const uint8_t *sp = sg + (int64_t)sb * ksb;
                KsfPart *Bs = B[sb & 1];
                MEMBAR(Bs); /* the built bytes are in memory before the tiles load them */
                for (int i = 0; i < npair; i++) {
                    const int nr = np - 32 * i < 32 ? np - 32 * i : 32;
                    for (int h = 0; h < NP; h += 2) /* two parts at a time */
                        if (kt) ksf_tiles(1, KS == 2, kt + (int64_t)32 * i * K, K, sb, nr > 16, Bs + h, C[i & 1] + h);
                        else ksf_tiles(0, KS == 2, a.q + (int64_t)32 * i * K, K, sb, nr > 16, Bs + h, C[i & 1] + h);
                    if (i == 0 && sb + 1 < nsb) ksf_build(HI, KS, wg, sp + ksb, sb + 1, B[(sb + 1) & 1]);
                    if (i > 0) ksf_close(SH, KS, 32, 32 * (i - 1), a, sb, sp, C[(i - 1) & 1], acc);
                }
                const int last = npair - 1, nl = np - 32 * last;
                ksf_close(SH, KS, nl, 32 * last, a, sb, sp, C[last & 1], acc);
                MEMBAR(C); /* the sums read before the next super-block's tiles store theirs */
            }
            mm_store(np, cols, acc[0], KVQ_NC, rscale ? rscale + p : NULL, bias ? bias + c0 : NULL,
                     y + (int64_t)p * ldy + c0, ldy, accumulate);
        }
    }
    T_RELEASE();
}

typedef void (*PassFn)(int ng, int np, Rows a, const uint8_t *w, int64_t gq, const void *dv, const void *mv,
                       int64_t gs, float acc[MAXR][NCOL]);
#define PASS_FN(name, NIB, HI, SGN, F16, NS, OFS) \
    static AMX_TARGET void name(int ng, int np, Rows a, const uint8_t *w, int64_t gq, const void *dv, \
                                const void *mv, int64_t gs, float acc[MAXR][NCOL]) { \
        if (ng == 2) \
            amx_pass(NIB, HI, SGN, F16, NS, OFS, 2, np, a, w, gq, dv, mv, gs, acc); \
        else \
            amx_pass(NIB, HI, SGN, F16, NS, OFS, 1, np, a, w, gq, dv, mv, gs, acc); \
    }
/* the formats' parameters as qgemm.c's GROUP_FN lines have them */
PASS_FN(p_q4_f16, 1, 0, 0, 1, 1, 0)
PASS_FN(p_q4_f32, 1, 0, 0, 0, 1, 0)
PASS_FN(p_s8_f16, 0, 0, 1, 1, 1, 0)
PASS_FN(p_s8_f32_16, 0, 0, 1, 0, 2, 0)
PASS_FN(p_u8_f16, 0, 0, 0, 1, 1, 0)
PASS_FN(p_u8_f32, 0, 0, 0, 0, 1, 0)
PASS_FN(p_u8_f32_16, 0, 0, 0, 0, 2, 0)
PASS_FN(p_q5_f16, 1, 1, 0, 1, 1, 0)
PASS_FN(p_q5_f32, 1, 1, 0, 0, 1, 0)
PASS_FN(p_q4o_f16, 1, 0, 0, 1, 1, 8)
PASS_FN(p_q5o_f16, 1, 1, 0, 1, 1, 16)
PASS_FN(p_mx4_f16, 2, 0, 0, 1, 1, KVQ_MX4_OFS)
/* NULL: the K-quants' products go by amx_ksf_run */
static const PassFn PASSES[KVQ_NFMT] = {p_q4_f16, p_q4_f32, p_s8_f16, p_s8_f32_16, p_u8_f16, p_u8_f32, p_u8_f32_16,
                                        p_q5_f16, p_q5_f32, p_q4o_f16, p_q5o_f16, NULL, NULL, NULL, NULL,
                                        p_mx4_f16};
static const char *const FMT_NAMES[KVQ_NFMT] = {"q4_f16", "q4_f32", "s8_f16", "s8_f32_16", "u8_f16",
                                                "u8_f32", "u8_f32_16", "q5_f16", "q5_f32", "q4o_f16",
                                                "q5o_f16", "q4_ks", "q5_ks", "q6_ks", "q2_ks", "mx4_f16"};

/* Rows r0 .. r0 + n - 1 (n a multiple of 16) of tile column t: y (+)= products * rscale + bias. */
static __attribute__((noinline)) AMX_TARGET void amx_run(const QW *wt, int t, int r0, int n, const Scratch *s,
                                                         const float *bias, const float *rscale, float *y,
                                                         int64_t ldy, int accumulate) {
    const int fmt = wt->fmt, K = wt->K, nb = K / 32, g = NGMAX * t;
    const int G = (wt->out + KVQ_NC - 1) / KVQ_NC, ng = G - g < NGMAX ? G - g : NGMAX;
    const int64_t gq = (int64_t)nb * kvq_qbytes(fmt), gs = kvq_group_scale_bytes(fmt, nb);
    const uint8_t *w = wt->qs + g * gq;
    const void *dv = (const char *)wt->d + g * gs, *mv = wt->m ? (const char *)wt->m + g * gs : NULL;
    const int c0 = KVQ_NC * g, cols = wt->out - c0 < KVQ_NC * ng ? wt->out - c0 : KVQ_NC * ng;
    switch (fmt) { /* the formats whose integer scales fold into the tiles */
    case KVQ_Q4_KS: amx_ksf_run(0, 1, wt, t, r0, n, s, bias, rscale, y, ldy, accumulate); return;
    case KVQ_Q5_KS: amx_ksf_run(1, 1, wt, t, r0, n, s, bias, rscale, y, ldy, accumulate); return;
    case KVQ_Q6_KS: amx_ksf_run(2, 2, wt, t, r0, n, s, bias, rscale, y, ldy, accumulate); return;
    case KVQ_Q2_KS: amx_ksf_run(0, 3, wt, t, r0, n, s, bias, rscale, y, ldy, accumulate); return;
    default: break;
    }
    float acc[MAXR][NCOL] __attribute__((aligned(64)));
    T_CFG(&CFG[KVQ_NS[fmt] - 1]);
    for (int p = r0; p < r0 + n; p += MAXR) {
        const int np = r0 + n - p < MAXR ? r0 + n - p : MAXR;
        const Rows a = {s->q + (int64_t)p * K, s->da + (int64_t)p * nb, s->sa + (int64_t)p * 3 * nb, K, nb,
                        NULL, NULL, NULL};
        PASSES[fmt](ng, np, a, w, gq, dv, mv, gs, acc);
        mm_store(np, cols, acc[0], NCOL, rscale ? rscale + p : NULL, bias ? bias + c0 : NULL,
                 y + (int64_t)p * ldy + c0, ldy, accumulate);
    }
    T_RELEASE();
}

/* -- the self-check ------------------------------------------------------------------------------ */
static uint32_t rnd(uint64_t *st) {
    *st = *st * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*st >> 33);
}

static uint16_t rnd_half(uint64_t *st) { /* +-2^-6 .. 2^2, now and then zero */
    const uint32_t r = rnd(st);
    if ((r & 15) == 0) return 0;
    return (uint16_t)(((r >> 4) & 1) << 15 | (9 + (r >> 5) % 8) << 10 | (r >> 8 & 0x3ff));
}

static float rnd_float(uint64_t *st) { /* +-2^-7 .. 2^3, now and then zero */
    const uint32_t r = rnd(st), r2 = rnd(st);
    if ((r & 15) == 0) return 0.f;
    const uint32_t bits = ((r >> 4) & 1) << 31 | (120 + (r >> 5) % 11) << 23 | (r2 & 0x7fffff);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

typedef struct { /* one probe: a weight of fmt [out, K], n rows of activations, rows rlo .. rhi - 1 */
    int fmt, out, K, n, rlo, rhi, chunk; /* rows go to mm_group chunk at a time (as mm_proj's chunks) */
    int bias, rscale, accumulate;
} Probe;

/* 1: the tiles gave the reference's bits; 0: they did not, or could not run (why says) */
static int probe(const Probe *p, uint64_t seed, char *why, size_t wn) {
    const int fmt = p->fmt, out = p->out, K = p->K, n = p->n, nb = K / 32, G = (out + KVQ_NC - 1) / KVQ_NC;
    const int64_t ldy = out + 3, qsz = (int64_t)G * nb * kvq_qbytes(fmt), dsz = G * kvq_group_scale_bytes(fmt, nb);
    const int has_m = !KVQ_SIGNED[fmt] && !KVQ_OFFSET[fmt] && !KVQ_KS[fmt];
    uint8_t *qs = malloc(qsz), *d = malloc(dsz), *m = has_m ? malloc(dsz) : NULL;
    float *x = malloc(sizeof(float) * n * K), *bias = malloc(sizeof(float) * out);
    float *y0 = malloc(sizeof(float) * n * ldy), *y1 = malloc(sizeof(float) * n * ldy);
    char *sb = malloc(scratch_bytes(n, K) + 64);
    int ok = 0;
    if (!qs || !d || (has_m && !m) || !x || !bias || !y0 || !y1 || !sb) {
        snprintf(why, wn, "not used: the self-check could not allocate its probes");
        goto done;
    }
    uint64_t st = seed;
    for (int64_t i = 0; i < qsz; i++) qs[i] = (uint8_t)rnd(&st);
    if (KVQ_KS[fmt]) { /* the file's integer scales (and minimums) in their ranges, then fp16 d (and dmin) */
        const int ks = KVQ_KS[fmt], ksb = kvq_ksb(ks), ints = kvq_ks_d(ks);
        for (int64_t sbk = 0; sbk < dsz / ksb; sbk++) {
            uint8_t *s = d + sbk * ksb;
            /* kind 1's packed bytes take any value; kind 3's hold four bits */
            for (int i = 0; i < ints; i++) s[i] = (uint8_t)(ks == 3 ? rnd(&st) & 15 : rnd(&st));
            for (int c = 0; c < (ks == 2 ? 1 : 2) * KVQ_NC; c++) {
                const uint16_t h = (uint16_t)(rnd_half(&st) & 0x7fff);
                memcpy(s + ints + 2 * c, &h, 2);
            }
        }
    } else if (KVQ_F16[fmt]) {
        for (int64_t i = 0; i < dsz / 2; i++) {
            const uint16_t h = rnd_half(&st), hm = rnd_half(&st);
            memcpy(d + 2 * i, &h, 2);
            if (m) memcpy(m + 2 * i, &hm, 2);
        }
    } else {
        for (int64_t i = 0; i < dsz / 4; i++) {
            const float f = rnd_float(&st), fm = rnd_float(&st);
            memcpy(d + 4 * i, &f, 4);
            if (m) memcpy(m + 4 * i, &fm, 4);
        }
    }
    for (int r = 0; r < n; r++)
        for (int k = 0; k < K; k++) {
            float v = (float)((int)(rnd(&st) % 2001) - 1000) * 1e-3f * (float)(1 + r % 5);
            if (r % 7 == 1 && k / 32 == 2) v = 0.f; /* an all-zero block: a step of 0 */
            if (r % 7 == 3 && k == 5) v *= 60.f;   /* an outlier */
            x[(int64_t)r * K + k] = v;
        }
    for (int c = 0; c < out; c++) bias[c] = rnd_float(&st);
    for (int64_t i = 0; i < (int64_t)n * ldy; i++) y0[i] = y1[i] = rnd_float(&st);
    tl_probe = 2; /* the activations in the tile order too (amx_acts), as the tiles would have them */
    const Scratch s = scratch_at((char *)(((uintptr_t)sb + 63) & ~(uintptr_t)63), n, K);
    tl_probe = 0;
    for (int r = 0; r < n; r++) act_row(&s, r, K, x, K, NULL, p->rscale ? 1e-5f : -1.f);
    const QW wt = {fmt, out, K, qs, d, m};
    const int T = (G + NGMAX - 1) / NGMAX;
    int64_t want = 0; /* rows the tiles should take */
    for (int mode = 1; mode <= 2; mode++) {
        tl_probe = mode;
        tl_rows = 0;
        for (int r0 = p->rlo; r0 < p->rhi; r0 += p->chunk) {
            const int r1 = p->rhi - r0 < p->chunk ? p->rhi : r0 + p->chunk;
            if (mode == 1) want += (int64_t)T * ((r1 - r0) & ~15);
            for (int t = 0; t < T; t++)
                mm_group(&wt, t, r0, r1, &s, p->bias ? bias : NULL, p->rscale ? s.inv : NULL, mode == 1 ? y0 : y1,
                         ldy, p->accumulate);
        }
    }
    tl_probe = 0;
    if (tl_rows != want) {
        snprintf(why, wn, "not used: self-check: the tiles took %lld rows of %lld (format %s)", (long long)tl_rows,
                 (long long)want, FMT_NAMES[fmt]);
        goto done;
    }
    ok = 1;
    for (int r = 0; r < n && ok; r++)
        for (int c = 0; c < out; c++) {
            const float *a = y1 + (int64_t)r * ldy + c, *b = y0 + (int64_t)r * ldy + c;
            if (memcmp(a, b, 4)) {
                uint32_t ua, ub;
                memcpy(&ua, a, 4), memcpy(&ub, b, 4);
                snprintf(why, wn,
                         "not used: self-check differed (format %s, out %d, K %d, row %d, col %d: tiles %.9g "
                         "[%08x], %s %.9g [%08x])",
                         FMT_NAMES[fmt], out, K, r, c, (double)*a, ua, kv_q_isa(), (double)*b, ub);
                ok = 0;
                break;
            }
        }
done:
    free(qs), free(d), free(m), free(x), free(bias), free(y0), free(y1), free(sb);
    return ok;
}

/* Every format through three probes: (1) 37 rows in one chunk (a pass of 32, 5 rows over), 40
 * columns (a tile column of two groups and one of a group and a half); (2) rows 3 .. 82 in chunks of
 * 64 with bias, 1 / rms row scales and accumulation, 70 columns over 768 inputs (the folded
 * K-quants' activations by rows: the chunks start off a row tile); (3) 100 rows in one call (three
 * passes, 4 rows over), 23 columns; the folded K-quants (amx_ksf_run) also (4) 310 rows in one call
 * (a window of KSF_ROWS and one of 48: a pair of row tiles and a lone one, 6 rows over), 20 columns,
 * row scales and accumulation. *arg: the probes that agreed, or -1. */
static void *amx_selfcheck(void *arg) {
    int *res = arg, n = 0;
    char why[sizeof(amx_why)];
    for (int fmt = 0; fmt < KVQ_NFMT; fmt++) {
        const Probe ps[4] = {{fmt, 40, 512, 37, 0, 37, RCHUNK, 0, 0, 0},
                             {fmt, 70, 768, 83, 3, 83, RCHUNK, 1, 1, 1},
                             {fmt, 23, 512, 100, 0, 100, 100, 1, 0, 0},
                             {fmt, 20, 256, 310, 0, 310, 310, 0, 1, 1}};
        const int folded = KVQ_KS[fmt] != 0;
        for (int i = 0; i < 3 + folded; i++) {
            if (!probe(&ps[i], 0x9E3779B97F4A7C15ULL * (uint64_t)(3 * fmt + i + 1), why, sizeof(why))) {
                memcpy(amx_why, why, sizeof(amx_why));
                *res = -1;
                return NULL;
            }
            n++;
        }
    }
    *res = n;
    return NULL;
}

#if !defined(KV_AMX_EMULATE)
/* The CPU has the tile instructions and the OS saves their state; why says otherwise. */
static int amx_cpu(char *why, size_t wn) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7) {
        snprintf(why, wn, "not used: CPU lacks amx_tile and amx_int8 (no CPUID leaf 7)");
        return 0;
    }
    __cpuid_count(7, 0, a, b, c, d);
    const int tile = d >> 24 & 1, int8 = d >> 25 & 1;
    if (!tile || !int8) {
        snprintf(why, wn, "not used: CPU lacks %s",
                 !tile && !int8 ? "amx_tile and amx_int8" : !tile ? "amx_tile" : "amx_int8");
        return 0;
    }
    __cpuid(1, a, b, c, d);
    if (!(c >> 27 & 1)) {
        snprintf(why, wn, "not used: the OS has not enabled XSAVE (CPUID OSXSAVE clear)");
        return 0;
    }
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = (uint64_t)hi << 32 | lo, need = 3ULL << 17;
    if ((xcr0 & need) != need) {
        snprintf(why, wn, "not used: the OS does not save tile state (XCR0 %#llx lacks bits 17, 18)",
                 (unsigned long long)xcr0);
        return 0;
    }
    return 1;
}

/* This process may use tile data (Linux asks for it once a process); why says otherwise. */
static int amx_permit(char *why, size_t wn) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        snprintf(why, wn, "not used: the OS refused tile data (arch_prctl ARCH_REQ_XCOMP_PERM: %s)", strerror(errno));
        return 0;
    }
    uint64_t perm = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm) != 0 || !(perm >> XFEATURE_XTILEDATA & 1)) {
        snprintf(why, wn, "not used: the OS refused tile data (arch_prctl ARCH_GET_XCOMP_PERM: %#llx)",
                 (unsigned long long)perm);
        return 0;
    }
    return 1;
#else
    snprintf(why, wn, "not used: tile data permission is asked of Linux only");
    return 0;
#endif
}
#endif
#endif /* AMX_CODE */

static void amx_init(void) {
    const char *env = getenv("KVCACHE_AMX");
    if (env && (!strcmp(env, "0") || !strcmp(env, "off") || !strcmp(env, "false") || !strcmp(env, "no"))) {
        snprintf(amx_why, sizeof(amx_why), "off (KVCACHE_AMX=%s)", env);
        return;
    }
#if !AMX_ISA
    snprintf(amx_why, sizeof(amx_why), "not used: the %s kernels have no AMX path", kv_q_isa());
#elif !AMX_CODE
    snprintf(amx_why, sizeof(amx_why), "not used: this build's compiler has no AMX intrinsics (or NGMAX %d)", NGMAX);
#else
#ifdef KV_AMX_EMULATE
    const char *how = "emulated tiles; ";
#else
    const char *how = "";
    if (!amx_cpu(amx_why, sizeof(amx_why)) || !amx_permit(amx_why, sizeof(amx_why))) return;
#endif
    /* on a thread of its own: its thread-local buffers are nobody's, and nothing waits on the caller's */
    int res = -1;
    pthread_t th;
    snprintf(amx_why, sizeof(amx_why), "not used: the self-check's thread could not start");
    if (pthread_create(&th, NULL, amx_selfcheck, &res) != 0) return;
    pthread_join(th, NULL);
    if (res < 0) return; /* amx_why says why */
    amx_cores = physical_cores();
    snprintf(amx_why, sizeof(amx_why),
             "used (%sself-check passed: %d probes bit-identical to %s) by calls of at most %d threads, one a core",
             how, res, kv_q_isa(), amx_cores);
    amx_on = 1;
#endif
}

static int amx_group(const QW *wt, int t, int r0, int r1, const Scratch *s, const float *bias, const float *rscale,
                     float *y, int64_t ldy, int accumulate) {
#if AMX_CODE
    const int n = (r1 - r0) & ~15;
    if (n < 16 || tl_probe == 1) return 0;
    if (tl_probe != 2) {
        pthread_once(&amx_once, amx_init);
        if (!amx_on || omp_get_num_threads() > amx_cores) return 0;
    }
    amx_run(wt, t, r0, n, s, bias, rscale, y, ldy, accumulate);
    tl_rows += n;
    return n;
#else
    (void)wt, (void)t, (void)r0, (void)r1, (void)s, (void)bias, (void)rscale, (void)y, (void)ldy, (void)accumulate;
    return 0;
#endif
}

#if AMX_CODE
/* mm_group's tile path, from the moment the library is loaded (amx_group decides per call) */
/* Scratch's kt for the products of n rows: where the tiles would take them (the self-check's tile
 * side; or, its checks run, whenever AMX is used: n >= 16 rows go to amx_group, which declines only
 * calls from more threads than cores, and then the copy is unused) */
static int amx_acts(int n) {
    if (n < 16 || tl_probe == 1) return 0;
    if (tl_probe == 2) return 1;
    pthread_once(&amx_once, amx_init);
    return amx_on;
}

__attribute__((constructor)) static void amx_register(void) {
    mm_tiles = amx_group;
    mm_tile_acts = amx_acts;
}
#endif

/* Whether the quantized products use AMX tiles in this process, and why: a line starting with
 * "used" when they do (the first call runs the checks). */
const char *kv_amx_status(void) {
    pthread_once(&amx_once, amx_init);
    return amx_why;
}
