/* TCP connection setup, the rendezvous client: registering with rank 0,
 * connecting to peers (again after a dropped handshake), and the whole setup. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tcp_setup.h"

/* Reads what rank 0 has sent on the control connection, if anything:
 * before GO it sends only GO or an ERROR (a rank failed in the rendezvous).
 * 0: nothing (yet) or GO; < 0: the rendezvous failed (error set). */
int epipe_tcp_ctl_step(struct epipe_tcp_rdv *s)
{
    if (s->ctl < 0 || s->go)
        return 0;
    int rc = epipe_tcp_reader_step(s->ctl, &s->ctl_r);
    if (rc == 0)
        return 0;
    if (rc < 0) {
        /* Nothing more is said on it, even when the failure is this rank's
         * (no memory for what rank 0 sent): that may have been GO, after
         * which rank 0 reads records, and a plain ERROR would look like
         * tampering. Rank 0 sees the connection close. */
        s->ctl_heard = 1;
        return epipe_tcp_refail(rc, "rendezvous: rank %u: the connection to rank 0", s->rank);
    }
    struct epipe_tcp_hello h;
    if (s->ctl_r.h.kind == EPIPE_WIRE_ERROR) {
        s->ctl_heard = 1;
        rc = -(int)s->ctl_r.h.step;
        char said[200];
        rc = epipe_fail(
            rc > -1 || rc < -64 ? EPIPE_EPEER : rc, "rendezvous: rank 0 reports: %s",
            epipe_tcp_peer_text(said, sizeof said, s->ctl_r.payload, s->ctl_r.h.payload_len));
    } else if ((rc = epipe_tcp_hello_decode(s->ctl_r.payload, s->ctl_r.h.payload_len, &h)) ==
               EPIPE_OK) {
        if (h.type == HT_GO)
            s->go = 1;
        else
            rc = epipe_fail(EPIPE_EPROTO, "rank 0 sent hello type %u during the rendezvous",
                            h.type);
    }
    epipe_tcp_reader_reset(&s->ctl_r);
    return rc;
}

/* Sleeps ms, or less if rank 0 says the rendezvous failed. */
int epipe_tcp_pause_ms(struct epipe_tcp_rdv *s, int ms)
{
    if (!s || s->ctl < 0) {
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        return EPIPE_OK;
    }
    int64_t end = epipe_now_ms() + ms;
    for (;;) {
        int rc = epipe_tcp_ctl_step(s);
        if (rc < 0)
            return rc;
        int64_t left = end - epipe_now_ms();
        if (left <= 0)
            return EPIPE_OK;
        struct pollfd pf = {.fd = s->ctl, .events = POLLIN};
        poll(&pf, 1, (int)left);
    }
}

int epipe_tcp_add_link(struct epipe_tcp_rdv *s, int fd, unsigned peer, unsigned stream)
{
    if (s->nlinks == s->links_cap) {
        unsigned cap = s->links_cap ? 2 * s->links_cap : 8;
        epipe_tcp_link *l = realloc(s->links, cap * sizeof *l);
        if (!l)
            return epipe_fail(EPIPE_ENOMEM, "out of memory");
        s->links = l, s->links_cap = cap;
    }
    epipe_tcp_link l = s->hs; /* the nonces and flags of its handshake */
    l.fd = fd, l.peer = peer, l.stream = stream;
    s->links[s->nlinks++] = l;
    s->have[peer] |= (uint8_t)(1u << stream);
    return EPIPE_OK;
}

/* Connects (unless *fd already is) and handshakes; again, after a pause,
 * while the acceptor drops the connection unanswered (it sheds connections
 * under a flood), until the init timeout. On failure *fd is closed, -1. */
static int dial(struct epipe_tcp_rdv *s, const char *host, unsigned port, unsigned type,
                unsigned peer, unsigned stream, const char *who, int *fd)
{
    int backoff = 10;
    for (;;) {
        int rc, dropped = 0;
        if (*fd < 0 && (rc = epipe_tcp_connect_retry(s, host, port, s->deadline, fd, who)))
            return rc;
        if ((rc = epipe_tcp_client_handshake(s, *fd, type, peer, stream, who, &dropped)) ==
            EPIPE_OK)
            return EPIPE_OK;
        close(*fd);
        *fd = -1;
        if (!dropped || epipe_now_ms() + backoff >= s->deadline)
            return rc;
        epipe_log_info((int)s->rank, "rendezvous", "%s; trying again", epipe_last_error());
        epipe_clear_error();
        if ((rc = epipe_tcp_pause_ms(s, backoff)))
            return rc;
        backoff = backoff < 250 ? backoff * 2 : 500;
    }
}

unsigned epipe_tcp_streams_between(const epipe_tcp_opts *o, unsigned a, unsigned b)
{
    if (a == b)
        return 0;
    if (o->mesh || a + 1 == b || b + 1 == a)
        return o->streams;
    return a == 0 || b == 0 ? 1 : 0;
}

