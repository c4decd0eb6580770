/* llama.cpp as an engine under test (engine contract v1, kernels/bench/tb_engine.h): one request is
 * served by libllama exactly as an application on a phone would call it, so testbed's oracles judge
 * llama.cpp's own chunked prefill, its KV cache (sliding-window eviction included), its sequence
 * removal and its state bytes.
 *
 *   tb_llama_engine REQUEST_DIR RESPONSE_DIR
 *
 * The plan (CONTRACT.md, "Semantics"): the GGUF named by model.file is loaded; the past tokens[0:P]
 * are decoded in calls of C rows (the last one partial), then the chunk tokens[P:N] in calls of C rows,
 * with n_batch = n_ubatch = C so that each call is one ubatch of llama.cpp's graph. The last partial
 * call of the chunk is, by tail.mode:
 *   none    decoded as it is (n_last rows)
 *   scalar  decoded one token per call
 *   padded  padded to C rows with pad tokens at the following positions, then the pad rows are
 *           removed with llama_memory_seq_rm (llama.cpp's rollback); if llama.cpp refuses to remove
 *           them (a recurrent state cannot lose a partial range unless the context keeps rs_snapshots
 *           >= the pad count: llama.cpp's n_rs_seq), the request is answered "refused" with llama.cpp's
 *           answer, never computed otherwise
 * The logits rows at logits_at are copied right after the call that covers them (a later call
 * overwrites llama.cpp's output buffer). With state=1 the sequence's bytes from
 * llama_state_seq_get_data are written to state.bin: a padded tail rolled back must give the same
 * bytes as an unpadded one; with state_before_last=1 also state_before_last.bin, the sequence's bytes
 * right before the plan's last llama_decode.
 *
 * state_in (tb_engine.h; engines/llamacpp.yaml says supports.state_in): the state.bin of an earlier
 * request is restored into sequence 0 with llama_state_seq_set_data, which must leave the sequence's
 * last position at state_in.positions - 1; then tokens[P:] are decoded one per llama_decode ("decode").
 *
 * Cache: type_k = type_v = cache.dtype (float32 or float16; testbed's int8 rows are not a llama.cpp
 * cache type, so int8 is refused). cache.window 0 keeps every row (swa_full); a window W > 0 must be
 * the model's own sliding window (llama.cpp reads it from the GGUF; the adapter cannot change it), and
 * then llama.cpp's sliding cache evicts as it does in an application. Sink rows do not exist in
 * llama.cpp and are refused. Flash attention is off (the same graph on every device).
 *
 * Every llama_decode is one marked call (tb_call_begin/tb_call_end: exact per-call instructions on
 * counting devices). With bench = {reps R, warmup W}, the plan runs W times unmarked, then R times
 * marked, each from an empty memory, each followed by an unmarked call "prefill" timing the whole
 * repetition; the outputs are those of the last run.
 *
 * Planted faults for the oracles' own tests, compiled in only by defines (build.py's test builds):
 *   TB_PLANT_CHUNK_OFF_BY_ONE  every call after the first reads its tokens one row early (the classic
 *                              chunk-boundary slip: row i of the call at `start` gets token start+i-1;
 *                              positions stay right, which llama.cpp checks: a gap or an overlap in
 *                              positions it refuses itself)
 *   TB_PLANT_KEEP_PAD_ROW      the rollback removes the pad rows from the second one on (one kept)
 *   TB_PLANT_STATE_WRONG_SEQUENCE  state.bin is read from llama.cpp's sequence 1 (which holds nothing)
 *                              instead of the request's sequence 0
 *   TB_PLANT_STATE_BEFORE_LAST_CALL  state.bin is the sequence's state from before the last llama_decode
 *   TB_PLANT_LAST_ROW_LOGITS   every row asked of a call gets the call's last output row (llama_get_logits_ith -1)
 *   TB_PLANT_HALF_UBATCH       n_ubatch = C / 2: each call of C rows is two ubatches of llama.cpp's graph */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#include "bench/harness.h"
#include "bench/tb_engine.h"

