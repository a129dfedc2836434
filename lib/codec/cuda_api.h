/* The interface between the codec core and the CUDA module (cuda/), which
 * libepipe opens with dlopen on the first CUDA tensor: what each gives the other. */
#ifndef EPIPE_LIB_CODEC_CUDA_API_H
#define EPIPE_LIB_CODEC_CUDA_API_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "../tensor.h"
#include "codec_impl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a field below or struct epipe_codec changes: a module
 * from another build is refused rather than misread. */
#define EPIPE_CUDA_ABI 16

/* What the module knows of poweriter's layout (codecs/poweriter/poweriter.h
 * checks each against its own): its warm-start slots (PI_MAX_SLOTS), its
 * body header's bytes, before the records (PI_BODY_HEADER), and its
 * `factors` parameter's index (PI_FACTORS) and fp16 value (PI_F16). */
#define EPIPE_CUDA_PI_SLOTS 256
#define EPIPE_CUDA_PI_HEADER 32
#define EPIPE_CUDA_PI_FACTORS 3
#define EPIPE_CUDA_PI_F16 1

/* The name of the function the module exports (default visibility). */
#define EPIPE_CUDA_INIT_SYMBOL "epipe_cuda_module_init"

/* A quantisation table as the kernels take it: k chunks of q level bits;
 * bnd [k + 1] (bnd[0] = -inf, bnd[k] = +inf), min, step and inv [k]. */
typedef struct epipe_cuda_qtab {
    unsigned k, q;
    float levels;
    const float *bnd, *min, *step, *inv;
} epipe_cuda_qtab;

/* insert's geometry and parameters for a CUDA tensor (cuda/insert.cu):
 * the conv kind reads [B][C][H][W] and writes the code [B][K][H/k][W/k]
 * by a k x k convolution of stride k; the linear kind reads [B][C] (B all
 * leading dimensions) and writes [B][K]. E (compress) and Rt (restore) are
 * the handle's own parameters, [K][C*k*k] row-major in host memory: the
 * layout of a cuDNN filter [K][C][k][k], and of the linear weights; gE and
 * gRt their gradients (host memory, what epipe_codec_tensor() lends),
 * which a backward adds to. */
typedef struct epipe_cuda_insert_view {
    int conv;   /* 1 conv, 0 linear */
    int code16; /* the body holds fp16 codes (code=fp16), else fp32 */
    int64_t B, C, H, W, K, k;
    const float *E, *Rt;
    float *gE, *gRt;
} epipe_cuda_insert_view;

/* What the core lends the module: the library's symbols are hidden, so
 * the few helpers the module needs come as pointers. */
