/* fakeverbs tests: helpers that set up an RC endpoint over the test provider
 * (device, PD, CQs, QP through RESET->INIT->RTR->RTS) and wait for completions. */
#ifndef EPIPE_FV_TESTUTIL_H
#define EPIPE_FV_TESTUTIL_H

#include <infiniband/verbs.h>
#include <stdint.h>

int fakeverbs_live(const char *what);

struct fvt_ep {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_cq *scq, *rcq;
    struct ibv_qp *qp;
};

struct fvt_info {
    union ibv_gid gid;
    uint32_t qpn, psn;
};

/* Opens the device and makes a QP in RESET->INIT (0, or -1). */
int fvt_open(struct fvt_ep *e, int cqe, int wr, int with_channel);
void fvt_info(const struct fvt_ep *e, struct fvt_info *i);
/* INIT->RTR->RTS towards peer; rnr_retry and timeout as the QP attributes. */
int fvt_connect(struct fvt_ep *e, const struct fvt_info *peer, int rnr_retry, int timeout);
void fvt_close(struct fvt_ep *e);
/* Polls cq until one completion arrives (1), or timeout_ms passes (0), or error (-1). */
int fvt_wait(struct ibv_cq *cq, struct ibv_wc *wc, int timeout_ms);
/* Write / send helpers: one signaled WR. */
int fvt_post(struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t wr_id, void *buf, uint32_t len,
             uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t imm, int signaled);
int fvt_post_recv(struct ibv_qp *qp, uint64_t wr_id, void *buf, uint32_t len, uint32_t lkey);
/* Full read/write on a pipe or socket. */
int fvt_xfer(int fd, void *p, size_t n, int writing);

#endif
