/* DLPack tensor helpers: validation, element counts, fp16/bf16 conversion,
 * and copying any-strided tensors to and from a dense fp32 buffer. */
#ifndef EPIPE_LIB_TENSOR_H
#define EPIPE_LIB_TENSOR_H

#include <dlpack/dlpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Element types libepipe moves; the values are written on the wire. */
enum epipe_dtype { EPIPE_DTYPE_F32 = 0, EPIPE_DTYPE_F16 = 1, EPIPE_DTYPE_BF16 = 2 };

#define EPIPE_MAX_NDIM 16

/* Validates a host tensor of a supported float dtype and gives its element
 * count and dtype. `what` names the argument in the error ("src"). Sets
 * the message into handle_msg (may be NULL). */
int epipe_tensor_inspect(const DLTensor *t, const char *what, char *handle_msg, uint64_t *numel,
                         enum epipe_dtype *dtype);
/* The same; with cuda_ok a CUDA tensor (kDLCUDA, kDLCUDAManaged) passes the
 * device check (the codec core's CUDA path; its module checks the memory). */
int epipe_tensor_inspect_on(const DLTensor *t, const char *what, char *handle_msg, uint64_t *numel,
                            enum epipe_dtype *dtype, int cuda_ok);

/* True for a tensor in CUDA device (or managed) memory. */
static inline bool epipe_tensor_is_cuda(const DLTensor *t)
{
    return t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged;
}

/* Bytes per element of a dtype. */
size_t epipe_dtype_size(enum epipe_dtype d);
const char *epipe_dtype_name(enum epipe_dtype d);

/* True when the tensor's elements are dense in row-major order. */
bool epipe_tensor_is_dense(const DLTensor *t);

/* Copies all n elements of t (any dtype, any strides) into dense fp32. */
void epipe_tensor_read_f32(const DLTensor *t, float *dst, size_t n);
/* Writes n dense fp32 values into t (any dtype, any strides), rounding to
 * nearest even for fp16/bf16. */
void epipe_tensor_write_f32(DLTensor *t, const float *src, size_t n);

uint16_t epipe_f32_to_f16(float f);
float epipe_f16_to_f32(uint16_t h);
uint16_t epipe_f32_to_bf16(float f);
float epipe_bf16_to_f32(uint16_t h);

/* Little-endian loads and stores for payload metadata. */
static inline void epipe_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void epipe_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t epipe_get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline uint64_t epipe_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}
static inline void epipe_put_f32(uint8_t *p, float f)
{
    union {
        float f;
        uint32_t u;
    } c = {.f = f};
    epipe_put_u32(p, c.u);
}
static inline float epipe_get_f32(const uint8_t *p)
{
    union {
        float f;
        uint32_t u;
    } c = {.u = epipe_get_u32(p)};
    return c.f;
}

#endif
