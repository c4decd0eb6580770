/* tb_gemm (tb_gemm.h): the blocked driver, the choice of micro-kernel, and the portable and NEON
 * micro-kernels. The x86 micro-kernels are in gemm_avx2.c and gemm_avx512.c. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tb_gemm.h"
#include "tb_simd.h"

/* KC: the inner-index block (a B panel of KC x NR stays in L1 while the row tiles pass over it);
 * NC: the column block (the packed KC x NC block of B stays in L2). */
#ifndef KC
#define KC 256
#endif
#ifndef NC
#define NC 1024
#endif
/* A row-major B is read in place (not packed) by products of at most DIRECT_ROWS rows, unless its
 * rows are a multiple of 4 KiB apart (its panels would then crowd a few cache sets). */
#ifndef DIRECT_ROWS
#define DIRECT_ROWS 32
#endif

/* --- portable micro-kernel: 4 x 8 over `vf` (SSE2 on a portable x86-64 build, plain C elsewhere) --- */

#define S_MR 4
#define S_NR VF_LANES

static inline void body_scalar(int kc, const float *a, ptrdiff_t ars, ptrdiff_t aks, const float *b, ptrdiff_t ldb,
                               float *c, ptrdiff_t ldc, int load) {
    vf t0 = load ? vf_load(c) : vf_zero(), t1 = load ? vf_load(c + ldc) : vf_zero();
    vf t2 = load ? vf_load(c + 2 * ldc) : vf_zero(), t3 = load ? vf_load(c + 3 * ldc) : vf_zero();
    for (int k = 0; k < kc; k++) {
        const vf bk = vf_load(b + k * ldb);
        const float *ak = a + k * aks;
        t0 = vf_madd(vf_set1(ak[0]), bk, t0);
        t1 = vf_madd(vf_set1(ak[ars]), bk, t1);
        t2 = vf_madd(vf_set1(ak[2 * ars]), bk, t2);
        t3 = vf_madd(vf_set1(ak[3 * ars]), bk, t3);
    }
    vf_store(c, t0), vf_store(c + ldc, t1), vf_store(c + 2 * ldc, t2), vf_store(c + 3 * ldc, t3);
}

static void kernel_scalar(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                          ptrdiff_t ldc, int load) {
    body_scalar(kc, a, lda, 1, b, ldb, c, ldc, load);
}

static void kernel_scalar_at(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                             ptrdiff_t ldc, int load) {
    body_scalar(kc, a, 1, lda, b, ldb, c, ldc, load);
}

static const tb_gemm_kernels scalar_kernels = {TB_MADD_FUSED ? "portable-fma" : "portable", S_MR, S_NR,
                                               kernel_scalar, kernel_scalar_at, NULL};

/* --- NEON micro-kernels: 8 x 8 on aarch64 (32 registers), 4 x 8 on armv7 (16) -------------------- */

/* Written for the instruction count (issue 35: exact counts under qemu against one FMLA/VMLA/VFMA
 * per four multiply-adds). Every NEON build has its micro-kernels in asm (aarch64 fused or not, armv7
 * VFPv3 unfused with VMLA, armv7 VFPv4 fused with VFMA): in C, GCC kept the 8 x 8 tile's t[8][2] on the
 * stack and stored it every step, hoisted unfused multiplies until the tile spilled, indexed B by
 * k * ldb, and kept C's row addresses on the stack across the loop. None of this changes a C element's
 * chain: one multiply-add per k, in ascending k, as tb_gemm.h promises. */
#if defined(TB_NEON)
#define N_NR 8
#define INLINE static inline __attribute__((always_inline))
#if defined(__aarch64__)
#define N_MR 8 /* the kernels are asm, below */
#else
#define N_MR 4
#endif

/* armv7: the whole micro-kernel in asm, as on aarch64 below. C's tile in q8-q15 (row r in q(8+2r),
 * q(9+2r)), A in q0-q3 and B in q4-q7. ARMv7 loads take no offset, so in C every load paid an address
 * add and GCC kept C's row addresses on the stack; here A's rows and B are walked by post-incrementing
 * VLD1 (one a row of B, eight floats, post-incremented by ldb: a packed panel or B in place).
 *
 * Without FMA (FUSED=0, or any VFPv3 build): VMLA, the unfused multiply-accumulate (the product
 * rounded, then added: the bits of a multiply and an add), by scalar (its scalar must sit in d0-d15):
 * a pass of four steps is 4 + 4 loads, 32 VMLA, the count and the branch (42 for 32).
 * With FMA (FUSED=1 builds for VFPv4, kernels/Makefile): VFMA.F32, which has no by-scalar form, so
 * each step broadcasts row r's A value into q(r): with A row-major, one VLD1 to all lanes per row
 * (post-incremented), a step 4 + 1 loads and 8 VFMA, a pass of four 54 for 32 (the broadcasts are the
 * cost of VFMA's form: a row's four consecutive values in two double-spaced VLD4 would need four B rows
 * live, 20 q registers); with A transposed, 2 + 1 loads a step (below). */
#if !defined(__aarch64__)
#define V7_ASM 1
/* C's tile: loaded (load != 0) or zeros at the start, stored at the end */
#define V7_C_IN                                                                                            \
    "cmp %[load], #0\n\t"                                                                                  \
    "beq 2f\n\t"                                                                                           \
    "vld1.32 {d16-d19}, [%[c]], %[ldc]\n\tvld1.32 {d20-d23}, [%[c]], %[ldc]\n\t"                          \
    "vld1.32 {d24-d27}, [%[c]], %[ldc]\n\tvld1.32 {d28-d31}, [%[c]]\n\t"                                  \
    "sub %[c], %[c], %[ldc], lsl #1\n\tsub %[c], %[c], %[ldc]\n\t"                                       \
    "b 3f\n\t"                                                                                             \
    "2:\n\t"                                                                                               \
    "vmov.i32 q8, #0\n\tvmov.i32 q9, #0\n\tvmov.i32 q10, #0\n\tvmov.i32 q11, #0\n\t"                      \
    "vmov.i32 q12, #0\n\tvmov.i32 q13, #0\n\tvmov.i32 q14, #0\n\tvmov.i32 q15, #0\n\t"                    \
    "3:\n\t"
#define V7_C_OUT                                                                                           \
    "vst1.32 {d16-d19}, [%[c]], %[ldc]\n\tvst1.32 {d20-d23}, [%[c]], %[ldc]\n\t"                          \
    "vst1.32 {d24-d27}, [%[c]], %[ldc]\n\tvst1.32 {d28-d31}, [%[c]]\n\t"
#define V7_CLOBBERS                                                                                        \
    "d0", "d1", "d2", "d3", "d4", "d5", "d6", "d7", "d8", "d9", "d10", "d11", "d12", "d13", "d14", "d15", "d16", \
        "d17", "d18", "d19", "d20", "d21", "d22", "d23", "d24", "d25", "d26", "d27", "d28", "d29", "d30", "d31", \
        "memory", "cc"
/* the k loop around a kernel's steps: kc / 4 passes of `four` (four steps), then kc % 4 of `one` */
#define V7_STEPS(four, one)                                                                                \
    "cmp %[n], #0\n\tbeq 5f\n\t4:\n\t" four "subs %[n], %[n], #1\n\tbne 4b\n\t5:\n\t"                       \
    "cmp %[rest], #0\n\tbeq 7f\n\t6:\n\t" one "subs %[rest], %[rest], #1\n\tbne 6b\n\t7:\n\t"

