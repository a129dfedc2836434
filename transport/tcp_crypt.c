/* Encrypted TCP links (encrypt=1): the option's checks, the cipher both ends
 * agree on, records (libsodium AEAD) and their reading and writing. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "../lib/log.h"
#include "tcp_conn.h"

#define RECORD_DEFAULT ((size_t)256 << 10)

size_t epipe_tcp_record_size(void)
{
    const char *v = getenv("EPIPE_TCP_RECORD_BYTES");
    if (v && *v) {
        char *end;
        unsigned long long n = strtoull(v, &end, 10);
        if (!*end && n >= 1024 && n <= EPIPE_TCP_REC_MAX)
            return (size_t)n;
        epipe_log_warn(-1, "tcp", "EPIPE_TCP_RECORD_BYTES = '%s' is not in 1024..%zu; using %zu", v,
                       EPIPE_TCP_REC_MAX, RECORD_DEFAULT);
    }
    return RECORD_DEFAULT;
}

const char *epipe_tcp_cipher_name(int aes)
{
    return aes ? "AES-256-GCM" : "ChaCha20-Poly1305";
}

int epipe_tcp_link_aes(const epipe_tcp_link *l)
{
    return (l->flags_c & l->flags_s & EPIPE_TCP_HF_AES) != 0;
}

int epipe_tcp_crypt_mismatch(const epipe_tcp_opts *o, unsigned theirs, unsigned their_rank,
                             char *why, size_t cap)
{
    int them = (theirs & EPIPE_TCP_HF_ENCRYPT) != 0;
    if (them == !!o->encrypt)
        return 0;
    snprintf(why, cap,
             "rank %u runs %s encryption, this rank %s (set encrypt=1 or "
             "EPIPE_ENCRYPT=1 on every rank, or on none)",
             their_rank, them ? "with" : "without", o->encrypt ? "with" : "without");
    return 1;
}

/* Record headers are made by rec_header (below). */
int epipe_tcp_rec_len(const uint8_t h[EPIPE_TCP_REC_HDR], size_t *len)
{
    size_t n = h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16;
    if (h[3] != (uint8_t)(0xA5 ^ h[0] ^ h[1] ^ h[2]) || n == 0 || n > EPIPE_TCP_REC_MAX)
        return epipe_fail(EPIPE_EAUTH,
                          "a record header that fails its check (%02x %02x %02x %02x): "
                          "tampered with, or the peer does not encrypt",
                          h[0], h[1], h[2], h[3]);
    *len = n;
    return EPIPE_OK;
}

#ifdef EPIPE_HAVE_SODIUM
#include <sodium.h>

/* Record header: the body length in bits 0..23 (little-endian), then a
 * check byte, so that a flipped bit in a length fails at once instead of
 * making the receiver wait for bytes that never come. The tag covers the
 * header too (it is the associated data). */
static void rec_header(uint8_t h[EPIPE_TCP_REC_HDR], size_t len)
{
    h[0] = (uint8_t)len, h[1] = (uint8_t)(len >> 8), h[2] = (uint8_t)(len >> 16);
    h[3] = (uint8_t)(0xA5 ^ h[0] ^ h[1] ^ h[2]);
}

struct epipe_tcp_aead {
    crypto_aead_aes256gcm_state aes_state; /* first: 16-byte aligned */
    int aes;
    uint64_t seq;
    uint64_t rekey_every; /* records under one key */
    uint8_t key[32];
};

/* Every 2^16 records (16 GiB at 256 KiB a record) a direction moves to a new
 * key, hashed from the old one, so no key comes near AES-GCM's usage limits
 * however long a connection lives. Both ends step at the same record. */
#define REKEY_EVERY ((uint64_t)1 << 16)

static void set_key(epipe_tcp_aead *a, const uint8_t key[32])
{
    memcpy(a->key, key, sizeof a->key);
    if (a->aes)
        crypto_aead_aes256gcm_beforenm(&a->aes_state, key);
}

