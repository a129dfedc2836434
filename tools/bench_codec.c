/* epipe-bench codec: encode and decode throughput of codecs against a
 * plain memcpy of the same tensor, their scalar references, and the error. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <epipe/epipe.h>

#include "../lib/codec/codec_impl.h"
#include "bench.h"
#include "cli.h"

#ifdef EPIPE_HAVE_BLAS
#include <cblas.h>
#endif

struct opts {
    int64_t shape[8];
    int ndim;
    const char *dist;
    int threads, reps, json, ref, gemm, fresh;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-bench codec SPEC [SPEC...] [--shape 32,32,112,112]\n"
               "       [--dist normal|relu|lognormal|uniform] [--threads N] [--reps R]\n"
               "       [--no-ref] [--gemm] [--fresh] [--json] [--device cpu|cuda]\n"
               "       [--payload device|host]\n\n"
               "Times encode and decode of one tensor (best of R runs, default 5) beside a\n"
               "single-threaded memcpy of the same bytes, and the codec's scalar reference\n"
               "(once; --no-ref skips it). --threads sets EPIPE_CODEC_THREADS (0 = auto).\n"
               "--gemm, for trainable codecs (insert): also time plain cblas_sgemm calls of\n"
               "the same matrix shapes on operands of the same size, and give GFLOP/s.\n"
               "--fresh: also time encode into a payload buffer, and decode into a tensor,\n"
               "allocated (malloc) before each call and freed after it, as a host that\n"
               "allocates per call pays (the Python binding's encode() to bytes).\n"
               "--device cuda runs epipe-bench-cuda (built with -Dcuda; found beside this\n"
               "program, in ../cuda/ of a build tree, or at $EPIPE_BENCH_CUDA) on a CUDA\n"
               "tensor of the --shape's size, against a device-to-device copy; it takes\n"
               "--reps and --payload (where the payload lives, default device).\n");
}

/* --device cuda: the CUDA benchmark is its own program (it links cudart,
 * which nothing here may), run in place of this one. */
static int run_cuda_bench(const char *const *specs, int nspecs, size_t n, int reps,
                          const char *payload)
{
    char self[4096], path[4200];
    const char *env = getenv("EPIPE_BENCH_CUDA");
    const char *tried[3];
    int ntried = 0;
    path[0] = 0;
    if (env && *env) {
        snprintf(path, sizeof path, "%s", env);
        tried[ntried++] = env;
    } else {
        ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
        if (len > 0) {
            self[len] = 0;
            char *slash = strrchr(self, '/');
            if (slash)
                *slash = 0;
            static char a[4200], b[4200];
            snprintf(a, sizeof a, "%s/epipe-bench-cuda", self);
            snprintf(b, sizeof b, "%s/../cuda/epipe-bench-cuda", self);
            tried[ntried++] = a;
            tried[ntried++] = b;
            for (int i = 0; i < ntried && !path[0]; i++)
                if (access(tried[i], X_OK) == 0)
                    snprintf(path, sizeof path, "%s", tried[i]);
        }
    }
    if (!path[0] || access(path, X_OK) != 0) {
        fprintf(stderr, "epipe-bench codec: --device cuda needs epipe-bench-cuda (built with "
                        "-Dcuda); not found at");
        for (int i = 0; i < ntried; i++)
            fprintf(stderr, " %s%s", tried[i], i + 1 < ntried ? "," : "");
        fprintf(stderr, "%s\n", ntried ? "" : " (no path known: set EPIPE_BENCH_CUDA)");
        return 2;
    }
    char nbuf[32], rbuf[32];
    snprintf(nbuf, sizeof nbuf, "%zu", n);
    snprintf(rbuf, sizeof rbuf, "%d", reps);
    const char *args[48];
    int k = 0;
    args[k++] = path;
    args[k++] = "--n";
    args[k++] = nbuf;
    args[k++] = "--reps";
    args[k++] = rbuf;
    args[k++] = "--payload";
    args[k++] = payload;
    for (int i = 0; i < nspecs && k < 47; i++)
        args[k++] = specs[i];
    args[k] = NULL;
    fflush(stdout);
    execv(path, (char *const *)args);
    fprintf(stderr, "epipe-bench codec: cannot run %s: %s\n", path, strerror(errno));
    return 1;
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

/* --fresh: the same calls on memory allocated for each call, so the page
 * faults of first touch are paid each time, as by a host that allocates. */
static int do_encode_fresh(void *p)
{
    struct run *r = p;
    uint8_t *out = malloc(r->cap);
    size_t len;
    int rc = out ? epipe_codec_encode(r->codec, r->src, out, r->cap, &len) : EPIPE_ENOMEM;
    free(out);
    return rc;
}

static int do_decode_fresh(void *p)
{
    struct run *r = p;
    DLTensor t = *r->dst;
    t.data = malloc(r->bytes);
    int rc = t.data ? epipe_codec_decode(r->codec, r->buf, r->len, &t) : EPIPE_ENOMEM;
    free(t.data);
    return rc;
}

/* The GEMMs an insert encode or decode performs, as plain BLAS calls on
 * operands of the same sizes: batch calls of (M x Kd) . (Kd x N). */
struct gemm_ref {
    int batch, linear;
    int K, P, S;    /* code channels, values a patch, positions a sample */
    const float *x; /* batch x [P][S] (conv) or [rows][P] (linear) */
    float *w;       /* [K][P] */
    float *z;       /* code: batch x [K][S] or [rows][K] */
    float *y;       /* like x */
};

static int do_gemm_encode(void *p)
{
#ifdef EPIPE_HAVE_BLAS
    struct gemm_ref *g = p;
    if (g->linear) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g->batch, g->K, g->P, 1.0f, g->x, g->P,
                    g->w, g->P, 0.0f, g->z, g->K);
        return 0;
    }
    size_t per = (size_t)g->P * (size_t)g->S, zper = (size_t)g->K * (size_t)g->S;
    for (int b = 0; b < g->batch; b++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g->K, g->S, g->P, 1.0f, g->w, g->P,
                    g->x + (size_t)b * per, g->S, 0.0f, g->z + (size_t)b * zper, g->S);
    return 0;
