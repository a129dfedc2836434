/* A CUDA module for tests on machines without a GPU: one "device" whose
 * memory is host pages kept inaccessible (PROT_NONE) except while the
 * module itself copies them, so any host code that reads or writes device
 * memory directly crashes the test, as it would fault on a real GPU. It
 * has no kernels: every codec goes through the core's host staging
 * (lib/codec/cuda_staged.c), which is what it exists to test. Every copy
 * is bounds-checked against the allocation it touches.
 *
 * One exception, off until a test turns it on (fakecuda_insert_kernels):
 * an insert backend whose "kernels" are plain loops on host copies, built
 * on the core's ins_plan as cuda/insert.cu is, so that the core's side of
 * insert on CUDA tensors (the view and parameters it lends, which calls
 * run on the module, the backward's route and checks) runs in CI. Mode 1
 * has no train ops (training is staged through the CPU backend), mode 2
 * has them, as cuda/insert.cu. */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../../codecs/inline/half.h"
#include "codec/cuda_api.h"
#include "codec/payload.h"

#define FAKE_EXPORT __attribute__((visibility("default")))

/* What the tests find with dlsym (test_cuda_staged.c), and the entry point. */
FAKE_EXPORT void *fakecuda_alloc(size_t bytes);
FAKE_EXPORT void fakecuda_free(void *p);
FAKE_EXPORT int fakecuda_copy(void *dst, const void *src, size_t bytes);
FAKE_EXPORT void *fakecuda_last_stream(unsigned long *copies);
FAKE_EXPORT unsigned long fakecuda_host_allocs(void);
FAKE_EXPORT long fakecuda_host_live(void);
FAKE_EXPORT unsigned long fakecuda_dev_allocs(void);
FAKE_EXPORT long fakecuda_dev_live(void);
FAKE_EXPORT void fakecuda_fences(unsigned long *made, unsigned long *waited, long *live);
FAKE_EXPORT void fakecuda_fail_next_fence(int status);
FAKE_EXPORT void fakecuda_no_memory_next_fence(void);
FAKE_EXPORT void fakecuda_marks(unsigned long *recorded, unsigned long *passed, long *live);
FAKE_EXPORT void fakecuda_marks_lag(long lag);
FAKE_EXPORT void fakecuda_fail_mark_at(unsigned long k, int status);
FAKE_EXPORT unsigned long fakecuda_early_frees(void);
FAKE_EXPORT void fakecuda_insert_kernels(int on);
FAKE_EXPORT unsigned long fakecuda_insert_calls(void);
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

/* ---- insert's plain-loop "kernels" ------------------------------------- */

static int insert_on;
static unsigned long insert_calls;

FAKE_EXPORT void fakecuda_insert_kernels(int on)
{
    __atomic_store_n(&insert_on, on, __ATOMIC_RELAXED);
}

FAKE_EXPORT unsigned long fakecuda_insert_calls(void)
{
    return __atomic_load_n(&insert_calls, __ATOMIC_RELAXED);
}

static int unused_entry(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    (void)x, (void)n, (void)body;
    return fail(c, EPIPE_EIO, "fakecuda: the backend's entry was called directly");
}

static int unused_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    (void)body, (void)n, (void)y;
    return fail(c, EPIPE_EIO, "fakecuda: the backend's entry was called directly");
}

/* What a backward needs of a forward, per handle (c->cuda): the encoder's
 * input or the decoder's code of one micro-batch, in host memory. */
typedef struct fake_slot {
    int64_t key;
    int enc, ndim;
    int64_t shape[EPIPE_MAX_NDIM];
    float *buf;
} fake_slot;

typedef struct fake_handle {
    fake_slot s[8];
} fake_handle;

static fake_slot *slot_find(epipe_codec *c, int enc, int64_t key)
{
    fake_handle *h = c->cuda;
    for (int i = 0; h && i < 8; i++)
        if (h->s[i].buf && h->s[i].enc == enc && h->s[i].key == key)
            return &h->s[i];
    return NULL;
}

