/* The codec configurations the fuzz targets and the corpus generator use:
 * one or more per codec, covering every payload layout. */
#ifndef EPIPE_FUZZ_SPECS_H
#define EPIPE_FUZZ_SPECS_H

#include <string.h>

static const char *const fuzz_specs[] = {
    "none",
    "cast:dtype=fp16",
    "cast:dtype=bf16",
    "kmeans:bits=1",
    "kmeans:bits=5",
    "topk:ratio=0.1",
    "topk:ratio=1",
    "quant:bits=1",
    "quant:bits=7",
    "quant:bits=16",
    "sortquant:bits=8",
    "sortquant:bits=5,split=2,mode=exact",
    "sortquant:bits=16",
    "sortquant:bits=11,split=5,mode=sample",
    "insert:kind=linear,out=2",
    "insert:kind=linear,ratio=0.5,code=fp16",
    "insert:kind=linear,out=2|quant:bits=5",
    "poweriter:rank=1",
    "poweriter:rank=3,factors=fp16",
    /* appended, so that the earlier seeds keep their indices */
    "sortquant:bits=8,mode=sample",
    "sortquant:bits=5,split=2,mode=fit",
    /* one range per row (fuzz_spec_per_row) */
    "quant:bits=3,rows=1",
    /* one range per run of 4 values of a row (also decoded into rows) */
    "quant:bits=3,group=4",
};
#define FUZZ_NSPECS (sizeof fuzz_specs / sizeof fuzz_specs[0])

/* fuzz_codec_decode decodes a per-row spec (one range per row, or per run
 * of a row) into a [1 + byte 2 % 8, n / rows] tensor, every other into [n];
 * make_corpus writes its seeds to match. */
static inline int fuzz_spec_per_row(const char *spec)
{
    return strstr(spec, "rows=1") != NULL || strstr(spec, "group=") != NULL;
}

#endif
