#!/usr/bin/env python3
"""epipe-bench schedule: --json prints one valid object with exactly the
documented keys and the known results; the timeline fits 100 columns; bad
arguments fail with a message that names them."""
import json
import re
import subprocess
import sys

from checks import fail, finish

bench = sys.argv[1]


def run(*args):
    return subprocess.run([bench, "schedule", *args], capture_output=True, text=True)


KEYS = {"kind", "stages", "pipeline_stages", "microbatches", "splits_backward", "makespan",
        "bubble_fraction", "bubble_over_ideal", "published_bubble", "placement", "peak_live", "ops",
        "steps", "weight_versions"}
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
            (o["steps"], 1), (o["weight_versions"], [1] * p),
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

# without a flush: 4 steps back to back and the drain, one fill and one
# drain of 2(p-1); rank s holds p-s versions (async) or 2 (2bw)
for kind, versions in (("1f1b-async", [4, 3, 2, 1]), ("1f1b-2bw", [2, 2, 2, 1])):
    o = json.loads(run("--kind", kind, "-p", "4", "-m", "8", "--json").stdout)
    steps = o["steps"]
    for got, want in ((steps, 4), (o["makespan"], steps * 8 * 2 + 2 * 3),
                      (o["weight_versions"], versions), (len(o["ops"][0]), steps * 8 * 2)):
        if got != want:
            fail(f"{kind}: got {got!r}, want {want!r}")
    r = run("--kind", kind, "-p", "4", "-m", "4")
    if r.returncode != 0 or "a step over the run" not in r.stdout or "weight versions" not in r.stdout:
        fail(f"{kind} timeline: exit {r.returncode}\n{r.stdout}{r.stderr}")
    r = run("--kind", kind, "-p", "4", "-m", "3")
    if r.returncode == 0 or "needs m >= 4" not in r.stderr:
        fail(f"{kind} m < p: exit {r.returncode}, {r.stderr!r}")

o = json.loads(run("--kind", "1f1b", "-p", "4", "-m", "8", "--json").stdout)
if o["ops"][0][:6] != ["F0", "F1", "F2", "F3", "B0", "F4"]:
    fail(f"1f1b stage 0 starts {o['ops'][0][:6]}")

r = run("--kind", "1f1b", "-p", "4", "-m", "8")
if r.returncode != 0 or not re.search(r"bubble fraction\s+0\.2727", r.stdout):
    fail(f"timeline: exit {r.returncode}\n{r.stdout}{r.stderr}")
if any(len(line) > 100 for line in r.stdout.splitlines()):
    fail("timeline wider than 100 columns:\n" + r.stdout)
if len([l for l in r.stdout.splitlines() if l.startswith("rank ")]) != 4:
    fail("timeline does not have one row per rank:\n" + r.stdout)

for args, needle in ((["--kind", "zb"], "'zb'"), (["-p", "0"], "0 stages"),
                     (["-m", "0"], "0 micro-batches"), (["-p", "x"], "-p"),
                     (["--bogus"], "--bogus"), (["-m", "70000"], "70000")):
    r = run(*args)
    if r.returncode == 0 or needle not in r.stderr:
        fail(f"{args}: exit {r.returncode}, stderr {r.stderr!r}")
r = run("--kind", "zb")
for k in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "1f1b-async", "1f1b-2bw"):
    if k not in r.stderr:
        fail(f"unknown kind does not list {k}: {r.stderr!r}")


def js(*args):
    r = run(*args, "--json")
    if r.returncode != 0:
        fail(f"{args}: exit {r.returncode}: {r.stderr}")
        return None
    return json.loads(r.stdout)


# The published bubbles at equal costs (idle over ideal compute).
for args, want in (
        (("--kind", "1f1b", "-p", "4", "-m", "8", "--weight-cost", "1"), 3 / 8),
        (("--kind", "interleaved", "-p", "4", "-m", "8", "--chunks", "2"), 3 / 16),
        (("--kind", "interleaved", "-p", "4", "-m", "10", "--chunks", "2"), 3 / 20),
        (("--kind", "zb-h1", "-p", "4", "-m", "8", "--weight-cost", "1"), 3 / 24)):
    o = js(*args)
    if o and (abs(o["bubble_over_ideal"] - want) > 0.01 * want
              or abs(o["published_bubble"] - want) > 1e-12):
        fail(f"{args}: bubble {o['bubble_over_ideal']} / published {o['published_bubble']}, "
             f"want {want}")

# zb-h1 splits the backward: Bi and W ops; 1f1b pays B + W per backward.
o = js("--kind", "zb-h1", "-p", "2", "-m", "2", "--weight-cost", "1")
if o and (not o["splits_backward"] or sorted(o["ops"][1]) != ["Bi0", "Bi1", "F0", "F1", "W0", "W1"]):
    fail(f"zb-h1 ops {o}")
o = js("--kind", "1f1b", "-p", "1", "-m", "1", "--weight-cost", "2")
if o and o["makespan"] != 4:
    fail(f"1f1b with weight cost: makespan {o['makespan']}, want 1 + 1 + 2")

# The client-server map: -p defaults to the ranks it names; chunk labels.
o = js("--placement", "0,1,0", "-m", "4")
if o and (o["stages"] != 2 or o["pipeline_stages"] != 3 or o["placement"] != [0, 1, 0]
          or "F0.1" not in o["ops"][0] or o["published_bubble"] is not None):
    fail(f"placement 0,1,0: {o}")
o = js("--kind", "zb-v", "-p", "3", "-m", "3")
if o and o["placement"] != [0, 1, 2, 2, 1, 0]:
    fail(f"zb-v placement {o['placement']}")
r = run("--kind", "zb-h1", "--placement", "0,1,0", "-m", "4", "--comm-cost", "0.5",
        "--codec-cost", "0.1")
if r.returncode != 0 or "rank 1" not in r.stdout or "Bi0.1" not in r.stdout:
    fail(f"zb-h1 on 0,1,0: exit {r.returncode}\n{r.stdout}{r.stderr}")

# Bad placements and chunk counts: named, exit 2.
for args, needle in ((["--placement", ""], "--placement"),
                     (["--placement", "0,,1"], "0,,1"),
                     (["--placement", "0,1,"], "0,1,"),
                     (["--placement", "a"], "list of ranks"),
                     (["--placement", "-1,0"], "-1,0"),
                     (["--placement", "+1,0"], "+1,0"),
                     (["--placement", "99999999999"], "99999999999"),
                     (["--placement", ",".join(["0"] * 1025)], "--placement"),
                     (["--placement", "0,2", "-p", "2"], "placement[1] = 2: rank out of range"),
                     (["--placement", "0,0", "-p", "2"], "rank 1 holds no pipeline stage"),
                     (["--kind", "zb-v", "--chunks", "3"], "zb-v needs 2"),
                     (["--chunks", "x"], "--chunks"),
                     (["--weight-cost", "-1"], "--weight-cost"),
                     (["--codec-cost", "nan"], "--codec-cost")):
    r = run(*args)
    if r.returncode != 2 or needle not in r.stderr:
        fail(f"{args}: exit {r.returncode}, stderr {r.stderr!r}")

finish(summary=True)
