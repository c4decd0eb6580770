/* my_engine.c: my_engine.h over testbed's own model engine (kernels/tb_model.h), compiled in whole (the
 * lab's folder holds this file alone; its Makefile's -I names testbed's kernels/). The caches keep every row
 * (the sliding window is the mask's, as llama.cpp's swa_full cache), so a rollback is a drop of the newest
 * rows; every call is computed as n_batch rows (the rest pads, never kept), so a row's bytes do not depend on
 * how many rows shared its call and a padded tail rolled back equals the unpadded one byte for byte. */
#define _POSIX_C_SOURCE 200809L
#include "my_engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/harness.h"
#include "bench/model_load.h"
#include "tb_model.h"

struct my_engine {
    tb_model model;
    st_file file;
    tb_engine *engine;
    int n_batch;
    long length; /* positions held */
};

my_engine *my_engine_load(const char *model, const char *const *config, int n_ctx, int n_batch) {
    static const char *const keys[] = {TB_MODEL_KEYS, NULL};
    static char weights[4096], *args[64] = {"my_engine", ".", ".", weights};
    int n = 4;
    snprintf(weights, sizeof weights, "weights=%s", model);
    for (; config[n - 4] && n < 63; n++) args[n] = (char *)config[n - 4];
    args[n] = NULL;
    args_init(n, args, "(the model's shape)", keys);
    my_engine *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    load_model(&e->model, &e->file);
    tb_engine_options o = {TB_F32, 32, 0, 0, n_ctx + n_batch, n_batch, 1};
    if (tb_engine_create(&e->model, &o, &e->engine) != TB_OK) return free(e), NULL;
    e->n_batch = n_batch;
    return e;
}

int my_engine_vocab(const my_engine *e) { return e->model.cfg.vocab; }

int my_engine_decode(my_engine *e, const int *tokens, int n, long pos, int row, float *logits) {
    if (pos != e->length || n < 1 || n > e->n_batch) return -1;
    int rc = tb_model_prefill_with_past(e->engine, (const int32_t *)tokens, n, e->n_batch, pos, n, row < 0 ? 0 : row,
                                        row < 0 ? NULL : logits);
    if (rc == TB_OK) e->length += n;
    return rc;
}

int my_engine_rollback(my_engine *e, long pos) {
    if (pos < 0 || pos > e->length) return -1;
    if (pos == 0) tb_engine_clear(e->engine);
    else if (tb_engine_drop(e->engine, (int)(e->length - pos)) != TB_OK) return -1;
    e->length = pos;
    return 0;
}

size_t my_engine_state(my_engine *e, void *buf, size_t size) {
    const tb_model_config *c = &e->model.cfg;
    const size_t plane = (size_t)c->kv_heads * e->length * c->head_dim;
    const size_t total = (size_t)c->layers * (2 * plane * sizeof(float) + e->length * sizeof(int64_t));
    if (!buf || size < total) return total;
    char *at = buf;
    float *k = malloc(sizeof(float) * (plane ? plane : 1)), *v = malloc(sizeof(float) * (plane ? plane : 1));
    for (int i = 0; k && v && i < c->layers; i++) {  /* per layer: K, V [kv_heads, rows, head_dim], positions */
        tb_kv_read(tb_engine_cache(e->engine, i), k, v, (int64_t *)(at + 2 * plane * sizeof(float)), (int)e->length);
        memcpy(at, k, plane * sizeof(float));
        memcpy(at + plane * sizeof(float), v, plane * sizeof(float));
        at += 2 * plane * sizeof(float) + e->length * sizeof(int64_t);
    }
    free(k), free(v);
    return total;
}

/* testbed's model engine itself, compiled in (a lab links its own engine instead); model.c names an older POSIX */
#include "attention.c"
#include "gdn.c"
#include "gemm.c"
#include "gemm_avx2.c"
#include "gemm_avx512.c"
#undef _POSIX_C_SOURCE
#include "model.c"
#include "model_cache.c"
#include "model_prefill.c"
#include "sliding_cache.c"
#include "bench/model_load.c"
#include "bench/safetensors.c"
