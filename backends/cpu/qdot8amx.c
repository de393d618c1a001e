/* Several rows (M = 2..16) of `--cpu-dot q8` on AMX-INT8 (Sapphire Rapids and later): qdot8_rows' products of a
 * plain Q8_0, Q4_K, Q2_K or IQ2_XXS weight, 16 weight rows at a time, with the integer block sums of all rows
 * from tile products (`tdpbssd` / `tdpbusd`: 16 x 16 x 64 int8 products per instruction) instead of one
 * `vpmaddubsw` chain per row. Each weight block is unpacked once (as the one-row kernel does) into int8 rows
 * that form the A tile; the activations, rounded by q8_quantize as for qdot8, are laid out once per call as B
 * tiles. The integer sums are exact, and every float step is the one-row kernel's, in its order
 * (ops/q8_activations.py), so each output has the same bits as qdot8's:
 *
 * - Q8_0: whole blocks (acc += (d_w d_x) isum), so the A tile is the stored weight itself (16 rows of 32 int8,
 *   read in place) and one K = 32 product per block gives every row's isum.
 * - Q2_K: each value times its sub-block's 4-bit scale fits a byte (3 x 15), so the A tile holds q * scale and
 *   one tile product per 64 values gives isum whole.
 * - Q4_K: the 6-bit scale split as 4 sh + sl (sh < 16, sl < 4): A tiles q * sh and q * sl (at most 225, as
 *   unsigned bytes), isum = 4 C_h + C_l.
 * - IQ2_XXS: each signed grid value times its 32-value group's 2 ls + 1 (at most 43 x 31) split as 128 h + l into
 *   two A tiles of signed bytes (looked up from the value's code, sign and ls), bsum = 128 C_h + C_l.
 * - the mins of Q2_K / Q4_K: the mins (unsigned bytes) against the low bytes (tdpbuud) and the high bytes
 *   (tdpbusd) of the sums of 16 activations they multiply, msum = 256 C_high + C_low.
 *
 * `qdot8amx_rows` serves whole tiles of 16 output rows from the row count where it is faster (`amx_from`) and
 * returns the first row it left (qdot8_rows takes the rest); it is off on a CPU without AMX (qgemm8.c asks Linux
 * for the tile state), with `qdot8amx_on(0)`, or in a build without AMX. Built with qgemv.c by
 * backends/cpu/kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int qgemm8_amx(int on);     /* qgemm8.c: whether the CPU has AMX and the process may use its tiles */

static int amx_rows_on = 1;         /* qdot8amx_on's switch */

/* Whether qdot8_rows takes the AMX tiles: `on` 0 turns them off, 1 back on (where the CPU has them, from the row
 * count where they are faster), 2 on for every M from 2 (tests); -1 asks. Returns the mode, 0 where they are off. */
int qdot8amx_on(int on) {
    if (on >= 0) amx_rows_on = on;
    return qgemm8_amx(-1) ? amx_rows_on : 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__F16C__) && defined(__linux__)
#include <immintrin.h>
#include "iq2_xxs_groups.h"

#define TILE 16
#define Q8K_BYTES 320       /* q8_quantize's Q8_K block: int8 qs[256], float d, int16 bsums[16], padding */
#define Q8_0_BYTES 36       /* its Q8_0 block: float d, int8 qs[32] */
#define CHUNK 32            /* blocks of 16 weight rows unpacked at a time (Q4_K: half as many): whole rows of K <= 8192
                             * (4096), so that the weight is read in order (docs/cpu.md, "Several rows on AMX tiles") */
#define AHEAD 1024          /* bytes of the weight stream prefetched ahead (the row streams alone run slower) */

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config;

/* Tiles 0-3 as A tiles of 16 rows x `a_cols` bytes or (where bit t of `b_tiles` is set) B tiles of `b_rows` x 64;
 * tmm4-7: 16 x 16 int32 sums. */
static void tiles_on(int a_cols, int b_rows, int b_tiles) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        int b = t < 4 && (b_tiles >> t) & 1;
        c.rows[t] = (uint8_t)(b ? b_rows : 16);
        c.colsb[t] = (uint16_t)(t < 4 && !b ? a_cols : 64);
    }
    asm volatile("" : : "r"(&c) : "memory");       /* keep the stores above before ldtilecfg */
    _tile_loadconfig(&c);
}

