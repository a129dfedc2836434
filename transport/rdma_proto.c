/* The rdma transport's verbs protocol: eager slots and clear-to-send ring,
 * large messages written where the receiver says, and the progress thread. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../lib/log.h"
#include "rdma_impl.h"

int epipe_rdma_link_alloc(struct rdma *r, struct rdma_link *l)
{
    pthread_mutex_init(&l->lock, NULL);
    l->r = r;
    size_t ssz = (size_t)RDMA_SLOTS * RDMA_SLOT_SIZE;
    size_t stsz = ssz + RDMA_RING * sizeof(struct rdma_cts);
    if (posix_memalign((void **)&l->slots, 4096, ssz) ||
        posix_memalign((void **)&l->stage, 4096, stsz) ||
        posix_memalign((void **)&l->ring, 4096, RDMA_RING * sizeof(struct rdma_cts)))
        return epipe_fail(EPIPE_ENOMEM, "rdma: out of memory");
    memset(l->ring, 0, RDMA_RING * sizeof(struct rdma_cts));
    int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    errno = 0;
    l->slots_mr = epipe_rdma_mr_new(&r->v, r->pd, l->slots, ssz, rw);
    l->ring_mr = l->slots_mr ? epipe_rdma_mr_new(&r->v, r->pd, l->ring,
                                                 RDMA_RING * sizeof(struct rdma_cts), rw)
                             : NULL;
    l->stage_mr = l->ring_mr
                      ? epipe_rdma_mr_new(&r->v, r->pd, l->stage, stsz, IBV_ACCESS_LOCAL_WRITE)
                      : NULL;
    if (!l->stage_mr)
        return epipe_fail(EPIPE_ENOTSUP,
                          "rdma: registering the %zu-byte slots for rank %u "
                          "failed (ibv_reg_mr: %s)",
                          ssz, l->peer, errno ? strerror(errno) : "no reason given");
    struct ibv_qp_init_attr qa;
    memset(&qa, 0, sizeof qa);
    qa.send_cq = r->cq;
    qa.recv_cq = r->cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = RDMA_SQ_DEPTH;
    qa.cap.max_recv_wr = RDMA_RQ_DEPTH;
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    errno = 0;
    l->qp = r->v.create_qp(r->pd, &qa);
    if (!l->qp)
        return epipe_fail(EPIPE_ENOTSUP,
                          "rdma: creating a queue pair for rank %u failed "
                          "(ibv_create_qp: %s)",
                          l->peer, errno ? strerror(errno) : "no reason given");
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = r->dev.port;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    int e = r->v.modify_qp(l->qp, &a,
                           IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (e)
        return epipe_fail(EPIPE_ENOTSUP, "rdma: queue pair for rank %u: RESET->INIT failed (%s)",
                          l->peer, strerror(e));
    uint32_t rnd;
    epipe_tcp_random((uint8_t *)&rnd, sizeof rnd);
    l->psn = rnd & 0xffffff;
    return EPIPE_OK;
}

static void release_rx(struct rdma_link *l)
{
    struct rdma *r = l->r;
    for (int i = 0; i < RDMA_LARGE; i++) {
        struct rdma_lrx *x = &l->lrx[i];
        if (x->busy) {
            epipe_rdma_reg_put(&r->cache, x->reg);
            epipe_msg_free(x->m);
        }
        memset(x, 0, sizeof *x);
    }
    for (struct rdma_pend *p = l->pq, *n; p; p = n) {
        n = p->next;
        epipe_msg_free(p->m);
        free(p);
    }
    l->pq = l->pq_tail = NULL;
}

/* Frees what the link holds on the send side; with all, large messages
 * still being written too (their writes are flushed or the QP is gone). */
static void release_tx(struct rdma_link *l, int all)
{
    for (epipe_msg *m = l->txq, *n; m; m = n) {
        n = m->next;
        epipe_msg_free(m);
    }
    l->txq = l->txq_tail = NULL;
    for (int i = 0; i < RDMA_LARGE; i++) {
        struct rdma_ltx *x = &l->ltx[i];
        if (x->state && (all || !x->inflight)) {
            epipe_rdma_reg_put(&l->r->cache, x->reg);
            epipe_msg_free(x->m);
            memset(x, 0, sizeof *x);
        }
    }
}

