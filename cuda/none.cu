/* `none` on CUDA: the body is the tensor's fp32 bytes, so encode and
 * decode are one stream-ordered copy between the device and the host body. */
#include "cuda_impl.h"

static int none_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    if (!n)
        return EPIPE_OK;
    return epipe_cuda_check(c,
                            cudaMemcpyAsync(body, x, n * 4, cudaMemcpyDeviceToHost,
                                            epipe_cuda_stream(c)),
                            "copying the body to the host");
}

static int none_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    if (!n)
        return EPIPE_OK;
    return epipe_cuda_check(c,
                            cudaMemcpyAsync(y, body, n * 4, cudaMemcpyHostToDevice,
                                            epipe_cuda_stream(c)),
                            "copying the body to the device");
}

const epipe_codec_backend epipe_cuda_none = {none_encode, none_decode, NULL, NULL, 0, NULL};
