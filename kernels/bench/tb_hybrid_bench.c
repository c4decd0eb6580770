/* The hybrid engine (tb_hybrid.h) as a benchmark-and-dump program: weights from ONE safetensors file
 * in Hugging Face's Qwen3.5 names (kernels/README.md), the model's shape from the arguments (the file
 * must match it exactly), the prompt from IN_DIR/tokens.npy (int32).
 *
 *   tb_hybrid_bench IN OUT weights=FILE MODEL... past=P tokens=n chunk=C [tail=exact|padded|scalar]
 *       [gdn=serial|chunkwise|none] [gdn_chunk=64] [precision=f32|fp16-acc32|fp16-acc16] [all_logits=0|1]
 *       [capacity=ROWS] threads= warmup= reps=
 *   From an empty past: the first P tokens, then the next n, each in calls of C rows; the remainder of
 *   each (P mod C, n mod C tokens) by `tail`: exact (one call of its own length), padded (one call of
 *   C rows, the rest pads: beta = g = 0, conv state at the last real row, pad K/V not kept) or scalar
 *   (one decode step per token). Every call selects its last real row.
 *   Writes call_logits [calls, vocab] (each call's selected row), call_positions [calls] (int64: the
 *   selected row's position), call_rows [calls] (int32: the rows of each call), the state after the
 *   P + n tokens per layer: layerI.conv [K - 1, channels] and layerI.recurrent [H_v, d, d] (stored
 *   transposed, as refimpl.gdn) for a linear layer, layerI.k and layerI.v [kv_heads, P + n, head_dim]
 *   for a full one; with all_logits=1 also logits_all [P + n, vocab] (every real row of every call).
 *   Timed: the whole prefill from an empty past, warmup + reps times (the outputs are the last
 *   repetition's; all are the same), each repetition between the counters' marks: "seconds",
 *   "cpu_seconds"; and the GDN recurrence's share of it (tb_hybrid_gdn_seconds): "gdn_seconds",
 *   "gdn_cpu_seconds".
 *   MODEL: vocab= hidden= layers= mlp= heads= kv_heads= head_dim= k_heads= v_heads= linear_dim=
 *       conv_kernel= types=LLLF (L linear, F full, one per layer) rotary_dim= rope_theta= eps= tied=0|1
 * A request outside the cache or the vocabulary is refused before anything runs; a weights file of
 * another shape or dtype, or a damaged one, is an error naming the tensor; both exit nonzero. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tb_hybrid.h"
#include "harness.h"
#include "hybrid_load.h"
#include "safetensors.h"

static const char *const KEYS[] = {TB_HYBRID_KEYS, "past", "tokens", "chunk", "tail", "gdn", "gdn_chunk",
                                   "precision", "all_logits", "capacity", "threads", "warmup", "reps", NULL};
static const char *const TAILS[] = {"exact", "padded", "scalar"};
static const char *const FORMS[] = {"serial", "chunkwise", "none"};
static const char *const PRECISIONS[] = {"f32", "fp16-acc32", "fp16-acc16"};

static long positive(const char *key, long fallback, long least) {
    long v = arg_int(key, fallback);
    if (v < least) die("%s=%ld is out of range (at least %ld)", key, v, least);
    return v;
}

static int choice(const char *key, const char *fallback, const char *const *options, int n) {
    const char *s = arg_str(key, fallback);
    for (int i = 0; i < n; i++)
        if (!strcmp(s, options[i])) return i;
    char accepted[128] = "";
    for (int i = 0; i < n; i++) snprintf(accepted + strlen(accepted), sizeof accepted - strlen(accepted), "%s%s",
                                         i ? ", " : "", options[i]);
    die("%s=%s is not one of %s", key, s, accepted);
    return 0;
}

/* --- the prefill ----------------------------------------------------------------------------------- */

static void check(int rc, const char *what) {
    if (rc == TB_E_REFUSED) die("%s refused: outside the cache or the vocabulary", what);
    if (rc != TB_OK) die("%s failed with error %d", what, rc);
}

typedef struct {
    tb_hybrid_engine *e;
    const tb_hybrid_config *c;
    int chunk, tail;
    int calls;
    float *call_logits, *all;  /* [calls, vocab]; [tokens, vocab] or NULL */
    int64_t *positions;
    int32_t *rows;
} prefill_run;

