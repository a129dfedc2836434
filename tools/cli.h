/* Command-line helpers shared by the tools and examples that parse options
 * with getopt_long: naming the option a message is about, as it was typed. */
#ifndef EPIPE_TOOLS_CLI_H
#define EPIPE_TOOLS_CLI_H

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The option getopt_long() just returned, without its value: "--stages"
 * for "--stages=4" and "--stages 4", "-p" for "-p 4" and "-p4". Call it
 * right after getopt_long(); buf holds the result. */
static inline const char *epipe_cli_optname(char **argv, char *buf, size_t cap)
{
    const char *a = argv[optind - 1];
    if (optarg && a == optarg && optind >= 2)
        a = argv[optind - 2]; /* the value was its own argument */
    size_t n = strcspn(a, "=");
    if (a[0] == '-' && a[1] && a[1] != '-')
        n = 2; /* "-p4" */
    snprintf(buf, cap, "%.*s", (int)n, a);
    return buf;
}

/* Prints prog's message for getopt_long()'s error returns (with opterr = 0
 * and an optstring that starts with ':'): c == ':' is an option without its
 * value; '?' an unknown option, or a value given to one that takes none. */
static inline void epipe_cli_bad_option(const char *prog, char **argv, int c)
{
    char name[64];
    const char *a = argv[optind - 1];
    int n = (int)strcspn(a, "=");
    if (c == ':')
        fprintf(stderr, "%s: option '%s' needs a value\n", prog,
                epipe_cli_optname(argv, name, sizeof name));
    else if (strncmp(a, "--", 2) == 0 && optopt != 0)
        fprintf(stderr, "%s: option '%.*s' takes no value\n", prog, n, a);
    else if (strncmp(a, "--", 2) == 0)
        fprintf(stderr, "%s: unknown option '%.*s'\n", prog, n, a);
    else
        fprintf(stderr, "%s: unknown option '-%c'\n", prog, optopt);
}

/* v as a whole decimal number in [lo, hi]: 0 and *out, or -1 after
 * "PROG: OPT 'v' is not an integer in lo..hi" (an empty value, trailing
 * characters, an overflow included). */
static inline int epipe_cli_int(const char *prog, const char *opt, const char *v, long long lo,
                                long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno == ERANGE || x < lo || x > hi) {
        fprintf(stderr, "%s: %s '%s' is not an integer in %lld..%lld\n", prog, opt, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

/* v as a finite number in [lo, hi]: 0 and *out, or -1 after "PROG: OPT
 * 'v' is not a number in lo..hi" (nan and inf refused). */
static inline int epipe_cli_real(const char *prog, const char *opt, const char *v, double lo,
                                 double hi, double *out)
{
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !(x >= lo && x <= hi)) {
        fprintf(stderr, "%s: %s '%s' is not a number in %g..%g\n", prog, opt, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

/* In a getopt_long loop: optarg as an integer or a finite number in
 * [lo, hi] into dst, or the message and `return fail` (EPIPE_CLI_INT and
 * EPIPE_CLI_REAL: return 2, the exit status of a bad option). */
#define EPIPE_CLI_INT_OR(fail, prog, opt, lo, hi, dst)                                             \
    do {                                                                                           \
        long long x_;                                                                              \
        if (epipe_cli_int(prog, opt, optarg, lo, hi, &x_))                                         \
            return fail;                                                                           \
        dst = x_;                                                                                  \
    } while (0)
#define EPIPE_CLI_REAL_OR(fail, prog, opt, lo, hi, dst)                                            \
    do {                                                                                           \
        double x_;                                                                                 \
        if (epipe_cli_real(prog, opt, optarg, lo, hi, &x_))                                        \
            return fail;                                                                           \
        dst = x_;                                                                                  \
    } while (0)
#define EPIPE_CLI_INT(prog, opt, lo, hi, dst) EPIPE_CLI_INT_OR(2, prog, opt, lo, hi, dst)
#define EPIPE_CLI_REAL(prog, opt, lo, hi, dst) EPIPE_CLI_REAL_OR(2, prog, opt, lo, hi, dst)

#endif
