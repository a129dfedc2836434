/* epipe-train's options, filled from the command line by
 * train_parse_args() (options.c) and read by the trainer (train.c). */
#ifndef EPIPE_TRAIN_OPTIONS_H
#define EPIPE_TRAIN_OPTIONS_H

#include <stdint.h>
#include <stdio.h>

#include "model.h"
#include "plan_file.h"

struct options {
    unsigned stages, microbatches;
    unsigned chunks;                /* --chunks: per rank (0 = the schedule's default) */
    unsigned placement[64], nplace; /* --placement: rank of each pipeline stage */
    const char *schedule, *act_codec, *grad_codec, *data_dir;
    int epochs, batch, hidden[MODEL_MAX_LAYERS], nhidden;
    float lr, momentum, codec_lr;
    uint64_t seed;
    long train_limit;
    int quiet, blas_threads;
    int schedule_set, codecs_set, stages_set; /* given on the command line */
    /* --plan auto|FILE, --plan-out, --link, --link-latency, --plan-codecs,
     * --plan-error (plan_auto.h, docs/planner.md) */
    const char *plan, *plan_out, *plan_codecs;
    double link_rate, link_latency, plan_error;
    const struct train_plan *layout; /* the plan in use, or NULL */
};

/* Prints the usage text to f. */
void train_usage(FILE *f);
/* Parses argv into o (whose defaults the caller set); 0, or -1 after
 * printing what was wrong. --help prints the usage and exits. */
int train_parse_args(int argc, char **argv, struct options *o);

#endif
