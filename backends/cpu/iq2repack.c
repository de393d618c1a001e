/* IQ2_XXS repacked at load for `--cpu-dot q8` (docs/cpu.md, "IQ2_XXS at several rows (session 15)"). A weight's
 * rows are taken 16 at a time (a group: 16 x row_bytes contiguous bytes, the same region before and after) and their
 * stored 66-byte blocks interleaved: block b of row n at (16 b + n) x 66. So a group's 16 rows are read as one stream
 * of memory, block after block, and the AMX tiles (qdot8amx.c, `qdot8amx_iq2_interleaved`) unpack one block of the
 * 16 rows at a time into buffers that stay in L1, instead of whole rows into L2 (the stored layout's 16 row streams
 * read block by block run slower); without the tiles, several rows gather a block's 16 rows into lanes (row n in
 * lane n) once for all rows (group_wide; docs/cpu.md, "Q4_K, Q2_K and IQ2_XXS at several rows without AMX (session
 * 16)"). Rows past the last whole group keep the stored layout (qdot8.c multiplies them). The arithmetic is qdot8.c's IQ2_XXS (ops/q8_activations.py): per row and block the exact bsum, then
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
 * dots (iq2_xxs_sums: no unpacked state kept; on AMD Zen iq2_xxs_chunk_sums against xo, the row's activation bytes
 * in chunk order, 256 a block), the 4 sums reduced together. */
static void group_row(const uint8_t *g, int64_t nb, const uint8_t *x, const int8_t *xo, float out[GROUP][GROUP]) {
    __m128 acc[GROUP / 4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
#if AMD_ZEN
        const int8_t *qs = xo + b * 256, *xb = (const int8_t *)(x + b * Q8K_BYTES);
#define SUMS iq2_xxs_chunk_sums
#else
        const int8_t *qs = (const int8_t *)(x + b * Q8K_BYTES), *xb = qs;
#define SUMS iq2_xxs_sums
        (void)xo;
#endif
        float dx;
        memcpy(&dx, xb + 256, 4);
        __m128 vdx = _mm_set1_ps(dx);
#pragma GCC unroll 4
        for (int q = 0; q < GROUP / 4; q++) {
            const uint8_t *wb = g + (b * GROUP + 4 * q) * QK_BYTES;
            uint16_t h[4];
            for (int i = 0; i < 4; i++) memcpy(&h[i], wb + QK_BYTES * i, 2);
            for (int i = 0; i < 5; i++) _mm_prefetch((const char *)wb + 64 * i + AHEAD, _MM_HINT_T0);
            __m128i sums = sum4_epi32(SUMS(wb, qs), SUMS(wb + QK_BYTES, qs), SUMS(wb + 2 * QK_BYTES, qs),
                                      SUMS(wb + 3 * QK_BYTES, qs));
            __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));
            acc[q] = _mm_add_ps(acc[q], _mm_mul_ps(_mm_mul_ps(d, vdx), _mm_cvtepi32_ps(sums)));
        }
    }
    for (int q = 0; q < GROUP / 4; q++) _mm_storeu_ps(out[0] + 4 * q, _mm_mul_ps(_mm_set1_ps(0.125f), acc[q]));
}
#undef SUMS

/* The 16 rows' 8 vectors of group j (32 values) of one interleaved block `gb`, each lane n row n's 4 values plus 64
 * (21..107, unsigned: the operand of `vpdpbusd`), the values' grid bytes and signs gathered lane by lane; scale[j]
 * lane n: row n's 2 ls + 1. */
static inline void group_lanes(const uint8_t *gb, int j, __m512i w[8], __m512i *scale) {
    const __m256i rows = _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(QK_BYTES));
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    __m512i rows0 = _mm512_i32gather_epi64(rows, gb + 2 + 8 * j, 1),     /* the group's 8 bytes of rows 0-7, 8-15 */
            rows8 = _mm512_i32gather_epi64(rows, gb + 8 * QK_BYTES + 2 + 8 * j, 1);
    __m512i index = _mm512_permutex2var_epi32(rows0, even, rows8),
            aux = _mm512_permutex2var_epi32(rows0, _mm512_add_epi32(even, _mm512_set1_epi32(1)), rows8);
    *scale = _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(aux, 28), 1), _mm512_set1_epi32(1));
    /* byte l of lane n: the 7-bit sign index of chunk l (aux bits 7 l ..; bit 7 of each byte ignored), looked up in
     * ksigns (with its parity bit: the chunk's 8 sign bits) */
    __m512i t = _mm512_mask_blend_epi8(0x2222222222222222ull, aux, _mm512_slli_epi32(aux, 1));
    t = _mm512_mask_blend_epi8(0x4444444444444444ull, t, _mm512_slli_epi32(aux, 2));
    t = _mm512_mask_blend_epi8(0x8888888888888888ull, t, _mm512_slli_epi32(aux, 3));
    __m512i signs = _mm512_permutex2var_epi8(_mm512_loadu_si512(iq2_ksigns_bytes), t,
                                             _mm512_loadu_si512(iq2_ksigns_bytes + 64));
    const __m512i bits_lo = _mm512_set1_epi32(0x08040201), bits_hi = _mm512_set1_epi32((int)0x80402010);
    for (int l = 0; l < 4; l++) {
        __m512i grid = _mm512_and_si512(_mm512_srli_epi32(index, 8 * l), _mm512_set1_epi32(255));
        __m512i sl = _mm512_shuffle_epi8(signs, _mm512_set4_epi32(0x01010101 * (12 + l), 0x01010101 * (8 + l),
                                                                  0x01010101 * (4 + l), 0x01010101 * l));   /* byte l */
        __m512i rows0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(grid), iq2_grid_bytes, 8),   /* 8 values */
                rows8 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(grid, 1), iq2_grid_bytes, 8);
        for (int h = 0; h < 2; h++) {       /* values 4 h .. 4 h + 3 of each row */
            const __m512i pick = _mm512_add_epi32(_mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4,
                                                                   2, 0), _mm512_set1_epi32(h));
            __m512i q = _mm512_permutex2var_epi32(rows0, pick, rows8);
            __mmask64 neg = _mm512_test_epi8_mask(sl, h ? bits_hi : bits_lo);
            w[2 * l + h] = _mm512_add_epi8(_mm512_mask_sub_epi8(q, neg, _mm512_setzero_si512(), q), _mm512_set1_epi8(64));
        }
    }
}

