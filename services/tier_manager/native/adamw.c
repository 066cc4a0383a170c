/*
 * adamw: the tier manager's CPU AdamW step as one pass over memory, on a pool of threads.
 *
 * Why native: AdamW on CPU is memory-bound. Per element an fp32 step reads 16 bytes
 * (parameter, gradient, two moments) and writes 12; the mixed-precision step reads the
 * fp32 master and moments and a bf16 gradient and writes them back plus a bf16
 * parameter (28 bytes either way). PyTorch's fused CPU AdamW moves exactly that, but
 * widening bf16 gradients and rounding masters to bf16 are separate passes around it,
 * and it runs on one OpenMP team per calling thread. Here every element is read once
 * and written once: gradient widened (and scaled), AdamW, master rounded, in registers.
 * Measured on the 16-core GPU machine, the torch path took 0.42 ns/param (fp32) and
 * 0.51 (bf16) against DeepSpeed cpu_adam's 0.23 (docs/bench/adamw_h200.txt).
 *
 * Exactness. The results are bit for bit those of torch.optim.AdamW(fused=True) as the
 * daemon used it (adamw_kernel.py's torch path): the arithmetic below repeats, operation
 * for operation, aten/src/ATen/native/cpu/FusedAdamKernel.cpp (adam_math, ADAMW mode) as
 * PyTorch's release builds compile it for their AVX2 and AVX512 kernels. Those builds let
 * GCC contract a multiply into a following add (-ffp-contract=fast, its GNU default) and
 * the x86 builds have FMA, so the rounding of each step depends on where GCC fused:
 *   - the lerp of exp_avg is an explicit fma in the vector loop, and the scalar loop's
 *     `m + w * (g - m)` is contracted into the same fma;
 *   - exp_avg_sq: the vector loop computes fma(c2 * g, g, v * beta2), the scalar loop
 *     fma(v, beta2, (c2 * g) * g) -- the one place the two loops differ;
 *   - nothing else is fused (the weight-decay product is rounded before the update).
 * Found by comparing every candidate against torch 2.13's kernel on random tensors, and
 * checked again at run time (adamw_kernel.py compares this kernel with torch's on each
 * start and uses torch's when they differ). This file is compiled with -ffp-contract=off so
 * that GCC fuses nothing here that the fmaf() calls do not say.
 * PyTorch's scalar loop takes the last `numel % width` elements of each tensor it is given
 * (width: its Vectorized<float>::size(), 8 for AVX2, 16 for AVX512); the caller passes
 * that width and cuts tensors into pieces only at multiples of it.
 *
 * Vectorisation: plain C loops that GCC vectorises, compiled for AVX2+FMA through a target
 * attribute and chosen at run time, so the library loads on any x86-64. A CPU without
 * AVX2/FMA gets TSADAM_UNSUPPORTED (PyTorch then uses no FMA either, and the caller
 * keeps PyTorch's kernel). AVX2 suffices: at 16 threads the step needs ~11 cycles per
 * element per core of the memory bandwidth, and the loop takes ~4 (two divisions and a
 * square root per element are the cost).
 *
 * Threads: a persistent pool (POSIX threads, no OpenMP: the PyTorch in the same process
 * has its own OpenMP runtime). The calling thread is worker 0. The elements of a call are
 * cut into chunks of CHUNK_ELEMENTS (a multiple of 16: 64 bytes of fp32 state, so that no
 * two threads write one cache line of it) that the threads take in turn from a shared
 * counter: a thread that the OS delays (the daemon shares its cores with the workers'
 * processes, and the dev machine with everything) delays the step by a chunk, not by its
 * whole share, as an equal static split would.
 *
 * Build: cc -O3 -std=c11 -D_GNU_SOURCE -ffp-contract=off -fno-math-errno -shared -fPIC
 *        -pthread -o libtierstack_adamw.so adamw.c -lm
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One run of contiguous elements: a tensor, or a cut of one at a multiple of the width. */
typedef struct {
    uint64_t params;     /* fp32 updated in place (no master), or written from the master;
                          * 0 with a master: no parameters written (the worker rounds the
                          * masters on their way to the device: TSADAM_NO_PARAMS) */
    uint64_t master;     /* fp32 master weights, or 0 */
    uint64_t grads;
    uint64_t exp_avg;
    uint64_t exp_avg_sq;
    int64_t numel;
} tsadam_piece;