#else
    (void)p;
    return -1; /* no BLAS: gemm_shapes() never selects these */
#endif
}

static int do_gemm_decode(void *p)
{
#ifdef EPIPE_HAVE_BLAS
    struct gemm_ref *g = p;
    if (g->linear) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g->batch, g->P, g->K, 1.0f, g->z,
                    g->K, g->w, g->P, 0.0f, g->y, g->P);
        return 0;
    }
    size_t per = (size_t)g->P * (size_t)g->S, zper = (size_t)g->K * (size_t)g->S;
    for (int b = 0; b < g->batch; b++)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, g->P, g->S, g->K, 1.0f, g->w, g->P,
                    g->z + (size_t)b * zper, g->S, 0.0f, g->y + (size_t)b * per, g->S);
    return 0;
#else
    (void)p;
    return -1; /* no BLAS: gemm_shapes() never selects these */
#endif
}

/* Fills *g for codec c on the tensor src; 0 if c is not a GEMM codec. */
static int gemm_shapes(epipe_codec *c, const DLTensor *src, struct gemm_ref *g)
{
    int zn;
    int64_t zs[EPIPE_CODEC_MAX_NDIM];
#ifndef EPIPE_HAVE_BLAS
    return 0; /* built without a BLAS: nothing to compare with */
#endif
    if (!epipe_codec_trainable(c) || epipe_codec_code_shape(c, src, &zn, zs))
        return 0;
    memset(g, 0, sizeof *g);
    if (src->ndim == 4 && zn == 4 && zs[2] < src->shape[2] + 1 &&
        strstr(epipe_codec_spec(c), "kind=conv")) {
        int64_t k = src->shape[2] / zs[2];
        g->batch = (int)src->shape[0];
        g->K = (int)zs[1];
        g->P = (int)(src->shape[1] * k * k);
        g->S = (int)(zs[2] * zs[3]);
    } else {
        int64_t rows = 1;
        for (int d = 0; d + 1 < src->ndim; d++)
            rows *= src->shape[d];
        g->linear = 1;
        g->batch = (int)rows;
        g->K = (int)zs[zn - 1];
        g->P = (int)src->shape[src->ndim - 1];
        g->S = 1;
    }
    return 1;
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
    DLTensor src = {.data = x,
                    .device = {kDLCPU, 0},
                    .ndim = o->ndim,
                    .dtype = {kDLFloat, 32, 1},
                    .shape = shape};
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
    double t_fenc = NAN, t_fdec = NAN;
    if (!rc && o->fresh) { /* r.buf keeps the last payload: the fresh encodes write elsewhere */
        t_fenc = best_of(o->reps, do_encode_fresh, &r, &rc);
        t_fdec = rc ? NAN : best_of(o->reps, do_decode_fresh, &r, &rc);
    }
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
    int identical = -1, approx = c->be->ref_approximate;
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
    /* --gemm: the BLAS's own rate on the same shapes. */
    struct gemm_ref g;
    double gflop = NAN, t_genc = NAN, t_gdec = NAN;
    if (o->gemm && gemm_shapes(c, &src, &g)) {
        size_t zn = (size_t)g.batch * (size_t)g.K * (size_t)g.S;
        g.w = malloc((size_t)g.K * (size_t)g.P * sizeof(float));
        g.z = malloc(zn * sizeof(float));
        g.x = x, g.y = y;
        if (g.w && g.z) {
            for (size_t i = 0; i < (size_t)g.K * (size_t)g.P; i++)
                g.w[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
            gflop = 2.0 * (double)g.batch * g.K * (double)g.P * g.S * 1e-9;
            int grc;
            t_genc = best_of(o->reps, do_gemm_encode, &g, &grc);
            t_gdec = best_of(o->reps, do_gemm_decode, &g, &grc);
        }
        free(g.w), free(g.z);
    }
    double mv = (double)n * 1e-6;
    double copy = mv / t_copy, enc = mv / t_enc, dec = mv / t_dec;
    if (o->json) {
        printf("{\"codec\": \"%s\", \"n\": %zu, \"dist\": \"%s\", \"threads\": %d, "
               "\"encode_mvals\": %.1f, \"decode_mvals\": %.1f, \"memcpy_mvals\": %.1f, "
               "\"encode_vs_memcpy\": %.4f, \"decode_vs_memcpy\": %.4f, "
               "\"wire_bytes\": %zu, \"wire_ratio\": %.6f, \"mse\": %.6g, \"max_abs_err\": %.6g",
               epipe_codec_spec(c), n, o->dist, o->threads, enc, dec, copy, enc / copy, dec / copy,
               len, (double)len / (double)(n * 4), se / (double)n, maxe);
        if (identical >= 0)
            printf(", \"ref_encode_mvals\": %.2f, \"ref_decode_mvals\": %.2f, "
                   "\"ref_identical\": %s",
                   mv / t_ref_enc, mv / t_ref_dec, identical ? "true" : "false");
        if (!isnan(ref_diff))
            printf(", \"ref_encode_mvals\": %.2f, \"ref_decode_mvals\": %.2f, "
                   "\"ref_max_rel_diff\": %.3g",
                   mv / t_ref_enc, mv / t_ref_dec, ref_diff);
        if (o->fresh)
            printf(", \"fresh_encode_mvals\": %.1f, \"fresh_decode_mvals\": %.1f", mv / t_fenc,
                   mv / t_fdec);
        if (!isnan(gflop))
            printf(", \"encode_gflops\": %.2f, \"decode_gflops\": %.2f, "
                   "\"gemm_encode_gflops\": %.2f, \"gemm_decode_gflops\": %.2f, "
                   "\"encode_vs_gemm\": %.4f, \"decode_vs_gemm\": %.4f",
                   gflop / t_enc, gflop / t_dec, gflop / t_genc, gflop / t_gdec, t_genc / t_enc,
                   t_gdec / t_dec);
        printf("}\n");
    } else {
        printf("%s  (%zu values, %s, threads=%d)\n", epipe_codec_spec(c), n, o->dist, o->threads);
        printf("  memcpy   %9.1f Mvals/s\n", copy);
        printf("  encode   %9.1f Mvals/s  %.3fx memcpy\n", enc, enc / copy);
        printf("  decode   %9.1f Mvals/s  %.3fx memcpy\n", dec, dec / copy);
        if (o->fresh)
            printf("  fresh    encode %.1f, decode %.1f Mvals/s (memory allocated each call)\n",
                   mv / t_fenc, mv / t_fdec);
        if (identical >= 0)
            printf("  reference encode %.1f, decode %.1f Mvals/s; bytes %s the fast path's\n",
                   mv / t_ref_enc, mv / t_ref_dec, identical ? "identical to" : "DIFFER from");
        if (!isnan(ref_diff))
            printf("  reference encode %.1f, decode %.1f Mvals/s; approximate: decoded values "
                   "within %.3g of max|x| of the fast path's\n",
                   mv / t_ref_enc, mv / t_ref_dec, ref_diff);
        if (!isnan(gflop)) {
            printf("  encode   %9.2f GFLOP/s  %.3fx cblas_sgemm of the same shapes (%.2f)\n",
                   gflop / t_enc, t_genc / t_enc, gflop / t_genc);
            printf("  decode   %9.2f GFLOP/s  %.3fx cblas_sgemm of the same shapes (%.2f)\n",
                   gflop / t_dec, t_gdec / t_dec, gflop / t_gdec);
        }
        printf("  wire     %zu bytes, ratio %.4f\n", len, (double)len / (double)(n * 4));
        printf("  error    mse %.4g, max abs %.4g\n", se / (double)n, maxe);
    }
    free(r.buf);
    epipe_codec_destroy(c);
    return identical == 0 ? 1 : 0;
}

int bench_codec_main(int argc, char **argv)
{
    struct opts o = {.shape = {32, 32, 112, 112},
                     .ndim = 4,
                     .dist = "normal",
                     .threads = 0,
                     .reps = 5,
                     .ref = 1};
    const char *specs[32];
    int nspecs = 0;
    enum {
        O_JSON = 256,
        O_GEMM,
        O_FRESH,
        O_NO_REF,
        O_SHAPE,
        O_DIST,
        O_THREADS,
        O_REPS,
        O_DEVICE,
        O_PAYLOAD
    };
    const char *device = "cpu", *payload = "device";
    int reps_set = 0;
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, O_JSON},
        {"gemm", no_argument, NULL, O_GEMM},
        {"fresh", no_argument, NULL, O_FRESH},
        {"no-ref", no_argument, NULL, O_NO_REF},
        {"shape", required_argument, NULL, O_SHAPE},
        {"dist", required_argument, NULL, O_DIST},
        {"threads", required_argument, NULL, O_THREADS},
        {"reps", required_argument, NULL, O_REPS},
        {"device", required_argument, NULL, O_DEVICE},
        {"payload", required_argument, NULL, O_PAYLOAD},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    /* "-" keeps the specs in place: each is returned as option 1. */
    while ((opt = getopt_long(argc, argv, "-:h", longopts, NULL)) != -1) {
        switch (opt) {
        case 'h': usage(stdout); return 0;
        case O_JSON: o.json = 1; break;
        case O_GEMM: o.gemm = 1; break;
        case O_FRESH: o.fresh = 1; break;
        case O_NO_REF: o.ref = 0; break;
        case O_SHAPE:
            if (parse_shape(optarg, &o)) {
                fprintf(stderr, "epipe-bench codec: bad --shape '%s' (want e.g. 32,32,112,112)\n",
                        optarg);
                return 2;
            }
            break;
        case O_DIST:
            o.dist = optarg;
            if (strcmp(o.dist, "normal") && strcmp(o.dist, "relu") && strcmp(o.dist, "lognormal") &&
                strcmp(o.dist, "uniform")) {
                fprintf(stderr, "epipe-bench codec: unknown --dist '%s'\n", o.dist);
                return 2;
            }
            break;
        case O_THREADS: EPIPE_CLI_INT("epipe-bench codec", "--threads", 0, 256, o.threads); break;
        case O_REPS:
            EPIPE_CLI_INT("epipe-bench codec", "--reps", 1, 1000000, o.reps);
            reps_set = 1;
            break;
        case O_DEVICE:
            device = optarg;
            if (strcmp(device, "cpu") && strcmp(device, "cuda")) {
                fprintf(stderr, "epipe-bench codec: unknown --device '%s' (cpu or cuda)\n", device);
                return 2;
            }
            break;
        case O_PAYLOAD:
            payload = optarg;
            if (strcmp(payload, "device") && strcmp(payload, "host")) {
                fprintf(stderr, "epipe-bench codec: unknown --payload '%s' (device or host)\n",
                        payload);
                return 2;
            }
            break;
        case 1:
            if (nspecs < 32)
                specs[nspecs++] = optarg;
            break;
        default: /* ':' or '?' */
            epipe_cli_bad_option("epipe-bench codec", argv, opt);
            usage(stderr);
            return 2;
        }
    }
    if (!nspecs) {
        usage(stderr);
        return 2;
    }
    size_t n = 1;
    for (int d = 0; d < o.ndim; d++)
        n *= (size_t)o.shape[d];
    if (!strcmp(device, "cuda")) {
        if (o.json || o.gemm || strcmp(o.dist, "normal") || o.threads) {
            fprintf(stderr, "epipe-bench codec: --device cuda times normal values only and "
                            "takes neither --json, --gemm, --dist nor --threads\n");
            return 2;
        }
        return run_cuda_bench(specs, nspecs, n, reps_set ? o.reps : 20, payload);
    }
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
