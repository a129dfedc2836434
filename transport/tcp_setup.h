/* Internals of TCP connection setup shared by its files: sockets (tcp_sock.c),
 * hello and handshake (tcp_hello.c), the rendezvous server and client. */
#ifndef EPIPE_TRANSPORT_TCP_SETUP_H
#define EPIPE_TRANSPORT_TCP_SETUP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "../lib/clock.h"
#include "../lib/log.h"
#include "../lib/tensor.h"
#include "tcp_impl.h"

/* ---- the HELLO payload (docs/transport.md): 160 bytes, little-endian ---- */

#define HELLO_MAGIC "EPTH"
#define HELLO_VERSION 3
#define HELLO_SIZE 160
#define TABLE_ENTRY 72
/* The most an unauthenticated peer can make this rank allocate for one
 * message: a hello or a refusal's text. Only the rank table, read from rank 0
 * on the connection this rank opened and authenticated, may be larger. */
#define HS_MAX_UNAUTH 1024
#define MAX_PENDING 128 /* connections in the middle of a handshake, at most */

enum { HT_REGISTER = 1, HT_CONNECT, HT_CHALLENGE, HT_PROOF, HT_WELCOME, HT_TABLE, HT_READY, HT_GO };
#define HF_AUTH 1u

struct epipe_tcp_hello {
    uint8_t type, flags;
    uint32_t rank, size, stream;
    uint16_t port;
    char addr[EPIPE_TCP_ADDR_MAX];
    uint8_t nonce[EPIPE_TCP_NONCE], mac[EPIPE_TCP_MAC];
    uint64_t job; /* the sender's job tag (epipe_tcp_job_tag()), 0: none known */
};

/* Writes the HELLO_SIZE bytes of h to p. */
void epipe_tcp_hello_encode(const struct epipe_tcp_hello *h, uint8_t *p);
/* Reads a hello from len bytes (at least HELLO_SIZE; more for a table):
 * EPIPE_EPROTO (short, bad magic, unknown type) or EPIPE_EVERSION. */
int epipe_tcp_hello_decode(const uint8_t *p, size_t len, struct epipe_tcp_hello *h);
/* Little-endian 16-bit fields of the hello and the table (lib/tensor.h has
 * the 32- and 64-bit ones). */
static inline unsigned epipe_tcp_get_u16(const uint8_t *p)
{
    return p[0] | (unsigned)p[1] << 8;
}
static inline void epipe_tcp_put_u16(uint8_t *p, unsigned v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8);
}

/* Prefixes the calling thread's last error: "prefix: previous message". */
__attribute__((format(printf, 2, 3))) int epipe_tcp_refail(int status, const char *fmt, ...);

/* ---- framed messages during setup (tcp_hello.c) ------------------------ */

/* Reads one whole message, byte-exact (nothing past it leaves the socket). */
struct epipe_tcp_reader {
    uint8_t hdr[EPIPE_WIRE_HEADER_MAX];
    size_t got, hlen;
    epipe_wire_header h;
    uint8_t *payload;
    size_t pgot;
    int have_header;
    uint64_t limit; /* largest payload accepted, 0: HS_MAX_UNAUTH (kept by reset) */
};

void epipe_tcp_reader_reset(struct epipe_tcp_reader *r);
/* 1: a message is complete in r; 0: would block; < 0: error (set). */
int epipe_tcp_reader_step(int fd, struct epipe_tcp_reader *r);
/* As reader_step, waiting until the deadline (EPIPE_ETIMEDOUT). */
int epipe_tcp_reader_wait(int fd, struct epipe_tcp_reader *r, int64_t deadline);
int epipe_tcp_send_msg(int fd, unsigned kind, unsigned src, unsigned dst, uint32_t mb,
                       uint64_t step, const void *payload, size_t len, int64_t deadline);
int epipe_tcp_send_hello(int fd, const struct epipe_tcp_hello *h, unsigned src, unsigned dst,
                         int64_t deadline);
/* ERROR messages carry the status (as a positive number) in `step` and the
 * rank the error is about in `micro_batch`; the payload is the text (at
 * most EPIPE_ERRMSG_MAX bytes). Best effort, within a second. */
void epipe_tcp_send_error(int fd, unsigned src, unsigned dst, unsigned about, int status,
                          const char *text);
/* Turns a received ERROR into a status and a message naming `who`. */
int epipe_tcp_error_from(const struct epipe_tcp_reader *r, const char *who);

/* ---- one rank's setup -------------------------------------------------- */

