/* fakeverbs: completion queues (a ring with overflow detection) and completion
 * channels (one event per arming, read from a pollable socket, ack counting). */
#define _GNU_SOURCE
#include "fv_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

FV_EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *ctx);
FV_EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *ctx)
{
    if (!ctx) {
        errno = EINVAL;
        return NULL;
    }
    struct fv_channel *c = calloc(1, sizeof *c);
    int sv[2];
    if (!c || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        int e = c ? errno : ENOMEM;
        free(c);
        errno = e;
        return NULL;
    }
    c->ch.context = ctx;
    c->ch.fd = sv[0];
    c->wfd = sv[1];
    pthread_mutex_init(&c->lock, NULL);
    fv_live_add(FV_LIVE_CH, 1);
    return &c->ch;
}

FV_EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *ch);
FV_EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *ch)
{
    if (!ch)
        return EINVAL;
    struct fv_channel *c = FV_CONTAINER(ch, struct fv_channel, ch);
    pthread_mutex_lock(&c->lock);
    int cqs = c->cqs;
    pthread_mutex_unlock(&c->lock);
    if (cqs) {
        fv_log("ibv_destroy_comp_channel: %d CQs still use it: EBUSY", cqs);
        return EBUSY;
    }
    close(c->ch.fd);
    close(c->wfd);
    pthread_mutex_destroy(&c->lock);
    free(c->q);
    free(c);
    fv_live_add(FV_LIVE_CH, -1);
    return 0;
}

