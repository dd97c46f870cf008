#!/usr/bin/env bash
# Compiles examples/transformer.df and trains it on a text corpus from Debian's `fortunes`
# package (installed if missing), the file's bytes as tokens in windows of 65 (a text feed,
# `--feed text=text:PATH`). Writes metrics and a checkpoint per epoch.
#
#   examples/train_transformer.sh [CORPUS] [EPOCHS]
#
# CORPUS is a file of /usr/share/games/fortunes (default `computers`, 238 KB: 116 steps an
# epoch at batch 32) or any path.
set -euo pipefail
cd "$(dirname "$0")/.."

corpus=${1:-computers}
epochs=${2:-8}
[ -e "$corpus" ] || corpus=/usr/share/games/fortunes/$corpus
if [ ! -e "$corpus" ]; then
    examples/apt_install.sh fortunes
fi

cargo build --release --locked
dfc=target/release/dfc
out=target/transformer
mkdir -p "$out"
"$dfc" compile examples/transformer.df -o "$out/transformer.plan"
"$dfc" run "$out/transformer.plan" --feed text="text:$corpus" --epochs "$epochs" \
    --metrics "$out/transformer.metrics.jsonl" --checkpoint-dir "$out/transformer.checkpoints"
echo "metrics: $out/transformer.metrics.jsonl; checkpoints: $out/transformer.checkpoints" >&2
