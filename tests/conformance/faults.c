/* Conformance tests of faults: a peer that aborts, is killed (mid-transfer
 * too), stops answering, or sends corrupt bytes. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "conform.h"

#define ACT EPIPE_WIRE_ACTIVATION
#define GRAD EPIPE_WIRE_GRADIENT
#define LONG_MS 20000

/* rc is a dead-peer status: EPIPE_EPEER or EPIPE_ETIMEDOUT. */
#define CHECK_DEAD(c, rc)                                                                          \
    do {                                                                                           \
        int r_ = (rc);                                                                             \
        if (r_ != EPIPE_EPEER && r_ != EPIPE_ETIMEDOUT) {                                          \
            fprintf(stderr, "FAIL %s:%d: %s is %s, want EPIPE_EPEER or EPIPE_ETIMEDOUT (%s)\n",    \
                    __FILE__, __LINE__, #rc, epipe_status_name(r_), epipe_comm_last_error(c));     \
            return CONF_FAIL;                                                                      \
        }                                                                                          \
    } while (0)

/* ---- peer abort --------------------------------------------------------- */

static void *abort_later(void *p)
{
    usleep(300000);
    epipe_comm_abort(p); /* from another thread, while the owner waits */
    return NULL;
}

/* arg: non-NULL to make rank 2's receive busy-wait (EPIPE_COMM_SPIN_US)
 * through the moment of the abort */
static int abort_rank(epipe_comm *c, unsigned rank, unsigned size, void *arg)
{
    (void)size;
    epipe_msg *m;
    double t0 = conf_now();
    if (rank == 2) {
        /* A receive blocked in this rank wakes when another thread aborts,
         * asleep or spinning: a spin that ends without an arrival must not
         * then sleep through the abort until its timeout. */
        if (arg)
            CHECK(epipe_comm_set_param(c, EPIPE_COMM_SPIN_US, 1000000) == EPIPE_OK);
        pthread_t th;
        CHECK(pthread_create(&th, NULL, abort_later, c) == 0);
        CHECK_RC(c, epipe_comm_recv(c, 1, ACT, 1, 0, LONG_MS, &m), EPIPE_EPEER);
        pthread_join(th, NULL);
        /* spinning: the others stay until 2 s, so a receive that slept
         * through the abort would only wake when they leave */
        CHECK_WITHIN(conf_now() - t0, arg ? 1.4 : 3.0);
        CHECK_MSG(c, "rank 2 was aborted");
        CHECK_RC(c, epipe_comm_send(c, 1, conf_msg(GRAD, 2, 1, 1, 0, 4, 1)), EPIPE_EPEER);
        CHECK_MSG(c, "aborted");
        /* let the failure reach the others before this rank leaves */
        usleep((useconds_t)conf_ms(1000) * 1000);
    } else {
        /* Its neighbour and a rank further away both hear of it. */
        CHECK_RC(c, epipe_comm_recv(c, 2, GRAD, 1, 0, LONG_MS, &m), EPIPE_EPEER);
        CHECK_WITHIN(conf_now() - t0, 5.0);
        CHECK_MSG(c, "rank 2 failed");
        if (rank == 1 && conf_is("tcp"))
            CHECK_MSG(c, "aborted");
        CHECK_RC(c, epipe_comm_send(c, 2, conf_msg(ACT, rank, 2, 1, 0, 4, 1)), EPIPE_EPEER);
        CHECK_MSG(c, "rank 2");
        if (arg) { /* no news from here for rank 2 before 2 s */
            double left = (double)conf_ms(2000) / 1e3 - (conf_now() - t0);
            if (left > 0)
                usleep((useconds_t)(left * 1e6));
        }
    }
    epipe_comm_destroy(c);
    return CONF_PASS;
}

static int test_abort(void)
{
    return conf_run(3, "timeout_ms=10000", abort_rank, NULL, 0, 60);
}

static int test_abort_spinning(void)
{
    static int spin = 1;
    return conf_run(3, "timeout_ms=10000", abort_rank, &spin, 0, 60);
}

/* ---- a peer process killed (kill -9), during a transfer ---------------- */

/* Rank `victim` tells rank 0 its pid (in the payload of a 2-float
 * activation of step 0), then waits to be killed or stopped. */
static int send_pid_and_wait(epipe_comm *c, unsigned victim)
{
    epipe_msg *m = conf_msg(ACT, victim, 0, 0, 0, 2, 0);
    int32_t pid = (int32_t)getpid();
    memcpy(epipe_msg_payload(m) + 16, &pid, sizeof pid);
    CHECK(epipe_msg_seal(m, m->hdr.payload_len) == EPIPE_OK);
    CHECK_RC(c, epipe_comm_send(c, 0, m), EPIPE_OK);
    return CONF_PASS;
}

static int recv_pid(epipe_comm *c, unsigned victim, pid_t *pid)
{
    epipe_msg *m;
    CHECK_RC(c, epipe_comm_recv(c, victim, ACT, 0, 0, LONG_MS, &m), EPIPE_OK);
    int32_t p;
    memcpy(&p, m->data + m->hdr.header_len + 16, sizeof p);
    epipe_msg_free(m);
    CHECK(p > 1);
    *pid = (pid_t)p;
    return CONF_PASS;
}

static int dead_rank(epipe_comm *c, unsigned rank, unsigned size, void *arg)
{
    (void)size, (void)arg;
    const size_t big = (size_t)4 << 20; /* 16 MiB */
    epipe_msg *m;
    if (rank == 1) {
        CHECK(send_pid_and_wait(c, 1) == CONF_PASS);
        CHECK_RC(c, epipe_comm_send(c, 0, conf_msg(ACT, 1, 0, 2, 0, big, 9)), EPIPE_OK);
        for (;;)
            pause(); /* killed by rank 0, as the transfer runs */
    }
    if (rank == 0) {
        pid_t pid;
        CHECK(recv_pid(c, 1, &pid) == CONF_PASS);
        kill(pid, SIGKILL);
        double t0 = conf_now();
        /* The message it was sending: whole, or not at all. */
        int rc = epipe_comm_recv(c, 1, ACT, 2, 0, LONG_MS, &m);
        if (rc == EPIPE_OK) {
            int same = conf_msg_is(m, big, 9);
            epipe_msg_free(m);
            CHECK(same);
        } else {
            CHECK_RC(c, rc, EPIPE_EPEER);
        }
        CHECK_RC(c, epipe_comm_recv(c, 1, GRAD, 3, 0, LONG_MS, &m), EPIPE_EPEER);
        CHECK_WITHIN(conf_now() - t0, 3.0); /* at once, not after the timeout */
        CHECK_MSG(c, "rank 1");
        if (conf_is("tcp"))
            CHECK_MSG(c, "without a goodbye");
        CHECK_RC(c, epipe_comm_send(c, 1, conf_msg(ACT, 0, 1, 4, 0, 4, 1)), EPIPE_EPEER);
    } else {
        /* Rank 2, the victim's other neighbour, hears of it too. */
        CHECK_DEAD(c, epipe_comm_recv(c, 1, GRAD, 3, 0, LONG_MS, &m));
        CHECK_MSG(c, "rank 1");
    }
    epipe_comm_destroy(c);
    return CONF_PASS;
}

static int test_dead_peer(void)
{
    return conf_run(3, "timeout_ms=10000", dead_rank, NULL, 1u << 1, 60);
}

/* ---- a peer that stops (SIGSTOP): found within the timeout -------------- */

static int stopped_rank(epipe_comm *c, unsigned rank, unsigned size, void *arg)
{
    (void)size, (void)arg;
    if (rank == 1) {
        CHECK(send_pid_and_wait(c, 1) == CONF_PASS);
        for (;;)
            pause();
    }
    pid_t pid;
    epipe_msg *m;
    CHECK(recv_pid(c, 1, &pid) == CONF_PASS);
    /* Alive and idle: still up after the liveness timeout (600 ms). */
    char within[64];
    snprintf(within, sizeof within, "within %lld ms", (long long)conf_ms(1500));
    CHECK_RC(c, epipe_comm_recv(c, 1, ACT, 1, 0, conf_ms(1500), &m), EPIPE_ETIMEDOUT);
    CHECK_MSG(c, within);
    kill(pid, SIGSTOP);
    double t0 = conf_now();
    int rc = epipe_comm_recv(c, 1, ACT, 1, 0, LONG_MS, &m);
    double dt = conf_now() - t0;
    kill(pid, SIGKILL);
    CHECK_RC(c, rc, EPIPE_ETIMEDOUT);
    CHECK_MSG(c, "rank 1");
    if (conf_is("tcp"))
        CHECK_MSG(c, "nothing heard");
    CHECK_WITHIN(dt, 3.0); /* within the 600 ms timeout, not the receive's 20 s */
    epipe_comm_destroy(c);
    return CONF_PASS;
}

static int test_stopped_peer(void)
{
    char opts[64];
    snprintf(opts, sizeof opts, "timeout_ms=%lld", (long long)conf_ms(600));
    return conf_run(2, opts, stopped_rank, NULL, 1u << 1, 60);
}

/* ---- corrupt bytes ------------------------------------------------------ *
 * Rank 1 sends a sealed message with one bit flipped after sealing (in the
 * payload, or in the header), through the ordinary send: the transport
 * carries the bytes as given, the receiving side's checks must catch them.
 * The receiver's receive fails with the check's status (EPIPE_ECHECKSUM)
 * naming rank 1 and the check, and rank 1 learns it was cut off (inproc:
 * the sender's send says why at once). */

static int logged_failure; /* the log said "rank 1 failed" */

static void watch_log(void *user, int level, const char *subsys, int rank, const char *message)
{
    (void)user, (void)level, (void)rank;
    fprintf(stderr, "epipe %s: %s\n", subsys, message);
    if (strstr(message, "rank 1 failed"))
        __atomic_store_n(&logged_failure, 1, __ATOMIC_RELEASE);
}

static int corrupt_rank(epipe_comm *c, unsigned rank, unsigned size, void *arg)
{
    (void)size;
    int in_header = *(int *)arg;
    epipe_msg *m;
    if (rank == 0 && conf_tp.procs)
        epipe_set_log_callback(watch_log, NULL);
    /* Rank 1 sends the corrupt message only once rank 0 says it watches
     * its log: a message that came before would be logged before the
     * callback is there (CI saw it, 1 run in about 20). */
    if (rank == 0)
        CHECK_RC(c, epipe_comm_send(c, 1, conf_msg(GRAD, 0, 1, 2, 0, 4, 5)), EPIPE_OK);
    if (rank == 1) {
        CHECK_RC(c, epipe_comm_recv(c, 0, GRAD, 2, 0, LONG_MS, &m), EPIPE_OK);
        epipe_msg_free(m);
        m = conf_msg(ACT, 1, 0, 3, 0, 1000, 7);
        if (in_header)
            m->data[24] ^= 0x01; /* a bit of the step: the header CRC catches it */
        else
            m->data[m->len - 5] ^= 0x20;
        int rc = epipe_comm_send(c, 0, m);
        if (rc != EPIPE_OK) /* inproc checks at once: the sender hears why */
            CHECK(rc == EPIPE_ECHECKSUM);
        CHECK_RC(c, epipe_comm_recv(c, 0, GRAD, 3, 0, LONG_MS, &m), EPIPE_EPEER);
    } else {
        int rc = epipe_comm_recv(c, 1, ACT, 3, 0, LONG_MS, &m);
        CHECK_MSG(c, "rank 1");
        CHECK_RC(c, rc, EPIPE_ECHECKSUM);
        CHECK_MSG(c, "CRC");
        CHECK_MSG(c, in_header ? "header" : "payload");
        if (conf_is("tcp")) /* and the log says so */
            CHECK(__atomic_load_n(&logged_failure, __ATOMIC_ACQUIRE));
    }
    epipe_comm_destroy(c);
    return CONF_PASS;
}

static int test_corrupt(void)
{
    int in_header = 0, rc = conf_run(2, "timeout_ms=10000", corrupt_rank, &in_header, 0, 60);
    if (rc != CONF_PASS)
        return rc;
    in_header = 1;
    return conf_run(2, "timeout_ms=10000", corrupt_rank, &in_header, 0, 60);
}

/* ---- a message over the receiver's max_message -------------------------- *
 * Refused with EPIPE_ETOOBIG naming the sender and the limit, before the
 * receiver takes the payload in; the sender is cut off. */

static int too_big_rank(epipe_comm *c, unsigned rank, unsigned size, void *arg)
{
    (void)size, (void)arg;
    epipe_msg *m;
    if (rank == 1) {
        /* Only once rank 0's handle has its settings: epipe_comm_create
         * applies them after the group forms, so a message that arrives
         * before that is judged by the default limit. */
        CHECK(conf_expect(c, 0, GRAD, 2, 0, 1, 0, LONG_MS) == CONF_PASS);
        int rc = epipe_comm_send(c, 0, conf_msg(ACT, 1, 0, 3, 0, 1u << 19, 7)); /* 2 MiB */
        if (rc != EPIPE_OK) /* inproc checks at once: the sender hears why */
            CHECK_RC(c, rc, EPIPE_ETOOBIG);
        CHECK_RC(c, epipe_comm_recv(c, 0, GRAD, 3, 0, LONG_MS, &m), EPIPE_EPEER);
    } else {
        CHECK_RC(c, epipe_comm_send(c, 1, conf_msg(GRAD, 0, 1, 2, 0, 1, 0)), EPIPE_OK);
        int rc = epipe_comm_recv(c, 1, ACT, 3, 0, LONG_MS, &m);
        if (rc == EPIPE_OK)
            epipe_msg_free(m);
        CHECK_MSG(c, "rank 1");
        CHECK_RC(c, rc, EPIPE_ETOOBIG);
        CHECK_MSG(c, "exceeds the limit 1048576");
    }
    epipe_comm_destroy(c);
    return CONF_PASS;
}

static int test_too_big(void)
{
    return conf_run(2, "timeout_ms=10000,max_message=1048576", too_big_rank, NULL, 0, 60);
}

#define NOT_PROCS "ranks of inproc are threads of one process: none can be killed or stopped alone"

const struct conf_test conf_fault_tests[] = {
    {"abort", test_abort, NULL},
    {"abort-spinning", test_abort_spinning, NULL},
    {"dead-peer", test_dead_peer, NOT_PROCS},
    {"stopped-peer", test_stopped_peer, NOT_PROCS},
    {"corrupt", test_corrupt, NULL},
    {"too-big", test_too_big, NULL},
    {NULL, NULL, NULL},
};
