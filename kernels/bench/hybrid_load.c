/* The hybrid engine's weights and shape from the harness's arguments (hybrid_load.h). */
#include "hybrid_load.h"

#include <stdio.h>
#include <string.h>

#include "harness.h"

static long at_least(const char *key, long fallback, long least) {
    long v = arg_int(key, fallback);
    if (v < least) die("%s=%ld is out of range (at least %ld)", key, v, least);
    return v;
}

/* --- weights --------------------------------------------------------------------------------------- */

static const float *tensor(const st_file *f, const char *path, const char *name, int ndim, const size_t *dims,
                           int *used) {
    const st_tensor *t = st_find(f, name);
    if (!t) die("%s: tensor %s is missing (a weights file for another model?)", path, name);
    if (strcmp(t->dtype, "F32")) die("%s: tensor %s is %s, expected F32", path, name, t->dtype);
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == dims[i];
    if (!same) {
        char got[96] = "", want[96] = "";
        for (int i = 0; i < t->ndim; i++) snprintf(got + strlen(got), sizeof got - strlen(got), "%s%zu", i ? ", " : "", t->shape[i]);
        for (int i = 0; i < ndim; i++) snprintf(want + strlen(want), sizeof want - strlen(want), "%s%zu", i ? ", " : "", dims[i]);
        die("%s: tensor %s has shape [%s], expected [%s] (a weights file for another shape?)", path, name, got, want);
    }
    (*used)++;
    return t->data;
}

static tb_matrix matrix(const st_file *f, const char *path, const char *name, int rows, int cols, int *used) {
    const size_t dims[2] = {(size_t)rows, (size_t)cols};
    tb_matrix m = {TB_F32, rows, cols, 0, tensor(f, path, name, 2, dims, used), NULL};
    return m;
}

static const float *vector(const st_file *f, const char *path, const char *name, int n, int *used) {
    const size_t dims[1] = {(size_t)n};
    return tensor(f, path, name, 1, dims, used);
}

