/* fakeverbs: RC queue pairs: creation, the modify state machine with the IB spec's
 * required/optional attribute masks, posting, completion and flushing on error. */
#define _GNU_SOURCE
#include "fv_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct fv_qp *fv_qp_lookup(uint32_t qpn)
{
    for (struct fv_qp *q = fv_nic.qps[qpn & 255]; q; q = q->hnext)
        if (q->qp.qp_num == qpn)
            return q;
    return NULL;
}

FV_EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init);
FV_EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init)
{
    if (!pd || !init || init->qp_type != IBV_QPT_RC || !init->send_cq || !init->recv_cq ||
        init->srq || init->cap.max_send_wr < 1 || init->cap.max_send_wr > FV_MAX_WR ||
        init->cap.max_recv_wr > FV_MAX_WR || init->cap.max_send_sge > FV_MAX_SGE ||
        init->cap.max_recv_sge > FV_MAX_SGE || init->cap.max_inline_data > FV_MAX_INLINE) {
        fv_log("ibv_create_qp: invalid attributes (only RC, no SRQ, wr <= %d, sge <= %d, "
               "inline <= %d)",
               FV_MAX_WR, FV_MAX_SGE, FV_MAX_INLINE);
        errno = EINVAL;
        return NULL;
    }
    struct fv_qp *q = calloc(1, sizeof *q);
    uint32_t rwr = init->cap.max_recv_wr ? init->cap.max_recv_wr : 1;
    if (q) {
        q->sq = calloc(init->cap.max_send_wr, sizeof *q->sq);
        q->rq = calloc(rwr, sizeof *q->rq);
        if (fv_nic.strict)
            q->sq_sge = calloc((size_t)init->cap.max_send_wr * FV_MAX_SGE, sizeof *q->sq_sge);
    }
    if (!q || !q->sq || !q->rq || (fv_nic.strict && !q->sq_sge)) {
        if (q) {
            free(q->sq_sge);
            free(q->sq);
            free(q->rq);
        }
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&fv_nic.lock);
    if (fv_fail_now(FV_FAIL_CREATE_QP)) {
        pthread_mutex_unlock(&fv_nic.lock);
        free(q->sq_sge);
        free(q->sq);
        free(q->rq);
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    do
        fv_nic.next_qpn = (fv_nic.next_qpn + 1) & 0xffffff;
    while (fv_nic.next_qpn < 2 || fv_qp_lookup(fv_nic.next_qpn));
    q->qp.qp_num = fv_nic.next_qpn;
    q->qp.context = pd->context;
    q->qp.qp_context = init->qp_context;
    q->qp.pd = pd;
    q->qp.send_cq = init->send_cq;
    q->qp.recv_cq = init->recv_cq;
    q->qp.handle = q->qp.qp_num;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_type = IBV_QPT_RC;
    pthread_mutex_init(&q->qp.mutex, NULL);
    pthread_cond_init(&q->qp.cond, NULL);
    q->cap = init->cap;
    q->cap.max_recv_wr = rwr;
    q->sig_all = init->sq_sig_all;
    init->cap = q->cap;
    q->hnext = fv_nic.qps[q->qp.qp_num & 255];
    fv_nic.qps[q->qp.qp_num & 255] = q;
    FV_CONTAINER(pd, struct fv_pd, pd)->refs++;
    FV_CONTAINER(init->send_cq, struct fv_cq, cq)->qps++;
    FV_CONTAINER(init->recv_cq, struct fv_cq, cq)->qps++;
    pthread_mutex_unlock(&fv_nic.lock);
    fv_live_add(FV_LIVE_QP, 1);
    fv_log("create_qp %u", q->qp.qp_num);
    return &q->qp;
}

static void fv_qp_reset_queues(struct fv_qp *q)
{
    q->sq_head = q->sq_acked = q->sq_tail = 0;
    q->rq_head = q->rq_tail = 0;
    if (q->out) {
        fv_conn_close(q->out);
        q->out = NULL;
    }
}

FV_EXPORT int ibv_destroy_qp(struct ibv_qp *qp);
FV_EXPORT int ibv_destroy_qp(struct ibv_qp *qp)
{
    if (!qp)
        return EINVAL;
    struct fv_qp *q = FV_CONTAINER(qp, struct fv_qp, qp);
    pthread_mutex_lock(&fv_nic.lock);
    struct fv_qp **pp = &fv_nic.qps[qp->qp_num & 255];
    while (*pp && *pp != q)
        pp = &(*pp)->hnext;
    if (!*pp) {
        pthread_mutex_unlock(&fv_nic.lock);
        return EINVAL;
    }
    *pp = q->hnext;
    fv_qp_reset_queues(q);
    FV_CONTAINER(qp->pd, struct fv_pd, pd)->refs--;
    FV_CONTAINER(qp->send_cq, struct fv_cq, cq)->qps--;
    FV_CONTAINER(qp->recv_cq, struct fv_cq, cq)->qps--;
    pthread_mutex_unlock(&fv_nic.lock);
    pthread_mutex_destroy(&qp->mutex);
    pthread_cond_destroy(&qp->cond);
    free(q->sq_sge);
    free(q->sq);
    free(q->rq);
    free(q);
    fv_live_add(FV_LIVE_QP, -1);
    return 0;
}

static void fv_send_wc(struct fv_qp *q, const struct fv_swqe *s, enum ibv_wc_status st)
{
    struct ibv_wc wc;
    memset(&wc, 0, sizeof wc);
    wc.wr_id = s->wr_id;
    wc.status = st;
    wc.opcode = (enum ibv_wc_opcode)s->opcode;
    wc.byte_len = s->byte_len;
    wc.qp_num = q->qp.qp_num;
    wc.vendor_err = st == IBV_WC_SUCCESS ? 0 : 0xfa00u + st;
    fv_cq_push(FV_CONTAINER(q->qp.send_cq, struct fv_cq, cq), &wc, 0);
}

void fv_push_recv_wc(struct fv_qp *q, const struct fv_rwqe *r, enum ibv_wc_status st,
                     enum ibv_wc_opcode op, uint32_t len, uint32_t imm, int with_imm, int solicited)
{
    struct ibv_wc wc;
    memset(&wc, 0, sizeof wc);
    wc.wr_id = r->wr_id;
    wc.status = st;
    wc.opcode = op;
    wc.byte_len = len;
    wc.qp_num = q->qp.qp_num;
    wc.src_qp = q->dest_qpn;
    wc.vendor_err = st == IBV_WC_SUCCESS ? 0 : 0xfa00u + st;
    if (with_imm && st == IBV_WC_SUCCESS) {
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = imm;
    }
    fv_cq_push(FV_CONTAINER(q->qp.recv_cq, struct fv_cq, cq), &wc, solicited);
}

/* The QP enters ERR: the oldest outstanding send gets `first` (unless it is
 * IBV_WC_WR_FLUSH_ERR already), every other outstanding send and receive is flushed. */
void fv_qp_to_err(struct fv_qp *q, enum ibv_wc_status first)
{
    if (q->qp.state != IBV_QPS_ERR)
        fv_log("qp %u -> ERR (%s)", q->qp.qp_num, ibv_wc_status_str(first));
    q->qp.state = IBV_QPS_ERR;
    for (uint64_t i = q->sq_acked; i < q->sq_tail; i++) {
        struct fv_swqe *s = &q->sq[i % q->cap.max_send_wr];
        fv_send_wc(q, s,
                   s->err             ? (enum ibv_wc_status)s->err
                   : i == q->sq_acked ? first
                                      : IBV_WC_WR_FLUSH_ERR);
    }
    q->sq_head = q->sq_acked = q->sq_tail;
    for (uint64_t i = q->rq_head; i < q->rq_tail; i++)
        fv_push_recv_wc(q, &q->rq[i % q->cap.max_recv_wr], IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, 0,
                        0, 0);
    q->rq_head = q->rq_tail;
    if (q->out) {
        fv_conn_close(q->out);
        q->out = NULL;
    }
}

static uint64_t fv_hash_sges(const struct ibv_sge *g, int n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < n; i++) {
        const unsigned char *p = (const unsigned char *)(uintptr_t)g[i].addr;
        for (uint32_t k = 0; k < g[i].length; k++)
            h = (h ^ p[k]) * 0x100000001b3ull;
    }
    return h;
}

