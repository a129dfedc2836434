/* TCP connection setup, the rendezvous server: the accepting side every
 * rank runs, and rank 0's registration, table and READY/GO barrier. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tcp_setup.h"

struct epipe_tcp_registry { /* rank 0 only */
    int *fd;                /* [size] registration connection, -1 until registered */
    struct epipe_tcp_hello *hi;
    uint8_t (*nonce_s)[EPIPE_TCP_NONCE]; /* [size] rank 0's nonce of each registration handshake */
    struct epipe_tcp_reader **rd; /* [size] what a registered rank sends, allocated when it does */
    uint8_t *ready;               /* [size] it said READY: its connections are all made */
    unsigned registered, nready;
    int table_sent;
};

/* Tells every registered rank but `about` that the rendezvous failed
 * because of rank `about` (0: this one). */
static void fail_all(struct epipe_tcp_rdv *s, struct epipe_tcp_registry *g, unsigned about,
                     int status, const char *why)
{
    for (unsigned q = 1; g && q < s->size; q++)
        if (g->fd[q] >= 0 && (q != about || about == 0))
            epipe_tcp_send_error(g->fd[q], s->rank, q, about, status, why);
}

/* Advances one pending connection. Returns 0 to go on, 1 when it is done
 * (refused, or a registration), 2 when it became a link, < 0 if fatal. */
static int serve(struct epipe_tcp_rdv *s, struct epipe_tcp_registry *g, struct epipe_tcp_pending *p)
{
    int rc = epipe_tcp_accept_step(s, p);
    if (rc != 2)
        return rc;
    char why[EPIPE_ERRMSG_MAX];
    struct epipe_tcp_hello h = p->hi;
    int is_reg = h.type == HT_REGISTER;
    uint64_t job = epipe_tcp_job_tag(s->o);
    if (h.job && job && h.job != job) {
        /* First: a rank of another job that found this port (two jobs given
         * one master port) is turned away alone, whatever it says of its
         * world size and rank, and this job goes on without it. */
        snprintf(why, sizeof why,
                 "rank %u at %s is from another job (tag %016llx; rank %u's %016llx, from %s): "
                 "two jobs on one master port need their own EPIPE_MASTER_PORT; one job "
                 "launched in parts, one EPIPE_JOB_ID on every rank",
                 h.rank, p->from, (unsigned long long)h.job, s->rank, (unsigned long long)job,
                 s->o->job_source);
        epipe_tcp_refuse(s, p, EPIPE_EINVAL, why);
        return 1;
    }
    if (h.size != s->size) {
        snprintf(why, sizeof why,
                 "mismatched world size: rank %u at %s says %u ranks, rank %u "
                 "has %u",
                 h.rank, p->from, h.size, s->rank, s->size);
        epipe_tcp_refuse(s, p, EPIPE_EINVAL, why);
        fail_all(s, g, 0, EPIPE_EINVAL, why);
        return epipe_fail(EPIPE_EINVAL, "rendezvous: %s", why);
    }
    if (h.rank >= s->size || h.rank <= s->rank) {
        snprintf(why, sizeof why, "rank %u may not connect to rank %u", h.rank, s->rank);
        epipe_tcp_refuse(s, p, EPIPE_EINVAL, why);
        return 1;
    }
    if (is_reg ? (!g || g->table_sent)
               : h.stream >= epipe_tcp_streams_between(s->o, s->rank, h.rank) ||
                     (s->rank == 0 && h.stream == 0)) {
        snprintf(why, sizeof why, "unexpected %s from rank %u, stream %u",
                 is_reg ? "registration" : "connection", h.rank, h.stream);
        epipe_tcp_refuse(s, p, EPIPE_EPROTO, why);
        return 1;
    }
    if (s->have[h.rank] & (1u << (is_reg ? 0 : h.stream))) {
        snprintf(why, sizeof why, "two processes claim rank %u (the second from %s)", h.rank,
                 p->from);
        epipe_tcp_refuse(s, p, EPIPE_EINVAL, why);
        fail_all(s, g, 0, EPIPE_EINVAL, why);
        return epipe_fail(EPIPE_EINVAL, "rendezvous: %s", why);
    }
    struct epipe_tcp_hello w = {
        .type = HT_WELCOME, .rank = s->rank, .size = s->size, .stream = p->hi.stream};
    if ((rc = epipe_tcp_send_hello(p->fd, &w, s->rank, p->hi.rank, epipe_now_ms() + 1000))) {
        snprintf(why, sizeof why, "%s", epipe_last_error());
        epipe_tcp_refuse(s, p, 0, why);
        return 1;
    }
    unsigned q = p->hi.rank;
    if (p->hi.type == HT_REGISTER) {
        if (!p->hi.addr[0] || !strcmp(p->hi.addr, "0.0.0.0") || !strcmp(p->hi.addr, "::")) {
            struct sockaddr_storage ss;
            socklen_t len = sizeof ss;
            getpeername(p->fd, (struct sockaddr *)&ss, &len);
            epipe_tcp_host_only((struct sockaddr *)&ss, p->hi.addr, sizeof p->hi.addr);
        }
        g->fd[q] = p->fd;
        g->hi[q] = p->hi;
        memcpy(g->nonce_s[q], p->nonce_s, EPIPE_TCP_NONCE);
        g->registered++;
        s->have[q] |= 1;
        epipe_log_info((int)s->rank, "rendezvous",
                       "rank %u registered from %s (listens on %s:%u)%s", q, p->from, p->hi.addr,
                       p->hi.port, s->key->on ? ", authenticated" : "");
    } else {
        epipe_tcp_link_note(&s->hs, 0, p->hi.nonce, p->nonce_s, p->hi.flags,
                            epipe_tcp_crypt_flags(s->o));
        if ((rc = epipe_tcp_add_link(s, p->fd, q, p->hi.stream)))
            return rc;
        epipe_log_debug((int)s->rank, "tcp", "accepted rank %u stream %u from %s", q, p->hi.stream,
                        p->from);
    }
    p->fd = -1; /* kept */
    return p->hi.type == HT_REGISTER ? 1 : 2;
}

