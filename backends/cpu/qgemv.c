/* Fused dequantize-and-multiply for few rows (decode and verify): y[m, n] = sum_k W[n, k] * x[m, k].
 *
 * Each block of W is dequantized exactly as the reference does (ops/quants/<type>.py: the same float
 * products, no fused multiply-add) into a small buffer and used at once by every row (F32 blocks are read
 * in place), so W is read once per call and never materialized; every cache line of the weight stream is
 * prefetched AHEAD bytes ahead. Each output is accumulated in 16 lanes (element k goes to lane k % 16,
 * two 8-float vectors) over the whole row, then the lanes are added in order: the same arithmetic for any
 * number of rows and any split of the output rows across threads, hence batch-invariant. `dequantize`
 * expands whole rows with the same block functions (prefill's tiles). On AVX-512 targets the grouped kernels
 * (further down) serve Q8_0, Q4_K, Q2_K, IQ2_XXS, Q3_K-Q6_K, IQ4_XS, the 32-value types (Q4_0-Q5_1, IQ4_NL, MXFP4;
 * rows of K % 128 == 0), IQ2_XS, IQ3_XXS and TQ2_0 instead. A new block type plugs in as a deq_<type>
 * function (block -> floats) and a case in `qgemv` and `dequantize`. Built by backends/cpu/kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "zen.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "lanes.h"
#endif

#define LANES 16
#define MAX_ROWS 16
#define AHEAD 2048      /* bytes of the weight stream prefetched ahead */

static float bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static __attribute__((noinline)) float rare_half_to_float(uint32_t h) {    /* zero, subnormal, inf, NaN */
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
    if (mant == 0) return bits_to_float(sign);
    exp = 127 - 15 + 1;                                                      /* subnormal: normalise */
    while (!(mant & 0x400)) { mant <<= 1; exp--; }
    return bits_to_float(sign | (exp << 23) | ((mant & 0x3ff) << 13));
}

/* Exact F16 -> F32 (inlined: one call per block would cost more than the block's arithmetic). */
static inline __attribute__((always_inline)) float half_to_float(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8), exp = (h >> 10) & 0x1f;
    if (__builtin_expect(exp == 0 || exp == 31, 0)) return rare_half_to_float(h);
    return bits_to_float(((h & 0x8000u) << 16) | ((exp + 127 - 15) << 23) | ((h & 0x3ff) << 13));
}

typedef float v8 __attribute__((vector_size(32)));    /* 8 floats: lanes 0-7 or 8-15 of an accumulator */
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }

#if defined(__AVX2__)
static inline i32x8 widen(const uint8_t *p) {     /* 8 bytes as int32 lanes (gcc scalarizes the generic form) */
    return (i32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#else
static inline i32x8 widen(const uint8_t *p) {     /* 8 bytes as int32 lanes */
    u8x8 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, i32x8);
}
#endif

static inline v8 to_float(i32x8 q) { return __builtin_convertvector(q, v8); }

static inline v8 sfloat8(const uint8_t *p) {      /* 8 int8 as floats (the sign applied in int32 lanes) */
    return __builtin_convertvector((widen(p) ^ 128) - 128, v8);
}

static inline void deq_f16(const uint8_t *b, float *w) {            /* 64 bytes -> 32 values (exact) */
#if defined(__F16C__)
    for (int i = 0; i < 32; i += 8) store8(w + i, (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 2 * i))));
#else
    for (int i = 0; i < 32; i++) w[i] = half_to_float(b + 2 * i);
#endif
}

static inline void deq_q8_0(const uint8_t *b, float *w) {          /* 34 bytes -> 32 values */
    float d = half_to_float(b);
    for (int i = 0; i < 32; i++) w[i] = (float)(int8_t)b[2 + i] * d;
}

/* The eight 6-bit (scale, min) pairs of a Q4_K or Q5_K block, times its d and dmin. */
static inline void k_scales(const uint8_t *b, float *scale, float *low) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *s = b + 4;
    for (int j = 0; j < 4; j++) {
        scale[j] = d * (float)(s[j] & 63);
        low[j] = dmin * (float)(s[4 + j] & 63);
        scale[4 + j] = d * (float)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        low[4 + j] = dmin * (float)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
}

static inline void deq_q4_k(const uint8_t *b, float *w) {          /* 144 bytes -> 256 values */
    const uint8_t *qs = b + 16;
    float scale[8], low[8];
    k_scales(b, scale, low);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l += 8) {
            i32x8 q = widen(qs + 32 * c + l);
            store8(w + 64 * c + l, splat(scale[2 * c]) * to_float(q & 15) - splat(low[2 * c]));
            store8(w + 64 * c + 32 + l, splat(scale[2 * c + 1]) * to_float(q >> 4) - splat(low[2 * c + 1]));
        }
}

static inline void deq_q2_k(const uint8_t *b, float *w) {          /* 84 bytes -> 256 values */
    float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    const uint8_t *s = b, *qs = b + 16;
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 4; i++)
            for (int h = 0; h < 2; h++) {                   /* elements 128k + 32i + 16h + (0..15) */
                int j = 8 * k + 2 * i + h;
                v8 scale = splat(d * (float)(s[j] & 15)), low = splat(dmin * (float)(s[j] >> 4));
                const uint8_t *q = qs + 32 * k + 16 * h;
                float *out = w + 128 * k + 32 * i + 16 * h;
                for (int l = 0; l < 16; l += 8) store8(out + l, scale * to_float((widen(q + l) >> (2 * i)) & 3) - low);
            }
}

static inline void deq_q6_k(const uint8_t *b, float *w) {          /* 210 bytes -> 256 values */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_to_float(b + 208);
    for (int c = 0; c < 2; c++)
        for (int s = 0; s < 4; s++)                         /* elements 128c + 32s + (0..31) */
            for (int l = 0; l < 32; l += 8) {
                i32x8 lo = (widen(ql + 64 * c + 32 * (s & 1) + l) >> (4 * (s >> 1))) & 15;
                i32x8 hi = (widen(qh + 32 * c + l) >> (2 * s)) & 3;
                v8 scale = splat(d * (float)sc[8 * c + 2 * s + l / 16]);
                store8(w + 128 * c + 32 * s + l, scale * to_float((lo | (hi << 4)) - 32));
            }
}

static inline void deq_q5_k(const uint8_t *b, float *w) {          /* 176 bytes -> 256 values */
    const uint8_t *qh = b + 16, *qs = b + 48;
    float scale[8], low[8];
    k_scales(b, scale, low);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l += 8) {
            i32x8 q = widen(qs + 32 * c + l), h = widen(qh + l);
            i32x8 q0 = (q & 15) | (((h >> (2 * c)) & 1) << 4), q1 = (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4);
            store8(w + 64 * c + l, splat(scale[2 * c]) * to_float(q0) - splat(low[2 * c]));
            store8(w + 64 * c + 32 + l, splat(scale[2 * c + 1]) * to_float(q1) - splat(low[2 * c + 1]));
        }
}

static inline void deq_q3_k(const uint8_t *b, float *w) {          /* 110 bytes -> 256 values */
    float d = half_to_float(b + 108);
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    for (int e = 0; e < 256; e += 8) {
        int j = e / 16;                                     /* the 6-bit scale of sub-block j, minus 32 */
        int s = ((sc[j % 8] >> (4 * (j / 8))) & 15) | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
        i32x8 ql = (widen(qs + 32 * (e / 128) + e % 32) >> (2 * ((e % 128) / 32))) & 3;
        i32x8 h = (widen(hmask + e % 32) >> (e / 32)) & 1;
        store8(w + e, splat(d * (float)(s - 32)) * to_float(ql - 4 * (1 - h)));
    }
}

static inline void deq_q4_0(const uint8_t *b, float *w) {          /* 18 bytes -> 32 values */
    v8 d = splat(half_to_float(b));
    for (int l = 0; l < 16; l += 8) {                       /* byte l: element l low, l + 16 high */
        i32x8 q = widen(b + 2 + l);
        store8(w + l, d * to_float((q & 15) - 8));
        store8(w + 16 + l, d * to_float((q >> 4) - 8));
    }
}

static inline void deq_q4_1(const uint8_t *b, float *w) {          /* 20 bytes -> 32 values */
    v8 d = splat(half_to_float(b)), m = splat(half_to_float(b + 2));
    for (int l = 0; l < 16; l += 8) {
        i32x8 q = widen(b + 4 + l);
        store8(w + l, d * to_float(q & 15) + m);
        store8(w + 16 + l, d * to_float(q >> 4) + m);
    }
}

static inline i32x8 q5_high(const uint8_t *qh, int j) {    /* bits j..j+7 (j % 8 == 0) of `qh`, as 0/16 lanes */
    i32x8 byte = (i32x8){0} + qh[j / 8];
    return ((byte >> (i32x8){0, 1, 2, 3, 4, 5, 6, 7}) & 1) << 4;
}

static inline void deq_q5_0(const uint8_t *b, float *w) {          /* 22 bytes -> 32 values */
    v8 d = splat(half_to_float(b));
    for (int l = 0; l < 16; l += 8) {
        i32x8 q = widen(b + 6 + l);
        store8(w + l, d * to_float(((q & 15) | q5_high(b + 2, l)) - 16));
        store8(w + 16 + l, d * to_float(((q >> 4) | q5_high(b + 2, 16 + l)) - 16));
    }
}

static inline void deq_q5_1(const uint8_t *b, float *w) {          /* 24 bytes -> 32 values */
    v8 d = splat(half_to_float(b)), m = splat(half_to_float(b + 2));
    for (int l = 0; l < 16; l += 8) {
        i32x8 q = widen(b + 8 + l);
        store8(w + l, d * to_float((q & 15) | q5_high(b + 4, l)) + m);
        store8(w + 16 + l, d * to_float((q >> 4) | q5_high(b + 4, 16 + l)) + m);
    }
}

static const float iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline void deq_iq4_nl(const uint8_t *b, float *w) {        /* 18 bytes -> 32 values */
    float d = half_to_float(b);
    for (int l = 0; l < 16; l++) {
        w[l] = d * iq4_levels[b[2 + l] & 15];
        w[16 + l] = d * iq4_levels[b[2 + l] >> 4];
    }
}

static inline void deq_iq4_xs(const uint8_t *b, float *w) {        /* 136 bytes -> 256 values */
    float d = half_to_float(b);
    uint32_t high = (uint32_t)b[2] | ((uint32_t)b[3] << 8);
    for (int j = 0; j < 8; j++) {                           /* sub-block j: 16 bytes, low nibbles first */
        int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
        float scale = d * (float)(ls - 32);
        const uint8_t *qs = b + 8 + 16 * j;
        for (int l = 0; l < 16; l++) {
            w[32 * j + l] = scale * iq4_levels[qs[l] & 15];
            w[32 * j + 16 + l] = scale * iq4_levels[qs[l] >> 4];
        }
    }
}

float iq2_grid[256][8];          /* set by qgemv_set_iq2_xxs from ops/quants/iq2_xxs.py's tables (iq2exact.c too) */
uint8_t iq2_ksigns[128];
static uint32_t iq2_sign_mask[128][8];      /* the float sign bit of each of the 8 values ksigns[i] flips */

void qgemv_set_iq2_xxs(const float *grid, const int64_t *ksigns) {
    memcpy(iq2_grid, grid, sizeof(iq2_grid));
    for (int i = 0; i < 128; i++) iq2_ksigns[i] = (uint8_t)ksigns[i];
    for (int i = 0; i < 128; i++)
        for (int j = 0; j < 8; j++) iq2_sign_mask[i][j] = ((ksigns[i] >> j) & 1) ? 0x80000000u : 0;
}

static inline void deq_iq2_xxs(const uint8_t *b, float *w) {    /* 66 bytes -> 256 values */
    float d = half_to_float(b);
    for (int g = 0; g < 8; g++) {
        const uint8_t *p = b + 2 + 8 * g;
        uint32_t bits = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        float db = d * (0.5f + (float)(bits >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++) {
            i32x8 signs = (i32x8){0} + iq2_ksigns[(bits >> (7 * l)) & 127];
            v8 sign = __builtin_convertvector(1 - 2 * ((signs >> (i32x8){0, 1, 2, 3, 4, 5, 6, 7}) & 1), v8);
            store8(w + 32 * g + 8 * l, splat(db) * load8(iq2_grid[p[l]]) * sign);
        }
    }
}

/* The other IQ codebooks, each handed over by its qgemv_set_<type> from ops/quants/<type>.py's grid (every grid
 * value a small integer, kept as a byte: the tables stay in L1), and the ±1 factors of the sign patterns
 * (qgemv_set_iq_signs). The block functions below multiply in the reference's order: (scale * grid) * sign. */
static uint8_t iq3_xxs_grid[256][4], iq3_s_grid[512][4], iq2_xs_grid[512][8], iq2_s_grid[1024][8];
static int8_t iq1_grid[2048][8];
static float ksign_values[128][8];      /* the 8 factors of ksigns[i] (IQ2_XXS's even-parity patterns) */
static float byte_sign_values[256][8];  /* factor j of byte i: -1 where bit j is set */

static int codebook_bytes(const float *grid, uint8_t *out, int count, int lowest) {   /* -1 (table unchanged): */
    for (int i = 0; i < count; i++)                                                     /* a value not a byte */
        if (!(grid[i] >= (float)lowest && grid[i] <= (float)(lowest + 255)) || grid[i] != (float)(int)grid[i]) return -1;
    for (int i = 0; i < count; i++) out[i] = (uint8_t)(int)grid[i];
    return 0;
}

static float iq3_xxs_grid_floats[256][4];   /* the same grid as floats (dot_iq3_xxs: one 4-float load per point) */

int qgemv_set_iq3_xxs(const float *grid) {
    if (codebook_bytes(grid, &iq3_xxs_grid[0][0], 256 * 4, 0)) return -1;
    memcpy(iq3_xxs_grid_floats, grid, sizeof(iq3_xxs_grid_floats));
    return 0;
}

int qgemv_set_iq3_s(const float *grid) { return codebook_bytes(grid, &iq3_s_grid[0][0], 512 * 4, 0); }
static float iq2_xs_grid_floats[512][8];    /* the same grid as floats (dot_iq2_xs: one 8-float load per chunk) */

int qgemv_set_iq2_xs(const float *grid) {
    if (codebook_bytes(grid, &iq2_xs_grid[0][0], 512 * 8, 0)) return -1;
    memcpy(iq2_xs_grid_floats, grid, sizeof(iq2_xs_grid_floats));
    return 0;
}
int qgemv_set_iq2_s(const float *grid) { return codebook_bytes(grid, &iq2_s_grid[0][0], 1024 * 8, 0); }
int qgemv_set_iq1_s(const float *grid) { return codebook_bytes(grid, (uint8_t *)&iq1_grid[0][0], 2048 * 8, -128); }

void qgemv_set_iq_signs(const int64_t *ksigns) {
    for (int i = 0; i < 256; i++)
        for (int j = 0; j < 8; j++) {
            if (i < 128) ksign_values[i][j] = ((ksigns[i] >> j) & 1) ? -1.0f : 1.0f;
            byte_sign_values[i][j] = ((i >> j) & 1) ? -1.0f : 1.0f;
        }
}

static inline v8 grid_pair(const uint8_t *a, const uint8_t *b) {     /* two 4-value grid points as 8 floats */
    uint8_t v[8];
    memcpy(v, a, 4);
    memcpy(v + 4, b, 4);
    return to_float(widen(v));
}

static inline void deq_iq3_xxs(const uint8_t *b, float *w) {   /* 98 bytes -> 256 values */
    float d = half_to_float(b);
    const uint8_t *qs = b + 2, *aux = b + 66;
    for (int s = 0; s < 8; s++) {                           /* sub-block s: 8 grid points, 4 sign patterns */
        const uint8_t *a = aux + 4 * s;
        uint32_t bits = (uint32_t)a[0] | ((uint32_t)a[1] << 8) | ((uint32_t)a[2] << 16) | ((uint32_t)a[3] << 24);
        v8 db = splat(d * (0.5f + (float)(bits >> 28)) * 0.5f);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            v8 g = grid_pair(iq3_xxs_grid[qs[8 * s + 2 * k]], iq3_xxs_grid[qs[8 * s + 2 * k + 1]]);
            store8(w + 32 * s + 8 * k, db * g * load8(ksign_values[(bits >> (7 * k)) & 127]));
        }
    }
}

