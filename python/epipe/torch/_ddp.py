"""Data parallelism with compressed gradients: a DDP communication hook that
all-reduces through torch.distributed (Gloo on CPUs, NCCL on GPUs) with the
gradients encoded by a libepipe codec, and the same hook applied to a
pipeline stage's gradients after a schedule's step (DP x PP, docs/python.md).

A compressed payload cannot be summed on the wire, so the hook all-gathers
the replicas' payloads (equal sizes: quant, sortquant, cast and topk payloads
depend only on the element count) and each replica decodes and averages
them. With error feedback (the default, as EF-SGD and PowerSGD do) each
replica adds what its codec dropped from a bucket to that bucket's next
gradient."""
import torch
import torch.distributed as dist

from .. import _core


class CompressedAllreduceState:
    """The hook's state: the codec spec, the process group (None: the
    default group), and per gradient bucket the codec handle and the error
    feedback residual."""

    def __init__(self, codec, group=None, error_feedback=True):
        if not isinstance(codec, str) or not codec:
            raise TypeError("CompressedAllreduceState: codec must be a codec spec string")
        _core.Codec(codec).close()  # a bad spec fails here, naming it
        self.codec = codec
        self.group = group
        self.error_feedback = bool(error_feedback)
        self._codecs = {}
        self._residual = {}
        self.bytes_raw = 0
        self.bytes_wire = 0

    def _codec(self, index):
        c = self._codecs.get(index)
        if c is None:
            c = self._codecs[index] = _core.Codec(self.codec)
        return c

    def __getstate__(self):  # DDP may pickle the state; codec handles stay behind
        d = dict(self.__dict__)
        d["_codecs"] = {}
        return d


def _payload_tensor(c, x):
    """x encoded, as a uint8 tensor on x's device: written in place, not
    returned as bytes and copied again."""
    out = torch.empty(c.max_encoded_size(x), dtype=torch.uint8, device=x.device)
    return c.encode(x, out=out)


def compressed_allreduce_hook(state, bucket):
    """DDP communication hook (DistributedDataParallel.register_comm_hook):
    the bucket's flat gradient, encoded with state.codec, all-gathered over
    state.group, decoded and averaged; returns the Future DDP waits for."""
    grad = bucket.buffer()
    index = bucket.index()
    group = state.group
    world = dist.get_world_size(group)
    c = state._codec(index)
    x = grad
    if state.error_feedback:
        r = state._residual.get(index)
        if r is not None and r.shape == grad.shape and r.device == grad.device:
            x = grad + r
    x = x.detach().contiguous()
    mine = _payload_tensor(c, x)
    if x.device.type == "cuda":
        c.synchronize()  # deferred errors (a NaN in the gradient) surface here
    if state.error_feedback:
        back = c.decode(mine, out=torch.empty_like(x))
        state._residual[index] = x - back
    state.bytes_raw += x.numel() * x.element_size() * (world - 1)
    state.bytes_wire += mine.numel() * (world - 1)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    fut = dist.all_gather(gathered, mine, group=group, async_op=True).get_future()

    def average(_):
        out = torch.zeros_like(grad)
        tmp = torch.empty_like(grad)
        for p in gathered:
            c.decode(p, out=tmp)
            out += tmp
        if out.is_cuda:
            c.synchronize()  # a peer's bad payload (its header, its tables) is refused here
        out /= world
        return out

    return fut.then(average)


class _Bucket:
    """What the hooks read of a DDP GradBucket, over given parameters: one
    flat buffer of their gradients (PyTorch's PowerSGD hook works on it too)."""

    def __init__(self, params, index):
        self._params = params
        self._index = index
        self._buffer = torch.cat([p.grad.detach().reshape(-1) for p in params])

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return True

    def parameters(self):
        return self._params

    def gradients(self):
        out, at = [], 0
        for p in self._params:
            n = p.numel()
            out.append(self._buffer[at:at + n].view_as(p))
            at += n
        return out

    def set_buffer(self, t):
        self._buffer.copy_(t)


def allreduce_gradients(params, state, hook=compressed_allreduce_hook):
    """All-reduces the gradients of `params` (a pipeline stage's, after its
    schedule's step) across state.group with a DDP communication hook
    (compressed_allreduce_hook by default, or e.g. PyTorch's
    powerSGD_hook.powerSGD_hook with its own state), and writes the averages
    back into each p.grad. Every replica of the stage calls it, with the
    same parameters in the same order."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    bucket = _Bucket(params, 0)
    result = hook(state, bucket).wait()
    at = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(result[at:at + n].view_as(p))
        at += n
