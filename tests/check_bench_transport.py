#!/usr/bin/env python3
"""epipe-bench transport --quick --json: one object per size with the
documented keys, positive figures; bad arguments fail with a message."""
import json
import subprocess
import sys

bench = sys.argv[1]
ok = True
r = subprocess.run([bench, "transport", "--quick", "--json", "--reps", "1", "--sizes", "4K,1M"],
                   capture_output=True, text=True, timeout=50)
if r.returncode != 0:
    print("FAIL: exit", r.returncode, r.stderr)
    sys.exit(1)
rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
keys = {"transport", "size", "mbytes_per_s", "raw_mbytes_per_s", "latency_us", "raw_latency_us"}
if [row.get("size") for row in rows] != [4096, 1 << 20]:
    print("FAIL: sizes", rows)
    ok = False
for row in rows:
    print(row)
    if not keys <= set(row):
        print("FAIL: missing keys", keys - set(row))
        ok = False
    if row.get("transport") != "tcp" or not all(row[k] > 0 for k in keys - {"transport"}):
        print("FAIL: bad values", row)
        ok = False
r = subprocess.run([bench, "transport", "--sizes", "3Q"], capture_output=True, text=True)
if r.returncode == 0 or "3Q" not in r.stderr:
    print("FAIL: a bad size must fail and name it:", r.returncode, r.stderr)
    ok = False
sys.exit(0 if ok else 1)