struct epipe_tcp_rdv {
    unsigned rank, size;
    const epipe_tcp_opts *o;
    const epipe_tcp_key *key;
    int64_t deadline;
    char my_addr[EPIPE_TCP_ADDR_MAX];
    unsigned my_port;
    epipe_tcp_link *links;
    unsigned nlinks, links_cap;
    uint8_t *have;                 /* [size] bit s: stream s of that peer is connected */
    char last_refusal[200];        /* the last connection the acceptor refused, for timeouts */
    uint64_t refused;              /* connections refused: the first REFUSALS_LOGGED are warned */
    int ctl;                       /* ranks > 0, after the table: the connection to rank 0 */
    struct epipe_tcp_reader ctl_r; /* what rank 0 says on it before GO: an ERROR, or GO */
    int go;                        /* rank 0 said GO */
    int ctl_heard;                 /* rank 0 said the rendezvous failed, or closed */
    epipe_tcp_link hs;             /* the last finished handshake, which add_link records
                               (nonces and flags: the link's keys come from them) */
};

/* One accepted connection in the middle of its handshake. */
struct epipe_tcp_pending {
    int fd;
    int phase;    /* 0: wants HELLO; 1: wants PROOF */
    uint64_t seq; /* arrival order */
    struct epipe_tcp_reader r;
    struct epipe_tcp_hello hi; /* its first hello */
    uint8_t nonce_s[EPIPE_TCP_NONCE];
    char from[80];
};

struct epipe_tcp_registry; /* rank 0's (tcp_rdv_server.c) */

/* ---- sockets (tcp_sock.c) ---------------------------------------------- */

/* Milliseconds to the deadline, clamped to 0..1000000 for poll. */
int epipe_tcp_left_ms(int64_t deadline);
void epipe_tcp_sock_text(const struct sockaddr *sa, char *buf, size_t cap);
void epipe_tcp_host_only(const struct sockaddr *sa, char *buf, size_t cap);
int epipe_tcp_resolve(const char *host, unsigned port, int passive, struct sockaddr_storage *out,
                      socklen_t *len);
int epipe_tcp_is_loopback(const struct sockaddr_storage *ss);
/* A non-blocking listening socket on host:port (host NULL: every address of
 * family); the port it got and its "address:port" text. */
int epipe_tcp_open_listener(const char *host, unsigned port, int family, int *fd_out,
                            unsigned *port_out, char *where, size_t where_cap);
/* TCP_NODELAY, non-blocking, a send buffer of at least 4 MiB. */
void epipe_tcp_tune(int fd);
/* Connects to host:port, retrying while nobody listens yet, until deadline;
 * between tries it listens to rank 0 (epipe_tcp_pause_ms). */
int epipe_tcp_connect_retry(struct epipe_tcp_rdv *s, const char *host, unsigned port,
                            int64_t deadline, int *fd_out, const char *who);
/* The address to listen on from listen_addr or ifname; *chosen 0: neither. */
int epipe_tcp_choose_addr(const epipe_tcp_opts *o, char *out, size_t cap, int *chosen);

/* ---- handshakes (tcp_hello.c) ------------------------------------------ */

/* Connector: HELLO, then CHALLENGE, PROOF, WELCOME. `who` names the peer.
 * *dropped is set when the acceptor closed the connection unanswered. */
int epipe_tcp_client_handshake(struct epipe_tcp_rdv *s, int fd, unsigned type, unsigned peer,
                               unsigned stream, const char *who, int *dropped);
/* Acceptor: advances p's handshake. 0: go on; 1: refused (closed); 2: the
 * peer proved the key (or none is used): p->hi is its first hello, now to
 * be believed, and the WELCOME is the caller's to send. */
int epipe_tcp_accept_step(struct epipe_tcp_rdv *s, struct epipe_tcp_pending *p);
/* Refusals logged as warnings in one rendezvous; the rest at debug level,
 * with their count at the end (a flood must not flood the log). */
#define REFUSALS_LOGGED 10
/* Logs why p is refused, tells it (status != 0) and closes it. */
void epipe_tcp_refuse(struct epipe_tcp_rdv *s, struct epipe_tcp_pending *p, int status,
                      const char *why);

/* ---- the rendezvous (tcp_rdv_server.c, tcp_rdv_client.c) ---------------- */

/* Accepts connections until every expected one has arrived; rank 0 (g not
 * NULL) also registers ranks, sends the table, collects every READY and
 * sends GO. Ranks > 0 listen to rank 0 meanwhile (s->ctl). */
int epipe_tcp_accept_loop(struct epipe_tcp_rdv *s, struct epipe_tcp_registry *g, int lfd);
/* Rank 0's whole setup. */
int epipe_tcp_setup_rank0(struct epipe_tcp_rdv *s, const char *master_addr, unsigned master_port);
int epipe_tcp_add_link(struct epipe_tcp_rdv *s, int fd, unsigned peer, unsigned stream);
/* Reads what rank 0 has sent on the control connection, if anything:
 * before GO it sends only GO or an ERROR (a rank failed in the rendezvous).
 * 0: nothing (yet) or GO; < 0: the rendezvous failed (error set). */
int epipe_tcp_ctl_step(struct epipe_tcp_rdv *s);
/* Sleeps ms, or less if rank 0 says the rendezvous failed (< 0). */
int epipe_tcp_pause_ms(struct epipe_tcp_rdv *s, int ms);

#endif
