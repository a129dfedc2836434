/* The public calls of trainable codecs (insert, and chains that start with
 * one): handle and tensor checks, then the backend's train ops. */
#include <stdlib.h>
#include <string.h>

#include <epipe/codec.h>

#include "codec_internal.h"
#include "core.h"
#include "cuda_core.h"

static int not_trainable(epipe_codec *c, const char *call)
{
    return epipe_codec_fail(c, EPIPE_ENOTSUP,
                            "%s: codec '%s' has no parameters to train (only insert has)", call,
                            c->ops->name);
}

/* The train ops of backend *be, or EPIPE_ENOTSUP for a codec without them;
 * *be becomes the backend that runs them. */
static int train_ops(epipe_codec *c, const epipe_codec_backend **bep, const char *call,
                     const epipe_codec_train_ops **t)
{
    const epipe_codec_backend *be = *bep;
    if (!c->ops->code_shape)
        return not_trainable(c, call);
    /* A CUDA backend without train ops (none in cuda/ today; the test
     * module's insert): its forward served only calls that kept nothing,
     * the training forward was staged through the CPU backend (cuda.c),
     * whose caches the backward reads, on host copies of CUDA tensors
     * (staging.c). */
    if (be && !be->train && be != c->ops->cpu && c->ops->cpu)
        be = c->ops->cpu;
    if (!be || !be->train)
        return epipe_codec_fail(c, EPIPE_ENOTSUP, "%s: codec '%s' cannot train on this backend",
                                call, c->ops->name);
    *t = be->train;
    *bep = be;
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_trainable(const epipe_codec *c)
{
    return c && c->ops->code_shape ? 1 : 0;
}

EPIPE_API int epipe_codec_code_shape(epipe_codec *c, const DLTensor *src, int *ndim,
                                     int64_t shape[EPIPE_CODEC_MAX_NDIM])
{
    epipe_clear_error();
    if (!c || !src || !ndim || !shape)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_code_shape: an argument is NULL");
    uint64_t n;
    enum epipe_dtype dt;
    int rc = epipe_tensor_inspect_on(src, "src", c->msg, &n, &dt, epipe_tensor_is_cuda(src));
    if (rc)
        return rc;
    if (!c->ops->code_shape) {
        *ndim = src->ndim;
        memcpy(shape, src->shape, sizeof(int64_t) * (size_t)src->ndim);
        return EPIPE_OK;
    }
    return c->ops->code_shape(c, src->shape, src->ndim, shape, ndim);
}

EPIPE_API int epipe_codec_num_tensors(epipe_codec *c, unsigned *count)
{
    epipe_clear_error();
    if (!c || !count)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_num_tensors: codec or count is NULL");
    *count = 0;
    if (!c->ops->code_shape)
        return not_trainable(c, "epipe_codec_num_tensors");
    *count = c->ops->ntensors(c);
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_tensor(epipe_codec *c, unsigned index, const char **name,
                                 DLTensor **param, DLTensor **grad)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_tensor: codec is NULL");
    const epipe_codec_train_ops *t = NULL;
    const epipe_codec_backend *be = c->be;
    int rc = train_ops(c, &be, "epipe_codec_tensor", &t);
    if (rc)
        return rc;
    unsigned count = c->ops->ntensors(c);
    if (index >= count)
        return epipe_codec_fail(c, EPIPE_EINVAL, "%s: tensor index %u; it has %u", c->ops->name,
                                index, count);
    return t->tensor(c, index, name, param, grad);
}

/* Backward from gin (n_in values of dt_in, checked) into gout (checked):
 * on the CUDA module when be is its backend (both tensors are then on
 * the handle's device), else through fp32 host views (the CPU backend, on
 * host copies of CUDA tensors). */
static int backward(epipe_codec *c, const epipe_codec_backend *be, const epipe_codec_train_ops *t,
                    unsigned mb, const DLTensor *gin, const char *in_name, uint64_t n_in,
                    enum epipe_dtype dt_in, DLTensor *gout, const char *out_name, uint64_t n_out,
                    enum epipe_dtype dt_out, int enc)
{
    if (be != c->ops->cpu) {
        if (!epipe_tensor_is_cuda(gout))
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "%s: %s is a CUDA tensor and %s is not; give both on the "
                                    "handle's device",
                                    c->ops->name, in_name, out_name);
        return epipe_codec_cuda_backward(c, be, enc, mb, gin, in_name, n_in, dt_in, gout, out_name,
                                         n_out, dt_out);
    }
    float *a = NULL, *b = NULL, *own_a = NULL, *own_b = NULL;
    int rc = epipe_codec_f32_view(c, gin, in_name, n_in, dt_in, &a, &own_a, 1);
    if (rc == EPIPE_OK &&
        (rc = epipe_codec_f32_view(c, gout, out_name, n_out, dt_out, &b, &own_b, 0)) == EPIPE_OK) {
        rc = enc ? t->encode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape, gout->ndim)
                 : t->decode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape, gout->ndim);
        if (rc == EPIPE_OK)
            rc = epipe_codec_f32_view_done(c, gout, out_name, n_out, dt_out, own_b);
    }
    free(own_a);
    free(own_b);
    return rc;
}

