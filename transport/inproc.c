/* The in-process transport: stages as threads of one process. A message is
 * parsed and checked by the receiver exactly as if it came off a socket. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../lib/comm/comm_impl.h"
#include "../lib/log.h"

/* The group all in-process ranks share; freed by the last rank to leave. */
struct inproc_hub {
    pthread_mutex_t lock;
    unsigned size, alive;
    epipe_comm **members; /* NULL once a rank has left */
    char name[64];        /* the group's name, "" for epipe_comm_create_inproc */
};

static struct inproc_hub *hub_of(epipe_comm *c)
{
    return c->tp;
}

/* A message whose payload stays in device memory (epipe_comm_msg_new_device):
 * its header alone, checked as any; the payload, which the transport does
 * not read, is the decoder's to check (epipe/codec.h: at the receiving
 * stage's synchronize, or before its kernels). dst must decode on a
 * device: on another than the payload's, it copies the payload over
 * first (device_payload_here() in lib/stage/opstream.c). */
static int parse_device_message(epipe_msg *m, epipe_comm *dst, const epipe_wire_limits *lim)
{
    int rc = epipe_wire_parse_header(m->data, m->len, lim, &m->hdr);
    if (rc)
        return rc;
    if (m->hdr.header_len != m->len || m->hdr.payload_len > m->dev_cap)
        return epipe_fail(EPIPE_EPROTO,
                          "wire: a device message of %zu header bytes and %zu payload bytes "
                          "says %u and %llu",
                          m->len, m->dev_cap, m->hdr.header_len,
                          (unsigned long long)m->hdr.payload_len);
    if (m->hdr.kind != EPIPE_WIRE_ACTIVATION && m->hdr.kind != EPIPE_WIRE_GRADIENT)
        return epipe_fail(EPIPE_EPROTO, "wire: a device message of kind %s carries no tensor",
                          epipe_wire_kind_name(m->hdr.kind));
    if (__atomic_load_n(&dst->dev_device, __ATOMIC_ACQUIRE) < 0)
        return epipe_fail(EPIPE_EINTERNAL,
                          "a payload in the memory of CUDA device %d for a rank that decodes "
                          "on no device",
                          m->dev_device);
    return EPIPE_OK;
}

