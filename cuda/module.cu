/* The CUDA module's entry point and plumbing: the device probe, per-handle
 * state and scratch, dtype staging on the device and the deferred status. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../codecs/inline/half.h"
#include "cuda_impl.h"
extern "C" {
#include "../lib/codec/payload.h"
}

const epipe_cuda_core *epipe_cuda_core_fns;

int epipe_cuda_fail(epipe_codec *c, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = epipe_cuda_core_fns->vfail(c, status, fmt, ap);
    va_end(ap);
    return rc;
}

int epipe_cuda_check(epipe_codec *c, cudaError_t e, const char *doing)
{
    if (e == cudaSuccess)
        return EPIPE_OK;
    /* The runtime also records every failed call as the thread's last
     * error; reported here, it must not be taken by the next launch's
     * cudaGetLastError() for that launch's own (a sticky error stays). */
    cudaGetLastError();
    return epipe_cuda_fail(c, e == cudaErrorMemoryAllocation ? EPIPE_ENOMEM : EPIPE_EIO,
                           "%s: CUDA error while %s: %s (%s)", c->ops->name, doing,
                           cudaGetErrorName(e), cudaGetErrorString(e));
}

/* ---- probe ---------------------------------------------------------------- */

static int probe_rc = 1; /* 1: not asked yet */
static char probe_why[200];

static int cuda_probe(char *why, size_t cap)
{
    if (probe_rc == 1) {
        int count = 0;
        cudaError_t e = cudaGetDeviceCount(&count);
        if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || e == cudaSuccess) {
            if (e == cudaSuccess && count > 0)
                probe_rc = EPIPE_OK;
            else
                snprintf(probe_why, sizeof probe_why, "%s: %s",
                         e == cudaErrorInsufficientDriver ? "no CUDA driver" : "no CUDA device",
                         e == cudaSuccess ? "the driver reports 0 devices" : cudaGetErrorString(e));
        } else {
            snprintf(probe_why, sizeof probe_why, "no usable CUDA device: %s (%s)",
                     cudaGetErrorString(e), cudaGetErrorName(e));
        }
        if (probe_rc != EPIPE_OK)
            probe_rc = EPIPE_ENOTSUP;
    }
    if (probe_rc != EPIPE_OK)
        snprintf(why, cap, "%s", probe_why);
    return probe_rc;
}

static const epipe_codec_backend *cuda_backend(unsigned id)
{
    switch (id) {
    case EPIPE_CODEC_ID_NONE: return &epipe_cuda_none;
    case EPIPE_CODEC_ID_CAST: return &epipe_cuda_cast;
    case EPIPE_CODEC_ID_QUANT: return &epipe_cuda_quant;
    case EPIPE_CODEC_ID_SORTQUANT: return &epipe_cuda_sortquant;
    case EPIPE_CODEC_ID_TOPK: return &epipe_cuda_topk;
    case EPIPE_CODEC_ID_KMEANS: return &epipe_cuda_kmeans;
    case EPIPE_CODEC_ID_POWERITER: /* the host's part is in the core, with BLAS */
        return epipe_cuda_core_fns->pi_plan && epipe_cuda_blas_available() ? &epipe_cuda_poweriter
                                                                           : NULL;
    case EPIPE_CODEC_ID_INSERT: /* cuDNN for conv, cuBLAS for linear */
        return epipe_cuda_core_fns->ins_plan && epipe_cuda_dnn_available() &&
                       epipe_cuda_blas_available()
                   ? &epipe_cuda_insert
                   : NULL;
    }
    return NULL;
}

/* ---- tensors and handles ----------------------------------------------- */

/* The driver's cuDeviceGet and cuDevicePrimaryCtxGetState, looked up in the
 * libcuda the runtime has loaded (none under the emulator). CUdevice is an
 * int and CUDA_SUCCESS 0. */
static int (*drv_device_get)(int *device, int ordinal);
static int (*drv_context_state)(int device, unsigned *flags, int *active);
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void drv_open(void)
{
    void *so = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!so)
        return;
    drv_device_get = (int (*)(int *, int))dlsym(so, "cuDeviceGet");
    drv_context_state = (int (*)(int, unsigned *, int *))dlsym(so, "cuDevicePrimaryCtxGetState");
}

/* Every entry point that selects a device gives the calling thread its own
 * back on return (the host's kernels and allocations must not move to the
 * tensor's GPU): the device to give back, or -1 for none. A thread that
 * never chose one reads device 0, and selecting 0 "back" would create GPU
 * 0's context (hundreds of MB) in a process that may never use GPU 0 (a
 * torchrun rank on cuda:3): so device 0 is given back only once its
 * context is active, where the driver can say. Any other device was chosen,
 * which made its context; and an active context stays so (remembered, to
 * keep the driver's calls off every encode and decode). */
static int context0_active;

static int caller_device(void)
{
    int d = -1;
    if (cudaGetDevice(&d) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    if (d != 0 || __atomic_load_n(&context0_active, __ATOMIC_RELAXED))
        return d;
    pthread_once(&drv_once, drv_open);
    int dev = 0, active = 0;
    unsigned flags = 0;
    if (!drv_device_get || !drv_context_state || drv_device_get(&dev, 0) != 0 ||
        drv_context_state(dev, &flags, &active) != 0)
        return 0; /* the driver cannot say: give it back, as before */
    if (!active)
        return -1;
    __atomic_store_n(&context0_active, 1, __ATOMIC_RELAXED);
    return 0;
}

static void restore_device(int device)
{
    if (device >= 0)
        cudaSetDevice(device);
}

/* The work goes on the handle's stream, which belongs to one device (the
 * default streams serve every device): a kernel launched there for another
 * device's tensor fails, or worse. EPIPE_EINVAL naming both, or a handle
 * that is not a stream; another CUDA error (a sticky one) as any. Where
 * the runtime cannot tell (built before CUDA 12.8, or a driver that old),
 * nothing is checked. */
static int stream_on(epipe_codec *c, int device, const char *what)
{
    cudaStream_t s = epipe_cuda_stream(c);
    if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread)
        return EPIPE_OK;
#if CUDART_VERSION >= 12080
    int sd = -1;
    cudaError_t e = cudaStreamGetDevice(s, &sd);
    if (e == cudaErrorCallRequiresNewerDriver || e == cudaErrorNotSupported) {
        cudaGetLastError();
        return EPIPE_OK;
    }
    if (e == cudaErrorInvalidResourceHandle || e == cudaErrorInvalidValue ||
        e == cudaErrorContextIsDestroyed) {
        cudaGetLastError();
        return epipe_cuda_fail(c, EPIPE_EINVAL,
                               "%s: the handle's stream (epipe_codec_set_stream) %p is not a CUDA "
                               "stream: %s",
                               c->ops->name, (void *)s, cudaGetErrorString(e));
    }
    int rc = epipe_cuda_check(c, e, "asking the device of the handle's stream");
    if (!rc && sd != device)
        rc = epipe_cuda_fail(c, EPIPE_EINVAL,
                             "%s: %s is on CUDA device %d, but the handle's stream "
                             "(epipe_codec_set_stream) is on device %d",
                             c->ops->name, what, device, sd);
    return rc;
#else
    (void)c;
    (void)device;
    (void)what;
    return EPIPE_OK;
#endif
}

static int cuda_check(epipe_codec *c, const DLTensor *t, const char *what, int *device)
{
    const char *name = c->ops->name;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || t->device.device_id < 0 ||
        t->device.device_id >= count)
        return epipe_cuda_fail(c, EPIPE_EINVAL, "%s: %s is on CUDA device %d; this machine has %d",
                               name, what, (int)t->device.device_id, count);
    if (t->strides) {
        int64_t want = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != want)
                return epipe_cuda_fail(c, EPIPE_EINVAL,
                                       "%s: %s is a CUDA tensor with strides; CUDA tensors must be "
                                       "dense (compact row-major)",
                                       name, what);
            want *= t->shape[d];
        }
    }
    size_t esize = t->dtype.bits / 8;
    uintptr_t p = (uintptr_t)t->data + (uintptr_t)t->byte_offset;
    if (p % esize)
        return epipe_cuda_fail(
            c, EPIPE_EINVAL, "%s: %s's data (offset %llu) is not aligned to its %zu-byte elements",
            name, what, (unsigned long long)t->byte_offset, esize);
    if (t->device.device_type == kDLCUDA) {
        cudaPointerAttributes a;
        cudaError_t e = cudaPointerGetAttributes(&a, (const void *)p);
        if (e != cudaSuccess ||
            (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)) {
            cudaGetLastError(); /* not sticky: clear it */
            return epipe_cuda_fail(c, EPIPE_EINVAL,
                                   "%s: %s says kDLCUDA, but its data %p is not CUDA device memory",
                                   name, what, (void *)p);
        }
        if (a.device != t->device.device_id)
            return epipe_cuda_fail(c, EPIPE_EINVAL,
                                   "%s: %s says CUDA device %d, but its data is on device %d", name,
                                   what, (int)t->device.device_id, a.device);
    }
    int rc = stream_on(c, t->device.device_id, what);
    if (rc)
        return rc;
    *device = t->device.device_id;
    return EPIPE_OK;
}

