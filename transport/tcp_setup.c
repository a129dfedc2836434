/* TCP connection setup: sockets, the HELLO handshake (with optional
 * challenge-response authentication) and the rendezvous at rank 0. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../lib/log.h"
#include "tcp_impl.h"

/* The HELLO payload (docs/transport.md): 152 bytes, little-endian. */
#define HELLO_MAGIC "EPTH"
#define HELLO_VERSION 2
#define HELLO_SIZE 152
#define TABLE_ENTRY 72
/* The most an unauthenticated peer can make this rank allocate for one
 * message: a hello or a refusal's text. Only the rank table, read from rank 0
 * on the connection this rank opened and authenticated, may be larger. */
#define HS_MAX_UNAUTH 1024
#define MAX_PENDING 64

enum { HT_REGISTER = 1, HT_CONNECT, HT_CHALLENGE, HT_PROOF, HT_WELCOME, HT_TABLE, HT_READY, HT_GO };
#define HF_AUTH 1u

struct hello {
    uint8_t type, flags;
    uint32_t rank, size, stream;
    uint16_t port;
    char addr[EPIPE_TCP_ADDR_MAX];
    uint8_t nonce[EPIPE_TCP_NONCE], mac[EPIPE_TCP_MAC];
};

static void put_u16(uint8_t *p, unsigned v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8);
}
static unsigned get_u16(const uint8_t *p)
{
    return p[0] | (unsigned)p[1] << 8;
}
static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p)
{
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void hello_encode(const struct hello *h, uint8_t *p)
{
    memset(p, 0, HELLO_SIZE);
    memcpy(p, HELLO_MAGIC, 4);
    p[4] = h->type;
    p[5] = h->flags;
    put_u16(p + 6, HELLO_VERSION);
    put_u32(p + 8, h->rank);
    put_u32(p + 12, h->size);
    put_u32(p + 16, h->stream);
    put_u16(p + 20, h->port);
    memcpy(p + 24, h->addr, strnlen(h->addr, EPIPE_TCP_ADDR_MAX - 1));
    memcpy(p + 88, h->nonce, EPIPE_TCP_NONCE);
    memcpy(p + 120, h->mac, EPIPE_TCP_MAC);
}

static int hello_decode(const uint8_t *p, size_t len, struct hello *h)
{
    memset(h, 0, sizeof *h);
    if (len < HELLO_SIZE)
        return epipe_fail(EPIPE_EPROTO, "hello payload is %zu bytes, fewer than %d", len, HELLO_SIZE);
    if (memcmp(p, HELLO_MAGIC, 4))
        return epipe_fail(EPIPE_EPROTO, "hello payload has a bad magic");
    if (get_u16(p + 6) != HELLO_VERSION)
        return epipe_fail(EPIPE_EVERSION, "hello version %u; this library speaks %d",
                          get_u16(p + 6), HELLO_VERSION);
    h->type = p[4];
    h->flags = p[5];
    h->rank = get_u32(p + 8);
    h->size = get_u32(p + 12);
    h->stream = get_u32(p + 16);
    h->port = (uint16_t)get_u16(p + 20);
    memcpy(h->addr, p + 24, EPIPE_TCP_ADDR_MAX - 1);
    memcpy(h->nonce, p + 88, EPIPE_TCP_NONCE);
    memcpy(h->mac, p + 120, EPIPE_TCP_MAC);
    if (h->type < HT_REGISTER || h->type > HT_GO)
        return epipe_fail(EPIPE_EPROTO, "hello type %u is unknown", h->type);
    return EPIPE_OK;
}

/* Prefixes the calling thread's last error: "prefix: previous message". */
__attribute__((format(printf, 2, 3))) static int refail(int status, const char *fmt, ...)
{
    char old[EPIPE_ERRMSG_MAX], pre[EPIPE_ERRMSG_MAX];
    snprintf(old, sizeof old, "%s", epipe_last_error());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    return epipe_fail(status, "%s: %s", pre, old);
}

/* ---- sockets ------------------------------------------------------------ */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int left_ms(int64_t deadline)
{
    int64_t l = deadline - now_ms();
    return l < 0 ? 0 : l > 1000000 ? 1000000 : (int)l;
}

static void set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void sock_text(const struct sockaddr *sa, char *buf, size_t cap)
{
    char host[INET6_ADDRSTRLEN] = "?";
    unsigned port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
        port = ntohs(in->sin_port);
        snprintf(buf, cap, "%s:%u", host, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof host);
        port = ntohs(in->sin6_port);
        snprintf(buf, cap, "[%s]:%u", host, port);
    } else {
        snprintf(buf, cap, "(unknown address family %d)", sa->sa_family);
    }
}

static void host_only(const struct sockaddr *sa, char *buf, size_t cap)
{
    buf[0] = '\0';
    if (sa->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, buf, (socklen_t)cap);
    else if (sa->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, buf, (socklen_t)cap);
}

static int resolve(const char *host, unsigned port, int passive, struct sockaddr_storage *out,
                   socklen_t *len)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    struct addrinfo *res;
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc)
        return epipe_fail(EPIPE_EINVAL, "cannot resolve '%s': %s", host ? host : "(any)",
                          gai_strerror(rc));
    struct addrinfo *pick = res;
    for (struct addrinfo *a = res; a; a = a->ai_next)
        if (a->ai_family == AF_INET) { /* prefer IPv4 when a name has both */
            pick = a;
            break;
        }
    memcpy(out, pick->ai_addr, pick->ai_addrlen);
    *len = pick->ai_addrlen;
    freeaddrinfo(res);
    return EPIPE_OK;
}

static int is_loopback(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)ss)->sin_addr.s_addr) >> 24) == 127;
    if (ss->ss_family == AF_INET6)
        return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)ss)->sin6_addr);
    return 0;
}

/* The first IPv4 address of an interface, else its first IPv6 one. */
static int ifname_addr(const char *ifname, char *out, size_t cap)
{
    struct ifaddrs *ifs;
    if (getifaddrs(&ifs))
        return epipe_fail(EPIPE_EIO, "EPIPE_IFNAME: cannot list interfaces: %s", strerror(errno));
    int found = 0;
    for (int fam = 0; fam < 2 && !found; fam++)
        for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next)
            if (i->ifa_addr && !strcmp(i->ifa_name, ifname) &&
                i->ifa_addr->sa_family == (fam ? AF_INET6 : AF_INET)) {
                host_only(i->ifa_addr, out, cap);
                found = 1;
            }
    freeifaddrs(ifs);
    if (!found)
        return epipe_fail(EPIPE_EINVAL, "EPIPE_IFNAME: interface '%s' has no IP address (or does "
                                        "not exist)", ifname);
    return EPIPE_OK;
}

