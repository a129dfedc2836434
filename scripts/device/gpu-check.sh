#!/bin/sh
# The GPU checks in one call, for a machine with a CUDA device: the gpu
# suite's program (byte identity with the CPU, hostile payloads, mix-ups),
# the codec benchmark against a device-to-device copy, the PyTorch
# prototype-style sort quantization, and compute-sanitizer's memcheck and
# racecheck over the kernels. Each step has its own time limit, so one that
# hangs costs its limit and not the rest; each writes its log to OUTDIR.
#
# usage: scripts/device/gpu-check.sh BUILD OUTDIR
#   BUILD holds lib/libepipe.so.0, cuda/libepipe-cuda.so,
#   cuda/epipe-bench-cuda, tests/gpu/test_gpu_codecs and
#   tests/gpu/test_gpu_stage (a meson build
#   folder, or the same files copied: the device machine needs no meson).
set -u
export PATH="$PATH:/usr/local/cuda/bin"
B=$(cd "$1" && pwd)
O=$2
mkdir -p "$O"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EPIPE_CUDA_MODULE="$B/cuda/libepipe-cuda.so"
step() { # step NAME SECONDS command...
    name=$1 limit=$2
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" >"$O/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc in $(($(date +%s) - t0)) s"
    tail -n 25 "$O/$name.log"
}
nvidia-smi -L 2>&1 | head -2
# insert opens cuDNN at run time (libcudnn.so.9): the toolkit's, else the
# one PyTorch's wheels bring; without it insert's CUDA tensors are staged
# and the gpu suite's insert cases fail (they check the device's path).
for d in /usr/local/cuda/lib64 "$(python3 -c 'import nvidia.cudnn, os; print(os.path.dirname(nvidia.cudnn.__file__) + "/lib")' 2>/dev/null)"; do
    if [ -n "$d" ] && ls "$d"/libcudnn.so.9* >/dev/null 2>&1; then
        export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
        echo "cuDNN: $d"
        break
    fi
done
step gpu-codecs "${GPU_CHECK_TEST_S:-150}" "$B/tests/gpu/test_gpu_codecs"
specs="none cast:dtype=fp16 cast:dtype=bf16 quant:bits=8 quant:bits=4 sortquant:bits=8,mode=sample
       sortquant:bits=8 sortquant:bits=4 sortquant:bits=8,mode=exact topk:ratio=0.1 topk:ratio=0.01
       kmeans:bits=4 kmeans:bits=8"
step gpu-stage "${GPU_CHECK_TEST_S:-150}" "$B/tests/gpu/test_gpu_stage"
# shellcheck disable=SC2086 # $specs: one word a spec
step bench-codec "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" $specs
# shellcheck disable=SC2086
step bench-codec-host "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" --payload host $specs
# The codecs that read the shape, on the issue's [32,32,112,112]: poweriter
# (cuBLAS products, its QR on the host) and insert (cuDNN's convolutions,
# against the same convolutions called directly: --cudnn)
step bench-shaped "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" --reps 5 --cudnn \
    --shape 32,32,112,112 poweriter:rank=3 insert:kind=conv,out=4,kernel=2 \
    insert:kind=conv,out=8,kernel=4,code=fp16
step bench-linear "${GPU_CHECK_BENCH_S:-90}" "$B/cuda/epipe-bench-cuda" --reps 5 \
    --shape 4096,3136 insert:kind=linear,out=196
# The Python binding on CUDA tensors (torch is on the device machine)
step python-cuda "${GPU_CHECK_PYTHON_S:-120}" env PYTHONPATH="$PWD/python" \
    EPIPE_LIBRARY="$B/lib/libepipe.so.0" PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q \
    -p no:cacheprovider python/tests/test_cuda.py python/tests/test_codec.py \
    python/tests/test_torch_api.py python/tests/test_dp_pp.py::test_hook_on_nccl
# A CUDA-tensor pipeline step against its compute and codec kernels, with
# each stage's trace summary (issue 11's overhead target)
for codec in sortquant:bits=8 none; do
    step "overhead-${codec%%:*}" "${GPU_CHECK_PYTHON_S:-120}" env PYTHONPATH="$PWD/python" \
        EPIPE_LIBRARY="$B/lib/libepipe.so.0" PYTHONDONTWRITEBYTECODE=1 \
        python3 python/bench/bench_pipeline_overhead.py --device cuda --codec "$codec" \
        --trace "$O/overhead-trace-${codec%%:*}"
done
# GPU_CHECK_PROFILE=1: each kernel's time in one encode and decode (ncu)
if [ "${GPU_CHECK_PROFILE:-0}" = 1 ] && command -v ncu >/dev/null; then
    # shellcheck disable=SC2086 # one word a spec
    step profile 120 ncu --csv --metrics gpu__time_duration.sum "$B/cuda/epipe-bench-cuda" \
        --reps 1 ${GPU_CHECK_PROFILE_SPECS:-quant:bits=8 sortquant:bits=8,mode=sample sortquant:bits=8}
fi
step bench-prototype "${GPU_CHECK_PROTO_S:-60}" python3 tools/torch/bench_sortquant_prototype.py
if command -v compute-sanitizer >/dev/null; then
    export EPIPE_GPU_TEST_QUICK=1
    for tool in ${GPU_CHECK_SANITIZERS:-memcheck racecheck}; do
        step "sanitizer-$tool" "${GPU_CHECK_SANITIZER_S:-75}" compute-sanitizer --tool "$tool" \
            --error-exitcode 1 "$B/tests/gpu/test_gpu_codecs"
    done
else
    echo "== compute-sanitizer: not on PATH"
fi
