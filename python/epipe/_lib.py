"""Loading libepipe with ctypes, the C declarations, and the error class.

Nothing here needs torch or numpy.
"""
import ctypes
import ctypes.util
import os

__all__ = ["Error", "lib", "library_path", "check", "strerror", "status_name"]


class Error(Exception):
    """A libepipe call returned a non-OK status.

    Attributes: ``status`` (the negative epipe_status value), ``name``
    ("EPIPE_EINVAL"), ``message`` (the library's detailed last-error message,
    or the status's sentence when the library gave none) and ``function``
    (the C function that failed).
    """

    def __init__(self, status, message, function=None):
        self.status = int(status)
        self.name = status_name(self.status)
        self.message = message or strerror(self.status)
        self.function = function
        where = f"{function}: " if function else ""
        super().__init__(f"{where}{self.message} [{self.name}]")


# ---- finding the shared library ---------------------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE_ROOT = os.path.dirname(os.path.dirname(_HERE))


def _candidates():
    env = os.environ.get("EPIPE_LIBRARY")
    if env:
        # An explicit choice is never second-guessed: it loads or fails.
        return [env], True
    c = []
    for build in ("build", "builddir"):
        p = os.path.join(_SOURCE_ROOT, build, "lib", "libepipe.so")
        if os.path.exists(p):
            c.append(p)
    found = ctypes.util.find_library("epipe")
    if found:
        c.append(found)
    c.append("libepipe.so.0")
    return c, False


def _load():
    cands, explicit = _candidates()
    errors = []
    for path in cands:
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append(f"{path}: {e}")
    hint = "" if explicit else " (set EPIPE_LIBRARY to the path of libepipe.so)"
    raise ImportError("cannot load libepipe" + hint + ": " + "; ".join(errors))


lib, library_path = _load()

# ---- DLPack structures (dlpack.h, DLPACK_VERSION 0.6 ABI) -------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


# ---- libepipe structures ----------------------------------------------------


class Op(ctypes.Structure):
    """epipe_op: 16 bytes, fixed for good."""

    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("microbatch", ctypes.c_uint32),
        ("chunk", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class StageStats(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("steps", ctypes.c_uint64),
        ("step_seconds", ctypes.c_double),
        ("compute_seconds", ctypes.c_double),
        ("encode_seconds", ctypes.c_double),
        ("decode_seconds", ctypes.c_double),
        ("wait_seconds", ctypes.c_double),
        ("act_sent_raw", ctypes.c_uint64),
        ("act_sent_wire", ctypes.c_uint64),
        ("grad_recv_raw", ctypes.c_uint64),
        ("grad_recv_wire", ctypes.c_uint64),
        ("act_recv_raw", ctypes.c_uint64),
        ("act_recv_wire", ctypes.c_uint64),
        ("grad_sent_raw", ctypes.c_uint64),
        ("grad_sent_wire", ctypes.c_uint64),
        ("loss_sum", ctypes.c_double),
        ("loss_count", ctypes.c_uint64),
    ]


# ---- function prototypes ----------------------------------------------------

_vp = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_cs = ctypes.c_char_p
_int = ctypes.c_int
_uint = ctypes.c_uint
_sz = ctypes.c_size_t
_dlp = ctypes.POINTER(DLTensor)

# epipe_log_fn (epipe/common.h): user, level, subsystem, rank, message.
LogFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                         ctypes.c_char_p)
# epipe_comm_create()'s rank and size meaning "from the environment".
COMM_FROM_ENV = 0xFFFFFFFF