static unsigned expected_in(const struct epipe_tcp_rdv *s)
{
    unsigned n = 0;
    for (unsigned q = s->rank + 1; q < s->size; q++)
        n += epipe_tcp_streams_between(s->o, s->rank, q);
    return n;
}

static int send_table(struct epipe_tcp_rdv *s, struct epipe_tcp_registry *g)
{
    size_t len = HELLO_SIZE + TABLE_ENTRY * (size_t)s->size;
    uint8_t *p = calloc(1, len);
    if (!p)
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    struct epipe_tcp_hello t = {.type = HT_TABLE, .rank = 0, .size = s->size};
    epipe_tcp_hello_encode(&t, p);
    for (unsigned q = 1; q < s->size; q++) {
        uint8_t *e = p + HELLO_SIZE + TABLE_ENTRY * (size_t)q;
        memcpy(e, g->hi[q].addr, strnlen(g->hi[q].addr, EPIPE_TCP_ADDR_MAX - 1));
        epipe_tcp_put_u16(e + 64, g->hi[q].port);
    }
    int rc = EPIPE_OK;
    for (unsigned q = 1; q < s->size && rc == EPIPE_OK; q++)
        if ((rc = epipe_tcp_send_msg(g->fd[q], EPIPE_WIRE_HELLO, 0, q, 0, 0, p, len, s->deadline)))
            rc = epipe_fail(rc, "rendezvous: sending the table to rank %u: %s", q,
                            epipe_last_error());
    free(p);
    g->table_sent = 1;
    epipe_log_info(0, "rendezvous", "all %u ranks registered; table sent", s->size);
    return rc;
}

/* Which pending connection to drop when a new one arrives and all slots
 * are taken: the oldest that has not finished its first hello (idle, or
 * stuck part way), else the oldest waiting to prove the key. A connecting
 * rank sends its hello at once, so it outlives a flood of connections that
 * send nothing or little unless MAX_PENDING newer ones arrive within one
 * round trip; a rank dropped anyway connects again (dial in
 * tcp_rdv_client.c). */
static unsigned evictee(const struct epipe_tcp_pending *pend, unsigned n)
{
    unsigned best = 0;
    for (unsigned i = 1; i < n; i++)
        if (pend[i].phase < pend[best].phase ||
            (pend[i].phase == pend[best].phase && pend[i].seq < pend[best].seq))
            best = i;
    return best;
}

/* Drops the pending connection evictee() picks, `why` (said once as a
 * warning: a flood must not flood the log too, then counted in *dropped);
 * the pending count left. */
static unsigned drop_oldest(const struct epipe_tcp_rdv *s, struct epipe_tcp_pending *pend,
                            unsigned npend, uint64_t *dropped, const char *why)
{
    unsigned v = evictee(pend, npend);
    epipe_log_msg((*dropped)++ ? EPIPE_LOG_DEBUG : EPIPE_LOG_WARN, (int)s->rank, "rendezvous",
                  "%s; dropping the oldest %s one, from %s", why,
                  pend[v].phase ? "unproven" : "silent", pend[v].from);
    close(pend[v].fd);
    epipe_tcp_reader_reset(&pend[v].r);
    pend[v] = pend[--npend];
    return npend;
}

