/* The wire format: CRC32C paths agree with a bitwise reference; headers
 * round-trip; every malformed header or payload is refused with its own
 * status and a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "error.h"
#include "testutil.h"
#include "wire/crc32c.h"
#include "wire/wire.h"

#define HS EPIPE_WIRE_HEADER_SIZE

/* Runs a call with a cleared message; checks its status and that a failure
 * left a message. */
#define EXPECT(want, call)                                                                         \
    do {                                                                                           \
        epipe_clear_error();                                                                       \
        int rc_ = (call);                                                                          \
        if (rc_ != (want))                                                                         \
            print_error("%s: got %s, want %s (%s)\n", #call, epipe_status_name(rc_),               \
                        epipe_status_name(want), epipe_last_error());                              \
        assert_int_equal(rc_, (want));                                                             \
        if ((want) != EPIPE_OK)                                                                    \
            assert_true(strncmp(epipe_last_error(), "wire: ", 6) == 0);                            \
    } while (0)

static uint32_t crc_bitwise(uint32_t crc, const uint8_t *p, size_t n)
{
    crc = ~crc;
    while (n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

/* ---- CRC32C ------------------------------------------------------------- */

static void crc_check_value(void **state)
{
    (void)state;
    const char *s = "123456789";
    assert_int_equal(crc_bitwise(0, (const uint8_t *)s, 9), 0xE3069283u);
    assert_int_equal(epipe_crc32c_ref(0, s, 9), 0xE3069283u);
    assert_int_equal(epipe_crc32c_hw(0, s, 9), 0xE3069283u);
    assert_int_equal(epipe_crc32c(0, s, 9), 0xE3069283u);
    assert_int_equal(epipe_crc32c(0, NULL, 0), 0);
    /* RFC 3720 B.4: 32 bytes of zeros, of 0xFF. */
    uint8_t z[32];
    memset(z, 0, sizeof z);
    assert_int_equal(epipe_crc32c(0, z, 32), 0x8A9136AAu);
    memset(z, 0xFF, sizeof z);
    assert_int_equal(epipe_crc32c(0, z, 32), 0x62A8AB43u);
    if (!epipe_crc32c_hw_available())
        print_message("note: no hardware CRC32C on this CPU; the hw path is the reference\n");
}

static void crc_paths_agree(void **state)
{
    (void)state;
    enum { N = 4096 + 16 };
    uint8_t *buf = malloc(N);
    test_rng r;
    test_rng_seed(&r, 42);
    for (size_t i = 0; i < N; i++)
        buf[i] = (uint8_t)test_rng_next(&r);
    const size_t big[] = {511, 512, 1000, 4095, 4096};
    for (size_t off = 0; off < 16; off++)
        for (size_t k = 0; k < 301 + 5; k++) {
            size_t n = k <= 300 ? k : big[k - 301];
            uint32_t want = crc_bitwise(0, buf + off, n);
            assert_int_equal(epipe_crc32c_ref(0, buf + off, n), want);
            assert_int_equal(epipe_crc32c_hw(0, buf + off, n), want);
            assert_int_equal(epipe_crc32c(0, buf + off, n), want);
        }
    /* Chaining: any split gives the CRC of the whole. */
    uint32_t whole = epipe_crc32c(0, buf, 1000);
    for (size_t cut = 0; cut <= 1000; cut += 37) {
        assert_int_equal(epipe_crc32c(epipe_crc32c(0, buf, cut), buf + cut, 1000 - cut), whole);
        assert_int_equal(epipe_crc32c_ref(epipe_crc32c_hw(0, buf, cut), buf + cut, 1000 - cut),
                         whole);
    }
    free(buf);
}

/* The three-way fast path (blocks of 8192 and 256 bytes per chain) against
 * the slicing-by-8 reference and the single-chain loop: random lengths
 * around and across the block edges, random alignments, random starting
 * CRCs, and chaining across a split. */
static void crc_three_way_matches_reference(void **state)
{
    (void)state;
    enum { N = (1 << 20) + 64 };
    uint8_t *buf = malloc(N);
    assert_non_null(buf);
    test_rng r;
    test_rng_seed(&r, 7);
    for (size_t i = 0; i < N; i++)
        buf[i] = (uint8_t)test_rng_next(&r);
    const size_t edges[] = {767,   768,   769,         775,         776,   1535,      1536,   24575,
                            24576, 24577, 24576 + 768, 24576 + 767, 49152, 49152 + 7, 1 << 20};
    for (size_t i = 0; i < sizeof edges / sizeof *edges + 400; i++) {
        size_t n = i < sizeof edges / sizeof *edges ? edges[i]
                                                    : (size_t)(test_rng_next(&r) % 200000);
        size_t off = (size_t)(test_rng_next(&r) % 64);
        uint32_t init = (i & 1) ? (uint32_t)test_rng_next(&r) : 0;
        uint32_t want = epipe_crc32c_ref(init, buf + off, n);
        assert_int_equal(epipe_crc32c_hw(init, buf + off, n), want);
        assert_int_equal(epipe_crc32c_hw_1way(init, buf + off, n), want);
        assert_int_equal(epipe_crc32c(init, buf + off, n), want);
        size_t cut = n ? (size_t)(test_rng_next(&r) % n) : 0;
        assert_int_equal(epipe_crc32c(epipe_crc32c(init, buf + off, cut), buf + off + cut, n - cut),
                         want);
    }
    /* All zeros and all ones over the long path. */
    memset(buf, 0, 100000);
    assert_int_equal(epipe_crc32c_hw(0, buf, 100000), epipe_crc32c_ref(0, buf, 100000));
    memset(buf, 0xFF, 100000);
    assert_int_equal(epipe_crc32c_hw(0, buf, 100000), epipe_crc32c_ref(0, buf, 100000));
    free(buf);
}

/* ---- helpers ------------------------------------------------------------ */

/* A 2x3x4 fp32 activation with a "none"-codec payload written by hand. */
enum { NUMEL = 24, PLEN = 16 + NUMEL * 4, MSG = HS + PLEN };

static epipe_wire_header tensor_header(void)
{
    epipe_wire_header h = {
        .kind = EPIPE_WIRE_ACTIVATION,
        .dtype = EPIPE_DTYPE_F32,
        .ndim = 3,
        .codec_id = 1,
        .codec_param = 0,
        .micro_batch = 5,
        .step = 77,
        .src_stage = 0,
        .dst_stage = 1,
        .shape = {2, 3, 4},
    };
    return h;
}

static void make_payload(uint8_t *p, const epipe_wire_header *h, uint64_t count)
{
    p[0] = h->codec_id;
    p[1] = 1;
    p[2] = h->dtype;
    p[3] = 0;
    epipe_put_u32(p + 4, h->codec_param);
    epipe_put_u64(p + 8, count);
    for (unsigned i = 0; i < NUMEL; i++)
        epipe_put_f32(p + 16 + 4 * i, (float)i * 0.5f - 3.0f);
}

static void make_message(uint8_t *msg)
{
    epipe_wire_header h = tensor_header();
    uint8_t payload[PLEN];
    make_payload(payload, &h, NUMEL);
    size_t w;
    EXPECT(EPIPE_OK, epipe_wire_frame(&h, payload, PLEN, msg, MSG, &w));
    assert_int_equal(w, MSG);
}

/* Recomputes the header CRC after a test edited header fields. */
static void reseal(uint8_t *msg, size_t hlen)
{
    epipe_put_u32(msg + hlen - 4, epipe_crc32c(0, msg, hlen - 4));
}

static int parse_msg(const uint8_t *msg, size_t len)
{
    epipe_wire_header h;
    const uint8_t *payload;
    return epipe_wire_parse(msg, len, NULL, &h, &payload);
}

/* ---- round trips -------------------------------------------------------- */

static void header_round_trip_every_field(void **state)
{
    (void)state;
    test_rng r;
    test_rng_seed(&r, 7);
    for (unsigned kind = 1; kind <= EPIPE_WIRE_KIND_MAX; kind++)
        for (unsigned ndim = 0; ndim <= EPIPE_MAX_NDIM; ndim++) {
            int tensor = kind == EPIPE_WIRE_ACTIVATION || kind == EPIPE_WIRE_GRADIENT;
            if (!tensor && ndim)
                continue;
            epipe_wire_header h = {
                .kind = (uint8_t)kind,
                .micro_batch = (uint32_t)test_rng_next(&r),
                .step = test_rng_next(&r),
                .src_stage = (uint32_t)test_rng_next(&r),
                .dst_stage = (uint32_t)test_rng_next(&r),
                .payload_len = 16 + test_rng_next(&r) % (EPIPE_WIRE_DEFAULT_MAX_PAYLOAD - 15),
                .payload_crc = (uint32_t)test_rng_next(&r),
            };
            if (tensor) {
                h.schedule_tag = (uint32_t)test_rng_next(&r);
                h.dtype = (uint8_t)(test_rng_next(&r) % 3);
                h.codec_id = (uint8_t)(1 + test_rng_next(&r) % 255);
                h.codec_param = (uint32_t)test_rng_next(&r);
                h.ndim = (uint8_t)ndim;
                for (unsigned i = 0; i < ndim; i++)
                    h.shape[i] = 1 + test_rng_next(&r) % 7; /* 7^16 fits */
            }
            uint8_t buf[HS];
            EXPECT(EPIPE_OK, epipe_wire_encode_header(&h, buf, sizeof buf));
            assert_memory_equal(buf, EPIPE_WIRE_MAGIC, 4);
            epipe_wire_header back;
            EXPECT(EPIPE_OK, epipe_wire_parse_header(buf, sizeof buf, NULL, &back));
            h.version = EPIPE_WIRE_VERSION;
            h.header_len = HS;
            assert_memory_equal(&back, &h, sizeof h);
            /* the schedule tag sits in the extension area, bytes 184..187 */
            assert_int_equal(epipe_get_u32(buf + 184), h.schedule_tag);
        }
}

static void message_round_trip_with_codec(void **state)
{
    (void)state;
    float x[NUMEL], y[NUMEL];
    test_fill(x, NUMEL, DIST_NORMAL, 3);
    int64_t shape[3] = {2, 3, 4};
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 3, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "cast:dtype=bf16"), EPIPE_OK);
    size_t plen;
    assert_int_equal(epipe_codec_max_encoded_size(c, &t, &plen), EPIPE_OK);
    uint8_t *msg = malloc(HS + plen);
    assert_int_equal(epipe_codec_encode(c, &t, msg + HS, plen, &plen), EPIPE_OK);
    epipe_wire_header h = {.kind = EPIPE_WIRE_GRADIENT,
                           .dtype = msg[HS + 2],
                           .ndim = 3,
                           .codec_id = msg[HS],
                           .codec_param = epipe_get_u32(msg + HS + 4),
                           .micro_batch = 3,
                           .step = 9,
                           .src_stage = 2,
                           .dst_stage = 1,
                           .shape = {2, 3, 4}};
    size_t w; /* the payload already sits after the header: framed in place */
    EXPECT(EPIPE_OK, epipe_wire_frame(&h, msg + HS, plen, msg, HS + plen, &w));
    assert_int_equal(w, HS + plen);
    epipe_wire_header back;
    const uint8_t *payload;
    EXPECT(EPIPE_OK, epipe_wire_parse(msg, w, NULL, &back, &payload));
    assert_ptr_equal(payload, msg + HS);
    assert_int_equal(back.payload_len, plen);
    assert_int_equal(back.kind, EPIPE_WIRE_GRADIENT);
    t.data = y;
    assert_int_equal(epipe_codec_decode(c, payload, back.payload_len, &t), EPIPE_OK);
    for (int i = 0; i < NUMEL; i++)
        assert_true(y[i] == epipe_bf16_to_f32(epipe_f32_to_bf16(x[i])));
    epipe_codec_destroy(c);
    free(msg);
}

