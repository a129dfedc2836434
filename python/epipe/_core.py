"""Codec, Comm and Stage: thin wrappers over the opaque libepipe handles."""
import ctypes
import operator
import threading
import weakref
from collections import namedtuple

from . import _abi, _lib
from ._buffer import Buffer, new_bytes
from ._lib import Error, check, lib
from ._tensor import DLView, wrap_lent

_C = _abi.C
# epipe_op_kind (schedule.h) values the op stream returns
OP_NONE, OP_FORWARD, OP_BACKWARD = (
    _C["EPIPE_OP_NONE"], _C["EPIPE_OP_FORWARD"], _C["EPIPE_OP_BACKWARD"])
OP_BACKWARD_INPUT, OP_BACKWARD_WEIGHT = (
    _C["EPIPE_OP_BACKWARD_INPUT"], _C["EPIPE_OP_BACKWARD_WEIGHT"])
ACTIVATION, GRADIENT = _C["EPIPE_DIR_ACTIVATION"], _C["EPIPE_DIR_GRADIENT"]  # epipe_direction
ALL_BOUNDARIES = _C["EPIPE_ALL_BOUNDARIES"]

# knobs (codec.h, comm.h, stage.h)
CODEC_THREADS = _C["EPIPE_CODEC_THREADS"]
COMM_TIMEOUT_MS, COMM_MAX_MESSAGE, COMM_SPIN_US = (
    _C["EPIPE_COMM_TIMEOUT_MS"], _C["EPIPE_COMM_MAX_MESSAGE"], _C["EPIPE_COMM_SPIN_US"])
STAGE_TIMEOUT_MS, STAGE_CODEC_THREADS, STAGE_BATCH_SIZE, STAGE_TRAINING = (
    _C["EPIPE_STAGE_TIMEOUT_MS"], _C["EPIPE_STAGE_CODEC_THREADS"], _C["EPIPE_STAGE_BATCH_SIZE"],
    _C["EPIPE_STAGE_TRAINING"])
STAGE_CUDA_DEVICE = _C["EPIPE_STAGE_CUDA_DEVICE"]
STAGE_CUDA_STREAM_ORDERED = _C["EPIPE_STAGE_CUDA_STREAM_ORDERED"]


def _sample_ids(ids, rows=None):
    """(array, count): sample ids as the C calls take them, checked; for
    ids None (untracked rows), (None, rows)."""
    if ids is None:
        if rows is None:
            raise TypeError("set_samples: ids None (untracked rows) needs rows=, the row count")
        return None, _uint(rows, "set_samples: rows", 2**64 - 1)
    ids = [int(i) for i in ids]
    if any(not 0 <= i < 2**64 for i in ids):
        raise ValueError("set_samples: sample ids must be integers in 0..2**64-1")
    return (ctypes.c_uint64 * max(1, len(ids)))(*ids), len(ids)


def version():
    """The loaded library's version as a string, "0.1.0"."""
    return lib.epipe_version_string().decode()


def version_number():
    """The loaded library's version as 10000*major + 100*minor + patch."""
    return int(lib.epipe_version())


def _enc(s):
    """s for a C string argument. A NUL inside would end the string there and
    drop the rest without a word ("quant:bits=8\\0,ef=1" would lose ef=1):
    refused."""
    if not isinstance(s, str):
        raise TypeError(f"expected a str, got {type(s).__name__}")
    if "\0" in s:
        raise ValueError(f"{s!r} holds a NUL character, where a C string would end")
    return s.encode("utf-8")


def _uint(v, what, hi=0xFFFFFFFF):
    """v for a C unsigned argument: an integer in 0..hi, else an error naming
    it. ctypes would turn -1 into 4294967295 and 2**40 into 0 without a
    word, and the library would then name a value the caller never gave."""
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(v).__name__}") from None
    if not 0 <= v <= hi:
        raise ValueError(f"{what} must be in 0..{hi}, not {v}")
    return v


def _s(b):
    return b.decode("utf-8", "replace") if b else ""


class _Handle:
    _destroy = None

    def __init__(self):
        self._h = None

    @property
    def closed(self):
        return not self._h

    def _handle(self):
        if not self._h:
            raise Error(_C["EPIPE_ESTATE"], f"this {type(self).__name__} is closed")
        return self._h

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---- codecs -----------------------------------------------------------------


