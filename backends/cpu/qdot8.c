/* The opt-in 8-bit-activation dot product (`--cpu-dot q8`): y[m, n] = sum_k W[n, k] * x[m, k] with x rounded
 * to 8 bits per block, as llama.cpp's CPU kernels do (the numerics and their PyTorch reference:
 * ops/q8_activations.py). `q8_quantize` rounds the activations once per call (Q8_K: 256 values, a float
 * scale, the sums of each 16 quants; Q8_0: 32 values, an f16 scale; Q8_1: Q8_0 and an f16 scaled sum; for F16
 * and BF16 weights each value to the nearest f16 / bf16); `qdot8` multiplies every weight block
 * with its activation block in integers (maddubs/madd on AVX2; the IQ codebook and TQ types 64 values a step on
 * AVX-512 with VBMI/BITALG/VNNI; a plain C loop elsewhere: the same exact integers everywhere) and adds the blocks' float
 * terms in block order (Q8_0 in whole blocks, as qgemm8.c; Q4_0, Q5_0, IQ4_NL, MXFP4, Q4_1, Q5_1 in 8 lanes, then
 * the lanes in order). Each output's arithmetic depends only on its row and its weight row, so the result is the
 * same for any M and any split of the output rows across threads (batch-invariant). Built with qgemv.c by backends/cpu/kernels.py.
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include "half.h"
#include "zen.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include "iq2_xxs_groups.h"

#define Q8_MAX_ROWS 16
#define Q8_AHEAD 2048       /* bytes of the weight stream prefetched ahead */

typedef struct { int8_t qs[256]; float d; int16_t bsums[16]; int8_t pad[28]; } q8k_block; /* 320: whole lines */
typedef struct { float d; int8_t qs[32]; } q8_0_block;                       /* 36 bytes */
typedef struct { float d, s; int8_t qs[32]; } q8_1_block;                    /* 40 bytes */

static float q8_bits_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint32_t q8_float_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return bits;
}

static float q8_round_half(float f) {    /* a finite f >= 0 rounded to the nearest f16 (ties to even), as float */
    if (f >= 65520.0f) return INFINITY;
    if (f < 6.103515625e-05f) return nearbyintf(f * 16777216.0f) / 16777216.0f;    /* f16 subnormals: 2^-24 */
    uint32_t bits = q8_float_bits(f);
    bits += 0xfff + ((bits >> 13) & 1);
    return q8_bits_float(bits & ~0x1fffu);
}

static inline int q8_nearest(float v) {     /* round to nearest, ties to even (|v| < 2^22) */
    float t = v + 12582912.0f;
    return (int)(q8_float_bits(t) & 0x007fffff) - 0x00400000;
}

/* One block of 32 values rounded as llama.cpp's quantize_row_q8_0_ref: amax = the largest |x_j| (a NaN ignored, as
 * fmaxf), d = amax / 127, q_j = roundf(x_j / d) (halves away from zero; 0 where d is 0); returns d (unrounded). With
 * AVX-512 the same float operations 16 lanes at a time: the maximum is exact in any order, roundf is the truncation
 * plus one away from zero where the exact remainder is at least a half, and the conversion to int8 keeps the low byte
 * of the int32 (as the scalar cast does), so the same bits. */
static inline float q8_0_round(const float *x, int8_t *qs) {
#if defined(__AVX512F__)
    __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    __m512 peak = _mm512_max_ps(_mm512_abs_ps(hi), _mm512_max_ps(_mm512_abs_ps(lo), _mm512_setzero_ps()));
    float d = _mm512_reduce_max_ps(peak) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 scale = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (int h = 0; h < 2; h++) {
        __m512 v = _mm512_mul_ps(h ? hi : lo, scale);
        __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
        t = _mm512_mask_add_ps(t, up, t, _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(one), _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)))));
        _mm_storeu_si128((__m128i *)(qs + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(t)));
    }
    return d;
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) qs[j] = (int8_t)roundf(x[j] * id);
    return d;
#endif
}

/* Rows of x [M, K] rounded to Q8_K (kind 0, K % 256 == 0) or Q8_0 (kind 1, K % 32 == 0) blocks into `out`
 * (M * K/256 q8k_block or M * K/32 q8_0_block), Q8_1 (kind 3: M * K/32 q8_1_block) or (kind 2, kind 4; K % 32 == 0)
 * each value to the nearest f16 (bf16), as M * K floats. Returns -1 for a kind or K it cannot serve. */
int q8_quantize(int kind, const float *x, int64_t M, int64_t K, void *out) {
    if (kind == 0) {
        if (K % 256) return -1;
        q8k_block *y = out;
        for (int64_t b = 0; b < M * (K / 256); b++, x += 256) {
            float amax = 0.0f, peak = 0.0f;
            for (int j = 0; j < 256; j++) {
                float a = fabsf(x[j]);
                if (a > amax) { amax = a; peak = x[j]; }
            }
            if (amax == 0.0f) { memset(&y[b], 0, sizeof y[b]); continue; }
            float iscale = -127.0f / peak;
            for (int j = 0; j < 256; j++) {
                int v = q8_nearest(iscale * x[j]);
                y[b].qs[j] = (int8_t)(v < 127 ? v : 127);
            }
            for (int j = 0; j < 16; j++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += y[b].qs[16 * j + i];
                y[b].bsums[j] = (int16_t)s;
            }
            y[b].d = 1.0f / iscale;
        }
        return 0;
    }
    if (kind == 1) {
        if (K % 32) return -1;
        q8_0_block *y = out;
        for (int64_t b = 0; b < M * (K / 32); b++, x += 32) y[b].d = q8_round_half(q8_0_round(x, y[b].qs));
        return 0;
    }
    if (kind == 3) {                /* Q8_1: Q8_0's d and quants, s = f16(d * sum of the quants), d unrounded */
        if (K % 32) return -1;
        q8_1_block *y = out;
        for (int64_t b = 0; b < M * (K / 32); b++, x += 32) {
            float d = q8_0_round(x, y[b].qs);
            int sum = 0;
            for (int j = 0; j < 32; j++) sum += y[b].qs[j];
            float s = (float)sum * d;
            y[b].d = q8_round_half(d);
            y[b].s = copysignf(q8_round_half(fabsf(s)), s);
        }
        return 0;
    }
    if (kind == 4) {                /* each value to the nearest bf16 (ties to even; a NaN stays a NaN) */
        if (K % 32) return -1;
        float *y = out;
        for (int64_t i = 0; i < M * K; i++) {
            uint32_t bits = q8_float_bits(x[i]);
            if ((bits & 0x7fffffffu) > 0x7f800000u) { y[i] = x[i]; continue; }
            y[i] = q8_bits_float((bits + 0x7fffu + ((bits >> 16) & 1)) & 0xffff0000u);
        }
        return 0;
    }
    if (kind == 2) {
        if (K % 32) return -1;
        float *y = out;
        int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= M * K; i += 8)              /* the same rounding (to nearest, ties to even) 8 at a time */
            _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
        for (; i < M * K; i++) y[i] = copysignf(q8_round_half(fabsf(x[i])), x[i]);
        return 0;
    }
    return -1;
}

uint64_t iq2_grid_bytes[256];    /* set by qdot8_set_iq2_xxs: the 8 grid values of each index, as bytes */
static uint64_t iq2_sign_bytes[128];    /* the 8 signs (+1 / -1 bytes) of each 7-bit sign index */
uint8_t iq2_ksigns_bytes[128];          /* set by qdot8_set_iq2_xxs: ksigns as bytes */
uint8_t iq2_code_bytes[2][256] __attribute__((aligned(64)));   /* set by qdot8_set_iq2_xxs: each grid row's 8 values
                                                                 * as 2-bit codes (value j in bits 2 j of a 16-bit
                                                                 * word: 0, 1, 2 for 8, 25, 43), low and high bytes */

void qdot8_set_iq2_xxs(const uint8_t *grid, const int64_t *ksigns) {
    memcpy(iq2_grid_bytes, grid, sizeof iq2_grid_bytes);
    for (int i = 0; i < 256; i++) {
        int word = 0;
        for (int j = 0; j < 8; j++) word |= (grid[8 * i + j] == 25 ? 1 : grid[8 * i + j] == 43 ? 2 : 0) << (2 * j);
        iq2_code_bytes[0][i] = (uint8_t)word;
        iq2_code_bytes[1][i] = (uint8_t)(word >> 8);
    }
    for (int i = 0; i < 128; i++) {
        iq2_ksigns_bytes[i] = (uint8_t)ksigns[i];
        uint64_t s = 0;
        for (int j = 0; j < 8; j++) s |= (uint64_t)(((ksigns[i] >> j) & 1) ? 0xff : 0x01) << (8 * j);
        iq2_sign_bytes[i] = s;
    }
}

#if defined(__AVX2__)
static inline int hsum_i32(__m256i v) {        /* the 8 lanes added (integers: any order is exact) */
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define IQ2_VECTOR 1
#endif

/* IQ2_XXS (66 bytes) against a Q8_K block: d_w d_x bsum (the 0.125 is applied per output). */
static inline float dot_iq2_xxs(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *p = b + 2;
    int bsum = 0;
#if defined(IQ2_VECTOR)
    (void)p;
    bsum = _mm512_reduce_add_epi32(iq2_xxs_sums(b, y->qs));
#elif defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++, p += 8) {
        uint32_t bits;
        memcpy(&bits, p + 4, 4);
        __m256i grid = _mm256_set_epi64x((long long)iq2_grid_bytes[p[3]], (long long)iq2_grid_bytes[p[2]],
                                         (long long)iq2_grid_bytes[p[1]], (long long)iq2_grid_bytes[p[0]]);
        __m256i sign = _mm256_set_epi64x((long long)iq2_sign_bytes[(bits >> 21) & 127],
                                         (long long)iq2_sign_bytes[(bits >> 14) & 127],
                                         (long long)iq2_sign_bytes[(bits >> 7) & 127],
                                         (long long)iq2_sign_bytes[bits & 127]);
        __m256i prod = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(load256(y->qs + 32 * g), sign));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16((short)(2 * (bits >> 28) + 1))));
    }
    bsum = hsum_i32(acc);
#else
    for (int g = 0; g < 8; g++, p += 8) {
        uint32_t bits = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        int sumi = 0;
        for (int l = 0; l < 4; l++) {
            const int8_t *sign = (const int8_t *)&iq2_sign_bytes[(bits >> (7 * l)) & 127];
            const uint8_t *grid = (const uint8_t *)&iq2_grid_bytes[p[l]];
            for (int j = 0; j < 8; j++) sumi += grid[j] * sign[j] * y->qs[32 * g + 8 * l + j];
        }
        bsum += (int)(2 * (bits >> 28) + 1) * sumi;
    }
#endif
    return (f16_to_f32(b) * y->d) * (float)bsum;
}

#if defined(__AVX2__)
static const uint8_t pair_shuffle[8][32] = {     /* int16 lanes 0-7 <- scale byte 2i, lanes 8-15 <- byte 2i+1 */
#define PAIR(i) {i, 128, i, 128, i, 128, i, 128, i, 128, i, 128, i, 128, i, 128, \
                  i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128}
    PAIR(0), PAIR(2), PAIR(4), PAIR(6), PAIR(8), PAIR(10), PAIR(12), PAIR(14)
#undef PAIR
};
#endif

/* Q2_K (84 bytes) against a Q8_K block: (d_x d) isum - (d_x dmin) msum. */
static inline float dot_q2_k(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *sc = b, *qs = b + 16;
    int isum = 0, msum = 0;
#if defined(__AVX2__)
    __m128i scales = _mm_loadu_si128((const __m128i *)sc);
    __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scales, 4), _mm_set1_epi8(15)));
    msum = hsum_i32(_mm256_madd_epi16(mins, load256(y->bsums)));
    __m256i low = _mm256_broadcastsi128_si256(_mm_and_si128(scales, _mm_set1_epi8(15)));
    __m256i three = _mm256_set1_epi8(3), acc = _mm256_setzero_si256();
    for (int k = 0; k < 2; k++) {
        __m256i q2 = load256(qs + 32 * k);
        for (int i = 0; i < 4; i++) {               /* elements 128k + 32i + (0..31): scales 8k+2i, 8k+2i+1 */
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(q2, 2 * i), three);
            __m256i prod = _mm256_maddubs_epi16(q, load256(y->qs + 128 * k + 32 * i));
            __m256i scale = _mm256_shuffle_epi8(low, load256(pair_shuffle[4 * k + i]));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, scale));
        }
    }
    isum = hsum_i32(acc);
#else
    for (int j = 0; j < 16; j++) msum += y->bsums[j] * (sc[j] >> 4);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 4; i++)
            for (int h = 0; h < 2; h++) {
                int s = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) s += ((qs[32 * k + l] >> (2 * i)) & 3) * y->qs[128 * k + 32 * i + l];
                isum += (sc[8 * k + 2 * i + h] & 15) * s;
            }
#endif
    return (y->d * f16_to_f32(b + 80)) * (float)isum - (y->d * f16_to_f32(b + 82)) * (float)msum;
}

/* Q4_K (144 bytes) against a Q8_K block: (d_x d) isum - (d_x dmin) msum. */
static inline float dot_q4_k(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *s = b + 4, *qs = b + 16;
    int isum = 0, msum = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* A whole block in two vectors: int16 lanes 0-7 of `six` the scales, 8-15 the mins (the 6-bit unpack done on
     * 32-bit words); each 512-bit product covers two 32-byte chunks (four groups), scaled per group by vpdpwssd. */
    uint32_t u[3];
    memcpy(u, s, 12);
    __m128i packed = _mm_set_epi32((int)(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)),
                                   (int)(u[1] & 0x3f3f3f3fu),
                                   (int)((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)),
                                   (int)(u[0] & 0x3f3f3f3fu));
    __m512i six = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(packed));
    __m256i mins = _mm512_castsi512_si256(_mm512_permutexvar_epi16(
        _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                         15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), six));
    msum = hsum_i32(_mm256_madd_epi16(mins, load256(y->bsums)));
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {      /* chunks 2h and 2h + 1: groups 4h..4h+3 */
        __m512i q4 = _mm512_loadu_si512(qs + 64 * h);
        const int8_t *a = y->qs + 128 * h;
        __m512i x_lo = _mm512_inserti64x4(_mm512_castsi256_si512(load256(a)), load256(a + 64), 1);
        __m512i x_hi = _mm512_inserti64x4(_mm512_castsi256_si512(load256(a + 32)), load256(a + 96), 1);
        __m512i lo = _mm512_maddubs_epi16(_mm512_and_si512(q4, nibble), x_lo);
        __m512i hi = _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(q4, 4), nibble), x_hi);
        __m512i s_lo = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(4 * h)),
                                                                   _mm256_set1_epi16((short)(4 * h + 2)), 1), six);
        __m512i s_hi = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(4 * h + 1)),
                                                                   _mm256_set1_epi16((short)(4 * h + 3)), 1), six);
        acc = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc, lo, s_lo), hi, s_hi);
    }
    isum = _mm512_reduce_add_epi32(acc);
#else
    int scale[8], low[8];
    for (int j = 0; j < 4; j++) {
        scale[j] = s[j] & 63;
        low[j] = s[4 + j] & 63;
        scale[4 + j] = (s[8 + j] & 15) | ((s[j] >> 6) << 4);
        low[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
    }
    for (int j = 0; j < 8; j++) msum += low[j] * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
#if defined(__AVX2__)
    __m256i nibble = _mm256_set1_epi8(15), acc = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i q4 = load256(qs + 32 * c);
        __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(q4, nibble), load256(y->qs + 64 * c));
        __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q4, 4), nibble), load256(y->qs + 64 * c + 32));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, _mm256_set1_epi16((short)scale[2 * c])));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_set1_epi16((short)scale[2 * c + 1])));
    }
    isum = hsum_i32(acc);
#else
    for (int c = 0; c < 4; c++) {
        int lo = 0, hi = 0;
        for (int l = 0; l < 32; l++) {
            lo += (qs[32 * c + l] & 15) * y->qs[64 * c + l];
            hi += (qs[32 * c + l] >> 4) * y->qs[64 * c + 32 + l];
        }
        isum += scale[2 * c] * lo + scale[2 * c + 1] * hi;
    }
#endif
#endif
    return (y->d * f16_to_f32(b)) * (float)isum - (y->d * f16_to_f32(b + 2)) * (float)msum;
}