static inline float half(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

static inline __m512i halves512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The M rows of Q8_K blocks `x` [M, nb] as B tiles: bq[b][c] (16 x 64 bytes) holds values 64c..64c+63 of block
 * b, row k bytes 4n..4n+3 = values 64c + 4k..4k+3 of activation row n; bm[b][0] and bm[b][1] the low bytes
 * (unsigned) and high bytes (signed) of the sums the mins multiply (Q4_K: bsums 2j + 2j + 1, j < 8; Q2_K: bsums j,
 * j < 16), value j of row n at row j / 4, byte 4n + j % 4; dx[b] lane n = row n's d. Rows past M are zero. */
typedef struct { int8_t (*bq)[4][16][64]; int8_t (*bm)[2][16][64]; float (*dx)[16]; } k_rows;

static int k_rows_pack(int type, const uint8_t *x, int64_t M, int64_t nb, k_rows *r) {
    size_t bytes = (size_t)nb * (sizeof *r->bq + sizeof *r->bm + sizeof *r->dx);
    uint8_t *mem = aligned_alloc(64, bytes);
    if (mem == NULL) return -2;
    memset(mem, 0, bytes);
    r->bq = (void *)mem;
    r->bm = (void *)(mem + nb * sizeof *r->bq);
    r->dx = (void *)(mem + nb * (sizeof *r->bq + sizeof *r->bm));
    /* B row k of chunk c: 4 bytes of each activation row, gathered (lane n: row n's block, rows past M zero) */
    __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32((int)(nb * Q8K_BYTES)));
    __mmask16 present = (__mmask16)((1u << M) - 1);
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < 4; c++)
            for (int k = 0; k < 16; k++)
                _mm512_store_si512(r->bq[b][c][k], _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, rows,
                                                                               x + b * Q8K_BYTES + 64 * c + 4 * k, 1));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = x + (m * nb + b) * Q8K_BYTES;
            int16_t bsums[16];
            memcpy(bsums, blk + 260, sizeof bsums);
            for (int j = 0; j < (type == 12 ? 8 : 16); j++) {
                int v = type == 12 ? bsums[2 * j] + bsums[2 * j + 1] : bsums[j];
                r->bm[b][0][j / 4][4 * m + j % 4] = (int8_t)(v & 255);
                r->bm[b][1][j / 4][4 * m + j % 4] = (int8_t)((v - (v & 255)) / 256);
            }
            memcpy(&r->dx[b][m], blk + 256, 4);
        }
    return 0;
}

static inline void prefetch_ahead(const uint8_t *p, int64_t bytes) {   /* the weight stream, AHEAD bytes on */
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)p + off + AHEAD, _MM_HINT_T0);
}

static inline void copy_row(uint8_t *to, const uint8_t *from, int64_t bytes) {
    prefetch_ahead(from, bytes);
    memcpy(to, from, (size_t)bytes);
}

/* Output columns n..n+15 of y [M, N] from acc[r] (lane m: activation row m), only rows m < M and columns < n1. */
static void store_tile(const __m512 *acc, int64_t M, float *y, int64_t N, int64_t n, int64_t n1, float factor) {
    float out[TILE][TILE];
    for (int r = 0; r < TILE; r++) _mm512_storeu_ps(out[r], acc[r]);
    for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < TILE && n + r < n1; r++) y[m * N + n + r] = factor * out[r][m];
}

/* 16 weight rows of nb blocks, unpacked: per block, the A rows (Q2_K q * scale; Q4_K q * sh, then q * sl; IQ2_XXS
 * the high, then the low parts of its values times their group scales), each weight row's mins against every
 * activation row's bsums (Q2_K, Q4_K) and the rows' scales. A tile is unpacked row after row (the weight read in
 * order, as the one-row kernel reads it) while the tile before it takes its products. */
typedef struct {
    int8_t (*a)[2][TILE][256];
    uint8_t (*mins)[TILE][64];
    float (*d)[TILE], (*dmin)[TILE];
} k_tile;

/* int16 lane j of vector c: the scale index of values 64c + 2j, 2j + 1 (Q2_K: group 4c + j / 8; Q4_K: sub-block
 * 2c + j / 16) */
