/* Several rows (M = 2..16) of `--cpu-dot q8` on AMX-INT8 (Sapphire Rapids and later): qdot8_rows' products of a
 * plain Q8_0, Q4_K, Q2_K or IQ2_XXS weight, 16 weight rows at a time, with the integer block sums of all rows
 * from tile products (`tdpbssd` / `tdpbusd`: 16 x 16 x 64 int8 products per instruction) instead of one
 * `vpmaddubsw` chain per row. Each weight block is unpacked once (as the one-row kernel does) into int8 rows
 * that form the A tile; the activations, rounded by q8_quantize as for qdot8, are laid out once per call as B
 * tiles. The integer sums are exact, and every float step is the one-row kernel's, in its order
 * (ops/q8_activations.py), so each output has the same bits as qdot8's:
 *
 * - Q8_0: decode's 8 lanes (lane l adds (d_w d_x) times the integer dot of values 4l..4l+3 of each block) come
 *   from a B tile holding two activation rows spread over 16 columns, column 8j + l seeing only lane l of row j.
 * - Q2_K: each value times its sub-block's 4-bit scale fits a byte (3 x 15), so the A tile holds q * scale and
 *   one tile product per 64 values gives isum whole.
 * - Q4_K: the 6-bit scale split as 4 sh + sl (sh < 16, sl < 4): A tiles q * sh and q * sl (at most 225, as
 *   unsigned bytes), isum = 4 C_h + C_l.
 * - IQ2_XXS: the signed grid values as A, one tile product per 32-value group, the groups' sums times
 *   2 ls + 1 added as integers.
 * - the mins of Q2_K / Q4_K: `vpdpwssd` of the int16 mins against each row's 16-value sums (bsums).
 *
 * `qdot8amx_rows` serves whole tiles of 16 output rows and returns the first row it left (qdot8_rows takes the
 * rest); it is off on a CPU without AMX (qgemm8.c asks Linux for the tile state), with `qdot8amx_on(0)`, or in
 * a build without AMX. Built with qgemv.c by backends/cpu/kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int qgemm8_amx(int on);     /* qgemm8.c: whether the CPU has AMX and the process may use its tiles */

static int amx_rows_on = 1;         /* qdot8amx_on's switch */

/* Whether qdot8_rows takes the AMX tiles: `on` 0 turns them off, 1 back on (where the CPU has them), -1 asks. */
int qdot8amx_on(int on) {
    if (on >= 0) amx_rows_on = on;
    return amx_rows_on && qgemm8_amx(-1);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__F16C__) && defined(__linux__)
#include <immintrin.h>

#define TILE 16
#define Q8K_BYTES 320       /* q8_quantize's Q8_K block: int8 qs[256], float d, int16 bsums[16], padding */
#define Q8_0_BYTES 36       /* its Q8_0 block: float d, int8 qs[32] */

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config;

static uint64_t grid_bytes[256];    /* IQ2_XXS: the 8 grid values of each index, as bytes (qdot8amx_set_iq2_xxs) */

void qdot8amx_set_iq2_xxs(const uint8_t *grid) { memcpy(grid_bytes, grid, sizeof grid_bytes); }

/* tmm0 and tmm2: A tiles of 16 rows x `a_cols` bytes; tmm1 and tmm3: B tiles of `b_rows` x 64; tmm4-7: 16 x 16
 * int32 sums. */
static void tiles_on(int a_cols, int b_rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t == 1 || t == 3 ? b_rows : 16);
        c.colsb[t] = (uint16_t)(t == 0 || t == 2 ? a_cols : 64);
    }
    asm volatile("" : : "r"(&c) : "memory");       /* keep the stores above before ldtilecfg */
    _tile_loadconfig(&c);
}

