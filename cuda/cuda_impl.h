/* What the files of the CUDA module share: the per-handle state (device
 * scratch, the deferred status word), error helpers and the backends. */
#ifndef EPIPE_CUDA_CUDA_IMPL_H
#define EPIPE_CUDA_CUDA_IMPL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "../lib/codec/cuda_api.h"
}

/* The deferred status word, in device memory: kernels that meet a value
 * they cannot encode record the smallest index of each kind (atomicMin);
 * UINT64_MAX = none. Read and cleared by epipe_cuda_synchronize(). */
struct epipe_cuda_status {
    unsigned long long nan, pinf, ninf;
};

/* A device buffer grown on demand (stream-ordered, on the handle's stream). */
struct epipe_cuda_buf {
    void *p;
    size_t cap;
};

/* c->cuda: one per handle, on the device it is bound to. */
struct epipe_cuda_handle {
    int device;
    epipe_cuda_status *status; /* device */
    epipe_cuda_buf stage;      /* fp32 view of a fp16/bf16 tensor */
    epipe_cuda_buf body;       /* the body before it is copied out */
    epipe_cuda_buf work[3];    /* per-codec work arrays */
    void *host;                /* per-codec host scratch (malloc) */
    size_t host_cap;
};

/* The core's helpers, set at init. */
extern const epipe_cuda_core *epipe_cuda_core_fns;

int epipe_cuda_fail(epipe_codec *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* EPIPE_ENOMEM for allocation errors, else EPIPE_EIO, naming the CUDA
 * error and what was being done; EPIPE_OK for cudaSuccess. */
int epipe_cuda_check(epipe_codec *c, cudaError_t e, const char *doing);

static inline cudaStream_t epipe_cuda_stream(const epipe_codec *c)
{
    return (cudaStream_t)c->stream;
}
static inline epipe_cuda_handle *epipe_cuda_h(epipe_codec *c)
{
    return (epipe_cuda_handle *)c->cuda;
}
/* At least `bytes` of device memory in b (contents not kept). */
int epipe_cuda_grow(epipe_codec *c, epipe_cuda_buf *b, size_t bytes, void **p);
/* At least `bytes` of host scratch in the handle. */
int epipe_cuda_host(epipe_codec *c, size_t bytes, void **p);

/* Blocks for n items at `threads` per block, capped so that a grid-stride
 * loop covers the rest. */
static inline unsigned epipe_cuda_blocks(uint64_t n, unsigned threads)
{
    uint64_t b = (n + threads - 1) / threads;
    if (b > 65535u * 4u)
        b = 65535u * 4u;
    return b ? (unsigned)b : 1u;
}

/* The backends, by codec. */
extern const epipe_codec_backend epipe_cuda_none;
extern const epipe_codec_backend epipe_cuda_cast;
extern const epipe_codec_backend epipe_cuda_quant;
extern const epipe_codec_backend epipe_cuda_sortquant;

#endif
