/* The AVX2 micro-kernel of tb_gemm (tb_gemm.h): 6 rows x 16 columns of C in 12 registers. Compiled
 * in by builds for AVX2 (-mavx2): the host library's AVX2 and AVX-512 variants, and the host programs. */
#include "tb_gemm.h"

#if defined(__x86_64__) && defined(__AVX2__)
#define TB_X86_TARGET __attribute__((target("avx2,fma"))) /* fma: the FUSED=1 build's */
#include "gemm_x86.h"

#define MR 6
#define NR 16

static inline TB_X86_TARGET __attribute__((always_inline)) __m256 madd8(__m256 a, __m256 b, __m256 c) {
#if TB_FUSED
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

/* A[r][k] at a[r * ars + k * aks] */
static inline TB_X86_TARGET __attribute__((always_inline)) void body(int kc, const float *a, ptrdiff_t ars,
                                                                     ptrdiff_t aks, const float *b, ptrdiff_t ldb,
                                                                     float *c, ptrdiff_t ldc, int load) {
    __m256 t[MR][2];
    for (int r = 0; r < MR; r++) {
        t[r][0] = load ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
        t[r][1] = load ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
        for (int r = 0; r < MR; r++) {
            const __m256 x = _mm256_set1_ps(a[r * ars + k * aks]);
            t[r][0] = madd8(x, b0, t[r][0]);
            t[r][1] = madd8(x, b1, t[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(c + r * ldc, t[r][0]);
        _mm256_storeu_ps(c + r * ldc + 8, t[r][1]);
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

static const tb_gemm_kernels avx2 = {TB_FUSED ? "avx2-fma" : "avx2", MR, NR, kernel, kernel_at, pack_t};
const tb_gemm_kernels *tb_gemm_avx2_kernels(void) { return &avx2; }
#endif
