/* The libFuzzer entry point every target in this folder defines; the
 * replay driver (replay.c) calls it on saved inputs without libFuzzer. */
#ifndef EPIPE_FUZZ_H
#define EPIPE_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