#if TB_MADD_FUSED
/* the four rows' fused multiply-adds with B row (lo, hi) and row r's A value broadcast in q(r) */
#define V7_FMA_ROWS(lo, hi)                                                                                \
    "vfma.f32 q8, " lo ", q0\n\tvfma.f32 q9, " hi ", q0\n\t"                                              \
    "vfma.f32 q10, " lo ", q1\n\tvfma.f32 q11, " hi ", q1\n\t"                                            \
    "vfma.f32 q12, " lo ", q2\n\tvfma.f32 q13, " hi ", q2\n\t"                                            \
    "vfma.f32 q14, " lo ", q3\n\tvfma.f32 q15, " hi ", q3\n\t"
/* one step, A row-major: each row's value broadcast from its own pointer, then B's row */
#define V7_FMA_STEP                                                                                        \
    "vld1.32 {d0[], d1[]}, [%[a0]]!\n\tvld1.32 {d2[], d3[]}, [%[a1]]!\n\t"                                \
    "vld1.32 {d4[], d5[]}, [%[a2]]!\n\tvld1.32 {d6[], d7[]}, [%[a3]]!\n\t"                                \
    "vld1.32 {d8-d11}, [%[b]], %[ldb]\n\t" V7_FMA_ROWS("q4", "q5")

/* A row-major: row r at a + r * lda */
static void kernel_neon(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                        int load) {
    const float *a1 = a + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    int n = kc >> 2, rest = kc & 3;
    const ptrdiff_t ldb_b = ldb * (ptrdiff_t)sizeof(float), ldc_b = ldc * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        V7_C_IN
        V7_STEPS(/* four steps */
            V7_FMA_STEP V7_FMA_STEP V7_FMA_STEP V7_FMA_STEP,
            /* the last kc % 4 steps */
            V7_FMA_STEP)
        V7_C_OUT
        : [a0] "+r"(a), [a1] "+r"(a1), [a2] "+r"(a2), [a3] "+r"(a3), [b] "+r"(b), [n] "+r"(n), [rest] "+r"(rest),
          [c] "+r"(c)
        : [ldb] "r"(ldb_b), [ldc] "r"(ldc_b), [load] "r"(load)
        : V7_CLOBBERS);
}

/* A transposed: the four values of step k contiguous at a + k * lda, broadcast into q0-q3 by two VLD4
 * to all lanes (double-spaced: the first fills d0, d2, d4, d6, the second d1, d3, d5, d7), so a step is
 * 2 + 1 loads and 8 VFMA, as many as the VMLA kernel's with A transposed; a pass of four steps 46 for
 * 32 (VMLA's row-major kernel: 42). Three loads a step is the least this tile can take: a step's eight
 * VFMA read six q registers (four broadcasts, B's two) and a load fills at most four d registers. */
#define V7_FMA_AT_STEP(lo, hi, b_lo)                                                                        \
    "vld4.32 {d0[], d2[], d4[], d6[]}, [%[a]]\n\tvld4.32 {d1[], d3[], d5[], d7[]}, [%[a]], %[lda]\n\t"      \
    "vld1.32 {" b_lo "}, [%[b]], %[ldb]\n\t" V7_FMA_ROWS(lo, hi)
static void kernel_neon_at(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                           ptrdiff_t ldc, int load) {
    int n = kc >> 2, rest = kc & 3;
    const ptrdiff_t lda_b = lda * (ptrdiff_t)sizeof(float), ldb_b = ldb * (ptrdiff_t)sizeof(float),
                    ldc_b = ldc * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        V7_C_IN
        V7_STEPS(/* four steps a pass */
            V7_FMA_AT_STEP("q4", "q5", "d8-d11") V7_FMA_AT_STEP("q6", "q7", "d12-d15")
            V7_FMA_AT_STEP("q4", "q5", "d8-d11") V7_FMA_AT_STEP("q6", "q7", "d12-d15"),
            /* the last kc % 4 steps */
            V7_FMA_AT_STEP("q4", "q5", "d8-d11"))
        V7_C_OUT
        : [a] "+r"(a), [b] "+r"(b), [n] "+r"(n), [rest] "+r"(rest), [c] "+r"(c)
        : [lda] "r"(lda_b), [ldb] "r"(ldb_b), [ldc] "r"(ldc_b), [load] "r"(load)
        : V7_CLOBBERS);
}
#else /* unfused: VMLA by scalar */
/* the four rows' multiply-accumulates with B row (lo, hi) and row r's A value in scalar s_r */
#define V7_ROWS(lo, hi, s0, s1, s2, s3)                                                                    \
    "vmla.f32 q8, " lo ", " s0 "\n\tvmla.f32 q9, " hi ", " s0 "\n\t"                                      \
    "vmla.f32 q10, " lo ", " s1 "\n\tvmla.f32 q11, " hi ", " s1 "\n\t"                                    \
    "vmla.f32 q12, " lo ", " s2 "\n\tvmla.f32 q13, " hi ", " s2 "\n\t"                                    \
    "vmla.f32 q14, " lo ", " s3 "\n\tvmla.f32 q15, " hi ", " s3 "\n\t"

/* A row-major: row r at a + r * lda */
static void kernel_neon(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                        int load) {
    const float *a1 = a + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    int n = kc >> 2, rest = kc & 3;
    const ptrdiff_t ldb_b = ldb * (ptrdiff_t)sizeof(float), ldc_b = ldc * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        V7_C_IN
        V7_STEPS(/* four steps: each row's four A values in one register, used by lane */
            "vld1.32 {d0-d1}, [%[a0]]!\n\tvld1.32 {d2-d3}, [%[a1]]!\n\t"
            "vld1.32 {d4-d5}, [%[a2]]!\n\tvld1.32 {d6-d7}, [%[a3]]!\n\t"
            "vld1.32 {d8-d11}, [%[b]], %[ldb]\n\t"
            "vld1.32 {d12-d15}, [%[b]], %[ldb]\n\t"
            V7_ROWS("q4", "q5", "d0[0]", "d2[0]", "d4[0]", "d6[0]")
            "vld1.32 {d8-d11}, [%[b]], %[ldb]\n\t"
            V7_ROWS("q6", "q7", "d0[1]", "d2[1]", "d4[1]", "d6[1]")
            "vld1.32 {d12-d15}, [%[b]], %[ldb]\n\t"
            V7_ROWS("q4", "q5", "d1[0]", "d3[0]", "d5[0]", "d7[0]")
            V7_ROWS("q6", "q7", "d1[1]", "d3[1]", "d5[1]", "d7[1]"),
            /* the last kc % 4 steps one by one, A broadcast */
            "vld1.32 {d0[], d1[]}, [%[a0]]!\n\tvld1.32 {d2[], d3[]}, [%[a1]]!\n\t"
            "vld1.32 {d4[], d5[]}, [%[a2]]!\n\tvld1.32 {d6[], d7[]}, [%[a3]]!\n\t"
            "vld1.32 {d8-d11}, [%[b]], %[ldb]\n\t"
            V7_ROWS("q4", "q5", "d0[0]", "d2[0]", "d4[0]", "d6[0]"))
        V7_C_OUT
        : [a0] "+r"(a), [a1] "+r"(a1), [a2] "+r"(a2), [a3] "+r"(a3), [b] "+r"(b), [n] "+r"(n), [rest] "+r"(rest),
          [c] "+r"(c)
        : [ldb] "r"(ldb_b), [ldc] "r"(ldc_b), [load] "r"(load)
        : V7_CLOBBERS);
}

