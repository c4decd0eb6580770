/* testbed's model engine (tb_model.h, the code tb_model_bench runs) behind engine contract v1
 * (tb_engine.h; README, "Engine under test"): what `backend=engine engine=testbed-c` runs.
 *
 *   tb_model_engine REQUEST_DIR RESPONSE_DIR
 *
 * technique=chunk_prefill  tokens[0:past] in calls of C rows (pad rows never kept, as tb_model_bench
 *     does), then tokens[past:n_tokens] in calls of C rows. The last call, when partial, by tail.mode:
 *     none: zero-padded, its pad rows left in the cache (tb_model_bench's chunk mode, whose bits this
 *     reproduces); padded: the same, the pad rows then dropped; scalar: its real rows one decode step
 *     each. logits.npy holds the rows at logits_at (at most one per call); cache/k_L.npy, v_L.npy every
 *     row the cache holds [kv_heads, rows, head_dim]; the cache is float32 (other dtypes refused).
 * technique=tail  the prompt through tb_model_prefill on sliding-window caches (cache.dtype, .sink,
 *     .group): tail.mode padded forces the padded tail (threshold 0), scalar sets the kill switch, none
 *     appends the last partial chunk's real rows in one call (no pads: the rollback's reference).
 *     logits.npy: the first token's logits (logits_at must be [n_tokens - 1]); state.bin (state=true):
 *     every layer's cache in order, each its k, v, then (int8) k_scale, v_scale, then positions: the
 *     slots' raw bytes, a sliding cache's every slot, a full cache's rows in use. The prefill is one
 *     call ("prefill"), so state_before_last.bin (state_before_last=1) is the empty caches' state.
 *     With state_in (tb_engine.h): that state.bin restored (same model, cache dtype, group, sink),
 *     checked to hold positions 0 .. P - 1, then tokens[P:] decoded one per call ("decode"), logits at
 *     logits_at among them; state_before_last.bin then the state before the last decode.
 * technique=hybrid  the Qwen3.5-style hybrid (tb_hybrid.h, the engine tb_hybrid_bench drives; weights in
 *     Hugging Face's names, model.config the keys of tb_hybrid_bench's arguments): tokens[0:past] in calls of
 *     C rows, then tokens[past:n_tokens] in calls of C rows, the last partial call by tail.mode (none: a call
 *     of its own length; padded: C rows, the pads never entering the state; scalar: one decode step per
 *     row); the GDN layers chunkwise (chunk 64, float32), as tb_hybrid_bench's defaults, so its bits are
 *     backend=native's. logits.npy: the rows at logits_at; state.bin (state=true): per layer, a linear
 *     layer's conv [K - 1, channels] then recurrent [H_v, d, d] state, a full layer's k then v
 *     [kv_heads, P + n, head_dim], float32. No cache/ (its layers are not all attention).
 * A gguf or hf model, or a request outside what the engine holds: refused (status.json).
 * bench={reps, warmup}: the plan run again warmup + reps times from empty caches, the timed calls
 * marked for the instruction counters (without bench, the one run's calls are).
 *
 * Faults for the tests (defined by a patched copy, never in a build of testbed's): TB_FAULT_CHUNK_OFF_BY_ONE
 * (the utterance's calls get positions one too far), TB_FAULT_PAD_ROW_KEPT (a partial past call keeps
 * one pad row), TB_FAULT_STATE_NOT_CARRIED (each utterance call starts from empty caches; the hybrid's
 * from an empty past, its conv and recurrent states and KV caches dropped), TB_FAULT_POSITION_AFTER_FIRST_CALL
 * (the utterance's calls after its first get positions one too far). */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../tb_hybrid.h"
#include "../tb_kernels.h"
#include "../tb_model.h"
#include "harness.h"
#include "hybrid_load.h"
#include "model_load.h"
#include "tb_engine.h"

#ifndef TB_FAULT_CHUNK_OFF_BY_ONE
#define TB_FAULT_CHUNK_OFF_BY_ONE 0
#endif
#ifndef TB_FAULT_PAD_ROW_KEPT
#define TB_FAULT_PAD_ROW_KEPT 0
#endif
#ifndef TB_FAULT_STATE_NOT_CARRIED
#define TB_FAULT_STATE_NOT_CARRIED 0
#endif
#ifndef TB_FAULT_POSITION_AFTER_FIRST_CALL
#define TB_FAULT_POSITION_AFTER_FIRST_CALL 0
#endif

