/* The internal interface every codec implements: a backend-independent
 * ops table (name, parameters, sizes) and one table per device backend. */
#ifndef EPIPE_LIB_CODEC_CODEC_IMPL_H
#define EPIPE_LIB_CODEC_CODEC_IMPL_H

/* The codec core (lib/codec/) parses specs, validates tensors, picks the
 * backend from the tensor's DLPack device, writes and checks the payload
 * header and stages dtypes; a backend only maps dense fp32 values to the
 * codec's body bytes. docs/codec-backends.md describes the contract. */

#include <stddef.h>
#include <stdint.h>

#include <epipe/codec.h>

#include "../error.h"

#define EPIPE_CODEC_MAX_PARAMS 8
#define EPIPE_SPEC_MAX 256

/* Stable codec ids: written on the wire, never reused. */
enum epipe_codec_id {
    EPIPE_CODEC_ID_NONE = 1,
    EPIPE_CODEC_ID_CAST = 2,
    EPIPE_CODEC_ID_QUANT = 3,
    EPIPE_CODEC_ID_SORTQUANT = 4,
    EPIPE_CODEC_ID_KMEANS = 5,
    EPIPE_CODEC_ID_TOPK = 6,
    EPIPE_CODEC_ID_POWERITER = 7,
    EPIPE_CODEC_ID_INSERT = 8,
    /* A two-link chain "a|b" (lib/codec/chain.c): far from the single
     * codecs' ids so that new codecs never collide with it. */
    EPIPE_CODEC_ID_CHAIN = 64,
};

typedef enum epipe_param_kind {
    EPIPE_PARAM_INT,    /* integer in [min, max] */
    EPIPE_PARAM_REAL,   /* finite real in [min, max] */
    EPIPE_PARAM_CHOICE, /* one of `choices`; the value is its index */
} epipe_param_kind;

typedef struct epipe_param_desc {
    const char *key;
    epipe_param_kind kind;
    double min, max;
    double def;                 /* default; NAN = the codec derives it */
    const char *const *choices; /* NULL-terminated, for EPIPE_PARAM_CHOICE */
    /* 1: the canonical spec leaves the key out while it has its default (a
     * key added later, so that older specs keep their canonical form). */
    int quiet_default;
} epipe_param_desc;

/* The choices of an on/off key ("0", "1"): its value is 0 or 1. */
extern const char *const epipe_param_bool[];

/* Trainable codecs (insert), per backend: the backward and the parameters.
 * The core checks handles and stages dtypes; these see dense fp32 in the
 * backend's memory only. */
typedef struct epipe_codec_train_ops {
    /* Parameter tensor i < ntensors() and its gradient, owned by the codec
     * and in the backend's memory; EPIPE_ESTATE while they do not exist. */
    int (*tensor)(epipe_codec *c, unsigned i, const char **name, DLTensor **param, DLTensor **grad);
    /* Given the gradient w.r.t. the code of micro-batch mb's encode, writes
     * the gradient w.r.t. its input and accumulates the compress gradients. */
    int (*encode_backward)(epipe_codec *c, int64_t mb, const float *grad_code,
                           const int64_t *code_shape, int code_ndim, float *grad_input,
                           const int64_t *input_shape, int input_ndim);
    /* Given the gradient w.r.t. micro-batch mb's decoded output, writes the
     * gradient w.r.t. the code and accumulates the restore gradients. */
    int (*decode_backward)(epipe_codec *c, int64_t mb, const float *grad_output,
                           const int64_t *output_shape, int output_ndim, float *grad_code,
                           const int64_t *code_shape, int code_ndim);
    void (*zero_grad)(epipe_codec *c);
    int (*sgd_step)(epipe_codec *c, float lr, float momentum);
    /* The code as fp32 (code_shape of c->shape), and the tensor restored
     * from it: encode and decode without the body bytes, for the first
     * link of a chain. They keep what the backward needs as encode and
     * decode do. */
    int (*forward_code)(epipe_codec *c, const float *x, size_t n, float *code);
    int (*restore_code)(epipe_codec *c, const float *code, float *y);
} epipe_codec_train_ops;

/* The devices a codec may run on (docs/codec-backends.md). */
typedef enum epipe_codec_device {
    EPIPE_CODEC_DEV_CPU,  /* host memory: kDLCPU, kDLCUDAHost */
    EPIPE_CODEC_DEV_CUDA, /* device memory: kDLCUDA, kDLCUDAManaged */
} epipe_codec_device;

/* What one device backend of a codec provides. The CPU backend gets host
 * memory; a CUDA backend (docs/codec-backends.md) gets device memory and
 * enqueues its work on the handle's stream. */
