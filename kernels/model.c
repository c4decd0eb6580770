/* The decoder's forward pass (tb_model.h): one call of R rows through every layer against the caches.
 * Numerics: float32 throughout; every reduction in the fixed order of tb_linalg.h and exp/tanh from
 * plain arithmetic (tb_simd.h), so an unfused build gives the same bits on every target. Weight
 * matrices stay in their stored dtype and are dequantised block by block inside the matrix product. */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tb_linalg.h"
#include "tb_model.h"
#include "tb_model_internal.h"
#include "tb_parallel.h"

struct tb_engine {
    const tb_model *m;
    tb_engine_options o;
    tb_kv_cache cache[TB_MAX_LAYERS];
    int evicts[TB_MAX_LAYERS]; /* a sliding cache; the others must never overflow */
    int max_keys;              /* the most keys one call can attend: largest cache + max_rows */
    double matmul_seconds[2]; /* wall, CPU */
    /* scratch for one call */
    float *x, *h, *q, *k, *v, *qh, *kh, *vh, *att, *gate, *up, *t, *cos[2], *sin[2], *keys_k, *keys_v, *mask;
    int64_t *positions, *key_positions;
};

static double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* --- checks ---------------------------------------------------------------------------------------- */

static int matrix_ok(const tb_matrix *w, int rows, int cols) {
    if (!w->data || w->rows != rows || w->cols != cols) return 0;
    if (w->dtype == TB_INT8) return w->group > 0 && cols % w->group == 0 && w->scales;
    return w->dtype == TB_F32 || w->dtype == TB_F16;
}

int tb_model_check(const tb_model *m) {
    const tb_model_config *c = &m->cfg;
    if (c->vocab < 1 || c->hidden < 1 || c->layers < 1 || c->layers > TB_MAX_LAYERS || c->heads < 1 ||
        c->kv_heads < 1 || c->heads % c->kv_heads || c->head_dim < 2 || c->head_dim % 2 || c->mlp < 1 || c->window < 1)
        return TB_E_SHAPE;
    const int q = c->heads * c->head_dim, kv = c->kv_heads * c->head_dim;
    if (!matrix_ok(&m->embed, c->vocab, c->hidden) || !m->final_norm) return TB_E_SHAPE;
    for (int i = 0; i < c->layers; i++) {
        const tb_layer_weights *l = &m->layer[i];
        if (c->layer_type[i] != TB_LOCAL && c->layer_type[i] != TB_GLOBAL) return TB_E_SHAPE;
        if (!matrix_ok(&l->q, q, c->hidden) || !matrix_ok(&l->k, kv, c->hidden) || !matrix_ok(&l->v, kv, c->hidden) ||
            !matrix_ok(&l->o, c->hidden, q) || !matrix_ok(&l->gate, c->mlp, c->hidden) ||
            !matrix_ok(&l->up, c->mlp, c->hidden) || !matrix_ok(&l->down, c->hidden, c->mlp))
            return TB_E_SHAPE;
        if (!l->q_norm || !l->k_norm || !l->input_norm || !l->post_attn_norm || !l->pre_ff_norm || !l->post_ff_norm)
            return TB_E_SHAPE;
    }
    return TB_OK;
}

/* --- engine ---------------------------------------------------------------------------------------- */

void tb_engine_free(tb_engine *e) {
    if (!e) return;
    for (int i = 0; i < TB_MAX_LAYERS; i++) tb_kv_free(&e->cache[i]);
    float *scratch[] = {e->x, e->h, e->q, e->k, e->v, e->qh, e->kh, e->vh, e->att, e->gate, e->up, e->t, e->cos[0], e->cos[1],
                        e->sin[0], e->sin[1], e->keys_k, e->keys_v, e->mask};
    for (size_t i = 0; i < sizeof scratch / sizeof *scratch; i++) free(scratch[i]);
    free(e->positions), free(e->key_positions), free(e);
}