static inline int q3_k_scale(const uint8_t *s, int j) {      /* Q3_K's signed 6-bit scale j (-32..31) */
    return (((s[j % 8] >> (4 * (j / 8))) & 15) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

#if defined(__AVX2__)
static const uint8_t signed_pair_shuffle[8][32] = {  /* int16 lanes 0-7 <- byte 2i << 8, lanes 8-15 <- byte 2i+1 << 8 */
#define PAIR_HIGH(i) {128, i, 128, i, 128, i, 128, i, 128, i, 128, i, 128, i, 128, i, \
                      128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1, 128, i + 1}
    PAIR_HIGH(0), PAIR_HIGH(2), PAIR_HIGH(4), PAIR_HIGH(6), PAIR_HIGH(8), PAIR_HIGH(10), PAIR_HIGH(12), PAIR_HIGH(14)
#undef PAIR_HIGH
};

static inline __m256i scale_pair(int lo, int hi) {     /* int16 lanes 0-7 = lo, 8-15 = hi */
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}
#endif

/* Q3_K (110 bytes: hmask, qs, scales, d) against a Q8_K block: (d_x d) isum, the codes q - 4 (1 - h). */
static inline float dot_q3_k(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    int isum = 0;
#if defined(__AVX2__)
    uint32_t aux[4];                                /* the 16 scales + 32 as bytes (llama.cpp's unpacking) */
    memcpy(aux, s, 12);
    uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & 0x0f0f0f0f) | (((tmp >> 4) & 0x03030303) << 4);
    aux[3] = ((aux[1] >> 4) & 0x0f0f0f0f) | (((tmp >> 6) & 0x03030303) << 4);
    aux[0] = (aux[0] & 0x0f0f0f0f) | ((tmp & 0x03030303) << 4);
    aux[1] = (aux[1] & 0x0f0f0f0f) | (((tmp >> 2) & 0x03030303) << 4);
#if AMD_ZEN
    /* on AMD Zen each pair by one byte shuffle of the 16 signed scales (as dot_q6_k): 0.95x (M = 1) and 0.91x (M = 4)
     * the time of the pairs set from scalars, which on an Intel core measured 1.27x the other way */
    __m256i scales = _mm256_broadcastsi128_si256(_mm_sub_epi8(_mm_loadu_si128((const __m128i *)aux), _mm_set1_epi8(32)));
#else
    const uint8_t *biased = (const uint8_t *)aux;
#endif
    __m256i missing = _mm256_andnot_si256(load256(hm), _mm256_set1_epi8(-1));    /* high bits cleared: -4 */
    __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), acc = _mm256_setzero_si256();
    for (int c = 0; c < 2; c++) {
        __m256i q3 = load256(qs + 32 * c);
        for (int i = 0; i < 4; i++) {               /* elements 128c + 32i + (0..31): scales 8c+2i, 8c+2i+1 */
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(q3, 2 * i), three);
            __m256i four = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(missing, 4 * c + i), one), 2);
            __m256i q8 = load256(y->qs + 128 * c + 32 * i);
            __m256i prod = _mm256_sub_epi16(_mm256_maddubs_epi16(q, q8), _mm256_maddubs_epi16(four, q8));
#if AMD_ZEN
            __m256i scale = _mm256_srai_epi16(_mm256_shuffle_epi8(scales, load256(signed_pair_shuffle[4 * c + i])), 8);
#else
            __m256i scale = scale_pair(biased[8 * c + 2 * i] - 32, biased[8 * c + 2 * i + 1] - 32);
#endif
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, scale));
        }
    }
    isum = hsum_i32(acc);
#else
    int scale[16];
    for (int j = 0; j < 16; j++) scale[j] = q3_k_scale(s, j);
    for (int e = 0; e < 256; e += 16) {
        int sumi = 0;
        for (int l = e; l < e + 16; l++) {
            int q = ((qs[32 * (l / 128) + l % 32] >> (2 * ((l / 32) % 4))) & 3) - ((hm[l % 32] >> (l / 32)) & 1 ? 0 : 4);
            sumi += q * y->qs[l];
        }
        isum += scale[e / 16] * sumi;
    }
#endif
    return (f16_to_f32(b + 108) * y->d) * (float)isum;
}

static inline void k_scale_min(const uint8_t *s, uint32_t u[4]) {  /* Q5_K's 6-bit pairs: 8 scale bytes, 8 mins */
    memcpy(u, s, 12);                               /* llama.cpp's unpacking */
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    uint32_t mins_low = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_low;
    u[0] &= 0x3f3f3f3f;
}

/* Q5_K (176 bytes: d, dmin, scales, qh, qs) against a Q8_K block: (d_x d) isum - (d_x dmin) msum. */
static inline float dot_q5_k(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *qh = b + 16, *qs = b + 48;
    uint32_t u[4];
    k_scale_min(b + 4, u);
    const uint8_t *scale = (const uint8_t *)u, *low = scale + 8;
    int isum = 0, msum = 0;
    for (int j = 0; j < 8; j++) msum += low[j] * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
#if defined(__AVX2__)
    __m256i nibble = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), high = load256(qh);
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i q4 = load256(qs + 32 * c);
        __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c), one), 4);
        __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c + 1), one), 4);
        __m256i lo = _mm256_or_si256(_mm256_and_si256(q4, nibble), h0);
        __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), nibble), h1);
        lo = _mm256_maddubs_epi16(lo, load256(y->qs + 64 * c));
        hi = _mm256_maddubs_epi16(hi, load256(y->qs + 64 * c + 32));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, _mm256_set1_epi16((short)scale[2 * c])));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_set1_epi16((short)scale[2 * c + 1])));
    }
    isum = hsum_i32(acc);
#else
    for (int c = 0; c < 4; c++) {
        int lo = 0, hi = 0;
        for (int l = 0; l < 32; l++) {
            lo += ((qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4)) * y->qs[64 * c + l];
            hi += ((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4)) * y->qs[64 * c + 32 + l];
        }
        isum += scale[2 * c] * lo + scale[2 * c + 1] * hi;
    }
#endif
    return (y->d * f16_to_f32(b)) * (float)isum - (y->d * f16_to_f32(b + 2)) * (float)msum;
}

/* Q6_K (210 bytes: ql, qh, int8 scales, d) against a Q8_K block: (d_x d) isum, the codes q - 32. */
static inline float dot_q6_k(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    int isum = 0;
#if defined(__AVX2__)
    __m256i nibble = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3), offset = _mm256_set1_epi8(32);
    __m256i scales = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)sc)), acc = _mm256_setzero_si256();
    for (int c = 0; c < 2; c++) {
        __m256i l0 = load256(ql + 64 * c), l1 = load256(ql + 64 * c + 32), h = load256(qh + 32 * c);
        __m256i lows[4] = {_mm256_and_si256(l0, nibble), _mm256_and_si256(l1, nibble),
                           _mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble),
                           _mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble)};
        for (int i = 0; i < 4; i++) {               /* elements 128c + 32i + (0..31): scales 8c+2i, 8c+2i+1 */
            __m256i q = _mm256_or_si256(lows[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * i), three), 4));
            __m256i q8 = load256(y->qs + 128 * c + 32 * i);
            __m256i prod = _mm256_sub_epi16(_mm256_maddubs_epi16(q, q8), _mm256_maddubs_epi16(offset, q8));
            __m256i scale = _mm256_srai_epi16(_mm256_shuffle_epi8(scales, load256(signed_pair_shuffle[4 * c + i])), 8);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, scale));
        }
    }
    isum = hsum_i32(acc);
#else
    for (int e = 0; e < 256; e += 16) {
        int sumi = 0;
        for (int l = e; l < e + 16; l++) {
            int c = l / 128, i = (l / 32) % 4, k = l % 32;
            int low = (ql[64 * c + 32 * (i % 2) + k] >> (4 * (i / 2))) & 15;
            sumi += ((low | (((qh[32 * c + k] >> (2 * i)) & 3) << 4)) - 32) * y->qs[l];
        }
        isum += sc[e / 16] * sumi;
    }
#endif
    return (f16_to_f32(b + 208) * y->d) * (float)isum;
}

typedef float (*dot8_fn)(const uint8_t *, const void *);
typedef float (*row8_fn)(const uint8_t *, const uint8_t *, int64_t);

static inline void prefetch_ahead(const uint8_t *blk, int bb) {
    for (int off = 0; off < bb; off += 64) __builtin_prefetch(blk + off + Q8_AHEAD);
}

/* The weight stream of Q8_0, F16 and BF16 (8 and 16 bits a value) prefetched into L2 on AMD Zen (there 0.84x
 * Q8_0's time and 0.82x F16's at M = 1; the other types measured slower with it: docs/cpu.md, session 16), into
 * L1 elsewhere. */
static inline void prefetch_wide(const uint8_t *blk, int bb) {
#if AMD_ZEN
    for (int off = 0; off < bb; off += 64) __builtin_prefetch(blk + off + Q8_AHEAD, 0, 1);
#else
    prefetch_ahead(blk, bb);
#endif
}

/* A row of nb blocks of bb bytes against activation blocks of ab bytes: the block terms added in block order. */
static inline __attribute__((always_inline)) float row_blocks(dot8_fn dot, const int bb, const int ab,
                                                              const uint8_t *row, const uint8_t *act, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        prefetch_ahead(row + b * bb, bb);
        acc += dot(row + b * bb, act + b * ab);
    }
    return acc;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q2K_VECTOR 1
/* The 16 lanes of each of a, b, c, d added: [sum a, sum b, sum c, sum d] (one transposing tree for 4 blocks). */
static inline __m128i sum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Q2_K's integer sums of one block, 64 values per step: isum's (the return value's 16 lanes) and msum's (`msum`'s
 * 8 lanes). Each activation vector j (values 64j..64j+63) meets one 32-byte chunk of 2-bit fields broadcast to
 * both halves and shifted per half (vpsrlvq), multiplied by vpdpbusd into lanes of 4 values each (|lane| <= 1536,
 * so two steps' lanes pack into int16 words exactly), and the packed words are scaled per group by vpdpwssd. */
static inline __m512i q2_k_sums(const uint8_t *b, const q8k_block *y, __m512i *msum) {
    __m128i sc = _mm_loadu_si128((const __m128i *)b);
    __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(15)));
    *msum = _mm512_castsi256_si512(_mm256_madd_epi16(mins, load256(y->bsums)));
    __m512i scales = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sc, _mm_set1_epi8(15))));
    /* packs_epi32(p[2h], p[2h + 1]): in 128-bit chunk c, words 0-3 group 8h + c, words 4-7 group 8h + 4 + c */
    const __m512i scale_lo = _mm512_set_epi16(7, 7, 7, 7, 3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2,
                                              5, 5, 5, 5, 1, 1, 1, 1, 4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i scale_hi = _mm512_add_epi16(scale_lo, _mm512_set1_epi16(8));
    const __m512i three = _mm512_set1_epi8(3);
    __m512i p[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {       /* values 64j..: fields 2 (j % 2) (low half) and 2 (j % 2) + 1 of chunk j / 2 */
        __m512i shift = _mm512_set_epi64(4 * (j % 2) + 2, 4 * (j % 2) + 2, 4 * (j % 2) + 2, 4 * (j % 2) + 2,
                                         4 * (j % 2), 4 * (j % 2), 4 * (j % 2), 4 * (j % 2));
        __m512i q = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(load256(b + 16 + 32 * (j / 2))), shift),
                                     three);
        p[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(y->qs + 64 * j));
    }
    __m512i acc = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(p[0], p[1]),
                                      _mm512_permutexvar_epi16(scale_lo, scales));
    return _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(p[2], p[3]), _mm512_permutexvar_epi16(scale_hi, scales));
}

/* The d and dmin of 4 Q2_K blocks (w: the first one's bytes): d0..d3 in lanes 0-3, dmin0..dmin3 in lanes 4-7. */
static inline __m256 q2_k_dmins(const uint8_t *w) {
    uint32_t h[4];      /* each block's d and dmin (f16) */
    for (int i = 0; i < 4; i++) memcpy(&h[i], w + 84 * i + 80, 4);
    __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));       /* d0, dmin0, d1, dmin1, ... */
    return _mm256_permutevar8x32_ps(dm, _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0));
}

/* The float steps of 4 Q2_K blocks (split: their q2_k_dmins, y: their activation blocks) from their isum and msum,
 * each lane the scalar (d_x d) isum - (d_x dmin) msum of dot_q2_k (the same operations, so the same bits). */
static inline __m128 q2_k_terms_of(__m256 split, const q8k_block *y, __m128i isum, __m128i msum) {
    __m128 yd = _mm_set_ps(y[3].d, y[2].d, y[1].d, y[0].d);
    __m128 a = _mm_mul_ps(_mm_mul_ps(yd, _mm256_castps256_ps128(split)), _mm_cvtepi32_ps(isum));
    __m128 m = _mm_mul_ps(_mm_mul_ps(yd, _mm256_extractf128_ps(split, 1)), _mm_cvtepi32_ps(msum));
    return _mm_sub_ps(a, m);
}

static inline __m128 q2_k_terms(const uint8_t *w, const q8k_block *y, __m128i isum, __m128i msum) {   /* w: bytes */
    return q2_k_terms_of(q2_k_dmins(w), y, isum, msum);
}

/* Blocks w[0..4) (against y[0..4)) added to acc: isum and msum of the 4 reduced together, their float terms
 * computed lane by lane (the same bits as dot_q2_k's), then added in block order as row_blocks does. */
static inline float step4_q2_k(float acc, const uint8_t *w, const q8k_block *y) {
    float t[4];
    for (int i = 0; i < 4; i++) prefetch_ahead(w + 84 * i, 84);
    __m512i m[4];
    __m512i s0 = q2_k_sums(w, y, &m[0]), s1 = q2_k_sums(w + 84, y + 1, &m[1]);
    __m512i s2 = q2_k_sums(w + 168, y + 2, &m[2]), s3 = q2_k_sums(w + 252, y + 3, &m[3]);
    _mm_storeu_ps(t, q2_k_terms(w, y, sum4_epi32(s0, s1, s2, s3), sum4_epi32(m[0], m[1], m[2], m[3])));
    return (((acc + t[0]) + t[1]) + t[2]) + t[3];
}
#define STEP4_Q2_K step4_q2_k
#else
#define STEP4_Q2_K NULL
#endif

#if defined(IQ2_VECTOR)
/* Blocks w[0..4) (against y[0..4)) added to acc: their integer sums reduced together (a quarter of the shuffles
 * of one reduction per block), their float terms computed lane by lane (dot_iq2_xxs's operations), then added in
 * block order as row_blocks does, so the same bits. */
static inline __attribute__((always_inline)) float step4_iq2(__m512i (*sums_of)(const uint8_t *, const int8_t *),
                                                             float acc, const uint8_t *w, const q8k_block *y) {
    float t[4];
    for (int i = 0; i < 4; i++) prefetch_ahead(w + 66 * i, 66);
    __m128i sums = sum4_epi32(sums_of(w, y[0].qs), sums_of(w + 66, y[1].qs), sums_of(w + 132, y[2].qs),
                              sums_of(w + 198, y[3].qs));
    uint16_t h[4];      /* the blocks' d (f16) */
    for (int i = 0; i < 4; i++) memcpy(&h[i], w + 66 * i, 2);
    __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));
    __m128 yd = _mm_set_ps(y[3].d, y[2].d, y[1].d, y[0].d);
    _mm_storeu_ps(t, _mm_mul_ps(_mm_mul_ps(d, yd), _mm_cvtepi32_ps(sums)));    /* lane i: block i's term */
    return (((acc + t[0]) + t[1]) + t[2]) + t[3];
}

static inline float step4_iq2_xxs(float acc, const uint8_t *w, const q8k_block *y) {
    return step4_iq2(iq2_xxs_sums, acc, w, y);
}
#define STEP4_IQ2_XXS step4_iq2_xxs
#else
#define STEP4_IQ2_XXS NULL
#endif

#if defined(IQ2_VECTOR) && AMD_ZEN
/* AMD Zen, a weight row of its own (M = 1, routed experts): the activations' bytes in chunk order (iq2_chunk_order,
 * a copy made by qdot8) against iq2_xxs_chunk_sums, the same integers and float steps as dot_iq2_xxs and
 * step4_iq2_xxs. */
#define IQ2_CHUNKS 1
static inline float dot_iq2_xxs_chunks(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    return (f16_to_f32(b) * y->d) * (float)_mm512_reduce_add_epi32(iq2_xxs_chunk_sums(b, y->qs));
}

static inline float step4_iq2_xxs_chunks(float acc, const uint8_t *w, const q8k_block *y) {
    return step4_iq2(iq2_xxs_chunk_sums, acc, w, y);
}
#else
#define IQ2_CHUNKS 0
#endif

