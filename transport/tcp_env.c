/* TCP transport settings: the options spec and EPIPE_* variables, and the
 * rendezvous read from the environment of mpirun, srun, torchrun or ours. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/parse.h"
#include "tcp_impl.h"

/* Applies one setting; `what` names its origin for the error message. */
static int set_opt(epipe_tcp_opts *o, const char *key, const char *val, const char *what)
{
    int64_t v;
    if (!strcmp(key, "timeout_ms") || !strcmp(key, "init_timeout_ms") ||
        !strcmp(key, "heartbeat_ms")) {
        int64_t lo = key[0] == 'h' ? 0 : 1;
        if (epipe_parse_i64(val, lo, 86400000, &v))
            return epipe_fail(EPIPE_EINVAL,
                              "tcp: %s = '%s' is not a number of ms in %lld..86400000", what, val,
                              (long long)lo);
        if (key[0] == 't')
            o->timeout_ms = v;
        else if (key[0] == 'i')
            o->init_timeout_ms = v;
        else
            o->heartbeat_ms = v;
    } else if (!strcmp(key, "spin_us")) {
        if (epipe_parse_i64(val, 0, 1000000, &v))
            return epipe_fail(EPIPE_EINVAL, "tcp: %s = '%s' is not a number of us in 0..1000000",
                              what, val);
        o->spin_us = v;
    } else if (!strcmp(key, "streams")) {
        if (epipe_parse_i64(val, 1, EPIPE_TCP_MAX_STREAMS, &v))
            return epipe_fail(EPIPE_EINVAL, "tcp: %s = '%s' is not a stream count in 1..%d", what,
                              val, EPIPE_TCP_MAX_STREAMS);
        o->streams = (unsigned)v;
    } else if (!strcmp(key, "topology")) {
        if (strcmp(val, "pipeline") && strcmp(val, "mesh"))
            return epipe_fail(EPIPE_EINVAL, "tcp: %s = '%s': use pipeline or mesh", what, val);
        o->mesh = !strcmp(val, "mesh");
    } else if (!strcmp(key, "listen_addr") || !strcmp(key, "ifname")) {
        char *dst = key[0] == 'l' ? o->listen_addr : o->ifname;
        if (strlen(val) >= EPIPE_TCP_ADDR_MAX)
            return epipe_fail(EPIPE_EINVAL, "tcp: %s = '%s' is longer than %d characters", what,
                              val, EPIPE_TCP_ADDR_MAX - 1);
        strcpy(dst, val);
    } else if (!strcmp(key, "key_file")) {
        if (strlen(val) >= sizeof o->key_file)
            return epipe_fail(EPIPE_EINVAL, "tcp: %s is longer than %zu characters", what,
                              sizeof o->key_file - 1);
        strcpy(o->key_file, val);
    } else if (!strcmp(key, "job")) {
        if (!*val || strlen(val) >= sizeof o->job)
            return epipe_fail(EPIPE_EINVAL,
                              "tcp: %s = '%.40s' is not a job name of 1..%zu "
                              "characters",
                              what, val, sizeof o->job - 1);
        strcpy(o->job, val);
        snprintf(o->job_source, sizeof o->job_source, "%s", what);
    } else if (!strcmp(key, "encrypt")) { /* crypt: encrypted links */
        if (strcmp(val, "0") && strcmp(val, "1"))
            return epipe_fail(EPIPE_EINVAL, "tcp: %s = '%s': use 0 or 1", what, val);
        o->encrypt = val[0] == '1';
    } else {
        /* every transport also takes max_message, buffer_cache and trace,
         * which epipe_comm_create consumes before the options come here */
        return epipe_fail(EPIPE_EINVAL,
                          "tcp: unknown option '%s' (known: timeout_ms, init_timeout_ms, "
                          "heartbeat_ms, spin_us, streams, topology, listen_addr, ifname, "
                          "key_file, encrypt, job, max_message, buffer_cache, trace)",
                          key);
    }
    return EPIPE_OK;
}