/* A transposed: the four values of step k contiguous at a + k * lda; two steps a pass */
static void kernel_neon_at(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                           ptrdiff_t ldc, int load) {
    int n = kc >> 1, rest = kc & 1;
    const ptrdiff_t lda_b = lda * (ptrdiff_t)sizeof(float), ldb_b = ldb * (ptrdiff_t)sizeof(float),
                    ldc_b = ldc * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        V7_C_IN
        "cmp %[n], #0\n\t"
        "beq 5f\n\t"
        "4:\n\t"
        "vld1.32 {d0-d1}, [%[a]], %[lda]\n\tvld1.32 {d8-d11}, [%[b]], %[ldb]\n\t"
        "vld1.32 {d2-d3}, [%[a]], %[lda]\n\tvld1.32 {d12-d15}, [%[b]], %[ldb]\n\t"
        V7_ROWS("q4", "q5", "d0[0]", "d0[1]", "d1[0]", "d1[1]")
        V7_ROWS("q6", "q7", "d2[0]", "d2[1]", "d3[0]", "d3[1]")
        "subs %[n], %[n], #1\n\t"
        "bne 4b\n\t"
        "5:\n\t"
        "cmp %[rest], #0\n\t"
        "beq 7f\n\t"
        "vld1.32 {d0-d1}, [%[a]], %[lda]\n\tvld1.32 {d8-d11}, [%[b]], %[ldb]\n\t"
        V7_ROWS("q4", "q5", "d0[0]", "d0[1]", "d1[0]", "d1[1]")
        "7:\n\t"
        V7_C_OUT
        : [a] "+r"(a), [b] "+r"(b), [n] "+r"(n), [rest] "+r"(rest), [c] "+r"(c)
        : [lda] "r"(lda_b), [ldb] "r"(ldb_b), [ldc] "r"(ldc_b), [load] "r"(load)
        : V7_CLOBBERS);
}
#endif /* TB_MADD_FUSED */
#else
#define V7_ASM 0
#endif

/* aarch64: the whole micro-kernel in asm (C's tile in v16-v31, row r in v(16+2r), v(17+2r); A in
 * v0-v7, B in v8-v9, the unfused product in v10). Each B row is one LD1 of eight floats
 * post-incremented by ldb (any ldb: a packed panel or B in place), each A row one LD1 post-incremented
 * through its own pointer (x9-x15 for rows 1-7), so a pass of four steps is 8 + 4 loads, 64 FMLA (or
 * 64 FMUL + 64 FADD unfused: the product rounded, then added, as vaddq_f32(product, c)), the count and
 * the branch: 78 for 64 (GCC's own made 82, more with B in place), and a call's set-up, C's loads or
 * zeros and stores about 50 (GCC's ~110: GDN's products are many short ones). In C the tile is 16
 * "+w" operands, 32 of asm's 30, so the asm holds the whole kernel. */
#if defined(__aarch64__)
#define A64_ASM 1
#if TB_MADD_FUSED
#define A64_MADD(c, b, s) "fmla " c ".4s, " b ".4s, " s "\n\t"
#else
#define A64_MADD(c, b, s) "fmul v10.4s, " b ".4s, " s "\n\tfadd " c ".4s, v10.4s, " c ".4s\n\t"
#endif
/* the eight rows' multiply-adds with B row (v8, v9) and row r's A value in lane s_r */
#define A64_ROWS(s0, s1, s2, s3, s4, s5, s6, s7)                                                           \
    A64_MADD("v16", "v8", s0) A64_MADD("v17", "v9", s0) A64_MADD("v18", "v8", s1) A64_MADD("v19", "v9", s1) \
    A64_MADD("v20", "v8", s2) A64_MADD("v21", "v9", s2) A64_MADD("v22", "v8", s3) A64_MADD("v23", "v9", s3) \
    A64_MADD("v24", "v8", s4) A64_MADD("v25", "v9", s4) A64_MADD("v26", "v8", s5) A64_MADD("v27", "v9", s5) \
    A64_MADD("v28", "v8", s6) A64_MADD("v29", "v9", s6) A64_MADD("v30", "v8", s7) A64_MADD("v31", "v9", s7)
#define A64_LOAD_B "ld1 {v8.4s, v9.4s}, [%[b]], %[ldb]\n\t"
/* step `l` of four, row r's A values in v<r> */
#define A64_LANE(l)                                                                                        \
    A64_LOAD_B A64_ROWS("v0.s[" #l "]", "v1.s[" #l "]", "v2.s[" #l "]", "v3.s[" #l "]", "v4.s[" #l "]",   \
                        "v5.s[" #l "]", "v6.s[" #l "]", "v7.s[" #l "]")
/* C's tile: loaded (load != 0) or zeros, at the start; stored at the end (x16 walks its rows) */
#define A64_C_IN                                                                                           \
    "mov x16, %[c]\n\t"                                                                                    \
    "cbz %w[load], 2f\n\t"                                                                                 \
    "ld1 {v16.4s, v17.4s}, [x16], %[ldc]\n\tld1 {v18.4s, v19.4s}, [x16], %[ldc]\n\t"                      \
    "ld1 {v20.4s, v21.4s}, [x16], %[ldc]\n\tld1 {v22.4s, v23.4s}, [x16], %[ldc]\n\t"                      \
    "ld1 {v24.4s, v25.4s}, [x16], %[ldc]\n\tld1 {v26.4s, v27.4s}, [x16], %[ldc]\n\t"                      \
    "ld1 {v28.4s, v29.4s}, [x16], %[ldc]\n\tld1 {v30.4s, v31.4s}, [x16]\n\t"                              \
    "b 3f\n\t"                                                                                             \
    "2:\n\t"                                                                                               \
    "movi v16.16b, #0\n\tmovi v17.16b, #0\n\tmovi v18.16b, #0\n\tmovi v19.16b, #0\n\t"                    \
    "movi v20.16b, #0\n\tmovi v21.16b, #0\n\tmovi v22.16b, #0\n\tmovi v23.16b, #0\n\t"                    \
    "movi v24.16b, #0\n\tmovi v25.16b, #0\n\tmovi v26.16b, #0\n\tmovi v27.16b, #0\n\t"                    \
    "movi v28.16b, #0\n\tmovi v29.16b, #0\n\tmovi v30.16b, #0\n\tmovi v31.16b, #0\n\t"                    \
    "3:\n\t"
#define A64_C_OUT                                                                                          \
    "mov x16, %[c]\n\t"                                                                                    \
    "st1 {v16.4s, v17.4s}, [x16], %[ldc]\n\tst1 {v18.4s, v19.4s}, [x16], %[ldc]\n\t"                      \
    "st1 {v20.4s, v21.4s}, [x16], %[ldc]\n\tst1 {v22.4s, v23.4s}, [x16], %[ldc]\n\t"                      \
    "st1 {v24.4s, v25.4s}, [x16], %[ldc]\n\tst1 {v26.4s, v27.4s}, [x16], %[ldc]\n\t"                      \
    "st1 {v28.4s, v29.4s}, [x16], %[ldc]\n\tst1 {v30.4s, v31.4s}, [x16]\n\t"
#define A64_CLOBBERS                                                                                       \
    "x9", "x10", "x11", "x12", "x13", "x14", "x15", "x16", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7",  \
        "v8", "v9", "v10", "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25", "v26",      \
        "v27", "v28", "v29", "v30", "v31", "memory", "cc"

/* A row-major (row r at a + r * lda): A's row pointers, then kc / 4 passes of four steps and kc % 4
 * single steps on the tile in v16-v31 */
#define A64_NN_STEPS                                                                                       \
    "add x9, %[a], %[lda]\n\tadd x10, x9, %[lda]\n\tadd x11, x10, %[lda]\n\tadd x12, x11, %[lda]\n\t"     \
    "add x13, x12, %[lda]\n\tadd x14, x13, %[lda]\n\tadd x15, x14, %[lda]\n\t"                            \
    "cbz %[n], 5f\n\t"                                                                                     \
    "4:\n\t" /* four steps: each row's four A values in one register, used by lane */                     \
    "ld1 {v0.4s}, [%[a]], #16\n\tld1 {v1.4s}, [x9], #16\n\tld1 {v2.4s}, [x10], #16\n\t"                   \
    "ld1 {v3.4s}, [x11], #16\n\tld1 {v4.4s}, [x12], #16\n\tld1 {v5.4s}, [x13], #16\n\t"                   \
    "ld1 {v6.4s}, [x14], #16\n\tld1 {v7.4s}, [x15], #16\n\t"                                               \
    A64_LANE(0) A64_LANE(1) A64_LANE(2) A64_LANE(3)                                                        \
    "subs %[n], %[n], #1\n\t"                                                                              \
    "b.ne 4b\n\t"                                                                                          \
    "5:\n\t"                                                                                               \
    "cbz %[rest], 7f\n\t"                                                                                  \
    "6:\n\t" /* the last kc % 4 steps one by one, A broadcast */                                          \
    "ld1r {v0.4s}, [%[a]], #4\n\tld1r {v1.4s}, [x9], #4\n\tld1r {v2.4s}, [x10], #4\n\t"                   \
    "ld1r {v3.4s}, [x11], #4\n\tld1r {v4.4s}, [x12], #4\n\tld1r {v5.4s}, [x13], #4\n\t"                   \
    "ld1r {v6.4s}, [x14], #4\n\tld1r {v7.4s}, [x15], #4\n\t"                                               \
    A64_LANE(0)                                                                                            \
    "subs %[rest], %[rest], #1\n\t"                                                                        \
    "b.ne 6b\n\t"                                                                                          \
    "7:\n\t"

/* A row-major: row r at a + r * lda */
static void kernel_neon(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                        int load) {
    long n = kc >> 2, rest = kc & 3;
    const ptrdiff_t lda_b = lda * (ptrdiff_t)sizeof(float), ldb_b = ldb * (ptrdiff_t)sizeof(float),
                    ldc_b = ldc * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        A64_C_IN
        A64_NN_STEPS
        A64_C_OUT
        : [a] "+r"(a), [b] "+r"(b), [n] "+r"(n), [rest] "+r"(rest)
        : [lda] "r"(lda_b), [ldb] "r"(ldb_b), [c] "r"(c), [ldc] "r"(ldc_b), [load] "r"(load)
        : A64_CLOBBERS);
}

