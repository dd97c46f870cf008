#!/usr/bin/env bash
# Loading a plan, per example: what `dfc run` and `dfc bench` spend between reading the plan
# file and a program ready to run (decoding and validating the plan, generating the partition's
# code or reading it from the code cache, linking it), cold (an empty code cache: the first run
# of a plan on a machine) and cached (every later run), with the JAX peer's first call and XLA
# compile of the mlp training step in the same run.
#
#   benches/load.sh [--runs N] [--no-peer]
#
# The figures are `dfc bench --json`'s `load_ms` (median of N runs, default 5, each a fresh
# process) and the whole `dfc bench` process with one step. The peer's figures come from
# bench_jax.py --quick (PEER_DIR, default ../shared/bench/peers; its venv /tmp/peer, made as
# benches/vs_jax.sh makes it if missing).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEER_DIR=${PEER_DIR:-$REPO/../shared/bench/peers}
RUNS=5
PEER=1
while [ $# -gt 0 ]; do
    case $1 in
        --runs) RUNS=${2:?--runs needs a number}; shift ;;
        --no-peer) PEER=0 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "load.sh: unknown argument \`$1\`" >&2; exit 64 ;;
    esac
    shift
done
say() { printf '== %s\n' "$*" >&2; }

say "cargo build --release"
(cd "$REPO" && cargo build --release --quiet --bin dfc)
DFC=$REPO/target/release/dfc
WORK=$(mktemp -d "${TMPDIR:-/tmp}/load.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
now_ns() { date +%s%N; }

: >"$WORK/runs.jsonl"
for example in softmax_regression linear_regression ridge_regression mlp cnn wide_and_deep; do
    # wide_and_deep's ps requests are set aside on one device.
    "$DFC" compile "$REPO/examples/$example.df" --soft-placement -o "$WORK/$example.plan" 2>/dev/null
    say "$example: $RUNS cold and $RUNS cached loads"
    for _ in $(seq "$RUNS"); do
        rm -rf "$WORK/cache"
        for state in cold cached; do
            t0=$(now_ns)
            json=$(DFC_CACHE_DIR="$WORK/cache" "$DFC" bench "$WORK/$example.plan" --json --warmup 0 --min-time 0 --min-steps 1)
            t1=$(now_ns)
            printf '{"example": "%s", "state": "%s", "process_ms": %s, "bench": %s}\n' \
                "$example" "$state" "$(((t1 - t0) / 1000))e-3" "$json" >>"$WORK/runs.jsonl"
        done
    done
done

PEER_JSON=""
if [ $PEER -eq 1 ]; then
    if ! /tmp/peer/bin/python -c 'import jax' >/dev/null 2>&1; then
        say "installing the peer into /tmp/peer"
        python3 -m venv /tmp/peer && /tmp/peer/bin/pip install -q 'jax[cpu]==0.10.2' 'numpy==2.4.6'
    fi
    say "the peer: bench_jax.py --quick"
    (cd "$PEER_DIR" && /tmp/peer/bin/python bench_jax.py --quick --out "$WORK/jax.json" >&2)
    PEER_JSON=$WORK/jax.json
fi

python3 - "$WORK/runs.jsonl" "$PEER_JSON" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
print(f"CPU:{sys.argv[3]}")
print(f"{'example':20} {'cold load ms':>13} {'cached load ms':>15} {'process ms (cached)':>20}  code")
for example in dict.fromkeys(r["example"] for r in runs):
    mine = [r for r in runs if r["example"] == example]
    cold = statistics.median(r["bench"]["load_ms"] for r in mine if r["state"] == "cold")
    cached = statistics.median(r["bench"]["load_ms"] for r in mine if r["state"] == "cached")
    process = statistics.median(r["process_ms"] for r in mine if r["state"] == "cached")
    origins = sorted({r["bench"]["code"] for r in mine})
    print(f"{example:20} {cold:13.1f} {cached:15.1f} {process:20.1f}  {'/'.join(origins)}")
if sys.argv[2]:
    compile_info = json.load(open(sys.argv[2]))["compile"]
    mlp_cold = statistics.median(r["bench"]["load_ms"] for r in runs if r["example"] == "mlp" and r["state"] == "cold")
    mlp_cached = statistics.median(r["bench"]["load_ms"] for r in runs if r["example"] == "mlp" and r["state"] == "cached")
    first, xla = compile_info["mlp_train_first_call_ms"], compile_info["mlp_train_xla_compile_ms"]
    print(f"peer (JAX) mlp train step: first call {first:.1f} ms, XLA compile {xla:.1f} ms")
    print(f"mlp: dfc cold load / JAX first call = {mlp_cold / first:.2f}; dfc cached load / JAX first call = {mlp_cached / first:.3f}")
PY
