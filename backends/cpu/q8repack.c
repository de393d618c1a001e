/* Q8_0 repacked at load for `--cpu-dot q8` (docs/cpu.md, "Several rows within 1.3x: Q4_K and Q8_0 (session 14)"),
 * as llama.cpp's AMX path lays it out. A weight's rows are taken 16 at a time (a group: 16 x row_bytes contiguous
 * bytes, the same region before and after), and each pair of blocks of the group's 16 rows (2 x 16 x 34 = 1088
 * bytes) becomes
 *
 *   [0, 512), [512, 1024)       the two blocks' values: 64-byte vector k (k = 0..7) of a block holds in bytes
 *                               4 n .. 4 n + 3 row n's values 4 k .. 4 k + 3;
 *   [1024, 1056), [1056, 1088)  the two blocks' 16 scales d (f16), row n at 2 n
 *
 * (a last odd block alone: its values, then its scales; values_at, scales_at). So the same bytes hold the same
 * numbers (no memory grows), the 16 rows' scales are one vector, and a block's 512 value bytes are at once the operand
 * of `vpdpbusd` against 4 activation bytes broadcast (16 weight rows' dots) and an AMX B tile (8 rows of 16 weight rows
 * x 4 values) read in address order. Rows past the last whole group keep the stored
 * layout (qdot8.c multiplies them). The arithmetic is qdot8.c's Q8_0 (ops/q8_activations.py, llama.cpp's generic
 * ggml_vec_dot_q8_0_q8_0): per row pair acc = acc + (d_w d_x) isum block after block, isum the block's exact integer
 * dot, so every output has qdot8's bits, for any M and any split of the rows. Built with qgemv.c by
 * backends/cpu/kernels.py.
 */
#include "half.h"
#include "repack.h"

#define STREAMS 4           /* groups read at once (more or fewer measured no faster) */
#define Q8_0_BYTES 34       /* a stored Q8_0 block: f16 d, 32 int8 */
#define GB (GROUP * Q8_0_BYTES)     /* a group's block: 544 bytes */
#define XB 36               /* q8_quantize's Q8_0 activation block: float d, 32 int8 */
#define Q8R_TYPE 1008       /* the repacked layout's type code in the kernel library (no GGUF type) */

/* Where block b (of nb) of a group keeps its 512 value bytes and its 16 scales: blocks go in pairs of 1088 bytes,
 * the two blocks' values (64-byte aligned where the group is) then their scales; a last odd block alone. */
static inline int64_t values_at(int64_t b) { return b / 2 * 2 * GB + b % 2 * 512; }
static inline int64_t scales_at(int64_t b, int64_t nb) {
    return b / 2 * 2 * GB + (b / 2 * 2 + 1 < nb ? 1024 : 512) + b % 2 * 32;
}

/* One group's nb blocks: `from` (16 stored rows of nb blocks) into `to` (the repacked layout), or back (`back`). */
static void group_pack(const uint8_t *from, uint8_t *to, int64_t nb, int back) {
    int64_t row_bytes = nb * Q8_0_BYTES;
    for (int64_t b = 0; b < nb; b++)
        for (int n = 0; n < GROUP; n++) {
            const uint8_t *g = back ? from : to;
            const uint8_t *stored = back ? to + n * row_bytes + b * Q8_0_BYTES : from + n * row_bytes + b * Q8_0_BYTES;
            uint8_t *dst_d = back ? (uint8_t *)stored : (uint8_t *)g + scales_at(b, nb) + 2 * n;
            const uint8_t *src_d = back ? g + scales_at(b, nb) + 2 * n : stored;
            memcpy(dst_d, src_d, 2);
            for (int k = 0; k < 8; k++) {
                uint8_t *dst = back ? (uint8_t *)stored + 2 + 4 * k : (uint8_t *)g + values_at(b) + 64 * k + 4 * n;
                const uint8_t *src = back ? g + values_at(b) + 64 * k + 4 * n : stored + 2 + 4 * k;
                memcpy(dst, src, 4);
            }
        }
}

