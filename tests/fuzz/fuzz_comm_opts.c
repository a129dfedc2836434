/* Fuzz target: the settings every transport shares, parsed from an options
 * string (epipe_comm_settings_resolve, lib/comm/create.c). */
#include <stdlib.h>
#include <string.h>

#include "comm/comm_impl.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int cleared;
    if (!cleared) { /* the environment is one source of settings: start without it */
        static const char *vars[] = {"EPIPE_TIMEOUT_MS", "EPIPE_SPIN_US", "EPIPE_MAX_MESSAGE",
                                     "EPIPE_BUFFER_CACHE", "EPIPE_INIT_TIMEOUT_MS"};
        for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
            unsetenv(vars[i]);
        cleared = 1;
    }
    char *spec = malloc(size + 1);
    if (!spec)
        return 0;
    memcpy(spec, data, size);
    spec[size] = '\0';
    epipe_clear_error();
    epipe_comm_settings s;
    char rest[1024];
    int rc = epipe_comm_settings_resolve(&s, spec, rest, sizeof rest);
    free(spec);
    if (rc != EPIPE_OK) {
        if (rc != EPIPE_EINVAL || epipe_last_error()[0] == '\0')
            abort();
        return 0;
    }
    /* Every value within its documented range, every string terminated,
     * and what is passed on to the transport is key=value items only. */
    if (s.timeout_ms < 1 || s.timeout_ms > 86400000 || s.spin_us < 0 || s.spin_us > 1000000 ||
        s.max_message < 4096 || s.max_message > (UINT64_C(1) << 40) ||
        s.buffer_cache > (UINT64_C(1) << 40) || s.init_timeout_ms < 1 ||
        s.init_timeout_ms > 86400000 || !memchr(s.trace, '\0', sizeof s.trace) ||
        !memchr(s.group, '\0', sizeof s.group) || !memchr(rest, '\0', sizeof rest))
        abort();
    for (const char *item = rest; *item;) {
        const char *end = strchr(item, ',');
        size_t n = end ? (size_t)(end - item) : strlen(item);
        const char *eq = memchr(item, '=', n);
        if (!eq || n == 0)
            abort();
        item += n + (end ? 1 : 0);
    }
    return 0;
}
