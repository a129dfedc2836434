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
the previous one. With --schedule zb-h1 the backward is split: the
input-gradient op computes only the input's gradient (torch.autograd.grad,
graph kept) and sends it at once; the weight-gradient op later accumulates
the weight gradients. With --schedule interleaved --chunks 2 the model is cut
into 6 pipeline stages and each rank holds two of them (round-robin: rank r
holds stages r and r+3). Every rank reads the data set and shuffles it with the same
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


# The model as a flat list of layers, and where to cut it into n pipeline
# stages: 1 is the whole model (data parallel alone), 2 convolutions | linear
# layers (the DP x PP example); 3 is the
# research's client/server/client split; 6 (3 ranks x 2
# chunks, interleaved) halves each of its parts.
CUTS = {1: (0, 10), 2: (0, 6, 10), 3: (0, 3, 9, 10), 6: (0, 2, 3, 5, 7, 9, 10)}


def build_parts(seed, n=3):
    """The whole model, made on every rank with the same seed (so a split run
    starts from the same weights as an unsplit one), cut into n parts."""
    if n not in CUTS:
        raise ValueError(f"the model cuts into {sorted(CUTS)} pipeline stages, not {n}")
    torch.manual_seed(seed)
    layers = [nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
              nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(),
              nn.Linear(128, 10)]
    c = CUTS[n]
    return [nn.Sequential(*layers[c[i]:c[i + 1]]) for i in range(n)]


def stage_parts(stage, parts):
    """This rank's model chunks: chunk c is pipeline stage chunk_stage(c)
    (round-robin for interleaved: c * ranks + rank). Returns a list of
    (module, is_first, is_last) per chunk."""
    out = []
    for c in range(stage.chunks):
        ps, n = stage.chunk_stage(c)
        if n != len(parts):
            raise ValueError(f"the schedule has {n} pipeline stages, the model {len(parts)}")
        out.append((parts[ps], ps == 0, ps + 1 == n))
    return out


def train_step(stage, chunks, xs, ys, m):
    """One mini-batch through the op stream; chunks as stage_parts() gives.
    BACKWARD runs the whole backward; a split schedule (zb-h1) gives
    BACKWARD_INPUT (the input's gradient only, sent upstream at once, the
    graph kept) and later BACKWARD_WEIGHT (the weight gradients, accumulated
    into .grad). Returns the summed loss (the rank of the last stage)."""
    saved, loss_sum = {}, 0.0
    for op in stage.ops():
        mb, key = op.microbatch, (op.chunk, op.microbatch)
        model, first, last = chunks[op.chunk]
        if op.kind == epipe.OP_FORWARD:
            # the received activation is lent by the stage until this
            # micro-batch's backward is over: autograd may keep it, no copy
            x = xs[mb] if first else stage.recv_activation(mb).requires_grad_()
            out = model(x)
            if last:
                out = F.cross_entropy(out, ys[mb]) / m  # mean over the whole batch
                loss_sum += out.item()
            else:
                stage.send_activation(mb, out)
            saved[key] = (x, out)
        elif op.kind == epipe.OP_BACKWARD:
            x, out = saved.pop(key)
            if last:
                out.backward()
            else:
                torch.autograd.backward(out, stage.recv_gradient(mb))
            if not first:
                stage.send_gradient(mb, x.grad)
        elif op.kind == epipe.OP_BACKWARD_INPUT:
            x, out = saved[key]
            # the received gradient is lent until the next op: keep a copy for W
            g = None if last else stage.recv_gradient(mb, copy=True)
            if not first:
                gx, = torch.autograd.grad(out, x, g, retain_graph=True)
                stage.send_gradient(mb, gx)
            saved[key] = (x, out, g)
        elif op.kind == epipe.OP_BACKWARD_WEIGHT:
            x, out, g = saved.pop(key)
            params = [p for p in model.parameters() if p.requires_grad]
            # accumulates into each parameter's .grad. The simplest form:
            # from the stage's output it computes the later layers' input
            # gradients again; epipe.torch's ScheduleZBH1 keeps each layer's
            # output gradient from the input op and starts there instead
            if params:
                torch.autograd.backward(out, g, inputs=params)
        else:
            raise RuntimeError(f"fmnist_split: unknown op kind {op.kind}")
    return loss_sum


