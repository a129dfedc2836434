#!/usr/bin/env python3
"""EPIPE_TRACE in a multi-process run: each rank writes its own file
(run.rank<R>.json), epipe-trace-merge joins them into one trace with a track
per stage, and every stage's track has a forward and a backward span for
each micro-batch of each step."""
import json
import os
import subprocess
import sys
import tempfile

run, trainer, merge = sys.argv[1:4]
with tempfile.TemporaryDirectory() as d:
    env = dict(os.environ, EPIPE_TRACE=os.path.join(d, "run.json"))
    r = subprocess.run([run, "-n", "3", "--", trainer], env=env, capture_output=True, text=True,
                       timeout=60)
    if r.returncode:
        sys.exit("FAIL: trainer exited %d\n%s%s" % (r.returncode, r.stdout, r.stderr))
    files = [os.path.join(d, "run.rank%d.json" % k) for k in range(3)]
    for f in files:
        if not os.path.exists(f):
            sys.exit("FAIL: %s was not written (have %s)" % (f, os.listdir(d)))
    out = os.path.join(d, "merged.json")
    subprocess.run([sys.executable, merge, out] + files, check=True, capture_output=True)
    events = json.load(open(out))["traceEvents"]
    for stage in range(3):
        names = [e["name"] for e in events if e["pid"] == stage and e.get("cat") == "compute"]
        # minimal_trainer: 100 steps of 4 micro-batches
        for op in ("F", "B"):
            for mb in range(4):
                if names.count("%s%d" % (op, mb)) != 100:
                    sys.exit("FAIL: stage %d has %d spans %s%d, not 100" %
                             (stage, names.count("%s%d" % (op, mb)), op, mb))
        tracks = [e for e in events if e["pid"] == stage and e["name"] == "process_name"]
        if len(tracks) != 1:
            sys.exit("FAIL: stage %d has %d track names" % (stage, len(tracks)))
print("1 passed, 0 failed")
