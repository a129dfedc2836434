#!/usr/bin/env python3
"""epipe-bench pipeline --compare runs every schedule it compares (1f1b, zb-h1,
interleaved with 2 chunks, zb-v, 1f1b-2bw) through the stage runtime and prints, for each,
the measured and the simulated step time and both ratios to 1f1b; the simulated
ratios are the simulator's (tiny costs: this checks the plumbing, not timing)."""
import json
import subprocess
import sys

bench = sys.argv[1]
r = subprocess.run([bench, "pipeline", "--compare", "--fwd-ms", "0.2", "--bwd-ms", "0.2",
                    "--w-ms", "0.2", "--steps", "3", "--json"],
                   capture_output=True, text=True, timeout=120)
if r.returncode:
    sys.exit("FAIL: exit %d\n%s%s" % (r.returncode, r.stdout, r.stderr))
rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
kinds = [(x["kind"], x["chunks"]) for x in rows]
if kinds != [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2), ("1f1b-2bw", 1)]:
    sys.exit("FAIL: rows %s" % kinds)
for x in rows:
    for key in ("measured_step_ms", "simulated_step_ms", "measured_vs_1f1b",
                "simulated_vs_1f1b", "overhead_us_per_op", "overhead_cpu_us_per_op"):
        if not x[key] > 0:
            sys.exit("FAIL: %s %s = %r" % (x["kind"], key, x[key]))
# The simulator's own figures for these costs: zero-bubble and interleaving beat 1f1b,
# and without a flush the steady step has no bubble at all.
sim = {x["kind"]: x["simulated_vs_1f1b"] for x in rows}
if not (sim["1f1b"] == 1.0 and sim["zb-h1"] < 1 and sim["interleaved"] < 1 and sim["zb-v"] < 1
        and sim["1f1b-2bw"] < sim["zb-v"]):
    sys.exit("FAIL: simulated ratios %s" % sim)
print("1 passed, 0 failed")
