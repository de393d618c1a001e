/* Fused dequantize-and-multiply for few rows (decode and verify): y[m, n] = sum_k W[n, k] * x[m, k].
 *
 * Each block of W is dequantized exactly as the reference does (ops/quants/<type>.py: the same float
 * products, no fused multiply-add) into a small buffer and used at once by every row (F32 blocks are read
 * in place), so W is read once per call and never materialized; every cache line of the weight stream is
 * prefetched AHEAD bytes ahead. Each output is accumulated in 16 lanes (element k goes to lane k % 16,
 * two 8-float vectors) over the whole row, then the lanes are added in order: the same arithmetic for any
 * number of rows and any split of the output rows across threads, hence batch-invariant. `dequantize`
 * expands whole rows with the same block functions (prefill's tiles). On AVX-512 targets the grouped kernels
 * (further down) serve Q8_0, Q4_K, Q2_K and IQ2_XXS instead. A new block type plugs in as a deq_<type>
 * function (block -> floats) and a case in `qgemv` and `dequantize`. Built by backends/cpu/kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
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

static inline void deq_q4_k(const uint8_t *b, float *w) {          /* 144 bytes -> 256 values */
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    float scale[8], low[8];
    for (int j = 0; j < 4; j++) {
        scale[j] = d * (float)(s[j] & 63);
        low[j] = dmin * (float)(s[4 + j] & 63);
        scale[4 + j] = d * (float)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        low[4 + j] = dmin * (float)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
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
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + 48;
    float scale[8], low[8];
    for (int j = 0; j < 4; j++) {                           /* the 6-bit (scale, min) pairs, as Q4_K */
        scale[j] = d * (float)(s[j] & 63);
        low[j] = dmin * (float)(s[4 + j] & 63);
        scale[4 + j] = d * (float)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        low[4 + j] = dmin * (float)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
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

static float iq2_grid[256][8];          /* set by qgemv_set_iq2_xxs from ops/quants/iq2_xxs.py's tables */
static uint8_t iq2_ksigns[128];
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

/* Output rows [n0, n1) of y [M, N] for one block type (inlined per type, so the dequantization is too);
 * deq == NULL: F32, read in place. */
static inline __attribute__((always_inline)) void rows_of(
        deq_fn deq, const int bs, const int bb, const uint8_t *w, int64_t expert_bytes, const int64_t *experts,
        int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / bs, row_bytes = nb * bb;
    float wblk[256];
    if (experts != NULL || M == 1) {    /* a weight of its own per row: one stream each, lanes in registers */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) {
                if (experts != NULL && experts[m] < 0) { y[m * N + n] = 0.0f; continue; }  /* another rank's */
                const uint8_t *row = w + (experts == NULL ? 0 : experts[m] * expert_bytes) + n * row_bytes;
                v8 lo = {0}, hi = {0};
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = row + b * bb;
                    prefetch_block(blk, bb);
                    if (deq != NULL) deq(blk, wblk);
                    dot_block(&lo, &hi, deq == NULL ? (const float *)blk : wblk, x + m * K + b * bs, bs);
                }
                y[m * N + n] = lane_sum(lo, hi);
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

/* Q8_0 decode (M == 1) rows [n0, n1) in pairs, dequantized in registers: the two rows' lanes are independent
 * chains. Returns the first row not done (an odd last one, left to rows_of). */
static int64_t q8_0_row_pairs(const uint8_t *w, int64_t K, const float *x, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / 32, row_bytes = nb * 34, n = n0;
    for (; n + 2 <= n1; n += 2) {
        v8 lo0 = {0}, hi0 = {0}, lo1 = {0}, hi1 = {0};
        const uint8_t *r0 = w + n * row_bytes, *r1 = r0 + row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            prefetch_block(r0 + b * 34, 34);
            prefetch_block(r1 + b * 34, 34);
            q8_0_dot(&lo0, &hi0, r0 + b * 34, x + b * 32);
            q8_0_dot(&lo1, &hi1, r1 + b * 34, x + b * 32);
        }
        y[n] = lane_sum(lo0, hi0);
        y[n + 1] = lane_sum(lo1, hi1);
    }
    return n;
}

/* The grouped kernels (Q8_0 four blocks at a time, Q4_K, Q2_K, IQ2_XXS; where the target has 16-float
 * vectors, AVX-512: elsewhere gcc splits them badly and rows_of serves these types): a block is unpacked once
 * into its integer values as floats (IQ2_XXS: the signed grid values) and one scale (and min) per group of G
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

static inline void unpack_q8_0x4(const uint8_t *b, float *q, float *scale, float *low) {   /* 4 x 34 bytes */
    (void)low;
    for (int t = 0; t < 4; t++, b += 34) {
        scale[t] = half_to_float(b);
        for (int i = 0; i < 32; i += 16) store16(q + 32 * t + i, float16((widen16(b + 2 + i) ^ 128) - 128));
    }
}

static inline void unpack_q4_k(const uint8_t *b, float *q, float *scale, float *low) {    /* 144 bytes, G 32 */
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int j = 0; j < 4; j++) {
        scale[j] = d * (float)(s[j] & 63);
        low[j] = dmin * (float)(s[4 + j] & 63);
        scale[4 + j] = d * (float)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        low[4 + j] = dmin * (float)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l += 16) {
            i32x16 v = widen16(qs + 32 * c + l);
            store16(q + 64 * c + l, float16(v & 15));
            store16(q + 64 * c + 32 + l, float16(v >> 4));
        }
}

