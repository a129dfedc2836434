/* DLPack tensor validation and dtype conversion. The strided copy walks the
 * index space with an odometer so any layout DLPack can describe (negative
 * strides included) is read element by element in row-major order. */
#include "tensor.h"

#include <math.h>
#include <string.h>

#include <epipe/common.h>

#include "../codecs/inline/half.h"
#include "error.h"

size_t epipe_dtype_size(enum epipe_dtype d)
{
    return d == EPIPE_DTYPE_F32 ? 4 : 2;
}

const char *epipe_dtype_name(enum epipe_dtype d)
{
    switch (d) {
    case EPIPE_DTYPE_F32: return "fp32";
    case EPIPE_DTYPE_F16: return "fp16";
    case EPIPE_DTYPE_BF16: return "bf16";
    }
    return "?";
}

int epipe_tensor_inspect(const DLTensor *t, const char *what, char *handle_msg, uint64_t *numel,
                         enum epipe_dtype *dtype)
{
    return epipe_tensor_inspect_on(t, what, handle_msg, numel, dtype, 0);
}

/* How a DLPack type code is written before its bits ("int" in int32);
 * NULL for a code we do not name. */
static const char *dlpack_code_name(uint8_t code)
{
    switch (code) {
    case kDLInt: return "int";
    case kDLUInt: return "uint";
    case kDLFloat: return "fp";
    case kDLBfloat: return "bf";
    case kDLComplex: return "complex";
    default: return NULL;
    }
}

int epipe_tensor_inspect_on(const DLTensor *t, const char *what, char *handle_msg, uint64_t *numel,
                            enum epipe_dtype *dtype, int cuda_ok)
{
    if (!t)
        return epipe_fail_into(handle_msg, EPIPE_EINVAL, "%s is NULL", what);
    int cuda = t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged;
    /* cuda_ok: the codec core's CUDA path, where the CUDA module checks
     * the memory itself */
    if (cuda && !cuda_ok)
        return epipe_fail_into(handle_msg, EPIPE_ENOTSUP,
                               "%s is a CUDA tensor, and this build has no CUDA backend", what);
    if (!cuda && t->device.device_type != kDLCPU && t->device.device_type != kDLCUDAHost)
        return epipe_fail_into(handle_msg, EPIPE_EINVAL,
                               "%s is on device type %d; only CPU tensors are supported", what,
                               (int)t->device.device_type);
    if (t->dtype.lanes != 1)
        return epipe_fail_into(handle_msg, EPIPE_EINVAL, "%s has %u lanes; only 1 is supported",
                               what, (unsigned)t->dtype.lanes);
    if (t->dtype.code == kDLFloat && t->dtype.bits == 32)
        *dtype = EPIPE_DTYPE_F32;
    else if (t->dtype.code == kDLFloat && t->dtype.bits == 16)
        *dtype = EPIPE_DTYPE_F16;
    else if (t->dtype.code == kDLBfloat && t->dtype.bits == 16)
        *dtype = EPIPE_DTYPE_BF16;
    else if (dlpack_code_name(t->dtype.code))
        return epipe_fail_into(handle_msg, EPIPE_EINVAL,
                               "%s has dtype %s%u; supported: fp32, fp16, bf16", what,
                               dlpack_code_name(t->dtype.code), (unsigned)t->dtype.bits);
    else
        return epipe_fail_into(handle_msg, EPIPE_EINVAL,
                               "%s has DLPack dtype code %u with %u bits; supported: fp32, fp16, "
                               "bf16",
                               what, (unsigned)t->dtype.code, (unsigned)t->dtype.bits);
    if (t->ndim < 0 || t->ndim > EPIPE_MAX_NDIM)
        return epipe_fail_into(handle_msg, EPIPE_EINVAL, "%s has ndim %d; supported 0..%d", what,
                               t->ndim, EPIPE_MAX_NDIM);
    if (t->ndim > 0 && !t->shape)
        return epipe_fail_into(handle_msg, EPIPE_EINVAL, "%s has ndim %d but no shape", what,
                               t->ndim);
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0)
            return epipe_fail_into(handle_msg, EPIPE_EINVAL, "%s shape[%d] = %lld is negative",
                                   what, i, (long long)t->shape[i]);
        if (t->shape[i] != 0 && n > (UINT64_MAX >> 4) / (uint64_t)t->shape[i])
            return epipe_fail_into(handle_msg, EPIPE_EOVERFLOW,
                                   "%s has too many elements (overflow at shape[%d])", what, i);
        n *= (uint64_t)t->shape[i];
    }
    if (n > (uint64_t)(SIZE_MAX / 8))
        return epipe_fail_into(handle_msg, EPIPE_EOVERFLOW, "%s has too many elements", what);
    if (n > 0 && !t->data)
        return epipe_fail_into(handle_msg, EPIPE_EINVAL, "%s has %llu elements but data is NULL",
                               what, (unsigned long long)n);
    *numel = n;
    return EPIPE_OK;
}