static inline float half(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

static inline __m512i halves512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The M rows of Q8_K blocks `x` [M, nb] as B tiles: bq[b][c] (16 x 64 bytes) holds values 64c..64c+63 of block
 * b, row k bytes 4n..4n+3 = values 64c + 4k..4k+3 of activation row n; bs[b][t] lane n = row n's bsums 2t, 2t+1
 * (int16 pairs); dx[b] lane n = row n's d. Rows past M are zero. */
typedef struct { int8_t (*bq)[4][16][64]; int32_t (*bs)[8][16]; float (*dx)[16]; } k_rows;

static int k_rows_pack(const uint8_t *x, int64_t M, int64_t nb, k_rows *r) {
    size_t bytes = (size_t)nb * (sizeof *r->bq + sizeof *r->bs + sizeof *r->dx);
    uint8_t *mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (mem == NULL) return -2;
    memset(mem, 0, bytes);
    r->bq = (void *)mem;
    r->bs = (void *)(mem + nb * sizeof *r->bq);
    r->dx = (void *)(mem + nb * (sizeof *r->bq + sizeof *r->bs));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = x + (m * nb + b) * Q8K_BYTES;
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 16; k++) memcpy(&r->bq[b][c][k][4 * m], blk + 64 * c + 4 * k, 4);
            for (int t = 0; t < 8; t++) memcpy(&r->bs[b][t][m], blk + 256 + 4 + 4 * t, 4);
            memcpy(&r->dx[b][m], blk + 256, 4);
        }
    return 0;
}

/* Row r's mins (16 int16, `mins`) against every activation row's bsums of block b: the 16 int32 msums. */
static inline __m512i msums(__m256i mins, const int32_t (*bs)[16]) {
    int32_t pair[8];
    _mm256_storeu_si256((__m256i *)pair, mins);
    __m512i s = _mm512_setzero_si512();
    for (int t = 0; t < 8; t++) s = _mm512_dpwssd_epi32(s, _mm512_set1_epi32(pair[t]), _mm512_load_si512(bs[t]));
    return s;
}

/* Output columns n..n+15 of y [M, N] from acc[r] (lane m: activation row m), only rows m < M and columns < n1. */
static void store_tile(const __m512 *acc, int64_t M, float *y, int64_t N, int64_t n, int64_t n1, float factor) {
    float out[TILE][TILE];
    for (int r = 0; r < TILE; r++) _mm512_storeu_ps(out[r], acc[r]);
    for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < TILE && n + r < n1; r++) y[m * N + n + r] = factor * out[r][m];
}

/* Q2_K (84 bytes: scales, qs, d, dmin), tiles of 16 weight rows from n0. */
static void amx_q2_k(const uint8_t *w, int64_t N, int64_t nb, const k_rows *x, int64_t M, float *y,
                     int64_t n0, int64_t n1) {
    int64_t ldw = nb * 84;
    int8_t a[TILE][256] __attribute__((aligned(64)));
    int32_t sums[TILE][TILE] __attribute__((aligned(64)));
    __m512i group[4];       /* int16 lane t of vector c: the scale of values 64c + 2t, 2t + 1 (group 4c + t / 8) */
    for (int c = 0; c < 4; c++) {
        int16_t idx[32];
        for (int t = 0; t < 32; t++) idx[t] = (int16_t)(4 * c + t / 8);
        group[c] = _mm512_loadu_si512(idx);
    }
    const __m256i three = _mm256_set1_epi8(3);
    tiles_on(64, 16);
    for (int64_t n = n0; n < n1; n += TILE) {
        __m512 acc[TILE];
        for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < nb; k++) {
            __m512i msum[TILE];
            float d[TILE], dmin[TILE];
            for (int r = 0; r < TILE; r++) {
                const uint8_t *b = w + (n + r) * ldw + k * 84;
                __m128i scales = _mm_loadu_si128((const __m128i *)b);
                __m512i low16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(scales, _mm_set1_epi8(15))));
                for (int h = 0; h < 2; h++) {
                    __m256i q2 = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
                    for (int i = 0; i < 4; i += 2) {      /* values 128h + 32i .. 128h + 32i + 63, times their scale */
                        int c = 2 * h + i / 2;
                        __m512i q = halves512(_mm256_and_si256(_mm256_srli_epi16(q2, 2 * i), three),
                                              _mm256_and_si256(_mm256_srli_epi16(q2, 2 * i + 2), three));
                        _mm512_store_si512(a[r] + 64 * c, _mm512_mullo_epi16(q, _mm512_permutexvar_epi16(group[c], low16)));
                    }
                }
                msum[r] = msums(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scales, 4), _mm_set1_epi8(15))),
                                x->bs[k]);
                d[r] = half(b + 80);
                dmin[r] = half(b + 82);
            }
            _tile_zero(4);
            for (int c = 0; c < 4; c++) {
                _tile_loadd(0, a[0] + 64 * c, 256);
                _tile_loadd(1, x->bq[k][c], 64);
                _tile_dpbusd(4, 0, 1);
            }
            _tile_stored(4, sums, 64);
            __m512 dx = _mm512_load_ps(x->dx[k]);
            for (int r = 0; r < TILE; r++) {
                __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(d[r])),
                                                       _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]))),
                                         _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(dmin[r])),
                                                       _mm512_cvtepi32_ps(msum[r])));
                acc[r] = _mm512_add_ps(acc[r], t);
            }
        }
        store_tile(acc, M, y, N, n, n1, 1.0f);
    }
    _tile_release();
}

