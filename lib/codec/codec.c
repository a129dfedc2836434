/* The public codec API: handles and their knobs, and encode and decode
 * with the tensor checks, backend dispatch and payload header around each
 * codec's backend. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/codec.h>

#include "../parallel.h"
#include "codec_internal.h"
#include "core.h"
#include "cuda_core.h"
#include "payload.h"

int epipe_codec_fail(epipe_codec *c, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    epipe_vfail_into(c ? c->msg : NULL, status, fmt, ap);
    va_end(ap);
    return status;
}

int epipe_codec_use_reference(epipe_codec *c, int on)
{
    c->use_reference = on && c->be && c->be->encode_ref && c->be->decode_ref;
    return c->use_reference || !on;
}

unsigned epipe_codec_workers(const epipe_codec *c, size_t n)
{
    /* Below ~256K values a thread start (~20 us) is no longer negligible. */
    if (c->threads == 1 || n < (size_t)1 << 18)
        return 1;
    unsigned t = c->threads ? c->threads : epipe_cpu_count();
    size_t by_size = n >> 17; /* at least 128K values per thread */
    if (t > by_size)
        t = (unsigned)by_size;
    return t ? t : 1;
}

int epipe_codec_backend_for(epipe_codec *c, const DLTensor *t, const char *what,
                            const epipe_codec_backend **be)
{
    /* Pinned host memory (kDLCUDAHost) is host memory: the CPU backend
     * reads it. Other devices fall to the CPU backend too, whose tensor
     * check refuses them by name. */
    epipe_codec_device dev = EPIPE_CODEC_DEV_CPU;
    if (t && (t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged))
        dev = EPIPE_CODEC_DEV_CUDA;
    if (t && c->bound_type) {
        int rc = epipe_codec_check_binding(c, t, what);
        if (rc)
            return rc;
    }
    if (dev == EPIPE_CODEC_DEV_CUDA)
        return epipe_codec_cuda_backend(c, t, what, be);
    *be = epipe_codec_backend_of(c->ops, dev);
    if (*be)
        return EPIPE_OK;
    return epipe_codec_fail(c, EPIPE_ENOTSUP, "codec '%s' has no CPU backend in this build",
                            c->ops->name);
}

static int is_cuda(const DLTensor *t)
{
    return t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged;
}

void epipe_codec_note_shape(epipe_codec *c, const DLTensor *t)
{
    c->ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++)
        c->shape[d] = t->shape[d];
}

/* ---- handles ----------------------------------------------------------- */

EPIPE_API int epipe_codec_create(epipe_codec **out, const char *spec)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_create: out is NULL");
    *out = NULL;
    if (!spec)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_create: spec is NULL");
    epipe_codec *c = calloc(1, sizeof *c);
    if (!c)
        return epipe_fail(EPIPE_ENOMEM, "epipe_codec_create: out of memory");
    c->microbatch = -1;
    epipe_codec_cuda_read_env(c);
    int rc = epipe_codec_parse_spec(c, spec);
    if (rc) {
        epipe_codec_destroy(c);
        return rc;
    }
    c->be = epipe_codec_backend_of(c->ops, EPIPE_CODEC_DEV_CPU);
    *out = c;
    return EPIPE_OK;
}

EPIPE_API void epipe_codec_destroy(epipe_codec *c)
{
    if (!c)
        return;
    epipe_codec_cuda_report_unsynced(c); /* first: its checks read the codec's state */
    if (c->ops && c->ops->release)
        c->ops->release(c);
    epipe_codec_ef_release(c);
    epipe_codec_delta_release(c, 1);
    epipe_codec_cuda_release(c);
    epipe_codec_staged_release(c);
    free(c->scratch);
    free(c);
}

EPIPE_API const char *epipe_codec_spec(const epipe_codec *c)
{
    return c ? c->spec : "";
}

EPIPE_API const char *epipe_codec_name(const epipe_codec *c)
{
    return c ? c->ops->name : "";
}

EPIPE_API unsigned epipe_codec_id(const epipe_codec *c)
{
    return c ? (unsigned)c->ops->id : 0;
}

