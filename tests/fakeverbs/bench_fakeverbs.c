/* fakeverbs benchmark: small RDMA WRITE_WITH_IMM messages per second between two
 * processes over the test provider (prints one line; asserts nothing). */
#define _GNU_SOURCE
#include "fv_testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WINDOW 256
#define RECVS 1024

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int receiver(int fd, long count, uint32_t size)
{
    struct fvt_ep e;
    if (fvt_open(&e, 4096, RECVS, 0))
        return 1;
    char *buf = calloc(1, size * (size_t)WINDOW);
    struct ibv_mr *mr = (ibv_reg_mr)(e.pd, buf, size * (size_t)WINDOW,
                                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    for (int i = 0; i < RECVS; i++)
        fvt_post_recv(e.qp, (uint64_t)i, NULL, 0, 0);
    struct fvt_info me, peer;
    fvt_info(&e, &me);
    uint64_t addr = (uintptr_t)buf;
    uint32_t rkey = mr->rkey;
    if (fvt_xfer(fd, &me, sizeof me, 1) || fvt_xfer(fd, &addr, sizeof addr, 1) ||
        fvt_xfer(fd, &rkey, sizeof rkey, 1) || fvt_xfer(fd, &peer, sizeof peer, 0) ||
        fvt_connect(&e, &peer, 7, 20))
        return 1;
    long got = 0;
    struct ibv_wc wc[64];
    while (got < count) {
        int n = ibv_poll_cq(e.rcq, 64, wc);
        if (n < 0)
            return 1;
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS)
                return 1;
            fvt_post_recv(e.qp, wc[i].wr_id, NULL, 0, 0);
        }
        got += n;
    }
    char done = 1;
    fvt_xfer(fd, &done, 1, 1);
    fvt_xfer(fd, &done, 1, 0);
    ibv_dereg_mr(mr);
    free(buf);
    fvt_close(&e);
    return 0;
}

int main(int argc, char **argv)
{
    long count = argc > 1 ? atol(argv[1]) : 200000;
    uint32_t size = argc > 2 ? (uint32_t)atol(argv[2]) : 64;
    int batch = argc > 3 ? atoi(argv[3]) : 16; /* work requests per ibv_post_send */
    if (batch < 1 || batch > 16)
        batch = 16;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        _exit(receiver(sv[1], count, size));
    }
    close(sv[1]);
    struct fvt_ep e;
    if (fvt_open(&e, 4096, 2 * WINDOW, 0))
        return 1;
    char *buf = calloc(1, size);
    struct ibv_mr *mr = (ibv_reg_mr)(e.pd, buf, size, IBV_ACCESS_LOCAL_WRITE);
    struct fvt_info me, peer;
    uint64_t raddr;
    uint32_t rkey;
    fvt_info(&e, &me);
    if (fvt_xfer(sv[0], &peer, sizeof peer, 0) || fvt_xfer(sv[0], &raddr, sizeof raddr, 0) ||
        fvt_xfer(sv[0], &rkey, sizeof rkey, 0) || fvt_xfer(sv[0], &me, sizeof me, 1) ||
        fvt_connect(&e, &peer, 7, 20))
        return 1;
    double t0 = now_s();
    long posted = 0, done = 0;
    long inflight_signaled = 0;
    struct ibv_wc wc[64];
    while (done < count) {
        while (posted < count && inflight_signaled < WINDOW / batch) {
            /* a batch of chained writes, the last signaled */
            struct ibv_sge sge[16];
            struct ibv_send_wr wr[16], *bad;
            int k = 0;
            for (; k < batch && posted < count; k++, posted++) {
                sge[k] = (struct ibv_sge){(uintptr_t)buf, size, mr->lkey};
                memset(&wr[k], 0, sizeof wr[k]);
                wr[k].wr_id = (uint64_t)posted;
                wr[k].sg_list = &sge[k];
                wr[k].num_sge = 1;
                wr[k].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                wr[k].imm_data = (uint32_t)posted;
                wr[k].wr.rdma.remote_addr = raddr + (uint64_t)(posted % WINDOW) * size;
                wr[k].wr.rdma.rkey = rkey;
                wr[k].next = &wr[k + 1];
            }
            wr[k - 1].next = NULL;
            wr[k - 1].send_flags = IBV_SEND_SIGNALED;
            wr[k - 1].wr_id = (uint64_t)k;
            if (ibv_post_send(e.qp, wr, &bad)) {
                fprintf(stderr, "post_send failed\n");
                return 1;
            }
            inflight_signaled++;
        }
        int n = ibv_poll_cq(e.scq, 64, wc);
        if (n < 0)
            return 1;
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                fprintf(stderr, "completion error: %s\n", ibv_wc_status_str(wc[i].status));
                return 1;
            }
            done += (long)wc[i].wr_id;
            inflight_signaled--;
        }
    }
    char d;
    fvt_xfer(sv[0], &d, 1, 0);
    double t = now_s() - t0;
    printf("{\"messages\": %ld, \"size\": %u, \"batch\": %d, \"seconds\": %.3f, "
           "\"messages_per_s\": %.0f}\n",
           count, size, batch, t, count / t);
    fvt_xfer(sv[0], &d, 1, 1);
    int st;
    waitpid(pid, &st, 0);
    ibv_dereg_mr(mr);
    free(buf);
    fvt_close(&e);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