int epipe_tcp_opts_parse(epipe_tcp_opts *o, const char *spec)
{
    static const struct {
        const char *var, *key;
    } vars[] = {
        {"EPIPE_TIMEOUT_MS", "timeout_ms"},
        {"EPIPE_INIT_TIMEOUT_MS", "init_timeout_ms"},
        {"EPIPE_HEARTBEAT_MS", "heartbeat_ms"},
        {"EPIPE_TCP_STREAMS", "streams"},
        {"EPIPE_TCP_TOPOLOGY", "topology"},
        {"EPIPE_LISTEN_ADDR", "listen_addr"},
        {"EPIPE_SPIN_US", "spin_us"},
        {"EPIPE_IFNAME", "ifname"},
        {"EPIPE_AUTH_KEY_FILE", "key_file"},
        {"EPIPE_ENCRYPT", "encrypt"},
        {"EPIPE_JOB_ID", "job"},
    };
    memset(o, 0, sizeof *o);
    o->timeout_ms = 30000;
    o->init_timeout_ms = 120000;
    o->streams = 1;
    o->spin_us = 50;
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i].var);
        int rc;
        if (v && *v && (rc = set_opt(o, vars[i].key, v, vars[i].var)))
            return rc;
    }
    /* The launchers' own job ids, where EPIPE_JOB_ID is not set: the same on
     * every rank of one job. torchrun's is "none" unless a run id is given. */
    static const char *const job_vars[] = {"TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"};
    for (size_t i = 0; i < 2 && !o->job[0]; i++) {
        const char *v = getenv(job_vars[i]);
        if (v && *v && strcmp(v, "none") && strlen(v) < sizeof o->job) {
            strcpy(o->job, v);
            snprintf(o->job_source, sizeof o->job_source, "%s", job_vars[i]);
        }
    }
    if (!spec || !*spec)
        return EPIPE_OK;
    char buf[1024];
    if (strlen(spec) >= sizeof buf)
        return epipe_fail(EPIPE_EINVAL, "tcp: options spec is longer than %zu characters",
                          sizeof buf - 1);
    strcpy(buf, spec);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq)
            return epipe_fail(EPIPE_EINVAL, "tcp: option '%s' has no value (use key=value)", item);
        *eq = '\0';
        char what[96];
        snprintf(what, sizeof what, "option %s", item);
        int rc = set_opt(o, item, eq + 1, what);
        if (rc)
            return rc;
    }
    return EPIPE_OK;
}