#define ENGINE_NAME "testbed-c"
#define ENGINE_VERSION "1"

static const char *g_request, *g_response;

/* A request this engine does not serve: the refusal is its answer (exit 0). */
static void refuse(const char *fmt, const char *what) {
    char reason[512];
    snprintf(reason, sizeof reason, fmt, what);
    if (tb_respond_refused(g_response, reason)) exit(4);
    tb_timings_write(g_response, ENGINE_NAME, ENGINE_VERSION, tb_source_hash());
    exit(0);
}

static void check(int rc, const char *what) {
    if (rc == TB_E_REFUSED) die("%s refused: outside the cache or the vocabulary", what);
    if (rc != TB_OK) die("%s failed with error %d", what, rc);
}

static int cache_dtype(const char *name) {
    if (!strcmp(name, "float32")) return TB_F32;
    if (!strcmp(name, "float16")) return TB_F16;
    if (!strcmp(name, "int8")) return TB_INT8;
    refuse("cache.dtype=%s is not one of float32, float16, int8", name);
    return -1;
}

typedef struct {
    const tb_model *m;
    const int32_t *tokens;
    int n_tokens, past, chunk, mode; /* mode: 0 none, 1 padded, 2 scalar */
    const long *at;
    int n_at;
    float *logits; /* [n_at, vocab] */
} plan;

/* The logits row wanted from a call over [start, start + rows), or -1; *slot: its row in logits.npy. */
static int wanted(const plan *p, int start, int rows, int *slot) {
    for (int i = 0; i < p->n_at; i++)
        if (p->at[i] >= start && p->at[i] < start + rows) return *slot = i, (int)(p->at[i] - start);
    return -1;
}

static void call(tb_engine *e, const plan *p, const char *name, int start, int real, int keep, int marked,
                 int64_t position) {
    int slot = 0, select = wanted(p, start, real, &slot);
    float *out = select >= 0 ? p->logits + (size_t)slot * p->m->cfg.vocab : NULL;
    if (marked) tb_call_begin();
    int rc = !strcmp(name, "decode")
                 ? tb_model_decode_with_past(e, p->tokens[start], position, out)
                 : tb_model_prefill_with_past(e, p->tokens + start, real, p->chunk, position, keep, select < 0 ? 0 : select, out);
    if (marked) tb_call_end(name, real);
    check(rc, name);
}

/* The whole chunk-prefill plan from empty caches. */
static void run_chunks(tb_engine *e, const plan *p, int marked) {
    const int C = p->chunk;
    for (int s = 0; s < p->past; s += C) {
        const int rows = p->past - s < C ? p->past - s : C;
        const int keep = TB_FAULT_PAD_ROW_KEPT && rows < C ? rows + 1 : rows;
        call(e, p, "past", s, rows, keep, marked, s);
    }
    for (int s = p->past; s < p->n_tokens; s += C) {
        const int real = p->n_tokens - s < C ? p->n_tokens - s : C;
        if (TB_FAULT_STATE_NOT_CARRIED) tb_engine_clear(e);
        if (real < C && p->mode == 2) { /* scalar tail: one decode step per real row */
            for (int i = 0; i < real; i++) call(e, p, "decode", s + i, 1, 1, marked, s + i);
            continue;
        }
        call(e, p, "chunk", s, real, C, marked,
             s + TB_FAULT_CHUNK_OFF_BY_ONE + (TB_FAULT_POSITION_AFTER_FIRST_CALL && s > p->past));
        if (real < C && p->mode == 1) check(tb_engine_drop(e, C - real), "pad rollback");
    }
}

