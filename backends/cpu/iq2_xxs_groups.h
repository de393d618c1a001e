/* IQ2_XXS on AVX-512 VBMI/BITALG, shared by qdot8.c and qdot8amx.c: one block's 4 group pairs unpacked from the
 * 64 bytes after its d (v): the sign masks (bit j of negative[i]: value j of pair i is negative, the parity bit
 * restored) and the grid row index of each 8 values (pairs01: pairs 0-1, pairs23: pairs 2-3, as 32-bit lanes). */
extern uint64_t iq2_grid_bytes[256];    /* qdot8.c's: the 8 grid values of each index, as bytes (qdot8_set_iq2_xxs) */
extern uint8_t iq2_ksigns_bytes[128];   /* qdot8.c's: ksigns (each 7-bit sign index with its parity in bit 7) */
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
#endif
