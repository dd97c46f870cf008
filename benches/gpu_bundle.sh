#!/usr/bin/env bash
# Packs what the GPU checks need into .gpu/ (git-ignored), for a machine with an NVIDIA GPU
# but no Rust or LLVM (the device tool's): dfc, the GPU test binaries and the bandwidth
# benchmark, built here, stripped, and the shared libraries they load (LLVM 14 and its
# dependencies), each xz-compressed. benches/gpu_check.sh unpacks and runs them there:
#
#   benches/gpu_bundle.sh            # here; then, through the device tool, with carry [".gpu"]:
#   bash benches/gpu_check.sh        # there; results under $OUT
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
BUNDLE=$REPO/.gpu
rm -rf "$BUNDLE" && mkdir -p "$BUNDLE"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

executable() { # the test or bench executable cargo built for $@ (its JSON messages; not the
    # binaries an integration test is built with, which come too)
    cargo "$@" --message-format json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -1
}
cargo build --release --quiet --bin dfc
declare -A binaries=(
    [dfc]=target/release/dfc
    [kernels-test]=$(executable test --release --no-run -p dfc-cuda --test kernels)
    [native-test]=$(executable test --release --no-run -p dfc --test native)
    [bandwidth-bench]=$(executable bench --no-run -p dfc-cuda --bench bandwidth)
)
for name in "${!binaries[@]}"; do
    path=${binaries[$name]}
    [ -x "$path" ] || { echo "gpu_bundle.sh: no executable for $name" >&2; exit 1; }
    strip -o "/tmp/$name" "$path"
    xz -T0 -6 -c "/tmp/$name" > "$BUNDLE/$name.xz"
done
# The shared libraries dfc loads that a bare machine may lack: LLVM 14 and what it needs
# (not the C library's own).
ldd target/release/dfc | awk '/=> \// { print $3 }' | while read -r lib; do
    case $(basename "$lib") in
        libc.so*|libm.so*|libgcc_s.so*|libstdc++.so*|ld-linux*) continue ;;
    esac
    xz -T0 -6 -c "$lib" > "$BUNDLE/lib.$(basename "$lib").xz"
done
du -sh "$BUNDLE"
ls -la "$BUNDLE"
