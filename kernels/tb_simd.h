/* An 8-lane float vector `vf` over AVX2 (x86-64 built with -mavx2), SSE2 (two quads: the baseline
 * x86-64 host library), NEON (two quads, arm32 and aarch64) or plain C, chosen at build time.
 * Internal to the kernels. (The matrix products have their own micro-kernels: tb_gemm.h.)
 *
 * Why 8 lanes everywhere: a reduction then sums the same elements in the same order on every
 * target (lane l holds elements l, l+8, l+16, ...; lanes are folded in one fixed tree). With
 * multiply-add unfused (TB_FUSED=0, and -ffp-contract=off so the compiler fuses nothing either),
 * the scalar, SSE2, AVX2 and NEON builds then produce the same bits: an ARM build run under qemu can
 * be compared byte for byte with a host build. TB_FUSED=1 (the default where the build has FMA) is
 * faster and rounds once per multiply-add, so results differ by ulps. A translation unit fuses
 * (TB_MADD_FUSED) when the build asks for it AND the instruction set it is compiled for has a fused
 * multiply-add (SSE2 has none: there the element-wise code stays unfused).
 */
#ifndef TB_SIMD_H
#define TB_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#define TB_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON) || defined(__ARM_NEON__)
#define TB_NEON 1
#include <arm_neon.h>
#elif defined(__SSE2__)
#define TB_SSE2 1
#include <emmintrin.h>
#endif

#ifndef TB_FUSED
#if (defined(TB_AVX2) && defined(__FMA__)) || (defined(TB_NEON) && defined(__aarch64__))
#define TB_FUSED 1
#else
#define TB_FUSED 0
#endif
#endif

#if TB_FUSED && !defined(TB_SSE2) && \
    (defined(__FMA__) || defined(__ARM_FEATURE_FMA) || !(defined(TB_AVX2) || defined(TB_NEON)))
#define TB_MADD_FUSED 1
#else
#define TB_MADD_FUSED 0
#endif

#define VF_LANES 8

/* a * b + c for one float, rounded like the vector path. */
static inline float madd1(float a, float b, float c) {
#if TB_MADD_FUSED
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

#if defined(TB_AVX2)
typedef __m256 vf;
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_madd(vf a, vf b, vf c) {
#if TB_MADD_FUSED
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}
/* x where x >= lo, else 0 */
static inline vf vf_zero_below(vf x, vf test, vf lo) {
    return _mm256_and_ps(x, _mm256_cmp_ps(test, lo, _CMP_GE_OQ));
}
/* 2^n for integral n in [-126, 127] held as floats */
static inline vf vf_pow2i(vf n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
/* 8 binary16 values as float32 by rebiasing, exact for normal numbers; *special: some are zero,
 * subnormal, infinite or NaN (the caller converts those itself). */
#if defined(__F16C__)
/* 8 binary16 values as float32, exactly, every kind of value included (F16C: every AVX2 CPU has it,
 * it is part of x86-64-v3), so *special is 0. */
static inline vf vf_from_f16(const uint16_t *p, int *special) {
    *special = 0;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#else
static inline vf vf_from_f16(const uint16_t *p, int *special) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m256i e = _mm256_and_si256(x, _mm256_set1_epi32(0x7c00));
    const __m256i bad = _mm256_or_si256(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()),
                                        _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7c00)));
    *special = !_mm256_testz_si256(bad, bad);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 16);
    const __m256i mag = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fff)), 13),
                                         _mm256_set1_epi32(112 << 23));
    return _mm256_castsi256_ps(_mm256_or_si256(sign, mag));
}
#endif
/* 8 int8 values as float32 (exact) */
static inline vf vf_from_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define TB_VECTOR_NAME (TB_MADD_FUSED ? "avx2-fma" : "avx2")

