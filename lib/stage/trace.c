/* Chrome-trace recording. Each stage keeps its spans on its own handle;
 * when it is destroyed they go into its file's shared list, and the file
 * (chrome://tracing, Perfetto) is written when its last stage is gone. */
#define _POSIX_C_SOURCE 200809L
#include "trace.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../log.h"

struct span {
    unsigned stage;
    char name[12];
    const char *cat;
    double t0, t1;
    /* epipe_trace_args(): has_args, then dir (-1: none), bytes (0: none)
     * and codec (an interned copy, NULL: none) */
    int has_args, dir;
    unsigned mb;
    uint64_t step, bytes;
    const char *codec;
};

/* Strings the spans point to (codec specs), each kept once. */
struct strs {
    char **v;
    size_t n;
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
    struct strs strs;   /* their strings */
    uint64_t dropped;   /* spans lost for want of memory, said when written */
};

struct epipe_trace {
    struct trace_file *file;
    unsigned stage;
    struct spans spans; /* this stage's, not yet handed over */
    struct strs strs;   /* their strings */
    size_t annotated;   /* spans [0, annotated) went through epipe_trace_args */
    uint64_t dropped;   /* spans lost for want of memory */
};

static pthread_mutex_t files_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t files_atfork_once = PTHREAD_ONCE_INIT;

/* Held across fork(), so that a child that destroys a stage it inherited
 * finds the list whole and unlocked. */
static void files_lock_take(void)
{
    pthread_mutex_lock(&files_lock);
}

static void files_lock_give(void)
{
    pthread_mutex_unlock(&files_lock);
}

static void files_atfork(void)
{
    pthread_atfork(files_lock_take, files_lock_give, files_lock_give);
}
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
    struct trace_file *f = NULL;
    if (full && t) {
        pthread_once(&files_atfork_once, files_atfork);
        pthread_mutex_lock(&files_lock);
        f = files;
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
    }
    free(full);
    if (!f) {
        free(t);
        epipe_log_msg(EPIPE_LOG_WARN, (int)rank, "trace",
                      "no memory to record the trace to %s: this stage is not traced", path);
        return NULL;
    }
    t->stage = rank;
    t->file = f;
    return t;
}

/* The longest part of [*t0, *t1] that the spans from `first` on (the
 * stage's receive and send spans inside the op, in time order) leave free. */
static void free_stretch(const struct spans *sp, size_t first, double *t0, double *t1)
{
    double best0 = *t0, best1 = *t0, at = *t0;
    for (size_t i = first; i <= sp->n; i++) {
        double end = i < sp->n ? sp->v[i].t0 : *t1;
        if (end > *t1)
            end = *t1;
        if (end - at > best1 - best0)
            best0 = at, best1 = end;
        if (i < sp->n && sp->v[i].t1 > at)
            at = sp->v[i].t1;
    }
    *t0 = best0, *t1 = best1;
}

void epipe_trace_span(epipe_trace *t, const char *name, const char *cat, double t0, double t1)
{
    if (!t)
        return;
    /* A trace is best effort: without memory the span is dropped (and the
     * count said when the file is written), and the step goes on. */
    if (spans_reserve(&t->spans, 1)) {
        t->dropped++;
        return;
    }
    if (!strcmp(cat, "compute")) {
        size_t first = t->spans.n;
        while (first > 0 && t->spans.v[first - 1].t0 >= t0 &&
               strcmp(t->spans.v[first - 1].cat, "compute"))
            first--;
        free_stretch(&t->spans, first, &t0, &t1);
    }
    struct span *s = &t->spans.v[t->spans.n++];
    memset(s, 0, sizeof *s);
    s->stage = t->stage;
    snprintf(s->name, sizeof s->name, "%s", name);
    s->cat = cat;
    s->t0 = t0, s->t1 = t1;
    s->dir = -1;
}

/* The trace's copy of `str`, made once; NULL when out of memory. */
static const char *intern(struct strs *ss, const char *str)
{
    for (size_t i = 0; i < ss->n; i++)
        if (!strcmp(ss->v[i], str))
            return ss->v[i];
    char **v = realloc(ss->v, (ss->n + 1) * sizeof *v);
    if (!v)
        return NULL;
    ss->v = v;
    size_t len = strlen(str) + 1;
    if (!(v[ss->n] = malloc(len)))
        return NULL;
    memcpy(v[ss->n], str, len);
    return v[ss->n++];
}

void epipe_trace_args(epipe_trace *t, uint64_t step, unsigned mb, int dir, uint64_t bytes,
                      const char *codec)
{
    if (!t)
        return;
    const char *c = codec ? intern(&t->strs, codec) : NULL;
    for (size_t i = t->annotated; i < t->spans.n; i++) {
        struct span *s = &t->spans.v[i];
        s->has_args = 1;
        s->step = step, s->mb = mb, s->dir = dir, s->bytes = bytes, s->codec = c;
    }
    t->annotated = t->spans.n;
}

/* ", \"args\": {...}" of a span that has them. Specs are [a-z0-9:,=.]
 * but are escaped anyway. */
