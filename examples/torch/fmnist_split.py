#!/usr/bin/python3
"""Split training of a small CNN on Fashion-MNIST with PyTorch and libepipe.

The model is cut as in the research this project continues: the first and
the last layer stay on the "client", the middle runs on the "server". Three
processes, one stage each, over TCP:

    stage 0  client head   conv 1->16, ReLU, max-pool       -> [B,16,14,14]
    stage 1  server        conv 16->32, ReLU, max-pool,
                           linear 1568->128, ReLU            -> [B,128]
    stage 2  client tail   linear 128->10, cross-entropy loss

Start them with the library's launcher (it sets EPIPE_RANK and friends):

    build/tools/epipe-run -n 3 -- /usr/bin/python3 examples/torch/fmnist_split.py \\
        --act-codec sortquant:bits=8 --grad-codec sortquant:bits=8 --train-limit 10000

torchrun, mpirun and srun work too (docs/transport.md). Each rank drives its
stage through the op stream with torch autograd: a forward saves its input
and output per micro-batch; a backward calls torch.autograd.backward with
the gradient received from the next stage and sends the input's gradient to
the previous one. Every rank reads the data set and shuffles it with the same
seed, so stage 0 has the images and stage 2 the labels of each batch.

At the end the last rank prints the test accuracy, and every rank a line
"RESULT {json}" (its boundary statistics; the accuracy on the last rank) that
scripts/experiments/accuracy_ablation.py reads; rank 1, which touches both boundaries,
prints the wire ratio of the whole pipeline.
"""
import argparse
import gzip
import json
import os
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "..", "python"))
import epipe  # noqa: E402

DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, SD = 72.94 / 255, 90.02 / 255  # Fashion-MNIST pixel statistics


