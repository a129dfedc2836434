/* Reading IDX files through zlib, which reads gzip and plain files alike.
 * Every header field is checked before it sizes an allocation, and a file
 * must end where its header says: a gzip file's checksum is checked too. */
#include "idx.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The message for the caller: why[0..n) gets it, formatted. */
static void say(char *why, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (n)
        vsnprintf(why, n, fmt, ap);
    va_end(ap);
}

/* zlib's reason for f's error, without the path it puts first. */
static const char *zlib_reason(gzFile f, const char *path, int *err)
{
    const char *why = gzerror(f, err);
    size_t n = strlen(path);
    return strncmp(why, path, n) == 0 && why[n] == ':' && why[n + 1] == ' ' ? why + n + 2 : why;
}

/* Reads exactly n bytes (n < 2^31): 0, or -1 with a message naming `what`
 * and the reason (zlib's for a corrupt stream). zlib reports a file cut
 * short as Z_BUF_ERROR beside a short count, a failed checksum or a bad
 * deflate stream as -1. */
static int read_exact(gzFile f, const char *path, void *buf, size_t n, const char *what, char *why,
                      size_t whylen)
{
    int got = gzread(f, buf, (unsigned)n);
    if (got == (int)n)
        return 0;
    int err;
    const char *reason = zlib_reason(f, path, &err);
    if (got < 0 && err != Z_BUF_ERROR)
        say(why, whylen, "%s: corrupt (%s)", path, reason);
    else
        say(why, whylen, "%s: truncated: %d of the %zu bytes of its %s", path, got < 0 ? 0 : got, n,
            what);
    return -1;
}

/* The end of the file: 0 where the data ended it (for gzip, with its
 * trailer read and its checksum right); -1 with a message otherwise. */
static int at_end(gzFile f, const char *path, char *why, size_t whylen)
{
    unsigned char extra;
    int got = gzread(f, &extra, 1);
    int err;
    const char *reason = zlib_reason(f, path, &err);
    if (got == 0 && err == Z_OK)
        return 0;
    if (got > 0)
        say(why, whylen, "%s: bytes beyond the data its header describes", path);
    else
        say(why, whylen, "%s: corrupt (%s)", path, reason);
    return -1;
}

/* Opens an IDX file of unsigned bytes with `ndim` dimensions; dims get them. */
static gzFile open_idx(const char *path, int ndim, uint32_t *dims, char *why, size_t whylen)
{
    gzFile f = gzopen(path, "rb");
    if (!f) {
        say(why, whylen,
            "cannot open %s: install the Debian package dataset-fashion-mnist, "
            "or give the data directory",
            path);
        return NULL;
    }
    unsigned char h[16];
    size_t want = 4 + 4 * (size_t)ndim;
    if (read_exact(f, path, h, want, "header", why, whylen)) {
        gzclose(f);
        return NULL;
    }
    if (h[0] || h[1] || h[2] != 8 || h[3] != ndim) {
        say(why, whylen, "%s: not an IDX file of %d-dimensional unsigned bytes", path, ndim);
        gzclose(f);
        return NULL;
    }
    for (int i = 0; i < ndim; i++)
        dims[i] = be32(h + 4 + 4 * i);
    return f;
}

/* The n bytes after the header, which must end the file; NULL with a
 * message. Closes f. */
static unsigned char *read_body(gzFile f, const char *path, size_t n, char *why, size_t whylen)
{
    unsigned char *buf = malloc(n);
    if (!buf)
        say(why, whylen, "%s: out of memory for its %zu bytes", path, n);
    if (!buf || read_exact(f, path, buf, n, "data", why, whylen) || at_end(f, path, why, whylen)) {
        free(buf);
        buf = NULL;
    }
    gzclose(f);
    return buf;
}

float *idx_load_images(const char *path, double mean, double sd, uint32_t *count, uint32_t *pixels,
                       char *why, size_t whylen)
{
    uint32_t dim[3];
    gzFile f = open_idx(path, 3, dim, why, whylen);
    if (!f)
        return NULL;
    if (!dim[0] || !dim[1] || !dim[2] || dim[0] > 10000000u || dim[1] > 4096 || dim[2] > 4096 ||
        (uint64_t)dim[0] * dim[1] * dim[2] > (1u << 30)) {
        say(why, whylen, "%s: implausible shape %ux%ux%u", path, dim[0], dim[1], dim[2]);
        gzclose(f);
        return NULL;
    }
    size_t n = (size_t)dim[0] * dim[1] * dim[2];
    unsigned char *raw = read_body(f, path, n, why, whylen);
    float *x = raw ? malloc(n * sizeof *x) : NULL;
    if (!x) {
        if (raw)
            say(why, whylen, "%s: out of memory for its %zu pixels as floats", path, n);
        free(raw);
        return NULL;
    }
    if (sd <= 0) {
        double s = 0, sq = 0;
        for (size_t i = 0; i < n; i++)
            s += raw[i], sq += (double)raw[i] * raw[i];
        mean = s / (double)n;
        sd = sqrt(sq / (double)n - mean * mean);
        if (sd <= 0)
            sd = 1;
    }
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(((double)raw[i] - mean) / sd);
    free(raw);
    *count = dim[0];
    *pixels = dim[1] * dim[2];
    return x;
}

uint8_t *idx_load_labels(const char *path, unsigned classes, uint32_t *count, char *why,
                         size_t whylen)
{
    uint32_t dim[1];
    gzFile f = open_idx(path, 1, dim, why, whylen);
    if (!f)
        return NULL;
    if (!dim[0] || dim[0] > 10000000u) {
        say(why, whylen, "%s: implausible label count %u", path, dim[0]);
        gzclose(f);
        return NULL;
    }
    uint8_t *y = read_body(f, path, dim[0], why, whylen);
    if (!y)
        return NULL;
    for (uint32_t i = 0; i < dim[0]; i++)
        if (y[i] >= classes) {
            say(why, whylen, "%s: label %u of item %u is not a class (0..%u)", path, y[i], i,
                classes - 1);
            free(y);
            return NULL;
        }
    *count = dim[0];
    return y;
}
