/* The stage runtime: creating and configuring a stage (schedule, codecs per
 * boundary, parameters) and its statistics. The op stream is in opstream.c,
 * the callback driver in step.c. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "../codec/codec_internal.h"
#include "../codec/cuda_core.h"
#include "../comm/comm_impl.h"
#include "../log.h"
#include "stage_impl.h"

/* ---- create, configure, destroy ---------------------------------------- */

static int make_codec(epipe_stage *st, epipe_codec **slot, const char *spec)
{
    epipe_codec *c;
    int rc = epipe_codec_create(&c, spec);
    if (rc)
        return fail(st, rc, "%s", epipe_last_error());
    epipe_codec_set_param(c, EPIPE_CODEC_THREADS, st->codec_threads);
    epipe_codec_set_stream(c, st->cuda_stream); /* a new handle: nothing to wait for */
    epipe_codec_destroy(*slot);
    *slot = c;
    return EPIPE_OK;
}

/* The schedule fingerprint that every tensor message carries
 * (docs/wire-format.md): the kind's index + 1 in bits 24..31, and a hash
 * of the kind, the rank and micro-batch counts and the placement in 0..23. */
static uint32_t schedule_tag(const epipe_stage *st)
{
    unsigned idx = 0;
    for (size_t i = 0; epipe_schedule_kind_name(i); i++)
        if (!strcmp(epipe_schedule_kind_name(i), st->kind))
            idx = (unsigned)i + 1;
    uint32_t h = 2166136261u;
#define MIX(byte) (h = (h ^ (uint8_t)(byte)) * 16777619u)
    for (const char *c = st->kind; *c; c++)
        MIX(*c);
    uint32_t words[3] = {st->p, st->m, st->P};
    for (int w = 0; w < 3; w++)
        for (int k = 0; k < 4; k++)
            MIX(words[w] >> (8 * k));
    for (unsigned g = 0; g < st->P; g++)
        for (int k = 0; k < 4; k++)
            MIX(st->place_rank[g] >> (8 * k));
#undef MIX
    return (idx > 255 ? 255u : idx) << 24 | ((h >> 24) ^ (h & 0xFFFFFFu));
}

/* The name of the kind whose index a schedule tag carries. */
const char *epipe_stage_tag_kind(uint32_t tag)
{
    unsigned idx = tag >> 24;
    const char *name = idx ? epipe_schedule_kind_name(idx - 1) : NULL;
    return name ? name : "a schedule this library does not know";
}

/* Fills the rank's chunks from the placement (st->P, place_rank,
 * place_chunk), and the forward-only list. */
static int setup_chunks(epipe_stage *st)
{
    st->nch = 0;
    for (unsigned g = 0; g < st->P; g++)
        st->nch += st->place_rank[g] == st->s;
    if (st->nch == 0)
        return epipe_fail(EPIPE_EINVAL, "rank %u holds no pipeline stage in this placement", st->s);
    st->ch = calloc(st->nch, sizeof *st->ch);
    if (!st->ch)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    for (unsigned g = 0; g < st->P; g++) {
        if (st->place_rank[g] != st->s)
            continue;
        if (st->place_chunk[g] >= st->nch)
            return epipe_fail(EPIPE_EINTERNAL, "pipeline stage %u is chunk %u of rank %u", g,
                              st->place_chunk[g], st->s);
        struct chunk *c = &st->ch[st->place_chunk[g]];
        c->g = g;
        c->has_up = g > 0;
        c->has_down = g + 1 < st->P;
        if (c->has_up) {
            c->up_rank = st->place_rank[g - 1];
            c->up_local = c->up_rank == st->s;
            c->up_chunk = st->place_chunk[g - 1];
        }
        if (c->has_down) {
            c->down_rank = st->place_rank[g + 1];
            c->down_local = c->down_rank == st->s;
            c->down_chunk = st->place_chunk[g + 1];
        }
        c->act_in = calloc(st->m, sizeof *c->act_in);
        c->act_out = calloc(st->m, sizeof *c->act_out);
        c->act_ready = calloc(st->m, 1);
        c->samples = calloc(st->m, sizeof *c->samples);
        c->fstep = calloc(st->m, sizeof *c->fstep);
        c->fversion = calloc(st->m, sizeof *c->fversion);
        if (!c->act_in || !c->act_out || !c->act_ready || !c->samples || !c->fstep || !c->fversion)
            return epipe_fail(EPIPE_ENOMEM, "out of memory");
        if (c->down_local) {
            c->grad_loc = calloc(st->m, sizeof *c->grad_loc);
            c->grad_ready = calloc(st->m, 1);
            if (!c->grad_loc || !c->grad_ready)
                return epipe_fail(EPIPE_ENOMEM, "out of memory");
        }
        if (make_codec(st, &c->enc_act, "none") || make_codec(st, &c->dec_act, "none") ||
            make_codec(st, &c->enc_grad, "none") || make_codec(st, &c->dec_grad, "none"))
            return epipe_fail(EPIPE_ENOMEM, "out of memory");
    }
    /* forward only: micro-batch by micro-batch, the chunks in pipeline order */
    st->neval_ops = (size_t)st->m * st->nch;
    st->eval_ops = calloc(st->neval_ops, sizeof *st->eval_ops);
    if (!st->eval_ops)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    for (unsigned i = 0; i < st->m; i++)
        for (unsigned k = 0; k < st->nch; k++)
            st->eval_ops[(size_t)i * st->nch + k] = (epipe_op){
                .kind = EPIPE_OP_FORWARD, .microbatch = i, .chunk = k};
    return EPIPE_OK;
}

