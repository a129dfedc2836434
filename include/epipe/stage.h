/* libepipe stage runtime: runs one pipeline stage's share of a schedule,
 * compressing and moving activations and gradients across its boundaries. */
#ifndef EPIPE_STAGE_H
#define EPIPE_STAGE_H

#include <dlpack/dlpack.h>
#include <epipe/codec.h>
#include <epipe/comm.h>
#include <epipe/common.h>
#include <epipe/schedule.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque stage: the stage whose index is its communicator's rank, in a
 * pipeline of as many stages as the communicator has ranks. With chunks
 * (virtual stages, see "The op stream"), one handle serves every pipeline
 * stage its rank holds; "stage" in a message then means the rank.
 *
 * The host owns the model and does the compute; the stage owns the
 * schedule, the codecs of its two boundaries, and the messages. Boundary b
 * joins stage b and stage b+1: activations cross it forward (encoded by b,
 * decoded by b+1), gradients backward (encoded by b+1, decoded by b).
 *
 * Drive a stage in one of two ways, one step (mini-batch) at a time:
 *  - callbacks: epipe_stage_set_callbacks(), then epipe_stage_step();
 *  - the op stream, for hosts with their own control flow (autograd):
 *    epipe_stage_next_op() says which compute op comes next, and the host
 *    calls the matching receive before it and send after it (see below).
 *
 * Thread safety: one thread at a time per handle; distinct stages (one per
 * thread, over epipe_comm_create_inproc) are independent. Calls may block
 * in receives for up to the timeout (EPIPE_STAGE_TIMEOUT_MS). A call that
 * drives the stage (the op stream, epipe_stage_step and _drain, the
 * setters, epipe_stage_reset_stats, the codecs' SGD step) made while
 * another thread is inside one is refused with EPIPE_ESTATE naming the
 * call inside, and changes nothing; its message is in epipe_last_error()
 * (the stage's own belongs to the thread inside), and a refused
 * epipe_stage_reset_stats resets nothing. epipe_stage_get_stats and
 * epipe_stage_get_boundary_stats may be called from any thread (see
 * there). epipe_stage_destroy while another thread is inside such a call
 * is not carried out (an error is logged, the stage is not freed), as from
 * inside a callback; a destroy that races the start of another thread's
 * call is not detected. */
typedef struct epipe_stage epipe_stage;

/* Returned in epipe_op.kind by epipe_stage_next_op() when the step is over. */
#define EPIPE_OP_NONE 0u

/* Creates a stage on comm running schedule `schedule` (a kind name of
 * epipe/schedule.h: "gpipe", "1f1b", ...) with `microbatches` micro-batches
 * per step, in the kind's default layout. The stage borrows comm, which
 * must outlive it. Codecs default to "none" on every boundary. Returns
 * EPIPE_OK; EPIPE_EINVAL for a NULL argument, an unknown schedule or a bad
 * micro-batch count (the message says which); EPIPE_ENOMEM. On error *out
 * is NULL. The caller frees the stage with epipe_stage_destroy(). */
EPIPE_API int epipe_stage_create(epipe_stage **out, epipe_comm *comm, const char *schedule,
                                 unsigned microbatches);
/* The same with the schedule's layout (epipe/schedule.h): chunks per rank
 * and the placement of the pipeline stages on ranks; NULL = the kind's
 * default, as epipe_stage_create(). The layout is read during the call
 * only. Errors as epipe_stage_create(), and those of
 * epipe_schedule_create_layout() (a placement or chunk count the kind
 * cannot use, a rank that holds no stage). Every rank must pass the same
 * schedule, micro-batch count and layout: a rank that does not is found
 * at the first message (EPIPE_EPROTO naming both kinds). */
EPIPE_API int epipe_stage_create_layout(epipe_stage **out, epipe_comm *comm, const char *schedule,
                                        unsigned microbatches, const epipe_schedule_layout *layout);

/* Frees the stage, its codecs and every buffer it lent. Messages still in
 * flight to peers are delivered first on the transports that queue them.
 * NULL is a no-op. From inside one of the stage's callbacks it frees
 * nothing and logs an error (see "Callbacks"). */
EPIPE_API void epipe_stage_destroy(epipe_stage *stage);

/* Which way a tensor crosses a boundary. */
typedef enum epipe_direction {
    EPIPE_DIR_ACTIVATION = 0, /* forward: stage b to b+1 */
    EPIPE_DIR_GRADIENT = 1    /* backward: stage b+1 to b */
} epipe_direction;

/* The `boundary` argument of epipe_stage_set_codec() meaning all of them. */
#define EPIPE_ALL_BOUNDARIES (~0u)

/* Sets the codec spec (epipe/codec.h) for one direction of one boundary, or
 * of every boundary. Both stages of a boundary must set the same spec: a
 * payload from another codec is refused with EPIPE_EPROTO. Only allowed
 * before the first step. EPIPE_EINVAL for a spec that fails to parse (the
 * message is the parser's) or a boundary >= stages-1; EPIPE_ESTATE after
 * the first step. Boundaries that do not touch this stage are checked and
 * ignored, so every rank may run the same configuration code. The spec key
 * ef=1 (error feedback) is for the gradient direction only: EPIPE_EINVAL
 * on the activation direction; the decoding side ignores it. The spec key
 * delta=1 (activation deltas, see epipe_stage_set_samples()) is for the
 * activation direction only: EPIPE_EINVAL on the gradient direction. */
EPIPE_API int epipe_stage_set_codec(epipe_stage *stage, epipe_direction dir, unsigned boundary,
                                    const char *spec);

/* ---- Activation deltas (experimental) -----------------------------------
 *
 * With an activation codec spec that has delta=1 (epipe/codec.h, "Activation
 * deltas"), each row of dimension 0 of an activation is one sample, and the
 * boundary sends the change of each sample's row since it last crossed.
 * The host names the samples on the first pipeline stage only: before it
 * sends micro-batch `microbatch`'s activation, epipe_stage_set_samples()
 * with the rows' ids (distinct, typically the data set indices). The ids
 * are copied at the call; they go with the next send of that micro-batch's
 * activation and are then forgotten (even by a send that fails), so set
 * them every step (before the step or in the forward, before the send).
 * n must equal the activation's dimension 0: the send refuses another
 * count with EPIPE_EINVAL naming both. NULL ids (n still the rows) send the rows untracked (in full, kept
 * by neither side). Later stages need nothing: the ids come with each
 * decoded activation and go on with the activation the stage sends for the
 * same micro-batch (also across boundaries between chunks of one rank).
 * delta=1 on a boundary therefore needs it on every boundary between ranks
 * before it (a boundary within a rank passes them on in any case). A
 * training send on a delta=1 boundary without ids fails with EPIPE_EINVAL
 * saying what to call; steps with EPIPE_STAGE_TRAINING = 0 send every row
 * untracked, ids or not. Without delta=1 the ids are checked and ignored.
 * EPIPE_EINVAL for a NULL stage, a micro-batch out of range, or a rank that
 * does not hold the first pipeline stage; EPIPE_ENOMEM. Never blocks; same
 * thread rules as every call on the stage. */
EPIPE_EXPERIMENTAL int epipe_stage_set_samples(epipe_stage *stage, unsigned microbatch,
                                               const uint64_t *ids, size_t n);

/* Knobs, set with epipe_stage_set_param(). */
typedef enum epipe_stage_param {
    /* How long a receive waits, in ms (1 .. 86400000). Until it is set,
     * the communicator's EPIPE_COMM_TIMEOUT_MS as it is at each receive. */
    EPIPE_STAGE_TIMEOUT_MS = 1,
    /* Worker threads for each codec call (as EPIPE_CODEC_THREADS). Default 1:
     * the host's compute usually owns the other cores. */
    EPIPE_STAGE_CODEC_THREADS = 2,
    /* The mini-batch size, when the host wants it checked: it must divide
     * by the micro-batch count (else EPIPE_EINVAL), and every tensor sent
     * must then have batch/microbatches rows in dimension 0. 0 = unchecked
     * (the default). */
    EPIPE_STAGE_BATCH_SIZE = 3,
    /* 1 (the default): steps run the schedule, forwards and backwards.
     * 0: steps run forwards only, micro-batch by micro-batch (evaluation,
     * inference): no backward op, no gradient crosses, and a received
     * activation is lent only until the next op. Every stage must switch
     * for the same steps. Only between steps (EPIPE_ESTATE otherwise). */
    EPIPE_STAGE_TRAINING = 4,
    /* Where received tensors live. -1 (the default): host memory. d >= 0:
     * the memory of CUDA device d, decoded there by the boundary's codecs
     * (EPIPE_ENOTSUP, naming what is missing, without the CUDA backend, a
     * driver or a device; EPIPE_EINVAL for a device that does not exist).
     * Sent tensors may be CPU or CUDA tensors either way (each boundary's
     * codec handles keep to the device of their first tensor). With CUDA
     * tensors a send returns once the payload is complete (in host memory,
     * or in device memory for a peer in this process, below) and a
     * receive once the tensor is decoded, so both may be used from any
     * stream; the codecs run on the stream of epipe_stage_set_cuda_stream()
     * (the legacy default stream until it is set). A lent CUDA tensor's
     * memory is written again, on that stream, by the call that ends its
     * lending or a later one: the host's work that reads it on another
     * stream must have finished by then (or that stream be the stage's).
     * Only between steps (EPIPE_ESTATE otherwise), and only until the
     * first tensor is received: a codec handle keeps to the memory of its
     * first tensor, so a change after that is EPIPE_ESTATE naming where
     * the stage's codecs write. A boundary whose trainable codec runs in
     * the stage back-propagates the code gradient into the memory received
     * tensors go to, so its activations must be sent from there (a CUDA
     * activation on device d needs d here; EPIPE_EINVAL otherwise).
     * Setting d >= 0 also makes the stage's communicator keep pinned
     * message buffers (EPIPE_COMM_BUFFER_CACHE in epipe/comm.h), so that
     * payloads cross PCIe in one DMA each, unless the environment has
     * EPIPE_CUDA_PINNED_MESSAGES=0 (1, the default: pinned; another value
     * is EPIPE_EINVAL naming it). Between ranks that are threads of one
     * process (inproc), when both stages set this knob to a device, a CUDA
     * tensor on d sent from one to the other has its payload encoded into
     * device memory of d, never crossing to the host (payloads of 4 KiB
     * and up; the sender's communicator keeps up to 32 such buffers and
     * EPIPE_COMM_BUFFER_CACHE bytes of device memory alive), unless the
     * environment has EPIPE_CUDA_DEVICE_MESSAGES=0 (same values). A
     * receiver on d decodes it there; one on another device e first copies
     * it from d to e, into a buffer the stage keeps (host memory where e
     * has none to spare), with one copy on the stage's stream, which the
     * receive waits for; peer to peer where the GPUs can: the library
     * enables e's peer access to d, once, as PyTorch does, and it stays
     * enabled. A message sent before its receiver
     * set the knob goes through the host. A communicator keeps to the
     * first device a stage on it named: a stage set to d and then to e
     * sends through the host, and one set back to -1 has the device
     * payloads it still gets copied to the host for their decode. With
     * EPIPE_STAGE_CUDA_STREAM_ORDERED set, sends and receives return
     * earlier (below). */
    EPIPE_STAGE_CUDA_DEVICE = 5,
    /* 0 (the default): a send of a CUDA tensor returns once its payload is
     * complete and a receive once its tensor is written, as above. 1:
     * stream-ordered, as a CUDA library call is: a receive into a CUDA
     * tensor returns once its decode is queued on the stage's stream
     * (epipe_stage_set_cuda_stream), and a send whose payload stays in
     * device memory (a peer of this process on a device, see
     * EPIPE_STAGE_CUDA_DEVICE) once its encode is queued there, carrying
     * a fence the receiver's stream waits for on the device: the host
     * waits for neither, and keeps the GPU's queue full. Still waiting:
     * sends through host memory (TCP; payloads under 4 KiB; a peer on
     * the host; the sender's device buffers all out), as the transport
     * reads the bytes; receives of a trainable codec's code gradient, of
     * delta=1 payloads and of device payloads copied to another memory (a
     * sender on another device: the receive waits for the encode, on the
     * host, then for the copy and the decode); hand-overs between chunks
     * of this rank; and what a
     * codec waits for itself (ef=1, kmeans, poweriter, sortquant's fit
     * mode, insert while training, a decode that reads its header first:
     * docs/codec-backends.md). The host then keeps to the stream's order:
     * a received tensor is read, and a sent one written again or freed, by
     * work queued on the stage's stream after the call (or after waiting
     * for that stream). What the device finds (a non-finite value sent
     * through a quantizer, a bad payload's deferred checks, a CUDA error)
     * is reported by the call that ends the step (epipe_stage_next_op at
     * the step's end, which still ends it, or epipe_stage_step), which
     * waits for the stage's CUDA work once a step, or by an earlier send
     * or receive that waits in the stage (above), or by
     * epipe_stage_set_cuda_stream: the first error found, the stage's own
     * encodes' first, then a received payload's verdict (below), then its
     * decodes'. (A wait inside a codec's own call may still report a CUDA
     * error that earlier work left as its own: CUDA's sticky errors belong
     * to the process.) A fence also carries its sender's
     * verdict on the encode, and what the sender's stage had been passed,
     * so every later stage fails its step too rather than end it with
     * what a refused encode wrote, or what it made of it. The communicator
     * is then aborted (epipe_comm_abort: the peers' calls fail rather than
     * wait), and every later op-stream call and wait reports the same
     * error. A received message, and with it the sender's device buffer,
     * is held until its decode is done on the device, which a later
     * receive finds without waiting, or until that wait; a stage holds at
     * most 32 (with 32 held and none done, the next receive waits first).
     * A sender has at most 32 device
     * buffers alive (and EPIPE_COMM_BUFFER_CACHE bytes), past which its
     * sends go through host memory and wait: so where the GPU falls far
     * behind the host, or payloads are over a 32nd of the cache, part of
     * the gain is lost. Only between steps (EPIPE_ESTATE
     * otherwise); 0 or 1 (EPIPE_EINVAL otherwise). No effect on CPU
     * tensors. */
    EPIPE_STAGE_CUDA_STREAM_ORDERED = 6
} epipe_stage_param;

EPIPE_API int epipe_stage_set_param(epipe_stage *stage, epipe_stage_param param, int64_t value);
/* The cudaStream_t (passed as void *) every codec of the stage enqueues
 * its CUDA work on, and that a CUDA tensor handed between two chunks of
 * this rank is copied on; NULL (the default) is the legacy default stream.
 * A host that computes on its own stream sets it so that the encode of a
 * sent tensor follows the kernels that made it, with no device-wide wait.
 * Sends and receives still return with their work complete, as
 * EPIPE_STAGE_CUDA_DEVICE says, unless EPIPE_STAGE_CUDA_STREAM_ORDERED. Work on the previous stream is waited for
 * first, and its error returned (the stream is set whatever it is). The
 * stream must outlive the stage or the next call. Any time between calls
 * on the stage, mid-step too (the Python binding follows torch's current
 * stream at each send); a stage without CUDA tensors ignores it. */
EPIPE_EXPERIMENTAL int epipe_stage_set_cuda_stream(epipe_stage *stage, void *stream);

/* The current value of a knob in *value: what epipe_stage_set_param() last
 * set, or the default (EPIPE_STAGE_TIMEOUT_MS: the communicator's timeout
 * as it is now, until the stage sets its own). EPIPE_EINVAL for a NULL argument or an
 * unknown param, with the message in epipe_last_error() (the handle is
 * const); *value is then left alone. Never blocks; same thread rules as
 * every call on the stage. */
EPIPE_API int epipe_stage_get_param(const epipe_stage *stage, epipe_stage_param param,
                                    int64_t *value);

EPIPE_API unsigned epipe_stage_index(const epipe_stage *stage);
EPIPE_API unsigned epipe_stage_count(const epipe_stage *stage);
/* The chunks (model chunks, virtual stages) this rank holds: 1 for the
 * classic schedules; 0 for NULL. */
EPIPE_API unsigned epipe_stage_chunks(const epipe_stage *stage);
/* The pipeline stage that chunk `chunk` of this rank is, and how many the
 * pipeline has (either pointer may be NULL). EPIPE_EINVAL for NULL or a
 * chunk out of range; the message goes to epipe_last_error() (the handle
 * is const). Never blocks. */
EPIPE_API int epipe_stage_chunk_stage(const epipe_stage *stage, unsigned chunk,
                                      unsigned *pipeline_stage, unsigned *pipeline_stages);
/* The schedule the stage runs; owned by the stage. */
EPIPE_API const epipe_schedule *epipe_stage_schedule(const epipe_stage *stage);
/* The message of the last failing call on this handle, or "". */
EPIPE_API const char *epipe_stage_last_error(const epipe_stage *stage);

/* ---- Trainable codecs ---------------------------------------------------
 *
 * When a boundary's activation codec is trainable (insert), the stage runs
 * its backward: the receiving stage back-propagates the host's gradient
 * through the restore and sends the gradient of the *code* (the code's
 * shape, encoded by the boundary's gradient codec); the sending stage
 * back-propagates that through the compress and hands the host the
 * gradient of the activation it sent. The host sees the same shapes as
 * with any other codec. Gradient codecs cannot be trainable (set_codec
 * answers EPIPE_ENOTSUP). docs/runtime.md shows the flow. */

/* Which of a stage's two boundaries. */
typedef enum epipe_boundary_side {
    EPIPE_SIDE_DOWN = 0, /* to stage s+1: encodes activations, decodes gradients */
    EPIPE_SIDE_UP = 1    /* to stage s-1: decodes activations, encodes gradients */
} epipe_boundary_side;

/* The codec this stage uses for direction `dir` on boundary `side`, so
 * the host can reach a trainable codec's parameters and gradients
 * (epipe_codec_tensor()) for its own optimizer. Owned by the stage: valid
 * until epipe_stage_set_codec() replaces it or the stage is destroyed. Use
 * it only between the stage's calls, on the stage's thread; do not encode
 * or decode with it or change its knobs. NULL if the stage has no such
 * boundary (stage 0 has no UP side, the last stage no DOWN side). On a
 * rank with several chunks: the boundaries of its chunk 0. */
EPIPE_API epipe_codec *epipe_stage_codec(epipe_stage *stage, epipe_direction dir,
                                         epipe_boundary_side side);

/* The built-in optimizer for this stage's trainable codecs: one
 * epipe_codec_sgd_step(lr, momentum) and then epipe_codec_zero_grad() on
 * each (the compress of its DOWN activation codec, the restore of its UP
 * one). Call it between steps, like the host's own optimizer step; a stage
 * with no trainable codec does nothing. EPIPE_ESTATE mid-step, EPIPE_EINVAL
 * for lr outside [0, 1e6] or momentum outside [0, 1). */
EPIPE_EXPERIMENTAL int epipe_stage_codec_sgd_step(epipe_stage *stage, double lr, double momentum);

/* ---- The op stream ------------------------------------------------------
 *
 * epipe_stage_next_op() fills *op with the next compute op of this rank's
 * schedule, or with kind EPIPE_OP_NONE when the step is over; the call
 * after that starts the next step. op->chunk says which of the rank's
 * chunks (pipeline stages, see epipe_schedule_stage_of()) it runs; it is
 * 0 when the rank holds one. The receive and send calls below always refer
 * to the chunk of the op in progress, and their micro-batch must be the
 * op's (EPIPE_ESTATE otherwise). "First" and "last" below mean the first
 * and last pipeline stage; a chunk whose neighbour is on the same rank
 * receives and sends like any other (the stage hands the tensor over in
 * memory, through the boundary's codec only if the host set one).
 * For a FORWARD of micro-batch i the host:
 *   - on every pipeline stage but the first: epipe_stage_recv_activation(i)
 *     for its input (the first stage reads its own data);
 *   - computes; on every stage but the last: epipe_stage_send_activation(i).
 * For a BACKWARD, or a BACKWARD_INPUT (split backward: input gradient
 * only), of micro-batch i:
 *   - on every stage but the last: epipe_stage_recv_gradient(i) for the
 *     gradient of its output (the last stage starts from its loss);
 *   - computes; on every stage but the first: epipe_stage_send_gradient(i)
 *     (for BACKWARD_INPUT the gradient leaves at once: send it, then return
 *     to next_op, before computing weight gradients).
 * For a BACKWARD_WEIGHT of micro-batch i: the host computes the weight
 * gradients of i; it neither receives nor sends (EPIPE_ESTATE, naming the
 * op, if it tries).
 * A call out of this order, or for another micro-batch, returns
 * EPIPE_ESTATE with a message that says what was expected. A refused call
 * (this one, or a bad tensor's EPIPE_EINVAL) changes nothing: the op in
 * progress and the codecs' state stay as they were, so the host may make
 * the right call next.
 *
 * Tensor lifetimes: a received activation is owned by the stage and stays
 * valid until the backward of its micro-batch on that chunk is over (the
 * next epipe_stage_next_op() after its BACKWARD or BACKWARD_WEIGHT), so a
 * host may keep it for autograd without a copy. A received gradient stays
 * valid until the next epipe_stage_next_op(). A tensor the host sends is
 * encoded (or copied) before the send returns; the host may reuse it at
 * once (a stream-ordered CUDA stage, EPIPE_STAGE_CUDA_STREAM_ORDERED:
 * by work queued on its stream after the send). Sent tensors: fp32, fp16 or bf16, on the CPU (any strides) or on
 * a CUDA device (dense; EPIPE_STAGE_CUDA_DEVICE says where received
 * tensors go). Each
 * micro-batch may send its own shape on a boundary (variable sequence
 * lengths): the receiver gets the shape with the message. A gradient sent
 * back must have the shape and dtype of the activation received for that
 * micro-batch (EPIPE_EINVAL else, naming both shapes); a received gradient
 * is checked against the activation sent for it too (EPIPE_EPROTO).
 * Received tensors are dense, in the dtype and shape that was sent.
 *
 * Every tensor message carries a fingerprint of the sender's schedule
 * (kind, ranks, micro-batches, placement): a rank that receives one from a
 * peer running another schedule fails with EPIPE_EPROTO naming both
 * kinds, and aborts its communicator so that no peer waits.
 *
 * A step cannot be abandoned part way: next_op after a host gave up in
 * the middle of a step returns the rest of that step's ops. A host whose
 * own compute failed mid-step (as a callback returning nonzero does for
 * epipe_stage_step) calls epipe_comm_abort() so that its peers stop at
 * once rather than at their timeout, and destroys the stage. */
EPIPE_API int epipe_stage_next_op(epipe_stage *stage, epipe_op *op);
EPIPE_API int epipe_stage_recv_activation(epipe_stage *stage, unsigned microbatch,
                                          const DLTensor **input);
EPIPE_API int epipe_stage_send_activation(epipe_stage *stage, unsigned microbatch,
                                          const DLTensor *output);
EPIPE_API int epipe_stage_recv_gradient(epipe_stage *stage, unsigned microbatch,
                                        const DLTensor **grad_output);
EPIPE_API int epipe_stage_send_gradient(epipe_stage *stage, unsigned microbatch,
                                        const DLTensor *grad_input);
/* The op in progress (the last one next_op returned, or the one whose
 * callback runs now): callbacks learn their chunk (op->chunk) from it,
 * and, with 1f1b-async or 1f1b-2bw, the weights to use: op->weight_version
 * is then the number of updates the host had applied to the chunk when the
 * micro-batch's forward ran (a forward: the current weights; a backward:
 * the ones its forward used, which the host stashed). next_op gives the
 * same version.
 * EPIPE_ESTATE when no op is in progress (*op is then zeroed), EPIPE_EINVAL
 * for NULL; the message goes to epipe_last_error() (the handle is const).
 * Never blocks; same thread rules as every call on the stage. */
EPIPE_API int epipe_stage_current_op(const epipe_stage *stage, epipe_op *op);

/* ---- Callbacks ----------------------------------------------------------
 *
 * Fill with EPIPE_STAGE_CALLBACKS_INIT, then set what you need; struct_size
 * lets later versions add fields at the end. A callback returns 0, or any
 * nonzero value to stop the step: epipe_stage_step() then returns
 * EPIPE_ECALLBACK with a message naming the callback, the micro-batch and
 * the value, and aborts the communicator so the peers stop too.
 *
 *  forward(user, mb, input, &output): input is the received activation
 *      (NULL on the first stage); set *output to the activation to send
 *      (ignored on the last stage), valid until forward's caller returns.
 *  backward(user, mb, grad_output, &grad_input): grad_output is the
 *      received gradient (NULL on the last stage, which starts from its
 *      loss); set *grad_input to the gradient to send (ignored on stage 0).
 *  loss(user, mb, &value): optional, last stage only, after forward: the
 *      micro-batch's loss, summed into the statistics.
 *
 * Inside a callback the stage is in the middle of an op. A callback may
 * read it (epipe_stage_current_op, _get_param, _get_stats, _codec, ...)
 * and set the knobs that may change at any time; the calls that drive it
 * (next_op, the receives and sends, step, drain, set_callbacks, set_codec,
 * codec_sgd_step, EPIPE_STAGE_TRAINING, EPIPE_STAGE_CUDA_DEVICE) return
 * EPIPE_ESTATE naming the callback, and change nothing.
 * epipe_stage_destroy() there is not carried out: it logs an error and
 * returns, and the stage stays usable. */
typedef struct epipe_stage_callbacks {
    size_t struct_size;
    void *user;
    int (*forward)(void *user, unsigned microbatch, const DLTensor *input, const DLTensor **output);
    int (*backward)(void *user, unsigned microbatch, const DLTensor *grad_output,
                    const DLTensor **grad_input);
    int (*loss)(void *user, unsigned microbatch, double *value);
    /* Split backward (schedules that split it: epipe_schedule_splits_backward()).
     * backward_input(user, mb, grad_output, &grad_input) computes only the
     * gradient of the input (the stage sends it upstream as soon as it
     * returns); backward_weight(user, mb) later computes the weight
     * gradients of the same micro-batch and may then free what it kept
     * for it. Set both or neither. A host without them can still run a
     * splitting schedule: backward then runs whole at the input-gradient
     * op, and the weight-gradient op does nothing. Setting them for a
     * schedule that does not split is EPIPE_EINVAL. */
    int (*backward_input)(void *user, unsigned microbatch, const DLTensor *grad_output,
                          const DLTensor **grad_input);
    int (*backward_weight)(void *user, unsigned microbatch);
} epipe_stage_callbacks;

#define EPIPE_STAGE_CALLBACKS_INIT                                                                 \
    {                                                                                              \
        sizeof(epipe_stage_callbacks), NULL, NULL, NULL, NULL, NULL, NULL                          \
    }

/* Copies the callbacks (the stage keeps cb->user, not cb), between steps
 * (EPIPE_ESTATE in the middle of one, op stream included). A struct_size
 * from an older header leaves the fields it lacks NULL. EPIPE_EINVAL if
 * struct_size is 0 or larger than this library knows, forward is NULL,
 * neither backward nor the split pair is set, only one of the pair is
 * set, or the pair is set for a schedule that does not split (the message
 * names the schedule). */
EPIPE_API int epipe_stage_set_callbacks(epipe_stage *stage, const epipe_stage_callbacks *cb);

/* Runs one step: every op of this stage's schedule, calling the callbacks
 * and moving tensors. Blocks until the step is over on this stage. Errors:
 * those of the calls above, EPIPE_ESTATE if no callbacks are set or the
 * op stream is mid-step, EPIPE_EPEER / EPIPE_ETIMEDOUT from the transport. */
EPIPE_API int epipe_stage_step(epipe_stage *stage);

/* Schedules without a flush (1f1b-async, 1f1b-2bw; epipe/schedule.h):
 * steps leave the last micro-batches' backwards in flight, to run in the
 * next step's list. epipe_stage_drain() runs them now (the DRAIN list),
 * so that every weight gradient has reached the host: call it on every
 * stage before an evaluation (EPIPE_STAGE_TRAINING = 0 is refused while
 * micro-batches are in flight), a checkpoint, or the end of training. With
 * callbacks it runs the drain like epipe_stage_step() and returns when it
 * is over; without them the host runs it through the op stream
 * (epipe_stage_next_op() until EPIPE_OP_NONE). The step after a drain
 * starts the stream afresh (the FIRST list). The host's update rule:
 * 1f1b-async, one update of a chunk after each of its backwards;
 * 1f1b-2bw, one after each step and after the drain. A step that fails
 * loses the micro-batches in flight. EPIPE_OK at once for other schedules
 * or with nothing in flight; EPIPE_ESTATE mid-step; errors as
 * epipe_stage_step(). Experimental (docs/api.md), as the schedules it
 * serves. */
EPIPE_EXPERIMENTAL int epipe_stage_drain(epipe_stage *stage);

/* ---- Statistics ---------------------------------------------------------
 *
 * Totals since the stage was created (or last reset). Set struct_size to
 * sizeof(epipe_stage_stats) before the call; a later library fills only
 * the fields your struct has, so a host built against an older header
 * (a smaller struct) keeps working. "down" is the boundary to the next
 * stage, "up" the one to the previous stage (with several chunks, the sum
 * over the rank's boundaries to other ranks); raw bytes are the tensors'
 * own (elements x element size), wire bytes the messages' (framing
 * included). MB is 10^6 bytes.
 *
 * Live: both getters may be called from any thread while another thread
 * runs the stage (a monitor, a progress bar); they see the totals as of
 * the last op boundary or message, never a torn value. */
typedef struct epipe_stage_stats {
    size_t struct_size;
    uint64_t steps;
    double step_seconds;    /* wall time inside steps */
    double compute_seconds; /* in callbacks, or between op-stream calls, or
                               (stream-ordered) waiting for the GPU */
    /* the host's time in encodes and decodes (stream-ordered: queueing
     * them), and blocked waiting for a message; a stream-ordered stage's
     * wait for its step's CUDA work counts as compute */
    double encode_seconds, decode_seconds;
    double wait_seconds;
    uint64_t act_sent_raw, act_sent_wire;   /* down */
    uint64_t grad_recv_raw, grad_recv_wire; /* down */
    uint64_t act_recv_raw, act_recv_wire;   /* up */
    uint64_t grad_sent_raw, grad_sent_wire; /* up */
    double loss_sum;                        /* last stage: sum of loss() values */
    uint64_t loss_count;
    /* Since the fields above (issue 15). */
    uint64_t samples;          /* rows of the training steps: EPIPE_STAGE_BATCH_SIZE a step
                                    that runs forwards (0 while it is unset) */
    double samples_per_second; /* samples over the training steps' wall time */
    double bubble_fraction;    /* wait_seconds / step_seconds: the share of the steps spent
                                    waiting for a neighbour */
    double step_p50_seconds;   /* median and 99th percentile of the last */
    double step_p99_seconds;   /* EPIPE_STAGE_STATS_STEPS training steps' wall times */
    uint32_t boundaries;       /* records epipe_stage_get_boundary_stats() gives */
} epipe_stage_stats;

/* Steps the percentiles look back over. */
#define EPIPE_STAGE_STATS_STEPS 256u

EPIPE_API int epipe_stage_get_stats(const epipe_stage *stage, epipe_stage_stats *stats);
EPIPE_API void epipe_stage_reset_stats(epipe_stage *stage);

/* One boundary between this rank and another (boundaries between two
 * chunks of this rank move no bytes and have no record), both directions. */
typedef struct epipe_boundary_stats {
    size_t struct_size;           /* sizeof(epipe_boundary_stats), set by the caller */
    uint32_t boundary;            /* b: it joins pipeline stages b and b+1 */
    uint32_t peer;                /* the rank across it */
    uint32_t sends_activations;   /* 1: this rank holds stage b (sends activations,
                                      receives gradients); 0: it holds stage b+1 */
    uint64_t act_raw, act_wire;   /* activations across it, sent or received */
    uint64_t grad_raw, grad_wire; /* gradients across it */
    double act_mbps, grad_mbps;   /* wire MB/s over the steps' wall time */
    double act_peak_mbps;         /* the most wire bytes that crossed in any one-second */
    double grad_peak_mbps;        /*   window (in 100 ms buckets), per second */
} epipe_boundary_stats;

/* Record `index` (0 .. stats.boundaries-1, in pipeline order) into *out;
 * struct_size as for epipe_stage_get_stats(). EPIPE_EINVAL for NULL, a
 * struct_size below sizeof(size_t), or an index out of range (the message
 * gives the count); the message goes to epipe_last_error(). */
EPIPE_API int epipe_stage_get_boundary_stats(const epipe_stage *stage, uint32_t index,
                                             epipe_boundary_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* EPIPE_STAGE_H */
