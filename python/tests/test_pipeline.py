"""An in-process pipeline driven from Python threads through the op stream
matches unpipelined torch; op-order and shape errors raise epipe.Error."""
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import epipe  # noqa: E402
from conftest import blas_codecs_missing, raise_first, run_threads  # noqa: E402

BATCH, MB, IN, HID, OUT = 16, 4, 8, 12, 3


def make_model(seed=0):
    torch.manual_seed(seed)
    return [
        torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh()),
        torch.nn.Sequential(torch.nn.Linear(HID, HID), torch.nn.ReLU()),
        torch.nn.Linear(HID, OUT),
    ]


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def loss_fn(y, t):
    return ((y - t) ** 2).sum()


def drive(stage, module, xs, ts, losses):
    """One training step of `stage` through the op stream, with autograd."""
    saved = {}
    for op in stage.ops():
        mb = op.microbatch
        if op.kind == epipe.OP_FORWARD:
            if stage.is_first:
                x = xs[mb]
            else:
                x = stage.recv_activation(mb).requires_grad_()
            y = module(x)
            if stage.is_last:
                y = loss_fn(y, ts[mb])
                losses[mb] = y.item()
            else:
                stage.send_activation(mb, y)
            saved[mb] = (x, y)
        else:
            assert op.kind == epipe.OP_BACKWARD
            x, y = saved.pop(mb)
            if stage.is_last:
                torch.autograd.backward(y)
            else:
                torch.autograd.backward(y, stage.recv_gradient(mb))
            if not stage.is_first:
                stage.send_gradient(mb, x.grad)
    assert not saved


def run_pipeline(parts, schedule, act="none", grad="none", steps=1):
    p = len(parts)
    comms = epipe.Comm.inproc(p)
    x, t = data()
    xs, ts = x.chunk(MB), t.chunk(MB)
    losses, stats = {}, [None] * p

    def body(s):
        with epipe.Stage(comms[s], schedule, MB, act_codec=act, grad_codec=grad,
                         batch_size=BATCH, timeout_ms=20000) as st:
            assert (st.index, st.count) == (s, p)
            for _ in range(steps):
                drive(st, parts[s], xs, ts, losses)
            stats[s] = st.stats()
            stats[s]["boundary_stats"] = st.boundary_stats()

    raise_first(run_threads(comms, body))
    return losses, stats


def reference_grads(parts):
    x, t = data()
    y = x
    for m in parts:
        y = m(y)
    loss = loss_fn(y, t)
    loss.backward()
    return loss.item(), [[q.grad.clone() for q in m.parameters()] for m in parts]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("nstages", [2, 3])
def test_pipeline_matches_torch(schedule, nstages):
    ref_parts = make_model()
    if nstages == 2:
        ref_parts = [torch.nn.Sequential(ref_parts[0], ref_parts[1]), ref_parts[2]]
    ref_loss, ref = reference_grads(ref_parts)

    parts = make_model()
    if nstages == 2:
        parts = [torch.nn.Sequential(parts[0], parts[1]), parts[2]]
    losses, stats = run_pipeline(parts, schedule)
    assert sorted(losses) == list(range(MB))
    assert sum(losses.values()) == pytest.approx(ref_loss, rel=1e-5)
    for s, m in enumerate(parts):
        for q, r in zip(m.parameters(), ref[s]):
            torch.testing.assert_close(q.grad, r, rtol=1e-5, atol=1e-6)
    # codec none: the wire carries the raw bytes plus headers
    st0 = stats[0]
    assert st0["steps"] == 1
    assert st0["act_sent_raw"] == BATCH * HID * 4
    assert st0["act_sent_wire"] > st0["act_sent_raw"]
    # live statistics: one record per boundary to another rank, matching the totals
    assert st0["samples"] == BATCH and st0["samples_per_second"] > 0
    assert 0 <= st0["bubble_fraction"] <= 1
    assert 0 < st0["step_p50_seconds"] <= st0["step_p99_seconds"]
    (b0,) = st0["boundary_stats"]
    assert (b0["boundary"], b0["peer"], b0["sends_activations"]) == (0, 1, 1)
    assert (b0["act_raw"], b0["act_wire"]) == (st0["act_sent_raw"], st0["act_sent_wire"])
    assert b0["act_peak_mbps"] > 0 and b0["act_mbps"] > 0
    assert len(stats[1]["boundary_stats"]) == (2 if nstages == 3 else 1)
    assert st0["grad_recv_raw"] == BATCH * HID * 4
    assert stats[1]["act_recv_raw"] == BATCH * HID * 4