void epipe_rdma_link_free(struct rdma_link *l)
{
    struct rdma *r = l->r;
    if (!r)
        return;
    if (l->qp)
        r->v.destroy_qp(l->qp);
    l->qp = NULL;
    release_tx(l, 1);
    release_rx(l);
    epipe_rdma_mr_free(&r->v, l->slots_mr);
    epipe_rdma_mr_free(&r->v, l->ring_mr);
    epipe_rdma_mr_free(&r->v, l->stage_mr);
    free(l->slots);
    free(l->stage);
    free(l->ring);
    pthread_mutex_destroy(&l->lock);
    l->r = NULL;
}

/* Under l->lock. Tears the link down; reports the peer unless it left. */
void epipe_rdma_fail_locked(struct rdma_link *l, int status, const char *why)
{
    if (l->dead)
        return;
    struct rdma *r = l->r;
    epipe_comm *c = r->c;
    l->dead = 1;
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_ERR;
    r->v.modify_qp(l->qp, &a, IBV_QP_STATE); /* flushes what is posted */
    release_tx(l, 0);
    release_rx(l);
    if (status == EPIPE_ENOMEM && why) {
        /* This rank's shortage, not the peer's failure: a message is lost,
         * so the rank cannot go on. Its receives and sends say so; its
         * peers hear why over TCP (the abort). */
        char mine[EPIPE_ERRMSG_MAX];
        snprintf(mine, sizeof mine, "rdma: %s from rank %u", why, l->peer);
        epipe_comm_fail_self(c, EPIPE_ENOMEM, mine);
        return;
    }
    if (l->peer_bye || !why)
        return;
    char text[EPIPE_ERRMSG_MAX];
    snprintf(text, sizeof text, "rdma: %s", why);
    epipe_log_warn((int)c->rank, "rdma", "rank %u: %s", l->peer, text);
    epipe_comm_peer_failed(c, l->peer, status, text);
    char told[EPIPE_ERRMSG_MAX];
    snprintf(told, sizeof told, "rank %u tore down its rdma link to rank %u: %s", c->rank, l->peer,
             why);
    epipe_tcp_queue_error(r->t, l->peer, c->rank, status, told);
}

void epipe_rdma_link_fail(struct rdma_link *l, int status, const char *why)
{
    pthread_mutex_lock(&l->lock);
    epipe_rdma_fail_locked(l, status, why);
    pthread_mutex_unlock(&l->lock);
}

