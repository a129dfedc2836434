/* The communicator core: the public handle functions, the mailbox that
 * matches arriving messages to receives, and peer-failure bookkeeping. */
#include "comm_impl.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../log.h"

/* Large message buffers are kept for reuse: a stage sends and receives
 * messages of the same few sizes every step, and a fresh large block costs
 * a page fault per 4 KiB on first touch (glibc maps and unmaps blocks over
 * 32 MiB every time). Each communicator has a cache of its own: at most
 * MSGBUF_SLOTS buffers of MSGBUF_MIN bytes or more, `cap` bytes in all
 * (EPIPE_COMM_BUFFER_CACHE, default 512 MiB); a buffer serves a message of
 * half its size or more. A message holds a reference on the cache its
 * buffer came from, so the cache lives until the handle is gone and the
 * last of its messages (perhaps freed by a peer's thread) is freed. */
#define MSGBUF_MIN ((size_t)256 << 10)
#define MSGBUF_SLOTS 32
/* Device payload buffers (epipe_comm_device_buffers) serve smaller
 * messages too: the alternative is two copies across PCIe. */
#define DEVBUF_MIN ((size_t)4 << 10)

/* A cache may be told to hand out pinned (page-locked) buffers, for a
 * stage that encodes CUDA tensors into its messages and decodes them
 * from there (epipe_comm_pin_buffers). Pinning costs far more than
 * malloc, and freeing pinned memory may wait for the device, so the cache
 * pins only what it can keep: buffers of at most half its cap, and no
 * more than MSGBUF_SLOTS of them and `cap` bytes alive (cached or out) at
 * once; past that a message gets a malloc'd buffer. A pinned buffer is
 * then never pushed out for want of a slot or of bytes: every one alive
 * fits. Each buffer carries the function that frees it, and buffers are
 * freed outside the cache's lock (fork() takes it, and a free may wait). */
typedef struct msgbuf {
    void *p;
    size_t cap;
    void (*release)(int device, void *p); /* NULL: free() */
    int device;                           /* release's argument */
} msgbuf;

struct epipe_msgpool {
    pthread_mutex_t lock;
    unsigned refs;                     /* the handle's and one per message out; atomic */
    int closed;                        /* the handle is gone: keep nothing more */
    uint64_t cap;                      /* bytes the cache may hold */
    const epipe_msgbuf_allocator *pin; /* NULL: malloc's buffers */
    int pin_device;                    /* the CUDA device pin allocates through */
    int device_memory;                 /* a cache of device payload buffers: pin's
                                          or none (never malloc's) */
    unsigned pinned;                   /* pinned buffers alive, cached or out */
    uint64_t pinned_bytes;             /* ... and their bytes */
    msgbuf slot[MSGBUF_SLOTS];
    uint64_t bytes, hits, misses;
    unsigned next;
};

/* The rdma transport's registration cache must forget a buffer before it
 * goes back to the system: every message buffer is freed through here. */
static void (*free_hook)(void *p, size_t cap);

void epipe_msgbuf_free_hook_set(void (*fn)(void *p, size_t cap))
{
    __atomic_store_n(&free_hook, fn, __ATOMIC_RELEASE);
}

static void buf_free(msgbuf b)
{
    void (*fn)(void *, size_t) = __atomic_load_n(&free_hook, __ATOMIC_ACQUIRE);
    if (fn && b.p)
        fn(b.p, b.cap);
    if (b.release && b.p)
        b.release(b.device, b.p);
    else
        free(b.p);
}

/* Buffers taken out of the cache under its lock, freed after it. */
typedef struct msgbuf_list {
    msgbuf b[MSGBUF_SLOTS + 1];
    int n;
} msgbuf_list;

static void list_free(msgbuf_list *l)
{
    for (int i = 0; i < l->n; i++)
        buf_free(l->b[i]);
    l->n = 0;
}

/* b leaves the cache's accounts for good (it is about to be freed). */
static void forget(epipe_msgpool *pool, msgbuf b, msgbuf_list *l)
{
    if (!b.p)
        return;
    if (b.release) {
        pool->pinned--;
        pool->pinned_bytes -= b.cap;
    }
    l->b[l->n++] = b;
}

static void slot_take(epipe_msgpool *pool, int i, msgbuf_list *l)
{
    if (pool->slot[i].p) {
        pool->bytes -= pool->slot[i].cap;
        forget(pool, pool->slot[i], l);
        pool->slot[i].p = NULL;
    }
}

static epipe_msgpool *pool_new(void)
{
    epipe_msgpool *pool = calloc(1, sizeof *pool);
    if (pool && pthread_mutex_init(&pool->lock, NULL) != 0) {
        free(pool);
        return NULL;
    }
    if (pool) {
        pool->refs = 1;
        pool->cap = (uint64_t)512 << 20;
    }
    return pool;
}

