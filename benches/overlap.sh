#!/usr/bin/env bash
# All-reduces overlapped with the backward pass against all-reduces after it (a benchmark, not
# a test):
#
#   benches/overlap.sh [MODEL...]        (default: mlp cnn; env ROUNDS=5, WORKERS=2, STEPS=300)
#
# Each model is compiled mirrored over WORKERS devices three ways: the default plan (one fused
# all-reduce after the backward pass), the same buckets as --overlap without overlap
# (--fusion-threshold 262144), and --overlap. Each plan trains STEPS steps of Fashion-MNIST
# with `dfc run --spawn WORKERS`, the plans taking turns, ROUNDS times; prints each plan's
# median step time (the run's training seconds over its steps) and the ratios.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-5}
WORKERS=${WORKERS:-2}
STEPS=${STEPS:-300}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("${@:-mlp}")
[ $# -eq 0 ] && MODELS=(mlp cnn)
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $WORKERS workers, $STEPS steps, $ROUNDS rounds"

# shellcheck source=benches/spawned_steps.sh
. "$REPO/benches/spawned_steps.sh"

for model in "${MODELS[@]}"; do
    common=(--devices "$WORKERS" --strategy mirrored)
    "$dfc" compile "examples/$model.df" "${common[@]}" -o "$dir/after.plan" 2>/dev/null
    "$dfc" compile "examples/$model.df" "${common[@]}" --fusion-threshold 262144 -o "$dir/buckets.plan" 2>/dev/null
    "$dfc" compile "examples/$model.df" "${common[@]}" --overlap -o "$dir/overlap.plan" 2>/dev/null
    : >"$dir/after" ; : >"$dir/buckets" ; : >"$dir/overlap"
    for round in $(seq "$ROUNDS"); do
        # ABC, then CBA: each plan in every position as often.
        order=(after buckets overlap)
        [ $((round % 2)) -eq 0 ] && order=(overlap buckets after)
        for plan in "${order[@]}"; do step_ms "$dfc" "$dir/$plan.plan" >>"$dir/$plan"; done
    done
    after=$(median <"$dir/after"); buckets=$(median <"$dir/buckets"); overlap=$(median <"$dir/overlap")
    echo "$model: median ms/step of $ROUNDS runs"
    printf '  all-reduce after the backward pass (default plan): %7.3f  [%s]\n' "$after" "$(tr '\n' ' ' <"$dir/after")"
    printf '  the --overlap buckets, not overlapped:              %7.3f  [%s]\n' "$buckets" "$(tr '\n' ' ' <"$dir/buckets")"
    printf '  --overlap:                                          %7.3f  [%s]\n' "$overlap" "$(tr '\n' ' ' <"$dir/overlap")"
    python3 -c "import sys; a,b,o=map(float,sys.argv[1:]); print(f'  overlap / default {o/a:.3f}, overlap / same buckets {o/b:.3f}')" "$after" "$buckets" "$overlap"
done
