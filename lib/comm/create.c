/* Communicators created by transport name (epipe_comm_create) and the one
 * place where the settings every transport shares are resolved. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../transport/rdma.h"
#include "../../transport/tcp_impl.h"
#include "../log.h"
#include "../parse.h"
#include "comm_impl.h"

/* ---- settings: defaults < environment < options string ----------------- */

enum setting_kind { S_MS, S_US, S_BYTES, S_CACHE, S_INIT_MS, S_TRACE, S_GROUP };

static const struct {
    const char *key, *var; /* option key, environment variable (or NULL) */
    enum setting_kind kind;
} settings[] = {
    {"timeout_ms", "EPIPE_TIMEOUT_MS", S_MS},
    {"spin_us", "EPIPE_SPIN_US", S_US},
    {"max_message", "EPIPE_MAX_MESSAGE", S_BYTES},
    {"buffer_cache", "EPIPE_BUFFER_CACHE", S_CACHE},
    {"init_timeout_ms", "EPIPE_INIT_TIMEOUT_MS", S_INIT_MS},
    {"trace", NULL, S_TRACE},
    {"group", NULL, S_GROUP},
};
#define NSETTINGS (sizeof settings / sizeof settings[0])

/* Applies setting i = val; `what` says where it came from. */
static int set_one(epipe_comm_settings *s, size_t i, const char *val, const char *what)
{
    int64_t v = 0;
    switch (settings[i].kind) {
    case S_MS:
    case S_INIT_MS:
        if (epipe_parse_i64(val, 1, 86400000, &v))
            return epipe_fail(EPIPE_EINVAL, "comm: %s = '%s' is not a number of ms in 1..86400000",
                              what, val);
        *(settings[i].kind == S_MS ? &s->timeout_ms : &s->init_timeout_ms) = v;
        return EPIPE_OK;
    case S_US:
        if (epipe_parse_i64(val, 0, 1000000, &v))
            return epipe_fail(EPIPE_EINVAL, "comm: %s = '%s' is not a number of us in 0..1000000",
                              what, val);
        s->spin_us = v;
        return EPIPE_OK;
    case S_BYTES:
    case S_CACHE:
        if (epipe_parse_i64(val, settings[i].kind == S_BYTES ? 4096 : 0, INT64_C(1) << 40, &v))
            return epipe_fail(EPIPE_EINVAL, "comm: %s = '%s' is not a byte count in %s..2^40", what,
                              val, settings[i].kind == S_BYTES ? "4096" : "0");
        *(settings[i].kind == S_BYTES ? &s->max_message : &s->buffer_cache) = (uint64_t)v;
        return EPIPE_OK;
    case S_TRACE:
    case S_GROUP: {
        char *dst = settings[i].kind == S_TRACE ? s->trace : s->group;
        size_t cap = settings[i].kind == S_TRACE ? sizeof s->trace : sizeof s->group;
        if (!*val || strlen(val) >= cap)
            return epipe_fail(EPIPE_EINVAL, "comm: %s must have 1..%zu characters", what, cap - 1);
        strcpy(dst, val);
        return EPIPE_OK;
    }
    }
    return epipe_fail(EPIPE_EINTERNAL, "comm: setting %zu has no kind", i);
}

int epipe_comm_settings_resolve(epipe_comm_settings *s, const char *options, char *rest,
                                size_t restcap)
{
    memset(s, 0, sizeof *s);
    s->timeout_ms = 30000;
    s->spin_us = 50;
    s->max_message = UINT64_C(1) << 32;
    s->buffer_cache = (uint64_t)512 << 20;
    s->init_timeout_ms = 120000;
    rest[0] = '\0';
    for (size_t i = 0; i < NSETTINGS; i++) {
        const char *v = settings[i].var ? getenv(settings[i].var) : NULL;
        int rc;
        if (v && *v && (rc = set_one(s, i, v, settings[i].var)))
            return rc;
    }
    if (!options || !*options)
        return EPIPE_OK;
    char buf[1024];
    if (strlen(options) >= sizeof buf)
        return epipe_fail(EPIPE_EINVAL, "comm: options string is longer than %zu characters",
                          sizeof buf - 1);
    strcpy(buf, options);
    size_t used = 0;
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq)
            return epipe_fail(EPIPE_EINVAL, "comm: option '%s' has no value (use key=value)", item);
        *eq = '\0';
        size_t i = 0;
        while (i < NSETTINGS && strcmp(settings[i].key, item))
            i++;
        if (i < NSETTINGS) {
            char what[96];
            snprintf(what, sizeof what, "option %s", item);
            int rc = set_one(s, i, eq + 1, what);
            if (rc)
                return rc;
            continue;
        }
        *eq = '=';
        size_t n = strlen(item);
        if (used + n + 2 > restcap)
            return epipe_fail(EPIPE_EINVAL, "comm: options string is too long");
        if (used)
            rest[used++] = ',';
        memcpy(rest + used, item, n + 1);
        used += n;
    }
    return EPIPE_OK;
}

/* ---- creation by name --------------------------------------------------- */

/* The transport `name` asks for: the argument, else EPIPE_TRANSPORT, else
 * "auto"; "auto" (why = "auto") is tcp, with rdma where both ends can, for groups
 * of more than one rank or ranks from the
 * environment, else inproc. */
static const char *pick_transport(const char *name, unsigned size, int from_env, const char **why)
{
    *why = "argument";
    if (!name || !*name || !strcmp(name, "auto")) {
        const char *env = getenv("EPIPE_TRANSPORT");
        *why = "EPIPE_TRANSPORT";
        name = env && *env ? env : "auto";
    }
    if (!strcmp(name, "auto")) {
        *why = "auto";
        /* Across processes: tcp, with rdma to the neighbours where both
         * sides have an active device (epipe_rdma_comm_create decides). */
        name = size > 1 || from_env ? "tcp" : "inproc";
    }
    return name;
}

