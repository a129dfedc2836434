/* fakeverbs: the device, contexts, protection domains and memory regions of the
 * test verbs provider, its environment knobs, logging and leak accounting. */
#define _GNU_SOURCE
#include "fv_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct fv_nic fv_nic = {.lock = PTHREAD_MUTEX_INITIALIZER, .epfd = -1, .lfd = -1, .kickfd = -1};

static struct ibv_device fv_device = {
    .node_type = IBV_NODE_CA,
    .transport_type = IBV_TRANSPORT_IB,
    .name = "fakeverbs0",
    .dev_name = "uverbs_fake0",
    .dev_path = "/nonexistent/fakeverbs0",
    .ibdev_path = "/nonexistent/fakeverbs0",
};

static int fv_live_counts[FV_LIVE_N];
static pthread_mutex_t fv_open_lock = PTHREAD_MUTEX_INITIALIZER;

void fv_live_add(enum fv_live_kind kind, int delta)
{
    __atomic_add_fetch(&fv_live_counts[kind], delta, __ATOMIC_RELAXED);
}

void fv_live_reset(void)
{
    memset(fv_live_counts, 0, sizeof fv_live_counts);
    pthread_mutex_init(&fv_open_lock, NULL);
}

FV_EXPORT int fakeverbs_live(const char *what);
FV_EXPORT int fakeverbs_live(const char *what)
{
    static const char *const names[FV_LIVE_N] = {"ctx", "pd", "mr", "cq", "qp", "channel"};
    if (!what)
        return -1;
    for (int i = 0; i < FV_LIVE_N; i++)
        if (strcmp(what, names[i]) == 0)
            return __atomic_load_n(&fv_live_counts[i], __ATOMIC_RELAXED);
    return -1;
}

/* The ops EPIPE_FAKEVERBS_FAIL can fail, by FV_FAIL_* index. */
static const char *const fv_fail_ops[4] = {"reg_mr", "create_qp", "modify_qp", "post_send"};

/* Calls of an op of fv_fail_ops since the device was last opened with no
 * other user; -1 for another name. */
FV_EXPORT long fakeverbs_calls(const char *op);
FV_EXPORT long fakeverbs_calls(const char *op)
{
    for (int i = 0; op && i < 4; i++)
        if (strcmp(op, fv_fail_ops[i]) == 0) {
            pthread_mutex_lock(&fv_nic.lock);
            long n = (long)fv_nic.calls[i];
            pthread_mutex_unlock(&fv_nic.lock);
            return n;
        }
    return -1;
}

uint64_t fv_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void fv_log(const char *fmt, ...)
{
    if (!fv_nic.log)
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fakeverbs[%d]: %s\n", (int)getpid(), line);
}

/* EPIPE_FAKEVERBS_FAIL=<op>:<n>[,<op>:<n>...]: the n-th call (from 1) of op fails. */
static void fv_parse_env(void)
{
    const char *lg = getenv("EPIPE_FAKEVERBS_LOG");
    fv_nic.log = lg && *lg && strcmp(lg, "0") != 0;
    const char *st = getenv("EPIPE_FAKEVERBS_STRICT");
    fv_nic.strict = st && *st && strcmp(st, "0") != 0;
    memset(fv_nic.calls, 0, sizeof fv_nic.calls);
    memset(fv_nic.fail_at, 0, sizeof fv_nic.fail_at);
    const char *f = getenv("EPIPE_FAKEVERBS_FAIL");
    while (f && *f) {
        const char *colon = strchr(f, ':');
        if (!colon)
            break;
        char *end;
        unsigned long n = strtoul(colon + 1, &end, 10);
        for (int i = 0; i < 4; i++)
            if ((size_t)(colon - f) == strlen(fv_fail_ops[i]) &&
                strncmp(f, fv_fail_ops[i], strlen(fv_fail_ops[i])) == 0)
                fv_nic.fail_at[i] = n;
        f = *end == ',' ? end + 1 : "";
    }
}

int fv_fail_now(int op)
{
    fv_nic.calls[op]++;
    if (fv_nic.fail_at[op] && fv_nic.calls[op] == fv_nic.fail_at[op]) {
        fv_log("injected failure of call %lu of op %d (EPIPE_FAKEVERBS_FAIL)", fv_nic.calls[op],
               op);
        return 1;
    }
    return 0;
}

static int fv_env_is(const char *name, const char *val)
{
    const char *v = getenv(name);
    return v && strcmp(v, val) == 0;
}