typedef float (*step8_fn)(float, const uint8_t *, const q8k_block *);

/* R rows r[0..R) of nb blocks of bb bytes against one row of K-quant activations, block by block in turn (R = 4:
 * four streams of the weight fetched at once): each row's terms added in its own order, `step` on `per` blocks at
 * a time where not NULL, then `dot` on each block left, so the same bits for any R. */
static inline __attribute__((always_inline)) void rows_k(step8_fn step, const int per, dot8_fn dot, const int bb,
        const int R, const uint8_t *const *r, const uint8_t *act, int64_t nb, float *acc) {
    const q8k_block *y = (const q8k_block *)act;
    int64_t b = 0;
    for (int i = 0; i < R; i++) acc[i] = 0.0f;
    if (step != NULL)
        for (; b + per <= nb; b += per)
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) acc[i] = step(acc[i], r[i] + b * bb, y + b);
    for (; b < nb; b++)
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            prefetch_ahead(r[i] + b * bb, bb);
            acc[i] += dot(r[i] + b * bb, y + b);
        }
}

static void rows_q2_k(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(STEP4_Q2_K, 4, dot_q2_k, 84, 4, r, act, nb, out);
}

static float row_q2_k(const uint8_t *row, const uint8_t *act, int64_t nb) {
    float acc;
    rows_k(STEP4_Q2_K, 4, dot_q2_k, 84, 1, &row, act, nb, &acc);
    return acc;
}

static void rows_iq2_xxs(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(STEP4_IQ2_XXS, 4, dot_iq2_xxs, 66, 4, r, act, nb, out);
    for (int i = 0; i < 4; i++) out[i] *= 0.125f;
}

static float row_iq2_xxs(const uint8_t *row, const uint8_t *act, int64_t nb) {
    float acc;
    rows_k(STEP4_IQ2_XXS, 4, dot_iq2_xxs, 66, 1, &row, act, nb, &acc);
    return 0.125f * acc;
}

#if IQ2_CHUNKS
static void rows_iq2_xxs_chunks(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(step4_iq2_xxs_chunks, 4, dot_iq2_xxs_chunks, 66, 4, r, act, nb, out);
    for (int i = 0; i < 4; i++) out[i] *= 0.125f;
}

static float row_iq2_xxs_chunks(const uint8_t *row, const uint8_t *act, int64_t nb) {
    float acc;
    rows_k(step4_iq2_xxs_chunks, 4, dot_iq2_xxs_chunks, 66, 1, &row, act, nb, &acc);
    return 0.125f * acc;
}
#endif

static void rows_q4_k(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(NULL, 1, dot_q4_k, 144, 4, r, act, nb, out);
}

static float row_q4_k(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return row_blocks(dot_q4_k, 144, sizeof(q8k_block), row, act, nb);
}

/* A row of Q8_0 blocks (34 bytes) against Q8_0 activations in whole blocks, as prefill's GEMM (qgemm8.c) and
 * llama.cpp's generic ggml_vec_dot_q8_0_q8_0: acc += (d_w d_x) isum block after block, isum the block's exact
 * integer dot. The rows of an own_rows4_q8 call (four streams) each add their blocks in that order. */
static inline int32_t q8_0_isum(const uint8_t *blk, const q8_0_block *y) {
#if defined(__AVX2__)
    /* |w| (unsigned; -128 -> 128) times x with w's sign: pairs reach at most 2 * 128 * 127, no saturation */
    __m256i w = load256(blk + 2);
    return hsum_i32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(load256(y->qs), w)),
                                      _mm256_set1_epi16(1)));
#else
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (int8_t)blk[2 + i] * y->qs[i];
    return s;
#endif
}

static inline float q8_0_term(const uint8_t *blk, const q8_0_block *y) {     /* one block's (d_w d_x) isum */
    return (f16_to_f32(blk) * y->d) * (float)q8_0_isum(blk, y);
}

static float row_q8_0(const uint8_t *row, const uint8_t *act, int64_t nb) {
    const q8_0_block *y = (const q8_0_block *)act;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        prefetch_wide(row + 34 * b, 34);
        acc = acc + q8_0_term(row + 34 * b, y + b);
    }
    return acc;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
static inline short q8_0_scale_bits(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk, 2);
    return (short)h;
}

/* s[i] lanes 0-7 / 8-15: row i's 8 partial sums of block b / b + 1 -> lane i + 4h: row i's isum of block b + h */
static inline __m256i q8_0_fold(const __m512i *s) {
    __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    __m512i v = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));     /* 128-bit lane L: rows 0-3 over lanes 4L.. */
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* One activation row's blocks 2p and 2p + 1, made once per call for every weight row: x (the two blocks' int8
 * values), -128 sum(x) per group of four (vpdpbusd's start) and the two blocks' d, each in four lanes. */
typedef struct { __m512i x, start; __m256 dx, pad; } q8_0_pair;
#define Q8_0_STACK_PAIRS 64     /* K <= 4096 without an allocation */

static void q8_0_pairs(const q8_0_block *y, int64_t nb, q8_0_pair *out) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t p = 0; p < nb / 2; p++) {
        const q8_0_block *b = y + 2 * p;
        __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(load256(b[0].qs)), load256(b[1].qs), 1);
        out[p].x = x;
        out[p].start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, x));
        out[p].dx = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(b[0].d)), _mm_set1_ps(b[1].d), 1);
    }
}

/* Four rows, two blocks a step: (w + 128) . x by vpdpbusd from the pair's start, the 4 x 2 sums folded into one
 * vector, the 8 weight scales gathered in two 64-bit words (general registers, not 16-bit inserts on the shuffle
 * port) and converted at once, the float steps of the 4 rows in one vector, block b before b + 1 (the same bits as
 * row_q8_0 row by row). */
static void rows_q8_0(const uint8_t *const *r, const q8_0_pair *pairs, const q8_0_block *y, int64_t nb, float *out) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m128 acc = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const q8_0_pair *pair = pairs + b / 2;
        __m512i s[4];
        uint64_t lo = 0, hi = 0;
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const uint8_t *p = r[i] + 34 * b;
            prefetch_wide(p, 68);
            __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(load256(p + 2)), load256(p + 36), 1);
            s[i] = _mm512_dpbusd_epi32(pair->start, _mm512_xor_si512(w, flip), pair->x);
            uint16_t h0, h1;
            memcpy(&h0, p, 2);
            memcpy(&h1, p + 34, 2);
            lo |= (uint64_t)h0 << (16 * i);
            hi |= (uint64_t)h1 << (16 * i);
        }
        __m256 dw = _mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo));
        __m256 term = _mm256_mul_ps(_mm256_mul_ps(dw, pair->dx), _mm256_cvtepi32_ps(q8_0_fold(s)));
        acc = _mm_add_ps(acc, _mm256_castps256_ps128(term));
        acc = _mm_add_ps(acc, _mm256_extractf128_ps(term, 1));
    }
    _mm_storeu_ps(out, acc);
    for (; b < nb; b++)
        for (int i = 0; i < 4; i++) out[i] = out[i] + q8_0_term(r[i] + 34 * b, y + b);
}

/* own_rows4_q8 for Q8_0: the same rows in the same order, each activation row's pairs made once (q8_0_pairs).
 * Returns 0, or -2 out of memory. */
static int own_rows4_q8_0(const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
                          const uint8_t *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / 32, row_bytes = nb * 34, q = (n1 - n0) / 4;
    q8_0_pair stack[Q8_0_STACK_PAIRS], *pairs = stack;
    if (nb / 2 > Q8_0_STACK_PAIRS && !(pairs = aligned_alloc(64, (size_t)(nb / 2) * sizeof *pairs))) return -2;
    for (int64_t m = 0; m < M; m++) {
        float *ym = y + m * N;
        if (experts != NULL && experts[m] < 0) {        /* another rank's */
            for (int64_t n = n0; n < n1; n++) ym[n] = 0.0f;
            continue;
        }
        const uint8_t *base = w + (experts == NULL ? 0 : experts[m] * expert_bytes);
        const q8_0_block *act = (const q8_0_block *)xq + m * nb;
        if (q > 0) q8_0_pairs(act, nb, pairs);
        for (int64_t n = n0; n < n0 + q; n++) {
            const uint8_t *r[4] = {base + n * row_bytes, base + (n + q) * row_bytes, base + (n + 2 * q) * row_bytes,
                                   base + (n + 3 * q) * row_bytes};
            float out[4];
            rows_q8_0(r, pairs, act, nb, out);
            for (int i = 0; i < 4; i++) ym[n + i * q] = out[i];
        }
        for (int64_t n = n0 + 4 * q; n < n1; n++) ym[n] = row_q8_0(base + n * row_bytes, (const uint8_t *)act, nb);
    }
    if (pairs != stack) free(pairs);
    return 0;
}
#define Q8_0_PAIRS 1
#else
static void rows_q8_0(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {  /* 4 rows in turn */
    const q8_0_block *y = (const q8_0_block *)act;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < 4; i++) {
            prefetch_wide(r[i] + 34 * b, 34);
            acc[i] = acc[i] + q8_0_term(r[i] + 34 * b, y + b);
        }
    for (int i = 0; i < 4; i++) out[i] = acc[i];
}
#endif

static float row_q3_k(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return row_blocks(dot_q3_k, 110, sizeof(q8k_block), row, act, nb);
}
static void rows_q3_k(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(NULL, 1, dot_q3_k, 110, 4, r, act, nb, out);
}

static float row_q5_k(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return row_blocks(dot_q5_k, 176, sizeof(q8k_block), row, act, nb);
}
static void rows_q5_k(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(NULL, 1, dot_q5_k, 176, 4, r, act, nb, out);
}

static float row_q6_k(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return row_blocks(dot_q6_k, 210, sizeof(q8k_block), row, act, nb);
}
static void rows_q6_k(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(NULL, 1, dot_q6_k, 210, 4, r, act, nb, out);
}

/* R rows r[0..R) of F16 (bf16: BF16) weights against f16 (bf16) rounded float activations (q8_quantize kind 2,
 * kind 4), block by block in turn (R = 4: four streams, as own_rows4_q8), in 32 float lanes per row: lane l adds
 * the products of values l, l + 32, l + 64, ... (exact: two f16 or two bf16 values multiply exactly in float),
 * then the lanes are added in order. `nb` blocks of 32 values; the same bits for any R. */
static inline __attribute__((always_inline)) void rows_f16_in_turn(const int R, const int bf16, const uint8_t *const *r,
                                                                   const uint8_t *act, int64_t nb, float *out) {
    const float *x = (const float *)act;
    float lanes[4][32] = {{0}};
#if defined(__AVX512F__)
    __m512 acc0[4], acc1[4];
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const uint8_t *row = r[i] + 64 * b;
            prefetch_wide(row, 64);
            __m256i lo = _mm256_loadu_si256((const __m256i *)row), hi = _mm256_loadu_si256((const __m256i *)(row + 32));
            __m512 w0 = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 16)) : _mm512_cvtph_ps(lo);
            __m512 w1 = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)) : _mm512_cvtph_ps(hi);
            acc0[i] = _mm512_add_ps(acc0[i], _mm512_mul_ps(w0, _mm512_loadu_ps(x + 32 * b)));
            acc1[i] = _mm512_add_ps(acc1[i], _mm512_mul_ps(w1, _mm512_loadu_ps(x + 32 * b + 16)));
        }
    for (int i = 0; i < R; i++) {
        _mm512_storeu_ps(lanes[i], acc0[i]);
        _mm512_storeu_ps(lanes[i] + 16, acc1[i]);
    }
#elif defined(__AVX2__) && defined(__F16C__)
    __m256 acc[4][4];
    for (int i = 0; i < R; i++) for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const uint8_t *row = r[i] + 64 * b;
            prefetch_wide(row, 64);
            for (int j = 0; j < 4; j++) {
                __m128i h = _mm_loadu_si128((const __m128i *)(row + 16 * j));
                __m256 wj = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
                acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_mul_ps(wj, _mm256_loadu_ps(x + 32 * b + 8 * j)));
            }
        }
    for (int i = 0; i < R; i++) for (int j = 0; j < 4; j++) _mm256_storeu_ps(lanes[i] + 8 * j, acc[i][j]);
#else
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < R; i++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *p = r[i] + 64 * b + 2 * l;
                float w = bf16 ? q8_bits_float(((uint32_t)p[0] | ((uint32_t)p[1] << 8)) << 16) : f16_to_f32(p);
                lanes[i][l] += w * x[32 * b + l];
            }
#endif
    for (int i = 0; i < R; i++) {
        float sum = 0.0f;
        for (int l = 0; l < 32; l++) sum += lanes[i][l];
        out[i] = sum;
    }
}

static float row_f16(const uint8_t *row, const uint8_t *act, int64_t nb) {
    float out;
    rows_f16_in_turn(1, 0, &row, act, nb, &out);
    return out;
}
static void rows_f16(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_f16_in_turn(4, 0, r, act, nb, out);
}
static float row_bf16(const uint8_t *row, const uint8_t *act, int64_t nb) {
    float out;
    rows_f16_in_turn(1, 1, &row, act, nb, &out);
    return out;
}
static void rows_bf16(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_f16_in_turn(4, 1, r, act, nb, out);
}

static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};   /* 2 x E2M1 */

