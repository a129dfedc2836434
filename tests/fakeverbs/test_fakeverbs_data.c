/* Tests of the test verbs provider in one process: transfers between two QPs and
 * the errors hardware reports (access, RNR, length, overflow, PSN, flush). */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "test_fakeverbs.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RW (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)

struct fixture {
    struct fvt_ep a, b;
    char src[4096], dst[4096];
    struct ibv_mr *smr, *dmr;
};

static void setup(struct fixture *f, int cqe, int chan_b, int rnr_retry, int timeout)
{
    memset(f, 0, sizeof *f);
    fvt_pair(&f->a, &f->b, cqe, chan_b, rnr_retry, timeout);
    for (size_t i = 0; i < sizeof f->src; i++)
        f->src[i] = (char)(i * 7 + 1);
    f->smr = (ibv_reg_mr)(f->a.pd, f->src, sizeof f->src, IBV_ACCESS_LOCAL_WRITE);
    f->dmr = (ibv_reg_mr)(f->b.pd, f->dst, sizeof f->dst, RW);
    assert_non_null(f->smr);
    assert_non_null(f->dmr);
}

static void teardown(struct fixture *f)
{
    assert_int_equal(ibv_dereg_mr(f->smr), 0);
    assert_int_equal(ibv_dereg_mr(f->dmr), 0);
    fvt_close(&f->a);
    fvt_close(&f->b);
    fvt_assert_no_leaks();
}

static int write_to(struct fixture *f, enum ibv_wr_opcode op, uint64_t id, size_t off, uint32_t len,
                    uint32_t rkey, uint32_t imm)
{
    return fvt_post(f->a.qp, op, id, f->src, len, f->smr->lkey, (uintptr_t)f->dst + off, rkey, imm,
                    1);
}

static void expect(struct ibv_cq *cq, uint64_t wr_id, enum ibv_wc_status st)
{
    struct ibv_wc wc;
    assert_int_equal(fvt_wait(cq, &wc, 5000), 1);
    if (wc.status != st || wc.wr_id != wr_id)
        fail_msg("completion wr %llu status %s, expected wr %llu %s", (unsigned long long)wc.wr_id,
                 ibv_wc_status_str(wc.status), (unsigned long long)wr_id, ibv_wc_status_str(st));
}

static void expect_none(struct ibv_cq *cq, int ms)
{
    struct ibv_wc wc;
    assert_int_equal(fvt_wait(cq, &wc, ms), 0);
}

void test_write_imm(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    assert_int_equal(fvt_post_recv(f.b.qp, 11, NULL, 0, 0), 0);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE_WITH_IMM, 5, 8, 100, f.dmr->rkey, htonl(77)),
                     0);
    struct ibv_wc wc;
    assert_int_equal(fvt_wait(f.a.scq, &wc, 5000), 1);
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_int_equal(wc.opcode, IBV_WC_RDMA_WRITE);
    assert_int_equal(wc.wr_id, 5);
    assert_int_equal(fvt_wait(f.b.rcq, &wc, 5000), 1);
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_int_equal(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
    assert_int_equal(wc.wr_id, 11);
    assert_int_equal(wc.byte_len, 100);
    assert_true(wc.wc_flags & IBV_WC_WITH_IMM);
    assert_int_equal(ntohl(wc.imm_data), 77);
    assert_int_equal(wc.qp_num, f.b.qp->qp_num);
    assert_int_equal(wc.src_qp, f.a.qp->qp_num);
    assert_memory_equal(f.dst + 8, f.src, 100);
    assert_int_equal(f.dst[7], 0);
    assert_int_equal(f.dst[108], 0);
    /* a plain write consumes no receive and completes nothing on the responder */
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 6, 1000, 50, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 6, IBV_WC_SUCCESS);
    assert_memory_equal(f.dst + 1000, f.src, 50);
    expect_none(f.b.rcq, 20);
    /* zero-length write with immediate: no memory touched, rkey not checked */
    assert_int_equal(fvt_post_recv(f.b.qp, 12, NULL, 0, 0), 0);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE_WITH_IMM, 7, 0, 0, 0, htonl(9)), 0);
    expect(f.a.scq, 7, IBV_WC_SUCCESS);
    assert_int_equal(fvt_wait(f.b.rcq, &wc, 5000), 1);
    assert_int_equal(wc.byte_len, 0);
    assert_int_equal(ntohl(wc.imm_data), 9);
    teardown(&f);
}

