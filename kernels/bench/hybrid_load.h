/* The hybrid engine's weights from ONE safetensors file in Hugging Face's Qwen3.5 names (kernels/README.md)
 * and its shape from the harness's key=value arguments: what tb_hybrid_bench and tb_model_engine (engine
 * contract v1, technique hybrid) both load, the same way. The file must hold exactly the model's tensors,
 * float32, of the shapes the arguments give; anything else exits naming the tensor. */
#ifndef TB_HYBRID_LOAD_H
#define TB_HYBRID_LOAD_H

#include "../tb_hybrid.h"
#include "safetensors.h"

/* The model keys hybrid_load_model reads (for args_init's list of known keys). */
#define TB_HYBRID_KEYS "weights", "vocab", "hidden", "layers", "mlp", "heads", "kv_heads", "head_dim", "k_heads", \
    "v_heads", "linear_dim", "conv_kernel", "types", "rotary_dim", "rope_theta", "eps", "tied"

/* The model from the arguments and the weights file they name (kept open in `f`: the matrices point into it). */
void hybrid_load_model(tb_hybrid_model *m, st_file *f);

#endif