static inline float e8m0_half(uint8_t e) {     /* 2^(e - 128), exact (subnormal for e < 2) */
    return q8_bits_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* The 32 integer codes of a 32-value block (Q4_0 q - 8, Q5_0 q - 16, IQ4_NL and MXFP4 their tables) and its
 * scale: each type's `codes32_<type>` writes them as int8 (an __m256i on AVX2) and returns the scale. */
#if defined(__AVX2__)
typedef __m256i codes32;
static inline __m256i nibbles32(const uint8_t *qs) {   /* bytes 0-15 the low nibbles of qs[16], 16-31 the high */
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
    return _mm256_set_m128i(hi, lo);
}
static inline __m256i table16(const int8_t *table, __m256i idx) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)), idx);
}
static inline float codes32_q4_0(const uint8_t *b, codes32 *c) {
    *c = _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    return f16_to_f32(b);
}
static inline __m256i fifth_bits(const uint8_t *qh_bytes) {    /* byte j: 16 where bit j of the u32 is set */
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    /* byte j <- byte j / 8 of qh, tested against bit j % 8 */
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                         _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                           0x0101010101010101, 0x0000000000000000));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
static inline float codes32_q5_0(const uint8_t *b, codes32 *c) {
    *c = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)), _mm256_set1_epi8(16));
    return f16_to_f32(b);
}
static inline float codes32_q4_1(const uint8_t *b, codes32 *c) {
    *c = nibbles32(b + 4);
    return f16_to_f32(b);
}
static inline float codes32_q5_1(const uint8_t *b, codes32 *c) {
    *c = _mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4));
    return f16_to_f32(b);
}
static inline float codes32_iq4_nl(const uint8_t *b, codes32 *c) {
    *c = table16(iq4_values, nibbles32(b + 2));
    return f16_to_f32(b);
}
static inline float codes32_mxfp4(const uint8_t *b, codes32 *c) {
    *c = table16(mxfp4_values, nibbles32(b + 1));
    return e8m0_half(b[0]);
}
#else
typedef int8_t codes32[32];
static inline float codes32_q4_0(const uint8_t *b, codes32 *c) {
    for (int j = 0; j < 16; j++) { (*c)[j] = (int8_t)((b[2 + j] & 15) - 8); (*c)[j + 16] = (int8_t)((b[2 + j] >> 4) - 8); }
    return f16_to_f32(b);
}
static inline float codes32_q5_0(const uint8_t *b, codes32 *c) {
    uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
    for (int j = 0; j < 16; j++) {
        (*c)[j] = (int8_t)(((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
        (*c)[j + 16] = (int8_t)(((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
    return f16_to_f32(b);
}
static inline float codes32_q4_1(const uint8_t *b, codes32 *c) {
    for (int j = 0; j < 16; j++) { (*c)[j] = (int8_t)(b[4 + j] & 15); (*c)[j + 16] = (int8_t)(b[4 + j] >> 4); }
    return f16_to_f32(b);
}
static inline float codes32_q5_1(const uint8_t *b, codes32 *c) {
    uint32_t qh = (uint32_t)b[4] | ((uint32_t)b[5] << 8) | ((uint32_t)b[6] << 16) | ((uint32_t)b[7] << 24);
    for (int j = 0; j < 16; j++) {
        (*c)[j] = (int8_t)((b[8 + j] & 15) | (((qh >> j) & 1) << 4));
        (*c)[j + 16] = (int8_t)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    return f16_to_f32(b);
}
static inline float codes32_iq4_nl(const uint8_t *b, codes32 *c) {
    for (int j = 0; j < 16; j++) { (*c)[j] = iq4_values[b[2 + j] & 15]; (*c)[j + 16] = iq4_values[b[2 + j] >> 4]; }
    return f16_to_f32(b);
}
static inline float codes32_mxfp4(const uint8_t *b, codes32 *c) {
    for (int j = 0; j < 16; j++) { (*c)[j] = mxfp4_values[b[1 + j] & 15]; (*c)[j + 16] = mxfp4_values[b[1 + j] >> 4]; }
    return e8m0_half(b[0]);
}
#endif

/* R rows r[0..R) of 32-value blocks of `bb` bytes given as codes times a scale, block by block in turn (R = 4:
 * four streams, as own_rows4_q8), against Q8_0 activations (mins: Q4_1 / Q5_1's unsigned codes with f16 d and m
 * first, against Q8_1 activations), in 8 lanes: lane l adds (d_w d_x) times the integer dot of values 4l..4l+3
 * of each block, then the lanes are added in order (mins: then `+ summs`, summs adding m_w s_x block after
 * block). The same bits for any R. */
static inline __attribute__((always_inline)) void rows_codes(float (*codes)(const uint8_t *, codes32 *), const int bb,
        const int mins, const int R, const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    const int ab = mins ? (int)sizeof(q8_1_block) : (int)sizeof(q8_0_block);
    float lanes[4][8] = {{0}}, summs[4] = {0};
    codes32 w;
#if defined(__AVX2__)
    __m256 acc[4];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *yb = act + b * ab;
        const float yd = mins ? ((const q8_1_block *)yb)->d : ((const q8_0_block *)yb)->d;
        const __m256i yq = load256(mins ? ((const q8_1_block *)yb)->qs : ((const q8_0_block *)yb)->qs);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = r[i] + b * bb;
            prefetch_ahead(blk, bb);
            float d = codes(blk, &w);
            __m256i prod;
            if (mins) {
                summs[i] += f16_to_f32(blk + 2) * ((const q8_1_block *)yb)->s;
                prod = _mm256_maddubs_epi16(w, yq);
            } else prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(yq, w));
            __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_set1_ps(d * yd), dots));
        }
    }
    for (int i = 0; i < R; i++) _mm256_storeu_ps(lanes[i], acc[i]);
#else
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *yb = act + b * ab;
        const float yd = mins ? ((const q8_1_block *)yb)->d : ((const q8_0_block *)yb)->d;
        const int8_t *yq = mins ? ((const q8_1_block *)yb)->qs : ((const q8_0_block *)yb)->qs;
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = r[i] + b * bb;
            float d = codes(blk, &w) * yd;
            if (mins) summs[i] += f16_to_f32(blk + 2) * ((const q8_1_block *)yb)->s;
            for (int l = 0; l < 8; l++) {
                int s = 0;
                for (int j = 4 * l; j < 4 * l + 4; j++) s += w[j] * yq[j];
                lanes[i][l] += d * (float)s;
            }
        }
    }
#endif
    for (int i = 0; i < R; i++) {
        float sum = 0.0f;
        for (int l = 0; l < 8; l++) sum += lanes[i][l];
        out[i] = mins ? sum + summs[i] : sum;
    }
}

/* Each 32-value type's one-row and four-row functions (Q4_1 and Q5_1 with their mins). */
#define CODES_ROWS(type, bb, mins)                                                                         \
    static float row_##type(const uint8_t *row, const uint8_t *act, int64_t nb) {                         \
        float out;                                                                                         \
        rows_codes(codes32_##type, bb, mins, 1, &row, act, nb, &out);                                      \
        return out;                                                                                        \
    }                                                                                                      \
    static void rows_##type(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {        \
        rows_codes(codes32_##type, bb, mins, 4, r, act, nb, out);                                          \
    }
CODES_ROWS(q4_0, 18, 0)
CODES_ROWS(q5_0, 22, 0)
CODES_ROWS(iq4_nl, 18, 0)
CODES_ROWS(mxfp4, 17, 0)
CODES_ROWS(q4_1, 20, 1)
CODES_ROWS(q5_1, 24, 1)

/* IQ4_XS (136 bytes: d, scales_h, scales_l, qs) against a Q8_K block: (d_w d_x) isum, isum = sum over the 8
 * sub-blocks of (ls - 32) times the integer dot of IQ4_NL's table values. */
static inline float dot_iq4_xs(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *qs = b + 8;
    int h = b[2] | (b[3] << 8), isum = 0, ls[8];
    for (int j = 0; j < 8; j++) ls[j] = (((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((h >> (2 * j)) & 3) << 4)) - 32;
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i w = table16(iq4_values, nibbles32(qs + 16 * j));
        __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(load256(y->qs + 32 * j), w));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16((short)ls[j])));
    }
    isum = hsum_i32(acc);
#else
    for (int j = 0; j < 8; j++) {
        int sumi = 0;
        for (int l = 0; l < 16; l++)
            sumi += iq4_values[qs[16 * j + l] & 15] * y->qs[32 * j + l] + iq4_values[qs[16 * j + l] >> 4] * y->qs[32 * j + 16 + l];
        isum += ls[j] * sumi;
    }
#endif
    return (f16_to_f32(b) * y->d) * (float)isum;
}

static float row_iq4_xs(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return row_blocks(dot_iq4_xs, 136, sizeof(q8k_block), row, act, nb);
}
static void rows_iq4_xs(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {
    rows_k(NULL, 1, dot_iq4_xs, 136, 4, r, act, nb, out);
}

/* The IQ codebook and ternary types against Q8_K blocks (llama.cpp's ggml_vec_dot_<type>_q8_K): per 32 values an
 * unsigned magnitude byte (a grid value, a ternary digit, or 1) times a sign byte (+1 / -1 / 0) times the
 * activation, the first 16 values' integer dot times one scale and the last 16's times another, all exact in
 * int32; one float step per block. The grids are ops/quants/<type>.py's, handed over by qdot8_set_grid. */
static uint64_t iq2xs_grid8[512], iq2s_grid8[1024], iq1s_grid8[2048];  /* 8 values a point, as bytes */
static uint32_t iq3xxs_grid4[256], iq3s_grid4[512];                     /* 4 values a point, as bytes */
static uint64_t byte_signs[256];         /* the 8 signs (+1 / -1 bytes) of each sign byte: bit j set, j negative */
static uint64_t iq1s_plus1[2048];        /* IQ1_S's grid plus one (0, 1, 2: unsigned bytes for maddubs) */
#define ONES8 0x0101010101010101ull

/* Copy the grid of GGUF type `type` (17 IQ2_XS, 22 IQ2_S, 18 IQ3_XXS, 21 IQ3_S, 19 IQ1_S: its points' values as
 * bytes, `bytes` of them); -1 for another type or size. */
int qdot8_set_grid(int type, const uint8_t *grid, int64_t bytes) {
    void *table = type == 17 ? (void *)iq2xs_grid8 : type == 22 ? (void *)iq2s_grid8 : type == 18 ? (void *)iq3xxs_grid4
                  : type == 21 ? (void *)iq3s_grid4 : type == 19 ? (void *)iq1s_grid8 : NULL;
    int64_t size = type == 17 ? (int64_t)sizeof iq2xs_grid8 : type == 22 ? (int64_t)sizeof iq2s_grid8
                   : type == 18 ? (int64_t)sizeof iq3xxs_grid4 : type == 21 ? (int64_t)sizeof iq3s_grid4
                   : (int64_t)sizeof iq1s_grid8;
    if (table == NULL || bytes != size) return -1;
    memcpy(table, grid, (size_t)size);
    if (type == 19)
        for (int i = 0; i < 2048; i++)
            for (int j = 0; j < 8; j++)
                iq1s_plus1[i] = (iq1s_plus1[i] & ~(0xffull << (8 * j))) | (uint64_t)(uint8_t)(grid[8 * i + j] + 1) << (8 * j);
    for (int i = 0; i < 256; i++) {
        uint64_t s = 0;
        for (int j = 0; j < 8; j++) s |= (uint64_t)(((i >> j) & 1) ? 0xff : 0x01) << (8 * j);
        byte_signs[i] = s;
    }
    return 0;
}

static inline uint64_t grid4_pair(const uint32_t *grid, int lo, int hi) {   /* two 4-value points: 8 bytes */
    return grid[lo] | ((uint64_t)grid[hi] << 32);
}

/* acc + lo * (dot of values 0..15) + hi * (dot of values 16..31): value j = byte j of g times byte j of s (as
 * int8; sign_epi8's: -1, 0 or +1) times q[j]. */
#if defined(__AVX2__)
typedef __m256i isum32;
static inline __m256i dot32(__m256i acc, const uint64_t *g, const uint64_t *s, int lo, int hi, const int8_t *q) {
    __m256i u = _mm256_set_epi64x((long long)g[3], (long long)g[2], (long long)g[1], (long long)g[0]);
    __m256i sg = _mm256_set_epi64x((long long)s[3], (long long)s[2], (long long)s[1], (long long)s[0]);
    __m256i prod = _mm256_maddubs_epi16(u, _mm256_sign_epi8(load256(q), sg));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(prod, scale_pair(lo, hi)));
}
#define ISUM_ZERO _mm256_setzero_si256()
#define ISUM_TOTAL(a) hsum_i32(a)
#else
typedef int isum32;
static inline int dot32(int acc, const uint64_t *g, const uint64_t *s, int lo, int hi, const int8_t *q) {
    int sum[2] = {0, 0};
    for (int j = 0; j < 32; j++) {
        int u = (int)((g[j / 8] >> (8 * (j % 8))) & 255), sign = (int8_t)((s[j / 8] >> (8 * (j % 8))) & 255);
        sum[j / 16] += u * (sign > 0 ? q[j] : sign < 0 ? -q[j] : 0);
    }
    return acc + lo * sum[0] + hi * sum[1];
}
#define ISUM_ZERO 0
#define ISUM_TOTAL(a) (a)
#endif

#if defined(IQ2_VECTOR)
/* The AVX-512 (VBMI, BITALG, VNNI) integer sums of the codebook types, 64 values per step: the 64 magnitude bytes
 * `u` (a grid row gather), the activations negated where `neg` is set, the products of pairs (maddubs: words) times
 * the step's scales (dpwssd; words 8p..8p+7 scale values 16p..16p+15) into the 16 lanes of acc (exact). */
static inline __attribute__((always_inline)) __m512i dot64(__m512i acc, __m512i u, uint64_t negative, const int8_t *q, __m512i scales) {
    __m512i q8 = _mm512_loadu_si512(q);
    __mmask64 neg;      /* as asm: a load (as iq2_xxs_sums) */
    __asm__("kmovq %1, %0" : "=k"(neg) : "m"(negative));
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u, _mm512_mask_sub_epi8(q8, neg, _mm512_setzero_si512(), q8)),
                               scales);
}

/* Step i's scale words from 16 words `ls` (one per 16 values of the block). */
static inline __m512i step_scales(__m256i ls, int i) {
    const __m512i pieces = _mm512_set_epi64(0x0003000300030003, 0x0003000300030003, 0x0002000200020002,
                                            0x0002000200020002, 0x0001000100010001, 0x0001000100010001, 0, 0);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(pieces, _mm512_set1_epi16((short)(4 * i))),
                                    _mm512_castsi256_si512(ls));
}

/* 16 words 2 n + 1 of 8 bytes of scale nibble pairs `v` (word 2j: the low nibble of byte j, 2j + 1: the high). */
static inline __m256i nibble_scales(__m128i v) {
    __m128i n = _mm_unpacklo_epi8(_mm_and_si128(v, _mm_set1_epi8(15)), _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)));
    __m256i w = _mm256_cvtepu8_epi16(n);
    return _mm256_add_epi16(_mm256_add_epi16(w, w), _mm256_set1_epi16(1));
}

/* 32 sign bytes (byte c: the 8 signs of values 8c..8c+7) of 32 7-bit ksigns indices (bytes), parity restored. */
static inline __m256i ksign_bytes(__m256i index) {
    return _mm512_castsi512_si256(_mm512_permutex2var_epi8(_mm512_loadu_si512(iq2_ksigns_bytes),
                                                           _mm512_castsi256_si512(index),
                                                           _mm512_loadu_si512(iq2_ksigns_bytes + 64)));
}

/* One codebook block unpacked: per 64 values the magnitudes (a grid gather), the sign mask and the scale words. */
typedef struct { __m512i grid[4], scales[4]; uint64_t negative[4]; } codebook_block;

/* The 4-byte grid points idx[0..15] of `table` in one vector, loaded one by one (AMD Zen: a 16-point vpgatherdd took
 * 6.8 ns here, 16 scalar loads and inserts 3.9; IQ3_S, whose ninth index bits would be taken out one by one, keeps
 * its gather: 1.18x the time that way). */
static inline __m512i grid_points16(const uint32_t *table, const uint32_t *idx) {
    return _mm512_set_epi32((int)table[idx[15]], (int)table[idx[14]], (int)table[idx[13]], (int)table[idx[12]],
                            (int)table[idx[11]], (int)table[idx[10]], (int)table[idx[9]], (int)table[idx[8]],
                            (int)table[idx[7]], (int)table[idx[6]], (int)table[idx[5]], (int)table[idx[4]],
                            (int)table[idx[3]], (int)table[idx[2]], (int)table[idx[1]], (int)table[idx[0]]);
}

/* The 8-byte grid rows idx[0..7] of `table` in one vector, loaded one by one: on AMD Zen a vpgatherdq of 8 rows takes
 * ~12 cycles, 8 scalar loads and inserts ~6 (elsewhere the unpackers gather). */
static inline __m512i grid_rows8(const uint64_t *table, const uint32_t *idx) {
    return _mm512_set_epi64((long long)table[idx[7]], (long long)table[idx[6]], (long long)table[idx[5]],
                            (long long)table[idx[4]], (long long)table[idx[3]], (long long)table[idx[2]],
                            (long long)table[idx[1]], (long long)table[idx[0]]);
}

/* The integer sums of an unpacked block against one row's activation block (16 lanes adding to bsum). */
static inline __attribute__((always_inline)) __m512i codebook_sums(const codebook_block *u, const q8k_block *y) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc = dot64(acc, u->grid[i], u->negative[i], y->qs + 64 * i, u->scales[i]);
    return acc;
}

static inline __attribute__((always_inline)) void iq3_xxs_unpack(const uint8_t *b, codebook_block *u) {
    __m256i aux = load256(b + 66);
    __m256i ls = _mm256_castsi128_si256(_mm256_cvtepi32_epi16(_mm256_srli_epi32(aux, 28)));
    ls = _mm256_add_epi16(_mm256_add_epi16(ls, ls), _mm256_set1_epi16(1));   /* words 0-7: the 32s' scales */
    ls = _mm256_permutexvar_epi16(_mm256_set_epi16(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), ls);
    /* byte 4 ib + l: bits 7l.. of aux[ib] (multishift: 8 bits from each offset of the 64-bit lane) */
    __m256i index = _mm256_and_si256(_mm256_multishift_epi64_epi8(
        _mm256_set1_epi64x(0x352e2720150e0700), aux), _mm256_set1_epi8(127));
    _mm256_storeu_si256((__m256i *)u->negative, ksign_bytes(index));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
#if AMD_ZEN
        uint32_t idx[16];
        for (int l = 0; l < 16; l++) idx[l] = b[2 + 16 * i + l];
        u->grid[i] = grid_points16(iq3xxs_grid4, idx);
#else
        u->grid[i] = _mm512_i32gather_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * i))),
                                            (const void *)iq3xxs_grid4, 4);
#endif
        u->scales[i] = step_scales(ls, i);
    }
}

static inline __attribute__((always_inline)) void iq3_s_unpack(const uint8_t *b, codebook_block *u) {
    uint32_t scales;            /* the 4 bytes of the 8 32s' scales (the block's last: no wider load) */
    memcpy(&scales, b + 106, 4);
    memcpy(u->negative, b + 74, 32);
    __m256i ls = _mm256_permutexvar_epi16(_mm256_set_epi16(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                          nibble_scales(_mm_cvtsi32_si128((int)scales)));   /* doubled up */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * i)));
        uint16_t high;
        memcpy(&high, b + 66 + 2 * i, 2);
        index = _mm512_mask_or_epi32(index, (__mmask16)high, index, _mm512_set1_epi32(256));
        u->grid[i] = _mm512_i32gather_epi32(index, (const void *)iq3s_grid4, 4);
        u->scales[i] = step_scales(ls, i);
    }
}

