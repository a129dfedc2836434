/* The transport conformance suite: one set of tests, run against every
 * transport by name (inproc, tcp, rdma); the harness that starts the ranks. */
#ifndef EPIPE_TESTS_CONFORM_H
#define EPIPE_TESTS_CONFORM_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <epipe/epipe.h>

#include "comm/comm_impl.h"

/* Exit statuses of the program and of each rank (meson's protocol). */
#define CONF_PASS 0
#define CONF_FAIL 1
#define CONF_SKIP 77

/* The transport under test, set once by main() before any rank starts. */
struct conf_transport {
    const char *arg;  /* as named on the command line: inproc, tcp, rdma, rdma-device */
    const char *name; /* as passed to epipe_comm_create: inproc, tcp, rdma */
    int procs;        /* ranks are processes (fork), else threads of this process */
};
extern struct conf_transport conf_tp;

/* Fails the calling rank (returns CONF_FAIL from the enclosing function)
 * with the condition, the place and the communicator's last error. */
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                        \
            return CONF_FAIL;                                                                      \
        }                                                                                          \
    } while (0)
/* rc == want, else fails naming both statuses and c's last error. */
#define CHECK_RC(c, rc, want)                                                                      \
    do {                                                                                           \
        int rc_ = (rc), want_ = (want);                                                            \
        if (rc_ != want_) {                                                                        \
            fprintf(stderr, "FAIL %s:%d: %s is %s, want %s (%s)\n", __FILE__, __LINE__, #rc,       \
                    epipe_status_name(rc_), epipe_status_name(want_),                              \
                    (c) ? epipe_comm_last_error(c) : epipe_last_error());                          \
            return CONF_FAIL;                                                                      \
        }                                                                                          \
    } while (0)
/* The communicator's last error contains s. */
#define CHECK_MSG(c, s)                                                                            \
    do {                                                                                           \
        if (!strstr(epipe_comm_last_error(c), (s))) {                                              \
            fprintf(stderr, "FAIL %s:%d: error '%s' does not say '%s'\n", __FILE__, __LINE__,      \
                    epipe_comm_last_error(c), (s));                                                \
            return CONF_FAIL;                                                                      \
        }                                                                                          \
    } while (0)

/* Seconds elapsed (dt) below limit_s times conf_time_scale(): the bounds
 * that tell "at once" from "after the timeout". */
#define CHECK_WITHIN(dt, limit_s)                                                                  \
    do {                                                                                           \
        double dt_ = (dt), lim_ = (limit_s)*conf_time_scale();                                     \
        if (!(dt_ < lim_)) {                                                                       \
            fprintf(stderr, "FAIL %s:%d: %s took %.3f s, limit %.3f s\n", __FILE__, __LINE__, #dt, \
                    dt_, lim_);                                                                    \
            return CONF_FAIL;                                                                      \
        }                                                                                          \
    } while (0)
/* EPIPE_CONF_TIME_SCALE (1..5, default 1) for slow runs (valgrind); at most
 * 5, so a bound stays below the 20 s receives it tells apart. */
double conf_time_scale(void);
/* ms times conf_time_scale(): liveness timeouts and the waits that outlast
 * them, so a slow tool does not make a live peer look dead. */
int64_t conf_ms(int64_t ms);

/* One rank's part of a test. It owns c and destroys it (or leaves it to
 * the harness by returning without doing so: the harness never does, so
 * every body destroys its handle). Returns CONF_PASS or CONF_FAIL. */
typedef int (*conf_rank_fn)(epipe_comm *c, unsigned rank, unsigned size, void *arg);

/* Runs `size` ranks of a group over the transport under test, each calling
 * fn once its handle is created with `options` (group= is added for
 * inproc). `killed` lists, as a bit mask, the ranks another rank may kill
 * with SIGKILL (their death is not a failure). Returns CONF_PASS, CONF_FAIL
 * or CONF_SKIP (a rank's epipe_comm_create said EPIPE_ENOTSUP; the reason
 * is printed). Every rank must finish within `limit_s` seconds. */
int conf_run(unsigned size, const char *options, conf_rank_fn fn, void *arg, unsigned killed,
             int limit_s);

/* ---- messages ----------------------------------------------------------- */

/* An activation or gradient of n floats made from seed, codec none. */
epipe_msg *conf_msg(unsigned kind, unsigned src, unsigned dst, uint64_t step, uint32_t mb, size_t n,
                    uint64_t seed);
/* 1 when m is the message conf_msg made with n and seed. */
int conf_msg_is(const epipe_msg *m, size_t n, uint64_t seed);
/* Receives (kind, step, mb) from peer within timeout_ms and checks it is
 * conf_msg's (n, seed): CONF_PASS or CONF_FAIL, saying which. */
int conf_expect(epipe_comm *c, unsigned peer, unsigned kind, uint64_t step, uint32_t mb, size_t n,
                uint64_t seed, int64_t timeout_ms);

double conf_now(void);
int conf_is(const char *transport); /* conf_tp.arg starts with transport */

/* ---- the tests (messages.c, faults.c, training.c) ----------------------- */

struct conf_test {
    const char *name;
    int (*run)(void);
    /* Non-NULL: the reason it cannot run on inproc (threads of one process). */
    const char *inproc_skip;
};
extern const struct conf_test conf_message_tests[], conf_fault_tests[], conf_training_tests[];

#endif
