/* The small ops of a decode step in one call each (backends/cpu/glue.py): after a large product has streamed its
 * weight through the caches, every torch call costs tens of microseconds of cold code and data (docs/cpu.md,
 * "The glue in C"), a short loop in C a few. Each function does exactly the float operations of its reference, in
 * the same order (built with -ffp-contract=off: no fused multiply-adds), so the results are the reference's bits:
 * rms_norm_lanes (ops/rms_norm.py: the sum of squares in LANES lanes), hc_pre_poly (ops/hc_pre.py), hc_post
 * (ops/hc_post.py), the stream sums of hc_pre and hc_head, the pair rotation of rope_tail (ops/rope_tail.py, its
 * cos/sin given), store_rows (ops/store_rows.py), sparse_attention_lanes (ops/sparse_attention.py) and swiglu_poly
 * (ops/exp_poly.py, whose e^x uses only rounded +, -, * and exact powers of two), head_streams_poly
 * (ops/hc_head.py). Row-wise, so batch-invariant.
 * Attention's (query, head) pairs are split across the kernel pool (pool.c); the others run on the calling thread.
 * Built with qgemv.c by backends/cpu/kernels.py.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
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

/* e^x with only rounded +, -, * and an exact power of two (ops/exp_poly.py): Cody-Waite reduction by
 * n = floor(x·log2 e + 1/2), a degree-5 polynomial; 0 below EXP_LOW (and for NaN), +inf above EXP_HIGH; branch-free,
 * so a loop of it vectorizes. */
#define EXP_LOW (-87.0f)
#define EXP_HIGH 88.0f
static inline float exp_poly(float x) {
    int low = !(x >= EXP_LOW), high = x > EXP_HIGH;
    x = low || high ? 0.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r);
    y = y + r;
    y = y + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return low ? 0.0f : high ? INFINITY : y * scale.f;
}

