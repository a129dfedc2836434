/* The codec core's calls into lib/codec/cuda.c: the CUDA module's backends,
 * handle binding and the encode and decode of CUDA tensors. */
#ifndef EPIPE_LIB_CODEC_CUDA_CORE_H
#define EPIPE_LIB_CODEC_CUDA_CORE_H

#include "../tensor.h"
#include "codec_impl.h"

/* The backend of the CUDA module for c's codec, loading the module on first
 * use: EPIPE_ENOTSUP naming what is missing (no module, no driver, no
 * device). Where the module has no kernels for the codec, or c uses
 * delta=1, it is the CPU backend, run on host copies (staged, below). */
int epipe_codec_cuda_backend(epipe_codec *c, const DLTensor *t, const char *what,
                             const epipe_codec_backend **be);
/* 1 when the loaded module stages c's CUDA tensors through the host. */
int epipe_codec_cuda_staged(const epipe_codec *c);
/* The module's checks of a CUDA tensor (dense, aligned, on a device that
 * exists), its device index into *device. */
int epipe_codec_cuda_check(epipe_codec *c, const DLTensor *t, const char *what, int *device);
/* A copy between host and device memory of `device`, ordered on c's
 * stream after its work and complete on return. */
int epipe_codec_cuda_stream_copy(epipe_codec *c, int device, void *dst, const void *src,
                                 size_t bytes);
/* A received device payload copied into another memory (cuda_api.h,
 * payload_copy): device memory of `device`, or host memory (-1). */
int epipe_codec_cuda_payload_copy(epipe_codec *c, int device, void *dst, int src_device,
                                  const void *src, size_t bytes);
/* A fence after the work on c's stream, on CUDA device `device`, into
 * *fence, passing on a stage's taint; c's stream made to wait for one on
 * the device, gathering its verdicts into a taint; and its free, which
 * waits for it first, from any thread (cuda_api.h, fence). Each fails
 * with EPIPE_ENOTSUP where no module is loaded (they load none). */
int epipe_codec_cuda_fence(epipe_codec *c, int device, const void *taint, void **fence);
int epipe_codec_cuda_fence_wait(epipe_codec *c, int device, void *fence, void **taint);
/* The verdict on the encode before the fence (cuda_api.h, fence_status):
 * EPIPE_OK, or its error, the message on c. */
int epipe_codec_cuda_fence_status(epipe_codec *c, void *fence);
void epipe_cuda_fence_free(int device, void *fence);
/* A mark after the work on c's stream (cuda_api.h, mark: *mark made at
 * the first, reused after, on `device`); whether the work before it is
 * done, never waiting (0 where it is not, or no module is loaded); its
 * free. The mark fails with EPIPE_ENOTSUP where no module is loaded. */
int epipe_codec_cuda_mark(epipe_codec *c, int device, void **mark);
int epipe_cuda_mark_passed(int device, void *mark);
void epipe_cuda_mark_free(int device, void *mark);
/* Pinned host memory of at least `bytes` for host staging, made through
 * CUDA device `device`, and its free (given the same device). */
int epipe_codec_cuda_host_alloc(epipe_codec *c, int device, size_t bytes, void **p);
void epipe_codec_cuda_host_free(int device, void *p);
/* Host staging for CUDA tensors (lib/codec/cuda_staged.c): encode src (a
 * CUDA tensor of n values of dt, into host or device memory dst of
 * `capacity` >= the payload's size) and decode a payload (host or device
 * memory) into the CUDA tensor dst, through the CPU backend; the payloads
 * are the CPU's. */
int epipe_codec_staged_encode(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                              void *dst, size_t capacity, size_t *written);
int epipe_codec_staged_decode(epipe_codec *c, const void *src, size_t len, DLTensor *dst,
                              uint64_t n, enum epipe_dtype dt);
/* A host fp32 copy of the CUDA tensor t (fill: with its values) into
 * *host (malloc'd, the caller frees), and the copy of such a buffer back
 * into t (converted to t's dtype). */
int epipe_codec_staged_f32_in(epipe_codec *c, const DLTensor *t, const char *what, uint64_t n,
                              enum epipe_dtype dt, float **host, int fill);