enum { TSADAM_FLOAT32 = 0, TSADAM_BFLOAT16 = 1 };
enum { TSADAM_OK = 0, TSADAM_UNSUPPORTED = 1, TSADAM_BAD_ARGUMENT = 2 };
/* Bits of tsadam_features(): what this build does beyond the first version's calls. */
enum { TSADAM_NO_PARAMS = 1 };

/* Where a piece's result goes: the `has_master` argument of update(). */
enum { NO_MASTER = 0, MASTER_AND_PARAMS = 1, MASTER_ONLY = 2 };

/* The per-call constants, as FusedAdamKernel.cpp casts them from double to float. */
typedef struct {
    float grad_scale, decay, lerp_weight, beta2, sq_weight, bias2_sqrt, eps, neg_step_size;
} constants;

typedef struct {
    const tsadam_piece *pieces;
    int64_t npieces, total;
    int width, grad_dtype, param_dtype, small_lerp;
    constants k;
} job;

typedef struct tsadam_pool {
    int nthreads;
    int64_t next_chunk; /* the next chunk of the current job to take (atomic) */
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    uint64_t generation;
    int used;     /* threads taking part in the current job (worker 0 is the caller) */
    int pending;  /* of those, pool threads still working */
    int stop;
    int started;  /* pool threads actually running */
    job current;
} tsadam_pool;

/* ---- the arithmetic --------------------------------------------------------------- */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as c10::BFloat16 and PyTorch's vectorised copy_ do; a NaN
 * becomes the quiet NaN 0x7fc0 (c10's scalar conversion; the vectorised one writes
 * 0xffff: NaN payloads are the one thing not reproduced). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

/* Elements [lo, hi) of one piece; `tail` selects PyTorch's scalar-loop rounding. The
 * const int arguments are literals at every call, so each combination is its own loop. */
static inline __attribute__((always_inline)) void update(
    const tsadam_piece *pc, int64_t lo, int64_t hi, const constants *k, const int grad_bf16,
    const int param_dtype, const int has_master, const int small_lerp, const int tail) {
    /* has_master: NO_MASTER, MASTER_AND_PARAMS or MASTER_ONLY (nothing but the state written) */
    float *restrict state = (float *)(uintptr_t)(has_master ? pc->master : pc->params);
    float *restrict m = (float *)(uintptr_t)pc->exp_avg;
    float *restrict v = (float *)(uintptr_t)pc->exp_avg_sq;
    const float *restrict g32 = (const float *)(uintptr_t)pc->grads;
    const uint16_t *restrict g16 = (const uint16_t *)(uintptr_t)pc->grads;
    float *restrict out32 = (float *)(uintptr_t)pc->params;
    uint16_t *restrict out16 = (uint16_t *)(uintptr_t)pc->params;
    const float scale = k->grad_scale, decay = k->decay, w = k->lerp_weight;
    const float beta2 = k->beta2, c2 = k->sq_weight, bias2 = k->bias2_sqrt, eps = k->eps;
    const float neg_step = k->neg_step_size;
    for (int64_t i = lo; i < hi; i++) {
        /* The daemon's gradients are widened to fp32 and multiplied by the scale in fp32
         * (grad * scale, one rounding) before AdamW sees them; a scale of 1 is exact. */
        float g = (grad_bf16 ? bf16_to_float(g16[i]) : g32[i]) * scale;
        float p = state[i] * decay; /* decay is exactly 1 without weight decay */
        float mi = m[i], vi = v[i];
        /* exp_avg.lerp_(grad, 1 - beta1), PyTorch's two-branch lerp */
        mi = small_lerp ? fmaf(w, g - mi, mi) : fmaf(w - 1.0f, g - mi, g);
        vi = tail ? fmaf(vi, beta2, (c2 * g) * g) : fmaf(c2 * g, g, vi * beta2);
        float denom = sqrtf(vi) / bias2 + eps;
        p = p + (neg_step * mi) / denom;
        m[i] = mi;
        v[i] = vi;
        state[i] = p;
        if (has_master == MASTER_AND_PARAMS) {
            if (param_dtype == TSADAM_BFLOAT16)
                out16[i] = float_to_bf16(p);
            else
                out32[i] = p;
        }
    }
}

/* A piece's range: the part before the piece's last numel % width elements takes the
 * vector loop's rounding, the rest the scalar loop's. */
