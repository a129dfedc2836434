/* The public codec API: spec parsing, the codec registry, tensor checks,
 * the payload header, and dtype staging around each codec's fp32 core. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/codec.h>

#include "../codecs/codec_impl.h"
#include "codec/payload.h"
#include "error.h"
#include "wire/crc32c.h"
#include "parallel.h"
#include "tensor.h"

static const epipe_codec_ops *const registry[] = {
    &epipe_codec_none,
    &epipe_codec_cast,
    &epipe_codec_quant,
    &epipe_codec_sortquant,
    &epipe_codec_kmeans,
    &epipe_codec_topk,
    &epipe_codec_poweriter,
    &epipe_codec_insert,
};
#define NREGISTRY (sizeof registry / sizeof registry[0])

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
    c->use_reference = on && c->ops->encode_ref && c->ops->decode_ref;
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

size_t epipe_find_nonfinite(const float *x, size_t n)
{
    /* A float is NaN or infinite exactly when its exponent bits are all
     * ones. Testing the bit patterns with integer operations vectorises
     * without reassociating float arithmetic; only a bad block is scanned
     * again for the index. */
    const size_t block = 4096;
    for (size_t b = 0; b < n; b += block) {
        size_t e = b + block < n ? b + block : n;
        uint32_t bad = 0;
        for (size_t i = b; i < e; i++) {
            uint32_t u;
            memcpy(&u, &x[i], sizeof u);
            bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        }
        if (bad)
            for (size_t i = b; i < e; i++)
                if (!isfinite(x[i]))
                    return i;
    }
    return n;
}

/* ---- spec parsing ------------------------------------------------------ */

static const epipe_codec_ops *find_ops(const char *name, size_t len)
{
    for (size_t i = 0; i < NREGISTRY; i++)
        if (strlen(registry[i]->name) == len && memcmp(registry[i]->name, name, len) == 0)
            return registry[i];
    return NULL;
}

static int unknown_codec(const char *name, size_t len)
{
    char known[160] = "";
    for (size_t i = 0; i < NREGISTRY; i++) {
        strncat(known, registry[i]->name, sizeof known - strlen(known) - 1);
        if (i + 1 < NREGISTRY)
            strncat(known, ", ", sizeof known - strlen(known) - 1);
    }
    return epipe_fail(EPIPE_EINVAL, "unknown codec '%.*s' (known: %s)", (int)len, name, known);
}

static int parse_value(const epipe_codec_ops *ops, const epipe_param_desc *d, const char *v,
                       size_t vlen, double *out)
{
    char buf[64];
    if (vlen == 0)
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' has an empty value", ops->name, d->key);
    if (vlen >= sizeof buf)
        return epipe_fail(EPIPE_EINVAL, "%s: value of key '%s' is too long", ops->name, d->key);
    memcpy(buf, v, vlen);
    buf[vlen] = '\0';
    if (d->kind == EPIPE_PARAM_CHOICE) {
        char options[96] = "";
        for (unsigned i = 0; d->choices[i]; i++) {
            if (strcmp(buf, d->choices[i]) == 0) {
                *out = i;
                return EPIPE_OK;
            }
            strncat(options, i ? "|" : "", sizeof options - strlen(options) - 1);
            strncat(options, d->choices[i], sizeof options - strlen(options) - 1);
        }
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%s' is not one of %s", ops->name,
                          d->key, buf, options);
    }
    char *end;
    double x = strtod(buf, &end);
    if (*end != '\0' || !isfinite(x) || buf[0] == ' ')
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%s' is not a number", ops->name, d->key,
                          buf);
    if (d->kind == EPIPE_PARAM_INT && x != floor(x))
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%s' is not an integer", ops->name,
                          d->key, buf);
    if (x < d->min || x > d->max) {
        if (d->kind == EPIPE_PARAM_INT)
            return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = %s is out of range %.0f..%.0f",
                              ops->name, d->key, buf, d->min, d->max);
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = %s is out of range [%g, %g]", ops->name,
                          d->key, buf, d->min, d->max);
    }
    *out = x;
    return EPIPE_OK;
}

