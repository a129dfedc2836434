#!/usr/bin/env python3
"""The test MLP trained by 2-4 processes over TCP (started by epipe-run) with
the schedules that have chunks and split backward equals the one-process
reference (codec none); 1f1b-async and 1f1b-2bw equal their stale-weights
reference. GPipe and 1F1B, and sortquant:bits=8, over every
transport: the conformance suite's train-equal and train-codec."""
import os
import struct
import subprocess
import sys
import tempfile
import time

from checks import fail, finish

run, trainer = sys.argv[1], sys.argv[2]
STEPS, MICRO = "12", "4"


def floats(path):
    data = open(path, "rb").read()
    return struct.unpack("<%df" % (len(data) // 4), data)


def launch(p, *args):
    t0 = time.time()
    r = subprocess.run([run, "-n", str(p), "--", trainer, *args], capture_output=True, text=True,
                       timeout=40, env=dict(os.environ, EPIPE_TIMEOUT_MS="10000"))
    return r, time.time() - t0


def compare(tag, out, ref):
    """Every layer file of the run equals the reference's within 1e-6 relative."""
    for l in range(5):
        a = open("%s.layer%d" % (out, l), "rb").read()
        b = open("%s.layer%d" % (ref, l), "rb").read()
        if a == b:
            continue
        x, y = floats("%s.layer%d" % (out, l)), floats("%s.layer%d" % (ref, l))
        worst = max(abs(u - v) / max(abs(v), 1e-6) for u, v in zip(x, y))
        if len(x) != len(y) or worst > 1e-6:
            fail("%s layer %d: parameters differ from the reference (worst relative %.3g)"
                 % (tag, l, worst))
        else:
            print("  layer %d: equal within %.3g (not bitwise)" % (l, worst))


# (ranks, schedule, extra arguments)
# zero-bubble (split backward, by the split callbacks) and interleaved chunks
RUNS = [(p, k, ["--split", "1"]) for p in (2, 4) for k in ("zb-h1", "zb-v")]
RUNS += [(p, "interleaved", ["--chunks", "2"]) for p in (2, 3)]
# the client-server split: rank 0 holds the first and the last layers
RUNS += [(2, k, ["--placement", "0,1,0"]) for k in ("gpipe", "1f1b")]
RUNS += [(3, "1f1b", ["--placement", "0,1,2,1,0"]), (2, "gpipe", ["--chunks", "2"])]
# chunks on raw op lists (pipeline_host.h): client-server, a local boundary, a V
RUNS += [(p, "raw", ["--raw", pl, "--split", sp]) for p, pl in
         ((2, "0,1,0"), (2, "0,0,1"), (3, "0,1,2,2,1,0")) for sp in ("0", "1")]

# 1f1b-async and 1f1b-2bw against their stale-weights reference (its own,
# per rank count), by callbacks and by the op stream
ASYNC = [(p, k, extra) for p in (2, 3) for k in ("1f1b-async", "1f1b-2bw")
         for extra in ([], ["--stream", "1"])]

def train(tag, p, sched, out, extra):
    """Runs p ranks; True when every rank exited 0 and said ok."""
    r, dt = launch(p, "--schedule", sched, "--micro", MICRO, "--steps", STEPS, "--out", out,
                   *extra)
    print("%s: exit %d in %.3f s" % (tag, r.returncode, dt))
    if r.returncode:
        fail("%s:\n%s%s" % (tag, r.stdout, r.stderr))
        return False
    for s in range(p):
        if not r.stdout.count("[rank %d] rank %d: ok" % (s, s)):
            fail("%s: no ok line from rank %d:\n%s" % (tag, s, r.stdout))
    return True


with tempfile.TemporaryDirectory() as d:
    ref = os.path.join(d, "ref")
    r = subprocess.run([trainer, "--reference", "1", "--micro", MICRO, "--steps", STEPS,
                        "--out", ref], capture_output=True, text=True, timeout=20)
    if r.returncode:
        fail("reference: %s %s" % (r.stdout, r.stderr))
    for i, (p, sched, extra) in enumerate(RUNS if not r.returncode else []):
        tag = "p=%d %s %s" % (p, sched, " ".join(extra))
        out = os.path.join(d, "run%d" % i)
        if train(tag, p, sched, out, extra):
            compare(tag, out, ref)
    for i, (p, sched, extra) in enumerate(ASYNC):
        tag = "p=%d %s %s" % (p, sched, " ".join(extra))
        aref = os.path.join(d, "aref%d" % i)
        r = subprocess.run([trainer, "--reference", str(p), "--schedule", sched, "--micro", MICRO,
                            "--steps", STEPS, "--out", aref], capture_output=True, text=True,
                           timeout=20)
        if r.returncode:
            fail("%s reference: %s %s" % (tag, r.stdout, r.stderr))
            continue
        out = os.path.join(d, "async%d" % i)
        if not train(tag, p, sched, out, extra):
            continue
        compare(tag, out, aref)
        # the flush reference differs: the run really used stale weights
        same = all(open("%s.layer%d" % (out, l), "rb").read() ==
                   open("%s.layer%d" % (ref, l), "rb").read() for l in range(5))
        if same:
            fail("%s: equals the flush reference" % tag)
finish()
