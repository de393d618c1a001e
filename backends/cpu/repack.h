/* What the repacked layouts (q4krepack.c, q2krepack.c, q8repack.c) share: the group-rewrite loop, the build's
 * paths (REPACK_VNNI, REPACK_AMX), the entry points `<prefix>_amx_from` and `<prefix>_vector`, the AMX tile setup,
 * the rows past the last whole group and the live activation rows of a call with experts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "zen.h"

#define GROUP 16            /* weight rows repacked together */

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#define REPACK_VNNI 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define REPACK_AMX 1
#else
#define REPACK_AMX 0
#endif
#else
#define REPACK_VNNI 0
#define REPACK_AMX 0
#endif

/* The weight streams' prefetch hint: into L2 on AMD Zen, where it measured faster than into L1 (docs/cpu.md, "Q4_K,
 * Q2_K and IQ2_XXS at several rows without AMX (session 16)"); into L1 elsewhere, as measured on Sapphire Rapids. */
#if AMD_ZEN
#define STREAM_HINT _MM_HINT_T2
#else
#define STREAM_HINT _MM_HINT_T0
#endif

int qdot8(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
          const void *xq, int64_t M, float *y, int64_t n0, int64_t n1);           /* qdot8.c: the stored layout */
int qdot8amx_on(int on);                                                         /* qdot8amx.c: the AMX switch */

/* One group's nb blocks: `from` (16 stored rows of nb blocks) into `to` (the repacked layout), or back (`back`). */
typedef void group_pack_fn(const uint8_t *from, uint8_t *to, int64_t nb, int back);

/* Rewrite the whole groups of a [N, K] weight (blocks of `block_values` values in `block_bytes` bytes) in place by
 * `pack`, each from a copy of it: into the repacked layout (`back` 0) or back to the stored one (`back` 1); rows past
 * N / 16 * 16 are left as they are. Returns 0, -1 for K not whole blocks, -2 out of memory. */
static inline int repack_groups(uint8_t *w, int64_t N, int64_t K, int back, int64_t block_values, int64_t block_bytes,
                                group_pack_fn *pack) {
    if (K % block_values || K <= 0) return -1;
    int64_t nb = K / block_values, bytes = GROUP * nb * block_bytes;
    uint8_t *tmp = malloc((size_t)bytes);
    if (tmp == NULL) return -2;
    for (int64_t g = 0; g + GROUP <= N; g += GROUP) {
        uint8_t *region = w + g * nb * block_bytes;
        memcpy(tmp, region, (size_t)bytes);
        pack(tmp, region, nb, back);
    }
    free(tmp);
    return 0;
}

/* A layout's switches: `amx_rows_from` (first: the fewest activation rows that take the AMX tiles), its setter
 * `<prefix>_amx_from` (`from` >= 2 sets it; 17: never; returns it) and `<prefix>_vector` (whether the repacked kernels
 * are the vector ones here, AVX-512 VNNI; else the plain C loop, slower than qdot8's kernels on the stored layout, so
 * a weight is worth repacking only where this is 1). */
#define REPACK_SWITCHES(prefix, first)                                                                               \
    static int amx_rows_from = (first);                                                                              \
    int prefix##_amx_from(int from) {                                                                                \
        if (from >= 2) amx_rows_from = from;                                                                         \
        return amx_rows_from;                                                                                        \
    }                                                                                                                \
    int prefix##_vector(void) { return REPACK_VNNI; }

/* Which path serves M rows here (amx_from: the layout's amx_rows_from): 2 AMX tiles, 1 AVX-512 VNNI, 0 plain C. */
static inline int path_for(int64_t M, int amx_from) {
    if (REPACK_AMX && M >= amx_from && qdot8amx_on(-1)) return 2;
    return REPACK_VNNI;
}

/* Outputs [n0, n1) of the rows past the last whole group (stored_type's stored layout, by qdot8) where n1 reaches
 * them, and n1 cut to the last whole group; returns qdot8's code (0: done). */
static inline int stored_rows(int stored_type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts,
                              int64_t N, int64_t K, const void *xq, int64_t M, float *y, int64_t n0, int64_t *n1) {
    int64_t whole = N / GROUP * GROUP;
    if (*n1 <= whole) return 0;
    int rc = qdot8(stored_type, w, expert_bytes, experts, N, K, xq, M, y, n0 > whole ? n0 : whole, *n1);
    if (rc == 0) *n1 = whole;
    return rc;
}

/* The activation rows a call computes (`experts` NULL: all M; else those with an expert, experts[m] >= 0, the others'
 * outputs [n0, n1) set to 0): their indices into live, their count returned. */
static inline int64_t live_rows(const int64_t *experts, int64_t M, float *y, int64_t N, int64_t n0, int64_t n1,
                                int64_t live[GROUP]) {
    int64_t rows = 0;
    for (int64_t m = 0; m < M; m++) {
        if (experts != NULL && experts[m] < 0) {
            for (int64_t n = n0; n < n1; n++) y[m * N + n] = 0.0f;
            continue;
        }
        live[rows++] = m;
    }
    return rows;
}

/* The live rows' activations (`bytes` each in x) copied together, or NULL out of memory. */
static inline uint8_t *live_activations(const uint8_t *x, const int64_t *live, int64_t rows, int64_t bytes) {
    uint8_t *xs = malloc((size_t)(rows * bytes));
    if (xs != NULL)
        for (int64_t i = 0; i < rows; i++) memcpy(xs + i * bytes, x + live[i] * bytes, (size_t)bytes);
    return xs;
}

#if REPACK_AMX
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* Configure the 8 tiles: tile t rows[t] x cols[t] bytes. */
static inline void tiles_load(const int rows[8], const int cols[8]) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = (uint16_t)cols[t];
    }
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* tmm0, tmm1: A tiles of M activation rows x 32 bytes (32 values); tmm2, tmm3: B tiles of 8 x 64 (32 values of the
 * 16 weight rows); tmm4-7: M x 16 int32 sums. */
static inline void tiles_for_32(int64_t M) {
    const int m = (int)M, rows[8] = {m, m, 8, 8, m, m, m, m}, cols[8] = {32, 32, 64, 64, 64, 64, 64, 64};
    tiles_load(rows, cols);
}
#endif
