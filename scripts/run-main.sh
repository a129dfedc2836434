#!/bin/sh
# Sets up, builds and runs libepipe's main job on its embedded default.
# For now that is the codec tour on Fashion-MNIST (epipe-codec-demo); the
# pipeline-training demo replaces it when the stage runtime lands.
# Safe to run twice. Extra arguments go to the demo.
set -eu
cd "$(dirname "$0")/.."
sh scripts/setup-debian.sh
if [ -f build-main/build.ninja ]; then
    meson setup --reconfigure build-main -Dtests=false >/dev/null
else
    meson setup build-main -Dtests=false >/dev/null
fi
ninja -C build-main >/dev/null
exec build-main/examples/epipe-codec-demo "$@"
