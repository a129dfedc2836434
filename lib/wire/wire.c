/* The wire format: encodes and strictly parses the fixed message header,
 * and checks payloads against it. Layout and rules: docs/wire-format.md. */
#include "wire.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <epipe/common.h>

#include "../codec/payload.h"
#include "../error.h"
#include "crc32c.h"

/* Field offsets in the header. The first 8 bytes and the CRC in the last 4
 * bytes of the header are frozen for every version. */
enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 4,
    OFF_HLEN = 6,
    OFF_KIND = 8,
    OFF_DTYPE = 9,
    OFF_NDIM = 10,
    OFF_CODEC = 11,
    OFF_FLAGS = 12,
    OFF_PARAM = 16,
    OFF_MB = 20,
    OFF_STEP = 24,
    OFF_SRC = 32,
    OFF_DST = 36,
    OFF_PLEN = 40,
    OFF_PCRC = 48,
    OFF_RESERVED = 52,
    OFF_SHAPE = 56,
    OFF_EXT = OFF_SHAPE + 8 * EPIPE_MAX_NDIM, /* 184: extension area */
};
_Static_assert(OFF_EXT + 8 == EPIPE_WIRE_HEADER_SIZE, "v1 header: 4 extension + 4 CRC bytes");
_Static_assert(sizeof(epipe_wire_header) == 56 + 8 * EPIPE_MAX_NDIM, "no padding");
_Static_assert(EPIPE_WIRE_HEADER_SIZE % 64 == 0, "payloads start cache-line aligned");

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static int is_tensor_kind(unsigned kind)
{
    return kind == EPIPE_WIRE_ACTIVATION || kind == EPIPE_WIRE_GRADIENT;
}

const char *epipe_wire_kind_name(unsigned kind)
{
    static const char *const names[] = {"invalid",   "activation", "gradient", "hello",
                                        "heartbeat", "error",      "bye"};
    return kind <= EPIPE_WIRE_KIND_MAX ? names[kind] : "unknown";
}

/* Records "wire: ..." and returns st; when encoding, every invalid field is
 * the caller's mistake and returns EPIPE_EINVAL instead. */
