/* The TCP transport: one progress thread per communicator that writes
 * queued messages, reads and checks arriving ones, and watches liveness. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../lib/log.h"
#include "../lib/wire/crc32c.h"
#include "tcp_impl.h"

#define STAGING (256 * 1024)   /* read buffer for headers and small messages */
#define DIRECT_MAX (256 * 1024) /* the caller writes messages up to this itself */
#define MAX_IOV 64
#define RECV_CHUNK (1024 * 1024) /* read at most this much at once, to CRC it in cache */

struct tcp;

struct conn {
    struct tcp *t;
    int fd; /* -1 once closed; changed under txlock */
    unsigned peer, stream;

    pthread_mutex_t txlock; /* guards the fields down to close_after */
    epipe_msg *txq, *txq_tail;
    size_t tx_off;      /* bytes of txq's head already written */
    uint64_t tx_queued; /* bytes waiting, read without the lock to pick a stream */
    int64_t last_tx;
    int bye_queued, shut, close_after;

    /* Progress thread only. */
    uint8_t hbuf[EPIPE_WIRE_HEADER_MAX];
    size_t hgot, hlen;
    epipe_msg *rx;
    size_t rx_got, rx_need;
    uint32_t rx_crc; /* CRC32C of the payload bytes got so far */
    int offload;     /* the CRC helper checksums this payload */
    int64_t last_rx;
    int bye, clean;
};

/* A helper thread checksums large incoming payloads while the progress
 * thread goes on copying the next bytes out of the socket: on a receiver the
 * two costs would otherwise add up (CRC32C runs at about the speed of the
 * kernel's copy). One payload at a time; others are checksummed inline. */
#define OFFLOAD_MIN ((size_t)4 << 20)
struct crc_helper {
    pthread_t thread;
    int started, stop, busy;
    pthread_mutex_t lock;
    pthread_cond_t work, progress;
    struct conn *owner; /* NULL: free */
    const uint8_t *base;
    size_t done, avail;
    uint32_t crc;
};

