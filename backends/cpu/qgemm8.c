/* Prefill's 8-bit GEMM for Q8_0 weights (`--cpu-dot q8`, more than 16 rows): y[m, n] = sum_k W[n, k] x[m, k] with
 * x rounded to Q8_0 blocks as qdot8.c's q8_quantize (kind 1) does (`qgemm8_quantize`, 16 values a vector on
 * AVX-512). Each 32-value block gives an exact integer sum, and the blocks are added in order as floats:
 * acc += (d_w d_x) * isum, as llama.cpp's generic ggml_vec_dot_q8_0_q8_0 and its AMX mmq (the reference:
 * ops/q8_activations.py, `qgemm8`). With AMX-INT8 (Sapphire Rapids) 16 weight rows (read in place from their
 * stored blocks) against 16 activation rows are one `tdpbssd` per block, the activations packed once per call
 * into tiles (`qgemm8_quantize`). Without AMX the same packed tiles feed a register-blocked GEMM: 4 weight rows
 * against 32 activation rows, each 4-byte group of a weight block broadcast against one 32-bit lane per activation
 * row (AVX-512 VNNI `vpdpbusd` on the activations + 128, less 128 * the block's weight sum; or AVX2 maddubs/madd
 * with the weight's sign moved onto the activations), so no horizontal sums. Rows past the last group of 4 and
 * plain C builds take a per-(row, block) loop. All paths compute the same integers and the same float steps, so
 * the output is the same bits on every build, for any thread split (each output depends only on its two rows);
 * pool.c splits output rows in whole tiles of 16 (`qgemm8_tiles`). Built with qgemv.c by backends/cpu/kernels.py.
 */
#include <stdint.h>
#include <string.h>
#include "half.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__linux__)
#define G8_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define G8_BLOCK_BYTES 34       /* a Q8_0 weight block: f16 d, 32 int8 */

typedef struct { float d; int8_t qs[32]; } g8_act;                  /* q8_quantize's Q8_0 block (36 bytes) */
typedef struct { int8_t b[8][64]; float d[16]; } g8_tile;          /* 16 rows of one block, AMX's B layout */

static inline int32_t g8_dot32(const int8_t *w, const int8_t *x) {     /* the exact integer dot of one block */
#if defined(__AVX2__)
    __m256i a = _mm256_loadu_si256((const __m256i *)w), b = _mm256_loadu_si256((const __m256i *)x);
    /* |w| as unsigned (-128 -> 128) times x with w's sign: pairs reach at most 2 * 128 * 127, no saturation */
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)),
                                  _mm256_set1_epi16(1));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
#else
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (int32_t)w[i] * x[i];
    return s;
#endif
}

/* One output: weight row `row` (nb Q8_0 blocks) against activation row `x`, blocks added in order. */
static float g8_row(const uint8_t *row, const g8_act *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, row += G8_BLOCK_BYTES) {
        float d = f16_to_f32(row) * x[b].d;
        acc = acc + d * (float)g8_dot32((const int8_t *)row + 2, x[b].qs);
    }
    return acc;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define G8_VNNI 1
#endif

/* The register-blocked paths without AMX: NR weight rows against T activation tiles (the packed layout below: one
 * 32-bit lane per activation row holding 4 of its values), so each loaded activation vector serves NR weight rows
 * and each weight dword, broadcast, serves every activation row of the T tiles; no horizontal sums. */
#define G8_NR 4

#ifdef G8_VNNI
/* -128 * (the sum of each block's 32 weights) for G8_NR rows: vpdpbusd takes unsigned activations (x + 128),
 * so its sums carry 128 * sum(w) more than the signed dot. */