static inline float sigmoid_poly(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

typedef float v16 __attribute__((vector_size(LANES * sizeof(float))));   /* the LANES partial sums, elementwise */

static inline v16 load16(const float *p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float add_lanes(v16 acc) {
    float total = acc[0];
    for (int l = 1; l < LANES; l++) total += acc[l];
    return total;
}

typedef struct {        /* one sparse_attention call (glue_attention), read by the pool's threads */
    const float *q, *kv, *sinks;
    const int64_t *rows;    /* [M, L]: each query's listed rows, then (comp not NULL) its rows of comp [M, Lc] */
    int64_t H, D, L;
    float scale;
    const int64_t *comp;
    int64_t Lc;
} attention_t;

#define HEADS 4     /* heads of a query done together: each key row is read once for all of them */

/* Output rows [start, stop) of the (query, head) pairs of an attention_t `args` (pool.c's row-function signature:
 * the unused arguments are the products'): s_k = (q·kv[row k], element i added to lane i % LANES in order, then the
 * lanes in order)·scale, −inf where row k is −1; p_k = exp_poly(s_k − m) with m the largest of the s_k and the sink;
 * out = (Σ_k p_k·kv[row k]) / (exp_poly(sink − m) + Σ_k p_k), both sums in list order (entries −1 weigh exactly 0,
 * so they are skipped). HEADS heads of one query at a time share each pass over its rows. A query's list is its L
 * rows, then its Lc rows of comp when comp is not NULL. */
int glue_attention_rows(int type, const uint8_t *args, int64_t expert_bytes, const int64_t *experts, int64_t N,
                        int64_t K, const void *x, int64_t M, float *out, int64_t start, int64_t stop) {
    (void)type, (void)expert_bytes, (void)experts, (void)N, (void)K, (void)x, (void)M;
    const attention_t *a = (const attention_t *)args;
    int64_t H = a->H, D = a->D, L = a->L + (a->comp ? a->Lc : 0);
    float *s = malloc((size_t)(HEADS * L + 1) * sizeof(float));
    int64_t *used = malloc((size_t)(L + 1) * sizeof(int64_t));
    if (!s || !used) {
        free(s), free(used);
        return -2;
    }
    for (int64_t pair = start, g; pair < stop; pair += g) {
        int64_t m = pair / H, h = pair % H, n = 0;
        g = stop - pair < H - h ? stop - pair : H - h;
        g = g < HEADS ? g : HEADS;
        const float *q[HEADS];
        float top[HEADS], total[HEADS], sink[HEADS];
        for (int t = 0; t < HEADS; t++) {            /* spare slots repeat the last head and are not stored */
            int64_t head = h + (t < g ? t : g - 1);
            q[t] = a->q + (m * H + head) * D, sink[t] = top[t] = a->sinks[head], total[t] = 0.0f;
        }
        const int64_t *rows = a->rows + m * a->L;
        for (int64_t k = 0; k < a->L; k++)
            if (rows[k] >= 0) used[n++] = rows[k];
        for (int64_t k = 0; a->comp && k < a->Lc; k++)
            if (a->comp[m * a->Lc + k] >= 0) used[n++] = a->comp[m * a->Lc + k];
        for (int64_t j = 0; j < n; j++) {
            const float *key = a->kv + used[j] * D;
            v16 acc[HEADS] = {{0}};
            int64_t d = 0;
            for (; d + LANES <= D; d += LANES) {
                v16 kd = load16(key + d);
                for (int t = 0; t < HEADS; t++) acc[t] += load16(q[t] + d) * kd;
            }
            for (int l = 0; d + l < D; l++)
                for (int t = 0; t < HEADS; t++) acc[t][l] += q[t][d + l] * key[d + l];
            for (int t = 0; t < HEADS; t++) {
                float v = add_lanes(acc[t]) * a->scale;
                s[t * L + j] = v;
                if (v > top[t]) top[t] = v;
            }
        }
        for (int t = 0; t < HEADS; t++)
            for (int64_t j = 0; j < n; j++) s[t * L + j] = exp_poly(s[t * L + j] - top[t]);
        for (int t = 0; t < HEADS; t++)
            for (int64_t j = 0; j < n; j++) total[t] = total[t] + s[t * L + j];
        int64_t d = 0;
        for (; d + 2 * LANES <= D; d += 2 * LANES) {        /* 2 x 16 outputs of each head in registers */
            v16 o[HEADS][2] = {{{0}}};
            for (int64_t j = 0; j < n; j++) {
                const float *v = a->kv + used[j] * D + d;
                v16 v0 = load16(v), v1 = load16(v + LANES);
                for (int t = 0; t < HEADS; t++) {
                    v16 w = {0};
                    w += s[t * L + j];
                    o[t][0] += w * v0, o[t][1] += w * v1;
                }
            }
            for (int t = 0; t < g; t++) {
                float *dst = out + (m * H + h + t) * D + d;
                __builtin_memcpy(dst, &o[t][0], sizeof(v16)), __builtin_memcpy(dst + LANES, &o[t][1], sizeof(v16));
            }
        }
        for (; d < D; d++)
            for (int t = 0; t < g; t++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < n; j++) acc = acc + s[t * L + j] * a->kv[used[j] * D + d];
                out[(m * H + h + t) * D + d] = acc;
            }
        for (int t = 0; t < g; t++) {
            float *dst = out + (m * H + h + t) * D, sum = exp_poly(sink[t] - top[t]) + total[t];
            for (int64_t i = 0; i < D; i++) dst[i] = dst[i] / sum;
        }
    }
    free(s), free(used);
    return 0;
}

void sinkhorn(const float *p, float *c, int64_t M, int64_t S, int64_t iters, float eps);     /* sinkhorn.c */

/* hc_pre (ops/hc_pre.py, hc_pre_poly): from the mixes [M, 2S + S²] of HC states X [M, S, D], the gates
 * pre = sigmoid_poly(m·scale[0] + base) + eps, post [M, S] = 2·sigmoid_poly(m·scale[1] + base), comb [M, S, S] the
 * Sinkhorn of the row softmax (exp_poly, sums in index order) of m·scale[2] + base, and x [M, D] = Σ_h pre_h·X_h in
 * stream order. Returns -2 where no memory is left for the gates. */
int glue_hc_pre(const float *X, const float *mixes, const float *scale, const float *base, int64_t M, int64_t S,
                int64_t D, int64_t iters, float eps, float *x, float *post, float *comb) {
    int64_t W = 2 * S + S * S;
    float *pre = malloc((size_t)(M * S + M * S * S + 1) * sizeof(float)), *soft = pre + M * S;
    if (!pre) return -2;
    for (int64_t m = 0; m < M; m++) {
        const float *mx = mixes + m * W;
        for (int64_t i = 0; i < S; i++) {
            pre[m * S + i] = sigmoid_poly(mx[i] * scale[0] + base[i]) + eps;
            post[m * S + i] = 2.0f * sigmoid_poly(mx[S + i] * scale[1] + base[S + i]);
        }
        for (int64_t r = 0; r < S; r++) {
            float *row = soft + (m * S + r) * S, top = -INFINITY, sum = 0.0f;
            for (int64_t k = 0; k < S; k++) {
                int64_t i = 2 * S + r * S + k;
                row[k] = mx[i] * scale[2] + base[i];
                if (row[k] > top) top = row[k];
            }
            for (int64_t k = 0; k < S; k++) row[k] = exp_poly(row[k] - top);
            for (int64_t k = 0; k < S; k++) sum = sum + row[k];
            for (int64_t k = 0; k < S; k++) row[k] = row[k] / sum;
        }
    }
    sinkhorn(soft, comb, M, S, iters, eps);
    glue_streams(X, pre, M, S, D, x);
    free(pre);
    return 0;
}

static inline int exponent_of(float v) {        /* floor(log2 |v|) of a normal float, from its exponent bits */
    union { float f; int32_t i; } u = {.f = v};
    return ((u.i >> 23) & 255) - 127;
}

static inline float pow2f(int e) {              /* 2^e for e in the normal range */
    union { int32_t i; float f; } u = {.i = (e + 127) << 23};
    return u.f;
}

/* x rounded to the nearest multiple of 2^(max(floor(log2 |x|), min_exp) - bits), ties to even: a float format with
 * `bits` mantissa bits and smallest normal exponent min_exp (rintf rounds half to even). */
static inline float round_bits(float x, int bits, int min_exp) {
    float a = fabsf(x);
    int e = a > 0.0f ? exponent_of(a) : min_exp;
    float step = pow2f((e > min_exp ? e : min_exp) - bits), q = rintf(a / step) * step;
    return x < 0.0f ? -q : q;
}

/* store_rows (ops/store_rows.py): cache[slots[m]] = rows[m] with the first fp8_dims values through the E4M3
 * simulation (ops/fp8_sim.py: per 64 values a scale 2^ceil(log2(max(amax, 1e-4) / 448)), taken exactly from the
 * float bits as backends/triton/sims.py does) and then, with f16, every value rounded to float16 and back. Returns
 * -1 (nothing written) when a slot is outside [0, N). */
int glue_store_rows(float *cache, int64_t N, int64_t d, const int64_t *slots, int64_t M, const float *rows,
                    int64_t fp8_dims, int f16) {
    for (int64_t m = 0; m < M; m++)
        if (slots[m] < 0 || slots[m] >= N) return -1;
    for (int64_t m = 0; m < M; m++) {
        const float *x = rows + m * d;
        float *o = cache + slots[m] * d;
        for (int64_t b = 0; b < fp8_dims; b += 64) {
            float amax = 0.0f;
            for (int i = 0; i < 64; i++) amax = fabsf(x[b + i]) > amax ? fabsf(x[b + i]) : amax;
            float y = (amax > 1e-4f ? amax : 1e-4f) / 448.0f;
            union { float f; int32_t i; } u = {.f = y};
            float scale = pow2f(exponent_of(y) + ((u.i & 0x7FFFFF) != 0));
            for (int i = 0; i < 64; i++) {
                float v = x[b + i] / scale;
                v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
                o[b + i] = round_bits(v, 3, -6) * scale;
            }
        }
        for (int64_t i = fp8_dims; i < d; i++) o[i] = x[i];
        if (f16)
            for (int64_t i = 0; i < d; i++) {
                float h = round_bits(o[i], 10, -14);
                o[i] = fabsf(h) > 65504.0f ? copysignf(INFINITY, h) : h;
            }
    }
    return 0;
}

int dequantize(int type, const uint8_t *w, int64_t rows, int64_t K, float *out);     /* qgemv.c */

/* out [M, K] = rows ids of a table of V rows of row_bytes raw blocks of `type`, dequantized by qgemv.c's
 * `dequantize` (ops/embed.py's values). Returns 1 for an id outside [0, V), -1 for a type it cannot serve. */
int glue_embed(int type, const uint8_t *table, int64_t V, int64_t row_bytes, const int64_t *ids, int64_t M,
               int64_t K, float *out) {
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= V) return 1;
    for (int64_t m = 0; m < M; m++)
        if (dequantize(type, table + ids[m] * row_bytes, 1, K, out + m * K)) return -1;
    return 0;
}

