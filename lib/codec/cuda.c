/* The core's side of the CUDA backend: finding and opening the CUDA module
 * (dlopen, on the first CUDA tensor), handle binding and the stream calls. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <epipe/codec.h>

#include "../log.h"
#include "core.h"
#include "cuda_api.h"
#include "cuda_core.h"
#include "payload.h"

#ifndef EPIPE_CUDA_MODULE_PATH
#define EPIPE_CUDA_MODULE_PATH "libepipe-cuda.so"
#endif

static int core_vfail(epipe_codec *c, int status, const char *fmt, va_list ap)
{
    return epipe_vfail_into(c ? c->msg : NULL, status, fmt, ap);
}

static const epipe_cuda_core core_fns = {
    .abi = EPIPE_CUDA_ABI,
    .codec_size = sizeof(struct epipe_codec),
    .vfail = core_vfail,
    .sq_fit_encode = epipe_sq_fit_cuda_encode,
    .sq_fit_decode = epipe_sq_fit_cuda_decode,
    .ef_slot = epipe_codec_ef_slot_cuda,
    .km_sample_size = epipe_km_cuda_sample_size,
    .km_sample_finish = epipe_km_cuda_sample_finish,
    .km_fit = epipe_km_cuda_fit,
    .km_read_table = epipe_km_read_table,
    .check_header = epipe_codec_check_payload_header,
#ifdef EPIPE_HAVE_BLAS
    .pi_plan = epipe_pi_cuda_plan,
    .pi_slot = epipe_pi_cuda_slot,
    .pi_orthonormalize = epipe_pi_cuda_orthonormalize,
    .pi_commit = epipe_pi_cuda_commit,
    .pi_refuse = epipe_pi_cuda_refuse,
    .pi_check_header = epipe_pi_cuda_check_header,
    .ins_plan = epipe_insert_cuda_plan,
    .ins_check_backward = epipe_insert_cuda_check_backward,
#endif
};

/* One module per process, loaded by the first call that needs it and
 * never closed or replaced: device memory, events and handles it made are
 * freed by the same code. So EPIPE_CUDA_MODULE is read only until a module
 * loads, and setting it later changes nothing (nor races with a getenv of
 * ours). A failed load is not remembered, so a host (or a test) may fix
 * the variable and try again. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static const epipe_cuda_module *loaded;

/* CUDA cannot be used in a child forked after it was set up (a DataLoader
 * worker): there the module counts as absent. The lock is held across
 * fork(), so that the child does not inherit it taken by a thread it does
 * not have. */
static int forked_child;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void)
{
    pthread_mutex_lock(&lock);
}

static void fork_parent(void)
{
    pthread_mutex_unlock(&lock);
}

static void fork_child(void)
{
    if (loaded)
        __atomic_store_n(&forked_child, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&lock);
}

