/* fakeverbs: the responder side of the NIC: checks each arriving request the way a
 * responder's hardware does, places its payload, completes receives and acks. */
#define _GNU_SOURCE
#include "fv_impl.h"

#include <stdio.h>
#include <string.h>

static uint64_t fv_rnr_ns(uint8_t t)
{
    static const uint32_t us[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                    160,    240,   320,   480,    640,    960,    1280,   1920,
                                    2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                    40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
    return (uint64_t)us[t & 31] * 1000u;
}

static void fv_rx_nak(struct fv_conn *c, enum ibv_wc_status st, const char *why)
{
    fv_log("qp %u <- qp %u: NAK %s (%s)", c->hello.dst_qpn, c->hello.src_qpn, ibv_wc_status_str(st),
           why);
    c->ack_err = st;
    c->failed = 1;
    c->in_payload = 0;
    if (c->stalled) {
        c->stalled = 0;
        __atomic_sub_fetch(&fv_nic.nstalled, 1, __ATOMIC_RELAXED);
        fv_conn_events(c);
    }
}

/* Stalls the stream (RC keeps order) until the condition clears or the
 * requester's retries would have run out. Returns 1 while stalled. A new
 * reason (not ready, then no receive) starts its own count. */
static int fv_rx_stall(struct fv_conn *c, enum ibv_wc_status st, uint64_t wait_ns, int forever,
                       const char *why)
{
    uint64_t now = fv_now_ns();
    if (!c->stalled || c->stall_status != (int)st) {
        if (!c->stalled)
            __atomic_add_fetch(&fv_nic.nstalled, 1, __ATOMIC_RELAXED);
        c->stalled = 1;
        c->stall_status = st;
        c->stall_deadline = forever ? 0 : now + wait_ns;
        fv_conn_events(c);
        fv_log("qp %u <- qp %u: stalled (%s)", c->hello.dst_qpn, c->hello.src_qpn, why);
        return 1;
    }
    if (c->stall_deadline && now >= c->stall_deadline) {
        fv_rx_nak(c, st, why);
        return 0;
    }
    return 1;
}

static void fv_rx_unstall(struct fv_conn *c)
{
    if (c->stalled) {
        c->stalled = 0;
        __atomic_sub_fetch(&fv_nic.nstalled, 1, __ATOMIC_RELAXED);
        fv_conn_events(c);
    }
}

static int fv_rwqe_check(struct fv_qp *q, const struct fv_rwqe *r, uint32_t len,
                         enum ibv_wc_status *st)
{
    uint64_t room = 0;
    for (uint32_t i = 0; i < r->nsge; i++) {
        const struct ibv_sge *g = &r->sge[i];
        struct fv_mr *m = fv_mr_by_lkey(g->lkey);
        if (g->length && (!m || m->mr.pd != q->qp.pd || !(m->access & IBV_ACCESS_LOCAL_WRITE) ||
                          g->addr < (uintptr_t)m->mr.addr ||
                          g->addr + g->length > (uintptr_t)m->mr.addr + m->mr.length)) {
            *st = IBV_WC_LOC_PROT_ERR;
            return 0;
        }
        room += g->length;
    }
    if (room < len) {
        *st = IBV_WC_LOC_LEN_ERR;
        return 0;
    }
    return 1;
}

/* A header is complete: check it the way the responder's hardware would.
 * 0: go on with its payload; 1: stalled; 2: refused (NAK queued). */
static int fv_rx_begin(struct fv_conn *c)
{
    struct fv_hdr *h = &c->cur;
    struct fv_qp *q = fv_qp_lookup(c->hello.dst_qpn);
    uint64_t retry_ns = ((uint64_t)4096 << h->timeout) * (h->retry_cnt + 1u);
    if (!q || (q->qp.state != IBV_QPS_RTR && q->qp.state != IBV_QPS_RTS))
        return fv_rx_stall(c, IBV_WC_RETRY_EXC_ERR, retry_ns, h->timeout == 0,
                           "no such QP, or it is not in RTR/RTS: the requester retries")
                   ? 1
                   : 2;
    if (q->dest_qpn != c->hello.src_qpn || memcmp(q->dgid.raw, c->hello.src_gid, 16) != 0)
        return fv_rx_stall(c, IBV_WC_RETRY_EXC_ERR, retry_ns, h->timeout == 0,
                           "packet from a QP this one is not connected to (dropped)")
                   ? 1
                   : 2;
    if (h->psn != q->expect_psn) {
        char why[96];
        snprintf(why, sizeof why, "PSN %u, expected %u (sq_psn/rq_psn mismatch)", h->psn,
                 q->expect_psn);
        fv_rx_nak(c, IBV_WC_RETRY_EXC_ERR, why);
        return 2;
    }
    int need_recv = h->op != FV_OP_WRITE;
    if (h->op == FV_OP_WRITE || h->op == FV_OP_WRITE_IMM) {
        struct fv_mr *m = h->len ? fv_mr_by_rkey(h->rkey) : NULL;
        if (!(q->access & IBV_ACCESS_REMOTE_WRITE)) {
            fv_rx_nak(c, IBV_WC_REM_ACCESS_ERR, "QP access flags lack IBV_ACCESS_REMOTE_WRITE");
            fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR); /* the responder fails too (access error) */
            return 2;
        }
        if (h->len &&
            (!m || m->mr.pd != q->qp.pd || !(m->access & IBV_ACCESS_REMOTE_WRITE) ||
             h->raddr < (uintptr_t)m->mr.addr || h->raddr - (uintptr_t)m->mr.addr > m->mr.length ||
             h->len > m->mr.length - (h->raddr - (uintptr_t)m->mr.addr))) {
            char why[128];
            snprintf(why, sizeof why, "rkey 0x%x addr 0x%llx len %u: %s", h->rkey,
                     (unsigned long long)h->raddr, h->len,
                     !m                                       ? "no such rkey"
                     : m->mr.pd != q->qp.pd                   ? "MR of another PD"
                     : !(m->access & IBV_ACCESS_REMOTE_WRITE) ? "MR without REMOTE_WRITE"
                                                              : "outside the MR");
            fv_rx_nak(c, IBV_WC_REM_ACCESS_ERR, why);
            fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
            return 2;
        }
    } else if (h->op != FV_OP_SEND && h->op != FV_OP_SEND_IMM) {
        fv_rx_nak(c, IBV_WC_REM_INV_REQ_ERR, "unknown opcode");
        fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
        return 2;
    }
    if (need_recv) {
        if (q->rq_head == q->rq_tail)
            return fv_rx_stall(c, IBV_WC_RNR_RETRY_EXC_ERR,
                               fv_rnr_ns(q->min_rnr_timer) * (h->rnr_retry + 1u), h->rnr_retry == 7,
                               "receiver not ready: no receive posted")
                       ? 1
                       : 2;
        c->rwqe = q->rq[q->rq_head % q->cap.max_recv_wr];
        q->rq_head++;
        c->have_rwqe = 1;
        enum ibv_wc_status st;
        if ((h->op == FV_OP_SEND || h->op == FV_OP_SEND_IMM) &&
            !fv_rwqe_check(q, &c->rwqe, h->len, &st)) {
            fv_push_recv_wc(q, &c->rwqe, st, IBV_WC_RECV, 0, 0, 0, 0);
            c->have_rwqe = 0;
            fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
            fv_rx_nak(c, st == IBV_WC_LOC_LEN_ERR ? IBV_WC_REM_INV_REQ_ERR : IBV_WC_REM_OP_ERR,
                      st == IBV_WC_LOC_LEN_ERR ? "send longer than the posted receive"
                                               : "receive buffer outside its MR");
            return 2;
        }
    }
    fv_rx_unstall(c);
    q->expect_psn = (q->expect_psn + 1) & 0xffffff;
    c->in_payload = 1;
    c->done = 0;
    c->payload_status = 0;
    return 0;
}

