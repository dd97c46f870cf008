#!/usr/bin/env bash
# The transformer's losses, dfc against the JAX peer trained from the same initial values on the
# same batches (benches/transformer_parity.py): `dfc run --steps 0` writes the initial values,
# both train EPOCHS epochs of a fortunes file in its order (`--no-shuffle`) and evaluate on
# another after each epoch; prints both, epoch by epoch, with the relative differences.
#
#   benches/transformer_parity.sh [EPOCHS] [TRAIN_TEXT] [EVAL_TEXT]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
epochs=${1:-8}
train=${2:-/usr/share/games/fortunes/computers}
held_out=${3:-/usr/share/games/fortunes/debian}
if ! /tmp/peer/bin/python -c "import jax, safetensors" 2>/dev/null; then
    python3 -m venv /tmp/peer
    /tmp/peer/bin/pip install -q 'jax[cpu]==0.10.2' 'numpy==2.4.6' 'safetensors==0.8.0'
fi
cargo build --release --locked -q
out=target/transformer-parity
rm -rf "$out" && mkdir -p "$out"
dfc=target/release/dfc
"$dfc" compile examples/transformer.df -o "$out/transformer.plan" >/dev/null
"$dfc" run "$out/transformer.plan" --feed text="text:$train" --steps 0 --checkpoint-dir "$out/initial" >/dev/null
cp -r "$out/initial" "$out/checkpoints"
"$dfc" run "$out/transformer.plan" --feed text="text:$train" --eval-feed text="text:$held_out" --no-shuffle \
    --epochs "$epochs" --checkpoint-dir "$out/checkpoints" --metrics "$out/dfc.jsonl" >/dev/null
(cd benches && /tmp/peer/bin/python transformer_parity.py "../$out/initial/ckpt-00000000.safetensors" \
    "$train" "$held_out" "$epochs") >"$out/jax.json"
python3 - "$out/dfc.jsonl" "$out/jax.json" <<'PY'
import json, sys
dfc = [json.loads(line) for line in open(sys.argv[1])]
jax = json.load(open(sys.argv[2]))
print("epoch  step  train loss: dfc     jax      diff    eval loss: dfc     jax      diff")
for d, j in zip(dfc, jax):
    rel = lambda key: (d[key] - j[key]) / j[key] * 100
    print(f"{d['epoch']:5} {d['step']:5}  {d['train_loss']:17.6f} {j['train_loss']:9.6f} {rel('train_loss'):+8.4f}%"
          f"  {d['eval_loss']:16.6f} {j['eval_loss']:9.6f} {rel('eval_loss'):+8.4f}%")
PY
