/* Q4_K repacked at load for `--cpu-dot q8` (docs/cpu.md, "Q4_K repacked at load (session 13)"). A weight's rows
 * are taken 16 at a time (a group: 16 x row_bytes contiguous bytes, the same region before and after), and each
 * block of the group's 16 rows (16 x 144 = 2304 bytes) is rewritten as
 *
 *   [0, 32)      the 16 rows' d (f16), [32, 64) their dmin (f16);
 *   [64, 160)    the 128 six-bit scales, entry 16 j + n = row n's scale of sub-block j: 64 bytes of low nibbles (byte t:
 *                entries t and t + 64), 32 bytes of top bits (byte t: entries t, t + 32, t + 64, t + 96, 2 bits each);
 *   [160, 256)   the 128 six-bit mins, the same way but entry 32 i + 2 n + t = row n's min of sub-block 2 i + t (so that
 *                16-bit pairs of them meet the activations' pairs of sub-block sums in `vpdpwssd`);
 *   [256, 2304)  the nibbles: 64-byte vector 8 p + r holds in bytes 4 n .. 4 n + 3 row n's stored bytes 32 p + 4 r ..
 *                32 p + 4 r + 3, whose low nibbles are values 64 p + 4 r .. + 3 (sub-block 2 p) and high nibbles
 *                values 64 p + 32 + 4 r .. + 3 (sub-block 2 p + 1).
 *
 * So the same bytes hold the same numbers (no memory grows), and a nibble vector, masked or shifted, is the
 * operand of `vpdpbusd` against 4 activation bytes broadcast (16 weight rows at once) and a row of an AMX B tile
 * (`tdpbsud`, 16 weight rows x 4 values per row) with nothing else unpacked. Rows past the last whole group keep the
 * stored layout (qdot8.c multiplies them). The arithmetic is qdot8.c's Q4_K (ops/q8_activations.py): per row and
 * block the exact integers isum = sum_j sc_j dot_j and msum = sum_j m_j (bsums 2j + bsums 2j+1), then
 * acc += (d_x d) isum - (d_x dmin) msum in block order. Here isum is formed in float from exact pieces (a sub-block's
 * dot times its scale is below 2^22 and four of them below 2^24, so the two halves are exact and their sum rounds as
 * (float)isum does; msum is below 2^21), so every output has qdot8's bits, for any M and any split of the rows.
 * Built with qgemv.c by backends/cpu/kernels.py.
 */
#include "half.h"
#include "repack.h"

#define QK_BYTES 144        /* a stored Q4_K block */
#define GB (GROUP * QK_BYTES)       /* a group's block: 2304 bytes */
#define Q8K_BYTES 320       /* q8_quantize's Q8_K block: int8 qs[256], float d, int16 bsums[16], padding */
#define Q4KR_TYPE 1012      /* the repacked layout's type code in the kernel library (no GGUF type) */
#define MIN_AT(j, n) (32 * ((j) / 2) + 2 * (n) + (j) % 2)     /* the min of sub-block j, row n: its entry */

/* A stored block's 8 scales and 8 mins (6 bits each), as qdot8.c's dot_q4_k unpacks them. */
static void stored_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = (uint8_t)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        mn[4 + j] = (uint8_t)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
}

static void stored_pack(const uint8_t sc[8], const uint8_t mn[8], uint8_t *s) {     /* stored_scales' inverse */
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] | ((sc[4 + j] >> 4) << 6));
        s[4 + j] = (uint8_t)(mn[j] | ((mn[4 + j] >> 4) << 6));
        s[8 + j] = (uint8_t)((sc[4 + j] & 15) | ((mn[4 + j] & 15) << 4));
    }
}

static void six_pack(const uint8_t e[128], uint8_t *out) {          /* 128 six-bit entries -> 96 bytes */
    for (int t = 0; t < 64; t++) out[t] = (uint8_t)((e[t] & 15) | ((e[t + 64] & 15) << 4));
    for (int t = 0; t < 32; t++)
        out[64 + t] = (uint8_t)((e[t] >> 4) | ((e[t + 32] >> 4) << 2) | ((e[t + 64] >> 4) << 4) | ((e[t + 96] >> 4) << 6));
}

