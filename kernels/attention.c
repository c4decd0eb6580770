/* One attention layer of C query rows against L = P + C keys (past and the chunk's own), float32.
 * Per query head h and row c: out = softmax(scale q_c . k_p + mask[h][c][p]) v over p < L, with
 * max subtraction; KV head h / (heads / kv_heads). A fully masked position (mask -1e30) gets
 * weight exp(-1e30 - max) = 0 exactly. */
#include <stdlib.h>

#include "tb_kernels.h"
#include "tb_linalg.h"
#include "tb_parallel.h"

typedef struct {
    int heads, kv_heads, c, l, kv_rows, hd;
    const float *q, *k, *v, *mask;
    float scale;
    float *out;
} attention_call;

/* Scores of one query row against every key, then turned into softmax weights in place. */
static void softmax_row(const float *qc, const float *k, const float *mask_row, int l, int hd, float scale,
                        float *p) {
    int j = 0;
    float s[4];
    for (; j + 4 <= l; j += 4) {
        const float *k0 = k + (size_t)j * hd;
        dot4(qc, k0, k0 + hd, k0 + 2 * hd, k0 + 3 * hd, hd, s);
        for (int r = 0; r < 4; r++) p[j + r] = s[r] * scale + mask_row[j + r];
    }
    for (; j < l; j++) p[j] = dot(qc, k + (size_t)j * hd, hd) * scale + mask_row[j];
    float max = p[0];
    for (j = 1; j < l; j++) max = p[j] > max ? p[j] : max;
    for (j = 0; j < l; j++) p[j] -= max;
    exp_n(p, p, l);
    float sum = 0.0f;
    for (j = 0; j < l; j++) sum += p[j];
    for (j = 0; j < l; j++) p[j] /= sum;
}

static int attention_heads(void *arg, int begin, int end) {
    const attention_call *a = arg;
    float *p = malloc(sizeof(float) * (size_t)a->c * a->l);
    if (!p) return TB_E_MEMORY;
    for (int h = begin; h < end; h++) {
        const int kvh = h / (a->heads / a->kv_heads);
        const float *k = a->k + (size_t)kvh * a->kv_rows * a->hd, *v = a->v + (size_t)kvh * a->kv_rows * a->hd;
        for (int c = 0; c < a->c; c++)
            softmax_row(a->q + ((size_t)h * a->c + c) * a->hd, k, a->mask + ((size_t)h * a->c + c) * a->l, a->l,
                        a->hd, a->scale, p + (size_t)c * a->l);
        gemm_nn(a->c, a->hd, a->l, p, a->l, v, a->hd, a->out + (size_t)h * a->c * a->hd, a->hd, 0, 0);
    }
    free(p);
    return TB_OK;
}

int tb_attention(int heads, int kv_heads, int c, int l, int kv_rows, int hd, const float *q, const float *k,
                 const float *v, const float *mask, float scale, float *out, int threads) {
    if (heads <= 0 || kv_heads <= 0 || c <= 0 || l < c || kv_rows < l || hd <= 0 || heads % kv_heads) return TB_E_SHAPE;
    attention_call a = {heads, kv_heads, c, l, kv_rows, hd, q, k, v, mask, scale, out};
    return tb_parallel_for(heads, threads, attention_heads, &a);
}