def read_idx(path):
    """An IDX file (gzip or plain) as a uint8 tensor of its shape."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    n = 1
    for d in dims:
        n *= d
    body = raw[4 + 4 * ndim :]
    if len(body) != n:
        raise ValueError(f"{path}: {len(body)} bytes of data, the header says {n}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(dims)


def load(data_dir, split):
    pre = "train" if split == "train" else "t10k"
    x = read_idx(os.path.join(data_dir, f"{pre}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(data_dir, f"{pre}-labels-idx1-ubyte.gz")).long()
    x = ((x.float() / 255 - MEAN) / SD).unsqueeze(1)  # [N,1,28,28]
    return x, y


def build_parts(seed):
    """The whole model, made on every rank with the same seed (so a split run
    starts from the same weights as an unsplit one), cut into 3 parts."""
    torch.manual_seed(seed)
    head = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    server = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                           nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU())
    tail = nn.Linear(128, 10)
    return [head, server, tail]


def train_step(stage, model, xs, ys, m):
    """One mini-batch through the op stream. Returns the summed loss (last stage)."""
    saved, loss_sum = {}, 0.0
    for op in stage.ops():
        mb = op.microbatch
        if op.kind == epipe.OP_FORWARD:
            # the received activation is lent by the stage until this
            # micro-batch's backward is over: autograd may keep it, no copy
            x = xs[mb] if stage.is_first else stage.recv_activation(mb).requires_grad_()
            out = model(x)
            if stage.is_last:
                out = F.cross_entropy(out, ys[mb]) / m  # mean over the whole batch
                loss_sum += out.item()
            else:
                stage.send_activation(mb, out)
            saved[mb] = (x, out)
        else:
            x, out = saved.pop(mb)
            if stage.is_last:
                out.backward()
            else:
                torch.autograd.backward(out, stage.recv_gradient(mb))
            if not stage.is_first:
                stage.send_gradient(mb, x.grad)
    return loss_sum


@torch.no_grad()
def eval_step(stage, model, xs, ys):
    """A forward-only step (stage.training is False). Returns correct count."""
    correct = 0
    for op in stage.ops():
        mb = op.microbatch
        x = xs[mb] if stage.is_first else stage.recv_activation(mb)
        out = model(x)
        if stage.is_last:
            correct += int((out.argmax(1) == ys[mb]).sum())
        else:
            stage.send_activation(mb, out)
    return correct


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--act-codec", default="none",
                    help="codec spec for activations; A+B: A on boundary 0->1, B on 1->2")
    ap.add_argument("--grad-codec", default="none",
                    help="codec spec for gradients; A+B as for --act-codec")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train-limit", type=int, default=0, help="use only N training images")
    ap.add_argument("--test-limit", type=int, default=0, help="evaluate only N test images")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--data", default=DATA_DIR)
    return ap.parse_args(argv)


def main():
    a = parse_args()
    if a.batch % a.microbatches:
        sys.exit(f"--batch {a.batch} does not divide into {a.microbatches} micro-batches")
    torch.set_num_threads(a.threads)
    comm = epipe.Comm.from_env()
    if comm.size != 3:
        sys.exit(f"fmnist_split runs as 3 ranks (head, server, tail), not {comm.size}")
    s = comm.rank
    model = build_parts(a.seed)[s]
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    stage = epipe.Stage(comm, a.schedule, a.microbatches, batch_size=a.batch)
    # "A" sets codec A on both boundaries; "A+B" sets A on boundary 0->1 and
    # B on 1->2 (their tensors differ: [n,16,14,14] and [n,128]).
    for direction, specs in ((epipe.ACTIVATION, a.act_codec), (epipe.GRADIENT, a.grad_codec)):
        per_boundary = specs.split("+")
        if len(per_boundary) == 1:
            stage.set_codec(direction, per_boundary[0])
        else:
            for b, spec in enumerate(per_boundary):
                stage.set_codec(direction, spec, boundary=b)

    train_x, train_y = load(a.data, "train")
    test_x, test_y = load(a.data, "test")
    ntrain = min(a.train_limit, len(train_y)) if a.train_limit > 0 else len(train_y)
    ntest = min(a.test_limit, len(test_y)) if a.test_limit > 0 else len(test_y)
    steps = ntrain // a.batch
    m = a.microbatches

    t0 = time.time()
    for epoch in range(a.epochs):
        g = torch.Generator().manual_seed(a.seed * 1000 + epoch)  # the same on every rank
        order = torch.randperm(len(train_y), generator=g)[:ntrain]
        model.train()
        run_loss, te = None, time.time()
        for b in range(steps):
            idx = order[b * a.batch : (b + 1) * a.batch]
            xs = train_x[idx].chunk(m) if stage.is_first else None
            ys = train_y[idx].chunk(m) if stage.is_last else None
            opt.zero_grad(set_to_none=True)
            loss = train_step(stage, model, xs, ys, m)
            opt.step()
            stage.codec_sgd_step(a.lr, a.momentum)  # trainable codecs (insert) learn too
            if stage.is_last:
                run_loss = loss if run_loss is None else 0.98 * run_loss + 0.02 * loss
                if (b + 1) % max(1, steps // 5) == 0 or b + 1 == steps:
                    print(f"epoch {epoch + 1}/{a.epochs} step {b + 1}/{steps} "
                          f"loss {run_loss:.4f} ({time.time() - te:.1f}s)", flush=True)
    train_seconds = time.time() - t0
    st = stage.stats()  # training traffic only

    # evaluation: forward-only steps; batches of up to 1000 split in m
    stage.training = False
    stage.set_param(epipe.STAGE_BATCH_SIZE, 0)  # evaluation batches have their own size
    model.eval()
    eb = (1000 // m) * m
    correct = seen = 0
    for start in range(0, ntest - ntest % m, eb):
        n = min(eb, ntest - start)
        n -= n % m
        xs = test_x[start : start + n].chunk(m) if stage.is_first else None
        ys = test_y[start : start + n].chunk(m) if stage.is_last else None
        correct += eval_step(stage, model, xs, ys)
        seen += n

    raw_down = st["act_sent_raw"] + st["grad_recv_raw"]
    wire_down = st["act_sent_wire"] + st["grad_recv_wire"]
    raw_up = st["act_recv_raw"] + st["grad_sent_raw"]
    wire_up = st["act_recv_wire"] + st["grad_sent_wire"]
    result = {"rank": s, "act_codec": a.act_codec, "grad_codec": a.grad_codec,
              "seed": a.seed, "train_seconds": round(train_seconds, 3),
              "raw_down": raw_down, "wire_down": wire_down, "raw_up": raw_up, "wire_up": wire_up}
    if stage.is_last:
        acc = correct / seen if seen else 0.0
        result.update(accuracy=acc, test_images=seen)
        print(f"test accuracy {100 * acc:.2f}% on {seen} images  (train {ntrain} images x "
              f"{a.epochs} epoch(s), {a.schedule}, {m} micro-batches, batch {a.batch}, "
              f"{train_seconds:.1f}s)", flush=True)
    if s == 1:  # the server sees both boundaries: boundary 0 up, boundary 1 down
        raw, wire = raw_up + raw_down, wire_up + wire_down
        print(f"wire ratio {wire / raw:.4f}  (boundary 0->1 {wire_up / raw_up:.4f}, "
              f"1->2 {wire_down / raw_down:.4f}; activations {a.act_codec}, "
              f"gradients {a.grad_codec}; training traffic, headers included)", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    stage.close()
    comm.close()


if __name__ == "__main__":
    try:
        main()
    except epipe.Error as e:
        sys.exit(f"fmnist_split: {e}")
