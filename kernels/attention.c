/* One attention layer of C query rows against L = P + C keys (past and the chunk's own), float32.
 * Per query head h and row c: out = softmax(scale q_c . k_p + mask[h][c][p]) v over p < L, with
 * max subtraction; KV head h / (heads / kv_heads). A fully masked position (mask -1e30) gets
 * weight exp(-1e30 - max) = 0 exactly.
 *
 * A chunk (8 or more query rows per KV head) walks the keys in blocks of KEY_BLOCK with an online
 * softmax (each block's scores, then the running max, sum and output rescaled by exp(old max - new
 * max)), so its working set is a few blocks whatever the context: without blocking the scores of
 * 8k keys spill out of cache and the rate falls by 5x. A block whose keys are all masked for a row
 * leaves weights exp(0) = 1 there until a block with a real key resets them by a factor exp(-1e30) =
 * 0, exactly. A decode step (fewer rows) reads each key once with dot products and needs no blocks. */
#include <math.h>
#include <stdlib.h>

#include "tb_kernels.h"
#include "tb_linalg.h"
#include "tb_parallel.h"

typedef struct {
    int heads, kv_heads, c, l, kv_rows, hd;
    const float *q, *k, *v, *mask;
    float scale;
    float *out;
    int parts; /* work items per KV head */
} attention_call;

/* From 8 query rows up (per KV head: query heads x C), scores are matrix products against blocks of
 * transposed keys; fewer rows (a decode step) read the keys in place with dot products. */
#define SCORES_BY_PRODUCT 8
#define KEY_BLOCK 128
/* how far ahead a decode step's dot products fetch keys (score_rows) */
#define SCORE_PREFETCH_KEYS 16

/* Raw scores of n query rows by dot products, key block by key block: each block of keys is read
 * from memory once for all the rows (the query heads that share a KV head). v: the values the
 * product after it reads, prefetched alongside. */
static void score_rows(const float *q, int n, const float *k, const float *v, int l, int hd, float *p) {
    int j = 0;
    float s[4];
    for (; j + 4 <= l; j += 4) {
        const float *k0 = k + (size_t)j * hd;
        /* A decode step reads each key and value once, from memory (the cache, in place): the keys
         * SCORE_PREFETCH_KEYS rows ahead, and these four rows' values for the product that follows,
         * are fetched into L2 while this block's dots compute. Without it the dots waited on every
         * line: the keys and values streamed at half the machine's bandwidth. */
        for (size_t f = 0; f < 4 * (size_t)hd; f += 64 / sizeof(float)) {
            __builtin_prefetch(k0 + SCORE_PREFETCH_KEYS * (size_t)hd + f, 0, 2);
            __builtin_prefetch(v + (size_t)j * hd + f, 0, 2);
        }
        for (int r = 0; r < n; r++) {
            dot4(q + (size_t)r * hd, k0, k0 + hd, k0 + 2 * hd, k0 + 3 * hd, hd, s);
            for (int t = 0; t < 4; t++) p[(size_t)r * l + j + t] = s[t];
        }
    }
    for (; j < l; j++)
        for (int r = 0; r < n; r++) p[(size_t)r * l + j] = dot(q + (size_t)r * hd, k + (size_t)j * hd, hd);
}

/* p[j] = p[j] * scale + m[j] (rounded twice) over n values; returns the largest (a max is exact: any
 * order gives it). */
static float scale_mask_max(float *p, const float *m, int n, float scale) {
    const vf vs = vf_set1(scale);
    vf vmax = vf_set1(-INFINITY);
    int j = 0;
    for (; j + VF_LANES <= n; j += VF_LANES) {
        const vf x = vf_add(vf_mul(vf_load(p + j), vs), vf_load(m + j));
        vf_store(p + j, x);
        vmax = vf_max(vmax, x);
    }
    float t[VF_LANES], max = -INFINITY;
    vf_store(t, vmax);
    for (int i = 0; i < VF_LANES; i++) max = t[i] > max ? t[i] : max;
    for (; j < n; j++) {
        p[j] = p[j] * scale + m[j];
        max = p[j] > max ? p[j] : max;
    }
    return max;
}

/* p[j] = exp(p[j] - max) over n values; returns their sum: 8 lanes over the first n - n % 8, folded in
 * vf_hsum's order, then the tail in order, the same on every target (a sequential sum would wait on
 * each add: it cost as much as a third of the scores' product). */
static float exp_sum(float *p, int n, float max) {
    const vf vm = vf_set1(max);
    vf acc = vf_zero();
    int j = 0;
    for (; j + VF_LANES <= n; j += VF_LANES) {
        const vf x = vf_exp(vf_sub(vf_load(p + j), vm));
        vf_store(p + j, x);
        acc = vf_add(acc, x);
    }
    float sum = vf_hsum(acc);
    for (; j < n; j++) {
        p[j] = exp1(p[j] - max);
        sum += p[j];
    }
    return sum;
}

/* Raw scores of one row -> softmax weights, in place. */
static void softmax_row(const float *mask_row, int l, float scale, float *p) {
    const float max = scale_mask_max(p, mask_row, l, scale);
    const float sum = exp_sum(p, l, max);
    for (int j = 0; j < l; j++) p[j] /= sum;
}

/* n query rows (n >= SCORES_BY_PRODUCT) against keys and values in blocks, online softmax. The
 * scores are q k^T with the block's key rows as the transposed B (packed by transposition inside the
 * product). Scratch: s [n][KEY_BLOCK], row_max and row_sum [n]. */
