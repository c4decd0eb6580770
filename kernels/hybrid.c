/* The hybrid decoder's forward pass (tb_hybrid.h): one call of R rows through every layer, continuing
 * from the carried conv states, recurrent states and KV caches.
 *
 * Numerics: float32 throughout. Every matrix product is tb_linalg.h's gemm_nn, whose every output is
 * one chain over the inner index in order whatever the number of rows or columns; attention computes
 * each row's scores over exactly the keys it may see, its softmax sums in key order, and masked keys
 * weigh an exact 0; exp comes from tb_simd.h's plain arithmetic, RoPE angles from libm's double cos
 * and sin. So a row's result never depends on the rows beside it in a call (the padded tail's
 * byte-identical oracle rests on this), and an unfused build gives the same bits on every target. */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tb_hybrid.h"
#include "tb_linalg.h"
#include "tb_parallel.h"

struct tb_hybrid_engine {
    const tb_hybrid_model *m;
    tb_hybrid_options o;
    int64_t length;
    int conv_dim, key_dim, value_dim;
    double gdn_seconds[2]; /* wall, CPU: in the recurrence since the engine was created */
    float *conv[TB_MAX_LAYERS], *rec[TB_MAX_LAYERS]; /* linear layers */
    float *k[TB_MAX_LAYERS], *v[TB_MAX_LAYERS];      /* full layers: [kv_heads, capacity, head_dim] */
    /* scratch for one call of up to max_rows rows */
    float *x, *h, *y, *rows, *mix, *z, *a, *b, *g, *beta, *gdn_out, *qg, *kr, *vr, *qh, *att, *gate, *up, *cos, *sin;
};

/* --- checks ---------------------------------------------------------------------------------------- */

static int matrix_ok(const tb_matrix *w, int rows, int cols) {
    return w->data && w->dtype == TB_F32 && w->rows == rows && w->cols == cols;
}

static int conv_dim(const tb_hybrid_config *c) { return 2 * c->k_heads * c->linear_dim + c->v_heads * c->linear_dim; }

int tb_hybrid_check(const tb_hybrid_model *m) {
    const tb_hybrid_config *c = &m->cfg;
    if (c->vocab < 1 || c->hidden < 1 || c->layers < 1 || c->layers > TB_MAX_LAYERS || c->mlp < 1 || c->heads < 1 ||
        c->kv_heads < 1 || c->heads % c->kv_heads || c->head_dim < 2 || c->k_heads < 1 || c->v_heads < 1 ||
        c->v_heads % c->k_heads || c->linear_dim < 1 || c->conv_kernel < 1 || c->rotary_dim < 2 ||
        c->rotary_dim % 2 || c->rotary_dim > c->head_dim || !(c->rope_theta > 0.0) || !(c->rms_eps >= 0.0f))
        return TB_E_SHAPE;
    const int hid = c->hidden, q = c->heads * c->head_dim, kv = c->kv_heads * c->head_dim;
    const int vd = c->v_heads * c->linear_dim;
    if (!matrix_ok(&m->embed, c->vocab, hid) || !m->final_norm || (!c->tied && !matrix_ok(&m->lm_head, c->vocab, hid)))
        return TB_E_SHAPE;
    for (int i = 0; i < c->layers; i++) {
        const tb_hybrid_layer *l = &m->layer[i];
        if (!matrix_ok(&l->gate, c->mlp, hid) || !matrix_ok(&l->up, c->mlp, hid) || !matrix_ok(&l->down, hid, c->mlp) ||
            !l->input_norm || !l->post_attn_norm)
            return TB_E_SHAPE;
        if (c->layer_type[i] == TB_HYBRID_LINEAR) {
            if (!matrix_ok(&l->qkv, conv_dim(c), hid) || !matrix_ok(&l->z, vd, hid) || !matrix_ok(&l->b, c->v_heads, hid) ||
                !matrix_ok(&l->a, c->v_heads, hid) || !matrix_ok(&l->out, hid, vd) || !l->conv || !l->dt_bias ||
                !l->a_log || !l->norm)
                return TB_E_SHAPE;
        } else if (c->layer_type[i] == TB_HYBRID_FULL) {
            if (!matrix_ok(&l->q, 2 * q, hid) || !matrix_ok(&l->k, kv, hid) || !matrix_ok(&l->v, kv, hid) ||
                !matrix_ok(&l->o, hid, q) || !l->q_norm || !l->k_norm)
                return TB_E_SHAPE;
        } else {
            return TB_E_SHAPE;
        }
    }
    return TB_OK;
}

