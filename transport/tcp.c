/* The TCP transport's communicator ops: create, send, abort, destroy, and
 * the connections' send queues the progress thread (tcp_progress.c) drains. */
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
#include "tcp_conn.h"

static void wake(struct tcp *t)
{
    uint64_t one = 1;
    ssize_t n = write(t->evfd, &one, sizeof one);
    (void)n;
}

/* A framed message without tensor: heartbeat, bye or error. */
epipe_msg *epipe_tcp_control_msg(struct tcp *t, unsigned kind, unsigned dst, unsigned about,
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
    k->sb_len = k->sb_off = 0;
    __atomic_store_n(&k->tx_queued, 0, __ATOMIC_RELAXED);
}

/* Closes a connection; with abrupt, unsent data is dropped and an RST sent. */
void epipe_tcp_conn_close(struct conn *k, int abrupt)
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
        epipe_tcp_offload_cancel(k->t);
    k->offload = 0;
    epipe_msg_free(k->rx);
    k->rx = NULL;
    k->hgot = k->hlen = 0;
    k->rh_got = k->rgot = 0;
}

/* Queues m on k; takes ownership. The caller's thread writes small messages
 * at once when nothing is queued before them. */
int epipe_tcp_enqueue(struct tcp *t, struct conn *k, epipe_msg *m, int direct)
{
    pthread_mutex_lock(&k->txlock);
    if (k->fd < 0 || k->bye_queued) {
        pthread_mutex_unlock(&k->txlock);
        epipe_msg_free(m);
        return EPIPE_EPEER;
    }
    size_t off = 0;
    int was_empty = !epipe_tcp_tx_waiting(k);
    if (was_empty && direct && k->tx_aead && m->len && m->len <= t->record) {
        /* Sealed as one record and written now; what the socket does not
         * take waits in sb for the progress thread. */
        epipe_tcp_seal(k->tx_aead, k->sb, m->data, m->len);
        k->sb_len = m->len + EPIPE_TCP_REC_OVERHEAD;
        ssize_t n = send(k->fd, k->sb, k->sb_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        k->sb_off = n > 0 ? (size_t)n : 0;
        if (n > 0)
            k->last_tx = epipe_now_ms();
        int rest = k->sb_off < k->sb_len;
        pthread_mutex_unlock(&k->txlock);
        epipe_msg_free(m);
        if (rest)
            wake(t);
        return EPIPE_OK;
    }
    if (was_empty && direct && !k->tx_aead && m->len <= DIRECT_MAX) {
        ssize_t n = send(k->fd, m->data, m->len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            off = (size_t)n;
            k->last_tx = epipe_now_ms();
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
    unsigned n = t->count[peer],
             start = n ? __atomic_fetch_add(&t->rr[peer], 1, __ATOMIC_RELAXED) : 0;
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
                               "neighbours and rank 0 (use topology=mesh)",
                               c->rank, peer);
    }
    struct conn *k = pick(t, peer);
    if (!k || epipe_tcp_enqueue(t, k, m, 1) != EPIPE_OK) {
        if (!k)
            epipe_msg_free(m);
        return epipe_fail_into(c->msg, EPIPE_EPEER, "rank %u: the connection to rank %u is closed",
                               c->rank, peer);
    }
    return EPIPE_OK;
}

/* Sends an ERROR about rank `about` to peer (best effort). */
void epipe_tcp_queue_error(struct tcp *t, unsigned peer, unsigned about, int status,
                           const char *why)
{
    if (!t->count[peer])
        return;
    epipe_msg *m = epipe_tcp_control_msg(t, EPIPE_WIRE_ERROR, peer, about, status, why);
    struct conn *k = m ? pick(t, peer) : NULL;
    if (k)
        epipe_tcp_enqueue(t, k, m, 0);
    else
        epipe_msg_free(m);
}

/* ---- ops ---------------------------------------------------------------- */

static void tcp_abort(epipe_comm *c)
{
    struct tcp *t = c->tp;
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "rank %u was aborted", c->rank);
    pthread_mutex_lock(&c->lock); /* name the failure that made it abort, if any */
    if (c->self_status)
        snprintf(why, sizeof why, "rank %u failed: %.200s", c->rank, c->self_why);
    for (unsigned p = 0; !c->self_status && p < c->size; p++)
        if (c->peer_state[p] == EPIPE_PEER_FAILED) {
            snprintf(why, sizeof why, "rank %u was aborted after rank %u failed: %s", c->rank, p,
                     c->peer_why[p]);
            break;
        }
    pthread_mutex_unlock(&c->lock);
    for (unsigned p = 0; p < c->size; p++)
        if (t->count[p])
            epipe_tcp_queue_error(t, p, c->rank, EPIPE_EPEER, why);
}