/* Writes a real so that strtod gives back exactly the same double. */
static void format_real(char *buf, size_t cap, double x)
{
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, x);
        if (strtod(buf, NULL) == x)
            return;
    }
}

static void build_canonical_spec(epipe_codec *c)
{
    const epipe_codec_ops *ops = c->ops;
    size_t len = (size_t)snprintf(c->spec, sizeof c->spec, "%s", ops->name);
    for (unsigned i = 0; i < ops->nparams && len < sizeof c->spec; i++) {
        const epipe_param_desc *d = &ops->params[i];
        char val[40];
        if (d->kind == EPIPE_PARAM_CHOICE)
            snprintf(val, sizeof val, "%s", d->choices[(int)c->p[i]]);
        else if (d->kind == EPIPE_PARAM_INT)
            snprintf(val, sizeof val, "%.0f", c->p[i]);
        else
            format_real(val, sizeof val, c->p[i]);
        len += (size_t)snprintf(c->spec + len, sizeof c->spec - len, "%c%s=%s", i ? ',' : ':',
                                d->key, val);
    }
}

static int parse_spec(epipe_codec *c, const char *spec)
{
    size_t total = strlen(spec);
    if (total == 0)
        return epipe_fail(EPIPE_EINVAL, "codec spec is empty");
    if (total >= EPIPE_SPEC_MAX)
        return epipe_fail(EPIPE_EINVAL, "codec spec is %zu characters; the limit is %d", total,
                          EPIPE_SPEC_MAX - 1);
    const char *colon = strchr(spec, ':');
    size_t nlen = colon ? (size_t)(colon - spec) : total;
    const epipe_codec_ops *ops = find_ops(spec, nlen);
    if (!ops)
        return unknown_codec(spec, nlen);
    c->ops = ops;
    int set[EPIPE_CODEC_MAX_PARAMS] = {0};
    if (colon) {
        const char *p = colon + 1;
        if (*p == '\0')
            return epipe_fail(EPIPE_EINVAL, "%s: nothing after ':'", ops->name);
        for (;;) {
            const char *comma = strchr(p, ',');
            size_t ilen = comma ? (size_t)(comma - p) : strlen(p);
            const char *eq = memchr(p, '=', ilen);
            if (ilen == 0)
                return epipe_fail(EPIPE_EINVAL, "%s: empty parameter in '%s'", ops->name, spec);
            if (!eq)
                return epipe_fail(EPIPE_EINVAL, "%s: parameter '%.*s' has no '=value'",
                                  ops->name, (int)ilen, p);
            size_t klen = (size_t)(eq - p);
            unsigned k = 0;
            while (k < ops->nparams &&
                   !(strlen(ops->params[k].key) == klen && memcmp(ops->params[k].key, p, klen) == 0))
                k++;
            if (k == ops->nparams)
                return epipe_fail(EPIPE_EINVAL, "%s: unknown key '%.*s'", ops->name, (int)klen, p);
            if (set[k])
                return epipe_fail(EPIPE_EINVAL, "%s: key '%s' is given twice", ops->name,
                                  ops->params[k].key);
            int rc = parse_value(ops, &ops->params[k], eq + 1, ilen - klen - 1, &c->p[k]);
            if (rc)
                return rc;
            set[k] = 1;
            if (!comma)
                break;
            p = comma + 1;
        }
    }
    for (unsigned k = 0; k < ops->nparams; k++)
        if (!set[k])
            c->p[k] = ops->params[k].def;
    if (ops->configure) {
        int rc = ops->configure(c);
        if (rc)
            return rc;
    }
    return EPIPE_OK;
}

/* ---- handles ----------------------------------------------------------- */

