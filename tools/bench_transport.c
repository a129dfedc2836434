/* epipe-bench transport: TCP or RDMA transport throughput and one-way latency
 * over loopback, each against a raw-socket stream of the same sizes in one run. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <epipe/epipe.h>

#include "bench.h"
#include "cli.h"
#include "codec/payload.h"
#include "comm/comm_impl.h"
#include "tensor.h"

struct cfg {
    size_t sizes[32];
    int nsizes;
    int json, quick, reps, raw_hot;
    unsigned streams;
    int spin_us;
    const char *options;   /* appended to the transport options */
    const char *compare;   /* a second communicator's extra options, or NULL */
    const char *transport; /* tcp (default) or rdma */
};

struct peer {
    int rank;
    epipe_comm *comm;
    epipe_comm *comm2; /* --compare: the other communicator */
    int raw;           /* raw socket to the other process */
    epipe_codec *none;
    float *src;      /* the tensor sent, largest size */
    uint8_t *rawbuf; /* raw socket buffer, largest size */
    uint32_t phase;  /* tags every phase's messages (micro-batch field) */
    int raw_hot;     /* raw sends from one buffer (stays in cache) */
    double cpu;      /* CPU seconds (user + system, this process) of the last stream */
};

static double cpu_now(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    double v = strtod(s, &end);
    size_t mul = 1;
    if (*end == 'K' || *end == 'k')
        mul = 1024, end++;
    else if (*end == 'M' || *end == 'm')
        mul = 1024 * 1024, end++;
    if (*end || v * (double)mul < 4 || v * (double)mul > (double)(1u << 30))
        return -1;
    *out = (size_t)(v * (double)mul) / 4 * 4;
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: epipe-bench transport [--json] [--sizes 4,4K,64K,1M,4M,64M] [--streams N]\n"
            "                             [--transport tcp|rdma]\n"
            "                             [--spin-us US] [--reps R] [--quick] [--raw-hot]\n"
            "                             [--options SPEC] [--compare SPEC]\n"
            "Two processes on loopback: for each message size (tensor bytes), streaming\n"
            "throughput and one-way latency (ping-pong / 2) of the TCP transport and of a raw\n"
            "TCP socket moving the same bytes. Transport messages are built (codec none, sealed)\n"
            "before the clock starts; timed is epipe_comm_send to the checked message returned\n"
            "by epipe_comm_recv in the other process. Best of R repetitions (default 3) of\n"
            "each. --quick moves less data (for tests). The raw sender sends from the\n"
            "payloads of as many distinct messages as the transport's, built the same way\n"
            "(not from one buffer that stays in cache); --raw-hot sends from one buffer.\n"
            "--options adds TCP options (\"key_file=K\"); --compare SPEC also measures a\n"
            "second communicator with SPEC added (\"encrypt=1\"), alternating with the first\n"
            "in every repetition; its rows say how it compares with the first.\n"
            "--transport rdma measures the rdma transport (EPIPE_IBVERBS_LIB picks the verbs\n"
            "library: the test provider measures protocol overhead); messages_per_s and\n"
            "cpu_us_per_message (the sending process, progress threads included) come from\n"
            "the streaming phase.\n");
}

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) ||
        getsockname(fd, (struct sockaddr *)&a, &len))
        return -1;
    close(fd);
    return ntohs(a.sin_port);
}

static int raw_io(int fd, void *buf, size_t n, int wr)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t k = wr ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k, n -= (size_t)k;
    }
    return 0;
}

