/* Q2_K repacked at load for `--cpu-dot q8` (docs/cpu.md, "Several rows within 1.3x: Q2_K and IQ2_XXS (session 14)").
 * A weight's rows are taken 16 at a time (a group: 16 x row_bytes contiguous bytes, the same region before and
 * after), and each block of the group's 16 rows (16 x 84 = 1344 bytes) is rewritten as
 *
 *   [0, 32)      the 16 rows' d (f16), [32, 64) their dmin (f16);
 *   [64, 320)    the 256 scale bytes as stored (low nibble the scale, high nibble the min of a group of 16 values):
 *                byte 64 + 32 p + 2 n + t = row n's byte of group 2 p + t;
 *   [320, 1344)  the 2-bit fields: 64-byte vector v holds in bytes 4 n .. 4 n + 3 row n's stored bytes 4 v .. 4 v + 3,
 *                whose fields i (bits 2 i, 2 i + 1) are values 128 (v / 8) + 32 i + 4 (v % 8) .. + 3, all of group
 *                8 (v / 8) + 2 i + (v % 8) / 4.
 *
 * So the same bytes hold the same numbers (no memory grows). A vector shifted by 2 i and masked holds 4 values of one
 * group for each of the 16 rows; one 16-bit multiply by the rows' group scales (value times scale <= 45: a byte) makes
 * it the operand of `vpdpbusd` against 4 activation bytes broadcast (16 rows' isum at once) and a row of an AMX B tile
 * (`tdpbsud`: 16 rows x 4 values, a whole block's isum in 4 products of 64 values). The mins meet the activations'
 * 16-value sums (int16) as 16-bit pairs: `vpdpwssd`, or on the tiles the sums' low bytes (unsigned, `tdpbuud`) and high
 * bytes (signed, `tdpbsud`), msum = 256 C_high + C_low. Rows past the last whole group keep the stored layout (qdot8.c
 * multiplies them). The arithmetic is qdot8.c's Q2_K (ops/q8_activations.py): per row and block the exact integers
 * isum = sum_j sc_j dot_j and msum = sum_j m_j bsums_j, then acc += (d_x d) isum - (d_x dmin) msum in block order,
 * so every output has qdot8's bits, for any M and any split of the rows. Built with qgemv.c by backends/cpu/kernels.py.
 */
#include "half.h"
#include "repack.h"

#define QK_BYTES 84         /* a stored Q2_K block */
#define GB (GROUP * QK_BYTES)       /* a group's block: 1344 bytes */
#define Q8K_BYTES 320       /* q8_quantize's Q8_K block: int8 qs[256], float d, int16 bsums[16], padding */
#define Q2KR_TYPE 1010      /* the repacked layout's type code in the kernel library (no GGUF type) */
#define SC_AT(j, n) (64 + 32 * ((j) / 2) + 2 * (n) + (j) % 2)      /* the scale byte of group j, row n */
#define QS_AT 320           /* the 2-bit field vectors */
#define STREAMS 2           /* groups whose weight streams are fetched at once (measured: 1, 2, 4, 8); on AMD Zen one
                             * for one activation row (docs/cpu.md, "M = 1 q8 kernels on Zen 4 (session 17)") */

/* One group's nb blocks: `from` (16 stored rows of nb blocks) into `to` (the repacked layout), or back (`back`). */
static void group_pack(const uint8_t *from, uint8_t *to, int64_t nb, int back) {
    int64_t row_bytes = nb * QK_BYTES;
    for (int64_t b = 0; b < nb; b++)
        for (int n = 0; n < GROUP; n++) {
            if (back) {
                const uint8_t *g = from + b * GB;
                uint8_t *out = to + n * row_bytes + b * QK_BYTES;
                memcpy(out + 80, g + 2 * n, 2);
                memcpy(out + 82, g + 32 + 2 * n, 2);
                for (int j = 0; j < 16; j++) out[j] = g[SC_AT(j, n)];
                for (int v = 0; v < 16; v++) memcpy(out + 16 + 4 * v, g + QS_AT + 64 * v + 4 * n, 4);
                continue;
            }
            const uint8_t *stored = from + n * row_bytes + b * QK_BYTES;
            uint8_t *g = to + b * GB;
            memcpy(g + 2 * n, stored + 80, 2);
            memcpy(g + 32 + 2 * n, stored + 82, 2);
            for (int j = 0; j < 16; j++) g[SC_AT(j, n)] = stored[j];
            for (int v = 0; v < 16; v++) memcpy(g + QS_AT + 64 * v + 4 * n, stored + 16 + 4 * v, 4);
        }
}