static void six_unpack(const uint8_t *in, uint8_t e[128]) {         /* six_pack's inverse */
    for (int t = 0; t < 128; t++)
        e[t] = (uint8_t)(((in[t % 64] >> (4 * (t / 64))) & 15) | (((in[64 + t % 32] >> (2 * (t / 32))) & 3) << 4));
}

/* One group's nb blocks: `from` (16 stored rows of nb blocks) into `to` (the repacked layout), or back (`back`). */
static void group_pack(const uint8_t *from, uint8_t *to, int64_t nb, int back) {
    int64_t row_bytes = nb * QK_BYTES;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = back ? from + b * GB : NULL;
        uint8_t *o = back ? NULL : to + b * GB, sc[128], mn[128];
        if (back) {
            six_unpack(g + 64, sc);
            six_unpack(g + 160, mn);
        }
        for (int n = 0; n < GROUP; n++) {
            const uint8_t *stored = back ? NULL : from + n * row_bytes + b * QK_BYTES;
            uint8_t *out = back ? to + n * row_bytes + b * QK_BYTES : NULL, s[8], m[8];
            if (back) {
                memcpy(out, g + 2 * n, 2);
                memcpy(out + 2, g + 32 + 2 * n, 2);
                for (int j = 0; j < 8; j++) s[j] = sc[16 * j + n], m[j] = mn[MIN_AT(j, n)];
                stored_pack(s, m, out + 4);
                for (int v = 0; v < 32; v++) memcpy(out + 16 + 4 * v, g + 256 + 64 * v + 4 * n, 4);
                continue;
            }
            memcpy(o + 2 * n, stored, 2);
            memcpy(o + 32 + 2 * n, stored + 2, 2);
            stored_scales(stored + 4, s, m);
            for (int j = 0; j < 8; j++) sc[16 * j + n] = s[j], mn[MIN_AT(j, n)] = m[j];
            for (int v = 0; v < 32; v++) memcpy(o + 256 + 64 * v + 4 * n, stored + 16 + 4 * v, 4);
        }
        if (!back) {
            six_pack(sc, o + 64);
            six_pack(mn, o + 160);
        }
    }
}

/* Rewrite the whole groups of a [N, K] Q4_K weight in place (repack.h's repack_groups). */
int q4kr_repack(uint8_t *w, int64_t N, int64_t K, int back) {
    return repack_groups(w, N, K, back, 256, QK_BYTES, group_pack);
}

/* The float terms of one row pair (weight row n, activation block): shared by every path below, scalar form. */
static inline float term_of(float dx, float d, float dmin, float isum, float msum) {
    return (dx * d) * isum - (dx * dmin) * msum;
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
        uint8_t sc[128], mn[128];
        six_unpack(gb + 64, sc);
        six_unpack(gb + 160, mn);
        for (int n = 0; n < GROUP; n++) {
            int isum = 0, msum = 0;
            for (int j = 0; j < 8; j++) {
                int dot = 0, p = j / 2, high = j % 2;
                for (int v = 0; v < 32; v++) {
                    int q = (gb[256 + 64 * (8 * p + v / 4) + 4 * n + v % 4] >> (4 * high)) & 15;
                    dot += q * qs[32 * j + v];
                }
                isum += sc[16 * j + n] * dot;
                msum += mn[MIN_AT(j, n)] * (bsums[2 * j] + bsums[2 * j + 1]);
            }
            out[n] += term_of(dx, f16_to_f32(gb + 2 * n), f16_to_f32(gb + 32 + 2 * n), (float)isum, (float)msum);
        }
    }
}
#endif

#if REPACK_VNNI

typedef struct { __m512 d, dmin, sc[8]; __m512i mn[4]; } block_scales;  /* lane n: row n; mn[i] its mins of
                                                                             * sub-blocks 2i, 2i + 1 as int16 pairs */

static inline void six_unpack_v(const uint8_t *in, uint8_t e[128]) {     /* six_unpack, 128 entries at once */
    const __m512i low4 = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    __m512i lo = _mm512_loadu_si512(in);
    __m256i top = _mm256_loadu_si256((const __m256i *)(in + 64));
    __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(top), top, 1);
    __m512i s01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);     /* bytes 32..63: >> 2 */
    __m512i s23 = _mm512_add_epi16(s01, _mm512_set1_epi16(4));
    __m512i e0 = _mm512_or_si512(_mm512_and_si512(lo, low4),
                                 _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hi, s01), two), 4));
    __m512i e1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), low4),
                                 _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hi, s23), two), 4));
    _mm512_storeu_si512(e, e0);
    _mm512_storeu_si512(e + 64, e1);
}

