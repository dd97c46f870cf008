#!/usr/bin/env bash
# Compiles an example and trains it on Fashion-MNIST (60,000 training images), evaluating on
# the 10,000 test images after each epoch. Installs Debian's dataset-fashion-mnist if missing.
#
#   examples/train_fashion_mnist.sh [softmax_regression|mlp|mlp_dropout|cnn|resnet] [EPOCHS] [OPTIMIZER]
#
# The examples keep the peer benchmarks' optimizer (SGD, lr 0.01); for accuracy this script
# trains with the optimizer below unless one is given.
#
# From the environment, if set: DEVICES (`--devices`, e.g. gpu:1 for a GPU plan), DFC (a dfc
# binary to use instead of building one), FASHION_MNIST (the data's folder), OUT_DIR (where
# the plan, metrics and checkpoints go; target/fashion-mnist by default).
set -euo pipefail
cd "$(dirname "$0")/.."

model=${1:-mlp}
case "$model" in
    softmax_regression) epochs=30; optimizer="sgd(lr = 0.1)" ;;
    mlp) epochs=15; optimizer="momentum(lr = 0.01, momentum = 0.9)" ;;
    # Dropout pays where the plain MLP overfits: compare with `mlp 40`.
    mlp_dropout) epochs=40; optimizer="momentum(lr = 0.01, momentum = 0.9)" ;;
    cnn) epochs=6; optimizer="adam(lr = 0.001)" ;;
    # Its own: Adam with a cosine decay over 15 epochs of 937 steps.
    resnet) epochs=15; optimizer="adam(lr = cosine_decay(0.002, decay_steps = 14060, alpha = 0.01))" ;;
    *) echo "usage: $0 [softmax_regression|mlp|mlp_dropout|cnn|resnet] [EPOCHS] [OPTIMIZER]" >&2; exit 2 ;;
esac
epochs=${2:-$epochs}
optimizer=${3:-$optimizer}

data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
if [ ! -e "$data/train-images-idx3-ubyte.gz" ]; then
    examples/apt_install.sh dataset-fashion-mnist
fi

if [ -n "${DFC:-}" ]; then
    dfc=$DFC
else
    cargo build --release --locked
    dfc=target/release/dfc
fi
out=${OUT_DIR:-target/fashion-mnist}
mkdir -p "$out"
"$dfc" compile "examples/$model.df" --optimizer "$optimizer" ${DEVICES:+--devices "$DEVICES"} -o "$out/$model.plan"
"$dfc" run "$out/$model.plan" \
    --feed images="$data/train-images-idx3-ubyte.gz" --feed labels="$data/train-labels-idx1-ubyte.gz" \
    --eval-feed images="$data/t10k-images-idx3-ubyte.gz" --eval-feed labels="$data/t10k-labels-idx1-ubyte.gz" \
    --epochs "$epochs" --metrics "$out/$model.metrics.jsonl" --checkpoint-dir "$out/$model.checkpoints"
echo "metrics: $out/$model.metrics.jsonl; checkpoints: $out/$model.checkpoints" >&2