void test_send_recv(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    struct ibv_sge sg[2] = {{(uintptr_t)f.dst, 10, f.dmr->lkey},
                            {(uintptr_t)f.dst + 100, 54, f.dmr->lkey}};
    struct ibv_recv_wr rwr = {.wr_id = 21, .sg_list = sg, .num_sge = 2}, *rbad;
    assert_int_equal(ibv_post_recv(f.b.qp, &rwr, &rbad), 0);
    assert_int_equal(
        fvt_post(f.a.qp, IBV_WR_SEND_WITH_IMM, 3, f.src, 40, f.smr->lkey, 0, 0, htonl(5), 1), 0);
    expect(f.a.scq, 3, IBV_WC_SUCCESS);
    struct ibv_wc wc;
    assert_int_equal(fvt_wait(f.b.rcq, &wc, 5000), 1);
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_int_equal(wc.opcode, IBV_WC_RECV);
    assert_int_equal(wc.byte_len, 40);
    assert_int_equal(ntohl(wc.imm_data), 5);
    assert_memory_equal(f.dst, f.src, 10); /* scattered over both entries */
    assert_memory_equal(f.dst + 100, f.src + 10, 30);
    /* inline: the lkey is not used; over max_inline_data it is refused */
    assert_int_equal(fvt_post_recv(f.b.qp, 22, f.dst + 200, 64, f.dmr->lkey), 0);
    char tmp[100] = "inline bytes";
    struct ibv_sge s = {(uintptr_t)tmp, 13, 0};
    struct ibv_send_wr w = {.wr_id = 4,
                            .sg_list = &s,
                            .num_sge = 1,
                            .opcode = IBV_WR_SEND,
                            .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED},
                       *bad = NULL;
    assert_int_equal(ibv_post_send(f.a.qp, &w, &bad), 0);
    expect(f.a.scq, 4, IBV_WC_SUCCESS);
    expect(f.b.rcq, 22, IBV_WC_SUCCESS);
    assert_string_equal(f.dst + 200, "inline bytes");
    s.length = 100;
    assert_int_equal(ibv_post_send(f.a.qp, &w, &bad), EINVAL);
    assert_ptr_equal(bad, &w);
    /* more gather entries than max_send_sge */
    struct ibv_sge many[5] = {{0}};
    struct ibv_send_wr w5 = {.wr_id = 5, .sg_list = many, .num_sge = 5, .opcode = IBV_WR_SEND};
    assert_int_equal(ibv_post_send(f.a.qp, &w5, &bad), EINVAL);
    teardown(&f);
}

void test_unsignaled_slots(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14); /* max_send_wr 16 */
    for (int i = 0; i < 16; i++)
        assert_int_equal(fvt_post(f.a.qp, IBV_WR_RDMA_WRITE, (uint64_t)i, f.src, 8, f.smr->lkey,
                                  (uintptr_t)f.dst, f.dmr->rkey, 0, 0),
                         0);
    expect_none(f.a.scq, 30); /* done, but unsignaled: no completion */
    /* the slots of unsignaled sends come back only with a later signaled completion */
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_RDMA_WRITE, 16, f.src, 8, f.smr->lkey,
                              (uintptr_t)f.dst, f.dmr->rkey, 0, 1),
                     ENOMEM);
    teardown(&f);
    setup(&f, 64, 0, 7, 14);
    for (int i = 0; i < 16; i++)
        assert_int_equal(fvt_post(f.a.qp, IBV_WR_RDMA_WRITE, (uint64_t)i, f.src, 8, f.smr->lkey,
                                  (uintptr_t)f.dst, f.dmr->rkey, 0, i == 15),
                         0);
    expect(f.a.scq, 15, IBV_WC_SUCCESS);
    expect_none(f.a.scq, 10);
    for (int i = 0; i < 16; i++)
        assert_int_equal(fvt_post(f.a.qp, IBV_WR_RDMA_WRITE, (uint64_t)i, f.src, 8, f.smr->lkey,
                                  (uintptr_t)f.dst, f.dmr->rkey, 0, i == 15),
                         0);
    expect(f.a.scq, 15, IBV_WC_SUCCESS);
    teardown(&f);
}