/* The parts of creation common to a schedule and to raw op lists. */
static epipe_stage *stage_new(epipe_comm *comm, unsigned microbatches)
{
    epipe_stage *st = calloc(1, sizeof *st);
    if (!st)
        return NULL;
    st->comm = comm;
    st->s = epipe_comm_rank(comm);
    st->p = epipe_comm_size(comm);
    st->m = microbatches;
    st->timeout_ms = 0; /* until EPIPE_STAGE_TIMEOUT_MS: the communicator's, at each receive */
    st->codec_threads = 1;
    st->training = 1;
    st->cuda_device = -1;
    return st;
}

static int stage_finish(epipe_stage *st)
{
    int rc = setup_chunks(st);
    if (rc || (rc = epipe_stage_stats_init(st)))
        return rc;
    st->tag = schedule_tag(st);
    /* every transport but inproc has its ranks in processes of their own */
    st->trace = epipe_trace_open(st->comm->trace, st->s,
                                 strcmp(epipe_comm_transport(st->comm), "inproc") != 0);
    st->tracing = st->trace != NULL;
    st->st.struct_size = sizeof st->st;
    return EPIPE_OK;
}

static int placement_arrays(epipe_stage *st)
{
    st->place_rank = calloc(st->P ? st->P : 1, sizeof *st->place_rank);
    st->place_chunk = calloc(st->P ? st->P : 1, sizeof *st->place_chunk);
    return st->place_rank && st->place_chunk ? EPIPE_OK : epipe_fail(EPIPE_ENOMEM, "out of memory");
}

EPIPE_API int epipe_stage_create_layout(epipe_stage **out, epipe_comm *comm, const char *schedule,
                                        unsigned microbatches, const epipe_schedule_layout *layout)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_create: out is NULL");
    *out = NULL;
    if (!comm || !schedule)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_create: comm or schedule is NULL");
    epipe_stage *st = stage_new(comm, microbatches);
    if (!st)
        return epipe_fail(EPIPE_ENOMEM, "epipe_stage_create: out of memory");
    int rc = epipe_schedule_create_layout(&st->sched, schedule, st->p, microbatches, layout);
    if (rc == EPIPE_OK)
        rc = epipe_schedule_ops(st->sched, st->s, &st->train_ops, &st->ntrain_ops);
    if (rc == EPIPE_OK && (st->weights = epipe_schedule_weights(st->sched))) {
        rc = epipe_schedule_phase_ops(st->sched, st->s, EPIPE_PHASE_STEADY, &st->steady_ops,
                                      &st->nsteady_ops);
        if (rc == EPIPE_OK)
            rc = epipe_schedule_phase_ops(st->sched, st->s, EPIPE_PHASE_DRAIN, &st->drain_ops,
                                          &st->ndrain_ops);
    }
    if (rc == EPIPE_OK) {
        st->kind = epipe_schedule_kind(st->sched);
        st->splits = epipe_schedule_splits_backward(st->sched) == 1;
        st->P = epipe_schedule_pipeline_stages(st->sched);
        rc = placement_arrays(st);
        for (unsigned g = 0; rc == EPIPE_OK && g < st->P; g++)
            rc = epipe_schedule_placement(st->sched, g, &st->place_rank[g], &st->place_chunk[g]);
    }
    if (rc == EPIPE_OK)
        rc = stage_finish(st);
    if (rc) {
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", epipe_last_error());
        epipe_stage_destroy(st);
        return epipe_fail(rc, "epipe_stage_create: %s", why);
    }
    *out = st;
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_create(epipe_stage **out, epipe_comm *comm, const char *schedule,
                                 unsigned microbatches)
{
    return epipe_stage_create_layout(out, comm, schedule, microbatches, NULL);
}