static void atfork_init(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* EPIPE_CUDA_MODULE, else epipe/libepipe-cuda.so beside libepipe itself
 * (the install layout), else the configured install path. */
static void module_path(char *out, size_t cap)
{
    const char *env = getenv("EPIPE_CUDA_MODULE");
    if (env && *env) {
        snprintf(out, cap, "%s", env);
        return;
    }
    Dl_info info;
    if (dladdr((void *)module_path, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash) {
            snprintf(out, cap, "%.*s/epipe/libepipe-cuda.so", (int)(slash - info.dli_fname),
                     info.dli_fname);
            if (access(out, R_OK) == 0)
                return;
        }
    }
    snprintf(out, cap, "%s", EPIPE_CUDA_MODULE_PATH);
}

/* The module, loaded now if need be, and a usable device: else
 * EPIPE_ENOTSUP with `why` naming what is missing (no module, no driver,
 * no device), prefixed by `what`. */
static int module_load(const char *what, char *why, size_t cap, const epipe_cuda_module **out)
{
    char path[1024];
    pthread_once(&atfork_once, atfork_init);
    pthread_mutex_lock(&lock);
    if (forked_child) {
        pthread_mutex_unlock(&lock);
        snprintf(why, cap,
                 "%s, but this process was forked after CUDA was set up in its parent, and CUDA "
                 "cannot be used across fork() (create the CUDA work in the child, or spawn it)",
                 what);
        return EPIPE_ENOTSUP;
    }
    if (!loaded) {
        module_path(path, sizeof path);
        dlerror();
        void *so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!so) {
            const char *e = dlerror();
            pthread_mutex_unlock(&lock);
            snprintf(why, cap, "%s, but the CUDA module %s could not be loaded (no module): %s",
                     what, path, e ? e : "dlopen failed");
            return EPIPE_ENOTSUP;
        }
        epipe_cuda_init_fn init;
        *(void **)&init = dlsym(so, EPIPE_CUDA_INIT_SYMBOL);
        const epipe_cuda_module *m = NULL;
        int rc = init ? init(&core_fns, &m) : EPIPE_ENOTSUP;
        if (rc || !m || m->abi != EPIPE_CUDA_ABI) {
            dlclose(so);
            pthread_mutex_unlock(&lock);
            snprintf(why, cap, "%s, but %s is not a CUDA module of this libepipe build (%s)", what,
                     path, init ? "its interface version differs" : "no " EPIPE_CUDA_INIT_SYMBOL);
            return EPIPE_ENOTSUP;
        }
        __atomic_store_n(&loaded, m, __ATOMIC_RELEASE);
    }
    const epipe_cuda_module *m = loaded;
    char probe[200];
    int probed = m->probe(probe, sizeof probe); /* under the lock: it caches */
    pthread_mutex_unlock(&lock);
    if (probed) {
        snprintf(why, cap, "%s, but there is %s", what, probe);
        return EPIPE_ENOTSUP;
    }
    *out = m;
    return EPIPE_OK;
}

/* The module if one is loaded, without loading it; none in a forked child
 * (freeing what the parent's CUDA made is the parent's business). It takes
 * no lock: the frees that ask run under other handles' locks, and fork()
 * takes this file's lock and theirs in its own order. */
static const epipe_cuda_module *loaded_module(void)
{
    if (__atomic_load_n(&forked_child, __ATOMIC_ACQUIRE))
        return NULL;
    return __atomic_load_n(&loaded, __ATOMIC_ACQUIRE);
}

/* module_load() for a codec call: the message on the handle. */
static int module_get(epipe_codec *c, const char *what, const epipe_cuda_module **out)
{
    char head[64], why[1400];
    snprintf(head, sizeof head, "%s is a CUDA tensor", what);
    int rc = module_load(head, why, sizeof why, out);
    return rc ? epipe_codec_fail(c, rc, "%s", why) : EPIPE_OK;
}

int epipe_cuda_device_ok(int device, char *why, size_t cap)
{
    const epipe_cuda_module *m;
    int rc = module_load("CUDA tensors were asked for", why, cap, &m);
    return rc ? rc : m->device_ok(device, why, cap);
}

int epipe_cuda_dev_alloc(int device, size_t bytes, void **p, char *why, size_t cap)
{
    const epipe_cuda_module *m;
    int rc = module_load("a CUDA tensor was asked for", why, cap, &m);
    return rc ? rc : m->alloc(device, bytes, p, why, cap);
}

void epipe_cuda_dev_free(int device, void *p)
{
    const epipe_cuda_module *m = loaded_module();
    if (m && p) /* device memory exists only if a module made it */
        m->free(device, p);
}

int epipe_cuda_pinned_alloc(int device, size_t bytes, void **p)
{
    const epipe_cuda_module *m = loaded_module();
    char why[256];
    if (!m) /* loads nothing: a caller that wants pinned memory has a module */
        return EPIPE_ENOTSUP;
    return m->host_alloc(device, bytes ? bytes : 1, p, why, sizeof why);
}

const epipe_codec_backend *epipe_codec_cuda_loaded_backend(const epipe_codec_ops *ops)
{
    const epipe_cuda_module *m = loaded_module();
    return m ? m->backend((unsigned)ops->id) : NULL;
}