#ifndef TB_SOURCE_HASH
#define TB_SOURCE_HASH "unknown"
#endif
#ifndef TB_PLANT_CHUNK_OFF_BY_ONE
#define TB_PLANT_CHUNK_OFF_BY_ONE 0
#endif
#ifndef TB_PLANT_KEEP_PAD_ROW
#define TB_PLANT_KEEP_PAD_ROW 0
#endif
#ifndef TB_PLANT_STATE_WRONG_SEQUENCE
#define TB_PLANT_STATE_WRONG_SEQUENCE 0
#endif
#ifndef TB_PLANT_STATE_BEFORE_LAST_CALL
#define TB_PLANT_STATE_BEFORE_LAST_CALL 0
#endif
#ifndef TB_PLANT_LAST_ROW_LOGITS
#define TB_PLANT_LAST_ROW_LOGITS 0
#endif
#ifndef TB_PLANT_HALF_UBATCH
#define TB_PLANT_HALF_UBATCH 0
#endif
#define STATE_SEQUENCE (TB_PLANT_STATE_WRONG_SEQUENCE ? 1 : 0) /* the request's sequence is 0 */

#define MAX_LOGITS_AT 4096

/* llama.cpp's error lines, kept so that a refusal quotes its loader ("unknown model architecture"). */
static char last_error[1024];

static void keep_errors(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level != GGML_LOG_LEVEL_ERROR) return;
    fputs(text, stderr);
    if (strstr(text, "error loading model:") != NULL || last_error[0] == '\0') {
        snprintf(last_error, sizeof last_error, "%s", text);
        size_t n = strlen(last_error);
        while (n > 0 && (last_error[n - 1] == '\n' || last_error[n - 1] == ' ')) last_error[--n] = '\0';
    }
}

typedef struct {
    struct llama_context *ctx;
    const int32_t *ids;
    long n_tokens, past, chunk;
    const char *tail;          /* none | scalar | padded */
    const long *logits_at;
    int n_logits_at;
    int32_t n_vocab;
    float *logits;             /* [n_logits_at, n_vocab] */
    struct llama_batch batch;
    char refusal[512];         /* set when llama.cpp refuses a step of the plan */
    const char *state_dir;     /* the response folder when states are asked (state=1), else NULL */
    int before_last;           /* state_before_last=1: the state before the last llama_decode too */
} plan;

/* The sequence's bytes (llama_state_seq_get_data) to RESPONSE_DIR/name. */
static void save_state(struct llama_context *ctx, const char *response_dir, const char *name) {
    size_t size = llama_state_seq_get_size(ctx, STATE_SEQUENCE);
    uint8_t *bytes = malloc(size ? size : 1);
    if (bytes == NULL) die("out of memory for %zu state bytes", size);
    size_t got = llama_state_seq_get_data(ctx, bytes, size, STATE_SEQUENCE);
    if (got != size) die("llama_state_seq_get_data wrote %zu of %zu bytes", got, size);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", response_dir, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(bytes, 1, size, f) != size || fclose(f) != 0) die("cannot write %s", path);
    free(bytes);
}

/* A GGUF metadata integer of the model's architecture (ARCH.suffix), or dflt. */
static long meta_long(const struct llama_model *model, const char *suffix, long dflt) {
    char arch[64], key[160], value[64];
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch) < 0) return dflt;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (llama_model_meta_val_str(model, key, value, sizeof value) < 0) return dflt;
    return strtol(value, NULL, 10);
}

/* The most a sequence's state can hold in a context of n_ctx cells: every layer's K and V rows of every
 * cell in float32 (the widest cache type here) with 64 bytes of bookkeeping per cell, at most the model's
 * own size of recurrent state, and 1 MiB of headers. A larger state_in is no state of this context. */
static size_t state_bound(const struct llama_model *model, uint32_t n_ctx) {
    long head = llama_model_n_embd(model) / (llama_model_n_head(model) > 0 ? llama_model_n_head(model) : 1);
    long k = meta_long(model, "attention.key_length", head), v = meta_long(model, "attention.value_length", head);
    size_t row = (size_t)llama_model_n_head_kv(model) * (size_t)(k + v) * 4 + 64;
    return (size_t)llama_model_n_layer(model) * n_ctx * row + 4 * (size_t)llama_model_n_params(model) + ((size_t)1 << 20);
}

/* The index in logits_at of `pos`, or -1. */
static int wanted(const plan *p, long pos) {
    for (int i = 0; i < p->n_logits_at; i++)
        if (p->logits_at[i] == pos) return i;
    return -1;
}

/* One llama_decode of rows [start, start + rows) at their positions; rows past n_tokens are pads
 * (token 0 at the following positions, no logits). Copies the wanted logits rows. */
