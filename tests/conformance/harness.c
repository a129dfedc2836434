/* The conformance harness: starts a test's ranks as processes (tcp, rdma)
 * or threads (inproc), builds and checks its messages, and picks the test. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sys/wait.h>

#include "codec/codec_impl.h"
#include "codec/payload.h"
#include "conform.h"
#include "loopback.h"

struct conf_transport conf_tp;

double conf_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double conf_time_scale(void)
{
    const char *v = getenv("EPIPE_CONF_TIME_SCALE");
    double x = v ? atof(v) : 1.0;
    return x < 1.0 ? 1.0 : x > 5.0 ? 5.0 : x;
}

int64_t conf_ms(int64_t ms)
{
    return (int64_t)((double)ms * conf_time_scale());
}

int conf_is(const char *transport)
{
    return !strncmp(conf_tp.arg, transport, strlen(transport));
}

/* ---- messages ----------------------------------------------------------- */

static float value_of(uint64_t seed, size_t i)
{
    uint64_t x = (seed + 1) * UINT64_C(0x9E3779B97F4A7C15) ^
                 (uint64_t)i * UINT64_C(0xBF58476D1CE4E5B9);
    x ^= x >> 29;
    return (float)(int64_t)(x % 20001) * 1e-3f - 10.0f;
}

epipe_msg *conf_msg(unsigned kind, unsigned src, unsigned dst, uint64_t step, uint32_t mb, size_t n,
                    uint64_t seed)
{
    epipe_msg *m = epipe_msg_new(EPIPE_PAYLOAD_HEADER + n * sizeof(float));
    if (!m) {
        fprintf(stderr, "conf_msg: out of memory for %zu floats\n", n);
        abort();
    }
    uint8_t *p = epipe_msg_payload(m);
    /* What codec none writes: its payload header, then the floats. */
    epipe_payload_put(p, EPIPE_CODEC_ID_NONE, EPIPE_DTYPE_F32, 0, n);
    float *x = (float *)(void *)(p + EPIPE_PAYLOAD_HEADER);
    for (size_t i = 0; i < n; i++)
        x[i] = value_of(seed, i);
    memset(&m->hdr, 0, sizeof m->hdr);
    m->hdr.kind = (uint8_t)kind;
    m->hdr.dtype = EPIPE_DTYPE_F32;
    m->hdr.ndim = 1;
    m->hdr.shape[0] = n;
    m->hdr.codec_id = EPIPE_CODEC_ID_NONE;
    m->hdr.micro_batch = mb;
    m->hdr.step = step;
    m->hdr.src_stage = src;
    m->hdr.dst_stage = dst;
    if (epipe_msg_seal(m, EPIPE_PAYLOAD_HEADER + n * sizeof(float)) != EPIPE_OK) {
        fprintf(stderr, "conf_msg: %s\n", epipe_last_error());
        abort();
    }
    return m;
}

int conf_msg_is(const epipe_msg *m, size_t n, uint64_t seed)
{
    if (m->hdr.shape[0] != n || m->hdr.payload_len != EPIPE_PAYLOAD_HEADER + n * sizeof(float))
        return 0;
    const uint8_t *p = m->data + m->hdr.header_len + EPIPE_PAYLOAD_HEADER;
    for (size_t i = 0; i < n; i++) {
        float want = value_of(seed, i), got;
        memcpy(&got, p + i * sizeof got, sizeof got);
        if (memcmp(&got, &want, sizeof got))
            return 0;
    }
    return 1;
}

int conf_expect(epipe_comm *c, unsigned peer, unsigned kind, uint64_t step, uint32_t mb, size_t n,
                uint64_t seed, int64_t timeout_ms)
{
    epipe_msg *m;
    int rc = epipe_comm_recv(c, peer, kind, step, mb, timeout_ms, &m);
    if (rc) {
        fprintf(stderr, "FAIL: rank %u: %s of step %llu mb %u from rank %u: %s: %s\n",
                epipe_comm_rank(c), epipe_wire_kind_name(kind), (unsigned long long)step, mb, peer,
                epipe_status_name(rc), epipe_comm_last_error(c));
        return CONF_FAIL;
    }
    int ok = conf_msg_is(m, n, seed);
    if (!ok)
        fprintf(stderr,
                "FAIL: rank %u: %s of step %llu mb %u from rank %u is not the one sent "
                "(%llu elements, want %zu, seed %llu)\n",
                epipe_comm_rank(c), epipe_wire_kind_name(kind), (unsigned long long)step, mb, peer,
                (unsigned long long)m->hdr.shape[0], n, (unsigned long long)seed);
    epipe_msg_free(m);
    return ok ? CONF_PASS : CONF_FAIL;
}