int epipe_codec_staged_f32_out(epipe_codec *c, DLTensor *t, const char *what, uint64_t n,
                               enum epipe_dtype dt, const float *host);
/* Frees the staging buffers (epipe_codec_destroy). */
void epipe_codec_staged_release(epipe_codec *c);
/* The loaded module's table for ops, or NULL (loads nothing). */
const epipe_codec_backend *epipe_codec_cuda_loaded_backend(const epipe_codec_ops *ops);
/* EPIPE_EINVAL naming both devices when t is not on the device the handle
 * is bound to; epipe_codec_bind() binds an unbound handle to t's device. */
int epipe_codec_check_binding(epipe_codec *c, const DLTensor *t, const char *what);
void epipe_codec_bind(epipe_codec *c, const DLTensor *t);
/* Whether c (NULL: no) is bound to a memory yet; *cuda_device is then that
 * memory's CUDA device index, or -1 for host memory. */
int epipe_codec_bound_to(const epipe_codec *c, int *cuda_device);
/* The module's checks of a CUDA tensor, then its encode or decode of a
 * whole payload (header included) in host or CUDA device memory. */
int epipe_codec_cuda_encode(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                            uint64_t n, enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr,
                            size_t len);
int epipe_codec_cuda_decode(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload,
                            size_t len, uint64_t n, DLTensor *dst, enum epipe_dtype dt);
/* The module's checks of both CUDA tensors, then its run of be's train ops
 * (encode_backward when enc, else decode_backward) on device fp32 views
 * of them. */
int epipe_codec_cuda_backward(epipe_codec *c, const epipe_codec_backend *be, int enc, unsigned mb,
                              const DLTensor *gin, const char *in_name, uint64_t n_in,
                              enum epipe_dtype dt_in, DLTensor *gout, const char *out_name,
                              uint64_t n_out, enum epipe_dtype dt_out);
/* The payload's header (len >= EPIPE_PAYLOAD_HEADER) into hdr: copied
 * from the device, with what the decode of n values reads on the host,
 * when the payload is CUDA memory. */
int epipe_codec_cuda_peek(epipe_codec *c, const void *payload, size_t len, uint64_t n, void *hdr);
/* 1 when the loaded module decodes the device payload at `payload` for c
 * at once and checks its header (with the core's check_header) and
 * tables at the next synchronize; 0 (no module, host memory, a codec
 * whose launch needs host-read tables: kmeans, sortquant's fit mode;
 * EPIPE_CUDA_DEFER_CHECKS=0 in the environment when c was made): peek
 * first. A negative status for any other value of that variable, its
 * message on c. */
int epipe_codec_cuda_defers(epipe_codec *c, const void *payload);
/* Reads the environment's EPIPE_CUDA_DEFER_CHECKS into c (its creation). */
void epipe_codec_cuda_read_env(epipe_codec *c);
/* 1 when a CUDA module is loaded and says p is device memory. */
int epipe_codec_cuda_is_device_memory(const void *p);
/* Device memory for the stage runtime, through the CUDA module (loaded
 * on first use): each fails with a status and a message in `why`
 * (EPIPE_ENOTSUP naming what is missing where there is no CUDA backend). */
int epipe_cuda_device_ok(int device, char *why, size_t cap);
int epipe_cuda_dev_alloc(int device, size_t bytes, void **p, char *why, size_t cap);
void epipe_cuda_dev_free(int device, void *p); /* p allocated on `device` */
/* Pinned host memory from the loaded module, made through CUDA device
 * `device` (EPIPE_ENOTSUP where no module is loaded: it loads nothing),
 * freed by epipe_codec_cuda_host_free(). */
int epipe_cuda_pinned_alloc(int device, size_t bytes, void **p);
/* epipe_codec_destroy: first a handle with kernels queued since its last
 * synchronize is synchronized, and a refusal found there (a value or a
 * payload) logged as a warning, as nothing else would report it; then the
 * module's per-handle state is freed. */
void epipe_codec_cuda_report_unsynced(epipe_codec *c);
void epipe_codec_cuda_release(epipe_codec *c);

#endif
