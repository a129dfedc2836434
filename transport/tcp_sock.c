/* TCP connection setup, sockets: addresses, listening, connecting with
 * retries until the init deadline, and the socket options links run with. */
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
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tcp_setup.h"

int epipe_tcp_left_ms(int64_t deadline)
{
    int64_t l = deadline - epipe_now_ms();
    return l < 0 ? 0 : l > 1000000 ? 1000000 : (int)l;
}

static void set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

void epipe_tcp_sock_text(const struct sockaddr *sa, char *buf, size_t cap)
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

void epipe_tcp_host_only(const struct sockaddr *sa, char *buf, size_t cap)
{
    buf[0] = '\0';
    if (sa->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, buf, (socklen_t)cap);
    else if (sa->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, buf, (socklen_t)cap);
}

int epipe_tcp_resolve(const char *host, unsigned port, int passive, struct sockaddr_storage *out,
                      socklen_t *len)
{
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = passive ? AI_PASSIVE : 0};
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    struct addrinfo *res;
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc) {
        /* A name that does not resolve is the caller's; the resolver
         * running out of memory or failing for now is not. */
        int status = rc == EAI_MEMORY                      ? EPIPE_ENOMEM
                     : rc == EAI_AGAIN || rc == EAI_SYSTEM ? EPIPE_EIO
                                                           : EPIPE_EINVAL;
        return epipe_fail(status, "cannot resolve '%s': %s", host ? host : "(any)",
                          rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
    }
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

int epipe_tcp_is_loopback(const struct sockaddr_storage *ss)
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
                epipe_tcp_host_only(i->ifa_addr, out, cap);
                found = 1;
            }
    freeifaddrs(ifs);
    if (!found)
        return epipe_fail(EPIPE_EINVAL,
                          "EPIPE_IFNAME: interface '%s' has no IP address (or does "
                          "not exist)",
                          ifname);
    return EPIPE_OK;
}

/* A listening socket on host:port (host NULL: every address of family). */
int epipe_tcp_open_listener(const char *host, unsigned port, int family, int *fd_out,
                            unsigned *port_out, char *where, size_t where_cap)
{
    struct sockaddr_storage ss;
    socklen_t len;
    int rc;
    if (host) {
        if ((rc = epipe_tcp_resolve(host, port, 1, &ss, &len)))
            return rc;
    } else {
        memset(&ss, 0, sizeof ss);
        if (family == AF_INET6) {
            struct sockaddr_in6 *in = (struct sockaddr_in6 *)&ss;
            in->sin6_family = AF_INET6, in->sin6_addr = in6addr_any,
            in->sin6_port = htons((uint16_t)port);
            len = sizeof *in;
        } else {
            struct sockaddr_in *in = (struct sockaddr_in *)&ss;
            in->sin_family = AF_INET, in->sin_addr.s_addr = htonl(INADDR_ANY),
            in->sin_port = htons((uint16_t)port);
            len = sizeof *in;
        }
    }
    epipe_tcp_sock_text((struct sockaddr *)&ss, where, where_cap);
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return epipe_fail(EPIPE_EIO, "cannot create a socket: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, len) != 0) {
        int e = errno;
        close(fd);
        return epipe_fail(EPIPE_EIO, "cannot listen on %s: %s%s", where, strerror(e),
                          e == EADDRINUSE      ? " (another job or program holds this port: pick "
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
    epipe_tcp_sock_text((struct sockaddr *)&ss, where, where_cap);
    *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    set_nonblock(fd);
    *fd_out = fd;
    return EPIPE_OK;
}

/* TCP_NODELAY, non-blocking, and a send buffer of at least 4 MiB: the
 * kernel's starting size (16 KiB) makes a caller's direct write of a
 * mid-sized message fall short and go through the progress thread. */
void epipe_tcp_tune(int fd)
{
    int one = 1, snd = 0, want = 4 << 20;
    socklen_t len = sizeof snd;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &snd, &len) == 0 && snd < want)
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
    set_nonblock(fd);
}

/* Connects to host:port, retrying while nobody listens yet, until deadline;
 * between tries it listens to rank 0 (epipe_tcp_pause_ms), which may say the rank
 * this one waits for has failed. */
int epipe_tcp_connect_retry(struct epipe_tcp_rdv *s, const char *host, unsigned port,
                            int64_t deadline, int *fd_out, const char *who)
{
    struct sockaddr_storage ss;
    socklen_t len;
    int rc = epipe_tcp_resolve(host, port, 0, &ss, &len);
    if (rc)
        return epipe_tcp_refail(rc, "cannot connect to %s", who);
    char where[80];
    epipe_tcp_sock_text((struct sockaddr *)&ss, where, sizeof where);
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
                int n = poll(&p, 1, epipe_tcp_left_ms(deadline));
                socklen_t el = sizeof err;
                err = 0;
                if (n <= 0)
                    err = ETIMEDOUT;
                else
                    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
            }
        }
        if (!err) {
            epipe_tcp_tune(fd);
            *fd_out = fd;
            return EPIPE_OK;
        }
        close(fd);
        last = err;
        if (err != ECONNREFUSED && err != ETIMEDOUT && err != ENETUNREACH && err != EHOSTUNREACH &&
            err != ECONNRESET && err != EAGAIN)
            return epipe_fail(EPIPE_EIO, "cannot connect to %s (%s): %s", who, where,
                              strerror(err));
        if (epipe_now_ms() + backoff >= deadline)
            break;
        if ((rc = epipe_tcp_pause_ms(s, backoff)))
            return rc;
        backoff = backoff < 500 ? backoff * 2 : 1000;
    }
    return epipe_fail(EPIPE_ETIMEDOUT,
                      "cannot reach %s: %s, still after retrying until the "
                      "init timeout (is it running? a firewall?)",
                      who, strerror(last));
}

int epipe_tcp_choose_addr(const epipe_tcp_opts *o, char *out, size_t cap, int *chosen)
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