/* h [M, N] = silu_poly(min(g, clamp)) · clamp(u, ±clamp) (· w[m]) (ops/exp_poly.py, swiglu_poly; no clamp when
 * has_clamp is 0, no weight when w is NULL). */
void glue_swiglu(const float *g, const float *u, const float *w, int64_t M, int64_t N, int has_clamp, float clamp,
                 float *h) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float a = g[m * N + n], b = u[m * N + n];
            if (has_clamp) {
                a = a > clamp ? clamp : a;
                b = b < -clamp ? -clamp : b > clamp ? clamp : b;
            }
            float v = a / (1.0f + exp_poly(-a)) * b;
            h[m * N + n] = w ? v * w[m] : v;
        }
}

/* out [M, D] = y[m, 0] + y[m, 1] + ... + y[m, K-1] (y [M, K, D]), added in order. */
void glue_sum_rows(const float *y, int64_t M, int64_t K, int64_t D, float *out) {
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * D;
        for (int64_t d = 0; d < D; d++) o[d] = y[m * K * D + d];
        for (int64_t k = 1; k < K; k++)
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + y[(m * K + k) * D + d];
    }
}

/* The indexer's scores [M, N] from its heads' products s [M, H, width] (backends/cpu/attention.py index_scores):
 * Σ_h relu(s[m, h, j]) · w[m, h], the heads added in order from h = 0, for j < visible[m] (<= width), −inf elsewhere;
 * relu as torch's (a negative value is +0, −0 and NaN stay): the bits of its torch ops. */
