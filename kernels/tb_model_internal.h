/* What the engine's files share beyond tb_model.h (internal). */
#ifndef TB_MODEL_INTERNAL_H
#define TB_MODEL_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "tb_half.h"
#include "tb_model.h"

/* Append n rows of k, v [kv_heads, row_stride, head_dim] (the first n rows of each head) at positions. */
int tb_kv_append(tb_kv_cache *c, const float *k, const float *v, int row_stride, const int64_t *positions, int n);
/* Drop the newest n rows. */
int tb_kv_drop(tb_kv_cache *c, int n);

/* The engine's layout, as far as the tail policy needs it: its layers, and which keep a sliding cache. */
int tb_engine_layers(const tb_engine *e);
int tb_engine_evicts(const tb_engine *e, int layer);

#endif