static int handle_state(epipe_codec *c, int device, epipe_cuda_handle **out)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    int rc;
    if ((rc = epipe_cuda_check(c, cudaSetDevice(device), "selecting the tensor's device")))
        return rc;
    if (!h) {
        h = (epipe_cuda_handle *)calloc(1, sizeof *h);
        if (!h)
            return epipe_cuda_fail(c, EPIPE_ENOMEM, "%s: out of memory", c->ops->name);
        h->device = device;
        cudaError_t e = cudaMalloc((void **)&h->status, sizeof *h->status);
        if (e == cudaSuccess)
            e = cudaHostAlloc((void **)&h->status_host, sizeof *h->status, cudaHostAllocDefault);
        /* On the handle's stream: a non-blocking stream does not wait for
         * work on the legacy default stream. */
        if (e == cudaSuccess)
            e = cudaMemsetAsync(h->status, 0xff, sizeof *h->status, epipe_cuda_stream(c));
        if (e != cudaSuccess) {
            cudaFree(h->status);
            if (h->status_host)
                cudaFreeHost(h->status_host);
            free(h);
            return epipe_cuda_check(c, e, "allocating the status word");
        }
        c->cuda = h;
    }
    *out = h;
    return EPIPE_OK;
}

int epipe_cuda_coop_blocks(const void *kernel, unsigned threads, int device, int cache[64],
                           int **entry)
{
    *entry = NULL;
    if (device < 0 || device >= 64)
        return 0;
    *entry = &cache[device];
    if (cache[device] == 0) {
        int coop = 0, sms = 0, per = 0;
        cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, (int)threads, 0) !=
            cudaSuccess)
            cudaGetLastError(), per = 0;
        cache[device] = coop && sms > 0 && per > 0 ? sms * per : -1;
    }
    return cache[device] > 0 ? cache[device] : 0;
}

int epipe_cuda_coop_launch(epipe_codec *c, const void *kernel, unsigned blocks, unsigned threads,
                           void **args, cudaStream_t s, int *entry, const char *what)
{
    cudaError_t e = cudaLaunchCooperativeKernel(kernel, blocks, threads, args, 0, s);
    if (e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported) {
        cudaGetLastError(); /* not sticky: leave nothing for the next check */
        if (entry)
            *entry = -1;
        return 0;
    }
    int rc = epipe_cuda_check(c, e, what);
    return rc ? rc : 1;
}

int epipe_cuda_grow(epipe_codec *c, epipe_cuda_buf *b, size_t bytes, void **p)
{
    if (b->cap < bytes || !b->p) {
        cudaStream_t s = epipe_cuda_stream(c);
        if (b->p)
            cudaFreeAsync(b->p, s);
        b->p = NULL;
        b->cap = 0;
        size_t want = bytes < 256 ? 256 : bytes;
        int rc = epipe_cuda_check(c, cudaMallocAsync(&b->p, want, s), "allocating device scratch");
        if (rc)
            return rc;
        b->cap = want;
    }
    *p = b->p;
    return EPIPE_OK;
}

int epipe_cuda_host(epipe_codec *c, size_t bytes, void **p)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (h->host_cap < bytes) {
        void *q = realloc(h->host, bytes);
        if (!q)
            return epipe_cuda_fail(c, EPIPE_ENOMEM, "%s: out of host memory", c->ops->name);
        h->host = q;
        h->host_cap = bytes;
    }
    *p = h->host;
    return EPIPE_OK;
}

/* ---- the body: host payload, or device payload and its host mirror -------- */

int epipe_cuda_body_out(epipe_codec *c, size_t off, size_t bytes, void **d)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (h->dev_body) {
        *d = h->dev_body + off;
        return EPIPE_OK;
    }
    return epipe_cuda_grow(c, &h->body, bytes, d);
}

int epipe_cuda_body_flush(epipe_codec *c, uint8_t *body, size_t off, const void *d, size_t bytes)
{
    if (epipe_cuda_h(c)->dev_body || !bytes)
        return EPIPE_OK; /* written in place */
    return epipe_cuda_check(
        c, cudaMemcpyAsync(body + off, d, bytes, cudaMemcpyDeviceToHost, epipe_cuda_stream(c)),
        "copying the body to the host");
}

int epipe_cuda_body_in(epipe_codec *c, const uint8_t *body, size_t off, size_t bytes,
                       const void **d)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (h->dev_body) {
        *d = h->dev_body + off;
        return EPIPE_OK;
    }
    void *p = NULL;
    int rc = epipe_cuda_grow(c, &h->body, bytes, &p);
    if (rc || !bytes)
        return *d = p, rc;
    *d = p;
    return epipe_cuda_check(
        c, cudaMemcpyAsync(p, body + off, bytes, cudaMemcpyHostToDevice, epipe_cuda_stream(c)),
        "copying the body to the device");
}

int epipe_cuda_body_push(epipe_codec *c, const uint8_t *body, size_t off, size_t bytes)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h->dev_body || !bytes)
        return EPIPE_OK;
    /* From pageable memory: the copy has read the mirror when it returns. */
    return epipe_cuda_check(c,
                            cudaMemcpyAsync(h->dev_body + off, body + off, bytes,
                                            cudaMemcpyHostToDevice, epipe_cuda_stream(c)),
                            "copying the host's part of the body to the device");
}

/* A host image of a body of `len` bytes. Plain malloc, never cleared: the
 * pages the backends do not touch are never made resident. */
static int mirror_get(epipe_codec *c, size_t len, uint8_t **out)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (h->mirror_cap < len || !h->mirror) {
        free(h->mirror);
        h->mirror_cap = 0;
        if (!(h->mirror = (uint8_t *)malloc(len ? len : 1)))
            return epipe_cuda_fail(c, EPIPE_ENOMEM, "%s: out of host memory", c->ops->name);
        h->mirror_cap = len;
    }
    *out = h->mirror;
    return EPIPE_OK;
}

static int pinned_get(epipe_codec *c, size_t bytes, uint8_t **out)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (h->pinned_cap < bytes) {
        if (h->pinned)
            cudaFreeHost(h->pinned);
        h->pinned = NULL;
        h->pinned_cap = 0;
        int rc = epipe_cuda_check(c,
                                  cudaHostAlloc((void **)&h->pinned, bytes, cudaHostAllocDefault),
                                  "allocating pinned staging");
        if (rc)
            return rc;
        h->pinned_cap = bytes;
    }
    *out = h->pinned;
    return EPIPE_OK;
}

/* The bytes of a body that the host reads while decoding: everything but
 * the codes (the tables, a fit word), and the end from the last code byte
 * on (its padding bits, the padding after the codes). `none` and `cast`
 * read nothing. */
static void host_read_span(const epipe_codec *c, uint64_t n, size_t len, size_t *head, size_t *tail)
{
    *head = *tail = 0;
    if (c->ops->id == EPIPE_CODEC_ID_POWERITER) { /* its header: the kernel checks the rest */
        *head = len < EPIPE_CUDA_PI_HEADER ? len : EPIPE_CUDA_PI_HEADER;
        return;
    }
    unsigned bits = 0;
    if (c->ops->id == EPIPE_CODEC_ID_QUANT || c->ops->id == EPIPE_CODEC_ID_SORTQUANT ||
        c->ops->id == EPIPE_CODEC_ID_KMEANS)
        bits = (unsigned)c->p[0]; /* bits is the first parameter of all three */
    if (!bits)
        return;
    uint64_t cb = (n * bits + 7) / 8;
    size_t meta = cb <= len ? len - (size_t)cb : len;
    *head = meta;
    *tail = meta + 1 < len ? meta + 1 : len;
}

static int locate(const void *p, int *device)
{
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* not sticky: clear it */
        return 0;
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) {
        *device = a.device;
        return 1;
    }
    return 0;
}

/* Where the bytes the host reads of a device payload (len bytes, n values)
 * are: quant rows=1's layout (`rows` rows `rsize` apart: each one's
 * 8-byte table and last code byte), or (rows 0) one head and one tail
 * span of the body (host_read_span). */
struct host_spans {
    uint64_t rows, rsize;
    size_t head, tail;
};