int tb_engine_create(const tb_model *m, const tb_engine_options *o, tb_engine **out) {
    *out = NULL;
    if (tb_model_check(m) != TB_OK) return TB_E_SHAPE;
    const tb_model_config *c = &m->cfg;
    if (o->max_rows < 1 || o->capacity < 1 || o->threads < 1 || (o->sliding && (o->sink < 0 || o->sink >= c->window)))
        return TB_E_SHAPE;
    tb_engine *e = calloc(1, sizeof *e);
    if (!e) return TB_E_MEMORY;
    e->m = m, e->o = *o;
    int largest = o->capacity;
    for (int i = 0; i < c->layers; i++) {
        e->evicts[i] = o->sliding && c->layer_type[i] == TB_LOCAL;
        const int rows = e->evicts[i] ? c->window : o->capacity;
        largest = rows > largest ? rows : largest;
        int rc = tb_kv_init(&e->cache[i], c->kv_heads, c->head_dim, rows, e->evicts[i] ? o->sink : 0, o->cache_dtype,
                            o->cache_group);
        if (rc != TB_OK) {
            tb_engine_free(e);
            return rc;
        }
    }
    const size_t r = (size_t)o->max_rows, hd = (size_t)c->head_dim;
    e->max_keys = largest + o->max_rows;
    const size_t sizes[] = {r * c->hidden, r * c->hidden, r * c->heads * hd, r * c->kv_heads * hd, r * c->kv_heads * hd,
                            r * c->heads * hd, r * c->kv_heads * hd, r * c->kv_heads * hd, r * c->heads * hd,
                            r * c->mlp, r * c->mlp, r * c->mlp,
                            r * hd, r * hd, r * hd, r * hd, (size_t)c->kv_heads * e->max_keys * hd,
                            (size_t)c->kv_heads * e->max_keys * hd, (size_t)c->heads * r * e->max_keys};
    float **slots[] = {&e->x, &e->h, &e->q, &e->k, &e->v, &e->qh, &e->kh, &e->vh, &e->att, &e->gate, &e->up, &e->t,
                       &e->cos[0],
                       &e->cos[1], &e->sin[0], &e->sin[1], &e->keys_k, &e->keys_v, &e->mask};
    int ok = 1;
    for (size_t i = 0; i < sizeof slots / sizeof *slots; i++) ok &= (*slots[i] = malloc(sizeof(float) * sizes[i])) != NULL;
    e->positions = malloc(sizeof(int64_t) * r * 2);
    e->key_positions = malloc(sizeof(int64_t) * e->max_keys);
    if (!ok || !e->positions || !e->key_positions) {
        tb_engine_free(e);
        return TB_E_MEMORY;
    }
    *out = e;
    return TB_OK;
}

tb_kv_cache *tb_engine_cache(tb_engine *e, int layer) { return &e->cache[layer]; }
int tb_engine_layers(const tb_engine *e) { return e->m->cfg.layers; }
int tb_engine_evicts(const tb_engine *e, int layer) { return e->evicts[layer]; }

void tb_engine_clear(tb_engine *e) {
    for (int i = 0; i < e->m->cfg.layers; i++) tb_kv_clear(&e->cache[i]);
}

int tb_engine_drop(tb_engine *e, int n) {
    for (int i = 0; i < e->m->cfg.layers; i++)
        if (n > tb_kv_count(&e->cache[i])) return TB_E_SHAPE;
    for (int i = 0; i < e->m->cfg.layers; i++) {
        int rc = tb_kv_drop(&e->cache[i], n);
        if (rc != TB_OK) return rc;
    }
    return TB_OK;
}

void tb_engine_matmul_seconds(const tb_engine *e, double *wall, double *cpu) {
    *wall = e->matmul_seconds[0], *cpu = e->matmul_seconds[1];
}

/* --- matrix products with weights in their stored dtype -------------------------------------------- */

/* 8 halves as float32, exactly: vf_from_f16 (F16C, or a rebias exact for normal numbers), the lanes
 * it flags (zeros, subnormals, infinities, NaNs; rare) by tb_f16_to_f32. */
static inline vf f16_lanes(const uint16_t *h) {
    int special;
    const vf v = vf_from_f16(h, &special);
    if (!special) return v;
    float t[VF_LANES];
    for (int l = 0; l < VF_LANES; l++) t[l] = tb_f16_to_f32(h[l]);
    return vf_load(t);
}

/* n halves to float32, exactly. */
static void f16_row(int n, const uint16_t *h, float *out) {
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store(out + i, f16_lanes(h + i));
    for (; i < n; i++) out[i] = tb_f16_to_f32(h[i]);
}

