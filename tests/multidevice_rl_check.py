"""Run as a script with 4 CPU devices (or on GPUs): linear_token_logprobs under every sharding
layout of tests/multidevice_linear_check.py (tokens, vocabulary, both; jit with Auto and
Explicit axes; shard_map with vocab_axis) against the single-device result, with per-token
cotangents on the log-probs and the entropy (labels -100 are out of range: their NaN log-prob
is masked out, so every gradient stays finite). Prints `OK ...` / `FAIL ...`; exits 1 on a FAIL.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.multidevice_rl_check xla
"""
from __future__ import annotations

import sys

import jax.numpy as jnp

import jax_fusedloss as jfl
from tests import multidevice_linear_check as check

CHUNK = check.CHUNK


def cases():
    """name -> (layout, with bias, objective(h, w, b, aux, impl, vocab_axis, reduction))."""

    def logprobs(layout, mode, entropy=True):
        def loss(h, w, b, a, impl, va, red):
            del red  # a sum over this device's tokens either way
            out = jfl.linear_token_logprobs(
                h, w, a[0], bias=b, weight_layout=layout, temperature=0.8 if entropy else 1.0,
                return_entropy=entropy, chunk_size=CHUNK, implementation=impl, vocab_axis=va,
                mode=mode)
            logp, ent = out if entropy else (out, jnp.zeros_like(out))
            return jnp.sum(jnp.where(a[0] >= 0, logp, 0.0) * a[1]) + jnp.sum(ent * a[2])
        return loss

    # "rl_dv_lean_logp": log-probs alone at temperature 1, lean's dH in the forward
    return {"rl_dv_bias_fast": ("dv", True, logprobs("dv", "fast")),
            "rl_vd_lean": ("vd", False, logprobs("vd", "lean")),
            "rl_dv_lean_logp": ("dv", True, logprobs("dv", "lean", entropy=False)),
            "rl_dv_low_precision": ("dv", False, logprobs("dv", "low_precision"))}


if __name__ == "__main__":
    check.cases = cases
    sys.exit(check.main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
