/* epipe-codec-demo: every codec on a real tensor (Fashion-MNIST images),
 * with the compression ratio, the error, and the speed of each. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <epipe/epipe.h>

#include "cli.h" /* tools/cli.h */
#include "common/idx.h"

static const char *const default_specs[] = {
    "none",
    "cast:dtype=bf16",
    "quant:bits=8",
    "quant:bits=4",
    "sortquant:bits=8",
    "sortquant:bits=4",
    "sortquant:bits=8,mode=exact",
    "kmeans:bits=4",
    "topk:ratio=0.1",
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const char *path = IDX_FASHION_DIR "/train-images-idx3-ubyte.gz";
    const char *specs[64];
    int nspecs = 0;
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"images", required_argument, NULL, 'i'},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    /* "-": specs stay in place, each returned as option 1. */
    while ((opt = getopt_long(argc, argv, "-:h", longopts, NULL)) != -1) {
        switch (opt) {
        case 'h':
            printf("usage: epipe-codec-demo [--images FILE.idx3[.gz]] [SPEC...]\n"
                   "Encodes the Fashion-MNIST training images with each codec and prints\n"
                   "the wire ratio, the error and the speed. Default specs: a tour of all.\n");
            return 0;
        case 'i': path = optarg; break;
        case 1:
            if (nspecs < 64)
                specs[nspecs++] = optarg;
            break;
        default: /* ':' or '?' */ epipe_cli_bad_option("epipe-codec-demo", argv, opt); return 2;
        }
    }
    if (!nspecs)
        for (size_t i = 0; i < sizeof default_specs / sizeof default_specs[0]; i++)
            specs[nspecs++] = default_specs[i];

    uint32_t count, pixels;
    char why[1200];
    /* zero mean, unit variance */
    float *x = idx_load_images(path, 0, 0, &count, &pixels, why, sizeof why);
    if (!x) {
        fprintf(stderr, "epipe-codec-demo: %s\n", why);
        return 1;
    }
    int64_t shape[4] = {count, 1, 28, 28};
    if (pixels != 28 * 28)
        shape[2] = pixels, shape[3] = 1;
    size_t n = (size_t)count * pixels;
    float *y = calloc(n, sizeof *y);
    if (!y) {
        fprintf(stderr, "epipe-codec-demo: out of memory for a %zu-value tensor\n", n);
        free(x);
        return 1;
    }
    DLTensor src = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 4, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    DLTensor dst = src;
    dst.data = y;
    printf("libepipe %s: %s as a [%lld,%lld,%lld,%lld] fp32 tensor (%.1f MB)\n\n",
           epipe_version_string(), path, (long long)shape[0], (long long)shape[1],
           (long long)shape[2], (long long)shape[3], (double)n * 4 / 1e6);
    printf("%-44s %9s %11s %10s %10s %10s\n", "codec (canonical spec)", "ratio", "MSE", "PSNR dB",
           "enc MB/s", "dec MB/s");
    int failed = 0;
    for (int s = 0; s < nspecs; s++) {
        epipe_codec *c;
        if (epipe_codec_create(&c, specs[s]) != EPIPE_OK) {
            printf("%-44s %s\n", specs[s], epipe_last_error());
            failed = 1;
            continue;
        }
        size_t cap, len;
        uint8_t *buf = NULL;
        int rc = epipe_codec_max_encoded_size(c, &src, &cap);
        if (!rc && !(buf = malloc(cap)))
            rc = EPIPE_ENOMEM;
        if (!rc) /* touch the pages first, so the timings are the codec's */
            memset(buf, 0, cap), memset(y, 0, n * sizeof *y);
        double t0 = now();
        if (!rc)
            rc = epipe_codec_encode(c, &src, buf, cap, &len);
        double t1 = now();
        if (!rc)
            rc = epipe_codec_decode(c, buf, len, &dst);
        double t2 = now();
        if (rc) {
            printf("%-44s %s: %s\n", epipe_codec_spec(c), epipe_strerror(rc),
                   epipe_codec_last_error(c));
            failed = 1;
        } else {
            double se = 0, peak = 0;
            for (size_t i = 0; i < n; i++) {
                double d = (double)x[i] - y[i];
                se += d * d;
                peak = fabs(x[i]) > peak ? fabs(x[i]) : peak;
            }
            double mse = se / (double)n;
            printf("%-44s %9.4f %11.3g %10.1f %10.0f %10.0f\n", epipe_codec_spec(c),
                   (double)len / ((double)n * 4), mse,
                   mse > 0 ? 10 * log10(peak * peak / mse) : INFINITY,
                   (double)n * 4 / 1e6 / (t1 - t0), (double)n * 4 / 1e6 / (t2 - t1));
        }
        free(buf);
        epipe_codec_destroy(c);
    }
    printf("\nratio = bytes on the wire / raw fp32 bytes; MB/s counts raw fp32 bytes.\n");
    free(x);
    free(y);
    return failed;
}
