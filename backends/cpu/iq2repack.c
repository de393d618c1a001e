/* IQ2_XXS repacked at load for `--cpu-dot q8` (docs/cpu.md, "IQ2_XXS at several rows (session 15)"). A weight's
 * rows are taken 16 at a time (a group: 16 x row_bytes contiguous bytes, the same region before and after) and their
 * stored 66-byte blocks interleaved: block b of row n at (16 b + n) x 66. So a group's 16 rows are read as one stream
 * of memory, block after block, and the AMX tiles (qdot8amx.c, `qdot8amx_iq2_interleaved`) unpack one block of the
 * 16 rows at a time into buffers that stay in L1, instead of whole rows into L2 (the stored layout's 16 row streams
 * read block by block run slower). Rows past the last whole group keep the stored layout (qdot8.c multiplies them).
 * The arithmetic is qdot8.c's IQ2_XXS (ops/q8_activations.py): per row and block the exact bsum, then
 * acc += (d_w d_x) bsum in block order and 0.125 acc, so every output has qdot8's bits for any M and any split of
 * the rows. Built with qgemv.c by backends/cpu/kernels.py.
 */
#include "half.h"
#include "repack.h"

#define QK_BYTES 66         /* a stored IQ2_XXS block */
#define Q8K_BYTES 320       /* q8_quantize's Q8_K block: int8 qs[256], float d, int16 bsums[16], padding */
#define IQ2R_TYPE 1016      /* the repacked layout's type code in the kernel library (no GGUF type) */
#define AHEAD 2048          /* bytes of the group's stream prefetched ahead (measured: 512, 1, 2, 4, 8 KB) */

/* One group's nb blocks: `from` (16 stored rows of nb blocks) into `to` (interleaved), or back (`back`). */
static void group_pack(const uint8_t *from, uint8_t *to, int64_t nb, int back) {
    int64_t row_bytes = nb * QK_BYTES;
    for (int64_t b = 0; b < nb; b++)
        for (int n = 0; n < GROUP; n++) {
            int64_t stored = n * row_bytes + b * QK_BYTES, interleaved = (b * GROUP + n) * QK_BYTES;
            memcpy(to + (back ? stored : interleaved), from + (back ? interleaved : stored), QK_BYTES);
        }
}

/* Rewrite the whole groups of a [N, K] IQ2_XXS weight in place (repack.h's repack_groups). */
int iq2r_repack(uint8_t *w, int64_t N, int64_t K, int back) {
    return repack_groups(w, N, K, back, 256, QK_BYTES, group_pack);
}

int qdot8amx_iq2_interleaved(const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                             int64_t n0, int64_t n1);      /* qdot8amx.c: whole groups on the tiles */

static int amx_rows_from = 4;       /* the fewest rows that take the AMX tiles (iq2r_amx_from; measured, docs/cpu.md) */

/* Sets the fewest rows that take the tiles (`from` >= 2; 17: never) and returns it. */
int iq2r_amx_from(int from) {
    if (from >= 2) amx_rows_from = from;
    return amx_rows_from;
}

#if REPACK_VNNI && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#include "iq2_xxs_groups.h"
#define IQ2R_VECTOR 1