/* Strict mode: did the user change a send's bytes before its completion? (Only
 * while its regions are still registered: the bytes are readable then.) */
static int fv_send_changed(struct fv_qp *q, const struct fv_swqe *s, uint64_t idx)
{
    const struct ibv_sge *g = q->sq_sge + idx * FV_MAX_SGE;
    for (int i = 0; i < s->nsge; i++) {
        struct fv_mr *m = fv_mr_by_lkey(g[i].lkey);
        if (!m || g[i].addr < (uintptr_t)m->mr.addr ||
            g[i].addr + g[i].length > (uintptr_t)m->mr.addr + m->mr.length)
            return 0;
    }
    if (fv_hash_sges(g, s->nsge) == s->hash)
        return 0;
    fprintf(stderr,
            "fakeverbs[%d]: EPIPE_FAKEVERBS_STRICT: the send buffer of wr_id 0x%llx on QP %u "
            "changed between ibv_post_send and its completion; it completes with %s\n",
            (int)getpid(), (unsigned long long)s->wr_id, q->qp.qp_num,
            ibv_wc_status_str(IBV_WC_LOC_PROT_ERR));
    return 1;
}

void fv_qp_acked(struct fv_qp *q, uint32_t count, enum ibv_wc_status status)
{
    if (q->qp.state == IBV_QPS_ERR || q->qp.state == IBV_QPS_RESET)
        return;
    for (uint32_t i = 0; i < count; i++) {
        if (q->sq_acked == q->sq_tail) {
            fv_log("qp %u: ack for a send never posted (ignored)", q->qp.qp_num);
            return;
        }
        struct fv_swqe *s = &q->sq[q->sq_acked % q->cap.max_send_wr];
        if (q->sq_sge && s->nsge && fv_send_changed(q, s, q->sq_acked % q->cap.max_send_wr)) {
            s->err = IBV_WC_LOC_PROT_ERR;
            fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
            return;
        }
        q->sq_acked++;
        if (s->signaled) {
            fv_send_wc(q, s, IBV_WC_SUCCESS);
            q->sq_head = q->sq_acked; /* the slots of the unsignaled sends before it come back */
        }
    }
    if (status != IBV_WC_SUCCESS)
        fv_qp_to_err(q, status);
}

