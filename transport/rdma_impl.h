/* Internals of the rdma transport shared by rdma.c (setup, ops) and
 * rdma_proto.c (the verbs protocol and its progress thread). */
#ifndef EPIPE_TRANSPORT_RDMA_IMPL_H
#define EPIPE_TRANSPORT_RDMA_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "rdma.h"
#include "rdma_reg.h"
#include "rdma_verbs.h"
#include "tcp_conn.h"

/* Per neighbour and direction: eager slots the receiver lends the sender
 * (a message of up to SLOT_SIZE bytes, header included, goes in one), at
 * most LARGE messages between request and completion, a ring of RING
 * clear-to-send entries in the sender's memory (RING >= SLOTS + LARGE:
 * an entry is rewritten only after the sender consumed it). */
#define RDMA_SLOTS 32
#define RDMA_SLOT_SIZE (32 * 1024)
#define RDMA_LARGE 8
#define RDMA_RING 64
#define RDMA_RQ_DEPTH 128  /* zero-length receives for immediates, >= SLOTS+RING+LARGE+2 */
#define RDMA_RECV_BATCH 16 /* receives re-posted at once; RQ_DEPTH - BATCH still covers the above */
#define RDMA_SQ_DEPTH 256
#define RDMA_SQ_DATA (RDMA_SQ_DEPTH - RDMA_SLOTS - RDMA_RING - 8) /* room large writes may use */
#define RDMA_CHUNK ((size_t)1 << 20)
#define RDMA_LEND_BATCH 8    /* slots lent back per clear-to-send */
#define RDMA_SIGNAL_EVERY 16 /* eager writes per signaled one */

/* Immediate values: a 4-bit type, a 28-bit value. */
enum { IMM_EAGER = 1, IMM_RTS, IMM_CTS, IMM_DONE, IMM_BYE, IMM_BYE_ACK };
#define IMM(type, v) (((uint32_t)(type) << 28) | ((uint32_t)(v)&0x0fffffffu))

/* Work-request ids: type, link, index. */
enum { WR_EAGER = 1, WR_CTS, WR_CHUNK, WR_DONE, WR_CTL, WR_RECV };
#define WRID(type, link, idx) (((uint64_t)(type) << 56) | ((uint64_t)(link) << 24) | (idx))

/* A clear-to-send entry, written by the receiver into the sender's ring. */
struct rdma_cts {
    uint64_t addr;
    uint64_t size; /* 64 bits: a message of 4 GiB or more is named whole */
    uint32_t rkey;
    uint32_t seq;  /* the receiver's CTS count: the sender expects them in order */
    uint32_t kind; /* 0: the eager slots in bitmap `tag` (slot i at addr + i * size);
                      1: the large message of sequence `tag` */
    uint32_t tag;
};
_Static_assert(sizeof(struct rdma_cts) == 32, "a CTS entry is 32 bytes (docs/rdma.md)");

/* A large message on the way out. */
struct rdma_ltx {
    int state; /* 0 free, 1 waiting for its CTS, 2 writing */
    epipe_msg *m;
    epipe_rdma_reg *reg;
    uint32_t seq;
    uint64_t raddr;
    uint32_t rkey;
    size_t off;        /* bytes posted */
    unsigned inflight; /* writes posted, not completed */
};

/* A large message on the way in. */
struct rdma_lrx {
    int busy;
    epipe_msg *m;
    epipe_rdma_reg *reg;
    uint32_t seq;
    size_t len;
};

/* Arrivals in order: a message is handed over once it and those before it are whole. */
struct rdma_pend {
    struct rdma_pend *next;
    epipe_msg *m;
    int lrx; /* -1: whole; else the large receive it waits for */
};

struct rdma;

struct rdma_link {
    struct rdma *r;
    unsigned idx, peer;
    struct ibv_qp *qp;
    uint32_t psn;
    /* My memory: slots the peer writes into, the ring it writes CTS into,
     * staging for what I send (SLOTS slots, then RING CTS sources). */
    uint8_t *slots, *stage;
    struct rdma_cts *ring;
    struct ibv_mr *slots_mr, *ring_mr, *stage_mr;
    uint64_t peer_ring;
    uint32_t peer_ring_rkey;

