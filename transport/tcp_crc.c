/* The TCP transport's CRC helper thread: checksums large incoming payloads
 * while the progress thread reads on (messages sent in clear). */
#define _GNU_SOURCE
#include <pthread.h>

#include "../lib/wire/crc32c.h"
#include "tcp_conn.h"

static void *crc_helper_main(void *arg)
{
    struct crc_helper *h = arg;
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (!h->stop && (!h->owner || h->done == h->avail))
            pthread_cond_wait(&h->work, &h->lock);
        if (h->stop)
            break;
        const uint8_t *base = h->base;
        size_t from = h->done, n = h->avail - h->done;
        uint32_t crc = h->crc;
        if (n > RECV_CHUNK)
            n = RECV_CHUNK;
        h->busy = 1;
        pthread_mutex_unlock(&h->lock);
        crc = epipe_crc32c(crc, base + from, n);
        pthread_mutex_lock(&h->lock);
        h->busy = 0;
        if (h->owner && h->base == base) {
            h->crc = crc;
            h->done = from + n;
        }
        pthread_cond_broadcast(&h->progress);
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

/* Hands k's payload to the helper; 0 if it is busy (then: inline). */
int epipe_tcp_offload_begin(struct tcp *t, struct conn *k)
{
    struct crc_helper *h = &t->h;
    if (!h->started) {
        if (pthread_mutex_init(&h->lock, NULL))
            return 0;
        pthread_cond_init(&h->work, NULL);
        pthread_cond_init(&h->progress, NULL);
        if (pthread_create(&h->thread, NULL, crc_helper_main, h)) {
            pthread_cond_destroy(&h->work);
            pthread_cond_destroy(&h->progress);
            pthread_mutex_destroy(&h->lock);
            h->started = -1; /* never again */
            return 0;
        }
        h->started = 1;
    }
    if (h->started < 0)
        return 0;
    pthread_mutex_lock(&h->lock);
    int ok = h->owner == NULL;
    if (ok) {
        h->owner = k;
        h->base = k->rx->data + k->hlen;
        h->done = h->avail = 0;
        h->crc = 0;
    }
    pthread_mutex_unlock(&h->lock);
    return ok;
}

void epipe_tcp_offload_add(struct tcp *t, size_t n)
{
    pthread_mutex_lock(&t->h.lock);
    t->h.avail += n;
    pthread_cond_signal(&t->h.work);
    pthread_mutex_unlock(&t->h.lock);
}

/* Waits for the helper to finish k's payload; its CRC. */
uint32_t epipe_tcp_offload_end(struct tcp *t)
{
    struct crc_helper *h = &t->h;
    pthread_mutex_lock(&h->lock);
    while (h->done < h->avail)
        pthread_cond_wait(&h->progress, &h->lock);
    uint32_t crc = h->crc;
    h->owner = NULL;
    pthread_mutex_unlock(&h->lock);
    return crc;
}

/* Takes k's payload back before it is freed. */
void epipe_tcp_offload_cancel(struct tcp *t)
{
    struct crc_helper *h = &t->h;
    pthread_mutex_lock(&h->lock);
    h->owner = NULL;
    while (h->busy)
        pthread_cond_wait(&h->progress, &h->lock);
    pthread_mutex_unlock(&h->lock);
}

void epipe_tcp_crc_stop(struct tcp *t)
{
    struct crc_helper *h = &t->h;
    if (h->started <= 0)
        return;
    pthread_mutex_lock(&h->lock);
    h->stop = 1;
    pthread_cond_signal(&h->work);
    pthread_mutex_unlock(&h->lock);
    pthread_join(h->thread, NULL);
    pthread_cond_destroy(&h->work);
    pthread_cond_destroy(&h->progress);
    pthread_mutex_destroy(&h->lock);
    h->started = 0;
}