EPIPE_API int epipe_comm_create(epipe_comm **out, const char *transport, unsigned rank,
                                unsigned size, const char *master_addr, unsigned master_port,
                                const char *options)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create: out is NULL");
    *out = NULL;
    int from_env = rank == EPIPE_COMM_FROM_ENV || size == EPIPE_COMM_FROM_ENV;
    if (from_env && (rank != EPIPE_COMM_FROM_ENV || size != EPIPE_COMM_FROM_ENV))
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create: rank and size must both be "
                                        "EPIPE_COMM_FROM_ENV or neither");
    epipe_rdv_env e;
    char addr[256];
    if (from_env) {
        int rc = epipe_rdv_env_parse(&e);
        if (rc)
            return rc;
        rank = e.rank;
        size = e.size;
        if (!master_addr || !*master_addr) {
            snprintf(addr, sizeof addr, "%s", e.master_addr);
            master_addr = addr;
            if (!master_port)
                master_port = e.master_port;
        }
        epipe_log_info((int)rank, "rendezvous",
                       "rank %u of %u from %s; master %s:%u (address from %s, port from %s)", rank,
                       size, e.source, master_addr, master_port, e.addr_source, e.port_source);
    }
    const char *why;
    const char *name = pick_transport(transport, size, from_env, &why);
    epipe_comm_settings s;
    char rest[1024 + 96];
    int rc = epipe_comm_settings_resolve(&s, options, rest, 1024);
    if (rc)
        return rc;
    if (!strcmp(name, "inproc")) {
        if (from_env)
            return epipe_fail(EPIPE_EINVAL, "inproc: ranks of one process give their rank and "
                                            "size, not EPIPE_COMM_FROM_ENV");
        if (rest[0])
            return epipe_fail(EPIPE_EINVAL,
                              "inproc: unknown option(s) '%s' (known: group, "
                              "timeout_ms, init_timeout_ms, spin_us, max_message, "
                              "buffer_cache, trace)",
                              rest);
        rc = epipe_inproc_join(out, rank, size, &s);
    } else if (!strcmp(name, "tcp") || !strcmp(name, "rdma")) {
        int is_auto = !strcmp(name, "tcp") && !strcmp(why, "auto"); /* tcp, rdma where both can */
        if (s.group[0])
            return epipe_fail(EPIPE_EINVAL, "%s: option group is for inproc only", name);
        /* The handle gets s (epipe_comm_alloc); the rendezvous, which runs
         * before there is one, reads its init timeout from the options. */
        size_t n = strlen(rest);
        snprintf(rest + n, sizeof rest - n, "%sinit_timeout_ms=%lld", n ? "," : "",
                 (long long)s.init_timeout_ms);
        if (!strcmp(name, "tcp") && !is_auto) {
            rc = epipe_tcp_comm_create(out, rank, size, master_addr, master_port, rest, &s);
        } else {
#ifdef EPIPE_HAVE_RDMA
            rc = epipe_rdma_comm_create(out, rank, size, master_addr, master_port, rest, is_auto,
                                        &s);
#else
            if (!is_auto)
                return epipe_fail(EPIPE_ENOTSUP,
                                  "comm: the rdma transport is not built into this "
                                  "libepipe (transport '%s' from %s)",
                                  name, why);
            epipe_log_debug(-1, "comm",
                            "auto: transport tcp (rdma is not built into this libepipe)");
            rc = epipe_tcp_comm_create(out, rank, size, master_addr, master_port, rest, &s);
#endif
        }
    } else {
        return epipe_fail(EPIPE_EINVAL,
                          "comm: unknown transport '%s' (from %s; known: tcp, "
                          "inproc, rdma, auto)",
                          name, why);
    }
    if (rc == EPIPE_OK)
        epipe_comm_publish(*out);
    return rc;
}

/* ---- the older functions, as thin wrappers ------------------------------ */

EPIPE_API int epipe_comm_create_inproc(epipe_comm **comms, unsigned size)
{
    epipe_clear_error();
    if (!comms)
        return epipe_fail(EPIPE_EINVAL, "epipe_comm_create_inproc: comms is NULL");
    epipe_comm_settings s;
    char rest[8];
    int rc = epipe_comm_settings_resolve(&s, NULL, rest, sizeof rest);
    if (rc == EPIPE_OK)
        rc = epipe_inproc_create_all(comms, size, &s);
    for (unsigned r = 0; rc == EPIPE_OK && r < size; r++)
        epipe_comm_publish(comms[r]);
    return rc;
}

EPIPE_API int epipe_comm_create_tcp(epipe_comm **out, unsigned rank, unsigned size,
                                    const char *master_addr, unsigned master_port,
                                    const char *options)
{
    if (rank == EPIPE_COMM_FROM_ENV || size == EPIPE_COMM_FROM_ENV) {
        epipe_clear_error();
        if (out)
            *out = NULL;
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_comm_create_tcp: rank %u of size %u is out of "
                          "range (size 1..1048576, rank below it)",
                          rank, size);
    }
    return epipe_comm_create(out, "tcp", rank, size, master_addr, master_port, options);
}

EPIPE_API int epipe_comm_create_from_env(epipe_comm **out, const char *options)
{
    return epipe_comm_create(out, "tcp", EPIPE_COMM_FROM_ENV, EPIPE_COMM_FROM_ENV, NULL, 0,
                             options);
}