/* A listening socket on host:port (host NULL: every address of family). */
static int open_listener(const char *host, unsigned port, int family, int *fd_out,
                         unsigned *port_out, char *where, size_t where_cap)
{
    struct sockaddr_storage ss;
    socklen_t len;
    int rc;
    if (host) {
        if ((rc = resolve(host, port, 1, &ss, &len)))
            return rc;
    } else {
        memset(&ss, 0, sizeof ss);
        if (family == AF_INET6) {
            struct sockaddr_in6 *in = (struct sockaddr_in6 *)&ss;
            in->sin6_family = AF_INET6, in->sin6_addr = in6addr_any, in->sin6_port = htons((uint16_t)port);
            len = sizeof *in;
        } else {
            struct sockaddr_in *in = (struct sockaddr_in *)&ss;
            in->sin_family = AF_INET, in->sin_addr.s_addr = htonl(INADDR_ANY), in->sin_port = htons((uint16_t)port);
            len = sizeof *in;
        }
    }
    sock_text((struct sockaddr *)&ss, where, where_cap);
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return epipe_fail(EPIPE_EIO, "cannot create a socket: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, len) != 0) {
        int e = errno;
        close(fd);
        return epipe_fail(EPIPE_EIO, "cannot listen on %s: %s%s", where, strerror(e),
                          e == EADDRINUSE ? " (another job or program holds this port: pick "
                                            "another with EPIPE_MASTER_PORT)"
                          : e == EADDRNOTAVAIL ? " (the address is not one of this host's)"
                                               : "");
    }
    if (listen(fd, 128) != 0) {
        int e = errno;
        close(fd);
        return epipe_fail(EPIPE_EIO, "cannot listen on %s: %s", where, strerror(e));
    }
    len = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &len);
    sock_text((struct sockaddr *)&ss, where, where_cap);
    *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    set_nonblock(fd);
    *fd_out = fd;
    return EPIPE_OK;
}

/* TCP_NODELAY, non-blocking, and a send buffer of at least 4 MiB: the
 * kernel's starting size (16 KiB) makes a caller's direct write of a
 * mid-sized message fall short and go through the progress thread. */
static void tune(int fd)
{
    int one = 1, snd = 0, want = 4 << 20;
    socklen_t len = sizeof snd;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &snd, &len) == 0 && snd < want)
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
    set_nonblock(fd);
}

struct setup;
static int pause_ms(struct setup *s, int ms);

/* Connects to host:port, retrying while nobody listens yet, until deadline;
 * between tries it listens to rank 0 (pause_ms), which may say the rank
 * this one waits for has failed. */
static int connect_retry(struct setup *s, const char *host, unsigned port, int64_t deadline,
                         int *fd_out, const char *who)
{
    struct sockaddr_storage ss;
    socklen_t len;
    int rc = resolve(host, port, 0, &ss, &len);
    if (rc)
        return refail(rc, "cannot connect to %s", who);
    char where[80];
    sock_text((struct sockaddr *)&ss, where, sizeof where);
    int last = 0, backoff = 20;
    for (;;) {
        int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            return epipe_fail(EPIPE_EIO, "cannot create a socket: %s", strerror(errno));
        int err = 0;
        if (connect(fd, (struct sockaddr *)&ss, len) != 0) {
            err = errno;
            if (err == EINPROGRESS) {
                struct pollfd p = {.fd = fd, .events = POLLOUT};
                int n = poll(&p, 1, left_ms(deadline));
                socklen_t el = sizeof err;
                err = 0;
                if (n <= 0)
                    err = ETIMEDOUT;
                else
                    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
            }
        }
        if (!err) {
            tune(fd);
            *fd_out = fd;
            return EPIPE_OK;
        }
        close(fd);
        last = err;
        if (err != ECONNREFUSED && err != ETIMEDOUT && err != ENETUNREACH && err != EHOSTUNREACH &&
            err != ECONNRESET && err != EAGAIN)
            return epipe_fail(EPIPE_EIO, "cannot connect to %s (%s): %s", who, where, strerror(err));
        if (now_ms() + backoff >= deadline)
            break;
        if ((rc = pause_ms(s, backoff)))
            return rc;
        backoff = backoff < 500 ? backoff * 2 : 1000;
    }
    return epipe_fail(EPIPE_ETIMEDOUT, "cannot reach %s: %s, still after retrying until the "
                                       "init timeout (is it running? a firewall?)",
                      who, strerror(last));
}

/* ---- framed messages during setup -------------------------------------- */

/* Reads one whole message, byte-exact (nothing past it leaves the socket). */
struct reader {
    uint8_t hdr[EPIPE_WIRE_HEADER_MAX];
    size_t got, hlen;
    epipe_wire_header h;
    uint8_t *payload;
    size_t pgot;
    int have_header;
    uint64_t limit; /* largest payload accepted (kept by reader_reset) */
};

static void reader_reset(struct reader *r)
{
    free(r->payload);
    r->payload = NULL;
    r->got = r->hlen = r->pgot = 0;
    r->have_header = 0;
}

