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
#define HELLO_VERSION 1
#define HELLO_SIZE 152
#define TABLE_ENTRY 72
#define HS_MAX_PAYLOAD (HELLO_SIZE + TABLE_ENTRY * (size_t)1048576)
#define MAX_PENDING 64

enum { HT_REGISTER = 1, HT_CONNECT, HT_CHALLENGE, HT_PROOF, HT_WELCOME, HT_TABLE };
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
    if (h->type < HT_REGISTER || h->type > HT_TABLE)
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

/* Connects to host:port, retrying while nobody listens yet, until deadline. */
static int connect_retry(const char *host, unsigned port, int64_t deadline, int *fd_out,
                         const char *who)
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
        struct timespec ts = {0, backoff * 1000000L};
        nanosleep(&ts, NULL);
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
                epipe_wire_limits lim = {.max_payload = HS_MAX_PAYLOAD};
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
static void send_error(int fd, unsigned src, unsigned dst, int status, const char *text)
{
    int save_len = (int)strlen(text);
    send_msg(fd, EPIPE_WIRE_ERROR, src, dst, src, (uint64_t)(-status), text, (size_t)save_len,
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
    epipe_tcp_link hs;      /* crypt: the handshake add_link records */
};

static int add_link(struct setup *s, int fd, unsigned peer, unsigned stream)
{
    if (s->nlinks == s->links_cap) {
        unsigned cap = s->links_cap ? 2 * s->links_cap : 8;
        epipe_tcp_link *l = realloc(s->links, cap * sizeof *l);
        if (!l)
            return epipe_fail(EPIPE_ENOMEM, "out of memory");
        s->links = l, s->links_cap = cap;
    }
    epipe_tcp_link l = s->hs; /* crypt: nonces and flags of its handshake */
    l.fd = fd, l.peer = peer, l.stream = stream;
    s->links[s->nlinks++] = l;
    s->have[peer] |= (uint8_t)(1u << stream);
    return EPIPE_OK;
}

/* Connector: HELLO, then CHALLENGE, PROOF, WELCOME. `who` names the peer. */
static int client_handshake(struct setup *s, int fd, unsigned type, unsigned peer,
                            unsigned stream, const char *who)
{
    struct hello me = {.type = (uint8_t)type,
                       .flags = (s->key->on ? HF_AUTH : 0) | epipe_tcp_crypt_flags(s->o),
                       .rank = s->rank, .size = s->size, .stream = stream,
                       .port = (uint16_t)s->my_port};
    snprintf(me.addr, sizeof me.addr, "%s", s->my_addr);
    epipe_tcp_random(me.nonce, sizeof me.nonce);
    struct reader r = {0};
    struct hello ch;
    int rc = send_hello(fd, &me, s->rank, peer, s->deadline);
    if (rc == EPIPE_OK)
        rc = reader_wait(fd, &r, s->deadline);
    if (rc < 0)
        goto out;
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
    if (ch.size != s->size || ch.rank != peer) {
        rc = epipe_fail(EPIPE_EINVAL, "%s answers as rank %u of %u, but this rank expects rank %u "
                                      "of %u (mismatched world size?)",
                        who, ch.rank, ch.size, peer, s->size);
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
            send_error(fd, s->rank, peer, EPIPE_EAUTH, text);
            epipe_fail(EPIPE_EAUTH, "%s", text);
            goto out;
        }
        epipe_tcp_mac(s->key, 'C', me.nonce, ch.nonce, s->rank, peer, stream, proof.mac);
    }
    char cw[160]; /* crypt: both sides encrypt, or neither; the keys come from this handshake */
    if (epipe_tcp_crypt_mismatch(s->o, ch.flags, peer, cw, sizeof cw)) {
        rc = epipe_fail(EPIPE_EINVAL, "%s: %s", who, cw);
        goto out;
    }
    epipe_tcp_link_note(&s->hs, 1, me.nonce, ch.nonce, me.flags, ch.flags);
    reader_reset(&r);
    if ((rc = send_hello(fd, &proof, s->rank, peer, s->deadline)) ||
        (rc = reader_wait(fd, &r, s->deadline)) < 0)
        goto out;
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

/* ---- the accepting side ------------------------------------------------- */

struct pending {
    int fd;
    int phase; /* 0: wants HELLO; 1: wants PROOF */
    struct reader r;
    struct hello hi;
    uint8_t nonce_s[EPIPE_TCP_NONCE];
    char from[80];
};

struct registry { /* rank 0 only */
    int *fd;      /* [size] registration connection, -1 until registered */
    struct hello *hi;
    unsigned registered;
    int table_sent;
};

static void refuse(struct setup *s, struct pending *p, int status, const char *why)
{
    epipe_log_warn((int)s->rank, "rendezvous", "refused the connection from %s: %s", p->from, why);
    snprintf(s->last_refusal, sizeof s->last_refusal, "%.40s: %.150s", p->from, why);
    if (status)
        send_error(p->fd, s->rank, p->hi.rank, status, why);
    close(p->fd);
    p->fd = -1;
}

/* Tells every registered rank that the rendezvous failed. */
static void fail_all(struct setup *s, struct registry *g, int status, const char *why)
{
    for (unsigned q = 1; g && q < s->size; q++)
        if (g->fd[q] >= 0)
            send_error(g->fd[q], s->rank, q, status, why);
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
        p->hi = h;
        int is_reg = h.type == HT_REGISTER;
        if (h.type != HT_REGISTER && h.type != HT_CONNECT) {
            refuse(s, p, EPIPE_EPROTO, "the first hello is neither register nor connect");
            return 1;
        }
        if (h.size != s->size) {
            snprintf(why, sizeof why, "mismatched world size: rank %u at %s says %u ranks, rank %u "
                                      "has %u", h.rank, p->from, h.size, s->rank, s->size);
            refuse(s, p, EPIPE_EINVAL, why);
            fail_all(s, g, EPIPE_EINVAL, why);
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
            fail_all(s, g, EPIPE_EINVAL, why);
            return epipe_fail(EPIPE_EINVAL, "rendezvous: %s", why);
        }
        if (!!(h.flags & HF_AUTH) != s->key->on) {
            snprintf(why, sizeof why, "rank %u %s", h.rank,
                     s->key->on ? "has no key, but this group requires one (EPIPE_AUTH_KEY_FILE)"
                                : "has a key, but this rank runs without one");
            refuse(s, p, EPIPE_EAUTH, why);
            return 1;
        }
        if (epipe_tcp_crypt_mismatch(s->o, h.flags, h.rank, why, sizeof why)) { /* crypt */
            refuse(s, p, EPIPE_EINVAL, why);
            return 1;
        }
        struct hello ch = {.type = HT_CHALLENGE,
                           .flags = (s->key->on ? HF_AUTH : 0) | epipe_tcp_crypt_flags(s->o),
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
    /* phase 1: the proof */
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
        memcpy(g->hi[q].mac, p->nonce_s, EPIPE_TCP_NONCE); /* crypt: kept for the link's keys */
        g->registered++;
        s->have[q] |= 1;
        epipe_log_info((int)s->rank, "rendezvous", "rank %u registered from %s (listens on %s:%u)%s",
                       q, p->from, p->hi.addr, p->hi.port, s->key->on ? ", authenticated" : "");
    } else {
        epipe_tcp_link_note(&s->hs, 0, p->hi.nonce, p->nonce_s, p->hi.flags,
                            epipe_tcp_crypt_flags(s->o)); /* crypt */
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

/* Accepts connections until every expected one has arrived. */
static int accept_loop(struct setup *s, struct registry *g, int lfd)
{
    struct pending *pend = calloc(MAX_PENDING, sizeof *pend);
    unsigned npend = 0;
    if (!pend)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    unsigned want = expected_in(s) - (g ? s->size - 1 : 0);
    unsigned got = 0;
    int rc = EPIPE_OK;
    for (;;) {
        if (g && !g->table_sent && g->registered == s->size - 1 && (rc = send_table(s, g)))
            break;
        if ((!g || g->table_sent) && got == want)
            break;
        struct pollfd pf[MAX_PENDING + 1];
        pf[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        for (unsigned i = 0; i < npend; i++)
            pf[i + 1] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
        int n = poll(pf, npend + 1, left_ms(s->deadline));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            char missing[128] = "";
            size_t off = 0;
            for (unsigned q = s->rank + 1; q < s->size && off < sizeof missing - 16; q++) {
                unsigned k = epipe_tcp_streams_between(s->o, s->rank, q);
                if (k && s->have[q] != (uint8_t)((1u << k) - 1))
                    off += (size_t)snprintf(missing + off, sizeof missing - off, "%s%u",
                                            off ? ", " : "", q);
            }
            rc = epipe_fail(EPIPE_ETIMEDOUT, "rendezvous: rank %u: rank%s %s did not %s within the "
                                             "init timeout%s%s",
                            s->rank, strchr(missing, ',') ? "s" : "", missing,
                            g && !g->table_sent ? "register" : "connect",
                            s->last_refusal[0] ? "; last refused: " : "", s->last_refusal);
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
                if (npend == MAX_PENDING) { /* drop the oldest silent one */
                    epipe_log_warn((int)s->rank, "rendezvous", "too many pending connections; "
                                   "dropping the one from %s", pend[0].from);
                    close(pend[0].fd);
                    reader_reset(&pend[0].r);
                    memmove(pend, pend + 1, sizeof *pend * --npend);
                }
                struct pending *p = &pend[npend++];
                memset(p, 0, sizeof *p);
                p->fd = fd;
                sock_text((struct sockaddr *)&ss, p->from, sizeof p->from);
                tune(fd);
            }
        }
        if (rc)
            break;
    }
    for (unsigned i = 0; i < npend; i++) {
        if (pend[i].fd >= 0)
            close(pend[i].fd);
        reader_reset(&pend[i].r);
    }
    free(pend);
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
    if (!g.fd || !g.hi) {
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
        epipe_tcp_link_note(&s->hs, 0, g.hi[q].nonce, g.hi[q].mac, g.hi[q].flags,
                            epipe_tcp_crypt_flags(s->o)); /* crypt: mac holds rank 0's nonce */
        if (rc == EPIPE_OK)
            rc = add_link(s, g.fd[q], q, 0);
        if (rc) {
            char why[EPIPE_ERRMSG_MAX];
            snprintf(why, sizeof why, "rank 0: %s", epipe_last_error());
            send_error(g.fd[q], 0, q, rc, why);
            epipe_clear_error();
            epipe_fail(rc, "%s", why + 8);
            close(g.fd[q]);
        }
    }
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
    if ((rc = connect_retry(master_addr, master_port, s->deadline, &fd0, who)))
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
    if ((rc = client_handshake(s, fd0, HT_REGISTER, 0, 0, who)))
        goto out;
    struct reader r = {0};
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
            int fd;
            if ((rc = connect_retry(q == 0 ? master_addr : qaddr, qport, s->deadline, &fd, qwho)))
                goto out;
            if ((rc = client_handshake(s, fd, HT_CONNECT, q, st, qwho)) ||
                (rc = add_link(s, fd, q, st))) {
                close(fd);
                goto out;
            }
            epipe_log_debug((int)s->rank, "tcp", "connected to %s, stream %u", qwho, st);
        }
    }
    rc = accept_loop(s, NULL, lfd);
out:
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
    struct setup s = {.rank = rank, .size = size, .o = o, .key = key,
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
