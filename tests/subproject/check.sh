#!/bin/sh
# Builds tests/subproject (a consumer project) with this source tree as its
# subproject "libepipe", found through dependency('epipe'), and runs it.
# Only the consumer target is built: libepipe's tests and tools are not.
set -eu
src=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/proj/subprojects"
cp "$src/tests/subproject/meson.build" "$src/tests/subproject/consumer.c" "$tmp/proj/"
ln -s "$src" "$tmp/proj/subprojects/libepipe"
meson setup "$tmp/build" "$tmp/proj" -Dlibepipe:tests=false >"$tmp/setup.log" 2>&1 ||
    { cat "$tmp/setup.log"; exit 1; }
grep -i 'dependency epipe' "$tmp/setup.log" || true
ninja -C "$tmp/build" consumer >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$tmp/build/consumer"
