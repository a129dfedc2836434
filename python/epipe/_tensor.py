"""Tensors in and out of libepipe, as DLPack DLTensor views.

In: a torch tensor (or any object with ``__dlpack__``, such as a NumPy
array) is exported with DLPack; the DLManagedTensor pointer is taken out of
the "dltensor" capsule with PyCapsule_GetPointer and ``&managed->dl_tensor``
is handed to the C call. No data is copied; the capsule (which keeps the
producer's tensor alive) is held until the call returns and then released,
which calls the producer's deleter.

Out: a DLTensor lent by the library (dense) is wrapped into a torch tensor
over the same memory: host memory with torch.frombuffer, CUDA memory through
__cuda_array_interface__; zero-copy, valid only as long as the library says
the DLTensor is (see Stage.recv_activation).
"""
import ctypes
import math

from . import _abi, _lib

try:
    import torch
    import torch.utils.dlpack as _torch_dlpack
except ImportError:  # the codec and comm parts work without torch
    torch = None
    _torch_dlpack = None

_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

kDLCPU, kDLCUDA, kDLCUDAHost = 1, 2, 3
kDLFloat, kDLBfloat = 2, 4


class DLView:
    """A DLTensor pointer for one C call, with what keeps its memory alive."""

    __slots__ = ("capsule", "source", "ptr")

    def __init__(self, obj):
        if torch is not None and isinstance(obj, torch.Tensor):
            # detach: the library only reads or writes the data; autograd
            # bookkeeping must not travel (and newer torch refuses it).
            self.source = obj.detach()
            self.capsule = _torch_dlpack.to_dlpack(self.source)
        elif hasattr(obj, "__dlpack__"):
            self.source = obj
            self.capsule = obj.__dlpack__()
        else:
            raise TypeError(
                f"expected a torch tensor or an object with __dlpack__, got {type(obj).__name__}"
            )
        addr = _capsule_get_pointer(self.capsule, b"dltensor")
        # dl_tensor is the first member of DLManagedTensor, so its address is
        # the managed tensor's: &managed->dl_tensor.
        managed = _lib.DLManagedTensor.from_address(addr)
        self.ptr = ctypes.pointer(managed.dl_tensor)


def _torch_dtype(dt):
    if dt.lanes != 1:
        return None
    if dt.code == kDLFloat and dt.bits == 32:
        return torch.float32
    if dt.code == kDLFloat and dt.bits == 16:
        return torch.float16
    if dt.code == kDLBfloat and dt.bits == 16:
        return torch.bfloat16
    return None


def wrap_lent(ptr, copy):
    """A torch tensor over the library's DLTensor *ptr (zero-copy unless
    copy is true, in which case the tensor owns its memory)."""
    if torch is None:
        raise ImportError("receiving tensors needs torch")
    t = ptr.contents
    if t.device.device_type not in (kDLCPU, kDLCUDAHost, kDLCUDA):
        raise _lib.Error(_abi.C["EPIPE_ENOTSUP"],
                         f"received tensor on device type {t.device.device_type}, not the CPU "
                         "or CUDA")
    dtype = _torch_dtype(t.dtype)
    if dtype is None:
        raise _lib.Error(
            _abi.C["EPIPE_EINTERNAL"],
            f"received tensor of DLPack dtype code {t.dtype.code} bits {t.dtype.bits}"
        )
    shape = [int(t.shape[i]) for i in range(t.ndim)]
    n = math.prod(shape)
    if t.strides:
        expect = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and int(t.strides[i]) != expect:
                raise _lib.Error(_abi.C["EPIPE_EINTERNAL"],
                                 "received tensor is not dense, as stage.h promises")
            expect *= shape[i]
    if t.device.device_type == kDLCUDA:
        return _wrap_cuda(t.data + t.byte_offset, int(t.device.device_id), shape, dtype, n, copy)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = t.dtype.bits // 8
    buf = (ctypes.c_char * (n * itemsize)).from_address(t.data + t.byte_offset)
    out = torch.frombuffer(buf, dtype=dtype, count=n).view(shape)
    return out.clone() if copy else out


class _CudaMemory:
    """Device memory described by __cuda_array_interface__ (version 2), which
    torch.as_tensor takes without a copy. bf16 has no type string there: it
    travels as int16 and is viewed back."""

    def __init__(self, addr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (addr, False), "version": 2, "strides": None}


def _wrap_cuda(addr, device, shape, dtype, n, copy):
    dev = torch.device("cuda", device)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=dev)
    typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2"}[dtype]
    with torch.cuda.device(dev):
        out = torch.as_tensor(_CudaMemory(addr, shape, typestr), device=dev)
    if dtype == torch.bfloat16:
        out = out.view(torch.bfloat16)
    return out.clone() if copy else out
