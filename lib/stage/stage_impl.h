/* Internal to lib/stage/: the stage handle (one rank, all of its chunks) and
 * the small helpers that its files (setup, op stream, local hand-over, driver) share. */
#ifndef EPIPE_STAGE_IMPL_H
#define EPIPE_STAGE_IMPL_H

#include <epipe/codec.h>
#include <epipe/stage.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "../comm/comm_impl.h"
#include "../error.h"
#include "stage_raw.h"
#include "trace.h"

/* A tensor the stage decoded (or was handed locally) and lends to the host. */
struct lent_tensor {
    DLTensor t;
    int64_t shape[EPIPE_MAX_NDIM];
    void *buf;
    size_t cap;
    int on_cuda; /* buf is device memory of CUDA device `device` */
    int device;
};
/* Frees a lent tensor's memory, wherever it is. */
void epipe_stage_lent_free(struct lent_tensor *lt);

/* The shape and dtype of a tensor the stage sent for one micro-batch. */
struct tensor_meta {
    int set;
    DLDataType dtype;
    int ndim;
    int64_t shape[EPIPE_MAX_NDIM];
};

/* The sample ids of one micro-batch's activation (delta=1, samples.c). */
struct sample_ids {
    int set;       /* given for the next send of the micro-batch */
    int untracked; /* NULL ids: the rows are sent in full, kept by neither side */
    size_t n, cap;
    uint64_t *ids;
};

enum { DIR_ACT = EPIPE_DIR_ACTIVATION, DIR_GRAD = EPIPE_DIR_GRADIENT };

/* Bytes of one direction of a boundary, and the peak rate over a sliding
 * one-second window kept as ten 100 ms buckets (stats.c). */
#define STATS_BUCKETS 10
struct byte_count {
    uint64_t raw, wire;
    uint64_t bucket[STATS_BUCKETS];
    int64_t bucket_id[STATS_BUCKETS]; /* the 100 ms tick the bucket counts, or -1 */
    double peak_mbps;
};

/* A boundary between one of the rank's chunks and another rank. */
struct boundary_rec {
    int used;
    unsigned boundary, peer;
    int sends_act;
    struct byte_count act, grad;
};

/* One of the rank's chunks: one pipeline stage of the model. */
struct chunk {
    unsigned g;                    /* its pipeline stage */
    int has_up, has_down;          /* pipeline stages g-1, g+1 exist */
    unsigned up_rank, down_rank;   /* the ranks that hold them */
    int up_local, down_local;      /* ... when that rank is this one */
    unsigned up_chunk, down_chunk; /* ... and then their chunk index here */

    /* Codecs of the chunk's two boundaries, one per use. */
    epipe_codec *enc_act;  /* activations to g+1 */
    epipe_codec *dec_act;  /* activations from g-1 */
    epipe_codec *enc_grad; /* gradients to g-1 */
    epipe_codec *dec_grad; /* gradients from g+1 */
    /* A local boundary down (to g+1) runs its codecs only when the host set
     * them ([dir]); otherwise tensors are copied. */
    int local_codec[2];
    /* enc_act / dec_act have delta=1 (activation deltas). */
    int delta_enc, delta_dec;
    struct sample_ids *samples; /* [m]: the ids that go with the activation sent down */

    /* The step of each micro-batch's forward (its messages carry it; a
     * schedule without a flush runs a backward in the next step's list) and
     * the weight version the forward used; updates: the host's updates to
     * this chunk so far (epipe_weight_mode). */
    uint64_t *fstep, *fversion; /* [m] */
    uint64_t updates;

    struct lent_tensor *act_in;   /* [m]: kept until the micro-batch's backward ends */
    struct tensor_meta *act_out;  /* [m]: the activation sent down, this step */
    unsigned char *act_ready;     /* [m]: handed over locally, not yet received */
    struct lent_tensor *grad_loc; /* [m] when down_local: gradients handed over */
    unsigned char *grad_ready;    /* [m] */
    /* Trainable activation codecs: the code gradient received (sender
     * side) or computed and sent (receiver side). */
    struct lent_tensor code_in, code_out;
    /* Its boundaries to other ranks: [0] down, [1] up (stats.c). */
    struct boundary_rec brec[2];
};

/* Received messages a stream-ordered stage holds before it waits. */
#define STAGE_HELD_MAX 32

/* The first failed verdict among held messages, by the order they were
 * received (seq), whichever was given back first. */
