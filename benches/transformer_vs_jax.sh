#!/usr/bin/env bash
# The transformer's training step (examples/transformer.df), dfc against the JAX peer
# (benches/transformer_jax.py), side by side: benches/step_vs_jax.sh transformer.
#
#   benches/transformer_vs_jax.sh [STEPS]
exec "$(dirname "${BASH_SOURCE[0]}")/step_vs_jax.sh" transformer "$@"
