"""The planner from Python: epipe.Plan on dicts, epipe.torch.profile and
codec_table on a real model, the JSON round trip, and the epipe-plan tool."""
import json
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import epipe  # noqa: E402
import epipe.torch as ept  # noqa: E402


def test_plan_cuts_where_the_link_is_cheap():
    layers = [{"forward_s": 0.01, "backward_s": 0.02, "out_bytes": 2e6},
              {"forward_s": 0.01, "backward_s": 0.02, "out_bytes": 5e4},
              {"forward_s": 0.01, "backward_s": 0.02, "out_bytes": 2e6},
              {"forward_s": 0.01, "backward_s": 0.02, "out_bytes": 4e3}]
    p = epipe.Plan(layers, stages=2, microbatches=8, bandwidth=12.5e6)
    assert p.stages == [(0, 1), (2, 3)]
    assert p.codecs == [("none", "none")]
    assert p.schedule in ("gpipe", "1f1b", "zb-h1")
    assert p.step_seconds < p.blind_step_seconds or p.stages == [(0, 1), (2, 3)]
    assert "bottleneck" in p.explain()
    d = p.to_dict()
    assert d["stages"] == [[0, 1], [2, 3]] and d["codecs"][0]["activation"] == "none"


def test_plan_refuses_bad_input_by_name():
    with pytest.raises(epipe.Error) as e:
        epipe.Plan([{"forward_s": float("nan"), "backward_s": 1, "out_bytes": 1}] * 2,
                   stages=2, microbatches=2, bandwidth=1e6)
    assert "layer 0 has forward_s = nan" in e.value.message
    with pytest.raises(ValueError, match="lacks out_bytes"):
        epipe.Plan([{"forward_s": 1, "backward_s": 1}], stages=1, microbatches=1, bandwidth=1)
    with pytest.raises(ValueError, match="dir 'sideways'"):
        epipe.Plan([{"forward_s": 1, "backward_s": 1, "out_bytes": 1}] * 2,
                   [{"spec": "quant:bits=8", "layer": 0, "dir": "sideways", "encode_s": 0,
                     "decode_s": 0, "wire_ratio": 0.25}], stages=2, microbatches=1, bandwidth=1)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def test_profile_codec_table_and_plan(tmp_path):
    m = model()
    x = torch.randn(16, 1, 28, 28)
    t = torch.randint(0, 10, (16,))
    prof = ept.profile(m, x, t, torch.nn.functional.cross_entropy, reps=2)
    assert len(prof.layers) == 7 and len(prof.samples) == 6
    conv = prof.layers[0]
    assert conv["out_bytes"] == 16 * 8 * 28 * 28 * 4 and conv["param_bytes"] == (72 + 8) * 4
    assert conv["forward_s"] > 0 and conv["backward_s"] > 0 and conv["stash_bytes"] > 0
    assert prof.layers[1]["param_bytes"] == 0 and prof.layers[1]["weight_s"] == 0
    act, grad = prof.samples[4]  # after the first linear: [16, 64]
    assert act.shape == (16, 64) and grad.shape == (16, 64) and grad.abs().sum() > 0
    table, skipped = ept.codec_table(prof, ["quant:bits=8", "sortquant:bits=8", "topk:ratio=0.1"],
                                     reps=1)
    assert len(table) == 6 * 2 * 3 and not skipped
    q = [e for e in table if e["spec"] == "quant:bits=8" and e["layer"] == 0]
    assert {e["dir"] for e in q} == {"activation", "gradient"}
    for e in q:
        assert 0.25 < e["wire_ratio"] < 0.26 and 0 < e["error"] < 1e-3
    tk = [e for e in table if e["spec"] == "topk:ratio=0.1" and e["dir"] == "gradient"]
    assert all(0 < e["error"] < 1 for e in tk)
    # save and load: the JSON and the samples beside it
    path = str(tmp_path / "prof.json")
    prof.save(path)
    back = ept.Profile.load(path)
    assert back.layers == prof.layers and torch.equal(back.samples[2][1], prof.samples[2][1])
    assert isinstance(back.samples[2], tuple)
    # a save that fails part way (here what cannot be JSON, at the end) leaves
    # the file there as it was, and no temporary file beside it
    with open(path) as f:
        before = f.read()
    with pytest.raises(TypeError):
        ept.Profile(prof.layers, meta={"z": object()}).save(path)
    with open(path) as f:
        assert f.read() == before
    assert sorted(os.listdir(tmp_path)) == ["prof.json", "prof.json.samples.pt"]
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()
    # a slow link: the plan compresses and beats the blind plan
    p = ept.plan(prof, table, stages=2, microbatches=4, bandwidth=1e6)
    assert p.step_seconds <= p.blind_step_seconds
    assert p.codecs[0] != ("none", "none")
    # the tool on the saved profile and a saved table, run as a program
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(epipe.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tpath = str(tmp_path / "table.json")
    with open(tpath, "w") as f:
        json.dump(table, f)
    r = subprocess.run([sys.executable, "-m", "epipe.plan_tool", path, "--stages", "2",
                        "--microbatches", "4", "--bandwidth", "8Mbit", "--codec-table", tpath,
                        "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stages"] == [list(s) for s in p.stages] and out["schedule"] == p.schedule
    r = subprocess.run([sys.executable, "-m", "epipe.plan_tool", path, "--stages", "9",
                        "--microbatches", "4", "--bandwidth", "1Gbit"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 1 and "9 stages for 7 layers" in r.stderr
    r = subprocess.run([sys.executable, "-m", "epipe.plan_tool", path, "--stages", "2",
                        "--microbatches", "4", "--bandwidth", "fast"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and "bad rate 'fast'" in r.stderr
    # files that cannot be read, or are not what they should be: one line, no traceback
    bad = str(tmp_path / "bad.json")
    with open(bad, "w") as f:
        f.write("{not json")
    for args, why in (([str(tmp_path / "missing.json")], "No such file or directory"),
                      ([bad], "not a profile (JSON"),
                      ([path, "--codec-table", bad], "not a codec table (JSON"),
                      ([path, "--codec-table", path], "not a codec table (a JSON list")):
        r = subprocess.run([sys.executable, "-m", "epipe.plan_tool", *args, "--stages", "2",
                            "--microbatches", "4", "--bandwidth", "1Gbit"], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_profile_of_a_chain_starting_without_parameters():
    m = [torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)]
    prof = ept.profile(m, torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)),
                       torch.nn.functional.cross_entropy, reps=1)
    assert len(prof.samples) == 3 and prof.samples[0][1].abs().sum() > 0
    assert prof.layers[0]["param_bytes"] == 0 and prof.layers[1]["param_bytes"] > 0



def test_profile_statistic():
    """min: the fastest run; median: the middle one; anything else refused
    by name (profile and codec_table)."""
    from epipe.torch import _profile
    waits = iter([0.03, 0.0, 0.06, 0.03, 0.0, 0.06])
    fn = lambda: time.sleep(next(waits))  # noqa: E731
    dev = torch.device("cpu")
    assert _profile._timed(fn, 3, dev, "min") < 0.02
    assert 0.025 < _profile._timed(fn, 3, dev, "median") < 0.05
    m = [torch.nn.Flatten(), torch.nn.Linear(784, 10)]
    x, t = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="'mean'"):
        ept.profile(m, x, t, torch.nn.functional.cross_entropy, statistic="mean")
    prof = ept.profile(m, x, t, torch.nn.functional.cross_entropy, reps=3, statistic="median")
    assert prof.meta["statistic"] == "median" and prof.layers[1]["forward_s"] > 0
    with pytest.raises(ValueError, match="'best'"):
        ept.codec_table(prof, ["quant:bits=8"], statistic="best")
    table, _ = ept.codec_table(prof, ["quant:bits=8"], reps=3, statistic="median")
    assert len(table) == 2 and all(e["encode_s"] > 0 for e in table)


class _Payload:
    """Unpickling this runs code: what a hostile samples file would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_profile_load_treats_the_files_as_hostile(tmp_path):
    """Profile.load never runs code from a samples file (torch.load with
    weights_only), reads samples only beside the profile, and refuses
    malformed documents with a ValueError naming the file."""
    layers = [{"forward_s": 1e-3, "backward_s": 2e-3, "out_bytes": 4096.0}] * 3
    path = tmp_path / "prof.json"

    def write(doc):
        path.write_text(json.dumps(doc))

    # a samples file that would run code when unpickled
    marker = tmp_path / "pwned"
    torch.save([(_Payload(str(marker)), torch.zeros(1))] * 2, str(tmp_path / "evil.pt"))
    write({"version": 1, "layers": layers, "samples": "evil.pt"})
    with pytest.raises(ValueError, match="not a samples file of tensors"):
        ept.Profile.load(str(path))
    assert not marker.exists()
    # samples only beside the profile
    for name in ("../prof.json.samples.pt", "/etc/passwd", "..", "sub/x.pt"):
        write({"version": 1, "layers": layers, "samples": name})
        with pytest.raises(ValueError, match="must name a file beside the profile"):
            ept.Profile.load(str(path))
    # the samples must be one tensor pair per boundary
    torch.save([(torch.zeros(2), torch.zeros(2))], str(tmp_path / "short.pt"))
    write({"version": 1, "layers": layers, "samples": "short.pt"})
    with pytest.raises(ValueError, match="expected 2 .activation, gradient. tensor pairs"):
        ept.Profile.load(str(path))
    torch.save([(torch.zeros(2), torch.zeros(2))] * 2, str(tmp_path / "ok.pt"))
    write({"version": 1, "layers": layers, "samples": "ok.pt"})
    assert len(ept.Profile.load(str(path)).samples) == 2
    # malformed documents
    for doc, why in ((None, "a JSON object expected"), ([], "a JSON object expected"),
                     ({"version": 2, "layers": layers}, "profile version 2"),
                     ({"version": 1, "layers": {}}, "non-empty list of objects"),
                     ({"version": 1, "layers": []}, "non-empty list of objects"),
                     ({"version": 1, "layers": ["forward_s"]}, "non-empty list of objects"),
                     ({"version": 1, "layers": layers, "meta": 3}, "'meta' must be an object")):
        write(doc)
        with pytest.raises(ValueError, match=why):
            ept.Profile.load(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a profile .JSON"):
        ept.Profile.load(str(path))


@pytest.mark.parametrize("field,value", [("stages", -1), ("stages", 0), ("microbatches", -2),
                                         ("microbatches", 2.5), ("stages", True)])
def test_plan_counts_are_checked(field, value):
    """A negative count was passed to C as a huge unsigned one ("4294967295
    stages"): refused here, naming the field and the value."""
    layers = [{"forward_s": 1e-3, "backward_s": 2e-3, "out_bytes": 4096.0}] * 2
    kw = {"stages": 1, "microbatches": 1, "bandwidth": 1e9}
    kw[field] = value
    with pytest.raises(ValueError, match=f"plan: {field} must be a positive int"):
        epipe.Plan(layers, **kw)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
