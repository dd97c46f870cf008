#!/usr/bin/env bash
# How `dfc compile` grows with the model and the devices: generated MLPs of N dense layers of
# width 64 with ReLU (batch 64, SGD; about 19 IR nodes per layer after autodiff and the
# optimizer), compiled single, and on 8 and 64 devices under the model and mirrored strategies.
# Each case is one `dfc compile --timings` process: its total time, its peak resident memory,
# and its largest stage. A case that runs past the limit is reported as such and not retried.
#
#   benches/compile.sh [--layers "100 1000 10000"] [--devices "1 8 64"] [--limit SECONDS]
#
# Defaults: layers 100 1000 10000, devices 1 8 64, limit 120 s per case.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LAYERS="100 1000 10000"
DEVICES="1 8 64"
LIMIT=120
while [ $# -gt 0 ]; do
    case $1 in
        --layers) LAYERS=${2:?--layers needs a list}; shift ;;
        --devices) DEVICES=${2:?--devices needs a list}; shift ;;
        --limit) LIMIT=${2:?--limit needs seconds}; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "compile.sh: unknown argument \`$1\`" >&2; exit 64 ;;
    esac
    shift
done

(cd "$REPO" && cargo build --release --quiet --bin dfc)
DFC=${DFC:-$REPO/target/release/dfc}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/compile.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

model() {
    local layers=$1
    printf 'layer dense(x: f32[n, k], units: dim) -> f32[n, units] {\n'
    printf '    param w: f32[k, units] = glorot_uniform\n    param b: f32[units] = zeros\n'
    printf '    return x @ w + b\n}\n\nmodel deep {\n    dim batch = 64\n'
    printf '    input x: f32[batch, 64]\n    input y: f32[batch, 64]\n    let h0 = x\n'
    for l in $(seq "$layers"); do
        printf '    let h%d = relu(dense(h%d, units = 64))\n' "$l" $((l - 1))
    done
    printf '    let loss = mean((h%d - y) * (h%d - y))\n    output h%d\n' "$layers" "$layers" "$layers"
    printf '    minimize loss with sgd(lr = 0.01)\n}\n'
}

echo "CPU:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) cores, dfc $(git -C "$REPO" rev-parse --short HEAD)"
printf '%8s %10s %8s %10s %10s  %s\n' layers strategy devices "time s" "peak MiB" "largest stage"
for layers in $LAYERS; do
    model "$layers" >"$WORK/deep$layers.df"
    for devices in $DEVICES; do
        if [ "$devices" = 1 ]; then strategies=single; else strategies="model mirrored"; fi
        for strategy in $strategies; do
            args=()
            [ "$strategy" = single ] || args=(--devices "$devices" --strategy "$strategy")
            if timeout "$LIMIT" "$DFC" compile "$WORK/deep$layers.df" "${args[@]}" --timings \
                -o "$WORK/out.plan" 2>"$WORK/timings" >/dev/null; then
                python3 - "$WORK/timings" "$layers" "$strategy" "$devices" <<'PY'
import re, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("time:")]
stages = [(float(l.split()[1]), l.rstrip().rsplit("  ", 1)[1]) for l in lines[:-1]]
total = re.match(r"time:\s+([\d.]+) s\s+peak rss:\s+(\S+) MiB", lines[-1])
seconds, stage = max(stages)
print(f"{sys.argv[2]:>8} {sys.argv[3]:>10} {sys.argv[4]:>8} {float(total.group(1)):>10.2f} {total.group(2):>10}  {stage} ({seconds:.2f} s)")
PY
            else
                printf '%8s %10s %8s %10s %10s  %s\n' "$layers" "$strategy" "$devices" "> $LIMIT" "-" "stopped at the limit (or failed)"
            fi
        done
    done
done
