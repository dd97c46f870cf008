#!/usr/bin/env bash
# A pipeline's idle share on 2 spawned workers against GPipe's bubble (a benchmark, not a
# test):
#
#   benches/pipeline_idle.sh [MODEL.df...]   (default: benches/uniform_mlp.df, examples/mlp.df;
#                                             env DFC=target/release/dfc, MICRO="2 4 8",
#                                             SCHEDULES="1f1b gpipe", STEPS=60)
#
# Each model compiled with `--strategy model --devices 2 --micro-batches M` under each
# `--pipeline-schedule` and trained STEPS
# Fashion-MNIST steps on 2 spawned workers with `--timeline`. From the timeline, per step
# (the span from the first worker's start of its partition to the last one's end) and per
# worker, the share of the step in which the worker computed nothing (its partition's spans
# but exchanges); the medians over the steps (the first tenth left out), each worker's and
# their mean, beside (K − 1)/(M + K − 1) with K = 2 stages.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DFC=$(realpath "${DFC:-$REPO/target/release/dfc}")
STEPS=${STEPS:-60}; MICRO=${MICRO:-2 4 8}; SCHEDULES=${SCHEDULES:-1f1b gpipe}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("$@"); [ $# -eq 0 ] && MODELS=("$REPO/benches/uniform_mlp.df" "$REPO/examples/mlp.df")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; 2 spawned workers, $STEPS steps"

for model in "${MODELS[@]}"; do
    for m in $MICRO; do
      for schedule in $SCHEDULES; do
        "$DFC" compile "$model" --devices 2 --strategy model --micro-batches "$m" --pipeline-schedule "$schedule" \
            -o "$dir/plan" 2>"$dir/err" \
            || { cat "$dir/err" >&2; exit 1; }
        "$DFC" run "$dir/plan" --spawn 2 --feed images="$DATA/train-images-idx3-ubyte.gz" \
            --feed labels="$DATA/train-labels-idx1-ubyte.gz" --steps "$STEPS" --timeline "$dir/t.json" \
            >/dev/null 2>"$dir/err" || { cat "$dir/err" >&2; exit 1; }
        python3 - "$dir/t.json" "$(basename "$model")" "$m" "$schedule" <<'PY'
import json, statistics, sys
events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
spans = [e for e in events if e.get("ph") == "X"]
runs = {}
for e in spans:
    if e["cat"] == "partition":
        runs.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
workers = sorted(runs)
for r in runs.values():
    r.sort()
computing = [e for e in spans if e["tid"] in runs and e["cat"] not in ("partition", "recv", "send")]
steps = min(len(r) for r in runs.values())
idle = {w: [] for w in workers}
for i in range(steps):
    lo, hi = min(runs[w][i][0] for w in workers), max(runs[w][i][1] for w in workers)
    for w in workers:
        busy = sum(min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)
                   for e in computing if e["tid"] == w and e["ts"] < hi and e["ts"] + e["dur"] > lo)
        idle[w].append(1 - busy / (hi - lo))
skip = steps // 10
each = [statistics.median(idle[w][skip:]) for w in workers]
both = statistics.median(statistics.mean(x) for x in zip(*(idle[w][skip:] for w in workers)))
m = int(sys.argv[3])
print(f"{sys.argv[2]}, M={m}, {sys.argv[4]}: idle share per worker {' '.join(f'{x:.3f}' for x in each)}, mean {both:.3f}; "
      f"(K-1)/(M+K-1) = {1 / (m + 1):.3f}")
PY
      done
    done
done
