"""epipe-plan: the compression-aware planner on a saved profile.

usage: epipe-plan PROFILE.json --stages P --microbatches M --bandwidth RATE
                  [--latency SECONDS] [--memory BYTES] [--codecs 'SPEC;SPEC...']
                  [--codec-table TABLE.json] [--save-table TABLE.json]
                  [--act-error E] [--grad-error E] [--schedules gpipe,1f1b,zb-h1]
                  [--json]

PROFILE.json is what epipe.torch.profile(...).save() writes. The codec
candidates come from --codec-table (entries as epipe.torch.codec_table()
returns them, as JSON), or are measured now on the profile's samples for the
specs of --codecs (needs torch; --save-table keeps them). RATE in bytes/s,
or with a unit: 100Mbit, 1Gbit, 12.5MB (bytes). Prints the plan and why
(docs/planner.md), or with --json the plan as JSON.
"""
import argparse
import json
import re
import sys

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "bit": 1 / 8, "kbit": 1e3 / 8,
          "mbit": 1e6 / 8, "gbit": 1e9 / 8}


def rate(text):
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*(/s)?\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad rate '{text}' (e.g. 100Mbit, 1Gbit, 12.5MB)")
    try:
        v = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rate '{text}'") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"rate '{text}' must be > 0")
    return v


def size(text):
    v = rate(text)  # the same units, bytes
    return v


def _plan(a, ap):
    """The plan the arguments ask for; OSError for a file that cannot be
    read or written, ValueError (or epipe.Error) for one that is not what it
    should be and for a plan refused."""
    from ._plan import Plan, read_json, write_json

    doc = read_json(a.profile, "a profile", dict)
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        ap.error(f"{a.profile}: no 'layers' list (write it with epipe.torch.profile().save())")
    table = read_json(a.codec_table, "a codec table", list) if a.codec_table else []
    if a.codecs:
        from .torch._profile import Profile, codec_table

        prof = Profile.load(a.profile)
        specs = [s for s in a.codecs.split(";") if s.strip()]
        measured, skipped = codec_table(prof, specs)
        for spec, k, d, why in skipped:
            print(f"epipe-plan: {spec} skipped on boundary {k} ({d}): {why}", file=sys.stderr)
        table += measured
        if a.save_table:
            write_json(a.save_table, measured)
    return Plan(layers, table, stages=a.stages, microbatches=a.microbatches,
                bandwidth=a.bandwidth, latency=a.latency, memory=a.memory,
                act_error_budget=a.act_error, grad_error_budget=a.grad_error,
                schedules=a.schedules.split(",") if a.schedules else None)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="epipe-plan", description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--bandwidth", type=rate, required=True)
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--memory", type=size, default=0.0)
    ap.add_argument("--codecs", default=None)
    ap.add_argument("--codec-table", default=None)
    ap.add_argument("--save-table", default=None)
    ap.add_argument("--act-error", type=float, default=None)
    ap.add_argument("--grad-error", type=float, default=None)
    ap.add_argument("--schedules", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from . import Error

    try:
        p = _plan(a, ap)
    except OSError as e:  # a file named on the command line: not a traceback
        print(f"epipe-plan: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    except (Error, ValueError) as e:  # JSON that is not what it should be, a refused plan
        print(f"epipe-plan: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(p.to_dict(), indent=1))
    else:
        print(p.explain(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
