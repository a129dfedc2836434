/* The communicator core shared by every transport: framed messages, the
 * mailbox that matches them to receives, and peer-failure bookkeeping. */
#ifndef EPIPE_LIB_COMM_IMPL_H
#define EPIPE_LIB_COMM_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include <epipe/comm.h>

#include "../error.h"
#include "../wire/wire.h"

typedef struct epipe_msgpool epipe_msgpool;

/* One framed message: wire header and payload in one allocation; or,
 * between ranks of one process (epipe_comm_msg_new_device), the header in
 * data and the payload in CUDA device memory at dev. */
typedef struct epipe_msg {
    struct epipe_msg *next;
    epipe_msgpool *pool;   /* the cache its buffer returns to, or NULL */
    epipe_wire_header hdr; /* parsed on receipt; filled by the sender */
    uint8_t *data;         /* header bytes, then payload (none when dev is set) */
    size_t len;            /* bytes used in data */
    size_t cap;
    void (*release)(int device, void *p); /* frees data (NULL: free()) */
    int release_device;                   /* ... given this */
    uint8_t *dev;                         /* the payload in device memory, or NULL */
    size_t dev_cap;
    int dev_device; /* the CUDA device dev is on */
    void (*dev_release)(int device, void *p);
    epipe_msgpool *dev_pool; /* the cache dev returns to */
    /* A sender that did not wait for the work writing dev (stream-ordered,
     * see epipe/stage.h) hangs a fence on the message: the receiver's
     * stream waits for it before reading dev, and freeing the message
     * frees it with fence_free (given dev_device), which waits for it
     * first, so that dev goes back to its cache only once written. */
    void *fence;
    void (*fence_free)(int device, void *fence);
} epipe_msg;

/* A message with room for a payload of `payload_cap` bytes after the
 * header; NULL when out of memory. epipe_msg_payload() is where it goes.
 * epipe_msg_new() allocates afresh (small control messages);
 * epipe_comm_msg_new() draws large buffers from c's buffer cache, and the
 * buffer goes back to that cache when the message is freed, by whichever
 * thread or handle frees it (the cache outlives c until then). */
epipe_msg *epipe_msg_new(size_t payload_cap);
epipe_msg *epipe_comm_msg_new(epipe_comm *c, size_t payload_cap);
void epipe_msg_free(epipe_msg *m);
static inline uint8_t *epipe_msg_payload(epipe_msg *m)
{
    return m->data + EPIPE_WIRE_HEADER_SIZE;
}
/* Frames m in place: sets the payload length and CRC in m->hdr from the
 * `payload_len` bytes at epipe_msg_payload(m) and writes the header; for
 * a payload at m->dev, the length only (its CRC field stays 0: device
 * memory never crosses a wire, and the host does not read it). */
int epipe_msg_seal(epipe_msg *m, size_t payload_len);
/* The bytes m stands for on a wire: header and payload. */
static inline size_t epipe_msg_wire_len(const epipe_msg *m)
{
    return m->dev ? m->len + (size_t)m->hdr.payload_len : m->len;
}

typedef struct epipe_transport_ops {
    const char *name;
    /* Delivers a sealed message to peer; takes ownership of m in every case.
     * Must not block for long (queue it if the wire is busy). */
    int (*send)(epipe_comm *c, unsigned peer, epipe_msg *m);
    /* Leaves the group: peers see this rank gone. Frees transport state. */
    void (*destroy)(epipe_comm *c);
    /* Optional: tells peers this rank failed (epipe_comm_abort). */
    void (*abort)(epipe_comm *c);
    /* Optional: in the child of a fork(), closes the child's copies of the
     * handle's descriptors. It takes no lock and joins no thread: the
     * child has only the thread that forked, and a lock another thread
     * held stays held there. */
    void (*forked)(epipe_comm *c);
    /* Optional, for a transport whose ranks share the process (inproc):
     * the CUDA device whose payloads peer decodes in place
     * (epipe_comm_device_buffers), or -1. A transport without it is
     * never given a message with a device payload. */
    int (*peer_device)(epipe_comm *c, unsigned peer);
} epipe_transport_ops;

enum epipe_peer_state { EPIPE_PEER_UP = 0, EPIPE_PEER_LEFT = 1, EPIPE_PEER_FAILED = 2 };

/* The settings every transport shares, resolved once by
 * epipe_comm_settings_resolve() (lib/comm/create.c) in the documented
 * order: defaults < environment < options string; epipe_comm_set_param()
 * changes them later. */