void glue_index_total(const float *s, const float *w, const int64_t *visible, int64_t M, int64_t H, int64_t width,
                      int64_t N, float *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < N; j++) {
            float t = -INFINITY;
            if (j < visible[m])
                for (int64_t h = 0; h < H; h++) {
                    float v = s[(m * H + h) * width + j];
                    float term = (v < 0.0f ? 0.0f : v) * w[m * H + h];
                    t = h ? t + term : term;
                }
            out[m * N + j] = t;
        }
}

/* out [M, D] = Σ_h (sigmoid_poly(mixes[m, h]·scale + base[h]) + eps)·X[m, h] in stream order (ops/hc_head.py,
 * head_streams_poly). */
void glue_head_streams(const float *X, const float *mixes, const float *scale, const float *base, float eps,
                       int64_t M, int64_t S, int64_t D, float *out) {
    for (int64_t m = 0; m < M; m++) {
        float w[64];
        int64_t n = S < 64 ? S : 64;
        for (int64_t h = 0; h < n; h++) w[h] = sigmoid_poly(mixes[m * S + h] * scale[0] + base[h]) + eps;
        glue_streams(X + m * S * D, w, 1, S, D, out + m * D);
    }
}

/* Several products in one pass of the kernel pool (glue_products): a decode step's products that need no result of
 * each other (the routed experts' gate and up, the eight groups of attention's output projection) are one hand-off
 * to the pool's threads instead of one each, and a thread that finishes its share of one weight goes on to the next
 * instead of waiting. Each product runs its row kernel (qgemv or qdot8_rows) on its N output rows cut into `parts`
 * chunks; every output is computed by one thread with the kernel's own code, so the bits are those of
 * the product's own pool_rows call, for any thread count. */
typedef int (*rows_fn)(int, const uint8_t *, int64_t, const int64_t *, int64_t, int64_t, const void *, int64_t,
                       float *, int64_t, int64_t);

typedef struct {
    rows_fn fn;
    int64_t type;
    const uint8_t *w;
    int64_t expert_bytes;
    const int64_t *experts;
    int64_t N, K;
    const void *x;
    int64_t M;
    float *y;
    int64_t parts;
} product_t;

typedef struct {
    const product_t *p;
    int64_t count;
} products_t;

int pool_range(int (*fn)(void *, int64_t, int64_t), void *ctx, int64_t n, int64_t parts, int threads);  /* pool.c */
int64_t pool_bound(int64_t n, int64_t c, int64_t parts);   /* pool.c: where chunk c of `parts` of [0, n) starts */

/* Chunks [start, stop) of the products' chunks in order, one kernel call per product they cover (its chunks' rows). */
static int product_chunks(void *ctx, int64_t start, int64_t stop) {
    const products_t *ps = ctx;
    int rc = 0;
    for (int64_t i = 0, first = 0; i < ps->count && first < stop; first += ps->p[i++].parts) {
        const product_t *p = &ps->p[i];
        int64_t j0 = start > first ? start - first : 0, j1 = stop - first < p->parts ? stop - first : p->parts;
        if (j0 >= j1) continue;
        int r = p->fn((int)p->type, p->w, p->expert_bytes, p->experts, p->N, p->K, p->x, p->M, p->y,
                      pool_bound(p->N, j0, p->parts), pool_bound(p->N, j1, p->parts));
        rc = r < rc ? r : rc;
    }
    return rc;
}

/* The `count` products p (each with parts >= 1) in one pool call on `threads` threads; the lowest return code. */
int glue_products(const product_t *p, int64_t count, int threads) {
    int64_t chunks = 0;
    for (int64_t i = 0; i < count; i++) {
        if (p[i].parts < 1 || p[i].N < 1) return -1;
        chunks += p[i].parts;
    }
    products_t ps = {p, count};
    return count ? pool_range(product_chunks, &ps, chunks, chunks, threads) : 0;
}

/* Whether score a ranks before score b of a lower expert id in a stable descending sort (NaN first). */
static inline int ranks_before(float a, float b) { return a > b || (isnan(a) && !isnan(b)); }

/* The routing of ops/moe.py's `select` after the router's scores p [M, E] (= sqrt(softplus(router · x))), and the
 * cpu backend's reordering by expert id: the top_k experts of p + bias (bias NULL: of p; ties to the lower id), or
 * table[ids[m]] (hash layers: table [rows, top_k]); w = p at them, divided by max(their sum, 6.1035e-5) when
 * normalize, times scale; then both by increasing expert id (stable). The sum is torch's float sum of fewer than 8
 * values (its scalar row sum: values 0..3 as four partial sums, the values from 4 on added to the first, then the
 * other three added to it in order). Returns 1 on an id outside the table or an expert outside p. */