_PROTOS = {
    "epipe_version": (_uint, []),
    "epipe_version_string": (_cs, []),
    "epipe_strerror": (_cs, [_int]),
    "epipe_status_name": (_cs, [_int]),
    "epipe_last_error": (_cs, []),
    # common.h: keep a LogFn object alive while it is set
    "epipe_set_log_callback": (None, [LogFn, _vp]),
    # codec.h
    "epipe_codec_create": (_int, [_pp, _cs]),
    "epipe_codec_destroy": (None, [_vp]),
    "epipe_codec_spec": (_cs, [_vp]),
    "epipe_codec_name": (_cs, [_vp]),
    "epipe_codec_id": (_uint, [_vp]),
    "epipe_codec_last_error": (_cs, [_vp]),
    "epipe_codec_set_param": (_int, [_vp, _int, ctypes.c_int64]),
    "epipe_codec_get_param": (_int, [_vp, _int, ctypes.POINTER(ctypes.c_int64)]),
    "epipe_codec_spec_param": (_int, [_vp, _cs, ctypes.POINTER(ctypes.c_double)]),
    "epipe_codec_param_bounds": (_int, [_cs, _cs, ctypes.POINTER(ctypes.c_double),
                                        ctypes.POINTER(ctypes.c_double)]),
    "epipe_codec_reset_feedback": (_int, [_vp]),
    "epipe_codec_max_encoded_size": (_int, [_vp, _dlp, ctypes.POINTER(_sz)]),
    "epipe_codec_encode": (_int, [_vp, _dlp, _vp, _sz, ctypes.POINTER(_sz)]),
    "epipe_codec_decode": (_int, [_vp, _vp, _sz, _dlp]),
    # comm.h
    "epipe_comm_create": (_int, [_pp, _cs, _uint, _uint, _cs, _uint, _cs]),
    "epipe_comm_create_inproc": (_int, [_pp, _uint]),
    "epipe_comm_create_tcp": (_int, [_pp, _uint, _uint, _cs, _uint, _cs]),
    "epipe_comm_create_from_env": (_int, [_pp, _cs]),
    "epipe_comm_destroy": (None, [_vp]),
    "epipe_comm_abort": (None, [_vp]),
    "epipe_comm_rank": (_uint, [_vp]),
    "epipe_comm_size": (_uint, [_vp]),
    "epipe_comm_transport": (_cs, [_vp]),
    "epipe_comm_last_error": (_cs, [_vp]),
    "epipe_comm_set_param": (_int, [_vp, _int, ctypes.c_int64]),
    "epipe_comm_get_param": (_int, [_vp, _int, ctypes.POINTER(ctypes.c_int64)]),
    # stage.h
    "epipe_stage_create": (_int, [_pp, _vp, _cs, _uint]),
    "epipe_stage_destroy": (None, [_vp]),
    "epipe_stage_set_codec": (_int, [_vp, _int, _uint, _cs]),
    "epipe_stage_set_param": (_int, [_vp, _int, ctypes.c_int64]),
    "epipe_stage_index": (_uint, [_vp]),
    "epipe_stage_count": (_uint, [_vp]),
    "epipe_stage_last_error": (_cs, [_vp]),
    "epipe_stage_next_op": (_int, [_vp, ctypes.POINTER(Op)]),
    "epipe_stage_recv_activation": (_int, [_vp, _uint, ctypes.POINTER(_dlp)]),
    "epipe_stage_send_activation": (_int, [_vp, _uint, _dlp]),
    "epipe_stage_recv_gradient": (_int, [_vp, _uint, ctypes.POINTER(_dlp)]),
    "epipe_stage_send_gradient": (_int, [_vp, _uint, _dlp]),
    "epipe_stage_get_stats": (_int, [_vp, ctypes.POINTER(StageStats)]),
    "epipe_stage_reset_stats": (None, [_vp]),
    "epipe_stage_codec_sgd_step": (_int, [_vp, ctypes.c_double, ctypes.c_double]),
    "epipe_op_kind_name": (_cs, [ctypes.c_uint32]),
}

for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


def _s(b):
    return b.decode("utf-8", "replace") if b else ""


def strerror(status):
    return _s(lib.epipe_strerror(int(status)))


def status_name(status):
    return _s(lib.epipe_status_name(int(status)))


def check(rc, function, handle_error=None, handle=None):
    """Raises Error for a negative status. The message is the handle's last
    error when a handle is given, else the calling thread's epipe_last_error().
    Must be called right after the failing call, on the same thread."""
    if rc >= 0:
        return rc
    msg = ""
    if handle_error is not None and handle:
        msg = _s(handle_error(handle))
    if not msg:
        msg = _s(lib.epipe_last_error())
    raise Error(rc, msg, function)
