/* libepipe schedules: the per-rank op lists of a pipeline schedule (GPipe,
 * 1F1B, interleaved, zero-bubble), as data, and a simulator that proves and times them. */
#ifndef EPIPE_SCHEDULE_H
#define EPIPE_SCHEDULE_H

#include <epipe/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque, immutable schedule: for each of `stages` ranks, the ordered
 * list of ops that rank runs for one training step of `microbatches`
 * micro-batches.
 *
 * Words: a *rank* is one process (communicator rank) and holds one op list.
 * A *pipeline stage* is one model chunk; the pipeline has
 * epipe_schedule_pipeline_stages() of them, in order 0..P-1, each on one
 * rank (the *placement*). A rank's chunks are numbered 0..chunks-1 in
 * pipeline order. With one chunk per rank and the default placement,
 * pipeline stage s is rank s, and "stage" in the older calls below means
 * either. Boundary b joins pipeline stages b and b+1.
 *
 * Thread safety: a schedule never changes after epipe_schedule_create(), so
 * any number of threads may read one at once. Errors are reported through
 * the calling thread's epipe_last_error() only (a shared, read-only handle
 * has no message buffer of its own). */
typedef struct epipe_schedule epipe_schedule;

/* What one op does, on the pipeline stage the op's chunk is. Pipeline stage
 * s receives activations from s-1 and sends them to s+1; gradients flow the
 * other way. Stage 0 has no RECV_ACT nor SEND_GRAD, the last stage no
 * SEND_ACT nor RECV_GRAD. The send/recv ops appear for every boundary, also
 * between two chunks on one rank (the runtime hands those over locally).
 * A schedule uses either BACKWARD or the split pair BACKWARD_INPUT then
 * BACKWARD_WEIGHT (epipe_schedule_splits_backward()). New kinds may be
 * added; skip kinds you do not know only if you can afford to. */
typedef enum epipe_op_kind {
    EPIPE_OP_FORWARD = 1,        /* forward of the micro-batch on this stage */
    EPIPE_OP_BACKWARD = 2,       /* backward; frees the micro-batch's activations */
    EPIPE_OP_RECV_ACT = 3,       /* receive its activation from stage s-1 */
    EPIPE_OP_SEND_ACT = 4,       /* send its activation (forward output) to s+1 */
    EPIPE_OP_RECV_GRAD = 5,      /* receive the gradient of its output from s+1 */
    EPIPE_OP_SEND_GRAD = 6,      /* send the gradient of its input to s-1 */
    EPIPE_OP_BACKWARD_INPUT = 7, /* "Bi": the input gradient only; SEND_GRAD follows at once */
    EPIPE_OP_BACKWARD_WEIGHT = 8 /* "W": the weight gradients of a micro-batch whose Bi ran;
                                    frees the micro-batch's activations on this chunk */
} epipe_op_kind;

/* One op. Its size is fixed for good (16 bytes): arrays of it cross the
 * API. Every op names its chunk (0 with one chunk per rank).
 * `weight_version` is 0 for the schedules that flush (every kind but
 * 1f1b-async and 1f1b-2bw). For those two it is the version of the
 * weights the op must use, as an offset (32-bit two's complement: -1 is
 * UINT32_MAX) from the version current when the op's list began, in the
 * steady state (from the third step on; the first list's always). A
 * stage (epipe_stage_current_op(), the op stream) gives the absolute
 * version instead: the number of updates the host had applied to this
 * chunk when the micro-batch's forward ran. */
typedef struct epipe_op {
    uint32_t kind;           /* an epipe_op_kind */
    uint32_t microbatch;     /* 0 .. microbatches-1 */
    uint32_t chunk;          /* which of this rank's chunks */
    uint32_t weight_version; /* 0 unless the schedule is asynchronous */
} epipe_op;

/* Where the pipeline stages live, for epipe_schedule_create_layout().
 * Initialise with EPIPE_SCHEDULE_LAYOUT_INIT, then set what you need. */
typedef struct epipe_schedule_layout {
    size_t struct_size;        /* sizeof(epipe_schedule_layout) */
    unsigned chunks;           /* chunks per rank; 0 = the kind's default (zb-v: 2, else 1).
                                  With a placement: 0, or the count every rank must hold */
    const unsigned *placement; /* rank of each pipeline stage, in pipeline order (borrowed
                                  during the call only); NULL = the kind's default:
                                  round-robin (stage s on rank s % ranks), a V for zb-v
                                  (stage s on rank s for s < ranks, else 2*ranks-1-s) */
    unsigned placement_len;    /* pipeline stage count when placement is set, else 0 */
} epipe_schedule_layout;
#define EPIPE_SCHEDULE_LAYOUT_INIT                                                                 \
    {                                                                                              \
        sizeof(epipe_schedule_layout), 0, NULL, 0                                                  \
    }

