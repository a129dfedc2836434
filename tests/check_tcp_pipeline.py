#!/usr/bin/env python3
"""The test MLP trained by 2-4 processes over TCP (started by epipe-run)
equals the one-process reference (GPipe and 1F1B, codec none), and trains
(loss falls) with sortquant:bits=8."""
import os
import struct
import subprocess
import sys
import tempfile
import time

run, trainer = sys.argv[1], sys.argv[2]
ok = True
STEPS, MICRO = "12", "4"


def fail(msg):
    global ok
    print("FAIL:", msg)
    ok = False


def floats(path):
    data = open(path, "rb").read()
    return struct.unpack("<%df" % (len(data) // 4), data)


def launch(p, *args):
    t0 = time.time()
    r = subprocess.run([run, "-n", str(p), "--", trainer, *args], capture_output=True, text=True,
                       timeout=40, env=dict(os.environ, EPIPE_TIMEOUT_MS="10000"))
    return r, time.time() - t0


with tempfile.TemporaryDirectory() as d:
    for p in (2, 3, 4):
        ref = os.path.join(d, "ref%d" % p)
        r = subprocess.run([trainer, "--reference", str(p), "--micro", MICRO, "--steps", STEPS,
                            "--out", ref], capture_output=True, text=True, timeout=20)
        if r.returncode:
            fail("reference p=%d: %s %s" % (p, r.stdout, r.stderr))
            continue
        for sched in ("gpipe", "1f1b"):
            out = os.path.join(d, "%s%d" % (sched, p))
            r, dt = launch(p, "--schedule", sched, "--micro", MICRO, "--steps", STEPS,
                           "--out", out)
            print("p=%d %s: exit %d in %.3f s" % (p, sched, r.returncode, dt))
            if r.returncode:
                fail("p=%d %s:\n%s%s" % (p, sched, r.stdout, r.stderr))
                continue
            for s in range(p):
                if not r.stdout.count("[rank %d] rank %d: ok" % (s, s)):
                    fail("p=%d %s: no ok line from rank %d:\n%s" % (p, sched, s, r.stdout))
                a = open("%s.stage%d" % (out, s), "rb").read()
                b = open("%s.stage%d" % (ref, s), "rb").read()
                if a == b:
                    continue
                x, y = floats("%s.stage%d" % (out, s)), floats("%s.stage%d" % (ref, s))
                worst = max(abs(u - v) / max(abs(v), 1e-6) for u, v in zip(x, y))
                if len(x) != len(y) or worst > 1e-6:
                    fail("p=%d %s stage %d: parameters differ from the reference (worst "
                         "relative %.3g)" % (p, sched, s, worst))
                else:
                    print("  stage %d: equal within %.3g (not bitwise)" % (s, worst))
    for p, sched in ((2, "1f1b"), (3, "gpipe"), (4, "1f1b")):
        r, dt = launch(p, "--schedule", sched, "--micro", MICRO, "--steps", "40",
                       "--codec", "sortquant:bits=8")
        print("p=%d %s sortquant:bits=8: exit %d in %.2f s" % (p, sched, r.returncode, dt))
        if r.returncode:
            if "unknown codec" in r.stdout + r.stderr:
                print("  sortquant is not registered: skipped")
                continue
            fail("sortquant p=%d:\n%s%s" % (p, r.stdout, r.stderr))
            continue
        line = [l for l in r.stdout.splitlines() if "loss first" in l]
        if not line:
            fail("sortquant p=%d: no loss line:\n%s" % (p, r.stdout))
            continue
        words = line[0].split()
        first, last = float(words[-3]), float(words[-1])
        print("  loss %.5f -> %.5f" % (first, last))
        if not last < 0.7 * first:
            fail("sortquant p=%d: loss did not fall enough: %g -> %g" % (p, first, last))
sys.exit(0 if ok else 1)
