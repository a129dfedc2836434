#!/usr/bin/python3
"""Accuracy against wire ratio for the boundary codecs, on Fashion-MNIST.

Runs examples/torch/fmnist_split.py (3 processes over TCP, started by
epipe-run) once per codec and seed (an entry ACT[/GRAD] sets the activation
and gradient codecs; A+B sets A on boundary 0->1 and B on 1->2), and writes

    accuracy.csv   one row per run                          into --results (default results/)
    accuracy.png   accuracy against wire ratio              into --results
                   (needs python3-matplotlib)
    accuracy.md    mean +- sd test accuracy and wire ratio  into --out (default docs/)
                   per codec, the exact settings and command
                   used, and links to the two files above

Codecs whose spec this libepipe does not parse are skipped with a message. Run it with the Python that has torch:

    /usr/bin/python3 scripts/experiments/accuracy_ablation.py --train-limit 10000 --seeds 1,2,3
"""
import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
import epipe  # noqa: E402

INSERT = "insert:kind=conv,out=4,kernel=2+insert:kind=linear,out=16"
DEFAULT_CODECS = [
    "none",
    "quant:bits=4", "quant:bits=8", "quant:bits=12", "quant:bits=16",
    "sortquant:bits=4", "sortquant:bits=8", "sortquant:bits=12", "sortquant:bits=16",
    "kmeans:bits=4", "kmeans:bits=8",
    # shared=1: a [16,128] boundary is one matrix whose rows share the factors
    # (refused without it: the collapse these rows measure)
    "poweriter:rank=2,shared=1", "poweriter:rank=4,shared=1",
    # low rank on activations only: the gradients cross uncompressed
    "poweriter:rank=2,shared=1/none", "poweriter:rank=4,shared=1/none",
    # ... and only on the conv boundary: a [n,128] activation is one matrix
    # whose low rank is shared by the micro-batch's samples
    "poweriter:rank=4+none/none",
    # insert: a learned conv on boundary 0->1 ([n,16,14,14] -> [n,4,7,7], 1/16 of the
    # values) and a learned projection on 1->2 (128 -> 16); the code's gradient
    # crosses back in fp32, or quantized by sortquant.
    INSERT + "/none", INSERT + "/sortquant:bits=8",
    # the chain insert|sortquant: the code itself quantized to 8 bits too
    INSERT.replace("+", "|sortquant:bits=8+") + "|sortquant:bits=8/sortquant:bits=8",
]
FIELDS = ["codec", "seed", "accuracy", "wire_ratio", "ratio_b01", "ratio_b12", "raw_bytes",
          "wire_bytes", "train_seconds", "test_images", "accuracy_uncompressed"]


class RunFailed(Exception):
    """A training run that stopped with an error (a diverged model makes a
    quantizer refuse non-finite values): reported, not fatal."""


ENTRY_OPTIONS = {"codec_lr": "--codec-lr", "untracked": "--untracked"}


def codec_args(codec):
    """An entry is ACT[/GRAD][#OPT=X[,OPT=X]]: ACT on activations, GRAD
    (default ACT) on gradients; either may be A+B, A on boundary 0->1 and B
    on 1->2. Options: codec_lr, the trainable codecs' learning rate (default:
    --lr); untracked, the share of micro-batches sent untracked with delta=1
    (fmnist_split.py --untracked)."""
    codec, _, opts = codec.partition("#")
    act, _, grad = codec.partition("/")
    args = ["--act-codec", act, "--grad-codec", grad or act]
    for opt in opts.split(",") if opts else []:
        key, _, value = opt.partition("=")
        if key not in ENTRY_OPTIONS or not value:
            raise ValueError(f"entry option '#{opt}': the options are "
                             + ", ".join(f"{k}=X" for k in ENTRY_OPTIONS))
        args += [ENTRY_OPTIONS[key], str(float(value))]
    return args