def test_pipeline_with_compression_stays_close():
    ref_parts = make_model()
    ref_parts = [torch.nn.Sequential(ref_parts[0], ref_parts[1]), ref_parts[2]]
    _, ref = reference_grads(ref_parts)
    parts = make_model()
    parts = [torch.nn.Sequential(parts[0], parts[1]), parts[2]]
    _, stats = run_pipeline(parts, "1f1b", act="quant:bits=16", grad="quant:bits=16")
    for s, m in enumerate(parts):
        for q, r in zip(m.parameters(), ref[s]):
            torch.testing.assert_close(q.grad, r, rtol=1e-2, atol=1e-3)
    parts = make_model()
    _, plain = run_pipeline([torch.nn.Sequential(parts[0], parts[1]), parts[2]], "1f1b")
    # 16-bit codes: half the payload of fp32 (the headers are the same)
    assert plain[0]["act_sent_wire"] - stats[0]["act_sent_wire"] >= BATCH * HID * 2 - 64
    assert plain[0]["grad_recv_wire"] - stats[0]["grad_recv_wire"] >= BATCH * HID * 2 - 64


def test_several_steps_and_codec_mismatch_is_refused():
    parts = make_model()
    run_pipeline([torch.nn.Sequential(parts[0], parts[1]), parts[2]], "1f1b", steps=3)

    comms = epipe.Comm.inproc(2)

    def body(s):
        with epipe.Stage(comms[s], "gpipe", 1, timeout_ms=5000) as st:
            st.set_codec(epipe.ACTIVATION, "quant:bits=8" if s == 0 else "sortquant:bits=8")
            op = st.next_op()
            if s == 0:
                st.send_activation(op.microbatch, torch.randn(4, 4))
            else:
                st.recv_activation(op.microbatch)

    errors = run_threads(comms, body, join_s=30)
    assert errors[0] is None or isinstance(errors[0], epipe.Error)
    assert errors[1] is not None and errors[1].name == "EPIPE_EPROTO"
    assert "quant" in errors[1].message


def test_op_stream_order_errors():
    comms = epipe.Comm.inproc(2)
    try:
        st = epipe.Stage(comms[0], "gpipe", 2)
        with pytest.raises(epipe.Error) as ei:
            st.set_codec(epipe.ACTIVATION, "sortquant:bits=99")
        assert ei.value.name == "EPIPE_EINVAL" and "bits" in ei.value.message
        op = st.next_op()
        assert op == (epipe.OP_FORWARD, 0, 0)  # kind, micro-batch, chunk
        with pytest.raises(epipe.Error) as ei:
            st.send_activation(1, torch.ones(2, 2))  # wrong micro-batch
        assert ei.value.name == "EPIPE_ESTATE" and ei.value.message
        with pytest.raises(epipe.Error) as ei:
            st.recv_gradient(0)  # not in a backward
        assert ei.value.name == "EPIPE_ESTATE"
        with pytest.raises(epipe.Error) as ei:
            st.send_activation(0, torch.ones(2, 2, dtype=torch.float64))
        assert ei.value.name == "EPIPE_EINVAL"
        with pytest.raises(epipe.Error) as ei:
            st.set_codec(epipe.ACTIVATION, "none")  # only before the first step
        assert ei.value.name == "EPIPE_ESTATE"
        st.close()
    finally:
        for c in comms:
            c.close()


