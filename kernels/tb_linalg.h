/* Small dense building blocks over `vf` (internal): dot products with a fixed summation order, and
 * one matrix-product micro-kernel, C (+)= A B with every C element accumulated over k in ascending
 * order, so the scalar and vector paths of one build and the targets of an unfused build agree. */
#ifndef TB_LINALG_H
#define TB_LINALG_H

#include "tb_simd.h"

/* sum_i a[i] b[i]: 8 lanes over the first n - n % 8 elements, folded, then the tail in order. */
static inline float dot(const float *a, const float *b, int n) {
    vf acc = vf_zero();
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) acc = vf_madd(vf_load(a + i), vf_load(b + i), acc);
    float s = vf_hsum(acc);
    for (; i < n; i++) s = madd1(a[i], b[i], s);
    return s;
}

/* Four dot products of a with b0..b3 (the same order as dot(), four independent chains). */
static inline void dot4(const float *a, const float *b0, const float *b1, const float *b2, const float *b3,
                        int n, float out[4]) {
    vf c0 = vf_zero(), c1 = vf_zero(), c2 = vf_zero(), c3 = vf_zero();
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) {
        vf x = vf_load(a + i);
        c0 = vf_madd(x, vf_load(b0 + i), c0);
        c1 = vf_madd(x, vf_load(b1 + i), c1);
        c2 = vf_madd(x, vf_load(b2 + i), c2);
        c3 = vf_madd(x, vf_load(b3 + i), c3);
    }
    float s0 = vf_hsum(c0), s1 = vf_hsum(c1), s2 = vf_hsum(c2), s3 = vf_hsum(c3);
    for (; i < n; i++) {
        s0 = madd1(a[i], b0[i], s0);
        s1 = madd1(a[i], b1[i], s1);
        s2 = madd1(a[i], b2[i], s2);
        s3 = madd1(a[i], b3[i], s3);
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* y[i] = a * x[i] + y[i] */
static inline void axpy(float a, const float *x, float *y, int n) {
    vf va = vf_set1(a);
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(y + i, vf_madd(va, vf_load(x + i), vf_load(y + i)));
    for (; i < n; i++) y[i] = madd1(a, x[i], y[i]);
}

/* x[i] *= a */
static inline void scale_n(float *x, float a, int n) {
    vf va = vf_set1(a);
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(x + i, vf_mul(vf_load(x + i), va));
    for (; i < n; i++) x[i] *= a;
}

#if defined(__AVX512F__)
/* 8 (or 4) rows x 32 columns in AVX-512 registers. Each C element is still one chain over k in
 * order, so the result has the bits of the 8-lane kernel below; only more columns are in flight. */
static inline __m512 madd16(__m512 a, __m512 b, __m512 c) {
#if TB_FUSED
    return _mm512_fmadd_ps(a, b, c);
#else
    return _mm512_add_ps(_mm512_mul_ps(a, b), c);
#endif
}

/* rows (4 or 8, a constant once inlined) x 32 columns of C */
static inline __attribute__((always_inline)) void gemm_rows_x32(const int rows, int kend, const float *A, int lda,
                                                                const float *B, int ldb, float *C, int ldc,
                                                                int accumulate) {
    __m512 c[8][2];
    for (int r = 0; r < rows; r++) {
        c[r][0] = accumulate ? _mm512_loadu_ps(C + r * ldc) : _mm512_setzero_ps();
        c[r][1] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16) : _mm512_setzero_ps();
    }
    for (int k = 0; k < kend; k++) {
        __m512 b0 = _mm512_loadu_ps(B + k * ldb), b1 = _mm512_loadu_ps(B + k * ldb + 16);
        for (int r = 0; r < rows; r++) {
            __m512 x = _mm512_set1_ps(A[r * lda + k]);
            c[r][0] = madd16(x, b0, c[r][0]);
            c[r][1] = madd16(x, b1, c[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(C + r * ldc, c[r][0]);
        _mm512_storeu_ps(C + r * ldc + 16, c[r][1]);
    }
}
#endif

/* C[M x N] = (accumulate ? C : 0) + A[M x K] B[K x N], all row-major with leading dimensions.
 * lower: row i only needs k <= i (A is lower triangular with zeros above the diagonal), so each
 * block of rows stops at its last row's diagonal.
 * Register block: 4 rows x 16 columns (8 vector accumulators; 8 x 32 with AVX-512), B rows
 * streamed, A broadcast. */
static void gemm_nn(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                    float *C, int ldc, int accumulate, int lower) {
    int n0 = 0;
#if defined(__AVX512F__)
    for (; n0 + 32 <= N && M >= 4; n0 += 32) {
        int m0 = 0;
        for (; m0 + 8 <= M; m0 += 8)
            gemm_rows_x32(8, lower && m0 + 8 < K ? m0 + 8 : K, A + m0 * lda, lda, B + n0, ldb, C + m0 * ldc + n0,
                          ldc, accumulate);
        for (; m0 + 4 <= M; m0 += 4)
            gemm_rows_x32(4, lower && m0 + 4 < K ? m0 + 4 : K, A + m0 * lda, lda, B + n0, ldb, C + m0 * ldc + n0,
                          ldc, accumulate);
        for (; m0 < M; m0++) { /* leftover rows: the 16-column path of the same arithmetic */
            int kend = lower && m0 + 1 < K ? m0 + 1 : K;
            for (int half = 0; half < 32; half += 2 * VF_LANES) {
                vf c0 = accumulate ? vf_load(C + m0 * ldc + n0 + half) : vf_zero();
                vf c1 = accumulate ? vf_load(C + m0 * ldc + n0 + half + VF_LANES) : vf_zero();
                for (int k = 0; k < kend; k++) {
                    vf x = vf_set1(A[m0 * lda + k]);
                    c0 = vf_madd(x, vf_load(B + k * ldb + n0 + half), c0);
                    c1 = vf_madd(x, vf_load(B + k * ldb + n0 + half + VF_LANES), c1);
                }
                vf_store(C + m0 * ldc + n0 + half, c0);
                vf_store(C + m0 * ldc + n0 + half + VF_LANES, c1);
            }
        }
    }
#endif
    for (; n0 + 2 * VF_LANES <= N; n0 += 2 * VF_LANES) {
        int m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) {
            int kend = lower && m0 + 4 < K ? m0 + 4 : K;
            vf c[4][2];
            for (int r = 0; r < 4; r++) {
                c[r][0] = accumulate ? vf_load(C + (m0 + r) * ldc + n0) : vf_zero();
                c[r][1] = accumulate ? vf_load(C + (m0 + r) * ldc + n0 + VF_LANES) : vf_zero();
            }
            const float *a0 = A + m0 * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
            for (int k = 0; k < kend; k++) {
                vf b0 = vf_load(B + k * ldb + n0), b1 = vf_load(B + k * ldb + n0 + VF_LANES);
                vf x;
                x = vf_set1(a0[k]); c[0][0] = vf_madd(x, b0, c[0][0]); c[0][1] = vf_madd(x, b1, c[0][1]);
                x = vf_set1(a1[k]); c[1][0] = vf_madd(x, b0, c[1][0]); c[1][1] = vf_madd(x, b1, c[1][1]);
                x = vf_set1(a2[k]); c[2][0] = vf_madd(x, b0, c[2][0]); c[2][1] = vf_madd(x, b1, c[2][1]);
                x = vf_set1(a3[k]); c[3][0] = vf_madd(x, b0, c[3][0]); c[3][1] = vf_madd(x, b1, c[3][1]);
            }
            for (int r = 0; r < 4; r++) {
                vf_store(C + (m0 + r) * ldc + n0, c[r][0]);
                vf_store(C + (m0 + r) * ldc + n0 + VF_LANES, c[r][1]);
            }
        }
        for (; m0 < M; m0++) {
            int kend = lower && m0 + 1 < K ? m0 + 1 : K;
            vf c0 = accumulate ? vf_load(C + m0 * ldc + n0) : vf_zero();
            vf c1 = accumulate ? vf_load(C + m0 * ldc + n0 + VF_LANES) : vf_zero();
            const float *a = A + m0 * lda;
            for (int k = 0; k < kend; k++) {
                vf x = vf_set1(a[k]);
                c0 = vf_madd(x, vf_load(B + k * ldb + n0), c0);
                c1 = vf_madd(x, vf_load(B + k * ldb + n0 + VF_LANES), c1);
            }
            vf_store(C + m0 * ldc + n0, c0);
            vf_store(C + m0 * ldc + n0 + VF_LANES, c1);
        }
    }
    for (; n0 + VF_LANES <= N; n0 += VF_LANES) {
        for (int m = 0; m < M; m++) {
            int kend = lower && m + 1 < K ? m + 1 : K;
            vf c = accumulate ? vf_load(C + m * ldc + n0) : vf_zero();
            for (int k = 0; k < kend; k++) c = vf_madd(vf_set1(A[m * lda + k]), vf_load(B + k * ldb + n0), c);
            vf_store(C + m * ldc + n0, c);
        }
    }
    for (; n0 < N; n0++) {
        for (int m = 0; m < M; m++) {
            int kend = lower && m + 1 < K ? m + 1 : K;
            float c = accumulate ? C[m * ldc + n0] : 0.0f;
            for (int k = 0; k < kend; k++) c = madd1(A[m * lda + k], B[k * ldb + n0], c);
            C[m * ldc + n0] = c;
        }
    }
}

#endif
