#!/usr/bin/env bash
# Tensor fusion's speed-up on 100 small gradients (a benchmark, not a test):
#
#   benches/tensor_fusion.sh [WORKERS] [RUNS]      (default 2 workers, 3 runs each)
#
# A generated model with 100 parameters of 16 floats, mirrored over WORKERS devices, trained for
# one epoch (100 steps) with `dfc run --spawn WORKERS`, compiled with tensor fusion (the default,
# 64 MiB threshold: one all-reduce per replica per step) and without (--fusion-threshold 0: 100
# all-reduces per replica per step). Prints the median step time of each and the speed-up.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORKERS=${1:-2}
RUNS=${2:-3}
cd "$REPO"
cargo build --release -q
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

python3 - "$dir" <<'PY'
import random, struct, sys
dir = sys.argv[1]
params = 100
terms = " + ".join(f"(x + {i / 100:.2f}) * p{i}" for i in range(params))
decls = "\n".join(f"    param p{i}: f32[16] = zeros" for i in range(params))
open(f"{dir}/model.df", "w").write(f"""model many_small {{
    dim batch = 32
    input x: f32[batch, 16]
    input y: f32[batch]
{decls}
    let s = sum({terms}, axis = 1)
    let loss = mean((s - y) * (s - y))
    minimize loss with sgd(lr = 0.001)
}}
""")
def npy(path, shape, values):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }" % "".join(f"{d}, " for d in shape)
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack(f"<{len(values)}f", *values))
random.seed(1)
n = 3200
npy(f"{dir}/x.npy", (n, 16), [random.uniform(-1, 1) for _ in range(n * 16)])
npy(f"{dir}/y.npy", (n,), [random.uniform(-1, 1) for _ in range(n)])
PY

step_us() {  # plan → median step time (µs) over RUNS one-epoch runs
    local times=()
    for _ in $(seq "$RUNS"); do
        rm -f "$dir/metrics.jsonl"
        "$dfc" run "$1" --spawn "$WORKERS" --feed x="$dir/x.npy" --feed y="$dir/y.npy" \
            --metrics "$dir/metrics.jsonl" 2>"$dir/err" || { cat "$dir/err" >&2; exit 1; }
        times+=("$(python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(r["seconds"] / r["step"] * 1e6)' "$dir/metrics.jsonl")")
    done
    printf '%s\n' "${times[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
}

"$dfc" compile "$dir/model.df" --devices "$WORKERS" --strategy mirrored -o "$dir/fused.plan" >/dev/null
"$dfc" compile "$dir/model.df" --devices "$WORKERS" --strategy mirrored --fusion-threshold 0 -o "$dir/unfused.plan" >/dev/null
unfused=$(step_us "$dir/unfused.plan") || exit 1
fused=$(step_us "$dir/fused.plan") || exit 1
printf '100 gradients of 16 floats, %s workers, median of %s runs of 100 steps:\n' "$WORKERS" "$RUNS"
printf '  unfused (100 all-reduces per step): %8.0f µs/step\n' "$unfused"
printf '  fused   (1 all-reduce per step):     %8.0f µs/step\n' "$fused"
python3 -c "import sys; print(f'  speed-up: {float(sys.argv[1]) / float(sys.argv[2]):.1f}x')" "$unfused" "$fused"
