#!/usr/bin/env python3
"""Hostile peers against a real TCP rendezvous on loopback: a memory bomb of
huge hello headers, unauthenticated REGISTERs that claim a taken rank or
another world size, a flood of idle connections while a rank joins, an
outsider's ERROR text made to forge log lines, and key files that are not
regular files. Usage: check_rdv_attacks.py TCP_TRAINER."""
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'support'))
import rdv_peer  # noqa: E402 (tests/support/rdv_peer.py)
from rdv_peer import (ERROR, HELLO, HT_CHALLENGE, HT_PROOF, HT_REGISTER, Rank, frame, free_port,
                      hello, rank_env, recv_msg, status_kb, wait_listening)

from checks import fail, finish  # noqa: E402 (tests/checks.py)

trainer = rdv_peer.trainer = sys.argv[1]


def group(n, port, extra, first=None):
    ranks = [first] if first else []
    ranks += [Rank(k, n, port, extra) for k in range(len(ranks), n)]
    good = True
    for r in ranks:
        if not r.finish():
            fail("the group did not finish: " + r.text())
            good = False
    return good


tmp = tempfile.TemporaryDirectory()
key = os.path.join(tmp.name, "key")
with open(key, "w") as f:
    f.write("a shared secret for the attack tests, long enough")
os.chmod(key, 0o600)
probe = subprocess.run([trainer, "--steps", "1"], capture_output=True, text=True,
                       env=dict(rank_env(0, 1, 1), EPIPE_AUTH_KEY_FILE=key))
have_auth = "libsodium" not in probe.stdout
keyed = {"EPIPE_AUTH_KEY_FILE": key} if have_auth else {}
print("authentication:", "on" if have_auth else "off (built without libsodium)")

# 1. Memory bomb: connections whose hello header claims ~75 MB and that then
# push payload bytes. Rank 0's resident memory stays within a few MB per
# pending connection, and the group still completes.
CONNS, PUSH, CLAIM = 32, 4 << 20, 160 + 72 * 1048576
port = free_port()
r0 = Rank(0, 3, port, keyed)
if not wait_listening(port):
    fail("rank 0 does not listen")
