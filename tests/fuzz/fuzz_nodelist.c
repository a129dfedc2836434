/* Fuzz target: Slurm's node-list parser (epipe_rdv_first_host). Byte 0 is
 * the output capacity; the rest the list. The host fits, is plain and is not
 * a number. */
#include <stdlib.h>
#include <string.h>

#include "../../transport/tcp_impl.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    size_t cap = data[0];
    char *list = malloc(size), *out = malloc(cap); /* exact: a byte past it is a bug */
    if (!list || (!out && cap)) {
        free(list);
        free(out);
        return 0;
    }
    memcpy(list, data + 1, size - 1);
    list[size - 1] = '\0';
    epipe_clear_error();
    int rc = epipe_rdv_first_host(list, out, cap);
    if (rc != EPIPE_OK) {
        if (rc != EPIPE_EINVAL || epipe_last_error()[0] == '\0')
            abort();
    } else {
        size_t n = strnlen(out, cap);
        if (n == 0 || n >= cap || strpbrk(out, ",[] \t") || strspn(out, "0123456789") == n)
            abort();
    }
    free(list);
    free(out);
    return 0;
}
