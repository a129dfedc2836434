/* Unit tests of what only the TCP transport has, over loopback: the
 * environment rendezvous, streams and topology, init failures, hostile
 * connections, authentication, framing cut mid-message. What every
 * transport shares (ordering, tags, faults...) is in tests/conformance/. */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <epipe/codec.h>
#include <epipe/comm.h>

#include "../transport/tcp_impl.h"
#include "comm/comm_impl.h"
#include "tensor.h"
#include "testutil.h"
#include "wire/crc32c.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- groups of ranks as threads ----------------------------------------- */

struct rank_arg {
    pthread_t th;
    unsigned rank, size, port;
    const char *opts;
    epipe_comm *c;
    int rc;
    char err[256];
    double seconds;
};

static void *create_thread(void *p)
{
    struct rank_arg *a = p;
    double t0 = now_s();
    a->rc = epipe_comm_create_tcp(&a->c, a->rank, a->size, "127.0.0.1", a->port, a->opts);
    a->seconds = now_s() - t0;
    snprintf(a->err, sizeof a->err, "%s", epipe_last_error());
    return NULL;
}

static void start_rank(struct rank_arg *a, unsigned rank, unsigned size, unsigned port,
                       const char *opts)
{
    memset(a, 0, sizeof *a);
    a->rank = rank, a->size = size, a->port = port, a->opts = opts;
    assert_int_equal(pthread_create(&a->th, NULL, create_thread, a), 0);
}

static void make_group(epipe_comm **comms, unsigned size, const char *opts)
{
    struct rank_arg a[8];
    unsigned port = test_free_port();
    for (unsigned r = 0; r < size; r++)
        start_rank(&a[r], r, size, port, opts);
    for (unsigned r = 0; r < size; r++) {
        pthread_join(a[r].th, NULL);
        if (a[r].rc)
            print_error("rank %u: %s\n", r, a[r].err);
        assert_int_equal(a[r].rc, EPIPE_OK);
        comms[r] = a[r].c;
        assert_string_equal(epipe_comm_transport(comms[r]), "tcp");
        assert_int_equal(epipe_comm_rank(comms[r]), r);
        assert_int_equal(epipe_comm_size(comms[r]), size);
    }
}

/* An activation message of n fill values (seed) from src to dst. */
static epipe_msg *make_act(unsigned src, unsigned dst, uint64_t step, uint32_t mb, size_t n,
                           uint64_t seed)
{
    float *x = malloc(n * sizeof *x);
    assert_non_null(x);
    test_fill(x, n, DIST_NORMAL, seed);
    epipe_msg *m = test_activation_msg(src, dst, step, mb, x, n);
    free(x);
    return m;
}

static void check_act(epipe_msg *m, size_t n, uint64_t seed)
{
    float *want = malloc(n * sizeof *want);
    test_fill(want, n, DIST_NORMAL, seed);
    assert_int_equal(m->hdr.shape[0], n);
    /* codec none: the floats follow the 16-byte codec payload header */
    assert_memory_equal(m->data + m->hdr.header_len + 16, want, n * sizeof *want);
    free(want);
}

static void recv_act(epipe_comm *c, unsigned peer, uint64_t step, uint32_t mb, size_t n,
                     uint64_t seed)
{
    epipe_msg *m;
    int rc = epipe_comm_recv(c, peer, EPIPE_WIRE_ACTIVATION, step, mb, 5000, &m);
    if (rc)
        print_error("%s\n", epipe_comm_last_error(c));
    assert_int_equal(rc, EPIPE_OK);
    check_act(m, n, seed);
    epipe_msg_free(m);
}

/* ---- rendezvous from the environment ----------------------------------- */

static const char *all_vars[] = {
    "EPIPE_RANK",
    "EPIPE_WORLD_SIZE",
    "EPIPE_MASTER_ADDR",
    "EPIPE_MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "SLURM_JOB_ID",
    "EPIPE_TIMEOUT_MS",
    "EPIPE_TCP_STREAMS",
    "EPIPE_AUTH_KEY_FILE",
    "EPIPE_IFNAME",
    "EPIPE_LISTEN_ADDR",
    "EPIPE_TCP_TOPOLOGY",
    "EPIPE_INIT_TIMEOUT_MS",
    "EPIPE_HEARTBEAT_MS",
    "EPIPE_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
};

static void clear_env(void)
{
    for (size_t i = 0; i < sizeof all_vars / sizeof all_vars[0]; i++)
        unsetenv(all_vars[i]);
}

