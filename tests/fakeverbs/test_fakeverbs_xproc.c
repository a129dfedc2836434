/* Tests of the test verbs provider across threads and processes: concurrent
 * posting and polling, transfers between forked processes, a peer killed mid-transfer. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "test_fakeverbs.h"

#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define RW (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
#define NMSG 20000

struct thr {
    struct fvt_ep *a, *b;
    uint64_t raddr;
    uint32_t rkey, lkey;
    char *src;
    volatile int inflight;
    int errors;
};

static void *poster(void *arg)
{
    struct thr *t = arg;
    for (int i = 0; i < NMSG; i++) {
        while (__atomic_load_n(&t->inflight, __ATOMIC_ACQUIRE) >= 12)
            sched_yield();
        __atomic_add_fetch(&t->inflight, 1, __ATOMIC_ACQ_REL);
        if (fvt_post(t->a->qp, IBV_WR_RDMA_WRITE_WITH_IMM, (uint64_t)i, t->src, 8, t->lkey,
                     t->raddr + (uint64_t)(i % 64) * 8, t->rkey, htonl((uint32_t)i), 1) != 0)
            t->errors++;
    }
    return NULL;
}

static void *receiver(void *arg)
{
    struct thr *t = arg;
    for (int i = 0; i < 16; i++)
        fvt_post_recv(t->b->qp, (uint64_t)i, NULL, 0, 0);
    for (int got = 0; got < NMSG;) {
        struct ibv_wc wc;
        int r = fvt_wait(t->b->rcq, &wc, 10000);
        if (r != 1 || wc.status != IBV_WC_SUCCESS || ntohl(wc.imm_data) != (uint32_t)got) {
            t->errors++;
            return NULL;
        }
        got++;
        fvt_post_recv(t->b->qp, wc.wr_id, NULL, 0, 0);
    }
    return NULL;
}

void test_threads(void **state)
{
    (void)state;
    struct fvt_ep a, b;
    fvt_pair(&a, &b, 64, 0, 7, 14);
    char src[8] = "1234567", dst[512];
    struct ibv_mr *smr = (ibv_reg_mr)(a.pd, src, sizeof src, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *dmr = (ibv_reg_mr)(b.pd, dst, sizeof dst, RW);
    struct thr t = {&a, &b, (uintptr_t)dst, dmr->rkey, smr->lkey, src, 0, 0};
    pthread_t tp, tr;
    pthread_create(&tr, NULL, receiver, &t);
    pthread_create(&tp, NULL, poster, &t);
    for (int done = 0; done < NMSG && !t.errors; done++) {
        struct ibv_wc wc;
        assert_int_equal(fvt_wait(a.scq, &wc, 10000), 1);
        assert_int_equal(wc.status, IBV_WC_SUCCESS);
        assert_int_equal(wc.wr_id, (uint64_t)done); /* in order */
        __atomic_sub_fetch(&t.inflight, 1, __ATOMIC_ACQ_REL);
    }
    pthread_join(tp, NULL);
    pthread_join(tr, NULL);
    assert_int_equal(t.errors, 0);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
    fvt_close(&a);
    fvt_close(&b);
    fvt_assert_no_leaks();
}

/* The child's side: an endpoint whose MR of `size` bytes the parent writes into. */
struct peer_msg {
    struct fvt_info info;
    uint64_t addr;
    uint32_t rkey, pad;
};

enum child_mode { CHILD_ECHO, CHILD_HANG, CHILD_NORECV };

