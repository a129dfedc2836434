#!/bin/sh
# Installs into a scratch DESTDIR, then builds and runs a program against the
# installed library found only through pkg-config: the shared library with
# `pkg-config --libs`, and, where a static archive was installed
# (-Ddefault_library=static or both), the archive with `--static`, whose
# Requires.private and Libs.private must name everything it needs.
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
# The first -L is epipe's own libdir, with the sysroot prefix: the libdir
# inside the scratch DESTDIR (a static-only .pc lists its dependencies' too).
set -- $(pkg-config --libs-only-L epipe)
libdir_root=${1#-L}
ran=0
if [ -e "$libdir_root/libepipe.so" ]; then
    libs=$(pkg-config --libs epipe)
    echo "pkg-config (shared): $cflags $libs"
    cc $cflags "$tmp/use.c" -o "$tmp/use" $libs
    LD_LIBRARY_PATH="$libdir_root" "$tmp/use"
    ran=1
fi
if [ -e "$libdir_root/libepipe.a" ]; then
    libs=$(pkg-config --static --libs epipe)
    echo "pkg-config --static: $cflags $libs"
    # -l:libepipe.a picks the archive even where the .so is beside it.
    cc $cflags "$tmp/use.c" -o "$tmp/use-static" $(echo "$libs" | sed 's/-lepipe\b/-l:libepipe.a/')
    if readelf -d "$tmp/use-static" | grep -q 'libepipe\.so'; then
        echo "the static link still loads libepipe.so"
        exit 1
    fi
    "$tmp/use-static"
    ran=1
fi
[ "$ran" = 1 ] || { echo "neither libepipe.so nor libepipe.a was installed in $libdir_root"; exit 1; }