#elif defined(TB_NEON)
typedef struct { float32x4_t lo, hi; } vf;
static inline vf vf_load(const float *p) { vf r = {vld1q_f32(p), vld1q_f32(p + 4)}; return r; }
static inline void vf_store(float *p, vf a) { vst1q_f32(p, a.lo); vst1q_f32(p + 4, a.hi); }
static inline vf vf_set1(float x) { vf r = {vdupq_n_f32(x), vdupq_n_f32(x)}; return r; }
static inline vf vf_add(vf a, vf b) { vf r = {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; return r; }
static inline vf vf_sub(vf a, vf b) { vf r = {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; return r; }
static inline vf vf_mul(vf a, vf b) { vf r = {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; return r; }
static inline vf vf_min(vf a, vf b) { vf r = {vminq_f32(a.lo, b.lo), vminq_f32(a.hi, b.hi)}; return r; }
static inline vf vf_max(vf a, vf b) { vf r = {vmaxq_f32(a.lo, b.lo), vmaxq_f32(a.hi, b.hi)}; return r; }
static inline vf vf_madd(vf a, vf b, vf c) {
#if TB_MADD_FUSED
    vf r = {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)};
#else
    vf r = {vaddq_f32(vmulq_f32(a.lo, b.lo), c.lo), vaddq_f32(vmulq_f32(a.hi, b.hi), c.hi)};
#endif
    return r;
}
/* a >= b lane by lane. GCC's armv7 arm_neon.h defines vcgeq_f32 as the GNU vector expression
 * (a >= b), which it then compares lane by lane in VFP (NEON's compare flushes denormals: not IEEE),
 * about 30 instructions a quad (most of vf_exp's on armv7); the kernels run with flush-to-zero set, so
 * VCGE gives the same mask. */
static inline uint32x4_t vcge_q(float32x4_t a, float32x4_t b) {
#if !defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__)
    uint32x4_t r;
    __asm__("vcge.f32 %q0, %q1, %q2" : "=w"(r) : "w"(a), "w"(b));
    return r;
#else
    return vcgeq_f32(a, b);
#endif
}
static inline vf vf_zero_below(vf x, vf test, vf lo) {
    vf r = {vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x.lo), vcge_q(test.lo, lo.lo))),
            vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x.hi), vcge_q(test.hi, lo.hi)))};
    return r;
}
static inline float32x4_t pow2i_q(float32x4_t n) {
    int32x4_t e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
    return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
static inline vf vf_pow2i(vf n) { vf r = {pow2i_q(n.lo), pow2i_q(n.hi)}; return r; }
static inline float32x4_t f16_rebias_q(uint32x4_t x, uint32x4_t *bad) {
    const uint32x4_t e = vandq_u32(x, vdupq_n_u32(0x7c00));
    *bad = vorrq_u32(*bad, vorrq_u32(vceqq_u32(e, vdupq_n_u32(0)), vceqq_u32(e, vdupq_n_u32(0x7c00))));
    const uint32x4_t sign = vshlq_n_u32(vandq_u32(x, vdupq_n_u32(0x8000)), 16);
    const uint32x4_t mag = vaddq_u32(vshlq_n_u32(vandq_u32(x, vdupq_n_u32(0x7fff)), 13), vdupq_n_u32(112u << 23));
    return vreinterpretq_f32_u32(vorrq_u32(sign, mag));
}
static inline vf vf_from_f16(const uint16_t *p, int *special) {
    const uint16x8_t h = vld1q_u16(p);
    uint32x4_t bad = vdupq_n_u32(0);
    vf r = {f16_rebias_q(vmovl_u16(vget_low_u16(h)), &bad), f16_rebias_q(vmovl_u16(vget_high_u16(h)), &bad)};
    const uint32x2_t folded = vorr_u32(vget_low_u32(bad), vget_high_u32(bad));
    *special = (vget_lane_u32(folded, 0) | vget_lane_u32(folded, 1)) != 0;
    return r;
}
static inline vf vf_from_i8(const int8_t *p) {
    const int16x8_t w = vmovl_s8(vld1_s8(p));
    vf r = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)))};
    return r;
}
#define TB_VECTOR_NAME (TB_MADD_FUSED ? "neon-fma" : "neon")

