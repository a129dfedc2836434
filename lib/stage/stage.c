/* The stage runtime: walks one stage's op list, checks the host's calls
 * against it, encodes and sends outputs, receives and decodes inputs, and
 * keeps the statistics. The callback driver is built on the op stream. */
#define _POSIX_C_SOURCE 200809L
#include <epipe/codec.h>
#include <epipe/stage.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../codec/codec_internal.h"
#include "../codec/payload.h"
#include "../comm/comm_impl.h"
#include "../error.h"
#include "../tensor.h"
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
    epipe_op *eval_ops;        /* forwards only, in micro-batch order */
    int training;
    const epipe_op *ops;       /* the list the current step runs */
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

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

__attribute__((format(printf, 3, 4))) static int fail(epipe_stage *st, int status,
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
static void enter(epipe_stage *st)
{
    epipe_clear_error();
    if (st->in_step)
        st->st.compute_seconds += now() - st->mark;
}

static int leave(epipe_stage *st, int rc)
{
    st->mark = now();
    return rc;
}

static const char *op_text(const epipe_op *op, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s of micro-batch %u",
             op->kind == EPIPE_OP_FORWARD ? "forward" : "backward", op->microbatch);
    return buf;
}

/* ---- create, configure, destroy ---------------------------------------- */

static int make_codec(epipe_stage *st, epipe_codec **slot, const char *spec)
{
    epipe_codec *c;
    int rc = epipe_codec_create(&c, spec);
    if (rc)
        return fail(st, rc, "%s", epipe_last_error());
    epipe_codec_set_param(c, EPIPE_CODEC_THREADS, st->codec_threads);
    epipe_codec_destroy(*slot);
    *slot = c;
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_create(epipe_stage **out, epipe_comm *comm, const char *schedule,
                                 unsigned microbatches)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_create: out is NULL");
    *out = NULL;
    if (!comm || !schedule)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_create: comm or schedule is NULL");
    epipe_stage *st = calloc(1, sizeof *st);
    if (!st)
        return epipe_fail(EPIPE_ENOMEM, "epipe_stage_create: out of memory");
    st->comm = comm;
    st->s = epipe_comm_rank(comm);
    st->p = epipe_comm_size(comm);
    st->m = microbatches;
    st->timeout_ms = 0; /* until EPIPE_STAGE_TIMEOUT_MS: the communicator's, at each receive */
    st->codec_threads = 1;
    int rc = epipe_schedule_create(&st->sched, schedule, st->p, microbatches);
    if (rc == EPIPE_OK)
        rc = epipe_schedule_ops(st->sched, st->s, &st->train_ops, &st->ntrain_ops);
    if (rc) {
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", epipe_last_error());
        epipe_stage_destroy(st);
        return epipe_fail(rc, "epipe_stage_create: %s", why);
    }
    st->act_in = calloc(microbatches, sizeof *st->act_in);
    st->eval_ops = calloc(microbatches, sizeof *st->eval_ops);
    for (unsigned i = 0; st->eval_ops && i < microbatches; i++)
        st->eval_ops[i] = (epipe_op){.kind = EPIPE_OP_FORWARD, .microbatch = i};
    st->training = 1;
    if (!st->act_in || !st->eval_ops || make_codec(st, &st->enc_act, "none") || make_codec(st, &st->dec_act, "none") ||
        make_codec(st, &st->enc_grad, "none") || make_codec(st, &st->dec_grad, "none")) {
        epipe_stage_destroy(st);
        return epipe_fail(EPIPE_ENOMEM, "epipe_stage_create: out of memory");
    }
    st->trace = epipe_trace_open(comm->trace, st->s, !strcmp(epipe_comm_transport(comm), "tcp"));
    st->tracing = st->trace != NULL;
    st->st.struct_size = sizeof st->st;
    *out = st;
    return EPIPE_OK;
}

EPIPE_API void epipe_stage_destroy(epipe_stage *st)
{
    if (!st)
        return;
    if (st->act_in) {
        for (unsigned i = 0; i < st->m; i++)
            free(st->act_in[i].buf);
        free(st->act_in);
    }
    epipe_trace_close(st->trace);
    free(st->grad_in.buf);
    free(st->code_in.buf);
    free(st->code_out.buf);
    free(st->eval_ops);
    epipe_codec_destroy(st->enc_act);
    epipe_codec_destroy(st->dec_act);
    epipe_codec_destroy(st->enc_grad);
    epipe_codec_destroy(st->dec_grad);
    epipe_schedule_destroy(st->sched);
    free(st);
}