void hybrid_load_model(tb_hybrid_model *m, st_file *f) {
    tb_hybrid_config *c = &m->cfg;
    memset(m, 0, sizeof *m);
    c->vocab = (int)at_least("vocab", 0, 1), c->hidden = (int)at_least("hidden", 0, 1);
    c->layers = (int)at_least("layers", 0, 1), c->mlp = (int)at_least("mlp", 0, 1);
    c->heads = (int)at_least("heads", 0, 1), c->kv_heads = (int)at_least("kv_heads", 0, 1);
    c->head_dim = (int)at_least("head_dim", 0, 2), c->k_heads = (int)at_least("k_heads", 0, 1);
    c->v_heads = (int)at_least("v_heads", 0, 1), c->linear_dim = (int)at_least("linear_dim", 0, 1);
    c->conv_kernel = (int)at_least("conv_kernel", 4, 1), c->rotary_dim = (int)at_least("rotary_dim", 0, 2);
    c->rope_theta = arg_float("rope_theta", 10000.0), c->rms_eps = (float)arg_float("eps", 1e-6);
    c->tied = (int)arg_int("tied", 0) != 0;
    const char *types = arg_str("types", "");
    if (c->layers > TB_MAX_LAYERS || (int)strlen(types) != c->layers || strspn(types, "LF") != strlen(types))
        die("types=%s must give L (linear) or F (full attention) for each of the %d layers", types, c->layers);
    for (int i = 0; i < c->layers; i++) c->layer_type[i] = types[i] == 'F' ? TB_HYBRID_FULL : TB_HYBRID_LINEAR;
    if (c->heads % c->kv_heads) die("heads=%d must be a multiple of kv_heads=%d", c->heads, c->kv_heads);
    if (c->v_heads % c->k_heads) die("v_heads=%d must be a multiple of k_heads=%d", c->v_heads, c->k_heads);
    if (c->rotary_dim % 2 || c->rotary_dim > c->head_dim)
        die("rotary_dim=%d must be even and at most head_dim=%d", c->rotary_dim, c->head_dim);
    if (!(c->rope_theta > 0.0)) die("rope_theta=%g must be > 0", c->rope_theta);

    const char *path = arg_str("weights", NULL);
    if (!path) die("weights=FILE is required");
    char err[512];
    if (st_open(path, f, err, sizeof err)) die("%s", err);
    const int hid = c->hidden, q = c->heads * c->head_dim, kv = c->kv_heads * c->head_dim, d = c->linear_dim;
    const int kd = c->k_heads * d, vd = c->v_heads * d, cd = 2 * kd + vd;
    int used = 0;
    m->embed = matrix(f, path, "model.embed_tokens.weight", c->vocab, hid, &used);
    if (!c->tied) m->lm_head = matrix(f, path, "lm_head.weight", c->vocab, hid, &used);
    m->final_norm = vector(f, path, "model.norm.weight", hid, &used);
    for (int i = 0; i < c->layers; i++) {
        tb_hybrid_layer *l = &m->layer[i];
        char n[256];
#define NAME(suffix) (snprintf(n, sizeof n, "model.layers.%d.%s", i, suffix), n)
        if (c->layer_type[i] == TB_HYBRID_LINEAR) {
            l->qkv = matrix(f, path, NAME("linear_attn.in_proj_qkv.weight"), cd, hid, &used);
            l->z = matrix(f, path, NAME("linear_attn.in_proj_z.weight"), vd, hid, &used);
            l->b = matrix(f, path, NAME("linear_attn.in_proj_b.weight"), c->v_heads, hid, &used);
            l->a = matrix(f, path, NAME("linear_attn.in_proj_a.weight"), c->v_heads, hid, &used);
            const size_t conv_dims[3] = {(size_t)cd, 1, (size_t)c->conv_kernel};
            l->conv = tensor(f, path, NAME("linear_attn.conv1d.weight"), 3, conv_dims, &used);
            l->dt_bias = vector(f, path, NAME("linear_attn.dt_bias"), c->v_heads, &used);
            l->a_log = vector(f, path, NAME("linear_attn.A_log"), c->v_heads, &used);
            l->norm = vector(f, path, NAME("linear_attn.norm.weight"), d, &used);
            l->out = matrix(f, path, NAME("linear_attn.out_proj.weight"), hid, vd, &used);
        } else {
            l->q = matrix(f, path, NAME("self_attn.q_proj.weight"), 2 * q, hid, &used);
            l->k = matrix(f, path, NAME("self_attn.k_proj.weight"), kv, hid, &used);
            l->v = matrix(f, path, NAME("self_attn.v_proj.weight"), kv, hid, &used);
            l->o = matrix(f, path, NAME("self_attn.o_proj.weight"), hid, q, &used);
            l->q_norm = vector(f, path, NAME("self_attn.q_norm.weight"), c->head_dim, &used);
            l->k_norm = vector(f, path, NAME("self_attn.k_norm.weight"), c->head_dim, &used);
        }
        l->gate = matrix(f, path, NAME("mlp.gate_proj.weight"), c->mlp, hid, &used);
        l->up = matrix(f, path, NAME("mlp.up_proj.weight"), c->mlp, hid, &used);
        l->down = matrix(f, path, NAME("mlp.down_proj.weight"), hid, c->mlp, &used);
        l->input_norm = vector(f, path, NAME("input_layernorm.weight"), hid, &used);
        l->post_attn_norm = vector(f, path, NAME("post_attention_layernorm.weight"), hid, &used);
#undef NAME
    }
    if ((size_t)used != f->n_tensors)
        die("%s holds %zu tensors, this %d-layer model has %d (a weights file for another shape, or untied?)", path,
            f->n_tensors, c->layers, used);
    if (tb_hybrid_check(m) != TB_OK) die("the model configuration is inconsistent");
}