/* A message as the stage builds it: codec none encodes `bytes` of src. */
static epipe_msg *make_msg(struct peer *p, unsigned kind, uint64_t step, size_t bytes)
{
    int64_t shape = (int64_t)(bytes / 4);
    DLTensor t = {.data = p->src,
                  .device = {kDLCPU, 0},
                  .ndim = 1,
                  .dtype = {kDLFloat, 32, 1},
                  .shape = &shape};
    size_t cap, len;
    if (epipe_codec_max_encoded_size(p->none, &t, &cap))
        return NULL;
    epipe_msg *m = epipe_comm_msg_new(p->comm, cap);
    if (!m)
        return NULL;
    if (epipe_codec_encode(p->none, &t, epipe_msg_payload(m), cap, &len)) {
        epipe_msg_free(m);
        return NULL;
    }
    epipe_payload_header ph;
    epipe_payload_get(epipe_msg_payload(m), len, &ph);
    memset(&m->hdr, 0, sizeof m->hdr);
    m->hdr.kind = (uint8_t)kind;
    m->hdr.dtype = ph.dtype;
    m->hdr.ndim = 1;
    m->hdr.shape[0] = (uint64_t)shape;
    m->hdr.codec_id = ph.codec_id;
    m->hdr.codec_param = ph.param_word;
    m->hdr.micro_batch = p->phase;
    m->hdr.step = step;
    m->hdr.src_stage = (uint32_t)p->rank;
    m->hdr.dst_stage = (uint32_t)(1 - p->rank);
    if (epipe_msg_seal(m, len)) {
        epipe_msg_free(m);
        return NULL;
    }
    return m;
}

/* Builds `n` sealed messages before a timed phase: what is timed is the
 * transport (send of a sealed message to its checked receipt), not the
 * codec and framing that make the message. */
static epipe_msg **prebuild(struct peer *p, unsigned kind, size_t n, size_t bytes)
{
    epipe_msg **ms = calloc(n, sizeof *ms);
    for (size_t i = 0; ms && i < n; i++)
        if (!(ms[i] = make_msg(p, kind, i, bytes))) {
            while (i--)
                epipe_msg_free(ms[i]);
            free(ms);
            return NULL;
        }
    return ms;
}

static void free_msgs(epipe_msg **ms, size_t from, size_t n)
{
    for (size_t i = from; ms && i < n; i++)
        epipe_msg_free(ms[i]);
    free(ms);
}

static int tsend_msg(struct peer *p, epipe_msg *m)
{
    int rc = epipe_comm_send(p->comm, (unsigned)(1 - p->rank), m);
    if (rc)
        fprintf(stderr, "epipe-bench transport: %s\n", epipe_comm_last_error(p->comm));
    return rc;
}

static int tsend(struct peer *p, unsigned kind, uint64_t step, size_t bytes)
{
    epipe_msg *m = make_msg(p, kind, step, bytes);
    return m ? tsend_msg(p, m) : -1;
}

static int trecv(struct peer *p, unsigned kind, uint64_t step)
{
    epipe_msg *m;
    int rc = epipe_comm_recv(p->comm, (unsigned)(1 - p->rank), kind, step, p->phase, 60000, &m);
    if (rc) {
        fprintf(stderr, "epipe-bench transport: %s\n", epipe_comm_last_error(p->comm));
        return rc;
    }
    epipe_msg_free(m);
    return 0;
}

