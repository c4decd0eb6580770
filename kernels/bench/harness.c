#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../tb_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static size_t dtype_size(const char *dtype) {
    if (!strcmp(dtype, "<f4")) return 4;
    if (!strcmp(dtype, "|u1")) return 1;
    if (!strcmp(dtype, "<i4")) return 4;
    if (!strcmp(dtype, "<i8")) return 8;
    die("unsupported dtype %s", dtype);
    return 0;
}

static FILE *open_in(const char *dir, const char *name, const char *mode, char *path, size_t n) {
    snprintf(path, n, "%s/%s.npy", dir, name);
    FILE *f = fopen(path, mode);
    if (!f) die("cannot open %s", path);
    return f;
}

npy_array npy_load(const char *dir, const char *name, const char *dtype) {
    char path[4096];
    FILE *f = open_in(dir, name, "rb", path, sizeof path);
    unsigned char pre[10];
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6)) die("%s is not a .npy file", path);
    size_t hlen = pre[8] | (size_t)pre[9] << 8;
    if (pre[6] >= 2) { /* version 2+: 4-byte header length */
        unsigned char more[2];
        if (fread(more, 1, 2, f) != 2) die("%s: truncated header", path);
        hlen |= (size_t)more[0] << 16 | (size_t)more[1] << 24;
    }
    char *header = calloc(hlen + 1, 1);
    if (!header || fread(header, 1, hlen, f) != hlen) die("%s: truncated header", path);
    npy_array a = {0};
    char *p = strstr(header, "'descr':");
    if (!p || sscanf(p + 8, " '%7[^']'", a.dtype) != 1) die("%s: no descr", path);
    if (strcmp(a.dtype, dtype)) die("%s has dtype %s, expected %s", path, a.dtype, dtype);
    if (strstr(header, "'fortran_order': True")) die("%s is in Fortran order", path);
    p = strstr(header, "'shape':");
    if (!p || !(p = strchr(p, '('))) die("%s: no shape", path);
    p++;
    a.count = 1;
    while (*p && *p != ')') {
        char *end;
        unsigned long long v = strtoull(p, &end, 10);
        if (end == p) { p++; continue; }
        if (a.ndim == NPY_MAX_DIMS) die("%s has more than %d dimensions", path, NPY_MAX_DIMS);
        a.shape[a.ndim++] = (size_t)v;
        a.count *= (size_t)v;
        p = end;
    }
    free(header);
    size_t bytes = a.count * dtype_size(dtype);
    a.data = malloc(bytes ? bytes : 1);
    if (!a.data || fread(a.data, 1, bytes, f) != bytes) die("%s: truncated data", path);
    fclose(f);
    return a;
}

void npy_save(const char *dir, const char *name, const char *dtype, int ndim, const size_t *shape, const void *data) {
    char path[4096], dict[512], shape_text[256] = "";
    size_t count = 1, used = 0;
    for (int i = 0; i < ndim; i++) {
        used += (size_t)snprintf(shape_text + used, sizeof shape_text - used, "%zu,%s", shape[i],
                                 i + 1 < ndim ? " " : "");
        count *= shape[i];
    }
    if (ndim > 1) shape_text[used - 1] = '\0'; /* (a, b) rather than (a, b,) */
    int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", dtype, shape_text);
    int total = 10 + n + 1, pad = (64 - total % 64) % 64;
    FILE *f = open_in(dir, name, "wb", path, sizeof path);
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)((n + pad + 1) & 0xff),
                             (unsigned char)((n + pad + 1) >> 8)};
    fwrite(pre, 1, 10, f);
    fwrite(dict, 1, (size_t)n, f);
    for (int i = 0; i < pad; i++) fputc(' ', f);
    fputc('\n', f);
    if (fwrite(data, dtype_size(dtype), count, f) != count || fclose(f)) die("cannot write %s", path);
}

static int g_argc;
static char **g_argv;

void args_init(int argc, char **argv, const char *usage, const char *const *known_keys) {
    if (argc < 3) die("usage: %s IN_DIR OUT_DIR %s", argv[0], usage);
    for (int i = 3; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        int ok = 0;
        for (const char *const *k = known_keys; eq && *k; k++)
            ok |= strlen(*k) == (size_t)(eq - argv[i]) && !strncmp(argv[i], *k, (size_t)(eq - argv[i]));
        if (!ok) die("argument %s is not one of KEY=VALUE with KEY in: %s", argv[i], usage);
    }
    g_argc = argc, g_argv = argv;
}

const char *in_dir(void) { return g_argv[1]; }
const char *out_dir(void) { return g_argv[2]; }

const char *arg_str(const char *key, const char *fallback) {
    size_t n = strlen(key);
    for (int i = 3; i < g_argc; i++)
        if (!strncmp(g_argv[i], key, n) && g_argv[i][n] == '=') return g_argv[i] + n + 1;
    return fallback;
}

