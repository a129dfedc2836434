/* Internal to lib/stage/: the stage handle and the small helpers that its
 * three files (setup and statistics, the op stream, the callback driver) share. */
#ifndef EPIPE_STAGE_IMPL_H
#define EPIPE_STAGE_IMPL_H

#include <epipe/codec.h>
#include <epipe/stage.h>

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "../comm/comm_impl.h"
#include "../error.h"
#include "trace.h"

/* A tensor the stage decoded and lends to the host. */
struct lent_tensor {
    DLTensor t;
    int64_t shape[EPIPE_MAX_NDIM];
    void *buf;
    size_t cap;
};

/* The shape and dtype the first micro-batch of a step sent one way; the
 * others must match. */
struct sent_shape {
    int set;
    DLDataType dtype;
    int ndim;
    int64_t shape[EPIPE_MAX_NDIM];
};

enum { DIR_ACT = EPIPE_DIR_ACTIVATION, DIR_GRAD = EPIPE_DIR_GRADIENT };

struct epipe_stage {
    epipe_comm *comm;
    epipe_schedule *sched;
    const epipe_op *train_ops; /* this stage's list in the schedule */
    size_t ntrain_ops;
    epipe_op *eval_ops; /* forwards only, in micro-batch order */
    int training;
    const epipe_op *ops; /* the list the current step runs */
    size_t nops;
    unsigned s, p, m;

    /* Codecs of the two boundaries this stage touches, one per use. */
    epipe_codec *enc_act;  /* activations to s+1 */
    epipe_codec *dec_act;  /* activations from s-1 */
    epipe_codec *enc_grad; /* gradients to s-1 */
    epipe_codec *dec_grad; /* gradients from s+1 */

    int64_t timeout_ms;
    unsigned codec_threads;
    int64_t batch;
    epipe_stage_callbacks cb;
    int has_cb;
    int tracing;
    epipe_trace *trace; /* this stage's spans (NULL: tracing off) */

    /* Position in the step. */
    int started, in_step;
    uint64_t step;
    size_t pc;
    int cur_valid;
    epipe_op cur;
    int need_recv, did_recv, need_send, did_send;
    double step_t0, op_t0, mark;

    struct lent_tensor *act_in; /* [m]: kept until the micro-batch's backward */
    struct lent_tensor grad_in;
    /* Trainable activation codecs: the code gradient received (sender
     * side) or computed and sent (receiver side). */
    struct lent_tensor code_in, code_out;
    struct sent_shape sent[2];

    epipe_stage_stats st;
    char msg[EPIPE_ERRMSG_MAX];
};

static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

__attribute__((format(printf, 3, 4))) static inline int fail(epipe_stage *st, int status,
                                                             const char *fmt, ...)
{
    char text[EPIPE_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    return epipe_fail_into(st->msg, status, "stage %u: %s", st->s, text);
}

/* Host compute is the time between the stage's calls within a step. */
static inline void enter(epipe_stage *st)
{
    epipe_clear_error();
    if (st->in_step)
        st->st.compute_seconds += now() - st->mark;
}

static inline int leave(epipe_stage *st, int rc)
{
    st->mark = now();
    return rc;
}

static inline const char *op_text(const epipe_op *op, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s of micro-batch %u",
             op->kind == EPIPE_OP_FORWARD ? "forward" : "backward", op->microbatch);
    return buf;
}

/* The receive timeout in force: the stage's own once EPIPE_STAGE_TIMEOUT_MS
 * was set, else the communicator's as it is now. */
static inline int64_t stage_timeout_ms(const epipe_stage *st)
{
    return st->timeout_ms ? st->timeout_ms
                          : __atomic_load_n(&st->comm->timeout_ms, __ATOMIC_RELAXED);
}

/* The op stream (opstream.c), which the callback driver (step.c) runs. */
int epipe_stage_advance(epipe_stage *st, epipe_op *op);
int epipe_stage_recv_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor **t);
int epipe_stage_send_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor *t);

#endif
