#!/usr/bin/env python3
"""Limited-bandwidth runs: epipe-train split into 2 stages, each stage in its
own network namespace, joined by a veth pair whose both ends are rate-limited
with tc (token bucket). For each link rate, codec and micro-batch count it
measures time per batch and the link's average and peak bandwidth (from the
veth's byte counters, sampled every 50 ms through /proc/PID/net/dev of the
rank), and for each codec the test accuracy of a full training run (the
computation does not depend on the link, so that run uses threads).

Needs root (ip netns, tc). Writes docs/bandwidth.md's table to stdout or
--out, JSON lines to --json, and a PNG plot to --plot when matplotlib is
importable. Example:

    sudo python3 scripts/experiments/bandwidth.py --build build-main --out table.md \\
        --json results/bandwidth.jsonl --plot results/bandwidth.png

(results/ holds the raw runs and plots that docs/bandwidth.md links.)
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

NS = ("epipe-bw0", "epipe-bw1")
DEV = ("epbw0", "epbw1")
ADDR = ("10.231.0.1", "10.231.0.2")
PORT = 29731


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def teardown():
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def setup(rate):
    teardown()
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", DEV[0], "netns", NS[0], "type", "veth", "peer", "name", DEV[1],
       "netns", NS[1])
    for i in (0, 1):
        sh("ip", "-n", NS[i], "addr", "add", ADDR[i] + "/24", "dev", DEV[i])
        sh("ip", "-n", NS[i], "link", "set", DEV[i], "up")
        # Both directions are limited: each end shapes what it sends. The
        # bucket holds about 2 ms of traffic at the rate (at least 64 KiB),
        # so bursts cannot beat the rate for long.
        burst = max(65536, int(rate_bits(rate) / 8 * 0.002))
        sh("ip", "netns", "exec", NS[i], "tc", "qdisc", "add", "dev", DEV[i], "root", "tbf",
           "rate", rate, "burst", str(burst), "latency", "100ms")


def rate_bits(rate):
    m = re.fullmatch(r"(\d+)([kmg]?)bit", rate)
    if not m:
        sys.exit("bad rate %r (want e.g. 100mbit)" % rate)
    return int(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def dev_bytes(pid, dev):
    """rx+tx bytes of dev in the network namespace of process pid."""
    try:
        with open("/proc/%d/net/dev" % pid) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == dev:
                    v = rest.split()
                    return int(v[0]) + int(v[8])
    except OSError:
        pass
    return None


def timed_run(train, codec, micro, args):
    """Runs 2 ranks, one a namespace; returns (seconds a batch, avg, peak
    Mbit/s on the link, accuracy line)."""
    procs = []
    for r in (0, 1):
        env = dict(os.environ, EPIPE_RANK=str(r), EPIPE_WORLD_SIZE="2",
                   EPIPE_MASTER_ADDR=ADDR[0], EPIPE_MASTER_PORT=str(PORT),
                   EPIPE_LISTEN_ADDR=ADDR[r], EPIPE_TIMEOUT_MS="60000")
        cmd = ["ip", "netns", "exec", NS[r], train, *codec_args(codec),
               "--microbatches", str(micro), "--quiet"] + args
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    samples = []  # (time, bytes) on rank 0's end of the link
    while procs[0].poll() is None:
        b = dev_bytes(procs[0].pid, DEV[0])
        if b is not None:
            samples.append((time.monotonic(), b))
        time.sleep(0.05)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode:
            raise RuntimeError("rank %d of %s failed:\n%s" % (r, codec, outs[r]))
    # The last stage prints the result: rank 1, or rank 0 under --placement
    # 0,1,0 (the client holds the last layers).
    m = (re.search(r"test accuracy ([0-9.]+)%.*\), ([0-9.]+) samples/s", outs[1]) or
         re.search(r"test accuracy ([0-9.]+)%.*\), ([0-9.]+) samples/s", outs[0]))
    if not m:
        raise RuntimeError("no result line from %s:\n%s" % (codec, outs[1]))
    sps = float(m.group(2))
    # The compute-only ideal of a step: (m+p-1)/m x the slowest stage's
    # compute a step; the measured step is the slowest rank's.
    steps = [tuple(map(float, x)) for o in outs for x in
             re.findall(r"step ([0-9.]+) ms, compute ([0-9.]+) ms a step", o)]
    nstages = getattr(timed_run, "stages", 2)
    ideal = (micro + nstages - 1) / micro * max(c for _, c in steps)
    efficiency = ideal / max(t for t, _ in steps)
    # Peak over 200 ms windows; the average over the stretch where the link
    # carried traffic (training and evaluation).
    peak = 0.0
    j = 0
    for i in range(len(samples)):
        while samples[i][0] - samples[j][0] > 0.2:
            j += 1
        if i > j:
            dt = samples[i][0] - samples[j][0]
            if dt >= 0.15:
                peak = max(peak, (samples[i][1] - samples[j][1]) * 8 / dt / 1e6)
    busy = [s for k, s in enumerate(samples[1:]) if s[1] > samples[k][1]]
    avg = 0.0
    if len(busy) >= 2 and busy[-1][0] > busy[0][0]:
        avg = (busy[-1][1] - busy[0][1]) * 8 / (busy[-1][0] - busy[0][0]) / 1e6
    return sps, avg, peak, efficiency


def codec_args(codec):
    """'A' uses codec A both ways; 'A/G' uses A for activations and G for
    gradients (a trainable activation codec such as insert needs a plain
    gradient codec: the gradient crossing back is its code's)."""
    act, _, grad = codec.partition("/")
    return ["--act-codec", act, "--grad-codec", grad or act]


def accuracy(train, codec, args):
    r = subprocess.run([train, *codec_args(codec), "--quiet",
                        "--stages", "2"] + args, capture_output=True, text=True, timeout=3600)
    m = re.search(r"test accuracy ([0-9.]+)%", r.stdout)
    if r.returncode or not m:
        raise RuntimeError("accuracy run of %s failed:\n%s%s" % (codec, r.stdout, r.stderr))
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build-main", help="meson build directory")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--codecs", default="none,quant:bits=8,sortquant:bits=8,sortquant:bits=4,"
                    "insert:kind=linear,out=64/sortquant:bits=8,"
                    "insert:kind=linear,out=64|sortquant:bits=8/sortquant:bits=8",
                    help="comma-separated codec specs; A/G sets activation and gradient "
                    "codecs apart")
    ap.add_argument("--micro", default="1,4,8")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", default="1024,256",
                    help="epipe-train --hidden; the first width is what crosses the link")
    ap.add_argument("--timed-samples", type=int, default=6400,
                    help="training images in each timed run (1 epoch)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of each accuracy run")
    ap.add_argument("--accuracy-samples", type=int, default=0,
                    help="training images of each accuracy run (default all 60000)")
    ap.add_argument("--train-args", default="",
                    help="more epipe-train options for every run, e.g. '--codec-lr 0.005'")
    ap.add_argument("--out", help="markdown table here (default stdout); avg and peak "
                    "bandwidth count both directions of the link")
    ap.add_argument("--json", help="one JSON object a run here")
    ap.add_argument("--placement", help="epipe-train --placement for the timed runs, e.g. "
                    "0,1,0: the client-server split on the 2 namespaces (the client's two "
                    "boundaries share its link)")
    ap.add_argument("--schedules", default="1f1b",
                    help="comma-separated epipe-train --schedule values for the timed runs")
    ap.add_argument("--no-accuracy", action="store_true",
                    help="skip the full accuracy runs (the table then shows n/a)")
    ap.add_argument("--plot", help="PNG plot here (needs matplotlib)")
    ap.add_argument("--from-json", help="no runs: rebuild the table and plot from these "
                    "JSON lines (written by an earlier --json)")
    a = ap.parse_args()
    if a.from_json:
        rows = [json.loads(line) for line in open(a.from_json) if line.strip()]
        report(a, rows, list(dict.fromkeys(r["codec"] for r in rows)))
        return
    if os.geteuid() != 0:
        sys.exit("bandwidth.py needs root for ip netns and tc (run it with sudo)")
    train = os.path.abspath(os.path.join(a.build, "examples", "epipe-train"))
    if not os.access(train, os.X_OK):
        sys.exit("%s not found: build first (meson setup %s && ninja -C %s)" % (train, a.build,
                                                                                a.build))
    codecs = a.codecs.split(";") if ";" in a.codecs else split_specs(a.codecs)
    common = ["--batch", str(a.batch), "--hidden", a.hidden] + a.train_args.split()
    usable = []
    for c in codecs:  # a codec this build lacks is skipped, and said so
        r = subprocess.run([train, *codec_args(c), "--quiet", "--stages",
                            "2", "--epochs", "1", "--train-limit", str(a.batch)] + common,
                           capture_output=True, text=True)
        if r.returncode:
            print("skipping %s: %s" % (c, (r.stderr or r.stdout).strip().splitlines()[-1]),
                  file=sys.stderr)
        else:
            usable.append(c)
    limit = ["--train-limit", str(a.accuracy_samples)] if a.accuracy_samples else []
    acc = {c: (None if a.no_accuracy else
               accuracy(train, c, common + limit + ["--epochs", str(a.epochs)]))
           for c in usable}
    place = ["--placement", a.placement] if a.placement else []
    timed_run.stages = len(a.placement.split(",")) if a.placement else 2
    rows = []
    if a.json:
        open(a.json, "w").close()
    try:
        for rate in a.rates.split(","):
            setup(rate)
            for sched in a.schedules.split(","):
              for c in usable:
                for m in (int(x) for x in a.micro.split(",")):
                    sps, avg, peak, eff = timed_run(train, c, m, common + place + [
                        "--schedule", sched,
                        "--epochs", "1", "--train-limit", str(a.timed_samples)])
                    row = {"rate": rate, "schedule": sched, "placement": a.placement or "0,1",
                           "codec": c, "microbatches": m,
                           "s_per_batch": a.batch / sps, "avg_mbit": avg, "peak_mbit": peak,
                           "accuracy": acc[c], "ideal_fraction": eff}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    if a.json:
                        with open(a.json, "a") as f:
                            f.write(json.dumps(row) + "\n")
    finally:
        teardown()
    report(a, rows, usable)


