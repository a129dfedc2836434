/* fakeverbs: the test verbs provider's internal structures, shared by its files.
 * Every public verbs object is embedded first in a private struct (container casts). */
#ifndef EPIPE_FAKEVERBS_IMPL_H
#define EPIPE_FAKEVERBS_IMPL_H

#include <infiniband/verbs.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define FV_EXPORT __attribute__((visibility("default")))
#define FV_MAX_SGE 16
#define FV_MAX_INLINE 256
#define FV_MAX_WR 16384
#define FV_MAX_CQE 1048576
#define FV_MAX_MSG (1u << 30)
#define FV_MAX_MR 65535
#define FV_RXBUF (256u * 1024u)

enum fv_live_kind {
    FV_LIVE_CTX,
    FV_LIVE_PD,
    FV_LIVE_MR,
    FV_LIVE_CQ,
    FV_LIVE_QP,
    FV_LIVE_CH,
    FV_LIVE_N
};

struct fv_pd {
    struct ibv_pd pd;
    int refs; /* MRs and QPs on it */
};

struct fv_mr {
    struct ibv_mr mr;
    int access;
    uint32_t slot;
};

struct fv_channel {
    struct ibv_comp_channel ch;
    int wfd; /* write end of the socket pair behind ch.fd */
    pthread_mutex_t lock;
    struct fv_cq **q; /* pending events, oldest first */
    size_t qlen, qcap;
    int cqs; /* CQs attached */
};

struct fv_cq {
    struct ibv_cq cq;
    pthread_mutex_t lock;
    struct ibv_wc *ring;
    uint32_t cap, head, count;
    int armed, solicited_only, overflow;
    uint32_t events_reported;
    int qps; /* QPs using it */
};

struct fv_swqe {
    uint64_t wr_id;
    uint32_t byte_len;
    uint8_t opcode; /* enum ibv_wc_opcode */
    uint8_t signaled;
    uint8_t err;   /* a local error found at post time: its completion status */
    uint8_t nsge;  /* EPIPE_FAKEVERBS_STRICT: the gather list kept in fv_qp.sq_sge */
    uint64_t hash; /* ... and a hash of the bytes sent */
};

struct fv_rwqe {
    uint64_t wr_id;
    uint32_t nsge;
    struct ibv_sge sge[FV_MAX_SGE];
};

struct fv_conn;

struct fv_qp {
    struct ibv_qp qp;
    struct fv_qp *hnext;
    struct ibv_qp_cap cap;
    int access, port, pkey_index;
    union ibv_gid dgid;
    uint32_t dest_qpn, rq_psn, sq_psn, expect_psn, next_psn;
    uint8_t min_rnr_timer, timeout, retry_cnt, rnr_retry;
    enum ibv_mtu mtu;
    /* send queue: [head, acked) done but slots not reclaimed (unsignaled),
   * [acked, tail) sent and waiting for the responder's ack */
    struct fv_swqe *sq;
    uint64_t sq_head, sq_acked, sq_tail;
    struct fv_rwqe *rq;
    uint64_t rq_head, rq_tail;
    struct fv_conn *out; /* requester connection to the peer's NIC */
    int out_broken;      /* peer unreachable: next send fails with RETRY_EXC_ERR */
    int sig_all;
    struct ibv_sge *sq_sge; /* strict mode: FV_MAX_SGE entries per send-queue slot */
};

/* Wire format between NICs (host byte order: one machine). */
#define FV_HELLO_MAGIC 0x46564831u /* "FVH1" */
struct fv_hello {
    uint32_t magic, src_qpn, dst_qpn, pad;
    uint8_t src_gid[16];
};
enum { FV_OP_WRITE = 1, FV_OP_WRITE_IMM, FV_OP_SEND, FV_OP_SEND_IMM };
/* FV_F_ACKREQ: a signaled send; the responder acks at once. Acks count cumulatively,
 * so those of unsignaled sends wait for the next one (no completion needs them). */
enum { FV_F_SOLICITED = 1, FV_F_ACKREQ = 2 };
struct fv_hdr {
    uint8_t op, flags, rnr_retry, timeout;
    uint8_t retry_cnt, pad[3];
    uint32_t psn, rkey, imm, len;
    uint64_t raddr;
};
struct fv_ack {
    uint32_t status, count;
};

