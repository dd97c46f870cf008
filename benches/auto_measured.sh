#!/usr/bin/env bash
# `--strategy auto` against the hand-picked strategies, measured (a benchmark, not a test):
#
#   benches/auto_measured.sh [MODEL...]   (default: mlp cnn softmax_regression; env STEPS=200,
#                                          WORKERS="1 2 4", CALIBRATE=1 to run `dfc calibrate`
#                                          first, DATA)
#
# For each model and number of workers N, compiles `--strategy auto` for N devices and the
# hand-picked plans — single, mirrored and model on N devices, ps --sync on 1 ps task and N-1
# workers — trains each STEPS steps of Fashion-MNIST on `dfc run --spawn N` workers (a single
# plan, which uses one device, on 1), and prints each
# plan's measured median step, which strategy auto chose, and auto's step against the fastest
# hand-picked one. Predictions come from this host's profile: run `dfc calibrate` first.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${STEPS:-200}
WORKERS=${WORKERS:-"1 2 4"}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("$@"); [ $# -eq 0 ] && MODELS=(mlp cnn softmax_regression)
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
[ "${CALIBRATE:-0}" = 1 ] && "$dfc" calibrate >&2
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $STEPS steps a run; dfc $(git rev-parse --short HEAD)"

measure() {  # plan workers → the median step in ms, or nothing where it does not run
    if "$dfc" run "$1" --spawn "$2" --feed images="$DATA/train-images-idx3-ubyte.gz" \
        --feed labels="$DATA/train-labels-idx1-ubyte.gz" --steps "$STEPS" \
        --timeline "$dir/timeline.json" >/dev/null 2>"$dir/err"; then
        sed -n 's/^step: median \([0-9.]*\) ms.*/\1/p' "$dir/err"
    else
        echo "  does not run on $2 workers: $(grep -m1 '^error' "$dir/err")" >&2
    fi
}

printf '%-20s %7s  %-34s %s\n' model workers "plan" "measured ms"
for model in "${MODELS[@]}"; do
    for n in $WORKERS; do
        : >"$dir/rows"
        candidates=(single mirrored model ps)
        [ "$n" = 1 ] && candidates=(single mirrored)
        for strategy in "${candidates[@]}"; do
            case $strategy in
                ps) python3 -c 'import json, sys; n = int(sys.argv[1]); print(json.dumps({"cluster": {"ps": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{2 + i}" for i in range(n - 1)]}}))' \
                        "$n" >"$dir/cluster.json"
                    flags=(--cluster "$dir/cluster.json" --strategy ps --sync) ;;
                *) flags=(--devices "$n" --strategy "$strategy") ;;
            esac
            "$dfc" compile "examples/$model.df" "${flags[@]}" -o "$dir/plan" >/dev/null 2>"$dir/err" || {
                echo "$model $strategy $n: does not compile: $(head -1 "$dir/err")" >&2; continue; }
            workers=$n
            [ "$strategy" = single ] && workers=1
            step=$(measure "$dir/plan" "$workers")
            [ -n "$step" ] || continue
            printf '%-20s %7s  %-34s %s\n' "$model" "$n" "$strategy" "$step"
            echo "$strategy $step" >>"$dir/rows"
        done
        "$dfc" compile "examples/$model.df" --devices "$n" --strategy auto -o "$dir/plan" >/dev/null 2>"$dir/err"
        chose=$(sed -n 's/.*(model `[^`]*`, \(.*\), chosen by --strategy auto.*/\1/p' "$dir/err")
        workers=$n
        [ "$chose" = single ] && workers=1
        step=$(measure "$dir/plan" "$workers")
        printf '%-20s %7s  %-34s %s\n' "$model" "$n" "auto (chose $chose)" "$step"
        [ -n "$step" ] || continue
        python3 - "$dir/rows" "$step" "$chose" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
best = min(rows, key=lambda r: float(r[1]))
auto = float(sys.argv[2])
same = " (the same strategy: the difference is run to run)" if sys.argv[3].split(",")[0].replace(" --sync", "") == best[0] else ""
print(f"{'':30}  auto against the fastest hand-picked ({best[0]}, {float(best[1]):.3f} ms): {auto / float(best[1]) - 1:+.1%}{same}")
PY
    done
done
