#!/bin/sh
# The GPU checks in one call, for a machine with a CUDA device: the gpu
# suite's programs (byte identity with the CPU, hostile payloads, mix-ups,
# stages with CUDA tensors), the Python binding on CUDA tensors, the codec
# benchmarks against a device-to-device copy and against cuDNN, the pipeline
# overhead with its trace, the split CNN example with its stages on the GPU,
# and compute-sanitizer's memcheck and racecheck.
#
# usage: scripts/device/gpu-check.sh BUILD OUTDIR
#   BUILD: what scripts/device/pack.sh gathers (lib/libepipe.so.0,
#          cuda/libepipe-cuda.so, cuda/epipe-bench-cuda, tests/gpu/*, and
#          deps.tar.gz with the libraries the device machine lacks), or a
#          meson build folder on a machine that has those libraries.
#
# The device tool lends a few minutes a session and returns at most 8 files,
# so the steps run most important first, under one budget
# (GPU_CHECK_BUDGET_S, default 330 s: a second call fits in the same
# session), each also under its own limit (so one that hangs costs its limit
# and not the rest); a step that finds too little of the budget left is not
# started and is named at the end. GPU_CHECK_ONLY="name ..." runs only the
# steps whose names begin with one of those words (a second call: the ones
# the first did not reach). Everything goes to OUTDIR/gpu-check.log, the
# summary to OUTDIR/summary.txt and the end of stdout, the pipeline traces to
# OUTDIR/overhead-*/.
set -u
export PATH="$PATH:/usr/local/cuda/bin"
B=$(cd "$1" && pwd)
mkdir -p "$2"
O=$(cd "$2" && pwd)
LOG=$O/gpu-check.log
SUMMARY=$O/summary.txt
: >"$LOG"
: >"$SUMMARY"
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-330}
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EPIPE_CUDA_MODULE="$B/cuda/libepipe-cuda.so"
if [ -f "$B/deps.tar.gz" ]; then
    DEPS=$(mktemp -d)
    tar -C "$DEPS" -xzf "$B/deps.tar.gz"
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$DEPS/deps"
fi

wanted() { # wanted NAME: is the step selected by GPU_CHECK_ONLY?
    [ -z "${GPU_CHECK_ONLY:-}" ] && return 0
    for w in $GPU_CHECK_ONLY; do
        case $1 in "$w"*) return 0 ;; esac
    done
    return 1
}
step() { # step NAME SECONDS command...
    name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    left=$((T0 + BUDGET - $(date +%s)))
    if [ "$left" -lt 20 ]; then
        echo "$name: not started, ${left} s of the budget left" >>"$SUMMARY"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "==== $name (limit $limit s): $*" >>"$LOG"
    t0=$(date +%s)
    timeout "$limit" "$@" >"$O/step.log" 2>&1
    rc=$?
    cat "$O/step.log" >>"$LOG"
    case $rc in
    0) verdict=passed ;;
    77) verdict=skipped ;;
    124) verdict="timed out" ;;
    *) verdict=failed ;;
    esac
    # a program that runs but cannot check some part says SKIP: named here
    skips=$(grep -c '^SKIP' "$O/step.log")
    [ "$skips" -gt 0 ] && [ "$rc" -ne 77 ] && verdict="$verdict, $skips SKIP lines"
    line="$name: $verdict (exit $rc) in $(($(date +%s) - t0)) s"
    echo "$line" >>"$SUMMARY"
    echo "== $line"
    tail -n 12 "$O/step.log"
    rm -f "$O/step.log"
}

nvidia-smi -L 2>&1 | head -2 | tee -a "$LOG"
# The module opens cuBLAS (poweriter, insert's linear kind) and cuDNN
# (insert's convolutions) at run time: the toolkit's, else the ones
# PyTorch's wheels bring. Without them those codecs' CUDA tensors are staged
# through the host and the gpu suite's poweriter and insert cases fail
# (they check the device's path), so say which were found.
wheel_lib() { # wheel_lib MODULE: the lib folder of an nvidia.* wheel
    python3 -c "import os, nvidia.$1 as m; print(os.path.join(list(m.__path__)[0], 'lib'))" \
        2>/dev/null
}
for lib in cublas cudnn; do
    found=
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib "$(wheel_lib $lib)"; do
        if [ -n "$d" ] && ls "$d"/lib$lib.so.* >/dev/null 2>&1; then
            export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
            found=$d
            break
        fi
    done
    echo "$lib: ${found:-not found}" | tee -a "$LOG" "$SUMMARY"
done
PY="env PYTHONPATH=$PWD/python EPIPE_LIBRARY=$B/lib/libepipe.so.0 PYTHONDONTWRITEBYTECODE=1 python3"

# 1. Correctness: every kernel against the CPU's bytes, the stages.
step gpu-codecs "${GPU_CHECK_TEST_S:-150}" "$B/tests/gpu/test_gpu_codecs"
step gpu-stage "${GPU_CHECK_TEST_S:-150}" "$B/tests/gpu/test_gpu_stage"
# 2. The codecs that read the shape, on the issue's [32,32,112,112]: poweriter
# (cuBLAS products, CholeskyQR2) and insert (cuDNN's convolutions, against
# the same convolutions called directly: --cudnn)
step bench-shaped "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" --reps 5 --cudnn \
    --shape 32,32,112,112 poweriter:rank=3 insert:kind=conv,out=4,kernel=2 \
    insert:kind=conv,out=8,kernel=4,code=fp16
# 3. The Python binding on CUDA tensors (torch is on the device machine)
# shellcheck disable=SC2086 # $PY: a command and its words
step python-cuda "${GPU_CHECK_PYTHON_S:-120}" $PY -m pytest -q -p no:cacheprovider \
    python/tests/test_cuda.py python/tests/test_codec.py python/tests/test_torch_api.py \
    python/tests/test_dp_pp.py::test_hook_on_nccl
