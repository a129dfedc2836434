"""epipe.torch: PipelineStage and the schedules' step() train a split MLP to
the same weights as one process (codec none, CPU, threads over inproc) for
GPipe, 1F1B, ZB-H1 and interleaved; eval() runs forwards only; splitting by
index, by parameters and by given boundaries; bad input raises."""
import copy
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import epipe  # noqa: E402
import epipe.torch as ept  # noqa: E402
from test_pipeline import raise_first, run_threads  # noqa: E402

BATCH, MB, STEPS, LR = 16, 4, 3, 0.1


def make_model():
    g = torch.Generator().manual_seed(11)
    layers = []
    dims = [8, 16, 16, 16, 16, 4]
    for i in range(len(dims) - 1):
        lin = torch.nn.Linear(dims[i], dims[i + 1])
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.3)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
        layers += [lin, torch.nn.Tanh()] if i + 2 < len(dims) else [lin]
    return torch.nn.Sequential(*layers)


def batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))
            for _ in range(STEPS)]


def mse(out, t):
    return torch.nn.functional.mse_loss(out, t)


def one_process(model, device="cpu"):
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, t in batches():
        opt.zero_grad()
        for xm, tm in zip(torch.tensor_split(x, MB), torch.tensor_split(t, MB)):
            loss = mse(model(xm.to(device)), tm.to(device))
            losses.append(loss.item())
            (loss / MB).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses


def pipelined(schedule_cls, ranks, chunks, device="cpu", stream_ordered=False):
    """Trains on `ranks` threads; returns the flat weights in model order and
    the last stage's losses."""
    n = ranks * chunks
    parts_all = [ept.split_sequential(make_model().to(device), n, by="index")
                 for _ in range(ranks)]
    comms = epipe.Comm.inproc(ranks)
    data = batches()
    got, losses = {}, []

    def body(r):
        parts = parts_all[r]
        if schedule_cls is ept.ScheduleZBV:
            mine = [r, 2 * ranks - 1 - r]
        else:
            mine = list(range(r, n, ranks))
        stages = [ept.PipelineStage(parts[g], g, n, device, comm=comms[r]) for g in mine]
        params = [p for s in stages for p in s.submod.parameters()]
        opt = torch.optim.SGD(params, lr=LR)
        with schedule_cls(stages if chunks > 1 else stages[0], MB, loss_fn=mse,
                          timeout_ms=20000, stream_ordered=stream_ordered) as sched:
            for x, t in data:
                opt.zero_grad()
                out = sched.step(x, target=t, losses=losses if (n - 1) in mine else None)
                assert (out is not None) == ((n - 1) in mine)
                if out is not None:
                    assert out.shape == (BATCH, 4)
                opt.step()
            # forward-only, under no_grad: the output of the trained model
            with torch.no_grad():
                ev = sched.step(data[0][0])
            if ev is not None:
                got["eval"] = ev
        for g in mine:
            got[g] = parts[g]

    raise_first(run_threads(comms, body))
    flat = torch.cat([p.detach().reshape(-1) for g in range(n) for p in got[g].parameters()])
    return flat, [x.item() for x in losses], got["eval"], [got[g] for g in range(n)]


@pytest.mark.parametrize("schedule_cls,ranks,chunks", [
    (ept.ScheduleGPipe, 2, 1), (ept.Schedule1F1B, 3, 1), (ept.ScheduleZBH1, 3, 1),
    (ept.ScheduleInterleaved1F1B, 2, 2), (ept.ScheduleZBV, 2, 2)])
