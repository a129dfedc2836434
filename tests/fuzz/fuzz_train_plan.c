/* Fuzz target: epipe-train's plan file parser (examples/train/plan_file.c).
 * Any bytes either fail with a message or give a plan whose written form
 * parses back to the same plan. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../examples/train/plan_file.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct train_plan p, q;
    char err[300] = "";
    if (train_plan_parse((const char *)data, size, &p, err, sizeof err)) {
        if (!err[0])
            abort();
        return 0;
    }
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f || train_plan_write(f, &p))
        abort();
    fclose(f);
    if (train_plan_parse(buf, len, &q, err, sizeof err) || memcmp(&p, &q, sizeof p) != 0)
        abort();
    free(buf);
    return 0;
}
