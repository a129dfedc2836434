/* epipe-train's plan files: a strict line parser (every byte may be
 * hostile: it is fuzzed, tests/fuzz/fuzz_train_plan.c) and the writer. */
#include "plan_file.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define LINE_MAX_LEN 512
#define MAGIC "epipe-train-plan 1"

__attribute__((format(printf, 4, 5))) static int fail(char *err, size_t cap, unsigned line,
                                                      const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line)
        snprintf(err, cap, "plan line %u: %s", line, msg);
    else
        snprintf(err, cap, "plan: %s", msg);
    return -1;
}

/* The next whitespace-separated field of [*p, end): its start and length,
 * 0 length at the end. */
static size_t field(const char **p, const char *end, const char **start)
{
    while (*p < end && (**p == ' ' || **p == '\t'))
        ++*p;
    *start = *p;
    while (*p < end && **p != ' ' && **p != '\t')
        ++*p;
    return (size_t)(*p - *start);
}

static int is_word(const char *s, size_t n, const char *w)
{
    return strlen(w) == n && memcmp(s, w, n) == 0;
}

/* A decimal number in 0..999, digits only. */
static int number(const char *s, size_t n, unsigned *v)
{
    if (n == 0 || n > 3)
        return -1;
    *v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        *v = *v * 10 + (unsigned)(s[i] - '0');
    }
    return 0;
}

struct seen {
    int magic, layers, stages, schedule, split;
    unsigned char act[TRAIN_PLAN_MAX_STAGES], grad[TRAIN_PLAN_MAX_STAGES];
};

static int parse_line(const char *s, const char *end, unsigned ln, struct train_plan *p,
                      struct seen *seen, char *err, size_t cap)
{
    const char *kw, *a;
    size_t kn = field(&s, end, &kw);
    if (!seen->magic) {
        if ((size_t)(end - kw) != strlen(MAGIC) || memcmp(kw, MAGIC, strlen(MAGIC)) != 0)
            return fail(err, cap, ln, "the first line must be '%s' (is this a plan file?)", MAGIC);
        seen->magic = 1;
        return 0;
    }
    size_t an = field(&s, end, &a);
    unsigned v = 0;
    if (is_word(kw, kn, "layers") || is_word(kw, kn, "stages")) {
        int layers = kw[0] == 'l';
        if ((layers ? seen->layers : seen->stages) != 0)
            return fail(err, cap, ln, "'%s' is given twice", layers ? "layers" : "stages");
        if (number(a, an, &v) || v < 1 || v > TRAIN_PLAN_MAX_STAGES)
            return fail(err, cap, ln, "'%s' needs a count in 1..%d", layers ? "layers" : "stages",
                        TRAIN_PLAN_MAX_STAGES);
        if (layers)
            p->layers = v, seen->layers = 1;
        else
            p->stages = v, seen->stages = 1;
    } else if (is_word(kw, kn, "schedule")) {
        if (seen->schedule)
            return fail(err, cap, ln, "'schedule' is given twice");
        if (an == 0 || an >= sizeof p->schedule)
            return fail(err, cap, ln, "'schedule' needs a name of 1..%zu characters",
                        sizeof p->schedule - 1);
        for (size_t i = 0; i < an; i++)
            if (!((a[i] >= 'a' && a[i] <= 'z') || (a[i] >= '0' && a[i] <= '9') || a[i] == '-'))
                return fail(err, cap, ln, "schedule names are lower-case letters, digits and '-'");
        memcpy(p->schedule, a, an);
        p->schedule[an] = '\0';
        seen->schedule = 1;
    } else if (is_word(kw, kn, "split")) {
        if (seen->split)
            return fail(err, cap, ln, "'split' is given twice");
        if (!seen->layers || !seen->stages)
            return fail(err, cap, ln, "'split' must come after 'layers' and 'stages'");
        if (p->stages > p->layers)
            return fail(err, cap, ln, "%u stages need at least as many layers; the plan has %u",
                        p->stages, p->layers);
        for (unsigned k = 0; k < p->stages; k++) {
            if (k)
                an = field(&s, end, &a);
            if (number(a, an, &v) || v >= p->layers || (k == 0 && v != 0) ||
                (k && v <= p->first[k - 1]))
                return fail(err, cap, ln,
                            "'split' needs %u first layers: 0, then increasing, each below %u",
                            p->stages, p->layers);
            p->first[k] = v;
        }
        p->first[p->stages] = p->layers;
        seen->split = 1;
    } else if (is_word(kw, kn, "act") || is_word(kw, kn, "grad")) {
        int act = kw[0] == 'a';
        if (!seen->stages)
            return fail(err, cap, ln, "'%s' must come after 'stages'", act ? "act" : "grad");
        if (p->stages == 1)
            return fail(err, cap, ln, "a plan of 1 stage has no boundaries");
        if (number(a, an, &v) || v + 1 >= p->stages)
            return fail(err, cap, ln, "'%s' needs a boundary in 0..%d", act ? "act" : "grad",
                        (int)p->stages - 2);
        unsigned char *done = act ? &seen->act[v] : &seen->grad[v];
        if (*done)
            return fail(err, cap, ln, "'%s %u' is given twice", act ? "act" : "grad", v);
        const char *spec;
        size_t sn = field(&s, end, &spec);
        if (sn == 0 || sn >= TRAIN_PLAN_SPEC)
            return fail(err, cap, ln, "'%s %u' needs a codec spec of 1..%d characters",
                        act ? "act" : "grad", v, TRAIN_PLAN_SPEC - 1);
        char *dst = act ? p->act[v] : p->grad[v];
        memcpy(dst, spec, sn);
        dst[sn] = '\0';
        *done = 1;
    } else {
        return fail(err, cap, ln, "unknown keyword '%.*s'", (int)(kn < 32 ? kn : 32), kw);
    }
    if (field(&s, end, &a))
        return fail(err, cap, ln, "unexpected text after the value ('%.*s')",
                    (int)(end - a < 32 ? end - a : 32), a);
    return 0;
}

