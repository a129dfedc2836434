/* Reading IDX files through zlib, which reads gzip and plain files alike.
 * Every header field is checked before it sizes an allocation. */
#include "idx.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <zlib.h>

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Opens an IDX file of unsigned bytes with `ndim` dimensions; dims get them. */
static gzFile open_idx(const char *path, int ndim, uint32_t *dims)
{
    gzFile f = gzopen(path, "rb");
    if (!f) {
        fprintf(stderr,
                "cannot open %s: install the Debian package dataset-fashion-mnist, "
                "or give the data directory\n",
                path);
        return NULL;
    }
    unsigned char h[16];
    int want = 4 + 4 * ndim;
    if (gzread(f, h, (unsigned)want) != want || h[0] || h[1] || h[2] != 8 || h[3] != ndim) {
        fprintf(stderr, "%s: not an IDX file of %d-dimensional unsigned bytes\n", path, ndim);
        gzclose(f);
        return NULL;
    }
    for (int i = 0; i < ndim; i++)
        dims[i] = be32(h + 4 + 4 * i);
    return f;
}

float *idx_load_images(const char *path, double mean, double sd, uint32_t *count, uint32_t *pixels)
{
    uint32_t dim[3];
    gzFile f = open_idx(path, 3, dim);
    if (!f)
        return NULL;
    if (!dim[0] || !dim[1] || !dim[2] || dim[0] > 10000000u || dim[1] > 4096 || dim[2] > 4096 ||
        (uint64_t)dim[0] * dim[1] * dim[2] > (1u << 30)) {
        fprintf(stderr, "%s: implausible shape %ux%ux%u\n", path, dim[0], dim[1], dim[2]);
        gzclose(f);
        return NULL;
    }
    size_t n = (size_t)dim[0] * dim[1] * dim[2];
    unsigned char *raw = malloc(n);
    float *x = malloc(n * sizeof *x);
    if (!raw || !x || gzread(f, raw, (unsigned)n) != (int)n) {
        fprintf(stderr, "%s: truncated, or out of memory\n", path);
        free(raw), free(x), gzclose(f);
        return NULL;
    }
    gzclose(f);
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

uint8_t *idx_load_labels(const char *path, uint32_t *count)
{
    uint32_t dim[1];
    gzFile f = open_idx(path, 1, dim);
    if (!f)
        return NULL;
    if (!dim[0] || dim[0] > 10000000u) {
        fprintf(stderr, "%s: implausible label count %u\n", path, dim[0]);
        gzclose(f);
        return NULL;
    }
    uint8_t *y = malloc(dim[0]);
    if (!y || gzread(f, y, dim[0]) != (int)dim[0]) {
        fprintf(stderr, "%s: truncated, or out of memory\n", path);
        free(y), gzclose(f);
        return NULL;
    }
    gzclose(f);
    *count = dim[0];
    return y;
}
