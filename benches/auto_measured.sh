#!/usr/bin/env bash
# `--strategy auto` against the hand-picked strategies, measured (a benchmark, not a test):
#
#   benches/auto_measured.sh [MODEL...]   (default: mlp cnn softmax_regression; env STEPS=200,
#                                          ROUNDS=3, WORKERS="1 2 4", CALIBRATE=1 to run
#                                          `dfc calibrate` first, DATA)
#
# For each model and number of workers N, compiles `--strategy auto` for N devices and the
# hand-picked plans — single, mirrored and model on N devices, ps --sync on 1 ps task and N-1
# workers — and trains each STEPS steps of Fashion-MNIST on `dfc run --spawn` workers, one for
# each device the plan gives work (a single plan's one; a model plan may leave devices idle).
# Every plan runs ROUNDS times, a round over all of them at a time, so that a slow spell of this
# host falls on one run of many plans rather than on every run of one; a plan's figure is its
# rounds' median. Prints each plan's median and
# range, which strategy auto chose, whether auto's plan does the same work as a hand-picked one
# (`dfc inspect --json` alike), and auto's median against the fastest hand-picked median.
# Predictions come from this host's profile: run `dfc calibrate` first.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${STEPS:-200}
ROUNDS=${ROUNDS:-3}
WORKERS=${WORKERS:-"1 2 4"}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("$@"); [ $# -eq 0 ] && MODELS=(mlp cnn softmax_regression)
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
[ "${CALIBRATE:-0}" = 1 ] && "$dfc" calibrate >&2
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $STEPS steps a run, $ROUNDS rounds; dfc $(git rev-parse --short HEAD)"

workers() {  # plan → the workers it runs on: one per device with work (a model plan may leave some idle)
    "$dfc" inspect --json "$1" | python3 -c 'import json, sys; print(len(json.load(sys.stdin)["devices"]))'
}

# Compile every plan first: entries "model n label workers", the plan in $dir/model-n-label.plan.
entries=()
: >"$dir/same"
for model in "${MODELS[@]}"; do
    for n in $WORKERS; do
        candidates=(single mirrored model ps)
        [ "$n" = 1 ] && candidates=(single mirrored)
        for strategy in "${candidates[@]}"; do
            case $strategy in
                ps) python3 -c 'import json, sys; n = int(sys.argv[1]); print(json.dumps({"cluster": {"ps": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{2 + i}" for i in range(n - 1)]}}))' \
                        "$n" >"$dir/cluster.json"
                    flags=(--cluster "$dir/cluster.json" --spawn "$n" --strategy ps --sync) ;;
                *) flags=(--devices "$n" --spawn "$n" --strategy "$strategy") ;;
            esac
            plan=$dir/$model-$n-$strategy.plan
            "$dfc" compile "examples/$model.df" "${flags[@]}" -o "$plan" >/dev/null 2>"$dir/err" || {
                echo "$model $strategy $n: does not compile: $(head -1 "$dir/err")" >&2; continue; }
            entries+=("$model $n $strategy $(workers "$plan")")
        done
        plan=$dir/$model-$n-auto.plan
        "$dfc" compile "examples/$model.df" --devices "$n" --spawn "$n" --strategy auto -o "$plan" >/dev/null 2>"$dir/err"
        chose=$(sed -n 's/.*(model `[^`]*`, \(.*\), chosen by --strategy auto.*/\1/p' "$dir/err")
        entries+=("$model $n auto $(workers "$plan")")
        # Which hand-picked plan, if any, does the same work: their summaries differ only where
        # a plan names how it was chosen.
        "$dfc" inspect --json "$plan" >"$dir/auto.json"
        for strategy in "${candidates[@]}"; do
            [ -f "$dir/$model-$n-$strategy.plan" ] || continue
            "$dfc" inspect --json "$dir/$model-$n-$strategy.plan" | cmp -s - "$dir/auto.json" &&
                echo "$model $n $strategy" >>"$dir/same"
        done
        echo "$model $n $chose" >>"$dir/chose"
    done
done

: >"$dir/rows"
for round in $(seq "$ROUNDS"); do
    for entry in "${entries[@]}"; do
        read -r model n label workers <<<"$entry"
        if "$dfc" run "$dir/$model-$n-$label.plan" --spawn "$workers" \
            --feed images="$DATA/train-images-idx3-ubyte.gz" \
            --feed labels="$DATA/train-labels-idx1-ubyte.gz" --steps "$STEPS" \
            --timeline "$dir/timeline.json" >/dev/null 2>"$dir/err"; then
            step=$(sed -n 's/^step: median \([0-9.]*\) ms.*/\1/p' "$dir/err")
            echo "$model $n $label $step" >>"$dir/rows"
        else
            echo "$model $label on $workers workers does not run: $(grep -m1 '^error' "$dir/err")" >&2
        fi
    done
    echo "round $round of $ROUNDS done" >&2
done

python3 - "$dir/rows" "$dir/chose" "$dir/same" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    model, n, label, step = line.split()
    runs.setdefault((model, int(n)), {}).setdefault(label, []).append(float(step))
chose = {tuple(l.split()[:2]): " ".join(l.split()[2:]) for l in open(sys.argv[2])}
same = {(l.split()[0], l.split()[1]): l.split()[2] for l in open(sys.argv[3])}
print(f"{'model':20} {'N':>2}  {'plan':34} {'median ms':>10}  range")
for (model, n), plans in runs.items():
    for label, steps in plans.items():
        name = f"auto (chose {chose[(model, str(n))]})" if label == "auto" else label
        print(f"{model:20} {n:>2}  {name:34} {statistics.median(steps):10.3f}  "
              f"{min(steps):.3f}-{max(steps):.3f}")
    hand = {k: statistics.median(v) for k, v in plans.items() if k != "auto"}
    if "auto" not in plans or not hand:
        continue
    best = min(hand, key=hand.get)
    auto = statistics.median(plans["auto"])
    twin = same.get((model, str(n)))
    note = f"; auto's plan does {twin}'s work" if twin else "; auto's plan is none of the hand-picked"
    if twin == best:
        note += ", the fastest hand-picked plan: the difference is run to run"
    print(f"{'':24}auto against the fastest hand-picked ({best}, {hand[best]:.3f} ms): "
          f"{auto / hand[best] - 1:+.1%}{note}")
PY
