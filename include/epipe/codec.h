/* libepipe codecs: compress one tensor into a self-describing payload and
 * restore it. Codecs are named by spec strings ("sortquant:bits=8"). */
#ifndef EPIPE_CODEC_H
#define EPIPE_CODEC_H

#include <dlpack/dlpack.h>
#include <epipe/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque codec: a configured compression method plus its scratch memory.
 *
 * Thread safety: one handle must not be used by two threads at once (it
 * owns scratch buffers and, for some codecs, state carried between calls).
 * Distinct handles are fully independent. A codec may use worker threads of
 * its own inside a call (see EPIPE_CODEC_THREADS); it never keeps any after
 * the call returns. */
typedef struct epipe_codec epipe_codec;

/* Spec grammar: name[:key=value[,key=value]...], no spaces. Codecs:
 *   none                               fp32/fp16/bf16 sent as they are
 *   cast:dtype=fp16|bf16               round to a 16-bit float type
 *   quant:bits=B                       global min/max uniform, B in 1..16
 *   sortquant:bits=B[,split=S][,mode=exact|sample][,sample=N]
 *                                      sort quantization, B in 2..16; S
 *                                      defaults to the 3:1 rule (B/4,
 *                                      at least 1); mode defaults to sample
 *   kmeans:bits=B[,iters=K]            1-D Lloyd-Max codebook, B in 1..12
 *   topk:ratio=r                       keep the ceil(r*n) largest |x|
 *   poweriter:rank=R[,iters=K][,warm=0|1][,factors=fp32|fp16]
 *                                      rank-R factors per matrix by power
 *                                      iteration, warm-started
 * The full list, with every default and range, is in docs/codecs.md.
 *
 * Creates a codec in *out. Returns EPIPE_OK, EPIPE_EINVAL for a malformed
 * spec, an unknown name or key, a repeated key or a value out of range (the
 * message names the bad part), or EPIPE_ENOMEM. On error *out is NULL.
 * The caller owns the handle and frees it with epipe_codec_destroy().
 * Thread-safe. */
EPIPE_API int epipe_codec_create(epipe_codec **out, const char *spec);

/* Frees the codec and everything it owns. NULL is a no-op. */
EPIPE_API void epipe_codec_destroy(epipe_codec *codec);

/* The canonical spec: the name and every parameter with defaults filled in,
 * in a fixed order ("sortquant:bits=8,split=2,mode=sample,sample=65536").
 * Creating a codec from it gives an identical codec. The string is owned by
 * the codec and valid until epipe_codec_destroy(). */
EPIPE_API const char *epipe_codec_spec(const epipe_codec *codec);

/* The codec's name ("sortquant") and its stable numeric id, the one written
 * into payloads and wire messages. Owned by the library; never NULL. */
EPIPE_API const char *epipe_codec_name(const epipe_codec *codec);
EPIPE_API unsigned epipe_codec_id(const epipe_codec *codec);

/* The message of the last failing call on this handle, or "" if none.
 * Owned by the codec; valid until the next call on it. */
EPIPE_API const char *epipe_codec_last_error(const epipe_codec *codec);

/* Run-time knobs that never change the encoded bytes. Set them with
 * epipe_codec_set_param(); each has a documented range. */
typedef enum epipe_codec_param {
    /* Worker threads a call may use: 0 = automatic (all online CPUs, for
     * tensors large enough to profit), 1 = the calling thread alone, up to
     * 256. Default 0. The payload is byte-identical for every value. */
    EPIPE_CODEC_THREADS = 1
} epipe_codec_param;

/* Sets a knob. EPIPE_EINVAL for an unknown knob or a value out of range. */
EPIPE_API int epipe_codec_set_param(epipe_codec *codec, epipe_codec_param param,
                                    int64_t value);

/* The largest payload epipe_codec_encode() can write for a tensor of src's
 * dtype and shape (src->data is not read). Plan buffers with it once; the
 * bound depends only on the element count, the dtype and the spec (for
 * poweriter also on the shape, which fixes its matrix view).
 * EPIPE_EINVAL if src is not a tensor the codec accepts (the message says
 * why), EPIPE_EOVERFLOW if the size would overflow size_t. */
EPIPE_API int epipe_codec_max_encoded_size(epipe_codec *codec, const DLTensor *src,
                                           size_t *bytes);

/* Encodes src into dst[0..capacity). src: fp32 (any codec), fp16 or bf16;
 * on the CPU (kDLCPU or kDLCUDAHost); any shape and any strides, contiguous
 * or not. The payload begins with a 16-byte header naming the codec, its
 * parameters, the source dtype and the element count (docs/codecs.md), so
 * a decoder can check that it was made for it.
 *
 * Returns EPIPE_OK and the payload length in *written; EPIPE_ENOSPC if
 * capacity is below epipe_codec_max_encoded_size(); EPIPE_EINVAL for an
 * unsupported dtype or device, or, for the quantizers, a NaN or infinity in
 * src (the message gives its index); EPIPE_ENOTSUP for a CUDA tensor when
 * the CUDA backend is not built. src is only read; the caller keeps
 * ownership of src and dst. The same input gives the same bytes whatever
 * the thread count. May block while its worker threads run. */
EPIPE_API int epipe_codec_encode(epipe_codec *codec, const DLTensor *src, void *dst,
                                 size_t capacity, size_t *written);

/* Decodes the payload src[0..len) into dst, which the caller allocates and
 * owns: fp32, fp16 or bf16, on the CPU, any strides, with exactly as many
 * elements as were encoded (the shape itself may differ). Every byte of src
 * is treated as hostile: EPIPE_EPROTO if the payload was made by another
 * codec or other parameters or is malformed, EPIPE_ETRUNC if it is short,
 * EPIPE_EINVAL if dst's element count, dtype or device does not fit. On
 * error dst may have been partly written. */
EPIPE_API int epipe_codec_decode(epipe_codec *codec, const void *src, size_t len,
                                 DLTensor *dst);

#ifdef __cplusplus
}
#endif
#endif /* EPIPE_CODEC_H */
