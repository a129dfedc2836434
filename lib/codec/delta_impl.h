/* The activation-delta state (spec key delta=1) the files delta*.c share:
 * the per-sample store, its index and the per-call buffers. */
#ifndef EPIPE_LIB_CODEC_DELTA_IMPL_H
#define EPIPE_LIB_CODEC_DELTA_IMPL_H

#include "core.h"

/* Per-row kinds, two bits each on the wire. */
enum { EPIPE_DELTA_FULL = 0, EPIPE_DELTA_KEEP = 1, EPIPE_DELTA_ROW = 2 };
#define EPIPE_DELTA_EMPTY UINT32_MAX /* no stored row */

/* The store: rows of rowlen fp32 values, found by sample id through an
 * open-addressing table (linear probing; entries are never removed one by
 * one, only all at once). */
struct epipe_codec_delta {
    uint64_t *keys;
    uint32_t *vals; /* row index, EPIPE_DELTA_EMPTY for a free entry */
    size_t tcap;    /* power of two, or 0 */
    float *rows;
    size_t nrows, rows_cap;
    /* What the stored rows are: dtype and the shape past dimension 0. */
    uint64_t rowlen;
    enum epipe_dtype dt;
    int ndim;
    int64_t shape[EPIPE_CODEC_MAX_NDIM];
    /* The ids for the next encode. */
    uint64_t *ids;
    size_t nids, ids_cap;
    int ids_set;
    int untracked; /* the ids were NULL (set_samples); then per call */
    /* Per call: row kinds, stored-row index per row, work values. */
    uint8_t *kind;
    uint32_t *base;
    uint64_t *sorted;
    uint64_t *rids;   /* the ids a decode read */
    size_t last_rows; /* of the last successful decode, when last_ok */
    int last_ok, last_untracked;
    size_t rcap;
    float *work;
    size_t work_cap;
    epipe_codec_delta_info info;
    /* epipe_codec_delta_max_size()'s last shape (mndim 0: none) and answer. */
    int mndim;
    int64_t mshape[EPIPE_CODEC_MAX_NDIM];
    size_t mbytes;
};

typedef struct epipe_codec_delta epipe_delta;

/* delta_store.c. The handle's state, made on first use (NULL: no memory). */
epipe_delta *epipe_delta_state(epipe_codec *c);
int epipe_delta_oom(epipe_codec *c);    /* EPIPE_ENOMEM, with a message */
void epipe_delta_clear(epipe_delta *s); /* empties the store */
/* The stored row index of id, or EPIPE_DELTA_EMPTY. */
uint32_t epipe_delta_lookup(const epipe_delta *s, uint64_t id);
/* Room for `more` rows beyond those stored (pool and index), so that
 * keeping rows after a successful encode or decode cannot fail. */
int epipe_delta_reserve(epipe_codec *c, epipe_delta *s, size_t more);
/* Stores row for id: over its old row, or as a new one (room reserved). */
void epipe_delta_store(epipe_delta *s, uint64_t id, const float *row);
/* Empties the store when its rows are of another dtype or row shape than
 * the current call's (c->shape), and takes the current ones. */
void epipe_delta_match_shape(epipe_delta *s, const epipe_codec *c, enum epipe_dtype dt);
/* 1 and *dup if an id occurs twice in ids[0..r) (sorted in s->sorted). */
int epipe_delta_find_duplicate(epipe_delta *s, const uint64_t *ids, size_t r, uint64_t *dup);
/* Per-call buffers: r rows, and 2 * n work values. */
int epipe_delta_per_call(epipe_codec *c, epipe_delta *s, size_t r, uint64_t n);

#endif
