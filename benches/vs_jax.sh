#!/usr/bin/env bash
# dfc against the JAX (XLA CPU) peer, side by side on this machine, in one run.
#
#   benches/vs_jax.sh [--quick] [--rounds N] [--backend llvm|interp] [--isa native|avx2] [--out PATH] [--strict]
#
# 1. the peer's venv (/tmp/peer: jax[cpu] 0.10.2, numpy 2.4.6), made if it cannot import jax;
# 2. cargo build --release;
# 3. dfc compile of the three standard models (softmax_regression = the peer's logreg, mlp,
#    cnn), timing the mlp compile (median of 5 runs of the whole `dfc compile` process);
# 4. dfc bench --json of each model, training step and inference, and inference at batch 1
#    (the same models compiled with --dim batch=1);
# 5. the peer's bench_jax.py, right after, and benches/jax_batch1.py (its batch-1 inference);
#    4 and 5 again, --rounds times in all (default 3), alternating: each round's ratios pair
#    figures taken a minute apart, so that a slow spell of the machine (they last seconds to
#    minutes here) lands on both sides of some round rather than on one side of the run;
# 6. the FMA peak program (fma_peak.c), before and after 4-5: the best figure on all the CPUs, of
#    either width (on Zen 4 the 256-bit loop is as fast; on a CPU without AVX-512, the program
#    runs without its 512-bit loop);
#    the time the hypervisor stole from this VM is read from /proc/stat around each side of each
#    round, and the round trip of a cache line between CPUs 0 and 1 (benches/round_trip.c) is
#    timed before and after each side (vs_jax.py reports both: a side with stolen time, or with a
#    round trip of hundreds of ns, timed a slower machine);
# 7. benches/vs_jax.py: the table of ratios and bars, and everything as JSON at --out
#    (default target/vs_jax.json).
#
# --quick: shorter timing on both sides (bench_jax.py --quick; dfc bench --min-time 0.5).
# --rounds N: how many alternating rounds of 4 and 5 (1 to 9; default 3).
# --strict: exit 2 if a bar is not met (otherwise only a failure to run is an error).
# --isa avx2: both sides limited to AVX2 + FMA on a CPU that has more (a stand-in for a CPU without
#   AVX-512): each side's processes see a CPU without AVX-512 and AMX (benches/avx2_only.c, loaded
#   with LD_PRELOAD, hides them from CPUID; it needs the kernel's CPUID faulting, cpuid_fault in
#   /proc/cpuinfo), so that dfc's kernels and generated code, and XLA's code and the YNNPACK
#   kernels of its matrix products, pick what they would pick on such a CPU; XLA_FLAGS also gets
#   --xla_cpu_max_isa=AVX2, and fma_peak is built without its 512-bit loop. On a CPU without
#   AVX-512, --isa avx2 changes nothing but the table's title.
#   The default, native: each side uses what the CPU has.
# PEER_DIR: where bench_jax.py, common.py and fma_peak.c are [default: ../shared/bench/peers
# relative to the repository root].
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEER_DIR=${PEER_DIR:-$REPO/../shared/bench/peers}
PEER_VENV=/tmp/peer
PEER_LOG=/tmp/peer_install.log
QUICK=0
BACKEND=llvm
OUT=$REPO/target/vs_jax.json
STRICT=()
ROUNDS=3
ISA=native

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
while [ $# -gt 0 ]; do
    case $1 in
        --quick) QUICK=1 ;;
        --backend) BACKEND=${2:?--backend needs llvm or interp}; shift ;;
        --backend=*) BACKEND=${1#--backend=} ;;
        --out) OUT=${2:?--out needs a path}; shift ;;
        --out=*) OUT=${1#--out=} ;;
        --rounds) ROUNDS=${2:?--rounds needs a count}; shift ;;
        --rounds=*) ROUNDS=${1#--rounds=} ;;
        --strict) STRICT=(--strict) ;;
        --isa) ISA=${2:?--isa needs native or avx2}; shift ;;
        --isa=*) ISA=${1#--isa=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "vs_jax.sh: unknown argument \`$1\`" >&2; usage >&2; exit 64 ;;
    esac
    shift
done
case $BACKEND in llvm|interp) ;; *) echo "vs_jax.sh: --backend is llvm or interp, not \`$BACKEND\`" >&2; exit 64 ;; esac
case $ROUNDS in [1-9]) ;; *) echo "vs_jax.sh: --rounds is a count from 1 to 9, not \`$ROUNDS\`" >&2; exit 64 ;; esac
case $ISA in
    native)
        if [ "${DFC_GEMM:-}" = avx2 ]; then
            echo "vs_jax.sh: DFC_GEMM=avx2 limits dfc alone, and the FMA peak is the CPU's widest;" \
                "--isa avx2 limits both sides and reads the 256-bit peak" >&2
        fi
        ;;
    avx2)
        grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo ||
            { echo "vs_jax.sh: --isa avx2 needs a CPU with AVX2 and FMA; this one lacks them" >&2; exit 1; }
        if [ -n "${DFC_GEMM:-}" ]; then
            echo "vs_jax.sh: --isa avx2 limits what both sides see of the CPU; unset DFC_GEMM=$DFC_GEMM" >&2
            exit 64
        fi
        if grep -qw avx512f /proc/cpuinfo && ! grep -qw cpuid_fault /proc/cpuinfo; then
            echo "vs_jax.sh: --isa avx2 hides AVX-512 from both sides through CPUID faulting, which this" \
                "CPU or kernel lacks (no cpuid_fault in /proc/cpuinfo); XLA_FLAGS alone would leave the" \
                "peer's matrix products on AVX-512" >&2
            exit 1
        fi
        export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_cpu_max_isa=AVX2"
        ;;
    *) echo "vs_jax.sh: --isa is native or avx2, not \`$ISA\`" >&2; exit 64 ;;