long arg_int(const char *key, long fallback) {
    const char *s = arg_str(key, NULL);
    char *end;
    if (!s) return fallback;
    long v = strtol(s, &end, 10);
    if (*end || end == s) die("%s=%s is not an integer", key, s);
    return v;
}

double arg_float(const char *key, double fallback) {
    const char *s = arg_str(key, NULL);
    char *end;
    if (!s) return fallback;
    double v = strtod(s, &end);
    if (*end || end == s) die("%s=%s is not a number", key, s);
    return v;
}

void flush_denormals(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(_mm_getcsr() | 0x8040); /* FTZ and DAZ */
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    __asm__ volatile("msr fpcr, %0" ::"r"(fpcr | (1u << 24)));
#elif defined(__arm__) && defined(__ARM_FP)
    uint32_t fpscr;
    __asm__ volatile("vmrs %0, fpscr" : "=r"(fpscr));
    __asm__ volatile("vmsr fpscr, %0" ::"r"(fpscr | (1u << 24)));
#endif
}

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Evict the caches before a cold repetition: write, then read, a buffer of `mb` MiB (larger than any
 * last-level cache), so the kernel's operands come from memory as a first call's would. */
void evict_caches(long mb) {
    static unsigned char *junk;
    static volatile unsigned sink;
    size_t n = (size_t)mb << 20;
    if (!junk && !(junk = malloc(n))) die("out of memory for cold=1 (%ld MiB)", mb);
    memset(junk, (int)(sink & 0xff) + 1, n);
    unsigned s = 0;
    for (size_t i = 0; i < n; i += 64) s += junk[i];
    sink = s;
}

/* Out of line and with different bodies, so the compiler can neither inline them nor fold the two into
 * one symbol: the counters find them by name in the symbol table. */
static volatile int count_mark;
/* Aligned, so that neither straddles a page (QEMU would translate it as two blocks). */
__attribute__((noinline, used, aligned(64))) void tb_count_begin(void) { count_mark = 1; }
__attribute__((noinline, used, aligned(64))) void tb_count_end(void) { count_mark = 2; }

/* The matrix products' micro-kernel (kernels/gemm.c, chosen at run time; TB_ISA forces one), or "none"
 * in a program linked without the kernels (tb_ggml_gdn links this harness alone). */
const char *tb_gemm_isa(void) __attribute__((weak));
const char *harness_gemm_isa(void) { return tb_gemm_isa ? tb_gemm_isa() : "none"; }

void bench_and_record(const char *program, const char *kernel, bench_fn fn, void *ctx, const char *extra_json) {
    long warmup = arg_int("warmup", 1), reps = arg_int("reps", 1), cold_mb = arg_int("cold_mb", 0);
    if (cold_mb < 0) die("cold_mb must be >= 0 (got %ld)", cold_mb);
    if (warmup < 0 || reps < 1) die("warmup must be >= 0 and reps >= 1 (got %ld, %ld)", warmup, reps);
    double *seconds = malloc(sizeof(double) * (size_t)reps), *cpu = malloc(sizeof(double) * (size_t)reps);
    if (!seconds || !cpu) die("out of memory");
    for (long i = 0; i < warmup; i++)
        if (fn(ctx)) die("%s failed in warm-up", kernel);
    for (long i = 0; i < reps; i++) {
        if (cold_mb) evict_caches(cold_mb); /* outside the timed region */
        double c0 = cpu_seconds(), t0 = now_seconds();
        tb_count_begin();
        int rc = fn(ctx);
        tb_count_end();
        seconds[i] = now_seconds() - t0, cpu[i] = cpu_seconds() - c0;
        if (rc) die("%s returned error %d", kernel, rc);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/timings.json", out_dir());
    FILE *f = fopen(path, "w");
    if (!f) die("cannot write %s", path);
    fprintf(f, "{\"program\": \"%s\", \"kernel\": \"%s\", \"vector_path\": \"%s\", \"gemm_isa\": \"%s\", "
               "\"source_hash\": \"%s\", \"warmup\": %ld, \"reps\": %ld, \"cold_mb\": %ld, \"marks\": [\"call\"], %s%s"
               "\"seconds\": [",
            program, kernel, tb_vector_path(), harness_gemm_isa(), tb_source_hash(), warmup, reps, cold_mb,
            extra_json ? extra_json : "", extra_json && *extra_json ? ", " : "");
    for (long i = 0; i < reps; i++) fprintf(f, "%s%.9g", i ? ", " : "", seconds[i]);
    fprintf(f, "], \"cpu_seconds\": [");
    for (long i = 0; i < reps; i++) fprintf(f, "%s%.9g", i ? ", " : "", cpu[i]);
    fprintf(f, "]}\n");
    if (fclose(f)) die("cannot write %s", path);
    free(seconds), free(cpu);
}