/* Something arrived on rank q's registration connection: READY once the
 * table is out, else it failed (closed, an ERROR, anything else). Before
 * the table a failed rank is forgotten and may register again; after it,
 * every other rank is told, and the rendezvous fails. */
static int watch_rank(struct epipe_tcp_rdv *s, struct epipe_tcp_registry *g, unsigned q)
{
    if (!g->rd[q] && !(g->rd[q] = calloc(1, sizeof *g->rd[q])))
        return epipe_fail(EPIPE_ENOMEM, "out of memory");
    struct epipe_tcp_reader *r = g->rd[q];
    int rc = epipe_tcp_reader_step(g->fd[q], r);
    if (rc == 0)
        return 0;
    if (rc == EPIPE_ENOMEM) /* this rank's shortage, not rank q's failure */
        return epipe_tcp_refail(rc, "rendezvous: rank 0, reading from rank %u", q);
    char why[EPIPE_ERRMSG_MAX];
    struct epipe_tcp_hello h;
    if (rc < 0)
        snprintf(why, sizeof why, "%s", epipe_last_error());
    else if (r->h.kind == EPIPE_WIRE_ERROR)
        epipe_tcp_peer_text(why, sizeof why, r->payload, r->h.payload_len);
    else if (epipe_tcp_hello_decode(r->payload, r->h.payload_len, &h) == EPIPE_OK &&
             h.type == HT_READY && g->table_sent && !g->ready[q]) {
        epipe_tcp_reader_reset(r);
        g->ready[q] = 1;
        g->nready++;
        return 0;
    } else
        snprintf(why, sizeof why, "an unexpected message on its registration connection");
    epipe_tcp_reader_reset(r);
    epipe_clear_error();
    if (!g->table_sent) {
        epipe_log_warn(0, "rendezvous",
                       "rank %u left before all ranks registered (%s); it may "
                       "register again",
                       q, why);
        close(g->fd[q]);
        g->fd[q] = -1;
        g->registered--;
        s->have[q] &= (uint8_t)~1u;
        return 0;
    }
    char text[EPIPE_ERRMSG_MAX + 64];
    snprintf(text, sizeof text, "rank %u failed during the rendezvous: %s", q, why);
    text[EPIPE_ERRMSG_MAX - 1] = '\0';
    fail_all(s, g, q, EPIPE_EPEER, text);
    return epipe_fail(EPIPE_EPEER, "rendezvous: %s", text);
}

/* The ranks among q0..size-1 still missing: streams (rank 0 also READY). */
static void missing_ranks(const struct epipe_tcp_rdv *s, const struct epipe_tcp_registry *g,
                          char *out, size_t cap)
{
    size_t off = 0;
    out[0] = '\0';
    for (unsigned q = s->rank + 1; q < s->size && off + 16 < cap; q++) {
        unsigned k = epipe_tcp_streams_between(s->o, s->rank, q);
        int miss = k && s->have[q] != (uint8_t)((1u << k) - 1);
        if (g && g->table_sent)
            miss = miss || !g->ready[q];
        if (miss)
            off += (size_t)snprintf(out + off, cap - off, "%s%u", off ? ", " : "", q);
    }
}

/* Accepts connections until every expected one has arrived; rank 0 also
 * collects every rank's READY and then sends GO to all. Ranks > 0 listen
 * to rank 0 meanwhile (s->ctl). */
