/* libepipe: version, status codes, error reporting and the export macro.
 * Every other public header includes this one. */
#ifndef EPIPE_COMMON_H
#define EPIPE_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* EPIPE_API marks the functions libepipe exports; everything else in the
 * shared library is hidden (built with -fvisibility=hidden and a version
 * script, lib/libepipe.map). */
#if defined(EPIPE_BUILDING_LIBRARY) && defined(__GNUC__)
#define EPIPE_API __attribute__((visibility("default")))
#else
#define EPIPE_API
#endif

/* EPIPE_EXPERIMENTAL marks exported calls whose signature or behaviour may
 * still change in a minor release (0.x to 0.y) without a new soname, for
 * example the trainable-codec calls (epipe/codec.h,
 * epipe_stage_codec_sgd_step), the schedule simulator (epipe_sim_*,
 * epipe/schedule.h), the planner (epipe/plan.h) and the CUDA stream calls;
 * each such declaration says EPIPE_EXPERIMENTAL. It exports them
 * as EPIPE_API does, in the same version node of lib/libepipe.map, so a
 * binary binds to them as to any other call; docs/api.md says more. */
#define EPIPE_EXPERIMENTAL EPIPE_API

#define EPIPE_VERSION_MAJOR 0
#define EPIPE_VERSION_MINOR 1
#define EPIPE_VERSION_PATCH 0
/* One integer that sorts like the version: 10000*major + 100*minor + patch. */
#define EPIPE_VERSION_NUMBER                                                                       \
    (EPIPE_VERSION_MAJOR * 10000 + EPIPE_VERSION_MINOR * 100 + EPIPE_VERSION_PATCH)

/* The version of the library actually loaded, in the EPIPE_VERSION_NUMBER
 * encoding; compare with the macro to detect a header/library mismatch.
 * Thread-safe. */
EPIPE_API unsigned epipe_version(void);
/* The same as a static string, "0.1.0". Thread-safe; never NULL. */
EPIPE_API const char *epipe_version_string(void);

/* Status codes. EPIPE_OK is zero; every error is negative, so callers may
 * test `if (rc < 0)`. New codes may be added at the end of the list. */
typedef enum epipe_status {
    EPIPE_OK = 0,
    EPIPE_EINVAL = -1,     /* bad argument or spec: the message names it */
    EPIPE_ENOMEM = -2,     /* an allocation failed */
    EPIPE_ENOTSUP = -3,    /* valid, but not built or not supported here */
    EPIPE_ENOSPC = -4,     /* output buffer too small */
    EPIPE_ETRUNC = -5,     /* message or payload shorter than it says */
    EPIPE_ETOOBIG = -6,    /* message larger than the configured limit */
    EPIPE_EVERSION = -7,   /* wire version this library does not speak */
    EPIPE_ECHECKSUM = -8,  /* checksum mismatch: the bytes were corrupted */
    EPIPE_EOVERFLOW = -9,  /* a shape or size overflows what can be held */
    EPIPE_EPROTO = -10,    /* malformed message or payload */
    EPIPE_ESTATE = -11,    /* call not valid in the handle's current state */
    EPIPE_EPEER = -12,     /* a peer died, disconnected or misbehaved */
    EPIPE_ETIMEDOUT = -13, /* an operation did not complete in time */
    EPIPE_EIO = -14,       /* an operating-system I/O call failed */
    EPIPE_EAUTH = -15,     /* authentication failed */
    EPIPE_EINTERNAL = -16, /* a bug in libepipe: please report it */
    EPIPE_ECALLBACK = -17  /* a host callback returned an error */
} epipe_status;

/* A static English sentence for a status ("invalid argument"). Unknown
 * values give "unknown status". Thread-safe; never NULL. */
EPIPE_API const char *epipe_strerror(int status);
/* The status's enumerator name ("EPIPE_EINVAL"). Thread-safe; never NULL. */
EPIPE_API const char *epipe_status_name(int status);

/* The detailed message of the last call that failed on the calling thread
 * ("sortquant: key 'bits' = 40 is out of range 2..16"), or "" if none has.
 * Every failing libepipe call sets it, with or without a handle. The string
 * belongs to the thread and stays valid until that thread's next libepipe
 * call; copy it if you need it longer. */
EPIPE_API const char *epipe_last_error(void);

/* ---- Log messages ---------------------------------------------------------
 *
 * libepipe logs rarely: errors and warnings by default, more with
 * EPIPE_LOG=info or debug, optionally only some subsystems with
 * EPIPE_LOG_SUBSYS=tcp,rendezvous,... (warnings and errors always pass; the
 * subsystems: auth, codec, comm, inproc, rdma, rendezvous, stage, tcp, trace; an
 * unknown value of either variable is named in a warning on stderr).
 * Those variables are read once, at the first message, and decide which
 * messages exist; the callback below decides where they go (by default one
 * line "epipe[rank N] subsys: message" on stderr). */
typedef enum epipe_log_level {
    EPIPE_LOG_ERROR = 0,
    EPIPE_LOG_WARN = 1,
    EPIPE_LOG_INFO = 2,
    EPIPE_LOG_DEBUG = 3
} epipe_log_level;

/* Receives one message: its level (epipe_log_level), its subsystem ("tcp",
 * "rendezvous", "inproc", "comm", "trace", ...; a static string), the rank
 * of the communicator it concerns or -1 when none does, and the text
 * without prefix or newline. `message` is valid only during the call. */
typedef void (*epipe_log_fn)(void *user, int level, const char *subsys, int rank,
                             const char *message);

/* Routes every message of this process to fn(user, ...) instead of stderr;
 * fn NULL restores stderr. (A line written to a stderr that is a pipe
 * nobody reads any more is dropped without raising SIGPIPE.) Process-wide by design, as NCCL's: messages
 * also come from where no handle exists (the environment, a rendezvous
 * before its communicator is made), and one host has one log. Messages name
 * their rank and, where there is one, their group (inproc) or peer address
 * (tcp), so a host running several pipelines can tell them apart.
 *
 * Thread safety: fn is called from whichever thread logs, library threads
 * included (TCP progress threads, codec workers), possibly concurrently, so
 * it must be thread-safe. It must not call epipe_set_log_callback(); it may
 * call other libepipe functions. epipe_set_log_callback() may be called
 * from any thread at any time: once it returns, the previous callback is
 * not running and will not be called again, so its `user` may be freed. */
EPIPE_API void epipe_set_log_callback(epipe_log_fn fn, void *user);

#ifdef __cplusplus
}
#endif
#endif /* EPIPE_COMMON_H */