static inline __attribute__((always_inline)) void iq2_xs_unpack(const uint8_t *b, codebook_block *u) {
    __m512i qs = _mm512_loadu_si512(b + 2);
    _mm256_storeu_si256((__m256i *)u->negative, ksign_bytes(_mm512_cvtepi16_epi8(_mm512_srli_epi16(qs, 9))));
    __m256i ls = nibble_scales(_mm_loadl_epi64((const __m128i *)(b + 66)));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
#if AMD_ZEN
        uint32_t idx[8];
        for (int l = 0; l < 8; l++) idx[l] = (b[2 + 16 * i + 2 * l] | (uint32_t)b[3 + 16 * i + 2 * l] << 8) & 511;
        u->grid[i] = grid_rows8(iq2xs_grid8, idx);
#else
        __m256i index = _mm256_and_si256(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * i))),
                                         _mm256_set1_epi32(511));
        u->grid[i] = _mm512_i32gather_epi64(index, (const void *)iq2xs_grid8, 8);
#endif
        u->scales[i] = step_scales(ls, i);
    }
}

static inline __attribute__((always_inline)) void iq2_s_unpack(const uint8_t *b, codebook_block *u) {
    memcpy(u->negative, b + 34, 32);
    __m256i ls = nibble_scales(_mm_loadl_epi64((const __m128i *)(b + 74)));
    const __m256i shifts = _mm256_set_epi32(14, 12, 10, 8, 6, 4, 2, 0);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        uint16_t high;
        memcpy(&high, b + 66 + 2 * i, 2);
#if AMD_ZEN
        (void)shifts;
        uint32_t idx[8];
        for (int l = 0; l < 8; l++) idx[l] = b[2 + 8 * i + l] | (uint32_t)((high >> (2 * l)) & 3) << 8;
        u->grid[i] = grid_rows8(iq2s_grid8, idx);
#else
        __m256i index = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i))),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high), shifts), _mm256_set1_epi32(3)), 8));
        u->grid[i] = _mm512_i32gather_epi64(index, (const void *)iq2s_grid8, 8);
#endif
        u->scales[i] = step_scales(ls, i);
    }
}

#define CODEBOOK_SUMS(type)                                                                                      \
    static inline __attribute__((always_inline)) __m512i type##_sums(const uint8_t *b, const q8k_block *y) {     \
        codebook_block u;                                                                                        \
        type##_unpack(b, &u);                                                                                    \
        return codebook_sums(&u, y);                                                                             \
    }
CODEBOOK_SUMS(iq3_xxs)
CODEBOOK_SUMS(iq3_s)
CODEBOOK_SUMS(iq2_xs)
CODEBOOK_SUMS(iq2_s)
#endif

/* IQ3_XXS (98 bytes: d, 64 grid indices, 8 u32 of signs and scale) against a Q8_K block: (d_w d_x) bsum, bsum =
 * sum over the 32s of (2 ls + 1) times their dot (0.25 per row at the end). */
static inline float dot_iq3_xxs(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    int bsum;
#if defined(IQ2_VECTOR)
    bsum = _mm512_reduce_add_epi32(iq3_xxs_sums(b, y));
#else
    const uint8_t *q3 = b + 2;
    isum32 acc = ISUM_ZERO;
    for (int ib = 0; ib < 8; ib++, q3 += 8) {
        uint32_t aux;
        memcpy(&aux, b + 66 + 4 * ib, 4);
        uint64_t g[4], s[4];
        for (int l = 0; l < 4; l++) {
            g[l] = grid4_pair(iq3xxs_grid4, q3[2 * l], q3[2 * l + 1]);
            s[l] = iq2_sign_bytes[(aux >> (7 * l)) & 127];
        }
        int ls = (int)(2 * (aux >> 28) + 1);
        acc = dot32(acc, g, s, ls, ls, y->qs + 32 * ib);
    }
    bsum = ISUM_TOTAL(acc);
#endif
    return (f16_to_f32(b) * y->d) * (float)bsum;
}

/* IQ3_S (110 bytes: d, qs[64], qh[8], signs[32], scales[4]) against a Q8_K block: (d_w d_x) bsum, the 32s'
 * scales 2 ls + 1. */
static inline float dot_iq3_s(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    int bsum;
#if defined(IQ2_VECTOR)
    bsum = _mm512_reduce_add_epi32(iq3_s_sums(b, y));
#else
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    isum32 acc = ISUM_ZERO;
    for (int ib = 0; ib < 8; ib++) {
        uint64_t g[4], s[4];
        for (int l = 0; l < 4; l++) {
            int e = 8 * ib + 2 * l;
            g[l] = grid4_pair(iq3s_grid4, qs[e] | (((qh[ib] >> (2 * l)) & 1) << 8),
                              qs[e + 1] | (((qh[ib] >> (2 * l + 1)) & 1) << 8));
            s[l] = byte_signs[signs[4 * ib + l]];
        }
        int ls = 2 * ((scales[ib / 2] >> (4 * (ib % 2))) & 15) + 1;
        acc = dot32(acc, g, s, ls, ls, y->qs + 32 * ib);
    }
    bsum = ISUM_TOTAL(acc);
#endif
    return (f16_to_f32(b) * y->d) * (float)bsum;
}

/* IQ2_XS (74 bytes: d, u16 qs[32] = grid index | sign index << 9, scales[8]) against a Q8_K block: (d_w d_x)
 * bsum, a scale 2 ls + 1 per 16 values (0.125 per row at the end). */
static inline float dot_iq2_xs(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    int bsum;
#if defined(IQ2_VECTOR)
    bsum = _mm512_reduce_add_epi32(iq2_xs_sums(b, y));
#else
    const uint8_t *scales = b + 66;
    isum32 acc = ISUM_ZERO;
    for (int ib = 0; ib < 8; ib++) {
        uint64_t g[4], s[4];
        for (int l = 0; l < 4; l++) {
            int v = b[2 + 8 * ib + 2 * l] | (b[3 + 8 * ib + 2 * l] << 8);
            g[l] = iq2xs_grid8[v & 511];
            s[l] = iq2_sign_bytes[v >> 9];
        }
        acc = dot32(acc, g, s, 2 * (scales[ib] & 15) + 1, 2 * (scales[ib] >> 4) + 1, y->qs + 32 * ib);
    }
    bsum = ISUM_TOTAL(acc);
#endif
    return (f16_to_f32(b) * y->d) * (float)bsum;
}

/* IQ2_S (82 bytes: d, qs[32], signs[32], qh[8], scales[8]) against a Q8_K block: as IQ2_XS, 10-bit grid indices
 * and a sign byte per 8 values. */
static inline float dot_iq2_s(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    int bsum;
#if defined(IQ2_VECTOR)
    bsum = _mm512_reduce_add_epi32(iq2_s_sums(b, y));
#else
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
    isum32 acc = ISUM_ZERO;
    for (int ib = 0; ib < 8; ib++) {
        uint64_t g[4], s[4];
        for (int l = 0; l < 4; l++) {
            g[l] = iq2s_grid8[qs[4 * ib + l] | (((qh[ib] >> (2 * l)) & 3) << 8)];
            s[l] = byte_signs[signs[4 * ib + l]];
        }
        acc = dot32(acc, g, s, 2 * (scales[ib] & 15) + 1, 2 * (scales[ib] >> 4) + 1, y->qs + 32 * ib);
    }
    bsum = ISUM_TOTAL(acc);
#endif
    return (f16_to_f32(b) * y->d) * (float)bsum;
}

#if defined(IQ2_VECTOR) && defined(__BMI2__)
#define IQ1_VECTOR 1
/* IQ1_S / IQ1_M unpacked, 64 values a step: the grid plus one (0, 1, 2: unsigned bytes for maddubs, gathered), the
 * scale words, IQ1_M's delta sign masks (bit j: value j's 8 have a negative delta); the scale of each 16 values
 * (`ls16`) and, IQ1_S, that times its delta's sign (`lsd16`). The grid's -1 is taken off as each 16's scale times its
 * activation sum (bsums). */
typedef struct { __m512i grid[4], scales[4]; uint64_t negative[4]; __m256i ls16, lsd16; } iq1_block;

static inline __attribute__((always_inline)) __m512i iq1_gather(const uint8_t *qs, __m256i high) {  /* 8 points */
    __m256i index = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs)),
                                    _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(7)), 8));
    return _mm512_i32gather_epi64(index, (const void *)iq1s_plus1, 8);
}

static inline __attribute__((always_inline)) void iq1_s_unpack(const uint8_t *b, iq1_block *u) {
    __m128i h = _mm_loadu_si128((const __m128i *)(b + 34));           /* the 8 qh words */
    __m128i ls = _mm_and_si128(_mm_srli_epi16(h, 12), _mm_set1_epi16(7));
    ls = _mm_add_epi16(_mm_add_epi16(ls, ls), _mm_set1_epi16(1));
    __m128i lsd = _mm_mask_sub_epi16(ls, _mm_movepi16_mask(h), _mm_setzero_si128(), ls);   /* bit 15: delta < 0 */
    const __m256i twice = _mm256_set_epi16(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    u->ls16 = _mm256_permutexvar_epi16(twice, _mm256_castsi128_si256(ls));
    u->lsd16 = _mm256_permutexvar_epi16(twice, _mm256_castsi128_si256(lsd));
    const __m256i shifts = _mm256_set_epi32(9, 6, 3, 0, 9, 6, 3, 0);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {      /* points 8i..8i+7: qh words 2i (4 points) and 2i + 1 */
        __m256i qh = _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(h), _mm256_set_epi32(
            2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i, 2 * i, 2 * i, 2 * i));
        u->grid[i] = iq1_gather(b + 2 + 8 * i, _mm256_srlv_epi32(qh, shifts));
        u->scales[i] = step_scales(u->ls16, i);
    }
}

static inline __attribute__((always_inline)) float iq1_s_term(const iq1_block *u, const q8k_block *y, float d) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u->grid[i], _mm512_loadu_si512(y->qs + 64 * i)), u->scales[i]);
    __m256i bsums = load256(y->bsums);
    int sumi = _mm512_reduce_add_epi32(acc) - hsum_i32(_mm256_madd_epi16(u->ls16, bsums));
    int sumd = hsum_i32(_mm256_madd_epi16(u->lsd16, bsums));
    return (d * y->d) * ((float)sumi + 0.125f * (float)sumd);
}

static inline __attribute__((always_inline)) void iq1_m_unpack(const uint8_t *b, iq1_block *u) {
    __m256i ls = _mm256_permutexvar_epi16(_mm256_set_epi16(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                          _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(b + 48))));
    ls = _mm256_and_si256(_mm256_srlv_epi16(ls, _mm256_set_epi16(9, 6, 3, 0, 9, 6, 3, 0, 9, 6, 3, 0, 9, 6, 3, 0)),
                          _mm256_set1_epi16(7));
    u->ls16 = _mm256_add_epi16(_mm256_add_epi16(ls, ls), _mm256_set1_epi16(1));      /* word j: the 16s' scale j */
    u->lsd16 = _mm256_setzero_si256();
    const __m256i shifts = _mm256_set_epi32(28, 24, 20, 16, 12, 8, 4, 0);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        uint32_t qh;                    /* the 8 nibbles of this step's chunks */
        memcpy(&qh, b + 32 + 4 * i, 4);
        u->grid[i] = iq1_gather(b + 8 * i, _mm256_srlv_epi32(_mm256_set1_epi32((int)qh), shifts));
        u->scales[i] = step_scales(u->ls16, i);
        u->negative[i] = _pdep_u64(_pext_u32(qh, 0x88888888u), 0x0101010101010101ull) * 0xff;
    }
}

static inline __attribute__((always_inline)) float iq1_m_term(const iq1_block *u, const q8k_block *y, float d) {
    __m512i acc = _mm512_setzero_si512(), accd = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i q8 = _mm512_loadu_si512(y->qs + 64 * i);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u->grid[i], q8), u->scales[i]);
        accd = dot64(accd, _mm512_set1_epi8(1), u->negative[i], y->qs + 64 * i, u->scales[i]);
    }
    int sumi = _mm512_reduce_add_epi32(acc) - hsum_i32(_mm256_madd_epi16(u->ls16, load256(y->bsums)));
    return (d * y->d) * ((float)sumi + 0.125f * (float)_mm512_reduce_add_epi32(accd));
}
#endif

/* IQ1_S (50 bytes: d, qs[32], u16 qh[8]) against a Q8_K block: (d_w d_x) (sumi + 0.125 sumd), sumi = sum over
 * the 32s of ls times their dot with the grid (-1, 0, 1), sumd = sum of ls delta times their activation sum. */
static inline float dot_iq1_s(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
#if defined(IQ1_VECTOR)
    iq1_block u;
    iq1_s_unpack(b, &u);
    return iq1_s_term(&u, y, f16_to_f32(b));
#else
    const uint64_t ones[4] = {ONES8, ONES8, ONES8, ONES8};
    isum32 acc = ISUM_ZERO;
    int sumd = 0;
    for (int ib = 0; ib < 8; ib++) {
        int h = b[34 + 2 * ib] | (b[35 + 2 * ib] << 8), ls = 2 * ((h >> 12) & 7) + 1;
        uint64_t s[4];
        for (int l = 0; l < 4; l++) s[l] = iq1s_grid8[b[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8)];
        acc = dot32(acc, ones, s, ls, ls, y->qs + 32 * ib);
        sumd += ls * (h & 0x8000 ? -1 : 1) * (y->bsums[2 * ib] + y->bsums[2 * ib + 1]);
    }
    return (f16_to_f32(b) * y->d) * ((float)ISUM_TOTAL(acc) + 0.125f * (float)sumd);
#endif
}

/* IQ1_M (56 bytes: qs[32], qh[16], u16 sc[4], d in the top nibbles of sc) against a Q8_K block: as IQ1_S with a
 * scale per 16 values and a delta per 8. */
static inline float iq1_m_scale(const uint8_t *b) {       /* IQ1_M's d: the top nibbles of its 4 scale words */
    uint16_t sc[4];
    memcpy(sc, b + 48, 8);
    uint16_t bits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    return f16_to_f32((const uint8_t *)&bits);
}

static inline float dot_iq1_m(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    float d = iq1_m_scale(b);
#if defined(IQ1_VECTOR)
    iq1_block u;
    iq1_m_unpack(b, &u);
    return iq1_m_term(&u, y, d);
#else
    uint16_t sc[4];
    memcpy(sc, b + 48, 8);
    const uint64_t ones[4] = {ONES8, ONES8, ONES8, ONES8};
    isum32 acc = ISUM_ZERO, accd = ISUM_ZERO;
    for (int ib = 0; ib < 8; ib++) {
        uint64_t s[4], delta[4];
        for (int l = 0; l < 4; l++) {
            int nib = (b[32 + 2 * ib + l / 2] >> (4 * (l % 2))) & 15;
            s[l] = iq1s_grid8[b[4 * ib + l] | ((nib & 7) << 8)];
            delta[l] = nib & 8 ? ~0ull : ONES8;
        }
        int lo = 2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 7) + 1, hi = 2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 7) + 1;
        acc = dot32(acc, ones, s, lo, hi, y->qs + 32 * ib);
        accd = dot32(accd, ones, delta, lo, hi, y->qs + 32 * ib);
    }
    return (d * y->d) * ((float)ISUM_TOTAL(acc) + 0.125f * (float)ISUM_TOTAL(accd));
#endif
}

static inline int bsums_total(const q8k_block *y) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += y->bsums[j];
    return s;
}

/* TQ2_0 (66 bytes: 2-bit codes q, d) against a Q8_K block: (d_w d_x) isum, isum = sum (q - 1) x = sum q x - sum x. */
#if defined(IQ2_VECTOR)
/* TQ2_0 unpacked: its 256 codes, 64 a step (step i: bit pairs 2 (i % 2) and 2 (i % 2) + 1 of qs[32 (i / 2)..]).
 * The codes' -1 is taken off as the activations' sum. */
typedef struct { __m512i codes[4]; } tq2_block;

static inline __attribute__((always_inline)) void tq2_0_unpack(const uint8_t *b, tq2_block *u) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i shift = _mm512_set_epi64(4 * (i % 2) + 2, 4 * (i % 2) + 2, 4 * (i % 2) + 2, 4 * (i % 2) + 2,
                                         4 * (i % 2), 4 * (i % 2), 4 * (i % 2), 4 * (i % 2));
        u->codes[i] = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(load256(b + 32 * (i / 2))), shift),
                                       _mm512_set1_epi8(3));
    }
}

