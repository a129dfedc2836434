/* libibverbs opened at run time: dlopen, symbols by version with dlvsym,
 * and the probe that finds a device with an active port (rdma_verbs.h). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/common.h>

#include "../lib/error.h"
#include "rdma_verbs.h"

#define DEFAULT_LIB "libibverbs.so.1"

/* Symbols and the version each has in rdma-core's libibverbs.so.1. */
static const struct {
    const char *name, *version;
    size_t off;
} syms[] = {
#define S(n, ver)                                                                                  \
    {                                                                                              \
        "ibv_" #n, ver, offsetof(epipe_verbs, n)                                                   \
    }
    S(get_device_list, "IBVERBS_1.1"),
    S(free_device_list, "IBVERBS_1.1"),
    S(get_device_name, "IBVERBS_1.1"),
    S(open_device, "IBVERBS_1.1"),
    S(close_device, "IBVERBS_1.1"),
    S(query_device, "IBVERBS_1.1"),
    S(query_port, "IBVERBS_1.1"),
    S(query_gid, "IBVERBS_1.1"),
    S(alloc_pd, "IBVERBS_1.1"),
    S(dealloc_pd, "IBVERBS_1.1"),
    S(reg_mr, "IBVERBS_1.1"),
    S(dereg_mr, "IBVERBS_1.1"),
    S(create_comp_channel, "IBVERBS_1.0"),
    S(destroy_comp_channel, "IBVERBS_1.0"),
    S(create_cq, "IBVERBS_1.1"),
    S(destroy_cq, "IBVERBS_1.1"),
    S(get_cq_event, "IBVERBS_1.1"),
    S(ack_cq_events, "IBVERBS_1.1"),
    S(create_qp, "IBVERBS_1.1"),
    S(modify_qp, "IBVERBS_1.1"),
    S(destroy_qp, "IBVERBS_1.1"),
    S(wc_status_str, "IBVERBS_1.1"),
#undef S
};

int epipe_verbs_open(epipe_verbs *v)
{
    memset(v, 0, sizeof *v);
    const char *env = getenv("EPIPE_IBVERBS_LIB");
    const char *path = env && *env ? env : DEFAULT_LIB;
    snprintf(v->path, sizeof v->path, "%s", path);
    dlerror();
    v->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!v->lib) {
        /* dlerror() starts with the path again ("PATH: cannot open shared
         * object file: ..."): without it a long path no longer pushes the
         * reason out of the 255-character message */
        const char *e = dlerror();
        size_t n = strlen(path);
        if (e && !strncmp(e, path, n) && e[n] == ':' && e[n + 1] == ' ')
            e += n + 2;
        return epipe_fail(EPIPE_ENOTSUP, "rdma: cannot load the verbs library %s%s (%s)", path,
                          env && *env ? " (from EPIPE_IBVERBS_LIB)" : "", e ? e : "dlopen failed");
    }
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = dlvsym(v->lib, syms[i].name, syms[i].version);
        if (!f) {
            int rc = epipe_fail(EPIPE_ENOTSUP,
                                "rdma: the verbs library %s has no %s@%s (not libibverbs "
                                "from rdma-core?)",
                                path, syms[i].name, syms[i].version);
            dlclose(v->lib);
            v->lib = NULL;
            return rc;
        }
        memcpy((char *)v + syms[i].off, &f, sizeof f);
    }
    return EPIPE_OK;
}

void epipe_verbs_close(epipe_verbs *v)
{
    if (v->lib)
        dlclose(v->lib);
    v->lib = NULL;
}

static const char *port_state(enum ibv_port_state s)
{
    switch (s) {
    case IBV_PORT_NOP: return "NOP";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    }
    return "unknown";
}

int epipe_verbs_probe(const epipe_verbs *v, epipe_verbs_dev *d)
{
    memset(d, 0, sizeof *d);
    const char *want = getenv("EPIPE_RDMA_DEVICE");
    const char *portv = getenv("EPIPE_RDMA_PORT");
    int port = portv && *portv ? atoi(portv) : 1;
    if (port < 1 || port > 255)
        return epipe_fail(EPIPE_EINVAL, "rdma: EPIPE_RDMA_PORT = '%s' is not a port in 1..255",
                          portv);
    int n = 0;
    struct ibv_device **list = v->get_device_list(&n);
    if (!list || n <= 0) {
        if (list)
            v->free_device_list(list);
        return epipe_fail(EPIPE_ENOTSUP, "rdma: no RDMA device (the verbs library %s lists none)",
                          v->path);
    }
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n && !dev; i++)
        if (!want || !*want || !strcmp(v->get_device_name(list[i]), want))
            dev = list[i];
    if (!dev) {
        v->free_device_list(list);
        return epipe_fail(EPIPE_ENOTSUP, "rdma: no RDMA device named '%s' (EPIPE_RDMA_DEVICE)",
                          want);
    }
    snprintf(d->name, sizeof d->name, "%s", v->get_device_name(dev));
    errno = 0;
    d->ctx = v->open_device(dev);
    int why = errno; /* ibv_open_device sets it where the open itself failed */
    v->free_device_list(list);
    if (!d->ctx)
        return epipe_fail(EPIPE_ENOTSUP, "rdma: cannot open RDMA device %s (%s)", d->name,
                          why ? strerror(why) : "no reason given");
    struct ibv_device_attr da;
    memset(&da, 0, sizeof da);
    if (v->query_device(d->ctx, &da) == 0)
        d->max_mr = (uint32_t)da.max_mr;
    d->port = (uint8_t)port;
    memset(&d->port_attr, 0, sizeof d->port_attr);
    int rc = EPIPE_OK;
    if (v->query_port(d->ctx, d->port, &d->port_attr))
        rc = epipe_fail(EPIPE_ENOTSUP, "rdma: device %s has no port %d", d->name, port);
    else if (d->port_attr.state != IBV_PORT_ACTIVE)
        rc = epipe_fail(EPIPE_ENOTSUP, "rdma: device %s port %d is %s, not ACTIVE", d->name, port,
                        port_state(d->port_attr.state));
    else if (v->query_gid(d->ctx, d->port, 0, &d->gid))
        rc = epipe_fail(EPIPE_ENOTSUP, "rdma: device %s port %d has no GID 0", d->name, port);
    if (rc) {
        v->close_device(d->ctx);
        d->ctx = NULL;
    }
    return rc;
}

void epipe_verbs_release(const epipe_verbs *v, epipe_verbs_dev *d)
{
    if (d->ctx)
        v->close_device(d->ctx);
    d->ctx = NULL;
}

const char *epipe_verbs_status(const epipe_verbs *v, enum ibv_wc_status s, char *buf, size_t cap)
{
    const char *t = v && v->wc_status_str ? v->wc_status_str(s) : NULL;
    snprintf(buf, cap, "%s (%d)", t ? t : "status", (int)s);
    return buf;
}