static inline __m128i g8_minus_128_sums(const uint8_t *w, int64_t ldw) {
    __m256i s[G8_NR], k = _mm256_set1_epi8((char)0x80);
    for (int r = 0; r < G8_NR; r++)
        s[r] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), k, _mm256_loadu_si256((const __m256i *)(w + r * ldw + 2)));
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    return _mm_sub_epi32(_mm_setzero_si128(), _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* G8_NR weight rows from `w` (stride `ldw`) against T 16-row activation tiles `t` (tile j's blocks at t + j * nb),
 * every block in order (AVX-512 VNNI): out[r][16 j + i] = y for weight row r, activation row 16 j + i. */
static inline __attribute__((always_inline)) void g8_vnni_rows(const uint8_t *w, int64_t ldw, const g8_tile *t,
                                                               int64_t nb, int T, float *out) {
    __m512 acc[G8_NR][2];
    __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int r = 0; r < G8_NR; r++)
        for (int j = 0; j < T; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += G8_BLOCK_BYTES) {
        __m128i minus = g8_minus_128_sums(w, ldw);
        __m512i sum[G8_NR][2];
        for (int r = 0; r < G8_NR; r++) {
            __m512i c = _mm512_permutexvar_epi32(_mm512_set1_epi32(r), _mm512_castsi128_si512(minus));
            for (int j = 0; j < T; j++) sum[r][j] = c;
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m512i x[2];
            for (int j = 0; j < T; j++) x[j] = _mm512_xor_si512(_mm512_loadu_si512(t[j * nb + b].b[i]), flip);
            for (int r = 0; r < G8_NR; r++) {
                int32_t q;
                memcpy(&q, w + r * ldw + 2 + 4 * i, 4);
                __m512i wq = _mm512_set1_epi32(q);
                for (int j = 0; j < T; j++) sum[r][j] = _mm512_dpbusd_epi32(sum[r][j], x[j], wq);
            }
        }
        for (int j = 0; j < T; j++) {
            __m512 dx = _mm512_loadu_ps(t[j * nb + b].d);
            for (int r = 0; r < G8_NR; r++) {
                __m512 d = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(w + r * ldw)), dx);
                acc[r][j] = _mm512_add_ps(acc[r][j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum[r][j])));
            }
        }
    }
    for (int r = 0; r < G8_NR; r++)
        for (int j = 0; j < T; j++) _mm512_storeu_ps(out + r * 32 + 16 * j, acc[r][j]);
}
#elif defined(__AVX2__) && defined(__F16C__)
/* As above on AVX2 (8 activation rows a vector): |w| times x with w's sign (maddubs pairs reach at most
 * 2 * 128 * 127, no saturation), pairs added by madd; T tiles are 2T vectors. */
static inline __attribute__((always_inline)) void g8_avx2_rows(const uint8_t *w, int64_t ldw, const g8_tile *t,
                                                               int64_t nb, int T, float *out) {
    __m256 acc[G8_NR][4];
    __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < G8_NR; r++)
        for (int h = 0; h < 2 * T; h++) acc[r][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += G8_BLOCK_BYTES) {
        __m256i sum[G8_NR][4];
        for (int r = 0; r < G8_NR; r++)
            for (int h = 0; h < 2 * T; h++) sum[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m256i x[4];
            for (int h = 0; h < 2 * T; h++)
                x[h] = _mm256_loadu_si256((const __m256i *)(t[(h / 2) * nb + b].b[i] + 32 * (h % 2)));
            for (int r = 0; r < G8_NR; r++) {
                int32_t q;
                memcpy(&q, w + r * ldw + 2 + 4 * i, 4);
                __m256i wq = _mm256_set1_epi32(q), aw = _mm256_abs_epi8(wq);
                for (int h = 0; h < 2 * T; h++) {
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x[h], wq)), ones);
                    sum[r][h] = _mm256_add_epi32(sum[r][h], p);
                }
            }
        }
        for (int h = 0; h < 2 * T; h++) {
            __m256 dx = _mm256_loadu_ps(t[(h / 2) * nb + b].d + 8 * (h % 2));
            for (int r = 0; r < G8_NR; r++) {
                __m256 d = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(w + r * ldw)), dx);
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(d, _mm256_cvtepi32_ps(sum[r][h])));
            }
        }
    }
    for (int r = 0; r < G8_NR; r++)
        for (int h = 0; h < 2 * T; h++) _mm256_storeu_ps(out + r * 32 + 8 * h, acc[r][h]);
}
#endif

