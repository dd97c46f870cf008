#!/usr/bin/env bash
# Two dfc binaries side by side on data-parallel training steps (a benchmark, not a test):
#
#   benches/spawned_ab.sh BASE_DFC NEW_DFC [MODEL...]   (default: mlp cnn; env ROUNDS=5,
#                                                        WORKERS=2, STEPS=300, STRATEGY=mirrored)
#
# Each binary compiles each model for WORKERS devices under STRATEGY and trains STEPS steps of
# Fashion-MNIST with `dfc run --spawn WORKERS`; the binaries take turns (A B, then B A),
# ROUNDS times. Prints each binary's median step time (the run's training seconds over its
# steps) and NEW / BASE. For a change to the runtime or the compiler: build BASE from the
# commit before it.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,10p "$0"; exit 2; }
BASE=$(realpath "$1"); NEW=$(realpath "$2"); shift 2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-5}; WORKERS=${WORKERS:-2}; STEPS=${STEPS:-300}; STRATEGY=${STRATEGY:-mirrored}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("$@"); [ $# -eq 0 ] && MODELS=(mlp cnn)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $STRATEGY on $WORKERS spawned workers, $STEPS steps, $ROUNDS rounds"

step_ms() {  # dfc plan → the step time of one run, in ms
    rm -f "$dir/metrics.jsonl"
    "$1" run "$2" --spawn "$WORKERS" --feed images="$DATA/train-images-idx3-ubyte.gz" \
        --feed labels="$DATA/train-labels-idx1-ubyte.gz" --steps "$STEPS" \
        --metrics "$dir/metrics.jsonl" 2>"$dir/err" >/dev/null || { cat "$dir/err" >&2; exit 1; }
    python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(r["seconds"] / r["step"] * 1e3)' "$dir/metrics.jsonl"
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

for model in "${MODELS[@]}"; do
    for side in base new; do
        dfc=$BASE; [ $side = new ] && dfc=$NEW
        "$dfc" compile "$REPO/examples/$model.df" --devices "$WORKERS" --strategy "$STRATEGY" -o "$dir/$side.plan" 2>/dev/null
        : >"$dir/$side"
    done
    for round in $(seq "$ROUNDS"); do
        order=(base new); [ $((round % 2)) -eq 0 ] && order=(new base)
        for side in "${order[@]}"; do
            dfc=$BASE; [ $side = new ] && dfc=$NEW
            step_ms "$dfc" "$dir/$side.plan" >>"$dir/$side"
        done
    done
    base=$(median <"$dir/base"); new=$(median <"$dir/new")
    printf '%s: median ms/step  base %.3f [%s]  new %.3f [%s]  new/base %s\n' "$model" "$base" \
        "$(tr '\n' ' ' <"$dir/base")" "$new" "$(tr '\n' ' ' <"$dir/new")" \
        "$(python3 -c "import sys; print(f'{float(sys.argv[2]) / float(sys.argv[1]):.3f}')" "$base" "$new")"
done
