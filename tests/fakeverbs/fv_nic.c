/* fakeverbs: the per-process "NIC": a thread on an abstract unix socket (named by the
 * GID) that executes peers' sends and writes on local memory and acks them back. */
#define _GNU_SOURCE
#include "fv_impl.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static char fv_tag_listen, fv_tag_kick;

void fv_gid_sockname(const union ibv_gid *gid, char *name, size_t cap)
{
    uint32_t pid, inst;
    memcpy(&pid, gid->raw + 4, 4);
    memcpy(&inst, gid->raw + 8, 4);
    name[0] = '\0'; /* abstract namespace */
    snprintf(name + 1, cap - 1, "epipe-fakeverbs-%u-%08x", pid, inst);
}

static socklen_t fv_addr(const char *name, struct sockaddr_un *sa)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    size_t n = 1 + strlen(name + 1);
    memcpy(sa->sun_path, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
}

void fv_nic_kick(void)
{
    uint64_t one = 1;
    (void)!write(fv_nic.kickfd, &one, sizeof one);
}

void fv_conn_events(struct fv_conn *c)
{
    uint32_t ev = c->want_out ? EPOLLOUT : 0;
    if (c->outgoing || !c->stalled)
        ev |= EPOLLIN;
    if (ev == c->ev_mask)
        return;
    struct epoll_event e = {.events = ev, .data.ptr = c};
    epoll_ctl(fv_nic.epfd, EPOLL_CTL_MOD, c->fd, &e);
    c->ev_mask = ev;
}

int fv_conn_append(struct fv_conn *c, const void *p, size_t n)
{
    if (c->tx_len + n > c->tx_cap && c->tx_off) {
        memmove(c->tx, c->tx + c->tx_off, c->tx_len - c->tx_off);
        c->tx_len -= c->tx_off;
        c->tx_off = 0;
    }
    if (c->tx_len + n > c->tx_cap) {
        size_t ncap = c->tx_cap ? c->tx_cap * 2 : 65536;
        while (ncap < c->tx_len + n)
            ncap *= 2;
        unsigned char *nb = realloc(c->tx, ncap);
        if (!nb)
            return -1;
        c->tx = nb;
        c->tx_cap = ncap;
    }
    if (n)
        memcpy(c->tx + c->tx_len, p, n);
    c->tx_len += n;
    return 0;
}

/* Sends what is queued without blocking; -1 when the peer is gone. */
int fv_conn_flush(struct fv_conn *c)
{
    while (c->tx_off < c->tx_len) {
        ssize_t w = send(c->fd, c->tx + c->tx_off, c->tx_len - c->tx_off,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w > 0) {
            c->tx_off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            c->want_out = 1;
            fv_conn_events(c);
            return 0;
        }
        return -1;
    }
    c->tx_off = c->tx_len = 0;
    if (c->tx_cap > (1u << 20)) {
        free(c->tx);
        c->tx = NULL;
        c->tx_cap = 0;
    }
    c->want_out = 0;
    fv_conn_events(c);
    return 0;
}

int fv_conn_open(struct fv_qp *q)
{
    char name[64];
    struct sockaddr_un sa;
    fv_gid_sockname(&q->dgid, name, sizeof name);
    socklen_t len = fv_addr(name, &sa);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&sa, len) != 0) {
        fv_log("qp %u: cannot reach the peer NIC %s: %s", q->qp.qp_num, name + 1, strerror(errno));
        close(fd);
        return -1;
    }
    struct fv_conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(fd);
        return -1;
    }
    c->fd = fd;
    c->outgoing = 1;
    c->qp = q;
    struct fv_hello h = {.magic = FV_HELLO_MAGIC, .src_qpn = q->qp.qp_num, .dst_qpn = q->dest_qpn};
    memcpy(h.src_gid, fv_nic.gid.raw, 16);
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
    c->ev_mask = EPOLLIN;
    if (fv_conn_append(c, &h, sizeof h) != 0 ||
        epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fd, &e) != 0) {
        free(c->tx);
        free(c);
        close(fd);
        return -1;
    }
    q->out = c;
    if (fv_conn_flush(c) != 0) {
        fv_conn_close(c);
        q->out = NULL;
        return -1;
    }
    return 0;
}

