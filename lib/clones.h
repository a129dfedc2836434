/* EPIPE_CLONES: build a hot kernel twice, for AVX2 and for the baseline,
 * and let the loader pick one (an ifunc). Both clones give the same bits:
 * neither enables FMA, and the build passes -ffp-contract=off.
 *
 * Left out under ThreadSanitizer: GCC instruments the ifunc resolvers it
 * makes for target_clones, and the loader runs them before the sanitizer's
 * runtime is set up, so every program linked with the library crashed
 * before main. */
#ifndef EPIPE_CLONES_H
#define EPIPE_CLONES_H

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) &&       \
    !defined(__SANITIZE_THREAD__)
#define EPIPE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define EPIPE_CLONES
#endif

#endif
