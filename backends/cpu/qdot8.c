/* The opt-in 8-bit-activation dot product (`--cpu-dot q8`): y[m, n] = sum_k W[n, k] * x[m, k] with x rounded
 * to 8 bits per block, as llama.cpp's CPU kernels do (the numerics and their PyTorch reference:
 * ops/q8_activations.py). `q8_quantize` rounds the activations once per call (Q8_K: 256 values, a float
 * scale, the sums of each 16 quants; Q8_0: 32 values, an f16 scale); `qdot8` multiplies every weight block
 * with its activation block in integers (maddubs/madd on AVX2; IQ2_XXS a block per vector on AVX-512 with
 * VBMI/BITALG/VNNI; a plain C loop elsewhere: the same exact integers everywhere) and adds the blocks' float
 * terms in block order (Q8_0: in 8 lanes, then the lanes in order). Each output's arithmetic depends only on
 * its row and its weight row, so the result is the same for any M and any split of the output rows across
 * threads (batch-invariant). Built with qgemv.c by backends/cpu/kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define Q8_MAX_ROWS 16
#define Q8_AHEAD 2048       /* bytes of the weight stream prefetched ahead */

typedef struct { int8_t qs[256]; float d; int16_t bsums[16]; int8_t pad[28]; } q8k_block; /* 320: whole lines */
typedef struct { float d; int8_t qs[32]; } q8_0_block;                       /* 36 bytes */

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

static inline float q8_half(const uint8_t *p) {        /* f16 -> f32, exact */
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)h);
#else
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 31) return q8_bits_float(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return q8_bits_float(sign);
        exp = 127 - 15 + 1;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        return q8_bits_float(sign | (exp << 23) | ((mant & 0x3ff) << 13));
    }
    return q8_bits_float(sign | ((exp + 127 - 15) << 23) | (mant << 13));
#endif
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

/* Rows of x [M, K] rounded to Q8_K (kind 0, K % 256 == 0) or Q8_0 (kind 1, K % 32 == 0) blocks into `out`
 * (M * K/256 q8k_block or M * K/32 q8_0_block). Returns -1 for a kind or K it cannot serve. */
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
        for (int64_t b = 0; b < M * (K / 32); b++, x += 32) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            y[b].d = q8_round_half(d);
            for (int j = 0; j < 32; j++) y[b].qs[j] = (int8_t)roundf(x[j] * id);
        }
        return 0;
    }
    return -1;
}

static uint64_t iq2_grid_bytes[256];    /* set by qdot8_set_iq2_xxs: the 8 grid values of each index, as bytes */
static uint64_t iq2_sign_bytes[128];    /* the 8 signs (+1 / -1 bytes) of each 7-bit sign index */

void qdot8_set_iq2_xxs(const uint8_t *grid, const int64_t *ksigns) {
    memcpy(iq2_grid_bytes, grid, sizeof iq2_grid_bytes);
    for (int i = 0; i < 128; i++) {
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

/* IQ2_XXS (66 bytes) against a Q8_K block: d_w d_x bsum (the 0.125 is applied per output). */
static inline float dot_iq2_xxs(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *p = b + 2;
    int bsum = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* The block's 8 groups in one vector: 64-bit lane g = the group's 4 grid indices, then its 32 bits. */
    __m512i v = _mm512_loadu_si512(p);
    /* bytes 0-3 of lane g: the 7-bit sign indices of chunks 0-3 (bits 32 + 7l), each byte's parity on top */
    __m512i t = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720), v), _mm512_set1_epi8(0x7f));
    __m512i parity = _mm512_and_si512(_mm512_popcnt_epi8(t), _mm512_set1_epi8(1));
    __m512i signs = _mm512_or_si512(t, _mm512_slli_epi16(parity, 7));
    /* bytes 0-3 of each lane packed together: byte k <- byte 8 (k / 4) + k % 4 */
    const __m512i pack = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x3b3a3938, 0x33323130, 0x2b2a2928, 0x23222120,
                                          0x1b1a1918, 0x13121110, 0x0b0a0908, 0x03020100);
    uint64_t negative[4];       /* per group pair: bit 8c + j set where value j of chunk c is negative */
    _mm256_storeu_si256((__m256i *)negative, _mm512_castsi512_si256(_mm512_permutexvar_epi8(pack, signs)));
    __m512i index = _mm512_permutexvar_epi8(pack, v);
    __m512i pairs01 = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(index));
    __m512i pairs23 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(index, 1));
    __m512i scales = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(v, 60), 1), _mm512_set1_epi64(1));
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {                  /* groups 2i and 2i + 1 */
        __m512i pair = i < 2 ? pairs01 : pairs23;
        __m256i idx = i % 2 ? _mm512_extracti64x4_epi64(pair, 1) : _mm512_castsi512_si256(pair);
        __m512i grid = _mm512_i32gather_epi64(idx, (const void *)iq2_grid_bytes, 8);
        __m512i q8 = _mm512_loadu_si512(y->qs + 64 * i);
        __m512i prod = _mm512_maddubs_epi16(grid, _mm512_mask_sub_epi8(q8, negative[i], _mm512_setzero_si512(), q8));
        __m512i ls = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(8 * i)),
                                                                 _mm256_set1_epi16((short)(8 * i + 4)), 1), scales);
        acc = _mm512_dpwssd_epi32(acc, prod, ls);
    }
    bsum = _mm512_reduce_add_epi32(acc);
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
    return (q8_half(b) * y->d) * (float)bsum;
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
    return (y->d * q8_half(b + 80)) * (float)isum - (y->d * q8_half(b + 82)) * (float)msum;
}

