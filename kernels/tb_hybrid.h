/* The Qwen3.5-style hybrid decoder of refimpl/qwen35.py in C (transformers' Qwen3_5ForCausalLM, text
 * only), next to the Gemma engine of tb_model.h: Gated DeltaNet ("linear") layers with their short
 * causal conv and recurrent state, and gated full-attention layers with partial RoPE and a KV cache.
 * One engine API: a call of R rows (n real, the rest pads) continuing from the carried past (prefill
 * chunk with past; R = 1 is decode). Same conventions as tb_kernels.h: plain C ABI, float32, TB_*
 * return codes, nothing written when a request is refused.
 *
 * Per layer, on rows h = rmsnorm(x) (weights (1 + w)):
 *   linear  qkv = silu(causal_conv([conv state; h Wqkv]))     depthwise, kernel K, per channel
 *           q, k = l2norm per key head; v per value head       value head h reads key head h / (H_v / H_k)
 *           g = -exp(A_log) softplus(h Wa + dt_bias); beta = sigmoid(h Wb)   pads: g = beta = 0
 *           o = GDN(q, k, v, g, beta, S) (tb_gdn_serial or tb_gdn_chunkwise_precision)
 *           x += (rmsnorm(o) * w_norm * silu(h Wz)) Wout       per value head, plain weight
 *   full    [q | gate] per head = h Wq; k = h Wk; v = h Wv
 *           q, k = rope(rmsnorm_head(q)), rope(rmsnorm_head(k)) on the first rotary_dim dims
 *           x += (softmax(q K^T / sqrt(d)) V * sigmoid(gate)) Wo over the past and the call's rows
 *   both    x += down(silu(gate(h)) * up(h)), h = rmsnorm(x)
 *   logits = rmsnorm(x) lm_head^T (the embedding when tied)
 *
 * Pads leave the past untouched, as in refimpl: beta = g = 0 is the identity on the recurrent state,
 * the conv state is taken at the last real row, a pad row attends only itself and its K/V row is not
 * kept. Every result is independent of how many rows share a call: every matrix product is a chain
 * over its inner index in order (tb_linalg.h's gemm_nn, whatever the rows), attention walks exactly
 * the keys a row may see, each reduction runs in a fixed order. So a tail padded to C rows gives the
 * same bytes, state and logits, as the same tail in a call of its own length.
 */
#ifndef TB_HYBRID_H
#define TB_HYBRID_H

#include <stdint.h>

#include "tb_model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TB_HYBRID_LINEAR 0
#define TB_HYBRID_FULL 1

/* The GDN form of the linear layers. TB_GDN_NONE does no recurrence (zero output, state unchanged):
 * the hybrid timed with it is everything but the recurrence (the crossover's bound on any GDN form). */
#define TB_GDN_SERIAL 0
#define TB_GDN_CHUNKWISE 1
#define TB_GDN_NONE 2

typedef struct {
    int vocab, hidden, layers, mlp;
    int heads, kv_heads, head_dim;      /* full attention */
    int k_heads, v_heads, linear_dim;   /* GDN: H_k query/key heads, H_v value heads, head size d */
    int conv_kernel, rotary_dim;        /* RoPE rotates the first rotary_dim dims of a head */
    int layer_type[TB_MAX_LAYERS];      /* TB_HYBRID_LINEAR or TB_HYBRID_FULL */
    double rope_theta;
    float rms_eps;
    int tied;                           /* the LM head is the embedding */
} tb_hybrid_config;

typedef struct {
    /* linear (GDN) layers; matrices [out, in] float32 */
    tb_matrix qkv, z, b, a, out;        /* qkv [2 H_k d + H_v d, hidden]; z [H_v d, hidden]; b, a [H_v, hidden] */
    const float *conv;                  /* [conv channels, K] (Hugging Face's [channels, 1, K]) */
    const float *dt_bias, *a_log;       /* [H_v] */
    const float *norm;                  /* [d], the output norm's plain weight */
    /* full-attention layers */
    tb_matrix q, k, v, o;               /* q [2 heads head_dim, hidden]: per head head_dim query rows, then head_dim gate rows */
    const float *q_norm, *k_norm;       /* [head_dim], (1 + w) */
    /* every layer */
    tb_matrix gate, up, down;
    const float *input_norm, *post_attn_norm; /* [hidden], (1 + w) */
} tb_hybrid_layer;

typedef struct {
    tb_hybrid_config cfg;
    tb_matrix embed, lm_head;           /* [vocab, hidden]; lm_head unused when tied */
    const float *final_norm;
    tb_hybrid_layer layer[TB_MAX_LAYERS];
} tb_hybrid_model;

typedef struct {
    int capacity;      /* positions the KV caches hold: the past and a call's rows must fit */
    int max_rows;      /* the largest call */
    int threads;
    int gdn_form;      /* TB_GDN_* */
    int gdn_chunk;     /* the chunkwise form's chunk */
    int gdn_precision; /* TB_PRECISION_* of the chunkwise form's products (tb_kernels.h) */
} tb_hybrid_options;

/* Checks the configuration and that every matrix has its shape (float32); TB_E_SHAPE otherwise. */
int tb_hybrid_check(const tb_hybrid_model *m);

typedef struct tb_hybrid_engine tb_hybrid_engine;

int tb_hybrid_create(const tb_hybrid_model *m, const tb_hybrid_options *o, tb_hybrid_engine **out);
void tb_hybrid_free(tb_hybrid_engine *e);
/* Back to an empty past: zero conv and recurrent states, empty KV caches. */
void tb_hybrid_clear(tb_hybrid_engine *e);
/* Positions consumed so far. */
int64_t tb_hybrid_length(const tb_hybrid_engine *e);

/* The carried state of layer i. A linear layer: conv [K - 1, conv channels] (the last K - 1 rows of
 * the conv's input) and recurrent [H_v, d, d] stored transposed (recurrent[h][j][i] = S[i][j], as
 * tb_gdn_*); a full layer: k and v [kv_heads, capacity, head_dim], rows 0..length-1 in use (after
 * k-norm and RoPE). NULL where the layer has no such array. */
float *tb_hybrid_conv(tb_hybrid_engine *e, int layer);
float *tb_hybrid_recurrent(tb_hybrid_engine *e, int layer);
float *tb_hybrid_keys(tb_hybrid_engine *e, int layer);
float *tb_hybrid_values(tb_hybrid_engine *e, int layer);

/* One call of `rows` rows after the past: tokens[0..n-1] real at positions length..length+n-1, the
 * rest pads (token 0). The past then holds the n real rows. logits: when non-NULL, [vocab] of row
 * `select` (a real row), or with select = TB_HYBRID_ALL_ROWS [n, vocab] of every real row. Refused
 * (TB_E_REFUSED) when the call does not fit the caches or max_rows, n is not 1..rows, or a token is
 * outside the vocabulary. */
#define TB_HYBRID_ALL_ROWS (-1)
int tb_hybrid_prefill_with_past(tb_hybrid_engine *e, const int32_t *tokens, int n, int rows, int select,
                                float *logits);
/* One token: the same call with one row. */
int tb_hybrid_decode(tb_hybrid_engine *e, int32_t token, float *logits);

/* Seconds spent in the GDN recurrence (tb_gdn_*) since the engine was created, by the wall clock and by
 * the process's CPU clock: the recurrence's own cost, apart from the rest of the model (the share a
 * faster GDN form can change). */
void tb_hybrid_gdn_seconds(const tb_hybrid_engine *e, double *wall, double *cpu);

#ifdef __cplusplus
}
#endif
#endif
