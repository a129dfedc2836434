/* epipe-bench: one program for every libepipe benchmark; the first
 * argument picks the subcommand. Figures are ratios measured in one run. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <epipe/epipe.h>

#include "bench.h"

double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const struct {
    const char *name;
    int (*main)(int argc, char **argv);
    const char *help;
} subcommands[] = {
    {"codec", bench_codec_main, "codec throughput and error against memcpy"},
    {"schedule", bench_schedule_main, "a pipeline schedule's simulated timeline and bubble"},
    {"pipeline", bench_pipeline_main, "stage runtime overhead and step time against the simulator"},
    {"transport", bench_transport_main,
     "TCP transport throughput and latency against a raw socket"},
    {"crc", bench_crc_main, "CRC32C throughput of the wire checksum paths against memcpy"},
    {"plan", bench_plan_main, "the compression-aware planner's time on a synthetic profile"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-bench SUBCOMMAND [options]   (libepipe %s)\n\nsubcommands:\n",
            epipe_version_string());
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        fprintf(f, "  %-10s %s\n", subcommands[i].name, subcommands[i].help);
    fprintf(f, "\n'epipe-bench SUBCOMMAND --help' describes its options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        if (!strcmp(argv[1], subcommands[i].name))
            return subcommands[i].main(argc - 1, argv + 1);
    fprintf(stderr, "epipe-bench: unknown subcommand '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
