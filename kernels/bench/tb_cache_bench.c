/* Sliding-cache benchmark-and-dump: IN_DIR/cache.npy (uint8 [planes, window, row_bytes], `count` rows
 * held) and IN_DIR/rows.npy (uint8 [planes, n_real + n_pad, row_bytes]: the real rows, then the pads).
 * Writes OUT_DIR/exact.npy (after appending the real rows alone) and OUT_DIR/rolled.npy (after
 * snapshot, padded append and rollback), each the whole cache [planes, window, row_bytes];
 * OUT_DIR/saved.npy (the snapshot) and timings.json with seconds per operation and row counts. Each
 * operation of a timed repetition is a marked region for the instruction counters, in the order of
 * OPS ("marks" in timings.json).
 *   tb_cache_bench IN OUT count=N sink=N n_pad=N [empty_byte=0] [warmup=1] [reps=1] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tb_kernels.h"
#include "harness.h"

/* Every slot of every plane, held or not: what byte-identical compares. */
static void save_cache(const char *name, const tb_sliding_cache *c) {
    size_t shape[3] = {(size_t)c->planes, (size_t)c->window, c->row_bytes};
    npy_save(out_dir(), name, "|u1", 3, shape, c->rows);
}

static void print_seconds(FILE *f, const char *name, const double *s, long n, int last) {
    fprintf(f, "\"%s\": [", name);
    for (long i = 0; i < n; i++) fprintf(f, "%s%.9g", i ? ", " : "", s[i]);
    fprintf(f, "]%s", last ? "" : ", ");
}

/* One operation's timed region: its clock starts, then (in a timed repetition, s not NULL) the
 * counters' region; op_end closes both, the region first, and stores the seconds in s[op]. */
static double op_begin(const double *s) {
    double t0 = now_seconds();
    if (s) tb_count_begin();
    return t0;
}
static void op_end(double *s, int op, double t0) {
    if (!s) return;
    tb_count_end();
    s[op] = now_seconds() - t0;
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"count", "sink", "n_pad", "empty_byte", "warmup", "reps", NULL};
    args_init(argc, argv, "count=N sink=N n_pad=N empty_byte=0..255 warmup=N reps=N", keys);
    npy_array cache = npy_load(in_dir(), "cache", "|u1"), rows = npy_load(in_dir(), "rows", "|u1");
    if (cache.ndim != 3 || rows.ndim != 3 || rows.shape[0] != cache.shape[0] || rows.shape[2] != cache.shape[2])
        die("cache must be [planes, window, row_bytes] and rows [planes, n, row_bytes]");
    const int n_pad = (int)arg_int("n_pad", 0), n_all = (int)rows.shape[1], n_real = n_all - n_pad;
    if (n_pad < 0 || n_real < 0) die("n_pad=%d is not within 0..%d", n_pad, n_all);
    tb_sliding_cache pristine = {cache.data, cache.shape[2], (int)cache.shape[0], (int)cache.shape[1],
                                 (int)arg_int("sink", 0), (int)arg_int("count", 0), (uint8_t)arg_int("empty_byte", 0)};
    const size_t bytes = cache.count, rb = pristine.row_bytes;
    uint8_t *work = malloc(bytes), *real = malloc((size_t)pristine.planes * (n_real ? n_real : 1) * rb);
    uint8_t *saved = malloc((size_t)pristine.planes * (n_pad ? n_pad : 1) * rb);
    if (!work || !real || !saved) die("out of memory");
    for (int p = 0; p < pristine.planes; p++)
        memcpy(real + (size_t)p * n_real * rb, (uint8_t *)rows.data + (size_t)p * n_all * rb, (size_t)n_real * rb);

    static const char *const OPS[4] = {"exact_append", "snapshot", "padded_append", "rollback"};
    long warmup = arg_int("warmup", 1), reps = arg_int("reps", 1);
    if (warmup < 0 || reps < 1) die("warmup must be >= 0 and reps >= 1");
    double *t = calloc((size_t)(4 * reps), sizeof(double));
    if (!t) die("out of memory");
    tb_sliding_cache exact, padded;
    int n_saved = 0;
    for (long r = -warmup; r < reps; r++) {
        double *s = r >= 0 ? t + 4 * r : NULL, t0; /* s: this timed repetition's seconds (NULL: warm-up) */
        memcpy(work, cache.data, bytes), exact = pristine, exact.rows = work;
        t0 = op_begin(s);
        if (tb_cache_append(&exact, real, n_real)) die("exact append rejected");
        op_end(s, 0, t0);
        if (r == reps - 1) save_cache("exact", &exact);

        memcpy(work, cache.data, bytes), padded = pristine, padded.rows = work;
        t0 = op_begin(s);
        if (tb_cache_snapshot(&padded, n_real, n_pad, saved, &n_saved)) die("snapshot rejected (padding guard)");
        op_end(s, 1, t0);
        t0 = op_begin(s);
        if (tb_cache_append(&padded, rows.data, n_all)) die("padded append rejected");
        op_end(s, 2, t0);
        t0 = op_begin(s);
        if (tb_cache_rollback(&padded, n_pad, saved, n_saved)) die("rollback rejected");
        op_end(s, 3, t0);
    }
    save_cache("rolled", &padded);
    size_t saved_shape[3] = {(size_t)pristine.planes, (size_t)n_saved, rb};
    uint8_t *compact = malloc((size_t)pristine.planes * (n_saved ? n_saved : 1) * rb);
    if (!compact) die("out of memory");
    for (int p = 0; p < pristine.planes; p++)
        memcpy(compact + (size_t)p * n_saved * rb, saved + (size_t)p * n_pad * rb, (size_t)n_saved * rb);
    npy_save(out_dir(), "saved", "|u1", 3, saved_shape, compact);

    char path[4096];
    snprintf(path, sizeof path, "%s/timings.json", out_dir());
    FILE *f = fopen(path, "w");
    if (!f) die("cannot write %s", path);
    fprintf(f, "{\"program\": \"tb_cache_bench\", \"vector_path\": \"%s\", \"source_hash\": \"%s\", \"warmup\": %ld, "
               "\"reps\": %ld, \"n_saved\": %d, \"count_exact\": %d, \"count_rolled\": %d, "
               "\"marks\": [\"%s\", \"%s\", \"%s\", \"%s\"], \"seconds\": {",
            tb_vector_path(), tb_source_hash(), warmup, reps, n_saved, exact.count, padded.count, OPS[0], OPS[1], OPS[2],
            OPS[3]);
    for (int op = 0; op < 4; op++) {
        double *col = malloc(sizeof(double) * (size_t)reps);
        for (long r = 0; r < reps; r++) col[r] = t[4 * r + op];
        print_seconds(f, OPS[op], col, reps, op == 3);
        free(col);
    }
    fprintf(f, "}}\n");
    if (fclose(f)) die("cannot write %s", path);
    return 0;
}