bool epipe_tensor_is_dense(const DLTensor *t)
{
    if (!t->strides)
        return true;
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != expect)
            return false;
        expect *= t->shape[i];
    }
    return true;
}

/* One definition of the conversions, shared with the cast codec and the
 * CUDA kernels (codecs/inline/half.h). */
uint16_t epipe_f32_to_f16(float f)
{
    return epipe_hd_f32_to_f16(f);
}

float epipe_f16_to_f32(uint16_t h)
{
    return epipe_hd_f16_to_f32(h);
}

uint16_t epipe_f32_to_bf16(float f)
{
    return epipe_hd_f32_to_bf16(f);
}

float epipe_bf16_to_f32(uint16_t h)
{
    return epipe_hd_bf16_to_f32(h);
}

static float load_elem(const char *p, enum epipe_dtype d)
{
    uint16_t h;
    float f;
    switch (d) {
    case EPIPE_DTYPE_F32: memcpy(&f, p, 4); return f;
    case EPIPE_DTYPE_F16: memcpy(&h, p, 2); return epipe_f16_to_f32(h);
    case EPIPE_DTYPE_BF16: memcpy(&h, p, 2); return epipe_bf16_to_f32(h);
    }
    return 0.0f;
}

static void store_elem(char *p, enum epipe_dtype d, float f)
{
    uint16_t h;
    switch (d) {
    case EPIPE_DTYPE_F32: memcpy(p, &f, 4); return;
    case EPIPE_DTYPE_F16:
        h = epipe_f32_to_f16(f);
        memcpy(p, &h, 2);
        return;
    case EPIPE_DTYPE_BF16:
        h = epipe_f32_to_bf16(f);
        memcpy(p, &h, 2);
        return;
    }
}

static enum epipe_dtype dtype_of(const DLTensor *t)
{
    if (t->dtype.bits == 32)
        return EPIPE_DTYPE_F32;
    return t->dtype.code == kDLBfloat ? EPIPE_DTYPE_BF16 : EPIPE_DTYPE_F16;
}

/* Visits every element in row-major order; `fn` gets the element address. */
static void walk(const DLTensor *t, size_t n, void (*fn)(char *elem, size_t i, void *ctx),
                 void *ctx)
{
    enum epipe_dtype d = dtype_of(t);
    size_t esz = epipe_dtype_size(d);
    char *base = (char *)t->data + t->byte_offset;
    if (epipe_tensor_is_dense(t)) {
        for (size_t i = 0; i < n; i++)
            fn(base + i * esz, i, ctx);
        return;
    }
    int64_t idx[EPIPE_MAX_NDIM] = {0};
    int64_t off = 0; /* element offset of idx */
    for (size_t i = 0; i < n; i++) {
        fn(base + off * (int64_t)esz, i, ctx);
        for (int k = t->ndim - 1; k >= 0; k--) {
            if (++idx[k] < t->shape[k]) {
                off += t->strides[k];
                break;
            }
            off -= t->strides[k] * (idx[k] - 1);
            idx[k] = 0;
        }
    }
}

struct copy_ctx {
    float *buf;
    enum epipe_dtype d;
};

static void read_one(char *e, size_t i, void *p)
{
    struct copy_ctx *c = p;
    c->buf[i] = load_elem(e, c->d);
}

static void write_one(char *e, size_t i, void *p)
{
    struct copy_ctx *c = p;
    store_elem(e, c->d, c->buf[i]);
}

void epipe_tensor_read_f32(const DLTensor *t, float *dst, size_t n)
{
    struct copy_ctx c = {dst, dtype_of(t)};
    if (c.d == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(t)) {
        if (n)
            memcpy(dst, (const char *)t->data + t->byte_offset, n * 4);
        return;
    }
    walk(t, n, read_one, &c);
}

void epipe_tensor_write_f32(DLTensor *t, const float *src, size_t n)
{
    struct copy_ctx c = {(float *)src, dtype_of(t)};
    if (c.d == EPIPE_DTYPE_F32 && epipe_tensor_is_dense(t)) {
        if (n)
            memcpy((char *)t->data + t->byte_offset, src, n * 4);
        return;
    }
    walk(t, n, write_one, &c);
}
