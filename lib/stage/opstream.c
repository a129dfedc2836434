/* The stage's op stream: next_op walks the step's op list, and the send and
 * receive calls check each against it, encode or decode, and move messages. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../codec/codec_internal.h"
#include "../codec/cuda_core.h"
#include "../codec/payload.h"
#include "../tensor.h"
#include "stage_impl.h"

/* ---- the op stream ------------------------------------------------------ */

static const char *carried(const epipe_op *op)
{
    return op->kind == EPIPE_OP_FORWARD ? "activation" : "gradient";
}

static int finish_current_op(epipe_stage *st)
{
    char what[96];
    if (!st->cur_valid)
        return EPIPE_OK;
    if (st->need_recv && !st->did_recv)
        return fail(st, EPIPE_ESTATE, "the %s ended without receiving its %s",
                    op_text(st, &st->cur, what, sizeof what), carried(&st->cur));
    if (st->need_send && !st->did_send)
        return fail(st, EPIPE_ESTATE, "the %s ended without sending its %s",
                    op_text(st, &st->cur, what, sizeof what), carried(&st->cur));
    if (st->tracing) {
        char name[24];
        uint32_t k = st->cur.kind;
        char letter = k == EPIPE_OP_FORWARD          ? 'F'
                      : k == EPIPE_OP_BACKWARD       ? 'B'
                      : k == EPIPE_OP_BACKWARD_INPUT ? 'I'
                                                     : 'W';
        if (st->nch > 1)
            snprintf(name, sizeof name, "%c%u.%u", letter, st->cur.microbatch, st->cur.chunk);
        else
            snprintf(name, sizeof name, "%c%u", letter, st->cur.microbatch);
        epipe_trace_span(st->trace, name, "compute", st->op_t0, now());
        epipe_trace_args(st->trace, st->step, st->cur.microbatch, -1, 0, NULL);
    }
    st->cur_valid = 0;
    return EPIPE_OK;
}

/* Picks the step's list: forward-only, the drain, a later step of a
 * schedule without a flush, or the first (every step of the others). */
static int start_step(epipe_stage *st)
{
    if (!st->training && st->flowing)
        return fail(st, EPIPE_ESTATE,
                    "a forward-only step while micro-batches of schedule '%s' are in flight: "
                    "call epipe_stage_drain() first",
                    st->kind);
    st->in_step = st->started = 1;
    st->pc = 0;
    st->running_drain = st->training && st->draining;
    st->draining = 0;
    if (!st->training)
        st->ops = st->eval_ops, st->nops = st->neval_ops;
    else if (st->running_drain)
        st->ops = st->drain_ops, st->nops = st->ndrain_ops;
    else if (st->flowing)
        st->ops = st->steady_ops, st->nops = st->nsteady_ops;
    else
        st->ops = st->train_ops, st->nops = st->ntrain_ops;
    st->step_t0 = st->mark = now();
    if (st->flowing) /* the last step's micro-batches still need their state */
        return EPIPE_OK;
    for (unsigned k = 0; k < st->nch; k++) {
        struct chunk *c = &st->ch[k];
        memset(c->act_out, 0, sizeof *c->act_out * st->m);
        memset(c->act_ready, 0, st->m);
        if (c->grad_ready)
            memset(c->grad_ready, 0, st->m);
    }
    return EPIPE_OK;
}

/* The end of a step's list: a schedule without a flush now has
 * micro-batches in flight, or none after its drain; with per-step updates
 * the host updates every chunk now. */
static void end_step(epipe_stage *st)
{
    if (!st->weights || !st->training)
        return;
    st->flowing = !st->running_drain;
    if (st->weights == EPIPE_WEIGHTS_DOUBLE)
        for (unsigned k = 0; k < st->nch; k++)
            st->ch[k].updates++;
}

static int advance(epipe_stage *st, epipe_op *op);

/* Every op boundary: the statistics other threads see catch up. */
int epipe_stage_advance(epipe_stage *st, epipe_op *op)
{
    int rc = advance(st, op);
    epipe_stage_stats_publish(st);
    return rc;
}

static int advance(epipe_stage *st, epipe_op *op)
{
    if (st->settle_rc) /* stream-ordered CUDA work failed: the stage stays failed */
        return fail(st, st->settle_rc, "%s", st->settle_why);
    /* A backward or weight-gradient backward (or, forward-only, a forward)
     * that ends now gives its received activation back to the stage; an
     * input-gradient backward keeps it for its weight-gradient backward. */
    uint32_t k = st->cur.kind;
    int releases = st->cur_valid &&
                   (k == EPIPE_OP_BACKWARD || k == EPIPE_OP_BACKWARD_WEIGHT || !st->training);
    epipe_op ended = st->cur;
    int rc = finish_current_op(st);
    if (rc)
        return rc;
    if (releases)
        st->ch[ended.chunk].act_in[ended.microbatch].t.data = NULL;
    /* 1f1b-async: the host updated the chunk's weights after the backward */
    if (ended.kind == EPIPE_OP_BACKWARD && releases && st->weights == EPIPE_WEIGHTS_STASHED)
        st->ch[ended.chunk].updates++;
    if (!st->in_step && (rc = start_step(st)))
        return rc;
    while (st->pc < st->nops && !is_compute_kind(st->ops[st->pc].kind))
        st->pc++;
    if (st->pc == st->nops) {
        /* A failure of the step's CUDA work still ends the step, so that
         * the knobs that change between steps can, and stays the stage's
         * (every later call returns it). */
        int settled = epipe_stage_settle(st, 1);
        end_step(st);
        st->in_step = 0;
        st->st.steps++;
        double took = now() - st->step_t0;
        st->st.step_seconds += took;
        epipe_stage_stats_step_end(st, took, !st->running_drain);
        st->step++;
        memset(op, 0, sizeof *op);
        op->kind = EPIPE_OP_NONE;
        return settled;
    }
    st->cur = st->ops[st->pc++];
    if (st->cur.chunk >= st->nch || st->cur.microbatch >= st->m)
        return fail(st, EPIPE_EINTERNAL, "op %zu names chunk %u, micro-batch %u (of %u, %u)",
                    st->pc - 1, st->cur.chunk, st->cur.microbatch, st->nch, st->m);
    st->cur_valid = 1;
    struct chunk *c = &st->ch[st->cur.chunk];
    k = st->cur.kind;
    if (k == EPIPE_OP_FORWARD) {
        c->fstep[st->cur.microbatch] = st->step;
        c->fversion[st->cur.microbatch] = c->updates;
    }
    /* Schedules without a flush: the absolute version, for the host's
     * weight stashing (a backward uses its forward's). */
    if (st->weights)
        st->cur.weight_version = (uint32_t)c->fversion[st->cur.microbatch];
    st->need_recv = k == EPIPE_OP_FORWARD ? c->has_up : is_backward_kind(k) ? c->has_down : 0;
    st->need_send = k == EPIPE_OP_FORWARD ? c->has_down : is_backward_kind(k) ? c->has_up : 0;
    st->did_recv = st->did_send = 0;
    st->op_t0 = now();
    *op = st->cur;
    return EPIPE_OK;
}