/* Row `row` of w as float32: in place for f32, else dequantised into `scratch` [cols]. */
static const float *weight_row(const tb_matrix *w, int row, float *scratch) {
    const size_t at = (size_t)row * w->cols;
    if (w->dtype == TB_F32) return (const float *)w->data + at;
    if (w->dtype == TB_F16) {
        f16_row(w->cols, (const uint16_t *)w->data + at, scratch);
    } else {
        const int8_t *q = (const int8_t *)w->data + at;
        const float *s = w->scales + (size_t)row * (w->cols / w->group);
        for (int g0 = 0; g0 < w->cols; g0 += w->group, s++)
            for (int i = g0; i < g0 + w->group; i++) scratch[i] = (float)q[i] * *s;
    }
    return scratch;
}

/* Output columns in blocks of OUT_BLOCK (the unit of the threads' static partition): a thread's
 * columns are ONE tb_gemm whose B is w^T read from the weight rows as they are (f32: a transposed B,
 * packed by transposition inside the product; f16 / int8: dequantised panel by panel as they are
 * packed), every output one chain over the input index in order, whatever the number of rows. Fewer
 * than DOT_ROWS input rows (a decode step, the LM head) stream the weight rows once instead, eight at
 * a time through dot8 (a decode step is bound by reading the weights: no packing, no copy of an f32
 * row). */
#define OUT_BLOCK 64
#define DOT_ROWS 4

typedef struct {
    const tb_matrix *w;
    const float *x;
    int rows;
    float *y;
} matmul_call;

/* Prefetching for the products that stream weight rows (dot8 on f32 rows in place, dot8_stored): the
 * eight rows of a call are one contiguous block of memory, and so are the next eight (the next call:
 * the following block of the same matrix). Each step prefetches its share of the next block in address
 * order, so the whole next block is requested while this one is summed, one block (4-64 KiB here)
 * ahead. Prefetching a fixed distance ahead within each row, as dot8_stored did, left the first lines
 * of every row to demand misses (rows of 0.5-8 KiB: eight short streams, which the hardware
 * prefetchers ramp up on too late): its decode steps ran at 1.5-2x the time to stream their weights. */
typedef struct {
    const char *p, *end;
} next_block;

static inline next_block next_block_of(const tb_matrix *w, int row0, size_t element_bytes) {
    const size_t row_bytes = (size_t)w->cols * element_bytes;
    const char *next = (const char *)w->data + (size_t)(row0 + 8) * row_bytes;
    next_block b = {next, row0 + 16 <= w->rows ? next + 8 * row_bytes : next}; /* nothing past the matrix */
    return b;
}

/* the next cache line of the next block, while there are some left */
static inline void prefetch_line(next_block *b) {
    if (b->p < b->end) __builtin_prefetch(b->p, 0, 3), b->p += 64;
}

/* Eight dot products of x with w[0..7] (dot()'s order: eight independent chains, so more weight rows
 * stream in flight); pf: the next block, four lines a step (f32 rows: 256 bytes a step), or none. */
static void dot8(const float *x, const float *const *w, int n, float *out, next_block *pf) {
    vf acc[8];
    for (int r = 0; r < 8; r++) acc[r] = vf_zero();
    int i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) {
        const vf xv = vf_load(x + i);
        prefetch_line(pf), prefetch_line(pf), prefetch_line(pf), prefetch_line(pf);
        for (int r = 0; r < 8; r++) acc[r] = vf_madd(xv, vf_load(w[r] + i), acc[r]);
    }
    for (int r = 0; r < 8; r++) {
        float s = vf_hsum(acc[r]);
        for (int k = i; k < n; k++) s = madd1(x[k], w[r][k], s);
        out[r] = s;
    }
}

/* the scale of weight row `row` of an int8 matrix for its inputs' group g */
static inline float group_scale(const tb_matrix *w, int row, int g) {
    return w->scales[(size_t)row * (w->cols / w->group) + g];
}

#if defined(__x86_64__) && defined(__AVX512F__) && defined(TB_AVX2)
/* int8 on AVX-512: two weight rows per 512-bit register, rows 2k and 2k + 1 in its low and high halves
 * and x's 8 lanes in both, so one vpmovsxbd, vcvtdq2ps, multiply by the two rows' scales and
 * multiply-add do 16 weights while each row keeps its own 8 lanes: every lane's chain is the 8-lane
 * code's, the same operations in the same order, so the same bits. All eight rows at once (4
 * accumulators and 4 scale registers of the 32). int8's conversion and multiply-add are 4 vector
 * operations per 8 weights, 3 of them on the two floating-point ports, and bound the step once the
 * weights stream (by port count 1.5 cycles per 8 weights of a row on 8 lanes, 1.25 here with the
 * pairing's one shuffle per 16; measured on warm weights, 10% less time). f16's conversion is one
 * operation (vcvtph2ps from memory), and pairing its rows costs an insert per 16 weights, as much as
 * it saves (measured equal): f16 stays on 8 lanes. */
