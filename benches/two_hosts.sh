# Sourced by the benchmarks that stand two hosts up on one machine (benches/hierarchical.sh,
# benches/overlap_network.sh): two network namespaces joined by a veth pair. Needs root, $dfc
# (a dfc binary) and $dir (scratch, removed on exit). Sets a and b (the namespaces), link_a and
# link_b (their ends of the veth), host_a and host_b (their addresses); makes TLS files for both
# hosts under $dir/pki and a random DFC_TOKEN. On exit it kills the processes in `pids` and
# removes the namespaces.
[ "$(id -u)" -eq 0 ] || { echo "error: network namespaces need root" >&2; exit 1; }
id=$$
a=dfc-bench-a-$id; b=dfc-bench-b-$id
link_a=dba$((id % 100000)); link_b=dbb$((id % 100000))
subnet=10.232.$((id % 250))
host_a=$subnet.1; host_b=$subnet.2
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    ip netns del "$a" 2>/dev/null || true
    ip netns del "$b" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
ip netns add "$a"; ip netns add "$b"
ip link add "$link_a" netns "$a" type veth peer name "$link_b" netns "$b"
ip -n "$a" addr add "$host_a/24" dev "$link_a"; ip -n "$b" addr add "$host_b/24" dev "$link_b"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "$link_a" up; ip -n "$b" link set "$link_b" up
"$dfc" certs --out "$dir/pki" "$host_a" "$host_b" >/dev/null 2>&1
export DFC_TOKEN
DFC_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')

# shape_link RATE BURST: a tc token bucket of RATE on both ends of the veth ("none": none).
shape_link() {
    local rate=$1 burst=$2 pair
    for pair in "$a $link_a" "$b $link_b"; do
        set -- $pair
        tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
        [ "$rate" = none ] || tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst "$burst" latency 50ms
    done
}