static void tcp_free(struct tcp *t)
{
    for (unsigned i = 0; i < t->nconns; i++) {
        struct conn *k = &t->conns[i];
        epipe_tcp_conn_close(k, 0); /* gives its payload back to the CRC helper */
        pthread_mutex_destroy(&k->txlock);
        epipe_tcp_aead_free(k->tx_aead);
        epipe_tcp_aead_free(k->rx_aead);
        free(k->sb);
        free(k->rbuf);
    }
    epipe_tcp_crc_stop(t);
    if (t->evfd >= 0)
        close(t->evfd);
    free(t->conns);
    free(t->first);
    free(t->count);
    free(t->rr);
    free(t->staging);
    free(t->pf);
    free(t->pf_conn);
    free(t);
}

static void tcp_destroy(epipe_comm *c)
{
    struct tcp *t = c->tp;
    if (t->started) {
        for (unsigned i = 0; i < t->nconns; i++) {
            struct conn *k = &t->conns[i];
            /* The progress thread may close k meanwhile; enqueue checks again
             * under the lock. */
            int open = __atomic_load_n(&k->fd, __ATOMIC_RELAXED) >= 0;
            epipe_msg *m = open
                               ? epipe_tcp_control_msg(t, EPIPE_WIRE_BYE, k->peer, c->rank, 0, NULL)
                               : NULL;
            if (m)
                epipe_tcp_enqueue(t, k, m, 0);
        }
        __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
        wake(t);
        pthread_join(t->thread, NULL);
    }
    tcp_free(t);
    epipe_comm_free(c);
}

/* A fork's child: closes its copies of the sockets and the event fd, so
 * the parent's connections end when the parent does (lib/comm/comm.c). */
void epipe_tcp_forked(epipe_comm *c)
{
    struct tcp *t = c->tp;
    for (unsigned i = 0; i < t->nconns; i++)
        if (t->conns[i].fd >= 0) {
            close(t->conns[i].fd);
            t->conns[i].fd = -1;
        }
    if (t->evfd >= 0)
        close(t->evfd);
    t->evfd = -1;
}

static const epipe_transport_ops tcp_ops = {
    .name = "tcp",
    .send = tcp_send,
    .destroy = tcp_destroy,
    .abort = tcp_abort,
    .forked = epipe_tcp_forked,
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
    return epipe_tcp_enqueue(t, k, m, 0);
}

static int cmp_link(const void *a, const void *b)
{
    const epipe_tcp_link *x = a, *y = b;
    return x->peer != y->peer ? (x->peer < y->peer ? -1 : 1)
                              : (x->stream < y->stream ? -1 : x->stream > y->stream);
}

static int create(epipe_comm **out, unsigned rank, unsigned size, const char *master_addr,
                  unsigned master_port, const epipe_tcp_opts *o, const epipe_comm_settings *s)
{
    epipe_tcp_key key = {0};
    int rc;
    if ((rc = epipe_tcp_crypt_check(o)))
        return rc;
    if (o->key_file[0] && (rc = epipe_tcp_key_load(&key, o->key_file)))
        return rc;
    epipe_tcp_link *links;
    unsigned nlinks;
    rc = epipe_tcp_setup(rank, size, master_addr, master_port, o, &key, &links, &nlinks);
    if (rc) {
        epipe_tcp_key_wipe(&key);
        return rc;
    }
    return epipe_tcp_comm_start(out, rank, size, o, s, &key, links, nlinks);
}

