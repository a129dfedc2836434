"""examples/torch/fmnist_split.py's op-stream driver with zb-h1 (split
backward) and interleaved (2 chunks per rank) trains to the same weights as
1f1b and as one process; split-op misuse and bad layouts raise epipe.Error."""
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
import epipe  # noqa: E402
from test_pipeline import raise_first, run_threads  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "torch", "fmnist_split.py")
if not os.path.exists(EXAMPLE):  # an installed copy of the tests, outside the source tree
    pytest.skip(f"no example at {EXAMPLE} (tests run outside the source tree)",
                allow_module_level=True)
_spec = importlib.util.spec_from_file_location("fmnist_split", EXAMPLE)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

RANKS, BATCH, MB, STEPS, LR, MOM, SEED = 3, 16, 4, 3, 0.05, 0.9, 7


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 1, 28, 28, generator=g),
             torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def flat(parts):
    return torch.cat([q.detach().reshape(-1) for m in parts for q in m.parameters()])


def one_process():
    parts = ex.build_parts(SEED, 3)
    model = torch.nn.Sequential(*parts)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    for x, y in batches():
        opt.zero_grad(set_to_none=True)
        loss = sum(torch.nn.functional.cross_entropy(model(xm), ym) / MB
                   for xm, ym in zip(x.chunk(MB), y.chunk(MB)))
        loss.backward()
        opt.step()
    return flat(parts)


def pipelined(schedule, chunks):
    """Trains on RANKS threads over inproc; returns the flat weights."""
    n = RANKS * chunks
    parts = [None] * n
    comms = epipe.Comm.inproc(RANKS)
    data = batches()
    kinds = set()
    # made here: torch's global RNG is not for threads to seed at once
    models = [ex.build_parts(SEED, n) for _ in range(RANKS)]

    def body(r):
        with epipe.Stage(comms[r], schedule, MB, chunks=chunks, batch_size=BATCH,
                         timeout_ms=20000) as st:
            assert st.chunks == chunks
            mine = ex.stage_parts(st, models[r])
            params = [q for m, _, _ in mine for q in m.parameters()]
            opt = torch.optim.SGD(params, lr=LR, momentum=MOM)
            ops = st.ops

            def spy():  # records the op kinds the schedule gives
                for op in ops():
                    kinds.add(op.kind)
                    assert st.current_op() == op
                    yield op
            st.ops = spy
            for x, y in data:
                opt.zero_grad(set_to_none=True)
                ex.train_step(st, mine, x.chunk(MB), y.chunk(MB), MB)
                opt.step()
            for c, (m, _, _) in enumerate(mine):
                parts[st.chunk_stage(c)[0]] = m

    raise_first(run_threads(comms, body))
    assert all(p is not None for p in parts)
    return flat(parts), kinds


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_zb_h1_and_interleaved_match_1f1b_and_one_process():
    ref = one_process()
    w_1f1b, k_1f1b = pipelined("1f1b", 1)
    w_zb, k_zb = pipelined("zb-h1", 1)
    w_il, k_il = pipelined("interleaved", 2)
    assert k_1f1b == {epipe.OP_FORWARD, epipe.OP_BACKWARD}
    assert k_zb == {epipe.OP_FORWARD, epipe.OP_BACKWARD_INPUT, epipe.OP_BACKWARD_WEIGHT}
    assert epipe.OP_FORWARD in k_il
    assert rel(w_1f1b, ref) < 1e-5
    assert rel(w_zb, ref) < 1e-5, rel(w_zb, ref)
    assert rel(w_il, ref) < 1e-5, rel(w_il, ref)
    assert rel(w_zb, w_1f1b) < 1e-5 and rel(w_il, w_1f1b) < 1e-5


def test_interleaved_places_chunks_round_robin():
    comms = epipe.Comm.inproc(2)
    got = {}

    def body(r):
        with epipe.Stage(comms[r], "interleaved", 4, chunks=2) as st:
            got[r] = [st.chunk_stage(c) for c in range(st.chunks)]
            with pytest.raises(epipe.Error) as ei:
                st.chunk_stage(2)
            assert ei.value.name == "EPIPE_EINVAL" and ei.value.message

    raise_first(run_threads(comms, body))
    assert got == {0: [(0, 4), (2, 4)], 1: [(1, 4), (3, 4)]}


def test_weight_op_refuses_transfers_and_bad_layouts_are_refused():
    comms = epipe.Comm.inproc(2)
    seen = []

    def body(r):
        with epipe.Stage(comms[r], "zb-h1", 2, timeout_ms=20000) as st:
            with pytest.raises(epipe.Error) as ei:
                st.current_op()  # no op in progress
            assert ei.value.name == "EPIPE_ESTATE"
            x = torch.ones(2, 3)
            for op in st.ops():
                if op.kind == epipe.OP_FORWARD:
                    if r == 0:
                        st.send_activation(op.microbatch, x)
                    else:
                        st.recv_activation(op.microbatch)
                elif op.kind == epipe.OP_BACKWARD_INPUT:
                    if r == 0:
                        st.recv_gradient(op.microbatch)
                    else:
                        st.send_gradient(op.microbatch, x)
                else:
                    assert op.kind == epipe.OP_BACKWARD_WEIGHT
                    # a weight-gradient op neither receives nor sends
                    with pytest.raises(epipe.Error) as ei:
                        if r == 0:
                            st.recv_gradient(op.microbatch)
                        else:
                            st.send_gradient(op.microbatch, x)
                    assert ei.value.name == "EPIPE_ESTATE" and ei.value.message
                    seen.append(ei.value.message)

    raise_first(run_threads(comms, body))
    assert len(seen) == 4

    # chunk counts a schedule cannot use: the library's error, no stage
    comms = epipe.Comm.inproc(2)
    try:
        for sched, chunks in (("zb-v", 3), ("zb-v", 1)):
            with pytest.raises(epipe.Error) as ei:
                epipe.Stage(comms[0], sched, 4, chunks=chunks)
            assert ei.value.name == "EPIPE_EINVAL" and ei.value.message
        with pytest.raises(epipe.Error) as ei:
            epipe.Stage(comms[0], "1f1b", 4, placement=[0, 5])
        assert ei.value.name == "EPIPE_EINVAL" and ei.value.message
    finally:
        for c in comms:
            c.close()