typedef struct epipe_codec_backend {
    /* Writes exactly body_size(n) bytes for the dense fp32 values x. */
    int (*encode)(epipe_codec *c, const float *x, size_t n, uint8_t *body);
    /* Reads a body whose length was already checked to be body_size(n).
     * Must validate every metadata byte it uses (EPIPE_EPROTO otherwise). */
    int (*decode)(epipe_codec *c, const uint8_t *body, size_t n, float *y);
    /* Optional plain scalar references with the same contract. When present,
     * tests check that the fast paths above produce identical bytes (or stay
     * within a stated tolerance), and epipe-bench times both. */
    int (*encode_ref)(epipe_codec *c, const float *x, size_t n, uint8_t *body);
    int (*decode_ref)(epipe_codec *c, const uint8_t *body, size_t n, float *y);
    /* 1 when the references agree with the fast paths only within a stated
     * tolerance, not byte for byte (poweriter: BLAS and LAPACK round
     * differently from plain loops); epipe-bench then compares decoded
     * values instead of payload bytes. */
    int ref_approximate;
    /* Trainable codecs only; NULL for the others. */
    const epipe_codec_train_ops *train;
} epipe_codec_backend;

/* What a codec is, whatever the device: every field here is plain data or
 * a host function of the parameters and the shape, so a codec that cannot
 * run in a build fills them and leaves its backends NULL (or ENOTSUP). */
typedef struct epipe_codec_ops {
    const char *name;
    enum epipe_codec_id id;
    const epipe_param_desc *params;
    unsigned nparams;
    /* Optional: a codec written with its own syntax (the chain, "a|b")
     * parses the whole spec, sets c->state and c->spec itself. Such a codec
     * is never looked up by name. */
    int (*parse)(epipe_codec *c, const char *spec);
    /* Optional: derive defaults given as NAN and check parameters against
     * each other. May allocate codec->state. */
    int (*configure)(epipe_codec *c);
    /* The 32-bit parameter word written into every payload header: the
     * parameters a decoder must share with the encoder. */
    uint32_t (*param_word)(const epipe_codec *c);
    /* Exact body size for n values; EPIPE_EOVERFLOW if it does not fit.
     * A codec that needs a shape (insert) may refuse c->shape with another
     * status, after setting the message with epipe_codec_fail(). The size
     * is known on the host before any backend runs: the core writes the
     * payload header from it (docs/codec-backends.md). */
    int (*body_size)(const epipe_codec *c, uint64_t n, size_t *bytes);
    /* Trainable codecs only (NULL for the others): the code's shape for an
     * input of `shape` (errors as body_size's), and the parameter tensors'
     * count. A trainable codec's backends have train ops. */
    int (*code_shape)(epipe_codec *c, const int64_t *shape, int ndim, int64_t *out, int *out_ndim);
    unsigned (*ntensors)(const epipe_codec *c);
    /* Optional: frees codec->state (and whatever a backend allocated). */
    void (*release)(epipe_codec *c);
    /* The CPU backend, for CPU tensors (kDLCPU, kDLCUDAHost); NULL when
     * this build cannot run the codec. Backends for other devices are not
     * fields here: the CUDA backend will live in a module loaded at run
     * time, whose tables the registry finds by codec id
     * (epipe_codec_backend_of(), docs/codec-backends.md). */
    const epipe_codec_backend *cpu;
} epipe_codec_ops;