struct held_verdict {
    int rc; /* EPIPE_OK: none yet */
    unsigned long long seq;
    char why[EPIPE_ERRMSG_MAX];
};

/* One of them: the message, the codec that decoded it, and a mark after
 * that decode on its stream (cuda_api.h), by which the message is given
 * back once the decode is done, before the stage waits. The marks stay
 * with the slots past the held ones, for reuse. */
struct held_msg {
    struct epipe_msg *msg;
    epipe_codec *by;
    unsigned long long seq; /* its place among the stage's holds */
    void *mark;             /* made on CUDA device mark_device; NULL: none */
    int mark_device;
    int marked; /* recorded after this message's decode */
};

struct epipe_stage {
    epipe_comm *comm;
    epipe_schedule *sched;              /* NULL for raw op lists (tests) */
    const char *kind;                   /* the schedule's kind, or "raw" */
    unsigned *place_rank, *place_chunk; /* [P]: where each pipeline stage lives */
    epipe_op *raw_ops;                  /* raw op lists: this rank's, owned */
    const epipe_op *train_ops;          /* this rank's list in the schedule */
    size_t ntrain_ops;
    epipe_op *eval_ops; /* forwards only, micro-batch by micro-batch, chunks in order */
    size_t neval_ops;
    int training;
    int cuda_device;   /* EPIPE_STAGE_CUDA_DEVICE: -1 host memory */
    void *cuda_stream; /* epipe_stage_set_cuda_stream(): its codecs' stream */
    /* EPIPE_STAGE_CUDA_STREAM_ORDERED: CUDA sends and receives return
     * with their work queued; unsettled: the codecs have such work not yet
     * waited for; held: received messages whose decodes may still read
     * them (epipe_stage_settle), in the order received (held_seq counts
     * them); verdict: the first failed verdict of those given back before
     * the wait, which reports it. */
    int stream_ordered, unsettled;
    struct held_msg held[STAGE_HELD_MAX];
    unsigned nheld;
    unsigned long long held_seq;
    struct held_verdict verdict;
    /* A wait that found such work failed (the communicator is aborted):
     * every later one reports it again. */
    int settle_rc;
    char settle_why[EPIPE_ERRMSG_MAX];
    /* What the fences this stage waited for said, gathered on the device
     * and passed on by its own fences (cuda_api.h, fence_wait), made on
     * CUDA device taint_device at the first; NULL until then. */
    void *taint;
    int taint_device;
    /* Where a device payload from a peer on another device is copied
     * before its decode (device_payload_here() in opstream.c) */
    struct lent_tensor peer_in;
    int splits;          /* the schedule splits the backward (BACKWARD_INPUT, BACKWARD_WEIGHT) */
    const epipe_op *ops; /* the list the current step runs */
    size_t nops;
    /* Schedules without a flush (1f1b-async, 1f1b-2bw): the lists of later
     * steps and of the drain; flowing: micro-batches are in flight between
     * steps; draining: the next step runs the drain list. */
    int weights; /* epipe_weight_mode */
    const epipe_op *steady_ops, *drain_ops;
    size_t nsteady_ops, ndrain_ops;
    int flowing, draining, running_drain;
    unsigned s, p, m; /* rank, ranks, micro-batches */
    unsigned P;       /* pipeline stages */
    unsigned nch;     /* chunks on this rank */
    struct chunk *ch; /* [nch] */
    uint32_t tag;     /* schedule fingerprint, on every tensor message */

    int64_t timeout_ms;
    unsigned codec_threads;
    int64_t batch;
    epipe_stage_callbacks cb;
    int has_cb;
    /* The callback running now ("forward", ...), or NULL: calls that
     * drive the stage are refused from inside one. */
    const char *in_callback;
    /* The thread inside a call that drives the stage (0: none) and that
     * call's name, both atomic: stage_claim() refuses a second thread. */
    uintptr_t owner;
    const char *owner_call;
    int tracing;
    epipe_trace *trace; /* this stage's spans (NULL: tracing off) */

    /* Position in the step. */
    int started, in_step;
    uint64_t step;
    size_t pc;
    int cur_valid;
    epipe_op cur;
    int need_recv, did_recv, need_send, did_send;
    double step_t0, op_t0, mark;

    struct lent_tensor grad_in; /* a gradient received over the transport */
    void *scratch;              /* a local boundary's encoded tensor */
    size_t scratch_cap;

