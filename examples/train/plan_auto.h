/* --plan auto: profiles epipe-train's model on this machine (per layer
 * forward, backward and weight-gradient time; each boundary's activation
 * and gradient through every candidate codec: time, wire ratio, error),
 * and asks libepipe's planner (epipe/plan.h) for the split, the codecs and
 * the schedule over the link the options name. */
#ifndef EPIPE_TRAIN_PLAN_AUTO_H
#define EPIPE_TRAIN_PLAN_AUTO_H

#include <stddef.h>
#include <stdint.h>

#include "plan_file.h"

struct options;

/* The candidate codecs when --plan-codecs is not given. */
#define TRAIN_PLAN_CODECS "sortquant:bits=8,zero=1;sortquant:bits=4,zero=1"

/* The network's widths dims[0..layers] (input, hidden..., classes) and
 * `rows` real input rows x (rows x dims[0]) with their labels. Fills *plan;
 * writes the planner's explanation into why[0..why_cap). 0, or -1 with a
 * message in err. */
int train_plan_auto(const struct options *o, const int *dims, unsigned layers, const float *x,
                    const uint8_t *labels, int rows, struct train_plan *plan, char *why,
                    size_t why_cap, char *err, size_t cap);

/* "100Mbit", "1Gbit", "12.5MB", "125000000": bytes/s in *v. 0, or -1. */
int train_parse_rate(const char *text, double *v);

#endif