/* --- engine ---------------------------------------------------------------------------------------- */

void tb_hybrid_free(tb_hybrid_engine *e) {
    if (!e) return;
    for (int i = 0; i < TB_MAX_LAYERS; i++) free(e->conv[i]), free(e->rec[i]), free(e->k[i]), free(e->v[i]);
    float *scratch[] = {e->x, e->h, e->y, e->rows, e->mix, e->z, e->a, e->b, e->g, e->beta, e->gdn_out,
                        e->qg, e->kr, e->vr, e->qh, e->att, e->gate, e->up, e->cos, e->sin};
    for (size_t i = 0; i < sizeof scratch / sizeof *scratch; i++) free(scratch[i]);
    free(e);
}

int tb_hybrid_create(const tb_hybrid_model *m, const tb_hybrid_options *o, tb_hybrid_engine **out) {
    *out = NULL;
    if (tb_hybrid_check(m) != TB_OK) return TB_E_SHAPE;
    if (o->max_rows < 1 || o->capacity < o->max_rows || o->threads < 1 || o->gdn_form < TB_GDN_SERIAL ||
        o->gdn_form > TB_GDN_NONE || (o->gdn_form == TB_GDN_CHUNKWISE && o->gdn_chunk < 1) ||
        o->gdn_precision < TB_PRECISION_F32 || o->gdn_precision > TB_PRECISION_FP16_ACC16 ||
        (o->gdn_precision != TB_PRECISION_F32 && o->gdn_form != TB_GDN_CHUNKWISE))
        return TB_E_SHAPE;
    const tb_hybrid_config *c = &m->cfg;
    tb_hybrid_engine *e = calloc(1, sizeof *e);
    if (!e) return TB_E_MEMORY;
    e->m = m, e->o = *o;
    e->key_dim = c->k_heads * c->linear_dim, e->value_dim = c->v_heads * c->linear_dim, e->conv_dim = conv_dim(c);
    const size_t d = (size_t)c->linear_dim, cap = (size_t)o->capacity, hd = (size_t)c->head_dim;
    int ok = 1;
    for (int i = 0; i < c->layers; i++) {
        if (c->layer_type[i] == TB_HYBRID_LINEAR) {
            ok &= (e->conv[i] = malloc(sizeof(float) * (size_t)(c->conv_kernel - 1 ? c->conv_kernel - 1 : 1) * e->conv_dim)) != NULL;
            ok &= (e->rec[i] = malloc(sizeof(float) * c->v_heads * d * d)) != NULL;
        } else {
            ok &= (e->k[i] = malloc(sizeof(float) * c->kv_heads * cap * hd)) != NULL;
            ok &= (e->v[i] = malloc(sizeof(float) * c->kv_heads * cap * hd)) != NULL;
        }
    }
    const size_t r = (size_t)o->max_rows, hid = (size_t)c->hidden;
    const size_t sizes[] = {r * hid, r * hid, r * (hid > (size_t)c->vocab ? hid : (size_t)c->vocab),
                            (r + c->conv_kernel - 1) * e->conv_dim, r * e->conv_dim, r * e->value_dim,
                            r * c->v_heads, r * c->v_heads, r * c->v_heads, r * c->v_heads, r * e->value_dim,
                            r * 2 * c->heads * hd, r * c->kv_heads * hd, r * c->kv_heads * hd, r * c->heads * hd,
                            r * c->heads * hd, r * c->mlp, r * c->mlp, r * c->rotary_dim, r * c->rotary_dim};
    float **slots[] = {&e->x, &e->h, &e->y, &e->rows, &e->mix, &e->z, &e->a, &e->b, &e->g, &e->beta, &e->gdn_out,
                       &e->qg, &e->kr, &e->vr, &e->qh, &e->att, &e->gate, &e->up, &e->cos, &e->sin};
    for (size_t i = 0; i < sizeof slots / sizeof *slots; i++) ok &= (*slots[i] = malloc(sizeof(float) * sizes[i])) != NULL;
    if (!ok) {
        tb_hybrid_free(e);
        return TB_E_MEMORY;
    }
    tb_hybrid_clear(e);
    *out = e;
    return TB_OK;
}

