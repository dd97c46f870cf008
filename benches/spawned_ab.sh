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

# shellcheck source=benches/spawned_steps.sh
. "$REPO/benches/spawned_steps.sh"

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
