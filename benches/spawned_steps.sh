# Sourced by the benchmarks that time training steps on spawned workers (benches/overlap.sh,
# benches/spawned_ab.sh). Needs $dir (scratch), $WORKERS, $STEPS and $DATA (Fashion-MNIST).

# step_ms DFC PLAN → the step time of one run of PLAN with DFC, in ms (the run's training
# seconds over its steps, from its metrics).
step_ms() {
    rm -f "$dir/metrics.jsonl"
    "$1" run "$2" --spawn "$WORKERS" --feed images="$DATA/train-images-idx3-ubyte.gz" \
        --feed labels="$DATA/train-labels-idx1-ubyte.gz" --steps "$STEPS" \
        --metrics "$dir/metrics.jsonl" 2>"$dir/err" >/dev/null || { cat "$dir/err" >&2; exit 1; }
    python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(r["seconds"] / r["step"] * 1e3)' "$dir/metrics.jsonl"
}

# median < numbers, one a line → their median
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
