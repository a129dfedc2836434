#!/usr/bin/python3
"""The planner against real runs (issue 16, item 4): for the split CNN and a
wider MLP on Fashion-MNIST, on two "machines" (network namespaces joined by a
tc-shaped veth, scripts/experiments/bandwidth.py), each model is profiled
(epipe.torch.profile, one micro-batch, one thread), its codec table measured
(epipe.torch.codec_table), and the planner's 2-stage plan trained beside

    (a) even:        the layers cut in half, codec none, 1F1B
    (b) blind+codec: the split that balances compute (PipeDream-style),
                     the main job's default codecs (sortquant:bits=8, on
                     the gradients with zero=1), 1F1B
    (c) even+codec:  the layers cut in half, the same codecs, 1F1B

with measured time per batch, test accuracy, and for the plan its predicted
step time. --codecs lists the candidate codecs (';' between them), and
--grad-codecs the gradients' where they differ. --microbatches M (default
4) plans and trains with M micro-batches of 16 images a step (a batch of
16 M). --cpus "0-3;4-7" pins stage 0 (and the profile) and stage 1 to
their own CPUs (taskset), for a machine with cores enough that the two
stages compute independently, as two devices would. Needs root. Example:

    sudo /usr/bin/python3 scripts/experiments/plan_validation.py --rates 100mbit,1gbit \\
        --csv results/plan-validation.csv --out docs/plan-validation-table.md
"""
import argparse
import csv
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import bandwidth as bw  # noqa: E402
import epipe.torch as ept  # noqa: E402
import plan_worker  # noqa: E402

CODECS = ["quant:bits=8", "sortquant:bits=8", "sortquant:bits=8,zero=1", "quant:bits=4",
          "sortquant:bits=4", "sortquant:bits=4,zero=1", "topk:ratio=0.1", "cast:dtype=bf16"]
# the main job's defaults (examples/train): activations, gradients
DEFAULT_ACT, DEFAULT_GRAD = "sortquant:bits=8", "sortquant:bits=8,zero=1"
PORT = 29791
MICROBATCH = 16  # images a micro-batch: the profile's, and each step's M of them


def profile(model, mb, codecs, grad_codecs):
    """The model's profile and codec table: one thread, nothing beside it,
    the best of 7 (codecs: 5) runs, as the library does by default. The
    gradients' candidates are grad_codecs where given (None: codecs)."""
    torch.set_num_threads(1)
    import fmnist_split as base

    x, y = base.load(base.DATA_DIR, "train")
    ls = plan_worker.layers(model)
    prof = ept.profile(ls, x[:mb], y[:mb], torch.nn.functional.cross_entropy, reps=7)
    table, skipped = ept.codec_table(prof, sorted(set(codecs) | set(grad_codecs or [])), reps=5)
    keep = {"activation": set(codecs), "gradient": set(grad_codecs or codecs)}
    return prof, [e for e in table if e["spec"] in keep[e["dir"]]]


def balanced_cut(prof):
    fb = [l["forward_s"] + l["backward_s"] for l in prof.layers]
    best, cut = float("inf"), 0
    for k in range(len(fb) - 1):
        v = max(sum(fb[:k + 1]), sum(fb[k + 1:]))
        if v < best:
            best, cut = v, k
    return cut


