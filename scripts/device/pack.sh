#!/bin/sh
# Builds what scripts/device/gpu-check.sh runs and gathers it into one folder
# for the device tool to carry. The device machine has the CUDA toolkit,
# PyTorch, meson and ninja, but none of Debian's -dev packages: so the build
# is made here, and the shared libraries it links that are not the C and C++
# runtimes (OpenBLAS and LAPACKE, which poweriter's and insert's CPU sides
# need, and which the gpu suite compares the device's results with) travel in
# OUT/deps.tar.gz, which gpu-check.sh unpacks and puts on LD_LIBRARY_PATH.
#
# usage: scripts/device/pack.sh [BUILD [OUT]]
#   BUILD: the meson build folder (default build-device; configured here
#          with BLAS and CUDA required, authentication and RDMA off, when it
#          is not configured yet)
#   OUT:   the folder to carry (default .devbuild, ignored by git); emptied
#
# Then, through the device tool: run with carry [".devbuild"] and the command
#   sh scripts/device/gpu-check.sh .devbuild "$OUT"
set -eu
B=${1:-build-device}
O=${2:-.devbuild}
if [ ! -f "$B/build.ninja" ]; then
    meson setup "$B" -Dbuildtype=debugoptimized -Dcuda=enabled -Dblas=enabled \
        -Dauth=disabled -Drdma=disabled -Dfuzz=disabled
fi
files="lib/libepipe.so.0 cuda/libepipe-cuda.so cuda/epipe-bench-cuda
       tests/gpu/test_gpu_codecs tests/gpu/test_gpu_stage tools/epipe-run"
meson compile -C "$B" epipe epipe-cuda epipe-bench-cuda test_gpu_codecs test_gpu_stage epipe-run
rm -rf "$O"
mkdir -p "$O/deps"
for f in $files; do
    mkdir -p "$O/$(dirname "$f")"
    cp -L "$B/$f" "$O/$f"
done
# The libraries the build links, less the C and C++ runtimes every Linux
# machine has (and ld.so): found by ldd on this machine, copied with the
# names the binaries ask for.
for f in $files; do
    ldd "$O/$f"
done | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u |
    while read -r name path; do
        case $name in
        libc.so.* | libm.so.* | libstdc++.so.* | libgcc_s.so.* | libpthread.so.* | \
            libdl.so.* | librt.so.* | ld-linux*) ;;
        libepipe*) ;;
        *) cp -L "$path" "$O/deps/$name" ;;
        esac
    done
# The carry limit is 64 MiB together with the working tree: debug sections
# are most of the binaries, and OpenBLAS is 36 MB, 14 gzipped (gpu-check.sh
# unpacks deps.tar.gz into a folder of its own).
find "$O" -type f -exec strip --strip-debug {} +
ls "$O/deps"
tar -C "$O" -czf "$O/deps.tar.gz" deps
rm -r "$O/deps"
# The first 3,840 training and 1,000 test images of Fashion-MNIST (about
# 1 MB), for examples/torch on the GPU: the device machine has no dataset.
data=/usr/share/datasets/fashion-mnist
if [ -f "$data/train-images-idx3-ubyte.gz" ]; then
    python3 - "$data" "$O/fmnist" <<'EOF'
import gzip, os, struct, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for pre, keep in (("train", 3840), ("t10k", 1000)):
    for kind in ("images-idx3", "labels-idx1"):
        name = f"{pre}-{kind}-ubyte.gz"
        with gzip.open(os.path.join(src, name), "rb") as f:
            raw = f.read()
        ndim = raw[3]
        dims = list(struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim]))
        item = len(raw[4 + 4 * ndim:]) // dims[0]
        dims[0] = min(keep, dims[0])
        body = raw[4 + 4 * ndim:4 + 4 * ndim + dims[0] * item]
        with gzip.open(os.path.join(dst, name), "wb") as f:
            f.write(raw[:4] + struct.pack(f">{ndim}I", *dims) + body)
EOF
else
    echo "pack.sh: no Fashion-MNIST in $data: the example-cuda step will be skipped" >&2
fi
du -sh "$O"