int train_plan_parse(const char *text, size_t len, struct train_plan *p, char *err, size_t cap)
{
    struct seen seen;
    memset(&seen, 0, sizeof seen);
    memset(p, 0, sizeof *p);
    if (len > TRAIN_PLAN_FILE_MAX)
        return fail(err, cap, 0, "%zu bytes; a plan has at most %d", len, TRAIN_PLAN_FILE_MAX);
    unsigned ln = 0;
    for (size_t pos = 0; pos < len;) {
        const char *s = text + pos, *nl = memchr(s, '\n', len - pos);
        const char *end = nl ? nl : text + len;
        pos = (size_t)(end - text) + (nl ? 1 : 0);
        ln++;
        if (end > s && end[-1] == '\r') /* CRLF files */
            end--;
        if ((size_t)(end - s) > LINE_MAX_LEN)
            return fail(err, cap, ln, "longer than %d characters", LINE_MAX_LEN);
        for (const char *c = s; c < end; c++)
            if ((unsigned char)*c < 0x20 ? *c != '\t' : (unsigned char)*c >= 0x7f)
                return fail(err, cap, ln, "byte 0x%02x is not printable ASCII", (unsigned char)*c);
        const char *q = s;
        while (q < end && (*q == ' ' || *q == '\t'))
            q++;
        if (q == end || *q == '#') /* blank or comment */
            continue;
        if (parse_line(s, end, ln, p, &seen, err, cap))
            return -1;
    }
    if (!seen.magic)
        return fail(err, cap, 0, "empty: a plan starts with '%s'", MAGIC);
    const char *missing = !seen.layers     ? "layers"
                          : !seen.stages   ? "stages"
                          : !seen.schedule ? "schedule"
                          : !seen.split    ? "split"
                                           : NULL;
    if (missing)
        return fail(err, cap, 0, "no '%s' line", missing);
    for (unsigned b = 0; b + 1 < p->stages; b++)
        if (!seen.act[b] || !seen.grad[b])
            return fail(err, cap, 0, "no '%s %u' line (every boundary needs both codecs)",
                        seen.act[b] ? "grad" : "act", b);
    return 0;
}

int train_plan_load(const char *path, struct train_plan *p, char *err, size_t cap)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return fail(err, cap, 0, "cannot open %s: %s", path, strerror(errno));
    static char buf[TRAIN_PLAN_FILE_MAX + 1];
    size_t n = fread(buf, 1, sizeof buf, f);
    int bad = ferror(f);
    fclose(f);
    if (bad)
        return fail(err, cap, 0, "cannot read %s", path);
    if (n > TRAIN_PLAN_FILE_MAX)
        return fail(err, cap, 0, "%s is larger than %d bytes", path, TRAIN_PLAN_FILE_MAX);
    if (train_plan_parse(buf, n, p, err, cap)) {
        char msg[300];
        snprintf(msg, sizeof msg, "%s", err);
        snprintf(err, cap, "%s: %s", path, msg);
        return -1;
    }
    return 0;
}

int train_plan_write(FILE *f, const struct train_plan *p)
{
    fprintf(f, "%s\nlayers %u\nstages %u\nschedule %s\nsplit", MAGIC, p->layers, p->stages,
            p->schedule);
    for (unsigned s = 0; s < p->stages; s++)
        fprintf(f, " %u", p->first[s]);
    fprintf(f, "\n");
    for (unsigned b = 0; b + 1 < p->stages; b++)
        fprintf(f, "act %u %s\ngrad %u %s\n", b, p->act[b], b, p->grad[b]);
    return fflush(f) || ferror(f) ? -1 : 0;
}

int train_plan_save(const char *path, const struct train_plan *p)
{
    size_t n = strlen(path);
    char *tmp = malloc(n + 8);
    if (!tmp)
        return ENOMEM;
    memcpy(tmp, path, n);
    memcpy(tmp + n, ".XXXXXX", 8);
    int fd = mkstemp(tmp), err = 0;
    FILE *f = NULL;
    if (fd < 0) {
        err = errno;
    } else {
        mode_t mask = umask(0); /* the mode a plain fopen() would give */
        umask(mask);
        if (fchmod(fd, 0666 & ~mask) != 0 || !(f = fdopen(fd, "w")))
            err = errno;
    }
    if (f) {
        errno = 0;
        if (train_plan_write(f, p))
            err = errno ? errno : EIO;
        if (fclose(f) != 0 && !err)
            err = errno;
    } else if (fd >= 0) {
        close(fd);
    }
    if (!err && rename(tmp, path) != 0)
        err = errno;
    if (err && fd >= 0)
        unlink(tmp);
    free(tmp);
    return err;
}
