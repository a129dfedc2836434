/* epipe-bench crc: CRC32C throughput of the wire's checksum paths (portable
 * reference, single-chain crc32, three-way crc32) beside memcpy. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "wire/crc32c.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-bench crc [--sizes 4K,64K,1M,4M,64M] [--reps R] [--json]\n\n"
               "Times epipe_crc32c (the path the wire uses), the single-chain crc32 loop\n"
               "it replaced, the portable slicing-by-8 reference and a memcpy over the\n"
               "same buffer; best of R (default 5) passes of ~256 MiB each, in GB/s.\n");
}

static int parse_sizes(const char *s, size_t *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        double v = strtod(s, &end);
        size_t mul = 1;
        if (*end == 'K' || *end == 'k')
            mul = 1024, end++;
        else if (*end == 'M' || *end == 'm')
            mul = 1024 * 1024, end++;
        if (end == s || v < 1 || v * (double)mul > (double)(1u << 30))
            return -1;
        out[n++] = (size_t)(v * (double)mul);
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return n;
}

typedef uint32_t (*crc_fn)(uint32_t, const void *, size_t);

static double best_gbps(crc_fn f, unsigned char *buf, unsigned char *dst, size_t n, int reps,
                        volatile uint32_t *sink)
{
    size_t iters = ((size_t)256 << 20) / n;
    if (iters < 2)
        iters = 2;
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = bench_now();
        for (size_t i = 0; i < iters; i++) {
            if (f)
                *sink ^= f(0, buf, n);
            else
                memcpy(dst, buf, n), *sink ^= dst[i % n];
        }
        double gbps = (double)n * (double)iters / (bench_now() - t0) / 1e9;
        best = gbps > best ? gbps : best;
    }
    return best;
}

int bench_crc_main(int argc, char **argv)
{
    size_t sizes[16] = {4096, 65536, 1u << 20, 4u << 20, 64u << 20};
    int nsizes = 5, reps = 5, json = 0;
    enum { O_JSON = 256, O_REPS, O_SIZES };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, O_JSON},
        {"reps", required_argument, NULL, O_REPS},
        {"sizes", required_argument, NULL, O_SIZES},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    while ((opt = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
        switch (opt) {
        case 'h': usage(stdout); return 0;
        case O_JSON: json = 1; break;
        case O_REPS: EPIPE_CLI_INT("epipe-bench crc", "--reps", 1, 1000000, reps); break;
        case O_SIZES: nsizes = parse_sizes(optarg, sizes, 16); break;
        default: /* ':' or '?' */
            epipe_cli_bad_option("epipe-bench crc", argv, opt);
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "epipe-bench crc: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (nsizes < 1 || reps < 1) {
        fprintf(stderr, "epipe-bench crc: bad --sizes or --reps\n");
        return 2;
    }
    size_t max = 0;
    for (int i = 0; i < nsizes; i++)
        max = sizes[i] > max ? sizes[i] : max;
    unsigned char *buf = malloc(max), *dst = malloc(max);
    if (!buf || !dst) {
        fprintf(stderr, "epipe-bench crc: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < max; i++)
        buf[i] = (unsigned char)(i * 2654435761u >> 13), dst[i] = 0;
    volatile uint32_t sink = 0;
    int hw = epipe_crc32c_hw_available();
    for (int i = 0; i < nsizes; i++) {
        size_t n = sizes[i];
        double fast = best_gbps(epipe_crc32c, buf, dst, n, reps, &sink);
        double one = best_gbps(epipe_crc32c_hw_1way, buf, dst, n, reps, &sink);
        double ref = best_gbps(epipe_crc32c_ref, buf, dst, n, reps, &sink);
        double cpy = best_gbps(NULL, buf, dst, n, reps, &sink);
        if (json)
            printf("{\"bench\": \"crc32c\", \"size\": %zu, \"hw\": %d, \"crc32c_gbps\": %.2f, "
                   "\"one_chain_gbps\": %.2f, \"ref_gbps\": %.2f, \"memcpy_gbps\": %.2f, "
                   "\"speedup_vs_one_chain\": %.2f}\n",
                   n, hw, fast, one, ref, cpy, fast / one);
        else
            printf("%9zu bytes: crc32c %.1f GB/s, one chain %.1f GB/s (x%.2f), reference %.1f "
                   "GB/s, memcpy %.1f GB/s\n",
                   n, fast, one, fast / one, ref, cpy);
    }
    free(buf);
    free(dst);
    return 0;
}