static void test_env_precedence(void **state)
{
    (void)state;
    epipe_rdv_env e;
    clear_env();
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_RANK"));

    /* Slurm alone: first host of the node list, port from the job id. */
    setenv("SLURM_PROCID", "3", 1);
    setenv("SLURM_NTASKS", "8", 1);
    setenv("SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1", 1);
    setenv("SLURM_NNODES", "4", 1);
    setenv("SLURM_JOB_ID", "123456", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.rank, 3);
    assert_int_equal(e.size, 8);
    assert_string_equal(e.master_addr, "gpu07");
    assert_int_equal(e.master_port, EPIPE_TCP_DEFAULT_PORT + 456);
    assert_non_null(strstr(e.source, "Slurm"));
    setenv("SLURM_NNODES", "1", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_string_equal(e.master_addr, "127.0.0.1");

    /* PMI wins over Slurm (srun --mpi=pmi2 sets both). */
    setenv("PMI_RANK", "1", 1);
    setenv("PMI_SIZE", "2", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.rank, 1);
    assert_int_equal(e.size, 2);
    assert_non_null(strstr(e.source, "PMI"));
    assert_int_equal(e.master_port, EPIPE_TCP_DEFAULT_PORT + 456); /* still a Slurm job */

    /* Open MPI over PMI; one node means the local host; multi-node needs
     * an address (here the Slurm node list gives one). */
    setenv("OMPI_COMM_WORLD_RANK", "2", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.rank, 2);
    assert_non_null(strstr(e.source, "Open MPI"));
    assert_string_equal(e.master_addr, "127.0.0.1");
    assert_int_equal(e.master_port, EPIPE_TCP_DEFAULT_PORT + 456); /* mpirun in a Slurm job */
    unsetenv("SLURM_JOB_ID");
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.master_port, EPIPE_TCP_DEFAULT_PORT);
    setenv("SLURM_JOB_ID", "123456", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    unsetenv("SLURM_JOB_NODELIST");
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_MASTER_ADDR"));
    setenv("EPIPE_MASTER_ADDR", "10.1.2.3", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_string_equal(e.master_addr, "10.1.2.3");

    /* torchrun over Open MPI: MASTER_PORT + 1, EPIPE_MASTER_ADDR still wins. */
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "3", 1);
    setenv("MASTER_ADDR", "node0", 1);
    setenv("MASTER_PORT", "29500", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.rank, 1);
    assert_int_equal(e.size, 3);
    assert_non_null(strstr(e.source, "torchrun"));
    assert_string_equal(e.master_addr, "10.1.2.3");
    assert_int_equal(e.master_port, 29501);
    unsetenv("EPIPE_MASTER_ADDR");
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_string_equal(e.master_addr, "node0");
    setenv("EPIPE_MASTER_PORT", "4000", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.master_port, 4000);

    /* Ours over everything. */
    setenv("EPIPE_RANK", "0", 1);
    setenv("EPIPE_WORLD_SIZE", "5", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.rank, 0);
    assert_int_equal(e.size, 5);
    assert_string_equal(e.source, "EPIPE_RANK/EPIPE_WORLD_SIZE");

    /* Errors name the variable. */
    unsetenv("EPIPE_WORLD_SIZE");
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_WORLD_SIZE"));
    setenv("EPIPE_WORLD_SIZE", "5", 1);
    setenv("EPIPE_RANK", "5", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    setenv("EPIPE_RANK", "x1", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_RANK"));
    setenv("EPIPE_RANK", "1", 1);
    setenv("EPIPE_MASTER_PORT", "70000", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    clear_env();
}

/* Each launcher's variables on their own (no other source set), and the
 * half-set mistakes, each named. */
static void test_env_sources_alone(void **state)
{
    (void)state;
    epipe_rdv_env e;
    clear_env();
    /* torchrun alone: MASTER_ADDR, MASTER_PORT + 1; no MASTER_ADDR is an error. */
    setenv("RANK", "2", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("MASTER_PORT", "29500", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "MASTER_ADDR"));
    setenv("MASTER_ADDR", "10.0.0.7", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.rank, 2);
    assert_int_equal(e.size, 4);
    assert_string_equal(e.master_addr, "10.0.0.7");
    assert_int_equal(e.master_port, 29501);
    assert_non_null(strstr(e.port_source, "MASTER_PORT+1"));
    setenv("MASTER_PORT", "65535", 1); /* no room for the offset */
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "MASTER_PORT"));
    unsetenv("MASTER_PORT");
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.master_port, EPIPE_TCP_DEFAULT_PORT);
    unsetenv("WORLD_SIZE");
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "WORLD_SIZE"));
    clear_env();

    /* PMI alone: no node count, no node list: the local host, default port. */
    setenv("PMI_RANK", "0", 1);
    setenv("PMI_SIZE", "3", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_int_equal(e.size, 3);
    assert_string_equal(e.master_addr, "127.0.0.1");
    assert_int_equal(e.master_port, EPIPE_TCP_DEFAULT_PORT);
    assert_non_null(strstr(e.source, "PMI"));
    /* MPI_LOCALNRANKS says the ranks span nodes: an address is needed. */
    setenv("MPI_LOCALNRANKS", "1", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_MASTER_ADDR"));
    setenv("EPIPE_MASTER_ADDR", "h0", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_string_equal(e.master_addr, "h0");
    clear_env();

    /* Open MPI alone, no local size: assumed single node. */
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_string_equal(e.master_addr, "127.0.0.1");
    unsetenv("OMPI_COMM_WORLD_SIZE");
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "OMPI_COMM_WORLD_SIZE"));
    clear_env();

    /* Slurm over several nodes without a node list: say what to set. */
    setenv("SLURM_PROCID", "0", 1);
    setenv("SLURM_NTASKS", "2", 1);
    setenv("SLURM_NNODES", "2", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_MASTER_ADDR"));
    setenv("SLURM_JOB_NODELIST", "a[1-2]", 1);
    assert_int_equal(epipe_rdv_env_parse(&e), EPIPE_OK);
    assert_string_equal(e.master_addr, "a1");
    assert_int_equal(e.master_port, EPIPE_TCP_DEFAULT_PORT); /* no job id */
    clear_env();
}

static void test_first_host(void **state)
{
    (void)state;
    char h[64];
    assert_int_equal(epipe_rdv_first_host("node1", h, sizeof h), EPIPE_OK);
    assert_string_equal(h, "node1");
    assert_int_equal(epipe_rdv_first_host("n[3-5]", h, sizeof h), EPIPE_OK);
    assert_string_equal(h, "n3");
    assert_int_equal(epipe_rdv_first_host("a[010,2]-ib,b1", h, sizeof h), EPIPE_OK);
    assert_string_equal(h, "a010-ib");
    assert_int_equal(epipe_rdv_first_host("x,y", h, sizeof h), EPIPE_OK);
    assert_string_equal(h, "x");
    assert_int_equal(epipe_rdv_first_host("rack[2-3]-n[007-010,1]", h, sizeof h), EPIPE_OK);
    assert_string_equal(h, "rack2-n007");
    assert_int_equal(epipe_rdv_first_host("n[09-10]", h, sizeof h), EPIPE_OK);
    assert_string_equal(h, "n09");
    assert_int_equal(epipe_rdv_first_host("n[1-2", h, sizeof h), EPIPE_EINVAL);
    assert_int_equal(epipe_rdv_first_host("", h, sizeof h), EPIPE_EINVAL);
    /* Malformed anywhere in the list, with the reason. */
    static const struct {
        const char *list, *why;
    } bad[] = {
        {"n[3-1]", "the range 3-1 in node list 'n[3-1]' runs backwards"},
        {"a,n[010-9]", "the range 010-9 in node list"},
        {"n[]", "is not numbers"},
        {"n[-3]", "is not numbers"},
        {"n[1-]", "is not numbers"},
        {"n[1-x]", "is not numbers"},
        {"n[1,,2]", "is not numbers"},
        {"n[1[2]]", "is not numbers"},
        {"a,b[1-2", "unbalanced '['"},
        {"a,b]", "unbalanced ']'"},
        {"a,,b", "an empty entry"},
        {"a,", "an empty entry"},
        {",a", "an empty entry"},
        {"a b", "a space or control character"},
        {"a,b\tc", "a space or control character"},
        {"[1-2]", "the first host '1' of node list '[1-2]' is a number"},
        {"10", "is a number"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        epipe_clear_error();
        assert_int_equal(epipe_rdv_first_host(bad[i].list, h, sizeof h), EPIPE_EINVAL);
        if (!strstr(epipe_last_error(), bad[i].why))
            fail_msg("'%s': %s", bad[i].list, epipe_last_error());
    }
    /* The first host fits exactly, or is refused: never cut short. */
    assert_int_equal(epipe_rdv_first_host("ab[12-13]", h, 5), EPIPE_OK);
    assert_string_equal(h, "ab12");
    assert_int_equal(epipe_rdv_first_host("ab[12-13]", h, 4), EPIPE_EINVAL);
    assert_int_equal(epipe_rdv_first_host("abcd,e", h, 4), EPIPE_EINVAL);
}

static void test_options(void **state)
{
    (void)state;
    epipe_tcp_opts o;
    clear_env();
    assert_int_equal(epipe_tcp_opts_parse(&o, NULL), EPIPE_OK);
    assert_int_equal(o.timeout_ms, 30000);
    assert_int_equal(o.streams, 1);
    assert_int_equal(o.mesh, 0);
    setenv("EPIPE_TIMEOUT_MS", "1500", 1);
    setenv("EPIPE_TCP_STREAMS", "3", 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, "streams=2,topology=mesh,key_file=/k"), EPIPE_OK);
    assert_int_equal(o.timeout_ms, 1500);
    assert_int_equal(o.streams, 2);
    assert_int_equal(o.mesh, 1);
    assert_string_equal(o.key_file, "/k");
    assert_int_equal(epipe_tcp_opts_parse(&o, "bogus=1"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "bogus"));
    assert_int_equal(epipe_tcp_opts_parse(&o, "streams=9"), EPIPE_EINVAL);
    assert_int_equal(epipe_tcp_opts_parse(&o, "streams"), EPIPE_EINVAL);
    setenv("EPIPE_TIMEOUT_MS", "-4", 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, NULL), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "EPIPE_TIMEOUT_MS"));
    clear_env();
    /* The job: EPIPE_JOB_ID, else torchrun's run id (not its "none"), else
     * Slurm's job id; job= over all; none known gives tag 0. */
    assert_int_equal(epipe_tcp_opts_parse(&o, NULL), EPIPE_OK);
    assert_string_equal(o.job, "");
    assert_true(epipe_tcp_job_tag(&o) == 0);
    setenv("SLURM_JOB_ID", "4711", 1);
    setenv("TORCHELASTIC_RUN_ID", "none", 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, NULL), EPIPE_OK);
    assert_string_equal(o.job, "4711");
    assert_string_equal(o.job_source, "SLURM_JOB_ID");
    uint64_t slurm = epipe_tcp_job_tag(&o);
    setenv("TORCHELASTIC_RUN_ID", "a1b2", 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, NULL), EPIPE_OK);
    assert_string_equal(o.job_source, "TORCHELASTIC_RUN_ID");
    assert_true(epipe_tcp_job_tag(&o) != slurm && epipe_tcp_job_tag(&o) != 0);
    setenv("EPIPE_JOB_ID", "mine", 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, NULL), EPIPE_OK);
    assert_string_equal(o.job, "mine");
    assert_string_equal(o.job_source, "EPIPE_JOB_ID");
    assert_int_equal(epipe_tcp_opts_parse(&o, "job=other"), EPIPE_OK);
    assert_string_equal(o.job, "other");
    assert_string_equal(o.job_source, "option job");
    assert_int_equal(epipe_tcp_opts_parse(&o, "job="), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "is not a job name of 1..127 characters"));
    char long_job[160] = "job=";
    memset(long_job + 4, 'j', 128);
    assert_int_equal(epipe_tcp_opts_parse(&o, long_job), EPIPE_EINVAL);
    clear_env();
    epipe_comm *c = (epipe_comm *)1;
    assert_int_equal(epipe_comm_create_tcp(&c, 2, 2, "127.0.0.1", 1, NULL), EPIPE_EINVAL);
    assert_null(c);
    assert_int_equal(epipe_comm_create_tcp(&c, 0, 2, NULL, 1, NULL), EPIPE_EINVAL);
    assert_int_equal(epipe_comm_create_from_env(&c, NULL), EPIPE_EINVAL);
    /* A group of one needs no sockets. */
    assert_int_equal(epipe_comm_create_tcp(&c, 0, 1, NULL, 0, NULL), EPIPE_OK);
    assert_int_equal(epipe_comm_size(c), 1);
    epipe_comm_destroy(c);
}

