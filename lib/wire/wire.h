/* The wire format: the fixed header that frames every message between
 * stages, its strict parser, and the payload check (docs/wire-format.md). */
#ifndef EPIPE_LIB_WIRE_WIRE_H
#define EPIPE_LIB_WIRE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "../tensor.h" /* EPIPE_MAX_NDIM, enum epipe_dtype */

#define EPIPE_WIRE_MAGIC "EPIW"    /* bytes 0-3 of every message */
#define EPIPE_WIRE_VERSION 1       /* the only version this library speaks */
#define EPIPE_WIRE_PREFIX_SIZE 8   /* magic, version, header length: frozen */
#define EPIPE_WIRE_HEADER_SIZE 192 /* header length this library writes */
#define EPIPE_WIRE_HEADER_MAX 4096 /* longest header a reader accepts */
/* Default for epipe_wire_limits.max_payload: 1 GiB. */
#define EPIPE_WIRE_DEFAULT_MAX_PAYLOAD (UINT64_C(1) << 30)

/* Message kinds (byte 8). Values are written on the wire, never reused. */
enum epipe_wire_kind {
    EPIPE_WIRE_ACTIVATION = 1, /* forward tensor: payload is a codec payload */
    EPIPE_WIRE_GRADIENT = 2,   /* backward tensor: payload is a codec payload */
    EPIPE_WIRE_HELLO = 3,      /* connection setup: transport-defined payload */
    EPIPE_WIRE_HEARTBEAT = 4,  /* liveness: payload usually empty */
    EPIPE_WIRE_ERROR = 5,      /* the sender failed: payload is UTF-8 text */
    EPIPE_WIRE_BYE = 6,        /* orderly close */
};
#define EPIPE_WIRE_KIND_MAX 6

/* No flag is defined in version 1; every flag bit must be zero. */
#define EPIPE_WIRE_FLAGS_KNOWN 0u

/* A decoded header; the field order is not the byte layout, and leaves no
 * padding, so headers compare with memcmp. Tensor fields (codec_id,
 * codec_param, dtype, ndim, shape) are used by ACTIVATION and GRADIENT and
 * must be zero otherwise. */
typedef struct epipe_wire_header {
    uint16_t version;     /* parse: as read; encode writes EPIPE_WIRE_VERSION */
    uint16_t header_len;  /* parse: as read; encode writes EPIPE_WIRE_HEADER_SIZE */
    uint8_t kind;         /* enum epipe_wire_kind */
    uint8_t dtype;        /* enum epipe_dtype of the tensor */
    uint8_t ndim;         /* 0..EPIPE_MAX_NDIM */
    uint8_t codec_id;     /* enum epipe_codec_id, copied from the payload */
    uint32_t flags;       /* must be 0 in version 1 */
    uint32_t codec_param; /* codec parameter word, copied from the payload */
    uint32_t micro_batch;
    uint32_t payload_crc; /* CRC32C of the payload */
    uint64_t step;
    uint32_t src_stage, dst_stage;
    uint64_t payload_len;           /* bytes after the header */
    uint64_t shape[EPIPE_MAX_NDIM]; /* dims [0, ndim); the rest zero */
    /* Tensor kinds: the sender's schedule tag (bytes 184..187, in the
     * extension area, so a reader that predates it ignores it): the stage
     * runtime's fingerprint of the schedule it runs, 0 = not stated. */
    uint32_t schedule_tag;
    uint32_t unused; /* not on the wire; 0 (keeps the struct free of padding) */
} epipe_wire_header;

/* What a receiver accepts. A NULL pointer means the defaults. */
typedef struct epipe_wire_limits {
    uint64_t max_payload; /* 0 = EPIPE_WIRE_DEFAULT_MAX_PAYLOAD */
} epipe_wire_limits;

/* Every function below sets the calling thread's last-error message when it
 * fails ("wire: ..." naming the field and values) and is thread-safe. */

/* Fills payload_len and payload_crc from the payload the message carries. */
void epipe_wire_set_payload(epipe_wire_header *h, const void *payload, size_t len);

/* Writes the EPIPE_WIRE_HEADER_SIZE-byte header of version 1, header CRC
 * included. The header is checked as a reader would (EPIPE_EINVAL naming
 * the bad field; no payload limit applies); EPIPE_ENOSPC if cap is short. */
int epipe_wire_encode_header(const epipe_wire_header *h, uint8_t *out, size_t cap);

/* Streaming step 1: from the first EPIPE_WIRE_PREFIX_SIZE bytes, the length
 * of the whole header (read that many bytes, then parse them). Checks the
 * magic and the header length only. EPIPE_ETRUNC if len < 8, EPIPE_EPROTO
 * for a bad magic or a header length outside
 * [EPIPE_WIRE_HEADER_SIZE, EPIPE_WIRE_HEADER_MAX] or not a multiple of 8. */
int epipe_wire_header_length(const uint8_t *buf, size_t len, size_t *header_len);

/* Streaming step 2: parses and validates the header at buf (len may exceed
 * the header; only header_len bytes are read). On success *out holds it and
 * the payload of out->payload_len bytes follows at buf + out->header_len.
 * Order of checks and their statuses: docs/wire-format.md. On failure *out
 * is zeroed. */
int epipe_wire_parse_header(const uint8_t *buf, size_t len, const epipe_wire_limits *lim,
                            epipe_wire_header *out);

/* Streaming step 3: checks a received payload against its parsed header:
 * length (EPIPE_ETRUNC short, EPIPE_EPROTO long), CRC (EPIPE_ECHECKSUM),
 * and for tensor kinds that the codec payload header agrees with the wire
 * header's codec id, parameter word, dtype and element count (EPIPE_EPROTO). */
int epipe_wire_check_payload(const epipe_wire_header *h, const uint8_t *payload, size_t len);
/* The same with the payload's CRC32C already computed (a receiver that
 * checksums each chunk as it arrives, while it is in cache); NULL = compute. */
int epipe_wire_check_payload_crc(const epipe_wire_header *h, const uint8_t *payload, size_t len,
                                 const uint32_t *crc);

/* Bytes of a whole framed message with this payload; 0 on overflow. */
size_t epipe_wire_message_size(size_t payload_len);

/* One shot: writes header and payload into out (cap bytes), taking the
 * payload length and CRC from the payload (h's are ignored). The payload
 * may already sit at out + EPIPE_WIRE_HEADER_SIZE (a codec encoded it in
 * place): then nothing is copied. *written = bytes used. */
int epipe_wire_frame(const epipe_wire_header *h, const void *payload, size_t payload_len,
                     uint8_t *out, size_t cap, size_t *written);

/* One shot: a whole message in buf[0, len), nothing after it (trailing
 * bytes are EPIPE_EPROTO). On success *payload points into buf. */
int epipe_wire_parse(const uint8_t *buf, size_t len, const epipe_wire_limits *lim,
                     epipe_wire_header *out, const uint8_t **payload);

/* Elements of the header's tensor: the product of its dims (1 for ndim 0).
 * EPIPE_EOVERFLOW if a dim or the product exceeds INT64_MAX. */
int epipe_wire_numel(const epipe_wire_header *h, uint64_t *numel);

/* "activation", "gradient", ... or "unknown". */
const char *epipe_wire_kind_name(unsigned kind);

#endif