/* 4 x 16 tiles for tb_gemm_tiles (whole tiles, B in place): C's tile in v16-v31 (row r in v(16+4r) ..
 * v(19+4r)), A's four rows eight steps at a time in v0-v7 (row r in v(2r), v(2r+1)), B's row of sixteen
 * in v8-v11 by one LD1, the unfused product in v12. Eight steps are 4 + 8 loads, 128 FMLA, the count
 * and the branch: 142 for 128 where the 8 x 8 kernel takes 156 (8 + 8 loads and two loop ends); C is
 * 4 loads and 4 stores a tile instead of 8 and 8. Each C element is the same chain, in the same order,
 * with the same multiply-add (operands in the 8 x 8 kernel's order), so the bits are tb_gemm's. */
#if TB_MADD_FUSED
#define A416_MADD(c, b, s) "fmla " c ".4s, " b ".4s, " s "\n\t"
#else
#define A416_MADD(c, b, s) "fmul v12.4s, " b ".4s, " s "\n\tfadd " c ".4s, v12.4s, " c ".4s\n\t"
#endif
/* one step: B's row, then row r's sixteen multiply-adds with its A value s_r */
#define A416_STEP(s0, s1, s2, s3)                                                                          \
    "ld1 {v8.4s, v9.4s, v10.4s, v11.4s}, [%[b]], %[ldb]\n\t"                                             \
    A416_MADD("v16", "v8", s0) A416_MADD("v17", "v9", s0) A416_MADD("v18", "v10", s0) A416_MADD("v19", "v11", s0) \
    A416_MADD("v20", "v8", s1) A416_MADD("v21", "v9", s1) A416_MADD("v22", "v10", s1) A416_MADD("v23", "v11", s1) \
    A416_MADD("v24", "v8", s2) A416_MADD("v25", "v9", s2) A416_MADD("v26", "v10", s2) A416_MADD("v27", "v11", s2) \
    A416_MADD("v28", "v8", s3) A416_MADD("v29", "v9", s3) A416_MADD("v30", "v10", s3) A416_MADD("v31", "v11", s3)
/* step `l` of a register of four: rows' values in v0, v2, v4, v6 (lo) or v1, v3, v5, v7 (hi) */
#define A416_LANE_LO(l) A416_STEP("v0.s[" #l "]", "v2.s[" #l "]", "v4.s[" #l "]", "v6.s[" #l "]")
#define A416_LANE_HI(l) A416_STEP("v1.s[" #l "]", "v3.s[" #l "]", "v5.s[" #l "]", "v7.s[" #l "]")
/* A's row pointers, then kc / 8 passes of eight steps, one of four when kc % 8 >= 4, kc % 4 single steps */
#define A416_STEPS                                                                                         \
    "add x9, %[a], %[lda]\n\tadd x10, x9, %[lda]\n\tadd x11, x10, %[lda]\n\t"                             \
    "cbz %[n], 5f\n\t"                                                                                     \
    "4:\n\t"                                                                                               \
    "ld1 {v0.4s, v1.4s}, [%[a]], #32\n\tld1 {v2.4s, v3.4s}, [x9], #32\n\t"                                \
    "ld1 {v4.4s, v5.4s}, [x10], #32\n\tld1 {v6.4s, v7.4s}, [x11], #32\n\t"                                \
    A416_LANE_LO(0) A416_LANE_LO(1) A416_LANE_LO(2) A416_LANE_LO(3)                                        \
    A416_LANE_HI(0) A416_LANE_HI(1) A416_LANE_HI(2) A416_LANE_HI(3)                                        \
    "subs %[n], %[n], #1\n\t"                                                                              \
    "b.ne 4b\n\t"                                                                                          \
    "5:\n\t"                                                                                               \
    "cbz %[four], 6f\n\t"                                                                                  \
    "ld1 {v0.4s}, [%[a]], #16\n\tld1 {v2.4s}, [x9], #16\n\tld1 {v4.4s}, [x10], #16\n\tld1 {v6.4s}, [x11], #16\n\t" \
    A416_LANE_LO(0) A416_LANE_LO(1) A416_LANE_LO(2) A416_LANE_LO(3)                                        \
    "6:\n\t"                                                                                               \
    "cbz %[rest], 8f\n\t"                                                                                  \
    "7:\n\t"                                                                                               \
    "ld1r {v0.4s}, [%[a]], #4\n\tld1r {v2.4s}, [x9], #4\n\tld1r {v4.4s}, [x10], #4\n\tld1r {v6.4s}, [x11], #4\n\t" \
    A416_LANE_LO(0)                                                                                        \
    "subs %[rest], %[rest], #1\n\t"                                                                        \
    "b.ne 7b\n\t"                                                                                          \
    "8:\n\t"
