/* Sample ids for activation deltas (delta=1): the first stage takes them from
 * the host, later stages from each decoded activation, and every send hands them to its encoder. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stage_impl.h"

/* Copies n ids (NULL: untracked rows) into s. */
static int store(epipe_stage *st, struct sample_ids *s, const uint64_t *ids, size_t n)
{
    if (ids && s->cap < n) {
        if (n > SIZE_MAX / sizeof *ids)
            return fail(st, EPIPE_EOVERFLOW, "%zu sample ids are too many to hold", n);
        void *p = realloc(s->ids, n * sizeof *ids);
        if (!p)
            return fail(st, EPIPE_ENOMEM, "no memory for %zu sample ids", n);
        s->ids = p, s->cap = n;
    }
    if (ids && n)
        memcpy(s->ids, ids, n * sizeof *ids);
    s->n = n;
    s->untracked = ids == NULL;
    s->set = 1;
    return EPIPE_OK;
}

static int stage_set_samples(epipe_stage *st, unsigned mb, const uint64_t *ids, size_t n)
{
    epipe_clear_error();
    if (!st)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_set_samples: stage is NULL");
    if (mb >= st->m)
        return fail(st, EPIPE_EINVAL, "epipe_stage_set_samples: micro-batch %u of %u", mb, st->m);
    if (st->place_rank[0] != st->s)
        return fail(st, EPIPE_EINVAL,
                    "epipe_stage_set_samples: rank %u does not hold the first pipeline stage "
                    "(rank %u does); later stages learn the sample ids from the activations "
                    "they receive",
                    st->s, st->place_rank[0]);
    return store(st, &st->ch[st->place_chunk[0]].samples[mb], ids, n);
}

EPIPE_EXPERIMENTAL int epipe_stage_set_samples(epipe_stage *st, unsigned mb, const uint64_t *ids,
                                               size_t n)
{
    int nested, rc = stage_claim(st, "epipe_stage_set_samples", &nested);
    return rc ? rc : stage_release(st, nested, stage_set_samples(st, mb, ids, n));
}

int epipe_stage_samples_before_encode(epipe_stage *st, struct chunk *c, epipe_codec *enc,
                                      unsigned mb, const DLTensor *t)
{
    struct sample_ids *s = &c->samples[mb];
    int set = s->set;
    s->set = 0; /* the ids are for this send only */
    size_t rows = t->ndim ? (size_t)t->shape[0] : 1;
    if (set && s->n != rows)
        return fail(st, EPIPE_EINVAL,
                    "the activation of micro-batch %u has %zu rows (dimension 0), but %zu "
                    "sample ids came with it%s",
                    mb, rows, s->n,
                    c->g == 0 ? " from epipe_stage_set_samples()" : " from the stage before");
    if (!c->delta_enc)
        return EPIPE_OK;
    int rc;
    if (!st->training || (set && s->untracked))
        rc = epipe_codec_set_samples(enc, NULL, rows);
    else if (!set && c->g == 0)
        return fail(st, EPIPE_EINVAL,
                    "the activation codec '%s' of micro-batch %u has delta=1: call "
                    "epipe_stage_set_samples(%u, ids, %zu) before each training send",
                    epipe_codec_spec(enc), mb, mb, rows);
    else if (!set)
        return fail(st, EPIPE_EINVAL,
                    "the activation codec '%s' of boundary %u has delta=1, but the activation "
                    "of micro-batch %u received from boundary %u carried no sample ids: set "
                    "delta=1 on every boundary between ranks before it",
                    epipe_codec_spec(enc), c->g, mb, c->g - 1);
    else
        rc = epipe_codec_set_samples(enc, s->ids, rows);
    if (rc)
        return fail(st, rc, "%s", epipe_codec_last_error(enc));
    return EPIPE_OK;
}

int epipe_stage_samples_after_decode(epipe_stage *st, struct chunk *c, epipe_codec *dec,
                                     unsigned mb)
{
    if (!c->delta_dec) {
        c->samples[mb].set = 0;
        return EPIPE_OK;
    }
    const uint64_t *ids;
    size_t n;
    int rc = epipe_codec_decoded_samples(dec, &ids, &n);
    if (rc)
        return fail(st, rc, "the sample ids of micro-batch %u: %s", mb,
                    epipe_codec_last_error(dec));
    return store(st, &c->samples[mb], ids, n);
}

int epipe_stage_samples_move(epipe_stage *st, struct chunk *from, struct chunk *to, unsigned mb)
{
    struct sample_ids *s = &from->samples[mb];
    if (!s->set) {
        to->samples[mb].set = 0;
        return EPIPE_OK;
    }
    s->set = 0;
    return store(st, &to->samples[mb], s->untracked ? NULL : s->ids, s->n);
}