class Codec(_Handle):
    """A codec from a spec string ("sortquant:bits=8"). Not thread-safe: use
    one Codec per thread."""

    def __init__(self, spec):
        super().__init__()
        h = ctypes.c_void_p()
        check(lib.epipe_codec_create(ctypes.byref(h), _enc(spec)), "epipe_codec_create")
        self._h = h.value

    def close(self):
        if self._h:
            h, self._h = self._h, None
            lib.epipe_codec_destroy(h)

    def _check(self, rc, fn):
        return check(rc, fn, lib.epipe_codec_last_error, self._h)

    @property
    def spec(self):
        """The canonical spec, every default filled in."""
        return _s(lib.epipe_codec_spec(self._handle()))

    @property
    def name(self):
        return _s(lib.epipe_codec_name(self._handle()))

    @property
    def id(self):
        return int(lib.epipe_codec_id(self._handle()))

    def set_threads(self, n):
        """Worker threads per call (0 = automatic); never changes the bytes."""
        self._check(lib.epipe_codec_set_param(self._handle(), CODEC_THREADS, int(n)),
                    "epipe_codec_set_param")

    def reset_feedback(self):
        """Clears the error-feedback residuals (spec key ef=1); a no-op without ef."""
        self._check(lib.epipe_codec_reset_feedback(self._handle()), "epipe_codec_reset_feedback")

    def set_samples(self, ids, rows=None):
        """For a codec with delta=1 (experimental; codec.h,
        epipe_codec_set_samples): names the rows (dimension 0) of the tensor
        the next encode() takes, `ids` a sequence of distinct non-negative
        integers, one per row. ids=None with `rows` (the row count) makes
        those rows untracked (evaluation passes): their values, not their
        changes, go through the codec, and neither side keeps them. The
        next encode consumes them, so set them before every encode; the
        decoder needs nothing (the ids travel in the payload)."""
        arr, count = _sample_ids(ids, rows)
        self._check(lib.epipe_codec_set_samples(self._handle(), arr, count),
                    "epipe_codec_set_samples")

    def max_encoded_size(self, tensor):
        v = DLView(tensor)
        n = ctypes.c_size_t()
        self._check(lib.epipe_codec_max_encoded_size(self._handle(), v.ptr, ctypes.byref(n)),
                    "epipe_codec_max_encoded_size")
        return n.value

    def _encode_at(self, v, h, addr, cap):
        written = ctypes.c_size_t()
        self._check(lib.epipe_codec_encode(h, v.ptr, addr, cap, ctypes.byref(written)),
                    "epipe_codec_encode")
        return written.value

    def _follow_stream(self, tensor):
        """A CUDA tensor: the codec's work goes on torch's current stream
        for the tensor's device, so that it is ordered after the work that
        made the tensor and before what reads the result, as a torch op
        would be. Nothing for a CPU tensor."""
        _follow_torch_stream(self, _cuda_device_of(tensor), lib.epipe_codec_set_stream,
                             "epipe_codec_set_stream")

    def synchronize(self):
        """Waits for the codec's CUDA work and reports what it deferred (a
        non-finite input value to a quantizer, a bad header or table in a
        CUDA payload decoded since); nothing to do for CPU tensors."""
        self._check(lib.epipe_codec_synchronize(self._handle()), "epipe_codec_synchronize")

    def encode(self, tensor, out=None):
        """Encodes a tensor (fp32, fp16 or bf16; on the CPU any strides, on
        CUDA dense), read in place through DLPack.

        A CUDA tensor is encoded on its device, asynchronously on torch's
        current stream, into a CUDA uint8 tensor (returned, the written
        prefix) unless `out` says otherwise (a CUDA uint8 tensor, or host
        memory, pageable or pinned, which makes the call wait for the
        payload and report a non-finite value at once); otherwise a
        non-finite value surfaces at synchronize().

        Without `out`: returns the payload as a new ``bytes``, encoded
        straight into it (every codec's payload fills max_encoded_size()
        but a delta=1 codec's, which is trimmed with one copy). Its pages are new memory, which
        costs the first touch of each; use `out` or encode_view() on hot
        paths. With `out` (a writable bytearray,
        memoryview, NumPy array or contiguous CPU uint8 torch tensor of at
        least max_encoded_size(tensor) bytes): the payload is written into
        it and a memoryview of the written prefix is returned; nothing is
        allocated or copied. Error EPIPE_ENOSPC names the size needed when
        out is too small."""
        cuda = _cuda_device_of(tensor) is not None
        if cuda:
            self._follow_stream(tensor)
            if out is None:
                import torch

                out = torch.empty(self.max_encoded_size(tensor), dtype=torch.uint8,
                                  device=tensor.device)
        v = DLView(tensor)
        h = self._handle()
        cap = ctypes.c_size_t()
        self._check(lib.epipe_codec_max_encoded_size(h, v.ptr, ctypes.byref(cap)),
                    "epipe_codec_max_encoded_size")
        if out is None:
            b, addr = new_bytes(max(cap.value, 1))
            n = self._encode_at(v, h, addr, len(b))
            return b if n == len(b) else b[:n]
        with Buffer(out, True) as (addr, size):
            if size < cap.value:
                raise Error(_C["EPIPE_ENOSPC"],
                            f"out has {size} bytes; this tensor may need up to {cap.value} "
                            "(max_encoded_size)", "Codec.encode")
            n = self._encode_at(v, h, addr, size)
            if cuda and _cuda_device_of(out) is None:
                self.synchronize()  # a copy into pinned memory is still in flight
        mv = out if isinstance(out, memoryview) else None
        if mv is None:
            try:
                mv = memoryview(out)
            except TypeError:  # a torch tensor: return a view of it instead
                return out.view(-1)[:n]
        return mv.cast("B")[:n]

    def encode_view(self, tensor):
        """Encodes into a buffer the codec keeps and reuses (grown when a
        larger tensor comes), and returns a read-only memoryview of the
        payload: no allocation or copy once the buffer has its size. The
        view stays readable, but the next encode_view() on this codec
        overwrites its bytes (unless the view was still held when the
        buffer had to grow): copy it (bytes(view)) to keep it."""
        v = DLView(tensor)
        h = self._handle()
        cap = ctypes.c_size_t()
        self._check(lib.epipe_codec_max_encoded_size(h, v.ptr, ctypes.byref(cap)),
                    "epipe_codec_max_encoded_size")
        need = max(cap.value, 1)
        buf = getattr(self, "_scratch", None)
        if buf is None or len(buf) < need:
            # a fresh one: a caller may still hold a view of the old one.
            # The ctypes array pins it (a bytearray with exports cannot move).
            buf = self._scratch = bytearray(need)
            self._scratch_pin = (ctypes.c_char * need).from_buffer(buf)
        n = self._encode_at(v, h, ctypes.addressof(self._scratch_pin), len(buf))
        return memoryview(buf)[:n].toreadonly()

    def decode(self, payload, out=None, *, shape=None, dtype=None, device=None):
        """Decodes payload (bytes, bytearray, memoryview, any contiguous
        buffer, or a CUDA uint8 tensor; read in place) into `out` (a
        writable tensor, written in place through DLPack, returned), or into
        a new torch tensor of `shape`, `dtype` (default torch.float32) and
        `device` (default: the payload's, so a CUDA payload decodes on its
        GPU). Decoding into a CUDA tensor runs on torch's current stream;
        a CUDA payload's header and tables may be checked only by the next
        synchronize() (epipe/codec.h), which raises for a bad one."""
        if out is None:
            import torch

            if shape is None:
                raise TypeError("decode needs out= or shape=")
            if device is None and isinstance(payload, torch.Tensor):
                device = payload.device
            out = torch.empty(shape, dtype=dtype or torch.float32, device=device)
        self._follow_stream(out)
        v = DLView(out)
        with Buffer(payload, False) as (addr, size):
            self._check(lib.epipe_codec_decode(self._handle(), addr, size, v.ptr),
                        "epipe_codec_decode")
        return out

    def __repr__(self):
        return f"epipe.Codec({self.spec!r})" if self._h else "epipe.Codec(<closed>)"