time.sleep(0.2)
base = status_kb(r0.p.pid, "VmRSS")
socks = []
for i in range(CONNS):
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(2)
    socks.append(s)
    try:
        s.sendall(frame(HELLO, b"", src=1, claim=CLAIM))
        chunk = bytes(1 << 16)
        for _ in range(PUSH // len(chunk)):
            s.sendall(chunk)
    except OSError:
        pass  # refused: what a hardened rank does
time.sleep(0.5)
hwm = status_kb(r0.p.pid, "VmHWM")
rss = status_kb(r0.p.pid, "VmRSS")
for s in socks:
    s.close()
per = (hwm - base) / CONNS
print("memory bomb: %d connections claiming %d MB, pushing %d MB each: rank 0 RSS %d kB before, "
      "peak %d kB, now %d kB: %.1f kB per connection" % (CONNS, CLAIM >> 20, PUSH >> 20, base, hwm,
                                                         rss, per))
if per > 1024:
    fail("rank 0 grew %.0f kB per pending connection (at most 1 MB)" % per)
if group(3, port, keyed, r0):
    print("  the group completed")

# 2. Unauthenticated REGISTERs: one names a registered rank, one another
# world size; neither aborts the keyed group.
if not have_auth:
    print("unauthenticated REGISTER: skipped (built without libsodium)")
else:
    port = free_port()
    r0 = Rank(0, 3, port, keyed)
    r1 = Rank(1, 3, port, keyed)
    if not r0.wait_log("rank 1 registered"):
        fail("rank 1 did not register:\n" + "".join(r0.err))
    answers = []
    for rank, size in ((1, 3), (2, 7), (2, 3)):
        for flags in (1, 0):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(hello(HT_REGISTER, rank, size, flags=flags))
                m = recv_msg(s)
                if m and m[0] == HELLO and m[1][4] == HT_CHALLENGE:  # a proof without the key
                    s.sendall(hello(HT_PROOF, rank, size, flags=flags))
                    m = recv_msg(s)
                s.close()
            except OSError as e:
                m = (ERROR, ("no listener: %s" % e).encode())
            answers.append("rank %u size %u flags %d: %s" % (
                rank, size, flags, m[1].decode(errors="replace")[:100] if m else "closed"))
    for a in answers:
        print("  attacker's REGISTER " + a)
    r2 = Rank(2, 3, port, keyed)
    good = all([r.finish() for r in (r0, r1, r2)])
    if not good:
        fail("unauthenticated REGISTERs broke the group:\n" +
             "\n".join(r.text() for r in (r0, r1, r2)))
    else:
        print("unauthenticated REGISTER (taken rank, other world size): the keyed group finished")

def proxy(listener, target, cut, delay=0.0):
    """Forwards connections to 127.0.0.1:target, each chunk after `delay`
    seconds (a long link), except the first `cut`, dropped once they speak."""
    def pump(a, b):
        try:
            while True:
                x = a.recv(65536)
                if not x:
                    break
                time.sleep(delay)
                b.sendall(x)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    n = 0
    while True:
        try:
            c, _ = listener.accept()
        except OSError:
            return
        n += 1
        if n <= cut:
            c.settimeout(5)
            try:
                c.recv(64)  # the hello has started: drop it mid-handshake
            except OSError:
                pass
            c.close()
            continue
        try:
            u = socket.create_connection(("127.0.0.1", target))
        except OSError:
            c.close()
            continue
        for a, b in ((c, u), (u, c)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


def stop_proxy(listener):
    """Wakes the proxy's accept (close alone does not) and ends it."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()


# 3. A flood while a rank joins over a slow link, several trials. FLOODERS
# processes open connections to rank 0 as fast as they can, each holding the
# last few hundred open; two send nothing, one sends the first byte of a
# message and stops. Rank 1 reaches rank 0 through a proxy that delays every
# chunk by DELAY s, so its handshake spans many flood connections.
FLOOD = """
import socket, sys, time
held, n = [], 0
end = time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1)
        if sys.argv[3] == "byte":
            s.send(b"E")
        held.append(s)
        n += 1
    except OSError:
        time.sleep(0.001)
    if len(held) > 300:
        held.pop(0).close()
print(n)
"""
# A trial counts when the flood filled rank 0's pending slots (it dropped
# some); up to MAX_TRIALS run until TRIALS of them did.
TRIALS, MAX_TRIALS, DELAY = 5, 12, 0.02
joined = contended = opened = 0
for trial in range(MAX_TRIALS):
    if contended == TRIALS:
        break
    port = free_port()
    r0 = Rank(0, 2, port, keyed)
    wait_listening(port)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    threading.Thread(target=proxy, args=(lst, port, 0, DELAY), daemon=True).start()
    floods = [subprocess.Popen([sys.executable, "-c", FLOOD, str(port), "4", kind],
                               stdout=subprocess.PIPE, text=True)
              for kind in ("idle", "idle", "byte")]
    time.sleep(0.5)
    r1 = Rank(1, 2, lst.getsockname()[1], keyed)
    good = all([r.finish(timeout=40) for r in (r1, r0)])
    n = sum(int(f.communicate()[0] or 0) for f in floods)
    stop_proxy(lst)
    opened += n
    dropped = sum(int(l.split("dropped ")[1].split()[0]) for l in r0.err
                  if "pending connections in all" in l)
    retried = sum("trying again" in l for l in r1.err)
    print("  flood trial %d: %d connections opened, rank 0 dropped %d, rank 1 retried %d times; "
          "%s" % (trial, n, dropped, retried, "joined" if good else "FAILED"))
    if not good:
        print("  trial %d failed:\n%s" % (trial, "\n".join(r.text()[-1500:] for r in (r0, r1))))
    if dropped:
        contended += 1
        joined += good
print("connection flood: the rank joined over a %d ms link in %d of %d trials where rank 0 had "
      "to drop connections (%d flood connections)" % (DELAY * 1000, joined, contended, opened))
if contended < TRIALS:
    fail("the flood filled rank 0's pending connections in only %d of %d trials" %
         (contended, MAX_TRIALS))
if joined != contended:
    fail("a flood of connections kept a rank out in %d of %d trials" %
         (contended - joined, contended))

# 3b. The acceptor drops a rank's handshake unanswered (as it does to shed
# a flood): a proxy in front of rank 0 cuts the first two connections once
# their hello has arrived; rank 1 connects again and the group trains.
port = free_port()
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen(8)
threading.Thread(target=proxy, args=(lst, port, 2), daemon=True).start()
r0 = Rank(0, 2, port, keyed)
r1 = Rank(1, 2, lst.getsockname()[1], keyed)
good = all([r.finish(timeout=40) for r in (r1, r0)])
retried = sum("trying again" in l for l in r1.err)
print("handshake dropped twice by the acceptor: rank 1 tried again %d times; %s" %
      (retried, "the group trained" if good else "FAILED"))
if not good or retried < 2:
    fail("rank 1 did not get through dropped handshakes:\n%s\n%s" % (r0.text(), r1.text()))
stop_proxy(lst)

# 4. What an outsider says is not written raw into rank 0's log: an ERROR
# before any proof whose text would forge a log line and colour the terminal.
port = free_port()
r0 = Rank(0, 2, port, keyed)
if not wait_listening(port):
    fail("rank 0 does not listen")
forged = "epipe[rank 0] rendezvous: rank 1 registered from 10.9.9.9:1 (forged)"
try:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(rdv_peer.error("bad\n" + forged + "\x1b[31m red", src=1, about=0))
    time.sleep(0.3)
    s.close()
except OSError as e:
    fail("the outsider could not connect: %s" % e)
refused = r0.wait_log("it refused this rank")
for _ in range(25):  # and then garbage, whose refusals are logged up to 10, then counted
    try:
        g = socket.create_connection(("127.0.0.1", port), timeout=5)
        g.sendall(b"GET / HTTP/1.0\r\n\r\n")
        g.recv(256)
        g.close()
    except OSError:
        pass
good = group(2, port, keyed, r0)
warned = sum("refused the connection from" in l for l in r0.err)
total = [l for l in r0.err if "connections in all; the first 10 are logged" in l]
print("26 refused connections (and more): %d logged, then %s" % (warned, total[0].strip() if total else None))
counted = int(total[0].split("refused ")[1].split()[0]) if total else 0
if warned != 10 or counted < 26:  # (and wait_listening's probe)
    fail("refusals not limited in the log:\n" + "".join(r0.err[-20:]))
raw = [l for l in r0.err if "\x1b" in l or l.startswith(forged)]
said = [l for l in r0.err if "it refused this rank" in l]
print("an outsider's ERROR with a newline and an escape: logged as %r; %s" %
      (said[0].strip()[-90:] if said else None, "the group completed" if good else "FAILED"))
if not refused or raw or not said or "bad?epipe[rank 0]" not in said[0]:
    fail("rank 0 logged the outsider's text raw, or not at all:\n" + "".join(r0.err))

# 5. Key files that are not regular files fail at once, with a message.
fifo = os.path.join(tmp.name, "fifo")
os.mkfifo(fifo)
big = os.path.join(tmp.name, "big")
with open(big, "wb") as f:
    f.write(os.urandom(1 << 20))
os.chmod(big, 0o600)
for path, want in (("/dev/zero", "not a regular file"), (fifo, "not a regular file"),
                   (big, "at most")):
    port = free_port()
    t0 = time.time()
    try:
        r = subprocess.run([trainer, "--steps", "1"], capture_output=True, text=True, timeout=30,
                           env=rank_env(0, 2, port, {"EPIPE_AUTH_KEY_FILE": path,
                                                     "EPIPE_INIT_TIMEOUT_MS": "3000"}))
    except subprocess.TimeoutExpired:
        fail("key file %s: still running after 30 s (init timeout 3 s)" % path)
        continue
    line = [l for l in r.stdout.splitlines() if "init FAILED" in l]
    print("key file %s: exit %d in %.2f s: %s" % (path, r.returncode, time.time() - t0,
                                                 line[0][:160] if line else r.stdout[:160]))
    if r.returncode == 0 or not line:
        fail("key file %s was accepted:\n%s%s" % (path, r.stdout, r.stderr))
    elif have_auth and (want not in line[0] or path not in line[0]):
        fail("key file %s: the message should name it and say '%s': %s" % (path, want, line[0]))
finish()
