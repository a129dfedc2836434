/* The codec registry: every codec this build has, found by the name a spec
 * gives or by the id a payload carries. */
#include <string.h>

#include "core.h"
#include "cuda_core.h"

static const epipe_codec_ops *const registry[] = {
    &epipe_codec_none,      &epipe_codec_cast,   &epipe_codec_quant,
    &epipe_codec_sortquant, &epipe_codec_kmeans, &epipe_codec_topk,
    &epipe_codec_poweriter, &epipe_codec_insert, &epipe_codec_chain,
};
#define NREGISTRY (sizeof registry / sizeof registry[0])

/* Codecs with a syntax of their own (the chain's "a|b") are not named. */
static int named(const epipe_codec_ops *ops)
{
    return ops->parse == NULL;
}

const epipe_codec_ops *epipe_codec_find(const char *name, size_t len)
{
    for (size_t i = 0; i < NREGISTRY; i++)
        if (named(registry[i]) && strlen(registry[i]->name) == len &&
            memcmp(registry[i]->name, name, len) == 0)
            return registry[i];
    return NULL;
}

const char *epipe_codec_name_of_id(unsigned id)
{
    for (size_t i = 0; i < NREGISTRY; i++)
        if ((unsigned)registry[i]->id == id)
            return registry[i]->name;
    return "unknown";
}

const epipe_codec_backend *epipe_codec_backend_of(const epipe_codec_ops *ops,
                                                  epipe_codec_device dev)
{
    switch (dev) {
    case EPIPE_CODEC_DEV_CPU: return ops->cpu;
    case EPIPE_CODEC_DEV_CUDA:
        /* The CUDA module's table for ops->id, once it is loaded
         * (lib/codec/cuda.c opens it on the first CUDA tensor). */
        return epipe_codec_cuda_loaded_backend(ops);
    }
    return NULL;
}

int epipe_codec_unknown(const char *name, size_t len)
{
    char known[160] = "";
    for (size_t i = 0; i < NREGISTRY; i++) {
        if (!named(registry[i]))
            continue;
        if (known[0])
            strncat(known, ", ", sizeof known - strlen(known) - 1);
        strncat(known, registry[i]->name, sizeof known - strlen(known) - 1);
    }
    return epipe_fail(EPIPE_EINVAL, "unknown codec '%.*s' (known: %s)", (int)len, name, known);
}
