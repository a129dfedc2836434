/* The chain "a|b" as a codec of its own: a (trainable) computes the code of
 * the tensor, b encodes the code. Its state holds both links. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../wire/crc32c.h"
#include "codec_internal.h"
#include "core.h"
#include "payload.h"

/* Payload (docs/codecs.md, Chains): the chain's 16-byte header (id 64;
 * parameter word: CRC32C of a's id and word and b's id and word), then as
 * the body a's 16-byte header (its id, the code's dtype f32, a's word, the
 * tensor's count; no body of its own) and b's whole payload for the code. */

struct chain {
    epipe_codec *a, *b;
    float *code; /* a's code, fp32 */
    size_t cap;
};

static struct chain *links(const epipe_codec *c)
{
    return c->state;
}

/* Records link l's failure on the chain: "chain: what (name): why". */
static int fail_from_link(epipe_codec *c, const epipe_codec *l, int rc, const char *what)
{
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", l->msg[0] ? l->msg : epipe_last_error());
    return epipe_codec_fail(c, rc, "chain: %s (%s): %s", what, l->ops->name, why);
}

/* Passes link a's failure on as it is: its calls act for the chain's. */
static int pass(epipe_codec *c, const epipe_codec *a, int rc)
{
    if (rc)
        epipe_codec_fail(c, rc, "%s", a->msg[0] ? a->msg : epipe_last_error());
    return rc;
}

/* Link a sees the chain's call: its shape, micro-batch and threads. */
static epipe_codec *link_a(epipe_codec *c)
{
    epipe_codec *a = links(c)->a;
    a->ndim = c->ndim;
    memcpy(a->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    a->microbatch = c->microbatch;
    a->threads = c->threads;
    links(c)->b->threads = c->threads;
    return a;
}

/* A dense fp32 view of the code of a tensor of c->shape, over the chain's
 * code buffer (grown to fit when `alloc`). */
static int code_view(epipe_codec *c, DLTensor *view, int64_t *shape, size_t *count, int alloc)
{
    struct chain *ch = links(c);
    epipe_codec *a = link_a(c);
    int zn;
    int rc = a->ops->code_shape(a, c->shape, c->ndim, shape, &zn);
    if (rc)
        return pass(c, a, rc);
    size_t nz = 1;
    for (int d = 0; d < zn; d++)
        nz *= (size_t)shape[d];
    if (alloc && ch->cap < nz) {
        float *p = realloc(ch->code, (nz ? nz : 1) * sizeof *p);
        if (!p)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "chain: no memory for %zu code values", nz);
        ch->code = p, ch->cap = nz;
    }
    memset(view, 0, sizeof *view);
    view->data = ch->code;
    view->device.device_type = kDLCPU;
    view->ndim = zn;
    view->dtype.code = kDLFloat;
    view->dtype.bits = 32;
    view->dtype.lanes = 1;
    view->shape = shape;
    *count = nz;
    return EPIPE_OK;
}

/* The size of b's payload for the code of a tensor of c->shape. */
static int inner_size(epipe_codec *c, DLTensor *view, int64_t *shape, size_t *nz, size_t *inner,
                      int alloc)
{
    int rc = code_view(c, view, shape, nz, alloc);
    if (rc)
        return rc;
    epipe_codec *b = links(c)->b;
    if ((rc = epipe_codec_size_checked(b, view, *nz, inner)))
        return fail_from_link(c, b, rc, "sizing the code's payload");
    return EPIPE_OK;
}

static uint32_t chain_word(const epipe_codec *c)
{
    const epipe_codec *a = links(c)->a, *b = links(c)->b;
    uint8_t w[10];
    w[0] = (uint8_t)a->ops->id;
    epipe_put_u32(w + 1, a->ops->param_word(a));
    w[5] = (uint8_t)b->ops->id;
    epipe_put_u32(w + 6, b->ops->param_word(b));
    return epipe_crc32c(0, w, sizeof w);
}

static int chain_body_size(const epipe_codec *cc, uint64_t n, size_t *bytes)
{
    (void)n;
    epipe_codec *c = (epipe_codec *)cc; /* only its message and the links' call shapes */
    DLTensor view;
    int64_t shape[EPIPE_MAX_NDIM];
    size_t nz, inner;
    int rc = inner_size(c, &view, shape, &nz, &inner, 0);
    if (rc)
        return rc;
    if (inner > SIZE_MAX - EPIPE_PAYLOAD_HEADER)
        return EPIPE_EOVERFLOW;
    *bytes = EPIPE_PAYLOAD_HEADER + inner;
    return EPIPE_OK;
}