/* Q4_K (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, qs), tiles of 16 weight rows from n0. */
static void amx_q4_k(const uint8_t *w, int64_t N, int64_t nb, const k_rows *x, int64_t M, float *y,
                     int64_t n0, int64_t n1) {
    int64_t ldw = nb * 144;
    int8_t high[TILE][256] __attribute__((aligned(64))), low[TILE][256] __attribute__((aligned(64)));
    int32_t sh[TILE][TILE] __attribute__((aligned(64))), sl[TILE][TILE] __attribute__((aligned(64)));
    __m512i pick[4];        /* int16 lanes 0-15 <- scale 2c, 16-31 <- scale 2c + 1 */
    for (int c = 0; c < 4; c++)
        pick[c] = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1);
    const __m256i twice = _mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i nibble = _mm512_set1_epi8(15);
    tiles_on(64, 16);
    for (int64_t n = n0; n < n1; n += TILE) {
        __m512 acc[TILE];
        for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < nb; k++) {
            __m512i msum[TILE];
            float d[TILE], dmin[TILE];
            for (int r = 0; r < TILE; r++) {
                const uint8_t *b = w + (n + r) * ldw + k * 144;
                uint32_t u[3];          /* the 6-bit scales and mins, 8 bytes each */
                memcpy(u, b + 4, 12);
                uint64_t sc = (u[0] & 0x3f3f3f3fu) | (uint64_t)((u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)) << 32;
                uint64_t mn = (u[1] & 0x3f3f3f3fu) | (uint64_t)(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)) << 32;
                __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
                for (int c = 0; c < 4; c++) {     /* values 64c..64c+63: chunk c's low nibbles, then its high ones */
                    __m256i q4 = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
                    __m512i q = _mm512_and_si512(halves512(q4, _mm256_srli_epi16(q4, 4)), nibble);
                    __m512i scale = _mm512_permutexvar_epi16(pick[c], scales);
                    _mm512_store_si512(high[r] + 64 * c, _mm512_mullo_epi16(q, _mm512_srli_epi16(scale, 2)));
                    _mm512_store_si512(low[r] + 64 * c, _mm512_mullo_epi16(q, _mm512_and_si512(scale, _mm512_set1_epi16(3))));
                }
                msum[r] = msums(_mm256_permutexvar_epi16(twice, _mm256_castsi128_si256(
                                    _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn)))), x->bs[k]);
                d[r] = half(b);
                dmin[r] = half(b + 2);
            }
            _tile_zero(4);
            _tile_zero(5);
            for (int c = 0; c < 4; c++) {
                _tile_loadd(1, x->bq[k][c], 64);
                _tile_loadd(0, high[0] + 64 * c, 256);
                _tile_loadd(2, low[0] + 64 * c, 256);
                _tile_dpbusd(4, 0, 1);
                _tile_dpbusd(5, 2, 1);
            }
            _tile_stored(4, sh, 64);
            _tile_stored(5, sl, 64);
            __m512 dx = _mm512_load_ps(x->dx[k]);
            for (int r = 0; r < TILE; r++) {
                __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sh[r]), 2), _mm512_load_si512(sl[r]));
                __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(d[r])), _mm512_cvtepi32_ps(isum)),
                                         _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(dmin[r])),
                                                       _mm512_cvtepi32_ps(msum[r])));
                acc[r] = _mm512_add_ps(acc[r], t);
            }
        }
        store_tile(acc, M, y, N, n, n1, 1.0f);
    }
    _tile_release();
}

