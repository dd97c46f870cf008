"""Trains the JAX peer of examples/transformer.df (benches/transformer_jax.py's model and Adam
step) from dfc's initial values, on dfc's batches, for comparing losses with `dfc run`:

- the initial values: the checkpoint `dfc run --steps 0 --checkpoint-dir DIR` writes (safetensors);
- the batches: a text file's bytes in windows of 65 overlapping by one, 32 windows a batch in the
  file's order, the last partial batch dropped (`dfc run --no-shuffle`);
- the learning rate: the example's warmup(cosine_decay(0.003, 2000, alpha 0.1), 100 steps).

Prints, as JSON, each epoch's mean training loss and the loss on the evaluation text after it,
as `dfc run --metrics` records them.

    /tmp/peer/bin/python benches/transformer_parity.py CHECKPOINT TRAIN_TEXT EVAL_TEXT EPOCHS
"""
import json
import math
import sys

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from transformer_jax import BATCH, CONTEXT, LAYERS, loss_fn, step

import jax


def params_from(checkpoint):
    """dfc's variables, named as examples/transformer.df names them, in the peer's tree."""
    c = {name: jnp.asarray(value) for name, value in load_file(checkpoint).items()}
    dense = lambda scope: {"w": c[f"{scope}/w"], "b": c[f"{scope}/bias"]}
    norm = lambda scope: {"gamma": c[f"{scope}/gamma"], "beta": c[f"{scope}/beta"]}
    blocks = [
        {"norm1": norm(f"h{i}/a/norm"), "q": dense(f"h{i}/a/attention/q"), "k": dense(f"h{i}/a/attention/k"),
         "v": dense(f"h{i}/a/attention/v"), "o": dense(f"h{i}/a/attention/dense"), "norm2": norm(f"h{i}/norm"),
         "up": dense(f"h{i}/dense"), "down": dense(f"h{i}/dense_1")}
        for i in range(1, LAYERS + 1)
    ]
    return {"embedding": c["embedding"], "position": c["position"], "blocks": blocks,
            "norm": norm("logits/norm"), "out": dense("logits/dense")}


def batches(path):
    text = np.frombuffer(open(path, "rb").read(), dtype=np.uint8).astype(np.int32)
    windows = (len(text) - 1) // CONTEXT
    examples = np.stack([text[e * CONTEXT:e * CONTEXT + CONTEXT + 1] for e in range(windows)])
    return [jnp.asarray(examples[b * BATCH:(b + 1) * BATCH]) for b in range(windows // BATCH)]


def learning_rate(step):
    cosine = lambda s: 0.003 * ((1 - 0.1) * 0.5 * (1 + math.cos(math.pi * min(s, 2000) / 2000)) + 0.1)
    return cosine(0) * (step + 1) / 100 if step < 100 else cosine(step - 100)


def main():
    checkpoint, train_text, eval_text, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    params = params_from(checkpoint)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    m, v, t = zeros, zeros, jnp.float32(0)
    train, held_out = batches(train_text), batches(eval_text)
    evaluate = jax.jit(loss_fn)
    records, n = [], 0
    for epoch in range(1, epochs + 1):
        losses = []
        for text in train:
            params, m, v, t, loss = step(params, m, v, t, text, jnp.float32(learning_rate(n)))
            losses.append(float(loss))
            n += 1
        eval_loss = float(np.mean([float(evaluate(params, text)) for text in held_out]))
        records.append({"epoch": epoch, "step": n, "train_loss": float(np.mean(losses)), "eval_loss": eval_loss})
    print(json.dumps(records))


if __name__ == "__main__":
    main()
