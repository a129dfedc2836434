/* Internal schedule interface: simulate raw per-stage op lists (used by the
 * public API, by tests that feed broken lists, and by lib/stage later). */
#ifndef EPIPE_LIB_SCHEDULE_IMPL_H
#define EPIPE_LIB_SCHEDULE_IMPL_H

#include <stddef.h>

#include <epipe/schedule.h>

/* Like epipe_sim_create(), on raw lists: ops[s][0..counts[s]) for each of
 * `stages` stages, micro-batch ids below `microbatches`. The sim borrows
 * both arrays, which must outlive it. Runs once with the default costs and
 * fails (EPIPE_ESTATE deadlock, EPIPE_EINVAL broken dependency or malformed
 * op) as epipe_sim_run() would; on error *out is NULL. */
int epipe_sim_create_raw(epipe_sim **out, unsigned stages, unsigned microbatches,
                         const epipe_op *const *ops, const size_t *counts);

/* The schedule's lists, for epipe_sim_create(): ops[s] has counts[s] ops. */
void epipe_schedule_lists(const epipe_schedule *sched, const epipe_op *const **ops,
                          const size_t **counts);

#endif