static inline void scales_of(const uint8_t *gb, block_scales *s) {
    uint8_t e[256] __attribute__((aligned(64)));
    six_unpack_v(gb + 64, e);
    six_unpack_v(gb + 160, e + 128);
    for (int j = 0; j < 8; j++)
        s->sc[j] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(e + 16 * j))));
    for (int i = 0; i < 4; i++)
        s->mn[i] = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)(e + 128 + 32 * i)));
    s->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb));
    s->dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 32)));
}

/* One activation block's term for the group's 16 rows from their isum (the exact integer rounded to float, lane n:
 * row n): bs[i] the activation's sums of sub-blocks 2i and 2i + 1 (bsums 4i + 4i+1 and 4i+2 + 4i+3) as an int16 pair,
 * dx its scale. */
static inline __m512 block_step(const block_scales *s, __m512 isum, const int32_t *bs, float dx) {
    __m512i mi = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) mi = _mm512_dpwssd_epi32(mi, s->mn[i], _mm512_set1_epi32(bs[i]));
    __m512 msum = _mm512_cvtepi32_ps(mi);
    __m512 vdx = _mm512_set1_ps(dx);
    return _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(vdx, s->d), isum),
                         _mm512_mul_ps(_mm512_mul_ps(vdx, s->dmin), msum));
}

/* block_step's term from dot[j], the exact sub-block dots (int32, lane n: row n). */
static inline __m512 block_term(const block_scales *s, const __m512i *dot, const int32_t *bs, float dx) {
    __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[0]), s->sc[0]);
    __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[4]), s->sc[4]);
    for (int j = 1; j < 4; j++) {           /* exact: every partial sum an integer below 2^24 */
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), s->sc[j], a);
        b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[4 + j]), s->sc[4 + j], b);
    }
    return block_step(s, _mm512_add_ps(a, b), bs, dx);      /* a + b: the exact isum rounded, as (float)isum */
}

static inline void bsums_of(const uint8_t *xb, int32_t bs[4]) {     /* block_term's pairs of sub-block sums */
    __m128i v = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(xb + 260)), _mm_loadu_si128((const __m128i *)(xb + 276)));
    _mm_storeu_si128((__m128i *)bs, v);
}

#if AMD_ZEN             /* groups whose weight streams one activation row takes at once: measured, docs/cpu.md */
#define STREAMS 2       /* ("M = 1 q8 kernels on Zen 4 (session 17)"; 1, 2, 4, 8 there) */
#else
#define STREAMS 4       /* (four on Sapphire Rapids: "Q4_K repacked at load (session 13)") */
#endif
#define AHEAD 1024      /* bytes of each weight stream prefetched ahead (STREAM_HINT): one row (STREAMS streams), */
#define AHEAD_ROWS 8192 /* several rows (one stream); measured: docs/cpu.md, "Q4_K, Q2_K and IQ2_XXS at several
                         * rows without AMX (session 16)" */

/* One group block `gb` against one activation block xb: `vpdpbusd` with 4 activation bytes broadcast, the nibble
 * vectors straight from the weight; adds the term to acc (lane n: row n). */
static inline __attribute__((always_inline)) void block_row(const uint8_t *gb, const uint8_t *xb, __m512 *acc) {
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int off = 0; off < GB; off += 64) _mm_prefetch((const char *)gb + off + AHEAD, STREAM_HINT);
    __m512i dot[8];
    for (int j = 0; j < 8; j++) dot[j] = _mm512_setzero_si512();
#pragma GCC unroll 32
    for (int v = 0; v < 32; v++) {        /* v = 8 p + r */
        int p = v / 8, k = v % 8;
        __m512i q = _mm512_loadu_si512(gb + 256 + 64 * v);
        __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
        int32_t xl, xh;
        memcpy(&xl, xb + 64 * p + 4 * k, 4);
        memcpy(&xh, xb + 64 * p + 32 + 4 * k, 4);
        dot[2 * p] = _mm512_dpbusd_epi32(dot[2 * p], lo, _mm512_set1_epi32(xl));
        dot[2 * p + 1] = _mm512_dpbusd_epi32(dot[2 * p + 1], hi, _mm512_set1_epi32(xh));
    }
    block_scales s;
    scales_of(gb, &s);
    int32_t bs[4];
    float dx;
    bsums_of(xb, bs);
    memcpy(&dx, xb + 256, 4);
    *acc = _mm512_add_ps(*acc, block_term(&s, dot, bs, dx));
}

