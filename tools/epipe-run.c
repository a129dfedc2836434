/* epipe-run: starts N ranks of a program on this machine with the rendezvous
 * environment set, prefixes their output, and stops them all when one fails. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

struct child {
    pid_t pid;
    int running;
    int status; /* exit code, or 128+signal */
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
    fprintf(
        f, "usage: epipe-run -n N [--grace SECONDS] [--] PROGRAM [ARGS...]\n"
           "Starts N copies of PROGRAM on this machine as ranks 0..N-1 of one libepipe group:\n"
           "each gets EPIPE_RANK, EPIPE_WORLD_SIZE, EPIPE_LOCAL_RANK, EPIPE_MASTER_ADDR=127.0.0.1\n"
           "and EPIPE_MASTER_PORT (a free port, unless EPIPE_MASTER_PORT is set). Output lines\n"
           "are prefixed \"[rank R] \"; stdin is /dev/null. SIGINT and SIGTERM are forwarded.\n"
           "When a rank fails (non-zero exit or a signal), the others get GRACE seconds\n"
           "(default 2) to end on their own, then SIGTERM, then SIGKILL 5 s later; epipe-run\n"
           "exits with the first failing rank's status (128+signal for a signal), else 0; a\n"
           "rank killed by a signal within 0.2 s after another failed counts as the first.\n");
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

static void signal_all(struct child *ch, unsigned n, int sig)
{
    for (unsigned r = 0; r < n; r++)
        if (ch[r].running && kill(-ch[r].pid, sig) != 0) /* its process group */
            kill(ch[r].pid, sig);
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
        snprintf(port, sizeof port, "%s", env_port);
    } else {
        int p = free_port();
        if (p < 0) {
            fprintf(stderr, "epipe-run: cannot find a free port on 127.0.0.1: %s\n",
                    strerror(errno));
            return 1;
        }
        snprintf(port, sizeof port, "%d", p);
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

    struct child *ch = calloc((size_t)n, sizeof *ch);
    if (!ch)
        return 1;
    char nbuf[16];
    snprintf(nbuf, sizeof nbuf, "%ld", n);
    for (unsigned r = 0; r < (unsigned)n; r++) {
        int pout[2], perr[2];
        if (pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC)) {
            perror("epipe-run: pipe");
            signal_all(ch, r, SIGKILL);
            return 1;
        }
        pid_t pid = fork();
        if (pid < 0) {
            perror("epipe-run: fork");
            signal_all(ch, r, SIGKILL);
            return 1;
        }
        if (pid == 0) {
            char rb[16];
            snprintf(rb, sizeof rb, "%u", r);
            setpgid(0, 0); /* the terminal's Ctrl-C reaches epipe-run, which forwards it */
            signal(SIGINT, SIG_DFL);
            signal(SIGTERM, SIG_DFL);
            signal(SIGCHLD, SIG_DFL);
            signal(SIGPIPE, SIG_DFL);
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
            ch[r].s[k].buf = malloc(LINE_MAX_BYTES + 1);
        }
    }

    int first_fail = -1, exit_code = 0, interrupted = 0, first_signaled = 0, signals_sent = 0;
    double first_fail_at = 0;
    unsigned running = (unsigned)n;
    double term_at = 0, kill_at = 0, all_done_at = 0;
    struct pollfd *pf = calloc(2 * (size_t)n + 1, sizeof *pf);
    struct stream **ps = calloc(2 * (size_t)n + 1, sizeof *ps);
    unsigned *prank = calloc(2 * (size_t)n + 1, sizeof *prank);
    if (!pf || !ps || !prank)
        return 1;
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
            if (!all_done_at)
                all_done_at = t;
            /* Output still held open by a grandchild: give it a moment, no more. */
            if (open_streams == 0 || t - all_done_at > 0.5)
                break;
        }
        if (term_at && t >= term_at) {
            signals_sent = 1;
            signal_all(ch, (unsigned)n, SIGTERM);
            term_at = 0;
            kill_at = t + 5.0;
        }
        if (kill_at && t >= kill_at) {
            signal_all(ch, (unsigned)n, SIGKILL);
            kill_at = 0;
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
        if (rc > 0 && (pf[0].revents & POLLIN)) {
            unsigned char sigs[64];
            ssize_t k = read(sig_pipe[0], sigs, sizeof sigs);
            for (ssize_t j = 0; j < k; j++) {
                if (sigs[j] == SIGCHLD)
                    continue;
                if (interrupted++) { /* a second interrupt: no more waiting */
                    signal_all(ch, (unsigned)n, SIGKILL);
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
        int st;
        pid_t pid;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
            for (unsigned r = 0; r < (unsigned)n; r++) {
                if (ch[r].pid != pid || !ch[r].running)
                    continue;
                ch[r].running = 0;
                running--;
                ch[r].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                /* A rank killed by a signal just after another rank failed is
                 * the likely cause (the other saw it go): it counts as first. */
                int cause = first_fail >= 0 && WIFSIGNALED(st) && !first_signaled &&
                            !signals_sent && now() - first_fail_at < 0.2;
                if (cause) {
                    fprintf(stderr,
                            "epipe-run: rank %u was killed by signal %d (%s) as rank %d "
                            "failed; taking it as the cause\n",
                            r, WTERMSIG(st), strsignal(WTERMSIG(st)), first_fail);
                    first_fail = (int)r;
                    first_signaled = 1;
                    exit_code = ch[r].status;
                }
                if (ch[r].status != 0 && first_fail < 0) {
                    first_fail_at = now();
                    first_signaled = WIFSIGNALED(st);
                    first_fail = (int)r;
                    exit_code = ch[r].status;
                    if (WIFSIGNALED(st))
                        fprintf(stderr, "epipe-run: rank %u was killed by signal %d (%s)%s\n", r,
                                WTERMSIG(st), strsignal(WTERMSIG(st)),
                                running ? "; stopping the other ranks" : "");
                    else
                        fprintf(stderr, "epipe-run: rank %u exited with status %d%s\n", r,
                                ch[r].status, running ? "; stopping the other ranks" : "");
                    if (running && !interrupted)
                        term_at = now() + grace;
                }
            }
        }
    }
    for (unsigned r = 0; r < (unsigned)n; r++)
        for (int k = 0; k < 2; k++) {
            if (ch[r].s[k].fd >= 0)
                close(ch[r].s[k].fd);
            free(ch[r].s[k].buf);
        }
    free(ch);
    free(pf);
    free(ps);
    free(prank);
    return exit_code;
}
