/* What the x86 micro-kernel files share (internal): the 8 x 8 transposition that packs a transposed
 * B, for AVX2 and AVX-512 alike. Included by gemm_avx2.c and gemm_avx512.c only, after they define
 * TB_X86_TARGET (the target attribute of their functions). */
#ifndef TB_GEMM_X86_H
#define TB_GEMM_X86_H

#include <immintrin.h>
#include <string.h>

#include "tb_simd.h" /* TB_FUSED: the build's choice, or fused where the build has FMA */

/* dst[k * ldd + j] = src[j * cs + k] for j, k < 8 */
static inline TB_X86_TARGET __attribute__((always_inline)) void transpose8(const float *src, ptrdiff_t cs, float *dst,
                                                                           ptrdiff_t ldd) {
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + cs), r2 = _mm256_loadu_ps(src + 2 * cs);
    __m256 r3 = _mm256_loadu_ps(src + 3 * cs), r4 = _mm256_loadu_ps(src + 4 * cs), r5 = _mm256_loadu_ps(src + 5 * cs);
    __m256 r6 = _mm256_loadu_ps(src + 6 * cs), r7 = _mm256_loadu_ps(src + 7 * cs);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3);
    __m256 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* B transposed (element (k, j) at src[j * cs + k]) into a kc x NR panel, zero for j >= nc. */
#define TB_DEFINE_PACK_T(name, NR)                                                                         \
    static TB_X86_TARGET void name(int kc, int nc, const float *src, ptrdiff_t cs, float *dst) {          \
        const int full = nc & ~7;                                                                          \
        int k = 0;                                                                                         \
        for (; k + 8 <= kc; k += 8) {                                                                      \
            for (int j = 0; j < full; j += 8) transpose8(src + j * cs + k, cs, dst + k * (NR) + j, (NR)); \
            for (int kk = k; kk < k + 8; kk++) {                                                           \
                for (int j = full; j < nc; j++) dst[kk * (NR) + j] = src[j * cs + kk];                     \
                for (int j = nc; j < (NR); j++) dst[kk * (NR) + j] = 0.0f;                                 \
            }                                                                                              \
        }                                                                                                  \
        for (; k < kc; k++) {                                                                              \
            for (int j = 0; j < nc; j++) dst[k * (NR) + j] = src[j * cs + k];                              \
            for (int j = nc; j < (NR); j++) dst[k * (NR) + j] = 0.0f;                                      \
        }                                                                                                  \
    }

#endif