int epipe_tcp_comm_start(epipe_comm **out, unsigned rank, unsigned size, const epipe_tcp_opts *o,
                         const epipe_comm_settings *s, epipe_tcp_key *keyp, epipe_tcp_link *links,
                         unsigned nlinks)
{
    epipe_tcp_key key = *keyp;
    int rc = EPIPE_OK;
    epipe_tcp_key_wipe(keyp);
    if (nlinks)
        qsort(links, nlinks, sizeof *links, cmp_link);
    epipe_comm *c = epipe_comm_alloc(&tcp_ops, rank, size, s);
    struct tcp *t = c ? calloc(1, sizeof *t) : NULL;
    int ev_errno = 0;
    if (t) {
        t->c = c;
        t->o = *o;
        t->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        ev_errno = errno;
        t->conns = calloc(nlinks ? nlinks : 1, sizeof *t->conns);
        t->first = calloc(size, sizeof *t->first);
        t->count = calloc(size, sizeof *t->count);
        t->rr = calloc(size, sizeof *t->rr);
        t->staging = malloc(STAGING);
        t->pf = calloc(nlinks + 1, sizeof *t->pf);
        t->pf_conn = calloc(nlinks + 1, sizeof *t->pf_conn);
        t->record = epipe_tcp_record_size();
    }
    if (!t || t->evfd < 0 || !t->conns || !t->first || !t->count || !t->rr || !t->staging ||
        !t->pf || !t->pf_conn) {
        for (unsigned i = 0; i < nlinks; i++)
            close(links[i].fd);
        free(links);
        epipe_tcp_key_wipe(&key);
        int no_fd = t && t->evfd < 0;
        if (t) {
            t->nconns = 0;
            tcp_free(t);
        }
        if (c)
            epipe_comm_free(c);
        if (no_fd) /* out of descriptors (EMFILE) most likely, which is not memory */
            return epipe_fail(ev_errno == ENOMEM ? EPIPE_ENOMEM : EPIPE_EIO,
                              "tcp: cannot make the progress thread's event fd: %s",
                              strerror(ev_errno));
        return epipe_fail(EPIPE_ENOMEM, "tcp: out of memory");
    }
    c->tp = t;
    int64_t now = epipe_now_ms();
    int aes_links = 0;
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
        if (o->encrypt && rc == EPIPE_OK) { /* this link's keys, from its handshake */
            uint8_t tx[32], rx[32];
            int aes = epipe_tcp_link_aes(&links[i]);
            aes_links += aes;
            rc = epipe_tcp_link_keys(&key, &links[i], rank, tx, rx);
            if (rc == EPIPE_OK) {
                k->tx_aead = epipe_tcp_aead_new(tx, aes);
                k->rx_aead = epipe_tcp_aead_new(rx, aes);
                k->sb_cap = t->record + EPIPE_TCP_REC_OVERHEAD;
                k->sb = malloc(k->sb_cap);
                if (!k->tx_aead || !k->rx_aead || !k->sb)
                    rc = epipe_fail(EPIPE_ENOMEM, "tcp: out of memory");
            }
            memset(tx, 0, sizeof tx), memset(rx, 0, sizeof rx);
            epipe_log_debug((int)rank, "tcp", "rank %u stream %u: %s", k->peer, k->stream,
                            epipe_tcp_cipher_name(aes));
        }
    }
    free(links);
    epipe_tcp_key_wipe(&key);
    if (rc) {
        tcp_free(t);
        epipe_comm_free(c);
        return rc;
    }
    if (nlinks) {
        if (pthread_create(&t->thread, NULL, epipe_tcp_progress, t) != 0) {
            tcp_free(t);
            epipe_comm_free(c);
            return epipe_fail(EPIPE_EIO, "tcp: cannot start the progress thread");
        }
        t->started = 1;
    }
    epipe_log_info((int)rank, "tcp",
                   "rank %u of %u connected: %u connection(s), topology %s, "
                   "%u stream(s) per neighbour, timeout %lld ms, job %s%s%s%s%s%s%s",
                   rank, size, nlinks, o->mesh ? "mesh" : "pipeline", o->streams,
                   (long long)c->timeout_ms, o->job[0] ? o->job : "unnamed",
                   o->job[0] ? " (from " : "", o->job_source, o->job[0] ? ")" : "",
                   o->key_file[0] ? ", authenticated" : "", o->encrypt ? ", encrypted: " : "",
                   !o->encrypt                ? ""
                   : aes_links == (int)nlinks ? "AES-256-GCM"
                   : aes_links                ? "AES-256-GCM and ChaCha20-Poly1305"
                                              : "ChaCha20-Poly1305");
    *out = c;
    return EPIPE_OK;
}

/* epipe_comm_create_tcp() and "tcp" in epipe_comm_create() (lib/comm/create.c). */
int epipe_tcp_comm_create(epipe_comm **out, unsigned rank, unsigned size, const char *master_addr,
                          unsigned master_port, const char *options, const epipe_comm_settings *s)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_tcp: out is NULL");
    *out = NULL;
    if (size == 0 || size > 1048576 || rank >= size)
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_comm_create_tcp: rank %u of size %u is out of range "
                          "(size 1..1048576, rank below it)",
                          rank, size);
    if (size > 1 && (!master_addr || !*master_addr || master_port == 0 || master_port > 65535))
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_comm_create_tcp: master address '%s' or port %u "
                          "is not valid",
                          master_addr ? master_addr : "(null)", master_port);
    epipe_tcp_opts o;
    int rc = epipe_tcp_opts_parse(&o, options);
    if (rc == EPIPE_OK)
        rc = create(out, rank, size, master_addr, master_port, &o, s);
    if (rc)
        epipe_log_info((int)rank, "tcp", "init failed: %s", epipe_last_error());
    return rc;
}