static inline __m128i sum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {     /* lane i: the sum of argument i */
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* One group against one activation row: out[0][n], each block of 4 rows at a time by qdot8.c's one-row integer
 * dots (iq2_xxs_sums: no unpacked state kept), the 4 sums reduced together. */
static void group_row(const uint8_t *g, int64_t nb, const uint8_t *x, float out[GROUP][GROUP]) {
    __m128 acc[GROUP / 4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *qs = (const int8_t *)(x + b * Q8K_BYTES);
        float dx;
        memcpy(&dx, qs + 256, 4);
        __m128 vdx = _mm_set1_ps(dx);
#pragma GCC unroll 4
        for (int q = 0; q < GROUP / 4; q++) {
            const uint8_t *wb = g + (b * GROUP + 4 * q) * QK_BYTES;
            uint16_t h[4];
            for (int i = 0; i < 4; i++) memcpy(&h[i], wb + QK_BYTES * i, 2);
            for (int i = 0; i < 5; i++) _mm_prefetch((const char *)wb + 64 * i + AHEAD, _MM_HINT_T0);
            __m128i sums = sum4_epi32(iq2_xxs_sums(wb, qs), iq2_xxs_sums(wb + QK_BYTES, qs),
                                      iq2_xxs_sums(wb + 2 * QK_BYTES, qs), iq2_xxs_sums(wb + 3 * QK_BYTES, qs));
            __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));
            acc[q] = _mm_add_ps(acc[q], _mm_mul_ps(_mm_mul_ps(d, vdx), _mm_cvtepi32_ps(sums)));
        }
    }
    for (int q = 0; q < GROUP / 4; q++) _mm_storeu_ps(out[0] + 4 * q, _mm_mul_ps(_mm_set1_ps(0.125f), acc[q]));
}

/* One group (16 rows, nb interleaved blocks at g) against M activation rows x: out[m][n]. Per block, 4 weight rows
 * at a time: each block unpacked once (iq2_xxs_unpack), its integer dot with every row (iq2_xxs_row), the 4 rows'
 * sums reduced together and their float terms taken lane by lane as qdot8.c's dot_iq2_xxs (d_w d_x) bsum. */
static void group_rows(const uint8_t *g, int64_t nb, const uint8_t *x, int64_t M, float out[GROUP][GROUP]) {
    if (M == 1) {
        group_row(g, nb, x, out);
        return;
    }
    __m128 acc[GROUP][GROUP / 4];
    for (int64_t m = 0; m < M; m++)
        for (int q = 0; q < GROUP / 4; q++) acc[m][q] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int q = 0; q < GROUP / 4; q++) {
            const uint8_t *wb = g + (b * GROUP + 4 * q) * QK_BYTES;
            uint16_t h[4];
            for (int i = 0; i < 4; i++) memcpy(&h[i], wb + QK_BYTES * i, 2);
            for (int i = 0; i < 5; i++) _mm_prefetch((const char *)wb + 64 * i + AHEAD, _MM_HINT_T0);
            __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));
            iq2_xxs_unpacked u[4];
            for (int i = 0; i < 4; i++) iq2_xxs_unpack(wb + QK_BYTES * i, &u[i]);
            for (int64_t m = 0; m < M; m++) {
                const int8_t *qs = (const int8_t *)(x + (m * nb + b) * Q8K_BYTES);
                float dx;
                memcpy(&dx, qs + 256, 4);
                __m128i sums = sum4_epi32(iq2_xxs_row(&u[0], qs), iq2_xxs_row(&u[1], qs), iq2_xxs_row(&u[2], qs),
                                          iq2_xxs_row(&u[3], qs));
                acc[m][q] = _mm_add_ps(acc[m][q], _mm_mul_ps(_mm_mul_ps(d, _mm_set1_ps(dx)), _mm_cvtepi32_ps(sums)));
            }
        }
    for (int64_t m = 0; m < M; m++)
        for (int q = 0; q < GROUP / 4; q++) _mm_storeu_ps(out[m] + 4 * q, _mm_mul_ps(_mm_set1_ps(0.125f), acc[m][q]));
}
#else
#define IQ2R_VECTOR 0
/* One group against M activation rows, plain C: each row's blocks gathered back into the stored layout (row, nb x 66
 * bytes) and multiplied by qdot8. */
static int group_rows_c(const uint8_t *g, int64_t nb, const uint8_t *x, int64_t M, float out[GROUP][GROUP],
                        uint8_t *row) {
    float y[GROUP];
    for (int n = 0; n < GROUP; n++) {
        for (int64_t b = 0; b < nb; b++) memcpy(row + b * QK_BYTES, g + (b * GROUP + n) * QK_BYTES, QK_BYTES);
        int rc = qdot8(16, row, 0, NULL, 1, nb * 256, x, M, y, 0, 1);
        if (rc) return rc;
        for (int64_t m = 0; m < M; m++) out[m][n] = y[m];
    }
    return 0;
}
#endif

