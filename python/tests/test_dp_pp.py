"""DP x PP under torchrun (examples/torch/fmnist_dp_pp.py): 2 replicas x 2
stages, each stage's replicas all-reducing their gradients through
torch.distributed (Gloo) with libepipe's compressed DDP hook. Uncompressed,
the weights equal one process trained on the whole batches; compressed, it
trains. The hook on a real DDP model, beside PyTorch's PowerSGD hook, on
Gloo, and on NCCL where torch has a GPU."""
import os
import random
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import epipe.torch as ept  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "torch")
DATA = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"
sys.path.insert(0, EXAMPLES)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def low_ports(count):
    """A free run of `count` ports below Linux's ephemeral range (32768+),
    so that none is taken meanwhile by a socket the kernel numbers itself
    (gloo's connections, the torchrun store's clients)."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randint(20000, 32000 - count)
        socks = []
        try:
            for q in range(p, p + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free run of ports below 32000")


def torchrun(nproc, script, *args, timeout=300):
    """torchrun as its module. --redirects 1 --tee 1: torch 1.13's parser of
    the default '0' returns None on Python 3.11 (iterating an IntFlag skips
    its zero member), which crashes the launcher before any worker starts."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "--redirects", "1",
           "--tee", "1", script, *args]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=env)


def needs_data(fn):
    fn = pytest.mark.skipif(not os.path.exists(DATA),
                            reason="dataset-fashion-mnist is not installed")(fn)
    return pytest.mark.skipif(not os.path.exists(os.path.join(EXAMPLES, "fmnist_dp_pp.py")),
                              reason=f"no examples at {EXAMPLES} (run outside the source "
                                     "tree)")(fn)


@needs_data
def test_dp_pp_uncompressed_equals_one_process(tmp_path):
    save = str(tmp_path / "w")
    steps, batch, m = 6, 32, 2
    p = torchrun(4, os.path.join(EXAMPLES, "fmnist_dp_pp.py"), "--epipe-port", str(low_ports(2)),
                 "--stages", "2", "--codec",
                 "none", "--allreduce-codec", "none", "--train-limit", str(steps * batch),
                 "--batch", str(batch), "--microbatches", str(m), "--test-limit", "100",
                 "--save", save)
    assert p.returncode == 0, p.stdout[-4000:]
    import fmnist_split as base

    torch.set_num_threads(1)
    parts = base.build_parts(seed=1, n=2)
    model = torch.nn.Sequential(*parts)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = base.load(base.DATA_DIR, "train")
    for b in range(steps):
        xb, yb = x[b * batch:(b + 1) * batch], y[b * batch:(b + 1) * batch]
        opt.zero_grad()
        # 2 replicas x m micro-batches, each loss over its own rows: the mean
        for xm, ym in zip(torch.tensor_split(xb, 2 * m), torch.tensor_split(yb, 2 * m)):
            (torch.nn.functional.cross_entropy(model(xm), ym) / (2 * m)).backward()
        opt.step()
    for s in range(2):
        got = torch.load(f"{save}.{s}")
        want = parts[s].state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


@needs_data
def test_dp_pp_compressed_trains():
    p = torchrun(4, os.path.join(EXAMPLES, "fmnist_dp_pp.py"), "--epipe-port", str(low_ports(2)),
                 "--stages", "2",
                 "--train-limit", "1920", "--test-limit", "500")
    assert p.returncode == 0, p.stdout[-4000:]
    line = [ln for ln in p.stdout.splitlines() if "test accuracy" in ln]
    assert line, p.stdout[-3000:]
    acc = float(line[0].split("test accuracy ")[1].split("%")[0])
    ratio = float(line[0].split("wire ratio ")[1].split(";")[0])
    assert acc > 55, line[0]  # chance is 10%
    assert 0.24 < ratio < 0.26, line[0]  # 8-bit codes of fp32 gradients


DDP_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
import epipe.torch as ept
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
backend = os.environ.get("DDP_BACKEND", "gloo")  # nccl: one GPU a rank
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else "cpu"
if backend == "nccl":
    torch.cuda.set_device(dev)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                            torch.nn.Linear(256, 8)).to(dev)
ref = [p.detach().clone() for p in model.parameters()]
results = {}
for name in ("plain", "epipe", "powersgd"):
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref):
            p.copy_(r)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[dev.index] if backend == "nccl" else None)
    if name == "epipe":
        state = ept.CompressedAllreduceState("sortquant:bits=8")
        ddp.register_comm_hook(state, ept.compressed_allreduce_hook)
    elif name == "powersgd":
        ddp.register_comm_hook(psgd.PowerSGDState(process_group=None,
                               matrix_approximation_rank=4, start_powerSGD_iter=2),
                               psgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 8, generator=g).to(dev)
    for step in range(40):
        x = torch.randn(32, 64, generator=g)[rank::world].to(dev)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ w)
        opt.zero_grad(); loss.backward(); opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    others = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(others, flat)
    assert all(torch.equal(others[0], o) for o in others), name  # replicas stay identical
    results[name] = (flat, loss.item())
    del ddp
if rank == 0:
    for name in ("epipe", "powersgd"):
        d = (results[name][0] - results["plain"][0]).norm() / results["plain"][0].norm()
        print(f"RESULT {name} rel_diff {d:.5f} loss {results[name][1]:.5f} plain "
              f"{results['plain'][1]:.5f}", flush=True)
dist.barrier()  # neither replica tears down its links while the other still uses them
dist.destroy_process_group()
# Torch 1.13's teardown at interpreter exit now and then ends in std::terminate
# ("terminate called without an active exception", SIGABRT) after everything
# above has passed: once in CI, 2 of 12 runs beside CPU hogs. This test is
# about the hook, so the process leaves without that teardown.
sys.stdout.flush()
os._exit(0)
'''


def check_hooks(p):
    assert p.returncode == 0, p.stdout[-4000:]
    res = {}
    for line in p.stdout.splitlines():
        if "RESULT " in line:
            f = line.split("RESULT ", 1)[1].split()
            res[f[0]] = (float(f[2]), float(f[4]), float(f[6]))
    assert sorted(res) == ["epipe", "powersgd"], p.stdout[-3000:]
    # 8-bit codes with error feedback: close to plain all-reduce, and trained
    rel, loss, plain = res["epipe"]
    assert rel < 0.02 and loss < 1.5 * plain, res


def test_hook_on_ddp_beside_powersgd(tmp_path):
    script = tmp_path / "ddp_hooks.py"
    script.write_text(DDP_SCRIPT)
    check_hooks(torchrun(2, str(script), timeout=240))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
def test_hook_on_nccl(tmp_path, monkeypatch):
    """The same on GPUs through NCCL: the payloads are encoded, all-gathered
    and decoded on the GPU. NCCL takes one GPU a rank: two ranks where there
    are two GPUs, else one (the hook still encodes, gathers and decodes)."""
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    script = tmp_path / "ddp_hooks.py"
    script.write_text(DDP_SCRIPT)
    monkeypatch.setenv("DDP_BACKEND", "nccl")
    check_hooks(torchrun(min(2, torch.cuda.device_count()), str(script), timeout=240))


def test_state_refuses_a_bad_spec():
    with pytest.raises(Exception) as e:
        ept.CompressedAllreduceState("sortquant:bits=99")
    assert "bits" in str(e.value)