static int inproc_peer_device(epipe_comm *c, unsigned peer)
{
    struct inproc_hub *hub = hub_of(c);
    pthread_mutex_lock(&hub->lock);
    epipe_comm *dst = hub->members[peer];
    int device = dst ? __atomic_load_n(&dst->dev_device, __ATOMIC_ACQUIRE) : -1;
    pthread_mutex_unlock(&hub->lock);
    return device;
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
    epipe_wire_limits lim = {.max_payload = __atomic_load_n(&dst->max_message, __ATOMIC_RELAXED)};
    const uint8_t *payload;
    int rc = m->dev ? parse_device_message(m, dst, &lim)
                    : epipe_wire_parse(m->data, m->len, &lim, &m->hdr, &payload);
    if (rc == EPIPE_OK && (m->hdr.src_stage != c->rank || m->hdr.dst_stage != peer))
        rc = epipe_fail(EPIPE_EPROTO, "wire: message from rank %u to %u claims %u to %u", c->rank,
                        peer, m->hdr.src_stage, m->hdr.dst_stage);
    if (rc != EPIPE_OK) {
        /* Copied first: the thread's error buffer is where fail_into writes. */
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", epipe_last_error());
        epipe_fail_into(c->msg, rc, "%s", why);
        epipe_comm_peer_failed(dst, c->rank, rc, why);
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

static void hub_free(struct inproc_hub *hub)
{
    pthread_mutex_destroy(&hub->lock);
    free(hub->members);
    free(hub);
}

static void inproc_destroy(epipe_comm *c)
{
    struct inproc_hub *hub = hub_of(c);
    if (epipe_log_enabled(EPIPE_LOG_DEBUG, "comm")) {
        uint64_t hits, misses;
        epipe_comm_cache_stats(c, &hits, &misses, NULL);
        epipe_log_debug((int)c->rank, "comm",
                        "inproc group '%s': rank %u leaves; its buffer "
                        "cache served %llu buffer(s) again and allocated %llu",
                        hub->name, c->rank, (unsigned long long)hits, (unsigned long long)misses);
    }
    inproc_leave(c, EPIPE_PEER_LEFT, "");
    pthread_mutex_lock(&hub->lock);
    hub->members[c->rank] = NULL;
    unsigned alive = --hub->alive;
    pthread_mutex_unlock(&hub->lock);
    epipe_comm_free(c);
    if (alive == 0)
        hub_free(hub);
}

static const epipe_transport_ops inproc_ops = {
    .name = "inproc",
    .send = inproc_send,
    .destroy = inproc_destroy,
    .abort = inproc_abort,
    .peer_device = inproc_peer_device,
};

static struct inproc_hub *hub_new(unsigned size)
{
    struct inproc_hub *hub = calloc(1, sizeof *hub);
    if (!hub || !(hub->members = calloc(size, sizeof *hub->members)) ||
        pthread_mutex_init(&hub->lock, NULL) != 0) {
        if (hub)
            free(hub->members);
        free(hub);
        return NULL;
    }
    hub->size = size;
    return hub;
}

static epipe_comm *member_new(struct inproc_hub *hub, unsigned rank, const epipe_comm_settings *s)
{
    epipe_comm *c = epipe_comm_alloc(&inproc_ops, rank, hub->size, s);
    if (c)
        c->tp = hub;
    return c;
}

static int check_size(const char *who, unsigned size)
{
    if (size == 0 || size > 1024)
        return epipe_fail(EPIPE_EINVAL, "%s: size %u is out of range 1..1024", who, size);
    return EPIPE_OK;
}

int epipe_inproc_create_all(epipe_comm **comms, unsigned size, const epipe_comm_settings *s)
{
    int rc = check_size("epipe_comm_create_inproc", size);
    if (rc)
        return rc;
    memset(comms, 0, sizeof *comms * size);
    struct inproc_hub *hub = hub_new(size);
    if (!hub)
        return epipe_fail(EPIPE_ENOMEM, "epipe_comm_create_inproc: out of memory");
    for (unsigned r = 0; r < size; r++) {
        epipe_comm *c = member_new(hub, r, s);
        if (!c) {
            for (unsigned k = 0; k < r; k++)
                epipe_comm_free(comms[k]), comms[k] = NULL;
            hub_free(hub);
            return epipe_fail(EPIPE_ENOMEM, "epipe_comm_create_inproc: out of memory");
        }
        hub->members[r] = comms[r] = c;
    }
    hub->alive = size;
    return EPIPE_OK;
}

/* ---- named groups: ranks of one process joining from their own threads --
 *
 * The registry below is the transport's only process-wide state: a list of
 * groups still being formed, keyed by name, behind reg_lock. A group leaves
 * the list the moment its last rank joins (so the name can be used again by
 * the next group) and its entry is freed by the last rank to stop waiting;
 * a rank that gives up (init timeout) takes its handle back out, and the
 * last one out of an incomplete group frees it. */
struct inproc_pending {
    struct inproc_pending *next;
    char name[64];
    struct inproc_hub *hub;
    unsigned joined;  /* ranks in hub->members */
    unsigned waiting; /* ranks blocked in join */
    int complete;
};

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reg_cond;
static pthread_once_t reg_once = PTHREAD_ONCE_INIT;
static struct inproc_pending *reg_head;

static void reg_init(void)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&reg_cond, &ca);
    pthread_condattr_destroy(&ca);
}

static void reg_unlink(struct inproc_pending *g)
{
    for (struct inproc_pending **p = &reg_head; *p; p = &(*p)->next)
        if (*p == g) {
            *p = g->next;
            return;
        }
}

unsigned epipe_inproc_pending(const char *name)
{
    pthread_mutex_lock(&reg_lock);
    struct inproc_pending *g = reg_head;
    while (g && strcmp(g->name, name))
        g = g->next;
    unsigned n = g ? g->joined : 0;
    pthread_mutex_unlock(&reg_lock);
    return n;
}

