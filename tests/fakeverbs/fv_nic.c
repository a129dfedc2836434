/* fakeverbs: the per-process "NIC": a thread on an abstract unix socket (named by the
 * GID) that executes peers' sends and writes on local memory and acks them back. */
#define _GNU_SOURCE
#include "fv_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static char fv_tag_listen, fv_tag_kick;

void fv_gid_sockname(const union ibv_gid *gid, char *name, size_t cap)
{
  uint32_t pid, inst;
  memcpy(&pid, gid->raw + 4, 4);
  memcpy(&inst, gid->raw + 8, 4);
  name[0] = '\0'; /* abstract namespace */
  snprintf(name + 1, cap - 1, "epipe-fakeverbs-%u-%08x", pid, inst);
}

static socklen_t fv_addr(const char *name, struct sockaddr_un *sa)
{
  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  size_t n = 1 + strlen(name + 1);
  memcpy(sa->sun_path, name, n);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
}

void fv_nic_kick(void)
{
  uint64_t one = 1;
  (void)!write(fv_nic.kickfd, &one, sizeof one);
}

static void fv_conn_events(struct fv_conn *c)
{
  uint32_t ev = c->want_out ? EPOLLOUT : 0;
  if (c->outgoing || !c->stalled)
    ev |= EPOLLIN;
  if (ev == c->ev_mask)
    return;
  struct epoll_event e = {.events = ev, .data.ptr = c};
  epoll_ctl(fv_nic.epfd, EPOLL_CTL_MOD, c->fd, &e);
  c->ev_mask = ev;
}

int fv_conn_append(struct fv_conn *c, const void *p, size_t n)
{
  if (c->tx_len + n > c->tx_cap && c->tx_off) {
    memmove(c->tx, c->tx + c->tx_off, c->tx_len - c->tx_off);
    c->tx_len -= c->tx_off;
    c->tx_off = 0;
  }
  if (c->tx_len + n > c->tx_cap) {
    size_t ncap = c->tx_cap ? c->tx_cap * 2 : 65536;
    while (ncap < c->tx_len + n)
      ncap *= 2;
    unsigned char *nb = realloc(c->tx, ncap);
    if (!nb)
      return -1;
    c->tx = nb;
    c->tx_cap = ncap;
  }
  if (n)
    memcpy(c->tx + c->tx_len, p, n);
  c->tx_len += n;
  return 0;
}

/* Sends what is queued without blocking; -1 when the peer is gone. */
int fv_conn_flush(struct fv_conn *c)
{
  while (c->tx_off < c->tx_len) {
    ssize_t w = send(c->fd, c->tx + c->tx_off, c->tx_len - c->tx_off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) {
      c->tx_off += (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      c->want_out = 1;
      fv_conn_events(c);
      return 0;
    }
    return -1;
  }
  c->tx_off = c->tx_len = 0;
  if (c->tx_cap > (1u << 20)) {
    free(c->tx);
    c->tx = NULL;
    c->tx_cap = 0;
  }
  c->want_out = 0;
  fv_conn_events(c);
  return 0;
}

int fv_conn_open(struct fv_qp *q)
{
  char name[64];
  struct sockaddr_un sa;
  fv_gid_sockname(&q->dgid, name, sizeof name);
  socklen_t len = fv_addr(name, &sa);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return -1;
  if (connect(fd, (struct sockaddr *)&sa, len) != 0) {
    fv_log("qp %u: cannot reach the peer NIC %s: %s", q->qp.qp_num, name + 1, strerror(errno));
    close(fd);
    return -1;
  }
  struct fv_conn *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    return -1;
  }
  c->fd = fd;
  c->outgoing = 1;
  c->qp = q;
  struct fv_hello h = {.magic = FV_HELLO_MAGIC, .src_qpn = q->qp.qp_num, .dst_qpn = q->dest_qpn};
  memcpy(h.src_gid, fv_nic.gid.raw, 16);
  struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
  c->ev_mask = EPOLLIN;
  if (fv_conn_append(c, &h, sizeof h) != 0 || epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fd, &e) != 0) {
    free(c->tx);
    free(c);
    close(fd);
    return -1;
  }
  q->out = c;
  if (fv_conn_flush(c) != 0) {
    fv_conn_close(c);
    q->out = NULL;
    return -1;
  }
  return 0;
}