EPIPE_API const char *epipe_codec_last_error(const epipe_codec *c)
{
    return c ? c->msg : "";
}

EPIPE_API int epipe_codec_set_param(epipe_codec *c, epipe_codec_param param, int64_t value)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_set_param: codec is NULL");
    switch (param) {
    case EPIPE_CODEC_THREADS:
        if (value < 0 || value > 256)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "EPIPE_CODEC_THREADS = %lld is out of range 0..256",
                                    (long long)value);
        c->threads = (unsigned)value;
        return EPIPE_OK;
    case EPIPE_CODEC_MICROBATCH:
        if (value < -1 || value > INT32_MAX)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "EPIPE_CODEC_MICROBATCH = %lld is out of range -1..2^31-1",
                                    (long long)value);
        c->microbatch = value;
        return EPIPE_OK;
    }
    return epipe_codec_fail(c, EPIPE_EINVAL, "unknown codec parameter %d", (int)param);
}

EPIPE_API int epipe_codec_get_param(const epipe_codec *c, epipe_codec_param param, int64_t *value)
{
    epipe_clear_error();
    if (!c || !value)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_get_param: codec or value is NULL");
    switch (param) {
    case EPIPE_CODEC_THREADS: *value = c->threads; return EPIPE_OK;
    case EPIPE_CODEC_MICROBATCH: *value = c->microbatch; return EPIPE_OK;
    }
    return epipe_codec_fail((epipe_codec *)c, EPIPE_EINVAL, "unknown codec parameter %d",
                            (int)param);
}

/* "bits, split, mode" for messages. */
static void list_keys(const epipe_codec_ops *ops, char *buf, size_t cap)
{
    buf[0] = '\0';
    for (unsigned k = 0; k < ops->nparams; k++) {
        if (k)
            strncat(buf, ", ", cap - strlen(buf) - 1);
        strncat(buf, ops->params[k].key, cap - strlen(buf) - 1);
    }
    if (epipe_codec_ef_allowed(ops))
        strncat(buf, ops->nparams ? ", ef" : "ef", cap - strlen(buf) - 1);
    if (!buf[0])
        snprintf(buf, cap, "none");
}

static int unknown_key(epipe_codec *c, const epipe_codec_ops *ops, const char *call,
                       const char *key)
{
    char keys[128];
    list_keys(ops, keys, sizeof keys);
    if (ops == &epipe_codec_chain)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: a chain has no parameters of its own; its links' are in "
                                "its spec ('%s')",
                                call, c ? c->spec : "a|b");
    return epipe_codec_fail(c, EPIPE_EINVAL, "%s: codec '%s' has no parameter '%s' (its keys: %s)",
                            call, ops->name, key ? key : "(null)", keys);
}

