/* IEEE binary16 <-> float32, exact bit manipulation (internal): the engines' f16 weights and cache rows,
 * and the fp16 products of the chunkwise GDN's reduced-precision forms (an NPU matrix unit's tiles). */
#ifndef TB_HALF_H
#define TB_HALF_H

#include <stdint.h>
#include <string.h>

/* IEEE binary16 -> float32, exact (inline: it runs once per weight of an f16 matrix product). */
static inline float tb_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
    uint32_t b;
    if (exp && exp != 0x1f) b = sign | ((exp + 112u) << 23) | (mant << 13); /* normal: rebias 15 -> 127 */
    else if (exp) b = sign | 0x7f800000u | (mant << 13);                   /* inf, nan */
    else if (!mant) b = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = mant;
        do e++, m <<= 1; while (!(m & 0x400u));
        b = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float x;
    memcpy(&x, &b, 4);
    return x;
}

/* float32 -> IEEE binary16, round to nearest even (numpy's astype(float16)). */
static inline uint16_t tb_f32_to_f16(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    const uint32_t sign = (b >> 16) & 0x8000u, abs = b & 0x7fffffffu;
    if (abs >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0)); /* inf, nan */
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (abs < 0x38800000u) { /* below 2^-14: a subnormal half (or zero) */
        if (abs < 0x33000000u) return (uint16_t)sign; /* below half the smallest subnormal: zero */
        const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(abs >> 23) + 14; /* 14..24: bits dropped below the half's lsb */
        uint32_t half = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = ((abs >> 13) - (112u << 10)); /* rebias the exponent 127 -> 15, keep 10 mantissa bits */
    const uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++; /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
}

/* x rounded to the nearest binary16 value, as float32. */
static inline float tb_round_f16(float x) { return tb_f16_to_f32(tb_f32_to_f16(x)); }

#endif