void fv_qp_peer_gone(struct fv_qp *q)
{
    fv_log("qp %u: peer NIC gone", q->qp.qp_num);
    if (q->out) {
        fv_conn_close(q->out);
        q->out = NULL;
    }
    q->out_broken = 1;
    if (q->sq_acked != q->sq_tail)
        fv_qp_to_err(q, IBV_WC_RETRY_EXC_ERR);
}

/* Required and optional attributes per transition (IB spec, RC; SQD/SQE unsupported). */
static int fv_mask_ok(enum ibv_qp_state cur, enum ibv_qp_state nxt, int mask)
{
    int req = 0, opt = 0;
    if (nxt == IBV_QPS_RESET || nxt == IBV_QPS_ERR) {
        req = IBV_QP_STATE;
    } else if (cur == IBV_QPS_RESET && nxt == IBV_QPS_INIT) {
        req = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    } else if (cur == IBV_QPS_INIT && nxt == IBV_QPS_INIT) {
        opt = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    } else if (cur == IBV_QPS_INIT && nxt == IBV_QPS_RTR) {
        req = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        opt = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
    } else if (cur == IBV_QPS_RTR && nxt == IBV_QPS_RTS) {
        req = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
              IBV_QP_MAX_QP_RD_ATOMIC;
        opt = IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
              IBV_QP_PATH_MIG_STATE;
    } else if (cur == IBV_QPS_RTS && nxt == IBV_QPS_RTS) {
        opt = IBV_QP_STATE | IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH |
              IBV_QP_MIN_RNR_TIMER | IBV_QP_PATH_MIG_STATE;
    } else {
        fv_log("modify_qp: transition %d -> %d not allowed", cur, nxt);
        return 0;
    }
    if ((mask & req) != req || (mask & ~(req | opt))) {
        fv_log("modify_qp %d -> %d: attribute mask 0x%x, required 0x%x, optional 0x%x", cur, nxt,
               mask, req, opt);
        return 0;
    }
    return 1;
}

