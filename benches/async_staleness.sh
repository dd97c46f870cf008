#!/usr/bin/env bash
# Asynchronous parameter servers with injected staleness (an experiment, not a test):
#
#   benches/async_staleness.sh [EPOCHS]   (default 3; env ROUNDS, DELAYS, LR, BASE_PORT)
#
# Starts 9 workers on loopback, 8 for the MLP's replicas and one parameter server; replica
# worker i waits DELAYS[i] ms before each of its runs (`dfc worker --delay-ms`, default
# "0 0 0 0 4 8 12 16"), so that the slow replicas' gradients come from variables that the
# fast ones have updated many times since. Trains the MLP on Fashion-MNIST with plain SGD at
# LR (default 0.1) three ways, each from the same initial values: synchronous (--sync),
# asynchronous with staleness-aware updates (the default for SGD), and asynchronous at the
# fixed rate (--no-staleness-aware); prints each epoch's test accuracy and the staleness seen.
# ROUNDS (default 1) repeats all three on fresh workers (free-running replicas do not repeat),
# then prints each way's final accuracies, their median, and the median's distance from the
# synchronous run's.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EPOCHS=${1:-3}
read -r -a DELAYS <<<"${DELAYS:-0 0 0 0 4 8 12 16}"
LR=${LR:-0.1}
ROUNDS=${ROUNDS:-1}
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
    python3 - "$name" "$dir/$name.jsonl" "$dir/finals" "$EPOCHS" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
last, r = float("nan"), {"epoch": 0}
for line in open(path):
    r = json.loads(line)
    staleness = ""
    if r.get("staleness_mean") is not None:
        staleness = f"  staleness mean {r['staleness_mean']:.1f}, max {r['staleness_max']}"
    last = r['eval_accuracy']
    print(f"{name:>16} epoch {r['epoch']}: test accuracy {r['eval_accuracy']:.4f}, {r['seconds']:.1f} s{staleness}")
with open(sys.argv[3], "a") as f:
    f.write(f"{name} {last if r['epoch'] == int(sys.argv[4]) else 'nan'}\n")
PY
}

start_workers() {  # the 9 workers of one round: 8 replicas (with their delays) and the ps
    local round=$1
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    pids=()
    workers=()
    for i in $(seq 0 8); do
        port=$((BASE_PORT + 20 * round + 2 * i))
        delay=0
        [ "$i" -lt 8 ] && delay=${DELAYS[$i]:-0}
        "$dfc" worker --listen "127.0.0.1:$port" --data-port $((port + 1)) --token-file "$dir/token" \
            --threads 1 --delay-ms "$delay" >"$dir/worker$round.$i.log" 2>&1 &
        pids+=($!)
        workers+=("\"127.0.0.1:$port\"")
    done
    ps_address=${workers[8]}
    replicas=$(IFS=,; echo "${workers[*]:0:8}")
    echo "{\"cluster\": {\"worker\": [$replicas], \"ps\": [$ps_address]}}" >"$dir/cluster.json"
    sleep 1
}

: >"$dir/finals"
for round in $(seq 1 "$ROUNDS"); do
    [ "$ROUNDS" -gt 1 ] && echo "round $round"
    start_workers "$round"
    train synchronous --sync
    train staleness-aware
    train fixed-rate --no-staleness-aware
done
python3 - "$dir/finals" "$EPOCHS" <<'PY'
import math, statistics, sys
finals = {}
for line in open(sys.argv[1]):
    name, accuracy = line.split()
    finals.setdefault(name, []).append(float(accuracy))
def median(xs):  # a diverged run (NaN) counts as the worst
    return statistics.median([0.0 if math.isnan(x) else x for x in xs])
sync = median(finals["synchronous"])
print(f"test accuracy after epoch {sys.argv[2]}, each round; median; points below synchronous:")
for name, xs in finals.items():
    runs = ", ".join("diverged" if math.isnan(x) else f"{x:.4f}" for x in xs)
    print(f"{name:>16}: {runs}; median {median(xs):.4f}; {100 * (sync - median(xs)):.2f}")
PY
