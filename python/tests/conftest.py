"""Makes python/ importable and keeps torch to one thread (the CI box is small)."""
import os
import sys
import threading

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


def run_threads(comms, body, join_s=60):
    """Runs body(s) for each stage s in a thread of its own; a stage that
    raises aborts its communicator (waking the others) and always closes it.
    Returns each stage's exception, or None."""
    errors = [None] * len(comms)

    def worker(s):
        try:
            body(s)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors[s] = e
            comms[s].abort()
        finally:
            comms[s].close()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(len(comms))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(join_s)
    return errors


def raise_first(errors):
    for e in errors:
        if e is not None:
            raise e
