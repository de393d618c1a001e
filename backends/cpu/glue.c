/* The small ops of a decode step in one call each (backends/cpu/glue.py): after a large product has streamed its
 * weight through the caches, every torch call costs tens of microseconds of cold code and data (docs/cpu.md,
 * "Per-step overhead"), a short loop in C a few. Each function does exactly the float operations of its
 * reference, in the same order (built with -ffp-contract=off: no fused multiply-adds), so the results are the
 * reference's bits: rms_norm_lanes (ops/rms_norm.py: the sum of squares in LANES lanes), hc_post
 * (ops/hc_post.py), the stream sums of hc_pre and hc_head (ops/hc_pre.py, ops/hc_head.py) and the pair rotation
 * of rope_tail (ops/rope_tail.py, its cos/sin given). Row-wise, so batch-invariant; one thread (each call is a
 * few microseconds of work). Built with qgemv.c by backends/cpu/kernels.py.
 */
#include <math.h>
#include <stdint.h>

#define LANES 16

/* out [M, n] = x * (1 / sqrt(sum(x²) / n + eps)) (* w when w is not NULL); element k of a row is added to lane
 * k % LANES in order, then the lanes are added in order. */
void glue_rms_norm(const float *x, int64_t M, int64_t n, const float *w, float eps, float *out) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * n;
        float acc[LANES] = {0}, *o = out + m * n;
        int64_t k = 0;
        for (; k + LANES <= n; k += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += row[k + l] * row[k + l];
        for (int l = 0; k + l < n; l++) acc[l] += row[k + l] * row[k + l];
        float total = acc[0];
        for (int l = 1; l < LANES; l++) total += acc[l];
        float r = 1.0f / sqrtf(total / (float)n + eps);
        if (w)
            for (int64_t i = 0; i < n; i++) o[i] = row[i] * r * w[i];
        else
            for (int64_t i = 0; i < n; i++) o[i] = row[i] * r;
    }
}

/* out [M, S, D]: out[j] = post[j] * y + comb[0][j] * X[0] + ... + comb[S-1][j] * X[S-1], added in stream order. */
void glue_hc_post(const float *X, const float *y, const float *post, const float *comb, int64_t M, int64_t S,
                  int64_t D, float *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < S; j++) {
            float *o = out + (m * S + j) * D, p = post[m * S + j];
            const float *ym = y + m * D;
            for (int64_t d = 0; d < D; d++) o[d] = p * ym[d];
            for (int64_t i = 0; i < S; i++) {
                const float *xi = X + (m * S + i) * D, c = comb[(m * S + i) * S + j];
                for (int64_t d = 0; d < D; d++) o[d] = o[d] + c * xi[d];
            }
        }
}

/* out [M, D] = w[0] * X[0] + ... + w[S-1] * X[S-1] per row (X [M, S, D], w [M, S]), added in stream order. */
void glue_streams(const float *X, const float *w, int64_t M, int64_t S, int64_t D, float *out) {
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * D;
        for (int64_t d = 0; d < D; d++) o[d] = w[m * S] * X[m * S * D + d];
        for (int64_t h = 1; h < S; h++) {
            const float *xh = X + (m * S + h) * D, c = w[m * S + h];
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + c * xh[d];
        }
    }
}

/* out [M, G, d] = x with the last 2 * P values of each of the G rows of d values of row m rotated in adjacent
 * pairs: (x0, x1) -> (x0 * cos - x1 * sin, x0 * sin + x1 * cos), cos/sin [M, P] (sin negated when inverse). */
void glue_rope(const float *x, int64_t M, int64_t G, int64_t d, const float *cos_, const float *sin_, int64_t P,
               int inverse, float *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xr = x + (m * G + g) * d, *c = cos_ + m * P, *s = sin_ + m * P;
            float *o = out + (m * G + g) * d;
            int64_t first = d - 2 * P;
            for (int64_t i = 0; i < first; i++) o[i] = xr[i];
            for (int64_t p = 0; p < P; p++) {
                float x0 = xr[first + 2 * p], x1 = xr[first + 2 * p + 1], sn = inverse ? -s[p] : s[p];
                o[first + 2 * p] = x0 * c[p] - x1 * sn;
                o[first + 2 * p + 1] = x0 * sn + x1 * c[p];
            }
        }
}
