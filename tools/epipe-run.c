/* epipe-run: starts N ranks of a program on this machine with the rendezvous
 * environment set, prefixes their output, and stops them all when one fails. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

#define MAX_RANKS 1024
#define LINE_MAX_BYTES 65536

struct stream {
    int fd;  /* read end, -1 at EOF */
    int out; /* 1 or 2 */
    char *buf;
    size_t len;
};

/* A rank's process leads its own process group, whose id is its pid. The
 * launcher notes a rank's exit without reaping it (waitid WNOWAIT) and reaps
 * it only when the launcher ends: while its zombie stays, its pid cannot be
 * taken by another process, so signalling the group reaches no one else. */
struct child {
    pid_t pid;
    int running;   /* until its exit is noted */
    int status;    /* exit code, or 128+signal */
    int signaled;  /* the status is a signal's */
    unsigned left; /* live processes in its group after it exited (count_left) */
    struct stream s[2];
};

static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int e = errno;
    unsigned char c = (unsigned char)sig;
    ssize_t n = write(sig_pipe[1], &c, 1);
    (void)n;
    errno = e;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-run -n N [--grace SECONDS] [--] PROGRAM [ARGS...]\n"
               "Starts N copies of PROGRAM on this machine as ranks 0..N-1 of one libepipe group:\n"
               "each gets EPIPE_RANK, EPIPE_WORLD_SIZE, EPIPE_LOCAL_RANK, EPIPE_LOCAL_WORLD_SIZE,\n"
               "EPIPE_JOB_ID (a random name, unless set), EPIPE_MASTER_ADDR=127.0.0.1 and\n"
               "EPIPE_MASTER_PORT (a free port, unless EPIPE_MASTER_PORT is set). Output lines\n"
               "are prefixed \"[rank R] \"; stdin is /dev/null. SIGINT and SIGTERM are forwarded.\n"
               "When a rank fails (non-zero exit or a signal), the others get GRACE seconds\n"
               "(default 2) to end on their own, then SIGTERM, then SIGKILL 5 s later; epipe-run\n"
               "exits with the first failing rank's status (128+signal for a signal), else 0; a\n"
               "rank killed by a signal within 0.2 s after another failed counts as the first.\n"
               "Each rank leads its own process group. Processes left in it after its rank\n"
               "exits get SIGTERM once every rank has exited, then SIGKILL 5 s later. If\n"
               "epipe-run itself is killed, the kernel sends each rank SIGTERM.\n");
}

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) ||
        getsockname(fd, (struct sockaddr *)&a, &len)) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        p += w, n -= (size_t)w;
    }
}

/* Writes "[rank R] line\n" in one call, so lines of ranks never mix. */
static void emit(int out, unsigned rank, const char *line, size_t n)
{
    char pre[32];
    int p = snprintf(pre, sizeof pre, "[rank %u] ", rank);
    char *buf = malloc((size_t)p + n + 1);
    if (!buf)
        return;
    memcpy(buf, pre, (size_t)p);
    memcpy(buf + p, line, n);
    buf[(size_t)p + n] = '\n';
    write_all(out, buf, (size_t)p + n + 1);
    free(buf);
}

static void drain(struct stream *s, unsigned rank)
{
    char tmp[16384];
    ssize_t n = read(s->fd, tmp, sizeof tmp);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n <= 0) { /* EOF: flush a last line without newline */
        if (s->len)
            emit(s->out, rank, s->buf, s->len);
        s->len = 0;
        close(s->fd);
        s->fd = -1;
        return;
    }
    for (ssize_t i = 0; i < n; i++) {
        if (tmp[i] == '\n' || s->len == LINE_MAX_BYTES) {
            emit(s->out, rank, s->buf, s->len);
            s->len = 0;
            if (tmp[i] == '\n')
                continue;
        }
        s->buf[s->len++] = tmp[i];
    }
}

/* Signals every rank's process group: the rank and what it started there. */
static void signal_all(struct child *ch, unsigned n, int sig)
{
    for (unsigned r = 0; r < n; r++)
        if (ch[r].pid > 0 && kill(-ch[r].pid, sig) != 0)
            kill(ch[r].pid, sig);
}