FV_EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                                       struct ibv_comp_channel *channel, int comp_vector);
FV_EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                                       struct ibv_comp_channel *channel, int comp_vector)
{
    if (!ctx || cqe < 1 || cqe > FV_MAX_CQE || comp_vector < 0 ||
        comp_vector >= ctx->num_comp_vectors) {
        fv_log("ibv_create_cq: invalid cqe %d or comp_vector %d", cqe, comp_vector);
        errno = EINVAL;
        return NULL;
    }
    struct fv_cq *q = calloc(1, sizeof *q);
    struct ibv_wc *ring = q ? calloc((size_t)cqe, sizeof *ring) : NULL;
    if (!ring) {
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    q->ring = ring;
    q->cap = (uint32_t)cqe;
    q->cq.context = ctx;
    q->cq.channel = channel;
    q->cq.cq_context = cq_context;
    q->cq.cqe = cqe;
    pthread_mutex_init(&q->cq.mutex, NULL);
    pthread_cond_init(&q->cq.cond, NULL);
    pthread_mutex_init(&q->lock, NULL);
    if (channel) {
        struct fv_channel *c = FV_CONTAINER(channel, struct fv_channel, ch);
        pthread_mutex_lock(&c->lock);
        c->cqs++;
        pthread_mutex_unlock(&c->lock);
    }
    fv_live_add(FV_LIVE_CQ, 1);
    return &q->cq;
}

FV_EXPORT int ibv_destroy_cq(struct ibv_cq *cq);
FV_EXPORT int ibv_destroy_cq(struct ibv_cq *cq)
{
    if (!cq)
        return EINVAL;
    struct fv_cq *q = FV_CONTAINER(cq, struct fv_cq, cq);
    pthread_mutex_lock(&fv_nic.lock);
    int qps = q->qps;
    pthread_mutex_unlock(&fv_nic.lock);
    if (qps) {
        fv_log("ibv_destroy_cq: %d QPs still use the CQ: EBUSY", qps);
        return EBUSY;
    }
    pthread_mutex_lock(&q->cq.mutex);
    uint32_t acked = q->cq.comp_events_completed;
    pthread_mutex_unlock(&q->cq.mutex);
    pthread_mutex_lock(&q->lock);
    uint32_t reported = q->events_reported;
    pthread_mutex_unlock(&q->lock);
    if (acked != reported) {
        /* libibverbs would wait forever here; say so instead of hanging. */
        fv_log("ibv_destroy_cq: %u events got, %u acked (ibv_ack_cq_events missing): EBUSY",
               reported, acked);
        return EBUSY;
    }
    if (cq->channel) {
        struct fv_channel *c = FV_CONTAINER(cq->channel, struct fv_channel, ch);
        pthread_mutex_lock(&c->lock);
        size_t w = 0;
        for (size_t i = 0; i < c->qlen; i++) {
            if (c->q[i] == q) {
                char b;
                (void)!recv(c->ch.fd, &b, 1, MSG_DONTWAIT); /* its unread event goes too */
            } else {
                c->q[w++] = c->q[i];
            }
        }
        c->qlen = w;
        c->cqs--;
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_destroy(&q->lock);
    pthread_mutex_destroy(&q->cq.mutex);
    pthread_cond_destroy(&q->cq.cond);
    free(q->ring);
    free(q);
    fv_live_add(FV_LIVE_CQ, -1);
    return 0;
}

/* Called with q->lock held. */
static void fv_cq_event(struct fv_cq *q)
{
    struct fv_channel *c = FV_CONTAINER(q->cq.channel, struct fv_channel, ch);
    q->armed = 0;
    pthread_mutex_lock(&c->lock);
    if (c->qlen == c->qcap) {
        size_t ncap = c->qcap ? c->qcap * 2 : 16;
        struct fv_cq **nq = realloc(c->q, ncap * sizeof *nq);
        if (!nq) {
            pthread_mutex_unlock(&c->lock);
            return;
        }
        c->q = nq;
        c->qcap = ncap;
    }
    c->q[c->qlen++] = q;
    char b = 1;
    (void)!send(c->wfd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    pthread_mutex_unlock(&c->lock);
}

void fv_cq_push(struct fv_cq *q, const struct ibv_wc *wc, int solicited)
{
    pthread_mutex_lock(&q->lock);
    if (q->overflow) {
        pthread_mutex_unlock(&q->lock);
        return;
    }
    if (q->count == q->cap) {
        q->overflow = 1;
        fv_log("CQ overrun (%u entries): the CQ is in error", q->cap);
        if (q->cq.channel && q->armed)
            fv_cq_event(q);
        pthread_mutex_unlock(&q->lock);
        return;
    }
    q->ring[(q->head + q->count) % q->cap] = *wc;
    q->count++;
    if (q->armed && q->cq.channel &&
        (!q->solicited_only || solicited || wc->status != IBV_WC_SUCCESS))
        fv_cq_event(q);
    pthread_mutex_unlock(&q->lock);
}

static int fv_poll_once(struct fv_cq *q, int n, struct ibv_wc *wc, int *armed)
{
    pthread_mutex_lock(&q->lock);
    *armed = q->armed;
    if (q->overflow) {
        pthread_mutex_unlock(&q->lock);
        return -1;
    }
    int got = 0;
    while (got < n && q->count) {
        wc[got++] = q->ring[q->head];
        q->head = (q->head + 1) % q->cap;
        q->count--;
    }
    pthread_mutex_unlock(&q->lock);
    return got;
}

int fv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    struct fv_cq *q = FV_CONTAINER(cq, struct fv_cq, cq);
    if (n < 0 || (n && !wc))
        return -1;
    int armed;
    int got = fv_poll_once(q, n, wc, &armed);
    if (got != 0 || n == 0)
        return got;
    /* the last look before sleeping on the channel does not claim the NIC */
    fv_nic_progress(!armed);
    return fv_poll_once(q, n, wc, &armed);
}

int fv_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    struct fv_cq *q = FV_CONTAINER(cq, struct fv_cq, cq);
    if (!cq->channel)
        return EINVAL;
    pthread_mutex_lock(&q->lock);
    q->armed = 1;
    q->solicited_only = solicited_only;
    pthread_mutex_unlock(&q->lock);
    /* the caller is about to sleep: the NIC thread takes over at once */
    if (__atomic_exchange_n(&fv_nic.poll_until, 0, __ATOMIC_RELAXED) != 0)
        fv_nic_kick();
    return 0;
}

FV_EXPORT int ibv_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_context);
FV_EXPORT int ibv_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_context)
{
    if (!ch || !cq || !cq_context)
        return -1;
    struct fv_channel *c = FV_CONTAINER(ch, struct fv_channel, ch);
    for (;;) {
        char b;
        ssize_t r = read(ch->fd, &b, 1); /* blocks unless the user made the fd non-blocking */
        if (r < 0 && errno == EINTR)
            continue;
        if (r != 1)
            return -1;
        pthread_mutex_lock(&c->lock);
        if (c->qlen == 0) { /* the event of a CQ destroyed meanwhile */
            pthread_mutex_unlock(&c->lock);
            continue;
        }
        struct fv_cq *q = c->q[0];
        memmove(c->q, c->q + 1, (c->qlen - 1) * sizeof *c->q);
        c->qlen--;
        pthread_mutex_unlock(&c->lock); /* lock order: CQ before channel */
        pthread_mutex_lock(&q->lock);
        q->events_reported++;
        pthread_mutex_unlock(&q->lock);
        *cq = &q->cq;
        *cq_context = q->cq.cq_context;
        return 0;
    }
}

FV_EXPORT void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents);
FV_EXPORT void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents)
{
    if (!cq)
        return;
    pthread_mutex_lock(&cq->mutex);
    cq->comp_events_completed += nevents;
    pthread_cond_signal(&cq->cond);
    pthread_mutex_unlock(&cq->mutex);
}
