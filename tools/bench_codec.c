/* epipe-bench codec: encode and decode throughput of codecs against a
 * plain memcpy of the same tensor, their scalar references, and the error. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "../codecs/codec_impl.h"
#include "bench.h"

struct opts {
    int64_t shape[8];
    int ndim;
    const char *dist;
    int threads, reps, json, ref;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: epipe-bench codec SPEC [SPEC...] [--shape 32,32,112,112]\n"
            "       [--dist normal|relu|lognormal|uniform] [--threads N] [--reps R]\n"
            "       [--no-ref] [--json]\n\n"
            "Times encode and decode of one tensor (best of R runs, default 5) beside a\n"
            "single-threaded memcpy of the same bytes, and the codec's scalar reference\n"
            "(once; --no-ref skips it). --threads sets EPIPE_CODEC_THREADS (0 = auto).\n");
}

static int parse_shape(const char *s, struct opts *o)
{
    o->ndim = 0;
    while (*s) {
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (end == s || v <= 0 || errno || o->ndim == 8)
            return -1;
        o->shape[o->ndim++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return o->ndim ? 0 : -1;
}

/* Deterministic data, fast enough for 100M values: xorshift + Box-Muller. */
static void fill(float *x, size_t n, const char *dist)
{
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i += 2) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        double u = (double)((s * 0x2545f4914f6cdd1dull) >> 11) * 0x1p-53;
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        double v = (double)((s * 0x2545f4914f6cdd1dull) >> 11) * 0x1p-53;
        double r = sqrt(-2.0 * log(1.0 - u));
        double g[2] = {r * cos(6.283185307179586 * v), r * sin(6.283185307179586 * v)};
        for (int k = 0; k < 2 && i + k < n; k++) {
            double y = g[k];
            if (!strcmp(dist, "relu"))
                y = y > 0 ? y : 0;
            else if (!strcmp(dist, "lognormal"))
                y = exp(y) * ((i + k) % 2 ? 1 : -1);
            else if (!strcmp(dist, "uniform"))
                y = 2.0 * (k ? v : u) - 1.0;
            x[i + k] = (float)y;
        }
    }
}

static double best_of(int reps, int (*fn)(void *), void *ctx, int *rc)
{
    double best = INFINITY;
    for (int r = 0; r < reps; r++) {
        double t0 = bench_now();
        *rc = fn(ctx);
        double t = bench_now() - t0;
        if (*rc)
            return NAN;
        if (t < best)
            best = t;
    }
    return best;
}

struct run {
    epipe_codec *codec;
    DLTensor *src, *dst;
    uint8_t *buf;
    size_t cap, len;
    const float *from;
    float *to;
    size_t bytes;
};

static int do_memcpy(void *p)
{
    struct run *r = p;
    memcpy(r->to, r->from, r->bytes);
    return 0;
}

static int do_encode(void *p)
{
    struct run *r = p;
    return epipe_codec_encode(r->codec, r->src, r->buf, r->cap, &r->len);
}

static int do_decode(void *p)
{
    struct run *r = p;
    return epipe_codec_decode(r->codec, r->buf, r->len, r->dst);
}

