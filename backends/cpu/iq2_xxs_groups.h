/* IQ2_XXS on AVX-512 VBMI/BITALG, shared by qdot8.c, qdot8amx.c and iq2repack.c: one block's 4 group pairs unpacked
 * from the 64 bytes after its d (v): the sign masks (bit j of negative[i]: value j of pair i is negative, the parity
 * bit restored) and the grid row index of each 8 values (pairs01: pairs 0-1, pairs23: pairs 2-3, as 32-bit lanes);
 * with VNNI, a block unpacked once and its integer dot with one activation row (several rows' kernels). */
#include "zen.h"

extern uint64_t iq2_grid_bytes[256];    /* qdot8.c's: the 8 grid values of each index, as bytes (qdot8_set_iq2_xxs) */
extern uint8_t iq2_ksigns_bytes[128];   /* qdot8.c's: ksigns (each 7-bit sign index with its parity in bit 7) */
extern uint8_t iq2_code_bytes[2][256];  /* qdot8.c's: the grid rows as 2-bit codes, a 16-bit word's two bytes */
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
static inline void iq2_xxs_groups(__m512i v, uint64_t negative[4], __m512i *pairs01, __m512i *pairs23) {
    /* bytes 0-3 of each lane packed together: byte k <- byte 8 (k / 4) + k % 4 */
    const __m512i pack = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x3b3a3938, 0x33323130, 0x2b2a2928,
                                          0x23222120, 0x1b1a1918, 0x13121110, 0x0b0a0908, 0x03020100);
    /* bytes 0-3 of lane g: the 7-bit sign indices of chunks 0-3 (bits 32 + 7l, bit 7 ignored), each looked up in
     * ksigns (two table vectors, one vpermi2b: the index and its parity bit at once) */
    __m512i s = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720), v);
    __m512i signs = _mm512_permutex2var_epi8(_mm512_loadu_si512(iq2_ksigns_bytes), s,
                                             _mm512_loadu_si512(iq2_ksigns_bytes + 64));
    _mm256_storeu_si256((__m256i *)negative, _mm512_castsi512_si256(_mm512_permutexvar_epi8(pack, signs)));
    __m512i index = _mm512_permutexvar_epi8(pack, v);
    *pairs01 = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(index));
    *pairs23 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(index, 1));
}

/* The grid rows (8 bytes each) of groups 2i and 2i + 1 of a block (p: its bytes after d; idx: their 8 indices as
 * 32-bit lanes) in one vector: a gather, or on AMD Zen (where a vpgatherdq of 8 rows costs ~12 cycles here, against
 * ~6 for 8 scalar loads and inserts) the same 8 rows loaded one by one. */
static inline __m512i iq2_grid_pair(const uint8_t *p, int i, __m256i idx) {
#if AMD_ZEN
    uint32_t lo, hi;        /* the two groups' 4 indices, one load each (bytes taken out by shifts) */
    memcpy(&lo, p + 16 * i, 4);
    memcpy(&hi, p + 16 * i + 8, 4);
    (void)idx;
    return _mm512_set_epi64((long long)iq2_grid_bytes[hi >> 24], (long long)iq2_grid_bytes[(hi >> 16) & 255],
                            (long long)iq2_grid_bytes[(hi >> 8) & 255], (long long)iq2_grid_bytes[hi & 255],
                            (long long)iq2_grid_bytes[lo >> 24], (long long)iq2_grid_bytes[(lo >> 16) & 255],
                            (long long)iq2_grid_bytes[(lo >> 8) & 255], (long long)iq2_grid_bytes[lo & 255]);
#else
    (void)p;
    (void)i;
    return _mm512_i32gather_epi64(idx, (const void *)iq2_grid_bytes, 8);
#endif
}

#if AMD_ZEN && defined(__AVX512VNNI__)
/* AMD Zen: a block's values in chunk order, vector i holding chunk i (values 8 i .. 8 i + 7) of the 8 groups, qword g
 * group g's, so that every 16-bit pair of one vector's products meets the scale of its own qword's group. */

/* One Q8_K block's 256 activation bytes `qs` into chunk order `out`. */
static inline void iq2_chunk_order(const int8_t *qs, int8_t *out) {
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < 8; g++) memcpy(out + 64 * i + 8 * g, qs + 32 * g + 8 * i, 8);
}

