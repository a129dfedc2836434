/* TCP connection setup, hello and handshake: the HELLO payload's encoding,
 * framed setup messages, and the challenge-response both sides run. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tcp_setup.h"

void epipe_tcp_hello_encode(const struct epipe_tcp_hello *h, uint8_t *p)
{
    memset(p, 0, HELLO_SIZE);
    memcpy(p, HELLO_MAGIC, 4);
    p[4] = h->type;
    p[5] = h->flags;
    epipe_tcp_put_u16(p + 6, HELLO_VERSION);
    epipe_put_u32(p + 8, h->rank);
    epipe_put_u32(p + 12, h->size);
    epipe_put_u32(p + 16, h->stream);
    epipe_tcp_put_u16(p + 20, h->port);
    memcpy(p + 24, h->addr, strnlen(h->addr, EPIPE_TCP_ADDR_MAX - 1));
    memcpy(p + 88, h->nonce, EPIPE_TCP_NONCE);
    memcpy(p + 120, h->mac, EPIPE_TCP_MAC);
    epipe_put_u64(p + 152, h->job);
}

/* A byte that may go into a log line or a name as it is: printable ASCII. */
static int is_text(unsigned char b)
{
    return b >= 0x20 && b < 0x7f;
}

int epipe_tcp_hello_decode(const uint8_t *p, size_t len, struct epipe_tcp_hello *h)
{
    memset(h, 0, sizeof *h);
    if (len < HELLO_SIZE)
        return epipe_fail(EPIPE_EPROTO, "hello payload is %zu bytes, fewer than %d", len,
                          HELLO_SIZE);
    if (memcmp(p, HELLO_MAGIC, 4))
        return epipe_fail(EPIPE_EPROTO, "hello payload has a bad magic");
    if (epipe_tcp_get_u16(p + 6) != HELLO_VERSION)
        return epipe_fail(EPIPE_EVERSION, "hello version %u; this library speaks %d",
                          epipe_tcp_get_u16(p + 6), HELLO_VERSION);
    h->type = p[4];
    h->flags = p[5];
    h->rank = epipe_get_u32(p + 8);
    h->size = epipe_get_u32(p + 12);
    h->stream = epipe_get_u32(p + 16);
    h->port = (uint16_t)epipe_tcp_get_u16(p + 20);
    memcpy(h->addr, p + 24, EPIPE_TCP_ADDR_MAX - 1);
    h->addr[EPIPE_TCP_ADDR_MAX - 1] = 0;
    for (const char *a = h->addr; *a; a++) /* logged, and resolved: text only */
        if (!is_text((unsigned char)*a))
            return epipe_fail(EPIPE_EPROTO, "hello address has a byte that is not text (0x%02x)",
                              (unsigned char)*a);
    memcpy(h->nonce, p + 88, EPIPE_TCP_NONCE);
    memcpy(h->mac, p + 120, EPIPE_TCP_MAC);
    h->job = epipe_get_u64(p + 152);
    if (h->type < HT_REGISTER || h->type > HT_GO)
        return epipe_fail(EPIPE_EPROTO, "hello type %u is unknown", h->type);
    return EPIPE_OK;
}

/* Prefixes the calling thread's last error: "prefix: previous message". */
int epipe_tcp_refail(int status, const char *fmt, ...)
{
    char old[EPIPE_ERRMSG_MAX], pre[EPIPE_ERRMSG_MAX];
    snprintf(old, sizeof old, "%s", epipe_last_error());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    return epipe_fail(status, "%s: %s", pre, old);
}

void epipe_tcp_reader_reset(struct epipe_tcp_reader *r)
{
    free(r->payload);
    r->payload = NULL;
    r->got = r->hlen = r->pgot = 0;
    r->have_header = 0;
}

