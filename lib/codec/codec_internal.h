/* Codec calls for the rest of the library (the stage runtime) on tensors
 * the caller has already checked with epipe_tensor_inspect(): no check twice. */
#ifndef EPIPE_LIB_CODEC_CODEC_INTERNAL_H
#define EPIPE_LIB_CODEC_CODEC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <epipe/codec.h>

#include "../tensor.h"

/* As epipe_codec_max_encoded_size(), epipe_codec_encode() and
 * epipe_codec_decode(), for a tensor t that epipe_tensor_inspect() accepted
 * with element count n and dtype dt. They do not clear the thread's error
 * and report failures on the handle (epipe_codec_last_error()). */
int epipe_codec_size_checked(epipe_codec *c, const DLTensor *t, uint64_t n, size_t *bytes);
int epipe_codec_encode_checked(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                               void *dst, size_t capacity, size_t *written);
int epipe_codec_decode_checked(epipe_codec *c, const void *src, size_t len, DLTensor *dst,
                               uint64_t n, enum epipe_dtype dt);
/* As epipe_codec_decode_backward() for a checked grad_output (n values of
 * dt) and a dense fp32 grad_code the caller made. */
int epipe_codec_decode_backward_checked(epipe_codec *c, unsigned mb, const DLTensor *grad_output,
                                        uint64_t n, enum epipe_dtype dt, DLTensor *grad_code);
/* The codec id and parameter word c's payloads begin with (payload.h):
 * what a payload encoded in device memory says, without reading it. */
void epipe_codec_payload_ident(const epipe_codec *c, unsigned *codec_id, uint32_t *param_word);

#endif