static inline void deq_iq3_s(const uint8_t *b, float *w) {     /* 110 bytes -> 256 values */
    float d = half_to_float(b);
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    for (int s = 0; s < 8; s++) {
        v8 db = splat(d * (float)(1 + 2 * ((scales[s / 2] >> (4 * (s % 2))) & 15)));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {                       /* values 32s + 8k + (0..7): chunks c and c + 1 */
            int c = 8 * s + 2 * k;
            v8 g = grid_pair(iq3_s_grid[qs[c] | (((qh[s] >> (2 * k)) & 1) << 8)],
                             iq3_s_grid[qs[c + 1] | (((qh[s] >> (2 * k + 1)) & 1) << 8)]);
            store8(w + 32 * s + 8 * k, db * g * load8(byte_sign_values[signs[4 * s + k]]));
        }
    }
}

/* The 16 sub-block scales d*(0.5 + ls)/4 of IQ2_XS/IQ2_S: sub-block 2i in even[i] (low nibble of scales[i]),
 * 2i + 1 in odd[i] (high nibble). */
static inline void iq2_sub_scales(float d, const uint8_t *scales, float *even, float *odd) {
    i32x8 ls = widen(scales);
    store8(even, splat(d) * (splat(0.5f) + to_float(ls & 15)) * splat(0.25f));
    store8(odd, splat(d) * (splat(0.5f) + to_float(ls >> 4)) * splat(0.25f));
}

static inline void deq_iq2_xs(const uint8_t *b, float *w) {    /* 74 bytes -> 256 values */
    float even[8], odd[8];
    iq2_sub_scales(half_to_float(b), b + 66, even, odd);
    for (int i = 0; i < 8; i++) {                           /* chunks 4i..4i+3 (8 values each): sub-blocks 2i, 2i+1 */
        v8 db[2] = {splat(even[i]), splat(odd[i])};
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            int c = 4 * i + p;
            uint32_t q = (uint32_t)b[2 + 2 * c] | ((uint32_t)b[3 + 2 * c] << 8);
            store8(w + 8 * c, db[p / 2] * to_float(widen(iq2_xs_grid[q & 511])) * load8(ksign_values[q >> 9]));
        }
    }
}

static inline void deq_iq2_s(const uint8_t *b, float *w) {     /* 82 bytes -> 256 values */
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66;
    float even[8], odd[8];
    iq2_sub_scales(half_to_float(b), b + 74, even, odd);
    for (int i = 0; i < 8; i++) {                           /* chunks 4i..4i+3: sub-blocks 2i, 2i+1, high bits qh[i] */
        v8 db[2] = {splat(even[i]), splat(odd[i])};
        uint32_t high = qh[i];
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            int c = 4 * i + p;
            const uint8_t *g = iq2_s_grid[qs[c] | (((high >> (2 * p)) & 3) << 8)];
            store8(w + 8 * c, db[p / 2] * to_float(widen(g)) * load8(byte_sign_values[signs[c]]));
        }
    }
}

static const float iq1_delta[2] = {0.125f, -0.125f};     /* indexed by the delta's sign bit */

static inline void deq_iq1_s(const uint8_t *b, float *w) {     /* 50 bytes -> 256 values */
    float d = half_to_float(b);
    for (int s = 0; s < 8; s++) {
        uint32_t qh = (uint32_t)b[34 + 2 * s] | ((uint32_t)b[35 + 2 * s] << 8);
        v8 dl = splat(d * (float)(2 * ((qh >> 12) & 7) + 1)), delta = splat(iq1_delta[qh >> 15]);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int8_t *g = iq1_grid[b[2 + 4 * s + k] | (((qh >> (3 * k)) & 7) << 8)];
            store8(w + 32 * s + 8 * k, dl * (sfloat8((const uint8_t *)g) + delta));
        }
    }
}

static inline void deq_iq1_m(const uint8_t *b, float *w) {     /* 56 bytes -> 256 values */
    const uint8_t *qs = b, *qh = b + 32;
    uint32_t sc[4];
    for (int i = 0; i < 4; i++) sc[i] = (uint32_t)b[48 + 2 * i] | ((uint32_t)b[49 + 2 * i] << 8);
    const uint8_t d_bytes[2] = {(uint8_t)((sc[0] >> 12) | ((sc[1] >> 12) << 4)),
                                (uint8_t)((sc[2] >> 12) | ((sc[3] >> 12) << 4))};
    float d = half_to_float(d_bytes);                       /* the f16 spread over the scales' top nibbles */
    for (int j = 0; j < 16; j++) {                          /* sub-block j: 16 values, chunks 2j and 2j + 1 */
        v8 dl = splat(d * (float)(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            int nibble = (qh[j] >> (4 * h)) & 15;
            const int8_t *g = iq1_grid[qs[2 * j + h] | ((nibble & 7) << 8)];
            store8(w + 16 * j + 8 * h, dl * (sfloat8((const uint8_t *)g) + splat(iq1_delta[nibble >> 3])));
        }
    }
}

static inline i32x8 trit(i32x8 bytes, int pow3) { return ((((bytes * pow3) & 255) * 3) >> 8) - 1; }

static inline void deq_tq1_0(const uint8_t *b, float *w) {     /* 54 bytes -> 256 values */
    static const int pow3[5] = {1, 3, 9, 27, 81};
    float d = half_to_float(b + 52);
    for (int p = 0; p < 5; p++) {                           /* digit p of qs[0..31] and of qs[32..47] */
        for (int l = 0; l < 32; l += 8) store8(w + 32 * p + l, splat(d) * to_float(trit(widen(b + l), pow3[p])));
        for (int l = 0; l < 16; l += 8) store8(w + 160 + 16 * p + l, splat(d) * to_float(trit(widen(b + 32 + l), pow3[p])));
    }
    for (int p = 0; p < 4; p++)                             /* digit p of qh[0..3] */
        for (int l = 0; l < 4; l++) w[240 + 4 * p + l] = d * (float)(((((b[48 + l] * pow3[p]) & 255) * 3) >> 8) - 1);
}

static inline void deq_tq2_0(const uint8_t *b, float *w) {     /* 66 bytes -> 256 values */
    v8 d = splat(half_to_float(b + 64));
    for (int c = 0; c < 2; c++)
        for (int s = 0; s < 4; s++)                         /* elements 128c + 32s + l: bits 2s of qs[32c + l] */
            for (int l = 0; l < 32; l += 8) store8(w + 128 * c + 32 * s + l, d * to_float(((widen(b + 32 * c + l) >> (2 * s)) & 3) - 1));
}

static const float mxfp4_twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  /* 2 * E2M1 */

static inline void deq_mxfp4(const uint8_t *b, float *w) {     /* 17 bytes -> 32 values */
    uint32_t e = b[0];
    float half_scale = bits_to_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);    /* 2**(e - 128), exact */
#if defined(__AVX2__)
    __m256 lo = _mm256_loadu_ps(mxfp4_twice), hi = _mm256_loadu_ps(mxfp4_twice + 8);
    for (int l = 0; l < 16; l += 8) {                       /* byte l: element l low nibble, l + 16 high */
        i32x8 q = widen(b + 1 + l);
        for (int h = 0; h < 2; h++) {
            __m256i code = (__m256i)(h ? q >> 4 : q & 15);
            __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, code), _mm256_permutevar8x32_ps(hi, code),
                                        (__m256)(h ? q << 24 : q << 28));     /* code bit 3 into the sign bit */
            store8(w + 16 * h + l, splat(half_scale) * (v8)v);
        }
    }
#else
    for (int l = 0; l < 16; l++) {
        w[l] = half_scale * mxfp4_twice[b[1 + l] & 15];
        w[16 + l] = half_scale * mxfp4_twice[b[1 + l] >> 4];
    }
#endif
}

typedef uint16_t u16x8 __attribute__((vector_size(16)));

static inline void deq_bf16(const uint8_t *b, float *w) {      /* 64 bytes -> 32 values (exact: the top 16 bits) */
    for (int i = 0; i < 32; i += 8) {
        u16x8 h;
        memcpy(&h, b + 2 * i, sizeof h);
        store8(w + i, (v8)(__builtin_convertvector(h, i32x8) << 16));
    }
}

typedef void (*deq_fn)(const uint8_t *, float *);

/* Lanes (lo, hi) += w[i] * x[i] for the bs values of one block, element i in lane i % 16. */
static inline __attribute__((always_inline)) void dot_block(v8 *lo, v8 *hi, const float *w, const float *x, int bs) {
    for (int i = 0; i < bs; i += LANES) {
        *lo += load8(w + i) * load8(x + i);
        *hi += load8(w + i + 8) * load8(x + i + 8);
    }
}

static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *blk, int bb) {
    for (int off = 0; off < bb; off += 64) __builtin_prefetch(blk + off + AHEAD);    /* every cache line */
}

static inline float lane_sum(v8 lo, v8 hi) {                  /* the 16 lanes added in order */
    float s = 0.0f;
    for (int l = 0; l < 8; l++) s += lo[l];
    for (int l = 0; l < 8; l++) s += hi[l];
    return s;
}

/* R rows r[0..R) of nb blocks (bs values in bb bytes) against one row x, block by block in turn (R = 4: four
 * streams of the weight fetched at once, as own_rows4), each row's lanes in registers and its blocks added in
 * order: the same bits for any R. */
static inline __attribute__((always_inline)) void rows_in_turn(deq_fn deq, const int bs, const int bb, const int R,
        const uint8_t *const *r, int64_t nb, const float *x, float *out) {
    float wblk[256];
    v8 lo[4] = {{0}}, hi[4] = {{0}};
    for (int64_t b = 0; b < nb; b++)
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = r[i] + b * bb;
            prefetch_block(blk, bb);
            if (deq != NULL) deq(blk, wblk);
            dot_block(&lo[i], &hi[i], deq == NULL ? (const float *)blk : wblk, x + b * bs, bs);
        }
    for (int i = 0; i < R; i++) out[i] = lane_sum(lo[i], hi[i]);
}

/* Output rows [n0, n1) of y [M, N] for one block type (inlined per type, so the dequantization is too);
 * deq == NULL: F32, read in place. */