static inline __m512 madd16(__m512 a, __m512 b, __m512 c) {
#if TB_MADD_FUSED
    return _mm512_fmadd_ps(a, b, c);
#else
    return _mm512_add_ps(_mm512_mul_ps(a, b), c);
#endif
}

static void dot8_int8_wide(const float *x, const tb_matrix *w, int row0, vf acc[8]) {
    const int n = w->cols, groups = n / w->group;
    const int8_t *q = (const int8_t *)w->data + (size_t)row0 * n;
    next_block pf = next_block_of(w, row0, 1);
    __m512 a[4];
    for (int k = 0; k < 4; k++) a[k] = _mm512_setzero_ps();
    for (int g = 0, i = 0; g < groups; g++) {
        __m512 s[4];
        for (int k = 0; k < 4; k++)
            s[k] = _mm512_mask_mov_ps(_mm512_set1_ps(group_scale(w, row0 + 2 * k, g)), 0xff00,
                                      _mm512_set1_ps(group_scale(w, row0 + 2 * k + 1, g)));
        for (const int end = i + w->group; i < end; i += VF_LANES) {
            /* x[i..i+7] in both halves */
            const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + i))));
            prefetch_line(&pf); /* 64 bytes a step */
            for (int k = 0; k < 4; k++) {
                const int8_t *r = q + (size_t)(2 * k) * n + i;
                const __m128i two = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)r),
                                                       _mm_loadl_epi64((const __m128i *)(r + n)));
                a[k] = madd16(xv, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two)), s[k]), a[k]);
            }
        }
    }
    for (int k = 0; k < 4; k++) {
        acc[2 * k] = _mm512_castps512_ps256(a[k]);
        acc[2 * k + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[k]), 1));
    }
}
#endif

/* dot8 on weight rows row0..row0+7 of an f16 or int8 matrix as they are stored, each weight converted
 * in registers (f16: f16_lanes; int8: q times its group's scale, rounded once; the group a multiple
 * of 8, so n is too): the values weight_row writes, summed in dot8's order, so the bits of dot8 on
 * weight_row's rows. The decode step reads each weight once, at its stored size, and writes nothing;
 * it prefetches the next block as dot8 does, 128 bytes a step for f16, 64 for int8. */
static void dot8_stored(const float *x, const tb_matrix *w, int row0, float *out) {
    const int n = w->cols;
    vf acc[8];
    if (w->dtype == TB_F16) {
        const uint16_t *h = (const uint16_t *)w->data + (size_t)row0 * n;
        next_block pf = next_block_of(w, row0, 2);
        for (int r = 0; r < 8; r++) acc[r] = vf_zero();
        int i = 0;
        for (; i + VF_LANES <= n; i += VF_LANES) {
            const vf xv = vf_load(x + i);
            prefetch_line(&pf), prefetch_line(&pf); /* 128 bytes a step */
            for (int r = 0; r < 8; r++) acc[r] = vf_madd(xv, f16_lanes(h + (size_t)r * n + i), acc[r]);
        }
        for (int r = 0; r < 8; r++) {
            float s = vf_hsum(acc[r]);
            for (int k = i; k < n; k++) s = madd1(x[k], tb_f16_to_f32(h[(size_t)r * n + k]), s);
            out[r] = s;
        }
        return;
    }
#if defined(__x86_64__) && defined(__AVX512F__) && defined(TB_AVX2)
    dot8_int8_wide(x, w, row0, acc);
#else
    /* int8 on 8 lanes: four rows at a time (eight rows' accumulators and scales outnumber 16 vector
     * registers), group by group, its scales set once; each row's sum is its own, so the order per row
     * is dot8's */
    const int groups = n / w->group;
    next_block pf = next_block_of(w, row0, 1);
    for (int r0 = 0; r0 < 8; r0 += 4) {
        const int8_t *q = (const int8_t *)w->data + (size_t)(row0 + r0) * n;
        vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero();
        for (int g = 0, i = 0; g < groups; g++) {
            const vf s0 = vf_set1(group_scale(w, row0 + r0, g)), s1 = vf_set1(group_scale(w, row0 + r0 + 1, g));
            const vf s2 = vf_set1(group_scale(w, row0 + r0 + 2, g)), s3 = vf_set1(group_scale(w, row0 + r0 + 3, g));
            for (const int end = i + w->group; i < end; i += VF_LANES) {
                const vf xv = vf_load(x + i);
                if (i & 8) prefetch_line(&pf); /* 32 bytes a step: a line every other step */
                a0 = vf_madd(xv, vf_mul(vf_from_i8(q + i), s0), a0);
                a1 = vf_madd(xv, vf_mul(vf_from_i8(q + n + i), s1), a1);
                a2 = vf_madd(xv, vf_mul(vf_from_i8(q + 2 * (size_t)n + i), s2), a2);
                a3 = vf_madd(xv, vf_mul(vf_from_i8(q + 3 * (size_t)n + i), s3), a3);
            }
        }
        acc[r0] = a0, acc[r0 + 1] = a1, acc[r0 + 2] = a2, acc[r0 + 3] = a3;
    }
#endif
    for (int r = 0; r < 8; r++) out[r] = vf_hsum(acc[r]); /* no tail: n is a multiple of the group */
}

