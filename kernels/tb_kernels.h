/* testbed native kernels: one plain C ABI (C11, float32, no allocation visible to the caller).
 *
 *   GDN      the gated delta rule, serial (per token) and chunkwise (WY / UT transform), with
 *            llama.cpp's GATED_DELTA_NET layout (see refimpl/gdn.py): q, k [n_seqs, T, H_k, d],
 *            v [n_seqs, T, H_v, d], g [n_seqs, T, H_v] or [n_seqs, T, H_v, d] (KDA), beta
 *            [n_seqs, T, H_v], state [n_seqs, H_v, d, d] stored transposed (state[j][i] = S[i][j]).
 *   attention  one attention layer of C query rows against P past + C new keys, with the additive
 *            per-head mask and grouped KV heads (C = 1 is the decode step).
 *   sliding cache  append with eviction and chronological compaction (sink rows kept), snapshot
 *            before a padded append and rollback after it, on raw rows of bytes.
 *
 * Every function returns TB_OK or a negative TB_E* code; nothing is written when a shape is
 * rejected. `threads` splits independent heads over POSIX threads (1 = the calling thread only;
 * more: the calling thread and the library's persistent workers, never a thread created per call).
 * Every function that computes does so with denormals flushed to zero (FTZ/DAZ), as the device
 * programs do, and gives the calling thread its own FP mode back before it returns.
 */
#ifndef TB_KERNELS_H
#define TB_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TB_OK 0
#define TB_E_SHAPE (-1)   /* a size is zero, negative or inconsistent */
#define TB_E_MEMORY (-2)  /* scratch allocation failed */
#define TB_E_THREAD (-3)  /* a worker thread could not be started */

#define TB_HEAD_MAP_TILED 0       /* value head h reads key head h % H_k (llama.cpp) */
#define TB_HEAD_MAP_INTERLEAVED 1 /* value head h reads key head h / (H_v / H_k) (Hugging Face) */

/* Shape and memory layout of one GATED_DELTA_NET call. Strides are in floats for the
 * [n_seqs, T, H] axes of q, k and v (the d axis is contiguous), so permuted inputs need no copy;
 * g, beta, state and out are contiguous. */
typedef struct {
    int n_seqs, tokens, h_k, h_v, d;
    int kda;       /* 0: g is one log-decay per head and token; 1: one per key index (KDA) */
    int head_map;  /* TB_HEAD_MAP_* */
    ptrdiff_t q_stride[3], k_stride[3], v_stride[3];
} tb_gdn_shape;

/* out [n_seqs, T, H_v, d]; state_out [n_seqs, H_v, d, d] (may alias state_in). */
int tb_gdn_serial(const tb_gdn_shape *shape, const float *q, const float *k, const float *v,
                  const float *g, const float *beta, const float *state_in,
                  float *out, float *state_out, int threads);

/* The chunkwise form: ceil(T / chunk) steps of `chunk` tokens, the last one possibly shorter;
 * chunk = TB_GDN_CHUNK_AUTO: tb_gdn_auto_chunk(d), the size measured fastest for the head size. */
#define TB_GDN_CHUNK_AUTO 0
int tb_gdn_auto_chunk(int d);
int tb_gdn_chunkwise(const tb_gdn_shape *shape, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, const float *state_in,
                     float *out, float *state_out, int chunk, int threads);

/* The chunkwise form with its matrix products rounded as a matrix unit computes them (an NPU's HMX
 * takes fp16 tiles): TB_PRECISION_FP16_ACC32 rounds both operands of each product to binary16 and
 * accumulates in float32; TB_PRECISION_FP16_ACC16 also rounds the accumulator to binary16 after every
 * multiply-add (a product that adds onto a result is computed apart, then added in float32). The
 * forward substitution, the decays and the state stay float32, as on a vector unit (refimpl.gdn's
 * PRECISIONS). TB_PRECISION_F32 is tb_gdn_chunkwise, bit for bit. Scalar gate only (kda = 0). */
#define TB_PRECISION_F32 0
#define TB_PRECISION_FP16_ACC32 1
#define TB_PRECISION_FP16_ACC16 2
int tb_gdn_chunkwise_precision(const tb_gdn_shape *shape, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, const float *state_in, float *out,
                               float *state_out, int chunk, int precision, int threads);

/* Attention of C query rows against the first L = P + C rows of a cache:
 *   q [heads, C, hd]; k and v [kv_heads, kv_rows, hd] with kv_rows >= L (a cache allocated for
 *   kv_rows positions, of which L are attended); mask [heads, C, L] (additive: 0 attends, -1e30
 *   masks); out [heads, C, hd]. Query head h reads KV head h / (heads / kv_heads).
 *   out = softmax(scale * q k^T + mask) v, row by row. */
int tb_attention(int heads, int kv_heads, int c, int l, int kv_rows, int hd, const float *q, const float *k,
                 const float *v, const float *mask, float scale, float *out, int threads);

/* A sliding-window cache of raw rows: `planes` independent planes (e.g. K and V of each KV head),
 * each holding up to `window` rows of `row_bytes` bytes in chronological order (row 0 oldest); the
 * first `sink` rows ever written are never evicted. `count` rows are held. Plane p starts at
 * rows + p * window * row_bytes. Slots not held contain `empty_byte` in every byte (0 for data;
 * 0xff makes an int64 position -1). */
typedef struct {
    uint8_t *rows;
    size_t row_bytes;
    int planes, window, sink, count;
    uint8_t empty_byte;
} tb_sliding_cache;

/* Append n rows per plane (new_rows [planes, n, row_bytes]): when more than `window` rows would be
 * held, the oldest non-sink rows are dropped and the rest compacted chronologically; if n alone
 * overflows the non-sink room, only its last rows are kept. */
int tb_cache_append(tb_sliding_cache *cache, const uint8_t *new_rows, int n);

/* Before appending n_real rows padded with n_pad rows: save the real rows the padded append will
 * evict and the exact one would not (at most n_pad per plane) into saved [planes, n_pad, row_bytes].
 * *n_saved is how many per plane. Requires n_real + n_pad <= window - sink (the padding guard). */
int tb_cache_snapshot(const tb_sliding_cache *cache, int n_real, int n_pad, uint8_t *saved, int *n_saved);

/* After the padded append: drop the n_pad pad rows (the newest) and put the saved rows back in
 * their chronological place, after the sink rows; freed slots get empty_byte. The cache is then
 * byte-identical to an append of the n_real rows alone. */
int tb_cache_rollback(tb_sliding_cache *cache, int n_pad, const uint8_t *saved, int n_saved);

/* What the library was built from and for: the sha256 of the kernel sources (hex), the vector path
 * of the element-wise code, fixed at build time ("sse2", "avx2", "avx2-fma", "neon", "neon-fma",
 * "scalar"), and the matrix products' micro-kernel, chosen at run time by CPUID on x86-64 or
 * forced by TB_ISA=avx512|avx2|neon|scalar ("avx512-fma", "avx512", "avx2-fma", "avx2", "neon",
 * "neon-fma", "portable", "portable-fma"; see kernels/tb_gemm.h). */
const char *tb_source_hash(void);
const char *tb_vector_path(void);
const char *tb_gemm_isa(void);

/* Worker threads the library has started (a pool created on the first call that asks for more than
 * one thread and kept for the process's life; see tb_parallel.h): 0 before that. */
int tb_pool_workers(void);

#ifdef __cplusplus
}
#endif
#endif