/* Keeps a copy of n values under c->microbatch (replacing that key's). */
static int slot_keep(epipe_codec *c, int enc, const float *v, size_t n)
{
    if (!c->cuda && !(c->cuda = calloc(1, sizeof(fake_handle))))
        return fail(c, EPIPE_ENOMEM, "fakecuda: no memory");
    fake_handle *h = c->cuda;
    fake_slot *s = slot_find(c, enc, c->microbatch);
    for (int i = 0; !s && i < 8; i++)
        if (!h->s[i].buf)
            s = &h->s[i];
    if (!s)
        return fail(c, EPIPE_ENOMEM, "fakecuda: more than 8 kept tensors");
    free(s->buf);
    if (!(s->buf = malloc(n * 4 + 4)))
        return fail(c, EPIPE_ENOMEM, "fakecuda: no memory");
    memcpy(s->buf, v, n * 4);
    s->key = c->microbatch, s->enc = enc, s->ndim = c->ndim;
    memcpy(s->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    return EPIPE_OK;
}

static void slot_drop(fake_slot *s)
{
    free(s->buf);
    memset(s, 0, sizeof *s);
}

static void sizes(const epipe_cuda_insert_view *v, int64_t *S, int64_t *P);
static size_t patch_index(const epipe_cuda_insert_view *v, int64_t b, int64_t s, int64_t p);

/* The kept slot of mb, the shapes checked by the core, and the view. */
static int backward_view(epipe_codec *c, int enc, int64_t mb, const int64_t *zs, int zn,
                         const int64_t *fs, int fn, fake_slot **s, epipe_cuda_insert_view *v)
{
    if (!(*s = slot_find(c, enc, mb)))
        return fail(c, EPIPE_ESTATE, "insert: no %s of micro-batch %lld is kept for its backward",
                    enc ? "encode" : "decode", (long long)mb);
    uint64_t n = 1;
    for (int d = 0; d < (*s)->ndim; d++)
        n *= (uint64_t)(*s)->shape[d];
    int rc = core->ins_check_backward(c, mb, enc ? "input" : "output", (*s)->shape, (*s)->ndim, zs,
                                      zn, fs, fn);
    return rc ? rc : core->ins_plan(c, (*s)->shape, (*s)->ndim, n, v);
}

static int fake_encode_backward(epipe_codec *c, int64_t mb, const float *gz, const int64_t *zs,
                                int zn, float *gx, const int64_t *xs, int xn)
{
    fake_slot *s;
    epipe_cuda_insert_view v;
    int64_t S, P;
    int rc = backward_view(c, 1, mb, zs, zn, xs, xn, &s, &v);
    if (rc)
        return rc;
    sizes(&v, &S, &P);
    memset(gx, 0, sizeof(float) * (size_t)(v.B * S * P));
    for (int64_t b = 0; b < v.B; b++)
        for (int64_t kk = 0; kk < v.K; kk++)
            for (int64_t t = 0; t < S; t++) {
                float g = gz[(b * v.K + kk) * S + t];
                for (int64_t p = 0; p < P; p++) {
                    size_t i = patch_index(&v, b, t, p);
                    gx[i] += g * v.E[kk * P + p];
                    v.gE[kk * P + p] += g * s->buf[i];
                }
            }
    slot_drop(s);
    return EPIPE_OK;
}

static int fake_decode_backward(epipe_codec *c, int64_t mb, const float *gy, const int64_t *ys,
                                int yn, float *gz, const int64_t *zs, int zn)
{
    fake_slot *s;
    epipe_cuda_insert_view v;
    int64_t S, P;
    int rc = backward_view(c, 0, mb, zs, zn, ys, yn, &s, &v);
    if (rc)
        return rc;
    sizes(&v, &S, &P);
    for (int64_t b = 0; b < v.B; b++)
        for (int64_t kk = 0; kk < v.K; kk++)
            for (int64_t t = 0; t < S; t++) {
                double acc = 0;
                float z = s->buf[(b * v.K + kk) * S + t];
                for (int64_t p = 0; p < P; p++) {
                    float g = gy[patch_index(&v, b, t, p)];
                    acc += (double)g * v.Rt[kk * P + p];
                    v.gRt[kk * P + p] += z * g;
                }
                gz[(b * v.K + kk) * S + t] = (float)acc;
            }
    slot_drop(s);
    return EPIPE_OK;
}

static const epipe_codec_train_ops fake_train = {
    .encode_backward = fake_encode_backward,
    .decode_backward = fake_decode_backward,
};

/* The module's encode and decode below do the work; mode 1 has no train
 * ops (training is staged), mode 2 has the backward passes. */
static const epipe_codec_backend fake_insert = {unused_entry, unused_decode, NULL, NULL, 1, NULL};
static const epipe_codec_backend fake_insert_train = {unused_entry, unused_decode, NULL, NULL, 1,
                                                      &fake_train};

static int is_fake_insert(const epipe_codec_backend *be)
{
    return be == &fake_insert || be == &fake_insert_train;
}

/* The value of patch value p of code position (b, s): x's index, for conv
 * [B][C][H][W] patches of k x k at stride k, or linear [B][C]. */
static size_t patch_index(const epipe_cuda_insert_view *v, int64_t b, int64_t s, int64_t p)
{
    if (!v->conv)
        return (size_t)(b * v->C + p);
    int64_t Wo = v->W / v->k, i = s / Wo, j = s % Wo;
    int64_t ch = p / (v->k * v->k), u = p / v->k % v->k, w = p % v->k;
    return (size_t)(((b * v->C + ch) * v->H + i * v->k + u) * v->W + j * v->k + w);
}

static void sizes(const epipe_cuda_insert_view *v, int64_t *S, int64_t *P)
{
    *S = v->conv ? (v->H / v->k) * (v->W / v->k) : 1;
    *P = v->C * v->k * v->k;
}

static int fake_insert_encode(epipe_codec *c, const DLTensor *src, uint64_t n, enum epipe_dtype dt,
                              uint8_t *payload, const uint8_t *hdr, size_t len)
{
    epipe_cuda_insert_view v;
    int64_t S, P;
    int rc = core->ins_plan(c, c->shape, c->ndim, n, &v);
    if (rc)
        return rc;
    if (dt != EPIPE_DTYPE_F32)
        return fail(c, EPIPE_ENOTSUP, "fakecuda: insert's loops take fp32 tensors only");
    sizes(&v, &S, &P);
    size_t zn = (size_t)(v.B * v.K * S), esz = v.code16 ? 2 : 4;
    float *x = malloc(n * 4 + 1);
    uint8_t *out = malloc(len);
    if (!x || !out || fakecuda_copy(x, (const char *)src->data + src->byte_offset, n * 4)) {
        free(x), free(out);
        return fail(c, EPIPE_EIO, "fakecuda: cannot read the tensor");
    }
    memcpy(out, hdr, EPIPE_PAYLOAD_HEADER);
    if (c->microbatch >= 0 && insert_on == 2)
        rc = slot_keep(c, 1, x, n);
    for (size_t z = 0; z < zn && rc == EPIPE_OK; z++) {
        int64_t b = (int64_t)z / (v.K * S), kk = (int64_t)z / S % v.K, s = (int64_t)z % S;
        double acc = 0;
        for (int64_t p = 0; p < P; p++)
            acc += (double)x[patch_index(&v, b, s, p)] * v.E[kk * P + p];
        float f = (float)acc;
        if (!epipe_hd_finite(f)) {
            size_t i = 0;
            while (i < n && epipe_hd_finite(x[i]))
                i++;
            rc = i < n ? fail(c, EPIPE_EINVAL, "insert: value at index %zu is not finite", i)
                       : fail(c, EPIPE_EINVAL, "insert: the code overflows fp32");
        } else if (v.code16 && !(fabsf(f) < 65520.0f)) {
            rc = fail(c, EPIPE_EINVAL, "insert: code value %zu does not fit fp16 (code=fp16)", z);
        }
        uint8_t *o = out + EPIPE_PAYLOAD_HEADER + z * esz;
        uint32_t u = v.code16 ? epipe_hd_f32_to_f16(f) : epipe_hd_f2u(f);
        for (size_t i = 0; i < esz; i++)
            o[i] = (uint8_t)(u >> (8 * i));
    }
    if (rc == EPIPE_OK && fakecuda_copy(payload, out, len))
        rc = fail(c, EPIPE_EIO, "fakecuda: cannot write the payload");
    free(x), free(out);
    __atomic_add_fetch(&insert_calls, 1, __ATOMIC_RELAXED);
    return rc;
}

static int fake_insert_decode(epipe_codec *c, const uint8_t *payload, size_t len, uint64_t n,
                              DLTensor *dst, enum epipe_dtype dt)
{
    epipe_cuda_insert_view v;
    int64_t S, P;
    int rc = core->ins_plan(c, c->shape, c->ndim, n, &v);
    if (rc)
        return rc;
    if (dt != EPIPE_DTYPE_F32)
        return fail(c, EPIPE_ENOTSUP, "fakecuda: insert's loops take fp32 tensors only");
    sizes(&v, &S, &P);
    size_t zn = (size_t)(v.B * v.K * S), esz = v.code16 ? 2 : 4;
    uint8_t *in = malloc(len);
    float *y = calloc(n + 1, 4), *codes = malloc(zn * 4 + 4);
    if (!in || !y || !codes || fakecuda_copy(in, payload, len)) {
        free(in), free(y), free(codes);
        return fail(c, EPIPE_EIO, "fakecuda: cannot read the payload");
    }
    for (size_t z = 0; z < zn && rc == EPIPE_OK; z++) {
        const uint8_t *o = in + EPIPE_PAYLOAD_HEADER + z * esz;
        uint32_t u = 0;
        for (size_t i = 0; i < esz; i++)
            u |= (uint32_t)o[i] << (8 * i);
        codes[z] = v.code16 ? epipe_hd_f16_to_f32((uint16_t)u) : epipe_hd_u2f(u);
        if (!epipe_hd_finite(codes[z]))
            rc = fail(c, EPIPE_EPROTO, "insert: code value %zu is not finite", z);
    }
    for (size_t z = 0; z < zn && rc == EPIPE_OK; z++) {
        int64_t b = (int64_t)z / (v.K * S), kk = (int64_t)z / S % v.K, s = (int64_t)z % S;
        for (int64_t p = 0; p < P; p++)
            y[patch_index(&v, b, s, p)] += codes[z] * v.Rt[kk * P + p];
    }
    if (rc == EPIPE_OK && fakecuda_copy((char *)dst->data + dst->byte_offset, y, n * 4))
        rc = fail(c, EPIPE_EIO, "fakecuda: cannot write the tensor");
    if (rc == EPIPE_OK && c->microbatch >= 0 && insert_on == 2) /* keep the code */
        rc = slot_keep(c, 0, codes, zn);
    free(in), free(y), free(codes);
    __atomic_add_fetch(&insert_calls, 1, __ATOMIC_RELAXED);
    return rc;
}

static const epipe_codec_backend *backend(unsigned id)
{
    /* no kernels (the core stages every codec) but insert's loops, when on */
    int on = __atomic_load_n(&insert_on, __ATOMIC_RELAXED);
    if (id != 8 /* EPIPE_CODEC_ID_INSERT */ || !core->ins_plan || !on)
        return NULL;
    return on == 2 ? &fake_insert_train : &fake_insert;
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
    (void)n;
    if (c->ops->id != 8 || len < EPIPE_PAYLOAD_HEADER) /* only insert's loops read payloads */
        return no_kernels(c);
    return fakecuda_copy(hdr, payload, EPIPE_PAYLOAD_HEADER)
               ? fail(c, EPIPE_EIO, "fakecuda: cannot read the header")
               : EPIPE_OK;
}

static int encode(epipe_codec *c, const epipe_codec_backend *be, const DLTensor *src, uint64_t n,
                  enum epipe_dtype dt, uint8_t *payload, const uint8_t *hdr, size_t len)
{
    if (is_fake_insert(be))
        return fake_insert_encode(c, src, n, dt, payload, hdr, len);
    return no_kernels(c);
}

static int decode(epipe_codec *c, const epipe_codec_backend *be, const uint8_t *payload, size_t len,
                  uint64_t n, DLTensor *dst, enum epipe_dtype dt)
{
    if (is_fake_insert(be))
        return fake_insert_decode(c, payload, len, n, dst, dt);
    return no_kernels(c);
}

/* The train ops on host copies of both gradients (fp32 only). */
static int backward(epipe_codec *c, const epipe_codec_backend *be, int enc, unsigned mb,
                    const DLTensor *gin, uint64_t n_in, enum epipe_dtype dt_in, DLTensor *gout,
                    uint64_t n_out, enum epipe_dtype dt_out)
{
    if (be != &fake_insert_train)
        return no_kernels(c);
    if (dt_in != EPIPE_DTYPE_F32 || dt_out != EPIPE_DTYPE_F32)
        return fail(c, EPIPE_ENOTSUP, "fakecuda: insert's loops take fp32 gradients only");
    float *a = malloc(n_in * 4 + 4), *b = malloc(n_out * 4 + 4);
    int rc = EPIPE_OK;
    if (!a || !b || fakecuda_copy(a, (const char *)gin->data + gin->byte_offset, n_in * 4))
        rc = fail(c, EPIPE_EIO, "fakecuda: cannot read the gradient");
    if (rc == EPIPE_OK)
        rc = enc ? be->train->encode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape,
                                              gout->ndim)
                 : be->train->decode_backward(c, mb, a, gin->shape, gin->ndim, b, gout->shape,
                                              gout->ndim);
    if (rc == EPIPE_OK && fakecuda_copy((char *)gout->data + gout->byte_offset, b, n_out * 4))
        rc = fail(c, EPIPE_EIO, "fakecuda: cannot write the gradient");
    free(a), free(b);
    __atomic_add_fetch(&insert_calls, 1, __ATOMIC_RELAXED);
    return rc;
}

