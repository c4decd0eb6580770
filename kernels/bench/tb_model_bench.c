/* The model engine (tb_model.h) as a benchmark-and-dump program: weights from ONE safetensors file
 * (names and dtypes: kernels/README.md), the model's shape from the arguments (the file must match
 * it exactly), the prompt from IN_DIR/tokens.npy (int32).
 *
 *   tb_model_bench IN OUT weights=FILE MODEL... mode=chunk past=P tokens=n chunk=C [capacity=ROWS]
 *       P past tokens prefilled (chunks of C), then n tokens in ceil(n/C) chunk calls against them
 *       (the last one zero-padded; its pad rows stay in the returned K/V, the contract's result).
 *       Writes chunk_logits [calls, vocab] (each call's selected row: its last real one), k and v
 *       [layers, kv_heads, rows, head_dim] after the last call, decode_logits [vocab] (the same n
 *       tokens one decode step at a time from the P-row cache).
 *       Timed, interleaved: one chunk call of C rows (between the counters' marks) and one decode step
 *       against the P-row cache ("seconds", "decode_seconds"; "matmul_seconds": the chunk call's weight products; each also
 *       by the process's CPU clock: "cpu_seconds", "decode_cpu_seconds", "matmul_cpu_seconds").
 *       cold_mb=N (> 0): the caches are evicted (N MiB written and read, untimed) before each timed
 *       decode step, so it reads its weights and K/V from memory, as a step after other work does.
 *   tb_model_bench IN OUT weights=FILE MODEL... mode=tail chunk=C cache=f32|f16|int8 cache_group=G
 *       sink=S [state=0|1] [threshold=8] [generate=G] [exact_tail=0|1]
 *       The prompt through chunked prefill with a padded or scalar tail (refimpl/tail_prefill.py):
 *       writes logits [vocab] (the first generated token's), generated [G] (greedy), and every
 *       layer's cache bytes after the prefill: layerI.k, layerI.v (uint8 [kv_heads, slots, row
 *       bytes]; slots: the window of a sliding cache, the rows held by a full one), layerI.k_scale,
 *       layerI.v_scale (int8 caches), layerI.positions (int64 [slots]); telemetry in timings.json.
 *       Timed: the prefill to the first token ("seconds", and by the process's CPU clock
 *       "cpu_seconds"), between the counters' marks. The host interleaves padded and scalar runs of several prompts, one program
 *       run each, so the program times one variant.
 *       The kill switch is the environment variable TESTBED_DISABLE_PREFILL_TAIL_PAD, or the same
 *       KEY=VALUE as an argument (for transports that cannot set a program's environment).
 *   MODEL: vocab= hidden= layers= heads= kv_heads= head_dim= mlp= window= types=LLLLLG (L local,
 *       G global) rope_local= rope_global= rope_global_scaling= (1: none) attn_scale= eps= softcap= (0: none)
 *       wdtype=f32|f16|int8
 *       wgroup= (int8 weights' scale group); and threads= warmup= reps= [reference=1: also time a
 *       float32 matrix product and a streaming read in the same run, the rates to compare with].
 * A request outside the cache or the vocabulary is refused before anything runs; a weights file of
 * another shape or dtype, or a damaged one, is an error naming the tensor; both exit nonzero. */
#define _DEFAULT_SOURCE /* posix_memalign, madvise */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../tb_linalg.h"
#include "../tb_model.h"
#include "harness.h"
#include "model_load.h"
#include "safetensors.h"

static const char *const KEYS[] = {"weights", "mode", "vocab", "hidden", "layers", "heads", "kv_heads", "head_dim",
                                   "mlp", "window", "types", "rope_local", "rope_global", "rope_global_scaling", "attn_scale", "eps",
                                   "softcap", "wdtype", "wgroup", "past", "tokens", "chunk", "capacity", "cache",
                                   "cache_group", "sink", "state", "threshold", "generate", "exact_tail",
                                   TB_KILL_SWITCH, "threads", "warmup", "reps", "reference", "cold_mb", NULL};
