#!/usr/bin/python3
"""The split CNN of examples/torch/fmnist_split.py trained in one process,
each boundary crossing replaced by a codec round trip: for trying codec
ideas in minutes before writing them in C.

Same model, data order, batch (64 in 4 micro-batches), SGD and loss
scaling as fmnist_split.py, so with libepipe codecs and no deltas it gives
the pipeline's test accuracy (checked: 86.92% for `none` and 85.36% for
`kmeans:bits=2` activations with deltas, 10,000 images, 6 epochs, seed 1,
as the 3-process run). The deltas and the error feedback are done here in
Python, per sample id and per micro-batch slot as the library does them, so
that any round trip can be put under them, and the relative error of what
crosses is printed per epoch.

Codecs (--act, --grad): `none`, a libepipe spec (`kmeans:bits=2`), or a
prototype written here:

    py:qB     uniform B-bit, one range, 0 on the grid
    py:qBr    the same, one range per sample (quant's rows=1)
    py:qBrs   per sample, stochastic rounding (unbiased)
    py:qBrcK  per sample, the range clipped at K standard deviations
    py:qBrm   per sample, the clipped range of least squared error (each
              end moved in by the same share of the range, 0-60%)
    py:qBgK   one range per group of K values of a sample (196: a channel of
              the conv boundary; per sample where K does not divide it)
    py:kBr    per-sample Lloyd-Max (k-means) codebook, 2^B levels
    py:kBs    one Lloyd-Max codebook for the tensor, its end levels moved to
              the extremes, stochastic rounding between neighbours (unbiased)
    py:g2r    per-sample Gaussian Lloyd-Max levels (+-0.4528, +-1.510 sd)
    rot:C     codec C on the values rotated by a random-sign block Hadamard
              transform (blocks of 64 along each sample), rotated back

    /usr/bin/python3 scripts/experiments/boundary_sim.py --act 'py:q2r' --delta 1 \\
        --grad kmeans:bits=2 --seed 1
"""
import argparse
import math
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "examples", "torch"))
sys.path.insert(0, os.path.join(_ROOT, "python"))
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import epipe  # noqa: E402
import fmnist_split as fs  # noqa: E402


def library_round_trip(spec):
    c = epipe.Codec(spec)

    def f(t):
        t = t.detach().contiguous()
        out = torch.empty_like(t)
        c.decode(c.encode(t), out)
        return out
    return f


def uniform(t, bits, stochastic=False, per_row=False, clip=None, group=0):
    """B-bit uniform levels with 0 on the grid, over the tensor's range or
    each sample's (clip: the range at most clip standard deviations; group:
    one range per run of that many values of a sample, where they divide it)."""
    levels = 2 ** bits - 1
    x = t.reshape(t.shape[0], -1) if per_row else t.reshape(1, -1)
    if group and x.shape[1] % group == 0:
        x = x.reshape(-1, group)
    lo, hi = x.min(1, keepdim=True)[0], x.max(1, keepdim=True)[0]
    if clip:
        mu, sd = x.mean(1, keepdim=True), x.std(1, keepdim=True)
        lo, hi = torch.maximum(lo, mu - clip * sd), torch.minimum(hi, mu + clip * sd)
    step = (hi - lo) / levels
    step = torch.where(step > 0, step, torch.ones_like(step))
    lo = torch.where((lo < 0) & (hi > 0), -torch.round(-lo / step) * step, lo)
    u = (x - lo) / step
    u = torch.floor(u + torch.rand_like(u)) if stochastic else torch.round(u)
    return (lo + u.clamp(0, levels) * step).reshape(t.shape)


def uniform_mse(t, bits):
    """Per-sample B-bit uniform levels whose range is clipped in from both
    ends by the share (0, 5, ... 60% of the range) that gives that sample
    the least squared error."""
    levels = 2 ** bits - 1
    x = t.reshape(t.shape[0], -1)
    lo0, hi0 = x.min(1, keepdim=True)[0], x.max(1, keepdim=True)[0]
    best, best_err = None, None
    for k in range(0, 13):
        f = 0.05 * k
        lo, hi = lo0 + f * (hi0 - lo0) * (lo0 < 0), hi0 - f * (hi0 - lo0) * (hi0 > 0)
        step = (hi - lo) / levels
        step = torch.where(step > 0, step, torch.ones_like(step))
        lo = torch.where((lo < 0) & (hi > 0), -torch.round(-lo / step) * step, lo)
        y = lo + torch.round((x - lo) / step).clamp(0, levels) * step
        err = ((y - x) ** 2).sum(1, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, y, best), torch.minimum(err, best_err)
    return best.reshape(t.shape)


