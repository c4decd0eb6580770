/* Work over independent items (heads) split across POSIX threads (internal). */
#ifndef TB_PARALLEL_H
#define TB_PARALLEL_H

/* Runs fn(ctx, begin, end) over [0, n) in `threads` contiguous ranges, the first on the calling
 * thread. Returns the first nonzero code a range returned, or TB_E_THREAD. */
typedef int (*tb_range_fn)(void *ctx, int begin, int end);
int tb_parallel_for(int n, int threads, tb_range_fn fn, void *ctx);

#endif
