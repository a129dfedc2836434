"""Codec.encode(out=) and encode_view() write into caller-provided or reused
memory, and decode reads any buffer in place: the same bytes as encode()."""
import ctypes

import pytest

torch = pytest.importorskip("torch")
import epipe  # noqa: E402

SPECS = ["none", "quant:bits=8", "sortquant:bits=8"]


def _x(n=5000, seed=3):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _addr(b):
    return ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))


@pytest.mark.parametrize("spec", SPECS)
def test_encode_into_out_gives_the_same_bytes(spec):
    x = _x()
    c = epipe.Codec(spec)
    ref = c.encode(x)
    out = bytearray(c.max_encoded_size(x) + 7)
    mv = c.encode(x, out=out)
    assert isinstance(mv, memoryview) and mv.obj is out
    assert bytes(mv) == ref and len(mv) == len(ref)
    # written in place: the bytearray holds the payload
    assert bytes(out[:len(ref)]) == ref


@pytest.mark.parametrize("spec", SPECS + ["topk:ratio=0.1", "kmeans:bits=4", "quant:bits=3"])
def test_encode_returns_bytes_of_the_payload_size(spec):
    # encoded straight into the bytes it returns (every codec here fills
    # max_encoded_size exactly): a real immutable bytes, equal to
    # encode_view's payload
    x = _x()
    c = epipe.Codec(spec)
    p = c.encode(x)
    assert type(p) is bytes
    assert p == bytes(c.encode_view(x))
    assert len(p) <= c.max_encoded_size(x)
    assert c.encode(x) == p  # a second call gives a new, equal object
    torch.testing.assert_close(c.decode(p, shape=x.shape), c.decode(c.encode_view(x),
                                                                    shape=x.shape))


def test_encode_trims_a_payload_shorter_than_its_bound():
    # a delta=1 codec's bound is the raw first sighting; a row seen before
    # travels as a 2-bit delta, so the bytes returned are the written prefix
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5))
    c, d = epipe.Codec("quant:bits=2,delta=1"), epipe.Codec("quant:bits=2,delta=1")
    for step in range(2):
        c.set_samples([10, 11, 12, 13])
        p = c.encode(x + 0.01 * step)
        assert type(p) is bytes
        y = d.decode(p, shape=x.shape)
    assert len(p) < c.max_encoded_size(x) // 4
    assert (y - (x + 0.01)).abs().max() < 0.01
    c.set_samples(None, rows=4)  # untracked: values, not changes, through the codec
    plain = epipe.Codec("quant:bits=2,zero=1")
    assert torch.equal(d.decode(c.encode(x), shape=x.shape),
                       plain.decode(plain.encode(x), shape=x.shape))
    with pytest.raises(TypeError):
        c.set_samples(None)
    with pytest.raises(ValueError):
        c.set_samples([1, -2, 3, 4])
    with pytest.raises(epipe.Error):
        epipe.Codec("quant:bits=2").set_samples([1, 2, 3, 4])


@pytest.mark.parametrize("kind", ["memoryview", "uint8 tensor"])
def test_encode_into_other_buffers(kind):
    x = _x()
    c = epipe.Codec("quant:bits=8")
    ref = c.encode(x)
    n = c.max_encoded_size(x)
    if kind == "memoryview":
        backing = bytearray(n + 10)
        out = memoryview(backing)[10:]
        got = bytes(c.encode(x, out=out))
        assert bytes(backing[10:10 + len(ref)]) == ref
    else:
        out = torch.empty(n, dtype=torch.uint8)
        got = c.encode(x, out=out)
        assert isinstance(got, torch.Tensor) and got.data_ptr() == out.data_ptr()
        got = bytes(got.numpy().tobytes())
    assert got == ref


@pytest.mark.parametrize("out,why", [
    (lambda n: bytes(n), "writable"),
    (lambda n: memoryview(bytearray(n)).toreadonly(), "writable"),
    (lambda n: torch.zeros(n, dtype=torch.float32), "uint8 tensor"),
    (lambda n: torch.zeros(2 * n, dtype=torch.uint8)[::2], "non-contiguous"),
    (lambda n: [0] * n, "got list"),
])
def test_out_that_is_not_writable_bytes_is_refused(out, why):
    """A float tensor was taken as raw memory and the payload returned as a
    float tensor of as many elements as it had bytes."""
    x = _x()
    c = epipe.Codec("quant:bits=8")
    with pytest.raises(TypeError, match=why):
        c.encode(x, out=out(c.max_encoded_size(x)))


def test_too_small_out_names_the_size_needed():
    x = _x()
    c = epipe.Codec("none")
    with pytest.raises(epipe.Error) as ei:
        c.encode(x, out=bytearray(100))
    assert ei.value.name == "EPIPE_ENOSPC"
    assert str(c.max_encoded_size(x)) in ei.value.message


def test_read_only_out_is_refused():
    c = epipe.Codec("none")
    with pytest.raises(TypeError, match="writable"):
        c.encode(_x(), out=bytes(1 << 16))


def test_encode_view_reuses_its_buffer():
    c = epipe.Codec("sortquant:bits=8")
    x1, x2 = _x(seed=1), _x(seed=2)
    v1 = c.encode_view(x1)
    assert v1.readonly and bytes(v1) == c.encode(x1)
    a1 = _addr(c._scratch)
    v2 = c.encode_view(x2)
    assert _addr(c._scratch) == a1  # same memory: nothing allocated
    assert bytes(v2) == c.encode(x2)
    # a larger tensor grows it; the old view stays readable
    kept = bytes(v2)
    v3 = c.encode_view(_x(50000))
    assert bytes(v2) == kept and len(v3) > len(v2)


@pytest.mark.parametrize("wrap", [bytes, bytearray, lambda b: memoryview(b),
                                  lambda b: memoryview(bytearray(b"xx" + b))[2:]])
def test_decode_reads_any_buffer(wrap):
    x = _x()
    c = epipe.Codec("quant:bits=16")
    p = c.encode(x)
    y = c.decode(wrap(p), shape=x.shape)
    assert torch.allclose(x, y, atol=1e-3)


def test_decode_of_a_truncated_view_fails_cleanly():
    x = _x()
    c = epipe.Codec("none")
    p = c.encode(x)
    with pytest.raises(epipe.Error) as ei:
        c.decode(memoryview(p)[:-4], shape=x.shape)
    assert ei.value.name in ("EPIPE_ETRUNC", "EPIPE_EPROTO")
