#!/bin/sh
# Sets up, builds and runs the whole test suite: the .clang-format check, a
# -Werror build (with, where the CUDA toolkit is installed, the gpu suite's
# programs run against the CUDA module compiled for the CPU emulator in
# tests/cudaemu), a build without the BLAS codecs that is also a static+shared
# build, the unit, fuzz, rdma and transport conformance suites under
# ASan+UBSan and valgrind, the threaded tests under ThreadSanitizer, and the
# libFuzzer targets for a few seconds each when clang is present. Safe to
# run twice.
set -eu
cd "$(dirname "$0")/.."
sh scripts/ci/setup-debian.sh

configure() { # dir, options...
    dir=$1; shift
    if [ -f "$dir/build.ninja" ]; then
        meson setup --reconfigure "$dir" "$@" >/dev/null
    else
        meson setup "$dir" "$@" >/dev/null
    fi
}

echo "== source format (.clang-format)"
sh scripts/ci/check-format.sh

echo "== build and test (-Werror)"
configure build-test -Dwerror=true
ninja -C build-test
meson test -C build-test --print-errorlogs --num-processes 2

echo "== without BLAS (-Dblas=disabled; poweriter/insert tests skip) and default_library=both"
configure build-noblas -Dwerror=true -Dblas=disabled -Ddefault_library=both -Dcuda=disabled
ninja -C build-noblas
# The transport suites (conformance, tcp) and the Python binding's do not
# depend on the BLAS codecs (the binding's codec tests skip poweriter and
# insert without them); they run in the -Werror build (and the first two
# under the sanitizers), which keeps this stage to what BLAS and the static
# library change.
meson test -C build-noblas --print-errorlogs --num-processes 2 --no-suite conformance \
    --no-suite tcp --no-suite python

echo "== AddressSanitizer + UndefinedBehaviorSanitizer"
# GCC's -fsanitize=undefined leaves out float-to-integer overflow (a NaN
# or 1e30 cast to an index): asked for by name.
configure build-asan -Db_sanitize=address,undefined -Db_lundef=false -Doptimization=1 -Dcuda=disabled \
    -Dc_args=-fsanitize=float-cast-overflow -Dc_link_args=-fsanitize=float-cast-overflow
ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    meson test -C build-asan --print-errorlogs --num-processes 2 --suite unit --suite fuzz \
    --suite rdma --suite conformance --suite examples --suite tools

echo "== ThreadSanitizer (the threaded parts: transports, stages, codec threads)"
# Progress threads, the stage runtime and the codec thread pool, in the
# suites that run them (the Python drivers and the compute sweeps left
# out, and tcp-attacks: the rendezvous server it attacks is one thread).
# GCC's TSan cannot map its shadow memory under some kernels' address
# randomisation; a probe program tells, and then the stage runs without it.
configure build-tsan -Db_sanitize=thread -Db_lundef=false -Doptimization=1 -Dcuda=disabled \
    -Dfuzz=disabled
ninja -C build-tsan
printf 'int main(void) { return 0; }\n' | cc -fsanitize=thread -x c - -o build-tsan/tsan-probe
norand=
if ! build-tsan/tsan-probe 2>/dev/null; then
    norand='setarch -R'
    $norand build-tsan/tsan-probe || { echo "ThreadSanitizer cannot run on this kernel"; exit 1; }
    echo "(without address randomisation: TSan's shadow memory needs it on this kernel)"
fi
tsan_test() {
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $norand meson test -C build-tsan \
        --no-rebuild --print-errorlogs --num-processes 2 --timeout-multiplier 3 "$@"
}
tsan_test --suite unit --suite conformance --suite rdma --no-suite compute --no-suite examples \
    --no-suite conformance-rdma-device
tsan_test tcp tcp-crypt tcp-faults tcp-pipeline

echo "== valgrind (memcheck)"
# The test verbs provider (C; the rdma transport's own test runs under ASan
# only: under valgrind it took two minutes of the budget), beside the unit
# and fuzz suites: alone it kept a core idle for its 23 s. Its output goes
# to a file, shown if it fails.
vg='valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite -q'
meson test -C build-test --no-rebuild --print-errorlogs --num-processes 1 fakeverbs \
    --wrapper "$vg" --timeout-multiplier 10 --logbase fakeverbs-valgrind \
    >build-test/fakeverbs-valgrind.out 2>&1 &
fakeverbs=$!
# The 'compute' tests (large tensors, wide schedule sweeps) run under
# ASan+UBSan above; under valgrind they cost five minutes.
units=0
meson test -C build-test --no-rebuild --print-errorlogs --num-processes 2 --suite unit \
    --suite fuzz --no-suite compute --wrapper "$vg" --timeout-multiplier 10 || units=$?
if ! wait "$fakeverbs"; then
    cat build-test/fakeverbs-valgrind.out
    echo "fakeverbs failed under valgrind"
    exit 1
fi
[ "$units" -eq 0 ] || exit "$units"
# The conformance programs (not main-job, a Python driver): "at once" bounds x5.
EPIPE_CONF_TIME_SCALE=5 meson test -C build-test --no-rebuild --print-errorlogs --num-processes 2 \
    --suite conformance --no-suite examples --wrapper "$vg" --timeout-multiplier 10

if command -v clang >/dev/null 2>&1 && [ -n "$(find /usr/lib/llvm-*/lib/clang -name 'libclang_rt.fuzzer*.a' 2>/dev/null | head -n 1)" ]; then
    echo "== libFuzzer (10 s a target, two at a time)"
    CC=clang configure build-fuzz -Dfuzz=enabled -Db_sanitize=address,undefined -Db_lundef=false -Dtests=true
    # the libFuzzer binaries only (the replay drivers and the rest of the
    # tests ran above)
    targets=$(ninja -C build-fuzz -t targets all |
        sed -n 's|^\(tests/fuzz/fuzz_[a-z0-9_]*\): .*|\1|p' | grep -v '_replay$')
    [ -n "$targets" ] || { echo "no libFuzzer targets in build-fuzz"; exit 1; }
    # shellcheck disable=SC2086 # one target per word
    ninja -C build-fuzz $targets
    fuzz_one() { # a target for 10 s from its seed corpus; nonzero on a crash
        name=$(basename "$1")
        work=$(mktemp -d)
        cp tests/fuzz/corpus/"${name#fuzz_}"/* "$work"/ 2>/dev/null || true
        rc=0
        "build-fuzz/$1" -max_total_time=10 -rss_limit_mb=2048 "$work" >/dev/null \
            2>build-fuzz/"$name".log || rc=$?
        rm -rf "$work"
        return $rc
    }
    # two targets at a time, a core each
    # shellcheck disable=SC2086 # one target per word
    set -- $targets
    while [ $# -gt 0 ]; do
        a=$1 b=
        shift
        fuzz_one "$a" &
        pa=$!
        if [ $# -gt 0 ]; then
            b=$1
            shift
            fuzz_one "$b" &
            pb=$!
        fi
        for t in $a $b; do
            name=$(basename "$t")
            if [ "$t" = "$a" ]; then p=$pa; else p=$pb; fi
            if wait "$p"; then
                echo "$name: $(grep -c . build-fuzz/"$name".log) log lines, no crash"
            else
                tail -n 40 build-fuzz/"$name".log
                exit 1
            fi
        done
    done
else
    echo "== libFuzzer: skipped (clang with libclang-rt-*-dev not installed)"
fi
echo "all test stages passed"