FV_EXPORT struct ibv_device **ibv_get_device_list(int *num);
FV_EXPORT struct ibv_device **ibv_get_device_list(int *num)
{
    int n = fv_env_is("EPIPE_FAKEVERBS_DEVICES", "0") ? 0 : 1;
    struct ibv_device **list = calloc(2, sizeof *list);
    if (!list) {
        errno = ENOMEM;
        return NULL;
    }
    if (n)
        list[0] = &fv_device;
    if (num)
        *num = n;
    return list;
}

FV_EXPORT void ibv_free_device_list(struct ibv_device **list);
FV_EXPORT void ibv_free_device_list(struct ibv_device **list)
{
    free(list);
}

FV_EXPORT const char *ibv_get_device_name(struct ibv_device *device);
FV_EXPORT const char *ibv_get_device_name(struct ibv_device *device)
{
    return device ? device->name : NULL;
}

FV_EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device);
FV_EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device)
{
    if (device != &fv_device) {
        errno = ENODEV;
        return NULL;
    }
    struct ibv_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&fv_open_lock);
    if (fv_nic.users == 0) {
        fv_parse_env();
        int rc = fv_nic_start();
        if (rc) {
            pthread_mutex_unlock(&fv_open_lock);
            free(ctx);
            errno = rc;
            return NULL;
        }
    }
    fv_nic.users++;
    pthread_mutex_unlock(&fv_open_lock);
    ctx->device = device;
    ctx->cmd_fd = -1;
    ctx->async_fd = -1;
    ctx->num_comp_vectors = 1;
    ctx->abi_compat = NULL; /* not a verbs_context: the inline helpers use the ops table */
    ctx->ops.poll_cq = fv_poll_cq;
    ctx->ops.req_notify_cq = fv_req_notify_cq;
    ctx->ops.post_send = fv_post_send;
    ctx->ops.post_recv = fv_post_recv;
    pthread_mutex_init(&ctx->mutex, NULL);
    fv_live_add(FV_LIVE_CTX, 1);
    fv_log("opened fakeverbs0 (gid socket %s)", fv_nic.sockname + 1);
    return ctx;
}

FV_EXPORT int ibv_close_device(struct ibv_context *ctx);
FV_EXPORT int ibv_close_device(struct ibv_context *ctx)
{
    if (!ctx)
        return EINVAL;
    pthread_mutex_lock(&fv_open_lock);
    if (--fv_nic.users == 0)
        fv_nic_stop();
    pthread_mutex_unlock(&fv_open_lock);
    pthread_mutex_destroy(&ctx->mutex);
    free(ctx);
    fv_live_add(FV_LIVE_CTX, -1);
    return 0;
}

FV_EXPORT int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a);
FV_EXPORT int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a)
{
    if (!ctx || !a)
        return EINVAL;
    memset(a, 0, sizeof *a);
    snprintf(a->fw_ver, sizeof a->fw_ver, "fakeverbs-1");
    a->node_guid = htobe64(0x0200fa4e00000001ull);
    a->sys_image_guid = a->node_guid;
    a->max_mr_size = (uint64_t)1 << 40;
    a->page_size_cap = 4096;
    a->vendor_id = 0xfa4e;
    a->max_qp = 65536;
    a->max_qp_wr = FV_MAX_WR;
    a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN;
    a->max_sge = FV_MAX_SGE;
    a->max_sge_rd = FV_MAX_SGE;
    a->max_cq = 65536;
    a->max_cqe = FV_MAX_CQE;
    a->max_mr = FV_MAX_MR;
    a->max_pd = 65536;
    a->max_qp_rd_atom = 16;
    a->max_qp_init_rd_atom = 16;
    a->max_res_rd_atom = 1 << 20;
    a->atomic_cap = IBV_ATOMIC_NONE;
    a->max_pkeys = 1;
    a->local_ca_ack_delay = 16;
    a->phys_port_cnt = 1;
    return 0;
}

/* Fills the compat prefix of struct ibv_port_attr only (everything up to flags). */
struct _compat_ibv_port_attr;
FV_EXPORT int(ibv_query_port)(struct ibv_context *ctx, uint8_t port,
                              struct _compat_ibv_port_attr *attr);