/* "a|b": a must be trainable (its code is a tensor), b must not be. */
static int create_chain(epipe_codec **out, const char *spec, const char *bar)
{
    char first[EPIPE_SPEC_MAX];
    size_t len = (size_t)(bar - spec);
    if (strlen(spec) >= EPIPE_SPEC_MAX)
        return epipe_fail(EPIPE_EINVAL, "codec spec is %zu characters; the limit is %d",
                          strlen(spec), EPIPE_SPEC_MAX - 1);
    if (strchr(bar + 1, '|'))
        return epipe_fail(EPIPE_ENOTSUP, "chains of more than two codecs are not supported ('%s')",
                          spec);
    memcpy(first, spec, len);
    first[len] = '\0';
    epipe_codec *a = NULL, *b = NULL;
    int rc = epipe_codec_create(&a, first);
    if (rc)
        return rc;
    if (!epipe_codec_trainable(a)) {
        epipe_codec_destroy(a);
        return epipe_fail(EPIPE_ENOTSUP,
                          "chain '%s': only a trainable codec (insert) can start a chain, since "
                          "its code is a tensor the next codec encodes; '%s' is not",
                          spec, first);
    }
    if ((rc = epipe_codec_create(&b, bar + 1))) {
        epipe_codec_destroy(a);
        return rc;
    }
    if (epipe_codec_trainable(b)) {
        epipe_codec_destroy(a), epipe_codec_destroy(b);
        return epipe_fail(EPIPE_ENOTSUP, "chain '%s': the second codec must not be trainable",
                          spec);
    }
    char canon[2 * EPIPE_SPEC_MAX];
    snprintf(canon, sizeof canon, "%s|%s", a->spec, b->spec);
    if (strlen(canon) >= EPIPE_SPEC_MAX) {
        epipe_codec_destroy(a), epipe_codec_destroy(b);
        return epipe_fail(EPIPE_EINVAL, "chain '%s': its canonical spec is %zu characters; the "
                          "limit is %d", spec, strlen(canon), EPIPE_SPEC_MAX - 1);
    }
    memcpy(a->spec, canon, strlen(canon) + 1);
    a->next = b;
    *out = a;
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_create(epipe_codec **out, const char *spec)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_create: out is NULL");
    *out = NULL;
    if (!spec)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_create: spec is NULL");
    const char *bar = strchr(spec, '|');
    if (bar)
        return create_chain(out, spec, bar);
    epipe_codec *c = calloc(1, sizeof *c);
    if (!c)
        return epipe_fail(EPIPE_ENOMEM, "epipe_codec_create: out of memory");
    c->microbatch = -1;
    int rc = parse_spec(c, spec);
    if (rc) {
        epipe_codec_destroy(c);
        return rc;
    }
    build_canonical_spec(c);
    *out = c;
    return EPIPE_OK;
}

EPIPE_API void epipe_codec_destroy(epipe_codec *c)
{
    if (!c)
        return;
    if (c->ops && c->ops->release)
        c->ops->release(c);
    epipe_codec_destroy(c->next);
    free(c->chain_code);
    free(c->scratch);
    free(c);
}

EPIPE_API const char *epipe_codec_spec(const epipe_codec *c)
{
    return c ? c->spec : "";
}

EPIPE_API const char *epipe_codec_name(const epipe_codec *c)
{
    return c ? c->next ? "chain" : c->ops->name : "";
}

EPIPE_API unsigned epipe_codec_id(const epipe_codec *c)
{
    return c ? c->next ? (unsigned)EPIPE_CODEC_ID_CHAIN : (unsigned)c->ops->id : 0;
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
        if (c->next)
            c->next->threads = (unsigned)value;
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

/* ---- encode and decode ------------------------------------------------- */

static void note_shape(epipe_codec *c, const DLTensor *t)
{
    c->ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++)
        c->shape[d] = t->shape[d];
}

static int payload_size(epipe_codec *c, uint64_t n, size_t *bytes)
{
    size_t body;
    int rc = c->ops->body_size(c, n, &body);
    if (rc == EPIPE_EOVERFLOW)
        return epipe_codec_fail(c, rc, "%s: payload for %llu values overflows size_t",
                                c->ops->name, (unsigned long long)n);
    if (rc)
        return rc; /* the codec said why (a shape it cannot take) */
    if (body > SIZE_MAX - EPIPE_PAYLOAD_HEADER)
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "%s: payload overflows size_t", c->ops->name);
    *bytes = body + EPIPE_PAYLOAD_HEADER;
    return EPIPE_OK;
}

