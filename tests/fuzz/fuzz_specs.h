/* The codec configurations the fuzz targets and the corpus generator use:
 * one or more per codec, covering every payload layout. */
#ifndef EPIPE_FUZZ_SPECS_H
#define EPIPE_FUZZ_SPECS_H

static const char *const fuzz_specs[] = {
    "none",
    "cast:dtype=fp16",
    "cast:dtype=bf16",
};
#define FUZZ_NSPECS (sizeof fuzz_specs / sizeof fuzz_specs[0])

#endif