typedef struct epipe_comm_settings {
    int64_t timeout_ms;      /* timeout_ms, EPIPE_TIMEOUT_MS: 30000 */
    int64_t spin_us;         /* spin_us, EPIPE_SPIN_US: 50 */
    uint64_t max_message;    /* max_message, EPIPE_MAX_MESSAGE: 2^32 */
    uint64_t buffer_cache;   /* buffer_cache, EPIPE_BUFFER_CACHE: 512 MiB */
    int64_t init_timeout_ms; /* init_timeout_ms, EPIPE_INIT_TIMEOUT_MS: 120000 */
    char trace[512];         /* trace=PATH, else EPIPE_TRACE at stage creation */
    char group[64];          /* inproc: group=NAME */
} epipe_comm_settings;

/* Fills s from defaults and the environment, then `options`; keys it does
 * not know are copied, comma-separated, into rest[restcap] for the
 * transport (init_timeout_ms too, which tcp reads itself). EPIPE_EINVAL
 * names a bad value and where it came from. */
int epipe_comm_settings_resolve(epipe_comm_settings *s, const char *options, char *rest,
                                size_t restcap);

/* Transport entry points, called by epipe_comm_create() (lib/comm/create.c). */
int epipe_inproc_join(epipe_comm **out, unsigned rank, unsigned size, const epipe_comm_settings *s);
int epipe_inproc_create_all(epipe_comm **comms, unsigned size, const epipe_comm_settings *s);
/* Ranks that have joined inproc group `name` while it is still forming;
 * 0 when no such group is forming (tests). */
unsigned epipe_inproc_pending(const char *name);
int epipe_tcp_comm_create(epipe_comm **out, unsigned rank, unsigned size, const char *master_addr,
                          unsigned master_port, const char *options, const epipe_comm_settings *s);

struct epipe_comm {
    const epipe_transport_ops *ops;
    void *tp; /* the transport's own state */
    unsigned rank, size;
    int64_t timeout_ms; /* read and written atomically */
    uint64_t max_message;
    int64_t spin_us;              /* a receive busy-waits this long before sleeping */
    epipe_msgpool *pool;          /* this handle's buffer cache */
    epipe_msgpool *dev_pool;      /* its device payload buffers, or NULL (set once) */
    int dev_device;               /* their CUDA device, or -1; atomic, set once */
    epipe_msgpool *fork_dev_pool; /* the device cache fork_prepare locked */
    char *trace;                  /* trace=PATH, or NULL */
    char msg[EPIPE_ERRMSG_MAX];
    /* The live handles of this process (epipe_comm_publish), for fork. */
    epipe_comm *live_prev, *live_next;
    int orphaned; /* this process is a fork's child: the handle is its parent's */

    pthread_mutex_t lock; /* guards everything below */
    pthread_cond_t arrived;
    epipe_msg *inbox, *inbox_tail;
    int aborted;
    int (*interrupt)(void *arg); /* epipe_comm_set_interrupt(), or NULL */
    void *interrupt_arg;
    int self_status;                    /* with self_why: this rank failed by itself
                                         (epipe_comm_fail_self); 0: aborted, or up */
    char self_why[EPIPE_ERRMSG_MAX];    /* why, without the rank ("no memory for ...") */
    uint64_t arrivals;                  /* counts deliveries and peer changes (spinners
                                    read it without the lock) */
    unsigned char *peer_state;          /* [size] enum epipe_peer_state */
    char (*peer_why)[EPIPE_ERRMSG_MAX]; /* [size] why a peer failed */
    int *peer_status;                   /* [size] what receives from a failed peer
                                    return; 0 means EPIPE_EPEER */
};

/* Adds a handle epipe_comm_create made to the live handles of the process,
 * which a fork's child gives up (epipe/comm.h, "Fork"). */
void epipe_comm_publish(epipe_comm *c);

/* Allocates the common part for a transport, with the settings s
 * (timeouts, spin, message limit, cache cap, trace) already in place: a
 * peer may deliver to the handle as soon as the transport publishes it, so
 * nothing it reads may be set later. NULL when out of memory. */
epipe_comm *epipe_comm_alloc(const epipe_transport_ops *ops, unsigned rank, unsigned size,
                             const epipe_comm_settings *s);
/* Frees the common part (queued messages included); transports call it
 * last in their destroy. */
void epipe_comm_free(epipe_comm *c);

/* Transports call these from any thread. deliver takes ownership of a
 * message whose header was parsed into m->hdr and payload checked. */
void epipe_comm_deliver(epipe_comm *c, epipe_msg *m);
void epipe_comm_peer_down(epipe_comm *c, unsigned peer, enum epipe_peer_state state,
                          const char *why);