static float *scratch(epipe_codec *c, size_t n)
{
    if (c->scratch_cap < n) {
        float *p = realloc(c->scratch, n * sizeof *p);
        if (!p)
            return NULL;
        c->scratch = p;
        c->scratch_cap = n;
    }
    return c->scratch;
}


/* ---- chains ------------------------------------------------------------
 * "a|b": a (trainable) computes the code of the tensor, b encodes the code.
 * Payload: the chain's 16-byte header (id 64; parameter word: CRC32C of
 * a's id and word and b's id and word), a's 16-byte header (its id, the
 * code's dtype f32, a's word, the tensor's count; no body), then b's whole
 * payload for the code. docs/codecs.md, Chains. */

#define CHAIN_HEADERS (2 * EPIPE_PAYLOAD_HEADER)

static const char *codec_name_of_id(unsigned id);

static void fail_from_link(epipe_codec *c, int rc, const char *what)
{
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", c->next->msg[0] ? c->next->msg : epipe_last_error());
    epipe_codec_fail(c, rc, "chain: %s (%s): %s", what, c->next->ops->name, why);
}

/* A dense fp32 view of the code of a tensor of c->shape, over c->chain_code
 * (grown to fit). */
static int chain_code_view(epipe_codec *c, DLTensor *view, int64_t *shape, size_t *count)
{
    int zn;
    int rc = c->ops->train->code_shape(c, c->shape, c->ndim, shape, &zn);
    if (rc)
        return rc;
    size_t nz = 1;
    for (int d = 0; d < zn; d++)
        nz *= (size_t)shape[d];
    if (c->chain_cap < nz) {
        float *p = realloc(c->chain_code, (nz ? nz : 1) * sizeof *p);
        if (!p)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "chain: no memory for %zu code values", nz);
        c->chain_code = p, c->chain_cap = nz;
    }
    memset(view, 0, sizeof *view);
    view->data = c->chain_code;
    view->device.device_type = kDLCPU;
    view->ndim = zn;
    view->dtype.code = kDLFloat;
    view->dtype.bits = 32;
    view->dtype.lanes = 1;
    view->shape = shape;
    note_shape(c->next, view);
    *count = nz;
    return EPIPE_OK;
}

static uint32_t chain_word(const epipe_codec *c)
{
    uint8_t b[10];
    b[0] = (uint8_t)c->ops->id;
    epipe_put_u32(b + 1, c->ops->param_word(c));
    b[5] = (uint8_t)c->next->ops->id;
    epipe_put_u32(b + 6, c->next->ops->param_word(c->next));
    return epipe_crc32c(0, b, sizeof b);
}

static int chain_size(epipe_codec *c, const DLTensor *src, size_t *bytes)
{
    (void)src;
    DLTensor view;
    int64_t shape[EPIPE_MAX_NDIM];
    size_t nz, inner;
    int rc = chain_code_view(c, &view, shape, &nz);
    if (rc)
        return rc;
    if ((rc = epipe_codec_max_encoded_size(c->next, &view, &inner))) {
        fail_from_link(c, rc, "sizing the code's payload");
        return rc;
    }
    if (inner > SIZE_MAX - CHAIN_HEADERS)
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "chain: payload overflows size_t");
    *bytes = inner + CHAIN_HEADERS;
    return EPIPE_OK;
}