typedef struct epipe_cuda_core {
    unsigned abi;      /* EPIPE_CUDA_ABI */
    size_t codec_size; /* sizeof(struct epipe_codec) as the core sees it */
    /* epipe_codec_fail() with a va_list: the message on the handle and the
     * calling thread; returns status. */
    int (*vfail)(epipe_codec *c, int status, const char *fmt, va_list ap);
    /* sortquant mode=fit, the host's part (codecs/sortquant/fit.c): the
     * plan from a sample s[0..m) (host memory) of the n values, whose
     * extent is [lo, hi]; every byte of the host body but the codes (fit
     * word, table, padding after the codes); and in *t the table the pack
     * kernel needs, in host memory of the handle (valid until its next
     * call). */
    int (*sq_fit_encode)(epipe_codec *c, const float *s, size_t m, size_t n, float lo, float hi,
                         uint8_t *body, struct epipe_cuda_qtab *t);
    /* The CPU decoder's checks of a fit body (fit word, table, padding
     * after the codes, the codes' tail bits) with its messages; *t the
     * table the decode kernel needs. */
    int (*sq_fit_decode)(epipe_codec *c, const uint8_t *body, size_t n, struct epipe_cuda_qtab *t);
    /* ef=1: the residual (device memory on `device`, n values) of the
     * slot of c->microbatch, kept by the core; *fresh = 1 when it is new
     * or starts over (a new shape or dtype), for the module to zero. */
    int (*ef_slot)(epipe_codec *c, int device, uint64_t n, enum epipe_dtype dt, float **r,
                   int *fresh);
    /* kmeans, the host's part (codecs/kmeans.c): the sample size m for n
     * values (n itself up to the sampling threshold); a sample gathered at
     * epipe_hd_km_sample_at()'s positions sorted in place, its ends set to
     * the extremes lo and hi, with the tail bounds *a and *b (the tails are
     * the values below a or above b); the CPU encoder's codebook into body
     * (its 4 * 2^bits bytes) and its midpoints into mid[2^bits], from all
     * n values x (host memory), or (x NULL) from the finished sample and
     * the t tails in index order (sorted in place); the decoder's checks
     * of a body (host memory) with the CPU's messages, its centroids into
     * cent. */
    size_t (*km_sample_size)(const epipe_codec *c, size_t n);
    void (*km_sample_finish)(float *s, size_t m, float lo, float hi, float *a, float *b);
    int (*km_fit)(epipe_codec *c, const float *x, size_t n, float lo, float hi, const float *s,
                  size_t m, float *tails, size_t t, uint8_t *body, double *mid);
    int (*km_read_table)(epipe_codec *c, const uint8_t *body, size_t n, float *cent);
    /* The decoder's checks of a payload's header (16 bytes at hdr, of a
     * payload of len bytes) for n values, with its statuses and messages,
     * for a check the module defers (defers, below); *need the size. */
    int (*check_header)(epipe_codec *c, const void *hdr, size_t len, uint64_t n, size_t *need);
    /* poweriter, the host's part (codecs/poweriter/poweriter.c), all NULL
     * in a build without BLAS: the view of n values (view: matrices, rows,
     * cols, iterations; *r the rank) checked as the CPU's encoder checks
     * it, with the body's header written, or (body NULL) as its decoder
     * does, and the body's size; the warm-start slot of the call (*index,
     * of EPIPE_CUDA_PI_SLOTS, -1 when warm starts are off) and whether the
     * module's device copy of it holds this view's start (*warm); one
     * matrix's Q (column-major) orthonormalised as the CPU does it
     * (LAPACK); the slot marked as holding this view's start (ok) or none,
     * at the end of an encode; the CPU encoder's refusal of matrix b's
     * factors (kind 0 not finite, 1 the scale s overflows); and a body's
     * header checked as the CPU decoder checks it. */
    int (*pi_plan)(epipe_codec *c, uint64_t n, uint8_t *body, uint64_t view[4], unsigned *r,
                   size_t *bytes);
    int (*pi_slot)(epipe_codec *c, uint64_t n, int *index, int *warm);
    int (*pi_orthonormalize)(epipe_codec *c, float *q, unsigned rows, unsigned r, uint64_t b);
    void (*pi_commit)(epipe_codec *c, uint64_t n, int ok);
    int (*pi_refuse)(epipe_codec *c, uint64_t n, uint64_t b, int kind, float s);
    int (*pi_check_header)(epipe_codec *c, const uint8_t *body, uint64_t n);
    /* insert, the host's part (codecs/insert/), NULL in a build without
     * BLAS: the view of a tensor of that shape (n values), checked as the
     * CPU checks it, with the parameters made on first use; and a
     * backward's shapes (the code gradient's, the full gradient's) checked
     * against the tensor micro-batch mb kept (its shape), with the CPU's
     * messages ("input" for the encoder's, "output" for the decoder's). */
    int (*ins_plan)(epipe_codec *c, const int64_t *shape, int ndim, uint64_t n,
                    epipe_cuda_insert_view *v);
    int (*ins_check_backward)(epipe_codec *c, int64_t mb, const char *what, const int64_t *kept,
                              int kept_ndim, const int64_t *code, int code_ndim,
                              const int64_t *full, int full_ndim);
} epipe_cuda_core;

/* What the module gives the core. Every function runs on the caller's
 * thread; the handle's stream is c->stream (NULL: the legacy default). */
