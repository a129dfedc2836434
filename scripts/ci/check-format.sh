#!/bin/sh
# Checks every tracked C source and header against .clang-format, or, with
# --fix, rewrites them in place. Exits 1 and names the files that differ.
# clang-format's output changes between major versions: the style was tuned
# with clang-format 14 (Debian bookworm); CLANG_FORMAT picks another binary.
set -eu
cd "$(dirname "$0")/../.."
cf=${CLANG_FORMAT:-clang-format}
if ! command -v "$cf" >/dev/null 2>&1; then
    echo "check-format: $cf not found (install clang-format, or set CLANG_FORMAT)" >&2
    exit 2
fi
major=$("$cf" --version | sed -n 's/.*version \([0-9]*\).*/\1/p')
[ "$major" = 14 ] || echo "check-format: note: $cf is version $major; the style was tuned with 14" >&2
fix=0
[ "${1:-}" = "--fix" ] && fix=1
files=$(git ls-files '*.c' '*.h' '*.c.in')
bad=0
for f in $files; do
    if [ "$fix" = 1 ]; then
        "$cf" -i --style=file "$f"
    elif ! "$cf" --style=file --dry-run --Werror "$f" >/dev/null 2>&1; then
        echo "$f"
        bad=$((bad + 1))
    fi
done
if [ "$bad" -gt 0 ]; then
    echo "check-format: $bad file(s) differ from .clang-format; run sh scripts/ci/check-format.sh --fix" >&2
    exit 1
fi
[ "$fix" = 1 ] && echo "check-format: reformatted $(echo "$files" | wc -w) files" || echo "check-format: all files match .clang-format"
