#!/bin/sh
# Installs what libepipe needs to build, test and run its demo on Debian 12.
# python3-torch, python3-pytest, python3-numpy: the Python binding's tests and
# examples/torch (run them with /usr/bin/python3, which sees these packages);
# python3-venv, python3-pip, python3-setuptools, python3-wheel: installing the
# binding as a package offline (scripts/check-python-package.sh);
# python3-matplotlib: scripts/experiments/accuracy_ablation.py's plot.
# libibverbs-dev: the verbs header the rdma transport is compiled against (the
# library itself is opened at run time, never linked).
# Safe to run twice: it installs only the packages that are missing.
# Usage: scripts/ci/setup-debian.sh [extra-package ...]
set -eu
pkgs="meson ninja-build pkg-config gcc g++ python3 libcmocka-dev libdlpack-dev zlib1g-dev libsodium-dev
      libopenblas-dev liblapacke-dev libibverbs-dev dataset-fashion-mnist valgrind clang-format
      python3-torch python3-pytest python3-numpy python3-matplotlib python3-venv python3-pip
      python3-setuptools python3-wheel $*"
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "libepipe needs these Debian packages:$missing" >&2
    echo "install them as root:  sudo apt-get install -y$missing" >&2
    exit 1
fi
echo "installing:$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >/dev/null