/* A block's grid rows and sign masks in chunk order (v: its 64 bytes after d) by shuffles, no loads of the grid:
 * grid[i] qword g = the grid row of chunk i of group g; bit 8 g + j of negative[i] set where its value j is
 * negative. Each index's 16-bit word of 2-bit codes (value j in bits 2 j) is looked up in place (byte 8 g + c of v,
 * c < 4) from the two 256-byte tables (low and high bytes, two `vpermi2b` each, the index's top bit choosing), the
 * high bytes moved up beside the low ones (bytes 8 g + 4 + c), and each chunk's 8 codes taken out by one
 * `vpmultishiftqb` and turned into the values 8, 25, 43 by one `vpermb`. */
static inline void iq2_block_chunks(__m512i v, __m512i grid[4], uint64_t negative[4]) {
    __mmask64 top = _mm512_movepi8_mask(v);
    const uint8_t *lo = iq2_code_bytes[0], *hi = iq2_code_bytes[1];
    __m512i low = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(_mm512_load_si512(lo), v,
                                                                       _mm512_load_si512(lo + 64)),
                                         _mm512_permutex2var_epi8(_mm512_load_si512(lo + 128), v,
                                                                  _mm512_load_si512(lo + 192)));
    __m512i high = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(_mm512_load_si512(hi), v,
                                                                        _mm512_load_si512(hi + 64)),
                                          _mm512_permutex2var_epi8(_mm512_load_si512(hi + 128), v,
                                                                   _mm512_load_si512(hi + 192)));
    /* qword g: the low code bytes of chunks 0-3, then their high ones */
    __m512i codes = _mm512_mask_blend_epi8(0xF0F0F0F0F0F0F0F0ull, low, _mm512_slli_epi64(high, 32));
    const __m512i magnitude = _mm512_set1_epi32(0x002b1908);      /* byte e: 8, 25, 43 by e % 4 */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {       /* value j of chunk i: bits 8 i + 2 j (j < 4), 32 + 8 i + 2 (j - 4) */
        const __m512i shifts = _mm512_set1_epi64(0x2624222006040200ll + 0x0808080808080808ll * i);
        grid[i] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shifts, codes), magnitude);
    }
    /* byte 8 g + c (c < 4): the sign byte of chunk c of group g (ksigns, as iq2_xxs_groups), moved to byte 8 c + g */
    __m512i signs = _mm512_permutex2var_epi8(_mm512_loadu_si512(iq2_ksigns_bytes),
                                             _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720), v),
                                             _mm512_loadu_si512(iq2_ksigns_bytes + 64));
    const __m512i transpose = _mm512_set_epi64(0, 0, 0, 0, 0x3b332b231b130b03ll, 0x3a322a221a120a02ll,
                                               0x3931292119110901ll, 0x3830282018100800ll);
    _mm256_storeu_si256((__m256i *)negative, _mm512_castsi512_si256(_mm512_permutexvar_epi8(transpose, signs)));
}

/* iq2_xxs_sums with the activations in chunk order (iq2_chunk_order): the same integers. */
static inline __m512i iq2_xxs_chunk_sums(const uint8_t *b, const int8_t *xo) {
    __m512i v = _mm512_loadu_si512(b + 2), grid[4];
    uint64_t negative[4];
    iq2_block_chunks(v, grid, negative);
    __m512i t = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(v, 60), 1), _mm512_set1_epi64(1));
    t = _mm512_or_si512(t, _mm512_slli_epi64(t, 16));
    __m512i ls = _mm512_or_si512(t, _mm512_slli_epi64(t, 32));      /* each word of qword g: 2 ls + 1 of group g */
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i q8 = _mm512_loadu_si512(xo + 64 * i);
        __mmask64 neg;      /* as asm: a load (as iq2_xxs_sums) */
        __asm__("kmovq %1, %0" : "=k"(neg) : "m"(negative[i]));
        __m512i prod = _mm512_maddubs_epi16(grid[i], _mm512_mask_sub_epi8(q8, neg, _mm512_setzero_si512(), q8));
        acc = _mm512_dpwssd_epi32(acc, prod, ls);
    }
    return acc;
}
#endif