/* Q4_K (144 bytes) against a Q8_K block: (d_x d) isum - (d_x dmin) msum. */
static inline float dot_q4_k(const uint8_t *b, const void *act) {
    const q8k_block *y = act;
    const uint8_t *s = b + 4, *qs = b + 16;
    int scale[8], low[8], isum = 0, msum = 0;
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
    return (y->d * q8_half(b)) * (float)isum - (y->d * q8_half(b + 2)) * (float)msum;
}

typedef float (*dot8_fn)(const uint8_t *, const void *);
typedef float (*row8_fn)(const uint8_t *, const uint8_t *, int64_t);

static inline void prefetch_ahead(const uint8_t *blk, int bb) {
    for (int off = 0; off < bb; off += 64) __builtin_prefetch(blk + off + Q8_AHEAD);
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

static float row_iq2_xxs(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return 0.125f * row_blocks(dot_iq2_xxs, 66, sizeof(q8k_block), row, act, nb);
}

static float row_q2_k(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return row_blocks(dot_q2_k, 84, sizeof(q8k_block), row, act, nb);
}

static float row_q4_k(const uint8_t *row, const uint8_t *act, int64_t nb) {
    return row_blocks(dot_q4_k, 144, sizeof(q8k_block), row, act, nb);
}

/* A row of Q8_0 blocks (34 bytes) against Q8_0 activations in 8 float lanes: lane l adds, block by block,
 * (d_w d_x) times the integer dot of values 4l..4l+3 of the block; then the lanes are added in order. */
static float row_q8_0(const uint8_t *row, const uint8_t *act, int64_t nb) {
    const q8_0_block *y = (const q8_0_block *)act;
    float lanes[8] = {0};
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, row += 34) {
        prefetch_ahead(row, 34);
        __m256i w = load256(row + 2);
        __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(load256(y[b].qs), w));
        __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(q8_half(row) * y[b].d), dots));
    }
    _mm256_storeu_ps(lanes, acc);
#else
    for (int64_t b = 0; b < nb; b++, row += 34) {
        float d = q8_half(row) * y[b].d;
        for (int l = 0; l < 8; l++) {
            int s = 0;
            for (int i = 4 * l; i < 4 * l + 4; i++) s += (int8_t)row[2 + i] * y[b].qs[i];
            lanes[l] += d * (float)s;
        }
    }
#endif
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}

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

/* y [M, N] rows [n0, n1) = x @ W.T for a weight of GGUF type `type` (16 IQ2_XXS after qdot8_set_iq2_xxs,
 * 10 Q2_K, 12 Q4_K: `xq` from q8_quantize kind 0; 8 Q8_0: kind 1), M <= 16; experts as in qgemv.c (row m
 * uses the weight at w + experts[m] * expert_bytes; experts[m] < 0 gives 0). Returns -1 for a call it cannot
 * serve. */