# ---- communicators ----------------------------------------------------------


def _rendezvous(create, function):
    """The handle create(pointer) makes, or Error. A rendezvous waits for
    every rank, up to its init timeout (120 s by default), inside one C
    call, and Python runs its SIGINT handler only once a call returns: on
    the main thread the call runs on a helper thread instead, so that Ctrl-C
    raises KeyboardInterrupt at once. The helper then finishes on its own
    and leaves the group it may still make."""
    def run(box):
        h = ctypes.c_void_p()
        try:
            rc = create(ctypes.byref(h))
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            box["error"] = e
            return
        msg = _s(lib.epipe_last_error()) if rc < 0 else ""  # thread-local: read here
        with box["lock"]:
            if box["abandoned"]:
                if rc >= 0 and h.value:
                    lib.epipe_comm_destroy(h.value)
                return
            box["result"] = (rc, msg, h.value)

    box = {"lock": threading.Lock(), "abandoned": False, "result": None, "error": None}
    if threading.current_thread() is not threading.main_thread():
        run(box)  # only the main thread takes KeyboardInterrupt
    else:
        t = threading.Thread(target=run, args=(box,), name="epipe-rendezvous", daemon=True)
        t.start()
        try:
            while t.is_alive():
                t.join(0.25)
        except BaseException:
            with box["lock"]:
                box["abandoned"] = True
                done = box["result"]
            if done and done[0] >= 0 and done[2]:
                lib.epipe_comm_destroy(done[2])
            raise
    if box["error"] is not None:
        raise box["error"]
    rc, msg, h = box["result"]
    if rc < 0:
        raise Error(rc, msg, function)
    return h


