#!/bin/sh
# Installs libepipe from a build dir into a scratch prefix, then the Python
# package into a fresh virtual environment (pip install, offline, no build
# isolation: setuptools comes from Debian's python3-setuptools), imports it
# from outside the source tree with the library found through pkg-config
# only, and runs the binding's pytest suite against the installed copy.
# Then the same with an editable install (pip install -e).
# Usage: scripts/check-python-package.sh BUILD_DIR [SOURCE_DIR]
# EPIPE_PYTHON picks the interpreter (default /usr/bin/python3, which has
# torch on Debian). Exit 77 (a skip, meson's protocol) with the reason when
# venv, pip, setuptools or torch are missing.
set -eu
build=$(cd "$1" && pwd)
src=$(cd "${2:-$(dirname "$0")/..}" && pwd)
PY=${EPIPE_PYTHON:-/usr/bin/python3}
if ! why=$("$PY" -c "import venv, ensurepip, setuptools, wheel, torch, pytest" 2>&1); then
    echo "SKIP: $PY lacks what the check needs (python3-venv python3-setuptools python3-wheel"
    echo "python3-torch python3-pytest):"
    echo "$why" | tail -n 1
    exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset EPIPE_LIBRARY EPIPE_INCLUDE PYTHONPATH LD_LIBRARY_PATH
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

# libepipe, installed; its epipe.pc rewritten to the scratch prefix
meson install -C "$build" --no-rebuild --quiet --destdir "$tmp/root" >/dev/null
pc=$(find "$tmp/root" -name epipe.pc | head -n 1)
[ -n "$pc" ] || { echo "FAIL: meson install wrote no epipe.pc"; exit 1; }
prefix=$(sed -n 's/^prefix=//p' "$pc")
mkdir "$tmp/pc"
sed "s|^prefix=.*|prefix=$tmp/root$prefix|" "$pc" > "$tmp/pc/epipe.pc"
export PKG_CONFIG_PATH="$tmp/pc" PKG_CONFIG_LIBDIR="$tmp/pc"
libdir=$(pkg-config --variable=libdir epipe)
[ -e "$libdir/libepipe.so.0" ] || { echo "SKIP: no shared libepipe in $libdir (static build)"; exit 77; }

# the package sources, copied: pip builds in place and must not write into the tree
cp -R "$src/python" "$tmp/pkg"
rm -rf "$tmp/pkg/tests" "$tmp/pkg/build" "$tmp/pkg"/*.egg-info
cp -R "$src/python/tests" "$tmp/tests"

"$PY" -m venv --system-site-packages "$tmp/venv"
vpy="$tmp/venv/bin/python"
cd "$tmp"

check_import() { # expected package dir
    out=$("$vpy" -c "import epipe, os; print(epipe.__version__, epipe.library_path, os.path.dirname(epipe.__file__))")
    dist=$("$vpy" -c "import importlib.metadata as m; print(m.version(\"epipe\"))")
    [ "$dist" = "${out%% *}" ] || { echo "FAIL: pip installed epipe $dist, epipe.__version__ is ${out%% *}"; exit 1; }
    echo "import epipe: $out"
    set -- "$1" $out
    case "$3" in "$libdir"/*) ;; *) echo "FAIL: libepipe loaded from $3, not pkg-config's $libdir"; exit 1 ;; esac
    case "$4" in "$1"*) ;; *) echo "FAIL: epipe imported from $4, not $1"; exit 1 ;; esac
    [ "$2" = "$(pkg-config --modversion epipe)" ] || { echo "FAIL: version $2 vs epipe.pc"; exit 1; }
}

echo "== pip install ./python (fresh venv, offline, --no-build-isolation)"
"$vpy" -m pip install -q --no-build-isolation "$tmp/pkg"
check_import "$tmp/venv/lib/"
"$vpy" -m pytest -q -p no:cacheprovider "$tmp/tests"

echo "== pip install -e ./python"
"$vpy" -m pip uninstall -q -y epipe
"$vpy" -m pip install -q --no-build-isolation -e "$tmp/pkg"
check_import "$tmp/pkg/epipe"
"$vpy" -m pytest -q -p no:cacheprovider "$tmp/tests/test_abi.py"
echo "python package: installed, imported and tested outside the source tree"