void test_bad_rkey_flush(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    assert_int_equal(fvt_post_recv(f.a.qp, 90, NULL, 0, 0), 0);
    assert_int_equal(fvt_post_recv(f.b.qp, 91, NULL, 0, 0), 0);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 1, 0, 16, f.dmr->rkey ^ 0x100, 0), 0);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 2, 0, 16, f.dmr->rkey, 0), 0);
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_RDMA_WRITE, 3, f.src, 16, f.smr->lkey,
                              (uintptr_t)f.dst, f.dmr->rkey, 0, 0),
                     0); /* unsignaled: flushed too */
    expect(f.a.scq, 1, IBV_WC_REM_ACCESS_ERR);
    expect(f.a.scq, 2, IBV_WC_WR_FLUSH_ERR);
    expect(f.a.scq, 3, IBV_WC_WR_FLUSH_ERR);
    expect(f.a.rcq, 90, IBV_WC_WR_FLUSH_ERR);
    assert_int_equal(f.a.qp->state, IBV_QPS_ERR);
    /* the responder's QP fails too (an access error), its receives are flushed */
    expect(f.b.rcq, 91, IBV_WC_WR_FLUSH_ERR);
    assert_int_equal(f.b.qp->state, IBV_QPS_ERR);
    assert_int_equal(f.dst[0], 0);
    /* posting to a QP in ERR completes at once with a flush error */
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 4, 0, 16, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 4, IBV_WC_WR_FLUSH_ERR);
    /* the lkey is not an rkey */
    struct fixture g;
    teardown(&f);
    setup(&g, 64, 0, 7, 14);
    assert_int_equal(write_to(&g, IBV_WR_RDMA_WRITE, 1, 0, 16, g.dmr->lkey, 0), 0);
    expect(g.a.scq, 1, IBV_WC_REM_ACCESS_ERR);
    teardown(&g);
}

void test_out_of_bounds(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 1, sizeof f.dst - 4, 8, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 1, IBV_WC_REM_ACCESS_ERR);
    assert_int_equal(f.dst[sizeof f.dst - 4], 0);
    teardown(&f);
    /* an MR registered without REMOTE_WRITE */
    setup(&f, 64, 0, 7, 14);
    struct ibv_mr *ro = (ibv_reg_mr)(f.b.pd, f.dst, 64,
                                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 1, 0, 8, ro->rkey, 0), 0);
    expect(f.a.scq, 1, IBV_WC_REM_ACCESS_ERR);
    ibv_dereg_mr(ro);
    teardown(&f);
    /* a deregistered MR */
    setup(&f, 64, 0, 7, 14);
    uint32_t old = f.dmr->rkey;
    ibv_dereg_mr(f.dmr);
    f.dmr = (ibv_reg_mr)(f.b.pd, f.dst, sizeof f.dst, RW);
    assert_int_not_equal(f.dmr->rkey, old);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 1, 0, 8, old, 0), 0);
    expect(f.a.scq, 1, IBV_WC_REM_ACCESS_ERR);
    teardown(&f);
    /* the responder QP does not allow remote writes */
    setup(&f, 64, 0, 7, 14);
    struct ibv_qp_attr at = {.qp_access_flags = IBV_ACCESS_LOCAL_WRITE};
    assert_int_equal(ibv_modify_qp(f.b.qp, &at, IBV_QP_ACCESS_FLAGS), 0);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 1, 0, 8, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 1, IBV_WC_REM_ACCESS_ERR);
    teardown(&f);
}

void test_bad_lkey(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    /* b's MR is in another protection domain */
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_RDMA_WRITE, 1, f.dst, 8, f.dmr->lkey, (uintptr_t)f.dst,
                              f.dmr->rkey, 0, 1),
                     0);
    expect(f.a.scq, 1, IBV_WC_LOC_PROT_ERR);
    assert_int_equal(f.a.qp->state, IBV_QPS_ERR);
    teardown(&f);
    setup(&f, 64, 0, 7, 14);
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_RDMA_WRITE, 1, f.src + 4000, 200, f.smr->lkey,
                              (uintptr_t)f.dst, f.dmr->rkey, 0, 1),
                     0);
    expect(f.a.scq, 1, IBV_WC_LOC_PROT_ERR);
    teardown(&f);
}

void test_rnr(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 1, 14); /* one RNR retry */
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE_WITH_IMM, 1, 0, 8, f.dmr->rkey, 1), 0);
    expect(f.a.scq, 1, IBV_WC_RNR_RETRY_EXC_ERR);
    assert_int_equal(f.dst[0], 0); /* nothing placed */
    teardown(&f);
    setup(&f, 64, 0, 7, 14); /* 7: retry for ever */
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_SEND, 1, f.src, 8, f.smr->lkey, 0, 0, 0, 1), 0);
    expect_none(f.a.scq, 50);
    assert_int_equal(fvt_post_recv(f.b.qp, 2, f.dst, 8, f.dmr->lkey), 0);
    expect(f.a.scq, 1, IBV_WC_SUCCESS);
    expect(f.b.rcq, 2, IBV_WC_SUCCESS);
    teardown(&f);
}