int epipe_tcp_accept_loop(struct epipe_tcp_rdv *s, struct epipe_tcp_registry *g, int lfd)
{
    unsigned nwatch = g ? s->size : 1;
    struct epipe_tcp_pending *pend = calloc(MAX_PENDING, sizeof *pend);
    struct pollfd *pf = calloc(MAX_PENDING + 1 + nwatch, sizeof *pf);
    unsigned *who = calloc(nwatch, sizeof *who);
    unsigned npend = 0;
    int rc = EPIPE_OK;
    if (!pend || !pf || !who) {
        rc = epipe_fail(EPIPE_ENOMEM, "out of memory");
        goto out;
    }
    unsigned want = expected_in(s) - (g ? s->size - 1 : 0);
    unsigned got = 0;
    uint64_t seq = 0, dropped = 0;
    for (;;) {
        if (g && !g->table_sent && g->registered == s->size - 1 && (rc = send_table(s, g)))
            break;
        if ((!g || g->table_sent) && got == want && (!g || g->nready == s->size - 1))
            break;
        pf[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        for (unsigned i = 0; i < npend; i++)
            pf[i + 1] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
        unsigned nw = 0; /* then the connections to listen to */
        for (unsigned q = 1; g && q < s->size; q++)
            if (g->fd[q] >= 0 && !g->ready[q])
                who[nw] = q,
                pf[1 + npend + nw++] = (struct pollfd){.fd = g->fd[q], .events = POLLIN};
        if (!g && s->ctl >= 0)
            pf[1 + npend + nw++] = (struct pollfd){.fd = s->ctl, .events = POLLIN};
        /* Past the deadline nothing is awaited any more: connections that
         * keep arriving (a flood) must not keep the rendezvous alive. */
        int n = epipe_now_ms() >= s->deadline
                    ? 0
                    : poll(pf, 1 + npend + nw, epipe_tcp_left_ms(s->deadline));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            char missing[128];
            missing_ranks(s, g, missing, sizeof missing);
            rc = epipe_fail(EPIPE_ETIMEDOUT,
                            "rendezvous: rank %u: rank%s %s did not %s within the "
                            "init timeout%s%s",
                            s->rank, strchr(missing, ',') ? "s" : "", missing,
                            g && !g->table_sent ? "register"
                            : g && got == want  ? "finish connecting"
                                                : "connect",
                            s->last_refusal[0] ? "; last refused: " : "", s->last_refusal);
            break;
        }
        for (unsigned i = 0; i < nw && rc == EPIPE_OK; i++)
            if (pf[1 + npend + i].revents)
                rc = g ? watch_rank(s, g, who[i]) : epipe_tcp_ctl_step(s);
        if (rc)
            break;
        if (s->go) {
            rc = epipe_fail(EPIPE_EPROTO, "rendezvous: rank 0 said GO before this rank was ready");
            break;
        }
        /* Backwards, so a finished entry can take the last one's place. */
        for (unsigned i = npend; i-- > 0;) {
            if (!pf[i + 1].revents)
                continue;
            int r = serve(s, g, &pend[i]);
            if (r < 0) {
                rc = r;
                break;
            }
            if (r > 0) {
                got += r == 2;
                epipe_tcp_reader_reset(&pend[i].r);
                pend[i] = pend[--npend];
            }
        }
        if (rc)
            break;
        if (pf[0].revents & POLLIN) {
            struct sockaddr_storage ss;
            socklen_t len = sizeof ss;
            int fd = accept4(lfd, (struct sockaddr *)&ss, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
            int short_of = fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
                                      errno == ENOMEM);
            if (short_of && npend > 0) {
                /* Out of descriptors (or memory) while connections are
                 * pending: the oldest silent or unproven one makes room, as
                 * when the slots are full, so that a flood of idle
                 * connections cannot fail the rendezvous of those who hold
                 * the key; the next round accepts again. */
                char why[96];
                snprintf(why, sizeof why, "cannot accept a connection (%s)", strerror(errno));
                npend = drop_oldest(s, pend, npend, &dropped, why);
                continue;
            }
            if (short_of) {
                /* Out of descriptors or memory with nothing pending to
                 * drop: the connection stays in the backlog, so polling
                 * again would spin until the init timeout while the peer
                 * waits for an answer. */
                rc = epipe_fail(errno == EMFILE || errno == ENFILE ? EPIPE_EIO : EPIPE_ENOMEM,
                                "rendezvous: rank %u: cannot accept a connection: %s%s", s->rank,
                                strerror(errno),
                                errno == EMFILE ? " (raise the limit, ulimit -n)" : "");
                break;
            }
            if (fd >= 0) {
                if (npend == MAX_PENDING) {
                    char why[64];
                    snprintf(why, sizeof why, "too many pending connections (%d)", MAX_PENDING);
                    npend = drop_oldest(s, pend, npend, &dropped, why);
                }
                struct epipe_tcp_pending *p = &pend[npend++];
                memset(p, 0, sizeof *p);
                p->fd = fd;
                p->seq = seq++;
                epipe_tcp_sock_text((struct sockaddr *)&ss, p->from, sizeof p->from);
                epipe_tcp_tune(fd);
            }
        }
    }
    if (s->refused > REFUSALS_LOGGED)
        epipe_log_warn((int)s->rank, "rendezvous",
                       "refused %llu connections in all; the first %d are logged above",
                       (unsigned long long)s->refused, REFUSALS_LOGGED);
    if (dropped)
        epipe_log_info((int)s->rank, "rendezvous",
                       "dropped %llu pending connections in all "
                       "(more than %d at once)",
                       (unsigned long long)dropped, MAX_PENDING);
out:
    for (unsigned i = 0; pend && i < npend; i++) {
        if (pend[i].fd >= 0)
            close(pend[i].fd);
        epipe_tcp_reader_reset(&pend[i].r);
    }
    free(pend);
    free(pf);
    free(who);
    return rc;
}

