/* Shared test helpers: deterministic random data and DLTensor views. */
#include "testutil.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <epipe/epipe.h>

#include "../lib/codec/codec_impl.h"
#include "../lib/codec/payload.h"
#include "../lib/comm/comm_impl.h"

void test_rng_seed(test_rng *r, uint64_t seed)
{
    r->s = seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
    if (!r->s)
        r->s = 1;
}

uint64_t test_rng_next(test_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545f4914f6cdd1dull;
}

double test_rng_uniform(test_rng *r)
{
    return (double)(test_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

double test_rng_normal(test_rng *r)
{
    double u = test_rng_uniform(r), v = test_rng_uniform(r);
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

void test_fill(float *x, size_t n, enum test_dist d, uint64_t seed)
{
    test_rng r;
    test_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++) {
        double g = test_rng_normal(&r);
        switch (d) {
        case DIST_NORMAL: x[i] = (float)g; break;
        case DIST_RELU: x[i] = g > 0 ? (float)g : 0.0f; break;
        case DIST_LOGNORMAL: x[i] = (float)(exp(g) * ((test_rng_next(&r) & 1) ? 1 : -1)); break;
        case DIST_UNIFORM: x[i] = (float)(2.0 * test_rng_uniform(&r) - 1.0); break;
        }
    }
}

DLTensor test_view_f32_nd(float *x, int64_t *shape, int ndim)
{
    DLTensor t = {0};
    t.data = x;
    t.device.device_type = kDLCPU;
    t.ndim = ndim;
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    t.shape = shape;
    return t;
}

DLTensor test_view_f32(float *x, int64_t *shape_store, size_t n)
{
    *shape_store = (int64_t)n;
    return test_view_f32_nd(x, shape_store, 1);
}

double test_mse(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        s += d * d;
    }
    return n ? s / (double)n : 0.0;
}

epipe_codec *test_codec(const char *spec, int threads, int ref)
{
    epipe_codec *c;
    if (epipe_codec_create(&c, spec) != EPIPE_OK)
        fail_msg("create '%s': %s", spec, epipe_last_error());
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_THREADS, threads), EPIPE_OK);
    if (ref)
        assert_true(epipe_codec_use_reference(c, 1));
    return c;
}

test_payload test_encode_view(const char *spec, const DLTensor *t, int threads, int ref)
{
    epipe_codec *c = test_codec(spec, threads, ref);
    test_payload p;
    assert_int_equal(epipe_codec_max_encoded_size(c, t, &p.len), EPIPE_OK);
    p.buf = malloc(p.len);
    size_t w;
    if (epipe_codec_encode(c, t, p.buf, p.len, &w) != EPIPE_OK)
        fail_msg("encode '%s' (%d dimensions, %lld first): %s", spec, t->ndim,
                 (long long)(t->ndim ? t->shape[0] : 0), epipe_codec_last_error(c));
    assert_int_equal(w, p.len);
    epipe_codec_destroy(c);
    return p;
}

test_payload test_encode(const char *spec, float *x, size_t n, int threads, int ref)
{
    int64_t shape;
    DLTensor t = test_view_f32(x, &shape, n);
    return test_encode_view(spec, &t, threads, ref);
}

void test_decode(const char *spec, const test_payload *p, float *y, size_t n, int threads, int ref)
{
    epipe_codec *c = test_codec(spec, threads, ref);
    int64_t shape;
    DLTensor t = test_view_f32(y, &shape, n);
    if (epipe_codec_decode(c, p->buf, p->len, &t) != EPIPE_OK)
        fail_msg("decode '%s': %s", spec, epipe_codec_last_error(c));
    epipe_codec_destroy(c);
}

void test_expect_rejected(epipe_codec *c, const uint8_t *p, size_t len, DLTensor *t,
                          const char *needle)
{
    for (int ref = 0; ref < 2; ref++) {
        assert_true(epipe_codec_use_reference(c, ref));
        int rc = epipe_codec_decode(c, p, len, t);
        if (rc != EPIPE_EPROTO || !strstr(epipe_codec_last_error(c), needle))
            fail_msg("rc %d, message '%s', expected EPROTO mentioning '%s'", rc,
                     epipe_codec_last_error(c), needle);
    }
}

void test_expect_proto(const char *spec, const test_payload *p, size_t n, const char *needle)
{
    epipe_codec *c = test_codec(spec, 1, 0);
    float *y = malloc(sizeof *y * (n ? n : 1));
    int64_t shape;
    DLTensor t = test_view_f32(y, &shape, n);
    test_expect_rejected(c, p->buf, p->len, &t, needle);
    free(y);
    epipe_codec_destroy(c);
}

epipe_msg *test_activation_msg(unsigned src, unsigned dst, uint64_t step, uint32_t mb,
                               const float *x, size_t n)
{
    epipe_codec *codec;
    assert_int_equal(epipe_codec_create(&codec, "none"), EPIPE_OK);
    int64_t shape;
    DLTensor t = test_view_f32((float *)x, &shape, n);
    size_t cap, len;
    assert_int_equal(epipe_codec_max_encoded_size(codec, &t, &cap), EPIPE_OK);
    epipe_msg *m = epipe_msg_new(cap);
    assert_non_null(m);
    assert_int_equal(epipe_codec_encode(codec, &t, epipe_msg_payload(m), cap, &len), EPIPE_OK);
    epipe_codec_destroy(codec);
    epipe_payload_header ph;
    assert_int_equal(epipe_payload_get(epipe_msg_payload(m), len, &ph), 0);
    memset(&m->hdr, 0, sizeof m->hdr);
    m->hdr.kind = EPIPE_WIRE_ACTIVATION;
    m->hdr.dtype = ph.dtype;
    m->hdr.ndim = 1;
    m->hdr.shape[0] = n;
    m->hdr.codec_id = ph.codec_id;
    m->hdr.codec_param = ph.param_word;
    m->hdr.micro_batch = mb;
    m->hdr.step = step;
    m->hdr.src_stage = src;
    m->hdr.dst_stage = dst;
    assert_int_equal(epipe_msg_seal(m, len), EPIPE_OK);
    return m;
}

unsigned test_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

int test_in_child(int (*fn)(const void *arg), const void *arg)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        _exit(fn(arg));
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (WIFSIGNALED(st))
        return -WTERMSIG(st);
    assert_true(WIFEXITED(st));
    return WEXITSTATUS(st);
}