static void save_cache_rows(const tb_model *m, tb_engine *e) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/cache", g_response);
    mkdir(dir, 0755);
    const tb_model_config *c = &m->cfg;
    for (int i = 0; i < c->layers; i++) {
        const tb_kv_cache *kv = tb_engine_cache(e, i);
        const int rows = tb_kv_count(kv);
        const size_t n = (size_t)c->kv_heads * rows * c->head_dim;
        float *k = malloc(sizeof(float) * (n ? n : 1)), *v = malloc(sizeof(float) * (n ? n : 1));
        int64_t *positions = malloc(sizeof(int64_t) * (rows ? rows : 1));
        if (!k || !v || !positions) die("out of memory");
        tb_kv_read(kv, k, v, positions, rows);
        size_t shape[3] = {(size_t)c->kv_heads, (size_t)rows, (size_t)c->head_dim};
        char name[32];
        snprintf(name, sizeof name, "k_%d", i);
        npy_save(dir, name, "<f4", 3, shape, k);
        snprintf(name, sizeof name, "v_%d", i);
        npy_save(dir, name, "<f4", 3, shape, v);
        free(k), free(v), free(positions);
    }
}

static void serve_chunk_prefill(const tb_request *req, plan *p, int threads, long reps, long warmup) {
    const tb_model_config *c = &p->m->cfg;
    if (strcmp(tb_req_str(req, "cache.dtype", "float32"), "float32"))
        refuse("cache.dtype=%s: testbed-c's chunk prefill keeps a float32 cache", tb_req_str(req, "cache.dtype", ""));
    for (int i = 0; i < p->n_at; i++) {
        int s = p->at[i] < p->past ? (int)(p->at[i] / p->chunk * p->chunk)
                                   : p->past + (int)((p->at[i] - p->past) / p->chunk) * p->chunk;
        for (int j = i + 1; j < p->n_at; j++) {
            int t = p->at[j] < p->past ? (int)(p->at[j] / p->chunk * p->chunk)
                                       : p->past + (int)((p->at[j] - p->past) / p->chunk) * p->chunk;
            if (s == t && p->mode != 2) refuse("logits_at=%s: testbed-c gives one logits row per call",
                                              tb_req_str(req, "logits_at", ""));
        }
    }
    const int calls = (p->n_tokens - p->past + p->chunk - 1) / p->chunk;
    const int capacity = p->past + 1 + calls * p->chunk; /* + 1: room for the planted kept pad row */
    tb_engine_options o = {TB_F32, 32, 0, 0, capacity, p->chunk, threads};
    tb_engine *e;
    check(tb_engine_create(p->m, &o, &e), "engine");
    run_chunks(e, p, reps == 0);
    size_t shape[2] = {(size_t)p->n_at, (size_t)c->vocab};
    npy_save(g_response, "logits", "<f4", 2, shape, p->logits);
    if (tb_req_int(req, "cache.expose", 1)) save_cache_rows(p->m, e);
    for (long r = -warmup; r < reps; r++) {
        tb_engine_clear(e);
        run_chunks(e, p, r >= 0);
    }
    tb_engine_free(e);
}

static void write_state(const tb_model *m, tb_engine *e, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", g_response, name);
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot write %s", path);
    for (int i = 0; i < m->cfg.layers; i++) {
        const tb_kv_cache *kv = tb_engine_cache(e, i);
        for (int part = 0; part < 5; part++) {
            if (!tb_kv_has_part(kv, part)) continue;
            const tb_sliding_cache *s = &kv->part[part];
            const int slots = m->cfg.layer_type[i] == TB_LOCAL ? s->window : tb_kv_count(kv);
            for (int q = 0; q < s->planes; q++)
                fwrite(s->rows + (size_t)q * s->window * s->row_bytes, 1, (size_t)slots * s->row_bytes, f);
        }
    }
    if (fclose(f)) die("cannot write %s", path);
}

/* The slots of state.bin's layout (write_state) in one layer's part: a local layer's every slot, a global
 * layer's `rows` in use. */
static int state_slots(const tb_model *m, int layer, const tb_sliding_cache *s, int rows) {
    return m->cfg.layer_type[layer] == TB_LOCAL ? s->window : rows;
}

/* state_in: a state.bin of write_state's layout into the engine's (empty) caches. Its size says how many
 * rows the global layers hold (the local layers' slots are fixed); each cache's held rows are those with
 * a position (-1: empty slot, all after the held ones). It must hold positions 0 .. P - 1: every global
 * layer each of them in order, every local layer its newest at P - 1. Anything else is an error: a state
 * this engine did not write for this model and these caches, or another prompt's. */