int epipe_stage_create_raw(epipe_stage **out, epipe_comm *comm, unsigned microbatches,
                           unsigned pipeline_stages, const unsigned *placement, const epipe_op *ops,
                           size_t nops, int splits)
{
    epipe_clear_error();
    *out = NULL;
    epipe_stage *st = stage_new(comm, microbatches);
    if (!st)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    st->kind = "raw";
    st->splits = splits;
    st->P = pipeline_stages;
    int rc = placement_arrays(st);
    unsigned seen[1024] = {0};
    for (unsigned g = 0; rc == EPIPE_OK && g < st->P; g++) {
        if (placement[g] >= st->p || placement[g] >= 1024) {
            rc = epipe_fail(EPIPE_EINVAL, "pipeline stage %u on rank %u of %u", g, placement[g],
                            st->p);
            break;
        }
        st->place_rank[g] = placement[g];
        st->place_chunk[g] = seen[placement[g]]++;
    }
    if (rc == EPIPE_OK && !(st->raw_ops = malloc(sizeof *ops * (nops ? nops : 1))))
        rc = epipe_fail(EPIPE_ENOMEM, "out of memory");
    if (rc == EPIPE_OK) {
        memcpy(st->raw_ops, ops, sizeof *ops * nops);
        st->train_ops = st->raw_ops;
        st->ntrain_ops = nops;
        rc = stage_finish(st);
    }
    if (rc) {
        epipe_stage_destroy(st);
        return rc;
    }
    *out = st;
    return EPIPE_OK;
}

void epipe_stage_lent_free(struct lent_tensor *lt)
{
    if (lt->on_cuda)
        epipe_cuda_dev_free(lt->device, lt->buf);
    else
        free(lt->buf);
    lt->buf = NULL;
    lt->cap = 0;
    lt->on_cuda = 0;
}

static void free_lent(struct lent_tensor *lt, unsigned n)
{
    for (unsigned i = 0; lt && i < n; i++)
        epipe_stage_lent_free(&lt[i]);
    free(lt);
}

EPIPE_API void epipe_stage_destroy(epipe_stage *st)
{
    if (!st)
        return;
    if (st->in_callback) { /* freeing it would pull the step out from under its callback */
        epipe_log_msg(EPIPE_LOG_ERROR, (int)st->s, "stage",
                      "epipe_stage_destroy called from inside the %s callback: ignored, the "
                      "stage is not freed; destroy it after epipe_stage_step returns",
                      st->in_callback);
        return;
    }
    uintptr_t owner = __atomic_load_n(&st->owner, __ATOMIC_ACQUIRE);
    if (owner && owner != (uintptr_t)pthread_self()) { /* it would free the stage under it */
        const char *inside = __atomic_load_n(&st->owner_call, __ATOMIC_RELAXED);
        epipe_log_msg(EPIPE_LOG_ERROR, (int)st->s, "stage",
                      "epipe_stage_destroy called while another thread is inside %s: ignored, "
                      "the stage is not freed; destroy it once that call has returned",
                      inside ? inside : "a call");
        return;
    }
    if (st->ch) /* before the codecs and the tensors their work uses go */
        epipe_stage_settle(st, 0);
    epipe_stage_free_marks(st);
    epipe_cuda_dev_free(st->taint_device, st->taint);
    epipe_stage_lent_free(&st->peer_in);
    for (unsigned i = 0; st->ch && i < st->nch; i++) {
        struct chunk *c = &st->ch[i];
        free_lent(c->act_in, st->m);
        free_lent(c->grad_loc, st->m);
        free(c->act_out);
        free(c->act_ready);
        for (unsigned k = 0; c->samples && k < st->m; k++)
            free(c->samples[k].ids);
        free(c->samples);
        free(c->fstep);
        free(c->fversion);
        free(c->grad_ready);
        epipe_stage_lent_free(&c->code_in);
        epipe_stage_lent_free(&c->code_out);
        epipe_codec_destroy(c->enc_act);
        epipe_codec_destroy(c->dec_act);
        epipe_codec_destroy(c->enc_grad);
        epipe_codec_destroy(c->dec_grad);
    }
    free(st->ch);
    epipe_trace_close(st->trace);
    epipe_stage_lent_free(&st->grad_in);
    free(st->scratch);
    free(st->eval_ops);
    free(st->raw_ops);
    free(st->place_rank);
    free(st->place_chunk);
    epipe_schedule_destroy(st->sched);
    epipe_stage_stats_fini(st);
    free(st);
}