/* Rewrite the whole groups of a [N, K] Q2_K weight in place (repack.h's repack_groups). */
int q2kr_repack(uint8_t *w, int64_t N, int64_t K, int back) {
    return repack_groups(w, N, K, back, 256, QK_BYTES, group_pack);
}

#if !REPACK_VNNI
/* One group (16 weight rows at `g`, nb repacked blocks) against one activation row `x`: out[n], plain C. */
static void group_row_c(const uint8_t *g, int64_t nb, const uint8_t *x, float out[GROUP]) {
    for (int n = 0; n < GROUP; n++) out[n] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g + b * GB, *xb = x + b * Q8K_BYTES;
        const int8_t *qs = (const int8_t *)xb;
        float dx;
        int16_t bsums[16];
        memcpy(&dx, xb + 256, 4);
        memcpy(bsums, xb + 260, sizeof bsums);
        for (int n = 0; n < GROUP; n++) {
            int isum = 0, msum = 0;
            for (int j = 0; j < 16; j++) msum += (gb[SC_AT(j, n)] >> 4) * bsums[j];
            for (int v = 0; v < 16; v++)
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++) {
                        int at = 128 * (v / 8) + 32 * i + 4 * (v % 8) + t;
                        int q = (gb[QS_AT + 64 * v + 4 * n + t] >> (2 * i)) & 3;
                        isum += (gb[SC_AT(at / 16, n)] & 15) * q * qs[at];
                    }
            out[n] += (dx * f16_to_f32(gb + 2 * n)) * (float)isum - (dx * f16_to_f32(gb + 32 + 2 * n)) * (float)msum;
        }
    }
}
#endif

#if REPACK_VNNI

#define AHEAD_ONE 8192  /* bytes of the weight stream prefetched ahead: one activation row on AMD Zen (one stream; 4,
                         * 6, 8, 12 and 16 KB measured, docs/cpu.md "M = 1 q8 kernels on Zen 4 (session 17)"), */
#define AHEAD 1024      /* STREAMS streams, */
#define AHEAD_ROWS 4096 /* one stream (several rows); by STREAM_HINT for one activation row, else into L1 (measured:
                         * docs/cpu.md, "Q4_K, Q2_K and IQ2_XXS at several rows without AMX (session 16)") */

/* A group block's scales: s[j] lane n = row n's scale of group j in both 16-bit words; mn[p] lane n = its mins of
 * groups 2 p, 2 p + 1 as an int16 pair; d, dmin lane n: row n's. */
typedef struct { __m512i s[16], mn[8]; __m512 d, dmin; } group_scales;

static inline void scales_of(const uint8_t *gb, group_scales *s) {
    const __m512i even = _mm512_set4_epi32(0x800C800C, 0x80088008, 0x80048004, 0x80008000);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(0x00020002)), low4 = _mm512_set1_epi16(15);
    for (int p = 0; p < 8; p++) {
        __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(gb + 64 + 32 * p)));   /* words */
        s->s[2 * p] = _mm512_and_si512(_mm512_shuffle_epi8(z, even), low4);
        s->s[2 * p + 1] = _mm512_and_si512(_mm512_shuffle_epi8(z, odd), low4);
        s->mn[p] = _mm512_srli_epi16(z, 4);
    }
    s->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb));
    s->dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 32)));
}

/* Fields i of vector v of a group block, times their groups' scales: 16 rows x 4 values, each <= 45. */
static inline __m512i scaled_of(const uint8_t *gb, const group_scales *s, int v, int i) {
    __m512i q = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(gb + QS_AT + 64 * v), 2 * i),
                                 _mm512_set1_epi8(3));
    return _mm512_mullo_epi16(q, s->s[8 * (v / 8) + 2 * i + (v % 8) / 4]);
}

/* One activation block's term for the group's 16 rows from their exact isum and msum (lane n: row n), as dot_q2_k. */
static inline __m512 block_term(const group_scales *s, __m512i isum, __m512i msum, float dx) {
    __m512 vdx = _mm512_set1_ps(dx);
    return _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(vdx, s->d), _mm512_cvtepi32_ps(isum)),
                         _mm512_mul_ps(_mm512_mul_ps(vdx, s->dmin), _mm512_cvtepi32_ps(msum)));
}

/* One group block `gb` against R activation blocks xb[r] (R = 1..4), the masked fields shared by the R rows (the
 * weight prefetched `ahead` bytes ahead, into L2 where `l2`); adds
 * each row's term to acc[r] (lane n: weight row n). Per pair of groups (2 p, 2 p + 1: fields i of vectors 8 k ..
 * 8 k + 7, p = 4 k + i) each row's two group dots (times 4^i: the fields masked in place, not shifted) come from 4
 * `vpdpbusd` each; they fit int16 (|dot| <= 16 x 3 x 128), so shifted into the two words of each lane they meet the
 * rows' scale pair in one `vpdpwssd`, as the mins meet the activation's pair of 16-value sums. */