static int child_main(int fd, size_t size, enum child_mode mode)
{
    struct fvt_ep e;
    if (fvt_open(&e, 64, 16, mode == CHILD_ECHO)) /* the echo child sleeps on a channel */
        return 2;
    unsigned char *buf = calloc(1, size);
    struct ibv_mr *mr = (ibv_reg_mr)(e.pd, buf, size, RW);
    if (mode != CHILD_NORECV)
        fvt_post_recv(e.qp, 1, NULL, 0, 0);
    struct peer_msg me = {.addr = (uintptr_t)buf, .rkey = mr->rkey}, peer;
    fvt_info(&e, &me.info);
    if (fvt_xfer(fd, &me, sizeof me, 1) || fvt_xfer(fd, &peer, sizeof peer, 0) ||
        fvt_connect(&e, &peer.info, 7, 14))
        return 3;
    if (mode == CHILD_ECHO && ibv_req_notify_cq(e.rcq, 0)) /* armed before the parent writes */
        return 8;
    char go = 1;
    fvt_xfer(fd, &go, 1, 1);
    if (mode != CHILD_ECHO) {
        for (;;)
            pause();
    }
    struct ibv_wc wc;
    struct pollfd pfd = {.fd = e.ch->fd, .events = POLLIN};
    struct ibv_cq *ecq;
    void *ectx;
    if (poll(&pfd, 1, 20000) != 1 || ibv_get_cq_event(e.ch, &ecq, &ectx) || ecq != e.rcq)
        return 8;
    ibv_ack_cq_events(e.rcq, 1);
    if (fvt_wait(e.rcq, &wc, 20000) != 1 || wc.status != IBV_WC_SUCCESS ||
        wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || wc.byte_len != size || ntohl(wc.imm_data) != 42)
        return 4;
    for (size_t i = 0; i < size; i++)
        if (buf[i] != (unsigned char)(i * 13 + 5))
            return 5;
    /* answer with a SEND of the first 32 bytes into the parent's posted receive */
    if (fvt_post(e.qp, IBV_WR_SEND, 9, buf, 32, mr->lkey, 0, 0, 0, 1) ||
        fvt_wait(e.scq, &wc, 20000) != 1 || wc.status != IBV_WC_SUCCESS)
        return 6;
    fvt_xfer(fd, &go, 1, 0); /* the parent has its completion */
    ibv_dereg_mr(mr);
    free(buf);
    fvt_close(&e);
    return fakeverbs_live("mr") == 0 && fakeverbs_live("qp") == 0 ? 0 : 7;
}

struct xparent {
    pid_t pid;
    int fd;
    struct fvt_ep e;
    struct peer_msg peer;
};

static void spawn(struct xparent *x, size_t size, enum child_mode mode, int rnr_retry)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    x->pid = fork();
    assert_true(x->pid >= 0);
    if (x->pid == 0) {
        close(sv[0]);
        _exit(child_main(sv[1], size, mode));
    }
    close(sv[1]);
    x->fd = sv[0];
    assert_int_equal(fvt_open(&x->e, 64, 16, 0), 0);
    struct peer_msg me = {0};
    fvt_info(&x->e, &me.info);
    assert_int_equal(fvt_xfer(x->fd, &x->peer, sizeof x->peer, 0), 0);
    assert_int_equal(fvt_xfer(x->fd, &me, sizeof me, 1), 0);
    assert_int_equal(fvt_connect(&x->e, &x->peer.info, rnr_retry, 14), 0);
    char go;
    assert_int_equal(fvt_xfer(x->fd, &go, 1, 0), 0);
}