#if defined(G8_VNNI) || (defined(__AVX2__) && defined(__F16C__))
#define G8_BLOCKED 1
#ifdef G8_VNNI
#define G8_ROWS g8_vnni_rows
#define G8_TILES 2
#else
#define G8_ROWS g8_avx2_rows
#define G8_TILES 1      /* two tiles' 16 sums and 16 accumulators do not fit AVX2's 16 registers */
#endif
/* Output rows [n0, n1) (whole groups of G8_NR) of y [M, N] through G8_ROWS, activation tiles G8_TILES at a time. */
static void g8_blocked(const uint8_t *w, int64_t N, int64_t ldw, int64_t nb, const g8_tile *t, int64_t M, float *y,
                       int64_t n0, int64_t n1) {
    float out[G8_NR * 32];
    for (int64_t n = n0; n < n1; n += G8_NR)
        for (int64_t m = 0; m < M; m += 16 * G8_TILES) {
            const g8_tile *tile = t + (m / 16) * nb;
            if (M - m > 16 && G8_TILES == 2) G8_ROWS(w + n * ldw, ldw, tile, nb, 2, out);
            else G8_ROWS(w + n * ldw, ldw, tile, nb, 1, out);
            for (int64_t j = m; j < M && j < m + 16 * G8_TILES; j++)
                for (int r = 0; r < G8_NR; r++) y[j * N + n + r] = out[r * 32 + j - m];
        }
}
#endif

#ifdef G8_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int g8_amx = -1;        /* -1: not asked yet; 0 off; 1 on */

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } g8_config;

static void g8_tiles_on(void) {
    g8_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16; c.colsb[0] = 32;        /* tmm0: 16 weight rows x one block of 32 bytes */
    c.rows[1] = 8;  c.colsb[1] = 64;        /* tmm1: one block of 16 activation rows (B layout) */
    c.rows[4] = 16; c.colsb[4] = 64;        /* tmm4: 16 x 16 int32 sums */
    asm volatile("" : : "r"(&c) : "memory");       /* GCC 12 drops the stores above before ldtilecfg otherwise */
    _tile_loadconfig(&c);
}

/* 16 weight rows from `w` (stride `ldw` bytes) against one 16-row activation tile `t`, every block in order, the
 * 16 x 16 float sums (weight row, activation row) kept in registers and stored to `out`. */
static void g8_amx_rows(const uint8_t *w, int64_t ldw, const g8_tile *t, int64_t nb, float out[16][16]) {
    int32_t sums[16][16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += G8_BLOCK_BYTES) {
        _tile_loadd(0, w + 2, ldw);
        _tile_loadd(1, t[b].b, 64);
        _tile_zero(4);
        _tile_dpbssd(4, 0, 1);
        _tile_stored(4, sums, 64);
        __m512 dx = _mm512_loadu_ps(t[b].d);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            __m512 d = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(w + r * ldw)), dx);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]))));
        }
    }
    for (int r = 0; r < 16; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#endif

/* Whether the AMX path is taken (asks the kernel for the tile state once); `on` 0 turns it off, 1 back on where
 * the CPU has it, -1 only asks. */
int qgemm8_amx(int on) {
#ifdef G8_AMX
    if (g8_amx == -1) {
        unsigned a, b, c, d;
        int has = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25));
        g8_amx = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        if (!g8_amx) g8_amx = -2;        /* not available: stays off */
    }
    if (g8_amx != -2 && on >= 0) g8_amx = on;
    return g8_amx == 1;
#else
    (void)on;
    return 0;
#endif
}

/* Which path qgemm8 takes: 3 AMX tiles, 2 AVX-512 VNNI, 1 AVX2, 0 plain C (the same bits on each). */
int qgemm8_path(void) {
    if (qgemm8_amx(-1)) return 3;
#if defined(G8_VNNI)
    return 2;
#elif defined(G8_BLOCKED)
    return 1;
#else
    return 0;
#endif
}

/* Bytes of the packed activations of M rows of K values (qgemm8_quantize's `packed`). */
int64_t qgemm8_packed_bytes(int64_t M, int64_t K) {
    return ((M + 15) / 16) * (K / 32) * (int64_t)sizeof(g8_tile);
}

int q8_quantize(int kind, const float *x, int64_t M, int64_t K, void *out);     /* qdot8.c */

#if defined(__AVX512F__) && defined(__F16C__)
/* One block of 32 values as q8_quantize's Q8_0 rule: d = amax / 127 kept as f16, q = roundf(x * (1 / d)) (the
 * halves away from zero: the integer part plus one where the exact fraction is >= 0.5). */