def test_step_equals_one_process(schedule_cls, ranks, chunks):
    ref, ref_losses = one_process(make_model())
    got, losses, ev, parts = pipelined(schedule_cls, ranks, chunks)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    with torch.no_grad():
        model = torch.nn.Sequential(*parts)
        want = torch.cat([model(xm) for xm in torch.tensor_split(batches()[0][0], MB)])
        torch.testing.assert_close(ev, want, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
@pytest.mark.parametrize("schedule_cls,ranks,chunks", [
    (ept.ScheduleGPipe, 2, 1), (ept.Schedule1F1B, 3, 1), (ept.ScheduleZBH1, 3, 1),
    (ept.ScheduleInterleaved1F1B, 2, 2), (ept.ScheduleZBV, 2, 2)])
def test_step_on_cuda_equals_one_process(schedule_cls, ranks, chunks):
    """The same on the GPU: the boundary tensors stay there (sent as CUDA
    tensors, received into GPU memory the stage lends) and training equals
    one process on the same GPU."""
    ref, ref_losses = one_process(make_model(), "cuda")
    got, losses, ev, parts = pipelined(schedule_cls, ranks, chunks, "cuda")
    assert got.device.type == "cuda" and ev.device.type == "cuda"
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_stream_ordered_on_cpu_changes_nothing():
    """stream_ordered=True with CPU stages: the knob is for CUDA stages only."""
    ref, ref_losses = one_process(make_model())
    got, losses, _, _ = pipelined(ept.Schedule1F1B, 2, 1, stream_ordered=True)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
@pytest.mark.parametrize("schedule_cls,ranks,chunks", [
    (ept.ScheduleGPipe, 2, 1), (ept.Schedule1F1B, 3, 1), (ept.ScheduleZBV, 2, 2)])
def test_step_on_cuda_stream_ordered_equals_one_process(schedule_cls, ranks, chunks):
    """With stream_ordered=True the sends and receives return with their
    work queued on torch's stream: training still equals one process."""
    ref, ref_losses = one_process(make_model(), "cuda")
    got, losses, ev, parts = pipelined(schedule_cls, ranks, chunks, "cuda", stream_ordered=True)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@pytest.mark.parametrize("schedule_cls", [ept.Schedule1F1B, ept.ScheduleZBH1])
def test_each_input_gradient_computed_once(schedule_cls):
    """The deferred weight op of ZB-H1 starts at each layer's output: every
    gradient that flows into a layer's input is computed once per
    micro-batch, as in 1F1B, not a second time by the weight op (autograd
    skips what the op's targets do not need; a hook on each linear layer's
    input counts what it computes)."""
    torch.manual_seed(3)
    counts = [0, 0]
    parts = [torch.nn.Sequential(*(m for _ in range(3)
                                   for m in (torch.nn.Linear(6, 6), torch.nn.Tanh())))
             for _ in range(2)]

    def counter(r):
        def count(_):
            counts[r] += 1

        def pre(_module, args):
            if args[0].grad_fn is not None:  # an intermediate: not the stage's input
                args[0].register_hook(count)
        return pre

    for r, part in enumerate(parts):
        for m in part:
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(counter(r))
    comms = epipe.Comm.inproc(2)
    x, t = torch.randn(BATCH, 6), torch.randn(BATCH, 6)

    def body(r):
        stage = ept.PipelineStage(parts[r], r, 2, comm=comms[r])
        with schedule_cls(stage, MB, loss_fn=mse, timeout_ms=20000) as sched:
            sched.step(x, target=t)

    raise_first(run_threads(comms, body))
    # two linear layers a stage take an intermediate input
    assert counts == [2 * MB, 2 * MB]


def test_split_sequential():
    model = make_model()  # 9 modules: Linear, Tanh, ... Linear
    assert [len(p) for p in ept.split_sequential(model, 3, by="index")] == [3, 3, 3]
    assert [len(p) for p in ept.split_sequential(model, 2, boundaries=[4])] == [4, 5]
    big = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 2),
                              torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    # by parameters: the big layer alone, the three small ones together
    assert [len(p) for p in ept.split_sequential(big, 2)] == [1, 3]
    with pytest.raises(ValueError, match="at least one"):
        ept.split_sequential(model, 10)
    with pytest.raises(ValueError, match="increasing"):
        ept.split_sequential(model, 3, boundaries=[5, 2])
    with pytest.raises(ValueError, match="by="):
        ept.split_sequential(model, 2, by="time")


