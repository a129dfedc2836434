/* A CUDA module for tests on machines without a GPU: one "device" whose
 * memory is host pages kept inaccessible (PROT_NONE) except while the
 * module itself copies them, so any host code that reads or writes device
 * memory directly crashes the test, as it would fault on a real GPU. It
 * has no kernels: every codec goes through the core's host staging
 * (lib/codec/cuda_staged.c), which is what it exists to test. Every copy
 * is bounds-checked against the allocation it touches. */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "codec/cuda_api.h"

#define FAKE_EXPORT __attribute__((visibility("default")))

/* What the tests find with dlsym (test_cuda_staged.c), and the entry point. */
FAKE_EXPORT void *fakecuda_alloc(size_t bytes);
FAKE_EXPORT void fakecuda_free(void *p);
FAKE_EXPORT int fakecuda_copy(void *dst, const void *src, size_t bytes);
FAKE_EXPORT void *fakecuda_last_stream(unsigned long *copies);
FAKE_EXPORT unsigned long fakecuda_host_allocs(void);
FAKE_EXPORT int epipe_cuda_module_init(const epipe_cuda_core *c, const epipe_cuda_module **out);
#define MAX_REGIONS 256

typedef struct region {
    char *p;
    size_t bytes, mapped;
} region;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static region regions[MAX_REGIONS];
static const epipe_cuda_core *core;
static void *last_stream;
static unsigned long stream_copies;

static int fail(epipe_codec *c, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = core->vfail(c, status, fmt, ap);
    va_end(ap);
    return rc;
}

/* The region holding [p, p + bytes), or NULL (lock held). */
static region *find(const void *p, size_t bytes)
{
    const char *q = p;
    for (int i = 0; i < MAX_REGIONS; i++) {
        region *r = &regions[i];
        if (r->p && q >= r->p && q < r->p + r->mapped) {
            size_t off = (size_t)(q - r->p);
            return off <= r->bytes && r->bytes - off >= bytes ? r : NULL;
        }
    }
    return NULL;
}

static int inside_any(const void *p)
{
    const char *q = p;
    for (int i = 0; i < MAX_REGIONS; i++)
        if (regions[i].p && q >= regions[i].p && q < regions[i].p + regions[i].mapped)
            return 1;
    return 0;
}

/* ---- what tests call (dlsym) ------------------------------------------- */

FAKE_EXPORT void *fakecuda_alloc(size_t bytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), mapped = (bytes + page - 1) / page * page;
    void *p = mmap(NULL, mapped ? mapped : page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_REGIONS; i++)
        if (!regions[i].p) {
            regions[i] = (region){p, bytes, mapped ? mapped : page};
            pthread_mutex_unlock(&lock);
            return p;
        }
    pthread_mutex_unlock(&lock);
    munmap(p, mapped ? mapped : page);
    return NULL;
}

FAKE_EXPORT void fakecuda_free(void *p)
{
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_REGIONS; i++)
        if (p && regions[i].p == p) {
            munmap(regions[i].p, regions[i].mapped);
            regions[i] = (region){0};
        }
    pthread_mutex_unlock(&lock);
}

/* memcpy in any direction; -1 when a device side is out of its bounds. */
FAKE_EXPORT int fakecuda_copy(void *dst, const void *src, size_t bytes)
{
    pthread_mutex_lock(&lock);
    region *d = inside_any(dst) ? find(dst, bytes) : NULL;
    region *s = inside_any(src) ? find(src, bytes) : NULL;
    if ((inside_any(dst) && !d) || (inside_any(src) && !s)) {
        pthread_mutex_unlock(&lock);
        return -1;
    }
    if (d)
        mprotect(d->p, d->mapped, PROT_READ | PROT_WRITE);
    if (s && s != d)
        mprotect(s->p, s->mapped, PROT_READ | PROT_WRITE);
    if (bytes)
        memmove(dst, src, bytes);
    if (d)
        mprotect(d->p, d->mapped, PROT_NONE);
    if (s && s != d)
        mprotect(s->p, s->mapped, PROT_NONE);
    pthread_mutex_unlock(&lock);
    return 0;
}

/* The stream of the last staging copy and how many there were. */
FAKE_EXPORT void *fakecuda_last_stream(unsigned long *copies)
{
    pthread_mutex_lock(&lock);
    void *s = last_stream;
    if (copies)
        *copies = stream_copies;
    pthread_mutex_unlock(&lock);
    return s;
}

/* ---- the module --------------------------------------------------------- */

static int probe(char *why, size_t cap)
{
    (void)why, (void)cap;
    return EPIPE_OK;
}

static const epipe_codec_backend *backend(unsigned id)
{
    (void)id;
    return NULL; /* no kernels: the core stages every codec */
}

