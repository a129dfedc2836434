#!/usr/bin/env python3
"""Failures during and after the TCP rendezvous, across real processes on
loopback: a rank that dies after registering is reported to every rank at
once (no waiting for the init timeout), with its reason whole; a rank that
leaves before the table may register again. (A rank killed mid-training,
named as the origin on every rank: the conformance suite's train-dead-peer.)
Usage: check_rdv_failures.py EPIPE_RUN TCP_TRAINER."""
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'support'))
import rdv_peer  # noqa: E402 (tests/support/rdv_peer.py)
from rdv_peer import HELLO, HT_TABLE, Rank, error, free_port, recv_msg, register

from checks import fail, finish  # noqa: E402 (tests/checks.py)

run, trainer = sys.argv[1], sys.argv[2]
rdv_peer.trainer = trainer
LONG = {"EPIPE_INIT_TIMEOUT_MS": "60000"}  # a rank that waited for it would be caught


def failed_line(r):
    return next((l for l in r.out.splitlines() if "FAILED" in l), "(no FAILED line)")


# 1. A scripted rank 2 of 4 registers, receives the table, then dies (a) in
# silence or (b) saying why at length. Ranks 0, 1 and 3 are real: rank 1
# waits for rank 2 to connect, rank 3 tries to reach it. Rank 0 tells them.
REASON = ("cannot connect to rank 1 at 10.1.2.3:41234: No route to host, still after retrying "
          "(the reason goes on past eighty characters) END-OF-REASON")
for how in ("dies in silence", "says why"):
    port = free_port()
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    r0 = Rank(0, 4, port, LONG)
    r1 = Rank(1, 4, port, LONG)
    fake = None
    try:
        if not r0.wait_log("rank 1 registered"):
            raise RuntimeError("rank 1 did not register")
        fake = register(port, 2, 4, lst.getsockname()[1])
        r3 = Rank(3, 4, port, LONG)
        m = recv_msg(fake)
        if not m or m[0] != HELLO or m[1][4] != HT_TABLE:
            raise RuntimeError("no table: %r" % (m,))
        if how == "says why":
            fake.sendall(error(REASON, 2, 2))
    except (OSError, RuntimeError) as e:
        fail("the scripted rank 2 could not register: %s" % e)
        r3 = Rank(3, 4, port, LONG)
    lst.close()
    if fake:
        fake.close()
    for r in (r0, r1, r3):
        done = r.finish(timeout=30)
        line = failed_line(r)
        print("rank 2 %s: rank %d: %s" % (how, r.k, line[:300]))
        if done or r.p.returncode is None or r.p.returncode < 0:
            fail("rank %d did not fail at once: %s" % (r.k, r.text()))
        elif "EPIPE_EPEER" not in line or "rank 2 failed during the rendezvous" not in line:
            fail("rank %d does not say rank 2 failed during the rendezvous: %s" % (r.k, line))
        elif how == "says why" and r.k != 0 and "END-OF-REASON" not in line:
            fail("rank %d did not get rank 2's reason whole: %s" % (r.k, line))

# 2. A rank that leaves before every rank has registered is forgotten; the
# real one registers in its place and the group trains.
port = free_port()
r0 = Rank(0, 3, port, LONG)
try:
    if not r0.wait_log("listens on"):
        raise RuntimeError("rank 0 does not listen")
    fake = register(port, 2, 3, 1)
    fake.close()
except (OSError, RuntimeError) as e:
    fail("the scripted rank 2 could not register: %s" % e)
if not r0.wait_log("rank 2 left before all ranks registered"):
    fail("rank 0 did not notice rank 2 leaving:\n" + "".join(r0.err))
rest = [Rank(k, 3, port, LONG) for k in (1, 2)]
good = all([r.finish(timeout=30) for r in [r0] + rest])
print("rank 2 leaves before the table, then joins again: %s" % ("the group trained" if good
                                                                  else "FAILED"))
if not good:
    fail("the group did not train after rank 2 registered again:\n" +
         "\n".join(r.text() for r in [r0] + rest))

# 3. A rank of another job that does not check the job tags itself (a
# scripted one: the library's own refuses at the challenge, check_tcp_faults)
# is refused by rank 0 after its proof, alone, whatever world size it
# claims; the real ranks then train.
port = free_port()
r0 = Rank(0, 2, port, dict(LONG, EPIPE_JOB_ID="job-a"))
for size in (5, 2):
    try:
        if not r0.wait_log("listens on"):
            raise RuntimeError("rank 0 does not listen")
        register(port, 1, size, 1, job=0x1234).close()
        fail("rank 0 welcomed a rank of another job (world size %d)" % size)
    except (OSError, RuntimeError) as e:
        if "is from another job (tag 0000000000001234" not in str(e):
            fail("rank 0 did not refuse the other job's rank of %d as such: %s" % (size, e))
        else:
            print("another job's rank of %d: %s" % (size, str(e)[:150]))
r1 = Rank(1, 2, port, dict(LONG, EPIPE_JOB_ID="job-a"))
if not all([r.finish(timeout=30) for r in (r0, r1)]):
    fail("the job did not train after another job's rank was refused:\n" +
         "\n".join(r.text() for r in (r0, r1)))
else:
    print("the job trained after refusing another job's rank twice")

finish()
