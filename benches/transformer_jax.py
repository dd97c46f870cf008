"""The JAX (XLA CPU) peer of examples/transformer.df: the same decoder-only character model
(2 pre-norm blocks, 4 heads, width 128, context 64, GELU MLP of 512, untied output layer,
softmax cross-entropy over 256 bytes) and the same training step (Adam, beta 0.9/0.999,
epsilon 1e-7, with the learning rate of step 0 of dfc's warm-up schedule), timed per call as
`dfc run` calls its step: median (and p10/p90) of the jitted step on random tokens.

    /tmp/peer/bin/python benches/transformer_jax.py [--steps N] [--json PATH]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax_timing import time_calls

BATCH, CONTEXT, WIDTH, HEADS, VOCAB, LAYERS = 32, 64, 128, 4, 256, 2


def init(rng):
    def normal(*shape, stddev=0.02):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * stddev)

    def dense(k, n):
        return {"w": normal(k, n), "b": jnp.zeros(n, jnp.float32)}

    def norm():
        return {"gamma": jnp.ones(WIDTH, jnp.float32), "beta": jnp.zeros(WIDTH, jnp.float32)}

    blocks = [
        {"norm1": norm(), "q": dense(WIDTH, WIDTH), "k": dense(WIDTH, WIDTH), "v": dense(WIDTH, WIDTH),
         "o": dense(WIDTH, WIDTH), "norm2": norm(), "up": dense(WIDTH, 4 * WIDTH), "down": dense(4 * WIDTH, WIDTH)}
        for _ in range(LAYERS)
    ]
    return {"embedding": normal(VOCAB, WIDTH), "position": normal(CONTEXT, WIDTH, stddev=0.01),
            "blocks": blocks, "norm": norm(), "out": dense(WIDTH, VOCAB)}


def layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["gamma"] + p["beta"]


def dense(p, x):
    return x @ p["w"] + p["b"]


def attention(p, x):
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, HEADS, d // HEADS).transpose(0, 2, 1, 3)
    q, k, v = split(dense(p["q"], x)), split(dense(p["k"], x)), split(dense(p["v"], x))
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    scores = jnp.where(causal, (q @ k.transpose(0, 1, 3, 2)) * (d // HEADS) ** -0.5, -1e9)
    mixed = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    return dense(p["o"], mixed)


def loss_fn(params, text):
    tokens, targets = text[:, :CONTEXT], text[:, 1:]
    x = params["embedding"][tokens] + params["position"]
    for p in params["blocks"]:
        x = x + attention(p, layer_norm(p["norm1"], x))
        x = x + dense(p["down"], jax.nn.gelu(dense(p["up"], layer_norm(p["norm2"], x)), approximate=True))
    logits = dense(params["out"], layer_norm(params["norm"], x))
    return -(jax.nn.one_hot(targets, VOCAB) * jax.nn.log_softmax(logits)).sum(-1).mean()


@jax.jit
def step(params, m, v, t, text, lr=0.003 / 100):
    b1, b2, eps = 0.9, 0.999, 1e-7
    loss, grads = jax.value_and_grad(loss_fn)(params, text)
    t = t + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    params = jax.tree_util.tree_map(lambda w, m, v: w - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, m, v, t, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    params = init(rng)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    m, v, t = zeros, zeros, jnp.float32(0)
    batches = [jnp.asarray(rng.integers(0, VOCAB, (BATCH, CONTEXT + 1)), jnp.int32) for _ in range(4)]
    state = [params, m, v, t]

    def call(i):
        *state[:], loss = step(*state, batches[i % 4])
        return loss

    time_calls(call, 3, args.steps, "transformer train step", args.json)


if __name__ == "__main__":
    main()
