/* The stage's callback driver: epipe_stage_step runs a whole step on the op
 * stream, calling the host's forward, backward (or split backward) and loss callbacks. */
#define _POSIX_C_SOURCE 200809L
#include <string.h>

#include "../codec/cuda_core.h"
#include "stage_impl.h"

/* ---- the callback driver ------------------------------------------------ */

static int stage_set_callbacks(epipe_stage *st, const epipe_stage_callbacks *cb)
{
    epipe_clear_error();
    if (!st || !cb)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_set_callbacks: stage or cb is NULL");
    if (cb->struct_size == 0 || cb->struct_size > sizeof st->cb)
        return fail(st, EPIPE_EINVAL,
                    "callbacks struct_size %zu: this library knows sizes up to %zu (use "
                    "EPIPE_STAGE_CALLBACKS_INIT)",
                    cb->struct_size, sizeof st->cb);
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_set_callbacks");
    if (st->in_step)
        return fail(st, EPIPE_ESTATE, "callbacks can only change between steps");
    epipe_stage_callbacks c = EPIPE_STAGE_CALLBACKS_INIT;
    memcpy(&c, cb, cb->struct_size);
    const char *kind = st->kind;
    int split = c.backward_input || c.backward_weight;
    if (!c.forward)
        return fail(st, EPIPE_EINVAL, "the forward callback is required");
    if (split && (!c.backward_input || !c.backward_weight))
        return fail(st, EPIPE_EINVAL,
                    "backward_input and backward_weight come together: set both or neither");
    if (split && !st->splits)
        return fail(st, EPIPE_EINVAL,
                    "schedule '%s' does not split the backward: it never runs backward_input "
                    "or backward_weight; set backward instead (zb-h1 and zb-v split it)",
                    kind);
    if (!c.backward && !split)
        return fail(st, EPIPE_EINVAL,
                    "a backward callback is required (or, for schedule '%s', backward_input and "
                    "backward_weight)",
                    kind);
    st->cb = c;
    st->has_cb = 1;
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_set_callbacks(epipe_stage *st, const epipe_stage_callbacks *cb)
{
    int nested, rc = stage_claim(st, "epipe_stage_set_callbacks", &nested);
    return rc ? rc : stage_release(st, nested, stage_set_callbacks(st, cb));
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
    int last = !st->ch[op->chunk].has_down;
    if (op->kind == EPIPE_OP_BACKWARD_WEIGHT) {
        /* a host without split callbacks ran the whole backward at the
         * input-gradient op: nothing is left */
        st->mark = now();
        st->in_callback = "backward_weight";
        rc = st->cb.backward_weight ? st->cb.backward_weight(st->cb.user, mb) : 0;
        st->in_callback = NULL;
        if (rc)
            return callback_failed(st, "backward_weight", mb, rc);
        enter(st);
        return EPIPE_OK;
    }
    if (op->kind == EPIPE_OP_FORWARD) {
        if (st->need_recv && (rc = epipe_stage_recv_tensor(st, mb, DIR_ACT, &in)))
            return rc;
        st->mark = now();
        st->in_callback = "forward";
        rc = st->cb.forward(st->cb.user, mb, in, &out);
        st->in_callback = NULL;
        if (rc)
            return callback_failed(st, "forward", mb, rc);
        if (last && st->cb.loss) {
            double v;
            st->in_callback = "loss";
            rc = st->cb.loss(st->cb.user, mb, &v);
            st->in_callback = NULL;
            if (rc)
                return callback_failed(st, "loss", mb, rc);
            st->st.loss_sum += v;
            st->st.loss_count++;
        }
        enter(st);
        if (st->need_send && (rc = epipe_stage_send_tensor(st, mb, DIR_ACT, out)))
            return rc;
    } else {
        if (st->need_recv && (rc = epipe_stage_recv_tensor(st, mb, DIR_GRAD, &in)))
            return rc;
        st->mark = now();
        int input_only = op->kind == EPIPE_OP_BACKWARD_INPUT && st->cb.backward_input;
        st->in_callback = input_only ? "backward_input" : "backward";
        rc = input_only ? st->cb.backward_input(st->cb.user, mb, in, &out)
                        : st->cb.backward(st->cb.user, mb, in, &out);
        st->in_callback = NULL;
        if (rc)
            return callback_failed(st, input_only ? "backward_input" : "backward", mb, rc);
        enter(st);
        if (st->need_send && (rc = epipe_stage_send_tensor(st, mb, DIR_GRAD, out)))
            return rc;
    }
    return EPIPE_OK;
}

static int stage_step(epipe_stage *st)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_step: stage is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_step");
    if (!st->has_cb)
        return fail(st, EPIPE_ESTATE,
                    "epipe_stage_step needs callbacks (epipe_stage_set_callbacks)");
    if (st->in_step)
        return fail(st, EPIPE_ESTATE, "epipe_stage_step called in the middle of an op-stream step");
    epipe_op op;
    for (;;) {
        int rc = epipe_stage_advance(st, &op);
        if (rc == EPIPE_OK && op.kind == EPIPE_OP_NONE)
            return EPIPE_OK;
        if (rc == EPIPE_OK)
            rc = run_op(st, &op);
        if (rc) {
            /* the step is lost, and any micro-batches in flight: the next
             * step starts afresh. A receive the host's interrupt check
             * stopped (Ctrl-C) ends the run as a failing callback does: the
             * peers must not wait for what will not come. */
            if (rc == EPIPE_ECALLBACK)
                epipe_comm_abort(st->comm);
            /* what stream-ordered calls left queued, waited for and
             * given back now, not reported by the next step (it failed) */
            epipe_stage_settle(st, 0);
            epipe_cuda_dev_free(st->taint_device, st->taint); /* nor its verdicts passed on */
            st->taint = NULL;
            st->in_step = st->cur_valid = 0;
            st->flowing = st->draining = 0;
            return rc;
        }
    }
}

EPIPE_API int epipe_stage_step(epipe_stage *st)
{
    int nested, rc = stage_claim(st, "epipe_stage_step", &nested);
    return rc ? rc : stage_release(st, nested, stage_step(st));
}

static int stage_drain(epipe_stage *st)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_drain: stage is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_drain");
    if (st->in_step)
        return fail(st, EPIPE_ESTATE, "epipe_stage_drain called in the middle of a step");
    if (!st->flowing)
        return EPIPE_OK; /* a schedule that flushes, or nothing in flight */
    st->draining = 1;
    return st->has_cb ? epipe_stage_step(st) : EPIPE_OK;
}

EPIPE_API int epipe_stage_drain(epipe_stage *st)
{
    int nested, rc = stage_claim(st, "epipe_stage_drain", &nested);
    return rc ? rc : stage_release(st, nested, stage_drain(st));
}