static inline __attribute__((always_inline)) float tq2_0_term(const tq2_block *u, const q8k_block *y, float d) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc = _mm512_dpbusd_epi32(acc, u->codes[i], _mm512_loadu_si512(y->qs + 64 * i));
    return (d * y->d) * (float)(_mm512_reduce_add_epi32(acc) - bsums_total(y));
}
#endif

static inline float dot_tq2_0(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
#if defined(IQ2_VECTOR)
    tq2_block u;
    tq2_0_unpack(b, &u);
    return tq2_0_term(&u, y, f16_to_f32(b + 64));
#else
    int isum = 0;
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 2; c++) {
        __m256i v = load256(b + 32 * c);
        for (int s = 0; s < 4; s++) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), _mm256_set1_epi8(3));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, load256(y->qs + 128 * c + 32 * s)),
                                                          _mm256_set1_epi16(1)));
        }
    }
    isum = hsum_i32(acc);
#else
    for (int j = 0; j < 256; j++) isum += ((b[32 * (j / 128) + j % 32] >> (2 * ((j / 32) % 4))) & 3) * y->qs[j];
#endif
    return (f16_to_f32(b + 64) * y->d) * (float)(isum - bsums_total(y));
#endif
}

#if defined(IQ2_VECTOR)
static inline __m512i base3_digit512(__m512i v, __m512i mult) {  /* per byte: ((v mult mod 256) 3) >> 8, 0..2 */
    const __m512i low = _mm512_set1_epi16(0x00ff), high = _mm512_set1_epi16((short)0xff00), three = _mm512_set1_epi16(3);
    __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_mullo_epi16(v, mult), low), _mm512_slli_epi16(
        _mm512_mullo_epi16(_mm512_srli_epi16(v, 8), _mm512_srli_epi16(mult, 8)), 8));
    return _mm512_or_si512(_mm512_srli_epi16(_mm512_mullo_epi16(_mm512_and_si512(q, low), three), 8),
                           _mm512_and_si512(_mm512_mullo_epi16(_mm512_srli_epi16(q, 8), three), high));
}
#endif

#if defined(__AVX2__)
static inline __m256i base3_digit(__m256i v, __m256i mult) {  /* per byte: ((v mult mod 256) 3) >> 8, 0..2 */
    const __m256i low = _mm256_set1_epi16(0x00ff), high = _mm256_set1_epi16((short)0xff00), three = _mm256_set1_epi16(3);
    __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_mullo_epi16(v, mult), low), _mm256_slli_epi16(
        _mm256_mullo_epi16(_mm256_srli_epi16(v, 8), _mm256_srli_epi16(mult, 8)), 8));
    return _mm256_or_si256(_mm256_srli_epi16(_mm256_mullo_epi16(_mm256_and_si256(q, low), three), 8),
                           _mm256_and_si256(_mm256_mullo_epi16(_mm256_srli_epi16(q, 8), three), high));
}
#endif

#if defined(IQ2_VECTOR)
/* TQ1_0 unpacked: its 256 digits, 64 a step: [digits 0, 1 of qs[0..31]], [2, 3], [4; 0, 1 of qs[32..47]],
 * [2, 3, 4 of those; qh's]. The codes' -1 is taken off as the activations' sum. */
typedef struct { __m512i digits[4]; } tq1_block;

static inline __attribute__((always_inline)) void tq1_0_unpack(const uint8_t *b, tq1_block *u) {
    __m256i qs = load256(b);
    __m128i rest = _mm_loadu_si128((const __m128i *)(b + 32));
    uint32_t qh;
    memcpy(&qh, b + 48, 4);
    const int p1 = 0x01010101, p3 = 0x03030303, p9 = 0x09090909, p27 = 0x1b1b1b1b, p81 = 0x51515151;
    __m512i both = _mm512_broadcast_i64x4(qs), three = _mm512_broadcast_i32x4(rest);
    u->digits[0] = base3_digit512(both, _mm512_set_epi32(p3, p3, p3, p3, p3, p3, p3, p3, p1, p1, p1, p1, p1, p1, p1, p1));
    u->digits[1] = base3_digit512(both, _mm512_set_epi32(p27, p27, p27, p27, p27, p27, p27, p27, p9, p9, p9, p9, p9, p9,
                                                         p9, p9));
    u->digits[2] = base3_digit512(_mm512_inserti64x4(both, _mm256_broadcastsi128_si256(rest), 1),
                                  _mm512_set_epi32(p3, p3, p3, p3, p1, p1, p1, p1, p81, p81, p81, p81, p81, p81, p81, p81));
    u->digits[3] = base3_digit512(_mm512_inserti32x4(three, _mm_set1_epi32((int)qh), 3),
                                  _mm512_set_epi32(p27, p9, p3, p1, p81, p81, p81, p81, p27, p27, p27, p27, p9, p9, p9, p9));
}

static inline __attribute__((always_inline)) float tq1_0_term(const tq1_block *u, const q8k_block *y, float d) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc = _mm512_dpbusd_epi32(acc, u->digits[i], _mm512_loadu_si512(y->qs + 64 * i));
    return (d * y->d) * (float)(_mm512_reduce_add_epi32(acc) - bsums_total(y));
}
#endif

/* TQ1_0 (54 bytes: qs[48], qh[4] of base-3 digits q, d) against a Q8_K block: (d_w d_x) (sum q x - sum x).
 * Values 32p + l are digit p of qs[l], 160 + 16p + l digit p of qs[32 + l], 240 + 4p + l digit p of qh[l]. */
static inline float dot_tq1_0(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
#if defined(IQ2_VECTOR)
    tq1_block u;
    tq1_0_unpack(b, &u);
    return tq1_0_term(&u, y, f16_to_f32(b + 52));
#else
    int isum = 0;
#if defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256(), qs = load256(b);
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    for (int p = 0; p < 5; p++)
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(
            base3_digit(qs, _mm256_set1_epi8((char)pow3[p])), load256(y->qs + 32 * p)), ones));
    __m128i rest = _mm_loadu_si128((const __m128i *)(b + 32));
    __m256i pairs = _mm256_set_m128i(rest, rest);
    for (int p = 0; p < 2; p++)         /* digits 2p (values 160 + 32p..) and 2p + 1 (the next 16) */
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(base3_digit(pairs, _mm256_set_m128i(
            _mm_set1_epi8((char)pow3[2 * p + 1]), _mm_set1_epi8((char)pow3[2 * p]))), load256(y->qs + 160 + 32 * p)), ones));
    uint32_t qh;
    memcpy(&qh, b + 48, 4);
    __m256i last = _mm256_set_m128i(_mm_set1_epi32((int)qh), rest);     /* digit 4 of qs[32..47], then qh's digits */
    __m256i mult = _mm256_set_m128i(_mm_set_epi32(0x1b1b1b1b, 0x09090909, 0x03030303, 0x01010101), _mm_set1_epi8(81));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(base3_digit(last, mult), load256(y->qs + 224)),
                                                  ones));
    isum = hsum_i32(acc);
#else
    static const int pow3[5] = {1, 3, 9, 27, 81};
    for (int j = 0; j < 256; j++) {
        int byte = j < 160 ? b[j % 32] : j < 240 ? b[32 + (j - 160) % 16] : b[48 + (j - 240) % 4];
        int p = j < 160 ? j / 32 : j < 240 ? (j - 160) / 16 : (j - 240) / 4;
        isum += ((((byte * pow3[p]) & 255) * 3) >> 8) * y->qs[j];
    }
#endif
    return (f16_to_f32(b + 52) * y->d) * (float)(isum - bsums_total(y));
#endif
}

#if defined(IQ2_VECTOR)
/* Blocks w[0..4) of bb bytes (d first) against y[0..4) added to acc: their integer sums (`sums`) reduced together,
 * their float terms lane by lane (the dot functions' operations), then added in block order: the same bits. */
#define STEP4_SUMS(type, bb)                                                                                     \
    static inline float step4_##type(float acc, const uint8_t *w, const q8k_block *y) {                         \
        float t[4];                                                                                              \
        uint16_t h[4];                                                                                           \
        for (int i = 0; i < 4; i++) {                                                                            \
            prefetch_ahead(w + bb * i, bb);                                                                      \
            memcpy(&h[i], w + bb * i, 2);                                                                        \
        }                                                                                                        \
        __m128i sums = sum4_epi32(type##_sums(w, y), type##_sums(w + bb, y + 1), type##_sums(w + 2 * bb, y + 2), \
                                  type##_sums(w + 3 * bb, y + 3));                                               \
        __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));                                            \
        __m128 yd = _mm_set_ps(y[3].d, y[2].d, y[1].d, y[0].d);                                                  \
        _mm_storeu_ps(t, _mm_mul_ps(_mm_mul_ps(d, yd), _mm_cvtepi32_ps(sums)));                                  \
        return (((acc + t[0]) + t[1]) + t[2]) + t[3];                                                            \
    }
STEP4_SUMS(iq3_xxs, 98)
STEP4_SUMS(iq3_s, 110)
STEP4_SUMS(iq2_xs, 74)
STEP4_SUMS(iq2_s, 82)
#define STEP4_CODEBOOK(type) step4_##type
#else
#define STEP4_CODEBOOK(type) NULL
#endif

/* The rows of the types above (one row; four rows in turn), `factor` applied to each row's sum at the end. */
#define CODEBOOK_ROWS(type, bb, factor, step)                                                                    \
    static float row_##type(const uint8_t *row, const uint8_t *act, int64_t nb) {                                 \
        float acc;                                                                                               \
        rows_k(step, 4, dot_##type, bb, 1, &row, act, nb, &acc);                                                 \
        return factor * acc;                                                                                     \
    }                                                                                                            \
    static void rows_##type(const uint8_t *const *r, const uint8_t *act, int64_t nb, float *out) {              \
        rows_k(step, 4, dot_##type, bb, 4, r, act, nb, out);                                                     \
        for (int i = 0; i < 4; i++) out[i] *= factor;                                                            \
    }
CODEBOOK_ROWS(iq3_xxs, 98, 0.25f, STEP4_CODEBOOK(iq3_xxs))
CODEBOOK_ROWS(iq3_s, 110, 1.0f, STEP4_CODEBOOK(iq3_s))
CODEBOOK_ROWS(iq2_xs, 74, 0.125f, STEP4_CODEBOOK(iq2_xs))
CODEBOOK_ROWS(iq2_s, 82, 0.125f, STEP4_CODEBOOK(iq2_s))
CODEBOOK_ROWS(iq1_s, 50, 1.0f, NULL)
CODEBOOK_ROWS(iq1_m, 56, 1.0f, NULL)
CODEBOOK_ROWS(tq2_0, 66, 1.0f, NULL)
CODEBOOK_ROWS(tq1_0, 54, 1.0f, NULL)

/* Output rows [n0, n1) of y [M, N]: each (row, output) through `row_dot` (bs values in bb bytes per weight
 * block, ab bytes per activation block). */
static inline __attribute__((always_inline)) void rows_q8(
        row8_fn row_dot, const int bs, const int bb, const int ab, const uint8_t *w, int64_t expert_bytes,
        const int64_t *experts, int64_t N, int64_t K, const uint8_t *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / bs, row_bytes = nb * bb;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            if (experts != NULL && experts[m] < 0) { y[m * N + n] = 0.0f; continue; }   /* another rank's */
            const uint8_t *row = w + (experts == NULL ? 0 : experts[m] * expert_bytes) + n * row_bytes;
            y[m * N + n] = row_dot(row, xq + m * nb * ab, nb);
        }
}

typedef void (*rows4_fn)(const uint8_t *const *, const uint8_t *, int64_t, float *);

/* Rows [n0, n1) where each row has a weight of its own (M = 1, routed experts), four at a time: rows n, n + q,
 * n + 2q and n + 3q (q a quarter of the range) through `four`, which takes their blocks in turn, so the weight is
 * fetched as four streams at once (as qgemv.c's own_rows4); the last (n1 - n0) % 4 rows through `one`. Each row's
 * arithmetic is `one`'s, so the same bits as rows_q8. */
static inline __attribute__((always_inline)) void own_rows4_q8(
        rows4_fn four, row8_fn one, const int bs, const int bb, const int ab, const uint8_t *w, int64_t expert_bytes,
        const int64_t *experts, int64_t N, int64_t K, const uint8_t *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / bs, row_bytes = nb * bb, q = (n1 - n0) / 4;
    for (int64_t m = 0; m < M; m++) {
        float *ym = y + m * N;
        if (experts != NULL && experts[m] < 0) {        /* another rank's */
            for (int64_t n = n0; n < n1; n++) ym[n] = 0.0f;
            continue;
        }
        const uint8_t *base = w + (experts == NULL ? 0 : experts[m] * expert_bytes), *act = xq + m * nb * ab;
        for (int64_t n = n0; n < n0 + q; n++) {
            const uint8_t *r[4] = {base + n * row_bytes, base + (n + q) * row_bytes, base + (n + 2 * q) * row_bytes,
                                   base + (n + 3 * q) * row_bytes};
            float out[4];
            four(r, act, nb, out);
            for (int i = 0; i < 4; i++) ym[n + i * q] = out[i];
        }
        for (int64_t n = n0 + 4 * q; n < n1; n++) ym[n] = one(base + n * row_bytes, act, nb);
    }
}

/* The other types' row functions (one row, four rows in turn), block values, weight and activation block bytes. */
typedef struct { int type; row8_fn one; rows4_fn four; int bs, bb, ab; } row_type;