/* 1: a message is complete in r; 0: would block; < 0: error (set). */
static int reader_step(int fd, struct reader *r)
{
    for (;;) {
        uint8_t *dst;
        size_t want;
        if (!r->have_header) {
            want = (r->hlen ? r->hlen : EPIPE_WIRE_PREFIX_SIZE) - r->got;
            dst = r->hdr + r->got;
        } else {
            want = (size_t)r->h.payload_len - r->pgot;
            dst = r->payload + r->pgot;
        }
        if (want == 0 && r->have_header)
            return 1;
        ssize_t n = recv(fd, dst, want, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (n < 0)
            return epipe_fail(EPIPE_EPEER, "connection error: %s", strerror(errno));
        if (n == 0)
            return epipe_fail(EPIPE_EPEER, "the other side closed the connection%s",
                              r->got || r->have_header ? " in the middle of a message" : "");
        if (r->have_header) {
            r->pgot += (size_t)n;
        } else {
            r->got += (size_t)n;
            int rc;
            if (!r->hlen && r->got == EPIPE_WIRE_PREFIX_SIZE &&
                (rc = epipe_wire_header_length(r->hdr, r->got, &r->hlen)))
                return rc;
            if (r->hlen && r->got == r->hlen) {
                epipe_wire_limits lim = {.max_payload = r->limit ? r->limit : HS_MAX_UNAUTH};
                if ((rc = epipe_wire_parse_header(r->hdr, r->got, &lim, &r->h)))
                    return rc;
                if (r->h.kind != EPIPE_WIRE_HELLO && r->h.kind != EPIPE_WIRE_ERROR)
                    return epipe_fail(EPIPE_EPROTO, "a %s message before the connection was set up",
                                      epipe_wire_kind_name(r->h.kind));
                r->payload = malloc(r->h.payload_len ? (size_t)r->h.payload_len : 1);
                if (!r->payload)
                    return epipe_fail(EPIPE_ENOMEM, "out of memory");
                r->have_header = 1;
            }
        }
        if (r->have_header && r->pgot == r->h.payload_len) {
            int rc = epipe_wire_check_payload(&r->h, r->payload, r->pgot);
            return rc ? rc : 1;
        }
    }
}

static int reader_wait(int fd, struct reader *r, int64_t deadline)
{
    for (;;) {
        int rc = reader_step(fd, r);
        if (rc)
            return rc;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int n = poll(&p, 1, left_ms(deadline));
        if (n == 0)
            return epipe_fail(EPIPE_ETIMEDOUT, "no answer within the init timeout");
        if (n < 0 && errno != EINTR)
            return epipe_fail(EPIPE_EIO, "poll: %s", strerror(errno));
    }
}

static int write_all(int fd, const uint8_t *p, size_t len, int64_t deadline)
{
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n, len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return epipe_fail(EPIPE_EPEER, "send failed: %s", strerror(errno));
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        if (poll(&pf, 1, left_ms(deadline)) == 0)
            return epipe_fail(EPIPE_ETIMEDOUT, "send did not finish within the init timeout");
    }
    return EPIPE_OK;
}

static int send_msg(int fd, unsigned kind, unsigned src, unsigned dst, uint32_t mb, uint64_t step,
                    const void *payload, size_t len, int64_t deadline)
{
    epipe_wire_header h;
    memset(&h, 0, sizeof h);
    h.kind = (uint8_t)kind;
    h.src_stage = src, h.dst_stage = dst, h.micro_batch = mb, h.step = step;
    size_t cap = epipe_wire_message_size(len), used;
    uint8_t *buf = malloc(cap);
    if (!buf)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    int rc = epipe_wire_frame(&h, payload, len, buf, cap, &used);
    if (rc == EPIPE_OK)
        rc = write_all(fd, buf, used, deadline);
    free(buf);
    return rc;
}

static int send_hello(int fd, const struct hello *h, unsigned src, unsigned dst, int64_t deadline)
{
    uint8_t p[HELLO_SIZE];
    hello_encode(h, p);
    return send_msg(fd, EPIPE_WIRE_HELLO, src, dst, 0, 0, p, sizeof p, deadline);
}

/* ERROR messages carry the status (as a positive number) in `step` and the
 * rank the error is about in `micro_batch`; the payload is the text. */
static void send_error(int fd, unsigned src, unsigned dst, unsigned about, int status,
                       const char *text)
{
    size_t len = strnlen(text, EPIPE_ERRMSG_MAX);
    send_msg(fd, EPIPE_WIRE_ERROR, src, dst, about, (uint64_t)(-status), text, len,
             now_ms() + 1000);
}

/* Turns a received ERROR into a status and a message. */
static int error_from(const struct reader *r, const char *who)
{
    int status = -(int)r->h.step;
    if (status > -1 || status < -64)
        status = EPIPE_EPEER;
    return epipe_fail(status, "%s refused this rank: %.*s", who, (int)r->h.payload_len,
                      (const char *)r->payload);
}

/* ---- the connecting side of a handshake -------------------------------- */

struct setup {
    unsigned rank, size;
    const epipe_tcp_opts *o;
    const epipe_tcp_key *key;
    int64_t deadline;
    char my_addr[EPIPE_TCP_ADDR_MAX];
    unsigned my_port;
    epipe_tcp_link *links;
    unsigned nlinks, links_cap;
    uint8_t *have;          /* [size] bit s: stream s of that peer is connected */
    char last_refusal[200]; /* the last connection the acceptor refused, for timeouts */
    int ctl;                /* ranks > 0, after the table: the connection to rank 0 */
    struct reader ctl_r;    /* what rank 0 says on it before GO: an ERROR, or GO */
    int go;                 /* rank 0 said GO */
    int ctl_heard;          /* rank 0 said the rendezvous failed, or closed */
};

/* Reads what rank 0 has sent on the control connection, if anything:
 * before GO it sends only GO or an ERROR (a rank failed in the rendezvous).
 * 0: nothing (yet) or GO; < 0: the rendezvous failed (error set). */
static int ctl_step(struct setup *s)
{
    if (s->ctl < 0 || s->go)
        return 0;
    int rc = reader_step(s->ctl, &s->ctl_r);
    if (rc == 0)
        return 0;
    if (rc < 0) {
        s->ctl_heard = 1;
        return refail(rc, "rendezvous: rank %u: the connection to rank 0", s->rank);
    }
    struct hello h;
    if (s->ctl_r.h.kind == EPIPE_WIRE_ERROR) {
        s->ctl_heard = 1;
        rc = -(int)s->ctl_r.h.step;
        rc = epipe_fail(rc > -1 || rc < -64 ? EPIPE_EPEER : rc, "rendezvous: rank 0 reports: %.*s",
                        (int)s->ctl_r.h.payload_len, (const char *)s->ctl_r.payload);
    } else if ((rc = hello_decode(s->ctl_r.payload, s->ctl_r.h.payload_len, &h)) == EPIPE_OK) {
        if (h.type == HT_GO)
            s->go = 1;
        else
            rc = epipe_fail(EPIPE_EPROTO, "rank 0 sent hello type %u during the rendezvous",
                            h.type);
    }
    reader_reset(&s->ctl_r);
    return rc;
}

/* Sleeps ms, or less if rank 0 says the rendezvous failed. */
static int pause_ms(struct setup *s, int ms)
{
    if (!s || s->ctl < 0) {
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        return EPIPE_OK;
    }
    int64_t end = now_ms() + ms;
    for (;;) {
        int rc = ctl_step(s);
        if (rc < 0)
            return rc;
        int64_t left = end - now_ms();
        if (left <= 0)
            return EPIPE_OK;
        struct pollfd pf = {.fd = s->ctl, .events = POLLIN};
        poll(&pf, 1, (int)left);
    }
}

