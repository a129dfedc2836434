/* `none` on CUDA: the body is the tensor's fp32 bytes, so encode and
 * decode are one stream-ordered copy between the tensor and the body
 * (host or device memory). */
#include "cuda_impl.h"

static int none_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if (!n)
        return EPIPE_OK;
    uint8_t *dev = epipe_cuda_h(c)->dev_body;
    return epipe_cuda_check(c,
                            cudaMemcpyAsync(dev ? dev : body, x, n * 4,
                                            dev ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost,
                                            epipe_cuda_stream(c)),
                            "copying the body out");
}

static int none_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    if (!n)
        return EPIPE_OK;
    const uint8_t *dev = epipe_cuda_h(c)->dev_body;
    return epipe_cuda_check(c,
                            cudaMemcpyAsync(y, dev ? dev : body, n * 4,
                                            dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice,
                                            epipe_cuda_stream(c)),
                            "copying the body in");
}

const epipe_codec_backend epipe_cuda_none = {none_encode, none_decode, NULL, NULL, 0, NULL};