static int stage_next_op(epipe_stage *st, epipe_op *op)
{
    if (!st || !op)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_next_op: stage or op is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_next_op");
    enter(st);
    return leave(st, epipe_stage_advance(st, op));
}

EPIPE_API int epipe_stage_next_op(epipe_stage *st, epipe_op *op)
{
    int nested, rc = stage_claim(st, "epipe_stage_next_op", &nested);
    return rc ? rc : stage_release(st, nested, stage_next_op(st, op));
}

EPIPE_API int epipe_stage_current_op(const epipe_stage *st, epipe_op *op)
{
    if (!st || !op)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_current_op: stage or op is NULL");
    if (!st->cur_valid) {
        memset(op, 0, sizeof *op);
        return epipe_fail(EPIPE_ESTATE, "stage %u: epipe_stage_current_op: no op is in progress",
                          st->s);
    }
    *op = st->cur;
    return EPIPE_OK;
}

/* Checks that a receive or send for `mb` in direction `dir` is what the
 * current op expects. */
static int expect(epipe_stage *st, unsigned mb, int is_recv, int dir)
{
    static const char *const names[2][2] = {{"send_activation", "send_gradient"},
                                            {"recv_activation", "recv_gradient"}};
    const char *call = names[is_recv][dir];
    char what[96];
    if (!st->cur_valid)
        return fail(st, EPIPE_ESTATE, "%s(%u) called with no op in progress: call next_op first",
                    call, mb);
        /* the op's text is formatted only for an error: this runs for every send and receive */
#define WHAT op_text(st, &st->cur, what, sizeof what)
    int kind_ok = dir == DIR_ACT ? st->cur.kind == EPIPE_OP_FORWARD
                                 : is_backward_kind(st->cur.kind);
    if (!kind_ok || st->cur.microbatch != mb)
        return fail(st, EPIPE_ESTATE, "%s(%u) called during the %s%s", call, mb, WHAT,
                    st->cur.kind == EPIPE_OP_BACKWARD_WEIGHT
                        ? " (which neither receives nor sends: the gradient went upstream "
                          "when the input-gradient backward ended)"
                        : "");
    if (is_recv ? !st->need_recv : !st->need_send)
        return fail(st, EPIPE_ESTATE, "%s(%u): the %s of pipeline stage %u of %u has nothing to %s",
                    call, mb, WHAT, st->ch[st->cur.chunk].g, st->P, is_recv ? "receive" : "send");
    if (is_recv ? st->did_recv : st->did_send)
        return fail(st, EPIPE_ESTATE, "%s(%u) called twice in the %s", call, mb, WHAT);
    if (is_recv && st->need_send && st->did_send)
        return fail(st, EPIPE_ESTATE, "%s(%u) called after the %s already sent", call, mb, WHAT);
#undef WHAT
    return EPIPE_OK;
}

const char *epipe_stage_shape_text(int ndim, const int64_t *shape, DLDataType dtype, char *buf,
                                   size_t cap)
{
    size_t n = 0;
    n += (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? "," : "", (long long)shape[d]);
    if (n < cap)
        snprintf(buf + n, cap - n, "] %s%u",
                 dtype.code == kDLBfloat  ? "bf"
                 : dtype.code == kDLFloat ? "f"
                                          : "code",
                 dtype.bits);
    return buf;
}

/* lt's memory, freed, made again: `bytes` of device memory of CUDA device
 * `device` (its contents not kept); why[cap] says what failed. */
static int lent_on_device(struct lent_tensor *lt, int device, size_t bytes, char *why, size_t cap)
{
    void *p = NULL;
    epipe_stage_lent_free(lt);
    int rc = epipe_cuda_dev_alloc(device, bytes, &p, why, cap);
    if (!rc)
        lt->buf = p, lt->cap = bytes, lt->on_cuda = 1, lt->device = device;
    return rc;
}

/* Points lt at a dense CPU tensor of the given shape and dtype, growing its
 * buffer as needed. */