int glue_route(const float *p, int64_t M, int64_t E, const float *bias, const int64_t *table, int64_t table_rows,
               const int64_t *ids, int64_t top_k, int normalize, float scale, int64_t *chosen, float *w) {
    for (int64_t m = 0; m < M; m++) {
        const float *pm = p + m * E;
        int64_t *c = chosen + m * top_k;
        float *wm = w + m * top_k;
        if (table) {
            if (ids[m] < 0 || ids[m] >= table_rows) return 1;
            for (int64_t j = 0; j < top_k; j++) {
                c[j] = table[ids[m] * top_k + j];
                if (c[j] < 0 || c[j] >= E) return 1;
            }
        } else {
            for (int64_t j = 0; j < top_k; j++) {     /* the best expert not taken yet, the lower id on a tie */
                int64_t best = -1;
                float best_score = 0.0f;
                for (int64_t e = 0; e < E; e++) {
                    int taken = 0;
                    for (int64_t i = 0; i < j; i++) taken |= c[i] == e;
                    float s = bias ? pm[e] + bias[e] : pm[e];
                    if (!taken && (best < 0 || ranks_before(s, best_score))) best = e, best_score = s;
                }
                c[j] = best;
            }
        }
        for (int64_t j = 0; j < top_k; j++) wm[j] = pm[c[j]];
        if (normalize) {
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int64_t whole = top_k / 4 * 4;
            for (int64_t j = 0; j < whole; j++) part[j % 4] += wm[j];
            for (int64_t j = whole; j < top_k; j++) part[0] += wm[j];
            float total = part[0] + part[1] + part[2] + part[3];
            total = total < 6.1035e-5f ? 6.1035e-5f : total;
            for (int64_t j = 0; j < top_k; j++) wm[j] = wm[j] / total;
        }
        for (int64_t j = 0; j < top_k; j++) wm[j] = wm[j] * scale;
        for (int64_t j = 1; j < top_k; j++)           /* insertion sort by id: stable */
            for (int64_t i = j; i > 0 && c[i - 1] > c[i]; i--) {
                int64_t ci = c[i]; c[i] = c[i - 1]; c[i - 1] = ci;
                float wi = wm[i]; wm[i] = wm[i - 1]; wm[i - 1] = wi;
            }
    }
    return 0;
}

int q8_quantize(int kind, const float *x, int64_t M, int64_t K, void *out);     /* qdot8.c */

/* glue_route's arguments for glue_moe_rows (the routing of the rows before their experts). */
typedef struct {
    const float *p;             /* router scores [M, E] */
    int64_t E;
    const float *bias;          /* [E] or NULL */
    const int64_t *table;       /* [table_rows, k] or NULL */
    int64_t table_rows;
    const int64_t *ids;         /* [M] */
    int64_t normalize;
    float scale;
} route_t;

/* glue_moe_rows before its first pool pass, on its products q (copied from the bound ones): the routing into chosen
 * and w (route not NULL; the products' experts then point at chosen), x's rows repeated into xs and (q8) rounded. */
static int moe_rows_in(product_t *q, const route_t *route, int64_t *chosen, float *w, const float *x, float *xs,
                       int q8_rows, int64_t M, int64_t k) {
    if (route) {
        if (glue_route(route->p, M, route->E, route->bias, route->table, route->table_rows, route->ids, k,
                       (int)route->normalize, route->scale, chosen, w)) return 1;
        for (int i = 0; i < 3; i++) q[i].experts = chosen;
    }
    int64_t K = q[0].K;
    if (xs != x)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < k; j++) memcpy(xs + (m * k + j) * K, x + m * K, (size_t)K * sizeof(float));
    return q8_rows >= 0 && q8_quantize(q8_rows, xs, q[0].M, K, (void *)q[0].x) ? -1 : 0;
}

/* glue_moe_rows between its pool passes: h = glue_swiglu(gate, up, clamp, w) and (q8) h rounded into hq. */
static int moe_rows_mid(const product_t *q, const float *w, int q8_kind, void *hq, int has_clamp, float clamp,
                        float *h) {
    glue_swiglu(q[0].y, q[1].y, w, q[0].M, q[0].N, has_clamp, clamp, h);
    return q8_kind >= 0 && q8_quantize(q8_kind, h, q[2].M, q[2].K, hq) ? -1 : 0;
}

/* The routed experts of M rows x [M, K] over k (row, expert) pairs each (p: the gate, up and down products of the
 * M * k pairs, their experts `chosen` [M, k] with routing weights w [M, k]; with `route`, both written first by
 * glue_route): x's rows each repeated k times into xs (xs == x: taken as they are), under q8 (q8_rows >= 0) rounded
 * by qdot8.c into the rows p[0].x (= p[1].x), the gate and up products in one pool pass, h = glue_swiglu(g, u, clamp,
 * w), under q8 (q8_kind >= 0) h rounded into hq, the down product (its rows h or hq), and out [M, D] each row's k
 * results added in order (glue_sum_rows): the bits of those calls made one by one. Returns 1 where the routing finds
 * a token id outside its table. */
