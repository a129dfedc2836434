#!/usr/bin/python3
"""Data parallel against pipeline parallel over a rate-limited link (issue 15,
item 4; the research's comparison redone): the split CNN of
examples/torch/fmnist_dp_pp.py on two "machines", network namespaces joined
by a veth pair shaped with tc (scripts/experiments/bandwidth.py sets them up),
trained

    dp-*   as 2 data-parallel replicas of the whole model, each on half of
           every batch, averaging gradients through torch.distributed (Gloo)
           uncompressed (DDP's own all-reduce hook), with libepipe's
           compressed hook, or with PyTorch's PowerSGD hook;
    pp-*   as a 2-stage pipeline (convolutions | linear layers, 1F1B, 4
           micro-batches) over libepipe's TCP transport, with and without
           compressed boundaries.

Each run is two processes, one per namespace, with torchrun's variables set
by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a torchrun agent per
namespace would do the same). Prints time per batch and test accuracy per
configuration and link rate; writes the rows as CSV, the table as Markdown
and a plot. Needs root (ip netns, tc). Example:

    sudo /usr/bin/python3 scripts/experiments/dp_vs_pp.py --rates 100mbit,1gbit \\
        --csv results/dp-vs-pp.csv --out docs/dp-vs-pp.md --plot results/dp-vs-pp.png
"""
import argparse
import csv
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bandwidth as bw  # noqa: E402  (the namespaces and the shaping)

CONFIGS = {
    "dp-plain": ["--stages", "1", "--allreduce-codec", "plain"],
    "dp-sortquant8": ["--stages", "1", "--allreduce-codec", "sortquant:bits=8"],
    "dp-powersgd": ["--stages", "1", "--allreduce-codec", "powersgd"],
    "pp-none": ["--stages", "2", "--codec", "none"],
    "pp-sortquant8": ["--stages", "2", "--codec", "sortquant:bits=8"],
}
PORT = 29761


def run(config, rate, a):
    bw.setup(rate)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR=bw.ADDR[0], MASTER_PORT=str(PORT),
               PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1",
               EPIPE_LIBRARY=os.path.join(ROOT, a.build, "lib", "libepipe.so"))
    script = os.path.join(ROOT, "examples", "torch", "fmnist_dp_pp.py")
    procs = []
    t0 = time.time()
    for r in (0, 1):
        e = dict(env, RANK=str(r), GLOO_SOCKET_IFNAME=bw.DEV[r])
        cmd = ["ip", "netns", "exec", bw.NS[r], "env", *[f"{k}={v}" for k, v in e.items()
                                                          if k in ("RANK", "WORLD_SIZE",
                                                                   "MASTER_ADDR", "MASTER_PORT",
                                                                   "PYTHONPATH", "OMP_NUM_THREADS",
                                                                   "EPIPE_LIBRARY",
                                                                   "GLOO_SOCKET_IFNAME")],
               a.python, script, *CONFIGS[config], "--microbatches", "4", "--batch",
               str(a.batch), "--train-limit", str(a.train_limit), "--test-limit",
               str(a.test_limit)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    wall = time.time() - t0
    bw.teardown()
    text = "\n".join(outs)
    if any(p.returncode for p in procs):
        sys.exit(f"{config} at {rate} failed:\n{text[-3000:]}")
    m = re.search(r"test accuracy ([0-9.]+)%.*?wire ratio ([0-9.]+); ([0-9.]+) s a step", text)
    if not m:
        sys.exit(f"{config} at {rate}: no result line:\n{text[-3000:]}")
    return {"config": config, "rate": rate, "accuracy": float(m.group(1)),
            "allreduce_wire_ratio": float(m.group(2)), "step_seconds": float(m.group(3)),
            "train_images": a.train_limit, "test_images": a.test_limit, "wall_seconds": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100mbit")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train-limit", type=int, default=12800)
    ap.add_argument("--test-limit", type=int, default=5000)
    ap.add_argument("--build", default="build")
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--out", default=None, help="the Markdown table here")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("dp_vs_pp: needs root (ip netns, tc)")
    rows = []
    for rate in a.rates.split(","):
        for config in a.configs.split(","):
            r = run(config, rate, a)
            print(f"{rate:>8} {config:<15} {r['step_seconds']:.4f} s a batch, "
                  f"accuracy {r['accuracy']:.2f}%", flush=True)
            rows.append(r)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    table = ["| link | configuration | time per batch (s) | vs dp-plain | test accuracy (%) |",
             "|---|---|---|---|---|"]
    for rate in a.rates.split(","):
        base = next((r["step_seconds"] for r in rows
                     if r["rate"] == rate and r["config"] == "dp-plain"), None)
        for r in rows:
            if r["rate"] != rate:
                continue
            rel = f"{base / r['step_seconds']:.2f}x" if base else ""
            table.append(f"| {rate} | `{r['config']}` | {r['step_seconds']:.4f} | {rel} | "
                         f"{r['accuracy']:.2f} |")
    text = "\n".join(table) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    if a.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("dp_vs_pp: no matplotlib, no plot", file=sys.stderr)
            return
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            ax.scatter(r["step_seconds"], r["accuracy"],
                       marker="o" if r["config"].startswith("dp") else "s")
            ax.annotate(f"{r['config']} @{r['rate']}", (r["step_seconds"], r["accuracy"]),
                        fontsize=7, xytext=(4, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("time per batch (s, log)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("Data parallel vs pipeline over a shaped link (split CNN, Fashion-MNIST)")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
