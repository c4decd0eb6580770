/* Gated DeltaNet: the serial recurrence and the chunkwise (WY / UT) form. Semantics: refimpl/gdn.py.
 *
 * Per token and value head, with S [d_k x d_v] and the state stored transposed (M = S^T, one row
 * per value index j, contiguous over key index i):
 *     S <- diag(exp(g)) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = scale S^T q
 */
#include <stdlib.h>
#include <string.h>

#include "tb_half.h"
#include "tb_kernels.h"
#include "tb_linalg.h"
#include "tb_parallel.h"

/* dst[i] = exp(src[i]): tb_simd.h's exp_n. With AVX-512, 16 lanes at a time by the same operations
 * in the same order (vf_exp's: clamp, round by the magic number, the two-step reduction, the
 * polynomial with vf_madd's fusing, the scale by 2^n, the flush below -87.3), so the bits of vf_exp
 * element by element; the tail by exp_n. KDA takes O(L d) exponentials per chunk (~8% of its time
 * at 8 lanes). */
static inline void gdn_exp_n(float *dst, const float *src, int n) {
    int i = 0;
#if defined(__x86_64__) && defined(__AVX512F__) && defined(TB_AVX2)
#if TB_MADD_FUSED
#define GDN_MADD16(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#else
#define GDN_MADD16(a, b, c) _mm512_add_ps(_mm512_mul_ps((a), (b)), (c))
#endif
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(src + i), lo = _mm512_set1_ps(-87.3f);
        const __m512 xc = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), lo);
        const __m512 magic = _mm512_set1_ps(12582912.0f);
        const __m512 nn = _mm512_sub_ps(GDN_MADD16(xc, _mm512_set1_ps(1.44269504088896341f), magic), magic);
        __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(nn, _mm512_set1_ps(0.693359375f)));
        r = _mm512_sub_ps(r, _mm512_mul_ps(nn, _mm512_set1_ps(-2.12194440e-4f)));
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = GDN_MADD16(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = GDN_MADD16(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = GDN_MADD16(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = GDN_MADD16(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = GDN_MADD16(p, r, _mm512_set1_ps(5.0000001201e-1f));
        p = GDN_MADD16(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
        const __m512 nc = _mm512_max_ps(nn, _mm512_set1_ps(-126.0f));
        const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(nc), _mm512_set1_epi32(127));
        const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
        _mm512_storeu_ps(dst + i, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y));
    }
#undef GDN_MADD16
#endif
    if (i < n) exp_n(dst + i, src + i, n - i);
}

/* The element-wise loops below in explicit vectors where the build has NEON: GCC does not vectorise
 * float loops for armv7's NEON (not IEEE without flush-to-zero; the kernels run with it set, so a
 * NEON lane rounds as the scalar VFP does), and on aarch64 it kept some of them scalar or strided.
 * Each element is the same operation(s) in the same order as the plain loop, so the bits are those
 * of the scalar code; elsewhere (x86, which vectorises them itself; Hexagon, scalar) the plain loops. */
#if defined(TB_NEON)
#define GDN_VEC 1
#else
#define GDN_VEC 0
#endif

#if GDN_VEC
/* dst[i] = x[i] * a */
static inline void gdn_mul_n(float *dst, const float *x, float a, int n) {
    int i = 0;
#if GDN_VEC && !defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__)
    /* armv7 (GCC): eight floats a load and a store, post-incremented; GCC's vf loop took 13-15
     * instructions for 8 floats here (two address computations per load and store) */
    if (n >= VF_LANES) {
        int blocks = n / VF_LANES;
        uint32_t bits;
        memcpy(&bits, &a, sizeof bits);
        const float *xp = x;
        float *dp = dst;
        __asm__ volatile("vdup.32 q10, %[a]\n\t"
                         "1:\n\t"
                         "vld1.32 {d16-d19}, [%[x]]!\n\t"
                         "vmul.f32 q8, q8, q10\n\t"
                         "vmul.f32 q9, q9, q10\n\t"
                         "subs %[b], %[b], #1\n\t"
                         "vst1.32 {d16-d19}, [%[d]]!\n\t"
                         "bne 1b\n\t"
                         : [x] "+r"(xp), [d] "+r"(dp), [b] "+r"(blocks)
                         : [a] "r"(bits)
                         : "d16", "d17", "d18", "d19", "d20", "d21", "memory", "cc");
        i = n / VF_LANES * VF_LANES;
    }
#elif GDN_VEC
    const vf va = vf_set1(a);
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vf_mul(vf_load(x + i), va));
#endif
    for (; i < n; i++) dst[i] = x[i] * a;
}
#endif

/* dst[i] = src[i]: on armv7 (GCC) in NEON registers (glibc's memcpy took ~115 instructions per row
 * of 64 floats there), elsewhere memcpy */
static inline void gdn_copy_n(float *dst, const float *src, int n) {
#if GDN_VEC && !defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__)
    int blocks = n / VF_LANES;
    if (blocks) {
        const float *sp = src;
        float *dp = dst;
        __asm__ volatile("1:\n\t"
                         "vld1.32 {d16-d19}, [%[s]]!\n\t"
                         "subs %[b], %[b], #1\n\t"
                         "vst1.32 {d16-d19}, [%[d]]!\n\t"
                         "bne 1b\n\t"
                         : [s] "+r"(sp), [d] "+r"(dp), [b] "+r"(blocks)
                         :
                         : "d16", "d17", "d18", "d19", "memory", "cc");
    }
    for (int i = n / VF_LANES * VF_LANES; i < n; i++) dst[i] = src[i];
#else /* aarch64's memcpy beat a vf loop here */
    memcpy(dst, src, sizeof(float) * (size_t)n);
#endif
}

/* dst[i] = x[i] - y[i] */
static inline void gdn_sub_n(float *dst, const float *x, const float *y, int n) {
    int i = 0;
#if GDN_VEC
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vf_sub(vf_load(x + i), vf_load(y + i)));
#endif
    for (; i < n; i++) dst[i] = x[i] - y[i];
}

#if GDN_VEC
/* dst[i] = x[i] + y[i] */
static inline void gdn_add_n(float *dst, const float *x, const float *y, int n) {
    int i = 0;
#if GDN_VEC
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vf_add(vf_load(x + i), vf_load(y + i)));
#endif
    for (; i < n; i++) dst[i] = x[i] + y[i];
}
#endif

/* dst[i] = x[i] * y[i] */
static inline void gdn_mulv_n(float *dst, const float *x, const float *y, int n) {
    int i = 0;
#if GDN_VEC
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vf_mul(vf_load(x + i), vf_load(y + i)));
#endif
    for (; i < n; i++) dst[i] = x[i] * y[i];
}

/* d1[i] = x1[i] * y[i], d2[i] = x2[i] * y[i] */
static inline void gdn_mulv2_n(float *d1, const float *x1, float *d2, const float *x2, const float *y, int n) {
    int i = 0;
#if GDN_VEC
    for (; i + VF_LANES <= n; i += VF_LANES) {
        const vf yi = vf_load(y + i);
        vf_store(d1 + i, vf_mul(vf_load(x1 + i), yi));
        vf_store(d2 + i, vf_mul(vf_load(x2 + i), yi));
    }
#endif
    for (; i < n; i++) d1[i] = x1[i] * y[i], d2[i] = x2[i] * y[i];
}

/* dst[i] = a * x[i] * y[i], i.e. (a * x[i]) * y[i] */
static inline void gdn_mul2_n(float *dst, float a, const float *x, const float *y, int n) {
    int i = 0;
#if GDN_VEC
    const vf va = vf_set1(a);
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vf_mul(vf_mul(va, vf_load(x + i)), vf_load(y + i)));
#endif
    for (; i < n; i++) dst[i] = a * x[i] * y[i];
}

#if GDN_VEC
/* d1[i] = a1 * x1[i] * y[i] and d2[i] = a2 * x2[i] * y[i] (gdn_mul2_n twice) in one pass, y loaded once;
 * d2 may be x1 itself (each index's x1 is read before its d2 is written) */
