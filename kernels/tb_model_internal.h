/* What the engine's files share beyond tb_model.h (internal). */
#ifndef TB_MODEL_INTERNAL_H
#define TB_MODEL_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "tb_model.h"

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

/* Append n rows of k, v [kv_heads, row_stride, head_dim] (the first n rows of each head) at positions. */
int tb_kv_append(tb_kv_cache *c, const float *k, const float *v, int row_stride, const int64_t *positions, int n);
/* Drop the newest n rows. */
int tb_kv_drop(tb_kv_cache *c, int n);

/* The engine's layout, as far as the tail policy needs it: its layers, and which keep a sliding cache. */
int tb_engine_layers(const tb_engine *e);
int tb_engine_evicts(const tb_engine *e, int layer);

#endif