/* 1: a message is complete in r; 0: would block; < 0: error (set). */
int epipe_tcp_reader_step(int fd, struct epipe_tcp_reader *r)
{
    for (;;) {
        uint8_t *dst;
        size_t want;
        if (!r->have_header) {
            want = (r->hlen ? r->hlen : EPIPE_WIRE_PREFIX_SIZE) - r->got;
            dst = r->hdr + r->got;
        } else {
            want = (size_t)r->h.payload_len - r->pgot;
            dst = r->payload + r->pgot;
        }
        if (want == 0 && r->have_header)
            return 1;
        ssize_t n = recv(fd, dst, want, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (n < 0)
            return epipe_fail(EPIPE_EPEER, "connection error: %s", strerror(errno));
        if (n == 0)
            return epipe_fail(EPIPE_EPEER, "the other side closed the connection%s",
                              r->got || r->have_header ? " in the middle of a message" : "");
        if (r->have_header) {
            r->pgot += (size_t)n;
        } else {
            r->got += (size_t)n;
            int rc;
            if (!r->hlen && r->got == EPIPE_WIRE_PREFIX_SIZE &&
                (rc = epipe_wire_header_length(r->hdr, r->got, &r->hlen)))
                return rc;
            if (r->hlen && r->got == r->hlen) {
                epipe_wire_limits lim = {.max_payload = r->limit ? r->limit : HS_MAX_UNAUTH};
                if ((rc = epipe_wire_parse_header(r->hdr, r->got, &lim, &r->h)))
                    return rc;
                if (r->h.kind != EPIPE_WIRE_HELLO && r->h.kind != EPIPE_WIRE_ERROR)
                    return epipe_fail(EPIPE_EPROTO, "a %s message before the connection was set up",
                                      epipe_wire_kind_name(r->h.kind));
                r->payload = malloc(r->h.payload_len ? (size_t)r->h.payload_len : 1);
                if (!r->payload)
                    return epipe_fail(EPIPE_ENOMEM, "out of memory");
                r->have_header = 1;
            }
        }
        if (r->have_header && r->pgot == r->h.payload_len) {
            int rc = epipe_wire_check_payload(&r->h, r->payload, r->pgot);
            return rc ? rc : 1;
        }
    }
}

int epipe_tcp_reader_wait(int fd, struct epipe_tcp_reader *r, int64_t deadline)
{
    for (;;) {
        int rc = epipe_tcp_reader_step(fd, r);
        if (rc)
            return rc;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int n = poll(&p, 1, epipe_tcp_left_ms(deadline));
        if (n == 0)
            return epipe_fail(EPIPE_ETIMEDOUT, "no answer within the init timeout");
        if (n < 0 && errno != EINTR)
            return epipe_fail(EPIPE_EIO, "poll: %s", strerror(errno));
    }
}

static int write_all(int fd, const uint8_t *p, size_t len, int64_t deadline)
{
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n, len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return epipe_fail(EPIPE_EPEER, "send failed: %s", strerror(errno));
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        if (poll(&pf, 1, epipe_tcp_left_ms(deadline)) == 0)
            return epipe_fail(EPIPE_ETIMEDOUT, "send did not finish within the init timeout");
    }
    return EPIPE_OK;
}

int epipe_tcp_send_msg(int fd, unsigned kind, unsigned src, unsigned dst, uint32_t mb,
                       uint64_t step, const void *payload, size_t len, int64_t deadline)
{
    epipe_wire_header h;
    memset(&h, 0, sizeof h);
    h.kind = (uint8_t)kind;
    h.src_stage = src, h.dst_stage = dst, h.micro_batch = mb, h.step = step;
    size_t cap = epipe_wire_message_size(len), used;
    uint8_t *buf = malloc(cap);
    if (!buf)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    int rc = epipe_wire_frame(&h, payload, len, buf, cap, &used);
    if (rc == EPIPE_OK)
        rc = write_all(fd, buf, used, deadline);
    free(buf);
    return rc;
}

int epipe_tcp_send_hello(int fd, const struct epipe_tcp_hello *h, unsigned src, unsigned dst,
                         int64_t deadline)
{
    uint8_t p[HELLO_SIZE];
    epipe_tcp_hello_encode(h, p);
    return epipe_tcp_send_msg(fd, EPIPE_WIRE_HELLO, src, dst, 0, 0, p, sizeof p, deadline);
}

