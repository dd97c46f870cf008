"""The JAX peer's inference at batch 1: the peer's three models (../shared/bench/README.md),
forward pass jitted and timed per call with the peer's own `common.timeit`, as bench_jax.py
times its batched inference rows. benches/vs_jax.sh runs it with the peer's venv:

    python jax_batch1.py PEER_DIR [--quick] --out FILE

FILE gets {"rows": [...]} in bench_jax.py's row shape, named "jax MODEL inference fwd batch 1
(per call)". The parameters are random, drawn as bench_jax.py draws them (standard normal
× 0.05), and the input standard normal: the time of a forward pass does not depend on them.
"""
import json
import sys

peer_dir = sys.argv[1]
sys.path.insert(0, peer_dir)
from common import flops_cnn, flops_logreg, flops_mlp, report, timeit  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

quick = "--quick" in sys.argv
out = sys.argv[sys.argv.index("--out") + 1]
min_time = 0.5 if quick else 3.0
rng = np.random.default_rng(0)


def g(*shape, scale=0.05):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)


def logreg(p, x):
    return x @ p["W"] + p["b"]


def mlp(p, x):
    h = jax.nn.relu(x @ p["W1"] + p["b1"])
    h = jax.nn.relu(h @ p["W2"] + p["b2"])
    return h @ p["W3"] + p["b3"]


NHWC = ("NHWC", "HWIO", "NHWC")


def pool2(h):
    return lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def cnn(p, x):
    h = pool2(jax.nn.relu(lax.conv_general_dilated(x, p["k1"], (1, 1), "VALID", dimension_numbers=NHWC) + p["c1"]))
    h = pool2(jax.nn.relu(lax.conv_general_dilated(h, p["k2"], (1, 1), "VALID", dimension_numbers=NHWC) + p["c2"]))
    h = jax.nn.relu(h.reshape(h.shape[0], -1) @ p["W1"] + p["b1"])
    return h @ p["W2"] + p["b2"]


MODELS = {
    "logreg": (logreg, lambda: dict(W=g(784, 10), b=g(10)), (1, 784), flops_logreg(1)),
    "mlp": (
        mlp,
        lambda: dict(W1=g(784, 256), b1=g(256), W2=g(256, 256), b2=g(256), W3=g(256, 10), b3=g(10)),
        (1, 784),
        flops_mlp(1),
    ),
    "cnn": (
        cnn,
        lambda: dict(k1=g(3, 3, 1, 32), c1=g(32), k2=g(3, 3, 32, 64), c2=g(64), W1=g(1600, 64), b1=g(64),
                     W2=g(64, 10), b2=g(10)),
        (1, 28, 28, 1),
        flops_cnn(1),
    ),
}

rows = []
for name, (forward, params, shape, flops) in MODELS.items():
    p, x = params(), g(*shape, scale=1.0)
    jitted = jax.jit(forward)
    report(rows, f"jax {name} inference fwd batch 1 (per call)",
           timeit(lambda: jax.block_until_ready(jitted(p, x)), min_time=min_time), flops)
with open(out, "w") as f:
    json.dump(dict(rows=rows), f, indent=1)
print("wrote", out)