#define A416_C_OUT                                                                                         \
    "mov x16, %[c]\n\t"                                                                                    \
    "st1 {v16.4s, v17.4s, v18.4s, v19.4s}, [x16], %[ldc]\n\tst1 {v20.4s, v21.4s, v22.4s, v23.4s}, [x16], %[ldc]\n\t" \
    "st1 {v24.4s, v25.4s, v26.4s, v27.4s}, [x16], %[ldc]\n\tst1 {v28.4s, v29.4s, v30.4s, v31.4s}, [x16]\n\t"
#define A416_CLOBBERS                                                                                      \
    "x9", "x10", "x11", "x16", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12", \
        "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25", "v26", "v27", "v28", "v29",    \
        "v30", "v31", "memory", "cc"

/* C[4 x 16] = (load ? C : 0) + A B, A row-major (row r at a + r * lda) */
static void kernel_neon_4x16(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                             ptrdiff_t ldc, int load) {
    long n = kc >> 3, four = (kc >> 2) & 1, rest = kc & 3;
    const ptrdiff_t lda_b = lda * (ptrdiff_t)sizeof(float), ldb_b = ldb * (ptrdiff_t)sizeof(float),
                    ldc_b = ldc * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        "mov x16, %[c]\n\t"
        "cbz %w[load], 2f\n\t"
        "ld1 {v16.4s, v17.4s, v18.4s, v19.4s}, [x16], %[ldc]\n\tld1 {v20.4s, v21.4s, v22.4s, v23.4s}, [x16], %[ldc]\n\t"
        "ld1 {v24.4s, v25.4s, v26.4s, v27.4s}, [x16], %[ldc]\n\tld1 {v28.4s, v29.4s, v30.4s, v31.4s}, [x16]\n\t"
        "b 3f\n\t"
        "2:\n\t"
        "movi v16.16b, #0\n\tmovi v17.16b, #0\n\tmovi v18.16b, #0\n\tmovi v19.16b, #0\n\t"
        "movi v20.16b, #0\n\tmovi v21.16b, #0\n\tmovi v22.16b, #0\n\tmovi v23.16b, #0\n\t"
        "movi v24.16b, #0\n\tmovi v25.16b, #0\n\tmovi v26.16b, #0\n\tmovi v27.16b, #0\n\t"
        "movi v28.16b, #0\n\tmovi v29.16b, #0\n\tmovi v30.16b, #0\n\tmovi v31.16b, #0\n\t"
        "3:\n\t"
        A416_STEPS
        A416_C_OUT
        : [a] "+r"(a), [b] "+r"(b), [n] "+r"(n), [four] "+r"(four), [rest] "+r"(rest)
        : [lda] "r"(lda_b), [ldb] "r"(ldb_b), [c] "r"(c), [ldc] "r"(ldc_b), [load] "r"(load)
        : A416_CLOBBERS);
}

/* C[4 x 16] = diag(e) X + A B: X's tile (leading dimension ldx; C itself, or another matrix) loaded and
 * row r multiplied by e[r] (FMUL by element: x * e[r] rounded, the bits of a separate pass of x * a),
 * then the steps. GDN's state update (S = diag(exp(G_last)) S + K^T U) and its right-hand sides
 * (R = diag(beta) V - K S) without a pass of their own over X (a load, a multiply and a store a quad). */
static void kernel_neon_4x16_scaled(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                                    ptrdiff_t ldc, const float *x, ptrdiff_t ldx, const float *e) {
    long n = kc >> 3, four = (kc >> 2) & 1, rest = kc & 3;
    const ptrdiff_t lda_b = lda * (ptrdiff_t)sizeof(float), ldb_b = ldb * (ptrdiff_t)sizeof(float),
                    ldc_b = ldc * (ptrdiff_t)sizeof(float), ldx_b = ldx * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        "ld1 {v0.4s}, [%[e]]\n\t"
        "ld1 {v16.4s, v17.4s, v18.4s, v19.4s}, [%[x]], %[ldx]\n\tld1 {v20.4s, v21.4s, v22.4s, v23.4s}, [%[x]], %[ldx]\n\t"
        "ld1 {v24.4s, v25.4s, v26.4s, v27.4s}, [%[x]], %[ldx]\n\tld1 {v28.4s, v29.4s, v30.4s, v31.4s}, [%[x]]\n\t"
        "fmul v16.4s, v16.4s, v0.s[0]\n\tfmul v17.4s, v17.4s, v0.s[0]\n\tfmul v18.4s, v18.4s, v0.s[0]\n\tfmul v19.4s, v19.4s, v0.s[0]\n\t"
        "fmul v20.4s, v20.4s, v0.s[1]\n\tfmul v21.4s, v21.4s, v0.s[1]\n\tfmul v22.4s, v22.4s, v0.s[1]\n\tfmul v23.4s, v23.4s, v0.s[1]\n\t"
        "fmul v24.4s, v24.4s, v0.s[2]\n\tfmul v25.4s, v25.4s, v0.s[2]\n\tfmul v26.4s, v26.4s, v0.s[2]\n\tfmul v27.4s, v27.4s, v0.s[2]\n\t"
        "fmul v28.4s, v28.4s, v0.s[3]\n\tfmul v29.4s, v29.4s, v0.s[3]\n\tfmul v30.4s, v30.4s, v0.s[3]\n\tfmul v31.4s, v31.4s, v0.s[3]\n\t"
        A416_STEPS
        A416_C_OUT
        : [a] "+r"(a), [b] "+r"(b), [n] "+r"(n), [four] "+r"(four), [rest] "+r"(rest), [x] "+r"(x)
        : [lda] "r"(lda_b), [ldb] "r"(ldb_b), [c] "r"(c), [ldc] "r"(ldc_b), [ldx] "r"(ldx_b), [e] "r"(e)
        : A416_CLOBBERS);
}

/* A transposed: the eight values of step k contiguous at a + k * lda, one LD1 into (v0, v1) */
#define A64_AT_STEP                                                                                        \
    "ld1 {v0.4s, v1.4s}, [%[a]], %[lda]\n\t" A64_LOAD_B                                                    \
    A64_ROWS("v0.s[0]", "v0.s[1]", "v0.s[2]", "v0.s[3]", "v1.s[0]", "v1.s[1]", "v1.s[2]", "v1.s[3]")
static void kernel_neon_at(int kc, const float *a, ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c,
                           ptrdiff_t ldc, int load) {
    long n = kc >> 1, rest = kc & 1;
    const ptrdiff_t lda_b = lda * (ptrdiff_t)sizeof(float), ldb_b = ldb * (ptrdiff_t)sizeof(float),
                    ldc_b = ldc * (ptrdiff_t)sizeof(float);
    __asm__ volatile(
        A64_C_IN
        "cbz %[n], 5f\n\t"
        "4:\n\t" /* two steps a pass */
        A64_AT_STEP A64_AT_STEP
        "subs %[n], %[n], #1\n\t"
        "b.ne 4b\n\t"
        "5:\n\t"
        "cbz %[rest], 7f\n\t"
        A64_AT_STEP
        "7:\n\t"
        A64_C_OUT
        : [a] "+r"(a), [b] "+r"(b), [n] "+r"(n), [rest] "+r"(rest)
        : [lda] "r"(lda_b), [ldb] "r"(ldb_b), [c] "r"(c), [ldc] "r"(ldc_b), [load] "r"(load)
        : A64_CLOBBERS);
}
#else
#define A64_ASM 0
#endif