#define RANGE(GB, PD, HM, SL)                                                              \
    do {                                                                                   \
        if (lo < split) update(pc, lo, hi < split ? hi : split, k, GB, PD, HM, SL, 0);     \
        if (hi > split) update(pc, lo > split ? lo : split, hi, k, GB, PD, HM, SL, 1);     \
    } while (0)

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void update_range_avx2(const job *j,
                                                                  const tsadam_piece *pc,
                                                                  int64_t lo, int64_t hi) {
    const constants *k = &j->k;
    const int64_t split = pc->numel - pc->numel % j->width;
    const int gb = j->grad_dtype == TSADAM_BFLOAT16, hm = pc->master != 0;
    const int bf = j->param_dtype == TSADAM_BFLOAT16, out = pc->params != 0;
    /* 2 x 4 x 2 specialisations: gradient dtype, where the result goes, lerp branch. */
    if (j->small_lerp) {
        if (!hm) { if (gb) RANGE(1, 0, 0, 1); else RANGE(0, 0, 0, 1); }
        else if (!out) { if (gb) RANGE(1, 0, 2, 1); else RANGE(0, 0, 2, 1); }
        else if (bf) { if (gb) RANGE(1, 1, 1, 1); else RANGE(0, 1, 1, 1); }
        else { if (gb) RANGE(1, 0, 1, 1); else RANGE(0, 0, 1, 1); }
    } else {
        if (!hm) { if (gb) RANGE(1, 0, 0, 0); else RANGE(0, 0, 0, 0); }
        else if (!out) { if (gb) RANGE(1, 0, 2, 0); else RANGE(0, 0, 2, 0); }
        else if (bf) { if (gb) RANGE(1, 1, 1, 0); else RANGE(0, 1, 1, 0); }
        else { if (gb) RANGE(1, 0, 1, 0); else RANGE(0, 0, 1, 0); }
    }
}
#endif

/* Chunks a thread takes at a time: 64K elements, ~1.8 MB of traffic (~15 us on one
 * core), so taking one costs nothing and a late thread delays a step by that little. A
 * call wakes no more threads than it has chunks (a wake-up costs ~10-50 us). */
#define CHUNK_ELEMENTS (1 << 16)

/* The elements [begin, end) of the call, counted across its pieces. */
static void run_range(const job *j, int64_t begin, int64_t end) {
    int64_t at = 0;
    for (int64_t i = 0; i < j->npieces && at < end; i++) {
        const tsadam_piece *pc = &j->pieces[i];
        int64_t lo = begin > at ? begin - at : 0, hi = end - at < pc->numel ? end - at : pc->numel;
        if (lo < hi) {
#if defined(__x86_64__)
            update_range_avx2(j, pc, lo, hi);
#endif
        }
        at += pc->numel;
    }
}

/* Take chunks of the call until none is left. */
static void run_chunks(const job *j, tsadam_pool *pool) {
    for (;;) {
        int64_t c = __atomic_fetch_add(&pool->next_chunk, 1, __ATOMIC_RELAXED);
        int64_t begin = c * CHUNK_ELEMENTS;
        if (begin >= j->total) return;
        run_range(j, begin, j->total - begin < CHUNK_ELEMENTS ? j->total : begin + CHUNK_ELEMENTS);
    }
}

/* ---- the pool ----------------------------------------------------------------------- */

static void *pool_main(void *arg) {
    tsadam_pool *pool = ((void **)arg)[0];
    int t = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->stop && pool->generation == seen) pthread_cond_wait(&pool->wake, &pool->lock);
        if (pool->stop) break;
        seen = pool->generation;
        if (t >= pool->used) continue; /* a small job: not needed this time */
        job j = pool->current;
        pthread_mutex_unlock(&pool->lock);
        run_chunks(&j, pool);
        pthread_mutex_lock(&pool->lock);
        if (--pool->pending == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

/* A pool of `nthreads` threads in all, the caller of tsadam_step included; NULL when
 * out of memory. Fewer threads than asked may start (then fewer are used). */
tsadam_pool *tsadam_pool_new(int nthreads) {
    if (nthreads < 1) nthreads = 1;
    tsadam_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->nthreads = nthreads;
    pool->threads = calloc((size_t)nthreads, sizeof *pool->threads);
    if (!pool->threads) {
        free(pool);
        return NULL;
    }
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    for (int t = 1; t < nthreads; t++) {
        void **arg = malloc(2 * sizeof *arg);
        if (!arg) break;
        arg[0] = pool;
        arg[1] = (void *)(intptr_t)t;
        if (pthread_create(&pool->threads[t], NULL, pool_main, arg) != 0) {
            free(arg);
            break;
        }
        pool->started++;
    }
    return pool;
}

int tsadam_pool_threads(const tsadam_pool *pool) { return pool->started + 1; }

void tsadam_pool_free(tsadam_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int t = 1; t <= pool->started; t++) pthread_join(pool->threads[t], NULL);
    pthread_mutex_destroy(&pool->lock);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    free(pool->threads);
    free(pool);
}