int epipe_stage_lend_shape(epipe_stage *st, struct lent_tensor *lt, int ndim, const int64_t *shape,
                           DLDataType dtype)
{
    size_t esz = (size_t)(dtype.bits / 8), n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || (shape[d] && n > SIZE_MAX / esz / (size_t)shape[d]))
            return fail(st, EPIPE_EOVERFLOW, "a %d-dimensional tensor is too large to hold", ndim);
        n *= (size_t)shape[d];
    }
    int cuda = st->cuda_device >= 0;
    if (lt->buf && (lt->on_cuda != cuda || (cuda && lt->device != st->cuda_device)))
        epipe_stage_lent_free(lt);                 /* EPIPE_STAGE_CUDA_DEVICE moved it */
    if (cuda && (lt->cap < n * esz || !lt->buf)) { /* a first empty tensor too */
        /* cudaMalloc does not keep contents; the decode writes them all */
        char why[1400];
        int rc = lent_on_device(lt, st->cuda_device, n * esz, why, sizeof why);
        if (rc)
            return fail(st, rc, "a %zu-byte tensor on CUDA device %d: %s", n * esz, st->cuda_device,
                        why);
    } else if (lt->cap < n * esz) {
        void *p = realloc(lt->buf, n * esz > 0 ? n * esz : 1);
        if (!p)
            return fail(st, EPIPE_ENOMEM, "no memory for a %zu-byte tensor", n * esz);
        lt->buf = p, lt->cap = n * esz;
    }
    memset(&lt->t, 0, sizeof lt->t);
    lt->t.data = lt->buf;
    lt->t.device.device_type = lt->on_cuda ? kDLCUDA : kDLCPU;
    lt->t.device.device_id = lt->on_cuda ? lt->device : 0;
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

static int same_meta(const struct tensor_meta *a, const DLTensor *t)
{
    return a->ndim == t->ndim && a->dtype.code == t->dtype.code && a->dtype.bits == t->dtype.bits &&
           memcmp(a->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) == 0;
}

/* A message from a peer that runs another schedule: refused, naming both. */
static int check_tag(epipe_stage *st, const epipe_wire_header *h, unsigned peer)
{
    if (!h->schedule_tag || h->schedule_tag == st->tag)
        return EPIPE_OK;
    const char *theirs = epipe_stage_tag_kind(h->schedule_tag);
    const char *mine = st->kind;
    epipe_comm_abort(st->comm); /* the peers must not wait for what will not come */
    if (!strcmp(theirs, mine))
        return fail(st, EPIPE_EPROTO,
                    "rank %u runs schedule '%s' and so does this rank, but with another "
                    "micro-batch count, rank count or placement (schedule tags 0x%08x and "
                    "0x%08x): every rank must create its stage alike",
                    peer, theirs, h->schedule_tag, st->tag);
    return fail(st, EPIPE_EPROTO,
                "rank %u runs schedule '%s' but this rank runs '%s' (schedule tags 0x%08x and "
                "0x%08x): every rank must create its stage with the same schedule",
                peer, theirs, mine, h->schedule_tag, st->tag);
}

/* The wait after a codec call on CUDA tensors whose status was rc. A
 * failed call waits too: it may have queued a copy into or out of the
 * message (pinned memory, see cuda_messages() in stage.c), whose buffer
 * must not go back to the cache, and to another message, while the copy
 * runs. The failed call's message stays the codec's last error. */
static int settle(epipe_codec *codec, int rc)
{
    if (rc == EPIPE_OK)
        return epipe_codec_synchronize(codec);
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", epipe_codec_last_error(codec));
    (void)epipe_codec_synchronize(codec);
    return epipe_codec_fail(codec, rc, "%s", why);
}

/* A held message whose decode is done, freed; the verdict its fence
 * carries into *v unless one received earlier is there already. A failed
 * verdict is the step's, reported where it ends (epipe_stage_settle()):
 * its text goes into *v, not into the call that gave the message back. */
static void give_back(struct held_msg *h, struct held_verdict *v)
{
    epipe_msg *m = h->msg;
    epipe_errors_kept kept;
    epipe_errors_keep(&kept, h->by->msg);
    int rc = m->fence && (!v->rc || h->seq < v->seq)
                 ? epipe_codec_cuda_fence_status(h->by, m->fence)
                 : EPIPE_OK;
    if (rc) {
        v->rc = rc;
        v->seq = h->seq;
        snprintf(v->why, sizeof v->why, "the %s of micro-batch %u from rank %u: %s",
                 m->hdr.kind == EPIPE_WIRE_ACTIVATION ? "activation" : "gradient",
                 m->hdr.micro_batch, m->hdr.src_stage, epipe_codec_last_error(h->by));
        epipe_errors_restore(&kept);
    }
    epipe_msg_free(m);
    h->msg = NULL;
    h->marked = 0;
}

/* Gives back, without waiting, the held messages whose decodes are done
 * (their marks passed), so that their senders' device buffers go back to
 * work before this stage's step ends. The rest keep their order; the
 * scan ends at the first mark not passed, as the later ones, queued after
 * it on the stage's stream, are unlikely to have. */
static void give_back_done(epipe_stage *st)
{
    unsigned kept = 0, i;
    for (i = 0; i < st->nheld; i++) {
        struct held_msg *h = &st->held[i];
        if (h->marked && !epipe_cuda_mark_passed(h->mark_device, h->mark))
            break;
        if (h->marked)
            give_back(h, &st->verdict);
        else if (kept++ != i) { /* no mark: held until the wait; slots swap */
            struct held_msg t = st->held[kept - 1];
            st->held[kept - 1] = *h;
            *h = t;
        }
    }
    for (; i < st->nheld; i++, kept++) {
        struct held_msg t = st->held[kept];
        st->held[kept] = st->held[i];
        st->held[i] = t;
    }
    st->nheld = kept;
}

void epipe_stage_free_marks(epipe_stage *st)
{
    for (unsigned i = 0; i < STAGE_HELD_MAX; i++) {
        epipe_cuda_mark_free(st->held[i].mark_device, st->held[i].mark);
        st->held[i].mark = NULL;
    }
}

