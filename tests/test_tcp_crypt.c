/* Encrypted TCP links (encrypt=1) over loopback, ranks as threads: records,
 * keys, delivery, a bit flipped on the wire, a capture, mismatched settings. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <epipe/codec.h>
#include <epipe/comm.h>

#include "../transport/tcp_impl.h"
#include "comm/comm_impl.h"
#include "tensor.h"
#include "testutil.h"

static char key_a[64], key_b[64];

static int setup_keys(void **state)
{
    (void)state;
    unsetenv("EPIPE_ENCRYPT");
    unsetenv("EPIPE_AUTH_KEY_FILE");
    unsetenv("EPIPE_TCP_CIPHER");
    const char *text[2] = {"a pre-shared key for the crypt tests, 32+",
                           "another key, also long enough"};
    char *path[2] = {key_a, key_b};
    for (int i = 0; i < 2; i++) {
        snprintf(path[i], sizeof key_a, "/tmp/epipe-crypt-key-XXXXXX");
        int fd = mkstemp(path[i]);
        assert_true(fd >= 0);
        assert_int_equal(write(fd, text[i], strlen(text[i])), (ssize_t)strlen(text[i]));
        close(fd);
    }
    return 0;
}

static int remove_keys(void **state)
{
    (void)state;
    unlink(key_a);
    unlink(key_b);
    return 0;
}

#ifdef EPIPE_HAVE_SODIUM /* what the end-to-end tests share */
/* ---- ranks as threads ----------------------------------------------------- */

struct rank_arg {
    pthread_t th;
    unsigned rank, size, port;
    char opts[256];
    epipe_comm *c;
    int rc;
    char err[512];
};

static void *create_thread(void *p)
{
    struct rank_arg *a = p;
    a->rc = epipe_comm_create_tcp(&a->c, a->rank, a->size, "127.0.0.1", a->port, a->opts);
    snprintf(a->err, sizeof a->err, "%s", epipe_last_error());
    return NULL;
}

static void start_rank(struct rank_arg *a, unsigned rank, unsigned port, const char *opts)
{
    memset(a, 0, sizeof *a);
    a->rank = rank, a->size = 2, a->port = port;
    snprintf(a->opts, sizeof a->opts, "%s", opts);
    assert_int_equal(pthread_create(&a->th, NULL, create_thread, a), 0);
}

/* Two ranks: rank 0 listens on port0, rank 1 dials port1 (a proxy's, or port0). */
static void make_pair(epipe_comm **c, unsigned port0, unsigned port1, const char *opts0,
                      const char *opts1)
{
    struct rank_arg a[2];
    start_rank(&a[0], 0, port0, opts0);
    start_rank(&a[1], 1, port1, opts1);
    for (int r = 0; r < 2; r++) {
        pthread_join(a[r].th, NULL);
        if (a[r].rc)
            print_error("rank %d: %s\n", r, a[r].err);
        assert_int_equal(a[r].rc, EPIPE_OK);
        c[r] = a[r].c;
    }
}

/* Receives step's activation from peer: its n floats must be x's bytes. */
static void expect_msg(epipe_comm *c, unsigned peer, uint64_t step, const float *x, size_t n)
{
    epipe_msg *m;
    int rc = epipe_comm_recv(c, peer, EPIPE_WIRE_ACTIVATION, step, 0, 10000, &m);
    if (rc)
        print_error("%s\n", epipe_comm_last_error(c));
    assert_int_equal(rc, EPIPE_OK);
    assert_int_equal(m->hdr.shape[0], n);
    /* codec none: the floats follow the 16-byte codec payload header */
    assert_memory_equal(m->data + m->hdr.header_len + 16, x, n * sizeof *x);
    epipe_msg_free(m);
}

static float *random_floats(size_t n, uint64_t seed)
{
    float *x = malloc(n * sizeof *x);
    assert_non_null(x);
    test_fill(x, n, DIST_NORMAL, seed);
    return x;
}

/* ---- a proxy between rank 1 and rank 0 ---------------------------------- */

