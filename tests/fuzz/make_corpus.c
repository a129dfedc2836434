/* Writes the seed corpus for the fuzz targets: valid payloads of every
 * codec in fuzz_specs.h, valid specs, wire messages, TCP setup hellos,
 * transport options and Slurm node lists. Run it to refresh
 * tests/fuzz/corpus after a format change:  make_corpus tests/fuzz/corpus */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <epipe/epipe.h>

#include "../../transport/tcp_setup.h"
#include "codec/payload.h"
#include "fuzz_delta.h"
#include "fuzz_specs.h"
#include "wire/crc32c.h"
#include "wire/wire.h"

static void write_file(const char *dir, const char *name, const void *p, size_t n)
{
    char path[8192];
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
        exit(1);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        perror(path);
        exit(1);
    }
    fclose(f);
}

/* A dense fp32 CPU tensor over x; shape is borrowed. */
static DLTensor f32_view(float *x, int64_t *shape, int ndim)
{
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = ndim, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    return t;
}

/* corpus/wire: framed messages of every kind with small payloads, a tensor
 * message with a real codec payload, and one with a longer header. */
static void write_wire_corpus(const char *root)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/wire", root);
    mkdir(dir, 0755);
    uint8_t msg[1024], payload[512];
    size_t w;
    /* Tensor kinds: a 2x3 fp32 tensor through each codec in fuzz_specs.h. */
    for (size_t s = 0; s < FUZZ_NSPECS; s++) {
        float x[6] = {1.5f, -2.0f, 0.25f, 3.0f, -0.5f, 8.0f};
        int64_t shape[2] = {2, 3};
        DLTensor t = f32_view(x, shape, 2);
        epipe_codec *c;
        size_t plen;
        if (epipe_codec_create(&c, fuzz_specs[s]) != EPIPE_OK) {
            fprintf(stderr, "%s: %s\n", fuzz_specs[s], epipe_last_error());
            exit(1);
        }
        if (epipe_codec_encode(c, &t, payload, sizeof payload, &plen) != EPIPE_OK) {
            /* a codec that refuses this shape (poweriter:rank=1: its two
             * rows would share factors) has no tensor seed */
            epipe_codec_destroy(c);
            continue;
        }
        epipe_codec_destroy(c);
        epipe_payload_header ph;
        epipe_payload_get(payload, plen, &ph);
        epipe_wire_header h = {.kind = s % 2 ? EPIPE_WIRE_GRADIENT : EPIPE_WIRE_ACTIVATION,
                               .dtype = ph.dtype,
                               .ndim = 2,
                               .codec_id = ph.codec_id,
                               .codec_param = ph.param_word,
                               .micro_batch = (uint32_t)s,
                               .step = 1000 + s,
                               .src_stage = 0,
                               .dst_stage = 1,
                               .shape = {2, 3},
                               /* some carry a schedule tag (bytes 184..187) */
                               .schedule_tag = s % 3 == 1 ? 0x02A1B2C3u : 0};
        if (epipe_wire_frame(&h, payload, plen, msg, sizeof msg, &w) != EPIPE_OK)
            exit(1);
        char name[32];
        snprintf(name, sizeof name, "tensor-%zu", s);
        write_file(dir, name, msg, w);
    }
    /* Control kinds. */
    static const struct {
        unsigned kind;
        const char *payload, *name;
    } ctl[] = {
        {EPIPE_WIRE_HELLO, "epipe hello v1", "hello"},
        {EPIPE_WIRE_HEARTBEAT, "", "heartbeat"},
        {EPIPE_WIRE_ERROR, "stage 2: out of memory", "error"},
        {EPIPE_WIRE_BYE, "", "bye"},
    };
    for (size_t i = 0; i < sizeof ctl / sizeof ctl[0]; i++) {
        epipe_wire_header h = {
            .kind = (uint8_t)ctl[i].kind, .step = 7, .src_stage = 2, .dst_stage = 1};
        if (epipe_wire_frame(&h, ctl[i].payload, strlen(ctl[i].payload), msg, sizeof msg, &w) !=
            EPIPE_OK)
            exit(1);
        write_file(dir, ctl[i].name, msg, w);
    }
    /* The heartbeat again with a 16-byte longer header (extension bytes). */
    size_t hl = EPIPE_WIRE_HEADER_SIZE + 16;
    memmove(msg + hl - 4, msg + EPIPE_WIRE_HEADER_SIZE - 4, 4);
    memset(msg + EPIPE_WIRE_HEADER_SIZE - 8, 0x5A, 20);
    msg[6] = (uint8_t)hl;
    msg[7] = (uint8_t)(hl >> 8);
    epipe_put_u32(msg + hl - 4, epipe_crc32c(0, msg, hl - 4));
    write_file(dir, "heartbeat-longer-header", msg, hl);
}