/* B transposed (element (k, j) at src[j * cs + k]) into a kc x N_NR panel, zero for j >= nc: four
 * columns' four steps in four registers, stored by one interleaving store per step (st4 / vst4 by
 * lane: dst[k * N_NR + j .. j + 3]), no shuffles. The scalar packing took ~4 instructions a float. */
static void pack_t_neon(int kc, int nc, const float *src, ptrdiff_t cs, float *dst) {
    if (nc == N_NR) { /* a whole panel (every one but a product's last): eight columns' pointers walked,
                       * the stores in address order (each row's two halves, row after row) */
        const float *s0 = src, *s1 = src + cs, *s2 = src + 2 * cs, *s3 = src + 3 * cs, *s4 = src + 4 * cs,
                    *s5 = src + 5 * cs, *s6 = src + 6 * cs, *s7 = src + 7 * cs;
        int k = 0;
        for (; k + 4 <= kc; k += 4) {
            float32x4x4_t lo, hi;
            lo.val[0] = vld1q_f32(s0), lo.val[1] = vld1q_f32(s1), lo.val[2] = vld1q_f32(s2), lo.val[3] = vld1q_f32(s3);
            hi.val[0] = vld1q_f32(s4), hi.val[1] = vld1q_f32(s5), hi.val[2] = vld1q_f32(s6), hi.val[3] = vld1q_f32(s7);
            s0 += 4, s1 += 4, s2 += 4, s3 += 4, s4 += 4, s5 += 4, s6 += 4, s7 += 4;
            vst4q_lane_f32(dst, lo, 0), vst4q_lane_f32(dst + 4, hi, 0);
            vst4q_lane_f32(dst + 8, lo, 1), vst4q_lane_f32(dst + 12, hi, 1);
            vst4q_lane_f32(dst + 16, lo, 2), vst4q_lane_f32(dst + 20, hi, 2);
            vst4q_lane_f32(dst + 24, lo, 3), vst4q_lane_f32(dst + 28, hi, 3);
            dst += 4 * N_NR;
        }
        for (; k < kc; k++, dst += N_NR) {
            dst[0] = *s0++, dst[1] = *s1++, dst[2] = *s2++, dst[3] = *s3++;
            dst[4] = *s4++, dst[5] = *s5++, dst[6] = *s6++, dst[7] = *s7++;
        }
        return;
    }
    const int full = nc & ~3;
    int k = 0;
    for (; k + 4 <= kc; k += 4, src += 4, dst += 4 * N_NR) {
        for (int j = 0; j < full; j += 4) {
            float32x4x4_t r;
            r.val[0] = vld1q_f32(src + j * cs), r.val[1] = vld1q_f32(src + (j + 1) * cs);
            r.val[2] = vld1q_f32(src + (j + 2) * cs), r.val[3] = vld1q_f32(src + (j + 3) * cs);
            vst4q_lane_f32(dst + j, r, 0);
            vst4q_lane_f32(dst + N_NR + j, r, 1);
            vst4q_lane_f32(dst + 2 * N_NR + j, r, 2);
            vst4q_lane_f32(dst + 3 * N_NR + j, r, 3);
        }
        for (int kk = 0; kk < 4; kk++) {
            for (int j = full; j < nc; j++) dst[kk * N_NR + j] = src[j * cs + kk];
            for (int j = nc; j < N_NR; j++) dst[kk * N_NR + j] = 0.0f;
        }
    }
    for (; k < kc; k++, src++, dst += N_NR) {
        for (int j = 0; j < nc; j++) dst[j] = src[j * cs];
        for (int j = nc; j < N_NR; j++) dst[j] = 0.0f;
    }
}

static const tb_gemm_kernels neon_kernels = {TB_MADD_FUSED ? "neon-fma" : "neon", N_MR, N_NR, kernel_neon,
                                             kernel_neon_at, pack_t_neon};
#endif

/* --- the choice of micro-kernel ------------------------------------------------------------------- */

static const tb_gemm_kernels *chosen;
static pthread_once_t chosen_once = PTHREAD_ONCE_INIT;

#if !(defined(__x86_64__) && defined(__AVX512F__))
const tb_gemm_kernels *tb_gemm_avx512_kernels(void) { return NULL; }
#endif
#if !(defined(__x86_64__) && defined(__AVX2__))
const tb_gemm_kernels *tb_gemm_avx2_kernels(void) { return NULL; }
#endif

/* The widest micro-kernel the build's flags compiled in, or the one TB_ISA names (when compiled in;
 * else the widest below it). Which build runs on which CPU is decided when it is loaded: the host
 * library is built once per x86-64 level and the loader takes the best one the CPU has
 * (testbed.backends.native.build.library_variants), the programs are built for the machine that runs
 * them, and ARM and Hexagon builds are for their target. So nothing here asks the CPU. */
static void choose(void) {
    const char *want = getenv("TB_ISA");
    int rank = 3; /* 3 avx512, 2 avx2, 1 neon, 0 portable (TB_ISA=scalar or portable) */
    if (want && !strcmp(want, "avx2")) rank = 2;
    else if (want && !strcmp(want, "neon")) rank = 1;
    else if (want && (!strcmp(want, "scalar") || !strcmp(want, "portable"))) rank = 0;
    chosen = &scalar_kernels;
#if defined(__x86_64__)
    const tb_gemm_kernels *k512 = tb_gemm_avx512_kernels(), *k2 = tb_gemm_avx2_kernels();
    if (rank >= 3 && k512) chosen = k512;
    else if (rank >= 2 && k2) chosen = k2;
#elif defined(TB_NEON)
    if (rank >= 1) chosen = &neon_kernels;
#else
    (void)rank; /* the portable kernel is all there is */
#endif
}

static const tb_gemm_kernels *kernels(void) {
    pthread_once(&chosen_once, choose);
    return chosen;
}

const char *tb_gemm_isa(void) { return kernels()->name; }

/* --- scratch: per thread and slot, grown as needed, kept, freed when the thread ends ----------------- */

#define SCRATCH_SLOTS 2
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
typedef struct {
    size_t cap[SCRATCH_SLOTS];
    float *p[SCRATCH_SLOTS];
} scratch_bufs;

static void scratch_free(void *p) {
    scratch_bufs *s = p;
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(s->p[i]);
    free(s);
}
static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

float *tb_thread_scratch(int slot, size_t floats) {
    pthread_once(&scratch_once, scratch_init);
    scratch_bufs *s = pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) return NULL;
        pthread_setspecific(scratch_key, s);
    }
    if (s->cap[slot] < floats) {
        free(s->p[slot]);
        /* 64-byte aligned: packed panels are read by full-vector loads */
        if (posix_memalign((void **)&s->p[slot], 64, sizeof(float) * floats)) s->p[slot] = NULL, s->cap[slot] = 0;
        else s->cap[slot] = floats;
    }
    return s->p[slot];
}

static float *scratch(size_t floats) { return tb_thread_scratch(TB_SCRATCH_GEMM, floats); }

/* --- packing ---------------------------------------------------------------------------------------- */

/* dst[j] = src[j] for j < nr (a multiple of VF_LANES): one row of a panel, in registers. A call of
 * memcpy per row of nr floats (128 bytes at AVX-512's 32) was most of the packing of attention's
 * value blocks, a few percent of the whole layer. */