static int add_link(struct setup *s, int fd, unsigned peer, unsigned stream)
{
    if (s->nlinks == s->links_cap) {
        unsigned cap = s->links_cap ? 2 * s->links_cap : 8;
        epipe_tcp_link *l = realloc(s->links, cap * sizeof *l);
        if (!l)
            return epipe_fail(EPIPE_ENOMEM, "out of memory");
        s->links = l, s->links_cap = cap;
    }
    s->links[s->nlinks++] = (epipe_tcp_link){.fd = fd, .peer = peer, .stream = stream};
    s->have[peer] |= (uint8_t)(1u << stream);
    return EPIPE_OK;
}

/* Connector: HELLO, then CHALLENGE, PROOF, WELCOME. `who` names the peer.
 * *dropped is set when the acceptor closed the connection unanswered. */
static int client_handshake(struct setup *s, int fd, unsigned type, unsigned peer,
                            unsigned stream, const char *who, int *dropped)
{
    struct hello me = {.type = (uint8_t)type, .flags = s->key->on ? HF_AUTH : 0,
                       .rank = s->rank, .size = s->size, .stream = stream,
                       .port = (uint16_t)s->my_port};
    snprintf(me.addr, sizeof me.addr, "%s", s->my_addr);
    epipe_tcp_random(me.nonce, sizeof me.nonce);
    struct reader r = {0};
    struct hello ch;
    int rc = send_hello(fd, &me, s->rank, peer, s->deadline);
    if (rc == EPIPE_OK)
        rc = reader_wait(fd, &r, s->deadline);
    if (rc < 0) {
        *dropped = rc == EPIPE_EPEER;
        goto out;
    }
    if (r.h.kind == EPIPE_WIRE_ERROR) {
        rc = error_from(&r, who);
        goto out;
    }
    if ((rc = hello_decode(r.payload, r.h.payload_len, &ch)))
        goto out;
    if (ch.type != HT_CHALLENGE) {
        rc = epipe_fail(EPIPE_EPROTO, "expected a challenge, got hello type %u", ch.type);
        goto out;
    }
    if (ch.rank != peer) {
        rc = epipe_fail(EPIPE_EINVAL, "%s answers as rank %u of %u, but this rank expects rank %u "
                                      "of %u", who, ch.rank, ch.size, peer, s->size);
        goto out;
    }
    struct hello proof = {.type = HT_PROOF, .flags = me.flags, .rank = s->rank, .size = s->size,
                          .stream = stream};
    if (s->key->on) {
        if (!(ch.flags & HF_AUTH) ||
            !epipe_tcp_mac_ok(s->key, 'S', me.nonce, ch.nonce, s->rank, peer, stream, ch.mac)) {
            rc = epipe_fail(EPIPE_EAUTH, "%s %s", who,
                            ch.flags & HF_AUTH ? "failed to prove it holds this rank's key "
                                                 "(the key files differ)"
                                               : "runs without a key, but this rank has one");
            char text[EPIPE_ERRMSG_MAX];
            snprintf(text, sizeof text, "%s", epipe_last_error());
            send_error(fd, s->rank, peer, s->rank, EPIPE_EAUTH, text);
            epipe_fail(EPIPE_EAUTH, "%s", text);
            goto out;
        }
        epipe_tcp_mac(s->key, 'C', me.nonce, ch.nonce, s->rank, peer, stream, proof.mac);
    }
    reader_reset(&r);
    if ((rc = send_hello(fd, &proof, s->rank, peer, s->deadline)) == EPIPE_OK &&
        ch.size != s->size) { /* after the proof, so the acceptor trusts our word and fails too */
        rc = epipe_fail(EPIPE_EINVAL, "mismatched world size: %s has %u ranks, this rank (rank %u) "
                                      "has %u", who, ch.size, s->rank, s->size);
        goto out;
    }
    if (rc || (rc = reader_wait(fd, &r, s->deadline)) < 0) {
        *dropped = rc == EPIPE_EPEER;
        goto out;
    }
    if (r.h.kind == EPIPE_WIRE_ERROR) {
        rc = error_from(&r, who);
        goto out;
    }
    struct hello w;
    if ((rc = hello_decode(r.payload, r.h.payload_len, &w)))
        goto out;
    rc = w.type == HT_WELCOME ? EPIPE_OK
                              : epipe_fail(EPIPE_EPROTO, "expected a welcome, got hello type %u",
                                           w.type);
out:
    reader_reset(&r);
    if (rc > 0)
        rc = EPIPE_OK;
    if (rc && !strstr(epipe_last_error(), who))
        rc = refail(rc, "handshake with %s", who);
    return rc;
}

/* Connects (unless *fd already is) and handshakes; again, after a pause,
 * while the acceptor drops the connection unanswered (it sheds connections
 * under a flood), until the init timeout. On failure *fd is closed, -1. */
static int dial(struct setup *s, const char *host, unsigned port, unsigned type, unsigned peer,
                unsigned stream, const char *who, int *fd)
{
    int backoff = 10;
    for (;;) {
        int rc, dropped = 0;
        if (*fd < 0 && (rc = connect_retry(s, host, port, s->deadline, fd, who)))
            return rc;
        if ((rc = client_handshake(s, *fd, type, peer, stream, who, &dropped)) == EPIPE_OK)
            return EPIPE_OK;
        close(*fd);
        *fd = -1;
        if (!dropped || now_ms() + backoff >= s->deadline)
            return rc;
        epipe_log_info((int)s->rank, "rendezvous", "%s; trying again", epipe_last_error());
        epipe_clear_error();
        if ((rc = pause_ms(s, backoff)))
            return rc;
        backoff = backoff < 250 ? backoff * 2 : 500;
    }
}

/* ---- the accepting side ------------------------------------------------- */

struct pending {
    int fd;
    int phase; /* 0: wants HELLO; 1: wants PROOF */
    uint64_t seq; /* arrival order */
    struct reader r;
    struct hello hi;
    uint8_t nonce_s[EPIPE_TCP_NONCE];
    char from[80];
};

struct registry { /* rank 0 only */
    int *fd;      /* [size] registration connection, -1 until registered */
    struct hello *hi;
    struct reader **rd; /* [size] what a registered rank sends, allocated when it does */
    uint8_t *ready;     /* [size] it said READY: its connections are all made */
    unsigned registered, nready;
    int table_sent;
};