#define R8(v) v, v, v, v, v, v, v, v
static const int16_t q2_k_group[4][32] __attribute__((aligned(64))) = {
    {R8(0), R8(1), R8(2), R8(3)}, {R8(4), R8(5), R8(6), R8(7)},
    {R8(8), R8(9), R8(10), R8(11)}, {R8(12), R8(13), R8(14), R8(15)}};
static const int16_t q4_k_pick[4][32] __attribute__((aligned(64))) = {
    {R8(0), R8(0), R8(1), R8(1)}, {R8(2), R8(2), R8(3), R8(3)},
    {R8(4), R8(4), R8(5), R8(5)}, {R8(6), R8(6), R8(7), R8(7)}};
#undef R8

static inline void unpack_q2_k(const uint8_t *b, k_tile *t, int64_t k, int r) {
    const __m256i three = _mm256_set1_epi8(3);       /* 84 bytes: scales, qs, d, dmin */
    __m128i scales = _mm_loadu_si128((const __m128i *)b);
    __m512i low16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(scales, _mm_set1_epi8(15))));
    for (int h = 0; h < 2; h++) {
        __m256i q2 = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
        for (int i = 0; i < 4; i += 2) {      /* values 128h + 32i .. 128h + 32i + 63, times their scale */
            int c = 2 * h + i / 2;
            __m512i q = halves512(_mm256_and_si256(_mm256_srli_epi16(q2, 2 * i), three),
                                  _mm256_and_si256(_mm256_srli_epi16(q2, 2 * i + 2), three));
            _mm512_store_si512(t->a[k][0][r] + 64 * c,
                               _mm512_mullo_epi16(q, _mm512_permutexvar_epi16(_mm512_load_si512(q2_k_group[c]), low16)));
        }
    }
    _mm_storeu_si128((__m128i *)t->mins[k][r], _mm_and_si128(_mm_srli_epi16(scales, 4), _mm_set1_epi8(15)));
    t->d[k][r] = half(b + 80);
    t->dmin[k][r] = half(b + 82);
}

static inline void unpack_q4_k(const uint8_t *b, k_tile *t, int64_t k, int r) {
    const __m512i nibble = _mm512_set1_epi8(15);
    uint32_t u[3];              /* 144 bytes: d, dmin, 6-bit scales and mins, qs */
    memcpy(u, b + 4, 12);
    uint64_t sc = (u[0] & 0x3f3f3f3fu) | (uint64_t)((u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)) << 32;
    uint64_t mn = (u[1] & 0x3f3f3f3fu) | (uint64_t)(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)) << 32;
    __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    for (int c = 0; c < 4; c++) {     /* values 64c..64c+63: chunk c's low nibbles, then its high ones */
        __m256i q4 = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
        __m512i q = _mm512_and_si512(halves512(q4, _mm256_srli_epi16(q4, 4)), nibble);
        __m512i scale = _mm512_permutexvar_epi16(_mm512_load_si512(q4_k_pick[c]), scales);
        _mm512_store_si512(t->a[k][0][r] + 64 * c, _mm512_mullo_epi16(q, _mm512_srli_epi16(scale, 2)));
        _mm512_store_si512(t->a[k][1][r] + 64 * c, _mm512_mullo_epi16(q, _mm512_and_si512(scale, _mm512_set1_epi16(3))));
    }
    memcpy(t->mins[k][r], &mn, 8);
    t->d[k][r] = half(b);
    t->dmin[k][r] = half(b + 2);
}

/* IQ2_XXS's A tiles: each value times its group's 2 ls + 1 (|w s| <= 43 x 31) split as 128 h + l, h and l signed
 * bytes (|h| <= 11, -64 <= l < 64), each looked up by one `vpermb` from the value's byte code | ls << 2 (code 0, 1, 2:
 * grid value 8, 25, 43), then negated where the value is; bsum = 128 C_h + C_l. */
static uint64_t iq2_grid_codes[256];                /* the 8 codes of each grid row, as bytes */
static int8_t iq2_scaled_high[64], iq2_scaled_low[64];

