/* TEMPORARY: stands in for the schedule API of issue 13 (branch sched) until it is
 * merged; deleted then. One chunk per rank, identity placement. */
#ifndef EPIPE_STAGE_SCHED_COMPAT_H
#define EPIPE_STAGE_SCHED_COMPAT_H
#include <epipe/stage.h>
enum { EPIPE_OP_BACKWARD_INPUT = 7, EPIPE_OP_BACKWARD_WEIGHT = 8 };
typedef struct epipe_schedule_layout {
    size_t struct_size;
    unsigned chunks;
    const unsigned *placement;
    unsigned placement_len;
} epipe_schedule_layout;
static inline int epipe_schedule_create_layout(epipe_schedule **out, const char *kind,
                                               unsigned ranks, unsigned microbatches,
                                               const epipe_schedule_layout *layout)
{
    (void)layout;
    return epipe_schedule_create(out, kind, ranks, microbatches);
}
static inline unsigned epipe_schedule_pipeline_stages(const epipe_schedule *s)
{
    return epipe_schedule_stages(s);
}
static inline unsigned epipe_schedule_chunks(const epipe_schedule *s, unsigned rank)
{
    (void)s, (void)rank;
    return 1;
}
static inline int epipe_schedule_stage_of(const epipe_schedule *s, unsigned rank, unsigned chunk,
                                          unsigned *stage)
{
    (void)s, (void)chunk;
    *stage = rank;
    return 0;
}
static inline int epipe_schedule_placement(const epipe_schedule *s, unsigned stage, unsigned *rank,
                                           unsigned *chunk)
{
    (void)s;
    *rank = stage, *chunk = 0;
    return 0;
}
static inline int epipe_schedule_splits_backward(const epipe_schedule *s)
{
    (void)s;
    return 0;
}
/* TEMPORARY: goes to include/epipe/stage.h after the merge */
EPIPE_API int epipe_stage_create_layout(epipe_stage **out, epipe_comm *comm, const char *schedule,
                                        unsigned microbatches, const epipe_schedule_layout *layout);
#endif