static inline void copy_panel_row(float *dst, const float *src, int nr) {
    for (int j = 0; j < nr; j += VF_LANES) vf_store(dst + j, vf_load(src + j));
}

/* kc x nc of B from (k0, n0) into a kc x nr panel dst[k * nr + j], zeros for j >= nc. */
static void pack_panel(const tb_gemm_kernels *kr, const tb_gemm_b *B, int k0, int kc, int n0, int nc, float *dst,
                       float *tmp) {
    const int nr = kr->nr;
    if (B->rows) { /* the caller's columns as float rows, then transposed into the panel */
        B->rows(B, n0, nc, k0, kc, tmp);
        if (kr->pack_t) {
            kr->pack_t(kc, nc, tmp, kc, dst);
            return;
        }
        for (int k = 0; k < kc; k++) {
            for (int j = 0; j < nc; j++) dst[k * nr + j] = tmp[(size_t)j * kc + k];
            for (int j = nc; j < nr; j++) dst[k * nr + j] = 0.0f;
        }
        return;
    }
    const float *src = B->p + k0 * B->rs + n0 * B->cs;
    if (B->cs == 1) {
        for (int k = 0; k < kc; k++) {
            memcpy(dst + (size_t)k * nr, src + k * B->rs, sizeof(float) * (size_t)nc);
            memset(dst + (size_t)k * nr + nc, 0, sizeof(float) * (size_t)(nr - nc));
        }
    } else if (B->rs == 1 && kr->pack_t) {
        kr->pack_t(kc, nc, src, B->cs, dst);
    } else {
        for (int k = 0; k < kc; k++) {
            for (int j = 0; j < nc; j++) dst[k * nr + j] = src[k * B->rs + j * B->cs];
            for (int j = nc; j < nr; j++) dst[k * nr + j] = 0.0f;
        }
    }
}

/* --- the driver --------------------------------------------------------------------------------------- */

/* armv7 fused (VFPv4): VFMA has no by-scalar form, so with A row-major the micro-kernel broadcasts each
 * A value by a load of its own (13 instructions a step of 8 VFMA), with A transposed by two VLD4 for
 * four rows (11). When a row tile passes over two or more panels, the driver packs A's whole row tiles
 * transposed (tile t's step k: the four rows' values at apack + (t kc + k) 4), one VST4 per four steps
 * of a tile, and runs kernel_at on them. The same multiply-adds in the same order: the same bits. */
#if defined(TB_NEON) && !defined(__aarch64__) && TB_MADD_FUSED
#define PACK_A 1
static void pack_a_v7(int tiles, int kc, const float *a, ptrdiff_t lda, float *dst) {
    for (int t = 0; t < tiles; t++, a += 4 * lda) {
        const float *r0 = a, *r1 = a + lda, *r2 = a + 2 * lda, *r3 = a + 3 * lda;
        int k = 0;
        for (; k + 4 <= kc; k += 4, dst += 16) {
            float32x4x4_t x;
            x.val[0] = vld1q_f32(r0 + k), x.val[1] = vld1q_f32(r1 + k);
            x.val[2] = vld1q_f32(r2 + k), x.val[3] = vld1q_f32(r3 + k);
            vst4q_f32(dst, x);
        }
        for (; k < kc; k++, dst += 4) dst[0] = r0[k], dst[1] = r1[k], dst[2] = r2[k], dst[3] = r3[k];
    }
}
#else
#define PACK_A 0
#endif

/* The driver; at: A given transposed (A[i][k] at A[k * lda + i]). */
static void gemm(int M, int N, int K, const float *A, int lda, int at, const tb_gemm_b *B, float *C, int ldc,
                 int accumulate, int lower) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate)
            for (int i = 0; i < M; i++) memset(C + (size_t)i * ldc, 0, sizeof(float) * (size_t)N);
        return;
    }
    const tb_gemm_kernels *kr = kernels();
    const int mr = kr->mr, nr = kr->nr;
    const int kcb = K < KC ? K : KC, ncb = N < NC ? N : NC, panels = (ncb + nr - 1) / nr;
    /* A row-major B is read in place when few row tiles pass over it (packing would cost as much as
     * the product); a transposed or dequantised one is always packed. */
    const int direct = !B->rows && B->cs == 1 && (M <= 2 * mr || (M <= DIRECT_ROWS && (B->rs * sizeof(float)) % 4096 != 0));
    const size_t pack_floats = direct ? (size_t)kcb * nr : (size_t)kcb * nr * panels;
#if PACK_A
    /* A packed when it is row-major and a row tile meets two or more panels */
    const int pack_a = kr == &neon_kernels && !at && M >= mr && (ncb > nr || N > NC);
    const size_t apack_floats = pack_a ? (size_t)(M / mr) * mr * kcb : 0;
    float *buf = scratch(pack_floats + (size_t)mr * kcb + (size_t)mr * nr + (B->rows ? (size_t)nr * kcb : 0) + 16 +
                         apack_floats);
#else
    float *buf = scratch(pack_floats + (size_t)mr * kcb + (size_t)mr * nr + (B->rows ? (size_t)nr * kcb : 0) + 16);