EPIPE_API int epipe_stage_set_codec(epipe_stage *st, epipe_direction dir, unsigned boundary,
                                    const char *spec)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_set_codec: stage is NULL");
    if (!spec)
        return fail(st, EPIPE_EINVAL, "codec spec is NULL");
    if (dir != EPIPE_DIR_ACTIVATION && dir != EPIPE_DIR_GRADIENT)
        return fail(st, EPIPE_EINVAL, "direction %d is neither activation (0) nor gradient (1)",
                    (int)dir);
    if (boundary != EPIPE_ALL_BOUNDARIES && (st->p < 2 || boundary > st->p - 2))
        return fail(st, EPIPE_EINVAL, "boundary %u does not exist: %u stages have boundaries 0..%d",
                    boundary, st->p, (int)st->p - 2);
    if (st->started)
        return fail(st, EPIPE_ESTATE, "codecs can only be set before the first step");
    epipe_codec *probe;
    int rc = epipe_codec_create(&probe, spec); /* check the spec even if unused here */
    if (rc)
        return fail(st, rc, "%s", epipe_last_error());
    int trainable = epipe_codec_trainable(probe);
    epipe_codec_destroy(probe);
    if (trainable && dir == EPIPE_DIR_GRADIENT)
        return fail(st, EPIPE_ENOTSUP,
                    "'%s' is trainable: it goes on the activation direction, and then the "
                    "gradient of its code crosses back (docs/runtime.md); nothing trains a "
                    "gradient codec",
                    spec);
    int all = boundary == EPIPE_ALL_BOUNDARIES;
    int down = st->s + 1 < st->p && (all || boundary == st->s);
    int up = st->s > 0 && (all || boundary + 1 == st->s);
    if (down && (rc = make_codec(st, dir == EPIPE_DIR_ACTIVATION ? &st->enc_act : &st->dec_grad, spec)))
        return rc;
    if (up && (rc = make_codec(st, dir == EPIPE_DIR_ACTIVATION ? &st->dec_act : &st->enc_grad, spec)))
        return rc;
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_set_param(epipe_stage *st, epipe_stage_param param, int64_t value)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_set_param: stage is NULL");
    switch (param) {
    case EPIPE_STAGE_TIMEOUT_MS:
        if (value < 1 || value > 86400000)
            return fail(st, EPIPE_EINVAL, "EPIPE_STAGE_TIMEOUT_MS = %lld is out of range 1..86400000",
                        (long long)value);
        st->timeout_ms = value;
        return EPIPE_OK;
    case EPIPE_STAGE_CODEC_THREADS: {
        if (value < 0 || value > 256)
            return fail(st, EPIPE_EINVAL, "EPIPE_STAGE_CODEC_THREADS = %lld is out of range 0..256",
                        (long long)value);
        st->codec_threads = (unsigned)value;
        epipe_codec *all[4] = {st->enc_act, st->dec_act, st->enc_grad, st->dec_grad};
        for (int i = 0; i < 4; i++)
            epipe_codec_set_param(all[i], EPIPE_CODEC_THREADS, value);
        return EPIPE_OK;
    }
    case EPIPE_STAGE_BATCH_SIZE:
        if (value < 0)
            return fail(st, EPIPE_EINVAL, "EPIPE_STAGE_BATCH_SIZE = %lld is negative",
                        (long long)value);
        if (value % st->m)
            return fail(st, EPIPE_EINVAL,
                        "batch size %lld does not divide into %u micro-batches", (long long)value,
                        st->m);
        st->batch = value;
        return EPIPE_OK;
    case EPIPE_STAGE_TRAINING:
        if (value != 0 && value != 1)
            return fail(st, EPIPE_EINVAL, "EPIPE_STAGE_TRAINING = %lld: use 1 (train) or 0 "
                        "(forward only)", (long long)value);
        if (st->in_step)
            return fail(st, EPIPE_ESTATE, "EPIPE_STAGE_TRAINING can only change between steps");
        st->training = (int)value;
        return EPIPE_OK;
    }
    return fail(st, EPIPE_EINVAL, "unknown stage parameter %d", (int)param);
}

/* The receive timeout in force: the stage's own once EPIPE_STAGE_TIMEOUT_MS
 * was set, else the communicator's as it is now. */
static int64_t stage_timeout_ms(const epipe_stage *st)
{
    return st->timeout_ms ? st->timeout_ms
                          : __atomic_load_n(&st->comm->timeout_ms, __ATOMIC_RELAXED);
}