struct epipe_codec {
    const epipe_codec_ops *ops;
    /* The backend that calls without a tensor (zero_grad, sgd_step, the
     * parameter tensors) and use_reference go to: the CPU one until a
     * CUDA backend exists (docs/codec-backends.md, "Binding"). */
    const epipe_codec_backend *be;
    double p[EPIPE_CODEC_MAX_PARAMS]; /* parameter values, in ops->params order */
    /* The shape of the tensor of the current call, set by the core before
     * body_size, encode or decode: codecs that work on matrices (poweriter)
     * or patches (insert) read it; the others need only the count. */
    int ndim;
    int64_t shape[16];
    unsigned threads;              /* EPIPE_CODEC_THREADS */
    int64_t microbatch;            /* EPIPE_CODEC_MICROBATCH: -1 = keep nothing */
    int use_reference;             /* run encode_ref/decode_ref (tests, bench) */
    int ef;                        /* spec key ef=1: error feedback (lib/codec/ef.c) */
    void *ef_state;                /* its residual slots, made on first encode */
    int delta, delta_strict;       /* spec keys delta=1, delta_strict=1 (lib/codec/delta.c) */
    int delta_raw;                 /* spec key delta_raw (default 1): first sightings in fp32 */
    unsigned delta_mb, delta_seen; /* spec key delta_mb; the delta keys given */
    void *delta_state;             /* its stored rows, made on first use */
    void *state;                   /* the codec's own */
    float *scratch;                /* fp32 staging for converted tensors */
    size_t scratch_cap;
    char spec[EPIPE_SPEC_MAX];
    char msg[EPIPE_ERRMSG_MAX];
    /* CUDA (docs/codec-backends.md): the stream the host set (a
     * cudaStream_t; NULL = the legacy default stream), the CUDA module's
     * per-handle state, and the device the first encode or decode bound the
     * handle to: bound_type 0 = none yet, else kDLCPU or kDLCUDA (with
     * bound_id, the CUDA device index). */
    void *stream;
    void *cuda;
    int bound_type, bound_id;
    /* Kernels (an encode, decode or backward) were queued since the last
     * synchronize: errors they note are unreported until one comes (or
     * epipe_codec_destroy, which logs them). */
    int cuda_unsynced;
    /* EPIPE_CUDA_DEFER_CHECKS as the environment had it when the handle
     * was made (read then, not under a host's setenv() from another
     * thread): 1 (unset too), 0, or -1 with the value in defer_env. */
    int defer_checks;
    char defer_env[41];
    /* Host buffers of a CUDA handle whose codec runs on the CPU backend
     * (lib/codec/cuda_staged.c): the tensor's values and the payload. */
    void *staged_values, *staged_payload;
    size_t staged_values_cap, staged_payload_cap;
};
/* How a codec that works per sample splits the n values of the current
 * call: with per_row, one range per row of dimension 0 (shape[0] rows of
 * n / shape[0] values); otherwise, and for a tensor of fewer than two
 * dimensions (a vector is one sample, not n of one value) or with no
 * values, one range of all n. */
static inline void epipe_codec_rows(const epipe_codec *c, uint64_t n, int per_row, uint64_t *count,
                                    uint64_t *len)
{
    *count = 1;
    *len = n;
    if (per_row && n && c->ndim > 1 && c->shape[0] > 0 && n % (uint64_t)c->shape[0] == 0) {
        *count = (uint64_t)c->shape[0];
        *len = n / *count;
    }
}

/* The same with runs of `group` values (0: off), each its own range: the n
 * values split into n / group ranges. The caller has checked that group
 * divides each row of dimension 0 (epipe_codec_group_fits); a tensor with
 * no values is one empty range. */
static inline void epipe_codec_ranges(const epipe_codec *c, uint64_t n, int per_row, uint64_t group,
                                      uint64_t *count, uint64_t *len)
{
    if (group && n && n % group == 0) {
        *count = n / group;
        *len = group;
        return;
    }
    epipe_codec_rows(c, n, per_row, count, len);
}

/* Whether runs of `group` values tile each row of dimension 0 of the current
 * shape (the whole tensor for fewer than two dimensions); *row_len gets the
 * row's length. */
static inline int epipe_codec_group_fits(const epipe_codec *c, uint64_t n, uint64_t group,
                                         uint64_t *row_len)
{
    uint64_t rows = c->ndim > 1 && c->shape[0] > 0 ? (uint64_t)c->shape[0] : 1;
    *row_len = n % rows == 0 ? n / rows : n;
    return !group || *row_len % group == 0;
}

/* Records an error on the codec (and the thread) and returns status. */
int epipe_codec_fail(epipe_codec *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Internal, for tests and epipe-bench: route encode and decode through the
 * codec's scalar reference (where it has one). Returns 0 if it has none. */
int epipe_codec_use_reference(epipe_codec *c, int on);

/* Worker threads to use for n values: 1 below a size where threads pay. */
unsigned epipe_codec_workers(const epipe_codec *c, size_t n);

/* Index of the first non-finite value in x[0..n), or n if all are finite;
 * the quantizers reject such input by name. */
size_t epipe_find_nonfinite(const float *x, size_t n);

extern const epipe_codec_ops epipe_codec_none;
extern const epipe_codec_ops epipe_codec_cast;
extern const epipe_codec_ops epipe_codec_quant;
extern const epipe_codec_ops epipe_codec_sortquant;
extern const epipe_codec_ops epipe_codec_kmeans;
extern const epipe_codec_ops epipe_codec_topk;
extern const epipe_codec_ops epipe_codec_poweriter;
extern const epipe_codec_ops epipe_codec_insert;
extern const epipe_codec_ops epipe_codec_chain;

#endif
