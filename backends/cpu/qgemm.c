/* Prefill's routed experts, every expert of a layer in one call: the rows (token, expert pairs) come sorted by
 * expert, group g being rows [first[g], first[g + 1]) with expert ids[g] of a stacked weight [E, N, K]; each
 * group is multiplied by its expert through qgemv (float rows; Q4_K's through q4kexact.c's q4k_rows and IQ2_XXS's
 * through iq2exact.c's iq2x_rows, the same bits with each block read once for the rows) or qdot8_rows (rows rounded
 * to 8 bits by q8_quantize), 16 rows at a time, so each expert's weight is read once per 16 of its rows and no Python
 * runs per expert. A call computes groups [g0, g1): the kernel pool splits a layer by whole experts, and an output's
 * arithmetic depends only on its row and its expert (the same bits for any thread count or split). Further down:
 * prefill's exact dense products (dense_gemm), and both split across the kernel pool (pool.c's pool_range). Built
 * with qgemv.c, q4kexact.c, iq2exact.c, qdot8.c and pool.c by backends/cpu/kernels.py. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "lanes.h"
#endif

int qgemv(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const float *x, int64_t M, float *y, int64_t n0, int64_t n1);
int qdot8_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
               const void *xq, int64_t M, float *y, int64_t n0, int64_t n1);
int q4kr_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
              const void *xq, int64_t M, float *y, int64_t n0, int64_t n1);   /* q4krepack.c: type 1012 */
int q2kr_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
              const void *xq, int64_t M, float *y, int64_t n0, int64_t n1);   /* q2krepack.c: type 1010 */
int iq2r_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
              const void *xq, int64_t M, float *y, int64_t n0, int64_t n1);   /* iq2repack.c: type 1016 */
int q4k_rows(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0,
             int64_t n1);    /* q4kexact.c: exact Q4_K, each block read once for all rows */
int iq2x_rows(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t n0,
              int64_t n1);   /* iq2exact.c: exact IQ2_XXS, each block read once for all rows */

#define CHUNK_ROWS 16   /* the kernels' most rows per call */

/* y [rows, N] for groups [g0, g1); `x` holds x_row_bytes per row (float32 when q8 == 0, else q8_quantize's
 * blocks). Returns the first nonzero kernel return code (-1: a call it cannot serve, -2: out of memory). */
int experts_gemm(int q8, int type, const uint8_t *w, int64_t expert_bytes, const int64_t *ids, const int64_t *first,
                 int64_t N, int64_t K, const uint8_t *x, int64_t x_row_bytes, float *y, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *expert = w + ids[g] * expert_bytes;
        for (int64_t r = first[g]; r < first[g + 1]; r += CHUNK_ROWS) {
            int64_t m = first[g + 1] - r < CHUNK_ROWS ? first[g + 1] - r : CHUNK_ROWS;
            const float *xf = (const float *)(x + r * x_row_bytes);
            int rc = q8 ? (type == 1012 ? q4kr_rows : type == 1010 ? q2kr_rows : type == 1016 ? iq2r_rows : qdot8_rows)(
                              type, expert, 0, NULL, N, K, x + r * x_row_bytes, m, y + r * N, 0, N)
                   : type == 12 ? q4k_rows(expert, N, K, xf, m, y + r * N, 0, N)
                   : type == 16 ? iq2x_rows(expert, N, K, xf, m, y + r * N, 0, N)
                   : qgemv(type, expert, 0, NULL, N, K, xf, m, y + r * N, 0, N);
            if (rc) return rc;
        }
    }
    return 0;
}

/* Prefill's dense products (M > 16 rows, the exact path): y [M, N] = x [M, K] @ W.T for a weight of a type
 * `dequantize` (qgemv.c) reads. Output rows are dequantized TILE_FLOATS at a time into a buffer of the calling
 * thread (the reference's values: the block functions of `qgemv`) and multiplied by every row there. Each output
 * is accumulated in 16 lanes (element k in lane k % 16, one fused multiply-add per element, k increasing) and the
 * lanes are added in order: its arithmetic depends only on its own row of x and of W, so the result is the same
 * bits for any M, tile, block or thread split, and on the AVX-512, AVX2 and plain C builds. Register blocks of
 * MR rows x NR outputs share each load (AVX-512: 24 accumulators); the rows are taken GROUP_BYTES of them at a
 * time so that they stay in L2 while a tile is multiplied. */
int dequantize(int type, const uint8_t *w, int64_t rows, int64_t K, float *out);

#define TILE_FLOATS (256 * 1024)    /* one dequantized tile: 1 MB of float32 */
#define GROUP_BYTES (256 * 1024)    /* rows of x multiplied by a tile before the next rows */