static void g8_quantize_block(const float *x, g8_act *out) {
    __m512 a0 = _mm512_loadu_ps(x), a1 = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    out->d = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
    for (int h = 0; h < 2; h++) {
        __m512 p = _mm512_mul_ps(h ? a1 : a0, _mm512_set1_ps(id)), a = _mm512_abs_ps(p);
        __m512 t = _mm512_roundscale_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(a, t), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
        __m512i r = _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, _mm512_set1_ps(1.0f)));
        __m512i q = _mm512_mask_sub_epi32(r, _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_LT_OQ),
                                          _mm512_setzero_si512(), r);
        _mm_storeu_si128((__m128i *)(out->qs + 16 * h), _mm512_cvtepi32_epi8(q));
    }
}
#endif

/* Rows of x [M, K] rounded to Q8_0 blocks (q8_quantize's kind 1, the same values) into `xq` (M * K/32 blocks) and
 * into tiles of 16 rows per block (`packed`, missing rows zero): row j's values 4i..4i+3 of a block go to
 * b[i][4j..4j+3], its d to d[j]. Returns -1 for a K that is not whole blocks. */
int qgemm8_quantize(const float *x, int64_t M, int64_t K, void *xq, void *packed) {
    if (K % 32) return -1;
    int64_t nb = K / 32;
    g8_act *a = xq;
    g8_tile *t = packed;
#if defined(__AVX512F__) && defined(__F16C__)
    for (int64_t b = 0; b < M * nb; b++) g8_quantize_block(x + 32 * b, &a[b]);
#else
    q8_quantize(1, x, M, K, xq);
#endif
    memset(packed, 0, (size_t)qgemm8_packed_bytes(M, K));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            g8_tile *tile = &t[(m / 16) * nb + b];
            const g8_act *blk = &a[m * nb + b];
            tile->d[m % 16] = blk->d;
            for (int i = 0; i < 8; i++) memcpy(&tile->b[i][4 * (m % 16)], blk->qs + 4 * i, 4);
        }
    return 0;
}

/* y [M, N] (output rows n0..n1 only) = Q8_0 weight `w` [N, K] against activations `x` (q8_quantize kind 1) and
 * `packed` (both from qgemm8_quantize). Returns -1 for a K that is not whole blocks. */
int qgemm8(const uint8_t *w, int64_t N, int64_t K, const void *x, const void *packed, int64_t M, float *y,
           int64_t n0, int64_t n1) {
    if (K % 32) return -1;
    int64_t nb = K / 32, ldw = nb * G8_BLOCK_BYTES;
    const g8_act *a = x;
    int64_t n = n0;
#ifdef G8_AMX
    if (g8_amx == 1) {
        const g8_tile *t = packed;
        float acc[16][16] __attribute__((aligned(64)));
        g8_tiles_on();
        for (; n + 16 <= n1; n += 16)
            for (int64_t m = 0; m < M; m += 16) {
                g8_amx_rows(w + n * ldw, ldw, t + (m / 16) * nb, nb, acc);
                for (int64_t j = m; j < M && j < m + 16; j++)
                    for (int r = 0; r < 16; r++) y[j * N + n + r] = acc[r][j - m];
            }
        _tile_release();
    }
#endif
#ifdef G8_BLOCKED
    int64_t whole = n + (n1 - n) / G8_NR * G8_NR;
    g8_blocked(w, N, ldw, nb, packed, M, y, n, whole);
    n = whole;
#else
    (void)packed;
#endif
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = g8_row(w + n * ldw, a + m * nb, nb);
    return 0;
}

/* qgemm8 as pool.c's row kernel (qgemv's signature; `type`, `expert_bytes` and `experts` unused): output tiles
 * [t0, t1) of 16 rows, `x` the two pointers {activations, packed} from qgemm8_quantize. */
int qgemm8_tiles(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
                 const void *x, int64_t M, float *y, int64_t t0, int64_t t1) {
    const void *const *acts = x;
    (void)type, (void)expert_bytes, (void)experts;
    return qgemm8(w, N, K, acts[0], acts[1], M, y, t0 * 16, t1 * 16 < N ? t1 * 16 : N);
}