/* --- outputs --------------------------------------------------------------------------------------- */

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) best = x[i] > x[best] ? i : best;
    return best;
}

static void print_series(FILE *f, const char *name, const double *s, long n) {
    fprintf(f, ", \"%s\": [", name);
    for (long i = 0; i < n; i++) fprintf(f, "%s%.9g", i ? ", " : "", s[i]);
    fprintf(f, "]");
}

static FILE *open_timings(const char *mode, long warmup, long reps, int threads) {
    char path[4096];
    snprintf(path, sizeof path, "%s/timings.json", out_dir());
    FILE *f = fopen(path, "w");
    if (!f) die("cannot write %s", path);
    fprintf(f, "{\"program\": \"tb_model_bench\", \"mode\": \"%s\", \"vector_path\": \"%s\", \"gemm_isa\": \"%s\", "
               "\"source_hash\": \"%s\", \"warmup\": %ld, \"reps\": %ld, \"threads\": %d",
            mode, tb_vector_path(), harness_gemm_isa(), tb_source_hash(), warmup, reps, threads);
    return f;
}

static void close_timings(FILE *f) {
    fprintf(f, "}\n");
    if (fclose(f)) die("cannot write timings.json");
}

/* The reference rates of this run (reference=1): a float32 product of the chunk's widest shape
 * (C x hidden by hidden x mlp, weights already float32 and transposed: the sgemm the engine's matmul
 * is compared with) and a streaming read of a buffer far larger than the caches. */
typedef struct {
    float *a, *b, *c, *stream;
    int m, n, k;
    size_t stream_floats;
} reference_work;

/* The streaming read's buffer, in transparent huge pages where the kernel gives them on request
 * (madvise, this VM's setting and Android's): over 4 KiB pages the read measured 13-18 GB/s from run to
 * run on the same quiet machine, over huge pages 17-18 (the rate an outside read over huge pages
 * gets), and a floor is the best rate the memory gives. The weights stay as the engine has them. */
static float *stream_buffer(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, (size_t)2 << 20, bytes)) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* a request: refused, the read runs over 4 KiB pages */
#endif
    return p;
}

static reference_work reference_setup(const tb_model_config *c, int rows) {
    reference_work r = {0};
    r.m = rows, r.n = c->mlp, r.k = c->hidden, r.stream_floats = (size_t)64 << 20; /* 256 MiB */
    r.a = calloc((size_t)r.m * r.k, sizeof(float)), r.b = calloc((size_t)r.k * r.n, sizeof(float));
    r.c = calloc((size_t)r.m * r.n, sizeof(float)), r.stream = stream_buffer(sizeof(float) * r.stream_floats);
    if (!r.a || !r.b || !r.c || !r.stream) die("out of memory");
    for (size_t i = 0; i < (size_t)r.m * r.k; i++) r.a[i] = (float)(i % 7) * 0.25f;
    for (size_t i = 0; i < (size_t)r.k * r.n; i++) r.b[i] = (float)(i % 5) * 0.5f;
    for (size_t i = 0; i < r.stream_floats; i++) r.stream[i] = (float)(i & 3);
    return r;
}

/* A moment by both clocks, and the time since one: wall and CPU seconds. */
typedef struct {
    double wall, cpu;
} stamp;

/* `marked`: a timed repetition's interval, which the instruction counters count as a region (warm-up
 * intervals are not marked); timings.json names the marked regions of one repetition ("marks"). */
static stamp stamp_now(int marked) {
    stamp t = {now_seconds(), cpu_seconds()};
    if (marked) tb_count_begin();
    return t;
}

static void since(stamp t0, int marked, double *wall, double *cpu) {
    if (marked) tb_count_end();
    *wall = now_seconds() - t0.wall, *cpu = cpu_seconds() - t0.cpu;
}

