#!/usr/bin/env python3
"""What a pipeline step costs beyond its compute and its codecs (issue 11's
"no hidden synchronisations" target), measured in one run on one device:

  compute   the same model in one process: forward and backward of each
            micro-batch, the optimizer step, one synchronisation a step;
  codecs    each boundary tensor of a step encoded and decoded on the
            device (activations and gradients, every micro-batch);
  pipeline  epipe.torch stages as threads of this process over inproc,
            every stage on the same device, the boundary tensors staying
            there (CUDA tensors on a GPU).

The stages share the device, so the ideal is compute + codecs: the ratio
pipeline / (compute + codecs) is the overhead (target: at most 1.10 on a
GPU). --trace DIR writes the pipeline's trace (EPIPE_TRACE) to
DIR/trace.json, both stages in one file, for Perfetto, and prints each
stage's time a step in its ops, encodes, decodes and waits: a wait that
should not be there, or an op longer than its compute, shows in it. On the
CPU the two stage threads share the cores (and the GIL), so the figure says
little there.

    python/bench/bench_pipeline_overhead.py [--device cuda] [--width 4096]
        [--layers 8] [--batch 256] [--microbatches 8] [--steps 20]
        [--codec sortquant:bits=8] [--schedule 1f1b] [--trace DIR]
        [--stream-ordered] [--json]

--stream-ordered builds the schedules with stream_ordered=True: the
stages' sends and receives return with their codec work queued on torch's
stream, and each stage waits for it once a step.
"""
import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE)))
import torch  # noqa: E402

import epipe  # noqa: E402
import epipe.torch as ept  # noqa: E402

SCHEDULES = {"gpipe": ept.ScheduleGPipe, "1f1b": ept.Schedule1F1B, "zb-h1": ept.ScheduleZBH1}


def make_model(width, layers, seed=3):
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_compute(a, device, data):
    model = make_model(a.width, a.layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()

    def step(x, t):
        opt.zero_grad(set_to_none=True)
        for xm, tm in zip(x.chunk(a.microbatches), t.chunk(a.microbatches)):
            (loss_fn(model(xm), tm) / a.microbatches).backward()
        opt.step()

    return timed(a, device, data, step)


def timed(a, device, data, step):
    for x, t in data[:2]:  # warm-up: allocations, kernels' first launches
        step(x, t)
    sync(device)
    t0 = time.perf_counter()
    for i in range(a.steps):
        x, t = data[i % len(data)]
        step(x, t)
    sync(device)
    return (time.perf_counter() - t0) / a.steps


def time_codecs(a, device, data):
    """Each boundary's activation and gradient of a step, encoded and
    decoded on the device: M micro-batches, both directions."""
    if a.codec == "none":
        return 0.0
    rows = a.batch // a.microbatches
    x = data[0][0][:rows].contiguous()
    enc, dec = epipe.Codec(a.codec), epipe.Codec(a.codec)
    y = torch.empty_like(x)
    cap = enc.max_encoded_size(x)
    buf = torch.empty(cap, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def one(_x, _t):
        for _ in range(2 * a.microbatches):  # activation and gradient
            p = enc.encode(x, out=buf) if buf is not None else enc.encode(x)
            dec.decode(p, out=y)
        if device.type == "cuda":
            enc.synchronize()
            dec.synchronize()

    return timed(a, device, data, one)


def time_pipeline(a, device, data):
    comms = epipe.Comm.inproc(2)
    model = make_model(a.width, a.layers)
    parts = ept.split_sequential(model, 2, by="index")
    loss_fn = torch.nn.MSELoss()
    result, errors = {}, [None, None]
    barrier = threading.Barrier(2)

    def body(r):
        try:
            torch.set_num_threads(1)  # per thread: OpenMP's setting is the caller's
            stage = ept.PipelineStage(parts[r].to(device), r, 2, device, comm=comms[r],
                                      act_codec=a.codec, grad_codec=a.codec)
            opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)
            with SCHEDULES[a.schedule](stage, a.microbatches, loss_fn=loss_fn,
                                       timeout_ms=120000,
                                       stream_ordered=a.stream_ordered) as sched:
                def step(x, t):
                    opt.zero_grad(set_to_none=True)
                    sched.step(x, target=t)
                    opt.step()
                barrier.wait()
                result[r] = timed(a, device, data, step)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e
            comms[r].abort()
        finally:
            comms[r].close()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for e in errors:
        if e is not None:
            raise e
    return max(result.values())


def trace_summary(path, steps):
    """Each stage's milliseconds a step by span category, from the trace
    (compute ops, encode, decode, wait); the warm-up steps included."""
    with open(path) as f:
        d = json.load(f)
    events = d["traceEvents"] if isinstance(d, dict) else d
    names, totals = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "X":
            key = (e["pid"], e.get("cat", e["name"]))
            totals[key] = totals.get(key, 0.0) + e["dur"] / 1e3
    out = {}
    for (pid, cat), ms in sorted(totals.items()):
        out.setdefault(names.get(pid, str(pid)), {})[cat] = ms / steps
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--codec", default="sortquant:bits=8")
    ap.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    ap.add_argument("--trace", help="directory for the pipeline's trace (one file a stage)")
    ap.add_argument("--stream-ordered", action="store_true",
                    help="sends and receives return with their CUDA work queued "
                         "(EPIPE_STAGE_CUDA_STREAM_ORDERED)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.batch % a.microbatches or a.layers < 2:
        ap.error("--batch must divide into --microbatches, and --layers be at least 2")
    device = torch.device(a.device)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(a.batch, a.width, generator=g).to(device),
             torch.randn(a.batch, a.width, generator=g).to(device)) for _ in range(4)]
    compute = time_compute(a, device, data)
    codecs = time_codecs(a, device, data)
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
        os.environ["EPIPE_TRACE"] = os.path.join(a.trace, "trace.json")
    pipeline = time_pipeline(a, device, data)
    spans = trace_summary(os.environ["EPIPE_TRACE"], a.steps + 2) if a.trace else None
    ideal = compute + codecs
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = {"device": name, "width": a.width, "layers": a.layers, "batch": a.batch,
           "microbatches": a.microbatches, "codec": a.codec, "schedule": a.schedule,
           "stream_ordered": a.stream_ordered,
           "compute_s": compute, "codecs_s": codecs, "pipeline_s": pipeline,
           "overhead": pipeline / ideal if ideal > 0 else float("nan"), "trace_ms_a_step": spans}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{name}: MLP {a.layers} x {a.width}, batch {a.batch} in {a.microbatches} "
          f"micro-batches, codec {a.codec}, {a.schedule}, 2 stages on one device"
          + (", stream-ordered" if a.stream_ordered else ""))
    print(f"  compute (one process)   {compute * 1e3:9.3f} ms a step")
    print(f"  codecs (every boundary) {codecs * 1e3:9.3f} ms a step")
    print(f"  pipeline (2 stages)     {pipeline * 1e3:9.3f} ms a step")
    print(f"  pipeline / (compute + codecs) = {out['overhead']:.3f}")
    for stage, cats in (spans or {}).items():
        print(f"  {stage}: " + ", ".join(f"{c} {ms:.3f} ms" for c, ms in cats.items()) +
              " a step (trace)")


if __name__ == "__main__":
    main()