/* R groups (1, or STREAMS: that many streams of the weight fetched at once) against one activation
 * row each, block by block in turn; each group's terms added in block order (the same bits for any R). */
static inline __attribute__((always_inline)) void groups_row(const int R, const uint8_t *const *g, int64_t nb,
                                                             const uint8_t *const *x, __m512 *acc) {
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < R; i++) {
            block_row(g[i] + b * GB, x[i] + b * Q8K_BYTES, acc + i);
        }
}

/* Rows [n0, n1) of one activation row's outputs `y` from groups [a0, a1) of the weight at `base` (row_bytes a row):
 * STREAMS groups at a time (a, a + q, .., q the range over STREAMS), the last ones alone. */
static void own_groups(const uint8_t *base, int64_t row_bytes, int64_t nb, const uint8_t *x, int64_t a0, int64_t a1,
                       float *y, int64_t n0, int64_t n1) {
    int64_t q = (a1 - a0) / STREAMS, step = GROUP * row_bytes;
    float out[STREAMS][GROUP];
    for (int64_t a = a0; a < a1; a++) {
        int R = a < a0 + q ? STREAMS : 1;
        if (a >= a0 + q && a < a0 + STREAMS * q) continue;      /* taken with a - q, a - 2q, .. */
        const uint8_t *g[STREAMS], *xs[STREAMS];
        for (int i = 0; i < R; i++) g[i] = base + (a + i * q) * step, xs[i] = x;
        __m512 acc[STREAMS];
        if (R == STREAMS) groups_row(STREAMS, g, nb, xs, acc);
        else groups_row(1, g, nb, xs, acc);
        for (int i = 0; i < R; i++) {
            _mm512_storeu_ps(out[i], acc[i]);
            int64_t first = (a + i * q) * GROUP;
            for (int64_t n = first < n0 ? n0 : first; n < first + GROUP && n < n1; n++) y[n] = out[i][n - first];
        }
    }
}

/* One group block `gb` (block b) against M activation rows (x: M rows of nb blocks):
 * per pair of sub-blocks (2 p, 2 p + 1) the 16 nibble operands are taken once into registers and serve every row's 16
 * `vpdpbusd`; each sub-block dot times its scale is added to the row's isum in int32 (exact, |isum| < 2^25), so the
 * scales cost one multiply per row and sub-block and the float step one conversion per row and block (block_step:
 * the same bits as block_term's). Adds row m's term to acc[m]. */
static void block_wide(const uint8_t *gb, const uint8_t *x, int64_t nb, int64_t b, int64_t M, __m512 *acc) {
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int off = 0; off < GB; off += 64) _mm_prefetch((const char *)gb + off + AHEAD_ROWS, STREAM_HINT);
    block_scales s;
    scales_of(gb, &s);
    __m512i isum[GROUP];
    for (int p = 0; p < 4; p++) {
        __m512i lo[8], hi[8];
        for (int k = 0; k < 8; k++) {
            __m512i q = _mm512_loadu_si512(gb + 256 + 64 * (8 * p + k));
            lo[k] = _mm512_and_si512(q, low4);
            hi[k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
        }
        __m512i sl = _mm512_cvtps_epi32(s.sc[2 * p]), sh = _mm512_cvtps_epi32(s.sc[2 * p + 1]);
        for (int64_t m = 0; m < M; m++) {
            const int32_t *xl = (const int32_t *)(x + (m * nb + b) * Q8K_BYTES + 64 * p), *xh = xl + 8;
            __m512i dl0 = _mm512_setzero_si512(), dl1 = dl0, dh0 = dl0, dh1 = dl0;
            for (int k = 0; k < 8; k += 2) {
                dl0 = _mm512_dpbusd_epi32(dl0, lo[k], _mm512_set1_epi32(xl[k]));
                dl1 = _mm512_dpbusd_epi32(dl1, lo[k + 1], _mm512_set1_epi32(xl[k + 1]));
                dh0 = _mm512_dpbusd_epi32(dh0, hi[k], _mm512_set1_epi32(xh[k]));
                dh1 = _mm512_dpbusd_epi32(dh1, hi[k + 1], _mm512_set1_epi32(xh[k + 1]));
            }
            __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(dl0, dl1), sl),
                                         _mm512_mullo_epi32(_mm512_add_epi32(dh0, dh1), sh));
            isum[m] = p ? _mm512_add_epi32(isum[m], t) : t;
        }
    }
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *xb = x + (m * nb + b) * Q8K_BYTES;
        int32_t bs[4];
        float dx;
        bsums_of(xb, bs);
        memcpy(&dx, xb + 256, 4);
        acc[m] = _mm512_add_ps(acc[m], block_step(&s, _mm512_cvtepi32_ps(isum[m]), bs, dx));
    }
}