/* Build the tables above from qdot8.c's grid (after qdot8_set_iq2_xxs); -1 where a grid value is not 8, 25 or 43. */
int qdot8amx_set_iq2_xxs(void) {
    static const int magnitude[4] = {8, 25, 43, 0};
    for (int i = 0; i < 256; i++) {
        uint64_t codes = 0;
        for (int j = 0; j < 8; j++) {
            int v = (int)((iq2_grid_bytes[i] >> (8 * j)) & 255), c = v == 8 ? 0 : v == 25 ? 1 : v == 43 ? 2 : -1;
            if (c < 0) return -1;
            codes |= (uint64_t)c << (8 * j);
        }
        iq2_grid_codes[i] = codes;
    }
    for (int index = 0; index < 64; index++) {
        int v = magnitude[index & 3] * (2 * (index >> 2) + 1), h = (v + 64) / 128;
        iq2_scaled_high[index] = (int8_t)h;
        iq2_scaled_low[index] = (int8_t)(v - 128 * h);
    }
    return 0;
}

static inline void unpack_iq2_xxs(const uint8_t *b, k_tile *t, int64_t k, int r) {
    __m512i v = _mm512_loadu_si512(b + 2);      /* 66 bytes: d, then qdot8.c's groups: grid rows and sign masks */
    uint64_t negative[4];
    __m512i pairs01, pairs23;
    iq2_xxs_groups(v, negative, &pairs01, &pairs23);
    /* qword g: ls << 2 of group g in byte 0 (ls: the top 4 bits of the group's second word) */
    __m512i ls = _mm512_slli_epi64(_mm512_srli_epi64(v, 60), 2);
    const __m512i high = _mm512_loadu_si512(iq2_scaled_high), low = _mm512_loadu_si512(iq2_scaled_low);
    for (int i = 0; i < 4; i++) {           /* values 64 i .. 64 i + 63: groups 2 i, 2 i + 1 */
        __m512i pair = i < 2 ? pairs01 : pairs23;
        __m256i idx = i % 2 ? _mm512_extracti64x4_epi64(pair, 1) : _mm512_castsi512_si256(pair);
        __m512i codes = _mm512_i32gather_epi64(idx, (const void *)iq2_grid_codes, 8);
        __m512i scale = _mm512_permutexvar_epi8(_mm512_inserti64x4(_mm512_set1_epi8((char)(16 * i)),
                                                                   _mm256_set1_epi8((char)(16 * i + 8)), 1), ls);
        __m512i index = _mm512_or_si512(codes, scale), zero = _mm512_setzero_si512();
        __m512i h = _mm512_permutexvar_epi8(index, high), l = _mm512_permutexvar_epi8(index, low);
        _mm512_store_si512(t->a[k][0][r] + 64 * i, _mm512_mask_sub_epi8(h, negative[i], zero, h));
        _mm512_store_si512(t->a[k][1][r] + 64 * i, _mm512_mask_sub_epi8(l, negative[i], zero, l));
    }
    t->d[k][r] = half(b);
}

/* A unit's blocks (16 weight rows of `kn` blocks from w, rows ldw bytes apart; `interleaved`: iq2repack.c's layout,
 * one block of the 16 rows after another, kn = 1) unpacked into t in the weight's order, row after row, from the
 * `*done`-th to the `target`-th. */
static inline void unpack_until(int type, int interleaved, const uint8_t *w, int64_t ldw, int64_t kn, k_tile *t,
                                int64_t *done, int64_t target) {
    int bb = type == 12 ? 144 : type == 10 ? 84 : 66;
    for (; *done < target; ++*done) {
        int r = (int)(*done / kn);
        int64_t k = *done % kn;
        const uint8_t *b = interleaved ? w + r * bb : w + r * ldw + k * bb;
        prefetch_ahead(b, bb);
        if (type == 12) unpack_q4_k(b, t, k, r);
        else if (type == 10) unpack_q2_k(b, t, k, r);
        else unpack_iq2_xxs(b, t, k, r);
    }
}

