/* The Sinkhorn rounds of the hyper-connection pre step (ops/hc_pre.py) after its row softmax, one call for
 * all rows instead of ~120 small torch ops: c = p + eps, a column normalisation, then iters-1 rounds of row
 * then column normalisation, each sum taken in index order. Each matrix on its own, so batch-invariant.
 * Built by backends/cpu/kernels.py with qgemv.c.
 */
#include <stdint.h>

static void normalize_rows(float *c, int64_t S, float eps) {
    for (int64_t i = 0; i < S; i++) {
        float sum = 0.0f;
        for (int64_t j = 0; j < S; j++) sum += c[i * S + j];
        sum += eps;
        for (int64_t j = 0; j < S; j++) c[i * S + j] /= sum;
    }
}

static void normalize_columns(float *c, int64_t S, float eps) {
    for (int64_t j = 0; j < S; j++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < S; i++) sum += c[i * S + j];
        sum += eps;
        for (int64_t i = 0; i < S; i++) c[i * S + j] /= sum;
    }
}

/* c [M, S, S] from the row-softmaxed p [M, S, S]. */
void sinkhorn(const float *p, float *c, int64_t M, int64_t S, int64_t iters, float eps) {
    for (int64_t m = 0; m < M; m++) {
        float *a = c + m * S * S;
        for (int64_t i = 0; i < S * S; i++) a[i] = p[m * S * S + i] + eps;
        normalize_columns(a, S, eps);
        for (int64_t it = 1; it < iters; it++) {
            normalize_rows(a, S, eps);
            normalize_columns(a, S, eps);
        }
    }
}
