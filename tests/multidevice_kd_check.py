"""Run as a script with 4 CPU devices (or on GPUs): linear_kd_loss / linear_distill_loss under
the sharding layouts of tests/multidevice_linear_check.py (tokens, vocabulary, both,
replicated; jit with Auto and Explicit axes; shard_map with vocab_axis), against the
single-device result, with the same checks (values, gradients, their shardings, no big
collective). The tail forms' vocabulary-parallel rows merge their tail sums with one O(N)
all-reduce.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.multidevice_kd_check xla
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jax_fusedloss as jfl
from tests import multidevice_linear_check as base

K = 4
_BASE_INPUTS = base.inputs


def cases():
    """name -> (layout, with bias, loss(h, w, b, aux, impl, vocab_axis, reduction))."""

    def make(layout, fn, mode, per_token=False, **opts):
        def loss(h, w, b, a, impl, va, red):
            y, ids, lp, wt = a
            kw = dict(bias=b, weight_layout=layout, chunk_size=base.CHUNK, mode=mode,
                      implementation=impl, vocab_axis=va,
                      reduction="none" if per_token else red, **opts)
            out = (jfl.linear_kd_loss(h, w, ids, lp, weights=wt, **kw) if fn == "kd" else
                   jfl.linear_distill_loss(h, w, y, ids, lp, alpha=0.4, **kw))
            return jnp.sum(out * wt) if per_token else out
        return loss

    return {"dv_bias_kd_tail_fused": ("dv", True, make("dv", "kd", "fast", tail=True)),
            "vd_distill_jsd_lean": ("vd", False, make("vd", "distill", "lean", tail=True,
                                                      divergence="jsd", temperature=2.0)),
            "vd_bias_kd_tail_recompute": ("vd", True, make("vd", "kd", "fast", per_token=True,
                                                           tail=True)),
            "dv_distill_fused": ("dv", True, make("dv", "distill", "low_precision",
                                                  temperature=1.5))}


def inputs(layout: str):
    h, w, b, (y, _, _) = _BASE_INPUTS(layout)
    keys = jax.random.split(jax.random.key(7), 2)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(
        jax.random.normal(keys[0], (base.N, base.V)) * 3.0), K)
    wt = jax.random.uniform(keys[1], (base.N,), minval=-0.5, maxval=1.5)
    return h, w, b, (y, ids.astype(jnp.int32), lp, wt)


if __name__ == "__main__":
    base.cases, base.inputs = cases, inputs
    sys.exit(base.main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
