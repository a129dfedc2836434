"""Makes python/ importable and keeps torch to one thread (the CI box is small)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


def blas_codecs_missing():
    """The reason the BLAS codecs (poweriter, insert) are unavailable in this
    libepipe (built with -Dblas=disabled), or None when they work."""
    import epipe

    try:
        epipe.Codec("poweriter:rank=1").close()
    except epipe.Error as e:
        if e.name == "EPIPE_ENOTSUP":
            return e.message
        raise
    return None