/* Whether the kernels here are the vector ones (AVX-512 VNNI, VBMI, BITALG), else the plain C loop (slower than
 * qdot8.c's on the stored layout: a weight is worth repacking only where this is 1). */
int iq2r_vector(void) {
    return IQ2R_VECTOR;
}

/* y [M, N] rows [n0, n1) = x @ W.T for an IQ2_XXS weight whose whole groups iq2r_repack interleaved (type IQ2R_TYPE),
 * the activations `xq` from q8_quantize kind 0; the arguments as qdot8's (experts: row m uses the weight at
 * w + experts[m] * expert_bytes, experts[m] < 0 gives 0). A group cut by [n0, n1) is computed whole and only its
 * rows inside stored. Returns -1 for a call it cannot serve, -2 out of memory. */
int iq2r_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
              const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (type != IQ2R_TYPE || K % 256 || M < 1 || M > GROUP) return -1;
    const uint8_t *x = xq;
    int64_t nb = K / 256, row_bytes = nb * QK_BYTES, x_bytes = nb * Q8K_BYTES;
    int rc = stored_rows(16, w, expert_bytes, experts, N, K, xq, M, y, n0, &n1);     /* past the last group */
    if (rc) return rc;
    int own = experts != NULL;
    int64_t live[GROUP], rows = live_rows(experts, M, y, N, n0, n1, live);
    if (rows == 0 || n0 >= n1) return 0;
    uint8_t *xs = NULL;         /* the live rows' activations together, where some rows have no expert */
    if (rows < M && (xs = live_activations(x, live, rows, x_bytes)) == NULL) return -2;
    int64_t a0 = n0 / GROUP, a1 = (n1 + GROUP - 1) / GROUP, width = (a1 - a0) * GROUP;
    float *tiles = NULL;        /* the tiles' outputs [M, width]: whole groups [a0, a1) (only [n0, n1) are y's) */
    uint8_t *row = NULL;        /* the plain C loop's stored row */
    int on_tiles = IQ2R_VECTOR && path_for(own ? 1 : rows, amx_rows_from) == 2;
    if ((on_tiles && (tiles = malloc((size_t)(rows * width) * 4)) == NULL) ||
        (!IQ2R_VECTOR && (row = malloc((size_t)row_bytes)) == NULL)) {
        free(xs);
        return -2;
    }
    for (int64_t i = 0; i < (own ? rows : 1) && rc == 0; i++) {    /* each row with a weight of its own, or all */
        const uint8_t *wi = own ? w + experts[live[i]] * expert_bytes : w, *xi = own ? (xs ? xs : x) + i * x_bytes : x;
        int64_t mi = own ? 1 : rows;
        float *yi = own ? y + live[i] * N : y;
        if (tiles != NULL) {
            rc = qdot8amx_iq2_interleaved(wi + a0 * GROUP * row_bytes, width, K, xi, mi, tiles, 0, width);
            for (int64_t m = 0; m < mi && rc == 0; m++)
                memcpy(yi + m * N + n0, tiles + m * width + n0 - a0 * GROUP, (size_t)(n1 - n0) * 4);
            continue;
        }
        for (int64_t a = a0; a < a1 && rc == 0; a++) {
            int64_t first = a * GROUP;
            float out[GROUP][GROUP];
#if IQ2R_VECTOR
            group_rows(wi + first * row_bytes, nb, xi, mi, out);
#else
            rc = group_rows_c(wi + first * row_bytes, nb, xi, mi, out, row);
#endif
            for (int64_t m = 0; m < mi; m++)
                for (int64_t n = first < n0 ? n0 : first; n < first + GROUP && n < n1; n++)
                    yi[m * N + n] = out[m][n - first];
        }
    }
    free(tiles);
    free(row);
    free(xs);
    return rc;
}
