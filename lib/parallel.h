/* A minimal fork-join helper: run one function over N tasks on N threads.
 * Codecs use it for large tensors; it never fails (it falls back to the
 * calling thread when a thread cannot be started). */
#ifndef EPIPE_LIB_PARALLEL_H
#define EPIPE_LIB_PARALLEL_H

#include <stddef.h>

typedef void (*epipe_task_fn)(void *ctx, unsigned task, unsigned ntasks);

/* Calls fn(ctx, t, ntasks) once for every t in 0..ntasks-1, task 0 on the
 * calling thread, the rest on fresh threads, and returns when all are done. */
void epipe_parallel_run(unsigned ntasks, epipe_task_fn fn, void *ctx);

/* How many CPUs this process may use (at least 1). */
unsigned epipe_cpu_count(void);

/* Splits [0, n) into `parts` ranges whose starts are multiples of `align`
 * (the last one ends at n); range `i` is [*begin, *end). */
void epipe_split_range(size_t n, unsigned parts, unsigned i, size_t align, size_t *begin,
                       size_t *end);

#endif