def test_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        ept.PipelineStage(torch.nn.Linear(2, 2), 3, 3)
    with pytest.raises(TypeError, match="nn.Module"):
        ept.PipelineStage(lambda x: x, 0, 1)
    # the device: named, checked against what torch sees and where the module is
    with pytest.raises(ValueError, match="device 'gpu' is not a device"):
        ept.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            ept.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cuda")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            ept.PipelineStage(torch.nn.Linear(2, 2).cuda(), 0, 1,
                              f"cuda:{torch.cuda.device_count()}")
        with pytest.raises(ValueError, match="'weight' is on cpu"):
            ept.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cuda")
    with pytest.raises(ValueError, match=r"PipelineStage 1: the module's parameter '0.weight' "
                                         r"is on meta, not the stage's device cpu; "
                                         r".*module.to\('cpu'\)"):
        ept.PipelineStage(torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta")), 1, 2)
    with pytest.raises(ValueError, match="buffer 'running_mean' is on meta"):
        ept.PipelineStage(torch.nn.BatchNorm1d(2, device="meta", affine=False), 0, 1)
    comms = epipe.Comm.inproc(1)
    try:
        st = ept.PipelineStage(torch.nn.Linear(2, 2), 0, 1, comm=comms[0])
        # interleaved with one chunk on one rank is the library's to refuse
        with ept.Schedule1F1B(st, 2, loss_fn=mse) as s:
            with pytest.raises(ValueError, match="loss_fn and target"):
                s.step(torch.zeros(4, 2))
            with pytest.raises(ValueError, match="cannot be cut"):
                s.step(torch.zeros(1, 2), target=torch.zeros(1, 2))
        wrong = ept.PipelineStage(torch.nn.Linear(2, 2), 0, 2, comm=comms[0])
        with pytest.raises(ValueError, match="pipeline stages"):
            ept.Schedule1F1B(wrong, 2, loss_fn=mse)
    finally:
        comms[0].close()


@pytest.mark.parametrize("make,what", [(lambda y: (y, y), "a tuple"), (lambda y: None, "None")])
def test_a_module_must_return_one_tensor(make, what):
    class Returns(torch.nn.Module):
        def forward(self, x):
            return make(x)

    comms = epipe.Comm.inproc(1)
    try:
        st = ept.PipelineStage(Returns(), 0, 1, comm=comms[0])
        with ept.Schedule1F1B(st, 2, loss_fn=mse) as s:
            with pytest.raises(TypeError, match=f"returned {what}; a pipeline stage must return "
                                                f"one tensor"):
                s.step(torch.zeros(4, 2), target=torch.zeros(4, 2))
    finally:
        comms[0].close()


def test_a_step_that_raises_stops_the_pipeline():
    """An exception in the middle of a step (the host's module here) leaves
    the op stream part way: the schedule aborts its communicator, so the
    other rank's step fails at once (not at its timeout), and every later
    step on either rank raises, naming the first failure. Arguments refused
    before any op cost nothing: the schedule goes on."""
    class Fails(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:  # the third micro-batch of the first step
                raise RuntimeError("the host's module failed")
            return self.lin(x)

    comms = epipe.Comm.inproc(2)
    x, t = torch.randn(BATCH, 6), torch.randn(BATCH, 6)
    seen = [None, None]
    done = threading.Event()  # rank 1's step is over: rank 0 may leave

    def body(r):
        stage = ept.PipelineStage(Fails() if r == 0 else torch.nn.Linear(6, 6), r, 2,
                                  comm=comms[r])
        with ept.Schedule1F1B(stage, MB, loss_fn=mse, timeout_ms=60000) as sched:
            if r == 1:
                with pytest.raises(ValueError, match="loss_fn and target"):
                    sched.step(x)  # refused before any op: not a failed step
            t0 = time.monotonic()
            with pytest.raises(Exception) as first:
                sched.step(x, target=t)
            seen[r] = (type(first.value).__name__, str(first.value), time.monotonic() - t0)
            if r == 1:
                done.set()
            else:  # stays, so that only the abort can wake rank 1 (leaving would too)
                done.wait(20)
            with pytest.raises(RuntimeError, match="an earlier step failed"):
                sched.step(x, target=t)

    raise_first(run_threads(comms, body))
    assert seen[0][0] == "RuntimeError" and "the host's module failed" in seen[0][1]
    assert seen[1][0] == "Error" and "EPIPE_EPEER" in seen[1][1], seen[1]
    assert seen[1][2] < 10, seen[1]  # woken by the abort, not by rank 0 leaving at 20 s


@pytest.mark.parametrize("n", [0, -3, 10**9, 2.5, True])
def test_microbatch_count_is_checked(n):
    comms = epipe.Comm.inproc(1)
    try:
        st = ept.PipelineStage(torch.nn.Linear(2, 2), 0, 1, comm=comms[0])
        with pytest.raises(ValueError, match="n_microbatches must be an int in 1..65536"):
            ept.Schedule1F1B(st, n, loss_fn=mse)
    finally:
        comms[0].close()
