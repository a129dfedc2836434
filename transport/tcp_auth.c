/* Pre-shared-key authentication for TCP connections: the key file, nonces,
 * HMAC-SHA512-256 (libsodium crypto_auth) and the keys of encrypted links. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../lib/log.h"
#include "tcp_impl.h"

void epipe_tcp_link_note(epipe_tcp_link *l, int connector, const uint8_t *nonce_c,
                         const uint8_t *nonce_s, unsigned flags_c, unsigned flags_s)
{
    l->connector = connector;
    memcpy(l->nonce_c, nonce_c, EPIPE_TCP_NONCE);
    memcpy(l->nonce_s, nonce_s, EPIPE_TCP_NONCE);
    l->flags_c = flags_c;
    l->flags_s = flags_s;
}

#ifdef EPIPE_HAVE_SODIUM
#include <sodium.h>

/* A link's key for one direction: BLAKE2b keyed with the pre-shared key
 * over a label, the direction, both nonces, both ranks, the stream and the
 * crypt flags each side announced (so a tampered flag gives keys that do
 * not match, and the first record fails). Nonces are fresh per handshake,
 * so every connection, and each of its directions, gets its own key. */
static void direction_key(const epipe_tcp_key *k, const epipe_tcp_link *l, char dir,
                          uint32_t rank_c, uint32_t rank_s, uint8_t out[32])
{
    const unsigned mask = EPIPE_TCP_HF_ENCRYPT | EPIPE_TCP_HF_AES;
    uint8_t t[18 + 1 + 2 * EPIPE_TCP_NONCE + 5 * 4];
    uint8_t *p = t;
    memcpy(p, "epipe-tcp-crypt-v1", 18), p += 18;
    *p++ = (uint8_t)dir;
    memcpy(p, l->nonce_c, EPIPE_TCP_NONCE), p += EPIPE_TCP_NONCE;
    memcpy(p, l->nonce_s, EPIPE_TCP_NONCE), p += EPIPE_TCP_NONCE;
    uint32_t v[5] = {rank_c, rank_s, l->stream, l->flags_c & mask, l->flags_s & mask};
    for (int i = 0; i < 5; i++)
        for (int b = 0; b < 4; b++)
            *p++ = (uint8_t)(v[i] >> (8 * b));
    crypto_generichash(out, 32, t, sizeof t, k->key, sizeof k->key);
    sodium_memzero(t, sizeof t);
}

int epipe_tcp_link_keys(const epipe_tcp_key *k, const epipe_tcp_link *l, unsigned my_rank,
                        uint8_t tx[32], uint8_t rx[32])
{
    if (!k->on)
        return epipe_fail(EPIPE_EINVAL, "tcp: an encrypted link needs a key");
    uint32_t rank_c = l->connector ? my_rank : l->peer, rank_s = l->connector ? l->peer : my_rank;
    /* 'C': what the connector sends; 'S': what the acceptor sends. */
    direction_key(k, l, l->connector ? 'C' : 'S', rank_c, rank_s, tx);
    direction_key(k, l, l->connector ? 'S' : 'C', rank_c, rank_s, rx);
    return EPIPE_OK;
}

int epipe_tcp_key_load(epipe_tcp_key *k, const char *path)
{
    memset(k, 0, sizeof *k);
    if (sodium_init() < 0)
        return epipe_fail(EPIPE_EINTERNAL, "auth: libsodium failed to initialise");
    /* O_NONBLOCK: opening a FIFO must not wait for a writer. Only a regular
     * file of bounded size is read, so loading a key never blocks for long. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return epipe_fail(EPIPE_EIO, "auth: cannot open the key file '%s': %s", path,
                          strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return epipe_fail(EPIPE_EIO, "auth: cannot stat the key file '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return epipe_fail(EPIPE_EINVAL,
                          "auth: the key file '%s' is not a regular file (a %s); "
                          "give a file holding the key",
                          path,
                          S_ISCHR(st.st_mode)    ? "character device"
                          : S_ISFIFO(st.st_mode) ? "FIFO"
                          : S_ISDIR(st.st_mode)  ? "directory"
                          : S_ISSOCK(st.st_mode) ? "socket"
                                                 : "special file");
    }
    if (st.st_size > EPIPE_TCP_KEY_FILE_MAX) {
        close(fd);
        return epipe_fail(EPIPE_EINVAL,
                          "auth: the key file '%s' holds %lld bytes; a key file "
                          "holds at most %d",
                          path, (long long)st.st_size, EPIPE_TCP_KEY_FILE_MAX);
    }
    if (st.st_mode & 077)
        epipe_log_warn(-1, "auth",
                       "key file '%s' is readable by other users (mode %03o); "
                       "chmod 600 it",
                       path, (unsigned)(st.st_mode & 0777));
    uint8_t buf[4096];
    size_t n = 0;
    crypto_generichash_state h;
    crypto_generichash_init(&h, (const uint8_t *)"epipe-key-v1", 12, sizeof k->key);
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int e = errno;
            close(fd);
            sodium_memzero(buf, sizeof buf);
            return epipe_fail(EPIPE_EIO, "auth: cannot read the key file '%s': %s", path,
                              strerror(e));
        }
        if (r == 0)
            break;
        crypto_generichash_update(&h, buf, (size_t)r);
        n += (size_t)r;
        if (n > EPIPE_TCP_KEY_FILE_MAX) { /* it grew while read */
            close(fd);
            sodium_memzero(buf, sizeof buf);
            sodium_memzero(&h, sizeof h);
            return epipe_fail(EPIPE_EINVAL, "auth: the key file '%s' holds more than %d bytes",
                              path, EPIPE_TCP_KEY_FILE_MAX);
        }
    }
    close(fd);
    sodium_memzero(buf, sizeof buf);
    if (n < 16) {
        sodium_memzero(&h, sizeof h);
        return epipe_fail(EPIPE_EINVAL,
                          "auth: the key file '%s' holds %zu bytes; a key needs at "
                          "least 16 (head -c 32 /dev/urandom > FILE)",
                          path, n);
    }
    crypto_generichash_final(&h, k->key, sizeof k->key);
    k->on = 1;
    return EPIPE_OK;
}