uint64_t epipe_tcp_job_tag(const epipe_tcp_opts *o)
{
    if (!o->job[0])
        return 0;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (const char *p = o->job; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    return h ? h : 1;
}

/* ---- rendezvous from the environment ----------------------------------- */

static const char *env(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

static int env_uint(const char *name, unsigned long max, unsigned long *out)
{
    const char *v = env(name);
    int64_t x;
    if (epipe_parse_i64(v, 0, (int64_t)max, &x))
        return epipe_fail(EPIPE_EINVAL, "rendezvous: %s = '%s' is not a number in 0..%lu", name, v,
                          max);
    *out = (unsigned long)x;
    return EPIPE_OK;
}

/* Compares two runs of decimal digits by value, leading zeros aside. */
static int digits_cmp(const char *a, size_t na, const char *b, size_t nb)
{
    while (na > 1 && *a == '0')
        a++, na--;
    while (nb > 1 && *b == '0')
        b++, nb--;
    if (na != nb)
        return na < nb ? -1 : 1;
    return memcmp(a, b, na);
}

/* One bracket of a node list, *pp just past its '[': numbers and ascending
 * ranges, comma-separated ("03-05,9"). The first number goes to out[*o...]
 * when out is given. Leaves *pp past the ']'. */
static int node_ranges(const char *list, const char **pp, char *out, size_t *o, size_t cap)
{
    const char *p = *pp;
    for (int item = 0;; item++) {
        const char *lo = p;
        while (*p >= '0' && *p <= '9')
            p++;
        size_t nlo = (size_t)(p - lo);
        if (nlo && *p == '-') {
            const char *hi = ++p;
            while (*p >= '0' && *p <= '9')
                p++;
            size_t nhi = (size_t)(p - hi);
            if (nhi && digits_cmp(lo, nlo, hi, nhi) > 0)
                return epipe_fail(EPIPE_EINVAL,
                                  "rendezvous: the range %.*s-%.*s in node list '%s' runs "
                                  "backwards",
                                  (int)nlo, lo, (int)nhi, hi, list);
            if (!nhi)
                nlo = 0;
        }
        if (!nlo || (*p != ',' && *p != ']'))
            return epipe_fail(EPIPE_EINVAL,
                              *p ? "rendezvous: a range in node list '%s' is not numbers"
                                 : "rendezvous: unbalanced '[' in node list '%s'",
                              list);
        if (item == 0 && out) {
            if (*o + nlo >= cap)
                return epipe_fail(EPIPE_EINVAL, "rendezvous: host name in '%s' too long", list);
            memcpy(out + *o, lo, nlo);
            *o += nlo;
        }
        if (*p++ == ']') {
            *pp = p;
            return EPIPE_OK;
        }
    }
}

int epipe_rdv_first_host(const char *list, char *out, size_t cap)
{
    /* The whole list is checked; the first host is the first entry with the
     * first number of each bracket: "pre[03-05,9]suf,b1" -> "pre03suf". */
    if (!list || !*list)
        return epipe_fail(EPIPE_EINVAL, "rendezvous: empty Slurm node list");
    if (cap == 0)
        return epipe_fail(EPIPE_EINVAL, "rendezvous: no room for a host name");
    size_t o = 0;
    int first = 1, entry_empty = 1;
    for (const char *p = list;;) {
        if (*p == ',' || *p == '\0') {
            if (entry_empty)
                return epipe_fail(EPIPE_EINVAL, "rendezvous: an empty entry in node list '%s'",
                                  list);
            if (!*p)
                break;
            first = 0;
            entry_empty = 1;
            p++;
            continue;
        }
        entry_empty = 0;
        if (*p == '[') {
            p++;
            int rc = node_ranges(list, &p, first ? out : NULL, &o, cap);
            if (rc)
                return rc;
            continue;
        }
        if (*p == ']')
            return epipe_fail(EPIPE_EINVAL, "rendezvous: unbalanced ']' in node list '%s'", list);
        if ((unsigned char)*p <= ' ' || *p == 0x7f)
            return epipe_fail(EPIPE_EINVAL,
                              "rendezvous: a space or control character in node list '%s'", list);
        if (first) {
            if (o + 1 >= cap)
                return epipe_fail(EPIPE_EINVAL, "rendezvous: host name in '%s' too long", list);
            out[o++] = *p;
        }
        p++;
    }
    out[o] = '\0';
    /* The resolver would take "1" or "10" for an IPv4 address. */
    if (strspn(out, "0123456789") == o)
        return epipe_fail(EPIPE_EINVAL,
                          "rendezvous: the first host '%s' of node list '%s' is a number, not a "
                          "host name",
                          out, list);
    return EPIPE_OK;
}

int epipe_rdv_env_parse(epipe_rdv_env *e)
{
    static const struct {
        const char *rank, *size, *name;
    } sources[] = {
        {"EPIPE_RANK", "EPIPE_WORLD_SIZE", "EPIPE_RANK/EPIPE_WORLD_SIZE"},
        {"RANK", "WORLD_SIZE", "torchrun (RANK/WORLD_SIZE)"},
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI (OMPI_COMM_WORLD_RANK/SIZE)"},
        {"PMI_RANK", "PMI_SIZE", "PMI (PMI_RANK/PMI_SIZE)"},
        {"SLURM_PROCID", "SLURM_NTASKS", "Slurm (SLURM_PROCID/SLURM_NTASKS)"},
    };
    enum { SRC_EPIPE, SRC_TORCH, SRC_OMPI, SRC_PMI, SRC_SLURM, NSRC };
    memset(e, 0, sizeof *e);
    int src = -1;
    for (int i = 0; i < NSRC && src < 0; i++) {
        int hr = env(sources[i].rank) != NULL, hs = env(sources[i].size) != NULL;
        if (hr != hs)
            return epipe_fail(EPIPE_EINVAL, "rendezvous: %s is set but %s is not",
                              hr ? sources[i].rank : sources[i].size,
                              hr ? sources[i].size : sources[i].rank);
        if (hr)
            src = i;
    }
    if (src < 0)
        return epipe_fail(EPIPE_EINVAL,
                          "rendezvous: no rank in the environment: set EPIPE_RANK and "
                          "EPIPE_WORLD_SIZE, or start under epipe-run, torchrun, mpirun or srun");
    unsigned long rank, size;
    int rc;
    if ((rc = env_uint(sources[src].rank, 1048575, &rank)) ||
        (rc = env_uint(sources[src].size, 1048576, &size)))
        return rc;
    if (size == 0 || rank >= size)
        return epipe_fail(EPIPE_EINVAL, "rendezvous: %s = %lu is not below %s = %lu",
                          sources[src].rank, rank, sources[src].size, size);
    e->rank = (unsigned)rank;
    e->size = (unsigned)size;
    snprintf(e->source, sizeof e->source, "%s", sources[src].name);

    /* The master's address. */
    const char *a;
    if ((a = env("EPIPE_MASTER_ADDR"))) {
        snprintf(e->addr_source, sizeof e->addr_source, "EPIPE_MASTER_ADDR");
    } else if (src == SRC_TORCH || (src == SRC_EPIPE && env("MASTER_ADDR"))) {
        if (!(a = env("MASTER_ADDR")))
            return epipe_fail(EPIPE_EINVAL,
                              "rendezvous: rank from %s but neither EPIPE_MASTER_ADDR "
                              "nor MASTER_ADDR is set",
                              e->source);
        snprintf(e->addr_source, sizeof e->addr_source, "MASTER_ADDR");
    } else if (src == SRC_EPIPE) {
        a = "127.0.0.1";
        snprintf(e->addr_source, sizeof e->addr_source, "local host (default)");
    } else {
        /* MPI, PMI and Slurm give no master: one node means the local host. */
        const char *local = src == SRC_OMPI  ? env("OMPI_COMM_WORLD_LOCAL_SIZE")
                            : src == SRC_PMI ? env("MPI_LOCALNRANKS")
                                             : NULL;
        const char *nnodes = env("SLURM_JOB_NUM_NODES") ? env("SLURM_JOB_NUM_NODES")
                                                        : env("SLURM_NNODES");
        const char *nodelist = env("SLURM_JOB_NODELIST") ? env("SLURM_JOB_NODELIST")
                                                         : env("SLURM_NODELIST");
        int single = -1; /* unknown */
        if (local)
            single = strtoul(local, NULL, 10) == size;
        else if (nnodes)
            single = strtoul(nnodes, NULL, 10) == 1;
        if (single == 1 || (single < 0 && !nodelist)) {
            a = "127.0.0.1";
            snprintf(e->addr_source, sizeof e->addr_source, "local host (%s)",
                     single == 1 ? "single-node run" : "assumed single-node run");
        } else if (nodelist) {
            if ((rc = epipe_rdv_first_host(nodelist, e->master_addr, sizeof e->master_addr)))
                return rc;
            a = NULL;
            snprintf(e->addr_source, sizeof e->addr_source, "first host of SLURM_JOB_NODELIST");
        } else {
            return epipe_fail(EPIPE_EINVAL,
                              "rendezvous: a multi-node run (%s) gives no master "
                              "address: set EPIPE_MASTER_ADDR to rank 0's host",
                              e->source);
        }
    }
    if (a) {
        if (strlen(a) >= sizeof e->master_addr)
            return epipe_fail(EPIPE_EINVAL, "rendezvous: master address '%s' is too long", a);
        strcpy(e->master_addr, a);
    }

    /* The master's port. torchrun's agent already listens on MASTER_PORT. */
    unsigned long port;
    if (env("EPIPE_MASTER_PORT")) {
        if ((rc = env_uint("EPIPE_MASTER_PORT", 65535, &port)))
            return rc;
        snprintf(e->port_source, sizeof e->port_source, "EPIPE_MASTER_PORT");
    } else if (env("MASTER_PORT") && src == SRC_TORCH) {
        if ((rc = env_uint("MASTER_PORT", 65534, &port)))
            return rc;
        port += 1;
        snprintf(e->port_source, sizeof e->port_source,
                 "MASTER_PORT+1 (torchrun's agent holds MASTER_PORT)");
    } else if ((src == SRC_SLURM || src == SRC_PMI || src == SRC_OMPI) && env("SLURM_JOB_ID")) {
        /* inside a Slurm job, whoever started the ranks (srun, srun
         * --mpi=pmi2, mpirun): jobs sharing a node get different ports */
        unsigned long job;
        if ((rc = env_uint("SLURM_JOB_ID", 0xFFFFFFFFul, &job)))
            return rc;
        port = EPIPE_TCP_DEFAULT_PORT + job % 1000;
        snprintf(e->port_source, sizeof e->port_source, "%d + SLURM_JOB_ID %% 1000",
                 EPIPE_TCP_DEFAULT_PORT);
    } else {
        port = EPIPE_TCP_DEFAULT_PORT;
        snprintf(e->port_source, sizeof e->port_source, "default %d", EPIPE_TCP_DEFAULT_PORT);
    }
    if (port == 0)
        return epipe_fail(EPIPE_EINVAL, "rendezvous: master port 0 (from %s) is not a port",
                          e->port_source);
    e->master_port = (unsigned)port;
    return EPIPE_OK;
}