static int stage_set_codec(epipe_stage *st, epipe_direction dir, unsigned boundary,
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
    if (boundary != EPIPE_ALL_BOUNDARIES && (st->P < 2 || boundary > st->P - 2))
        return fail(st, EPIPE_EINVAL,
                    "boundary %u does not exist: %u pipeline stages have boundaries 0..%d",
                    boundary, st->P, (int)st->P - 2);
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_set_codec");
    if (st->started)
        return fail(st, EPIPE_ESTATE, "codecs can only be set before the first step");
    epipe_codec *probe;
    int rc = epipe_codec_create(&probe, spec); /* check the spec even if unused here */
    if (rc)
        return fail(st, rc, "%s", epipe_last_error());
    int trainable = epipe_codec_trainable(probe);
    double ef = 0, delta = 0;
    if (epipe_codec_spec_param(probe, "ef", &ef) != EPIPE_OK)
        ef = 0; /* a codec without the key */
    if (epipe_codec_spec_param(probe, "delta", &delta) != EPIPE_OK)
        delta = 0;
    epipe_codec_destroy(probe);
    epipe_clear_error();
    if (ef == 1 && dir == EPIPE_DIR_ACTIVATION)
        return fail(st, EPIPE_EINVAL,
                    "'%s': ef=1 (error feedback) is for gradients, whose sum over steps is "
                    "what training uses; one step's activations do not continue the last's",
                    spec);
    if (delta == 1 && dir == EPIPE_DIR_GRADIENT)
        return fail(st, EPIPE_EINVAL,
                    "'%s': delta=1 (activation deltas) is for activations, whose rows are "
                    "samples that cross again each epoch; for gradients use ef=1",
                    spec);
    if (trainable && dir == EPIPE_DIR_GRADIENT)
        return fail(st, EPIPE_ENOTSUP,
                    "'%s' is trainable: it goes on the activation direction, and then the "
                    "gradient of its code crosses back (docs/runtime.md); nothing trains a "
                    "gradient codec",
                    spec);
    int all = boundary == EPIPE_ALL_BOUNDARIES;
    for (unsigned i = 0; i < st->nch; i++) {
        struct chunk *c = &st->ch[i];
        if (trainable && !all && c->has_down && c->down_local && boundary == c->g)
            return fail(st, EPIPE_ENOTSUP,
                        "'%s' is trainable, and boundary %u joins two chunks of rank %u: a "
                        "trainable codec runs only between ranks",
                        spec, boundary, st->s);
    }
    for (unsigned i = 0; i < st->nch; i++) {
        struct chunk *c = &st->ch[i];
        int down = c->has_down && (all || boundary == c->g);
        int up = c->has_up && (all || boundary + 1 == c->g);
        /* with every boundary, a trainable codec leaves the local ones copying */
        if (trainable && down && c->down_local)
            down = 0;
        if (trainable && up && c->up_local)
            up = 0;
        if (down &&
            (rc = make_codec(st, dir == EPIPE_DIR_ACTIVATION ? &c->enc_act : &c->dec_grad, spec)))
            return rc;
        if (up &&
            (rc = make_codec(st, dir == EPIPE_DIR_ACTIVATION ? &c->dec_act : &c->enc_grad, spec)))
            return rc;
        if (down && c->down_local)
            c->local_codec[dir] = 1;
        if (down && dir == EPIPE_DIR_ACTIVATION)
            c->delta_enc = delta == 1;
        if (up && dir == EPIPE_DIR_ACTIVATION)
            c->delta_dec = delta == 1;
    }
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_set_codec(epipe_stage *st, epipe_direction dir, unsigned boundary,
                                    const char *spec)
{
    int nested, rc = stage_claim(st, "epipe_stage_set_codec", &nested);
    return rc ? rc : stage_release(st, nested, stage_set_codec(st, dir, boundary, spec));
}

/* A switch of the environment for a stage on a CUDA device: 1 (the
 * default) or 0, anything else refused by name. */
static int env_switch(epipe_stage *st, const char *name, const char *on, const char *off,
                      int *value)
{
    const char *env = getenv(name);
    if (env && strcmp(env, "0") && strcmp(env, "1"))
        return fail(st, EPIPE_EINVAL,
                    "EPIPE_STAGE_CUDA_DEVICE: the environment's %s = '%.40s': use 1 (%s, the "
                    "default) or 0 (%s)",
                    name, env, on, off);
    *value = !env || !strcmp(env, "1");
    return EPIPE_OK;
}

static int devbuf_alloc(int device, size_t bytes, void **p)
{
    char why[256];
    return epipe_cuda_dev_alloc(device, bytes, p, why, sizeof why);
}

/* A stage on a CUDA device has its codecs copy each payload from the
 * device into its message and each received one back: from pinned memory
 * such a copy is one DMA the host does not wait for; from malloc's, the
 * driver stages it through a bounce buffer of its own and may hold the
 * host until it is done. So its communicator's cached message
 * buffers are pinned, unless EPIPE_CUDA_PINNED_MESSAGES=0 (for measuring
 * the difference). Between stages that are threads of one process
 * (inproc) the payload need not leave the device at all: the sender
 * encodes into device memory and the receiver decodes from there (when
 * both are on a device; a receiver on another first copies the payload
 * device to device), unless EPIPE_CUDA_DEVICE_MESSAGES=0. The
 * communicator is told once and stays so: other stages on it lose
 * nothing by either. */
static int cuda_messages(epipe_stage *st, int device)
{
    static const epipe_msgbuf_allocator pinned = {epipe_cuda_pinned_alloc,
                                                  epipe_codec_cuda_host_free};
    static const epipe_msgbuf_allocator on_device = {devbuf_alloc, epipe_cuda_dev_free};
    int pin = 1, dev = 1, rc;
    if ((rc = env_switch(st, "EPIPE_CUDA_PINNED_MESSAGES", "pinned message buffers", "pageable",
                         &pin)) ||
        (rc = env_switch(st, "EPIPE_CUDA_DEVICE_MESSAGES",
                         "payloads stay on the device between stages of one process",
                         "they cross to the host", &dev)))
        return rc;
    if (pin)
        epipe_comm_pin_buffers(st->comm, &pinned, device);
    if (dev)
        epipe_comm_device_buffers(st->comm, &on_device, device);
    return EPIPE_OK;
}

/* EPIPE_ESTATE naming `knob` unless the stage is between steps (and not in
 * one of its callbacks): for the knobs that change only there. */
static int between_steps(epipe_stage *st, const char *knob)
{
    if (st->in_callback)
        return refuse_in_callback(st, knob);
    if (st->in_step)
        return fail(st, EPIPE_ESTATE, "%s can only change between steps", knob);
    return EPIPE_OK;
}

static int stage_set_param(epipe_stage *st, epipe_stage_param param, int64_t value)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_set_param: stage is NULL");
    int rc;
    switch (param) {
    case EPIPE_STAGE_TIMEOUT_MS:
        if (value < 1 || value > 86400000)
            return fail(st, EPIPE_EINVAL,
                        "EPIPE_STAGE_TIMEOUT_MS = %lld is out of range 1..86400000",
                        (long long)value);
        st->timeout_ms = value;
        return EPIPE_OK;
    case EPIPE_STAGE_CODEC_THREADS: {
        if (value < 0 || value > 256)
            return fail(st, EPIPE_EINVAL, "EPIPE_STAGE_CODEC_THREADS = %lld is out of range 0..256",
                        (long long)value);
        st->codec_threads = (unsigned)value;
        for (unsigned k = 0; k < st->nch; k++) {
            struct chunk *c = &st->ch[k];
            epipe_codec *all[4] = {c->enc_act, c->dec_act, c->enc_grad, c->dec_grad};
            for (int i = 0; i < 4; i++)
                epipe_codec_set_param(all[i], EPIPE_CODEC_THREADS, value);
        }
        return EPIPE_OK;
    }
    case EPIPE_STAGE_BATCH_SIZE:
        if (value < 0)
            return fail(st, EPIPE_EINVAL, "EPIPE_STAGE_BATCH_SIZE = %lld is negative",
                        (long long)value);
        if (value % st->m)
            return fail(st, EPIPE_EINVAL, "batch size %lld does not divide into %u micro-batches",
                        (long long)value, st->m);
        st->batch = value;
        return EPIPE_OK;
    case EPIPE_STAGE_TRAINING:
        if (value != 0 && value != 1)
            return fail(st, EPIPE_EINVAL,
                        "EPIPE_STAGE_TRAINING = %lld: use 1 (train) or 0 "
                        "(forward only)",
                        (long long)value);
        if ((rc = between_steps(st, "EPIPE_STAGE_TRAINING")))
            return rc;
        if (!value && st->flowing)
            return fail(st, EPIPE_ESTATE,
                        "EPIPE_STAGE_TRAINING = 0 while micro-batches of schedule '%s' are in "
                        "flight: call epipe_stage_drain() first",
                        st->kind);
        st->training = (int)value;
        return EPIPE_OK;
    case EPIPE_STAGE_CUDA_DEVICE: {
        if (value < -1 || value > 65535)
            return fail(st, EPIPE_EINVAL,
                        "EPIPE_STAGE_CUDA_DEVICE = %lld: use -1 (host memory) or a CUDA device "
                        "index",
                        (long long)value);
        if ((rc = between_steps(st, "EPIPE_STAGE_CUDA_DEVICE")))
            return rc;
        char why[1400];
        if (value >= 0 && (rc = epipe_cuda_device_ok((int)value, why, sizeof why)))
            return fail(st, rc, "EPIPE_STAGE_CUDA_DEVICE = %lld: %s", (long long)value, why);
        /* A codec handle keeps to the memory of its first tensor: once the
         * decoders (and a trainable codec's backward) have written received
         * tensors somewhere, moving them would fail every later receive. */
        for (unsigned i = 0; i < st->nch; i++) {
            const struct chunk *c = &st->ch[i];
            const epipe_codec *writers[3] = {c->dec_act, c->dec_grad,
                                             epipe_codec_trainable(c->enc_act) ? c->enc_act : NULL};
            for (int k = 0; k < 3; k++) {
                int bound;
                if (!epipe_codec_bound_to(writers[k], &bound) || bound == (int)value)
                    continue;
                memory_name(why, sizeof why, bound);
                return fail(st, EPIPE_ESTATE,
                            "EPIPE_STAGE_CUDA_DEVICE = %lld: this stage's codecs already write "
                            "received tensors into %s, and a codec handle keeps to the memory of "
                            "its first tensor: set the knob before the first step",
                            (long long)value, why);
            }
        }
        if (value >= 0 && (rc = cuda_messages(st, (int)value)))
            return rc;
        st->cuda_device = (int)value;
        return EPIPE_OK;
    }
    case EPIPE_STAGE_CUDA_STREAM_ORDERED:
        if (value != 0 && value != 1)
            return fail(st, EPIPE_EINVAL,
                        "EPIPE_STAGE_CUDA_STREAM_ORDERED = %lld: use 1 (calls return with "
                        "their CUDA work queued) or 0 (complete)",
                        (long long)value);
        if ((rc = between_steps(st, "EPIPE_STAGE_CUDA_STREAM_ORDERED")))
            return rc;
        st->stream_ordered = (int)value;
        return EPIPE_OK;
    }
    return fail(st, EPIPE_EINVAL, "unknown stage parameter %d", (int)param);
}