void test_send_too_long(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    assert_int_equal(fvt_post_recv(f.b.qp, 2, f.dst, 8, f.dmr->lkey), 0);
    assert_int_equal(fvt_post_recv(f.b.qp, 3, f.dst, 8, f.dmr->lkey), 0);
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_SEND, 1, f.src, 16, f.smr->lkey, 0, 0, 0, 1), 0);
    expect(f.a.scq, 1, IBV_WC_REM_INV_REQ_ERR);
    expect(f.b.rcq, 2, IBV_WC_LOC_LEN_ERR);
    expect(f.b.rcq, 3, IBV_WC_WR_FLUSH_ERR);
    assert_int_equal(f.b.qp->state, IBV_QPS_ERR);
    teardown(&f);
}

void test_cq_overflow(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 4, 0, 7, 14);
    for (int i = 0; i < 6; i++)
        assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, (uint64_t)i, 0, 8, f.dmr->rkey, 0), 0);
    struct ibv_wc wc[8];
    int n = 0;
    for (int tries = 0; tries < 500 && n >= 0; tries++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        n = ibv_poll_cq(f.a.scq, 0, wc); /* looks without taking */
    }
    assert_true(n < 0);
    assert_true(ibv_poll_cq(f.a.scq, 8, wc) < 0);
    teardown(&f);
}

void test_channel(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 1, 7, 14);
    int fd = f.b.ch->fd;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    assert_int_equal(ibv_req_notify_cq(f.b.rcq, 0), 0);
    assert_int_equal(poll(&p, 1, 0), 0);
    assert_int_equal(fvt_post_recv(f.b.qp, 1, NULL, 0, 0), 0);
    assert_int_equal(fvt_post_recv(f.b.qp, 2, NULL, 0, 0), 0);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE_WITH_IMM, 1, 0, 8, f.dmr->rkey, 1), 0);
    assert_int_equal(poll(&p, 1, 5000), 1);
    struct ibv_cq *cq = NULL;
    void *ctx = (void *)1;
    assert_int_equal(ibv_get_cq_event(f.b.ch, &cq, &ctx), 0);
    assert_ptr_equal(cq, f.b.rcq);
    assert_null(ctx);
    expect(f.b.rcq, 1, IBV_WC_SUCCESS);
    /* not re-armed: the next completion raises no event */
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE_WITH_IMM, 2, 0, 8, f.dmr->rkey, 2), 0);
    expect(f.b.rcq, 2, IBV_WC_SUCCESS);
    assert_int_equal(poll(&p, 1, 20), 0);
    /* non-blocking channel fd: no event is EAGAIN */
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    errno = 0;
    assert_int_equal(ibv_get_cq_event(f.b.ch, &cq, &ctx), -1);
    assert_int_equal(errno, EAGAIN);
    /* solicited only: an unsolicited send does not wake, a solicited one does */
    assert_int_equal(ibv_req_notify_cq(f.b.rcq, 1), 0);
    assert_int_equal(fvt_post_recv(f.b.qp, 3, f.dst, 64, f.dmr->lkey), 0);
    assert_int_equal(fvt_post_recv(f.b.qp, 4, f.dst, 64, f.dmr->lkey), 0);
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_SEND, 3, f.src, 8, f.smr->lkey, 0, 0, 0, 1), 0);
    expect(f.b.rcq, 3, IBV_WC_SUCCESS);
    assert_int_equal(poll(&p, 1, 20), 0);
    struct ibv_sge s = {(uintptr_t)f.src, 8, f.smr->lkey};
    struct ibv_send_wr w = {.wr_id = 4,
                            .sg_list = &s,
                            .num_sge = 1,
                            .opcode = IBV_WR_SEND,
                            .send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED},
                       *bad;
    assert_int_equal(ibv_post_send(f.a.qp, &w, &bad), 0);
    assert_int_equal(poll(&p, 1, 5000), 1);
    assert_int_equal(ibv_get_cq_event(f.b.ch, &cq, &ctx), 0);
    /* two events got, one acked: the CQ cannot be destroyed yet */
    ibv_ack_cq_events(f.b.rcq, 1);
    assert_int_equal(ibv_destroy_qp(f.b.qp), 0);
    f.b.qp = NULL;
    assert_int_equal(ibv_destroy_cq(f.b.rcq), EBUSY);
    assert_int_equal(ibv_destroy_comp_channel(f.b.ch), EBUSY);
    ibv_ack_cq_events(f.b.rcq, 1);
    teardown(&f);
}