static inline void gdn_mul2x2_n(float *d1, float a1, const float *x1, float *d2, float a2, const float *x2,
                                const float *y, int n) {
    const vf va1 = vf_set1(a1), va2 = vf_set1(a2);
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) {
        const vf yi = vf_load(y + i), p1 = vf_mul(vf_mul(va1, vf_load(x1 + i)), yi);
        const vf p2 = vf_mul(vf_mul(va2, vf_load(x2 + i)), yi);
        vf_store(d1 + i, p1);
        vf_store(d2 + i, p2);
    }
    for (; i < n; i++) d1[i] = a1 * x1[i] * y[i], d2[i] = a2 * x2[i] * y[i];
}
#endif

/* dst[i] = exp(x[i] - y[i]): the difference rounded, then gdn_exp_n's exponential; on NEON in one pass
 * (the difference stays in registers: the same value as stored and reloaded) */
static inline void gdn_exp_diff_n(float *dst, const float *x, const float *y, int n) {
#if GDN_VEC
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vf_exp(vf_sub(vf_load(x + i), vf_load(y + i))));
    if (i < n) {
        float t[VF_LANES] = {0};
        for (int j = i; j < n; j++) t[j - i] = x[j] - y[j];
        vf_store(t, vf_exp(vf_load(t)));
        memcpy(dst + i, t, sizeof(float) * (size_t)(n - i));
    }
#else
    gdn_sub_n(dst, x, y, n);
    gdn_exp_n(dst, dst, n);
#endif
}

#if GDN_VEC
/* dst[i] = exp(x[i] - x[i]) without the exponential: x - x is +0 (finite x) or NaN (inf, NaN), and vf_exp
 * gives exactly 1 at +0 (n = 0, r = +0, p = 0 + (r + 1)) and 0 at NaN (its x >= -87.3 mask), so the
 * mask of the difference ANDed onto 1: the same bits, 3 operations a quad instead of ~34 */
static inline void gdn_exp_self_n(float *dst, const float *x, int n) {
    const vf one = vf_set1(1.0f), lo = vf_set1(-87.3f);
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) {
        const vf z = vf_sub(vf_load(x + i), vf_load(x + i));
        vf_store(dst + i, vf_zero_below(one, z, lo));
    }
    for (; i < n; i++) {
        const float z = x[i] - x[i];
        dst[i] = z >= -87.3f ? 1.0f : 0.0f;
    }
}

/* dst[i] = v for i < n */
static inline void gdn_fill_n(float *dst, float v, int n) {
    const vf vv = vf_set1(v);
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vv);
    for (; i < n; i++) dst[i] = v;
}
#endif

/* X[c][0..n) *= f[c] for c < rows (row c at X + c * ld): scale_n on each row; on NEON nothing at all for
 * n = 0 (KDA's first carried columns at L = 16) and one vector a row for n = VF_LANES, without a call of
 * scale_n's loop per row */
static void scale_rows(float *X, int ld, const float *f, int rows, int n) {
#if GDN_VEC
    if (n == 0) return;
    if (n == VF_LANES) {
        for (int c = 0; c < rows; c++) vf_store(X + (size_t)c * ld, vf_mul(vf_load(X + (size_t)c * ld), vf_set1(f[c])));
        return;
    }
#endif
    for (int c = 0; c < rows; c++) scale_n(X + (size_t)c * ld, f[c], n);
}

#if GDN_VEC
/* e = exp(x - y) as gdn_exp_diff_n computes it, then d1 = x1 * e and d2 = x2 * e (gdn_mulv2_n's products;
 * d2 may be NULL) in the same pass, e from registers (the value a store and reload would give); e itself
 * stored only where keep is not NULL */
static inline void gdn_exp_diff_mulv2_n(float *keep, const float *x, const float *y, float *d1, const float *x1,
                                        float *d2, const float *x2, int n) {
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) {
        const vf e = vf_exp(vf_sub(vf_load(x + i), vf_load(y + i)));
        if (keep) vf_store(keep + i, e);
        vf_store(d1 + i, vf_mul(vf_load(x1 + i), e));
        if (d2) vf_store(d2 + i, vf_mul(vf_load(x2 + i), e));
    }
    if (i < n) {
        float t[VF_LANES];
        gdn_exp_diff_n(t, x + i, y + i, n - i);
        for (int j = i; j < n; j++) {
            if (keep) keep[j] = t[j - i];
            d1[j] = x1[j] * t[j - i];
            if (d2) d2[j] = x2[j] * t[j - i];
        }
    }
}

/* dst = exp(x - y) * k (e first: the product's operands in gdn_mulv_n(dst, e, k)'s order), one pass */
static inline void gdn_exp_diff_times_n(float *dst, const float *x, const float *y, const float *k, int n) {
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES)
        vf_store(dst + i, vf_mul(vf_exp(vf_sub(vf_load(x + i), vf_load(y + i))), vf_load(k + i)));
    if (i < n) {
        float t[VF_LANES];
        gdn_exp_diff_n(t, x + i, y + i, n - i);
        for (int j = i; j < n; j++) dst[j] = t[j - i] * k[j];
    }
}
#endif

/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols: 4 x 4 blocks through registers on NEON */
static void gdn_transpose(float *dst, ptrdiff_t ldd, const float *src, ptrdiff_t lds, int rows, int cols) {
    int c0 = 0;
#if GDN_VEC
    for (; c0 + 4 <= cols; c0 += 4) {
        int r0 = 0;
        for (; r0 + 4 <= rows; r0 += 4) {
            const float *s = src + r0 * lds + c0; /* rows r0..r0+3 of src, columns c0..c0+3 */
#if defined(__aarch64__)
            /* TRN1/TRN2 on 32-bit lanes, then on 64-bit halves: 8 permutes for the block (GCC made
             * vcombine of the halves 14 moves and inserts) */
            const float32x4_t r0v = vld1q_f32(s), r1v = vld1q_f32(s + lds);
            const float32x4_t r2v = vld1q_f32(s + 2 * lds), r3v = vld1q_f32(s + 3 * lds);
            const float64x2_t e01 = vreinterpretq_f64_f32(vtrn1q_f32(r0v, r1v)), o01 = vreinterpretq_f64_f32(vtrn2q_f32(r0v, r1v));
            const float64x2_t e23 = vreinterpretq_f64_f32(vtrn1q_f32(r2v, r3v)), o23 = vreinterpretq_f64_f32(vtrn2q_f32(r2v, r3v));
            float *o = dst + c0 * ldd + r0;
            vst1q_f32(o, vreinterpretq_f32_f64(vtrn1q_f64(e01, e23)));
            vst1q_f32(o + ldd, vreinterpretq_f32_f64(vtrn1q_f64(o01, o23)));
            vst1q_f32(o + 2 * ldd, vreinterpretq_f32_f64(vtrn2q_f64(e01, e23)));
            vst1q_f32(o + 3 * ldd, vreinterpretq_f32_f64(vtrn2q_f64(o01, o23)));
#else
            const float32x4x2_t t01 = vtrnq_f32(vld1q_f32(s), vld1q_f32(s + lds));
            const float32x4x2_t t23 = vtrnq_f32(vld1q_f32(s + 2 * lds), vld1q_f32(s + 3 * lds));
            float *o = dst + c0 * ldd + r0;
            vst1q_f32(o, vcombine_f32(vget_low_f32(t01.val[0]), vget_low_f32(t23.val[0])));
            vst1q_f32(o + ldd, vcombine_f32(vget_low_f32(t01.val[1]), vget_low_f32(t23.val[1])));
            vst1q_f32(o + 2 * ldd, vcombine_f32(vget_high_f32(t01.val[0]), vget_high_f32(t23.val[0])));
            vst1q_f32(o + 3 * ldd, vcombine_f32(vget_high_f32(t01.val[1]), vget_high_f32(t23.val[1])));
#endif
        }
        for (int c = c0; c < c0 + 4; c++)
            for (int r = r0; r < rows; r++) dst[c * ldd + r] = src[r * lds + c];
    }
#endif
    for (int c = c0; c < cols; c++)
        for (int r = 0; r < rows; r++) dst[c * ldd + r] = src[r * lds + c];
}

typedef struct {
    const tb_gdn_shape *shape;
    const float *q, *k, *v, *g, *beta, *state_in;
    float *out, *state_out;
    int chunk, precision;
} gdn_call;

