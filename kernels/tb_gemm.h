/* The matrix product every kernel uses (internal): C (+)= A B, BLIS's structure.
 *
 * Loops, outer to inner: columns of C in blocks of NC; the inner index k in blocks of KC, each block
 * of B packed once into NR-wide panels (row-major B copied, transposed B transposed, or a caller's
 * weights dequantised as they are packed); rows of C in blocks of MC; the NR-wide panels; the MR-row
 * tiles, each computed by an MR x NR micro-kernel that keeps its C tile in registers for the whole
 * KC block. A is read in place (row-major, or transposed: then each k's MR values are contiguous, as
 * a packed panel's would be), broadcast element by element, so it needs no packing.
 *
 * Bits: every C element is ONE chain over k in ascending order, c = (accumulate ? C : 0), then
 * c = a_k b_k + c for k = 0, 1, ...: a KC block ends by storing the chain's partial sum and the next
 * block resumes it, so the blocking, the vector width and the tile shape change nothing. With
 * TB_FUSED=0 each step rounds twice (multiply, then add) on every target, so the AVX-512, AVX2,
 * NEON and scalar micro-kernels give the same bits; TB_FUSED=1 rounds once (FMA) where the
 * micro-kernel's instruction set has one: faster, judged by tolerance.
 *
 * Micro-kernels: AVX-512 8 x 32 and AVX2 6 x 16 (x86-64), NEON 8 x 8 (aarch64) and 4 x 8 (armv7:
 * vmla, the unfused multiply-accumulate; vfma in the FUSED=1 build, which targets VFPv4), and a
 * portable 4 x 8 one (any target, Hexagon included).
 * The widest one the build's flags allow runs: on x86-64 the host library is built once per level
 * (baseline, AVX2, AVX-512) and the loader takes the best the CPU has, so a wheel built anywhere runs
 * on any x86-64. TB_ISA=avx512|avx2|neon|scalar in the environment forces a narrower one (the widest
 * compiled in at or below it); tb_gemm_isa() says which runs. */
#ifndef TB_GEMM_H
#define TB_GEMM_H

#include <stddef.h>

/* The B operand: element (k, n) at p[k * rs + n * cs]: rs = ldb, cs = 1 for a row-major B; rs = 1,
 * cs = ld for a B given transposed (x W^T with W row-major, or q k^T with the keys as rows). With
 * `rows` set, p is not read: rows(b, n0, nc, k0, kc, dst) writes columns n0..n0+nc-1 over k0..k0+kc-1
 * as float32 rows, dst[(n - n0) * kc + (k - k0)] (a weight matrix in f16 or int8, dequantised as it
 * is packed; nc <= TB_GEMM_MAX_NR). */
typedef struct tb_gemm_b tb_gemm_b;
struct tb_gemm_b {
    const float *p;
    ptrdiff_t rs, cs;
    void (*rows)(const tb_gemm_b *b, int n0, int nc, int k0, int kc, float *dst);
    const void *ctx;
};

#define TB_GEMM_MAX_MR 8
#define TB_GEMM_MAX_NR 32

/* C[M x N] (ldc) = (accumulate ? C : 0) + A[M x K] B[K x N]; A row-major (lda) for tb_gemm, or given
 * transposed for tb_gemm_at: A[i][k] = At[k * ldat + i] (K_out^T v_new with K_out's rows as they are).
 * lower: A is lower triangular (A[i][k] = 0 for k > i): a tile of rows stops at its last row's
 * diagonal, skipping terms that are exact zeros (0 * b added to a chain leaves it unchanged unless b
 * is infinite or NaN, or the chain is -0). */
void tb_gemm(int M, int N, int K, const float *A, int lda, const tb_gemm_b *B, float *C, int ldc, int accumulate,
             int lower);
void tb_gemm_at(int M, int N, int K, const float *At, int ldat, const tb_gemm_b *B, float *C, int ldc, int accumulate,
                int lower);

/* tb_gemm for a product of whole tiles with B row-major and read in place (B[k][n] at B[k * ldb + n]):
 * when M and N are multiples of the micro-kernel's MR and NR and 0 < K <= its KC, the micro-kernel
 * called on each tile straight from here, the calls (and so the bits) tb_gemm itself would make, without
 * its set-up, scratch and packing (GDN's chunk products are short, K = 16 or 64: the driver's ~180
 * instructions a call and ~17 a tile were a tenth of the micro-kernel's on aarch64). On aarch64 the
 * tiles are 4 x 16 (asm, fewer loads a multiply-add than the 8 x 8 kernel) where M and N allow.
 * Returns 0, doing nothing, when the shape does not qualify: the caller then calls tb_gemm. */
int tb_gemm_tiles(int M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                  int accumulate, int lower);

/* C = diag(e) X + A B (A row-major, B row-major in place), whole 4 x 16 tiles on aarch64's NEON kernel:
 * each element of X times its row's e rounded, then one chain over k in ascending order, the bits of
 * scaling X into C and then tb_gemm accumulating (X may be C itself). Returns 0, doing nothing,
 * elsewhere (other micro-kernels, other targets) or when the shape does not qualify as for tb_gemm_tiles. */
int tb_gemm_tiles_scaled(int M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                         const float *X, int ldx, const float *e);

/* The micro-kernel in use ("avx512", "avx2", "neon", "scalar") and whether fused ("-fma" suffix). */
const char *tb_gemm_isa(void);

/* Scratch memory of the calling thread: slot TB_SCRATCH_GEMM is tb_gemm's own, TB_SCRATCH_KERNEL a
 * kernel's (GDN chunkwise, attention), which may call tb_gemm while it holds it. Grown as needed (the
 * contents are not kept when it grows), 64-byte aligned, kept for the thread's life: a call after the
 * first allocates nothing, so repeated calls execute the same instructions (exact counts) and pay no
 * allocation. NULL when memory runs out. */
#define TB_SCRATCH_GEMM 0
#define TB_SCRATCH_KERNEL 1
float *tb_thread_scratch(int slot, size_t floats);

/* --- what an instruction set provides (gemm.c, gemm_avx2.c, gemm_avx512.c) ------------------------ */

typedef struct {
    const char *name;
    int mr, nr;
    /* C[mr x nr] (ldc) = (load ? C : 0) + sum over k < kc of A[:, k] B[k, :]; A[r][k] at a[r * lda + k]
     * (kernel) or a[k * lda + r] (kernel_at), read in place; B row k at b + k * ldb (nr floats: a
     * packed panel, or B itself). */
    void (*kernel)(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                   int load);
    void (*kernel_at)(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                      int load);
    /* Pack B (kc x nc, element (k, j) at src[k * rs + j * cs]) into a kc x nr panel, dst[k * nr + j],
     * zero for j >= nc. NULL: the portable packing. */
    void (*pack_t)(int kc, int nc, const float *src, ptrdiff_t cs, float *dst); /* rs = 1 */
} tb_gemm_kernels;

const tb_gemm_kernels *tb_gemm_avx512_kernels(void); /* NULL where not compiled in */
const tb_gemm_kernels *tb_gemm_avx2_kernels(void);

#endif
