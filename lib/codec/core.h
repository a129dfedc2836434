/* What the files of the codec core (lib/codec/) share: the registry, the
 * spec parser, backend dispatch and dtype staging. Codecs never see it. */
#ifndef EPIPE_LIB_CODEC_CORE_H
#define EPIPE_LIB_CODEC_CORE_H

#include "../tensor.h"
#include "codec_impl.h"

/* registry.c: the codecs a spec may name (by name), and every codec
 * including those with their own syntax (by id). */
const epipe_codec_ops *epipe_codec_find(const char *name, size_t len);
const char *epipe_codec_name_of_id(unsigned id);
/* The backend of codec ops for a device, or NULL when this build has none:
 * the one place that maps (codec, device) to code. */
const epipe_codec_backend *epipe_codec_backend_of(const epipe_codec_ops *ops,
                                                  epipe_codec_device dev);
/* Fails with EPIPE_EINVAL naming `name` and listing the known codecs. */
int epipe_codec_unknown(const char *name, size_t len);

/* spec.c: fills c->ops, c->p and the canonical c->spec from spec, and runs
 * the codec's configure. Errors go to the thread (the handle is new). */
int epipe_codec_parse_spec(epipe_codec *c, const char *spec);
/* 1 if specs of ops may carry the core key ef=1: every lossy codec that
 * is not trainable (not none, insert or a chain). */
int epipe_codec_ef_allowed(const epipe_codec_ops *ops);
/* The index of key in ops->params, or -1. */
int epipe_codec_param_index(const epipe_codec_ops *ops, const char *key);

/* ef.c: error feedback for a handle whose spec has ef=1. Encodes x + r
 * (r: the residual of the slot of c->microbatch, zeroed when new or when
 * the tensor's dtype or shape (c->shape) changed) into body, decodes it
 * back with the codec's own decoder and keeps x + r - decoded as the new
 * r. On failure the residual is left as it was (or cleared if the decode
 * failed). The CPU backend; the CUDA module does the same on the device
 * with the slots of epipe_codec_ef_slot_cuda() (cuda_api.h). */
#define EPIPE_CODEC_EF_MAX_SLOTS 4096
int epipe_codec_ef_encode(epipe_codec *c, const epipe_codec_backend *be, const float *x, uint64_t n,
                          enum epipe_dtype dt, uint8_t *body);
/* Frees every residual slot (epipe_codec_destroy, epipe_codec_reset_feedback). */
void epipe_codec_ef_release(epipe_codec *c);
/* The residual of c->microbatch's slot for n values of dt, in memory of
 * CUDA device `device`: *fresh = 1 when the slot is new or starts over
 * (the caller zeroes it, on its stream). */
int epipe_codec_ef_slot_cuda(epipe_codec *c, int device, uint64_t n, enum epipe_dtype dt, float **r,
                             int *fresh);

/* delta*.c: activation deltas for a handle whose spec has delta=1 (AQ-SGD,
 * docs/codecs.md "Activation deltas"). parse: 1 if key is not a delta key,
 * else EPIPE_OK or an error (on the thread); check: after all keys. */
#define EPIPE_CODEC_DELTA_MB_DEFAULT 1024
int epipe_codec_delta_parse(epipe_codec *c, const char *key, size_t klen, const char *v,
                            size_t vlen);
int epipe_codec_delta_check(epipe_codec *c);
void epipe_codec_delta_spec(epipe_codec *c); /* appends delta keys to c->spec */
/* 1 (filling the non-NULL outputs) if key is a delta key of ops, else 0. */
int epipe_codec_delta_key_info(const epipe_codec_ops *ops, const char *key, const epipe_codec *c,
                               double *value, double *min, double *max);
/* The largest payload for c->shape (the split of rows into full and delta
 * varies); encode writes the payload body and sets *written (header
 * included); decode checks the body and writes dst. CPU backend only. */
int epipe_codec_delta_max_size(epipe_codec *c, uint64_t n, size_t *bytes);
int epipe_codec_delta_encode(epipe_codec *c, const epipe_codec_backend *be, const float *x,
                             uint64_t n, enum epipe_dtype dt, uint8_t *payload, size_t *written);
int epipe_codec_delta_decode(epipe_codec *c, const epipe_codec_backend *be, const void *src,
                             size_t len, DLTensor *dst, uint64_t n, enum epipe_dtype dt);
/* Frees the stored rows, and with `all` everything (epipe_codec_destroy). */
void epipe_codec_delta_release(epipe_codec *c, int all);
/* The stored row of sample id, or NULL (tests). */
const float *epipe_codec_delta_row(const epipe_codec *c, uint64_t id);

/* codec.c: the backend for a tensor on t's device; EPIPE_ENOTSUP (naming
 * the device and the codec) when this build has none for it. */
int epipe_codec_backend_for(epipe_codec *c, const DLTensor *t, const char *what,
                            const epipe_codec_backend **be);
/* The two halves of encode and decode after the backend is known (the
 * CUDA staging runs them on host copies): the CPU encode of the host
 * tensor src into h (need bytes: the payload size), and the decode of a
 * payload with the header and length checks. */
int epipe_codec_encode_host(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                            uint64_t n, enum epipe_dtype dt, uint8_t *h, size_t need,
                            size_t *written);
int epipe_codec_decode_with(epipe_codec *c, const epipe_codec_backend *be, const void *src,
                            size_t len, DLTensor *dst, uint64_t n, enum epipe_dtype dt);
/* The checks of a payload's header hp (its 16 bytes, of a payload of len
 * bytes) for a decode of n values by c, in the decoder's order and with
 * its statuses and messages; *need the size the values take. The length
 * itself is the caller's to check against *need. */
int epipe_codec_check_payload_header(epipe_codec *c, const void *hp, size_t len, uint64_t n,
                                     size_t *need);
/* Records t's shape as the shape of the current call (c->ndim, c->shape). */
void epipe_codec_note_shape(epipe_codec *c, const DLTensor *t);

/* staging.c: dense fp32 views of CPU tensors for the CPU backend.
 * A view of src: src's own memory when it is dense fp32, else the handle's
 * scratch filled from src. EPIPE_ENOMEM (message on c) if it cannot grow. */
int epipe_codec_stage_in(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                         const float **x);
/* Where a backend writes dst's values: dst's memory when dense fp32, else
 * the scratch; epipe_codec_stage_out_done() then converts into dst. */
int epipe_codec_stage_out(epipe_codec *c, DLTensor *dst, uint64_t n, enum epipe_dtype dt,
                          float **y);
void epipe_codec_stage_out_done(DLTensor *dst, const float *y, uint64_t n);
/* A dense fp32 copy or view of a checked tensor for the backward calls:
 * t's memory, or a fresh buffer in *owned (filled from t when `fill`; a
 * CUDA tensor's values are copied to the host); and, after the backward
 * wrote the view, the copy of *owned back into t (nothing when the view
 * was t's memory). The caller frees *owned. */
int epipe_codec_f32_view(epipe_codec *c, const DLTensor *t, const char *what, uint64_t n,
                         enum epipe_dtype dt, float **out, float **owned, int fill);
int epipe_codec_f32_view_done(epipe_codec *c, DLTensor *t, const char *what, uint64_t n,
                              enum epipe_dtype dt, const float *owned);

#endif