/* Counts the live processes in the process groups of ranks that have exited,
 * in total and in each rank's .left (from /proc: Linux only; none where /proc
 * cannot be read). */
static unsigned count_left(struct child *ch, unsigned n)
{
    unsigned left = 0;
    for (unsigned r = 0; r < n; r++)
        ch[r].left = 0;
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char path[300], buf[512];
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue; /* it has just ended */
        ssize_t k = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (k <= 0)
            continue;
        buf[k] = 0;
        /* "pid (name) state ppid pgrp ...": the name may hold anything. */
        const char *p = strrchr(buf, ')');
        char state;
        int ppid, pgrp;
        if (!p || sscanf(p + 1, " %c %d %d", &state, &ppid, &pgrp) != 3 || state == 'Z' ||
            state == 'X')
            continue;
        for (unsigned r = 0; r < n; r++)
            if (ch[r].pid == pgrp && !ch[r].running) {
                left++;
                ch[r].left++;
                break;
            }
    }
    closedir(d);
    return left;
}

/* "rank 3 left 2 processes running", "ranks 0, 1 and 2 left 3 processes ..." */
static void report_left(const struct child *ch, unsigned n, unsigned left)
{
    char who[160];
    size_t len = 0;
    unsigned ranks = 0, named = 0;
    for (unsigned r = 0; r < n; r++)
        ranks += ch[r].left > 0;
    for (unsigned r = 0; r < n && len + 24 < sizeof who; r++) {
        if (!ch[r].left)
            continue;
        named++;
        const char *sep = named == 1 ? "" : named == ranks ? " and " : ", ";
        len += (size_t)snprintf(who + len, sizeof who - len, "%s%u", sep, r);
    }
    if (named < ranks)
        snprintf(who + len, sizeof who - len, " and %u more", ranks - named);
    fprintf(stderr,
            "epipe-run: rank%s %s left %u process%s running; sending SIGTERM, then SIGKILL in "
            "5 s\n",
            ranks == 1 ? "" : "s", who, left, left == 1 ? "" : "es");
}

/* The end of a failed start: kills and reaps the ranks already started. */
static int abandon_start(struct child *ch, unsigned started)
{
    signal_all(ch, started, SIGKILL);
    for (unsigned r = 0; r < started; r++)
        waitpid(ch[r].pid, NULL, 0);
    return 1;
}

