/* Attention benchmark-and-dump: IN_DIR/{q,k,v,mask}.npy (q [heads, C, hd], k and v
 * [kv_heads, P + C, hd], mask [1, heads, C, P + C]) -> OUT_DIR/out.npy [heads, C, hd] and timings.json.
 *   tb_attention_bench IN OUT [form=chunk|decode_steps] [scale=1/sqrt(hd)] [threads=1] [warmup=1] [reps=1]
 * form=decode_steps runs the same C rows as C calls of one row each, row i against the first P + i + 1
 * keys (the cache filled up to its own position, as an engine's step loop would): the chunk's
 * speedup over decoding, timed in the kernel with no host call in between. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tb_kernels.h"
#include "harness.h"

typedef struct {
    npy_array q, k, v, mask;
    int heads, kv_heads, c, l, hd, threads, decode_steps;
    float scale, *out;
    float *step_q, *step_mask, *step_out; /* per step i: q row [heads, 1, hd], its mask row [heads, 1, P+i+1] */
    size_t *mask_offset;
} attention_job;

static int decode_steps(attention_job *j) {
    int past = j->l - j->c;
    for (int i = 0; i < j->c; i++) {
        int rc = tb_attention(j->heads, j->kv_heads, 1, past + i + 1, j->l, j->hd, j->step_q + (size_t)i * j->heads * j->hd,
                              j->k.data, j->v.data, j->step_mask + j->mask_offset[i], j->scale,
                              j->step_out + (size_t)i * j->heads * j->hd, j->threads);
        if (rc) return rc;
    }
    return TB_OK;
}

/* Lay each step's query row and mask row out contiguously, before anything is timed. */
static void prepare_steps(attention_job *j) {
    int past = j->l - j->c;
    size_t total = 0;
    j->mask_offset = malloc(sizeof(size_t) * j->c);
    if (!j->mask_offset) die("out of memory");
    for (int i = 0; i < j->c; i++) j->mask_offset[i] = total, total += (size_t)j->heads * (past + i + 1);
    j->step_q = malloc(sizeof(float) * j->q.count), j->step_out = malloc(sizeof(float) * j->q.count);
    j->step_mask = malloc(sizeof(float) * total);
    if (!j->step_q || !j->step_out || !j->step_mask) die("out of memory");
    const float *q = j->q.data, *mask = j->mask.data;
    for (int i = 0; i < j->c; i++)
        for (int h = 0; h < j->heads; h++) {
            memcpy(j->step_q + ((size_t)i * j->heads + h) * j->hd, q + ((size_t)h * j->c + i) * j->hd, sizeof(float) * j->hd);
            memcpy(j->step_mask + j->mask_offset[i] + (size_t)h * (past + i + 1), mask + ((size_t)h * j->c + i) * j->l,
                   sizeof(float) * (past + i + 1));
        }
}

static int run(void *arg) {
    attention_job *j = arg;
    if (j->decode_steps) return decode_steps(j);
    return tb_attention(j->heads, j->kv_heads, j->c, j->l, j->l, j->hd, j->q.data, j->k.data, j->v.data, j->mask.data,
                        j->scale, j->out, j->threads);
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"form", "scale", "threads", "warmup", "reps", "cold_mb", NULL};
    args_init(argc, argv, "form=chunk|decode_steps scale=X threads=N warmup=N reps=N cold_mb=N", keys);
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
    const char *form = arg_str("form", "chunk");
    if (strcmp(form, "chunk") && strcmp(form, "decode_steps")) die("form=%s is not chunk or decode_steps", form);
    j.decode_steps = !strcmp(form, "decode_steps");
    if (j.decode_steps) prepare_steps(&j);
    char extra[256];
    snprintf(extra, sizeof extra, "\"form\": \"%s\", \"heads\": %d, \"kv_heads\": %d, \"c\": %d, \"l\": %d, \"hd\": %d, \"threads\": %d",
             form, j.heads, j.kv_heads, j.c, j.l, j.hd, j.threads);
    bench_and_record("tb_attention_bench", "tb_attention", run, &j, extra);
    if (j.decode_steps) /* step i's rows [heads, hd] back into [heads, C, hd] */
        for (int i = 0; i < j.c; i++)
            for (int h = 0; h < j.heads; h++)
                memcpy(j.out + ((size_t)h * j.c + i) * j.hd, j.step_out + ((size_t)i * j.heads + h) * j.hd, sizeof(float) * j.hd);
    npy_save(out_dir(), "out", "<f4", 3, j.q.shape, j.out);
    return 0;
}