static void spans_of(epipe_codec *c, size_t len, uint64_t n, host_spans *sp)
{
    uint64_t rows = 1, rlen = n;
    if (c->ops->id == EPIPE_CODEC_ID_QUANT)
        epipe_codec_ranges(c, n, c->p[QUANT_ROWS] != 0, (uint64_t)c->p[QUANT_GROUP], &rows, &rlen);
    uint64_t rsize = 8 + (rlen * (uint64_t)c->p[QUANT_BITS] + 7) / 8;
    size_t blen = len - EPIPE_PAYLOAD_HEADER;
    *sp = host_spans{0, 0, 0, 0};
    /* a body of another length is refused by the core after a peek: read
     * it as one range, which stays inside it */
    if (rows > 1 && rows * rsize == blen)
        sp->rows = rows, sp->rsize = rsize;
    else
        host_read_span(c, n, blen, &sp->head, &sp->tail);
}

/* The pinned bytes the spans take, header first. */
static size_t spans_bytes(const host_spans *sp)
{
    return EPIPE_PAYLOAD_HEADER + (sp->rows ? 9 * sp->rows : sp->head + sp->tail);
}

/* Queues the copies of the header and the spans of a device payload into
 * pin (spans_bytes), on the handle's stream. */
static int copy_spans(epipe_codec *c, const uint8_t *payload, size_t len, const host_spans *sp,
                      uint8_t *pin)
{
    cudaStream_t s = epipe_cuda_stream(c);
    const size_t H = EPIPE_PAYLOAD_HEADER, blen = len - H;
    const uint8_t *body = payload + H;
    int rc;
    if (sp->rows) {
        uint64_t rows = sp->rows, size = sp->rsize;
        if ((rc = epipe_cuda_check(c, cudaMemcpyAsync(pin, payload, H, cudaMemcpyDeviceToHost, s),
                                   "reading the payload's header")) ||
            (rc = epipe_cuda_check(
                 c, cudaMemcpy2DAsync(pin + H, 8, body, size, 8, rows, cudaMemcpyDeviceToHost, s),
                 "reading the payload's row tables")))
            return rc;
        return epipe_cuda_check(c,
                                cudaMemcpy2DAsync(pin + H + 8 * rows, 1, body + size - 1, size, 1,
                                                  rows, cudaMemcpyDeviceToHost, s),
                                "reading the rows' last code bytes");
    }
    if ((rc = epipe_cuda_check(
             c, cudaMemcpyAsync(pin, payload, H + sp->head, cudaMemcpyDeviceToHost, s),
             "reading the payload's header and tables")))
        return rc;
    if (!sp->tail)
        return EPIPE_OK;
    return epipe_cuda_check(c,
                            cudaMemcpyAsync(pin + H + sp->head, body + blen - sp->tail, sp->tail,
                                            cudaMemcpyDeviceToHost, s),
                            "reading the payload's end");
}

/* Once the copies have landed: the header into hdr, the spans into the
 * mirror at their places. */
static int land_spans(epipe_codec *c, const uint8_t *pin, size_t len, const host_spans *sp,
                      void *hdr)
{
    const size_t H = EPIPE_PAYLOAD_HEADER, blen = len - H;
    uint8_t *m = NULL;
    int rc = mirror_get(c, blen, &m);
    if (rc)
        return rc;
    memcpy(hdr, pin, H);
    if (sp->rows) {
        for (uint64_t r = 0; r < sp->rows; r++) {
            memcpy(m + r * sp->rsize, pin + H + 8 * r, 8);
            m[r * sp->rsize + sp->rsize - 1] = pin[H + 8 * sp->rows + r];
        }
    } else {
        memcpy(m, pin + H, sp->head);
        memcpy(m + blen - sp->tail, pin + H + sp->head, sp->tail);
    }
    return EPIPE_OK;
}

/* The header and the body's host-read bytes of a device payload into
 * the mirror, through pinned staging, in one wait. */
static int fetch_host_bytes(epipe_codec *c, const uint8_t *payload, size_t len, uint64_t n,
                            void *hdr)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    host_spans sp;
    spans_of(c, len, n, &sp);
    uint8_t *pin = NULL;
    int rc;
    if ((rc = pinned_get(c, spans_bytes(&sp), &pin)) ||
        (rc = copy_spans(c, payload, len, &sp, pin)) ||
        (rc = epipe_cuda_check(c, cudaStreamSynchronize(epipe_cuda_stream(c)),
                               "reading the payload's header")) ||
        (rc = land_spans(c, pin, len, &sp, hdr)))
        return rc;
    h->peeked = payload;
    h->peeked_len = len;
    return EPIPE_OK;
}

/* ---- deferred checks -------------------------------------------------------
 *
 * Reading a device payload's header and tables before the decode kernels
 * launch costs a wait on the stream each decode (about a third of a
 * decode of 12.8M values on an H200). The codecs whose decode kernels
 * read all they use from the device, and whose launches follow from the
 * codec and the value count alone (none, cast, topk, quant, poweriter,
 * insert, sortquant's sample and exact modes) launch at once instead; the header and the
 * bytes the host checks are copied on the stream into pinned memory, and
 * checked, with the CPU's statuses and messages, by the next synchronize,
 * whose status the first failure becomes (the tensor of such a decode is
 * garbage, as with the errors the kernels find). The kernels keep inside
 * the payload whatever its bytes say: its length is checked at once. Up to
 * PENDING_MAX decodes wait for their checks; one more, or one whose bytes
 * do not fit the pinned arena, first waits for the stream and runs the
 * checks of those before it, holding a failure for synchronize. */

#define PENDING_MAX 16
#define CHECKS_MIN ((size_t)64 << 10)

struct epipe_cuda_pending {
    size_t len, at; /* the payload's length; its bytes' place in h->checks */
    uint64_t n;
    unsigned long long seq; /* the decode's place among the handle's calls */
    host_spans sp;
    /* the decode's tensor shape (c->shape, which quant's rows and groups
     * follow, and which later calls overwrite) */
    int ndim;
    int64_t shape[EPIPE_CODEC_MAX_NDIM];
};
static_assert(sizeof(epipe_cuda_pending::shape) == sizeof(epipe_codec::shape),
              "a pending check keeps the whole of c->shape");

static int deferrable(const epipe_codec *c)
{
    switch (c->ops->id) {
    case EPIPE_CODEC_ID_NONE:
    case EPIPE_CODEC_ID_CAST:
    case EPIPE_CODEC_ID_QUANT:
    case EPIPE_CODEC_ID_TOPK:
    /* poweriter's launch follows its plan, from c and n alone */
    case EPIPE_CODEC_ID_POWERITER: return 1;
    /* insert keeps a micro-batch's code for its backward: a payload the
     * CPU refuses must keep none (nor replace one kept), so only
     * forward-only decodes defer */
    case EPIPE_CODEC_ID_INSERT: return c->microbatch < 0;
    case EPIPE_CODEC_ID_SORTQUANT: return epipe_cuda_sq_defers(c);
    default: return 0;
    }
}

static int body_check(epipe_codec *c, const uint8_t *body, uint64_t n)
{
    switch (c->ops->id) {
    case EPIPE_CODEC_ID_QUANT: return epipe_cuda_quant_check(c, body, (size_t)n);
    case EPIPE_CODEC_ID_SORTQUANT: return epipe_cuda_sq_check(c, body, (size_t)n);
    case EPIPE_CODEC_ID_POWERITER: /* NULL without BLAS, where the CPU backend stages it */
        return epipe_cuda_core_fns->pi_check_header
                   ? epipe_cuda_core_fns->pi_check_header(c, body, n)
                   : EPIPE_OK;
    default: return EPIPE_OK;
    }
}

/* The checks of the decodes waiting for theirs, in order, once the stream
 * has passed their copies: the first failure (its message on c, its
 * decode's seq in *seq), or EPIPE_OK. None waits after. */
static int run_checks(epipe_codec *c, unsigned long long *seq)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    int first = EPIPE_OK;
    int ndim = c->ndim;
    int64_t shape[EPIPE_CODEC_MAX_NDIM];
    memcpy(shape, c->shape, sizeof shape);
    for (unsigned i = 0; i < h->npending && !first; i++) {
        const epipe_cuda_pending *p = &h->pending[i];
        uint8_t hdr[EPIPE_PAYLOAD_HEADER];
        size_t need = 0;
        c->ndim = p->ndim; /* the checks read the shape of their own decode */
        memcpy(c->shape, p->shape, sizeof shape);
        first = land_spans(c, h->checks + p->at, p->len, &p->sp, hdr);
        if (!first)
            first = epipe_cuda_core_fns->check_header(c, hdr, p->len, p->n, &need);
        if (!first && need != p->len) /* the core checked it: only a bug gets here */
            first = epipe_cuda_fail(c, EPIPE_EINTERNAL,
                                    "%s: a deferred check found %zu bytes where %zu were decoded",
                                    c->ops->name, need, p->len);
        if (!first)
            first = body_check(c, h->mirror, p->n);
        if (first)
            *seq = p->seq;
    }
    c->ndim = ndim;
    memcpy(c->shape, shape, sizeof shape);
    h->npending = 0;
    h->checks_used = 0;
    return first;
}

