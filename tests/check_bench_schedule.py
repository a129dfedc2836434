#!/usr/bin/env python3
"""epipe-bench schedule: --json prints one valid object with exactly the
documented keys and the known results; the timeline fits 100 columns; bad
arguments fail with a message that names them."""
import json
import re
import subprocess
import sys

bench = sys.argv[1]
ok = True


def fail(msg):
    global ok
    print("FAIL:", msg)
    ok = False


def run(*args):
    return subprocess.run([bench, "schedule", *args], capture_output=True, text=True)


KEYS = {"kind", "stages", "microbatches", "makespan", "bubble_fraction", "peak_live", "ops"}
for kind in ("gpipe", "1f1b"):
    for p, m in ((1, 1), (2, 3), (4, 8), (6, 16), (5, 2)):
        r = run("--kind", kind, "-p", str(p), "-m", str(m), "--json")
        if r.returncode != 0:
            fail(f"{kind} p={p} m={m}: exit {r.returncode}: {r.stderr}")
            continue
        lines = r.stdout.strip().splitlines()
        if len(lines) != 1:
            fail(f"{kind} p={p} m={m}: {len(lines)} lines, want one object")
        o = json.loads(r.stdout)
        if set(o) != KEYS:
            fail(f"{kind} p={p} m={m}: keys {sorted(o)}")
            continue
        want_peak = [m if kind == "gpipe" else min(p - s, m) for s in range(p)]
        checks = [
            (o["kind"], kind), (o["stages"], p), (o["microbatches"], m),
            (o["makespan"], 2 * (m + p - 1)), (o["peak_live"], want_peak), (len(o["ops"]), p),
        ]
        for got, want in checks:
            if got != want:
                fail(f"{kind} p={p} m={m}: got {got!r}, want {want!r}")
        if abs(o["bubble_fraction"] - (p - 1) / (m + p - 1)) > 1e-12:
            fail(f"{kind} p={p} m={m}: bubble {o['bubble_fraction']}")
        for s, ops in enumerate(o["ops"]):
            if sorted(ops) != sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]):
                fail(f"{kind} p={p} m={m} stage {s}: ops {ops}")
            for i in range(m):
                if ops.index(f"F{i}") > ops.index(f"B{i}"):
                    fail(f"{kind} p={p} m={m} stage {s}: B{i} before F{i}")

o = json.loads(run("--kind", "1f1b", "-p", "4", "-m", "8", "--json").stdout)
if o["ops"][0][:6] != ["F0", "F1", "F2", "F3", "B0", "F4"]:
    fail(f"1f1b stage 0 starts {o['ops'][0][:6]}")

r = run("--kind", "1f1b", "-p", "4", "-m", "8")
if r.returncode != 0 or not re.search(r"bubble fraction\s+0\.2727", r.stdout):
    fail(f"timeline: exit {r.returncode}\n{r.stdout}{r.stderr}")
if any(len(line) > 100 for line in r.stdout.splitlines()):
    fail("timeline wider than 100 columns:\n" + r.stdout)
if len([l for l in r.stdout.splitlines() if l.startswith("stage ")]) != 4:
    fail("timeline does not have one row per stage:\n" + r.stdout)

for args, needle in ((["--kind", "zb"], "'zb'"), (["-p", "0"], "0 stages"),
                     (["-m", "0"], "0 micro-batches"), (["-p", "x"], "-p"),
                     (["--bogus"], "--bogus"), (["-m", "70000"], "70000")):
    r = run(*args)
    if r.returncode == 0 or needle not in r.stderr:
        fail(f"{args}: exit {r.returncode}, stderr {r.stderr!r}")
r = run("--kind", "zb")
if "gpipe" not in r.stderr or "1f1b" not in r.stderr:
    fail(f"unknown kind does not list the known ones: {r.stderr!r}")

print("ok" if ok else "failed")
sys.exit(0 if ok else 1)
