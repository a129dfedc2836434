/* The CUDA module's entry point and plumbing: the device probe, per-handle
 * state and scratch, dtype staging on the device and the deferred status. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../codecs/inline/half.h"
#include "cuda_impl.h"

const epipe_cuda_core *epipe_cuda_core_fns;

int epipe_cuda_fail(epipe_codec *c, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = epipe_cuda_core_fns->vfail(c, status, fmt, ap);
    va_end(ap);
    return rc;
}

int epipe_cuda_check(epipe_codec *c, cudaError_t e, const char *doing)
{
    if (e == cudaSuccess)
        return EPIPE_OK;
    return epipe_cuda_fail(c, e == cudaErrorMemoryAllocation ? EPIPE_ENOMEM : EPIPE_EIO,
                           "%s: CUDA error while %s: %s (%s)", c->ops->name, doing,
                           cudaGetErrorName(e), cudaGetErrorString(e));
}

/* ---- probe ---------------------------------------------------------------- */

static int probe_rc = 1; /* 1: not asked yet */
static char probe_why[200];

static int cuda_probe(char *why, size_t cap)
{
    if (probe_rc == 1) {
        int count = 0;
        cudaError_t e = cudaGetDeviceCount(&count);
        if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || e == cudaSuccess) {
            if (e == cudaSuccess && count > 0)
                probe_rc = EPIPE_OK;
            else
                snprintf(probe_why, sizeof probe_why, "%s: %s",
                         e == cudaErrorInsufficientDriver ? "no CUDA driver" : "no CUDA device",
                         e == cudaSuccess ? "the driver reports 0 devices" : cudaGetErrorString(e));
        } else {
            snprintf(probe_why, sizeof probe_why, "no usable CUDA device: %s (%s)",
                     cudaGetErrorString(e), cudaGetErrorName(e));
        }
        if (probe_rc != EPIPE_OK)
            probe_rc = EPIPE_ENOTSUP;
    }
    if (probe_rc != EPIPE_OK)
        snprintf(why, cap, "%s", probe_why);
    return probe_rc;
}

static const epipe_codec_backend *cuda_backend(unsigned id)
{
    switch (id) {
    case EPIPE_CODEC_ID_NONE: return &epipe_cuda_none;
    case EPIPE_CODEC_ID_CAST: return &epipe_cuda_cast;
    case EPIPE_CODEC_ID_QUANT: return &epipe_cuda_quant;
    case EPIPE_CODEC_ID_SORTQUANT: return &epipe_cuda_sortquant;
    }
    return NULL;
}

/* ---- tensors and handles ----------------------------------------------- */

static int cuda_check(epipe_codec *c, const DLTensor *t, const char *what, int *device)
{
    const char *name = c->ops->name;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || t->device.device_id < 0 ||
        t->device.device_id >= count)
        return epipe_cuda_fail(c, EPIPE_EINVAL, "%s: %s is on CUDA device %d; this machine has %d",
                               name, what, (int)t->device.device_id, count);
    if (t->strides) {
        int64_t want = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != want)
                return epipe_cuda_fail(c, EPIPE_EINVAL,
                                       "%s: %s is a CUDA tensor with strides; CUDA tensors must be "
                                       "dense (compact row-major)",
                                       name, what);
            want *= t->shape[d];
        }
    }
    size_t esize = t->dtype.bits / 8;
    uintptr_t p = (uintptr_t)t->data + (uintptr_t)t->byte_offset;
    if (p % esize)
        return epipe_cuda_fail(c, EPIPE_EINVAL,
                               "%s: %s's data (offset %llu) is not aligned to its %zu-byte elements",
                               name, what, (unsigned long long)t->byte_offset, esize);
    if (t->device.device_type == kDLCUDA) {
        cudaPointerAttributes a;
        cudaError_t e = cudaPointerGetAttributes(&a, (const void *)p);
        if (e != cudaSuccess || (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)) {
            cudaGetLastError(); /* not sticky: clear it */
            return epipe_cuda_fail(c, EPIPE_EINVAL,
                                   "%s: %s says kDLCUDA, but its data %p is not CUDA device memory",
                                   name, what, (void *)p);
        }
        if (a.device != t->device.device_id)
            return epipe_cuda_fail(c, EPIPE_EINVAL,
                                   "%s: %s says CUDA device %d, but its data is on device %d", name,
                                   what, (int)t->device.device_id, a.device);
    }
    *device = t->device.device_id;
    return EPIPE_OK;
}