static inline __attribute__((always_inline)) void rows_of(
        deq_fn deq, const int bs, const int bb, const uint8_t *w, int64_t expert_bytes, const int64_t *experts,
        int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / bs, row_bytes = nb * bb;
    float wblk[256];
    if (experts != NULL || M == 1) {    /* a weight of its own per row, lanes in registers */
        /* four streams (rows n, n + q, n + 2q, n + 3q, as own_rows4) for the types measured faster so (the ones
         * bound by the fetch: docs/cpu.md), one row after another for the rest (bound by their dequantization;
         * IQ4_NL 1.13x slower in fours) */
        const int four = deq == NULL || deq == deq_f16 || deq == deq_bf16 || deq == deq_q4_0 || deq == deq_q4_1 ||
                         deq == deq_q5_0;
        int64_t q = four ? (n1 - n0) / 4 : 0;
        for (int64_t m = 0; m < M; m++) {
            float *ym = y + m * N;
            if (experts != NULL && experts[m] < 0) {        /* another rank's */
                for (int64_t n = n0; n < n1; n++) ym[n] = 0.0f;
                continue;
            }
            const uint8_t *base = w + (experts == NULL ? 0 : experts[m] * expert_bytes);
            for (int64_t n = n0; n < n0 + q; n++) {
                const uint8_t *r[4] = {base + n * row_bytes, base + (n + q) * row_bytes, base + (n + 2 * q) * row_bytes,
                                       base + (n + 3 * q) * row_bytes};
                float out[4];
                rows_in_turn(deq, bs, bb, 4, r, nb, x + m * K, out);
                for (int i = 0; i < 4; i++) ym[n + i * q] = out[i];
            }
            for (int64_t n = n0 + 4 * q; n < n1; n++) {     /* the last (n1 - n0) % 4 rows (every row: one stream) */
                const uint8_t *row = base + n * row_bytes;
                rows_in_turn(deq, bs, bb, 1, &row, nb, x + m * K, ym + n);
            }
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) { /* one weight for every row: each block dequantized once */
        v8 lo[MAX_ROWS], hi[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) lo[m] = hi[m] = (v8){0};
        const uint8_t *row = w + n * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            prefetch_block(blk, bb);
            if (deq != NULL) deq(blk, wblk);
            const float *wb = deq == NULL ? (const float *)blk : wblk;
            for (int64_t m = 0; m < M; m++) dot_block(&lo[m], &hi[m], wb, x + m * K + b * bs, bs);
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = lane_sum(lo[m], hi[m]);
    }
}

/* One Q8_0 block's 32 products added to the lanes: the same sums as deq_q8_0 then dot_block. */
static inline __attribute__((always_inline)) void q8_0_dot(v8 *lo, v8 *hi, const uint8_t *blk, const float *x) {
    v8 d = splat(half_to_float(blk));
    *lo += (sfloat8(blk + 2) * d) * load8(x);
    *hi += (sfloat8(blk + 10) * d) * load8(x + 8);
    *lo += (sfloat8(blk + 18) * d) * load8(x + 16);
    *hi += (sfloat8(blk + 26) * d) * load8(x + 24);
}

#if defined(__AVX__)
/* lane_sum of four rows at once (the same bits): the rows' lanes transposed within 128-bit halves (t_j: lane j of
 * rows 0-3, then lane 4 + j), then added in lane_sum's order, four rows per add. */
static inline void lane_sum4(const v8 *lo, const v8 *hi, float *out) {
    __m128 s = _mm_setzero_ps();
    for (int h = 0; h < 2; h++) {
        const v8 *v = h ? hi : lo;
        __m256 a0 = _mm256_unpacklo_ps((__m256)v[0], (__m256)v[1]), a1 = _mm256_unpackhi_ps((__m256)v[0], (__m256)v[1]);
        __m256 a2 = _mm256_unpacklo_ps((__m256)v[2], (__m256)v[3]), a3 = _mm256_unpackhi_ps((__m256)v[2], (__m256)v[3]);
        __m256 t[4] = {_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a0), _mm256_castps_pd(a2))),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a0), _mm256_castps_pd(a2))),
                       _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a1), _mm256_castps_pd(a3))),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a1), _mm256_castps_pd(a3)))};
        for (int j = 0; j < 4; j++) s = _mm_add_ps(s, _mm256_castps256_ps128(t[j]));
        for (int j = 0; j < 4; j++) s = _mm_add_ps(s, _mm256_extractf128_ps(t[j], 1));
    }
    _mm_storeu_ps(out, s);
}
#define Q8_0_ROWS 4
#else
static inline void lane_sum4(const v8 *lo, const v8 *hi, float *out) {
    for (int i = 0; i < 4; i++) out[i] = lane_sum(lo[i], hi[i]);
}
#define Q8_0_ROWS 2
#endif

/* Q8_0 decode (M == 1) rows [n0, n1) four at a time (two without AVX), dequantized in registers: the rows' lanes
 * are independent chains, their lane sums taken together (lane_sum4; K = 64, the 89M model's q_b and output_b, was
 * bound by the per-row lane sums). Returns the first row not done (the last ones, left to rows_of). */
static int64_t q8_0_rows(const uint8_t *w, int64_t K, const float *x, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / 32, row_bytes = nb * 34, n = n0;
    for (; n + Q8_0_ROWS <= n1; n += Q8_0_ROWS) {
        v8 lo[4] = {{0}}, hi[4] = {{0}};
        const uint8_t *r = w + n * row_bytes;
#if defined(__AVX512F__)
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t b = 0; b < nb; b++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {     /* lanes 0-7 lo's, 8-15 hi's: q8_0_dot's sums, 16 at a time */
                const uint8_t *blk = r + i * row_bytes + b * 34;
                prefetch_block(blk, 34);
                __m512 d = _mm512_set1_ps(half_to_float(blk));
                for (int h = 0; h < 2; h++) {
                    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h))));
                    acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(q, d), _mm512_loadu_ps(x + b * 32 + 16 * h)));
                }
            }
        for (int i = 0; i < 4; i++) {
            lo[i] = (v8)_mm512_castps512_ps256(acc[i]);
            hi[i] = (v8)_mm512_extractf32x8_ps(acc[i], 1);
        }
#else
        for (int64_t b = 0; b < nb; b++)
#pragma GCC unroll 4
            for (int i = 0; i < Q8_0_ROWS; i++) {
                prefetch_block(r + i * row_bytes + b * 34, 34);
                q8_0_dot(&lo[i], &hi[i], r + i * row_bytes + b * 34, x + b * 32);
            }
#endif
        if (Q8_0_ROWS == 4) {
            lane_sum4(lo, hi, y + n);
        } else {
            for (int i = 0; i < Q8_0_ROWS; i++) y[n + i] = lane_sum(lo[i], hi[i]);
        }
    }
    return n;
}

/* The grouped kernels (Q8_0 four blocks at a time, Q4_K, Q2_K, IQ2_XXS, and the types further down; where the target
 * has 16-float vectors, AVX-512: elsewhere gcc splits them badly and rows_of serves these types): a block is unpacked
 * once into its integer values as floats (IQ2_XXS: the signed grid values) and one scale (and min) per group of G
 * values, and each row adds, per group g, scale[g] * (sum of q * x over the group, in 16 lanes) into
 * accumulator g % ACCS (groups counted along the row), and min[g] * (the row's sum of x over group g) into
 * lane g of a min accumulator (fused multiply-adds): sum (a q - b) x = a sum q x - b sum x, regrouped. So a
 * decode row costs one multiply-add per value plus one per group, with no dequantized weight in between.
 * Every output's arithmetic is fixed by its row and its weight alone (not by M, the other rows or the
 * thread split), so it stays batch-invariant; it rounds differently from dequantize-then-multiply (within
 * float32's usual error). */
#if defined(__AVX512F__)
#define GROUPED 1
#else
#define GROUPED 0
#endif
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
#define ACCS 4

typedef struct { v16 part[ACCS], low; } acc_t;

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat16(float f) { return (v16){0} + f; }

#define HALVES(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define LOW(a) __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
#define HIGH(a) __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15)

static inline v16 fma16(v16 a, v16 b, v16 c) {      /* a * b + c, fused where the target has it */
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return HALVES((v8)_mm256_fmadd_ps((__m256)LOW(a), (__m256)LOW(b), (__m256)LOW(c)),
                  (v8)_mm256_fmadd_ps((__m256)HIGH(a), (__m256)HIGH(b), (__m256)HIGH(c)));
#else
    return a * b + c;
#endif
}

static inline i32x16 widen16(const uint8_t *p) {    /* 16 bytes as int32 lanes */
#if defined(__AVX512F__)
    return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return HALVES(widen(p), widen(p + 8));
#endif
}

static inline v16 float16(i32x16 q) { return __builtin_convertvector(q, v16); }

#if defined(__AVX512F__)
/* a times the float at m (broadcast by the multiply's own load, `{1to16}`), and that plus c: on AMD Zen 4 a
 * broadcast into a register (vbroadcastss, or gcc's permute) takes a slot of the two vector pipes that shuffle. */
static inline __attribute__((always_inline)) __m512 mul_broadcast(__m512 a, const float *m) {
    __m512 out;
    __asm__("vmulps %1%{1to16%}, %2, %0" : "=v"(out) : "m"(*m), "v"(a));
    return out;
}

static inline __attribute__((always_inline)) v16 fma_broadcast(v16 a, const float *m, v16 c) {
    __asm__("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(c) : "m"(*m), "v"(a));
    return c;
}
#endif


#if defined(__AVX512F__)
/* Q4_K's eight scales (lanes 0-7, times d) and mins (lanes 8-15, times dmin): k_scales' values, in one vector. The
 * block's first 16 bytes broadcast to each 128-bit lane; one byte shuffle puts in dword lane L the byte with its low
 * bits (a) and, for the scales and mins 4-7, the byte with its top 2 bits (b) at bits 8-15; then (a & 63), or
 * ((a >> sh) & 15) | ((b >> 6) << 4) by one ternary logic op on (v >> sh) and (v >> 10). On AMD Zen the broadcast
 * and the shuffle are one zero-masked vpermb of the 16 bytes (the same lanes; one shuffle fewer). */
static inline __m512 q4_k_scales16(const uint8_t *b) {
    __m128i raw = _mm_loadu_si128((const __m128i *)b);     /* d, dmin, then scale byte s[i] at 4 + i */
#if defined(__AVX512VBMI__) && AMD_ZEN
    const __m512i pick = _mm512_set_epi32(     /* the bytes below; the mask zeroes those marked 0x80 there */
        0x00000b0f, 0x00000a0e, 0x0000090d, 0x0000080c, 0x0000000b, 0x0000000a, 0x00000009, 0x00000008,
        0x0000070f, 0x0000060e, 0x0000050d, 0x0000040c, 0x00000007, 0x00000006, 0x00000005, 0x00000004);
    __m512i v = _mm512_maskz_permutexvar_epi8(0x3333111133331111ull, pick, _mm512_castsi128_si512(raw));
#elif defined(__AVX512BW__)
    const __m512i pick = _mm512_set_epi32(
        0x80800b0f, 0x80800a0e, 0x8080090d, 0x8080080c, 0x8080800b, 0x8080800a, 0x80808009, 0x80808008,
        0x8080070f, 0x8080060e, 0x8080050d, 0x8080040c, 0x80808007, 0x80808006, 0x80808005, 0x80808004);
    __m512i v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), pick);
#else       /* the same lanes: 16 byte pairs, then widened */
    const __m256i pick = _mm256_set_epi32(0x0b0f0a0e, 0x090d080c, 0x800b800a, 0x80098008,
                                          0x070f060e, 0x050d040c, 0x80078006, 0x80058004);
    __m512i v = _mm512_cvtepu16_epi32(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(raw), pick));
#endif
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low_mask = _mm512_set_epi32(15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63);
    __m512i six_bits = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(v, shift), _mm512_srli_epi32(v, 10), low_mask,
                                                 0xe4);      /* low_mask ? (v >> sh) : (v >> 10), bit by bit */
    __m512 d_dmin = _mm512_castps128_ps512(_mm_cvtph_ps(raw));     /* exact */
    __m512 factor = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), d_dmin);
    return _mm512_mul_ps(factor, _mm512_cvtepi32_ps(six_bits));
}
#endif

static inline void unpack_q4_k(const uint8_t *b, float *q, float *scale, float *low) {    /* 144 bytes, G 32 */
    const uint8_t *qs = b + 16;
#if defined(__AVX512F__)    /* the same values as below: the scales in one vector, the nibbles by vpermps (dot_q4_k) */
    __m512 sv = q4_k_scales16(b);
    _mm512_mask_storeu_ps(scale, 0x00ff, sv);
    _mm512_mask_storeu_ps(low, 0x00ff, _mm512_shuffle_f32x4(sv, sv, 0x0e));     /* lanes 8-15 */
    const __m512 nibble = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l += 16) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + l)));
            _mm512_storeu_ps(q + 64 * c + l, _mm512_permutexvar_ps(v, nibble));
            _mm512_storeu_ps(q + 64 * c + 32 + l, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), nibble));
        }
#else
    k_scales(b, scale, low);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l += 16) {
            i32x16 v = widen16(qs + 32 * c + l);
            store16(q + 64 * c + l, float16(v & 15));
            store16(q + 64 * c + 32 + l, float16(v >> 4));
        }
#endif
}

static inline void unpack_iq2_xxs(const uint8_t *b, float *q, float *scale, float *low) {  /* 66 bytes, G 32 */
    (void)low;
    float d = half_to_float(b);
    for (int g = 0; g < 8; g++) {
        const uint8_t *p = b + 2 + 8 * g;
        uint32_t bits = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        scale[g] = d * (0.5f + (float)(bits >> 28)) * 0.25f;
        for (int l = 0; l < 4; l += 2) {    /* 16 values per store, so the 16-value loads that follow forward */
            i32x8 v0, v1, m0, m1;
            memcpy(&v0, iq2_grid[p[l]], sizeof v0);
            memcpy(&v1, iq2_grid[p[l + 1]], sizeof v1);
            memcpy(&m0, iq2_sign_mask[(bits >> (7 * l)) & 127], sizeof m0);
            memcpy(&m1, iq2_sign_mask[(bits >> (7 * l + 7)) & 127], sizeof m1);
            i32x16 v = HALVES(v0 ^ m0, v1 ^ m1);
            memcpy(q + 32 * g + 8 * l, &v, sizeof v);
        }
    }
}

typedef void (*unpack_fn)(const uint8_t *, float *, float *, float *);

/* One row's share of one block straight from its packed bytes, in registers (decode, and each routed expert's
 * row): add_block's arithmetic on the values the unpack_ function gives (the same bits), without storing and
 * reloading them. Measured for IQ2_XXS 9-10% faster at M = 1; Q2_K's (on x reordered per call) is q2_k_dot,
 * further down. */
typedef void (*dot_fn)(acc_t *, const uint8_t *, const float *x, const float *xsum);  /* xsum: for group mins */
typedef void (*dot4_fn)(acc_t *, const uint8_t *const *, const float *x, const float *xsum);  /* dot of 4 rows' blocks */

#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__AVX512BW__)
/* With VBMI/BITALG (Sapphire Rapids, Zen 4) the block's bookkeeping is vector work done once per block: its 32
 * sign bytes (ksigns of the sign indices spread by vpmultishiftqb, looked up by one vpermi2b)
 * become one 16-bit mask per 16 values, applied to the grid floats by a masked xor of the sign bit, and its 8
 * group scales come from one conversion; what is left per group is the grid rows' loads and the same float
 * products as below (the same bits). Measured in 0.70x the time of the scalar index and sign work below. */