/* Limits on the arguments of epipe_schedule_create(). */
#define EPIPE_SCHEDULE_MAX_STAGES 1024u /* ranks, and pipeline stages */
#define EPIPE_SCHEDULE_MAX_MICROBATCHES 65536u
#define EPIPE_SCHEDULE_MAX_PRODUCT (1u << 20) /* pipeline stages * microbatches */
#define EPIPE_SCHEDULE_MAX_CHUNKS 64u         /* chunks on one rank */

/* Kinds (the names are what epipe_schedule_create() takes). Every kind is
 * built for any placement: each rank's list is what a greedy run at costs
 * F = 1, B = 2 (Bi = W = 1 when split) gives under the kind's rules (below),
 * so it never waits for work it could do at those costs. With one chunk per
 * rank and the default placement:
 *   gpipe  every forward in micro-batch order, then every backward in
 *          micro-batch order. Each stage holds all m activations at once.
 *          With several chunks, a rank runs all its forwards first.
 *   1f1b   PipeDream-flush: stage s of p runs min(p-s-1, m) warm-up
 *          forwards, then alternates one forward and one backward, then
 *          drains the remaining backwards. At most min(p-s, m) micro-batches'
 *          activations are alive on stage s at once (any placement: at most
 *          P-s on pipeline stage s of P; a backward goes first when ready).
 *   interleaved  Megatron-LM's depth-first interleaved 1F1B over v chunks
 *          per rank (default placement round-robin; with several chunks a
 *          rank needs it): forwards in groups of g >= p micro-batches
 *          (m/p groups, sizes as equal as possible, so any m >= 1), chunk
 *          by chunk, backwards the same with the chunks reversed. Rank r
 *          holds at most 2(p-r-1) + (v-1)g + 1 chunk activations. At equal
 *          costs and m >= p its bubble is (p-1)/(v m) of the compute.
 *   zb-h1  zero bubble H1 (Qi et al. 2024): splits the backward
 *          (BACKWARD_INPUT, BACKWARD_WEIGHT); 1f1b's order of forwards
 *          and input backwards, the weight backwards where 1f1b would idle.
 *          Every rank holds at most 1f1b's peak (p). At F = B = W and
 *          m >= p its bubble is (p-1)/(3m) of the compute.
 *   zb-v   zero bubble V: splits the backward; 2 chunks per rank (any
 *          other count is refused), placed in a V by default (stage s on
 *          rank s, then back). Each rank holds at most 2p chunk activations.
 *   1f1b-async  PipeDream's 1F1B without a flush: steps run back to back
 *          as one stream (the first step's list warms up, every later
 *          step's is steady 1F1B whose first p-s-1 backwards are the
 *          previous step's last micro-batches, and a drain list runs the
 *          backwards still in flight before an evaluation, a checkpoint or
 *          the end: epipe_schedule_phase_ops(), epipe_stage_drain()). The
 *          host updates a stage's weights after every backward and keeps
 *          each in-flight micro-batch's version until its backward (weight
 *          stashing, EPIPE_WEIGHTS_STASHED): stage s holds up to p-s
 *          versions. One chunk per rank; m >= p.
 *   1f1b-2bw  the same lists, with PipeDream-2BW's double buffering: the
 *          host updates once per step, after the step's list (and after the
 *          drain), so at most two versions live (EPIPE_WEIGHTS_DOUBLE).
 * With one chunk per rank gpipe and 1f1b give the lists of earlier
 * releases. docs/schedules.md has the rules and the simulated bubbles.
 * Around the compute ops, on every pipeline stage that has the neighbour:
 * RECV_ACT i just before FORWARD i, SEND_ACT i just after it, RECV_GRAD i
 * just before BACKWARD (or BACKWARD_INPUT) i, SEND_GRAD i just after it
 * (never after BACKWARD_WEIGHT). Each chunk runs its forwards, its backwards
 * (and its weight backwards) in micro-batch order, so each directed link
 * carries its messages in micro-batch order.
 *
 * Creates a schedule of `stages` ranks (one pipeline stage each, stage s on
 * rank s) in *out and proves it with the simulator (it cannot deadlock and
 * respects every dependency). Same as epipe_schedule_create_layout() with a
 * NULL layout. Returns EPIPE_OK; EPIPE_EINVAL for a NULL argument, an
 * unknown kind (the message names it and lists the known ones), stages or
 * microbatches of 0 or above the limits above, a count the kind cannot use;
 * EPIPE_ENOMEM. On error *out is NULL. The caller owns the schedule and
 * frees it with epipe_schedule_destroy(). Thread-safe. */
