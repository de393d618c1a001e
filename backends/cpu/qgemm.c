/* Prefill's routed experts, every expert of a layer in one call: the rows (token, expert pairs) come sorted by
 * expert, group g being rows [first[g], first[g + 1]) with expert ids[g] of a stacked weight [E, N, K]; each
 * group is multiplied by its expert through qgemv (float rows) or qdot8_rows (rows rounded to 8 bits by
 * q8_quantize), 16 rows at a time, so each expert's weight is read once per 16 of its rows and no Python runs
 * per expert. A call computes groups [g0, g1): the kernel pool splits a layer by whole experts, and an output's
 * arithmetic depends only on its row and its expert (the same bits for any thread count or split). Built with
 * qgemv.c and qdot8.c by backends/cpu/kernels.py. */
#include <stddef.h>
#include <stdint.h>

int qgemv(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const float *x, int64_t M, float *y, int64_t n0, int64_t n1);
int qdot8_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
               const void *xq, int64_t M, float *y, int64_t n0, int64_t n1);

#define CHUNK_ROWS 16   /* the kernels' most rows per call */

/* y [rows, N] for groups [g0, g1); `x` holds x_row_bytes per row (float32 when q8 == 0, else q8_quantize's
 * blocks). Returns the first nonzero kernel return code (-1: a call it cannot serve, -2: out of memory). */
int experts_gemm(int q8, int type, const uint8_t *w, int64_t expert_bytes, const int64_t *ids, const int64_t *first,
                 int64_t N, int64_t K, const uint8_t *x, int64_t x_row_bytes, float *y, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *expert = w + ids[g] * expert_bytes;
        for (int64_t r = first[g]; r < first[g + 1]; r += CHUNK_ROWS) {
            int64_t m = first[g + 1] - r < CHUNK_ROWS ? first[g + 1] - r : CHUNK_ROWS;
            int rc = q8 ? qdot8_rows(type, expert, 0, NULL, N, K, x + r * x_row_bytes, m, y + r * N, 0, N)
                        : qgemv(type, expert, 0, NULL, N, K, (const float *)(x + r * x_row_bytes), m, y + r * N, 0, N);
            if (rc) return rc;
        }
    }
    return 0;
}