esac
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
for f in bench_jax.py common.py fma_peak.c; do
    [ -f "$PEER_DIR/$f" ] || { echo "vs_jax.sh: no $f in PEER_DIR=$PEER_DIR" >&2; exit 1; }
done
PEER_DIR=$(cd "$PEER_DIR" && pwd)
say() { printf '== %s\n' "$*" >&2; }

# --- 1. the peer's venv ---------------------------------------------------------------------
peer_ready() { "$PEER_VENV/bin/python" -c 'import jax, numpy' >/dev/null 2>&1; }
if ! peer_ready; then
    # An install started elsewhere (its pip runs from the venv): wait for it, not a second one.
    waited=0
    while pgrep -f "$PEER_VENV/bin/(pip|python)" >/dev/null 2>&1 && ! peer_ready; do
        [ $waited -eq 0 ] && say "waiting for the peer install in progress ($PEER_LOG)"
        sleep 5
        waited=$((waited + 5))
        [ $waited -lt 1800 ] || { echo "vs_jax.sh: the peer install has run 30 minutes; see $PEER_LOG" >&2; exit 1; }
    done
fi
if ! peer_ready; then
    say "installing the peer into $PEER_VENV (log: $PEER_LOG)"
    {
        python3 -m venv "$PEER_VENV" &&
            "$PEER_VENV/bin/pip" install -q 'jax[cpu]==0.10.2' 'numpy==2.4.6' &&
            echo done
    } >"$PEER_LOG" 2>&1 || { echo "vs_jax.sh: the peer install failed; see $PEER_LOG" >&2; exit 1; }
    peer_ready || { echo "vs_jax.sh: $PEER_VENV cannot import jax after installing; see $PEER_LOG" >&2; exit 1; }
fi