static void streaming_steps(void **state)
{
    (void)state;
    uint8_t msg[MSG];
    make_message(msg);
    size_t hlen;
    EXPECT(EPIPE_OK, epipe_wire_header_length(msg, EPIPE_WIRE_PREFIX_SIZE, &hlen));
    assert_int_equal(hlen, HS);
    epipe_wire_header h;
    EXPECT(EPIPE_OK, epipe_wire_parse_header(msg, hlen, NULL, &h));
    assert_int_equal(h.payload_len, PLEN);
    EXPECT(EPIPE_OK, epipe_wire_check_payload(&h, msg + HS, PLEN));
    uint64_t n;
    EXPECT(EPIPE_OK, epipe_wire_numel(&h, &n));
    assert_int_equal(n, NUMEL);
}

/* A longer header (a later minor revision) is accepted; its extension
 * bytes are covered by the CRC and ignored. */
static void longer_header_accepted(void **state)
{
    (void)state;
    uint8_t msg[MSG], longer[MSG + 16];
    make_message(msg);
    enum { HL = HS + 16 };
    memcpy(longer, msg, HS - 8);
    memset(longer + HS - 8, 0xAB, HL - 4 - (HS - 8)); /* extension area */
    longer[6] = (uint8_t)HL;
    longer[7] = (uint8_t)(HL >> 8);
    reseal(longer, HL);
    memcpy(longer + HL, msg + HS, PLEN);
    epipe_wire_header h;
    const uint8_t *payload;
    EXPECT(EPIPE_OK, epipe_wire_parse(longer, sizeof longer, NULL, &h, &payload));
    assert_int_equal(h.header_len, HS + 16);
    assert_ptr_equal(payload, longer + HS + 16);
    assert_int_equal(h.schedule_tag, 0xABABABABu); /* bytes 184..187: read, never refused */
}