FV_EXPORT int(ibv_query_port)(struct ibv_context *ctx, uint8_t port,
                              struct _compat_ibv_port_attr *attr)
{
    if (!ctx || !attr || port != 1)
        return EINVAL;
    struct ibv_port_attr a;
    memset(&a, 0, sizeof a);
    a.state = fv_env_is("EPIPE_FAKEVERBS_PORT", "down") ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    a.max_mtu = IBV_MTU_4096;
    a.active_mtu = IBV_MTU_4096;
    a.gid_tbl_len = 1;
    a.max_msg_sz = FV_MAX_MSG;
    a.pkey_tbl_len = 1;
    a.lid = 0; /* RoCE: no LID, route by GID */
    a.max_vl_num = 1;
    a.active_width = 2;
    a.active_speed = 32;
    a.phys_state = a.state == IBV_PORT_ACTIVE ? 5 : 3;
    a.link_layer = IBV_LINK_LAYER_ETHERNET;
    memcpy(attr, &a, offsetof(struct ibv_port_attr, port_cap_flags2));
    return 0;
}

FV_EXPORT int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid);
FV_EXPORT int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
{
    if (!ctx || !gid || port != 1 || index != 0)
        return -1;
    *gid = fv_nic.gid;
    return 0;
}

FV_EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx);
FV_EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx)
{
    struct fv_pd *p = ctx ? calloc(1, sizeof *p) : NULL;
    if (!p) {
        errno = ctx ? ENOMEM : EINVAL;
        return NULL;
    }
    p->pd.context = ctx;
    fv_live_add(FV_LIVE_PD, 1);
    return &p->pd;
}

FV_EXPORT int ibv_dealloc_pd(struct ibv_pd *pd);
FV_EXPORT int ibv_dealloc_pd(struct ibv_pd *pd)
{
    if (!pd)
        return EINVAL;
    struct fv_pd *p = FV_CONTAINER(pd, struct fv_pd, pd);
    pthread_mutex_lock(&fv_nic.lock);
    int refs = p->refs;
    pthread_mutex_unlock(&fv_nic.lock);
    if (refs) {
        fv_log("ibv_dealloc_pd: %d MRs/QPs still use the PD: EBUSY", refs);
        return EBUSY;
    }
    free(p);
    fv_live_add(FV_LIVE_PD, -1);
    return 0;
}

/* Keys: tag (L or R) << 24 | slot << 8 | generation, so lkey != rkey and a stale key
 * of a freed slot does not match its next tenant. */
static struct fv_mr *fv_mr_by_key(uint32_t key, int remote)
{
    uint32_t slot = (key >> 8) & 0xffff;
    if (slot >= fv_nic.nmrs || !fv_nic.mrs[slot])
        return NULL;
    struct fv_mr *m = fv_nic.mrs[slot];
    return (remote ? m->mr.rkey : m->mr.lkey) == key ? m : NULL;
}
struct fv_mr *fv_mr_by_lkey(uint32_t lkey)
{
    return fv_mr_by_key(lkey, 0);
}
struct fv_mr *fv_mr_by_rkey(uint32_t rkey)
{
    return fv_mr_by_key(rkey, 1);
}

FV_EXPORT struct ibv_mr *(ibv_reg_mr)(struct ibv_pd *pd, void *addr, size_t length, int access);
FV_EXPORT struct ibv_mr *(ibv_reg_mr)(struct ibv_pd *pd, void *addr, size_t length, int access)
{
    const int known = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                      IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_RELAXED_ORDERING;
    if (!pd || (!addr && length) || (access & ~known) ||
        ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
         !(access & IBV_ACCESS_LOCAL_WRITE))) {
        fv_log("ibv_reg_mr: invalid argument (pd %p addr %p access 0x%x)", (void *)pd, addr,
               access);
        errno = EINVAL;
        return NULL;
    }
    struct fv_mr *m = calloc(1, sizeof *m);
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&fv_nic.lock);
    if (fv_fail_now(FV_FAIL_REG_MR)) {
        pthread_mutex_unlock(&fv_nic.lock);
        free(m);
        errno = ENOMEM;
        return NULL;
    }
    uint32_t slot = 0;
    while (slot < fv_nic.nmrs && fv_nic.mrs[slot])
        slot++;
    if (slot == fv_nic.nmrs) {
        uint32_t ncap = fv_nic.nmrs ? fv_nic.nmrs * 2 : 64;
        if (ncap > FV_MAX_MR)
            ncap = FV_MAX_MR;
        struct fv_mr **nm = slot < ncap ? realloc(fv_nic.mrs, ncap * sizeof *nm) : NULL;
        uint8_t *ng = nm ? realloc(fv_nic.mrgen, ncap) : NULL;
        if (nm)
            fv_nic.mrs = nm;
        if (!ng) {
            pthread_mutex_unlock(&fv_nic.lock);
            free(m);
            errno = ENOMEM;
            return NULL;
        }
        fv_nic.mrgen = ng;
        memset(nm + fv_nic.nmrs, 0, (ncap - fv_nic.nmrs) * sizeof *nm);
        memset(ng + fv_nic.nmrs, 0, ncap - fv_nic.nmrs);
        fv_nic.nmrs = ncap;
    }
    uint32_t gen = ++fv_nic.mrgen[slot];
    m->slot = slot;
    m->access = access;
    m->mr.context = pd->context;
    m->mr.pd = pd;
    m->mr.addr = addr;
    m->mr.length = length;
    m->mr.handle = slot;
    m->mr.lkey = (0x4cu << 24) | (slot << 8) | gen;
    m->mr.rkey = (0x52u << 24) | (slot << 8) | gen;
    fv_nic.mrs[slot] = m;
    FV_CONTAINER(pd, struct fv_pd, pd)->refs++;
    pthread_mutex_unlock(&fv_nic.lock);
    fv_live_add(FV_LIVE_MR, 1);
    fv_log("reg_mr %p+%zu access 0x%x lkey 0x%x rkey 0x%x", addr, length, access, m->mr.lkey,
           m->mr.rkey);
    return &m->mr;
}