EPIPE_API int epipe_schedule_create(epipe_schedule **out, const char *kind, unsigned stages,
                                    unsigned microbatches);

/* Like epipe_schedule_create() over `ranks` ranks with the layout's chunks
 * and placement (NULL = the kind's defaults). The pipeline has
 * placement_len stages, or ranks*chunks without a placement. EPIPE_EINVAL
 * besides for: a layout whose struct_size is not the size this library
 * knows (a newer host's larger struct is refused, not half-read), a
 * placement of length 0 or over EPIPE_SCHEDULE_MAX_STAGES, a rank with more than
 * EPIPE_SCHEDULE_MAX_CHUNKS chunks, an entry that is not a rank
 * below `ranks`, a rank that holds no pipeline stage, a rank whose chunk
 * count differs from a nonzero layout->chunks, chunks the kind cannot use
 * (zb-v: 2 per rank), a placement the kind cannot use (interleaved with
 * several chunks on a rank: round-robin only); each message names the bad
 * value. Thread-safe. */
EPIPE_API int epipe_schedule_create_layout(epipe_schedule **out, const char *kind, unsigned ranks,
                                           unsigned microbatches,
                                           const epipe_schedule_layout *layout);

/* The number of pipeline stages (model chunks of all ranks); 0 for NULL. */
EPIPE_API unsigned epipe_schedule_pipeline_stages(const epipe_schedule *sched);

/* The number of chunks rank `rank` holds; 0 for NULL or a rank out of range. */
EPIPE_API unsigned epipe_schedule_chunks(const epipe_schedule *sched, unsigned rank);

/* The pipeline stage of (rank, chunk) into *stage, and the reverse: the
 * rank and chunk of a pipeline stage (either out pointer may be NULL there).
 * EPIPE_EINVAL for a NULL schedule or stage pointer, or a rank, chunk or
 * stage out of range (the message gives the range). Thread-safe. */
EPIPE_API int epipe_schedule_stage_of(const epipe_schedule *sched, unsigned rank, unsigned chunk,
                                      unsigned *stage);
EPIPE_API int epipe_schedule_placement(const epipe_schedule *sched, unsigned stage, unsigned *rank,
                                       unsigned *chunk);

/* 1 when the lists use BACKWARD_INPUT and BACKWARD_WEIGHT instead of
 * BACKWARD, 0 when not or for NULL. */
EPIPE_API int epipe_schedule_splits_backward(const epipe_schedule *sched);

/* How a schedule's weights advance (epipe_schedule_weights()). */
typedef enum epipe_weight_mode {
    EPIPE_WEIGHTS_FLUSH = 0,   /* one update after each step, which ends with a flush */
    EPIPE_WEIGHTS_STASHED = 1, /* 1f1b-async: an update after every backward of the chunk;
                                  each micro-batch uses its forward's version (stashed) */
    EPIPE_WEIGHTS_DOUBLE = 2   /* 1f1b-2bw: an update after each step's list and after the
                                  drain; at most two versions live */
} epipe_weight_mode;

/* The schedule's epipe_weight_mode; EPIPE_WEIGHTS_FLUSH for NULL.
 * Experimental (docs/api.md), as the two calls below. */
EPIPE_EXPERIMENTAL int epipe_schedule_weights(const epipe_schedule *sched);

/* The phases of a schedule without a flush (epipe_schedule_phase_ops()). */
typedef enum epipe_schedule_phase {
    EPIPE_PHASE_FIRST = 0,  /* the first step after the start or a drain */
    EPIPE_PHASE_STEADY = 1, /* every later step */
    EPIPE_PHASE_DRAIN = 2   /* the backwards still in flight, run to stop the stream */
} epipe_schedule_phase;

/* Rank `stage`'s list for one phase, as epipe_schedule_ops() (which gives
 * the FIRST list). For the schedules that flush, FIRST and STEADY are the
 * one list and DRAIN is empty (*count 0). EPIPE_EINVAL for a NULL
 * argument, a rank out of range or an unknown phase. */
EPIPE_EXPERIMENTAL int epipe_schedule_phase_ops(const epipe_schedule *sched, unsigned stage,
                                                int phase, const epipe_op **ops, size_t *count);

