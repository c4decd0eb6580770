/* The matrix product benchmark-and-dump: IN_DIR/{a,b,c}.npy (float32) -> OUT_DIR/c.npy and
 * OUT_DIR/timings.json.
 *   tb_gemm_bench IN OUT [form=gemm|loop] [trans=0|1] [transa=0|1] [accumulate=0|1] [lower=0|1] [threads=1]
 *                [warmup=1] [reps=1]
 * a [M, K], or [K, M] with transa=1 (A given transposed, as K_out^T v_new uses it); b [K, N], or
 * [N, K] with trans=1 (B given transposed, as x W^T and q k^T use it); c [M, N]
 * the C an accumulating product starts from. form=gemm is tb_gemm (kernels/tb_gemm.h: packed panels,
 * the micro-kernel of this CPU or of TB_ISA); form=loop is the reference loop: each element one chain
 * over k in ascending order, written plainly (the summation order tb_gemm promises), so an unfused
 * build must give the same bits from both, and an instruction count of each says what the blocking
 * and the micro-kernel buy on that ISA. Every timed call starts from c (copied in, counted: M N of
 * M N K). lower=1: a is lower triangular (the caller zeroes it above the diagonal). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tb_kernels.h"
#include "../tb_linalg.h"
#include "harness.h"

typedef struct {
    int M, N, K, trans, transa, accumulate, lower, loop;
    const float *a, *b, *c0;
    float *c;
} gemm_job;

/* The reference loop: the same chain per element, no blocking, no packing. */
static void reference_loop(const gemm_job *j) {
    const ptrdiff_t rs = j->trans ? 1 : j->N, cs = j->trans ? j->K : 1;
    const ptrdiff_t ars = j->transa ? 1 : j->K, aks = j->transa ? j->M : 1;
    for (int i = 0; i < j->M; i++)
        for (int n = 0; n < j->N; n++) {
            float s = j->accumulate ? j->c[(size_t)i * j->N + n] : 0.0f;
            for (int k = 0; k < j->K; k++) s = madd1(j->a[i * ars + k * aks], j->b[k * rs + n * cs], s);
            j->c[(size_t)i * j->N + n] = s;
        }
}

static int run(void *arg) {
    gemm_job *j = arg;
    memcpy(j->c, j->c0, sizeof(float) * (size_t)j->M * j->N);
    if (j->loop) {
        reference_loop(j);
    } else if (j->transa) {
        const tb_gemm_b b = {j->b, j->trans ? 1 : j->N, j->trans ? j->K : 1, NULL, NULL};
        tb_gemm_at(j->M, j->N, j->K, j->a, j->M, &b, j->c, j->N, j->accumulate, j->lower);
    } else if (j->trans) gemm_nt(j->M, j->N, j->K, j->a, j->K, j->b, j->K, j->c, j->N, j->accumulate, j->lower);
    else gemm_nn(j->M, j->N, j->K, j->a, j->K, j->b, j->N, j->c, j->N, j->accumulate, j->lower);
    return TB_OK;
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"form",   "trans", "transa",  "accumulate", "lower",
                                       "threads", "warmup", "reps", "cold_mb",    NULL};
    args_init(argc, argv, "form=gemm|loop trans=0|1 transa=0|1 accumulate=0|1 lower=0|1 threads=1 warmup=N reps=N", keys);
    if (arg_int("threads", 1) != 1) die("threads=%ld: tb_gemm is one thread's product (its callers split the work)", arg_int("threads", 1));
    flush_denormals();
    gemm_job j = {0};
    const char *form = arg_str("form", "gemm");
    if (strcmp(form, "gemm") && strcmp(form, "loop")) die("form=%s is not gemm or loop", form);
    j.loop = !strcmp(form, "loop");
    j.trans = arg_int("trans", 0) != 0, j.transa = arg_int("transa", 0) != 0;
    j.accumulate = arg_int("accumulate", 0) != 0, j.lower = arg_int("lower", 0) != 0;
    npy_array a = npy_load(in_dir(), "a", "<f4"), b = npy_load(in_dir(), "b", "<f4"), c = npy_load(in_dir(), "c", "<f4");
    if (a.ndim != 2 || b.ndim != 2 || c.ndim != 2) die("a, b and c must be matrices");
    j.M = (int)a.shape[j.transa ? 1 : 0], j.K = (int)a.shape[j.transa ? 0 : 1], j.N = (int)c.shape[1];
    if ((int)c.shape[0] != j.M || (int)b.shape[j.trans ? 1 : 0] != j.K || b.shape[j.trans ? 0 : 1] != c.shape[1])
        die("shapes do not agree: a [M, K] (transa=1: [K, M]), b [K, N] (trans=1: [N, K]), c [M, N]");
    j.a = a.data, j.b = b.data, j.c0 = c.data;
    if (!(j.c = malloc(sizeof(float) * (c.count ? c.count : 1)))) die("out of memory");
    char extra[256];
    snprintf(extra, sizeof extra, "\"form\": \"%s\", \"M\": %d, \"N\": %d, \"K\": %d, \"trans\": %d, \"transa\": %d, "
             "\"accumulate\": %d, \"lower\": %d", form, j.M, j.N, j.K, j.trans, j.transa, j.accumulate, j.lower);
    bench_and_record("tb_gemm_bench", j.loop ? "reference loop" : "tb_gemm", run, &j, extra);
    size_t shape[2] = {(size_t)j.M, (size_t)j.N};
    npy_save(out_dir(), "c", "<f4", 2, shape, j.c);
    return 0;
}
