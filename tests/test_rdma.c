/* Tests of the rdma transport over the test verbs provider (libfakeverbs):
 * loader errors, messages, protocol attacks, faults and leak counting. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <epipe/comm.h>

#include "../transport/rdma.h"
#include "comm/comm_impl.h"
#include "testutil.h"

static const char *fakeverbs; /* EPIPE_TEST_FAKEVERBS: the provider's path */

static unsigned free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

/* Live objects of a kind in the provider ("mr", "qp", ...), -1 if not loaded. */
static int provider_live(const char *what)
{
    void *h = dlopen(fakeverbs, RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        return 0; /* not loaded: nothing lives */
    int (*f)(const char *) = (int (*)(const char *))dlsym(h, "fakeverbs_live");
    int n = f ? f(what) : -1;
    dlclose(h);
    return n;
}

static void expect_no_leaks(void)
{
    assert_int_equal(epipe_rdma_live_mrs(), 0);
    assert_int_equal(provider_live("mr"), 0);
    assert_int_equal(provider_live("qp"), 0);
    assert_int_equal(provider_live("cq"), 0);
    assert_int_equal(provider_live("pd"), 0);
}

static int setup_env(void **state)
{
    setenv("EPIPE_IBVERBS_LIB", fakeverbs, 1);
    unsetenv("EPIPE_FAKEVERBS_DEVICES");
    unsetenv("EPIPE_FAKEVERBS_PORT");
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    epipe_rdma_debug_corrupt_info(-1);
    return 0;
}

/* ---- ranks as threads ---------------------------------------------------- */

struct rank_arg {
    pthread_t th;
    const char *transport;
    unsigned rank, size, port;
    const char *opts;
    epipe_comm *c;
    int rc;
    char err[256];
};

static void *create_thread(void *p)
{
    struct rank_arg *a = p;
    a->rc = epipe_comm_create(&a->c, a->transport, a->rank, a->size, "127.0.0.1", a->port,
                              a->opts);
    snprintf(a->err, sizeof a->err, "%s", epipe_last_error());
    return NULL;
}

/* Creates `size` ranks; their statuses in rc[], messages in err[][256]. */
static void try_group(const char *transport, epipe_comm **c, unsigned size, const char *opts,
                      int *rc, char (*err)[256])
{
    struct rank_arg a[4];
    unsigned port = free_port();
    for (unsigned r = 0; r < size; r++) {
        a[r] = (struct rank_arg){.transport = transport, .rank = r, .size = size, .port = port,
                                 .opts = opts};
        assert_int_equal(pthread_create(&a[r].th, NULL, create_thread, &a[r]), 0);
    }
    for (unsigned r = 0; r < size; r++) {
        pthread_join(a[r].th, NULL);
        c[r] = a[r].c;
        rc[r] = a[r].rc;
        if (err)
            snprintf(err[r], 256, "%s", a[r].err);
    }
}

static void make_group(const char *transport, epipe_comm **c, unsigned size, const char *opts)
{
    int rc[4];
    char err[4][256];
    try_group(transport, c, size, opts, rc, err);
    for (unsigned r = 0; r < size; r++) {
        if (rc[r])
            print_error("rank %u: %s\n", r, err[r]);
        assert_int_equal(rc[r], EPIPE_OK);
    }
}

static epipe_msg *make_act(unsigned src, unsigned dst, uint64_t step, uint32_t mb, size_t n,
                           uint64_t seed)
{
    float *x = malloc((n ? n : 1) * sizeof *x);
    assert_non_null(x);
    test_fill(x, n, DIST_NORMAL, seed);
    epipe_msg *m = test_activation_msg(src, dst, step, mb, x, n);
    free(x);
    return m;
}

static void recv_act(epipe_comm *c, unsigned peer, uint64_t step, uint32_t mb, size_t n,
                     uint64_t seed)
{
    epipe_msg *m;
    int rc = epipe_comm_recv(c, peer, EPIPE_WIRE_ACTIVATION, step, mb, 10000, &m);
    if (rc)
        print_error("%s\n", epipe_comm_last_error(c));
    assert_int_equal(rc, EPIPE_OK);
    float *want = malloc((n ? n : 1) * sizeof *want);
    test_fill(want, n, DIST_NORMAL, seed);
    assert_int_equal(m->hdr.shape[0], n);
    assert_memory_equal(m->data + m->hdr.header_len + 16, want, n * sizeof *want);
    free(want);
    epipe_msg_free(m);
}

/* ---- loader and probe errors ------------------------------------------- */

static void expect_enotsup(const char *needle)
{
    epipe_comm *c = NULL;
    int rc = epipe_comm_create(&c, "rdma", 0, 1, NULL, 0, NULL);
    assert_int_equal(rc, EPIPE_ENOTSUP);
    assert_null(c);
    if (!strstr(epipe_last_error(), needle))
        print_error("'%s' does not name '%s'\n", epipe_last_error(), needle);
    assert_non_null(strstr(epipe_last_error(), needle));
}

static void test_loader_errors(void **state)
{
    setenv("EPIPE_IBVERBS_LIB", "/nonexistent/libibverbs-missing.so.1", 1);
    expect_enotsup("/nonexistent/libibverbs-missing.so.1");
    setenv("EPIPE_IBVERBS_LIB", "libm.so.6", 1); /* a library without verbs */
    expect_enotsup("ibv_get_device_list@IBVERBS_1.1");
    setenv("EPIPE_IBVERBS_LIB", fakeverbs, 1);
    setenv("EPIPE_FAKEVERBS_DEVICES", "0", 1);
    expect_enotsup("no RDMA device");
    unsetenv("EPIPE_FAKEVERBS_DEVICES");
    setenv("EPIPE_FAKEVERBS_PORT", "down", 1);
    expect_enotsup("port 1 is DOWN");
    unsetenv("EPIPE_FAKEVERBS_PORT");
    setenv("EPIPE_RDMA_DEVICE", "mlx5_9", 1);
    expect_enotsup("mlx5_9");
    unsetenv("EPIPE_RDMA_DEVICE");
    expect_no_leaks();
}

/* auto: rdma where both sides have a device, tcp otherwise. */
static void test_auto_picks(void **state)
{
    epipe_comm *c[2];
    make_group("auto", c, 2, NULL);
    for (int r = 0; r < 2; r++)
        assert_string_equal(epipe_comm_transport(c[r]), "rdma");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    setenv("EPIPE_FAKEVERBS_DEVICES", "0", 1);
    make_group("auto", c, 2, NULL);
    for (int r = 0; r < 2; r++)
        assert_string_equal(epipe_comm_transport(c[r]), "tcp");
    assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 1, 0, 10, 5)), EPIPE_OK);
    recv_act(c[1], 0, 1, 0, 10, 5);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    unsetenv("EPIPE_FAKEVERBS_DEVICES");
    expect_no_leaks();
}

