#!/usr/bin/env bash
# All-reduces overlapped with the backward pass, over a network (a benchmark, not a test; needs
# root for the network namespaces):
#
#   sudo benches/overlap_network.sh [MODEL...]    (default: mlp cnn; env ROUNDS=5, STEPS=200,
#                                                  RATES="5gbit 2gbit")
#
# Two network namespaces joined by a veth pair stand for two hosts with one worker each, in
# TLS, sending over TCP (`--no-shared-memory`: they are on one machine, and would otherwise
# send through shared memory, not over the link); for each link rate in RATES a tc token
# bucket on both ends makes the veth a network of that speed. Each model is compiled mirrored
# over the two workers three ways, as benches/overlap.sh does (the default plan, the --overlap
# buckets not overlapped, --overlap), and each plan trains STEPS steps of Fashion-MNIST, the
# plans taking turns, ROUNDS times.
# Prints each plan's median step time and the ratios. On one machine (benches/overlap.sh) the
# all-reduce is copying on the cores the backward pass uses; here it waits on a link.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-5}
STEPS=${STEPS:-200}
RATES=${RATES:-5gbit 2gbit}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
MODELS=("${@:-mlp}")
[ $# -eq 0 ] && MODELS=(mlp cnn)
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
# shellcheck source=benches/two_hosts.sh
. "$REPO/benches/two_hosts.sh"
for pair in "$a $host_a" "$b $host_b"; do
    set -- $pair
    ip netns exec "$1" "$dfc" worker --listen "$2:7000" --data-port 7001 --tls-dir "$dir/pki/$2" --threads 1 --no-shared-memory \
        >"$dir/worker-$2.log" 2>&1 &
    pids+=($!)
done
echo "{\"cluster\": {\"worker\": [\"$host_a:7000\", \"$host_b:7000\"]}}" >"$dir/cluster.json"
sleep 1
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; 2 hosts x 1 worker, TLS; $STEPS steps, $ROUNDS rounds"

step_ms() {  # plan → ms per step of one run
    rm -f "$dir/metrics.jsonl"
    ip netns exec "$a" "$dfc" run "$1" --cluster "$dir/cluster.json" --tls-dir "$dir/pki/$host_a" \
        --feed images="$DATA/train-images-idx3-ubyte.gz" --feed labels="$DATA/train-labels-idx1-ubyte.gz" \
        --steps "$STEPS" --metrics "$dir/metrics.jsonl" 2>"$dir/err" >/dev/null || { cat "$dir/err" >&2; exit 1; }
    python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(r["seconds"] / r["step"] * 1e3)' "$dir/metrics.jsonl"
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

for rate in $RATES; do
    shape_link "$rate" 512kb
    for model in "${MODELS[@]}"; do
        common=(--cluster "$dir/cluster.json" --strategy mirrored)
        "$dfc" compile "examples/$model.df" "${common[@]}" -o "$dir/after.plan" 2>/dev/null
        "$dfc" compile "examples/$model.df" "${common[@]}" --fusion-threshold 262144 -o "$dir/buckets.plan" 2>/dev/null
        "$dfc" compile "examples/$model.df" "${common[@]}" --overlap -o "$dir/overlap.plan" 2>/dev/null
        : >"$dir/after"; : >"$dir/buckets"; : >"$dir/overlap"
        for round in $(seq "$ROUNDS"); do
            order=(after buckets overlap)
            [ $((round % 2)) -eq 0 ] && order=(overlap buckets after)
            for plan in "${order[@]}"; do step_ms "$dir/$plan.plan" >>"$dir/$plan"; done
        done
        after=$(median <"$dir/after"); buckets=$(median <"$dir/buckets"); overlap=$(median <"$dir/overlap")
        echo "$model over $rate: median ms/step of $ROUNDS runs"
        printf '  all-reduce after the backward pass (default plan): %7.3f  [%s]\n' "$after" "$(tr '\n' ' ' <"$dir/after")"
        printf '  the --overlap buckets, not overlapped:              %7.3f  [%s]\n' "$buckets" "$(tr '\n' ' ' <"$dir/buckets")"
        printf '  --overlap:                                          %7.3f  [%s]\n' "$overlap" "$(tr '\n' ' ' <"$dir/overlap")"
        python3 -c "import sys; a,b,o=map(float,sys.argv[1:]); print(f'  overlap / default {o/a:.3f}, overlap / same buckets {o/b:.3f}')" "$after" "$buckets" "$overlap"
    done
done