static void fv_rx_place(struct fv_conn *c, const unsigned char *p, uint32_t n)
{
    struct fv_hdr *h = &c->cur;
    if (c->payload_status)
        return;
    if (h->op == FV_OP_WRITE || h->op == FV_OP_WRITE_IMM) {
        if (!fv_mr_by_rkey(h->rkey)) { /* deregistered meanwhile */
            c->payload_status = IBV_WC_REM_ACCESS_ERR;
            return;
        }
        memcpy((void *)(uintptr_t)(h->raddr + c->done), p, n);
        return;
    }
    uint64_t off = c->done;
    for (uint32_t i = 0; i < c->rwqe.nsge && n; i++) {
        const struct ibv_sge *g = &c->rwqe.sge[i];
        if (off >= g->length) {
            off -= g->length;
            continue;
        }
        uint32_t k = (uint32_t)(g->length - off) < n ? (uint32_t)(g->length - off) : n;
        if (!fv_mr_by_lkey(g->lkey)) {
            c->payload_status = IBV_WC_LOC_PROT_ERR;
            return;
        }
        memcpy((void *)(uintptr_t)(g->addr + off), p, k);
        p += k;
        n -= k;
        off = 0;
    }
}

static void fv_rx_finish(struct fv_conn *c)
{
    struct fv_hdr *h = &c->cur;
    struct fv_qp *q = fv_qp_lookup(c->hello.dst_qpn);
    c->in_payload = 0;
    if (c->payload_status) {
        if (c->have_rwqe && q)
            fv_push_recv_wc(q, &c->rwqe, (enum ibv_wc_status)c->payload_status, IBV_WC_RECV, 0, 0,
                            0, 0);
        c->have_rwqe = 0;
        if (q)
            fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
        fv_rx_nak(c,
                  c->payload_status == IBV_WC_REM_ACCESS_ERR ? IBV_WC_REM_ACCESS_ERR
                                                             : IBV_WC_REM_OP_ERR,
                  "memory region deregistered during the transfer");
        return;
    }
    if (c->have_rwqe && q) {
        int ok = q->qp.state == IBV_QPS_RTR || q->qp.state == IBV_QPS_RTS;
        int imm = h->op == FV_OP_WRITE_IMM || h->op == FV_OP_SEND_IMM;
        fv_push_recv_wc(q, &c->rwqe, ok ? IBV_WC_SUCCESS : IBV_WC_WR_FLUSH_ERR,
                        h->op == FV_OP_WRITE_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV, h->len,
                        h->imm, imm, h->flags & FV_F_SOLICITED);
    }
    c->have_rwqe = 0;
    c->ack_ok++;
    if (h->flags & FV_F_ACKREQ)
        c->ack_due = 1;
}

