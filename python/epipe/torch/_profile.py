"""Profiles and codec tables for the planner (docs/planner.md): per layer of a
chain, forward and backward time, output and stash bytes, parameter bytes,
and a sample of each boundary's activation and gradient; per codec and
boundary, measured encode and decode time, wire ratio and error."""
import os
import statistics
import time

import torch

from .. import _core
from .._plan import Plan, read_json, write_json

PROFILE_VERSION = 1


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# how the repeated runs of a timing become one value
STATISTICS = {"min": min, "median": statistics.median}


def _check_statistic(statistic):
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, not {statistic!r}")


def _timed(fn, reps, device, statistic="min"):
    """fn's time: the fastest of `reps` runs, or their median."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return STATISTICS[statistic](times)


def _stash_bytes(layer, x):
    """Bytes autograd saves for the backward in one forward of layer(x)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return total


class Profile:
    """What profile() measured: `layers` (a list of dicts, epipe_plan_layer's
    fields) and `samples` (per boundary after layer k: (activation,
    gradient) tensors, or None when loaded without them)."""

    def __init__(self, layers, samples=None, meta=None):
        self.layers = layers
        self.samples = samples
        self.meta = meta or {}

    def save(self, path):
        """The profile as JSON at path; the samples beside it in
        path + '.samples.pt' (torch.save), named in the JSON."""
        doc = {"version": PROFILE_VERSION, "layers": self.layers, "meta": self.meta,
               "samples": None}
        if self.samples is not None:
            side = path + ".samples.pt"
            torch.save([(a.cpu(), g.cpu()) for a, g in self.samples], side)
            doc["samples"] = os.path.basename(side)
        write_json(path, doc)

    @classmethod
    def load(cls, path):
        """A profile save() wrote. The file is treated as untrusted: its
        layers must be a list of objects, its samples file a plain name
        beside it, read with torch.load(weights_only=True) (tensors only,
        never code) and holding a pair of tensors per boundary; anything
        else is a ValueError naming the file and the fault."""
        doc = read_json(path, "a profile", dict)
        if doc.get("version") != PROFILE_VERSION:
            raise ValueError(f"{path}: profile version {doc.get('version')!r}; this epipe reads "
                             f"{PROFILE_VERSION}")
        layers = doc.get("layers")
        if not isinstance(layers, list) or not layers or \
                not all(isinstance(d, dict) for d in layers):
            raise ValueError(f"{path}: 'layers' must be a non-empty list of objects")
        meta = doc.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"{path}: 'meta' must be an object")
        samples = None
        name = doc.get("samples")
        if name:
            if not isinstance(name, str) or os.path.basename(name) != name or \
                    name in (".", ".."):
                raise ValueError(f"{path}: 'samples' must name a file beside the profile, "
                                 f"not {name!r}")
            side = os.path.join(os.path.dirname(os.path.abspath(path)), name)
            try:
                samples = torch.load(side, weights_only=True)
            except Exception as e:  # noqa: BLE001 - the unpickler's refusal, whatever it is
                raise ValueError(f"{side}: not a samples file of tensors ({e})") from None
            if not isinstance(samples, list) or len(samples) != len(layers) - 1 or \
                    not all(isinstance(p, (list, tuple)) and len(p) == 2 and
                            all(isinstance(t, torch.Tensor) for t in p) for p in samples):
                raise ValueError(f"{side}: expected {len(layers) - 1} (activation, gradient) "
                                 "tensor pairs, one per boundary")
            samples = [tuple(p) for p in samples]
        return cls(layers, samples, meta)


