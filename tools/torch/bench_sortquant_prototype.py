"""The research prototype's sort quantization in PyTorch, timed on a GPU.

The prototype (DESIGN.md, *Reference results*) sorts the whole tensor, cuts
the sorted order into 2^S equal-count chunks and quantises each chunk with
its own min and step, writing the codes back with one scatter per chunk.
This is that algorithm written the straightforward PyTorch way, the baseline
`epipe-bench-cuda` is compared against (issue 11, item 7). It is a
benchmark, not a codec: its output is never put on a wire.

usage: python3 tools/torch/bench_sortquant_prototype.py [--n 12800000]
           [--bits 8] [--split 2] [--reps 10] [--device cuda]
"""
import argparse
import time

import torch


def encode(x, bits, split):
    q = bits - split
    k = 1 << split
    flat = x.reshape(-1)
    n = flat.numel()
    vals, order = torch.sort(flat)
    codes = torch.empty(n, dtype=torch.int32, device=flat.device)
    mins = torch.empty(k, dtype=flat.dtype, device=flat.device)
    steps = torch.empty(k, dtype=flat.dtype, device=flat.device)
    levels = float((1 << q) - 1)
    for c in range(k):
        lo_i, hi_i = n * c // k, n * (c + 1) // k
        if lo_i == hi_i:
            mins[c] = 0.0
            steps[c] = 0.0
            continue
        seg = vals[lo_i:hi_i]
        lo, hi = seg.min(), seg.max()
        step = (hi - lo) / levels
        safe = torch.where(step > 0, step, torch.ones_like(step))
        level = torch.round((seg - lo) / safe).clamp_(0, levels).to(torch.int32)
        codes[order[lo_i:hi_i]] = (c << q) | level  # the scatter per chunk
        mins[c] = lo
        steps[c] = step
    dtype = torch.uint8 if bits <= 8 else torch.int16 if bits <= 16 else torch.int32
    return codes.to(dtype), mins, steps


def decode(codes, mins, steps, bits, split):
    q = bits - split
    c = codes.to(torch.int64) & ((1 << bits) - 1)
    chunk = c >> q
    level = (c & ((1 << q) - 1)).to(mins.dtype)
    return mins[chunk] + level * steps[chunk]


def timed(fn, reps, sync):
    best = float("inf")
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=12_800_000)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--split", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device for PyTorch")
        raise SystemExit(77)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(a.n, generator=g).to(dev)
    y = torch.empty_like(x)
    tc, _ = timed(lambda: y.copy_(x), a.reps, sync)
    te, (codes, mins, steps) = timed(lambda: encode(x, a.bits, a.split), a.reps, sync)
    td, z = timed(lambda: decode(codes, mins, steps, a.bits, a.split), a.reps, sync)
    mse = torch.mean((z - x) ** 2).item()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device: {name}, {a.n} fp32 values, best of {a.reps}")
    print(f"{'torch copy_':40s} {tc * 1e3:9.3f} ms {8.0 * a.n / tc / 1e9:8.1f} GB/s (read+write)")
    print(f"{'prototype sortquant bits=%d split=%d' % (a.bits, a.split):40s} encode {te * 1e3:9.3f} ms "
          f"{a.n / te / 1e6:9.1f} Mval/s {tc / te:7.4f}x copy | decode {td * 1e3:8.3f} ms "
          f"{tc / td:7.4f}x copy | mse {mse:.3e}")


if __name__ == "__main__":
    main()
