/* A pipeline host for the tests: one stage of the test MLP (tests/mlp.h),
 * driven by callbacks or by the op stream, on any communicator. */
#ifndef EPIPE_TESTS_PIPELINE_HOST_H
#define EPIPE_TESTS_PIPELINE_HOST_H

#include <epipe/epipe.h>

#include "mlp.h"

#define HOST_MAX_LAYERS 8
#define HOST_MAX_MB 16

/* The model every test trains: widths of layer inputs, then the output. */
extern const int host_dims[];
extern const int host_nlayers;
#define HOST_BATCH 16
#define HOST_LR 0.1f

struct host_call;

struct host_config {
    const char *schedule;
    unsigned microbatches;
    int steps;
    const char *act_codec, *grad_codec; /* NULL = none */
    int one_boundary;                   /* 1: the codecs go on boundary `boundary` only */
    unsigned boundary;
    int use_op_stream;
    /* > 0: after each step, the built-in SGD for trainable codecs
     * (epipe_stage_codec_sgd_step) with this lr and momentum. */
    double codec_lr, codec_momentum;
    /* Layout (epipe_schedule_layout): chunks per rank (0 = the kind's
     * default) and the rank of each pipeline stage (NULL = the default). */
    unsigned chunks;
    const unsigned *placement;
    unsigned placement_len;
    /* 1: backward_input and backward_weight (split backward); 0: backward */
    int split;
    /* Creates the stage instead of host_create_stage's default (tests that
     * run raw op lists); arg is theirs. */
    int (*create)(epipe_stage **out, epipe_comm *comm, const struct host_config *cfg);
    const void *create_arg;
    /* Called before each call an op-stream host makes on the stage, and
     * at the start of each callback, to make calls of its own first (tests
     * of misuse). Nonzero stops the host (in a callback, by returning 9):
     * res->error is then the hook's call->error. */
    int (*before_call)(struct host_call *call);
    void *hook_arg;
};

/* What the op-stream host is about to do, for host_config.before_call. */
enum host_call_kind {
    HOST_NEXT_OP,
    HOST_RECV_ACTIVATION,
    HOST_SEND_ACTIVATION,
    HOST_RECV_GRADIENT,
    HOST_SEND_GRADIENT,
    HOST_IN_CALLBACK /* callbacks: at the start of each, which then go on */
};
struct host_call {
    epipe_stage *stage;
    enum host_call_kind kind;
    unsigned microbatch;    /* the op's; for HOST_NEXT_OP, unset */
    const DLTensor *tensor; /* what a send will send */
    unsigned microbatches;
    unsigned rank;
    int in_step;     /* next_op has given an op of this step, not yet NONE */
    int started;     /* next_op has been called on this stage */
    uint64_t serial; /* the hook's calls on this rank so far */
    void *arg;       /* host_config.hook_arg */
    char error[512];
};

struct host_result {
    int rc; /* first error status, or EPIPE_OK */
    char error[512];
    double first_loss, last_loss; /* last stage: mean loss of the first and last step */
    epipe_stage_stats stats;
    /* The activations of the boundary below this stage as sent (index 0:
     * first step, 1: last step, all micro-batches), and of the boundary
     * above it as received (restored by the codec). */
    float act_sent[2][HOST_BATCH * 16], act_recv[2][HOST_BATCH * 16];
    /* This rank's layers after training, for comparison: owns[l] says
     * which; l0, l1: the range of its first chunk. */
    int l0, l1;
    unsigned char owns[HOST_MAX_LAYERS];
    int holds_last; /* this rank holds the last pipeline stage (the loss) */
    mlp_layer layers[HOST_MAX_LAYERS];
};

/* One rank run by host_rank_thread(): its communicator and config (set by
 * the caller) and its result. */
struct host_rank {
    epipe_comm *comm;
    struct host_config cfg;
    struct host_result res;
};
/* A pthread body: host_run(a->comm, &a->cfg, &a->res). */
void *host_rank_thread(void *a);
/* cfg on p ranks of a fresh in-process communicator, a thread each, a[r]
 * filled; 0, or -1 when the communicator or a thread could not be made. */
int host_run_threads(unsigned p, const struct host_config *cfg, struct host_rank *a);
/* |a-b| / max(|a|,|b|), or |a-b| where both are tiny. */
double host_rel_diff(float a, float b);

/* Creates rank epipe_comm_rank(comm)'s stage with cfg's schedule and layout. */
int host_create_stage(epipe_stage **out, epipe_comm *comm, const struct host_config *cfg);

/* Layers [*l0, *l1) of the model that pipeline stage s of p owns (empty
 * when p exceeds the layer count: such a stage passes tensors on). */
void host_partition(unsigned s, unsigned p, int *l0, int *l1);

/* Trains stage `epipe_comm_rank(comm)` for cfg->steps steps; fills res
 * (res->layers must be freed with host_result_free). Takes ownership of
 * comm and destroys it. */
void host_run(epipe_comm *comm, const struct host_config *cfg, struct host_result *res);
void host_result_free(struct host_result *res);

/* Raw op lists (tests of the runtime without a schedule kind) for any
 * placement, in one global order that respects every dependency: all
 * forwards by (micro-batch, pipeline stage), then the backwards by
 * (micro-batch, stage from the last); with split, each backward is an
 * input-gradient op and every weight-gradient op comes at the end of its
 * rank's list (the activations must live until then). */
#define HOST_RAW_MAX_STAGES 16
#define HOST_RAW_MAX_RANKS 8
#define HOST_RAW_MAX_OPS 1024
struct host_raw_layout {
    unsigned P, ranks, m;                    /* set by the caller */
    unsigned placement[HOST_RAW_MAX_STAGES]; /* set by the caller */
    int split;                               /* set by the caller */
    epipe_op ops[HOST_RAW_MAX_RANKS][HOST_RAW_MAX_OPS];
    size_t n[HOST_RAW_MAX_RANKS];
};
/* Fills L->ops and L->n; -1 if they do not fit. */
int host_build_raw(struct host_raw_layout *L);
/* A host_config.create that runs cfg->create_arg (a host_raw_layout). */
int host_create_raw(epipe_stage **out, epipe_comm *comm, const struct host_config *cfg);

/* The same training in one process without libepipe: the reference. */
void host_reference(unsigned microbatches, int steps, mlp_layer *layers, double *first_loss,
                    double *last_loss);

/* The reference for 1f1b-async (weights = EPIPE_WEIGHTS_STASHED) and
 * 1f1b-2bw (EPIPE_WEIGHTS_DOUBLE) over `stages` pipeline stages, one
 * process, micro-batch after micro-batch: each stage's forward of global
 * micro-batch g uses the weights the pipeline's would (async: after
 * g - (stages-s-1) updates of stage s, one per backward; 2bw: after one
 * update per earlier step), its backward the same version, and each stage
 * applies its updates when the pipeline's host does, over the drain too. */
void host_reference_async(int weights, unsigned stages, unsigned microbatches, int steps,
                          mlp_layer *layers, double *first_loss, double *last_loss);

#endif
