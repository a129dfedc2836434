/* Strict parsing of numbers in option strings and environment variables,
 * shared by every parser of settings in the library. */
#ifndef EPIPE_LIB_PARSE_H
#define EPIPE_LIB_PARSE_H

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

/* Reads all of s as a decimal integer in [lo, hi] into *out: 0, or -1 (and
 * *out untouched) for an empty string, trailing characters, overflow or a
 * value out of range. The caller names the bad setting in its message. */
static inline int epipe_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    if (!s || !*s)
        return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

#endif