/* Writes one corpus file: a selector byte, then the bytes. */
static void write_sel(const char *dir, const char *name, uint8_t sel, const void *p, size_t n)
{
    uint8_t buf[2048];
    if (n + 1 > sizeof buf)
        exit(1);
    buf[0] = sel;
    memcpy(buf + 1, p, n);
    write_file(dir, name, buf, n + 1);
}

/* corpus/hello (fuzz_hello.c): hello payloads of every type (selector 0),
 * and framed streams (1; 3 allows a 3-rank table): a register, two
 * messages back to back, an error, a table, a header claiming 75 MB.
 * corpus/tcp_opts, corpus/comm_opts and corpus/nodelist: option strings
 * (the TCP transport's, the settings every transport shares) and Slurm
 * lists. */
static void write_tcp_corpus(const char *root)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/hello", root);
    mkdir(dir, 0755);
    uint8_t p[HELLO_SIZE + 3 * TABLE_ENTRY], msg[1024];
    char name[32];
    for (unsigned t = HT_REGISTER; t <= HT_GO; t++) {
        struct epipe_tcp_hello h = {.type = (uint8_t)t,
                                    .flags = t & 1 ? HF_AUTH : 0,
                                    .rank = t,
                                    .size = 4,
                                    .stream = t % 2,
                                    .port = 29600};
        snprintf(h.addr, sizeof h.addr, "10.0.0.%u", t);
        memset(h.nonce, (int)t, sizeof h.nonce);
        memset(h.mac, (int)(t + 100), sizeof h.mac);
        epipe_tcp_hello_encode(&h, p);
        snprintf(name, sizeof name, "hello-%u", t);
        write_sel(dir, name, 0, p, HELLO_SIZE);
    }
    struct epipe_tcp_hello reg = {.type = HT_REGISTER, .rank = 1, .size = 3, .port = 4000};
    strcpy(reg.addr, "127.0.0.1");
    epipe_tcp_hello_encode(&reg, p);
    epipe_wire_header h = {.kind = EPIPE_WIRE_HELLO, .src_stage = 1};
    size_t w, w2;
    if (epipe_wire_frame(&h, p, HELLO_SIZE, msg, sizeof msg, &w) != EPIPE_OK)
        exit(1);
    write_sel(dir, "stream-register", 1, msg, w);
    struct epipe_tcp_hello rdy = {.type = HT_READY, .rank = 1, .size = 3};
    epipe_tcp_hello_encode(&rdy, p);
    if (epipe_wire_frame(&h, p, HELLO_SIZE, msg + w, sizeof msg - w, &w2) != EPIPE_OK)
        exit(1);
    write_sel(dir, "stream-register-ready", 1, msg, w + w2);
    static const char why[] = "rank 2 failed during the rendezvous: the other side closed";
    epipe_wire_header e = {.kind = EPIPE_WIRE_ERROR, .micro_batch = 2, .step = 12};
    if (epipe_wire_frame(&e, why, sizeof why - 1, msg, sizeof msg, &w) != EPIPE_OK)
        exit(1);
    write_sel(dir, "stream-error", 1, msg, w);
    struct epipe_tcp_hello tab = {.type = HT_TABLE, .size = 3};
    memset(p, 0, sizeof p);
    epipe_tcp_hello_encode(&tab, p);
    for (unsigned q = 1; q < 3; q++) {
        uint8_t *en = p + HELLO_SIZE + TABLE_ENTRY * q;
        snprintf((char *)en, 64, "10.0.0.%u", q);
        epipe_tcp_put_u16(en + 64, 40000 + q);
    }
    if (epipe_wire_frame(&h, p, sizeof p, msg, sizeof msg, &w) != EPIPE_OK)
        exit(1);
    write_sel(dir, "stream-table", 3, msg, w);
    write_sel(dir, "stream-table-unauthenticated", 1, msg, w);
    if (epipe_wire_frame(&h, p, HELLO_SIZE, msg, sizeof msg, &w) != EPIPE_OK)
        exit(1);
    /* The memory bomb: a header claiming 152 + 72 * 2^20 bytes (its CRC redone). */
    epipe_put_u64(msg + 40, HELLO_SIZE + TABLE_ENTRY * (uint64_t)1048576);
    epipe_put_u32(msg + 188, epipe_crc32c(0, msg, 188));
    write_sel(dir, "stream-claims-75MB", 1, msg, w);

    static const char *opts[] = {
        "",
        "timeout_ms=5000",
        "streams=2,topology=mesh",
        "timeout_ms=1,init_timeout_ms=86400000,heartbeat_ms=0,spin_us=1000000,streams=8,"
        "topology=pipeline,listen_addr=127.0.0.1,ifname=lo,key_file=/etc/epipe.key",
        "streams=9",
        "topology=ring",
        "timeout_ms=",
        "key",
        "unknown=1",
        "spin_us=-1,,",
        "listen_addr=0123456789012345678901234567890123456789012345678901234567890123456789",
        "encrypt=1,key_file=/etc/epipe.key",
        "encrypt=2",
        "job=slurm-4711.0,streams=2",
        "job="};
    snprintf(dir, sizeof dir, "%s/tcp_opts", root);
    mkdir(dir, 0755);
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
        snprintf(name, sizeof name, "opts-%zu", i);
        write_file(dir, name, opts[i], strlen(opts[i]));
    }
    static const struct {
        uint8_t cap;
        const char *list;
    } lists[] = {{64, "node[03-05,9],gpu1"},
                 {64, "localhost"},
                 {5, "longname"},
                 {64, "n[1"},
                 {64, "a]b"},
                 {0, "x"},
                 {64, "[]"},
                 {64, "pre[007]suf,x"},
                 {64, ",node1"},
                 {8, "r[1-2]c[3-4]"},
                 {64, "n[09-10],m[3-1]"},
                 {64, "a[1,,2]"},
                 {64, "[1-2]"}};
    snprintf(dir, sizeof dir, "%s/nodelist", root);
    mkdir(dir, 0755);
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
        snprintf(name, sizeof name, "list-%zu", i);
        write_sel(dir, name, lists[i].cap, lists[i].list, strlen(lists[i].list));
    }
    static const char *comm_opts[] = {
        "",
        "timeout_ms=5000",
        "group=g1,timeout_ms=100,spin_us=0",
        "timeout_ms=86400000,spin_us=1000000,max_message=4096,buffer_cache=0,"
        "init_timeout_ms=1,trace=/tmp/t.json,group=pipeline-a,streams=2,encrypt=1",
        "max_message=4095",
        "buffer_cache=1099511627777",
        "timeout_ms=0",
        "group=",
        "trace",
        "=1",
        "streams=2,,topology=mesh",
        "timeout_ms=99999999999999999999"};
    snprintf(dir, sizeof dir, "%s/comm_opts", root);
    mkdir(dir, 0755);
    for (size_t i = 0; i < sizeof comm_opts / sizeof comm_opts[0]; i++) {
        snprintf(name, sizeof name, "opts-%zu", i);
        write_file(dir, name, comm_opts[i], strlen(comm_opts[i]));
    }
}

