/* The registration cache of the rdma transport (rdma_reg.h): lookups by
 * address range, reference counts, invalidation when a buffer is freed. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../lib/comm/comm_impl.h"
#include "../lib/error.h"
#include "../lib/log.h"
#include "rdma_reg.h"

#define ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)

static long live_mrs;
static pthread_mutex_t caches_lock = PTHREAD_MUTEX_INITIALIZER;
static epipe_rdma_regcache *caches;

long epipe_rdma_live_mrs(void)
{
    return __atomic_load_n(&live_mrs, __ATOMIC_RELAXED);
}

struct ibv_mr *epipe_rdma_mr_new(const epipe_verbs *v, struct ibv_pd *pd, void *p, size_t len,
                                 int access)
{
    struct ibv_mr *mr = v->reg_mr(pd, p, len, access);
    if (mr)
        __atomic_add_fetch(&live_mrs, 1, __ATOMIC_RELAXED);
    return mr;
}

void epipe_rdma_mr_free(const epipe_verbs *v, struct ibv_mr *mr)
{
    if (mr && v->dereg_mr(mr) == 0)
        __atomic_sub_fetch(&live_mrs, 1, __ATOMIC_RELAXED);
}

/* lib/comm calls this before a message buffer goes back to the system. */
static void buffer_freed(void *p, size_t len)
{
    pthread_mutex_lock(&caches_lock);
    for (epipe_rdma_regcache *rc = caches; rc; rc = rc->next_cache)
        epipe_rdma_reg_invalidate(rc, p, len);
    pthread_mutex_unlock(&caches_lock);
}

void epipe_rdma_reg_init(epipe_rdma_regcache *rc, const epipe_verbs *v, struct ibv_pd *pd,
                         unsigned max_idle)
{
    memset(rc, 0, sizeof *rc);
    pthread_mutex_init(&rc->lock, NULL);
    rc->v = v;
    rc->pd = pd;
    rc->max_idle = max_idle;
    pthread_mutex_lock(&caches_lock);
    rc->next_cache = caches;
    caches = rc;
    epipe_msgbuf_free_hook_set(buffer_freed);
    pthread_mutex_unlock(&caches_lock);
}

static void drop(epipe_rdma_regcache *rc, epipe_rdma_reg *r)
{
    epipe_rdma_mr_free(rc->v, r->mr);
    rc->count--;
    free(r);
}

void epipe_rdma_reg_fini(epipe_rdma_regcache *rc)
{
    pthread_mutex_lock(&caches_lock);
    for (epipe_rdma_regcache **pp = &caches; *pp; pp = &(*pp)->next_cache)
        if (*pp == rc) {
            *pp = rc->next_cache;
            break;
        }
    pthread_mutex_unlock(&caches_lock);
    for (epipe_rdma_reg *r = rc->list, *n; r; r = n) {
        n = r->next;
        if (r->refs)
            epipe_log_warn(-1, "rdma", "a registration of %zu bytes still had %u reference(s)",
                           (size_t)(r->hi - r->lo), r->refs);
        drop(rc, r);
    }
    rc->list = NULL;
    pthread_mutex_destroy(&rc->lock);
}

static uintptr_t page_size(void)
{
    static long ps;
    if (!ps)
        ps = sysconf(_SC_PAGESIZE);
    return ps > 0 ? (uintptr_t)ps : 4096;
}

int epipe_rdma_reg_get(epipe_rdma_regcache *rc, const void *p, size_t len, epipe_rdma_reg **out)
{
    uintptr_t ps = page_size(), a = (uintptr_t)p;
    uintptr_t lo = a & ~(ps - 1), hi = (a + (len ? len : 1) + ps - 1) & ~(ps - 1);
    pthread_mutex_lock(&rc->lock);
    for (epipe_rdma_reg **pp = &rc->list; *pp; pp = &(*pp)->next) {
        epipe_rdma_reg *r = *pp;
        if (!r->stale && r->lo <= lo && r->hi >= hi) {
            if (!r->refs++)
                rc->idle--;
            *pp = r->next; /* to the front */
            r->next = rc->list;
            rc->list = r;
            rc->hits++;
            pthread_mutex_unlock(&rc->lock);
            *out = r;
            return EPIPE_OK;
        }
    }
    rc->misses++;
    epipe_rdma_reg *r = calloc(1, sizeof *r);
    if (!r) {
        pthread_mutex_unlock(&rc->lock);
        return epipe_fail(EPIPE_ENOMEM, "rdma: out of memory");
    }
    errno = 0;
    r->mr = epipe_rdma_mr_new(rc->v, rc->pd, (void *)lo, hi - lo, ACCESS);
    if (!r->mr) {
        int e = errno;
        pthread_mutex_unlock(&rc->lock);
        free(r);
        return epipe_fail(EPIPE_EIO, "rdma: registering %zu bytes failed (ibv_reg_mr: %s)",
                          (size_t)(hi - lo), e ? strerror(e) : "no reason given");
    }
    r->lo = lo, r->hi = hi, r->refs = 1;
    r->next = rc->list;
    rc->list = r;
    rc->count++;
    pthread_mutex_unlock(&rc->lock);
    *out = r;
    return EPIPE_OK;
}

void epipe_rdma_reg_put(epipe_rdma_regcache *rc, epipe_rdma_reg *r)
{
    if (!r)
        return;
    pthread_mutex_lock(&rc->lock);
    if (--r->refs == 0) {
        rc->idle++;
        /* Stale regions go; so do the least recently used beyond max_idle. */
        unsigned keep = 0;
        for (epipe_rdma_reg **pp = &rc->list; *pp;) {
            epipe_rdma_reg *x = *pp;
            if (!x->refs && (x->stale || ++keep > rc->max_idle)) {
                *pp = x->next;
                rc->idle--;
                drop(rc, x);
                continue;
            }
            pp = &x->next;
        }
    }
    pthread_mutex_unlock(&rc->lock);
}

void epipe_rdma_reg_invalidate(epipe_rdma_regcache *rc, const void *p, size_t len)
{
    uintptr_t a = (uintptr_t)p, b = a + len;
    pthread_mutex_lock(&rc->lock);
    for (epipe_rdma_reg **pp = &rc->list; *pp;) {
        epipe_rdma_reg *x = *pp;
        if (x->lo < b && a < x->hi) {
            if (!x->refs) {
                *pp = x->next;
                rc->idle--;
                drop(rc, x);
                continue;
            }
            x->stale = 1;
        }
        pp = &x->next;
    }
    pthread_mutex_unlock(&rc->lock);
}
