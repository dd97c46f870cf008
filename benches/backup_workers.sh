#!/usr/bin/env bash
# Backup workers against a worker that stops (a benchmark, not a test):
#
#   benches/backup_workers.sh [ROUNDS]     (default 3; env EPOCHS, STOP_S, RUN_S, BASE_PORT,
#                                           WORKER_FLAGS: more `dfc worker` flags)
#
# Starts 5 workers on loopback: 4 for the MLP's replicas and a parameter server. Trains the MLP
# on Fashion-MNIST under synchronous ps four ways, in alternating rounds: 3 synchronous replicas
# plus 1 backup (`--backup-workers 1`, the 4 workers) and 3 replicas without one, each healthy
# and with the second worker stopped (SIGSTOP) for STOP_S seconds after every RUN_S seconds of
# running (default 2 and 2). Every replica takes 32 rows a step, and every update averages 3 of
# them (batch 128 over 4 replicas, of which 3 make an update; batch 96 over 3). Prints the median updates per second of each (an update: one step
# of the variables; with backups, `updates_per_sec` of the metrics log, else steps / seconds) and
# their ratios to the healthy runs.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${1:-3}
EPOCHS=${EPOCHS:-1}
STOP_S=${STOP_S:-2}
RUN_S=${RUN_S:-2}
BASE_PORT=${BASE_PORT:-47300}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
pids=()
stopper=
cleanup() {
    [ -n "$stopper" ] && kill "$stopper" 2>/dev/null
    kill -CONT "${pids[@]}" 2>/dev/null || true
    kill "${pids[@]}" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/token"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; worker 1 stopped ${STOP_S} s after every ${RUN_S} s"

addresses=()
for i in $(seq 0 4); do
    port=$((BASE_PORT + 2 * i))
    "$dfc" worker --listen "127.0.0.1:$port" --data-port $((port + 1)) --token-file "$dir/token" \
        --threads 1 ${WORKER_FLAGS:-} >"$dir/worker$i.log" 2>&1 &
    pids+=($!)
    addresses+=("\"127.0.0.1:$port\"")
done
ps_address=${addresses[4]}
echo "{\"cluster\": {\"worker\": [$(IFS=,; echo "${addresses[*]:0:4}")], \"ps\": [$ps_address]}}" >"$dir/backup.json"
echo "{\"cluster\": {\"worker\": [$(IFS=,; echo "${addresses[*]:0:3}")], \"ps\": [$ps_address]}}" >"$dir/plain.json"
sleep 1
"$dfc" compile examples/mlp.df --cluster "$dir/backup.json" --strategy ps --sync --backup-workers 1 -o "$dir/backup.plan" >/dev/null
# The same 32 rows per replica, 96 per update, in both.
"$dfc" compile examples/mlp.df --cluster "$dir/plain.json" --strategy ps --sync --dim batch=96 -o "$dir/plain.plan" >/dev/null

stop_worker_1() {  # in the background: stop worker 1 for STOP_S s after every RUN_S s
    while true; do
        sleep "$RUN_S"
        kill -STOP "${pids[1]}"
        sleep "$STOP_S"
        kill -CONT "${pids[1]}"
    done
}

run() {  # plan, label, stopped (0/1) → appends "label updates/s" to $dir/results
    local plan=$1 label=$2 stopped=$3
    if [ "$stopped" = 1 ]; then
        stop_worker_1 &
        stopper=$!
    fi
    DFC_TOKEN=$(cat "$dir/token") "$dfc" run "$dir/$plan.plan" --cluster "$dir/$plan.json" \
        --feed images="$DATA/train-images-idx3-ubyte.gz" --feed labels="$DATA/train-labels-idx1-ubyte.gz" \
        --epochs "$EPOCHS" --metrics "$dir/$label.jsonl" >/dev/null 2>"$dir/$label.err" || { cat "$dir/$label.err" >&2; exit 1; }
    if [ -n "$stopper" ]; then
        kill "$stopper"
        wait "$stopper" 2>/dev/null || true
        stopper=
        kill -CONT "${pids[1]}"
    fi
    python3 - "$label" "$dir/$label.jsonl" >>"$dir/results" <<'PY'
import json, sys
label, path = sys.argv[1], sys.argv[2]
records = [json.loads(line) for line in open(path)]
seconds = sum(r["seconds"] for r in records)
updates = sum(r.get("updates", 0) for r in records) if "updates" in records[0] else records[-1]["step"]
dropped = sum(r.get("gradients_dropped", 0) for r in records)
print(label, updates / seconds, dropped)
PY
}

for round in $(seq 1 "$ROUNDS"); do
    run backup backup-healthy 0
    run backup backup-stopped 1
    run plain plain-healthy 0
    run plain plain-stopped 1
    echo "round $round: $(tail -4 "$dir/results" | awk '{printf "%s %.1f/s  ", $1, $2}')"
done
python3 - "$dir/results" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
median = {label: statistics.median(float(r[1]) for r in rows if r[0] == label) for label in {r[0] for r in rows}}
dropped = {label: statistics.median(int(r[2]) for r in rows if r[0] == label) for label in median}
for kind, what in [("backup", "3 replicas + 1 backup"), ("plain", "3 replicas, no backup")]:
    healthy, stopped = median[f"{kind}-healthy"], median[f"{kind}-stopped"]
    print(f"{what:>22}: healthy {healthy:6.1f} updates/s, worker 1 stopping {stopped:6.1f} updates/s"
          f" ({stopped / healthy:.2f}x); gradients dropped per run {dropped[f'{kind}-healthy']:.0f} / {dropped[f'{kind}-stopped']:.0f}")
PY
