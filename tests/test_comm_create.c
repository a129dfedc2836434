/* Tests of epipe_comm_create(): transports by name, inproc groups joined
 * from threads, the one precedence of settings, and per-handle caches. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "comm/comm_impl.h"

static const char *env_vars[] = {"EPIPE_TRANSPORT",
                                 "EPIPE_TIMEOUT_MS",
                                 "EPIPE_SPIN_US",
                                 "EPIPE_BUFFER_CACHE",
                                 "EPIPE_MAX_MESSAGE",
                                 "EPIPE_INIT_TIMEOUT_MS",
                                 "EPIPE_RANK",
                                 "EPIPE_WORLD_SIZE",
                                 "RANK",
                                 "WORLD_SIZE",
                                 "OMPI_COMM_WORLD_RANK",
                                 "OMPI_COMM_WORLD_SIZE",
                                 "PMI_RANK",
                                 "PMI_SIZE",
                                 "SLURM_PROCID",
                                 "SLURM_NTASKS"};

static int clean_env(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof env_vars / sizeof env_vars[0]; i++)
        unsetenv(env_vars[i]);
    return 0;
}

static int64_t param(epipe_comm *c, epipe_comm_param p)
{
    int64_t v = -1;
    assert_int_equal(epipe_comm_get_param(c, p, &v), EPIPE_OK);
    return v;
}

/* A sealed message of `payload` bytes of text from c's rank to dst; the
 * kind needs no tensor, so no codec is involved. */
static epipe_msg *make_msg(epipe_comm *c, unsigned dst, size_t payload, uint32_t mb)
{
    epipe_msg *m = epipe_comm_msg_new(c, payload);
    assert_non_null(m);
    memset(epipe_msg_payload(m), 'x', payload);
    memset(&m->hdr, 0, sizeof m->hdr);
    m->hdr.kind = EPIPE_WIRE_ERROR;
    m->hdr.src_stage = epipe_comm_rank(c);
    m->hdr.dst_stage = dst;
    m->hdr.micro_batch = mb;
    assert_int_equal(epipe_msg_seal(m, payload), EPIPE_OK);
    return m;
}

/* ---- transports by name ------------------------------------------------ */

static void names_pick_the_transport(void **state)
{
    (void)state;
    epipe_comm *c = (epipe_comm *)1;
    /* auto, NULL and "" mean inproc for a group of one */
    const char *autos[] = {"auto", NULL, ""};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(epipe_comm_create(&c, autos[i], 0, 1, NULL, 0, NULL), EPIPE_OK);
        assert_string_equal(epipe_comm_transport(c), "inproc");
        epipe_comm_destroy(c);
    }
    /* tcp of one rank needs no master and opens no socket */
    assert_int_equal(epipe_comm_create(&c, "tcp", 0, 1, NULL, 0, "streams=2"), EPIPE_OK);
    assert_string_equal(epipe_comm_transport(c), "tcp");
    epipe_comm_destroy(c);
    /* EPIPE_TRANSPORT decides when the argument does not */
    setenv("EPIPE_TRANSPORT", "tcp", 1);
    assert_int_equal(epipe_comm_create(&c, NULL, 0, 1, NULL, 0, NULL), EPIPE_OK);
    assert_string_equal(epipe_comm_transport(c), "tcp");
    epipe_comm_destroy(c);
    /* but an explicit name wins over it */
    assert_int_equal(epipe_comm_create(&c, "inproc", 0, 1, NULL, 0, NULL), EPIPE_OK);
    assert_string_equal(epipe_comm_transport(c), "inproc");
    epipe_comm_destroy(c);
    setenv("EPIPE_TRANSPORT", "carrier-pigeon", 1);
    assert_int_equal(epipe_comm_create(&c, "auto", 0, 1, NULL, 0, NULL), EPIPE_EINVAL);
    assert_null(c);
    assert_non_null(strstr(epipe_last_error(), "carrier-pigeon"));
    assert_non_null(strstr(epipe_last_error(), "EPIPE_TRANSPORT"));
    unsetenv("EPIPE_TRANSPORT");
    /* rdma: not built, or (built) no verbs library where this one points */
    setenv("EPIPE_IBVERBS_LIB", "/nonexistent/libibverbs.so.1", 1);
    assert_int_equal(epipe_comm_create(&c, "rdma", 0, 2, "127.0.0.1", 29600, NULL), EPIPE_ENOTSUP);
    assert_true(strstr(epipe_last_error(), "rdma transport is not built") ||
                strstr(epipe_last_error(), "/nonexistent/libibverbs.so.1"));
    unsetenv("EPIPE_IBVERBS_LIB");
    assert_int_equal(epipe_comm_create(&c, "udp", 0, 1, NULL, 0, NULL), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "'udp'"));
    /* bad options name themselves */
    assert_int_equal(epipe_comm_create(&c, "inproc", 0, 1, NULL, 0, "streams=2"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "streams"));
    assert_int_equal(epipe_comm_create(&c, "tcp", 0, 1, NULL, 0, "bogus=1"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "bogus"));
    assert_int_equal(epipe_comm_create(&c, "tcp", 0, 1, NULL, 0, "group=g"), EPIPE_EINVAL);
    assert_int_equal(epipe_comm_create(&c, "inproc", 0, 1, NULL, 0, "timeout_ms=0"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "timeout_ms"));
    assert_int_equal(epipe_comm_create(&c, "inproc", 2, 2, NULL, 0, "group=x"), EPIPE_EINVAL);
    assert_int_equal(epipe_comm_create(&c, "inproc", 0, 2, NULL, 0, NULL), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "group=NAME"));
    assert_int_equal(epipe_comm_create(NULL, "inproc", 0, 1, NULL, 0, NULL), EPIPE_EINVAL);
    assert_int_equal(epipe_comm_create(&c, "inproc", EPIPE_COMM_FROM_ENV, 1, NULL, 0, NULL),
                     EPIPE_EINVAL);
}

