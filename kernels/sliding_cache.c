/* Sliding-window cache operations on raw rows (see tb_kernels.h). Each plane is handled alike:
 * rows [0, sink) are the sinks, the rest is a chronological queue of at most window - sink rows.
 * Semantics: refimpl/sliding_cache.py, whose layout arrays (k, v, scales, positions) are each one
 * such set of planes; slots past the held rows hold `empty_byte` (0, or 0xff for positions of -1). */
#include <string.h>

#include "tb_kernels.h"

static uint8_t *plane_rows(const tb_sliding_cache *c, int p) {
    return c->rows + (size_t)p * c->window * c->row_bytes;
}

static int check_cache(const tb_sliding_cache *c) {
    if (!c || !c->rows || c->row_bytes == 0 || c->planes <= 0 || c->window <= 0) return TB_E_SHAPE;
    if (c->sink < 0 || c->sink >= c->window || c->count < 0 || c->count > c->window) return TB_E_SHAPE;
    return TB_OK;
}

int tb_cache_append(tb_sliding_cache *c, const uint8_t *new_rows, int n) {
    if (check_cache(c) || n < 0) return TB_E_SHAPE;
    const size_t rb = c->row_bytes;
    const int total = c->count + n;
    /* rows of the sequence (held rows, then new rows) that survive: the first `sink`, and the newest
     * window - sink; everything between is evicted */
    const int evict = total > c->window ? total - c->window : 0;
    for (int p = 0; p < c->planes; p++) {
        uint8_t *rows = plane_rows(c, p);
        const uint8_t *src = new_rows + (size_t)p * n * rb;
        /* sequence index i of a kept row lands at i (i < sink) or i - evict (i >= sink + evict) */
        int kept_old = c->count - (c->sink + evict);          /* held non-sink rows that survive */
        if (kept_old > 0) memmove(rows + (size_t)c->sink * rb, rows + (size_t)(c->sink + evict) * rb, kept_old * rb);
        for (int i = 0; i < n; i++) {
            int seq_index = c->count + i;
            if (seq_index < c->sink) memcpy(rows + (size_t)seq_index * rb, src + (size_t)i * rb, rb);
            else if (seq_index >= c->sink + evict) memcpy(rows + (size_t)(seq_index - evict) * rb, src + (size_t)i * rb, rb);
        }
    }
    c->count = total - evict;
    return TB_OK;
}

/* Held rows evicted by an append of n rows: sequence indices [sink, sink + evicted(n)). */
static int evicted(const tb_sliding_cache *c, int n) {
    int over = c->count + n - c->window;
    return over > 0 ? over : 0;
}

int tb_cache_snapshot(const tb_sliding_cache *c, int n_real, int n_pad, uint8_t *saved, int *n_saved) {
    if (check_cache(c) || n_real < 0 || n_pad < 0 || !n_saved) return TB_E_SHAPE;
    /* the padding guard: the padded chunk must fit beside the sinks (window > chunk + sink) */
    if (n_real + n_pad > c->window - c->sink) return TB_E_SHAPE;
    const size_t rb = c->row_bytes;
    const int first = c->sink + evicted(c, n_real), last = c->sink + evicted(c, n_real + n_pad);
    for (int p = 0; p < c->planes; p++)
        memcpy(saved + (size_t)p * n_pad * rb, plane_rows(c, p) + (size_t)first * rb, (size_t)(last - first) * rb);
    *n_saved = last - first;
    return TB_OK;
}

int tb_cache_rollback(tb_sliding_cache *c, int n_pad, const uint8_t *saved, int n_saved) {
    if (check_cache(c) || n_pad < 0 || n_saved < 0 || n_saved > n_pad || n_pad > c->count - c->sink) return TB_E_SHAPE;
    if (c->count - n_pad + n_saved > c->window) return TB_E_SHAPE;
    const size_t rb = c->row_bytes;
    const int kept = c->count - n_pad - c->sink; /* non-sink rows left once the pads are dropped */
    for (int p = 0; p < c->planes; p++) {
        uint8_t *rows = plane_rows(c, p);
        memmove(rows + (size_t)(c->sink + n_saved) * rb, rows + (size_t)c->sink * rb, (size_t)kept * rb);
        memcpy(rows + (size_t)c->sink * rb, saved + (size_t)p * n_pad * rb, (size_t)n_saved * rb);
        /* slots no longer held read as empty again, as if the pads had never been written */
        memset(rows + (size_t)(c->count - n_pad + n_saved) * rb, c->empty_byte, (size_t)(n_pad - n_saved) * rb);
    }
    c->count = c->count - n_pad + n_saved;
    return TB_OK;
}