/* A group block's nibbles as sub-block operands: u[j][r] (64 bytes) = values 32 j + 4 r .. + 3 of the 16 rows. */
static inline void nibbles_of(const uint8_t *gb, uint8_t u[8][8][64]) {
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int v = 0; v < 32; v++) {
        __m512i q = _mm512_loadu_si512(gb + 256 + 64 * v);
        _mm512_store_si512(u[2 * (v / 8)][v % 8], _mm512_and_si512(q, low4));
        _mm512_store_si512(u[2 * (v / 8) + 1][v % 8], _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
    }
}

/* One group against M activation rows (M >= 2), block by block (block_wide); acc[m] lane n: activation row m,
 * weight row n. */
static void group_rows(const uint8_t *g, int64_t nb, const uint8_t *x, int64_t M, __m512 *acc) {
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) block_wide(g + b * GB, x, nb, b, M, acc);
}

#if REPACK_AMX

/* Block b of one group (`gb`) on the tiles: per sub-block one `tdpbsud` (activations signed, nibbles unsigned) gives
 * the M x 16 dots, stored to c[j]. */
static inline void block_tiles(const uint8_t *gb, const uint8_t *xb, int64_t ldx, uint8_t u[8][8][64],
                               int32_t c[8][GROUP][GROUP]) {
    for (int off = 0; off < GB; off += 64) _mm_prefetch((const char *)gb + off + AHEAD_ROWS, _MM_HINT_T0);
    nibbles_of(gb, u);
#define SUB(j, ta, tb, tc) _tile_loadd(ta, xb + 32 * (j), ldx); _tile_loadd(tb, u[j], 64); _tile_zero(tc); \
    _tile_dpbsud(tc, ta, tb); _tile_stored(tc, c[j], 64);
    SUB(0, 0, 2, 4) SUB(1, 1, 3, 5) SUB(2, 0, 2, 6) SUB(3, 1, 3, 7)
    SUB(4, 0, 2, 4) SUB(5, 1, 3, 5) SUB(6, 0, 2, 6) SUB(7, 1, 3, 7)
#undef SUB
}

/* The float steps of block b of one group from its tile sums c (block_tiles'). */
static inline void block_sums(const uint8_t *gb, const uint8_t *x, int64_t nb, int64_t b, int64_t M,
                              int32_t c[8][GROUP][GROUP], __m512 *acc) {
    block_scales s;
    scales_of(gb, &s);
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *xb = x + (m * nb + b) * Q8K_BYTES;
        __m512i dot[8];
        for (int j = 0; j < 8; j++) dot[j] = _mm512_load_si512(c[j][m]);
        int32_t bs[4];
        float dx;
        bsums_of(xb, bs);
        memcpy(&dx, xb + 256, 4);
        acc[m] = _mm512_add_ps(acc[m], block_term(&s, dot, bs, dx));
    }
}

/* One group against M activation rows on the tiles, block by block; the float steps of block b run while the tiles
 * take block b + 1; acc as group_rows'. */
static void group_tiles(const uint8_t *g, int64_t nb, const uint8_t *x, int64_t M, __m512 *acc) {
    uint8_t u[8][8][64] __attribute__((aligned(64)));
    int32_t c[2][8][GROUP][GROUP] __attribute__((aligned(64)));
    const int64_t ldx = nb * Q8K_BYTES;
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) block_tiles(g + b * GB, x + b * Q8K_BYTES, ldx, u, c[b & 1]);
        if (b > 0) block_sums(g + (b - 1) * GB, x, nb, b - 1, M, c[(b - 1) & 1], acc);
    }
}
#endif
#endif

