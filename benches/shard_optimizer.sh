#!/usr/bin/env bash
# ZeRO stage 1 (`--shard-optimizer`) beside plain mirrored, on spawned workers (a benchmark,
# not a test):
#
#   benches/shard_optimizer.sh [MODEL...]   (default: mlp cnn; env DFC=target/release/dfc,
#                                            WORKERS="2 4", ROUNDS=5, STEPS=300,
#                                            OPTIMIZER="adam(lr = 0.001)")
#
# For each model and worker count: each plan's optimizer state per worker (`dfc inspect
# --json`), the median step time of ROUNDS interleaved runs of STEPS Fashion-MNIST steps each
# with `dfc run --spawn` (the run's training seconds over its steps), sharded / mirrored, and
# the largest difference between the two plans' variables after 30 steps (their checkpoints:
# parameters, and the slots, whole).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DFC=$(realpath "${DFC:-$REPO/target/release/dfc}")
ROUNDS=${ROUNDS:-5}; STEPS=${STEPS:-300}; OPTIMIZER=${OPTIMIZER:-adam(lr = 0.001)}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("$@"); [ $# -eq 0 ] && MODELS=(mlp cnn)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $OPTIMIZER; $STEPS steps, $ROUNDS rounds"

# shellcheck source=benches/spawned_steps.sh
. "$REPO/benches/spawned_steps.sh"

# state_bytes PLAN → the optimizer state of each of its devices, in bytes
state_bytes() {
    "$DFC" inspect --json "$1" | python3 -c 'import json,sys; print(" ".join(str(d["optimizer_state_bytes"]) for d in json.load(sys.stdin)["devices"]))'
}

# checkpoint PLAN DIR: 30 steps on the spawned workers, checkpointed into DIR
checkpoint() {
    "$DFC" run "$1" --spawn "$WORKERS" --feed images="$DATA/train-images-idx3-ubyte.gz" \
        --feed labels="$DATA/train-labels-idx1-ubyte.gz" --steps 30 --no-shuffle --checkpoint-dir "$2" >/dev/null 2>"$dir/err" \
        || { cat "$dir/err" >&2; exit 1; }
}

for model in "${MODELS[@]}"; do
    for WORKERS in ${WORKERS:-2 4}; do
        for side in mirrored sharded; do
            flag=(); [ $side = sharded ] && flag=(--shard-optimizer)
            "$DFC" compile "$REPO/examples/$model.df" --devices "$WORKERS" --strategy mirrored --optimizer "$OPTIMIZER" \
                "${flag[@]}" -o "$dir/$side.plan" 2>/dev/null
            : >"$dir/$side"
        done
        for round in $(seq "$ROUNDS"); do
            order=(mirrored sharded); [ $((round % 2)) -eq 0 ] && order=(sharded mirrored)
            for side in "${order[@]}"; do
                step_ms "$DFC" "$dir/$side.plan" >>"$dir/$side"
            done
        done
        rm -rf "$dir/ck_mirrored" "$dir/ck_sharded"
        checkpoint "$dir/mirrored.plan" "$dir/ck_mirrored"
        checkpoint "$dir/sharded.plan" "$dir/ck_sharded"
        difference=$(python3 - "$dir/ck_mirrored" "$dir/ck_sharded" <<'PY'
import glob, json, struct, sys, array
def load(directory):
    data = open(glob.glob(directory + "/*.safetensors")[0], "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    tensors = {}
    for name, v in header.items():
        if name != "__metadata__":
            values = array.array({"F32": "f", "I64": "q", "I32": "i"}[v["dtype"]])
            values.frombytes(body[v["data_offsets"][0]:v["data_offsets"][1]])
            tensors[name] = values
    return tensors
a, b = load(sys.argv[1]), load(sys.argv[2])
assert sorted(a) == sorted(b), (sorted(a), sorted(b))
# A sharded slot is whole in its checkpoint, flat and padded at the end.
print(max(max((abs(x - y) for x, y in zip(a[k], b[k])), default=0) for k in a))
PY
)
        m=$(median <"$dir/mirrored"); s=$(median <"$dir/sharded")
        printf '%s on %s workers: optimizer state per worker  mirrored %s B  sharded %s B\n' "$model" "$WORKERS" \
            "$(state_bytes "$dir/mirrored.plan" | cut -d' ' -f1)" "$(state_bytes "$dir/sharded.plan" | cut -d' ' -f1)"
        printf '  median ms/step  mirrored %.3f [%s]  sharded %.3f [%s]  sharded/mirrored %s; largest difference after 30 steps %s\n' \
            "$m" "$(tr '\n' ' ' <"$dir/mirrored")" "$s" "$(tr '\n' ' ' <"$dir/sharded")" \
            "$(python3 -c "import sys; print(f'{float(sys.argv[2]) / float(sys.argv[1]):.3f}')" "$m" "$s")" "$difference"
    done
done
