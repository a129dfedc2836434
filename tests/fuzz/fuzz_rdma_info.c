/* Fuzz target: the rdma transport's queue-pair information decoder
 * (transport/rdma_info.c), which reads a peer's record before any verbs
 * call uses it. Any bytes either fail with a message, or decode to
 * information whose record decodes to the same information. */
#include <stdlib.h>
#include <string.h>

#include <epipe/common.h>

#include "../../transport/rdma_info.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct epipe_rdma_info a, b;
    if (epipe_rdma_info_decode(data, size, &a, 1) != EPIPE_OK) {
        if (epipe_last_error()[0] == '\0')
            abort();
        return 0;
    }
    if (!memchr(a.why, 0, sizeof a.why))
        abort();
    uint8_t p[EPIPE_RDMA_INFO_SIZE];
    epipe_rdma_info_encode(&a, p);
    if (epipe_rdma_info_decode(p, sizeof p, &b, 1) != EPIPE_OK || a.usable != b.usable ||
        strcmp(a.why, b.why) || a.mtu != b.mtu || a.qpn != b.qpn || a.psn != b.psn ||
        memcmp(a.gid, b.gid, sizeof a.gid) || a.lid != b.lid || a.ring != b.ring ||
        a.ring_rkey != b.ring_rkey)
        abort();
    return 0;
}