static void attend_blocked(const attention_call *a, const float *q, int n, const float *k, const float *v,
                           const float *mask, float *out, float *s, float *row_max, float *row_sum) {
    const int l = a->l, hd = a->hd;
    const size_t slice = ((size_t)KEY_BLOCK * hd + n - 1) / n; /* floats of the next K and V blocks per row */
    for (int r = 0; r < n; r++) row_max[r] = -INFINITY, row_sum[r] = 0.0f;
    for (int j0 = 0; j0 < l; j0 += KEY_BLOCK) {
        const int bl = l - j0 < KEY_BLOCK ? l - j0 : KEY_BLOCK;
        gemm_nt(n, bl, hd, q, hd, k + (size_t)j0 * hd, hd, s, bl, 0, 0);
        for (int r = 0; r < n; r++) {
            float *sr = s + (size_t)r * bl, *o = out + (size_t)r * hd;
            const float *m = mask + (size_t)r * l + j0;
            if (j0 + KEY_BLOCK < l) { /* the next block's operands, a share per row, so that they stream in
                                       * while this block computes: this row's mask (a row of the mask
                                       * apart, too far for the hardware's prefetchers) and a slice of
                                       * the next keys and values */
                for (int b = 0; b < KEY_BLOCK && j0 + KEY_BLOCK + b < l; b += 64 / (int)sizeof(float))
                    __builtin_prefetch(m + KEY_BLOCK + b, 0, 2);
                const size_t next = (size_t)(j0 + KEY_BLOCK) * hd, end = (size_t)l * hd, share = (slice + 15) & ~(size_t)15;
                for (size_t f = next + r * share; f < next + (r + 1) * share && f < end; f += 64 / sizeof(float)) {
                    __builtin_prefetch(k + f, 0, 2);
                    __builtin_prefetch(v + f, 0, 2);
                }
            }
            const float block_max = scale_mask_max(sr, m, bl, a->scale);
            const float new_max = block_max > row_max[r] ? block_max : row_max[r];
            const float sum = exp_sum(sr, bl, new_max);
            if (j0 > 0) { /* the earlier blocks' weights were taken against the old max */
                float shift = row_max[r] - new_max;
                exp_n(&shift, &shift, 1);
                row_sum[r] *= shift;
                scale_n(o, shift, hd);
            }
            row_sum[r] += sum, row_max[r] = new_max;
        }
        gemm_nn(n, hd, bl, s, bl, v + (size_t)j0 * hd, hd, out, hd, j0 > 0, 0);
    }
    for (int r = 0; r < n; r++) scale_n(out + (size_t)r * hd, 1.0f / row_sum[r], hd);
}

/* The query rows of KV head kvh are the `group` = (heads / kv_heads) * C consecutive rows from
 * kvh * group of q, mask and out viewed as [heads * C] rows. A work item is one KV head's rows, or a
 * part of them when there are more threads than KV heads. */
static int attention_items(void *arg, int begin, int end) {
    const attention_call *a = arg;
    const int group = a->heads / a->kv_heads * a->c, parts = a->parts;
    const int most = (group + parts - 1) / parts;
    const int blocked = most >= SCORES_BY_PRODUCT;
    /* blocked: scores of one key block, running max and sum; else all scores */
    /* the thread's kernel scratch (tb_gemm.h: kept between calls, so a call allocates nothing) */
    float *p = tb_thread_scratch(TB_SCRATCH_KERNEL, blocked ? (size_t)most * KEY_BLOCK + 2 * (size_t)most : (size_t)most * a->l);
    if (!p) return TB_E_MEMORY;
    for (int item = begin; item < end; item++) {
        const int kvh = item / parts, part = item % parts;
        const int r0 = kvh * group + (int)((long)group * part / parts);
        const int n = kvh * group + (int)((long)group * (part + 1) / parts) - r0;
        const float *k = a->k + (size_t)kvh * a->kv_rows * a->hd, *v = a->v + (size_t)kvh * a->kv_rows * a->hd;
        const float *q = a->q + (size_t)r0 * a->hd;
        if (n >= SCORES_BY_PRODUCT) {
            float *s = p, *row_max = p + (size_t)most * KEY_BLOCK, *row_sum = row_max + most;
            attend_blocked(a, q, n, k, v, a->mask + (size_t)r0 * a->l, a->out + (size_t)r0 * a->hd, s, row_max, row_sum);
            continue;
        }
        score_rows(q, n, k, v, a->l, a->hd, p);
        for (int r = 0; r < n; r++) softmax_row(a->mask + (size_t)(r0 + r) * a->l, a->l, a->scale, p + (size_t)r * a->l);
        gemm_nn(n, a->hd, a->l, p, a->l, v, a->hd, a->out + (size_t)r0 * a->hd, a->hd, 0, 0);
    }
    return TB_OK;
}

int tb_attention(int heads, int kv_heads, int c, int l, int kv_rows, int hd, const float *q, const float *k,
                 const float *v, const float *mask, float scale, float *out, int threads) {
    if (heads <= 0 || kv_heads <= 0 || c <= 0 || l < c || kv_rows < l || hd <= 0 || heads % kv_heads) return TB_E_SHAPE;
    const int group = heads / kv_heads * c;
    int parts = threads > kv_heads ? (threads + kv_heads - 1) / kv_heads : 1;
    if (parts > group) parts = group;
    attention_call a = {heads, kv_heads, c, l, kv_rows, hd, q, k, v, mask, scale, out, parts};
    TB_FP_ENTER();
    return TB_FP_LEAVE(tb_parallel_for(kv_heads * parts, threads, attention_items, &a));
}
