/* Fork-join over pthreads. Threads are started per call: codecs only go
 * parallel for tensors where the ~20 us start cost is far below 1%. */
#define _GNU_SOURCE
#include "parallel.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

struct task_arg {
    epipe_task_fn fn;
    void *ctx;
    unsigned task, ntasks;
};

static void *task_main(void *p)
{
    struct task_arg *a = p;
    a->fn(a->ctx, a->task, a->ntasks);
    return NULL;
}

void epipe_parallel_run(unsigned ntasks, epipe_task_fn fn, void *ctx)
{
    enum { MAX_THREADS = 256 };
    pthread_t tid[MAX_THREADS];
    struct task_arg args[MAX_THREADS];
    unsigned started[MAX_THREADS];
    if (ntasks > MAX_THREADS)
        ntasks = MAX_THREADS;
    for (unsigned t = 1; t < ntasks; t++) {
        args[t] = (struct task_arg){fn, ctx, t, ntasks};
        started[t] = pthread_create(&tid[t], NULL, task_main, &args[t]) == 0;
    }
    fn(ctx, 0, ntasks);
    for (unsigned t = 1; t < ntasks; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            fn(ctx, t, ntasks); /* no thread to be had: do it here */
    }
}

unsigned epipe_cpu_count(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0)
            return (unsigned)n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (unsigned)n : 1;
}

void epipe_split_range(size_t n, unsigned parts, unsigned i, size_t align, size_t *begin,
                       size_t *end)
{
    size_t units = (n + align - 1) / align;
    size_t b = units * i / parts * align, e = units * (i + 1) / parts * align;
    *begin = b < n ? b : n;
    *end = (i + 1 == parts || e > n) ? n : e;
}
