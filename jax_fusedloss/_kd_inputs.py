"""Trace-time checks and row preparation shared by the distillation ops (kd_loss,
distill_loss, linear_kd_loss, linear_distill_loss): teacher entries, options, the tail /
divergence switches, per-token weights and the "mean" row scales."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _validate
from jax_fusedloss._kd_rows import DIVERGENCES

NORMALIZATIONS = _validate.NORMALIZATIONS


def check_teacher(student_logits, teacher_ids, teacher_logprobs, mask) -> None:
    """Trace-time checks shared by kd_loss and distill_loss."""
    _common.check_logits(student_logits, "student_logits")
    check_teacher_arrays(student_logits.shape, teacher_ids, teacher_logprobs, mask)


def check_teacher_arrays(logits_shape, teacher_ids, teacher_logprobs, mask) -> None:
    """The teacher entries' checks against the (possibly never built) logits' shape
    `[..., V]`."""
    for name, a in (("teacher_ids", teacher_ids), ("teacher_logprobs", teacher_logprobs),
                    ("mask", mask)):
        if a is not None and not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if not jnp.issubdtype(teacher_ids.dtype, jnp.integer):
        raise _validate.integer_dtype_error("teacher_ids", teacher_ids.dtype)
    _validate.check_teacher_shapes(tuple(logits_shape), teacher_ids.shape,
                                   teacher_logprobs.shape, None if mask is None else mask.shape)
    if not jnp.issubdtype(teacher_logprobs.dtype, jnp.floating):
        raise TypeError(f"teacher_logprobs.dtype={teacher_logprobs.dtype} must be a float type")


def check_options(temperature, normalize, reduction, num_items, implementation) -> float:
    """Checks the options shared by kd_loss and distill_loss; returns the temperature."""
    t = _common.check_static_float(temperature, "temperature", lo=0.0, lo_open=True)
    _common.check_choice(normalize, "normalize", NORMALIZATIONS)
    _common.check_choice(reduction, "reduction", _common.REDUCTIONS)
    _common.check_implementation(implementation)
    if _validate.check_num_items(num_items, reduction):
        _validate.check_scalar_shape(jnp.shape(num_items), "num_items")
    return t


def check_divergence(tail, divergence, beta, normalize) -> tuple[bool, str, float]:
    """(tail, divergence, beta) checked: "jsd" needs tail=True, tail needs normalize="full"
    (the student's mass outside the ids is that of its full softmax)."""
    tail = _common.check_bool(tail, "tail")
    _common.check_choice(divergence, "divergence", DIVERGENCES)
    beta = _common.check_static_float(beta, "beta", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    if divergence == "jsd" and not tail:
        raise ValueError('divergence="jsd" requires tail=True (the generalised Jensen-Shannon '
                         "divergence is taken over the K+1 buckets: the teacher's ids and the "
                         "tail)")
    if tail and normalize != "full":
        raise ValueError(f'tail=True requires normalize="full", got normalize={normalize!r} '
                         "(a student renormalised over the teacher's ids has no tail)")
    return tail, divergence, beta


def token_weights(weights, where, lead: tuple[int, ...]):
    """(float32 [N] weights or None, bool [N] `where` or None), broadcast to the tokens' shape
    `lead` and flattened; they get no gradient. The weights are 0 where `where` is False."""
    out = []
    for name, a, floating in (("weights", weights, True), ("where", where, False)):
        if a is None:
            out.append(None)
            continue
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        if floating and not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"weights.dtype={a.dtype} must be a float type")
        if not floating and a.dtype != jnp.bool_:
            raise TypeError(f"where.dtype={a.dtype} must be bool")
        try:
            b = jnp.broadcast_to(a, lead)
        except ValueError:
            raise ValueError(f"{name}.shape={tuple(a.shape)} must broadcast to the tokens' "
                             f"shape {tuple(lead)}") from None
        b = jax.lax.stop_gradient(b.reshape(-1))
        out.append(b.astype(jnp.float32) if floating else b)
    w, keep = out
    if keep is not None:  # a token where=False weighs 0 (and its rows count as inactive)
        w = jnp.where(keep, 1.0 if w is None else w, 0.0)
    return w, keep


def row_scales(n: int, terms, weights, reduction: str, num_items) -> jax.Array:
    """float32 [N, 2] per-row weights of (cross-entropy, KD): `terms` is ((coef, counted [N]
    bool or None), (coef, counted)); each row's weight is coef times its token weight, and for
    "mean" divided by `mean_denominator` of the counted rows (their weights' sum)."""
    cols = []
    w = jnp.ones((n,), jnp.float32) if weights is None else weights
    for coef, counted in terms:
        if counted is None:  # a term the op does not have (kd_loss's cross-entropy); like w, so
            cols.append(jnp.zeros_like(w))  # the stack's operands share a sharding (Explicit)
            continue
        col = jnp.float32(coef) * w
        if reduction == "mean":
            col = col / mean_denominator(jnp.sum(jnp.where(counted, w, 0.0)), num_items,
                                         weighted=weights is not None)
        cols.append(col)
    return jnp.stack(cols, axis=1)


def prepare_entries(student_logits, teacher_ids, teacher_logprobs, mask, active=None,
                    vocab_axis=None):
    """Rows [N, V], then `teacher_rows`' (ids, log-probs, has_entry)."""
    vocab = student_logits.shape[-1]
    if vocab_axis is not None:  # inside shard_map: the logits are one slice of the vocabulary
        vocab *= jax.lax.axis_size(vocab_axis)
    return (_common.flatten_rows(student_logits),) + teacher_rows(
        teacher_ids, teacher_logprobs, mask, vocab, active)


def teacher_rows(teacher_ids, teacher_logprobs, mask, vocab: int, active=None):
    """int32 ids [N, K] with -1 at every entry that does not count (masked, out of [0, V), or
    in an inactive row), float32 log-probs [N, K] and whether each row has a counting entry
    [N]."""
    k = teacher_ids.shape[-1]
    ids = teacher_ids.reshape(-1, k)
    valid = (ids >= 0) & (ids < vocab)
    if mask is not None:
        valid = valid & (mask.reshape(-1, k) != 0)
    if active is not None:
        valid = valid & active[:, None]
    ids32 = jnp.where(valid, jnp.where(valid, ids, 0).astype(jnp.int32), -1)
    lp = teacher_logprobs.reshape(-1, k).astype(jnp.float32)
    return ids32, lp, valid.any(axis=1)


def mean_denominator(count: jax.Array, num_items, weighted: bool = False) -> jax.Array:
    """num_items as float32 when given, else max(count, 1) (so nothing counted gives 0); a
    weighted count (a sum of weights, any sign) is used as is unless it is 0 (then 1)."""
    if num_items is not None:
        return jnp.asarray(num_items).astype(jnp.float32)
    if weighted:
        return jnp.where(count == 0, 1.0, count).astype(jnp.float32)
    return jnp.maximum(count, 1).astype(jnp.float32)