int epipe_stage_settle(epipe_stage *st, int report)
{
    if (!st->unsettled && !st->nheld)
        return report && st->settle_rc ? fail(st, st->settle_rc, "%s", st->settle_why) : EPIPE_OK;
    double t0 = now();
    /* What went wrong, the likeliest cause first: this stage's own encodes
     * (a non-finite value the host sent), then a received payload's
     * verdict (its encode, or an earlier stage's, refused: the cause of
     * what its decode found), then the decodes. */
    int first = EPIPE_OK, decoded = EPIPE_OK;
    char why[EPIPE_ERRMSG_MAX] = "", dwhy[EPIPE_ERRMSG_MAX] = "";
    for (unsigned k = 0; k < st->nch; k++) {
        struct chunk *c = &st->ch[k];
        epipe_codec *all[4] = {c->enc_act, c->enc_grad, c->dec_act, c->dec_grad};
        for (int i = 0; i < 4; i++) {
            int rc = all[i] ? epipe_codec_synchronize(all[i]) : EPIPE_OK;
            int *to = i < 2 ? &first : &decoded;
            if (rc && !*to) {
                *to = rc;
                snprintf(i < 2 ? why : dwhy, sizeof why, "%s", epipe_codec_last_error(all[i]));
            }
        }
    }
    /* Their decodes are done (with those given back already, the verdict
     * of the first received) */
    struct held_verdict *v = &st->verdict;
    for (unsigned i = 0; i < st->nheld; i++)
        give_back(&st->held[i], v);
    if (!first && (v->rc || decoded)) {
        first = v->rc ? v->rc : decoded;
        memcpy(why, v->rc ? v->why : dwhy, sizeof why);
    }
    st->nheld = 0;
    v->rc = EPIPE_OK;
    st->unsettled = 0;
    double t1 = now();
    /* the GPU finishing the step's work, the host's compute mostly: not a
     * wait for a neighbour (bubble_fraction) */
    st->st.compute_seconds += t1 - t0;
    if (st->tracing) {
        epipe_trace_span(st->trace, "settle", "settle", t0, t1);
        epipe_trace_args(st->trace, st->step, 0, -1, 0, NULL);
    }
    if (!report)
        return EPIPE_OK;
    if (st->settle_rc) /* the first failure stays the stage's */
        return fail(st, st->settle_rc, "%s", st->settle_why);
    if (!first)
        return EPIPE_OK;
    epipe_comm_abort(st->comm); /* a peer may have decoded what a failed encode wrote */
    st->settle_rc = first;
    snprintf(st->settle_why, sizeof st->settle_why,
             "stream-ordered CUDA work failed (communicator aborted): %s", why);
    return fail(st, first, "%s", st->settle_why);
}

/* Whether the stage's taint (what its fences were told) can go with a
 * payload on CUDA device `device`: it lives on the device of the first
 * payload it gathered, and is none before that. */
static int taint_serves(const epipe_stage *st, int device)
{
    return !st->taint || st->taint_device == device;
}

/* A stream-ordered send of a device payload: a fence after its encode
 * rides with the message in place of a wait; the receiver's stream waits
 * for it. Where there is no memory for one, the wait; a CUDA error making
 * it is the send's (after the wait, as any failed call's). */
static int fence_payload(epipe_stage *st, epipe_codec *codec, epipe_msg *msg)
{
    /* What the stage was passed goes on with the fence, from its device;
     * a payload on another (or sent without a fence) goes once the stage
     * has waited, and found nothing passed to it. */
    int rc, passes = taint_serves(st, msg->dev_device);
    if (!passes && (rc = epipe_stage_settle_first(st)))
        return rc;
    epipe_errors_kept kept; /* a fence's lack of memory is no call's failure */
    epipe_errors_keep(&kept, codec->msg);
    rc = epipe_codec_cuda_fence(codec, msg->dev_device, passes ? st->taint : NULL, &msg->fence);
    if (rc == EPIPE_ENOMEM) {
        epipe_errors_restore(&kept);
        return (rc = epipe_stage_settle_first(st)) ? rc : epipe_codec_synchronize(codec);
    }
    if (rc)
        return settle(codec, rc);
    msg->fence_free = epipe_cuda_fence_free;
    st->unsettled = 1;
    return EPIPE_OK;
}

/* A message a stream-ordered decode on CUDA device `device` may still
 * read, kept until that decode is done (a mark after it, on its stream)
 * or the stage waits for its work; when STAGE_HELD_MAX are held and none
 * is done, that wait comes first. A mark that cannot be made costs only
 * the early give-back of this message. */
static int hold_message(epipe_stage *st, epipe_msg *msg, epipe_codec *codec, int device)
{
    give_back_done(st);
    int rc = st->nheld == STAGE_HELD_MAX ? epipe_stage_settle(st, 1) : EPIPE_OK;
    if (rc) {
        epipe_msg_free(msg); /* the wait is done with it too */
        return rc;
    }
    struct held_msg *h = &st->held[st->nheld++];
    if (h->mark && h->mark_device != device) {
        epipe_cuda_mark_free(h->mark_device, h->mark);
        h->mark = NULL;
    }
    h->mark_device = device;
    /* a failed mark costs only the early give-back: its text is no
     * call's failure */
    epipe_errors_kept kept;
    epipe_errors_keep(&kept, codec->msg);
    h->marked = epipe_codec_cuda_mark(codec, device, &h->mark) == EPIPE_OK;
    if (!h->marked)
        epipe_errors_restore(&kept);
    h->msg = msg;
    h->by = codec;
    h->seq = ++st->held_seq;
    st->unsettled = 1;
    return EPIPE_OK;
}

/* The stage's device buffer on CUDA device `device` for a payload of len
 * bytes copied from another device (peer_in, grown as needed): 1 when
 * there is one, 0 without device memory for it (the payload then goes
 * through host memory, as a host message's would). */
static int peer_buffer(epipe_stage *st, int device, size_t len)
{
    struct lent_tensor *to = &st->peer_in;
    char why[1400];
    return (to->buf && to->device == device && to->cap >= len) ||
           lent_on_device(to, device, len ? len : 1, why, sizeof why) == EPIPE_OK;
}

