/* Command-line helpers shared by the tools and examples that parse options
 * with getopt_long: naming the option a message is about, as it was typed. */
#ifndef EPIPE_TOOLS_CLI_H
#define EPIPE_TOOLS_CLI_H

#include <getopt.h>
#include <stdio.h>
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

#endif