static void test_from_env(void **state)
{
    (void)state;
    clear_env();
    char port[16];
    snprintf(port, sizeof port, "%u", test_free_port());
    setenv("EPIPE_MASTER_PORT", port, 1);
    setenv("EPIPE_WORLD_SIZE", "1", 1);
    setenv("EPIPE_RANK", "0", 1);
    epipe_comm *c;
    assert_int_equal(epipe_comm_create_from_env(&c, "timeout_ms=2000"), EPIPE_OK);
    assert_int_equal(epipe_comm_size(c), 1);
    epipe_comm_destroy(c);
    clear_env();
}

/* ---- messages ----------------------------------------------------------- */

static void test_streams_mesh(void **state)
{
    (void)state;
    epipe_comm *c[4];
    make_group(c, 4, "streams=3,topology=mesh,timeout_ms=5000");
    for (unsigned s = 0; s < 4; s++)
        for (unsigned d = 0; d < 4; d++)
            if (s != d)
                for (uint32_t mb = 0; mb < 6; mb++)
                    assert_int_equal(
                        epipe_comm_send(
                            c[s], d, make_act(s, d, 1, mb, 20000 + 100 * s, s * 100 + d * 10 + mb)),
                        EPIPE_OK);
    for (unsigned d = 0; d < 4; d++)
        for (unsigned s = 0; s < 4; s++)
            if (s != d)
                for (uint32_t mb = 6; mb-- > 0;)
                    recv_act(c[d], s, 1, mb, 20000 + 100 * s, s * 100 + d * 10 + mb);
    for (unsigned r = 0; r < 4; r++)
        epipe_comm_destroy(c[r]);
}

