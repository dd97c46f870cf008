#!/usr/bin/env bash
# LLVM pass pipelines for the kernels, against each other: the cold load (code generated into
# an empty code cache) and the training step of the standard models, per pipeline, from
# interleaved rounds (a pipeline's runs are spread over the whole measurement, so that the
# machine's drift falls on all of them alike).
#
#   benches/pipelines.sh [--rounds N] [PIPELINE ...]
#
# Default pipelines: default<O3> (dfc's), default<O2>, and a hand-picked list of what the
# kernels need (promotion to registers, simplification, loop canonical form, LICM, the loop
# and SLP vectorisers). Each is given to dfc as DFC_LLVM_PASSES; O3 and O2 run, as dfc's own
# does, without LLVM's loop unroller. Figures: medians over N rounds (default 3) of
# `dfc bench --json`'s load_ms and median_step_us.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=3
PIPELINES=()
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=${2:?--rounds needs a number}; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "pipelines.sh: unknown argument \`$1\`" >&2; exit 64 ;;
        *) PIPELINES+=("$1") ;;
    esac
    shift
done
if [ ${#PIPELINES[@]} -eq 0 ]; then
    PIPELINES=(
        'default<O3>'
        'default<O2>'
        'function(sroa,early-cse,instcombine,simplifycfg,loop-simplify,lcssa,loop-mssa(licm),loop-rotate,indvars,loop-vectorize,slp-vectorizer,instcombine,simplifycfg)'
    )
fi

(cd "$REPO" && cargo build --release --quiet --bin dfc)
DFC=$REPO/target/release/dfc
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pipelines.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
MODELS="softmax_regression mlp cnn"
for model in $MODELS; do
    "$DFC" compile "$REPO/examples/$model.df" -o "$WORK/$model.plan" 2>/dev/null
done

: >"$WORK/runs.jsonl"
for round in $(seq "$ROUNDS"); do
    for p in "${!PIPELINES[@]}"; do
        for model in $MODELS; do
            rm -rf "$WORK/cache"
            json=$(DFC_LLVM_PASSES="${PIPELINES[$p]}" DFC_CACHE_DIR="$WORK/cache" \
                "$DFC" bench "$WORK/$model.plan" --json --min-time 1)
            printf '{"round": %s, "pipeline": %s, "model": "%s", "bench": %s}\n' \
                "$round" "$p" "$model" "$json" >>"$WORK/runs.jsonl"
        done
    done
    echo "round $round of $ROUNDS done" >&2
done

python3 - "$WORK/runs.jsonl" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" "${PIPELINES[@]}" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
pipelines = sys.argv[3:]
print(f"CPU:{sys.argv[2]}, {len({r['round'] for r in runs})} rounds, medians")
models = list(dict.fromkeys(r["model"] for r in runs))
print(f"{'pipeline':12} " + " ".join(f"{m + ' load ms':>24} {m + ' step us':>24}" for m in models))
for p, text in enumerate(pipelines):
    cells = []
    for m in models:
        mine = [r["bench"] for r in runs if r["pipeline"] == p and r["model"] == m]
        cells.append(f"{statistics.median(b['load_ms'] for b in mine):24.1f} {statistics.median(b['median_step_us'] for b in mine):24.1f}")
    name = text if len(text) <= 12 else f"hand-picked"
    print(f"{name:12} " + " ".join(cells))
for p, text in enumerate(pipelines):
    if len(text) > 12:
        print(f"hand-picked: {text}")
PY