static int fv_gid_ok(const union ibv_gid *g)
{
    return g->raw[0] == 0xfe && g->raw[1] == 0x80 && g->raw[2] == 'f' && g->raw[3] == 'v';
}

static int fv_attr_values_ok(const struct ibv_qp_attr *a, int mask)
{
    const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                    IBV_ACCESS_REMOTE_ATOMIC;
    if ((mask & IBV_QP_PORT) && a->port_num != 1)
        return 0;
    if ((mask & IBV_QP_PKEY_INDEX) && a->pkey_index != 0)
        return 0;
    if ((mask & IBV_QP_ACCESS_FLAGS) && (a->qp_access_flags & ~(unsigned)acc))
        return 0;
    if ((mask & IBV_QP_AV) && (!a->ah_attr.is_global || a->ah_attr.port_num != 1 ||
                               a->ah_attr.grh.sgid_index != 0 || !fv_gid_ok(&a->ah_attr.grh.dgid)))
        return 0; /* RoCE: a GRH with the peer's GID is mandatory */
    if ((mask & IBV_QP_PATH_MTU) && (a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096))
        return 0;
    if ((mask & IBV_QP_DEST_QPN) && a->dest_qp_num > 0xffffff)
        return 0;
    if ((mask & IBV_QP_RQ_PSN) && a->rq_psn > 0xffffff)
        return 0;
    if ((mask & IBV_QP_SQ_PSN) && a->sq_psn > 0xffffff)
        return 0;
    if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a->max_dest_rd_atomic > 16)
        return 0;
    if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a->max_rd_atomic > 16)
        return 0;
    if ((mask & IBV_QP_TIMEOUT) && a->timeout > 31)
        return 0;
    if ((mask & IBV_QP_RETRY_CNT) && a->retry_cnt > 7)
        return 0;
    if ((mask & IBV_QP_RNR_RETRY) && a->rnr_retry > 7)
        return 0;
    if ((mask & IBV_QP_MIN_RNR_TIMER) && a->min_rnr_timer > 31)
        return 0;
    return 1;
}

FV_EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
FV_EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
    if (!qp || !attr)
        return EINVAL;
    struct fv_qp *q = FV_CONTAINER(qp, struct fv_qp, qp);
    pthread_mutex_lock(&fv_nic.lock);
    enum ibv_qp_state cur = qp->state;
    enum ibv_qp_state nxt = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
    if (!fv_mask_ok(cur, nxt, mask) || !fv_attr_values_ok(attr, mask)) {
        pthread_mutex_unlock(&fv_nic.lock);
        fv_log("modify_qp %u: EINVAL", qp->qp_num);
        return EINVAL;
    }
    if (fv_fail_now(FV_FAIL_MODIFY_QP)) {
        pthread_mutex_unlock(&fv_nic.lock);
        return EIO;
    }
    if (mask & IBV_QP_ACCESS_FLAGS)
        q->access = (int)attr->qp_access_flags;
    if (mask & IBV_QP_PORT)
        q->port = attr->port_num;
    if (mask & IBV_QP_AV)
        q->dgid = attr->ah_attr.grh.dgid;
    if (mask & IBV_QP_PATH_MTU)
        q->mtu = attr->path_mtu;
    if (mask & IBV_QP_DEST_QPN)
        q->dest_qpn = attr->dest_qp_num;
    if (mask & IBV_QP_RQ_PSN)
        q->rq_psn = q->expect_psn = attr->rq_psn;
    if (mask & IBV_QP_SQ_PSN)
        q->sq_psn = q->next_psn = attr->sq_psn;
    if (mask & IBV_QP_MIN_RNR_TIMER)
        q->min_rnr_timer = attr->min_rnr_timer;
    if (mask & IBV_QP_TIMEOUT)
        q->timeout = attr->timeout;
    if (mask & IBV_QP_RETRY_CNT)
        q->retry_cnt = attr->retry_cnt;
    if (mask & IBV_QP_RNR_RETRY)
        q->rnr_retry = attr->rnr_retry;
    if (nxt != cur)
        fv_log("qp %u: %d -> %d", qp->qp_num, cur, nxt);
    if (nxt == IBV_QPS_ERR && cur != IBV_QPS_ERR) {
        fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
    } else if (nxt == IBV_QPS_RESET) {
        fv_qp_reset_queues(q);
        q->out_broken = 0;
    } else if (nxt == IBV_QPS_RTS && cur == IBV_QPS_RTR) {
        q->out_broken = 0;
        if (fv_conn_open(q) != 0)
            q->out_broken = 1; /* like a real NIC: found out when the first send retries out */
    }
    qp->state = nxt;
    if (fv_nic.nstalled)
        fv_nic_kick();
    pthread_mutex_unlock(&fv_nic.lock);
    return 0;
}

