/* Boundaries between two chunks of one rank: the tensor is handed over in
 * memory, without the transport, and through the codecs only when the host set them. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../codec/codec_internal.h"
#include "../codec/cuda_core.h"
#include "../tensor.h"
#include "stage_impl.h"

/* Encodes t with enc and decodes it with dec into slot (whose shape and
 * dtype are set): the boundary's codecs, run in this process. */
static int through_codecs(epipe_stage *st, epipe_codec *enc, epipe_codec *dec, unsigned mb,
                          const DLTensor *t, struct lent_tensor *slot, const char *what)
{
    uint64_t n;
    enum epipe_dtype dt;
    int rc = epipe_tensor_inspect_on(t, what, NULL, &n, &dt, 1);
    size_t cap, len;
    if (rc == EPIPE_OK)
        rc = epipe_codec_size_checked(enc, t, n, &cap);
    if (rc)
        return fail(st, rc, "%s", epipe_codec_last_error(enc));
    if (st->scratch_cap < cap) {
        void *p = realloc(st->scratch, cap);
        if (!p)
            return fail(st, EPIPE_ENOMEM, "no memory for a %zu-byte %s", cap, what);
        st->scratch = p, st->scratch_cap = cap;
    }
    epipe_codec_set_param(enc, EPIPE_CODEC_MICROBATCH, st->training ? (int64_t)mb : -1);
    double t0 = now();
    rc = epipe_codec_encode_checked(enc, t, n, dt, st->scratch, cap, &len);
    if (rc == EPIPE_OK && epipe_tensor_is_cuda(t))
        rc = epipe_codec_synchronize(enc);
    double t1 = now();
    st->st.encode_seconds += t1 - t0;
    if (rc)
        return fail(st, rc, "encoding the %s of micro-batch %u: %s", what, mb,
                    epipe_codec_last_error(enc));
    rc = epipe_codec_decode(dec, st->scratch, len, &slot->t);
    if (rc == EPIPE_OK && slot->on_cuda)
        rc = epipe_codec_synchronize(dec);
    st->st.decode_seconds += now() - t1;
    if (rc)
        return fail(st, rc, "decoding the %s of micro-batch %u: %s", what, mb,
                    epipe_codec_last_error(dec));
    return EPIPE_OK;
}

int epipe_stage_hand_over(epipe_stage *st, struct chunk *c, unsigned mb, int dir, const DLTensor *t)
{
    const char *what = dir == DIR_ACT ? "activation" : "gradient";
    struct chunk *to = &st->ch[dir == DIR_ACT ? c->down_chunk : c->up_chunk];
    struct lent_tensor *slot = dir == DIR_ACT ? &to->act_in[mb] : &to->grad_loc[mb];
    unsigned char *ready = dir == DIR_ACT ? &to->act_ready[mb] : &to->grad_ready[mb];
    /* the flag lives on the chunk whose DOWN side the boundary is */
    int codec = dir == DIR_ACT ? c->local_codec[DIR_ACT] : to->local_codec[DIR_GRAD];
    epipe_codec *enc = dir == DIR_ACT ? c->enc_act : c->enc_grad;
    epipe_codec *dec = dir == DIR_ACT ? to->dec_act : to->dec_grad;
    int rc = epipe_stage_lend_shape(st, slot, t->ndim, t->shape, t->dtype);
    if (rc)
        return rc;
    /* sample ids (delta=1) go through delta codecs, else along with the tensor */
    int delta = dir == DIR_ACT && codec && c->delta_enc;
    if (dir == DIR_ACT && (rc = delta ? epipe_stage_samples_before_encode(st, c, enc, mb, t)
                                      : epipe_stage_samples_move(st, c, to, mb)))
        return rc;
    if (!codec && epipe_tensor_is_dense(t)) {
        size_t bytes = (size_t)(t->dtype.bits / 8);
        for (int d = 0; d < t->ndim; d++)
            bytes *= (size_t)t->shape[d];
        const char *from = (const char *)t->data + t->byte_offset;
        if (bytes && (slot->on_cuda || epipe_tensor_is_cuda(t))) {
            /* on the stage's stream (enc's), after the work that made t */
            int device = epipe_tensor_is_cuda(t) ? (int)t->device.device_id : slot->device;
            if ((rc = epipe_codec_cuda_stream_copy(enc, device, slot->buf, from, bytes))) {
                slot->t.data = NULL;
                return fail(st, rc, "handing over the %s of micro-batch %u: %s", what, mb,
                            epipe_codec_last_error(enc));
            }
        } else if (bytes) {
            memcpy(slot->buf, from, bytes);
        }
    } else if ((rc = through_codecs(st, enc, dec, mb, t, slot, what)) ||
               (delta && (rc = epipe_stage_samples_after_decode(st, to, dec, mb)))) {
        slot->t.data = NULL;
        return rc;
    }
    *ready = 1;
    return EPIPE_OK;
}

int epipe_stage_take_local(epipe_stage *st, struct chunk *c, unsigned mb, int dir,
                           const DLTensor **t)
{
    unsigned char *ready = dir == DIR_ACT ? &c->act_ready[mb] : &c->grad_ready[mb];
    struct lent_tensor *slot = dir == DIR_ACT ? &c->act_in[mb] : &c->grad_loc[mb];
    if (!*ready)
        return fail(st, EPIPE_EINTERNAL,
                    "the %s of micro-batch %u for pipeline stage %u was not handed over by "
                    "its neighbour on this rank before it is needed",
                    dir == DIR_ACT ? "activation" : "gradient", mb, c->g);
    *ready = 0;
    if (dir == DIR_GRAD) {
        /* a gradient has the shape of the activation sent for it */
        const struct tensor_meta *s = &c->act_out[mb];
        const DLTensor *g = &slot->t;
        if (s->set && (s->ndim != g->ndim || s->dtype.code != g->dtype.code ||
                       s->dtype.bits != g->dtype.bits ||
                       memcmp(s->shape, g->shape, sizeof(int64_t) * (size_t)g->ndim)))
            return fail(st, EPIPE_EINTERNAL,
                        "the gradient of micro-batch %u handed over differs from its activation",
                        mb);
    }
    *t = &slot->t;
    return EPIPE_OK;
}
