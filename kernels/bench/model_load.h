/* The model engine's weights from ONE safetensors file (names and dtypes: kernels/README.md) and its
 * shape from the harness's key=value arguments (vocab= hidden= layers= ... wdtype= wgroup= weights=FILE):
 * what tb_model_bench and tb_model_engine (engine contract v1) both load, the same way. */
#ifndef TB_MODEL_LOAD_H
#define TB_MODEL_LOAD_H

#include "../tb_model.h"
#include "safetensors.h"

/* The argument `key` as one of f32, f16, int8 (TB_F32, TB_F16, TB_INT8); exits naming it otherwise. */
int dtype_arg(const char *key, const char *fallback);
/* The argument `key` as an integer >= least; exits naming it otherwise. */
long positive(const char *key, long fallback, long least);
/* The model from the arguments and the weights file they name (kept open in `f`: the matrices point
 * into it); a file of another shape or dtype, or a damaged one, exits naming the tensor. */
void load_model(tb_model *m, st_file *f);
/* The model keys load_model reads, NULL-terminated (for args_init's list of known keys). */
#define TB_MODEL_KEYS "weights", "vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "window", \
    "types", "rope_local", "rope_global", "rope_global_scaling", "attn_scale", "eps", "softcap", "wdtype", "wgroup"

#endif