/* The most weight versions rank `stage` holds at once in a run of the
 * schedule (the current one and those of in-flight micro-batches): 1 for
 * the schedules that flush, 0 for NULL or a rank out of range. */
EPIPE_EXPERIMENTAL unsigned epipe_schedule_weight_versions(const epipe_schedule *sched,
                                                           unsigned stage);

/* Frees the schedule. NULL is a no-op. Any epipe_sim made from it must be
 * destroyed first. */
EPIPE_API void epipe_schedule_destroy(epipe_schedule *sched);

/* The i-th known kind name ("gpipe", "1f1b", ...), or NULL when i is past
 * the last. Static strings; thread-safe. */
EPIPE_API const char *epipe_schedule_kind_name(size_t i);

/* The schedule's kind (static string), rank count (the number of op
 * lists; the stage count when each rank holds one chunk) and micro-batch
 * count. */
EPIPE_API const char *epipe_schedule_kind(const epipe_schedule *sched);
EPIPE_API unsigned epipe_schedule_stages(const epipe_schedule *sched);
EPIPE_API unsigned epipe_schedule_microbatches(const epipe_schedule *sched);

/* The ordered op list of one rank (`stage` is the rank): *ops points to
 * *count ops owned by the schedule, valid until epipe_schedule_destroy().
 * EPIPE_EINVAL for a NULL argument or a rank out of range (the message gives
 * the range). */
EPIPE_API int epipe_schedule_ops(const epipe_schedule *sched, unsigned stage, const epipe_op **ops,
                                 size_t *count);

/* A short static name of an op kind: "F", "B", "recv-act", "send-act",
 * "recv-grad", "send-grad", "Bi", "W", or "?" for an unknown kind.
 * Thread-safe. */
EPIPE_API const char *epipe_op_kind_name(uint32_t kind);

/* ---- Simulation --------------------------------------------------------
 *
 * The simulator runs every rank's list against the others. Each rank is
 * one processor that runs its ops in order; FORWARD, BACKWARD_INPUT and
 * BACKWARD_WEIGHT take their pipeline stage's cost F, B and W in compute
 * time, and a BACKWARD (a schedule that does not split) takes B + W. A send
 * does not block the rank (the transport queues it): the message crosses
 * its link, one message at a time per boundary and direction, taking the
 * link's cost, and a receive waits until it has arrived. A link between two
 * chunks on one rank costs 0. With a codec cost, a message between ranks
 * also takes that much of the sending rank's time to encode (at the send)
 * and of the receiving rank's time to decode (at the receive). Times are in
 * whatever unit the costs are in.
 *
 * For 1f1b-async and 1f1b-2bw the simulator runs EPIPE_SIM_ASYNC_STEPS
 * steps back to back (the first list, then steady ones, then the drain),
 * micro-batches numbered across the run (step t's micro-batch j is
 * t*m + j); the makespan, bubble, peak and op times are of that run, and
 * op indices count through it in that order.
 *
 * Default costs: forward 1, backward 1, weight 0, links 0, codec 0. With
 * costs the same on every stage (any forward and backward costs) and free
 * links, both gpipe and 1f1b over one chunk per rank take
 * (m+p-1)*(forward+backward) and their bubble fraction is (p-1)/(m+p-1).
 *
 * Results: the makespan (the time the last op ends, starting at 0); the
 * bubble fraction, idle time over ranks*makespan, that is 1 - (sum of all
 * compute and codec time) / (ranks * makespan) (0 when the makespan is 0).
 * This is idle over the whole step; the papers' "bubble" is idle over the
 * ideal compute time, b/(1-b) of it (1F1B: (p-1)/m). Also the peak number
 * of micro-batch activations alive at once on each rank (one per chunk and
 * micro-batch, from the start of its forward to the end of its BACKWARD or
 * BACKWARD_WEIGHT); and the start and end time of every op.
 *
 * Options are enum-keyed setters, as for codecs (epipe_codec_set_param):
 * a new cost is a new enum value, never a changed struct.
 *
 * Thread safety: one epipe_sim must not be used by two threads at once;
 * distinct sims (even of one schedule) are independent.
 *
 * Experimental (EPIPE_EXPERIMENTAL, docs/api.md): the simulator's calls
 * may change in a minor release. */
typedef struct epipe_sim epipe_sim;

/* Which cost epipe_sim_set_cost() sets. Costs are finite and >= 0. */
/* The `stage` argument is a pipeline stage (the rank, with one chunk per
 * rank and the default placement). */