int glue_moe_rows(const product_t *p, const route_t *route, int64_t *chosen, float *w, const float *x, float *xs,
                  int q8_rows, int q8_kind, void *hq, int has_clamp, float clamp, float *h, int64_t M, int64_t k,
                  float *out, int threads) {
    product_t q[3];
    memcpy(q, p, sizeof q);
    int rc = moe_rows_in(q, route, chosen, w, x, xs, q8_rows, M, k);
    if (!rc) rc = glue_products(q, 2, threads);
    if (!rc) rc = moe_rows_mid(q, w, q8_kind, hq, has_clamp, clamp, h);
    if (!rc) rc = glue_products(q + 2, 1, threads);
    if (!rc) glue_sum_rows(q[2].y, M, k, q[2].N, out);
    return rc;
}

/* Fused ops (ops/hc_pre_norm.py, ops/qmatmul_norm_rope.py): the glue functions above chained in one call, so the
 * bits are those of the separate calls. */

/* hc_pre_norm: flat [M, S·D] = glue_rms_norm(X) (no weight), under q8 (q8_kind >= 0) rounded by qdot8.c into the
 * product's rows p->x, the product p (the HC weight: mixes = p->y), glue_hc_pre, then x normed in place by norm. */
int glue_hc_pre_norm(const product_t *p, int q8_kind, const float *X, float *flat, const float *scale,
                     const float *base, const float *norm, int64_t M, int64_t S, int64_t D, int64_t iters,
                     float hc_eps, float rms_eps, float *x, float *post, float *comb, int threads) {
    glue_rms_norm(X, M, S * D, NULL, rms_eps, flat);
    if (q8_kind >= 0 && q8_quantize(q8_kind, flat, M, S * D, (void *)p->x)) return -1;
    int rc = glue_products(p, 1, threads);
    if (rc) return rc;
    rc = glue_hc_pre(X, p->y, scale, base, M, S, D, iters, hc_eps, x, post, comb);
    if (rc) return rc;
    glue_rms_norm(x, M, D, norm, rms_eps, x);
    return 0;
}

/* hc_head: flat [M, S·D] = glue_rms_norm(X) (no weight), the product p of the head's HC weight (mixes = p->y, exact
 * rows), then glue_head_streams into out [M, D]: the cpu hc_head's calls chained. */
int glue_hc_head(const product_t *p, const float *X, float *flat, const float *scale, const float *base, int64_t M,
                 int64_t S, int64_t D, float rms_eps, float hc_eps, float *out, int threads) {
    glue_rms_norm(X, M, S * D, NULL, rms_eps, flat);
    int rc = glue_products(p, 1, threads);
    if (rc) return rc;
    glue_head_streams(X, p->y, scale, base, hc_eps, M, S, D, out);
    return 0;
}

/* qmatmul_norm_rope: under q8 (q8_kind >= 0) the rows x [M, K] rounded by qdot8.c into the product's rows p->x, the
 * product p (y [M, N]), each group of `width` outputs normed into out (by norm when not NULL), then, when cos_ is not
 * NULL, each group's tail rotated in place by cos/sin [M, P]. */
int glue_qmatmul_norm_rope(const product_t *p, int q8_kind, const float *x, int threads, const float *norm,
                           int64_t width, float eps, const float *cos_, const float *sin_, int64_t P, float *out) {
    if (q8_kind >= 0 && q8_quantize(q8_kind, x, p->M, p->K, (void *)p->x)) return -1;
    int rc = glue_products(p, 1, threads);
    if (rc) return rc;
    glue_rms_norm(p->y, p->M * (p->N / width), width, norm, eps, out);
    if (cos_) glue_rope(out, p->M, p->N / width, width, cos_, sin_, P, 0, out);
    return 0;
}

/* attention_output: o [M, H, hd] rotated back (glue_rope, inverse) into rot, its rows regrouped into xs [G, M, K]
 * (K = H·hd / G: group g of row m is row g·M + m), under q8 (q8_a >= 0) rounded into p[0].x; p[0] the grouped product
 * (the groups as a stack of G experts, y [G·M, n]); its rows gathered back into u [M, G·n], under q8 (q8_b >= 0)
 * rounded into p[1].x; p[1] the output product. */
int glue_attention_output(const product_t *p, int q8_a, int q8_b, const float *o, int64_t M, int64_t H, int64_t hd,
                          const float *cos_, const float *sin_, int64_t P, int64_t G, float *rot, float *xs, float *u,
                          int threads) {
    int64_t K = H * hd / G, n = p[0].N;
    glue_rope(o, M, H, hd, cos_, sin_, P, 1, rot);
    for (int64_t g = 0; g < G; g++)
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) xs[(g * M + m) * K + k] = rot[m * H * hd + g * K + k];
    if (q8_a >= 0 && q8_quantize(q8_a, xs, G * M, K, (void *)p[0].x)) return -1;
    int rc = glue_products(p, 1, threads);
    if (rc) return rc;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < n; j++) u[m * G * n + g * n + j] = p[0].y[(g * M + m) * n + j];
    if (q8_b >= 0 && q8_quantize(q8_b, u, M, G * n, (void *)p[1].x)) return -1;
    return glue_products(p + 1, 1, threads);
}