/* After a wait: runs the checks still waiting; a failure is held for
 * synchronize (the first one held stays), and what decode kernels noted
 * in the status word (its bad entry) goes with it, so that no later call
 * reports that as its own (an ef=1 encode reads the word mid-call); what
 * encodes noted stays for synchronize. */
static int run_and_hold(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    unsigned long long seq = 0;
    int rc = run_checks(c, &seq);
    if (!rc)
        return EPIPE_OK;
    if (!h->held_rc) {
        h->held_rc = rc;
        h->held_seq = seq;
        snprintf(h->held_msg, sizeof h->held_msg, "%s", c->msg);
    }
    return epipe_cuda_check(
        c, cudaMemsetAsync(&h->status->bad, 0xff, sizeof h->status->bad, epipe_cuda_stream(c)),
        "clearing the status word");
}

/* Before a call that reads the status word or adds its own errors to it
 * (an encode, a backward): the decodes still waiting for their checks
 * are checked now, after a wait (run_and_hold): the call's own errors are
 * its own. */
static int settle_checks(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h || !h->npending)
        return EPIPE_OK;
    int rc = epipe_cuda_check(c, cudaStreamSynchronize(epipe_cuda_stream(c)),
                              "waiting for the payloads' checks");
    return rc ? rc : run_and_hold(c);
}

/* Room for `bytes` more: past the bounds, the stream is waited for and
 * the checks run (a failure held for synchronize); the arena grows. */
static int checks_room(epipe_codec *c, size_t bytes)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    int rc;
    if (!h->pending &&
        !(h->pending = (epipe_cuda_pending *)calloc(PENDING_MAX, sizeof *h->pending)))
        return epipe_cuda_fail(c, EPIPE_ENOMEM, "%s: out of host memory", c->ops->name);
    if (h->npending < PENDING_MAX && h->checks_used + bytes <= h->checks_cap)
        return EPIPE_OK;
    if ((rc = settle_checks(c)))
        return rc;
    if (bytes > h->checks_cap) {
        if (h->checks)
            cudaFreeHost(h->checks); /* nothing of the stream's uses it now */
        h->checks = NULL;
        h->checks_cap = 0;
        size_t cap = bytes > CHECKS_MIN ? bytes : CHECKS_MIN;
        if ((rc = epipe_cuda_check(c, cudaHostAlloc((void **)&h->checks, cap, cudaHostAllocDefault),
                                   "allocating pinned memory for the payloads' checks")))
            return rc;
        h->checks_cap = cap;
    }
    return EPIPE_OK;
}

/* A decode of a device payload that launches before its checks: the
 * copies of its header and host-read bytes, queued. */
static int defer_checks(epipe_codec *c, const uint8_t *payload, size_t len, uint64_t n)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    host_spans sp;
    spans_of(c, len, n, &sp);
    size_t bytes = spans_bytes(&sp);
    uint8_t *m;
    int rc;
    if ((rc = checks_room(c, bytes)) || (rc = mirror_get(c, len - EPIPE_PAYLOAD_HEADER, &m)) ||
        (rc = copy_spans(c, payload, len, &sp, h->checks + h->checks_used)))
        return rc;
    epipe_cuda_pending *p = &h->pending[h->npending++];
    *p = epipe_cuda_pending{len, h->checks_used, n, ++h->seq, sp, c->ndim, {0}};
    memcpy(p->shape, c->shape, sizeof p->shape);
    h->checks_used += bytes;
    return EPIPE_OK;
}

/* A deferred decode that failed after its checks were queued: they go
 * (the call reported its own error; its copies land unread). */
static void drop_last_check(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (h->npending) {
        epipe_cuda_pending *p = &h->pending[--h->npending];
        h->checks_used = p->at;
    }
}

static int cuda_defers(epipe_codec *c, const void *payload)
{
    int dev;
    if (!deferrable(c) || !locate(payload, &dev))
        return 0;
    if (c->cuda) /* the decode that follows was not peeked */
        epipe_cuda_h(c)->peeked = NULL;
    return 1;
}

static int cuda_peek(epipe_codec *c, const void *payload, size_t len, uint64_t n, void *hdr)
{
    int dev = -1;
    locate(payload, &dev);
    if (dev < 0)
        return epipe_cuda_fail(c, EPIPE_EINVAL, "%s: the payload is not CUDA memory", c->ops->name);
    int prev = caller_device();
    epipe_cuda_handle *h = NULL;
    int rc = handle_state(c, dev, &h);
    if (rc == EPIPE_OK)
        rc = fetch_host_bytes(c, (const uint8_t *)payload, len, n, hdr);
    restore_device(prev);
    return rc;
}

/* Points the handle at the call's payload: device memory on the tensor's
 * device, or host memory. */
static int payload_bind(epipe_codec *c, const DLTensor *t, const uint8_t *payload, size_t len,
                        int *on_device)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    int dev = -1;
    *on_device = locate(payload, &dev);
    h->dev_body = NULL;
    h->body_len = len - EPIPE_PAYLOAD_HEADER;
    if (!*on_device)
        return EPIPE_OK;
    if (dev != t->device.device_id)
        return epipe_cuda_fail(c, EPIPE_EINVAL,
                               "%s: the payload is on CUDA device %d, the tensor on device %d",
                               c->ops->name, dev, (int)t->device.device_id);
    h->dev_body = (uint8_t *)payload + EPIPE_PAYLOAD_HEADER;
    return EPIPE_OK;
}

/* ---- staging ------------------------------------------------------------- */

__global__ void stage_in_kernel(const uint16_t *in, uint64_t n, int bf16, float *out)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        out[i] = bf16 ? epipe_hd_bf16_to_f32(in[i]) : epipe_hd_f16_to_f32(in[i]);
}

/* fp32 to the tensor's 16-bit type as the CPU's staging rounds (no
 * saturation: that is cast's, not the staging's). */
__global__ void stage_out_kernel(const float *in, uint64_t n, int bf16, uint16_t *out)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        out[i] = bf16 ? epipe_hd_f32_to_bf16(in[i]) : epipe_hd_f32_to_f16(in[i]);
}

static void *tensor_ptr(const DLTensor *t)
{
    return (char *)t->data + t->byte_offset;
}

/* t's n values as dense fp32 on the device: t's own, or for a 16-bit t a
 * converted copy in buf. */
static int f32_in(epipe_codec *c, epipe_cuda_buf *buf, const DLTensor *t, uint64_t n,
                  enum epipe_dtype dt, const char *doing, const float **out)
{
    *out = (const float *)tensor_ptr(t);
    if (dt == EPIPE_DTYPE_F32 || !n)
        return EPIPE_OK;
    void *p;
    int rc = epipe_cuda_grow(c, buf, n * sizeof(float), &p);
    if (rc)
        return rc;
    stage_in_kernel<<<epipe_cuda_blocks(n, 256), 256, 0, epipe_cuda_stream(c)>>>(
        (const uint16_t *)*out, n, dt == EPIPE_DTYPE_BF16, (float *)p);
    *out = (const float *)p;
    return epipe_cuda_check(c, cudaGetLastError(), doing);
}

/* Where fp32 results for t go: t itself, or for a 16-bit t buf, which
 * f32_out_done() then converts into t. */
static int f32_out(epipe_codec *c, epipe_cuda_buf *buf, DLTensor *t, uint64_t n,
                   enum epipe_dtype dt, float **out)
{
    *out = (float *)tensor_ptr(t);
    if (dt == EPIPE_DTYPE_F32 || !n)
        return EPIPE_OK;
    void *p;
    int rc = epipe_cuda_grow(c, buf, n * sizeof(float), &p);
    *out = (float *)p;
    return rc;
}

static int f32_out_done(epipe_codec *c, DLTensor *t, uint64_t n, enum epipe_dtype dt,
                        const float *y, const char *doing)
{
    if (dt == EPIPE_DTYPE_F32 || !n)
        return EPIPE_OK;
    stage_out_kernel<<<epipe_cuda_blocks(n, 256), 256, 0, epipe_cuda_stream(c)>>>(
        y, n, dt == EPIPE_DTYPE_BF16, (uint16_t *)tensor_ptr(t));
    return epipe_cuda_check(c, cudaGetLastError(), doing);
}