/* Each function runs on both ranks; rank 0 returns the seconds taken. */
static double tcp_stream(struct peer *p, size_t bytes, size_t count)
{
    size_t every = (16u << 20) / bytes; /* flow control: an ack per ~16 MiB */
    if (every < 1)
        every = 1;
    if (every > count)
        every = count;
    p->phase++;
    epipe_msg **ms = p->rank == 0 ? prebuild(p, EPIPE_WIRE_ACTIVATION, count, bytes) : NULL;
    if (p->rank == 0 && !ms)
        return -1;
    size_t sent = 0;
    double t0 = bench_now(), dt = -1, c0 = cpu_now();
    if (p->rank == 0) {
        size_t acked = 0;
        for (; sent < count; sent++) {
            while (sent - acked >= 2 * every) {
                size_t next = acked + every < count ? acked + every : count;
                if (trecv(p, EPIPE_WIRE_GRADIENT, next))
                    goto out;
                acked = next;
            }
            ms[sent]->hdr.micro_batch = p->phase; /* re-sealed: the header changed */
            epipe_wire_encode_header(&ms[sent]->hdr, ms[sent]->data, EPIPE_WIRE_HEADER_SIZE);
            if (tsend_msg(p, ms[sent]))
                goto out;
        }
        while (acked < count) {
            size_t next = acked + every < count ? acked + every : count;
            if (trecv(p, EPIPE_WIRE_GRADIENT, next))
                goto out;
            acked = next;
        }
    } else {
        for (size_t i = 0; i < count; i++) {
            if (trecv(p, EPIPE_WIRE_ACTIVATION, i))
                goto out;
            if (((i + 1) % every == 0 || i + 1 == count) && tsend(p, EPIPE_WIRE_GRADIENT, i + 1, 4))
                goto out;
        }
    }
    dt = bench_now() - t0;
    p->cpu = cpu_now() - c0;
out:
    free_msgs(ms, sent + (dt < 0 && sent < count), count);
    return dt;
}

/* The memory a raw send reads: by default the payload of one of `n` distinct
 * messages built before the clock, as the transport's sends read, so that
 * neither side sends from a buffer that stays in cache while the other
 * streams from memory (at 1-4 MiB a single buffer fits in the L3 cache, and
 * 64 messages of 4 MiB do not). --raw-hot sends from one buffer instead. */
static epipe_msg **raw_sources(struct peer *p, size_t n, size_t bytes)
{
    return p->raw_hot ? NULL : prebuild(p, EPIPE_WIRE_ACTIVATION, n, bytes);
}

static uint8_t *raw_src(struct peer *p, epipe_msg **ms, size_t i)
{
    return ms ? (uint8_t *)epipe_msg_payload(ms[i]) : p->rawbuf;
}

static double raw_stream(struct peer *p, size_t bytes, size_t count)
{
    epipe_msg **ms = p->rank == 0 ? raw_sources(p, count, bytes) : NULL;
    if (p->rank == 0 && !p->raw_hot && !ms)
        return -1;
    double t0 = bench_now(), dt = -1;
    uint8_t ack = 1;
    for (size_t i = 0; i < count; i++)
        if (raw_io(p->raw, p->rank == 0 ? raw_src(p, ms, i) : p->rawbuf, bytes, p->rank == 0))
            goto out;
    if (raw_io(p->raw, &ack, 1, p->rank == 1))
        goto out;
    dt = bench_now() - t0;
out:
    free_msgs(ms, 0, ms ? count : 0);
    return dt;
}

static double tcp_pingpong(struct peer *p, size_t bytes, size_t iters)
{
    p->phase++;
    unsigned kind = p->rank == 0 ? EPIPE_WIRE_ACTIVATION : EPIPE_WIRE_GRADIENT;
    epipe_msg **ms = prebuild(p, kind, iters, bytes);
    if (!ms)
        return -1;
    size_t i = 0;
    double t0 = bench_now(), dt = -1;
    for (; i < iters; i++) {
        ms[i]->hdr.micro_batch = p->phase;
        epipe_wire_encode_header(&ms[i]->hdr, ms[i]->data, EPIPE_WIRE_HEADER_SIZE);
        if (p->rank == 0) {
            if (tsend_msg(p, ms[i]) || trecv(p, EPIPE_WIRE_GRADIENT, i))
                goto out;
        } else {
            if (trecv(p, EPIPE_WIRE_ACTIVATION, i) || tsend_msg(p, ms[i]))
                goto out;
        }
    }
    dt = bench_now() - t0;
out:
    free_msgs(ms, i + (dt < 0 && i < iters), iters);
    return dt;
}

