/* The trainer's model: dense layers with ReLU, a softmax cross-entropy head,
 * SGD with momentum; the matrix products go to the BLAS. Each stage owns a
 * contiguous run of layers and keeps per-micro-batch activations. */
#ifndef EPIPE_TRAIN_MODEL_H
#define EPIPE_TRAIN_MODEL_H

#include <stdint.h>

#define MODEL_MAX_LAYERS 8
#define MODEL_MAX_MB 64

typedef struct dense_layer {
    int in, out, relu;
    float *w, *b;   /* [out][in], [out] */
    float *gw, *gb; /* gradients summed over the step's micro-batches */
    float *vw, *vb; /* momentum */
} dense_layer;

/* One stage's part of the model and its working memory. */
typedef struct stage_model {
    int nlayers; /* layers this stage owns */
    dense_layer layers[MODEL_MAX_LAYERS];
    int rows; /* rows of one micro-batch */
    int mbs;  /* micro-batches a step */
    /* act[mb][k]: input of layer k (k = 0) or output of layer k-1 */
    float *act[MODEL_MAX_MB][MODEL_MAX_LAYERS + 1];
    float *grad[2]; /* backward scratch between layers */
    float *dx;      /* gradient of the stage's input */
    /* split backward (model_enable_split): g[mb][k], the gradient of layer
     * k's pre-activation, kept from backward_input for backward_weight */
    float *g[MODEL_MAX_MB][MODEL_MAX_LAYERS + 1];
} stage_model;

/* dims[0..n]: the widths of the whole network (input, hidden..., classes).
 * Builds the layers [l0, l1) with weights from `seed` (He initialisation),
 * the same on every rank. Returns 0, or -1 when out of memory. */
int model_init(stage_model *m, const int *dims, int n, int l0, int l1, int rows, int mbs,
               uint64_t seed);
void model_free(stage_model *m);

/* Forward of micro-batch mb from input x (copied in); returns the output. */
const float *model_forward(stage_model *m, int mb, const float *x, int rows);
/* Backward of micro-batch mb given the gradient of its output; returns the
 * gradient of its input (NULL when want_dx is 0). */
const float *model_backward(stage_model *m, int mb, const float *dy, int rows, int want_dx);
/* The backward split in two (zero-bubble schedules): model_enable_split()
 * allocates what the split keeps (0, or -1 when out of memory);
 * model_backward_input() computes only the input gradient (as
 * model_backward's result) and keeps each layer's pre-activation gradient;
 * model_backward_weight() later adds the weight gradients of mb from them. */
int model_enable_split(stage_model *m);
const float *model_backward_input(stage_model *m, int mb, const float *dy, int rows, int want_dx);
void model_backward_weight(stage_model *m, int mb, int rows);
/* SGD with momentum over the summed gradients, which are then zeroed. */
void model_sgd(stage_model *m, float lr, float momentum);
/* One kept version of a stage's weights (weight stashing, for the
 * schedules without a flush): model_stash_keep() copies the current
 * weights in (0, or -1 when out of memory); model_stash_swap() exchanges
 * them with the model's, so that a second call undoes the first. */
typedef struct weight_stash {
    int set;
    uint64_t version;
    float *w[MODEL_MAX_LAYERS], *b[MODEL_MAX_LAYERS];
} weight_stash;
int model_stash_keep(const stage_model *m, weight_stash *st, uint64_t version);
void model_stash_swap(stage_model *m, weight_stash *st);
void model_stash_free(weight_stash *st);

/* Threads the BLAS may use for each call (OpenBLAS; a no-op elsewhere).
 * Stages already run side by side, one thread or process each: BLAS
 * threads on top of them oversubscribe the cores. */
void model_set_blas_threads(int n);

/* Softmax cross-entropy of logits [rows][classes] against labels: returns
 * the summed loss, writes dlogits scaled by 1/batch, counts correct. */
double softmax_xent(const float *logits, const uint8_t *labels, int rows, int classes, int batch,
                    float *dlogits, int *correct);

#endif