static void restore_state(const tb_model *m, tb_engine *e, const tb_state_in *in) {
    const tb_model_config *c = &m->cfg;
    size_t fixed = 0, per_row = 0; /* bytes of the local layers; bytes each row adds over the global layers */
    int capacity = INT_MAX;
    for (int i = 0; i < c->layers; i++) {
        const tb_kv_cache *kv = tb_engine_cache(e, i);
        for (int part = 0; part < 5; part++) {
            if (!tb_kv_has_part(kv, part)) continue;
            const tb_sliding_cache *s = &kv->part[part];
            if (c->layer_type[i] == TB_LOCAL) fixed += (size_t)s->planes * s->window * s->row_bytes;
            else per_row += (size_t)s->planes * s->row_bytes;
        }
        if (c->layer_type[i] != TB_LOCAL && kv->part[TB_KV_K].window < capacity) capacity = kv->part[TB_KV_K].window;
    }
    const size_t most = fixed + (per_row ? per_row * (size_t)capacity : 0);
    unsigned char *bytes = tb_state_in_read(in, most);
    if (!bytes) die("state_in: not a state of testbed-c's caches for this request (at most %zu bytes)", most);
    if (in->bytes < fixed || (per_row ? (in->bytes - fixed) % per_row : in->bytes != fixed))
        die("state_in: %zu bytes is not a state of these caches (%zu bytes of sliding caches, then %zu per row of "
            "the full ones)", in->bytes, fixed, per_row);
    const int rows = per_row ? (int)((in->bytes - fixed) / per_row) : 0;
    size_t at = 0;
    for (int i = 0; i < c->layers; i++) {
        tb_kv_cache *kv = tb_engine_cache(e, i);
        for (int part = 0; part < 5; part++) {
            if (!tb_kv_has_part(kv, part)) continue;
            tb_sliding_cache *s = &kv->part[part];
            const size_t plane = (size_t)state_slots(m, i, s, rows) * s->row_bytes;
            for (int q = 0; q < s->planes; q++, at += plane) memcpy(s->rows + (size_t)q * s->window * s->row_bytes, bytes + at, plane);
        }
        const tb_sliding_cache *pos = &kv->part[TB_KV_POSITIONS];
        const int64_t *positions = (const int64_t *)pos->rows;
        const int slots = state_slots(m, i, pos, rows);
        int held = 0;
        while (held < slots && positions[held] != -1) held++;
        for (int r = held; r < slots; r++)
            if (positions[r] != -1) die("state_in: layer %d holds a row at position %lld after an empty slot", i, (long long)positions[r]);
        for (int r = 1; r < held; r++)
            if (positions[r] <= positions[r - 1]) die("state_in: layer %d's positions do not ascend at slot %d", i, r);
        if (held < 1 || positions[held - 1] != in->positions - 1 ||
            (c->layer_type[i] != TB_LOCAL && (held != in->positions || positions[0] != 0)))
            die("state_in: layer %d holds %d rows, the newest at position %lld; the request says the state holds "
                "positions 0 .. %ld", i, held, held ? (long long)positions[held - 1] : -1LL, in->positions - 1);
        for (int part = 0; part < 5; part++) kv->part[part].count = held;
    }
    free(bytes);
}

/* technique=tail with state_in: restore, then decode tokens[P:] one per call, each marked "decode". */
static void serve_continuation(const tb_request *req, plan *p, const tb_state_in *in, int threads) {
    const tb_model_config *c = &p->m->cfg;
    for (int i = 0; i < p->n_at; i++)
        if (p->at[i] < in->positions) refuse("logits_at=%s: a continued state gives logits of the decoded tokens only",
                                             tb_req_str(req, "logits_at", ""));
    const int sink = (int)tb_req_int(req, "cache.sink", 0), window = (int)tb_req_int(req, "cache.window", c->window);
    if (window != c->window) refuse("cache.window=%s: testbed-c's window is the model's", tb_req_str(req, "cache.window", ""));
    if (sink >= c->window) refuse("cache.sink=%s must be below the window", tb_req_str(req, "cache.sink", ""));
    tb_engine_options o = {cache_dtype(tb_req_str(req, "cache.dtype", "float32")), (int)tb_req_int(req, "cache.group", 16),
                           1, sink, p->n_tokens + 1, 1, threads};
    if (o.cache_dtype == TB_INT8 && (o.cache_group < 1 || c->head_dim % o.cache_group))
        refuse("cache.group=%s must divide head_dim", tb_req_str(req, "cache.group", "16"));
    tb_engine *e;
    check(tb_engine_create(p->m, &o, &e), "engine");
    restore_state(p->m, e, in);
    const int want_state = (int)tb_req_int(req, "state", 0);
    for (int pos = (int)in->positions; pos < p->n_tokens; pos++) {
        if (pos == p->n_tokens - 1 && want_state && tb_req_int(req, "state_before_last", 0))
            write_state(p->m, e, "state_before_last.bin");
        call(e, p, "decode", pos, 1, 1, 1, pos);
    }
    size_t shape[2] = {(size_t)p->n_at, (size_t)c->vocab};
    npy_save(g_response, "logits", "<f4", 2, shape, p->logits);
    if (want_state) write_state(p->m, e, "state.bin");
    tb_engine_free(e);
}

