/* Tests of the test verbs provider: the helpers and test cases its three test
 * files share (one cmocka program). */
#ifndef EPIPE_TEST_FAKEVERBS_H
#define EPIPE_TEST_FAKEVERBS_H

#include "fv_testutil.h"

/* Two connected endpoints in this process (a's QP talks to b's); b may get a
 * completion channel. */
void fvt_pair(struct fvt_ep *a, struct fvt_ep *b, int cqe, int chan_b, int rnr_retry, int timeout);
void fvt_assert_no_leaks(void);

void test_write_imm(void **state);
void test_send_recv(void **state);
void test_unsignaled_slots(void **state);
void test_bad_rkey_flush(void **state);
void test_out_of_bounds(void **state);
void test_bad_lkey(void **state);
void test_rnr(void **state);
void test_send_too_long(void **state);
void test_cq_overflow(void **state);
void test_channel(void **state);
void test_psn_mismatch(void **state);
void test_peer_not_ready(void **state);
void test_post_send_fault(void **state);
void test_cycles(void **state);
void test_recv_prot_and_stranger(void **state);
void test_strict_send_buffer(void **state);
void test_threads(void **state);
void test_xproc_transfer(void **state);
void test_xproc_peer_killed(void **state);
void test_xproc_errors(void **state);

#endif
