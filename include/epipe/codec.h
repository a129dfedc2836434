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
 *   cast:dtype=fp16|bf16               round to a 16-bit float type;
 *                                      finite values beyond its range
 *                                      saturate to its largest finite
 *   quant:bits=B[,zero=1][,rows=1][,group=K]
 *                                      global min/max uniform, B in 1..16;
 *                                      zero=1 moves the grid by under half
 *                                      a step so that 0 decodes exactly
 *                                      (use it for gradients; same payload
 *                                      format); rows=1: one min/max per
 *                                      row of dimension 0 (per sample) of
 *                                      a tensor of 2 or more dimensions
 *                                      (another format); group=K (1..2^20):
 *                                      one min/max per run of K values, K
 *                                      dividing each row (EPIPE_EINVAL
 *                                      otherwise; K = H*W: per channel of
 *                                      each sample of NCHW)
 *   sortquant:bits=B[,split=S][,mode=fit|sample|exact][,sample=N][,zero=1]
 *                                      sort quantization, B in 2..16; mode
 *                                      defaults to fit (MSE-fitted chunks,
 *                                      S in 0..4 chosen per tensor unless
 *                                      given); sample and exact (the
 *                                      research's equal-count chunks) take
 *                                      S from the 3:1 rule (B/4, at least 1);
 *                                      zero=1 as quant's, per chunk
 *   kmeans:bits=B[,iters=K]            1-D Lloyd-Max codebook, B in 1..12
 *   topk:ratio=r                       keep the ceil(r*n) largest |x|
 *   insert:kind=conv|linear[,out=K|ratio=r][,kernel=k][,in=C][,seed=S]
 *          [,code=fp32|fp16]          learned compress/restore (trainable)
 *   a|b                                a chain: trainable a (insert) makes
 *                                      a code, b encodes it ("insert:kind=
 *                                      linear,out=8|sortquant:bits=8");
 *                                      other chains: EPIPE_ENOTSUP
 *   poweriter:rank=R[,iters=K][,warm=0|1][,factors=fp32|fp16][,shared=1]
 *                                      rank-R factors per matrix by power
 *                                      iteration, warm-started; a 2-D
 *                                      [B,D] tensor below rank B only with
 *                                      shared=1 (its rows share factors)
 * Every lossy codec that is not trainable (cast, quant, sortquant, kmeans,
 * topk, poweriter; not none, insert or a chain) also takes ef=0|1: error
 * feedback for gradients ("quant:bits=2,ef=1"). The encoder keeps, per
 * micro-batch slot (EPIPE_CODEC_MICROBATCH; -1 is a slot of its own), the
 * residual x + r - decode(encode(x + r)) of its last encode and adds it to
 * the next input, so that what it drops is sent later. The payload is
 * that of the codec without ef (same format and parameter word; a decoder
 * need not have ef=1). A slot starts over at zero when the tensor's shape
 * or dtype changes; epipe_codec_reset_feedback() clears them all. Memory:
 * one fp32 copy of the tensor per slot, and one more per handle. CPU
 * tensors only.
 * The same codecs take delta=0|1[,delta_mb=M][,delta_strict=0|1][,delta_raw=0|1]:
 * activation deltas per sample (see "Activation deltas" below); on quant
 * and sortquant delta=1 implies zero=1 unless the spec gives zero.
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
    EPIPE_CODEC_THREADS = 1,
    /* The micro-batch the next encode or decode belongs to, -1 .. 2^31-1.
     * Trainable codecs (insert): with a value >= 0 the codec keeps what its
     * backward needs (encode: the input; decode: the code) under that key
     * until epipe_codec_encode_backward() / _decode_backward() of the same
     * micro-batch consumes it, or a later call with the same key replaces
     * it; -1 (the default) keeps nothing: inference. poweriter keys its
     * warm start by it (-1 shares the state of micro-batch 0), since one
     * handle encodes every micro-batch of a boundary in turn. The other
     * codecs ignore it. The stage runtime sets it before every call. */
    EPIPE_CODEC_MICROBATCH = 2
} epipe_codec_param;

/* Sets a knob. EPIPE_EINVAL for an unknown knob or a value out of range. */
EPIPE_API int epipe_codec_set_param(epipe_codec *codec, epipe_codec_param param, int64_t value);

/* The knob's current value in *value. EPIPE_EINVAL for an unknown knob. */
EPIPE_API int epipe_codec_get_param(const epipe_codec *codec, epipe_codec_param param,
                                    int64_t *value);

/* Clears the error-feedback residuals of every micro-batch slot (spec key
 * ef=1) and frees their memory: the next encode of each slot starts from
 * zero, as after creation. Call it when the gradients stop continuing the
 * previous ones (a new model, a restored checkpoint). With delta=1 it
 * empties the stored rows of every sample instead (reset the encoder and
 * the decoder of a boundary together). A no-op for a codec with neither.
 * EPIPE_EINVAL for NULL. Not thread-safe on one handle. */
EPIPE_API int epipe_codec_reset_feedback(epipe_codec *codec);

/* The value of the spec parameter `key` ("bits") as configured, defaults
 * and derived values filled in (what epipe_codec_spec() prints). A choice
 * ("mode=exact|sample|fit") gives the index of the choice in the order
 * docs/codecs.md lists them (sortquant mode: 0 exact, 1 sample, 2 fit); a
 * parameter the codec chooses per tensor (sortquant's split in fit mode
 * when not given) gives NaN; "ef" gives 0 or 1 on codecs that take it.
 * EPIPE_EINVAL
 * for a key the codec does not have (the message lists its keys); a chain
 * has no parameters of its own (read its links' in its spec). */
EPIPE_API int epipe_codec_spec_param(const epipe_codec *codec, const char *key, double *value);

/* The range a spec parameter accepts, without creating a codec: for codec
 * name `codec` ("sortquant") and `key` ("bits"), the smallest and largest
 * value in *min and *max (inclusive; a choice gives 0 and the count of
 * choices less one). A value in range may still be refused by the codec's
 * rules across parameters (sortquant: split < bits). EPIPE_EINVAL for an
 * unknown codec or key. Thread-safe. */
EPIPE_API int epipe_codec_param_bounds(const char *codec, const char *key, double *min,
                                       double *max);

/* The largest payload epipe_codec_encode() can write for a tensor of src's
 * dtype and shape (src->data is not read). Plan buffers with it once; the
 * bound depends only on the element count, the dtype and the spec (for
 * poweriter also on the shape, which fixes its matrix view; with delta=1
 * on the rows, dimension 0, and an encode may write less than it).
 * EPIPE_EINVAL if src is not a tensor the codec accepts (the message says
 * why), EPIPE_EOVERFLOW if the size would overflow size_t, EPIPE_ENOTSUP for
 * a CUDA tensor the CUDA backend cannot take (see "CUDA tensors" below).
 * It changes neither the
 * codec's configuration nor its state; like every call it records its
 * error on the handle, so it must not run while another thread uses the
 * same handle. */
EPIPE_API int epipe_codec_max_encoded_size(const epipe_codec *codec, const DLTensor *src,
                                           size_t *bytes);

/* Encodes src into dst[0..capacity). src: fp32 (any codec), fp16 or bf16;
 * on the CPU (kDLCPU or kDLCUDAHost): any shape and any strides, contiguous
 * or not, any byte_offset (data off element boundaries are read through a
 * copy); dst, and decode's src, at any address; or on a CUDA device (kDLCUDA, dense: see "CUDA tensors" below).
 * The codec core picks the codec's backend from src's DLPack device
 * (docs/codec-backends.md). The CPU backend is synchronous: when the call
 * returns, dst holds the payload and src may be reused; the CUDA backend
 * enqueues on a stream. The payload begins with a 16-byte header naming the codec, its
 * parameters, the source dtype and the element count (docs/codecs.md), so
 * a decoder can check that it was made for it.
 *
 * Returns EPIPE_OK and the payload length in *written; EPIPE_ENOSPC if
 * capacity is below epipe_codec_max_encoded_size(); EPIPE_EINVAL for an
 * unsupported dtype or device, or, for the quantizers, a NaN or infinity in
 * src (the message gives its index); EPIPE_ENOTSUP for a CUDA tensor the
 * CUDA backend cannot take. src is only read; the caller keeps
 * ownership of src and dst. The same input gives the same bytes whatever
 * the thread count. May block while its worker threads run. */
EPIPE_API int epipe_codec_encode(epipe_codec *codec, const DLTensor *src, void *dst,
                                 size_t capacity, size_t *written);

/* Decodes the payload src[0..len) into dst, which the caller allocates and
 * owns: fp32, fp16 or bf16, on the CPU, any strides, with exactly as many
 * elements as were encoded (the shape itself may differ; with delta=1 its
 * dimension 0 must be the encoded rows). Every byte of src
 * is treated as hostile: EPIPE_EPROTO if the payload was made by another
 * codec or other parameters or is malformed, EPIPE_ETRUNC if it is short,
 * EPIPE_EINVAL if dst's element count, dtype or device does not fit. On
 * error dst may have been partly written. */
EPIPE_API int epipe_codec_decode(epipe_codec *codec, const void *src, size_t len, DLTensor *dst);

/* ---- Trainable codecs ---------------------------------------------------
 *
 * A trainable codec (today: insert) has parameters that learn with the
 * model. Its encoder computes a code from the input with the compress
 * parameters; its decoder restores the tensor from the code with the
 * restore parameters. The two are separate parameter sets: the sender's
 * handle trains the compress set, the receiver's the restore set (each
 * handle holds both; the one it does not use keeps zero gradients).
 *
 * Backward is keyed by micro-batch: set EPIPE_CODEC_MICROBATCH before an
 * encode or decode so the codec keeps what the backward needs. Gradients
 * accumulate (+=) across backward calls until epipe_codec_zero_grad().
 * The other codecs return EPIPE_ENOTSUP from every call below except
 * epipe_codec_trainable() and epipe_codec_code_shape().
 *
 * Experimental (EPIPE_EXPERIMENTAL, docs/api.md): these calls may change
 * in a minor release. */

#define EPIPE_CODEC_MAX_NDIM 16

/* 1 if the codec has parameters to train, else 0 (and 0 for NULL). */
EPIPE_EXPERIMENTAL int epipe_codec_trainable(const epipe_codec *codec);

/* The shape of the code the codec computes for a tensor of src's shape
 * (src->data is not read): the shape of the gradient the decoder's
 * backward produces and the encoder's backward consumes. For codecs that
 * are not trainable the code's shape is src's. EPIPE_EINVAL for a shape
 * the codec cannot take. shape must have room for EPIPE_CODEC_MAX_NDIM. */
EPIPE_EXPERIMENTAL int epipe_codec_code_shape(epipe_codec *codec, const DLTensor *src, int *ndim,
                                              int64_t shape[EPIPE_CODEC_MAX_NDIM]);

/* How many parameter tensors the codec has (insert: 2). */
EPIPE_EXPERIMENTAL int epipe_codec_num_tensors(epipe_codec *codec, unsigned *count);

/* Parameter tensor `index`: its name ("compress.weight"), the parameter
 * and its gradient, as dense fp32 CPU DLTensor views. All three are owned
 * by the codec and stay valid, at the same addresses, until
 * epipe_codec_destroy(); the host may read them, and may write the
 * parameter (its own optimizer) between codec calls, never during one.
 * Any output pointer may be NULL. EPIPE_ESTATE if the parameters do not
 * exist yet (insert creates them when it learns the channel count: give
 * `in=` in the spec, or encode or decode once first); EPIPE_EINVAL for an
 * index out of range. */
EPIPE_EXPERIMENTAL int epipe_codec_tensor(epipe_codec *codec, unsigned index, const char **name,
                                          DLTensor **param, DLTensor **grad);

/* Encoder backward for `microbatch` (kept by its encode, see
 * EPIPE_CODEC_MICROBATCH): given grad_code, the gradient of the loss with
 * respect to the code (epipe_codec_code_shape() of the input), writes
 * grad_input (the input's shape) and adds the compress parameters'
 * gradient. Both tensors are the caller's: fp32/fp16/bf16, CPU (any
 * strides) or CUDA (dense; copied through host memory, synchronously, as
 * "CUDA tensors" below says). The kept input is released. EPIPE_ESTATE if nothing is kept
 * for that micro-batch; EPIPE_EINVAL for a shape that does not match. */
EPIPE_EXPERIMENTAL int epipe_codec_encode_backward(epipe_codec *codec, unsigned microbatch,
                                                   const DLTensor *grad_code, DLTensor *grad_input);

/* Decoder backward for `microbatch` (kept by its decode): given
 * grad_output, the gradient with respect to the restored tensor, writes
 * grad_code (the code's shape) and adds the restore parameters' gradient.
 * Ownership and errors as epipe_codec_encode_backward(). */
EPIPE_EXPERIMENTAL int epipe_codec_decode_backward(epipe_codec *codec, unsigned microbatch,
                                                   const DLTensor *grad_output,
                                                   DLTensor *grad_code);

/* Sets every parameter gradient to zero. */
EPIPE_EXPERIMENTAL int epipe_codec_zero_grad(epipe_codec *codec);

/* The built-in optimizer, SGD with momentum (PyTorch's form, no dampening):
 * v = momentum*v + grad; param -= lr*v, for every parameter tensor. The
 * gradients are left as they are (call epipe_codec_zero_grad()).
 * lr in [0, 1e6], momentum in [0, 1); EPIPE_EINVAL otherwise. */
EPIPE_EXPERIMENTAL int epipe_codec_sgd_step(epipe_codec *codec, double lr, double momentum);

/* ---- Activation deltas (spec key delta=1, experimental) ------------------
 * With delta=1 (docs/codecs.md, "Activation deltas"; AQ-SGD) each row of
 * dimension 0 of an encoded tensor is one sample: the encoder sends the
 * change of the sample's row since the sample last crossed (a first
 * sighting in full: raw fp32 with delta_raw=1, the default, or through the
 * codec with delta_raw=0), and both encoder and decoder keep, per sample id, the
 * last row the decoder reconstructs, within delta_mb MiB per handle. */

/* The sample ids of the rows (dimension 0) of the tensor of the next
 * epipe_codec_encode() on this handle: n must equal that dimension, and
 * the ids must be distinct. The ids are copied; an encode that reaches
 * the codec consumes them (even one that fails), so set them before every
 * encode. NULL ids (n still the rows) make the next encode's rows
 * untracked, for evaluation passes or rows without ids: sent in full and
 * kept by neither side. EPIPE_EINVAL for a handle without delta=1. Not
 * thread-safe on one handle. */
EPIPE_EXPERIMENTAL int epipe_codec_set_samples(epipe_codec *codec, const uint64_t *ids, size_t n);

/* The sample ids of the rows of the last successful epipe_codec_decode()
 * on this delta=1 handle: *ids (NULL for untracked rows) and their count
 * in *n, owned by the handle and valid until its next decode. A receiving
 * stage passes them on to the encoder of its own output. EPIPE_ESTATE when
 * there was none, or the last decode that got past the payload header
 * failed; EPIPE_EINVAL for NULL. */
EPIPE_EXPERIMENTAL int epipe_codec_decoded_samples(const epipe_codec *codec, const uint64_t **ids,
                                                   size_t *n);

/* Counters of a delta=1 handle, encoder or decoder (zero for others). */
typedef struct epipe_codec_delta_info {
    uint64_t stored_samples; /* rows kept now */
    uint64_t stored_bytes;   /* their values: stored_samples x row values x 4 */
    uint64_t full_rows;      /* rows sent in full and kept (first sightings) */
    uint64_t delta_rows;     /* rows sent as deltas */
    uint64_t fallback_rows;  /* rows sent in full, not kept: delta_mb was full */
    uint64_t untracked_rows; /* rows sent in full, not kept: NULL ids */
} epipe_codec_delta_info;

/* Copies the counters into *info. EPIPE_EINVAL for NULL. */
EPIPE_EXPERIMENTAL int epipe_codec_delta_stats(const epipe_codec *codec,
                                               epipe_codec_delta_info *info);

/* ---- CUDA tensors (experimental) -----------------------------------------
 *
 * epipe_codec_encode() and epipe_codec_decode() accept kDLCUDA (and
 * kDLCUDAManaged) tensors when libepipe finds its CUDA module
 * (libepipe-cuda.so: $EPIPE_CUDA_MODULE, else epipe/ beside libepipe, else
 * the install path), the CUDA driver and a device; otherwise EPIPE_ENOTSUP
 * with a message naming what is missing (no module, no driver, no device).
 * The module is loaded once, by the first call that needs it, and kept:
 * EPIPE_CUDA_MODULE is not read after that.
 * CUDA tensors must be dense and aligned to their element size.
 *
 * Kernels exist for none, cast, quant (rows=1 and group=K too), sortquant in its three
 * modes, topk, kmeans and poweriter (its own kernels up to rank 8, cuBLAS
 * above; its payloads are the CPU's within a tolerance,
 * docs/codec-backends.md), and insert (cuDNN and cuBLAS, within a
 * tolerance), with or without error feedback (ef=1). Chains, activation
 * deltas (delta=1), and poweriter and insert where cuBLAS or cuDNN is not
 * found at run time, run on
 * the CPU backend through host staging: the tensor is copied to host
 * memory on the handle's stream, encoded there, and the payload copied to
 * a device buffer if it is one (decode: the reverse). Such a call is
 * synchronous (its copies are complete when it returns), its payload is
 * the CPU's byte for byte, the whole tensor crosses PCIe, and a trainable
 * codec's parameters and their gradients (epipe_codec_tensor()) stay CPU
 * tensors; its backward calls take CUDA gradients the same way.
 *
 * Payload buffers: host memory (pinned, cudaHostAlloc, for the copies to
 * be fast; pageable works and makes the call wait for the copy) or CUDA
 * device memory on the tensor's device, in which case the kernels write
 * and read the payload in place and nothing crosses PCIe. A device
 * payload of the length its values take, for none, cast, quant, topk,
 * poweriter and insert on their kernels (insert forward only:
 * EPIPE_CODEC_MICROBATCH -1) and sortquant's sample and exact modes, is
 * decoded without a wait: its
 * 16-byte header and the few bytes the host checks (tables, padding) are
 * copied back on the handle's stream, after the work already there, and
 * checked at the next epipe_codec_synchronize() (below). For the other
 * codecs, a payload of another length, and with EPIPE_CUDA_DEFER_CHECKS=0
 * in the environment when the handle was made (1, the default: deferred;
 * another value makes such decodes EPIPE_EINVAL naming it), the decode first reads those bytes in one wait
 * on the stream and checks them at once. Either way a
 * payload written on that stream is read after it is complete. A device
 * payload with a CPU tensor is EPIPE_EINVAL naming it.
 *
 * Binding: a handle binds to the device of the first tensor it encodes or
 * decodes (the CPU, or CUDA device i); a tensor on another device later is
 * EPIPE_EINVAL naming both. Use one handle per device. A call that fails
 * binds nothing; one that returns EPIPE_OK binds, even where the next
 * synchronize then refuses its payload (its work ran on that device).
 *
 * Asynchrony: on a CUDA tensor, encode and decode enqueue their work on
 * the handle's stream and return; EPIPE_OK means enqueued. *written and the
 * header are final at return. The source tensor (encode), the destination
 * tensor (decode) and the payload buffer must stay valid and unchanged
 * until the stream reaches the work: reuse them only after
 * epipe_codec_synchronize() or after an event recorded on the stream.
 * One exception: `sortquant` mode=fit (its default) plans its chunks on the
 * host from the tensor's extent and a sample, so its encode waits for the
 * stream once, mid-call, before it enqueues the codes (kmeans too: once,
 * or twice above its sampling threshold; poweriter once, before it writes
 * the payload, so that it refuses what the CPU refuses at once); and with ef=1 an
 * encode waits once, between the encode and the decode of its own payload
 * (the decoders check its tables on the host), so a value that is not
 * finite is refused by that call, the residual kept.
 * On CPU tensors every call is synchronous, as before.
 *
 * Errors: argument, tensor, header, size and capacity errors, and a bad
 * table or padding in a payload to decode (read on the host, as above),
 * are returned at once with the CPU's statuses, but for a device payload
 * decoded without a wait (above), whose bad header, table or padding the
 * next epipe_codec_synchronize() returns (or epipe_codec_set_stream(),
 * which waits the same way), with the CPU's status and message, instead
 * of any error that payload's decode kernels found; of several such
 * decodes since, the first bad payload's. Against an error an encode
 * noted, the earlier call's is returned and the other kept for the next
 * synchronize. An encode or backward on the handle in between first
 * waits for such decodes and checks them, keeping a failure for
 * synchronize, so that what their kernels noted is not its error. Errors that depend
 * on values a kernel sees are recorded on the device and returned by the next
 * epipe_codec_synchronize(): a NaN or infinity given to a quantizer or to
 * topk (EPIPE_EINVAL naming the first index), and a bad topk entry or
 * poweriter scale or factor in a payload to decode (EPIPE_EPROTO naming
 * the first entry: index out of range or order, value not finite or out of
 * its range). The payload of such an encode, or the
 * tensor of such a decode, is garbage and must not be used. A failed CUDA call is
 * EPIPE_ENOMEM (allocation) or EPIPE_EIO with the CUDA error's name and
 * text. A sticky CUDA error (an illegal address, from any kernel of the
 * process) is reported the same way by every later call: the CUDA context
 * is lost and only a new process recovers. */

/* Sets the cudaStream_t (passed as void *) the handle's CUDA work is
 * ordered on; NULL (the default) is the legacy default stream. A stream
 * belongs to one device: a CUDA tensor on another is EPIPE_EINVAL naming
 * both devices (the default streams serve every device; a module built
 * before CUDA 12.8, which cannot ask, does not check). Work already
 * enqueued on the previous stream is waited for first, and its deferred
 * status returned (the stream is set whatever it is). The CPU backend
 * stores and ignores it. Not thread-safe: one thread per handle. */
EPIPE_EXPERIMENTAL int epipe_codec_set_stream(epipe_codec *codec, void *stream);

/* Blocks until the work enqueued by the handle on its stream is done and
 * returns the first deferred error since the last call (then cleared), or
 * EPIPE_OK. EPIPE_OK at once for a handle that never ran CUDA work.
 * epipe_codec_destroy() waits the same way for a handle that queued work
 * since its last synchronize (so the stream must stay valid until then),
 * and a value or payload refused there, which no call returned, is logged
 * as a warning (subsystem "codec") naming the handle's spec and the error
 * (a CUDA error is not: every call since returned it). */
EPIPE_EXPERIMENTAL int epipe_codec_synchronize(epipe_codec *codec);

#ifdef __cplusplus
}
#endif
#endif /* EPIPE_CODEC_H */
