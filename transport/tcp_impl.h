/* Internals of the TCP transport shared by its files: settings, rendezvous
 * from the environment, the connection handshake and authentication. */
#ifndef EPIPE_TRANSPORT_TCP_IMPL_H
#define EPIPE_TRANSPORT_TCP_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "../lib/comm/comm_impl.h"

#define EPIPE_TCP_DEFAULT_PORT 29600 /* master port when no source gives one */
#define EPIPE_TCP_ADDR_MAX 64        /* numeric addresses and interface names */
#define EPIPE_TCP_MAX_STREAMS 8

/* Init-time settings: defaults, then EPIPE_* environment variables, then
 * the options spec ("timeout_ms=5000,streams=2"), each overriding the last. */
typedef struct epipe_tcp_opts {
    int64_t timeout_ms;                   /* receives and liveness (EPIPE_TIMEOUT_MS): 30000 */
    int64_t init_timeout_ms;              /* rendezvous (EPIPE_INIT_TIMEOUT_MS): 120000 */
    int64_t heartbeat_ms;                 /* 0: timeout/4, at most 5000 (EPIPE_HEARTBEAT_MS) */
    int64_t spin_us;                      /* receive busy-wait (EPIPE_SPIN_US): 50 */
    unsigned streams;                     /* connections per neighbour (EPIPE_TCP_STREAMS): 1 */
    int mesh;                             /* topology=mesh (EPIPE_TCP_TOPOLOGY): 0 = pipeline */
    char listen_addr[EPIPE_TCP_ADDR_MAX]; /* EPIPE_LISTEN_ADDR */
    char ifname[EPIPE_TCP_ADDR_MAX];      /* EPIPE_IFNAME */
    char key_file[512];                   /* EPIPE_AUTH_KEY_FILE */
    int encrypt;                          /* encrypt=1 (EPIPE_ENCRYPT); needs key_file */
    /* job=: which job the rank belongs to (EPIPE_JOB_ID, else torchrun's
     * TORCHELASTIC_RUN_ID, else SLURM_JOB_ID; "" when none says): a
     * rendezvous refuses a rank of another job (docs/transport.md) */
    char job[128];
    char job_source[32]; /* where job came from: "EPIPE_JOB_ID", "option job", ... */
    int offer_rdma;      /* set by the rdma transport (not an option): hellos carry HF_RDMA */
} epipe_tcp_opts;

/* Fills *o from defaults, the environment and spec (NULL or "" for none).
 * EPIPE_EINVAL naming the bad key or variable; sets the thread's error. */
int epipe_tcp_opts_parse(epipe_tcp_opts *o, const char *spec);

/* The 64-bit tag of o->job that hellos carry (a hash, never 0), or 0 when
 * no job is known: two tags that are both nonzero and differ are two jobs. */
uint64_t epipe_tcp_job_tag(const epipe_tcp_opts *o);

/* Where rank, size and master came from, as found in the environment. */
typedef struct epipe_rdv_env {
    unsigned rank, size;
    char master_addr[256];
    unsigned master_port;
    char source[64];      /* "EPIPE_RANK/EPIPE_WORLD_SIZE", "torchrun (RANK/WORLD_SIZE)", ... */
    char addr_source[96]; /* "EPIPE_MASTER_ADDR", "local host (single-node Open MPI run)", ... */
    char port_source[64]; /* "EPIPE_MASTER_PORT", "MASTER_PORT+1 (torchrun's agent ...)", ... */
} epipe_rdv_env;

/* Reads the environment in the documented order (docs/transport.md):
 * EPIPE_*, torchrun, Open MPI, PMI, Slurm. EPIPE_EINVAL with a message
 * naming the variable when none is set, one of a pair is missing, a value
 * is not a number or the rank is not below the size. */
int epipe_rdv_env_parse(epipe_rdv_env *out);

/* Slurm's first host of a node list: "node[03-05,9],gpu1" gives "node03".
 * EPIPE_EINVAL if the list cannot be read. */
int epipe_rdv_first_host(const char *nodelist, char *out, size_t cap);

/* ---- authentication (tcp_auth.c) -------------------------------------- */

#define EPIPE_TCP_NONCE 32
#define EPIPE_TCP_MAC 32

typedef struct epipe_tcp_key {
    int on;
    uint8_t key[32];
} epipe_tcp_key;

#define EPIPE_TCP_KEY_FILE_MAX 65536 /* longest key file read */