def cpu_set(text):
    """The CPUs of a taskset-style list ("0-3,8"), checked."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
            sys.exit(f"plan_validation: bad CPU list '{text}' (want e.g. 0-3,8)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    unknown = cpus - os.sched_getaffinity(0)
    if unknown:
        sys.exit(f"plan_validation: CPUs {sorted(unknown)} of '{text}' are not available here")
    return cpus


def run(model, cut, act, grad, schedule, rate, a):
    bw.setup(rate)
    try:
        procs = []
        for r in (0, 1):
            env = {"RANK": str(r), "MASTER_ADDR": bw.ADDR[0], "MASTER_PORT": str(PORT),
                   "PYTHONPATH": os.path.join(ROOT, "python"), "OMP_NUM_THREADS": "1",
                   "EPIPE_LIBRARY": os.path.join(ROOT, a.build, "lib", "libepipe.so")}
            pin = ["taskset", "-c", a.cpu_sets[r]] if a.cpu_sets else []
            cmd = ["ip", "netns", "exec", bw.NS[r], *pin, "env",
                   *[f"{k}={v}" for k, v in env.items()],
                   a.python, os.path.join(HERE, "plan_worker.py"), "--model", model, "--cut",
                   str(cut), "--act-codec", act, "--grad-codec", grad, "--schedule", schedule,
                   "--train-limit", str(a.train_limit), "--test-limit", str(a.test_limit),
                   "--microbatches", str(a.microbatches),
                   "--batch", str(MICROBATCH * a.microbatches)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    finally:
        bw.teardown()
    text = "\n".join(outs)
    if any(p.returncode for p in procs):
        sys.exit(f"{model} cut {cut} {act}/{grad} at {rate} failed:\n{text[-3000:]}")
    line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[0][len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--train-limit", type=int, default=6400)
    ap.add_argument("--test-limit", type=int, default=5000)
    ap.add_argument("--codecs", default=";".join(CODECS),
                    help="the candidate codecs, ';' between them (none always is one)")
    ap.add_argument("--grad-codecs", default=None,
                    help="the gradients' candidates, if not --codecs")
    ap.add_argument("--microbatches", type=int, default=4,
                    help="micro-batches a step, of %d images each" % MICROBATCH)
    ap.add_argument("--act-error", type=float, default=1e-3)
    ap.add_argument("--grad-error", type=float, default=1e-2)
    ap.add_argument("--build", default="build")
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpus", default=None,
                    help="CPU lists of stage 0 and stage 1, ';' between them (e.g. '0-3;4-7')")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("plan_validation: needs root (ip netns, tc)")
    a.cpu_sets = a.cpus.split(";") if a.cpus else None
    if a.cpu_sets:
        if len(a.cpu_sets) != 2:
            sys.exit(f"plan_validation: --cpus '{a.cpus}' needs two CPU lists, one a stage")
        sets = [cpu_set(s) for s in a.cpu_sets]
        if sets[0] & sets[1]:
            sys.exit(f"plan_validation: --cpus '{a.cpus}': the stages share CPUs "
                     f"{sorted(sets[0] & sets[1])}")
        os.sched_setaffinity(0, sets[0])  # the profile runs where stage 0 will
    sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
    rows = []
    for model in a.models.split(","):
        prof, table = profile(model, MICROBATCH, a.codecs.split(";"),
                              a.grad_codecs.split(";") if a.grad_codecs else None)
        L = len(prof.layers)
        for rate in a.rates.split(","):
            bps = bw.rate_bits(rate) / 8
            p = ept.plan(prof, table, stages=2, microbatches=a.microbatches, bandwidth=bps,
                         latency=1e-4,
                         act_error_budget=a.act_error, grad_error_budget=a.grad_error)
            print(f"{model} at {rate}:\n{p.explain()}", flush=True)
            half, blind = L // 2 - 1, balanced_cut(prof)
            configs = [
                ("plan", p.stages[0][1], p.codecs[0][0], p.codecs[0][1], p.schedule,
                 p.step_seconds),
                ("(a) even", half, "none", "none", "1f1b", None),
                ("(b) blind+codec", blind, DEFAULT_ACT, DEFAULT_GRAD, "1f1b", None),
                ("(c) even+codec", half, DEFAULT_ACT, DEFAULT_GRAD, "1f1b", None),
            ]
            for name, cut, act, grad, sched, pred in configs:
                r = run(model, cut, act, grad, sched, rate, a)
                row = {"model": model, "rate": rate, "config": name, "cut_after": cut,
                       "act_codec": act, "grad_codec": grad, "schedule": sched,
                       "predicted_s": pred, "measured_s": r["step_seconds"],
                       "accuracy": r["accuracy"]}
                rows.append(row)
                print(f"  {name:16} cut {cut} {act}/{grad} {sched}: {r['step_seconds']:.4f} s "
                      f"(predicted {pred if pred is None else round(pred, 4)}), "
                      f"{r['accuracy']:.2f}%", flush=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    out = ["| model | link | configuration | cut after layer | codecs (act / grad) | schedule | "
           "predicted s | measured s | plan's speed-up | test accuracy (%) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for model in a.models.split(","):
        for rate in a.rates.split(","):
            rs = [r for r in rows if r["model"] == model and r["rate"] == rate]
            plan_t = rs[0]["measured_s"]
            for r in rs:
                pred = f"{r['predicted_s']:.4f}" if r["predicted_s"] is not None else ""
                sp = f"{r['measured_s'] / plan_t:.2f}x" if r is not rs[0] else ""
                out.append(f"| {model} | {rate} | {r['config']} | {r['cut_after']} | "
                           f"`{r['act_codec']}` / `{r['grad_codec']}` | {r['schedule']} | {pred} | "
                           f"{r['measured_s']:.4f} | {sp} | {r['accuracy']:.2f} |")
    text = "\n".join(out) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
