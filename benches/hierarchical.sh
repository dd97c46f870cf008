#!/usr/bin/env bash
# The hierarchical all-reduce against the flat ring on two hosts of two workers each (a
# benchmark, not a test; needs root for the network namespaces):
#
#   sudo benches/hierarchical.sh        (env ROUNDS=3, SIZES=16,64, RATES="none 10gbit 2gbit")
#
# Two network namespaces joined by a veth pair stand for two hosts; the second has a /dev/shm
# of its own, so that its two workers share memory with each other and not with the first
# host's. All four workers run in TLS (they listen beyond loopback). For each link rate in
# RATES ("none": the veth as it is, as fast as this machine's cores move bytes; else a tc
# token bucket on both ends, a network of that speed), `dfc bench-allreduce --at` runs both
# algorithms ROUNDS times, taking turns; prints the median bus bandwidth of each, their ratio,
# and the bytes that crossed the link per all-reduce (the veth's own counters).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-16,64}
RATES=${RATES:-none 10gbit 2gbit}
cd "$REPO"
cargo build --release -q --bin dfc
dfc=$REPO/target/release/dfc
dir=$(mktemp -d)
# shellcheck source=benches/two_hosts.sh
. "$REPO/benches/two_hosts.sh"
mkdir -p "$dir/shm-b"

# `on HOST CMD...`: CMD in that host's namespace (the second with its own /dev/shm).
# (exec: a worker started with `on ... &` is then the process whose pid is kept, and killed.)
on() {
    local host=$1; shift
    if [ "$host" = a ]; then
        exec ip netns exec "$a" "$@"
    else
        DFC_SHM="$dir/shm-b" exec ip netns exec "$b" sh -c 'mount --bind "$DFC_SHM" /dev/shm && exec "$0" "$@"' "$@"
    fi
}
for host in a b; do
    address=$host_a; [ "$host" = b ] && address=$host_b
    for port in 7000 7002; do
        (on "$host" "$dfc" worker --listen "$address:$port" --data-port $((port + 1)) --tls-dir "$dir/pki/$address" \
            >"$dir/worker-$host-$port.log" 2>&1) &
        pids+=($!)
    done
done
sleep 1
at=$host_a:7000,$host_a:7002,$host_b:7000,$host_b:7002
sent() { echo $(( $(ip netns exec "$a" cat "/sys/class/net/$link_a/statistics/tx_bytes") + $(ip netns exec "$b" cat "/sys/class/net/$link_b/statistics/tx_bytes") )); }

echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; 2 hosts x 2 workers, TLS; sizes $SIZES MiB; $ROUNDS rounds"
for rate in $RATES; do
    shape_link "$rate" 4mb
    : >"$dir/results"
    for round in $(seq "$ROUNDS"); do
        order=(ring hierarchical)
        [ $((round % 2)) -eq 0 ] && order=(hierarchical ring)
        for size in ${SIZES//,/ }; do
            for algorithm in "${order[@]}"; do
                before=$(sent)
                (on a "$dfc" bench-allreduce --at "$at" --tls-dir "$dir/pki/$host_a" --algorithm "$algorithm" \
                    --sizes-mib "$size" --transport shared-memory --iterations 5 --json >"$dir/out.json" 2>/dev/null)
                after=$(sent)
                # 1 untimed and 5 timed all-reduces (the barriers' bytes are few).
                python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
print(json.dumps({"algorithm": r["algorithm"], "mib": r["bytes"] >> 20, "busbw": r["bus_bytes_per_second"],
                  "link_mib": int(sys.argv[2]) / 6 / 2**20, "reported_mib": r["bytes_between_hosts"] / 2**20}))' \
                    "$dir/out.json" "$((after - before))" >>"$dir/results"
            done
        done
    done
    python3 - "$dir/results" "$rate" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"link rate {sys.argv[2]}:")
for mib in sorted({r["mib"] for r in rows}):
    get = lambda a, k: statistics.median(r[k] for r in rows if r["mib"] == mib and r["algorithm"] == a)
    flat, hier = get("ring", "busbw"), get("hierarchical", "busbw")
    print(f"  {mib:4d} MiB: bus bandwidth ring {flat/1e9:.2f} GB/s, hierarchical {hier/1e9:.2f} GB/s "
          f"({hier/flat:.2f}x); between hosts per all-reduce: ring {get('ring', 'reported_mib'):.1f} MiB, "
          f"hierarchical {get('hierarchical', 'reported_mib'):.1f} MiB "
          f"(on the link, framing and TLS included: {get('ring', 'link_mib'):.1f} and {get('hierarchical', 'link_mib'):.1f})")
EOF
done
