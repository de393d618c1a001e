/* Exact F16 -> F32 of two little-endian bytes, shared by the kernel sources (static inline: a copy per source). */
#ifndef DS4_HALF_H
#define DS4_HALF_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float f16_to_f32(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)h);
#else
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 31) bits = sign | 0x7f800000u | (mant << 13);
    else if (exp == 0 && mant == 0) bits = sign;
    else if (exp == 0) {                                                    /* subnormal: normalise */
        exp = 127 - 15 + 1;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    } else bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}
#endif