static inline void dot_iq2_xxs(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {
    (void)xsum;
    __m512i v = _mm512_loadu_si512(b + 2);     /* qword g: group g's 4 grid indices, then its 32 bits */
    __m512i t = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720), v);    /* bit 7 ignored below */
    const __m512i pack = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x3b3a3938, 0x33323130, 0x2b2a2928, 0x23222120,
                                          0x1b1a1918, 0x13121110, 0x0b0a0908, 0x03020100);
    __m256i signs = _mm512_castsi512_si256(_mm512_permutexvar_epi8(pack, _mm512_permutex2var_epi8(
        _mm512_loadu_si512(iq2_ksigns), t, _mm512_loadu_si512(iq2_ksigns + 64))));         /* byte c: chunk c */
    __m128i sign_lo = _mm256_castsi256_si128(signs), sign_hi = _mm256_extracti128_si256(signs, 1);
    uint64_t negative[4] = {(uint64_t)_mm_cvtsi128_si64(sign_lo), (uint64_t)_mm_extract_epi64(sign_lo, 1),
                            (uint64_t)_mm_cvtsi128_si64(sign_hi), (uint64_t)_mm_extract_epi64(sign_hi, 1)};
    __m256 ls = _mm256_cvtepi32_ps(_mm512_cvtepi64_epi32(_mm512_srli_epi64(v, 60)));
    float scale[8] __attribute__((aligned(32)));     /* + 0: splat16's, as the scalar path */
    uint16_t h;         /* d (f16), converted by vcvtph2ps: exact, as half_to_float */
    memcpy(&h, b, 2);
    __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
    _mm256_store_ps(scale, _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(d,
        _mm256_add_ps(_mm256_set1_ps(0.5f), ls)), _mm256_set1_ps(0.25f)), _mm256_setzero_ps()));
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u);
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const uint8_t *p = b + 2 + 8 * g;
        v16 s = {0};
        for (int h = 0; h < 2; h++) {
            __m256i row0 = _mm256_loadu_si256((const __m256i *)iq2_grid[p[2 * h]]);
            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(row0),
                                           _mm256_loadu_si256((const __m256i *)iq2_grid[p[2 * h + 1]]), 1);
            __mmask16 k = _cvtu32_mask16((uint32_t)(negative[g / 2] >> (32 * (g % 2) + 16 * h)) & 0xffff);
            v16 signed_q = (v16)_mm512_mask_xor_epi32(q, k, q, sign_bit);
            s = h == 0 ? signed_q * load16(x + 32 * g) : fma16(signed_q, load16(x + 32 * g + 16), s);
        }
        a->part[g % ACCS] = fma_broadcast(s, &scale[g], a->part[g % ACCS]);     /* scale[g] * s + part */
    }
}
#else
static inline void dot_iq2_xxs(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {
    (void)xsum;
    float d = half_to_float(b);
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const uint8_t *p = b + 2 + 8 * g;
        uint32_t bits = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        float scale = d * (0.5f + (float)(bits >> 28)) * 0.25f;
        v16 t = {0};
        for (int l = 0; l < 4; l += 2) {
            i32x8 v0, v1, m0, m1;
            memcpy(&v0, iq2_grid[p[l]], sizeof v0);
            memcpy(&v1, iq2_grid[p[l + 1]], sizeof v1);
            memcpy(&m0, iq2_sign_mask[(bits >> (7 * l)) & 127], sizeof m0);
            memcpy(&m1, iq2_sign_mask[(bits >> (7 * l + 7)) & 127], sizeof m1);
            v16 q = (v16)HALVES(v0 ^ m0, v1 ^ m1);
            t = l == 0 ? q * load16(x + 32 * g) : fma16(q, load16(x + 32 * g + 16), t);
        }
        a->part[g % ACCS] = fma16(splat16(scale), t, a->part[g % ACCS]);
    }
}
#endif

static inline v16 int8_floats16(const uint8_t *p) {    /* 16 int8 as floats */
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return float16((widen16(p) ^ 128) - 128);
#endif
}

#if defined(__AVX512F__)
/* The exact Q8_0 rows of K % 128 == 0 (the LM head, attention, shared experts): each block's 32 products q * x in
 * 16 lanes (a multiply, then a fused multiply-add of the second 16), times the block's scale into the row's one
 * accumulator (a fused multiply-add), the blocks in order; then the 16 lanes added as a tree (q8_0_lanes). Per 16
 * weights: one sign extension (port 5), one conversion (port 0) and 1.5 multiply-adds: the least an exact float
 * product of every weight costs (docs/cpu.md, "The 89M exact step"). One chain a row and the tree replace
 * add_block's four chains and finish's sequential lane sum, which at K = 256 (the 89M model's LM head: 8 blocks a
 * row) cost ~15% of the call. Every row's arithmetic is fixed by its row and weight alone: the M-row path
 * (q8_0_weight_rows) does the same operations, so any M and any thread split give the same bits. */
static inline __attribute__((always_inline)) void q8_0_scales4(const uint8_t *b, float *d) {
    /* four f16 scales in one 64-bit word (general registers: no narrow stores for a wide load to wait on), converted
     * exactly (as half_to_float); put together last to first (two registers: with q8_0_own_rows' twelve streams
     * gcc otherwise moved the words through vector registers, ~9 vmovq per four blocks) */
    uint64_t h = 0;
    for (int t = 3; t >= 0; t--) {
        uint16_t s;
        memcpy(&s, b + 34 * t, 2);
        h = h << 16 | s;
    }
    _mm_store_ps(d, _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h)));
}

static inline __attribute__((always_inline)) __m512 q8_0_block(__m512 acc, const uint8_t *q, const float *x,
                                                               const float *d) {
    __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))),
                             _mm512_loadu_ps(x));
    s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
                        _mm512_loadu_ps(x + 16), s);
    return (__m512)fma_broadcast((v16)s, d, (v16)acc);     /* *d * s + acc */
}

/* The tree sum of a row's lanes: quarters (0 + 2) + (1 + 3), then of those four lanes (0 + 2) + (1 + 3). */
static inline float q8_0_lanes(__m512 p) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(p), _mm512_extractf32x8_ps(p, 1));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* q8_0_lanes of four rows at once (the same bits): 9 shuffles and 5 adds for the four rows. */
static inline void q8_0_lanes4(const __m512 *p, float *out) {
    __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], 0x44), _mm512_shuffle_f32x4(p[0], p[1], 0xee));
    __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], 0x44), _mm512_shuffle_f32x4(p[2], p[3], 0xee));
    __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));   /* quarter i: row i */
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4e));
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0xb1));
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                                      0, 12, 8, 4, 0), c)));
}

#if AMD_ZEN
/* On AMD Zen 4 twelve streams, each prefetched 512 bytes ahead, read the weight faster from memory than four 2 KB
 * ahead (the LM head 0.87x the time, docs/cpu.md "Exact Q8_0 and Q4_K at M = 1 on Zen 4 (session 17)") */
#define Q8_0_STREAMS 12
static inline __attribute__((always_inline)) void q8_0_prefetch(const uint8_t *blk) {    /* 4 blocks, 136 bytes */
    for (int off = 0; off < 136; off += 64) __builtin_prefetch(blk + off + 512);
}
#else
#define Q8_0_STREAMS 4
static inline __attribute__((always_inline)) void q8_0_prefetch(const uint8_t *blk) { prefetch_block(blk, 136); }
#endif

/* Q8_0 rows [n0, n1) where each row has a weight of its own (decode, routed experts), Q8_0_STREAMS at a time as
 * own_rows4 (rows n, n + q, n + 2q, ...: as many streams of the weight), the rest one by one. More streams than an
 * L1 set's 8 ways a multiple of 4 KB apart would share one set (1.27x the time at 16 streams), so then q is one row
 * less. */
static void q8_0_own_rows(const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
                          const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / 32, row_bytes = nb * 34, q = (n1 - n0) / Q8_0_STREAMS;
    if (Q8_0_STREAMS > 8 && q > 1 && (q * row_bytes) % 4096 == 0) q--;
    float d[Q8_0_STREAMS][4] __attribute__((aligned(16)));
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *base = w + (experts == NULL ? 0 : experts[m] * expert_bytes);
        const float *xm = x + m * K;
        float *ym = y + m * N;
        if (experts != NULL && experts[m] < 0) {        /* another rank's */
            for (int64_t n = n0; n < n1; n++) ym[n] = 0.0f;
            continue;
        }
        for (int64_t n = n0; n < n0 + q; n++) {
            const uint8_t *r[Q8_0_STREAMS];
            __m512 acc[Q8_0_STREAMS];
            for (int i = 0; i < Q8_0_STREAMS; i++) {
                r[i] = base + (n + i * q) * row_bytes;
                acc[i] = _mm512_setzero_ps();
            }
            for (int64_t b = 0; b < nb; b += 4)
#pragma GCC unroll 12
                for (int i = 0; i < Q8_0_STREAMS; i++) {
                    const uint8_t *blk = r[i] + b * 34;
                    q8_0_prefetch(blk);
                    q8_0_scales4(blk, d[i]);
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++) acc[i] = q8_0_block(acc[i], blk + 34 * t + 2, xm + (b + t) * 32, &d[i][t]);
                }
            float out[Q8_0_STREAMS];
            for (int i = 0; i < Q8_0_STREAMS; i += 4) q8_0_lanes4(acc + i, out + i);
            for (int i = 0; i < Q8_0_STREAMS; i++) ym[n + i * q] = out[i];
        }
        for (int64_t n = n0 + Q8_0_STREAMS * q; n < n1; n++) {
            const uint8_t *row = base + n * row_bytes;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b += 4) {
                prefetch_block(row + b * 34, 136);
                q8_0_scales4(row + b * 34, d[0]);
                for (int t = 0; t < 4; t++) acc = q8_0_block(acc, row + (b + t) * 34 + 2, xm + (b + t) * 32, &d[0][t]);
            }
            ym[n] = q8_0_lanes(acc);
        }
    }
}

/* Q8_0 rows [n0, n1) of y [M, N] with one weight for every row: each block's values converted once, then each row
 * takes q8_0_block's operations on them (the same bits as its own call). */
static void q8_0_weight_rows(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0,
                             int64_t n1) {
    int64_t nb = K / 32, row_bytes = nb * 34;
    float d[4] __attribute__((aligned(16)));
    __m512 acc[MAX_ROWS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b += 4) {
            prefetch_block(row + b * 34, 136);
            q8_0_scales4(row + b * 34, d);
            for (int t = 0; t < 4; t++) {
                const uint8_t *q = row + (b + t) * 34 + 2;
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
                __m512 scale = _mm512_set1_ps(d[t]);
                for (int64_t m = 0; m < M; m++) {
                    const float *xb = x + m * K + (b + t) * 32;
                    __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
                    acc[m] = _mm512_fmadd_ps(scale, s, acc[m]);
                }
            }
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = q8_0_lanes(acc[m]);
    }
}
#endif

/* One row's share of one unpacked block: ng groups of G values starting at group number j0 of the row. */
static inline __attribute__((always_inline)) void add_block(acc_t *a, const float *q, const float *scale,
        const float *low, int ng, int G, const float *x, const float *xsum) {
#pragma GCC unroll 16
    for (int g = 0; g < ng; g++) {
        v16 t = load16(q + g * G) * load16(x + g * G);
        for (int i = 16; i < G; i += 16) t = fma16(load16(q + g * G + i), load16(x + g * G + i), t);
        a->part[g % ACCS] = fma16(splat16(scale[g]), t, a->part[g % ACCS]);
    }
    if (low != NULL) a->low = fma16(load16(low), load16(xsum), a->low);
}

static inline float finish(const acc_t *a, int lows) {
    v16 p = (a->part[0] + a->part[1]) + (a->part[2] + a->part[3]);
    float s = 0.0f, t = 0.0f;
    for (int l = 0; l < 16; l++) s += p[l];
    if (!lows) return s;
    for (int l = 0; l < 16; l++) t += a->low[l];
    return s - t;
}

#if defined(__AVX512F__)
/* finish() of four rows without group mins at once (the same bits): each row's p = (part0 + part1) + (part2 + part3),
 * each row's lanes added in finish's order 0, 1, ..., 15, four rows per add (lanes.h): one chain of 16 adds for the
 * four rows, not a chain of 16 scalar adds (and 15 lane extractions) per row, which bound the rows of few blocks
 * (the 89M model's LM head). */
static inline void finish4(const acc_t *a, float *out) {
    __m512 p[4];
    for (int i = 0; i < 4; i++)
        p[i] = (__m512)((a[i].part[0] + a[i].part[1]) + (a[i].part[2] + a[i].part[3]));
    _mm_storeu_ps(out, lane_sums4(p));
}
#endif

/* Output rows [n0, n1) of y [M, N] (one weight for every row; a row of its own goes through own_rows4) through a
 * grouped unpacker (bs values in bb bytes, groups of G values, each a multiple of ACCS groups per block); xsum:
 * each row's sums of x per group, 16 per block (or NULL). */
static inline __attribute__((always_inline)) void rows_grouped(
        unpack_fn unpack, const int bs, const int bb, const int G, const uint8_t *w, int64_t N, int64_t K,
        const float *x, const float *xsum, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / bs, row_bytes = nb * bb;
    const int ng = bs / G;
    float q[256] __attribute__((aligned(64))), scale[16], low[16] __attribute__((aligned(64))) = {0};
    const float *lows = xsum == NULL ? NULL : low;
    acc_t acc[MAX_ROWS];
    for (int64_t n = n0; n < n1; n++) { /* one weight for every row: each block unpacked once */
        memset(acc, 0, sizeof(acc_t) * M);
        const uint8_t *row = w + n * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            prefetch_block(row + b * bb, bb);
            unpack(row + b * bb, q, scale, low);
            for (int64_t m = 0; m < M; m++)
                add_block(&acc[m], q, scale, lows, ng, G, x + m * K + b * bs,
                          xsum == NULL ? NULL : xsum + (m * nb + b) * 16);
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = finish(&acc[m], lows != NULL);
    }
}

/* Each row's sums of x over every group of G values, 16 floats per block of bs values (in order; unused
 * lanes 0), 64-byte aligned (a 64-byte load across two cache lines costs two on AMD Zen 4). The caller frees the
 * result; NULL when out of memory. */
static float *group_sums(const float *x, int64_t M, int64_t K, int bs, int G) {
    int64_t nb = K / bs;
    float *out = aligned_alloc(64, (size_t)(M * nb * 16) * sizeof(float));
    if (out == NULL) return NULL;
    memset(out, 0, (size_t)(M * nb * 16) * sizeof(float));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++)
            for (int g = 0; g < bs / G; g++) {
                float s = 0.0f;
                for (int i = 0; i < G; i++) s += x[m * K + b * bs + g * G + i];
                out[(m * nb + b) * 16 + g] = s;
            }
    return out;
}