def test_a_second_thread_is_refused():
    # While one thread waits in a receive, a call from another is refused
    # with a message naming the call inside, not the stage's last error
    # (set here by an earlier mistake); the step then ends as it would have.
    comms = epipe.Comm.inproc(2)
    try:
        st0 = epipe.Stage(comms[0], "gpipe", 1, timeout_ms=20000)
        st1 = epipe.Stage(comms[1], "gpipe", 1, timeout_ms=20000)
        with pytest.raises(epipe.Error):
            st1.set_codec(epipe.ACTIVATION, "sortquant:bits=99")
        inside = threading.Event()
        got = []

        def rank1():
            st1.next_op()
            inside.set()
            while True:  # this thread's own claim may meet the probe below
                try:
                    got.append(st1.recv_activation(0, copy=True))
                    break
                except epipe.Error as e:
                    if "another thread is inside" not in e.message:
                        raise
            st1.next_op()
            st1.send_gradient(0, torch.ones(4))
            st1.next_op()

        t = threading.Thread(target=rank1)
        t.start()
        inside.wait(10)
        for _ in range(1000):  # a harmless probe, until the receive holds the stage
            try:
                st1.set_param(epipe.STAGE_TIMEOUT_MS, 20000)
            except epipe.Error as e:
                assert e.name == "EPIPE_ESTATE"
                assert "another thread is inside epipe_stage_recv_activation" in e.message
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the receive never held the stage")
        with pytest.raises(epipe.Error) as ei:
            st1.next_op()
        assert ei.value.name == "EPIPE_ESTATE"
        assert "another thread is inside epipe_stage_recv_activation" in ei.value.message
        with pytest.raises(epipe.Error) as ei:
            st1.reset_stats()
        assert "epipe_stage_reset_stats: another thread is inside" in ei.value.message
        st0.next_op()
        st0.send_activation(0, torch.full((4,), 7.0))
        st0.next_op()
        st0.recv_gradient(0, copy=True)
        t.join(20)
        assert got and torch.equal(got[0], torch.full((4,), 7.0))
        st0.close()
        st1.close()
    finally:
        for c in comms:
            c.close()


def test_batch_size_checks_rows():
    comms = epipe.Comm.inproc(2)
    try:
        with pytest.raises(epipe.Error) as ei:
            epipe.Stage(comms[0], "gpipe", 3, batch_size=16)
        assert ei.value.name == "EPIPE_EINVAL"
        st = epipe.Stage(comms[0], "gpipe", 4, batch_size=16)
        st.next_op()
        with pytest.raises(epipe.Error) as ei:
            st.send_activation(0, torch.ones(5, 3))
        assert ei.value.name == "EPIPE_EINVAL" and "4" in ei.value.message
    finally:
        for c in comms:
            c.close()


def test_stage_cuda_stream_setting():
    """set_cuda_stream takes None, an integer or an object with .cuda_stream
    (torch.cuda.Stream) and reaches the C call; a CPU stage stores it and
    still runs (the CUDA side: tests/fakecuda/test_stage_staged.c)."""
    class FakeStream:
        cuda_stream = 0x5eed

    comms = epipe.Comm.inproc(2)
    try:
        st = epipe.Stage(comms[0], "gpipe", 1)
        for s in (None, 0x1234, FakeStream()):
            st.set_cuda_stream(s)
        assert st._stream == 0x5eed
        st.close()
    finally:
        for c in comms:
            c.close()


def test_bad_schedule_and_comm_info():
    comms = epipe.Comm.inproc(3)
    try:
        assert [c.rank for c in comms] == [0, 1, 2]
        assert comms[1].size == 3 and comms[1].transport == "inproc"
        with pytest.raises(epipe.Error) as ei:
            epipe.Stage(comms[0], "zigzag", 4)
        assert "zigzag" in ei.value.message
    finally:
        for c in comms:
            c.close()