static int k_tiles_alloc(int64_t nb, k_tile t[2], void **mem) {
    size_t one = (size_t)nb * (sizeof *t->a + sizeof *t->mins + 2 * sizeof *t->d);
    uint8_t *p = *mem = aligned_alloc(64, 2 * one);
    if (p == NULL) return -2;
    memset(p, 0, 2 * one);      /* the mins' bytes past 8 (Q4_K) or 16 (Q2_K) stay zero */
    for (int i = 0; i < 2; i++, p += one) {
        t[i].a = (void *)p;
        t[i].mins = (void *)(p + nb * sizeof *t->a);
        t[i].d = (void *)(p + nb * (sizeof *t->a + sizeof *t->mins));
        t[i].dmin = t[i].d + nb;
    }
    return 0;
}

/* The 256-value K-quants (12 Q4_K, 10 Q2_K, 16 IQ2_XXS), tiles of 16 weight rows from n0, taken in units of up to
 * `CHUNK` blocks (whole rows at V4 Flash's shapes): while a unit's blocks take their tile products and float steps,
 * the next unit's blocks are unpacked in the weight's order (row after row), in slots between the tile products. */
static int amx_k(int type, int interleaved, const uint8_t *w, int64_t N, int64_t nb, const k_rows *x, int64_t M,
                 float *y, int64_t n0, int64_t n1) {
    int bb = type == 12 ? 144 : type == 10 ? 84 : 66;
    int64_t ldw = nb * bb, kc = interleaved ? 1 : nb < CHUNK / (type == 12 ? 2 : 1) ? nb : CHUNK / (type == 12 ? 2 : 1);
    int64_t chunks = (nb + kc - 1) / kc, units = (n1 - n0 + TILE - 1) / TILE * chunks;
    k_tile t[2];
    void *mem;
    if (k_tiles_alloc(kc, t, &mem)) return -2;
    int32_t sums[4][TILE][TILE] __attribute__((aligned(64)));
    __m512 acc[TILE];
    tiles_on(64, 16, 0xa);     /* A: tmm0, tmm2; B: tmm1, tmm3 */
    int64_t first = 0;
    unpack_until(type, interleaved, w + n0 * ldw, ldw, kc, &t[0], &first, TILE * kc);
    for (int64_t u = 0; u < units; u++) {
        int64_t n = n0 + u / chunks * TILE, c0 = u % chunks * kc, kn = nb - c0 < kc ? nb - c0 : kc;
        int64_t next_n = n0 + (u + 1) / chunks * TILE, next_c0 = (u + 1) % chunks * kc;
        int64_t next_kn = nb - next_c0 < kc ? nb - next_c0 : kc;
        k_tile *cur = &t[u % 2], *next = &t[(u + 1) % 2];
        int64_t done = 0, total = u + 1 < units ? TILE * next_kn : 0;
        const uint8_t *wn = w + next_n * ldw + next_c0 * bb * (interleaved ? TILE : 1);
        /* the next unit's unpacking, spread over 5 slots per block between the tile products (slot s of block k:
         * up to (5 k + s + 1) / (5 kn) of it), so that they overlap */
#define SLOT(s) unpack_until(type, interleaved, wn, ldw, next_kn, next, &done, total * (5 * k + (s) + 1) / (5 * kn))
        if (c0 == 0)
            for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < kn; k++) {
            const int8_t *a = cur->a[k][0][0];
            if (type == 16) {       /* 128 C_h + C_l: A tiles h (tmm0) and l (tmm2), B the activations (tmm1) */
                _tile_zero(4);
                _tile_zero(5);
                for (int c = 0; c < 4; c++) {
                    _tile_loadd(1, x->bq[c0 + k][c], 64);
                    _tile_loadd(0, a + 64 * c, 256);
                    _tile_dpbssd(4, 0, 1);
                    _tile_loadd(2, a + TILE * 256 + 64 * c, 256);
                    _tile_dpbssd(5, 2, 1);
                    SLOT(c);
                }
            } else {
                _tile_zero(4);
                _tile_zero(5);
                for (int c = 0; c < 4; c++) {
                    _tile_loadd(1, x->bq[c0 + k][c], 64);
                    _tile_loadd(0, a + 64 * c, 256);
                    _tile_dpbusd(4, 0, 1);
                    if (type == 12) {
                        _tile_loadd(2, a + TILE * 256 + 64 * c, 256);
                        _tile_dpbusd(5, 2, 1);
                    }
                    SLOT(c);
                }
                /* msum = sum of min times bsums: 256 (mins . high bytes) + (mins . low bytes) */
                _tile_zero(6);
                _tile_zero(7);
                _tile_loadd(0, cur->mins[k], 64);
                _tile_loadd(3, x->bm[c0 + k][0], 64);
                _tile_dpbuud(6, 0, 3);
                _tile_loadd(1, x->bm[c0 + k][1], 64);
                _tile_dpbusd(7, 0, 1);
            }
            SLOT(4);
            __m512 dx = _mm512_load_ps(x->dx[c0 + k]);
            if (type == 16) {
                _tile_stored(4, sums[0], 64);
                _tile_stored(5, sums[1], 64);
                for (int r = 0; r < TILE; r++) {
                    __m512i bsum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[0][r]), 7),
                                                    _mm512_load_si512(sums[1][r]));
                    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(cur->d[k][r]), dx),
                                                                 _mm512_cvtepi32_ps(bsum)));
                }
                continue;
            }
            _tile_stored(4, sums[0], 64);
            if (type == 12) _tile_stored(5, sums[1], 64);
            _tile_stored(6, sums[2], 64);
            _tile_stored(7, sums[3], 64);
            for (int r = 0; r < TILE; r++) {
                __m512i isum = _mm512_load_si512(sums[0][r]);
                if (type == 12) isum = _mm512_add_epi32(_mm512_slli_epi32(isum, 2), _mm512_load_si512(sums[1][r]));
                __m512i msum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[3][r]), 8),
                                                _mm512_load_si512(sums[2][r]));
                __m512 term = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(cur->d[k][r])),
                                                          _mm512_cvtepi32_ps(isum)),
                                            _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(cur->dmin[k][r])),
                                                          _mm512_cvtepi32_ps(msum)));
                acc[r] = _mm512_add_ps(acc[r], term);
            }
        }
        if (c0 + kn == nb) store_tile(acc, M, y, N, n, n1, type == 16 ? 0.125f : 1.0f);
    }
    _tile_release();
    free(mem);
    return 0;
}
#undef SLOT