void epipe_tcp_key_wipe(epipe_tcp_key *k)
{
    sodium_memzero(k, sizeof *k);
}

void epipe_tcp_random(uint8_t *buf, size_t len)
{
    if (sodium_init() < 0) { /* cannot happen after a key loaded; be safe */
        memset(buf, 0, len);
        return;
    }
    randombytes_buf(buf, len);
}

static void transcript(uint8_t *t, char role, const uint8_t *nc, const uint8_t *ns, uint32_t rc,
                       uint32_t rs, uint32_t stream)
{
    memcpy(t, "epipe-tcp-auth-v1", 17);
    t[17] = (uint8_t)role;
    memcpy(t + 18, nc, EPIPE_TCP_NONCE);
    memcpy(t + 18 + EPIPE_TCP_NONCE, ns, EPIPE_TCP_NONCE);
    uint32_t v[3] = {rc, rs, stream};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 4; b++)
            t[18 + 2 * EPIPE_TCP_NONCE + 4 * i + b] = (uint8_t)(v[i] >> (8 * b));
}

#define TRANSCRIPT (18 + 2 * EPIPE_TCP_NONCE + 12)

void epipe_tcp_mac(const epipe_tcp_key *k, char role, const uint8_t *nc, const uint8_t *ns,
                   uint32_t rc, uint32_t rs, uint32_t stream, uint8_t mac[EPIPE_TCP_MAC])
{
    uint8_t t[TRANSCRIPT];
    transcript(t, role, nc, ns, rc, rs, stream);
    crypto_auth(mac, t, sizeof t, k->key);
}

int epipe_tcp_mac_ok(const epipe_tcp_key *k, char role, const uint8_t *nc, const uint8_t *ns,
                     uint32_t rc, uint32_t rs, uint32_t stream, const uint8_t mac[EPIPE_TCP_MAC])
{
    uint8_t t[TRANSCRIPT];
    transcript(t, role, nc, ns, rc, rs, stream);
    return crypto_auth_verify(mac, t, sizeof t, k->key) == 0;
}

#else /* built without libsodium: no authentication, and never silently so */

int epipe_tcp_link_keys(const epipe_tcp_key *k, const epipe_tcp_link *l, unsigned my_rank,
                        uint8_t tx[32], uint8_t rx[32])
{
    return epipe_fail(EPIPE_ENOTSUP, "tcp: built without libsodium, so links cannot be encrypted");
}

int epipe_tcp_key_load(epipe_tcp_key *k, const char *path)
{
    memset(k, 0, sizeof *k);
    return epipe_fail(EPIPE_ENOTSUP,
                      "auth: key file '%s' given, but this libepipe was built "
                      "without libsodium, so it cannot authenticate peers "
                      "(install libsodium-dev and rebuild)",
                      path);
}

void epipe_tcp_key_wipe(epipe_tcp_key *k)
{
    memset(k, 0, sizeof *k);
}

void epipe_tcp_random(uint8_t *buf, size_t len)
{
    memset(buf, 0, len); /* nonces matter only with a key */
}

void epipe_tcp_mac(const epipe_tcp_key *k, char role, const uint8_t *nc, const uint8_t *ns,
                   uint32_t rc, uint32_t rs, uint32_t stream, uint8_t mac[EPIPE_TCP_MAC])
{
    memset(mac, 0, EPIPE_TCP_MAC);
}

int epipe_tcp_mac_ok(const epipe_tcp_key *k, char role, const uint8_t *nc, const uint8_t *ns,
                     uint32_t rc, uint32_t rs, uint32_t stream, const uint8_t mac[EPIPE_TCP_MAC])
{
    return 0;
}

#endif
