/* The decode step's small calls in fewer ctypes calls (backends/cpu/kernels.py, docs/cpu.md "The decode step's
 * Python"): a product of a few rows with one weight whose arguments were bound once (`bound_product`: under q8 the
 * activations rounded by qdot8.c's q8_quantize into a per-thread buffer, then the row kernel through pool.c's
 * pool_rows, exactly the calls kernels.qdot8/qgemv make one by one), the indexer's Hadamard transform and FP4
 * simulation (`index_sim`: the float operations of ops/hadamard.py and ops/fp4_sim.py in their order, so their
 * bits), the greedy top-1 and margin of ops/verify_argmax.py (`verify_argmax`) and the indexer's top-k of
 * ops/indexer_topk.py (`indexer_topk`). Built with qgemv.c (-ffp-contract=off).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int (*rows_fn)(int, const uint8_t *, int64_t, const int64_t *, int64_t, int64_t, const void *, int64_t,
                       float *, int64_t, int64_t);
int pool_rows(rows_fn fn, int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N,
              int64_t K, const void *x, int64_t M, float *y, int64_t n, int64_t parts, int threads);   /* pool.c */
int q8_quantize(int kind, const float *x, int64_t M, int64_t K, void *out);                          /* qdot8.c */

typedef struct {        /* kernels.BoundArgs: one weight's arguments of its row kernel */
    rows_fn fn;         /* qgemv, or qdot8_rows under q8 */
    int64_t type;       /* the GGUF type number */
    const uint8_t *w;   /* the raw blocks [N, row bytes] */
    int64_t N, K;
    int64_t q8_kind;    /* -1: the float32 rows as they are; else q8_quantize's activation kind */
    int64_t q8_row_bytes;   /* bytes of one row rounded for that kind */
    int64_t expert_bytes;   /* a stack [E, N, row bytes]: bytes of one expert (row m takes expert experts[m]); 0: 2-D */
} bound_t;

static _Thread_local uint8_t *scratch;     /* this thread's rounded activations (kept between calls) */
static _Thread_local size_t scratch_bytes;

/* y [M, N] = the rows x [M, K] (float32) times the bound weight (row m times expert experts[m] of a stack), the
 * output rows cut into `parts` chunks on `threads` threads; the row kernel's return code, or -2 where the rounded
 * rows find no memory. */
int bound_product(const bound_t *b, const float *x, int64_t M, const int64_t *experts, float *y, int64_t parts,
                  int threads) {
    const void *rows = x;
    if (b->q8_kind >= 0) {
        size_t need = (size_t)(M * b->q8_row_bytes);
        if (need > scratch_bytes) {     /* 64-byte aligned, as torch's buffers */
            uint8_t *grown = aligned_alloc(64, (need + 63) / 64 * 64);
            if (!grown) return -2;
            free(scratch);
            scratch = grown;
            scratch_bytes = need;
        }
        if (q8_quantize((int)b->q8_kind, x, M, b->K, scratch)) return -1;
        rows = scratch;
    }
    return pool_rows(b->fn, (int)b->type, b->w, b->expert_bytes, experts, b->N, b->K, rows, M, y, b->N, parts,
                     threads);
}

/* out [rows, n] = fp4_sim(hadamard(x)) (either step may be off): the butterfly over strides 1, 2, ..., n/2 (a + b,
 * a - b), divided by `root` (float32 sqrt(n)); then per block of 32 the scale 2^ceil(log2(max(amax, 6 * 2^-126) /
 * 6)), log2 rounded to float32 first (so v a few ulp above 2^k gets 2^k, as torch's), and each value rounded to
 * the E2M1 grid (ties to even) times the scale. n a power of two (hadamard) and a
 * multiple of 32 (fp4). */
void index_sim(const float *x, int64_t n_rows, int64_t n, int hadamard, float root, int fp4, float *out) {
    const float floor_amax = 6.0f * 0x1p-126f;
    for (int64_t r = 0; r < n_rows; r++) {
        float *y = out + r * n;
        for (int64_t i = 0; i < n; i++) y[i] = x[r * n + i];
        if (hadamard) {
            for (int64_t h = 1; h < n; h *= 2)
                for (int64_t i = 0; i < n; i += 2 * h)
                    for (int64_t j = i; j < i + h; j++) {
                        float a = y[j], b = y[j + h];
                        y[j] = a + b;
                        y[j + h] = a - b;
                    }
            for (int64_t i = 0; i < n; i++) y[i] = y[i] / root;
        }
        if (!fp4) continue;
        for (int64_t s = 0; s < n; s += 32) {
            float amax = fabsf(y[s]);
            for (int i = 1; i < 32; i++) {
                float a = fabsf(y[s + i]);
                if (a > amax || isnan(a)) amax = isnan(amax) ? amax : a;     /* a NaN wins, as torch's amax */
            }
            if (amax < floor_amax) amax = floor_amax;
            float v = amax / 6.0f, scale = v;   /* NaN and Inf stay what they are (exp2(ceil(log2(v))) of them) */
            if (isfinite(v))    /* log2 rounded to float32 as torch's (not the exact ceiling just above 2^k) */
                scale = ldexpf(1.0f, (int)ceilf((float)log2((double)v)));
            for (int i = 0; i < 32; i++) {
                float q = y[s + i] / scale, a = fabsf(q);
                if (a > 6.0f) a = 6.0f;
                float step = a < 2.0f ? 0.5f : a < 4.0f ? 1.0f : 2.0f;
                y[s + i] = copysignf(rintf(a / step) * step, q) * scale;
            }
        }
    }
}

