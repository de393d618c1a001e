/* Exact Q4_K products of several float rows that share one weight (prefill's routed experts: an expert chosen by
 * 2-16 tokens of a chunk): y [M, N] rows [n0, n1) = x [M, K] @ W.T. Each output is qgemv's (qgemv.c, dot_q4_k and
 * finish: the same operations in the same order, so the same bits for any M, any grouping of the rows and any split
 * of the output rows), but the rows are taken up to GROUP_ROWS at a time and each weight block is read and unpacked
 * once for the rows of a group: a block's 256 nibbles become floats once (vpermps from a table of 0..15) and each row
 * adds its 16 products and 8 scaled group sums into its own accumulators; qgemv unpacks the block into memory and
 * reloads it per row. AVX-512 only; other builds call qgemv. Built with qgemv.c by backends/cpu/kernels.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include "lanes.h"
#endif

int qgemv(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const float *x, int64_t M, float *y, int64_t n0, int64_t n1);

#define BLOCK_BYTES 144     /* one Q4_K block: d, dmin, 12 bytes of scales, 128 bytes of nibbles; 256 values */
#define MOST_ROWS 16        /* qgemv's MAX_ROWS */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#define GROUP_ROWS 4        /* rows sharing one pass over the weight */
#define AHEAD 2048          /* bytes of the weight stream prefetched ahead (qgemv's) */

/* A block's eight scales times d (lanes 0-7) and eight mins times dmin (lanes 8-15): qgemv.c's q4_k_scales16. */
static inline __m512 scales16(const uint8_t *b) {
    __m128i raw = _mm_loadu_si128((const __m128i *)b);
    const __m512i pick = _mm512_set_epi32(
        0x80800b0f, 0x80800a0e, 0x8080090d, 0x8080080c, 0x8080800b, 0x8080800a, 0x80808009, 0x80808008,
        0x8080070f, 0x8080060e, 0x8080050d, 0x8080040c, 0x80808007, 0x80808006, 0x80808005, 0x80808004);
    __m512i v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), pick);
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low_mask = _mm512_set_epi32(15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63);
    __m512i six_bits = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(v, shift), _mm512_srli_epi32(v, 10), low_mask,
                                                 0xe4);
    __m512 d_dmin = _mm512_castps128_ps512(_mm_cvtph_ps(raw));
    __m512 factor = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), d_dmin);
    return _mm512_mul_ps(factor, _mm512_cvtepi32_ps(six_bits));
}

/* Each row's sums of x over its 8 groups of 32 values per block, 8 floats a block, added in order (qgemv.c's
 * group_sums). */
static void group_sums(const float *x, int64_t M, int64_t K, float *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / 32; g++) {
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += x[m * K + g * 32 + i];
            out[m * (K / 32) + g] = s;
        }
}

/* Output rows [n0, n1) for R rows of x (xsum: their group sums), one weight row at a time, every block of it
 * unpacked once for the R rows. Row r's accumulators are dot_q4_k's: part[j] takes the groups j and j + 4 (each
 * group's 32 products in 16 lanes, times its scale), low the mins times the group sums (lanes 0-7). */
static inline __attribute__((always_inline)) void pass(const int R, const uint8_t *w, int64_t K, const float *x,
                                                       const float *xsum, float *y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / 256;
    const __m512 nibble = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    float sv[16] __attribute__((aligned(64)));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * nb * BLOCK_BYTES;
        __m512 part[GROUP_ROWS][4], low[GROUP_ROWS];
        for (int r = 0; r < GROUP_ROWS; r++) {
            low[r] = _mm512_setzero_ps();
            for (int j = 0; j < 4; j++) part[r][j] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * BLOCK_BYTES, *qs = blk + 16;
            for (int off = 0; off < BLOCK_BYTES; off += 64) __builtin_prefetch(blk + off + AHEAD);
            _mm512_store_ps(sv, scales16(blk));
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
                __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
                __m512 f00 = _mm512_permutexvar_ps(v0, nibble), f01 = _mm512_permutexvar_ps(v1, nibble);
                __m512 f10 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), nibble);
                __m512 f11 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), nibble);
                __m512 s0, s1;      /* broadcast from memory (gcc would permute in registers, on the shuffle unit) */
                __asm__("vbroadcastss %1, %0" : "=v"(s0) : "m"(sv[2 * c]));
                __asm__("vbroadcastss %1, %0" : "=v"(s1) : "m"(sv[2 * c + 1]));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * K + b * 256 + 64 * c;
                    __m512 t0 = _mm512_mul_ps(f00, _mm512_loadu_ps(xr));
                    t0 = _mm512_fmadd_ps(f01, _mm512_loadu_ps(xr + 16), t0);
                    __m512 t1 = _mm512_mul_ps(f10, _mm512_loadu_ps(xr + 32));
                    t1 = _mm512_fmadd_ps(f11, _mm512_loadu_ps(xr + 48), t1);
                    part[r][(2 * c) % 4] = _mm512_fmadd_ps(s0, t0, part[r][(2 * c) % 4]);
                    part[r][(2 * c + 1) % 4] = _mm512_fmadd_ps(s1, t1, part[r][(2 * c + 1) % 4]);
                }
            }
            __m512 mins = _mm512_castps256_ps512(_mm256_load_ps(sv + 8));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                low[r] = _mm512_mask3_fmadd_ps(mins, _mm512_castps256_ps512(_mm256_loadu_ps(xsum + (r * nb + b) * 8)),
                                               low[r], 0x00ff);
        }
        __m512 p[GROUP_ROWS];
        for (int r = 0; r < GROUP_ROWS; r++) p[r] = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]),
                                                                  _mm512_add_ps(part[r][2], part[r][3]));
        float out[4];
        _mm_storeu_ps(out, _mm_sub_ps(lane_sums4(p), lane_sums4(low)));
        for (int r = 0; r < R; r++) y[r * N + n] = out[r];
    }
}

/* The rows in groups of at most GROUP_ROWS, as even as they come (M = 5: 3 + 2), each group one pass. */
static int grouped_rows(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0,
                        int64_t n1) {
    float *xsum = malloc((size_t)(M * (K / 32)) * sizeof(float));
    if (xsum == NULL) return -2;
    group_sums(x, M, K, xsum);
    int64_t groups = (M + GROUP_ROWS - 1) / GROUP_ROWS;
    for (int64_t g = 0, m = 0; g < groups; g++) {
        int64_t rows = (M - m) / (groups - g);
        const float *xg = x + m * K, *sg = xsum + m * (K / 32);
        float *yg = y + m * N;
        switch (rows) {
        case 1: pass(1, w, K, xg, sg, yg, N, n0, n1); break;
        case 2: pass(2, w, K, xg, sg, yg, N, n0, n1); break;
        case 3: pass(3, w, K, xg, sg, yg, N, n0, n1); break;
        default: pass(4, w, K, xg, sg, yg, N, n0, n1); break;
        }
        m += rows;
    }
    free(xsum);
    return 0;
}
#endif

/* y [M, N] rows [n0, n1) = x [M, K] @ W.T for a Q4_K weight W [N, K] shared by every row, the bits of qgemv's; M = 1
 * (or a build without AVX-512) is qgemv's own call. Returns qgemv's codes: 0, -1 (K % 256 != 0, M > 16), -2 (no
 * memory). */
int q4k_rows(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0, int64_t n1) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
    if (M > 1 && M <= MOST_ROWS && K % 256 == 0) return grouped_rows(w, N, K, x, M, y, n0, n1);
#endif
    return qgemv(12, w, 0, NULL, N, K, x, M, y, n0, n1);
}
