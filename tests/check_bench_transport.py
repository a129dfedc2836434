#!/usr/bin/env python3
"""epipe-bench transport --quick --json: one object per size with the
documented keys, positive figures; bad arguments fail with a message."""
import json
import os
import subprocess
import sys
import tempfile

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
# --compare: a second communicator in the same run, its rows beside the first's.
with tempfile.NamedTemporaryFile("w", delete=False) as kf:
    kf.write("a key for the transport bench check, 32+ bytes")
os.chmod(kf.name, 0o600)
r = subprocess.run([bench, "transport", "--quick", "--json", "--reps", "1", "--sizes", "1M",
                    "--options", "key_file=" + kf.name, "--compare", "encrypt=1"],
                   capture_output=True, text=True, timeout=50)
os.unlink(kf.name)
if r.returncode != 0 and "libsodium" in r.stderr:
    print("built without libsodium: --compare encrypt=1 not measured")
elif r.returncode != 0:
    print("FAIL: --compare exit", r.returncode, r.stderr)
    ok = False
else:
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    print(rows)
    if [row.get("transport") for row in rows] != ["tcp", "tcp:encrypt=1"] or \
            not rows[1].get("vs_first_throughput", 0) > 0:
        print("FAIL: --compare rows", rows)
        ok = False
r = subprocess.run([bench, "transport", "--sizes", "3Q"], capture_output=True, text=True)
if r.returncode == 0 or "3Q" not in r.stderr:
    print("FAIL: a bad size must fail and name it:", r.returncode, r.stderr)
    ok = False
sys.exit(0 if ok else 1)
