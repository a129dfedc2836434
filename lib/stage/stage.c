/* The stage runtime: creating and configuring a stage (schedule, codecs per
 * boundary, parameters) and its statistics. The op stream is in opstream.c,
 * the callback driver in step.c. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "../codec/codec_internal.h"
#include "stage_impl.h"

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
    if (!st->act_in || !st->eval_ops || make_codec(st, &st->enc_act, "none") ||
        make_codec(st, &st->dec_act, "none") || make_codec(st, &st->enc_grad, "none") ||
        make_codec(st, &st->dec_grad, "none")) {
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
    double ef = 0;
    if (epipe_codec_spec_param(probe, "ef", &ef) != EPIPE_OK)
        ef = 0; /* a codec without the key */
    epipe_codec_destroy(probe);
    epipe_clear_error();
    if (ef == 1 && dir == EPIPE_DIR_ACTIVATION)
        return fail(st, EPIPE_EINVAL,
                    "'%s': ef=1 (error feedback) is for gradients, whose sum over steps is "
                    "what training uses; one step's activations do not continue the last's",
                    spec);
    if (trainable && dir == EPIPE_DIR_GRADIENT)
        return fail(st, EPIPE_ENOTSUP,
                    "'%s' is trainable: it goes on the activation direction, and then the "
                    "gradient of its code crosses back (docs/runtime.md); nothing trains a "
                    "gradient codec",
                    spec);
    int all = boundary == EPIPE_ALL_BOUNDARIES;
    int down = st->s + 1 < st->p && (all || boundary == st->s);
    int up = st->s > 0 && (all || boundary + 1 == st->s);
    if (down &&
        (rc = make_codec(st, dir == EPIPE_DIR_ACTIVATION ? &st->enc_act : &st->dec_grad, spec)))
        return rc;
    if (up &&
        (rc = make_codec(st, dir == EPIPE_DIR_ACTIVATION ? &st->dec_act : &st->enc_grad, spec)))
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
        if (st->in_step)
            return fail(st, EPIPE_ESTATE, "EPIPE_STAGE_TRAINING can only change between steps");
        st->training = (int)value;
        return EPIPE_OK;
    }
    return fail(st, EPIPE_EINVAL, "unknown stage parameter %d", (int)param);
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
    epipe_codec *mine[2] = {st->s + 1 < st->p ? st->enc_act : NULL, st->s > 0 ? st->dec_act : NULL};
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

/* ---- statistics --------------------------------------------------------- */

EPIPE_API int epipe_stage_get_stats(const epipe_stage *st, epipe_stage_stats *out)
{
    epipe_clear_error();
    if (!st || !out)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_get_stats: stage or stats is NULL");
    size_t n = out->struct_size;
    if (n < sizeof(size_t))
        return epipe_fail(
            EPIPE_EINVAL,
            "epipe_stage_get_stats: set stats->struct_size = sizeof(epipe_stage_stats)");
    if (n > sizeof st->st)
        n = sizeof st->st;
    memcpy((char *)out + sizeof(size_t), (const char *)&st->st + sizeof(size_t),
           n - sizeof(size_t));
    return EPIPE_OK;
}

EPIPE_API void epipe_stage_reset_stats(epipe_stage *st)
{
    if (!st)
        return;
    memset(&st->st, 0, sizeof st->st);
    st->st.struct_size = sizeof st->st;
}