EPIPE_API int epipe_codec_spec_param(const epipe_codec *c, const char *key, double *value)
{
    epipe_clear_error();
    if (!c || !key || !value)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_spec_param: codec, key or value is NULL");
    if (strcmp(key, "ef") == 0 && epipe_codec_ef_allowed(c->ops)) {
        *value = c->ef;
        return EPIPE_OK;
    }
    if (epipe_codec_delta_key_info(c->ops, key, c, value, NULL, NULL))
        return EPIPE_OK;
    int k = epipe_codec_param_index(c->ops, key);
    if (k < 0)
        return unknown_key((epipe_codec *)c, c->ops, "epipe_codec_spec_param", key);
    *value = c->p[k];
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_param_bounds(const char *codec, const char *key, double *min, double *max)
{
    epipe_clear_error();
    if (!codec || !key || !min || !max)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_param_bounds: an argument is NULL");
    const epipe_codec_ops *ops = epipe_codec_find(codec, strlen(codec));
    if (!ops)
        return epipe_codec_unknown(codec, strlen(codec));
    if (strcmp(key, "ef") == 0 && epipe_codec_ef_allowed(ops)) {
        *min = 0;
        *max = 1;
        return EPIPE_OK;
    }
    if (epipe_codec_delta_key_info(ops, key, NULL, NULL, min, max))
        return EPIPE_OK;
    int k = epipe_codec_param_index(ops, key);
    if (k < 0)
        return unknown_key(NULL, ops, "epipe_codec_param_bounds", key);
    const epipe_param_desc *d = &ops->params[k];
    if (d->kind == EPIPE_PARAM_CHOICE) {
        unsigned n = 0;
        while (d->choices[n])
            n++;
        *min = 0;
        *max = n - 1;
    } else {
        *min = d->min;
        *max = d->max;
    }
    return EPIPE_OK;
}

/* ---- encode and decode ------------------------------------------------- */

static int payload_size(epipe_codec *c, uint64_t n, size_t *bytes)
{
    if (c->delta)
        return epipe_codec_delta_max_size(c, n, bytes);
    size_t body;
    int rc = c->ops->body_size(c, n, &body);
    if (rc == EPIPE_EOVERFLOW)
        return epipe_codec_fail(c, rc, "%s: payload for %llu values overflows size_t", c->ops->name,
                                (unsigned long long)n);
    if (rc)
        return rc; /* the codec said why (a shape it cannot take) */
    if (body > SIZE_MAX - EPIPE_PAYLOAD_HEADER)
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "%s: payload overflows size_t", c->ops->name);
    *bytes = body + EPIPE_PAYLOAD_HEADER;
    return EPIPE_OK;
}

/* The public calls' one check of a tensor: its backend first, so that a
 * CUDA tensor is refused as one (not as a tensor on an unknown device),
 * then its shape, dtype and count. */
static int inspect_for_call(epipe_codec *c, const DLTensor *t, const char *what, uint64_t *n,
                            enum epipe_dtype *dt)
{
    const epipe_codec_backend *be = NULL;
    int rc = epipe_codec_backend_for(c, t, what, &be);
    return rc ? rc : epipe_tensor_inspect_on(t, what, c->msg, n, dt, is_cuda(t));
}

int epipe_codec_size_checked(epipe_codec *c, const DLTensor *t, uint64_t n, size_t *bytes)
{
    const epipe_codec_backend *be = NULL;
    int rc = epipe_codec_backend_for(c, t, "src", &be);
    if (rc)
        return rc;
    epipe_codec_note_shape(c, t);
    return payload_size(c, n, bytes);
}

int epipe_codec_encode_checked(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                               void *dst, size_t capacity, size_t *written)
{
    *written = 0;
    const epipe_codec_backend *be = NULL;
    int rc = epipe_codec_backend_for(c, src, "src", &be);
    if (rc)
        return rc;
    epipe_codec_note_shape(c, src);
    size_t need = 0;
    if ((rc = payload_size(c, n, &need)))
        return rc;
    if (!dst || capacity < need)
        return epipe_codec_fail(c, EPIPE_ENOSPC,
                                "%s: encoding %llu values needs %zu bytes; capacity is %zu",
                                c->ops->name, (unsigned long long)n, need, dst ? capacity : 0);
    if (is_cuda(src)) {
        if (epipe_codec_cuda_staged(c))
            rc = epipe_codec_staged_encode(c, src, n, dt, dst, need, written);
        else {
            /* The header from the host's knowledge; the module writes it
             * and enqueues the body, into host or device memory. */
            uint8_t hdr[EPIPE_PAYLOAD_HEADER];
            epipe_payload_put(hdr, c->ops->id, dt, c->ops->param_word(c), n);
            rc = epipe_codec_cuda_encode(c, be, src, n, dt, dst, hdr, need);
            *written = rc ? 0 : need;
        }
        if (rc == EPIPE_OK)
            epipe_codec_bind(c, src);
        return rc;
    }
    if (epipe_codec_cuda_is_device_memory(dst))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: dst is CUDA device memory, but src is a CPU tensor; encode a "
                                "CPU tensor into host memory",
                                c->ops->name);
    epipe_codec_bind(c, src);
    return epipe_codec_encode_host(c, be, src, n, dt, dst, need, written);
}

