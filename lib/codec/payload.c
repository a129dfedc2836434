/* The codec payload header: its layout, written and read here and nowhere
 * else (docs/codecs.md, "Payload header"). */
#include "payload.h"

#include "../tensor.h"

enum { OFF_ID = 0, OFF_VERSION = 1, OFF_DTYPE = 2, OFF_RESERVED = 3, OFF_WORD = 4, OFF_COUNT = 8 };
_Static_assert(OFF_COUNT + 8 == EPIPE_PAYLOAD_HEADER, "16-byte payload header");

void epipe_payload_put(uint8_t *p, unsigned codec_id, unsigned dtype, uint32_t param_word,
                       uint64_t count)
{
    p[OFF_ID] = (uint8_t)codec_id;
    p[OFF_VERSION] = EPIPE_PAYLOAD_VERSION;
    p[OFF_DTYPE] = (uint8_t)dtype;
    p[OFF_RESERVED] = 0;
    epipe_put_u32(p + OFF_WORD, param_word);
    epipe_put_u64(p + OFF_COUNT, count);
}

int epipe_payload_get(const uint8_t *p, size_t len, epipe_payload_header *h)
{
    if (len < EPIPE_PAYLOAD_HEADER)
        return -1;
    h->codec_id = p[OFF_ID];
    h->version = p[OFF_VERSION];
    h->dtype = p[OFF_DTYPE];
    h->reserved = p[OFF_RESERVED];
    h->param_word = epipe_get_u32(p + OFF_WORD);
    h->count = epipe_get_u64(p + OFF_COUNT);
    return 0;
}
