#!/usr/bin/env bash
# The cost model's prediction against the measured step (a benchmark, not a test):
#
#   benches/predict.sh [MODEL...]   (default: mlp cnn softmax_regression; env STEPS=200,
#                                    ROUNDS=3, CALIBRATE=1 to run `dfc calibrate` first, DATA)
#
# Each model is compiled under single (1 worker), mirrored (1, 2 and 4 workers), ps --sync
# (1 ps task and 1 or 2 workers) and model (2 workers), and trained STEPS steps of Fashion-MNIST
# on `dfc run --spawn` workers with --timeline; `dfc run` then prints the median step (the
# driver's step spans) beside the step the cost model predicts from this host's profile for the
# way it ran. The same plans on one process: `dfc bench`'s median beside its prediction. Each
# plan runs ROUNDS times, a round over all of them at a time, and a row is its rounds' median.
# Prints each row's error (predicted / measured - 1), then the median and worst |error| of each
# set, and whether each model's plans are ordered alike by the predictions and the
# measurements: in all, in the pairs measured more than 10% apart, and in the pairs whose
# rounds' ranges do not overlap (which this host's noise did not reorder in any round).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${STEPS:-200}
ROUNDS=${ROUNDS:-3}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("$@"); [ $# -eq 0 ] && MODELS=(mlp cnn softmax_regression)
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
[ "${CALIBRATE:-0}" = 1 ] && "$dfc" calibrate >&2
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $STEPS steps a run, $ROUNDS rounds"

cluster() {  # workers → a cluster file of 1 ps task and N-1 worker tasks (addresses unused: --spawn)
    python3 - "$1" <<'PY'
import json, sys
n = int(sys.argv[1])
print(json.dumps({"cluster": {"ps": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{2 + i}" for i in range(n - 1)]}}))
PY
}

: >"$dir/rows"
plans=()
for model in "${MODELS[@]}"; do
    configs=("single 1" "mirrored 1" "mirrored 2" "mirrored 4" "ps 2" "ps 3" "model 2")
    for config in "${configs[@]}"; do
        read -r strategy workers <<<"$config"
        plan=$dir/$model-$strategy-$workers.plan
        case $strategy in
            ps) cluster "$workers" >"$dir/cluster.json"
                flags=(--cluster "$dir/cluster.json" --strategy ps --sync) ;;
            *) flags=(--devices "$workers" --strategy "$strategy") ;;
        esac
        "$dfc" compile "examples/$model.df" "${flags[@]}" -o "$plan" >/dev/null 2>"$dir/err" || {
            echo "$model $strategy $workers: does not compile: $(head -1 "$dir/err")" >&2; continue; }
        plans+=("$model $strategy $workers")
    done
done

# Rounds over all the plans, so that a slow spell of this host falls on one run of many plans
# rather than on every run of one.
for round in $(seq "$ROUNDS"); do
    for entry in "${plans[@]}"; do
        read -r model strategy workers <<<"$entry"
        plan=$dir/$model-$strategy-$workers.plan
        "$dfc" run "$plan" --spawn "$workers" --feed images="$DATA/train-images-idx3-ubyte.gz" \
            --feed labels="$DATA/train-labels-idx1-ubyte.gz" --steps "$STEPS" \
            --timeline "$dir/timeline.json" >/dev/null 2>"$dir/err" || { cat "$dir/err" >&2; exit 1; }
        line=$(grep '^step: median' "$dir/err" || true)
        measured=$(sed -n 's/^step: median \([0-9.]*\) ms.*/\1/p' <<<"$line")
        predicted=$(sed -n 's/.*; predicted \([0-9.]*\) ms.*/\1/p' <<<"$line")
        [ -n "$predicted" ] || { echo "no prediction: run dfc calibrate first (or CALIBRATE=1)" >&2; exit 1; }
        echo "spawned $model $strategy $workers $measured $predicted" >>"$dir/rows"
        json=$("$dfc" bench "$plan" --min-time 1 --json 2>/dev/null)
        python3 - "$json" "$model $strategy $workers" >>"$dir/rows" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
print("one-process", sys.argv[2], r["median_step_us"] / 1e3, r["predicted_step_us"] / 1e3)
PY
    done
    echo "round $round of $ROUNDS done" >&2
done

python3 - "$dir/rows" <<'PY'
import statistics, sys
# One row per plan and place: the median of its rounds' measurements and predictions.
runs = {}
for line in open(sys.argv[1]):
    where, model, strategy, workers, measured, predicted = line.split()
    runs.setdefault((where, model, strategy, workers), []).append((float(measured), float(predicted)))
rows = [list(key) + [statistics.median(m for m, _ in v), statistics.median(p for _, p in v),
                     min(m for m, _ in v), max(m for m, _ in v)]
        for key, v in runs.items()]
print(f"{'where':12} {'model':20} {'strategy':9} {'workers':>7} {'measured ms':>12} {'predicted ms':>13} {'error':>8}  rounds' range")
for where, model, strategy, workers, measured, predicted, low, high in rows:
    error = predicted / measured - 1
    print(f"{where:12} {model:20} {strategy:9} {workers:>7} {measured:12.3f} {predicted:13.3f} {error:+8.1%}  {low:.3f}-{high:.3f}")
for where in ("spawned", "one-process"):
    errors = [abs(float(r[5]) / float(r[4]) - 1) for r in rows if r[0] == where]
    if not errors:
        continue
    print(f"{where}: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(errors)} runs")
    for model in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[0] == where and r[1] == model]
        by_measured = [f"{r[2]}/{r[3]}" for r in sorted(mine, key=lambda r: float(r[4]))]
        by_predicted = [f"{r[2]}/{r[3]}" for r in sorted(mine, key=lambda r: float(r[5]))]
        same = "the same" if by_measured == by_predicted else "differently"
        print(f"  {model}: fastest first, measured {' < '.join(by_measured)}; predicted orders them {same}"
              + ("" if same == "the same" else f" ({' < '.join(by_predicted)})"))
        # Pairs whose measurements are apart by more than this host's noise between runs.
        apart = [(a, b) for i, a in enumerate(mine) for b in mine[i + 1:]
                 if max(a[4], b[4]) > 1.1 * min(a[4], b[4])]
        alike = sum((a[4] < b[4]) == (a[5] < b[5]) for a, b in apart)
        print(f"    of the {len(apart)} pairs measured more than 10% apart, the predictions order {alike} alike")
        # Pairs that every round ordered alike: the slower plan's fastest round slower than the
        # faster plan's slowest.
        told = [(a, b) for i, a in enumerate(mine) for b in mine[i + 1:] if a[7] < b[6] or b[7] < a[6]]
        alike = sum((a[4] < b[4]) == (a[5] < b[5]) for a, b in told)
        print(f"    of the {len(told)} pairs whose rounds' ranges do not overlap, the predictions order {alike} alike")
PY