static void decode(plan *p, const char *name, long start, long rows, int marked) {
    struct llama_batch *b = &p->batch;
    for (long i = 0; i < rows; i++) {
        long pos = start + i;
        long at = TB_PLANT_CHUNK_OFF_BY_ONE && start > 0 ? pos - 1 : pos;
        b->token[i] = pos < p->n_tokens ? p->ids[at] : 0;
        b->pos[i] = (llama_pos)pos;
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = 0;
        b->logits[i] = pos < p->n_tokens && wanted(p, pos) >= 0;
    }
    b->n_tokens = (int32_t)rows;
    if (p->state_dir && start + rows >= p->n_tokens) { /* the plan's last call: the state before it */
        if (p->before_last) save_state(p->ctx, p->state_dir, "state_before_last.bin");
        if (TB_PLANT_STATE_BEFORE_LAST_CALL) save_state(p->ctx, p->state_dir, "state.bin");
    }
    if (marked) tb_call_begin();
    int rc = llama_decode(p->ctx, *b);
    if (marked) tb_call_end(name, (int)rows);
    if (rc != 0) die("llama_decode of %ld rows at position %ld returned %d", rows, start, rc);
    for (long i = 0; i < rows; i++) {
        int k = b->logits[i] ? wanted(p, start + i) : -1;
        if (k < 0) continue;
        const float *row = llama_get_logits_ith(p->ctx, TB_PLANT_LAST_ROW_LOGITS ? -1 : (int32_t)i);
        if (row == NULL) die("llama.cpp returned no logits for position %ld", start + i);
        memcpy(p->logits + (size_t)k * (size_t)p->n_vocab, row, sizeof(float) * (size_t)p->n_vocab);
    }
}

/* tokens[from:to] in calls of C rows; the last partial call as `tail` says (the past's never padded). */
static int decode_range(plan *p, const char *name, long from, long to, const char *tail, int marked) {
    long c = p->chunk;
    long start = from;
    for (; start + c <= to; start += c) decode(p, name, start, c, marked);
    long rest = to - start;
    if (rest == 0) return 0;
    if (strcmp(tail, "scalar") == 0) {
        for (long i = 0; i < rest; i++) decode(p, "decode", start + i, 1, marked);
    } else if (strcmp(tail, "padded") == 0) {
        decode(p, "tail", start, c, marked);
        llama_pos keep = (llama_pos)(to + TB_PLANT_KEEP_PAD_ROW);
        if (!llama_memory_seq_rm(llama_get_memory(p->ctx), 0, keep, -1)) {
            snprintf(p->refusal, sizeof p->refusal,
                     "llama_memory_seq_rm(seq 0, %ld, -1) returned false: llama.cpp cannot remove the pad rows of a "
                     "padded tail from this model's memory (recurrent state: partial rollback not supported with "
                     "n_rs_seq=%u)", (long)keep, llama_n_rs_seq(p->ctx));
            return -1;
        }
    } else {
        decode(p, name, start, rest, marked);
    }
    return 0;
}

static int run_plan(plan *p, int marked) {
    llama_memory_clear(llama_get_memory(p->ctx), true);
    if (decode_range(p, "past", 0, p->past, "none", marked) != 0) return -1;
    return decode_range(p, "chunk", p->past, p->n_tokens, p->tail, marked);
}

/* state_in: the state restored into sequence 0, which must then end at position P - 1; tokens[P:] decoded
 * one per llama_decode. */
static void continue_from_state(plan *p, const struct llama_model *model, const tb_state_in *in, uint32_t n_ctx) {
    unsigned char *bytes = tb_state_in_read(in, state_bound(model, n_ctx));
    if (bytes == NULL) die("state_in: not a state of this context (n_ctx=%u)", n_ctx);
    llama_memory_clear(llama_get_memory(p->ctx), true);
    if (llama_state_seq_set_data(p->ctx, bytes, in->bytes, 0) == 0)
        die("llama_state_seq_set_data could not restore state_in (%zu bytes): %s", in->bytes,
            last_error[0] ? last_error : "no message");
    free(bytes);
    llama_pos last = llama_memory_seq_pos_max(llama_get_memory(p->ctx), 0);
    if (last != (llama_pos)(in->positions - 1))
        die("state_in: the restored sequence 0 ends at position %d; the request says it holds positions 0 .. %ld", last,
            in->positions - 1);
    for (long pos = in->positions; pos < p->n_tokens; pos++) decode(p, "decode", pos, 1, 1);
}