/* The NIC places data under fv_nic.lock and looks the MR up by key for every
 * chunk, so once this returns nothing writes into the region any more. */
FV_EXPORT int ibv_dereg_mr(struct ibv_mr *mr);
FV_EXPORT int ibv_dereg_mr(struct ibv_mr *mr)
{
    if (!mr)
        return EINVAL;
    struct fv_mr *m = FV_CONTAINER(mr, struct fv_mr, mr);
    pthread_mutex_lock(&fv_nic.lock);
    if (m->slot >= fv_nic.nmrs || fv_nic.mrs[m->slot] != m) {
        pthread_mutex_unlock(&fv_nic.lock);
        return EINVAL;
    }
    fv_nic.mrs[m->slot] = NULL;
    FV_CONTAINER(mr->pd, struct fv_pd, pd)->refs--;
    pthread_mutex_unlock(&fv_nic.lock);
    free(m);
    fv_live_add(FV_LIVE_MR, -1);
    return 0;
}

FV_EXPORT const char *ibv_wc_status_str(enum ibv_wc_status status);
FV_EXPORT const char *ibv_wc_status_str(enum ibv_wc_status status)
{
    static const char *const s[] = {
        [IBV_WC_SUCCESS] = "success",
        [IBV_WC_LOC_LEN_ERR] = "local length error",
        [IBV_WC_LOC_QP_OP_ERR] = "local QP operation error",
        [IBV_WC_LOC_EEC_OP_ERR] = "local EE context operation error",
        [IBV_WC_LOC_PROT_ERR] = "local protection error",
        [IBV_WC_WR_FLUSH_ERR] = "Work Request Flushed Error",
        [IBV_WC_MW_BIND_ERR] = "memory management operation error",
        [IBV_WC_BAD_RESP_ERR] = "bad response error",
        [IBV_WC_LOC_ACCESS_ERR] = "local access error",
        [IBV_WC_REM_INV_REQ_ERR] = "remote invalid request error",
        [IBV_WC_REM_ACCESS_ERR] = "remote access error",
        [IBV_WC_REM_OP_ERR] = "remote operation error",
        [IBV_WC_RETRY_EXC_ERR] = "transport retry counter exceeded",
        [IBV_WC_RNR_RETRY_EXC_ERR] = "RNR retry counter exceeded",
        [IBV_WC_LOC_RDD_VIOL_ERR] = "local RDD violation error",
        [IBV_WC_REM_INV_RD_REQ_ERR] = "remote invalid RD request",
        [IBV_WC_REM_ABORT_ERR] = "aborted error",
        [IBV_WC_INV_EECN_ERR] = "invalid EE context number",
        [IBV_WC_INV_EEC_STATE_ERR] = "invalid EE context state",
        [IBV_WC_FATAL_ERR] = "fatal error",
        [IBV_WC_RESP_TIMEOUT_ERR] = "response timeout error",
        [IBV_WC_GENERAL_ERR] = "general error",
    };
    if ((unsigned)status < sizeof s / sizeof s[0] && s[status])
        return s[status];
    return "unknown";
}
