/* The engine's KV caches (tb_model.h): refimpl/sliding_cache.py's byte layout, kept as five sets of
 * raw-row planes (k, v, k_scale, v_scale, positions) that kernels/sliding_cache.c appends to,
 * snapshots and rolls back. Rows are encoded into the storage dtype on append, exactly as
 * refimpl.sliding_cache.encode_rows does, and decoded to float32 for attention. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tb_model.h"
#include "tb_model_internal.h"
#include "tb_parallel.h"

static size_t elem_size(int dtype) { return dtype == TB_F32 ? 4 : dtype == TB_F16 ? 2 : 1; }

int tb_kv_has_part(const tb_kv_cache *c, int p) {
    return p != TB_KV_K_SCALE && p != TB_KV_V_SCALE ? 1 : c->dtype == TB_INT8;
}

int tb_kv_init(tb_kv_cache *c, int kv_heads, int head_dim, int capacity, int sink, int dtype, int group) {
    memset(c, 0, sizeof *c);
    if (kv_heads < 1 || head_dim < 1 || capacity < 1 || sink < 0 || sink >= capacity) return TB_E_SHAPE;
    if (dtype != TB_F32 && dtype != TB_F16 && dtype != TB_INT8) return TB_E_SHAPE;
    if (dtype == TB_INT8 && (group < 1 || head_dim % group)) return TB_E_SHAPE;
    c->dtype = dtype, c->group = group, c->kv_heads = kv_heads, c->head_dim = head_dim;
    const size_t data = (size_t)head_dim * elem_size(dtype), scales = dtype == TB_INT8 ? sizeof(float) * (head_dim / group) : 0;
    const size_t row_bytes[5] = {data, data, scales, scales, sizeof(int64_t)};
    const int planes[5] = {kv_heads, kv_heads, kv_heads, kv_heads, 1};
    for (int p = 0; p < 5; p++) {
        if (!tb_kv_has_part(c, p)) continue;
        /* empty slots: zero data, and position -1, whose int64 bytes are all 0xff */
        tb_sliding_cache s = {NULL, row_bytes[p], planes[p], capacity, sink, 0, p == TB_KV_POSITIONS ? 0xff : 0};
        s.rows = malloc((size_t)planes[p] * capacity * row_bytes[p]);
        if (!s.rows) {
            tb_kv_free(c);
            return TB_E_MEMORY;
        }
        c->part[p] = s;
    }
    tb_kv_clear(c);
    return TB_OK;
}

void tb_kv_free(tb_kv_cache *c) {
    for (int p = 0; p < 5; p++) free(c->part[p].rows), c->part[p].rows = NULL;
}

int tb_kv_count(const tb_kv_cache *c) { return c->part[TB_KV_K].count; }

void tb_kv_clear(tb_kv_cache *c) {
    for (int p = 0; p < 5; p++) {
        tb_sliding_cache *s = &c->part[p];
        if (!s->rows) continue;
        memset(s->rows, s->empty_byte, (size_t)s->planes * s->window * s->row_bytes);
        s->count = 0;
    }
}

/* --- rows in and out ------------------------------------------------------------------------------ */

/* One row of head_dim floats into the storage dtype (int8: `group`-element groups, one scale each,
 * refimpl.sliding_cache.quantize_int8). */
static void encode_row(const tb_kv_cache *c, const float *x, uint8_t *data, float *scales) {
    const int d = c->head_dim;
    if (c->dtype == TB_F32) {
        memcpy(data, x, sizeof(float) * d);
    } else if (c->dtype == TB_F16) {
        for (int i = 0; i < d; i++) {
            uint16_t h = tb_f32_to_f16(x[i]);
            memcpy(data + 2 * i, &h, 2);
        }
    } else {
        for (int g0 = 0, gi = 0; g0 < d; g0 += c->group, gi++) {
            float max = 0.0f;
            for (int i = g0; i < g0 + c->group; i++) max = fabsf(x[i]) > max ? fabsf(x[i]) : max;
            const float scale = max / 127.0f, safe = scale == 0.0f ? 1.0f : scale;
            for (int i = g0; i < g0 + c->group; i++) {
                float q = rintf(x[i] / safe);
                q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                data[i] = (uint8_t)(int8_t)q;
            }
            scales[gi] = scale;
        }
    }
}

static void decode_row(const tb_kv_cache *c, const uint8_t *data, const float *scales, float *x) {
    const int d = c->head_dim;
    if (c->dtype == TB_F32) {
        memcpy(x, data, sizeof(float) * d);
    } else if (c->dtype == TB_F16) {
        for (int i = 0; i < d; i++) {
            uint16_t h;
            memcpy(&h, data + 2 * i, 2);
            x[i] = tb_f16_to_f32(h);
        }
    } else {
        for (int i = 0; i < d; i++) x[i] = (float)(int8_t)data[i] * scales[i / c->group];
    }
}

void tb_kv_positions(const tb_kv_cache *c, int64_t *positions) {
    memcpy(positions, c->part[TB_KV_POSITIONS].rows, sizeof(int64_t) * tb_kv_count(c));
}

int tb_kv_stage(tb_kv_cache *c, const float *k, const float *v, int rows, const float **k_planes,
                const float **v_planes, int *kv_rows) {
    tb_sliding_cache *pk = &c->part[TB_KV_K], *pv = &c->part[TB_KV_V];
    const int held = tb_kv_count(c);
    if (c->dtype != TB_F32 || rows < 0 || held + rows > pk->window) return 0;
    const size_t bytes = sizeof(float) * c->head_dim;
    for (int h = 0; h < c->kv_heads; h++) {
        const size_t slot = (size_t)h * pk->window + held;
        memcpy(pk->rows + slot * bytes, k + (size_t)h * rows * c->head_dim, bytes * rows);
        memcpy(pv->rows + slot * bytes, v + (size_t)h * rows * c->head_dim, bytes * rows);
    }
    *k_planes = (const float *)pk->rows, *v_planes = (const float *)pv->rows, *kv_rows = pk->window;
    return 1;
}

