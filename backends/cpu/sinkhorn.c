/* The Sinkhorn rounds of the hyper-connection pre step (ops/hc_pre.py) after its row softmax, one call for
 * all rows instead of ~120 small torch ops: c = p + eps, a column normalisation, then iters-1 rounds of row
 * then column normalisation, each sum taken in index order. Each matrix on its own, so batch-invariant.
 * Built by backends/cpu/kernels.py with qgemv.c.
 */
#include <stdint.h>

/* Each of the S lines of c (line l holds c[l * step + k * stride], k < S) divided by its sum + eps. */
static void normalize(float *c, int64_t S, int64_t step, int64_t stride, float eps) {
    for (int64_t l = 0; l < S; l++) {
        float *line = c + l * step, sum = 0.0f;
        for (int64_t k = 0; k < S; k++) sum += line[k * stride];
        sum += eps;
        for (int64_t k = 0; k < S; k++) line[k * stride] /= sum;
    }
}

/* c [M, S, S] from the row-softmaxed p [M, S, S]. */
void sinkhorn(const float *p, float *c, int64_t M, int64_t S, int64_t iters, float eps) {
    for (int64_t m = 0; m < M; m++) {
        float *a = c + m * S * S;
        for (int64_t i = 0; i < S * S; i++) a[i] = p[m * S * S + i] + eps;
        normalize(a, S, 1, S, eps);                           /* columns */
        for (int64_t it = 1; it < iters; it++) {
            normalize(a, S, S, 1, eps);                       /* rows */
            normalize(a, S, 1, S, eps);
        }
    }
}