static int check_shape(const tb_gdn_shape *s) {
    if (!s || s->n_seqs <= 0 || s->tokens <= 0 || s->h_k <= 0 || s->h_v <= 0 || s->d <= 0) return TB_E_SHAPE;
    if (s->h_v % s->h_k) return TB_E_SHAPE;
    if (s->head_map != TB_HEAD_MAP_TILED && s->head_map != TB_HEAD_MAP_INTERLEAVED) return TB_E_SHAPE;
    return TB_OK;
}

static int key_head(const tb_gdn_shape *s, int h) {
    return s->head_map == TB_HEAD_MAP_TILED ? h % s->h_k : h / (s->h_v / s->h_k);
}

/* Row (seq, t, head) of a [n_seqs, T, H, d] tensor with the given strides. */
static const float *row_of(const float *x, const ptrdiff_t st[3], int seq, int t, int h) {
    return x + seq * st[0] + t * st[1] + h * st[2];
}

/* --- serial ------------------------------------------------------------------------------------ */

/* One token on rows j0..j0+3 of M: decay, S^T k, rank-1 update and S^T q, in two passes over each
 * row while it sits in L1. The four rows are four independent dependency chains. */
static void serial_rows4(float *m, int d, const float *decay_vec, float decay, const float *kt, const float *qt,
                         const float *vt, float beta, float scale, float *ot) {
    float *r0 = m, *r1 = m + d, *r2 = m + 2 * d, *r3 = m + 3 * d;
    vf c0 = vf_zero(), c1 = vf_zero(), c2 = vf_zero(), c3 = vf_zero();
    vf dec = vf_set1(decay);
    int i = 0;
    for (; i + VF_LANES <= d; i += VF_LANES) {
        vf e = decay_vec ? vf_load(decay_vec + i) : dec, x = vf_load(kt + i), y;
        y = vf_mul(vf_load(r0 + i), e); vf_store(r0 + i, y); c0 = vf_madd(y, x, c0);
        y = vf_mul(vf_load(r1 + i), e); vf_store(r1 + i, y); c1 = vf_madd(y, x, c1);
        y = vf_mul(vf_load(r2 + i), e); vf_store(r2 + i, y); c2 = vf_madd(y, x, c2);
        y = vf_mul(vf_load(r3 + i), e); vf_store(r3 + i, y); c3 = vf_madd(y, x, c3);
    }
    float sk[4] = {vf_hsum(c0), vf_hsum(c1), vf_hsum(c2), vf_hsum(c3)};
    float *rows[4] = {r0, r1, r2, r3};
    for (int r = 0; r < 4; r++) {
        for (int t = i; t < d; t++) {
            rows[r][t] *= decay_vec ? decay_vec[t] : decay;
            sk[r] = madd1(rows[r][t], kt[t], sk[r]);
        }
    }
    float delta[4];
    for (int r = 0; r < 4; r++) delta[r] = beta * (vt[r] - sk[r]);
    vf d0 = vf_set1(delta[0]), d1 = vf_set1(delta[1]), d2 = vf_set1(delta[2]), d3 = vf_set1(delta[3]);
    c0 = c1 = c2 = c3 = vf_zero();
    for (i = 0; i + VF_LANES <= d; i += VF_LANES) {
        vf x = vf_load(kt + i), z = vf_load(qt + i), y;
        y = vf_madd(d0, x, vf_load(r0 + i)); vf_store(r0 + i, y); c0 = vf_madd(y, z, c0);
        y = vf_madd(d1, x, vf_load(r1 + i)); vf_store(r1 + i, y); c1 = vf_madd(y, z, c1);
        y = vf_madd(d2, x, vf_load(r2 + i)); vf_store(r2 + i, y); c2 = vf_madd(y, z, c2);
        y = vf_madd(d3, x, vf_load(r3 + i)); vf_store(r3 + i, y); c3 = vf_madd(y, z, c3);
    }
    float sq[4] = {vf_hsum(c0), vf_hsum(c1), vf_hsum(c2), vf_hsum(c3)};
    for (int r = 0; r < 4; r++) {
        for (int t = i; t < d; t++) {
            rows[r][t] = madd1(delta[r], kt[t], rows[r][t]);
            sq[r] = madd1(rows[r][t], qt[t], sq[r]);
        }
        ot[r] = scale * sq[r];
    }
}

/* The same for one row (d % 4 leftover rows). */
static void serial_row1(float *row, int d, const float *decay_vec, float decay, const float *kt, const float *qt,
                        float vj, float beta, float scale, float *oj) {
    for (int i = 0; i < d; i++) row[i] *= decay_vec ? decay_vec[i] : decay;
    float delta = beta * (vj - dot(row, kt, d));
    axpy(delta, kt, row, d);
    *oj = scale * dot(row, qt, d);
}

static int serial_heads(void *arg, int begin, int end) {
    const gdn_call *c = arg;
    const tb_gdn_shape *s = c->shape;
    const int d = s->d, T = s->tokens, H = s->h_v;
    const float scale = 1.0f / sqrtf((float)d);
    float *decay_vec = s->kda ? malloc(sizeof(float) * (size_t)d) : NULL;
    if (s->kda && !decay_vec) return TB_E_MEMORY;
    for (int item = begin; item < end; item++) {
        const int seq = item / H, h = item % H, hk = key_head(s, h);
        float *m = c->state_out + (size_t)item * d * d;
        if (c->state_out != c->state_in) memcpy(m, c->state_in + (size_t)item * d * d, sizeof(float) * (size_t)d * d);
        for (int t = 0; t < T; t++) {
            const size_t tok = ((size_t)seq * T + t) * H + h;
            const float *qt = row_of(c->q, s->q_stride, seq, t, hk), *kt = row_of(c->k, s->k_stride, seq, t, hk);
            const float *vt = row_of(c->v, s->v_stride, seq, t, h);
            float decay = 0.0f;
            if (s->kda) gdn_exp_n(decay_vec, c->g + tok * d, d);
            else decay = exp1(c->g[tok]);
            float *ot = c->out + tok * d;
            int j = 0;
            for (; j + 4 <= d; j += 4)
                serial_rows4(m + (size_t)j * d, d, decay_vec, decay, kt, qt, vt + j, c->beta[tok], scale, ot + j);
            for (; j < d; j++)
                serial_row1(m + (size_t)j * d, d, decay_vec, decay, kt, qt, vt[j], c->beta[tok], scale, ot + j);
        }
    }
    free(decay_vec);
    return TB_OK;
}

int tb_gdn_serial(const tb_gdn_shape *shape, const float *q, const float *k, const float *v, const float *g,
                  const float *beta, const float *state_in, float *out, float *state_out, int threads) {
    int rc = check_shape(shape);
    if (rc) return rc;
    gdn_call c = {shape, q, k, v, g, beta, state_in, out, state_out, 0, TB_PRECISION_F32};
    TB_FP_ENTER();
    return TB_FP_LEAVE(tb_parallel_for(shape->n_seqs * shape->h_v, threads, serial_heads, &c));
}

/* --- chunkwise --------------------------------------------------------------------------------- */

/* Scratch for one head's chunk of up to L tokens. */
typedef struct {
    float *S;              /* [d_k][d_v] the item's working state (not transposed) */
    const float *Q, *K, *V; /* the chunk's rows, read in place from the inputs: row t at t * ld */
    ptrdiff_t ldq, ldk, ldv;
    float *G;              /* [L] or [L][d]: cumulative log-decay inside the chunk */
    float *Qin, *Kin;      /* [L][d] scale q and -beta k, decayed to the chunk start */
    float *Kout;           /* [L][d] k decayed to the chunk end (the transposed A of the state update) */
    float *A, *QK;         /* [L][L] -beta-weighted strictly lower k.k, and scale times lower q.k, with decays
                            * (QK = A + L * L for the chunk's L) */
    float *T;              /* [L][L] (I - A)^-1, unit lower triangular */
    float *R;              /* [L][d] right-hand sides beta (v - k_in S) */
    float *U;              /* [L][d] the deltas v_new = T R */
    float *X, *Kref;       /* KDA: [L][d] q rows rescaled to a reference token; [d][L] keys carried to one,
                            * then K_out^T */
    float *e;              /* [max(L, d)] one row of exponentials */
    float *beta;           /* [L] */
    int precision;         /* TB_PRECISION_* of the matrix products */
    float *Ha, *Hb;        /* reduced precision: the operands rounded to binary16, row-major */
    float *extra;          /* what the caller asked for beyond the scratch */
} chunk_scratch;