__attribute__((format(printf, 3, 4))) static int bad(int encoding, int st, const char *fmt, ...)
{
    char msg[EPIPE_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (encoding)
        return epipe_fail(EPIPE_EINVAL, "wire: cannot encode: %s", msg);
    return epipe_fail(st, "wire: %s", msg);
}

static int numel_of(const epipe_wire_header *h, int encoding, uint64_t *numel)
{
    uint64_t n = 1;
    int zero = 0;
    for (unsigned i = 0; i < h->ndim && i < EPIPE_MAX_NDIM; i++) {
        if (h->shape[i] > (uint64_t)INT64_MAX)
            return bad(encoding, EPIPE_EOVERFLOW, "shape dim %u = %llu exceeds INT64_MAX", i,
                       (unsigned long long)h->shape[i]);
        if (h->shape[i] == 0)
            zero = 1;
        else if (!zero && n > (uint64_t)INT64_MAX / h->shape[i])
            return bad(encoding, EPIPE_EOVERFLOW,
                       "shape product overflows INT64_MAX at dim %u (%llu x %llu)", i,
                       (unsigned long long)n, (unsigned long long)h->shape[i]);
        else if (!zero)
            n *= h->shape[i];
    }
    *numel = zero ? 0 : n;
    return EPIPE_OK;
}

int epipe_wire_numel(const epipe_wire_header *h, uint64_t *numel)
{
    *numel = 0;
    if (h->ndim > EPIPE_MAX_NDIM)
        return epipe_fail(EPIPE_EPROTO, "wire: ndim %u exceeds the maximum %d", h->ndim,
                          EPIPE_MAX_NDIM);
    return numel_of(h, 0, numel);
}

/* The checks on decoded fields, shared by the parser and the encoder (in
 * the order docs/wire-format.md lists, after magic, length, CRC, version). */
static int check_fields(const epipe_wire_header *h, uint64_t max_payload, int encoding)
{
    const char *kn = epipe_wire_kind_name(h->kind);
    if (h->kind == 0 || h->kind > EPIPE_WIRE_KIND_MAX)
        return bad(encoding, EPIPE_EPROTO, "unknown message kind %u (known: 1..%d)", h->kind,
                   EPIPE_WIRE_KIND_MAX);
    if (h->flags & ~EPIPE_WIRE_FLAGS_KNOWN)
        return bad(encoding, EPIPE_EPROTO,
                   "unknown flags 0x%08x in a %s message (version %d defines 0x%08x)", h->flags, kn,
                   EPIPE_WIRE_VERSION, EPIPE_WIRE_FLAGS_KNOWN);
    if (h->payload_len > max_payload)
        return bad(encoding, EPIPE_ETOOBIG, "%s payload length %llu exceeds the limit %llu", kn,
                   (unsigned long long)h->payload_len, (unsigned long long)max_payload);
    if (h->ndim > EPIPE_MAX_NDIM)
        return bad(encoding, EPIPE_EPROTO, "ndim %u exceeds the maximum %d", h->ndim,
                   EPIPE_MAX_NDIM);
    for (unsigned i = h->ndim; i < EPIPE_MAX_NDIM; i++)
        if (h->shape[i] != 0)
            return bad(encoding, EPIPE_EPROTO,
                       "shape slot %u is %llu but ndim is %u; unused slots must be zero", i,
                       (unsigned long long)h->shape[i], h->ndim);
    if (!is_tensor_kind(h->kind)) {
        const char *field = h->codec_id      ? "codec id"
                            : h->codec_param ? "codec param"
                            : h->dtype       ? "dtype"
                            : h->ndim        ? "ndim"
                                             : NULL;
        unsigned long long v = h->codec_id      ? h->codec_id
                               : h->codec_param ? h->codec_param
                               : h->dtype       ? h->dtype
                                                : h->ndim;
        if (field)
            return bad(encoding, EPIPE_EPROTO, "%s message has %s %llu; it must be 0 (no tensor)",
                       kn, field, v);
        return EPIPE_OK;
    }
    if (h->dtype > EPIPE_DTYPE_BF16)
        return bad(encoding, EPIPE_EPROTO,
                   "unknown dtype %u in a %s message (known: 0 f32, 1 f16, 2 bf16)", h->dtype, kn);
    if (h->codec_id == 0)
        return bad(encoding, EPIPE_EPROTO, "%s message has codec id 0", kn);
    uint64_t n;
    int rc = numel_of(h, encoding, &n);
    if (rc)
        return rc;
    if (h->payload_len < EPIPE_PAYLOAD_HEADER)
        return bad(encoding, EPIPE_EPROTO,
                   "%s payload length %llu is shorter than the %d-byte codec payload header", kn,
                   (unsigned long long)h->payload_len, EPIPE_PAYLOAD_HEADER);
    return EPIPE_OK;
}

void epipe_wire_set_payload(epipe_wire_header *h, const void *payload, size_t len)
{
    h->payload_len = len;
    h->payload_crc = epipe_crc32c(0, payload, len);
}

int epipe_wire_encode_header(const epipe_wire_header *h, uint8_t *out, size_t cap)
{
    if (!h || !out)
        return epipe_fail(EPIPE_EINVAL, "wire: cannot encode: header or output is NULL");
    if (cap < EPIPE_WIRE_HEADER_SIZE)
        return epipe_fail(EPIPE_ENOSPC, "wire: header needs %d bytes; capacity is %zu",
                          EPIPE_WIRE_HEADER_SIZE, cap);
    int rc = check_fields(h, UINT64_MAX, 1);
    if (rc)
        return rc;
    uint8_t *p = out;
    memset(p, 0, EPIPE_WIRE_HEADER_SIZE);
    memcpy(p + OFF_MAGIC, EPIPE_WIRE_MAGIC, 4);
    put_u16(p + OFF_VERSION, EPIPE_WIRE_VERSION);
    put_u16(p + OFF_HLEN, EPIPE_WIRE_HEADER_SIZE);
    p[OFF_KIND] = h->kind;
    p[OFF_DTYPE] = h->dtype;
    p[OFF_NDIM] = h->ndim;
    p[OFF_CODEC] = h->codec_id;
    epipe_put_u32(p + OFF_FLAGS, h->flags);
    epipe_put_u32(p + OFF_PARAM, h->codec_param);
    epipe_put_u32(p + OFF_MB, h->micro_batch);
    epipe_put_u64(p + OFF_STEP, h->step);
    epipe_put_u32(p + OFF_SRC, h->src_stage);
    epipe_put_u32(p + OFF_DST, h->dst_stage);
    epipe_put_u64(p + OFF_PLEN, h->payload_len);
    epipe_put_u32(p + OFF_PCRC, h->payload_crc);
    for (unsigned i = 0; i < h->ndim; i++)
        epipe_put_u64(p + OFF_SHAPE + 8 * i, h->shape[i]);
    epipe_put_u32(p + OFF_EXT, h->schedule_tag);
    epipe_put_u32(p + EPIPE_WIRE_HEADER_SIZE - 4, epipe_crc32c(0, p, EPIPE_WIRE_HEADER_SIZE - 4));
    return EPIPE_OK;
}

int epipe_wire_header_length(const uint8_t *buf, size_t len, size_t *header_len)
{
    *header_len = 0;
    if (len < EPIPE_WIRE_PREFIX_SIZE || !buf)
        return epipe_fail(EPIPE_ETRUNC, "wire: message is %zu bytes; its fixed prefix alone is %d",
                          buf ? len : 0, EPIPE_WIRE_PREFIX_SIZE);
    if (memcmp(buf + OFF_MAGIC, EPIPE_WIRE_MAGIC, 4) != 0)
        return epipe_fail(EPIPE_EPROTO,
                          "wire: bad magic %02x %02x %02x %02x (expected \"%s\"): not a libepipe "
                          "message, or the stream lost its framing",
                          buf[0], buf[1], buf[2], buf[3], EPIPE_WIRE_MAGIC);
    unsigned hlen = get_u16(buf + OFF_HLEN);
    if (hlen < EPIPE_WIRE_HEADER_SIZE || hlen > EPIPE_WIRE_HEADER_MAX || hlen % 8)
        return epipe_fail(EPIPE_EPROTO, "wire: header length %u is not a multiple of 8 in %d..%d",
                          hlen, EPIPE_WIRE_HEADER_SIZE, EPIPE_WIRE_HEADER_MAX);
    *header_len = hlen;
    return EPIPE_OK;
}

int epipe_wire_parse_header(const uint8_t *buf, size_t len, const epipe_wire_limits *lim,
                            epipe_wire_header *out)
{
    memset(out, 0, sizeof *out);
    size_t hlen;
    int rc = epipe_wire_header_length(buf, len, &hlen);
    if (rc)
        return rc;
    if (len < hlen)
        return epipe_fail(EPIPE_ETRUNC, "wire: header truncated: %zu of its %zu bytes", len, hlen);
    uint32_t want = epipe_get_u32(buf + hlen - 4), got = epipe_crc32c(0, buf, hlen - 4);
    if (want != got)
        return epipe_fail(EPIPE_ECHECKSUM,
                          "wire: header CRC32C is 0x%08x but its %zu bytes give 0x%08x: the "
                          "header is corrupted",
                          want, hlen - 4, got);
    unsigned version = get_u16(buf + OFF_VERSION);
    if (version != EPIPE_WIRE_VERSION)
        return epipe_fail(EPIPE_EVERSION,
                          "wire: message has wire version %u; this library speaks %d", version,
                          EPIPE_WIRE_VERSION);
    uint32_t reserved = epipe_get_u32(buf + OFF_RESERVED);
    if (reserved)
        return epipe_fail(EPIPE_EPROTO,
                          "wire: reserved header bytes %d..%d are 0x%08x; they must be zero",
                          OFF_RESERVED, OFF_RESERVED + 3, reserved);
    epipe_wire_header h = {
        .version = (uint16_t)version,
        .header_len = (uint16_t)hlen,
        .kind = buf[OFF_KIND],
        .dtype = buf[OFF_DTYPE],
        .ndim = buf[OFF_NDIM],
        .codec_id = buf[OFF_CODEC],
        .flags = epipe_get_u32(buf + OFF_FLAGS),
        .codec_param = epipe_get_u32(buf + OFF_PARAM),
        .micro_batch = epipe_get_u32(buf + OFF_MB),
        .step = epipe_get_u64(buf + OFF_STEP),
        .src_stage = epipe_get_u32(buf + OFF_SRC),
        .dst_stage = epipe_get_u32(buf + OFF_DST),
        .payload_len = epipe_get_u64(buf + OFF_PLEN),
        .payload_crc = epipe_get_u32(buf + OFF_PCRC),
        .schedule_tag = epipe_get_u32(buf + OFF_EXT),
    };
    for (unsigned i = 0; i < EPIPE_MAX_NDIM; i++)
        h.shape[i] = epipe_get_u64(buf + OFF_SHAPE + 8 * i);
    uint64_t max = lim && lim->max_payload ? lim->max_payload : EPIPE_WIRE_DEFAULT_MAX_PAYLOAD;
    if (max > SIZE_MAX - hlen)
        max = SIZE_MAX - hlen; /* the whole message must fit in memory */
    if ((rc = check_fields(&h, max, 0)))
        return rc;
    *out = h;
    return EPIPE_OK;
}

int epipe_wire_check_payload(const epipe_wire_header *h, const uint8_t *payload, size_t len)
{
    return epipe_wire_check_payload_crc(h, payload, len, NULL);
}

int epipe_wire_check_payload_crc(const epipe_wire_header *h, const uint8_t *payload, size_t len,
                                 const uint32_t *crc)
{
    const char *kn = epipe_wire_kind_name(h->kind);
    if (!payload && len)
        return epipe_fail(EPIPE_EINVAL, "wire: payload is NULL");
    if (len < h->payload_len)
        return epipe_fail(EPIPE_ETRUNC, "wire: %s payload truncated: %zu of its %llu bytes", kn,
                          len, (unsigned long long)h->payload_len);
    if (len > h->payload_len)
        return epipe_fail(EPIPE_EPROTO, "wire: %s payload is %zu bytes but the header says %llu",
                          kn, len, (unsigned long long)h->payload_len);
    uint32_t got = crc ? *crc : epipe_crc32c(0, payload, len);
    if (got != h->payload_crc)
        return epipe_fail(EPIPE_ECHECKSUM,
                          "wire: %s payload CRC32C is 0x%08x but the header says 0x%08x: the "
                          "payload (%zu bytes) is corrupted",
                          kn, got, h->payload_crc, len);
    if (!is_tensor_kind(h->kind))
        return EPIPE_OK;
    epipe_payload_header ph;
    if (epipe_payload_get(payload, len, &ph)) /* the parser already refused this header */
        return epipe_fail(EPIPE_EPROTO, "wire: %s payload of %zu bytes has no codec header", kn,
                          len);
    uint64_t n;
    int rc = epipe_wire_numel(h, &n);
    if (rc)
        return rc;
    uint32_t param = ph.param_word;
    uint64_t count = ph.count;
    if (ph.codec_id != h->codec_id)
        return epipe_fail(EPIPE_EPROTO, "wire: %s payload has codec id %u; the header says %u", kn,
                          ph.codec_id, h->codec_id);
    if (ph.dtype != h->dtype)
        return epipe_fail(EPIPE_EPROTO, "wire: %s payload has dtype %u; the header says %u", kn,
                          ph.dtype, h->dtype);
    if (param != h->codec_param)
        return epipe_fail(
            EPIPE_EPROTO,
            "wire: %s payload has codec parameter word 0x%08x; the header says 0x%08x", kn, param,
            h->codec_param);
    if (count != n)
        return epipe_fail(EPIPE_EPROTO,
                          "wire: %s payload holds %llu values; the header's shape has %llu", kn,
                          (unsigned long long)count, (unsigned long long)n);
    return EPIPE_OK;
}

size_t epipe_wire_message_size(size_t payload_len)
{
    return payload_len > SIZE_MAX - EPIPE_WIRE_HEADER_SIZE ? 0
                                                           : payload_len + EPIPE_WIRE_HEADER_SIZE;
}

int epipe_wire_frame(const epipe_wire_header *h, const void *payload, size_t payload_len,
                     uint8_t *out, size_t cap, size_t *written)
{
    *written = 0;
    if (!h || (!payload && payload_len))
        return epipe_fail(EPIPE_EINVAL, "wire: cannot frame: header or payload is NULL");
    size_t need = epipe_wire_message_size(payload_len);
    if (need == 0)
        return epipe_fail(EPIPE_EOVERFLOW, "wire: a %zu-byte payload overflows size_t when framed",
                          payload_len);
    if (!out || cap < need)
        return epipe_fail(EPIPE_ENOSPC,
                          "wire: framing a %zu-byte payload needs %zu bytes; capacity is %zu",
                          payload_len, need, out ? cap : 0);
    epipe_wire_header hh = *h;
    epipe_wire_set_payload(&hh, payload, payload_len);
    int rc = epipe_wire_encode_header(&hh, out, cap);
    if (rc)
        return rc;
    if (payload_len && payload != out + EPIPE_WIRE_HEADER_SIZE)
        memmove(out + EPIPE_WIRE_HEADER_SIZE, payload, payload_len);
    *written = need;
    return EPIPE_OK;
}

int epipe_wire_parse(const uint8_t *buf, size_t len, const epipe_wire_limits *lim,
                     epipe_wire_header *out, const uint8_t **payload)
{
    *payload = NULL;
    int rc = epipe_wire_parse_header(buf, len, lim, out);
    if (rc)
        return rc;
    if ((rc = epipe_wire_check_payload(out, buf + out->header_len, len - out->header_len))) {
        memset(out, 0, sizeof *out);
        return rc;
    }
    *payload = buf + out->header_len;
    return EPIPE_OK;
}