static int device_ok(int device, char *why, size_t cap)
{
    if (device == 0)
        return EPIPE_OK;
    snprintf(why, cap, "CUDA device %d does not exist (this machine has 1)", device);
    return EPIPE_EINVAL;
}

/* Device memory the library asked the module for (not the tests' own),
 * counted so a test can see that each allocation went back. */
static unsigned long dev_allocs;
static long dev_live;

FAKE_EXPORT unsigned long fakecuda_dev_allocs(void)
{
    return __atomic_load_n(&dev_allocs, __ATOMIC_RELAXED);
}

FAKE_EXPORT long fakecuda_dev_live(void)
{
    return __atomic_load_n(&dev_live, __ATOMIC_RELAXED);
}

static int dev_alloc(int device, size_t bytes, void **p, char *why, size_t cap)
{
    int rc = device_ok(device, why, cap);
    if (rc)
        return rc;
    if ((*p = fakecuda_alloc(bytes))) {
        __atomic_add_fetch(&dev_allocs, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&dev_live, 1, __ATOMIC_RELAXED);
        return EPIPE_OK;
    }
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

/* The test module has one device: a received payload is copied only to
 * the host (a stage moved there), counted with the staging copies. */
static int payload_copy(epipe_codec *c, int device, void *dst, int src_device, const void *src,
                        size_t bytes)
{
    if (device != -1 || src_device != 0 || fakecuda_copy(dst, src, bytes))
        return fail(c, EPIPE_EIO, "fakecuda: a payload copy of %zu bytes from device %d to %d",
                    bytes, src_device, device);
    pthread_mutex_lock(&lock);
    stream_copies++;
    pthread_mutex_unlock(&lock);
    return EPIPE_OK;
}

/* Pinned host memory is host memory: malloc, counted so a test can see
 * that host staging and message buffers ask the module for it, and give
 * it all back to the module. */
static unsigned long host_allocs;
static long host_live;

static int host_alloc(int device, size_t bytes, void **p, char *why, size_t cap)
{
    (void)device;
    if ((*p = malloc(bytes))) {
        __atomic_add_fetch(&host_allocs, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&host_live, 1, __ATOMIC_RELAXED);
        return EPIPE_OK;
    }
    snprintf(why, cap, "fakecuda: no host memory for %zu bytes", bytes);
    return EPIPE_ENOMEM;
}

/* free(p), one fewer of `live` alive. */
static void free_counted(long *live, void *p)
{
    if (p)
        __atomic_sub_fetch(live, 1, __ATOMIC_RELAXED);
    free(p);
}

static void host_free(int device, void *p)
{
    (void)device;
    free_counted(&host_live, p);
}

FAKE_EXPORT long fakecuda_host_live(void)
{
    return __atomic_load_n(&host_live, __ATOMIC_RELAXED);
}

FAKE_EXPORT unsigned long fakecuda_host_allocs(void)
{
    return __atomic_load_n(&host_allocs, __ATOMIC_RELAXED);
}

static void module_free(int device, void *p)
{
    (void)device;
    if (p)
        __atomic_sub_fetch(&dev_live, 1, __ATOMIC_RELAXED);
    fakecuda_free(p);
}

/* Fences: this module's work is done when its calls return, so a fence
 * is a token, counted: made, waited for, and alive (not yet freed); it
 * carries the verdict on its encode, which a test may make a failure
 * (fakecuda_fail_next_fence: the next fence made only). */
static unsigned long fences_made, fences_waited;
static long fences_live;
static int next_verdict;

FAKE_EXPORT void fakecuda_fail_next_fence(int status)
{
    __atomic_store_n(&next_verdict, status, __ATOMIC_RELAXED);
}

FAKE_EXPORT void fakecuda_fences(unsigned long *made, unsigned long *waited, long *live)
{
    *made = __atomic_load_n(&fences_made, __ATOMIC_RELAXED);
    *waited = __atomic_load_n(&fences_waited, __ATOMIC_RELAXED);
    *live = __atomic_load_n(&fences_live, __ATOMIC_RELAXED);
}

/* A fence's verdicts: its encode's, and what its stage was passed. */
typedef struct fake_fence {
    int own, passed;
    epipe_codec *waiter;    /* the handle whose stream waited for it (its decode's) */
    unsigned long long seq; /* that wait's place in the handle's queue */
} fake_fence;

/* What a real GPU would have run of each handle's queue: `queued` counts
 * the fence waits queued on its stream (each before a decode that reads
 * the fence's payload), `done` how many of them are known finished, by a
 * synchronize or a mark found passed. A fence freed past `done` is a
 * message given back while its decode could still be reading it. */
typedef struct fake_queue {
    const epipe_codec *c;
    unsigned long long queued, done;
    struct fake_queue *next;
} fake_queue;
static fake_queue *queues; /* under `lock` */
static unsigned long early_frees;

static fake_queue *queue_of(const epipe_codec *c)
{
    fake_queue *q;
    for (q = queues; q && q->c != c; q = q->next)
        ;
    if (!q && (q = calloc(1, sizeof *q))) {
        q->c = c;
        q->next = queues;
        queues = q;
    }
    return q;
}

FAKE_EXPORT unsigned long fakecuda_early_frees(void)
{
    return __atomic_load_n(&early_frees, __ATOMIC_RELAXED);
}

/* The next fence is not made, for lack of memory (fakecuda_no_memory_next_fence). */
static int no_memory_next;

FAKE_EXPORT void fakecuda_no_memory_next_fence(void)
{
    __atomic_store_n(&no_memory_next, 1, __ATOMIC_RELAXED);
}

static int fence(epipe_codec *c, int device, const void *taint, void **out)
{
    fake_fence *f = __atomic_exchange_n(&no_memory_next, 0, __ATOMIC_RELAXED)
                        ? NULL
                        : calloc(1, sizeof *f);
    if (device != 0 || !f || (taint && fakecuda_copy(&f->passed, taint, sizeof f->passed))) {
        free(f); /* as the module: no memory is EPIPE_ENOMEM, a failed copy EPIPE_EIO */
        return fail(c,
                    device ? EPIPE_EINVAL
                    : f    ? EPIPE_EIO
                           : EPIPE_ENOMEM,
                    "fakecuda: a fence on device %d", device);
    }
    f->own = __atomic_exchange_n(&next_verdict, 0, __ATOMIC_RELAXED);
    *out = f;
    __atomic_add_fetch(&fences_made, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&fences_live, 1, __ATOMIC_RELAXED);
    return EPIPE_OK;
}

/* The taint: one int in this module's device memory, the first verdict
 * that came (0: none). */
static int fence_wait(epipe_codec *c, int device, void *p, void **taint)
{
    fake_fence *f = p;
    char why[128];
    int zero = 0, t = 0;
    if (device != 0 || !f)
        return fail(c, EPIPE_EINVAL, "fakecuda: waiting for fence %p on device %d", p, device);
    if (taint && !*taint &&
        (dev_alloc(0, sizeof zero, taint, why, sizeof why) || fakecuda_copy(*taint, &zero, 4)))
        return fail(c, EPIPE_ENOMEM, "fakecuda: the stage's taint");
    if (taint && (fakecuda_copy(&t, *taint, 4) ||
                  (!t && (t = f->own ? f->own : f->passed) && fakecuda_copy(*taint, &t, 4))))
        return fail(c, EPIPE_EINVAL, "fakecuda: the stage's taint");
    /* the handle now has stream work, as far as the core can tell: its
     * synchronize comes here (where the queue is known done) */
    if (!c->cuda && !(c->cuda = calloc(1, sizeof(fake_handle))))
        return fail(c, EPIPE_ENOMEM, "fakecuda: a handle's state");
    pthread_mutex_lock(&lock);
    fake_queue *q = queue_of(c);
    if (q) {
        f->waiter = c;
        f->seq = ++q->queued;
    }
    pthread_mutex_unlock(&lock);
    __atomic_add_fetch(&fences_waited, 1, __ATOMIC_RELAXED);
    return EPIPE_OK;
}

static int fence_status(epipe_codec *c, void *p)
{
    const fake_fence *f = p;
    if (f->own)
        return fail(c, f->own, "fakecuda: its encode failed");
    return f->passed ? fail(c, f->passed, "fakecuda: an earlier stage's encode failed") : 0;
}

static void fence_free(int device, void *p)
{
    fake_fence *f = p;
    (void)device;
    if (!f)
        return;
    pthread_mutex_lock(&lock);
    fake_queue *q = f->waiter ? queue_of(f->waiter) : NULL;
    if (q && f->seq > q->done)
        early_frees++;
    pthread_mutex_unlock(&lock);
    __atomic_sub_fetch(&fences_live, 1, __ATOMIC_RELAXED);
    free(f);
}

/* Marks: counted (recorded, found passed, alive). Each is stamped with
 * a clock that every record advances; a mark passes once `lag` more have
 * been recorded after it (fakecuda_marks_lag: 0, the default, at once; -1
 * never), as a GPU that runs behind its host would have it, and then what
 * its handle queued before it is done. A test may fail the k-th record
 * from now (fakecuda_fail_mark_at). */
typedef struct fake_mark {
    const epipe_codec *c;
    unsigned long long upto; /* its handle's queue when recorded */
    unsigned long at;        /* the clock then */
} fake_mark;
static unsigned long marks_recorded, marks_passed, fail_mark_at;
static long marks_live, marks_lag;
static int fail_mark_status;

FAKE_EXPORT void fakecuda_marks(unsigned long *recorded, unsigned long *passed, long *live)
{
    pthread_mutex_lock(&lock);
    *recorded = marks_recorded;
    *passed = marks_passed;
    pthread_mutex_unlock(&lock);
    *live = __atomic_load_n(&marks_live, __ATOMIC_RELAXED);
}

FAKE_EXPORT void fakecuda_marks_lag(long lag)
{
    pthread_mutex_lock(&lock);
    marks_lag = lag;
    pthread_mutex_unlock(&lock);
}

FAKE_EXPORT void fakecuda_fail_mark_at(unsigned long k, int status)
{
    pthread_mutex_lock(&lock);
    fail_mark_at = k ? marks_recorded + k : 0;
    fail_mark_status = status;
    pthread_mutex_unlock(&lock);
}

static int mark(epipe_codec *c, int device, void **out)
{
    pthread_mutex_lock(&lock);
    int err = fail_mark_at && marks_recorded + 1 == fail_mark_at ? fail_mark_status : 0;
    if (err)
        fail_mark_at = 0;
    pthread_mutex_unlock(&lock);
    if (device != 0 || err)
        return fail(c, device ? EPIPE_EINVAL : err, "fakecuda: a mark on device %d", device);
    fake_mark *m = *out;
    if (!m) {
        if (!(m = calloc(1, sizeof *m)))
            return fail(c, EPIPE_ENOMEM, "fakecuda: no memory for a mark");
        *out = m;
        __atomic_add_fetch(&marks_live, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_lock(&lock);
    fake_queue *q = queue_of(c);
    m->c = c;
    m->upto = q ? q->queued : 0;
    m->at = ++marks_recorded;
    pthread_mutex_unlock(&lock);
    return EPIPE_OK;
}

static int mark_passed(int device, void *p)
{
    fake_mark *m = p;
    if (device != 0 || !m)
        return 0;
    pthread_mutex_lock(&lock);
    int passed = marks_lag >= 0 && marks_recorded - m->at >= (unsigned long)marks_lag;
    fake_queue *q = passed ? queue_of(m->c) : NULL;
    if (q && m->upto > q->done)
        q->done = m->upto;
    marks_passed += (unsigned long)passed;
    pthread_mutex_unlock(&lock);
    return passed;
}

static void mark_free(int device, void *m)
{
    (void)device;
    free_counted(&marks_live, m);
}

static int synchronize(epipe_codec *c)
{
    pthread_mutex_lock(&lock);
    fake_queue *q = queue_of(c);
    if (q)
        q->done = q->queued;
    pthread_mutex_unlock(&lock);
    return EPIPE_OK;
}

static void release(epipe_codec *c)
{
    fake_handle *h = c->cuda;
    for (int i = 0; h && i < 8; i++)
        slot_drop(&h->s[i]);
    free(h);
    c->cuda = NULL;
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
    .free = module_free,
    .stream_copy = stream_copy,
    .payload_copy = payload_copy,
    .host_alloc = host_alloc,
    .host_free = host_free,
    .backward = backward,
    .fence = fence,
    .fence_wait = fence_wait,
    .fence_status = fence_status,
    .fence_free = fence_free,
    .mark = mark,
    .mark_passed = mark_passed,
    .mark_free = mark_free,
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
