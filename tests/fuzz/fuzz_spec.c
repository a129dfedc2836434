/* Fuzz target: the codec spec parser. Any string either fails with a
 * message or yields a codec whose canonical spec parses to itself. */
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char spec[512];
    if (size >= sizeof spec)
        size = sizeof spec - 1;
    memcpy(spec, data, size);
    spec[size] = '\0';
    epipe_codec *c, *d;
    int rc = epipe_codec_create(&c, spec);
    if (rc != EPIPE_OK) {
        if (c != NULL || epipe_last_error()[0] == '\0')
            abort();
        return 0;
    }
    if (epipe_codec_create(&d, epipe_codec_spec(c)) != EPIPE_OK)
        abort();
    if (strcmp(epipe_codec_spec(c), epipe_codec_spec(d)) != 0)
        abort();
    epipe_codec_destroy(d);
    epipe_codec_destroy(c);
    return 0;
}