static void dot_block(const matmul_call *c, int o0, int nb, float *scratch) {
    const int in = c->w->cols, out = c->w->rows;
    int j = 0;
    const int stored = c->w->dtype == TB_F16 || (c->w->dtype == TB_INT8 && c->w->group % VF_LANES == 0);
    for (; stored && j + 8 <= nb; j += 8)
        for (int r = 0; r < c->rows; r++) {
            float s[8];
            dot8_stored(c->x + (size_t)r * in, c->w, o0 + j, s);
            memcpy(c->y + (size_t)r * out + o0 + j, s, sizeof s);
        }
    for (; j + 8 <= nb; j += 8) {
        const float *w[8];
        for (int r = 0; r < 8; r++) w[r] = weight_row(c->w, o0 + j + r, scratch + (size_t)r * in);
        next_block pf = next_block_of(c->w, o0 + j, sizeof(float));
        if (c->w->dtype != TB_F32) pf.end = pf.p; /* rows dequantised into scratch: nothing to prefetch */
        for (int r = 0; r < c->rows; r++) {
            float s[8];
            dot8(c->x + (size_t)r * in, w, in, s, &pf);
            memcpy(c->y + (size_t)r * out + o0 + j, s, sizeof s);
        }
    }
    for (; j + 4 <= nb; j += 4) {
        const float *w0 = weight_row(c->w, o0 + j, scratch), *w1 = weight_row(c->w, o0 + j + 1, scratch + in);
        const float *w2 = weight_row(c->w, o0 + j + 2, scratch + 2 * in), *w3 = weight_row(c->w, o0 + j + 3, scratch + 3 * in);
        for (int r = 0; r < c->rows; r++) {
            float s[4];
            dot4(c->x + (size_t)r * in, w0, w1, w2, w3, in, s);
            memcpy(c->y + (size_t)r * out + o0 + j, s, sizeof s);
        }
    }
    for (; j < nb; j++) {
        const float *wr = weight_row(c->w, o0 + j, scratch);
        for (int r = 0; r < c->rows; r++) c->y[(size_t)r * out + o0 + j] = dot(c->x + (size_t)r * in, wr, in);
    }
}

/* The weight rows from o0 on, as the B = w^T of one product. */
typedef struct {
    const tb_matrix *w;
    int o0;
} weights_view;

/* tb_gemm_b.rows for f16 / int8 weights: columns n0.. of w^T (weight rows o0 + n0..) over inputs
 * k0..k0+kc-1 as float32 rows, exactly as weight_row dequantises them. */
static void dequantised_rows(const tb_gemm_b *b, int n0, int nc, int k0, int kc, float *dst) {
    const weights_view *view = b->ctx;
    const tb_matrix *w = view->w;
    n0 += view->o0;
    for (int j = 0; j < nc; j++) {
        const size_t at = (size_t)(n0 + j) * w->cols;
        float *d = dst + (size_t)j * kc;
        if (w->dtype == TB_F16) {
            f16_row(kc, (const uint16_t *)w->data + at + k0, d);
            continue;
        }
        const int8_t *q = (const int8_t *)w->data + at;
        const float *scales = w->scales + (size_t)(n0 + j) * (w->cols / w->group);
        for (int k = k0; k < k0 + kc;) {
            const int g = k / w->group, end = (g + 1) * w->group < k0 + kc ? (g + 1) * w->group : k0 + kc;
            const float sc = scales[g];
            for (; k < end; k++) d[k - k0] = (float)q[k] * sc;
        }
    }
}