/* Takes everything the cache holds into l (the caller frees it). */
static void pool_drain(epipe_msgpool *pool, msgbuf_list *l)
{
    for (int i = 0; i < MSGBUF_SLOTS; i++)
        slot_take(pool, i, l);
}

static void pool_unref(epipe_msgpool *pool)
{
    if (pool && __atomic_sub_fetch(&pool->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        msgbuf_list l = {.n = 0};
        pool_drain(pool, &l);
        list_free(&l);
        pthread_mutex_destroy(&pool->lock);
        free(pool);
    }
}

/* The handle is gone: free what is cached, keep nothing more, and drop the
 * handle's reference (messages still out hold theirs). */
static void pool_close(epipe_msgpool *pool)
{
    msgbuf_list l = {.n = 0};
    pthread_mutex_lock(&pool->lock);
    pool->closed = 1;
    pool_drain(pool, &l);
    pthread_mutex_unlock(&pool->lock);
    list_free(&l);
    pool_unref(pool);
}

static size_t pool_min(const epipe_msgpool *pool)
{
    return pool->device_memory ? DEVBUF_MIN : MSGBUF_MIN;
}

/* A buffer of at least b->cap bytes (its size into b->cap, and how to free
 * it), or b->p NULL when out of memory (or, in a cache of device memory,
 * when it has none to give). */
static void pool_get(epipe_msgpool *pool, msgbuf *b)
{
    b->release = NULL;
    if (b->cap >= pool_min(pool)) {
        msgbuf_list l = {.n = 0};
        pthread_mutex_lock(&pool->lock);
        void (*want)(int, void *) = pool->pin ? pool->pin->release : NULL;
        int best = -1;
        for (int i = 0; i < MSGBUF_SLOTS; i++)
            if (pool->slot[i].p && pool->slot[i].release == want && pool->slot[i].cap >= b->cap &&
                pool->slot[i].cap / 2 <= b->cap &&
                (best < 0 || pool->slot[i].cap < pool->slot[best].cap))
                best = i;
        if (best >= 0) {
            *b = pool->slot[best];
            pool->bytes -= b->cap;
            pool->slot[best].p = NULL;
            pool->hits++;
            pthread_mutex_unlock(&pool->lock);
            return;
        }
        pool->misses++;
        const epipe_msgbuf_allocator *pin = NULL;
        if (pool->pin && b->cap <= pool->cap / 2) {
            /* Past the bounds, cached pinned buffers (none of which fits
             * this message; while pinning, every cached one is pinned) make
             * room, in slot order from pool->next; but only where freeing
             * them all would make enough, or they would go for nothing. */
            unsigned held = 0;
            for (int i = 0; i < MSGBUF_SLOTS; i++)
                held += pool->slot[i].p != NULL;
            int room = pool->pinned - held < MSGBUF_SLOTS &&
                       pool->pinned_bytes - pool->bytes + b->cap <= pool->cap;
            for (int k = 0;
                 room && k < MSGBUF_SLOTS &&
                 (pool->pinned >= MSGBUF_SLOTS || pool->pinned_bytes + b->cap > pool->cap);
                 k++)
                slot_take(pool, (int)((pool->next + k) % MSGBUF_SLOTS), &l);
            if (pool->pinned < MSGBUF_SLOTS && pool->pinned_bytes + b->cap <= pool->cap) {
                pin = pool->pin;
                pool->pinned++; /* reserved until the allocation says */
                pool->pinned_bytes += b->cap;
            }
        }
        int device = pool->pin_device;
        pthread_mutex_unlock(&pool->lock);
        list_free(&l);
        if (pin) {
            b->p = NULL;
            if (pin->alloc(device, b->cap, &b->p) == EPIPE_OK && b->p) {
                b->release = pin->release;
                b->device = device;
                return;
            }
            pthread_mutex_lock(&pool->lock);
            pool->pinned--;
            pool->pinned_bytes -= b->cap;
            pthread_mutex_unlock(&pool->lock);
            /* no pinned memory: a pageable buffer serves, only slower */
        }
    }
    b->p = pool->device_memory ? NULL : malloc(b->cap);
}

static void pool_put(epipe_msgpool *pool, msgbuf b)
{
    msgbuf_list l = {.n = 0};
    pthread_mutex_lock(&pool->lock);
    /* Only the kind of buffer the cache now hands out is kept. */
    void (*want)(int, void *) = pool->pin ? pool->pin->release : NULL;
    if (b.p && !pool->closed && b.release == want && b.cap >= pool_min(pool) &&
        b.cap <= pool->cap / 2) {
        int slot = -1;
        for (int i = 0; i < MSGBUF_SLOTS && slot < 0; i++)
            if (!pool->slot[i].p)
                slot = i;
        if (slot < 0) /* full: the oldest-placed slot in turn makes room */
            slot = (int)(pool->next++ % MSGBUF_SLOTS);
        slot_take(pool, slot, &l);
        for (int i = 0; i < MSGBUF_SLOTS && pool->bytes + b.cap > pool->cap; i++)
            slot_take(pool, i, &l);
        pool->slot[slot] = b;
        pool->bytes += b.cap;
    } else {
        forget(pool, b, &l);
    }
    pthread_mutex_unlock(&pool->lock);
    list_free(&l);
}

void epipe_comm_pin_buffers(epipe_comm *c, const epipe_msgbuf_allocator *pin, int device)
{
    epipe_msgpool *pool = c->pool;
    msgbuf_list l = {.n = 0};
    pthread_mutex_lock(&pool->lock);
    if (pool->pin != pin) {
        pool->pin = pin;
        pool->pin_device = device;
        pool_drain(pool, &l); /* buffers of the other kind would never serve again */
    }
    pthread_mutex_unlock(&pool->lock);
    list_free(&l);
}

void epipe_comm_cache_stats(const epipe_comm *c, uint64_t *hits, uint64_t *misses, uint64_t *bytes)
{
    epipe_msgpool *pool = c->pool;
    pthread_mutex_lock(&pool->lock);
    if (hits)
        *hits = pool->hits;
    if (misses)
        *misses = pool->misses;
    if (bytes)
        *bytes = pool->bytes;
    pthread_mutex_unlock(&pool->lock);
}

static epipe_msg *msg_new(epipe_msgpool *pool, size_t payload_cap)
{
    if (payload_cap > SIZE_MAX - EPIPE_WIRE_HEADER_SIZE)
        return NULL;
    epipe_msg *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    msgbuf b = {.cap = EPIPE_WIRE_HEADER_SIZE + payload_cap};
    if (pool)
        pool_get(pool, &b);
    else
        b.p = malloc(b.cap);
    m->data = b.p;
    m->cap = b.cap;
    m->release = b.release;
    m->release_device = b.device;
    if (!m->data) {
        free(m);
        return NULL;
    }
    if (pool) {
        __atomic_add_fetch(&pool->refs, 1, __ATOMIC_RELAXED);
        m->pool = pool;
    }
    return m;
}

epipe_msg *epipe_msg_new(size_t payload_cap)
{
    return msg_new(NULL, payload_cap);
}

epipe_msg *epipe_comm_msg_new(epipe_comm *c, size_t payload_cap)
{
    return msg_new(c->pool, payload_cap);
}

int epipe_comm_device_buffers(epipe_comm *c, const epipe_msgbuf_allocator *dev, int device)
{
    if (!c->ops->peer_device || !dev || device < 0)
        return 0;
    /* c->lock orders this against a change of the cap (epipe_comm_set_param);
     * the host cache's lock, against fork_prepare, which holds it while it
     * reads whether there is a device cache to lock too */
    pthread_mutex_lock(&c->lock);
    pthread_mutex_lock(&c->pool->lock);
    if (!c->dev_pool && (c->dev_pool = pool_new())) {
        c->dev_pool->device_memory = 1;
        c->dev_pool->pin = dev;
        c->dev_pool->pin_device = device;
        c->dev_pool->cap = c->pool->cap;
        __atomic_store_n(&c->dev_device, device, __ATOMIC_RELEASE);
    }
    int ok = c->dev_pool != NULL;
    pthread_mutex_unlock(&c->pool->lock);
    pthread_mutex_unlock(&c->lock);
    return ok;
}

int epipe_comm_peer_device(epipe_comm *c, unsigned peer)
{
    return c->ops->peer_device && peer < c->size && peer != c->rank ? c->ops->peer_device(c, peer)
                                                                    : -1;
}

epipe_msg *epipe_comm_msg_new_device(epipe_comm *c, int device, size_t payload_cap)
{
    /* dev_pool is set once, before dev_device says so */
    if (device < 0 || __atomic_load_n(&c->dev_device, __ATOMIC_ACQUIRE) != device)
        return NULL;
    msgbuf b = {.cap = payload_cap};
    pool_get(c->dev_pool, &b);
    if (!b.p)
        return NULL;
    epipe_msg *m = msg_new(NULL, 0); /* the header */
    if (!m) {
        pool_put(c->dev_pool, b);
        return NULL;
    }
    m->dev = b.p;
    m->dev_cap = b.cap;
    m->dev_release = b.release;
    m->dev_device = b.device;
    m->dev_pool = c->dev_pool;
    __atomic_add_fetch(&c->dev_pool->refs, 1, __ATOMIC_RELAXED);
    return m;
}

void epipe_msg_free(epipe_msg *m)
{
    if (m) {
        msgbuf b = {m->data, m->cap, m->release, m->release_device};
        if (m->pool) {
            pool_put(m->pool, b);
            pool_unref(m->pool);
        } else {
            buf_free(b);
        }
        if (m->fence)
            m->fence_free(m->dev_device, m->fence);
        if (m->dev) {
            msgbuf d = {m->dev, m->dev_cap, m->dev_release, m->dev_device};
            pool_put(m->dev_pool, d);
            pool_unref(m->dev_pool);
        }
        free(m);
    }
}

int epipe_msg_seal(epipe_msg *m, size_t payload_len)
{
    if (m->dev) { /* the host does not read device memory, which no wire carries */
        m->hdr.payload_len = payload_len;
        m->hdr.payload_crc = 0;
    } else {
        epipe_wire_set_payload(&m->hdr, epipe_msg_payload(m), payload_len);
    }
    int rc = epipe_wire_encode_header(&m->hdr, m->data, EPIPE_WIRE_HEADER_SIZE);
    if (rc == EPIPE_OK)
        m->len = EPIPE_WIRE_HEADER_SIZE + (m->dev ? 0 : payload_len);
    return rc;
}

epipe_comm *epipe_comm_alloc(const epipe_transport_ops *ops, unsigned rank, unsigned size,
                             const epipe_comm_settings *s)
{
    epipe_comm *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    if (s->trace[0] && !(c->trace = strdup(s->trace))) {
        free(c);
        return NULL;
    }
    c->peer_state = calloc(size, 1);
    c->peer_why = calloc(size, sizeof *c->peer_why);
    c->peer_status = calloc(size, sizeof *c->peer_status);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    c->pool = pool_new();
    int ok = c->pool && c->peer_state && c->peer_why && c->peer_status &&
             pthread_mutex_init(&c->lock, NULL) == 0;
    if (ok && pthread_cond_init(&c->arrived, &ca) != 0) {
        pthread_mutex_destroy(&c->lock);
        ok = 0;
    }
    pthread_condattr_destroy(&ca);
    if (!ok) {
        pool_unref(c->pool);
        free(c->peer_state);
        free(c->peer_why);
        free(c->peer_status);
        free(c->trace);
        free(c);
        return NULL;
    }
    c->ops = ops;
    c->rank = rank;
    c->size = size;
    c->timeout_ms = s->timeout_ms;
    c->max_message = s->max_message;
    c->spin_us = s->spin_us;
    c->pool->cap = s->buffer_cache;
    c->dev_device = -1;
    return c;
}

void epipe_comm_free(epipe_comm *c)
{
    for (epipe_msg *m = c->inbox, *next; m; m = next) {
        next = m->next;
        epipe_msg_free(m);
    }
    pthread_cond_destroy(&c->arrived);
    pthread_mutex_destroy(&c->lock);
    pool_close(c->pool);
    if (c->dev_pool)
        pool_close(c->dev_pool);
    free(c->trace);
    free(c->peer_state);
    free(c->peer_why);
    free(c->peer_status);
    free(c);
}

void epipe_comm_deliver(epipe_comm *c, epipe_msg *m)
{
    m->next = NULL;
    pthread_mutex_lock(&c->lock);
    if (c->inbox_tail)
        c->inbox_tail->next = m;
    else
        c->inbox = m;
    c->inbox_tail = m;
    __atomic_add_fetch(&c->arrivals, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&c->arrived);
    pthread_mutex_unlock(&c->lock);
}

void epipe_comm_peer_down(epipe_comm *c, unsigned peer, enum epipe_peer_state state,
                          const char *why)
{
    pthread_mutex_lock(&c->lock);
    if (peer < c->size && c->peer_state[peer] == EPIPE_PEER_UP) {
        c->peer_state[peer] = (unsigned char)state;
        strncpy(c->peer_why[peer], why ? why : "", sizeof c->peer_why[peer] - 1);
    }
    __atomic_add_fetch(&c->arrivals, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&c->arrived);
    pthread_mutex_unlock(&c->lock);
}

void epipe_comm_peer_failed(epipe_comm *c, unsigned peer, int status, const char *why)
{
    pthread_mutex_lock(&c->lock);
    if (peer < c->size && c->peer_state[peer] == EPIPE_PEER_UP) {
        c->peer_state[peer] = EPIPE_PEER_FAILED;
        c->peer_status[peer] = status;
        strncpy(c->peer_why[peer], why ? why : "", sizeof c->peer_why[peer] - 1);
    }
    __atomic_add_fetch(&c->arrivals, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&c->arrived);
    pthread_mutex_unlock(&c->lock);
}

/* Under c->lock, the peer not up or this rank aborted: the send's error.
 * Say why the peer is gone, as receives do: the reason may name the rank
 * where a failure began (rank 3 killed, relayed by rank 2). */
static int send_refused_locked(epipe_comm *c, unsigned peer)
{
    int aborted = c->aborted, state = c->peer_state[peer];
    if (aborted && c->self_status)
        return epipe_fail_into(c->msg, c->self_status, "rank %u: cannot send to rank %u: %s",
                               c->rank, peer, c->self_why);
    return epipe_fail_into(
        c->msg, EPIPE_EPEER, "rank %u: cannot send to rank %u: %s%s%s", c->rank, peer,
        aborted                    ? "this rank was aborted"
        : state == EPIPE_PEER_LEFT ? "it left the group"
                                   : "it failed",
        !aborted && c->peer_why[peer][0] ? ": " : "", aborted ? "" : c->peer_why[peer]);
}

/* ---- fork ---------------------------------------------------------------
 *
 * A child of fork() has the parent's memory but only the thread that
 * forked: no progress threads, and any lock another thread held stays
 * held. It cannot use the parent's communicators. Its copies of their
 * sockets would keep the parent's connections open, though: a parent
 * killed while children it forked live on (a data loader's workers) would
 * look alive to its peers until the children exited. So the child closes
 * them at once, and every call on such a handle returns at once. */

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static epipe_comm *live;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* The list, and each handle's buffer cache, are whole and unlocked in the
 * child: a child that destroys a stage it inherited hands its buffers back
 * through the cache. (Order: live_lock, then a cache's lock, as nowhere
 * else are both taken.) The log callback's lock is not taken here: it
 * would wait for callbacks in flight on other threads, and a Python host's
 * callback waits for the interpreter lock that the thread calling fork()
 * holds. A child that forks while another thread logs through a callback
 * can still log; only epipe_set_log_callback() would wait there. */
static void fork_prepare(void)
{
    pthread_mutex_lock(&live_lock);
    for (epipe_comm *c = live; c; c = c->live_next) {
        pthread_mutex_lock(&c->pool->lock);
        /* a device cache is made under the host cache's lock: none appears
         * now; the one there is locked too */
        c->fork_dev_pool = __atomic_load_n(&c->dev_device, __ATOMIC_ACQUIRE) >= 0 ? c->dev_pool
                                                                                  : NULL;
        if (c->fork_dev_pool)
            pthread_mutex_lock(&c->fork_dev_pool->lock);
    }
}

static void fork_unlock_pools(epipe_comm *c)
{
    if (c->fork_dev_pool)
        pthread_mutex_unlock(&c->fork_dev_pool->lock);
    pthread_mutex_unlock(&c->pool->lock);
}

static void fork_parent(void)
{
    for (epipe_comm *c = live; c; c = c->live_next)
        fork_unlock_pools(c);
    pthread_mutex_unlock(&live_lock);
}

static void fork_child(void)
{
    for (epipe_comm *c = live; c; c = c->live_next) {
        c->orphaned = 1;
        if (c->ops->forked)
            c->ops->forked(c);
        fork_unlock_pools(c);
    }
    live = NULL; /* this process owns none of them */
    /* rdma's hook looks freed buffers up in registration caches that are
     * the parent's; a new rdma communicator in the child sets it again */
    __atomic_store_n(&free_hook, NULL, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&live_lock);
}

static void atfork_init(void)
{
    if (pthread_atfork(fork_prepare, fork_parent, fork_child) != 0)
        epipe_log_warn(-1, "comm",
                       "cannot register the fork handler (out of memory): a child this "
                       "process forks keeps its connections open");
}

void epipe_comm_publish(epipe_comm *c)
{
    pthread_once(&atfork_once, atfork_init);
    pthread_mutex_lock(&live_lock);
    c->live_next = live;
    if (live)
        live->live_prev = c;
    live = c;
    pthread_mutex_unlock(&live_lock);
}

static void unpublish(epipe_comm *c)
{
    pthread_mutex_lock(&live_lock);
    if (c->live_prev)
        c->live_prev->live_next = c->live_next;
    else if (live == c)
        live = c->live_next;
    if (c->live_next)
        c->live_next->live_prev = c->live_prev;
    c->live_prev = c->live_next = NULL;
    pthread_mutex_unlock(&live_lock);
}

#define ORPHANED_FMT                                                                               \
    "rank %u: this communicator belongs to the process that forked this one; a child cannot use "  \
    "it"

static int orphaned(epipe_comm *c)
{
    return epipe_fail_into(c->msg, EPIPE_ESTATE, ORPHANED_FMT, c->rank);
}

int epipe_comm_send(epipe_comm *c, unsigned peer, epipe_msg *m)
{
    if (c->orphaned) {
        epipe_msg_free(m);
        return orphaned(c);
    }
    if (peer >= c->size || peer == c->rank) {
        epipe_msg_free(m);
        return epipe_fail_into(c->msg, EPIPE_EINVAL, "rank %u: cannot send to rank %u of %u",
                               c->rank, peer, c->size);
    }
    if (m->dev && !c->ops->peer_device) {
        int device = m->dev_device;
        epipe_msg_free(m);
        return epipe_fail_into(c->msg, EPIPE_EINTERNAL,
                               "rank %u: a payload in the memory of CUDA device %d cannot go to "
                               "rank %u over %s",
                               c->rank, device, peer, c->ops->name);
    }
    pthread_mutex_lock(&c->lock);
    if (c->aborted || c->peer_state[peer] != EPIPE_PEER_UP) {
        int rc = send_refused_locked(c, peer);
        pthread_mutex_unlock(&c->lock);
        epipe_msg_free(m);
        return rc;
    }
    pthread_mutex_unlock(&c->lock);
    return c->ops->send(c, peer, m);
}

static void deadline_after(struct timespec *ts, int64_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000;
    if (ts->tv_nsec >= 1000000000) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000;
    }
}