EPIPE_API int epipe_stage_set_param(epipe_stage *st, epipe_stage_param param, int64_t value)
{
    int nested, rc = stage_claim(st, "epipe_stage_set_param", &nested);
    return rc ? rc : stage_release(st, nested, stage_set_param(st, param, value));
}

static int stage_set_cuda_stream(epipe_stage *st, void *stream)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_set_cuda_stream: stage is NULL");
    /* the work stream-ordered calls left on the old stream, reported as
     * theirs before a codec's wait below would take it as its own */
    int first = epipe_stage_settle_first(st);
    st->cuda_stream = stream;
    for (unsigned k = 0; k < st->nch; k++) {
        struct chunk *c = &st->ch[k];
        epipe_codec *all[4] = {c->enc_act, c->dec_act, c->enc_grad, c->dec_grad};
        for (int i = 0; i < 4; i++) {
            int rc = epipe_codec_set_stream(all[i], stream);
            if (rc && !first)
                first = fail(st, rc, "waiting for the previous CUDA stream: %s",
                             epipe_codec_last_error(all[i]));
        }
    }
    return first;
}

EPIPE_EXPERIMENTAL int epipe_stage_set_cuda_stream(epipe_stage *st, void *stream)
{
    int nested, rc = stage_claim(st, "epipe_stage_set_cuda_stream", &nested);
    return rc ? rc : stage_release(st, nested, stage_set_cuda_stream(st, stream));
}