/* Before record seq: the next key when seq starts a new period. */
static void maybe_rekey(epipe_tcp_aead *a, uint64_t seq)
{
    if (seq == 0 || seq % a->rekey_every)
        return;
    uint8_t in[18 + 8], next[32];
    memcpy(in, "epipe-tcp-rekey-v1", 18);
    for (int i = 0; i < 8; i++)
        in[18 + i] = (uint8_t)(seq >> (8 * i));
    crypto_generichash(next, sizeof next, in, sizeof in, a->key, sizeof a->key);
    set_key(a, next);
    sodium_memzero(next, sizeof next);
}

void epipe_tcp_aead_rekey_every(epipe_tcp_aead *a, uint64_t records)
{
    a->rekey_every = records ? records : REKEY_EVERY;
}

int epipe_tcp_crypt_check(const epipe_tcp_opts *o)
{
    if (o->encrypt && !o->key_file[0])
        return epipe_fail(EPIPE_EINVAL, "tcp: encrypt=1 (or EPIPE_ENCRYPT) needs a pre-shared key: "
                                        "set key_file= or EPIPE_AUTH_KEY_FILE");
    if (o->encrypt && sodium_init() < 0)
        return epipe_fail(EPIPE_EINTERNAL, "tcp: libsodium failed to initialise");
    return EPIPE_OK;
}

unsigned epipe_tcp_crypt_flags(const epipe_tcp_opts *o)
{
    if (!o->encrypt || sodium_init() < 0)
        return o->offer_rdma ? EPIPE_TCP_HF_RDMA : 0;
    const char *force = getenv("EPIPE_TCP_CIPHER");
    int chacha = force && !strcmp(force, "chacha20-poly1305");
    return EPIPE_TCP_HF_ENCRYPT |
           (!chacha && crypto_aead_aes256gcm_is_available() ? EPIPE_TCP_HF_AES : 0);
}

epipe_tcp_aead *epipe_tcp_aead_new(const uint8_t key[32], int aes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, sizeof(epipe_tcp_aead)))
        return NULL;
    epipe_tcp_aead *a = p;
    memset(a, 0, sizeof *a);
    a->aes = aes;
    a->rekey_every = REKEY_EVERY;
    set_key(a, key);
    return a;
}

void epipe_tcp_aead_free(epipe_tcp_aead *a)
{
    if (!a)
        return;
    sodium_memzero(a, sizeof *a);
    free(a);
}

uint64_t epipe_tcp_aead_count(const epipe_tcp_aead *a)
{
    return a->seq;
}

/* The nonce: the record counter, little-endian, in 12 bytes. Each direction
 * has its own key, so a counter never repeats under a key. */
static void nonce_of(uint64_t seq, uint8_t n[12])
{
    memset(n, 0, 12);
    for (int i = 0; i < 8; i++)
        n[i] = (uint8_t)(seq >> (8 * i));
}

void epipe_tcp_seal(epipe_tcp_aead *a, uint8_t *out, const uint8_t *in, size_t len)
{
    uint8_t n[12];
    maybe_rekey(a, a->seq);
    nonce_of(a->seq++, n);
    rec_header(out, len);
    uint8_t *c = out + EPIPE_TCP_REC_HDR, *tag = c + len;
    if (a->aes)
        crypto_aead_aes256gcm_encrypt_detached_afternm(c, tag, NULL, in, len, out,
                                                       EPIPE_TCP_REC_HDR, NULL, n, &a->aes_state);
    else
        crypto_aead_chacha20poly1305_ietf_encrypt_detached(c, tag, NULL, in, len, out,
                                                           EPIPE_TCP_REC_HDR, NULL, n, a->key);
}

int epipe_tcp_open(epipe_tcp_aead *a, const uint8_t hdr[EPIPE_TCP_REC_HDR], uint8_t *body,
                   size_t len, const uint8_t tag[EPIPE_TCP_REC_TAG])
{
    uint8_t n[12];
    uint64_t seq = a->seq++;
    maybe_rekey(a, seq);
    nonce_of(seq, n);
    int rc = a->aes ? crypto_aead_aes256gcm_decrypt_detached_afternm(
                          body, NULL, body, len, tag, hdr, EPIPE_TCP_REC_HDR, n, &a->aes_state)
                    : crypto_aead_chacha20poly1305_ietf_decrypt_detached(
                          body, NULL, body, len, tag, hdr, EPIPE_TCP_REC_HDR, n, a->key);
    if (rc)
        return epipe_fail(EPIPE_EAUTH,
                          "record %llu failed its %s tag: tampered with or keys "
                          "differ",
                          (unsigned long long)seq, epipe_tcp_cipher_name(a->aes));
    return EPIPE_OK;
}