typedef struct epipe_cuda_module {
    unsigned abi;
    /* EPIPE_OK when a CUDA device is usable; else EPIPE_ENOTSUP with `why`
     * ("no CUDA driver: <cuda error>", "no CUDA device: ..."). Cached. */
    int (*probe)(char *why, size_t cap);
    /* The CUDA backend of codec `id`, or NULL when the module has none. */
    const epipe_codec_backend *(*backend)(unsigned id);
    /* Checks a CUDA tensor of the call (dense, aligned, on a device that
     * exists) before anything is enqueued; the core checked dtype and shape.
     * *device receives its device index. */
    int (*check)(epipe_codec *c, const DLTensor *t, const char *what, int *device);
    /* Where p points: 1 CUDA device (or managed) memory, with its device
     * in *device; 0 host memory (pageable or pinned). */
    int (*locate)(const void *p, int *device);
    /* The header of a device payload of len (>= 16) bytes into hdr, copied
     * after the work already on the handle's stream (which may be what
     * wrote it); synchronous. In the same wait it reads the bytes of the
     * body the host checks when decoding n values (tables, padding), for
     * the decode of this payload that follows on the handle. */
    int (*peek)(epipe_codec *c, const void *payload, size_t len, uint64_t n, void *hdr);
    /* Optional (NULL: never): 1 when payload is device memory and c's
     * decode kernels read all they use from it. The core then calls decode
     * without a peek (for a payload of the exact length); the module
     * copies the header and the bytes the host checks on the stream,
     * launches the kernels, and runs the checks (check_header, then the
     * codec's) in the next synchronize, whose status they become. */
    int (*defers)(epipe_codec *c, const void *payload);
    /* Stages src (n values of dt, dense, device memory) to dense fp32 on
     * the device, writes the header `hdr` and runs be->encode into the
     * payload (len bytes, host or device memory) and returns once the work
     * is enqueued. */
    int (*encode)(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src, uint64_t n,
                  enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr, size_t len);
    /* The reverse: the payload's header was checked by the core (from a
     * peek where the payload is device memory, unless defers said 1) and
     * its length is exact. */
    int (*decode)(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload, size_t len,
                  uint64_t n, DLTensor *dst, enum epipe_dtype dt);
    /* Device memory for the stage's received tensors: EPIPE_OK when CUDA
     * device `device` exists (else EPIPE_EINVAL with `why`); alloc of
     * `bytes` (> 0) on it, and free. Errors as a status with `why`. */
    int (*device_ok)(int device, char *why, size_t cap);
    int (*alloc)(int device, size_t bytes, void **p, char *why, size_t cap);
    void (*free)(int device, void *p); /* p was allocated on `device` */
    /* Host staging (lib/codec/cuda_staged.c), and the stage's hand-over of
     * a CUDA tensor between its chunks: a copy of `bytes` between host and
     * device memory of CUDA device `device` (cudaMemcpyDefault),
     * ordered on the handle's stream after the work already on it, and
     * complete when it returns. Errors as a status with the message on c. */
    int (*stream_copy)(epipe_codec *c, int device, void *dst, const void *src, size_t bytes);
    /* A device payload a stage received in another memory than its
     * tensor's (lib/stage/opstream.c): a copy of `bytes` from device
     * memory of CUDA device src_device into dst, which is device memory of
     * CUDA device `device`, on c's stream after the work on it, with peer
     * access from `device` to src_device enabled first where
     * cudaDeviceCanAccessPeer allows (once a pair: the copy is then peer
     * to peer, not staged through the host by the driver); or, with
     * device -1, host memory, on src_device's default stream (c's may be
     * on a device the stage has left). Complete when it returns. Errors
     * as a status with the message on c. */
    int (*payload_copy)(epipe_codec *c, int device, void *dst, int src_device, const void *src,
                        size_t bytes);
    /* Host staging's buffers: pinned host memory (cudaHostAlloc), which the
     * staging copies read and write at the link's speed, without a bounce
     * through the driver's own buffers (and the stage's message buffers),
     * made through the context of CUDA device `device`; and its free,
     * given the same device: a thread that selected none must not create
     * GPU 0's context to free it. */
    int (*host_alloc)(int device, size_t bytes, void **p, char *why, size_t cap);
    void (*host_free)(int device, void *p);
    /* A trainable codec's backward (be->train's encode_backward, enc = 1,
     * or decode_backward) on CUDA tensors gin (n_in values of dt_in, read)
     * and gout (n_out of dt_out, written), both checked by the core and on
     * the handle's device: the module hands the backend dense fp32 device
     * views of them. */
    int (*backward)(epipe_codec *c, const epipe_codec_backend *be, int enc, unsigned mb,
                    const DLTensor *gin, uint64_t n_in, enum epipe_dtype dt_in, DLTensor *gout,
                    uint64_t n_out, enum epipe_dtype dt_out);
    /* Fences for payloads that stay on the device between stages of one
     * process (EPIPE_STAGE_CUDA_STREAM_ORDERED in epipe/stage.h): fence
     * records, on CUDA device `device`, an event after the work already
     * on c's stream into *fence (NULL when it fails: the status with the
     * message on c); fence_wait makes c's stream wait for it on the device
     * (the host does not wait); fence_status waits for it on the host and
     * returns the verdict on the payload, as c's status and message. A
     * fence carries what c's status word held after the encode (a
     * non-finite input, say) and what the sending stage was passed: a
     * stage's taint (device memory the module allocates into *taint at
     * the first fence_wait given one, freed with `free`) gathers on its
     * stream the verdicts of the fences it waited for, and fence passes
     * it on (taint NULL: nothing), so that the stages after a refused
     * encode all fail their step rather than the next one alone.
     * fence_free waits for it on the host, then frees it, given the same
     * device (a thread that selected none must not create GPU 0's
     * context). The fence may be waited for from any handle or stream, and
     * freed from any thread. */
    int (*fence)(epipe_codec *c, int device, const void *taint, void **fence);
    int (*fence_wait)(epipe_codec *c, int device, void *fence, void **taint);
    int (*fence_status)(epipe_codec *c, void *fence);
    void (*fence_free)(int device, void *fence);
    /* Marks, for a stream-ordered stage to give back a received message
     * once the decodes that read it are done, without waiting for them:
     * mark records, on CUDA device `device`, an event after the work on
     * c's stream into *mark (made there when *mark is NULL, else reused:
     * one made on `device`); the status with the message on c, *mark then
     * NULL or as it was. mark_passed returns 1 once the work before the
     * last record is done, and 0 while it is not or cannot be told (a CUDA
     * error: the caller waits as it would have); it never waits. mark_free
     * frees one without waiting, given the device it was made on. */
    int (*mark)(epipe_codec *c, int device, void **mark);
    int (*mark_passed)(int device, void *mark);
    void (*mark_free)(int device, void *mark);
    /* Waits for the handle's stream; the first deferred error since the
     * last call, or a CUDA error, as a status with the message on c. */
    int (*synchronize)(epipe_codec *c);
    /* Frees c->cuda (device scratch, the status word). */
    void (*release)(epipe_codec *c);
} epipe_cuda_module;

