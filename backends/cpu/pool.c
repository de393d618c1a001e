/* The kernels' thread pool: `pool_rows` runs a row kernel (qgemv or qdot8, whose signatures are the same) over
 * output rows [0, n) cut into `parts` even chunks (`pool_bound`), which the calling thread and `threads - 1` worker
 * threads claim in turn (one compare-and-swap per claim of one or more consecutive chunks, fewer towards the end).
 * The caller waits only for chunks already claimed, never for a worker the OS has not scheduled yet. Each output is
 * computed by exactly one thread with the same code, so the result is the same bits for any thread count and any
 * split. Workers are started on first use and, between calls, poll for SPIN_NS (yielding their core between polls
 * after YIELD_NS, so that on a busy machine other threads
 * run) before they sleep on a condition variable: a decode step makes ~40 calls a few hundred microseconds apart,
 * and waking a sleeping thread costs tens of microseconds. A second caller while a call is
 * in flight (two Python threads) runs its rows alone. The caller polls for the workers' last chunks for WAIT_SPIN_NS,
 * then sleeps until the last one ends: on a machine with more runnable threads than cores, a worker descheduled
 * in its chunk then gets the caller's core instead of waiting for the caller's time slice to end. Built with
 * qgemv.c by backends/cpu/kernels.py.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define POOL_MAX_WORKERS 63
#define MAX_PARTS 65535
#define SPIN_NS 300000L      /* how long an idle worker polls for the next call before it sleeps */
#define YIELD_NS 20000L      /* after polling this long, a worker yields its core between polls */
#define WAIT_SPIN_NS 30000L  /* how long the caller polls for the workers' last chunks before it sleeps */
#define CLAIM_SHARE 4        /* a claim takes at most 1/(CLAIM_SHARE x threads) of the chunks left */
#define ALIGN_ROWS 16        /* chunk bounds of a long range fall on multiples of this many rows */

typedef int (*rows_fn)(int, const uint8_t *, int64_t, const int64_t *, int64_t, int64_t, const void *, int64_t,
                       float *, int64_t, int64_t);

typedef struct {        /* the call in flight; written by the caller before it publishes a new generation */
    rows_fn fn;
    int type, helpers;  /* helpers: how many workers take part */
    const uint8_t *w;
    int64_t expert_bytes, N, K, M, n;
    const int64_t *experts;
    const void *x;
    float *y;
} job_t;

static job_t job;
static _Atomic uint64_t state;          /* generation << 32 | chunks << 16 | next chunk to claim */
static atomic_int chunks_done, job_rc;
static atomic_int sleepers, caller_sleeps;
static int workers;                     /* started so far */
static uint32_t start_gen;              /* the generation before the call that starts a worker: it takes that call */
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER, sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, finished = PTHREAD_COND_INITIALIZER;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__SSE2__)
    _mm_pause();
#endif
}

/* Where chunk c of `parts` even chunks of [0, n) starts: n * c / parts, rounded down to a multiple of ALIGN_ROWS where
 * every chunk keeps at least that many (n >= ALIGN_ROWS * parts): a chunk bound then cuts no group of 16 rows of a
 * repacked weight (repack.h's GROUP, which both chunks would compute) nor of four rows of a kernel's four streams. */
int64_t pool_bound(int64_t n, int64_t c, int64_t parts) {
    int64_t start = n * c / parts;
    return c < parts && n >= ALIGN_ROWS * parts ? start / ALIGN_ROWS * ALIGN_ROWS : start;
}

/* Claim and run chunks of generation `gen` until none is left (or a newer generation has replaced it). A claim takes
 * 1/CLAIM_SHARE of the chunks left per thread taking part, at least one: runs of consecutive chunks early in the call
 * (fewer claims and kernel calls), single chunks at its end (the threads finish within a chunk of each other, and a
 * thread that comes late takes a share of what is left, not a fixed piece). */
