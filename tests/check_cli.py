#!/usr/bin/env python3
"""Options the GNU way (getopt_long) in the tools and examples: `--opt=value`
and `--opt value` give the same result, short options take attached values,
and a bad option is named in the error. Usage: check_cli.py EPIPE_BENCH
EPIPE_RUN [EPIPE_TRAIN]."""
import os
import subprocess
import sys

from checks import fail, finish

bench, run = sys.argv[1], sys.argv[2]
train = sys.argv[3] if len(sys.argv) > 3 else None


def call(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60)


def same(what, a, b):
    ra, rb = call(*a), call(*b)
    if ra.returncode != 0 or ra.stdout != rb.stdout or ra.returncode != rb.returncode:
        fail(f"{what}: {a} -> {ra.returncode} {ra.stdout[:200]!r} {ra.stderr[:200]!r}\n"
             f"    vs {b} -> {rb.returncode} {rb.stdout[:200]!r} {rb.stderr[:200]!r}")
    else:
        print(f"ok: {what}: {' '.join(a[1:])}  ==  {' '.join(b[1:])}")


def refused(what, args, needle):
    r = call(*args)
    if r.returncode == 0 or needle not in r.stderr:
        fail(f"{what}: {args}: exit {r.returncode}, stderr {r.stderr[:300]!r}")
    else:
        print(f"ok: {what}: {r.stderr.splitlines()[0]}")


same("epipe-bench schedule",
     [bench, "schedule", "--kind", "gpipe", "--stages", "3", "--microbatches", "4", "--json"],
     [bench, "schedule", "--kind=gpipe", "--stages=3", "--microbatches=4", "--json"])
same("epipe-bench schedule, short options",
     [bench, "schedule", "-k", "gpipe", "-p", "3", "-m", "4", "--json"],
     [bench, "schedule", "-kgpipe", "-p3", "-m4", "--json"])
same("epipe-bench schedule, costs",
     [bench, "schedule", "--forward-cost", "2", "--comm-cost", "0.5", "--json"],
     [bench, "schedule", "--json", "--forward-cost=2", "--comm-cost=0.5"])
refused("bad value", [bench, "schedule", "--stages=x"], "'--stages' needs a whole number")
refused("missing value", [bench, "schedule", "--kind"], "'--kind' needs a value")
refused("unknown option", [bench, "schedule", "--bogus=1"], "unknown option '--bogus'")
refused("value to a flag", [bench, "schedule", "--json=1"], "'--json' takes no value")
refused("bench codec", [bench, "codec", "none", "--shape=0"], "bad --shape '0'")
refused("bench codec device", [bench, "codec", "none", "--device=gpu"], "unknown --device 'gpu'")
refused("bench codec cuda options", [bench, "codec", "none", "--device=cuda", "--json"],
        "--device cuda times normal values only")
# --device cuda runs epipe-bench-cuda: where it is built it answers (a skip, exit 77, with the
# reason on a machine without a GPU; the figures where there is one); where it is not, or the
# path is wrong, the message names where it looked.
r = call(bench, "codec", "quant:bits=8", "--shape=4096", "--reps=2", "--device=cuda")
if r.returncode == 0 and "cudaMemcpy D2D" in r.stdout and "quant:bits=8" in r.stdout:
    print("ok: bench codec --device cuda ran on a GPU")
elif r.returncode == 77 and "SKIP: no CUDA device" in r.stdout:
    print(f"ok: bench codec --device cuda: {r.stdout.strip()}")
elif r.returncode == 2 and "needs epipe-bench-cuda" in r.stderr:
    print(f"ok: bench codec --device cuda: {r.stderr.strip()}")
else:
    fail(f"bench codec --device cuda: exit {r.returncode} {r.stdout[:200]!r} {r.stderr[:200]!r}")
env = dict(os.environ, EPIPE_BENCH_CUDA="/nonexistent/epipe-bench-cuda")
r = subprocess.run([bench, "codec", "none", "--device=cuda"], capture_output=True, text=True,
                   timeout=60, env=env)
if r.returncode != 2 or "/nonexistent/epipe-bench-cuda" not in r.stderr:
    fail(f"bench codec --device cuda, bad path: exit {r.returncode} {r.stderr[:200]!r}")
else:
    print(f"ok: {r.stderr.strip()}")

sh = "/bin/sh"
prog = [sh, "-c", 'echo "rank $EPIPE_RANK of $EPIPE_WORLD_SIZE"']
a = call(run, "-n", "2", "--", *prog)
b = call(run, "--np=2", *prog)
lines = lambda r: sorted(r.stdout.splitlines())
if a.returncode or b.returncode or lines(a) != lines(b) or len(lines(a)) != 2:
    fail(f"epipe-run: -n 2 -> {a.stdout!r} {a.stderr!r}; --np=2 -> {b.stdout!r} {b.stderr!r}")
else:
    print(f"ok: epipe-run -n 2 == --np=2: {lines(a)}")
