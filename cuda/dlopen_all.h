/* Opening a CUDA library at run time (cuBLAS, cuDNN): the first of a list
 * of names that dlopen finds and that has every symbol wanted. The
 * callers list their functions once, in an X-macro of (field, symbol),
 * and get a table typed from the library's own header with decltype. */
#ifndef EPIPE_CUDA_DLOPEN_ALL_H
#define EPIPE_CUDA_DLOPEN_ALL_H

#include <dlfcn.h>
#include <stddef.h>

/* Opens the first of names[0..nnames) that has all of syms[0..nsyms),
 * storing each symbol's address through slots[i]; the handle, or NULL
 * when none has them all (the slots then hold nothing to call). */
static inline void *epipe_cuda_dlopen_all(const char *const *names, size_t nnames,
                                          const char *const *syms, void **const *slots,
                                          size_t nsyms)
{
    for (size_t i = 0; i < nnames; i++) {
        void *so = names[i] ? dlopen(names[i], RTLD_NOW | RTLD_LOCAL) : NULL;
        if (!so)
            continue;
        size_t found = 0;
        for (size_t k = 0; k < nsyms; k++)
            found += (*slots[k] = dlsym(so, syms[k])) != NULL;
        if (found == nsyms)
            return so;
        dlclose(so);
    }
    return NULL;
}

/* For a table declared from an X-macro FNS of (field, symbol): its
 * fields (typed from the library's header) and its symbol names. */
#define EPIPE_CUDA_FIELD(name, sym) decltype(&sym) name;
#define EPIPE_CUDA_SYM(name, sym) #sym,

#endif
