#!/usr/bin/env python3
"""EPIPE_TRACE in a multi-process run: each rank writes its own file
(run.rank<R>.json), epipe-trace-merge joins them into one trace with a track
per stage (pids from 1), every stage's track has a forward and a backward
slice for each micro-batch of each step, compute slices never contain a
wait, slices carry their step, micro-batch, bytes and codec, and a flow
arrow runs from each send to its receive on the neighbouring rank.
Usage: check_trace.py EPIPE_RUN MINIMAL_TRAINER EPIPE_TRACE_MERGE, or
check_trace.py EPIPE_RUN EPIPE_TRAIN EPIPE_TRACE_MERGE VERBS_LIB: a file per
rank over the rdma transport too (on the test verbs provider)."""
import json
import os
import subprocess
import sys
import tempfile

run, trainer, merge = sys.argv[1:4]
if len(sys.argv) > 4:
    # Over rdma every rank used to write the one file named, over each other.
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, EPIPE_TRACE=os.path.join(d, "rd.json"), EPIPE_TRANSPORT="rdma",
                   EPIPE_IBVERBS_LIB=sys.argv[4])
        r = subprocess.run([run, "-n", "2", "--", trainer, "--epochs", "1", "--train-limit",
                            "320"], env=env, capture_output=True, text=True, timeout=120)
        names = sorted(os.listdir(d))
        if r.returncode or names != ["rd.rank0.json", "rd.rank1.json"]:
            sys.exit("FAIL: over rdma: exit %d, files %s\n%s" % (r.returncode, names,
                                                                 r.stderr[-2000:]))
        for name in names:
            pids = {e.get("pid") for e in json.load(open(os.path.join(d, name)))["traceEvents"]
                    if e.get("ph") == "X"}
            if pids != {int(name[7]) + 1}:
                sys.exit("FAIL: %s holds the slices of pids %s" % (name, sorted(pids)))
        out = os.path.join(d, "merged.json")
        subprocess.run([sys.executable, merge, out] + [os.path.join(d, n) for n in names],
                       check=True, capture_output=True)
    print("ok: over rdma each rank writes its own trace (%s), and they merge" % ", ".join(names))
    sys.exit(0)
STAGES, MB, STEPS = 3, 4, 100  # minimal_trainer: 100 steps of 4 micro-batches
SPEC = "quant:bits=8"
EPS = 0.002  # us: the files print times to 1 ns


def fail(msg):
    sys.exit("FAIL: " + msg)


# Files that are not the library's traces are refused with the file and the
# fault (exit 1), not a Python traceback.
with tempfile.TemporaryDirectory() as d:
    for name, text, why in (("nojson", "{not json", "Expecting property name"),
                            ("list", "[]", "not a Chrome trace"),
                            ("events", '{"traceEvents": 5}', "not a Chrome trace"),
                            ("event", '{"traceEvents": [7]}', "event 0 is not an object"),
                            ("pid", '{"traceEvents": [{"ph": "M", "pid": [1]}]}',
                             "event 0: 'pid' must be an integer"),
                            ("args", '{"traceEvents": [{"ph": "X", "args": 3}]}',
                             "event 0: 'args' must be an object"),
                            ("message", '{"traceEvents": [{"ph": "X", "name": "decode", "pid": 1, '
                             '"ts": 0, "args": {"direction": "activation", "step": "a", '
                             '"microbatch": 0}}]}', "event 0: a message slice needs")):
        path = os.path.join(d, name + ".json")
        with open(path, "w") as f:
            f.write(text)
        r = subprocess.run([sys.executable, merge, os.path.join(d, "out.json"), path],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 1 or why not in r.stderr or path not in r.stderr or \
                "Traceback" in r.stderr:
            fail("merge of %s: exit %d, %r" % (name, r.returncode, r.stderr[-300:]))
    print("ok: malformed trace files refused, each naming the fault")
    # An output that cannot be written: a missing folder, and one cut off
    # by the file-size limit (a full disk's failure), which is removed.
    good = os.path.join(d, "good.json")
    with open(good, "w") as f:
        json.dump({"traceEvents": [{"ph": "X", "name": "F0", "pid": 1, "ts": i, "dur": 1}
                                   for i in range(200)]}, f)

    def small_files():
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))

    for out, why, limit in ((os.path.join(d, "no", "out.json"), "No such file", None),
                            (os.path.join(d, "cut.json"), "File too large", small_files)):
        r = subprocess.run([sys.executable, merge, out, good], capture_output=True, text=True,
                           timeout=60, preexec_fn=limit)
        if r.returncode != 1 or why not in r.stderr or "Traceback" in r.stderr or \
                os.path.exists(out):
            fail("merge into %s: exit %d, %r" % (out, r.returncode, r.stderr[-300:]))
    print("ok: an output that cannot be written is named, and none is left")
    # ... and one that existed stays as it was.
    kept = os.path.join(d, "kept.json")
    with open(kept, "w") as f:
        f.write('{"traceEvents": []}')
    r = subprocess.run([sys.executable, merge, kept, good], capture_output=True, text=True,
                       timeout=60, preexec_fn=small_files)
    with open(kept) as f:
        if r.returncode != 1 or f.read() != '{"traceEvents": []}':
            fail("a failed merge into an existing file changed it: exit %d" % r.returncode)
    # The inputs are never written: a rank's trace as OUT (the slip of leaving
    # OUT out: "epipe-trace-merge run.rank*.json"), OUT among the inputs, an
    # option where OUT goes.
    ranks = [os.path.join(d, "run.rank%d.json" % k) for k in range(2)]
    for path in ranks:
        with open(path, "w") as f:
            f.write('{"traceEvents": []}')
    for args, why in ((ranks, "run.rank0.json is a rank's trace, not a merged one"),
                      ([good, good], "good.json is also an input"),
                      ([kept, ranks[0], kept], "kept.json is also an input"),
                      (["-o", kept, good], "unknown option '-o'")):
        before = {p: open(p).read() for p in (good, kept, *ranks)}
        r = subprocess.run([sys.executable, merge, *args], capture_output=True, text=True,
                           timeout=60)
        after = {p: open(p).read() for p in before}
        if r.returncode != 2 or why not in r.stderr or before != after or \
                os.path.exists(os.path.join(d, "-o")):
            fail("merge %s: exit %d, %r, inputs changed: %s" %
                 (args, r.returncode, r.stderr[-300:], before != after))
    print("ok: the inputs are never the output")