# --- 2. build -------------------------------------------------------------------------------
say "cargo build --release"
(cd "$REPO" && cargo build --release --quiet --bin dfc)
DFC=$REPO/target/release/dfc

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vs_jax.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# Under --isa avx2 on a CPU with AVX-512, every timed or compiling process of either side runs as
# "${AS_CPU[@]}" COMMAND: with AVX-512 hidden from it (the library checks that it took).
AS_CPU=()
if [ "$ISA" = avx2 ] && grep -qw avx512f /proc/cpuinfo; then
    gcc -O2 -shared -fPIC "$REPO/benches/avx2_only.c" -o "$WORK/avx2_only.so"
    AS_CPU=(env "LD_PRELOAD=$WORK/avx2_only.so")
    "${AS_CPU[@]}" true || { echo "vs_jax.sh: AVX-512 could not be hidden from the benchmarks" >&2; exit 1; }
fi

# --- 3. compile, timing mlp -----------------------------------------------------------------
# The peer's names: logreg is examples/softmax_regression.df.
MODELS=(logreg:softmax_regression mlp:mlp cnn:cnn)
now_ns() { date +%s%N; }
for pair in "${MODELS[@]}"; do
    peer=${pair%%:*} example=${pair#*:}
    "${AS_CPU[@]}" "$DFC" compile "$REPO/examples/$example.df" -o "$WORK/$peer.plan" 2>/dev/null ||
        { "${AS_CPU[@]}" "$DFC" compile "$REPO/examples/$example.df" -o "$WORK/$peer.plan"; exit 1; }
    "${AS_CPU[@]}" "$DFC" compile "$REPO/examples/$example.df" --dim batch=1 -o "$WORK/${peer}_batch1.plan" 2>/dev/null ||
        { "${AS_CPU[@]}" "$DFC" compile "$REPO/examples/$example.df" --dim batch=1 -o "$WORK/${peer}_batch1.plan"; exit 1; }
done
say "timing dfc compile examples/mlp.df (5 runs)"
: >"$WORK/compile_ms.txt"
for _ in 1 2 3 4 5; do
    t0=$(now_ns)
    "${AS_CPU[@]}" "$DFC" compile "$REPO/examples/mlp.df" -o "$WORK/mlp-timed.plan" 2>/dev/null
    t1=$(now_ns)
    echo "$(((t1 - t0) / 1000))" >>"$WORK/compile_ms.txt" # microseconds; vs_jax.py converts
done

# --- 6a. FMA peak, a first time: the peak is the machine's, so vs_jax.py takes the better of
# two runs (before and after the benchmarks), one of which other load may have slowed.
if [ "$ISA" = native ] && grep -qw avx512f /proc/cpuinfo; then
    gcc -O2 -mavx512f -mfma -fopenmp "$PEER_DIR/fma_peak.c" -o "$WORK/fma_peak"
else
    # No AVX-512 here (or --isa avx2): the 512-bit loop would stop the program at its first
    # instruction, before its 256-bit lines are out. Build the peer's program without it, for AVX2 + FMA.
    sed -e '/^static double run512/,/^}/d' -e 's/w<=512/w<=256/' \
        -e 's/(w==512)? run512(iters): run256(iters)/run256(iters)/' \
        "$PEER_DIR/fma_peak.c" >"$WORK/fma_peak_avx2.c"
    gcc -O2 -mavx2 -mfma -fopenmp "$WORK/fma_peak_avx2.c" -o "$WORK/fma_peak"
fi
# The round trip between CPUs 0 and 1, in ns (none on one CPU): timed before and after each side.
gcc -O2 -pthread "$REPO/benches/round_trip.c" -o "$WORK/round_trip"
# round_trip FILE…: one timing, appended to each FILE.
round_trip() {
    [ "$(nproc)" -ge 2 ] || return 0
    local ns
    if ns=$(timeout 20 "$WORK/round_trip"); then
        for file in "$@"; do echo "$ns" >>"$file"; done
    else
        echo "round_trip failed" >&2
    fi
}
# How many CPUs other work keeps busy (over 2 s, while this script waits): timings are only
# comparable on an otherwise idle machine.
cpu_jiffies() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9; exit }' /proc/stat; }
read -r busy0 total0 < <(cpu_jiffies)
sleep 2
read -r busy1 total1 < <(cpu_jiffies)
BUSY=$(awk -v b=$((busy1 - busy0)) -v t=$((total1 - total0)) -v n="$(nproc)" 'BEGIN { printf "%.2f\n", (t > 0 ? n * b / t : 0) }')
say "CPUs busy with other work before timing: $BUSY of $(nproc)"
echo "$BUSY" >"$WORK/busy_before.txt"
say "FMA peak (fma_peak.c), before"
"$WORK/fma_peak" | tee "$WORK/fma.txt" >&2