static inline __attribute__((always_inline)) void block_rows(const int R, const uint8_t *gb, const uint8_t *const *xb,
                                                             __m512 *acc, int ahead, int l2) {
    for (int off = 0; off < GB; off += 64)
        if (l2) _mm_prefetch((const char *)gb + off + ahead, STREAM_HINT);
        else _mm_prefetch((const char *)gb + off + ahead, _MM_HINT_T0);
    const __m512i low4 = _mm512_set1_epi16(15);
    __m512i isum[4], msum[4];
    for (int r = 0; r < R; r++) isum[r] = msum[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i mask = _mm512_set1_epi8((char)(3 << (2 * i)));
            __m512i dot[4][2];
            for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                __m512i q = _mm512_and_si512(_mm512_loadu_si512(gb + QS_AT + 64 * (8 * k + v)), mask);
                for (int r = 0; r < R; r++) {
                    int32_t xv;
                    memcpy(&xv, xb[r] + 128 * k + 32 * i + 4 * v, 4);
                    dot[r][v / 4] = _mm512_dpbusd_epi32(dot[r][v / 4], q, _mm512_set1_epi32(xv));
                }
            }
            int p = 4 * k + i;
            __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(gb + 64 + 32 * p)));   /* words */
            __m512i sc = _mm512_and_si512(z, low4), mn = _mm512_srli_epi16(z, 4);
            for (int r = 0; r < R; r++) {
                __m512i even = i ? _mm512_srai_epi32(dot[r][0], 2 * i) : dot[r][0];
                __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAA, even, _mm512_slli_epi32(dot[r][1], 16 - 2 * i));
                int32_t bs;
                memcpy(&bs, xb[r] + 260 + 4 * p, 4);
                isum[r] = _mm512_dpwssd_epi32(isum[r], pair, sc);
                msum[r] = _mm512_dpwssd_epi32(msum[r], mn, _mm512_set1_epi32(bs));
            }
        }
    group_scales s;
    s.d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb));
    s.dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 32)));
    for (int r = 0; r < R; r++) {
        float dx;
        memcpy(&dx, xb[r] + 256, 4);
        acc[r] = _mm512_add_ps(acc[r], block_term(&s, isum[r], msum[r], dx));
    }
}

/* R groups g[0..R) (R = 1, or STREAMS: that many streams of the weight fetched at once) against M activation rows, block by block
 * in turn, up to four rows at a time sharing the masked fields; acc[i][m] lane n: group i, activation row m, weight
 * row n (each sum in block order: the same bits for any R). */
static void group_rows(const int R, const uint8_t *const *g, int64_t nb, const uint8_t *x, int64_t M,
                       __m512 (*acc)[GROUP]) {
    for (int i = 0; i < R; i++)
        for (int64_t m = 0; m < M; m++) acc[i][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < R; i++)
            for (int64_t m = 0; m < M; m += 4) {
                const uint8_t *gb = g[i] + b * GB, *xb[4];
                int ahead = AMD_ZEN && M == 1 ? AHEAD_ONE : R > 1 ? AHEAD : AHEAD_ROWS;
                for (int r = 0; r < 4; r++) xb[r] = x + ((m + r < M ? m + r : m) * nb + b) * Q8K_BYTES;
                switch (M - m < 4 ? M - m : 4) {
                case 1: block_rows(1, gb, xb, acc[i] + m, ahead, M == 1); break;
                case 2: block_rows(2, gb, xb, acc[i] + m, ahead, M == 1); break;
                case 3: block_rows(3, gb, xb, acc[i] + m, ahead, M == 1); break;
                default: block_rows(4, gb, xb, acc[i] + m, ahead, M == 1); break;
                }
            }
}

#if REPACK_AMX

/* tmm0, tmm1: A tiles of M activation rows x 64 values; tmm2, tmm3: B tiles of 16 x 64 (the scaled fields of 64
 * values of the 16 weight rows); tmm4: the M x 16 isum; tmm5: A tile of M rows x 32 bytes (the activations' 16-value
 * sums); tmm6: B tile of 8 x 64 (the mins as int16 pairs, or shifted into the high bytes); tmm7: M x 16 msum parts. */
static void tiles_for(int64_t M) {
    const int rows[8] = {(int)M, (int)M, 16, 16, (int)M, (int)M, 8, (int)M}, cols[8] = {64, 64, 64, 64, 64, 32, 64, 64};
    tiles_load(rows, cols);
}

