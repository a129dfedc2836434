/* poweriter internals shared by its files: the parameters, the matrix view,
 * the warm-start slots and scratch, and the record reader and writer. */
#ifndef EPIPE_CODECS_POWERITER_H
#define EPIPE_CODECS_POWERITER_H

#include <stddef.h>
#include <stdint.h>

#include "../../lib/codec/codec_impl.h"
#include "../../lib/codec/cuda_api.h"
#include "../../lib/tensor.h"

enum { PI_RANK, PI_ITERS, PI_WARM, PI_FACTORS, PI_SHARED };
enum { PI_F32 = 0, PI_F16 = 1 };

/* Bytes of the body header: u32 rank, u32 reserved (0), u64 B, rows, cols. */
#define PI_BODY_HEADER 32
/* Warm starts are kept for slots 0..PI_MAX_SLOTS-1; higher slots share
 * slot % PI_MAX_SLOTS. */
#define PI_MAX_SLOTS 256
_Static_assert(PI_MAX_SLOTS == EPIPE_CUDA_PI_SLOTS, "the CUDA module keeps as many slots");
_Static_assert(PI_BODY_HEADER == EPIPE_CUDA_PI_HEADER, "the CUDA module's body header");
_Static_assert(PI_FACTORS == EPIPE_CUDA_PI_FACTORS && PI_F16 == EPIPE_CUDA_PI_F16,
               "the CUDA module's factors parameter");

/* The matrix view of a tensor shape (docs/codecs.md). */
typedef struct pi_view {
    uint64_t nb, rows, cols;
    unsigned r; /* effective rank: min(rank, rows, cols) */
} pi_view;

typedef struct pi_slot {
    pi_view v; /* the view the warm start belongs to */
    float *p;  /* nb blocks of cols x r, column-major; NULL = cold */
    size_t cap;
    /* 1: the warm start is the CUDA module's, in device memory (the
     * handle is bound to a device: cuda/poweriter.cu), and p is unused */
    int on_device;
} pi_slot;

typedef struct pi_state {
    pi_slot slots[PI_MAX_SLOTS];
    float *q, *p, *tau, *work; /* per-matrix scratch */
    size_t qcap, pcap, taucap, workcap;
} pi_state;

static inline size_t pi_esize(const epipe_codec *c)
{
    return (int)c->p[PI_FACTORS] == PI_F16 ? 2 : 4;
}

/* poweriter.c: the view and sizes, scratch, warm starts. */
/* EPIPE_EINVAL (with the reason) for a 2-D tensor whose rows would share
 * factors of a rank below their count, unless the spec says shared=1. */
int epipe_pi_check_shared(epipe_codec *c, const pi_view *v);
int epipe_pi_view_of(const epipe_codec *c, uint64_t n, pi_view *v);
int epipe_pi_record_size(const epipe_codec *c, const pi_view *v, uint64_t *bytes);
int epipe_pi_grow(float **p, size_t *cap, size_t n);
int epipe_pi_prepare(epipe_codec *c, const pi_view *v, pi_slot **slot_out);
void epipe_pi_cold_start(float *p, uint64_t cols, unsigned r);
int epipe_pi_finish_matrix(epipe_codec *c, const pi_view *v, uint64_t b, pi_slot *slot,
                           float *start, const float *q, const float *p, uint8_t *rec);

/* payload.c: the body header and the per-matrix records. */
void epipe_pi_write_header(uint8_t *body, const pi_view *v);
int epipe_pi_check_factors(epipe_codec *c, uint64_t b, float s, int finite, unsigned r);
int epipe_pi_write_record(epipe_codec *c, const pi_view *v, uint64_t b, const float *q,
                          const float *p, uint8_t *rec);
int epipe_pi_check_header(epipe_codec *c, const uint8_t *body, const pi_view *v);
int epipe_pi_read_factor(epipe_codec *c, const uint8_t *in, uint64_t n, unsigned r, int fp16,
                         float *f, uint64_t b, const char *which);
int epipe_pi_read_scale(epipe_codec *c, const uint8_t *rec, unsigned r, uint64_t b, float *s);
/* Matrix b's record at rec: its scale into *s, Q into q and P into p
 * (column-major), every value checked as above. */
int epipe_pi_read_record(epipe_codec *c, const pi_view *v, uint64_t b, const uint8_t *rec, float *s,
                         float *q, float *p);
int epipe_pi_reject_nonfinite(epipe_codec *c, const float *x, size_t at);

/* lowrank.c: the fast path (OpenBLAS, LAPACKE). */
int epipe_pi_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body);
int epipe_pi_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y);

/* ref.c: the scalar reference. */
int epipe_pi_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body);
int epipe_pi_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y);

#endif
