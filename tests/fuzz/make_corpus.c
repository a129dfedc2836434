/* Writes the seed corpus for the fuzz targets: valid payloads of every
 * codec in fuzz_specs.h and valid specs. Run it to refresh
 * tests/fuzz/corpus after a format change:  make_corpus tests/fuzz/corpus */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <epipe/epipe.h>

#include "codec/payload.h"
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
        DLTensor t = {.data = x, .device = {kDLCPU, 0}, .ndim = 2,
                      .dtype = {kDLFloat, 32, 1}, .shape = shape};
        epipe_codec *c;
        size_t plen;
        if (epipe_codec_create(&c, fuzz_specs[s]) != EPIPE_OK ||
            epipe_codec_encode(c, &t, payload, sizeof payload, &plen) != EPIPE_OK) {
            fprintf(stderr, "%s: %s\n", fuzz_specs[s], epipe_last_error());
            exit(1);
        }
        epipe_codec_destroy(c);
        epipe_payload_header ph;
        epipe_payload_get(payload, plen, &ph);
        epipe_wire_header h = {.kind = s % 2 ? EPIPE_WIRE_GRADIENT : EPIPE_WIRE_ACTIVATION,
                               .dtype = ph.dtype, .ndim = 2, .codec_id = ph.codec_id,
                               .codec_param = ph.param_word, .micro_batch = (uint32_t)s,
                               .step = 1000 + s, .src_stage = 0, .dst_stage = 1, .shape = {2, 3}};
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
        epipe_wire_header h = {.kind = (uint8_t)ctl[i].kind, .step = 7, .src_stage = 2,
                               .dst_stage = 1};
        if (epipe_wire_frame(&h, ctl[i].payload, strlen(ctl[i].payload), msg, sizeof msg,
                             &w) != EPIPE_OK)
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
            DLTensor t = {.data = x, .device = {kDLCPU, 0}, .ndim = 1,
                          .dtype = {kDLFloat, 32, 1}, .shape = &n};
            epipe_codec *c;
            if (epipe_codec_create(&c, fuzz_specs[s]) != EPIPE_OK)
                return 1;
            uint8_t buf[4096];
            size_t len;
            buf[0] = (uint8_t)s;
            buf[1] = (uint8_t)n;
            buf[2] = 0;
            if (epipe_codec_encode(c, &t, buf + 3, sizeof buf - 3, &len) != EPIPE_OK) {
                if (epipe_codec_trainable(c) && n < 2) { /* insert needs D >= out */
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
    snprintf(dir, sizeof dir, "%s/spec", argv[1]);
    mkdir(dir, 0755);
    for (size_t s = 0; s < FUZZ_NSPECS; s++) {
        char name[32];
        snprintf(name, sizeof name, "spec-%zu", s);
        write_file(dir, name, fuzz_specs[s], strlen(fuzz_specs[s]));
    }
    write_wire_corpus(argv[1]);
    return 0;
}