static void serve_tail(const tb_request *req, plan *p, int threads, long reps, long warmup) {
    const tb_model_config *c = &p->m->cfg;
    if (p->past) refuse("past=%s: testbed-c's tail prefills a prompt from empty caches", tb_req_str(req, "past", ""));
    tb_state_in in;
    const int restoring = tb_state_in_find(req, g_request, &in);
    if (restoring < 0) exit(2);
    if (restoring) {
        if (reps) refuse("bench=%s: a continued state is not timed", tb_req_str(req, "bench.reps", ""));
        serve_continuation(req, p, &in, threads);
        return;
    }
    if (p->n_at != 1 || p->at[0] != p->n_tokens - 1)
        refuse("logits_at=%s: testbed-c's tail gives the first token's logits only (n_tokens - 1)",
               tb_req_str(req, "logits_at", ""));
    const int sink = (int)tb_req_int(req, "cache.sink", 0), window = (int)tb_req_int(req, "cache.window", c->window);
    if (window != c->window) refuse("cache.window=%s: testbed-c's window is the model's", tb_req_str(req, "cache.window", ""));
    if (sink >= c->window) refuse("cache.sink=%s must be below the window", tb_req_str(req, "cache.sink", ""));
    /* padded: forced wherever the guards allow (threshold 0); scalar: the kill switch; none: the last
     * partial chunk's real rows appended by one call, what an unpadded append leaves (the reference a
     * padded tail rolled back must equal byte for byte) */
    tb_tail_policy policy = {p->mode == 2 ? 8 : 0, p->mode == 2, 0, p->mode == 0};
    tb_engine_options o = {cache_dtype(tb_req_str(req, "cache.dtype", "float32")), (int)tb_req_int(req, "cache.group", 16),
                           1, sink, p->n_tokens / p->chunk * p->chunk + p->chunk + 1, p->chunk, threads};
    if (o.cache_dtype == TB_INT8 && (o.cache_group < 1 || c->head_dim % o.cache_group))
        refuse("cache.group=%s must divide head_dim", tb_req_str(req, "cache.group", "16"));
    tb_engine *e;
    check(tb_engine_create(p->m, &o, &e), "engine");
    tb_telemetry tel;
    const int want_state = (int)tb_req_int(req, "state", 0);
    if (want_state && tb_req_int(req, "state_before_last", 0)) write_state(p->m, e, "state_before_last.bin");
    if (reps == 0) tb_call_begin();
    check(tb_model_prefill(e, p->tokens, p->n_tokens, p->chunk, &policy, p->logits, &tel), "prefill");
    if (reps == 0) tb_call_end("prefill", p->n_tokens);
    size_t shape[2] = {1, (size_t)c->vocab};
    npy_save(g_response, "logits", "<f4", 2, shape, p->logits);
    if (want_state) write_state(p->m, e, "state.bin");
    for (long r = -warmup; r < reps; r++) {
        tb_engine_clear(e);
        if (r >= 0) tb_call_begin();
        check(tb_model_prefill(e, p->tokens, p->n_tokens, p->chunk, &policy, p->logits, &tel), "prefill");
        if (r >= 0) tb_call_end("prefill", p->n_tokens);
    }
    tb_engine_free(e);
}

/* The harness's arguments of testbed's programs from the request: weights=REQUEST_DIR/MODEL_FILE and
 * model.config's key=value strings (the shape, as tb_model_bench and tb_hybrid_bench take it); a key outside
 * `keys` exits naming it. */
