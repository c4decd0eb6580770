/* tb_parallel_for, and what the library reports about its own build. */
#include <pthread.h>
#include <stdlib.h>

#include "tb_kernels.h"
#include "tb_parallel.h"
#include "tb_simd.h"

#ifndef TB_SOURCE_HASH
#define TB_SOURCE_HASH "unknown"
#endif

const char *tb_source_hash(void) { return TB_SOURCE_HASH; }
const char *tb_vector_path(void) { return TB_VECTOR_NAME; }

typedef struct {
    tb_range_fn fn;
    void *ctx;
    int begin, end, status;
} range_job;

static void *run_range(void *arg) {
    range_job *job = arg;
    job->status = job->fn(job->ctx, job->begin, job->end);
    return NULL;
}

int tb_parallel_for(int n, int threads, tb_range_fn fn, void *ctx) {
    if (threads > n) threads = n;
    if (threads <= 1) return fn(ctx, 0, n);
    range_job *jobs = calloc((size_t)threads, sizeof *jobs);
    pthread_t *ids = calloc((size_t)threads, sizeof *ids);
    int status = TB_OK, started = 1;
    if (!jobs || !ids) {
        free(jobs), free(ids);
        return TB_E_MEMORY;
    }
    for (int t = 0; t < threads; t++) {
        jobs[t] = (range_job){fn, ctx, (int)((long)n * t / threads), (int)((long)n * (t + 1) / threads), TB_OK};
    }
    for (int t = 1; t < threads; t++, started++) {
        if (pthread_create(&ids[t], NULL, run_range, &jobs[t]) != 0) {
            status = TB_E_THREAD;
            break;
        }
    }
    if (status == TB_OK) run_range(&jobs[0]);
    for (int t = 1; t < started; t++) pthread_join(ids[t], NULL);
    for (int t = 0; t < started && status == TB_OK; t++) status = jobs[t].status;
    free(jobs), free(ids);
    return status;
}