#elif defined(TB_SSE2)
typedef struct { __m128 lo, hi; } vf;
static inline vf vf_load(const float *p) { vf r = {_mm_loadu_ps(p), _mm_loadu_ps(p + 4)}; return r; }
static inline void vf_store(float *p, vf a) { _mm_storeu_ps(p, a.lo); _mm_storeu_ps(p + 4, a.hi); }
static inline vf vf_set1(float x) { vf r = {_mm_set1_ps(x), _mm_set1_ps(x)}; return r; }
static inline vf vf_add(vf a, vf b) { vf r = {_mm_add_ps(a.lo, b.lo), _mm_add_ps(a.hi, b.hi)}; return r; }
static inline vf vf_sub(vf a, vf b) { vf r = {_mm_sub_ps(a.lo, b.lo), _mm_sub_ps(a.hi, b.hi)}; return r; }
static inline vf vf_mul(vf a, vf b) { vf r = {_mm_mul_ps(a.lo, b.lo), _mm_mul_ps(a.hi, b.hi)}; return r; }
static inline vf vf_min(vf a, vf b) { vf r = {_mm_min_ps(a.lo, b.lo), _mm_min_ps(a.hi, b.hi)}; return r; }
static inline vf vf_max(vf a, vf b) { vf r = {_mm_max_ps(a.lo, b.lo), _mm_max_ps(a.hi, b.hi)}; return r; }
static inline vf vf_madd(vf a, vf b, vf c) { /* no FMA in SSE2: always unfused (TB_MADD_FUSED is 0) */
    vf r = {_mm_add_ps(_mm_mul_ps(a.lo, b.lo), c.lo), _mm_add_ps(_mm_mul_ps(a.hi, b.hi), c.hi)};
    return r;
}
static inline vf vf_zero_below(vf x, vf test, vf lo) {
    vf r = {_mm_and_ps(x.lo, _mm_cmpge_ps(test.lo, lo.lo)), _mm_and_ps(x.hi, _mm_cmpge_ps(test.hi, lo.hi))};
    return r;
}
static inline __m128 pow2i_sse(__m128 n) {
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(n), _mm_set1_epi32(127)), 23));
}
static inline vf vf_pow2i(vf n) { vf r = {pow2i_sse(n.lo), pow2i_sse(n.hi)}; return r; }
static inline __m128 f16_rebias_sse(__m128i x, __m128i *bad) {
    const __m128i e = _mm_and_si128(x, _mm_set1_epi32(0x7c00));
    *bad = _mm_or_si128(*bad, _mm_or_si128(_mm_cmpeq_epi32(e, _mm_setzero_si128()), _mm_cmpeq_epi32(e, _mm_set1_epi32(0x7c00))));
    const __m128i sign = _mm_slli_epi32(_mm_and_si128(x, _mm_set1_epi32(0x8000)), 16);
    const __m128i mag = _mm_add_epi32(_mm_slli_epi32(_mm_and_si128(x, _mm_set1_epi32(0x7fff)), 13), _mm_set1_epi32(112 << 23));
    return _mm_castsi128_ps(_mm_or_si128(sign, mag));
}
static inline vf vf_from_f16(const uint16_t *p, int *special) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p), zero = _mm_setzero_si128();
    __m128i bad = zero;
    vf r = {f16_rebias_sse(_mm_unpacklo_epi16(h, zero), &bad), f16_rebias_sse(_mm_unpackhi_epi16(h, zero), &bad)};
    *special = _mm_movemask_epi8(bad) != 0;
    return r;
}
static inline vf vf_from_i8(const int8_t *p) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m128i w = _mm_srai_epi16(_mm_unpacklo_epi8(b, b), 8); /* sign-extended to 16 bits */
    vf r = {_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(w, w), 16)),
            _mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpackhi_epi16(w, w), 16))};
    return r;
}
#define TB_VECTOR_NAME "sse2"