static void gemm_block(const matmul_call *c, int o0, int nb) {
    const int in = c->w->cols, out = c->w->rows;
    const weights_view view = {c->w, o0};
    tb_gemm_b b = {NULL, 1, in, NULL, &view};
    if (c->w->dtype == TB_F32) b.p = (const float *)c->w->data + (size_t)o0 * in;
    else b.rows = dequantised_rows;
    tb_gemm(c->rows, nb, in, c->x, in, &b, c->y + o0, out, 0, 0);
}

static int matmul_blocks(void *arg, int begin, int end) {
    const matmul_call *c = arg;
    const int in = c->w->cols, out = c->w->rows, by_dot = c->rows < DOT_ROWS;
    const int o0 = begin * OUT_BLOCK, o1 = end * OUT_BLOCK < out ? end * OUT_BLOCK : out;
    if (!by_dot) {
        gemm_block(c, o0, o1 - o0);
        return TB_OK;
    }
    float *scratch = malloc(sizeof(float) * 8 * in);
    if (!scratch) return TB_E_MEMORY;
    for (int b = begin; b < end; b++) {
        const int b0 = b * OUT_BLOCK, nb = out - b0 < OUT_BLOCK ? out - b0 : OUT_BLOCK;
        dot_block(c, b0, nb, scratch);
    }
    free(scratch);
    return TB_OK;
}

/* y [rows, w->rows] = x [rows, w->cols] w^T */
static int matmul(tb_engine *e, const tb_matrix *w, const float *x, int rows, float *y) {
    matmul_call c = {w, x, rows, y};
    const double wall = clock_seconds(CLOCK_MONOTONIC), cpu = clock_seconds(CLOCK_PROCESS_CPUTIME_ID);
    int rc = tb_parallel_for((w->rows + OUT_BLOCK - 1) / OUT_BLOCK, e->o.threads, matmul_blocks, &c);
    e->matmul_seconds[0] += clock_seconds(CLOCK_MONOTONIC) - wall;
    e->matmul_seconds[1] += clock_seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu;
    return rc;
}

/* --- element-wise pieces --------------------------------------------------------------------------- */

/* Gemma's RMSNorm of `rows` rows of n: y = x / sqrt(mean(x^2) + eps) * (1 + w); y may alias x. */
static void rms_norm(const float *x, const float *w, int rows, int n, float eps, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float *yr = y + (size_t)r * n;
        const float rms = sqrtf(dot(xr, xr, n) / (float)n + eps);
        for (int i = 0; i < n; i++) yr[i] = xr[i] / rms * (1.0f + w[i]);
    }
}

/* tanh(x) = 1 - 2 / (exp(2x) + 1) in place, with the portable exp. */
static void tanh_n(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] *= 2.0f;
    exp_n(x, x, n);
    for (int i = 0; i < n; i++) x[i] = 1.0f - 2.0f / (x[i] + 1.0f);
}

/* gate = gelu_tanh(gate) * up over n values (t: scratch for the tanh). */
static void gelu_times(float *gate, const float *up, float *t, int n) {
    const float c = (float)sqrt(2.0 / 3.14159265358979323846);
    for (int i = 0; i < n; i++) {
        const float x = gate[i];
        t[i] = c * (x + 0.044715f * (x * x * x));
    }
    tanh_n(t, n);
    for (int i = 0; i < n; i++) gate[i] = 0.5f * gate[i] * (1.0f + t[i]) * up[i];
}

/* cos and sin [rows, head_dim] for table positions start.. (rotate-half: frequencies repeated over both
 * halves, each divided by the linear scaling); angles in float64, then float32, as refimpl.gemma.rope_tables. */
static void rope_tables(int64_t start, int rows, int hd, double base, double scaling, float *cos_out, float *sin_out) {
    const int half = hd / 2;
    for (int j = 0; j < half; j++) {
        const double inv_freq = pow(base, -(double)(2 * j) / (double)hd) / scaling;
        for (int r = 0; r < rows; r++) {
            const double angle = (double)(start + r) * inv_freq;
            const float c = (float)cos(angle), s = (float)sin(angle);
            cos_out[(size_t)r * hd + j] = cos_out[(size_t)r * hd + j + half] = c;
            sin_out[(size_t)r * hd + j] = sin_out[(size_t)r * hd + j + half] = s;
        }
    }
}