/* compressor_store: under q8 the rows x [M, K] rounded by qdot8.c into each product's rows (q8_kv >= 0: p[0].x;
 * q8_gate >= 0: p[1].x, unless it is p[0].x), the products p[0] (kv) and p[1] (gate) of the same rows in one pool
 * pass, then kv_ring[slots[m]] = p[0].y[m] and score_ring[slots[m]] = p[1].y[m] + ape[ape_rows[m]] (rings of N rows
 * of c values, ape of ape_n rows). Returns 1 (nothing written) when a slot is outside [0, N) or an ape row outside
 * [0, ape_n). */
int glue_compressor_store(const product_t *p, int q8_kv, int q8_gate, const float *x, int threads, const float *ape,
                          int64_t ape_n, const int64_t *ape_rows, const int64_t *slots, int64_t N, float *kv_ring,
                          float *score_ring) {
    int64_t M = p[0].M, c = p[0].N;
    for (int64_t m = 0; m < M; m++)
        if (slots[m] < 0 || slots[m] >= N || ape_rows[m] < 0 || ape_rows[m] >= ape_n) return 1;
    if (q8_kv >= 0 && q8_quantize(q8_kv, x, M, p[0].K, (void *)p[0].x)) return -1;
    if (q8_gate >= 0 && p[1].x != p[0].x && q8_quantize(q8_gate, x, M, p[1].K, (void *)p[1].x)) return -1;
    int rc = glue_products(p, 2, threads);
    if (rc) return rc;
    for (int64_t m = 0; m < M; m++) {
        const float *kv = p[0].y + m * c, *gate = p[1].y + m * c, *bias = ape + ape_rows[m] * c;
        float *k = kv_ring + slots[m] * c, *s = score_ring + slots[m] * c;
        for (int64_t i = 0; i < c; i++) k[i] = kv[i], s[i] = gate[i] + bias[i];
    }
    return 0;
}

/* hc_post_pre_norm: Xn = glue_hc_post(X, y, post, comb), then glue_hc_pre_norm on Xn (post and comb of the next
 * sub-layer into post2 and comb2). */
int glue_hc_post_pre_norm(const product_t *p, int q8_kind, const float *X, const float *y, const float *post,
                          const float *comb, float *Xn, float *flat, const float *scale, const float *base,
                          const float *norm, int64_t M, int64_t S, int64_t D, int64_t iters, float hc_eps,
                          float rms_eps, float *x, float *post2, float *comb2, int threads) {
    glue_hc_post(X, y, post, comb, M, S, D, Xn);
    return glue_hc_pre_norm(p, q8_kind, Xn, flat, scale, base, norm, M, S, D, iters, hc_eps, rms_eps, x, post2, comb2,
                            threads);
}

/* attention_input (ops/attention_input.py): p[0] the q_a product and p[1] the kv product of the rows x [M, K], under
 * q8 rounded by qdot8.c into their rows (q8_a >= 0: p[0].x; q8_kv >= 0: p[1].x, unless it is p[0].x), in one pool
 * pass; q_lat = q_a's output normed by q_a_norm, under q8 (q8_b >= 0) rounded into p[2].x (else p[2].x is q_lat);
 * p[2] the q_b product, each head of hd values normed (no weight) into q and its tail rotated by cos/sin [M, P]; kv's
 * output normed by kv_norm into kv_row and rotated; then glue_store_rows(cache [N, hd], slots, kv_row, fp8_dims, f16).
 * The bits of glue_qmatmul_norm_rope three times and glue_store_rows. Returns 1 (nothing written) when a slot is
 * outside [0, N). */