/* s[0], s[1]: the sgemm's wall and CPU seconds; s[2], s[3]: the streaming read's. */
static void reference_time(reference_work *r, double *s, int marked) {
    stamp t0 = stamp_now(marked);
    gemm_nn(r->m, r->n, r->k, r->a, r->k, r->b, r->n, r->c, r->n, 0, 0);
    since(t0, marked, &s[0], &s[1]);
    t0 = stamp_now(marked);
    /* four independent sums, so the adds never limit the read */
    vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
    for (size_t i = 0; i + 4 * VF_LANES <= r->stream_floats; i += 4 * VF_LANES)
        for (int a = 0; a < 4; a++) acc[a] = vf_add(acc[a], vf_load(r->stream + i + a * VF_LANES));
    since(t0, marked, &s[2], &s[3]);
    for (int a = 0; a < 4; a++) r->c[0] += vf_hsum(acc[a]); /* keeps the read */
}

/* --- mode=chunk ------------------------------------------------------------------------------------ */

static void check(int rc, const char *what) {
    if (rc == TB_E_REFUSED) die("%s refused: outside the cache or the vocabulary", what);
    if (rc != TB_OK) die("%s failed with error %d", what, rc);
}

static void run_chunk(const tb_model *m, const int32_t *tokens, size_t n_tokens, int threads) {
    const tb_model_config *c = &m->cfg;
    const int past = (int)positive("past", 0, 0), n = (int)positive("tokens", 0, 1), chunk = (int)positive("chunk", 0, 1);
    const int calls = (n + chunk - 1) / chunk;
    const long need = (long)past + (long)calls * chunk;
    const long capacity = arg_int("capacity", need);
    if (need > capacity)
        die("refused: P=%d past rows and %d chunk calls of C=%d rows need %ld cache rows, the cache has %ld", past, calls,
            chunk, need, capacity);
    if ((size_t)past + n > n_tokens) die("tokens.npy holds %zu tokens, P + n = %d", n_tokens, past + n);
    for (int i = 0; i < past + n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab) die("refused: token %d at %d is outside the vocabulary", tokens[i], i);
    tb_engine_options o = {TB_F32, 32, 0, 0, (int)capacity, chunk, threads};
    tb_engine *e;
    check(tb_engine_create(m, &o, &e), "engine");

    /* the past, prefilled in chunks of C: only its real rows are kept */
    for (int s = 0; s < past; s += chunk) {
        const int rows = past - s < chunk ? past - s : chunk;
        check(tb_model_prefill_with_past(e, tokens + s, rows, chunk, s, rows, 0, NULL), "past prefill");
    }
    float *logits = malloc(sizeof(float) * (size_t)calls * c->vocab), *scratch = malloc(sizeof(float) * c->vocab);
    if (!logits || !scratch) die("out of memory");
    for (int j = 0; j < calls; j++) {
        const int s = past + j * chunk, real = past + n - s < chunk ? past + n - s : chunk;
        check(tb_model_prefill_with_past(e, tokens + s, real, chunk, s, chunk, real - 1, logits + (size_t)j * c->vocab),
              "chunk call");
    }
    const int rows = tb_kv_count(tb_engine_cache(e, 0)), hd = c->head_dim;
    const size_t per_layer = (size_t)c->kv_heads * rows * hd;
    float *k = malloc(sizeof(float) * per_layer * c->layers), *v = malloc(sizeof(float) * per_layer * c->layers);
    int64_t *positions = malloc(sizeof(int64_t) * rows);
    if (!k || !v || !positions) die("out of memory");
    for (int i = 0; i < c->layers; i++)
        tb_kv_read(tb_engine_cache(e, i), k + i * per_layer, v + i * per_layer, positions, rows);
    size_t kv_shape[4] = {(size_t)c->layers, (size_t)c->kv_heads, (size_t)rows, (size_t)hd};
    size_t logits_shape[2] = {(size_t)calls, (size_t)c->vocab};
    npy_save(out_dir(), "chunk_logits", "<f4", 2, logits_shape, logits);
    npy_save(out_dir(), "k", "<f4", 4, kv_shape, k);
    npy_save(out_dir(), "v", "<f4", 4, kv_shape, v);

    /* the same utterance one decode step at a time from the P-row cache */
    check(tb_engine_drop(e, rows - past), "rewind");
    for (int p = past; p < past + n; p++) check(tb_model_decode_with_past(e, tokens[p], p, scratch), "decode step");
    size_t vocab_shape[1] = {(size_t)c->vocab};
    npy_save(out_dir(), "decode_logits", "<f4", 1, vocab_shape, scratch);
    check(tb_engine_drop(e, n), "rewind");

    /* timed: one chunk call and one decode step against the P-row cache, interleaved; every figure
     * by the wall clock and by the CPU clock */
    const long warmup = positive("warmup", 1, 0), reps = positive("reps", 1, 1), reference = arg_int("reference", 0);
    const long cold_mb = positive("cold_mb", 0, 0);
    const int first = n < chunk ? n : chunk, columns = reference ? 10 : 6;
    double *t = calloc((size_t)reps * 10, sizeof(double)), scratch_times[10];
    if (!t) die("out of memory");
    reference_work ref = reference ? reference_setup(c, chunk) : (reference_work){0};
    for (long r = -warmup; r < reps; r++) {
        double *s = r >= 0 ? t + 10 * r : scratch_times, mm_wall, mm_cpu, wall, cpu;
        tb_engine_matmul_seconds(e, &mm_wall, &mm_cpu);
        stamp t0 = stamp_now(r >= 0);
        check(tb_model_prefill_with_past(e, tokens + past, first, chunk, past, chunk, first - 1, scratch), "chunk call");
        since(t0, r >= 0, &s[0], &s[1]);
        tb_engine_matmul_seconds(e, &wall, &cpu);
        s[2] = wall - mm_wall, s[3] = cpu - mm_cpu;
        check(tb_engine_drop(e, chunk), "rewind");
        if (cold_mb) evict_caches(cold_mb);
        t0 = stamp_now(r >= 0);
        check(tb_model_decode_with_past(e, tokens[past], past, scratch), "decode step");
        since(t0, r >= 0, &s[4], &s[5]);
        check(tb_engine_drop(e, 1), "rewind");
        if (reference) reference_time(&ref, s + 6, r >= 0);
    }
    FILE *f = open_timings("chunk", warmup, reps, threads);
    fprintf(f, ", \"past\": %d, \"tokens\": %d, \"chunk\": %d, \"calls\": %d, \"rows\": %d, \"cold_mb\": %ld", past, n,
            chunk, calls, rows, cold_mb);
    fprintf(f, ", \"marks\": [\"chunk\", \"decode\"%s]", reference ? ", \"sgemm\", \"stream\"" : "");
    const char *names[10] = {"seconds", "cpu_seconds", "matmul_seconds", "matmul_cpu_seconds", "decode_seconds",
                             "decode_cpu_seconds", "sgemm_seconds", "sgemm_cpu_seconds", "stream_seconds",
                             "stream_cpu_seconds"};
    double *series = malloc(sizeof(double) * (size_t)reps);
    for (int col = 0; col < columns; col++) {
        for (long r = 0; r < reps; r++) series[r] = t[10 * r + col];
        print_series(f, names[col], series, reps);
    }
    if (reference)
        fprintf(f, ", \"sgemm_shape\": [%d, %d, %d], \"stream_bytes\": %zu", ref.m, ref.n, ref.k,
                ref.stream_floats * sizeof(float));
    close_timings(f);
    tb_engine_free(e);
}

