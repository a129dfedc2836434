#!/usr/bin/python3
"""Test accuracy of the main job (epipe-train) under each schedule, several seeds.

Issue 13 asks that zb-h1 and interleaved reach the accuracy of 1f1b within
seed noise. Every run trains the same model on the same data with the same
codecs; only the schedule (and, for interleaved, the two chunks a rank
holds) changes. Writes one CSV row per run and prints mean +- sd per
schedule as a Markdown table:

    python3 scripts/experiments/schedule_accuracy.py --build build \\
        --epochs 10 --seeds 1,2,3 --csv results/schedule-accuracy.csv
"""
import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import time

SCHEDULES = {
    "1f1b": ["--schedule", "1f1b"],
    "zb-h1": ["--schedule", "zb-h1"],
    "interleaved": ["--schedule", "interleaved", "--chunks", "2"],
}


def run(exe, common, name, seed):
    cmd = [exe] + common + SCHEDULES[name] + ["--seed", str(seed), "--quiet"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.time() - t0
    m = re.search(r"test accuracy\s+([0-9.]+)%", p.stdout)
    if p.returncode != 0 or not m:
        sys.exit("%s failed (exit %d):\n%s%s" % (" ".join(cmd), p.returncode, p.stdout, p.stderr))
    return float(m.group(1)), secs, " ".join(cmd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--hidden", default="512,256,128",
                    help="four layers, so that interleaved's 2 ranks x 2 chunks each get one")
    ap.add_argument("--codec", default="sortquant:bits=8", help="activations and gradients")
    ap.add_argument("--csv", default="results/schedule-accuracy.csv")
    a = ap.parse_args()
    exe = os.path.join(a.build, "examples", "epipe-train")
    common = ["--stages", str(a.stages), "--hidden", a.hidden, "--epochs", str(a.epochs),
              "--act-codec", a.codec, "--grad-codec", a.codec]
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    for name in SCHEDULES:
        for seed in seeds:
            acc, secs, cmd = run(exe, common, name, seed)
            rows.append({"schedule": name, "seed": seed, "accuracy": acc,
                         "seconds": round(secs, 1), "command": cmd})
            print("%-12s seed %d: %.2f%% (%.0f s)" % (name, seed, acc, secs), flush=True)
    os.makedirs(os.path.dirname(a.csv) or ".", exist_ok=True)
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("\n| schedule | runs | test accuracy (mean ± sd) |\n|---|---|---|")
    for name in SCHEDULES:
        acc = [r["accuracy"] for r in rows if r["schedule"] == name]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print("| %s | %d | %.2f ± %.2f |" % (name, len(acc), statistics.mean(acc), sd))


if __name__ == "__main__":
    main()
