#!/usr/bin/env python3
"""epipe-train's data files treated as hostile input: a small well-formed
IDX set (gzip and plain) trains, and every malformed one (missing, wrong
magic, truncated, implausible shape, a label that is no class, image and
label files that disagree, fewer images than a batch, bytes after the
data, a gzip stream cut short, corrupt or failing its checksum) is refused
with exit 1 and a message naming the file and the problem, before any
training. Needs no Fashion-MNIST: the files are made here. Usage:
check_train_data.py EPIPE_TRAIN."""
import gzip
import os
import random
import struct
import subprocess
import sys
import tempfile

train = sys.argv[1]
ok = True
NAMES = {"train-images": "train-images-idx3-ubyte.gz", "train-labels": "train-labels-idx1-ubyte.gz",
         "test-images": "t10k-images-idx3-ubyte.gz", "test-labels": "t10k-labels-idx1-ubyte.gz"}
ARGS = ["--stages", "1", "--epochs", "1", "--batch", "8", "--hidden", "16", "--quiet"]


def idx(dims, body, magic=b"\0\0\x08"):
    return magic + bytes([len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + body


def images(n, side=4):
    rng = random.Random(n)
    return idx([n, side, side], bytes(rng.randrange(256) for _ in range(n * side * side)))


def labels(n, classes=10):
    return idx([n], bytes(i % classes for i in range(n)))


def dataset(**override):
    """The four files (bytes by name), 32 training and 16 test items of 4x4
    pixels, with some replaced."""
    files = {"train-images": images(32), "train-labels": labels(32),
             "test-images": images(16), "test-labels": labels(16)}
    files.update(override)
    return files


def run(what, files, plain=False, extra=()):
    with tempfile.TemporaryDirectory() as d:
        for key, data in files.items():
            if data is None:
                continue
            with open(os.path.join(d, NAMES[key.removeprefix("raw:")]), "wb") as f:
                f.write(data if plain or key.startswith("raw:") else gzip.compress(data))
        r = subprocess.run([train, *ARGS, *extra, "--data", d], capture_output=True, text=True,
                           timeout=120)
        return r, d


def accepted(what, files, plain=False):
    global ok
    r, _ = run(what, files, plain)
    if r.returncode != 0 or "test accuracy" not in r.stdout:
        print(f"FAIL: {what}: exit {r.returncode}\n{r.stdout[-500:]}{r.stderr[-500:]}")
        ok = False
    else:
        print(f"ok: {what}: " + [l for l in r.stdout.splitlines() if "test accuracy" in l][0])


def refused(what, files, needles, extra=()):
    """Exit 1, no accuracy line, and a stderr that holds every needle ({d}
    stands for the data folder)."""
    global ok
    r, d = run(what, files, extra=extra)
    err = r.stderr
    missing = [n for n in needles if n.format(d=d) not in err]
    if r.returncode != 1 or "test accuracy" in r.stdout or missing or "Sanitizer" in err:
        print(f"FAIL: {what}: exit {r.returncode}, missing {missing}\n"
              f"{r.stdout[-300:]}{err[-600:]}")
        ok = False
    else:
        print(f"ok: {what}: {err.strip().splitlines()[-1]}")


accepted("a small gzip set", dataset())
accepted("the same set as plain files", dataset(), plain=True)

lab = labels(32)
refused("a missing label file", dataset(**{"train-labels": None}),
        ["cannot open {d}/train-labels-idx1-ubyte.gz"])
refused("wrong magic", dataset(**{"test-images": idx([16, 4, 4], bytes(256), magic=b"\0\0\x09")}),
        ["{d}/t10k-images-idx3-ubyte.gz: not an IDX file of 3-dimensional unsigned bytes"])
refused("labels given as images", dataset(**{"train-images": labels(32)}),
        ["{d}/train-images-idx3-ubyte.gz: not an IDX file"])
refused("a header cut short", dataset(**{"train-images": images(32)[:9]}),
        ["{d}/train-images-idx3-ubyte.gz: truncated: 9 of the 16 bytes of its header"])
refused("images cut short", dataset(**{"train-images": images(32)[:-1]}),
        ["{d}/train-images-idx3-ubyte.gz: truncated: 511 of the 512 bytes of its data"])
refused("labels cut short", dataset(**{"test-labels": labels(16)[:-3]}),
        ["{d}/t10k-labels-idx1-ubyte.gz: truncated"])
refused("a zero dimension", dataset(**{"train-images": idx([32, 0, 4], b"")}),
        ["{d}/train-images-idx3-ubyte.gz: implausible shape 32x0x4"])
refused("a header claiming 2^32 - 1 images",
        dataset(**{"train-images": idx([0xFFFFFFFF, 28, 28], bytes(64))}),
        ["implausible shape 4294967295x28x28"])
refused("a header claiming 4 GiB of pixels",
        dataset(**{"train-images": idx([65536, 256, 256], bytes(64))}),
        ["implausible shape 65536x256x256"])
refused("a header claiming 2^32 - 1 labels",
        dataset(**{"test-labels": idx([0xFFFFFFFF], bytes(16))}),
        ["{d}/t10k-labels-idx1-ubyte.gz: implausible label count 4294967295"])
refused("a label that is no class", dataset(**{"train-labels": lab[:8 + 7] + b"\x0a" + lab[16:]}),
        ["{d}/train-labels-idx1-ubyte.gz: label 10 of item 7 is not a class (0..9)"])
refused("a label of 255", dataset(**{"test-labels": labels(16)[:-1] + b"\xff"}),
        ["label 255 of item 15 is not a class"])
refused("more labels than images", dataset(**{"train-labels": labels(33)}),
        ["the image and label files of {d} disagree: 32 and 33 training"])
refused("test images of another size", dataset(**{"test-images": images(16, side=5)}),
        ["disagree", "16 and 25 pixels"])
refused("fewer training images than a batch",
        dataset(**{"train-images": images(7), "train-labels": labels(7)}),
        ["7 training and 16 test images in {d}: each must be at least one batch (--batch 8)"])
refused("fewer test images than a batch",
        dataset(**{"test-images": images(4), "test-labels": labels(4)}),
        ["32 training and 4 test images"])
refused("a training limit below a batch", dataset(), ["5 training and 16 test images"],
        extra=["--train-limit", "5"])
gz = bytearray(gzip.compress(images(32)))
gz[len(gz) // 2] ^= 0xFF  # a flipped byte inside the deflate stream
refused("bytes after the labels", dataset(**{"train-labels": labels(32) + b"\0"}),
        ["{d}/train-labels-idx1-ubyte.gz: bytes beyond the data its header describes"])
cut = gzip.compress(images(32))
refused("a gzip file cut short", dataset(**{"raw:train-images": cut[:-12], "train-images": None}),
        ["{d}/train-images-idx3-ubyte.gz: truncated"])
refused("a gzip file without its checksum",
        dataset(**{"raw:train-images": cut[:-8], "train-images": None}),
        ["{d}/train-images-idx3-ubyte.gz: corrupt"])
crc = bytearray(cut)
crc[-8] ^= 1  # the trailer's CRC32 of an intact stream
refused("a gzip checksum that fails", dataset(**{"raw:train-images": bytes(crc),
                                                 "train-images": None}),
        ["{d}/train-images-idx3-ubyte.gz: corrupt"])
refused("a corrupt gzip stream", dataset(**{"raw:train-images": bytes(gz), "train-images": None}),
        ["{d}/train-images-idx3-ubyte.gz: corrupt ("])

sys.exit(0 if ok else 1)