EPIPE_API int epipe_stage_get_param(const epipe_stage *st, epipe_stage_param param,
                                    int64_t *value)
{
    epipe_clear_error();
    if (!st || !value)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_get_param: %s is NULL",
                          st ? "value" : "stage");
    switch (param) {
    case EPIPE_STAGE_TIMEOUT_MS:
        *value = stage_timeout_ms(st);
        return EPIPE_OK;
    case EPIPE_STAGE_CODEC_THREADS:
        *value = (int64_t)st->codec_threads;
        return EPIPE_OK;
    case EPIPE_STAGE_BATCH_SIZE:
        *value = st->batch;
        return EPIPE_OK;
    case EPIPE_STAGE_TRAINING:
        *value = st->training;
        return EPIPE_OK;
    }
    /* fail() writes the handle's message, which a const handle cannot take. */
    return epipe_fail(EPIPE_EINVAL, "epipe_stage_get_param: unknown stage parameter %d",
                      (int)param);
}

EPIPE_API unsigned epipe_stage_index(const epipe_stage *st)
{
    return st ? st->s : 0;
}

EPIPE_API unsigned epipe_stage_count(const epipe_stage *st)
{
    return st ? st->p : 0;
}

EPIPE_API const epipe_schedule *epipe_stage_schedule(const epipe_stage *st)
{
    return st ? st->sched : NULL;
}

EPIPE_API const char *epipe_stage_last_error(const epipe_stage *st)
{
    return st ? st->msg : "";
}

EPIPE_API epipe_codec *epipe_stage_codec(epipe_stage *st, epipe_direction dir,
                                         epipe_boundary_side side)
{
    if (!st || (dir != EPIPE_DIR_ACTIVATION && dir != EPIPE_DIR_GRADIENT))
        return NULL;
    if (side == EPIPE_SIDE_DOWN && st->s + 1 < st->p)
        return dir == EPIPE_DIR_ACTIVATION ? st->enc_act : st->dec_grad;
    if (side == EPIPE_SIDE_UP && st->s > 0)
        return dir == EPIPE_DIR_ACTIVATION ? st->dec_act : st->enc_grad;
    return NULL;
}

EPIPE_API int epipe_stage_codec_sgd_step(epipe_stage *st, double lr, double momentum)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_codec_sgd_step: stage is NULL");
    if (st->in_step)
        return fail(st, EPIPE_ESTATE, "epipe_stage_codec_sgd_step can only run between steps");
    epipe_codec *mine[2] = {st->s + 1 < st->p ? st->enc_act : NULL,
                            st->s > 0 ? st->dec_act : NULL};
    for (int i = 0; i < 2; i++) {
        if (!epipe_codec_trainable(mine[i]))
            continue;
        int rc = epipe_codec_sgd_step(mine[i], lr, momentum);
        if (rc == EPIPE_OK)
            rc = epipe_codec_zero_grad(mine[i]);
        if (rc)
            return fail(st, rc, "%s", epipe_codec_last_error(mine[i]));
    }
    return EPIPE_OK;
}

/* ---- the op stream ------------------------------------------------------ */

static int finish_current_op(epipe_stage *st)
{
    char what[64];
    if (!st->cur_valid)
        return EPIPE_OK;
    if (st->need_recv && !st->did_recv)
        return fail(st, EPIPE_ESTATE, "the %s ended without receiving its %s",
                    op_text(&st->cur, what, sizeof what),
                    st->cur.kind == EPIPE_OP_FORWARD ? "activation" : "gradient");
    if (st->need_send && !st->did_send)
        return fail(st, EPIPE_ESTATE, "the %s ended without sending its %s",
                    op_text(&st->cur, what, sizeof what),
                    st->cur.kind == EPIPE_OP_FORWARD ? "activation" : "gradient");
    if (st->tracing) {
        char name[12];
        snprintf(name, sizeof name, "%c%u", st->cur.kind == EPIPE_OP_FORWARD ? 'F' : 'B',
                 st->cur.microbatch);
        epipe_trace_span(st->trace, name, "compute", st->op_t0, now());
    }
    st->cur_valid = 0;
    return EPIPE_OK;
}

