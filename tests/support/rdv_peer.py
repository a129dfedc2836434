"""A scripted peer of the TCP rendezvous for the tests: the wire and hello
formats as a foreign process writes them, and real ranks started directly."""
import os
import socket
import struct
import subprocess
import threading
import time

trainer = None  # path of tcp_trainer; the test sets it


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


HT_REGISTER, HT_CHALLENGE, HT_PROOF, HT_WELCOME, HT_TABLE = 1, 3, 4, 5, 6


def hello(htype, rank, size, flags=0, stream=0, port=1, job=0):
    p = b"EPTH" + struct.pack("<BBHIIIH", htype, flags, 3, rank, size, stream, port) + bytes(2)
    p += b"127.0.0.1".ljust(64, b"\0") + os.urandom(32) + bytes(32) + struct.pack("<Q", job)
    assert len(p) == 160
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
        self.err, self.outl = [], []
        self.t = [threading.Thread(target=self._drain, args=(f, lines), daemon=True)
                  for f, lines in ((self.p.stderr, self.err), (self.p.stdout, self.outl))]
        for t in self.t:
            t.start()

    @staticmethod
    def _drain(f, lines):
        for line in f:
            lines.append(line)

    def wait_log(self, text, timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            if any(text in l for l in self.err):
                return True
            time.sleep(0.02)
        return False

    def finish(self, timeout=60):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        for t in self.t:
            t.join(5)
        self.out = "".join(self.outl)
        return self.p.returncode == 0 and ("rank %d: ok" % self.k) in self.out

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


def register(port, rank, size, listen_port, job=0):
    """Registers as `rank` (no key; job tag `job`, 0 for none) with rank 0 at
    port; returns the socket once rank 0 has welcomed it, or raises (with
    rank 0's ERROR text, if it sent one)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(hello(HT_REGISTER, rank, size, port=listen_port, job=job))
    for want in (HT_CHALLENGE, HT_WELCOME):
        m = recv_msg(s)
        if m and m[0] == ERROR:
            raise RuntimeError("rank 0 refused: " + m[1].decode(errors="replace"))
        if not m or m[0] != HELLO or m[1][4] != want:
            raise RuntimeError("rank 0 answered %r, not hello type %d" % (m, want))
        if want == HT_CHALLENGE:
            s.sendall(hello(HT_PROOF, rank, size))
    return s


def error(text, src, about, status=-12):
    """An ERROR message about rank `about` (status EPIPE_EPEER by default)."""
    f = bytearray(frame(ERROR, text.encode(), src=src))
    struct.pack_into("<IQ", f, 20, about, -status)  # micro-batch, step
    struct.pack_into("<I", f, 188, crc32c(bytes(f[:188])))
    return bytes(f)