def kmeans_rows(t, bits, iters=8):
    """Lloyd-Max per sample, started at the sample's quantiles."""
    x = t.reshape(t.shape[0], -1)
    k = 2 ** bits
    c = torch.quantile(x, torch.tensor([(i + 0.5) / k for i in range(k)]), dim=1).T.contiguous()
    for _ in range(iters):
        a = (x.unsqueeze(2) - c.unsqueeze(1)).abs().argmin(2)
        oh = F.one_hot(a, k).float()
        cnt = oh.sum(1)
        c = torch.where(cnt > 0, (oh * x.unsqueeze(2)).sum(1) / cnt.clamp_min(1), c)
    a = (x.unsqueeze(2) - c.unsqueeze(1)).abs().argmin(2)
    return torch.gather(c, 1, a).reshape(t.shape)


def kmeans_stochastic(t, bits, iters=8):
    """Tensor-wide Lloyd-Max levels, the outer two moved to min and max so
    that every value lies between two levels, then rounded to one of its
    two neighbours with the probability that keeps its mean."""
    x = t.reshape(-1)
    k = 2 ** bits
    c = torch.quantile(x[torch.randperm(x.numel())[:65536]],
                       torch.tensor([(i + 0.5) / k for i in range(k)]))
    for _ in range(iters):
        a = torch.bucketize(x, (c[1:] + c[:-1]) / 2)
        cnt = torch.bincount(a, minlength=k).float()
        s = torch.zeros(k).index_add_(0, a, x)
        c = torch.where(cnt > 0, s / cnt.clamp_min(1), c)
    c, _ = torch.sort(c)
    c[0], c[-1] = x.min(), x.max()
    j = (torch.bucketize(x, c, right=True) - 1).clamp(0, k - 2)
    lo, hi = c[j], c[j + 1]
    p = ((x - lo) / (hi - lo).clamp_min(1e-30)).clamp(0, 1)
    return torch.where(torch.rand_like(x) < p, hi, lo).reshape(t.shape)


GAUSS2 = torch.tensor([-1.510, -0.4528, 0.4528, 1.510])


def gauss_rows(t):
    x = t.reshape(t.shape[0], -1)
    lv = x.pow(2).mean(1, keepdim=True).sqrt().unsqueeze(2) * GAUSS2
    a = (x.unsqueeze(2) - lv).abs().argmin(2)
    return torch.gather(lv.squeeze(1), 1, a).reshape(t.shape)


def hadamard(k):
    h = torch.ones(1, 1)
    while h.shape[0] < k:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(k)