/* What this build does beyond the first version's calls (TSADAM_NO_PARAMS: a piece with
 * a master and params 0 updates the state and writes no parameters). A library without
 * this symbol does none of it: the caller probes for it before sending such pieces. */
int tsadam_features(void) { return TSADAM_NO_PARAMS; }

/* Whether this CPU runs the kernel (AVX2 and FMA). */
int tsadam_supported(void) {
#if defined(__x86_64__)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* One AdamW step (decoupled weight decay, no amsgrad, no maximize) of every piece, with
 * PyTorch's step counter `step` (>= 1) and hyperparameters; gradients of `grad_dtype`
 * are multiplied by `grad_scale` first; with masters, the updated masters are written to
 * the parameters in `param_dtype` (unless a piece's params is 0). Calls on one pool must
 * not overlap. */
int tsadam_step(tsadam_pool *pool, const tsadam_piece *pieces, int64_t npieces, int width,
                int grad_dtype, int param_dtype, double lr, double beta1, double beta2, double eps,
                double weight_decay, double grad_scale, int64_t step) {
    if (!tsadam_supported()) return TSADAM_UNSUPPORTED;
    if (width < 1 || npieces < 0 || step < 1 ||
        (grad_dtype != TSADAM_FLOAT32 && grad_dtype != TSADAM_BFLOAT16) ||
        (param_dtype != TSADAM_FLOAT32 && param_dtype != TSADAM_BFLOAT16))
        return TSADAM_BAD_ARGUMENT;
    job j = {.pieces = pieces, .npieces = npieces, .width = width, .grad_dtype = grad_dtype,
             .param_dtype = param_dtype};
    for (int64_t i = 0; i < npieces; i++) {
        if (pieces[i].numel < 0) return TSADAM_BAD_ARGUMENT;
        if (!pieces[i].master && param_dtype != TSADAM_FLOAT32) return TSADAM_BAD_ARGUMENT;
        if (!pieces[i].master && !pieces[i].params) return TSADAM_BAD_ARGUMENT;
        j.total += pieces[i].numel;
    }
    /* FusedAdamKernel.cpp: the step counter is read as a float, the bias corrections are
     * computed in double ("to align with non-fused adam"), then each constant is cast to
     * float where the vector loop builds it. */
    double s = (double)(float)step;
    double bias1 = 1 - pow(beta1, s), bias2 = 1 - pow(beta2, s);
    double step_size = lr / bias1;
    double lerp_weight = 1 - beta1;
    j.k = (constants){
        .grad_scale = (float)grad_scale,
        .decay = weight_decay != 0 ? (float)(1 - lr * weight_decay) : 1.0f,
        .lerp_weight = (float)lerp_weight,
        .beta2 = (float)beta2,
        .sq_weight = (float)(1 - beta2),
        .bias2_sqrt = (float)sqrt(bias2),
        .eps = (float)eps,
        .neg_step_size = (float)(-step_size),
    };
    j.small_lerp = fabsf((float)lerp_weight) < 0.5f;
    if (j.total == 0) return TSADAM_OK;

    int64_t chunks = (j.total + CHUNK_ELEMENTS - 1) / CHUNK_ELEMENTS;
    int have = pool->started + 1;
    int used = chunks < have ? (int)chunks : have;
    if (used > 1) {
        pthread_mutex_lock(&pool->lock);
        pool->current = j;
        pool->used = used;
        pool->next_chunk = 0;
        pool->pending = used - 1;
        pool->generation++;
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    if (used > 1)
        run_chunks(&j, pool);
    else
        run_range(&j, 0, j.total);
    if (used > 1) {
        pthread_mutex_lock(&pool->lock);
        while (pool->pending > 0) pthread_cond_wait(&pool->done, &pool->lock);
        pthread_mutex_unlock(&pool->lock);
    }
    return TSADAM_OK;
}
