/* What every benchmark-and-dump program shares: .npy input and output, key=value arguments,
 * warm-up + timed repetitions, and the timings JSON. The same program runs on the host, under
 * qemu-user and on a phone over ADB, so it needs nothing but libc. */
#ifndef TB_HARNESS_H
#define TB_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#define NPY_MAX_DIMS 8

typedef struct {
    char dtype[8];        /* "<f4", "|u1", "<i4" or "<i8" */
    int ndim;
    size_t shape[NPY_MAX_DIMS];
    size_t count;         /* number of elements */
    void *data;
} npy_array;

/* Read DIR/NAME.npy (C order, dtype `dtype`); exits with a message on any problem. */
npy_array npy_load(const char *dir, const char *name, const char *dtype);
/* Write DIR/NAME.npy. */
void npy_save(const char *dir, const char *name, const char *dtype, int ndim, const size_t *shape, const void *data);

/* key=value arguments after the two folders: arg_int("reps", 5). Unknown keys are rejected. */
void args_init(int argc, char **argv, const char *usage, const char *const *known_keys);
long arg_int(const char *key, long fallback);
double arg_float(const char *key, double fallback);
const char *arg_str(const char *key, const char *fallback);
const char *in_dir(void);
const char *out_dir(void);

/* Flush denormals to zero for the whole process, as ARMv7 NEON always does, so that every target
 * computes the same bits. */
void flush_denormals(void);

double now_seconds(void);
/* CPU time of the whole process, every thread: beside wall time it tells a loaded or throttled run
 * (wall >> cpu / threads) from a slow kernel. */
double cpu_seconds(void);

/* Marks around each timed call for the instruction counters: the QEMU plugin
 * (testbed/measure/counts/qemu_insn_plugin.c) and valgrind's callgrind (--dump-before at each mark) count
 * the guest instructions executed between tb_count_begin() and tb_count_end(), so a count is the
 * kernel's, apart from the harness around it. They do nothing else; each call costs a few instructions,
 * counted too, the same in every build. A program that marks says so in timings.json: "marks", the
 * names of the regions one timed repetition marks, in order (bench_and_record: ["call"]). */
void tb_count_begin(void);
void tb_count_end(void);

/* Run fn(ctx) warmup times, then reps times timed; write DIR/timings.json. fn returns a TB_* code.
 * With the argument cold_mb=N (> 0) every timed repetition starts with the caches evicted (N MiB
 * written and read first, outside the timing): a first call's cost instead of a hot loop's. */
/* Evict the caches: write, then read, `mb` MiB (more than any last-level cache), so what a kernel
 * reads next comes from memory, as a first call's would. */
void evict_caches(long mb);

typedef int (*bench_fn)(void *ctx);
void bench_and_record(const char *program, const char *kernel, bench_fn fn, void *ctx, const char *extra_json);

void die(const char *fmt, ...);

/* The matrix products' micro-kernel in this program ("avx512-fma", "neon", ...; "none" without them). */
const char *harness_gemm_isa(void);

#endif