/* Called with reg_lock held when `rank` gives up on g. */
static int give_up(struct inproc_pending *g, epipe_comm *c, unsigned rank, int64_t ms)
{
    char missing[160] = "";
    size_t n = 0;
    for (unsigned r = 0; r < g->hub->size && n + 12 < sizeof missing; r++)
        if (!g->hub->members[r])
            n += (size_t)snprintf(missing + n, sizeof missing - n, "%s%u", n ? ", " : "", r);
    int rc = epipe_fail(EPIPE_ETIMEDOUT,
                        "inproc: group '%s': rank %u waited %lld ms; rank(s) "
                        "%s of %u did not join",
                        g->name, rank, (long long)ms, missing, g->hub->size);
    g->hub->members[rank] = NULL;
    epipe_comm_free(c);
    if (--g->joined == 0) {
        reg_unlink(g);
        hub_free(g->hub);
        free(g);
    }
    return rc;
}

int epipe_inproc_join(epipe_comm **out, unsigned rank, unsigned size, const epipe_comm_settings *s)
{
    int rc = check_size("inproc", size);
    if (rc)
        return rc;
    if (rank >= size)
        return epipe_fail(EPIPE_EINVAL, "inproc: rank %u is not below size %u", rank, size);
    if (!s->group[0]) {
        if (size > 1)
            return epipe_fail(EPIPE_EINVAL,
                              "inproc: a group of %u ranks needs a name "
                              "(option group=NAME) for its ranks to meet",
                              size);
        epipe_comm *one[1];
        if ((rc = epipe_inproc_create_all(one, 1, s)))
            return rc;
        *out = one[0];
        return EPIPE_OK;
    }
    pthread_once(&reg_once, reg_init);
    pthread_mutex_lock(&reg_lock);
    struct inproc_pending *g = reg_head;
    while (g && strcmp(g->name, s->group))
        g = g->next;
    if (g && g->hub->size != size)
        rc = epipe_fail(EPIPE_EINVAL, "inproc: group '%s' has %u ranks; rank %u says %u", g->name,
                        g->hub->size, rank, size);
    else if (g && g->hub->members[rank])
        rc = epipe_fail(EPIPE_EINVAL, "inproc: group '%s': rank %u joined twice", g->name, rank);
    else if (!g && (!(g = calloc(1, sizeof *g)) || !(g->hub = hub_new(size)))) {
        free(g);
        rc = epipe_fail(EPIPE_ENOMEM, "inproc: out of memory");
    } else if (!g->name[0]) {
        snprintf(g->name, sizeof g->name, "%s", s->group);
        snprintf(g->hub->name, sizeof g->hub->name, "%s", s->group);
        g->next = reg_head;
        reg_head = g;
    }
    epipe_comm *c = rc ? NULL : member_new(g->hub, rank, s);
    if (!rc && !c) {
        rc = epipe_fail(EPIPE_ENOMEM, "inproc: out of memory");
        if (g->joined == 0) {
            reg_unlink(g);
            hub_free(g->hub);
            free(g);
        }
    }
    if (rc) {
        pthread_mutex_unlock(&reg_lock);
        return rc;
    }
    g->hub->members[rank] = c;
    if (++g->joined == size) {
        reg_unlink(g);
        g->hub->alive = size;
        g->complete = 1;
        pthread_cond_broadcast(&reg_cond);
        if (g->waiting == 0)
            free(g);
        pthread_mutex_unlock(&reg_lock);
        epipe_log_info((int)rank, "inproc", "group '%s': rank %u of %u joined last", s->group, rank,
                       size);
        *out = c;
        return EPIPE_OK;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += s->init_timeout_ms / 1000;
    deadline.tv_nsec += (s->init_timeout_ms % 1000) * 1000000;
    if (deadline.tv_nsec >= 1000000000)
        deadline.tv_sec++, deadline.tv_nsec -= 1000000000;
    g->waiting++;
    int timed_out = 0;
    while (!g->complete && !timed_out)
        timed_out = pthread_cond_timedwait(&reg_cond, &reg_lock, &deadline) == ETIMEDOUT;
    g->waiting--;
    if (!g->complete) {
        rc = give_up(g, c, rank, s->init_timeout_ms);
        pthread_mutex_unlock(&reg_lock);
        return rc;
    }
    if (g->waiting == 0)
        free(g);
    pthread_mutex_unlock(&reg_lock);
    epipe_log_info((int)rank, "inproc", "group '%s': rank %u of %u joined", s->group, rank, size);
    *out = c;
    return EPIPE_OK;
}