/* The scratch, then `extra` floats (the range's states) at w->extra. */
static chunk_scratch *scratch_new(int L, int d, int kda, int precision, size_t extra) {
    const size_t Ld = (size_t)L * d, LL = (size_t)L * L, dd = (size_t)d * d;
    const size_t e_len = (size_t)(L > d ? L : d);
    /* the largest operand of a product: [K; Q] (2L x d), L x L or d x d */
    const size_t big = 2 * Ld > LL ? (2 * Ld > dd ? 2 * Ld : dd) : (LL > dd ? LL : dd);
    const size_t reduced = precision == TB_PRECISION_F32 ? 0 : 2 * big;
    const size_t floats =
        (kda ? Ld : (size_t)L) + 3 * Ld + 3 * LL + 2 * Ld + (kda ? 2 * Ld : 0) + e_len + (size_t)L + reduced;
    /* the thread's kernel scratch (tb_gemm.h: kept between calls, so a call allocates nothing), the
     * arrays after a header of whole cache lines */
    const size_t head = (sizeof(chunk_scratch) + 63) & ~(size_t)63;
    chunk_scratch *w = (chunk_scratch *)tb_thread_scratch(TB_SCRATCH_KERNEL, (head + sizeof(float) * (floats + extra)) / sizeof(float));
    if (!w) return NULL;
    float *p = (float *)((char *)w + head);
    w->S = NULL; /* the item's own state slot, set per chunk */
    w->G = p, p += kda ? Ld : (size_t)L;
    w->Qin = p, p += Ld;
    w->Kin = p, p += Ld;
    w->Kout = p, p += Ld;
    w->A = p, p += LL;
    w->QK = p, p += LL;
    w->T = p, p += LL;
    w->R = p, p += Ld;
    w->U = p, p += Ld;
    w->X = kda ? p : NULL, p += kda ? Ld : 0;
    w->Kref = kda ? p : NULL, p += kda ? Ld : 0;
    w->e = p, p += e_len;
    w->beta = p, p += L;
    w->precision = precision;
    w->Ha = reduced ? p : NULL, p += reduced / 2;
    w->Hb = reduced ? p : NULL, p += reduced / 2;
    w->extra = p;
    return w;
}

/* rows x cols of op(x) (x itself, or x^T when `transposed`; leading dimension ld) rounded to
 * binary16, into out (row-major, leading dimension cols) */
static void round_f16(int rows, int cols, const float *x, int ld, int transposed, float *out) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            out[(size_t)r * cols + c] = tb_round_f16(transposed ? x[(size_t)c * ld + r] : x[(size_t)r * ld + c]);
}

/* One of the chunkwise form's matrix products, C (+)= op(A) op(B), in the scratch's precision (a_t,
 * b_t: the operand is given transposed). float32 is tb_gemm itself (gemm_nn / gemm_tn / gemm_nt);
 * fp16-acc32 the same on operands rounded to binary16 (a product of two binary16 numbers is exact in
 * float32); fp16-acc16 a binary16 accumulator rounded after each multiply-add, from zero, then added
 * onto C in float32 when accumulating. The reduced forms model an NPU's matrix unit, for accuracy
 * only: they are not fast. */
/* gemm_nn; on NEON, whole tiles by tb_gemm_tiles where the shape allows (the same chains, so the same
 * bits, without the driver: a chunk's products are short, K = L or d; 4 x 16 tiles on aarch64, tb_gemm's
 * 4 x 8 kernel on armv7) */
static void chunk_gemm_nn(int M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                          int accumulate, int lower) {
#if GDN_VEC
    if (tb_gemm_tiles(M, N, K, A, lda, B, ldb, C, ldc, accumulate, lower)) return;
#endif
    gemm_nn(M, N, K, A, lda, B, ldb, C, ldc, accumulate, lower);
}

static void product(chunk_scratch *w, int M, int N, int K, const float *A, int lda, int a_t, const float *B, int ldb,
                    int b_t, float *C, int ldc, int accumulate, int lower) {
    if (w->precision == TB_PRECISION_F32) {
        if (a_t) gemm_tn(M, N, K, A, lda, B, ldb, C, ldc, accumulate, lower);
        else if (b_t) gemm_nt(M, N, K, A, lda, B, ldb, C, ldc, accumulate, lower);
        else chunk_gemm_nn(M, N, K, A, lda, B, ldb, C, ldc, accumulate, lower);
        return;
    }
    round_f16(M, K, A, lda, a_t, w->Ha);
    round_f16(K, N, B, ldb, b_t, w->Hb);
    if (w->precision == TB_PRECISION_FP16_ACC32) {
        gemm_nn(M, N, K, w->Ha, K, w->Hb, N, C, ldc, accumulate, lower);
        return;
    }
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float acc = 0.0f; /* lower: the terms past the diagonal are exact zeros, skipped */
            for (int k = 0; k < (lower && i + 1 < K ? i + 1 : K); k++) acc = tb_round_f16(acc + w->Ha[(size_t)i * K + k] * w->Hb[(size_t)k * N + j]);
            C[(size_t)i * ldc + j] = accumulate ? C[(size_t)i * ldc + j] + acc : acc;
        }
}

/* KDA gram matrices: kk[i][j] (j < i) and qk[i][j] (j <= i) = sum_c x_i[c] k_j[c] exp(G_i[c] - G_j[c]).
 * The pairwise decay is split at a reference token m, the first of i's block of 8 (j < m <= i):
 * exp(G_i - G_m) exp(G_m - G_j). Both factors are <= 1, so nothing overflows, and the block's rows
 * against all earlier tokens are one matrix product. The second factors are carried from block to
 * block (times exp(G_m' - G_m)) and pairs inside a block from row to row (times exp(g_i)), so only
 * O(L d) exponentials are taken rather than one per pair and key index. */
#define KDA_BLOCK 8

/* e *= f; then *a = k_i . (k_j e) and *qk = q_i . (k_j e), each summed as dot() sums (8 lanes folded,
 * then the tail in order), in one pass over the d channels. */
static void pair_grams(const float *ki, const float *qi, const float *kj, float *e, const float *f, int d, float *a,
                       float *qk) {
    vf sa = vf_zero(), sq = vf_zero();
    int c = 0;
    for (; c + VF_LANES <= d; c += VF_LANES) {
        const vf ec = vf_mul(vf_load(e + c), vf_load(f + c));
        vf_store(e + c, ec);
        const vf ke = vf_mul(vf_load(kj + c), ec);
        sa = vf_madd(vf_load(ki + c), ke, sa);
        sq = vf_madd(vf_load(qi + c), ke, sq);
    }
    float ra = vf_hsum(sa), rq = vf_hsum(sq);
    for (; c < d; c++) {
        e[c] *= f[c];
        const float ke = kj[c] * e[c];
        ra = madd1(ki[c], ke, ra);
        rq = madd1(qi[c], ke, rq);
    }
    *a = ra, *qk = rq;
}

#if GDN_VEC && defined(__aarch64__)
/* pair_grams for two earlier tokens j0, j1 at once (32 vector registers hold both pairs' sums): f, k_i
 * and q_i loaded once for both; each pair's operations and their order exactly pair_grams' */
