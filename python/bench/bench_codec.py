#!/usr/bin/env python3
"""The binding's codec paths against the C library's, side by side in one run:
runs `epipe-bench codec SPEC --json` for the C numbers, times the same codec
through the epipe package on a tensor of the same size, and prints both.

    python/bench/bench_codec.py [SPEC ...] [--n 12800000] [--reps 5] [--rounds 3]
                                [--threads 1] [--bench build/tools/epipe-bench] [--json]

Each time is the best of --reps runs (as epipe-bench does), and the C and binding
measurements alternate for --rounds rounds, each side keeping its best, so that
a burst of load from other processes hits both alike. The binding/C column is
the binding's throughput over C's for the same operation on memory used the
same way (1.00: no binding tax); binding/C-reuse compares every path with C
writing into memory it reuses, the fastest C can go.
Paths: encode(t, out=buf) and encode_view(t) reuse memory; encode(t) returns new
bytes (one copy of the payload); decode(p, out=t) writes a given tensor;
decode(p, shape=) allocates the tensor it returns. C's counterparts of the two
allocating paths are `epipe-bench codec --fresh` (malloc before each call, free
after), which pay the same first-touch page faults."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def find_bench(arg):
    for c in (arg, os.environ.get("EPIPE_BENCH"), os.path.join(ROOT, "build", "tools",
                                                                "epipe-bench"),
              shutil.which("epipe-bench")):
        if c and os.path.exists(c):
            return c
    sys.exit("no epipe-bench: pass --bench PATH or set EPIPE_BENCH")


def c_numbers(bench, spec, n, reps, threads):
    r = subprocess.run([bench, "codec", spec, "--shape", str(n), "--reps", str(reps),
                        "--threads", str(threads), "--no-ref", "--fresh", "--json"],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def best(reps, fn):
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def binding_numbers(epipe, torch, spec, n, reps, threads):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    y = torch.empty_like(x)
    c = epipe.Codec(spec)
    c.set_threads(threads)
    out = bytearray(c.max_encoded_size(x))
    payload = bytes(c.encode(x, out=out))
    c.encode_view(x)  # the reused buffer gets its size
    mv = n / 1e6
    res = {
        "memcpy": mv / best(reps, lambda: y.copy_(x)),
        "encode(out=)": mv / best(reps, lambda: c.encode(x, out=out)),
        "encode_view": mv / best(reps, lambda: c.encode_view(x)),
        "encode->bytes": mv / best(reps, lambda: c.encode(x)),
        "decode(out=)": mv / best(reps, lambda: c.decode(payload, out=y)),
        "decode(shape=)": mv / best(reps, lambda: c.decode(payload, shape=(n,))),
    }
    c.close()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="*", default=["none", "quant:bits=8", "sortquant:bits=8"])
    ap.add_argument("--n", type=int, default=12_800_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bench")
    ap.add_argument("--json", action="store_true", help="one JSON line per spec")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))  # the source tree's package, if not installed
    import torch

    import epipe

    torch.set_num_threads(max(1, a.threads))
    bench = find_bench(a.bench)
    if not a.json:
        print(f"libepipe {epipe.version()} ({epipe.library_path}) vs {bench}; "
              f"{a.n} fp32 values, threads={a.threads}, best of {a.reps} x {a.rounds} rounds")
        print(f"{'codec':<20} {'path':<15} {'binding Mv/s':>12} {'C Mv/s':>9} {'binding/C':>9} "
              f"{'binding/C-reuse':>15}")
    for spec in a.specs:
        cn, bn = {}, {}
        for _ in range(max(1, a.rounds)):
            for k, v in c_numbers(bench, spec, a.n, a.reps, a.threads).items():
                if k.endswith("_mvals"):
                    cn[k] = max(cn.get(k, 0), v)
            for k, v in binding_numbers(epipe, torch, spec, a.n, a.reps, a.threads).items():
                bn[k] = max(bn.get(k, 0), v)
        reuse = {"memcpy": cn["memcpy_mvals"], "encode(out=)": cn["encode_mvals"],
                 "encode_view": cn["encode_mvals"], "encode->bytes": cn["encode_mvals"],
                 "decode(out=)": cn["decode_mvals"], "decode(shape=)": cn["decode_mvals"]}
        c_of = dict(reuse, **{"encode->bytes": cn["fresh_encode_mvals"],
                              "decode(shape=)": cn["fresh_decode_mvals"]})
        if a.json:
            print(json.dumps({"codec": spec, "n": a.n, "threads": a.threads,
                              "binding_mvals": {k: round(v, 1) for k, v in bn.items()},
                              "c_mvals": {k: round(v, 1) for k, v in c_of.items()},
                              "c_reuse_mvals": {k: round(v, 1) for k, v in reuse.items()}}))
            continue
        for path, v in bn.items():
            print(f"{spec:<20} {path:<15} {v:12.1f} {c_of[path]:9.1f} {v / c_of[path]:9.2f} "
                  f"{v / reuse[path]:15.2f}")


if __name__ == "__main__":
    main()
