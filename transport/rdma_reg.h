/* The rdma transport's registration cache: page-aligned memory regions,
 * reference counted, kept for reuse and dropped when their buffer is freed. */
#ifndef EPIPE_TRANSPORT_RDMA_REG_H
#define EPIPE_TRANSPORT_RDMA_REG_H

#include <pthread.h>
#include <stdint.h>

#include "rdma_verbs.h"

typedef struct epipe_rdma_reg {
    struct epipe_rdma_reg *next;
    uintptr_t lo, hi; /* page-aligned [lo, hi) */
    struct ibv_mr *mr;
    unsigned refs;
    int stale; /* its buffer was freed while in use: deregister on the last put */
} epipe_rdma_reg;

typedef struct epipe_rdma_regcache {
    struct epipe_rdma_regcache *next_cache; /* the list the free hook walks */
    pthread_mutex_t lock;
    const epipe_verbs *v;
    struct ibv_pd *pd;
    epipe_rdma_reg *list; /* most recently used first */
    unsigned count, idle, max_idle;
    uint64_t hits, misses;
} epipe_rdma_regcache;

/* A cache on pd keeping at most max_idle unreferenced regions; it joins the
 * process-wide list that message-buffer frees invalidate (lib/comm). */
void epipe_rdma_reg_init(epipe_rdma_regcache *rc, const epipe_verbs *v, struct ibv_pd *pd,
                         unsigned max_idle);
/* Deregisters everything (references still held are a bug: logged). */
void epipe_rdma_reg_fini(epipe_rdma_regcache *rc);
/* A region covering [p, p+len), local and remote write; a reference the
 * caller gives back with put. EPIPE_EIO naming the size and errno when the
 * device refuses the registration. Thread-safe. */
int epipe_rdma_reg_get(epipe_rdma_regcache *rc, const void *p, size_t len, epipe_rdma_reg **out);
void epipe_rdma_reg_put(epipe_rdma_regcache *rc, epipe_rdma_reg *r);
/* The memory [p, p+len) is being freed: regions overlapping it are
 * deregistered now (idle) or at their last put (in use). */
void epipe_rdma_reg_invalidate(epipe_rdma_regcache *rc, const void *p, size_t len);

/* Memory regions the rdma transport holds now in this process (every
 * cache and the fixed rings and slots): 0 when nothing leaked. Tests. */
long epipe_rdma_live_mrs(void);
/* Registers/deregisters a fixed region and counts it (the transport's rings). */
struct ibv_mr *epipe_rdma_mr_new(const epipe_verbs *v, struct ibv_pd *pd, void *p, size_t len,
                                 int access);
void epipe_rdma_mr_free(const epipe_verbs *v, struct ibv_mr *mr);

#endif