REPACK_SWITCHES(q4kr, 10)

/* Rows [n0, n1) of y [M, N] from groups [a0, a1) of the weight `w` against M activation rows on `path`
 * (path_for), one group after another. */
static void rows_groups(int path, const uint8_t *w, int64_t row_bytes, int64_t nb, const uint8_t *x, int64_t M,
                        int64_t a0, int64_t a1, float *y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t a = a0; a < a1; a++) {
        const uint8_t *g = w + a * GROUP * row_bytes;
        float out[GROUP][GROUP];
#if REPACK_VNNI
        __m512 acc[GROUP];
#if REPACK_AMX
        if (path == 2) group_tiles(g, nb, x, M, acc);
        else
#endif
        group_rows(g, nb, x, M, acc);
        if (a * GROUP >= n0 && (a + 1) * GROUP <= n1) {        /* a whole group: straight from the accumulators */
            for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(y + m * N + a * GROUP, acc[m]);
            continue;
        }
        for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(out[m], acc[m]);
#else
        (void)path;
        for (int64_t m = 0; m < M; m++) group_row_c(g, nb, x + m * nb * Q8K_BYTES, out[m]);
#endif
        int64_t first = a * GROUP;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = first < n0 ? n0 : first; n < first + GROUP && n < n1; n++) y[m * N + n] = out[m][n - first];
    }
}

/* y [M, N] rows [n0, n1) = x @ W.T for a Q4_K weight whose whole groups q4kr_repack rewrote (type Q4KR_TYPE), the
 * activations `xq` from q8_quantize kind 0; the arguments as qdot8's (experts: row m uses the weight at
 * w + experts[m] * expert_bytes, experts[m] < 0 gives 0). A group cut by [n0, n1) is computed whole and only its
 * rows inside stored. Returns -1 for a call it cannot serve, -2 out of memory. */
int q4kr_rows(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
              const void *xq, int64_t M, float *y, int64_t n0, int64_t n1) {
    if (type != Q4KR_TYPE || K % 256 || M < 1 || M > GROUP) return -1;
    const uint8_t *x = xq;
    int64_t nb = K / 256, row_bytes = nb * QK_BYTES;
    int rc = stored_rows(12, w, expert_bytes, experts, N, K, xq, M, y, n0, &n1);     /* past the last group */
    if (rc) return rc;
    int own = experts != NULL;
    int64_t live[GROUP], rows = live_rows(experts, M, y, N, n0, n1, live);
    if (rows == 0) return 0;
    uint8_t *xs = NULL;         /* the live rows' activations together, where some rows have no expert */
    if (rows < M && (xs = live_activations(x, live, rows, nb * Q8K_BYTES)) == NULL) return -2;
#if REPACK_VNNI
    if (own || rows == 1) {         /* a weight row of its own: four streams of groups */
        for (int64_t i = 0; i < rows; i++)
            own_groups(w + (own ? experts[live[i]] * expert_bytes : 0), row_bytes, nb,
                       (xs != NULL ? xs : x) + i * nb * Q8K_BYTES, n0 / GROUP, (n1 + GROUP - 1) / GROUP,
                       y + live[i] * N, n0, n1);
        free(xs);
        return 0;
    }
#endif
    int path = path_for(own ? 1 : rows, amx_rows_from);
#if REPACK_AMX
    if (path == 2 && n0 < n1) tiles_for_32(rows);
#endif
    if (!own) rows_groups(path, w, row_bytes, nb, x, rows, n0 / GROUP, (n1 + GROUP - 1) / GROUP, y, N, n0, n1);
    else            /* the plain C build's rows with a weight of their own */
        for (int64_t i = 0; i < rows; i++)
            rows_groups(path, w + experts[live[i]] * expert_bytes, row_bytes, nb, (xs != NULL ? xs : x) + i * nb *
                        Q8K_BYTES, 1, n0 / GROUP, (n1 + GROUP - 1) / GROUP, y + live[i] * N, N, n0, n1);
#if REPACK_AMX
    if (path == 2 && n0 < n1) _tile_release();
#endif
    free(xs);
    return 0;
}
