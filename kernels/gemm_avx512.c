/* The AVX-512 micro-kernel of tb_gemm (tb_gemm.h): 8 rows x 32 columns of C in 16 registers.
 * Compiled in by builds for AVX-512 (-mavx512f): the host library's AVX-512 variant, and the host
 * programs on a machine that has it. */
#include "tb_gemm.h"

#if defined(__x86_64__) && defined(__AVX512F__)
#define TB_X86_TARGET __attribute__((target("avx512f,avx2,fma"))) /* fma: the FUSED=1 build's */
#include "gemm_x86.h"

#define MR 8
#define NR 32

static inline TB_X86_TARGET __attribute__((always_inline)) __m512 madd16(__m512 a, __m512 b, __m512 c) {
#if TB_FUSED
    return _mm512_fmadd_ps(a, b, c);
#else
    return _mm512_add_ps(_mm512_mul_ps(a, b), c);
#endif
}

/* A[r][k] at a[r * ars + k * aks] */
static inline TB_X86_TARGET __attribute__((always_inline)) void body(int kc, const float *a, ptrdiff_t ars,
                                                                     ptrdiff_t aks, const float *b, ptrdiff_t ldb,
                                                                     float *c, ptrdiff_t ldc, int load) {
    __m512 t[MR][2];
    for (int r = 0; r < MR; r++) {
        t[r][0] = load ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
        t[r][1] = load ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(b + k * ldb), b1 = _mm512_loadu_ps(b + k * ldb + 16);
        for (int r = 0; r < MR; r++) {
            const __m512 x = _mm512_set1_ps(a[r * ars + k * aks]);
            t[r][0] = madd16(x, b0, t[r][0]);
            t[r][1] = madd16(x, b1, t[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(c + r * ldc, t[r][0]);
        _mm512_storeu_ps(c + r * ldc + 16, t[r][1]);
    }
}

static TB_X86_TARGET void kernel(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                                 ptrdiff_t ldc, int load) {
    body(kc, a, lda, 1, b, ldb, c, ldc, load);
}

static TB_X86_TARGET void kernel_at(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                                    ptrdiff_t ldc, int load) {
    body(kc, a, 1, lda, b, ldb, c, ldc, load);
}

TB_DEFINE_PACK_T(pack_t, NR)

static const tb_gemm_kernels avx512 = {TB_FUSED ? "avx512-fma" : "avx512", MR, NR, kernel, kernel_at, pack_t};
const tb_gemm_kernels *tb_gemm_avx512_kernels(void) { return &avx512; }
#endif
