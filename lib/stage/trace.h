/* Chrome-trace recording (EPIPE_TRACE=file.json, or trace=PATH in the
 * communicator's options): every op of a stage on a track of its own. */
#ifndef EPIPE_LIB_STAGE_TRACE_H
#define EPIPE_LIB_STAGE_TRACE_H

#include <stdint.h>

/* One stage's trace: its spans, kept on the stage (no lock: one thread at a
 * time uses a stage). */
typedef struct epipe_trace epipe_trace;

/* Opens a stage's trace into `path` (NULL: EPIPE_TRACE, read now); NULL
 * when tracing is off (or out of memory: a trace is best effort).
 * `rank` is the stage's rank; `one_process_per_rank` is set for transports
 * whose ranks are separate processes (tcp, rdma): each process then writes a file
 * of its own, the path with "%r" replaced by the rank, or with ".rank<R>"
 * put before its ".json" when it has no "%r". Stages of one process that
 * name the same file share it: their spans are merged into it when each
 * closes, and the file is written when the last of them closes. Stages
 * with different files share nothing. Thread-safe. */
epipe_trace *epipe_trace_open(const char *path, unsigned rank, int one_process_per_rank);
/* Hands the spans to the file and writes it if this was its last stage
 * (a file that cannot be written is reported on the log). NULL: no-op. */
void epipe_trace_close(epipe_trace *t);
/* Records a span [t0, t1] (seconds, CLOCK_MONOTONIC: files written by
 * processes of one machine share the clock and merge without shifting)
 * named e.g. "F3" on the stage's track. `cat` groups spans: "compute",
 * "encode", "decode", "wait". A "compute" span covers the host's op from
 * its start to its end; it is recorded as the longest stretch of it that
 * holds none of the stage's own spans (the receive's wait and decode, the
 * send's encode), so compute never contains a wait. NULL t: no-op. */
void epipe_trace_span(epipe_trace *t, const char *name, const char *cat, double t0, double t1);
/* Attaches arguments to every span recorded since the previous call (the
 * slice details Perfetto shows): the step, the micro-batch, the direction
 * (0 activation, 1 gradient, -1 none), the message's wire bytes (0: none)
 * and the codec spec (NULL: none; copied). Send spans carrying a direction
 * are what epipe-trace-merge joins to their receives with flow arrows.
 * NULL t: no-op. */
void epipe_trace_args(epipe_trace *t, uint64_t step, unsigned mb, int dir, uint64_t bytes,
                      const char *codec);

#endif
