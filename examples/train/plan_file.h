/* epipe-train's plan: which layers each pipeline stage holds, the codec of
 * every boundary in each direction, and the schedule; chosen by the
 * planner (plan_auto.c, --plan auto) or read from a file (--plan FILE),
 * and written with --plan-out. The file format is in docs/planner.md. */
#ifndef EPIPE_TRAIN_PLAN_FILE_H
#define EPIPE_TRAIN_PLAN_FILE_H

#include <stddef.h>
#include <stdio.h>

#define TRAIN_PLAN_MAX_STAGES 64
#define TRAIN_PLAN_SPEC 256 /* a codec spec, with its NUL */
#define TRAIN_PLAN_FILE_MAX 65536

struct train_plan {
    unsigned layers, stages;
    /* first[s]: the first layer of stage s; first[stages] = layers */
    unsigned first[TRAIN_PLAN_MAX_STAGES + 1];
    char schedule[32];
    /* boundary b (between stages b and b+1), b < stages - 1 */
    char act[TRAIN_PLAN_MAX_STAGES - 1][TRAIN_PLAN_SPEC];
    char grad[TRAIN_PLAN_MAX_STAGES - 1][TRAIN_PLAN_SPEC];
};

/* Parses len bytes of plan text (not NUL-terminated) into *p. Returns 0, or
 * -1 with a message naming the line and what is wrong in err[0..cap).
 * Checks the form only: whether the layer and stage counts fit the model,
 * the schedule exists and the specs parse is for the caller and the stage. */
int train_plan_parse(const char *text, size_t len, struct train_plan *p, char *err, size_t cap);

/* Reads and parses the file at path (at most TRAIN_PLAN_FILE_MAX bytes).
 * 0, or -1 with a message. */
int train_plan_load(const char *path, struct train_plan *p, char *err, size_t cap);

/* Writes p in the format train_plan_parse() reads. 0, or -1 (errno). */
int train_plan_write(FILE *f, const struct train_plan *p);

/* Writes p to the file at path whole or not at all: through a temporary
 * file beside it, renamed over path at the end, so a failure (a full disk)
 * leaves path as it was. 0, or the errno of the failure. */
int train_plan_save(const char *path, const struct train_plan *p);

#endif