static int next_op(epipe_stage *st, epipe_op *op)
{
    /* A backward (or, forward-only, a forward) that ends now gives its
     * received activation back to the stage. */
    int releases = st->cur_valid && (st->cur.kind == EPIPE_OP_BACKWARD || !st->training);
    unsigned mb = st->cur.microbatch;
    int rc = finish_current_op(st);
    if (rc)
        return rc;
    if (releases)
        st->act_in[mb].t.data = NULL;
    if (!st->in_step) {
        st->in_step = st->started = 1;
        st->pc = 0;
        st->ops = st->training ? st->train_ops : st->eval_ops;
        st->nops = st->training ? st->ntrain_ops : st->m;
        st->step_t0 = st->mark = now();
        memset(st->sent, 0, sizeof st->sent);
    }
    while (st->pc < st->nops && st->ops[st->pc].kind != EPIPE_OP_FORWARD &&
           st->ops[st->pc].kind != EPIPE_OP_BACKWARD)
        st->pc++;
    if (st->pc == st->nops) {
        st->in_step = 0;
        st->st.steps++;
        st->st.step_seconds += now() - st->step_t0;
        st->step++;
        memset(op, 0, sizeof *op);
        op->kind = EPIPE_OP_NONE;
        return EPIPE_OK;
    }
    st->cur = st->ops[st->pc++];
    st->cur_valid = 1;
    int fwd = st->cur.kind == EPIPE_OP_FORWARD;
    st->need_recv = fwd ? st->s > 0 : st->s + 1 < st->p;
    st->need_send = fwd ? st->s + 1 < st->p : st->s > 0;
    st->did_recv = st->did_send = 0;
    st->op_t0 = now();
    *op = st->cur;
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_next_op(epipe_stage *st, epipe_op *op)
{
    if (!st || !op)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_next_op: stage or op is NULL");
    enter(st);
    return leave(st, next_op(st, op));
}

/* Checks that a receive or send for `mb` in direction `dir` is what the
 * current op expects. */
static int expect(epipe_stage *st, unsigned mb, int is_recv, int dir)
{
    static const char *const names[2][2] = {{"send_activation", "send_gradient"},
                                            {"recv_activation", "recv_gradient"}};
    const char *call = names[is_recv][dir];
    unsigned want = dir == DIR_ACT ? EPIPE_OP_FORWARD : EPIPE_OP_BACKWARD;
    char what[64];
    if (!st->cur_valid)
        return fail(st, EPIPE_ESTATE, "%s(%u) called with no op in progress: call next_op first",
                    call, mb);
    /* the op's text is formatted only for an error: this runs for every send and receive */
#define WHAT op_text(&st->cur, what, sizeof what)
    if (st->cur.kind != want || st->cur.microbatch != mb)
        return fail(st, EPIPE_ESTATE, "%s(%u) called during the %s", call, mb, WHAT);
    if (is_recv ? !st->need_recv : !st->need_send)
        return fail(st, EPIPE_ESTATE, "%s(%u): the %s of stage %u of %u has nothing to %s", call,
                    mb, WHAT, st->s, st->p, is_recv ? "receive" : "send");
    if (is_recv ? st->did_recv : st->did_send)
        return fail(st, EPIPE_ESTATE, "%s(%u) called twice in the %s", call, mb, WHAT);
    if (is_recv && st->need_send && st->did_send)
        return fail(st, EPIPE_ESTATE, "%s(%u) called after the %s already sent", call, mb, WHAT);
#undef WHAT
    return EPIPE_OK;
}

/* Points lt at a dense CPU tensor of the given shape and dtype, growing its
 * buffer as needed. */
static int lend_shape(epipe_stage *st, struct lent_tensor *lt, int ndim, const int64_t *shape,
                      DLDataType dtype)
{
    size_t esz = (size_t)(dtype.bits / 8), n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || (shape[d] && n > SIZE_MAX / esz / (size_t)shape[d]))
            return fail(st, EPIPE_EOVERFLOW, "a %d-dimensional tensor is too large to hold", ndim);
        n *= (size_t)shape[d];
    }
    if (lt->cap < n * esz) {
        void *p = realloc(lt->buf, n * esz > 0 ? n * esz : 1);
        if (!p)
            return fail(st, EPIPE_ENOMEM, "no memory for a %zu-byte tensor", n * esz);
        lt->buf = p, lt->cap = n * esz;
    }
    memset(&lt->t, 0, sizeof lt->t);
    lt->t.data = lt->buf;
    lt->t.device.device_type = kDLCPU;
    lt->t.ndim = ndim;
    lt->t.shape = lt->shape;
    memcpy(lt->shape, shape, sizeof(int64_t) * (size_t)ndim);
    lt->t.dtype = dtype;
    return EPIPE_OK;
}

/* The activation codec of this stage's boundary `dir`-side is trainable and
 * the stage trains: its backward runs in the stage. */
