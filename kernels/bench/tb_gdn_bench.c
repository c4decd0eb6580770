/* GDN benchmark-and-dump: IN_DIR/{q,k,v,g,beta,state}.npy (refimpl.gdn layout, float32) ->
 * OUT_DIR/out.npy, OUT_DIR/state.npy and OUT_DIR/timings.json.
 *   tb_gdn_bench IN OUT [form=serial|chunkwise|serial-chunk-loop] [chunk=64|auto] [head_map=tiled|interleaved]
 *                [threads=1] [warmup=1] [reps=1]
 * serial-chunk-loop is the serial recurrence restructured as a loop over chunks of `chunk` tokens that
 * carries the state from one call to the next: the same arithmetic in the same order, so it must give
 * the bits of one serial call (the bit-exact oracle of a pure loop restructuring). chunk=auto: the size
 * measured fastest for the head size (tb_gdn_auto_chunk); timings.json records the chunk used. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tb_kernels.h"
#include "harness.h"

typedef struct {
    tb_gdn_shape shape;
    npy_array q, k, v, g, beta, state;
    float *out, *state_out;
    int chunkwise, chunk_loop, chunk, threads;
} gdn_job;

/* Tokens [t0, t0 + len) of a contiguous [n_seqs, T, row] array, as a contiguous [n_seqs, len, row]
 * one (to_chunk) or back (from_chunk). */
static void copy_tokens(float *full, float *part, int n_seqs, int tokens, int t0, int len, size_t row, int to_chunk) {
    for (int s = 0; s < n_seqs; s++) {
        float *f = full + ((size_t)s * tokens + t0) * row, *c = part + (size_t)s * len * row;
        memcpy(to_chunk ? c : f, to_chunk ? f : c, sizeof(float) * len * row);
    }
}

static int serial_chunk_loop(gdn_job *j) {
    const tb_gdn_shape *s = &j->shape;
    size_t qk_row = (size_t)s->h_k * s->d, v_row = (size_t)s->h_v * s->d;
    size_t g_row = (size_t)s->h_v * (s->kda ? s->d : 1), beta_row = s->h_v;
    size_t n = (size_t)s->n_seqs * j->chunk, state_n = (size_t)s->n_seqs * s->h_v * s->d * s->d;
    float *q = malloc(sizeof(float) * n * qk_row), *k = malloc(sizeof(float) * n * qk_row);
    float *v = malloc(sizeof(float) * n * v_row), *o = malloc(sizeof(float) * n * v_row);
    float *g = malloc(sizeof(float) * n * g_row), *beta = malloc(sizeof(float) * n * beta_row);
    int rc = (q && k && v && o && g && beta) ? TB_OK : TB_E_MEMORY;
    if (rc == TB_OK) memcpy(j->state_out, j->state.data, sizeof(float) * state_n);
    for (int t0 = 0; rc == TB_OK && t0 < s->tokens; t0 += j->chunk) {
        int len = s->tokens - t0 < j->chunk ? s->tokens - t0 : j->chunk;
        copy_tokens(j->q.data, q, s->n_seqs, s->tokens, t0, len, qk_row, 1);
        copy_tokens(j->k.data, k, s->n_seqs, s->tokens, t0, len, qk_row, 1);
        copy_tokens(j->v.data, v, s->n_seqs, s->tokens, t0, len, v_row, 1);
        copy_tokens(j->g.data, g, s->n_seqs, s->tokens, t0, len, g_row, 1);
        copy_tokens(j->beta.data, beta, s->n_seqs, s->tokens, t0, len, beta_row, 1);
        tb_gdn_shape part = *s;
        part.tokens = len;
        ptrdiff_t qk[3] = {(ptrdiff_t)len * qk_row, (ptrdiff_t)qk_row, s->d}, vv[3] = {(ptrdiff_t)len * v_row, (ptrdiff_t)v_row, s->d};
        memcpy(part.q_stride, qk, sizeof qk), memcpy(part.k_stride, qk, sizeof qk), memcpy(part.v_stride, vv, sizeof vv);
        rc = tb_gdn_serial(&part, q, k, v, g, beta, j->state_out, o, j->state_out, j->threads);
        copy_tokens(j->out, o, s->n_seqs, s->tokens, t0, len, v_row, 0);
    }
    free(q), free(k), free(v), free(o), free(g), free(beta);
    return rc;
}

static int run(void *arg) {
    gdn_job *j = arg;
    if (j->chunk_loop) return serial_chunk_loop(j);
    if (j->chunkwise)
        return tb_gdn_chunkwise(&j->shape, j->q.data, j->k.data, j->v.data, j->g.data, j->beta.data, j->state.data,
                                j->out, j->state_out, j->chunk, j->threads);
    return tb_gdn_serial(&j->shape, j->q.data, j->k.data, j->v.data, j->g.data, j->beta.data, j->state.data, j->out,
                         j->state_out, j->threads);
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"form", "chunk", "head_map", "threads", "warmup", "reps", "cold_mb", NULL};
    args_init(argc, argv, "form=serial|chunkwise|serial-chunk-loop chunk=N head_map=tiled|interleaved threads=N warmup=N reps=N cold_mb=N", keys);
    flush_denormals();
    gdn_job j = {0};
    const char *form = arg_str("form", "chunkwise"), *head_map = arg_str("head_map", "tiled");
    if (strcmp(form, "serial") && strcmp(form, "chunkwise") && strcmp(form, "serial-chunk-loop"))
        die("form=%s is not serial, chunkwise or serial-chunk-loop", form);
    if (strcmp(head_map, "tiled") && strcmp(head_map, "interleaved")) die("head_map=%s is not tiled or interleaved", head_map);
    j.chunkwise = !strcmp(form, "chunkwise"), j.chunk_loop = !strcmp(form, "serial-chunk-loop");
    const int auto_chunk = !strcmp(arg_str("chunk", "64"), "auto");
    j.chunk = auto_chunk ? 0 : (int)arg_int("chunk", 64);
    if (j.chunk < 1 && !auto_chunk) die("chunk=%d must be >= 1 (or auto)", j.chunk);
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
    if (auto_chunk) j.chunk = j.chunkwise ? tb_gdn_auto_chunk(s->d) : 64;
    char extra[256];
    snprintf(extra, sizeof extra, "\"form\": \"%s\", \"chunk\": %d, \"chunk_auto\": %d, \"threads\": %d, \"tokens\": %d, "
             "\"heads\": %d, \"d\": %d, \"kda\": %d", form, j.chunk, auto_chunk, j.threads, s->tokens, s->h_v, s->d, s->kda);
    bench_and_record("tb_gdn_bench", j.chunkwise ? "tb_gdn_chunkwise" : j.chunk_loop ? "tb_gdn_serial (chunk loop)" : "tb_gdn_serial", run, &j, extra);
    size_t out_shape[4] = {(size_t)s->n_seqs, (size_t)s->tokens, (size_t)s->h_v, (size_t)s->d};
    size_t state_shape[4] = {(size_t)s->n_seqs, (size_t)s->h_v, (size_t)s->d, (size_t)s->d};
    npy_save(out_dir(), "out", "<f4", 4, out_shape, j.out);
    npy_save(out_dir(), "state", "<f4", 4, state_shape, j.state_out);
    return 0;
}