    epipe_stage_stats st;
    /* Live statistics (stats.c): the copy other threads read, under
     * stats_lock with the boundary records; the training steps' time and
     * the last steps' wall times for the percentiles. */
    pthread_mutex_t stats_lock;
    int stats_lock_ok;
    epipe_stage_stats pub;
    double train_seconds, step_ring[EPIPE_STAGE_STATS_STEPS], t_origin;
    unsigned ring_n, ring_pos;
    char msg[EPIPE_ERRMSG_MAX];
};

static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

__attribute__((format(printf, 3, 4))) static inline int fail(epipe_stage *st, int status,
                                                             const char *fmt, ...)
{
    char text[EPIPE_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    return epipe_fail_into(st->msg, status, "stage %u: %s", st->s, text);
}

/* EPIPE_ESTATE for a call that drives the stage (the op stream, a step,
 * the knobs that change between steps) made from inside one of its
 * callbacks (the caller checks st->in_callback): epipe_stage_step is in
 * the middle of the op, and would go on from a state the call had changed
 * under it. */
static inline int refuse_in_callback(epipe_stage *st, const char *call)
{
    return fail(st, EPIPE_ESTATE,
                "%s called from inside the %s callback of micro-batch %u: the stage receives, "
                "sends and moves to the next op itself around its callbacks",
                call, st->in_callback, st->cur.microbatch);
}

/* "CUDA device 1", or "host memory" for -1: where tensors live, in messages. */
static inline void memory_name(char *buf, size_t cap, int cuda_device)
{
    if (cuda_device >= 0)
        snprintf(buf, cap, "CUDA device %d", cuda_device);
    else
        snprintf(buf, cap, "host memory");
}

/* One thread at a time (epipe/stage.h): a call that drives the stage
 * claims it, and a call from a second thread while the first is inside
 * fails with EPIPE_ESTATE instead of racing it. The owner's own calls from
 * inside its callbacks pass (*nested), and meet refuse_in_callback() as
 * before. The refusal goes to the calling thread's epipe_last_error(), not
 * to the stage's message, which the thread inside may be writing. A NULL
 * stage passes, for the call to report. */
static inline int stage_claim(epipe_stage *st, const char *call, int *nested)
{
    uintptr_t self = (uintptr_t)pthread_self(), seen = 0;
    *nested = 1;
    if (!st)
        return EPIPE_OK;
    if (__atomic_compare_exchange_n(&st->owner, &seen, self, 0, __ATOMIC_ACQUIRE,
                                    __ATOMIC_RELAXED)) {
        __atomic_store_n(&st->owner_call, call, __ATOMIC_RELAXED);
        *nested = 0;
        return EPIPE_OK;
    }
    if (seen == self)
        return EPIPE_OK;
    const char *inside = __atomic_load_n(&st->owner_call, __ATOMIC_RELAXED);
    return epipe_fail(EPIPE_ESTATE,
                      "%s: another thread is inside %s on stage %u; a stage is used by one "
                      "thread at a time",
                      call, inside ? inside : "a call", st->s);
}

static inline int stage_release(epipe_stage *st, int nested, int rc)
{
    if (!nested) {
        __atomic_store_n(&st->owner_call, NULL, __ATOMIC_RELAXED);
        __atomic_store_n(&st->owner, 0, __ATOMIC_RELEASE);
    }
    return rc;
}

/* Host compute is the time between the stage's calls within a step. */
static inline void enter(epipe_stage *st)
{
    epipe_clear_error();
    if (st->in_step)
        st->st.compute_seconds += now() - st->mark;
}

static inline int leave(epipe_stage *st, int rc)
{
    st->mark = now();
    return rc;
}

static inline int is_backward_kind(uint32_t kind)
{
    return kind == EPIPE_OP_BACKWARD || kind == EPIPE_OP_BACKWARD_INPUT;
}

static inline int is_compute_kind(uint32_t kind)
{
    return kind == EPIPE_OP_FORWARD || is_backward_kind(kind) || kind == EPIPE_OP_BACKWARD_WEIGHT;
}

/* "forward of micro-batch 3" (", chunk 1" when the rank holds several). */
static inline const char *op_text(const epipe_stage *st, const epipe_op *op, char *buf, size_t cap)
{
    const char *what = op->kind == EPIPE_OP_FORWARD          ? "forward"
                       : op->kind == EPIPE_OP_BACKWARD       ? "backward"
                       : op->kind == EPIPE_OP_BACKWARD_INPUT ? "input-gradient backward"
                                                             : "weight-gradient backward";
    if (st->nch > 1)
        snprintf(buf, cap, "%s of micro-batch %u on chunk %u", what, op->microbatch, op->chunk);
    else
        snprintf(buf, cap, "%s of micro-batch %u", what, op->microbatch);
    return buf;
}

/* The receive timeout in force: the stage's own once EPIPE_STAGE_TIMEOUT_MS
 * was set, else the communicator's as it is now. */
static inline int64_t stage_timeout_ms(const epipe_stage *st)
{
    return st->timeout_ms ? st->timeout_ms
                          : __atomic_load_n(&st->comm->timeout_ms, __ATOMIC_RELAXED);
}

/* The step a message for micro-batch mb carries: an activation the
 * current step's, a gradient that of the micro-batch's forward. */
static inline uint64_t msg_step(const epipe_stage *st, const struct chunk *c, unsigned mb, int dir)
{
    return dir == DIR_ACT ? st->step : c->fstep[mb];
}

/* Statistics (stats.c): set up once the chunks are; the bytes of one
 * message (sending or received) across chunk c's boundary in direction
 * dir; a step's end (training: its wall time counts for samples/s); the
 * copy other threads read, made at every op boundary. */
int epipe_stage_stats_init(epipe_stage *st);
void epipe_stage_stats_fini(epipe_stage *st);
void epipe_stage_stats_count(epipe_stage *st, struct chunk *c, int dir, int sending, uint64_t raw,
                             uint64_t wire);
void epipe_stage_stats_step_end(epipe_stage *st, double seconds, int with_forwards);
void epipe_stage_stats_publish(epipe_stage *st);

/* The op stream (opstream.c), which the callback driver (step.c) runs. */
int epipe_stage_advance(epipe_stage *st, epipe_op *op);
/* Waits for the CUDA work stream-ordered sends and receives left queued
 * (every codec of the stage), takes the verdicts of the encodes that
 * wrote the messages held (their fences), then frees those messages.
 * `report`: the first error fails the stage, naming it, aborts the
 * communicator (a peer may have decoded what a failed encode wrote), and
 * every later call reports it again; 0: errors are dropped
 * (epipe_stage_destroy). */
int epipe_stage_settle(epipe_stage *st, int report);
/* Frees the marks of the held messages' slots (epipe_stage_destroy, after
 * the settle). */
void epipe_stage_free_marks(epipe_stage *st);
/* The same, before a wait on one codec that would otherwise take an error
 * of that earlier work as its own: nothing when there is none. */
static inline int epipe_stage_settle_first(epipe_stage *st)
{
    return st->unsettled || st->settle_rc ? epipe_stage_settle(st, 1) : EPIPE_OK;
}
int epipe_stage_recv_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor **t);
int epipe_stage_send_tensor(epipe_stage *st, unsigned mb, int dir, const DLTensor *t);

