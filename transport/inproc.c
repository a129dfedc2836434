/* The in-process transport: stages as threads of one process. A message is
 * parsed and checked by the receiver exactly as if it came off a socket. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/comm/comm_impl.h"

/* The group all in-process ranks share; freed by the last rank to leave. */
struct inproc_hub {
    pthread_mutex_t lock;
    unsigned size, alive;
    epipe_comm **members; /* NULL once a rank has left */
};

static struct inproc_hub *hub_of(epipe_comm *c)
{
    return c->tp;
}

static int inproc_send(epipe_comm *c, unsigned peer, epipe_msg *m)
{
    struct inproc_hub *hub = hub_of(c);
    pthread_mutex_lock(&hub->lock);
    epipe_comm *dst = hub->members[peer];
    if (!dst) {
        pthread_mutex_unlock(&hub->lock);
        epipe_msg_free(m);
        return epipe_fail_into(c->msg, EPIPE_EPEER, "rank %u: rank %u has left", c->rank, peer);
    }
    /* The receiver's side of a network transport: strict parse, then hand
     * over. A bad message is the sender's bug, reported to the receiver as
     * a failed peer and to the sender as the parse error. */
    epipe_wire_limits lim = {.max_payload = dst->max_message};
    const uint8_t *payload;
    int rc = epipe_wire_parse(m->data, m->len, &lim, &m->hdr, &payload);
    if (rc == EPIPE_OK && (m->hdr.src_stage != c->rank || m->hdr.dst_stage != peer))
        rc = epipe_fail(EPIPE_EPROTO, "wire: message from rank %u to %u claims %u to %u",
                        c->rank, peer, m->hdr.src_stage, m->hdr.dst_stage);
    if (rc != EPIPE_OK) {
        epipe_fail_into(c->msg, rc, "%s", epipe_last_error());
        epipe_comm_peer_down(dst, c->rank, EPIPE_PEER_FAILED, c->msg);
        pthread_mutex_unlock(&hub->lock);
        epipe_msg_free(m);
        return rc;
    }
    epipe_comm_deliver(dst, m);
    pthread_mutex_unlock(&hub->lock);
    return EPIPE_OK;
}

static void inproc_leave(epipe_comm *c, enum epipe_peer_state how, const char *why)
{
    struct inproc_hub *hub = hub_of(c);
    pthread_mutex_lock(&hub->lock);
    for (unsigned r = 0; r < hub->size; r++)
        if (hub->members[r] && r != c->rank)
            epipe_comm_peer_down(hub->members[r], c->rank, how, why);
    pthread_mutex_unlock(&hub->lock);
}

static void inproc_abort(epipe_comm *c)
{
    inproc_leave(c, EPIPE_PEER_FAILED, "it was aborted");
}

static void inproc_destroy(epipe_comm *c)
{
    struct inproc_hub *hub = hub_of(c);
    inproc_leave(c, EPIPE_PEER_LEFT, "");
    pthread_mutex_lock(&hub->lock);
    hub->members[c->rank] = NULL;
    unsigned alive = --hub->alive;
    pthread_mutex_unlock(&hub->lock);
    epipe_comm_free(c);
    if (alive == 0) {
        pthread_mutex_destroy(&hub->lock);
        free(hub->members);
        free(hub);
    }
}

static const epipe_transport_ops inproc_ops = {
    .name = "inproc",
    .send = inproc_send,
    .destroy = inproc_destroy,
    .abort = inproc_abort,
};

EPIPE_API int epipe_comm_create_inproc(epipe_comm **comms, unsigned size)
{
    epipe_clear_error();
    if (!comms)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_inproc: comms is NULL");
    if (size == 0 || size > 1024)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_inproc: size %u is out of range 1..1024",
                          size);
    memset(comms, 0, sizeof *comms * size);
    struct inproc_hub *hub = calloc(1, sizeof *hub);
    if (!hub || !(hub->members = calloc(size, sizeof *hub->members)) ||
        pthread_mutex_init(&hub->lock, NULL) != 0) {
        if (hub)
            free(hub->members);
        free(hub);
        return epipe_fail(EPIPE_ENOMEM, "epipe_comm_create_inproc: out of memory");
    }
    hub->size = size;
    for (unsigned r = 0; r < size; r++) {
        epipe_comm *c = epipe_comm_alloc(&inproc_ops, r, size);
        if (!c) {
            for (unsigned k = 0; k < r; k++)
                epipe_comm_free(comms[k]), comms[k] = NULL;
            pthread_mutex_destroy(&hub->lock);
            free(hub->members);
            free(hub);
            return epipe_fail(EPIPE_ENOMEM, "epipe_comm_create_inproc: out of memory");
        }
        c->tp = hub;
        /* As tcp's default: a receive spins (yielding) 50 us before it sleeps.
         * A futex wake-up of a sleeping thread costs 10-20 us on a VM whose
         * idle vCPUs halt, and 1F1B hands over a message at every op. */
        c->spin_us = 50;
        hub->members[r] = comms[r] = c;
    }
    hub->alive = size;
    return EPIPE_OK;
}