/* ERROR messages carry the status (as a positive number) in `step` and the
 * rank the error is about in `micro_batch`; the payload is the text. */
void epipe_tcp_send_error(int fd, unsigned src, unsigned dst, unsigned about, int status,
                          const char *text)
{
    size_t len = strnlen(text, EPIPE_ERRMSG_MAX);
    epipe_tcp_send_msg(fd, EPIPE_WIRE_ERROR, src, dst, about, (uint64_t)(-status), text, len,
                       epipe_now_ms() + 1000);
}

char *epipe_tcp_peer_text(char *out, size_t cap, const void *text, size_t len)
{
    const unsigned char *p = text;
    size_t n = 0;
    for (size_t i = 0; cap && i < len && n + 1 < cap && p[i]; i++)
        out[n++] = is_text(p[i]) ? (char)p[i] : '?';
    if (cap)
        out[n] = 0;
    return out;
}

/* Turns a received ERROR into a status and a message. */
int epipe_tcp_error_from(const struct epipe_tcp_reader *r, const char *who)
{
    int status = -(int)r->h.step;
    if (status > -1 || status < -64)
        status = EPIPE_EPEER;
    char said[200];
    return epipe_fail(status, "%s refused this rank: %s", who,
                      epipe_tcp_peer_text(said, sizeof said, r->payload, r->h.payload_len));
}

/* Connector: HELLO, then CHALLENGE, PROOF, WELCOME. `who` names the peer.
 * *dropped is set when the acceptor closed the connection unanswered. */
