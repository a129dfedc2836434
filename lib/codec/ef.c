/* Error feedback (the core-level spec key ef=1): per micro-batch slot, the
 * residual of the last encode, added to the next input before encoding.
 * The slots live here for both backends; a CUDA handle's residuals are
 * device memory, which the CUDA module fills (cuda/module.cu). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "cuda_core.h"

/* One residual: the error left by the last encode of this slot, for a
 * tensor of this dtype and shape (any change starts the slot over). */
typedef struct ef_slot {
    int64_t key; /* EPIPE_CODEC_MICROBATCH; -1 is a slot of its own */
    float *r;
    int device; /* -1: r is host memory; else the CUDA device it is on */
    uint64_t n;
    enum epipe_dtype dt;
    int ndim;
    int64_t shape[EPIPE_CODEC_MAX_NDIM];
} ef_slot;

struct epipe_codec_ef {
    ef_slot *slots;
    unsigned nslots, cap;
    float *work; /* x + r, the tensor actually encoded */
    size_t work_cap;
};

static void residual_free(float *r, int device)
{
    if (device < 0)
        free(r);
    else /* cudaFree: it waits for the work queued on the device */
        epipe_cuda_dev_free(device, r);
}

void epipe_codec_ef_release(epipe_codec *c)
{
    struct epipe_codec_ef *e = c->ef_state;
    if (!e)
        return;
    for (unsigned i = 0; i < e->nslots; i++)
        residual_free(e->slots[i].r, e->slots[i].device);
    free(e->slots);
    free(e->work);
    free(e);
    c->ef_state = NULL;
}

static int same_shape(const ef_slot *s, const epipe_codec *c, uint64_t n, enum epipe_dtype dt,
                      int device)
{
    if (!s->r || s->device != device || s->n != n || s->dt != dt || s->ndim != c->ndim)
        return 0;
    for (int d = 0; d < c->ndim; d++)
        if (s->shape[d] != c->shape[d])
            return 0;
    return 1;
}

/* n residual values (at least one) in host memory (device -1) or on a
 * CUDA device. */
static int residual_alloc(epipe_codec *c, uint64_t n, int device, float **r)
{
    size_t bytes = (n ? n : 1) * sizeof **r;
    if (device < 0) {
        if (!(*r = malloc(bytes)))
            return epipe_codec_fail(c, EPIPE_ENOMEM,
                                    "%s: ef: no memory for a residual of %llu values", c->ops->name,
                                    (unsigned long long)n);
        return EPIPE_OK;
    }
    char why[300];
    void *p = NULL;
    int rc = epipe_cuda_dev_alloc(device, bytes, &p, why, sizeof why);
    if (rc)
        return epipe_codec_fail(c, rc, "%s: ef: a residual of %llu values: %s", c->ops->name,
                                (unsigned long long)n, why);
    *r = p;
    return EPIPE_OK;
}

/* The slot of the current micro-batch, new (*fresh = 1) when it did not
 * exist or the tensor changed shape, dtype or device since its last
 * encode: zeroed here in host memory; a device residual is the caller's
 * to zero. */
