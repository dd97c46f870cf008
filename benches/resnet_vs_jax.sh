#!/usr/bin/env bash
# The residual network's training step (examples/resnet.df: 15 batch norms), dfc against the JAX
# (XLA CPU) peer (benches/resnet_jax.py: the same model and Adam step), side by side in one run;
# prints both medians and the ratio dfc / JAX. Makes the peer's venv (/tmp/peer) if it cannot
# import jax, as benches/vs_jax.sh does.
#
#   benches/resnet_vs_jax.sh [STEPS]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
steps=${1:-30}
if ! /tmp/peer/bin/python -c "import jax" 2>/dev/null; then
    python3 -m venv /tmp/peer
    /tmp/peer/bin/pip install -q 'jax[cpu]==0.10.2' 'numpy==2.4.6'
fi
cargo build --release --locked -q
out=target/resnet-bench
mkdir -p "$out"
target/release/dfc compile examples/resnet.df -o "$out/resnet.plan" >/dev/null
target/release/dfc bench "$out/resnet.plan" --min-steps "$steps" --max-steps "$steps" --json >"$out/dfc.json"
/tmp/peer/bin/python benches/resnet_jax.py --steps "$steps" --json "$out/jax.json"
python3 - "$out/dfc.json" "$out/jax.json" <<'PY'
import json, sys
dfc = json.load(open(sys.argv[1]))
jax = json.load(open(sys.argv[2]))
dfc_ms = dfc["median_step_us"] / 1000
print(f"resnet train step: dfc {dfc_ms:.1f} ms, jax {jax['median_ms']:.1f} ms, dfc / jax = {dfc_ms / jax['median_ms']:.2f}")
PY
