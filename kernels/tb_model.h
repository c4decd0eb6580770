/* The Gemma-3-style decoder of refimpl/gemma.py in C, on the kernels of tb_kernels.h: chunk prefill
 * with past (seed 000) and chunked prefill with a padded tail and rollback on sliding-window caches
 * (seed 003). Same conventions as tb_kernels.h: plain C ABI, float32 activations, TB_* return codes,
 * nothing written when a request is refused; libc, libm and the kernels' threads only.
 *
 * Per layer i (type local or global), for a call of R rows at table positions s..s+R-1:
 *     x      = embed[tokens] * sqrt(hidden)
 *     h      = rmsnorm(x); q, k, v = h Wq, h Wk, h Wv             rmsnorm(x) = x / rms(x) * (1 + w)
 *     q, k   = rope(rmsnorm_head(q)), rope(rmsnorm_head(k))       bases rope_local / rope_global
 *     x     += rmsnorm(attention(q, [cache K; k], [cache V; v], mask) Wo)
 *     x     += rmsnorm(down(gelu_tanh(gate(h)) * up(h)))           h = rmsnorm(x)
 *     logits = rmsnorm(x_selected) embed^T                         tied; optional tanh soft cap
 * The mask is built here from positions exactly as refimpl.gemma.attention_mask builds it: a real row
 * at position a attends held keys at positions in [0, a] (local: also > a - window); a pad row
 * (position -1) attends only its own column. K/V are cached after k-norm and RoPE.
 */
#ifndef TB_MODEL_H
#define TB_MODEL_H

#include <stdint.h>

#include "tb_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TB_E_REFUSED (-4) /* a request the engine must not carry out (outside the cache or window) */

/* Storage dtypes of weights and of cache rows. TB_INT8: symmetric, one float32 scale per `group`
 * consecutive elements of a row (scale = max|x| / 127, q = round(x / scale)). */
#define TB_F32 0
#define TB_F16 1
#define TB_INT8 2

#define TB_MAX_LAYERS 256
#define TB_LOCAL 0
#define TB_GLOBAL 1

typedef struct {
    int vocab, hidden, layers, heads, kv_heads, head_dim, mlp, window;
    int layer_type[TB_MAX_LAYERS]; /* TB_LOCAL or TB_GLOBAL */
    double rope_local, rope_global;
    double rope_global_scaling; /* linear RoPE scaling of the global layers (frequencies / it); 1 = none */
    float attn_scale; /* query_pre_attn_scalar ** -0.5 */
    float rms_eps;
    float softcap; /* final logit soft cap; 0 = none */
} tb_model_config;

/* A weight matrix [rows, cols] (Hugging Face's [out, in]) in its stored dtype, row-major. */
typedef struct {
    int dtype, rows, cols, group;
    const void *data;
    const float *scales; /* TB_INT8: [rows, cols / group] */
} tb_matrix;

typedef struct {
    tb_matrix q, k, v, o, gate, up, down;
    const float *q_norm, *k_norm;                       /* [head_dim] */
    const float *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm; /* [hidden] */
} tb_layer_weights;

typedef struct {
    tb_model_config cfg;
    tb_matrix embed; /* [vocab, hidden], also the output projection (tied) */
    const float *final_norm;
    tb_layer_weights layer[TB_MAX_LAYERS];
} tb_model;

/* Checks the configuration and that every matrix has its shape; TB_E_SHAPE otherwise. */
int tb_model_check(const tb_model *m);

/* One layer's KV cache in refimpl/sliding_cache.py's byte layout: k, v [kv_heads, capacity, head_dim]
 * in the storage dtype, k_scale, v_scale [kv_heads, capacity, head_dim / group] float32 (int8 only),
 * positions [capacity] int64 (-1 empty). Each array is a tb_sliding_cache of raw rows, so append,
 * snapshot and rollback are kernels/sliding_cache.c's. A full (global) cache is one whose capacity
 * is never exceeded: sink 0, capacity rows. */
typedef struct {
    int dtype, group, kv_heads, head_dim;
    tb_sliding_cache part[5]; /* k, v, k_scale, v_scale, positions (scales unused unless int8) */
} tb_kv_cache;

#define TB_KV_K 0
#define TB_KV_V 1
#define TB_KV_K_SCALE 2
#define TB_KV_V_SCALE 3
#define TB_KV_POSITIONS 4

int tb_kv_init(tb_kv_cache *c, int kv_heads, int head_dim, int capacity, int sink, int dtype, int group);
void tb_kv_free(tb_kv_cache *c);
int tb_kv_count(const tb_kv_cache *c);
/* Back to empty: every slot zero, every position -1. */
void tb_kv_clear(tb_kv_cache *c);
/* The held rows as float32: k, v [kv_heads, kv_rows, head_dim] (rows 0..count-1 written) and their
 * positions [count]. */
void tb_kv_read(const tb_kv_cache *c, float *k, float *v, int64_t *positions, int kv_rows);
/* The held rows' positions [count]. */
void tb_kv_positions(const tb_kv_cache *c, int64_t *positions);
/* Attention's keys read in place. A float32 cache's K and V planes are already what tb_attention reads
 * ([kv_heads, capacity, head_dim], the held rows first, in order), so a call's own rows k, v
 * [kv_heads, rows, head_dim] are staged in the free slots right after them: not held (count and
 * positions unchanged; tb_kv_unstage empties the slots again, leaving the cache's bytes as they were),
 * and the planes are handed out with kv_rows = capacity. Returns 1 when staged; 0 when the cache holds
 * another dtype or has no room for the rows after its held ones, and nothing is written: the caller
 * reads a float32 copy (tb_kv_read). A decode step then streams its K/V once instead of three times. */