static const char *device_name(int type)
{
    return type == kDLCUDA ? "CUDA" : "CPU";
}

/* 1 when m has no kernels for c's codec or c asks for what they lack:
 * activation deltas, or (a trainable codec whose CUDA backend has no train
 * ops) a forward that keeps its input for the backward, which then runs on
 * the CPU's host copies too (train.c). */
static int staged(const epipe_cuda_module *m, const epipe_codec *c)
{
    const epipe_codec_backend *be = m->backend((unsigned)c->ops->id);
    return !be || c->delta || (c->ops->code_shape && !be->train && c->microbatch >= 0);
}

int epipe_codec_cuda_backend(epipe_codec *c, const DLTensor *t, const char *what,
                             const epipe_codec_backend **be)
{
    const epipe_cuda_module *m;
    int rc = module_get(c, what, &m);
    if (rc)
        return rc;
    if (!staged(m, c)) {
        *be = m->backend((unsigned)c->ops->id);
        return EPIPE_OK;
    }
    /* No kernels for the codec, or a setting they lack: the CPU backend
     * runs it on host copies (lib/codec/cuda_staged.c). */
    if (!(*be = epipe_codec_backend_of(c->ops, EPIPE_CODEC_DEV_CPU)))
        return epipe_codec_fail(c, EPIPE_ENOTSUP,
                                "%s is a CUDA tensor; the CUDA backend has no kernels for codec "
                                "'%s', and this build has no CPU backend to stage it through",
                                what, c->ops->name);
    return EPIPE_OK;
}

int epipe_codec_cuda_staged(const epipe_codec *c)
{
    const epipe_cuda_module *m = loaded_module();
    return m && staged(m, c);
}

int epipe_codec_cuda_check(epipe_codec *c, const DLTensor *t, const char *what, int *device)
{
    const epipe_cuda_module *m;
    int rc = module_get(c, what, &m);
    return rc ? rc : m->check(c, t, what, device);
}

int epipe_codec_cuda_host_alloc(epipe_codec *c, int device, size_t bytes, void **p)
{
    const epipe_cuda_module *m;
    char why[256];
    int rc = module_get(c, "a staged tensor", &m);
    if (rc)
        return rc;
    if ((rc = m->host_alloc(device, bytes ? bytes : 1, p, why, sizeof why)))
        return epipe_codec_fail(c, rc, "%s: %s", c->ops->name, why);
    return EPIPE_OK;
}

void epipe_codec_cuda_host_free(int device, void *p)
{
    const epipe_cuda_module *m = loaded_module();
    if (m && p) /* pinned memory exists only if a module made it */
        m->host_free(device, p);
}

int epipe_codec_cuda_stream_copy(epipe_codec *c, int device, void *dst, const void *src,
                                 size_t bytes)
{
    const epipe_cuda_module *m;
    int rc = module_get(c, "a staged tensor", &m);
    return rc || !bytes ? rc : m->stream_copy(c, device, dst, src, bytes);
}

int epipe_codec_cuda_payload_copy(epipe_codec *c, int device, void *dst, int src_device,
                                  const void *src, size_t bytes)
{
    const epipe_cuda_module *m;
    int rc = module_get(c, "a device payload", &m);
    return rc || !bytes ? rc : m->payload_copy(c, device, dst, src_device, src, bytes);
}

/* Fences and marks exist only where a module made them: these load none. */
static int fence_module(epipe_codec *c, const char *what, const epipe_cuda_module **m)
{
    if ((*m = loaded_module()))
        return EPIPE_OK;
    return epipe_codec_fail(c, EPIPE_ENOTSUP, "no CUDA module is loaded for %s", what);
}

int epipe_codec_cuda_fence(epipe_codec *c, int device, const void *taint, void **fence)
{
    const epipe_cuda_module *m;
    *fence = NULL;
    int rc = fence_module(c, "a payload's fence", &m);
    return rc ? rc : m->fence(c, device, taint, fence);
}