static int check(epipe_codec *c, const DLTensor *t, const char *what, int *device)
{
    if (t->device.device_id != 0)
        return fail(c, EPIPE_EINVAL, "%s: %s is on CUDA device %d; this machine has 1",
                    c->ops->name, what, (int)t->device.device_id);
    int64_t want = 1;
    uint64_t n = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->strides && t->shape[d] != 1 && t->strides[d] != want)
            return fail(c, EPIPE_EINVAL,
                        "%s: %s is a CUDA tensor with strides; CUDA tensors must be dense",
                        c->ops->name, what);
        want *= t->shape[d];
        n *= (uint64_t)t->shape[d];
    }
    const char *p = (const char *)t->data + t->byte_offset;
    pthread_mutex_lock(&lock);
    int ok = find(p, (size_t)n * (t->dtype.bits / 8)) != NULL;
    pthread_mutex_unlock(&lock);
    if (!ok)
        return fail(c, EPIPE_EINVAL,
                    "%s: %s says kDLCUDA, but its data %p is not CUDA device memory", c->ops->name,
                    what, (const void *)p);
    *device = 0;
    return EPIPE_OK;
}

static int locate(const void *p, int *device)
{
    pthread_mutex_lock(&lock);
    int in = inside_any(p);
    pthread_mutex_unlock(&lock);
    *device = 0;
    return in;
}

static int no_kernels(epipe_codec *c)
{
    return fail(c, EPIPE_EIO, "fakecuda: a kernel entry point was called for codec '%s'",
                c->ops->name);
}

static int peek(epipe_codec *c, const void *payload, size_t len, uint64_t n, void *hdr)
{
    (void)payload, (void)len, (void)n, (void)hdr;
    return no_kernels(c);
}

static int encode(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src, uint64_t n,
                  enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr, size_t len)
{
    (void)be, (void)src, (void)n, (void)dt, (void)payload, (void)hdr, (void)len;
    return no_kernels(c);
}

static int decode(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload, size_t len,
                  uint64_t n, DLTensor *dst, enum epipe_dtype dt)
{
    (void)be, (void)payload, (void)len, (void)n, (void)dst, (void)dt;
    return no_kernels(c);
}

static int device_ok(int device, char *why, size_t cap)
{
    if (device == 0)
        return EPIPE_OK;
    snprintf(why, cap, "CUDA device %d does not exist (this machine has 1)", device);
    return EPIPE_EINVAL;
}

static int dev_alloc(int device, size_t bytes, void **p, char *why, size_t cap)
{
    int rc = device_ok(device, why, cap);
    if (rc)
        return rc;
    if ((*p = fakecuda_alloc(bytes)))
        return EPIPE_OK;
    snprintf(why, cap, "fakecuda: no memory for %zu bytes", bytes);
    return EPIPE_ENOMEM;
}

static int stream_copy(epipe_codec *c, int device, void *dst, const void *src, size_t bytes)
{
    if (device != 0 || fakecuda_copy(dst, src, bytes))
        return fail(c, EPIPE_EIO, "fakecuda: a staging copy of %zu bytes overruns device memory",
                    bytes);
    pthread_mutex_lock(&lock);
    last_stream = c->stream;
    stream_copies++;
    pthread_mutex_unlock(&lock);
    return EPIPE_OK;
}

/* Pinned host memory is host memory: malloc, counted so a test can see
 * that host staging asks the module for it. */
static unsigned long host_allocs;

static int host_alloc(size_t bytes, void **p, char *why, size_t cap)
{
    if ((*p = malloc(bytes))) {
        __atomic_add_fetch(&host_allocs, 1, __ATOMIC_RELAXED);
        return EPIPE_OK;
    }
    snprintf(why, cap, "fakecuda: no host memory for %zu bytes", bytes);
    return EPIPE_ENOMEM;
}

static void host_free(void *p)
{
    free(p);
}

FAKE_EXPORT unsigned long fakecuda_host_allocs(void)
{
    return __atomic_load_n(&host_allocs, __ATOMIC_RELAXED);
}

static int synchronize(epipe_codec *c)
{
    (void)c;
    return EPIPE_OK;
}

static void release(epipe_codec *c)
{
    (void)c;
}

static const epipe_cuda_module module = {
    .abi = EPIPE_CUDA_ABI,
    .probe = probe,
    .backend = backend,
    .check = check,
    .locate = locate,
    .peek = peek,
    .encode = encode,
    .decode = decode,
    .device_ok = device_ok,
    .alloc = dev_alloc,
    .free = fakecuda_free,
    .stream_copy = stream_copy,
    .host_alloc = host_alloc,
    .host_free = host_free,
    .synchronize = synchronize,
    .release = release,
};

FAKE_EXPORT int epipe_cuda_module_init(const epipe_cuda_core *c, const epipe_cuda_module **out)
{
    if (!c || c->abi != EPIPE_CUDA_ABI || c->codec_size != sizeof(struct epipe_codec))
        return EPIPE_EVERSION;
    core = c;
    *out = &module;
    return EPIPE_OK;
}