static int post_write_sig(struct rdma_link *l, uint64_t wrid, const void *src, size_t len,
                          uint32_t lkey, uint64_t raddr, uint32_t rkey, int imm_on, uint32_t imm,
                          int signaled)
{
    struct ibv_sge sge = {.addr = (uintptr_t)src, .length = (uint32_t)len, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wrid;
    wr.sg_list = len ? &sge : NULL;
    wr.num_sge = len ? 1 : 0;
    wr.opcode = imm_on ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    int e = ibv_post_send(l->qp, &wr, &bad);
    if (e) {
        char why[160];
        snprintf(why, sizeof why, "posting an RDMA write to rank %u failed (ibv_post_send: %s)",
                 l->peer, strerror(e));
        epipe_rdma_fail_locked(l, EPIPE_EPEER, why);
        return EPIPE_EPEER;
    }
    l->sq_used++;
    return EPIPE_OK;
}

static int post_write(struct rdma_link *l, uint64_t wrid, const void *src, size_t len,
                      uint32_t lkey, uint64_t raddr, uint32_t rkey, int imm_on, uint32_t imm)
{
    return post_write_sig(l, wrid, src, len, lkey, raddr, rkey, imm_on, imm, 1);
}

/* Eager writes gathered by one pump, posted with one call (one doorbell). */
struct chain {
    struct ibv_send_wr wr[RDMA_SLOTS];
    struct ibv_sge sge[RDMA_SLOTS];
    int n;
};

static void chain_add(struct chain *ch, uint64_t wrid, const void *src, size_t len, uint32_t lkey,
                      uint64_t raddr, uint32_t rkey, uint32_t imm, int signaled)
{
    int i = ch->n++;
    struct ibv_send_wr *wr = &ch->wr[i];
    memset(wr, 0, sizeof *wr);
    ch->sge[i] = (struct ibv_sge){.addr = (uintptr_t)src, .length = (uint32_t)len, .lkey = lkey};
    wr->wr_id = wrid;
    wr->sg_list = &ch->sge[i];
    wr->num_sge = 1;
    wr->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr->send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr->imm_data = htonl(imm);
    wr->wr.rdma.remote_addr = raddr;
    wr->wr.rdma.rkey = rkey;
    if (i)
        ch->wr[i - 1].next = wr;
}

static int chain_post(struct rdma_link *l, struct chain *ch)
{
    if (!ch->n || l->dead)
        return EPIPE_OK;
    struct ibv_send_wr *bad = NULL;
    int e = ibv_post_send(l->qp, ch->wr, &bad);
    if (e) {
        char why[160];
        snprintf(why, sizeof why, "posting an RDMA write to rank %u failed (ibv_post_send: %s)",
                 l->peer, strerror(e));
        epipe_rdma_fail_locked(l, EPIPE_EPEER, why);
        return EPIPE_EPEER;
    }
    l->sq_used += (unsigned)ch->n;
    ch->n = 0;
    return EPIPE_OK;
}

int epipe_rdma_post_recv(struct rdma_link *l)
{
    /* Zero-length receives for immediates, posted RDMA_RECV_BATCH at a time
     * (one call into the provider) once that many were used. */
    unsigned n = RDMA_RQ_DEPTH - l->rq_posted;
    if (n < RDMA_RECV_BATCH && l->rq_posted)
        return EPIPE_OK;
    struct ibv_recv_wr wr[RDMA_RQ_DEPTH], *bad = NULL;
    memset(wr, 0, n * sizeof wr[0]);
    for (unsigned i = 0; i < n; i++) {
        wr[i].wr_id = WRID(WR_RECV, l->idx, 0);
        wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
    }
    int e = n ? ibv_post_recv(l->qp, wr, &bad) : 0;
    if (e) {
        char why[160];
        snprintf(why, sizeof why, "posting a receive for rank %u failed (ibv_post_recv: %s)",
                 l->peer, strerror(e));
        epipe_rdma_fail_locked(l, EPIPE_EPEER, why);
        return EPIPE_EPEER;
    }
    l->rq_posted += n;
    return EPIPE_OK;
}

/* Writes a clear-to-send into the peer's ring. */
int epipe_rdma_post_cts(struct rdma_link *l, uint64_t addr, uint64_t size, uint32_t rkey,
                        uint32_t kind, uint32_t tag)
{
    uint32_t seq = l->cts_next++;
    unsigned i = seq % RDMA_RING;
    struct rdma_cts *src = (struct rdma_cts *)(l->stage + (size_t)RDMA_SLOTS * RDMA_SLOT_SIZE) + i;
    *src = (struct rdma_cts){
        .addr = addr, .size = size, .rkey = rkey, .seq = seq, .kind = kind, .tag = tag};
    int rc = post_write(l, WRID(WR_CTS, l->idx, 0), src, sizeof *src, l->stage_mr->lkey,
                        l->peer_ring + i * sizeof *src, l->peer_ring_rkey, 1, IMM(IMM_CTS, seq));
    if (rc == EPIPE_OK)
        l->cts_inflight++;
    return rc;
}

/* Slot `slot` was read: lend it again, with others in one CTS once
 * RDMA_LEND_BATCH are free (or now, with force). The sender always holds or
 * has in flight at least SLOTS - BATCH + 1 slots, so it never waits on this. */
int epipe_rdma_lend_slot(struct rdma_link *l, int slot, int force)
{
    if (slot >= 0)
        l->slot_free |= 1u << slot;
    if (!l->slot_free || (!force && __builtin_popcount(l->slot_free) < RDMA_LEND_BATCH))
        return EPIPE_OK;
    uint32_t bits = l->slot_free;
    l->slot_free = 0;
    l->slot_lent |= bits;
    return epipe_rdma_post_cts(l, (uintptr_t)l->slots, RDMA_SLOT_SIZE, l->slots_mr->rkey, 0, bits);
}

int epipe_rdma_post_ctl(struct rdma_link *l, uint32_t imm)
{
    if (l->dead)
        return EPIPE_EPEER;
    int rc = post_write(l, WRID(WR_CTL, l->idx, 0), NULL, 0, 0, l->peer_ring, l->peer_ring_rkey, 1,
                        imm);
    if (rc == EPIPE_OK)
        l->ctl_inflight++;
    return rc;
}

int epipe_rdma_link_start(struct rdma_link *l)
{
    int rc = EPIPE_OK;
    pthread_mutex_lock(&l->lock);
    rc = epipe_rdma_post_recv(l);
    pthread_mutex_unlock(&l->lock);
    return rc;
}

int epipe_rdma_link_lend_all(struct rdma_link *l)
{
    l->slot_free = (uint32_t)((1ull << RDMA_SLOTS) - 1);
    return epipe_rdma_lend_slot(l, -1, 1);
}

int epipe_rdma_link_idle(struct rdma_link *l)
{
    if (l->dead || l->peer_bye)
        return 1;
    if (l->txq)
        return 0;
    for (int i = 0; i < RDMA_LARGE; i++)
        if (l->ltx[i].state)
            return 0;
    return 1;
}

/* Posts the writes of large messages whose CTS came, as the queue allows. */
static void pump_large(struct rdma_link *l)
{
    for (int i = 0; i < RDMA_LARGE && !l->dead; i++) {
        struct rdma_ltx *x = &l->ltx[i];
        while (x->state == 2 && x->off < x->m->len && l->sq_used < RDMA_SQ_DATA) {
            size_t n = x->m->len - x->off < RDMA_CHUNK ? x->m->len - x->off : RDMA_CHUNK;
            int last = x->off + n == x->m->len;
            if (post_write(l, WRID(last ? WR_DONE : WR_CHUNK, l->idx, (unsigned)i),
                           x->m->data + x->off, n, x->reg->mr->lkey, x->raddr + x->off, x->rkey,
                           last, IMM(IMM_DONE, x->seq)))
                return;
            x->off += n;
            x->inflight++;
        }
    }
}

/* A slot this rank may write now: the peer lent it (credit) and the last
 * write from its staging slot has completed (a signaled completion covering
 * it was polled), so the bytes may change. -1: none. */
static int usable_slot(const struct rdma_link *l)
{
    for (uint32_t c = l->credit; c; c &= c - 1) {
        unsigned s = (unsigned)__builtin_ctz(c);
        if (l->stage_seq[s] <= l->eager_done)
            return (int)s;
    }
    return -1;
}

/* Adds an eager write from staging slot `slot` to the peer's slot `slot`;
 * every RDMA_SIGNAL_EVERY-th is signaled (its completion retires those before it). */
static void eager_add(struct rdma_link *l, struct chain *ch, unsigned slot, size_t n, uint32_t imm)
{
    l->credit &= ~(1u << slot);
    l->stage_seq[slot] = ++l->eager_posted;
    int sig = ++l->unsignaled >= RDMA_SIGNAL_EVERY;
    chain_add(ch, WRID(WR_EAGER, l->idx, sig ? l->unsignaled : 0),
              l->stage + (size_t)slot * RDMA_SLOT_SIZE, n, l->stage_mr->lkey,
              l->credit_base + (uint64_t)slot * RDMA_SLOT_SIZE, l->credit_rkey, imm, sig);
    if (sig)
        l->unsignaled = 0, l->eager_signaled++;
}

/* The last write of a pump is signaled, so that a completion always comes
 * to free the staging slots behind it. */
static void eager_close(struct rdma_link *l, struct chain *ch)
{
    if (!ch->n || (ch->wr[ch->n - 1].send_flags & IBV_SEND_SIGNALED))
        return;
    ch->wr[ch->n - 1].send_flags = IBV_SEND_SIGNALED;
    ch->wr[ch->n - 1].wr_id = WRID(WR_EAGER, l->idx, l->unsignaled);
    l->unsignaled = 0;
    l->eager_signaled++;
}

/* Starts what the queue holds as credits, staging and large slots allow. */
void epipe_rdma_pump(struct rdma_link *l)
{
    struct rdma *r = l->r;
    struct chain ch;
    ch.n = 0;
    int slot;
    while (!l->dead && l->txq && (slot = usable_slot(l)) >= 0) {
        epipe_msg *m = l->txq;
        int large = m->len > RDMA_SLOT_SIZE, li = -1;
        if (large) {
            for (int i = 0; i < RDMA_LARGE && li < 0; i++)
                if (!l->ltx[i].state)
                    li = i;
            if (li < 0)
                break;
        }
        uint8_t *dst = l->stage + (size_t)slot * RDMA_SLOT_SIZE;
        l->txq = m->next;
        if (!l->txq)
            l->txq_tail = NULL;
        if (!large) {
            memcpy(dst, m->data, m->len);
            eager_add(l, &ch, (unsigned)slot, m->len, IMM(IMM_EAGER, slot));
            epipe_msg_free(m);
            l->sent++;
            continue;
        }
        epipe_rdma_reg *reg;
        if (epipe_rdma_reg_get(&r->cache, m->data, m->len, &reg)) {
            char why[EPIPE_ERRMSG_MAX];
            snprintf(why, sizeof why, "sending to rank %u: %s", l->peer, epipe_last_error());
            epipe_msg_free(m);
            eager_close(l, &ch);
            if (chain_post(l, &ch) == EPIPE_OK) /* what went before still goes */
                epipe_rdma_fail_locked(l, EPIPE_EPEER, why);
            return;
        }
        struct rdma_ltx *x = &l->ltx[li];
        *x = (struct rdma_ltx){.state = 1, .m = m, .reg = reg, .seq = l->next_lseq++ & 0x0fffffffu};
        uint32_t w[4] = {x->seq, 0, (uint32_t)m->len, (uint32_t)((uint64_t)m->len >> 32)};
        memcpy(dst, w, sizeof w);
        memcpy(dst + sizeof w, m->data, EPIPE_WIRE_HEADER_SIZE); /* sealed: 192 bytes */
        size_t n = sizeof w + EPIPE_WIRE_HEADER_SIZE;
        eager_add(l, &ch, (unsigned)slot, n, IMM(IMM_RTS, slot));
        int s2;
        if (r->inject == EPIPE_RDMA_INJECT_DUP_RTS && (s2 = usable_slot(l)) >= 0) { /* tests */
            r->inject = 0;
            memcpy(l->stage + (size_t)s2 * RDMA_SLOT_SIZE, dst, n);
            eager_add(l, &ch, (unsigned)s2, n, IMM(IMM_RTS, s2));
        }
        l->sent++;
    }
    eager_close(l, &ch);
    if (chain_post(l, &ch) == EPIPE_OK)
        pump_large(l);
}

int epipe_rdma_send(struct rdma *r, struct rdma_link *l, epipe_msg *m)
{
    pthread_mutex_lock(&l->lock);
    if (l->dead || l->peer_bye) {
        int dead = l->dead;
        pthread_mutex_unlock(&l->lock);
        epipe_msg_free(m);
        /* The peer's goodbye over verbs (sent by an aborting peer too) or
         * the link's failure can overtake the TCP message that says why:
         * wait for it, so that the error names where a failure began. */
        char fallback[EPIPE_ERRMSG_MAX];
        snprintf(fallback, sizeof fallback, "rank %u: the rdma link to rank %u is %s", r->c->rank,
                 l->peer, dead ? "down" : "closed: it left");
        int64_t ms = r->c->timeout_ms > 0 && r->c->timeout_ms < 2000 ? r->c->timeout_ms : 2000;
        return epipe_comm_send_gone(r->c, l->peer, ms, fallback);
    }
    m->next = NULL;
    if (l->txq_tail)
        l->txq_tail->next = m;
    else
        l->txq = m;
    l->txq_tail = m;
    epipe_rdma_pump(l);
    pthread_mutex_unlock(&l->lock);
    return EPIPE_OK;
}
