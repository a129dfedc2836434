/* Chrome-trace recording. Each stage keeps its spans on its own handle;
 * when it is destroyed they go into its file's shared list, and the file
 * (chrome://tracing, Perfetto) is written when its last stage is gone. */
#define _POSIX_C_SOURCE 200809L
#include "trace.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../log.h"

struct span {
    unsigned stage;
    char name[12];
    const char *cat;
    double t0, t1;
};

struct spans {
    struct span *v;
    size_t n, cap;
};

/* A file that stages of this process write: found by path in `files`, the
 * only process-wide state here (guarded by files_lock), and gone once its
 * last stage has closed and it is written. */
struct trace_file {
    struct trace_file *next;
    char *path;
    unsigned users;
    struct spans spans; /* of the stages that closed */
};

struct epipe_trace {
    struct trace_file *file;
    unsigned stage;
    struct spans spans; /* this stage's, not yet handed over */
};

static pthread_mutex_t files_lock = PTHREAD_MUTEX_INITIALIZER;
static struct trace_file *files;

/* The file this process writes: the path as given when every rank is in
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

static int spans_reserve(struct spans *s, size_t more)
{
    if (s->n + more <= s->cap)
        return 0;
    size_t cap = s->cap ? s->cap : 4096;
    while (cap < s->n + more)
        cap *= 2;
    struct span *p = realloc(s->v, cap * sizeof *p);
    if (!p)
        return -1;
    s->v = p, s->cap = cap;
    return 0;
}

epipe_trace *epipe_trace_open(const char *path, unsigned rank, int one_process_per_rank)
{
    if (!path || !*path)
        path = getenv("EPIPE_TRACE");
    if (!path || !*path)
        return NULL;
    char *full = rank_path(path, rank, one_process_per_rank);
    epipe_trace *t = calloc(1, sizeof *t);
    if (!full || !t) {
        free(full);
        free(t);
        return NULL;
    }
    t->stage = rank;
    pthread_mutex_lock(&files_lock);
    struct trace_file *f = files;
    while (f && strcmp(f->path, full))
        f = f->next;
    if (!f && (f = calloc(1, sizeof *f))) {
        f->path = full;
        full = NULL;
        f->next = files;
        files = f;
    }
    if (f)
        f->users++;
    pthread_mutex_unlock(&files_lock);
    free(full);
    if (!f) {
        free(t);
        return NULL;
    }
    t->file = f;
    return t;
}

void epipe_trace_span(epipe_trace *t, const char *name, const char *cat, double t0, double t1)
{
    if (!t || spans_reserve(&t->spans, 1))
        return; /* a trace is best effort: drop the span, never fail a step */
    struct span *s = &t->spans.v[t->spans.n++];
    s->stage = t->stage;
    snprintf(s->name, sizeof s->name, "%s", name);
    s->cat = cat;
    s->t0 = t0, s->t1 = t1;
}

static void write_trace(const char *path, const struct spans *sp)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        epipe_log_msg(EPIPE_LOG_ERROR, -1, "trace", "cannot write the trace to %s", path);
        return;
    }
    const struct span *spans = sp->v;
    size_t nspans = sp->n;
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
        epipe_log_msg(EPIPE_LOG_ERROR, -1, "trace", "error writing the trace to %s", path);
}

void epipe_trace_close(epipe_trace *t)
{
    if (!t)
        return;
    struct trace_file *f = t->file;
    pthread_mutex_lock(&files_lock);
    if (t->spans.n && spans_reserve(&f->spans, t->spans.n) == 0) {
        memcpy(f->spans.v + f->spans.n, t->spans.v, t->spans.n * sizeof *t->spans.v);
        f->spans.n += t->spans.n;
    }
    int last = --f->users == 0;
    if (last)
        for (struct trace_file **p = &files; *p; p = &(*p)->next)
            if (*p == f) {
                *p = f->next;
                break;
            }
    pthread_mutex_unlock(&files_lock);
    free(t->spans.v);
    free(t);
    if (last) {
        if (f->spans.n)
            write_trace(f->path, &f->spans);
        free(f->spans.v);
        free(f->path);
        free(f);
    }
}
