/* The stage's op stream: next_op walks the step's op list, and the send and
 * receive calls check each against it, encode or decode, and move messages. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../codec/codec_internal.h"
#include "../codec/payload.h"
#include "../tensor.h"
#include "stage_impl.h"

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
        epipe_trace_args(st->trace, st->step, st->cur.microbatch, -1, 0, NULL);
    }
    st->cur_valid = 0;
    return EPIPE_OK;
}

int epipe_stage_advance(epipe_stage *st, epipe_op *op)
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
    return leave(st, epipe_stage_advance(st, op));
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

int epipe_stage_recv_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor **t)
{
    int rc = expect(st, mb, 1, dir);
    if (rc)
        return rc;
    unsigned peer = dir == DIR_ACT ? st->s - 1 : st->s + 1;
    epipe_msg *msg;
    double t0 = now();
    rc = epipe_comm_recv(st->comm, peer,
                         dir == DIR_ACT ? EPIPE_WIRE_ACTIVATION : EPIPE_WIRE_GRADIENT, st->step, mb,
                         stage_timeout_ms(st), &msg);
    double t1 = now();
    st->st.wait_seconds += t1 - t0;
    if (st->tracing)
        epipe_trace_span(st->trace, dir == DIR_ACT ? "wait-act" : "wait-grad", "wait", t0, t1);
    if (rc)
        return fail(st, rc, "%s", epipe_comm_last_error(st->comm));
    /* A gradient for a trainable activation codec is the code's: decode it
     * aside, then back-propagate it through the compress into grad_in. */
    int code_grad = dir == DIR_GRAD && trains(st, st->enc_act);
    struct lent_tensor *lt = dir == DIR_ACT ? &st->act_in[mb]
                             : code_grad    ? &st->code_in
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
    epipe_trace_args(st->trace, st->step, mb, dir, wire, epipe_codec_spec(codec));
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
            return fail(st, EPIPE_EINTERNAL,
                        "a code gradient arrived before any activation "
                        "was sent this step");
        if ((rc = lend_shape(st, &st->grad_in, ss->ndim, ss->shape, ss->dtype)))
            return rc;
        rc = epipe_codec_encode_backward(st->enc_act, mb, &lt->t, &st->grad_in.t);
        double t3 = now();
        st->st.decode_seconds += t3 - t2;
        if (st->tracing)
            epipe_trace_span(st->trace, "compress-backward", "decode", t2, t3);
        if (rc)
            return fail(st, rc,
                        "back-propagating the code gradient of micro-batch %u through "
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

int epipe_stage_send_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor *t)
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
            return fail(st, rc,
                        "back-propagating the gradient of micro-batch %u through the "
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
    epipe_trace_args(st->trace, st->step, mb, dir, wire, epipe_codec_spec(codec));
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
    return leave(st, epipe_stage_recv_tensor(st, mb, DIR_ACT, input));
}

EPIPE_API int epipe_stage_recv_gradient(epipe_stage *st, unsigned mb, const DLTensor **grad)
{
    if (!st || !grad)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_recv_gradient: stage or grad is NULL");
    enter(st);
    return leave(st, epipe_stage_recv_tensor(st, mb, DIR_GRAD, grad));
}

EPIPE_API int epipe_stage_send_activation(epipe_stage *st, unsigned mb, const DLTensor *output)
{
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_send_activation: stage is NULL");
    enter(st);
    return leave(st, epipe_stage_send_tensor(st, mb, DIR_ACT, output));
}

EPIPE_API int epipe_stage_send_gradient(epipe_stage *st, unsigned mb, const DLTensor *grad)
{
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_send_gradient: stage is NULL");
    enter(st);
    return leave(st, epipe_stage_send_tensor(st, mb, DIR_GRAD, grad));
}
