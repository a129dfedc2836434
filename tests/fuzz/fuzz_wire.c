/* Fuzz target: the wire parser on arbitrary bytes, taken as one whole
 * message and through the streaming steps. Never crashes; every rejection
 * says why; what parses re-encodes to the same bytes. */
#include <stdlib.h>
#include <string.h>

#include <epipe/common.h>

#include "error.h"
#include "fuzz.h"
#include "wire/wire.h"

static void must_explain(int rc)
{
    if (rc != EPIPE_OK && epipe_last_error()[0] == '\0')
        abort(); /* every failure must say why */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    epipe_wire_limits lim = {.max_payload = 1u << 20};
    epipe_wire_header h, hs;
    const uint8_t *payload;

    epipe_clear_error();
    int rc = epipe_wire_parse(data, size, &lim, &h, &payload);
    must_explain(rc);

    /* Streaming: prefix, header, then the payload bytes that are there. */
    size_t hlen;
    epipe_clear_error();
    int rs = epipe_wire_header_length(data, size, &hlen);
    must_explain(rs);
    if (rs == EPIPE_OK) {
        epipe_clear_error();
        rs = epipe_wire_parse_header(data, size, &lim, &hs);
        must_explain(rs);
    }
    if (rs == EPIPE_OK) {
        if (hs.header_len != hlen)
            abort();
        size_t avail = size - hlen;
        epipe_clear_error();
        rs = epipe_wire_check_payload(&hs, data + hlen, avail);
        must_explain(rs);
        /* The header re-encodes to the same bytes, but for its length
         * and what follows the fixed fields (extension area, CRC). */
        uint8_t again[EPIPE_WIRE_HEADER_SIZE];
        if (epipe_wire_encode_header(&hs, again, sizeof again) != EPIPE_OK)
            abort();
        if (memcmp(again, data, 6) != 0 ||
            memcmp(again + 8, data + 8, EPIPE_WIRE_HEADER_SIZE - 16) != 0)
            abort(); /* bytes 6-7: the header length, longer in data */
    }
    /* The one-shot and the streaming parse agree. */
    if ((rc == EPIPE_OK) != (rs == EPIPE_OK))
        abort();
    if (rc != EPIPE_OK)
        return 0;
    if (memcmp(&h, &hs, sizeof h) != 0 || payload != data + h.header_len)
        abort();

    /* Framing what was parsed gives a message that parses to the same. */
    size_t n = epipe_wire_message_size(h.payload_len), w;
    uint8_t *buf = malloc(n);
    if (!buf)
        return 0;
    epipe_wire_header back;
    const uint8_t *p2;
    if (epipe_wire_frame(&h, payload, h.payload_len, buf, n, &w) != EPIPE_OK || w != n ||
        epipe_wire_parse(buf, n, &lim, &back, &p2) != EPIPE_OK)
        abort();
    back.header_len = h.header_len;
    if (memcmp(&back, &h, sizeof h) != 0)
        abort();
    free(buf);
    return 0;
}