def report(a, rows, usable):
    ref = "none" if "none" in usable else usable[0]
    table = ["| link | schedule | codec | micro-batches | s / batch | speed-up vs %s | avg Mbit/s " % ref +
             "| peak Mbit/s | of ideal | test accuracy |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next(x for x in rows if x["rate"] == r["rate"] and x["codec"] == ref
                    and x["microbatches"] == r["microbatches"]
                    and x.get("schedule") == r.get("schedule"))
        acc = "n/a" if r["accuracy"] is None else "%.2f%%" % r["accuracy"]
        table.append("| %s | %s | `%s` | %d | %.4f | %.2fx | %.0f | %.0f | %.0f%% | %s |" % (
            r["rate"], r.get("schedule", "1f1b"), r["codec"].replace("|", "\\|"), r["microbatches"], r["s_per_batch"],
            base["s_per_batch"] / r["s_per_batch"], r["avg_mbit"], r["peak_mbit"],
            100 * r["ideal_fraction"], acc))
    text = "\n".join(table) + "\n"
    if a.out:
        open(a.out, "w").write(text)
    else:
        sys.stdout.write(text)
    if a.plot:
        plot(rows, usable, a.plot)


def split_specs(s):
    """Splits a comma-separated list of specs whose own parameters contain
    commas: a new spec starts at a word followed by ':' or at a bare name."""
    out = []
    for part in s.split(","):
        if out and "=" in part and ":" not in part.split("=")[0]:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def plot(rows, codecs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot (apt-get install python3-matplotlib)",
              file=sys.stderr)
        return
    rates = sorted({r["rate"] for r in rows}, key=rate_bits)
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        micro = sorted({r["microbatches"] for r in rows})
        width = 0.8 / len(codecs)
        for k, c in enumerate(codecs):
            ys = [next(r["s_per_batch"] for r in rows if r["rate"] == rate and r["codec"] == c
                       and r["microbatches"] == m) * 1e3 for m in micro]
            ax.bar([i + k * width for i in range(len(micro))], ys, width, label=c)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(micro))])
        ax.set_xticklabels(["%d micro-batches" % m for m in micro])
        ax.set_ylabel("time per batch (ms)")
        ax.set_title("epipe-train, 2 stages, link %s" % rate)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