/* Rewrite the whole groups of a [N, K] Q8_0 weight in place (repack.h's repack_groups). */
int q8r_repack(uint8_t *w, int64_t N, int64_t K, int back) {
    return repack_groups(w, N, K, back, 32, Q8_0_BYTES, group_pack);
}

#if !REPACK_VNNI
/* One group (16 weight rows at `g`, nb repacked blocks) against one activation row `x`: out[n], plain C. */
static void group_row_c(const uint8_t *g, int64_t nb, const uint8_t *x, float out[GROUP]) {
    for (int n = 0; n < GROUP; n++) out[n] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *xb = x + b * XB;
        const int8_t *qs = (const int8_t *)(xb + 4);
        float dx;
        memcpy(&dx, xb, 4);
        for (int n = 0; n < GROUP; n++) {
            int32_t isum = 0;
            for (int v = 0; v < 32; v++) isum += (int8_t)g[values_at(b) + 64 * (v / 4) + 4 * n + v % 4] * qs[v];
            out[n] = out[n] + (f16_to_f32(g + scales_at(b, nb) + 2 * n) * dx) * (float)isum;
        }
    }
}
#endif

#if REPACK_VNNI

#define AHEAD 2048      /* bytes of each stream prefetched ahead (1024..8192 and the T1 hint measured no better); the
                         * four streams of up to 5 rows by STREAM_HINT (repack.h) */
#define STREAM_BYTES (1 << 20)  /* outputs at least this large are written around the cache (whole groups): their
                                 * line fills stalled the stores (docs/cpu.md, session 14) */

/* Block b (of nb) of G groups (1..4) against R activation rows (R = 1..4; row r's blocks at x[r], 128 sum(x) of its
 * blocks at sx[r]): `(w + 128) . x` by `vpdpbusd` with 4 activation bytes broadcast, less 128 sum(x); the groups'
 * value vectors taken a line of each group in turn (the G streams read a line at a time each, as qdot8.c reads its
 * four rows: whole 544-byte blocks of one group after another measured 2-5% slower at M = 1 on 35.7 MB weights),
 * each line prefetched once, AHEAD bytes ahead in its stream, and loaded once for the R rows; adds each row's term
 * to acc[i][m + r] (lane n: group i, weight row n). */
static inline __attribute__((always_inline)) void blocks_rows(const int G, const int R, const uint8_t *const *g,
        int64_t b, int64_t nb, const uint8_t *const *x, const int32_t *const *sx, __m512 (*acc)[GROUP], int64_t m) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i s[4][4];
    const int64_t v = values_at(b), d = scales_at(b, nb);
    for (int i = 0; i < G; i++)
        for (int r = 0; r < R; r++) s[i][r] = _mm512_set1_epi32(-sx[r][b]);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        __m512i xk[4];
        for (int r = 0; r < R; r++) {
            int32_t x0;
            memcpy(&x0, x[r] + b * XB + 4 + 4 * k, 4);
            xk[r] = _mm512_set1_epi32(x0);
        }
        for (int i = 0; i < G; i++) {
            _mm_prefetch((const char *)g[i] + v + 64 * k + AHEAD, STREAM_HINT);
            __m512i q = _mm512_xor_si512(_mm512_loadu_si512(g[i] + v + 64 * k), flip);
            for (int r = 0; r < R; r++) s[i][r] = _mm512_dpbusd_epi32(s[i][r], q, xk[r]);
        }
    }
    for (int i = 0; i < G; i++) {
        if (b % 2 || b + 1 == nb) _mm_prefetch((const char *)g[i] + d + AHEAD, STREAM_HINT);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g[i] + d)));
        for (int r = 0; r < R; r++) {
            float dx;
            memcpy(&dx, x[r] + b * XB, 4);
            __m512 isum = _mm512_cvtepi32_ps(s[i][r]);
            acc[i][m + r] = _mm512_add_ps(acc[i][m + r], _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), isum));
        }
    }
}

