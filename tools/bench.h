/* epipe-bench: shared helpers and the subcommands' entry points. Each
 * subcommand prints human-readable text, or JSON lines with --json. */
#ifndef EPIPE_TOOLS_BENCH_H
#define EPIPE_TOOLS_BENCH_H

#include <stddef.h>

/* Seconds on a monotonic clock. */
double bench_now(void);

int bench_codec_main(int argc, char **argv);
int bench_schedule_main(int argc, char **argv);
int bench_pipeline_main(int argc, char **argv);
int bench_transport_main(int argc, char **argv);
int bench_crc_main(int argc, char **argv);
int bench_plan_main(int argc, char **argv);

#endif