static int handle_state(epipe_codec *c, int device, epipe_cuda_handle **out)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    int rc;
    if ((rc = epipe_cuda_check(c, cudaSetDevice(device), "selecting the tensor's device")))
        return rc;
    if (!h) {
        h = (epipe_cuda_handle *)calloc(1, sizeof *h);
        if (!h)
            return epipe_cuda_fail(c, EPIPE_ENOMEM, "%s: out of memory", c->ops->name);
        h->device = device;
        cudaError_t e = cudaMalloc((void **)&h->status, sizeof *h->status);
        /* On the handle's stream: a non-blocking stream does not wait for
         * work on the legacy default stream. */
        if (e == cudaSuccess)
            e = cudaMemsetAsync(h->status, 0xff, sizeof *h->status, epipe_cuda_stream(c));
        if (e != cudaSuccess) {
            cudaFree(h->status);
            free(h);
            return epipe_cuda_check(c, e, "allocating the status word");
        }
        c->cuda = h;
    }
    *out = h;
    return EPIPE_OK;
}

int epipe_cuda_grow(epipe_codec *c, epipe_cuda_buf *b, size_t bytes, void **p)
{
    if (b->cap < bytes || !b->p) {
        cudaStream_t s = epipe_cuda_stream(c);
        if (b->p)
            cudaFreeAsync(b->p, s);
        b->p = NULL;
        b->cap = 0;
        size_t want = bytes < 256 ? 256 : bytes;
        int rc = epipe_cuda_check(c, cudaMallocAsync(&b->p, want, s), "allocating device scratch");
        if (rc)
            return rc;
        b->cap = want;
    }
    *p = b->p;
    return EPIPE_OK;
}

int epipe_cuda_host(epipe_codec *c, size_t bytes, void **p)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (h->host_cap < bytes) {
        void *q = realloc(h->host, bytes);
        if (!q)
            return epipe_cuda_fail(c, EPIPE_ENOMEM, "%s: out of host memory", c->ops->name);
        h->host = q;
        h->host_cap = bytes;
    }
    *p = h->host;
    return EPIPE_OK;
}

/* ---- staging ------------------------------------------------------------- */

__global__ void stage_in_kernel(const uint16_t *in, uint64_t n, int bf16, float *out)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        out[i] = bf16 ? epipe_hd_bf16_to_f32(in[i]) : epipe_hd_f16_to_f32(in[i]);
}

/* fp32 to the tensor's 16-bit type as the CPU's staging rounds (no
 * saturation: that is cast's, not the staging's). */
__global__ void stage_out_kernel(const float *in, uint64_t n, int bf16, uint16_t *out)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        out[i] = bf16 ? epipe_hd_f32_to_bf16(in[i]) : epipe_hd_f32_to_f16(in[i]);
}

static void *tensor_ptr(const DLTensor *t)
{
    return (char *)t->data + t->byte_offset;
}

static int encode_on(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                     uint64_t n, enum epipe_dtype dt, uint8_t *body)
{
    epipe_cuda_handle *h = NULL;
    int rc = handle_state(c, src->device.device_id, &h);
    if (rc)
        return rc;
    const float *x = (const float *)tensor_ptr(src);
    if (dt != EPIPE_DTYPE_F32 && n) {
        void *p;
        if ((rc = epipe_cuda_grow(c, &h->stage, n * sizeof(float), &p)))
            return rc;
        stage_in_kernel<<<epipe_cuda_blocks(n, 256), 256, 0, epipe_cuda_stream(c)>>>(
            (const uint16_t *)x, n, dt == EPIPE_DTYPE_BF16, (float *)p);
        if ((rc = epipe_cuda_check(c, cudaGetLastError(), "staging the input")))
            return rc;
        x = (const float *)p;
    }
    return be->encode(c, x, (size_t)n, body);
}

