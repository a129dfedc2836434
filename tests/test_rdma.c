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
#include "../transport/rdma_reg.h"
#include "clock.h"
#include "comm/comm_impl.h"
#include "testutil.h"

static const char *fakeverbs; /* EPIPE_TEST_FAKEVERBS: the provider's path */
static char self_exe[4096];   /* this program, for the peer process */

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
    a->rc = epipe_comm_create(&a->c, a->transport, a->rank, a->size, "127.0.0.1", a->port, a->opts);
    snprintf(a->err, sizeof a->err, "%s", epipe_last_error());
    return NULL;
}

/* Creates `size` ranks; their statuses in rc[], messages in err[][256]. */
static void try_group(const char *transport, epipe_comm **c, unsigned size, const char *opts,
                      int *rc, char (*err)[256])
{
    struct rank_arg a[4];
    unsigned port = test_free_port();
    for (unsigned r = 0; r < size; r++) {
        a[r] = (struct rank_arg){
            .transport = transport, .rank = r, .size = size, .port = port, .opts = opts};
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

static void expect_recv_fails(epipe_comm *c, unsigned peer, int status, const char *needle);

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
    int rc[2];
    char err[2][256];
    try_group("auto", c, 2, NULL, rc, err);
    for (int r = 0; r < 2; r++) {
        assert_int_equal(rc[r], EPIPE_OK);
        assert_string_equal(epipe_comm_transport(c[r]), "tcp");
        assert_string_equal(err[r], ""); /* no stale "no RDMA device" after success */
    }
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
            assert_int_equal(
                epipe_comm_send(c[0], 1,
                                make_act(0, 1, (uint64_t)round, (uint32_t)i, sizes[i], 100 + i)),
                EPIPE_OK);
            assert_int_equal(epipe_comm_send(c[1], 0,
                                             make_act(1, 0, (uint64_t)round, (uint32_t)i,
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

/* Three ranks (pipeline topology: neighbours and rank 0): every joined
 * pair over its own queue pair; a rank's destroy does not cut the others. */
static void test_three_ranks(void **state)
{
    epipe_comm *c[3];
    make_group("rdma", c, 3, NULL);
    assert_int_equal(epipe_rdma_debug_links(c[0]), 2);
    assert_int_equal(epipe_rdma_debug_links(c[1]), 2);
    assert_int_equal(epipe_rdma_debug_links(c[2]), 2);
    for (uint32_t i = 0; i < 20; i++) {
        size_t n = i % 3 ? 50 : 30000;
        assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 1, i, n, i)), EPIPE_OK);
        assert_int_equal(epipe_comm_send(c[1], 2, make_act(1, 2, 1, i, n, 100 + i)), EPIPE_OK);
        assert_int_equal(epipe_comm_send(c[2], 0, make_act(2, 0, 1, i, n, 200 + i)), EPIPE_OK);
    }
    for (uint32_t i = 0; i < 20; i++) {
        size_t n = i % 3 ? 50 : 30000;
        recv_act(c[1], 0, 1, i, n, i);
        recv_act(c[2], 1, 1, i, n, 100 + i);
        recv_act(c[0], 2, 1, i, n, 200 + i);
    }
    epipe_comm_destroy(c[2]);
    assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 2, 0, 8, 7)), EPIPE_OK);
    recv_act(c[1], 0, 2, 0, 8, 7);
    expect_recv_fails(c[1], 2, EPIPE_EPEER, "left");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    expect_no_leaks();
}

/* The registration cache: one region serves every buffer inside it while
 * referenced or idle; freeing a message buffer drops what covers it. */