int main(int argc, char **argv)
{
    long n = 0;
    double grace = 2.0;
    enum { O_GRACE = 256 };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"np", required_argument, NULL, 'n'},
        {"grace", required_argument, NULL, O_GRACE},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    /* "+": options end at the program's name (or "--"); its own options are
     * its business. */
    while ((opt = getopt_long(argc, argv, "+:hn:", longopts, NULL)) != -1) {
        char name[64];
        char *end;
        switch (opt) {
        case 'h': usage(stdout); return 0;
        case 'n':
            n = strtol(optarg, &end, 10);
            if (*end || n < 1 || n > MAX_RANKS) {
                fprintf(stderr, "epipe-run: %s %s: give a count in 1..%d\n",
                        epipe_cli_optname(argv, name, sizeof name), optarg, MAX_RANKS);
                return 2;
            }
            break;
        case O_GRACE:
            if (epipe_cli_real("epipe-run", "--grace", optarg, 0, 3600, &grace))
                return 2;
            break;
        default: /* ':' or '?' */
            epipe_cli_bad_option("epipe-run", argv, opt);
            usage(stderr);
            return 2;
        }
    }
    int i = optind;
    if (n < 1 || i >= argc) {
        usage(stderr);
        return 2;
    }
    char **prog = argv + i;

    char port[16];
    const char *env_port = getenv("EPIPE_MASTER_PORT");
    if (env_port && *env_port) {
        char *end;
        errno = 0;
        long p = strtol(env_port, &end, 10);
        if (*end || errno || p < 1 || p > 65535 || env_port[0] == '+' || env_port[0] == ' ') {
            fprintf(stderr, "epipe-run: EPIPE_MASTER_PORT='%s' is not a port number in 1..65535\n",
                    env_port);
            return 2;
        }
        snprintf(port, sizeof port, "%ld", p);
    } else {
        int p = free_port();
        if (p < 0) {
            fprintf(stderr, "epipe-run: cannot find a free port on 127.0.0.1: %s\n",
                    strerror(errno));
            return 1;
        }
        snprintf(port, sizeof port, "%d", p);
    }

    /* Two pipes per rank stay open here, which the common soft limit of 1024
     * files would stop at about 500 ranks: raise it as far as the hard limit
     * lets, and give each rank the limit it would have had. */
    struct rlimit files_given;
    rlim_t files_needed = 2 * (rlim_t)n + 16; /* + stdio, the signal pipe, a rank's 4 */
    if (getrlimit(RLIMIT_NOFILE, &files_given) == 0 && files_given.rlim_cur != RLIM_INFINITY &&
        files_given.rlim_cur < files_needed) {
        struct rlimit raised = files_given;
        if (raised.rlim_max != RLIM_INFINITY && raised.rlim_max < files_needed) {
            fprintf(stderr,
                    "epipe-run: %ld ranks need %llu open files here, but the hard limit is %llu "
                    "(ulimit -Hn); raise it or start fewer ranks\n",
                    n, (unsigned long long)files_needed, (unsigned long long)raised.rlim_max);
            return 1;
        }
        raised.rlim_cur = files_needed;
        if (setrlimit(RLIMIT_NOFILE, &raised)) {
            perror("epipe-run: setrlimit(RLIMIT_NOFILE)");
            return 1;
        }
    }

    /* The job's name for the rendezvous, unless the caller gave one: a rank
     * of another job that reaches this job's port is refused. */
    char job[48];
    {
        unsigned long long r[2] = {0, 0};
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (fd < 0 || read(fd, r, sizeof r) != (ssize_t)sizeof r)
            r[0] = (unsigned long long)getpid() << 32 ^ (unsigned long long)(now() * 1e9);
        if (fd >= 0)
            close(fd);
        snprintf(job, sizeof job, "epipe-run-%016llx%016llx", r[0], r[1]);
    }

    if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK)) {
        perror("epipe-run: pipe");
        return 1;
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    /* Everything the launcher needs is allocated before a rank starts, so a
     * failure here leaves nothing running. */
    struct child *ch = calloc((size_t)n, sizeof *ch);
    struct pollfd *pf = calloc(2 * (size_t)n + 1, sizeof *pf);
    struct stream **ps = calloc(2 * (size_t)n + 1, sizeof *ps);
    unsigned *prank = calloc(2 * (size_t)n + 1, sizeof *prank);
    int out_of_memory = !ch || !pf || !ps || !prank;
    for (unsigned r = 0; !out_of_memory && r < (unsigned)n; r++)
        for (int k = 0; k < 2; k++) {
            ch[r].s[k].fd = -1;
            ch[r].s[k].buf = malloc(LINE_MAX_BYTES + 1);
            out_of_memory |= !ch[r].s[k].buf;
        }
    if (out_of_memory) {
        fprintf(stderr, "epipe-run: out of memory for %ld ranks\n", n);
        return 1;
    }
    char nbuf[16];
    snprintf(nbuf, sizeof nbuf, "%ld", n);
    pid_t launcher = getpid();
    for (unsigned r = 0; r < (unsigned)n; r++) {
        int pout[2], perr[2];
        if (pipe2(pout, O_CLOEXEC)) {
            perror("epipe-run: pipe");
            return abandon_start(ch, r);
        }
        if (pipe2(perr, O_CLOEXEC)) {
            perror("epipe-run: pipe");
            close(pout[0]);
            close(pout[1]);
            return abandon_start(ch, r);
        }
        pid_t pid = fork();
        if (pid < 0) {
            perror("epipe-run: fork");
            return abandon_start(ch, r);
        }
        if (pid == 0) {
            char rb[16];
            snprintf(rb, sizeof rb, "%u", r);
            /* A launcher killed outright (SIGKILL, the OOM killer) cannot stop
             * its ranks: the kernel sends them SIGTERM instead of leaving them
             * running without anyone reading their output. */
            if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != launcher)
                _exit(127); /* the launcher is already gone */
            setpgid(0, 0);  /* the terminal's Ctrl-C reaches epipe-run, which forwards it */
            signal(SIGINT, SIG_DFL);
            signal(SIGTERM, SIG_DFL);
            signal(SIGCHLD, SIG_DFL);
            signal(SIGPIPE, SIG_DFL);
            setrlimit(RLIMIT_NOFILE, &files_given); /* lowering the soft limit never fails */
            int null = open("/dev/null", O_RDONLY);
            if (null >= 0)
                dup2(null, 0);
            dup2(pout[1], 1);
            dup2(perr[1], 2);
            setenv("EPIPE_RANK", rb, 1);
            setenv("EPIPE_LOCAL_RANK", rb, 1);
            setenv("EPIPE_WORLD_SIZE", nbuf, 1);
            setenv("EPIPE_LOCAL_WORLD_SIZE", nbuf, 1);
            setenv("EPIPE_MASTER_ADDR", "127.0.0.1", 1);
            setenv("EPIPE_MASTER_PORT", port, 1);
            setenv("EPIPE_JOB_ID", job, 0); /* one job: a rendezvous refuses another's ranks */
            execvp(prog[0], prog);
            fprintf(stderr, "epipe-run: cannot run %s: %s\n", prog[0], strerror(errno));
            _exit(127);
        }
        setpgid(pid, pid); /* as the child does: no race with a signal */
        close(pout[1]);
        close(perr[1]);
        ch[r].pid = pid;
        ch[r].running = 1;
        for (int k = 0; k < 2; k++) {
            ch[r].s[k].fd = k ? perr[0] : pout[0];
            ch[r].s[k].out = k ? 2 : 1;
        }
    }

    int first_fail = -1, exit_code = 0, interrupted = 0, first_signaled = 0, signals_sent = 0;
    double first_fail_at = 0;
    unsigned running = (unsigned)n;
    double term_at = 0, kill_at = 0, killed_at = 0, all_done_at = 0;
    int leftovers = 0, exits_to_note = 1;
    for (;;) {
        unsigned np = 1, open_streams = 0;
        pf[0] = (struct pollfd){.fd = sig_pipe[0], .events = POLLIN};
        for (unsigned r = 0; r < (unsigned)n; r++)
            for (int k = 0; k < 2; k++)
                if (ch[r].s[k].fd >= 0) {
                    pf[np] = (struct pollfd){.fd = ch[r].s[k].fd, .events = POLLIN};
                    ps[np] = &ch[r].s[k];
                    prank[np++] = r;
                    open_streams++;
                }
        double t = now();
        if (running == 0) {
            term_at = 0; /* no rank is left to stop */
            if (!all_done_at) {
                all_done_at = t;
                unsigned left = count_left(ch, (unsigned)n);
                if (left) {
                    report_left(ch, (unsigned)n, left);
                    signal_all(ch, (unsigned)n, SIGTERM);
                    leftovers = 1;
                    if (!kill_at || kill_at > t + 5.0)
                        kill_at = t + 5.0;
                }
            } else if (leftovers && count_left(ch, (unsigned)n) == 0) {
                leftovers = 0;
                all_done_at = t;
            }
            /* Output still held open by a process outside the groups: give it a
             * moment, no more; nor wait on a process SIGKILL does not end. */
            if (!leftovers && (open_streams == 0 || t - all_done_at > 0.5))
                break;
            if (killed_at && t - killed_at > 1.0)
                break;
        }
        if (term_at && t >= term_at) {
            signals_sent = 1;
            signal_all(ch, (unsigned)n, SIGTERM);
            term_at = 0;
            if (!kill_at || kill_at > t + 5.0)
                kill_at = t + 5.0;
        }
        if (kill_at && t >= kill_at) {
            signal_all(ch, (unsigned)n, SIGKILL);
            kill_at = 0;
            killed_at = t;
        }
        double next = 1.0;
        if (term_at && term_at - t < next)
            next = term_at - t;
        if (kill_at && kill_at - t < next)
            next = kill_at - t;
        if (running == 0 && next > 0.1)
            next = 0.1;
        int rc = poll(pf, np, (int)(next * 1000) + 1);
        if (rc < 0 && errno != EINTR)
            break;
        if (rc == 0)
            exits_to_note = 1; /* as well as on SIGCHLD, in case a byte was lost */
        if (rc > 0 && (pf[0].revents & POLLIN)) {
            unsigned char sigs[64];
            ssize_t k = read(sig_pipe[0], sigs, sizeof sigs);
            for (ssize_t j = 0; j < k; j++) {
                if (sigs[j] == SIGCHLD) {
                    exits_to_note = 1;
                    continue;
                }
                if (interrupted++) { /* a second interrupt: no more waiting */
                    signal_all(ch, (unsigned)n, SIGKILL);
                    killed_at = now();
                } else {
                    fprintf(stderr, "epipe-run: %s: forwarding it to the ranks\n",
                            strsignal(sigs[j]));
                    signal_all(ch, (unsigned)n, sigs[j]);
                    signals_sent = 1;
                    kill_at = now() + 5.0;
                }
            }
        }
        for (unsigned j = 1; rc > 0 && j < np; j++)
            if (pf[j].revents & (POLLIN | POLLHUP | POLLERR))
                drain(ps[j], prank[j]);
        for (unsigned r = 0; exits_to_note && r < (unsigned)n; r++) {
            siginfo_t si;
            si.si_pid = 0;
            if (!ch[r].running ||
                waitid(P_PID, (id_t)ch[r].pid, &si, WEXITED | WNOHANG | WNOWAIT) != 0 ||
                si.si_pid != ch[r].pid)
                continue;
            ch[r].running = 0;
            running--;
            ch[r].signaled = si.si_code != CLD_EXITED;
            ch[r].status = ch[r].signaled ? 128 + si.si_status : si.si_status;
            /* A rank killed by a signal just after another rank failed is
             * the likely cause (the other saw it go): it counts as first. */
            int cause = first_fail >= 0 && ch[r].signaled && !first_signaled && !signals_sent &&
                        now() - first_fail_at < 0.2;
            if (cause) {
                fprintf(stderr,
                        "epipe-run: rank %u was killed by signal %d (%s) as rank %d "
                        "failed; taking it as the cause\n",
                        r, si.si_status, strsignal(si.si_status), first_fail);
                first_fail = (int)r;
                first_signaled = 1;
                exit_code = ch[r].status;
            }
            if (ch[r].status != 0 && first_fail < 0) {
                first_fail_at = now();
                first_signaled = ch[r].signaled;
                first_fail = (int)r;
                exit_code = ch[r].status;
                if (ch[r].signaled)
                    fprintf(stderr, "epipe-run: rank %u was killed by signal %d (%s)%s\n", r,
                            si.si_status, strsignal(si.si_status),
                            running ? "; stopping the other ranks" : "");
                else
                    fprintf(stderr, "epipe-run: rank %u exited with status %d%s\n", r, ch[r].status,
                            running ? "; stopping the other ranks" : "");
                if (running && !interrupted)
                    term_at = now() + grace;
            }
        }
        exits_to_note = 0;
    }
    if (running) /* poll failed: nothing more can be watched */
        signal_all(ch, (unsigned)n, SIGKILL);
    for (unsigned r = 0; r < (unsigned)n; r++) {
        waitpid(ch[r].pid, NULL, 0);
        for (int k = 0; k < 2; k++) {
            if (ch[r].s[k].fd >= 0)
                close(ch[r].s[k].fd);
            free(ch[r].s[k].buf);
        }
    }
    free(ch);
    free(pf);
    free(ps);
    free(prank);
    return exit_code;
}