static int decode_on(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *body,
                     uint64_t n, DLTensor *dst, enum epipe_dtype dt)
{
    epipe_cuda_handle *h = NULL;
    int rc = handle_state(c, dst->device.device_id, &h);
    if (rc)
        return rc;
    float *y = (float *)tensor_ptr(dst);
    if (dt != EPIPE_DTYPE_F32 && n) {
        void *p;
        if ((rc = epipe_cuda_grow(c, &h->stage, n * sizeof(float), &p)))
            return rc;
        y = (float *)p;
    }
    if ((rc = be->decode(c, body, (size_t)n, y)))
        return rc;
    if (dt != EPIPE_DTYPE_F32 && n) {
        stage_out_kernel<<<epipe_cuda_blocks(n, 256), 256, 0, epipe_cuda_stream(c)>>>(
            y, n, dt == EPIPE_DTYPE_BF16, (uint16_t *)tensor_ptr(dst));
        return epipe_cuda_check(c, cudaGetLastError(), "converting the output");
    }
    return EPIPE_OK;
}

/* The calls select the tensor's device and give the caller's thread its
 * current device back, as a library should. */
static int cuda_encode(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                       uint64_t n, enum epipe_dtype dt, uint8_t *body)
{
    int prev = -1;
    cudaGetDevice(&prev);
    int rc = encode_on(c, be, src, n, dt, body);
    if (prev >= 0)
        cudaSetDevice(prev);
    return rc;
}

static int cuda_decode(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *body,
                       uint64_t n, DLTensor *dst, enum epipe_dtype dt)
{
    int prev = -1;
    cudaGetDevice(&prev);
    int rc = decode_on(c, be, body, n, dst, dt);
    if (prev >= 0)
        cudaSetDevice(prev);
    return rc;
}

/* ---- synchronisation ------------------------------------------------------- */

static int cuda_synchronize(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h)
        return EPIPE_OK; /* nothing was ever enqueued */
    int rc = epipe_cuda_check(c, cudaSetDevice(h->device), "selecting the handle's device");
    if (rc)
        return rc;
    if ((rc = epipe_cuda_check(c, cudaStreamSynchronize(epipe_cuda_stream(c)),
                               "waiting for the handle's stream")))
        return rc;
    epipe_cuda_status st;
    if ((rc = epipe_cuda_check(c, cudaMemcpy(&st, h->status, sizeof st, cudaMemcpyDeviceToHost),
                               "reading the status word")))
        return rc;
    unsigned long long first = st.nan < st.pinf ? st.nan : st.pinf;
    first = st.ninf < first ? st.ninf : first;
    if (first == ~0ull)
        return EPIPE_OK;
    if ((rc = epipe_cuda_check(c,
                               cudaMemsetAsync(h->status, 0xff, sizeof *h->status,
                                               epipe_cuda_stream(c)),
                               "clearing the status word")))
        return rc;
    return epipe_cuda_fail(c, EPIPE_EINVAL,
                           "%s: input value at index %llu is %s; quantizers need finite values",
                           c->ops->name, first,
                           first == st.nan    ? "NaN"
                           : first == st.pinf ? "+inf"
                                              : "-inf");
}

static void cuda_release(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h)
        return;
    /* cudaFree waits for the device, so work still queued on the handle's
     * stream finishes before its scratch goes. */
    cudaSetDevice(h->device);
    cudaFree(h->status);
    cudaFree(h->stage.p);
    cudaFree(h->body.p);
    for (int i = 0; i < 3; i++)
        cudaFree(h->work[i].p);
    free(h->host);
    free(h);
    c->cuda = NULL;
}

static const epipe_cuda_module module = {
    EPIPE_CUDA_ABI, cuda_probe,  cuda_backend,      cuda_check,
    cuda_encode,    cuda_decode, cuda_synchronize, cuda_release,
};

extern "C" __attribute__((visibility("default"))) int
epipe_cuda_module_init(const epipe_cuda_core *core, const epipe_cuda_module **out)
{
    if (!core || core->abi != EPIPE_CUDA_ABI || core->codec_size != sizeof(struct epipe_codec))
        return EPIPE_EVERSION;
    epipe_cuda_core_fns = core;
    *out = &module;
    return EPIPE_OK;
}