/* Where the decode reads msg's payload: in its message; a device payload
 * (epipe_comm_msg_new_device) in place when the tensor goes to its
 * device; copied device to device into peer_in when the tensor goes to
 * another device; else (the stage moved to the host while the message
 * was on its way, or no device memory for peer_in) into host memory,
 * *host_copy, for the caller to free. A copy reads the payload after its
 * encode: the sender waited for it, or the caller waited for its fence.
 * The call waits for the copy. */
static int device_payload_here(epipe_stage *st, epipe_msg *msg, const struct lent_tensor *lt,
                               epipe_codec *codec, const uint8_t **payload, uint8_t **host_copy)
{
    *payload = msg->data + msg->hdr.header_len;
    *host_copy = NULL;
    if (!msg->dev)
        return EPIPE_OK;
    *payload = msg->dev;
    if (lt->on_cuda && lt->device == msg->dev_device)
        return EPIPE_OK;
    size_t len = (size_t)msg->hdr.payload_len;
    int to_device = lt->on_cuda && peer_buffer(st, lt->device, len);
    uint8_t *dst = to_device ? (uint8_t *)st->peer_in.buf : malloc(len ? len : 1);
    if (!dst)
        return fail(st, EPIPE_ENOMEM, "no memory for a %zu-byte payload", len);
    int rc = epipe_codec_cuda_payload_copy(codec, to_device ? lt->device : -1, dst, msg->dev_device,
                                           msg->dev, len);
    if (rc) {
        if (!to_device)
            free(dst);
        return fail(st, rc, "copying a payload from CUDA device %d: %s", msg->dev_device,
                    epipe_codec_last_error(codec));
    }
    *payload = dst;
    if (!to_device)
        *host_copy = dst;
    return EPIPE_OK;
}