EPIPE_API int epipe_stage_get_param(const epipe_stage *st, epipe_stage_param param, int64_t *value)
{
    epipe_clear_error();
    if (!st || !value)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_get_param: %s is NULL",
                          st ? "value" : "stage");
    switch (param) {
    case EPIPE_STAGE_TIMEOUT_MS: *value = stage_timeout_ms(st); return EPIPE_OK;
    case EPIPE_STAGE_CODEC_THREADS: *value = (int64_t)st->codec_threads; return EPIPE_OK;
    case EPIPE_STAGE_BATCH_SIZE: *value = st->batch; return EPIPE_OK;
    case EPIPE_STAGE_TRAINING: *value = st->training; return EPIPE_OK;
    case EPIPE_STAGE_CUDA_DEVICE: *value = st->cuda_device; return EPIPE_OK;
    case EPIPE_STAGE_CUDA_STREAM_ORDERED: *value = st->stream_ordered; return EPIPE_OK;
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

EPIPE_API unsigned epipe_stage_chunks(const epipe_stage *st)
{
    return st ? st->nch : 0;
}

EPIPE_API int epipe_stage_chunk_stage(const epipe_stage *st, unsigned chunk,
                                      unsigned *pipeline_stage, unsigned *pipeline_stages)
{
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_chunk_stage: stage is NULL");
    if (chunk >= st->nch)
        return epipe_fail(EPIPE_EINVAL, "stage %u: chunk %u does not exist: this rank holds %u",
                          st->s, chunk, st->nch);
    if (pipeline_stage)
        *pipeline_stage = st->ch[chunk].g;
    if (pipeline_stages)
        *pipeline_stages = st->P;
    return EPIPE_OK;
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
    const struct chunk *c = &st->ch[0];
    if (side == EPIPE_SIDE_DOWN && c->has_down)
        return dir == EPIPE_DIR_ACTIVATION ? c->enc_act : c->dec_grad;
    if (side == EPIPE_SIDE_UP && c->has_up)
        return dir == EPIPE_DIR_ACTIVATION ? c->dec_act : c->enc_grad;
    return NULL;
}

static int stage_codec_sgd_step(epipe_stage *st, double lr, double momentum)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_codec_sgd_step: stage is NULL");
    if (st->in_callback)
        return refuse_in_callback(st, "epipe_stage_codec_sgd_step");
    if (st->in_step)
        return fail(st, EPIPE_ESTATE, "epipe_stage_codec_sgd_step can only run between steps");
    for (unsigned k = 0; k < st->nch; k++) {
        const struct chunk *c = &st->ch[k];
        epipe_codec *mine[2] = {c->has_down ? c->enc_act : NULL, c->has_up ? c->dec_act : NULL};
        for (int i = 0; i < 2; i++) {
            if (!epipe_codec_trainable(mine[i]))
                continue;
            int rc = epipe_codec_sgd_step(mine[i], lr, momentum);
            if (rc == EPIPE_OK)
                rc = epipe_codec_zero_grad(mine[i]);
            if (rc)
                return fail(st, rc, "%s", epipe_codec_last_error(mine[i]));
        }
    }
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_codec_sgd_step(epipe_stage *st, double lr, double momentum)
{
    int nested, rc = stage_claim(st, "epipe_stage_codec_sgd_step", &nested);
    return rc ? rc : stage_release(st, nested, stage_codec_sgd_step(st, lr, momentum));
}
