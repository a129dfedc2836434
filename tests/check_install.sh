#!/bin/sh
# Installs into a scratch DESTDIR, then builds and runs a program against the
# installed library found only through pkg-config.
set -eu
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
meson install -C "$build" --no-rebuild --quiet --destdir "$tmp/root" >/dev/null
pcdir=$(dirname "$(find "$tmp/root" -name epipe.pc | head -n 1)")
[ -f "$pcdir/epipe.pc" ] || { echo "epipe.pc was not installed"; exit 1; }
export PKG_CONFIG_PATH="$pcdir" PKG_CONFIG_SYSROOT_DIR="$tmp/root"
cflags=$(pkg-config --cflags epipe)
libs=$(pkg-config --libs epipe)
echo "pkg-config: $cflags $libs"
cat > "$tmp/use.c" <<'C'
#include <epipe/epipe.h>
#include <stdio.h>
int main(void)
{
    epipe_codec *c;
    if (epipe_version() != EPIPE_VERSION_NUMBER) return 1;
    if (epipe_codec_create(&c, "none") != EPIPE_OK) return 2;
    printf("%s %s\n", epipe_version_string(), epipe_codec_spec(c));
    epipe_codec_destroy(c);
    return 0;
}
C
cc $cflags "$tmp/use.c" -o "$tmp/use" $libs
libdir=$(pkg-config --libs-only-L epipe | sed 's/^ *-L//; s/ *$//')
LD_LIBRARY_PATH="$libdir" "$tmp/use"