/* ---- error feedback (ef=1) ------------------------------------------------- */

/* w = x + r; a sum that is not finite goes to the status, as a codec's
 * kernels note an input value. */
__global__ void ef_sum_kernel(const float *x, const float *r, uint64_t n, float *w,
                              epipe_cuda_status *st)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        float v = x[i] + r[i];
        w[i] = v;
        if (!epipe_hd_finite(v))
            epipe_cuda_note_nonfinite(st, v, i);
    }
}

/* r = w - y, y the decoded payload (in r): the residual. */
__global__ void ef_residual_kernel(const float *w, uint64_t n, float *r)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        r[i] = w[i] - r[i];
}

static int cuda_synchronize(epipe_codec *c);

/* What the CPU's ef.c does, on the device and with the same arithmetic
 * (one fp32 add, one subtract), so the payloads stay the CPU's byte for
 * byte: encode x + r, decode the payload with the codec's own kernels,
 * keep x + r - decoded. The decoders check the tables on the host, which
 * the encode kernels wrote on the device, so an ef=1 encode waits for its
 * stream once, in the middle; a value that is not finite is reported
 * there, at once, as on the CPU, and leaves the residual as it was. */
static int ef_encode(epipe_codec *c, const epipe_codec_backend *be, const float *x, uint64_t n,
                     enum epipe_dtype dt, const uint8_t *payload, size_t len, int on_device,
                     uint8_t *body)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    float *r = NULL;
    void *w = NULL;
    int fresh = 0;
    int rc = epipe_cuda_core_fns->ef_slot(c, h->device, n, dt, &r, &fresh);
    if (rc || (rc = epipe_cuda_grow(c, &h->ef_work, (n ? n : 1) * sizeof(float), &w)))
        return rc;
    if (fresh && (rc = epipe_cuda_check(c, cudaMemsetAsync(r, 0, (n ? n : 1) * sizeof(float), s),
                                        "clearing a new residual")))
        return rc;
    if (n) {
        ef_sum_kernel<<<epipe_cuda_blocks(n, 256), 256, 0, s>>>(x, r, n, (float *)w, h->status);
        if ((rc = epipe_cuda_check(c, cudaGetLastError(), "launching the ef sum kernel")))
            return rc;
    }
    if ((rc = be->encode(c, (const float *)w, (size_t)n, body)) || (rc = cuda_synchronize(c)))
        return rc;
    if (on_device) { /* the tables the decoder reads on the host */
        uint8_t hdr[EPIPE_PAYLOAD_HEADER];
        if ((rc = fetch_host_bytes(c, payload, len, n, hdr)))
            return rc;
        h->peeked = NULL;
        body = h->mirror;
    }
    if ((rc = be->decode(c, body, (size_t)n, r))) {
        cudaMemsetAsync(r, 0, (n ? n : 1) * sizeof(float), s);
        return rc;
    }
    if (!n)
        return EPIPE_OK;
    ef_residual_kernel<<<epipe_cuda_blocks(n, 256), 256, 0, s>>>((const float *)w, n, r);
    return epipe_cuda_check(c, cudaGetLastError(), "launching the ef residual kernel");
}

static int encode_on(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src, uint64_t n,
                     enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr, size_t len)
{
    epipe_cuda_handle *h = NULL;
    int on_device, rc = handle_state(c, src->device.device_id, &h);
    if (rc || (rc = settle_checks(c)) || (rc = payload_bind(c, src, payload, len, &on_device)))
        return rc;
    if (!h->enc_seq) /* its notes in the status word come after the decodes before it */
        h->enc_seq = h->seq + 1;
    h->seq++;
    cudaStream_t s = epipe_cuda_stream(c);
    uint8_t *body = payload + EPIPE_PAYLOAD_HEADER;
    if (on_device) {
        /* From pageable memory: hdr has been read when the copy returns. */
        if ((rc = epipe_cuda_check(
                 c, cudaMemcpyAsync(payload, hdr, EPIPE_PAYLOAD_HEADER, cudaMemcpyHostToDevice, s),
                 "writing the payload header")) ||
            (rc = mirror_get(c, len - EPIPE_PAYLOAD_HEADER, &body)))
            return rc;
    } else {
        memcpy(payload, hdr, EPIPE_PAYLOAD_HEADER);
    }
    const float *x;
    if ((rc = f32_in(c, &h->stage, src, n, dt, "staging the input", &x)))
        return rc;
    if (c->ef)
        return ef_encode(c, be, x, n, dt, payload, len, on_device, body);
    return be->encode(c, x, (size_t)n, body);
}

static int decode_on(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload,
                     size_t len, uint64_t n, DLTensor *dst, enum epipe_dtype dt)
{
    epipe_cuda_handle *h = NULL;
    int on_device, rc = handle_state(c, dst->device.device_id, &h);
    if (rc || (rc = payload_bind(c, dst, payload, len, &on_device)))
        return rc;
    const uint8_t *body = payload + EPIPE_PAYLOAD_HEADER;
    int deferred = 0;
    if (on_device) {
        /* What the host checks: in the mirror since the core's peek, or
         * (not peeked: cuda_defers said so) on its way for synchronize. */
        uint8_t hdr[EPIPE_PAYLOAD_HEADER];
        if (h->peeked == payload && h->peeked_len == len)
            ;
        else if (deferrable(c))
            rc = defer_checks(c, payload, len, n), deferred = 1;
        else
            rc = fetch_host_bytes(c, payload, len, n, hdr);
        if (rc)
            return rc;
        h->peeked = NULL;
        body = h->mirror;
    }
    float *y;
    if (!(rc = f32_out(c, &h->stage, dst, n, dt, &y))) {
        h->defer_checks = deferred; /* the backend reads no table on the host */
        rc = be->decode(c, body, (size_t)n, y);
        h->defer_checks = 0;
    }
    if (!rc)
        rc = f32_out_done(c, dst, n, dt, y, "converting the output");
    if (rc && deferred)
        drop_last_check(c);
    return rc;
}

/* The calls select the tensor's device and give the caller's thread its
 * current device back, as a library should. */
static int cuda_encode(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src,
                       uint64_t n, enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr,
                       size_t len)
{
    int prev = caller_device();
    int rc = encode_on(c, be, src, n, dt, payload, hdr, len);
    if (c->cuda)
        epipe_cuda_h(c)->dev_body = NULL;
    restore_device(prev);
    return rc;
}

static int cuda_decode(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload,
                       size_t len, uint64_t n, DLTensor *dst, enum epipe_dtype dt)
{
    int prev = caller_device();
    int rc = decode_on(c, be, payload, len, n, dst, dt);
    if (c->cuda)
        epipe_cuda_h(c)->dev_body = NULL;
    restore_device(prev);
    return rc;
}

/* ---- synchronisation ------------------------------------------------------- */

int epipe_cuda_status_clear(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    return epipe_cuda_check(
        c, cudaMemsetAsync(h->status, 0xff, sizeof *h->status, epipe_cuda_stream(c)),
        "clearing the status word");
}

int epipe_cuda_take_nonfinite(epipe_codec *c, const epipe_cuda_status *st,
                              unsigned long long *index, int *kind)
{
    unsigned long long first = epipe_cuda_first_nonfinite(st);
    if (first == ~0ull)
        return 0;
    *index = first;
    *kind = first == st->nan ? 0 : first == st->pinf ? 1 : 2;
    /* only these: a decode's deferred error (bad) waits for synchronize */
    epipe_cuda_status *dev = epipe_cuda_h(c)->status;
    int rc = epipe_cuda_check(c,
                              cudaMemsetAsync(&dev->nan, 0xff,
                                              sizeof dev->nan + sizeof dev->pinf + sizeof dev->ninf,
                                              epipe_cuda_stream(c)),
                              "clearing the status word");
    return rc ? rc : 1;
}

/* A trainable codec's backward on CUDA tensors: fp32 device views of both
 * (16-bit gradients converted on the device, as encode_on does), the
 * backend's train op, and the result converted back. */