static int chain_encode(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                        void *dst, size_t capacity, size_t *written)
{
    size_t need = 0;
    int rc = chain_size(c, src, &need);
    if (rc)
        return rc;
    if (!dst || capacity < need)
        return epipe_codec_fail(c, EPIPE_ENOSPC,
                                "chain: encoding %llu values needs %zu bytes; capacity is %zu",
                                (unsigned long long)n, need, dst ? capacity : 0);
    DLTensor view;
    int64_t shape[EPIPE_MAX_NDIM];
    size_t nz, inner;
    if ((rc = chain_code_view(c, &view, shape, &nz)))
        return rc;
    const float *x;
    if (dt == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(src)) {
        x = (const float *)((const char *)src->data + src->byte_offset);
    } else {
        float *s = scratch(c, n);
        if (!s && n)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "chain: no memory to stage %llu values",
                                    (unsigned long long)n);
        epipe_tensor_read_f32(src, s, n);
        x = s;
    }
    if ((rc = c->ops->train->forward_code(c, x, n, c->chain_code)))
        return rc;
    uint8_t *h = dst;
    epipe_payload_put(h, EPIPE_CODEC_ID_CHAIN, dt, chain_word(c), n);
    epipe_payload_put(h + EPIPE_PAYLOAD_HEADER, c->ops->id, EPIPE_DTYPE_F32, c->ops->param_word(c), n);
    if ((rc = epipe_codec_encode(c->next, &view, h + CHAIN_HEADERS, capacity - CHAIN_HEADERS,
                                 &inner))) {
        fail_from_link(c, rc, "encoding the code");
        return rc;
    }
    *written = CHAIN_HEADERS + inner;
    return EPIPE_OK;
}

static int chain_decode(epipe_codec *c, const uint8_t *h, size_t len, DLTensor *dst, uint64_t n)
{
    if (len < CHAIN_HEADERS)
        return epipe_codec_fail(c, EPIPE_ETRUNC,
                                "chain: payload is %zu bytes; its two headers alone are %d", len,
                                CHAIN_HEADERS);
    if (h[0] != EPIPE_CODEC_ID_CHAIN)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "chain: payload was made by codec id %u (%s), not a chain (id %d)",
                                h[0], codec_name_of_id(h[0]), EPIPE_CODEC_ID_CHAIN);
    if (h[1] != EPIPE_PAYLOAD_VERSION)
        return epipe_codec_fail(c, EPIPE_EVERSION,
                                "chain: payload format version %u; this library reads %d", h[1],
                                EPIPE_PAYLOAD_VERSION);
    if (h[2] > EPIPE_DTYPE_BF16 || h[3] != 0)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "chain: payload header has bad dtype %u or reserved byte %u", h[2],
                                h[3]);
    DLTensor view;
    int64_t shape[EPIPE_MAX_NDIM];
    size_t nz;
    int rc = chain_code_view(c, &view, shape, &nz);
    if (rc)
        return rc;
    uint32_t word = epipe_get_u32(h + 4), mine = chain_word(c);
    if (word != mine)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "chain: payload parameter word 0x%08x differs from this chain's "
                                "0x%08x (%s)",
                                word, mine, c->spec);
    if (epipe_get_u64(h + 8) != n)
        return epipe_codec_fail(c, EPIPE_EINVAL, "chain: payload holds %llu values but dst has %llu",
                                (unsigned long long)epipe_get_u64(h + 8), (unsigned long long)n);
    const uint8_t *l = h + EPIPE_PAYLOAD_HEADER;
    if (l[0] != (uint8_t)c->ops->id || l[1] != EPIPE_PAYLOAD_VERSION || l[2] != EPIPE_DTYPE_F32 ||
        l[3] != 0 || epipe_get_u32(l + 4) != c->ops->param_word(c) || epipe_get_u64(l + 8) != n)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "chain: the header of link 0 (%s) does not match this chain (id "
                                "%u, version %u, dtype %u, reserved %u, word 0x%08x, count %llu)",
                                c->ops->name, l[0], l[1], l[2], l[3], epipe_get_u32(l + 4),
                                (unsigned long long)epipe_get_u64(l + 8));
    if ((rc = epipe_codec_decode(c->next, h + CHAIN_HEADERS, len - CHAIN_HEADERS, &view))) {
        fail_from_link(c, rc, "decoding the code");
        return rc;
    }
    size_t bad = epipe_find_nonfinite(c->chain_code, nz);
    if (bad < nz)
        return epipe_codec_fail(c, EPIPE_EPROTO, "chain: code value %zu decodes to %g", bad,
                                (double)c->chain_code[bad]);
    enum epipe_dtype dt;
    uint64_t count;
    epipe_tensor_inspect(dst, "dst", NULL, &count, &dt);
    if (dt == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(dst))
        return c->ops->train->restore_code(c, c->chain_code,
                                           (float *)((char *)dst->data + dst->byte_offset));
    float *s = scratch(c, n);
    if (!s && n)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "chain: no memory to stage %llu values",
                                (unsigned long long)n);
    if ((rc = c->ops->train->restore_code(c, c->chain_code, s)))
        return rc;
    epipe_tensor_write_f32(dst, s, n);
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_max_encoded_size(epipe_codec *c, const DLTensor *src, size_t *bytes)
{
    epipe_clear_error();
    if (!c || !bytes)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_max_encoded_size: codec or bytes is NULL");
    uint64_t n;
    enum epipe_dtype dt;
    int rc = epipe_tensor_inspect(src, "src", c->msg, &n, &dt);
    if (rc)
        return rc;
    note_shape(c, src);
    if (c->next)
        return chain_size(c, src, bytes);
    return payload_size(c, n, bytes);
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
    int rc = epipe_tensor_inspect(src, "src", c->msg, &n, &dt);
    if (rc)
        return rc;
    note_shape(c, src);
    if (c->next)
        return chain_encode(c, src, n, dt, dst, capacity, written);
    size_t need = 0;
    if ((rc = payload_size(c, n, &need)))
        return rc;
    if (!dst || capacity < need)
        return epipe_codec_fail(c, EPIPE_ENOSPC,
                                "%s: encoding %llu values needs %zu bytes; capacity is %zu",
                                c->ops->name, (unsigned long long)n, need, dst ? capacity : 0);
    const float *x;
    if (dt == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(src)) {
        x = (const float *)((const char *)src->data + src->byte_offset);
    } else {
        float *s = scratch(c, n);
        if (!s && n)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: no memory to stage %llu values",
                                    c->ops->name, (unsigned long long)n);
        epipe_tensor_read_f32(src, s, n);
        x = s;
    }
    uint8_t *h = dst;
    epipe_payload_put(h, c->ops->id, dt, c->ops->param_word(c), n);
    if ((rc = (c->use_reference ? c->ops->encode_ref : c->ops->encode)(c, x, n,
                                                                      h + EPIPE_PAYLOAD_HEADER)))
        return rc;
    *written = need;
    return EPIPE_OK;
}

