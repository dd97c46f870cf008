"""What the JAX peers of single models (transformer_jax.py, resnet_jax.py) share: timing a
jitted training step per call, as `dfc run` calls its step, and reporting it."""
import json
import time

import numpy as np


def time_calls(call, warmup, steps, what, json_path=None):
    """Runs `call(i)` (one step; it returns an array to wait on) `warmup` times untimed, then
    `steps` times timed; prints the median, p10 and p90 and, with `json_path`, writes them."""
    for i in range(warmup):
        call(i).block_until_ready()
    times = []
    for i in range(steps):
        start = time.perf_counter()
        call(warmup + i).block_until_ready()
        times.append(time.perf_counter() - start)
    ms = np.percentile(np.array(times) * 1e3, [10, 50, 90])
    print(f"jax {what} (per call): median {ms[1]:.1f} ms (p10 {ms[0]:.1f}, p90 {ms[2]:.1f}), n={len(times)}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"median_ms": ms[1], "p10_ms": ms[0], "p90_ms": ms[2], "steps": len(times)}, f)
