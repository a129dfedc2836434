#!/bin/sh
# Sets up, builds and runs libepipe's main job on its embedded default:
# epipe-train on Fashion-MNIST, 3 pipeline stages as 3 processes over TCP on
# this machine (started by epipe-run), 1f1b, sortquant:bits=8 on activations
# and gradients (zero=1 on the gradients). Safe to run twice. Extra arguments go to epipe-train
# (--help lists them), e.g. --act-codec none --grad-codec none.
set -eu
cd "$(dirname "$0")/.."
sh scripts/ci/setup-debian.sh
if [ -f build-main/build.ninja ]; then
    meson setup --reconfigure build-main -Dtests=false >/dev/null
else
    meson setup build-main -Dtests=false >/dev/null
fi
ninja -C build-main >/dev/null
exec build-main/tools/epipe-run -n "${EPIPE_STAGES:-3}" -- build-main/examples/epipe-train "$@"
