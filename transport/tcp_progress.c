/* The TCP transport's progress thread: polls every connection, reads and
 * checks arriving messages, writes queued ones, sends heartbeats. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "../lib/log.h"
#include "../lib/wire/crc32c.h"
#include "tcp_conn.h"

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
        epipe_tcp_conn_close(&t->conns[t->first[peer] + i], 0);
    char text[EPIPE_ERRMSG_MAX];
    snprintf(text, sizeof text, "rank %u failed: %s", peer, why);
    if (c->rank == 0) {
        for (unsigned q = 1; q < c->size; q++)
            if (q != peer)
                epipe_tcp_queue_error(t, q, peer, EPIPE_EPEER, text);
    } else if (peer != 0) {
        epipe_tcp_queue_error(t, 0, peer, EPIPE_EPEER, text);
    }
}

/* A connection ended: cleanly after a BYE, or not. */
void epipe_tcp_conn_ended(struct tcp *t, struct conn *k, const char *how)
{
    epipe_comm *c = t->c;
    unsigned peer = k->peer;
    char why[160];
    pthread_mutex_lock(&k->txlock);
    int leaving = k->bye_queued;
    pthread_mutex_unlock(&k->txlock);
    if (leaving && !k->bye) { /* it closes because this rank said goodbye */
        epipe_tcp_conn_close(k, 0);
        return;
    }
    if (k->hgot || k->rx || k->rh_got) {
        snprintf(why, sizeof why,
                 "stream %u was cut in the middle of a message (%zu of %zu "
                 "payload bytes)",
                 k->stream, k->rx_got, k->rx ? k->rx_need : 0);
        peer_failed(t, peer, EPIPE_EPEER, why); /* before the close: see below */
        epipe_tcp_conn_close(k, 0);
        return;
    }
    if (!k->bye) {
        snprintf(why, sizeof why, "%s without a goodbye (crashed or killed?)", how);
        /* The failure is recorded before the connection closes: a send that
         * finds it closed, and an abort that follows, then name this peer
         * as the cause (peer_failed closes its connections; closing twice
         * is harmless). */
        peer_failed(t, peer, EPIPE_EPEER, why);
        epipe_tcp_conn_close(k, 0);
        return;
    }
    k->clean = 1;
    epipe_tcp_conn_close(k, 0);
    for (unsigned i = 0; i < t->count[peer]; i++)
        if (!t->conns[t->first[peer] + i].clean)
            return;
    epipe_log_debug((int)c->rank, "tcp", "rank %u left", peer);
    epipe_comm_peer_down(c, peer, EPIPE_PEER_LEFT, "");
}

/* A read on k returned n <= 0 for good (not EINTR, not EAGAIN): the
 * connection closed (0) or failed (errno). */
void epipe_tcp_read_ended(struct tcp *t, struct conn *k, ssize_t n)
{
    char how[64];
    snprintf(how, sizeof how, "the connection %s%s",
             n == 0 ? "closed" : "failed: ", n == 0 ? "" : strerror(errno));
    epipe_tcp_conn_ended(t, k, how);
}

void epipe_tcp_corrupt(struct tcp *t, struct conn *k, int status, const char *detail)
{
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s from it: %.200s", epipe_status_name(status), detail);
    unsigned peer = k->peer;
    epipe_tcp_conn_close(k, 1);
    peer_failed(t, peer, status, why);
}

