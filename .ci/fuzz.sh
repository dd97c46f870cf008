#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of every input dfc takes from outside (fuzz/): the front end
# (.df text), plan files (payloads changed with their checksum made right), data files (IDX,
# gzip, npy, CSV, safetensors checkpoints) and a worker's RPCs. Each target runs for
# DFC_FUZZ_SECONDS (default 60) from seeds made here; a crash, a leak past the memory limit or
# a slow input fails the run and leaves the input in fuzz/artifacts/TARGET/ (see
# fuzz/README.md for reproducing it and turning it into a regression test).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${DFC_FUZZ_SECONDS:-60}

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --version 0.13.2
fi
# cargo-fuzz passes flags only a nightly compiler takes; this lets the stable one take them.
export RUSTC_BOOTSTRAP=1
# Without AddressSanitizer (-s none): the targets reach mostly safe Rust, and without it each
# runs several times as many inputs in the time given.
cargo fuzz build --fuzz-dir fuzz -s none

# Seeds: the examples, their plans, one small file of each data format.
corpus=target/fuzz-corpus
rm -rf "$corpus"
mkdir -p "$corpus"/{front_end,plan,feeds,worker}
cp examples/*.df "$corpus/front_end/"
dfc=target/debug/dfc
[ -x "$dfc" ] || cargo build --bin dfc
for source in examples/*.df; do
    name=$(basename "$source" .df)
    # Small batches, so that the plans' steps are quick; wide_and_deep's ps requests set aside.
    "$dfc" compile "$source" --soft-placement --dim batch=4 -o "$corpus/plan/$name.plan" >/dev/null 2>&1 \
        || "$dfc" compile "$source" --soft-placement -o "$corpus/plan/$name.plan" >/dev/null
done
# A plan with replica instances (replicas 2 and 3 stored as copies of replica 1's partition).
"$dfc" compile examples/linear_regression.df --devices 4 --strategy mirrored --dim batch=4 \
    -o "$corpus/plan/linear_regression_mirrored_4.plan" >/dev/null
# The first byte picks the reader (fuzz_targets/feeds.rs).
python3 - "$corpus/feeds" <<'PY'
import gzip, struct, sys
out = sys.argv[1]
idx = bytes([0, 0, 8, 3]) + struct.pack(">III", 2, 2, 2) + bytes(range(8))
header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }".ljust(117) + "\n"
npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + struct.pack("<2f", 1.0, 2.0)
seeds = {"idx": (0, idx), "idx.gz": (1, gzip.compress(idx)), "npy": (2, npy), "csv": (3, b"1,2,3\n4,5,6\n"),
         "labels": (4, bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 1, 9])), "npy-direct": (5, npy), "tsv": (6, b"0.5\t1\n2\t-3e4\n"),
         "text": (8, b"\x05Q: What is a dataflow graph?\nA: A program that waits for its inputs.\n")}
for name, (reader, data) in seeds.items():
    open(f"{out}/{name}", "wb").write(bytes([reader]) + data)
PY

status=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for target in front_end plan feeds worker; do
    echo "fuzzing $target for ${seconds} s"
    # -rss_limit_mb: an input that makes dfc allocate past 2 GiB is a failure, as the issue's
    # bar for data files says; -timeout: one input may take at most 30 s.
    if cargo fuzz run --fuzz-dir fuzz -s none "$target" "$corpus/$target" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=30 -print_final_stats=1 >"$out" 2>&1; then
        grep '^stat::\|^Done' "$out"
    else
        # The failure (a panic's message and backtrace, or libFuzzer's report) and the input.
        grep -m1 -B2 -A40 'panicked\|ERROR: libFuzzer\|==ERROR' "$out" || tail -n 60 "$out"
        echo "error: fuzzing $target found a failing input: $(ls fuzz/artifacts/"$target"/ 2>/dev/null | head -3)" >&2
        status=1
    fi
done
exit "$status"
