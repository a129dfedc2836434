/* libepipe communicators: the ranks of one pipeline and the transport that
 * joins them. The stage runtime (epipe/stage.h) moves its tensors over one. */
#ifndef EPIPE_COMM_H
#define EPIPE_COMM_H

#include <epipe/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque communicator: this rank's end of a group of `size` ranks.
 *
 * Thread safety: one thread at a time may call functions on a handle,
 * except epipe_comm_abort() and epipe_comm_set_interrupt(), which any
 * thread may call at any time (to wake or stop a stage blocked in a
 * receive). Transports may run threads of their
 * own; they end when the handle is destroyed.
 *
 * Fork: a child made by fork() cannot use its parent's communicators (it
 * has none of their threads). At the fork the child closes its copies of
 * their sockets, so that a parent that dies is seen gone by its peers at
 * once even while children it forked live on (a data loader's workers).
 * In the child, calls on such a handle return EPIPE_ESTATE (stages over it
 * fail with it) and epipe_comm_destroy() releases nothing and returns at
 * once; the parent keeps using and destroys it as before. */
typedef struct epipe_comm epipe_comm;

/* ---- Creating a communicator by transport name (docs/transport.md) ------
 *
 * The one way to make a communicator; the functions after it are thin
 * wrappers kept for existing code. Joins a group of `size` ranks as rank
 * `rank` over the transport named `transport`:
 *   "tcp"     processes, over TCP: rank 0 listens on master_addr:master_port,
 *             the others connect to it (see epipe_comm_create_tcp below).
 *   "inproc"  ranks that are threads of this process, each calling
 *             epipe_comm_create() from its own thread with the same
 *             options "group=NAME": the call blocks until all `size` ranks
 *             of group NAME have joined (or init_timeout_ms passes:
 *             EPIPE_ETIMEDOUT naming the missing ranks). master_addr and
 *             master_port are ignored. A group of one needs no name. Once a
 *             group is complete its name may be used again by a new group.
 *   "rdma"    processes: the TCP rendezvous, then tensors over RDMA verbs
 *             (docs/rdma.md); libibverbs is opened at run time.
 *             EPIPE_ENOTSUP names what is missing (verbs library, device,
 *             active port, a neighbour that cannot), or says the transport
 *             is not built into this libepipe.
 *   "auto", NULL or ""   EPIPE_TRANSPORT from the environment if set, else,
 *             when size > 1 or the ranks come from the environment, tcp
 *             with RDMA to every neighbour where both ends have an active
 *             device (the log says which and why), else inproc.
 * An explicit name other than "auto" wins over EPIPE_TRANSPORT.
 *
 * Rendezvous from the environment: rank = size = EPIPE_COMM_FROM_ENV reads
 * rank, size and (when master_addr is NULL or "") the master's address and
 * port as epipe_comm_create_from_env() does.
 *
 * `options` is NULL, "" or comma-separated key=value pairs. The keys every
 * transport takes (environment variable in brackets):
 *   timeout_ms=N       how long a receive waits, and (tcp) how long a silent
 *                      peer is trusted, ms, 1..86400000 (EPIPE_TIMEOUT_MS;
 *                      30000)
 *   init_timeout_ms=N  the whole rendezvous (EPIPE_INIT_TIMEOUT_MS; 120000)
 *   spin_us=N          a receive busy-waits this long before it sleeps,
 *                      0..1000000 (EPIPE_SPIN_US; 50)
 *   max_message=N      largest message accepted, bytes (EPIPE_MAX_MESSAGE;
 *                      2^32)
 *   buffer_cache=N     bytes of message buffers this handle keeps for reuse,
 *                      0 (none) .. 2^40 (EPIPE_BUFFER_CACHE; 512 MiB)
 *   trace=PATH         stages on this communicator write their Chrome trace
 *                      to PATH (wins over EPIPE_TRACE; docs/trace.md)
 *   group=NAME         inproc only: the group to join, 1..63 characters
 * and tcp takes its own keys, listed at epipe_comm_create_tcp(); a key no
 * transport knows is EPIPE_EINVAL naming it.
 *
 * Precedence of every setting, lowest first, resolved in one place:
 *   built-in default < environment variable < options string
 *   < epipe_comm_set_param() at run time (this handle, from then on)
 *   < epipe_stage_set_param(EPIPE_STAGE_TIMEOUT_MS) (that stage's receives
 *     only; a stage that has not set it follows the communicator's value).
 *
 * Returns EPIPE_OK and *out, owned by the caller (epipe_comm_destroy); on
 * error *out is NULL and the message names the cause: EPIPE_EINVAL (bad
 * argument, option, transport name, or an inproc group whose ranks disagree
 * on its size or repeat a rank), EPIPE_ENOTSUP (rdma that cannot run
 * here), EPIPE_ETIMEDOUT, and
 * the transport's own errors (epipe_comm_create_tcp). Thread-safe; blocks
 * until the group is formed. */
#define EPIPE_COMM_FROM_ENV (~0u)
EPIPE_API int epipe_comm_create(epipe_comm **out, const char *transport, unsigned rank,
                                unsigned size, const char *master_addr, unsigned master_port,
                                const char *options);

/* Creates `size` communicators joined in this process, comms[0..size-1]
 * with ranks 0..size-1, for stages that run as threads of one process.
 * Messages are framed, checksummed and parsed exactly as over a network.
 * Each handle is destroyed on its own (by the thread that uses it, when it
 * is done). Settings come from the defaults and the environment, as for
 * epipe_comm_create() with no options. Returns EPIPE_OK, EPIPE_EINVAL for
 * size 0 or above 1024 or a bad environment variable, or EPIPE_ENOMEM; on
 * error every comms[i] is NULL. Thread-safe. */
EPIPE_API int epipe_comm_create_inproc(epipe_comm **comms, unsigned size);

/* ---- TCP (docs/transport.md) --------------------------------------------
 *
 * Joins a group of `size` processes over TCP as rank `rank`. Rank 0 listens
 * on master_addr:master_port; every other rank connects to it, registers
 * the address it listens on, receives the table of all ranks, and then
 * connects to its pipeline neighbours (rank r to r-1; every rank keeps its
 * connection to rank 0 for control). A progress thread per handle moves
 * messages while the host computes; it ends in epipe_comm_destroy().
 * size 1 makes a group of one with no sockets.
 *
 * The same as epipe_comm_create(out, "tcp", ...): settings follow its one
 * precedence (default < environment < options < epipe_comm_set_param).
 * `options` is NULL, "" or a spec of comma-separated key=value pairs; each
 * key may also come from an environment variable (in brackets), which the
 * spec overrides:
 *   timeout_ms=N       receives and peer liveness, ms (EPIPE_TIMEOUT_MS;
 *                      default 30000; later EPIPE_COMM_TIMEOUT_MS changes it)
 *   init_timeout_ms=N  the whole rendezvous (EPIPE_INIT_TIMEOUT_MS; 120000)
 *   heartbeat_ms=N     idle heartbeat period (EPIPE_HEARTBEAT_MS; default
 *                      timeout/4, at most 5000)
 *   spin_us=N          receives busy-wait this long before they sleep
 *                      (EPIPE_SPIN_US; default 50; see EPIPE_COMM_SPIN_US)
 *   streams=N          connections per neighbour, 1..8 (EPIPE_TCP_STREAMS; 1)
 *   topology=pipeline|mesh   mesh joins every pair (EPIPE_TCP_TOPOLOGY)
 *   listen_addr=A      the address this rank listens on and advertises
 *                      (EPIPE_LISTEN_ADDR); else the address of ifname
 *   ifname=I           (EPIPE_IFNAME); else the address this host uses to
 *                      reach the master (rank 0: the master address if it
 *                      is a loopback one, else every address)
 *   key_file=PATH      authenticate every connection with the pre-shared
 *                      key in PATH (EPIPE_AUTH_KEY_FILE); off by default
 *   encrypt=0|1        encrypt and authenticate every message after the
 *                      handshake (EPIPE_ENCRYPT; 0): AES-256-GCM, or
 *                      ChaCha20-Poly1305 where a side lacks AES-NI, with
 *                      per-connection keys from key_file, which it needs;
 *                      every rank must agree (docs/transport.md)
 *   job=NAME           the job this rank belongs to, 1..127 characters
 *                      (EPIPE_JOB_ID; else TORCHELASTIC_RUN_ID unless
 *                      "none", else SLURM_JOB_ID; else none): a rank of
 *                      another job that reaches this job's ports is
 *                      refused alone (EPIPE_EINVAL on its side)
 *
 * Blocks until every rank has joined or init_timeout_ms has passed. Returns
 * EPIPE_OK and *out, owned by the caller (epipe_comm_destroy), or an error
 * with *out NULL and a message (epipe_last_error) that says which rank,
 * address and cause:
 *   EPIPE_EINVAL    bad argument or option (encrypt=1 without key_file); a
 *                   rank that says another world size; two processes with
 *                   the same rank; a peer whose encrypt setting differs
 *   EPIPE_EIO       cannot listen (the port is in use, the address is not
 *                   this host's), or the name lookup failed for now (the
 *                   resolver's EAI_AGAIN or a system error; a name that
 *                   does not resolve is EPIPE_EINVAL)
 *   EPIPE_ETIMEDOUT the master is unreachable, or a rank did not join, in time
 *   EPIPE_EVERSION  a peer speaks another wire version
 *   EPIPE_EAUTH     a peer lacks the key or holds another one
 *   EPIPE_ENOTSUP   key_file or encrypt=1 in a build without libsodium
 *   EPIPE_ENOMEM
 * Thread-safe (each call makes its own handle).
 *
 * After creation, failures surface in receives: a peer that exits without
 * epipe_comm_destroy, is killed, or falls silent for timeout_ms makes
 * receives from it return EPIPE_EPEER (EPIPE_ETIMEDOUT when it fell
 * silent); a peer whose message fails its checks (its CRC, its header)
 * is cut off and receives from it return that check's status:
 * EPIPE_ECHECKSUM, EPIPE_EPROTO or EPIPE_ETOOBIG (EPIPE_EAUTH for an
 * encrypted record whose tag fails); the message names it. A rank that
 * finds no memory for a message arriving from a peer has lost it and
 * cannot go on: its receives and sends return EPIPE_ENOMEM ("rank R: no
 * memory for a N-byte message from rank P"), and its peers get
 * EPIPE_EPEER naming it, as after epipe_comm_abort(). */
EPIPE_API int epipe_comm_create_tcp(epipe_comm **out, unsigned rank, unsigned size,
                                    const char *master_addr, unsigned master_port,
                                    const char *options);

/* epipe_comm_create(out, "tcp", EPIPE_COMM_FROM_ENV, EPIPE_COMM_FROM_ENV,
 * NULL, 0, options): rank, size and master taken from the environment,
 * first found wins (docs/transport.md has the details):
 *   1. EPIPE_RANK, EPIPE_WORLD_SIZE (what epipe-run sets);
 *   2. torchrun: RANK, WORLD_SIZE;
 *   3. Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE;
 *   4. PMI (MPICH, Intel MPI): PMI_RANK, PMI_SIZE;
 *   5. Slurm: SLURM_PROCID, SLURM_NTASKS.
 * Master address: EPIPE_MASTER_ADDR, else MASTER_ADDR (torchrun), else the
 * local host for single-node runs, else Slurm's first host of
 * SLURM_JOB_NODELIST. Master port: EPIPE_MASTER_PORT, else MASTER_PORT+1
 * under torchrun (its agent holds MASTER_PORT), else 29600 (+ SLURM_JOB_ID
 * % 1000 under Slurm). With EPIPE_LOG=info the log says which source won.
 * Errors: those of epipe_comm_create_tcp(), and EPIPE_EINVAL when no rank
 * is found or a variable is malformed (the message names it). */
EPIPE_API int epipe_comm_create_from_env(epipe_comm **out, const char *options);

/* Leaves the group and frees the handle. A peer still waiting for a message
 * from this rank gets EPIPE_EPEER. Over TCP, messages already sent are
 * flushed first, however long a slow link takes, as long as bytes keep
 * moving: it gives up (and logs it) only after the timeout, at most 10 s,
 * without progress. Then the peers are told this rank left. NULL is a
 * no-op. */
EPIPE_API void epipe_comm_destroy(epipe_comm *comm);

/* Marks this rank as failed: its blocked and later receives, and its peers'
 * receives from it, return EPIPE_EPEER. Use it to stop a pipeline when one
 * stage hits an error the others cannot see. Any thread; never waits for
 * the network or a peer. It takes the handle's lock briefly, so it is not
 * async-signal-safe: from a signal handler (Ctrl-C), set a flag or write
 * to a pipe that a thread of yours watches, and call it from there. */
EPIPE_API void epipe_comm_abort(epipe_comm *comm);

/* Experimental (EPIPE_EXPERIMENTAL, docs/api.md). Sets a check that a
 * receive of this handle (a stage's too) calls while it waits: from the
 * waiting thread, with no lock of libepipe held, every 100 ms of the wait
 * (however often messages for other receives wake it; a spin, at most
 * EPIPE_COMM_SPIN_US, can put a call off). A nonzero return ends that
 * receive with EPIPE_ECALLBACK ("the host's interrupt check stopped the
 * wait for ..."), and the communicator is left as it was: the message,
 * when it comes, waits for a later receive. A stage's op-stream receive
 * can then be called again; inside epipe_stage_step the step is lost and
 * the stage aborts its communicator, as for a failing callback. For hosts
 * whose signal handler only sets a flag that their code reads when a call
 * returns (Python's, for Ctrl-C): the Python binding sets one on every
 * handle it makes. A NULL check removes it; arg is passed to check.
 * The check may call epipe_comm_abort() on the handle, never
 * epipe_comm_destroy(). A receive reads the check and arg when it calls
 * it, so after a call that replaces them the old pair may still be called
 * once by a receive already calling it: keep both valid as long as the
 * handle. EPIPE_EINVAL for a NULL comm. */
EPIPE_EXPERIMENTAL int epipe_comm_set_interrupt(epipe_comm *comm, int (*check)(void *arg),
                                                void *arg);

EPIPE_API unsigned epipe_comm_rank(const epipe_comm *comm);
EPIPE_API unsigned epipe_comm_size(const epipe_comm *comm);
/* The transport's name: "inproc", "tcp" or "rdma" (never "auto"). Static
 * string. */
EPIPE_API const char *epipe_comm_transport(const epipe_comm *comm);
/* The message of the last failing call on this handle, or "". */
EPIPE_API const char *epipe_comm_last_error(const epipe_comm *comm);

/* Knobs, set with epipe_comm_set_param(): the last and strongest of the
 * precedence at epipe_comm_create() (default < environment < options). */
typedef enum epipe_comm_param {
    /* How long a receive waits before EPIPE_ETIMEDOUT, in milliseconds,
     * 1 .. 86400000; over tcp also how long a silent peer is trusted.
     * Default: timeout_ms / EPIPE_TIMEOUT_MS, else 30000. Stages follow the
     * new value from their next receive unless they set
     * EPIPE_STAGE_TIMEOUT_MS themselves. */
    EPIPE_COMM_TIMEOUT_MS = 1,
    /* The largest message accepted from a peer, in bytes, 4096 .. 2^40.
     * Larger ones are refused with EPIPE_ETOOBIG. Default 2^32. */
    EPIPE_COMM_MAX_MESSAGE = 2,
    /* How long a receive busy-waits for its message before it sleeps, in
     * microseconds, 0 .. 1000000. Spinning saves a thread wake-up (several
     * microseconds) on each message that arrives within it, at the cost of
     * a busy core while it waits. Default: spin_us / EPIPE_SPIN_US, else
     * 50. */
    EPIPE_COMM_SPIN_US = 3,
    /* The most bytes of message buffers this handle keeps for reuse
     * (at most 32 buffers of 256 KiB or more), 0 .. 2^40; 0 keeps none.
     * Every handle has a cache of its own, shared with no other handle;
     * lowering the cap frees what it holds. Once a stage on the handle
     * has a CUDA device (EPIPE_STAGE_CUDA_DEVICE), the buffers it may keep
     * (up to half the cap each) are pinned host memory: at most 32 of them
     * and the cap in bytes alive at once, cached or in messages; a message
     * past that gets a malloc'd buffer. Default: buffer_cache /
     * EPIPE_BUFFER_CACHE, else 512 MiB. */
    EPIPE_COMM_BUFFER_CACHE = 4
} epipe_comm_param;

/* EPIPE_EINVAL for an unknown knob or a value out of range. Any thread may
 * set EPIPE_COMM_TIMEOUT_MS and EPIPE_COMM_SPIN_US while a receive runs
 * (the next wait uses the new value). */
EPIPE_API int epipe_comm_set_param(epipe_comm *comm, epipe_comm_param param, int64_t value);
/* The knob's current value into *value; EPIPE_EINVAL for an unknown knob
 * or a NULL argument. Thread-safe. */
EPIPE_API int epipe_comm_get_param(const epipe_comm *comm, epipe_comm_param param, int64_t *value);

#ifdef __cplusplus
}
#endif
#endif /* EPIPE_COMM_H */