typedef struct { int32_t isum[GROUP][GROUP], low[GROUP][GROUP], high[GROUP][GROUP]; } block_sums;
typedef struct { uint8_t u[4][16][64], mins[2][8][64]; } block_tiles_b;   /* a block's B tiles */

/* A group block's B tiles: its scaled fields (tile h, row rho: values 64 h + 4 rho .. + 3, i.e. fields
 * 2 (h % 2) + rho / 8 of vector 8 (h / 2) + rho % 8) and its mins (as int16 pairs, and shifted into the high bytes). */
static inline void block_b(const uint8_t *gb, block_tiles_b *t) {
    for (int off = 0; off < GB; off += 64) _mm_prefetch((const char *)gb + off + AHEAD_ROWS, _MM_HINT_T0);
    group_scales s;
    scales_of(gb, &s);
    for (int p = 0; p < 8; p++) {
        _mm512_store_si512(t->mins[0][p], s.mn[p]);
        _mm512_store_si512(t->mins[1][p], _mm512_slli_epi16(s.mn[p], 8));
    }
#pragma GCC unroll 4
    for (int h = 0; h < 4; h++)
#pragma GCC unroll 16
        for (int rho = 0; rho < 16; rho++)
            _mm512_store_si512(t->u[h][rho], scaled_of(gb, &s, 8 * (h / 2) + rho % 8, 2 * (h % 2) + rho / 8));
}

/* A block's products on the tiles (B tiles t, activation blocks at xb with row stride ldx): isum from 4 products
 * into tmm4, tmm0-3 its A and B tiles. */
static inline void block_products(const uint8_t *xb, int64_t ldx, const block_tiles_b *t) {
    _tile_zero(4);
    _tile_loadd(0, xb, ldx);
    _tile_loadd(2, t->u[0], 64);
    _tile_dpbsud(4, 0, 2);
    _tile_loadd(1, xb + 64, ldx);
    _tile_loadd(3, t->u[1], 64);
    _tile_dpbsud(4, 1, 3);
    _tile_loadd(0, xb + 128, ldx);
    _tile_loadd(2, t->u[2], 64);
    _tile_dpbsud(4, 0, 2);
    _tile_loadd(1, xb + 192, ldx);
    _tile_loadd(3, t->u[3], 64);
    _tile_dpbsud(4, 1, 3);
}

/* msum's two products of a block (after block_products) and the three sums stored to c. */
static inline void block_store(const uint8_t *xb, int64_t ldx, const block_tiles_b *t, block_sums *c) {
    _tile_loadd(5, xb + 260, ldx);
    _tile_loadd(6, t->mins[0], 64);
    _tile_zero(7);
    _tile_dpbuud(7, 5, 6);
    _tile_stored(4, c->isum, 64);
    _tile_stored(7, c->low, 64);
    _tile_loadd(6, t->mins[1], 64);
    _tile_zero(7);
    _tile_dpbsud(7, 5, 6);
    _tile_stored(7, c->high, 64);
}

/* The float steps of block b of one group from its tile sums c. */
static inline void block_steps(const uint8_t *gb, const uint8_t *x, int64_t nb, int64_t b, int64_t M,
                               const block_sums *c, __m512 *acc) {
    group_scales s;
    s.d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb));
    s.dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 32)));
    for (int64_t m = 0; m < M; m++) {
        float dx;
        memcpy(&dx, x + (m * nb + b) * Q8K_BYTES + 256, 4);
        __m512i msum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c->high[m]), 8),
                                        _mm512_load_si512(c->low[m]));
        acc[m] = _mm512_add_ps(acc[m], block_term(&s, _mm512_load_si512(c->isum[m]), msum, dx));
    }
}

/* One group against M activation rows on the tiles, block by block: the B tiles of block b + 1 built and the float
 * steps of block b - 1 taken while the tiles multiply block b; acc[m] as group_rows' acc[i][m]. (Four groups' streams
 * in turn, as group_rows takes them, measured slower here from M = 12.) */
static void group_tiles(const uint8_t *g, int64_t nb, const uint8_t *x, int64_t M, __m512 *acc) {
    block_tiles_b t[2] __attribute__((aligned(64)));
    block_sums c[2] __attribute__((aligned(64)));
    const int64_t ldx = nb * Q8K_BYTES;
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    block_b(g, &t[0]);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *xb = x + b * Q8K_BYTES;
        block_products(xb, ldx, &t[b & 1]);
        if (b + 1 < nb) block_b(g + (b + 1) * GB, &t[(b + 1) & 1]);
        if (b > 0) block_steps(g + (b - 1) * GB, x, nb, b - 1, M, &c[(b - 1) & 1], acc);
        block_store(xb, ldx, &t[b & 1], &c[b & 1]);
    }
    block_steps(g + (nb - 1) * GB, x, nb, nb - 1, M, &c[(nb - 1) & 1], acc);
}
#endif
#endif