/* Validates a send WR's gather list; 0 or the completion status it earns. */
static enum ibv_wc_status fv_gather_check(struct fv_qp *q, const struct ibv_send_wr *wr,
                                          uint64_t *total)
{
    uint64_t n = 0;
    for (int i = 0; i < wr->num_sge; i++) {
        const struct ibv_sge *g = &wr->sg_list[i];
        n += g->length;
        if (wr->send_flags & IBV_SEND_INLINE)
            continue;
        struct fv_mr *m = fv_mr_by_lkey(g->lkey);
        if (!m || m->mr.pd != q->qp.pd || g->addr < (uintptr_t)m->mr.addr ||
            g->addr + g->length > (uintptr_t)m->mr.addr + m->mr.length) {
            fv_log(
                "qp %u: send sge %d (lkey 0x%x addr 0x%llx len %u) outside any local MR of the PD",
                q->qp.qp_num, i, g->lkey, (unsigned long long)g->addr, g->length);
            return IBV_WC_LOC_PROT_ERR;
        }
    }
    *total = n;
    if (n > FV_MAX_MSG)
        return IBV_WC_LOC_LEN_ERR;
    return IBV_WC_SUCCESS;
}

static int fv_post_one(struct fv_qp *q, struct ibv_send_wr *wr)
{
    uint8_t op, wcop;
    switch (wr->opcode) {
    case IBV_WR_RDMA_WRITE:
        op = FV_OP_WRITE;
        wcop = IBV_WC_RDMA_WRITE;
        break;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
        op = FV_OP_WRITE_IMM;
        wcop = IBV_WC_RDMA_WRITE;
        break;
    case IBV_WR_SEND:
        op = FV_OP_SEND;
        wcop = IBV_WC_SEND;
        break;
    case IBV_WR_SEND_WITH_IMM:
        op = FV_OP_SEND_IMM;
        wcop = IBV_WC_SEND;
        break;
    default: fv_log("qp %u: unsupported send opcode %d", q->qp.qp_num, wr->opcode); return EINVAL;
    }
    if (wr->num_sge < 0 || (uint32_t)wr->num_sge > q->cap.max_send_sge ||
        (wr->num_sge && !wr->sg_list))
        return EINVAL;
    if (q->sq_tail - q->sq_head >= q->cap.max_send_wr) {
        fv_log("qp %u: send queue full (%u WRs; unsignaled sends hold their slot until a later "
               "signaled one completes)",
               q->qp.qp_num, q->cap.max_send_wr);
        return ENOMEM;
    }
    uint64_t total = 0;
    if (wr->send_flags & IBV_SEND_INLINE) {
        for (int i = 0; i < wr->num_sge; i++)
            total += wr->sg_list[i].length;
        if (total > q->cap.max_inline_data)
            return EINVAL;
    }
    struct fv_swqe *s = &q->sq[q->sq_tail % q->cap.max_send_wr];
    s->wr_id = wr->wr_id;
    s->opcode = wcop;
    s->signaled = q->sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    s->byte_len = 0;
    s->err = 0;
    s->nsge = 0;
    q->sq_tail++;
    if (q->qp.state == IBV_QPS_ERR) {
        fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
        return 0;
    }
    enum ibv_wc_status st = fv_gather_check(q, wr, &total);
    s->byte_len = (uint32_t)total;
    if (st == IBV_WC_SUCCESS && q->sq_sge && !(wr->send_flags & IBV_SEND_INLINE) && wr->num_sge) {
        struct ibv_sge *g = q->sq_sge + ((q->sq_tail - 1) % q->cap.max_send_wr) * FV_MAX_SGE;
        memcpy(g, wr->sg_list, (size_t)wr->num_sge * sizeof *g);
        s->nsge = (uint8_t)wr->num_sge;
        s->hash = fv_hash_sges(g, wr->num_sge);
    }
    if (st == IBV_WC_SUCCESS && fv_fail_now(FV_FAIL_POST_SEND))
        st = IBV_WC_RETRY_EXC_ERR;
    if (st == IBV_WC_SUCCESS && (q->out_broken || !q->out))
        st = IBV_WC_RETRY_EXC_ERR;
    if (st != IBV_WC_SUCCESS) {
        /* this WR completes with st; sends still in flight before it are flushed */
        s->err = (uint8_t)st;
        fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
        return 0;
    }
    struct fv_hdr h;
    memset(&h, 0, sizeof h);
    h.op = op;
    h.flags = (wr->send_flags & IBV_SEND_SOLICITED) ? FV_F_SOLICITED : 0;
    if (s->signaled || q->sq_sge) /* strict mode checks every send at its ack */
        h.flags |= FV_F_ACKREQ;
    h.rnr_retry = q->rnr_retry;
    h.timeout = q->timeout;
    h.retry_cnt = q->retry_cnt;
    h.psn = q->next_psn;
    q->next_psn = (q->next_psn + 1) & 0xffffff;
    h.len = (uint32_t)total;
    h.imm = wr->imm_data;
    if (op == FV_OP_WRITE || op == FV_OP_WRITE_IMM) {
        h.rkey = wr->wr.rdma.rkey;
        h.raddr = wr->wr.rdma.remote_addr;
    }
    int rc = fv_conn_append(q->out, &h, sizeof h);
    for (int i = 0; rc == 0 && i < wr->num_sge; i++)
        rc = fv_conn_append(q->out, (const void *)(uintptr_t)wr->sg_list[i].addr,
                            wr->sg_list[i].length);
    if (rc) {
        q->sq_tail--;
        return ENOMEM;
    }
    return 0;
}