@torch.no_grad()
def eval_step(stage, chunks, xs, ys):
    """A forward-only step (stage.training is False). Returns correct count."""
    correct = 0
    for op in stage.ops():
        mb = op.microbatch
        model, first, last = chunks[op.chunk]
        x = xs[mb] if first else stage.recv_activation(mb)
        out = model(x)
        if last:
            correct += int((out.argmax(1) == ys[mb]).sum())
        else:
            stage.send_activation(mb, out)
    return correct


def evaluate(stage, chunks, test_x, test_y, ntest, m):
    """Forward-only steps over the first ntest test images, in batches of
    up to 1000 split in m. Returns (correct, seen) on the last stage's
    rank (correct is 0 elsewhere)."""
    eb = (1000 // m) * m
    correct = seen = 0
    for start in range(0, ntest - ntest % m, eb):
        n = min(eb, ntest - start)
        n -= n % m
        xs, ys = test_x[start : start + n].chunk(m), test_y[start : start + n].chunk(m)
        correct += eval_step(stage, chunks, xs, ys)
        seen += n
    return correct, seen


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--act-codec", default="none",
                    help="codec spec for activations; A+B: A on boundary 0->1, B on 1->2")
    ap.add_argument("--grad-codec", default="none",
                    help="codec spec for gradients; A+B as for --act-codec")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b",
                    choices=["gpipe", "1f1b", "zb-h1", "interleaved"])
    ap.add_argument("--chunks", type=int, default=1,
                    help="model chunks per rank (interleaved: 2, the model then cuts in 6)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--codec-lr", type=float, default=None,
                    help="learning rate of the trainable codecs (insert); default: --lr")
    ap.add_argument("--eval-uncompressed", action="store_true",
                    help="evaluate a second time with no codecs on the boundaries (the "
                         "trained model on its own)")
    ap.add_argument("--untracked", type=float, default=0.0,
                    help="with delta=1: each training micro-batch crosses untracked with "
                         "probability P (its values coded whole, as test rows are, and kept "
                         "by neither side), so the model also trains on the codes it meets "
                         "at test")
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
    if not 0 <= a.untracked <= 1 or (a.untracked and "delta=1" not in a.act_codec):
        sys.exit(f"--untracked {a.untracked}: a probability, for an activation codec with "
                 f"delta=1 (not '{a.act_codec}')")
    torch.set_num_threads(a.threads)
    comm = epipe.Comm.from_env()
    if comm.size != 3:
        sys.exit(f"fmnist_split runs as 3 ranks (head, server, tail), not {comm.size}")
    s = comm.rank
    stage = epipe.Stage(comm, a.schedule, a.microbatches, chunks=a.chunks, batch_size=a.batch)
    chunks = stage_parts(stage, build_parts(a.seed, comm.size * stage.chunks))
    model = nn.ModuleList([c[0] for c in chunks])  # this rank's chunks
    holds_last = any(c[2] for c in chunks)  # this rank computes the loss
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    # "A" sets codec A on both boundaries; "A+B" sets A on boundary 0->1 and
    # B on 1->2 (their tensors differ: [n,16,14,14] and [n,128]).
    for direction, specs in ((epipe.ACTIVATION, a.act_codec), (epipe.GRADIENT, a.grad_codec)):
        per_boundary = specs.split("+")
        if len(per_boundary) == 1:
            stage.set_codec(direction, per_boundary[0])
        else:
            for b, spec in enumerate(per_boundary):
                stage.set_codec(direction, spec, boundary=b)

    # activation deltas (delta=1): the first stage names each micro-batch's
    # rows by their data set index every step; later stages get them with
    # the activations
    name_samples = "delta=1" in a.act_codec and stage.is_first

    train_x, train_y = load(a.data, "train")
    test_x, test_y = load(a.data, "test")
    ntrain = min(a.train_limit, len(train_y)) if a.train_limit > 0 else len(train_y)
    ntest = min(a.test_limit, len(test_y)) if a.test_limit > 0 else len(test_y)
    steps = ntrain // a.batch
    m = a.microbatches

    coin = torch.Generator().manual_seed(a.seed * 7919 + 1)  # for --untracked
    t0 = time.time()
    for epoch in range(a.epochs):
        g = torch.Generator().manual_seed(a.seed * 1000 + epoch)  # the same on every rank
        order = torch.randperm(len(train_y), generator=g)[:ntrain]
        model.train()
        run_loss, te = None, time.time()
        for b in range(steps):
            idx = order[b * a.batch : (b + 1) * a.batch]
            xs, ys = train_x[idx].chunk(m), train_y[idx].chunk(m)
            if name_samples:
                for mb, ids in enumerate(idx.chunk(m)):
                    plain = a.untracked > 0 and float(torch.rand(1, generator=coin)) < a.untracked
                    stage.set_samples(mb, None if plain else ids.tolist(), rows=len(ids))
            opt.zero_grad(set_to_none=True)
            loss = train_step(stage, chunks, xs, ys, m)
            opt.step()
            # trainable codecs (insert) learn too
            stage.codec_sgd_step(a.lr if a.codec_lr is None else a.codec_lr, a.momentum)
            if holds_last:
                run_loss = loss if run_loss is None else 0.98 * run_loss + 0.02 * loss
                if (b + 1) % max(1, steps // 5) == 0 or b + 1 == steps:
                    print(f"epoch {epoch + 1}/{a.epochs} step {b + 1}/{steps} "
                          f"loss {run_loss:.4f} ({time.time() - te:.1f}s)", flush=True)
    train_seconds = time.time() - t0
    st = stage.stats()  # training traffic only

    stage.training = False
    stage.set_param(epipe.STAGE_BATCH_SIZE, 0)  # evaluation batches have their own size
    model.eval()
    correct, seen = evaluate(stage, chunks, test_x, test_y, ntest, m)
    plain = None
    if a.eval_uncompressed:
        # the trained model on its own: a stage keeps its codecs for life,
        # so the test set crosses once more through one without any
        stage.close()
        stage = epipe.Stage(comm, a.schedule, a.microbatches, chunks=a.chunks)
        stage.training = False
        plain, _ = evaluate(stage, chunks, test_x, test_y, ntest, m)

    raw_down = st["act_sent_raw"] + st["grad_recv_raw"]
    wire_down = st["act_sent_wire"] + st["grad_recv_wire"]
    raw_up = st["act_recv_raw"] + st["grad_sent_raw"]
    wire_up = st["act_recv_wire"] + st["grad_sent_wire"]
    result = {"rank": s, "act_codec": a.act_codec, "grad_codec": a.grad_codec,
              "seed": a.seed, "train_seconds": round(train_seconds, 3),
              "raw_down": raw_down, "wire_down": wire_down, "raw_up": raw_up, "wire_up": wire_up}
    if holds_last:
        acc = correct / seen if seen else 0.0
        result.update(accuracy=acc, test_images=seen)
        print(f"test accuracy {100 * acc:.2f}% on {seen} images  (train {ntrain} images x "
              f"{a.epochs} epoch(s), {a.schedule}, {m} micro-batches, batch {a.batch}, "
              f"{train_seconds:.1f}s)", flush=True)
        if plain is not None:
            plain_acc = plain / seen if seen else 0.0
            result.update(accuracy_uncompressed=plain_acc)
            print(f"test accuracy {100 * plain_acc:.2f}% with the test activations "
                  "uncompressed", flush=True)
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