void tb_hybrid_clear(tb_hybrid_engine *e) {
    const tb_hybrid_config *c = &e->m->cfg;
    const size_t d = (size_t)c->linear_dim, kv = (size_t)c->kv_heads * e->o.capacity * c->head_dim;
    for (int i = 0; i < c->layers; i++) {
        if (c->layer_type[i] == TB_HYBRID_LINEAR) {
            memset(e->conv[i], 0, sizeof(float) * (size_t)(c->conv_kernel - 1) * e->conv_dim);
            memset(e->rec[i], 0, sizeof(float) * c->v_heads * d * d);
        } else {
            memset(e->k[i], 0, sizeof(float) * kv);
            memset(e->v[i], 0, sizeof(float) * kv);
        }
    }
    e->length = 0;
}

int64_t tb_hybrid_length(const tb_hybrid_engine *e) { return e->length; }

static double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void tb_hybrid_gdn_seconds(const tb_hybrid_engine *e, double *wall, double *cpu) {
    *wall = e->gdn_seconds[0], *cpu = e->gdn_seconds[1];
}
float *tb_hybrid_conv(tb_hybrid_engine *e, int layer) { return e->conv[layer]; }
float *tb_hybrid_recurrent(tb_hybrid_engine *e, int layer) { return e->rec[layer]; }
float *tb_hybrid_keys(tb_hybrid_engine *e, int layer) { return e->k[layer]; }
float *tb_hybrid_values(tb_hybrid_engine *e, int layer) { return e->v[layer]; }

/* --- matrix products --------------------------------------------------------------------------------- */

/* Output columns in blocks of OUT_BLOCK: the block's weight rows transposed once into [in, block], then
 * gemm_nn with all the input rows (one chain over the input index per output, whatever the rows). */
#define OUT_BLOCK 64

typedef struct {
    const tb_matrix *w;
    const float *x;
    int rows;
    float *y;
} matmul_call;

static int matmul_blocks(void *arg, int begin, int end) {
    const matmul_call *c = arg;
    const int in = c->w->cols, out = c->w->rows;
    float *bt = malloc(sizeof(float) * (size_t)in * OUT_BLOCK);
    if (!bt) return TB_E_MEMORY;
    const float *w = c->w->data;
    for (int blk = begin; blk < end; blk++) {
        const int o0 = blk * OUT_BLOCK, nb = out - o0 < OUT_BLOCK ? out - o0 : OUT_BLOCK;
        for (int j = 0; j < nb; j++) {
            const float *wr = w + (size_t)(o0 + j) * in;
            for (int i = 0; i < in; i++) bt[(size_t)i * nb + j] = wr[i];
        }
        gemm_nn(c->rows, nb, in, c->x, in, bt, nb, c->y + o0, out, 0, 0);
    }
    free(bt);
    return TB_OK;
}

/* y [rows, w->rows] = x [rows, w->cols] w^T */
static int matmul(const tb_hybrid_engine *e, const tb_matrix *w, const float *x, int rows, float *y) {
    matmul_call c = {w, x, rows, y};
    return tb_parallel_for((w->rows + OUT_BLOCK - 1) / OUT_BLOCK, e->o.threads, matmul_blocks, &c);
}