static int backward_on(epipe_codec *c, const epipe_codec_backend *be, int enc, unsigned mb,
                       const DLTensor *gin, uint64_t n_in, enum epipe_dtype dt_in, DLTensor *gout,
                       uint64_t n_out, enum epipe_dtype dt_out)
{
    epipe_cuda_handle *h = NULL;
    const float *a;
    float *b;
    int rc = handle_state(c, gin->device.device_id, &h);
    if (rc || (rc = settle_checks(c)) ||
        (rc = f32_in(c, &h->stage, gin, n_in, dt_in, "staging the gradient", &a)) ||
        (rc = f32_out(c, &h->grad_out, gout, n_out, dt_out, &b)))
        return rc;
    const epipe_codec_train_ops *t = be->train;
    rc = enc ? t->encode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape, gout->ndim)
             : t->decode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape, gout->ndim);
    return rc ? rc : f32_out_done(c, gout, n_out, dt_out, b, "converting the gradient");
}

/* Like encode and decode, it gives the caller's thread its device back. */
static int cuda_backward(epipe_codec *c, const epipe_codec_backend *be, int enc, unsigned mb,
                         const DLTensor *gin, uint64_t n_in, enum epipe_dtype dt_in, DLTensor *gout,
                         uint64_t n_out, enum epipe_dtype dt_out)
{
    int prev = caller_device();
    int rc = backward_on(c, be, enc, mb, gin, n_in, dt_in, gout, n_out, dt_out);
    restore_device(prev);
    return rc;
}

static int synchronize_on(epipe_codec *c, epipe_cuda_handle *h);

static int cuda_synchronize(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h)
        return EPIPE_OK; /* nothing was ever enqueued */
    int prev = caller_device();
    int rc = synchronize_on(c, h);
    restore_device(prev);
    return rc;
}

/* Waits for the handle's stream with the status word copied on it (one
 * wait for both): *st the word as the stream left it, cleared on the
 * device when it holds anything. A CUDA error as a status. */
static int wait_status(epipe_codec *c, epipe_cuda_handle *h, epipe_cuda_status *st)
{
    memset(st, 0xff, sizeof *st);
    int rc = epipe_cuda_check(c, cudaSetDevice(h->device), "selecting the handle's device");
    /* The status word rides on the stream: one wait for both. */
    if (!rc)
        rc = epipe_cuda_check(c,
                              cudaMemcpyAsync(h->status_host, h->status, sizeof *h->status,
                                              cudaMemcpyDeviceToHost, epipe_cuda_stream(c)),
                              "reading the status word");
    if (rc) {
        /* Still wait: the caller frees buffers the stream's copies use
         * once this returns (a stream names its device itself). */
        cudaStreamSynchronize(epipe_cuda_stream(c));
        cudaGetLastError();
        return rc;
    }
    if ((rc = epipe_cuda_check(c, cudaStreamSynchronize(epipe_cuda_stream(c)),
                               "waiting for the handle's stream")))
        return rc;
    *st = *h->status_host;
    h->enc_seq = 0; /* what the encodes noted is read */
    if (epipe_cuda_first_nonfinite(st) == ~0ull && st->bad == ~0ull && st->code == ~0ull)
        return EPIPE_OK;
    return epipe_cuda_status_clear(c);
}

/* The error a status word read holds, with its message headed by `name`,
 * or EPIPE_OK; the decode kernels' notes (bad) left out with drop_bad:
 * those of a payload the deferred checks refuse, which the CPU would
 * never have decoded. */
static int status_error_as(epipe_codec *c, const epipe_cuda_status *s, int drop_bad,
                           const char *name)
{
    epipe_cuda_status st = *s;
    if (drop_bad)
        st.bad = ~0ull;
    unsigned long long first = epipe_cuda_first_nonfinite(&st);
    if (first == ~0ull && st.bad == ~0ull && st.code == ~0ull)
        return EPIPE_OK;
    if (st.bad != ~0ull) {
        unsigned kind = (unsigned)(st.bad & 3u);
        return epipe_cuda_fail(c, EPIPE_EPROTO, "%s: payload entry %llu %s", name, st.bad >> 2,
                               kind == EPIPE_CUDA_BAD_RANGE   ? "has an index out of range"
                               : kind == EPIPE_CUDA_BAD_ORDER ? "breaks the ascending index order"
                               : kind == EPIPE_CUDA_BAD_VALUE ? "has a value that is not finite"
                                                              : "is not finite or is outside its "
                                                                "range");
    }
    if (first == ~0ull) /* insert: every input value is finite, a code is not */
        return epipe_cuda_fail(c, EPIPE_EINVAL,
                               (st.code & EPIPE_CUDA_CODE_FP16)
                                   ? "%s: code value %llu does not fit fp16 (code=fp16)"
                                   : "%s: code value %llu overflows fp32 (the input is too large)",
                               name, st.code & ~EPIPE_CUDA_CODE_FP16);
    return epipe_cuda_fail(c, EPIPE_EINVAL,
                           "%s: input value at index %llu is %s; the codec needs finite values",
                           name, first,
                           first == st.nan    ? "NaN"
                           : first == st.pinf ? "+inf"
                                              : "-inf");
}

/* ... headed by c's codec: a status word of c's own */
static int status_error(epipe_codec *c, const epipe_cuda_status *s, int drop_bad)
{
    return status_error_as(c, s, drop_bad, c->ops->name);
}

static int synchronize_on(epipe_codec *c, epipe_cuda_handle *h)
{
    epipe_cuda_status st;
    int rc = wait_status(c, h, &st);
    return rc ? rc : status_error(c, &st, 0);
}

/* The public synchronize: the stream and its status word, then the
 * checks of the decodes that deferred theirs. Of a failure held by an
 * earlier wait, a check failing now and an error an encode noted in the
 * status word, the one of the earliest call is returned and the next one
 * held for the next synchronize (a third, rarer still, is dropped, as the
 * status word keeps one error of each kind); a refused payload's decode
 * notes (bad entries) are dropped, as the CPU would never have decoded
 * it. A CUDA error drops the checks (their bytes may not have landed) and
 * comes first; a failure held stays. */
static int cuda_synchronize_checked(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h)
        return EPIPE_OK;
    int prev = caller_device();
    unsigned long long enc_seq = h->enc_seq, seq = 0;
    epipe_cuda_status st;
    int rc = wait_status(c, h, &st);
    if (rc) { /* its message is on c */
        h->npending = 0, h->checks_used = 0;
        restore_device(prev);
        return rc;
    }
    struct {
        int rc;
        unsigned long long seq;
        char msg[sizeof h->held_msg];
    } err[3];
    int n = 0;
    if (h->held_rc) {
        err[n].rc = h->held_rc, err[n].seq = h->held_seq;
        snprintf(err[n++].msg, sizeof err[0].msg, "%s", h->held_msg);
        h->held_rc = 0;
    }
    int refused = h->npending && (rc = run_checks(c, &seq));
    if (refused) {
        err[n].rc = rc, err[n].seq = seq;
        snprintf(err[n++].msg, sizeof err[0].msg, "%s", c->msg);
    }
    /* the bad entry of a failure held was cleared when it was found */
    if ((rc = status_error(c, &st, refused))) {
        err[n].rc = rc, err[n].seq = enc_seq ? enc_seq : ~0ull; /* a decode's: after checks */
        snprintf(err[n++].msg, sizeof err[0].msg, "%s", c->msg);
    }
    restore_device(prev);
    if (!n)
        return EPIPE_OK;
    int a = 0, b = -1; /* the earliest, and the next */
    for (int i = 1; i < n; i++)
        if (err[i].seq < err[a].seq)
            a = i;
    for (int i = 0; i < n; i++)
        if (i != a && (b < 0 || err[i].seq < err[b].seq))
            b = i;
    if (b >= 0) {
        h->held_rc = err[b].rc, h->held_seq = err[b].seq;
        snprintf(h->held_msg, sizeof h->held_msg, "%s", err[b].msg);
    }
    return epipe_cuda_fail(c, err[a].rc, "%s", err[a].msg);
}

static void cuda_release(epipe_codec *c)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!h)
        return;
    /* cudaFree waits for the device, so work still queued on the handle's
     * stream finishes before its scratch goes. */
    int prev = caller_device();
    cudaSetDevice(h->device);
    cudaFree(h->status);
    cudaFree(h->stage.p);
    cudaFree(h->body.p);
    for (int i = 0; i < 3; i++)
        cudaFree(h->work[i].p);
    cudaFree(h->ef_work.p);
    cudaFree(h->grad_out.p);
    cudaFree(h->pi_stats.p);
    for (int i = 0; h->pi_slots && i < EPIPE_CUDA_PI_SLOTS; i++)
        cudaFree(h->pi_slots[i].p);
    free(h->pi_slots);
    epipe_cuda_blas_release(h);
    epipe_cuda_dnn_release(h);
    free(h->host);
    free(h->mirror);
    if (h->pinned)
        cudaFreeHost(h->pinned);
    if (h->checks)
        cudaFreeHost(h->checks);
    free(h->pending);
    cudaFreeHost(h->status_host);
    free(h);
    c->cuda = NULL;
    restore_device(prev);
}