class Comm(_Handle):
    """This rank's end of a group. Create with Comm.from_env(), Comm.tcp() or
    Comm.inproc(n) (a list of n joined in this process, one per thread)."""

    def __init__(self, handle):
        super().__init__()
        self._h = handle
        self._stages = weakref.WeakSet()
        self._lock = threading.Lock()
        # Ctrl-C ends a receive that waits on the main thread (_lib.check)
        check(lib.epipe_comm_set_interrupt(handle, _lib.INTERRUPT_CHECK, None),
              "epipe_comm_set_interrupt")

    @classmethod
    def inproc(cls, size):
        size = _uint(size, "size")
        arr = (ctypes.c_void_p * size)()
        check(lib.epipe_comm_create_inproc(arr, size), "epipe_comm_create_inproc")
        return [cls(arr[i]) for i in range(size)]

    @classmethod
    def from_env(cls, options=None):
        """Rank, size and master from the environment (EPIPE_*, torchrun,
        Open MPI, PMI, Slurm; docs/transport.md), over TCP."""
        opts = _enc(options) if options else None
        return cls(_rendezvous(lambda h: lib.epipe_comm_create_from_env(h, opts),
                               "epipe_comm_create_from_env"))

    @classmethod
    def tcp(cls, rank, size, master_addr, master_port, options=None):
        args = (_uint(rank, "rank"), _uint(size, "size"), _enc(master_addr),
                _uint(master_port, "master_port", 65535),
                _enc(options) if options else None)
        return cls(_rendezvous(lambda h: lib.epipe_comm_create_tcp(h, *args),
                               "epipe_comm_create_tcp"))

    def close(self):
        """Closes this rank's stages, then leaves the group."""
        with self._lock:
            if not self._h:
                return
            for st in list(self._stages):
                st.close()
            h, self._h = self._h, None
        lib.epipe_comm_destroy(h)

    def abort(self):
        """Marks this rank failed; wakes blocked receives. Any thread."""
        h = self._h
        if h:
            lib.epipe_comm_abort(h)

    @property
    def rank(self):
        return int(lib.epipe_comm_rank(self._handle()))

    @property
    def size(self):
        return int(lib.epipe_comm_size(self._handle()))

    @property
    def transport(self):
        return _s(lib.epipe_comm_transport(self._handle()))

    def set_param(self, param, value):
        check(lib.epipe_comm_set_param(self._handle(), int(param), int(value)),
              "epipe_comm_set_param", lib.epipe_comm_last_error, self._h)

    def __repr__(self):
        if not self._h:
            return "epipe.Comm(<closed>)"
        return f"epipe.Comm(rank={self.rank}, size={self.size}, transport={self.transport!r})"


# ---- stages -----------------------------------------------------------------

