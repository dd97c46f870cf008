#!/usr/bin/env bash
# The residual network's training step (examples/resnet.df: 15 batch norms), dfc against the
# JAX peer (benches/resnet_jax.py), side by side: benches/step_vs_jax.sh resnet.
#
#   benches/resnet_vs_jax.sh [STEPS]
exec "$(dirname "${BASH_SOURCE[0]}")/step_vs_jax.sh" resnet "$@"