/* A whole message has arrived on k: check it and act on it. */
static void finish(struct tcp *t, struct conn *k)
{
    epipe_comm *c = t->c;
    epipe_msg *m = k->rx;
    if (k->offload)
        k->rx_crc = epipe_tcp_offload_end(t);
    k->offload = 0;
    k->rx = NULL;
    k->hgot = k->hlen = 0;
    if (k->rx_aead) /* every byte passed its record's tag: the CRC adds nothing */
        k->rx_crc = m->hdr.payload_crc;
    int rc = epipe_wire_check_payload_crc(&m->hdr, m->data + m->hdr.header_len, k->rx_need,
                                          &k->rx_crc);
    if (rc) {
        char detail[EPIPE_ERRMSG_MAX];
        snprintf(detail, sizeof detail, "%s", epipe_last_error());
        epipe_msg_free(m);
        epipe_tcp_corrupt(t, k, rc, detail);
        return;
    }
    m->len = m->hdr.header_len + k->rx_need;
    switch (m->hdr.kind) {
    case EPIPE_WIRE_ACTIVATION:
    case EPIPE_WIRE_GRADIENT: epipe_comm_deliver(c, m); return;
    case EPIPE_WIRE_HEARTBEAT: break;
    case EPIPE_WIRE_BYE: k->bye = 1; break;
    case EPIPE_WIRE_ERROR: {
        unsigned about = m->hdr.micro_batch;
        char why[EPIPE_ERRMSG_MAX];
        char by[32] = "";
        if (k->peer != about)
            snprintf(by, sizeof by, "reported by rank %u: ", k->peer);
        char said[200];
        snprintf(why, sizeof why, "%s%s", by,
                 epipe_tcp_peer_text(said, sizeof said, m->data + m->hdr.header_len, k->rx_need));
        if (about < c->size && about != c->rank)
            peer_failed(t, about, EPIPE_EPEER, why);
        break;
    }
    default: {
        epipe_msg_free(m);
        epipe_tcp_corrupt(t, k, EPIPE_EPROTO, "a hello after the connection was set up");
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
        epipe_tcp_corrupt(t, k, rc, detail);
        return rc;
    }
    if (h.src_stage != k->peer || h.dst_stage != c->rank) {
        snprintf(detail, sizeof detail, "a message from rank %u to rank %u on its connection",
                 h.src_stage, h.dst_stage);
        epipe_tcp_corrupt(t, k, EPIPE_EPROTO, detail);
        return EPIPE_EPROTO;
    }
    k->rx = epipe_comm_msg_new(k->t->c, k->hlen - EPIPE_WIRE_HEADER_SIZE + (size_t)h.payload_len);
    if (!k->rx) {
        /* This rank's failure, not the peer's: the message is lost, so the
         * rank cannot go on (its receives say so, its peers are told),
         * and the connection, whose bytes can no longer be followed, is
         * cut. */
        snprintf(detail, sizeof detail, "no memory for a %llu-byte message from rank %u",
                 (unsigned long long)h.payload_len, k->peer);
        epipe_comm_fail_self(c, EPIPE_ENOMEM, detail);
        epipe_tcp_conn_close(k, 1);
        return EPIPE_ENOMEM;
    }
    k->rx->hdr = h;
    memcpy(k->rx->data, k->hbuf, k->hlen);
    k->rx_got = 0;
    k->rx_crc = 0;
    k->rx_need = (size_t)h.payload_len;
    k->offload = !k->rx_aead && k->rx_need >= OFFLOAD_MIN && epipe_tcp_offload_begin(t, k);
    if (k->rx_need == 0)
        finish(t, k);
    return EPIPE_OK;
}

/* n payload bytes of k's message are in place at p. */
void epipe_tcp_payload_got(struct tcp *t, struct conn *k, const uint8_t *p, size_t n)
{
    if (k->offload)
        epipe_tcp_offload_add(t, n);
    else if (!k->rx_aead)
        k->rx_crc = epipe_crc32c(k->rx_crc, p, n); /* while it is in cache */
    k->rx_got += n;
    if (k->rx_got == k->rx_need)
        finish(t, k);
}

/* Feeds bytes read into the staging buffer through k's parser. */
void epipe_tcp_feed(struct tcp *t, struct conn *k, const uint8_t *p, size_t n)
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
                    epipe_tcp_corrupt(t, k, rc, detail);
                    return;
                }
            }
            if (k->hlen && k->hgot == k->hlen && header_done(t, k))
                return;
        } else {
            size_t need = k->rx_need - k->rx_got;
            size_t take = n < need ? n : need;
            uint8_t *dst = k->rx->data + k->hlen + k->rx_got;
            memcpy(dst, p, take);
            p += take, n -= take;
            epipe_tcp_payload_got(t, k, dst, take);
        }
    }
}