int epipe_tcp_client_handshake(struct epipe_tcp_rdv *s, int fd, unsigned type, unsigned peer,
                               unsigned stream, const char *who, int *dropped)
{
    struct epipe_tcp_hello me = {.type = (uint8_t)type,
                                 .flags = (s->key->on ? HF_AUTH : 0) | epipe_tcp_crypt_flags(s->o),
                                 .rank = s->rank,
                                 .size = s->size,
                                 .stream = stream,
                                 .port = (uint16_t)s->my_port,
                                 .job = epipe_tcp_job_tag(s->o)};
    snprintf(me.addr, sizeof me.addr, "%s", s->my_addr);
    epipe_tcp_random(me.nonce, sizeof me.nonce);
    struct epipe_tcp_reader r = {0};
    struct epipe_tcp_hello ch;
    int rc = epipe_tcp_send_hello(fd, &me, s->rank, peer, s->deadline);
    if (rc == EPIPE_OK)
        rc = epipe_tcp_reader_wait(fd, &r, s->deadline);
    if (rc < 0) {
        *dropped = rc == EPIPE_EPEER;
        goto out;
    }
    if (r.h.kind == EPIPE_WIRE_ERROR) {
        rc = epipe_tcp_error_from(&r, who);
        goto out;
    }
    if ((rc = epipe_tcp_hello_decode(r.payload, r.h.payload_len, &ch)))
        goto out;
    if (ch.type != HT_CHALLENGE) {
        rc = epipe_fail(EPIPE_EPROTO, "expected a challenge, got hello type %u", ch.type);
        goto out;
    }
    if (ch.rank != peer) {
        rc = epipe_fail(EPIPE_EINVAL,
                        "%s answers as rank %u of %u, but this rank expects rank %u "
                        "of %u",
                        who, ch.rank, ch.size, peer, s->size);
        goto out;
    }
    struct epipe_tcp_hello proof = {
        .type = HT_PROOF, .flags = me.flags, .rank = s->rank, .size = s->size, .stream = stream};
    if (s->key->on) {
        if (!(ch.flags & HF_AUTH) ||
            !epipe_tcp_mac_ok(s->key, 'S', me.nonce, ch.nonce, s->rank, peer, stream, ch.mac)) {
            rc = epipe_fail(EPIPE_EAUTH, "%s %s", who,
                            ch.flags & HF_AUTH ? "failed to prove it holds this rank's key "
                                                 "(the key files differ)"
                                               : "runs without a key, but this rank has one");
            char text[EPIPE_ERRMSG_MAX];
            snprintf(text, sizeof text, "%s", epipe_last_error());
            epipe_tcp_send_error(fd, s->rank, peer, s->rank, EPIPE_EAUTH, text);
            epipe_fail(EPIPE_EAUTH, "%s", text);
            goto out;
        }
        epipe_tcp_mac(s->key, 'C', me.nonce, ch.nonce, s->rank, peer, stream, proof.mac);
    }
    if (ch.job && me.job && ch.job != me.job) { /* before the world size: it explains that */
        rc = epipe_fail(EPIPE_EINVAL,
                        "%s is from another job (tag %016llx; this rank's %016llx, from %s): two "
                        "jobs on one master port need their own EPIPE_MASTER_PORT; one job "
                        "launched in parts, one EPIPE_JOB_ID on every rank",
                        who, (unsigned long long)ch.job, (unsigned long long)me.job,
                        s->o->job_source);
        char text[EPIPE_ERRMSG_MAX];
        snprintf(text, sizeof text, "%s", epipe_last_error());
        epipe_tcp_send_error(fd, s->rank, peer, s->rank, EPIPE_EINVAL, text);
        epipe_fail(EPIPE_EINVAL, "%s", text);
        goto out;
    }
    char cw[160]; /* both sides encrypt, or neither; the keys come from this handshake */
    if (epipe_tcp_crypt_mismatch(s->o, ch.flags, peer, cw, sizeof cw)) {
        rc = epipe_fail(EPIPE_EINVAL, "%s: %s", who, cw);
        goto out;
    }
    epipe_tcp_link_note(&s->hs, 1, me.nonce, ch.nonce, me.flags, ch.flags);
    epipe_tcp_reader_reset(&r);
    if ((rc = epipe_tcp_send_hello(fd, &proof, s->rank, peer, s->deadline)) == EPIPE_OK &&
        ch.size != s->size) { /* after the proof, so the acceptor trusts our word and fails too */
        rc = epipe_fail(EPIPE_EINVAL,
                        "mismatched world size: %s has %u ranks, this rank (rank %u) "
                        "has %u",
                        who, ch.size, s->rank, s->size);
        goto out;
    }
    if (rc || (rc = epipe_tcp_reader_wait(fd, &r, s->deadline)) < 0) {
        *dropped = rc == EPIPE_EPEER;
        goto out;
    }
    if (r.h.kind == EPIPE_WIRE_ERROR) {
        rc = epipe_tcp_error_from(&r, who);
        goto out;
    }
    struct epipe_tcp_hello w;
    if ((rc = epipe_tcp_hello_decode(r.payload, r.h.payload_len, &w)))
        goto out;
    rc = w.type == HT_WELCOME
             ? EPIPE_OK
             : epipe_fail(EPIPE_EPROTO, "expected a welcome, got hello type %u", w.type);
out:
    epipe_tcp_reader_reset(&r);
    if (rc > 0)
        rc = EPIPE_OK;
    if (rc && !strstr(epipe_last_error(), who))
        rc = epipe_tcp_refail(rc, "handshake with %s", who);
    return rc;
}

void epipe_tcp_refuse(struct epipe_tcp_rdv *s, struct epipe_tcp_pending *p, int status,
                      const char *why)
{
    epipe_log_msg(s->refused++ < REFUSALS_LOGGED ? EPIPE_LOG_WARN : EPIPE_LOG_DEBUG, (int)s->rank,
                  "rendezvous", "refused the connection from %s: %s", p->from, why);
    snprintf(s->last_refusal, sizeof s->last_refusal, "%.40s: %.150s", p->from, why);
    if (status)
        epipe_tcp_send_error(p->fd, s->rank, p->hi.rank, s->rank, status, why);
    close(p->fd);
    p->fd = -1;
}