static void pair_grams2(const float *ki, const float *qi, const float *kj0, const float *kj1, float *e0, float *e1,
                        const float *f, int d, float *a0, float *qk0, float *a1, float *qk1) {
    vf sa0 = vf_zero(), sq0 = vf_zero(), sa1 = vf_zero(), sq1 = vf_zero();
    int c = 0;
    for (; c + VF_LANES <= d; c += VF_LANES) {
        const vf fc = vf_load(f + c), kic = vf_load(ki + c), qic = vf_load(qi + c);
        const vf ec0 = vf_mul(vf_load(e0 + c), fc), ec1 = vf_mul(vf_load(e1 + c), fc);
        vf_store(e0 + c, ec0);
        vf_store(e1 + c, ec1);
        const vf ke0 = vf_mul(vf_load(kj0 + c), ec0), ke1 = vf_mul(vf_load(kj1 + c), ec1);
        sa0 = vf_madd(kic, ke0, sa0);
        sq0 = vf_madd(qic, ke0, sq0);
        sa1 = vf_madd(kic, ke1, sa1);
        sq1 = vf_madd(qic, ke1, sq1);
    }
    float ra0 = vf_hsum(sa0), rq0 = vf_hsum(sq0), ra1 = vf_hsum(sa1), rq1 = vf_hsum(sq1);
    for (; c < d; c++) {
        e0[c] *= f[c];
        e1[c] *= f[c];
        const float ke0 = kj0[c] * e0[c], ke1 = kj1[c] * e1[c];
        ra0 = madd1(ki[c], ke0, ra0);
        rq0 = madd1(qi[c], ke0, rq0);
        ra1 = madd1(ki[c], ke1, ra1);
        rq1 = madd1(qi[c], ke1, rq1);
    }
    *a0 = ra0, *qk0 = rq0, *a1 = ra1, *qk1 = rq1;
}
#endif

/* a * b + c in 16 lanes, fused as the build's AVX-512 micro-kernel (gemm_avx512.c) fuses */
#if defined(__x86_64__) && defined(__AVX512F__)
static inline __m512 gdn_madd16(__m512 a, __m512 b, __m512 c) {
#if TB_FUSED
    return _mm512_fmadd_ps(a, b, c);
#else
    return _mm512_add_ps(_mm512_mul_ps(a, b), c);
#endif
}
#endif

/* C[r][j] = sum_c X[r][c] KrT[c][j] (r < rows <= KDA_BLOCK, j < n, n a multiple of VF_LANES: the
 * block's reference m is a multiple of KDA_BLOCK = VF_LANES), each element one chain over c in
 * ascending order from zero: tb_gemm's arithmetic, so the bits of gemm_nn. A block's products are
 * at most 8 x 24 x d at L = 32: tb_gemm's 8 x 32 tiles were mostly edge (a packed partial panel, C
 * through a padded tile), about half of its multiply-add rate there; here 8 x 8 tiles in registers,
 * B read in place. */
static void kda_gram_product(int rows, int n, int d, const float *X, const float *KrT, int ldk, float *C, int ldc) {
    int j = 0;
#if GDN_VEC
    /* NEON: tb_gemm's asm micro-kernel on each tile (the same chains; the loop below broadcast every A
     * value by a load of its own: ~1.9 instructions per FMLA on aarch64 against the kernel's ~1.27, ~6
     * per VMLA or VFMA on armv7, where GCC compiles vf_set1 of a loaded value poorly) */
    if (tb_gemm_tiles(rows, n, d, X, d, KrT, ldk, C, ldc, 0, 0)) return;
#endif
#if defined(__x86_64__) && defined(__AVX512F__)
    /* AVX-512: 8 x 16 tiles (the same chains, twice the columns per broadcast) */
    for (; rows == 8 && j + 16 <= n; j += 16) {
        __m512 t[8];
        for (int r = 0; r < 8; r++) t[r] = _mm512_setzero_ps();
        for (int k = 0; k < d; k++) {
            const __m512 b = _mm512_loadu_ps(KrT + (size_t)k * ldk + j);
            for (int r = 0; r < 8; r++) t[r] = gdn_madd16(_mm512_set1_ps(X[(size_t)r * d + k]), b, t[r]);
        }
        for (int r = 0; r < 8; r++) _mm512_storeu_ps(C + (size_t)r * ldc + j, t[r]);
    }
#endif
    for (; j < n; j += VF_LANES) {
        if (rows == 8) {
            vf c0 = vf_zero(), c1 = vf_zero(), c2 = vf_zero(), c3 = vf_zero();
            vf c4 = vf_zero(), c5 = vf_zero(), c6 = vf_zero(), c7 = vf_zero();
            for (int k = 0; k < d; k++) {
                const vf b = vf_load(KrT + (size_t)k * ldk + j);
                const float *x = X + k;
                c0 = vf_madd(vf_set1(x[0]), b, c0);
                c1 = vf_madd(vf_set1(x[d]), b, c1);
                c2 = vf_madd(vf_set1(x[2 * d]), b, c2);
                c3 = vf_madd(vf_set1(x[3 * d]), b, c3);
                c4 = vf_madd(vf_set1(x[4 * d]), b, c4);
                c5 = vf_madd(vf_set1(x[5 * d]), b, c5);
                c6 = vf_madd(vf_set1(x[6 * d]), b, c6);
                c7 = vf_madd(vf_set1(x[7 * d]), b, c7);
            }
            vf_store(C + j, c0), vf_store(C + ldc + j, c1), vf_store(C + 2 * ldc + j, c2);
            vf_store(C + 3 * ldc + j, c3), vf_store(C + 4 * ldc + j, c4), vf_store(C + 5 * ldc + j, c5);
            vf_store(C + 6 * ldc + j, c6), vf_store(C + 7 * ldc + j, c7);
            continue;
        }
        for (int r = 0; r < rows; r++) {
            vf c0 = vf_zero();
            for (int k = 0; k < d; k++) c0 = vf_madd(vf_set1(X[(size_t)r * d + k]), vf_load(KrT + (size_t)k * ldk + j), c0);
            vf_store(C + (size_t)r * ldc + j, c0);
        }
    }
}

static void kda_grams(chunk_scratch *w, int L, int d) {
    float *Xq = w->X, *Xk = w->Qin; /* Qin is free until after the grams */
    float *KrT = w->Kref;           /* [d][L]: k_j exp(G_m - G_j) for j < m, transposed */
    float *E = w->Kin;              /* [KDA_BLOCK][d]: exp(G_i - G_j) for j in i's block; Kin is free too */
    float *eg = w->e;               /* [d] exp(g_i) or a block-to-block factor */
    for (int m = 0; m < L; m += KDA_BLOCK) {
        const int m_end = m + KDA_BLOCK < L ? m + KDA_BLOCK : L, rows = m_end - m;
        const float *Gm = w->G + (size_t)m * d;
        for (int i = m; i < m_end; i++) {
#if GDN_VEC
            /* row L - 1's factor exp(G_last - G_m) kept in U (free until T R) for kda_decays, which needs it */
            float *ei = i == L - 1 ? w->U : eg;
            if (i > m) { /* the factor used from registers (stored only for row L - 1) */
                gdn_exp_diff_mulv2_n(i == L - 1 ? ei : NULL, w->G + (size_t)i * d, Gm, Xq + (size_t)i * d,
                                     w->Q + i * w->ldq, Xk + (size_t)i * d, w->K + i * w->ldk, d);
                continue;
            }
            gdn_exp_self_n(ei, Gm, d);
#else
            float *ei = eg;
            gdn_exp_diff_n(ei, w->G + (size_t)i * d, Gm, d);
#endif
            gdn_mulv2_n(Xq + (size_t)i * d, w->Q + i * w->ldq, Xk + (size_t)i * d, w->K + i * w->ldk, ei, d);
        }
        if (m > 0) {
            /* columns j < m - KDA_BLOCK: carried from the previous reference; the previous block's
             * columns: fresh */
            const int prev = m - KDA_BLOCK;
            const float *Gp = w->G + (size_t)prev * d;
            gdn_exp_diff_n(eg, Gm, Gp, d);
            scale_rows(KrT, L, eg, d, prev);
            float *fresh = w->R; /* [KDA_BLOCK][d], then written transposed: contiguous per channel */
            for (int j = prev; j < m; j++) {
                float *f = fresh + (size_t)(j - prev) * d;
#if GDN_VEC
                gdn_exp_diff_times_n(f, Gm, w->G + (size_t)j * d, w->K + j * w->ldk, d);
#else
                gdn_exp_diff_n(f, Gm, w->G + (size_t)j * d, d);
                gdn_mulv_n(f, f, w->K + j * w->ldk, d);
#endif
            }
#if GDN_VEC
            gdn_transpose(KrT + prev, L, fresh, d, KDA_BLOCK, d);
#else
            for (int c = 0; c < d; c++)
                for (int j = prev; j < m; j++) KrT[(size_t)c * L + j] = fresh[(size_t)(j - prev) * d + c];
#endif
            kda_gram_product(rows, m, d, Xk + (size_t)m * d, KrT, L, w->A + m * L, L);
            kda_gram_product(rows, m, d, Xq + (size_t)m * d, KrT, L, w->QK + m * L, L);
        }
        for (int i = m; i < m_end; i++) {
            if (i > m) { /* exp(g_i), as exp(G_i - G_{i-1}) */
                gdn_exp_diff_n(eg, w->G + (size_t)i * d, w->G + (size_t)(i - 1) * d, d);
            }
            const float *ki = w->K + i * w->ldk, *qi = w->Q + i * w->ldq;
            int j = m;
#if GDN_VEC && defined(__aarch64__)
            for (; j + 1 < i; j += 2)
                pair_grams2(ki, qi, w->K + j * w->ldk, w->K + (j + 1) * w->ldk, E + (size_t)(j - m) * d,
                            E + (size_t)(j + 1 - m) * d, eg, d, &w->A[i * L + j], &w->QK[i * L + j],
                            &w->A[i * L + j + 1], &w->QK[i * L + j + 1]);
#endif
            for (; j < i; j++) /* E_j *= exp(g_i), then both products with k_j E_j, one pass */
                pair_grams(ki, qi, w->K + j * w->ldk, E + (size_t)(j - m) * d, eg, d, &w->A[i * L + j],
                           &w->QK[i * L + j]);
#if GDN_VEC
            gdn_fill_n(E + (size_t)(i - m) * d, 1.0f, d);
#else
            for (int c = 0; c < d; c++) E[(size_t)(i - m) * d + c] = 1.0f;
#endif
            w->A[i * L + i] = 0.0f;
            w->QK[i * L + i] = dot(qi, ki, d); /* E_i = 1: k_i itself */
        }
    }
}

