/* Work over independent items (heads) split across POSIX threads, and the floating-point mode the
 * kernels compute in (internal). */
#ifndef TB_PARALLEL_H
#define TB_PARALLEL_H

/* Runs fn(ctx, begin, end) over [0, n) in `threads` contiguous ranges (range t is
 * [n t / threads, n (t + 1) / threads): a static partition), the first on the calling thread, the
 * others on the library's persistent workers: created once, when a call first asks for them, kept
 * until the process ends (never per call). Workers sleep on a condition variable between calls
 * (no spinning: a waiting worker costs no CPU time). A call while another thread's call holds the
 * workers waits for them; a call made from inside a range (nested) runs all its ranges on its own
 * thread. Results do not depend on the partition: the ranges' items are independent. Returns the first nonzero code a range returned (in range order), or
 * TB_E_THREAD when a worker could not be started (then no range ran). */
typedef int (*tb_range_fn)(void *ctx, int begin, int end);
int tb_parallel_for(int n, int threads, tb_range_fn fn, void *ctx);

/* Denormals: the kernels compute with flush-to-zero and denormals-are-zero, as the device programs
 * do (kernels/bench/harness.c flush_denormals: MXCSR FTZ|DAZ on x86, FPCR.FZ on aarch64, FPSCR.FZ
 * on arm32), so the host library and the programs give the same bits and no input drawn near the
 * denormal range (test-backend-ops' gates) makes one build crawl through microcode assists.
 *
 * The host library is called from Python through ctypes, on threads that also run numpy: changing
 * such a thread's FP mode for good would change numpy's results behind its back. So every entry
 * point that computes (tb_gdn_*, tb_attention, tb_model_*, tb_kv_read) sets FTZ/DAZ on the calling
 * thread for the duration of the call and restores the caller's mode before it returns
 * (TB_FP_ENTER / TB_FP_LEAVE; nested entries restore what their caller had, i.e. keep it). The
 * pool's workers are the library's own threads and run nothing else: they set FTZ/DAZ once when
 * they start. A write of the control register happens only when the mode differs. */
typedef struct {
    unsigned long saved;
} tb_fp_mode;

tb_fp_mode tb_fp_flush_enter(void);    /* FTZ/DAZ on; returns the mode the thread had */
void tb_fp_restore(tb_fp_mode mode);   /* back to what tb_fp_flush_enter returned */

/* In an entry point: TB_FP_ENTER(); ... return TB_FP_LEAVE(expression); (the expression is
 * evaluated before the caller's mode is restored: it is a function argument). */
static inline int tb_fp_leave_(tb_fp_mode mode, int rc) {
    tb_fp_restore(mode);
    return rc;
}
#define TB_FP_ENTER() const tb_fp_mode tb_fp_caller_ = tb_fp_flush_enter()
#define TB_FP_LEAVE(rc) tb_fp_leave_(tb_fp_caller_, (rc))

#endif
