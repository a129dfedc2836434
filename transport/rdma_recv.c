/* The receiving side of the rdma protocol: immediates from the peer, eager
 * messages, requests to send, clear-to-sends, completions of large messages. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/log.h"
#include "rdma_impl.h"

/* ---- receiving ---------------------------------------------------------- */

void epipe_rdma_protocol_error(struct rdma_link *l, const char *fmt, ...)
{
    char why[EPIPE_ERRMSG_MAX];
    int n = snprintf(why, sizeof why, "protocol error from rank %u: ", l->peer);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why + n, sizeof why - (size_t)n, fmt, ap);
    va_end(ap);
    epipe_rdma_fail_locked(l, EPIPE_EPROTO, why);
}

/* Tears the link down with a wire check's own status (EPIPE_ECHECKSUM,
 * EPIPE_ETOOBIG, ...) and message, so receivers see what tcp would show. */
static int fail_wire_check(struct rdma_link *l, int rc)
{
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s from rank %u: %.180s", epipe_status_name(rc), l->peer,
             epipe_last_error());
    epipe_rdma_fail_locked(l, rc, why);
    return rc;
}

/* Parses and checks a wire header at p (at most cap bytes of message). */
static int parse_header(struct rdma_link *l, const uint8_t *p, size_t cap, epipe_wire_header *h)
{
    epipe_comm *c = l->r->c;
    epipe_wire_limits lim = {.max_payload = __atomic_load_n(&c->max_message, __ATOMIC_RELAXED)};
    int rc = epipe_wire_parse_header(p, cap, &lim, h);
    if (rc)
        return fail_wire_check(l, rc);
    if (h->kind != EPIPE_WIRE_ACTIVATION && h->kind != EPIPE_WIRE_GRADIENT) {
        epipe_rdma_protocol_error(l, "a message of kind %u over verbs", h->kind);
        return EPIPE_EPROTO;
    }
    if (h->src_stage != l->peer || h->dst_stage != c->rank) {
        epipe_rdma_protocol_error(l, "a message from rank %u to rank %u on its link", h->src_stage,
                                  h->dst_stage);
        return EPIPE_EPROTO;
    }
    return EPIPE_OK;
}

static int check_payload(struct rdma_link *l, epipe_msg *m)
{
    int rc = epipe_wire_check_payload_crc(&m->hdr, m->data + m->hdr.header_len,
                                          (size_t)m->hdr.payload_len, NULL);
    return rc ? fail_wire_check(l, rc) : EPIPE_OK;
}

static void flush_pending(struct rdma_link *l)
{
    while (l->pq && l->pq->lrx < 0) {
        struct rdma_pend *p = l->pq;
        l->pq = p->next;
        if (!l->pq)
            l->pq_tail = NULL;
        l->received++;
        epipe_comm_deliver(l->r->c, p->m);
        free(p);
    }
}

static int pend(struct rdma_link *l, epipe_msg *m, int lrx)
{
    struct rdma_pend *p = malloc(sizeof *p);
    if (!p) {
        epipe_msg_free(m);
        epipe_rdma_fail_locked(l, EPIPE_ENOMEM, "no memory to hold a message in order");
        return EPIPE_ENOMEM;
    }
    *p = (struct rdma_pend){.m = m, .lrx = lrx};
    if (l->pq_tail)
        l->pq_tail->next = p;
    else
        l->pq = p;
    l->pq_tail = p;
    return EPIPE_OK;
}

