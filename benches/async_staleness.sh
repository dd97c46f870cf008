#!/usr/bin/env bash
# Asynchronous parameter servers with injected staleness (an experiment, not a test):
#
#   benches/async_staleness.sh [EPOCHS]        (default 3; env DELAYS, LR, BASE_PORT)
#
# Starts 9 workers on loopback, 8 for the MLP's replicas and one parameter server; replica
# worker i waits DELAYS[i] ms before each of its runs (`dfc worker --delay-ms`, default
# "0 0 0 0 4 8 12 16"), so that the slow replicas' gradients come from variables that the
# fast ones have updated many times since. Trains the MLP on Fashion-MNIST with plain SGD at
# LR (default 0.2) three ways, each from the same initial values: synchronous (--sync),
# asynchronous with staleness-aware updates (the default for SGD), and asynchronous at the
# fixed rate (--no-staleness-aware); prints each epoch's test accuracy and the staleness seen.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EPOCHS=${1:-3}
read -r -a DELAYS <<<"${DELAYS:-0 0 0 0 4 8 12 16}"
LR=${LR:-0.2}
BASE_PORT=${BASE_PORT:-47100}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$dir"' EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/token"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; replica delays (ms): ${DELAYS[*]}; sgd lr $LR"

workers=()
for i in $(seq 0 8); do
    port=$((BASE_PORT + 2 * i))
    delay=0
    [ "$i" -lt 8 ] && delay=${DELAYS[$i]:-0}
    "$dfc" worker --listen "127.0.0.1:$port" --data-port $((port + 1)) --token-file "$dir/token" \
        --threads 1 --delay-ms "$delay" >"$dir/worker$i.log" 2>&1 &
    pids+=($!)
    workers+=("\"127.0.0.1:$port\"")
done
ps_address=${workers[8]}
replicas=$(IFS=,; echo "${workers[*]:0:8}")
echo "{\"cluster\": {\"worker\": [$replicas], \"ps\": [$ps_address]}}" >"$dir/cluster.json"
sleep 1

train() {  # name, compile flags... → per-epoch accuracy and staleness
    local name=$1; shift
    "$dfc" compile examples/mlp.df --cluster "$dir/cluster.json" --strategy ps "$@" \
        --optimizer "sgd(lr = $LR)" -o "$dir/$name.plan" 2>/dev/null
    DFC_TOKEN=$(cat "$dir/token") "$dfc" run "$dir/$name.plan" --cluster "$dir/cluster.json" \
        --feed images="$DATA/train-images-idx3-ubyte.gz" --feed labels="$DATA/train-labels-idx1-ubyte.gz" \
        --eval-feed images="$DATA/t10k-images-idx3-ubyte.gz" --eval-feed labels="$DATA/t10k-labels-idx1-ubyte.gz" \
        --epochs "$EPOCHS" --metrics "$dir/$name.jsonl" >/dev/null 2>"$dir/$name.err" || {
        # Training at a rate that stale gradients make too large ends in NaN: say so, go on.
        grep -q "became NaN" "$dir/$name.err" || { cat "$dir/$name.err" >&2; exit 1; }
        echo "$(printf '%16s' "$name") diverged: $(grep -o 'the loss of .* NaN' "$dir/$name.err")"
    }
    touch "$dir/$name.jsonl"
    python3 - "$name" "$dir/$name.jsonl" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
for line in open(path):
    r = json.loads(line)
    staleness = ""
    if r.get("staleness_mean") is not None:
        staleness = f"  staleness mean {r['staleness_mean']:.1f}, max {r['staleness_max']}"
    print(f"{name:>16} epoch {r['epoch']}: test accuracy {r['eval_accuracy']:.4f}, {r['seconds']:.1f} s{staleness}")
PY
}
train synchronous --sync
train staleness-aware
train fixed-rate --no-staleness-aware