static int slot_for(epipe_codec *c, uint64_t n, enum epipe_dtype dt, int device, ef_slot **out,
                    int *fresh)
{
    struct epipe_codec_ef *e = c->ef_state;
    if (!e) {
        if (!(e = calloc(1, sizeof *e)))
            return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: ef: out of memory", c->ops->name);
        c->ef_state = e;
    }
    ef_slot *s = NULL;
    for (unsigned i = 0; i < e->nslots && !s; i++)
        if (e->slots[i].key == c->microbatch)
            s = &e->slots[i];
    if (!s) {
        if (e->nslots == EPIPE_CODEC_EF_MAX_SLOTS)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "%s: ef: micro-batch %lld would be residual slot %d; the "
                                    "limit is %d (epipe_codec_reset_feedback() frees them)",
                                    c->ops->name, (long long)c->microbatch,
                                    EPIPE_CODEC_EF_MAX_SLOTS + 1, EPIPE_CODEC_EF_MAX_SLOTS);
        if (e->nslots == e->cap) {
            unsigned cap = e->cap ? 2 * e->cap : 8;
            ef_slot *p = realloc(e->slots, cap * sizeof *p);
            if (!p)
                return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: ef: out of memory", c->ops->name);
            e->slots = p, e->cap = cap;
        }
        s = &e->slots[e->nslots++];
        memset(s, 0, sizeof *s);
        s->key = c->microbatch;
        s->device = -1;
    }
    *fresh = 0;
    if (!same_shape(s, c, n, dt, device)) {
        if (s->n != n || !s->r || s->device != device) {
            residual_free(s->r, s->device);
            s->r = NULL, s->n = 0, s->device = -1;
            int rc = residual_alloc(c, n, device, &s->r);
            if (rc)
                return rc;
            s->device = device;
        }
        if (device < 0)
            memset(s->r, 0, (n ? n : 1) * sizeof *s->r);
        s->n = n, s->dt = dt, s->ndim = c->ndim;
        memcpy(s->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
        *fresh = 1;
    }
    *out = s;
    return EPIPE_OK;
}

int epipe_codec_ef_slot_cuda(epipe_codec *c, int device, uint64_t n, enum epipe_dtype dt, float **r,
                             int *fresh)
{
    ef_slot *s = NULL;
    int rc = slot_for(c, n, dt, device, &s, fresh);
    if (rc)
        return rc;
    *r = s->r;
    return EPIPE_OK;
}

int epipe_codec_ef_encode(epipe_codec *c, const epipe_codec_backend *be, const float *x, uint64_t n,
                          enum epipe_dtype dt, uint8_t *body)
{
    if (be != c->ops->cpu)
        return epipe_codec_fail(c, EPIPE_ENOTSUP, "%s: ef=1 runs on the CPU backend only",
                                c->ops->name);
    ef_slot *s = NULL;
    int fresh, rc = slot_for(c, n, dt, -1, &s, &fresh);
    if (rc)
        return rc;
    struct epipe_codec_ef *e = c->ef_state;
    if (e->work_cap < n) {
        float *p = realloc(e->work, n * sizeof *p);
        if (!p)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: ef: no memory for %llu values",
                                    c->ops->name, (unsigned long long)n);
        e->work = p, e->work_cap = n;
    }
    float *w = e->work;
    for (size_t i = 0; i < n; i++)
        w[i] = x[i] + s->r[i];
    /* Refused before the codec sees it, whatever the codec: a non-finite
     * value would stay in the residual for good. */
    size_t bad = epipe_find_nonfinite(w, n);
    if (bad < n) {
        if (epipe_find_nonfinite(x + bad, 1) == 0)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "%s: input value at index %zu is %s; error feedback (ef=1) "
                                    "needs finite values",
                                    c->ops->name, bad,
                                    isnan(x[bad]) ? "NaN"
                                    : x[bad] > 0  ? "+inf"
                                                  : "-inf");
        return epipe_codec_fail(
            c, EPIPE_EINVAL,
            "%s: ef: input value at index %zu (%g) plus its residual %g overflows fp32",
            c->ops->name, bad, (double)x[bad], (double)s->r[bad]);
    }
    if ((rc = (c->use_reference ? be->encode_ref : be->encode)(c, w, n, body)))
        return rc;
    /* The residual is what the receiver will miss: x + r less what it
     * decodes. The payload is decoded here with the codec's own decoder. */
    float *y = s->r;
    if ((rc = (c->use_reference ? be->decode_ref : be->decode)(c, body, n, y))) {
        memset(s->r, 0, n * sizeof *s->r);
        return rc;
    }
    for (size_t i = 0; i < n; i++)
        y[i] = w[i] - y[i];
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_reset_feedback(epipe_codec *c)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_reset_feedback: codec is NULL");
    epipe_codec_ef_release(c);
    epipe_codec_delta_release(c, 0);
    return EPIPE_OK;
}