def run_one(a, codec, seed):
    cmd = [a.launcher, "-n", "3", "--", sys.executable,
           os.path.join(ROOT, "examples", "torch", "fmnist_split.py"),
           *codec_args(codec), "--seed", str(seed),
           "--epochs", str(a.epochs), "--batch", str(a.batch), "--lr", str(a.lr),
           "--microbatches", str(a.microbatches), "--schedule", a.schedule,
           "--eval-uncompressed"]
    if a.train_limit:
        cmd += ["--train-limit", str(a.train_limit)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res = {}
    for line in p.stdout.splitlines():
        if "RESULT " in line:
            r = json.loads(line.split("RESULT ", 1)[1])
            res[r["rank"]] = r
    if p.returncode != 0 or sorted(res) != [0, 1, 2]:
        sys.stderr.write(p.stdout[-3000:])
        # the cause, not its echo: the other ranks report the peer that left
        lines = [ln for ln in p.stdout.splitlines() if "fmnist_split: " in ln]
        first = next((ln for ln in lines if "[EPIPE_EPEER]" not in ln),
                     lines[0] if lines else f"exit status {p.returncode}")
        raise RunFailed(first.split("fmnist_split: ", 1)[-1])
    raw = res[0]["raw_down"] + res[1]["raw_down"]
    wire = res[0]["wire_down"] + res[1]["wire_down"]
    return {
        "codec": codec, "seed": seed, "accuracy": res[2]["accuracy"],
        "wire_ratio": wire / raw,
        "ratio_b01": res[0]["wire_down"] / res[0]["raw_down"],
        "ratio_b12": res[1]["wire_down"] / res[1]["raw_down"],
        "raw_bytes": raw, "wire_bytes": wire,
        "train_seconds": max(r["train_seconds"] for r in res.values()),
        "test_images": res[2]["test_images"],
        "accuracy_uncompressed": res[2]["accuracy_uncompressed"],
    }


def mean_sd(values):
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(rows, codecs):
    out = []
    for c in codecs:
        rs = [r for r in rows if r["codec"] == c]
        if not rs:
            continue
        acc_mean, acc_sd = mean_sd([100 * float(r["accuracy"]) for r in rs])
        ratio = [float(r["wire_ratio"]) for r in rs]
        # runs from before the second evaluation have no such field
        plain = [100 * float(r["accuracy_uncompressed"]) for r in rs
                 if r.get("accuracy_uncompressed") not in (None, "")]
        out.append({
            "codec": c, "n": len(rs),
            "acc_mean": acc_mean, "acc_sd": acc_sd,
            "plain_n": len(plain), "plain": mean_sd(plain) if plain else None,
            "ratio": statistics.mean(ratio),
            "ratio_b01": statistics.mean(float(r["ratio_b01"]) for r in rs),
            "ratio_b12": statistics.mean(float(r["ratio_b12"]) for r in rs),
            "seconds": statistics.mean(float(r["train_seconds"]) for r in rs),
        })
    return out


def table_row(s):
    """One codec's line of the results table."""
    name = s["codec"].replace("|", "\\|")  # a chain's bar is not a cell border
    plain = "—" if s["plain"] is None else "{:.2f} ± {:.2f}".format(*s["plain"])
    if s["plain"] is not None and s["plain_n"] != s["n"]:
        plain += f" ({s['plain_n']} runs)"
    return (f"| `{name}` | {s['n']} | {s['acc_mean']:.2f} ± {s['acc_sd']:.2f} | {plain} | "
            f"{s['ratio']:.4f} | {s['ratio_b01']:.4f} | {s['ratio_b12']:.4f} | "
            f"{s['seconds']:.1f} |")


def write_md(path, a, summary, skipped, command, failed):
    lines = [
        "# Accuracy against wire ratio (Fashion-MNIST, split CNN)",
        "",
        "Generated by `scripts/experiments/accuracy_ablation.py`; do not edit by hand. Each row: a",
        "codec setting (`ACT/GRAD`: activation and gradient codecs; `A+B`: A on boundary",
        "0→1, B on 1→2; one spec: the same everywhere) on both boundaries of",
        "`examples/torch/fmnist_split.py` (client head conv 1→16 | server conv 16→32 + linear",
        "1568→128 | client tail linear 128→10), three processes over TCP on one machine.",
        "",
        "## Settings",
        "",
        f"- command: `{command}`",
        f"- training images: {a.train_limit or 60000} (first of a per-seed shuffle), "
        f"epochs: {a.epochs}, batch {a.batch}, {a.microbatches} micro-batches, "
        f"schedule {a.schedule}, SGD lr {a.lr} momentum 0.9",
        f"- seeds: {', '.join(str(s) for s in a.seeds)} (model init and shuffle)",
        "- test accuracy on all 10,000 test images (forward-only steps, codecs on); then the",
        "  same model once more with no codecs on the boundaries (the trained model on its own;",
        "  — for runs made before this second evaluation existed)",
        "- wire ratio: bytes of the wire messages (192-byte wire header + 16-byte codec header",
        "  + body) over raw fp32 bytes, activations and gradients of both boundaries, training",
        "  only. Boundary 0→1 carries [16,16,14,14] per micro-batch, 1→2 [16,128], so the",
        "  headers weigh more on 1→2.",
        f"- library {epipe.version()}, torch {__import__('torch').__version__}, "
        f"{os.cpu_count()} CPUs shared with other jobs (times are indicative only)",
        "",
        "## Results",
        "",
        "| codec | runs | test accuracy (%) mean ± sd | without codecs at test | wire ratio "
        "| ratio 0→1 | ratio 1→2 | train s/run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [table_row(s) for s in summary]
    if skipped:
        lines += ["", "Skipped (the spec does not parse with this library):", ""]
        lines += [f"- `{c}`: {msg}" for c, msg in skipped]
    if failed:
        lines += ["", "Runs that stopped with an error (not in the table):", ""]
        lines += [f"- `{c}`, seed {seed}: {msg}" for c, seed, msg in failed]
    rel = os.path.relpath(a.results, os.path.dirname(os.path.abspath(path)))
    lines += ["", f"Raw runs: [accuracy.csv]({rel}/accuracy.csv). "
              f"Plot: ![accuracy]({rel}/accuracy.png)", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(path, summary):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (apt-get install python3-matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    families = {}
    for s in summary:
        families.setdefault(s["codec"].split(":")[0], []).append(s)
    for fam, ss in families.items():
        ss.sort(key=lambda s: s["ratio"])
        ax.errorbar([s["ratio"] for s in ss], [s["acc_mean"] for s in ss],
                    yerr=[s["acc_sd"] for s in ss], marker="o", capsize=3, label=fam)
        for s in ss:
            ax.annotate(s["codec"].split("bits=")[-1] if "bits=" in s["codec"] else "",
                        (s["ratio"], s["acc_mean"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("wire ratio (wire bytes / raw fp32 bytes, log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST split CNN: codec on activations and gradients")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default=";".join(DEFAULT_CODECS),
                    help="codec specs separated by ';'")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--train-limit", type=int, default=10000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--launcher", default=os.path.join(ROOT, "build", "tools", "epipe-run"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"), help="accuracy.md here")
    ap.add_argument("--results", default=os.path.join(ROOT, "results"),
                    help="accuracy.csv and accuracy.png here")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in accuracy.csv and do only the missing ones")
    a = ap.parse_args()
    a.seeds = [int(s) for s in a.seeds.split(",")]
    command = "/usr/bin/python3 scripts/experiments/accuracy_ablation.py " + shlex.join(sys.argv[1:])

    codecs, skipped = [], []
    for c in a.codecs.split(";"):
        try:
            try:
                codec_args(c)  # the entry's options
            except ValueError as e:
                sys.exit(f"accuracy_ablation: entry '{c}': {e}")
            for spec in c.partition("#")[0].replace("/", "+").split("+"):
                epipe.Codec(spec).close()
            codecs.append(c)
        except epipe.Error as e:
            print(f"skipping {c}: this libepipe does not parse it: {e.message}")
            skipped.append((c, e.message))

    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    csv_path = os.path.join(a.results, "accuracy.csv")
    rows = []
    if a.resume and os.path.exists(csv_path):
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
    done = {(r["codec"], int(r["seed"])) for r in rows}
    failed = []
    for c in codecs:
        for seed in a.seeds:
            if (c, seed) in done:
                continue
            t = time.time()
            try:
                r = run_one(a, c, seed)
            except RunFailed as e:
                failed.append((c, seed, str(e)))
                print(f"{c:22s} seed {seed}: FAILED: {e}", flush=True)
                continue
            rows.append(r)
            print(f"{c:22s} seed {seed}: accuracy {100 * r['accuracy']:.2f}%  "
                  f"wire ratio {r['wire_ratio']:.4f}  ({time.time() - t:.0f}s)", flush=True)
            with open(csv_path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(rows)
    summary = summarize(rows, codecs)
    write_md(os.path.join(a.out, "accuracy.md"), a, summary, skipped, command, failed)
    print(f"wrote {csv_path} and {os.path.join(a.out, 'accuracy.md')}")
    plot(os.path.join(a.results, "accuracy.png"), summary)


if __name__ == "__main__":
    main()