static int recv_remote(epipe_stage *st, struct chunk *c, unsigned mb, int dir, const DLTensor **t)
{
    unsigned peer = dir == DIR_ACT ? c->up_rank : c->down_rank;
    epipe_msg *msg;
    double t0 = now();
    int rc = epipe_comm_recv(st->comm, peer,
                             dir == DIR_ACT ? EPIPE_WIRE_ACTIVATION : EPIPE_WIRE_GRADIENT,
                             msg_step(st, c, mb, dir), mb, stage_timeout_ms(st), &msg);
    double t1 = now();
    st->st.wait_seconds += t1 - t0;
    if (st->tracing)
        epipe_trace_span(st->trace, dir == DIR_ACT ? "wait-act" : "wait-grad", "wait", t0, t1);
    if (rc)
        return fail(st, rc, "%s", epipe_comm_last_error(st->comm));
    const epipe_wire_header *h = &msg->hdr;
    if ((rc = check_tag(st, h, peer))) {
        epipe_msg_free(msg);
        return rc;
    }
    /* A gradient for a trainable activation codec is the code's: decode it
     * aside, then back-propagate it through the compress into grad_in. */
    int code_grad = dir == DIR_GRAD && trains(st, c->enc_act);
    struct lent_tensor *lt = dir == DIR_ACT ? &c->act_in[mb]
                             : code_grad    ? &c->code_in
                                            : &st->grad_in;
    const struct tensor_meta *sent = &c->act_out[mb];
    uint64_t n;
    size_t esz = epipe_dtype_size((enum epipe_dtype)h->dtype);
    if (epipe_wire_numel(h, &n) || n > SIZE_MAX / esz) {
        epipe_msg_free(msg);
        return fail(st, EPIPE_EOVERFLOW, "the %s from rank %u is too large to hold",
                    epipe_wire_kind_name(h->kind), peer);
    }
    int64_t shape[EPIPE_MAX_NDIM];
    for (int d = 0; d < h->ndim; d++)
        shape[d] = (int64_t)h->shape[d];
    DLDataType dtype = {h->dtype == EPIPE_DTYPE_BF16 ? kDLBfloat : kDLFloat, (uint8_t)(esz * 8), 1};
    /* The shape comes with each message: micro-batches may differ. But a
     * gradient has the shape of the activation it is the gradient of. */
    if (dir == DIR_GRAD && !code_grad && sent->set) {
        DLTensor probe = {.ndim = h->ndim, .shape = shape, .dtype = dtype};
        if (!same_meta(sent, &probe)) {
            char a[96], b[96];
            epipe_msg_free(msg);
            return fail(st, EPIPE_EPROTO,
                        "the gradient of micro-batch %u from rank %u is %s, but the activation "
                        "sent for it was %s",
                        mb, peer, epipe_stage_shape_text(h->ndim, shape, dtype, a, sizeof a),
                        epipe_stage_shape_text(sent->ndim, sent->shape, sent->dtype, b, sizeof b));
        }
    }
    if ((rc = epipe_stage_lend_shape(st, lt, h->ndim, shape, dtype))) {
        epipe_msg_free(msg);
        return rc;
    }
    epipe_codec *codec = dir == DIR_ACT ? c->dec_act : c->dec_grad;
    if (dir == DIR_ACT && epipe_codec_trainable(codec))
        epipe_codec_set_param(codec, EPIPE_CODEC_MICROBATCH, st->training ? (int64_t)mb : -1);
    /* A device payload read from another memory is copied there first
     * (device_payload_here). Stream-ordered, the decode is held (below)
     * unless its payload is copied, or it waits for more work. */
    int copies = msg->dev && !(lt->on_cuda && lt->device == msg->dev_device);
    int holds = st->stream_ordered && lt->on_cuda && !code_grad && !c->delta_dec && !copies;
    if (!holds && (lt->on_cuda || msg->dev) && (rc = epipe_stage_settle_first(st))) {
        epipe_msg_free(msg);
        return rc;
    }
    t1 = now(); /* the decode's span starts after that wait, not around it */
    if (copies && msg->fence) {
        /* A copy waits for the encode on the host (its stream may be on
         * another device than the fence), and knows its verdict first: a
         * wait for the sender, as for its message */
        rc = epipe_codec_cuda_fence_status(codec, msg->fence);
        double tw = now();
        st->st.wait_seconds += tw - t1;
        if (st->tracing)
            epipe_trace_span(st->trace, dir == DIR_ACT ? "wait-act" : "wait-grad", "wait", t1, tw);
        t1 = tw;
    }
    const uint8_t *payload;
    if (msg->fence && !rc && !copies) {
        /* a stream-ordered receiver passes the fence's verdicts on: what
         * it sends is made of what it decodes */
        void **taint = holds && taint_serves(st, msg->dev_device) ? &st->taint : NULL;
        if (taint && !st->taint) /* where the module makes it, if it does */
            st->taint_device = msg->dev_device;
        rc = epipe_codec_cuda_fence_wait(codec, msg->dev_device, msg->fence, taint);
    }
    if (rc) { /* the fence, waited for on the host or on the device */
        (void)epipe_codec_synchronize(codec); /* before the fence goes back */
        epipe_msg_free(msg);
        return fail(st, rc, "the %s of micro-batch %u from rank %u: %s",
                    dir == DIR_ACT ? "activation" : "gradient", mb, peer,
                    epipe_codec_last_error(codec));
    }
    uint8_t *host_copy;
    if ((rc = device_payload_here(st, msg, lt, codec, &payload, &host_copy))) {
        if (msg->fence) /* its verdicts may still be on their way to the taint */
            (void)epipe_codec_synchronize(codec);
        epipe_msg_free(msg);
        return rc;
    }
    rc = epipe_codec_decode(codec, payload, (size_t)h->payload_len, &lt->t);
    free(host_copy);
    /* Stream-ordered: the tensor is ready in the stream's order, and the
     * message held until the stage waits. Otherwise usable from any
     * stream when the call returns. */
    int hold = rc == EPIPE_OK && holds;
    if (!hold && (lt->on_cuda || msg->dev))
        rc = settle(codec, rc);
    /* its sender did not wait for the encode: its verdict first (a copy's
     * was taken before it) */
    if (!hold && msg->fence && !copies) {
        int verdict = epipe_codec_cuda_fence_status(codec, msg->fence);
        rc = verdict ? verdict : rc;
    }
    double t2 = now();
    st->st.decode_seconds += t2 - t1;
    if (st->tracing)
        epipe_trace_span(st->trace, "decode", "decode", t1, t2);
    uint64_t wire = epipe_msg_wire_len(msg);
    epipe_trace_args(st->trace, msg_step(st, c, mb, dir), mb, dir, wire, epipe_codec_spec(codec));
    if (hold && (rc = hold_message(st, msg, codec, lt->device))) {
        lt->t.data = NULL;
        return rc; /* the stage's wait failed, and says so */
    }
    if (!hold)
        epipe_msg_free(msg); /* a device payload: the wait above is done with it */
    if (rc) {
        lt->t.data = NULL;
        return fail(st, rc, "decoding the %s of micro-batch %u from rank %u: %s",
                    dir == DIR_ACT ? "activation" : "gradient", mb, peer,
                    epipe_codec_last_error(codec));
    }
    if (dir == DIR_ACT && (rc = epipe_stage_samples_after_decode(st, c, codec, mb))) {
        lt->t.data = NULL;
        return rc;
    }
    uint64_t raw = n * esz;
    if (code_grad) { /* raw: the gradient of the activation sent, as the host sees it */
        raw = sent->dtype.bits / 8u;
        for (int d = 0; d < sent->ndim; d++)
            raw *= (uint64_t)sent->shape[d];
    }
    if (dir == DIR_ACT)
        st->st.act_recv_raw += raw, st->st.act_recv_wire += wire;
    else
        st->st.grad_recv_raw += raw, st->st.grad_recv_wire += wire;
    epipe_stage_stats_count(st, c, dir, 0, raw, wire);
    if (code_grad) {
        /* The gradient of the activation this chunk sent for mb. */
        if (!sent->set)
            return fail(st, EPIPE_EINTERNAL,
                        "a code gradient of micro-batch %u arrived before its activation was "
                        "sent this step",
                        mb);
        if ((rc = epipe_stage_lend_shape(st, &st->grad_in, sent->ndim, sent->shape, sent->dtype)))
            return rc;
        rc = epipe_codec_encode_backward(c->enc_act, mb, &lt->t, &st->grad_in.t);
        if (rc == EPIPE_OK && st->grad_in.on_cuda) /* a receive returns its tensor written */
            rc = epipe_codec_synchronize(c->enc_act);
        double t3 = now();
        st->st.decode_seconds += t3 - t2;
        if (st->tracing)
            epipe_trace_span(st->trace, "compress-backward", "decode", t2, t3);
        if (rc)
            return fail(st, rc,
                        "back-propagating the code gradient of micro-batch %u through "
                        "the compress: %s",
                        mb, epipe_codec_last_error(c->enc_act));
        lt = &st->grad_in;
    }
    *t = &lt->t;
    return EPIPE_OK;
}

int epipe_stage_recv_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor **t)
{
    int rc = expect(st, mb, 1, dir);
    if (rc)
        return rc;
    struct chunk *c = &st->ch[st->cur.chunk];
    int local = dir == DIR_ACT ? c->up_local : c->down_local;
    rc = local ? epipe_stage_take_local(st, c, mb, dir, t) : recv_remote(st, c, mb, dir, t);
    if (rc == EPIPE_OK)
        st->did_recv = 1;
    return rc;
}