int epipe_codec_cuda_fence_wait(epipe_codec *c, int device, void *fence, void **taint)
{
    const epipe_cuda_module *m;
    int rc = fence_module(c, "a payload's fence", &m);
    return rc ? rc : m->fence_wait(c, device, fence, taint);
}

int epipe_codec_cuda_fence_status(epipe_codec *c, void *fence)
{
    const epipe_cuda_module *m;
    int rc = fence_module(c, "a payload's fence", &m);
    return rc ? rc : m->fence_status(c, fence);
}

void epipe_cuda_fence_free(int device, void *fence)
{
    const epipe_cuda_module *m = loaded_module();
    if (m && fence)
        m->fence_free(device, fence);
}

int epipe_codec_cuda_mark(epipe_codec *c, int device, void **mark)
{
    const epipe_cuda_module *m;
    int rc = fence_module(c, "a decode's mark", &m);
    return rc ? rc : m->mark(c, device, mark);
}

int epipe_cuda_mark_passed(int device, void *mark)
{
    const epipe_cuda_module *m = loaded_module();
    return m && mark ? m->mark_passed(device, mark) : 0;
}

void epipe_cuda_mark_free(int device, void *mark)
{
    const epipe_cuda_module *m = loaded_module();
    if (m && mark)
        m->mark_free(device, mark);
}

int epipe_codec_check_binding(epipe_codec *c, const DLTensor *t, const char *what)
{
    int type = t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged ? kDLCUDA
                                                                                           : kDLCPU;
    int id = type == kDLCUDA ? t->device.device_id : 0;
    if (!c->bound_type || (c->bound_type == type && c->bound_id == id))
        return EPIPE_OK;
    return epipe_codec_fail(c, EPIPE_EINVAL,
                            "%s: %s is a %s tensor (device %d), but this handle is bound to %s "
                            "device %d by its first tensor; use one handle per device",
                            c->ops->name, what, device_name(type), id, device_name(c->bound_type),
                            c->bound_id);
}

int epipe_codec_bound_to(const epipe_codec *c, int *cuda_device)
{
    if (!c || !c->bound_type)
        return 0;
    *cuda_device = c->bound_type == kDLCUDA ? c->bound_id : -1;
    return 1;
}

void epipe_codec_bind(epipe_codec *c, const DLTensor *t)
{
    if (c->bound_type)
        return;
    int cuda = t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged;
    c->bound_type = cuda ? kDLCUDA : kDLCPU;
    c->bound_id = cuda ? t->device.device_id : 0;
}

int epipe_codec_cuda_encode(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                            uint64_t n, enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr,
                            size_t len)
{
    const epipe_cuda_module *m;
    int dev, rc = module_get(c, "src", &m);
    if (rc || (rc = m->check(c, src, "src", &dev)))
        return rc;
    c->cuda_unsynced = 1; /* even a failed call may have queued some */
    return m->encode(c, be, src, n, dt, payload, hdr, len);
}

int epipe_codec_cuda_decode(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload,
                            size_t len, uint64_t n, DLTensor *dst, enum epipe_dtype dt)
{
    const epipe_cuda_module *m;
    int dev, rc = module_get(c, "dst", &m);
    if (rc || (rc = m->check(c, dst, "dst", &dev)))
        return rc;
    c->cuda_unsynced = 1; /* even a failed call may have queued some */
    return m->decode(c, be, payload, len, n, dst, dt);
}

int epipe_codec_cuda_backward(epipe_codec *c, const epipe_codec_backend *be, int enc, unsigned mb,
                              const DLTensor *gin, const char *in_name, uint64_t n_in,
                              enum epipe_dtype dt_in, DLTensor *gout, const char *out_name,
                              uint64_t n_out, enum epipe_dtype dt_out)
{
    const epipe_cuda_module *m;
    int dev, rc = module_get(c, in_name, &m);
    if (rc || (rc = m->check(c, gin, in_name, &dev)) || (rc = m->check(c, gout, out_name, &dev)))
        return rc;
    c->cuda_unsynced = 1; /* even a failed call may have queued some */
    return m->backward(c, be, enc, mb, gin, n_in, dt_in, gout, n_out, dt_out);
}