/* The same as peer_down(FAILED), but receives from the peer return
 * `status` (EPIPE_ECHECKSUM for a corrupted message, ...) not EPIPE_EPEER. */
void epipe_comm_peer_failed(epipe_comm *c, unsigned peer, int status, const char *why);

/* This rank cannot go on because of something here, not at a peer (a
 * transport thread found no memory for a message, now lost): aborts it as
 * epipe_comm_abort() does, but its receives and sends return `status`
 * with "rank R: why", the log says why, and the transport tells the peers
 * why. The first call wins. Any thread. */
void epipe_comm_fail_self(epipe_comm *c, int status, const char *why);

/* For a transport whose data path to peer has closed or failed before
 * the control plane said why (an RDMA goodbye or error can overtake the
 * TCP message that explains it): waits up to ms for the peer to leave the
 * UP state (or this rank to be aborted), then fails the send as
 * epipe_comm_send() would, naming the peer's reason; `fallback` is the
 * message when the peer is still up after ms. Returns the status. */
int epipe_comm_send_gone(epipe_comm *c, unsigned peer, int64_t ms, const char *fallback);

/* Sends a sealed message (ownership passes, even on error). */
int epipe_comm_send(epipe_comm *c, unsigned peer, epipe_msg *m);
/* Waits up to timeout_ms for the message of `kind`, step and micro-batch
 * from peer, and hands it over. EPIPE_ETIMEDOUT, or EPIPE_EPEER if the
 * peer left or failed (or this rank was aborted) before sending it. */
int epipe_comm_recv(epipe_comm *c, unsigned peer, unsigned kind, uint64_t step,
                    uint32_t micro_batch, int64_t timeout_ms, epipe_msg **out);

/* Sets the function called with every message buffer (data, cap) just
 * before it is freed: the rdma registration cache drops what covers it. */
void epipe_msgbuf_free_hook_set(void (*fn)(void *p, size_t cap));

/* Pinned host memory for message buffers: alloc returns EPIPE_OK with a
 * buffer of `bytes` in *p, made through CUDA device `device`; release
 * frees one. Both must stay callable for as long as any communicator or
 * message may hold such a buffer. */
typedef struct epipe_msgbuf_allocator {
    int (*alloc)(int device, size_t bytes, void **p);
    void (*release)(int device, void *p); /* the device p was made through */
} epipe_msgbuf_allocator;

/* From now on, c's cache draws the buffers it may keep from `pin` through
 * CUDA device `device` (pin NULL: from malloc again), and frees those it
 * holds of the other kind. It pins at most 32 buffers and `buffer_cache`
 * bytes alive at once; a message past that, or one pin cannot serve,
 * gets a malloc'd buffer. Any thread; idempotent (the device named first
 * stays: pinned memory serves every device). */
void epipe_comm_pin_buffers(epipe_comm *c, const epipe_msgbuf_allocator *pin, int device);

/* Device memory for the payloads of messages between ranks of one
 * process: a stage on CUDA device `device` whose peers are threads of its
 * process (inproc) encodes into such a buffer and its peer decodes from
 * it, so that the payload never crosses PCIe. From now on c draws them
 * from `dev` (the same bounds as pinned buffers: 32 and `buffer_cache`
 * bytes alive at once, none under 4 KiB; past them a message gets a host
 * buffer), and its peers may send it device payloads on `device`.
 * Returns 1, or 0 where c's transport cannot carry them (tcp, rdma) or no
 * memory. Idempotent: the device named first stays. Any thread. */
int epipe_comm_device_buffers(epipe_comm *c, const epipe_msgbuf_allocator *dev, int device);
/* The CUDA device whose payloads peer decodes in place, or -1. */
int epipe_comm_peer_device(epipe_comm *c, unsigned peer);
/* A message with its header in host memory and room for a payload of
 * `payload_cap` bytes at m->dev, on CUDA device `device`: NULL where c has
 * none to give (none set up, set up on another device, past the bounds,
 * too small, out of device memory): then use epipe_comm_msg_new(). Seal
 * it with epipe_msg_seal(). */
epipe_msg *epipe_comm_msg_new_device(epipe_comm *c, int device, size_t payload_cap);

/* Buffer-cache counters of c's cache (tests, epipe-bench): buffers reused
 * and freshly allocated for epipe_comm_msg_new(), and the bytes held now. */
void epipe_comm_cache_stats(const epipe_comm *c, uint64_t *hits, uint64_t *misses, uint64_t *bytes);

#endif
