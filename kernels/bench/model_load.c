/* The model engine's weights and shape from the harness's arguments (model_load.h). */
#include "model_load.h"

#include <stdio.h>
#include <string.h>

#include "harness.h"

static const char *const DTYPES[] = {"f32", "f16", "int8"};
static const char *const ST_DTYPES[] = {"F32", "F16", "I8"};

int dtype_arg(const char *key, const char *fallback) {
    const char *s = arg_str(key, fallback);
    for (int d = 0; d < 3; d++)
        if (!strcmp(s, DTYPES[d])) return d;
    die("%s=%s is not one of f32, f16, int8", key, s);
    return 0;
}

long positive(const char *key, long fallback, long least) {
    long v = arg_int(key, fallback);
    if (v < least) die("%s=%ld is out of range (at least %ld)", key, v, least);
    return v;
}

/* --- weights --------------------------------------------------------------------------------------- */

static const st_tensor *tensor(const st_file *f, const char *path, const char *name, const char *dtype, size_t rows,
                               size_t cols, int *used) {
    const st_tensor *t = st_find(f, name);
    if (!t) die("%s: tensor %s is missing (a weights file for another model?)", path, name);
    if (strcmp(t->dtype, dtype)) die("%s: tensor %s is %s, expected %s", path, name, t->dtype, dtype);
    const int ndim = cols ? 2 : 1;
    if (t->ndim != ndim || t->shape[0] != rows || (cols && t->shape[1] != cols))
        die("%s: tensor %s has shape [%zu%s%zu], expected [%zu%s%zu] (a weights file for another shape?)", path, name,
            t->shape[0], t->ndim > 1 ? ", " : "", t->ndim > 1 ? t->shape[1] : (size_t)0, rows, cols ? ", " : "",
            cols ? cols : (size_t)0);
    (*used)++;
    return t;
}

static tb_matrix matrix(const st_file *f, const char *path, const char *name, int rows, int cols, int dtype, int group,
                        int *used) {
    tb_matrix m = {dtype, rows, cols, group, NULL, NULL};
    m.data = tensor(f, path, name, ST_DTYPES[dtype], (size_t)rows, (size_t)cols, used)->data;
    if (dtype == TB_INT8) {
        char scale_name[256];
        snprintf(scale_name, sizeof scale_name, "%s_scale", name);
        m.scales = tensor(f, path, scale_name, "F32", (size_t)rows, (size_t)(cols / group), used)->data;
    }
    return m;
}

static const float *vector(const st_file *f, const char *path, const char *name, int n, int *used) {
    return tensor(f, path, name, "F32", (size_t)n, 0, used)->data;
}

void load_model(tb_model *m, st_file *f) {
    tb_model_config *c = &m->cfg;
    memset(m, 0, sizeof *m);
    c->vocab = (int)positive("vocab", 0, 1), c->hidden = (int)positive("hidden", 0, 1);
    c->layers = (int)positive("layers", 0, 1), c->heads = (int)positive("heads", 0, 1);
    c->kv_heads = (int)positive("kv_heads", 0, 1), c->head_dim = (int)positive("head_dim", 0, 2);
    c->mlp = (int)positive("mlp", 0, 1), c->window = (int)positive("window", 0, 1);
    c->rope_local = arg_float("rope_local", 10000.0), c->rope_global = arg_float("rope_global", 1000000.0);
    c->rope_global_scaling = arg_float("rope_global_scaling", 1.0);
    if (!(c->rope_global_scaling > 0.0)) die("rope_global_scaling=%g must be > 0", c->rope_global_scaling);
    c->attn_scale = (float)arg_float("attn_scale", 0.0), c->rms_eps = (float)arg_float("eps", 1e-6);
    c->softcap = (float)arg_float("softcap", 0.0);
    const char *types = arg_str("types", "");
    if (c->layers > TB_MAX_LAYERS || (int)strlen(types) != c->layers || strspn(types, "LG") != strlen(types))
        die("types=%s must give L (local) or G (global) for each of the %d layers", types, c->layers);
    for (int i = 0; i < c->layers; i++) c->layer_type[i] = types[i] == 'G' ? TB_GLOBAL : TB_LOCAL;
    if (c->attn_scale <= 0.0f) die("attn_scale must be given and positive");

    const char *path = arg_str("weights", NULL);
    if (!path) die("weights=FILE is required");
    char err[512];
    if (st_open(path, f, err, sizeof err)) die("%s", err);
    const int wd = dtype_arg("wdtype", "f32"), group = (int)positive("wgroup", 32, 1);
    if (wd == TB_INT8 && (c->hidden % group || c->mlp % group || (c->heads * c->head_dim) % group))
        die("wgroup=%d must divide hidden, mlp and heads * head_dim", group);
    const int q = c->heads * c->head_dim, kv = c->kv_heads * c->head_dim;
    int used = 0;
    m->embed = matrix(f, path, "model.embed_tokens.weight", c->vocab, c->hidden, wd, group, &used);
    m->final_norm = vector(f, path, "model.norm.weight", c->hidden, &used);
    for (int i = 0; i < c->layers; i++) {
        tb_layer_weights *l = &m->layer[i];
        char n[256];
#define NAME(suffix) (snprintf(n, sizeof n, "model.layers.%d.%s", i, suffix), n)
        l->q = matrix(f, path, NAME("self_attn.q_proj.weight"), q, c->hidden, wd, group, &used);
        l->k = matrix(f, path, NAME("self_attn.k_proj.weight"), kv, c->hidden, wd, group, &used);
        l->v = matrix(f, path, NAME("self_attn.v_proj.weight"), kv, c->hidden, wd, group, &used);
        l->o = matrix(f, path, NAME("self_attn.o_proj.weight"), c->hidden, q, wd, group, &used);
        l->gate = matrix(f, path, NAME("mlp.gate_proj.weight"), c->mlp, c->hidden, wd, group, &used);
        l->up = matrix(f, path, NAME("mlp.up_proj.weight"), c->mlp, c->hidden, wd, group, &used);
        l->down = matrix(f, path, NAME("mlp.down_proj.weight"), c->hidden, c->mlp, wd, group, &used);
        l->q_norm = vector(f, path, NAME("self_attn.q_norm.weight"), c->head_dim, &used);
        l->k_norm = vector(f, path, NAME("self_attn.k_norm.weight"), c->head_dim, &used);
        l->input_norm = vector(f, path, NAME("input_layernorm.weight"), c->hidden, &used);
        l->post_attn_norm = vector(f, path, NAME("post_attention_layernorm.weight"), c->hidden, &used);
        l->pre_ff_norm = vector(f, path, NAME("pre_feedforward_layernorm.weight"), c->hidden, &used);
        l->post_ff_norm = vector(f, path, NAME("post_feedforward_layernorm.weight"), c->hidden, &used);
#undef NAME
    }
    if ((size_t)used != f->n_tensors)
        die("%s holds %zu tensors, a %d-layer model has %d (a weights file for another shape?)", path, f->n_tensors,
            c->layers, used);
    if (tb_model_check(m) != TB_OK) die("the model configuration is inconsistent");
}