/* ---- rejections --------------------------------------------------------- */

static void truncated_everywhere(void **state)
{
    (void)state;
    uint8_t msg[MSG];
    make_message(msg);
    epipe_wire_header h;
    for (size_t len = 0; len < HS; len++) {
        EXPECT(EPIPE_ETRUNC, epipe_wire_parse_header(msg, len, NULL, &h));
        assert_int_equal(h.kind, 0); /* zeroed on failure */
    }
    for (size_t len = 0; len < MSG; len++)
        EXPECT(EPIPE_ETRUNC, parse_msg(msg, len));
    EXPECT(EPIPE_OK, epipe_wire_parse_header(msg, HS, NULL, &h));
    for (size_t len = 0; len < PLEN; len++)
        EXPECT(EPIPE_ETRUNC, epipe_wire_check_payload(&h, msg + HS, len));
    /* and one byte too many */
    uint8_t more[MSG + 1];
    memcpy(more, msg, MSG);
    more[MSG] = 0;
    EXPECT(EPIPE_EPROTO, parse_msg(more, MSG + 1));
}

static void payload_over_limit(void **state)
{
    (void)state;
    epipe_wire_header h = tensor_header(), out;
    h.payload_len = 9000000000ull;
    uint8_t buf[HS];
    EXPECT(EPIPE_OK, epipe_wire_encode_header(&h, buf, sizeof buf));
    EXPECT(EPIPE_ETOOBIG, epipe_wire_parse_header(buf, HS, NULL, &out));
    assert_non_null(strstr(epipe_last_error(), "9000000000 exceeds the limit 1073741824"));
    epipe_wire_limits lim = {.max_payload = 10000000000ull};
    EXPECT(EPIPE_OK, epipe_wire_parse_header(buf, HS, &lim, &out));
    uint8_t msg[MSG];
    make_message(msg);
    lim.max_payload = PLEN - 1;
    EXPECT(EPIPE_ETOOBIG, epipe_wire_parse_header(msg, MSG, &lim, &out));
    lim.max_payload = PLEN;
    EXPECT(EPIPE_OK, epipe_wire_parse_header(msg, MSG, &lim, &out));
}