/* Q8_0 (34 bytes: d, 32 int8) in whole blocks: 16 weight rows as the A tile, read in place from their stored
 * blocks (tile rows ldw bytes apart, 32 bytes each), against the activation rows (M padded to P = 4, 8 or 16) in
 * one B tile per block (row k bytes 4m..4m+3: values 4k..4k+3 of activation row m; rows past M zero), packed once
 * per call; one K = 32 `tdpbssd` gives the 16 x P block sums, stored densely (lane l of vector v: weight row
 * (16 v + l) / P, activation row l % P), and acc += (d_w d_x) isum takes P vectors per block: the one-row kernel's
 * float step. Each block's product is issued two blocks before its float steps (tiles 4-7 in turn); the weight
 * two tiles ahead is prefetched in address order (a tile's 16 rows lie together), a part in each block's steps. */
typedef struct { int8_t b[8][64]; float d[16]; } q8_0_tile;     /* d lane l: activation row l % P's d_x */

static q8_0_tile *q8_0_pack(const uint8_t *xq, int64_t M, int64_t nb, int P) {
    q8_0_tile *t = aligned_alloc(64, (size_t)nb * sizeof *t);
    if (t == NULL) return NULL;
    __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), rows_bytes =
        _mm512_set1_epi32((int)(nb * Q8_0_BYTES));
    __m512i rows = _mm512_mullo_epi32(lanes, rows_bytes);
    __m512i cycle = _mm512_mullo_epi32(_mm512_and_si512(lanes, _mm512_set1_epi32(P - 1)), rows_bytes);
    __mmask16 present = (__mmask16)((1u << M) - 1);
    __mmask16 cycled = _mm512_cmplt_epi32_mask(_mm512_and_si512(lanes, _mm512_set1_epi32(P - 1)), _mm512_set1_epi32((int)M));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = xq + b * Q8_0_BYTES;
        for (int k = 0; k < 8; k++)
            _mm512_store_si512(t[b].b[k], _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, rows,
                                                                      blk + 4 + 4 * k, 1));
        _mm512_store_ps(t[b].d, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), cycled, cycle, blk, 1));
    }
    return t;
}