#if defined(__AVX512F__)
typedef __m512 lanes16;
static inline lanes16 lanes_zero(void) { return _mm512_setzero_ps(); }
static inline lanes16 lanes_load(const float *p) { return _mm512_loadu_ps(p); }
static inline lanes16 lanes_fma(lanes16 a, lanes16 b, lanes16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void lanes_store(float *p, lanes16 v) { _mm512_storeu_ps(p, v); }
/* v kept in a register: gcc would otherwise fold a weight vector's load into each of its MR multiply-adds (24 + 4
 * loads per 24 multiply-adds of a 4 x 6 block, where a core loads one 512-bit vector a cycle: load-bound) */
static inline lanes16 lanes_held(lanes16 v) { __asm__("" : "+v"(v)); return v; }
#define MR 4
#define NR 6
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 lo, hi; } lanes16;
static inline lanes16 lanes_zero(void) { return (lanes16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline lanes16 lanes_load(const float *p) { return (lanes16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline lanes16 lanes_fma(lanes16 a, lanes16 b, lanes16 c) {
    return (lanes16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline void lanes_store(float *p, lanes16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline lanes16 lanes_held(lanes16 v) { return v; }
#define MR 2
#define NR 3
#else
typedef struct { float v[16]; } lanes16;
static inline lanes16 lanes_zero(void) { return (lanes16){{0}}; }
static inline lanes16 lanes_load(const float *p) { lanes16 r; for (int l = 0; l < 16; l++) r.v[l] = p[l]; return r; }
static inline lanes16 lanes_fma(lanes16 a, lanes16 b, lanes16 c) {
    for (int l = 0; l < 16; l++) c.v[l] = fmaf(a.v[l], b.v[l], c.v[l]);
    return c;
}
static inline void lanes_store(float *p, lanes16 v) { for (int l = 0; l < 16; l++) p[l] = v.v[l]; }
static inline lanes16 lanes_held(lanes16 v) { return v; }
#define MR 1
#define NR 1
#endif

static inline float lanes_sum(lanes16 v) {     /* the 16 lanes added in order */
    float l[16], s = 0.0f;
    lanes_store(l, v);
    for (int i = 0; i < 16; i++) s += l[i];
    return s;
}

/* y[i, j] (row stride ldy) for i < mr rows of x and j < nr rows of w, both with K values a row. */
static inline __attribute__((always_inline)) void block(int mr, int nr, const float *x, const float *w, int64_t K,
                                                        float *y, int64_t ldy) {
    lanes16 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = lanes_zero();
    for (int64_t k = 0; k < K; k += 16) {
        lanes16 xv[MR];
        for (int i = 0; i < mr; i++) xv[i] = lanes_load(x + i * K + k);
        for (int j = 0; j < nr; j++) {
            lanes16 wv = lanes_held(lanes_load(w + j * K + k));
            for (int i = 0; i < mr; i++) acc[i][j] = lanes_fma(xv[i], wv, acc[i][j]);
        }
    }
#if defined(__AVX512F__)
    if (mr == 4) {      /* four rows' lanes added at once, in lanes_sum's order (lanes.h): the same bits */
        for (int j = 0; j < nr; j++) {
            float out[4];
            _mm_storeu_ps(out, lane_sums4((const __m512[4]){acc[0][j], acc[1][j], acc[2][j], acc[3][j]}));
            for (int i = 0; i < 4; i++) y[i * ldy + j] = out[i];
        }
        return;
    }
#endif
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = lanes_sum(acc[i][j]);
}

/* block() with mr <= MR and nr <= NR known to the compiler (its loops unrolled, the accumulators in registers). */
static void block_of(int mr, int nr, const float *x, const float *w, int64_t K, float *y, int64_t ldy) {
#define CASE(m, n) if (mr == (m) && nr == (n)) { block(m, n, x, w, K, y, ldy); return; }
#define CASES(m) CASE(m, 1) CASE(m, 2) CASE(m, 3)
#if MR == 4 && NR == 6
    CASES(4) CASES(3) CASES(2) CASES(1)
    CASE(4, 4) CASE(4, 5) CASE(4, 6) CASE(3, 4) CASE(3, 5) CASE(3, 6)
    CASE(2, 4) CASE(2, 5) CASE(2, 6) CASE(1, 4) CASE(1, 5) CASE(1, 6)
#elif MR == 2 && NR == 3
    CASES(2) CASES(1)
#endif
    block(1, 1, x, w, K, y, ldy);     /* MR == NR == 1 */
#undef CASES
#undef CASE
}

/* y [M, n] (row stride ldy) = x [M, K] @ w [n, K].T, float32, K a multiple of 16. */
static void tile_product(const float *x, int64_t M, int64_t K, const float *w, int64_t n, float *y, int64_t ldy) {
    int64_t group = GROUP_BYTES / 4 / K / MR * MR;
    if (group < MR) group = MR;
    for (int64_t g = 0; g < M; g += group) {
        int64_t g_end = g + group < M ? g + group : M;
        for (int64_t j = 0; j < n; j += NR)
            for (int64_t m = g; m < g_end; m += MR)
                block_of(g_end - m < MR ? (int)(g_end - m) : MR, n - j < NR ? (int)(n - j) : NR, x + m * K, w + j * K, K,
                         y + m * ldy + j, ldy);
    }
}

typedef struct {        /* one dense product, its output rows split across the kernel pool */
    int type;
    const uint8_t *w;
    int64_t row_bytes, N, K, M;
    const float *x;
    float *y;
} dense_job;

static __thread float *tile_buffer;     /* each thread's dequantized tile, kept between calls */

/* `rows` rows of K values of a weight into `out`: `dequantize`'s values (the reference's), Q8_0 on AVX-512 by
 * 16 values a vector (each value the float product q * d, as deq_q8_0 computes it: ~3x faster). */
static int tile_dequantize(int type, const uint8_t *w, int64_t rows, int64_t K, float *out) {
#if defined(__AVX512F__) && defined(__F16C__)
    if (type == 8 && K % 32 == 0) {
        for (int64_t b = 0; b < rows * K / 32; b++, w += 34, out += 32) {
            __m512 d = _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(w[0] | w[1] << 8))));
            for (int i = 0; i < 32; i += 16) {
                __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 2 + i)));
                _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
            }
        }
        return 0;
    }
#endif
    return dequantize(type, w, rows, K, out);
}

/* Output rows [n0, n1) of a dense_job, a tile at a time; -1: a type `dequantize` does not read, -2: no memory. */
static int dense_rows(void *ctx, int64_t n0, int64_t n1) {
    const dense_job *job = ctx;
    if (tile_buffer == NULL && (tile_buffer = aligned_alloc(64, TILE_FLOATS * sizeof(float))) == NULL) return -2;
    int64_t step = TILE_FLOATS / job->K < 1 ? 1 : TILE_FLOATS / job->K;
    for (int64_t t = n0; t < n1; t += step) {
        int64_t rows = n1 - t < step ? n1 - t : step;
        if (job->K * rows > TILE_FLOATS) return -2;
        int rc = tile_dequantize(job->type, job->w + t * job->row_bytes, rows, job->K, tile_buffer);
        if (rc) return rc;
        tile_product(job->x, job->M, job->K, tile_buffer, rows, job->y + t, job->N);
    }
    return 0;
}

int pool_range(int (*fn)(void *, int64_t, int64_t), void *ctx, int64_t n, int64_t parts, int threads);

/* y [M, N] = x [M, K] @ W.T for W [N, K] of `type` (rows of row_bytes), its rows cut into `parts` chunks taken by
 * `threads` threads of the pool; 0, -1 (a type or K it does not serve) or -2 (no memory). */
int dense_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const float *x, int64_t M,
               float *y, int64_t parts, int threads) {
    if (K % 16 || K > TILE_FLOATS) return -1;
    dense_job job = {type, w, row_bytes, N, K, M, x, y};
    return pool_range(dense_rows, &job, N, parts, threads);
}

typedef struct {        /* experts_gemm's arguments, its groups split across the kernel pool */
    int q8, type;
    const uint8_t *w;
    int64_t expert_bytes;
    const int64_t *ids, *first;
    int64_t N, K;
    const uint8_t *x;
    int64_t x_row_bytes;
    float *y;
} experts_job;

static int experts_groups(void *ctx, int64_t g0, int64_t g1) {
    const experts_job *j = ctx;
    return experts_gemm(j->q8, j->type, j->w, j->expert_bytes, j->ids, j->first, j->N, j->K, j->x, j->x_row_bytes,
                        j->y, g0, g1);
}

/* experts_gemm over all `groups`, each group (expert) a chunk of the pool's `threads` threads. */
int experts_gemm_pool(int q8, int type, const uint8_t *w, int64_t expert_bytes, const int64_t *ids,
                      const int64_t *first, int64_t N, int64_t K, const uint8_t *x, int64_t x_row_bytes, float *y,
                      int64_t groups, int threads) {
    experts_job job = {q8, type, w, expert_bytes, ids, first, N, K, x, x_row_bytes, y};
    return pool_range(experts_groups, &job, groups, groups, threads);
}
