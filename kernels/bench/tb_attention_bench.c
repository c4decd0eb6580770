/* Attention benchmark-and-dump: IN_DIR/{q,k,v,mask}.npy (q [heads, C, hd], k and v
 * [kv_heads, P + C, hd], mask [1, heads, C, P + C]) -> OUT_DIR/out.npy [heads, C, hd] and timings.json.
 *   tb_attention_bench IN OUT [scale=1/sqrt(hd)] [threads=1] [warmup=1] [reps=1] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../tb_kernels.h"
#include "harness.h"

typedef struct {
    npy_array q, k, v, mask;
    int heads, kv_heads, c, l, hd, threads;
    float scale, *out;
} attention_job;

static int run(void *arg) {
    attention_job *j = arg;
    return tb_attention(j->heads, j->kv_heads, j->c, j->l, j->l, j->hd, j->q.data, j->k.data, j->v.data, j->mask.data,
                        j->scale, j->out, j->threads);
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"scale", "threads", "warmup", "reps", NULL};
    args_init(argc, argv, "scale=X threads=N warmup=N reps=N", keys);
    flush_denormals();
    attention_job j = {0};
    j.q = npy_load(in_dir(), "q", "<f4"), j.k = npy_load(in_dir(), "k", "<f4"), j.v = npy_load(in_dir(), "v", "<f4");
    j.mask = npy_load(in_dir(), "mask", "<f4");
    if (j.q.ndim != 3 || j.k.ndim != 3) die("q must be [heads, C, hd] and k, v [kv_heads, P + C, hd]");
    j.heads = (int)j.q.shape[0], j.c = (int)j.q.shape[1], j.hd = (int)j.q.shape[2];
    j.kv_heads = (int)j.k.shape[0], j.l = (int)j.k.shape[1];
    if (j.v.count != j.k.count || j.mask.count != (size_t)j.heads * j.c * j.l) die("k, v and mask shapes do not agree");
    j.scale = (float)arg_float("scale", 1.0 / sqrt((double)j.hd));
    j.threads = (int)arg_int("threads", 1);
    j.out = malloc(sizeof(float) * j.q.count);
    if (!j.out) die("out of memory");
    char extra[256];
    snprintf(extra, sizeof extra, "\"heads\": %d, \"kv_heads\": %d, \"c\": %d, \"l\": %d, \"hd\": %d, \"threads\": %d",
             j.heads, j.kv_heads, j.c, j.l, j.hd, j.threads);
    bench_and_record("tb_attention_bench", "tb_attention", run, &j, extra);
    npy_save(out_dir(), "out", "<f4", 3, j.q.shape, j.out);
    return 0;
}