static double raw_pingpong(struct peer *p, size_t bytes, size_t iters)
{
    epipe_msg **ms = raw_sources(p, iters, bytes);
    if (!p->raw_hot && !ms)
        return -1;
    double t0 = bench_now(), dt = -1;
    for (size_t i = 0; i < iters; i++) {
        int first = p->rank == 0;
        uint8_t *src = raw_src(p, ms, i);
        if (raw_io(p->raw, first ? src : p->rawbuf, bytes, first) ||
            raw_io(p->raw, first ? p->rawbuf : src, bytes, !first))
            goto out;
    }
    dt = bench_now() - t0;
out:
    free_msgs(ms, 0, ms ? iters : 0);
    return dt;
}

static void swap_comms(struct peer *p)
{
    if (p->comm2) {
        epipe_comm *x = p->comm;
        p->comm = p->comm2, p->comm2 = x;
    }
}

static double best(double a, double b)
{
    return a < 0 ? b : b < 0 ? a : a < b ? a : b;
}

static int run(struct peer *p, const struct cfg *c)
{
    for (int si = 0; si < c->nsizes; si++) {
        size_t s = c->sizes[si];
        size_t budget = c->quick ? (8u << 20) : (256u << 20);
        size_t count = budget / s < 8 ? 8 : budget / s;
        if (count > (c->quick ? 20000u : 200000u))
            count = c->quick ? 20000u : 200000u;
        size_t iters = s <= 65536 ? (c->quick ? 200 : 2000)
                       : ((c->quick ? 16u : 128u) << 20) / s < 4
                           ? 4
                           : ((c->quick ? 16u : 128u) << 20) / s;
        double ts[2] = {-1, -1}, rs = -1, tl[2] = {-1, -1}, rl = -1, cpu[2] = {-1, -1};
        int ncomm = p->comm2 ? 2 : 1;
        /* A warm-up of each, then the repetitions, alternating them. */
        for (int k = 0; k < ncomm; k++, swap_comms(p))
            tcp_stream(p, s, count / 8 + 1);
        raw_stream(p, s, count / 8 + 1);
        for (int r = 0; r < c->reps; r++) {
            double a = raw_stream(p, s, count);
            if (a < 0)
                return -1;
            rs = best(rs, a);
            for (int k = 0; k < ncomm; k++, swap_comms(p)) {
                double b = tcp_stream(p, s, count);
                if (b < 0)
                    return -1;
                ts[k] = best(ts[k], b);
                cpu[k] = best(cpu[k], p->cpu);
            }
        }
        for (int k = 0; k < ncomm; k++, swap_comms(p))
            tcp_pingpong(p, s, iters / 8 + 1);
        raw_pingpong(p, s, iters / 8 + 1);
        for (int r = 0; r < c->reps; r++) {
            double a = raw_pingpong(p, s, iters);
            if (a < 0)
                return -1;
            rl = best(rl, a);
            for (int k = 0; k < ncomm; k++, swap_comms(p)) {
                double b = tcp_pingpong(p, s, iters);
                if (b < 0)
                    return -1;
                tl[k] = best(tl[k], b);
            }
        }
        if (p->rank != 0)
            continue;
        double mb = (double)s * (double)count / 1e6;
        double rtput = mb / rs, rlat = rl / (double)iters / 2 * 1e6;
        for (int k = 0; k < ncomm; k++) {
            double tput = mb / ts[k], lat = tl[k] / (double)iters / 2 * 1e6;
            double vs_t = ts[0] / ts[k], vs_l = tl[k] / tl[0];
            char name[160];
            int n = snprintf(name, sizeof name, "%s", c->transport);
            if (c->streams > 1)
                n += snprintf(name + n, sizeof name - (size_t)n, ":streams=%u", c->streams);
            if (k == 1)
                snprintf(name + n, sizeof name - (size_t)n, "%s%s", c->streams > 1 ? "," : ":",
                         c->compare);
            if (c->json)
                printf("{\"bench\":\"transport\",\"transport\":\"%s\",\"size\":%zu,"
                       "\"messages\":%zu,\"streams\":%u,\"spin_us\":%d,"
                       "\"mbytes_per_s\":%.1f,\"raw_mbytes_per_s\":%.1f,\"throughput_ratio\":%.3f,"
                       "\"latency_us\":%.2f,\"raw_latency_us\":%.2f,\"latency_ratio\":%.3f,"
                       "\"messages_per_s\":%.0f,\"cpu_us_per_message\":%.3f%s",
                       name, s, count, c->streams, c->spin_us, tput, rtput, tput / rtput, lat, rlat,
                       lat / rlat, (double)count / ts[k], cpu[k] / (double)count * 1e6,
                       k ? "" : "}\n");
            else
                printf("%-14s %9zu B  %9.1f MB/s  raw %9.1f MB/s  (%.2fx)   one-way %8.2f us  "
                       "raw %8.2f us  (%.2fx)  %.0f msg/s  %.2f us CPU/msg%s",
                       name, s, tput, rtput, tput / rtput, lat, rlat, lat / rlat,
                       (double)count / ts[k], cpu[k] / (double)count * 1e6, k ? "" : "\n");
            if (k && c->json)
                printf(",\"vs_first_throughput\":%.3f,\"vs_first_latency\":%.3f}\n", vs_t, vs_l);
            else if (k)
                printf("   vs tcp: throughput %.2fx, latency %.2fx\n", vs_t, vs_l);
        }
        fflush(stdout);
    }
    return 0;
}