void epipe_codec_payload_ident(const epipe_codec *c, unsigned *codec_id, uint32_t *param_word)
{
    *codec_id = c->ops->id;
    *param_word = c->ops->param_word(c);
}

int epipe_codec_encode_host(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                            uint64_t n, enum epipe_dtype dt, uint8_t *h, size_t need,
                            size_t *written)
{
    int rc;
    const float *x;
    if ((rc = epipe_codec_stage_in(c, src, n, dt, &x)))
        return rc;
    epipe_payload_put(h, c->ops->id, dt, c->ops->param_word(c), n);
    if (c->delta)
        return epipe_codec_delta_encode(c, be, x, n, dt, h, written);
    if (c->ef)
        rc = epipe_codec_ef_encode(c, be, x, n, dt, h + EPIPE_PAYLOAD_HEADER);
    else
        rc = (c->use_reference ? be->encode_ref : be->encode)(c, x, n, h + EPIPE_PAYLOAD_HEADER);
    if (rc)
        return rc;
    *written = need;
    return EPIPE_OK;
}

int epipe_codec_decode_checked(epipe_codec *c, const void *src, size_t len, DLTensor *dst,
                               uint64_t n, enum epipe_dtype dt)
{
    const epipe_codec_backend *be = NULL;
    int rc = epipe_codec_backend_for(c, dst, "dst", &be);
    if (rc)
        return rc;
    epipe_codec_note_shape(c, dst);
    if (is_cuda(dst) && epipe_codec_cuda_staged(c))
        rc = epipe_codec_staged_decode(c, src, len, dst, n, dt);
    else
        rc = epipe_codec_decode_with(c, be, src, len, dst, n, dt);
    if (rc == EPIPE_OK) /* the device of the first tensor decoded into */
        epipe_codec_bind(c, dst);
    return rc;
}

int epipe_codec_decode_with(epipe_codec *c, const epipe_codec_backend *be, const void *src,
                            size_t len, DLTensor *dst, uint64_t n, enum epipe_dtype dt)
{
    int rc;
    if (!src && len)
        return epipe_codec_fail(c, EPIPE_EINVAL, "%s: src is NULL", c->ops->name);
    const char *name = c->ops->name;
    /* A device payload of the size its values need, for a codec whose
     * decode kernels read everything they use from the device: launched at
     * once, its header and tables checked at the next synchronize
     * (epipe/codec.h). Any other size takes the checks below at once, in
     * their order. */
    size_t need = 0;
    if (is_cuda(dst) && !c->delta && len >= EPIPE_PAYLOAD_HEADER) {
        int defers = epipe_codec_cuda_defers(c, src);
        if (defers < 0)
            return defers;
        if (defers && payload_size(c, n, &need) == EPIPE_OK && len == need)
            return epipe_codec_cuda_decode(c, be, src, len, n, dst, dt);
    }
    /* Else a CUDA tensor may take its payload from device memory: the header
     * is read from a copy. A CPU tensor needs a host payload. */
    uint8_t hdr[EPIPE_PAYLOAD_HEADER];
    const void *hp = src;
    if (is_cuda(dst) && len >= EPIPE_PAYLOAD_HEADER) {
        int dev; /* dst checked (its device, the stream's) before any copy */
        if ((rc = epipe_codec_cuda_check(c, dst, "dst", &dev)) ||
            (rc = epipe_codec_cuda_peek(c, src, len, n, hdr)))
            return rc;
        hp = hdr;
    } else if (!is_cuda(dst) && epipe_codec_cuda_is_device_memory(src)) {
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: src is CUDA device memory, but dst is a CPU tensor; decode a "
                                "device payload into a CUDA tensor",
                                name);
    }
    if ((rc = epipe_codec_check_payload_header(c, hp, len, n, &need)))
        return rc;
    if (c->delta)
        return epipe_codec_delta_decode(c, be, src, len, dst, n, dt);
    if (len < need)
        return epipe_codec_fail(c, EPIPE_ETRUNC, "%s: payload is %zu bytes; %llu values need %zu",
                                name, len, (unsigned long long)n, need);
    if (len > need)
        return epipe_codec_fail(c, EPIPE_EPROTO, "%s: payload has %zu bytes after its end", name,
                                len - need);
    if (is_cuda(dst))
        return epipe_codec_cuda_decode(c, be, src, len, n, dst, dt);
    float *y;
    if ((rc = epipe_codec_stage_out(c, dst, n, dt, &y)))
        return rc;
    const uint8_t *body = (const uint8_t *)src + EPIPE_PAYLOAD_HEADER;
    if ((rc = (c->use_reference ? be->decode_ref : be->decode)(c, body, n, y)))
        return rc;
    epipe_codec_stage_out_done(dst, y, n);
    return EPIPE_OK;
}