/* G groups (1..4: as many streams of the weight fetched at once, as qdot8.c's own_rows4_q8) against M activation
 * rows, block after block, four activation rows at a time (the rest 1..3 at a time); acc[i][m] lane n: group i,
 * activation row m, weight row n. */
static inline __attribute__((always_inline)) void groups_rows(const int G, const uint8_t *const *g, int64_t nb,
        const uint8_t *x, const int32_t *sx, int64_t M, __m512 (*acc)[GROUP]) {
    const uint8_t *xs[GROUP];
    const int32_t *ss[GROUP];
    for (int64_t m = 0; m < M; m++) xs[m] = x + m * nb * XB, ss[m] = sx + m * nb;
    for (int i = 0; i < G; i++)
        for (int64_t m = 0; m < M; m++) acc[i][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) blocks_rows(G, 4, g, b, nb, xs + m, ss + m, acc, m);
        switch (M - m) {
        case 3: blocks_rows(G, 3, g, b, nb, xs + m, ss + m, acc, m); break;
        case 2: blocks_rows(G, 2, g, b, nb, xs + m, ss + m, acc, m); break;
        case 1: blocks_rows(G, 1, g, b, nb, xs + m, ss + m, acc, m); break;
        default: break;
        }
    }
}

/* 128 sum(x) of every activation block (vpdpbusd's offset for the weight's values + 128). */
static void block_sums(const uint8_t *x, int64_t blocks, int32_t *sx) {
    for (int64_t i = 0; i < blocks; i++) {
        __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(x + i * XB + 4)),
                                     _mm256_set1_epi8((char)0x80));
        __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
        __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        sx[i] = 128 * ((int32_t)(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128);
    }
}

#if REPACK_AMX

/* One block's float steps from its tile sums (M x 16, dense): acc[m] = acc[m] + (d_w d_x) isum. */
static inline void block_steps(const uint8_t *g, int64_t b, int64_t nb, const uint8_t *xb, int64_t ldx, int64_t M,
                               const int32_t *sums, __m512 *acc) {
    __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + scales_at(b, nb))));
    const uint8_t *gb = g + b * GB;
    for (int off = 0; off < GB; off += 64) _mm_prefetch((const char *)gb + off + AHEAD, _MM_HINT_T0);
    for (int64_t m = 0; m < M; m++) {
        float dx;
        memcpy(&dx, xb + m * ldx, 4);
        __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + GROUP * m));
        acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), isum));
    }
}

/* G groups (1 or 4) against M activation rows on the tiles: per block one `tdpbssd` per group (the activations'
 * block as A, read in place with the row stride once per block; each group's block as B, in address order), each
 * issued two products before its float steps; acc as groups_rows'. */
static inline __attribute__((always_inline)) void groups_tiles(const int G, const uint8_t *const *g, int64_t nb,
        const uint8_t *x, int64_t M, __m512 (*acc)[GROUP]) {
    int32_t sums[4][GROUP * GROUP] __attribute__((aligned(64)));
    const int64_t ldx = nb * XB;
    for (int i = 0; i < G; i++)
        for (int64_t m = 0; m < M; m++) acc[i][m] = _mm512_setzero_ps();
#define ISSUE(b, i, ta, tb, tc) if ((b) < nb && (i) < G) { if ((i) == 0) _tile_loadd(ta, x + (b) * XB + 4, ldx); \
        _tile_loadd(tb, g[i] + values_at(b), 64); _tile_zero(tc); _tile_dpbssd(tc, ta, tb); }