/* One call of `rows` rows holding n real tokens; its last real row's logits (all real rows' too). */
static void call(prefill_run *p, const int32_t *tokens, int n, int rows) {
    const int64_t start = tb_hybrid_length(p->e);
    float *logits = p->call_logits + (size_t)p->calls * p->c->vocab;
    if (p->all) {
        float *rows_logits = p->all + (size_t)start * p->c->vocab;
        check(tb_hybrid_prefill_with_past(p->e, tokens, n, rows, TB_HYBRID_ALL_ROWS, rows_logits), "call");
        memcpy(logits, rows_logits + (size_t)(n - 1) * p->c->vocab, sizeof(float) * p->c->vocab);
    } else if (rows == 1) {
        check(tb_hybrid_decode(p->e, tokens[0], logits), "decode step");
    } else {
        check(tb_hybrid_prefill_with_past(p->e, tokens, n, rows, n - 1, logits), "call");
    }
    p->positions[p->calls] = start + n - 1, p->rows[p->calls] = rows;
    p->calls++;
}

/* n tokens in calls of C rows, the remainder by the tail mode */
static void segment(prefill_run *p, const int32_t *tokens, int n) {
    const int C = p->chunk, full = n / C, rem = n - full * C;
    for (int b = 0; b < full; b++) call(p, tokens + (size_t)b * C, C, C);
    if (!rem) return;
    const int32_t *rest = tokens + (size_t)full * C;
    if (p->tail == 0) call(p, rest, rem, rem);
    else if (p->tail == 1) call(p, rest, rem, C);
    else
        for (int t = 0; t < rem; t++) call(p, rest + t, 1, 1);
}

static int calls_for(int n, int C, int tail) {
    const int rem = n % C;
    return n / C + (rem ? (tail == 2 ? rem : 1) : 0);
}

static void save_state(tb_hybrid_engine *e, const tb_hybrid_config *c, int capacity) {
    const int64_t length = tb_hybrid_length(e);
    const size_t d = (size_t)c->linear_dim, cd = 2 * (size_t)c->k_heads * d + (size_t)c->v_heads * d;
    for (int i = 0; i < c->layers; i++) {
        char name[64];
        if (c->layer_type[i] == TB_HYBRID_LINEAR) {
            size_t conv[2] = {(size_t)(c->conv_kernel - 1), cd}, rec[3] = {(size_t)c->v_heads, d, d};
            snprintf(name, sizeof name, "layer%d.conv", i);
            npy_save(out_dir(), name, "<f4", 2, conv, tb_hybrid_conv(e, i));
            snprintf(name, sizeof name, "layer%d.recurrent", i);
            npy_save(out_dir(), name, "<f4", 3, rec, tb_hybrid_recurrent(e, i));
        } else {
            const size_t hd = (size_t)c->head_dim, rows = (size_t)length;
            float *buf = malloc(sizeof(float) * (size_t)c->kv_heads * (rows ? rows : 1) * hd);
            if (!buf) die("out of memory");
            size_t shape[3] = {(size_t)c->kv_heads, rows, hd};
            for (int part = 0; part < 2; part++) {
                const float *src = part ? tb_hybrid_values(e, i) : tb_hybrid_keys(e, i);
                for (int h = 0; h < c->kv_heads; h++)
                    memcpy(buf + (size_t)h * rows * hd, src + (size_t)h * capacity * hd, sizeof(float) * rows * hd);
                snprintf(name, sizeof name, "layer%d.%s", i, part ? "v" : "k");
                npy_save(out_dir(), name, "<f4", 3, shape, buf);
            }
            free(buf);
        }
    }
}

static void print_series(FILE *f, const char *name, const double *s, long n) {
    fprintf(f, ", \"%s\": [", name);
    for (long i = 0; i < n; i++) fprintf(f, "%s%.9g", i ? ", " : "", s[i]);
    fprintf(f, "]");
}