static void wrong_version(void **state)
{
    (void)state;
    const uint16_t versions[] = {0, 2, 256, 0xFFFF};
    for (size_t i = 0; i < 4; i++) {
        uint8_t msg[MSG];
        make_message(msg);
        msg[4] = (uint8_t)versions[i];
        msg[5] = (uint8_t)(versions[i] >> 8);
        reseal(msg, HS);
        EXPECT(EPIPE_EVERSION, parse_msg(msg, MSG));
    }
}

static void bad_magic(void **state)
{
    (void)state;
    uint8_t msg[MSG];
    make_message(msg);
    memcpy(msg, "EPIX", 4);
    reseal(msg, HS);
    EXPECT(EPIPE_EPROTO, parse_msg(msg, MSG));
    assert_non_null(strstr(epipe_last_error(), "magic"));
    memcpy(msg, "GET ", 4); /* someone speaking HTTP at us */
    size_t hlen;
    EXPECT(EPIPE_EPROTO, epipe_wire_header_length(msg, 8, &hlen));
}

static void bad_header_length(void **state)
{
    (void)state;
    const unsigned lens[] = {0, 8, HS - 8, HS + 1, HS + 4, EPIPE_WIRE_HEADER_MAX + 8, 0xFFFF};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        uint8_t msg[MSG];
        make_message(msg);
        msg[6] = (uint8_t)lens[i];
        msg[7] = (uint8_t)(lens[i] >> 8);
        EXPECT(EPIPE_EPROTO, parse_msg(msg, MSG));
    }
}

