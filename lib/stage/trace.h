/* Chrome-trace recording (EPIPE_TRACE=file.json): every op of every stage
 * in this process on a track of its own, written when the last stage goes. */
#ifndef EPIPE_LIB_STAGE_TRACE_H
#define EPIPE_LIB_STAGE_TRACE_H

/* A stage joins the trace (reads EPIPE_TRACE on first use); returns 1 when
 * tracing is on. Every join is matched by one epipe_trace_leave().
 * `rank` is the stage's rank; `one_process_per_rank` is set for transports
 * whose ranks are separate processes (tcp): each process then writes a file
 * of its own, EPIPE_TRACE with "%r" replaced by the rank, or with
 * ".rank<R>" put before its ".json" when it has no "%r". */
int epipe_trace_join(unsigned rank, int one_process_per_rank);
void epipe_trace_leave(void);
/* Records a span [t0, t1] (seconds, CLOCK_MONOTONIC: files written by
 * processes of one machine share the clock and merge without shifting) named e.g. "F3" on a stage's
 * track. `cat` groups spans: "compute", "encode", "decode", "wait". */
void epipe_trace_span(unsigned stage, const char *name, const char *cat, double t0, double t1);

#endif
