/* libepipe schedules: the per-stage op lists of a pipeline schedule (GPipe,
 * 1F1B), as data, and a simulator that proves them and times them. */
#ifndef EPIPE_SCHEDULE_H
#define EPIPE_SCHEDULE_H

#include <epipe/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque, immutable schedule: for each of `stages` pipeline stages, the
 * ordered list of ops that stage runs for one training step of
 * `microbatches` micro-batches.
 *
 * Thread safety: a schedule never changes after epipe_schedule_create(), so
 * any number of threads may read one at once. Errors are reported through
 * the calling thread's epipe_last_error() only (a shared, read-only handle
 * has no message buffer of its own). */
typedef struct epipe_schedule epipe_schedule;

/* What one op does. Stage s receives activations from s-1 and sends them to
 * s+1; gradients flow the other way. Stage 0 has no RECV_ACT nor SEND_GRAD,
 * the last stage no SEND_ACT nor RECV_GRAD. New kinds may be added (for
 * zero-bubble schedules, a backward split in two); skip kinds you do not
 * know only if you can afford to. */
typedef enum epipe_op_kind {
    EPIPE_OP_FORWARD = 1,   /* forward of the micro-batch on this stage */
    EPIPE_OP_BACKWARD = 2,  /* backward; frees the micro-batch's activations */
    EPIPE_OP_RECV_ACT = 3,  /* receive its activation from stage s-1 */
    EPIPE_OP_SEND_ACT = 4,  /* send its activation (forward output) to s+1 */
    EPIPE_OP_RECV_GRAD = 5, /* receive the gradient of its output from s+1 */
    EPIPE_OP_SEND_GRAD = 6  /* send the gradient of its input to s-1 */
} epipe_op_kind;

/* One op. Its size is fixed for good (16 bytes): arrays of it cross the
 * API. `chunk` (the model chunk of interleaved schedules) and `reserved` are
 * 0 for every schedule this version makes. */
typedef struct epipe_op {
    uint32_t kind;       /* an epipe_op_kind */
    uint32_t microbatch; /* 0 .. microbatches-1 */
    uint32_t chunk;
    uint32_t reserved;
} epipe_op;

/* Limits on the arguments of epipe_schedule_create(). */
#define EPIPE_SCHEDULE_MAX_STAGES 1024u
#define EPIPE_SCHEDULE_MAX_MICROBATCHES 65536u
#define EPIPE_SCHEDULE_MAX_PRODUCT (1u << 20) /* stages * microbatches */

/* Kinds (the names are what epipe_schedule_create() takes):
 *   gpipe  every forward in micro-batch order, then every backward in
 *          micro-batch order. Each stage holds all m activations at once.
 *   1f1b   PipeDream-flush: stage s of p runs min(p-s-1, m) warm-up
 *          forwards, then alternates one forward and one backward, then
 *          drains the remaining backwards. At most min(p-s, m) micro-batches'
 *          activations are alive on stage s at once.
 * Around the compute ops, on every stage that has the neighbour:
 * RECV_ACT i just before FORWARD i, SEND_ACT i just after it, RECV_GRAD i
 * just before BACKWARD i, SEND_GRAD i just after it. Each link carries its
 * messages in micro-batch order.
 *
 * Creates a schedule in *out and proves it with the simulator (it cannot
 * deadlock and respects every dependency). Returns EPIPE_OK; EPIPE_EINVAL
 * for a NULL argument, an unknown kind (the message names it and lists the
 * known ones), stages or microbatches of 0 or above the limits above;
 * EPIPE_ENOMEM. On error *out is NULL. The caller owns the schedule and
 * frees it with epipe_schedule_destroy(). Thread-safe. */
EPIPE_API int epipe_schedule_create(epipe_schedule **out, const char *kind, unsigned stages,
                                    unsigned microbatches);

/* Frees the schedule. NULL is a no-op. Any epipe_sim made from it must be
 * destroyed first. */
EPIPE_API void epipe_schedule_destroy(epipe_schedule *sched);

/* The i-th known kind name ("gpipe", "1f1b", ...), or NULL when i is past
 * the last. Static strings; thread-safe. */
EPIPE_API const char *epipe_schedule_kind_name(size_t i);

/* The schedule's kind (static string), stage count and micro-batch count. */
EPIPE_API const char *epipe_schedule_kind(const epipe_schedule *sched);
EPIPE_API unsigned epipe_schedule_stages(const epipe_schedule *sched);
EPIPE_API unsigned epipe_schedule_microbatches(const epipe_schedule *sched);

/* The ordered op list of one stage: *ops points to *count ops owned by the
 * schedule, valid until epipe_schedule_destroy(). EPIPE_EINVAL for a NULL
 * argument or a stage out of range (the message gives the range). */
EPIPE_API int epipe_schedule_ops(const epipe_schedule *sched, unsigned stage, const epipe_op **ops,
                                 size_t *count);

/* A short static name of an op kind: "F", "B", "recv-act", "send-act",
 * "recv-grad", "send-grad", or "?" for an unknown kind. Thread-safe. */
EPIPE_API const char *epipe_op_kind_name(uint32_t kind);

/* ---- Simulation --------------------------------------------------------
 *
 * The simulator runs every stage's list against the others. Each stage is
 * one processor that runs its ops in order; FORWARD and BACKWARD take their
 * cost in compute time. A send does not block the stage (the transport
 * queues it): the message crosses its link, one message at a time per
 * direction, taking the link's cost, and a receive waits until it has
 * arrived. Times are in whatever unit the costs are in.
 *
 * Default costs: forward 1, backward 1, every link 0. With costs the same
 * on every stage (any forward and backward costs) and free links, both
 * gpipe and 1f1b take (m+p-1)*(forward+backward) and their bubble fraction
 * is (p-1)/(m+p-1).
 *
 * Results: the makespan (the time the last op ends, starting at 0); the
 * bubble fraction, idle compute time over stages*makespan, that is
 * 1 - sum of all compute costs / (stages * makespan) (0 when the makespan
 * is 0); the peak number of micro-batches whose activations are alive at
 * once on each stage (from the start of its forward to the end of its
 * backward); and the start and end time of every op.
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
typedef enum epipe_sim_cost {
    EPIPE_SIM_FORWARD = 1,  /* one forward on the stage; default 1 */
    EPIPE_SIM_BACKWARD = 2, /* one backward on the stage; default 1 */
    EPIPE_SIM_SEND_ACT = 3, /* one activation from the stage to the next; default 0 */
    EPIPE_SIM_SEND_GRAD = 4 /* one gradient from the stage to the previous; default 0 */
} epipe_sim_cost;

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

/* Sets one cost on one stage, or on every stage with EPIPE_SIM_ALL_STAGES.
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

/* The peak count of live micro-batch activations on a stage. EPIPE_EINVAL
 * for a NULL argument or a stage out of range; EPIPE_ESTATE when a cost has
 * been set since the last run. */
EPIPE_EXPERIMENTAL int epipe_sim_peak_live(const epipe_sim *sim, unsigned stage, unsigned *peak);

/* Start and end time of op `index` of a stage's list (as epipe_schedule_ops
 * gives it). A receive starts when the stage reaches it and ends when the
 * message has arrived; a send takes no stage time. Either pointer may be
 * NULL. Errors as for epipe_sim_peak_live(), and EPIPE_EINVAL for an index
 * out of range. */
EPIPE_EXPERIMENTAL int epipe_sim_op_time(const epipe_sim *sim, unsigned stage, size_t index,
                                         double *start, double *end);

#ifdef __cplusplus
}
#endif
#endif /* EPIPE_SCHEDULE_H */
