#!/usr/bin/env python3
"""epipe-run cleans up after its ranks and starts as many as asked: processes a
rank leaves in its process group get SIGTERM when every rank has exited (and
SIGKILL 5 s later), whatever the ranks' status; ranks get SIGTERM when the
launcher is killed outright; a low soft limit on open files is raised for the
launcher alone. Usage: check_epipe_run.py EPIPE_RUN."""
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

from checks import fail, finish

run = sys.argv[1]


def alive(pid):
    """True while pid is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def launch(args, timeout=30, preexec=None):
    t0 = time.monotonic()
    r = subprocess.run([run, *args], capture_output=True, text=True, timeout=timeout,
                       preexec_fn=preexec)
    return r, time.monotonic() - t0


def left_pids(d):
    pids = []
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name)) as f:
            pids += [int(x) for x in f.read().split()]
    return pids


def gone_soon(pids, within=2.0):
    end = time.monotonic() + within
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def check_leftovers(what, script, want_status, want_time, n=3):
    with tempfile.TemporaryDirectory() as d:
        r, dt = launch(["-n", str(n), "--grace", "0.2", "--", "sh", "-c", script, "sh", d])
        pids = left_pids(d)
        survivors = gone_soon(pids)
        for p in survivors:
            os.kill(p, signal.SIGKILL)
        print(f"{what}: exit {r.returncode} in {dt:.2f} s, {len(pids)} left, "
              f"{len(survivors)} survived; {r.stderr.strip().splitlines()[-1:]}")
        if len(pids) != 2 * n:
            fail(f"{what}: the ranks wrote {len(pids)} pids, not {2 * n}: {r.stderr}")
        if survivors:
            fail(f"{what}: {survivors} outlived epipe-run")
        if r.returncode != want_status:
            fail(f"{what}: exit {r.returncode}, want {want_status}: {r.stderr}")
        if not want_time[0] <= dt <= want_time[1]:
            fail(f"{what}: took {dt:.2f} s, want {want_time[0]}..{want_time[1]}")
        if f"left {2 * n} processes running" not in r.stderr:
            fail(f"{what}: the launcher did not say what it stopped: {r.stderr!r}")


# Each rank starts two processes in its group and exits; they keep stdout and
# stderr open, so before the fix the launcher waited 0.5 s for them and left
# them running.
start_two = 'sleep 60 & echo $! >> "$1/$EPIPE_RANK"; sleep 60 & echo $! >> "$1/$EPIPE_RANK"; '
check_leftovers("ranks succeed, children left", start_two + "exit 0", 0, (0, 3))
check_leftovers("a rank fails, children left",
                start_two + '[ "$EPIPE_RANK" = 1 ] && exit 5; exit 0', 5, (0, 3))
# Children that ignore SIGTERM (and hold no output open) get SIGKILL 5 s later.
# Each child writes its pid once it ignores SIGTERM, and the rank exits only
# then: a SIGTERM sent before the trap was set would end it at once.
ignore_one = ('sh -c \'trap "" TERM; echo $$ >> "$1/$EPIPE_RANK"; exec sleep 60\' sh "$1" '
              '>/dev/null 2>&1 & ')
ignore = (ignore_one * 2 + 'while [ "$(cat "$1/$EPIPE_RANK" 2>/dev/null | wc -l)" -lt 2 ]; '
          'do sleep 0.01; done; exit 0')
check_leftovers("children ignore SIGTERM", ignore, 0, (4.5, 8), n=2)

# A rank whose children have all ended: nothing to say, no delay.
r, dt = launch(["-n", "2", "--", "sh", "-c", "sleep 0.1 & wait; echo done"])
if r.returncode != 0 or "left" in r.stderr or dt > 2:
    fail(f"no leftovers: exit {r.returncode} in {dt:.2f} s: {r.stderr!r}")
else:
    print(f"no leftovers: exit 0 in {dt:.2f} s, nothing said")

# A process that leaves the group (its own session) is the rank's business:
# epipe-run neither stops it nor waits more than a moment for its output.
with tempfile.TemporaryDirectory() as d:
    r, dt = launch(["-n", "1", "--", "sh", "-c",
                    'setsid sh -c \'echo $$ > "$1/0.tmp"; mv "$1/0.tmp" "$1/0"; exec sleep 60\' '
                    'sh "$1" & while [ ! -e "$1/0" ]; do sleep 0.01; done', "sh", d])
    pids = left_pids(d)
    time.sleep(0.2)
    still = [p for p in pids if alive(p)]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    if r.returncode != 0 or dt > 3 or len(still) != 1:
        fail(f"own session: exit {r.returncode} in {dt:.2f} s, alive {still} of {pids}")
    else:
        print(f"own session: left alone, launcher done in {dt:.2f} s")


# The launcher killed outright (SIGKILL: it can stop nothing itself): the
# kernel sends each rank SIGTERM (PR_SET_PDEATHSIG) instead of leaving them
# running with no one reading their output.
with tempfile.TemporaryDirectory() as d:
    p = subprocess.Popen([run, "-n", "2", "--", "sh", "-c",
                          'echo $$ > "$1/$EPIPE_RANK.tmp"; mv "$1/$EPIPE_RANK.tmp" '
                          '"$1/$EPIPE_RANK"; exec sleep 60', "sh", d],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 10
    while len([n for n in os.listdir(d) if not n.endswith(".tmp")]) < 2 and \
            time.monotonic() < end:
        time.sleep(0.02)
    pids = left_pids(d)
    p.kill()
    p.wait()
    survivors = gone_soon(pids)
    for q in survivors:
        os.kill(q, signal.SIGKILL)
    if len(pids) != 2 or survivors:
        fail(f"launcher killed: ranks {pids}, {survivors} outlived it")
    else:
        print("launcher killed by SIGKILL: both ranks ended")


# Open files: two pipes per rank stay open in the launcher. A soft limit of 64
# files is raised for the launcher, and each rank gets 64 back.
def soft_limit(n):
    def set_it():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    return set_it


r, dt = launch(["-n", "100", "--", "sh", "-c", "ulimit -Sn"], preexec=soft_limit(64))
seen = sorted(set(l.split("] ", 1)[1] for l in r.stdout.splitlines()))
if r.returncode != 0 or len(r.stdout.splitlines()) != 100 or seen != ["64"]:
    fail(f"100 ranks under a soft limit of 64 files: exit {r.returncode}, limits {seen}, "
         f"{r.stderr[:300]!r}")
else:
    print(f"100 ranks under a soft limit of 64 files: all ran, each saw 64 ({dt:.2f} s)")


# A hard limit too low: refused before any rank starts, naming the limit.
def hard_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


with tempfile.TemporaryDirectory() as d:
    r, dt = launch(["-n", "100", "--", "sh", "-c", 'touch "$1/$EPIPE_RANK"', "sh", d],
                   preexec=hard_limit)
    started = os.listdir(d)
    if r.returncode != 1 or "hard limit is 64" not in r.stderr or started:
        fail(f"hard limit 64: exit {r.returncode}, {len(started)} ranks started, {r.stderr!r}")
    else:
        print(f"hard limit 64: {r.stderr.strip()}")

finish()