static const char *codec_name_of_id(unsigned id)
{
    if (id == EPIPE_CODEC_ID_CHAIN)
        return "chain";
    for (size_t i = 0; i < NREGISTRY; i++)
        if ((unsigned)registry[i]->id == id)
            return registry[i]->name;
    return "unknown";
}

EPIPE_API int epipe_codec_decode(epipe_codec *c, const void *src, size_t len, DLTensor *dst)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_decode: codec is NULL");
    uint64_t n;
    enum epipe_dtype dt;
    int rc = epipe_tensor_inspect(dst, "dst", c->msg, &n, &dt);
    if (rc)
        return rc;
    note_shape(c, dst);
    if (!src && len)
        return epipe_codec_fail(c, EPIPE_EINVAL, "%s: src is NULL", c->ops->name);
    if (c->next)
        return chain_decode(c, src, len, dst, n);
    const uint8_t *h = src;
    if (len < EPIPE_PAYLOAD_HEADER)
        return epipe_codec_fail(c, EPIPE_ETRUNC, "%s: payload is %zu bytes; its header alone is %d",
                                c->ops->name, len, EPIPE_PAYLOAD_HEADER);
    if (h[0] != (uint8_t)c->ops->id)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "%s: payload was made by codec id %u (%s), not this codec (id %u)",
                                c->ops->name, h[0], codec_name_of_id(h[0]), (unsigned)c->ops->id);
    if (h[1] != EPIPE_PAYLOAD_VERSION)
        return epipe_codec_fail(c, EPIPE_EVERSION, "%s: payload format version %u; this library reads %d",
                                c->ops->name, h[1], EPIPE_PAYLOAD_VERSION);
    if (h[2] > EPIPE_DTYPE_BF16 || h[3] != 0)
        return epipe_codec_fail(c, EPIPE_EPROTO, "%s: payload header has bad dtype %u or reserved byte %u",
                                c->ops->name, h[2], h[3]);
    size_t need = 0;
    if ((rc = payload_size(c, n, &need))) /* first: a shape the codec cannot take */
        return rc;
    uint32_t word = epipe_get_u32(h + 4), mine = c->ops->param_word(c);
    if (word != mine)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "%s: payload parameter word 0x%08x differs from this codec's 0x%08x (%s)",
                                c->ops->name, word, mine, c->spec);
    uint64_t count = epipe_get_u64(h + 8);
    if (count != n)
        return epipe_codec_fail(c, EPIPE_EINVAL, "%s: payload holds %llu values but dst has %llu",
                                c->ops->name, (unsigned long long)count, (unsigned long long)n);
    if (len < need)
        return epipe_codec_fail(c, EPIPE_ETRUNC, "%s: payload is %zu bytes; %llu values need %zu",
                                c->ops->name, len, (unsigned long long)n, need);
    if (len > need)
        return epipe_codec_fail(c, EPIPE_EPROTO, "%s: payload has %zu bytes after its end",
                                c->ops->name, len - need);
    const uint8_t *body = h + EPIPE_PAYLOAD_HEADER;
    int (*decode)(epipe_codec *, const uint8_t *, size_t, float *) =
        c->use_reference ? c->ops->decode_ref : c->ops->decode;
    if (dt == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(dst))
        return decode(c, body, n, (float *)((char *)dst->data + dst->byte_offset));
    float *s = scratch(c, n);
    if (!s && n)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: no memory to stage %llu values",
                                c->ops->name, (unsigned long long)n);
    if ((rc = decode(c, body, n, s)))
        return rc;
    epipe_tensor_write_f32(dst, s, n);
    return EPIPE_OK;
}

