/* Fuzz target: the TCP transport's options parser (epipe_tcp_opts_parse).
 * Any string fails with a message or gives settings within their ranges. */
#include <stdlib.h>
#include <string.h>

#include "../../transport/tcp_impl.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int cleared;
    if (!cleared) { /* the environment is one source of settings: start without it */
        static const char *vars[] = {"EPIPE_TIMEOUT_MS",    "EPIPE_INIT_TIMEOUT_MS",
                                     "EPIPE_HEARTBEAT_MS",  "EPIPE_TCP_STREAMS",
                                     "EPIPE_TCP_TOPOLOGY",  "EPIPE_LISTEN_ADDR",
                                     "EPIPE_SPIN_US",       "EPIPE_IFNAME",
                                     "EPIPE_AUTH_KEY_FILE", "EPIPE_ENCRYPT"};
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
    epipe_tcp_opts o;
    int rc = epipe_tcp_opts_parse(&o, spec);
    free(spec);
    if (rc != EPIPE_OK) {
        if (rc != EPIPE_EINVAL || epipe_last_error()[0] == '\0')
            abort();
        return 0;
    }
    if (o.timeout_ms < 1 || o.timeout_ms > 86400000 || o.init_timeout_ms < 1 ||
        o.init_timeout_ms > 86400000 || o.heartbeat_ms < 0 || o.heartbeat_ms > 86400000 ||
        o.spin_us < 0 || o.spin_us > 1000000 || o.streams < 1 ||
        o.streams > EPIPE_TCP_MAX_STREAMS || (o.mesh != 0 && o.mesh != 1) ||
        (o.encrypt != 0 && o.encrypt != 1) || !memchr(o.listen_addr, '\0', sizeof o.listen_addr) ||
        !memchr(o.ifname, '\0', sizeof o.ifname) || !memchr(o.key_file, '\0', sizeof o.key_file))
        abort();
    return 0;
}