static void do_read(struct tcp *t, struct conn *k)
{
    if (k->rx_aead) {
        epipe_tcp_read_sealed(t, k);
        return;
    }
    for (int round = 0; round < 64 && k->fd >= 0; round++) {
        ssize_t n;
        if (k->rx && k->rx_need - k->rx_got >= STAGING) { /* straight into the message */
            size_t want = k->rx_need - k->rx_got;
            uint8_t *dst = k->rx->data + k->hlen + k->rx_got;
            n = recv(k->fd, dst, want < RECV_CHUNK ? want : RECV_CHUNK, MSG_DONTWAIT);
            if (n > 0) {
                k->last_rx = epipe_now_ms();
                epipe_tcp_payload_got(t, k, dst, (size_t)n);
                continue;
            }
        } else {
            n = recv(k->fd, t->staging, STAGING, MSG_DONTWAIT);
            if (n > 0) {
                k->last_rx = epipe_now_ms();
                epipe_tcp_feed(t, k, t->staging, (size_t)n);
                if (n < STAGING)
                    return;
                continue;
            }
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        epipe_tcp_read_ended(t, k, n);
        return;
    }
}

/* Writes k's queue in clear; an errno if the connection failed. Under txlock. */
static int write_clear(struct conn *k, epipe_msg **done)
{
    while (k->txq && k->fd >= 0) {
        struct iovec iov[MAX_IOV];
        int n = 0;
        size_t off = k->tx_off;
        for (epipe_msg *m = k->txq; m && n < MAX_IOV; m = m->next, off = 0)
            iov[n++] = (struct iovec){m->data + off, m->len - off};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(k->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0)
            return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR ? errno : 0;
        k->last_tx = epipe_now_ms();
        __atomic_sub_fetch(&k->tx_queued, (uint64_t)w, __ATOMIC_RELAXED);
        size_t left = (size_t)w;
        while (k->txq && left >= k->txq->len - k->tx_off) {
            left -= k->txq->len - k->tx_off;
            epipe_msg *m = k->txq;
            k->txq = m->next;
            if (!k->txq)
                k->txq_tail = NULL;
            k->tx_off = 0;
            m->next = *done, *done = m;
        }
        k->tx_off += left;
    }
    return 0;
}

static void do_write(struct tcp *t, struct conn *k)
{
    epipe_msg *done = NULL;
    pthread_mutex_lock(&k->txlock);
    int failed = k->tx_aead ? epipe_tcp_write_sealed(t, k, &done) : write_clear(k, &done);
    if (!failed && !epipe_tcp_tx_waiting(k) && k->fd >= 0) {
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
        epipe_tcp_conn_close(k, 0);
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
        int idle = !epipe_tcp_tx_waiting(k) && !k->bye_queued;
        int64_t since = now - k->last_tx;
        pthread_mutex_unlock(&k->txlock);
        if (idle && since >= hb) {
            epipe_msg *m = epipe_tcp_control_msg(t, EPIPE_WIRE_HEARTBEAT, k->peer, t->c->rank, 0,
                                                 NULL);
            if (m)
                epipe_tcp_enqueue(t, k, m, 0);
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

void *epipe_tcp_progress(void *arg)
{
    struct tcp *t = arg;
    struct pollfd *pf = t->pf;
    unsigned *idx = t->pf_conn;
    /* Closing flushes what was sent: it gives up only when no byte has
     * moved for `patience` ms (a dead or stuck peer), however long a slow
     * link takes to carry the queue (a forward-only pass can queue many
     * messages ahead of a 100 Mbit/s link). */
    const int64_t patience = timeout_of(t) < 10000 ? timeout_of(t) : 10000;
    int64_t stop_at = 0, next = 0;
    for (;;) {
        int64_t now = epipe_now_ms();
        int stopping = __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE);
        if (stopping && !stop_at)
            stop_at = now + patience;
        if (now >= next)
            next = now + housekeeping(t, now);
        unsigned n = 1, busy = 0, unsent = 0;
        pf[0] = (struct pollfd){.fd = t->evfd, .events = POLLIN};
        for (unsigned i = 0; i < t->nconns; i++) {
            struct conn *k = &t->conns[i];
            if (k->fd < 0)
                continue;
            pthread_mutex_lock(&k->txlock);
            int want_out = epipe_tcp_tx_waiting(k);
            unsent += want_out || (k->bye_queued && !k->shut);
            /* After our FIN, the connection stays open (and read) until the
             * peer closes it, which it does once it has read everything:
             * closing a socket with unread data in its receive buffer (a
             * heartbeat) sends an RST, and an RST makes the peer drop what
             * it had not read yet of ours (seen at 100 Mbit/s: the tail of
             * a 15 MB activation lost). */
            busy += want_out || k->bye_queued || k->shut;
            pthread_mutex_unlock(&k->txlock);
            pf[n] = (struct pollfd){.fd = k->fd,
                                    .events = (short)(POLLIN | (want_out ? POLLOUT : 0))};
            idx[n++] = i;
        }
        if (stopping && (!busy || now >= stop_at)) {
            if (unsent)
                epipe_log_warn((int)t->c->rank, "tcp",
                               "closing with unsent messages to %u "
                               "connection(s): no progress for %lld ms",
                               unsent, (long long)patience);
            else if (busy)
                epipe_log_debug((int)t->c->rank, "tcp",
                                "closing %u connection(s) the peer has not closed after %lld ms",
                                busy, (long long)patience);
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
    return NULL;
}