/* Tiles 0, 2: A (16 x 32 bytes); 1, 3: B (8 x 4P bytes); 4-7: 16 x P sums. */
static void q8_0_tiles_on(int P) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t == 1 || t == 3 ? 8 : 16);
        c.colsb[t] = (uint16_t)(t == 0 || t == 2 ? 32 : 4 * P);
    }
    asm volatile("" : : "r"(&c) : "memory");       /* keep the stores above before ldtilecfg */
    _tile_loadconfig(&c);
}

/* One block's float steps (sums: 16 x P int32, dense), the rows' f16 scales gathered from their blocks at `blk`
 * (`rows`: their offsets); prefetches 9 lines from `ahead`. */
static inline __attribute__((always_inline)) void q8_0_steps(const int P, __m512 *acc, const uint8_t *blk,
        __m512i rows, const float *dx, const int32_t *sums, const char *ahead) {
    float dw[TILE] __attribute__((aligned(64)));
    __m512 dwv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(rows, blk, 1)));
    _mm512_store_ps(dw, dwv);
    __m512 x = _mm512_load_ps(dx);
#pragma GCC unroll 16
    for (int v = 0; v < P; v++) {
        if (v < 9) _mm_prefetch(ahead + 64 * v, _MM_HINT_T1);
        __m512 d = P == TILE ? _mm512_set1_ps(dw[v])       /* lane l: weight row 16 v / P + l / P */
                             : _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * v),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), P == 8 ? 3 : 2), dwv);
        acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(_mm512_mul_ps(d, x), _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * v))));
    }
    if (P < 9)
        for (int v = P; v < 9; v++) _mm_prefetch(ahead + 64 * v, _MM_HINT_T1);
}

static inline __attribute__((always_inline)) void amx_q8_0_tiles(const int P, const uint8_t *w, int64_t N,
        int64_t nb, const q8_0_tile *t, int64_t M, float *y, int64_t n0, int64_t n1) {
    int64_t ldw = nb * 34;
    int32_t sums[2][TILE * TILE] __attribute__((aligned(64)));
    __m512 acc[TILE];
    __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32((int)ldw));
    q8_0_tiles_on(P);
    for (int64_t n = n0; n < n1; n += TILE) {
        const uint8_t *wt = w + n * ldw;
        const char *ahead = (const char *)wt + 2 * TILE * ldw;
        for (int v = 0; v < P; v++) acc[v] = _mm512_setzero_ps();
#define ISSUE(k, ta, tb, tc) if ((k) < nb) { _tile_loadd(ta, wt + 34 * (k) + 2, ldw); _tile_loadd(tb, t[k].b, 64); \
                                            _tile_zero(tc); _tile_dpbssd(tc, ta, tb); }
#define RETIRE(k, tc, s) if ((k) < nb) { _tile_stored(tc, sums[s], 4 * P); \
                                         q8_0_steps(P, acc, wt + 34 * (k), rows, t[k].d, sums[s], ahead + TILE * 34 * (k)); }
        ISSUE(0, 0, 1, 4);
        ISSUE(1, 2, 3, 5);
        for (int64_t b = 0; b < nb; b += 4) {
            ISSUE(b + 2, 0, 1, 6);
            RETIRE(b, 4, 0);
            ISSUE(b + 3, 2, 3, 7);
            RETIRE(b + 1, 5, 1);
            ISSUE(b + 4, 0, 1, 4);
            RETIRE(b + 2, 6, 0);
            ISSUE(b + 5, 2, 3, 5);
            RETIRE(b + 3, 7, 1);
        }
#undef ISSUE
#undef RETIRE
        float out[TILE * TILE];
        for (int v = 0; v < P; v++) _mm512_storeu_ps(out + 16 * v, acc[v]);
        for (int64_t m = 0; m < M; m++)
            for (int r = 0; r < TILE && n + r < n1; r++) y[m * N + n + r] = out[r * P + m];
    }
    _tile_release();
}

