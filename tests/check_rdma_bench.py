#!/usr/bin/env python3
"""epipe-bench transport --transport rdma over the test verbs provider: the
same JSON rows as tcp plus messages_per_s and cpu_us_per_message; without a
verbs library it fails naming it; a bad --transport is refused."""
import json
import os
import subprocess
import sys

bench, provider = sys.argv[1], sys.argv[2]
ok = True
env = dict(os.environ, EPIPE_IBVERBS_LIB=provider)
r = subprocess.run([bench, "transport", "--transport", "rdma", "--quick", "--json", "--reps", "1",
                    "--sizes", "4,64K,1M"], capture_output=True, text=True, timeout=100, env=env)
if r.returncode != 0:
    print("FAIL: exit", r.returncode, r.stderr)
    sys.exit(1)
rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
keys = {"transport", "size", "messages", "mbytes_per_s", "raw_mbytes_per_s", "latency_us",
        "raw_latency_us", "messages_per_s", "cpu_us_per_message"}
if [row.get("size") for row in rows] != [4, 65536, 1 << 20]:
    print("FAIL: sizes", rows)
    ok = False
for row in rows:
    print(row)
    if not keys <= set(row):
        print("FAIL: missing keys", keys - set(row))
        ok = False
    elif row["transport"] != "rdma" or not all(row[k] > 0 for k in keys - {"transport"}):
        print("FAIL: bad values", row)
        ok = False
env["EPIPE_IBVERBS_LIB"] = "/nonexistent/libibverbs.so.1"
r = subprocess.run([bench, "transport", "--transport", "rdma", "--quick", "--sizes", "4"],
                   capture_output=True, text=True, timeout=60, env=env)
if r.returncode == 0 or "/nonexistent/libibverbs.so.1" not in r.stderr:
    print("FAIL: without a verbs library the bench must fail naming it:", r.returncode, r.stderr)
    ok = False
r = subprocess.run([bench, "transport", "--transport", "pigeon"], capture_output=True, text=True)
if r.returncode == 0 or "pigeon" not in r.stderr:
    print("FAIL: a bad --transport must fail and name it:", r.returncode, r.stderr)
    ok = False
sys.exit(0 if ok else 1)
