#!/usr/bin/env python3
"""epipe-train, the main job, on a slice of Fashion-MNIST: as 3 processes over
TCP (started by epipe-run) it reaches the same test accuracy as its 3 stages
as threads of one process (the same seed gives the same computation), that
accuracy is far above chance, and every stage reports its row."""
import os
import re
import subprocess
import sys

run, train = sys.argv[1], sys.argv[2]
DATA = "/usr/share/datasets/fashion-mnist"
if not os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte.gz")):
    print("SKIP: Fashion-MNIST is not installed (Debian package dataset-fashion-mnist)")
    sys.exit(77)

ARGS = ["--epochs", "1", "--train-limit", "4000", "--quiet", "--microbatches", "4"]
ACC = re.compile(r"test accuracy ([0-9.]+)%")


def accuracy(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, EPIPE_TIMEOUT_MS="20000"))
    if r.returncode:
        sys.exit("FAIL: %s exited %d\n%s%s" % (" ".join(cmd), r.returncode, r.stdout, r.stderr))
    m = ACC.search(r.stdout)
    if not m:
        sys.exit("FAIL: no accuracy line from %s\n%s" % (" ".join(cmd), r.stdout))
    return float(m.group(1)), r.stdout


threads, _ = accuracy([train, "--stages", "3", *ARGS])
procs, out = accuracy([run, "-n", "3", "--", train, *ARGS])
for s in range(3):
    if not re.search(r"^\[rank %d\] stage %d: " % (s, s), out, re.M):
        sys.exit("FAIL: stage %d printed no row:\n%s" % (s, out))
print("threads %.2f%%, processes over TCP %.2f%%" % (threads, procs))
# Issue 13: the same three pipeline stages on two ranks in the client-server
# placement (rank 0 holds the first and the last layers) with the zero-bubble
# schedule, and interleaved chunks, compute the same thing: the same accuracy.
cs, _ = accuracy([run, "-n", "2", "--", train, *ARGS, "--placement", "0,1,0",
                  "--schedule", "zb-h1"])
inter, _ = accuracy([train, "--stages", "3", "--chunks", "1", "--schedule", "interleaved", *ARGS])
print("client-server zb-h1 over TCP %.2f%%, interleaved threads %.2f%%" % (cs, inter))
if abs(cs - threads) > 1e-9 or abs(inter - threads) > 1e-9:
    sys.exit("FAIL: the client-server or interleaved run's accuracy differs")
if abs(threads - procs) > 1e-9:
    sys.exit("FAIL: the TCP run's accuracy differs from the threads run's")
if procs < 60.0:
    sys.exit("FAIL: accuracy %.2f%% is too close to chance (10%%)" % procs)
print("1 passed, 0 failed")