typedef enum epipe_sim_cost {
    EPIPE_SIM_FORWARD = 1,   /* one forward on the stage; default 1 */
    EPIPE_SIM_BACKWARD = 2,  /* one input-gradient backward (B) on the stage; default 1 */
    EPIPE_SIM_SEND_ACT = 3,  /* one activation from the stage to the next; default 0 */
    EPIPE_SIM_SEND_GRAD = 4, /* one gradient from the stage to the previous; default 0 */
    EPIPE_SIM_WEIGHT = 5,    /* one weight-gradient backward (W) on the stage; default 0 */
    EPIPE_SIM_CODEC = 6,     /* encoding, and decoding, one message the stage sends to
                                another rank; default 0 */
    /* The same by direction, added to EPIPE_SIM_CODEC, all indexed by the
     * stage that sends (default 0): the sender encodes, the receiver
     * decodes. For the planner, whose boundaries have a codec each way. */
    EPIPE_SIM_ENCODE_ACT = 7,  /* encoding the activation the stage sends */
    EPIPE_SIM_DECODE_ACT = 8,  /* decoding it, on the next stage */
    EPIPE_SIM_ENCODE_GRAD = 9, /* encoding the gradient the stage sends */
    EPIPE_SIM_DECODE_GRAD = 10 /* decoding it, on the previous stage */
} epipe_sim_cost;

/* Steps the simulator runs for a schedule without a flush. */
#define EPIPE_SIM_ASYNC_STEPS 4u

/* The `stage` argument of epipe_sim_set_cost() that means every stage. */
#define EPIPE_SIM_ALL_STAGES (~0u)

/* Creates a simulator for sched in *out and runs it once with the default
 * costs, so its results are ready. The sim borrows sched, which must
 * outlive it. Returns EPIPE_OK, EPIPE_EINVAL for a NULL argument, or
 * EPIPE_ENOMEM; on error *out is NULL. Free with epipe_sim_destroy().
 * Thread-safe. */
EPIPE_EXPERIMENTAL int epipe_sim_create(epipe_sim **out, const epipe_schedule *sched);

/* Frees the sim. NULL is a no-op. */
EPIPE_EXPERIMENTAL void epipe_sim_destroy(epipe_sim *sim);

/* Sets one cost on one pipeline stage, or on every stage with
 * EPIPE_SIM_ALL_STAGES.
 * The results are void until the next epipe_sim_run(). EPIPE_EINVAL for an
 * unknown cost, a stage out of range, or a value that is negative, NaN or
 * infinite (the message says which). */
EPIPE_EXPERIMENTAL int epipe_sim_set_cost(epipe_sim *sim, epipe_sim_cost what, unsigned stage,
                                          double value);

/* Runs the simulation with the current costs. Never blocks. EPIPE_OK; for a
 * schedule from epipe_schedule_create() it cannot fail otherwise. (On op
 * lists that do not hold, EPIPE_ESTATE for a deadlock, naming each stage
 * that waits and for what, and EPIPE_EINVAL for a broken dependency.) */
EPIPE_EXPERIMENTAL int epipe_sim_run(epipe_sim *sim);

/* Results of the last successful epipe_sim_run(); NaN when a cost has been
 * set since. */
EPIPE_EXPERIMENTAL double epipe_sim_makespan(const epipe_sim *sim);
EPIPE_EXPERIMENTAL double epipe_sim_bubble_fraction(const epipe_sim *sim);

/* The peak count of live micro-batch activations on a rank (`stage` is the
 * rank; each chunk's activation of a micro-batch counts once). EPIPE_EINVAL
 * for a NULL argument or a rank out of range; EPIPE_ESTATE when a cost has
 * been set since the last run. */
EPIPE_EXPERIMENTAL int epipe_sim_peak_live(const epipe_sim *sim, unsigned stage, unsigned *peak);

/* Start and end time of op `index` of a rank's list (as epipe_schedule_ops
 * gives it). A receive starts when the stage reaches it and ends when the
 * message has arrived (and, between ranks, been decoded); a send takes no
 * rank time but the encoding of its codec cost. Either pointer may be
 * NULL. Errors as for epipe_sim_peak_live(), and EPIPE_EINVAL for an index
 * out of range. */
EPIPE_EXPERIMENTAL int epipe_sim_op_time(const epipe_sim *sim, unsigned stage, size_t index,
                                         double *start, double *end);

#ifdef __cplusplus
}
#endif
#endif /* EPIPE_SCHEDULE_H */