static inline void unpack_q2_k(const uint8_t *b, float *q, float *scale, float *low) {    /* 84 bytes, G 16 */
    float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    const uint8_t *s = b, *qs = b + 16;
    i32x16 sv = widen16(s);
    store16(scale, splat16(d) * float16(sv & 15));
    store16(low, splat16(dmin) * float16(sv >> 4));
    for (int k = 0; k < 2; k++)
        for (int h = 0; h < 2; h++) {
            i32x16 v = widen16(qs + 32 * k + 16 * h);
            for (int i = 0; i < 4; i++) store16(q + 128 * k + 32 * i + 16 * h, float16((v >> (2 * i)) & 3));
        }
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
 * reloading them. Measured for IQ2_XXS 9-10% faster at M = 1; for Q2_K no faster, so Q2_K has none. */
typedef void (*dot_fn)(acc_t *, const uint8_t *, const float *);     /* types without group mins */

static inline void dot_iq2_xxs(acc_t *a, const uint8_t *b, const float *x) {
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

/* Output rows [n0, n1) of y [M, N] through a grouped unpacker (bs values in bb bytes, groups of G values,
 * each a multiple of ACCS groups per block; a row of its own through `dot` where not NULL); xsum: each row's
 * sums of x per group, 16 per block (or NULL). */
static inline __attribute__((always_inline)) void rows_grouped(
        unpack_fn unpack, dot_fn dot, const int bs, const int bb, const int G, const uint8_t *w,
        int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K, const float *x, const float *xsum,
        int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / bs, row_bytes = nb * bb;
    const int ng = bs / G;
    float q[256] __attribute__((aligned(64))), scale[16], low[16] __attribute__((aligned(64))) = {0};
    const float *lows = xsum == NULL ? NULL : low;
    acc_t acc[MAX_ROWS];
    if (experts != NULL || M == 1) {    /* a weight of its own per row */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *row = w + (experts == NULL ? 0 : experts[m] * expert_bytes) + n * row_bytes;
                acc_t a = {0};
                for (int64_t b = 0; b < nb; b++) {
                    prefetch_block(row + b * bb, bb);
                    if (dot != NULL) {
                        dot(&a, row + b * bb, x + m * K + b * bs);
                        continue;
                    }
                    unpack(row + b * bb, q, scale, low);
                    add_block(&a, q, scale, lows, ng, G, x + m * K + b * bs,
                              xsum == NULL ? NULL : xsum + (m * nb + b) * 16);
                }
                y[m * N + n] = finish(&a, lows != NULL);
            }
        return;
    }
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
 * lanes 0). The caller frees the result; NULL when out of memory. */
static float *group_sums(const float *x, int64_t M, int64_t K, int bs, int G) {
    int64_t nb = K / bs;
    float *out = calloc((size_t)(M * nb * 16), sizeof(float));
    if (out == NULL) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++)
            for (int g = 0; g < bs / G; g++) {
                float s = 0.0f;
                for (int i = 0; i < G; i++) s += x[m * K + b * bs + g * G + i];
                out[(m * nb + b) * 16 + g] = s;
            }
    return out;
}

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
    rows_grouped(unpack, NULL, 256, bb, G, w, expert_bytes, experts, N, K, x, xsum, M, y, n0, n1);
    free(xsum);
    return 0;
}