static int chain_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    DLTensor view;
    int64_t shape[EPIPE_MAX_NDIM];
    size_t nz, inner, written;
    int rc = inner_size(c, &view, shape, &nz, &inner, 1);
    if (rc)
        return rc;
    epipe_codec *a = link_a(c), *b = links(c)->b;
    if ((rc = a->be->train->forward_code(a, x, n, links(c)->code)))
        return pass(c, a, rc);
    epipe_payload_put(body, a->ops->id, EPIPE_DTYPE_F32, a->ops->param_word(a), n);
    if ((rc = epipe_codec_encode_checked(b, &view, nz, EPIPE_DTYPE_F32, body + EPIPE_PAYLOAD_HEADER,
                                         inner, &written)))
        return fail_from_link(c, b, rc, "encoding the code");
    return EPIPE_OK;
}

static int chain_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    DLTensor view;
    int64_t shape[EPIPE_MAX_NDIM];
    size_t nz, inner;
    int rc = inner_size(c, &view, shape, &nz, &inner, 1);
    if (rc)
        return rc;
    epipe_codec *a = link_a(c), *b = links(c)->b;
    epipe_payload_header l;
    epipe_payload_get(body, EPIPE_PAYLOAD_HEADER, &l); /* the body holds it: body_size */
    if (l.codec_id != (unsigned)a->ops->id || l.version != EPIPE_PAYLOAD_VERSION ||
        l.dtype != EPIPE_DTYPE_F32 || l.reserved != 0 || l.param_word != a->ops->param_word(a) ||
        l.count != n)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "chain: the header of link 0 (%s) does not match this chain (id "
                                "%u, version %u, dtype %u, reserved %u, word 0x%08x, count %llu)",
                                a->ops->name, l.codec_id, l.version, l.dtype, l.reserved,
                                l.param_word, (unsigned long long)l.count);
    if ((rc = epipe_codec_decode_checked(b, body + EPIPE_PAYLOAD_HEADER, inner, &view, nz,
                                         EPIPE_DTYPE_F32)))
        return fail_from_link(c, b, rc, "decoding the code");
    float *code = links(c)->code;
    size_t bad = epipe_find_nonfinite(code, nz);
    if (bad < nz)
        return epipe_codec_fail(c, EPIPE_EPROTO, "chain: code value %zu decodes to %g", bad,
                                (double)code[bad]);
    return pass(c, a, a->be->train->restore_code(a, code, y));
}

/* ---- training goes through link a ---------------------------------------- */

static int chain_code_shape(epipe_codec *c, const int64_t *shape, int ndim, int64_t *out,
                            int *out_ndim)
{
    epipe_codec *a = links(c)->a;
    return pass(c, a, a->ops->code_shape(a, shape, ndim, out, out_ndim));
}

static unsigned chain_ntensors(const epipe_codec *c)
{
    const epipe_codec *a = links(c)->a;
    return a->ops->ntensors(a);
}

static int chain_tensor(epipe_codec *c, unsigned i, const char **name, DLTensor **param,
                        DLTensor **grad)
{
    epipe_codec *a = links(c)->a;
    return pass(c, a, a->be->train->tensor(a, i, name, param, grad));
}

static int chain_encode_backward(epipe_codec *c, int64_t mb, const float *grad_code,
                                 const int64_t *code_shape, int code_ndim, float *grad_input,
                                 const int64_t *input_shape, int input_ndim)
{
    epipe_codec *a = link_a(c);
    return pass(c, a,
                a->be->train->encode_backward(a, mb, grad_code, code_shape, code_ndim, grad_input,
                                              input_shape, input_ndim));
}

static int chain_decode_backward(epipe_codec *c, int64_t mb, const float *grad_output,
                                 const int64_t *output_shape, int output_ndim, float *grad_code,
                                 const int64_t *code_shape, int code_ndim)
{
    epipe_codec *a = link_a(c);
    return pass(c, a,
                a->be->train->decode_backward(a, mb, grad_output, output_shape, output_ndim,
                                              grad_code, code_shape, code_ndim));
}