struct fv_conn {
    int fd;
    int outgoing;
    int dead;
    struct fv_conn *next; /* nic list or graveyard */
    /* outgoing (requester side) */
    struct fv_qp *qp;
    unsigned char *tx;
    size_t tx_len, tx_cap, tx_off;
    int want_out;
    unsigned char ackpart[sizeof(struct fv_ack)];
    size_t ackpart_len;
    /* incoming (responder side) */
    unsigned char *rx;
    size_t rx_len, rx_off;
    int have_hello;
    struct fv_hello hello;
    int in_payload;
    struct fv_hdr cur;
    uint32_t done;
    int have_rwqe;
    struct fv_rwqe rwqe;
    int payload_status; /* first error met while placing the payload */
    int stalled;
    uint64_t stall_deadline; /* ns, CLOCK_MONOTONIC; 0 = never */
    int stall_status;
    int failed; /* sent an error NAK: drop everything after */
    uint64_t ack_ok;
    int ack_due; /* a request asked for its ack */
    uint32_t ack_err;
    uint32_t ev_mask; /* epoll events registered */
};

struct fv_nic {
    pthread_mutex_t lock; /* QPs, MR table, connections */
    int users;            /* open contexts */
    int running;
    pthread_t thread;
    int epfd, lfd, kickfd;
    int stop;
    union ibv_gid gid;
    char sockname[64];
    struct fv_conn *conns;     /* incoming, owned by the NIC thread */
    struct fv_conn *graveyard; /* outgoing, freed by the NIC thread */
    struct fv_qp *qps[256];
    uint32_t next_qpn;
    struct fv_mr **mrs;
    uint8_t *mrgen;
    uint32_t nmrs;
    int nstalled;
    uint64_t poll_until; /* ns: a thread polls a CQ and drives the NIC until then */
    /* fault injection: call counters and the failing call (0 = none) */
    unsigned long calls[4], fail_at[4];
    int log;
    int strict; /* EPIPE_FAKEVERBS_STRICT=1 */
};

enum { FV_FAIL_REG_MR, FV_FAIL_CREATE_QP, FV_FAIL_MODIFY_QP, FV_FAIL_POST_SEND };

extern struct fv_nic fv_nic;

void fv_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void fv_live_add(enum fv_live_kind kind, int delta);
void fv_live_reset(void); /* in a forked child */
int fv_fail_now(int op);  /* under fv_nic.lock: counts a call, 1 when this one fails */
uint64_t fv_now_ns(void);

/* nic.c: the NIC thread and its connections (callers hold fv_nic.lock unless noted) */
int fv_nic_start(void); /* not locked */
void fv_nic_stop(void); /* not locked */
void fv_nic_kick(void);
void fv_nic_progress(int claim); /* not locked: from ibv_poll_cq */
int fv_conn_open(struct fv_qp *qp);
void fv_conn_close(struct fv_conn *c);
int fv_conn_flush(struct fv_conn *c);
void fv_conn_events(struct fv_conn *c); /* epoll interest from stalled/want_out */
int fv_conn_append(struct fv_conn *c, const void *p, size_t n);
void fv_gid_sockname(const union ibv_gid *gid, char *name, size_t cap);

/* rx.c: the responder (fv_nic.lock held) */
int fv_rx_process(struct fv_conn *c);

/* mr lookups (fv_nic.lock held) */
struct fv_mr *fv_mr_by_lkey(uint32_t lkey);
struct fv_mr *fv_mr_by_rkey(uint32_t rkey);

/* cq.c */
void fv_cq_push(struct fv_cq *cq, const struct ibv_wc *wc, int solicited);
int fv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc);
int fv_req_notify_cq(struct ibv_cq *cq, int solicited_only);

/* qp.c */
struct fv_qp *fv_qp_lookup(uint32_t qpn);
void fv_qp_to_err(struct fv_qp *qp, enum ibv_wc_status first);
void fv_qp_acked(struct fv_qp *qp, uint32_t count, enum ibv_wc_status status);
void fv_qp_peer_gone(struct fv_qp *qp);
int fv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
int fv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);
void fv_push_recv_wc(struct fv_qp *qp, const struct fv_rwqe *r, enum ibv_wc_status st,
                     enum ibv_wc_opcode op, uint32_t len, uint32_t imm, int with_imm,
                     int solicited);

#define FV_CONTAINER(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

#endif