/* --- mode=tail ------------------------------------------------------------------------------------- */

static const char *const TAIL_MODES[] = {"none", "scalar", "padded"};

static void print_telemetry(FILE *f, const char *name, const tb_telemetry *t, const tb_tail_policy *p, int window,
                            int sink) {
    char reason[160];
    switch (t->reason) {
    case TB_REASON_PADDED: snprintf(reason, sizeof reason, "padded"); break;
    case TB_REASON_NO_TAIL: snprintf(reason, sizeof reason, "no tail"); break;
    case TB_REASON_KILL_SWITCH: snprintf(reason, sizeof reason, "kill switch %s=1", TB_KILL_SWITCH); break;
    case TB_REASON_THRESHOLD:
        snprintf(reason, sizeof reason, "tail %d <= threshold %d", t->prompt_tokens - t->chunk_tokens, p->threshold);
        break;
    case TB_REASON_STATE: snprintf(reason, sizeof reason, "conv/recurrent state cannot be rolled back"); break;
    case TB_REASON_NO_SLIDING: snprintf(reason, sizeof reason, "no sliding cache"); break;
    default: snprintf(reason, sizeof reason, "window %d <= chunk %d + sink %d", window, t->chunk_size, sink);
    }
    fprintf(f, ", \"%s\": {\"prompt_tokens\": %d, \"chunk_size\": %d, \"chunk_tokens\": %d, \"tail_chunk_tokens\": %d, "
               "\"padding_tokens\": %d, \"scalar_tail_tokens\": %d, \"tail_mode\": \"%s\", \"reason\": \"%s\"}",
            name, t->prompt_tokens, t->chunk_size, t->chunk_tokens, t->tail_chunk_tokens, t->padding_tokens,
            t->scalar_tail_tokens, TAIL_MODES[t->tail_mode], reason);
}

