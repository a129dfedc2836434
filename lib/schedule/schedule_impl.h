/* Internal schedule interface: the layout of a schedule, the list builder,
 * and the simulator on raw per-rank op lists (also used by tests). */
#ifndef EPIPE_LIB_SCHEDULE_IMPL_H
#define EPIPE_LIB_SCHEDULE_IMPL_H

#include <stddef.h>

#include <epipe/schedule.h>

/* Where the pipeline stages live: stage s is chunk chunk_of[s] of rank
 * rank_of[s]; rank r's chunk c is stage stage_at[first[r] + c]. */
struct epipe_sched_layout {
    unsigned ranks, nstages;
    unsigned *rank_of, *chunk_of; /* nstages each */
    unsigned *nchunks, *first;    /* ranks each */
    unsigned *stage_at;           /* nstages */
};

/* Fills the derived arrays of a layout from rank_of (allocates all but
 * rank_of, which the caller allocated). EPIPE_OK, EPIPE_EINVAL naming a bad
 * entry or a rank without a stage, EPIPE_ENOMEM. */
int epipe_sched_layout_init(struct epipe_sched_layout *l, unsigned ranks, unsigned nstages,
                            unsigned *rank_of);
void epipe_sched_layout_free(struct epipe_sched_layout *l);

/* The rules a kind's lists are built by (build.c). */
struct epipe_sched_policy {
    int split;          /* BACKWARD_INPUT + BACKWARD_WEIGHT instead of BACKWARD */
    int flush_forwards; /* gpipe: no backward on a rank before all its forwards */
    int in_order;       /* only the rank's lowest-key pending forward (backward) may run */
    int depth_first;    /* interleaved keys: micro-batch group, chunk, mb */
    int f_first;        /* a forward before a backward when both may run */
    /* When set: each rank runs the forwards and backwards of script[r] (a
     * list of a non-split kind on the same layout) in that order, a backward
     * as BACKWARD_INPUT, and a weight backward whenever the next of them
     * cannot run yet. */
    const epipe_op *const *script;
    const size_t *script_n;
    unsigned *stage_limit; /* nstages: live activations a stage may hold, or 0 = none */
    unsigned *rank_limit;  /* ranks: live activations a rank may hold, or 0 = none */
};

/* Depth-first (interleaved) micro-batch groups: m/R groups (at least one)
 * of sizes as equal as possible, the larger first; each has >= R micro-batches
 * unless m < R. The group of micro-batch mb, and the size of the first. */
static inline unsigned epipe_sched_group(unsigned m, unsigned ranks, unsigned mb)
{
    unsigned g = m / ranks ? m / ranks : 1, base = m / g, extra = m % g;
    unsigned edge = extra * (base + 1);
    return mb < edge ? mb / (base + 1) : extra + (mb - edge) / base;
}
static inline unsigned epipe_sched_group_size(unsigned m, unsigned ranks)
{
    unsigned g = m / ranks ? m / ranks : 1;
    return m / g + (m % g != 0);
}

/* Builds each rank's list by a greedy run under the policy at costs F = 1,
 * BACKWARD = 2, BACKWARD_INPUT = BACKWARD_WEIGHT = 1.
 * ops[r] (allocated here) has counts[r] ops. EPIPE_OK, EPIPE_ENOMEM, or
 * EPIPE_EINTERNAL when the rules leave every rank stuck. */
int epipe_sched_build(const struct epipe_sched_layout *l, unsigned microbatches,
                      const struct epipe_sched_policy *pol, epipe_op **ops, size_t *counts);

/* Like epipe_sim_create(), on raw lists: ops[r][0..counts[r]) for each of
 * l->ranks ranks, micro-batch ids below `microbatches`. The sim borrows all
 * of it, which must outlive it. Runs once with the default costs and fails
 * (EPIPE_ESTATE deadlock, EPIPE_EINVAL broken dependency or malformed op)
 * as epipe_sim_run() would; on error *out is NULL. */
int epipe_sim_create_layout_raw(epipe_sim **out, const struct epipe_sched_layout *l,
                                unsigned microbatches, const epipe_op *const *ops,
                                const size_t *counts);

/* The same with one chunk per rank, stage s on rank s (for tests). */
int epipe_sim_create_raw(epipe_sim **out, unsigned stages, unsigned microbatches,
                         const epipe_op *const *ops, const size_t *counts);

/* The async kinds (async.c): each rank's FIRST, STEADY and DRAIN lists
 * (phase_ops[phase][rank], allocated here) for mode EPIPE_WEIGHTS_STASHED
 * or EPIPE_WEIGHTS_DOUBLE, one chunk per rank and m > every stage's
 * warm-up; the run of `steps` steps with micro-batches numbered across it
 * (run[r], allocated here); and the replay that checks the ops' versions
 * and counts the versions each rank holds. */
int epipe_sched_build_async(const struct epipe_sched_layout *l, unsigned m, int mode,
                            epipe_op **phase_ops[3], size_t *phase_counts[3]);
int epipe_sched_async_run(const struct epipe_sched_layout *l, unsigned m, unsigned steps,
                          epipe_op *const *phase_ops[3], const size_t *phase_counts[3],
                          epipe_op **run, size_t *run_n);
int epipe_sched_async_versions(const struct epipe_sched_layout *l, unsigned m, int mode,
                               unsigned steps, epipe_op *const *phase_ops[3],
                               const size_t *phase_counts[3], unsigned *versions);

/* The lists the simulator runs and their micro-batch count, for
 * epipe_sim_create(): the one list per rank, or an async kind's run. */
void epipe_schedule_lists(const epipe_schedule *sched, const epipe_op *const **ops,
                          const size_t **counts, unsigned *microbatches);
const struct epipe_sched_layout *epipe_schedule_layout_of(const epipe_schedule *sched);

#endif