/* Loads and hashes the key file; EPIPE_ENOTSUP without libsodium, EPIPE_EIO
 * if it cannot be read, EPIPE_EINVAL if it is not a regular file, holds
 * fewer than 16 bytes or more than EPIPE_TCP_KEY_FILE_MAX. Never waits on
 * the file (a FIFO or device is refused at once). */
int epipe_tcp_key_load(epipe_tcp_key *k, const char *path);
void epipe_tcp_key_wipe(epipe_tcp_key *k);
void epipe_tcp_random(uint8_t *buf, size_t len);
/* The MAC of one side of a handshake over both nonces and both ranks. */
void epipe_tcp_mac(const epipe_tcp_key *k, char role, const uint8_t *nonce_c,
                   const uint8_t *nonce_s, uint32_t rank_c, uint32_t rank_s, uint32_t stream,
                   uint8_t mac[EPIPE_TCP_MAC]);
/* Constant-time check of a MAC made by epipe_tcp_mac: 1 if it matches. */
int epipe_tcp_mac_ok(const epipe_tcp_key *k, char role, const uint8_t *nonce_c,
                     const uint8_t *nonce_s, uint32_t rank_c, uint32_t rank_s, uint32_t stream,
                     const uint8_t mac[EPIPE_TCP_MAC]);

/* ---- connection setup (tcp_sock.c, tcp_hello.c, tcp_rdv_*.c) ---------- */

/* One established, authenticated connection to a peer, before the progress
 * thread takes it, with what its handshake agreed (for the link's keys). */
typedef struct epipe_tcp_link {
    int fd;
    unsigned peer, stream;
    int connector; /* this rank opened the connection (sent the first hello) */
    uint8_t nonce_c[EPIPE_TCP_NONCE], nonce_s[EPIPE_TCP_NONCE]; /* connector's, acceptor's */
    unsigned flags_c, flags_s; /* hello flags each side sent (EPIPE_TCP_HF_*) */
} epipe_tcp_link;

/* Records a finished handshake in l (not its fd, peer or stream). */
void epipe_tcp_link_note(epipe_tcp_link *l, int connector, const uint8_t *nonce_c,
                         const uint8_t *nonce_s, unsigned flags_c, unsigned flags_s);

/* Runs the rendezvous and connects this rank to its peers (docs/transport.md
 * says how). On success *links holds *nlinks connections, blocking, with
 * TCP_NODELAY set; the caller owns and frees the array and closes the fds.
 * Errors name the peer, address and cause: EPIPE_EIO (port in use, cannot
 * listen), EPIPE_ETIMEDOUT (master unreachable, a rank missing), EPIPE_EINVAL
 * (mismatched world size, duplicate rank), EPIPE_EVERSION, EPIPE_EAUTH,
 * EPIPE_EPEER (a rank failed during the rendezvous, as rank 0 reports). */
int epipe_tcp_setup(unsigned rank, unsigned size, const char *master_addr, unsigned master_port,
                    const epipe_tcp_opts *o, const epipe_tcp_key *key, epipe_tcp_link **links,
                    unsigned *nlinks);

/* The communicator over links from epipe_tcp_setup (sorted here): takes
 * the links (array and fds) and wipes *key in every case. create() runs
 * setup then this; the rdma transport exchanges queue-pair information on
 * the links' sockets in between. s: the common settings (epipe_comm_alloc). */
int epipe_tcp_comm_start(epipe_comm **out, unsigned rank, unsigned size, const epipe_tcp_opts *o,
                         const epipe_comm_settings *s, epipe_tcp_key *key, epipe_tcp_link *links,
                         unsigned nlinks);

/* The transport's fork hook (epipe_transport_ops.forked), which rdma's
 * shares: closes the child's copies of the handle's descriptors. */
void epipe_tcp_forked(epipe_comm *c);

/* Whether ranks a and b are joined under the topology, and how many streams. */
unsigned epipe_tcp_streams_between(const epipe_tcp_opts *o, unsigned a, unsigned b);

/* ---- encrypted links (tcp_crypt.c, keys in tcp_auth.c) ---------------- */

/* Hello flags beside tcp_setup.h's HF_AUTH (1): what a side announces. */
#define EPIPE_TCP_HF_ENCRYPT 2u /* it runs with encrypt=1 */
#define EPIPE_TCP_HF_AES 4u     /* and can run AES-256-GCM (AES-NI and PCLMUL) */
#define EPIPE_TCP_HF_RDMA 8u    /* it has an active RDMA device and runs rdma or auto */