static void save_cache(int layer, const tb_kv_cache *c, int sliding) {
    static const char *const parts[5] = {"k", "v", "k_scale", "v_scale", "positions"};
    for (int p = 0; p < 5; p++) {
        if (!tb_kv_has_part(c, p)) continue;
        const tb_sliding_cache *s = &c->part[p];
        /* a sliding cache's every slot; a full cache's rows in use, the layer's length (refimpl's
         * FullCache holds no more) */
        const int slots = sliding ? s->window : tb_kv_count(c);
        char name[64];
        snprintf(name, sizeof name, "layer%d.%s", layer, parts[p]);
        uint8_t *rows = malloc((size_t)s->planes * (slots ? slots : 1) * s->row_bytes);
        if (!rows) die("out of memory");
        for (int q = 0; q < s->planes; q++)
            memcpy(rows + (size_t)q * slots * s->row_bytes, s->rows + (size_t)q * s->window * s->row_bytes,
                   (size_t)slots * s->row_bytes);
        if (p == TB_KV_POSITIONS) {
            size_t shape[1] = {(size_t)slots};
            npy_save(out_dir(), name, "<i8", 1, shape, rows);
        } else {
            size_t shape[3] = {(size_t)s->planes, (size_t)slots, s->row_bytes};
            npy_save(out_dir(), name, "|u1", 3, shape, rows);
        }
        free(rows);
    }
}