void fv_conn_close(struct fv_conn *c)
{
    epoll_ctl(fv_nic.epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    c->dead = 1;
    c->qp = NULL;
    if (fv_nic.running) {
        c->next = fv_nic.graveyard; /* events already fetched may still name it */
        fv_nic.graveyard = c;
    } else {
        free(c->tx);
        free(c);
    }
}

/* ---- the NIC thread ---- */

static void fv_rx_read(struct fv_conn *c)
{
    for (int round = 0; round < 8 && !c->dead && !c->stalled; round++) {
        if (c->rx_off) {
            memmove(c->rx, c->rx + c->rx_off, c->rx_len - c->rx_off);
            c->rx_len -= c->rx_off;
            c->rx_off = 0;
        }
        ssize_t r = read(c->fd, c->rx + c->rx_len, FV_RXBUF - c->rx_len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r <= 0) {
            c->dead = 1; /* the requester closed (its QP failed, or its process is gone) */
            return;
        }
        c->rx_len += (size_t)r;
        if (fv_rx_process(c) != 0) {
            c->dead = 1;
            return;
        }
        if ((size_t)r < FV_RXBUF / 2)
            return;
    }
}

static void fv_tx_read_acks(struct fv_conn *c)
{
    unsigned char buf[4096];
    for (;;) {
        memcpy(buf, c->ackpart, c->ackpart_len);
        ssize_t r = read(c->fd, buf + c->ackpart_len, sizeof buf - c->ackpart_len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r <= 0) {
            fv_qp_peer_gone(c->qp);
            return;
        }
        size_t n = c->ackpart_len + (size_t)r, off = 0;
        struct fv_qp *q = c->qp;
        while (n - off >= sizeof(struct fv_ack)) {
            struct fv_ack a;
            memcpy(&a, buf + off, sizeof a);
            off += sizeof a;
            fv_qp_acked(q, a.count, (enum ibv_wc_status)a.status);
            if (c->dead)
                return; /* the QP failed and closed this connection */
        }
        c->ackpart_len = n - off;
        memcpy(c->ackpart, buf + off, c->ackpart_len);
        if ((size_t)r < sizeof buf - sizeof(struct fv_ack))
            return; /* drained: spare the read that would say EAGAIN */
    }
}

static void fv_accept_all(void)
{
    for (;;) {
        int fd = accept4(fv_nic.lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        struct fv_conn *c = calloc(1, sizeof *c);
        unsigned char *rx = c ? malloc(FV_RXBUF) : NULL;
        struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
        if (!rx || epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fd, &e) != 0) {
            free(rx);
            free(c);
            close(fd);
            continue;
        }
        c->fd = fd;
        c->rx = rx;
        c->ev_mask = EPOLLIN;
        c->next = fv_nic.conns;
        fv_nic.conns = c;
    }
}

static void fv_rx_free(struct fv_conn *c)
{
    if (c->stalled)
        __atomic_sub_fetch(&fv_nic.nstalled, 1, __ATOMIC_RELAXED);
    epoll_ctl(fv_nic.epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->rx);
    free(c->tx);
    free(c);
}

static void fv_rx_kill(struct fv_conn *c)
{
    c->dead = 1; /* freed by the NIC thread's sweep; out of epoll now */
    epoll_ctl(fv_nic.epfd, EPOLL_CTL_DEL, c->fd, NULL);
}

/* Handles what epoll reported (fv_nic.lock held). */
static void fv_nic_handle(const struct epoll_event *ev, int n)
{
    for (int i = 0; i < n; i++) {
        void *p = ev[i].data.ptr;
        if (p == &fv_tag_kick) {
            uint64_t v;
            (void)!read(fv_nic.kickfd, &v, sizeof v);
            continue;
        }
        if (p == &fv_tag_listen) {
            fv_accept_all();
            continue;
        }
        struct fv_conn *c = p;
        if (c->dead)
            continue;
        if (c->outgoing) {
            if (ev[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP))
                fv_tx_read_acks(c);
            if (!c->dead && (ev[i].events & EPOLLOUT) && fv_conn_flush(c) != 0)
                fv_qp_peer_gone(c->qp);
            continue;
        }
        if ((ev[i].events & EPOLLOUT) && fv_conn_flush(c) != 0)
            fv_rx_kill(c);
        if (!c->dead && c->stalled && (ev[i].events & (EPOLLERR | EPOLLHUP)))
            fv_rx_kill(c); /* the requester is gone: nothing will retry the stalled request */
        if (!c->dead && (ev[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)))
            fv_rx_read(c);
        if (c->dead)
            fv_rx_kill(c);
    }
    if (fv_nic.nstalled)
        for (struct fv_conn *c = fv_nic.conns; c; c = c->next)
            if (c->stalled && !c->dead && fv_rx_process(c) != 0)
                fv_rx_kill(c);
}

/* Frees dead connections: only the NIC thread, after handling the events it
 * fetched (which may still name them). */
static void fv_nic_sweep(void)
{
    for (struct fv_conn **pp = &fv_nic.conns; *pp;) {
        struct fv_conn *c = *pp;
        if (c->dead) {
            *pp = c->next;
            fv_rx_free(c);
        } else {
            pp = &c->next;
        }
    }
    while (fv_nic.graveyard) {
        struct fv_conn *c = fv_nic.graveyard;
        fv_nic.graveyard = c->next;
        free(c->tx);
        free(c);
    }
}

/* Called by ibv_poll_cq when it found nothing: a thread that busy-polls drives the
 * NIC itself, so small messages need no thread wake-ups (fv_nic.lock not held). */
void fv_nic_progress(int claim)
{
    if (pthread_mutex_trylock(&fv_nic.lock) != 0)
        return;
    if (fv_nic.running && !fv_nic.stop) {
        struct epoll_event ev[32];
        if (claim)
            __atomic_store_n(&fv_nic.poll_until, fv_now_ns() + 200000u, __ATOMIC_RELAXED);
        int n = epoll_wait(fv_nic.epfd, ev, 32, 0);
        fv_nic_handle(ev, n);
    }
    pthread_mutex_unlock(&fv_nic.lock);
}

static void *fv_nic_main(void *arg)
{
    (void)arg;
    struct epoll_event ev[64];
    for (;;) {
        /* while a thread busy-polls, it does the work and this one stays out of its way */
        uint64_t until = __atomic_load_n(&fv_nic.poll_until, __ATOMIC_RELAXED), now = fv_now_ns();
        int n = 0;
        if (until > now) {
            /* a kick (stop, or a poller going to sleep) ends the wait early */
            struct timespec ts = {0, (long)(until - now < 200000u ? until - now : 200000u)};
            struct pollfd k = {.fd = fv_nic.kickfd, .events = POLLIN};
            if (ppoll(&k, 1, &ts, NULL) > 0) {
                uint64_t v;
                (void)!read(fv_nic.kickfd, &v, sizeof v);
            }
        } else {
            int timeout = __atomic_load_n(&fv_nic.nstalled, __ATOMIC_RELAXED) ? 1 : -1;
            n = epoll_wait(fv_nic.epfd, ev, 64, timeout);
        }
        pthread_mutex_lock(&fv_nic.lock);
        if (fv_nic.stop) {
            pthread_mutex_unlock(&fv_nic.lock);
            return NULL;
        }
        fv_nic_handle(ev, n < 0 ? 0 : n);
        fv_nic_sweep();
        pthread_mutex_unlock(&fv_nic.lock);
    }
}

int fv_nic_start(void)
{
    static uint32_t instance;
    uint32_t pid = (uint32_t)getpid();
    uint32_t inst = (uint32_t)(fv_now_ns() ^ (++instance * 0x9e3779b9u));
    memset(&fv_nic.gid, 0, sizeof fv_nic.gid);
    fv_nic.gid.raw[0] = 0xfe;
    fv_nic.gid.raw[1] = 0x80;
    fv_nic.gid.raw[2] = 'f';
    fv_nic.gid.raw[3] = 'v';
    memcpy(fv_nic.gid.raw + 4, &pid, 4);
    memcpy(fv_nic.gid.raw + 8, &inst, 4);
    fv_gid_sockname(&fv_nic.gid, fv_nic.sockname, sizeof fv_nic.sockname);
    if (fv_nic.next_qpn == 0)
        fv_nic.next_qpn = (pid * 977u) & 0xffffff;
    struct sockaddr_un sa;
    socklen_t len = fv_addr(fv_nic.sockname, &sa);
    fv_nic.epfd = epoll_create1(EPOLL_CLOEXEC);
    fv_nic.kickfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    fv_nic.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc = 0;
    if (fv_nic.epfd < 0 || fv_nic.kickfd < 0 || fv_nic.lfd < 0 ||
        bind(fv_nic.lfd, (struct sockaddr *)&sa, len) != 0 || listen(fv_nic.lfd, 4096) != 0)
        rc = errno ? errno : EIO;
    struct epoll_event e1 = {.events = EPOLLIN, .data.ptr = &fv_tag_listen};
    struct epoll_event e2 = {.events = EPOLLIN, .data.ptr = &fv_tag_kick};
    if (!rc && (epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fv_nic.lfd, &e1) != 0 ||
                epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fv_nic.kickfd, &e2) != 0))
        rc = errno;
    fv_nic.stop = 0;
    if (!rc)
        rc = pthread_create(&fv_nic.thread, NULL, fv_nic_main, NULL);
    if (rc) {
        fv_log("cannot start the NIC thread: %s", strerror(rc));
        if (fv_nic.lfd >= 0)
            close(fv_nic.lfd);
        if (fv_nic.kickfd >= 0)
            close(fv_nic.kickfd);
        if (fv_nic.epfd >= 0)
            close(fv_nic.epfd);
        fv_nic.lfd = fv_nic.kickfd = fv_nic.epfd = -1;
        return rc;
    }
    fv_nic.running = 1;
    return 0;
}