/* The core's sq_fit_encode and sq_fit_decode (codecs/sortquant/fit.c). */
int epipe_sq_fit_cuda_encode(epipe_codec *c, const float *s, size_t m, size_t n, float lo, float hi,
                             uint8_t *body, epipe_cuda_qtab *t);
int epipe_sq_fit_cuda_decode(epipe_codec *c, const uint8_t *body, size_t n, epipe_cuda_qtab *t);
/* The core's kmeans functions (codecs/kmeans.c). */
size_t epipe_km_cuda_sample_size(const epipe_codec *c, size_t n);
void epipe_km_cuda_sample_finish(float *s, size_t m, float lo, float hi, float *a, float *b);
int epipe_km_cuda_fit(epipe_codec *c, const float *x, size_t n, float lo, float hi, const float *s,
                      size_t m, float *tails, size_t t, uint8_t *body, double *mid);
int epipe_km_read_table(epipe_codec *c, const uint8_t *body, size_t n, float *cent);
/* The core's poweriter functions (codecs/poweriter/), in BLAS builds. */
int epipe_pi_cuda_plan(epipe_codec *c, uint64_t n, uint8_t *body, uint64_t view[4], unsigned *r,
                       size_t *bytes);
int epipe_pi_cuda_slot(epipe_codec *c, uint64_t n, int *index, int *warm);
int epipe_pi_cuda_orthonormalize(epipe_codec *c, float *q, unsigned rows, unsigned r, uint64_t b);
void epipe_pi_cuda_commit(epipe_codec *c, uint64_t n, int ok);
int epipe_pi_cuda_refuse(epipe_codec *c, uint64_t n, uint64_t b, int kind, float s);
int epipe_pi_cuda_check_header(epipe_codec *c, const uint8_t *body, uint64_t n);
/* The core's insert functions (codecs/insert/), in BLAS builds. */
int epipe_insert_cuda_plan(epipe_codec *c, const int64_t *shape, int ndim, uint64_t n,
                           epipe_cuda_insert_view *v);
int epipe_insert_cuda_check_backward(epipe_codec *c, int64_t mb, const char *what,
                                     const int64_t *kept, int kept_ndim, const int64_t *code,
                                     int code_ndim, const int64_t *full, int full_ndim);

typedef int (*epipe_cuda_init_fn)(const epipe_cuda_core *core, const epipe_cuda_module **out);

#ifdef __cplusplus
}
#endif
#endif