/* ---- ranks -------------------------------------------------------------- */

static unsigned free_port(void)
{
    unsigned port = loopback_free_port();
    if (!port) {
        perror("conformance: no free port");
        exit(CONF_FAIL);
    }
    return port;
}

struct rank_job {
    pthread_t th;
    unsigned rank, size;
    const char *options;
    conf_rank_fn fn;
    void *arg;
    int status;
    unsigned port;
};

/* Creates the rank's handle and runs its part. */
static int rank_main(struct rank_job *j)
{
    epipe_comm *c = NULL;
    int rc = epipe_comm_create(&c, conf_tp.name, j->rank, j->size, "127.0.0.1", j->port,
                               j->options);
    /* EPIPE_ENOTSUP is a skip where the transport is not built, or (real
     * devices) where the machine has none; over the test provider, which
     * always offers a device, any other reason is a failure. */
    if (rc == EPIPE_ENOTSUP &&
        (strcmp(conf_tp.arg, "rdma") || strstr(epipe_last_error(), "not built"))) {
        printf("SKIP: rank %u: %s\n", j->rank, epipe_last_error());
        return CONF_SKIP;
    }
    if (rc) {
        fprintf(stderr, "FAIL: rank %u: epipe_comm_create(%s): %s: %s\n", j->rank, conf_tp.name,
                epipe_status_name(rc), epipe_last_error());
        return CONF_FAIL;
    }
    if (strcmp(epipe_comm_transport(c), conf_tp.name)) {
        fprintf(stderr, "FAIL: rank %u: asked for %s, got %s\n", j->rank, conf_tp.name,
                epipe_comm_transport(c));
        epipe_comm_destroy(c);
        return CONF_FAIL;
    }
    return j->fn(c, j->rank, j->size, j->arg);
}

static void *rank_thread(void *p)
{
    struct rank_job *j = p;
    j->status = rank_main(j);
    return NULL;
}

#define MAX_RANKS 8

static int run_threads(struct rank_job *jobs, unsigned size, const char *options, int limit_s)
{
    static unsigned groups;
    char opts[512];
    snprintf(opts, sizeof opts, "%s%sgroup=conf%d-%u", options, *options ? "," : "", (int)getpid(),
             groups++);
    alarm((unsigned)limit_s); /* a hang ends the program (SIGALRM) instead of the CI */
    for (unsigned r = 0; r < size; r++) {
        jobs[r].options = opts;
        if (pthread_create(&jobs[r].th, NULL, rank_thread, &jobs[r])) {
            perror("pthread_create");
            exit(CONF_FAIL);
        }
    }
    int result = CONF_PASS;
    for (unsigned r = 0; r < size; r++) {
        pthread_join(jobs[r].th, NULL);
        if (jobs[r].status == CONF_SKIP && result == CONF_PASS)
            result = CONF_SKIP;
        else if (jobs[r].status != CONF_PASS && jobs[r].status != CONF_SKIP)
            result = CONF_FAIL;
    }
    alarm(0);
    return result;
}

static void kill_all(pid_t *pids, unsigned size)
{
    for (unsigned r = 0; r < size; r++)
        if (pids[r] > 0)
            kill(pids[r], SIGKILL);
}

static int run_procs(struct rank_job *jobs, unsigned size, const char *options, unsigned killed,
                     int limit_s)
{
    pid_t pids[MAX_RANKS];
    unsigned port = free_port();
    fflush(stdout);
    fflush(stderr);
    for (unsigned r = 0; r < size; r++) {
        jobs[r].options = options;
        jobs[r].port = port;
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            kill_all(pids, r);
            exit(CONF_FAIL);
        }
        if (pids[r] == 0) {
            int status = rank_main(&jobs[r]);
            fflush(stdout);
            exit(status); /* exit, not _exit: LeakSanitizer checks each rank */
        }
    }
    int result = CONF_PASS, stopping = 0;
    unsigned left = size;
    double deadline = conf_now() + limit_s;
    while (left) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid < 0 && errno != EINTR)
            break;
        if (pid <= 0) {
            if (conf_now() > deadline) {
                for (unsigned r = 0; r < size; r++)
                    if (pids[r] > 0)
                        fprintf(stderr, "FAIL: rank %u did not finish within %d s\n", r, limit_s);
                kill_all(pids, size);
                while (waitpid(-1, &st, 0) > 0)
                    ;
                return CONF_FAIL;
            }
            usleep(2000);
            continue;
        }
        unsigned r = 0;
        while (r < size && pids[r] != pid)
            r++;
        if (r == size)
            continue;
        pids[r] = 0;
        left--;
        int status;
        if (WIFEXITED(st))
            status = WEXITSTATUS(st);
        else if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL && (stopping || (killed >> r & 1)))
            status = CONF_PASS; /* the test killed it, or this harness did */
        else {
            fprintf(stderr, "FAIL: rank %u ended by signal %d\n", r,
                    WIFSIGNALED(st) ? WTERMSIG(st) : -1);
            status = CONF_FAIL;
        }
        if (status == CONF_PASS)
            continue;
        /* A skip or a failure: the others would only wait for this rank. */
        if (status == CONF_SKIP && result == CONF_PASS)
            result = CONF_SKIP;
        else if (status != CONF_SKIP)
            result = CONF_FAIL;
        stopping = 1;
        kill_all(pids, size);
    }
    return result;
}