#else
typedef struct { float x[VF_LANES]; } vf;
#define VF_MAP(expr) do { for (int l = 0; l < VF_LANES; l++) r.x[l] = (expr); } while (0)
static inline vf vf_load(const float *p) { vf r; memcpy(r.x, p, sizeof r.x); return r; }
static inline void vf_store(float *p, vf a) { memcpy(p, a.x, sizeof a.x); }
static inline vf vf_set1(float v) { vf r; VF_MAP(v); return r; }
static inline vf vf_add(vf a, vf b) { vf r; VF_MAP(a.x[l] + b.x[l]); return r; }
static inline vf vf_sub(vf a, vf b) { vf r; VF_MAP(a.x[l] - b.x[l]); return r; }
static inline vf vf_mul(vf a, vf b) { vf r; VF_MAP(a.x[l] * b.x[l]); return r; }
static inline vf vf_min(vf a, vf b) { vf r; VF_MAP(b.x[l] < a.x[l] ? b.x[l] : a.x[l]); return r; }
static inline vf vf_max(vf a, vf b) { vf r; VF_MAP(b.x[l] > a.x[l] ? b.x[l] : a.x[l]); return r; }
static inline vf vf_madd(vf a, vf b, vf c) { vf r; VF_MAP(madd1(a.x[l], b.x[l], c.x[l])); return r; }
static inline vf vf_zero_below(vf x, vf test, vf lo) { vf r; VF_MAP(test.x[l] >= lo.x[l] ? x.x[l] : 0.0f); return r; }
static inline vf vf_pow2i(vf n) {
    vf r;
    for (int l = 0; l < VF_LANES; l++) {
        uint32_t bits = (uint32_t)((int32_t)n.x[l] + 127) << 23;
        memcpy(&r.x[l], &bits, sizeof bits);
    }
    return r;
}
static inline vf vf_from_f16(const uint16_t *p, int *special) {
    vf r;
    int bad = 0;
    for (int l = 0; l < VF_LANES; l++) {
        const uint32_t x = p[l], e = x & 0x7c00u;
        const uint32_t bits = ((x & 0x8000u) << 16) | (((x & 0x7fffu) << 13) + (112u << 23));
        memcpy(&r.x[l], &bits, sizeof bits);
        bad |= (e == 0) | (e == 0x7c00u);
    }
    *special = bad;
    return r;
}
static inline vf vf_from_i8(const int8_t *p) { vf r; VF_MAP((float)p[l]); return r; }
#define TB_VECTOR_NAME "scalar"
#endif

static inline vf vf_zero(void) { return vf_set1(0.0f); }

/* Sum of the 8 lanes in one fixed order, the same on every target. */
static inline float vf_hsum(vf a) {
#if defined(TB_NEON)
    /* in registers, each addition the scalar order's with its operands in the same order:
     * s = (t0 + t4, t1 + t5, t2 + t6, t3 + t7), then (s0 + s2, s1 + s3), then their sum */
    const float32x4_t s = vaddq_f32(a.lo, a.hi);
    const float32x2_t h = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
#else
    float t[VF_LANES];
    vf_store(t, a);
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
#endif
}

/* exp(x) in float32 from plain arithmetic (Cephes' expf polynomial, about 1 ulp), so every target
 * computes the same bits; libm's expf differs between builds. Results below 2^-126 are flushed to 0,
 * which is also what ARMv7 NEON does with denormals. */
static inline vf vf_exp(vf x) {
    const vf lo = vf_set1(-87.3f);
    vf xc = vf_max(vf_min(x, vf_set1(88.0f)), lo);
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (round to nearest even) */
    const vf magic = vf_set1(12582912.0f);
    vf n = vf_sub(vf_madd(xc, vf_set1(1.44269504088896341f), magic), magic);
    vf r = vf_sub(xc, vf_mul(n, vf_set1(0.693359375f)));
    r = vf_sub(r, vf_mul(n, vf_set1(-2.12194440e-4f)));
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_madd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_madd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_madd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_madd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_madd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_madd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    vf n_clamped = vf_max(n, vf_set1(-126.0f));
    return vf_zero_below(vf_mul(p, vf_pow2i(n_clamped)), x, lo);
}

static inline float exp1(float x) {
    float t[VF_LANES];
    vf_store(t, vf_exp(vf_set1(x)));
    return t[0];
}

/* dst[i] = exp(src[i]) for n values, tail included */
static inline void exp_n(float *dst, const float *src, int n) {
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(dst + i, vf_exp(vf_load(src + i)));
    if (i < n) {
        float t[VF_LANES] = {0};
        memcpy(t, src + i, sizeof(float) * (size_t)(n - i));
        vf_store(t, vf_exp(vf_load(t)));
        memcpy(dst + i, t, sizeof(float) * (size_t)(n - i));
    }
}

#endif