static void test_registration_cache(void **state)
{
    epipe_verbs v;
    epipe_verbs_dev d;
    assert_int_equal(epipe_verbs_open(&v), EPIPE_OK);
    assert_int_equal(epipe_verbs_probe(&v, &d), EPIPE_OK);
    struct ibv_pd *pd = v.alloc_pd(d.ctx);
    assert_non_null(pd);
    epipe_rdma_regcache rc;
    epipe_rdma_reg_init(&rc, &v, pd, 2);
    epipe_msg *m = epipe_msg_new(300000);
    assert_non_null(m);
    epipe_rdma_reg *a, *b, *x;
    assert_int_equal(epipe_rdma_reg_get(&rc, m->data, m->cap, &a), EPIPE_OK);
    assert_int_equal((uintptr_t)a->mr->addr % 4096, 0); /* page-aligned */
    assert_true((uintptr_t)a->mr->addr <= (uintptr_t)m->data);
    assert_true((uintptr_t)a->mr->addr + a->mr->length >= (uintptr_t)m->data + m->cap);
    /* a part of the same buffer: the same region, a second reference */
    assert_int_equal(epipe_rdma_reg_get(&rc, m->data + 5000, 1000, &b), EPIPE_OK);
    assert_ptr_equal(a, b);
    assert_int_equal(a->refs, 2);
    epipe_rdma_reg_put(&rc, b);
    epipe_rdma_reg_put(&rc, a);
    assert_int_equal(rc.count, 1); /* idle, kept for the next message */
    assert_int_equal(epipe_rdma_reg_get(&rc, m->data, 100, &x), EPIPE_OK);
    assert_ptr_equal(x, a);
    assert_int_equal(rc.hits, 2);
    /* freed while in use: deregistered at the last put, never handed out again */
    long live = epipe_rdma_live_mrs();
    epipe_msg_free(m);
    assert_int_equal(epipe_rdma_live_mrs(), live);
    epipe_msg *m2 = epipe_msg_new(300000);
    assert_int_equal(epipe_rdma_reg_get(&rc, m2->data, m2->cap, &b), EPIPE_OK);
    assert_ptr_not_equal(b, x);
    epipe_rdma_reg_put(&rc, x);
    assert_int_equal(epipe_rdma_live_mrs(), live);
    epipe_rdma_reg_put(&rc, b);
    /* freed while idle: deregistered at once */
    epipe_msg_free(m2);
    assert_int_equal(rc.count, 0);
    assert_int_equal(epipe_rdma_live_mrs(), 0);
    /* at most max_idle idle regions */
    epipe_msg *ms[4];
    for (int i = 0; i < 4; i++) {
        ms[i] = epipe_msg_new(100000);
        assert_int_equal(epipe_rdma_reg_get(&rc, ms[i]->data, ms[i]->cap, &a), EPIPE_OK);
        epipe_rdma_reg_put(&rc, a);
    }
    assert_int_equal(rc.count, 2);
    for (int i = 0; i < 4; i++)
        epipe_msg_free(ms[i]);
    assert_int_equal(rc.count, 0);
    /* a refused registration names its size */
    setenv("EPIPE_FAKEVERBS_FAIL", "reg_mr:1", 1);
    epipe_rdma_reg_fini(&rc);
    v.dealloc_pd(pd);
    epipe_verbs_release(&v, &d);
    assert_int_equal(epipe_verbs_probe(&v, &d), EPIPE_OK); /* re-reads the knob */
    pd = v.alloc_pd(d.ctx);
    epipe_rdma_reg_init(&rc, &v, pd, 2);
    m = epipe_msg_new(5000);
    assert_int_equal(epipe_rdma_reg_get(&rc, m->data, 5000, &a), EPIPE_EIO);
    assert_non_null(strstr(epipe_last_error(), "bytes failed (ibv_reg_mr"));
    epipe_msg_free(m);
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    epipe_rdma_reg_fini(&rc);
    v.dealloc_pd(pd);
    epipe_verbs_release(&v, &d);
    epipe_verbs_close(&v);
    expect_no_leaks();
}

/* ---- protocol attacks ---------------------------------------------------- */

/* A receive on c from peer fails with `status` and a message naming needle. */
static void expect_recv_fails(epipe_comm *c, unsigned peer, int status, const char *needle)
{
    epipe_msg *m = NULL;
    int rc = epipe_comm_recv(c, peer, EPIPE_WIRE_ACTIVATION, 77, 0, 10000, &m);
    const char *e = epipe_comm_last_error(c);
    if (rc != status || (needle && !strstr(e, needle)))
        print_error("rank %u: got %d (%s), want %d naming '%s'\n", epipe_comm_rank(c), rc, e,
                    status, needle ? needle : "");
    assert_int_equal(rc, status);
    if (needle)
        assert_non_null(strstr(e, needle));
}

