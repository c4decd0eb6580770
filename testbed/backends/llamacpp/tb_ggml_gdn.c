/* ggml's own GATED_DELTA_NET, run on the device and dumped, so that testbed's float64 reference can
 * judge it. test-backend-ops compares a backend with ggml's CPU backend; with the CPU backend alone it
 * compares ggml with itself and cannot fail. This program closes that blind spot: it runs the very
 * op ggml's CPU backend computes (ggml_gated_delta_net, one graph node) on inputs testbed drew, and
 * writes what it returned.
 *
 *   tb_ggml_gdn IN_DIR OUT_DIR [K=1] [threads=1] [warmup=0] [reps=1]
 *
 * IN_DIR/{q,k,v,g,beta,state}.npy in refimpl.gdn's layout (float32), which is ggml's memory layout
 * with the axes reversed (q [n_seqs, T, H_k, d] is ggml's [d, H_k, T, n_seqs]), so the bytes are
 * copied as they are. OUT_DIR receives out.npy [n_seqs, T, H_v, d], state.npy [n_seqs, H_v, d, d]
 * (the final state, ggml's snapshot slot 0), for K > 1 snapshots.npy [min(K, T), n_seqs, H_v, d, d]
 * (slot s = the state s tokens before the end), and timings.json (kernels/bench/harness.c). */
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml.h"

#include "bench/harness.h"

typedef struct {
    struct ggml_cgraph *graph;
    struct ggml_cplan plan;
} ggml_job;

static int compute(void *arg) {
    ggml_job *job = arg;
    return ggml_graph_compute(job->graph, &job->plan) == GGML_STATUS_SUCCESS ? 0 : 1;
}

/* A ggml tensor holding a .npy array: ggml's ne is the numpy shape reversed. */
static struct ggml_tensor *tensor_from(struct ggml_context *ctx, const npy_array *a) {
    if (a->ndim < 1 || a->ndim > 4) die("an input has %d dimensions; ggml tensors have 1 to 4", a->ndim);
    int64_t ne[4] = {1, 1, 1, 1};
    for (int i = 0; i < a->ndim; i++) ne[i] = (int64_t)a->shape[a->ndim - 1 - i];
    struct ggml_tensor *t = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, ne);
    memcpy(t->data, a->data, sizeof(float) * a->count);
    return t;
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"K", "threads", "warmup", "reps", NULL};
    args_init(argc, argv, "K=N threads=N warmup=N reps=N", keys);
    long K = arg_int("K", 1), threads = arg_int("threads", 1);
    if (K < 1 || threads < 1) die("K=%ld and threads=%ld must both be >= 1", K, threads);

    npy_array q = npy_load(in_dir(), "q", "<f4"), k = npy_load(in_dir(), "k", "<f4"), v = npy_load(in_dir(), "v", "<f4");
    npy_array g = npy_load(in_dir(), "g", "<f4"), beta = npy_load(in_dir(), "beta", "<f4");
    npy_array state = npy_load(in_dir(), "state", "<f4");
    if (q.ndim != 4 || v.ndim != 4 || state.ndim != 4) die("q, v and state must have 4 dimensions (see refimpl/gdn.py)");
    size_t n_seqs = v.shape[0], tokens = v.shape[1], h_v = v.shape[2], d = v.shape[3];

    /* refimpl's g and beta have no unit axis for the scalar gate: [n_seqs, T, H_v] is ggml's
     * [1, H_v, T, n_seqs] once a leading 1 is put back. */
    size_t g_shape[4] = {n_seqs, tokens, h_v, g.ndim == 4 ? d : 1}, beta_shape[4] = {n_seqs, tokens, h_v, 1};
    g.ndim = beta.ndim = 4;
    memcpy(g.shape, g_shape, sizeof g_shape), memcpy(beta.shape, beta_shape, sizeof beta_shape);

    size_t inputs = q.count + k.count + v.count + g.count + beta.count + state.count;
    size_t result = d * h_v * (tokens * n_seqs + (size_t)K * d * n_seqs);
    struct ggml_init_params params = {
        .mem_size = sizeof(float) * (inputs + result) + 8 * ggml_tensor_overhead() + ggml_graph_overhead() + (1 << 20),
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) die("ggml_init could not allocate %zu bytes", params.mem_size);
    struct ggml_tensor *out = ggml_gated_delta_net(ctx, tensor_from(ctx, &q), tensor_from(ctx, &k), tensor_from(ctx, &v),
                                                   tensor_from(ctx, &g), tensor_from(ctx, &beta),
                                                   tensor_from(ctx, &state), K);
    ggml_job job = {ggml_new_graph(ctx)};
    ggml_build_forward_expand(job.graph, out);
    job.plan = ggml_graph_plan(job.graph, (int)threads, NULL);
    job.plan.work_data = job.plan.work_size ? malloc(job.plan.work_size) : NULL;
    if (job.plan.work_size && !job.plan.work_data) die("out of memory for ggml's work buffer");

    char extra[160];
    snprintf(extra, sizeof extra, "\"K\": %ld, \"threads\": %ld, \"tokens\": %zu, \"heads\": %zu, \"d\": %zu, \"kda\": %d",
             K, threads, tokens, h_v, d, g.shape[3] != 1);
    bench_and_record("tb_ggml_gdn", "ggml_gated_delta_net (ggml CPU backend)", compute, &job, extra);

    /* ggml's result packs the outputs [n_seqs, T, H_v, d], then K state slots of [n_seqs, H_v, d, d];
     * when T < K only the first T slots are written. */
    const float *packed = out->data;
    size_t slots = (size_t)K < tokens ? (size_t)K : tokens;
    size_t out_shape[4] = {n_seqs, tokens, h_v, d}, state_shape[4] = {n_seqs, h_v, d, d};
    size_t snapshots_shape[5] = {slots, n_seqs, h_v, d, d};
    const float *states = packed + n_seqs * tokens * h_v * d;
    npy_save(out_dir(), "out", "<f4", 4, out_shape, packed);
    npy_save(out_dir(), "state", "<f4", 4, state_shape, states);
    if (K > 1) npy_save(out_dir(), "snapshots", "<f4", 5, snapshots_shape, states);
    ggml_free(ctx);
    free(job.plan.work_data);
    return 0;
}
