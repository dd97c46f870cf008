#!/usr/bin/env bash
# On the GPU machine, right after benches/gpu_check.sh (which unpacks the bundle into
# /tmp/dfc-gpu and stays warm): trains GPU plans of the MLP, the CNN and the residual network
# on Fashion-MNIST with examples/train_fashion_mnist.sh's epochs and optimizers, for comparison
# with the same script's CPU runs. The data travels apart from the bundle (both together are
# over the device tool's 64 MiB): Debian's four dataset-fashion-mnist files in .fmnist/.
#
#   mkdir -p .fmnist && cp /usr/share/datasets/fashion-mnist/*.gz .fmnist/   # here
#   bash benches/gpu_fashion_mnist.sh [MODEL...]                            # there; logs and metrics under $OUT
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/gpu-out}
BIN=/tmp/dfc-gpu
mkdir -p "$OUT"
[ -x "$BIN/dfc" ] || { echo "no bundle unpacked at $BIN: run benches/gpu_check.sh on this machine first" >&2; exit 1; }
[ -e "$REPO/.fmnist/train-images-idx3-ubyte.gz" ] || { echo "no Fashion-MNIST in .fmnist/" >&2; exit 1; }
CUBLAS=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$BIN/lib:${CUBLAS:-}:${LD_LIBRARY_PATH:-}
export DFC_CACHE_DIR=off
failures=0
for model in "${@:-mlp cnn resnet}"; do
    for m in $model; do
        echo "== $m"
        if ! DFC=$BIN/dfc DEVICES=gpu:1 FASHION_MNIST=$REPO/.fmnist OUT_DIR=/tmp/fashion-mnist \
            timeout "${LIMIT:-240}" bash "$REPO/examples/train_fashion_mnist.sh" "$m" > "$OUT/$m.log" 2>&1; then
            failures=$((failures + 1))
            echo "   FAILED (see $m.log)"
        fi
        cp /tmp/fashion-mnist/"$m".metrics.jsonl "$OUT/" 2>/dev/null
        tail -c 600 "$OUT/$m.log"; echo
        tail -n 1 "$OUT/$m.metrics.jsonl" 2>/dev/null
    done
done
echo "== $failures failed"
exit "$failures"