/* KDA's decays to the chunk start and end from the grams' own exponentials (no second pass of one
 * exponential per token and channel): q and k decayed to the start are the grams' rows rescaled to
 * their block's reference token m, times exp(G_m) (one exponential per block and channel):
 *   Q_in = scale Xq exp(G_m), K_in = -beta Xk exp(G_m)
 * and k decayed to the end, transposed, is the grams' carried k exp(G_m' - G_j) (m' the last block's
 * reference) times exp(G_last - G_m'), the last block's own columns fresh. Every factor is <= 1. */
static void kda_decays(chunk_scratch *w, int L, int d, float scale) {
    float *Xq = w->X, *Xk = w->Qin, *KoutT = w->Kref, *em = w->e;
    const float *Glast = w->G + (size_t)(L - 1) * d;
    for (int m = 0; m < L; m += KDA_BLOCK) {
        const int m_end = m + KDA_BLOCK < L ? m + KDA_BLOCK : L;
        gdn_exp_n(em, w->G + (size_t)m * d, d);
        for (int t = m; t < m_end; t++) {
            const float *xq = Xq + (size_t)t * d, *xk = Xk + (size_t)t * d;
            float *qin = w->Qin + (size_t)t * d, *kin = w->Kin + (size_t)t * d; /* qin overwrites xk: read first */
            const float kb = -w->beta[t];
#if GDN_VEC
            gdn_mul2x2_n(kin, kb, xk, qin, scale, xq, em, d);
#else
            gdn_mul2_n(kin, kb, xk, em, d);
            gdn_mul2_n(qin, scale, xq, em, d);
#endif
        }
    }
    const int last = (L - 1) / KDA_BLOCK * KDA_BLOCK; /* the last block's reference */
#if GDN_VEC
    scale_rows(KoutT, L, w->U, d, last); /* exp(G_last - G_last'): kda_grams' row L - 1 factor */
    float *fresh = w->R; /* [L - last][d], then transposed into KoutT's columns; R is written after this */
    for (int j = last; j < L; j++) {
        float *f = fresh + (size_t)(j - last) * d;
        if (j < L - 1) { /* k times the factor, from registers */
            gdn_exp_diff_mulv2_n(NULL, Glast, w->G + (size_t)j * d, f, w->K + j * w->ldk, NULL, NULL, d);
            continue;
        }
        gdn_exp_self_n(f, Glast, d);
        gdn_mulv_n(f, w->K + j * w->ldk, f, d);
    }
    gdn_transpose(KoutT + last, L, fresh, d, L - last, d);
#else
    const float *Gl = w->G + (size_t)last * d;
    gdn_exp_diff_n(em, Glast, Gl, d);
    for (int c = 0; c < d; c++) scale_n(KoutT + (size_t)c * L, em[c], last);
    for (int j = last; j < L; j++) {
        gdn_exp_diff_n(em, Glast, w->G + (size_t)j * d, d);
        for (int c = 0; c < d; c++) KoutT[(size_t)c * L + j] = w->K[j * w->ldk + c] * em[c];
    }
#endif
}

/* Scalar-gate gram matrices: the chunk's k and q rows copied into one block [K; Q] (2L x d, the first
 * touch of those rows), then [K; Q] K^T as ONE matrix product with the keys as the transposed B (packed
 * once), giving A = K K^T and QK = Q K^T (w->A and w->QK are adjacent); the full squares: at
 * matrix-product speed that beats half of them as dot products. Then each row decayed by
 * exp(G_i - G_j) and cut to the strict lower (A) or lower (QK) triangle. */
static void scalar_grams(chunk_scratch *w, int L, int d) {
    float *decay = w->e, *KQ = w->Kin; /* [2L][d]: Kin and Kout are free until the decays below */
    for (int t = 0; t < L; t++) {
        gdn_copy_n(KQ + (size_t)t * d, w->K + t * w->ldk, d);
        gdn_copy_n(KQ + (size_t)(L + t) * d, w->Q + t * w->ldq, d);
    }
    product(w, 2 * L, L, d, KQ, d, 0, KQ, d, 1, w->A, L, 0, 0);
    for (int i = 0; i < L; i++) {
        float *a = w->A + i * L, *qk = w->QK + i * L;
        for (int j = 0; j <= i; j++) decay[j] = w->G[i] - w->G[j];
        gdn_exp_n(decay, decay, i + 1);
        for (int j = 0; j < i; j++) a[j] *= decay[j], qk[j] *= decay[j];
        qk[i] *= decay[i];
        for (int j = i; j < L; j++) a[j] = 0.0f;
        for (int j = i + 1; j < L; j++) qk[j] = 0.0f;
    }
}

/* T = (I - A)^-1 for a strictly lower A: row i of T is e_i + sum over j < i of A[i][j] T[j] (rows of T
 * are zero right of their diagonal), each element's terms added in ascending j (the same order on
 * every target): rows in blocks of 8, the terms of the rows solved before the block as one product
 * (a chain over j in order), then the block's own rows in order. L^3 / 6 multiply-adds: the UT
 * transform's triangular solves done once on the L x L matrix, so that the chunk's deltas are ONE
 * lower-triangular matrix product (T R) instead of L small solves against d-wide rows. */
#define INVERT_BLOCK 8
static void invert_unit_lower(const float *A, float *T, int L) {
    for (int i0 = 0; i0 < L; i0 += INVERT_BLOCK) {
        const int rows = L - i0 < INVERT_BLOCK ? L - i0 : INVERT_BLOCK;
        const int width = i0 + rows; /* the block's rows are zero from here on */
        if (i0) chunk_gemm_nn(rows, width, i0, A + (size_t)i0 * L, L, T, L, T + (size_t)i0 * L, L, 0, 0);
        else
            for (int i = 0; i < rows; i++) memset(T + (size_t)i * L, 0, sizeof(float) * (size_t)width);
        for (int i = i0; i < i0 + rows; i++) {
            float *t = T + (size_t)i * L;
            for (int j = i0; j < i; j++) axpy(A[(size_t)i * L + j], T + (size_t)j * L, t, width);
            t[i] = 1.0f;
            for (int k = width; k < L; k++) t[k] = 0.0f;
        }
    }
}

