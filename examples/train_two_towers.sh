#!/usr/bin/env bash
# Builds the tickets of examples/two_towers.df from Debian's `fortunes` (installed if missing;
# examples/two_towers_data.py) and trains the model on them, evaluating both outputs' metrics
# on every seventh fortune after each epoch.
#
#   examples/train_two_towers.sh [EPOCHS]
set -euo pipefail
cd "$(dirname "$0")/.."

epochs=${1:-15}
if [ ! -e /usr/share/games/fortunes/computers ]; then
    examples/apt_install.sh fortunes
fi

cargo build --release --locked
dfc=target/release/dfc
out=target/two_towers
python3 examples/two_towers_data.py "$out/data"
"$dfc" compile examples/two_towers.df -o "$out/two_towers.plan"
feeds=()
for input in title body tag_bits priority department; do
    feeds+=(--feed "$input=$out/data/train_$input.npy" --eval-feed "$input=$out/data/test_$input.npy")
done
"$dfc" run "$out/two_towers.plan" "${feeds[@]}" --epochs "$epochs" --metrics "$out/two_towers.metrics.jsonl"
echo "metrics: $out/two_towers.metrics.jsonl" >&2