static void refuse(struct setup *s, struct pending *p, int status, const char *why)
{
    epipe_log_warn((int)s->rank, "rendezvous", "refused the connection from %s: %s", p->from, why);
    snprintf(s->last_refusal, sizeof s->last_refusal, "%.40s: %.150s", p->from, why);
    if (status)
        send_error(p->fd, s->rank, p->hi.rank, s->rank, status, why);
    close(p->fd);
    p->fd = -1;
}

/* Tells every registered rank but `about` that the rendezvous failed
 * because of rank `about` (0: this one). */
static void fail_all(struct setup *s, struct registry *g, unsigned about, int status,
                     const char *why)
{
    for (unsigned q = 1; g && q < s->size; q++)
        if (g->fd[q] >= 0 && (q != about || about == 0))
            send_error(g->fd[q], s->rank, q, about, status, why);
}

/* Advances one pending connection. Returns 0 to go on, 1 when it is done
 * (refused, or a registration), 2 when it became a link, < 0 if fatal. */
static int serve(struct setup *s, struct registry *g, struct pending *p)
{
    int rc = reader_step(p->fd, &p->r);
    if (rc == 0)
        return 0;
    if (rc < 0) {
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", epipe_last_error());
        refuse(s, p, rc == EPIPE_EPEER ? 0 : rc, why);
        return 1;
    }
    char why[EPIPE_ERRMSG_MAX];
    if (p->r.h.kind == EPIPE_WIRE_ERROR) {
        snprintf(why, sizeof why, "it refused this rank: %.*s", (int)p->r.h.payload_len,
                 (const char *)p->r.payload);
        refuse(s, p, 0, why);
        return 1;
    }
    struct hello h;
    if ((rc = hello_decode(p->r.payload, p->r.h.payload_len, &h))) {
        snprintf(why, sizeof why, "%s", epipe_last_error());
        refuse(s, p, rc, why);
        return 1;
    }
    reader_reset(&p->r);
    if (p->phase == 0) {
        /* Nothing this hello says counts before the peer has proven the key:
         * only what shapes the challenge is looked at here. */
        p->hi = h;
        if (h.type != HT_REGISTER && h.type != HT_CONNECT) {
            refuse(s, p, EPIPE_EPROTO, "the first hello is neither register nor connect");
            return 1;
        }
        if (!!(h.flags & HF_AUTH) != s->key->on) {
            snprintf(why, sizeof why, "rank %u %s", h.rank,
                     s->key->on ? "has no key, but this group requires one (EPIPE_AUTH_KEY_FILE)"
                                : "has a key, but this rank runs without one");
            refuse(s, p, EPIPE_EAUTH, why);
            return 1;
        }
        struct hello ch = {.type = HT_CHALLENGE, .flags = s->key->on ? HF_AUTH : 0,
                           .rank = s->rank, .size = s->size, .stream = h.stream};
        epipe_tcp_random(p->nonce_s, sizeof p->nonce_s);
        memcpy(ch.nonce, p->nonce_s, sizeof ch.nonce);
        if (s->key->on)
            epipe_tcp_mac(s->key, 'S', h.nonce, p->nonce_s, h.rank, s->rank, h.stream, ch.mac);
        if ((rc = send_hello(p->fd, &ch, s->rank, h.rank, now_ms() + 1000))) {
            snprintf(why, sizeof why, "%s", epipe_last_error());
            refuse(s, p, 0, why);
            return 1;
        }
        p->phase = 1;
        return 0;
    }
    /* phase 1: the proof; from here on the peer holds the key (or none is used) */
    if (h.type != HT_PROOF) {
        refuse(s, p, EPIPE_EPROTO, "expected a proof");
        return 1;
    }
    if (s->key->on && !epipe_tcp_mac_ok(s->key, 'C', p->hi.nonce, p->nonce_s, p->hi.rank, s->rank,
                                        p->hi.stream, h.mac)) {
        snprintf(why, sizeof why, "rank %u failed to prove it holds the key (wrong key file?)",
                 p->hi.rank);
        refuse(s, p, EPIPE_EAUTH, why);
        return 1;
    }
    h = p->hi;
    int is_reg = h.type == HT_REGISTER;
    if (h.size != s->size) {
        snprintf(why, sizeof why, "mismatched world size: rank %u at %s says %u ranks, rank %u "
                                  "has %u", h.rank, p->from, h.size, s->rank, s->size);
        refuse(s, p, EPIPE_EINVAL, why);
        fail_all(s, g, 0, EPIPE_EINVAL, why);
        return epipe_fail(EPIPE_EINVAL, "rendezvous: %s", why);
    }
    if (h.rank >= s->size || h.rank <= s->rank) {
        snprintf(why, sizeof why, "rank %u may not connect to rank %u", h.rank, s->rank);
        refuse(s, p, EPIPE_EINVAL, why);
        return 1;
    }
    if (is_reg ? (!g || g->table_sent) : h.stream >= epipe_tcp_streams_between(s->o, s->rank, h.rank) ||
                                         (s->rank == 0 && h.stream == 0)) {
        snprintf(why, sizeof why, "unexpected %s from rank %u, stream %u",
                 is_reg ? "registration" : "connection", h.rank, h.stream);
        refuse(s, p, EPIPE_EPROTO, why);
        return 1;
    }
    if (s->have[h.rank] & (1u << (is_reg ? 0 : h.stream))) {
        snprintf(why, sizeof why, "two processes claim rank %u (the second from %s)", h.rank,
                 p->from);
        refuse(s, p, EPIPE_EINVAL, why);
        fail_all(s, g, 0, EPIPE_EINVAL, why);
        return epipe_fail(EPIPE_EINVAL, "rendezvous: %s", why);
    }
    struct hello w = {.type = HT_WELCOME, .rank = s->rank, .size = s->size, .stream = p->hi.stream};
    if ((rc = send_hello(p->fd, &w, s->rank, p->hi.rank, now_ms() + 1000))) {
        snprintf(why, sizeof why, "%s", epipe_last_error());
        refuse(s, p, 0, why);
        return 1;
    }
    unsigned q = p->hi.rank;
    if (p->hi.type == HT_REGISTER) {
        if (!p->hi.addr[0] || !strcmp(p->hi.addr, "0.0.0.0") || !strcmp(p->hi.addr, "::")) {
            struct sockaddr_storage ss;
            socklen_t len = sizeof ss;
            getpeername(p->fd, (struct sockaddr *)&ss, &len);
            host_only((struct sockaddr *)&ss, p->hi.addr, sizeof p->hi.addr);
        }
        g->fd[q] = p->fd;
        g->hi[q] = p->hi;
        g->registered++;
        s->have[q] |= 1;
        epipe_log_info((int)s->rank, "rendezvous", "rank %u registered from %s (listens on %s:%u)%s",
                       q, p->from, p->hi.addr, p->hi.port, s->key->on ? ", authenticated" : "");
    } else {
        if ((rc = add_link(s, p->fd, q, p->hi.stream)))
            return rc;
        epipe_log_debug((int)s->rank, "tcp", "accepted rank %u stream %u from %s", q,
                        p->hi.stream, p->from);
    }
    p->fd = -1; /* kept */
    return p->hi.type == HT_REGISTER ? 1 : 2;
}

