#!/usr/bin/python3
"""One rank of a 2-stage pipeline for scripts/experiments/plan_validation.py:
MODEL cut after layer CUT, the activation and gradient codecs and schedule
given, trained on Fashion-MNIST over libepipe's TCP transport (RANK,
MASTER_ADDR, MASTER_PORT from the environment). The last stage prints one
line "RESULT {json}" with the time per step and the test accuracy."""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
import fmnist_split as base  # noqa: E402
import epipe  # noqa: E402
import epipe.torch as ept  # noqa: E402

SCHEDULES = {"gpipe": ept.ScheduleGPipe, "1f1b": ept.Schedule1F1B, "zb-h1": ept.ScheduleZBH1}


def layers(model, seed=1):
    """The models the validation plans, as flat lists of layers."""
    torch.manual_seed(seed)
    if model == "cnn":
        return list(base.build_parts(seed, n=1)[0].children())
    if model == "mlp":
        nn = torch.nn
        return [nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(),
                nn.Linear(512, 10)]
    raise ValueError(f"unknown model {model}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--cut", type=int, required=True, help="stage 0 holds layers 0..CUT")
    ap.add_argument("--act-codec", default="none")
    ap.add_argument("--grad-codec", default="none")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train-limit", type=int, default=6400)
    ap.add_argument("--test-limit", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    ls = layers(a.model)
    part = torch.nn.Sequential(*(ls[:a.cut + 1] if rank == 0 else ls[a.cut + 1:]))
    comm = epipe.Comm.tcp(rank, 2, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    stage = ept.PipelineStage(part, rank, 2, comm=comm, act_codec=a.act_codec,
                              grad_codec=a.grad_codec)
    sched = SCHEDULES[a.schedule](stage, a.microbatches,
                                  loss_fn=torch.nn.functional.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=0.05, momentum=0.9)
    x, y = base.load(base.DATA_DIR, "train")
    steps = a.train_limit // a.batch
    t_first = None
    for b in range(steps):
        if b == 2:
            t_first = time.perf_counter()  # two steps warm up
        xb, yb = x[b * a.batch:(b + 1) * a.batch], y[b * a.batch:(b + 1) * a.batch]
        opt.zero_grad()
        sched.step(xb, target=yb)
        opt.step()
    step_s = (time.perf_counter() - t_first) / (steps - 2)
    tx, ty = base.load(base.DATA_DIR, "test")
    out = sched.eval(tx[:a.test_limit])
    if stage.is_last:
        acc = (out.argmax(1) == ty[:a.test_limit]).float().mean().item()
        print("RESULT " + json.dumps({"step_seconds": step_s, "accuracy": 100 * acc}),
              flush=True)
    sched.close()
    comm.close()


if __name__ == "__main__":
    main()