int epipe_tcp_setup_rank0(struct epipe_tcp_rdv *s, const char *master_addr, unsigned master_port)
{
    char addr[EPIPE_TCP_ADDR_MAX], where[96];
    int chosen, rc, lfd = -1, family = AF_INET;
    if ((rc = epipe_tcp_choose_addr(s->o, addr, sizeof addr, &chosen)))
        return rc;
    if (!chosen) {
        struct sockaddr_storage ss;
        socklen_t len;
        if (epipe_tcp_resolve(master_addr, master_port, 0, &ss, &len) == EPIPE_OK) {
            family = ss.ss_family;
            if (epipe_tcp_is_loopback(&ss)) {
                epipe_tcp_host_only((struct sockaddr *)&ss, addr, sizeof addr);
                chosen = 1;
            }
        }
        epipe_clear_error();
    }
    unsigned port;
    if ((rc = epipe_tcp_open_listener(chosen ? addr : NULL, master_port, family, &lfd, &port, where,
                                      sizeof where)))
        return epipe_tcp_refail(rc, "rendezvous: rank 0");
    epipe_log_info(0, "rendezvous", "rank 0 listens on %s for %u ranks%s", where, s->size,
                   s->key->on ? " (authentication on)" : "");
    struct epipe_tcp_registry g = {0};
    g.fd = malloc(sizeof *g.fd * s->size);
    g.hi = calloc(s->size, sizeof *g.hi);
    g.nonce_s = calloc(s->size, sizeof *g.nonce_s);
    g.rd = calloc(s->size, sizeof *g.rd);
    g.ready = calloc(s->size, 1);
    /* no connection yet, whatever else failed: the loop below closes
     * only the registry's descriptors */
    for (unsigned q = 0; g.fd && q < s->size; q++)
        g.fd[q] = -1;
    if (!g.fd || !g.hi || !g.nonce_s || !g.rd || !g.ready)
        rc = epipe_fail(EPIPE_ENOMEM, "rendezvous: rank 0: no memory for a registry of %u ranks",
                        s->size);
    else
        rc = epipe_tcp_accept_loop(s, &g, lfd);
    close(lfd);
    /* Every rank is connected. The links are made before GO, so that a
     * failure here still reaches the ranks as an ERROR while they wait
     * for GO: after it they may encrypt, and a plain message would look
     * like tampering. Registration connections before `linked` are the
     * links' now (epipe_tcp_setup closes those on failure); ranks before
     * `told` have their GO. */
    unsigned linked = 1, told = 1;
    for (; rc == EPIPE_OK && g.fd && linked < s->size; linked++) {
        unsigned q = linked;
        if (g.fd[q] < 0)
            continue;
        epipe_tcp_link_note(&s->hs, 0, g.hi[q].nonce, g.nonce_s[q], g.hi[q].flags,
                            epipe_tcp_crypt_flags(s->o));
        if ((rc = epipe_tcp_add_link(s, g.fd[q], q, 0)))
            break;
    }
    struct epipe_tcp_hello go = {.type = HT_GO, .rank = 0, .size = s->size};
    for (; rc == EPIPE_OK && told < s->size; told++)
        if ((rc = epipe_tcp_send_hello(g.fd[told], &go, 0, told, s->deadline)))
            rc = epipe_tcp_refail(rc, "rendezvous: telling rank %u to go", told);
    if (rc && g.fd) {
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "rank 0: %s", epipe_last_error());
        for (unsigned q = 1; q < s->size; q++) {
            if (g.fd[q] < 0)
                continue;
            if (q >= told) /* the others heard GO: they see the connection close */
                epipe_tcp_send_error(g.fd[q], 0, q, 0, rc, why);
            if (q >= linked)
                close(g.fd[q]);
        }
        epipe_clear_error();
        epipe_fail(rc, "%s", why + 8);
    }
    for (unsigned q = 0; g.rd && q < s->size; q++)
        if (g.rd[q]) {
            epipe_tcp_reader_reset(g.rd[q]);
            free(g.rd[q]);
        }
    free(g.rd);
    free(g.ready);
    free(g.fd);
    free(g.hi);
    free(g.nonce_s);
    return rc;
}