static unsigned expected_in(const struct setup *s)
{
    unsigned n = 0;
    for (unsigned q = s->rank + 1; q < s->size; q++)
        n += epipe_tcp_streams_between(s->o, s->rank, q);
    return n;
}

static int send_table(struct setup *s, struct registry *g)
{
    size_t len = HELLO_SIZE + TABLE_ENTRY * (size_t)s->size;
    uint8_t *p = calloc(1, len);
    if (!p)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    struct hello t = {.type = HT_TABLE, .rank = 0, .size = s->size};
    hello_encode(&t, p);
    for (unsigned q = 1; q < s->size; q++) {
        uint8_t *e = p + HELLO_SIZE + TABLE_ENTRY * (size_t)q;
        memcpy(e, g->hi[q].addr, strnlen(g->hi[q].addr, EPIPE_TCP_ADDR_MAX - 1));
        put_u16(e + 64, g->hi[q].port);
    }
    int rc = EPIPE_OK;
    for (unsigned q = 1; q < s->size && rc == EPIPE_OK; q++)
        if ((rc = send_msg(g->fd[q], EPIPE_WIRE_HELLO, 0, q, 0, 0, p, len, s->deadline)))
            rc = epipe_fail(rc, "rendezvous: sending the table to rank %u: %s", q,
                            epipe_last_error());
    free(p);
    g->table_sent = 1;
    epipe_log_info(0, "rendezvous", "all %u ranks registered; table sent", s->size);
    return rc;
}

/* Which pending connection to drop when a new one arrives and all slots
 * are taken: the oldest that has sent nothing, else the oldest still in the
 * middle of its first hello, else the oldest waiting to prove the key. A
 * rank that handshakes at once thus outlives a flood of idle connections;
 * a dropped rank retries (client_handshake's caller). */
static unsigned evictee(const struct pending *pend, unsigned n)
{
    unsigned best = 0;
    int best_class = 3;
    for (unsigned i = 0; i < n; i++) {
        const struct pending *p = &pend[i];
        int cls = p->phase ? 2 : p->r.got || p->r.have_header ? 1 : 0;
        if (cls < best_class || (cls == best_class && p->seq < pend[best].seq))
            best = i, best_class = cls;
    }
    return best;
}

/* Something arrived on rank q's registration connection: READY once the
 * table is out, else it failed (closed, an ERROR, anything else). Before
 * the table a failed rank is forgotten and may register again; after it,
 * every other rank is told, and the rendezvous fails. */
static int watch_rank(struct setup *s, struct registry *g, unsigned q)
{
    if (!g->rd[q] && !(g->rd[q] = calloc(1, sizeof *g->rd[q])))
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    struct reader *r = g->rd[q];
    int rc = reader_step(g->fd[q], r);
    if (rc == 0)
        return 0;
    char why[EPIPE_ERRMSG_MAX];
    struct hello h;
    if (rc < 0)
        snprintf(why, sizeof why, "%s", epipe_last_error());
    else if (r->h.kind == EPIPE_WIRE_ERROR)
        snprintf(why, sizeof why, "%.*s", (int)r->h.payload_len, (const char *)r->payload);
    else if (hello_decode(r->payload, r->h.payload_len, &h) == EPIPE_OK && h.type == HT_READY &&
             g->table_sent && !g->ready[q]) {
        reader_reset(r);
        g->ready[q] = 1;
        g->nready++;
        return 0;
    } else
        snprintf(why, sizeof why, "an unexpected message on its registration connection");
    reader_reset(r);
    epipe_clear_error();
    if (!g->table_sent) {
        epipe_log_warn(0, "rendezvous", "rank %u left before all ranks registered (%s); it may "
                       "register again", q, why);
        close(g->fd[q]);
        g->fd[q] = -1;
        g->registered--;
        s->have[q] &= (uint8_t)~1u;
        return 0;
    }
    char text[EPIPE_ERRMSG_MAX + 64];
    snprintf(text, sizeof text, "rank %u failed during the rendezvous: %s", q, why);
    text[EPIPE_ERRMSG_MAX - 1] = '\0';
    fail_all(s, g, q, EPIPE_EPEER, text);
    return epipe_fail(EPIPE_EPEER, "rendezvous: %s", text);
}

/* The ranks among q0..size-1 still missing: streams (rank 0 also READY). */
static void missing_ranks(const struct setup *s, const struct registry *g, char *out, size_t cap)
{
    size_t off = 0;
    out[0] = '\0';
    for (unsigned q = s->rank + 1; q < s->size && off + 16 < cap; q++) {
        unsigned k = epipe_tcp_streams_between(s->o, s->rank, q);
        int miss = k && s->have[q] != (uint8_t)((1u << k) - 1);
        if (g && g->table_sent)
            miss = miss || !g->ready[q];
        if (miss)
            off += (size_t)snprintf(out + off, cap - off, "%s%u", off ? ", " : "", q);
    }
}

/* Accepts connections until every expected one has arrived; rank 0 also
 * collects every rank's READY and then sends GO to all. Ranks > 0 listen
 * to rank 0 meanwhile (s->ctl). */