void fv_conn_close(struct fv_conn *c)
{
  epoll_ctl(fv_nic.epfd, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->fd = -1;
  c->dead = 1;
  c->qp = NULL;
  if (fv_nic.running) {
    c->next = fv_nic.graveyard; /* events already fetched may still name it */
    fv_nic.graveyard = c;
  } else {
    free(c->tx);
    free(c);
  }
}

/* ---- responder side ---- */

static uint64_t fv_rnr_ns(uint8_t t)
{
  static const uint32_t us[32] = {655360, 10,   20,    30,    40,    60,    80,    120,
                                  160,    240,  320,   480,   640,   960,   1280,  1920,
                                  2560,   3840, 5120,  7680,  10240, 15360, 20480, 30720,
                                  40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return (uint64_t)us[t & 31] * 1000u;
}

static void fv_rx_nak(struct fv_conn *c, enum ibv_wc_status st, const char *why)
{
  fv_log("qp %u <- qp %u: NAK %s (%s)", c->hello.dst_qpn, c->hello.src_qpn, ibv_wc_status_str(st),
         why);
  c->ack_err = st;
  c->failed = 1;
  c->in_payload = 0;
  if (c->stalled) {
    c->stalled = 0;
    fv_nic.nstalled--;
    fv_conn_events(c);
  }
}

/* Stalls the stream (RC keeps order) until the condition clears or the
 * requester's retries would have run out. Returns 1 while stalled. */
static int fv_rx_stall(struct fv_conn *c, enum ibv_wc_status st, uint64_t wait_ns, int forever,
                       const char *why)
{
  uint64_t now = fv_now_ns();
  if (!c->stalled) {
    c->stalled = 1;
    c->stall_status = st;
    c->stall_deadline = forever ? 0 : now + wait_ns;
    fv_nic.nstalled++;
    fv_conn_events(c);
    fv_log("qp %u <- qp %u: stalled (%s)", c->hello.dst_qpn, c->hello.src_qpn, why);
    return 1;
  }
  if (c->stall_deadline && now >= c->stall_deadline) {
    fv_rx_nak(c, st, why);
    return 0;
  }
  return 1;
}

static void fv_rx_unstall(struct fv_conn *c)
{
  if (c->stalled) {
    c->stalled = 0;
    fv_nic.nstalled--;
    fv_conn_events(c);
  }
}

static int fv_rwqe_check(struct fv_qp *q, const struct fv_rwqe *r, uint32_t len,
                         enum ibv_wc_status *st)
{
  uint64_t room = 0;
  for (uint32_t i = 0; i < r->nsge; i++) {
    const struct ibv_sge *g = &r->sge[i];
    struct fv_mr *m = fv_mr_by_lkey(g->lkey);
    if (g->length && (!m || m->mr.pd != q->qp.pd || !(m->access & IBV_ACCESS_LOCAL_WRITE) ||
                      g->addr < (uintptr_t)m->mr.addr ||
                      g->addr + g->length > (uintptr_t)m->mr.addr + m->mr.length)) {
      *st = IBV_WC_LOC_PROT_ERR;
      return 0;
    }
    room += g->length;
  }
  if (room < len) {
    *st = IBV_WC_LOC_LEN_ERR;
    return 0;
  }
  return 1;
}

/* A header is complete: check it the way the responder's hardware would.
 * 0: go on with its payload; 1: stalled; 2: refused (NAK queued). */
static int fv_rx_begin(struct fv_conn *c)
{
  struct fv_hdr *h = &c->cur;
  struct fv_qp *q = fv_qp_lookup(c->hello.dst_qpn);
  uint64_t retry_ns = ((uint64_t)4096 << h->timeout) * (h->retry_cnt + 1u);
  if (!q || (q->qp.state != IBV_QPS_RTR && q->qp.state != IBV_QPS_RTS))
    return fv_rx_stall(c, IBV_WC_RETRY_EXC_ERR, retry_ns, h->timeout == 0,
                       "no such QP, or it is not in RTR/RTS: the requester retries") ? 1 : 2;
  if (q->dest_qpn != c->hello.src_qpn || memcmp(q->dgid.raw, c->hello.src_gid, 16) != 0)
    return fv_rx_stall(c, IBV_WC_RETRY_EXC_ERR, retry_ns, h->timeout == 0,
                       "packet from a QP this one is not connected to (dropped)") ? 1 : 2;
  if (h->psn != q->expect_psn) {
    char why[96];
    snprintf(why, sizeof why, "PSN %u, expected %u (sq_psn/rq_psn mismatch)", h->psn, q->expect_psn);
    fv_rx_nak(c, IBV_WC_RETRY_EXC_ERR, why);
    return 2;
  }
  int need_recv = h->op != FV_OP_WRITE;
  if (h->op == FV_OP_WRITE || h->op == FV_OP_WRITE_IMM) {
    struct fv_mr *m = h->len ? fv_mr_by_rkey(h->rkey) : NULL;
    if (!(q->access & IBV_ACCESS_REMOTE_WRITE)) {
      fv_rx_nak(c, IBV_WC_REM_ACCESS_ERR, "QP access flags lack IBV_ACCESS_REMOTE_WRITE");
      return 2;
    }
    if (h->len && (!m || m->mr.pd != q->qp.pd || !(m->access & IBV_ACCESS_REMOTE_WRITE) ||
                   h->raddr < (uintptr_t)m->mr.addr ||
                   h->raddr - (uintptr_t)m->mr.addr > m->mr.length ||
                   h->len > m->mr.length - (h->raddr - (uintptr_t)m->mr.addr))) {
      char why[128];
      snprintf(why, sizeof why, "rkey 0x%x addr 0x%llx len %u: %s", h->rkey,
               (unsigned long long)h->raddr, h->len,
               !m ? "no such rkey" : m->mr.pd != q->qp.pd ? "MR of another PD"
               : !(m->access & IBV_ACCESS_REMOTE_WRITE) ? "MR without REMOTE_WRITE"
                                                        : "outside the MR");
      fv_rx_nak(c, IBV_WC_REM_ACCESS_ERR, why);
      return 2;
    }
  } else if (h->op != FV_OP_SEND && h->op != FV_OP_SEND_IMM) {
    fv_rx_nak(c, IBV_WC_REM_INV_REQ_ERR, "unknown opcode");
    return 2;
  }
  if (need_recv) {
    if (q->rq_head == q->rq_tail)
      return fv_rx_stall(c, IBV_WC_RNR_RETRY_EXC_ERR,
                         fv_rnr_ns(q->min_rnr_timer) * (h->rnr_retry + 1u), h->rnr_retry == 7,
                         "receiver not ready: no receive posted") ? 1 : 2;
    c->rwqe = q->rq[q->rq_head % q->cap.max_recv_wr];
    q->rq_head++;
    c->have_rwqe = 1;
    enum ibv_wc_status st;
    if ((h->op == FV_OP_SEND || h->op == FV_OP_SEND_IMM) && !fv_rwqe_check(q, &c->rwqe, h->len, &st)) {
      fv_push_recv_wc(q, &c->rwqe, st, IBV_WC_RECV, 0, 0, 0, 0);
      c->have_rwqe = 0;
      fv_qp_to_err(q, IBV_WC_WR_FLUSH_ERR);
      fv_rx_nak(c, st == IBV_WC_LOC_LEN_ERR ? IBV_WC_REM_INV_REQ_ERR : IBV_WC_REM_OP_ERR,
                st == IBV_WC_LOC_LEN_ERR ? "send longer than the posted receive"
                                         : "receive buffer outside its MR");
      return 2;
    }
  }
  fv_rx_unstall(c);
  q->expect_psn = (q->expect_psn + 1) & 0xffffff;
  c->in_payload = 1;
  c->done = 0;
  c->payload_status = 0;
  return 0;
}

static void fv_rx_place(struct fv_conn *c, const unsigned char *p, uint32_t n)
{
  struct fv_hdr *h = &c->cur;
  if (c->payload_status)
    return;
  if (h->op == FV_OP_WRITE || h->op == FV_OP_WRITE_IMM) {
    if (!fv_mr_by_rkey(h->rkey)) { /* deregistered meanwhile */
      c->payload_status = IBV_WC_REM_ACCESS_ERR;
      return;
    }
    memcpy((void *)(uintptr_t)(h->raddr + c->done), p, n);
    return;
  }
  uint64_t off = c->done;
  for (uint32_t i = 0; i < c->rwqe.nsge && n; i++) {
    const struct ibv_sge *g = &c->rwqe.sge[i];
    if (off >= g->length) {
      off -= g->length;
      continue;
    }
    uint32_t k = (uint32_t)(g->length - off) < n ? (uint32_t)(g->length - off) : n;
    if (!fv_mr_by_lkey(g->lkey)) {
      c->payload_status = IBV_WC_LOC_PROT_ERR;
      return;
    }
    memcpy((void *)(uintptr_t)(g->addr + off), p, k);
    p += k;
    n -= k;
    off = 0;
  }
}

static void fv_rx_finish(struct fv_conn *c)
{
  struct fv_hdr *h = &c->cur;
  struct fv_qp *q = fv_qp_lookup(c->hello.dst_qpn);
  c->in_payload = 0;
  if (c->payload_status) {
    if (c->have_rwqe && q)
      fv_push_recv_wc(q, &c->rwqe, (enum ibv_wc_status)c->payload_status, IBV_WC_RECV, 0, 0, 0, 0);
    c->have_rwqe = 0;
    fv_rx_nak(c, c->payload_status == IBV_WC_REM_ACCESS_ERR ? IBV_WC_REM_ACCESS_ERR
                                                            : IBV_WC_REM_OP_ERR,
              "memory region deregistered during the transfer");
    return;
  }
  if (c->have_rwqe && q) {
    int ok = q->qp.state == IBV_QPS_RTR || q->qp.state == IBV_QPS_RTS;
    int imm = h->op == FV_OP_WRITE_IMM || h->op == FV_OP_SEND_IMM;
    fv_push_recv_wc(q, &c->rwqe, ok ? IBV_WC_SUCCESS : IBV_WC_WR_FLUSH_ERR,
                    h->op == FV_OP_WRITE_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV, h->len,
                    h->imm, imm, h->flags & FV_F_SOLICITED);
  }
  c->have_rwqe = 0;
  c->ack_ok++;
}

/* Parses and executes what the requester sent; queues and sends the acks. */
int fv_rx_process(struct fv_conn *c)
{
  while (!c->failed) {
    size_t avail = c->rx_len - c->rx_off;
    unsigned char *p = c->rx + c->rx_off;
    if (!c->have_hello) {
      if (avail < sizeof c->hello)
        break;
      memcpy(&c->hello, p, sizeof c->hello);
      c->rx_off += sizeof c->hello;
      if (c->hello.magic != FV_HELLO_MAGIC) {
        fv_log("connection without a fakeverbs hello: dropped");
        c->failed = 1;
        break;
      }
      c->have_hello = 1;
      continue;
    }
    if (!c->in_payload) {
      if (avail < sizeof c->cur)
        break;
      memcpy(&c->cur, p, sizeof c->cur);
      int r = fv_rx_begin(c);
      if (r == 1)
        break;
      c->rx_off += sizeof c->cur;
      if (r == 2)
        break;
      if (c->cur.len == 0)
        fv_rx_finish(c);
      continue;
    }
    if (!avail)
      break;
    uint32_t n = c->cur.len - c->done;
    if (n > avail)
      n = (uint32_t)avail;
    fv_rx_place(c, p, n);
    c->done += n;
    c->rx_off += n;
    if (c->done == c->cur.len)
      fv_rx_finish(c);
  }
  if (c->failed)
    c->rx_off = c->rx_len; /* everything after a NAK is dropped */
  while (c->ack_ok) {
    uint32_t k = c->ack_ok > 0xffffffffu ? 0xffffffffu : (uint32_t)c->ack_ok;
    struct fv_ack a = {IBV_WC_SUCCESS, k};
    if (fv_conn_append(c, &a, sizeof a) != 0)
      break;
    c->ack_ok -= k;
  }
  if (c->ack_err) {
    struct fv_ack a = {c->ack_err, 1};
    if (fv_conn_append(c, &a, sizeof a) == 0)
      c->ack_err = 0;
  }
  return fv_conn_flush(c);
}

/* ---- the NIC thread ---- */

static void fv_rx_read(struct fv_conn *c)
{
  for (int round = 0; round < 8 && !c->dead && !c->stalled; round++) {
    if (c->rx_off) {
      memmove(c->rx, c->rx + c->rx_off, c->rx_len - c->rx_off);
      c->rx_len -= c->rx_off;
      c->rx_off = 0;
    }
    ssize_t r = read(c->fd, c->rx + c->rx_len, FV_RXBUF - c->rx_len);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return;
    if (r <= 0) {
      c->dead = 1; /* the requester closed (its QP failed, or its process is gone) */
      return;
    }
    c->rx_len += (size_t)r;
    if (fv_rx_process(c) != 0) {
      c->dead = 1;
      return;
    }
    if ((size_t)r < FV_RXBUF / 2)
      return;
  }
}

static void fv_tx_read_acks(struct fv_conn *c)
{
  unsigned char buf[4096];
  for (;;) {
    memcpy(buf, c->ackpart, c->ackpart_len);
    ssize_t r = read(c->fd, buf + c->ackpart_len, sizeof buf - c->ackpart_len);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return;
    if (r <= 0) {
      fv_qp_peer_gone(c->qp);
      return;
    }
    size_t n = c->ackpart_len + (size_t)r, off = 0;
    struct fv_qp *q = c->qp;
    while (n - off >= sizeof(struct fv_ack)) {
      struct fv_ack a;
      memcpy(&a, buf + off, sizeof a);
      off += sizeof a;
      fv_qp_acked(q, a.count, (enum ibv_wc_status)a.status);
      if (c->dead)
        return; /* the QP failed and closed this connection */
    }
    c->ackpart_len = n - off;
    memcpy(c->ackpart, buf + off, c->ackpart_len);
  }
}

static void fv_accept_all(void)
{
  for (;;) {
    int fd = accept4(fv_nic.lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0)
      return;
    struct fv_conn *c = calloc(1, sizeof *c);
    unsigned char *rx = c ? malloc(FV_RXBUF) : NULL;
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
    if (!rx || epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fd, &e) != 0) {
      free(rx);
      free(c);
      close(fd);
      continue;
    }
    c->fd = fd;
    c->rx = rx;
    c->ev_mask = EPOLLIN;
    c->next = fv_nic.conns;
    fv_nic.conns = c;
  }
}

static void fv_rx_free(struct fv_conn *c)
{
  if (c->stalled)
    fv_nic.nstalled--;
  epoll_ctl(fv_nic.epfd, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  free(c->rx);
  free(c->tx);
  free(c);
}

static void *fv_nic_main(void *arg)
{
  (void)arg;
  struct epoll_event ev[64];
  for (;;) {
    int timeout = __atomic_load_n(&fv_nic.nstalled, __ATOMIC_RELAXED) ? 1 : -1;
    int n = epoll_wait(fv_nic.epfd, ev, 64, timeout);
    pthread_mutex_lock(&fv_nic.lock);
    if (fv_nic.stop) {
      pthread_mutex_unlock(&fv_nic.lock);
      return NULL;
    }
    for (int i = 0; i < n; i++) {
      void *p = ev[i].data.ptr;
      if (p == &fv_tag_kick) {
        uint64_t v;
        (void)!read(fv_nic.kickfd, &v, sizeof v);
        continue;
      }
      if (p == &fv_tag_listen) {
        fv_accept_all();
        continue;
      }
      struct fv_conn *c = p;
      if (c->dead)
        continue;
      if (c->outgoing) {
        if (ev[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP))
          fv_tx_read_acks(c);
        if (!c->dead && (ev[i].events & EPOLLOUT) && fv_conn_flush(c) != 0)
          fv_qp_peer_gone(c->qp);
        continue;
      }
      if ((ev[i].events & EPOLLOUT) && fv_conn_flush(c) != 0)
        c->dead = 1;
      if (!c->dead && c->stalled && (ev[i].events & (EPOLLERR | EPOLLHUP)))
        c->dead = 1; /* the requester is gone: nothing will retry the stalled request */
      if (!c->dead && (ev[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)))
        fv_rx_read(c);
    }
    if (fv_nic.nstalled)
      for (struct fv_conn *c = fv_nic.conns; c; c = c->next)
        if (c->stalled && !c->dead && fv_rx_process(c) != 0)
          c->dead = 1;
    for (struct fv_conn **pp = &fv_nic.conns; *pp;) {
      struct fv_conn *c = *pp;
      if (c->dead) {
        *pp = c->next;
        fv_rx_free(c);
      } else {
        pp = &c->next;
      }
    }
    while (fv_nic.graveyard) {
      struct fv_conn *c = fv_nic.graveyard;
      fv_nic.graveyard = c->next;
      free(c->tx);
      free(c);
    }
    pthread_mutex_unlock(&fv_nic.lock);
  }
}

int fv_nic_start(void)
{
  static uint32_t instance;
  uint32_t pid = (uint32_t)getpid();
  uint32_t inst = (uint32_t)(fv_now_ns() ^ (++instance * 0x9e3779b9u));
  memset(&fv_nic.gid, 0, sizeof fv_nic.gid);
  fv_nic.gid.raw[0] = 0xfe;
  fv_nic.gid.raw[1] = 0x80;
  fv_nic.gid.raw[2] = 'f';
  fv_nic.gid.raw[3] = 'v';
  memcpy(fv_nic.gid.raw + 4, &pid, 4);
  memcpy(fv_nic.gid.raw + 8, &inst, 4);
  fv_gid_sockname(&fv_nic.gid, fv_nic.sockname, sizeof fv_nic.sockname);
  if (fv_nic.next_qpn == 0)
    fv_nic.next_qpn = (pid * 977u) & 0xffffff;
  struct sockaddr_un sa;
  socklen_t len = fv_addr(fv_nic.sockname, &sa);
  fv_nic.epfd = epoll_create1(EPOLL_CLOEXEC);
  fv_nic.kickfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  fv_nic.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int rc = 0;
  if (fv_nic.epfd < 0 || fv_nic.kickfd < 0 || fv_nic.lfd < 0 ||
      bind(fv_nic.lfd, (struct sockaddr *)&sa, len) != 0 || listen(fv_nic.lfd, 4096) != 0)
    rc = errno ? errno : EIO;
  struct epoll_event e1 = {.events = EPOLLIN, .data.ptr = &fv_tag_listen};
  struct epoll_event e2 = {.events = EPOLLIN, .data.ptr = &fv_tag_kick};
  if (!rc && (epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fv_nic.lfd, &e1) != 0 ||
              epoll_ctl(fv_nic.epfd, EPOLL_CTL_ADD, fv_nic.kickfd, &e2) != 0))
    rc = errno;
  fv_nic.stop = 0;
  if (!rc)
    rc = pthread_create(&fv_nic.thread, NULL, fv_nic_main, NULL);
  if (rc) {
    fv_log("cannot start the NIC thread: %s", strerror(rc));
    if (fv_nic.lfd >= 0)
      close(fv_nic.lfd);
    if (fv_nic.kickfd >= 0)
      close(fv_nic.kickfd);
    if (fv_nic.epfd >= 0)
      close(fv_nic.epfd);
    fv_nic.lfd = fv_nic.kickfd = fv_nic.epfd = -1;
    return rc;
  }
  fv_nic.running = 1;
  return 0;
}

void fv_nic_stop(void)
{
  pthread_mutex_lock(&fv_nic.lock);
  fv_nic.stop = 1;
  fv_nic_kick();
  pthread_mutex_unlock(&fv_nic.lock);
  pthread_join(fv_nic.thread, NULL);
  pthread_mutex_lock(&fv_nic.lock);
  fv_nic.running = 0;
  while (fv_nic.conns) {
    struct fv_conn *c = fv_nic.conns;
    fv_nic.conns = c->next;
    fv_rx_free(c);
  }
  while (fv_nic.graveyard) {
    struct fv_conn *c = fv_nic.graveyard;
    fv_nic.graveyard = c->next;
    free(c->tx);
    free(c);
  }
  close(fv_nic.lfd);
  close(fv_nic.kickfd);
  close(fv_nic.epfd);
  fv_nic.lfd = fv_nic.kickfd = fv_nic.epfd = -1;
  if (fv_nic.nmrs) {
    int live = 0;
    for (uint32_t i = 0; i < fv_nic.nmrs; i++)
      live += fv_nic.mrs[i] != NULL;
    if (!live) {
      free(fv_nic.mrs);
      free(fv_nic.mrgen);
      fv_nic.mrs = NULL;
      fv_nic.mrgen = NULL;
      fv_nic.nmrs = 0;
    }
  }
  pthread_mutex_unlock(&fv_nic.lock);
}
