"""Loading libepipe with ctypes, the C declarations, and the error class.

Nothing here needs torch or numpy.
"""
import ctypes
import os
import signal
import subprocess
import sys
import sysconfig

from . import _abi

__all__ = ["Error", "lib", "library_path", "find_library", "check_version", "check", "strerror",
           "status_name"]


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
        # the library's messages often start with the function already
        where = f"{function}: " if function and not self.message.startswith(
            f"{function}:") else ""
        super().__init__(f"{where}{self.message} [{self.name}]")


# ---- finding the shared library ---------------------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))
_SONAME = "libepipe.so.0"


def _source_tree_builds():
    """build*/lib/libepipe.so of the checkout this package sits in, when it
    runs from one (python/epipe in a tree with meson.build at the top): a
    development fallback only, never used by an installed package."""
    root = os.path.dirname(os.path.dirname(_HERE))
    if not (os.path.isfile(os.path.join(root, "meson.build"))
            and os.path.isdir(os.path.join(root, "include", "epipe"))):
        return []
    out = []
    for build in ("build", "builddir"):
        p = os.path.join(root, build, "lib", "libepipe.so")
        if os.path.exists(p):
            out.append(p)
    return out


def _pkgconfig_libdir():
    """`pkg-config --variable=libdir epipe`, or (None, why not)."""
    try:
        r = subprocess.run(["pkg-config", "--variable=libdir", "epipe"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"pkg-config could not run ({e})"
    if r.returncode != 0 or not r.stdout.strip():
        why = (r.stderr.strip().splitlines() or ["no package epipe"])[-1]
        return None, f"pkg-config found no epipe.pc ({why})"
    return r.stdout.strip(), None


def _prefix_dirs():
    """The lib directories of the install prefixes: this Python's (a
    virtual environment's or the system's) and /usr/local, where meson
    installs by default, with the Debian multiarch directory of each."""
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    out = []
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix, "/usr/local"]):
        for d in ([os.path.join(prefix, "lib", arch)] if arch else []) + [
                os.path.join(prefix, "lib64"), os.path.join(prefix, "lib")]:
            if d not in out:
                out.append(d)
    return out


def find_library():
    """Loads libepipe: EPIPE_LIBRARY (a path, never second-guessed), else
    the libdir pkg-config gives for epipe, else the install prefixes and the
    system's loader path, else (development) the source tree's build dir.
    Returns (CDLL, path); raises ImportError naming every place tried."""
    env = os.environ.get("EPIPE_LIBRARY")
    if env:
        try:
            return ctypes.CDLL(env), env
        except OSError as e:
            raise ImportError(f"cannot load libepipe from EPIPE_LIBRARY={env}: {e}") from None
    tried = ["EPIPE_LIBRARY: not set"]
    libdir, why = _pkgconfig_libdir()
    if libdir:
        p = os.path.join(libdir, _SONAME)
        if os.path.exists(p):
            try:
                return ctypes.CDLL(p), p
            except OSError as e:
                tried.append(f"pkg-config: {p}: {e}")
        else:
            tried.append(f"pkg-config: libdir {libdir} has no {_SONAME}")
    else:
        tried.append(f"pkg-config: {why}")
    prefix_dirs = _prefix_dirs()
    for d in prefix_dirs:
        p = os.path.join(d, _SONAME)
        if os.path.exists(p):
            try:
                return ctypes.CDLL(p), p
            except OSError as e:
                tried.append(f"install prefix: {p}: {e}")
    try:
        return ctypes.CDLL(_SONAME), _SONAME  # LD_LIBRARY_PATH, ld.so.cache
    except OSError:
        tried.append(f"install prefix: no {_SONAME} in {', '.join(prefix_dirs)} "
                     "or on the dynamic loader's path")
    for p in _source_tree_builds():
        try:
            return ctypes.CDLL(p), p
        except OSError as e:
            tried.append(f"source tree: {p}: {e}")
    raise ImportError("cannot find libepipe; tried " + "; ".join(tried)
                      + ". Install libepipe (meson install), point PKG_CONFIG_PATH at its "
                      "epipe.pc, or set EPIPE_LIBRARY to the path of libepipe.so")