int epipe_codec_check_payload_header(epipe_codec *c, const void *hp, size_t len, uint64_t n,
                                     size_t *need)
{
    const char *name = c->ops->name;
    int rc;
    epipe_payload_header ph;
    if (epipe_payload_get(hp, len, &ph))
        return epipe_codec_fail(c, EPIPE_ETRUNC, "%s: payload is %zu bytes; its header alone is %d",
                                name, len, EPIPE_PAYLOAD_HEADER);
    if (ph.codec_id != (unsigned)c->ops->id)
        return epipe_codec_fail(
            c, EPIPE_EPROTO, "%s: payload was made by codec id %u (%s), not this codec (id %u)",
            name, ph.codec_id, epipe_codec_name_of_id(ph.codec_id), (unsigned)c->ops->id);
    if (ph.version != EPIPE_PAYLOAD_VERSION)
        return epipe_codec_fail(c, EPIPE_EVERSION,
                                "%s: payload format version %u; this library reads %d", name,
                                ph.version, EPIPE_PAYLOAD_VERSION);
    if (ph.dtype > EPIPE_DTYPE_BF16 || ph.reserved != 0)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "%s: payload header has bad dtype %u or reserved byte %u", name,
                                ph.dtype, ph.reserved);
    if ((rc = payload_size(c, n, need))) /* first: a shape the codec cannot take */
        return rc;
    uint32_t mine = c->ops->param_word(c);
    if (ph.param_word != mine)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "%s: payload parameter word 0x%08x differs from this codec's "
                                "0x%08x (%s)",
                                name, ph.param_word, mine, c->spec);
    if (ph.count != n)
        return epipe_codec_fail(c, EPIPE_EINVAL, "%s: payload holds %llu values but dst has %llu",
                                name, (unsigned long long)ph.count, (unsigned long long)n);
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_max_encoded_size(const epipe_codec *codec, const DLTensor *src,
                                           size_t *bytes)
{
    epipe_clear_error();
    if (!codec || !bytes)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_max_encoded_size: codec or bytes is NULL");
    /* Only the per-call shape and the last error are written: the handle's
     * scratch, not its configuration (see the header). */
    epipe_codec *c = (epipe_codec *)codec;
    uint64_t n;
    enum epipe_dtype dt;
    int rc = inspect_for_call(c, src, "src", &n, &dt);
    if (rc)
        return rc;
    return epipe_codec_size_checked(c, src, n, bytes);
}

EPIPE_API int epipe_codec_encode(epipe_codec *c, const DLTensor *src, void *dst, size_t capacity,
                                 size_t *written)
{
    epipe_clear_error();
    if (!c || !written)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_encode: codec or written is NULL");
    *written = 0;
    uint64_t n;
    enum epipe_dtype dt;
    int rc = inspect_for_call(c, src, "src", &n, &dt);
    if (rc)
        return rc;
    return epipe_codec_encode_checked(c, src, n, dt, dst, capacity, written);
}

EPIPE_API int epipe_codec_decode(epipe_codec *c, const void *src, size_t len, DLTensor *dst)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_decode: codec is NULL");
    uint64_t n;
    enum epipe_dtype dt;
    int rc = inspect_for_call(c, dst, "dst", &n, &dt);
    if (rc)
        return rc;
    return epipe_codec_decode_checked(c, src, len, dst, n, dt);
}
