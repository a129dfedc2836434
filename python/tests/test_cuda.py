"""epipe.Codec on CUDA tensors: payloads in device memory, byte-identical to
the CPU's, work ordered on torch's current stream, deferred errors at
synchronize(). Skipped (with the reason) where torch sees no GPU."""
import pytest

torch = pytest.importorskip("torch")
import epipe  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device for torch", allow_module_level=True)

SPECS = ["none", "cast:dtype=bf16", "quant:bits=8", "quant:bits=3", "sortquant:bits=8,mode=sample",
         "sortquant:bits=8", "sortquant:bits=4,mode=exact"]


def cpu_payload(spec, x):
    with epipe.Codec(spec) as c:
        return c.encode(x)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_payload_is_the_cpus(spec, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1000, 33, generator=g).to(dtype)
    want = cpu_payload(spec, x)
    with epipe.Codec(spec) as c:
        p = c.encode(x.cuda())
        assert p.device.type == "cuda" and p.dtype == torch.uint8
        c.synchronize()
        assert bytes(p.cpu().numpy()) == want
        # decoded on the GPU, from the device payload and from the CPU's bytes
        y = c.decode(p, shape=x.shape, dtype=dtype)
        assert y.device.type == "cuda"
        z = c.decode(want, out=torch.empty_like(x, device="cuda"))
        c.synchronize()
    with epipe.Codec(spec) as c:
        ref = c.decode(want, shape=x.shape, dtype=dtype)
    assert torch.equal(y.cpu(), ref) and torch.equal(z.cpu(), ref)


def test_work_follows_torchs_stream():
    x = torch.randn(1 << 20)
    want = cpu_payload("quant:bits=8", x)
    s = torch.cuda.Stream()
    with epipe.Codec("quant:bits=8") as c, torch.cuda.stream(s):
        xs = x.to("cuda", non_blocking=True)  # made on s: the codec must wait for it
        p = c.encode(xs)
        y = c.decode(p, shape=x.shape)
        s.synchronize()
        assert bytes(p.cpu().numpy()) == want
    with epipe.Codec("quant:bits=8") as c:
        assert torch.equal(y.cpu(), c.decode(want, shape=x.shape))


def test_nan_surfaces_at_synchronize():
    x = torch.ones(5000, device="cuda")
    x[1234] = float("nan")
    with epipe.Codec("quant:bits=8") as c:
        c.encode(x)  # enqueued: the kernels note the NaN
        with pytest.raises(epipe.Error) as e:
            c.synchronize()
        assert e.value.name == "EPIPE_EINVAL" and "index 1234 is NaN" in e.value.message
        c.synchronize()  # reported once


def test_device_payload_with_cpu_tensor_is_refused():
    x = torch.randn(100)
    with epipe.Codec("quant:bits=8") as c:
        p = c.encode(x.cuda())
    with epipe.Codec("quant:bits=8") as c:  # a fresh handle: not bound to CUDA
        with pytest.raises(epipe.Error) as e:
            c.decode(p, out=torch.empty(100))
        assert "src is CUDA device memory" in e.value.message