#else /* without libsodium: encrypt=1 is refused, never silently ignored */

struct epipe_tcp_aead {
    int unused;
};

int epipe_tcp_crypt_check(const epipe_tcp_opts *o)
{
    if (o->encrypt)
        return epipe_fail(EPIPE_ENOTSUP, "tcp: encrypt=1 (or EPIPE_ENCRYPT) given, but this "
                                         "libepipe was built without libsodium, so it cannot "
                                         "encrypt (install libsodium-dev and rebuild)");
    return EPIPE_OK;
}

unsigned epipe_tcp_crypt_flags(const epipe_tcp_opts *o)
{
    return o->offer_rdma ? EPIPE_TCP_HF_RDMA : 0;
}

epipe_tcp_aead *epipe_tcp_aead_new(const uint8_t key[32], int aes)
{
    return NULL;
}

void epipe_tcp_aead_free(epipe_tcp_aead *a)
{
    free(a);
}

uint64_t epipe_tcp_aead_count(const epipe_tcp_aead *a)
{
    return 0;
}

void epipe_tcp_aead_rekey_every(epipe_tcp_aead *a, uint64_t records)
{
}

void epipe_tcp_seal(epipe_tcp_aead *a, uint8_t *out, const uint8_t *in, size_t len)
{
    abort(); /* unreachable: no link encrypts without libsodium */
}

int epipe_tcp_open(epipe_tcp_aead *a, const uint8_t hdr[EPIPE_TCP_REC_HDR], uint8_t *body,
                   size_t len, const uint8_t tag[EPIPE_TCP_REC_TAG])
{
    return epipe_fail(EPIPE_ENOTSUP, "tcp: built without libsodium");
}

#endif

/* ---- records on a connection -------------------------------------------- */

/* The next record's header is in: choose where its body goes. */
static int record_begin(struct tcp *t, struct conn *k)
{
    int rc = epipe_tcp_rec_len(k->rhdr, &k->rlen);
    if (rc) {
        char detail[EPIPE_ERRMSG_MAX];
        snprintf(detail, sizeof detail, "stream %u: %s", k->stream, epipe_last_error());
        epipe_tcp_corrupt(t, k, rc, detail);
        return rc;
    }
    k->rgot = 0;
    k->rdirect = k->rx && k->rlen >= OPEN_IN_PLACE_MIN && k->rx_need - k->rx_got >= k->rlen;
    if (k->rdirect) {
        k->rdst = k->rx->data + k->hlen + k->rx_got;
        return EPIPE_OK;
    }
    if (k->rbuf_cap < k->rlen + EPIPE_TCP_REC_TAG) {
        uint8_t *b = realloc(k->rbuf, k->rlen + EPIPE_TCP_REC_TAG);
        if (!b) {
            epipe_tcp_corrupt(t, k, EPIPE_ENOMEM, "no memory for a record");
            return EPIPE_ENOMEM;
        }
        k->rbuf = b, k->rbuf_cap = k->rlen + EPIPE_TCP_REC_TAG;
    }
    k->rdst = k->rbuf;
    return EPIPE_OK;
}

/* A whole record is in: open it, and hand its bytes on. */
static void record_end(struct tcp *t, struct conn *k)
{
    const uint8_t *tag = k->rdirect ? k->rtag : k->rbuf + k->rlen;
    k->rh_got = 0;
    if (epipe_tcp_open(k->rx_aead, k->rhdr, k->rdst, k->rlen, tag)) {
        char detail[EPIPE_ERRMSG_MAX];
        snprintf(detail, sizeof detail, "stream %u: %s", k->stream, epipe_last_error());
        epipe_tcp_corrupt(t, k, EPIPE_EAUTH, detail);
        return;
    }
    if (k->rdirect)
        epipe_tcp_payload_got(t, k, k->rdst, k->rlen);
    else
        epipe_tcp_feed(t, k, k->rbuf, k->rlen);
}