#if defined(__AVX512F__)
/* Rows [n0, n1) where each row has a weight of its own (decode, routed experts), four at a time: rows n, n + q,
 * n + 2q and n + 3q (q a quarter of the range) block by block, so the weight is fetched as four streams at once
 * (measured 10-16% faster from memory than one row after another for Q4_K, ~5% for Q8_0's LM head); each row
 * still takes `dot` on its blocks in order, so the same bits as one row at a time. bs values in bb bytes per
 * `dot`; dot4 (or NULL): `dot` of the four rows' blocks at once; xsum: each row's sums of x per group, 16 per block,
 * for types with group mins (NULL without). */
static inline __attribute__((always_inline)) void own_rows4_sums(
        dot_fn dot, dot4_fn dot4, const int bs, const int bb, const float *xsum, const uint8_t *w, int64_t expert_bytes,
        const int64_t *experts, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / bs, row_bytes = nb * bb, q = (n1 - n0) / 4;
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *base = w + (experts == NULL ? 0 : experts[m] * expert_bytes);
        const float *xm = x + m * K, *sm = xsum == NULL ? NULL : xsum + m * nb * 16;
        float *ym = y + m * N;
        if (experts != NULL && experts[m] < 0) {        /* another rank's */
            for (int64_t n = n0; n < n1; n++) ym[n] = 0.0f;
            continue;
        }
        for (int64_t n = n0; n < n0 + q; n++) {
            const uint8_t *r[4];
            acc_t a[4] = {0};
            for (int i = 0; i < 4; i++) r[i] = base + (n + i * q) * row_bytes;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blocks[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    blocks[i] = r[i] + b * bb;
                    prefetch_block(blocks[i], bb);
                    if (dot4 == NULL) dot(&a[i], blocks[i], xm + b * bs, sm == NULL ? NULL : sm + b * 16);
                }
                if (dot4 != NULL) dot4(a, blocks, xm + b * bs, sm == NULL ? NULL : sm + b * 16);
            }
            if (sm == NULL) {
                float out[4];
                finish4(a, out);
                for (int i = 0; i < 4; i++) ym[n + i * q] = out[i];
            } else {
                for (int i = 0; i < 4; i++) ym[n + i * q] = finish(&a[i], 1);
            }
        }
        for (int64_t n = n0 + 4 * q; n < n1; n++) {     /* the last (n1 - n0) % 4 rows */
            const uint8_t *row = base + n * row_bytes;
            acc_t a = {0};
            for (int64_t b = 0; b < nb; b++) {
                prefetch_block(row + b * bb, bb);
                dot(&a, row + b * bb, xm + b * bs, sm == NULL ? NULL : sm + b * 16);
            }
            ym[n] = finish(&a, sm != NULL);
        }
    }
}

/* own_rows4_sums with each row's group sums of x made here (groups of G values; G = 0: none). Returns 0, or -2 out
 * of memory. */
static inline __attribute__((always_inline)) int own_rows4(
        dot_fn dot, const int bs, const int bb, const int G, const uint8_t *w, int64_t expert_bytes,
        const int64_t *experts, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    float *xsum = G ? group_sums(x, M, K, bs, G) : NULL;
    if (G && xsum == NULL) return -2;
    own_rows4_sums(dot, NULL, bs, bb, xsum, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
    free(xsum);
    return 0;
}

/* Q2_K and Q3_K (256 values in 16 groups of 16; Q2_K with a scale and a min each, Q3_K with a signed scale) without
 * widening their bytes: both keep element 128k + 32i + l's low 2 bits in bits 2i of byte 32k + l of 64 bytes, which
 * are one vector, whose dword lane j holds bytes 4j..4j+3. Value i of byte 4j + r is looked up by one vpermps, whose
 * index is the dword's low 4 bits: for Q2_K the dword shifted right by 8r + 4(i / 2) (7 shifts a block) in a table
 * of the index's low (i even) or high (i odd) 2 bits; for Q3_K a vector per i of 3-bit codes (the 2 bits | hmask's
 * bit << 2, made 64 at a time) shifted right by 8r, in a table of code - 4. x is reordered once per call to match
 * (two_bit_order): vector (i, r)'s lane j meets element 128 (j / 8) + 32 i + 4 (j % 8) + r. The 4 vectors of one i
 * are summed (a multiply, 3 multiply-adds) and multiplied into the row's accumulator (one: 3% faster than four,
 * fewer registers spilled) by their groups' scales spread over the lanes (lanes 4h..4h+3 belong to group
 * 8 (h / 2) + 2 i + h % 2; d times the integer scale, exact); Q2_K's mins' term is (dmin m) . (the groups' sums of
 * x), one multiply-add a block. A Q2_K block costs 16 lookups, 21 multiply(-add)s, 7 shifts and 4 scale spreads on
 * the two 512-bit ports (was 18 lookups, 35 multiply(-add)s, 5 widenings and 4 shifts). The one-row (<type>_dot)
 * and the several-row (<type>_unpack + two_bit_add) paths make the same operations in the same order, so every row
 * has the same bits at any M and thread split. */
static const float q2_k_levels[2][16] __attribute__((aligned(64))) = {     /* a 4-bit index's low / high 2 bits */
    {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}, {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}};

/* x reordered per block, 64-byte aligned as group_sums (NULL: no memory; Q2_K 12.5 -> 10.9 ns a block on Zen 4) */
static float *two_bit_order(const float *x, int64_t M, int64_t K) {
    float *out = aligned_alloc(64, (size_t)(M * K) * sizeof(float));
    if (out == NULL) return NULL;
    for (int64_t b = 0; b < M * K; b += 256)
        for (int v = 0; v < 16; v++)        /* vector (i, r) = (v / 4, v % 4) */
            for (int j = 0; j < 16; j++)
                out[b + 16 * v + j] = x[b + 128 * (j / 8) + 32 * (v / 4) + 4 * (j % 8) + v % 4];
    return out;
}

/* Group g's scale (lane g of sc) spread over the lanes of each i (lanes 4h..4h+3: group 8 (h / 2) + 2 i + h % 2): one
 * vpermps puts groups 8 (h / 2) + h % 2 + 2i (i = 0..3) in 128-bit lane h, then one in-lane vpermilps per i (on
 * AMD Zen 4 a cross-lane vpermps shares two of the four vector pipes with the multiply-adds; vpermilps has three). */
static inline __attribute__((always_inline)) void spread_scales(__m512 sc, __m512 *scale) {
    __m512 lanes = _mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0), sc);
    scale[0] = _mm512_permute_ps(lanes, 0x00);
    scale[1] = _mm512_permute_ps(lanes, 0x55);
    scale[2] = _mm512_permute_ps(lanes, 0xaa);
    scale[3] = _mm512_permute_ps(lanes, 0xff);
}

/* A Q2_K block's scales spread over the lanes of each i (scale[i]) and its mins (low: d and dmin converted together
 * by vcvtph2ps, exact as half_to_float). */
static inline __attribute__((always_inline)) void q2_k_scales(const uint8_t *b, __m512 *scale, __m512 *low) {
    i32x16 sv = widen16(b);
    uint32_t dm;
    memcpy(&dm, b + 80, 4);
    float dms[4] __attribute__((aligned(16)));
    _mm_store_ps(dms, _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)));
    *low = mul_broadcast(_mm512_cvtepi32_ps((__m512i)(sv >> 4)), dms + 1);
    spread_scales(mul_broadcast(_mm512_cvtepi32_ps((__m512i)(sv & 15)), dms), scale);
}

static inline __attribute__((always_inline)) __m512 q2_k_values(__m512i raw, int i, int r) {    /* vector (i, r) */
    int shift = 8 * r + 4 * (i / 2);
    return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(raw, shift) : raw, _mm512_load_ps(q2_k_levels[i % 2]));
}

static inline void q2_k_dot(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 84 bytes */
    __m512 scale[4], low;
    q2_k_scales(b, scale, &low);
    a->low = fma16((v16)low, load16(xsum), a->low);
    __m512i raw = _mm512_loadu_si512(b + 16);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        v16 t = (v16)q2_k_values(raw, i, 0) * load16(x + 64 * i);
        for (int r = 1; r < 4; r++) t = fma16((v16)q2_k_values(raw, i, r), load16(x + 64 * i + 16 * r), t);
        a->part[0] = fma16((v16)scale[i], t, a->part[0]);
    }
}

typedef struct { v16 value[16], scale[4], low; } two_bit_block;

static inline void q2_k_unpack(const uint8_t *b, two_bit_block *u) {
    q2_k_scales(b, (__m512 *)u->scale, (__m512 *)&u->low);
    __m512i raw = _mm512_loadu_si512(b + 16);
    for (int v = 0; v < 16; v++) u->value[v] = (v16)q2_k_values(raw, v / 4, v % 4);
}

#if defined(__AVX512BW__)
/* Q3_K (110 bytes: hmask 32, qs 64, scales 12, d): the codes of each i (bit 2: hmask's bit 4k + i of byte l; bit 3
 * left as it falls, which the table ignores) and the scales d * (6-bit scale - 32) spread over the lanes. */
static inline __attribute__((always_inline)) void q3_k_codes(const uint8_t *b, __m512i *code, __m512 *scale) {
    __m512i qs = _mm512_loadu_si512(b + 32);                  /* k = 0 in bytes 0-31, k = 1 in 32-63 */
    __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(hm), _mm256_srli_epi16(hm, 4), 1);   /* bit i at bit i */
    for (int i = 0; i < 4; i++) {       /* (qs >> 2i) bits 0-1, (h << 2 - i) bits 2-7: bit select by 3 */
        __m512i bit = i < 2 ? _mm512_slli_epi16(h, 2 - i) : i > 2 ? _mm512_srli_epi16(h, i - 2) : h;
        code[i] = _mm512_ternarylogic_epi32(i ? _mm512_srli_epi16(qs, 2 * i) : qs, bit, _mm512_set1_epi8(3), 0xe4);
    }
    __m128i raw = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)(b + 96)), *(const int32_t *)(b + 104), 2);
    i32x16 bytes = (i32x16)_mm512_cvtepu8_epi32(raw);
    i32x16 low = __builtin_shufflevector(bytes, bytes, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    i32x16 top = __builtin_shufflevector(bytes, bytes, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11);
    const i32x16 low_shift = {0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4};
    const i32x16 top_shift = {0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6};
    float d = half_to_float(b + 108);
    spread_scales(mul_broadcast((__m512)float16((((low >> low_shift) & 15) | (((top >> top_shift) & 3) << 4)) - 32), &d),
                  scale);
}

static inline __attribute__((always_inline)) __m512 q3_k_values(const __m512i *code, int i, int r) {    /* (i, r) */
    static const float levels[16] __attribute__((aligned(64))) = {-4, -3, -2, -1, 0, 1, 2, 3,
                                                                   -4, -3, -2, -1, 0, 1, 2, 3};
    return _mm512_permutexvar_ps(r ? _mm512_srli_epi32(code[i], 8 * r) : code[i], _mm512_load_ps(levels));
}

static inline void q3_k_dot(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 110 bytes */
    (void)xsum;
    __m512i code[4];
    __m512 scale[4];
    q3_k_codes(b, code, scale);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        v16 t = (v16)q3_k_values(code, i, 0) * load16(x + 64 * i);
        for (int r = 1; r < 4; r++) t = fma16((v16)q3_k_values(code, i, r), load16(x + 64 * i + 16 * r), t);
        a->part[0] = fma16((v16)scale[i], t, a->part[0]);
    }
}

static inline void q3_k_unpack(const uint8_t *b, two_bit_block *u) {
    __m512i code[4];
    q3_k_codes(b, code, (__m512 *)u->scale);
    for (int v = 0; v < 16; v++) u->value[v] = (v16)q3_k_values(code, v / 4, v % 4);
}
#endif

static inline __attribute__((always_inline)) void two_bit_add(acc_t *a, const two_bit_block *u, const float *x,
                                                              const float *xsum) {
    if (xsum != NULL) a->low = fma16(u->low, load16(xsum), a->low);
    for (int i = 0; i < 4; i++) {
        v16 t = u->value[4 * i] * load16(x + 64 * i);
        for (int r = 1; r < 4; r++) t = fma16(u->value[4 * i + r], load16(x + 64 * i + 16 * r), t);
        a->part[0] = fma16(u->scale[i], t, a->part[0]);
    }
}

/* qgemv's rows [n0, n1) of Q2_K or Q3_K (K % 256 == 0; bb bytes a block; mins: Q2_K's group mins): rows of their own
 * through `dot`, else each block unpacked once and added to the M rows. Returns 0, or -2 out of memory. */
static inline __attribute__((always_inline)) int two_bit_rows(
        dot_fn dot, void (*unpack)(const uint8_t *, two_bit_block *), const int bb, const int mins, const uint8_t *w,
        int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K, const float *x, int64_t M, float *y,
        int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    float *xo = two_bit_order(x, M, K), *xsum = mins ? group_sums(x, M, K, 256, 16) : NULL;
    if (xo == NULL || (mins && xsum == NULL)) {
        free(xo);
        free(xsum);
        return -2;
    }
    if (experts != NULL || M == 1) {
        own_rows4_sums(dot, NULL, 256, bb, xsum, w, expert_bytes, experts, N, K, xo, M, y, n0, n1);
    } else {
        two_bit_block u;
        acc_t acc[MAX_ROWS];
        for (int64_t n = n0; n < n1; n++) {     /* one weight for every row: each block unpacked once */
            memset(acc, 0, sizeof(acc_t) * M);
            const uint8_t *row = w + n * nb * bb;
            for (int64_t b = 0; b < nb; b++) {
                prefetch_block(row + b * bb, bb);
                unpack(row + b * bb, &u);
                for (int64_t m = 0; m < M; m++)
                    two_bit_add(&acc[m], &u, xo + m * K + b * 256, mins ? xsum + (m * nb + b) * 16 : NULL);
            }
            for (int64_t m = 0; m < M; m++) y[m * N + n] = finish(&acc[m], mins);
        }
    }
    free(xo);
    free(xsum);
    return 0;
}
#endif

/* Rows [n0, n1) of a K-quant with group mins (256 values in bb bytes, groups of G): the grouped path with each
 * row's sums of x per group where it is built, else dequantize-then-multiply. Returns 0, or -2 out of memory. */