/* y [M, N] rows [n0, n1) = x [M, K] @ W.T for a weight of GGUF block type `type` (0 F32, 1 F16, 8 Q8_0,
 * 12 Q4_K, 10 Q2_K, 16 IQ2_XXS after qgemv_set_iq2_xxs, 14 Q6_K, 13 Q5_K, 11 Q3_K, 2 Q4_0, 3 Q4_1,
 * 6 Q5_0, 7 Q5_1, 20 IQ4_NL, 23 IQ4_XS), M <= MAX_ROWS. experts == NULL: every row uses
 * `w`; else row m uses the weight at w + experts[m] * expert_bytes, and a row with experts[m] < 0 (an expert
 * another rank holds) is 0. Returns -1 for a call it cannot serve. */
int qgemv(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (M > MAX_ROWS) return -1;
    switch (type) {
    case 0: if (K % 64) return -1; rows_of(NULL, 64, 256, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 1: if (K % 32) return -1; rows_of(deq_f16, 32, 64, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 8:
        if (K % 32) return -1;
        if (GROUPED && K % 128 == 0) {
            rows_grouped(unpack_q8_0x4, NULL, 128, 136, 32, w, expert_bytes, experts, N, K, x, NULL, M, y, n0, n1);
            return 0;
        }
        if (M == 1 && experts == NULL) n0 = q8_0_row_pairs(w, K, x, y, n0, n1);
        rows_of(deq_q8_0, 32, 34, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
        return 0;
    case 16:
        if (K % 256) return -1;
        if (GROUPED)
            rows_grouped(unpack_iq2_xxs, dot_iq2_xxs, 256, 66, 32, w, expert_bytes, experts, N, K, x, NULL, M, y,
                         n0, n1);
        else rows_of(deq_iq2_xxs, 256, 66, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
        return 0;
    case 12: return K % 256 ? -1 : k_quant_rows(deq_q4_k, unpack_q4_k, 144, 32, w, expert_bytes, experts, N, K,
                                                x, M, y, n0, n1);
    case 10: return K % 256 ? -1 : k_quant_rows(deq_q2_k, unpack_q2_k, 84, 16, w, expert_bytes, experts, N, K,
                                                x, M, y, n0, n1);
    case 14: if (K % 256) return -1; rows_of(deq_q6_k, 256, 210, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 13: if (K % 256) return -1; rows_of(deq_q5_k, 256, 176, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 11: if (K % 256) return -1; rows_of(deq_q3_k, 256, 110, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 2: if (K % 32) return -1; rows_of(deq_q4_0, 32, 18, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 3: if (K % 32) return -1; rows_of(deq_q4_1, 32, 20, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 6: if (K % 32) return -1; rows_of(deq_q5_0, 32, 22, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 7: if (K % 32) return -1; rows_of(deq_q5_1, 32, 24, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 20: if (K % 32) return -1; rows_of(deq_iq4_nl, 32, 18, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 23: if (K % 256) return -1; rows_of(deq_iq4_xs, 256, 136, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    default: return -1;
    }
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
    default: return -1;
    }
}