/* Activation deltas: the second payload of a stream whose first primed
 * the decoder (fuzz_delta.h), with delta, kept and new rows. */
static int write_delta_corpus(const char *root)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/delta_decode", root);
    mkdir(dir, 0755);
    const uint8_t shapes[][2] = {{0, 0}, {3, 7}, {5, 63}, {7, 15}}; /* the last: NULL ids */
    for (size_t s = 0; s < FUZZ_DELTA_NSPECS; s++)
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int64_t rows, cols;
            fuzz_delta_shape(fuzz_delta_specs[s], shapes[k][0], shapes[k][1], &rows, &cols);
            epipe_codec *c;
            if (epipe_codec_create(&c, fuzz_delta_specs[s]) != EPIPE_OK)
                return 1;
            uint64_t ids[16];
            uint8_t *p0, *p1;
            size_t len0, len1;
            fuzz_delta_prime_ids(ids, rows);
            int rc = fuzz_delta_encode(c, rows, cols, ids, 0, &p0, &len0);
            for (int64_t i = 0; i < rows; i++) /* every other row a new sample */
                ids[i] = i % 2 ? (uint64_t)(rows - 1 - i) : (uint64_t)(1000 + i) << (20 * k);
            if (rc || (rc = fuzz_delta_encode(c, rows, cols, k == 3 ? NULL : ids, 1, &p1, &len1))) {
                fprintf(stderr, "%s: %s\n", fuzz_delta_specs[s], epipe_last_error());
                return 1;
            }
            uint8_t buf[8192];
            buf[0] = (uint8_t)s, buf[1] = shapes[k][0], buf[2] = shapes[k][1];
            memcpy(buf + FUZZ_DELTA_SEL, p1 + 16, len1 - 16);
            char name[64];
            snprintf(name, sizeof name, "delta-%zu-%zu", s, k);
            write_file(dir, name, buf, len1 - 16 + FUZZ_DELTA_SEL);
            /* The seed must decode as the target builds it: p0's header. */
            if (memcmp(p0, p1, 16) != 0) {
                fprintf(stderr, "%s: the two payload headers differ\n", fuzz_delta_specs[s]);
                return 1;
            }
            free(p0), free(p1);
            epipe_codec_destroy(c);
        }
    return 0;
}