int conf_run(unsigned size, const char *options, conf_rank_fn fn, void *arg, unsigned killed,
             int limit_s)
{
    struct rank_job jobs[MAX_RANKS];
    if (size > MAX_RANKS)
        return CONF_FAIL;
    memset(jobs, 0, sizeof jobs);
    for (unsigned r = 0; r < size; r++)
        jobs[r] = (struct rank_job){.rank = r, .size = size, .fn = fn, .arg = arg};
    return conf_tp.procs ? run_procs(jobs, size, options ? options : "", killed, limit_s)
                         : run_threads(jobs, size, options ? options : "", limit_s);
}

/* ---- main --------------------------------------------------------------- */

static void usage(void)
{
    fprintf(stderr, "usage: conformance inproc|tcp|rdma|rdma-device TEST\n"
                    "Runs one conformance test over one transport; exit 0 pass, 1 fail,\n"
                    "77 skip (with the reason). Tests:");
    const struct conf_test *lists[] = {conf_message_tests, conf_fault_tests, conf_training_tests};
    for (int l = 0; l < 3; l++)
        for (const struct conf_test *t = lists[l]; t->name; t++)
            fprintf(stderr, " %s", t->name);
    fprintf(stderr, "\n");
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc != 3) {
        usage();
        return 2;
    }
    conf_tp.arg = argv[1];
    if (!strcmp(argv[1], "inproc")) {
        conf_tp.name = "inproc";
    } else if (!strcmp(argv[1], "tcp")) {
        conf_tp.name = "tcp", conf_tp.procs = 1;
    } else if (!strcmp(argv[1], "rdma")) {
        /* Over the test verbs provider, which meson names in the
         * environment. */
        conf_tp.name = "rdma", conf_tp.procs = 1;
        const char *lib = getenv("EPIPE_IBVERBS_LIB");
        if (!lib || !*lib) {
            /* Say what libepipe says of rdma too ("not built into this
             * libepipe" where the transport is missing). */
            epipe_comm *c = NULL;
            int rc = epipe_comm_create(&c, "rdma", 0, 1, "127.0.0.1", 0, NULL);
            printf("SKIP: the test verbs provider (tests/fakeverbs) is not built; %s\n",
                   rc == EPIPE_OK ? "rdma itself is" : epipe_last_error());
            epipe_comm_destroy(c);
            return CONF_SKIP;
        }
    } else if (!strcmp(argv[1], "rdma-device")) {
        /* A real device through the system's libibverbs.so.1. */
        conf_tp.name = "rdma", conf_tp.procs = 1;
        unsetenv("EPIPE_IBVERBS_LIB");
    } else {
        usage();
        return 2;
    }
    const struct conf_test *lists[] = {conf_message_tests, conf_fault_tests, conf_training_tests};
    for (int l = 0; l < 3; l++)
        for (const struct conf_test *t = lists[l]; t->name; t++) {
            if (strcmp(t->name, argv[2]))
                continue;
            if (!conf_tp.procs && t->inproc_skip) {
                printf("SKIP: %s on inproc: %s\n", t->name, t->inproc_skip);
                return CONF_SKIP;
            }
            double t0 = conf_now();
            int rc = t->run();
            printf("%s over %s: %s in %.2f s\n", t->name, conf_tp.arg,
                   rc == CONF_PASS   ? "pass"
                   : rc == CONF_SKIP ? "skip"
                                     : "FAIL",
                   conf_now() - t0);
            return rc;
        }
    usage();
    return 2;
}