static int amx_q8_0(const uint8_t *w, int64_t N, int64_t nb, const uint8_t *xq, int64_t M, float *y,
                    int64_t n0, int64_t n1) {
    int P = M <= 4 ? 4 : M <= 8 ? 8 : TILE;
    q8_0_tile *t = q8_0_pack(xq, M, nb, P);
    if (t == NULL) return -2;
    if (P == 4) amx_q8_0_tiles(4, w, N, nb, t, M, y, n0, n1);
    else if (P == 8) amx_q8_0_tiles(8, w, N, nb, t, M, y, n0, n1);
    else amx_q8_0_tiles(TILE, w, N, nb, t, M, y, n0, n1);
    free(t);
    return 0;
}

/* The fewest rows for which the tiles beat qdot8_rows' AVX-512 path on this machine (one thread, one routed
 * expert's weight read from memory, where qdot8_rows gets 2..16 rows of these types; Q8_0: the attention's q_b:
 * docs/cpu.md, "Several rows on AMX tiles"); below it a tile's fixed cost (the unpacked A rows written and read
 * back as tiles, the B tiles reloaded per block) outweighs the rows it saves. 17 for a type it does not serve. */
static int amx_from(int type) {
    switch (type) {
    case 8: return 2;       /* Q8_0: nothing unpacked, faster from 2 rows (docs/cpu.md, session 12) */
    case 12: return 9;      /* Q4_K */
    case 10: return 6;      /* Q2_K (its AVX-512 rows share each block's unpacking: qdot8.c's rows4_q2_k) */
    case 16: return 6;      /* IQ2_XXS (likewise: rows4_iq2_xxs) */
    default: return TILE + 1;
    }
}

/* Output rows from n0 of y [M, N] for a plain weight of GGUF type `type` (8 Q8_0, 12 Q4_K, 10 Q2_K, 16 IQ2_XXS)
 * against q8_quantize's rows `xq`, M = amx_from(type)..16 (2..16 in mode 2), in whole tiles of 16 rows (the last
 * tile may end past n1 where the weight has the rows: they are read, not stored). Returns the first output row it did not compute (n0 when it
 * serves nothing: another type or M, K not whole blocks, AMX off), or -2 when out of memory. */
int64_t qdot8amx_rows(int type, const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                      int64_t n0, int64_t n1) {
    int k_type = type == 12 || type == 10 || type == 16;
    int mode = qdot8amx_on(-1);
    if (mode == 0 || M < (mode == 2 && amx_from(type) <= TILE ? 2 : amx_from(type)) || M > TILE ||
        K % (k_type ? 256 : 32))
        return n0;
    int64_t end = n0 + (n1 - n0) / TILE * TILE;
    if (end < n1 && n1 - (n1 - n0) % TILE + TILE <= N) end = n1;      /* a last partial tile inside the weight */
    if (end == n0) return n0;
    if (type == 8) return amx_q8_0(w, N, K / 32, xq, M, y, n0, end) ? -2 : end;
    k_rows x;
    if (k_rows_pack(type, xq, M, K / 256, &x)) return -2;
    int rc = amx_k(type, 0, w, N, K / 256, &x, M, y, n0, end);
    free(x.bq);
    return rc ? rc : end;
}

/* Output rows [n0, n1) (whole groups of 16) of y [M, N] for an IQ2_XXS weight in iq2repack.c's layout, M = 1..16, on
 * the tiles, with qdot8's bits; 0, or -2 when out of memory. */
int qdot8amx_iq2_interleaved(const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                             int64_t n0, int64_t n1) {
    k_rows x;
    if (k_rows_pack(16, xq, M, K / 256, &x)) return -2;
    int rc = amx_k(16, 1, w, N, K / 256, &x, M, y, n0, n1);
    free(x.bq);
    return rc;
}
#else
int qdot8amx_set_iq2_xxs(void) { return 0; }      /* no tiles here: no tables */

int qdot8amx_iq2_interleaved(const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                             int64_t n0, int64_t n1) {
    (void)w, (void)N, (void)K, (void)xq, (void)M, (void)y, (void)n0, (void)n1;
    return -1;      /* not called: iq2repack.c takes the tiles only in a build with its vector kernels and AMX */
}

int64_t qdot8amx_rows(int type, const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                      int64_t n0, int64_t n1) {
    (void)type, (void)w, (void)N, (void)K, (void)xq, (void)M, (void)y, (void)n1;
    return n0;
}
#endif
