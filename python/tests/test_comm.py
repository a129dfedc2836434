"""Communicators over TCP from Python: a rendezvous from the main thread
and from another, its errors, and Ctrl-C in the middle of one or of a
blocked receive."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import epipe

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_pair_from_the_main_thread_and_another():
    port = free_port()
    got = {}

    def rank1():
        try:
            got[1] = epipe.Comm.tcp(1, 2, "127.0.0.1", port, "init_timeout_ms=20000")
        except Exception as e:  # noqa: BLE001 - reported below
            got[1] = e

    t = threading.Thread(target=rank1)
    t.start()
    c0 = epipe.Comm.tcp(0, 2, "127.0.0.1", port, "init_timeout_ms=20000")
    t.join()
    c1 = got[1]
    assert isinstance(c1, epipe.Comm), c1
    try:
        assert (c0.rank, c0.size, c1.rank, c1.size) == (0, 2, 1, 2)
        assert c0.transport == c1.transport == "tcp"
    finally:
        c1.close()
        c0.close()


def test_a_forked_child_cannot_use_the_parents_comm():
    port = free_port()
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(
        1, epipe.Comm.tcp(1, 2, "127.0.0.1", port, "init_timeout_ms=20000")))
    t.start()
    c0 = epipe.Comm.tcp(0, 2, "127.0.0.1", port, "init_timeout_ms=20000")
    t.join()
    c1 = got[1]
    try:
        st = epipe.Stage(c0, "gpipe", 2)
        pid = os.fork()
        if pid == 0:  # the child: no pytest here, only an exit status
            status = 1
            try:
                c0.set_param(epipe.COMM_TIMEOUT_MS, 1000)
            except epipe.Error as e:
                status = 0 if e.name == "EPIPE_ESTATE" and "forked" in e.message else 2
            st.close()
            c0.close()  # returns at once, releasing nothing
            os._exit(status)
        _, st = os.waitpid(pid, 0)
        assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, st
        c0.set_param(epipe.COMM_TIMEOUT_MS, 1000)  # the parent's is unchanged
    finally:
        c1.close()
        c0.close()


@pytest.mark.parametrize("args, what", [
    ((-1, 2, "127.0.0.1", 29500), "rank must be in 0..4294967295, not -1"),
    ((0, 2**32, "127.0.0.1", 29500), "size must be in 0..4294967295, not 4294967296"),
    ((0, 2, "127.0.0.1", 2**40), "master_port must be in 0..65535, not 1099511627776"),
    ((0, 2, "127.0.0.1", -5), "master_port must be in 0..65535, not -5"),
])
def test_numbers_ctypes_would_wrap_are_refused(args, what):
    # ctypes passes -1 as 4294967295 (EPIPE_COMM_FROM_ENV, for a rank!) and
    # 2**40 as 0, and the library would name numbers nobody gave
    with pytest.raises(ValueError, match=what.replace("..", r"\.\.")):
        epipe.Comm.tcp(*args)


def test_indices_and_counts_must_be_non_negative_ints():
    comms = epipe.Comm.inproc(2)
    try:
        st = epipe.Stage(comms[0], "gpipe", 2)
        with pytest.raises(ValueError, match="microbatch must be in"):
            st.recv_gradient(-1)
        with pytest.raises(TypeError, match="microbatch must be an int, not float"):
            st.recv_gradient(1.5)
        with pytest.raises(TypeError, match="size must be an int"):
            epipe.Comm.inproc("3")
        with pytest.raises(ValueError, match="microbatches must be in"):
            epipe.Stage(comms[0], "gpipe", -4)
        with pytest.raises(ValueError, match="boundary must be in"):
            st.set_codec("activation", "none", boundary=-2)
        with pytest.raises(ValueError, match="placement entry must be in"):
            epipe.Stage(comms[0], "1f1b", 2, placement=[0, -1])
        with pytest.raises(ValueError, match="sample ids must be integers in"):
            st.set_samples(0, [2**64])
    finally:
        for c in comms:
            c.close()


def test_rendezvous_errors_keep_their_message():
    # the message is the calling thread's in C: the binding must read it on
    # the thread that made the call
    try:
        epipe.Comm.tcp(0, 2, "127.0.0.1", free_port(), "no_such_option=1")
    except epipe.Error as e:
        assert e.name == "EPIPE_EINVAL"
        assert e.function == "epipe_comm_create_tcp"
        assert "unknown option 'no_such_option'" in e.message
    else:
        raise AssertionError("an unknown option was accepted")


def ctrl_c_after_waiting(script, timeout):
    """Runs script, which prints 'waiting' just before the call to
    interrupt, and sends it SIGINT 0.5 s later (inside the call by then).
    Returns its exit status, stdout, stderr and the seconds from the signal
    to its exit."""
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "waiting"
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=timeout)
        waited = time.monotonic() - t0
    finally:
        p.kill()
        p.wait()
    return p.returncode, out, err, waited


def test_ctrl_c_interrupts_a_rendezvous():
    # Rank 0 of 2 waits for a rank 1 that never comes, for up to 60 s; Ctrl-C
    # must end it at once, not when the C call gives up.
    script = (
        "import sys, epipe\n"
        "print('waiting', flush=True)\n"
        f"epipe.Comm.tcp(0, 2, '127.0.0.1', {free_port()}, 'init_timeout_ms=60000')\n")
    _, _, err, waited = ctrl_c_after_waiting(script, 30)
    assert "KeyboardInterrupt" in err, err
    assert waited < 10, f"Ctrl-C took {waited:.1f} s to end a rendezvous"


def test_ctrl_c_interrupts_a_blocked_receive():
    pytest.importorskip("numpy")  # the ranks send arrays
    # A stage's receive waits up to 60 s for an activation rank 0 never
    # sends; Ctrl-C must raise KeyboardInterrupt at once, and the stage and
    # the group must still close cleanly after it.
    # Nothing is lost: the receive, tried again once rank 0 sends, gets the
    # activation, and the step ends.
    script = (
        "import threading, time, numpy as np, epipe\n"
        "comms = epipe.Comm.inproc(2)\n"
        "st = epipe.Stage(comms[1], 'gpipe', 1, timeout_ms=60000)\n"
        "op = st.next_op()\n"
        "print('waiting', flush=True)\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    st.recv_activation(op.microbatch)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted after %.2f s' % (time.monotonic() - t0), flush=True)\n"
        "def rank0():\n"
        "    with epipe.Stage(comms[0], 'gpipe', 1, timeout_ms=60000) as s0:\n"
        "        s0.next_op()\n"
        "        s0.send_activation(0, np.full(4, 7, np.float32))\n"
        "        s0.next_op()\n"
        "        s0.recv_gradient(0, copy=True)\n"
        "t = threading.Thread(target=rank0)\n"
        "t.start()\n"
        "x = st.recv_activation(op.microbatch, copy=True)\n"
        "st.next_op()\n"
        "st.send_gradient(0, np.ones(4, np.float32))\n"
        "t.join()\n"
        "print('received', [float(v) for v in x], flush=True)\n"
        "st.close()\n"
        "for c in comms:\n"
        "    c.close()\n"
        "print('closed', flush=True)\n")
    rc, out, err, waited = ctrl_c_after_waiting(script, 90)
    assert rc == 0, err
    assert "interrupted after" in out and "closed" in out, (out, err)
    assert "received [7.0, 7.0, 7.0, 7.0]" in out, (out, err)
    assert waited < 10, f"Ctrl-C took {waited:.1f} s to end a receive"


@pytest.mark.parametrize("env, lines, said", [
    ({"EPIPE_LOG": "loud"}, 1,
     ["EPIPE_LOG=loud is not one of error, warn, info, debug; using warn"]),
    ({"EPIPE_LOG_SUBSYS": "tcp,rendevous,,x"}, 2,
     ["names 'rendevous', which is not a subsystem (auth, codec, comm, inproc, rdma, rendezvous, "
      "stage, tcp, trace)", "names 'x', which is not a subsystem"]),
    ({"EPIPE_LOG_SUBSYS": "tcp," * 80}, 1, ["EPIPE_LOG_SUBSYS=tcp,tcp,", "is too long"]),
    ({"EPIPE_LOG": "INFO", "EPIPE_LOG_SUBSYS": "comm,tcp"}, 0, []),
])
def test_log_variables_are_checked(env, lines, said):
    # Read at the first log call of a process; a value that would silently
    # hide messages (a misspelt subsystem) is named on stderr.
    script = "import epipe\nfor c in epipe.Comm.inproc(2): c.close()\n"
    full = {k: v for k, v in os.environ.items() if k not in ("EPIPE_LOG", "EPIPE_LOG_SUBSYS")}
    full.update(env, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("epipe: log:")]) == lines, \
        r.stderr
    for s in said:
        assert s in r.stderr, r.stderr