# 3b. examples/torch/fmnist_schedule.py with its three stages on the GPU,
# on the Fashion-MNIST subset pack.sh carries: it must learn and say cuda
if [ -d "$B/fmnist" ] && [ -x "$B/tools/epipe-run" ]; then
    # shellcheck disable=SC2016 # $1 and $2: the inner sh's
    step example-cuda "${GPU_CHECK_PYTHON_S:-120}" sh -c '
        out=$(env PYTHONPATH="$1/python" EPIPE_LIBRARY="$2/lib/libepipe.so.0" \
            PYTHONDONTWRITEBYTECODE=1 "$2/tools/epipe-run" -n 3 -- python3 \
            examples/torch/fmnist_schedule.py --device auto --data "$2/fmnist" \
            --train-limit 3840 --test-limit 1000 2>&1)
        rc=$?
        echo "$out"
        [ "$rc" = 0 ] && echo "$out" | grep -q "test accuracy .* on cuda:0$"' sh "$PWD" "$B"
elif wanted example; then
    echo "example-cuda: pack.sh carried no Fashion-MNIST subset or no epipe-run" >>"$SUMMARY"
fi
# 4. A CUDA-tensor pipeline step against its compute and codec kernels, with
# each stage's trace summary (issue 11's overhead target)
for codec in sortquant:bits=8 none; do
    # shellcheck disable=SC2086
    step "overhead-${codec%%:*}" "${GPU_CHECK_PYTHON_S:-120}" $PY \
        python/bench/bench_pipeline_overhead.py --device cuda --codec "$codec" \
        --trace "$O/overhead-${codec%%:*}"
done
# ... both again with stream-ordered stages (sends and receives that return
# with their work queued, one wait a step): the hidden waits it removes
for codec in sortquant:bits=8 none; do
    # shellcheck disable=SC2086
    step "overhead-${codec%%:*}-ordered" "${GPU_CHECK_PYTHON_S:-120}" $PY \
        python/bench/bench_pipeline_overhead.py --device cuda --codec "$codec" \
        --stream-ordered --trace "$O/overhead-${codec%%:*}-ordered"
done
# ... and `none` again with its payloads through host messages, pinned and
# then pageable, in the same run: what keeping them on the device and
# pinning host messages (EPIPE_STAGE_CUDA_DEVICE's defaults) each save
# shellcheck disable=SC2086
step overhead-none-hostmsg "${GPU_CHECK_PYTHON_S:-120}" env EPIPE_CUDA_DEVICE_MESSAGES=0 $PY \
    python/bench/bench_pipeline_overhead.py --device cuda --codec none
# shellcheck disable=SC2086
step overhead-none-pageable "${GPU_CHECK_PYTHON_S:-120}" env EPIPE_CUDA_DEVICE_MESSAGES=0 \
    EPIPE_CUDA_PINNED_MESSAGES=0 $PY python/bench/bench_pipeline_overhead.py --device cuda \
    --codec none
# 5. Throughput against a device-to-device copy, 12.8M values
specs="none cast:dtype=fp16 cast:dtype=bf16 quant:bits=8 quant:bits=4 sortquant:bits=8,mode=sample
       sortquant:bits=8 sortquant:bits=4 sortquant:bits=8,mode=exact topk:ratio=0.1 topk:ratio=0.01
       kmeans:bits=4 kmeans:bits=8"
# shellcheck disable=SC2086 # $specs: one word a spec
step bench-codec "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" $specs
# ... and the decodes whose checks wait for synchronize, with them at once
# (the wait before each launch), in the same run: what deferring saves
step bench-codec-checks-first "${GPU_CHECK_BENCH_S:-90}" env EPIPE_CUDA_DEFER_CHECKS=0 \
    "$B/cuda/epipe-bench-cuda" cast:dtype=fp16 quant:bits=8 sortquant:bits=8,mode=sample \
    topk:ratio=0.1
# 6. compute-sanitizer over the kernels, small tensors
if command -v compute-sanitizer >/dev/null; then
    for tool in ${GPU_CHECK_SANITIZERS:-memcheck racecheck}; do
        # racecheck took 122 s on an H200 (2026-11-27), memcheck 3 s
        step "sanitizer-$tool" "${GPU_CHECK_SANITIZER_S:-150}" env EPIPE_GPU_TEST_QUICK=1 \
            compute-sanitizer --tool "$tool" --error-exitcode 1 "$B/tests/gpu/test_gpu_codecs"
    done
elif wanted sanitizer; then
    echo "sanitizer: compute-sanitizer not on PATH" >>"$SUMMARY"
fi
# 7. The rest: measured before, or less central
step bench-linear "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" --reps 5 \
    --shape 4096,3136 insert:kind=linear,out=196
# shellcheck disable=SC2086
step bench-codec-host "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" --payload host $specs
step bench-prototype "${GPU_CHECK_PROTO_S:-60}" python3 tools/torch/bench_sortquant_prototype.py
# GPU_CHECK_PROFILE=1: each kernel's time in one encode and decode (ncu)
if [ "${GPU_CHECK_PROFILE:-0}" = 1 ] && command -v ncu >/dev/null; then
    # shellcheck disable=SC2086 # one word a spec
    step profile 120 ncu --csv --metrics gpu__time_duration.sum "$B/cuda/epipe-bench-cuda" \
        --reps 1 ${GPU_CHECK_PROFILE_SPECS:-quant:bits=8 sortquant:bits=8,mode=sample sortquant:bits=8}
fi
echo "== summary, $(($(date +%s) - T0)) s of a ${BUDGET} s budget"
cat "$SUMMARY"