def rotated(inner, block=64):
    """inner on H·D·x per block of each sample (D random signs, fixed)."""
    h, gen, signs = hadamard(block), torch.Generator().manual_seed(12345), {}

    def f(t):
        x = t.reshape(t.shape[0], -1)
        n = x.shape[1]
        if n % block:
            return inner(t)
        if n not in signs:
            signs[n] = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).float()
        z = ((x * signs[n]).reshape(-1, n // block, block) @ h).reshape(t.shape)
        zq = inner(z.contiguous()).reshape(-1, n // block, block)
        return ((zq @ h).reshape(-1, n) * signs[n]).reshape(t.shape)
    return f


def prototype(name):
    if name == "g2r":
        return gauss_rows
    kind, bits, rest = name[0], int(name[1]), name[2:]
    if kind == "k" and rest == "r":
        return lambda t: kmeans_rows(t.detach(), bits)
    if kind == "k" and rest == "s":
        return lambda t: kmeans_stochastic(t.detach(), bits)
    if kind == "q" and rest == "rm":
        return lambda t: uniform_mse(t.detach(), bits)
    if kind == "q" and rest.startswith("g"):
        return lambda t: uniform(t.detach(), bits, per_row=True, group=int(rest[1:]))
    if kind == "q":
        clip = float(rest.split("c")[1]) if "c" in rest else None
        return lambda t: uniform(t.detach(), bits, "s" in rest, "r" in rest, clip)
    raise SystemExit(f"boundary_sim: unknown prototype 'py:{name}'")


def make(spec):
    if spec == "none":
        return lambda t: t.detach().clone()
    if spec.startswith("rot:"):
        return rotated(make(spec[4:]))
    if spec.startswith("py:"):
        return prototype(spec[3:])
    return library_round_trip(spec)


def rel_err(y, x):
    return float(((y - x) ** 2).sum() / (x ** 2).sum().clamp_min(1e-30))


class Boundary:
    """One boundary: activations forward (deltas per sample id when asked),
    gradients back (error feedback per micro-batch slot when asked)."""

    def __init__(self, a):
        self.act_codec, self.grad_codec = make(a.act), make(a.grad)
        self.delta, self.ef, self.delta_raw = a.delta, a.ef, a.delta_raw
        self.store, self.residual = {}, {}
        self.act_err, self.grad_err = [], []

    def activation(self, x, ids, training, untracked=False):
        x = x.detach()
        if not (self.delta and training) or untracked:
            y = self.act_codec(x)
        else:
            y = torch.empty_like(x)
            known = [i for i, s in enumerate(ids) if s in self.store]
            new = [i for i, s in enumerate(ids) if s not in self.store]
            if new:  # first sightings raw (delta_raw=1) or through the codec
                y[new] = x[new] if self.delta_raw else self.act_codec(x[new].contiguous())
            if known:
                prev = torch.stack([self.store[ids[i]] for i in known])
                y[known] = prev + self.act_codec(x[known] - prev)
            for i, s in enumerate(ids):
                self.store[s] = y[i].clone()
        if training:
            self.act_err.append(rel_err(y, x))
        return y

    def gradient(self, g, mb):
        g = g.detach()
        r = self.residual.get(mb) if self.ef else None
        v = g + r if r is not None and r.shape == g.shape else g
        y = self.grad_codec(v)
        if self.ef:
            self.residual[mb] = v - y
        self.grad_err.append(rel_err(y, g))
        return y


class Crossing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, boundary, ids, mb, untracked=False):
        ctx.boundary, ctx.mb = boundary, mb
        return boundary.activation(x, ids, True, untracked)

    @staticmethod
    def backward(ctx, g):
        return ctx.boundary.gradient(g, ctx.mb), None, None, None, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--act", default="none", help="activation codec (see above)")
    ap.add_argument("--grad", default="none", help="gradient codec (see above)")
    ap.add_argument("--test-act", default="",
                    help="comma-separated activation codecs to evaluate the trained model with "
                         "as well (default: only --act)")
    ap.add_argument("--delta", type=int, default=0, help="1: activation deltas per sample")
    ap.add_argument("--delta-raw", type=int, default=1,
                    help="0: first sightings through the codec, not raw (delta_raw=0)")
    ap.add_argument("--ef", type=int, default=0, help="1: error feedback on gradients")
    ap.add_argument("--plain-last", type=int, default=0,
                    help="K: deltas off in the last K epochs (the codec on whole values, "
                         "as at test)")
    ap.add_argument("--plain-frac", type=float, default=0.0,
                    help="P: each micro-batch untracked with probability P (the codec on "
                         "whole values, as at test, the stored rows left as they are)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--train-limit", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--data", default=fs.DATA_DIR)
    a = ap.parse_args()
    torch.set_num_threads(1)
    parts = fs.build_parts(a.seed, 3)
    model = nn.ModuleList(parts)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    bounds = [Boundary(a), Boundary(a)]
    tx, ty = fs.load(a.data, "train")
    vx, vy = fs.load(a.data, "test")
    n, batch, m = min(a.train_limit, len(ty)), 64, 4
    steps, t0 = n // batch, time.time()
    coin = torch.Generator().manual_seed(a.seed * 7919 + 1)
    for ep in range(a.epochs):
        order = torch.randperm(len(ty), generator=torch.Generator().manual_seed(a.seed * 1000 + ep))
        model.train()
        if a.plain_last and ep == a.epochs - a.plain_last:
            for bd in bounds:
                bd.delta = 0
        for b in range(steps):
            idx = order[:n][b * batch:(b + 1) * batch]
            opt.zero_grad(set_to_none=True)
            for mb, (xi, yi, ii) in enumerate(zip(tx[idx].chunk(m), ty[idx].chunk(m),
                                                  idx.chunk(m))):
                ids = ii.tolist()
                un = a.plain_frac > 0 and float(torch.rand(1, generator=coin)) < a.plain_frac
                h = Crossing.apply(parts[0](xi), bounds[0], ids, mb, un)
                h = Crossing.apply(parts[1](h), bounds[1], ids, mb, un)
                (F.cross_entropy(parts[2](h), yi) / m).backward()
            opt.step()
        last = steps * m

        def mean(v):
            return sum(v[-last:]) / len(v[-last:]) if v else 0.0
        print(f"epoch {ep + 1}: relative squared error, activations "
              f"{mean(bounds[0].act_err):.3e} {mean(bounds[1].act_err):.3e}, gradients "
              f"{mean(bounds[0].grad_err):.3e} {mean(bounds[1].grad_err):.3e}", flush=True)
    model.eval()
    # codecs on at test (rows untracked, as fmnist_split evaluates), off, and
    # each --test-act codec in place of --act
    tests = [a.act, "none"] + [t for t in a.test_act.split(",") if t]
    codecs = {t: (bounds[0].act_codec if t == a.act else make(t)) for t in tests}
    correct = dict.fromkeys(tests, 0)
    with torch.no_grad():
        for s in range(0, len(vy), 1000):
            for xi, yi in zip(vx[s:s + 1000].chunk(m), vy[s:s + 1000].chunk(m)):
                for t in tests:
                    h = codecs[t](parts[1](codecs[t](parts[0](xi))))
                    correct[t] += int((parts[2](h).argmax(1) == yi).sum())
    print(f"test accuracy {100 * correct[a.act] / len(vy):.2f}% "
          f"({100 * correct['none'] / len(vy):.2f}% with the test activations uncompressed)  "
          f"(act {a.act}, grad {a.grad}, delta {a.delta}, raw {a.delta_raw}, ef {a.ef}, "
          f"plain-last {a.plain_last}, plain-frac {a.plain_frac}, seed {a.seed}, "
          f"{time.time() - t0:.0f}s)")
    for t in tests[2:]:
        print(f"  test activations through {t}: {100 * correct[t] / len(vy):.2f}%")

if __name__ == "__main__":
    main()
