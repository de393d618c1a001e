/* What qgemv.c and q4kexact.c share: the 16 lanes of four vectors added in order, four rows per add (AVX-512). */
#pragma once
#include <immintrin.h>

/* out[i] = the 16 lanes of p[i] added in order 0..15 from 0, for four vectors at once: the four transposed within
 * 128-bit lanes (t_j lane 4k + i: vector i's lane 4k + j), then one chain of 16 adds for the four. */
static inline __m128 lane_sums4(const __m512 *p) {
    __m512 u0 = _mm512_unpacklo_ps(p[0], p[1]), u1 = _mm512_unpackhi_ps(p[0], p[1]);
    __m512 u2 = _mm512_unpacklo_ps(p[2], p[3]), u3 = _mm512_unpackhi_ps(p[2], p[3]);
    __m512 t[4] = {_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u2))),
                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u2))),
                   _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u1), _mm512_castps_pd(u3))),
                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u1), _mm512_castps_pd(u3)))};
    __m128 s = _mm_setzero_ps();
    for (int j = 0; j < 4; j++) s = _mm_add_ps(s, _mm512_castps512_ps128(t[j]));
    for (int j = 0; j < 4; j++) s = _mm_add_ps(s, _mm512_extractf32x4_ps(t[j], 1));
    for (int j = 0; j < 4; j++) s = _mm_add_ps(s, _mm512_extractf32x4_ps(t[j], 2));
    for (int j = 0; j < 4; j++) s = _mm_add_ps(s, _mm512_extractf32x4_ps(t[j], 3));
    return s;
}
