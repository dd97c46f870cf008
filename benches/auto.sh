#!/usr/bin/env bash
# `--strategy auto` and the placement search on generated branchy models: TOWERS chains of
# DEPTH dense layers (widths 64 to 256) from one input, summed. For each cluster it compiles
# the model with `--strategy auto --report` and prints the predicted step of every candidate,
# of the reference round-robin placement, the searched placement's gain over round-robin and
# over earliest-finish, and the search's rate (placements scored a second) and graph size.
#
#   benches/auto.sh [--towers 16] [--depth 4] [--clusters "devices:8 devices:64 tasks:8 tasks:64"]
#
# devices:N is N devices of one process (--devices N); tasks:N is N worker tasks on N hosts of
# their own (a cluster file). Predictions use the assumed rates (--no-profile): the devices are
# simulated, not this machine's.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOWERS=16
DEPTH=4
CLUSTERS="devices:8 devices:64 tasks:8 tasks:64"
while [ $# -gt 0 ]; do
    case $1 in
        --towers) TOWERS=${2:?--towers needs a number}; shift ;;
        --depth) DEPTH=${2:?--depth needs a number}; shift ;;
        --clusters) CLUSTERS=${2:?--clusters needs a list}; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "auto.sh: unknown argument \`$1\`" >&2; exit 64 ;;
    esac
    shift
done

(cd "$REPO" && cargo build --release --quiet --bin dfc)
DFC=$REPO/target/release/dfc
WORK=$(mktemp -d "${TMPDIR:-/tmp}/auto.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

python3 - "$TOWERS" "$DEPTH" >"$WORK/branchy.df" <<'PY'
import sys
towers, depth = int(sys.argv[1]), int(sys.argv[2])
print("layer dense(x: f32[n, k], units: dim) -> f32[n, units] {")
print("    param w: f32[k, units] = glorot_uniform\n    param b: f32[units] = zeros\n    return x @ w + b\n}\n")
print("model branchy {\n    dim batch = 64\n    input x: f32[batch, 64]\n    input y: f32[batch, 64]")
ends = []
for t in range(towers):
    previous = "x"
    for l in range(depth):
        print(f"    let t{t}_{l} = relu(dense({previous}, units = {64 * (1 + t % 4)}))")
        previous = f"t{t}_{l}"
    print(f"    let e{t} = dense({previous}, units = 64)")
    ends.append(f"e{t}")
print("    let out = " + " + ".join(ends))
print("    let loss = mean((out - y) * (out - y))\n    output out\n    minimize loss with sgd(lr = 0.01)\n}")
PY

echo "CPU:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) cores, dfc $(git -C "$REPO" rev-parse --short HEAD)"
echo "model: $TOWERS towers of $DEPTH dense layers"
for cluster in $CLUSTERS; do
    kind=${cluster%%:*}
    n=${cluster#*:}
    case $kind in
        devices) where=(--devices "$n") ;;
        tasks)
            python3 -c 'import json, sys; n = int(sys.argv[1]); print(json.dumps({"cluster": {"worker": [f"host{i}:2222" for i in range(n)]}}))' \
                "$n" >"$WORK/cluster$n.json"
            where=(--cluster "$WORK/cluster$n.json") ;;
        *) echo "auto.sh: a cluster is devices:N or tasks:N, not \`$cluster\`" >&2; exit 64 ;;
    esac
    echo
    echo "== $cluster"
    "$DFC" compile "$WORK/branchy.df" "${where[@]}" --strategy auto --no-profile --report -o "$WORK/out.plan" \
        >"$WORK/report" 2>"$WORK/stderr" || { cat "$WORK/stderr" >&2; exit 1; }
    sed -n '1,/^placement search/p' "$WORK/report"
    python3 - "$WORK/report" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def ms(label):
    m = re.search(r"^\s+(?:→ )?" + re.escape(label) + r"\s+([\d.]+) (ms|µs|s)\b", text, re.M)
    if not m:
        return None
    return float(m.group(1)) * {"ms": 1.0, "µs": 1e-3, "s": 1e3}[m.group(2)]
searched = ms("model, searched placement")
earliest = ms("model, earliest-finish placement")
round_robin = ms("model, round-robin placement")
chosen = re.search(r"^\s+→ (.+?)\s{2,}([\d.]+) (ms|µs|s)\b", text, re.M)
if searched and round_robin and chosen:
    auto = float(chosen.group(2)) * {"ms": 1.0, "µs": 1e-3, "s": 1e3}[chosen.group(3)]
    print(f"auto's plan ({chosen.group(1)}) vs round-robin: {100 * (1 - auto / round_robin):.1f}% below; "
          f"searched vs round-robin: {100 * (1 - searched / round_robin):.1f}% below, vs earliest-finish: {100 * (1 - searched / earliest):.1f}% below")
PY
done