void fv_nic_stop(void)
{
    pthread_mutex_lock(&fv_nic.lock);
    fv_nic.stop = 1;
    fv_nic_kick();
    pthread_mutex_unlock(&fv_nic.lock);
    pthread_join(fv_nic.thread, NULL);
    pthread_mutex_lock(&fv_nic.lock);
    fv_nic.running = 0;
    while (fv_nic.conns) {
        struct fv_conn *c = fv_nic.conns;
        fv_nic.conns = c->next;
        fv_rx_free(c);
    }
    while (fv_nic.graveyard) {
        struct fv_conn *c = fv_nic.graveyard;
        fv_nic.graveyard = c->next;
        free(c->tx);
        free(c);
    }
    close(fv_nic.lfd);
    close(fv_nic.kickfd);
    close(fv_nic.epfd);
    fv_nic.lfd = fv_nic.kickfd = fv_nic.epfd = -1;
    if (fv_nic.nmrs) {
        int live = 0;
        for (uint32_t i = 0; i < fv_nic.nmrs; i++)
            live += fv_nic.mrs[i] != NULL;
        if (!live) {
            free(fv_nic.mrs);
            free(fv_nic.mrgen);
            fv_nic.mrs = NULL;
            fv_nic.mrgen = NULL;
            fv_nic.nmrs = 0;
        }
    }
    pthread_mutex_unlock(&fv_nic.lock);
}