/* Parses and executes what the requester sent; queues and sends the acks. */
int fv_rx_process(struct fv_conn *c)
{
    while (!c->failed) {
        size_t avail = c->rx_len - c->rx_off;
        unsigned char *p = c->rx + c->rx_off;
        if (!c->have_hello) {
            if (avail < sizeof c->hello)
                break;
            memcpy(&c->hello, p, sizeof c->hello);
            c->rx_off += sizeof c->hello;
            if (c->hello.magic != FV_HELLO_MAGIC) {
                fv_log("connection without a fakeverbs hello: dropped");
                c->failed = 1;
                break;
            }
            c->have_hello = 1;
            continue;
        }
        if (!c->in_payload) {
            if (avail < sizeof c->cur)
                break;
            memcpy(&c->cur, p, sizeof c->cur);
            int r = fv_rx_begin(c);
            if (r == 1)
                break;
            c->rx_off += sizeof c->cur;
            if (r == 2)
                break;
            if (c->cur.len == 0)
                fv_rx_finish(c);
            continue;
        }
        if (!avail)
            break;
        uint32_t n = c->cur.len - c->done;
        if (n > avail)
            n = (uint32_t)avail;
        fv_rx_place(c, p, n);
        c->done += n;
        c->rx_off += n;
        if (c->done == c->cur.len)
            fv_rx_finish(c);
    }
    if (c->failed)
        c->rx_off = c->rx_len; /* everything after a NAK is dropped */
    while (c->ack_ok && (c->ack_due || c->ack_err)) {
        uint32_t k = c->ack_ok > 0xffffffffu ? 0xffffffffu : (uint32_t)c->ack_ok;
        struct fv_ack a = {IBV_WC_SUCCESS, k};
        if (fv_conn_append(c, &a, sizeof a) != 0)
            break;
        c->ack_ok -= k;
    }
    if (!c->ack_ok)
        c->ack_due = 0;
    if (c->ack_err) {
        struct fv_ack a = {c->ack_err, 0}; /* the oldest outstanding send failed */
        if (fv_conn_append(c, &a, sizeof a) == 0)
            c->ack_err = 0;
    }
    return fv_conn_flush(c);
}