static void every_header_bit_flip_refused(void **state)
{
    (void)state;
    uint8_t msg[MSG];
    make_message(msg);
    for (size_t bit = 0; bit < HS * 8; bit++) {
        msg[bit / 8] ^= (uint8_t)(1u << bit % 8);
        size_t byte = bit / 8;
        epipe_clear_error();
        int rc = parse_msg(msg, MSG);
        if (byte < 4) /* magic: the CRC cannot be found without it */
            assert_int_equal(rc, EPIPE_EPROTO);
        else if (byte == 6 || byte == 7) /* header length: bad, or CRC elsewhere */
            assert_true(rc == EPIPE_EPROTO || rc == EPIPE_ETRUNC || rc == EPIPE_ECHECKSUM);
        else
            assert_int_equal(rc, EPIPE_ECHECKSUM);
        assert_true(epipe_last_error()[0] != '\0');
        msg[bit / 8] ^= (uint8_t)(1u << bit % 8);
    }
    EXPECT(EPIPE_OK, parse_msg(msg, MSG));
}

static void every_payload_bit_flip_refused(void **state)
{
    (void)state;
    uint8_t msg[MSG];
    make_message(msg);
    for (size_t bit = HS * 8; bit < MSG * 8; bit++) {
        msg[bit / 8] ^= (uint8_t)(1u << bit % 8);
        EXPECT(EPIPE_ECHECKSUM, parse_msg(msg, MSG));
        msg[bit / 8] ^= (uint8_t)(1u << bit % 8);
    }
}

/* Writes a header with fields the encoder refuses, then seals it. */
static void forge(uint8_t *buf, void (*edit)(uint8_t *))
{
    epipe_wire_header h = tensor_header();
    h.payload_len = 16;
    assert_int_equal(epipe_wire_encode_header(&h, buf, HS), EPIPE_OK);
    edit(buf);
    reseal(buf, HS);
}

static void edit_dims_2_32(uint8_t *b)
{
    b[10] = 2;
    epipe_put_u64(b + 56, UINT64_C(1) << 32);
    epipe_put_u64(b + 64, UINT64_C(1) << 31);
    epipe_put_u64(b + 72, 0);
}
static void edit_dim_huge(uint8_t *b)
{
    epipe_put_u64(b + 64, UINT64_C(1) << 63);
}
static void edit_zero_dim(uint8_t *b)
{
    epipe_put_u64(b + 56, 0);
    epipe_put_u64(b + 64, UINT64_C(1) << 62);
    epipe_put_u64(b + 72, UINT64_C(1) << 62);
}
static void edit_ndim_17(uint8_t *b)
{
    b[10] = 17;
}
static void edit_kind_0(uint8_t *b)
{
    b[8] = 0;
}
static void edit_kind_7(uint8_t *b)
{
    b[8] = EPIPE_WIRE_KIND_MAX + 1;
}
static void edit_kind_255(uint8_t *b)
{
    b[8] = 255;
}
static void edit_dtype_3(uint8_t *b)
{
    b[9] = 3;
}
static void edit_reserved(uint8_t *b)
{
    b[54] = 1;
}
static void edit_flags(uint8_t *b)
{
    b[15] = 0x80;
}
static void edit_slot(uint8_t *b)
{
    epipe_put_u64(b + 56 + 8 * 15, 1);
}
static void edit_codec_0(uint8_t *b)
{
    b[11] = 0;
}
static void edit_short_payload(uint8_t *b)
{
    epipe_put_u64(b + 40, 15);
}
static void edit_heartbeat_with_ndim(uint8_t *b)
{
    b[8] = EPIPE_WIRE_HEARTBEAT;
    b[11] = 0;
    b[9] = 0;
}

static void field_rejections(void **state)
{
    (void)state;
    const struct {
        void (*edit)(uint8_t *);
        int want;
    } cases[] = {
        {edit_dims_2_32, EPIPE_EOVERFLOW},  {edit_dim_huge, EPIPE_EOVERFLOW},
        {edit_zero_dim, EPIPE_OK},          {edit_ndim_17, EPIPE_EPROTO},
        {edit_kind_0, EPIPE_EPROTO},        {edit_kind_7, EPIPE_EPROTO},
        {edit_kind_255, EPIPE_EPROTO},      {edit_dtype_3, EPIPE_EPROTO},
        {edit_reserved, EPIPE_EPROTO},      {edit_flags, EPIPE_EPROTO},
        {edit_slot, EPIPE_EPROTO},          {edit_codec_0, EPIPE_EPROTO},
        {edit_short_payload, EPIPE_EPROTO}, {edit_heartbeat_with_ndim, EPIPE_EPROTO},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t buf[HS];
        epipe_wire_header h;
        forge(buf, cases[i].edit);
        EXPECT(cases[i].want, epipe_wire_parse_header(buf, HS, NULL, &h));
    }
    /* the messages name the field */
    uint8_t buf[HS];
    epipe_wire_header h;
    forge(buf, edit_ndim_17);
    epipe_wire_parse_header(buf, HS, NULL, &h);
    assert_non_null(strstr(epipe_last_error(), "ndim 17"));
    forge(buf, edit_dims_2_32);
    epipe_wire_parse_header(buf, HS, NULL, &h);
    assert_non_null(strstr(epipe_last_error(), "overflows"));
    forge(buf, edit_kind_7);
    epipe_wire_parse_header(buf, HS, NULL, &h);
    assert_non_null(strstr(epipe_last_error(), "kind 7"));
}