/* Acceptor: the challenge to the first hello, then the check of the proof.
 * Nothing the first hello says counts before the proof: only its type and
 * whether it holds a key shape the challenge. */
int epipe_tcp_accept_step(struct epipe_tcp_rdv *s, struct epipe_tcp_pending *p)
{
    int rc = epipe_tcp_reader_step(p->fd, &p->r);
    if (rc == 0)
        return 0;
    if (rc < 0) {
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", epipe_last_error());
        epipe_tcp_refuse(s, p, rc == EPIPE_EPEER ? 0 : rc, why);
        return 1;
    }
    char why[EPIPE_ERRMSG_MAX];
    if (p->r.h.kind == EPIPE_WIRE_ERROR) {
        char said[200];
        snprintf(why, sizeof why, "it refused this rank: %s",
                 epipe_tcp_peer_text(said, sizeof said, p->r.payload, p->r.h.payload_len));
        epipe_tcp_refuse(s, p, 0, why);
        return 1;
    }
    struct epipe_tcp_hello h;
    if ((rc = epipe_tcp_hello_decode(p->r.payload, p->r.h.payload_len, &h))) {
        snprintf(why, sizeof why, "%s", epipe_last_error());
        epipe_tcp_refuse(s, p, rc, why);
        return 1;
    }
    epipe_tcp_reader_reset(&p->r);
    if (p->phase == 0) {
        p->hi = h;
        if (h.type != HT_REGISTER && h.type != HT_CONNECT) {
            epipe_tcp_refuse(s, p, EPIPE_EPROTO, "the first hello is neither register nor connect");
            return 1;
        }
        if (!!(h.flags & HF_AUTH) != s->key->on) {
            snprintf(why, sizeof why, "rank %u %s", h.rank,
                     s->key->on ? "has no key, but this group requires one (EPIPE_AUTH_KEY_FILE)"
                                : "has a key, but this rank runs without one");
            epipe_tcp_refuse(s, p, EPIPE_EAUTH, why);
            return 1;
        }
        /* Refusing drops only this connection: a peer that says it runs
         * another encryption setting learns why, and the group goes on. */
        if (epipe_tcp_crypt_mismatch(s->o, h.flags, h.rank, why, sizeof why)) {
            epipe_tcp_refuse(s, p, EPIPE_EINVAL, why);
            return 1;
        }
        struct epipe_tcp_hello ch = {.type = HT_CHALLENGE,
                                     .flags = (s->key->on ? HF_AUTH : 0) |
                                              epipe_tcp_crypt_flags(s->o),
                                     .rank = s->rank,
                                     .size = s->size,
                                     .stream = h.stream,
                                     .job = epipe_tcp_job_tag(s->o)};
        epipe_tcp_random(p->nonce_s, sizeof p->nonce_s);
        memcpy(ch.nonce, p->nonce_s, sizeof ch.nonce);
        if (s->key->on)
            epipe_tcp_mac(s->key, 'S', h.nonce, p->nonce_s, h.rank, s->rank, h.stream, ch.mac);
        if ((rc = epipe_tcp_send_hello(p->fd, &ch, s->rank, h.rank, epipe_now_ms() + 1000))) {
            snprintf(why, sizeof why, "%s", epipe_last_error());
            epipe_tcp_refuse(s, p, 0, why);
            return 1;
        }
        p->phase = 1;
        return 0;
    }
    /* phase 1: the proof; from here on the peer holds the key (or none is used) */
    if (h.type != HT_PROOF) {
        epipe_tcp_refuse(s, p, EPIPE_EPROTO, "expected a proof");
        return 1;
    }
    if (s->key->on && !epipe_tcp_mac_ok(s->key, 'C', p->hi.nonce, p->nonce_s, p->hi.rank, s->rank,
                                        p->hi.stream, h.mac)) {
        snprintf(why, sizeof why, "rank %u failed to prove it holds the key (wrong key file?)",
                 p->hi.rank);
        epipe_tcp_refuse(s, p, EPIPE_EAUTH, why);
        return 1;
    }
    return 2;
}