struct proxy {
    pthread_t th;
    int lfd;
    unsigned port, upstream;
    long long flip_at; /* flips bit 0x10 of this byte from rank 1 to rank 0; -1: none */
    uint8_t *cap[2];   /* what each direction carried: [0] rank 1 -> 0, [1] 0 -> 1 */
    size_t len[2], capcap[2];
    int stop; /* atomic */
};

static void record(struct proxy *p, int dir, const uint8_t *b, size_t n)
{
    if (p->len[dir] + n > p->capcap[dir]) {
        size_t c = (p->len[dir] + n) * 2;
        p->cap[dir] = realloc(p->cap[dir], c);
        assert_non_null(p->cap[dir]);
        p->capcap[dir] = c;
    }
    memcpy(p->cap[dir] + p->len[dir], b, n);
    p->len[dir] += n;
}

static int send_all(int fd, const uint8_t *b, size_t n)
{
    while (n) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        b += w, n -= (size_t)w;
    }
    return 0;
}

static void *proxy_main(void *arg)
{
    struct proxy *p = arg;
    struct pollfd pf = {.fd = p->lfd, .events = POLLIN};
    if (poll(&pf, 1, 20000) != 1)
        return NULL;
    int down = accept(p->lfd, NULL, NULL), up = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)p->upstream),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    for (int tries = 0; connect(up, (struct sockaddr *)&a, sizeof a) && tries < 200; tries++)
        usleep(20000);
    int fds[2] = {down, up}; /* direction d reads fds[d], writes fds[1 - d] */
    int open_[2] = {1, 1};
    long long seen = 0;
    static uint8_t buf[2][65536];
    while ((open_[0] || open_[1]) && !__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
        struct pollfd q[2] = {{.fd = open_[0] ? down : -1, .events = POLLIN},
                              {.fd = open_[1] ? up : -1, .events = POLLIN}};
        if (poll(q, 2, 100) <= 0)
            continue;
        for (int d = 0; d < 2; d++) {
            if (!q[d].revents)
                continue;
            ssize_t n = recv(fds[d], buf[d], sizeof buf[d], 0);
            if (n <= 0) {
                shutdown(fds[1 - d], SHUT_WR);
                open_[d] = 0;
                continue;
            }
            if (d == 0 && p->flip_at >= seen && p->flip_at < seen + n)
                buf[d][p->flip_at - seen] ^= 0x10;
            if (d == 0)
                seen += n;
            record(p, d, buf[d], (size_t)n);
            if (send_all(fds[1 - d], buf[d], (size_t)n))
                open_[d] = 0;
        }
    }
    close(down);
    close(up);
    return NULL;
}

static void proxy_start(struct proxy *p, unsigned upstream, long long flip_at)
{
    memset(p, 0, sizeof *p);
    p->upstream = upstream;
    p->flip_at = flip_at;
    p->lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(p->lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(p->lfd, 4), 0);
    getsockname(p->lfd, (struct sockaddr *)&a, &len);
    p->port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&p->th, NULL, proxy_main, p), 0);
}

static void proxy_stop(struct proxy *p)
{
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    pthread_join(p->th, NULL);
    close(p->lfd);
}

static void proxy_free(struct proxy *p)
{
    free(p->cap[0]);
    free(p->cap[1]);
}

#endif

/* ---- options and records -------------------------------------------------- */

static void test_options(void **state)
{
    (void)state;
    epipe_tcp_opts o;
    assert_int_equal(epipe_tcp_opts_parse(&o, "encrypt=1,key_file=/k"), EPIPE_OK);
    assert_int_equal(o.encrypt, 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, ""), EPIPE_OK);
    assert_int_equal(o.encrypt, 0);
    assert_int_equal(epipe_tcp_opts_parse(&o, "encrypt=yes"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "encrypt"));
    setenv("EPIPE_ENCRYPT", "1", 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, NULL), EPIPE_OK);
    assert_int_equal(o.encrypt, 1);
    assert_int_equal(epipe_tcp_opts_parse(&o, "encrypt=0"), EPIPE_OK); /* the spec wins */
    assert_int_equal(o.encrypt, 0);
    unsetenv("EPIPE_ENCRYPT");

    /* encrypt without a key: refused before any connection, naming both. */
    epipe_comm *c = NULL;
