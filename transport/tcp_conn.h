/* Internals of the TCP transport's data side shared by tcp.c (ops),
 * tcp_progress.c (the progress thread), tcp_crc.c and tcp_crypt.c. */
#ifndef EPIPE_TRANSPORT_TCP_CONN_H
#define EPIPE_TRANSPORT_TCP_CONN_H

#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "../lib/clock.h"
#include "tcp_impl.h"

#define STAGING (256 * 1024)    /* read buffer for headers and small messages */
#define DIRECT_MAX (256 * 1024) /* the caller writes messages up to this itself */
#define MAX_IOV 64
#define RECV_CHUNK (1024 * 1024) /* read at most this much at once, to CRC it in cache */
#define OPEN_IN_PLACE_MIN 4096   /* smaller records are opened in rbuf and copied */

struct tcp;

struct conn {
    struct tcp *t;
    int fd; /* -1 once closed; changed under txlock */
    unsigned peer, stream;

    pthread_mutex_t txlock; /* guards the fields down to close_after */
    epipe_msg *txq, *txq_tail;
    size_t tx_off;      /* bytes of txq's head already written */
    uint64_t tx_queued; /* bytes waiting, read without the lock to pick a stream */
    int64_t last_tx;
    int bye_queued, shut, close_after;

    /* Progress thread only. */
    uint8_t hbuf[EPIPE_WIRE_HEADER_MAX];
    size_t hgot, hlen;
    epipe_msg *rx;
    size_t rx_got, rx_need;
    uint32_t rx_crc; /* CRC32C of the payload bytes got so far */
    int offload;     /* the CRC helper checksums this payload */
    int64_t last_rx;
    int bye, clean;

    /* encrypt=1: records (tcp_crypt.c). tx side under txlock: sealed bytes
     * waiting in sb; rx side in the progress thread. NULL: in clear. */
    epipe_tcp_aead *tx_aead, *rx_aead;
    uint8_t *sb;
    size_t sb_len, sb_off, sb_cap;
    uint8_t rhdr[EPIPE_TCP_REC_HDR], rtag[EPIPE_TCP_REC_TAG];
    size_t rh_got, rlen, rgot; /* header bytes; body length; body and tag bytes got */
    uint8_t *rdst;             /* where the body goes: into rx, or rbuf */
    int rdirect;
    uint8_t *rbuf;
    size_t rbuf_cap;
};

/* A helper thread checksums large incoming payloads while the progress
 * thread goes on copying the next bytes out of the socket: on a receiver the
 * two costs would otherwise add up (CRC32C runs at about the speed of the
 * kernel's copy). One payload at a time; others are checksummed inline. */
#define OFFLOAD_MIN ((size_t)4 << 20)
struct crc_helper {
    pthread_t thread;
    int started, stop, busy;
    pthread_mutex_t lock;
    pthread_cond_t work, progress;
    struct conn *owner; /* NULL: free */
    const uint8_t *base;
    size_t done, avail;
    uint32_t crc;
};

struct tcp {
    epipe_comm *c;
    struct crc_helper h;
    epipe_tcp_opts o;
    struct conn *conns;
    unsigned nconns;
    unsigned *first, *count; /* [size]: peer p owns conns[first[p] .. +count[p]) */
    unsigned *rr;
    int evfd;
    pthread_t thread;
    int started;
    int stop; /* atomic */
    uint8_t *staging;
    /* the progress thread's poll set and the connection of each entry
     * ([nconns + 1]: the event fd first), made with the communicator so
     * that the thread itself allocates nothing */
    struct pollfd *pf;
    unsigned *pf_conn;
    size_t record; /* body bytes per sealed record (encrypt=1) */
    void *upper;   /* the rdma transport's state when it runs on these links */
};

/* Whether k has bytes to write (under txlock). */
static inline int epipe_tcp_tx_waiting(const struct conn *k)
{
    return k->txq != NULL || k->sb_off < k->sb_len;
}

/* ---- tcp.c: connections and sending ---- */

/* A framed message without tensor: heartbeat, bye or error; NULL when out
 * of memory. */
epipe_msg *epipe_tcp_control_msg(struct tcp *t, unsigned kind, unsigned dst, unsigned about,
                                 int status, const char *text);
/* Queues m on k and takes it; the caller's thread writes small messages
 * itself when `direct` and nothing waits before them. EPIPE_EPEER if k is
 * closed or said goodbye. */
int epipe_tcp_enqueue(struct tcp *t, struct conn *k, epipe_msg *m, int direct);
/* Closes k; with abrupt, unsent data is dropped and an RST sent. */
void epipe_tcp_conn_close(struct conn *k, int abrupt);
/* A read on k returned n <= 0 for good: the connection closed or failed. */
void epipe_tcp_read_ended(struct tcp *t, struct conn *k, ssize_t n);
/* Queues an ERROR about rank `about` to peer on its connection (best effort). */
void epipe_tcp_queue_error(struct tcp *t, unsigned peer, unsigned about, int status,
                           const char *why);

/* ---- tcp_progress.c: the progress thread ---- */

void *epipe_tcp_progress(void *arg);
/* k's peer sent something that fails a check: cut it off with status. */
void epipe_tcp_corrupt(struct tcp *t, struct conn *k, int status, const char *detail);
/* k's connection ended (EOF or error); `how` says which. */
void epipe_tcp_conn_ended(struct tcp *t, struct conn *k, const char *how);
/* Feeds n received bytes (in clear) through k's message parser. */
void epipe_tcp_feed(struct tcp *t, struct conn *k, const uint8_t *p, size_t n);
/* n payload bytes of k's message are in place at p. */
void epipe_tcp_payload_got(struct tcp *t, struct conn *k, const uint8_t *p, size_t n);

/* ---- tcp_crypt.c: records on encrypted connections ---- */

/* Reads and opens records on k (progress thread). */
void epipe_tcp_read_sealed(struct tcp *t, struct conn *k);
/* Seals and writes k's queue (under txlock); an errno if the connection
 * failed; finished messages go onto *done. */
int epipe_tcp_write_sealed(struct tcp *t, struct conn *k, epipe_msg **done);

/* ---- tcp_crc.c: the CRC helper thread ---- */

/* Hands k's payload to the helper; 0 if it is busy (then: inline). */
int epipe_tcp_offload_begin(struct tcp *t, struct conn *k);
/* n more payload bytes are in place for the helper. */
void epipe_tcp_offload_add(struct tcp *t, size_t n);
/* Waits for the helper to finish the payload; its CRC. */
uint32_t epipe_tcp_offload_end(struct tcp *t);
/* Takes the payload back before it is freed. */
void epipe_tcp_offload_cancel(struct tcp *t);
/* Stops the helper thread, if it runs, and frees its resources. */
void epipe_tcp_crc_stop(struct tcp *t);

#endif