static void got_eager(struct rdma_link *l, unsigned slot, int rts)
{
    epipe_comm *c = l->r->c;
    if (slot >= RDMA_SLOTS || !(l->slot_lent & (1u << slot))) {
        epipe_rdma_protocol_error(
            l, "an immediate names eager slot %u, which this rank did not lend it", slot);
        return;
    }
    l->slot_lent &= ~(1u << slot);
    const uint8_t *p = l->slots + (size_t)slot * RDMA_SLOT_SIZE;
    epipe_wire_header h;
    if (rts) {
        uint32_t w[4];
        memcpy(w, p, sizeof w);
        if (parse_header(l, p + sizeof w, RDMA_SLOT_SIZE - sizeof w, &h))
            return;
        uint64_t len = w[2] | (uint64_t)w[3] << 32;
        if (len != h.header_len + h.payload_len) {
            epipe_rdma_protocol_error(l, "a request to send %llu bytes for a %llu-byte message",
                                      (unsigned long long)len,
                                      (unsigned long long)(h.header_len + h.payload_len));
            return;
        }
        int li = -1;
        for (int i = 0; i < RDMA_LARGE; i++) {
            if (l->lrx[i].busy && l->lrx[i].seq == w[0]) {
                epipe_rdma_protocol_error(l, "a second request to send message sequence %u", w[0]);
                return;
            }
            if (!l->lrx[i].busy && li < 0)
                li = i;
        }
        if (w[0] > 0x0fffffffu) {
            epipe_rdma_protocol_error(l, "a request to send with sequence %u (at most 2^28 - 1)",
                                      w[0]);
            return;
        }
        if (li < 0) {
            epipe_rdma_protocol_error(l, "more than %d large messages at once", RDMA_LARGE);
            return;
        }
        epipe_msg *m = epipe_comm_msg_new(c, len - EPIPE_WIRE_HEADER_SIZE);
        if (!m) {
            epipe_rdma_fail_locked(l, EPIPE_ENOMEM, "no memory for a large message");
            return;
        }
        epipe_rdma_reg *reg;
        if (epipe_rdma_reg_get(&l->r->cache, m->data, len, &reg)) {
            char why[EPIPE_ERRMSG_MAX];
            snprintf(why, sizeof why, "receiving from rank %u: %s", l->peer, epipe_last_error());
            epipe_msg_free(m);
            epipe_rdma_fail_locked(l, EPIPE_EPEER, why);
            return;
        }
        m->hdr = h;
        m->len = len;
        l->lrx[li] = (struct rdma_lrx){.busy = 1, .m = m, .reg = reg, .seq = w[0], .len = len};
        uint64_t size = len;
        if (l->r->inject == EPIPE_RDMA_INJECT_SHORT_CTS) { /* tests: a CTS naming half */
            l->r->inject = 0;
            size = len / 2;
        }
        if (epipe_rdma_lend_slot(l, (int)slot, 0) || pend(l, NULL, li))
            return;
        epipe_rdma_post_cts(l, (uintptr_t)m->data, size, reg->mr->rkey, 1, w[0]);
        return;
    }
    if (parse_header(l, p, RDMA_SLOT_SIZE, &h))
        return;
    size_t len = h.header_len + (size_t)h.payload_len;
    if (len > RDMA_SLOT_SIZE) {
        epipe_rdma_protocol_error(l, "a %zu-byte message in a %d-byte eager slot", len,
                                  RDMA_SLOT_SIZE);
        return;
    }
    epipe_msg *m = epipe_comm_msg_new(c, len - EPIPE_WIRE_HEADER_SIZE);
    if (!m) {
        epipe_rdma_fail_locked(l, EPIPE_ENOMEM, "no memory for a message");
        return;
    }
    memcpy(m->data, p, len);
    m->len = len;
    m->hdr = h;
    if (epipe_rdma_lend_slot(l, (int)slot, 0)) {
        epipe_msg_free(m);
        return;
    }
    if (check_payload(l, m)) {
        epipe_msg_free(m);
        return;
    }
    if (pend(l, m, -1) == EPIPE_OK)
        flush_pending(l);
}