static void write_args(FILE *f, const struct span *s)
{
    if (!s->has_args)
        return;
    fprintf(f, ", \"args\": {\"step\": %llu, \"microbatch\": %u", (unsigned long long)s->step,
            s->mb);
    if (s->dir >= 0)
        fprintf(f, ", \"direction\": \"%s\"", s->dir == 0 ? "activation" : "gradient");
    if (s->bytes)
        fprintf(f, ", \"bytes\": %llu", (unsigned long long)s->bytes);
    if (s->codec) {
        fputs(", \"codec\": \"", f);
        for (const char *c = s->codec; *c; c++)
            if (*c == '"' || *c == '\\')
                fprintf(f, "\\%c", *c);
            else if ((unsigned char)*c >= 0x20)
                fputc(*c, f);
        fputc('"', f);
    }
    fputc('}', f);
}

static void strs_free(struct strs *ss)
{
    for (size_t i = 0; i < ss->n; i++)
        free(ss->v[i]);
    free(ss->v);
    ss->v = NULL, ss->n = 0;
}

/* Moves `from`'s strings to the end of `to`; on failure frees them and
 * clears the codec of the spans in `sp` that point to them. */
static void strs_move(struct strs *to, struct strs *from, struct spans *sp)
{
    char **v = from->n ? realloc(to->v, (to->n + from->n) * sizeof *v) : to->v;
    if (!v) {
        for (size_t i = 0; i < sp->n; i++)
            sp->v[i].codec = NULL;
        strs_free(from);
        return;
    }
    memcpy(v + to->n, from->v, from->n * sizeof *v);
    to->v = v, to->n += from->n;
    free(from->v);
    from->v = NULL, from->n = 0;
}

/* The trace file, created or emptied, or NULL (logged). Only a regular
 * file: opening a FIFO for writing waits for a reader, at stage
 * destruction, for ever; and a reader that goes away would kill the host
 * with SIGPIPE. O_NONBLOCK makes the open of one fail instead of waiting. */
static FILE *open_trace(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, 0666);
    const char *why = NULL;
    struct stat st;
    if (fd < 0)
        why = errno == ENXIO ? "it is a FIFO with no reader" : strerror(errno);
    else if (fstat(fd, &st) != 0)
        why = strerror(errno);
    else if (!S_ISREG(st.st_mode))
        why = S_ISFIFO(st.st_mode)   ? "it is a FIFO"
              : S_ISCHR(st.st_mode)  ? "it is a character device"
              : S_ISSOCK(st.st_mode) ? "it is a socket"
                                     : "it is not a regular file";
    else if (ftruncate(fd, 0) != 0 || fcntl(fd, F_SETFL, 0) != 0)
        why = strerror(errno);
    FILE *f = why ? NULL : fdopen(fd, "w");
    if (!f) {
        epipe_log_msg(EPIPE_LOG_ERROR, -1, "trace",
                      "cannot write the trace to %s: %s (give the path of a regular file)", path,
                      why ? why : strerror(errno));
        if (fd >= 0)
            close(fd);
    }
    return f;
}

static void write_trace(const char *path, const struct spans *sp)
{
    FILE *f = open_trace(path);
    if (!f)
        return;
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
                s + 1, s, s + 1, s);
    for (size_t i = 0; i < nspans; i++) {
        /* pid: the stage plus one (Perfetto treats pid 0 as the idle task) */
        fprintf(f,
                "{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %u, \"tid\": 0, "
                "\"ts\": %.3f, \"dur\": %.3f",
                spans[i].name, spans[i].cat, spans[i].stage + 1, spans[i].t0 * 1e6,
                (spans[i].t1 - spans[i].t0) * 1e6);
        write_args(f, &spans[i]);
        fprintf(f, "}%s\n", i + 1 < nspans ? "," : "");
    }
    fprintf(f, "]}\n");
    errno = 0;
    int failed = fflush(f) != 0 || ferror(f);
    int why = errno;
    if (fclose(f) != 0 && !failed)
        failed = 1, why = errno;
    if (failed) {
        /* a trace cut off part way is not JSON: no viewer opens it */
        int removed = unlink(path) == 0;
        epipe_log_msg(EPIPE_LOG_ERROR, -1, "trace", "cannot write the trace to %s: %s%s", path,
                      why ? strerror(why) : "a write failed",
                      removed ? " (the partial file is removed)" : "");
    }
}

void epipe_trace_close(epipe_trace *t)
{
    if (!t)
        return;
    struct trace_file *f = t->file;
    pthread_mutex_lock(&files_lock);
    if (t->spans.n && spans_reserve(&f->spans, t->spans.n) == 0) {
        strs_move(&f->strs, &t->strs, &t->spans);
        memcpy(f->spans.v + f->spans.n, t->spans.v, t->spans.n * sizeof *t->spans.v);
        f->spans.n += t->spans.n;
    } else {
        t->dropped += t->spans.n;
    }
    f->dropped += t->dropped;
    int last = --f->users == 0;
    if (last)
        for (struct trace_file **p = &files; *p; p = &(*p)->next)
            if (*p == f) {
                *p = f->next;
                break;
            }
    pthread_mutex_unlock(&files_lock);
    strs_free(&t->strs); /* those not handed over */
    free(t->spans.v);
    free(t);
    if (last) {
        if (f->spans.n)
            write_trace(f->path, &f->spans);
        if (f->dropped)
            epipe_log_msg(EPIPE_LOG_WARN, -1, "trace",
                          "%llu spans of %s were dropped for want of memory: the trace is "
                          "incomplete",
                          (unsigned long long)f->dropped, f->path);
        free(f->spans.v);
        strs_free(&f->strs);
        free(f->path);
        free(f);
    }
}