#ifdef EPIPE_HAVE_SODIUM
    assert_int_equal(epipe_comm_create_tcp(&c, 0, 2, "127.0.0.1", test_free_port(), "encrypt=1"),
                     EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "encrypt"));
    assert_non_null(strstr(epipe_last_error(), "key_file"));
    assert_non_null(strstr(epipe_last_error(), "EPIPE_AUTH_KEY_FILE"));
#else
    char opts[128];
    snprintf(opts, sizeof opts, "encrypt=1,key_file=%s", key_a);
    assert_int_equal(epipe_comm_create_tcp(&c, 0, 2, "127.0.0.1", test_free_port(), opts),
                     EPIPE_ENOTSUP);
    assert_non_null(strstr(epipe_last_error(), "libsodium"));
#endif
    assert_null(c);
}

#ifdef EPIPE_HAVE_SODIUM
static void test_records(void **state)
{
    (void)state;
    uint8_t key[32] = {7}, in[3000], out[3000 + EPIPE_TCP_REC_OVERHEAD], copy[sizeof out];
    for (size_t i = 0; i < sizeof in; i++)
        in[i] = (uint8_t)(i * 31 + 1);
    for (int aes = 0; aes < 2; aes++) {
        epipe_tcp_aead *tx = epipe_tcp_aead_new(key, aes), *rx = epipe_tcp_aead_new(key, aes);
        assert_non_null(tx);
        assert_non_null(rx);
        for (int rec = 0; rec < 3; rec++) {
            epipe_tcp_seal(tx, out, in, sizeof in);
            assert_memory_not_equal(out + EPIPE_TCP_REC_HDR, in, 64); /* not in clear */
            size_t len;
            assert_int_equal(epipe_tcp_rec_len(out, &len), EPIPE_OK);
            assert_int_equal(len, sizeof in);
            memcpy(copy, out, sizeof out);
            assert_int_equal(epipe_tcp_open(rx, copy, copy + EPIPE_TCP_REC_HDR, len,
                                            copy + EPIPE_TCP_REC_HDR + len),
                             EPIPE_OK);
            assert_memory_equal(copy + EPIPE_TCP_REC_HDR, in, sizeof in);
        }
        assert_int_equal(epipe_tcp_aead_count(tx), 3);
        /* A replayed record (the counter moved on) fails, and so does one
         * with any single bit flipped: in the body, the tag or the header. */
        memcpy(copy, out, sizeof out);
        assert_int_equal(epipe_tcp_open(rx, copy, copy + 4, sizeof in, copy + 4 + sizeof in),
                         EPIPE_EAUTH);
        assert_non_null(strstr(epipe_last_error(), "failed its"));
        size_t flips[] = {EPIPE_TCP_REC_HDR + 100, EPIPE_TCP_REC_HDR + sizeof in + 3};
        for (int f = 0; f < 2; f++) {
            epipe_tcp_aead *tx2 = epipe_tcp_aead_new(key, aes), *rx2 = epipe_tcp_aead_new(key, aes);
            epipe_tcp_seal(tx2, out, in, sizeof in);
            out[flips[f]] ^= 0x01;
            assert_int_equal(epipe_tcp_open(rx2, out, out + 4, sizeof in, out + 4 + sizeof in),
                             EPIPE_EAUTH);
            epipe_tcp_aead_free(tx2);
            epipe_tcp_aead_free(rx2);
        }
        epipe_tcp_aead_free(tx);
        epipe_tcp_aead_free(rx);
    }
    /* Keys move on every `n` records, on both ends alike: an end that does
     * not step with the other fails at the first record after the step. */
    for (int aes = 0; aes < 2; aes++) {
        epipe_tcp_aead *tx = epipe_tcp_aead_new(key, aes), *rx = epipe_tcp_aead_new(key, aes),
                       *stale = epipe_tcp_aead_new(key, aes);
        epipe_tcp_aead_rekey_every(tx, 3);
        epipe_tcp_aead_rekey_every(rx, 3);
        for (int rec = 0; rec < 8; rec++) {
            epipe_tcp_seal(tx, out, in, 100);
            memcpy(copy, out, 100 + EPIPE_TCP_REC_OVERHEAD);
            assert_int_equal(epipe_tcp_open(rx, out, out + 4, 100, out + 104), EPIPE_OK);
            assert_memory_equal(out + 4, in, 100);
            assert_int_equal(epipe_tcp_open(stale, copy, copy + 4, 100, copy + 104),
                             rec < 3 ? EPIPE_OK : EPIPE_EAUTH);
        }
        epipe_tcp_aead_free(tx);
        epipe_tcp_aead_free(rx);
        epipe_tcp_aead_free(stale);
    }
    /* A flipped bit in a record header fails its check at once. */
    uint8_t h[4] = {0x00, 0x00, 0x04, 0xA5 ^ 0x04}; /* 256 KiB */
    size_t len;
    assert_int_equal(epipe_tcp_rec_len(h, &len), EPIPE_OK);
    assert_int_equal(len, 256 * 1024);
    for (int bit = 0; bit < 32; bit++) {
        uint8_t g[4];
        memcpy(g, h, 4);
        g[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        assert_int_equal(epipe_tcp_rec_len(g, &len), EPIPE_EAUTH);
    }
    uint8_t big[4] = {0x01, 0x00, 0x10, 0xA5 ^ 0x01 ^ 0x10}; /* 1 MiB + 1: too long */
    assert_int_equal(epipe_tcp_rec_len(big, &len), EPIPE_EAUTH);
}

/* Both ends of a link derive the same two keys, each direction its own;
 * another stream, nonce or announced flag gives other keys. */
static void test_link_keys(void **state)
{
    (void)state;
    epipe_tcp_key k;
    assert_int_equal(epipe_tcp_key_load(&k, key_a), EPIPE_OK);
    uint8_t nc[EPIPE_TCP_NONCE], ns[EPIPE_TCP_NONCE];
    memset(nc, 1, sizeof nc);
    memset(ns, 2, sizeof ns);
    unsigned both = EPIPE_TCP_HF_ENCRYPT | EPIPE_TCP_HF_AES;
    epipe_tcp_link c = {.peer = 0, .stream = 1}, s = {.peer = 3, .stream = 1};
    epipe_tcp_link_note(&c, 1, nc, ns, both | 1, both | 1);
    epipe_tcp_link_note(&s, 0, nc, ns, both | 1, both | 1);
    uint8_t ctx[32], crx[32], stx[32], srx[32], x[32], y[32];
    assert_int_equal(epipe_tcp_link_keys(&k, &c, 3, ctx, crx), EPIPE_OK);
    assert_int_equal(epipe_tcp_link_keys(&k, &s, 0, stx, srx), EPIPE_OK);
    assert_memory_equal(ctx, srx, 32);
    assert_memory_equal(crx, stx, 32);
    assert_memory_not_equal(ctx, crx, 32);
    assert_int_equal(epipe_tcp_link_aes(&c), 1);
    epipe_tcp_link o = c;
    o.stream = 0;
    assert_int_equal(epipe_tcp_link_keys(&k, &o, 3, x, y), EPIPE_OK);
    assert_memory_not_equal(x, ctx, 32);
    o = c;
    o.nonce_s[5] ^= 1;
    assert_int_equal(epipe_tcp_link_keys(&k, &o, 3, x, y), EPIPE_OK);
    assert_memory_not_equal(x, ctx, 32);
    o = c;
    o.flags_s = EPIPE_TCP_HF_ENCRYPT; /* the acceptor cannot run AES: ChaCha20-Poly1305 */
    assert_int_equal(epipe_tcp_link_aes(&o), 0);
    assert_int_equal(epipe_tcp_link_keys(&k, &o, 3, x, y), EPIPE_OK);
    assert_memory_not_equal(x, ctx, 32);
    epipe_tcp_key_wipe(&k);
}

/* ---- encrypted links end to end ----------------------------------------- */

static void pipeline_with(const char *extra)
{
    char opts[256];
    snprintf(opts, sizeof opts, "timeout_ms=10000,encrypt=1,key_file=%s%s", key_a, extra);
    unsigned port = test_free_port();
    epipe_comm *c[2];
    make_pair(c, port, port, opts, opts);
    /* One float, a small message, one cut into many records, both ways. */
    size_t sizes[] = {1, 1000, 70000, (5u << 20) / 4 + 3};
    float *x[4];
    for (int i = 0; i < 4; i++) {
        x[i] = random_floats(sizes[i], 100 + (uint64_t)i);
        assert_int_equal(
            epipe_comm_send(c[0], 1, test_activation_msg(0, 1, (uint64_t)i, 0, x[i], sizes[i])),
            EPIPE_OK);
        assert_int_equal(
            epipe_comm_send(c[1], 0, test_activation_msg(1, 0, (uint64_t)i, 0, x[i], sizes[i])),
            EPIPE_OK);
    }
    for (int i = 0; i < 4; i++) {
        expect_msg(c[1], 0, (uint64_t)i, x[i], sizes[i]);
        expect_msg(c[0], 1, (uint64_t)i, x[i], sizes[i]);
    }
    /* Many small ones queued at once (packed into shared records). */
    for (int i = 0; i < 50; i++)
        assert_int_equal(
            epipe_comm_send(c[0], 1, test_activation_msg(0, 1, 100 + (uint64_t)i, 0, x[1], 1000)),
            EPIPE_OK);
    for (int i = 0; i < 50; i++)
        expect_msg(c[1], 0, 100 + (uint64_t)i, x[1], 1000);
    /* A clean goodbye is seen as one. */
    epipe_comm_destroy(c[1]);
    epipe_msg *m;
    assert_int_equal(epipe_comm_recv(c[0], 1, EPIPE_WIRE_ACTIVATION, 999, 0, 5000, &m),
                     EPIPE_EPEER);
    assert_non_null(strstr(epipe_comm_last_error(c[0]), "rank 1 left"));
    epipe_comm_destroy(c[0]);
    for (int i = 0; i < 4; i++)
        free(x[i]);
}

static void test_encrypted_pipeline(void **state)
{
    (void)state;
    pipeline_with("");
    pipeline_with(",streams=3");
    /* The other cipher, and records far smaller than the default. */
    setenv("EPIPE_TCP_CIPHER", "chacha20-poly1305", 1);
    setenv("EPIPE_TCP_RECORD_BYTES", "5000", 1);
    pipeline_with("");
    unsetenv("EPIPE_TCP_CIPHER");
    unsetenv("EPIPE_TCP_RECORD_BYTES");
}

/* A proxy flips one bit of what rank 1 sends: rank 0 refuses the record
 * with EPIPE_EAUTH, names rank 1, and drops the connection. */
static void test_tampered_bit(void **state)
{
    (void)state;
    char opts[256];
    snprintf(opts, sizeof opts, "timeout_ms=10000,encrypt=1,key_file=%s", key_a);
    unsigned port = test_free_port();
    struct proxy p;
    proxy_start(&p, port, 2000000); /* inside the 4 MiB message's records */
    epipe_comm *c[2];
    make_pair(c, port, p.port, opts, opts);
    size_t n = (4u << 20) / 4;
    float *x = random_floats(n, 9);
    assert_int_equal(epipe_comm_send(c[1], 0, test_activation_msg(1, 0, 1, 0, x, n)), EPIPE_OK);
    epipe_msg *m;
    int rc = epipe_comm_recv(c[0], 1, EPIPE_WIRE_ACTIVATION, 1, 0, 10000, &m);
    assert_int_equal(rc, EPIPE_EAUTH);
    const char *err = epipe_comm_last_error(c[0]);
    print_message("rank 0: %s\n", err);
    assert_non_null(strstr(err, "rank 1"));
    assert_non_null(strstr(err, "EPIPE_EAUTH"));
    /* The connection is gone: rank 1 learns it, and later receives fail too. */
    rc = epipe_comm_recv(c[1], 0, EPIPE_WIRE_GRADIENT, 1, 0, 10000, &m);
    assert_int_equal(rc, EPIPE_EPEER);
    assert_int_equal(epipe_comm_recv(c[0], 1, EPIPE_WIRE_ACTIVATION, 2, 0, 100, &m), EPIPE_EAUTH);
    proxy_stop(&p);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    proxy_free(&p);
    free(x);
}

static int contains(const uint8_t *hay, size_t n, const uint8_t *needle, size_t k)
{
    return n >= k && memmem(hay, n, needle, k) != NULL;
}

/* Returns whether the proxy saw the tensor's bytes in clear, either way. */
static int canary_seen(const char *extra)
{
    char opts[256];
    snprintf(opts, sizeof opts, "timeout_ms=10000,key_file=%s%s", key_a, extra);
    unsigned port = test_free_port();
    struct proxy p;
    proxy_start(&p, port, -1);
    epipe_comm *c[2];
    make_pair(c, port, p.port, opts, opts);
    /* A distinctive tensor: the same 16 bytes over and over. */
    static const char pat[17] = "EPIPE-CANARY-42!";
    size_t n = 300000;
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n * sizeof *x; i++)
        ((uint8_t *)x)[i] = (uint8_t)pat[i % 16];
    assert_int_equal(epipe_comm_send(c[1], 0, test_activation_msg(1, 0, 5, 0, x, n)), EPIPE_OK);
    assert_int_equal(epipe_comm_send(c[0], 1, test_activation_msg(0, 1, 6, 0, x, 1000)), EPIPE_OK);
    expect_msg(c[0], 1, 5, x, n);
    expect_msg(c[1], 0, 6, x, 1000);
    epipe_comm_destroy(c[1]);
    epipe_comm_destroy(c[0]);
    proxy_stop(&p);
    uint8_t needle[64];
    for (size_t i = 0; i < sizeof needle; i++)
        needle[i] = (uint8_t)pat[i % 16];
    assert_true(p.len[0] > n * sizeof *x); /* it carried the tensor */
    int seen = contains(p.cap[0], p.len[0], needle, sizeof needle) ||
               contains(p.cap[1], p.len[1], needle, sizeof needle);
    proxy_free(&p);
    free(x);
    return seen;
}

