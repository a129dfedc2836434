/* Writes the seed corpus for the fuzz targets: valid payloads of every
 * codec in fuzz_specs.h and valid specs. Run it to refresh
 * tests/fuzz/corpus after a format change:  make_corpus tests/fuzz/corpus */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <epipe/epipe.h>

#include "fuzz_specs.h"

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
    return 0;
}
