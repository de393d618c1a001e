/* Exact IQ2_XXS products of several float rows that share one weight (prefill's routed experts: an expert chosen by
 * 2-16 tokens of a chunk): y [M, N] rows [n0, n1) = x [M, K] @ W.T. Each output is qgemv's (qgemv.c, dot_iq2_xxs
 * and finish: the same operations in the same order, so the same bits for any M, any grouping of the rows and any
 * split of the output rows), but the rows are taken up to GROUP_ROWS at a time and each weight block is read and
 * unpacked once for the rows of a group: its sign masks and group scales once, each group's 32 signed grid values
 * once into two registers, which every row multiplies by its x; qgemv unpacks the block into memory and reloads it
 * per row (2.6x the one-row time at M = 2). AVX-512 with VBMI and BITALG only (dot_iq2_xxs's fast path); other
 * builds call qgemv. Built with qgemv.c by backends/cpu/kernels.py. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include "lanes.h"
#endif

int qgemv(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const float *x, int64_t M, float *y, int64_t n0, int64_t n1);

#define BLOCK_BYTES 66      /* one IQ2_XXS block: d, then 8 groups of 4 grid indices and 32 bits; 256 values */
#define MOST_ROWS 16        /* qgemv's MAX_ROWS */

extern float iq2_grid[256][8];      /* qgemv.c's: the grid rows as floats and the sign patterns (qgemv_set_iq2_xxs) */
extern uint8_t iq2_ksigns[128];

#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__AVX512BW__) && defined(__F16C__)
#define GROUP_ROWS 4        /* rows sharing one pass over the weight */
#define AHEAD 2048          /* bytes of the weight stream prefetched ahead (qgemv's) */

/* A block's 8 group scales (d (0.5 + ls) 0.25 + 0) and its 32 sign bytes as four 64-bit words of masks (bit 16 h + 32
 * (g % 2) of word g / 2: value 16 h + l of group g negative), as dot_iq2_xxs makes them. */
static inline void block_signs(const uint8_t *b, float *scale, uint64_t *negative) {
    __m512i v = _mm512_loadu_si512(b + 2);
    __m512i t = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720), v);
    const __m512i pack = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x3b3a3938, 0x33323130, 0x2b2a2928, 0x23222120,
                                          0x1b1a1918, 0x13121110, 0x0b0a0908, 0x03020100);
    __m256i signs = _mm512_castsi512_si256(_mm512_permutexvar_epi8(pack, _mm512_permutex2var_epi8(
        _mm512_loadu_si512(iq2_ksigns), t, _mm512_loadu_si512(iq2_ksigns + 64))));
    __m128i sign_lo = _mm256_castsi256_si128(signs), sign_hi = _mm256_extracti128_si256(signs, 1);
    negative[0] = (uint64_t)_mm_cvtsi128_si64(sign_lo);
    negative[1] = (uint64_t)_mm_extract_epi64(sign_lo, 1);
    negative[2] = (uint64_t)_mm_cvtsi128_si64(sign_hi);
    negative[3] = (uint64_t)_mm_extract_epi64(sign_hi, 1);
    __m256 ls = _mm256_cvtepi32_ps(_mm512_cvtepi64_epi32(_mm512_srli_epi64(v, 60)));
    uint16_t h;
    memcpy(&h, b, 2);
    __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
    _mm256_store_ps(scale, _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(d,
        _mm256_add_ps(_mm256_set1_ps(0.5f), ls)), _mm256_set1_ps(0.25f)), _mm256_setzero_ps()));
}

/* Half h (16 values) of group g: its two grid rows with the sign bit flipped where the block's masks say. */
static inline __m512 signed_half(const uint8_t *b, const uint64_t *negative, int g, int h) {
    const uint8_t *p = b + 2 + 8 * g;
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)iq2_grid[p[2 * h]])),
                                   _mm256_loadu_si256((const __m256i *)iq2_grid[p[2 * h + 1]]), 1);
    __mmask16 k = _cvtu32_mask16((uint32_t)(negative[g / 2] >> (32 * (g % 2) + 16 * h)) & 0xffff);
    return _mm512_castsi512_ps(_mm512_mask_xor_epi32(q, k, q, _mm512_set1_epi32((int)0x80000000u)));
}

/* Output rows [n0, n1) for R rows of x, one weight row at a time, every block of it unpacked once for the R rows.
 * Row r's accumulators are dot_iq2_xxs's: part[g % 4] takes group g's 32 products (a multiply, a multiply-add, in 16
 * lanes) times its scale. */
static inline __attribute__((always_inline)) void pass(const int R, const uint8_t *w, int64_t K, const float *x,
                                                       float *y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / 256;
    float scale[8] __attribute__((aligned(32)));
    uint64_t negative[4];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * nb * BLOCK_BYTES;
        __m512 part[GROUP_ROWS][4];
        for (int r = 0; r < GROUP_ROWS; r++)
            for (int j = 0; j < 4; j++) part[r][j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * BLOCK_BYTES;
            for (int off = 0; off < BLOCK_BYTES; off += 64) __builtin_prefetch(blk + off + AHEAD);
            block_signs(blk, scale, negative);
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m512 q0 = signed_half(blk, negative, g, 0), q1 = signed_half(blk, negative, g, 1);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const float *xg = x + r * K + b * 256 + 32 * g;
                    __m512 s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xg + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xg)));
                    __asm__("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(part[r][g % 4]) : "m"(scale[g]), "v"(s));
                }
            }
        }
        __m512 p[GROUP_ROWS];
        for (int r = 0; r < GROUP_ROWS; r++) p[r] = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]),
                                                                  _mm512_add_ps(part[r][2], part[r][3]));
        float out[4];
        _mm_storeu_ps(out, lane_sums4(p));
        for (int r = 0; r < R; r++) y[r * N + n] = out[r];
    }
}

/* The rows in groups of at most GROUP_ROWS, as even as they come (M = 5: 3 + 2), each group one pass. */
static void grouped_rows(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0,
                         int64_t n1) {
    int64_t groups = (M + GROUP_ROWS - 1) / GROUP_ROWS;
    for (int64_t g = 0, m = 0; g < groups; g++) {
        int64_t rows = (M - m) / (groups - g);
        const float *xg = x + m * K;
        float *yg = y + m * N;
        switch (rows) {
        case 1: pass(1, w, K, xg, yg, N, n0, n1); break;
        case 2: pass(2, w, K, xg, yg, N, n0, n1); break;
        case 3: pass(3, w, K, xg, yg, N, n0, n1); break;
        default: pass(4, w, K, xg, yg, N, n0, n1); break;
        }
        m += rows;
    }
}
#endif

/* y [M, N] rows [n0, n1) = x [M, K] @ W.T for an IQ2_XXS weight W [N, K] shared by every row, the bits of qgemv's;
 * M = 1 (or a build without VBMI) is qgemv's own call. Returns qgemv's codes: 0, -1 (K % 256 != 0, M > 16). */
int iq2x_rows(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__AVX512BW__) && defined(__F16C__)
    if (M > 1 && M <= MOST_ROWS && K % 256 == 0) {
        grouped_rows(w, N, K, x, M, y, n0, n1);
        return 0;
    }
#endif
    return qgemv(16, w, 0, NULL, N, K, x, M, y, n0, n1);
}
