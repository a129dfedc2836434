/* Tests of the test verbs provider (libfakeverbs.so) in one process: devices, MRs,
 * the QP state machine, data transfer and every error the provider enforces. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "fv_testutil.h"
#include "test_fakeverbs.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct ibv_mr *reg(struct ibv_pd *pd, void *p, size_t n, int access)
{
    return (ibv_reg_mr)(pd, p, n, access);
}

void fvt_pair(struct fvt_ep *a, struct fvt_ep *b, int cqe, int chan_b, int rnr_retry, int timeout)
{
    assert_int_equal(fvt_open(a, cqe, 16, 0), 0);
    assert_int_equal(fvt_open(b, cqe, 16, chan_b), 0);
    struct fvt_info ia, ib;
    fvt_info(a, &ia);
    fvt_info(b, &ib);
    assert_int_equal(fvt_connect(a, &ib, rnr_retry, timeout), 0);
    assert_int_equal(fvt_connect(b, &ia, rnr_retry, timeout), 0);
}

void fvt_assert_no_leaks(void)
{
    static const char *const kinds[] = {"mr", "qp", "cq", "pd", "ctx", "channel"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        if (fakeverbs_live(kinds[i]) != 0)
            fail_msg("%d live %s objects", fakeverbs_live(kinds[i]), kinds[i]);
    }
}

static void test_device(void **state)
{
    (void)state;
    int n = -1;
    struct ibv_device **list = ibv_get_device_list(&n);
    assert_non_null(list);
    assert_int_equal(n, 1);
    assert_string_equal(ibv_get_device_name(list[0]), "fakeverbs0");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    assert_non_null(ctx);
    struct ibv_port_attr pa;
    assert_int_equal(ibv_query_port(ctx, 1, &pa), 0);
    assert_int_equal(pa.state, IBV_PORT_ACTIVE);
    assert_int_equal(pa.active_mtu, IBV_MTU_4096);
    assert_int_equal(pa.link_layer, IBV_LINK_LAYER_ETHERNET);
    assert_true(pa.max_msg_sz >= (1u << 30));
    assert_int_not_equal(ibv_query_port(ctx, 2, &pa), 0);
    struct ibv_device_attr da;
    assert_int_equal(ibv_query_device(ctx, &da), 0);
    assert_int_equal(da.phys_port_cnt, 1);
    union ibv_gid g;
    assert_int_equal(ibv_query_gid(ctx, 1, 0, &g), 0);
    assert_int_not_equal(ibv_query_gid(ctx, 1, 1, &g), 0);
    assert_int_equal(fakeverbs_live("ctx"), 1);
    assert_int_equal(fakeverbs_live("bogus"), -1);
    setenv("EPIPE_FAKEVERBS_PORT", "down", 1);
    assert_int_equal(ibv_query_port(ctx, 1, &pa), 0);
    assert_int_equal(pa.state, IBV_PORT_DOWN);
    unsetenv("EPIPE_FAKEVERBS_PORT");
    assert_int_equal(ibv_close_device(ctx), 0);
    setenv("EPIPE_FAKEVERBS_DEVICES", "0", 1);
    list = ibv_get_device_list(&n);
    assert_non_null(list);
    assert_int_equal(n, 0);
    assert_null(list[0]);
    ibv_free_device_list(list);
    unsetenv("EPIPE_FAKEVERBS_DEVICES");
    fvt_assert_no_leaks();
}

static void test_mr(void **state)
{
    (void)state;
    struct fvt_ep e;
    assert_int_equal(fvt_open(&e, 8, 4, 0), 0);
    char buf[256];
    /* remote write without local write is refused, as by the kernel */
    assert_null(reg(e.pd, buf, sizeof buf, IBV_ACCESS_REMOTE_WRITE));
    struct ibv_mr *mr = reg(e.pd, buf, sizeof buf,
                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    assert_non_null(mr);
    assert_int_not_equal(mr->lkey, mr->rkey);
    assert_ptr_equal(mr->addr, buf);
    assert_int_equal(mr->length, sizeof buf);
    assert_int_equal(fakeverbs_live("mr"), 1);
    assert_int_equal(ibv_dealloc_pd(e.pd), EBUSY);  /* still has an MR and a QP */
    assert_int_equal(ibv_destroy_cq(e.scq), EBUSY); /* the QP uses it */
    assert_int_equal(ibv_dereg_mr(mr), 0);
    /* a re-registration of the same slot gets new keys */
    struct ibv_mr *mr2 = reg(e.pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
    assert_non_null(mr2);
    assert_int_equal(ibv_dereg_mr(mr2), 0);
    setenv("EPIPE_FAKEVERBS_FAIL", "reg_mr:2", 1);
    fvt_close(&e);
    assert_int_equal(fvt_open(&e, 8, 4, 0), 0); /* the knob is read when the NIC starts */
    struct ibv_mr *m1 = reg(e.pd, buf, 16, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *m2 = reg(e.pd, buf, 16, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *m3 = reg(e.pd, buf, 16, IBV_ACCESS_LOCAL_WRITE);
    assert_non_null(m1);
    assert_null(m2);
    assert_non_null(m3);
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    ibv_dereg_mr(m1);
    ibv_dereg_mr(m3);
    fvt_close(&e);
    fvt_assert_no_leaks();
}

static void test_state_machine(void **state)
{
    (void)state;
    struct fvt_ep a, b;
    assert_int_equal(fvt_open(&a, 8, 4, 0), 0); /* a is in INIT */
    assert_int_equal(fvt_open(&b, 8, 4, 0), 0);
    struct fvt_info ib;
    fvt_info(&b, &ib);
    struct ibv_qp_attr at;
    memset(&at, 0, sizeof at);
    /* INIT -> RTS skips RTR */
    at.qp_state = IBV_QPS_RTS;
    assert_int_equal(ibv_modify_qp(a.qp, &at,
                                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                       IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
                     EINVAL);
    /* INIT -> RTR without IBV_QP_MIN_RNR_TIMER */
    at.qp_state = IBV_QPS_RTR;
    at.path_mtu = IBV_MTU_1024;
    at.dest_qp_num = ib.qpn;
    at.ah_attr.is_global = 1;
    at.ah_attr.grh.dgid = ib.gid;
    at.ah_attr.port_num = 1;
    int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    assert_int_equal(ibv_modify_qp(a.qp, &at, rtr & ~IBV_QP_MIN_RNR_TIMER), EINVAL);
    /* an attribute the transition does not take */
    assert_int_equal(ibv_modify_qp(a.qp, &at, rtr | IBV_QP_SQ_PSN), EINVAL);
    /* RoCE needs the GRH */
    at.ah_attr.is_global = 0;
    assert_int_equal(ibv_modify_qp(a.qp, &at, rtr), EINVAL);
    at.ah_attr.is_global = 1;
    /* posting a send before RTS, a receive in RESET */
    char buf[8];
    assert_int_equal(fvt_post(a.qp, IBV_WR_SEND, 1, buf, 0, 0, 0, 0, 0, 1), EINVAL);
    assert_int_equal(ibv_modify_qp(a.qp, &at, rtr), 0);
    assert_int_equal(a.qp->state, IBV_QPS_RTR);
    assert_int_equal(fvt_post(a.qp, IBV_WR_SEND, 1, buf, 0, 0, 0, 0, 0, 1), EINVAL);
    /* RTR -> RTS without IBV_QP_RNR_RETRY */
    memset(&at, 0, sizeof at);
    at.qp_state = IBV_QPS_RTS;
    assert_int_equal(ibv_modify_qp(a.qp, &at,
                                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                       IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
                     EINVAL);
    /* any -> RESET, then receives are refused; any -> ERR */
    at.qp_state = IBV_QPS_RESET;
    assert_int_equal(ibv_modify_qp(a.qp, &at, IBV_QP_STATE), 0);
    assert_int_equal(fvt_post_recv(a.qp, 1, NULL, 0, 0), EINVAL);
    at.qp_state = IBV_QPS_ERR;
    assert_int_equal(ibv_modify_qp(a.qp, &at, IBV_QP_STATE | IBV_QP_TIMEOUT), EINVAL);
    assert_int_equal(ibv_modify_qp(a.qp, &at, IBV_QP_STATE), 0);
    assert_int_equal(a.qp->state, IBV_QPS_ERR);
    /* modify_qp fault injection */
    fvt_close(&a);
    fvt_close(&b);
    setenv("EPIPE_FAKEVERBS_FAIL", "modify_qp:1,create_qp:2", 1);
    assert_int_equal(fvt_open(&a, 8, 4, 0), -1); /* its RESET->INIT fails */
    assert_int_equal(fvt_open(&b, 8, 4, 0), -1); /* create_qp fails */
    assert_null(b.qp);
    unsetenv("EPIPE_FAKEVERBS_FAIL");
    fvt_close(&a);
    fvt_close(&b);
    fvt_assert_no_leaks();
}

/* EPIPE_FAKEVERBS_LOG=1 traces refusals on stderr, naming the reason. */
static void test_log(void **state)
{
    (void)state;
    int p[2];
    assert_int_equal(pipe(p), 0);
    int saved = dup(2);
    dup2(p[1], 2);
    setenv("EPIPE_FAKEVERBS_LOG", "1", 1);
    struct fvt_ep e;
    int rc = fvt_open(&e, 8, 4, 0);
    char buf[16];
    struct ibv_mr *mr = reg(e.pd, buf, sizeof buf, IBV_ACCESS_REMOTE_WRITE);
    fvt_close(&e);
    unsetenv("EPIPE_FAKEVERBS_LOG");
    dup2(saved, 2);
    close(saved);
    close(p[1]);
    char out[8192] = {0};
    size_t n = 0;
    ssize_t r;
    while (n < sizeof out - 1 && (r = read(p[0], out + n, sizeof out - 1 - n)) > 0)
        n += (size_t)r;
    close(p[0]);
    assert_int_equal(rc, 0);
    assert_null(mr);
    assert_non_null(strstr(out, "fakeverbs["));
    assert_non_null(strstr(out, "ibv_reg_mr: invalid argument"));
    fvt_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_device),
        cmocka_unit_test(test_log),
        cmocka_unit_test(test_mr),
        cmocka_unit_test(test_state_machine),
        cmocka_unit_test(test_write_imm),
        cmocka_unit_test(test_send_recv),
        cmocka_unit_test(test_unsignaled_slots),
        cmocka_unit_test(test_bad_rkey_flush),
        cmocka_unit_test(test_out_of_bounds),
        cmocka_unit_test(test_bad_lkey),
        cmocka_unit_test(test_rnr),
        cmocka_unit_test(test_send_too_long),
        cmocka_unit_test(test_cq_overflow),
        cmocka_unit_test(test_channel),
        cmocka_unit_test(test_psn_mismatch),
        cmocka_unit_test(test_peer_not_ready),
        cmocka_unit_test(test_post_send_fault),
        cmocka_unit_test(test_cycles),
        cmocka_unit_test(test_recv_prot_and_stranger),
        cmocka_unit_test(test_strict_send_buffer),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_xproc_transfer),
        cmocka_unit_test(test_xproc_peer_killed),
        cmocka_unit_test(test_xproc_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