static int trains(const epipe_stage *st, const epipe_codec *c)
{
    return st->training && epipe_codec_trainable(c);
}

static int recv_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor **t)
{
    int rc = expect(st, mb, 1, dir);
    if (rc)
        return rc;
    unsigned peer = dir == DIR_ACT ? st->s - 1 : st->s + 1;
    epipe_msg *msg;
    double t0 = now();
    rc = epipe_comm_recv(st->comm, peer, dir == DIR_ACT ? EPIPE_WIRE_ACTIVATION : EPIPE_WIRE_GRADIENT,
                         st->step, mb, stage_timeout_ms(st),
                         &msg);
    double t1 = now();
    st->st.wait_seconds += t1 - t0;
    if (st->tracing)
        epipe_trace_span(st->trace, dir == DIR_ACT ? "wait-act" : "wait-grad", "wait", t0, t1);
    if (rc)
        return fail(st, rc, "%s", epipe_comm_last_error(st->comm));
    /* A gradient for a trainable activation codec is the code's: decode it
     * aside, then back-propagate it through the compress into grad_in. */
    int code_grad = dir == DIR_GRAD && trains(st, st->enc_act);
    struct lent_tensor *lt = dir == DIR_ACT ? &st->act_in[mb] : code_grad ? &st->code_in
                                                                          : &st->grad_in;
    const epipe_wire_header *h = &msg->hdr;
    uint64_t n;
    size_t esz = epipe_dtype_size((enum epipe_dtype)h->dtype);
    if (epipe_wire_numel(h, &n) || n > SIZE_MAX / esz) {
        epipe_msg_free(msg);
        return fail(st, EPIPE_EOVERFLOW, "the %s from stage %u is too large to hold",
                    epipe_wire_kind_name(h->kind), peer);
    }
    if (lt->cap < n * esz) {
        void *p = realloc(lt->buf, n * esz);
        if (!p) {
            epipe_msg_free(msg);
            return fail(st, EPIPE_ENOMEM, "no memory for a %zu-byte %s", (size_t)(n * esz),
                        epipe_wire_kind_name(h->kind));
        }
        lt->buf = p, lt->cap = n * esz;
    }
    memset(&lt->t, 0, sizeof lt->t);
    lt->t.data = lt->buf;
    lt->t.device.device_type = kDLCPU;
    lt->t.ndim = h->ndim;
    lt->t.shape = lt->shape;
    for (int d = 0; d < h->ndim; d++)
        lt->shape[d] = (int64_t)h->shape[d];
    lt->t.dtype.code = h->dtype == EPIPE_DTYPE_BF16 ? kDLBfloat : kDLFloat;
    lt->t.dtype.bits = (uint8_t)(esz * 8);
    lt->t.dtype.lanes = 1;
    epipe_codec *codec = dir == DIR_ACT ? st->dec_act : st->dec_grad;
    if (dir == DIR_ACT && epipe_codec_trainable(codec))
        epipe_codec_set_param(codec, EPIPE_CODEC_MICROBATCH, st->training ? (int64_t)mb : -1);
    rc = epipe_codec_decode(codec, msg->data + h->header_len, (size_t)h->payload_len, &lt->t);
    double t2 = now();
    st->st.decode_seconds += t2 - t1;
    if (st->tracing)
        epipe_trace_span(st->trace, "decode", "decode", t1, t2);
    uint64_t wire = msg->len;
    epipe_msg_free(msg);
    if (rc) {
        lt->t.data = NULL;
        return fail(st, rc, "decoding the %s of micro-batch %u from stage %u: %s",
                    dir == DIR_ACT ? "activation" : "gradient", mb, peer,
                    epipe_codec_last_error(codec));
    }
    uint64_t raw = n * esz;
    if (code_grad) { /* raw: the gradient of the activation sent, as the host sees it */
        const struct sent_shape *as = &st->sent[DIR_ACT];
        raw = as->dtype.bits / 8u;
        for (int d = 0; d < as->ndim; d++)
            raw *= (uint64_t)as->shape[d];
    }
    if (dir == DIR_ACT)
        st->st.act_recv_raw += raw, st->st.act_recv_wire += wire;
    else
        st->st.grad_recv_raw += raw, st->st.grad_recv_wire += wire;
    if (code_grad) {
        /* The gradient of the activation this stage sent for mb: the shape
         * and dtype of the step's activations. */
        const struct sent_shape *ss = &st->sent[DIR_ACT];
        if (!ss->set)
            return fail(st, EPIPE_EINTERNAL, "a code gradient arrived before any activation "
                        "was sent this step");
        if ((rc = lend_shape(st, &st->grad_in, ss->ndim, ss->shape, ss->dtype)))
            return rc;
        rc = epipe_codec_encode_backward(st->enc_act, mb, &lt->t, &st->grad_in.t);
        double t3 = now();
        st->st.decode_seconds += t3 - t2;
        if (st->tracing)
            epipe_trace_span(st->trace, "compress-backward", "decode", t2, t3);
        if (rc)
            return fail(st, rc, "back-propagating the code gradient of micro-batch %u through "
                        "the compress: %s",
                        mb, epipe_codec_last_error(st->enc_act));
        lt = &st->grad_in;
    }
    st->did_recv = 1;
    *t = &lt->t;
    return EPIPE_OK;
}

