#!/bin/sh
# Runs the same benchmarks on two builds of libepipe, one after the other in
# one session, so that a change is measured before and after on one machine.
# Usage: scripts/experiments/compare-builds.sh BEFORE_BUILD_DIR AFTER_BUILD_DIR [OUT.jsonl]
# Each line of OUT (default: stdout) is epipe-bench's JSON with a "build" key
# added ("before" or "after"). Take figures for the record on an idle machine
# and note `uptime` beside them (the script prints it first and last).
set -eu
[ $# -ge 2 ] || { echo "usage: $0 BEFORE_BUILD_DIR AFTER_BUILD_DIR [OUT.jsonl]" >&2; exit 2; }
before=$1 after=$2 out=${3:-/dev/stdout}
for b in "$before" "$after"; do
    [ -x "$b/tools/epipe-bench" ] || { echo "$0: no $b/tools/epipe-bench (build it first)" >&2; exit 2; }
done
: >"$out"
echo "load before: $(uptime)" >&2

run() { # label, build dir, epipe-bench arguments...
    label=$1 dir=$2
    shift 2
    "$dir/tools/epipe-bench" "$@" --json | sed "s/^{/{\"build\": \"$label\", /" >>"$out"
}

# Codecs against memcpy (the issue-3 set; sortquant in the research's sample
# mode, which both builds have), stage overhead per op, TCP against a raw
# socket. Alternate the builds so that a drift in load hits both.
for label in before after; do
    eval dir=\$$label
    run "$label" "$dir" codec none quant:bits=8 sortquant:bits=8,mode=sample \
        sortquant:bits=4,mode=sample cast:dtype=bf16 --shape 12800000 --threads 2 --no-ref
done
for label in before after; do
    eval dir=\$$label
    run "$label" "$dir" pipeline --kind 1f1b -p 4 -m 8
done
for label in before after; do
    eval dir=\$$label
    run "$label" "$dir" transport --sizes 4M,16M,64M --reps 5
done
echo "load after: $(uptime)" >&2
