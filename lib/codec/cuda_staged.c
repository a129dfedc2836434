/* Host staging: CUDA tensors for the codecs (and settings) the CUDA module
 * has no kernels for (insert, chains, delta=1; poweriter without cuBLAS).
 * The tensor is copied to host memory on the handle's stream, the CPU
 * backend encodes it there, and a payload meant for device memory is
 * copied up; decode is the reverse. The payloads are the CPU's, byte for
 * byte, because the CPU backend writes them; the cost is the whole tensor
 * crossing PCIe. Each call returns with its copies complete
 * (docs/codec-backends.md). */
#include <stdlib.h>

#include "core.h"
#include "cuda_core.h"

/* One of the handle's two host buffers (pinned, from the module through
 * CUDA device `device`), at least `bytes` long, in *out; its contents are
 * not kept when it grows. */
static int grow(epipe_codec *c, int device, void **buf, size_t *cap, size_t bytes, void **out)
{
    if (*cap < bytes || !*buf) {
        epipe_codec_cuda_host_free(device, *buf);
        *buf = NULL;
        *cap = 0;
        int rc = epipe_codec_cuda_host_alloc(c, device, bytes, buf);
        if (rc)
            return rc; /* the module said why */
        *cap = bytes ? bytes : 1;
    }
    *out = *buf;
    return EPIPE_OK;
}

static void *device_data(const DLTensor *t)
{
    return (char *)t->data + t->byte_offset;
}

/* t's n values of dt on the host, in the handle's value buffer: *host is
 * a dense host tensor over it with t's shape (filled from t when `fill`). */
static int to_host(epipe_codec *c, const DLTensor *t, const char *what, uint64_t n,
                   enum epipe_dtype dt, int fill, DLTensor *host, int *device)
{
    int rc = epipe_codec_cuda_check(c, t, what, device);
    if (rc)
        return rc;
    size_t esz = epipe_dtype_size(dt);
    if (n > SIZE_MAX / esz)
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "%s: %s has too many values to stage",
                                c->ops->name, what);
    void *v;
    if ((rc = grow(c, *device, &c->staged_values, &c->staged_values_cap, (size_t)n * esz, &v)))
        return rc;
    *host = *t;
    host->data = v;
    host->byte_offset = 0;
    host->strides = NULL; /* the module's check: t is dense */
    host->device.device_type = kDLCPU;
    host->device.device_id = 0;
    return fill ? epipe_codec_cuda_stream_copy(c, *device, v, device_data(t), (size_t)n * esz)
                : EPIPE_OK;
}

int epipe_codec_staged_encode(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                              void *dst, size_t capacity, size_t *written)
{
    DLTensor host;
    int device, rc = to_host(c, src, "src", n, dt, 1, &host, &device);
    if (rc)
        return rc;
    int up = epipe_codec_cuda_is_device_memory(dst);
    void *out = dst;
    if (up && (rc = grow(c, device, &c->staged_payload, &c->staged_payload_cap, capacity, &out)))
        return rc;
    rc = epipe_codec_encode_host(c, c->ops->cpu, &host, n, dt, out, capacity, written);
    if (rc == EPIPE_OK && up)
        rc = epipe_codec_cuda_stream_copy(c, device, dst, out, *written);
    if (rc)
        *written = 0;
    return rc;
}

int epipe_codec_staged_decode(epipe_codec *c, const void *src, size_t len, DLTensor *dst,
                              uint64_t n, enum epipe_dtype dt)
{
    DLTensor host;
    int device, rc = to_host(c, dst, "dst", n, dt, 0, &host, &device);
    if (rc)
        return rc;
    const void *payload = src;
    if (src && epipe_codec_cuda_is_device_memory(src)) {
        void *p;
        if ((rc = grow(c, device, &c->staged_payload, &c->staged_payload_cap, len, &p)) ||
            (rc = epipe_codec_cuda_stream_copy(c, device, p, src, len)))
            return rc;
        payload = p;
    }
    if ((rc = epipe_codec_decode_with(c, c->ops->cpu, payload, len, &host, n, dt)))
        return rc;
    return epipe_codec_cuda_stream_copy(c, device, device_data(dst), host.data,
                                        (size_t)n * epipe_dtype_size(dt));
}

int epipe_codec_staged_f32_in(epipe_codec *c, const DLTensor *t, const char *what, uint64_t n,
                              enum epipe_dtype dt, float **out, int fill)
{
    DLTensor host;
    int device, rc = to_host(c, t, what, n, dt, fill, &host, &device);
    if (rc)
        return rc;
    if (n > SIZE_MAX / sizeof(float) || !(*out = malloc(n ? (size_t)n * sizeof(float) : 1)))
        return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: no memory to stage %s", c->ops->name, what);
    if (fill)
        epipe_tensor_read_f32(&host, *out, (size_t)n);
    return EPIPE_OK;
}

int epipe_codec_staged_f32_out(epipe_codec *c, DLTensor *t, const char *what, uint64_t n,
                               enum epipe_dtype dt, const float *values)
{
    DLTensor host;
    int device, rc = to_host(c, t, what, n, dt, 0, &host, &device);
    if (rc)
        return rc;
    epipe_tensor_write_f32(&host, values, (size_t)n);
    return epipe_codec_cuda_stream_copy(c, device, device_data(t), host.data,
                                        (size_t)n * epipe_dtype_size(dt));
}

void epipe_codec_staged_release(epipe_codec *c)
{
    int device = 0; /* staged buffers exist only for a handle bound to a device */
    epipe_codec_bound_to(c, &device);
    epipe_codec_cuda_host_free(device, c->staged_values);
    epipe_codec_cuda_host_free(device, c->staged_payload);
    c->staged_values = c->staged_payload = NULL;
    c->staged_values_cap = c->staged_payload_cap = 0;
}
