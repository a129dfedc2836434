/* `none`: the values as little-endian fp32, the uncompressed baseline
 * every other codec is measured against. */
#include <string.h>

#include "../lib/codec/codec_impl.h"
#include "../lib/tensor.h"

static uint32_t none_param_word(const epipe_codec *c)
{
    (void)c;
    return 0;
}

static int none_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    (void)c;
    if (n > SIZE_MAX / 4)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)n * 4;
    return EPIPE_OK;
}

static int none_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    (void)c;
    if (n)
        memcpy(body, x, n * 4); /* the build requires a little-endian host */
    return EPIPE_OK;
}

static int none_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    (void)c;
    if (n)
        memcpy(y, body, n * 4);
    return EPIPE_OK;
}

static const epipe_codec_backend none_cpu = {
    .encode = none_encode,
    .decode = none_decode,
};

const epipe_codec_ops epipe_codec_none = {
    .name = "none",
    .id = EPIPE_CODEC_ID_NONE,
    .param_word = none_param_word,
    .body_size = none_body_size,
    .cpu = &none_cpu,
};
