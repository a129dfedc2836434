/* fork() while another thread frees pinned message buffers must not hang.
 * A communicator's fork handler takes its buffer cache's lock, and the CUDA
 * loader's takes its own; a thread that freed a pinned buffer under the
 * cache's lock asked the loader for the module under it, the two handlers
 * took the locks in the other order, and a fork could deadlock (about one
 * in a few hundred did). Buffers are now freed outside the cache's lock,
 * and the loader answers without a lock; either alone prevents it, so
 * this test fails only when both are undone. Through the test CUDA module
 * (fakecuda.c), whose pinned memory is malloc's. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <epipe/epipe.h>

#include "codec/cuda_core.h"
#include "comm/comm_impl.h"

/* FORKS forks, or as many as SECONDS allow (valgrind makes each slow); a
 * fork that has not come back in HUNG seconds hangs */
enum { FORKS = 1000, SECONDS = 20, HUNG = 30, BUFS = 32 };

static epipe_comm *c[2];
static int stop;

/* Fills the cache with pinned buffers, then frees them all by lowering the
 * cap, over and over. */
static void *churn(void *arg)
{
    (void)arg;
    while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
        epipe_msg *m[BUFS];
        for (int i = 0; i < BUFS; i++)
            m[i] = epipe_comm_msg_new(c[0], 300 << 10);
        for (int i = 0; i < BUFS; i++)
            epipe_msg_free(m[i]);
        epipe_comm_set_param(c[0], EPIPE_COMM_BUFFER_CACHE, 0);
        epipe_comm_set_param(c[0], EPIPE_COMM_BUFFER_CACHE, 512 << 20);
        /* under valgrind, which runs one thread at a time, fork() could
         * otherwise starve on the cache's lock for longer than HUNG */
        sched_yield();
    }
    return NULL;
}

static void hung(int sig)
{
    (void)sig;
    static const char msg[] = "FAIL: a fork hung while pinned buffers were freed\n";
    if (write(2, msg, sizeof msg - 1) < 0)
        _exit(1);
    _exit(1);
}

int main(void)
{
    static const epipe_msgbuf_allocator pinned = {epipe_cuda_pinned_alloc,
                                                  epipe_codec_cuda_host_free};
    /* the communicator first, then the module: their fork handlers run in
     * the order that deadlocked */
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        fprintf(stderr, "inproc: %s\n", epipe_last_error());
        return 1;
    }
    char why[512];
    if (epipe_cuda_device_ok(0, why, sizeof why) != EPIPE_OK) {
        fprintf(stderr, "EPIPE_CUDA_MODULE must name the test module (fakecuda): %s\n", why);
        return 1;
    }
    epipe_comm_pin_buffers(c[0], &pinned, 0);
    signal(SIGALRM, hung);
    pthread_t t;
    if (pthread_create(&t, NULL, churn, NULL) != 0)
        return fprintf(stderr, "no thread\n"), 1;
    int forks = 0, failed = 0;
    time_t start = time(NULL);
    for (; forks < FORKS && time(NULL) - start < SECONDS; forks++) {
        alarm(HUNG);
        pid_t p = fork();
        if (p == 0) { /* exec, as a real child would: no leak report from it */
            execlp("true", "true", (char *)NULL);
            _exit(0);
        }
        if (p < 0 || waitpid(p, NULL, 0) != p) {
            failed = 1;
            break;
        }
    }
    __atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
    pthread_join(t, NULL);
    alarm(0);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    if (failed || forks < 50)
        return fprintf(stderr, "fork %d failed, or too few forks in %d s\n", forks, SECONDS), 1;
    printf("%d forks while pinned buffers were freed: ok\n", forks);
    return 0;
}