static int accept_loop(struct setup *s, struct registry *g, int lfd)
{
    unsigned nwatch = g ? s->size : 1;
    struct pending *pend = calloc(MAX_PENDING, sizeof *pend);
    struct pollfd *pf = calloc(MAX_PENDING + 1 + nwatch, sizeof *pf);
    unsigned *who = calloc(nwatch, sizeof *who);
    unsigned npend = 0;
    int rc = EPIPE_OK;
    if (!pend || !pf || !who) {
        rc = epipe_fail(EPIPE_ENOMEM, "out of memory");
        goto out;
    }
    unsigned want = expected_in(s) - (g ? s->size - 1 : 0);
    unsigned got = 0;
    uint64_t seq = 0;
    for (;;) {
        if (g && !g->table_sent && g->registered == s->size - 1 && (rc = send_table(s, g)))
            break;
        if ((!g || g->table_sent) && got == want && (!g || g->nready == s->size - 1))
            break;
        pf[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        for (unsigned i = 0; i < npend; i++)
            pf[i + 1] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
        unsigned nw = 0; /* then the connections to listen to */
        for (unsigned q = 1; g && q < s->size; q++)
            if (g->fd[q] >= 0 && !g->ready[q])
                who[nw] = q, pf[1 + npend + nw++] = (struct pollfd){.fd = g->fd[q], .events = POLLIN};
        if (!g && s->ctl >= 0)
            pf[1 + npend + nw++] = (struct pollfd){.fd = s->ctl, .events = POLLIN};
        int n = poll(pf, 1 + npend + nw, left_ms(s->deadline));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            char missing[128];
            missing_ranks(s, g, missing, sizeof missing);
            rc = epipe_fail(EPIPE_ETIMEDOUT, "rendezvous: rank %u: rank%s %s did not %s within the "
                                             "init timeout%s%s",
                            s->rank, strchr(missing, ',') ? "s" : "", missing,
                            g && !g->table_sent ? "register"
                            : g && got == want  ? "finish connecting"
                                                : "connect",
                            s->last_refusal[0] ? "; last refused: " : "", s->last_refusal);
            break;
        }
        for (unsigned i = 0; i < nw && rc == EPIPE_OK; i++)
            if (pf[1 + npend + i].revents)
                rc = g ? watch_rank(s, g, who[i]) : ctl_step(s);
        if (rc)
            break;
        if (s->go) {
            rc = epipe_fail(EPIPE_EPROTO, "rendezvous: rank 0 said GO before this rank was ready");
            break;
        }
        /* Backwards, so a finished entry can take the last one's place. */
        for (unsigned i = npend; i-- > 0;) {
            if (!pf[i + 1].revents)
                continue;
            int r = serve(s, g, &pend[i]);
            if (r < 0) {
                rc = r;
                break;
            }
            if (r > 0) {
                got += r == 2;
                reader_reset(&pend[i].r);
                pend[i] = pend[--npend];
            }
        }
        if (rc)
            break;
        if (pf[0].revents & POLLIN) {
            struct sockaddr_storage ss;
            socklen_t len = sizeof ss;
            int fd = accept4(lfd, (struct sockaddr *)&ss, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd >= 0) {
                if (npend == MAX_PENDING) {
                    unsigned v = evictee(pend, npend);
                    epipe_log_warn((int)s->rank, "rendezvous", "too many pending connections; "
                                   "dropping the %s one from %s",
                                   pend[v].phase ? "oldest unproven" : "oldest idle", pend[v].from);
                    close(pend[v].fd);
                    reader_reset(&pend[v].r);
                    pend[v] = pend[--npend];
                }
                struct pending *p = &pend[npend++];
                memset(p, 0, sizeof *p);
                p->fd = fd;
                p->seq = seq++;
                sock_text((struct sockaddr *)&ss, p->from, sizeof p->from);
                tune(fd);
            }
        }
    }
    if (rc == EPIPE_OK && g) { /* every rank is connected: go */
        struct hello go = {.type = HT_GO, .rank = 0, .size = s->size};
        for (unsigned q = 1; q < s->size && rc == EPIPE_OK; q++)
            if ((rc = send_hello(g->fd[q], &go, 0, q, s->deadline)))
                rc = refail(rc, "rendezvous: telling rank %u to go", q);
    }
out:
    for (unsigned i = 0; pend && i < npend; i++) {
        if (pend[i].fd >= 0)
            close(pend[i].fd);
        reader_reset(&pend[i].r);
    }
    free(pend);
    free(pf);
    free(who);
    return rc;
}

/* ---- the whole setup ---------------------------------------------------- */

unsigned epipe_tcp_streams_between(const epipe_tcp_opts *o, unsigned a, unsigned b)
{
    if (a == b)
        return 0;
    if (o->mesh || a + 1 == b || b + 1 == a)
        return o->streams;
    return a == 0 || b == 0 ? 1 : 0;
}

static int choose_addr(const epipe_tcp_opts *o, char *out, size_t cap, int *chosen)
{
    *chosen = 1;
    if (o->listen_addr[0]) {
        snprintf(out, cap, "%s", o->listen_addr);
        return EPIPE_OK;
    }
    if (o->ifname[0])
        return ifname_addr(o->ifname, out, cap);
    *chosen = 0;
    return EPIPE_OK;
}

static int setup_rank0(struct setup *s, const char *master_addr, unsigned master_port)
{
    char addr[EPIPE_TCP_ADDR_MAX], where[96];
    int chosen, rc, lfd = -1, family = AF_INET;
    if ((rc = choose_addr(s->o, addr, sizeof addr, &chosen)))
        return rc;
    if (!chosen) {
        struct sockaddr_storage ss;
        socklen_t len;
        if (resolve(master_addr, master_port, 0, &ss, &len) == EPIPE_OK) {
            family = ss.ss_family;
            if (is_loopback(&ss)) {
                host_only((struct sockaddr *)&ss, addr, sizeof addr);
                chosen = 1;
            }
        }
        epipe_clear_error();
    }
    unsigned port;
    if ((rc = open_listener(chosen ? addr : NULL, master_port, family, &lfd, &port, where,
                            sizeof where)))
        return refail(rc, "rendezvous: rank 0");
    epipe_log_info(0, "rendezvous", "rank 0 listens on %s for %u ranks%s", where, s->size,
                   s->key->on ? " (authentication on)" : "");
    struct registry g = {0};
    g.fd = malloc(sizeof *g.fd * s->size);
    g.hi = calloc(s->size, sizeof *g.hi);
    g.rd = calloc(s->size, sizeof *g.rd);
    g.ready = calloc(s->size, 1);
    if (!g.fd || !g.hi || !g.rd || !g.ready) {
        rc = epipe_fail(EPIPE_ENOMEM, "out of memory");
    } else {
        for (unsigned q = 0; q < s->size; q++)
            g.fd[q] = -1;
        rc = accept_loop(s, &g, lfd);
    }
    close(lfd);
    for (unsigned q = 1; g.fd && q < s->size; q++) {
        if (g.fd[q] < 0)
            continue;
        if (rc == EPIPE_OK)
            rc = add_link(s, g.fd[q], q, 0);
        if (rc) {
            char why[EPIPE_ERRMSG_MAX];
            snprintf(why, sizeof why, "rank 0: %s", epipe_last_error());
            send_error(g.fd[q], 0, q, 0, rc, why);
            epipe_clear_error();
            epipe_fail(rc, "%s", why + 8);
            close(g.fd[q]);
        }
    }
    for (unsigned q = 0; g.rd && q < s->size; q++)
        if (g.rd[q]) {
            reader_reset(g.rd[q]);
            free(g.rd[q]);
        }
    free(g.rd);
    free(g.ready);
    free(g.fd);
    free(g.hi);
    return rc;
}

