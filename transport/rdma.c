/* The rdma transport: TCP rendezvous and liveness, queue-pair information
 * exchanged on the TCP links, every data message over verbs (rdma_proto.c). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "../lib/log.h"
#include "rdma.h"
#include "rdma_impl.h"
#include "rdma_info.h"
#include "tcp_setup.h"

#define READY_MAGIC "EPRDREDY"

/* Reads one HELLO-kind message from a link; its payload in r. */
static int read_hello(int fd, struct epipe_tcp_reader *rd, int64_t deadline, unsigned peer)
{
    int rc = epipe_tcp_reader_wait(fd, rd, deadline);
    if (rc < 0)
        return epipe_tcp_refail(rc, "rdma: rank %u during the queue-pair exchange", peer);
    if (rd->h.kind == EPIPE_WIRE_ERROR) {
        char who[32];
        snprintf(who, sizeof who, "rank %u", peer);
        return epipe_tcp_error_from(rd, who);
    }
    if (rd->h.kind != EPIPE_WIRE_HELLO ||
        epipe_wire_check_payload_crc(&rd->h, rd->payload, (size_t)rd->h.payload_len, NULL))
        return epipe_fail(EPIPE_EPROTO,
                          "rdma: rank %u sent a message of kind %u, not its "
                          "queue-pair information",
                          peer, rd->h.kind);
    return EPIPE_OK;
}