static void attack(int what, unsigned bad, int send_large, const char *needle)
{
    epipe_comm *c[2];
    make_group("rdma", c, 2, "timeout_ms=10000");
    unsigned victim = 1 - bad;
    assert_int_equal(epipe_rdma_debug_inject(c[bad], victim, what), EPIPE_OK);
    if (send_large) /* the victim sends; the bad rank answers with a short CTS */
        assert_int_equal(epipe_comm_send(c[victim], bad, make_act(victim, bad, 1, 0, 50000, 1)),
                         EPIPE_OK);
    expect_recv_fails(c[victim], bad, EPIPE_EPROTO, needle);
    /* The bad rank hears that the link was torn down. */
    expect_recv_fails(c[bad], victim, EPIPE_EPEER, "tore down its rdma link");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    expect_no_leaks();
}

static void test_attack_short_cts(void **state)
{
    attack(EPIPE_RDMA_INJECT_SHORT_CTS, 1, 1,
           "clear-to-send names a buffer of 100104 bytes for a 200208-byte message");
}

static void test_attack_unknown_imm(void **state)
{
    attack(EPIPE_RDMA_INJECT_UNKNOWN_IMM, 0, 0, "sequence 11259375, which it never announced");
}

static void test_attack_unlent_slot(void **state)
{
    attack(EPIPE_RDMA_INJECT_UNLENT_SLOT, 0, 0, "eager slot 35, which this rank did not lend");
}

static void test_attack_duplicate_rts(void **state)
{
    epipe_comm *c[2];
    make_group("rdma", c, 2, "timeout_ms=10000");
    assert_int_equal(epipe_rdma_debug_inject(c[0], 1, EPIPE_RDMA_INJECT_DUP_RTS), EPIPE_OK);
    assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 1, 0, 50000, 1)), EPIPE_OK);
    expect_recv_fails(c[1], 0, EPIPE_EPROTO, "a second request to send message sequence 0");
    expect_recv_fails(c[0], 1, EPIPE_EPEER, "tore down its rdma link");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    expect_no_leaks();
}

static void test_attack_bogus_completion(void **state)
{
    epipe_comm *c[2];
    make_group("rdma", c, 2, "timeout_ms=10000");
    assert_int_equal(epipe_rdma_debug_inject(c[0], 1, EPIPE_RDMA_INJECT_BOGUS_WC), EPIPE_OK);
    expect_recv_fails(c[0], 1, EPIPE_EPROTO, "which this rank never posted");
    expect_recv_fails(c[1], 0, EPIPE_EPEER, "tore down its rdma link");
    assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 1, 0, 10, 1)), EPIPE_EPEER);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    expect_no_leaks();
}

/* Malformed queue-pair information in the rendezvous: EPIPE_EPROTO naming
 * the field, at once, on the rank that reads it. */
static void test_bad_qp_info(void **state)
{
    static const char *field[] = {"bad magic", "bad path mtu", "bad queue pair number",
                                  "bad slot or ring geometry", "bad reason text"};
    for (int f = 0; f < 5; f++) {
        epipe_rdma_debug_corrupt_info(f);
        epipe_comm *c[2];
        int rc[2];
        char err[2][256];
        try_group("rdma", c, 2, "init_timeout_ms=10000", rc, err);
        for (int r = 0; r < 2; r++) {
            assert_null(c[r]);
            if (rc[r] != EPIPE_EPROTO || !strstr(err[r], field[f]))
                print_error("field %d rank %d: %d %s\n", f, r, rc[r], err[r]);
            assert_int_equal(rc[r], EPIPE_EPROTO);
            assert_non_null(strstr(err[r], "malformed queue-pair information"));
            assert_non_null(strstr(err[r], field[f]));
        }
        expect_no_leaks();
    }
    epipe_rdma_debug_corrupt_info(-1);
}

/* ---- faults ------------------------------------------------------------ */

/* The n-th post_send of this process fails and its QP goes to error: both
 * ranks learn, the one that saw it with the verbs status. */