static void test_pipeline_topology(void **state)
{
    (void)state;
    epipe_comm *c[4];
    make_group(c, 4, "timeout_ms=5000,streams=2");
    /* Neighbours and rank 0 are joined; 1 and 3 are not. */
    assert_int_equal(epipe_comm_send(c[3], 0, make_act(3, 0, 1, 0, 10, 1)), EPIPE_OK);
    assert_int_equal(epipe_comm_send(c[2], 3, make_act(2, 3, 1, 0, 10, 2)), EPIPE_OK);
    recv_act(c[0], 3, 1, 0, 10, 1);
    recv_act(c[3], 2, 1, 0, 10, 2);
    assert_int_equal(epipe_comm_send(c[1], 3, make_act(1, 3, 1, 0, 10, 3)), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_comm_last_error(c[1]), "topology"));
    /* Rank 3 aborts: rank 1, not joined to it, hears through rank 0. */
    epipe_comm_abort(c[3]);
    epipe_msg *m;
    double t0 = now_s();
    assert_int_equal(epipe_comm_recv(c[2], 3, EPIPE_WIRE_GRADIENT, 1, 0, 5000, &m), EPIPE_EPEER);
    assert_non_null(strstr(epipe_comm_last_error(c[2]), "aborted"));
    assert_int_equal(epipe_comm_recv(c[1], 3, EPIPE_WIRE_GRADIENT, 1, 0, 5000, &m), EPIPE_EPEER);
    assert_non_null(strstr(epipe_comm_last_error(c[1]), "rank 3 failed"));
    assert_true(now_s() - t0 < 3.0);
    for (unsigned r = 0; r < 4; r++)
        epipe_comm_destroy(c[r]);
}

/* ---- init failures ------------------------------------------------------ */

/* The address to listen on can be chosen by interface or by address; a
 * missing interface is named at init. */
static void test_listen_choice(void **state)
{
    (void)state;
    clear_env();
    epipe_comm *c[2];
    make_group(c, 2, "ifname=lo,init_timeout_ms=5000");
    assert_int_equal(epipe_comm_send(c[1], 0, make_act(1, 0, 1, 0, 64, 3)), EPIPE_OK);
    recv_act(c[0], 1, 1, 0, 64, 3);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    make_group(c, 2, "listen_addr=127.0.0.1,init_timeout_ms=5000");
    assert_int_equal(epipe_comm_send(c[0], 1, make_act(0, 1, 1, 0, 64, 4)), EPIPE_OK);
    recv_act(c[1], 0, 1, 0, 64, 4);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    epipe_comm *x = NULL;
    int rc = epipe_comm_create_tcp(&x, 0, 2, "127.0.0.1", test_free_port(),
                                   "ifname=nosuch9,init_timeout_ms=500");
    assert_int_equal(rc, EPIPE_EINVAL);
    assert_null(x);
    assert_non_null(strstr(epipe_last_error(), "nosuch9"));
    setenv("EPIPE_IFNAME", "nosuch8", 1);
    rc = epipe_comm_create_tcp(&x, 0, 2, "127.0.0.1", test_free_port(), "init_timeout_ms=500");
    assert_int_equal(rc, EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "nosuch8"));
    clear_env();
}