static int reap(struct xparent *x)
{
    int st = 0;
    close(x->fd);
    waitpid(x->pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

void test_xproc_transfer(void **state)
{
    (void)state;
    const size_t size = 3u << 20; /* larger than the NIC's buffers: arrives in pieces */
    struct xparent x;
    spawn(&x, size, CHILD_ECHO, 7);
    unsigned char *src = malloc(size), back[32] = {0};
    for (size_t i = 0; i < size; i++)
        src[i] = (unsigned char)(i * 13 + 5);
    struct ibv_mr *smr = (ibv_reg_mr)(x.e.pd, src, size, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *bmr = (ibv_reg_mr)(x.e.pd, back, sizeof back, IBV_ACCESS_LOCAL_WRITE);
    assert_int_equal(fvt_post_recv(x.e.qp, 77, back, sizeof back, bmr->lkey), 0);
    assert_int_equal(fvt_post(x.e.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 1, src, (uint32_t)size, smr->lkey,
                              x.peer.addr, x.peer.rkey, htonl(42), 1),
                     0);
    struct ibv_wc wc;
    assert_int_equal(fvt_wait(x.e.scq, &wc, 20000), 1);
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_int_equal(fvt_wait(x.e.rcq, &wc, 20000), 1);
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_int_equal(wc.wr_id, 77);
    assert_int_equal(wc.byte_len, 32);
    assert_memory_equal(back, src, 32);
    char go = 1;
    assert_int_equal(fvt_xfer(x.fd, &go, 1, 1), 0);
    assert_int_equal(reap(&x), 0);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(bmr);
    free(src);
    fvt_close(&x.e);
    fvt_assert_no_leaks();
}

void test_xproc_peer_killed(void **state)
{
    (void)state;
    const size_t size = 8u << 20;
    struct xparent x;
    spawn(&x, size, CHILD_HANG, 7);
    unsigned char *src = calloc(1, size);
    struct ibv_mr *smr = (ibv_reg_mr)(x.e.pd, src, size, IBV_ACCESS_LOCAL_WRITE);
    assert_int_equal(fvt_post_recv(x.e.qp, 50, NULL, 0, 0), 0);
    /* with immediates: the child posted one receive, so the later ones cannot finish */
    for (int i = 0; i < 4; i++)
        assert_int_equal(fvt_post(x.e.qp, IBV_WR_RDMA_WRITE_WITH_IMM, (uint64_t)i, src,
                                  (uint32_t)size, smr->lkey, x.peer.addr, x.peer.rkey, 0, 1),
                         0);
    kill(x.pid, SIGKILL); /* while the writes are in flight */
    assert_int_equal(reap(&x), 128 + SIGKILL);
    /* some writes may have landed first; then one retry-exceeded, then flushes */
    int i = 0;
    struct ibv_wc wc;
    for (; i < 4; i++) {
        assert_int_equal(fvt_wait(x.e.scq, &wc, 10000), 1);
        assert_int_equal(wc.wr_id, (uint64_t)i);
        if (wc.status != IBV_WC_SUCCESS)
            break;
    }
    assert_true(i < 4);
    assert_int_equal(wc.status, IBV_WC_RETRY_EXC_ERR);
    for (i++; i < 4; i++) {
        assert_int_equal(fvt_wait(x.e.scq, &wc, 10000), 1);
        assert_int_equal(wc.status, IBV_WC_WR_FLUSH_ERR);
    }
    assert_int_equal(fvt_wait(x.e.rcq, &wc, 10000), 1);
    assert_int_equal(wc.wr_id, 50);
    assert_int_equal(wc.status, IBV_WC_WR_FLUSH_ERR);
    assert_int_equal(x.e.qp->state, IBV_QPS_ERR);
    ibv_dereg_mr(smr);
    free(src);
    fvt_close(&x.e);
    fvt_assert_no_leaks();
}

/* Bad rkey, out-of-bounds and RNR against another process. */
void test_xproc_errors(void **state)
{
    (void)state;
    char src[64] = {0};
    for (int round = 0; round < 3; round++) {
        struct xparent x;
        spawn(&x, 4096, round == 2 ? CHILD_NORECV : CHILD_HANG, round == 2 ? 2 : 7);
        struct ibv_mr *smr = (ibv_reg_mr)(x.e.pd, src, sizeof src, IBV_ACCESS_LOCAL_WRITE);
        struct ibv_wc wc;
        if (round == 0) {
            assert_int_equal(fvt_post(x.e.qp, IBV_WR_RDMA_WRITE, 1, src, 8, smr->lkey, x.peer.addr,
                                      x.peer.rkey + 1, 0, 1),
                             0);
            assert_int_equal(fvt_wait(x.e.scq, &wc, 10000), 1);
            assert_int_equal(wc.status, IBV_WC_REM_ACCESS_ERR);
        } else if (round == 1) {
            assert_int_equal(fvt_post(x.e.qp, IBV_WR_RDMA_WRITE, 1, src, 64, smr->lkey,
                                      x.peer.addr + 4096 - 32, x.peer.rkey, 0, 1),
                             0);
            assert_int_equal(fvt_wait(x.e.scq, &wc, 10000), 1);
            assert_int_equal(wc.status, IBV_WC_REM_ACCESS_ERR);
        } else { /* no receive posted in the child, two RNR retries */
            assert_int_equal(fvt_post(x.e.qp, IBV_WR_SEND, 1, src, 8, smr->lkey, 0, 0, 0, 1), 0);
            assert_int_equal(fvt_wait(x.e.scq, &wc, 10000), 1);
            assert_int_equal(wc.status, IBV_WC_RNR_RETRY_EXC_ERR);
        }
        kill(x.pid, SIGKILL);
        reap(&x);
        ibv_dereg_mr(smr);
        fvt_close(&x.e);
        fvt_assert_no_leaks();
    }
}