static void model_args(tb_request *req, char **argv, const char *const *keys) {
    static char weights[4096];
    const char *const *config = tb_req_model_config(req);
    int n = 0;
    while (config[n]) n++;
    char **args = malloc(sizeof(char *) * (size_t)(n + 5));
    if (!args) die("out of memory");
    snprintf(weights, sizeof weights, "weights=%s/%s", argv[1], tb_req_str(req, "model.file", ""));
    args[0] = argv[0], args[1] = argv[1], args[2] = argv[2], args[3] = weights;
    for (int i = 0; i < n; i++) args[4 + i] = (char *)config[i];
    args[4 + n] = NULL;
    args_init(4 + n, args, "(model.config.* of the request)", keys);
}

/* --- technique=hybrid: the Qwen3.5-style hybrid (tb_hybrid.h), computed as tb_hybrid_bench computes it --- */

typedef struct {
    tb_hybrid_engine *e;
    const tb_hybrid_config *c;
    const int32_t *tokens;
    int n_tokens, past, chunk, mode; /* mode: 0 none, 1 padded, 2 scalar */
    const long *at;
    int n_at;
    float *logits; /* [n_at, vocab] */
    float *rows;   /* [chunk, vocab]: every real row of a call that holds several of logits_at */
} hybrid_plan;

/* One call: tokens[start, start + real) in `rows` rows (the rest pads, which never enter the state), and
 * the rows of logits_at it holds. */
static void hybrid_call(hybrid_plan *p, const char *name, int start, int real, int rows, int marked) {
    int first = -1, wanted = 0;
    for (int i = 0; i < p->n_at; i++)
        if (p->at[i] >= start && p->at[i] < start + real) first = first < 0 ? i : first, wanted++;
    const size_t vocab = (size_t)p->c->vocab;
    float *out = wanted == 1 ? p->logits + (size_t)first * vocab : wanted ? p->rows : NULL;
    const int select = wanted == 1 ? (int)(p->at[first] - start) : wanted ? TB_HYBRID_ALL_ROWS : real - 1;
    if (marked) tb_call_begin();
    int rc = rows == 1 ? tb_hybrid_decode(p->e, p->tokens[start], out)
                       : tb_hybrid_prefill_with_past(p->e, p->tokens + start, real, rows, select, out);
    if (marked) tb_call_end(name, rows);
    check(rc, name);
    if (wanted > 1)
        for (int i = first; i < first + wanted; i++)
            memcpy(p->logits + (size_t)i * vocab, p->rows + (size_t)(p->at[i] - start) * vocab, sizeof(float) * vocab);
}

/* The plan from an empty past: the past in calls of C rows (a partial one padded), then the rest in calls of
 * C rows, the last partial one as tail.mode says. */
static void hybrid_run(hybrid_plan *p, int marked) {
    const int C = p->chunk;
    tb_hybrid_clear(p->e);
    for (int s = 0; s < p->past; s += C) hybrid_call(p, "past", s, p->past - s < C ? p->past - s : C, C, marked);
    for (int s = p->past; s < p->n_tokens; s += C) {
        const int real = p->n_tokens - s < C ? p->n_tokens - s : C;
        if (TB_FAULT_STATE_NOT_CARRIED) tb_hybrid_clear(p->e);
        if (real == C || p->mode == 1) hybrid_call(p, real == C ? "chunk" : "tail", s, real, C, marked);
        else if (p->mode == 0) hybrid_call(p, "tail", s, real, real, marked);
        else
            for (int i = 0; i < real; i++) hybrid_call(p, "decode", s + i, 1, 1, marked);
    }
}

/* state.bin: every layer's carried state in order, float32, as tb_hybrid_bench dumps it (layerI.conv,
 * layerI.recurrent; layerI.k, layerI.v over the rows in use). */
