/* The queue-pair information two ranks exchange on their TCP link before
 * they talk verbs (rdma_info.h): a fixed 96-byte record, every field of a
 * peer's checked before it is used. */
#include "rdma_info.h"

#include <string.h>

#include "../lib/error.h"
#include "../lib/tensor.h"
#include "rdma.h"
#include "rdma_impl.h"
#include "tcp_setup.h"

#define INFO_VERSION 1

static int corrupt_field = -1; /* tests: epipe_rdma_debug_corrupt_info */

void epipe_rdma_debug_corrupt_info(int field)
{
    corrupt_field = field;
}

void epipe_rdma_info_encode(const struct epipe_rdma_info *in, uint8_t p[EPIPE_RDMA_INFO_SIZE])
{
    memset(p, 0, EPIPE_RDMA_INFO_SIZE);
    memcpy(p, "EPRD", 4);
    epipe_tcp_put_u16(p + 4, INFO_VERSION);
    p[6] = (uint8_t)in->usable;
    p[7] = in->mtu;
    epipe_put_u32(p + 8, in->qpn);
    epipe_put_u32(p + 12, in->psn);
    memcpy(p + 16, in->gid, 16);
    epipe_tcp_put_u16(p + 32, in->lid);
    epipe_tcp_put_u16(p + 34, RDMA_SLOTS);
    epipe_put_u32(p + 36, RDMA_SLOT_SIZE);
    epipe_put_u64(p + 40, in->ring);
    epipe_put_u32(p + 48, in->ring_rkey);
    epipe_tcp_put_u16(p + 52, RDMA_RING);
    epipe_tcp_put_u16(p + 54, RDMA_LARGE);
    memcpy(p + 56, in->why, strnlen(in->why, sizeof in->why - 1));
    switch (corrupt_field) {
    case 0: p[0] = 'X'; break;               /* magic */
    case 1: p[7] = 9; break;                 /* path mtu */
    case 2: epipe_put_u32(p + 8, 0); break;  /* qp number */
    case 3: epipe_put_u32(p + 36, 7); break; /* slot size */
    case 4: memset(p + 56, 'x', 40); break;  /* text without its end */
    default: break;
    }
}

int epipe_rdma_info_decode(const uint8_t *p, size_t len, struct epipe_rdma_info *out, unsigned peer)
{
    memset(out, 0, sizeof *out);
    const char *bad = NULL;
    if (len != EPIPE_RDMA_INFO_SIZE)
        bad = "length";
    else if (memcmp(p, "EPRD", 4))
        bad = "magic";
    else if (epipe_tcp_get_u16(p + 4) != INFO_VERSION)
        return epipe_fail(EPIPE_EVERSION,
                          "rdma: rank %u speaks queue-pair information version "
                          "%u, this rank %d",
                          peer, epipe_tcp_get_u16(p + 4), INFO_VERSION);
    else if (p[6] > 1)
        bad = "usable flag";
    else if (!memchr(p + 56, 0, 40))
        bad = "reason text (not terminated)";
    if (!bad && p[6]) {
        out->usable = 1;
        out->mtu = p[7];
        out->qpn = epipe_get_u32(p + 8);
        out->psn = epipe_get_u32(p + 12);
        memcpy(out->gid, p + 16, 16);
        out->lid = (uint16_t)epipe_tcp_get_u16(p + 32);
        out->ring = epipe_get_u64(p + 40);
        out->ring_rkey = epipe_get_u32(p + 48);
        if (out->mtu < IBV_MTU_256 || out->mtu > IBV_MTU_4096)
            bad = "path mtu";
        else if (out->qpn == 0 || out->qpn > 0xffffff)
            bad = "queue pair number";
        else if (out->psn > 0xffffff)
            bad = "packet sequence number";
        else if (epipe_tcp_get_u16(p + 34) != RDMA_SLOTS ||
                 epipe_get_u32(p + 36) != RDMA_SLOT_SIZE ||
                 epipe_tcp_get_u16(p + 52) != RDMA_RING || epipe_tcp_get_u16(p + 54) != RDMA_LARGE)
            bad = "slot or ring geometry";
        else if (!out->ring)
            bad = "ring address";
    }
    if (bad)
        return epipe_fail(EPIPE_EPROTO,
                          "rdma: rank %u sent malformed queue-pair information: "
                          "bad %s",
                          peer, bad);
    memcpy(out->why, p + 56, 40);
    return EPIPE_OK;
}