static void rendezvous_from_the_environment(void **state)
{
    (void)state;
    epipe_comm *c;
    assert_int_equal(
        epipe_comm_create(&c, NULL, EPIPE_COMM_FROM_ENV, EPIPE_COMM_FROM_ENV, NULL, 0, NULL),
        EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_RANK"));
    setenv("EPIPE_RANK", "0", 1);
    setenv("EPIPE_WORLD_SIZE", "1", 1);
    assert_int_equal(epipe_comm_create(&c, "auto", EPIPE_COMM_FROM_ENV, EPIPE_COMM_FROM_ENV, NULL,
                                       0, "timeout_ms=1234"),
                     EPIPE_OK);
    assert_string_equal(epipe_comm_transport(c), "tcp");
    assert_int_equal(param(c, EPIPE_COMM_TIMEOUT_MS), 1234);
    epipe_comm_destroy(c);
    /* the old function is the same call */
    assert_int_equal(epipe_comm_create_from_env(&c, "timeout_ms=999"), EPIPE_OK);
    assert_int_equal(param(c, EPIPE_COMM_TIMEOUT_MS), 999);
    epipe_comm_destroy(c);
    assert_int_equal(
        epipe_comm_create(&c, "inproc", EPIPE_COMM_FROM_ENV, EPIPE_COMM_FROM_ENV, NULL, 0, NULL),
        EPIPE_EINVAL);
    clean_env(NULL);
}

/* ---- inproc groups joined from threads --------------------------------- */

struct joiner {
    pthread_t th;
    unsigned rank, size;
    const char *options;
    int rc;
    char err[256];
    epipe_comm *c;
};

static void *join_thread(void *arg)
{
    struct joiner *j = arg;
    j->rc = epipe_comm_create(&j->c, "inproc", j->rank, j->size, NULL, 0, j->options);
    snprintf(j->err, sizeof j->err, "%s", epipe_last_error());
    return NULL;
}

static void start_joiners(struct joiner *j, unsigned n, unsigned size, const char *options)
{
    for (unsigned r = 0; r < n; r++) {
        j[r] = (struct joiner){.rank = r, .size = size, .options = options};
        assert_int_equal(pthread_create(&j[r].th, NULL, join_thread, &j[r]), 0);
    }
}

static void join_all(struct joiner *j, unsigned n)
{
    for (unsigned r = 0; r < n; r++)
        pthread_join(j[r].th, NULL);
}

static void ranks_join_a_group_from_threads(void **state)
{
    (void)state;
    enum { P = 4 };
    struct joiner j[P];
    for (int round = 0; round < 2; round++) { /* a complete group frees its name */
        start_joiners(j, P, P, "group=g4,timeout_ms=5000");
        join_all(j, P);
        for (unsigned r = 0; r < P; r++) {
            if (j[r].rc)
                fail_msg("rank %u: %s", r, j[r].err);
            assert_int_equal(epipe_comm_rank(j[r].c), r);
            assert_int_equal(epipe_comm_size(j[r].c), P);
            assert_string_equal(epipe_comm_transport(j[r].c), "inproc");
        }
        /* a ring of messages: every rank reaches its neighbour */
        for (unsigned r = 0; r < P; r++)
            assert_int_equal(
                epipe_comm_send(j[r].c, (r + 1) % P, make_msg(j[r].c, (r + 1) % P, 64, r)),
                EPIPE_OK);
        for (unsigned r = 0; r < P; r++) {
            epipe_msg *m;
            unsigned from = (r + P - 1) % P;
            assert_int_equal(epipe_comm_recv(j[r].c, from, EPIPE_WIRE_ERROR, 0, from, 1000, &m),
                             EPIPE_OK);
            epipe_msg_free(m);
        }
        for (unsigned r = 0; r < P; r++)
            epipe_comm_destroy(j[r].c);
    }
}

static void bad_groups_are_refused(void **state)
{
    (void)state;
    /* a rank alone waits for the rest, then names who is missing */
    struct joiner j[2];
    start_joiners(j, 1, 3, "group=lonely,init_timeout_ms=100");
    join_all(j, 1);
    assert_int_equal(j[0].rc, EPIPE_ETIMEDOUT);
    assert_null(j[0].c);
    assert_non_null(strstr(j[0].err, "'lonely'"));
    assert_non_null(strstr(j[0].err, "1, 2 of 3 did not join"));
    /* a second rank that disagrees on the size, or repeats a rank */
    start_joiners(j, 1, 2, "group=g2,init_timeout_ms=10000");
    while (epipe_inproc_pending("g2") == 0) /* until rank 0 is in */
        sched_yield();
    epipe_comm *c = (epipe_comm *)1;
    assert_int_equal(epipe_comm_create(&c, "inproc", 1, 3, NULL, 0, "group=g2"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "has 2 ranks; rank 1 says 3"));
    assert_null(c);
    assert_int_equal(epipe_comm_create(&c, "inproc", 0, 2, NULL, 0, "group=g2"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "rank 0 joined twice"));
    /* the group still forms with the right rank */
    assert_int_equal(epipe_comm_create(&c, "inproc", 1, 2, NULL, 0, "group=g2"), EPIPE_OK);
    join_all(j, 1);
    assert_int_equal(j[0].rc, EPIPE_OK);
    epipe_comm_destroy(c);
    epipe_comm_destroy(j[0].c);
}

/* ---- one precedence for every setting ---------------------------------- */

static void settings_follow_one_precedence(void **state)
{
    (void)state;
    const char *transports[] = {"inproc", "tcp"};
    for (int t = 0; t < 2; t++) {
        epipe_comm *c;
        /* defaults */
        assert_int_equal(epipe_comm_create(&c, transports[t], 0, 1, NULL, 0, NULL), EPIPE_OK);
        assert_int_equal(param(c, EPIPE_COMM_TIMEOUT_MS), 30000);
        assert_int_equal(param(c, EPIPE_COMM_SPIN_US), 50);
        assert_int_equal(param(c, EPIPE_COMM_BUFFER_CACHE), 512 << 20);
        assert_int_equal(param(c, EPIPE_COMM_MAX_MESSAGE), INT64_C(1) << 32);
        epipe_comm_destroy(c);
        /* environment over defaults */
        setenv("EPIPE_TIMEOUT_MS", "1500", 1);
        setenv("EPIPE_SPIN_US", "7", 1);
        setenv("EPIPE_BUFFER_CACHE", "1048576", 1);
        assert_int_equal(epipe_comm_create(&c, transports[t], 0, 1, NULL, 0, NULL), EPIPE_OK);
        assert_int_equal(param(c, EPIPE_COMM_TIMEOUT_MS), 1500);
        assert_int_equal(param(c, EPIPE_COMM_SPIN_US), 7);
        assert_int_equal(param(c, EPIPE_COMM_BUFFER_CACHE), 1048576);
        epipe_comm_destroy(c);
        /* the options string over the environment */
        assert_int_equal(epipe_comm_create(&c, transports[t], 0, 1, NULL, 0,
                                           "timeout_ms=700,spin_us=0,max_message=8192"),
                         EPIPE_OK);
        assert_int_equal(param(c, EPIPE_COMM_TIMEOUT_MS), 700);
        assert_int_equal(param(c, EPIPE_COMM_SPIN_US), 0);
        assert_int_equal(param(c, EPIPE_COMM_MAX_MESSAGE), 8192);
        assert_int_equal(param(c, EPIPE_COMM_BUFFER_CACHE), 1048576);
        /* set_param over everything */
        assert_int_equal(epipe_comm_set_param(c, EPIPE_COMM_TIMEOUT_MS, 300), EPIPE_OK);
        assert_int_equal(param(c, EPIPE_COMM_TIMEOUT_MS), 300);
        epipe_comm_destroy(c);
        /* a bad variable is named */
        setenv("EPIPE_TIMEOUT_MS", "-4", 1);
        assert_int_equal(epipe_comm_create(&c, transports[t], 0, 1, NULL, 0, NULL), EPIPE_EINVAL);
        assert_non_null(strstr(epipe_last_error(), "EPIPE_TIMEOUT_MS"));
        clean_env(NULL);
    }
    /* epipe_comm_create_inproc takes the environment too */
    epipe_comm *cs[2];
    setenv("EPIPE_TIMEOUT_MS", "2500", 1);
    assert_int_equal(epipe_comm_create_inproc(cs, 2), EPIPE_OK);
    assert_int_equal(param(cs[1], EPIPE_COMM_TIMEOUT_MS), 2500);
    epipe_comm_destroy(cs[0]);
    epipe_comm_destroy(cs[1]);
    clean_env(NULL);
}

/* A stage that has not set EPIPE_STAGE_TIMEOUT_MS follows its
 * communicator's timeout as it is at each receive; one that has, keeps it. */
static void stages_follow_the_comm_timeout(void **state)
{
    (void)state;
    epipe_comm *cs[2];
    assert_int_equal(epipe_comm_create_inproc(cs, 2), EPIPE_OK);
    epipe_stage *st;
    assert_int_equal(epipe_stage_create(&st, cs[1], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_comm_set_param(cs[1], EPIPE_COMM_TIMEOUT_MS, 40), EPIPE_OK);
    const DLTensor *x;
    epipe_op op;
    assert_int_equal(epipe_stage_next_op(st, &op), EPIPE_OK);
    assert_int_equal(epipe_stage_recv_activation(st, op.microbatch, &x), EPIPE_ETIMEDOUT);
    assert_non_null(strstr(epipe_stage_last_error(st), "within 40 ms"));
    epipe_stage_destroy(st);
    assert_int_equal(epipe_stage_create(&st, cs[1], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 30), EPIPE_OK);
    assert_int_equal(epipe_comm_set_param(cs[1], EPIPE_COMM_TIMEOUT_MS, 60000), EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(st, &op), EPIPE_OK);
    assert_int_equal(epipe_stage_recv_activation(st, op.microbatch, &x), EPIPE_ETIMEDOUT);
    assert_non_null(strstr(epipe_stage_last_error(st), "within 30 ms"));
    epipe_stage_destroy(st);
    epipe_comm_destroy(cs[0]);
    epipe_comm_destroy(cs[1]);
}

/* ---- buffer caches belong to their handle ------------------------------ */

static void buffer_caches_are_per_handle(void **state)
{
    (void)state;
    epipe_comm *a[2], *b[2];
    assert_int_equal(epipe_comm_create_inproc(a, 2), EPIPE_OK);
    assert_int_equal(epipe_comm_create_inproc(b, 2), EPIPE_OK);
    enum { BIG = 1 << 20 };
    uint64_t hits, misses, bytes;
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(epipe_comm_send(a[0], 1, make_msg(a[0], 1, BIG, i)), EPIPE_OK);
        epipe_msg *m;
        assert_int_equal(epipe_comm_recv(a[1], 0, EPIPE_WIRE_ERROR, 0, i, 1000, &m), EPIPE_OK);
        epipe_msg_free(m); /* back to a[0]'s cache, freed by a[1]'s side */
    }
    epipe_comm_cache_stats(a[0], &hits, &misses, &bytes);
    assert_int_equal(misses, 1);
    assert_int_equal(hits, 2);
    assert_true(bytes >= BIG);
    /* b finds nothing of a's, though a holds a buffer of the size it needs */
    epipe_msg *m = make_msg(b[0], 1, BIG, 0);
    epipe_comm_cache_stats(b[0], &hits, &misses, &bytes);
    assert_int_equal(hits, 0);
    assert_int_equal(misses, 1);
    epipe_comm_cache_stats(a[0], &hits, NULL, &bytes);
    assert_int_equal(hits, 2);
    assert_true(bytes >= BIG);
    /* a message outlives the handle whose cache it came from */
    epipe_comm_destroy(b[0]);
    epipe_comm_destroy(b[1]);
    epipe_msg_free(m);
    /* a cap of 0 keeps nothing; lowering the cap frees what is held */
    assert_int_equal(epipe_comm_set_param(a[0], EPIPE_COMM_BUFFER_CACHE, 0), EPIPE_OK);
    epipe_comm_cache_stats(a[0], NULL, NULL, &bytes);
    assert_int_equal(bytes, 0);
    epipe_msg_free(make_msg(a[0], 1, BIG, 0));
    epipe_comm_cache_stats(a[0], NULL, NULL, &bytes);
    assert_int_equal(bytes, 0);
    assert_int_equal(epipe_comm_set_param(a[0], EPIPE_COMM_BUFFER_CACHE, -1), EPIPE_EINVAL);
    epipe_comm_destroy(a[0]);
    epipe_comm_destroy(a[1]);
}

/* ---- pinned buffers ------------------------------------------------------ */

/* A stand-in for pinned memory: malloc'd, each buffer remembered so that
 * the test sees which buffers came from it and that each went back. */
enum { PIN_MAX = 64 };
static struct {
    void *live[PIN_MAX];
    int allocs, releases, fail;
} pin;

static int pin_alloc(int device, size_t bytes, void **p)
{
    assert_int_equal(device, 3);
    if (pin.fail || !(*p = malloc(bytes)))
        return EPIPE_ENOMEM;
    for (int i = 0; i < PIN_MAX; i++)
        if (!pin.live[i]) {
            pin.live[i] = *p;
            pin.allocs++;
            return EPIPE_OK;
        }
    free(*p);
    return EPIPE_ENOMEM;
}

static void pin_release(int device, void *p)
{
    assert_int_equal(device, 3); /* the device it was made through */
    for (int i = 0; i < PIN_MAX; i++)
        if (pin.live[i] == p) {
            pin.live[i] = NULL;
            pin.releases++;
            free(p);
            return;
        }
    fail_msg("a buffer the allocator did not make was given to its release");
}

static int pinned(const epipe_msg *m)
{
    for (int i = 0; i < PIN_MAX; i++)
        if (pin.live[i] && pin.live[i] == m->data)
            return 1;
    return 0;
}

/* Sends m from c[0] to c[1] and frees it there (back to c[0]'s cache). */
static void pass(epipe_comm **c, epipe_msg *m, uint32_t mb)
{
    assert_int_equal(epipe_comm_send(c[0], 1, m), EPIPE_OK);
    assert_int_equal(epipe_comm_recv(c[1], 0, EPIPE_WIRE_ERROR, 0, mb, 1000, &m), EPIPE_OK);
    epipe_msg_free(m);
}

static const epipe_msgbuf_allocator pin_allocator = {pin_alloc, pin_release};

static void pinned_buffers_are_cached_and_released(void **state)
{
    (void)state;
    memset(&pin, 0, sizeof pin);
    epipe_comm *c[2];
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    enum { BIG = 1 << 20 };
    uint64_t hits, misses, bytes;
    pass(c, make_msg(c[0], 1, BIG, 0), 0); /* a pageable buffer, cached */
    epipe_comm_cache_stats(c[0], NULL, NULL, &bytes);
    assert_true(bytes >= BIG);
    /* pinning frees the cached pageable buffer: it would not serve again */
    epipe_comm_pin_buffers(c[0], &pin_allocator, 3);
    epipe_comm_pin_buffers(c[0], &pin_allocator, 5); /* idempotent: device 3 stays */
    epipe_comm_cache_stats(c[0], &hits, &misses, &bytes);
    assert_int_equal(bytes, 0);
    epipe_msg *m = make_msg(c[0], 1, BIG, 1);
    assert_true(pinned(m));
    pass(c, m, 1);
    m = make_msg(c[0], 1, BIG, 2); /* the same pinned buffer again */
    assert_true(pinned(m));
    assert_int_equal(pin.allocs, 1);
    pass(c, m, 2);
    epipe_comm_cache_stats(c[0], &hits, NULL, &bytes);
    assert_int_equal(hits, 1);
    assert_true(bytes >= BIG);
    /* small messages, and those the cache could not keep, stay malloc's */
    m = make_msg(c[0], 1, 1000, 3);
    assert_false(pinned(m));
    pass(c, m, 3);
    assert_int_equal(epipe_comm_set_param(c[0], EPIPE_COMM_BUFFER_CACHE, BIG), EPIPE_OK);
    assert_int_equal(pin.releases, 1); /* lowering the cap freed the held one */
    m = make_msg(c[0], 1, BIG, 4);
    assert_false(pinned(m));
    pass(c, m, 4);
    assert_int_equal(epipe_comm_set_param(c[0], EPIPE_COMM_BUFFER_CACHE, 512 << 20), EPIPE_OK);
    /* no pinned memory: a pageable buffer serves, and is not cached; and
     * the failed pinnings hold nothing back (after 32 of them, a leaked
     * reservation each would leave no room for the next) */
    pin.fail = 1;
    for (uint32_t i = 0; i < 32; i++) {
        m = make_msg(c[0], 1, BIG, 100 + i);
        assert_false(pinned(m));
        pass(c, m, 100 + i);
    }
    epipe_comm_cache_stats(c[0], NULL, NULL, &bytes);
    assert_int_equal(bytes, 0);
    pin.fail = 0;
    m = make_msg(c[0], 1, BIG, 5);
    assert_true(pinned(m));
    pass(c, m, 5);
    /* a message outlives its handle; the last buffer goes back to release */
    m = make_msg(c[0], 1, BIG, 6);
    assert_true(pinned(m));
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    assert_int_equal(pin.releases, pin.allocs - 1);
    epipe_msg_free(m);
    assert_int_equal(pin.releases, pin.allocs);
}

/* Sends n messages of `payload` bytes from c[0] before c[1] frees any:
 * how many were pinned. */
static int round_trip(epipe_comm **c, int n, size_t payload, uint32_t mb0)
{
    epipe_msg *m[40];
    int npinned = 0;
    for (int i = 0; i < n; i++) {
        m[i] = make_msg(c[0], 1, payload, mb0 + (uint32_t)i);
        npinned += pinned(m[i]);
        assert_int_equal(epipe_comm_send(c[0], 1, m[i]), EPIPE_OK);
    }
    for (int i = 0; i < n; i++) {
        assert_int_equal(
            epipe_comm_recv(c[1], 0, EPIPE_WIRE_ERROR, 0, mb0 + (uint32_t)i, 1000, &m[i]),
            EPIPE_OK);
    }
    for (int i = 0; i < n; i++)
        epipe_msg_free(m[i]);
    return npinned;
}

/* At most 32 pinned buffers and buffer_cache bytes alive: a message past
 * them gets malloc's, so no pinned buffer is ever pushed out of the cache
 * and pinned afresh, step after step. */
static void pinned_buffers_are_bounded(void **state)
{
    (void)state;
    memset(&pin, 0, sizeof pin);
    epipe_comm *c[2];
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    epipe_comm_pin_buffers(c[0], &pin_allocator, 3);
    enum { MID = 300 << 10, BIG = 1 << 20 };
    uint64_t bytes;
    for (int round = 0; round < 3; round++) {
        assert_int_equal(round_trip(c, 40, MID, 100u * (uint32_t)round), 32);
        assert_int_equal(pin.allocs, 32);
        assert_int_equal(pin.releases, 0);
    }
    epipe_comm_cache_stats(c[0], NULL, NULL, &bytes);
    assert_true(bytes >= 32u * MID);
    /* a cap of 4.5 MiB: four 1 MiB buffers alive, the cached 300 KiB ones
     * freed to make room for them */
    assert_int_equal(epipe_comm_set_param(c[0], EPIPE_COMM_BUFFER_CACHE, (9 << 20) / 2), EPIPE_OK);
    assert_int_equal(pin.releases, 32); /* over the new cap: all freed */
    for (int round = 0; round < 3; round++)
        assert_int_equal(round_trip(c, 6, BIG, 1000u + 100u * (uint32_t)round), 4);
    assert_int_equal(pin.allocs, 36);
    /* other sizes: cached buffers that do not fit make room, only as many
     * as needed (1 + 1.5 + 1.5 MiB fit in 4.5, so one 1 MiB buffer stays) */
    assert_int_equal(round_trip(c, 2, (3 << 20) / 2, 2000), 2);
    assert_int_equal(pin.allocs, 38);
    assert_int_equal(pin.releases, 35);
    epipe_comm_cache_stats(c[0], NULL, NULL, &bytes);
    assert_true(bytes <= (9 << 20) / 2);
    /* freeing cached buffers that could not make room frees none: with two
     * 1.5 MiB buffers out (3 MiB), no 1.5 MiB more fits in 4.5 MiB however
     * many small ones go */
    epipe_msg *out[2] = {make_msg(c[0], 1, (3 << 20) / 2, 3000),
                         make_msg(c[0], 1, (3 << 20) / 2, 3001)};
    assert_true(pinned(out[0]) && pinned(out[1]));
    int released = pin.releases;
    epipe_msg *more = make_msg(c[0], 1, (3 << 20) / 2, 3002);
    assert_false(pinned(more));
    assert_int_equal(pin.releases, released);
    epipe_msg_free(more);
    epipe_msg_free(out[0]);
    epipe_msg_free(out[1]);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    assert_int_equal(pin.releases, pin.allocs);
}

/* ---- device payloads between ranks of one process ------------------------ */

/* A message of `payload` bytes at m->dev (the allocator above stands in
 * for device memory), or NULL where the cache gives none. */
static epipe_msg *make_dev_msg(epipe_comm *c, unsigned dst, size_t payload, uint32_t mb)
{
    epipe_msg *m = epipe_comm_msg_new_device(c, 3, payload);
    if (!m)
        return NULL;
    assert_true(m->dev_cap >= payload);
    memset(&m->hdr, 0, sizeof m->hdr);
    m->hdr.kind = EPIPE_WIRE_ACTIVATION;
    m->hdr.dtype = EPIPE_DTYPE_F32;
    m->hdr.ndim = 1;
    m->hdr.shape[0] = payload / 4;
    m->hdr.codec_id = 1;
    m->hdr.src_stage = epipe_comm_rank(c);
    m->hdr.dst_stage = dst;
    m->hdr.micro_batch = mb;
    assert_int_equal(epipe_msg_seal(m, payload), EPIPE_OK);
    return m;
}

static int fake_send(epipe_comm *c, unsigned peer, epipe_msg *m)
{
    (void)c, (void)peer;
    epipe_msg_free(m);
    return EPIPE_OK;
}

static void fake_destroy(epipe_comm *c)
{
    epipe_comm_free(c);
}

/* A stage on a CUDA device encodes into device memory for a peer that is
 * a thread of its process and decodes there: the message carries its
 * header on the host and the payload at m->dev, which goes back to the
 * sender's cache, bounded as pinned buffers are; no other transport is
 * given one. */
static void device_payloads_stay_in_process(void **state)
{
    (void)state;
    memset(&pin, 0, sizeof pin);
    epipe_comm *c[2];
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    enum { SIZE = 8000, MID = 300 << 10 };
    assert_int_equal(epipe_comm_peer_device(c[0], 1), -1);
    assert_null(epipe_comm_msg_new_device(c[0], 3, SIZE)); /* none set up */
    assert_int_equal(epipe_comm_device_buffers(c[1], &pin_allocator, 3), 1);
    assert_int_equal(epipe_comm_peer_device(c[0], 1), 3);
    assert_int_equal(epipe_comm_peer_device(c[0], 0), -1); /* itself */
    assert_int_equal(epipe_comm_peer_device(c[0], 7), -1);
    assert_int_equal(epipe_comm_device_buffers(c[0], &pin_allocator, 3), 1);
    assert_int_equal(epipe_comm_device_buffers(c[0], &pin_allocator, 5), 1); /* 3 stays */
    assert_int_equal(epipe_comm_peer_device(c[1], 0), 3);
    assert_null(epipe_comm_msg_new_device(c[0], 3, 4000)); /* under 4 KiB: a host message */
    assert_null(epipe_comm_msg_new_device(c[0], 5, SIZE)); /* another device: none */
    epipe_msg *m = make_dev_msg(c[0], 1, SIZE, 0);
    assert_non_null(m);
    void *dev = m->dev;
    assert_int_equal(m->dev_device, 3);
    assert_int_equal(m->len, EPIPE_WIRE_HEADER_SIZE);
    assert_int_equal(epipe_msg_wire_len(m), EPIPE_WIRE_HEADER_SIZE + SIZE);
    assert_int_equal(epipe_comm_send(c[0], 1, m), EPIPE_OK);
    assert_int_equal(epipe_comm_recv(c[1], 0, EPIPE_WIRE_ACTIVATION, 0, 0, 1000, &m), EPIPE_OK);
    assert_ptr_equal(m->dev, dev); /* handed over, not copied */
    assert_int_equal(m->hdr.payload_len, SIZE);
    epipe_msg_free(m);
    m = make_dev_msg(c[0], 1, SIZE, 1); /* the cached buffer again */
    assert_ptr_equal(m->dev, dev);
    assert_int_equal(pin.allocs, 1);
    epipe_msg_free(m);
    /* 32 alive at once at most; past that, none (a host message serves) */
    epipe_msg *out[40];
    int got = 0;
    for (int i = 0; i < 40; i++)
        got += (out[i] = make_dev_msg(c[0], 1, MID, (uint32_t)i)) != NULL;
    assert_int_equal(got, 32);
    for (int i = 0; i < 40; i++)
        epipe_msg_free(out[i]);
    /* no device memory: none either, and nothing held back */
    pin.fail = 1;
    assert_null(epipe_comm_msg_new_device(c[0], 3, 2 * MID));
    pin.fail = 0;
    /* a header that does not fit what it carries fails at the receiver as
     * a corrupt message would */
    m = make_dev_msg(c[0], 1, SIZE, 2);
    m->hdr.payload_len = m->dev_cap + 1;
    assert_int_equal(epipe_wire_encode_header(&m->hdr, m->data, EPIPE_WIRE_HEADER_SIZE), EPIPE_OK);
    assert_int_equal(epipe_comm_send(c[0], 1, m), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_comm_last_error(c[0]), "device message"));
    /* a transport that cannot carry them is given none */
    static const epipe_transport_ops fake = {
        .name = "fake", .send = fake_send, .destroy = fake_destroy};
    epipe_comm_settings st = {.timeout_ms = 1000, .buffer_cache = 1 << 20};
    epipe_comm *f = epipe_comm_alloc(&fake, 0, 2, &st);
    assert_non_null(f);
    assert_int_equal(epipe_comm_device_buffers(f, &pin_allocator, 3), 0);
    assert_int_equal(epipe_comm_peer_device(f, 1), -1);
    assert_null(epipe_comm_msg_new_device(f, 3, SIZE));
    m = make_dev_msg(c[0], 1, SIZE, 4);
    int releases = pin.releases;
    assert_int_equal(epipe_comm_send(f, 1, m), EPIPE_EINTERNAL); /* freed all the same */
    assert_non_null(strstr(epipe_comm_last_error(f), "cannot go to rank 1 over fake"));
    assert_int_equal(pin.releases, releases); /* back to c[0]'s cache */
    epipe_comm_destroy(f);
    /* a message outlives its handle; every buffer goes back to release */
    m = make_dev_msg(c[1], 0, SIZE, 3);
    assert_non_null(m);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    assert_int_equal(pin.releases, pin.allocs - 1);
    epipe_msg_free(m);
    assert_int_equal(pin.releases, pin.allocs);

    /* the device cache takes the handle's cap, and follows its changes */
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_comm_set_param(c[0], EPIPE_COMM_BUFFER_CACHE, 0), EPIPE_OK);
    assert_int_equal(epipe_comm_device_buffers(c[0], &pin_allocator, 3), 1);
    assert_int_equal(epipe_comm_device_buffers(c[1], &pin_allocator, 3), 1);
    assert_null(epipe_comm_msg_new_device(c[0], 3, SIZE));
    assert_int_equal(epipe_comm_set_param(c[0], EPIPE_COMM_BUFFER_CACHE, 1 << 20), EPIPE_OK);
    m = make_dev_msg(c[0], 1, SIZE, 0);
    assert_non_null(m);
    epipe_msg_free(m);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    assert_int_equal(pin.releases, pin.allocs);
}