static int bench_one(const char *spec, const struct opts *o, float *x, float *y, size_t n)
{
    epipe_codec *c;
    if (epipe_codec_create(&c, spec) != EPIPE_OK) {
        fprintf(stderr, "epipe-bench: %s\n", epipe_last_error());
        return 1;
    }
    epipe_codec_set_param(c, EPIPE_CODEC_THREADS, o->threads);
    int64_t shape[8];
    memcpy(shape, o->shape, sizeof shape);
    DLTensor src = {.data = x, .device = {kDLCPU, 0}, .ndim = o->ndim,
                    .dtype = {kDLFloat, 32, 1}, .shape = shape};
    DLTensor dst = src;
    dst.data = y;
    struct run r = {.codec = c, .src = &src, .dst = &dst, .from = x, .to = y, .bytes = n * 4};
    int rc = epipe_codec_max_encoded_size(c, &src, &r.cap);
    r.buf = rc ? NULL : malloc(r.cap);
    if (!r.buf) {
        fprintf(stderr, "epipe-bench: %s: cannot plan or allocate the payload\n", spec);
        epipe_codec_destroy(c);
        return 1;
    }
    memset(r.buf, 0, r.cap);
    double t_copy = best_of(o->reps, do_memcpy, &r, &rc);
    double t_enc = best_of(o->reps, do_encode, &r, &rc);
    double t_dec = rc ? NAN : best_of(o->reps, do_decode, &r, &rc);
    if (rc) {
        fprintf(stderr, "epipe-bench: %s: %s\n", spec, epipe_codec_last_error(c));
        free(r.buf);
        epipe_codec_destroy(c);
        return 1;
    }
    double se = 0, maxe = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)x[i] - (double)y[i]);
        se += d * d;
        maxe = d > maxe ? d : maxe;
    }
    size_t len = r.len;
    /* The scalar reference, once: its bytes must equal the fast path's. */
    double t_ref_enc = NAN, t_ref_dec = NAN, ref_diff = NAN;
    int identical = -1, approx = c->ops->ref_approximate;
    if (o->ref && epipe_codec_use_reference(c, 1) && c->use_reference) {
        uint8_t *fast = r.buf;
        /* An approximate reference is judged by its decoded values: the
         * largest difference from the fast path's, relative to max |x|. */
        float *fast_y = approx ? malloc(n * sizeof *fast_y) : NULL;
        r.buf = malloc(r.cap);
        if (r.buf && (!approx || fast_y)) {
            if (fast_y)
                memcpy(fast_y, y, n * sizeof *y);
            memset(r.buf, 0, r.cap);
            t_ref_enc = best_of(1, do_encode, &r, &rc);
            identical = !rc && r.len == len && memcmp(fast, r.buf, len) == 0;
            t_ref_dec = rc ? NAN : best_of(1, do_decode, &r, &rc);
            if (approx && !rc) {
                double d = 0, xmax = 0;
                for (size_t i = 0; i < n; i++) {
                    double e = fabs((double)y[i] - (double)fast_y[i]), a = fabs((double)x[i]);
                    d = e > d ? e : d;
                    xmax = a > xmax ? a : xmax;
                }
                ref_diff = xmax > 0 ? d / xmax : d;
                identical = -1;
            }
        }
        free(r.buf);
        free(fast_y);
        r.buf = fast;
        epipe_codec_use_reference(c, 0);
    }
    double mv = (double)n * 1e-6;
    double copy = mv / t_copy, enc = mv / t_enc, dec = mv / t_dec;
    if (o->json) {
        printf("{\"codec\": \"%s\", \"n\": %zu, \"dist\": \"%s\", \"threads\": %d, "
               "\"encode_mvals\": %.1f, \"decode_mvals\": %.1f, \"memcpy_mvals\": %.1f, "
               "\"encode_vs_memcpy\": %.4f, \"decode_vs_memcpy\": %.4f, "
               "\"wire_bytes\": %zu, \"wire_ratio\": %.6f, \"mse\": %.6g, \"max_abs_err\": %.6g",
               epipe_codec_spec(c), n, o->dist, o->threads, enc, dec, copy, enc / copy,
               dec / copy, len, (double)len / (double)(n * 4), se / (double)n, maxe);
        if (identical >= 0)
            printf(", \"ref_encode_mvals\": %.2f, \"ref_decode_mvals\": %.2f, "
                   "\"ref_identical\": %s",
                   mv / t_ref_enc, mv / t_ref_dec, identical ? "true" : "false");
        if (!isnan(ref_diff))
            printf(", \"ref_encode_mvals\": %.2f, \"ref_decode_mvals\": %.2f, "
                   "\"ref_max_rel_diff\": %.3g",
                   mv / t_ref_enc, mv / t_ref_dec, ref_diff);
        printf("}\n");
    } else {
        printf("%s  (%zu values, %s, threads=%d)\n", epipe_codec_spec(c), n, o->dist, o->threads);
        printf("  memcpy   %9.1f Mvals/s\n", copy);
        printf("  encode   %9.1f Mvals/s  %.3fx memcpy\n", enc, enc / copy);
        printf("  decode   %9.1f Mvals/s  %.3fx memcpy\n", dec, dec / copy);
        if (identical >= 0)
            printf("  reference encode %.1f, decode %.1f Mvals/s; bytes %s the fast path's\n",
                   mv / t_ref_enc, mv / t_ref_dec, identical ? "identical to" : "DIFFER from");
        if (!isnan(ref_diff))
            printf("  reference encode %.1f, decode %.1f Mvals/s; approximate: decoded values "
                   "within %.3g of max|x| of the fast path's\n",
                   mv / t_ref_enc, mv / t_ref_dec, ref_diff);
        printf("  wire     %zu bytes, ratio %.4f\n", len, (double)len / (double)(n * 4));
        printf("  error    mse %.4g, max abs %.4g\n", se / (double)n, maxe);
    }
    free(r.buf);
    epipe_codec_destroy(c);
    return identical == 0 ? 1 : 0;
}

int bench_codec_main(int argc, char **argv)
{
    struct opts o = {.shape = {32, 32, 112, 112}, .ndim = 4, .dist = "normal", .threads = 0,
                     .reps = 5, .ref = 1};
    const char *specs[32];
    int nspecs = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            o.json = 1;
        } else if (!strcmp(a, "--no-ref")) {
            o.ref = 0;
        } else if (!strcmp(a, "--shape") && more) {
            if (parse_shape(argv[++i], &o)) {
                fprintf(stderr, "epipe-bench codec: bad --shape '%s' (want e.g. 32,32,112,112)\n",
                        argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--dist") && more) {
            o.dist = argv[++i];
            if (strcmp(o.dist, "normal") && strcmp(o.dist, "relu") &&
                strcmp(o.dist, "lognormal") && strcmp(o.dist, "uniform")) {
                fprintf(stderr, "epipe-bench codec: unknown --dist '%s'\n", o.dist);
                return 2;
            }
        } else if (!strcmp(a, "--threads") && more) {
            o.threads = atoi(argv[++i]);
        } else if (!strcmp(a, "--reps") && more) {
            o.reps = atoi(argv[++i]);
            if (o.reps < 1)
                o.reps = 1;
        } else if (a[0] == '-') {
            fprintf(stderr, "epipe-bench codec: unknown or incomplete option '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (nspecs < 32) {
            specs[nspecs++] = a;
        }
    }
    if (!nspecs) {
        usage(stderr);
        return 2;
    }
    size_t n = 1;
    for (int d = 0; d < o.ndim; d++)
        n *= (size_t)o.shape[d];
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    if (!x || !y) {
        fprintf(stderr, "epipe-bench codec: cannot allocate %zu values\n", n);
        return 1;
    }
    fill(x, n, o.dist);
    memset(y, 0, n * sizeof *y);
    int bad = 0;
    for (int s = 0; s < nspecs; s++)
        bad |= bench_one(specs[s], &o, x, y, n);
    free(x);
    free(y);
    return bad;
}