/* Small and large messages in both directions arrive whole and in order. */
static void test_messages(void **state)
{
    epipe_comm *c[2];
    make_group("rdma", c, 2, NULL);
    assert_string_equal(epipe_comm_transport(c[0]), "rdma");
    assert_int_equal(epipe_rdma_debug_links(c[0]), 1);
    static const size_t sizes[] = {0, 1, 100, 8000, 8100, 20000, 300000, 3 << 20};
    const size_t ns = sizeof sizes / sizeof sizes[0];
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < ns; i++) {
            assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, (uint64_t)round, (uint32_t)i,
                                                               sizes[i], 100 + i)),
                             EPIPE_OK);
            assert_int_equal(epipe_comm_send(c[1], 0, make_act(1, 0, (uint64_t)round, (uint32_t)i,
                                                               sizes[ns - 1 - i], 200 + i)),
                             EPIPE_OK);
        }
        for (size_t i = 0; i < ns; i++) {
            recv_act(c[1], 0, (uint64_t)round, (uint32_t)i, sizes[i], 100 + i);
            recv_act(c[0], 1, (uint64_t)round, (uint32_t)i, sizes[ns - 1 - i], 200 + i);
        }
    }
    /* Many in flight: more than the eager slots and the large slots. */
    for (uint32_t i = 0; i < 300; i++)
        assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 9, i, i % 7 ? 16 : 20000, i)),
                         EPIPE_OK);
    for (uint32_t i = 0; i < 300; i++)
        recv_act(c[1], 0, 9, i, i % 7 ? 16 : 20000, i);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    expect_no_leaks();
}

int main(void)
{
    fakeverbs = getenv("EPIPE_TEST_FAKEVERBS");
    if (!fakeverbs || !*fakeverbs) {
        printf("SKIP: EPIPE_TEST_FAKEVERBS (the test verbs provider) is not set\n");
        return 77;
    }
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_loader_errors, setup_env),
        cmocka_unit_test_setup(test_auto_picks, setup_env),
        cmocka_unit_test_setup(test_messages, setup_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