static int refuse(const char *response_dir, const char *reason) {
    tb_respond_refused(response_dir, reason);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s REQUEST_DIR RESPONSE_DIR (engine contract v%d)\n", argv[0], TB_ENGINE_CONTRACT);
        return 2;
    }
    const char *request_dir = argv[1], *response_dir = argv[2];
    tb_request *req = tb_request_load(request_dir);
    if (req == NULL) return 2;

    const char *technique = tb_req_str(req, "technique", "");
    const char *format = tb_req_str(req, "model.format", "");
    const char *model_file = tb_req_str(req, "model.file", NULL);
    const char *tail = tb_req_str(req, "tail.mode", "none");
    const char *dtype = tb_req_str(req, "cache.dtype", "float32");
    long window = tb_req_int(req, "cache.window", 0), sink = tb_req_int(req, "cache.sink", 0);
    long n_tokens = tb_req_int(req, "n_tokens", -1), past = tb_req_int(req, "past", 0);
    long chunk = tb_req_int(req, "chunk", -1), threads = tb_req_int(req, "threads", 1);
    long want_state = tb_req_int(req, "state", 0);
    long rs_snapshots = tb_req_int(req, "rs_snapshots", 0);  /* recurrent-state snapshots llama.cpp keeps for rollback */
    long reps = tb_req_int(req, "bench.reps", 0), warmup = tb_req_int(req, "bench.warmup", 0);
    static long logits_at[MAX_LOGITS_AT];
    int n_logits_at = tb_req_ints(req, "logits_at", logits_at, MAX_LOGITS_AT);

    if (strcmp(technique, "chunk_prefill") != 0 && strcmp(technique, "tail") != 0 && strcmp(technique, "hybrid") != 0)
        return refuse(response_dir, "technique is not one of chunk_prefill, tail, hybrid");
    if (strcmp(format, "gguf") != 0) return refuse(response_dir, "llama.cpp reads GGUF models only (model.format=gguf)");
    if (model_file == NULL) die("request.args has no model.file");
    if (n_tokens < 1 || past < 0 || past >= n_tokens || chunk < 1 || threads < 1)
        die("request: n_tokens=%ld past=%ld chunk=%ld threads=%ld (accepted: 0 <= past < n_tokens, chunk >= 1, threads >= 1)",
            n_tokens, past, chunk, threads);
    if (n_logits_at < 0) die("request: logits_at is missing or longer than %d positions", MAX_LOGITS_AT);
    for (int i = 0; i < n_logits_at; i++)
        if (logits_at[i] < 0 || logits_at[i] >= n_tokens) die("request: logits_at %ld is outside [0, %ld)", logits_at[i], n_tokens);
    if (strcmp(tail, "none") != 0 && strcmp(tail, "scalar") != 0 && strcmp(tail, "padded") != 0)
        die("request: tail.mode=%s (accepted: none, scalar, padded)", tail);
    enum ggml_type cache_type;
    if (strcmp(dtype, "float32") == 0) cache_type = GGML_TYPE_F32;
    else if (strcmp(dtype, "float16") == 0) cache_type = GGML_TYPE_F16;
    else return refuse(response_dir, "llama.cpp's K/V cache types here are float32 and float16 (testbed's int8 rows are not a llama.cpp cache type)");
    if (sink > 0) return refuse(response_dir, "llama.cpp's sliding-window cache has no sink rows (cache.sink must be 0)");
    tb_state_in in;
    int restoring = tb_state_in_find(req, request_dir, &in);
    if (restoring < 0) return 2;
    if (restoring && (reps > 0 || warmup > 0)) return refuse(response_dir, "a restored state (state_in) is not timed (bench)");
    for (int i = 0; restoring && i < n_logits_at; i++)
        if (logits_at[i] < in.positions) return refuse(response_dir, "with state_in, logits_at lies among the decoded tokens");

    npy_array tokens = npy_load(request_dir, "tokens", "<i4");
    if (tokens.ndim != 1 || (long)tokens.count != n_tokens) die("tokens.npy must be int32 [%ld]", n_tokens);

    char model_path[4096];
    if (model_file[0] == '/') snprintf(model_path, sizeof model_path, "%s", model_file);
    else snprintf(model_path, sizeof model_path, "%s/%s", request_dir, model_file);

    llama_log_set(keep_errors, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.check_tensors = true;  /* a GGUF with NaN or out-of-range data is refused, not run */
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (model == NULL) {
        /* an architecture this tree lacks is "not supported"; any other loader refusal is an error */
        if (strstr(last_error, "unknown model architecture") != NULL) return refuse(response_dir, last_error);
        die("llama.cpp could not load %s: %s", model_file, last_error[0] ? last_error : "no message");
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const int32_t *ids = (const int32_t *)tokens.data;
    for (long i = 0; i < n_tokens; i++)
        if (ids[i] < 0 || ids[i] >= n_vocab) die("token %d at position %ld is outside the vocabulary [0, %d)", ids[i], i, n_vocab);

    int32_t n_swa = llama_model_n_swa(model);
    if (window > 0 && window != n_swa) {
        char reason[256];
        snprintf(reason, sizeof reason, "llama.cpp's sliding window is the model's own (n_swa=%d in the GGUF); cache.window=%ld "
                 "is not a setting of its cache (accepted: 0 for a full cache, or %d)", n_swa, window, n_swa);
        return refuse(response_dir, reason);
    }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(n_tokens + chunk);  /* room for the pads of a padded tail, the same for every tail mode */
    cp.n_batch = cp.n_ubatch = (uint32_t)chunk;
    if (TB_PLANT_HALF_UBATCH) cp.n_ubatch = (uint32_t)(chunk > 1 ? chunk / 2 : 1);
    cp.n_seq_max = 1;
    cp.n_rs_seq = (uint32_t)(rs_snapshots > 0 ? rs_snapshots : 0);  /* 0: llama.cpp's default, no partial rollback */
    cp.n_threads = cp.n_threads_batch = (int32_t)threads;
    cp.type_k = cp.type_v = cache_type;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.swa_full = window == 0;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (ctx == NULL) die("llama.cpp could not make a context (n_ctx=%u, n_ubatch=%ld, cache %s): %s", cp.n_ctx, chunk, dtype,
                         last_error[0] ? last_error : "no message");

    plan p = {.ctx = ctx, .ids = ids, .n_tokens = n_tokens, .past = past, .chunk = chunk, .tail = tail,
              .logits_at = logits_at, .n_logits_at = n_logits_at, .n_vocab = n_vocab,
              .batch = llama_batch_init((int32_t)chunk, 0, 1)};
    p.logits = calloc((size_t)(n_logits_at ? n_logits_at : 1) * (size_t)n_vocab, sizeof(float));
    if (p.logits == NULL) die("out of memory for %d x %d logits", n_logits_at, n_vocab);
    p.state_dir = want_state ? response_dir : NULL;
    p.before_last = (int)tb_req_int(req, "state_before_last", 0);

    if (restoring) continue_from_state(&p, model, &in, cp.n_ctx);
    for (long i = 0; !restoring && i < warmup; i++)
        if (run_plan(&p, 0) != 0) return refuse(response_dir, p.refusal);
    for (long i = 0; !restoring && i < (reps > 0 ? reps : 1); i++) {
        double wall = now_seconds(), cpu = cpu_seconds();
        if (run_plan(&p, 1) != 0) return refuse(response_dir, p.refusal);
        /* bench: the whole prefill of this repetition as one more (unmarked) call, last of the repetition:
         * a tail's cost is all its calls (scalar: one per token), which the harness reads as the last call */
        if (reps > 0) tb_timing_add("prefill", (int)n_tokens, now_seconds() - wall, cpu_seconds() - cpu);
    }

    size_t shape[2] = {(size_t)n_logits_at, (size_t)n_vocab};
    npy_save(response_dir, "logits", "<f4", 2, shape, p.logits);
    if (want_state && !TB_PLANT_STATE_BEFORE_LAST_CALL) save_state(ctx, response_dir, "state.bin");
    char desc[256];
    llama_model_desc(model, desc, sizeof desc);
    char version[512];
    snprintf(version, sizeof version, "libllama (%s; n_swa=%d)", desc, n_swa);
    if (tb_timings_write(response_dir, "llamacpp", version, TB_SOURCE_HASH) != 0) die("cannot write timings.json");
    if (tb_respond_ok(response_dir) != 0) die("cannot write status.json");

    free(p.logits);
    llama_batch_free(p.batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    tb_request_free(req);
    return 0;
}