/* A gradient sent back has the shape and dtype of the activation received
 * for that micro-batch (still lent to the host until its backward ends). */
static int check_grad_like_input(epipe_stage *st, const struct chunk *c, const DLTensor *t,
                                 unsigned mb)
{
    const DLTensor *in = &c->act_in[mb].t;
    if (!in->data)
        return EPIPE_OK;
    int same = in->ndim == t->ndim && in->dtype.code == t->dtype.code &&
               in->dtype.bits == t->dtype.bits &&
               memcmp(in->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) == 0;
    if (!same) {
        char a[96], b[96];
        return fail(st, EPIPE_EINVAL,
                    "the gradient of micro-batch %u differs in shape or dtype from the activation "
                    "received for it: %s vs %s",
                    mb, epipe_stage_shape_text(t->ndim, t->shape, t->dtype, a, sizeof a),
                    epipe_stage_shape_text(in->ndim, in->shape, in->dtype, b, sizeof b));
    }
    return EPIPE_OK;
}

/* Checks a tensor the host sends; records an activation's shape. Every
 * micro-batch may send its own shape. */
static int check_sent(epipe_stage *st, struct chunk *c, int dir, const DLTensor *t, unsigned mb)
{
    const char *what = dir == DIR_ACT ? "activation" : "gradient";
    int rc;
    if (dir == DIR_GRAD && (rc = check_grad_like_input(st, c, t, mb)))
        return rc;
    if (st->batch && (t->ndim < 1 || t->shape[0] != st->batch / st->m))
        return fail(st, EPIPE_EINVAL,
                    "the %s of micro-batch %u has %lld rows; batch %lld over %u micro-batches "
                    "gives %lld",
                    what, mb, t->ndim ? (long long)t->shape[0] : 0LL, (long long)st->batch, st->m,
                    (long long)(st->batch / st->m));
    int local = dir == DIR_ACT ? c->down_local : c->up_local;
    int on_cuda = t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged;
    if (dir == DIR_ACT && !local && trains(st, c->enc_act) &&
        (on_cuda ? t->device.device_id != st->cuda_device : st->cuda_device >= 0)) {
        char at[40], to[40];
        memory_name(at, sizeof at, on_cuda ? t->device.device_id : -1);
        memory_name(to, sizeof to, st->cuda_device);
        return fail(st, EPIPE_EINVAL,
                    "the activation of micro-batch %u is in %s, but the trainable codec '%s' "
                    "back-propagates its code gradient into the memory received tensors go to, "
                    "%s (EPIPE_STAGE_CUDA_DEVICE): send it from there, or set the knob to its "
                    "device",
                    mb, at, epipe_codec_spec(c->enc_act), to);
    }
    if (dir == DIR_ACT) {
        struct tensor_meta *s = &c->act_out[mb];
        s->set = 1;
        s->dtype = t->dtype;
        s->ndim = t->ndim;
        memcpy(s->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    }
    return EPIPE_OK;
}

static int send_remote(epipe_stage *st, struct chunk *c, unsigned mb, int dir, const DLTensor *t,
                       uint64_t n, enum epipe_dtype dt)
{
    int rc;
    /* Raw bytes count the host's tensor: with a trainable codec the code
     * gradient that crosses is smaller, and that saving is the codec's. */
    size_t raw = (size_t)n * epipe_dtype_size(dt);
    double tb = now();
    if (dir == DIR_GRAD && trains(st, c->dec_act)) {
        /* The host's gradient is the restored activation's: back-propagate
         * it through the restore and send the (smaller) code gradient. */
        if (epipe_tensor_is_cuda(t) && (rc = epipe_stage_settle_first(st)))
            return rc;
        tb = now();
        int zn;
        int64_t zs[EPIPE_CODEC_MAX_NDIM];
        DLDataType f32 = {kDLFloat, 32, 1};
        if ((rc = epipe_codec_code_shape(c->dec_act, &c->act_in[mb].t, &zn, zs)))
            return fail(st, rc, "the code of micro-batch %u: %s", mb,
                        epipe_codec_last_error(c->dec_act));
        if ((rc = epipe_stage_lend_shape(st, &c->code_out, zn, zs, f32)))
            return rc;
        if ((rc = epipe_codec_decode_backward_checked(c->dec_act, mb, t, n, dt, &c->code_out.t)))
            return fail(st, rc,
                        "back-propagating the gradient of micro-batch %u through the "
                        "restore: %s",
                        mb, epipe_codec_last_error(c->dec_act));
        double tb1 = now();
        st->st.encode_seconds += tb1 - tb; /* the restore's backward counts as encoding */
        if (st->tracing)
            epipe_trace_span(st->trace, "restore-backward", "encode", tb, tb1);
        t = &c->code_out.t;
        dt = EPIPE_DTYPE_F32;
        n = 1;
        for (int d = 0; d < zn; d++)
            n *= (uint64_t)zs[d];
    }
    epipe_codec *codec = dir == DIR_ACT ? c->enc_act : c->enc_grad;
    /* Trainable codecs keep their input for the backward, and poweriter
     * its warm start, per micro-batch: one handle encodes them all in turn. */
    epipe_codec_set_param(codec, EPIPE_CODEC_MICROBATCH, st->training ? (int64_t)mb : -1);
    unsigned peer = dir == DIR_ACT ? c->down_rank : c->up_rank;
    size_t cap, len;
    if (dir == DIR_ACT && (rc = epipe_stage_samples_before_encode(st, c, codec, mb, t)))
        return rc;
    /* t was checked above: the codec checks it no more (codec_internal.h). */
    if ((rc = epipe_codec_size_checked(codec, t, n, &cap)))
        return fail(st, rc, "%s", epipe_codec_last_error(codec));
    /* A CUDA tensor for a rank of this process that decodes on a device:
     * the payload stays in device memory (cuda_messages() in stage.c), on
     * this one; a receiver on another copies it over (device_payload_here) */
    epipe_msg *msg = NULL;
    if (epipe_tensor_is_cuda(t) && epipe_comm_peer_device(st->comm, peer) >= 0)
        msg = epipe_comm_msg_new_device(st->comm, t->device.device_id, cap);
    if (!msg && !(msg = epipe_comm_msg_new(st->comm, cap)))
        return fail(st, EPIPE_ENOMEM, "no memory for a %zu-byte message", cap);
    uint8_t *payload = msg->dev ? msg->dev : epipe_msg_payload(msg);
    int fences = epipe_tensor_is_cuda(t) && msg->dev && st->stream_ordered;
    if (epipe_tensor_is_cuda(t) && !fences && (rc = epipe_stage_settle_first(st))) {
        epipe_msg_free(msg);
        return rc;
    }
    double t0 = now();
    rc = epipe_codec_encode_checked(codec, t, n, dt, payload, cap, &len);
    if (fences && rc == EPIPE_OK)
        rc = fence_payload(st, codec, msg);
    else if (epipe_tensor_is_cuda(t)) /* the payload complete, its errors known */
        rc = settle(codec, rc);
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
    if (msg->dev) { /* what it wrote there, without reading the device */
        unsigned id;
        epipe_codec_payload_ident(codec, &id, &ph.param_word);
        ph.codec_id = (uint8_t)id;
    } else {
        epipe_payload_get(payload, len, &ph); /* the codec just wrote it */
    }
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
    h->step = msg_step(st, c, mb, dir);
    h->src_stage = st->s;
    h->dst_stage = peer;
    h->schedule_tag = st->tag;
    if ((rc = epipe_msg_seal(msg, len))) {
        epipe_msg_free(msg);
        return fail(st, rc, "framing: %s", epipe_last_error());
    }
    uint64_t wire = epipe_msg_wire_len(msg);
    epipe_trace_args(st->trace, h->step, mb, dir, wire, epipe_codec_spec(codec));
    if ((rc = epipe_comm_send(st->comm, peer, msg)))
        return fail(st, rc, "%s", epipe_comm_last_error(st->comm));
    if (dir == DIR_ACT)
        st->st.act_sent_raw += raw, st->st.act_sent_wire += wire;
    else
        st->st.grad_sent_raw += raw, st->st.grad_sent_wire += wire;
    epipe_stage_stats_count(st, c, dir, 1, raw, wire);
    return EPIPE_OK;
}

int epipe_stage_send_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor *t)
{
    int rc = expect(st, mb, 0, dir);
    if (rc)
        return rc;
    struct chunk *c = &st->ch[st->cur.chunk];
    uint64_t n;
    enum epipe_dtype dt;
    /* CUDA tensors too: the boundary's codecs take them (through host
     * staging where the CUDA module has no kernels), or refuse them by
     * name where there is no CUDA module, driver or device */
    if ((rc = epipe_tensor_inspect_on(t, dir == DIR_ACT ? "activation" : "gradient", NULL, &n, &dt,
                                      1)))
        return fail(st, rc, "%s", epipe_last_error());
    if ((rc = check_sent(st, c, dir, t, mb)))
        return rc;
    int local = dir == DIR_ACT ? c->down_local : c->up_local;
    rc = local ? epipe_stage_hand_over(st, c, mb, dir, t) : send_remote(st, c, mb, dir, t, n, dt);
    if (rc == EPIPE_OK)
        st->did_send = 1;
    return rc;
}