/* ---- trainable codecs --------------------------------------------------- */

static int not_trainable(epipe_codec *c, const char *call)
{
    return epipe_codec_fail(c, EPIPE_ENOTSUP,
                            "%s: codec '%s' has no parameters to train (only insert has)", call,
                            c->ops->name);
}

EPIPE_API int epipe_codec_trainable(const epipe_codec *c)
{
    return c && c->ops->train ? 1 : 0;
}

EPIPE_API int epipe_codec_code_shape(epipe_codec *c, const DLTensor *src, int *ndim,
                                     int64_t shape[EPIPE_CODEC_MAX_NDIM])
{
    epipe_clear_error();
    if (!c || !src || !ndim || !shape)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_code_shape: an argument is NULL");
    uint64_t n;
    enum epipe_dtype dt;
    int rc = epipe_tensor_inspect(src, "src", c->msg, &n, &dt);
    if (rc)
        return rc;
    if (!c->ops->train) {
        *ndim = src->ndim;
        memcpy(shape, src->shape, sizeof(int64_t) * (size_t)src->ndim);
        return EPIPE_OK;
    }
    return c->ops->train->code_shape(c, src->shape, src->ndim, shape, ndim);
}

EPIPE_API int epipe_codec_num_tensors(epipe_codec *c, unsigned *count)
{
    epipe_clear_error();
    if (!c || !count)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_num_tensors: codec or count is NULL");
    *count = 0;
    if (!c->ops->train)
        return not_trainable(c, "epipe_codec_num_tensors");
    *count = c->ops->train->ntensors;
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_tensor(epipe_codec *c, unsigned index, const char **name,
                                 DLTensor **param, DLTensor **grad)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_tensor: codec is NULL");
    if (!c->ops->train)
        return not_trainable(c, "epipe_codec_tensor");
    if (index >= c->ops->train->ntensors)
        return epipe_codec_fail(c, EPIPE_EINVAL, "%s: tensor index %u; it has %u", c->ops->name,
                                index, c->ops->train->ntensors);
    return c->ops->train->tensor(c, index, name, param, grad);
}