/* ---- device memory for the stage runtime ------------------------------------ */

static int device_ok(int device, char *why, size_t cap)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || device < 0 || device >= count) {
        snprintf(why, cap, "CUDA device %d does not exist (this machine has %d)", device,
                 e == cudaSuccess ? count : 0);
        return EPIPE_EINVAL;
    }
    return EPIPE_OK;
}

static int dev_alloc(int device, size_t bytes, void **p, char *why, size_t cap)
{
    int rc = device_ok(device, why, cap);
    if (rc)
        return rc;
    int prev = caller_device();
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaMalloc(p, bytes ? bytes : 1);
    restore_device(prev);
    if (e == cudaSuccess)
        return EPIPE_OK;
    cudaGetLastError();
    snprintf(why, cap, "allocating %zu bytes on CUDA device %d: %s", bytes, device,
             cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? EPIPE_ENOMEM : EPIPE_EIO;
}

/* release(p) on `device`, selected before any other call: on a thread with
 * none selected, any call that needs a context (asking where p lives, too)
 * would create GPU 0's. The caller's device is given back. */
static void free_on(int device, void *p, cudaError_t (*release)(void *))
{
    int prev = caller_device();
    cudaSetDevice(device);
    cudaGetLastError();
    release(p);
    restore_device(prev);
}

static void dev_free(int device, void *p)
{
    free_on(device, p, cudaFree);
}

/* A copy with `device` selected, on stream s after its work, waited for:
 * the call returns with the copy complete. */
static int copy_waited(epipe_codec *c, int device, cudaStream_t s, void *dst, const void *src,
                       size_t bytes, const char *doing, const char *waiting)
{
    int prev = caller_device();
    int rc = epipe_cuda_check(c, cudaSetDevice(device), "selecting the device of a copy");
    if (!rc)
        rc = epipe_cuda_check(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), doing);
    if (!rc)
        rc = epipe_cuda_check(c, cudaStreamSynchronize(s), waiting);
    restore_device(prev);
    return rc;
}

/* Host staging's copies and the stage's hand-overs: on the handle's
 * stream. */
static int stream_copy(epipe_codec *c, int device, void *dst, const void *src, size_t bytes)
{
    int rc = stream_on(c, device, "the tensor to copy");
    return rc ? rc
              : copy_waited(c, device, epipe_cuda_stream(c), dst, src, bytes,
                            "copying a tensor between host and device for the CPU backend",
                            "waiting for the handle's stream");
}

/* Peer access between two devices' memory, tried once a pair (to, from)
 * of devices under PEER_DEVICES_MAX: set under peers_lock once tried. */
enum { PEER_DEVICES_MAX = 64 };
static unsigned char peers_tried[PEER_DEVICES_MAX][PEER_DEVICES_MAX];
static pthread_mutex_t peers_lock = PTHREAD_MUTEX_INITIALIZER;

/* `device`'s access to src_device's memory enabled where the GPUs allow
 * it, as PyTorch does for its own copies between devices, so that a copy
 * from there is a DMA between the two (NVLink or PCIe); without it the
 * driver stages such a copy through host memory. Once a pair; it stays
 * enabled. A refusal (too many peers, or the host enabled it already)
 * leaves the copy as it was, and no error behind. */
static void enable_peer_access(int device, int src_device)
{
    if (device < 0 || src_device < 0 || device >= PEER_DEVICES_MAX ||
        src_device >= PEER_DEVICES_MAX || device == src_device)
        return;
    pthread_mutex_lock(&peers_lock);
    int tried = peers_tried[device][src_device];
    peers_tried[device][src_device] = 1;
    pthread_mutex_unlock(&peers_lock);
    if (tried)
        return;
    int prev = caller_device(), can = 0;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaDeviceCanAccessPeer(&can, device, src_device) != cudaSuccess ||
        (can && cudaDeviceEnablePeerAccess(src_device, 0) != cudaSuccess))
        cudaGetLastError(); /* the failure just made, not the next call's */
    restore_device(prev);
}

static int payload_copy(epipe_codec *c, int device, void *dst, int src_device, const void *src,
                        size_t bytes)
{
    const char *doing = "copying a received payload out of its sender's device",
               *waiting = "waiting for a received payload's copy";
    if (device < 0) /* to the host: on the payload's device's default stream */
        return copy_waited(c, src_device, (cudaStream_t)0, dst, src, bytes, doing, waiting);
    int rc = stream_on(c, device, "the tensor the payload is for");
    if (rc)
        return rc;
    enable_peer_access(device, src_device);
    return copy_waited(c, device, epipe_cuda_stream(c), dst, src, bytes, doing, waiting);
}

/* Fences (cuda_api.h): an event without timing, recorded on the sender's
 * stream and waited for by the receiver's, so that a payload written on
 * one stage's stream is read on another's with no wait on the host; and,
 * copied on the same stream before the event, the sender's verdicts in
 * pinned memory: seen[0] its handle's status word as the encode left it,
 * seen[1] its stage's taint (what it was passed, below). Fences are kept
 * for reuse per device once freed (their event waited for): pinning and
 * creating events for every send would cost more than the wait they save.
 * The idle ones are never freed, but there are never more than were out
 * at once: one rides each device message, and a sender has at most 32. */
struct fence_rec {
    cudaEvent_t ev;
    /* recorded on a receiver's stream after its copy out of seen (read
     * set), which fence_free waits for before the fence is reused */
    cudaEvent_t read_ev;
    epipe_cuda_status *seen; /* pinned, [2] */
    const char *name;        /* the sender's codec */
    int device;
    int waited;      /* fence_status waited for it: fence_free need not */
    int read;        /* a receiver's copy out of seen was queued */
    fence_rec *next; /* idle ones */
};
static pthread_mutex_t fences_lock = PTHREAD_MUTEX_INITIALIZER;
static fence_rec *fences_idle;

/* A stage's taint, in device memory: [0] the worst verdict its fences
 * brought (none: every word all ones), which its own fences pass on, so
 * that a refused encode fails every later stage's step, not only the
 * next; [1] and [2] where a fence's two words land before they are merged
 * into it, in the receiver's stream order. */
enum { TAINT_WORDS = 3 };

__global__ void taint_merge_kernel(epipe_cuda_status *t)
{
    for (int k = 1; k < TAINT_WORDS; k++) {
        t[0].nan = t[k].nan < t[0].nan ? t[k].nan : t[0].nan;
        t[0].pinf = t[k].pinf < t[0].pinf ? t[k].pinf : t[0].pinf;
        t[0].ninf = t[k].ninf < t[0].ninf ? t[k].ninf : t[0].ninf;
        t[0].code = t[k].code < t[0].code ? t[k].code : t[0].code;
    }
}

/* An idle fence of `device` (the current device), or a new one. */
static int fence_get(epipe_codec *c, int device, fence_rec **out)
{
    pthread_mutex_lock(&fences_lock);
    fence_rec **p = &fences_idle;
    while (*p && (*p)->device != device)
        p = &(*p)->next;
    fence_rec *f = *p;
    if (f)
        *p = f->next;
    pthread_mutex_unlock(&fences_lock);
    if ((*out = f))
        return EPIPE_OK;
    if (!(f = (fence_rec *)calloc(1, sizeof *f)))
        return epipe_cuda_fail(c, EPIPE_ENOMEM, "%s: no memory for a payload's fence",
                               c->ops->name);
    f->device = device;
    int rc = epipe_cuda_check(c, cudaEventCreateWithFlags(&f->ev, cudaEventDisableTiming),
                              "creating a payload's fence");
    if (!rc &&
        (rc = epipe_cuda_check(c, cudaEventCreateWithFlags(&f->read_ev, cudaEventDisableTiming),
                               "creating a payload's fence")))
        cudaEventDestroy(f->ev);
    if (!rc && (rc = epipe_cuda_check(
                    c, cudaHostAlloc((void **)&f->seen, 2 * sizeof *f->seen, cudaHostAllocDefault),
                    "pinning a payload's fence"))) {
        cudaEventDestroy(f->ev);
        cudaEventDestroy(f->read_ev);
    }
    if (rc) {
        free(f);
        return rc;
    }
    *out = f;
    return EPIPE_OK;
}

static void fence_drop(fence_rec *f)
{
    cudaEventDestroy(f->ev);
    cudaEventDestroy(f->read_ev);
    cudaFreeHost(f->seen);
    free(f);
}