/* IQ2_XXS (66 bytes: d, 8 groups of 4 grid indices and 32 bits of signs and scale), tiles of 16 weight rows. */
static void amx_iq2_xxs(const uint8_t *w, int64_t N, int64_t nb, const k_rows *x, int64_t M, float *y,
                        int64_t n0, int64_t n1) {
    int64_t ldw = nb * 66;
    int8_t a[TILE][256] __attribute__((aligned(64)));
    int32_t sums[8][TILE][TILE] __attribute__((aligned(64)));
    const __m512i pack = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x3b3a3938, 0x33323130, 0x2b2a2928,
                                          0x23222120, 0x1b1a1918, 0x13121110, 0x0b0a0908, 0x03020100);
    tiles_on(32, 8);
    for (int64_t n = n0; n < n1; n += TILE) {
        __m512 acc[TILE];
        for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < nb; k++) {
            int32_t scale[TILE][8];
            float d[TILE];
            for (int r = 0; r < TILE; r++) {    /* qdot8.c's unpacking: grid rows and sign masks, 64 values a time */
                const uint8_t *b = w + (n + r) * ldw + k * 66;
                __m512i v = _mm512_loadu_si512(b + 2);
                __m512i t = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720), v),
                                             _mm512_set1_epi8(0x7f));
                __m512i parity = _mm512_and_si512(_mm512_popcnt_epi8(t), _mm512_set1_epi8(1));
                __m512i signs = _mm512_or_si512(t, _mm512_slli_epi16(parity, 7));
                uint64_t negative[4];
                _mm256_storeu_si256((__m256i *)negative, _mm512_castsi512_si256(_mm512_permutexvar_epi8(pack, signs)));
                __m512i index = _mm512_permutexvar_epi8(pack, v);
                __m512i pairs01 = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(index));
                __m512i pairs23 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(index, 1));
                for (int i = 0; i < 4; i++) {
                    __m512i pair = i < 2 ? pairs01 : pairs23;
                    __m256i idx = i % 2 ? _mm512_extracti64x4_epi64(pair, 1) : _mm512_castsi512_si256(pair);
                    __m512i grid = _mm512_i32gather_epi64(idx, (const void *)grid_bytes, 8);
                    _mm512_store_si512(a[r] + 64 * i, _mm512_mask_sub_epi8(grid, negative[i], _mm512_setzero_si512(), grid));
                }
                for (int g = 0; g < 8; g++) {
                    uint32_t bits;
                    memcpy(&bits, b + 2 + 8 * g + 4, 4);
                    scale[r][g] = (int32_t)(2 * (bits >> 28) + 1);
                }
                d[r] = half(b);
            }
            for (int g = 0; g < 8; g++) {       /* group g: values 32g..32g+31, rows 8 (g % 2).. of chunk g / 2 */
                _tile_loadd(0, a[0] + 32 * g, 256);
                _tile_loadd(1, x->bq[k][g / 2][8 * (g % 2)], 64);
                _tile_zero(4);
                _tile_dpbssd(4, 0, 1);
                _tile_stored(4, sums[g], 64);
            }
            __m512 dx = _mm512_load_ps(x->dx[k]);
            for (int r = 0; r < TILE; r++) {
                __m512i bsum = _mm512_setzero_si512();
                for (int g = 0; g < 8; g++)
                    bsum = _mm512_add_epi32(bsum, _mm512_mullo_epi32(_mm512_load_si512(sums[g][r]),
                                                                     _mm512_set1_epi32(scale[r][g])));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dx),
                                                             _mm512_cvtepi32_ps(bsum)));
            }
        }
        store_tile(acc, M, y, N, n, n1, 0.125f);
    }
    _tile_release();
}

/* Q8_0 (34 bytes: d, 32 int8) in decode's 8 lanes, tiles of 16 weight rows read in place as A. The activation
 * rows go in pairs: B tile (block b, pair p) row k holds values 4k..4k+3 of row 2p in column k and of row 2p + 1
 * in column 8 + k, zeros elsewhere, so column 8j + l of the product is lane l of row 2p + j. */
