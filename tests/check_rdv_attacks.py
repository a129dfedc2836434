#!/usr/bin/env python3
"""Hostile peers against a real TCP rendezvous on loopback: a memory bomb of
huge hello headers, unauthenticated REGISTERs that claim a taken rank or
another world size, a flood of idle connections while a rank joins, and key
files that are not regular files. Usage: check_rdv_attacks.py TCP_TRAINER."""
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

trainer = sys.argv[1]
ok = True


def fail(msg):
    global ok
    print("FAIL:", msg)
    ok = False


# ---- the wire, as an attacker writes it (docs/wire-format.md) ----------

def _crc_table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


CRC_T = _crc_table()


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = CRC_T[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


HELLO, ERROR = 3, 5


def frame(kind, payload, src=0, dst=0, claim=None):
    """A wire message; claim overrides the payload length in the header."""
    n = len(payload) if claim is None else claim
    h = b"EPIW" + struct.pack("<HHBBBBIIIQIIQII", 1, 192, kind, 0, 0, 0, 0, 0, 0, 0, src, dst, n,
                              crc32c(payload), 0)
    h += bytes(128 + 4)
    return h + struct.pack("<I", crc32c(h)) + payload


HT_REGISTER, HT_CHALLENGE, HT_PROOF = 1, 3, 4


def hello(htype, rank, size, flags=0, stream=0, port=1):
    p = b"EPTH" + struct.pack("<BBHIIIH", htype, flags, 1, rank, size, stream, port) + bytes(2)
    p += b"127.0.0.1".ljust(64, b"\0") + os.urandom(32) + bytes(32)
    assert len(p) == 152
    return frame(HELLO, p, src=rank)


def recv_msg(s):
    """One message (kind, payload) or None when the connection ends."""
    def exact(n):
        b = b""
        while len(b) < n:
            x = s.recv(n - len(b))
            if not x:
                return None
            b += x
        return b
    h = exact(192)
    if h is None:
        return None
    kind = h[8]
    n = struct.unpack_from("<Q", h, 40)[0]
    p = exact(n) if n else b""
    return kind, p


# ---- ranks ------------------------------------------------------------

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rank_env(k, n, port, extra=None):
    e = {k2: v for k2, v in os.environ.items()
         if not k2.startswith(("EPIPE_", "OMPI_", "PMI_", "SLURM_"))
         and k2 not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    e.update({"EPIPE_RANK": str(k), "EPIPE_WORLD_SIZE": str(n), "EPIPE_MASTER_ADDR": "127.0.0.1",
              "EPIPE_MASTER_PORT": str(port), "EPIPE_LOG": "info",
              "EPIPE_INIT_TIMEOUT_MS": "20000", "EPIPE_TIMEOUT_MS": "10000"})
    e.update(extra or {})
    return e


class Rank:
    def __init__(self, k, n, port, extra=None, args=("--steps", "2")):
        self.k = k
        self.p = subprocess.Popen([trainer, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=rank_env(k, n, port, extra))
        self.err = []
        self.t = threading.Thread(target=self._drain, daemon=True)
        self.t.start()

    def _drain(self):
        for line in self.p.stderr:
            self.err.append(line)

    def wait_log(self, text, timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            if any(text in l for l in self.err):
                return True
            time.sleep(0.02)
        return False

    def finish(self, timeout=60):
        try:
            out, _ = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, _ = self.p.communicate()
        self.t.join(5)
        self.out = out
        return self.p.returncode == 0 and ("rank %d: ok" % self.k) in out

    def text(self):
        return "rank %d exit %s:\n%s%s" % (self.k, self.p.returncode, self.out,
                                          "".join(self.err[-30:]))


def status_kb(pid, field):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def wait_listening(port, timeout=20):
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.02)
    return False


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
CONNS, PUSH, CLAIM = 32, 4 << 20, 152 + 72 * 1048576
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

# 3. A flood of idle connections while real ranks join, several trials:
# FLOODERS processes open connections to rank 0 as fast as they can, each
# holding the last few hundred open, and never send a byte.
FLOOD = """
import socket, sys, time
held, n = [], 0
end = time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        held.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1))
        n += 1
    except OSError:
        time.sleep(0.001)
    if len(held) > 300:
        held.pop(0).close()
print(n)
"""
# A trial counts when the flood filled rank 0's pending slots (it dropped
# some); up to MAX_TRIALS run until TRIALS of them did.
TRIALS, MAX_TRIALS, FLOODERS = 5, 12, 3
joined = contended = opened = 0
for trial in range(MAX_TRIALS):
    if contended == TRIALS:
        break
    port = free_port()
    r0 = Rank(0, 3, port, keyed)
    wait_listening(port)
    floods = [subprocess.Popen([sys.executable, "-c", FLOOD, str(port), "4"],
                               stdout=subprocess.PIPE, text=True) for _ in range(FLOODERS)]
    time.sleep(0.3)
    rest = [Rank(k, 3, port, keyed) for k in (1, 2)]
    good = all([r.finish(timeout=40) for r in rest + [r0]])
    n = sum(int(f.communicate()[0] or 0) for f in floods)
    opened += n
    dropped = sum("too many pending connections" in l for l in r0.err)
    retried = sum("trying again" in l for r in rest for l in r.err)
    print("  flood trial %d: %d idle connections opened, rank 0 dropped %d, the ranks retried %d "
          "times; %s" % (trial, n, dropped, retried, "joined" if good else "FAILED"))
    if not good:
        print("  trial %d failed:\n%s" % (trial, "\n".join(r.text() for r in [r0] + rest)))
    if dropped:
        contended += 1
        joined += good
print("connection flood: the ranks joined in %d of %d trials where rank 0 had to drop "
      "connections (%d idle connections)" % (joined, contended, opened))
if contended < TRIALS:
    fail("the flood filled rank 0's pending connections in only %d of %d trials" %
         (contended, MAX_TRIALS))
if joined != contended:
    fail("a flood of idle connections kept a rank out in %d of %d trials" %
         (contended - joined, contended))

# 4. Key files that are not regular files fail at once, with a message.
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
sys.exit(0 if ok else 1)