/* A record: a 4-byte header (body length, 1 .. EPIPE_TCP_REC_MAX, and a
 * check byte), the body encrypted, a 16-byte tag over body and header. */
#define EPIPE_TCP_REC_HDR 4
#define EPIPE_TCP_REC_TAG 16
#define EPIPE_TCP_REC_MAX ((size_t)1 << 20)
#define EPIPE_TCP_REC_OVERHEAD (EPIPE_TCP_REC_HDR + EPIPE_TCP_REC_TAG)

/* One direction of one connection: its key and record counter. */
typedef struct epipe_tcp_aead epipe_tcp_aead;

/* EPIPE_OK if the options can be run: encrypt=1 needs a key (EPIPE_EINVAL)
 * and libsodium (EPIPE_ENOTSUP). */
int epipe_tcp_crypt_check(const epipe_tcp_opts *o);
/* The EPIPE_TCP_HF_* flags this rank announces under o (HF_RDMA too). */
unsigned epipe_tcp_crypt_flags(const epipe_tcp_opts *o);
/* 1 (and a message in why) if a peer announcing `theirs` cannot talk to a
 * rank running o: one side encrypts and the other does not. */
int epipe_tcp_crypt_mismatch(const epipe_tcp_opts *o, unsigned theirs, unsigned their_rank,
                             char *why, size_t cap);
/* The cipher both ends of l run: 1 for AES-256-GCM, 0 for ChaCha20-Poly1305. */
int epipe_tcp_link_aes(const epipe_tcp_link *l);
const char *epipe_tcp_cipher_name(int aes);
/* Derives l's two keys from the pre-shared key (tcp_auth.c): tx for what
 * this rank sends on it, rx for what it receives. EPIPE_ENOTSUP without
 * libsodium. The caller wipes them. */
int epipe_tcp_link_keys(const epipe_tcp_key *k, const epipe_tcp_link *l, unsigned my_rank,
                        uint8_t tx[32], uint8_t rx[32]);
/* A direction's state from its key; NULL when out of memory. */
epipe_tcp_aead *epipe_tcp_aead_new(const uint8_t key[32], int aes);
void epipe_tcp_aead_free(epipe_tcp_aead *a);
/* The next record: writes EPIPE_TCP_REC_OVERHEAD + len bytes at out (len in
 * 1 .. EPIPE_TCP_REC_MAX; in and out do not overlap). */
void epipe_tcp_seal(epipe_tcp_aead *a, uint8_t *out, const uint8_t *in, size_t len);
/* The body length a record header announces; EPIPE_EAUTH if it fails its
 * check byte or is out of range. */
int epipe_tcp_rec_len(const uint8_t hdr[EPIPE_TCP_REC_HDR], size_t *len);
/* Checks and decrypts the next record in place; EPIPE_EAUTH if its tag
 * fails (then the direction is unusable: tear the connection down). */
int epipe_tcp_open(epipe_tcp_aead *a, const uint8_t hdr[EPIPE_TCP_REC_HDR], uint8_t *body,
                   size_t len, const uint8_t tag[EPIPE_TCP_REC_TAG]);
/* Records sealed or opened so far by a. */
uint64_t epipe_tcp_aead_count(const epipe_tcp_aead *a);
/* Moves a to a new key every `records` records (0: the default, 2^16);
 * both ends of a direction must use the same. For tests. */
void epipe_tcp_aead_rekey_every(epipe_tcp_aead *a, uint64_t records);
/* The body size a sender cuts messages into: 256 KiB, or
 * EPIPE_TCP_RECORD_BYTES (1024 .. 1 MiB, for measurement). */
size_t epipe_tcp_record_size(void);

/* ---- test hooks (tcp.c) ------------------------------------------------ */

/* Queues `len` raw bytes (not framed) on the first connection to peer, and
 * shuts that connection (FIN) once they are written when close_after.
 * Tests use it to send corrupted messages and to cut a stream mid-message. */
int epipe_tcp_debug_send_raw(epipe_comm *c, unsigned peer, const void *bytes, size_t len,
                             int close_after);

/* A peer's text (an ERROR's, up to its first NUL) as one line of printable
 * ASCII in out[cap]: any other byte becomes '?', so that what a peer says,
 * before it has proved anything too, cannot forge log lines or send
 * terminal escapes into a log or an error message. Returns out. */
char *epipe_tcp_peer_text(char *out, size_t cap, const void *text, size_t len);

#endif