with tempfile.TemporaryDirectory() as d:
    env = dict(os.environ, EPIPE_TRACE=os.path.join(d, "run.json"))
    r = subprocess.run([run, "-n", str(STAGES), "--", trainer, SPEC], env=env,
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        fail("trainer exited %d\n%s%s" % (r.returncode, r.stdout, r.stderr))
    files = [os.path.join(d, "run.rank%d.json" % k) for k in range(STAGES)]
    for f in files:
        if not os.path.exists(f):
            fail("%s was not written (have %s)" % (f, os.listdir(d)))
    out = os.path.join(d, "merged.json")
    subprocess.run([sys.executable, merge, out] + files, check=True, capture_output=True)
    events = json.load(open(out))["traceEvents"]

slices = [e for e in events if e["ph"] == "X"]
# process ids from 1: stage s is pid s + 1, and nothing is on pid 0
pids = sorted({e["pid"] for e in events})
if pids != list(range(1, STAGES + 1)):
    fail("pids %s, not 1..%d" % (pids, STAGES))
for stage in range(STAGES):
    pid = stage + 1
    names = [e for e in events if e["pid"] == pid and e["name"] == "process_name"]
    if len(names) != 1 or names[0]["args"]["name"] != "stage %d" % stage:
        fail("pid %d has track names %s" % (pid, names))
    compute = [e for e in slices if e["pid"] == pid and e["cat"] == "compute"]
    # a forward and a backward slice per micro-batch per step, with their args
    got = sorted((e["args"]["step"], e["name"][0], e["args"]["microbatch"]) for e in compute)
    want = sorted((s, op, mb) for s in range(STEPS) for op in "FB" for mb in range(MB))
    if got != want:
        fail("stage %d: compute slices (step, op, mb) differ from %d steps x %s" %
             (stage, STEPS, [op + str(mb) for op in "FB" for mb in range(MB)]))
    for e in compute:
        if e["name"] != "%s%d" % (e["name"][0], e["args"]["microbatch"]):
            fail("slice %s has microbatch %s" % (e["name"], e["args"]["microbatch"]))
    # compute slices do not contain (or overlap) the stage's waits
    waits = [e for e in slices if e["pid"] == pid and e["cat"] == "wait"]
    if not waits and stage:
        fail("stage %d has no wait slices" % stage)
    allc = sorted((e["ts"], e["ts"] + e["dur"]) for e in compute)
    for w in waits:
        w0, w1 = w["ts"], w["ts"] + w["dur"]
        for c0, c1 in allc:
            if c0 < w1 - EPS and w0 < c1 - EPS:
                fail("stage %d: compute slice [%.3f, %.3f] overlaps wait [%.3f, %.3f]" %
                     (stage, c0, c1, w0, w1))
    # message slices carry step, micro-batch, direction, bytes and codec
    for e in slices:
        if e["pid"] == pid and e["cat"] in ("wait", "decode", "encode"):
            a = e.get("args", {})
            if not a.get("codec", "").startswith(SPEC):  # the canonical spec
                fail("slice %s on stage %d has args %s" % (e["name"], stage, a))
            if a.get("direction") not in ("activation", "gradient") or "step" not in a or \
                    "microbatch" not in a or a.get("bytes", 0) <= 0:
                fail("slice %s on stage %d has args %s" % (e["name"], stage, a))

# a flow arrow from every send to its receive
starts = {e["id"]: e for e in events if e["ph"] == "s"}
ends = {e["id"]: e for e in events if e["ph"] == "f"}
messages = STEPS * MB * (STAGES - 1) * 2
if len(starts) != messages or sorted(starts) != sorted(ends):
    fail("%d flow starts and %d ends, not %d paired" % (len(starts), len(ends), messages))


def inside(pid, name, ts):
    return [e for e in slices if e["pid"] == pid and e["name"] == name and
            e["ts"] - EPS <= ts <= e["ts"] + e["dur"] + EPS]


for i, s in starts.items():
    f = ends[i]
    if f.get("bp") != "e" or abs(s["pid"] - f["pid"]) != 1:
        fail("flow %d from pid %d to pid %d (bp %s)" % (i, s["pid"], f["pid"], f.get("bp")))
    enc, dec = inside(s["pid"], "encode", s["ts"]), inside(f["pid"], "decode", f["ts"])
    if len(enc) != 1 or len(dec) != 1:
        fail("flow %d does not start in one encode and end in one decode slice" % i)
    ea, da = enc[0]["args"], dec[0]["args"]
    for k in ("step", "microbatch", "direction", "bytes"):
        if ea[k] != da[k]:
            fail("flow %d joins a send and a receive that differ in %s: %s vs %s" %
                 (i, k, ea[k], da[k]))
    fwd = f["pid"] == s["pid"] + 1
    if fwd != (ea["direction"] == "activation"):
        fail("flow %d: a %s from pid %d to pid %d" % (i, ea["direction"], s["pid"], f["pid"]))
print("1 passed, 0 failed")