static int setup_rank(struct epipe_tcp_rdv *s, const char *master_addr, unsigned master_port)
{
    char who[320], where[96];
    snprintf(who, sizeof who, "the master (rank 0) at %s:%u", master_addr, master_port);
    int fd0 = -1, lfd = -1, chosen, rc;
    uint8_t *table = NULL;
    if ((rc = epipe_tcp_connect_retry(s, master_addr, master_port, s->deadline, &fd0, who)))
        return epipe_tcp_refail(rc, "rendezvous: rank %u", s->rank);
    if ((rc = epipe_tcp_choose_addr(s->o, s->my_addr, sizeof s->my_addr, &chosen)))
        goto out;
    if (!chosen) { /* the address this host uses to reach the master */
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        getsockname(fd0, (struct sockaddr *)&ss, &len);
        epipe_tcp_host_only((struct sockaddr *)&ss, s->my_addr, sizeof s->my_addr);
    }
    if ((rc = epipe_tcp_open_listener(s->my_addr, 0, AF_INET, &lfd, &s->my_port, where,
                                      sizeof where))) {
        rc = epipe_tcp_refail(rc, "rendezvous: rank %u", s->rank);
        goto out;
    }
    epipe_log_debug((int)s->rank, "rendezvous", "listening on %s", where);
    if ((rc = dial(s, master_addr, master_port, HT_REGISTER, 0, 0, who, &fd0)))
        goto out;
    struct epipe_tcp_reader r = {.limit = HELLO_SIZE + TABLE_ENTRY * (uint64_t)s->size};
    rc = epipe_tcp_reader_wait(fd0, &r, s->deadline);
    if (rc > 0 && r.h.kind == EPIPE_WIRE_ERROR)
        rc = epipe_tcp_error_from(&r, who);
    struct epipe_tcp_hello t;
    if (rc > 0 && (rc = epipe_tcp_hello_decode(r.payload, r.h.payload_len, &t)) == EPIPE_OK &&
        (t.type != HT_TABLE || t.size != s->size ||
         r.h.payload_len != HELLO_SIZE + TABLE_ENTRY * (uint64_t)s->size))
        rc = epipe_fail(EPIPE_EPROTO, "%s sent a malformed table", who);
    table = r.payload;
    r.payload = NULL;
    epipe_tcp_reader_reset(&r);
    if (rc < 0) {
        if (!strstr(epipe_last_error(), "rank 0"))
            rc = epipe_tcp_refail(rc, "waiting for the table from %s", who);
        goto out;
    }
    if ((rc = epipe_tcp_add_link(s, fd0, 0, 0)))
        goto out;
    s->ctl = fd0;
    fd0 = -1;
    epipe_log_info((int)s->rank, "rendezvous", "registered with %s%s", who,
                   s->key->on ? " (authenticated)" : "");
    for (unsigned q = s->rank; q-- > 0;) {
        unsigned k = epipe_tcp_streams_between(s->o, s->rank, q);
        for (unsigned st = q == 0 ? 1 : 0; st < k; st++) {
            char qaddr[EPIPE_TCP_ADDR_MAX] = {0};
            const uint8_t *e = table + HELLO_SIZE + TABLE_ENTRY * (size_t)q;
            memcpy(qaddr, e, EPIPE_TCP_ADDR_MAX - 1);
            unsigned qport = q == 0 ? master_port : epipe_tcp_get_u16(e + 64);
            char qwho[160];
            snprintf(qwho, sizeof qwho, "rank %u at %s:%u", q, q == 0 ? master_addr : qaddr, qport);
            int fd = -1;
            if ((rc = dial(s, q == 0 ? master_addr : qaddr, qport, HT_CONNECT, q, st, qwho, &fd)))
                goto out;
            if ((rc = epipe_tcp_add_link(s, fd, q, st))) {
                close(fd);
                goto out;
            }
            epipe_log_debug((int)s->rank, "tcp", "connected to %s, stream %u", qwho, st);
        }
    }
    if ((rc = epipe_tcp_accept_loop(s, NULL, lfd)))
        goto out;
    /* Every connection of this rank is made: READY, then wait for GO. */
    struct epipe_tcp_hello ready = {.type = HT_READY, .rank = s->rank, .size = s->size};
    if ((rc = epipe_tcp_send_hello(s->ctl, &ready, s->rank, 0, s->deadline)))
        goto out;
    while (!s->go && rc == EPIPE_OK) {
        struct pollfd pf = {.fd = s->ctl, .events = POLLIN};
        if (poll(&pf, 1, epipe_tcp_left_ms(s->deadline)) == 0)
            rc = epipe_fail(EPIPE_ETIMEDOUT,
                            "rendezvous: rank %u: rank 0 did not say go within "
                            "the init timeout",
                            s->rank);
        else
            rc = epipe_tcp_ctl_step(s);
    }
out:
    if (rc && s->ctl >= 0 && !s->ctl_heard) { /* rank 0 tells the others why */
        char text[EPIPE_ERRMSG_MAX];
        snprintf(text, sizeof text, "%s", epipe_last_error());
        epipe_tcp_send_error(s->ctl, s->rank, 0, s->rank, rc, text);
        epipe_fail(rc, "%s", text);
    }
    epipe_tcp_reader_reset(&s->ctl_r);
    if (rc)
        epipe_log_debug((int)s->rank, "rendezvous", "failed: %s", epipe_last_error());
    free(table);
    if (fd0 >= 0)
        close(fd0);
    if (lfd >= 0)
        close(lfd);
    return rc;
}

int epipe_tcp_setup(unsigned rank, unsigned size, const char *master_addr, unsigned master_port,
                    const epipe_tcp_opts *o, const epipe_tcp_key *key, epipe_tcp_link **links,
                    unsigned *nlinks)
{
    *links = NULL;
    *nlinks = 0;
    if (size == 1)
        return EPIPE_OK;
    struct epipe_tcp_rdv s = {.rank = rank,
                              .size = size,
                              .o = o,
                              .key = key,
                              .ctl = -1,
                              .deadline = epipe_now_ms() + o->init_timeout_ms};
    s.have = calloc(size, 1);
    if (!s.have)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    int rc = rank == 0 ? epipe_tcp_setup_rank0(&s, master_addr, master_port)
                       : setup_rank(&s, master_addr, master_port);
    free(s.have);
    if (rc) {
        for (unsigned i = 0; i < s.nlinks; i++)
            close(s.links[i].fd);
        free(s.links);
        return rc;
    }
    *links = s.links;
    *nlinks = s.nlinks;
    return EPIPE_OK;
}
