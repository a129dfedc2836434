"""The numbers the binding copies by hand from include/epipe/*.h, under their
C names. tests/test_abi.py compiles them against the installed headers."""

# The C library version this binding is written for. A library of another
# major.minor is refused at import (0.x: a minor release may break the ABI);
# another patch level is accepted.
VERSION = "0.1.0"

# Every enumerator of the enums below, and the #defines the binding uses.
# test_abi.py fails when a header gains an enumerator that is missing here.
MIRRORED_ENUMS = (
    "epipe_status", "epipe_log_level", "epipe_codec_param", "epipe_comm_param",
    "epipe_stage_param", "epipe_direction", "epipe_op_kind",
)

C = {
    # common.h: epipe_status
    "EPIPE_OK": 0,
    "EPIPE_EINVAL": -1,
    "EPIPE_ENOMEM": -2,
    "EPIPE_ENOTSUP": -3,
    "EPIPE_ENOSPC": -4,
    "EPIPE_ETRUNC": -5,
    "EPIPE_ETOOBIG": -6,
    "EPIPE_EVERSION": -7,
    "EPIPE_ECHECKSUM": -8,
    "EPIPE_EOVERFLOW": -9,
    "EPIPE_EPROTO": -10,
    "EPIPE_ESTATE": -11,
    "EPIPE_EPEER": -12,
    "EPIPE_ETIMEDOUT": -13,
    "EPIPE_EIO": -14,
    "EPIPE_EAUTH": -15,
    "EPIPE_EINTERNAL": -16,
    "EPIPE_ECALLBACK": -17,
    # common.h: epipe_log_level
    "EPIPE_LOG_ERROR": 0,
    "EPIPE_LOG_WARN": 1,
    "EPIPE_LOG_INFO": 2,
    "EPIPE_LOG_DEBUG": 3,
    # codec.h
    "EPIPE_CODEC_THREADS": 1,
    "EPIPE_CODEC_MICROBATCH": 2,
    "EPIPE_CODEC_MAX_NDIM": 16,
    # comm.h
    "EPIPE_COMM_FROM_ENV": 0xFFFFFFFF,
    "EPIPE_COMM_TIMEOUT_MS": 1,
    "EPIPE_COMM_MAX_MESSAGE": 2,
    "EPIPE_COMM_SPIN_US": 3,
    "EPIPE_COMM_BUFFER_CACHE": 4,
    # schedule.h: epipe_op_kind
    "EPIPE_OP_FORWARD": 1,
    "EPIPE_OP_BACKWARD": 2,
    "EPIPE_OP_RECV_ACT": 3,
    "EPIPE_OP_SEND_ACT": 4,
    "EPIPE_OP_RECV_GRAD": 5,
    "EPIPE_OP_SEND_GRAD": 6,
    "EPIPE_OP_BACKWARD_INPUT": 7,
    "EPIPE_OP_BACKWARD_WEIGHT": 8,
    # stage.h
    "EPIPE_OP_NONE": 0,
    "EPIPE_DIR_ACTIVATION": 0,
    "EPIPE_DIR_GRADIENT": 1,
    "EPIPE_ALL_BOUNDARIES": 0xFFFFFFFF,
    "EPIPE_STAGE_TIMEOUT_MS": 1,
    "EPIPE_STAGE_CODEC_THREADS": 2,
    "EPIPE_STAGE_BATCH_SIZE": 3,
    "EPIPE_STAGE_TRAINING": 4,
    "EPIPE_STAGE_CUDA_DEVICE": 5,
    "EPIPE_STAGE_CUDA_STREAM_ORDERED": 6,
}

STATUS_NAMES = {v: k for k, v in C.items() if k in (
    "EPIPE_OK", "EPIPE_EINVAL", "EPIPE_ENOMEM", "EPIPE_ENOTSUP", "EPIPE_ENOSPC", "EPIPE_ETRUNC",
    "EPIPE_ETOOBIG", "EPIPE_EVERSION", "EPIPE_ECHECKSUM", "EPIPE_EOVERFLOW", "EPIPE_EPROTO",
    "EPIPE_ESTATE", "EPIPE_EPEER", "EPIPE_ETIMEDOUT", "EPIPE_EIO", "EPIPE_EAUTH",
    "EPIPE_EINTERNAL", "EPIPE_ECALLBACK")}
