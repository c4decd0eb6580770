/* llama.cpp's logits for a token sequence: a third reference beside transformers and refimpl. It
 * loads a GGUF through libllama exactly as llama.cpp's tools do (its loader, its graph for the
 * architecture, its CPU backend), decodes the tokens in one batch asking for the logits of every
 * position, and writes them.
 *
 *   tb_llama_logits IN_DIR OUT_DIR model=PATH [threads=1]
 *
 * IN_DIR/tokens.npy: int32 [T]. OUT_DIR receives logits.npy: float32 [T, n_vocab] and timings.json.
 * The K/V cache is float32 (llama.cpp's default is float16, which would put a rounding of its own
 * between the references), flash attention is off, and the sliding-window cache is full-size so
 * that llama.cpp keeps every row the reference keeps. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#include "bench/harness.h"

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);  /* llama.cpp's loader says why it refused */
}

typedef struct {
    struct llama_context *ctx;
    struct llama_batch batch;
} decode_job;

static int decode(void *arg) {
    decode_job *job = arg;
    llama_memory_clear(llama_get_memory(job->ctx), true);  /* every repetition decodes from an empty cache */
    return llama_decode(job->ctx, job->batch) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    static const char *const keys[] = {"model", "threads", NULL};
    args_init(argc, argv, "model=PATH threads=N", keys);
    const char *model_path = arg_str("model", NULL);
    long threads = arg_int("threads", 1);
    if (model_path == NULL) die("model=PATH (a GGUF file) is required");
    if (threads < 1) die("threads=%ld must be >= 1", threads);

    npy_array tokens = npy_load(in_dir(), "tokens", "<i4");
    if (tokens.ndim != 1 || tokens.count == 0) die("tokens.npy must be a non-empty 1-D int32 array");
    int32_t n = (int32_t)tokens.count;

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.check_tensors = true;  /* a GGUF with NaN or out-of-range data is refused, not run */
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (model == NULL) die("llama.cpp could not load %s", model_path);
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const int32_t *ids = (const int32_t *)tokens.data;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_vocab) die("token %d at position %d is outside the vocabulary [0, %d)", ids[i], i, n_vocab);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t)n;
    cp.n_threads = cp.n_threads_batch = (int32_t)threads;
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.swa_full = true;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (ctx == NULL) die("llama.cpp could not make a context of %d tokens for %s", n, model_path);

    decode_job job = {ctx, llama_batch_init(n, 0, 1)};
    for (int32_t i = 0; i < n; i++) {
        job.batch.token[i] = ids[i];
        job.batch.pos[i] = i;
        job.batch.n_seq_id[i] = 1;
        job.batch.seq_id[i][0] = 0;
        job.batch.logits[i] = 1;  /* the logits of every position, not only the last */
    }
    job.batch.n_tokens = n;
    bench_and_record("tb_llama_logits", "llama_decode", decode, &job, NULL);

    float *logits = malloc(sizeof(float) * (size_t)n * (size_t)n_vocab);
    if (logits == NULL) die("out of memory for %d x %d logits", n, n_vocab);
    for (int32_t i = 0; i < n; i++) {
        const float *row = llama_get_logits_ith(ctx, i);
        if (row == NULL) die("llama.cpp returned no logits for position %d", i);
        memcpy(logits + (size_t)i * (size_t)n_vocab, row, sizeof(float) * (size_t)n_vocab);
    }
    size_t shape[2] = {(size_t)n, (size_t)n_vocab};
    npy_save(out_dir(), "logits", "<f4", 2, shape, logits);

    free(logits);
    llama_batch_free(job.batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