static void got_done(struct rdma_link *l, uint32_t seq)
{
    int li = -1;
    for (int i = 0; i < RDMA_LARGE && li < 0; i++)
        if (l->lrx[i].busy && l->lrx[i].seq == seq)
            li = i;
    if (li < 0) {
        epipe_rdma_protocol_error(
            l, "an immediate for message sequence %u, which it never announced", seq);
        return;
    }
    struct rdma_lrx *x = &l->lrx[li];
    epipe_wire_header h;
    if (parse_header(l, x->m->data, x->len, &h))
        return;
    if (h.header_len + h.payload_len != x->len) {
        epipe_rdma_protocol_error(l, "a %llu-byte message where it announced %zu bytes",
                                  (unsigned long long)(h.header_len + h.payload_len), x->len);
        return;
    }
    epipe_msg *m = x->m;
    m->hdr = h;
    epipe_rdma_reg_put(&l->r->cache, x->reg);
    memset(x, 0, sizeof *x);
    if (check_payload(l, m)) {
        epipe_msg_free(m);
        return;
    }
    for (struct rdma_pend *p = l->pq; p; p = p->next)
        if (p->lrx == li && !p->m) {
            p->m = m, p->lrx = -1;
            break;
        }
    flush_pending(l);
}

static void got_cts(struct rdma_link *l, uint32_t imm_seq)
{
    unsigned i = l->cts_expect % RDMA_RING;
    struct rdma_cts e = l->ring[i];
    if (imm_seq != (l->cts_expect & 0x0fffffffu) || e.seq != l->cts_expect) {
        epipe_rdma_protocol_error(l, "a clear-to-send out of sequence (%u, expected %u)", e.seq,
                                  l->cts_expect);
        return;
    }
    l->cts_expect++;
    if (e.kind == 0) {
        if ((RDMA_SLOTS < 32 && e.tag >> RDMA_SLOTS) || (e.tag & l->credit) ||
            e.size != RDMA_SLOT_SIZE ||
            (l->credit_base && (e.addr != l->credit_base || e.rkey != l->credit_rkey))) {
            epipe_rdma_protocol_error(l,
                                      "a clear-to-send lending eager slots 0x%x of %llu bytes "
                                      "at 0x%llx (holding 0x%x)",
                                      e.tag, (unsigned long long)e.size, (unsigned long long)e.addr,
                                      l->credit);
            return;
        }
        l->credit |= e.tag;
        l->credit_base = e.addr;
        l->credit_rkey = e.rkey;
    } else if (e.kind == 1) {
        struct rdma_ltx *x = NULL;
        for (int k = 0; k < RDMA_LARGE && !x; k++)
            if (l->ltx[k].state == 1 && l->ltx[k].seq == e.tag)
                x = &l->ltx[k];
        if (!x) {
            epipe_rdma_protocol_error(
                l, "a clear-to-send for message sequence %u, which is not waiting", e.tag);
            return;
        }
        if (e.size < x->m->len) {
            epipe_rdma_protocol_error(l,
                                      "a clear-to-send names a buffer of %llu bytes for a %zu-byte "
                                      "message",
                                      (unsigned long long)e.size, x->m->len);
            return;
        }
        x->state = 2;
        x->raddr = e.addr;
        x->rkey = e.rkey;
    } else {
        epipe_rdma_protocol_error(l, "a clear-to-send of unknown kind %u", e.kind);
        return;
    }
    epipe_rdma_pump(l);
}

void epipe_rdma_got_imm(struct rdma_link *l, uint32_t imm)
{
    uint32_t type = imm >> 28, v = imm & 0x0fffffffu;
    switch (type) {
    case IMM_EAGER: got_eager(l, v, 0); return;
    case IMM_RTS: got_eager(l, v, 1); return;
    case IMM_CTS: got_cts(l, v); return;
    case IMM_DONE: got_done(l, v); return;
    case IMM_BYE:
        epipe_rdma_post_ctl(l, IMM(IMM_BYE_ACK, 0));
        l->peer_bye = 1;
        return;
    case IMM_BYE_ACK: l->bye_acked = 1; return;
    }
    epipe_rdma_protocol_error(l, "an immediate of unknown type %u", type);
}