/* A dense fp32 view of t: t's own memory when it is dense fp32, else a
 * fresh buffer (*owned) filled from t when `fill`. */
static int f32_view(epipe_codec *c, const DLTensor *t, const char *what, float **out,
                    float **owned, int fill)
{
    uint64_t n;
    enum epipe_dtype dt;
    int rc = epipe_tensor_inspect(t, what, c->msg, &n, &dt);
    if (rc)
        return rc;
    *owned = NULL;
    if (dt == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(t)) {
        *out = (float *)((char *)t->data + t->byte_offset);
        return EPIPE_OK;
    }
    if (n > SIZE_MAX / sizeof(float) || !(*owned = malloc(n ? (size_t)n * sizeof(float) : 1)))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: no memory to stage %s", c->ops->name, what);
    if (fill)
        epipe_tensor_read_f32(t, *owned, (size_t)n);
    *out = *owned;
    return EPIPE_OK;
}

static int backward(epipe_codec *c, unsigned mb, const DLTensor *gin, const char *in_name,
                    DLTensor *gout, const char *out_name, int enc)
{
    float *a = NULL, *b = NULL, *own_a = NULL, *own_b = NULL;
    int rc = f32_view(c, gin, in_name, &a, &own_a, 1);
    if (rc == EPIPE_OK && (rc = f32_view(c, gout, out_name, &b, &own_b, 0)) == EPIPE_OK) {
        const epipe_codec_train_ops *t = c->ops->train;
        rc = enc ? t->encode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape, gout->ndim)
                 : t->decode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape, gout->ndim);
        if (rc == EPIPE_OK && own_b) {
            uint64_t n = 1;
            for (int d = 0; d < gout->ndim; d++)
                n *= (uint64_t)gout->shape[d];
            epipe_tensor_write_f32(gout, own_b, (size_t)n);
        }
    }
    free(own_a);
    free(own_b);
    return rc;
}

EPIPE_API int epipe_codec_encode_backward(epipe_codec *c, unsigned microbatch,
                                          const DLTensor *grad_code, DLTensor *grad_input)
{
    epipe_clear_error();
    if (!c || !grad_code || !grad_input)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_encode_backward: an argument is NULL");
    if (!c->ops->train)
        return not_trainable(c, "epipe_codec_encode_backward");
    return backward(c, microbatch, grad_code, "grad_code", grad_input, "grad_input", 1);
}

EPIPE_API int epipe_codec_decode_backward(epipe_codec *c, unsigned microbatch,
                                          const DLTensor *grad_output, DLTensor *grad_code)
{
    epipe_clear_error();
    if (!c || !grad_output || !grad_code)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_decode_backward: an argument is NULL");
    if (!c->ops->train)
        return not_trainable(c, "epipe_codec_decode_backward");
    return backward(c, microbatch, grad_output, "grad_output", grad_code, "grad_code", 0);
}

EPIPE_API int epipe_codec_zero_grad(epipe_codec *c)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_zero_grad: codec is NULL");
    if (!c->ops->train)
        return not_trainable(c, "epipe_codec_zero_grad");
    c->ops->train->zero_grad(c);
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_sgd_step(epipe_codec *c, double lr, double momentum)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_sgd_step: codec is NULL");
    if (!c->ops->train)
        return not_trainable(c, "epipe_codec_sgd_step");
    if (!(lr >= 0 && lr <= 1e6) || !(momentum >= 0 && momentum < 1))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: sgd lr = %g must be in [0, 1e6] and momentum = %g in [0, 1)",
                                c->ops->name, lr, momentum);
    return c->ops->train->sgd_step(c, (float)lr, (float)momentum);
}