def check_version(number, text, path):
    """Refuses a library whose major.minor differs from the binding's
    (_abi.VERSION): its ABI may differ. Another patch level is fine."""
    want = tuple(int(x) for x in _abi.VERSION.split("."))
    have = (int(number) // 10000, int(number) // 100 % 100)
    if have != want[:2]:
        raise ImportError(
            f"libepipe {text} at {path} does not match this epipe package, written for "
            f"libepipe {_abi.VERSION}: the ABI may differ (major.minor {have[0]}.{have[1]} vs "
            f"{want[0]}.{want[1]}); install the epipe package of the library's version or "
            "point EPIPE_LIBRARY at a matching libepipe.so")


lib, library_path = find_library()
lib.epipe_version.restype = ctypes.c_uint
lib.epipe_version.argtypes = []
lib.epipe_version_string.restype = ctypes.c_char_p
lib.epipe_version_string.argtypes = []
check_version(lib.epipe_version(), lib.epipe_version_string().decode(), library_path)

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
        ("weight_version", ctypes.c_uint32),
    ]


class ScheduleLayout(ctypes.Structure):
    """epipe_schedule_layout (schedule.h)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("chunks", ctypes.c_uint),
        ("placement", ctypes.POINTER(ctypes.c_uint)),
        ("placement_len", ctypes.c_uint),
    ]


class PlanLayer(ctypes.Structure):
    """epipe_plan_layer (plan.h)."""

    _fields_ = [(name, ctypes.c_double) for name in (
        "forward_s", "backward_s", "weight_s", "out_bytes", "param_bytes", "stash_bytes",
        "update_s")]


class PlanCodec(ctypes.Structure):
    """epipe_plan_codec (plan.h)."""

    _fields_ = [
        ("spec", ctypes.c_char_p),
        ("layer", ctypes.c_uint),
        ("dir", ctypes.c_uint),
        ("encode_s", ctypes.c_double),
        ("decode_s", ctypes.c_double),
        ("wire_ratio", ctypes.c_double),
        ("error", ctypes.c_double),
    ]


class PlanOptions(ctypes.Structure):
    """epipe_plan_options (plan.h)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("stages", ctypes.c_uint),
        ("microbatches", ctypes.c_uint),
        ("bandwidth", ctypes.c_double),
        ("latency_s", ctypes.c_double),
        ("pair_bandwidth", ctypes.POINTER(ctypes.c_double)),
        ("pair_latency_s", ctypes.POINTER(ctypes.c_double)),
        ("memory_bytes", ctypes.c_double),
        ("param_copies", ctypes.c_double),
        ("act_error_budget", ctypes.c_double),
        ("grad_error_budget", ctypes.c_double),
        ("schedules", ctypes.c_char_p),
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
        ("samples", ctypes.c_uint64),
        ("samples_per_second", ctypes.c_double),
        ("bubble_fraction", ctypes.c_double),
        ("step_p50_seconds", ctypes.c_double),
        ("step_p99_seconds", ctypes.c_double),
        ("boundaries", ctypes.c_uint32),
    ]