    pthread_mutex_t lock; /* everything below */
    int dead;             /* torn down: QP in ERR, nothing more posted */
    int peer_bye;         /* the peer said goodbye over verbs */
    int bye_acked;        /* the peer acknowledged this rank's goodbye */
    unsigned sq_used, rq_posted, cts_inflight, ctl_inflight;
    /* sending */
    epipe_msg *txq, *txq_tail;
    /* Eager slot i of the peer may be written (from my staging slot i)
     * while bit i of credit is set: its CTS lent it, and it is lent again
     * only after the peer has read what was written there. */
    uint32_t credit;
    uint64_t credit_base;
    uint32_t credit_rkey;
    unsigned unsignaled;               /* eager writes posted since the last signaled one */
    unsigned eager_signaled;           /* signaled eager writes in flight */
    uint64_t eager_posted, eager_done; /* eager writes posted; completed (signaled or implied) */
    uint64_t stage_seq[RDMA_SLOTS];    /* the write that last read staging slot i */
    struct rdma_ltx ltx[RDMA_LARGE];
    uint32_t next_lseq;
    uint32_t cts_expect; /* the next CTS sequence from the peer */
    /* receiving */
    uint32_t slot_lent; /* bit i: my slot i is lent to the peer */
    uint32_t slot_free; /* read, to be lent again (in batches of RDMA_LEND_BATCH) */
    struct rdma_lrx lrx[RDMA_LARGE];
    uint32_t cts_next; /* my next CTS sequence */
    struct rdma_pend *pq, *pq_tail;
    uint64_t sent, received;
};

struct rdma {
    epipe_comm *c;
    struct tcp *t;
    const epipe_transport_ops *tcp_ops;
    epipe_verbs v;
    epipe_verbs_dev dev;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    epipe_rdma_regcache cache;
    struct rdma_link *links;
    unsigned nlinks;
    int *link_of; /* [size]: the verbs link to a rank, or -1 (tcp) */
    pthread_t thread;
    int started, stop, evfd;
    uint32_t inject; /* tests: the next bad thing to send (epipe_rdma_debug_inject) */
};

/* ---- rdma_proto.c (links, posting, sending), rdma_recv.c (epipe_rdma_got_imm) ---- */
int epipe_rdma_link_alloc(struct rdma *r, struct rdma_link *l);
/* Posts the zero-length receives and lends every slot (after both sides are RTS). */
int epipe_rdma_link_start(struct rdma_link *l);
void epipe_rdma_link_free(struct rdma_link *l);
int epipe_rdma_send(struct rdma *r, struct rdma_link *l, epipe_msg *m);
/* Tears l down (QP to error, queue dropped) and fails its peer with status. */
void epipe_rdma_link_fail(struct rdma_link *l, int status, const char *why);
int epipe_rdma_post_ctl(struct rdma_link *l, uint32_t imm);
void *epipe_rdma_progress(void *arg);
/* Under l->lock: tear l down reporting status and why (NULL: quietly;
 * EPIPE_ENOMEM: this rank's own shortage, which fails the rank itself);
 * the same for a protocol error (EPIPE_EPROTO); post a receive; act on an
 * arrived immediate; start what the send queue holds. */
void epipe_rdma_fail_locked(struct rdma_link *l, int status, const char *why);
void epipe_rdma_protocol_error(struct rdma_link *l, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
int epipe_rdma_post_recv(struct rdma_link *l);
/* Writes a clear-to-send into the peer's ring (rdma_proto.c). */
int epipe_rdma_post_cts(struct rdma_link *l, uint64_t addr, uint64_t size, uint32_t rkey,
                        uint32_t kind, uint32_t tag);
/* My slot `slot` (-1: none) was read: lend it back, in a batch or (force) now. */
int epipe_rdma_lend_slot(struct rdma_link *l, int slot, int force);
void epipe_rdma_got_imm(struct rdma_link *l, uint32_t imm);
void epipe_rdma_pump(struct rdma_link *l);
/* Lends the peer every eager slot (under l->lock), once both QPs are ready. */
int epipe_rdma_link_lend_all(struct rdma_link *l);
/* Handles one completion (the progress thread; tests feed bogus ones). */
void epipe_rdma_handle_wc(struct rdma *r, const struct ibv_wc *wc);
/* Whether l has nothing left to send (under its lock). */
int epipe_rdma_link_idle(struct rdma_link *l);

#endif
