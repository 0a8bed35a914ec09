"""Worker of the vocabulary-parallel conformance case (run by benchmarks.conformance_impls in a
subprocess, because the device count is fixed when jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.conformance_vp \
        IMPLEMENTATION CASE.npz

Reads the logits, labels and options from CASE.npz, splits the vocabulary over every device
(a 1-D mesh "v") inside jax.shard_map with `vocab_axis="v"`, and writes the loss and the
gathered gradient to out.npz beside it.
"""
from __future__ import annotations

import ast
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedloss as jfl


def main(implementation: str, path: str) -> None:
    data = np.load(path)
    x = data["x"].view(ml_dtypes.bfloat16) if bool(data["bf16"]) else data["x"]
    opts = ast.literal_eval(str(data["opts"]))
    mesh = jax.make_mesh((jax.device_count(),), ("v",))

    def body(x, y):
        def loss(x):
            return jfl.cross_entropy(x, y, reduction=opts["reduction"], vocab_axis="v",
                                     label_smoothing=opts["label_smoothing"],
                                     z_loss=opts["z_loss"], implementation=implementation)

        value, vjp = jax.vjp(loss, x)
        (grad,) = vjp(jnp.full(value.shape, opts["loss_scale"], value.dtype))
        return value, grad

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "v"), P()),
                               out_specs=(P(), P(None, "v"))))
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(None, "v")))
    ys = jax.device_put(jnp.asarray(data["labels"]), NamedSharding(mesh, P()))
    value, grad = fn(xs, ys)
    np.savez(os.path.join(os.path.dirname(path), "out.npz"),
             value=np.asarray(value, np.float64),
             grad=np.asarray(grad.astype(jnp.float32), np.float64))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
