"""epipe: a thin ctypes binding of libepipe (pipeline-parallel training with
compressed stage boundaries). See docs/python.md.

The shared library is found through EPIPE_LIBRARY (a path), else the libdir
`pkg-config --variable=libdir epipe` gives, else the install prefixes
(this Python's, /usr/local) and the dynamic loader's path, else, in a source
checkout only, its build/lib/libepipe.so. A library of another major.minor
than __version__ is refused at import.
"""
from ._core import (
    ACTIVATION,
    ALL_BOUNDARIES,
    CODEC_THREADS,
    COMM_MAX_MESSAGE,
    COMM_SPIN_US,
    COMM_TIMEOUT_MS,
    GRADIENT,
    OP_BACKWARD,
    OP_BACKWARD_INPUT,
    OP_BACKWARD_WEIGHT,
    OP_FORWARD,
    OP_NONE,
    STAGE_BATCH_SIZE,
    STAGE_CODEC_THREADS,
    STAGE_CUDA_DEVICE,
    STAGE_CUDA_STREAM_ORDERED,
    STAGE_TIMEOUT_MS,
    STAGE_TRAINING,
    Codec,
    Comm,
    Op,
    Stage,
    version,
    version_number,
)
from ._abi import VERSION as __version__
from ._plan import Plan
from ._lib import Error, library_path, status_name, strerror

__all__ = [
    "__version__",
    "ACTIVATION", "ALL_BOUNDARIES", "CODEC_THREADS", "COMM_MAX_MESSAGE", "COMM_SPIN_US",
    "COMM_TIMEOUT_MS", "GRADIENT", "OP_BACKWARD", "OP_BACKWARD_INPUT",
    "OP_BACKWARD_WEIGHT", "OP_FORWARD", "OP_NONE", "STAGE_BATCH_SIZE",
    "STAGE_CODEC_THREADS", "STAGE_CUDA_DEVICE", "STAGE_CUDA_STREAM_ORDERED",
    "STAGE_TIMEOUT_MS", "STAGE_TRAINING", "Codec", "Comm", "Error", "Op",
    "Plan", "Stage", "library_path", "status_name", "strerror", "version", "version_number",
]
