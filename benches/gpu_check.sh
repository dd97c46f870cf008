#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and no Rust or LLVM (the device tool's): unpacks the bundle
# benches/gpu_bundle.sh made (.gpu/, carried) and runs dfc's GPU checks and benchmarks, each
# logged under $OUT (default /tmp/gpu-out):
#
# 1. every fused kernel of every example on the GPU against the interpreter (kernels.log);
# 2. every example's GPU plan, training steps on the GPU against the interpreter (native.log);
# 3. the bandwidth of a 64 Mi-element fused elementwise kernel against the GPU's peak
#    (bandwidth.log);
# 4. dfc bench of logreg, mlp and cnn GPU plans at batch 128 and 512, and PyTorch eager's
#    steps right after (bench.log, torch.json).
#
# A check that fails is logged and the others still run; the exit status is the number of
# failures.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
BIN=/tmp/dfc-gpu
mkdir -p "$BIN/lib"
for packed in "$REPO"/.gpu/*.xz; do
    name=$(basename "${packed%.xz}")
    case $name in
        lib.*) xz -dc "$packed" > "$BIN/lib/${name#lib.}" ;;
        *) xz -dc "$packed" > "$BIN/$name" && chmod +x "$BIN/$name" ;;
    esac
done
# cuBLAS from PyTorch's wheel, under a name cudarc tries (libcublas.so).
CUBLAS=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null)
if [ -n "$CUBLAS" ]; then
    for lib in "$CUBLAS"/libcublas.so.*; do ln -sf "$lib" "$BIN/lib/libcublas.so"; done
fi
export LD_LIBRARY_PATH=$BIN/lib:${CUBLAS:-}:${LD_LIBRARY_PATH:-}
# The test binaries read the examples from where they were built.
[ -e /work/main ] || { mkdir -p /work && ln -s "$REPO" /work/main; }
export DFC_GPU_REQUIRED=1 DFC_CACHE_DIR=off
failures=0
check() { # name, command...
    local name=$1; shift
    echo "== $name: $*"
    if ! "$@" > "$OUT/$name.log" 2>&1; then
        failures=$((failures + 1))
        echo "   FAILED (see $name.log)"
    fi
    tail -5 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
check kernels "$BIN/kernels-test" --nocapture every_kernel_of_every_example
check native "$BIN/native-test" --nocapture gpu_plans_run_on_a_gpu
check bandwidth "$BIN/bandwidth-bench" --bench
cd "$REPO"
: > "$OUT/bench.log"
for model in softmax_regression mlp cnn; do
    for batch in 128 512; do
        plan=/tmp/$model-$batch.plan
        if "$BIN/dfc" compile "examples/$model.df" --devices gpu:1 --dim "batch=$batch" -o "$plan" >> "$OUT/bench.log" 2>&1; then
            "$BIN/dfc" bench "$plan" --min-time 2 >> "$OUT/bench.log" 2>&1 || failures=$((failures + 1))
        else
            failures=$((failures + 1))
        fi
    done
done
tail -8 "$OUT/bench.log"
check torch python3 benches/torch_peer.py --batches 128 512 --out "$OUT/torch.json"
echo "== $failures failed"
exit "$failures"