def test_insert_trains_through_the_binding():
    """A trainable codec on the activations: the stage runs its backward, the
    host steps the model with torch and the codec with codec_sgd_step, and
    the loss falls; a codec_sgd_step mid-step raises."""
    why = blas_codecs_missing()
    if why:
        pytest.skip(why)
    parts = make_model(3)
    p, steps = len(parts), 40
    comms = epipe.Comm.inproc(p)
    x, t = data(4)
    xs, ts = x.chunk(MB), t.chunk(MB)
    history = []

    def body(s):
        opt = torch.optim.SGD(parts[s].parameters(), lr=0.002, momentum=0.9)
        with epipe.Stage(comms[s], "1f1b", MB, act_codec="insert:kind=linear,out=6",
                         grad_codec="none", timeout_ms=20000) as st:
            for _ in range(steps):
                losses = {}
                opt.zero_grad()
                drive(st, parts[s], xs, ts, losses)
                opt.step()
                st.codec_sgd_step(0.002, 0.9)
                if st.is_last:
                    history.append(sum(losses.values()))
            if s == 0:
                st.next_op()  # mid-step now
                with pytest.raises(epipe.Error) as e:
                    st.codec_sgd_step(0.002, 0.9)
                assert e.value.name == "EPIPE_ESTATE"

    raise_first(run_threads(comms, body))
    assert len(history) == steps
    assert history[-1] < 0.5 * history[0], history


def test_activation_deltas_through_the_binding():
    """delta=1 with sample ids from set_samples(): the second step's
    activations go as changes, coded on their own much narrower range (ten
    times closer than the first, full send), a send without ids is refused
    by name, and bad ids raise before reaching the library. Rows sent
    untracked (ids None) are coded whole, exactly as the codec codes
    untracked rows, and leave the stored rows as they were."""
    comms = epipe.Comm.inproc(2)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    got = []

    def body(s):
        # delta_raw=0: first sightings coded too (the default sends them exactly)
        with epipe.Stage(comms[s], "gpipe", 1, act_codec="quant:bits=4,delta=1,delta_raw=0",
                         timeout_ms=20000) as st:
            for step in range(5):
                for op in st.ops():
                    mb = op.microbatch
                    if op.kind == epipe.OP_BACKWARD:
                        if s == 1:
                            st.send_gradient(mb, torch.zeros(8, 64))
                        else:
                            st.recv_gradient(mb)
                    elif s == 1:
                        got.append(st.recv_activation(mb, copy=True))
                    elif step < 2 or step == 4:
                        st.set_samples(mb, range(100, 108))
                        st.send_activation(mb, x + 0.01 * step)
                    elif step == 3:  # untracked: x + 0.03 coded whole
                        with pytest.raises(TypeError):
                            st.set_samples(mb, None)
                        st.set_samples(mb, None, rows=8)
                        st.send_activation(mb, x + 0.03)
                    else:  # no ids: refused, naming the call to make
                        with pytest.raises(epipe.Error) as ei:
                            st.send_activation(mb, x)
                        assert ei.value.name == "EPIPE_EINVAL"
                        assert "set_samples" in ei.value.message
                        with pytest.raises(ValueError):
                            st.set_samples(mb, [-1] * 8)
                        st.set_samples(mb, range(100, 108))
                        st.send_activation(mb, x)

    raise_first(run_threads(comms, body))
    assert len(got) == 5
    err0 = (got[0] - x).abs().max().item()
    assert 0 < err0 < 0.5
    assert (got[1] - (x + 0.01)).abs().max().item() < 0.1 * err0
    assert (got[2] - x).abs().max().item() < 0.1 * err0
    assert (got[3] - (x + 0.03)).abs().max().item() > 0.1 * err0  # coded whole
    assert (got[4] - (x + 0.04)).abs().max().item() < 0.1 * err0
    # exactly what a codec pair gives for the same sends: step 4 a change from
    # step 2's stored rows, the untracked step kept by neither side
    enc, dec = (epipe.Codec("quant:bits=4,delta=1,delta_raw=0") for _ in range(2))
    sends = [(x, True), (x + 0.01, True), (x, True), (x + 0.03, False), (x + 0.04, True)]
    for step, (value, tracked) in enumerate(sends):
        enc.set_samples(range(100, 108) if tracked else None, rows=8)
        want = torch.empty(8, 64)
        dec.decode(enc.encode(value), want)
        assert torch.equal(got[step], want), step