static inline __attribute__((always_inline)) int k_quant_rows(
        deq_fn deq, unpack_fn unpack, const int bb, const int G, const uint8_t *w, int64_t expert_bytes,
        const int64_t *experts, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (!GROUPED) {
        rows_of(deq, 256, bb, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
        return 0;
    }
    float *xsum = group_sums(x, M, K, 256, G);
    if (xsum == NULL) return -2;
    rows_grouped(unpack, 256, bb, G, w, N, K, x, xsum, M, y, n0, n1);
    free(xsum);
    return 0;
}

#if GROUPED
/* Q4_K's and Q5_K's groups 2c and 2c + 1 (products t0, t1) into their accumulators, times the scales in sv[0..7]
 * (each by the multiply-add's own broadcast from memory) */
static inline __attribute__((always_inline)) void k_pair_add(acc_t *a, const float *sv, int c, v16 t0, v16 t1) {
    a->part[(2 * c) % ACCS] = fma_broadcast(t0, &sv[2 * c], a->part[(2 * c) % ACCS]);
    a->part[(2 * c + 1) % ACCS] = fma_broadcast(t1, &sv[2 * c + 1], a->part[(2 * c + 1) % ACCS]);
}

/* Their mins' term: lanes 0-7 the mins (a 256-bit load of sv's lanes 8-15) times the group sums; lanes 8-15 stay as
 * they are (0) */
static inline __attribute__((always_inline)) void k_mins_add(acc_t *a, const float *sv, const float *xsum) {
    a->low = (v16)_mm512_mask3_fmadd_ps(_mm512_castps256_ps512(_mm256_load_ps(sv + 8)), (__m512)load16(xsum),
                                        (__m512)a->low, 0x00ff);
}

/* One row's share of one Q4_K block in registers: unpack_q4_k then add_block's arithmetic (the same bits),
 * without storing the values; the scales unpacked in one vector and each nibble turned into its float by one vpermps
 * from a table of 0..15 (measured ~1.3x faster at M = 1 than unpack + add_block). */
static inline void dot_q4_k(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {
    const uint8_t *qs = b + 16;
    float sv[16] __attribute__((aligned(64)));     /* the scales, then the mins: each broadcast from memory */
    _mm512_store_ps(sv, q4_k_scales16(b));
    /* each nibble's float by one vpermps (which reads 4 bits of each index) from the table 0..15 */
    const __m512 nibble = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
        v16 t0 = (v16)_mm512_permutexvar_ps(v0, nibble) * load16(x + 64 * c);
        t0 = fma16((v16)_mm512_permutexvar_ps(v1, nibble), load16(x + 64 * c + 16), t0);
        v16 t1 = (v16)_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), nibble) * load16(x + 64 * c + 32);
        t1 = fma16((v16)_mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), nibble), load16(x + 64 * c + 48), t1);
        k_pair_add(a, sv, c, t0, t1);
    }
    k_mins_add(a, sv, xsum);
}

#if defined(__AVX512VBMI__) && AMD_ZEN
#define Q4_K_DOT4 1
/* dot_q4_k of four rows' blocks (r[i]: row i's), chunk by chunk (each row the same operations in the same order, so
 * the same bits), on AMD Zen: each 64 bytes of nibbles put by one vpermb so that lane l holds bytes l, l + 16, l + 32
 * and l + 48 (instead of four widenings, each a shuffle here), each nibble shifted down to the bits vpermps reads
 * but byte 3's high one, which the shift leaves alone in the lane and vcvtdq2ps converts (off the shuffle pipes);
 * one block of four rows in one call, so x is read once for the four and fewer registers are spilled. */
static inline __attribute__((always_inline)) void dot4_q4_k(acc_t *a, const uint8_t *const *r, const float *x,
                                                            const float *xsum) {
    float sv[4][16] __attribute__((aligned(64)));     /* each row's scales, then mins: broadcast from memory */
    for (int i = 0; i < 4; i++) _mm512_store_ps(sv[i], q4_k_scales16(r[i]));
    const __m512 nibble = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i transpose = _mm512_set_epi32(
        0x3f2f1f0f, 0x3e2e1e0e, 0x3d2d1d0d, 0x3c2c1c0c, 0x3b2b1b0b, 0x3a2a1a0a, 0x39291909, 0x38281808,
        0x37271707, 0x36261606, 0x35251505, 0x34241404, 0x33231303, 0x32221202, 0x31211101, 0x30201000);
    __m512i bytes[4];       /* row i's chunks c and c + 1 (c even) */
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        v16 x0 = load16(x + 64 * c), x1 = load16(x + 64 * c + 16), x2 = load16(x + 64 * c + 32),
            x3 = load16(x + 64 * c + 48);
        if (c % 2 == 0)
            for (int i = 0; i < 4; i++)
                bytes[i] = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(r[i] + 16 + 32 * c));
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m512i v0 = c % 2 ? _mm512_srli_epi32(bytes[i], 16) : bytes[i];     /* as dot_q4_k's, bits 8 up aside */
            __m512i v1 = _mm512_srli_epi32(bytes[i], 16 * (c % 2) + 8);
            v16 t0 = (v16)_mm512_permutexvar_ps(v0, nibble) * x0;
            t0 = fma16((v16)_mm512_permutexvar_ps(v1, nibble), x1, t0);
            v16 t1 = (v16)_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), nibble) * x2;
            __m512 top = c % 2 ? _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes[i], 28))     /* byte 3's high nibble */
                               : _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), nibble);
            t1 = fma16((v16)top, x3, t1);
            k_pair_add(&a[i], sv[i], c, t0, t1);
        }
    }
    for (int i = 0; i < 4; i++) k_mins_add(&a[i], sv[i], xsum);
}
#else
#define Q4_K_DOT4 0
#endif
#endif

#if GROUPED
/* finish(a + i, 1) of four Q4_K rows at once (the same bits): finish4 for the parts; the mins' lanes 0-7 transposed
 * the same way and added in order (their lanes 8-15 are 0, and adding +0 eight times is adding it once), then the
 * differences. */
static inline void q4_k_finish4(const acc_t *a, float *out) {
    float s[4] __attribute__((aligned(16)));
    finish4(a, s);
    __m256 l[4];
    for (int i = 0; i < 4; i++) l[i] = _mm512_castps512_ps256((__m512)a[i].low);
    __m256 u0 = _mm256_unpacklo_ps(l[0], l[1]), u1 = _mm256_unpackhi_ps(l[0], l[1]);
    __m256 u2 = _mm256_unpacklo_ps(l[2], l[3]), u3 = _mm256_unpackhi_ps(l[2], l[3]);
    __m256 t[4] = {_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2))),
                   _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2))),
                   _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3))),
                   _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)))};
    __m128 low = _mm_setzero_ps();
    for (int j = 0; j < 4; j++) low = _mm_add_ps(low, _mm256_castps256_ps128(t[j]));
    for (int j = 0; j < 4; j++) low = _mm_add_ps(low, _mm256_extractf128_ps(t[j], 1));
    low = _mm_add_ps(low, _mm_setzero_ps());
    _mm_storeu_ps(out, _mm_sub_ps(_mm_load_ps(s), low));
}

/* own_rows4 of Q4_K rows of one block (K = 256: the 89M model's routed experts), each four rows finished together
 * (q4_k_finish4: at one block a row finish's two chains of 16 scalar adds cost about as much as the block) and the
 * group sums on the stack; the same bits as own_rows4. A path of its own: the same finish in own_rows4_sums slowed the
 * full-width experts (K = 2048, 4096) by 4-6% (docs/cpu.md "The 89M exact step (session 15)"). */
static void q4_k_block_rows(const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, const float *x,
                            int64_t M, float *y, int64_t n0, int64_t n1) {
    float xsum[MAX_ROWS * 16] __attribute__((aligned(64))) = {0};    /* group_sums' values */
    for (int64_t m = 0; m < M; m++)
        for (int g = 0; g < 8; g++) {
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += x[m * 256 + g * 32 + i];
            xsum[m * 16 + g] = s;
        }
    int64_t q = (n1 - n0) / 4;
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *base = w + (experts == NULL ? 0 : experts[m] * expert_bytes);
        const float *xm = x + m * 256, *sm = xsum + m * 16;
        float *ym = y + m * N;
        if (experts != NULL && experts[m] < 0) {        /* another rank's */
            for (int64_t n = n0; n < n1; n++) ym[n] = 0.0f;
            continue;
        }
        for (int64_t n = n0; n < n0 + q; n++) {
            acc_t a[4] = {0};
            float out[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const uint8_t *row = base + (n + i * q) * 144;
                prefetch_block(row, 144);
                dot_q4_k(&a[i], row, xm, sm);
            }
            q4_k_finish4(a, out);
            for (int i = 0; i < 4; i++) ym[n + i * q] = out[i];
        }
        for (int64_t n = n0 + 4 * q; n < n1; n++) {     /* the last (n1 - n0) % 4 rows */
            acc_t a = {0};
            prefetch_block(base + n * 144, 144);
            dot_q4_k(&a, base + n * 144, xm, sm);
            ym[n] = finish(&a, 1);
        }
    }
}
#endif

#if GROUPED
/* The other types on the grouped path (session 14; docs/cpu.md "The other types' exact M = 1 kernels"): each has a
 * dot_<type> for rows of their own (M = 1, routed experts) and an unpack_<type> for one weight shared by M > 1 rows
 * (add_block), the same operations in the same order, so the same bits at any M. */

/* Per 16 values, a signed integer scale and signed integer values (Q6_K, Q3_K), and one float d per block: the
 * value is d * (scale * q), and scale * q is an exact small integer (|.| <= 4096), so the grouped form takes it as
 * the value, with groups of 64 values (4 chains per row) scaled by d: one multiply-add per 16 values per row, as the
 * dequantized path's. q: the block's 256 values as bytes; sc: its 16 scales as floats. */
static inline __attribute__((always_inline)) void scaled_bytes_dot(acc_t *a, const int8_t *q, const float *sc,
                                                                   float d, const float *x) {
    v16 dv = splat16(d);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        v16 t = {0};
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            int j = 4 * g + i;
            v16 w = (v16)mul_broadcast((__m512)int8_floats16((const uint8_t *)q + 16 * j), &sc[j]);
            t = i == 0 ? w * load16(x + 16 * j) : fma16(w, load16(x + 16 * j), t);
        }
        a->part[g] = fma16(dv, t, a->part[g]);
    }
}

static inline __attribute__((always_inline)) void scaled_bytes_unpack(const int8_t *q, const float *sc, float d,
                                                                      float *values, float *scale) {
    for (int j = 0; j < 16; j++) store16(values + 16 * j, int8_floats16((const uint8_t *)q + 16 * j) * splat16(sc[j]));
    for (int g = 0; g < 4; g++) scale[g] = d;
}

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));

/* Q6_K's 256 values (ql's 4 bits | qh's 2 bits << 4) - 32 as bytes, 64 at a time (elements 128c + 32s + l). */
static inline void q6_k_bytes(const uint8_t *b, int8_t *q) {
    for (int c = 0; c < 2; c++) {
        u8x64 lo;       /* ql[64c + l]: low nibbles s = 0 (l < 32) and 1, high nibbles s = 2 and 3 */
        u8x32 h;        /* qh[32c + l]: bits 2s, 2s + 1 */
        memcpy(&lo, b + 64 * c, 64);
        memcpy(&h, b + 128 + 32 * c, 32);
        u8x32 h0 = (h << 4) & 0x30, h1 = (h << 2) & 0x30, h2 = h & 0x30, h3 = (h >> 2) & 0x30;
        u8x64 low = (lo & 15) | __builtin_shufflevector(h0, h1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
            16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42,
            43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
        u8x64 high = (lo >> 4) | __builtin_shufflevector(h2, h3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
            16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42,
            43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
        low -= 32;
        high -= 32;
        memcpy(q + 128 * c, &low, 64);
        memcpy(q + 128 * c + 64, &high, 64);
    }
}

static inline void dot_q6_k(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 210 bytes */
    (void)xsum;
    int8_t q[256] __attribute__((aligned(64)));
    float sc[16] __attribute__((aligned(64)));
    q6_k_bytes(b, q);
    store16(sc, int8_floats16(b + 192));
    scaled_bytes_dot(a, q, sc, half_to_float(b + 208), x);
}

static inline void unpack_q6_k(const uint8_t *b, float *values, float *scale, float *low) {    /* G 64 */
    (void)low;
    int8_t q[256] __attribute__((aligned(64)));
    float sc[16] __attribute__((aligned(64)));
    q6_k_bytes(b, q);
    store16(sc, int8_floats16(b + 192));
    scaled_bytes_unpack(q, sc, half_to_float(b + 208), values, scale);
}

/* Q5_K: Q4_K's scales and nibbles (dot_q4_k's way), + 16 where the value's bit of qh is set (a masked add: exact);
 * value l of group 2c (2c + 1) takes bit 2c (2c + 1) of qh[l]. */
static inline __attribute__((always_inline)) __m512 q5_k_values(__m512i nibbles, __m512i high, int bit) {
    const __m512 counting = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 q = _mm512_permutexvar_ps(nibbles, counting);      /* reads the low 4 bits of each index */
    return _mm512_mask_add_ps(q, _mm512_test_epi32_mask(high, _mm512_set1_epi32(1 << bit)), q, _mm512_set1_ps(16));
}

static inline void dot_q5_k(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 176 bytes */
    const uint8_t *qs = b + 48;
    float sv[16] __attribute__((aligned(64)));     /* the scales, then the mins: each broadcast from memory */
    _mm512_store_ps(sv, q4_k_scales16(b));
    __m512i h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
    __m512i h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32)));
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
        v16 t0 = (v16)q5_k_values(v0, h0, 2 * c) * load16(x + 64 * c);
        t0 = fma16((v16)q5_k_values(v1, h1, 2 * c), load16(x + 64 * c + 16), t0);
        v16 t1 = (v16)q5_k_values(_mm512_srli_epi32(v0, 4), h0, 2 * c + 1) * load16(x + 64 * c + 32);
        t1 = fma16((v16)q5_k_values(_mm512_srli_epi32(v1, 4), h1, 2 * c + 1), load16(x + 64 * c + 48), t1);
        k_pair_add(a, sv, c, t0, t1);
    }
    k_mins_add(a, sv, xsum);
}

