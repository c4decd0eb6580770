/* tb_parallel_for over a persistent worker pool, the kernels' floating-point mode, and what the
 * library reports about its own build. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "tb_kernels.h"
#include "tb_parallel.h"
#include "tb_simd.h"

#ifndef TB_SOURCE_HASH
#define TB_SOURCE_HASH "unknown"
#endif

const char *tb_source_hash(void) { return TB_SOURCE_HASH; }
const char *tb_vector_path(void) { return TB_VECTOR_NAME; }

/* --- floating-point mode (tb_parallel.h says why it is set and restored per entry point) ---------- */

/* Only the flush bits are set and put back: a status flag the kernel raised stays raised, and
 * every other control bit (rounding, exception masks) is the caller's throughout. */
#if defined(__x86_64__) || defined(__i386__)
#define FLUSH_BITS 0x8040ul /* MXCSR: FTZ (bit 15) and DAZ (bit 6) */
static unsigned long fp_get(void) { return _mm_getcsr(); }
static void fp_set(unsigned long m) { _mm_setcsr((unsigned)m); }
#elif defined(__aarch64__)
#define FLUSH_BITS (1ul << 24) /* FPCR.FZ: inputs and results */
static unsigned long fp_get(void) {
    uint64_t r;
    __asm__ volatile("mrs %0, fpcr" : "=r"(r));
    return (unsigned long)r;
}
static void fp_set(unsigned long m) { __asm__ volatile("msr fpcr, %0" ::"r"((uint64_t)m) : "memory"); }
#elif defined(__arm__) && defined(__ARM_FP)
#define FLUSH_BITS (1ul << 24) /* FPSCR.FZ (NEON always flushes) */
static unsigned long fp_get(void) {
    uint32_t r;
    __asm__ volatile("vmrs %0, fpscr" : "=r"(r));
    return r;
}
static void fp_set(unsigned long m) { __asm__ volatile("vmsr fpscr, %0" ::"r"((uint32_t)m) : "memory"); }
#else
#define FLUSH_BITS 0ul /* no flush mode known for this target: IEEE denormals */
static unsigned long fp_get(void) { return 0; }
static void fp_set(unsigned long m) { (void)m; }
#endif

tb_fp_mode tb_fp_flush_enter(void) {
    const unsigned long now = fp_get();
    if ((now & FLUSH_BITS) != FLUSH_BITS) fp_set(now | FLUSH_BITS);
    return (tb_fp_mode){now & FLUSH_BITS};
}

void tb_fp_restore(tb_fp_mode mode) {
    const unsigned long now = fp_get();
    if ((now & FLUSH_BITS) != mode.saved) fp_set((now & ~FLUSH_BITS) | mode.saved);
}

/* --- the worker pool -------------------------------------------------------------------------------- */

#define POOL_MAX 255 /* workers; a call asking for more threads uses POOL_MAX + 1 ranges */

typedef struct {
    int id;              /* the range it runs: 1..POOL_MAX */
    unsigned long seen;  /* the call generation when it was started */
} worker_arg;

static struct {
    pthread_mutex_t call; /* held by the thread whose call uses the workers */
    pthread_mutex_t lock; /* guards every field below */
    pthread_cond_t start, done;
    int workers;              /* started so far */
    unsigned long generation; /* incremented per call */
    int n, threads, pending;  /* the current call: items, ranges, worker ranges not finished */
    tb_range_fn fn;
    void *ctx;
    int status[POOL_MAX + 1];
    worker_arg args[POOL_MAX];
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .start = PTHREAD_COND_INITIALIZER,
        .done = PTHREAD_COND_INITIALIZER};

static _Thread_local int in_range; /* this thread runs a range: a nested call stays on it */
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;

static int range_begin(int n, int t, int threads) { return (int)((long)n * t / threads); }

static void *worker(void *arg) {
    const worker_arg *w = arg;
    unsigned long seen = w->seen;
    tb_fp_flush_enter(); /* the library's own thread: it never gives the mode back */
    in_range = 1;
#ifdef __linux__
    prctl(PR_SET_NAME, "tb_pool", 0, 0, 0); /* how the tests find the pool's threads */
#endif
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.start, &pool.lock);
        seen = pool.generation;
        if (w->id >= pool.threads) continue; /* this call does not need it */
        const int n = pool.n, threads = pool.threads;
        const tb_range_fn fn = pool.fn;
        void *ctx = pool.ctx;
        pthread_mutex_unlock(&pool.lock);
        const int status = fn(ctx, range_begin(n, w->id, threads), range_begin(n, w->id + 1, threads));
        pthread_mutex_lock(&pool.lock);
        pool.status[w->id] = status;
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* fork(): the child has none of the workers. The forking thread holds both locks across the fork
 * (so no call is half dispatched), then the child starts over with no workers. */
static void before_fork(void) {
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.lock);
}
static void after_fork_parent(void) {
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
}
static void after_fork_child(void) {
    pool.workers = 0, pool.pending = 0;
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
}
static void register_fork_handlers(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

/* Start workers until there are `need` (pool.lock held). Workers block every signal: the threads
 * that called the library handle them. */
static int grow(int need) {
    if (pool.workers >= need) return TB_OK;
    pthread_once(&fork_handlers_once, register_fork_handlers);
    pthread_attr_t attr;
    sigset_t all, old;
    if (pthread_attr_init(&attr)) return TB_E_THREAD;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = TB_OK;
    while (pool.workers < need) {
        worker_arg *w = &pool.args[pool.workers];
        *w = (worker_arg){pool.workers + 1, pool.generation};
        pthread_t id;
        if (pthread_create(&id, &attr, worker, w)) {
            rc = TB_E_THREAD;
            break;
        }
        pool.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return rc;
}

int tb_pool_workers(void) {
    pthread_mutex_lock(&pool.lock);
    const int n = pool.workers;
    pthread_mutex_unlock(&pool.lock);
    return n;
}

int tb_parallel_for(int n, int threads, tb_range_fn fn, void *ctx) {
    if (threads > n) threads = n;
    if (threads > POOL_MAX + 1) threads = POOL_MAX + 1;
    if (threads <= 1 || in_range) return fn(ctx, 0, n);
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.lock);
    if (grow(threads - 1) != TB_OK) {
        pthread_mutex_unlock(&pool.lock);
        pthread_mutex_unlock(&pool.call);
        return TB_E_THREAD;
    }
    pool.n = n, pool.threads = threads, pool.fn = fn, pool.ctx = ctx, pool.pending = threads - 1;
    pool.generation++;
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.lock);

    in_range = 1;
    int status = fn(ctx, 0, range_begin(n, 1, threads));
    in_range = 0;

    pthread_mutex_lock(&pool.lock);
    while (pool.pending) pthread_cond_wait(&pool.done, &pool.lock);
    for (int t = 1; t < threads && status == TB_OK; t++) status = pool.status[t];
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
    return status;
}