static void run_tail(const tb_model *m, const int32_t *tokens, size_t n_tokens, int threads) {
    const tb_model_config *c = &m->cfg;
    const int n = (int)n_tokens, chunk = (int)positive("chunk", 0, 1), generate = (int)positive("generate", 1, 1);
    const int sink = (int)positive("sink", 0, 0);
    if (n < 1) die("tokens.npy is empty");
    if (sink >= c->window) die("refused: sink=%d must be below the window %d", sink, c->window);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab) die("refused: token %d at %d is outside the vocabulary", tokens[i], i);
    const char *kill = getenv(TB_KILL_SWITCH);
    kill = arg_str(TB_KILL_SWITCH, kill ? kill : "0");
    tb_tail_policy policy = {(int)positive("threshold", 8, 0), !strcmp(kill, "1"), (int)arg_int("state", 0) != 0,
                             (int)arg_int("exact_tail", 0) != 0};
    /* a full cache holds the padded tail chunk's rows until the rollback, then the generated ones */
    const int need = n / chunk * chunk + chunk + generate;
    tb_engine_options o = {dtype_arg("cache", "f32"), (int)positive("cache_group", 16, 1), 1, sink,
                           (int)arg_int("capacity", need), chunk, threads};
    if (o.capacity < need)
        die("refused: a prompt of %d tokens in chunks of %d and %d generated need %d cache rows, the cache has %d", n,
            chunk, generate, need, o.capacity);
    if (o.cache_dtype == TB_INT8 && c->head_dim % o.cache_group)
        die("cache_group=%d must divide head_dim=%d", o.cache_group, c->head_dim);
    tb_engine *e;
    check(tb_engine_create(m, &o, &e), "engine");
    float *logits = malloc(sizeof(float) * c->vocab);
    int32_t *generated = malloc(sizeof(int32_t) * generate);
    if (!logits || !generated) die("out of memory");

    tb_telemetry tel;
    check(tb_model_prefill(e, tokens, n, chunk, &policy, logits, &tel), "prefill");
    size_t vocab_shape[1] = {(size_t)c->vocab}, gen_shape[1] = {(size_t)generate};
    npy_save(out_dir(), "logits", "<f4", 1, vocab_shape, logits);
    int lengths[TB_MAX_LAYERS];
    for (int i = 0; i < c->layers; i++) save_cache(i, tb_engine_cache(e, i), c->layer_type[i] == TB_LOCAL), lengths[i] = tb_kv_count(tb_engine_cache(e, i));
    generated[0] = argmax(logits, c->vocab);
    for (int g = 1; g < generate; g++) {
        check(tb_model_decode_with_past(e, generated[g - 1], n + g - 1, logits), "decode step");
        generated[g] = argmax(logits, c->vocab);
    }
    npy_save(out_dir(), "generated", "<i4", 1, gen_shape, generated);

    /* timed: prompt to first token, from empty caches, by both clocks */
    const long warmup = positive("warmup", 1, 0), reps = positive("reps", 1, 1);
    double *wall = calloc((size_t)reps, sizeof(double)), *cpu = calloc((size_t)reps, sizeof(double));
    if (!wall || !cpu) die("out of memory");
    for (long r = -warmup; r < reps; r++) {
        tb_engine_clear(e);
        tb_telemetry ignored;
        stamp t0 = stamp_now(r >= 0);
        check(tb_model_prefill(e, tokens, n, chunk, &policy, logits, &ignored), "prefill");
        volatile int first = argmax(logits, c->vocab);
        (void)first;
        double w, u;
        since(t0, r >= 0, &w, &u);
        if (r >= 0) wall[r] = w, cpu[r] = u;
    }
    FILE *f = open_timings("tail", warmup, reps, threads);
    const tb_sliding_cache *any = NULL;
    for (int i = 0; i < c->layers && !any; i++)
        if (c->layer_type[i] == TB_LOCAL) any = &tb_engine_cache(e, i)->part[TB_KV_K];
    const int window = any ? any->window : c->window;
    print_telemetry(f, "telemetry", &tel, &policy, window, sink);
    fprintf(f, ", \"marks\": [\"prefill\"]");
    fprintf(f, ", \"lengths\": [");
    for (int i = 0; i < c->layers; i++) fprintf(f, "%s%d", i ? ", " : "", lengths[i]);
    fprintf(f, "]");
    print_series(f, "seconds", wall, reps);
    print_series(f, "cpu_seconds", cpu, reps);
    free(wall), free(cpu);
    close_timings(f);
    tb_engine_free(e);
}

int main(int argc, char **argv) {
    args_init(argc, argv, "weights=FILE mode=chunk|tail MODEL... (see the source's header)", KEYS);
    flush_denormals();
    st_file file;
    tb_model *m = malloc(sizeof *m);
    if (!m) die("out of memory");
    load_model(m, &file);
    const char *mode = arg_str("mode", "");
    const int threads = (int)positive("threads", 1, 1);
    npy_array tokens = npy_load(in_dir(), "tokens", "<i4");
    if (tokens.ndim != 1) die("tokens.npy must be one-dimensional");
    if (!strcmp(mode, "chunk")) run_chunk(m, tokens.data, tokens.count, threads);
    else if (!strcmp(mode, "tail")) run_tail(m, tokens.data, tokens.count, threads);
    else die("mode=%s is not one of chunk, tail", mode);
    st_close(&file);
    free(m);
    return 0;
}