void test_psn_mismatch(void **state)
{
    (void)state;
    struct fvt_ep a, b;
    assert_int_equal(fvt_open(&a, 8, 4, 0), 0);
    assert_int_equal(fvt_open(&b, 8, 4, 0), 0);
    struct fvt_info ia, ib;
    fvt_info(&a, &ia);
    fvt_info(&b, &ib);
    ia.psn += 1; /* b expects a PSN a does not start from */
    assert_int_equal(fvt_connect(&a, &ib, 7, 14), 0);
    assert_int_equal(fvt_connect(&b, &ia, 7, 14), 0);
    assert_int_equal(fvt_post(a.qp, IBV_WR_RDMA_WRITE, 1, NULL, 0, 0, 0, 0, 0, 1), 0);
    expect(a.scq, 1, IBV_WC_RETRY_EXC_ERR);
    fvt_close(&a);
    fvt_close(&b);
    fvt_assert_no_leaks();
}

void test_peer_not_ready(void **state)
{
    (void)state;
    struct fvt_ep a, b;
    assert_int_equal(fvt_open(&a, 8, 4, 0), 0);
    assert_int_equal(fvt_open(&b, 8, 4, 0), 0);
    struct fvt_info ia, ib;
    fvt_info(&a, &ia);
    fvt_info(&b, &ib);
    assert_int_equal(fvt_connect(&a, &ib, 7, 18), 0); /* 1.07 s x 3 of retries */
    /* b is still in INIT: the request waits (retries) until b reaches RTR */
    assert_int_equal(fvt_post(a.qp, IBV_WR_RDMA_WRITE, 1, NULL, 0, 0, 0, 0, 0, 1), 0);
    expect_none(a.scq, 30);
    assert_int_equal(fvt_connect(&b, &ia, 7, 14), 0);
    expect(a.scq, 1, IBV_WC_SUCCESS);
    fvt_close(&a);
    fvt_close(&b);
    /* not ready, then ready without a receive: the RNR wait (for ever) replaces the
   * retry wait (timeout 16: 0.27 s x 3), which must not fail the send */
    assert_int_equal(fvt_open(&a, 8, 4, 0), 0);
    assert_int_equal(fvt_open(&b, 8, 4, 0), 0);
    fvt_info(&a, &ia);
    fvt_info(&b, &ib);
    assert_int_equal(fvt_connect(&a, &ib, 7, 16), 0);
    assert_int_equal(fvt_post(a.qp, IBV_WR_SEND, 1, NULL, 0, 0, 0, 0, 0, 1), 0);
    expect_none(a.scq, 10);
    assert_int_equal(fvt_connect(&b, &ia, 7, 16), 0);
    expect_none(a.scq, 900);
    assert_int_equal(fvt_post_recv(b.qp, 5, NULL, 0, 0), 0);
    expect(a.scq, 1, IBV_WC_SUCCESS);
    expect(b.rcq, 5, IBV_WC_SUCCESS);
    /* b's QP destroyed: a's retries run out (timeout 4: 65 us x 3 tries) */
    fvt_close(&b);
    struct ibv_qp_attr at = {.timeout = 4};
    assert_int_equal(ibv_modify_qp(a.qp, &at, IBV_QP_TIMEOUT),
                     EINVAL); /* RTS->RTS cannot change it */
    fvt_close(&a);
    assert_int_equal(fvt_open(&a, 8, 4, 0), 0);
    assert_int_equal(fvt_open(&b, 8, 4, 0), 0);
    fvt_info(&b, &ib);
    assert_int_equal(fvt_connect(&a, &ib, 7, 4), 0);
    ibv_destroy_qp(b.qp);
    b.qp = NULL;
    assert_int_equal(fvt_post(a.qp, IBV_WR_RDMA_WRITE, 1, NULL, 0, 0, 0, 0, 0, 1), 0);
    expect(a.scq, 1, IBV_WC_RETRY_EXC_ERR);
    fvt_close(&a);
    fvt_close(&b);
    fvt_assert_no_leaks();
}

