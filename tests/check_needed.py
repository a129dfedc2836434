#!/usr/bin/env python3
"""Checks the libraries the shared libepipe loads against the blas feature:
usage check_needed.py LIB blas|noblas. Without the feature neither its
NEEDED entries nor ldd's full list may name a BLAS or LAPACK; with it, the
NEEDED entries must (so the check cannot pass by looking at nothing).
Whatever the features, libepipe never loads a CUDA library (libcuda,
libcudart, libcublas, libcudnn): the CUDA backend is a module it opens
with dlopen on the first CUDA tensor.
libibverbs is never NEEDED either: the rdma transport opens it at run time."""
import re
import subprocess
import sys

lib, feature = sys.argv[1], sys.argv[2]
BLAS = re.compile(r"blas|lapack", re.I)
dyn = subprocess.run(["readelf", "-d", lib], check=True, capture_output=True, text=True).stdout
needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
print("NEEDED:", " ".join(needed))
if not needed:
    sys.exit(f"{lib}: no NEEDED entries read")
# The rdma transport opens libibverbs with dlopen: it is never a NEEDED entry.
if any("ibverbs" in n for n in needed):
    sys.exit("libepipe must not link libibverbs (the rdma transport dlopens it): " +
             " ".join(needed))
CUDA = re.compile(r"libcuda|libcudart|libcublas|libcudnn|libnvrtc", re.I)
cuda_needed = [n for n in needed if CUDA.search(n)]
if cuda_needed:
    sys.exit("libepipe must not link CUDA libraries, but needs " + ", ".join(cuda_needed))
ldd_cuda = subprocess.run(["ldd", lib], capture_output=True, text=True)
if ldd_cuda.returncode == 0:
    bad = [l.split()[0] for l in ldd_cuda.stdout.splitlines() if l.strip() and CUDA.search(l)]
    if bad:
        sys.exit("loading libepipe pulls in CUDA libraries: " + ", ".join(bad))
blas_needed = [n for n in needed if BLAS.search(n)]
if feature == "blas":
    if not blas_needed:
        sys.exit("built with the blas feature, but libepipe does not load a BLAS")
    sys.exit(0)
if blas_needed:
    sys.exit("built without the blas feature, but libepipe needs " + ", ".join(blas_needed))
ldd = subprocess.run(["ldd", lib], capture_output=True, text=True)
if ldd.returncode == 0:
    loaded = [line.split()[0] for line in ldd.stdout.splitlines() if line.strip()]
    print("ldd:", " ".join(loaded))
    bad = [n for n in loaded if BLAS.search(n)]
    if bad:
        sys.exit("built without the blas feature, but loading libepipe pulls in " +
                 ", ".join(bad))
else:
    print("ldd failed; checked the NEEDED entries only:", ldd.stderr.strip())
