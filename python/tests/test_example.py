"""examples/torch/fmnist_split.py: three processes over TCP, started by epipe-run,
train a little and report accuracy and wire ratio."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.environ.get("EPIPE_RUN") or os.path.join(ROOT, "build", "tools", "epipe-run")
DATA = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


def _launch(example, *args):
    """examples/torch/EXAMPLE as three ranks under epipe-run: its output,
    after checking that it succeeded."""
    cmd = [LAUNCHER, "-n", "3", "--", sys.executable,
           os.path.join(ROOT, "examples", "torch", example), *args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:]
    return p.stdout


@pytest.mark.skipif(not os.path.exists(LAUNCHER), reason=f"no launcher at {LAUNCHER}")
@pytest.mark.skipif(not os.path.exists(DATA), reason="dataset-fashion-mnist is not installed")
def test_fmnist_split_trains_over_tcp():
    out = _launch("fmnist_split.py",
                  "--act-codec", "sortquant:bits=8", "--grad-codec", "quant:bits=8",
                  "--train-limit", "1920", "--test-limit", "1000", "--schedule", "gpipe",
                  "--microbatches", "2")
    res = {}
    for line in out.splitlines():
        if "RESULT " in line:
            r = json.loads(line.split("RESULT ", 1)[1])
            res[r["rank"]] = r
    assert sorted(res) == [0, 1, 2], out[-3000:]
    assert res[2]["test_images"] == 1000
    assert res[2]["accuracy"] > 0.4, out[-3000:]  # chance is 0.1
    # each boundary's two ends count the same bytes
    assert res[0]["raw_down"] == res[1]["raw_up"] and res[0]["wire_down"] == res[1]["wire_up"]
    assert res[1]["raw_down"] == res[2]["raw_up"] and res[1]["wire_down"] == res[2]["wire_up"]
    assert res[0]["wire_down"] < 0.35 * res[0]["raw_down"]  # 8-bit codes on fp32
    assert "test accuracy" in out and "wire ratio" in out


def _run_schedule(schedule, chunks):
    out = _launch("fmnist_split.py",
                  "--train-limit", "640", "--test-limit", "500", "--schedule", schedule,
                  "--chunks", str(chunks), "--microbatches", "4", "--eval-uncompressed")
    loss = [ln.split("loss ", 1)[1].split()[0] for ln in out.splitlines()
            if "step 10/10 loss" in ln]
    acc = [ln.split("RESULT ", 1)[1] for ln in out.splitlines() if '"accuracy"' in ln]
    assert len(loss) == 1 and len(acc) == 1, out[-3000:]
    r = json.loads(acc[0])
    # no codecs: the second evaluation, through a stage of its own, is the first
    assert r["accuracy_uncompressed"] == r["accuracy"], out[-3000:]
    return loss[0], r["accuracy"]


@pytest.mark.skipif(not os.path.exists(LAUNCHER), reason=f"no launcher at {LAUNCHER}")
@pytest.mark.skipif(not os.path.exists(DATA), reason="dataset-fashion-mnist is not installed")
def test_fmnist_split_zb_h1_and_interleaved_match_1f1b_over_tcp():
    ref = _run_schedule("1f1b", 1)
    assert _run_schedule("zb-h1", 1) == ref
    assert _run_schedule("interleaved", 2) == ref


@pytest.mark.skipif(not os.path.exists(LAUNCHER), reason=f"no launcher at {LAUNCHER}")
@pytest.mark.skipif(not os.path.exists(DATA), reason="dataset-fashion-mnist is not installed")
def test_fmnist_schedule_trains_with_the_torch_front_end():
    """examples/torch/fmnist_schedule.py: PipelineStage + Schedule1F1B.step()
    over three TCP processes learns (chance is 10%) and reports samples/s."""
    out = _launch("fmnist_schedule.py", "--train-limit", "1920", "--test-limit", "500")
    line = [ln for ln in out.splitlines() if "test accuracy" in ln]
    assert len(line) == 1, out[-3000:]
    acc = float(line[0].split("test accuracy ", 1)[1].split("%")[0])
    sps = float(line[0].split("; ", 1)[1].split()[0])
    assert acc > 40 and sps > 0, line[0]
    import torch  # --device auto: the GPU where torch has one
    assert line[0].endswith("on cuda:0" if torch.cuda.is_available() else "on cpu"), line[0]


def _wire_share(extra):
    out = _launch("fmnist_split.py",
                  "--act-codec", "quant:bits=2,rows=1,delta=1", "--grad-codec",
                  "quant:bits=2,rows=1", "--train-limit", "640", "--test-limit", "200",
                  "--epochs", "2", *extra)
    r = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if '"rank": 0' in ln]
    assert len(r) == 1, out[-3000:]
    return r[0]["wire_down"] / r[0]["raw_down"]


@pytest.mark.skipif(not os.path.exists(LAUNCHER), reason=f"no launcher at {LAUNCHER}")
@pytest.mark.skipif(not os.path.exists(DATA), reason="dataset-fashion-mnist is not installed")
def test_untracked_micro_batches_are_coded_whole():
    """--untracked P: with P = 1 every training micro-batch crosses untracked,
    coded at 2 bits, where tracked rows cross raw when first seen (here every
    time: each epoch draws its 640 images afresh); without delta=1 it is
    refused. (The share counts the activations sent and the 2-bit gradients
    received.)"""
    tracked, untracked = _wire_share([]), _wire_share(["--untracked", "1"])
    assert tracked > 0.5, tracked
    assert untracked < 0.1, untracked  # 2 bits of 32, and a range per row
    cmd = [sys.executable, os.path.join(ROOT, "examples", "torch", "fmnist_split.py"),
           "--act-codec", "quant:bits=2", "--untracked", "0.1"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=60)
    assert p.returncode != 0 and "--untracked 0.1" in p.stdout and "delta=1" in p.stdout