/* The largest of row[0..n) (its first index in *at) and the largest of the others (duplicates counted), where the
 * row holds no NaN; returns 0 where it holds one. One pass: each SIMD lane keeps its largest value, that value's
 * first index and its second largest (max(second, min(v, largest))); the lanes are then combined and the scalar tail
 * added in index order. Only comparisons, so the values are the row's own. */
static int top2(const float *row, int64_t n, int64_t *at, float *second) {
    float best = -INFINITY, next = -INFINITY;
    int64_t k = 0, where = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 m1 = _mm512_set1_ps(-INFINITY), m2 = m1;
        __m512i i1 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), idx = i1;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = 0;
        for (; k + 16 <= n; k += 16, idx = _mm512_add_epi32(idx, step)) {
            __m512 v = _mm512_loadu_ps(row + k);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            __mmask16 above = _mm512_cmp_ps_mask(v, m1, _CMP_GT_OQ);
            m2 = _mm512_max_ps(m2, _mm512_min_ps(v, m1));
            m1 = _mm512_max_ps(v, m1);
            i1 = _mm512_mask_mov_epi32(i1, above, idx);
        }
        if (unordered) return 0;
        float l1[16], l2[16];
        int32_t li[16];
        _mm512_storeu_ps(l1, m1);
        _mm512_storeu_ps(l2, m2);
        _mm512_storeu_si512(li, i1);
        int lane = 0;
        for (int l = 1; l < 16; l++)
            if (l1[l] > l1[lane] || (l1[l] == l1[lane] && li[l] < li[lane])) lane = l;
        best = l1[lane], where = li[lane], next = l2[lane];
        for (int l = 0; l < 16; l++) next = l != lane && l1[l] > next ? l1[l] : next;
    }
#endif
    for (; k < n; k++) {
        float v = row[k];
        if (v != v) return 0;
        if (k == 0) { best = v; continue; }         /* the first value: the largest so far (even -inf) */
        next = v < best ? (v > next ? v : next) : best > next ? best : next;
        if (v > best) best = v, where = k;
    }
    *at = where;
    *second = next;
    return 1;
}

/* Per row of logits [M, V] (V >= 2): the index of the largest value (the first one on ties; the first NaN where
 * a row holds one, as torch's argmax) and the largest minus the second largest, duplicates counted (torch.topk's
 * two values: 0 on a tie; NaN after a NaN, which topk ranks first), in one vectorized pass (`top2`). */
void verify_argmax(const float *logits, int64_t M, int64_t V, int64_t *top1, float *margin) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = logits + m * V;
        int64_t best = 0;
        float second;
        if (!top2(row, V, &best, &second)) {
            while (row[best] == row[best]) best++;
            top1[m] = best;
            margin[m] = NAN;
            continue;
        }
        top1[m] = best;
        margin[m] = row[best] - second;
    }
}

typedef struct {
    float score;
    int64_t index;
} ranked_t;

/* Descending score, a NaN above every number (torch's descending sort), ties to the lower index. */
static int by_rank(const void *pa, const void *pb) {
    const ranked_t *a = pa, *b = pb;
    int nan_a = isnan(a->score), nan_b = isnan(b->score);
    if (nan_a != nan_b) return nan_a ? -1 : 1;
    if (!nan_a && a->score != b->score) return a->score > b->score ? -1 : 1;
    return a->index < b->index ? -1 : a->index > b->index;
}

/* out [M, k]: per row of scores [M, n] the columns below visible[m] by descending score (ties: the lower column),
 * -1 after them (ops/indexer_topk.py). Returns -2 where the row's ranking finds no memory. */
int indexer_topk(const float *scores, int64_t M, int64_t n, int64_t k, const int64_t *visible, int64_t *out) {
    ranked_t *ranked = malloc((size_t)(n > 0 ? n : 1) * sizeof(ranked_t));
    if (!ranked) return -2;
    for (int64_t m = 0; m < M; m++) {
        int64_t seen = visible[m] < n ? visible[m] : n;
        if (seen < 0) seen = 0;
        for (int64_t j = 0; j < seen; j++) ranked[j] = (ranked_t){scores[m * n + j], j};
        qsort(ranked, (size_t)seen, sizeof(ranked_t), by_rank);
        for (int64_t s = 0; s < k; s++) out[m * k + s] = s < seen ? ranked[s].index : -1;
    }
    free(ranked);
    return 0;
}