static int amx_q8_0(const uint8_t *w, int64_t N, int64_t nb, const uint8_t *xq, int64_t M, float *y,
                    int64_t n0, int64_t n1) {
    int64_t ldw = nb * 34, pairs = (M + 1) / 2;
    size_t tiles = (size_t)(nb * pairs);
    uint8_t *mem = aligned_alloc(64, tiles * (512 + 64) + (size_t)pairs * TILE * 64);
    if (mem == NULL) return -2;
    int8_t (*bq)[8][64] = (void *)mem;                              /* [nb * pairs] B tiles */
    float (*dx)[16] = (void *)(mem + tiles * 512);                  /* lane 8j + l: row 2p + j's d */
    __m512 *acc = (__m512 *)(mem + tiles * 576);                    /* [pairs][16 weight rows][8 lanes, 2 rows] */
    memset(mem, 0, tiles * 576);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = xq + (m * nb + b) * Q8_0_BYTES;
            int64_t t = b * pairs + m / 2;
            for (int l = 0; l < 8; l++) {
                memcpy(&bq[t][l][4 * (8 * (m % 2) + l)], blk + 4 + 4 * l, 4);
                memcpy(&dx[t][8 * (m % 2) + l], blk, 4);
            }
        }
    int32_t sums[TILE][TILE] __attribute__((aligned(64)));
    tiles_on(32, 8);
    for (int64_t n = n0; n < n1; n += TILE) {
        for (int64_t i = 0; i < pairs * TILE; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + n * ldw + b * 34;
            float d[TILE];
            for (int r = 0; r < TILE; r++) d[r] = half(blk + r * ldw);
            _tile_loadd(0, blk + 2, ldw);
            for (int64_t p = 0; p < pairs; p++) {
                _tile_loadd(1, bq[b * pairs + p], 64);
                _tile_zero(4);
                _tile_dpbssd(4, 0, 1);
                _tile_stored(4, sums, 64);
                __m512 dxp = _mm512_load_ps(dx[b * pairs + p]);
                __m512 *a = acc + p * TILE;
                for (int r = 0; r < TILE; r++)
                    a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dxp),
                                                             _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]))));
            }
        }
        for (int64_t m = 0; m < M; m++) {
            const float *lanes = (const float *)(acc + (m / 2) * TILE) + 8 * (m % 2);
            for (int r = 0; r < TILE && n + r < n1; r++) {
                float sum = 0.0f;       /* the lanes in order, as the one-row kernel */
                for (int l = 0; l < 8; l++) sum += lanes[16 * r + l];
                y[m * N + n + r] = sum;
            }
        }
    }
    _tile_release();
    free(mem);
    return 0;
}

/* Output rows from n0 of y [M, N] for a plain weight of GGUF type `type` (8 Q8_0, 12 Q4_K, 10 Q2_K, 16 IQ2_XXS)
 * against q8_quantize's rows `xq`, M = 2..16, in whole tiles of 16 rows (the last tile may end past n1 where the
 * weight has the rows: they are read, not stored). Returns the first output row it did not compute (n0 when it
 * serves nothing: another type or M, K not whole blocks, AMX off), or -2 when out of memory. */
int64_t qdot8amx_rows(int type, const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                      int64_t n0, int64_t n1) {
    int k_type = type == 12 || type == 10 || type == 16;
    if (M < 2 || M > TILE || !(k_type || type == 8) || K % (k_type ? 256 : 32) || !qdot8amx_on(-1)) return n0;
    int64_t end = n0 + (n1 - n0) / TILE * TILE;
    if (end < n1 && n1 - (n1 - n0) % TILE + TILE <= N) end = n1;      /* a last partial tile inside the weight */
    if (end == n0) return n0;
    if (type == 8) return amx_q8_0(w, N, K / 32, xq, M, y, n0, end) ? -2 : end;
    k_rows x;
    if (k_rows_pack(xq, M, K / 256, &x)) return -2;
    if (type == 12) amx_q4_k(w, N, K / 256, &x, M, y, n0, end);
    else if (type == 10) amx_q2_k(w, N, K / 256, &x, M, y, n0, end);
    else amx_iq2_xxs(w, N, K / 256, &x, M, y, n0, end);
    free(x.bq);
    return end;
}
#else
void qdot8amx_set_iq2_xxs(const uint8_t *grid) { (void)grid; }

int64_t qdot8amx_rows(int type, const uint8_t *w, int64_t N, int64_t K, const void *xq, int64_t M, float *y,
                      int64_t n0, int64_t n1) {
    (void)type, (void)w, (void)N, (void)K, (void)xq, (void)M, (void)y, (void)n1;
    return n0;
}
#endif