/* x [rows, heads * hd] per head: RMSNorm over hd with w, RoPE, then heads-first into out [heads, rows, hd]. */
static void norm_rope_heads(const float *x, int rows, int heads, int hd, const float *w, float eps, const float *cos_t,
                            const float *sin_t, float *out) {
    const int half = hd / 2;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float *y = out + ((size_t)h * rows + r) * hd;
            rms_norm(x + ((size_t)r * heads + h) * hd, w, 1, hd, eps, y);
            const float *c = cos_t + (size_t)r * hd, *s = sin_t + (size_t)r * hd;
            for (int j = 0; j < half; j++) {
                const float a = y[j], b = y[j + half];
                y[j] = a * c[j] + -b * s[j];
                y[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
}

static void heads_first(const float *x, int rows, int heads, int hd, float *out) {
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            memcpy(out + ((size_t)h * rows + r) * hd, x + ((size_t)r * heads + h) * hd, sizeof(float) * hd);
}

static void rows_first(const float *x, int rows, int heads, int hd, float *out) {
    for (int h = 0; h < heads; h++)
        for (int r = 0; r < rows; r++)
            memcpy(out + ((size_t)r * heads + h) * hd, x + ((size_t)h * rows + r) * hd, sizeof(float) * hd);
}

#define MASKED (-1e30f)

/* The additive mask [heads, rows, keys] of refimpl.gemma.attention_mask: keys are the held rows then
 * the call's own; a key at position -1 is never attended by a real row; a real row at position a
 * attends keys in [0, a], a local layer's only those > a - window; a pad row only its own column. */
static void build_mask(const int64_t *query_pos, int rows, const int64_t *key_pos, int keys, int local, int window,
                       int heads, float *mask) {
    for (int r = 0; r < rows; r++) {
        float *m = mask + (size_t)r * keys;
        const int64_t a = query_pos[r];
        for (int j = 0; j < keys; j++) {
            const int64_t p = key_pos[j];
            int allowed = p >= 0 && p <= a && (!local || p >= a - window + 1);
            if (a < 0) allowed = j == keys - rows + r;
            m[j] = allowed ? 0.0f : MASKED;
        }
    }
    for (int h = 1; h < heads; h++) memcpy(mask + (size_t)h * rows * keys, mask, sizeof(float) * rows * keys);
}

/* --- one call -------------------------------------------------------------------------------------- */

static int layer(tb_engine *e, int i, int rows, int keep) {
    const tb_model_config *c = &e->m->cfg;
    const tb_layer_weights *w = &e->m->layer[i];
    const int hd = c->head_dim, type = c->layer_type[i];
    tb_kv_cache *cache = &e->cache[i];
    const int held = tb_kv_count(cache), keys = held + rows;
    int rc;

    rms_norm(e->x, w->input_norm, rows, c->hidden, c->rms_eps, e->h);
    if ((rc = matmul(e, &w->q, e->h, rows, e->q)) || (rc = matmul(e, &w->k, e->h, rows, e->k)) ||
        (rc = matmul(e, &w->v, e->h, rows, e->v)))
        return rc;
    norm_rope_heads(e->q, rows, c->heads, hd, w->q_norm, c->rms_eps, e->cos[type], e->sin[type], e->qh);
    norm_rope_heads(e->k, rows, c->kv_heads, hd, w->k_norm, c->rms_eps, e->cos[type], e->sin[type], e->kh);
    heads_first(e->v, rows, c->kv_heads, hd, e->vh);

    /* keys: the held rows, then this call's own rows; read in place from a float32 cache with room
     * after its held rows, else from a float32 copy */
    const float *keys_k, *keys_v;
    int kv_rows;
    const int staged = tb_kv_stage(cache, e->kh, e->vh, rows, &keys_k, &keys_v, &kv_rows);
    if (staged) {
        tb_kv_positions(cache, e->key_positions);
    } else {
        tb_kv_read(cache, e->keys_k, e->keys_v, e->key_positions, keys);
        for (int h = 0; h < c->kv_heads; h++) {
            memcpy(e->keys_k + ((size_t)h * keys + held) * hd, e->kh + (size_t)h * rows * hd, sizeof(float) * rows * hd);
            memcpy(e->keys_v + ((size_t)h * keys + held) * hd, e->vh + (size_t)h * rows * hd, sizeof(float) * rows * hd);
        }
        keys_k = e->keys_k, keys_v = e->keys_v, kv_rows = keys;
    }
    memcpy(e->key_positions + held, e->positions, sizeof(int64_t) * rows);
    build_mask(e->positions, rows, e->key_positions, keys, type == TB_LOCAL, c->window, c->heads, e->mask);
    rc = tb_attention(c->heads, c->kv_heads, rows, keys, kv_rows, hd, e->qh, keys_k, keys_v, e->mask, c->attn_scale,
                      e->att, e->o.threads);
    if (staged) tb_kv_unstage(cache, rows);
    if (rc) return rc;
    /* the chunk's rows join the cache once this layer has read it */
    if ((rc = tb_kv_append(cache, e->kh, e->vh, rows, e->positions, keep))) return rc;

    rows_first(e->att, rows, c->heads, hd, e->q);
    if ((rc = matmul(e, &w->o, e->q, rows, e->h))) return rc;
    rms_norm(e->h, w->post_attn_norm, rows, c->hidden, c->rms_eps, e->h);
    for (size_t j = 0; j < (size_t)rows * c->hidden; j++) e->x[j] += e->h[j];

    rms_norm(e->x, w->pre_ff_norm, rows, c->hidden, c->rms_eps, e->h);
    if ((rc = matmul(e, &w->gate, e->h, rows, e->gate)) || (rc = matmul(e, &w->up, e->h, rows, e->up))) return rc;
    gelu_times(e->gate, e->up, e->t, rows * c->mlp);
    if ((rc = matmul(e, &w->down, e->gate, rows, e->h))) return rc;
    rms_norm(e->h, w->post_ff_norm, rows, c->hidden, c->rms_eps, e->h);
    for (size_t j = 0; j < (size_t)rows * c->hidden; j++) e->x[j] += e->h[j];
    return TB_OK;
}

static int prefill_with_past(tb_engine *e, const int32_t *tokens, int n, int rows, int64_t start, int keep,
                             int select, float *logits) {
    const tb_model_config *c = &e->m->cfg;
    if (rows < 1 || rows > e->o.max_rows || n < 0 || n > rows || keep < 0 || keep > rows || start < 0 ||
        (logits && (select < 0 || select >= rows)))
        return TB_E_REFUSED;
    for (int r = 0; r < n; r++)
        if (tokens[r] < 0 || tokens[r] >= c->vocab) return TB_E_REFUSED;
    for (int i = 0; i < c->layers; i++)
        if (!e->evicts[i] && tb_kv_count(&e->cache[i]) + keep > e->cache[i].part[TB_KV_K].window) return TB_E_REFUSED;

    const float scale = (float)sqrt((double)c->hidden);
    for (int r = 0; r < rows; r++) {
        const float *row = weight_row(&e->m->embed, r < n ? tokens[r] : 0, e->h);
        for (int j = 0; j < c->hidden; j++) e->x[(size_t)r * c->hidden + j] = row[j] * scale;
        e->positions[r] = r < n ? start + r : -1;
    }
    rope_tables(start, rows, c->head_dim, c->rope_local, 1.0, e->cos[TB_LOCAL], e->sin[TB_LOCAL]);
    rope_tables(start, rows, c->head_dim, c->rope_global, c->rope_global_scaling, e->cos[TB_GLOBAL], e->sin[TB_GLOBAL]);
    for (int i = 0; i < c->layers; i++) {
        int rc = layer(e, i, rows, keep);
        if (rc != TB_OK) return rc;
    }
    if (!logits) return TB_OK;
    rms_norm(e->x + (size_t)select * c->hidden, e->m->final_norm, 1, c->hidden, c->rms_eps, e->h);
    int rc = matmul(e, &e->m->embed, e->h, 1, logits);
    if (rc == TB_OK && c->softcap > 0.0f) {
        for (int v = 0; v < c->vocab; v++) logits[v] /= c->softcap;
        tanh_n(logits, c->vocab);
        for (int v = 0; v < c->vocab; v++) logits[v] *= c->softcap;
    }
    return rc;
}

int tb_model_prefill_with_past(tb_engine *e, const int32_t *tokens, int n, int rows, int64_t start, int keep,
                               int select, float *logits) {
    TB_FP_ENTER();
    return TB_FP_LEAVE(prefill_with_past(e, tokens, n, rows, start, keep, select, logits));
}

int tb_model_decode_with_past(tb_engine *e, int32_t token, int64_t position, float *logits) {
    return tb_model_prefill_with_past(e, &token, 1, 1, position, 1, 0, logits);
}
