/* Internal to libepipe and its tests: a stage over raw op lists, for
 * testing the runtime on lists no schedule kind makes. */
#ifndef EPIPE_STAGE_RAW_H
#define EPIPE_STAGE_RAW_H

#include <stddef.h>

#include <epipe/stage.h>

/* Tests: a stage that runs this rank's raw op list `ops` (copied) over the
 * placement (rank of each of `pipeline_stages` stages; a rank's chunks are
 * its stages in pipeline order), without a schedule object: kind "raw",
 * epipe_stage_schedule() NULL. `splits`: the list uses BACKWARD_INPUT and
 * BACKWARD_WEIGHT. The lists are not proven. */
int epipe_stage_create_raw(epipe_stage **out, epipe_comm *comm, unsigned microbatches,
                           unsigned pipeline_stages, const unsigned *placement, const epipe_op *ops,
                           size_t nops, int splits);

#endif
