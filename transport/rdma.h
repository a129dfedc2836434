/* The rdma transport's entry point for epipe_comm_create and its test
 * hooks (internal: tests link the internal archive). */
#ifndef EPIPE_TRANSPORT_RDMA_H
#define EPIPE_TRANSPORT_RDMA_H

#include "../lib/comm/comm_impl.h"

/* "rdma" (is_auto 0) and "auto" (1) in epipe_comm_create. Runs the TCP
 * rendezvous with `options` (tcp's keys), then exchanges queue-pair
 * information on each TCP link. rdma: EPIPE_ENOTSUP naming what is missing
 * here (library, symbol, device, port) or which rank lacks it; auto: verbs
 * to every neighbour where both sides have an active device, tcp to the
 * others, and the log says which and why. */
int epipe_rdma_comm_create(epipe_comm **out, unsigned rank, unsigned size, const char *master_addr,
                           unsigned master_port, const char *options, int is_auto,
                           const epipe_comm_settings *s);

/* ---- test hooks ---- */

/* Memory regions the transport holds in this process (0: none leaked). */
long epipe_rdma_live_mrs(void);
/* Verbs links of c (0 for a communicator that is not rdma, or runs tcp). */
int epipe_rdma_debug_links(epipe_comm *c);
/* Makes the next queue-pair information this process sends malformed in
 * one field (0 magic, 1 mtu, 2 qp number, 3 slot size, 4 text); -1: off. */
void epipe_rdma_debug_corrupt_info(int field);
enum {
    EPIPE_RDMA_INJECT_SHORT_CTS = 1, /* the next large CTS to peer names half the buffer */
    EPIPE_RDMA_INJECT_UNKNOWN_IMM,   /* writes an immediate for a sequence never announced */
    EPIPE_RDMA_INJECT_UNLENT_SLOT,   /* writes an immediate naming a slot never lent */
    EPIPE_RDMA_INJECT_BOGUS_WC,      /* feeds c a completion for a request never posted */
    EPIPE_RDMA_INJECT_DUP_RTS,       /* announces c's next large message to peer twice */
};
/* Makes c misbehave towards peer as `what` says; EPIPE_EINVAL if c has no
 * verbs link to peer. */
int epipe_rdma_debug_inject(epipe_comm *c, unsigned peer, int what);

#endif