class BoundaryStats(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("boundary", ctypes.c_uint32),
        ("peer", ctypes.c_uint32),
        ("sends_activations", ctypes.c_uint32),
        ("act_raw", ctypes.c_uint64),
        ("act_wire", ctypes.c_uint64),
        ("grad_raw", ctypes.c_uint64),
        ("grad_wire", ctypes.c_uint64),
        ("act_mbps", ctypes.c_double),
        ("grad_mbps", ctypes.c_double),
        ("act_peak_mbps", ctypes.c_double),
        ("grad_peak_mbps", ctypes.c_double),
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
# epipe_comm_set_interrupt()'s check: arg; nonzero stops the waiting receive.
InterruptFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# epipe_comm_create()'s rank and size meaning "from the environment".
COMM_FROM_ENV = _abi.C["EPIPE_COMM_FROM_ENV"]

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
    "epipe_codec_set_samples": (_int, [_vp, ctypes.POINTER(ctypes.c_uint64), _sz]),
    "epipe_codec_max_encoded_size": (_int, [_vp, _dlp, ctypes.POINTER(_sz)]),
    "epipe_codec_encode": (_int, [_vp, _dlp, _vp, _sz, ctypes.POINTER(_sz)]),
    "epipe_codec_decode": (_int, [_vp, _vp, _sz, _dlp]),
    "epipe_codec_set_stream": (_int, [_vp, _vp]),
    "epipe_plan_create": (_int, [_pp, ctypes.POINTER(PlanLayer), _sz, ctypes.POINTER(PlanCodec),
                                 _sz, ctypes.POINTER(PlanOptions)]),
    "epipe_plan_destroy": (None, [_vp]),
    "epipe_plan_first_layer": (_uint, [_vp, _uint]),
    "epipe_plan_codec_spec": (_cs, [_vp, _uint, _uint]),
    "epipe_plan_schedule": (_cs, [_vp]),
    "epipe_plan_step_seconds": (ctypes.c_double, [_vp]),
    "epipe_plan_blind_step_seconds": (ctypes.c_double, [_vp]),
    "epipe_plan_explain": (_sz, [_vp, ctypes.c_char_p, _sz]),
    "epipe_codec_synchronize": (_int, [_vp]),
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
    "epipe_comm_set_interrupt": (_int, [_vp, InterruptFn, _vp]),
    # stage.h
    "epipe_stage_create": (_int, [_pp, _vp, _cs, _uint]),
    "epipe_stage_create_layout": (_int, [_pp, _vp, _cs, _uint, ctypes.POINTER(ScheduleLayout)]),
    "epipe_stage_destroy": (None, [_vp]),
    "epipe_stage_chunks": (_uint, [_vp]),
    "epipe_stage_chunk_stage": (_int, [_vp, _uint, ctypes.POINTER(_uint), ctypes.POINTER(_uint)]),
    "epipe_stage_current_op": (_int, [_vp, ctypes.POINTER(Op)]),
    "epipe_stage_set_codec": (_int, [_vp, _int, _uint, _cs]),
    "epipe_stage_set_param": (_int, [_vp, _int, ctypes.c_int64]),
    "epipe_stage_set_cuda_stream": (_int, [_vp, _vp]),
    "epipe_stage_set_samples": (_int, [_vp, _uint, ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.c_size_t]),
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
    "epipe_stage_get_boundary_stats": (_int, [_vp, ctypes.c_uint32,
                                              ctypes.POINTER(BoundaryStats)]),
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


# ---- Ctrl-C in a blocked receive ---------------------------------------------
#
# Python's own SIGINT handler only notes the signal, and the interpreter
# runs the Python handler (which raises KeyboardInterrupt) once the C call
# it is in returns: a receive that waits for a peer would hold Ctrl-C back
# until its timeout. Every Comm the binding makes carries INTERRUPT_CHECK
# (epipe_comm_set_interrupt), which a waiting receive calls every 100 ms.
# It is a ctypes callback whose target is the ctypes function object of
# CPython's PyOS_InterruptOccurred (through pythonapi): the callback's thunk
# takes the GIL (PyGILState_Ensure, so any thread may call it) and calls
# the C function without running any Python code. It returns 1 on the main
# thread when SIGINT has come, which it takes. Do not pass the function's
# raw address instead: called without the GIL it has no thread state. Nor
# a Python function: the interpreter runs the pending handler on entering
# it, and ctypes swallows what a callback raises. check() then raises
# SIGINT again, so that Python's handler, the default or the host's own,
# runs as it would have. A receive waiting on another thread takes the GIL
# for that moment every 100 ms.

_interrupt_occurred = ctypes.pythonapi.PyOS_InterruptOccurred
_interrupt_occurred.restype = ctypes.c_int
# argtypes unset: the receive passes its arg (NULL, as None), which the
# function does not take and, in the C calling conventions of Linux, ignores.
INTERRUPT_CHECK = InterruptFn(_interrupt_occurred)
INTERRUPTED = "the host's interrupt check stopped the wait"
REFUSED_THREAD = "another thread is inside"


def check(rc, function, handle_error=None, handle=None):
    """Raises Error for a negative status. The message is the handle's last
    error when a handle is given, else the calling thread's epipe_last_error().
    Must be called right after the failing call, on the same thread. A
    receive that Ctrl-C stopped runs Python's SIGINT handler first, which
    by default raises KeyboardInterrupt."""
    if rc >= 0:
        return rc
    # A stage another thread is inside refuses with this thread's message;
    # the stage's own is the other thread's, not to be read meanwhile.
    msg = _s(lib.epipe_last_error())
    if not (rc == _abi.C["EPIPE_ESTATE"] and REFUSED_THREAD in msg):
        if handle_error is not None and handle:
            msg = _s(handle_error(handle)) or msg
    if rc == _abi.C["EPIPE_ECALLBACK"] and INTERRUPTED in msg:
        signal.raise_signal(signal.SIGINT)  # its handler runs here: KeyboardInterrupt
    raise Error(rc, msg, function)