static void test_fault_qp_error(void **state)
{
    epipe_comm *c[2];
    setenv("EPIPE_FAKEVERBS_FAIL", "post_send:200", 1); /* after the 2x32 lent slots */
    make_group("rdma", c, 2, "timeout_ms=10000");
    int rc = EPIPE_OK;
    for (uint32_t i = 0; i < 400 && rc == EPIPE_OK; i++)
        rc = epipe_comm_send(c[i % 2], 1 - i % 2, make_act(i % 2, 1 - i % 2, 2, i, 20, i));
    int seen = 0;
    for (int r = 0; r < 2; r++) {
        epipe_msg *m = NULL;
        int got;
        uint32_t i = (uint32_t)(1 - r);
        while ((got = epipe_comm_recv(c[r], 1 - r, EPIPE_WIRE_ACTIVATION, 2, i, 10000, &m)) ==
               EPIPE_OK) {
            epipe_msg_free(m);
            i += 2;
        }
        assert_int_equal(got, EPIPE_EPEER);
        const char *e = epipe_comm_last_error(c[r]);
        seen += strstr(e, "transport retry counter exceeded") != NULL ||
                strstr(e, "Work Request Flushed Error") != NULL;
    }
    assert_true(seen >= 1); /* the verbs status is named */
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    expect_no_leaks();
}

/* A registration that fails for a large message: EPIPE_EPEER naming it. */
static void test_fault_registration(void **state)
{
    epipe_comm *c[2];
    setenv("EPIPE_FAKEVERBS_FAIL", "reg_mr:7", 1); /* 3 per rank at setup, then this */
    make_group("rdma", c, 2, "timeout_ms=10000");
    assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 1, 0, 50000, 1)), EPIPE_OK);
    expect_recv_fails(c[0], 1, EPIPE_EPEER, "registering");
    expect_recv_fails(c[1], 0, EPIPE_EPEER, "registering");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    expect_no_leaks();
}

/* Queue-pair setup failing on one rank fails both creations, promptly. */
static void test_fault_setup(void **state)
{
    static const char *fails[] = {"create_qp:1", "modify_qp:3", "reg_mr:2"};
    for (int k = 0; k < 3; k++) {
        setenv("EPIPE_FAKEVERBS_FAIL", fails[k], 1);
        epipe_comm *c[2];
        int rc[2];
        try_group("rdma", c, 2, "init_timeout_ms=10000", rc, NULL);
        for (int r = 0; r < 2; r++) {
            assert_int_not_equal(rc[r], EPIPE_OK);
            assert_null(c[r]);
        }
        expect_no_leaks();
    }
    unsetenv("EPIPE_FAKEVERBS_FAIL");
}

/* ---- every verbs call fails in turn -------------------------------------- */

/* The verbs calls the test provider can fail (EPIPE_FAKEVERBS_FAIL). */
static const char *const verbs_ops[4] = {"reg_mr", "create_qp", "modify_qp", "post_send"};

