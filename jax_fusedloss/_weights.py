"""Per-token weights of the cross-entropy losses (`weights=`, `where=`, `num_items=`).

A token's weight joins the per-row scale the cross-entropy row functions already take (the
"mean" denominator lives there): `row_scale = w / denominator`, so the fused gradient stays one
pass (no extra read of the logits, no recompute of an LM head). The weights are data: they get
no gradient. Semantics, shared by `cross_entropy` and `linear_cross_entropy`:

- `where` (bool `[...]`, optax's convention): False counts as ignored (as `ignore_index`).
- `weights` (float `[...]`, broadcast against the labels): each counted token's loss is
  multiplied by its weight (any sign; a NaN or inf weight gives a NaN or inf loss; a weight of 0
  does not hide an out-of-range label's NaN: use `where` for that).
- "mean" divides by `num_items` when given, else by the sum of the counted tokens' weights
  (without weights: their number), taken as 1 where it is 0 (nothing counted, or all-zero
  weights, give a loss of 0).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _validate


class TokenWeights(NamedTuple):
    """Per-row arrays of one call: labels with `where=False` tokens ignored, the float32
    weights `[N]` (ones without `weights`) and the "mean" denominator (1.0 otherwise)."""
    labels: jax.Array
    weights: jax.Array
    denominator: jax.Array


def _broadcast(a, name: str, shape: tuple[int, ...]):
    try:
        out = jnp.broadcast_shapes(tuple(a.shape), tuple(shape))
    except ValueError:
        out = None
    if out != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(a.shape)} must broadcast to labels.shape="
                         f"{tuple(shape)}")
    return jnp.broadcast_to(a, shape).reshape(-1)


def check(weights, where, num_items, reduction: str, shape: tuple[int, ...]) -> None:
    """Trace-time checks naming the argument (`shape`: the labels')."""
    if weights is not None:
        if not hasattr(weights, "shape") or not hasattr(weights, "dtype"):
            raise TypeError(f"weights must be a float array, got {type(weights).__name__}")
        if not jnp.issubdtype(weights.dtype, jnp.floating):
            raise TypeError(f"weights.dtype={weights.dtype} must be a float type")
        _broadcast(weights, "weights", shape)
    if where is not None:
        if not hasattr(where, "shape") or not hasattr(where, "dtype"):
            raise TypeError(f"where must be a bool array, got {type(where).__name__}")
        if jnp.dtype(where.dtype) != jnp.bool_:
            raise TypeError(f"where.dtype={where.dtype} must be bool")
        _broadcast(where, "where", shape)
    if _validate.check_num_items(num_items, reduction):
        _validate.check_scalar_shape(tuple(jnp.shape(num_items)), "num_items")


def prepare(y: jax.Array, shape: tuple[int, ...], ignore_index: int, reduction: str,
            weights=None, where=None, num_items=None) -> TokenWeights:
    """`y`: the flat int32 labels of `[...]`-shaped `shape`; arguments already `check`ed."""
    if where is not None:
        y = jnp.where(_broadcast(where, "where", shape), y, jnp.int32(ignore_index))
    counted = y != ignore_index
    if weights is None:
        w = jnp.ones_like(y, jnp.float32)
    else:
        w = jax.lax.stop_gradient(_broadcast(weights, "weights", shape).astype(jnp.float32))
    if reduction != "mean":
        denom = jnp.float32(1.0)
    elif num_items is not None:
        denom = jnp.asarray(num_items).astype(jnp.float32)
    elif weights is None:
        denom = jnp.maximum(jnp.sum(counted), 1).astype(jnp.float32)
    else:
        total = jnp.sum(jnp.where(counted, w, 0.0))
        denom = jnp.where(total == 0, 1.0, total)
    return TokenWeights(y, w, jax.lax.stop_gradient(denom))


def row_scale(w: jax.Array, denom: jax.Array) -> jax.Array:
    """The per-row scale of the row functions (their gradient coefficients' weight)."""
    return (w * (1.0 / denom)).astype(jnp.float32)


def reduce(loss_rows: jax.Array, y: jax.Array, w: jax.Array, denom: jax.Array,
           ignore_index: int, reduction: str) -> jax.Array:
    """The weighted per-token losses (0 at ignored tokens), summed ("sum"), divided by the
    denominator ("mean") or as they are ("none")."""
    loss = jnp.where(y == ignore_index, 0.0, loss_rows * w)
    if reduction == "none":
        return loss
    return jnp.sum(loss) / denom
