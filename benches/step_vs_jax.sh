#!/usr/bin/env bash
# One example's training step, dfc against its JAX (XLA CPU) peer (benches/MODEL_jax.py: the same
# model and Adam step), side by side in one run; prints both medians and the ratio dfc / JAX.
# Makes the peer's venv (/tmp/peer) if it cannot import jax, as benches/vs_jax.sh does.
#
#   benches/step_vs_jax.sh MODEL [STEPS]      (MODEL: transformer or resnet)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
model=${1:?usage: benches/step_vs_jax.sh MODEL [STEPS]}
steps=${2:-30}
[ -f "benches/${model}_jax.py" ] || { echo "no JAX peer benches/${model}_jax.py" >&2; exit 2; }
if ! /tmp/peer/bin/python -c "import jax" 2>/dev/null; then
    python3 -m venv /tmp/peer
    /tmp/peer/bin/pip install -q 'jax[cpu]==0.10.2' 'numpy==2.4.6'
fi
cargo build --release --locked -q
out=target/$model-bench
mkdir -p "$out"
target/release/dfc compile "examples/$model.df" -o "$out/$model.plan" >/dev/null
target/release/dfc bench "$out/$model.plan" --min-steps "$steps" --max-steps "$steps" --json >"$out/dfc.json"
/tmp/peer/bin/python "benches/${model}_jax.py" --steps "$steps" --json "$out/jax.json"
python3 - "$model" "$out/dfc.json" "$out/jax.json" <<'PY'
import json, sys
model = sys.argv[1]
dfc = json.load(open(sys.argv[2]))
jax = json.load(open(sys.argv[3]))
dfc_ms = dfc["median_step_us"] / 1000
print(f"{model} train step: dfc {dfc_ms:.1f} ms, jax {jax['median_ms']:.1f} ms, dfc / jax = {dfc_ms / jax['median_ms']:.2f}")
PY