int main(int argc, char **argv) {
    args_init(argc, argv, "weights=FILE MODEL... past=P tokens=n chunk=C (see the source's header)", KEYS);
    flush_denormals();
    st_file file;
    tb_hybrid_model *m = malloc(sizeof *m);
    if (!m) die("out of memory");
    hybrid_load_model(m, &file);
    const tb_hybrid_config *c = &m->cfg;
    const int past = (int)positive("past", 0, 0), n = (int)positive("tokens", 0, 1), chunk = (int)positive("chunk", 0, 1);
    const int tail = choice("tail", "exact", TAILS, 3), form = choice("gdn", "chunkwise", FORMS, 3);
    const int precision = choice("precision", "f32", PRECISIONS, 3), all_logits = (int)arg_int("all_logits", 0) != 0;
    const int threads = (int)positive("threads", 1, 1);
    const long warmup = positive("warmup", 0, 0), reps = positive("reps", 1, 1);
    if (precision && form != 1) die("precision=%s needs gdn=chunkwise", PRECISIONS[precision]);
    npy_array tokens = npy_load(in_dir(), "tokens", "<i4");
    if (tokens.ndim != 1) die("tokens.npy must be one-dimensional");
    if ((size_t)past + n > tokens.count) die("tokens.npy holds %zu tokens, P + n = %d", tokens.count, past + n);
    const int32_t *ids = tokens.data;
    for (int i = 0; i < past + n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab) die("refused: token %d at %d is outside the vocabulary", ids[i], i);
    /* a call writes its C rows after the past before keeping the real ones */
    const long need = (long)past + n + chunk, capacity = arg_int("capacity", need);
    if (capacity < need)
        die("refused: P=%d and n=%d tokens in calls of C=%d rows need %ld cache rows, the cache has %ld", past, n, chunk,
            need, capacity);
    tb_hybrid_options o = {(int)capacity, chunk, threads, form, (int)positive("gdn_chunk", 64, 1), precision};
    tb_hybrid_engine *e;
    check(tb_hybrid_create(m, &o, &e), "engine");

    const int calls = calls_for(past, chunk, tail) + calls_for(n, chunk, tail);
    prefill_run p = {e, c, chunk, tail, 0, malloc(sizeof(float) * (size_t)calls * c->vocab),
                     all_logits ? malloc(sizeof(float) * (size_t)(past + n) * c->vocab) : NULL,
                     malloc(sizeof(int64_t) * (size_t)calls), malloc(sizeof(int32_t) * (size_t)calls)};
    /* per repetition: the prefill's wall and CPU seconds, and those of its recurrence alone */
    double *t = calloc((size_t)reps * 4, sizeof(double));
    if (!p.call_logits || (all_logits && !p.all) || !p.positions || !p.rows || !t) die("out of memory");
    for (long r = -warmup; r < reps; r++) {
        tb_hybrid_clear(e);
        p.calls = 0;
        double g_wall, g_cpu, g_wall1, g_cpu1;
        tb_hybrid_gdn_seconds(e, &g_wall, &g_cpu);
        const double c0 = cpu_seconds(), t0 = now_seconds();
        if (r >= 0) tb_count_begin();
        if (past) segment(&p, ids, past);
        segment(&p, ids + past, n);
        if (r >= 0) {
            tb_count_end();
            t[4 * r] = now_seconds() - t0, t[4 * r + 1] = cpu_seconds() - c0;
            tb_hybrid_gdn_seconds(e, &g_wall1, &g_cpu1);
            t[4 * r + 2] = g_wall1 - g_wall, t[4 * r + 3] = g_cpu1 - g_cpu;
        }
    }
    size_t logits_shape[2] = {(size_t)calls, (size_t)c->vocab}, calls_shape[1] = {(size_t)calls};
    npy_save(out_dir(), "call_logits", "<f4", 2, logits_shape, p.call_logits);
    npy_save(out_dir(), "call_positions", "<i8", 1, calls_shape, p.positions);
    npy_save(out_dir(), "call_rows", "<i4", 1, calls_shape, p.rows);
    if (all_logits) {
        size_t shape[2] = {(size_t)(past + n), (size_t)c->vocab};
        npy_save(out_dir(), "logits_all", "<f4", 2, shape, p.all);
    }
    save_state(e, c, (int)capacity);

    char path[4096];
    snprintf(path, sizeof path, "%s/timings.json", out_dir());
    FILE *f = fopen(path, "w");
    if (!f) die("cannot write %s", path);
    fprintf(f, "{\"program\": \"tb_hybrid_bench\", \"vector_path\": \"%s\", \"source_hash\": \"%s\", \"warmup\": %ld, "
               "\"reps\": %ld, \"threads\": %d, \"past\": %d, \"tokens\": %d, \"chunk\": %d, \"tail\": \"%s\", "
               "\"gdn\": \"%s\", \"gdn_chunk\": %d, \"precision\": \"%s\", \"calls\": %d, \"length\": %lld, "
               "\"marks\": [\"prefill\"]",
            tb_vector_path(), tb_source_hash(), warmup, reps, threads, past, n, chunk, TAILS[tail], FORMS[form],
            o.gdn_chunk, PRECISIONS[precision], calls, (long long)tb_hybrid_length(e));
    const char *names[4] = {"seconds", "cpu_seconds", "gdn_seconds", "gdn_cpu_seconds"};
    double *series = malloc(sizeof(double) * (size_t)reps);
    if (!series) die("out of memory");
    for (int col = 0; col < 4; col++) {
        for (long r = 0; r < reps; r++) series[r] = t[4 * r + col];
        print_series(f, names[col], series, reps);
    }
    free(series), free(t);
    fprintf(f, "}\n");
    if (fclose(f)) die("cannot write timings.json");
    tb_hybrid_free(e);
    st_close(&file);
    free(m);
    return 0;
}