#if defined(__AVX512VNNI__)
/* IQ2_XXS's integer dot of one block in one vector: its 16 lanes add up to bsum (below). */
static inline __m512i iq2_xxs_sums(const uint8_t *b, const int8_t *qs) {
    const uint8_t *p = b + 2;
    /* The block's 8 groups in one vector: 64-bit lane g = the group's 4 grid indices, then its 32 bits. */
    __m512i v = _mm512_loadu_si512(p);
    uint64_t negative[4];       /* per group pair: bit 8c + j set where value j of chunk c is negative */
    __m512i pairs01, pairs23;
    iq2_xxs_groups(v, negative, &pairs01, &pairs23);
    __m512i scales = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(v, 60), 1), _mm512_set1_epi64(1));
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {                  /* groups 2i and 2i + 1 */
        __m512i pair = i < 2 ? pairs01 : pairs23;
        __m256i idx = i % 2 ? _mm512_extracti64x4_epi64(pair, 1) : _mm512_castsi512_si256(pair);
        __m512i grid = iq2_grid_pair(p, i, idx);
        __mmask64 neg;      /* as asm: a load (gcc would move each mask out of the vector: ~3 uops on the shuffle port) */
        __asm__("kmovq %1, %0" : "=k"(neg) : "m"(negative[i]));
        __m512i q8 = _mm512_loadu_si512(qs + 64 * i);
        __m512i prod = _mm512_maddubs_epi16(grid, _mm512_mask_sub_epi8(q8, neg, _mm512_setzero_si512(), q8));
        __m512i ls = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(8 * i)),
                                                                 _mm256_set1_epi16((short)(8 * i + 4)), 1), scales);
        acc = _mm512_dpwssd_epi32(acc, prod, ls);
    }
    return acc;
}

/* IQ2_XXS, several rows of one weight: a block unpacked once for all rows (its grid rows, sign masks and group
 * scales, as iq2_xxs_sums), each row then multiplied by vpdpbusd into lanes of 4 values (|lane| <= 4 * 43 * 127,
 * so two steps' lanes pack into int16 words exactly) scaled per group by vpdpwssd: per 64 values one operation on
 * the multiply port fewer than iq2_xxs_sums' vpmaddubsw and vpdpwssd. */
typedef struct { __m512i grid[4], scale[2]; __mmask64 negative[4]; } iq2_xxs_unpacked;

static inline void iq2_xxs_unpack(const uint8_t *b, iq2_xxs_unpacked *u) {
    /* packs_epi32(p[2h], p[2h + 1]): in 128-bit lane L, words 0-3 group 4h + (L >= 2), words 4-7 group 4h + 2 +
     * (L >= 2); int16 word 4g of `scales` is group g's 2 ls + 1 */
    static const int16_t pick[2][32] __attribute__((aligned(64))) = {
        {0, 0, 0, 0, 8, 8, 8, 8, 0, 0, 0, 0, 8, 8, 8, 8, 4, 4, 4, 4, 12, 12, 12, 12, 4, 4, 4, 4, 12, 12, 12, 12},
        {16, 16, 16, 16, 24, 24, 24, 24, 16, 16, 16, 16, 24, 24, 24, 24,
         20, 20, 20, 20, 28, 28, 28, 28, 20, 20, 20, 20, 28, 28, 28, 28}};
    __m512i v = _mm512_loadu_si512(b + 2);
    uint64_t negative[4];
    __m512i pairs01, pairs23;
    iq2_xxs_groups(v, negative, &pairs01, &pairs23);
    __m512i scales = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(v, 60), 1), _mm512_set1_epi64(1));
    for (int h = 0; h < 2; h++) u->scale[h] = _mm512_permutexvar_epi16(_mm512_load_si512(pick[h]), scales);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i pair = i < 2 ? pairs01 : pairs23;
        __m256i idx = i % 2 ? _mm512_extracti64x4_epi64(pair, 1) : _mm512_castsi512_si256(pair);
        u->grid[i] = iq2_grid_pair(b + 2, i, idx);
        u->negative[i] = _cvtu64_mask64(negative[i]);
    }
}

static inline __m512i iq2_xxs_row(const iq2_xxs_unpacked *u, const int8_t *qs) {   /* 16 lanes adding to bsum */
    __m512i p[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i q8 = _mm512_loadu_si512(qs + 64 * i);
        p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u->grid[i],
                                   _mm512_mask_sub_epi8(q8, u->negative[i], _mm512_setzero_si512(), q8));
    }
    __m512i acc = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(p[0], p[1]), u->scale[0]);
    return _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(p[2], p[3]), u->scale[1]);
}
#endif
#endif
