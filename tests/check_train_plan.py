#!/usr/bin/env python3
"""epipe-train --plan: `auto` profiles, plans and trains, and writes a plan
file (--plan-out) that `--plan FILE` then runs, as threads and as processes
over TCP; misuse is refused by name. Usage: check_train_plan.py EPIPE_TRAIN
EPIPE_RUN. Skips (77) without the Fashion-MNIST files."""
import os
import subprocess
import sys
import tempfile

from checks import fail, finish

train, run = sys.argv[1], sys.argv[2]
SMALL = ["--train-limit", "640", "--epochs", "1", "--quiet"]


def call(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


probe = call(train, "--train-limit", "64", "--epochs", "1", "--quiet", "--batch", "64")
if probe.returncode != 0 and "cannot open" in (probe.stderr + probe.stdout):
    print("SKIP: no Fashion-MNIST data (install dataset-fashion-mnist):", probe.stderr.strip())
    sys.exit(77)

with tempfile.TemporaryDirectory() as tmp:
    plan = os.path.join(tmp, "plan.txt")
    r = call(train, "--plan", "auto", "--link", "100Mbit", "--plan-out", plan, *SMALL)
    out = r.stdout
    if r.returncode != 0 or "compression-blind" not in out or "plan: 3 stages" not in out \
            or "test accuracy" not in out:
        fail(f"--plan auto: exit {r.returncode}\n{out[-2000:]}\n{r.stderr[-1000:]}")
    else:
        print("ok: --plan auto profiles, plans and trains")
    text = open(plan).read() if os.path.exists(plan) else ""
    if not text.startswith("epipe-train-plan 1\n") or "split 0" not in text:
        fail(f"--plan-out wrote {text!r}")
    # the plan's codecs come from the candidates (or none)
    for line in text.splitlines():
        if line.startswith(("act ", "grad ")):
            spec = line.split()[2]
            if spec not in ("none", "sortquant:bits=8,zero=1", "sortquant:bits=4,zero=1"):
                fail(f"plan codec {spec!r} is not a candidate")

    r = call(train, "--plan", plan, *SMALL)
    if r.returncode != 0 or "codecs of the plan" not in r.stdout or "test accuracy" not in r.stdout:
        fail(f"--plan FILE (threads): exit {r.returncode} {r.stdout[-1500:]} {r.stderr[-500:]}")
    else:
        print("ok: --plan FILE runs as threads")
    r = call(run, "-n", "3", "--", train, "--plan", plan, *SMALL)
    if r.returncode != 0 or "test accuracy" not in r.stdout:
        fail(f"--plan FILE (3 processes): exit {r.returncode} {r.stdout[-1500:]} {r.stderr[-500:]}")
    else:
        print("ok: --plan FILE runs as 3 processes over TCP")

    def refused(what, args, needle, launcher=None):
        cmd = ([run, "-n", str(launcher), "--"] if launcher else []) + [train, *args, *SMALL]
        r = call(*cmd)
        if r.returncode == 0 or needle not in r.stderr + r.stdout:
            fail(f"{what}: exit {r.returncode}, {r.stderr[-600:]!r}")
        else:
            print(f"ok: {what}: refused ({needle})")

    refused("auto without a link", ["--plan", "auto"], "needs --link")
    refused("auto under a launcher", ["--plan", "auto", "--link", "1Gbit"],
            "profiles in one process", launcher=3)
    refused("ranks other than the plan's", ["--plan", plan], "the launcher started 2 ranks",
            launcher=2)
    refused("codecs beside a plan", ["--plan", plan, "--grad-codec", "none"], "leave out")
    refused("another model", ["--plan", plan, "--hidden", "64"], "--hidden makes 2")
    refused("a bad rate", ["--plan", "auto", "--link", "fast"], "bad --link")
    refused("an untrainable candidate",
            ["--plan", "auto", "--link", "1Gbit", "--plan-codecs", "quant:bits=4,delta=1"],
            "cannot be profiled")
    bad = os.path.join(tmp, "bad.txt")
    with open(bad, "w") as f:
        f.write(text.replace("split 0", "split 1"))
    refused("a corrupt plan file", ["--plan", bad], "line 5")
    with open(bad, "w") as f:
        f.write(text.replace("grad 0 ", "act 9 "))
    refused("a plan naming a boundary that does not exist", ["--plan", bad], "boundary in 0..1")
    with open(bad, "w") as f:
        f.write(text.replace("act 0 sortquant", "act 0 nosuchcodec"))
    refused("a plan with an unknown codec", ["--plan", bad], "nosuchcodec")
    refused("a plan written where no folder is", ["--plan", plan, "--plan-out",
                                                   os.path.join(tmp, "no", "p.txt")],
            "cannot write the plan to " + os.path.join(tmp, "no", "p.txt") +
            ": No such file or directory")

    # A plan that cannot be written whole (a full disk; here the file-size
    # limit, whose write fails with EFBIG) is named and removed: a cut-off
    # plan file would only be refused when read.
    def small_files():
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))

    cut = os.path.join(tmp, "cut.txt")
    r = subprocess.run([train, "--plan", plan, "--plan-out", cut, *SMALL], capture_output=True,
                       text=True, timeout=120, preexec_fn=small_files)
    if r.returncode == 0 or "File too large" not in r.stderr or os.path.exists(cut):
        fail(f"a plan cut off by the file-size limit: exit {r.returncode}, {r.stderr[-400:]!r}, "
             f"file left: {os.path.exists(cut)}")
    else:
        print("ok: a plan cut off by the file-size limit is named and removed")
    # ... and a plan file already there stays as it was, even the one read
    # (--plan X --plan-out X).
    with open(plan) as f:
        before = f.read()
    r = subprocess.run([train, "--plan", plan, "--plan-out", plan, *SMALL], capture_output=True,
                       text=True, timeout=120, preexec_fn=small_files)
    with open(plan) as f:
        after = f.read()
    if r.returncode == 0 or "File too large" not in r.stderr or after != before:
        fail(f"a failed --plan-out over the plan read: exit {r.returncode}, "
             f"{r.stderr[-400:]!r}, file changed: {after != before}")
    elif [n for n in os.listdir(tmp) if n.startswith(os.path.basename(plan) + ".")]:
        fail(f"a temporary file was left: {os.listdir(tmp)}")
    else:
        print("ok: a failed --plan-out leaves the file there as it was")

finish()