static void take(uint32_t gen) {
    for (;;) {
        uint64_t s = atomic_load(&state);
        int64_t c = (int64_t)(s & 0xffff), parts = (int64_t)((s >> 16) & 0xffff);
        if ((uint32_t)(s >> 32) != gen || c >= parts) return;
        int64_t k = (parts - c) / (CLAIM_SHARE * (job.helpers + 1));
        k = k < 1 ? 1 : k;
        if (!atomic_compare_exchange_weak(&state, &s, s + (uint64_t)k)) continue;  /* claimed: the job stays put */
        int rc = job.fn(job.type, job.w, job.expert_bytes, job.experts, job.N, job.K, job.x, job.M, job.y,
                        pool_bound(job.n, c, parts), pool_bound(job.n, c + k, parts));
        for (int old = atomic_load(&job_rc); rc < old && !atomic_compare_exchange_weak(&job_rc, &old, rc);) {}
        if (atomic_fetch_add(&chunks_done, (int)k) + k == parts && atomic_load(&caller_sleeps)) {
            pthread_mutex_lock(&sleep_lock);        /* the last chunk: wake the caller if it gave up polling */
            pthread_cond_broadcast(&finished);
            pthread_mutex_unlock(&sleep_lock);
        }
    }
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = start_gen;      /* read from state, a worker scheduled after the call was published missed it */
    for (;;) {
        uint32_t gen = (uint32_t)(atomic_load(&state) >> 32);
        if (gen != seen) {
            seen = gen;
            if (id < job.helpers) take(gen);
            continue;
        }
        int64_t start = now_ns();
        for (int i = 1; (uint32_t)(atomic_load(&state) >> 32) == seen; i++) {
            relax();
            if (i % 64 != 0) continue;
            int64_t waited = now_ns() - start;
            if (waited > YIELD_NS && waited <= SPIN_NS) sched_yield();     /* let other runnable threads in */
            if (waited > SPIN_NS) {
                pthread_mutex_lock(&sleep_lock);
                atomic_fetch_add(&sleepers, 1);
                while ((uint32_t)(atomic_load(&state) >> 32) == seen) pthread_cond_wait(&wake, &sleep_lock);
                atomic_fetch_sub(&sleepers, 1);
                pthread_mutex_unlock(&sleep_lock);
            }
        }
    }
    return NULL;
}

/* fn over output rows [0, n) in `parts` chunks on `threads` threads (the caller among them); returns the lowest
 * return code of the chunks (0, or a kernel's negative error). */
int pool_rows(rows_fn fn, int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N,
              int64_t K, const void *x, int64_t M, float *y, int64_t n, int64_t parts, int threads) {
    if (parts > n) parts = n;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    if (threads > POOL_MAX_WORKERS + 1) threads = POOL_MAX_WORKERS + 1;
    if (parts <= 1 || threads <= 1 || pthread_mutex_trylock(&caller_lock) != 0)
        return fn(type, w, expert_bytes, experts, N, K, x, M, y, 0, n);
    start_gen = (uint32_t)(atomic_load(&state) >> 32);
    while (workers < threads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)workers) != 0) break;
        pthread_detach(t);
        workers++;
    }
    job = (job_t){fn, type, workers < threads - 1 ? workers : threads - 1, w, expert_bytes, N, K, M, n, experts,
                  x, y};
    atomic_store(&chunks_done, 0);
    atomic_store(&job_rc, 0);
    uint32_t gen = (uint32_t)(atomic_load(&state) >> 32) + 1;
    atomic_store(&state, (uint64_t)gen << 32 | (uint64_t)parts << 16);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    take(gen);
    int64_t until = now_ns() + WAIT_SPIN_NS;     /* chunks still running on workers: poll, then sleep (a */
    for (int i = 1; atomic_load(&chunks_done) < parts; i++) {     /* descheduled worker gets this core) */
        relax();
        if (i % 64 == 0 && now_ns() > until) {
            pthread_mutex_lock(&sleep_lock);
            atomic_store(&caller_sleeps, 1);
            while (atomic_load(&chunks_done) < parts) pthread_cond_wait(&finished, &sleep_lock);
            atomic_store(&caller_sleeps, 0);
            pthread_mutex_unlock(&sleep_lock);
        }
    }
    int rc = atomic_load(&job_rc);
    pthread_mutex_unlock(&caller_lock);
    return rc;
}

/* pool_range: fn(ctx, start, stop) over [0, n) in `parts` chunks, as pool_rows runs a row kernel (the context
 * travels in pool_rows' activation pointer). */
typedef struct {
    int (*fn)(void *, int64_t, int64_t);
    void *ctx;
} range_job;

static int run_range(int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts, int64_t N, int64_t K,
                     const void *job, int64_t M, float *y, int64_t start, int64_t stop) {
    (void)type, (void)w, (void)expert_bytes, (void)experts, (void)N, (void)K, (void)M, (void)y;
    const range_job *r = job;
    return r->fn(r->ctx, start, stop);
}

int pool_range(int (*fn)(void *, int64_t, int64_t), void *ctx, int64_t n, int64_t parts, int threads) {
    range_job job = {fn, ctx};
    return pool_rows(run_range, 0, NULL, 0, NULL, 0, 0, &job, 0, NULL, n, parts, threads);
}