int qdot8(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    const uint8_t *x = xq;
    if (M > Q8_MAX_ROWS) return -1;
    const int k_bytes = (int)sizeof(q8k_block);
    switch (type) {
    case 16: if (K % 256) return -1;
        rows_q8(row_iq2_xxs, 256, 66, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 10: if (K % 256) return -1;
        rows_q8(row_q2_k, 256, 84, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 12: if (K % 256) return -1;
        rows_q8(row_q4_k, 256, 144, k_bytes, w, expert_bytes, experts, N, K, x, M, y, n0, n1); return 0;
    case 8: if (K % 32) return -1;
        rows_q8(row_q8_0, 32, 34, (int)sizeof(q8_0_block), w, expert_bytes, experts, N, K, x, M, y, n0, n1);
        return 0;
    default: return -1;
    }
}

/* Several rows against one weight (M = 2..16 of a plain weight: verify, and each routed expert's rows at
 * prefill): each weight block is read and unpacked once (nibbles, 2-bit fields, grid rows, scale vectors)
 * and dotted with every row's activation block; each row keeps its own float sum, adding the same block terms
 * in the same order as the 1-row functions above, so every output has the same bits as the 1-row call. */
#if defined(__AVX2__)
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
            float d = q8_half(b), dmin = q8_half(b + 2);
            for (int64_t m = 0; m < M; m++) {
                const q8k_block *a = x + m * nb + k;
                __m256i sum = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++)
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load256(a->qs + 32 * j)),
                                                                  scale[j]));
                int isum = hsum_i32(sum), msum = hsum_i32(_mm256_madd_epi16(lows, load256(a->bsums)));
                acc[m] += (a->d * d) * (float)isum - (a->d * dmin) * (float)msum;
            }
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
            float d = q8_half(b + 80), dmin = q8_half(b + 82);
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
            float d = q8_half(b);
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
    /* rows 4 at a time over the whole weight row (which stays in L1), their 8-lane sums in registers */
    int64_t nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * nb * 34;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            const uint8_t *b = row;
            for (int64_t k = 0; k < nb; k++, b += 34) {
                if (m0 == 0) prefetch_ahead(b, 34);
                __m256i v = load256(b + 2), magnitude = _mm256_sign_epi8(v, v);
                float d = q8_half(b);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    if (m0 + j >= M) continue;
                    const q8_0_block *a = x + (m0 + j) * nb + k;
                    __m256i signed_x = _mm256_sign_epi8(load256(a->qs), v);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    __m256i dots = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x);
#else
                    __m256i dots = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones);
#endif
                    acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(dots)));
                }
            }
            for (int j = 0; j < 4 && m0 + j < M; j++) {
                float lanes[8], sum = 0.0f;
                _mm256_storeu_ps(lanes, acc[j]);
                for (int l = 0; l < 8; l++) sum += lanes[l];
                y[(m0 + j) * N + n] = sum;
            }
        }
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
            float d = q8_half(b), dmin = q8_half(b + 2);
            for (int64_t m0 = 0; m0 < M; m0 += 4)
                acc[m0 / 4] = _mm_add_ps(acc[m0 / 4], terms4_k(q, scale, lows, d, dmin, x, nb, k, m0, M));
        }
        store_rows(acc, M, y, N, n, 1.0f);
    }
}

