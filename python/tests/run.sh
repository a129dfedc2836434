#!/bin/sh
# Runs the binding's pytest suite (meson test --suite python). The Python
# that can import torch is /usr/bin/python3 on Debian (python3-torch), not
# whatever python3 is first on PATH; EPIPE_PYTHON overrides it. Without torch
# or pytest the suite reports a skip (exit 77, meson's protocol) with the
# reason, never a pass.
PY=${EPIPE_PYTHON:-/usr/bin/python3}
if [ ! -x "$PY" ]; then
    echo "SKIP: no Python interpreter at $PY (set EPIPE_PYTHON)"
    exit 77
fi
if ! why=$("$PY" -c "import torch, pytest" 2>&1); then
    echo "SKIP: $PY cannot import torch and pytest (install python3-torch python3-pytest):"
    echo "$why" | tail -n 1
    exit 77
fi
cd "$(dirname "$0")/../.." || exit 1
export PYTHONDONTWRITEBYTECODE=1
# The arguments go to pytest; without any, the whole of python/tests.
[ $# -gt 0 ] || set -- python/tests
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