/* fuzz_codec_encode: each spec on [4, 16] tensors in four forms (fp32;
 * fp16 one byte off; bf16 transposed; fp32 three bytes off, two threads),
 * and one fp32 tensor holding NaN, infinities, a denormal and -0. */
static void write_encode_corpus(const char *root)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/codec_encode", root);
    mkdir(dir, 0755);
    static const uint8_t forms[4] = {0x00, 0x05, 0x12, 0x2c};
    for (size_t s = 0; s < FUZZ_NSPECS; s++)
        for (int f = 0; f < 5; f++) {
            uint8_t buf[3 + 64 * 4];
            size_t esz = f < 4 && (forms[f] & 3) ? 2 : 4;
            buf[0] = (uint8_t)s, buf[1] = f < 4 ? forms[f] : 0, buf[2] = 3;
            for (int i = 0; i < 64; i++) {
                float x = sinf((float)i * 0.7f) * (float)(1 + i % 7);
                if (f == 4) {
                    static const float odd[6] = {NAN, INFINITY, -INFINITY, 1e-40f, -0.0f, 3e38f};
                    x = i % 9 < 6 ? odd[i % 9] : x;
                }
                if (esz == 4) {
                    memcpy(buf + 3 + 4 * i, &x, 4);
                } else { /* the top half of the fp32: a bf16, and some fp16 */
                    uint32_t u;
                    memcpy(&u, &x, 4);
                    buf[3 + 2 * i] = (uint8_t)(u >> 16), buf[4 + 2 * i] = (uint8_t)(u >> 24);
                }
            }
            char name[32];
            snprintf(name, sizeof name, "enc-%zu-%d", s, f);
            write_file(dir, name, buf, 3 + 64 * esz);
        }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/codec_decode", argv[1]);
    mkdir(argv[1], 0755);
    mkdir(dir, 0755);
    const int64_t counts[] = {0, 1, 37};
    for (size_t s = 0; s < FUZZ_NSPECS; s++)
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            int64_t n = counts[k];
            float x[64];
            for (int i = 0; i < n; i++)
                x[i] = sinf((float)i * 0.7f) * (float)(i % 5);
            DLTensor t = f32_view(x, &n, 1);
            epipe_codec *c;
            if (epipe_codec_create(&c, fuzz_specs[s]) != EPIPE_OK)
                return 1;
            uint8_t buf[4096];
            size_t len;
            buf[0] = (uint8_t)s;
            buf[1] = (uint8_t)n;
            buf[2] = 0;
            if (epipe_codec_encode(c, &t, buf + 3, sizeof buf - 3, &len) != EPIPE_OK) {
                /* insert needs D >= out; group=4 runs do not divide 1 or 37 values
                 * (its seeds are the rows' below) */
                if ((epipe_codec_trainable(c) && n < 2) || strstr(fuzz_specs[s], "group=")) {
                    epipe_codec_destroy(c);
                    continue;
                }
                fprintf(stderr, "%s: %s\n", fuzz_specs[s], epipe_last_error());
                return 1;
            }
            char name[64];
            snprintf(name, sizeof name, "%s-%lld", epipe_codec_name(c), (long long)n);
            for (char *p = name; *p; p++)
                if (*p == ':' || *p == '=' || *p == ',')
                    *p = '_';
            snprintf(name + strlen(name), sizeof name - strlen(name), "-%zu", s);
            write_file(dir, name, buf, len + 3);
            epipe_codec_destroy(c);
        }
    /* A per-row spec over several rows: [4, 192], as fuzz_codec_decode
     * reads bytes 1-2 = 768 (byte 2 = 3: 1 + 3 rows). */
    for (size_t s = 0; s < FUZZ_NSPECS; s++) {
        if (!fuzz_spec_per_row(fuzz_specs[s]))
            continue;
        static float x[768];
        for (int i = 0; i < 768; i++) /* rows 8x apart in scale */
            x[i] = sinf((float)i * 0.7f) * (float)(1 << (i / 192 * 3));
        int64_t shape[2] = {4, 192};
        DLTensor t = f32_view(x, shape, 2);
        epipe_codec *c;
        uint8_t buf[4096];
        size_t len;
        if (epipe_codec_create(&c, fuzz_specs[s]) != EPIPE_OK ||
            epipe_codec_encode(c, &t, buf + 3, sizeof buf - 3, &len) != EPIPE_OK)
            return 1;
        buf[0] = (uint8_t)s, buf[1] = 0, buf[2] = 3;
        char name[32];
        snprintf(name, sizeof name, "rows-4x192-%zu", s);
        write_file(dir, name, buf, len + 3);
        epipe_codec_destroy(c);
    }
    snprintf(dir, sizeof dir, "%s/spec", argv[1]);
    mkdir(dir, 0755);
    for (size_t s = 0; s < FUZZ_NSPECS; s++) {
        char name[32];
        snprintf(name, sizeof name, "spec-%zu", s);
        write_file(dir, name, fuzz_specs[s], strlen(fuzz_specs[s]));
    }
    write_wire_corpus(argv[1]);
    write_tcp_corpus(argv[1]);
    write_encode_corpus(argv[1]);
    return write_delta_corpus(argv[1]);
}