static inline void unpack_q5_k(const uint8_t *b, float *q, float *scale, float *low) {    /* 176 bytes, G 32 */
    const uint8_t *qs = b + 48;
    __m512 sv = q4_k_scales16(b);
    _mm512_mask_storeu_ps(scale, 0x00ff, sv);
    _mm512_mask_storeu_ps(low, 0x00ff, _mm512_shuffle_f32x4(sv, sv, 0x0e));
    __m512i h[2] = {_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16))),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32)))};
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 2; l++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16 * l)));
            _mm512_storeu_ps(q + 64 * c + 16 * l, q5_k_values(v, h[l], 2 * c));
            _mm512_storeu_ps(q + 64 * c + 32 + 16 * l, q5_k_values(_mm512_srli_epi32(v, 4), h[l], 2 * c + 1));
        }
}

/* IQ4_XS: per sub-block j of 32 values the scale d * (ls - 32) (deq_iq4_xs's), the values iq4_levels[nibble] by one
 * vpermps each; groups of 32, no mins. */
static inline void iq4_xs_scales(const uint8_t *b, float *scale) {
    uint32_t low;
    uint16_t high;
    memcpy(&high, b + 2, 2);
    memcpy(&low, b + 4, 4);
    i32x8 ls = (((i32x8){0} + (int32_t)low) >> (i32x8){0, 4, 8, 12, 16, 20, 24, 28}) & 15;
    ls |= ((((i32x8){0} + (int32_t)high) >> (i32x8){0, 2, 4, 6, 8, 10, 12, 14}) & 3) << 4;
    store8(scale, splat(half_to_float(b)) * to_float(ls - 32));
}

static inline void dot_iq4_xs(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 136 bytes */
    (void)xsum;
    float scale[8] __attribute__((aligned(32)));
    iq4_xs_scales(b, scale);
    for (int j = 0; j < 8; j++) scale[j] += 0.0f;     /* splat16's */
    const __m512 levels = _mm512_loadu_ps(iq4_levels);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 8 + 16 * j)));
        v16 t = (v16)_mm512_permutexvar_ps(v, levels) * load16(x + 32 * j);
        t = fma16((v16)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), levels), load16(x + 32 * j + 16), t);
        a->part[j % ACCS] = fma_broadcast(t, &scale[j], a->part[j % ACCS]);
    }
}

static inline void unpack_iq4_xs(const uint8_t *b, float *q, float *scale, float *low) {    /* 136 bytes, G 32 */
    (void)low;
    iq4_xs_scales(b, scale);
    const __m512 levels = _mm512_loadu_ps(iq4_levels);
    for (int j = 0; j < 8; j++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 8 + 16 * j)));
        _mm512_storeu_ps(q + 32 * j, _mm512_permutexvar_ps(v, levels));
        _mm512_storeu_ps(q + 32 * j + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), levels));
    }
}

/* The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) four blocks (128 values, groups of 32) at a time: a
 * block's value l is table[low nibble of byte l], 16 + l table[high nibble] (+ 16 where bit l of the u32 at qh_at is
 * set: Q5_0/Q5_1), its scale the f16 at 0 (MXFP4: 2**(e - 128) of the byte at 0), and Q4_1/Q5_1's `+ m` (the f16 at
 * 2) a min of -m. */
typedef struct { int bb, qs_at, qh_at, min_at, e8m0; const float *table; } codes_t;

static const float q4_0_values[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
static const float q5_0_values[16] = {-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1};
static const float counting_values[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const codes_t Q4_0_CODES = {18, 2, -1, -1, 0, q4_0_values}, Q4_1_CODES = {20, 4, -1, 2, 0, counting_values},
                     Q5_0_CODES = {22, 6, 2, -1, 0, q5_0_values}, Q5_1_CODES = {24, 8, 4, 2, 0, counting_values},
                     IQ4_NL_CODES = {18, 2, -1, -1, 0, iq4_levels}, MXFP4_CODES = {17, 1, -1, -1, 1, mxfp4_twice};

static inline __attribute__((always_inline)) __m512 code_values(const codes_t t, const uint8_t *blk, int high) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + t.qs_at)));
    __m512 q = _mm512_permutexvar_ps(high ? _mm512_srli_epi32(v, 4) : v, _mm512_loadu_ps(t.table));
    if (t.qh_at < 0) return q;
    uint32_t qh;
    memcpy(&qh, blk + t.qh_at, 4);
    return _mm512_mask_add_ps(q, (__mmask16)(qh >> (16 * high)), q, _mm512_set1_ps(16));
}

/* The four blocks' scales (+ 0: splat16's) into d, and their mins (-m, 0 without) as the lanes 0-3 of the result. */
static inline __attribute__((always_inline)) __m128 code_scales(const codes_t t, const uint8_t *b, float *d) {
    if (t.e8m0) {
        for (int i = 0; i < 4; i++) {
            uint32_t e = b[i * t.bb];
            d[i] = bits_to_float(e < 2 ? 0x00200000u << e : (e - 1) << 23) + 0.0f;    /* deq_mxfp4's, exact */
        }
        return _mm_setzero_ps();
    }
    __m128i h;
#if defined(__AVX512BW__)
    /* With mins (Q4_1, Q5_1) the 8 halves picked by one vpermi2w from the first and the last 64 bytes of the 4 blocks:
     * copied one by one into a stack array, whose 16-byte load waits for the copies, they took ~1.45x (Q4_1) and
     * ~1.2x (Q5_1) the time at M = 1 (on an Intel core); for the types without mins the copies measured 3% faster. */
    if (t.min_at >= 0) {
        const int last = 4 * t.bb - 64;
#define WORD(o) ((o) + 2 <= 64 ? (o) / 2 : 32 + ((o) - last) / 2)
        const __m512i pick = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            WORD(3 * t.bb + t.min_at), WORD(2 * t.bb + t.min_at), WORD(t.bb + t.min_at), WORD(t.min_at),
            WORD(3 * t.bb), WORD(2 * t.bb), WORD(t.bb), WORD(0));
#undef WORD
        h = _mm512_castsi512_si128(_mm512_permutex2var_epi16(_mm512_loadu_si512(b), pick,
                                                             _mm512_loadu_si512(b + last)));
    } else
#endif
    {   /* the halves in general registers (as q8_0_scales4): a stack copy read back by one wide load waits for the
         * narrow stores (Q4_0, IQ4_NL 0.4x and Q5_0 0.6x the time on AMD Zen 4) */
        uint64_t lo = 0, hi = 0;
        for (int i = 0; i < 4; i++) {
            uint16_t s;
            memcpy(&s, b + i * t.bb, 2);
            lo |= (uint64_t)s << (16 * i);
            if (t.min_at >= 0) {
                memcpy(&s, b + i * t.bb + t.min_at, 2);
                hi |= (uint64_t)s << (16 * i);
            }
        }
        h = _mm_set_epi64x((long long)hi, (long long)lo);
    }
    __m256 both = _mm256_cvtph_ps(h);       /* exact, as half_to_float */
    _mm_storeu_ps(d, _mm_add_ps(_mm256_castps256_ps128(both), _mm_setzero_ps()));
    return _mm_sub_ps(_mm_setzero_ps(), _mm256_extractf128_ps(both, 1));
}

static inline __attribute__((always_inline)) void codes_dot(const codes_t t, acc_t *a, const uint8_t *b,
                                                            const float *x, const float *xsum) {
    float d[4] __attribute__((aligned(16)));
    __m128 low = code_scales(t, b, d);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const uint8_t *blk = b + i * t.bb;
        v16 s = (v16)code_values(t, blk, 0) * load16(x + 32 * i);
        s = fma16((v16)code_values(t, blk, 1), load16(x + 32 * i + 16), s);
        a->part[i] = fma_broadcast(s, &d[i], a->part[i]);
    }
    if (t.min_at >= 0) a->low = fma16((v16)_mm512_zextps128_ps512(low), load16(xsum), a->low);  /* lanes 4-15: 0 */
}

static inline __attribute__((always_inline)) void codes_unpack(const codes_t t, const uint8_t *b, float *q,
                                                               float *scale, float *low) {
    __m128 mins = code_scales(t, b, scale);
    if (t.min_at >= 0) _mm_storeu_ps(low, mins);
    for (int i = 0; i < 4; i++) {
        _mm512_storeu_ps(q + 32 * i, code_values(t, b + i * t.bb, 0));
        _mm512_storeu_ps(q + 32 * i + 16, code_values(t, b + i * t.bb, 1));
    }
}

#define CODES_TYPE(name, codes)                                                                                     \
    static inline void dot_##name(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {               \
        codes_dot(codes, a, b, x, xsum);                                                                           \
    }                                                                                                              \
    static inline void unpack_##name(const uint8_t *b, float *q, float *scale, float *low) {                      \
        codes_unpack(codes, b, q, scale, low);                                                                     \
    }
CODES_TYPE(q4_0, Q4_0_CODES)
CODES_TYPE(q4_1, Q4_1_CODES)
CODES_TYPE(q5_0, Q5_0_CODES)
CODES_TYPE(q5_1, Q5_1_CODES)
CODES_TYPE(iq4_nl, IQ4_NL_CODES)
CODES_TYPE(mxfp4, MXFP4_CODES)

/* IQ2_XS and IQ3_XXS on the grouped path, as dot_iq2_xxs: the values the grid points (as floats) with their sign
 * pattern's sign bits flipped by an xor (exact); `<type>_values(b, j)`: values 16j..16j + 15 of block b. */
static inline __attribute__((always_inline)) v16 signed_pair(const float *v0, const float *v1, const uint32_t *m0,
                                                             const uint32_t *m1) {   /* 8 + 8 values, xor'd signs */
    i32x8 a, b, s, t;
    memcpy(&a, v0, sizeof a);
    memcpy(&b, v1, sizeof b);
    memcpy(&s, m0, sizeof s);
    memcpy(&t, m1, sizeof t);
    return (v16)HALVES(a ^ s, b ^ t);
}

static inline __attribute__((always_inline)) v16 grid4_pair(const float *g0, const float *g1, const float *g2,
        const float *g3, const uint32_t *m0, const uint32_t *m1) {      /* four 4-value grid points, xor'd signs */
    __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(g0));
    v = _mm512_insertf32x4(v, _mm_loadu_ps(g1), 1);
    v = _mm512_insertf32x4(v, _mm_loadu_ps(g2), 2);
    v = _mm512_insertf32x4(v, _mm_loadu_ps(g3), 3);
    __m512i m = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)m0)),
                                   _mm256_loadu_si256((const __m256i *)m1), 1);
    return (v16)_mm512_xor_si512(_mm512_castps_si512(v), m);
}

/* IQ2_XS's 16 sub-block scales d*(0.5 + ls)/4 in order (iq2_sub_scales' even and odd ones interleaved) */
static inline void iq2_scales16(const uint8_t *b, const uint8_t *packed, float *scale) {
    float even[8], odd[8];
    iq2_sub_scales(half_to_float(b), packed, even, odd);
    for (int i = 0; i < 8; i++) {
        scale[2 * i] = even[i];
        scale[2 * i + 1] = odd[i];
    }
}

static inline v16 iq2_xs_values(const uint8_t *b, int j) {     /* chunks 2j, 2j + 1: u16 grid | ksigns index << 9 */
    uint16_t q0, q1;
    memcpy(&q0, b + 2 + 4 * j, 2);
    memcpy(&q1, b + 4 + 4 * j, 2);
    return signed_pair(iq2_xs_grid_floats[q0 & 511], iq2_xs_grid_floats[q1 & 511], iq2_sign_mask[q0 >> 9],
                       iq2_sign_mask[q1 >> 9]);
}

static inline v16 iq3_xxs_values(const uint8_t *b, int j) {    /* values 16j..: 4 grid points, 2 ksigns patterns */
    const uint8_t *qs = b + 2 + 4 * j, *aux = b + 66 + 4 * (j / 2);
    uint32_t bits;
    memcpy(&bits, aux, 4);
    int k = 2 * (j % 2);
    return grid4_pair(iq3_xxs_grid_floats[qs[0]], iq3_xxs_grid_floats[qs[1]], iq3_xxs_grid_floats[qs[2]],
                      iq3_xxs_grid_floats[qs[3]], iq2_sign_mask[(bits >> (7 * k)) & 127],
                      iq2_sign_mask[(bits >> (7 * k + 7)) & 127]);
}

static inline void iq3_xxs_scales(const uint8_t *b, float *scale) {     /* d * (0.5 + (bits >> 28)) * 0.5 per 32 */
    float d = half_to_float(b);
    for (int s = 0; s < 8; s++) {
        uint32_t bits;
        memcpy(&bits, b + 66 + 4 * s, 4);
        scale[s] = d * (0.5f + (float)(bits >> 28)) * 0.5f;
    }
}

/* IQ3_XXS: per sub-block of 32 values its scale after the dot (groups of 32, no mins). */
static inline void dot_iq3_xxs(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 98 bytes */
    (void)xsum;
    float scale[8] __attribute__((aligned(32)));
    iq3_xxs_scales(b, scale);
    for (int g = 0; g < 8; g++) scale[g] += 0.0f;     /* splat16's */
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        v16 t = iq3_xxs_values(b, 2 * g) * load16(x + 32 * g);
        t = fma16(iq3_xxs_values(b, 2 * g + 1), load16(x + 32 * g + 16), t);
        a->part[g % ACCS] = fma_broadcast(t, &scale[g], a->part[g % ACCS]);
    }
}

static inline void unpack_iq3_xxs(const uint8_t *b, float *q, float *scale, float *low) {    /* 98 bytes, G 32 */
    (void)low;
    iq3_xxs_scales(b, scale);
    for (int j = 0; j < 16; j++) store16(q + 16 * j, iq3_xxs_values(b, j));
}

/* IQ2_XS: its scale per 16 values applied to the values (the reference's dequantized values, exactly: the sign is an
 * xor) and the sums taken in groups of 64 with scale 1 (one multiply-add per 16 values per row at M > 1; the scale
 * after each 16 values' dot, as IQ3_XXS, measured 1.16x slower than dequantize-then-multiply at M = 16). */
static inline __attribute__((always_inline)) v16 iq2_xs_scaled(const uint8_t *b, int j, const float *scale) {
    return iq2_xs_values(b, j) * (v16)_mm512_set1_ps(scale[j]);
}

static inline void dot_iq2_xs(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 74 bytes */
    (void)xsum;
    float scale[16] __attribute__((aligned(64)));
    iq2_scales16(b, b + 66, scale);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        v16 t = iq2_xs_scaled(b, 4 * g, scale) * load16(x + 64 * g);
        for (int i = 1; i < 4; i++) t = fma16(iq2_xs_scaled(b, 4 * g + i, scale), load16(x + 64 * g + 16 * i), t);
        a->part[g] = fma16(splat16(1.0f), t, a->part[g]);
    }
}