void test_post_send_fault(void **state)
{
    (void)state;
    setenv("EPIPE_FAKEVERBS_FAIL", "post_send:2", 1);
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 1, 0, 8, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 1, IBV_WC_SUCCESS);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 2, 0, 8, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 2, IBV_WC_RETRY_EXC_ERR);
    assert_int_equal(f.a.qp->state, IBV_QPS_ERR);
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 3, 0, 8, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 3, IBV_WC_WR_FLUSH_ERR);
    teardown(&f);
}

static int count_fds(void)
{
    int n = 0;
    for (int fd = 0; fd < 4096; fd++)
        n += fcntl(fd, F_GETFD) != -1;
    return n;
}

/* Connect, transfer or fail, tear down: nothing is left behind (objects, sockets). */
void test_cycles(void **state)
{
    (void)state;
    int fds = count_fds();
    for (int i = 0; i < 300; i++) {
        struct fixture f;
        setup(&f, 64, i % 3 == 0, 7, 14);
        assert_int_equal(fvt_post_recv(f.b.qp, 1, NULL, 0, 0), 0);
        uint32_t rkey = i % 2 ? f.dmr->rkey : f.dmr->rkey ^ 0x100;
        assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE_WITH_IMM, 1, 0, 64, rkey, 0), 0);
        expect(f.a.scq, 1, i % 2 ? IBV_WC_SUCCESS : IBV_WC_REM_ACCESS_ERR);
        teardown(&f);
    }
    assert_int_equal(count_fds(), fds);
}

/* A receive whose buffer lies outside its region, and a QP talking to a QP that
 * is connected to another one. */
void test_recv_prot_and_stranger(void **state)
{
    (void)state;
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    assert_int_equal(fvt_post_recv(f.b.qp, 2, f.dst + 4090, 64, f.dmr->lkey), 0);
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_SEND, 1, f.src, 16, f.smr->lkey, 0, 0, 0, 1), 0);
    expect(f.a.scq, 1, IBV_WC_REM_OP_ERR);
    expect(f.b.rcq, 2, IBV_WC_LOC_PROT_ERR);
    teardown(&f);
    struct fvt_ep a, b, c;
    assert_int_equal(fvt_open(&a, 8, 4, 0), 0);
    assert_int_equal(fvt_open(&b, 8, 4, 0), 0);
    assert_int_equal(fvt_open(&c, 8, 4, 0), 0);
    struct fvt_info ib, ic;
    fvt_info(&b, &ib);
    fvt_info(&c, &ic);
    assert_int_equal(fvt_connect(&a, &ib, 7, 4), 0); /* a -> b, but b -> c */
    assert_int_equal(fvt_connect(&b, &ic, 7, 4), 0);
    assert_int_equal(fvt_post(a.qp, IBV_WR_RDMA_WRITE, 1, NULL, 0, 0, 0, 0, 0, 1), 0);
    expect(a.scq, 1, IBV_WC_RETRY_EXC_ERR);
    fvt_close(&a);
    fvt_close(&b);
    fvt_close(&c);
    fvt_assert_no_leaks();
}

/* EPIPE_FAKEVERBS_STRICT=1: a send buffer changed before its completion fails the send. */
void test_strict_send_buffer(void **state)
{
    (void)state;
    setenv("EPIPE_FAKEVERBS_STRICT", "1", 1);
    struct fixture f;
    setup(&f, 64, 0, 7, 14);
    unsetenv("EPIPE_FAKEVERBS_STRICT");
    /* untouched: fine */
    assert_int_equal(write_to(&f, IBV_WR_RDMA_WRITE, 1, 0, 64, f.dmr->rkey, 0), 0);
    expect(f.a.scq, 1, IBV_WC_SUCCESS);
    /* no receive posted yet, so the send waits (RNR) while its buffer changes */
    assert_int_equal(fvt_post(f.a.qp, IBV_WR_SEND, 2, f.src, 64, f.smr->lkey, 0, 0, 0, 1), 0);
    expect_none(f.a.scq, 10);
    f.src[3] ^= 1;
    assert_int_equal(fvt_post_recv(f.b.qp, 3, f.dst, 64, f.dmr->lkey), 0);
    expect(f.a.scq, 2, IBV_WC_LOC_PROT_ERR);
    assert_int_equal(f.a.qp->state, IBV_QPS_ERR);
    teardown(&f);
}