/* S = diag(e) S + op(A) U, the state's decay and update in one pass over S (d x d, row-major, U: L x
 * d, row-major): A[i][k] at a[i * ars + k * aks] (K_out given transposed: ars = 1, aks = d; KDA's
 * K_out^T: ars = L, aks = 1). The bits of scale_n then tb_gemm accumulating: each element of S
 * rounded times e[i], then one chain over k in ascending order (fused as the build's AVX-512
 * micro-kernel fuses). With AVX-512 and d a multiple of 32: 8 x 32 tiles of S in registers, loaded
 * once (the separate decay read and wrote all of S, 64 KiB per head at d = 128, once more), U read
 * in place (tb_gemm packs it: M = d rows is past its in-place rule). Elsewhere the two steps. */

static void state_update(chunk_scratch *w, int d, int L, const float *e, const float *a, ptrdiff_t ars, ptrdiff_t aks) {
    float *S = w->S;
    const float *U = w->U;
#if defined(__x86_64__) && defined(__AVX512F__)
    if (d % 32 == 0 && w->precision == TB_PRECISION_F32) {
        for (int i0 = 0; i0 < d; i0 += 8)
            for (int j0 = 0; j0 < d; j0 += 32) {
                __m512 t[8][2];
                for (int r = 0; r < 8; r++) {
                    const __m512 er = _mm512_set1_ps(e[i0 + r]);
                    float *sr = S + (size_t)(i0 + r) * d + j0;
                    t[r][0] = _mm512_mul_ps(_mm512_loadu_ps(sr), er);
                    t[r][1] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16), er);
                }
                const float *ai = a + (size_t)i0 * ars;
                for (int k = 0; k < L; k++) {
                    const __m512 b0 = _mm512_loadu_ps(U + (size_t)k * d + j0), b1 = _mm512_loadu_ps(U + (size_t)k * d + j0 + 16);
                    for (int r = 0; r < 8; r++) {
                        const __m512 x = _mm512_set1_ps(ai[r * ars + k * aks]);
                        t[r][0] = gdn_madd16(x, b0, t[r][0]);
                        t[r][1] = gdn_madd16(x, b1, t[r][1]);
                    }
                }
                for (int r = 0; r < 8; r++) {
                    float *sr = S + (size_t)(i0 + r) * d + j0;
                    _mm512_storeu_ps(sr, t[r][0]);
                    _mm512_storeu_ps(sr + 16, t[r][1]);
                }
            }
        return;
    }
#endif
#if GDN_VEC && defined(__aarch64__)
    /* aarch64: each tile of S scaled as the micro-kernel loads it (x * e[i], as below), no pass of its
     * own */
    if (ars != 1 && tb_gemm_tiles_scaled(d, d, L, a, (int)ars, U, d, S, d, S, d, e)) return;
#endif
#if GDN_VEC
    for (int i = 0; i < d; i++) gdn_mul_n(S + (size_t)i * d, S + (size_t)i * d, e[i], d); /* scale_n's x * a */
#else
    for (int i = 0; i < d; i++) scale_n(S + (size_t)i * d, e[i], d);
#endif
    if (ars == 1) product(w, d, d, L, a, (int)aks, 1, U, d, 0, S, d, 1, 0);
    else chunk_gemm_nn(d, d, L, a, (int)ars, U, d, S, d, 1, 0);
}

/* R += K_in S and out = Q_in S (both L x d, K = d), the two products that read the state before its
 * update, as one pass over S: for each 32-column panel of S, the panel (in L1 after its first tile)
 * serves the K_in tiles and then the Q_in tiles, so S comes from L2 once per step instead of twice.
 * Each element is tb_gemm's chain (R's from its value, out's from zero, over k in order, fused as
 * the AVX-512 micro-kernel fuses), so the bits are unchanged. Returns 0 (nothing done) where it does
 * not apply: without AVX-512, d not a multiple of 32, L not a multiple of 8, reduced precision. */
static int state_reads(chunk_scratch *w, int L, int d, float *out, int ldo) {
#if defined(__x86_64__) && defined(__AVX512F__)
    if (d % 32 || L % 8 || w->precision != TB_PRECISION_F32) return 0;
    const float *S = w->S;
    for (int j0 = 0; j0 < d; j0 += 32)
        for (int src = 0; src < 2; src++)
            for (int i0 = 0; i0 < L; i0 += 8) {
                const float *a = (src ? w->Qin : w->Kin) + (size_t)i0 * d;
                float *c = src ? out + (size_t)i0 * ldo + j0 : w->R + (size_t)i0 * d + j0;
                const ptrdiff_t ldc = src ? ldo : d;
                __m512 t[8][2];
                for (int r = 0; r < 8; r++) {
                    t[r][0] = src ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);
                    t[r][1] = src ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16);
                }
                for (int k = 0; k < d; k++) {
                    const __m512 b0 = _mm512_loadu_ps(S + (size_t)k * d + j0), b1 = _mm512_loadu_ps(S + (size_t)k * d + j0 + 16);
                    for (int r = 0; r < 8; r++) {
                        const __m512 x = _mm512_set1_ps(a[(size_t)r * d + k]);
                        t[r][0] = gdn_madd16(x, b0, t[r][0]);
                        t[r][1] = gdn_madd16(x, b1, t[r][1]);
                    }
                }
                for (int r = 0; r < 8; r++) {
                    _mm512_storeu_ps(c + r * ldc, t[r][0]);
                    _mm512_storeu_ps(c + r * ldc + 16, t[r][1]);
                }
            }
    return 1;
#else
    (void)w, (void)L, (void)d, (void)out, (void)ldo;
    return 0;
#endif
}

/* aarch64: R's beta v folded into R's product (tb_gemm_tiles_scaled) instead of a pass of its own */
#if GDN_VEC && defined(__aarch64__)
#define GDN_FOLD_R 1
#else
#define GDN_FOLD_R 0
#endif

/* One chunk of L tokens from t0 for (seq, head); w->S holds the state on entry and on exit.
 *   grams    A = -beta (K K^T) o decay (strict lower), QK = scale (Q K^T) o decay (lower)
 *   T        (I - A)^-1 (unit lower), by rows
 *   R        beta V - beta K_in S          (K_in: k decayed to the chunk start; one product into beta V)
 *   U        T R                          (v_new, the chunk's deltas; one lower-triangular product)
 *   out      Q_in S + QK U                (Q_in: scale q decayed to the start; written in place)
 *   S        exp(G_last) S + K_out^T U    (K_out: k decayed to the chunk end, its rows as A^T) */