/* One group (16 rows, nb interleaved blocks at g) against M activation rows x (M >= 2): out[m][n]. Per
 * block and group of 32 values the 16 rows' values are gathered once into lanes (group_lanes) and serve every row's
 * 8 `vpdpbusd` (16 weight rows at once); the group's dot times its scale is added to the row's bsum in int32, less
 * 64 (2 ls + 1) times the activation's sum over the group (the +64 of the values, from the Q8_K bsums by
 * `vpdpwssd`); the float steps are the one-row kernel's, (d_w d_x) bsum in block order and 0.125 acc. */
static void group_wide(const uint8_t *g, int64_t nb, const uint8_t *x, int64_t M, float out[GROUP][GROUP]) {
    __m512 acc[GROUP];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g + b * GROUP * QK_BYTES;
        for (int off = 0; off < GROUP * QK_BYTES; off += 64) _mm_prefetch((const char *)gb + off + AHEAD, _MM_HINT_T0);
        __m512i isum[GROUP], scale[8];
        for (int j = 0; j < 8; j++) {
            __m512i w[8];
            group_lanes(gb, j, w, &scale[j]);
            for (int64_t m = 0; m < M; m++) {
                const int32_t *xv = (const int32_t *)(x + (m * nb + b) * Q8K_BYTES + 32 * j);
                __m512i d0 = _mm512_setzero_si512(), d1 = d0;
                for (int v = 0; v < 8; v += 2) {
                    d0 = _mm512_dpbusd_epi32(d0, w[v], _mm512_set1_epi32(xv[v]));
                    d1 = _mm512_dpbusd_epi32(d1, w[v + 1], _mm512_set1_epi32(xv[v + 1]));
                }
                __m512i t = _mm512_mullo_epi32(_mm512_add_epi32(d0, d1), scale[j]);
                isum[m] = j ? _mm512_add_epi32(isum[m], t) : t;
            }
        }
        __m512i pairs[4];       /* lane n: row n's scales of groups 2 i, 2 i + 1 as an int16 pair */
        for (int i = 0; i < 4; i++) pairs[i] = _mm512_or_si512(scale[2 * i], _mm512_slli_epi32(scale[2 * i + 1], 16));
        const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(QK_BYTES));
        __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(rows, gb, 1)));
        for (int64_t m = 0; m < M; m++) {
            const uint8_t *xb = x + (m * nb + b) * Q8K_BYTES;
            int32_t sums[4];        /* the activation's sums over groups 2 i, 2 i + 1 (bsums pairs), int16 pairs */
            _mm_storeu_si128((__m128i *)sums, _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(xb + 260)),
                                                              _mm_loadu_si128((const __m128i *)(xb + 276))));
            __m512i offset = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) offset = _mm512_dpwssd_epi32(offset, pairs[i], _mm512_set1_epi32(sums[i]));
            __m512i bsum = _mm512_sub_epi32(isum[m], _mm512_slli_epi32(offset, 6));
            float dx;
            memcpy(&dx, xb + 256, 4);
            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(bsum)));
        }
    }
    for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(out[m], _mm512_mul_ps(_mm512_set1_ps(0.125f), acc[m]));
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
    int8_t *xo = NULL;          /* one row's activation bytes in chunk order (group_row on AMD Zen) */
    if (IQ2R_VECTOR && AMD_ZEN && !on_tiles && (own || rows == 1) && (xo = malloc((size_t)nb * 256)) == NULL) {
        free(tiles);
        free(row);
        free(xs);
        return -2;
    }
    for (int64_t i = 0; i < (own ? rows : 1) && rc == 0; i++) {    /* each row with a weight of its own, or all */
        const uint8_t *wi = own ? w + experts[live[i]] * expert_bytes : w, *xi = own ? (xs ? xs : x) + i * x_bytes : x;
        int64_t mi = own ? 1 : rows;
        float *yi = own ? y + live[i] * N : y;
#if IQ2R_VECTOR && AMD_ZEN
        for (int64_t b = 0; xo != NULL && b < nb; b++) iq2_chunk_order((const int8_t *)xi + b * Q8K_BYTES, xo + b * 256);
#endif
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
            if (mi == 1) group_row(wi + first * row_bytes, nb, xi, xo, out);
            else group_wide(wi + first * row_bytes, nb, xi, mi, out);
#else
            rc = group_rows_c(wi + first * row_bytes, nb, xi, mi, out, row);
#endif
            for (int64_t m = 0; m < mi; m++)
                for (int64_t n = first < n0 ? n0 : first; n < first + GROUP && n < n1; n++)
                    yi[m * N + n] = out[m][n - first];
        }
    }
    free(xo);
    free(tiles);
    free(row);
    free(xs);
    return rc;
}