static long provider_calls(const char *op)
{
    void *h = dlopen(fakeverbs, RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        return -1;
    long (*f)(const char *) = (long (*)(const char *))dlsym(h, "fakeverbs_calls");
    long n = f ? f(op) : -1;
    dlclose(h);
    return n;
}

/* The sweep's workload: a group of two, then 6 messages each way of three
 * sizes (eager, and the rendezvous path's one and several chunks), each
 * received and checked. 0 when all arrived; 1 when the group or a
 * receive failed as a fault may make it fail: every failure a status with
 * a message, every message that arrived whole, and, once a rank has seen
 * its link fail, every later receive on it failing too. -1 (why filled)
 * otherwise. */
static int verbs_workload(char *why, size_t cap, long *calls)
{
    epipe_comm *c[2];
    int rc[2];
    char err[2][256];
    try_group("rdma", c, 2, "timeout_ms=4000,init_timeout_ms=8000", rc, err);
    if (rc[0] || rc[1]) {
        for (int r = 0; r < 2; r++) {
            if (rc[r] && !err[r][0]) {
                snprintf(why, cap, "rank %d's creation failed (%s) without a message", r,
                         epipe_status_name(rc[r]));
                return -1;
            }
            epipe_comm_destroy(c[r]);
        }
        return 1;
    }
    static const size_t sizes[3] = {8, 40000, 300000};
    enum { K = 6 };
    int failed[2] = {0, 0}, bad = 0;
    for (uint32_t i = 0; i < K; i++)
        for (unsigned r = 0; r < 2; r++) {
            epipe_msg *m = make_act(r, 1 - r, 3, i, sizes[i % 3], 100 * r + i);
            if (epipe_comm_send(c[r], 1 - r, m) != EPIPE_OK)
                failed[r] = 1; /* the send took the message and reported the link down */
        }
    for (unsigned r = 0; r < 2 && !bad; r++)
        for (uint32_t i = 0; i < K && !bad; i++) {
            epipe_msg *m = NULL;
            int got = epipe_comm_recv(c[r], 1 - r, EPIPE_WIRE_ACTIVATION, 3, i, 6000, &m);
            if (got == EPIPE_OK && failed[r] == 2) {
                snprintf(why, cap, "rank %u received micro-batch %u after its link failed", r, i);
                bad = 1;
            } else if (got == EPIPE_OK) {
                size_t n = sizes[i % 3];
                float *want = malloc(n * sizeof *want);
                test_fill(want, n, DIST_NORMAL, 100 * (1 - r) + i);
                if (m->hdr.shape[0] != n ||
                    memcmp(m->data + m->hdr.header_len + 16, want, n * sizeof *want)) {
                    snprintf(why, cap, "rank %u: micro-batch %u arrived damaged", r, i);
                    bad = 1;
                }
                free(want);
                epipe_msg_free(m);
            } else if (got != EPIPE_EPEER || !epipe_comm_last_error(c[r])[0]) {
                snprintf(why, cap, "rank %u: micro-batch %u: %s '%s', wanted EPIPE_EPEER", r, i,
                         epipe_status_name(got), epipe_comm_last_error(c[r]));
                bad = 1;
            } else {
                failed[r] = 2;
            }
        }
    for (int k = 0; calls && k < 4; k++) /* before the provider is unloaded */
        calls[k] = provider_calls(verbs_ops[k]);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    return bad ? -1 : failed[0] || failed[1];
}

/* Every registration, queue-pair creation and transition, and (a spread
 * of) the sends of a small workload fail in turn: each run either
 * completes or fails as verbs_workload allows, promptly, and leaves
 * nothing registered or open. */
static void test_every_verbs_call_fails_in_turn(void **state)
{
    char why[256] = "";
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    long calls[4];
    if (verbs_workload(why, sizeof why, calls) != 0)
        fail_msg("the workload without faults: %s", why[0] ? why : "a failure");
    expect_no_leaks();
    int runs = 0, failures = 0;
    double slowest = 0;
    for (int k = 0; k < 4; k++) {
        if (calls[k] <= 0)
            fail_msg("the provider counted %ld calls of %s", calls[k], verbs_ops[k]);
        /* every call of the rare ops; 24 sends spread over the run */
        long step = calls[k] > 24 ? calls[k] / 24 : 1;
        for (long n = 1; n <= calls[k]; n += step) {
            char spec[64];
            snprintf(spec, sizeof spec, "%s:%ld", verbs_ops[k], n);
            setenv("EPIPE_FAKEVERBS_FAIL", spec, 1);
            int64_t t0 = epipe_now_ms();
            int out = verbs_workload(why, sizeof why, NULL);
            double took = (double)(epipe_now_ms() - t0) / 1000;
            if (out < 0)
                fail_msg("%s: %s", spec, why);
            failures += out;
            runs++;
            slowest = took > slowest ? took : slowest;
            if (took > 3.0)
                fail_msg("%s: the run took %.1f s: a failure waited for a timeout", spec, took);
            expect_no_leaks();
        }
    }
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    print_message("%d runs, each with one verbs call failing (%ld registrations, %ld queue-pair "
                  "creations, %ld transitions, %ld sends in a run): %d failed cleanly, the rest "
                  "completed; slowest %.2f s\n",
                  runs, calls[0], calls[1], calls[2], calls[3], failures, slowest);
}

/* Connect, exchange, fault, tear down, many times: nothing leaks. */
static void test_leak_cycles(void **state)
{
    const char *v = getenv("EPIPE_TEST_RDMA_CYCLES");
    int cycles = v && *v ? atoi(v) : 40;
    for (int k = 0; k < cycles; k++) {
        epipe_comm *c[2];
        make_group("rdma", c, 2, "timeout_ms=10000");
        assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 1, 0, 8, 1)), EPIPE_OK);
        assert_int_equal(epipe_comm_send(c[1], 0, make_act(1, 0, 1, 0, 40000, 2)), EPIPE_OK);
        recv_act(c[1], 0, 1, 0, 8, 1);
        switch (k % 4) {
        case 0: break; /* clean */
        case 1:        /* a fault while a large message waits for its CTS */
            assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 2, 0, 90000, 3)), EPIPE_OK);
            epipe_rdma_debug_inject(c[0], 1, EPIPE_RDMA_INJECT_BOGUS_WC);
            break;
        case 2: epipe_rdma_debug_inject(c[1], 0, EPIPE_RDMA_INJECT_UNKNOWN_IMM); break;
        case 3: /* leave without receiving: the message is dropped with the handle */
            assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 3, 0, 70000, 4)), EPIPE_OK);
            break;
        }
        epipe_comm_destroy(c[(unsigned)k % 2]);
        epipe_comm_destroy(c[1 - (unsigned)k % 2]);
        expect_no_leaks();
    }
}

