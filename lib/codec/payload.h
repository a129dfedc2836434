/* The 16-byte header every codec payload starts with (docs/codecs.md):
 * the one place its layout is written and read. */
#ifndef EPIPE_LIB_CODEC_PAYLOAD_H
#define EPIPE_LIB_CODEC_PAYLOAD_H

#include <stddef.h>
#include <stdint.h>

/* Bytes of the header, and the format version this library writes. */
#define EPIPE_PAYLOAD_HEADER 16
#define EPIPE_PAYLOAD_VERSION 1

/* The header's fields, as read; epipe_payload_put() writes version
 * EPIPE_PAYLOAD_VERSION and a zero reserved byte whatever they hold. */
typedef struct epipe_payload_header {
    uint8_t codec_id;    /* enum epipe_codec_id of the codec that wrote it */
    uint8_t version;     /* payload format version */
    uint8_t dtype;       /* enum epipe_dtype of the encoded tensor */
    uint8_t reserved;    /* 0 */
    uint32_t param_word; /* the parameters a decoder must share */
    uint64_t count;      /* element count */
} epipe_payload_header;

/* Writes the header into p[0..EPIPE_PAYLOAD_HEADER). */
void epipe_payload_put(uint8_t *p, unsigned codec_id, unsigned dtype, uint32_t param_word,
                       uint64_t count);

/* Reads the header of p[0..len) into *h without judging it. Returns 0, or
 * -1 if len < EPIPE_PAYLOAD_HEADER (then *h is untouched). */
int epipe_payload_get(const uint8_t *p, size_t len, epipe_payload_header *h);

#endif