/* --- element-wise pieces ----------------------------------------------------------------------------- */

/* The decoder's RMSNorm of `rows` rows of n: y = x / sqrt(mean(x^2) + eps) * (1 + w); y may alias x. */
static void rms_norm(const float *x, const float *w, int rows, int n, float eps, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float *yr = y + (size_t)r * n;
        const float rms = sqrtf(dot(xr, xr, n) / (float)n + eps);
        for (int i = 0; i < n; i++) yr[i] = xr[i] / rms * (1.0f + w[i]);
    }
}

/* x / sqrt(||x||^2 + 1e-6) over n values in place (the FLA library's l2norm, as transformers uses it) */
static void l2_norm(float *x, int n) {
    const float norm = sqrtf(dot(x, x, n) + 1e-6f);
    for (int i = 0; i < n; i++) x[i] /= norm;
}

/* x / (1 + exp(-x)) in place (exp_n is element-wise: blocks give the same bits) */
static void silu_n(float *x, size_t n) {
    float t[256];
    for (size_t i0 = 0; i0 < n; i0 += 256) {
        const int m = n - i0 < 256 ? (int)(n - i0) : 256;
        for (int i = 0; i < m; i++) t[i] = -x[i0 + i];
        exp_n(t, t, m);
        for (int i = 0; i < m; i++) x[i0 + i] = x[i0 + i] / (1.0f + t[i]);
    }
}

static float sigmoid1(float x) { return 1.0f / (1.0f + exp1(-x)); }

/* log(1 + exp(x)), torch's threshold: x itself above 20 */
static float softplus1(float x) { return x > 20.0f ? x : (float)log1p((double)exp1(x)); }

/* cos and sin [rows, rotary] for positions start.. (rotate-half: each frequency over both halves);
 * angles in float64, then float32, as refimpl.gemma.rope_tables. */
static void rope_tables(int64_t start, int rows, int rotary, double base, float *cos_out, float *sin_out) {
    const int half = rotary / 2;
    for (int j = 0; j < half; j++) {
        const double inv_freq = pow(base, -(double)(2 * j) / (double)rotary);
        for (int r = 0; r < rows; r++) {
            const double angle = (double)(start + r) * inv_freq;
            const float c = (float)cos(angle), s = (float)sin(angle);
            cos_out[(size_t)r * rotary + j] = cos_out[(size_t)r * rotary + j + half] = c;
            sin_out[(size_t)r * rotary + j] = sin_out[(size_t)r * rotary + j + half] = s;
        }
    }
}

/* RMSNorm over one head of hd values with (1 + w), then RoPE on its first `rotary` dims (row tables). */
static void norm_rope(const float *x, const float *w, int hd, int rotary, float eps, const float *c, const float *s,
                      float *y) {
    rms_norm(x, w, 1, hd, eps, y);
    const int half = rotary / 2;
    for (int j = 0; j < half; j++) {
        const float a = y[j], b = y[j + half];
        y[j] = a * c[j] + -b * s[j];
        y[j + half] = b * c[j + half] + a * s[j + half];
    }
}

/* --- gated DeltaNet layer ---------------------------------------------------------------------------- */

