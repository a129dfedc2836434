/* The codec core's calls into lib/codec/cuda.c: the CUDA module's backends,
 * handle binding and the encode and decode of CUDA tensors. */
#ifndef EPIPE_LIB_CODEC_CUDA_CORE_H
#define EPIPE_LIB_CODEC_CUDA_CORE_H

#include "../tensor.h"
#include "codec_impl.h"

/* The backend of the CUDA module for c's codec, loading the module on first
 * use: EPIPE_ENOTSUP naming what is missing (no module, no driver, no
 * device, no kernels for the codec, delta=1, a setting the kernels lack). */
int epipe_codec_cuda_backend(epipe_codec *c, const DLTensor *t, const char *what,
                             const epipe_codec_backend **be);
/* The loaded module's table for ops, or NULL (loads nothing). */
const epipe_codec_backend *epipe_codec_cuda_loaded_backend(const epipe_codec_ops *ops);
/* EPIPE_EINVAL naming both devices when t is not on the device the handle
 * is bound to; epipe_codec_bind() binds an unbound handle to t's device. */
int epipe_codec_check_binding(epipe_codec *c, const DLTensor *t, const char *what);
void epipe_codec_bind(epipe_codec *c, const DLTensor *t);
/* The module's checks of a CUDA tensor, then its encode or decode of a
 * whole payload (header included) in host or CUDA device memory. */
int epipe_codec_cuda_encode(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                            uint64_t n, enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr,
                            size_t len);
int epipe_codec_cuda_decode(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload,
                            size_t len, uint64_t n, DLTensor *dst, enum epipe_dtype dt);
/* The payload's header (len >= EPIPE_PAYLOAD_HEADER) into hdr: copied
 * from the device, with what the decode of n values reads on the host,
 * when the payload is CUDA memory. */
int epipe_codec_cuda_peek(epipe_codec *c, const void *payload, size_t len, uint64_t n, void *hdr);
/* 1 when a CUDA module is loaded and says p is device memory. */
int epipe_codec_cuda_is_device_memory(const void *p);
/* Device memory for the stage runtime, through the CUDA module (loaded
 * on first use): each fails with a status and a message in `why`
 * (EPIPE_ENOTSUP naming what is missing where there is no CUDA backend). */
int epipe_cuda_device_ok(int device, char *why, size_t cap);
int epipe_cuda_dev_alloc(int device, size_t bytes, void **p, char *why, size_t cap);
void epipe_cuda_dev_free(void *p);
int epipe_cuda_dev_copy(void *dst, const void *src, size_t bytes, char *why, size_t cap);
/* Frees the module's per-handle state (epipe_codec_destroy). */
void epipe_codec_cuda_release(epipe_codec *c);

#endif
