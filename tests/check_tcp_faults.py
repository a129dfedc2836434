#!/usr/bin/env python3
"""The launcher and TCP's own faults across processes: the launcher's duties
(prefixes, status, SIGINT/SIGTERM forwarding, exit 137 for a rank killed by
SIGKILL), a wrong key (EPIPE_EAUTH at init), and real two-process rendezvous
from torchrun, Open MPI, PMI and Slurm environments. The faults every
transport shares (killed, stopped, aborted peers) are tests/conformance/."""
import os
import signal
import subprocess
import sys
import tempfile
import time

from checks import fail, finish

run, trainer = sys.argv[1], sys.argv[2]


def launch(args, timeout=30, env=None):
    t0 = time.time()
    r = subprocess.run([run, *args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    return r, time.time() - t0


# 1. The launcher: prefixes, the environment, the first failing status.
r, _ = launch(["-n", "3", "--", "sh", "-c",
               'echo "hello $EPIPE_RANK/$EPIPE_WORLD_SIZE $EPIPE_MASTER_ADDR"; echo err >&2'])
for k in range(3):
    if "[rank %d] hello %d/3 127.0.0.1" % (k, k) not in r.stdout:
        fail("launcher output lacks rank %d's line:\n%s" % (k, r.stdout))
    if "[rank %d] err" % k not in r.stderr:
        fail("launcher stderr lacks rank %d's line:\n%s" % (k, r.stderr))
if r.returncode != 0:
    fail("launcher exit %d for ranks that all succeed" % r.returncode)
r, dt = launch(["-n", "3", "--grace", "0.2", "--", "sh", "-c",
                'if [ "$EPIPE_RANK" = 1 ]; then exit 7; fi; sleep 20'])
print("a rank exits 7: launcher exit %d in %.2f s" % (r.returncode, dt))
if r.returncode != 7 or dt > 5:
    fail("launcher should exit 7 quickly, got %d after %.1f s: %s" % (r.returncode, dt, r.stderr))
if r.returncode == 7 and "rank 1 exited with status 7" not in r.stderr:
    fail("launcher did not say which rank failed: " + r.stderr)
p = subprocess.Popen([run, "-n", "2", "--", "sleep", "20"], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
time.sleep(0.3)
t0 = time.time()
p.send_signal(signal.SIGTERM)
out, err = p.communicate(timeout=10)
print("SIGTERM to the launcher: exit %d in %.2f s" % (p.returncode, time.time() - t0))
if p.returncode != 128 + signal.SIGTERM or time.time() - t0 > 5:
    fail("SIGTERM not forwarded: exit %d, %s" % (p.returncode, err))

# SIGINT too, and the ranks themselves see the signal: each traps it, says
# so and exits 3, which becomes the launcher's status.
p = subprocess.Popen([run, "-n", "2", "--", "sh", "-c",
                      'trap "echo caught INT; exit 3" INT; trap "echo caught TERM; exit 3" TERM; '
                      'echo ready; while :; do sleep 0.05; done'],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
time.sleep(0.5)
t0 = time.time()
p.send_signal(signal.SIGINT)
out, err = p.communicate(timeout=10)
print("SIGINT to the launcher: exit %d in %.2f s" % (p.returncode, time.time() - t0))
for k in range(2):
    if "[rank %d] caught INT" % k not in out:
        fail("SIGINT not forwarded to rank %d:\n%s%s" % (k, out, err))
if p.returncode != 3 or time.time() - t0 > 5:
    fail("SIGINT: launcher exit %d (want the ranks' 3): %s" % (p.returncode, err))
p = subprocess.Popen([run, "-n", "2", "--", "sh", "-c",
                      'trap "echo caught TERM; exit 3" TERM; echo ready; '
                      'while :; do sleep 0.05; done'],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
time.sleep(0.5)
p.send_signal(signal.SIGTERM)
out, err = p.communicate(timeout=10)
for k in range(2):
    if "[rank %d] caught TERM" % k not in out:
        fail("SIGTERM not forwarded to rank %d:\n%s%s" % (k, out, err))

# 1b. The rendezvous from the environments other launchers set, as two real
# processes started without epipe-run; the log says which source was used.
def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def clean_env():
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("EPIPE_", "OMPI_", "PMI_", "SLURM_", "MPI_LOCALNRANKS"))
         and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    e["EPIPE_LOG"] = "info"
    e["EPIPE_TIMEOUT_MS"] = "10000"
    return e


def env_run(name, per_rank, want_source, want_port):
    procs = []
    for k in range(2):
        e = clean_env()
        e.update(per_rank(k))
        procs.append(subprocess.Popen([trainer, "--steps", "2"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=e))
    outs = []
    for k, q in enumerate(procs):
        try:
            o, er = q.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            q.kill()
            o, er = q.communicate()
        outs.append((q.returncode, o, er))
    for k, (rc, o, er) in enumerate(outs):
        if rc != 0 or "rank %d: ok" % k not in o:
            fail("%s: rank %d exit %s:\n%s%s" % (name, k, rc, o, er))
        elif want_source not in er or (":%d " % want_port) not in er:
            fail("%s: rank %d's log does not name %s and port %d:\n%s" % (name, k, want_source,
                                                                        want_port, er))
    line = [l for l in outs[0][2].splitlines() if "from " + want_source in l]
    print("%s: %s" % (name, line[0].strip()[:200] if line else "no rendezvous line"))


port = free_port()
env_run("torchrun", lambda k: {"RANK": str(k), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(port - 1)}, "torchrun", port)
port = free_port()
env_run("Open MPI", lambda k: {"OMPI_COMM_WORLD_RANK": str(k), "OMPI_COMM_WORLD_SIZE": "2",
                               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "EPIPE_MASTER_PORT": str(port)},
        "Open MPI", port)
port = free_port()
env_run("PMI", lambda k: {"PMI_RANK": str(k), "PMI_SIZE": "2", "EPIPE_MASTER_PORT": str(port)},
        "PMI", port)
port = free_port()
env_run("Slurm", lambda k: {"SLURM_PROCID": str(k), "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
                            "SLURM_JOB_NODELIST": "localhost", "EPIPE_MASTER_PORT": str(port)},
        "Slurm", port)

# 2. A rank killed by SIGKILL: the launcher stops the others at once and
# exits 128+9 naming it. (What the surviving ranks of a training report is
# the conformance suite's train-dead-peer, over every transport.)
r, dt = launch(["-n", "3", "--grace", "0.2", "--", "sh", "-c",
                'if [ "$EPIPE_RANK" = 1 ]; then kill -9 $$; fi; sleep 20'], timeout=30)
print("kill -9 of rank 1 of 3: launcher exit %d in %.2f s" % (r.returncode, dt))
if r.returncode != 128 + signal.SIGKILL or dt > 15:
    fail("launcher exit %d after %.1f s, expected %d at once:\n%s%s"
         % (r.returncode, dt, 128 + 9, r.stdout, r.stderr))
elif "rank 1 was killed by signal 9" not in r.stderr:
    fail("launcher did not say which rank was killed: " + r.stderr)

# 3. A wrong key: EPIPE_EAUTH at init on the rank that holds it.
with tempfile.TemporaryDirectory() as d:
    for k, text in ((0, "the first secret key, long enough"), (1, "another secret key, long enough")):
        with open(os.path.join(d, "key%d" % k), "w") as f:
            f.write(text)
        os.chmod(os.path.join(d, "key%d" % k), 0o600)
    r, dt = launch(["-n", "2", "--grace", "5", "--", "sh", "-c",
                    'EPIPE_AUTH_KEY_FILE=%s/key$EPIPE_RANK exec "$0" "$@"' % d, trainer,
                    "--options", "init_timeout_ms=1500"], timeout=30)
    print("wrong key: launcher exit %d in %.2f s" % (r.returncode, dt))
    if "unknown codec" not in r.stdout and "libsodium" in r.stdout:
        print("  built without libsodium: EPIPE_ENOTSUP expected")
        if "EPIPE_ENOTSUP" not in r.stdout:
            fail("no EPIPE_ENOTSUP:\n" + r.stdout)
    else:
        if "[rank 1] init FAILED EPIPE_EAUTH" not in r.stdout:
            fail("rank 1 should fail with EPIPE_EAUTH:\n%s%s" % (r.stdout, r.stderr))
        if "[rank 0] init FAILED EPIPE_ETIMEDOUT" not in r.stdout or "key" not in r.stdout:
            fail("rank 0 should time out naming the refused rank:\n%s%s" % (r.stdout, r.stderr))
        if r.returncode == 0:
            fail("a wrong key must fail the launch")
        for l in r.stdout.splitlines():
            print("  " + l[:160])
    # The same key on both: it trains.
    r, dt = launch(["-n", "2", "--", trainer, "--steps", "3"],
                   env={"EPIPE_AUTH_KEY_FILE": os.path.join(d, "key0")})
    print("same key: launcher exit %d in %.2f s" % (r.returncode, dt))
    if r.returncode != 0 and "libsodium" not in r.stdout:
        fail("same key should train:\n%s%s" % (r.stdout, r.stderr))
    # Encrypted (encrypt=1 via EPIPE_ENCRYPT): three processes train.
    r, dt = launch(["-n", "3", "--", trainer, "--steps", "3"],
                   env={"EPIPE_AUTH_KEY_FILE": os.path.join(d, "key0"), "EPIPE_ENCRYPT": "1"})
    print("same key, encrypted: launcher exit %d in %.2f s" % (r.returncode, dt))
    if (r.returncode != 0 or "rank 2: ok" not in r.stdout) and "libsodium" not in r.stdout:
        fail("an encrypted group should train:\n%s%s" % (r.stdout, r.stderr))
# 4. Two jobs given one master port: ranks of job B reach job A's rank 0
# before A's own rank 1 does. Each is refused alone, whatever world size it
# claims (another size used to fail A's whole rendezvous; the same size let
# B's rank take A's place), and A trains once its own rank 1 arrives.
port = free_port()


def job_rank(job, rank, size, extra=()):
    e = clean_env()
    e.update(EPIPE_RANK=str(rank), EPIPE_WORLD_SIZE=str(size), EPIPE_MASTER_ADDR="127.0.0.1",
             EPIPE_MASTER_PORT=str(port), EPIPE_JOB_ID=job)
    return subprocess.Popen([trainer, "--steps", "2", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e)


a0 = job_rank("job-a", 0, 2, ["--options", "init_timeout_ms=20000"])
time.sleep(0.3)
for size in (3, 2):
    t0 = time.time()
    b = job_rank("job-b", 1, size, ["--options", "init_timeout_ms=5000"])
    o, er = b.communicate(timeout=30)
    print("job B's rank 1 of %d at job A's port: exit %d in %.2f s" % (size, b.returncode,
                                                                        time.time() - t0))
    if b.returncode == 0 or "EPIPE_EINVAL" not in o or "from another job" not in o or \
            time.time() - t0 > 4:
        fail("job B's rank 1 of %d should be refused at once as another job's:\n%s%s"
             % (size, o, er))
    if a0.poll() is not None:
        fail("job A's rank 0 ended when job B's rank 1 of %d knocked:\n%s%s"
             % (size, *a0.communicate()))
        break
a1 = job_rank("job-a", 1, 2)
outs = [q.communicate(timeout=30) for q in (a0, a1)]
for k, (q, (o, er)) in enumerate(zip((a0, a1), outs)):
    if q.returncode != 0 or "rank %d: ok" % k not in o:
        fail("job A's rank %d after job B's were refused: exit %s\n%s%s" % (k, q.returncode, o, er))
refusals = [l for l in outs[0][1].splitlines() if "from another job" in l]
print("job A trained; its rank 0 logged %d refusal(s): %s" % (len(refusals),
                                                             refusals[0][:160] if refusals else ""))
finish()