static int linear_layer(tb_hybrid_engine *e, int i, int rows, int n) {
    const tb_hybrid_config *c = &e->m->cfg;
    const tb_hybrid_layer *w = &e->m->layer[i];
    const int K = c->conv_kernel, cd = e->conv_dim, d = c->linear_dim, H = c->v_heads;
    int rc;
    /* the conv's input: the state (its last K - 1 input rows), then this call's projections */
    memcpy(e->rows, e->conv[i], sizeof(float) * (size_t)(K - 1) * cd);
    if ((rc = matmul(e, &w->qkv, e->h, rows, e->rows + (size_t)(K - 1) * cd))) return rc;
    for (int t = 0; t < rows; t++) {
        float *out = e->mix + (size_t)t * cd;
        for (int ch = 0; ch < cd; ch++) {
            const float *taps = w->conv + (size_t)ch * K;
            float acc = taps[0] * e->rows[(size_t)t * cd + ch];
            for (int j = 1; j < K; j++) acc = taps[j] * e->rows[(size_t)(t + j) * cd + ch] + acc;
            out[ch] = acc;
        }
    }
    silu_n(e->mix, (size_t)rows * cd);
    /* the next call reads the last K - 1 input rows up to the last real one: pads never enter it */
    memcpy(e->conv[i], e->rows + (size_t)n * cd, sizeof(float) * (size_t)(K - 1) * cd);
    for (int t = 0; t < rows; t++)
        for (int hk = 0; hk < 2 * c->k_heads; hk++) l2_norm(e->mix + (size_t)t * cd + (size_t)hk * d, d);

    /* gates: pads get g = beta = 0, the identity on the state */
    if ((rc = matmul(e, &w->a, e->h, rows, e->a)) || (rc = matmul(e, &w->b, e->h, rows, e->b))) return rc;
    for (int t = 0; t < rows; t++)
        for (int hv = 0; hv < H; hv++) {
            const size_t at = (size_t)t * H + hv;
            e->beta[at] = t < n ? sigmoid1(e->b[at]) : 0.0f;
            e->g[at] = t < n ? -exp1(w->a_log[hv]) * softplus1(e->a[at] + w->dt_bias[hv]) : 0.0f;
        }
    const ptrdiff_t ld = cd;
    tb_gdn_shape shape = {1, rows, c->k_heads, H, d, 0, TB_HEAD_MAP_INTERLEAVED,
                          {(ptrdiff_t)rows * ld, ld, d}, {(ptrdiff_t)rows * ld, ld, d}, {(ptrdiff_t)rows * ld, ld, d}};
    const float *q = e->mix, *k = e->mix + e->key_dim, *v = e->mix + 2 * e->key_dim;
    const double wall = clock_seconds(CLOCK_MONOTONIC), cpu = clock_seconds(CLOCK_PROCESS_CPUTIME_ID);
    if (e->o.gdn_form == TB_GDN_SERIAL)
        rc = tb_gdn_serial(&shape, q, k, v, e->g, e->beta, e->rec[i], e->gdn_out, e->rec[i], e->o.threads);
    else if (e->o.gdn_form == TB_GDN_CHUNKWISE)
        rc = tb_gdn_chunkwise_precision(&shape, q, k, v, e->g, e->beta, e->rec[i], e->gdn_out, e->rec[i],
                                        e->o.gdn_chunk, e->o.gdn_precision, e->o.threads);
    else
        memset(e->gdn_out, 0, sizeof(float) * (size_t)rows * e->value_dim);
    e->gdn_seconds[0] += clock_seconds(CLOCK_MONOTONIC) - wall;
    e->gdn_seconds[1] += clock_seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu;
    if (rc) return rc;

    /* the gated output norm per value head: rmsnorm(o) * w * silu(z) */
    if ((rc = matmul(e, &w->z, e->h, rows, e->z))) return rc;
    silu_n(e->z, (size_t)rows * e->value_dim);
    for (int t = 0; t < rows; t++)
        for (int hv = 0; hv < H; hv++) {
            float *o = e->gdn_out + ((size_t)t * H + hv) * d;
            const float *z = e->z + ((size_t)t * H + hv) * d;
            const float rms = sqrtf(dot(o, o, d) / (float)d + c->rms_eps);
            for (int j = 0; j < d; j++) o[j] = o[j] / rms * w->norm[j] * z[j];
        }
    return matmul(e, &w->out, e->gdn_out, rows, e->y);
}

/* --- gated full-attention layer ---------------------------------------------------------------------- */