static void hybrid_write_state(tb_hybrid_engine *e, const tb_hybrid_config *c, int capacity) {
    char path[4096];
    snprintf(path, sizeof path, "%s/state.bin", g_response);
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot write %s", path);
    const size_t d = (size_t)c->linear_dim, channels = 2 * (size_t)c->k_heads * d + (size_t)c->v_heads * d;
    const size_t rows = (size_t)tb_hybrid_length(e), hd = (size_t)c->head_dim;
    for (int i = 0; i < c->layers; i++) {
        if (c->layer_type[i] == TB_HYBRID_LINEAR) {
            fwrite(tb_hybrid_conv(e, i), sizeof(float), (size_t)(c->conv_kernel - 1) * channels, f);
            fwrite(tb_hybrid_recurrent(e, i), sizeof(float), (size_t)c->v_heads * d * d, f);
            continue;
        }
        for (int part = 0; part < 2; part++) {
            const float *plane = part ? tb_hybrid_values(e, i) : tb_hybrid_keys(e, i);
            for (int h = 0; h < c->kv_heads; h++) fwrite(plane + (size_t)h * capacity * hd, sizeof(float), rows * hd, f);
        }
    }
    if (fclose(f)) die("cannot write %s", path);
}

static int serve_hybrid(tb_request *req, char **argv, int tail_mode) {
    static const char *const keys[] = {TB_HYBRID_KEYS, NULL};
    if (strcmp(tb_req_str(req, "cache.dtype", "float32"), "float32"))
        refuse("cache.dtype=%s: testbed-c's hybrid keeps float32 states and caches", tb_req_str(req, "cache.dtype", ""));
    if (tb_req_int(req, "cache.window", 0) || tb_req_int(req, "cache.sink", 0))
        refuse("cache.window=%s: testbed-c's hybrid has no sliding window (its attention layers keep every row)",
               tb_req_str(req, "cache.window", "0"));
    model_args(req, argv, keys);
    flush_denormals();
    st_file file;
    tb_hybrid_model *m = malloc(sizeof *m);
    if (!m) die("out of memory");
    hybrid_load_model(m, &file);
    const tb_hybrid_config *c = &m->cfg;

    npy_array tokens = npy_load(argv[1], "tokens", "<i4");
    hybrid_plan p = {NULL, c, tokens.data, (int)tokens.count, (int)tb_req_int(req, "past", 0),
                     (int)tb_req_int(req, "chunk", 0), tail_mode, NULL, 0, NULL, NULL};
    if (tokens.ndim != 1 || (long)tokens.count != tb_req_int(req, "n_tokens", -1))
        die("tokens.npy holds %zu tokens, request.args says n_tokens=%s", tokens.count, tb_req_str(req, "n_tokens", "?"));
    if (p.chunk < 1 || p.past < 0 || p.past >= p.n_tokens) die("chunk=%d past=%d n_tokens=%d: out of range", p.chunk, p.past, p.n_tokens);
    for (int i = 0; i < p.n_tokens; i++)
        if (p.tokens[i] < 0 || p.tokens[i] >= c->vocab) refuse("a token outside the vocabulary (tokens.npy)%s", "");
    long *at = malloc(sizeof(long) * (size_t)p.n_tokens);
    if (!at) die("out of memory");
    p.at = at;
    p.n_at = tb_req_ints(req, "logits_at", at, p.n_tokens);
    if (p.n_at < 1) refuse("logits_at=%s: testbed-c gives at least one logits row", tb_req_str(req, "logits_at", ""));
    for (int i = 0; i < p.n_at; i++)
        if (at[i] < 0 || at[i] >= p.n_tokens || (i && at[i] <= at[i - 1]))
            die("logits_at=%s: positions must ascend within 0..%d", tb_req_str(req, "logits_at", ""), p.n_tokens - 1);
    p.logits = calloc((size_t)p.n_at * c->vocab, sizeof(float));
    p.rows = malloc(sizeof(float) * (size_t)p.chunk * c->vocab);
    if (!p.logits || !p.rows) die("out of memory");

    /* the GDN form and chunk tb_hybrid_bench runs by default (backend=native's hybrid: the same bits) */
    const int capacity = p.n_tokens + p.chunk;
    tb_hybrid_options o = {capacity, p.chunk, (int)tb_req_int(req, "threads", 1), TB_GDN_CHUNKWISE, 64, TB_PRECISION_F32};
    check(tb_hybrid_create(m, &o, &p.e), "engine");
    const long reps = tb_req_int(req, "bench.reps", 0), warmup = tb_req_int(req, "bench.warmup", 0);
    hybrid_run(&p, reps == 0);
    size_t shape[2] = {(size_t)p.n_at, (size_t)c->vocab};
    npy_save(g_response, "logits", "<f4", 2, shape, p.logits);
    if (tb_req_int(req, "state", 0)) hybrid_write_state(p.e, c, capacity);
    for (long r = -warmup; r < reps; r++) hybrid_run(&p, r >= 0);
    tb_hybrid_free(p.e);
    /* status last: a run that dies before it leaves no "ok" behind */
    if (tb_timings_write(g_response, ENGINE_NAME, ENGINE_VERSION, tb_source_hash()) || tb_respond_ok(g_response))
        return 4;
    st_close(&file);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) die("usage: %s REQUEST_DIR RESPONSE_DIR (engine contract v1)", argv[0]);
    g_request = argv[1], g_response = argv[2];
    tb_request *req = tb_request_load(argv[1]);
    if (!req) return 2;
    const char *technique = tb_req_str(req, "technique", "");
    if (strcmp(technique, "chunk_prefill") && strcmp(technique, "tail") && strcmp(technique, "hybrid"))
        refuse("technique=%s: testbed-c serves chunk_prefill, tail and hybrid", technique);
    if (strcmp(tb_req_str(req, "model.format", ""), "safetensors"))
        refuse("model.format=%s: testbed-c reads testbed's safetensors engine file", tb_req_str(req, "model.format", ""));
    const char *mode = tb_req_str(req, "tail.mode", "none");
    const int tail_mode = !strcmp(mode, "none") ? 0 : !strcmp(mode, "padded") ? 1 : !strcmp(mode, "scalar") ? 2 : -1;
    if (tail_mode < 0) refuse("tail.mode=%s is not one of none, padded, scalar", mode);
    if (!strcmp(technique, "hybrid")) return serve_hybrid(req, argv, tail_mode);

    /* the model's shape and weights as tb_model_bench takes them: the harness's arguments */
    static const char *const keys[] = {TB_MODEL_KEYS, NULL};
    model_args(req, argv, keys);
    flush_denormals();
    st_file file;
    tb_model *m = malloc(sizeof *m);
    if (!m) die("out of memory");
    load_model(m, &file);

    npy_array tokens = npy_load(argv[1], "tokens", "<i4");
    plan p = {m, tokens.data, (int)tokens.count, (int)tb_req_int(req, "past", 0), (int)tb_req_int(req, "chunk", 0),
              tail_mode, NULL, 0, NULL};
    if (tokens.ndim != 1 || (long)tokens.count != tb_req_int(req, "n_tokens", -1))
        die("tokens.npy holds %zu tokens, request.args says n_tokens=%s", tokens.count, tb_req_str(req, "n_tokens", "?"));
    if (p.chunk < 1 || p.past < 0 || p.past >= p.n_tokens) die("chunk=%d past=%d n_tokens=%d: out of range", p.chunk, p.past, p.n_tokens);
    for (int i = 0; i < p.n_tokens; i++)
        if (p.tokens[i] < 0 || p.tokens[i] >= m->cfg.vocab)
            refuse("a token outside the vocabulary (tokens.npy)%s", "");
    long *at = malloc(sizeof(long) * (size_t)p.n_tokens);
    p.at = at;
    p.n_at = tb_req_ints(req, "logits_at", at, p.n_tokens);
    if (p.n_at < 1) refuse("logits_at=%s: testbed-c gives at least one logits row", tb_req_str(req, "logits_at", ""));
    for (int i = 0; i < p.n_at; i++)
        if (at[i] < 0 || at[i] >= p.n_tokens || (i && at[i] <= at[i - 1]))
            die("logits_at=%s: positions must ascend within 0..%d", tb_req_str(req, "logits_at", ""), p.n_tokens - 1);
    p.logits = calloc((size_t)p.n_at * m->cfg.vocab, sizeof(float));
    if (!p.logits) die("out of memory");
    const int threads = (int)tb_req_int(req, "threads", 1);
    const long reps = tb_req_int(req, "bench.reps", 0), warmup = tb_req_int(req, "bench.warmup", 0);
    if (!strcmp(technique, "chunk_prefill")) serve_chunk_prefill(req, &p, threads, reps, warmup);
    else serve_tail(req, &p, threads, reps, warmup);

    /* status last: a run that dies before it leaves no "ok" behind */
    if (tb_timings_write(g_response, ENGINE_NAME, ENGINE_VERSION, tb_source_hash()) || tb_respond_ok(g_response))
        return 4;
    st_close(&file);
    tb_request_free(req);
    return 0;
}