#define RETIRE(b, i, tc) if ((b) >= 0 && (b) < nb && (i) < G) { _tile_stored(tc, sums[i], 64); \
        block_steps(g[i], b, nb, x + (b) * XB, ldx, M, sums[i], acc[i]); }
    if (G == 1) {           /* one group: blocks b + 2 and b + 3 issued before b and b + 1 retire */
        for (int64_t b = 0; b < nb + 2; b += 4) {
            ISSUE(b, 0, 0, 2, 4) RETIRE(b - 2, 0, 6)
            ISSUE(b + 1, 0, 1, 3, 5) RETIRE(b - 1, 0, 7)
            ISSUE(b + 2, 0, 0, 2, 6) RETIRE(b, 0, 4)
            ISSUE(b + 3, 0, 1, 3, 7) RETIRE(b + 1, 0, 5)
        }
    } else {
        for (int64_t b = 0; b < nb; b += 2) {
            ISSUE(b, 0, 0, 2, 4) RETIRE(b - 1, 2, 6)
            ISSUE(b, 1, 0, 3, 5) RETIRE(b - 1, 3, 7)
            ISSUE(b, 2, 0, 2, 6) RETIRE(b, 0, 4)
            ISSUE(b, 3, 0, 3, 7) RETIRE(b, 1, 5)
            ISSUE(b + 1, 0, 1, 2, 4) RETIRE(b, 2, 6)
            ISSUE(b + 1, 1, 1, 3, 5) RETIRE(b, 3, 7)
            ISSUE(b + 1, 2, 1, 2, 6) RETIRE(b + 1, 0, 4)
            ISSUE(b + 1, 3, 1, 3, 7) RETIRE(b + 1, 1, 5)
        }
        if (nb % 2 == 0) {
            RETIRE(nb - 1, 2, 6)
            RETIRE(nb - 1, 3, 7)
        }
    }
#undef ISSUE
#undef RETIRE
}
#endif
#endif

REPACK_SWITCHES(q8r, 6)

/* y [M, N] rows [n0, n1) of a repacked weight for any M (`experts` NULL): four groups at a time (a, a + q, a + 2q,
 * a + 3q; the last ones alone) against the rows 16 at a time, so each group is read from memory once whatever M (its
 * blocks from the cache for the later rows); the rows past the last whole group through qdot8, 16 at a time. Tiles
 * (AMX) only where M <= 16. */
static int all_rows(const uint8_t *w, int64_t N, int64_t K, const uint8_t *x, int64_t M, float *y, int64_t n0,
                    int64_t n1) {
    int64_t nb = K / 32, row_bytes = nb * Q8_0_BYTES;
    for (int64_t m = 0; m < M && n1 > N / GROUP * GROUP; m += GROUP) {       /* past the last group */
        int64_t end = n1;
        int rc = stored_rows(8, w, 0, NULL, N, K, x + m * nb * XB, M - m < GROUP ? M - m : GROUP, y + m * N, n0, &end);
        if (rc) return rc;
    }
    if (n1 > N / GROUP * GROUP) n1 = N / GROUP * GROUP;
    if (n0 >= n1) return 0;
#if REPACK_VNNI
    int32_t *sx = NULL;
    int stream = M * N * (int64_t)sizeof(float) >= STREAM_BYTES;
#if REPACK_AMX
    int tiles = M <= GROUP && M >= amx_rows_from && qdot8amx_on(-1);
    if (tiles) tiles_for_32(M);
    else
#endif
    {
        sx = malloc((size_t)(M * nb) * sizeof *sx);
        if (sx == NULL) return -2;
        block_sums(x, M * nb, sx);
    }
#endif
    int64_t a0 = n0 / GROUP, a1 = (n1 + GROUP - 1) / GROUP, q = (a1 - a0) / STREAMS;
    for (int64_t a = a0; a < a1; a++) {
        if (a >= a0 + q && a < a0 + STREAMS * q) continue;
        int G = a < a0 + q ? STREAMS : 1;
        const uint8_t *g[8];
        for (int i = 0; i < STREAMS; i++) g[i] = w + (a + i * q) * GROUP * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
            int64_t rows = M - m0 < GROUP ? M - m0 : GROUP;
            const uint8_t *xm = x + m0 * nb * XB;
            float *ym = y + m0 * N, out[8][GROUP][GROUP];
#if REPACK_VNNI
            __m512 acc[8][GROUP];
#if REPACK_AMX
            if (tiles && G == 4) groups_tiles(4, g, nb, xm, rows, acc);
            else if (tiles) groups_tiles(1, g, nb, xm, rows, acc);
            else
#endif
            if (G == STREAMS) groups_rows(STREAMS, g, nb, xm, sx + m0 * nb, rows, acc);
            else groups_rows(1, g, nb, xm, sx + m0 * nb, rows, acc);
#endif
            for (int i = 0; i < G; i++) {
                int64_t first = (a + i * q) * GROUP;
                int whole_group = first >= n0 && first + GROUP <= n1;
                for (int64_t m = 0; m < rows; m++) {
#if REPACK_VNNI
                    float *to = whole_group ? ym + m * N + first : out[i][m];
                    if (stream && whole_group && ((uintptr_t)to & 63) == 0) _mm512_stream_ps(to, acc[i][m]);
                    else _mm512_storeu_ps(to, acc[i][m]);
#else
                    group_row_c(g[i], nb, xm + m * nb * XB, whole_group ? ym + m * N + first : out[i][m]);
#endif
                    for (int64_t n = first < n0 ? n0 : first; !whole_group && n < first + GROUP && n < n1; n++)
                        ym[m * N + n] = out[i][m][n - first];
                }
            }
        }
    }