static void encoder_refuses_what_readers_refuse(void **state)
{
    (void)state;
    uint8_t buf[HS];
    epipe_wire_header h = tensor_header();
    h.payload_len = 16;
    EXPECT(EPIPE_ENOSPC, epipe_wire_encode_header(&h, buf, HS - 1));
    h.kind = 0;
    EXPECT(EPIPE_EINVAL, epipe_wire_encode_header(&h, buf, HS));
    h = tensor_header();
    h.payload_len = 16;
    h.ndim = 17;
    EXPECT(EPIPE_EINVAL, epipe_wire_encode_header(&h, buf, HS));
    h.ndim = 2;
    EXPECT(EPIPE_EINVAL, epipe_wire_encode_header(&h, buf, HS)); /* slot 2 set */
    h = tensor_header();
    h.payload_len = 8; /* no room for the codec payload header */
    EXPECT(EPIPE_EINVAL, epipe_wire_encode_header(&h, buf, HS));
    h = tensor_header();
    h.kind = EPIPE_WIRE_HELLO; /* a hello carries no tensor */
    EXPECT(EPIPE_EINVAL, epipe_wire_encode_header(&h, buf, HS));
    size_t w;
    uint8_t small[HS + 4];
    h = (epipe_wire_header){.kind = EPIPE_WIRE_HEARTBEAT};
    EXPECT(EPIPE_ENOSPC, epipe_wire_frame(&h, "abcde", 5, small, sizeof small, &w));
    EXPECT(EPIPE_OK, epipe_wire_frame(&h, "abcd", 4, small, sizeof small, &w));
    assert_int_equal(w, HS + 4);
}

static void payload_must_match_header(void **state)
{
    (void)state;
    static const struct {
        unsigned off;
        uint8_t val;
        const char *word;
    } edits[] = {
        {0, 2, "codec id"}, {2, 1, "dtype"}, {4, 9, "parameter word"}, {8, 25, "25 values"}};
    for (size_t i = 0; i < 4; i++) {
        epipe_wire_header h = tensor_header();
        uint8_t payload[PLEN], msg[MSG];
        make_payload(payload, &h, NUMEL);
        payload[edits[i].off] = edits[i].val;
        size_t w;
        EXPECT(EPIPE_OK, epipe_wire_frame(&h, payload, PLEN, msg, MSG, &w));
        EXPECT(EPIPE_EPROTO, parse_msg(msg, MSG));
        assert_non_null(strstr(epipe_last_error(), edits[i].word));
    }
    /* control messages carry any bytes */
    epipe_wire_header h = {.kind = EPIPE_WIRE_ERROR, .src_stage = 1};
    uint8_t msg[HS + 5];
    size_t w;
    EXPECT(EPIPE_OK, epipe_wire_frame(&h, "oops!", 5, msg, sizeof msg, &w));
    EXPECT(EPIPE_OK, parse_msg(msg, w));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(crc_check_value),
        cmocka_unit_test(crc_paths_agree),
        cmocka_unit_test(crc_three_way_matches_reference),
        cmocka_unit_test(header_round_trip_every_field),
        cmocka_unit_test(message_round_trip_with_codec),
        cmocka_unit_test(streaming_steps),
        cmocka_unit_test(longer_header_accepted),
        cmocka_unit_test(truncated_everywhere),
        cmocka_unit_test(payload_over_limit),
        cmocka_unit_test(wrong_version),
        cmocka_unit_test(bad_magic),
        cmocka_unit_test(bad_header_length),
        cmocka_unit_test(every_header_bit_flip_refused),
        cmocka_unit_test(every_payload_bit_flip_refused),
        cmocka_unit_test(field_rejections),
        cmocka_unit_test(encoder_refuses_what_readers_refuse),
        cmocka_unit_test(payload_must_match_header),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