int glue_attention_input(const product_t *p, int q8_a, int q8_kv, int q8_b, const float *x, int threads,
                         const float *q_a_norm, const float *kv_norm, float eps, int64_t hd, const float *cos_,
                         const float *sin_, int64_t P, float *q_lat, float *q, float *kv_row, float *cache, int64_t N,
                         const int64_t *slots, int64_t fp8_dims, int f16) {
    int64_t M = p[0].M;
    for (int64_t m = 0; m < M; m++)
        if (slots[m] < 0 || slots[m] >= N) return 1;
    if (q8_a >= 0 && q8_quantize(q8_a, x, M, p[0].K, (void *)p[0].x)) return -1;
    if (q8_kv >= 0 && p[1].x != p[0].x && q8_quantize(q8_kv, x, M, p[1].K, (void *)p[1].x)) return -1;
    int rc = glue_products(p, 2, threads);
    if (rc) return rc;
    glue_rms_norm(p[0].y, M, p[0].N, q_a_norm, eps, q_lat);
    glue_rms_norm(p[1].y, M * (p[1].N / hd), hd, kv_norm, eps, kv_row);
    glue_rope(kv_row, M, p[1].N / hd, hd, cos_, sin_, P, 0, kv_row);
    if (q8_b >= 0 && q8_quantize(q8_b, q_lat, M, p[2].K, (void *)p[2].x)) return -1;
    rc = glue_products(p + 2, 1, threads);
    if (rc) return rc;
    glue_rms_norm(p[2].y, M * (p[2].N / hd), hd, NULL, eps, q);
    glue_rope(q, M, p[2].N / hd, hd, cos_, sin_, P, 0, q);
    return glue_store_rows(cache, N, hd, slots, M, kv_row, fp8_dims, f16);
}

void index_sim(const float *x, int64_t n_rows, int64_t n, int hadamard, float root, int fp4, float *out);  /* step.c */

/* indexer_query (ops/indexer_query.py): p[0] the q_b product of the query latents q_lat [M, r] and p[1] the proj
 * product of the rows x [M, D], under q8 rounded by qdot8.c into their rows (q8_q >= 0: p[0].x; q8_w >= 0: p[1].x),
 * in one pool pass; q [M, H, di] = p[0].y with each head's tail rotated by cos/sin [M, P], then with `sim` each head
 * through step.c's index_sim (Hadamard with its float32 sqrt(di) `hroot`, FP4); w [M, H] = p[1].y / root. The bits
 * of qmatmul, rope_tail, hadamard, fp4_sim and the float32 division. */
int glue_indexer_query(const product_t *p, int q8_q, int q8_w, const float *q_lat, const float *x, int threads,
                       int64_t di, const float *cos_, const float *sin_, int64_t P, int sim, float hroot, float root,
                       float *q, float *w) {
    int64_t M = p[0].M, H = p[0].N / di;
    if (q8_q >= 0 && q8_quantize(q8_q, q_lat, M, p[0].K, (void *)p[0].x)) return -1;
    if (q8_w >= 0 && q8_quantize(q8_w, x, M, p[1].K, (void *)p[1].x)) return -1;
    int rc = glue_products(p, 2, threads);
    if (rc) return rc;
    glue_rope(p[0].y, M, H, di, cos_, sin_, P, 0, q);
    if (sim) index_sim(q, M * H, di, 1, hroot, 1, q);
    for (int64_t i = 0; i < M * p[1].N; i++) w[i] = p[1].y[i] / root;
    return 0;
}

/* ffn (ops/ffn.py): glue_moe_rows of the routed experts (p: the stacks' gate, up and down products, the rows routed
 * by `route` into chosen and w) into out and glue_moe_rows of the shared expert (s: its 2-D weights' products on the
 * rows x as they are, no routing weight) into s_out, the two calls' products interleaved: both gate and up products
 * in one pool pass, both down products in the next (two hand-offs to the pool's threads instead of four); then
 * out += s_out. The bits of moe, shared_expert and the float32 add. Returns glue_moe_rows' code (1: a token id
 * outside the routing table). */
int glue_ffn(const product_t *p, const route_t *route, int64_t *chosen, float *w, const float *x, float *xs,
             int q8_rows, int q8_kind, void *hq, int has_clamp, float clamp, float *h, int64_t M, int64_t k,
             const product_t *s, int s_q8_rows, int s_q8_kind, void *s_hq, int s_has_clamp, float s_clamp, float *s_h,
             float *s_out, float *out, int threads) {
    product_t q[3], r[3], pass[4];
    memcpy(q, p, sizeof q);
    memcpy(r, s, sizeof r);
    int rc = moe_rows_in(q, route, chosen, w, x, xs, q8_rows, M, k);
    if (!rc) rc = moe_rows_in(r, NULL, NULL, NULL, x, (float *)x, s_q8_rows, M, 1);
    pass[0] = q[0], pass[1] = q[1], pass[2] = r[0], pass[3] = r[1];
    if (!rc) rc = glue_products(pass, 4, threads);
    if (!rc) rc = moe_rows_mid(q, w, q8_kind, hq, has_clamp, clamp, h);
    if (!rc) rc = moe_rows_mid(r, NULL, s_q8_kind, s_hq, s_has_clamp, s_clamp, s_h);
    pass[0] = q[2], pass[1] = r[2];
    if (!rc) rc = glue_products(pass, 2, threads);
    if (rc) return rc;
    glue_sum_rows(q[2].y, M, k, q[2].N, out);
    glue_sum_rows(r[2].y, M, 1, r[2].N, s_out);
    for (int64_t i = 0; i < M * s[2].N; i++) out[i] += s_out[i];
    return 0;
}