# --- 4 and 5, alternating rounds: dfc bench, then the JAX peer right after -------------------
BENCH_ARGS=(--json --backend "$BACKEND")
[ $QUICK -eq 1 ] && BENCH_ARGS+=(--min-time 0.5)
JAX_QUICK=()
[ $QUICK -eq 1 ] && JAX_QUICK=(--quick)
for round in $(seq "$ROUNDS"); do
    R=$WORK/round$round
    mkdir -p "$R"
    round_trip "$R/round_trip_dfc.txt"
    head -1 /proc/stat >"$R/stat_dfc.txt"
    for pair in "${MODELS[@]}"; do
        peer=${pair%%:*}
        for mode in train inference; do
            extra=()
            [ $mode = inference ] && extra=(--inference)
            say "round $round/$ROUNDS: dfc bench $peer $mode ($BACKEND)"
            "${AS_CPU[@]}" "$DFC" bench "$WORK/$peer.plan" "${BENCH_ARGS[@]}" "${extra[@]}" >"$R/dfc_${peer}_${mode}.json"
            cat "$R/dfc_${peer}_${mode}.json" >&2
        done
        say "round $round/$ROUNDS: dfc bench $peer inference at batch 1 ($BACKEND)"
        "${AS_CPU[@]}" "$DFC" bench "$WORK/${peer}_batch1.plan" "${BENCH_ARGS[@]}" --inference >"$R/dfc_${peer}_batch1.json"
        cat "$R/dfc_${peer}_batch1.json" >&2
    done
    # The end of dfc's side is the start of the peer's.
    head -1 /proc/stat | tee -a "$R/stat_dfc.txt" >"$R/stat_jax.txt"
    round_trip "$R/round_trip_dfc.txt" "$R/round_trip_jax.txt"
    say "round $round/$ROUNDS: JAX peer: bench_jax.py --out $R/jax.json ${JAX_QUICK[*]}"
    (cd "$PEER_DIR" && "${AS_CPU[@]}" "$PEER_VENV/bin/python" bench_jax.py --out "$R/jax.json" "${JAX_QUICK[@]}") | tee "$R/jax.log" >&2
    say "round $round/$ROUNDS: JAX peer: jax_batch1.py --out $R/jax_batch1.json ${JAX_QUICK[*]}"
    "${AS_CPU[@]}" "$PEER_VENV/bin/python" "$REPO/benches/jax_batch1.py" "$PEER_DIR" --out "$R/jax_batch1.json" "${JAX_QUICK[@]}" |
        tee -a "$R/jax.log" >&2
    head -1 /proc/stat >>"$R/stat_jax.txt"
    round_trip "$R/round_trip_jax.txt"
done

# --- 6b. FMA peak, again ---------------------------------------------------------------------
say "FMA peak (fma_peak.c), after"
"$WORK/fma_peak" | tee -a "$WORK/fma.txt" >&2

# --- 7. the table ---------------------------------------------------------------------------
mkdir -p "$(dirname "$OUT")"
python3 "$REPO/benches/vs_jax.py" --work "$WORK" --backend "$BACKEND" --isa "$ISA" --quick "$QUICK" --out "$OUT" "${STRICT[@]}"
