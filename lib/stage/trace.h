/* Chrome-trace recording (EPIPE_TRACE=file.json): every op of every stage
 * in this process on a track of its own, written when the last stage goes. */
#ifndef EPIPE_LIB_STAGE_TRACE_H
#define EPIPE_LIB_STAGE_TRACE_H

/* A stage joins the trace (reads EPIPE_TRACE on first use); returns 1 when
 * tracing is on. Every join is matched by one epipe_trace_leave(). */
int epipe_trace_join(void);
void epipe_trace_leave(void);
/* Records a span [t0, t1] (seconds, monotonic) named e.g. "F3" on a stage's
 * track. `cat` groups spans: "compute", "encode", "decode", "wait". */
void epipe_trace_span(unsigned stage, const char *name, const char *cat, double t0, double t1);

#endif
