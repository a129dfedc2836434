"""Addresses of Python buffers (bytes, bytearray, memoryview, NumPy arrays,
contiguous CPU or CUDA torch tensors) for one C call, without copying them."""
import ctypes

try:
    import torch
except ImportError:
    torch = None


class _Py_buffer(ctypes.Structure):
    # Python's Py_buffer (Include/pybuffer.h), stable since 3.3
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_PyBUF_SIMPLE, _PyBUF_WRITABLE = 0, 1
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_Py_buffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_Py_buffer)]
_release_buffer.restype = None


class Buffer:
    """`with Buffer(obj, writable) as (address, nbytes):` the contiguous
    memory of obj, pinned (and, for a bytearray, not resizable) for the
    duration. TypeError for an object without such memory."""

    __slots__ = ("obj", "writable", "view", "held")

    def __init__(self, obj, writable):
        self.obj, self.writable, self.held = obj, writable, False
        self.view = None

    def __enter__(self):
        obj = self.obj
        if torch is not None and isinstance(obj, torch.Tensor):
            # a CUDA tensor is a payload in device memory, which the library
            # takes with CUDA tensors (it refuses it with CPU tensors)
            if obj.device.type not in ("cpu", "cuda") or not obj.is_contiguous() or \
                    obj.dtype != torch.uint8:
                how = "" if obj.is_contiguous() else " non-contiguous"
                raise TypeError(f"a byte buffer tensor must be a contiguous uint8 tensor on the "
                                f"CPU or CUDA; got a{how} {obj.dtype} tensor on {obj.device}")
            return obj.data_ptr(), obj.numel() * obj.element_size()
        self.view = _Py_buffer()
        flags = _PyBUF_WRITABLE if self.writable else _PyBUF_SIMPLE
        try:
            if _get_buffer(obj, ctypes.byref(self.view), flags) != 0:
                raise TypeError  # pythonapi raises the Python error itself
        except (TypeError, BufferError, ValueError) as e:
            what = ("a writable contiguous buffer (bytearray, writable memoryview, array, "
                    "uint8 tensor)" if self.writable else
                    "a contiguous buffer (bytes, bytearray, memoryview, array, uint8 tensor)")
            raise TypeError(f"expected {what}, got {type(obj).__name__}: {e}") from None
        self.held = True
        return self.view.buf or 0, self.view.len

    def __exit__(self, *exc):
        if self.held:
            _release_buffer(ctypes.byref(self.view))
            self.held = False


_bytes_new = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_new.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
_bytes_new.restype = ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = [ctypes.py_object]
_bytes_address.restype = ctypes.c_void_p


def new_bytes(size):
    """(b, address): a new bytes object of `size` bytes, not yet written,
    and the address of its bytes. The C API lets the creator of such an
    object fill it before anyone else holds it (what
    PyBytes_FromStringAndSize(NULL, n) is for), so a payload is encoded
    straight into the bytes that Codec.encode() returns, with no copy and
    no zero-filling pass."""
    b = _bytes_new(None, size)
    return b, _bytes_address(b)