int epipe_comm_send_gone(epipe_comm *c, unsigned peer, int64_t ms, const char *fallback)
{
    struct timespec deadline;
    deadline_after(&deadline, ms);
    pthread_mutex_lock(&c->lock);
    while (!c->aborted && c->peer_state[peer] == EPIPE_PEER_UP &&
           pthread_cond_timedwait(&c->arrived, &c->lock, &deadline) == 0)
        ;
    int rc = !c->aborted && c->peer_state[peer] == EPIPE_PEER_UP
                 ? epipe_fail_into(c->msg, EPIPE_EPEER, "%s", fallback)
                 : send_refused_locked(c, peer);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* Called with c->lock held; releases it while it busy-waits up to
 * c->spin_us (and the deadline) for an arrival. 1 if something arrived. */
static int spin_for_arrival(epipe_comm *c, const struct timespec *deadline)
{
    uint64_t seen = c->arrivals;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int64_t limit = __atomic_load_n(&c->spin_us, __ATOMIC_RELAXED) * 1000;
    int64_t to_deadline = (int64_t)(deadline->tv_sec - t0.tv_sec) * 1000000000 +
                          (deadline->tv_nsec - t0.tv_nsec);
    if (to_deadline < limit)
        limit = to_deadline;
    pthread_mutex_unlock(&c->lock);
    int changed = 0;
    for (unsigned i = 1; !changed; i++) {
        changed = __atomic_load_n(&c->arrivals, __ATOMIC_ACQUIRE) != seen;
        /* Yield, not pause: the transport thread that will deliver the
         * message may need this core (few cores, or more threads than them). */
        sched_yield();
        if (!changed && (i & 7) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((int64_t)(t.tv_sec - t0.tv_sec) * 1000000000 + (t.tv_nsec - t0.tv_nsec) >= limit)
                break;
        }
    }
    pthread_mutex_lock(&c->lock);
    return changed || c->arrivals != seen; /* an arrival just before the lock */
}

/* How often a waiting receive calls the host's interrupt check. */
#define INTERRUPT_SLICE_MS 100

static int before(const struct timespec *a, const struct timespec *b)
{
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

/* Called with c->lock held: when an interrupt check is set and its time
 * *next_check has come (every INTERRUPT_SLICE_MS of the receive, however
 * often arrivals for other receives wake it or it spins), calls it with
 * the lock released. -1: the check asked to stop; 1: it ran; 0: not due. */
static int check_if_due(epipe_comm *c, struct timespec *next_check)
{
    int (*check)(void *) = c->interrupt;
    if (!check)
        return 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (before(&now, next_check))
        return 0;
    void *arg = c->interrupt_arg;
    deadline_after(next_check, INTERRUPT_SLICE_MS);
    pthread_mutex_unlock(&c->lock);
    int stop = check(arg);
    pthread_mutex_lock(&c->lock);
    return stop ? -1 : 1;
}

/* Called with c->lock held: sleeps until an arrival, the deadline or, with
 * an interrupt check set, the check's next time. 1: the deadline passed. */
static int wait_for_arrival(epipe_comm *c, const struct timespec *deadline,
                            const struct timespec *next_check)
{
    const struct timespec *until = c->interrupt && before(next_check, deadline) ? next_check
                                                                                : deadline;
    return pthread_cond_timedwait(&c->arrived, &c->lock, until) == ETIMEDOUT && until == deadline;
}

int epipe_comm_recv(epipe_comm *c, unsigned peer, unsigned kind, uint64_t step,
                    uint32_t micro_batch, int64_t timeout_ms, epipe_msg **out)
{
    struct timespec deadline, next_check;
    deadline_after(&deadline, timeout_ms);
    deadline_after(&next_check, INTERRUPT_SLICE_MS);
    uint64_t spun = UINT64_MAX; /* c->arrivals when this receive last spun */
    *out = NULL;
    if (c->orphaned)
        return orphaned(c);
    if (peer >= c->size || peer == c->rank)
        return epipe_fail_into(c->msg, EPIPE_EINVAL, "rank %u: cannot receive from rank %u of %u",
                               c->rank, peer, c->size);
    pthread_mutex_lock(&c->lock);
    for (;;) {
        epipe_msg *prev = NULL;
        for (epipe_msg *m = c->inbox; m; prev = m, m = m->next) {
            if (m->hdr.src_stage != peer || m->hdr.kind != kind || m->hdr.step != step ||
                m->hdr.micro_batch != micro_batch)
                continue;
            if (prev)
                prev->next = m->next;
            else
                c->inbox = m->next;
            if (c->inbox_tail == m)
                c->inbox_tail = prev;
            pthread_mutex_unlock(&c->lock);
            m->next = NULL;
            *out = m;
            return EPIPE_OK;
        }
        int rc = EPIPE_OK, due;
        if (c->aborted && c->self_status)
            rc = epipe_fail_into(c->msg, c->self_status, "rank %u: %s", c->rank, c->self_why);
        else if (c->aborted)
            rc = epipe_fail_into(c->msg, EPIPE_EPEER, "rank %u was aborted", c->rank);
        else if (c->peer_state[peer] != EPIPE_PEER_UP)
            rc = epipe_fail_into(c->msg, c->peer_status[peer] ? c->peer_status[peer] : EPIPE_EPEER,
                                 "rank %u: rank %u %s before sending %s of step %llu, "
                                 "micro-batch %u%s%s",
                                 c->rank, peer,
                                 c->peer_state[peer] == EPIPE_PEER_LEFT ? "left" : "failed",
                                 epipe_wire_kind_name(kind), (unsigned long long)step, micro_batch,
                                 c->peer_why[peer][0] ? ": " : "", c->peer_why[peer]);
        else if ((due = check_if_due(c, &next_check)) < 0)
            rc = epipe_fail_into(c->msg, EPIPE_ECALLBACK,
                                 "rank %u: the host's interrupt check stopped the wait for %s "
                                 "from rank %u for step %llu, micro-batch %u",
                                 c->rank, epipe_wire_kind_name(kind), peer,
                                 (unsigned long long)step, micro_batch);
        else if (due)
            continue; /* the lock was let go: look again */
        /* Spin after a wake-up that brought something, not again after a
         * slice that ended with nothing new. */
        else if (__atomic_load_n(&c->spin_us, __ATOMIC_RELAXED) > 0 && c->arrivals != spun &&
                 (spun = c->arrivals, spin_for_arrival(c, &deadline)))
            continue; /* something arrived while spinning: look again */
        else if (wait_for_arrival(c, &deadline, &next_check))
            rc = epipe_fail_into(c->msg, EPIPE_ETIMEDOUT,
                                 "rank %u: no %s from rank %u for step %llu, micro-batch %u "
                                 "within %lld ms",
                                 c->rank, epipe_wire_kind_name(kind), peer,
                                 (unsigned long long)step, micro_batch, (long long)timeout_ms);
        if (rc) {
            pthread_mutex_unlock(&c->lock);
            return rc;
        }
    }
}

/* ---- public handle functions ------------------------------------------- */

EPIPE_EXPERIMENTAL int epipe_comm_set_interrupt(epipe_comm *c, int (*check)(void *arg), void *arg)
{
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_set_interrupt: comm is NULL");
    pthread_mutex_lock(&c->lock);
    c->interrupt = check;
    c->interrupt_arg = check ? arg : NULL;
    pthread_mutex_unlock(&c->lock);
    return EPIPE_OK;
}

EPIPE_API void epipe_comm_destroy(epipe_comm *c)
{
    if (!c || c->orphaned)
        return; /* a fork's child: its parent's handle, released by the parent */
    unpublish(c);
    c->ops->destroy(c);
}

/* Marks this rank aborted (with its own status and reason when status is
 * nonzero and it was not aborted yet) and wakes every receive; 1 if it was
 * not aborted before. */
static int mark_aborted(epipe_comm *c, int status, const char *why)
{
    pthread_mutex_lock(&c->lock);
    int first = !c->aborted;
    c->aborted = 1;
    if (first && status) {
        c->self_status = status;
        snprintf(c->self_why, sizeof c->self_why, "%s", why);
    }
    /* a receive spinning without the lock watches arrivals, not aborted */
    __atomic_add_fetch(&c->arrivals, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&c->arrived);
    pthread_mutex_unlock(&c->lock);
    return first;
}

EPIPE_API void epipe_comm_abort(epipe_comm *c)
{
    if (!c || c->orphaned)
        return;
    mark_aborted(c, 0, NULL);
    if (c->ops->abort)
        c->ops->abort(c);
}

void epipe_comm_fail_self(epipe_comm *c, int status, const char *why)
{
    if (!mark_aborted(c, status, why))
        return;
    epipe_log_warn((int)c->rank, "comm", "this rank cannot go on: %s", why);
    if (c->ops->abort)
        c->ops->abort(c);
}

EPIPE_API unsigned epipe_comm_rank(const epipe_comm *c)
{
    return c ? c->rank : 0;
}

EPIPE_API unsigned epipe_comm_size(const epipe_comm *c)
{
    return c ? c->size : 0;
}

EPIPE_API const char *epipe_comm_transport(const epipe_comm *c)
{
    return c ? c->ops->name : "";
}

EPIPE_API const char *epipe_comm_last_error(const epipe_comm *c)
{
    return c ? c->msg : "";
}

EPIPE_API int epipe_comm_set_param(epipe_comm *c, epipe_comm_param param, int64_t value)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_set_param: comm is NULL");
    if (c->orphaned)
        return orphaned(c);
    switch (param) {
    case EPIPE_COMM_TIMEOUT_MS:
        if (value < 1 || value > 86400000)
            return epipe_fail_into(c->msg, EPIPE_EINVAL,
                                   "EPIPE_COMM_TIMEOUT_MS = %lld is out of range 1..86400000",
                                   (long long)value);
        __atomic_store_n(&c->timeout_ms, value, __ATOMIC_RELAXED);
        return EPIPE_OK;
    case EPIPE_COMM_SPIN_US:
        if (value < 0 || value > 1000000)
            return epipe_fail_into(c->msg, EPIPE_EINVAL,
                                   "EPIPE_COMM_SPIN_US = %lld is out of range 0..1000000",
                                   (long long)value);
        __atomic_store_n(&c->spin_us, value, __ATOMIC_RELAXED);
        return EPIPE_OK;
    case EPIPE_COMM_MAX_MESSAGE:
        if (value < 4096 || value > (INT64_C(1) << 40))
            return epipe_fail_into(c->msg, EPIPE_EINVAL,
                                   "EPIPE_COMM_MAX_MESSAGE = %lld is out of range 4096..2^40",
                                   (long long)value);
        __atomic_store_n(&c->max_message, (uint64_t)value, __ATOMIC_RELAXED);
        return EPIPE_OK;
    case EPIPE_COMM_BUFFER_CACHE:
        if (value < 0 || value > (INT64_C(1) << 40))
            return epipe_fail_into(c->msg, EPIPE_EINVAL,
                                   "EPIPE_COMM_BUFFER_CACHE = %lld is out of range 0..2^40",
                                   (long long)value);
        pthread_mutex_lock(&c->lock); /* a device cache made meanwhile gets the new cap */
        epipe_msgpool *pools[2] = {c->pool, c->dev_pool};
        for (int i = 0; i < 2 && pools[i]; i++) {
            msgbuf_list l = {.n = 0};
            pthread_mutex_lock(&pools[i]->lock);
            pools[i]->cap = (uint64_t)value;
            if (pools[i]->bytes > pools[i]->cap)
                pool_drain(pools[i], &l);
            pthread_mutex_unlock(&pools[i]->lock);
            list_free(&l);
        }
        pthread_mutex_unlock(&c->lock);
        return EPIPE_OK;
    }
    return epipe_fail_into(c->msg, EPIPE_EINVAL, "unknown communicator parameter %d", (int)param);
}

EPIPE_API int epipe_comm_get_param(const epipe_comm *c, epipe_comm_param param, int64_t *value)
{
    epipe_clear_error();
    if (!c || !value)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_get_param: comm or value is NULL");
    if (c->orphaned)
        return epipe_fail(EPIPE_ESTATE, ORPHANED_FMT, c->rank);
    switch (param) {
    case EPIPE_COMM_TIMEOUT_MS:
        *value = __atomic_load_n(&c->timeout_ms, __ATOMIC_RELAXED);
        return EPIPE_OK;
    case EPIPE_COMM_SPIN_US:
        *value = __atomic_load_n(&c->spin_us, __ATOMIC_RELAXED);
        return EPIPE_OK;
    case EPIPE_COMM_MAX_MESSAGE:
        *value = (int64_t)__atomic_load_n(&c->max_message, __ATOMIC_RELAXED);
        return EPIPE_OK;
    case EPIPE_COMM_BUFFER_CACHE:
        pthread_mutex_lock(&c->pool->lock);
        *value = (int64_t)c->pool->cap;
        pthread_mutex_unlock(&c->pool->lock);
        return EPIPE_OK;
    }
    return epipe_fail(EPIPE_EINVAL, "unknown communicator parameter %d", (int)param);
}