Op = namedtuple("Op", "kind microbatch chunk", defaults=(0,))
Op.__doc__ = ("One compute op: kind is OP_FORWARD, OP_BACKWARD, OP_BACKWARD_INPUT, "
              "OP_BACKWARD_WEIGHT or OP_NONE; chunk is which of the rank's model chunks "
              "runs it (0 with one chunk per rank).")

_STAT_FIELDS = [f for f, _ in _lib.StageStats._fields_ if f != "struct_size"]
_BOUNDARY_FIELDS = [f for f, _ in _lib.BoundaryStats._fields_ if f != "struct_size"]


def _cuda_device_of(tensor):
    """The device of a torch CUDA tensor; None for anything else: CPU
    tensors, NumPy arrays (whose .device is the string "cpu" from NumPy 2
    on), other libraries' arrays."""
    dev = getattr(tensor, "device", None)
    return dev if getattr(dev, "type", None) == "cuda" else None


def _follow_torch_stream(handle, dev, setter, name):
    """Sets handle's CUDA stream (with setter, the C call `name`) to torch's
    current stream on CUDA device `dev` (a torch device or an index) when it
    changed; nothing for None, or where torch is not installed."""
    if dev is None:
        return
    try:
        import torch
    except ImportError:
        return
    stream = torch.cuda.current_stream(dev).cuda_stream
    if getattr(handle, "_stream", None) != stream:
        handle._check(setter(handle._handle(), ctypes.c_void_p(stream)), name)
        handle._stream = stream


def _stream_pointer(stream):
    """A cudaStream_t as an integer: None or 0 (the legacy default stream),
    an integer, or an object with .cuda_stream (torch.cuda.Stream)."""
    if stream is None:
        return 0
    return int(getattr(stream, "cuda_stream", stream))


