/* The rdma transport's progress thread: completions polled with a bounded
 * spin, then a completion-channel wait; each one checked and accounted. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../lib/log.h"
#include "rdma_impl.h"

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* ---- completions -------------------------------------------------------- */

/* Accounts for the completion of a request of `type` and index; 0 if this
 * rank never posted such a request. */
static int account(struct rdma_link *l, unsigned type, unsigned idx)
{
    switch (type) {
    case WR_EAGER: /* a signaled write retiring idx writes (itself and those before) */
        if (!idx || idx > l->sq_used || !l->eager_signaled)
            return 0;
        l->eager_signaled--;
        l->sq_used -= idx;
        l->eager_done += idx;
        return 1;
    case WR_CTS:
        if (!l->cts_inflight)
            return 0;
        l->cts_inflight--;
        break;
    case WR_CTL:
        if (!l->ctl_inflight)
            return 0;
        l->ctl_inflight--;
        break;
    case WR_CHUNK:
    case WR_DONE: {
        if (idx >= RDMA_LARGE || l->ltx[idx].state != 2 || !l->ltx[idx].inflight)
            return 0;
        struct rdma_ltx *x = &l->ltx[idx];
        x->inflight--;
        if (!x->inflight && (l->dead || (type == WR_DONE && x->off == x->m->len))) {
            epipe_rdma_reg_put(&l->r->cache, x->reg);
            epipe_msg_free(x->m);
            memset(x, 0, sizeof *x);
        }
        break;
    }
    case WR_RECV:
        if (!l->rq_posted)
            return 0;
        l->rq_posted--;
        return 1;
    default: return 0;
    }
    l->sq_used--;
    return 1;
}

static const char *wr_name(unsigned type)
{
    switch (type) {
    case WR_EAGER: return "eager write";
    case WR_CTS: return "clear-to-send write";
    case WR_CHUNK:
    case WR_DONE: return "RDMA write of a large message";
    case WR_CTL: return "goodbye write";
    case WR_RECV: return "receive";
    }
    return "work request";
}

void epipe_rdma_handle_wc(struct rdma *r, const struct ibv_wc *wc)
{
    struct rdma_link *l = NULL;
    for (unsigned i = 0; i < r->nlinks && !l; i++)
        if (r->links[i].qp && r->links[i].qp->qp_num == wc->qp_num)
            l = &r->links[i];
    if (!l) {
        epipe_log_warn((int)r->c->rank, "rdma", "a completion for queue pair %u, not one of ours",
                       wc->qp_num);
        return;
    }
    unsigned type = (unsigned)(wc->wr_id >> 56), li = (unsigned)(wc->wr_id >> 24) & 0xffffffffu,
             idx = (unsigned)(wc->wr_id & 0xffffff);
    pthread_mutex_lock(&l->lock);
    if (wc->status != IBV_WC_SUCCESS) {
        /* The QP is in error: everything outstanding is flushed, unsignaled
         * writes too; account for what can be, and tear the link down. */
        if (li == l->idx)
            account(l, type, idx);
        if (!l->dead && !l->peer_bye) {
            char why[EPIPE_ERRMSG_MAX], st[64];
            snprintf(why, sizeof why, "a %s on the queue pair to rank %u completed with %s",
                     wr_name(type), l->peer, epipe_verbs_status(&r->v, wc->status, st, sizeof st));
            epipe_rdma_fail_locked(l, EPIPE_EPEER, why);
        }
        l->dead = 1;
        pthread_mutex_unlock(&l->lock);
        return;
    }
    if (li != l->idx || !account(l, type, idx)) {
        if (!l->dead) {
            char why[EPIPE_ERRMSG_MAX];
            snprintf(why, sizeof why,
                     "protocol error on the link to rank %u: a completion for "
                     "work request 0x%llx, which this rank never posted",
                     l->peer, (unsigned long long)wc->wr_id);
            epipe_rdma_fail_locked(l, EPIPE_EPROTO, why);
        }
        pthread_mutex_unlock(&l->lock);
        return;
    }
    if (!l->dead && type == WR_RECV) {
        if (!(wc->wc_flags & IBV_WC_WITH_IMM))
            epipe_rdma_protocol_error(l, "a receive completed without an immediate (opcode %d)",
                                      (int)wc->opcode);
        else if (epipe_rdma_post_recv(l) == EPIPE_OK)
            epipe_rdma_got_imm(l, ntohl(wc->imm_data));
    }
    if (!l->dead)
        epipe_rdma_pump(l);
    pthread_mutex_unlock(&l->lock);
}

/* Links whose peer the communicator has given up on (the TCP side saw it
 * die or leave) are torn down quietly: their QP flushed, their buffers freed. */
static void check_peers(struct rdma *r)
{
    epipe_comm *c = r->c;
    for (unsigned i = 0; i < r->nlinks; i++) {
        struct rdma_link *l = &r->links[i];
        pthread_mutex_lock(&c->lock);
        int gone = c->peer_state[l->peer] != EPIPE_PEER_UP;
        pthread_mutex_unlock(&c->lock);
        if (gone) {
            pthread_mutex_lock(&l->lock);
            if (!l->dead)
                epipe_rdma_fail_locked(l, EPIPE_EPEER, NULL);
            pthread_mutex_unlock(&l->lock);
        }
    }
}

void *epipe_rdma_progress(void *arg)
{
    struct rdma *r = arg;
    struct ibv_wc wc[32];
    int64_t idle_since = now_us(), last_check = 0, now = idle_since;
    unsigned empty = 0;
    for (;;) {
        int n = ibv_poll_cq(r->cq, 32, wc);
        if (n < 0) {
            for (unsigned i = 0; i < r->nlinks; i++)
                epipe_rdma_link_fail(&r->links[i], EPIPE_EIO,
                                     "polling the completion queue failed");
            break;
        }
        for (int i = 0; i < n; i++)
            epipe_rdma_handle_wc(r, &wc[i]);
        if (n > 0) {
            empty = 0;
            continue; /* the clock is read only while nothing arrives */
        }
        if (empty++ % 16) {
            sched_yield(); /* a spinning thread must not starve the one it waits for */
            continue;
        }
        now = now_us();
        if (empty == 1)
            idle_since = now;
        if (now - last_check > 20000) {
            check_peers(r);
            last_check = now;
        }
        if (__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE))
            break;
        if (now - idle_since < __atomic_load_n(&r->c->spin_us, __ATOMIC_RELAXED))
            continue;
        if (ibv_req_notify_cq(r->cq, 0))
            continue;
        n = ibv_poll_cq(r->cq, 32, wc);
        for (int i = 0; i < n; i++)
            epipe_rdma_handle_wc(r, &wc[i]);
        if (n > 0) {
            empty = 0;
            continue;
        }
        struct pollfd pf[2] = {{.fd = r->ch->fd, .events = POLLIN},
                               {.fd = r->evfd, .events = POLLIN}};
        if (poll(pf, 2, 20) <= 0)
            continue;
        if (pf[0].revents & POLLIN) {
            struct ibv_cq *cq;
            void *ctx;
            if (r->v.get_cq_event(r->ch, &cq, &ctx) == 0)
                r->v.ack_cq_events(cq, 1);
        }
        if (pf[1].revents & POLLIN) {
            uint64_t v;
            ssize_t rd = read(r->evfd, &v, sizeof v);
            (void)rd;
        }
    }
    return NULL;
}