/* ---- a peer process killed mid-transfer ------------------------------- */

/* The peer role (test_rdma --peer PORT DELAY_MS): rank 1 sends a 64 MiB
 * message to rank 0 and kills itself DELAY_MS later, mid-transfer. */
static int peer_main(unsigned port, int delay_ms)
{
    epipe_comm *c = NULL;
    if (epipe_comm_create(&c, "rdma", 1, 2, "127.0.0.1", port, "timeout_ms=5000")) {
        fprintf(stderr, "peer: %s\n", epipe_last_error());
        return 1;
    }
    float *x = calloc((size_t)16 << 20, sizeof *x);
    epipe_msg *m = x ? test_activation_msg(1, 0, 1, 0, x, (size_t)16 << 20) : NULL;
    if (!m || epipe_comm_send(c, 0, m))
        return 1;
    if (delay_ms)
        usleep((useconds_t)delay_ms * 1000);
    raise(SIGKILL);
    return 1;
}

/* The peer role (test_rdma --auto-peer PORT RANK SIZE PARTNER DEVICE):
 * rank RANK of SIZE under auto, with a device or without one (DEVICE 1 or
 * 0), whose transport must then be rdma or tcp; it echoes one message from
 * rank PARTNER back to it. */
static int auto_peer_main(unsigned port, unsigned rank, unsigned size, unsigned partner, int device)
{
    if (!device)
        setenv("EPIPE_FAKEVERBS_DEVICES", "0", 1);
    epipe_comm *c = NULL;
    if (epipe_comm_create(&c, "auto", rank, size, "127.0.0.1", port, "timeout_ms=10000")) {
        fprintf(stderr, "rank %u: %s\n", rank, epipe_last_error());
        return 1;
    }
    epipe_msg *m = NULL;
    int rc = strcmp(epipe_comm_transport(c), device ? "rdma" : "tcp") ? 2 : 0;
    if (!rc)
        rc = epipe_comm_recv(c, partner, EPIPE_WIRE_ACTIVATION, 1, 0, 10000, &m);
    if (!rc) {
        m->hdr.src_stage = rank, m->hdr.dst_stage = partner;
        epipe_wire_encode_header(&m->hdr, m->data, EPIPE_WIRE_HEADER_SIZE);
        rc = epipe_comm_send(c, partner, m);
    }
    if (rc)
        fprintf(stderr, "rank %u: %d %s\n", rank, rc, epipe_comm_last_error(c));
    epipe_comm_destroy(c);
    return rc ? 1 : 0;
}