/* do_read for an encrypted connection: record headers, then each body and
 * tag straight where it goes (a message's payload, opened in place, or
 * rbuf for headers and small messages). */
void epipe_tcp_read_sealed(struct tcp *t, struct conn *k)
{
    for (int round = 0; round < 64 && k->fd >= 0; round++) {
        ssize_t n;
        if (k->rh_got < EPIPE_TCP_REC_HDR) {
            n = recv(k->fd, k->rhdr + k->rh_got, EPIPE_TCP_REC_HDR - k->rh_got, MSG_DONTWAIT);
            if (n > 0) {
                k->last_rx = epipe_now_ms();
                k->rh_got += (size_t)n;
                if (k->rh_got == EPIPE_TCP_REC_HDR && record_begin(t, k))
                    return;
                continue;
            }
        } else {
            struct iovec iov[2];
            int niov = 0;
            size_t want = k->rlen + EPIPE_TCP_REC_TAG - k->rgot;
            if (!k->rdirect) {
                iov[niov++] = (struct iovec){k->rbuf + k->rgot, want};
            } else {
                if (k->rgot < k->rlen)
                    iov[niov++] = (struct iovec){k->rdst + k->rgot, k->rlen - k->rgot};
                size_t tg = k->rgot > k->rlen ? k->rgot - k->rlen : 0;
                iov[niov++] = (struct iovec){k->rtag + tg, EPIPE_TCP_REC_TAG - tg};
            }
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
            n = recvmsg(k->fd, &mh, MSG_DONTWAIT);
            if (n > 0) {
                k->last_rx = epipe_now_ms();
                k->rgot += (size_t)n;
                if ((size_t)n == want)
                    record_end(t, k);
                continue;
            }
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        epipe_tcp_read_ended(t, k, n);
        return;
    }
}

/* Seals the queue's next bytes into k->sb (written out): records of up to
 * t->record body bytes, each inside one message, small messages packed
 * together; a large message's header goes alone in its first record, so
 * the receiver opens the payload's records in place. Under txlock. */
static void seal_more(struct tcp *t, struct conn *k, epipe_msg **done)
{
    k->sb_len = k->sb_off = 0;
    const size_t hl = EPIPE_WIRE_HEADER_SIZE; /* where every sealed message's payload starts */
    while (k->txq && k->sb_cap - k->sb_len > EPIPE_TCP_REC_OVERHEAD) {
        epipe_msg *m = k->txq;
        size_t left = m->len - k->tx_off;
        size_t room = k->sb_cap - k->sb_len - EPIPE_TCP_REC_OVERHEAD;
        size_t n = left < t->record ? left : t->record;
        if (k->tx_off == 0 && left > t->record)
            n = hl;
        if (n > room && k->sb_len)
            break; /* a full record next time */
        if (n) {
            epipe_tcp_seal(k->tx_aead, k->sb + k->sb_len, m->data + k->tx_off, n);
            k->sb_len += n + EPIPE_TCP_REC_OVERHEAD;
            k->tx_off += n;
            __atomic_sub_fetch(&k->tx_queued, (uint64_t)n, __ATOMIC_RELAXED);
        }
        if (k->tx_off < m->len)
            continue;
        k->txq = m->next;
        if (!k->txq)
            k->txq_tail = NULL;
        k->tx_off = 0;
        m->next = *done, *done = m;
    }
}

/* Writes k's queue as sealed records; an errno if the connection failed. */
int epipe_tcp_write_sealed(struct tcp *t, struct conn *k, epipe_msg **done)
{
    while (k->fd >= 0) {
        if (k->sb_off == k->sb_len) {
            if (!k->txq)
                break;
            seal_more(t, k, done);
        }
        ssize_t w = send(k->fd, k->sb + k->sb_off, k->sb_len - k->sb_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0)
            return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR ? errno : 0;
        k->last_tx = epipe_now_ms();
        k->sb_off += (size_t)w;
    }
    return 0;
}