static int to_rts(struct rdma *r, struct rdma_link *l, const struct epipe_rdma_info *pi)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)(
        pi->mtu < r->dev.port_attr.active_mtu ? pi->mtu : r->dev.port_attr.active_mtu);
    a.dest_qp_num = pi->qpn;
    a.rq_psn = pi->psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, pi->gid, 16);
    a.ah_attr.grh.sgid_index = 0;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.dlid = pi->lid;
    a.ah_attr.port_num = r->dev.port;
    int e = r->v.modify_qp(l->qp, &a,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                               IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (e)
        return epipe_fail(EPIPE_EPEER, "rdma: queue pair to rank %u: INIT->RTR failed (%s)",
                          l->peer, strerror(e));
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = l->psn;
    a.max_rd_atomic = 1;
    e = r->v.modify_qp(l->qp, &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (e)
        return epipe_fail(EPIPE_EPEER, "rdma: queue pair to rank %u: RTR->RTS failed (%s)", l->peer,
                          strerror(e));
    l->peer_ring = pi->ring;
    l->peer_ring_rkey = pi->ring_rkey;
    return EPIPE_OK;
}

/* ---- ops ---------------------------------------------------------------- */

static struct rdma *of(epipe_comm *c)
{
    return ((struct tcp *)c->tp)->upper;
}

static int rdma_send(epipe_comm *c, unsigned peer, epipe_msg *m)
{
    struct rdma *r = of(c);
    int li = r->link_of[peer];
    if (li < 0)
        return r->tcp_ops->send(c, peer, m);
    return epipe_rdma_send(r, &r->links[li], m);
}

static void rdma_abort(epipe_comm *c)
{
    of(c)->tcp_ops->abort(c);
}

static void free_verbs(struct rdma *r)
{
    for (unsigned i = 0; i < r->nlinks; i++)
        epipe_rdma_link_free(&r->links[i]);
    free(r->links);
    if (r->pd)
        epipe_rdma_reg_fini(&r->cache);
    if (r->cq)
        r->v.destroy_cq(r->cq);
    if (r->ch)
        r->v.destroy_comp_channel(r->ch);
    if (r->pd)
        r->v.dealloc_pd(r->pd);
    epipe_verbs_release(&r->v, &r->dev);
    epipe_verbs_close(&r->v);
    if (r->evfd >= 0)
        close(r->evfd);
    free(r->link_of);
    free(r);
}

/* Waits up to `patience` ms (from the last progress) until done(l) holds
 * for every link or its peer is gone. */
static void wait_links(struct rdma *r, int (*done)(struct rdma_link *), int64_t patience)
{
    int64_t until = epipe_now_ms() + patience;
    for (;;) {
        int all = 1;
        for (unsigned i = 0; i < r->nlinks; i++) {
            struct rdma_link *l = &r->links[i];
            pthread_mutex_lock(&l->lock);
            all &= l->dead || done(l);
            pthread_mutex_unlock(&l->lock);
        }
        if (all || epipe_now_ms() > until)
            return;
        usleep(200);
    }
}

static int acked(struct rdma_link *l)
{
    return l->bye_acked || l->peer_bye;
}

static void rdma_destroy(epipe_comm *c)
{
    struct rdma *r = of(c);
    struct tcp *t = r->t;
    if (r->started) {
        int64_t patience = c->timeout_ms < 10000 ? c->timeout_ms : 10000;
        /* Everything sent is written, then a goodbye over verbs that the peer
         * acknowledges once it has handed over all that came before: only
         * then may TCP's goodbye tell it this rank left. */
        wait_links(r, epipe_rdma_link_idle, patience);
        for (unsigned i = 0; i < r->nlinks; i++) {
            struct rdma_link *l = &r->links[i];
            pthread_mutex_lock(&c->lock);
            int up = c->peer_state[l->peer] == EPIPE_PEER_UP;
            pthread_mutex_unlock(&c->lock);
            pthread_mutex_lock(&l->lock);
            if (!up)
                epipe_rdma_fail_locked(l, EPIPE_EPEER, NULL); /* gone: quietly */
            else if (!l->dead)
                epipe_rdma_post_ctl(l, IMM(IMM_BYE, 0));
            pthread_mutex_unlock(&l->lock);
        }
        wait_links(r, acked, patience);
        __atomic_store_n(&r->stop, 1, __ATOMIC_RELEASE);
        uint64_t one = 1;
        ssize_t n = write(r->evfd, &one, sizeof one);
        (void)n;
        pthread_join(r->thread, NULL);
    }
    const epipe_transport_ops *tops = r->tcp_ops;
    free_verbs(r);
    t->upper = NULL;
    c->ops = tops;
    tops->destroy(c);
}

/* A fork's child closes the TCP side's sockets (the links' rendezvous and
 * fallback connections, and what tells a peer this rank is gone); the
 * verbs resources it leaves alone. */
static const epipe_transport_ops rdma_ops = {
    .name = "rdma",
    .send = rdma_send,
    .destroy = rdma_destroy,
    .abort = rdma_abort,
    .forked = epipe_tcp_forked,
};

int epipe_rdma_debug_inject(epipe_comm *c, unsigned peer, int what)
{
    if (c->ops != &rdma_ops || peer >= c->size || of(c)->link_of[peer] < 0)
        return EPIPE_EINVAL;
    struct rdma *r = of(c);
    struct rdma_link *l = &r->links[r->link_of[peer]];
    int rc = EPIPE_OK;
    pthread_mutex_lock(&l->lock);
    switch (what) {
    case EPIPE_RDMA_INJECT_SHORT_CTS: r->inject = EPIPE_RDMA_INJECT_SHORT_CTS; break;
    case EPIPE_RDMA_INJECT_DUP_RTS: r->inject = EPIPE_RDMA_INJECT_DUP_RTS; break;
    case EPIPE_RDMA_INJECT_UNKNOWN_IMM:
        rc = epipe_rdma_post_ctl(l, IMM(IMM_DONE, 0x0abcdef));
        break;
    case EPIPE_RDMA_INJECT_UNLENT_SLOT:
        rc = epipe_rdma_post_ctl(l, IMM(IMM_EAGER, RDMA_SLOTS + 3));
        break;
    case EPIPE_RDMA_INJECT_BOGUS_WC: {
        pthread_mutex_unlock(&l->lock);
        struct ibv_wc wc;
        memset(&wc, 0, sizeof wc);
        wc.qp_num = l->qp->qp_num;
        wc.wr_id = WRID(WR_CHUNK, l->idx, 3);
        wc.status = IBV_WC_SUCCESS;
        wc.opcode = IBV_WC_RDMA_WRITE;
        epipe_rdma_handle_wc(r, &wc);
        return EPIPE_OK;
    }
    default: rc = EPIPE_EINVAL;
    }
    pthread_mutex_unlock(&l->lock);
    return rc;
}

int epipe_rdma_debug_links(epipe_comm *c)
{
    if (c->ops != &rdma_ops)
        return 0;
    return (int)of(c)->nlinks;
}

/* ---- creation ----------------------------------------------------------- */

static int cmp_link(const void *a, const void *b)
{
    const epipe_tcp_link *x = a, *y = b;
    return x->peer != y->peer ? (x->peer < y->peer ? -1 : 1)
                              : (x->stream < y->stream ? -1 : x->stream > y->stream);
}

/* The verbs side on this rank: device, PD, CQ and channel, one link per
 * neighbour. EPIPE_ENOTSUP naming what is missing. */
static int open_verbs(struct rdma *r)
{
    int rc = epipe_verbs_open(&r->v);
    if (rc == EPIPE_OK)
        rc = epipe_verbs_probe(&r->v, &r->dev);
    if (rc)
        return rc;
    errno = 0;
    r->pd = r->v.alloc_pd(r->dev.ctx);
    r->ch = r->pd ? r->v.create_comp_channel(r->dev.ctx) : NULL;
    if (!r->ch)
        return epipe_fail(EPIPE_ENOTSUP, "rdma: device %s: cannot create a %s (%s)", r->dev.name,
                          !r->pd ? "protection domain" : "completion channel",
                          errno ? strerror(errno) : "no reason given");
    epipe_rdma_reg_init(&r->cache, &r->v, r->pd, 64);
    return EPIPE_OK;
}

int epipe_rdma_comm_create(epipe_comm **out, unsigned rank, unsigned size, const char *master_addr,
                           unsigned master_port, const char *options, int is_auto,
                           const epipe_comm_settings *s)
{
    epipe_clear_error();
    *out = NULL;
    if (size == 0 || size > 1048576 || rank >= size)
        return epipe_fail(EPIPE_EINVAL, "rdma: rank %u of size %u is out of range", rank, size);
    if (size > 1 && (!master_addr || !*master_addr || master_port == 0 || master_port > 65535))
        return epipe_fail(EPIPE_EINVAL, "rdma: master address '%s' or port %u is not valid",
                          master_addr ? master_addr : "(null)", master_port);
    epipe_tcp_opts o;
    int rc = epipe_tcp_opts_parse(&o, options);
    if (rc)
        return rc;
    if (o.encrypt) {
        if (is_auto)
            return epipe_tcp_comm_create(out, rank, size, master_addr, master_port, options, s);
        return epipe_fail(EPIPE_ENOTSUP, "rdma: encrypt=1 is for tcp only (RDMA writes go to "
                                         "memory in clear)");
    }
    struct rdma *r = calloc(1, sizeof *r);
    if (!r || !(r->link_of = malloc(size * sizeof *r->link_of))) {
        free(r);
        return epipe_fail(EPIPE_ENOMEM, "rdma: out of memory");
    }
    r->evfd = -1;
    for (unsigned p = 0; p < size; p++)
        r->link_of[p] = -1;
    /* This rank's side first: an explicit rdma without a device fails here. */
    char local_why[EPIPE_ERRMSG_MAX] = "";
    int local_ok = open_verbs(r) == EPIPE_OK;
    if (!local_ok) {
        snprintf(local_why, sizeof local_why, "%s", epipe_last_error());
        if (!is_auto) {
            rc = epipe_fail(EPIPE_ENOTSUP, "%s", local_why);
            free_verbs(r);
            return rc;
        }
        epipe_clear_error(); /* auto goes on over tcp */
    }
    epipe_tcp_key key = {0};
    if (o.key_file[0] && (rc = epipe_tcp_key_load(&key, o.key_file))) {
        free_verbs(r);
        return rc;
    }
    o.offer_rdma = local_ok;
    epipe_tcp_link *links = NULL;
    unsigned nlinks = 0;
    rc = epipe_tcp_setup(rank, size, master_addr, master_port, &o, &key, &links, &nlinks);
    if (rc) {
        epipe_tcp_key_wipe(&key);
        free_verbs(r);
        return rc;
    }
    if (nlinks)
        qsort(links, nlinks, sizeof *links, cmp_link);
    /* One verbs link per neighbour, on its first TCP stream. */
    unsigned npeers = 0;
    for (unsigned i = 0; i < nlinks; i++)
        npeers += links[i].stream == 0;
    int64_t deadline = epipe_now_ms() + o.init_timeout_ms;
    struct epipe_rdma_info *peer_info = calloc(npeers ? npeers : 1, sizeof *peer_info);
    int *lfd = calloc(npeers ? npeers : 1, sizeof *lfd);
    unsigned char *both = calloc(npeers ? npeers : 1, 1); /* both sides offered rdma */
    r->links = calloc(npeers ? npeers : 1, sizeof *r->links);
    if (!peer_info || !lfd || !both || !r->links)
        rc = epipe_fail(EPIPE_ENOMEM, "rdma: out of memory");
    else
        r->nlinks = npeers; /* free_verbs frees those allocated */
    if (local_ok && rc == EPIPE_OK) {
        errno = 0;
        r->cq = r->v.create_cq(r->dev.ctx, (int)(npeers * (RDMA_SQ_DEPTH + RDMA_RQ_DEPTH) + 16),
                               NULL, r->ch, 0);
        if (!r->cq)
            rc = epipe_fail(EPIPE_ENOTSUP,
                            "rdma: device %s: cannot create a completion queue "
                            "(%s)",
                            r->dev.name, errno ? strerror(errno) : "no reason given");
    }
    for (unsigned i = 0, k = 0; rc == EPIPE_OK && i < nlinks; i++) {
        if (links[i].stream)
            continue;
        struct rdma_link *l = &r->links[k];
        lfd[k] = links[i].fd;
        l->idx = k;
        l->peer = links[i].peer;
        unsigned theirs = links[i].connector ? links[i].flags_s : links[i].flags_c;
        both[k] = local_ok && (theirs & EPIPE_TCP_HF_RDMA);
        k++;
        if (!both[k - 1]) {
            if (!is_auto)
                rc = epipe_fail(EPIPE_ENOTSUP,
                                "rdma: rank %u did not offer rdma (it has no "
                                "active RDMA device, or runs tcp)",
                                l->peer);
            else if (local_ok) /* without a device here, one line says so below */
                epipe_log_info((int)rank, "rdma",
                               "auto: tcp to rank %u: it has no active RDMA device (or runs tcp)",
                               l->peer);
            continue;
        }
        /* Both sides offered: a failure now fails the exchange (the peer
         * waits for this rank's queue pair). */
        rc = epipe_rdma_link_alloc(r, l);
    }
    /* A link's id (in every work request it posts) is its place among the
     * links that keep verbs: the array is compacted to them below, after
     * the receives carrying the id are posted. */
    for (unsigned k = 0, kept = 0; rc == EPIPE_OK && k < npeers; k++)
        if (both[k])
            r->links[k].idx = kept++;
    /* Round 1: queue-pair information (or why there is none) both ways. */
    for (unsigned k = 0; rc == EPIPE_OK && k < npeers; k++) {
        struct rdma_link *l = &r->links[k];
        if (!both[k])
            continue;
        struct epipe_rdma_info me = {.usable = local_ok};
        if (local_ok) {
            me.mtu = (uint8_t)r->dev.port_attr.active_mtu;
            me.qpn = l->qp->qp_num;
            me.psn = l->psn;
            memcpy(me.gid, r->dev.gid.raw, 16);
            me.lid = r->dev.port_attr.lid;
            me.ring = (uintptr_t)l->ring;
            me.ring_rkey = l->ring_mr->rkey;
        } else {
            snprintf(me.why, sizeof me.why, "%.39s", local_why);
        }
        uint8_t p[EPIPE_RDMA_INFO_SIZE];
        epipe_rdma_info_encode(&me, p);
        rc = epipe_tcp_send_msg(lfd[k], EPIPE_WIRE_HELLO, rank, l->peer, 0, 0, p, sizeof p,
                                deadline);
    }
    for (unsigned k = 0; rc == EPIPE_OK && k < npeers; k++) {
        if (!both[k])
            continue;
        struct epipe_tcp_reader rd = {0};
        rc = read_hello(lfd[k], &rd, deadline, r->links[k].peer);
        if (rc == EPIPE_OK)
            rc = epipe_rdma_info_decode(rd.payload, (size_t)rd.h.payload_len, &peer_info[k],
                                        r->links[k].peer);
        epipe_tcp_reader_reset(&rd);
    }
    for (unsigned k = 0; rc == EPIPE_OK && k < npeers; k++) {
        struct rdma_link *l = &r->links[k];
        if (!both[k])
            continue;
        if (!peer_info[k].usable) {
            rc = epipe_fail(EPIPE_ENOTSUP, "rdma: rank %u cannot run rdma: %s", l->peer,
                            peer_info[k].why);
            break;
        }
        rc = to_rts(r, l, &peer_info[k]);
        if (rc == EPIPE_OK)
            rc = epipe_rdma_link_start(l);
    }
    /* Round 2: both queue pairs are ready to receive before anything is written. */
    for (unsigned k = 0; rc == EPIPE_OK && k < npeers; k++)
        if (both[k])
            rc = epipe_tcp_send_msg(lfd[k], EPIPE_WIRE_HELLO, rank, r->links[k].peer, 0, 0,
                                    READY_MAGIC, 8, deadline);
    for (unsigned k = 0; rc == EPIPE_OK && k < npeers; k++) {
        if (!both[k])
            continue;
        struct epipe_tcp_reader rd = {0};
        rc = read_hello(lfd[k], &rd, deadline, r->links[k].peer);
        if (rc == EPIPE_OK && (rd.h.payload_len != 8 || memcmp(rd.payload, READY_MAGIC, 8)))
            rc = epipe_fail(EPIPE_EPROTO, "rdma: rank %u did not say its queue pair is ready",
                            r->links[k].peer);
        epipe_tcp_reader_reset(&rd);
    }
    free(lfd);
    if (rc) {
        free(both);
        for (unsigned i = 0; i < nlinks; i++)
            close(links[i].fd);
        free(links);
        free(peer_info);
        epipe_tcp_key_wipe(&key);
        char keep[EPIPE_ERRMSG_MAX]; /* free_verbs may log: keep the text */
        snprintf(keep, sizeof keep, "%s", epipe_last_error());
        free_verbs(r);
        return epipe_fail(rc, "%s", keep);
    }
    /* Links with verbs on both sides keep their QP; the others go. */
    unsigned kept = 0;
    for (unsigned k = 0; k < npeers; k++) {
        if (both[k]) {
            if (kept != k) {
                r->links[kept] = r->links[k];
                pthread_mutex_init(&r->links[kept].lock, NULL);
                memset(&r->links[k], 0, sizeof r->links[k]);
            }
            r->link_of[r->links[kept].peer] = (int)kept; /* .idx is kept already */
            kept++;
        } else {
            epipe_rdma_link_free(&r->links[k]);
        }
    }
    r->nlinks = kept;
    free(peer_info);
    free(both);
    epipe_comm *c = NULL;
    rc = epipe_tcp_comm_start(&c, rank, size, &o, s, &key, links, nlinks);
    if (rc) {
        char keep[EPIPE_ERRMSG_MAX];
        snprintf(keep, sizeof keep, "%s", epipe_last_error());
        free_verbs(r);
        return epipe_fail(rc, "%s", keep);
    }
    if (is_auto && !kept) { /* plain tcp */
        free_verbs(r);
        epipe_log_info((int)rank, "comm", "auto: transport tcp (%s)",
                       local_ok ? "no neighbour has an active RDMA device" : local_why);
        *out = c;
        return EPIPE_OK;
    }
    r->c = c;
    r->t = c->tp;
    r->t->upper = r;
    r->tcp_ops = c->ops;
    c->ops = &rdma_ops;
    r->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    int ev_errno = errno;
    for (unsigned k = 0; k < kept && rc == EPIPE_OK; k++) {
        r->links[k].idx = k;
        pthread_mutex_lock(&r->links[k].lock);
        rc = epipe_rdma_link_lend_all(&r->links[k]);
        pthread_mutex_unlock(&r->links[k].lock);
    }
    if (rc == EPIPE_OK && kept) {
        int e = r->evfd < 0 ? ev_errno : pthread_create(&r->thread, NULL, epipe_rdma_progress, r);
        if (e)
            rc = epipe_fail(EPIPE_EIO, "rdma: cannot start the progress thread (%s: %s)",
                            r->evfd < 0 ? "its event fd" : "pthread_create", strerror(e));
        else
            r->started = 1;
    }
    if (rc) {
        rdma_destroy(c);
        return rc;
    }
    epipe_log_info((int)rank, "comm",
                   "%stransport rdma: device %s port %u, %u verbs link(s), %u over tcp",
                   is_auto ? "auto: " : "", r->dev.name, r->dev.port, kept, npeers - kept);
    *out = c;
    return EPIPE_OK;
}