static inline void unpack_iq2_xs(const uint8_t *b, float *q, float *scale, float *low) {    /* 74 bytes, G 64 */
    (void)low;
    float sub[16] __attribute__((aligned(64)));
    iq2_scales16(b, b + 66, sub);
    for (int j = 0; j < 16; j++) store16(q + 16 * j, iq2_xs_scaled(b, j, sub));
    for (int g = 0; g < 4; g++) scale[g] = 1.0f;
}

/* TQ2_0: d * (q - 1) with 2-bit q (element 128c + 32s + l: bits 2s of qs[32c + l]); the values -1, 0, 1 by one
 * vpermps each from the low 4 bits of a byte (or of the byte shifted by 4); groups of 64 scaled by d. */
static inline __attribute__((always_inline)) __m512 tq2_0_values(const uint8_t *b, int c, int s, int half) {
    static const float levels[2][16] __attribute__((aligned(64))) = {   /* bits 0-1 / 2-3 of a 4-bit index, minus 1 */
        {-1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2}, {-1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}};
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32 * c + 16 * half)));
    return _mm512_permutexvar_ps(s < 2 ? v : _mm512_srli_epi32(v, 4), _mm512_load_ps(levels[s % 2]));
}

static inline void dot_tq2_0(acc_t *a, const uint8_t *b, const float *x, const float *xsum) {    /* 66 bytes */
    (void)xsum;
    v16 d = splat16(half_to_float(b + 64));
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {       /* values 64g..64g + 63: c = g / 2, s = 2 (g % 2) and + 1 */
        v16 t = {0};
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            v16 q = (v16)tq2_0_values(b, g / 2, 2 * (g % 2) + i / 2, i % 2);
            t = i == 0 ? q * load16(x + 64 * g) : fma16(q, load16(x + 64 * g + 16 * i), t);
        }
        a->part[g] = fma16(d, t, a->part[g]);
    }
}

static inline void unpack_tq2_0(const uint8_t *b, float *q, float *scale, float *low) {    /* 66 bytes, G 64 */
    (void)low;
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(q + 16 * j, tq2_0_values(b, j / 8, (j / 2) % 4, j % 2));
    for (int g = 0; g < 4; g++) scale[g] = half_to_float(b + 64);
}

/* A type on the grouped path: rows of their own through `dot` (own_rows4), one weight for M > 1 rows through
 * `unpack` and add_block (rows_grouped); bs values in bb bytes, groups of G, `mins`: the type has group mins (each
 * row's sums of x per group made once per call). Returns 0, or -2 out of memory. */
static inline __attribute__((always_inline)) int grouped(
        dot_fn dot, unpack_fn unpack, const int bs, const int bb, const int G, const int mins, const uint8_t *w,
        int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K, const float *x, int64_t M, float *y,
        int64_t n0, int64_t n1) {
    if (experts != NULL || M == 1)
        return own_rows4(dot, bs, bb, mins ? G : 0, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
    float *xsum = mins ? group_sums(x, M, K, bs, G) : NULL;
    if (mins && xsum == NULL) return -2;
    rows_grouped(unpack, bs, bb, G, w, N, K, x, xsum, M, y, n0, n1);
    free(xsum);
    return 0;
}
#endif

/* qgemv's case for a type `t` (deq_t; dot_t and unpack_t where GROUPED) of `bs`-value blocks of `bb` bytes: rows of
 * whole `gbs`-value steps (`gbb` bytes, groups of `g`, `mins`: whether it has a min term) on the grouped path where
 * GROUPED, else (and for other rows) dequantize-then-multiply; ROWS: that only. */
#define ROWS(t, bs, bb) do { rows_of(deq_##t, bs, bb, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0; } \
    while (0)
#if GROUPED
#define GROUPED_OR_ROWS(t, bs, bb, gbs, gbb, g, mins) do { \
        if (K % (gbs) == 0) \
            return grouped(dot_##t, unpack_##t, gbs, gbb, g, mins, w, expert_bytes, experts, N, K, x, M, y, n0, n1); \
        ROWS(t, bs, bb); \
    } while (0)
#else
#define GROUPED_OR_ROWS(t, bs, bb, gbs, gbb, g, mins) ROWS(t, bs, bb)
#endif

/* y [M, N] rows [n0, n1) = x [M, K] @ W.T for a weight of GGUF block type `type` (0 F32, 1 F16, 8 Q8_0,
 * 12 Q4_K, 10 Q2_K, 16 IQ2_XXS after qgemv_set_iq2_xxs, 14 Q6_K, 13 Q5_K, 11 Q3_K, 2 Q4_0, 3 Q4_1,
 * 6 Q5_0, 7 Q5_1, 20 IQ4_NL, 23 IQ4_XS), M <= MAX_ROWS. experts == NULL: every row uses
 * `w`; else row m uses the weight at w + experts[m] * expert_bytes, and a row with experts[m] < 0 (an expert
 * another rank holds) is 0. Returns -1 for a call it cannot serve. */
static __attribute__((noinline)) int qgemv_types(int type, const uint8_t *w, int64_t expert_bytes,
        const int64_t *experts, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (M > MAX_ROWS) return -1;
    switch (type) {
    case 0: if (K % 64) return -1; rows_of(NULL, 64, 256, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 1: if (K % 32) return -1; ROWS(f16, 32, 64);
    case 8:
        if (K % 32) return -1;
#if GROUPED
        if (K % 128 == 0) {
            if (experts != NULL || M == 1) q8_0_own_rows(w, expert_bytes, experts, N, K, x, M, y, n0, n1);
            else q8_0_weight_rows(w, N, K, x, M, y, n0, n1);
            return 0;
        }
#endif
        if (M == 1 && experts == NULL) n0 = q8_0_rows(w, K, x, y, n0, n1);
        rows_of(deq_q8_0, 32, 34, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
        return 0;
    case 16:
        if (K % 256) return -1;
#if defined(__AVX512F__)
        if (experts != NULL || M == 1)
            return own_rows4(dot_iq2_xxs, 256, 66, 0, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
#endif
        if (GROUPED)
            rows_grouped(unpack_iq2_xxs, 256, 66, 32, w, N, K, x, NULL, M, y, n0, n1);
        else rows_of(deq_iq2_xxs, 256, 66, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
        return 0;
    case 12:
#if GROUPED
        if (K % 256 == 0 && (experts != NULL || M == 1)) {
#if Q4_K_DOT4
            float *xsum = group_sums(x, M, K, 256, 32);
            if (xsum == NULL) return -2;
            own_rows4_sums(dot_q4_k, dot4_q4_k, 256, 144, xsum, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
            free(xsum);
            return 0;
#else
            return own_rows4(dot_q4_k, 256, 144, 32, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
#endif
        }
#endif
        return K % 256 ? -1 : k_quant_rows(deq_q4_k, unpack_q4_k, 144, 32, w, expert_bytes, experts, N, K,
                                                x, M, y, n0, n1);
    case 10:
        if (K % 256) return -1;
#if defined(__AVX512F__)
        return two_bit_rows(q2_k_dot, q2_k_unpack, 84, 1, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
#else
        ROWS(q2_k, 256, 84);
#endif
    case 14: if (K % 256) return -1; GROUPED_OR_ROWS(q6_k, 256, 210, 256, 210, 64, 0);
    case 13: if (K % 256) return -1; GROUPED_OR_ROWS(q5_k, 256, 176, 256, 176, 32, 1);
    case 11:
        if (K % 256) return -1;
#if defined(__AVX512BW__)
        return two_bit_rows(q3_k_dot, q3_k_unpack, 110, 0, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
#else
        ROWS(q3_k, 256, 110);
#endif
    case 2: if (K % 32) return -1; GROUPED_OR_ROWS(q4_0, 32, 18, 128, 72, 32, 0);
    case 3: if (K % 32) return -1; GROUPED_OR_ROWS(q4_1, 32, 20, 128, 80, 32, 1);
    case 6: if (K % 32) return -1; GROUPED_OR_ROWS(q5_0, 32, 22, 128, 88, 32, 0);
    case 7: if (K % 32) return -1; GROUPED_OR_ROWS(q5_1, 32, 24, 128, 96, 32, 1);
    case 20: if (K % 32) return -1; GROUPED_OR_ROWS(iq4_nl, 32, 18, 128, 72, 32, 0);
    case 23: if (K % 256) return -1; GROUPED_OR_ROWS(iq4_xs, 256, 136, 256, 136, 32, 0);
    /* the IQ grids after qgemv_set_<type> and qgemv_set_iq_signs: 18 IQ3_XXS, 21 IQ3_S, 17 IQ2_XS, 22 IQ2_S, 19 IQ1_S,
     * 29 IQ1_M; 34 TQ1_0, 35 TQ2_0, 39 MXFP4, 30 BF16 (dequantize-then-multiply but IQ3_XXS, IQ2_XS, TQ2_0 and MXFP4
     * on AVX-512) */
    case 18: if (K % 256) return -1; GROUPED_OR_ROWS(iq3_xxs, 256, 98, 256, 98, 32, 0);
    case 21: if (K % 256) return -1; ROWS(iq3_s, 256, 110);
    case 17: if (K % 256) return -1; GROUPED_OR_ROWS(iq2_xs, 256, 74, 256, 74, 64, 0);
    case 22: if (K % 256) return -1; ROWS(iq2_s, 256, 82);
    case 19: if (K % 256) return -1; ROWS(iq1_s, 256, 50);
    case 29: if (K % 256) return -1; ROWS(iq1_m, 256, 56);
    case 34: if (K % 256) return -1; ROWS(tq1_0, 256, 54);
    case 35: if (K % 256) return -1; GROUPED_OR_ROWS(tq2_0, 256, 66, 256, 66, 64, 0);
    case 39: if (K % 32) return -1; GROUPED_OR_ROWS(mxfp4, 32, 17, 128, 68, 32, 0);
    case 30: if (K % 32) return -1; ROWS(bf16, 32, 64);
    default: return -1;
    }
}

/* qgemv_types, but exact Q4_K rows of one block (K = 256) of their own through q4_k_block_rows: outside qgemv_types,
 * whose code (the full-width kernels) it would change (inside it, the full-width Q4_K experts measured 2-3% slower). */
int qgemv(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
#if GROUPED
    if (type == 12 && K == 256 && M <= MAX_ROWS && (experts != NULL || M == 1)) {
        q4_k_block_rows(w, expert_bytes, experts, N, x, M, y, n0, n1);
        return 0;
    }
#endif
    return qgemv_types(type, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
}

static inline __attribute__((always_inline)) void blocks_of(deq_fn deq, int bs, int bb, const uint8_t *w,
                                                            int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks; b++) deq(w + b * bb, out + b * bs);
}

/* out [rows, K] = `rows` rows of a weight of block type `type` (as qgemv, but not F32), dequantized as the
 * reference does. Returns -1 for a type or row length it cannot serve. */
int dequantize(int type, const uint8_t *w, int64_t rows, int64_t K, float *out) {
    switch (type) {
    case 1: if (K % 32) return -1; blocks_of(deq_f16, 32, 64, w, rows * (K / 32), out); return 0;
    case 8: if (K % 32) return -1; blocks_of(deq_q8_0, 32, 34, w, rows * (K / 32), out); return 0;
    case 12: if (K % 256) return -1; blocks_of(deq_q4_k, 256, 144, w, rows * (K / 256), out); return 0;
    case 16: if (K % 256) return -1; blocks_of(deq_iq2_xxs, 256, 66, w, rows * (K / 256), out); return 0;
    case 10: if (K % 256) return -1; blocks_of(deq_q2_k, 256, 84, w, rows * (K / 256), out); return 0;
    case 14: if (K % 256) return -1; blocks_of(deq_q6_k, 256, 210, w, rows * (K / 256), out); return 0;
    case 13: if (K % 256) return -1; blocks_of(deq_q5_k, 256, 176, w, rows * (K / 256), out); return 0;
    case 11: if (K % 256) return -1; blocks_of(deq_q3_k, 256, 110, w, rows * (K / 256), out); return 0;
    case 2: if (K % 32) return -1; blocks_of(deq_q4_0, 32, 18, w, rows * (K / 32), out); return 0;
    case 3: if (K % 32) return -1; blocks_of(deq_q4_1, 32, 20, w, rows * (K / 32), out); return 0;
    case 6: if (K % 32) return -1; blocks_of(deq_q5_0, 32, 22, w, rows * (K / 32), out); return 0;
    case 7: if (K % 32) return -1; blocks_of(deq_q5_1, 32, 24, w, rows * (K / 32), out); return 0;
    case 20: if (K % 32) return -1; blocks_of(deq_iq4_nl, 32, 18, w, rows * (K / 32), out); return 0;
    case 23: if (K % 256) return -1; blocks_of(deq_iq4_xs, 256, 136, w, rows * (K / 256), out); return 0;
    case 18: if (K % 256) return -1; blocks_of(deq_iq3_xxs, 256, 98, w, rows * (K / 256), out); return 0;
    case 21: if (K % 256) return -1; blocks_of(deq_iq3_s, 256, 110, w, rows * (K / 256), out); return 0;
    case 17: if (K % 256) return -1; blocks_of(deq_iq2_xs, 256, 74, w, rows * (K / 256), out); return 0;
    case 22: if (K % 256) return -1; blocks_of(deq_iq2_s, 256, 82, w, rows * (K / 256), out); return 0;
    case 19: if (K % 256) return -1; blocks_of(deq_iq1_s, 256, 50, w, rows * (K / 256), out); return 0;
    case 29: if (K % 256) return -1; blocks_of(deq_iq1_m, 256, 56, w, rows * (K / 256), out); return 0;
    case 34: if (K % 256) return -1; blocks_of(deq_tq1_0, 256, 54, w, rows * (K / 256), out); return 0;
    case 35: if (K % 256) return -1; blocks_of(deq_tq2_0, 256, 66, w, rows * (K / 256), out); return 0;
    case 39: if (K % 32) return -1; blocks_of(deq_mxfp4, 32, 17, w, rows * (K / 32), out); return 0;
    case 30: if (K % 32) return -1; blocks_of(deq_bf16, 32, 64, w, rows * (K / 32), out); return 0;
    default: return -1;
    }
}