# Options after the program's name are the program's.
r = call(run, "-n1", sh, "-c", "echo $1", "x", "--np=9")
if r.returncode or "--np=9" not in r.stdout:
    fail(f"epipe-run parsed its program's options: {r.stdout!r} {r.stderr!r}")
refused("epipe-run", [run, "--np=0", sh], "--np 0: give a count")
# The benchmarks' numbers are checked whole and in range too (-m -1 read as
# 4294967295 micro-batches; --fwd-ms nan hung).
refused("epipe-bench", [bench, "pipeline", "-m", "-1"], "-m '-1' is not an integer in 1..4096")
refused("epipe-bench", [bench, "pipeline", "--fwd-ms=nan"], "--fwd-ms 'nan' is not a number")
refused("epipe-bench", [bench, "codec", "none", "--threads=-1"],
        "--threads '-1' is not an integer")
refused("epipe-bench", [bench, "transport", "--streams=9"],
        "--streams '9' is not an integer in 1..8")
refused("epipe-bench", [bench, "crc", "--reps=2x"], "--reps '2x' is not an integer")
refused("epipe-run", [run, "--grace=soon", "-n1", sh], "--grace 'soon' is not a number in 0..3600")
refused("epipe-run", [run, "--grace=nan", "-n1", sh], "not a number")
for bad in ("abc", "0", "65536", "123456789012345678", "80x", "-1"):
    r = subprocess.run([run, "-n1", sh, "-c", "echo started"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, EPIPE_MASTER_PORT=bad))
    if r.returncode != 2 or "started" in r.stdout or \
            f"EPIPE_MASTER_PORT='{bad}' is not a port number in 1..65535" not in r.stderr:
        fail(f"epipe-run with EPIPE_MASTER_PORT={bad}: exit {r.returncode}, {r.stderr!r}")
print("ok: epipe-run refuses an EPIPE_MASTER_PORT that is not a port, before any rank starts")

if train:
    a = call(train, "--epochs", "0")
    b = call(train, "--epochs=0")
    if a.returncode == 0 or a.stderr != b.stderr or "--epochs" not in a.stderr:
        fail(f"epipe-train --epochs 0 vs --epochs=0: {a.stderr!r} / {b.stderr!r}")
    else:
        print("ok: epipe-train --epochs 0 == --epochs=0:", a.stderr.strip())
    refused("epipe-train", [train, "--lr"], "'--lr' needs a value")
    # Numbers are checked whole, in range, before anything runs: no atoi
    # that reads "12x" as 12, 99999999999 as a wrapped int or "abc" as 0.
    for opt, value, why in (("--batch", "0", "not an integer in 1..1048576"),
                            ("--batch", "99999999999", "not an integer in 1..1048576"),
                            ("--batch", "12x", "not an integer"),
                            ("--microbatches", "65", "not an integer in 1..64"),
                            ("--stages", "", "not an integer in 1..64"),
                            ("--seed", "abc", "not an integer"),
                            ("--train-limit", "-3", "not an integer in 1.."),
                            ("--lr", "nan", "not a number in 0..1e+06"),
                            ("--lr", "inf", "not a number"),
                            ("--lr", "-1", "not a number"),
                            ("--momentum", "1", "not a number in 0..0.9999"),
                            ("--codec-lr", "-2", "not a number"),
                            ("--blas-threads", "0", "not an integer in 1..256"),
                            ("--chunks", "9", "not an integer in 1..8"),
                            ("--hidden", "5,", "bad --hidden '5,'"),
                            ("--hidden", "1,2,3,4,5,6,7,8", "at most 7")):
        r = call(train, f"{opt}={value}")
        if r.returncode != 2 or why not in r.stderr or f"'{value}'" not in r.stderr:
            fail(f"epipe-train {opt}={value}: exit {r.returncode}, {r.stderr.strip()!r}")
        else:
            print(f"ok: epipe-train {opt}={value}: {r.stderr.strip()}")
    # Choices that only the library or the layout can judge are judged
    # before any rank starts: one line, exit 2, naming the option.
    for args, why in ((["--act-codec", "sortquant:bits=99"],
                       "bad --act-codec 'sortquant:bits=99': sortquant: key 'bits' = 99"),
                      (["--grad-codec", "quant:bitz=4"], "bad --grad-codec 'quant:bitz=4'"),
                      (["--act-codec", "quant:bits=8,ef=1"], "ef=1 (error feedback) is for grad"),
                      (["--placement", "0,3"], "rank 1 holds no pipeline stage"),
                      (["--placement", "0,1,0,1,1"], "lists 5 pipeline stages but the model "
                                                      "has 3 layers"),
                      (["--stages", "4"], "--stages 4: the model has 3 layers")):
        r = call(train, *args)
        lines = r.stderr.strip().splitlines()
        if r.returncode != 2 or len(lines) != 1 or why not in lines[0] or r.stdout:
            fail(f"epipe-train {' '.join(args)}: exit {r.returncode}, {r.stderr.strip()!r}, "
                 f"stdout {r.stdout[:100]!r}")
        else:
            print(f"ok: epipe-train {' '.join(args)}: {lines[0]}")

finish(summary=True)