struct tcp {
    epipe_comm *c;
    struct crc_helper h;
    epipe_tcp_opts o;
    struct conn *conns;
    unsigned nconns;
    unsigned *first, *count; /* [size]: peer p owns conns[first[p] .. +count[p]) */
    unsigned *rr;
    int evfd;
    pthread_t thread;
    int started;
    int stop; /* atomic */
    uint8_t *staging;
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void wake(struct tcp *t)
{
    uint64_t one = 1;
    ssize_t n = write(t->evfd, &one, sizeof one);
    (void)n;
}

static void *crc_helper_main(void *arg)
{
    struct crc_helper *h = arg;
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (!h->stop && (!h->owner || h->done == h->avail))
            pthread_cond_wait(&h->work, &h->lock);
        if (h->stop)
            break;
        const uint8_t *base = h->base;
        size_t from = h->done, n = h->avail - h->done;
        uint32_t crc = h->crc;
        if (n > RECV_CHUNK)
            n = RECV_CHUNK;
        h->busy = 1;
        pthread_mutex_unlock(&h->lock);
        crc = epipe_crc32c(crc, base + from, n);
        pthread_mutex_lock(&h->lock);
        h->busy = 0;
        if (h->owner && h->base == base) {
            h->crc = crc;
            h->done = from + n;
        }
        pthread_cond_broadcast(&h->progress);
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

/* Hands k's payload to the helper; 0 if it is busy (then: inline). */
static int offload_begin(struct tcp *t, struct conn *k)
{
    struct crc_helper *h = &t->h;
    if (!h->started) {
        if (pthread_mutex_init(&h->lock, NULL))
            return 0;
        pthread_cond_init(&h->work, NULL);
        pthread_cond_init(&h->progress, NULL);
        if (pthread_create(&h->thread, NULL, crc_helper_main, h)) {
            pthread_cond_destroy(&h->work);
            pthread_cond_destroy(&h->progress);
            pthread_mutex_destroy(&h->lock);
            h->started = -1; /* never again */
            return 0;
        }
        h->started = 1;
    }
    if (h->started < 0)
        return 0;
    pthread_mutex_lock(&h->lock);
    int ok = h->owner == NULL;
    if (ok) {
        h->owner = k;
        h->base = k->rx->data + k->hlen;
        h->done = h->avail = 0;
        h->crc = 0;
    }
    pthread_mutex_unlock(&h->lock);
    return ok;
}

static void offload_add(struct tcp *t, size_t n)
{
    pthread_mutex_lock(&t->h.lock);
    t->h.avail += n;
    pthread_cond_signal(&t->h.work);
    pthread_mutex_unlock(&t->h.lock);
}

/* Waits for the helper to finish k's payload; its CRC. */
static uint32_t offload_end(struct tcp *t)
{
    struct crc_helper *h = &t->h;
    pthread_mutex_lock(&h->lock);
    while (h->done < h->avail)
        pthread_cond_wait(&h->progress, &h->lock);
    uint32_t crc = h->crc;
    h->owner = NULL;
    pthread_mutex_unlock(&h->lock);
    return crc;
}

/* Takes k's payload back before it is freed. */
static void offload_cancel(struct tcp *t)
{
    struct crc_helper *h = &t->h;
    pthread_mutex_lock(&h->lock);
    h->owner = NULL;
    while (h->busy)
        pthread_cond_wait(&h->progress, &h->lock);
    pthread_mutex_unlock(&h->lock);
}

static int64_t timeout_of(struct tcp *t)
{
    return __atomic_load_n(&t->c->timeout_ms, __ATOMIC_RELAXED);
}

static int64_t heartbeat_of(struct tcp *t)
{
    if (t->o.heartbeat_ms)
        return t->o.heartbeat_ms;
    int64_t h = timeout_of(t) / 4;
    return h < 1 ? 1 : h > 5000 ? 5000 : h;
}

/* A framed message without tensor: heartbeat, bye or error. */
static epipe_msg *control_msg(struct tcp *t, unsigned kind, unsigned dst, unsigned about,
                              int status, const char *text)
{
    size_t len = text ? strlen(text) : 0;
    epipe_msg *m = epipe_msg_new(len);
    if (!m)
        return NULL;
    memset(&m->hdr, 0, sizeof m->hdr);
    m->hdr.kind = (uint8_t)kind;
    m->hdr.src_stage = t->c->rank;
    m->hdr.dst_stage = dst;
    m->hdr.micro_batch = about;
    m->hdr.step = (uint64_t)(-(int64_t)status);
    if (len)
        memcpy(epipe_msg_payload(m), text, len);
    if (epipe_msg_seal(m, len)) {
        epipe_msg_free(m);
        return NULL;
    }
    return m;
}

static void free_queue(struct conn *k)
{
    for (epipe_msg *m = k->txq, *n; m; m = n) {
        n = m->next;
        epipe_msg_free(m);
    }
    k->txq = k->txq_tail = NULL;
    k->tx_off = 0;
    __atomic_store_n(&k->tx_queued, 0, __ATOMIC_RELAXED);
}

/* Closes a connection; with abrupt, unsent data is dropped and an RST sent. */
static void conn_close(struct conn *k, int abrupt)
{
    pthread_mutex_lock(&k->txlock);
    if (k->fd >= 0) {
        if (abrupt) {
            struct linger lg = {1, 0};
            setsockopt(k->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        }
        close(k->fd);
        __atomic_store_n(&k->fd, -1, __ATOMIC_RELAXED);
    }
    free_queue(k);
    pthread_mutex_unlock(&k->txlock);
    if (k->offload)
        offload_cancel(k->t);
    k->offload = 0;
    epipe_msg_free(k->rx);
    k->rx = NULL;
    k->hgot = k->hlen = 0;
}

/* Queues m on k; takes ownership. The caller's thread writes small messages
 * at once when nothing is queued before them. */
static int conn_enqueue(struct tcp *t, struct conn *k, epipe_msg *m, int direct)
{
    pthread_mutex_lock(&k->txlock);
    if (k->fd < 0 || k->bye_queued) {
        pthread_mutex_unlock(&k->txlock);
        epipe_msg_free(m);
        return EPIPE_EPEER;
    }
    size_t off = 0;
    int was_empty = k->txq == NULL;
    if (was_empty && direct && m->len <= DIRECT_MAX) {
        ssize_t n = send(k->fd, m->data, m->len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            off = (size_t)n;
            k->last_tx = now_ms();
        }
        if (off == m->len) {
            pthread_mutex_unlock(&k->txlock);
            epipe_msg_free(m);
            return EPIPE_OK;
        }
    }
    m->next = NULL;
    if (k->txq_tail)
        k->txq_tail->next = m;
    else
        k->txq = m, k->tx_off = off;
    k->txq_tail = m;
    __atomic_add_fetch(&k->tx_queued, m->len - off, __ATOMIC_RELAXED);
    if (m->hdr.kind == EPIPE_WIRE_BYE)
        k->bye_queued = 1;
    pthread_mutex_unlock(&k->txlock);
    if (was_empty)
        wake(t);
    return EPIPE_OK;
}

/* The live connection to peer with the fewest bytes waiting, or NULL. */
static struct conn *pick(struct tcp *t, unsigned peer)
{
    struct conn *best = NULL;
    uint64_t least = UINT64_MAX;
    unsigned n = t->count[peer], start = n ? __atomic_fetch_add(&t->rr[peer], 1, __ATOMIC_RELAXED) : 0;
    for (unsigned i = 0; i < n; i++) {
        struct conn *k = &t->conns[t->first[peer] + (start + i) % n];
        uint64_t q = __atomic_load_n(&k->tx_queued, __ATOMIC_RELAXED);
        if (__atomic_load_n(&k->fd, __ATOMIC_RELAXED) >= 0 && q < least)
            best = k, least = q;
    }
    return best;
}

static int tcp_send(epipe_comm *c, unsigned peer, epipe_msg *m)
{
    struct tcp *t = c->tp;
    if (!t->count[peer]) {
        epipe_msg_free(m);
        return epipe_fail_into(c->msg, EPIPE_EINVAL,
                               "rank %u: no connection to rank %u: topology=pipeline joins "
                               "neighbours and rank 0 (use topology=mesh)", c->rank, peer);
    }
    struct conn *k = pick(t, peer);
    if (!k || conn_enqueue(t, k, m, 1) != EPIPE_OK) {
        if (!k)
            epipe_msg_free(m);
        return epipe_fail_into(c->msg, EPIPE_EPEER, "rank %u: the connection to rank %u is closed",
                               c->rank, peer);
    }
    return EPIPE_OK;
}

/* Sends an ERROR about rank `about` to peer (best effort). */
static void send_error_to(struct tcp *t, unsigned peer, unsigned about, int status, const char *why)
{
    if (!t->count[peer])
        return;
    epipe_msg *m = control_msg(t, EPIPE_WIRE_ERROR, peer, about, status, why);
    struct conn *k = m ? pick(t, peer) : NULL;
    if (k)
        conn_enqueue(t, k, m, 0);
    else
        epipe_msg_free(m);
}

/* Marks peer failed (once), closes its connections and tells the others:
 * rank 0 relays to everyone, other ranks report to rank 0. */
static void peer_failed(struct tcp *t, unsigned peer, int status, const char *why)
{
    epipe_comm *c = t->c;
    pthread_mutex_lock(&c->lock);
    int was_up = c->peer_state[peer] == EPIPE_PEER_UP, aborted = c->aborted;
    pthread_mutex_unlock(&c->lock);
    if (!was_up)
        return;
    epipe_log_msg(aborted ? EPIPE_LOG_INFO : EPIPE_LOG_WARN, (int)c->rank, "tcp",
                  "rank %u failed: %s", peer, why);
    if (status == EPIPE_EPEER)
        epipe_comm_peer_down(c, peer, EPIPE_PEER_FAILED, why);
    else
        epipe_comm_peer_failed(c, peer, status, why);
    for (unsigned i = 0; i < t->count[peer]; i++)
        conn_close(&t->conns[t->first[peer] + i], 0);
    char text[EPIPE_ERRMSG_MAX];
    snprintf(text, sizeof text, "rank %u failed: %s", peer, why);
    if (c->rank == 0) {
        for (unsigned q = 1; q < c->size; q++)
            if (q != peer)
                send_error_to(t, q, peer, EPIPE_EPEER, text);
    } else if (peer != 0) {
        send_error_to(t, 0, peer, EPIPE_EPEER, text);
    }
}

/* A connection ended: cleanly after a BYE, or not. */
static void conn_ended(struct tcp *t, struct conn *k, const char *how)
{
    epipe_comm *c = t->c;
    unsigned peer = k->peer;
    char why[160];
    pthread_mutex_lock(&k->txlock);
    int leaving = k->bye_queued;
    pthread_mutex_unlock(&k->txlock);
    if (leaving && !k->bye) { /* it closes because this rank said goodbye */
        conn_close(k, 0);
        return;
    }
    if (k->hgot || k->rx) {
        snprintf(why, sizeof why, "stream %u was cut in the middle of a message (%zu of %zu "
                                  "payload bytes)", k->stream, k->rx_got, k->rx ? k->rx_need : 0);
        conn_close(k, 0);
        peer_failed(t, peer, EPIPE_EPEER, why);
        return;
    }
    if (!k->bye) {
        snprintf(why, sizeof why, "%s without a goodbye (crashed or killed?)", how);
        conn_close(k, 0);
        peer_failed(t, peer, EPIPE_EPEER, why);
        return;
    }
    k->clean = 1;
    conn_close(k, 0);
    for (unsigned i = 0; i < t->count[peer]; i++)
        if (!t->conns[t->first[peer] + i].clean)
            return;
    epipe_log_debug((int)c->rank, "tcp", "rank %u left", peer);
    epipe_comm_peer_down(c, peer, EPIPE_PEER_LEFT, "");
}

static void corrupt(struct tcp *t, struct conn *k, int status, const char *detail)
{
    char why[96];
    snprintf(why, sizeof why, "%s from it: %s", epipe_status_name(status), detail);
    unsigned peer = k->peer;
    conn_close(k, 1);
    peer_failed(t, peer, status, why);
}

/* A whole message has arrived on k: check it and act on it. */
static void finish(struct tcp *t, struct conn *k)
{
    epipe_comm *c = t->c;
    epipe_msg *m = k->rx;
    if (k->offload)
        k->rx_crc = offload_end(t);
    k->offload = 0;
    k->rx = NULL;
    k->hgot = k->hlen = 0;
    int rc = epipe_wire_check_payload_crc(&m->hdr, m->data + m->hdr.header_len, k->rx_need,
                                          &k->rx_crc);
    if (rc) {
        char detail[EPIPE_ERRMSG_MAX];
        snprintf(detail, sizeof detail, "%s", epipe_last_error());
        epipe_msg_free(m);
        corrupt(t, k, rc, detail);
        return;
    }
    m->len = m->hdr.header_len + k->rx_need;
    switch (m->hdr.kind) {
    case EPIPE_WIRE_ACTIVATION:
    case EPIPE_WIRE_GRADIENT:
        epipe_comm_deliver(c, m);
        return;
    case EPIPE_WIRE_HEARTBEAT:
        break;
    case EPIPE_WIRE_BYE:
        k->bye = 1;
        break;
    case EPIPE_WIRE_ERROR: {
        unsigned about = m->hdr.micro_batch;
        char why[EPIPE_ERRMSG_MAX];
        char by[32] = "";
        if (k->peer != about)
            snprintf(by, sizeof by, "reported by rank %u: ", k->peer);
        snprintf(why, sizeof why, "%s%.*s", by, (int)(k->rx_need < sizeof why ? k->rx_need : sizeof why),
                 (const char *)m->data + m->hdr.header_len);
        if (about < c->size && about != c->rank)
            peer_failed(t, about, EPIPE_EPEER, why);
        break;
    }
    default: {
        epipe_msg_free(m);
        corrupt(t, k, EPIPE_EPROTO, "a hello after the connection was set up");
        return;
    }
    }
    epipe_msg_free(m);
}

/* The header of the message on k is complete: parse it, make room. */
static int header_done(struct tcp *t, struct conn *k)
{
    epipe_comm *c = t->c;
    epipe_wire_limits lim = {.max_payload = __atomic_load_n(&c->max_message, __ATOMIC_RELAXED)};
    epipe_wire_header h;
    int rc = epipe_wire_parse_header(k->hbuf, k->hlen, &lim, &h);
    char detail[EPIPE_ERRMSG_MAX];
    if (rc) {
        snprintf(detail, sizeof detail, "%s", epipe_last_error());
        corrupt(t, k, rc, detail);
        return rc;
    }
    if (h.src_stage != k->peer || h.dst_stage != c->rank) {
        snprintf(detail, sizeof detail, "a message from rank %u to rank %u on its connection",
                 h.src_stage, h.dst_stage);
        corrupt(t, k, EPIPE_EPROTO, detail);
        return EPIPE_EPROTO;
    }
    k->rx = epipe_msg_new(k->hlen - EPIPE_WIRE_HEADER_SIZE + (size_t)h.payload_len);
    if (!k->rx) {
        snprintf(detail, sizeof detail, "no memory for a %llu-byte message",
                 (unsigned long long)h.payload_len);
        corrupt(t, k, EPIPE_ENOMEM, detail);
        return EPIPE_ENOMEM;
    }
    k->rx->hdr = h;
    memcpy(k->rx->data, k->hbuf, k->hlen);
    k->rx_got = 0;
    k->rx_crc = 0;
    k->rx_need = (size_t)h.payload_len;
    k->offload = k->rx_need >= OFFLOAD_MIN && offload_begin(t, k);
    if (k->rx_need == 0)
        finish(t, k);
    return EPIPE_OK;
}

/* Feeds bytes read into the staging buffer through k's parser. */
static void feed(struct tcp *t, struct conn *k, const uint8_t *p, size_t n)
{
    while (n && k->fd >= 0) {
        if (!k->rx) {
            size_t need = (k->hlen ? k->hlen : EPIPE_WIRE_PREFIX_SIZE) - k->hgot;
            size_t take = n < need ? n : need;
            memcpy(k->hbuf + k->hgot, p, take);
            k->hgot += take, p += take, n -= take;
            if (!k->hlen && k->hgot == EPIPE_WIRE_PREFIX_SIZE) {
                int rc = epipe_wire_header_length(k->hbuf, k->hgot, &k->hlen);
                if (rc) {
                    char detail[EPIPE_ERRMSG_MAX];
                    snprintf(detail, sizeof detail, "%s", epipe_last_error());
                    corrupt(t, k, rc, detail);
                    return;
                }
            }
            if (k->hlen && k->hgot == k->hlen && header_done(t, k))
                return;
        } else {
            size_t need = k->rx_need - k->rx_got;
            size_t take = n < need ? n : need;
            memcpy(k->rx->data + k->hlen + k->rx_got, p, take);
            if (k->offload)
                offload_add(t, take);
            else
                k->rx_crc = epipe_crc32c(k->rx_crc, p, take); /* while it is in cache */
            k->rx_got += take, p += take, n -= take;
            if (k->rx_got == k->rx_need)
                finish(t, k);
        }
    }
}

static void do_read(struct tcp *t, struct conn *k)
{
    for (int round = 0; round < 64 && k->fd >= 0; round++) {
        ssize_t n;
        if (k->rx && k->rx_need - k->rx_got >= STAGING) { /* straight into the message */
            size_t want = k->rx_need - k->rx_got;
            uint8_t *dst = k->rx->data + k->hlen + k->rx_got;
            n = recv(k->fd, dst, want < RECV_CHUNK ? want : RECV_CHUNK, MSG_DONTWAIT);
            if (n > 0) {
                k->last_rx = now_ms();
                if (k->offload)
                    offload_add(t, (size_t)n);
                else
                    k->rx_crc = epipe_crc32c(k->rx_crc, dst, (size_t)n);
                k->rx_got += (size_t)n;
                if (k->rx_got == k->rx_need)
                    finish(t, k);
                continue;
            }
        } else {
            n = recv(k->fd, t->staging, STAGING, MSG_DONTWAIT);
            if (n > 0) {
                k->last_rx = now_ms();
                feed(t, k, t->staging, (size_t)n);
                if (n < STAGING)
                    return;
                continue;
            }
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        char how[64];
        snprintf(how, sizeof how, "the connection %s%s", n == 0 ? "closed" : "failed: ",
                 n == 0 ? "" : strerror(errno));
        conn_ended(t, k, how);
        return;
    }
}

static void do_write(struct tcp *t, struct conn *k)
{
    epipe_msg *done = NULL;
    int failed = 0;
    pthread_mutex_lock(&k->txlock);
    while (k->txq && k->fd >= 0) {
        struct iovec iov[MAX_IOV];
        int n = 0;
        size_t off = k->tx_off;
        for (epipe_msg *m = k->txq; m && n < MAX_IOV; m = m->next, off = 0)
            iov[n++] = (struct iovec){m->data + off, m->len - off};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(k->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                failed = errno;
            break;
        }
        k->last_tx = now_ms();
        __atomic_sub_fetch(&k->tx_queued, (uint64_t)w, __ATOMIC_RELAXED);
        size_t left = (size_t)w;
        while (k->txq && left >= k->txq->len - k->tx_off) {
            left -= k->txq->len - k->tx_off;
            epipe_msg *m = k->txq;
            k->txq = m->next;
            if (!k->txq)
                k->txq_tail = NULL;
            k->tx_off = 0;
            m->next = done, done = m;
        }
        k->tx_off += left;
    }
    if (!k->txq && k->fd >= 0) {
        if ((k->bye_queued || k->close_after) && !k->shut) {
            shutdown(k->fd, SHUT_WR); /* the peer reads all we wrote, then EOF */
            k->shut = k->bye_queued = 1;
        }
    }
    pthread_mutex_unlock(&k->txlock);
    for (epipe_msg *m = done, *n; m; m = n) {
        n = m->next;
        epipe_msg_free(m);
    }
    if (failed) {
        char why[96];
        snprintf(why, sizeof why, "send on stream %u failed: %s", k->stream, strerror(failed));
        unsigned peer = k->peer;
        conn_close(k, 0);
        if (!k->bye)
            peer_failed(t, peer, EPIPE_EPEER, why);
    }
}

/* Heartbeats and liveness; returns ms until it needs to run again. */
static int64_t housekeeping(struct tcp *t, int64_t now)
{
    int64_t hb = heartbeat_of(t), to = timeout_of(t), next = hb;
    for (unsigned i = 0; i < t->nconns; i++) {
        struct conn *k = &t->conns[i];
        if (k->fd < 0)
            continue;
        if (!k->bye && now - k->last_rx > to) {
            char why[96];
            snprintf(why, sizeof why, "nothing heard from it for %lld ms (stream %u)",
                     (long long)(now - k->last_rx), k->stream);
            peer_failed(t, k->peer, EPIPE_ETIMEDOUT, why);
            continue;
        }
        int64_t until_dead = k->bye ? hb : to - (now - k->last_rx) + 1;
        pthread_mutex_lock(&k->txlock);
        int idle = !k->txq && !k->bye_queued;
        int64_t since = now - k->last_tx;
        pthread_mutex_unlock(&k->txlock);
        if (idle && since >= hb) {
            epipe_msg *m = control_msg(t, EPIPE_WIRE_HEARTBEAT, k->peer, t->c->rank, 0, NULL);
            if (m)
                conn_enqueue(t, k, m, 0);
            since = 0;
        }
        int64_t until_hb = hb - since;
        if (until_hb < next)
            next = until_hb;
        if (until_dead < next)
            next = until_dead;
    }
    return next < 1 ? 1 : next;
}

static void *progress(void *arg)
{
    struct tcp *t = arg;
    struct pollfd *pf = calloc(t->nconns + 1, sizeof *pf);
    unsigned *idx = calloc(t->nconns + 1, sizeof *idx);
    if (!pf || !idx) {
        free(pf);
        free(idx);
        epipe_log_warn((int)t->c->rank, "tcp", "progress thread: out of memory");
        for (unsigned p = 0; p < t->c->size; p++)
            if (t->count[p])
                epipe_comm_peer_down(t->c, p, EPIPE_PEER_FAILED, "this rank ran out of memory");
        return NULL;
    }
    /* Closing flushes what was sent: it gives up only when no byte has
     * moved for `patience` ms (a dead or stuck peer), however long a slow
     * link takes to carry the queue (a forward-only pass can queue many
     * messages ahead of a 100 Mbit/s link). */
    const int64_t patience = timeout_of(t) < 10000 ? timeout_of(t) : 10000;
    int64_t stop_at = 0, next = 0;
    for (;;) {
        int64_t now = now_ms();
        int stopping = __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE);
        if (stopping && !stop_at)
            stop_at = now + patience;
        if (now >= next)
            next = now + housekeeping(t, now);
        unsigned n = 1, busy = 0;
        pf[0] = (struct pollfd){.fd = t->evfd, .events = POLLIN};
        for (unsigned i = 0; i < t->nconns; i++) {
            struct conn *k = &t->conns[i];
            if (k->fd < 0)
                continue;
            pthread_mutex_lock(&k->txlock);
            int want_out = k->txq != NULL;
            busy += want_out || (k->bye_queued && !k->shut);
            pthread_mutex_unlock(&k->txlock);
            pf[n] = (struct pollfd){.fd = k->fd, .events = (short)(POLLIN | (want_out ? POLLOUT : 0))};
            idx[n++] = i;
        }
        if (stopping && (!busy || now >= stop_at)) {
            if (busy)
                epipe_log_warn((int)t->c->rank, "tcp", "closing with unsent messages to %u "
                               "connection(s): no progress for %lld ms", busy,
                               (long long)patience);
            break;
        }
        int64_t wait = next - now;
        if (stopping && stop_at - now < wait)
            wait = stop_at - now;
        int r = poll(pf, n, (int)(wait < 0 ? 0 : wait));
        if (r < 0 && errno != EINTR)
            break;
        if (r <= 0)
            continue;
        if (pf[0].revents & POLLIN) {
            uint64_t v;
            ssize_t rd = read(t->evfd, &v, sizeof v);
            (void)rd;
        }
        for (unsigned j = 1; j < n; j++) {
            struct conn *k = &t->conns[idx[j]];
            if (pf[j].revents & (POLLIN | POLLHUP | POLLERR))
                do_read(t, k);
            if (k->fd >= 0 && (pf[j].revents & (POLLOUT | POLLERR))) {
                do_write(t, k);
                if (stopping && k->last_tx + patience > stop_at)
                    stop_at = k->last_tx + patience; /* it moved: keep flushing */
            }
        }
    }
    free(pf);
    free(idx);
    return NULL;
}

/* ---- ops ---------------------------------------------------------------- */

static void tcp_abort(epipe_comm *c)
{
    struct tcp *t = c->tp;
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "rank %u was aborted", c->rank);
    pthread_mutex_lock(&c->lock); /* name the failure that made it abort, if any */
    for (unsigned p = 0; p < c->size; p++)
        if (c->peer_state[p] == EPIPE_PEER_FAILED) {
            snprintf(why, sizeof why, "rank %u was aborted after rank %u failed: %s", c->rank, p,
                     c->peer_why[p]);
            break;
        }
    pthread_mutex_unlock(&c->lock);
    for (unsigned p = 0; p < c->size; p++)
        if (t->count[p])
            send_error_to(t, p, c->rank, EPIPE_EPEER, why);
}

static void tcp_free(struct tcp *t)
{
    if (t->h.started > 0) {
        pthread_mutex_lock(&t->h.lock);
        t->h.stop = 1;
        pthread_cond_signal(&t->h.work);
        pthread_mutex_unlock(&t->h.lock);
        pthread_join(t->h.thread, NULL);
    }
    for (unsigned i = 0; i < t->nconns; i++) {
        conn_close(&t->conns[i], 0);
        pthread_mutex_destroy(&t->conns[i].txlock);
    }
    if (t->h.started > 0) {
        pthread_cond_destroy(&t->h.work);
        pthread_cond_destroy(&t->h.progress);
        pthread_mutex_destroy(&t->h.lock);
    }
    if (t->evfd >= 0)
        close(t->evfd);
    free(t->conns);
    free(t->first);
    free(t->count);
    free(t->rr);
    free(t->staging);
    free(t);
}

static void tcp_destroy(epipe_comm *c)
{
    struct tcp *t = c->tp;
    if (t->started) {
        for (unsigned i = 0; i < t->nconns; i++) {
            struct conn *k = &t->conns[i];
            epipe_msg *m = k->fd >= 0 ? control_msg(t, EPIPE_WIRE_BYE, k->peer, c->rank, 0, NULL)
                                      : NULL;
            if (m)
                conn_enqueue(t, k, m, 0);
        }
        __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
        wake(t);
        pthread_join(t->thread, NULL);
    }
    tcp_free(t);
    epipe_comm_free(c);
}

static const epipe_transport_ops tcp_ops = {
    .name = "tcp",
    .send = tcp_send,
    .destroy = tcp_destroy,
    .abort = tcp_abort,
};

int epipe_tcp_debug_send_raw(epipe_comm *c, unsigned peer, const void *bytes, size_t len,
                             int close_after)
{
    struct tcp *t = c->tp;
    if (c->ops != &tcp_ops || peer >= c->size || !t->count[peer])
        return EPIPE_EINVAL;
    epipe_msg *m = epipe_msg_new(len);
    if (!m)
        return EPIPE_ENOMEM;
    memcpy(m->data, bytes, len);
    m->len = len;
    memset(&m->hdr, 0, sizeof m->hdr);
    struct conn *k = &t->conns[t->first[peer]];
    pthread_mutex_lock(&k->txlock);
    k->close_after = close_after;
    pthread_mutex_unlock(&k->txlock);
    return conn_enqueue(t, k, m, 0);
}

static int cmp_link(const void *a, const void *b)
{
    const epipe_tcp_link *x = a, *y = b;
    return x->peer != y->peer ? (x->peer < y->peer ? -1 : 1)
                              : (x->stream < y->stream ? -1 : x->stream > y->stream);
}

static int create(epipe_comm **out, unsigned rank, unsigned size, const char *master_addr,
                  unsigned master_port, const epipe_tcp_opts *o)
{
    epipe_tcp_key key = {0};
    int rc;
    if (o->key_file[0] && (rc = epipe_tcp_key_load(&key, o->key_file)))
        return rc;
    epipe_tcp_link *links;
    unsigned nlinks;
    rc = epipe_tcp_setup(rank, size, master_addr, master_port, o, &key, &links, &nlinks);
    epipe_tcp_key_wipe(&key);
    if (rc)
        return rc;
    qsort(links, nlinks, sizeof *links, cmp_link);
    epipe_comm *c = epipe_comm_alloc(&tcp_ops, rank, size);
    struct tcp *t = c ? calloc(1, sizeof *t) : NULL;
    if (t) {
        t->c = c;
        t->o = *o;
        t->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        t->conns = calloc(nlinks ? nlinks : 1, sizeof *t->conns);
        t->first = calloc(size, sizeof *t->first);
        t->count = calloc(size, sizeof *t->count);
        t->rr = calloc(size, sizeof *t->rr);
        t->staging = malloc(STAGING);
    }
    if (!t || t->evfd < 0 || !t->conns || !t->first || !t->count || !t->rr || !t->staging) {
        for (unsigned i = 0; i < nlinks; i++)
            close(links[i].fd);
        free(links);
        if (t) {
            t->nconns = 0;
            tcp_free(t);
        }
        if (c)
            epipe_comm_free(c);
        return epipe_fail(EPIPE_ENOMEM, "tcp: out of memory");
    }
    c->tp = t;
    c->timeout_ms = o->timeout_ms;
    c->spin_us = o->spin_us;
    int64_t now = now_ms();
    for (unsigned i = 0; i < nlinks; i++) {
        struct conn *k = &t->conns[i];
        k->t = t;
        k->fd = links[i].fd;
        k->peer = links[i].peer;
        k->stream = links[i].stream;
        k->last_rx = k->last_tx = now;
        pthread_mutex_init(&k->txlock, NULL);
        if (!t->count[k->peer]++)
            t->first[k->peer] = i;
        t->nconns++;
    }
    free(links);
    if (nlinks) {
        if (pthread_create(&t->thread, NULL, progress, t) != 0) {
            tcp_free(t);
            epipe_comm_free(c);
            return epipe_fail(EPIPE_EIO, "tcp: cannot start the progress thread");
        }
        t->started = 1;
    }
    epipe_log_info((int)rank, "tcp", "rank %u of %u connected: %u connection(s), topology %s, "
                   "%u stream(s) per neighbour, timeout %lld ms%s", rank, size, nlinks,
                   o->mesh ? "mesh" : "pipeline", o->streams, (long long)o->timeout_ms,
                   o->key_file[0] ? ", authenticated" : "");
    *out = c;
    return EPIPE_OK;
}

EPIPE_API int epipe_comm_create_tcp(epipe_comm **out, unsigned rank, unsigned size,
                                    const char *master_addr, unsigned master_port,
                                    const char *options)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_tcp: out is NULL");
    *out = NULL;
    if (size == 0 || size > 1048576 || rank >= size)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_tcp: rank %u of size %u is out of range "
                                        "(size 1..1048576, rank below it)", rank, size);
    if (size > 1 && (!master_addr || !*master_addr || master_port == 0 || master_port > 65535))
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_tcp: master address '%s' or port %u "
                                        "is not valid", master_addr ? master_addr : "(null)",
                          master_port);
    epipe_tcp_opts o;
    int rc = epipe_tcp_opts_parse(&o, options);
    if (rc == EPIPE_OK)
        rc = create(out, rank, size, master_addr, master_port, &o);
    if (rc)
        epipe_log_info((int)rank, "tcp", "init failed: %s", epipe_last_error());
    return rc;
}

EPIPE_API int epipe_comm_create_from_env(epipe_comm **out, const char *options)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_from_env: out is NULL");
    *out = NULL;
    epipe_rdv_env e;
    int rc = epipe_rdv_env_parse(&e);
    if (rc)
        return rc;
    epipe_log_info((int)e.rank, "rendezvous", "rank %u of %u from %s; master %s:%u (address from "
                   "%s, port from %s)", e.rank, e.size, e.source, e.master_addr, e.master_port,
                   e.addr_source, e.port_source);
    return epipe_comm_create_tcp(out, e.rank, e.size, e.master_addr, e.master_port, options);
}