def profile(layers, example, target=None, loss_fn=None, *, reps=3, statistic="min"):
    """Profiles a chain of modules (an nn.Sequential or a list) on one
    micro-batch `example`, on the device its tensors and parameters are on.
    The gradients sampled at each boundary are those of loss_fn(output,
    target) (default: the mean square of the output). Times are the best of
    `reps` runs (statistic "min"), or their median ("median": closer to
    what a long run sees where the timings vary, as when another process
    shares the device's caches); backward_s is the input and weight
    gradients together, weight_s the weight gradients alone."""
    _check_statistic(statistic)
    layers = list(layers)
    if not layers:
        raise ValueError("profile: no layers")
    device = example.device
    # one pass through the chain for the samples: each boundary's output and
    # the loss's gradient at it
    # the input needs a gradient too: a chain may start with layers
    # without parameters (Flatten), whose outputs would not have one
    outs, h = [], example.detach().requires_grad_(example.is_floating_point())
    for layer in layers:
        h = layer(h)
        h.retain_grad()
        outs.append(h)
    loss = loss_fn(h, target) if loss_fn is not None else h.float().pow(2).mean()
    loss.backward()
    samples = [(o.detach().clone(), o.grad.detach().clone()) for o in outs[:-1]]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    recs, x = [], example.detach()
    for i, layer in enumerate(layers):
        xi = x.detach().requires_grad_(x.is_floating_point())
        params = [p for p in layer.parameters() if p.requires_grad]
        out = layer(xi)
        g = outs[i].grad.detach() if outs[i].grad is not None else torch.ones_like(out)

        def fwd():
            layer(xi)

        def both():
            o = layer(xi)
            torch.autograd.backward(o, g)

        def weights_only():
            o = layer(xi)
            if params:
                torch.autograd.grad(o, params, g)

        both()  # warm up
        f = _timed(fwd, reps, device, statistic)
        fb = _timed(both, reps, device, statistic)
        w = max(0.0, _timed(weights_only, reps, device, statistic) - f) if params else 0.0
        b = max(0.0, fb - f)
        u = 0.0
        if params:  # an SGD step with momentum: the optimiser most hosts run
            both()
            opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)
            opt.step()
            u = _timed(opt.step, reps, device, statistic)
        layer.zero_grad(set_to_none=True)
        recs.append({
            "name": type(layer).__name__,
            "forward_s": f,
            "backward_s": b,
            "weight_s": min(w, b),
            "out_bytes": float(out.numel() * out.element_size()),
            "out_shape": list(out.shape),
            "param_bytes": float(sum(p.numel() * p.element_size() for p in layer.parameters())),
            "stash_bytes": float(_stash_bytes(layer, xi)),
            "update_s": u,
        })
        x = out.detach()
    meta = {"device": str(device), "microbatch": list(example.shape), "reps": reps,
            "statistic": statistic,
            "torch": torch.__version__}
    return Profile(recs, samples, meta)


def _time_codec(spec, t, reps, device, statistic):
    c = _core.Codec(spec)
    try:
        if device.type == "cuda":
            payload = c.encode(t)
            c.synchronize()
            enc = _timed(lambda: c.encode(t), reps, device, statistic)
            y = torch.empty_like(t)
            dec = _timed(lambda: c.decode(payload, out=y), reps, device, statistic)
            c.synchronize()
            n = payload.numel()
        else:
            view = c.encode_view(t)
            n = len(view)
            payload = bytes(view)
            enc = _timed(lambda: c.encode_view(t), reps, device, statistic)
            y = torch.empty_like(t)
            dec = _timed(lambda: c.decode(payload, out=y), reps, device, statistic)
        return enc, dec, n, y
    finally:
        c.close()


def codec_table(prof, codecs, *, reps=3, boundaries=None, statistic="min"):
    """Measures each codec spec on each sampled boundary tensor (both
    directions): encode and decode time (the best of `reps`, or their
    median: profile()'s statistic), wire ratio (payload bytes over raw
    bytes), and error (activations: relative MSE; gradients: 1 - cosine).
    Returns (entries, skipped): entries for Plan, and (spec, boundary,
    direction, why) for the codecs that refused a tensor."""
    _check_statistic(statistic)
    if prof.samples is None:
        raise ValueError("codec_table: the profile has no samples (saved without them?)")
    entries, skipped = [], []
    for k, (act, grad) in enumerate(prof.samples):
        if boundaries is not None and k not in boundaries:
            continue
        for direction, t in (("activation", act), ("gradient", grad)):
            t = t.contiguous()
            raw = t.numel() * t.element_size()
            for spec in codecs:
                try:
                    enc, dec, n, y = _time_codec(spec, t, reps, t.device, statistic)
                except Exception as e:  # a codec that cannot take this tensor
                    skipped.append((spec, k, direction, str(e)))
                    continue
                x64, y64 = t.double().flatten(), y.double().flatten()
                if direction == "activation":
                    den = float(x64.pow(2).sum())
                    err = float((y64 - x64).pow(2).sum()) / den if den > 0 else 0.0
                else:
                    nx, ny = float(x64.norm()), float(y64.norm())
                    err = 1.0 - float(x64.dot(y64)) / (nx * ny) if nx > 0 and ny > 0 else 0.0
                entries.append({"spec": spec, "layer": k, "dir": direction, "encode_s": enc,
                                "decode_s": dec, "wire_ratio": n / raw,
                                "error": max(0.0, err)})
    return entries, skipped


def plan(prof, table, *, stages, microbatches, bandwidth, **options):
    """epipe.Plan for a Profile (or a list of layer dicts) and a codec table
    (entries from codec_table(), or such dicts); the options as Plan's."""
    layers = prof.layers if isinstance(prof, Profile) else prof
    return Plan(layers, table, stages=stages, microbatches=microbatches, bandwidth=bandwidth,
                **options)