static void test_port_in_use(void **state)
{
    (void)state;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 4), 0);
    getsockname(fd, (struct sockaddr *)&a, &len);
    epipe_comm *c;
    int rc = epipe_comm_create_tcp(&c, 0, 2, "127.0.0.1", ntohs(a.sin_port),
                                   "init_timeout_ms=2000");
    assert_int_equal(rc, EPIPE_EIO);
    assert_null(c);
    assert_non_null(strstr(epipe_last_error(), "in use"));
    close(fd);
}

/* A connection to 127.0.0.1:port, dialled every 10 ms up to `tries`
 * times (the listener may not be up yet); -1 if none got through. */
static int try_connect(unsigned port, int tries)
{
    for (int i = 0; i < tries; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET,
                                .sin_port = htons((uint16_t)port),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0)
            return fd;
        close(fd);
        usleep(10000);
    }
    return -1;
}

static int connect_to(unsigned port)
{
    int fd = try_connect(port, 200);
    if (fd < 0)
        fail_msg("cannot connect to port %u", port);
    return fd;
}

/* Rank 0 that cannot accept a connection for want of descriptors fails at
 * once with the cause, instead of polling the connection, which stays in
 * the backlog, until its init timeout while the peer waits for an answer.
 * The peer is a child process (its own descriptors), dialling until it gets
 * through. */
static void test_accept_out_of_descriptors(void **state)
{
    (void)state;
    unsigned port = test_free_port();
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) { /* no cmocka here: a failure would run on in the child */
        if (try_connect(port, 500) >= 0)
            pause(); /* held open until killed */
        _exit(1);
    }
    int lowest = dup(0); /* the next descriptor rank 0 opens: its listener */
    assert_true(lowest >= 0);
    close(lowest);
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    lim = old;
    lim.rlim_cur = (rlim_t)lowest + 1; /* the listener, and nothing more */
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &lim), 0);
    struct rank_arg a0;
    start_rank(&a0, 0, 2, port, "init_timeout_ms=5000");
    pthread_join(a0.th, NULL);
    setrlimit(RLIMIT_NOFILE, &old);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    print_message("%s (%.2f s)\n", a0.err, a0.seconds);
    assert_int_equal(a0.rc, EPIPE_EIO);
    assert_null(a0.c);
    assert_non_null(strstr(a0.err, "cannot accept a connection"));
    assert_non_null(strstr(a0.err, strerror(EMFILE)));
}

/* A flood of idle connections that runs rank 0 out of descriptors while
 * some are pending does not fail the rendezvous: the oldest silent one is
 * dropped to make room, as when the pending slots are full, and rank 1
 * (a child, let go once the flood is in) still joins. */