static void chunk_step(chunk_scratch *w, const gdn_call *c, int seq, int h, int t0, int L) {
    const tb_gdn_shape *s = c->shape;
    const int d = s->d, H = s->h_v, T = s->tokens, hk = key_head(s, h), kda = s->kda;
    const float scale = 1.0f / sqrtf((float)d);

    w->Q = row_of(c->q, s->q_stride, seq, t0, hk), w->ldq = s->q_stride[1];
    w->K = row_of(c->k, s->k_stride, seq, t0, hk), w->ldk = s->k_stride[1];
    w->V = row_of(c->v, s->v_stride, seq, t0, h), w->ldv = s->v_stride[1];
    float *out = c->out + (((size_t)seq * T + t0) * H + h) * d;
    const int ldo = H * d;
    w->QK = w->A + (size_t)L * L; /* right after A at this chunk's L: the grams are one product */
    for (int t = 0; t < L; t++) {
        const size_t tok = ((size_t)seq * T + t0 + t) * H + h;
        w->beta[t] = c->beta[tok];
        if (kda) {
            float *Gt = w->G + (size_t)t * d;
            const float *gt = c->g + tok * d;
#if GDN_VEC
            if (t) gdn_add_n(Gt, Gt - d, gt, d);
            else memcpy(Gt, gt, sizeof(float) * (size_t)d);
#else
            for (int i = 0; i < d; i++) Gt[i] = t ? Gt[i - d] + gt[i] : gt[i];
#endif
        } else {
            w->G[t] = t ? w->G[t - 1] + c->g[tok] : c->g[tok];
        }
    }

    /* A (-beta applied below) and QK, zero above the diagonal */
    if (kda) {
        memset(w->A, 0, sizeof(float) * (size_t)L * L);
        memset(w->QK, 0, sizeof(float) * (size_t)L * L);
        kda_grams(w, L, d);
    } else {
        scalar_grams(w, L, d);
    }
#if GDN_VEC
    /* whole rows in vectors where L allows: A's entries from the diagonal on are never read again (the
     * inversion reads j < i), and QK's zeros times scale > 0 stay +0; the rest is each value times its
     * factor as before */
    if (L % VF_LANES == 0) {
        for (int i = 0; i < L; i++) {
            gdn_mul_n(w->A + i * L, w->A + i * L, -w->beta[i], L);
            gdn_mul_n(w->QK + i * L, w->QK + i * L, scale, L);
        }
    } else
#endif
    for (int i = 0; i < L; i++) {
        scale_n(w->A + i * L, -w->beta[i], i); /* A holds -beta k.k */
        scale_n(w->QK + i * L, scale, i + 1);
    }
    invert_unit_lower(w->A, w->T, L);

    /* q (times scale) and k (times -beta) decayed to the chunk start; k decayed to the chunk end; R = beta v.
     * Off x86, the scalar gate's factors exp(G_t) and exp(G_last - G_t) for the whole chunk by exp_n (lane
     * by lane the arithmetic of one exp1 per value, which computes a whole vector for one value; A is
     * free after the inversion). x86 keeps its code as it was: the change moved its timings +-1.5%. */
#if !defined(__x86_64__)
#define GDN_BATCH_EXP 1
    float *to_start = w->e, *to_end = w->A;
#else
#define GDN_BATCH_EXP 0
#endif
    if (kda) kda_decays(w, L, d, scale);
#if GDN_BATCH_EXP
    else {
        for (int t = 0; t < L; t++) to_end[t] = w->G[L - 1] - w->G[t];
        exp_n(to_start, w->G, L);
        exp_n(to_end, to_end, L);
    }
#endif
    for (int t = 0; t < L; t++) {
        const float *qt = w->Q + t * w->ldq, *kt = w->K + t * w->ldk, *vt = w->V + t * w->ldv;
        float *qin = w->Qin + (size_t)t * d, *kin = w->Kin + (size_t)t * d, *kout = w->Kout + (size_t)t * d;
        float *r = w->R + (size_t)t * d;
        const float b = w->beta[t];
        if (!kda) {
#if GDN_BATCH_EXP
            const float ts = to_start[t], te = to_end[t];
#else
            const float ts = exp1(w->G[t]), te = exp1(w->G[L - 1] - w->G[t]);
#endif
            const float qs = scale * ts, ks = -b * ts;
#if GDN_VEC
            gdn_mul_n(qin, qt, qs, d);
            gdn_mul_n(kin, kt, ks, d);
            gdn_mul_n(kout, kt, te, d);
#else
            for (int i = 0; i < d; i++) qin[i] = qt[i] * qs, kin[i] = kt[i] * ks, kout[i] = kt[i] * te;
#endif
        }
#if GDN_FOLD_R
        (void)vt, (void)r, (void)b; /* R below */
#elif GDN_VEC
        gdn_mul_n(r, vt, b, d); /* b * v: the product commutes, bit for bit */
#else
        for (int i = 0; i < d; i++) r[i] = b * vt[i];
#endif
    }

    /* R = beta v - beta k_in S and out = Q_in S (one pass over S where state_reads applies); U = T R;
     * out += QK U, in the output rows */
    const int both = state_reads(w, L, d, out, ldo);
#if GDN_FOLD_R
    /* aarch64: beta v as the micro-kernel loads R's tiles (v * beta, the pass's product), then - k_in S */
    if (w->precision != TB_PRECISION_F32 ||
        !tb_gemm_tiles_scaled(L, d, d, w->Kin, d, w->S, d, w->R, d, w->V, (int)w->ldv, w->beta)) {
        for (int t = 0; t < L; t++) gdn_mul_n(w->R + (size_t)t * d, w->V + t * w->ldv, w->beta[t], d);
        product(w, L, d, d, w->Kin, d, 0, w->S, d, 0, w->R, d, 1, 0);
    }
#else
    if (!both) product(w, L, d, d, w->Kin, d, 0, w->S, d, 0, w->R, d, 1, 0);
#endif
    chunk_gemm_nn(L, d, L, w->T, L, w->R, d, w->U, d, 0, 1); /* the forward substitution's part: float32 always */
    if (!both) product(w, L, d, d, w->Qin, d, 0, w->S, d, 0, out, ldo, 0, 0);
    product(w, L, d, L, w->QK, L, 0, w->U, d, 0, out, ldo, 1, 1);

    /* S = diag(exp(G_last)) S + K_out^T U (KDA: K_out^T from the grams' factors) */
    if (kda) {
        gdn_exp_n(w->e, w->G + (size_t)(L - 1) * d, d);
        state_update(w, d, L, w->e, w->Kref, L, 1);
    } else {
#if GDN_BATCH_EXP
        const float last = w->e[L - 1]; /* exp(G_last), to_start above */
#else
        const float last = exp1(w->G[L - 1]);
#endif
        for (int i = 0; i < d; i++) w->e[i] = last;
        state_update(w, d, L, w->e, w->Kout, 1, d);
    }
}

/* A range of (seq, head) items, chunk by chunk: every item's first chunk, then every item's second,
 * and so on, each item's state kept in its own d x d slot (in L2: 64 KiB per head at d = 128). The
 * heads of one token are adjacent in memory ([T, H, d] rows), so a chunk's rows of consecutive heads
 * are read (and its output rows written) side by side, which the hardware prefetchers follow; head
 * by head, the rows of one head are a whole token row apart and every line would be fetched from
 * memory for 1/H of its use. */
static int chunkwise_heads(void *arg, int begin, int end) {
    const gdn_call *c = arg;
    const tb_gdn_shape *s = c->shape;
    const int d = s->d, T = s->tokens, H = s->h_v, n = end - begin;
    const int L = c->chunk < T ? c->chunk : T;
    chunk_scratch *w = scratch_new(L, d, s->kda, c->precision, (size_t)n * d * d);
    if (!w) return TB_E_MEMORY;
    float *states = w->extra;
    for (int item = begin; item < end; item++) {
        const float *m_in = c->state_in + (size_t)item * d * d;
        gdn_transpose(states + (size_t)(item - begin) * d * d, d, m_in, d, d, d);
    }
    for (int t0 = 0; t0 < T; t0 += L)
        for (int item = begin; item < end; item++) {
            w->S = states + (size_t)(item - begin) * d * d;
            chunk_step(w, c, item / H, item % H, t0, T - t0 < L ? T - t0 : L);
        }
    for (int item = begin; item < end; item++) {
        const float *S = states + (size_t)(item - begin) * d * d;
        gdn_transpose(c->state_out + (size_t)item * d * d, d, S, d, d, d);
    }
    return TB_OK;
}

/* Chunk sizes measured on an AVX-512 host (T 512, 16 heads; FUSED=1; docs in kernels/README.md): the
 * fastest of 8..128 was 8 or 16 (within 4%) at head size 64, 32 at 128 and 256 (with the state read
 * in place by the products of at most 32 rows, tb_gemm's rule). */
int tb_gdn_auto_chunk(int d) { return d <= 64 ? 16 : 32; }

int tb_gdn_chunkwise_precision(const tb_gdn_shape *shape, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, const float *state_in, float *out,
                               float *state_out, int chunk, int precision, int threads) {
    int rc = check_shape(shape);
    if (rc) return rc;
    if (chunk == TB_GDN_CHUNK_AUTO) chunk = tb_gdn_auto_chunk(shape->d);
    if (chunk <= 0 || precision < TB_PRECISION_F32 || precision > TB_PRECISION_FP16_ACC16 ||
        (precision != TB_PRECISION_F32 && shape->kda))
        return TB_E_SHAPE;
    gdn_call c = {shape, q, k, v, g, beta, state_in, out, state_out, chunk, precision};
    TB_FP_ENTER();
    return TB_FP_LEAVE(tb_parallel_for(shape->n_seqs * shape->h_v, threads, chunkwise_heads, &c));
}

int tb_gdn_chunkwise(const tb_gdn_shape *shape, const float *q, const float *k, const float *v, const float *g,
                     const float *beta, const float *state_in, float *out, float *state_out, int chunk, int threads) {
    return tb_gdn_chunkwise_precision(shape, q, k, v, g, beta, state_in, out, state_out, chunk, TB_PRECISION_F32,
                                      threads);
}