#if REPACK_AMX
    if (tiles) _tile_release();
#endif
#if REPACK_VNNI
    if (stream) _mm_sfence();       /* the streamed outputs ordered before the caller's (or the pool's) next store */
    free(sx);
#endif
    return 0;
}

/* y [M, N] rows [n0, n1) = x @ W.T for a Q8_0 weight whose whole groups q8r_repack rewrote (type Q8R_TYPE), the
 * activations `xq` from q8_quantize kind 1; the arguments as qdot8's: with `experts`, row m against the weight
 * experts[m] of a stack (expert_bytes apart; -1: another rank's, 0), each as a one-row call (the grouped output
 * projection's groups, each N rows of whole groups). A group cut by [n0, n1) is computed whole and only its rows
 * inside stored. Returns -1 for a call it cannot serve, -2 out of memory. */
int q8r_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
             const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (type != Q8R_TYPE || K % 32 || M < 1 || M > GROUP) return -1;
    const uint8_t *x = xq;
    int64_t nb = K / 32;
    for (int64_t m = 0; experts != NULL && m < M; m++) {
        int rc = experts[m] < 0 ? 0 : q8r_rows(type, w + experts[m] * expert_bytes, 0, NULL, N, K, x + m * nb * XB, 1,
                                               y + m * N, n0, n1);
        for (int64_t n = n0; experts[m] < 0 && n < n1; n++) y[m * N + n] = 0.0f;
        if (rc) return rc;
    }
    return experts != NULL ? 0 : all_rows(w, N, K, x, M, y, n0, n1);
}

/* q8r_rows for any number of rows (prefill's products; no `experts`): each group read from memory once for all rows
 * (all_rows), where q8r_rows on 16 rows at a time reads the weight once per 16 rows; the same bits. On a CPU with the
 * AMX tiles on, 16 rows at a time through q8r_rows (its tiles). */
int q8r_gemm(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
             const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (type != Q8R_TYPE || K % 32 || M < 1 || experts != NULL) return -1;
    const uint8_t *x = xq;
    if (!(REPACK_AMX && qdot8amx_on(-1))) return all_rows(w, N, K, x, M, y, n0, n1);
    for (int64_t m = 0; m < M; m += GROUP) {
        int rc = q8r_rows(type, w, expert_bytes, NULL, N, K, x + m * (K / 32) * XB, M - m < GROUP ? M - m : GROUP,
                          y + m * N, n0, n1);
        if (rc) return rc;
    }
    return 0;
}