static void wide_q2_k(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                      int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    const __m256i three = _mm256_set1_epi8(3);
    __m512i group[4];       /* int16 lane t of vector c: the scale of values 64c + 2t, 2t + 1 (group 4c + t / 8) */
    for (int c = 0; c < 4; c++) {
        int16_t idx[32];
        for (int t = 0; t < 32; t++) idx[t] = (int16_t)(4 * c + t / 8);
        group[c] = _mm512_loadu_si512(idx);
    }
    for (int64_t n = n0; n < n1; n++) {
        __m128 acc[Q8_MAX_ROWS / 4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
        const uint8_t *b = w + n * nb * 84;
        for (int64_t k = 0; k < nb; k++, b += 84) {
            prefetch_ahead(b, 84);
            __m128i scales = _mm_loadu_si128((const __m128i *)b);
            __m256i lows = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scales, 4), _mm_set1_epi8(15)));
            __m512i low16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(scales, _mm_set1_epi8(15))));
            __m512i q[4], scale[4];
            for (int h = 0; h < 2; h++) {
                __m256i q2 = load256(b + 16 + 32 * h);
                for (int i = 0; i < 4; i += 2)      /* values 128h + 32i .. 128h + 32i + 63 */
                    q[2 * h + i / 2] = halves512(_mm256_and_si256(_mm256_srli_epi16(q2, 2 * i), three),
                                                 _mm256_and_si256(_mm256_srli_epi16(q2, 2 * i + 2), three));
            }
            for (int c = 0; c < 4; c++) scale[c] = _mm512_permutexvar_epi16(group[c], low16);
            float d = q8_half(b + 80), dmin = q8_half(b + 82);
            for (int64_t m0 = 0; m0 < M; m0 += 4)
                acc[m0 / 4] = _mm_add_ps(acc[m0 / 4], terms4_k(q, scale, lows, d, dmin, x, nb, k, m0, M));
        }
        store_rows(acc, M, y, N, n, 1.0f);
    }
}
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
static void wide_iq2_xxs(const uint8_t *w, int64_t N, int64_t K, const q8k_block *x, int64_t M, float *y,
                         int64_t n0, int64_t n1) {
    int64_t nb = K / 256;
    const __m512i pack = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x3b3a3938, 0x33323130, 0x2b2a2928,
                                          0x23222120, 0x1b1a1918, 0x13121110, 0x0b0a0908, 0x03020100);
    for (int64_t n = n0; n < n1; n++) {
        __m128 acc[Q8_MAX_ROWS / 4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
        const uint8_t *b = w + n * nb * 66;
        for (int64_t k = 0; k < nb; k++, b += 66) {
            prefetch_ahead(b, 66);
            /* dot_iq2_xxs's unpacking, once per block: grid rows, sign masks and scales of the 4 group pairs */
            __m512i v = _mm512_loadu_si512(b + 2);
            __m512i t = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720), v),
                                         _mm512_set1_epi8(0x7f));
            __m512i parity = _mm512_and_si512(_mm512_popcnt_epi8(t), _mm512_set1_epi8(1));
            __m512i signs = _mm512_or_si512(t, _mm512_slli_epi16(parity, 7));
            uint64_t negative[4];
            _mm256_storeu_si256((__m256i *)negative, _mm512_castsi512_si256(_mm512_permutexvar_epi8(pack, signs)));
            __m512i index = _mm512_permutexvar_epi8(pack, v);
            __m512i pairs01 = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(index));
            __m512i pairs23 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(index, 1));
            __m512i scales = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(v, 60), 1), _mm512_set1_epi64(1));
            __m512i grid[4], ls[4];
            for (int i = 0; i < 4; i++) {
                __m512i pair = i < 2 ? pairs01 : pairs23;
                __m256i idx = i % 2 ? _mm512_extracti64x4_epi64(pair, 1) : _mm512_castsi512_si256(pair);
                grid[i] = _mm512_i32gather_epi64(idx, (const void *)iq2_grid_bytes, 8);
                ls[i] = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(8 * i)),
                                                                    _mm256_set1_epi16((short)(8 * i + 4)), 1), scales);
            }
            __m128 d = _mm_set1_ps(q8_half(b));
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                __m256i is[4];
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    if (m0 + j >= M) { is[j] = _mm256_setzero_si256(); continue; }
                    const q8k_block *a = x + (m0 + j) * nb + k;
                    __m512i sum = _mm512_setzero_si512();
                    for (int i = 0; i < 4; i++) {
                        __m512i q8 = _mm512_loadu_si512(a->qs + 64 * i);
                        __m512i prod = _mm512_maddubs_epi16(grid[i], _mm512_mask_sub_epi8(q8, negative[i],
                                                                                          _mm512_setzero_si512(), q8));
                        sum = _mm512_dpwssd_epi32(sum, prod, ls[i]);
                    }
                    is[j] = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
                }
                __m128 terms = _mm_mul_ps(_mm_mul_ps(d, row_scales(x, nb, k, m0, M)), _mm_cvtepi32_ps(fold4(is)));
                acc[m0 / 4] = _mm_add_ps(acc[m0 / 4], terms);
            }
        }
        store_rows(acc, M, y, N, n, 0.125f);
    }
}
#endif
#endif

/* qdot8 (same arguments and results, bit for bit) with the rows of a plain weight (experts == NULL, M >= 2)
 * sharing each block's unpacking where the target has AVX2; every other call is qdot8's. */
int qdot8_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
               const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
#if defined(__AVX2__)
    if (experts == NULL && M >= 2 && M <= Q8_MAX_ROWS) {
        switch (type) {
#if defined(WIDE_ROWS) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
        case 16: if (K % 256) return -1; wide_iq2_xxs(w, N, K, xq, M, y, n0, n1); return 0;
#else
        case 16: if (K % 256) return -1; rows8_iq2_xxs(w, N, K, xq, M, y, n0, n1); return 0;
#endif
#if defined(WIDE_ROWS)
        case 10: if (K % 256) return -1; wide_q2_k(w, N, K, xq, M, y, n0, n1); return 0;
        case 12: if (K % 256) return -1; wide_q4_k(w, N, K, xq, M, y, n0, n1); return 0;
#else
        case 10: if (K % 256) return -1; rows8_q2_k(w, N, K, xq, M, y, n0, n1); return 0;
        case 12: if (K % 256) return -1; rows8_q4_k(w, N, K, xq, M, y, n0, n1); return 0;
#endif
        case 8: if (K % 32) return -1; rows8_q8_0(w, N, K, xq, M, y, n0, n1); return 0;
        default: break;
        }
    }
#endif
    return qdot8(type, w, expert_bytes, experts, N, K, xq, M, y, n0, n1);
}