/* A forked child starts without a NIC: the parent's thread is not there, and the
 * child must not hold the parent's sockets open (a killed parent would then never
 * look gone to its peers). The parent's objects stay unusable in the child, as
 * verbs objects are after fork() without ibv_fork_init(). */
static void fv_atfork_child(void)
{
    pthread_mutex_init(&fv_nic.lock, NULL);
    for (struct fv_conn *c = fv_nic.conns; c; c = c->next)
        close(c->fd);
    for (int i = 0; i < 256; i++)
        for (struct fv_qp *q = fv_nic.qps[i]; q; q = q->hnext)
            if (q->out)
                close(q->out->fd);
    if (fv_nic.epfd >= 0) {
        close(fv_nic.lfd);
        close(fv_nic.kickfd);
        close(fv_nic.epfd);
    }
    fv_nic.lfd = fv_nic.kickfd = fv_nic.epfd = -1;
    fv_nic.conns = fv_nic.graveyard = NULL;
    memset(fv_nic.qps, 0, sizeof fv_nic.qps);
    fv_nic.mrs = NULL;
    fv_nic.mrgen = NULL;
    fv_nic.nmrs = 0;
    fv_nic.users = 0;
    fv_nic.running = 0;
    fv_nic.nstalled = 0;
    fv_nic.next_qpn = 0;
    fv_live_reset();
}

__attribute__((constructor)) static void fv_init(void)
{
    pthread_atfork(NULL, NULL, fv_atfork_child);
}
