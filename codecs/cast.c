/* `cast:dtype=fp16|bf16`: each value rounded to nearest even in a 16-bit
 * float type, halving the bytes with no other change. A finite value
 * beyond the type's range saturates to its largest finite value (fp16
 * 65504, bf16 about 3.39e38) instead of becoming infinity; infinities and
 * NaN stay what they are. */
#include <math.h>

#include "../lib/codec/codec_impl.h"
#include "../lib/tensor.h"

enum { CAST_DTYPE };
enum { CAST_FP16, CAST_BF16 };

static const char *const cast_dtypes[] = {"fp16", "bf16", NULL};

static const epipe_param_desc cast_params[] = {
    {.key = "dtype", .kind = EPIPE_PARAM_CHOICE, .def = CAST_FP16, .choices = cast_dtypes},
};

static uint32_t cast_param_word(const epipe_codec *c)
{
    return (uint32_t)c->p[CAST_DTYPE];
}

static int cast_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    (void)c;
    if (n > SIZE_MAX / 2)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)n * 2;
    return EPIPE_OK;
}

/* Bit patterns of the 16-bit types: infinity and the largest finite. */
#define F16_INF 0x7c00u
#define F16_MAX 0x7bffu
#define BF16_INF 0x7f80u
#define BF16_MAX 0x7f7fu

static int cast_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    int bf16 = (int)c->p[CAST_DTYPE] == CAST_BF16;
    uint16_t inf = bf16 ? BF16_INF : F16_INF, max = bf16 ? BF16_MAX : F16_MAX;
    for (size_t i = 0; i < n; i++) {
        uint16_t h = bf16 ? epipe_f32_to_bf16(x[i]) : epipe_f32_to_f16(x[i]);
        if ((h & 0x7fffu) == inf && isfinite(x[i])) /* rounded past the range */
            h = (uint16_t)((h & 0x8000u) | max);
        body[2 * i] = (uint8_t)h;
        body[2 * i + 1] = (uint8_t)(h >> 8);
    }
    return EPIPE_OK;
}

static int cast_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    int bf16 = (int)c->p[CAST_DTYPE] == CAST_BF16;
    for (size_t i = 0; i < n; i++) {
        uint16_t h = (uint16_t)(body[2 * i] | body[2 * i + 1] << 8);
        y[i] = bf16 ? epipe_bf16_to_f32(h) : epipe_f16_to_f32(h);
    }
    return EPIPE_OK;
}

static const epipe_codec_backend cast_cpu = {
    .encode = cast_encode,
    .decode = cast_decode,
};

const epipe_codec_ops epipe_codec_cast = {
    .name = "cast",
    .id = EPIPE_CODEC_ID_CAST,
    .params = cast_params,
    .nparams = 1,
    .param_word = cast_param_word,
    .body_size = cast_body_size,
    .cpu = &cast_cpu,
};
