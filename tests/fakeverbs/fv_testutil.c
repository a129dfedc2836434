/* fakeverbs tests: endpoint setup and completion waits shared by the provider's
 * tests and its throughput benchmark. */
#define _GNU_SOURCE
#include "fv_testutil.h"

#include <errno.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int fvt_open(struct fvt_ep *e, int cqe, int wr, int with_channel)
{
    memset(e, 0, sizeof *e);
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list)
        return -1;
    if (n < 1) {
        ibv_free_device_list(list);
        return -1;
    }
    e->ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    if (!e->ctx)
        return -1;
    e->pd = ibv_alloc_pd(e->ctx);
    if (with_channel)
        e->ch = ibv_create_comp_channel(e->ctx);
    e->scq = ibv_create_cq(e->ctx, cqe, NULL, e->ch, 0);
    e->rcq = ibv_create_cq(e->ctx, cqe, NULL, e->ch, 0);
    if (!e->pd || !e->scq || !e->rcq || (with_channel && !e->ch))
        return -1;
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = e->scq;
    ia.recv_cq = e->rcq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = (uint32_t)wr;
    ia.cap.max_recv_wr = (uint32_t)wr;
    ia.cap.max_send_sge = 4;
    ia.cap.max_recv_sge = 4;
    ia.cap.max_inline_data = 64;
    e->qp = ibv_create_qp(e->pd, &ia);
    if (!e->qp)
        return -1;
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    return ibv_modify_qp(e->qp, &a,
                         IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)
               ? -1
               : 0;
}

void fvt_info(const struct fvt_ep *e, struct fvt_info *i)
{
    memset(i, 0, sizeof *i);
    ibv_query_gid(e->ctx, 1, 0, &i->gid);
    i->qpn = e->qp->qp_num;
    i->psn = 0x1234 + e->qp->qp_num % 1000;
}

int fvt_connect(struct fvt_ep *e, const struct fvt_info *peer, int rnr_retry, int timeout)
{
    struct fvt_info me;
    fvt_info(e, &me);
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_4096;
    a.dest_qp_num = peer->qpn;
    a.rq_psn = peer->psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 1; /* 0.01 ms */
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = peer->gid;
    a.ah_attr.grh.sgid_index = 0;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.port_num = 1;
    if (ibv_modify_qp(e->qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return -1;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = (uint8_t)timeout;
    a.retry_cnt = 2;
    a.rnr_retry = (uint8_t)rnr_retry;
    a.sq_psn = me.psn;
    a.max_rd_atomic = 1;
    return ibv_modify_qp(e->qp, &a,
                         IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                             IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)
               ? -1
               : 0;
}

void fvt_close(struct fvt_ep *e)
{
    if (e->qp)
        ibv_destroy_qp(e->qp);
    if (e->scq)
        ibv_destroy_cq(e->scq);
    if (e->rcq)
        ibv_destroy_cq(e->rcq);
    if (e->ch)
        ibv_destroy_comp_channel(e->ch);
    if (e->pd)
        ibv_dealloc_pd(e->pd);
    if (e->ctx)
        ibv_close_device(e->ctx);
    memset(e, 0, sizeof *e);
}

static long fvt_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

int fvt_wait(struct ibv_cq *cq, struct ibv_wc *wc, int timeout_ms)
{
    long end = fvt_ms() + timeout_ms;
    for (unsigned spins = 0;; spins++) {
        int n = ibv_poll_cq(cq, 1, wc);
        if (n != 0)
            return n < 0 ? -1 : 1;
        if (fvt_ms() > end)
            return 0;
        if (spins > 1000) {
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
        }
    }
}

int fvt_post(struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t wr_id, void *buf, uint32_t len,
             uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t imm, int signaled)
{
    struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = len, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = len ? 1 : 0;
    wr.opcode = op;
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr.imm_data = imm;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(qp, &wr, &bad);
}

int fvt_post_recv(struct ibv_qp *qp, uint64_t wr_id, void *buf, uint32_t len, uint32_t lkey)
{
    struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = len, .lkey = lkey};
    struct ibv_recv_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = buf ? 1 : 0;
    return ibv_post_recv(qp, &wr, &bad);
}

int fvt_xfer(int fd, void *p, size_t n, int writing)
{
    char *c = p;
    while (n) {
        ssize_t r = writing ? write(fd, c, n) : read(fd, c, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}