/* Shared by the op stream and the local hand-over (local.c). */
int epipe_stage_lend_shape(epipe_stage *st, struct lent_tensor *lt, int ndim, const int64_t *shape,
                           DLDataType dtype);
/* Hands a tensor the current op sends to the chunk on this rank that
 * receives it (copied, or through the boundary's codecs when the host set
 * them); `n` elements of dtype `dt`, checked by the caller. */
int epipe_stage_hand_over(epipe_stage *st, struct chunk *c, unsigned mb, int dir,
                          const DLTensor *t);
/* The tensor a local neighbour handed over to chunk c for the current op. */
int epipe_stage_take_local(epipe_stage *st, struct chunk *c, unsigned mb, int dir,
                           const DLTensor **t);

/* Sample ids (samples.c). Before encoding the activation of mb on chunk c:
 * checks and consumes its ids, and hands them (or NULL ids, when not
 * training) to enc if it has delta=1. After decoding one into chunk c:
 * keeps the ids the payload carried for c's own send. A local hand-over
 * without delta codecs moves them from chunk to chunk. */
int epipe_stage_samples_before_encode(epipe_stage *st, struct chunk *c, epipe_codec *enc,
                                      unsigned mb, const DLTensor *t);
int epipe_stage_samples_after_decode(epipe_stage *st, struct chunk *c, epipe_codec *dec,
                                     unsigned mb);
int epipe_stage_samples_move(epipe_stage *st, struct chunk *from, struct chunk *to, unsigned mb);

/* The kind name a schedule tag names (stage.c). */
const char *epipe_stage_tag_kind(uint32_t tag);

/* "[2,4] f32" for messages. */
const char *epipe_stage_shape_text(int ndim, const int64_t *shape, DLDataType dtype, char *buf,
                                   size_t cap);

#endif