static void chain_zero_grad(epipe_codec *c)
{
    epipe_codec *a = links(c)->a;
    a->be->train->zero_grad(a);
}

static int chain_sgd_step(epipe_codec *c, float lr, float momentum)
{
    epipe_codec *a = links(c)->a;
    return pass(c, a, a->be->train->sgd_step(a, lr, momentum));
}

/* ---- the handle ------------------------------------------------------------ */

/* "a|b": a must be trainable (its code is a tensor), b must not be. */
static int chain_parse(epipe_codec *c, const char *spec)
{
    const char *bar = strchr(spec, '|');
    char first[EPIPE_SPEC_MAX];
    size_t len = (size_t)(bar - spec);
    if (strlen(spec) >= EPIPE_SPEC_MAX)
        return epipe_fail(EPIPE_EINVAL, "codec spec is %zu characters; the limit is %d",
                          strlen(spec), EPIPE_SPEC_MAX - 1);
    if (strchr(bar + 1, '|'))
        return epipe_fail(EPIPE_ENOTSUP, "chains of more than two codecs are not supported ('%s')",
                          spec);
    struct chain *ch = calloc(1, sizeof *ch);
    if (!ch)
        return epipe_fail(EPIPE_ENOMEM, "epipe_codec_create: out of memory");
    c->state = ch;
    memcpy(first, spec, len);
    first[len] = '\0';
    int rc = epipe_codec_create(&ch->a, first);
    if (rc)
        return rc;
    if (!epipe_codec_trainable(ch->a))
        return epipe_fail(EPIPE_ENOTSUP,
                          "chain '%s': only a trainable codec (insert) can start a chain, since "
                          "its code is a tensor the next codec encodes; '%s' is not",
                          spec, first);
    if ((rc = epipe_codec_create(&ch->b, bar + 1)))
        return rc;
    if (epipe_codec_trainable(ch->b))
        return epipe_fail(EPIPE_ENOTSUP, "chain '%s': the second codec must not be trainable",
                          spec);
    if (ch->b->ef)
        return epipe_fail(EPIPE_EINVAL,
                          "chain '%s': ef=1 is not supported inside a chain (the residual "
                          "would be the code's, not the gradient's); give it to a single codec",
                          spec);
    if (ch->b->delta)
        return epipe_fail(EPIPE_EINVAL,
                          "chain '%s': delta=1 is not supported inside a chain (the delta "
                          "would be the code's); give it to a single codec",
                          spec);
    char canon[2 * EPIPE_SPEC_MAX];
    snprintf(canon, sizeof canon, "%s|%s", ch->a->spec, ch->b->spec);
    if (strlen(canon) >= EPIPE_SPEC_MAX)
        return epipe_fail(EPIPE_EINVAL,
                          "chain '%s': its canonical spec is %zu characters; the "
                          "limit is %d",
                          spec, strlen(canon), EPIPE_SPEC_MAX - 1);
    memcpy(c->spec, canon, strlen(canon) + 1);
    return EPIPE_OK;
}

static void chain_release(epipe_codec *c)
{
    struct chain *ch = links(c);
    if (!ch)
        return;
    epipe_codec_destroy(ch->a);
    epipe_codec_destroy(ch->b);
    free(ch->code);
    free(ch);
    c->state = NULL;
}

static const epipe_codec_train_ops chain_train = {
    /* forward_code and restore_code: none, a chain never starts a chain. */
    .tensor = chain_tensor,
    .encode_backward = chain_encode_backward,
    .decode_backward = chain_decode_backward,
    .zero_grad = chain_zero_grad,
    .sgd_step = chain_sgd_step,
};

/* One CPU backend: the links run on their own CPU backends. */
static const epipe_codec_backend chain_cpu = {
    .encode = chain_encode,
    .decode = chain_decode,
    .train = &chain_train,
};

const epipe_codec_ops epipe_codec_chain = {
    .name = "chain",
    .id = EPIPE_CODEC_ID_CHAIN,
    .parse = chain_parse,
    .param_word = chain_word,
    .body_size = chain_body_size,
    .code_shape = chain_code_shape,
    .ntensors = chain_ntensors,
    .release = chain_release,
    .cpu = &chain_cpu,
};
