/* Small dense building blocks over `vf` (internal): dot products with a fixed summation order, and
 * the matrix product (tb_gemm.h), C (+)= A B with every C element accumulated over k in ascending
 * order, so the scalar and vector paths of one build and the targets of an unfused build agree. */
#ifndef TB_LINALG_H
#define TB_LINALG_H

#include "tb_gemm.h"
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

/* C[M x N] = (accumulate ? C : 0) + A[M x K] B[K x N], all row-major with leading dimensions.
 * lower: row i only needs k <= i (A is lower triangular with zeros above the diagonal).
 * tb_gemm (tb_gemm.h): packed panels, a register-blocked micro-kernel chosen for the CPU, every C
 * element one chain over k in ascending order. */
static inline void gemm_nn(int M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                           int accumulate, int lower) {
    const tb_gemm_b b = {B, ldb, 1, NULL, NULL};
    tb_gemm(M, N, K, A, lda, &b, C, ldc, accumulate, lower);
}

/* The same with A given transposed: A[i][k] = At[k * ldat + i] (K_out^T v_new from K_out's rows). */
static inline void gemm_tn(int M, int N, int K, const float *At, int ldat, const float *B, int ldb, float *C, int ldc,
                           int accumulate, int lower) {
    const tb_gemm_b b = {B, ldb, 1, NULL, NULL};
    tb_gemm_at(M, N, K, At, ldat, &b, C, ldc, accumulate, lower);
}

/* The same with B given transposed: B[k][n] = Bt[n * ldbt + k] (x W^T, q k^T), packed from Bt by
 * transposition inside the product. */
static inline void gemm_nt(int M, int N, int K, const float *A, int lda, const float *Bt, int ldbt, float *C, int ldc,
                           int accumulate, int lower) {
    const tb_gemm_b b = {Bt, 1, ldbt, NULL, NULL};
    tb_gemm(M, N, K, A, lda, &b, C, ldc, accumulate, lower);
}

#endif