int epipe_codec_cuda_defers(epipe_codec *c, const void *payload)
{
    const epipe_cuda_module *m; /* loaded on first use: the first decode defers too */
    if (module_get(c, "dst", &m) != EPIPE_OK || !m->defers || !m->defers(c, payload))
        return 0;
    /* 0 reads a device payload's checked bytes at once, for measuring the
     * difference in one run (scripts/device/gpu-check.sh); a bad value is
     * refused only by a decode that would defer, not by every one into a
     * CUDA tensor */
    if (c->defer_checks < 0)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: the environment's EPIPE_CUDA_DEFER_CHECKS = '%s' (when the "
                                "handle was made): use 1 (a device payload's header and tables "
                                "checked at synchronize, the default) or 0 (at once)",
                                c->ops->name, c->defer_env);
    return c->defer_checks;
}

void epipe_codec_cuda_read_env(epipe_codec *c)
{
    const char *env = getenv("EPIPE_CUDA_DEFER_CHECKS");
    c->defer_checks = !env || !strcmp(env, "1") ? 1 : !strcmp(env, "0") ? 0 : -1;
    if (c->defer_checks < 0)
        snprintf(c->defer_env, sizeof c->defer_env, "%s", env);
}

int epipe_codec_cuda_peek(epipe_codec *c, const void *payload, size_t len, uint64_t n, void *hdr)
{
    const epipe_cuda_module *m;
    int dev, rc = module_get(c, "dst", &m);
    if (rc)
        return rc;
    if (m->locate(payload, &dev) != 1) {
        memcpy(hdr, payload, EPIPE_PAYLOAD_HEADER);
        return EPIPE_OK;
    }
    return m->peek(c, payload, len, n, hdr);
}

int epipe_codec_cuda_is_device_memory(const void *p)
{
    const epipe_cuda_module *m = loaded_module();
    int dev;
    return m && p && m->locate(p, &dev) == 1;
}

void epipe_codec_cuda_report_unsynced(epipe_codec *c)
{
    const epipe_cuda_module *m = c->cuda && c->cuda_unsynced ? loaded_module() : NULL;
    if (!m) /* c->cuda exists only if a module made it */
        return;
    /* An error the device noted (a value or a payload refused: a CUDA
     * error, sticky, was returned by every call since) that no synchronize
     * returned: a host that destroys the handle would never learn that a
     * tensor it may have used is garbage. The frees in release wait for
     * the device anyway. */
    int rc = m->synchronize(c);
    c->cuda_unsynced = 0;
    if (rc == EPIPE_EINVAL || rc == EPIPE_EPROTO)
        epipe_log_msg(EPIPE_LOG_WARN, -1, "codec",
                      "epipe_codec_destroy(%s): an error no epipe_codec_synchronize() "
                      "returned: %s",
                      c->spec, c->msg);
}

void epipe_codec_cuda_release(epipe_codec *c)
{
    const epipe_cuda_module *m = c->cuda ? loaded_module() : NULL;
    if (m) /* c->cuda exists only if a module made it */
        m->release(c);
}

static int synchronize(epipe_codec *c)
{
    if (!c->cuda)
        return EPIPE_OK; /* CPU work is done when its call returns */
    const epipe_cuda_module *m = loaded_module();
    int rc = m ? m->synchronize(c) : EPIPE_OK;
    /* a failure may hold a second one back for the next synchronize */
    c->cuda_unsynced = rc != EPIPE_OK;
    return rc;
}

EPIPE_EXPERIMENTAL int epipe_codec_set_stream(epipe_codec *c, void *stream)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_set_stream: codec is NULL");
    int rc = synchronize(c); /* the scratch was ordered on the old stream */
    c->stream = stream;
    return rc;
}

EPIPE_EXPERIMENTAL int epipe_codec_synchronize(epipe_codec *c)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_synchronize: codec is NULL");
    return synchronize(c);
}
