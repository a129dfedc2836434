"""The compression-aware planner (epipe_plan_*, include/epipe/plan.h): split
points, a codec per boundary and direction, and the schedule, from a profile
of a chain of layers and a table of measured codec costs. docs/planner.md."""
import ctypes
import json
import os
import tempfile

from ._core import _enc
from ._lib import PlanCodec, PlanLayer, PlanOptions, check, lib

def read_json(path, what, kind):
    """The JSON document in path (a profile, a codec table), which must be a
    `kind` (dict or list): ValueError naming the file and `what` it should
    be otherwise. OSError when it cannot be read."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not {what} (JSON: {e})") from None
    if not isinstance(doc, kind):
        noun = "object" if kind is dict else "list"
        raise ValueError(f"{path}: not {what} (a JSON {noun} expected)")
    return doc


def write_json(path, doc):
    """doc as JSON at path, whole or not at all: written to a temporary file
    beside path and renamed over it, so a failure (a full disk) leaves path
    as it was, even when it is the file just read."""
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".",
                               dir=os.path.dirname(path) or ".")
    try:
        mask = os.umask(0)  # the mode open(path, "w") would give
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "w") as f:
            fd = -1
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
        raise


LAYER_FIELDS = ("forward_s", "backward_s", "weight_s", "out_bytes", "param_bytes", "stash_bytes",
                "update_s")
CODEC_FIELDS = ("spec", "layer", "dir", "encode_s", "decode_s", "wire_ratio", "error")
_DIRS = {"activation": 0, "gradient": 1, 0: 0, 1: 1}


def _layer(i, d):
    missing = [f for f in ("forward_s", "backward_s", "out_bytes") if f not in d]
    if missing:
        raise ValueError(f"plan: layer {i} lacks {', '.join(missing)}")
    return PlanLayer(*(float(d.get(f, 0.0)) for f in LAYER_FIELDS))


def _codec(i, d):
    missing = [f for f in ("spec", "layer", "dir", "encode_s", "decode_s", "wire_ratio")
               if f not in d]
    if missing:
        raise ValueError(f"plan: codec entry {i} lacks {', '.join(missing)}")
    if d["dir"] not in _DIRS:
        raise ValueError(f"plan: codec entry {i} has dir {d['dir']!r}; use 'activation' or "
                         "'gradient'")
    return PlanCodec(_enc(str(d["spec"])), int(d["layer"]), _DIRS[d["dir"]],
                     float(d["encode_s"]), float(d["decode_s"]), float(d["wire_ratio"]),
                     float(d.get("error", 0.0)))


class Plan:
    """A plan for `layers` (dicts with forward_s, backward_s, out_bytes and
    optionally weight_s, param_bytes, stash_bytes, per micro-batch) with the
    candidate `codecs` (dicts with spec, layer, dir 'activation'/'gradient',
    encode_s, decode_s, wire_ratio, error) on `stages` devices.

    bandwidth in bytes/s and latency in seconds for every link, or
    pair_bandwidth / pair_latency as stages x stages nested lists; memory
    per device in bytes (0: no limit); the error budgets per boundary (None:
    none); schedules a list of 'gpipe', '1f1b', 'zb-h1' (None: all).

    Attributes: stages (a list of (first, last) layer indices), codecs (a
    list of (activation spec, gradient spec) per boundary), schedule,
    step_seconds, blind_step_seconds; explain() the planner's account."""

    def __init__(self, layers, codecs=(), *, stages, microbatches, bandwidth=None, latency=0.0,
                 pair_bandwidth=None, pair_latency=None, memory=0.0, param_copies=0.0,
                 act_error_budget=None, grad_error_budget=None, schedules=None):
        layers, codecs = list(layers), list(codecs)
        if not layers:
            raise ValueError("plan: no layers")
        for name, v in (("stages", stages), ("microbatches", microbatches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"plan: {name} must be a positive int, not {v!r}")
        larr = (PlanLayer * len(layers))(*(_layer(i, d) for i, d in enumerate(layers)))
        carr = (PlanCodec * max(1, len(codecs)))(*(_codec(i, d) for i, d in enumerate(codecs)))
        o = PlanOptions()
        o.struct_size = ctypes.sizeof(PlanOptions)
        o.stages = int(stages)
        o.microbatches = int(microbatches)
        if bandwidth is None and pair_bandwidth is None:
            raise ValueError("plan: give bandwidth (bytes/s) or pair_bandwidth")
        o.bandwidth = float(bandwidth if bandwidth is not None else 1.0)
        o.latency_s = float(latency)
        self._keep = []
        for name, m in (("pair_bandwidth", pair_bandwidth), ("pair_latency_s", pair_latency)):
            if m is None:
                continue
            flat = [float(v) for row in m for v in row]
            if len(flat) != o.stages * o.stages or any(len(row) != o.stages for row in m):
                raise ValueError(f"plan: {name} must be {o.stages} x {o.stages}")
            arr = (ctypes.c_double * len(flat))(*flat)
            self._keep.append(arr)
            setattr(o, name, arr)
        o.memory_bytes = float(memory)
        o.param_copies = float(param_copies)
        o.act_error_budget = -1.0 if act_error_budget is None else float(act_error_budget)
        o.grad_error_budget = -1.0 if grad_error_budget is None else float(grad_error_budget)
        o.schedules = _enc(",".join(schedules)) if schedules else None
        h = ctypes.c_void_p()
        check(lib.epipe_plan_create(ctypes.byref(h), larr, len(layers), carr, len(codecs),
                                    ctypes.byref(o)), "epipe_plan_create")
        self._h = h
        self.layer_count = len(layers)
        self.num_stages = o.stages
        try:
            first = [lib.epipe_plan_first_layer(h, s) for s in range(o.stages + 1)]
            self.stages = [(first[s], first[s + 1] - 1) for s in range(o.stages)]
            self.codecs = [(lib.epipe_plan_codec_spec(h, b, 0).decode(),
                            lib.epipe_plan_codec_spec(h, b, 1).decode())
                           for b in range(o.stages - 1)]
            self.schedule = lib.epipe_plan_schedule(h).decode()
            self.step_seconds = lib.epipe_plan_step_seconds(h)
            self.blind_step_seconds = lib.epipe_plan_blind_step_seconds(h)
            n = lib.epipe_plan_explain(h, None, 0)
            buf = ctypes.create_string_buffer(n + 1)
            lib.epipe_plan_explain(h, buf, n + 1)
            self._text = buf.value.decode()
        finally:
            lib.epipe_plan_destroy(h)
            self._h = None

    def explain(self):
        return self._text

    def to_dict(self):
        return {"schedule": self.schedule, "stages": [list(s) for s in self.stages],
                "codecs": [{"activation": a, "gradient": g} for a, g in self.codecs],
                "step_seconds": self.step_seconds,
                "blind_step_seconds": self.blind_step_seconds}

    def __repr__(self):
        return (f"Plan({self.schedule}, stages {self.stages}, codecs {self.codecs}, "
                f"{self.step_seconds:.4g} s a step)")