static int stage_recv_activation(epipe_stage *st, unsigned mb, const DLTensor **input)
{
    if (!st || !input)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_recv_activation: stage or input is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_recv_activation");
    enter(st);
    return leave(st, epipe_stage_recv_tensor(st, mb, DIR_ACT, input));
}

EPIPE_API int epipe_stage_recv_activation(epipe_stage *st, unsigned mb, const DLTensor **input)
{
    int nested, rc = stage_claim(st, "epipe_stage_recv_activation", &nested);
    return rc ? rc : stage_release(st, nested, stage_recv_activation(st, mb, input));
}

static int stage_recv_gradient(epipe_stage *st, unsigned mb, const DLTensor **grad)
{
    if (!st || !grad)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_recv_gradient: stage or grad is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_recv_gradient");
    enter(st);
    return leave(st, epipe_stage_recv_tensor(st, mb, DIR_GRAD, grad));
}

EPIPE_API int epipe_stage_recv_gradient(epipe_stage *st, unsigned mb, const DLTensor **grad)
{
    int nested, rc = stage_claim(st, "epipe_stage_recv_gradient", &nested);
    return rc ? rc : stage_release(st, nested, stage_recv_gradient(st, mb, grad));
}

static int stage_send_activation(epipe_stage *st, unsigned mb, const DLTensor *output)
{
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_send_activation: stage is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_send_activation");
    enter(st);
    return leave(st, epipe_stage_send_tensor(st, mb, DIR_ACT, output));
}

EPIPE_API int epipe_stage_send_activation(epipe_stage *st, unsigned mb, const DLTensor *output)
{
    int nested, rc = stage_claim(st, "epipe_stage_send_activation", &nested);
    return rc ? rc : stage_release(st, nested, stage_send_activation(st, mb, output));
}

static int stage_send_gradient(epipe_stage *st, unsigned mb, const DLTensor *grad)
{
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_send_gradient: stage is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_send_gradient");
    enter(st);
    return leave(st, epipe_stage_send_tensor(st, mb, DIR_GRAD, grad));
}

EPIPE_API int epipe_stage_send_gradient(epipe_stage *st, unsigned mb, const DLTensor *grad)
{
    int nested, rc = stage_claim(st, "epipe_stage_send_gradient", &nested);
    return rc ? rc : stage_release(st, nested, stage_send_gradient(st, mb, grad));
}
