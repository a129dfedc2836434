/* Stand-ins for the poweriter and insert codecs in a build without
 * OpenBLAS/LAPACKE (meson -Dblas=disabled, or auto when they are missing).
 * The names stay registered and their specs parse as usual, so a spec
 * that works elsewhere fails here with EPIPE_ENOTSUP naming the missing
 * library, never "unknown codec". The parameter tables repeat the keys and
 * bounds of poweriter/poweriter.c and insert/insert.c; keep them in step. */
#include <math.h>

#include "../lib/codec/codec_impl.h"

static const char *const nb_fp[] = {"fp32", "fp16", NULL};
static const char *const nb_kind[] = {"conv", "linear", NULL};

static const epipe_param_desc nb_poweriter_params[] = {
    {.key = "rank", .kind = EPIPE_PARAM_INT, .min = 1, .max = 256, .def = NAN},
    {.key = "iters", .kind = EPIPE_PARAM_INT, .min = 1, .max = 64, .def = 1},
    {.key = "warm", .kind = EPIPE_PARAM_CHOICE, .def = 1, .choices = epipe_param_bool},
    {.key = "factors", .kind = EPIPE_PARAM_CHOICE, .def = 0, .choices = nb_fp},
    {.key = "shared",
     .kind = EPIPE_PARAM_CHOICE,
     .def = 0,
     .choices = epipe_param_bool,
     .quiet_default = 1},
};

static const epipe_param_desc nb_insert_params[] = {
    {.key = "kind", .kind = EPIPE_PARAM_CHOICE, .min = 0, .max = 1, .def = 0, .choices = nb_kind},
    {.key = "out", .kind = EPIPE_PARAM_INT, .min = 0, .max = 16777215.0, .def = 0},
    {.key = "ratio", .kind = EPIPE_PARAM_REAL, .min = 0, .max = 1, .def = 0},
    {.key = "kernel", .kind = EPIPE_PARAM_INT, .min = 1, .max = 64, .def = NAN},
    {.key = "in", .kind = EPIPE_PARAM_INT, .min = 0, .max = 16777215.0, .def = 0},
    {.key = "seed", .kind = EPIPE_PARAM_INT, .min = 0, .max = 4294967295.0, .def = 1},
    {.key = "code", .kind = EPIPE_PARAM_CHOICE, .min = 0, .max = 1, .def = 0, .choices = nb_fp},
};

static int nb_configure(epipe_codec *c)
{
    return epipe_codec_fail(c, EPIPE_ENOTSUP,
                            "%s: this libepipe was built without OpenBLAS/LAPACKE (meson "
                            "option blas), which the %s codec needs; rebuild with "
                            "libopenblas-dev and liblapacke-dev installed",
                            c->ops->name, c->ops->name);
}

const epipe_codec_ops epipe_codec_poweriter = {
    .name = "poweriter",
    .id = EPIPE_CODEC_ID_POWERITER,
    .params = nb_poweriter_params,
    .nparams = sizeof nb_poweriter_params / sizeof nb_poweriter_params[0],
    .configure = nb_configure,
};

const epipe_codec_ops epipe_codec_insert = {
    .name = "insert",
    .id = EPIPE_CODEC_ID_INSERT,
    .params = nb_insert_params,
    .nparams = sizeof nb_insert_params / sizeof nb_insert_params[0],
    .configure = nb_configure,
};