int bench_transport_main(int argc, char **argv)
{
    struct cfg c = {.reps = 3, .streams = 1, .spin_us = 50, .transport = "tcp"};
    const char *sizes = "4,4K,16K,64K,256K,1M,4M,16M,64M";
    enum {
        O_JSON = 256,
        O_QUICK,
        O_RAW_HOT,
        O_SIZES,
        O_SPIN_US,
        O_STREAMS,
        O_REPS,
        O_OPTIONS,
        O_COMPARE,
        O_TRANSPORT
    };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, O_JSON},
        {"quick", no_argument, NULL, O_QUICK},
        {"raw-hot", no_argument, NULL, O_RAW_HOT},
        {"sizes", required_argument, NULL, O_SIZES},
        {"spin-us", required_argument, NULL, O_SPIN_US},
        {"streams", required_argument, NULL, O_STREAMS},
        {"reps", required_argument, NULL, O_REPS},
        {"options", required_argument, NULL, O_OPTIONS},
        {"compare", required_argument, NULL, O_COMPARE},
        {"transport", required_argument, NULL, O_TRANSPORT},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    while ((opt = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
        switch (opt) {
        case 'h': usage(stdout); return 0;
        case O_JSON: c.json = 1; break;
        case O_QUICK: c.quick = 1; break;
        case O_RAW_HOT: c.raw_hot = 1; break;
        case O_SIZES: sizes = optarg; break;
        case O_SPIN_US:
            EPIPE_CLI_INT("epipe-bench transport", "--spin-us", 0, 1000000, c.spin_us);
            break;
        case O_STREAMS: EPIPE_CLI_INT("epipe-bench transport", "--streams", 1, 8, c.streams); break;
        case O_REPS: EPIPE_CLI_INT("epipe-bench transport", "--reps", 1, 1000000, c.reps); break;
        case O_OPTIONS: c.options = optarg; break;
        case O_COMPARE: c.compare = optarg; break;
        case O_TRANSPORT: c.transport = optarg; break;
        default: /* ':' or '?' */
            epipe_cli_bad_option("epipe-bench transport", argv, opt);
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "epipe-bench transport: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    char buf[512];
    snprintf(buf, sizeof buf, "%s", sizes);
    for (char *save, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (c.nsizes == 32 || parse_size(t, &c.sizes[c.nsizes++])) {
            fprintf(stderr, "epipe-bench transport: bad size '%s' (4 .. 1G, with K or M)\n", t);
            return 2;
        }
    }
    if (strcmp(c.transport, "tcp") && strcmp(c.transport, "rdma")) {
        fprintf(stderr, "epipe-bench transport: --transport '%s' is not tcp or rdma\n",
                c.transport);
        return 2;
    }
    if (c.reps < 1 || c.streams < 1 || c.streams > 8 || !c.nsizes) {
        usage(stderr);
        return 2;
    }
    size_t maxs = 0;
    for (int i = 0; i < c.nsizes; i++)
        maxs = c.sizes[i] > maxs ? c.sizes[i] : maxs;
    int port = free_port(), raw_port = free_port(), port2 = c.compare ? free_port() : 0;
    if (port < 0 || raw_port < 0 || port2 < 0) {
        fprintf(stderr, "epipe-bench transport: no free port on 127.0.0.1\n");
        return 1;
    }
    char opts[1024], opts2[2048];
    snprintf(opts, sizeof opts, "streams=%u,spin_us=%d,timeout_ms=60000,init_timeout_ms=20000%s%s",
             c.streams, c.spin_us, c.options ? "," : "", c.options ? c.options : "");
    snprintf(opts2, sizeof opts2, "%s,%s", opts, c.compare ? c.compare : "");

    /* The raw listener exists before the fork, so the parent's connect finds it. */
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)raw_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 1)) {
        fprintf(stderr, "epipe-bench transport: raw listener: %s\n", strerror(errno));
        return 1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    struct peer p = {.rank = pid == 0 ? 1 : 0, .raw = -1, .raw_hot = c.raw_hot};
    p.src = calloc(maxs / 4 + 1, sizeof(float));
    p.rawbuf = calloc(maxs + 1, 1);
    for (size_t i = 0; p.src && i < maxs / 4; i++)
        p.src[i] = (float)(i % 1000) * 0.001f;
    int rc = p.src && p.rawbuf ? epipe_codec_create(&p.none, "none") : EPIPE_ENOMEM;
    if (rc == EPIPE_OK)
        rc = epipe_comm_create(&p.comm, c.transport, (unsigned)p.rank, 2, "127.0.0.1",
                               (unsigned)port, opts);
    if (rc == EPIPE_OK && c.compare)
        rc = epipe_comm_create(&p.comm2, c.transport, (unsigned)p.rank, 2, "127.0.0.1",
                               (unsigned)port2, opts2);
    if (rc) {
        fprintf(stderr, "epipe-bench transport: rank %d: %s\n", p.rank, epipe_last_error());
    } else if (p.rank == 1) {
        p.raw = accept(lfd, NULL, NULL);
    } else {
        p.raw = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(p.raw, (struct sockaddr *)&a, sizeof a)) {
            close(p.raw);
            p.raw = -1;
        }
    }
    close(lfd);
    if (rc == EPIPE_OK && p.raw < 0) {
        fprintf(stderr, "epipe-bench transport: raw socket: %s\n", strerror(errno));
        rc = EPIPE_EIO;
    }
    if (rc == EPIPE_OK) {
        setsockopt(p.raw, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (p.rank == 0 && !c.json)
            printf("%s transport over loopback: two processes, best of %d, streams %u\n",
                   c.transport, c.reps, c.streams);
        if (run(&p, &c))
            rc = EPIPE_EIO;
    }
    if (p.raw >= 0)
        close(p.raw);
    epipe_comm_destroy(p.comm);
    epipe_comm_destroy(p.comm2);
    epipe_codec_destroy(p.none);
    free(p.src);
    free(p.rawbuf);
    if (p.rank == 1)
        _exit(rc ? 1 : 0);
    int st = 0;
    if (rc)
        kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return rc || !WIFEXITED(st) || WEXITSTATUS(st) ? 1 : 0;
}