class Stage(_Handle):
    """One pipeline stage on `comm` (its rank is the stage index).

    Received tensors are zero-copy views of memory the stage lends, valid for
    as long as stage.h says: an activation until the end of its
    micro-batch's backward on this stage (the next next_op() after that
    backward; in evaluation mode, the next op), a gradient until the next
    next_op(). Reading one later reads freed or reused memory; pass
    copy=True for a tensor that owns its data.
    """

    def __init__(self, comm, schedule="1f1b", microbatches=4, *, chunks=None, placement=None,
                 act_codec=None, grad_codec=None, batch_size=None, timeout_ms=None,
                 codec_threads=None):
        super().__init__()
        self.comm = comm  # the stage borrows the comm: keep it alive
        h = ctypes.c_void_p()
        if chunks is None and placement is None:
            check(lib.epipe_stage_create(ctypes.byref(h), comm._handle(), _enc(schedule),
                                         _uint(microbatches, "microbatches")),
                  "epipe_stage_create")
        else:
            # chunks per rank (None/0: the schedule's default) and placement
            # (the rank of each pipeline stage; None: the schedule's default)
            lay = _lib.ScheduleLayout()
            lay.struct_size = ctypes.sizeof(lay)
            lay.chunks = _uint(chunks or 0, "chunks")
            if placement is not None:
                if isinstance(placement, str):
                    placement = [int(x) for x in placement.split(",")]
                arr = (ctypes.c_uint * len(placement))(
                    *[_uint(x, "placement entry") for x in placement])
                lay.placement = ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint))
                lay.placement_len = len(placement)
            check(lib.epipe_stage_create_layout(ctypes.byref(h), comm._handle(),
                                                _enc(schedule),
                                                _uint(microbatches, "microbatches"),
                                                ctypes.byref(lay)),
                  "epipe_stage_create_layout")
        self._h = h.value
        self.microbatches = int(microbatches)
        self.schedule = schedule
        comm._stages.add(self)
        try:
            if act_codec is not None:
                self.set_codec(ACTIVATION, act_codec)
            if grad_codec is not None:
                self.set_codec(GRADIENT, grad_codec)
            if batch_size is not None:
                self.set_param(STAGE_BATCH_SIZE, batch_size)
            if timeout_ms is not None:
                self.set_param(STAGE_TIMEOUT_MS, timeout_ms)
            if codec_threads is not None:
                self.set_param(STAGE_CODEC_THREADS, codec_threads)
        except Exception:
            self.close()
            raise

    def close(self):
        if self._h:
            h, self._h = self._h, None
            lib.epipe_stage_destroy(h)

    def _check(self, rc, fn):
        return check(rc, fn, lib.epipe_stage_last_error, self._h)

    @property
    def index(self):
        return int(lib.epipe_stage_index(self._handle()))

    @property
    def count(self):
        return int(lib.epipe_stage_count(self._handle()))

    @property
    def chunks(self):
        """The model chunks (virtual stages) this rank holds."""
        return int(lib.epipe_stage_chunks(self._handle()))

    def chunk_stage(self, chunk):
        """The pipeline stage that chunk `chunk` of this rank is, and the
        pipeline's stage count, as (stage, stages)."""
        st, n = ctypes.c_uint(), ctypes.c_uint()
        check(lib.epipe_stage_chunk_stage(self._handle(), _uint(chunk, "chunk"), ctypes.byref(st),
                                          ctypes.byref(n)), "epipe_stage_chunk_stage")
        return int(st.value), int(n.value)

    @property
    def is_first(self):
        return self.index == 0

    @property
    def is_last(self):
        return self.index + 1 == self.count

    def set_codec(self, direction, spec, boundary=ALL_BOUNDARIES):
        """direction: ACTIVATION or GRADIENT (or "activation"/"gradient")."""
        if isinstance(direction, str):
            direction = {"activation": ACTIVATION, "gradient": GRADIENT}[direction]
        self._check(lib.epipe_stage_set_codec(self._handle(), int(direction),
                                              _uint(boundary, "boundary"), _enc(spec)),
                    "epipe_stage_set_codec")

    def set_param(self, param, value):
        self._check(lib.epipe_stage_set_param(self._handle(), int(param), int(value)),
                    "epipe_stage_set_param")
        if int(param) == STAGE_CUDA_DEVICE:
            self._cuda_device = int(value)

    def set_cuda_stream(self, stream):
        """The CUDA stream the stage's codecs work on (experimental;
        stage.h, epipe_stage_set_cuda_stream): None (the legacy default
        stream), a torch.cuda.Stream or a raw cudaStream_t as an integer.
        Sends of torch CUDA tensors set it themselves to torch's current
        stream, as Codec.encode does."""
        ptr = _stream_pointer(stream)
        self._check(lib.epipe_stage_set_cuda_stream(self._handle(), ctypes.c_void_p(ptr)),
                    "epipe_stage_set_cuda_stream")
        self._stream = ptr

    def _follow_stream(self, tensor=None):
        """The stage's codecs work on torch's current stream, as
        Codec._follow_stream does for a codec: that of a torch CUDA tensor
        to send; for a receive (tensor None), that of the device received
        tensors go to (STAGE_CUDA_DEVICE), so that the decode into a lent
        buffer follows the host's kernels that read it last."""
        dev = _cuda_device_of(tensor) if tensor is not None else None
        if tensor is None and getattr(self, "_cuda_device", -1) >= 0:
            dev = self._cuda_device
        _follow_torch_stream(self, dev, lib.epipe_stage_set_cuda_stream,
                             "epipe_stage_set_cuda_stream")

    @property
    def training(self):
        return getattr(self, "_training", True)

    @training.setter
    def training(self, on):
        self.set_param(STAGE_TRAINING, 1 if on else 0)
        self._training = bool(on)

    # -- the op stream
    def next_op(self):
        op = _lib.Op()
        self._check(lib.epipe_stage_next_op(self._handle(), ctypes.byref(op)),
                    "epipe_stage_next_op")
        return Op(int(op.kind), int(op.microbatch), int(op.chunk))

    def current_op(self):
        """The op in progress (the last next_op() returned); Error
        (EPIPE_ESTATE) when none is."""
        op = _lib.Op()
        check(lib.epipe_stage_current_op(self._handle(), ctypes.byref(op)),
              "epipe_stage_current_op")
        return Op(int(op.kind), int(op.microbatch), int(op.chunk))

    def ops(self):
        """Iterates one step's compute ops; ends after OP_NONE."""
        while True:
            op = self.next_op()
            if op.kind == OP_NONE:
                return
            yield op

    def recv_activation(self, microbatch, copy=False):
        self._follow_stream()
        p = ctypes.POINTER(_lib.DLTensor)()
        self._check(lib.epipe_stage_recv_activation(self._handle(), _uint(microbatch, "microbatch"),
                                                    ctypes.byref(p)),
                    "epipe_stage_recv_activation")
        return wrap_lent(p, copy)

    def recv_gradient(self, microbatch, copy=False):
        self._follow_stream()
        p = ctypes.POINTER(_lib.DLTensor)()
        self._check(lib.epipe_stage_recv_gradient(self._handle(), _uint(microbatch, "microbatch"),
                                                  ctypes.byref(p)),
                    "epipe_stage_recv_gradient")
        return wrap_lent(p, copy)

    def send_activation(self, microbatch, tensor):
        """Encodes and sends; the tensor may be reused as soon as this returns
        (with STAGE_CUDA_STREAM_ORDERED, by work on torch's current stream)."""
        self._follow_stream(tensor)
        v = DLView(tensor)
        mb = _uint(microbatch, "microbatch")
        self._check(lib.epipe_stage_send_activation(self._handle(), mb, v.ptr),
                    "epipe_stage_send_activation")

    def set_samples(self, microbatch, ids, rows=None):
        """Names the rows of micro-batch `microbatch`'s next activation send
        (first pipeline stage only), for boundaries whose activation codec
        has delta=1 (experimental; stage.h, epipe_stage_set_samples): `ids`
        is a sequence of distinct non-negative integers, one per row of
        dimension 0 (typically the data set indices), copied at the call and
        used by the next send of that micro-batch only. Set them every
        step, before the send (sends on a delta=1 boundary without them
        fail with EPIPE_EINVAL). ids=None with `rows` (the row count) sends
        those rows untracked: their values, not their changes, through the
        codec, kept by neither side. Later stages need nothing: the ids
        travel with the activations."""
        arr, count = _sample_ids(ids, rows)
        mb = _uint(microbatch, "microbatch")
        self._check(lib.epipe_stage_set_samples(self._handle(), mb, arr, count),
                    "epipe_stage_set_samples")

    def send_gradient(self, microbatch, tensor):
        self._follow_stream(tensor)
        v = DLView(tensor)
        mb = _uint(microbatch, "microbatch")
        self._check(lib.epipe_stage_send_gradient(self._handle(), mb, v.ptr),
                    "epipe_stage_send_gradient")

    # -- statistics
    def stats(self):
        """Totals since creation or reset_stats(), as a dict (stage.h names)."""
        s = _lib.StageStats()
        s.struct_size = ctypes.sizeof(s)
        self._check(lib.epipe_stage_get_stats(self._handle(), ctypes.byref(s)),
                    "epipe_stage_get_stats")
        return {f: getattr(s, f) for f in _STAT_FIELDS}

    def boundary_stats(self):
        """One dict per boundary to another rank (stage.h's
        epipe_boundary_stats names): bytes raw and on the wire each way,
        average and peak (one-second window) wire MB/s. Like stats(), safe
        to call from another thread while this stage runs."""
        out = []
        for i in range(self.stats()["boundaries"]):
            b = _lib.BoundaryStats()
            b.struct_size = ctypes.sizeof(b)
            self._check(lib.epipe_stage_get_boundary_stats(self._handle(), i, ctypes.byref(b)),
                        "epipe_stage_get_boundary_stats")
            out.append({f: getattr(b, f) for f in _BOUNDARY_FIELDS})
        return out

    def reset_stats(self):
        lib.epipe_stage_reset_stats(self._handle())
        msg = _s(lib.epipe_last_error())  # cleared by the call: set only by a refusal
        if _lib.REFUSED_THREAD in msg:
            raise Error(_abi.C["EPIPE_ESTATE"], msg, "epipe_stage_reset_stats")

    def codec_sgd_step(self, lr, momentum=0.0):
        """One step of the built-in SGD (with momentum) on this stage's
        trainable codecs (insert), then zeroes their gradients. Call it
        between steps, beside the host's own optimizer step; a stage with
        no trainable codec does nothing."""
        self._check(lib.epipe_stage_codec_sgd_step(self._handle(), float(lr), float(momentum)),
                    "epipe_stage_codec_sgd_step")

    def __repr__(self):
        if not self._h:
            return "epipe.Stage(<closed>)"
        return (f"epipe.Stage(index={self.index}, count={self.count}, "
                f"schedule={self.schedule!r}, microbatches={self.microbatches})")
