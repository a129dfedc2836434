/* Chrome-trace recording. Spans are kept in memory and written as one JSON
 * file (chrome://tracing, Perfetto) when the last stage of the process is
 * destroyed; a trace that cannot be written is reported on stderr. */
#define _POSIX_C_SOURCE 200809L
#include "trace.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct span {
    unsigned stage;
    char name[12];
    const char *cat;
    double t0, t1;
};

static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned trace_users;
static char *trace_path;
static struct span *spans;
static size_t nspans, capspans;

/* The file this process writes: EPIPE_TRACE as given when every rank is in
 * this process, else made distinct per rank (see trace.h). */
static char *rank_path(const char *p, unsigned rank, int per_rank)
{
    const char *mark = strstr(p, "%r");
    size_t n = strlen(p);
    char *out = malloc(n + 32);
    if (!out)
        return NULL;
    if (mark)
        snprintf(out, n + 32, "%.*s%u%s", (int)(mark - p), p, rank, mark + 2);
    else if (!per_rank)
        memcpy(out, p, n + 1);
    else if (n > 5 && !strcmp(p + n - 5, ".json"))
        snprintf(out, n + 32, "%.*s.rank%u.json", (int)(n - 5), p, rank);
    else
        snprintf(out, n + 32, "%s.rank%u", p, rank);
    return out;
}

int epipe_trace_join(unsigned rank, int one_process_per_rank)
{
    pthread_mutex_lock(&trace_lock);
    if (trace_users++ == 0) {
        const char *p = getenv("EPIPE_TRACE");
        free(trace_path);
        trace_path = p && *p ? rank_path(p, rank, one_process_per_rank) : NULL;
    }
    int on = trace_path != NULL;
    pthread_mutex_unlock(&trace_lock);
    return on;
}

void epipe_trace_span(unsigned stage, const char *name, const char *cat, double t0, double t1)
{
    pthread_mutex_lock(&trace_lock);
    if (trace_path) {
        if (nspans == capspans) {
            size_t cap = capspans ? capspans * 2 : 4096;
            struct span *p = realloc(spans, cap * sizeof *p);
            if (!p) {
                pthread_mutex_unlock(&trace_lock);
                return; /* a trace is best effort: drop the span, never fail a step */
            }
            spans = p, capspans = cap;
        }
        struct span *s = &spans[nspans++];
        s->stage = stage;
        snprintf(s->name, sizeof s->name, "%s", name);
        s->cat = cat;
        s->t0 = t0, s->t1 = t1;
    }
    pthread_mutex_unlock(&trace_lock);
}

static void write_trace(void)
{
    FILE *f = fopen(trace_path, "w");
    if (!f) {
        fprintf(stderr, "libepipe: cannot write the trace to %s (EPIPE_TRACE)\n", trace_path);
        return;
    }
    unsigned max_stage = 0;
    for (size_t i = 0; i < nspans; i++)
        max_stage = spans[i].stage > max_stage ? spans[i].stage : max_stage;
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    for (unsigned s = 0; nspans && s <= max_stage; s++)
        fprintf(f,
                "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %u, \"tid\": 0, "
                "\"args\": {\"name\": \"stage %u\"}},\n"
                "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %u, \"tid\": 0, "
                "\"args\": {\"sort_index\": %u}},\n",
                s, s, s, s);
    for (size_t i = 0; i < nspans; i++)
        fprintf(f,
                "{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %u, \"tid\": 0, "
                "\"ts\": %.3f, \"dur\": %.3f}%s\n",
                spans[i].name, spans[i].cat, spans[i].stage, spans[i].t0 * 1e6,
                (spans[i].t1 - spans[i].t0) * 1e6, i + 1 < nspans ? "," : "");
    fprintf(f, "]}\n");
    if (fclose(f) != 0)
        fprintf(stderr, "libepipe: error writing the trace to %s\n", trace_path);
}

void epipe_trace_leave(void)
{
    pthread_mutex_lock(&trace_lock);
    if (trace_users && --trace_users == 0) {
        if (trace_path && nspans)
            write_trace();
        free(trace_path);
        free(spans);
        trace_path = NULL;
        spans = NULL;
        nspans = capspans = 0;
    }
    pthread_mutex_unlock(&trace_lock);
}