/* The public backward calls: both tensors checked here, once. */
static int backward_entry(epipe_codec *c, const char *call, unsigned mb, const DLTensor *gin,
                          const char *in_name, DLTensor *gout, const char *out_name, int enc)
{
    const epipe_codec_backend *be = NULL;
    const epipe_codec_train_ops *t = NULL;
    uint64_t n_in, n_out;
    enum epipe_dtype dt_in, dt_out;
    int rc;
    if (!c->ops->code_shape)
        return not_trainable(c, call);
    const epipe_codec_backend *be_out = NULL;
    if ((rc = epipe_codec_backend_for(c, gin, in_name, &be)) ||
        (rc = train_ops(c, &be, call, &t)) ||
        (rc = epipe_codec_backend_for(c, gout, out_name, &be_out)) ||
        (rc = epipe_tensor_inspect_on(gin, in_name, c->msg, &n_in, &dt_in,
                                      epipe_tensor_is_cuda(gin))) ||
        (rc = epipe_tensor_inspect_on(gout, out_name, c->msg, &n_out, &dt_out,
                                      epipe_tensor_is_cuda(gout))))
        return rc;
    return backward(c, be, t, mb, gin, in_name, n_in, dt_in, gout, out_name, n_out, dt_out, enc);
}

EPIPE_API int epipe_codec_encode_backward(epipe_codec *c, unsigned microbatch,
                                          const DLTensor *grad_code, DLTensor *grad_input)
{
    epipe_clear_error();
    if (!c || !grad_code || !grad_input)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_encode_backward: an argument is NULL");
    return backward_entry(c, "epipe_codec_encode_backward", microbatch, grad_code, "grad_code",
                          grad_input, "grad_input", 1);
}

EPIPE_API int epipe_codec_decode_backward(epipe_codec *c, unsigned microbatch,
                                          const DLTensor *grad_output, DLTensor *grad_code)
{
    epipe_clear_error();
    if (!c || !grad_output || !grad_code)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_decode_backward: an argument is NULL");
    return backward_entry(c, "epipe_codec_decode_backward", microbatch, grad_output, "grad_output",
                          grad_code, "grad_code", 0);
}

int epipe_codec_decode_backward_checked(epipe_codec *c, unsigned mb, const DLTensor *grad_output,
                                        uint64_t n, enum epipe_dtype dt, DLTensor *grad_code)
{
    const epipe_codec_backend *be = NULL;
    const epipe_codec_train_ops *t = NULL;
    int rc;
    if ((rc = epipe_codec_backend_for(c, grad_output, "grad_output", &be)) ||
        (rc = train_ops(c, &be, "epipe_codec_decode_backward", &t)))
        return rc;
    uint64_t nz = 1;
    for (int d = 0; d < grad_code->ndim; d++)
        nz *= (uint64_t)grad_code->shape[d];
    return backward(c, be, t, mb, grad_output, "grad_output", n, dt, grad_code, "grad_code", nz,
                    EPIPE_DTYPE_F32, 0);
}

EPIPE_API int epipe_codec_zero_grad(epipe_codec *c)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_zero_grad: codec is NULL");
    const epipe_codec_train_ops *t = NULL;
    const epipe_codec_backend *be = c->be;
    int rc = train_ops(c, &be, "epipe_codec_zero_grad", &t);
    if (rc)
        return rc;
    t->zero_grad(c);
    return EPIPE_OK;
}

EPIPE_API int epipe_codec_sgd_step(epipe_codec *c, double lr, double momentum)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_sgd_step: codec is NULL");
    const epipe_codec_train_ops *t = NULL;
    const epipe_codec_backend *be = c->be;
    int rc = train_ops(c, &be, "epipe_codec_sgd_step", &t);
    if (rc)
        return rc;
    if (!(lr >= 0 && lr <= 1e6) || !(momentum >= 0 && momentum < 1))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: sgd lr = %g must be in [0, 1e6] and momentum = %g in [0, 1)",
                                c->ops->name, lr, momentum);
    return t->sgd_step(c, (float)lr, (float)momentum);
}
