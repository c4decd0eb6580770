/* GDN benchmark-and-dump: IN_DIR/{q,k,v,g,beta,state}.npy (refimpl.gdn layout, float32) ->
 * OUT_DIR/out.npy, OUT_DIR/state.npy and OUT_DIR/timings.json.
 *   tb_gdn_bench IN OUT [form=serial|chunkwise] [chunk=64] [head_map=tiled|interleaved] [threads=1]
 *                [warmup=1] [reps=1] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tb_kernels.h"
#include "harness.h"

typedef struct {
    tb_gdn_shape shape;
    npy_array q, k, v, g, beta, state;
    float *out, *state_out;
    int chunkwise, chunk, threads;
} gdn_job;

static int run(void *arg) {
    gdn_job *j = arg;
    if (j->chunkwise)
        return tb_gdn_chunkwise(&j->shape, j->q.data, j->k.data, j->v.data, j->g.data, j->beta.data, j->state.data,
                                j->out, j->state_out, j->chunk, j->threads);
    return tb_gdn_serial(&j->shape, j->q.data, j->k.data, j->v.data, j->g.data, j->beta.data, j->state.data, j->out,
                         j->state_out, j->threads);
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"form", "chunk", "head_map", "threads", "warmup", "reps", NULL};
    args_init(argc, argv, "form=serial|chunkwise chunk=N head_map=tiled|interleaved threads=N warmup=N reps=N", keys);
    flush_denormals();
    gdn_job j = {0};
    const char *form = arg_str("form", "chunkwise"), *head_map = arg_str("head_map", "tiled");
    if (strcmp(form, "serial") && strcmp(form, "chunkwise")) die("form=%s is not serial or chunkwise", form);
    if (strcmp(head_map, "tiled") && strcmp(head_map, "interleaved")) die("head_map=%s is not tiled or interleaved", head_map);
    j.chunkwise = !strcmp(form, "chunkwise");
    j.chunk = (int)arg_int("chunk", 64);
    j.threads = (int)arg_int("threads", 1);
    j.q = npy_load(in_dir(), "q", "<f4"), j.k = npy_load(in_dir(), "k", "<f4"), j.v = npy_load(in_dir(), "v", "<f4");
    j.g = npy_load(in_dir(), "g", "<f4"), j.beta = npy_load(in_dir(), "beta", "<f4");
    j.state = npy_load(in_dir(), "state", "<f4");
    if (j.q.ndim != 4 || j.v.ndim != 4) die("q and v must be [n_seqs, T, H, d]");
    tb_gdn_shape *s = &j.shape;
    s->n_seqs = (int)j.q.shape[0], s->tokens = (int)j.q.shape[1], s->h_k = (int)j.q.shape[2], s->d = (int)j.q.shape[3];
    s->h_v = (int)j.v.shape[2], s->kda = j.g.ndim == 4;
    s->head_map = strcmp(head_map, "tiled") ? TB_HEAD_MAP_INTERLEAVED : TB_HEAD_MAP_TILED;
    ptrdiff_t qk[3] = {(ptrdiff_t)s->tokens * s->h_k * s->d, (ptrdiff_t)s->h_k * s->d, s->d};
    ptrdiff_t vv[3] = {(ptrdiff_t)s->tokens * s->h_v * s->d, (ptrdiff_t)s->h_v * s->d, s->d};
    memcpy(s->q_stride, qk, sizeof qk), memcpy(s->k_stride, qk, sizeof qk), memcpy(s->v_stride, vv, sizeof vv);
    size_t out_n = (size_t)s->n_seqs * s->tokens * s->h_v * s->d, state_n = (size_t)s->n_seqs * s->h_v * s->d * s->d;
    if (j.k.count != j.q.count || j.v.count != out_n || j.state.count != state_n ||
        j.beta.count != (size_t)s->n_seqs * s->tokens * s->h_v || j.g.count != j.beta.count * (s->kda ? (size_t)s->d : 1))
        die("input shapes do not agree (see refimpl/gdn.py for the layout)");
    j.out = malloc(sizeof(float) * out_n), j.state_out = malloc(sizeof(float) * state_n);
    if (!j.out || !j.state_out) die("out of memory");
    char extra[256];
    snprintf(extra, sizeof extra, "\"form\": \"%s\", \"chunk\": %d, \"threads\": %d, \"tokens\": %d, \"heads\": %d, \"d\": %d, \"kda\": %d",
             form, j.chunk, j.threads, s->tokens, s->h_v, s->d, s->kda);
    bench_and_record("tb_gdn_bench", j.chunkwise ? "tb_gdn_chunkwise" : "tb_gdn_serial", run, &j, extra);
    size_t out_shape[4] = {(size_t)s->n_seqs, (size_t)s->tokens, (size_t)s->h_v, (size_t)s->d};
    size_t state_shape[4] = {(size_t)s->n_seqs, (size_t)s->h_v, (size_t)s->d, (size_t)s->d};
    npy_save(out_dir(), "out", "<f4", 4, out_shape, j.out);
    npy_save(out_dir(), "state", "<f4", 4, state_shape, j.state_out);
    return 0;
}