int fv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct fv_qp *q = FV_CONTAINER(qp, struct fv_qp, qp);
    int rc = 0;
    pthread_mutex_lock(&fv_nic.lock);
    if (qp->state != IBV_QPS_RTS && qp->state != IBV_QPS_ERR) {
        fv_log("qp %u: post_send in state %d (needs RTS)", qp->qp_num, qp->state);
        rc = EINVAL;
        if (bad)
            *bad = wr;
    }
    for (; rc == 0 && wr; wr = wr->next) {
        rc = fv_post_one(q, wr);
        if (rc && bad)
            *bad = wr;
    }
    if (q->out)
        fv_conn_flush(q->out);
    pthread_mutex_unlock(&fv_nic.lock);
    return rc;
}

int fv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct fv_qp *q = FV_CONTAINER(qp, struct fv_qp, qp);
    int rc = 0;
    pthread_mutex_lock(&fv_nic.lock);
    if (qp->state == IBV_QPS_RESET) {
        fv_log("qp %u: post_recv in RESET", qp->qp_num);
        rc = EINVAL;
    }
    for (; rc == 0 && wr; wr = wr->next) {
        if (wr->num_sge < 0 || (uint32_t)wr->num_sge > q->cap.max_recv_sge ||
            (wr->num_sge && !wr->sg_list)) {
            rc = EINVAL;
            break;
        }
        if (q->rq_tail - q->rq_head >= q->cap.max_recv_wr) {
            fv_log("qp %u: receive queue full (%u WRs)", qp->qp_num, q->cap.max_recv_wr);
            rc = ENOMEM;
            break;
        }
        struct fv_rwqe *r = &q->rq[q->rq_tail % q->cap.max_recv_wr];
        r->wr_id = wr->wr_id;
        r->nsge = (uint32_t)wr->num_sge;
        if (wr->num_sge)
            memcpy(r->sge, wr->sg_list, (size_t)wr->num_sge * sizeof *r->sge);
        q->rq_tail++;
        if (qp->state == IBV_QPS_ERR)
            fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
    }
    if (rc && bad)
        *bad = wr;
    if (fv_nic.nstalled)
        fv_nic_kick();
    pthread_mutex_unlock(&fv_nic.lock);
    return rc;
}