/* A gradient sent back has the shape and dtype of the activation received
 * for that micro-batch (still lent to the host during its backward). */
static int check_grad_like_input(epipe_stage *st, const DLTensor *t, unsigned mb)
{
    const DLTensor *in = &st->act_in[mb].t;
    if (!in->data)
        return EPIPE_OK;
    int same = in->ndim == t->ndim && in->dtype.code == t->dtype.code &&
               in->dtype.bits == t->dtype.bits &&
               memcmp(in->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) == 0;
    if (!same)
        return fail(st, EPIPE_EINVAL,
                    "the gradient of micro-batch %u differs in shape or dtype from the activation "
                    "received for it (ndim %d vs %d, last dim %lld vs %lld, %u vs %u bits)",
                    mb, t->ndim, in->ndim, t->ndim ? (long long)t->shape[t->ndim - 1] : 0LL,
                    in->ndim ? (long long)in->shape[in->ndim - 1] : 0LL, t->dtype.bits,
                    in->dtype.bits);
    return EPIPE_OK;
}

static int check_sent_shape(epipe_stage *st, int dir, const DLTensor *t, unsigned mb)
{
    struct sent_shape *s = &st->sent[dir];
    const char *what = dir == DIR_ACT ? "activation" : "gradient";
    int rc;
    if (dir == DIR_GRAD && (rc = check_grad_like_input(st, t, mb)))
        return rc;
    if (st->batch && (t->ndim < 1 || t->shape[0] != st->batch / st->m))
        return fail(st, EPIPE_EINVAL,
                    "the %s of micro-batch %u has %lld rows; batch %lld over %u micro-batches "
                    "gives %lld",
                    what, mb, t->ndim ? (long long)t->shape[0] : 0LL, (long long)st->batch, st->m,
                    (long long)(st->batch / st->m));
    if (!s->set) {
        s->set = 1;
        s->dtype = t->dtype;
        s->ndim = t->ndim;
        memcpy(s->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
        return EPIPE_OK;
    }
    int same = s->ndim == t->ndim && s->dtype.code == t->dtype.code &&
               s->dtype.bits == t->dtype.bits &&
               memcmp(s->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) == 0;
    if (!same)
        return fail(st, EPIPE_EINVAL,
                    "the %s of micro-batch %u differs in shape or dtype from the first one of "
                    "this step (ndim %d vs %d, dim0 %lld vs %lld)",
                    what, mb, t->ndim, s->ndim, t->ndim ? (long long)t->shape[0] : 0LL,
                    s->ndim ? (long long)s->shape[0] : 0LL);
    return EPIPE_OK;
}

static int send_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor *t)
{
    int rc = expect(st, mb, 0, dir);
    if (rc)
        return rc;
    uint64_t n;
    enum epipe_dtype dt;
    if ((rc = epipe_tensor_inspect(t, dir == DIR_ACT ? "activation" : "gradient", NULL, &n, &dt)))
        return fail(st, rc, "%s", epipe_last_error());
    if ((rc = check_sent_shape(st, dir, t, mb)))
        return rc;
    /* Raw bytes count the host's tensor: with a trainable codec the code
     * gradient that crosses is smaller, and that saving is the codec's. */
    size_t raw = (size_t)n * epipe_dtype_size(dt);
    double tb = now();
    if (dir == DIR_GRAD && trains(st, st->dec_act)) {
        /* The host's gradient is the restored activation's: back-propagate
         * it through the restore and send the (smaller) code gradient. */
        int zn;
        int64_t zs[EPIPE_CODEC_MAX_NDIM];
        DLDataType f32 = {kDLFloat, 32, 1};
        if ((rc = epipe_codec_code_shape(st->dec_act, &st->act_in[mb].t, &zn, zs)))
            return fail(st, rc, "the code of micro-batch %u: %s", mb,
                        epipe_codec_last_error(st->dec_act));
        if ((rc = lend_shape(st, &st->code_out, zn, zs, f32)))
            return rc;
        if ((rc = epipe_codec_decode_backward_checked(st->dec_act, mb, t, n, dt, &st->code_out.t)))
            return fail(st, rc, "back-propagating the gradient of micro-batch %u through the "
                        "restore: %s",
                        mb, epipe_codec_last_error(st->dec_act));
        double tb1 = now();
        st->st.encode_seconds += tb1 - tb; /* the restore's backward counts as encoding */
        if (st->tracing)
            epipe_trace_span(st->trace, "restore-backward", "encode", tb, tb1);
        t = &st->code_out.t;
        dt = EPIPE_DTYPE_F32;
        n = 1;
        for (int d = 0; d < zn; d++)
            n *= (uint64_t)zs[d];
    }
    epipe_codec *codec = dir == DIR_ACT ? st->enc_act : st->enc_grad;
    /* Trainable codecs keep their input for the backward, and poweriter
     * its warm start, per micro-batch: one handle encodes them all in turn. */
    epipe_codec_set_param(codec, EPIPE_CODEC_MICROBATCH, st->training ? (int64_t)mb : -1);
    unsigned peer = dir == DIR_ACT ? st->s + 1 : st->s - 1;
    size_t cap, len;
    /* t was checked above: the codec checks it no more (codec_internal.h). */
    if ((rc = epipe_codec_size_checked(codec, t, n, &cap)))
        return fail(st, rc, "%s", epipe_codec_last_error(codec));
    epipe_msg *msg = epipe_comm_msg_new(st->comm, cap);
    if (!msg)
        return fail(st, EPIPE_ENOMEM, "no memory for a %zu-byte message", cap);
    double t0 = now();
    rc = epipe_codec_encode_checked(codec, t, n, dt, epipe_msg_payload(msg), cap, &len);
    double t1 = now();
    st->st.encode_seconds += t1 - t0;
    if (st->tracing)
        epipe_trace_span(st->trace, "encode", "encode", t0, t1);
    if (rc) {
        epipe_msg_free(msg);
        return fail(st, rc, "encoding the %s of micro-batch %u: %s",
                    dir == DIR_ACT ? "activation" : "gradient", mb, epipe_codec_last_error(codec));
    }
    epipe_payload_header ph;
    epipe_payload_get(epipe_msg_payload(msg), len, &ph); /* the codec just wrote it */
    epipe_wire_header *h = &msg->hdr;
    memset(h, 0, sizeof *h);
    h->kind = dir == DIR_ACT ? EPIPE_WIRE_ACTIVATION : EPIPE_WIRE_GRADIENT;
    h->dtype = (uint8_t)dt;
    h->ndim = (uint8_t)t->ndim;
    for (int d = 0; d < t->ndim; d++)
        h->shape[d] = (uint64_t)t->shape[d];
    h->codec_id = ph.codec_id;
    h->codec_param = ph.param_word;
    h->micro_batch = mb;
    h->step = st->step;
    h->src_stage = st->s;
    h->dst_stage = peer;
    if ((rc = epipe_msg_seal(msg, len))) {
        epipe_msg_free(msg);
        return fail(st, rc, "framing: %s", epipe_last_error());
    }
    uint64_t wire = msg->len;
    if ((rc = epipe_comm_send(st->comm, peer, msg)))
        return fail(st, rc, "%s", epipe_comm_last_error(st->comm));
    if (dir == DIR_ACT)
        st->st.act_sent_raw += raw, st->st.act_sent_wire += wire;
    else
        st->st.grad_sent_raw += raw, st->st.grad_sent_wire += wire;
    st->did_send = 1;
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_recv_activation(epipe_stage *st, unsigned mb, const DLTensor **input)
{
    if (!st || !input)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_recv_activation: stage or input is NULL");
    enter(st);
    return leave(st, recv_tensor(st, mb, DIR_ACT, input));
}

EPIPE_API int epipe_stage_recv_gradient(epipe_stage *st, unsigned mb, const DLTensor **grad)
{
    if (!st || !grad)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_recv_gradient: stage or grad is NULL");
    enter(st);
    return leave(st, recv_tensor(st, mb, DIR_GRAD, grad));
}

EPIPE_API int epipe_stage_send_activation(epipe_stage *st, unsigned mb, const DLTensor *output)
{
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_send_activation: stage is NULL");
    enter(st);
    return leave(st, send_tensor(st, mb, DIR_ACT, output));
}

EPIPE_API int epipe_stage_send_gradient(epipe_stage *st, unsigned mb, const DLTensor *grad)
{
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_send_gradient: stage is NULL");
    enter(st);
    return leave(st, send_tensor(st, mb, DIR_GRAD, grad));
}

/* ---- the callback driver ------------------------------------------------ */

EPIPE_API int epipe_stage_set_callbacks(epipe_stage *st, const epipe_stage_callbacks *cb)
{
    epipe_clear_error();
    if (!st || !cb)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_set_callbacks: stage or cb is NULL");
    if (cb->struct_size == 0 || cb->struct_size > sizeof st->cb)
        return fail(st, EPIPE_EINVAL,
                    "callbacks struct_size %zu: this library knows sizes up to %zu (use "
                    "EPIPE_STAGE_CALLBACKS_INIT)",
                    cb->struct_size, sizeof st->cb);
    epipe_stage_callbacks c = EPIPE_STAGE_CALLBACKS_INIT;
    memcpy(&c, cb, cb->struct_size);
    if (!c.forward || !c.backward)
        return fail(st, EPIPE_EINVAL, "the forward and backward callbacks are required");
    st->cb = c;
    st->has_cb = 1;
    return EPIPE_OK;
}

static int callback_failed(epipe_stage *st, const char *which, unsigned mb, int value)
{
    epipe_comm_abort(st->comm); /* the peers must not wait for what will not come */
    return fail(st, EPIPE_ECALLBACK, "the %s callback of micro-batch %u returned %d", which, mb,
                value);
}

static int run_op(epipe_stage *st, const epipe_op *op)
{
    unsigned mb = op->microbatch;
    const DLTensor *in = NULL, *out = NULL;
    int rc;
    if (op->kind == EPIPE_OP_FORWARD) {
        if (st->need_recv && (rc = recv_tensor(st, mb, DIR_ACT, &in)))
            return rc;
        st->mark = now();
        if ((rc = st->cb.forward(st->cb.user, mb, in, &out)))
            return callback_failed(st, "forward", mb, rc);
        if (st->s + 1 == st->p && st->cb.loss) {
            double v;
            if ((rc = st->cb.loss(st->cb.user, mb, &v)))
                return callback_failed(st, "loss", mb, rc);
            st->st.loss_sum += v;
            st->st.loss_count++;
        }
        enter(st);
        if (st->need_send && (rc = send_tensor(st, mb, DIR_ACT, out)))
            return rc;
    } else {
        if (st->need_recv && (rc = recv_tensor(st, mb, DIR_GRAD, &in)))
            return rc;
        st->mark = now();
        if ((rc = st->cb.backward(st->cb.user, mb, in, &out)))
            return callback_failed(st, "backward", mb, rc);
        enter(st);
        if (st->need_send && (rc = send_tensor(st, mb, DIR_GRAD, out)))
            return rc;
    }
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_step(epipe_stage *st)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_step: stage is NULL");
    if (!st->has_cb)
        return fail(st, EPIPE_ESTATE, "epipe_stage_step needs callbacks (epipe_stage_set_callbacks)");
    if (st->in_step)
        return fail(st, EPIPE_ESTATE, "epipe_stage_step called in the middle of an op-stream step");
    epipe_op op;
    for (;;) {
        int rc = next_op(st, &op);
        if (rc == EPIPE_OK && op.kind == EPIPE_OP_NONE)
            return EPIPE_OK;
        if (rc == EPIPE_OK)
            rc = run_op(st, &op);
        if (rc) {
            st->in_step = st->cur_valid = 0; /* the step is lost; the next one starts afresh */
            return rc;
        }
    }
}

/* ---- statistics --------------------------------------------------------- */

EPIPE_API int epipe_stage_get_stats(const epipe_stage *st, epipe_stage_stats *out)
{
    epipe_clear_error();
    if (!st || !out)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_get_stats: stage or stats is NULL");
    size_t n = out->struct_size;
    if (n < sizeof(size_t))
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_stage_get_stats: set stats->struct_size = sizeof(epipe_stage_stats)");
    if (n > sizeof st->st)
        n = sizeof st->st;
    memcpy((char *)out + sizeof(size_t), (const char *)&st->st + sizeof(size_t), n - sizeof(size_t));
    return EPIPE_OK;
}

EPIPE_API void epipe_stage_reset_stats(epipe_stage *st)
{
    if (!st)
        return;
    memset(&st->st, 0, sizeof st->st);
    st->st.struct_size = sizeof st->st;
}