typedef struct {
    tb_hybrid_engine *e;
    int layer, rows, n;
    int64_t past;
} attention_call;

/* Query heads of KV heads begin..end-1: scores against the past and the call's rows by gemm_nn, each
 * row's softmax over the keys it may see (a real row: positions 0..its own; a pad row: itself), the
 * others weighing an exact 0, then the weighted values by gemm_nn. */
static int attention_heads(void *arg, int begin, int end) {
    const attention_call *a = arg;
    tb_hybrid_engine *e = a->e;
    const tb_hybrid_config *c = &e->m->cfg;
    const int hd = c->head_dim, rows = a->rows, group = c->heads / c->kv_heads;
    const int keys = (int)a->past + rows, ld_att = c->heads * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    float *kt = malloc(sizeof(float) * (size_t)hd * keys), *p = malloc(sizeof(float) * (size_t)rows * keys);
    if (!kt || !p) {
        free(kt), free(p);
        return TB_E_MEMORY;
    }
    for (int hk = begin; hk < end; hk++) {
        const float *kh = e->k[a->layer] + (size_t)hk * e->o.capacity * hd;
        const float *vh = e->v[a->layer] + (size_t)hk * e->o.capacity * hd;
        for (int j = 0; j < keys; j++)
            for (int t = 0; t < hd; t++) kt[(size_t)t * keys + j] = kh[(size_t)j * hd + t];
        for (int hq = hk * group; hq < (hk + 1) * group; hq++) {
            const float *q = e->qh + (size_t)hq * rows * hd;
            gemm_nn(rows, keys, hd, q, hd, kt, keys, p, keys, 0, 0);
            for (int r = 0; r < rows; r++) {
                float *pr = p + (size_t)r * keys;
                /* a real row sees keys [0, past + r]; a pad row only its own, past + r */
                const int first = r < a->n ? 0 : (int)a->past + r, last = (int)a->past + r;
                for (int j = 0; j < first; j++) pr[j] = 0.0f;
                float max = pr[first] * scale;
                for (int j = first; j <= last; j++) {
                    pr[j] *= scale;
                    max = pr[j] > max ? pr[j] : max;
                }
                for (int j = first; j <= last; j++) pr[j] -= max;
                exp_n(pr + first, pr + first, last - first + 1);
                float sum = 0.0f;
                for (int j = first; j <= last; j++) sum += pr[j];
                for (int j = first; j <= last; j++) pr[j] /= sum;
                for (int j = last + 1; j < keys; j++) pr[j] = 0.0f;
            }
            gemm_nn(rows, hd, keys, p, keys, vh, hd, e->att + (size_t)hq * hd, ld_att, 0, 0);
        }
    }
    free(kt), free(p);
    return TB_OK;
}

static int full_layer(tb_hybrid_engine *e, int i, int rows, int n) {
    const tb_hybrid_config *c = &e->m->cfg;
    const tb_hybrid_layer *w = &e->m->layer[i];
    const int hd = c->head_dim, rot = c->rotary_dim;
    const size_t cap = (size_t)e->o.capacity;
    int rc;
    if ((rc = matmul(e, &w->q, e->h, rows, e->qg)) || (rc = matmul(e, &w->k, e->h, rows, e->kr)) ||
        (rc = matmul(e, &w->v, e->h, rows, e->vr)))
        return rc;
    /* queries heads-first; the call's K/V rows into the cache after the past (only n stay) */
    for (int r = 0; r < rows; r++) {
        const float *cs = e->cos + (size_t)r * rot, *sn = e->sin + (size_t)r * rot;
        for (int hq = 0; hq < c->heads; hq++)
            norm_rope(e->qg + ((size_t)r * c->heads + hq) * 2 * hd, w->q_norm, hd, rot, c->rms_eps, cs, sn,
                      e->qh + ((size_t)hq * rows + r) * hd);
        for (int hk = 0; hk < c->kv_heads; hk++) {
            const size_t slot = ((size_t)hk * cap + (size_t)e->length + r) * hd;
            norm_rope(e->kr + ((size_t)r * c->kv_heads + hk) * hd, w->k_norm, hd, rot, c->rms_eps, cs, sn, e->k[i] + slot);
            memcpy(e->v[i] + slot, e->vr + ((size_t)r * c->kv_heads + hk) * hd, sizeof(float) * hd);
        }
    }
    attention_call call = {e, i, rows, n, e->length};
    if ((rc = tb_parallel_for(c->kv_heads, e->o.threads, attention_heads, &call))) return rc;
    /* the output gate: attention * sigmoid(gate) per head */
    for (int r = 0; r < rows; r++)
        for (int hq = 0; hq < c->heads; hq++) {
            const float *gate = e->qg + ((size_t)r * c->heads + hq) * 2 * hd + hd;
            float *o = e->att + ((size_t)r * c->heads + hq) * hd;
            for (int j = 0; j < hd; j++) o[j] *= sigmoid1(gate[j]);
        }
    return matmul(e, &w->o, e->att, rows, e->y);
}

