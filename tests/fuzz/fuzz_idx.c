/* Fuzz target: the IDX data set reader of the examples
 * (examples/common/idx.c), through zlib, on gzip and plain input alike.
 * The first byte picks images or labels and the class count; the rest is
 * the file. Any bytes either fail with a message naming the file, or give
 * a data set whose sizes are the header's and whose labels are classes. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../../examples/common/idx.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    unsigned pick = data[0];
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        fd = memfd_create("idx", 0);
        if (fd < 0)
            abort();
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) || pwrite(fd, data + 1, size - 1, 0) != (ssize_t)(size - 1))
        abort();
    char why[1200] = "";
    uint32_t count = 0, pixels = 0;
    if (pick & 1) {
        unsigned classes = 1 + (pick >> 1); /* 1..128 */
        uint8_t *y = idx_load_labels(path, classes, &count, why, sizeof why);
        if (!y) {
            if (!strstr(why, path))
                abort();
            return 0;
        }
        if (!count || size - 1 < 8)
            abort();
        for (uint32_t i = 0; i < count; i++)
            if (y[i] >= classes)
                abort();
        free(y);
    } else {
        float *x = idx_load_images(path, pick & 2 ? 0 : 72.94, 90.02, &count, &pixels, why,
                                   sizeof why);
        if (!x) {
            if (!strstr(why, path))
                abort();
            return 0;
        }
        if (!count || !pixels)
            abort();
        for (size_t i = 0; i < (size_t)count * pixels; i++)
            if (!isfinite(x[i]))
                abort();
        free(x);
    }
    return 0;
}
