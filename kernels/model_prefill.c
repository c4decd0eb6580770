/* Chunked prefill with a padded tail and rollback (seed 003; refimpl/tail_prefill.py).
 *
 * A prompt of N tokens runs as N / C full chunk calls, then the tail of N mod C tokens either one
 * decode step per token (scalar) or as one chunk call padded to C rows. The pads evict real rows of
 * the sliding caches, so every cache is snapshotted before the padded call and rolled back after it;
 * the padded call's logits are a pad's, so the last real token is rolled back too and re-run as a
 * decode step for the first generated token's logits. */
#include <stdlib.h>

#include "tb_model.h"
#include "tb_model_internal.h"
#include "tb_parallel.h"

int tb_tail_decide(const tb_engine *e, const tb_tail_policy *p, int tail, int chunk, int *reason) {
    int why = TB_REASON_PADDED, sliding = 0;
    if (tail == 0) why = TB_REASON_NO_TAIL;
    else if (p->kill_switch) why = TB_REASON_KILL_SWITCH;
    else if (tail <= p->threshold) why = TB_REASON_THRESHOLD;
    else if (p->has_state) why = TB_REASON_STATE;
    else {
        for (int i = 0; i < tb_engine_layers(e); i++) {
            if (!tb_engine_evicts(e, i)) continue;
            sliding = 1;
            /* the padded chunk must fit beside the sinks: window > chunk + sink */
            const tb_sliding_cache *s = &tb_engine_cache((tb_engine *)e, i)->part[TB_KV_K];
            if (s->window <= chunk + s->sink) why = TB_REASON_WINDOW;
        }
        if (!sliding) why = TB_REASON_NO_SLIDING;
    }
    *reason = why;
    return why == TB_REASON_PADDED;
}

static int prefill(tb_engine *e, const int32_t *tokens, int n, int chunk, const tb_tail_policy *p, float *logits,
                   tb_telemetry *t) {
    if (n < 1 || chunk < 1) return TB_E_REFUSED;
    const int full = n / chunk, tail = n - full * chunk, start = full * chunk, layers = tb_engine_layers(e);
    int rc = TB_OK, reason;
    for (int b = 0; b < full && rc == TB_OK; b++)
        rc = tb_model_prefill_with_past(e, tokens + b * chunk, chunk, chunk, (int64_t)b * chunk, chunk, chunk - 1,
                                        tail ? NULL : logits);
    if (rc != TB_OK) return rc;
    const int pad = tb_tail_decide(e, p, tail, chunk, &reason);
    *t = (tb_telemetry){n, chunk, start, 0, 0, tail, tail ? TB_TAIL_SCALAR : TB_TAIL_NONE, reason};
    if (pad) {
        /* the last real token is rolled back with the pads: its row in the chunk yields no logits */
        const int real = tail - 1, pads = chunk - real;
        tb_kv_snapshot *snaps = calloc((size_t)layers, sizeof *snaps);
        if (!snaps) return TB_E_MEMORY;
        int taken = 0;
        for (; taken < layers && rc == TB_OK && !p->exact_tail; taken++)
            rc = tb_kv_snapshot_padded(tb_engine_cache(e, taken), real, pads, &snaps[taken]);
        if (rc == TB_OK)
            rc = tb_model_prefill_with_past(e, tokens + start, tail, chunk, start, p->exact_tail ? real : chunk, 0, NULL);
        for (int i = 0; i < taken; i++) {
            if (rc == TB_OK) rc = tb_kv_rollback_padded(tb_engine_cache(e, i), &snaps[i]);
            else tb_kv_snapshot_free(&snaps[i]);
        }
        free(snaps);
        if (rc == TB_OK) rc = tb_model_decode_with_past(e, tokens[n - 1], n - 1, logits);
        *t = (tb_telemetry){n, chunk, start, real, chunk - tail, 1, TB_TAIL_PADDED, reason};
    } else {
        for (int pos = start; pos < n && rc == TB_OK; pos++) rc = tb_model_decode_with_past(e, tokens[pos], pos, logits);
    }
    return rc;
}

int tb_model_prefill(tb_engine *e, const int32_t *tokens, int n, int chunk, const tb_tail_policy *p, float *logits,
                     tb_telemetry *t) {
    TB_FP_ENTER();
    return TB_FP_LEAVE(prefill(e, tokens, n, chunk, p, logits, t));
}