static int fence(epipe_codec *c, int device, const void *taint, void **out)
{
    int prev = caller_device();
    fence_rec *f = NULL;
    *out = NULL;
    int rc = epipe_cuda_check(c, cudaSetDevice(device), "selecting the payload's device");
    if (!rc)
        rc = fence_get(c, device, &f);
    epipe_cuda_handle *h = epipe_cuda_h(c);
    if (!rc) /* nothing on the device noted anything, where no copy comes */
        memset(f->seen, 0xff, 2 * sizeof *f->seen);
    if (!rc && h && h->status) /* after the encode, on its stream */
        rc = epipe_cuda_check(c,
                              cudaMemcpyAsync(&f->seen[0], h->status, sizeof *f->seen,
                                              cudaMemcpyDeviceToHost, epipe_cuda_stream(c)),
                              "copying the encode's status for its payload's fence");
    if (!rc && taint)
        rc = epipe_cuda_check(c,
                              cudaMemcpyAsync(&f->seen[1], taint, sizeof *f->seen,
                                              cudaMemcpyDeviceToHost, epipe_cuda_stream(c)),
                              "copying what the stage was passed for its payload's fence");
    if (!rc)
        rc = epipe_cuda_check(c, cudaEventRecord(f->ev, epipe_cuda_stream(c)),
                              "recording a payload's fence");
    if (!rc) {
        f->waited = f->read = 0;
        f->name = c->ops->name;
    }
    if (rc && f) { /* a copy into it may be queued */
        cudaStreamSynchronize(epipe_cuda_stream(c));
        cudaGetLastError();
        fence_drop(f);
    }
    restore_device(prev);
    if (!rc)
        *out = (void *)f;
    return rc;
}

static int fence_wait(epipe_codec *c, int device, void *p, void **taint)
{
    fence_rec *f = (fence_rec *)p;
    int prev = caller_device();
    cudaStream_t s = epipe_cuda_stream(c);
    int rc = epipe_cuda_check(c, cudaSetDevice(device), "selecting the payload's device");
    if (!rc)
        rc = epipe_cuda_check(c, cudaStreamWaitEvent(s, f->ev, 0),
                              "waiting on the device for the payload's encode");
    if (!rc && taint && !*taint) {
        epipe_cuda_status *t = NULL;
        rc = epipe_cuda_check(c, cudaMalloc((void **)&t, TAINT_WORDS * sizeof *t),
                              "allocating the stage's taint");
        if (!rc && (rc = epipe_cuda_check(c, cudaMemsetAsync(t, 0xff, sizeof *t, s),
                                          "clearing the stage's taint")))
            cudaFree(t);
        if (!rc)
            *taint = t;
    }
    if (!rc && taint) {
        epipe_cuda_status *t = (epipe_cuda_status *)*taint;
        rc = epipe_cuda_check(
            c, cudaMemcpyAsync(t + 1, f->seen, 2 * sizeof *t, cudaMemcpyHostToDevice, s),
            "passing the payload's verdict on");
        if (!rc) { /* the fence is not reused before the copy ran */
            f->read = 1;
            rc = epipe_cuda_check(c, cudaEventRecord(f->read_ev, s),
                                  "passing the payload's verdict on");
        }
        if (!rc) {
            taint_merge_kernel<<<1, 1, 0, s>>>(t);
            rc = epipe_cuda_check(c, cudaGetLastError(), "passing the payload's verdict on");
        }
    }
    restore_device(prev);
    return rc;
}

/* The verdicts on the payload (seen[], above): errors noted on the
 * sender's handle since its last synchronize, so a failure of an earlier
 * encode of the same step too, and what the sender's stage was passed. */
static int fence_status(epipe_codec *c, void *p)
{
    fence_rec *f = (fence_rec *)p;
    int prev = caller_device();
    int rc = epipe_cuda_check(c, cudaSetDevice(f->device), "selecting the payload's device");
    if (!rc && !f->waited)
        rc = epipe_cuda_check(c, cudaEventSynchronize(f->ev), "waiting for the payload's encode");
    if (!rc)
        f->waited = 1;
    if (!rc && f->read &&
        !(rc = epipe_cuda_check(c, cudaEventSynchronize(f->read_ev),
                                "waiting for the payload's verdict to pass on")))
        f->read = 0; /* the copy out of seen ran: fence_free need not wait for it */
    restore_device(prev);
    if (rc)
        return rc;
    for (int k = 0; k < 2 && !rc; k++) { /* an encode notes no payload entries (bad) */
        char whose[96];
        snprintf(whose, sizeof whose,
                 k ? "an earlier stage's encode failed" : "its encode (%s) failed",
                 f->name ? f->name : "?");
        rc = status_error_as(c, &f->seen[k], 1, whose);
    }
    return rc;
}

static void fence_free(int device, void *p)
{
    fence_rec *f = (fence_rec *)p;
    cudaError_t e = cudaSuccess;
    if (!f->waited || f->read) {
        int prev = caller_device();
        cudaSetDevice(device);
        if (!f->waited) /* dropped unread: its buffer may be written again next */
            e = cudaEventSynchronize(f->ev);
        if (f->read && e == cudaSuccess) /* and seen, once the receiver's copy ran */
            e = cudaEventSynchronize(f->read_ev);
        cudaGetLastError();
        restore_device(prev);
    }
    if (e != cudaSuccess) {
        fence_drop(f);
        return;
    }
    pthread_mutex_lock(&fences_lock);
    f->next = fences_idle;
    fences_idle = f;
    pthread_mutex_unlock(&fences_lock);
}

/* Marks (cuda_api.h): a plain event, so that a stage can tell without
 * waiting that the decodes reading a held message are done. */
static int mark(epipe_codec *c, int device, void **out)
{
    int prev = caller_device();
    cudaEvent_t ev = (cudaEvent_t)*out;
    int rc = epipe_cuda_check(c, cudaSetDevice(device), "selecting the device of a decode's mark");
    if (!rc && !ev &&
        !(rc = epipe_cuda_check(c, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                                "creating a decode's mark")))
        *out = (void *)ev;
    if (!rc)
        rc = epipe_cuda_check(c, cudaEventRecord(ev, epipe_cuda_stream(c)),
                              "recording a decode's mark");
    restore_device(prev);
    return rc;
}

static int mark_passed(int device, void *p)
{
    int prev = caller_device();
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaEventQuery((cudaEvent_t)p);
    /* not ready (which the runtime does not record as the thread's last
     * error: the host's own stays), or broken: the stage's wait will tell */
    if (e != cudaSuccess && e != cudaErrorNotReady)
        cudaGetLastError();
    restore_device(prev);
    return e == cudaSuccess;
}

static void mark_free(int device, void *p)
{
    free_on(device, p, [](void *ev) { return cudaEventDestroy((cudaEvent_t)ev); });
}

/* Pinned memory through `device`'s context, and freed through the context
 * that made it: a thread with no device selected (a transport's) would
 * otherwise create GPU 0's. */
static int host_alloc(int device, size_t bytes, void **p, char *why, size_t cap)
{
    int prev = caller_device();
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaHostAlloc(p, bytes, cudaHostAllocDefault);
    restore_device(prev);
    if (e == cudaSuccess)
        return EPIPE_OK;
    cudaGetLastError();
    snprintf(why, cap, "allocating %zu bytes of pinned host memory through CUDA device %d: %s",
             bytes, device, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? EPIPE_ENOMEM : EPIPE_EIO;
}

static void host_free(int device, void *p)
{
    free_on(device, p, cudaFreeHost);
}

static const epipe_cuda_module module = {
    .abi = EPIPE_CUDA_ABI,
    .probe = cuda_probe,
    .backend = cuda_backend,
    .check = cuda_check,
    .locate = locate,
    .peek = cuda_peek,
    .defers = cuda_defers,
    .encode = cuda_encode,
    .decode = cuda_decode,
    .device_ok = device_ok,
    .alloc = dev_alloc,
    .free = dev_free,
    .stream_copy = stream_copy,
    .payload_copy = payload_copy,
    .host_alloc = host_alloc,
    .host_free = host_free,
    .backward = cuda_backward,
    .fence = fence,
    .fence_wait = fence_wait,
    .fence_status = fence_status,
    .fence_free = fence_free,
    .mark = mark,
    .mark_passed = mark_passed,
    .mark_free = mark_free,
    .synchronize = cuda_synchronize_checked,
    .release = cuda_release,
};

extern "C" __attribute__((visibility("default"))) int
epipe_cuda_module_init(const epipe_cuda_core *core, const epipe_cuda_module **out)
{
    if (!core || core->abi != EPIPE_CUDA_ABI || core->codec_size != sizeof(struct epipe_codec))
        return EPIPE_EVERSION;
    epipe_cuda_core_fns = core;
    *out = &module;
    return EPIPE_OK;
}
