"""epipe.Codec: round trips through the C codecs, spec errors, tensor errors."""
import pytest

torch = pytest.importorskip("torch")
import epipe  # noqa: E402
from conftest import raise_first, run_threads  # noqa: E402


def test_version():
    assert epipe.version().count(".") == 2
    major, minor, patch = (int(p) for p in epipe.version().split("."))
    assert epipe.version_number() == 10000 * major + 100 * minor + patch


# spec, largest allowed |error| relative to the tensor's range (None: exact)
ROUND_TRIPS = [
    ("none", None),
    ("cast:dtype=bf16", 1e-2),
    ("cast:dtype=fp16", 1e-3),
    ("quant:bits=8", 1.0 / 255),
    ("quant:bits=16", 1e-4),
    # fit (the default): chunks within the range, at least 4 level bits
    ("sortquant:bits=8", 1.0 / 30),
    ("sortquant:bits=8,mode=sample", 1.0 / 63),
    ("sortquant:bits=12,split=3,mode=exact", 1.0 / 511),
    ("kmeans:bits=4", 0.25),
]


@pytest.mark.parametrize("spec,tol", ROUND_TRIPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip(spec, tol, dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, 7, generator=g).to(dtype)
    c = epipe.Codec(spec)
    payload = c.encode(x)
    assert isinstance(payload, bytes)
    assert 16 <= len(payload) <= c.max_encoded_size(x)
    y = c.decode(payload, shape=x.shape, dtype=dtype)
    assert y.shape == x.shape and y.dtype == dtype
    if tol is None:
        assert torch.equal(x, y)
    else:
        rng = (x.float().max() - x.float().min()).item()
        # a 16-bit dtype adds its own rounding on the way back
        slack = 0 if dtype == torch.float32 else 1e-2 * x.float().abs().max().item()
        assert (x.float() - y.float()).abs().max().item() <= tol * rng + slack + 1e-6


def test_encode_reads_strided_tensors_in_place():
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    view = base.t()[2:7]  # non-contiguous, with an offset
    c = epipe.Codec("none")
    y = c.decode(c.encode(view), shape=view.shape)
    assert torch.equal(y, view)


def test_decode_into_out_and_requires_grad_input():
    x = torch.randn(4, 4, requires_grad=True)
    c = epipe.Codec("quant:bits=16")
    out = torch.empty(16)  # same element count, other shape: allowed
    assert c.decode(c.encode(x), out=out) is out
    assert torch.allclose(out, x.detach().reshape(16), atol=1e-3)


def test_topk_keeps_largest():
    x = torch.zeros(100)
    x[[3, 50, 97]] = torch.tensor([5.0, -7.0, 2.0])
    x[10] = 0.01
    c = epipe.Codec("topk:ratio=0.03")
    y = c.decode(c.encode(x), shape=x.shape)
    assert torch.equal(y[[3, 50, 97]], x[[3, 50, 97]])
    assert y[10] == 0


def test_error_feedback_sends_what_it_dropped():
    g = torch.randn(256)
    c, d = epipe.Codec("quant:bits=2,ef=1"), epipe.Codec("quant:bits=2")
    assert c.spec == "quant:bits=2,ef=1"
    first = c.encode(g)
    assert bytes(first) == bytes(d.encode(g))  # same format, no residual yet
    total = d.decode(first, shape=g.shape)
    for _ in range(49):
        total += d.decode(c.encode(g), shape=g.shape)
    assert (total - 50 * g).abs().max() <= 0.5 * float(g.max() - g.min())
    c.reset_feedback()
    assert bytes(c.encode(g)) == bytes(first)


def test_canonical_spec_round_trips():
    c = epipe.Codec("sortquant:bits=8")
    assert c.name == "sortquant"
    assert c.spec.startswith("sortquant:bits=8,mode=fit")
    c2 = epipe.Codec(c.spec)
    assert c2.spec == c.spec and c2.id == c.id
    x = torch.randn(1000)
    assert c.encode(x) == c2.encode(x)


@pytest.mark.parametrize("spec,needle", [
    ("sortquant:bitz=8", "bitz"),
    ("quant:bits=40", "bits"),
    ("kmeans:bits=4,iters=-1", "iters"),
    ("nosuchcodec", "nosuchcodec"),
    ("cast:dtype=int8", "dtype"),
])
def test_spec_errors_name_the_bad_part(spec, needle):
    with pytest.raises(epipe.Error) as ei:
        epipe.Codec(spec)
    e = ei.value
    assert e.status == -1 and e.name == "EPIPE_EINVAL"
    assert needle in e.message, e.message
    assert needle in str(e)


def test_a_nul_in_a_spec_is_refused():
    """ctypes would pass "quant:bits=8\\0,ef=1" as "quant:bits=8": the rest
    would be lost without a word."""
    with pytest.raises(ValueError, match="NUL"):
        epipe.Codec("quant:bits=8\0,ef=1")
    with pytest.raises(ValueError, match="NUL"):
        epipe.Codec("none\0")


def test_wrong_dtype_raises():
    c = epipe.Codec("sortquant:bits=8")
    with pytest.raises(epipe.Error) as ei:
        c.encode(torch.zeros(8, dtype=torch.int32))
    assert ei.value.name == "EPIPE_EINVAL"
    assert "dtype" in ei.value.message
    with pytest.raises(epipe.Error):
        c.decode(c.encode(torch.ones(8)), out=torch.zeros(8, dtype=torch.float64))


def test_wrong_shape_raises():
    c = epipe.Codec("sortquant:bits=8")
    payload = c.encode(torch.randn(4, 8))
    with pytest.raises(epipe.Error) as ei:
        c.decode(payload, shape=(4, 7))
    assert ei.value.name == "EPIPE_EINVAL"
    assert "32" in ei.value.message and "28" in ei.value.message


def test_payload_from_other_codec_or_corrupt_raises():
    x = torch.randn(64)
    payload = epipe.Codec("quant:bits=8").encode(x)
    with pytest.raises(epipe.Error) as ei:
        epipe.Codec("sortquant:bits=8").decode(payload, shape=x.shape)
    assert ei.value.name == "EPIPE_EPROTO"
    with pytest.raises(epipe.Error) as ei:
        epipe.Codec("quant:bits=8").decode(payload[:20], shape=x.shape)
    assert ei.value.name in ("EPIPE_ETRUNC", "EPIPE_EPROTO")


def test_nan_is_refused_with_its_index():
    x = torch.zeros(10)
    x[6] = float("nan")
    with pytest.raises(epipe.Error) as ei:
        epipe.Codec("quant:bits=8").encode(x)
    assert "6" in ei.value.message


def test_non_tensor_and_cuda_like_inputs():
    with pytest.raises(TypeError):
        epipe.Codec("none").encode([1.0, 2.0])


def test_closed_handle_raises():
    c = epipe.Codec("none")
    c.close()
    c.close()  # twice is fine
    with pytest.raises(epipe.Error) as ei:
        c.encode(torch.ones(2))
    assert ei.value.name == "EPIPE_ESTATE"


def test_numpy_2_arrays_with_a_device_string():
    # NumPy 2 gives arrays .device == "cpu" (a string, not a torch device):
    # they encode, decode and pass through a stage as other host buffers do.
    np = pytest.importorskip("numpy")

    class Np2(np.ndarray):
        device = "cpu"

    x = np.linspace(-1, 1, 1000, dtype=np.float32).view(Np2)
    c = epipe.Codec("quant:bits=8")
    payload = c.encode(x)
    assert bytes(c.encode(x, out=bytearray(c.max_encoded_size(x)))) == payload
    y = np.zeros(1000, dtype=np.float32).view(Np2)
    c.decode(payload, out=y)
    assert np.abs(y - x).max() < 0.01
    got = []

    def rank(r):
        st = epipe.Stage(comms[r], "gpipe", 1, timeout_ms=5000)
        for op in st.ops():
            if op.kind == epipe.OP_FORWARD and r == 0:
                st.send_activation(op.microbatch, x.reshape(10, 100))
            elif op.kind == epipe.OP_FORWARD:
                got.append(st.recv_activation(op.microbatch, copy=True))
            elif r == 1:
                st.send_gradient(op.microbatch, y.reshape(10, 100))
            else:
                st.recv_gradient(op.microbatch, copy=True)
        st.close()

    comms = epipe.Comm.inproc(2)
    raise_first(run_threads(comms, rank))
    assert len(got) == 1