/* Starts that role in a process of its own. */
static pid_t spawn_auto_peer(unsigned port, unsigned rank, unsigned size, unsigned partner,
                             int device)
{
    char args[5][16];
    snprintf(args[0], sizeof args[0], "%u", port);
    snprintf(args[1], sizeof args[1], "%u", rank);
    snprintf(args[2], sizeof args[2], "%u", size);
    snprintf(args[3], sizeof args[3], "%u", partner);
    snprintf(args[4], sizeof args[4], "%d", device);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl(self_exe, "test_rdma", "--auto-peer", args[0], args[1], args[2], args[3], args[4],
              (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* This rank's end of an "auto" group on the local master port, which
 * must pick `transport`. */
static epipe_comm *auto_comm(unsigned rank, unsigned size, unsigned port, const char *transport)
{
    epipe_comm *c = NULL;
    int rc = epipe_comm_create(&c, "auto", rank, size, "127.0.0.1", port, "timeout_ms=10000");
    if (rc)
        print_error("%s\n", epipe_last_error());
    assert_int_equal(rc, EPIPE_OK);
    assert_string_equal(epipe_comm_transport(c), transport);
    return c;
}

static void expect_exit_0(pid_t pid)
{
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* auto over three ranks where the first has no device: rank 1's link to
 * rank 2 runs verbs, its link to rank 0 tcp, and its verbs links are
 * renumbered when the tcp one leaves the array. Messages cross both ways on
 * both links (the receives posted before the renumbering used to carry the
 * old number, and the first completion was a protocol error). */
static void test_auto_three(void **state)
{
    (void)state;
    unsigned port = test_free_port();
    pid_t pid[2] = {spawn_auto_peer(port, 0, 3, 1, 0), spawn_auto_peer(port, 2, 3, 1, 1)};
    epipe_comm *c = auto_comm(1, 3, port, "rdma");
    for (unsigned peer = 0; peer < 3; peer += 2) {
        assert_int_equal(epipe_comm_send(c, peer, make_act(1, peer, 1, 0, 3000, 20 + peer)),
                         EPIPE_OK);
        recv_act(c, peer, 1, 0, 3000, 20 + peer);
    }
    for (int i = 0; i < 2; i++)
        expect_exit_0(pid[i]);
    epipe_comm_destroy(c);
    expect_no_leaks();
}

/* auto between a rank with a device and one without: that link is tcp. */
static void test_auto_mixed(void **state)
{
    unsigned port = test_free_port();
    pid_t pid = spawn_auto_peer(port, 1, 2, 0, 0);
    epipe_comm *c = auto_comm(0, 2, port, "tcp");
    assert_int_equal(epipe_comm_send(c, 1, make_act(0, 1, 1, 0, 3000, 9)), EPIPE_OK);
    recv_act(c, 1, 1, 0, 3000, 9);
    expect_exit_0(pid);
    epipe_comm_destroy(c);
    expect_no_leaks();
}

static void killed_peer(int delay_ms)
{
    unsigned port = test_free_port();
    char ports[16], delay[16];
    snprintf(ports, sizeof ports, "%u", port);
    snprintf(delay, sizeof delay, "%d", delay_ms);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl(self_exe, "test_rdma", "--peer", ports, delay, (char *)NULL);
        _exit(127);
    }
    epipe_comm *c = NULL;
    int rc = epipe_comm_create(&c, "rdma", 0, 2, "127.0.0.1", port, "timeout_ms=5000");
    if (rc)
        print_error("%s\n", epipe_last_error());
    assert_int_equal(rc, EPIPE_OK);
    epipe_msg *m = NULL;
    rc = epipe_comm_recv(c, 1, EPIPE_WIRE_ACTIVATION, 1, 0, 20000, &m);
    if (rc == EPIPE_OK) { /* it was whole before the kill: the next one never comes */
        epipe_msg_free(m);
        rc = epipe_comm_recv(c, 1, EPIPE_WIRE_ACTIVATION, 2, 0, 20000, &m);
    }
    const char *e = epipe_comm_last_error(c);
    if (rc != EPIPE_EPEER && rc != EPIPE_ETIMEDOUT)
        print_error("got %d: %s\n", rc, e);
    assert_true(rc == EPIPE_EPEER || rc == EPIPE_ETIMEDOUT);
    assert_non_null(strstr(e, "rank 1"));
    int st;
    waitpid(pid, &st, 0);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    epipe_comm_destroy(c);
    expect_no_leaks();
}

static void test_killed_peer(void **state)
{
    killed_peer(0);
    killed_peer(20);
}

/* A send over a link the peer closed (its goodbye over verbs, which an
 * aborting peer sends too) or that failed waits for the control plane's
 * verdict, which can come after it: the error then names the peer's
 * reason, the rank where a failure began, not only the link. Without a
 * verdict within the wait, the link's own message. */
struct verdict {
    epipe_comm *c;
    unsigned peer;
};

static void *late_verdict(void *p)
{
    struct verdict *v = p;
    usleep(100 * 1000);
    epipe_comm_peer_failed(v->c, v->peer, EPIPE_EPEER,
                           "rank 1 was aborted after rank 3 failed: killed");
    return NULL;
}

static void test_send_waits_for_the_verdict(void **state)
{
    (void)state;
    epipe_comm *c[2];
    make_group("rdma", c, 2, "timeout_ms=10000");
    assert_int_equal(epipe_comm_send_gone(c[0], 1, 50, "rank 0: the rdma link to rank 1 is down"),
                     EPIPE_EPEER);
    assert_string_equal(epipe_comm_last_error(c[0]), "rank 0: the rdma link to rank 1 is down");
    struct verdict v = {c[0], 1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, late_verdict, &v), 0);
    int rc = epipe_comm_send_gone(c[0], 1, 5000, "rank 0: the rdma link to rank 1 is down");
    pthread_join(th, NULL);
    assert_int_equal(rc, EPIPE_EPEER);
    const char *e = epipe_comm_last_error(c[0]);
    if (!strstr(e, "rank 3 failed"))
        print_error("'%s' does not name rank 3\n", e);
    assert_non_null(strstr(e, "cannot send to rank 1: it failed: rank 1 was aborted after rank 3"));
    epipe_comm_abort(c[0]);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    expect_no_leaks();
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "--peer"))
        return peer_main((unsigned)atoi(argv[2]), atoi(argv[3]));
    if (argc == 7 && !strcmp(argv[1], "--auto-peer"))
        return auto_peer_main((unsigned)atoi(argv[2]), (unsigned)atoi(argv[3]),
                              (unsigned)atoi(argv[4]), (unsigned)atoi(argv[5]), atoi(argv[6]));
    fakeverbs = getenv("EPIPE_TEST_FAKEVERBS");
    if (!fakeverbs || !*fakeverbs) {
        printf("SKIP: EPIPE_TEST_FAKEVERBS (the test verbs provider) is not set\n");
        return 77;
    }
    signal(SIGPIPE, SIG_IGN);
    ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
    if (n <= 0)
        snprintf(self_exe, sizeof self_exe, "%s", argv[0]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_loader_errors, setup_env),
        cmocka_unit_test_setup(test_auto_picks, setup_env),
        cmocka_unit_test_setup(test_messages, setup_env),
        cmocka_unit_test_setup(test_three_ranks, setup_env),
        cmocka_unit_test_setup(test_registration_cache, setup_env),
        cmocka_unit_test_setup(test_attack_short_cts, setup_env),
        cmocka_unit_test_setup(test_attack_unknown_imm, setup_env),
        cmocka_unit_test_setup(test_attack_unlent_slot, setup_env),
        cmocka_unit_test_setup(test_attack_duplicate_rts, setup_env),
        cmocka_unit_test_setup(test_attack_bogus_completion, setup_env),
        cmocka_unit_test_setup(test_bad_qp_info, setup_env),
        cmocka_unit_test_setup(test_fault_qp_error, setup_env),
        cmocka_unit_test_setup(test_fault_registration, setup_env),
        cmocka_unit_test_setup(test_fault_setup, setup_env),
        cmocka_unit_test_setup(test_every_verbs_call_fails_in_turn, setup_env),
        cmocka_unit_test_setup(test_auto_mixed, setup_env),
        cmocka_unit_test_setup(test_auto_three, setup_env),
        cmocka_unit_test_setup(test_killed_peer, setup_env),
        cmocka_unit_test_setup(test_send_waits_for_the_verdict, setup_env),
        cmocka_unit_test_setup(test_leak_cycles, setup_env),
    };
    const char *only = getenv("EPIPE_TEST_RDMA_FILTER"); /* e.g. test_leak_cycles */
    if (only && *only)
        cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