static int setup_rank(struct setup *s, const char *master_addr, unsigned master_port)
{
    char who[320], where[96];
    snprintf(who, sizeof who, "the master (rank 0) at %s:%u", master_addr, master_port);
    int fd0 = -1, lfd = -1, chosen, rc;
    uint8_t *table = NULL;
    if ((rc = connect_retry(s, master_addr, master_port, s->deadline, &fd0, who)))
        return refail(rc, "rendezvous: rank %u", s->rank);
    if ((rc = choose_addr(s->o, s->my_addr, sizeof s->my_addr, &chosen)))
        goto out;
    if (!chosen) { /* the address this host uses to reach the master */
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        getsockname(fd0, (struct sockaddr *)&ss, &len);
        host_only((struct sockaddr *)&ss, s->my_addr, sizeof s->my_addr);
    }
    if ((rc = open_listener(s->my_addr, 0, AF_INET, &lfd, &s->my_port, where, sizeof where))) {
        rc = refail(rc, "rendezvous: rank %u", s->rank);
        goto out;
    }
    epipe_log_debug((int)s->rank, "rendezvous", "listening on %s", where);
    if ((rc = dial(s, master_addr, master_port, HT_REGISTER, 0, 0, who, &fd0)))
        goto out;
    struct reader r = {.limit = HELLO_SIZE + TABLE_ENTRY * (uint64_t)s->size};
    rc = reader_wait(fd0, &r, s->deadline);
    if (rc > 0 && r.h.kind == EPIPE_WIRE_ERROR)
        rc = error_from(&r, who);
    struct hello t;
    if (rc > 0 && (rc = hello_decode(r.payload, r.h.payload_len, &t)) == EPIPE_OK &&
        (t.type != HT_TABLE || t.size != s->size ||
         r.h.payload_len != HELLO_SIZE + TABLE_ENTRY * (uint64_t)s->size))
        rc = epipe_fail(EPIPE_EPROTO, "%s sent a malformed table", who);
    table = r.payload;
    r.payload = NULL;
    reader_reset(&r);
    if (rc < 0) {
        if (!strstr(epipe_last_error(), "rank 0"))
            rc = refail(rc, "waiting for the table from %s", who);
        goto out;
    }
    if ((rc = add_link(s, fd0, 0, 0)))
        goto out;
    s->ctl = fd0;
    fd0 = -1;
    epipe_log_info((int)s->rank, "rendezvous", "registered with %s%s", who,
                   s->key->on ? " (authenticated)" : "");
    for (unsigned q = s->rank; q-- > 0;) {
        unsigned k = epipe_tcp_streams_between(s->o, s->rank, q);
        for (unsigned st = q == 0 ? 1 : 0; st < k; st++) {
            char qaddr[EPIPE_TCP_ADDR_MAX] = {0};
            const uint8_t *e = table + HELLO_SIZE + TABLE_ENTRY * (size_t)q;
            memcpy(qaddr, e, EPIPE_TCP_ADDR_MAX - 1);
            unsigned qport = q == 0 ? master_port : get_u16(e + 64);
            char qwho[160];
            snprintf(qwho, sizeof qwho, "rank %u at %s:%u", q, q == 0 ? master_addr : qaddr, qport);
            int fd = -1;
            if ((rc = dial(s, q == 0 ? master_addr : qaddr, qport, HT_CONNECT, q, st, qwho, &fd)))
                goto out;
            if ((rc = add_link(s, fd, q, st))) {
                close(fd);
                goto out;
            }
            epipe_log_debug((int)s->rank, "tcp", "connected to %s, stream %u", qwho, st);
        }
    }
    if ((rc = accept_loop(s, NULL, lfd)))
        goto out;
    /* Every connection of this rank is made: READY, then wait for GO. */
    struct hello ready = {.type = HT_READY, .rank = s->rank, .size = s->size};
    if ((rc = send_hello(s->ctl, &ready, s->rank, 0, s->deadline)))
        goto out;
    while (!s->go && rc == EPIPE_OK) {
        struct pollfd pf = {.fd = s->ctl, .events = POLLIN};
        if (poll(&pf, 1, left_ms(s->deadline)) == 0)
            rc = epipe_fail(EPIPE_ETIMEDOUT, "rendezvous: rank %u: rank 0 did not say go within "
                                             "the init timeout", s->rank);
        else
            rc = ctl_step(s);
    }
out:
    if (rc && s->ctl >= 0 && !s->ctl_heard) { /* rank 0 tells the others why */
        char text[EPIPE_ERRMSG_MAX];
        snprintf(text, sizeof text, "%s", epipe_last_error());
        send_error(s->ctl, s->rank, 0, s->rank, rc, text);
        epipe_fail(rc, "%s", text);
    }
    reader_reset(&s->ctl_r);
    if (rc)
        epipe_log_debug((int)s->rank, "rendezvous", "failed: %s", epipe_last_error());
    free(table);
    if (fd0 >= 0)
        close(fd0);
    if (lfd >= 0)
        close(lfd);
    return rc;
}

int epipe_tcp_setup(unsigned rank, unsigned size, const char *master_addr, unsigned master_port,
                    const epipe_tcp_opts *o, const epipe_tcp_key *key, epipe_tcp_link **links,
                    unsigned *nlinks)
{
    *links = NULL;
    *nlinks = 0;
    if (size == 1)
        return EPIPE_OK;
    struct setup s = {.rank = rank, .size = size, .o = o, .key = key, .ctl = -1,
                      .deadline = now_ms() + o->init_timeout_ms};
    s.have = calloc(size, 1);
    if (!s.have)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    int rc = rank == 0 ? setup_rank0(&s, master_addr, master_port)
                       : setup_rank(&s, master_addr, master_port);
    free(s.have);
    if (rc) {
        for (unsigned i = 0; i < s.nlinks; i++)
            close(s.links[i].fd);
        free(s.links);
        return rc;
    }
    *links = s.links;
    *nlinks = s.nlinks;
    return EPIPE_OK;
}