int tb_kv_stage(tb_kv_cache *c, const float *k, const float *v, int rows, const float **k_planes,
                const float **v_planes, int *kv_rows);
void tb_kv_unstage(tb_kv_cache *c, int rows);
/* Whether part p is in use (the scales only for int8). */
int tb_kv_has_part(const tb_kv_cache *c, int p);

/* What a padded append will evict beyond the exact one, per part (tb_cache_snapshot). */
typedef struct {
    uint8_t *saved[5];
    int n_saved, n_pad;
} tb_kv_snapshot;

int tb_kv_snapshot_padded(const tb_kv_cache *c, int n_real, int n_pad, tb_kv_snapshot *s);
int tb_kv_rollback_padded(tb_kv_cache *c, tb_kv_snapshot *s); /* frees s */
void tb_kv_snapshot_free(tb_kv_snapshot *s);                  /* a snapshot not rolled back */

/* The engine: a model, one cache per layer, scratch for calls of up to max_rows rows. */
typedef struct tb_engine tb_engine;

typedef struct {
    int cache_dtype, cache_group;
    int sliding;          /* 1: local layers keep a sliding cache of `window` rows (seed 003);
                             0: every layer keeps every row (the chunk-prefill contract, seed 000) */
    int sink;             /* sliding caches: rows never evicted */
    int capacity;         /* rows of every cache that never evicts (a call that overflows it is refused) */
    int max_rows;         /* the largest call */
    int threads;
} tb_engine_options;

int tb_engine_create(const tb_model *m, const tb_engine_options *o, tb_engine **out);
void tb_engine_free(tb_engine *e);
tb_kv_cache *tb_engine_cache(tb_engine *e, int layer);
void tb_engine_clear(tb_engine *e);
/* Drop the newest n rows of every cache (pads between chunk calls, or a rewind). */
int tb_engine_drop(tb_engine *e, int n);

/* One call: `rows` rows, the first n real (tokens[0..n-1]; the rest are pads with token 0 and mask
 * position -1), table positions start..start+rows-1, against what every cache holds. The first
 * `keep` rows are appended to every cache (keep = rows: the contract's call, pads included).
 * logits [vocab] of row `select` when non-NULL. Refused (TB_E_REFUSED) when the rows do not fit a
 * full cache or a token is outside the vocabulary. */
int tb_model_prefill_with_past(tb_engine *e, const int32_t *tokens, int n, int rows, int64_t start, int keep,
                               int select, float *logits);
/* One token at `position`: prefill_with_past with one row. */
int tb_model_decode_with_past(tb_engine *e, int32_t token, int64_t position, float *logits);

/* The padded-tail policy of refimpl/tail_prefill.py (TailPolicy). */
typedef struct {
    int threshold;   /* tails of up to this many tokens stay scalar */
    int kill_switch; /* TESTBED_DISABLE_PREFILL_TAIL_PAD=1 */
    int has_state;   /* the model has a conv or recurrent state (its rows cannot be rolled back) */
    int exact_tail;  /* for the byte-identical oracle: the padded call appends only its real rows,
                        no snapshot and no rollback (what an unpadded append leaves) */
} tb_tail_policy;

#define TB_KILL_SWITCH "TESTBED_DISABLE_PREFILL_TAIL_PAD"

#define TB_TAIL_NONE 0
#define TB_TAIL_SCALAR 1
#define TB_TAIL_PADDED 2

/* Why a tail ran as it did (refimpl's reasons, as codes). */
#define TB_REASON_PADDED 0
#define TB_REASON_NO_TAIL 1
#define TB_REASON_KILL_SWITCH 2
#define TB_REASON_THRESHOLD 3
#define TB_REASON_STATE 4
#define TB_REASON_NO_SLIDING 5
#define TB_REASON_WINDOW 6

typedef struct {
    int prompt_tokens, chunk_size, chunk_tokens, tail_chunk_tokens, padding_tokens, scalar_tail_tokens;
    int tail_mode, reason;
} tb_telemetry;

/* Whether a tail of `tail` tokens runs padded, and why (refimpl's TailPolicy.decide). */
int tb_tail_decide(const tb_engine *e, const tb_tail_policy *p, int tail, int chunk, int *reason);

/* Prefill tokens[0..n-1] from position 0 into the (empty) caches: n / chunk full chunk calls, then
 * the tail scalar or padded: snapshot, one padded chunk call, rollback of the pads and the last real
 * token, which is re-run as a decode step for the first token's logits [vocab]. */
int tb_model_prefill(tb_engine *e, const int32_t *tokens, int n, int chunk, const tb_tail_policy *p,
                     float *logits, tb_telemetry *t);

/* Seconds spent in the weight matrix products since the engine was created, by the wall clock and
 * by the process's CPU clock (the engine's own timer: what a chunk call's matmul rate is computed
 * from; on a shared machine the CPU clock leaves out the time other processes held the core). */
void tb_engine_matmul_seconds(const tb_engine *e, double *wall, double *cpu);

#ifdef __cplusplus
}
#endif
#endif