static const row_type *other_type(int type) {
    static const row_type types[] = {
        {11, row_q3_k, rows_q3_k, 256, 110, sizeof(q8k_block)}, {13, row_q5_k, rows_q5_k, 256, 176, sizeof(q8k_block)},
        {14, row_q6_k, rows_q6_k, 256, 210, sizeof(q8k_block)},
        {23, row_iq4_xs, rows_iq4_xs, 256, 136, sizeof(q8k_block)},
        {1, row_f16, rows_f16, 32, 64, 32 * sizeof(float)},
        {2, row_q4_0, rows_q4_0, 32, 18, sizeof(q8_0_block)}, {6, row_q5_0, rows_q5_0, 32, 22, sizeof(q8_0_block)},
        {20, row_iq4_nl, rows_iq4_nl, 32, 18, sizeof(q8_0_block)},
        {39, row_mxfp4, rows_mxfp4, 32, 17, sizeof(q8_0_block)},
        {3, row_q4_1, rows_q4_1, 32, 20, sizeof(q8_1_block)}, {7, row_q5_1, rows_q5_1, 32, 24, sizeof(q8_1_block)},
        {18, row_iq3_xxs, rows_iq3_xxs, 256, 98, sizeof(q8k_block)},
        {21, row_iq3_s, rows_iq3_s, 256, 110, sizeof(q8k_block)},
        {17, row_iq2_xs, rows_iq2_xs, 256, 74, sizeof(q8k_block)}, {22, row_iq2_s, rows_iq2_s, 256, 82, sizeof(q8k_block)},
        {19, row_iq1_s, rows_iq1_s, 256, 50, sizeof(q8k_block)}, {29, row_iq1_m, rows_iq1_m, 256, 56, sizeof(q8k_block)},
        {35, row_tq2_0, rows_tq2_0, 256, 66, sizeof(q8k_block)}, {34, row_tq1_0, rows_tq1_0, 256, 54, sizeof(q8k_block)},
        {30, row_bf16, rows_bf16, 32, 64, 32 * sizeof(float)},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (types[i].type == type) return &types[i];
    return NULL;
}

/* y [M, N] rows [n0, n1) = x @ W.T for a weight of GGUF type `type` (16 IQ2_XXS after qdot8_set_iq2_xxs,
 * 10 Q2_K, 12 Q4_K, 11 Q3_K, 13 Q5_K, 14 Q6_K, 23 IQ4_XS, 35 TQ2_0, 34 TQ1_0 and after qdot8_set_grid 18 IQ3_XXS,
 * 21 IQ3_S, 17 IQ2_XS, 22 IQ2_S, 19 IQ1_S, 29 IQ1_M: `xq` from q8_quantize kind 0; 8 Q8_0, 2 Q4_0, 6 Q5_0,
 * 20 IQ4_NL, 39 MXFP4: kind 1; 3 Q4_1, 7 Q5_1: kind 3; 1 F16: kind 2; 30 BF16: kind 4),
 * M <= 16; experts as in qgemv.c (row m
 * uses the weight at w + experts[m] * expert_bytes; experts[m] < 0 gives 0). Returns -1 for a call it cannot
 * serve. */
int qdot8(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    const uint8_t *x = xq;
    if (M > Q8_MAX_ROWS) return -1;
    const int k_bytes = (int)sizeof(q8k_block), own = experts != NULL || M == 1;     /* a weight row of its own */
    switch (type) {
    case 16: if (K % 256) return -1;
#if IQ2_CHUNKS
        if (own) {      /* each activation row copied with its bytes in chunk order, then its rows of its own */
            int64_t nb = K / 256;
            q8k_block *xo = malloc((size_t)nb * sizeof(q8k_block));
            if (xo == NULL) return -2;
            for (int64_t m = 0; m < M; m++) {
                memcpy(xo, x + m * nb * k_bytes, (size_t)nb * sizeof(q8k_block));
                for (int64_t b = 0; b < nb; b++) iq2_chunk_order(((const q8k_block *)x)[m * nb + b].qs, xo[b].qs);
                own_rows4_q8(rows_iq2_xxs_chunks, row_iq2_xxs_chunks, 256, 66, k_bytes, w, expert_bytes,
                             experts == NULL ? NULL : experts + m, N, K, (const uint8_t *)xo, 1, y + m * N, n0, n1);
            }
            free(xo);
            return 0;
        }
#endif
        if (own) { own_rows4_q8(rows_iq2_xxs, row_iq2_xxs, 256, 66, k_bytes, w, expert_bytes, experts, N, K, x, M, y,
                                n0, n1); return 0; }
        rows_q8(row_iq2_xxs, 256, 66, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 10: if (K % 256) return -1;
        if (own) { own_rows4_q8(rows_q2_k, row_q2_k, 256, 84, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
                   return 0; }
        rows_q8(row_q2_k, 256, 84, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 12: if (K % 256) return -1;
        if (own) { own_rows4_q8(rows_q4_k, row_q4_k, 256, 144, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0,
                                n1); return 0; }
        rows_q8(row_q4_k, 256, 144, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 8: if (K % 32) return -1;
#if defined(Q8_0_PAIRS)
        if (own) return own_rows4_q8_0(w, expert_bytes, experts, N, K, x, M, y, n0, n1);
#else
        if (own) { own_rows4_q8(rows_q8_0, row_q8_0, 32, 34, (int)sizeof(q8_0_block), w, expert_bytes, experts, N, K,
                                x, M, y, n0, n1); return 0; }
#endif
        rows_q8(row_q8_0, 32, 34, (int)sizeof(q8_0_block), w, expert_bytes, experts, N, K, x, M, y, n0, n1);
        return 0;
    default: break;
    }
    const row_type *t = other_type(type);     /* the rest: one driver, four streams for the rows of their own */
    if (t == NULL) return -1;
    if (K % t->bs) return -1;
    if (own) own_rows4_q8(t->four, t->one, t->bs, t->bb, t->ab, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
    else rows_q8(t->one, t->bs, t->bb, t->ab, w, expert_bytes, experts, N, K, x, M, y, n0, n1);
    return 0;
}

/* Several rows against one weight (M = 2..16 of a plain weight: verify, and each routed expert's rows at
 * prefill): each weight block is read and unpacked once (nibbles, 2-bit fields, grid rows, scale vectors)
 * and dotted with every row's activation block; each row keeps its own float sum, adding the same block terms
 * in the same order as the 1-row functions above, so every output has the same bits as the 1-row call. */
#if defined(__AVX2__)
/* One unpacked K-quant block (q: 8 x 32 values, scale: their scales as int16 pairs, mins: the 16 mins as int16)
 * against every row's Q8_K block k: each row's integer sums and float step as the 1-row function's. */
static inline __attribute__((always_inline)) void rows8_k_block(const __m256i *q, const __m256i *scale, __m256i mins,
        float d, float dmin, const q8k_block *x, int64_t nb, int64_t k, int64_t M, float *acc) {
    for (int64_t m = 0; m < M; m++) {
        const q8k_block *a = x + m * nb + k;
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++)
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load256(a->qs + 32 * j)),
                                                          scale[j]));
        int isum = hsum_i32(sum), msum = hsum_i32(_mm256_madd_epi16(mins, load256(a->bsums)));
        acc[m] += (a->d * d) * (float)isum - (a->d * dmin) * (float)msum;
    }
}

static void rows8_q4_k(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                       int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    const __m256i nibble = _mm256_set1_epi8(15);
    for (int64_t n = n0; n < n1; n++) {
        float acc[Q8_MAX_ROWS] = {0};
        const uint8_t *b = w + n * nb * 144;
        for (int64_t k = 0; k < nb; k++, b += 144) {
            prefetch_ahead(b, 144);
            const uint8_t *s = b + 4, *qs = b + 16;
            int16_t low[16];        /* each group's min twice: the pairs of 16-value sums bsums holds */
            __m256i q[8], scale[8];
            for (int j = 0; j < 4; j++) {
                scale[j] = _mm256_set1_epi16((short)(s[j] & 63));
                low[2 * j] = low[2 * j + 1] = (int16_t)(s[4 + j] & 63);
                scale[4 + j] = _mm256_set1_epi16((short)((s[8 + j] & 15) | ((s[j] >> 6) << 4)));
                low[8 + 2 * j] = low[9 + 2 * j] = (int16_t)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
            }
            __m256i lows = load256(low);
            for (int c = 0; c < 4; c++) {
                __m256i q4 = load256(qs + 32 * c);
                q[2 * c] = _mm256_and_si256(q4, nibble);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q4, 4), nibble);
            }
            rows8_k_block(q, scale, lows, f16_to_f32(b), f16_to_f32(b + 2), x, nb, k, M, acc);
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = acc[m];
    }
}

static void rows8_q2_k(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                       int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    const __m256i three = _mm256_set1_epi8(3);
    for (int64_t n = n0; n < n1; n++) {
        float acc[Q8_MAX_ROWS] = {0};
        const uint8_t *b = w + n * nb * 84;
        for (int64_t k = 0; k < nb; k++, b += 84) {
            prefetch_ahead(b, 84);
            __m128i scales = _mm_loadu_si128((const __m128i *)b);
            __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scales, 4), _mm_set1_epi8(15)));
            __m256i low = _mm256_broadcastsi128_si256(_mm_and_si128(scales, _mm_set1_epi8(15)));
            __m256i q[8], scale[8];
            for (int h = 0; h < 2; h++) {
                __m256i q2 = load256(b + 16 + 32 * h);
                for (int i = 0; i < 4; i++) {       /* elements 128h + 32i + (0..31) */
                    q[4 * h + i] = _mm256_and_si256(_mm256_srli_epi16(q2, 2 * i), three);
                    scale[4 * h + i] = _mm256_shuffle_epi8(low, load256(pair_shuffle[4 * h + i]));
                }
            }
            rows8_k_block(q, scale, mins, f16_to_f32(b + 80), f16_to_f32(b + 82), x, nb, k, M, acc);
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = acc[m];
    }
}

static void rows8_iq2_xxs(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                          int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    for (int64_t n = n0; n < n1; n++) {
        float acc[Q8_MAX_ROWS] = {0};
        const uint8_t *b = w + n * nb * 66;
        for (int64_t k = 0; k < nb; k++, b += 66) {
            prefetch_ahead(b, 66);
            const uint8_t *p = b + 2;
            __m256i grid[8], sign[8], scale[8];
            for (int g = 0; g < 8; g++, p += 8) {
                uint32_t bits;
                memcpy(&bits, p + 4, 4);
                grid[g] = _mm256_set_epi64x((long long)iq2_grid_bytes[p[3]], (long long)iq2_grid_bytes[p[2]],
                                            (long long)iq2_grid_bytes[p[1]], (long long)iq2_grid_bytes[p[0]]);
                sign[g] = _mm256_set_epi64x((long long)iq2_sign_bytes[(bits >> 21) & 127],
                                            (long long)iq2_sign_bytes[(bits >> 14) & 127],
                                            (long long)iq2_sign_bytes[(bits >> 7) & 127],
                                            (long long)iq2_sign_bytes[bits & 127]);
                scale[g] = _mm256_set1_epi16((short)(2 * (bits >> 28) + 1));
            }
            float d = f16_to_f32(b);
            for (int64_t m = 0; m < M; m++) {
                const q8k_block *a = x + m * nb + k;
                __m256i sum = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    __m256i prod = _mm256_maddubs_epi16(grid[g], _mm256_sign_epi8(load256(a->qs + 32 * g), sign[g]));
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(prod, scale[g]));
                }
                acc[m] += (d * a->d) * (float)hsum_i32(sum);
            }
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = 0.125f * acc[m];
    }
}

static void rows8_q8_0(const uint8_t *w, int64_t N, int64_t K, const q8_0_block *x, int64_t M, float *y,
                       int64_t n0, int64_t n1) {
    /* each block read once for every row, whole blocks as row_q8_0: 4 rows' integer sums folded into one vector
     * (lane j: row m0 + j) and their float steps in one */
    int64_t nb = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        __m128 acc[Q8_MAX_ROWS / 4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
        const uint8_t *b = w + n * nb * 34;
        for (int64_t k = 0; k < nb; k++, b += 34) {
            prefetch_wide(b, 34);
            __m256i v = load256(b + 2), magnitude = _mm256_sign_epi8(v, v);
            __m128 d = _mm_set1_ps(f16_to_f32(b));
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                __m256i dots[4];
                float dx[4];
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const q8_0_block *a = x + (m0 + j < M ? m0 + j : m0) * nb + k;
                    dx[j] = a->d;
                    dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(load256(a->qs), v)),
                                                _mm256_set1_epi16(1));
                }
                __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3]));
                __m128i isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                acc[m0 / 4] = _mm_add_ps(acc[m0 / 4], _mm_mul_ps(_mm_mul_ps(d, _mm_loadu_ps(dx)), _mm_cvtepi32_ps(isum)));
            }
        }
        float out[Q8_MAX_ROWS];
        for (int64_t m0 = 0; m0 < M; m0 += 4) _mm_storeu_ps(out + m0, acc[m0 / 4]);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = out[m];
    }
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define WIDE_ROWS 1
/* With AVX-512 (BW, VNNI): 64 values per instruction (`vpmaddubsw`, then `vpdpwssd` with the group scales), and
 * rows taken 4 at a time, whose integer sums are reduced together (one vector holds the 4 rows' sums) and whose
 * float terms are computed lane by lane: each lane does exactly the scalar steps of the 1-row function. */
static inline __m128i fold4(const __m256i *s) {       /* lane m = the sum of s[m]'s 8 lanes (exact) */
    __m256i ab = _mm256_hadd_epi32(s[0], s[1]), cd = _mm256_hadd_epi32(s[2], s[3]);
    __m256i abcd = _mm256_hadd_epi32(ab, cd);
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

static inline __m512i halves512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m128 row_scales(const q8k_block *x, int64_t nb, int64_t k, int64_t m0, int64_t M) {
    float d[4];     /* each of the 4 rows' activation scale for block k (0 past M) */
    for (int j = 0; j < 4; j++) d[j] = m0 + j < M ? x[(m0 + j) * nb + k].d : 0.0f;
    return _mm_set_ps(d[3], d[2], d[1], d[0]);
}

/* The block terms of rows [m0, m0 + 4) (those below M) of a 256-value K-quant: (dx d) isum - (dx dmin) msum per
 * row, isum from the 4 64-value products against q[c] scaled by scale[c], msum = lows . bsums. */
static inline __attribute__((always_inline)) __m128 terms4_k(const __m512i *q, const __m512i *scale, __m256i lows,
        float d, float dmin, const q8k_block *x, int64_t nb, int64_t k, int64_t m0, int64_t M) {
    __m256i is[4], ms[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        if (m0 + j >= M) { is[j] = ms[j] = _mm256_setzero_si256(); continue; }
        const q8k_block *a = x + (m0 + j) * nb + k;
        __m512i sum = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++)
            sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(q[c], _mm512_loadu_si512(a->qs + 64 * c)), scale[c]);
        is[j] = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        ms[j] = _mm256_madd_epi16(lows, load256(a->bsums));
    }
    __m128 vd = row_scales(x, nb, k, m0, M);
    return _mm_sub_ps(_mm_mul_ps(_mm_mul_ps(vd, _mm_set1_ps(d)), _mm_cvtepi32_ps(fold4(is))),
                      _mm_mul_ps(_mm_mul_ps(vd, _mm_set1_ps(dmin)), _mm_cvtepi32_ps(fold4(ms))));
}

static void store_rows(const __m128 *acc, int64_t M, float *y, int64_t N, int64_t n, float factor) {
    float out[Q8_MAX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += 4) _mm_storeu_ps(out + m0, acc[m0 / 4]);
    for (int64_t m = 0; m < M; m++) y[m * N + n] = factor * out[m];
}

static void wide_q4_k(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                      int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    __m512i pick[4];        /* int16 lanes 0-15 <- scale 2c, 16-31 <- scale 2c + 1 */
    for (int c = 0; c < 4; c++)
        pick[c] = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1);
    const __m256i twice = _mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t n = n0; n < n1; n++) {
        __m128 acc[Q8_MAX_ROWS / 4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
        const uint8_t *b = w + n * nb * 144;
        for (int64_t k = 0; k < nb; k++, b += 144) {
            prefetch_ahead(b, 144);
            uint32_t u[3];          /* the 6-bit scales and mins, 8 bytes each (dot_q4_k's unpacking, per word) */
            memcpy(u, b + 4, 12);
            uint64_t sc = (u[0] & 0x3f3f3f3fu) | (uint64_t)((u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)) << 32;
            uint64_t mn = (u[1] & 0x3f3f3f3fu) | (uint64_t)(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)) << 32;
            __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
            __m256i lows = _mm256_permutexvar_epi16(twice, _mm256_castsi128_si256(
                _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn))));      /* each min twice: bsums' pairs */
            __m512i q[4], scale[4];
            for (int c = 0; c < 4; c++) {     /* values 64c..64c+63: chunk c's low nibbles, then its high ones */
                __m256i q4 = load256(b + 16 + 32 * c);
                q[c] = _mm512_and_si512(halves512(q4, _mm256_srli_epi16(q4, 4)), nibble);
                scale[c] = _mm512_permutexvar_epi16(pick[c], scales);
            }
            float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
            for (int64_t m0 = 0; m0 < M; m0 += 4)
                acc[m0 / 4] = _mm_add_ps(acc[m0 / 4], terms4_k(q, scale, lows, d, dmin, x, nb, k, m0, M));
        }
        store_rows(acc, M, y, N, n, 1.0f);
    }
}

/* Q8_0 rows (M = 2..16) sharing each weight block: two weight rows against two activation rows at a time, two
 * blocks a step, (w + 128) . x by vpdpbusd folded into one vector (lane j + 4h: pair j of (weight row, activation
 * row), block b + h) less 128 sum(x) (per call), and the four pairs' float steps in one, block b before b + 1; an odd
 * last block alone: each output the bits of row_q8_0. A missing second row (odd M, or the chunk's last weight row)
 * repeats the first and is not stored. */
#if defined(__F16C__)
typedef struct { __m256i corr; __m256 dx; } q8_0_rows2;     /* per activation row pair and block pair */

