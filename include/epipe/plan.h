/* libepipe: the compression-aware planner (experimental).
 *
 * From a profile of a chain of layers (per layer: forward and backward
 * time, output bytes, parameter and stash bytes) and a table of measured
 * codec costs per candidate boundary (encode and decode time, wire ratio,
 * error), the planner chooses the split points, the codec of every
 * boundary in each direction and the schedule that minimise the simulated
 * step time over a given link, under a memory limit per device and an
 * error budget per boundary; and it says why (docs/planner.md).
 *
 * Every call here is EPIPE_EXPERIMENTAL (docs/api.md): it may change in a
 * minor release. */
#ifndef EPIPE_PLAN_H
#define EPIPE_PLAN_H

#include <stddef.h>

#include <epipe/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One layer of the chain, for one micro-batch. Times in seconds, sizes in
 * bytes; every value finite and >= 0. */
typedef struct epipe_plan_layer {
    double forward_s;   /* forward */
    double backward_s;  /* backward: input and weight gradients together */
    double weight_s;    /* the weight-gradient part of backward_s (0: not split) */
    double out_bytes;   /* the output activation (its gradient is as large) */
    double param_bytes; /* the parameters */
    double stash_bytes; /* what a micro-batch in flight keeps for the backward */
    double update_s;    /* the optimiser's step on the parameters, once a training step */
} epipe_plan_layer;

/* One codec measured on one boundary tensor: the output of layer `layer`
 * (the boundary between layers layer and layer+1) in direction `dir`
 * (EPIPE_DIR_ACTIVATION 0, EPIPE_DIR_GRADIENT 1). The codec "none" (wire
 * ratio 1, no time, no error) is always a candidate without an entry. */
typedef struct epipe_plan_codec {
    const char *spec;  /* the codec spec; copied */
    unsigned layer;    /* 0 .. layers-2 */
    unsigned dir;      /* 0 activation, 1 gradient */
    double encode_s;   /* encoding one micro-batch's tensor */
    double decode_s;   /* decoding it */
    double wire_ratio; /* payload bytes over raw bytes, > 0 */
    double error;      /* relative MSE (activations), 1 - cosine (gradients) */
} epipe_plan_codec;

/* What to plan for. Initialise with EPIPE_PLAN_OPTIONS_INIT. */
typedef struct epipe_plan_options {
    size_t struct_size; /* sizeof(epipe_plan_options) */
    unsigned stages;    /* pipeline stages (devices), >= 1 */
    unsigned microbatches;
    double bandwidth; /* bytes/s of every link, > 0 */
    double latency_s; /* per message */
    /* Per pair, optional: [stages * stages], entry [a * stages + b] for the
     * link from device a to device b (only neighbours are used); NULL: the
     * two values above everywhere. */
    const double *pair_bandwidth;
    const double *pair_latency_s;
    double memory_bytes;      /* per device; 0: no limit */
    double param_copies;      /* memory per parameter byte: weights, gradients,
                                   optimiser state; 0: 3 */
    double act_error_budget;  /* largest codec error per boundary, activations;
                                   < 0: no limit */
    double grad_error_budget; /* the same for gradients */
    /* Candidate schedules, comma-separated: of gpipe, 1f1b, zb-h1. NULL:
     * all three. */
    const char *schedules;
} epipe_plan_options;

#define EPIPE_PLAN_OPTIONS_INIT                                                                    \
    {                                                                                              \
        sizeof(epipe_plan_options), 1, 1, 1.25e8, 0.0, NULL, NULL, 0.0, 0.0, -1.0, -1.0, NULL      \
    }

typedef struct epipe_plan epipe_plan;

/* Plans `layers` (a chain, in order) on opts->stages devices with the
 * codec candidates `codecs` (may be NULL with ncodecs 0: "none" only).
 * Returns EPIPE_OK with the plan in *out; EPIPE_EINVAL naming the bad
 * input (a NaN or negative cost, a codec entry for a boundary that does
 * not exist, more stages than layers, an unknown schedule, a problem
 * whose tables would pass 2^25 cells: (stages + 1) x (layers + 1) x the
 * most codec options of a boundary...);
 * EPIPE_ENOTSUP naming the limit when no split fits the memory limit;
 * EPIPE_ENOMEM. Messages in epipe_last_error(). Thread-safe; the inputs
 * are only read and may be freed after the call. */
EPIPE_EXPERIMENTAL int epipe_plan_create(epipe_plan **out, const epipe_plan_layer *layers,
                                         size_t nlayers, const epipe_plan_codec *codecs,
                                         size_t ncodecs, const epipe_plan_options *opts);
/* Frees a plan; NULL is a no-op. */
EPIPE_EXPERIMENTAL void epipe_plan_destroy(epipe_plan *plan);

/* The first layer of pipeline stage `stage` (stage 0 starts at 0; stage s
 * holds layers first(s) .. first(s+1)-1); the layer count for stage ==
 * stages. (unsigned)-1 for NULL or a stage out of range. */
EPIPE_EXPERIMENTAL unsigned epipe_plan_first_layer(const epipe_plan *plan, unsigned stage);
/* The codec spec of boundary b (between stages b and b+1) in direction
 * dir; owned by the plan. NULL for NULL or out of range. */
EPIPE_EXPERIMENTAL const char *epipe_plan_codec_spec(const epipe_plan *plan, unsigned boundary,
                                                     unsigned dir);
/* The schedule kind chosen; owned by the plan. */
EPIPE_EXPERIMENTAL const char *epipe_plan_schedule(const epipe_plan *plan);
/* The simulated step time of the plan, in seconds. */
EPIPE_EXPERIMENTAL double epipe_plan_step_seconds(const epipe_plan *plan);
/* The same for the best compression-blind plan: split by compute alone
 * (PipeDream-style, the link not looked at), codec "none", the best of the
 * candidate schedules, timed over the same link. */
EPIPE_EXPERIMENTAL double epipe_plan_blind_step_seconds(const epipe_plan *plan);
/* A human-readable account of the plan (per stage: layers, compute, codec
 * time, memory; per boundary: codecs, bytes on the wire, link time; the
 * bottleneck; the compression-blind plan and its time) into buf[0..cap),
 * NUL-terminated. Returns the length it needs (without the NUL), as
 * snprintf does. */
EPIPE_EXPERIMENTAL size_t epipe_plan_explain(const epipe_plan *plan, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* EPIPE_PLAN_H */
