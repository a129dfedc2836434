/* The queue-pair information of one rdma link (transport/rdma_info.c):
 * what a rank tells its peer over their TCP link so that the peer can
 * connect its queue pair and write into its ring, or why it cannot. */
#ifndef EPIPE_TRANSPORT_RDMA_INFO_H
#define EPIPE_TRANSPORT_RDMA_INFO_H

#include <stddef.h>
#include <stdint.h>

#define EPIPE_RDMA_INFO_SIZE 96

struct epipe_rdma_info {
    int usable;
    char why[40]; /* why not, when not usable */
    uint8_t mtu;
    uint32_t qpn, psn;
    uint8_t gid[16];
    uint16_t lid;
    uint64_t ring;
    uint32_t ring_rkey;
};

/* The record of `in`, with this build's slot and ring geometry. */
void epipe_rdma_info_encode(const struct epipe_rdma_info *in, uint8_t p[EPIPE_RDMA_INFO_SIZE]);
/* A peer's record p[0..len), every byte hostile: EPIPE_OK and *out;
 * EPIPE_EPROTO naming the bad field (length, magic, flag, path MTU, queue
 * pair or sequence number, geometry unlike this build's, ring address, an
 * unterminated reason); EPIPE_EVERSION for another version. `peer` names
 * the rank in the message. */
int epipe_rdma_info_decode(const uint8_t *p, size_t len, struct epipe_rdma_info *out,
                           unsigned peer);

#endif