#endif
    if (!buf) abort(); /* a few hundred KiB per thread; nothing sensible to return to a void caller */
    float *bpack = buf, *apad = bpack + pack_floats, *ctile = apad + (size_t)mr * kcb, *tmp = ctile + (size_t)mr * nr;

    for (int jc = 0; jc < N; jc += NC) {
        const int nc = N - jc < NC ? N - jc : NC;
        for (int pc = 0; pc < K; pc += KC) {
            const int kc = K - pc < KC ? K - pc : KC;
            const int load = accumulate || pc > 0;
#if PACK_A
            float *const apack = tmp + (B->rows ? (size_t)nr * kcb : 0) + 16;
            if (pack_a) pack_a_v7(M / mr, kc, A + pc, lda, apack);
#endif
            if (!direct && !B->rows && B->cs == 1) { /* row-major B: read along its rows, once */
                /* walked by pointers, and a panel row of one vector (NEON's and the portable kernel's
                 * nr) copied as one: indexed by ((p kc + k) nr), this loop took ~26 instructions per 8
                 * floats on aarch64, 7% of a 128^3 product's */
                const int full = nc / nr;
                const size_t panel = (size_t)kc * nr;
                for (int k = 0; k < kc; k++) {
                    const float *s = B->p + (size_t)(pc + k) * B->rs + jc;
                    float *d = bpack + (size_t)k * nr;
                    int p = 0;
                    if (nr == VF_LANES)
                        for (; p < full; p++, s += VF_LANES, d += panel) vf_store(d, vf_load(s));
                    else
                        for (; p < full; p++, s += nr, d += panel) copy_panel_row(d, s, nr);
                    if (p * nr < nc) {
                        memcpy(d, s, sizeof(float) * (size_t)(nc - p * nr));
                        memset(d + (nc - p * nr), 0, sizeof(float) * (size_t)((p + 1) * nr - nc));
                    }
                }
            } else if (!direct) {
                for (int p = 0; p * nr < nc; p++)
                    pack_panel(kr, B, pc, kc, jc + p * nr, nc - p * nr < nr ? nc - p * nr : nr,
                               bpack + (size_t)p * kc * nr, tmp);
            }
            for (int jr = 0; jr < nc; jr += nr) {
                const int cols = nc - jr < nr ? nc - jr : nr;
                const float *bp;
                ptrdiff_t ldb;
                if (!direct) {
                    bp = bpack + (size_t)(jr / nr) * kc * nr, ldb = nr;
                } else if (cols == nr) {
                    bp = B->p + pc * B->rs + jc + jr, ldb = B->rs;
                } else {
                    pack_panel(kr, B, pc, kc, jc + jr, cols, bpack, tmp);
                    bp = bpack, ldb = nr;
                }
                int i0 = 0;
                if (cols == nr) {
                    /* the whole row tiles of a whole panel, the common case, kept tight: the general
                     * loop below re-derives every operand per tile (~60 instructions a tile on armv7,
                     * as many as the loads of a 16-step kernel call). The same calls, in order. */
                    void (*const kernel)(int, const float *, ptrdiff_t, const float *, ptrdiff_t, float *, ptrdiff_t,
                                         int) = at ? kr->kernel_at : kr->kernel;
                    const float *ap = at ? A + (size_t)pc * lda : A + pc;
                    float *cp = C + jc + jr;
                    const size_t astep = at ? (size_t)mr : (size_t)mr * lda, cstep = (size_t)mr * ldc;
#if PACK_A
                    if (pack_a) /* every whole row tile from the packed A (the loop below then has none left) */
                        for (const float *pa = apack; i0 + mr <= M; i0 += mr, pa += (size_t)mr * kc, cp += cstep) {
                            int keff = kc;
                            if (lower) {
                                const int kend = i0 + mr;
                                if (kend <= pc) continue;
                                if (kend - pc < keff) keff = kend - pc;
                            }
                            kr->kernel_at(keff, pa, mr, bp, ldb, cp, ldc, load);
                        }
#endif
                    for (; i0 + mr <= M; i0 += mr, ap += astep, cp += cstep) {
                        int keff = kc;
                        if (lower) {
                            const int kend = i0 + mr; /* row i needs k <= i */
                            if (kend <= pc) continue; /* nothing in this block: C keeps its chain (load = 1 here) */
                            if (kend - pc < keff) keff = kend - pc;
                        }
                        kernel(keff, ap, lda, bp, ldb, cp, ldc, load);
                    }
                }
                for (; i0 < M; i0 += mr) {
                    const int rows = M - i0 < mr ? M - i0 : mr;
                    int keff = kc;
                    if (lower) {
                        const int kend = i0 + rows; /* row i needs k <= i */
                        if (kend <= pc) continue; /* nothing in this block: C keeps its chain (load = 1 here) */
                        if (kend - pc < keff) keff = kend - pc;
                    }
                    const float *ap = at ? A + (size_t)pc * lda + i0 : A + (size_t)i0 * lda + pc;
                    ptrdiff_t la = lda;
                    int tr = at;
#if PACK_A
                    if (pack_a && rows == mr) ap = apack + (size_t)(i0 / mr) * mr * kc, la = mr, tr = 1;
#endif
                    if (rows < mr) { /* the missing rows as zeros, row-major */
                        for (int r = 0; r < mr; r++) {
                            float *row = apad + (size_t)r * keff;
                            if (r >= rows) memset(row, 0, sizeof(float) * (size_t)keff);
                            else if (!at) memcpy(row, ap + (size_t)r * lda, sizeof(float) * (size_t)keff);
                            else
                                for (int k = 0; k < keff; k++) row[k] = ap[(size_t)k * lda + r];
                        }
                        ap = apad, la = keff, tr = 0;
                    }
                    void (*const kernel)(int, const float *, ptrdiff_t, const float *, ptrdiff_t, float *, ptrdiff_t,
                                         int) = tr ? kr->kernel_at : kr->kernel;
                    float *cp = C + (size_t)i0 * ldc + jc + jr;
                    if (rows == mr && cols == nr) {
                        kernel(keff, ap, la, bp, ldb, cp, ldc, load);
                        continue;
                    }
                    for (int r = 0; r < mr; r++)
                        for (int j = 0; j < nr; j++)
                            ctile[r * nr + j] = load && r < rows && j < cols ? cp[(size_t)r * ldc + j] : 0.0f;
                    kernel(keff, ap, la, bp, ldb, ctile, nr, load);
                    for (int r = 0; r < rows; r++) memcpy(cp + (size_t)r * ldc, ctile + r * nr, sizeof(float) * (size_t)cols);
                }
            }
        }
    }
}

int tb_gemm_tiles(int M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                  int accumulate, int lower) {
    const tb_gemm_kernels *kr = kernels();
    const int mr = kr->mr, nr = kr->nr;
    if (M <= 0 || N <= 0 || K <= 0 || K > KC) return 0;
#if A64_ASM
    if (kr == &neon_kernels && M % 4 == 0 && N % 16 == 0) {
        /* 4 x 16 tiles; lower: each row's chain over the k that gemm()'s 8-row tile of it takes (up to
         * that tile's last row, M at most), so the same terms, exact zeros included */
        for (int i0 = 0; i0 < M; i0 += 4) {
            const int kend = (i0 & ~7) + 8 < M ? (i0 & ~7) + 8 : M, keff = lower && kend < K ? kend : K;
            const float *ap = A + (size_t)i0 * lda;
            float *cp = C + (size_t)i0 * ldc;
            for (int j0 = 0; j0 < N; j0 += 16) kernel_neon_4x16(keff, ap, lda, B + j0, ldb, cp + j0, ldc, accumulate);
        }
        return 1;
    }
#endif
    if (M % mr || N % nr) return 0;
#if PACK_A
    /* armv7 fused: where a row tile meets two or more panels the driver packs A's row tiles (fewer loads
     * than these calls); a second caller of that packing changed GCC's code for it (+0.1% on tb_gemm),
     * so those products stay with the driver */
    if (kr == &neon_kernels && N > nr) return 0;
#endif
    /* gemm()'s calls for one KC block and B in place: per row tile, keff = K, or up to the tile's last
     * row's diagonal when lower; load = accumulate */
    for (int i0 = 0; i0 < M; i0 += mr) {
        const int keff = lower && i0 + mr < K ? i0 + mr : K;
        const float *ap = A + (size_t)i0 * lda;
        float *cp = C + (size_t)i0 * ldc;
        for (int j0 = 0; j0 < N; j0 += nr) kr->kernel(keff, ap, lda, B + j0, ldb, cp + j0, ldc, accumulate);
    }
    return 1;
}

int tb_gemm_tiles_scaled(int M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                         const float *X, int ldx, const float *e) {
#if A64_ASM
    if (kernels() != &neon_kernels || M <= 0 || N <= 0 || K <= 0 || K > KC || M % 4 || N % 16) return 0;
    for (int i0 = 0; i0 < M; i0 += 4)
        for (int j0 = 0; j0 < N; j0 += 16)
            kernel_neon_4x16_scaled(K, A + (size_t)i0 * lda, lda, B + j0, ldb, C + (size_t)i0 * ldc + j0, ldc,
                                    X + (size_t)i0 * ldx + j0, ldx, e + i0);
    return 1;
#else
    (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)X, (void)ldx, (void)e;
    return 0;
#endif
}

void tb_gemm(int M, int N, int K, const float *A, int lda, const tb_gemm_b *B, float *C, int ldc, int accumulate,
             int lower) {
    gemm(M, N, K, A, lda, 0, B, C, ldc, accumulate, lower);
}

void tb_gemm_at(int M, int N, int K, const float *At, int ldat, const tb_gemm_b *B, float *C, int ldc, int accumulate,
                int lower) {
    gemm(M, N, K, At, ldat, 1, B, C, ldc, accumulate, lower);
}