static void test_accept_flood_out_of_descriptors(void **state)
{
    (void)state;
    unsigned port = test_free_port();
    int flooded[2], go[2];
    assert_int_equal(pipe(flooded), 0);
    assert_int_equal(pipe(go), 0);
    pid_t flooder = fork();
    assert_true(flooder >= 0);
    if (flooder == 0) { /* 40 connections that never say anything */
        int n = 0;
        for (int i = 0; i < 40; i++) /* the first once rank 0 listens */
            n += try_connect(port, i ? 1 : 500) >= 0;
        char b = n == 40 ? 'y' : 'n';
        if (write(flooded[1], &b, 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    pid_t rank1 = fork(); /* before the limit below: it needs its descriptors */
    assert_true(rank1 >= 0);
    if (rank1 == 0) {
        char b;
        epipe_comm *c;
        if (read(go[0], &b, 1) != 1 ||
            epipe_comm_create_tcp(&c, 1, 2, "127.0.0.1", port, "init_timeout_ms=5000"))
            _exit(1);
        epipe_comm_destroy(c);
        _exit(0);
    }
    int lowest = dup(0);
    assert_true(lowest >= 0);
    close(lowest);
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    lim = old;
    lim.rlim_cur = (rlim_t)lowest + 6; /* the listener and five more */
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &lim), 0);
    struct rank_arg a0;
    start_rank(&a0, 0, 2, port, "init_timeout_ms=5000");
    char b = 0;
    assert_int_equal(read(flooded[0], &b, 1), 1);
    assert_int_equal(write(go[1], "g", 1), 1);
    pthread_join(a0.th, NULL);
    int status = 0;
    waitpid(rank1, &status, 0);
    setrlimit(RLIMIT_NOFILE, &old);
    kill(flooder, SIGKILL);
    waitpid(flooder, NULL, 0);
    for (int i = 0; i < 2; i++)
        close(flooded[i]), close(go[i]);
    print_message("%s (%.2f s)\n", a0.rc ? a0.err : "formed", a0.seconds);
    assert_int_equal(b, 'y');
    assert_int_equal(a0.rc, EPIPE_OK);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    epipe_comm_destroy(a0.c);
}

/* A fork's child cannot use its parent's communicator, and gives up its
 * copies of the sockets at once: a rank that dies while a child it forked
 * lives on (a data loader's worker) is seen gone by its peers at once, not
 * when the child exits. In the child, calls on the handle return
 * EPIPE_ESTATE and epipe_comm_destroy releases nothing (the progress
 * thread it would join is not there). */
static void test_fork_child_gives_up_the_connections(void **state)
{
    (void)state;
    unsigned port = test_free_port();
    int report[2], done[2]; /* the worker's findings to the test; "checked" to rank 1 */
    assert_int_equal(pipe(report), 0);
    assert_int_equal(pipe(done), 0);
    pid_t rank1 = fork();
    assert_true(rank1 >= 0);
    if (rank1 == 0) { /* no cmocka in the children */
        epipe_comm *c;
        if (epipe_comm_create_tcp(&c, 1, 2, "127.0.0.1", port, "timeout_ms=20000"))
            _exit(2);
        pid_t worker = fork();
        if (worker == 0) {
            int64_t v;
            epipe_msg *m = NULL;
            char ok = epipe_comm_get_param(c, EPIPE_COMM_TIMEOUT_MS, &v) == EPIPE_ESTATE &&
                              epipe_comm_recv(c, 0, EPIPE_WIRE_ACTIVATION, 0, 0, 100, &m) ==
                                  EPIPE_ESTATE &&
                              strstr(epipe_comm_last_error(c), "forked")
                          ? 'y'
                          : 'n';
            epipe_comm_abort(c);
            epipe_comm_destroy(c); /* must return */
            pid_t me = getpid();
            ssize_t w = write(report[1], &ok, 1) + write(report[1], &me, sizeof me) +
                        write(done[1], &ok, 1);
            (void)w;
            sleep(20); /* outlives its parent by far, unless killed */
            _exit(0);
        }
        char got;
        ssize_t r = read(done[0], &got, 1); /* the worker has checked */
        (void)r;
        _exit(worker > 0 ? 0 : 3); /* dies without a goodbye, the worker living on */
    }
    epipe_comm *c;
    assert_int_equal(epipe_comm_create_tcp(&c, 0, 2, "127.0.0.1", port, "timeout_ms=20000"),
                     EPIPE_OK);
    int st;
    assert_int_equal(waitpid(rank1, &st, 0), rank1);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    char ok = 0;
    pid_t worker = 0;
    assert_int_equal(read(report[0], &ok, 1), 1);
    assert_int_equal(read(report[0], &worker, sizeof worker), sizeof worker);
    double t0 = now_s();
    epipe_msg *m = NULL;
    int rc = epipe_comm_recv(c, 1, EPIPE_WIRE_ACTIVATION, 0, 0, 10000, &m);
    double waited = now_s() - t0;
    print_message("rank 0: %s after %.2f s: %s\n", epipe_status_name(rc), waited,
                  epipe_comm_last_error(c));
    epipe_comm_destroy(c);
    kill(worker, SIGKILL); /* an orphan now: init reaps it */
    for (int i = 0; i < 2; i++)
        close(report[i]), close(done[i]);
    assert_int_equal(ok, 'y');
    assert_int_equal(rc, EPIPE_EPEER);
    assert_true(waited < 5.0); /* the worker sleeps 20 s; heartbeats trust 20 s */
}

static void test_unreachable_master(void **state)
{
    (void)state;
    epipe_comm *c;
    double t0 = now_s();
    int rc = epipe_comm_create_tcp(&c, 1, 2, "127.0.0.1", test_free_port(), "init_timeout_ms=400");
    print_message("%s\n", epipe_last_error());
    assert_int_equal(rc, EPIPE_ETIMEDOUT);
    assert_true(now_s() - t0 < 3.0);
    assert_non_null(strstr(epipe_last_error(), "master"));
    assert_non_null(strstr(epipe_last_error(), "refused"));
}

static void test_world_size_mismatch(void **state)
{
    (void)state;
    struct rank_arg a0, a1;
    unsigned port = test_free_port();
    start_rank(&a0, 0, 2, port, "init_timeout_ms=3000");
    start_rank(&a1, 1, 3, port, "init_timeout_ms=3000");
    pthread_join(a0.th, NULL);
    pthread_join(a1.th, NULL);
    assert_int_equal(a0.rc, EPIPE_EINVAL);
    assert_int_equal(a1.rc, EPIPE_EINVAL);
    assert_non_null(strstr(a0.err, "world size"));
    assert_non_null(strstr(a1.err, "world size"));
    assert_true(a0.seconds < 2.5 && a1.seconds < 2.5);
}

/* Captures what libepipe logs to stderr. */
static int saved_stderr = -1;
static FILE *capture;

static void capture_begin(void)
{
    fflush(stderr);
    capture = tmpfile();
    saved_stderr = dup(2);
    dup2(fileno(capture), 2);
}

static char *capture_end(void)
{
    fflush(stderr);
    dup2(saved_stderr, 2);
    close(saved_stderr);
    static char buf[8192];
    rewind(capture);
    size_t n = fread(buf, 1, sizeof buf - 1, capture);
    buf[n] = '\0';
    fclose(capture);
    fprintf(stderr, "%s", buf); /* keep it visible in the test log */
    return buf;
}

static void test_garbage_and_version(void **state)
{
    (void)state;
    capture_begin();
    struct rank_arg a0, a1;
    unsigned port = test_free_port();
    start_rank(&a0, 0, 2, port, "init_timeout_ms=5000");
    /* Garbage, then a message of another wire version, then silence. */
    int g = connect_to(port);
    const char junk[] = "GET / HTTP/1.0\r\n\r\n";
    assert_true(write(g, junk, sizeof junk) > 0);
    uint8_t hdr[EPIPE_WIRE_HEADER_SIZE];
    epipe_wire_header h;
    memset(&h, 0, sizeof h);
    h.kind = EPIPE_WIRE_HELLO;
    h.src_stage = 1;
    assert_int_equal(epipe_wire_encode_header(&h, hdr, sizeof hdr), EPIPE_OK);
    hdr[4] = 2; /* version 2, and a header CRC that matches it */
    uint32_t crc = epipe_crc32c(0, hdr, sizeof hdr - 4);
    memcpy(hdr + sizeof hdr - 4, &crc, 4);
    int v = connect_to(port);
    assert_true(write(v, hdr, sizeof hdr) == (ssize_t)sizeof hdr);
    int silent = connect_to(port);
    usleep(100000);
    start_rank(&a1, 1, 2, port, "init_timeout_ms=5000");
    pthread_join(a0.th, NULL);
    pthread_join(a1.th, NULL);
    char *log = capture_end();
    assert_int_equal(a0.rc, EPIPE_OK);
    assert_int_equal(a1.rc, EPIPE_OK);
    assert_non_null(strstr(log, "refused the connection"));
    assert_non_null(strstr(log, "magic"));
    assert_non_null(strstr(log, "wire version 2"));
    epipe_comm_destroy(a0.c);
    epipe_comm_destroy(a1.c);
    close(g);
    close(v);
    close(silent);
}

/* A master that answers in wire version 2: the client says so. */
static void *fake_master(void *p)
{
    int lfd = *(int *)p;
    int fd = accept(lfd, NULL, NULL);
    uint8_t buf[4096];
    ssize_t n = read(fd, buf, sizeof buf);
    (void)n;
    uint8_t hdr[EPIPE_WIRE_HEADER_SIZE];
    epipe_wire_header h;
    memset(&h, 0, sizeof h);
    h.kind = EPIPE_WIRE_HELLO;
    epipe_wire_encode_header(&h, hdr, sizeof hdr);
    hdr[4] = 2;
    uint32_t crc = epipe_crc32c(0, hdr, sizeof hdr - 4);
    memcpy(hdr + sizeof hdr - 4, &crc, 4);
    n = write(fd, hdr, sizeof hdr);
    usleep(200000);
    close(fd);
    return NULL;
}

static void test_master_version(void **state)
{
    (void)state;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    listen(lfd, 4);
    getsockname(lfd, (struct sockaddr *)&a, &len);
    pthread_t th;
    pthread_create(&th, NULL, fake_master, &lfd);
    epipe_comm *c;
    int rc = epipe_comm_create_tcp(&c, 1, 2, "127.0.0.1", ntohs(a.sin_port),
                                   "init_timeout_ms=3000");
    pthread_join(th, NULL);
    close(lfd);
    print_message("%s\n", epipe_last_error());
    assert_int_equal(rc, EPIPE_EVERSION);
    assert_non_null(strstr(epipe_last_error(), "version 2"));
    assert_non_null(strstr(epipe_last_error(), "master"));
}

/* ---- authentication ----------------------------------------------------- */

static void write_key(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_auth(void **state)
{
    (void)state;
    char ka[] = "/tmp/epipe-key-a-XXXXXX", kb[] = "/tmp/epipe-key-b-XXXXXX";
    close(mkstemp(ka));
    close(mkstemp(kb));
    write_key(ka, "correct horse battery staple, 32+");
    write_key(kb, "a different secret of some length");
    char oa[128], ob[128];
    snprintf(oa, sizeof oa, "init_timeout_ms=1500,key_file=%s", ka);
    snprintf(ob, sizeof ob, "init_timeout_ms=1500,key_file=%s", kb);
#ifdef EPIPE_HAVE_SODIUM
    /* The same key: a working group. */
    epipe_comm *c[3];
    make_group(c, 3, oa);
    assert_int_equal(epipe_comm_send(c[2], 1, make_act(2, 1, 1, 0, 1000, 5)), EPIPE_OK);
    recv_act(c[1], 2, 1, 0, 1000, 5);
    for (int r = 0; r < 3; r++)
        epipe_comm_destroy(c[r]);

    /* A wrong key: refused on both sides, and rank 0 says why. */
    capture_begin();
    struct rank_arg a0, a1;
    unsigned port = test_free_port();
    start_rank(&a0, 0, 2, port, oa);
    start_rank(&a1, 1, 2, port, ob);
    pthread_join(a0.th, NULL);
    pthread_join(a1.th, NULL);
    char *log = capture_end();
    assert_int_equal(a1.rc, EPIPE_EAUTH);
    assert_non_null(strstr(a1.err, "key"));
    assert_int_equal(a0.rc, EPIPE_ETIMEDOUT);
    assert_non_null(strstr(a0.err, "refused"));
    assert_non_null(strstr(log, "refused"));

    /* No key against a keyed rank 0. */
    port = test_free_port();
    start_rank(&a0, 0, 2, port, oa);
    start_rank(&a1, 1, 2, port, "init_timeout_ms=1500");
    pthread_join(a0.th, NULL);
    pthread_join(a1.th, NULL);
    assert_int_equal(a1.rc, EPIPE_EAUTH);
    assert_non_null(strstr(a1.err, "requires"));
    assert_int_equal(a0.rc, EPIPE_ETIMEDOUT);

    /* A key file too short to be a key. */
    write_key(kb, "short");
    epipe_comm *x;
    assert_int_equal(epipe_comm_create_tcp(&x, 0, 2, "127.0.0.1", test_free_port(), ob),
                     EPIPE_EINVAL);
#else
    epipe_comm *x;
    assert_int_equal(epipe_comm_create_tcp(&x, 0, 2, "127.0.0.1", test_free_port(), oa),
                     EPIPE_ENOTSUP);
    assert_non_null(strstr(epipe_last_error(), "libsodium"));
#endif
    unlink(ka);
    unlink(kb);
}

/* ---- faults after init -------------------------------------------------- */

/* Small and large (checksummed by the helper thread, which must let go). */
static void cut_mid_message(size_t floats)
{
    epipe_comm *c[2];
    make_group(c, 2, "timeout_ms=5000");
    epipe_msg *m = make_act(1, 0, 3, 0, floats, 7);
    assert_int_equal(epipe_tcp_debug_send_raw(c[1], 0, m->data, m->len / 2, 1), EPIPE_OK);
    epipe_msg_free(m);
    epipe_msg *got;
    double t0 = now_s();
    int rc = epipe_comm_recv(c[0], 1, EPIPE_WIRE_ACTIVATION, 3, 0, 5000, &got);
    assert_int_equal(rc, EPIPE_EPEER);
    assert_true(now_s() - t0 < 3.0); /* at once; generous for loaded CI */
    assert_non_null(strstr(epipe_comm_last_error(c[0]), "middle of a message"));
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

static void test_cut_mid_message(void **state)
{
    (void)state;
    cut_mid_message(100000);
    cut_mid_message(3u << 20);
}

/* A rank that closes right after a large send to a peer that is not
 * reading (stopped with SIGSTOP, resumed 300 ms into the close): the close
 * waits and the peer gets it all. The race this guards against (closing
 * with unread data in the receive buffer, a heartbeat, sends an RST that
 * makes the peer drop the tail still in its buffers; since the fix the close
 * waits for the peer's own close) showed over a 100 Mbit/s shaped link
 * (scripts/experiments/plan_validation.py); on loopback it did not
 * reproduce, so this test checks the waiting, not the race. */
static void *resume_later(void *p)
{
    usleep(300000);
    kill(*(pid_t *)p, SIGCONT);
    return NULL;
}

static void test_close_after_large_send(void **state)
{
    (void)state;
    const size_t n = (size_t)8 << 20; /* 32 MB */
    for (int round = 0; round < 3; round++) {
        unsigned port = test_free_port();
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) { /* rank 1: stop once connected, then read it all */
            epipe_comm *c;
            if (epipe_comm_create_tcp(&c, 1, 2, "127.0.0.1", port,
                                      "timeout_ms=20000,heartbeat_ms=1"))
                _exit(2);
            raise(SIGSTOP);
            epipe_msg *m;
            int rc = epipe_comm_recv(c, 0, EPIPE_WIRE_ACTIVATION, 5, 0, 20000, &m);
            if (rc) {
                fprintf(stderr, "rank 1: %s\n", epipe_comm_last_error(c));
                _exit(3);
            }
            float *want = malloc(n * sizeof *want);
            test_fill(want, n, DIST_NORMAL, 11);
            int same = m->hdr.shape[0] == n &&
                       !memcmp(m->data + m->hdr.header_len + 16, want, n * sizeof *want);
            epipe_msg_free(m);
            free(want);
            epipe_comm_destroy(c);
            _exit(same ? 0 : 4);
        }
        epipe_comm *c;
        assert_int_equal(epipe_comm_create_tcp(&c, 0, 2, "127.0.0.1", port, "timeout_ms=20000"),
                         EPIPE_OK);
        int st;
        assert_int_equal(waitpid(pid, &st, WUNTRACED), pid); /* stopped */
        assert_true(WIFSTOPPED(st));
        assert_int_equal(epipe_comm_send(c, 1, make_act(0, 1, 5, 0, n, 11)), EPIPE_OK);
        pthread_t th;
        pthread_create(&th, NULL, resume_later, &pid);
        epipe_comm_destroy(c); /* returns once rank 1 has it all */
        pthread_join(th, NULL);
        assert_int_equal(waitpid(pid, &st, 0), pid);
        if (!WIFEXITED(st) || WEXITSTATUS(st))
            fail_msg("round %d: rank 1 ended with status %d (3: the message was cut, 4: it "
                     "differs)",
                     round, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    if (argc > 1) /* one test by name (a pattern), for valgrind and debugging */
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_env_precedence),
        cmocka_unit_test(test_env_sources_alone),
        cmocka_unit_test(test_first_host),
        cmocka_unit_test(test_options),
        cmocka_unit_test(test_close_after_large_send),
        cmocka_unit_test(test_fork_child_gives_up_the_connections),
        cmocka_unit_test(test_from_env),
        cmocka_unit_test(test_streams_mesh),
        cmocka_unit_test(test_pipeline_topology),
        cmocka_unit_test(test_listen_choice),
        cmocka_unit_test(test_port_in_use),
        cmocka_unit_test(test_unreachable_master),
        cmocka_unit_test(test_accept_out_of_descriptors),
        cmocka_unit_test(test_accept_flood_out_of_descriptors),
        cmocka_unit_test(test_world_size_mismatch),
        cmocka_unit_test(test_garbage_and_version),
        cmocka_unit_test(test_master_version),
        cmocka_unit_test(test_auth),
        cmocka_unit_test(test_cut_mid_message),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