REPACK_SWITCHES(q2kr, 7)

/* Rows [n0, n1) of y [M, N] from groups [a0, a1) of the weight `w` against M activation rows on `path`
 * (path_for): STREAMS groups at a time (a, a + q, .., q the range over STREAMS: that many streams of the weight
 * fetched at once; on the tiles one group after another), the last ones alone. */
static void rows_groups(int path, const uint8_t *w, int64_t row_bytes, int64_t nb, const uint8_t *x, int64_t M,
                        int64_t a0, int64_t a1, float *y, int64_t N, int64_t n0, int64_t n1) {
    const int streams = AMD_ZEN && M == 1 ? 1 : STREAMS;
    int64_t q = (a1 - a0) / streams, step = GROUP * row_bytes;
    for (int64_t a = a0; a < a1; a++) {
        int R = a < a0 + q ? streams : 1;
        if (a >= a0 + q && a < a0 + streams * q) continue;      /* taken with a - q, a - 2q, .. */
        const uint8_t *g[STREAMS];
        for (int i = 0; i < R; i++) g[i] = w + (a + i * q) * step;
        float out[STREAMS][GROUP][GROUP];
#if REPACK_VNNI
        __m512 acc[STREAMS][GROUP];
#if REPACK_AMX
        if (path == 2)
            for (int i = 0; i < R; i++) group_tiles(g[i], nb, x, M, acc[i]);
        else
#endif
        if (R == STREAMS) group_rows(STREAMS, g, nb, x, M, acc);
        else group_rows(1, g, nb, x, M, acc);
        for (int i = 0; i < R; i++)
            for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(out[i][m], acc[i][m]);
#else
        (void)path;
        for (int i = 0; i < R; i++)
            for (int64_t m = 0; m < M; m++) group_row_c(g[i], nb, x + m * nb * Q8K_BYTES, out[i][m]);
#endif
        for (int i = 0; i < R; i++) {
            int64_t first = (a + i * q) * GROUP;
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = first < n0 ? n0 : first; n < first + GROUP && n < n1; n++)
                    y[m * N + n] = out[i][m][n - first];
        }
    }
}

/* y [M, N] rows [n0, n1) = x @ W.T for a Q2_K weight whose whole groups q2kr_repack rewrote (type Q2KR_TYPE), the
 * activations `xq` from q8_quantize kind 0; the arguments as qdot8's (experts: row m uses the weight at
 * w + experts[m] * expert_bytes, experts[m] < 0 gives 0). A group cut by [n0, n1) is computed whole and only its
 * rows inside stored. Returns -1 for a call it cannot serve, -2 out of memory. */
int q2kr_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
              const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (type != Q2KR_TYPE || K % 256 || M < 1 || M > GROUP) return -1;
    const uint8_t *x = xq;
    int64_t nb = K / 256, row_bytes = nb * QK_BYTES;
    int rc = stored_rows(10, w, expert_bytes, experts, N, K, xq, M, y, n0, &n1);     /* past the last group */
    if (rc) return rc;
    int own = experts != NULL;
    int64_t live[GROUP], rows = live_rows(experts, M, y, N, n0, n1, live);
    if (rows == 0) return 0;
    uint8_t *xs = NULL;         /* the live rows' activations together, where some rows have no expert */
    if (rows < M && (xs = live_activations(x, live, rows, nb * Q8K_BYTES)) == NULL) return -2;
    int path = path_for(own ? 1 : rows, amx_rows_from);
#if REPACK_AMX
    if (path == 2 && n0 < n1) tiles_for(rows);
#endif
    if (!own) rows_groups(path, w, row_bytes, nb, x, rows, n0 / GROUP, (n1 + GROUP - 1) / GROUP, y, N, n0, n1);
    else            /* each row with a weight of its own */
        for (int64_t i = 0; i < rows; i++)
            rows_groups(path, w + experts[live[i]] * expert_bytes, row_bytes, nb, (xs != NULL ? xs : x) + i * nb *
                        Q8K_BYTES, 1, n0 / GROUP, (n1 + GROUP - 1) / GROUP, y + live[i] * N, N, n0, n1);
#if REPACK_AMX
    if (path == 2 && n0 < n1) _tile_release();
#endif
    free(xs);
    return 0;
}