static int wide_q8_0(const uint8_t *w, int64_t N, int64_t K, const q8_0_block *x, int64_t M, float *y,
                     int64_t n0, int64_t n1) {
    int64_t nb = K / 32, pairs = nb / 2, groups = (M + 1) / 2;
    q8_0_rows2 *g = aligned_alloc(64, (size_t)(groups * pairs + 1) * sizeof *g);
    if (g == NULL) return -2;
    for (int64_t i = 0; i < groups; i++)
        for (int64_t p = 0; p < pairs; p++) {
            int32_t corr[8];
            float dx[8];
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++) {       /* lane j + 4h: activation row 2i + j % 2, block 2p + h */
                    const q8_0_block *a = x + (2 * i + j % 2 < M ? 2 * i + j % 2 : M - 1) * nb + 2 * p + h;
                    int32_t s = 0;
                    for (int v = 0; v < 32; v++) s += a->qs[v];
                    corr[4 * h + j] = 128 * s;
                    dx[4 * h + j] = a->d;
                }
            memcpy(&g[i * pairs + p].corr, corr, 32);
            memcpy(&g[i * pairs + p].dx, dx, 32);
        }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t n = n0; n < n1; n += 2) {
        const uint8_t *r0 = w + n * nb * 34, *r1 = n + 1 < n1 ? r0 + nb * 34 : r0;
        __m128 acc[Q8_MAX_ROWS / 2];
        for (int64_t i = 0; i < groups; i++) acc[i] = _mm_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t *b0 = r0 + 68 * p, *b1 = r1 + 68 * p;
            prefetch_wide(b0, 68);
            prefetch_wide(b1, 68);
            __m512i w0 = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(load256(b0 + 2)), load256(b0 + 36), 1),
                                          flip);
            __m512i w1 = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(load256(b1 + 2)), load256(b1 + 36), 1),
                                          flip);
            short h0 = q8_0_scale_bits(b0), h1 = q8_0_scale_bits(b1), h2 = q8_0_scale_bits(b0 + 34),
                  h3 = q8_0_scale_bits(b1 + 34);
            __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(h0, h0, h1, h1, h2, h2, h3, h3));
            for (int64_t i = 0; i < groups; i++) {
                const q8_0_block *a0 = x + 2 * i * nb + 2 * p, *a1 = 2 * i + 1 < M ? a0 + nb : a0;
                __m512i x0 = _mm512_inserti64x4(_mm512_castsi256_si512(load256(a0[0].qs)), load256(a0[1].qs), 1);
                __m512i x1 = _mm512_inserti64x4(_mm512_castsi256_si512(load256(a1[0].qs)), load256(a1[1].qs), 1);
                __m512i s[4] = {_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, x0),
                                _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, x1),
                                _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, x0),
                                _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, x1)};
                const q8_0_rows2 *c = &g[i * pairs + p];
                __m256 term = _mm256_mul_ps(_mm256_mul_ps(dw, c->dx),
                                            _mm256_cvtepi32_ps(_mm256_sub_epi32(q8_0_fold(s), c->corr)));
                acc[i] = _mm_add_ps(acc[i], _mm256_castps256_ps128(term));
                acc[i] = _mm_add_ps(acc[i], _mm256_extractf128_ps(term, 1));
            }
        }
        for (int64_t i = 0; i < groups; i++) {
            float out[4];
            _mm_storeu_ps(out, acc[i]);
            for (int j = 0; j < 4; j++) {
                int64_t m = 2 * i + j % 2, row = n + j / 2;
                if (m >= M || row >= n1) continue;
                float v = out[j];
                if (nb % 2) v = v + q8_0_term((j < 2 ? r0 : r1) + 34 * (nb - 1), x + m * nb + nb - 1);
                y[m * N + row] = v;
            }
        }
    }
    free(g);
    return 0;
}
#endif

#if defined(IQ2_VECTOR)
/* Blocks b..b + 3 of one IQ2_XXS weight row (wb: block b's bytes) added to the M rows' sums acc, each row as
 * row_iq2_xxs adds them (step4_iq2_xxs's reduction and float terms), the 4 blocks unpacked once for all rows. */
static inline void rows_step4_iq2_xxs(const uint8_t *wb, const q8k_block *x, int64_t nb, int64_t b, int64_t M,
                                      float *acc) {
    iq2_xxs_unpacked u[4];
    uint16_t h[4];      /* the blocks' d (f16) */
    for (int i = 0; i < 4; i++) {
        prefetch_ahead(wb + 66 * i, 66);
        iq2_xxs_unpack(wb + 66 * i, &u[i]);
        memcpy(&h[i], wb + 66 * i, 2);
    }
    __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));
    for (int64_t m = 0; m < M; m++) {
        const q8k_block *a = x + m * nb + b;
        __m128i sums = sum4_epi32(iq2_xxs_row(&u[0], a[0].qs), iq2_xxs_row(&u[1], a[1].qs),
                                  iq2_xxs_row(&u[2], a[2].qs), iq2_xxs_row(&u[3], a[3].qs));
        __m128 yd = _mm_set_ps(a[3].d, a[2].d, a[1].d, a[0].d);
        float t[4];
        _mm_storeu_ps(t, _mm_mul_ps(_mm_mul_ps(d, yd), _mm_cvtepi32_ps(sums)));
        acc[m] = (((acc[m] + t[0]) + t[1]) + t[2]) + t[3];
    }
}

/* Rows of one IQ2_XXS weight (M = 2..16), every output with the one-row call's bits: each weight row's blocks 4 at
 * a time (rows_step4_iq2_xxs), then dot_iq2_xxs on the blocks left (four streams as rows4_q2_k's measured 3-7%
 * slower: the arithmetic is the limit here). */
static void rows4_iq2_xxs(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                          int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    for (int64_t n = n0; n < n1; n++) {
        float acc[Q8_MAX_ROWS] = {0};
        const uint8_t *row = w + n * nb * 66;
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) rows_step4_iq2_xxs(row + 66 * b, x, nb, b, M, acc);
        for (; b < nb; b++)
            for (int64_t m = 0; m < M; m++) acc[m] += dot_iq2_xxs(row + 66 * b, x + m * nb + b);
        for (int64_t m = 0; m < M; m++) y[m * N + n] = 0.125f * acc[m];
    }
}
#endif

/* Q2_K, several rows of one weight: a block unpacked once for all rows into its 2-bit values times their group's
 * scale (at most 45: one vpdpbusd chain per row gives isum, no per-row scaling) and its mins. */
typedef struct { __m512i q[4]; __m256i mins; } q2_k_scaled;

static inline void q2_k_scale_values(const uint8_t *b, q2_k_scaled *u) {
    __m128i sc = _mm_loadu_si128((const __m128i *)b);
    u->mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(15)));
    __m512i low = _mm512_broadcast_i32x4(_mm_and_si128(sc, _mm_set1_epi8(15)));
    const __m512i three = _mm512_set1_epi8(3);
    /* shuffle control of 128-bit lane L: each int16 word = byte L (plus 4j below), its high byte zeroed */
    const __m512i lane = _mm512_set_epi32(0x80038003, 0x80038003, 0x80038003, 0x80038003, 0x80028002, 0x80028002,
                                          0x80028002, 0x80028002, 0x80018001, 0x80018001, 0x80018001, 0x80018001,
                                          0x80008000, 0x80008000, 0x80008000, 0x80008000);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {       /* values 64j..64j+63 (128-bit lane L: group 4j + L) */
        __m512i shift = _mm512_set_epi64(4 * (j % 2) + 2, 4 * (j % 2) + 2, 4 * (j % 2) + 2, 4 * (j % 2) + 2,
                                         4 * (j % 2), 4 * (j % 2), 4 * (j % 2), 4 * (j % 2));
        __m512i q = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(load256(b + 16 + 32 * (j / 2))), shift),
                                     three);
        /* int16 word of lane L: the group's scale (byte 4j + L, high byte zeroed); q < 4 and scale < 16, so one
         * 16-bit multiply scales both bytes of a word */
        __m512i pick = _mm512_add_epi32(lane, _mm512_set1_epi32(4 * j * 0x10001));
        u->q[j] = _mm512_mullo_epi16(q, _mm512_shuffle_epi8(low, pick));
    }
}

/* One activation row's isum (the return value's 16 lanes) and msum (`msum`'s 8 lanes) of an unpacked block. */
static inline __m512i q2_k_scaled_row(const q2_k_scaled *u, const q8k_block *y, __m512i *msum) {
    *msum = _mm512_castsi256_si512(_mm256_madd_epi16(u->mins, load256(y->bsums)));
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u->q[0], _mm512_loadu_si512(y->qs));
#pragma GCC unroll 3
    for (int j = 1; j < 4; j++) acc = _mm512_dpbusd_epi32(acc, u->q[j], _mm512_loadu_si512(y->qs + 64 * j));
    return acc;
}

/* Blocks b..b + 3 of one Q2_K weight row (wb: block b's bytes) added to the M rows' sums acc, each row as row_q2_k
 * adds them (step4_q2_k's integer sums, reduction and float terms), the 4 blocks unpacked once for all rows. */
static inline void rows_step4_q2_k(const uint8_t *wb, const q8k_block *x, int64_t nb, int64_t b, int64_t M,
                                   float *acc) {
    q2_k_scaled u[4];
    for (int i = 0; i < 4; i++) {
        prefetch_ahead(wb + 84 * i, 84);
        q2_k_scale_values(wb + 84 * i, &u[i]);
    }
    __m256 dmins = q2_k_dmins(wb);
    for (int64_t m = 0; m < M; m++) {
        const q8k_block *a = x + m * nb + b;
        __m512i m0, m1, m2, m3;
        __m512i s0 = q2_k_scaled_row(&u[0], a, &m0), s1 = q2_k_scaled_row(&u[1], a + 1, &m1);
        __m512i s2 = q2_k_scaled_row(&u[2], a + 2, &m2), s3 = q2_k_scaled_row(&u[3], a + 3, &m3);
        float t[4];
        _mm_storeu_ps(t, q2_k_terms_of(dmins, a, sum4_epi32(s0, s1, s2, s3), sum4_epi32(m0, m1, m2, m3)));
        acc[m] = (((acc[m] + t[0]) + t[1]) + t[2]) + t[3];
    }
}

/* Rows of one Q2_K weight (M = 2..16), every output with the one-row call's bits: each weight row's blocks 4 at a
 * time (rows_step4_q2_k), then dot_q2_k on the blocks left. For M <= 3, where the weight's fetch rather than the
 * arithmetic is the limit, weight rows n, n + q, n + 2q, n + 3q (q a quarter of the range) go block step by block
 * step, so that the weight is fetched as four streams (as own_rows4_q8); with more rows one stream was faster. */
static void rows4_q2_k(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                       int64_t n0, int64_t n1) {
    const int streams = M <= 3 ? 4 : 1;
    int64_t nb = K / 256, q = (n1 - n0) / streams;
    for (int64_t n = n0; n < n1; n++) {
        if (n >= n0 + q && n < n0 + streams * q) continue;     /* taken with row n - i q */
        int R = n < n0 + q ? streams : 1;                        /* the rows left after the streams' go alone */
        float acc[4][Q8_MAX_ROWS] = {{0}};
        const uint8_t *row[4];
        for (int i = 0; i < R; i++) row[i] = w + (n + i * q) * nb * 84;
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4)
            for (int i = 0; i < R; i++) rows_step4_q2_k(row[i] + 84 * b, x, nb, b, M, acc[i]);
        for (int i = 0; i < R; i++) {
            for (int64_t k = b; k < nb; k++)
                for (int64_t m = 0; m < M; m++) acc[i][m] += dot_q2_k(row[i] + 84 * k, x + m * nb + k);
            for (int64_t m = 0; m < M; m++) y[m * N + n + i * q] = acc[i][m];
        }
    }
}

#endif

#if defined(IQ2_VECTOR)
/* Rows [n0, n1) of a plain IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S weight (bb bytes a block, d first) against M <= 16 rows
 * of Q8_K blocks: each block unpacked once (grid gathers, sign masks, scales) and dotted with every row's block;
 * row m adds its terms (d_w d_x) bsum in block order, then `factor`: the 1-row call's operations, so its bits. */
static inline __attribute__((always_inline)) void rows_codebook(void (*unpack)(const uint8_t *, codebook_block *),
        const int bb, const float factor, const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M,
        float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * nb * bb;
        float acc[Q8_MAX_ROWS] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            prefetch_ahead(blk, bb);
            codebook_block u;
            unpack(blk, &u);
            float d = f16_to_f32(blk);
            for (int64_t m = 0; m < M; m++) {
                const q8k_block *xm = x + m * nb + b;
                acc[m] += (d * xm->d) * (float)_mm512_reduce_add_epi32(codebook_sums(&u, xm));
            }
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = factor * acc[m];
    }
}
#endif

/* Rows [n0, n1) of a plain IQ1_S / IQ1_M / TQ1_0 / TQ2_0 weight against M <= 16 rows of Q8_K blocks: each block unpacked
 * once and its term computed for every row as the 1-row kernel computes it, added in block order: the same bits. */
#define UNPACKED_ROWS(type, block_t, bb, d_of)                                                                   \
    static void rows_m_##type(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,   \
                              int64_t n0, int64_t n1) {                                                          \
        int64_t nb = K / 256;                                                                                    \
        for (int64_t n = n0; n < n1; n++) {                                                                      \
            const uint8_t *row = w + n * nb * bb;                                                                \
            float acc[Q8_MAX_ROWS] = {0};                                                                        \
            for (int64_t b = 0; b < nb; b++) {                                                                   \
                const uint8_t *blk = row + b * bb;                                                               \
                prefetch_ahead(blk, bb);                                                                         \
                block_t u;                                                                                       \
                type##_unpack(blk, &u);                                                                          \
                float d = d_of;                                                                                  \
                for (int64_t m = 0; m < M; m++) acc[m] += type##_term(&u, x + m * nb + b, d);                    \
            }                                                                                                    \
            for (int64_t m = 0; m < M; m++) y[m * N + n] = acc[m];                                               \
        }                                                                                                        \
    }
#if defined(IQ1_VECTOR)
UNPACKED_ROWS(iq1_s, iq1_block, 50, f16_to_f32(blk))
UNPACKED_ROWS(iq1_m, iq1_block, 56, iq1_m_scale(blk))
#endif
#if defined(IQ2_VECTOR)
UNPACKED_ROWS(tq1_0, tq1_block, 54, f16_to_f32(blk + 52))
UNPACKED_ROWS(tq2_0, tq2_block, 66, f16_to_f32(blk + 64))
#endif

/* qdot8 (same arguments and results, bit for bit) with the rows of a plain weight (experts == NULL, M >= 2)
 * sharing each block's unpacking where the target has AVX2; every other call is qdot8's. */
int64_t qdot8amx_rows(int type, const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                      int64_t n0, int64_t n1);      /* qdot8amx.c: whole tiles of 16 rows on AMX, the same bits */

int qdot8_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
               const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (experts == NULL && n1 > n0) {
        int64_t done = qdot8amx_rows(type, w, N, K, xq, M, y, n0, n1);
        if (done < 0 || done == n1) return done < 0 ? (int)done : 0;
        n0 = done;
    }
#if defined(__AVX2__)
    if (experts == NULL && M >= 2 && M <= Q8_MAX_ROWS) {
        switch (type) {
#if defined(WIDE_ROWS) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
        case 16: if (K % 256) return -1; rows4_iq2_xxs(w, N, K, xq, M, y, n0, n1); return 0;
#else
        case 16: if (K % 256) return -1; rows8_iq2_xxs(w, N, K, xq, M, y, n0, n1); return 0;
#endif
#if defined(WIDE_ROWS)
        case 10: if (K % 256) return -1; rows4_q2_k(w, N, K, xq, M, y, n0, n1); return 0;
        case 12: if (K % 256) return -1; wide_q4_k(w, N, K, xq, M, y, n0, n1); return 0;
#else
        case 10: if (K % 256) return -1; rows8_q2_k(w, N, K, xq, M, y, n0, n1); return 0;
        case 12: if (K % 256) return -1; rows8_q4_k(w, N, K, xq, M, y, n0, n1); return 0;
#endif
#if defined(IQ2_VECTOR)
        case 18: if (K % 256) return -1; rows_codebook(iq3_xxs_unpack, 98, 0.25f, w, N, K, xq, M, y, n0, n1); return 0;
        case 21: if (K % 256) return -1; rows_codebook(iq3_s_unpack, 110, 1.0f, w, N, K, xq, M, y, n0, n1); return 0;
        case 17: if (K % 256) return -1; rows_codebook(iq2_xs_unpack, 74, 0.125f, w, N, K, xq, M, y, n0, n1); return 0;
        case 22: if (K % 256) return -1; rows_codebook(iq2_s_unpack, 82, 0.125f, w, N, K, xq, M, y, n0, n1); return 0;
        case 34: if (K % 256) return -1; rows_m_tq1_0(w, N, K, xq, M, y, n0, n1); return 0;
        case 35: if (K % 256) return -1; rows_m_tq2_0(w, N, K, xq, M, y, n0, n1); return 0;
#endif
#if defined(IQ1_VECTOR)
        case 19: if (K % 256) return -1; rows_m_iq1_s(w, N, K, xq, M, y, n0, n1); return 0;
        case 29: if (K % 256) return -1; rows_m_iq1_m(w, N, K, xq, M, y, n0, n1); return 0;
#endif
#if defined(WIDE_ROWS) && defined(__F16C__)
        case 8: if (K % 32) return -1; return wide_q8_0(w, N, K, xq, M, y, n0, n1);
#else
        case 8: if (K % 32) return -1; rows8_q8_0(w, N, K, xq, M, y, n0, n1); return 0;
#endif
        default: break;
        }
    }
#endif
    return qdot8(type, w, expert_bytes, experts, N, K, xq, M, y, n0, n1);
}
