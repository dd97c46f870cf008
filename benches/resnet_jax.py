"""The JAX (XLA CPU) peer of examples/resnet.df: the same residual network (a 3×3 stem, three
stages of two residual blocks of 16, 32 and 64 channels, the second and third opening with a
strided block and a 1×1 projection, batch norm after every convolution with Keras's moving
averages, global average pooling, a dense classifier) and the same training step (Adam, beta
0.9/0.999, epsilon 1e-7, at the learning rate of step 0 of the cosine decay), timed per call as
`dfc run` calls its step: median (and p10/p90) of the jitted step on random images.

    /tmp/peer/bin/python benches/resnet_jax.py [--steps N] [--json PATH]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax_timing import time_calls

BATCH, CLASSES = 64, 10
MOMENTUM, EPSILON = 0.99, 1e-3


def init(rng):
    params, state = {}, {}

    def conv_bn(name, c, filters, size=3):
        fan_in = size * size * c
        kernel = rng.standard_normal((size, size, c, filters), dtype=np.float32) * np.sqrt(2.0 / fan_in)
        params[name] = {"kernel": jnp.asarray(kernel), "gamma": jnp.ones(filters), "beta": jnp.zeros(filters)}
        state[name] = {"mean": jnp.zeros(filters), "variance": jnp.ones(filters)}

    conv_bn("stem", 1, 16)
    c = 16
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(2):
            name = f"s{stage}b{block}"
            if stage > 0 and block == 0:
                conv_bn(name + "a", c, filters)
                conv_bn(name + "shortcut", c, filters, size=1)
            else:
                conv_bn(name + "a", c, c)
            conv_bn(name + "b", filters, filters)
            c = filters
    limit = np.sqrt(6.0 / (64 + CLASSES))
    params["dense"] = {"w": jnp.asarray(rng.uniform(-limit, limit, (64, CLASSES)).astype(np.float32)),
                       "b": jnp.zeros(CLASSES)}
    return params, state


def conv_bn(params, state, updates, name, x, stride=1):
    p, s = params[name], state[name]
    y = jax.lax.conv_general_dilated(x, p["kernel"], (stride, stride), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    mean = y.mean((0, 1, 2))
    variance = ((y - mean) ** 2).mean((0, 1, 2))
    updates[name] = {"mean": s["mean"] - (1 - MOMENTUM) * (s["mean"] - mean),
                     "variance": s["variance"] - (1 - MOMENTUM) * (s["variance"] - variance)}
    return (y - mean) * jax.lax.rsqrt(variance + EPSILON) * p["gamma"] + p["beta"]


def loss_fn(params, state, images, labels):
    updates = {}
    cb = lambda name, x, stride=1: conv_bn(params, state, updates, name, x, stride)
    x = (images.astype(jnp.float32) / 255.0).reshape(BATCH, 28, 28, 1)
    x = jax.nn.relu(cb("stem", x))
    for stage in range(3):
        for block in range(2):
            name = f"s{stage}b{block}"
            if stage > 0 and block == 0:
                a = jax.nn.relu(cb(name + "a", x, 2))
                x = jax.nn.relu(cb(name + "shortcut", x, 2) + cb(name + "b", a))
            else:
                a = jax.nn.relu(cb(name + "a", x))
                x = jax.nn.relu(x + cb(name + "b", a))
    logits = x.mean((1, 2)) @ params["dense"]["w"] + params["dense"]["b"]
    loss = -(jax.nn.one_hot(labels, CLASSES) * jax.nn.log_softmax(logits)).sum(-1).mean()
    return loss, updates


@jax.jit
def step(params, state, m, v, t, images, labels, lr=0.002):
    b1, b2, eps = 0.9, 0.999, 1e-7
    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, images, labels)
    t = t + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    params = jax.tree_util.tree_map(lambda w, m, v: w - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, state, m, v, t, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    params, state = init(rng)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    m, v, t = zeros, zeros, jnp.float32(0)
    batches = [(jnp.asarray(rng.integers(0, 256, (BATCH, 28, 28)), jnp.uint8),
                jnp.asarray(rng.integers(0, CLASSES, BATCH), jnp.int32)) for _ in range(4)]
    carried = [params, state, m, v, t]

    def call(i):
        *carried[:], loss = step(*carried, *batches[i % 4])
        return loss

    time_calls(call, 3, args.steps, "resnet train step", args.json)


if __name__ == "__main__":
    main()