/* A device payload goes to a peer of this process that decodes on
 * another device too (its stage copies it over), but not to one that
 * decodes on none: the sender asks first (epipe_comm_peer_device), and a
 * message sent anyway is refused, to both. */
static void device_payloads_cross_devices(void **state)
{
    (void)state;
    memset(&pin, 0, sizeof pin);
    epipe_comm *c[3];
    enum { SIZE = 8000 };
    assert_int_equal(epipe_comm_create_inproc(c, 3), EPIPE_OK);
    assert_int_equal(epipe_comm_device_buffers(c[0], &pin_allocator, 3), 1);
    assert_int_equal(epipe_comm_device_buffers(c[1], &pin_allocator, 5), 1);
    assert_int_equal(epipe_comm_peer_device(c[0], 1), 5);
    assert_int_equal(epipe_comm_peer_device(c[0], 2), -1);
    epipe_msg *m = make_dev_msg(c[0], 1, SIZE, 0);
    void *dev = m->dev;
    assert_int_equal(epipe_comm_send(c[0], 1, m), EPIPE_OK);
    assert_int_equal(epipe_comm_recv(c[1], 0, EPIPE_WIRE_ACTIVATION, 0, 0, 1000, &m), EPIPE_OK);
    assert_ptr_equal(m->dev, dev); /* handed over: device 3's, for rank 1 to copy */
    assert_int_equal(m->dev_device, 3);
    epipe_msg_free(m);
    m = make_dev_msg(c[0], 2, SIZE, 0);
    assert_int_equal(epipe_comm_send(c[0], 2, m), EPIPE_EINTERNAL);
    assert_non_null(strstr(epipe_comm_last_error(c[0]), "decodes on no device"));
    for (int i = 0; i < 3; i++)
        epipe_comm_destroy(c[i]);
    assert_int_equal(pin.releases, pin.allocs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(names_pick_the_transport, clean_env),
        cmocka_unit_test_setup(rendezvous_from_the_environment, clean_env),
        cmocka_unit_test_setup(ranks_join_a_group_from_threads, clean_env),
        cmocka_unit_test_setup(bad_groups_are_refused, clean_env),
        cmocka_unit_test_setup(settings_follow_one_precedence, clean_env),
        cmocka_unit_test_setup(stages_follow_the_comm_timeout, clean_env),
        cmocka_unit_test_setup(buffer_caches_are_per_handle, clean_env),
        cmocka_unit_test_setup(pinned_buffers_are_cached_and_released, clean_env),
        cmocka_unit_test_setup(pinned_buffers_are_bounded, clean_env),
        cmocka_unit_test_setup(device_payloads_stay_in_process, clean_env),
        cmocka_unit_test_setup(device_payloads_cross_devices, clean_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
