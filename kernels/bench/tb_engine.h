/* Engine contract v1, the C side: what a program under `backend=engine` needs to read a request and
 * write a response (README, "Engine under test"; engines/contract-v1.schema.json). C99 and libc only,
 * plus harness.c for .npy files and the count marks.
 *
 * The harness pushes a request folder and runs   ENGINE REQUEST_DIR RESPONSE_DIR   on the device:
 *   REQUEST_DIR/request.args   the request, one key=value per line, nested keys dotted (cache.dtype),
 *                              lists comma-separated (logits_at=850,851); request.json says the same
 *   REQUEST_DIR/tokens.npy     int32 [n_tokens]; the model file it names beside it
 * and pulls RESPONSE_DIR: status.json (tb_respond_ok / tb_respond_refused), logits.npy (npy_save),
 * optionally state.bin (and state_before_last.bin: the state after every call but the last, when the
 * request says state_before_last=1), cache/, and timings.json (tb_timings_write). A request may carry a
 * state to restore first (state_in, below).
 *
 * Count marks: tb_call_begin() / tb_call_end() put harness.h's tb_count_begin() / tb_count_end()
 * around one engine call and record it in timings.json's "calls" with "counted": true, so the i-th
 * counted region on a counting device (qemu-user's plugin, valgrind) is the i-th counted call. An
 * engine that never marks is counted as a whole process, and its records say so. */
#ifndef TB_ENGINE_H
#define TB_ENGINE_H

#include <stddef.h>

#define TB_ENGINE_CONTRACT 1

typedef struct tb_request tb_request; /* opaque: the lines of request.args */

/* Read REQUEST_DIR/request.args; NULL (and a message on stderr) if it cannot be read or is not the
 * contract version this header speaks. */
tb_request *tb_request_load(const char *request_dir);
/* The value of `key` as an integer; `dflt` when absent. A value that is not an integer is an error
 * (message, exit 2): the harness wrote it, so a bad one is a broken request, never a default. */
long tb_req_int(const tb_request *req, const char *key, long dflt);
const char *tb_req_str(const tb_request *req, const char *key, const char *dflt);
/* A comma-separated list of integers into out[0..max): the count, or -1 when absent or too long. */
int tb_req_ints(const tb_request *req, const char *key, long *out, int max);
/* model.config as "key=value" strings (model.config.hidden=640 gives "hidden=640"), in request order,
 * NULL-terminated and owned by the request: the model's shape for an engine whose model file does not carry
 * it (testbed's safetensors file), as testbed's own programs take it on their command line. */
const char *const *tb_req_model_config(tb_request *req);
void tb_request_free(tb_request *req);

/* state_in: a request may carry a state to restore (only to an engine whose yaml says supports.state_in:
 * true): a state.bin this engine wrote for an earlier request with the same model and cache settings,
 * pushed as REQUEST_DIR/<state_in.file>, holding positions 0 .. state_in.positions - 1 (tokens[0:P]). The
 * engine restores it before its calls, then decodes tokens[P:n_tokens] one token per call at positions
 * P .. n_tokens - 1 (logits_at lies among them; state=1: state.bin after them).
 * tb_state_in_find: 0 when the request carries no state_in; 1 when it does (*s: the file's path, its
 * size, the positions it holds); -1 (a message on stderr) when state_in names no regular file inside
 * REQUEST_DIR (a path, a symlink) or its positions are not in 1 .. n_tokens - 1. */
typedef struct {
    char path[4096];
    long positions;
    size_t bytes;
} tb_state_in;

int tb_state_in_find(const tb_request *req, const char *request_dir, tb_state_in *s);
/* The whole file in a malloc'd buffer (the caller frees it) when it holds at most max_bytes (what the
 * engine's caches can hold: a larger one is not a state of them, and is never read); NULL and a message
 * otherwise. */
unsigned char *tb_state_in_read(const tb_state_in *s, size_t max_bytes);

/* status.json: {"contract": 1, "status": "ok"} or {"contract": 1, "status": "refused", "reason": ...}.
 * A refusal is what an engine answers to a request it does not support (the harness records "not
 * supported", never a pass). Both return 0, or -1 when the file cannot be written. */
int tb_respond_ok(const char *response_dir);
int tb_respond_refused(const char *response_dir, const char *reason);

/* One engine call for timings.json's "calls": its name ("chunk", "decode", "prefill", ...), the rows
 * it took, its wall and CPU seconds. tb_timing_add records an unmarked call ("counted": false). */
void tb_timing_add(const char *name, int rows, double wall_s, double cpu_s);
/* The marked form: tb_call_begin() starts the clocks and the count region, tb_call_end() closes both
 * and records the call with "counted": true. Not nested. */
void tb_call_begin(void);
void tb_call_end(const char *name, int rows);
/* RESPONSE_DIR/timings.json: {"contract": 1, "calls": [...], "marks": [names of the counted calls,
 * in order], "reps": 1, "device_time": ISO 8601 by the device's clock, "engine": {name, version,
 * source_hash}}. Returns 0, or -1 when it cannot be written. */
int tb_timings_write(const char *response_dir, const char *engine_name, const char *version,
                     const char *source_hash);

#endif
