#!/usr/bin/python3
"""Data parallel x pipeline parallel: the split CNN of fmnist_split.py in
REPLICAS pipelines of STAGES stages, each stage's replicas averaging their
gradients through torch.distributed with a libepipe-compressed DDP hook.
Started by torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; 2 replicas x 3 stages:

    python3 -m torch.distributed.run --nproc_per_node 6 examples/torch/fmnist_dp_pp.py

Rank layout: rank = replica * STAGES + stage. Pipeline `replica` is ranks
replica*STAGES .. replica*STAGES+STAGES-1 over libepipe's TCP transport,
meeting at MASTER_PORT + 1 + replica (or --epipe-port + replica); the replicas of stage s (ranks s,
STAGES + s, ...) form a torch.distributed group (Gloo on CPUs) that
all-reduces that stage's gradients after each step. Each replica trains on
its share of every batch, so a step sees the whole batch, as one pipeline
with a batch REPLICAS times larger would (with --allreduce-codec none the
weights are the same, up to float rounding: tests/check_dp_pp.py).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fmnist_split as base  # noqa: E402  (the data loader and the model)
import epipe  # noqa: E402
import epipe.torch as ept  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--codec", default="sortquant:bits=8", help="pipeline boundaries")
    ap.add_argument("--allreduce-codec", default="sortquant:bits=8",
                    help="the DDP hook's codec; 'plain' for DDP's own uncompressed all-reduce, "
                         "'powersgd' for PyTorch's PowerSGD hook")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="per step, over all replicas")
    ap.add_argument("--train-limit", type=int, default=6400)
    ap.add_argument("--test-limit", type=int, default=1000)
    ap.add_argument("--data", default=base.DATA_DIR)
    ap.add_argument("--save", default=None, help="stage weights to FILE.<stage> (replica 0)")
    ap.add_argument("--epipe-port", type=int, default=None,
                    help="replica r's pipeline meets at this port + r (default MASTER_PORT + 1)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % a.stages:
        sys.exit(f"fmnist_dp_pp: {world} ranks do not make pipelines of {a.stages} stages")
    replicas = world // a.stages
    replica, s = divmod(rank, a.stages)
    dist.init_process_group("gloo")
    groups = [dist.new_group([r * a.stages + g for r in range(replicas)])
              for g in range(a.stages)]  # every rank creates every group
    base_port = a.epipe_port if a.epipe_port else int(os.environ["MASTER_PORT"]) + 1
    comm = epipe.Comm.tcp(s, a.stages, os.environ["MASTER_ADDR"], base_port + replica)
    parts = base.build_parts(seed=1, n=a.stages)  # the same weights on every replica
    stage = ept.PipelineStage(parts[s], s, a.stages, comm=comm, act_codec=a.codec,
                              grad_codec=a.codec)
    sched = ept.Schedule1F1B(stage, a.microbatches, loss_fn=torch.nn.functional.cross_entropy)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.05, momentum=0.9)
    if a.allreduce_codec == "plain":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        state, hook = groups[s], default_hooks.allreduce_hook
    elif a.allreduce_codec == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=groups[s], matrix_approximation_rank=2,
                                   start_powerSGD_iter=2)
        hook = psgd.powerSGD_hook
    else:
        state = ept.CompressedAllreduceState(a.allreduce_codec, group=groups[s])
        hook = ept.compressed_allreduce_hook
    x, y = base.load(a.data, "train")
    share = a.batch // replicas
    steps = a.train_limit // a.batch
    t_first = None
    for b in range(steps):
        if b == 1:
            t_first = time.perf_counter()  # the first step warms up
        lo = b * a.batch + replica * share
        xb, yb = x[lo:lo + share], y[lo:lo + share]
        opt.zero_grad()
        losses = []
        sched.step(xb, target=yb, losses=losses)
        if replicas > 1:
            ept.allreduce_gradients(stage.submod.parameters(), state, hook)
        opt.step()
        if stage.is_last and replica == 0 and (b + 1) % 20 == 0:
            print(f"step {b + 1} loss {sum(losses).item() / len(losses):.4f}", flush=True)
    step_s = (time.perf_counter() - t_first) / (steps - 1) if steps > 1 else float("nan")
    tx, ty = base.load(a.data, "test")
    out = sched.eval(tx[:a.test_limit])
    if stage.is_last and replica == 0:
        acc = (out.argmax(1) == ty[:a.test_limit]).float().mean().item()
        wire = getattr(state, "bytes_wire", 0) / max(1, getattr(state, "bytes_raw", 0))
        print(f"test accuracy {100 * acc:.2f}%  ({a.test_limit} images); all-reduce wire "
              f"ratio {wire:.4f}; {step_s:.4f} s a step", flush=True)
    if a.save and replica == 0:
        torch.save(stage.submod.state_dict(), f"{a.save}.{s}")
    sched.close()
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