static void test_capture_shows_no_tensor(void **state)
{
    (void)state;
    assert_true(canary_seen(""));            /* in clear: the search finds it */
    assert_false(canary_seen(",encrypt=1")); /* encrypted: nowhere in the capture */
}

/* One rank encrypts and the other does not: both fail at init, and say so. */
static void test_mismatch(void **state)
{
    (void)state;
    char on[256], off[256];
    snprintf(on, sizeof on, "init_timeout_ms=1500,encrypt=1,key_file=%s", key_a);
    snprintf(off, sizeof off, "init_timeout_ms=1500,key_file=%s", key_a);
    for (int which = 0; which < 2; which++) {
        unsigned port = test_free_port();
        struct rank_arg a[2];
        start_rank(&a[0], 0, port, which ? off : on);
        start_rank(&a[1], 1, port, which ? on : off);
        pthread_join(a[0].th, NULL);
        pthread_join(a[1].th, NULL);
        print_message("rank 0: %s\nrank 1: %s\n", a[0].err, a[1].err);
        assert_int_equal(a[1].rc, EPIPE_EINVAL);
        assert_non_null(strstr(a[1].err, "encrypt"));
        assert_int_not_equal(a[0].rc, EPIPE_OK);
        assert_non_null(strstr(a[0].err, "encrypt"));
        assert_null(a[0].c);
        assert_null(a[1].c);
    }
    /* Encrypted with different keys: refused by the key check, as before. */
    snprintf(off, sizeof off, "init_timeout_ms=1500,encrypt=1,key_file=%s", key_b);
    unsigned port = test_free_port();
    struct rank_arg a[2];
    start_rank(&a[0], 0, port, on);
    start_rank(&a[1], 1, port, off);
    pthread_join(a[0].th, NULL);
    pthread_join(a[1].th, NULL);
    assert_int_equal(a[1].rc, EPIPE_EAUTH);
    assert_int_not_equal(a[0].rc, EPIPE_OK);
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_options),
#ifdef EPIPE_HAVE_SODIUM
        cmocka_unit_test(test_records),
        cmocka_unit_test(test_link_keys),
        cmocka_unit_test(test_encrypted_pipeline),
        cmocka_unit_test(test_tampered_bit),
        cmocka_unit_test(test_capture_shows_no_tensor),
        cmocka_unit_test(test_mismatch),
#endif
    };
    return cmocka_run_group_tests(tests, setup_keys, remove_keys);
}