void tb_kv_unstage(tb_kv_cache *c, int rows) {
    const int held = tb_kv_count(c);
    for (int p = TB_KV_K; p <= TB_KV_V; p++) {
        tb_sliding_cache *s = &c->part[p];
        for (int h = 0; h < c->kv_heads; h++)
            memset(s->rows + ((size_t)h * s->window + held) * s->row_bytes, s->empty_byte, s->row_bytes * rows);
    }
}

void tb_kv_read(const tb_kv_cache *c, float *k, float *v, int64_t *positions, int kv_rows) {
    const int n = tb_kv_count(c), d = c->head_dim;
    const tb_fp_mode caller = tb_fp_flush_enter();
    const tb_sliding_cache *pk = &c->part[TB_KV_K], *pv = &c->part[TB_KV_V];
    const tb_sliding_cache *sk = &c->part[TB_KV_K_SCALE], *sv = &c->part[TB_KV_V_SCALE];
    for (int h = 0; h < c->kv_heads; h++)
        for (int r = 0; r < n; r++) {
            const size_t slot = (size_t)h * pk->window + r;
            const float *ks = sk->rows ? (const float *)(sk->rows + slot * sk->row_bytes) : NULL;
            const float *vs = sv->rows ? (const float *)(sv->rows + slot * sv->row_bytes) : NULL;
            decode_row(c, pk->rows + slot * pk->row_bytes, ks, k + ((size_t)h * kv_rows + r) * d);
            decode_row(c, pv->rows + slot * pv->row_bytes, vs, v + ((size_t)h * kv_rows + r) * d);
        }
    tb_kv_positions(c, positions);
    tb_fp_restore(caller);
}

int tb_kv_append(tb_kv_cache *c, const float *k, const float *v, int row_stride, const int64_t *positions, int n) {
    if (n < 0) return TB_E_SHAPE;
    if (n == 0) return TB_OK;
    uint8_t *staged[5] = {0};
    int rc = TB_OK;
    for (int p = 0; p < 5 && rc == TB_OK; p++)
        if (tb_kv_has_part(c, p) && !(staged[p] = malloc((size_t)c->part[p].planes * n * c->part[p].row_bytes)))
            rc = TB_E_MEMORY;
    if (rc == TB_OK) {
        for (int h = 0; h < c->kv_heads; h++)
            for (int r = 0; r < n; r++) {
                const size_t row = (size_t)h * n + r;
                float *ks = staged[TB_KV_K_SCALE] ? (float *)(staged[TB_KV_K_SCALE] + row * c->part[TB_KV_K_SCALE].row_bytes) : NULL;
                float *vs = staged[TB_KV_V_SCALE] ? (float *)(staged[TB_KV_V_SCALE] + row * c->part[TB_KV_V_SCALE].row_bytes) : NULL;
                encode_row(c, k + ((size_t)h * row_stride + r) * c->head_dim, staged[TB_KV_K] + row * c->part[TB_KV_K].row_bytes, ks);
                encode_row(c, v + ((size_t)h * row_stride + r) * c->head_dim, staged[TB_KV_V] + row * c->part[TB_KV_V].row_bytes, vs);
            }
        memcpy(staged[TB_KV_POSITIONS], positions, sizeof(int64_t) * n);
        for (int p = 0; p < 5 && rc == TB_OK; p++)
            if (staged[p]) rc = tb_cache_append(&c->part[p], staged[p], n);
    }
    for (int p = 0; p < 5; p++) free(staged[p]);
    return rc;
}

int tb_kv_snapshot_padded(const tb_kv_cache *c, int n_real, int n_pad, tb_kv_snapshot *s) {
    memset(s, 0, sizeof *s);
    s->n_pad = n_pad;
    for (int p = 0; p < 5; p++) {
        if (!tb_kv_has_part(c, p)) continue;
        const tb_sliding_cache *part = &c->part[p];
        s->saved[p] = malloc((size_t)part->planes * (n_pad ? n_pad : 1) * part->row_bytes);
        int rc = s->saved[p] ? tb_cache_snapshot(part, n_real, n_pad, s->saved[p], &s->n_saved) : TB_E_MEMORY;
        if (rc != TB_OK) {
            tb_kv_snapshot_free(s);
            return rc;
        }
    }
    return TB_OK;
}

void tb_kv_snapshot_free(tb_kv_snapshot *s) {
    for (int p = 0; p < 5; p++) free(s->saved[p]), s->saved[p] = NULL;
}

int tb_kv_rollback_padded(tb_kv_cache *c, tb_kv_snapshot *s) {
    int rc = TB_OK;
    for (int p = 0; p < 5 && rc == TB_OK; p++)
        if (s->saved[p]) rc = tb_cache_rollback(&c->part[p], s->n_pad, s->saved[p], s->n_saved);
    tb_kv_snapshot_free(s);
    return rc;
}

int tb_kv_drop(tb_kv_cache *c, int n) {
    static const uint8_t nothing[1]; /* a rollback that reinserts no row */
    for (int p = 0; p < 5; p++) {
        if (!c->part[p].rows) continue;
        int rc = tb_cache_rollback(&c->part[p], n, nothing, 0);
        if (rc != TB_OK) return rc;
    }
    return TB_OK;
}