/* --- the call ---------------------------------------------------------------------------------------- */

int tb_hybrid_prefill_with_past(tb_hybrid_engine *e, const int32_t *tokens, int n, int rows, int select,
                                float *logits) {
    const tb_hybrid_config *c = &e->m->cfg;
    if (rows < 1 || rows > e->o.max_rows || n < 1 || n > rows || e->length + rows > e->o.capacity ||
        (logits && select != TB_HYBRID_ALL_ROWS && (select < 0 || select >= n)))
        return TB_E_REFUSED;
    for (int r = 0; r < n; r++)
        if (tokens[r] < 0 || tokens[r] >= c->vocab) return TB_E_REFUSED;
    const int hid = c->hidden;
    const float *embed = e->m->embed.data;
    for (int r = 0; r < rows; r++)
        memcpy(e->x + (size_t)r * hid, embed + (size_t)(r < n ? tokens[r] : 0) * hid, sizeof(float) * hid);
    rope_tables(e->length, rows, c->rotary_dim, c->rope_theta, e->cos, e->sin);
    for (int i = 0; i < c->layers; i++) {
        const tb_hybrid_layer *w = &e->m->layer[i];
        rms_norm(e->x, w->input_norm, rows, hid, c->rms_eps, e->h);
        int rc = c->layer_type[i] == TB_HYBRID_LINEAR ? linear_layer(e, i, rows, n) : full_layer(e, i, rows, n);
        if (rc) return rc;
        for (size_t j = 0; j < (size_t)rows * hid; j++) e->x[j] += e->y[j];
        rms_norm(e->x, w->post_attn_norm, rows, hid, c->rms_eps, e->h);
        if ((rc = matmul(e, &w->gate, e->h, rows, e->gate)) || (rc = matmul(e, &w->up, e->h, rows, e->up))) return rc;
        silu_n(e->gate, (size_t)rows * c->mlp);
        for (size_t j = 0; j < (size_t)rows * c->mlp; j++) e->gate[j] *= e->up[j];
        if ((rc = matmul(e, &w->down, e->gate, rows, e->y))) return rc;
        for (size_t j = 0; j < (size_t)rows * hid; j++) e->x[j] += e->y[j];
    }
    e->length += n;
    if (!logits) return TB_OK;
    const int first = select == TB_HYBRID_ALL_ROWS ? 0 : select, count = select == TB_HYBRID_ALL_ROWS ? n : 1;
    rms_norm(e->x + (size_t)first * hid, e->m->final_norm, count, hid, c->rms_eps, e->h);
    return matmul(e, c->tied ? &e->m->embed : &e->m->lm_head, e->h, count, logits);
}

int tb_hybrid_decode(tb_hybrid_engine *e, int32_t token, float *logits) {
    return tb_hybrid_prefill_with_past(e, &token, 1, 1, 0, logits);
}
