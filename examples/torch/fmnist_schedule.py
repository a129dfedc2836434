#!/usr/bin/python3
"""The split CNN of fmnist_split.py trained with epipe.torch's front end:
each rank wraps its part in a PipelineStage and calls Schedule1F1B.step(),
as torch.distributed.pipelining's users do. Run as 3 processes:

    build/tools/epipe-run -n 3 -- /usr/bin/python3 examples/torch/fmnist_schedule.py

Where torch has a GPU the stages run on it (--device auto, the default:
cuda:LOCAL_RANK modulo the GPUs torch sees): the activations and gradients
are then encoded and decoded on the GPU, and only the payloads cross to the
host for the transport. --device cpu keeps them on the CPU.

fmnist_split.py shows the op stream underneath (and zb-h1, interleaved,
codecs per boundary); this file is what most hosts need.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fmnist_split as base  # noqa: E402  (the data loader and the model)
import epipe  # noqa: E402
import epipe.torch as ept  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="sortquant:bits=8", help="activations and gradients")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train-limit", type=int, default=6400)
    ap.add_argument("--test-limit", type=int, default=1000)
    ap.add_argument("--data", default=base.DATA_DIR)
    ap.add_argument("--device", default="auto", help="auto (a GPU where torch has one), cpu, "
                    "cuda or cuda:N")
    a = ap.parse_args()
    torch.set_num_threads(1)
    device = a.device
    if device == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = int(os.environ.get("EPIPE_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{local % gpus}" if gpus else "cpu"
    # ---- the pipeline: from here to the end of training, under 30 lines
    comm = epipe.Comm.from_env()
    parts = base.build_parts(seed=1, n=comm.size)  # the same weights on every rank
    stage = ept.PipelineStage(parts[comm.rank].to(device), comm.rank, comm.size, device,
                              comm=comm, act_codec=a.codec, grad_codec=a.codec)
    sched = ept.Schedule1F1B(stage, a.microbatches,
                             loss_fn=torch.nn.functional.cross_entropy)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.05, momentum=0.9)
    x, y = base.load(a.data, "train")
    for b in range(a.train_limit // a.batch):
        xb, yb = x[b * a.batch:(b + 1) * a.batch], y[b * a.batch:(b + 1) * a.batch]
        opt.zero_grad()
        losses = []
        sched.step(xb, target=yb, losses=losses)  # each rank passes what it has
        opt.step()
        if stage.is_last and (b + 1) % 20 == 0:
            print(f"step {b + 1} loss {sum(losses).item() / len(losses):.4f}", flush=True)
    tx, ty = base.load(a.data, "test")
    out = sched.eval(tx[:a.test_limit])  # forward only
    # ---- end of the pipeline code
    if stage.is_last:
        acc = (out.argmax(1).cpu() == ty[:a.test_limit]).float().mean().item()
        print(f"test accuracy {100 * acc:.2f}%  ({a.test_limit} images); "
              f"{sched.stats()['samples_per_second']:.0f} samples/s on {stage.device}",
              flush=True)
    sched.close()
    comm.close()


if __name__ == "__main__":
    main()
