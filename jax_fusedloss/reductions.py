"""Log-sum-exp, entropy and token log-probs over the vocabulary, and the merge of partials."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _op, _sharding, _triton_jax
from jax_fusedloss._xla import reductions as _xla_red


class RedOptions(NamedTuple):
    temperature: float
    entropy: bool  # compute (and differentiate) the entropy
    implementation: str
    vocab_axis: str | tuple[str, ...] | None = None


# ----------------------------------------------------------------------------- Triton launches
def _plan(name: str, opts: RedOptions, has_label: bool):
    """A reductions plan function of (n, vocab) for these options."""
    from jax_fusedloss.kernels import reductions

    return functools.partial(getattr(reductions, name), inv_temp=1.0 / opts.temperature,
                             entropy=opts.entropy, has_label=has_label,
                             num_sms=_triton_jax.num_sms())


def _labels(y):
    return ((y,), ("y",)) if y is not None else ((), ())


def _triton_rows_fwd(x, y, opts: RedOptions):
    """Per-row (lse, entropy or None, logp or None, lse_lo) through red_fwd_plan."""
    labels, names = _labels(y)
    want = ("lse",) + ("ent",) * opts.entropy + ("logp",) * (y is not None) + ("lse_lo",)
    outs = dict(zip(want, _triton_jax.run_rows(_plan("red_fwd_plan", opts, y is not None),
                                               ("x",) + names, x, *labels, results=want)))
    return outs["lse"], outs.get("ent"), outs.get("logp"), outs["lse_lo"]


def _triton_rows_bwd(x, y, lse, lse_lo, ent, cot, opts: RedOptions):
    labels, names = _labels(y)
    ent = lse if ent is None else ent  # read only with opts.entropy
    return _triton_jax.run_rows(_plan("red_bwd_plan", opts, y is not None),
                                ("x", "lse", "lse_lo", "ent", "cot") + names, x, lse, lse_lo,
                                ent, cot, *labels)[0]


def _triton_slice_stats(x, y, opts: RedOptions):
    """Per-row partials (m, s, u, z[y] or 0; None without labels) through red_partials_plan;
    y may lie outside [0, V) (a label in another device's vocabulary slice)."""
    labels, names = _labels(y)
    (part,) = _triton_jax.run_rows(_plan("red_partials_plan", opts, y is not None),
                                   ("x",) + names, x, *labels)
    m, s, u = _xla_red.merge_stats(part[..., 0], part[..., 1], part[..., 2], axis=1)
    return m, s, u, part[..., 3].sum(axis=1) if y is not None else None


# ----------------------------------------------------------------------------- row functions
def _row_fns(opts: RedOptions, impl: str, has_label: bool) -> dict[str, _sharding.RowFns]:
    """fwd: (x[, y]) -> (lse[, entropy][, logp], lse_lo); bwd: (x, lse, ent, cot[, y]) ->
    grad; each with its vocabulary-parallel form.

    lse_lo is the low part of the log-sum-exp (lse + lse_lo, _online.lse_parts). The backward
    takes lse as [N] (lse_lo taken as 0: every softmax entry then loses |lse| * 2**-24) or as
    [N, 2] = (lse, lse_lo) stacked, accurate whatever |lse|."""
    if impl == "triton":
        stats, fwd, bwd = _triton_slice_stats, _triton_rows_fwd, _triton_rows_bwd
    else:
        stats, fwd, bwd = _xla_red.slice_stats, _xla_red.rows_fwd, _xla_red.rows_bwd

    def present(outs):
        return tuple(o for o in outs if o is not None)

    def fwd_local(x, *y):
        return present(fwd(x, y[0] if y else None, opts))

    def fwd_vp(x, *y, axes):
        label = y[0] if y else None
        off = _sharding.slice_offset(x.shape[1], axes)
        m, s, u, zy = stats(x, None if label is None else label - off, opts)
        m, s, u, *zy = _sharding.merge_across(axes, m, s, u if opts.entropy else None,
                                              sums=(zy,) if y else ())
        return present(_xla_red.finish(m, s, u, zy[0] if y else None, label,
                                       _sharding.global_vocab(x.shape[1], axes)))

    def bwd_local(x, lse, ent, cot, *y):
        lse, lse_lo = (lse[:, 0], lse[:, 1]) if lse.ndim == 2 else (lse, jnp.zeros_like(lse))
        return (bwd(x, y[0] if y else None, lse, lse_lo, ent if opts.entropy else None, cot,
                    opts),)

    def bwd_vp(x, lse, ent, cot, *y, axes):
        if not y:
            return bwd_local(x, lse, ent, cot)
        # The label term lives on the slice that owns the label: elsewhere its softmax part
        # joins g_lse and the label column term is dropped. A label outside [0, V) with a
        # nonzero cotangent poisons the row through g_lse, as the local kernels do.
        vocab = x.shape[1]
        local = y[0] - _sharding.slice_offset(vocab, axes)
        owned = (local >= 0) & (local < vocab)
        bad = (y[0] < 0) | (y[0] >= _sharding.global_vocab(vocab, axes))
        g_lse, g_ent, g_logp = cot[:, 0], cot[:, 1], cot[:, 2]
        g_lse = jnp.where(owned, g_lse, g_lse - g_logp)
        g_lse = jnp.where(bad & (g_logp != 0), jnp.nan, g_lse)
        cot = jnp.stack([g_lse, g_ent, jnp.where(owned, g_logp, 0.0)], axis=1)
        return bwd_local(x, lse, ent, cot, jnp.where(owned, local, 0))

    n_out = 2 + opts.entropy + has_label
    R, X = _sharding.ROW, _sharding.LIKE_X
    return dict(fwd=_sharding.RowFns(fwd_local, fwd_vp, (R,) * n_out),
                bwd=_sharding.RowFns(bwd_local, bwd_vp, (X,)))


def _call(opts: RedOptions, role: str, has_label: bool, *arrays):
    return _sharding.run(lambda impl: _row_fns(opts, impl, has_label), opts, role, *arrays)


# ----------------------------------------------------------------------------- the op
@dataclasses.dataclass(frozen=True)
class _Reductions(_op.RowOp):
    """x (, y) -> (lse, entropy or None, log-prob or None). Row functions: fwd gives lse (and
    the entropy, the label's log-prob); bwd takes the three cotangents stacked [N, 3]. No
    gradient in the forward: the backward is one pass combining every output's cotangent."""
    opts: RedOptions
    has_label: bool = False
    auto_family = "reductions"

    @property
    def num_aux(self) -> int:
        return int(self.has_label)

    def call(self, role, *arrays):
        return _call(self.opts, role, self.has_label, *arrays)

    def primal(self, outs, *y):
        outs = iter(outs)
        lse = next(outs)
        return (lse, next(outs) if self.opts.entropy else None,
                next(outs) if self.has_label else None)

    def saved(self, outs):
        """(lse with its low part [N, 2] (the forward's trailing output), entropy); the entropy
        is read only with opts.entropy."""
        lse, ent, _ = self.primal(outs)
        return jnp.stack([lse, outs[-1]], axis=1), lse if ent is None else ent

    def row_cotangent(self, cts, n):
        like = next(g for g in cts if g is not None)  # keeps the rows' sharding (Explicit axes)
        zeros = jnp.zeros_like(like, jnp.float32)
        return jnp.stack([zeros if g is None else g.astype(jnp.float32) for g in cts], axis=1)

    def recompute(self, res, cot, cts):
        lse, ent = res.stats
        return _call(self.opts, "bwd", self.has_label, res.x, lse, ent, cot, *res.inputs)[0]


def _compute(logits, labels, temperature, entropy: bool, implementation, vocab_axis=None,
             check_labels: bool = False):
    """Validates, flattens to rows and dispatches; returns (lse, entropy, logp) shaped `[...]`."""
    logits = _common.as_logits(logits)
    if labels is not None:
        _common.check_int_array(labels, "labels", logits.shape[:-1], "logits.shape[:-1]")
    _common.check_implementation(implementation)
    temperature = _common.check_static_float(temperature, "temperature", lo=0.0, lo_open=True)
    vocab_axis = _common.check_vocab_axis(vocab_axis, logits, "logits")
    lead = logits.shape[:-1]
    x = _common.flatten_rows(logits)
    y = None
    if labels is not None:
        vocab = _common.vocab_size(logits, vocab_axis)
        y = _common.labels_to_int32(labels.reshape(-1), None, vocab)
        _common.check_labels(labels, vocab, None, enabled=check_labels)
    if x.shape[0] == 0:
        empty = jnp.zeros(lead, jnp.float32)
        return empty, empty, empty
    op = _Reductions(RedOptions(temperature=temperature, entropy=entropy, implementation="",
                                vocab_axis=vocab_axis), y is not None)
    outs = _op.apply(op, implementation, x, *([] if y is None else [y]))
    return tuple(_op.unflatten(o, lead) for o in outs)


# ----------------------------------------------------------------------------- public API
@_common.public
def logsumexp(logits: jax.Array, *, temperature: float = 1.0, implementation: str | None = None,
              vocab_axis: str | tuple[str, ...] | None = None) -> jax.Array:
    r"""Log-sum-exp over the last axis, in one read of the logits.

    With :math:`z = \mathrm{logits} / T` (`temperature` T):

    .. math::
        \mathrm{lse} = \log \sum_j e^{z_j}, \qquad
        \frac{\partial\, \mathrm{lse}}{\partial\, \mathrm{logits}_j} = \mathrm{softmax}(z)_j / T

    Rows that are few but long are split over several programs (two-level reduction: partial
    `(max, sum)` per vocabulary slice, then a merge; see `merge_partials`).

    Args:
      logits: `[..., V]` float32, bfloat16 or float16.
      temperature: a static float > 0.
      implementation: None (Triton on a CUDA GPU, XLA elsewhere), "triton" or "xla".
      vocab_axis: inside `jax.shard_map` only, the mesh axis (or axes) splitting the
        vocabulary (see `cross_entropy`); under `jax.jit` the op partitions itself.

    Returns:
      float32 `[...]`; `-inf` for a row whose logits are all `-inf` (its gradient is zero).
      The gradient w.r.t. `logits` has the logits' dtype.

    Raises:
      TypeError / ValueError at trace time for non-float logits, a bad temperature or an
      unknown implementation.

    Example:
      >>> logits = jax.random.normal(jax.random.key(0), (8, 1000))
      >>> lse = logsumexp(logits)  # == jax.nn.logsumexp(logits, axis=-1)
    """
    return _compute(logits, None, temperature, False, implementation, vocab_axis)[0]


@_common.public
def entropy(logits: jax.Array, *, temperature: float = 1.0, implementation: str | None = None,
            vocab_axis: str | tuple[str, ...] | None = None) -> jax.Array:
    r"""Entropy of softmax(logits / temperature) over the last axis, in one read.

    With :math:`z = \mathrm{logits} / T` and :math:`p = \mathrm{softmax}(z)`:

    .. math::
        H = -\sum_j p_j \log p_j = \mathrm{lse}(z) - \sum_j p_j z_j, \qquad
        \frac{\partial H}{\partial\, \mathrm{logits}_j} = -p_j(\log p_j + H) / T

    The sum is kept relative to the running max, so H stays accurate for large logits.
    Entries equal to `-inf` (masked tokens) have p = 0 and add nothing.

    Args:
      logits: `[..., V]` float32, bfloat16 or float16.
      temperature: a static float > 0.
      implementation: None (Triton on a CUDA GPU, XLA elsewhere), "triton" or "xla".
      vocab_axis: inside `jax.shard_map` only, the mesh axis (or axes) splitting the
        vocabulary (see `cross_entropy`); under `jax.jit` the op partitions itself.

    Returns:
      float32 `[...]` in nats; NaN for a row whose logits are all `-inf` (no distribution;
      its gradient is zero).

    Raises:
      TypeError / ValueError at trace time, as `logsumexp`.

    Example:
      >>> logits = jax.random.normal(jax.random.key(0), (8, 1000))
      >>> h = entropy(logits, temperature=0.7)
    """
    return _compute(logits, None, temperature, True, implementation, vocab_axis)[1]


@_common.public
def token_logprobs(logits: jax.Array, labels: jax.Array, *, temperature: float = 1.0,
                   return_entropy: bool = False, check_labels: bool = False,
                   implementation: str | None = None,
                   vocab_axis: str | tuple[str, ...] | None = None,
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Log-probability of each label under softmax(logits / temperature), and its entropy.

    The per-token quantities of RL fine-tuning (PPO, GRPO): with
    :math:`z = \mathrm{logits} / T`,

    .. math::
        \log p_y = z_y - \mathrm{lse}(z), \qquad
        \frac{\partial \log p_y}{\partial\, \mathrm{logits}_j} = ([j = y] - p_j) / T

    With `return_entropy`, the entropy (see `entropy`) comes from the same pass over the
    logits, and the backward of both outputs is one pass as well.

    Args:
      logits: `[..., V]` float32, bfloat16 or float16.
      labels: `[...]` integer token ids in `[0, V)`.
      temperature: a static float > 0.
      return_entropy: also return the entropy `[...]`.
      check_labels: debugging aid: raise a ValueError naming the first label outside
        `[0, V)` (its index and value, and how many there are), checked at run time through
        `jax.debug.callback` (under `jax.jit` JAX re-raises it as a `JaxRuntimeError`
        carrying that message); costs a device-to-host sync per call.
      implementation: None (Triton on a CUDA GPU, XLA elsewhere), "triton" or "xla".
      vocab_axis: inside `jax.shard_map` only, the mesh axis (or axes) splitting the
        vocabulary (see `cross_entropy`); under `jax.jit` the op partitions itself.

    Returns:
      float32 `[...]` log-probs, or `(logprobs, entropy)`. A label outside `[0, V)` is never
      used as an address: its log-prob is NaN, and its gradient row is NaN only if that
      log-prob's cotangent is nonzero (so `jnp.where(valid, logp, 0)` masks it cleanly); the
      entropy of that row is unaffected. A row whose logits are all `-inf` gives NaN log-prob
      and entropy and a zero gradient; a finite row gives `-inf` for a label whose logit is
      `-inf`.

    Raises:
      TypeError / ValueError at trace time for non-float logits, non-integer labels,
      `labels.shape != logits.shape[:-1]`, a bad temperature or an unknown implementation.

    Example:
      >>> logits = jax.random.normal(jax.random.key(0), (4, 16, 1000))
      >>> tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 1000)
      >>> logp, h = token_logprobs(logits, tokens, return_entropy=True)
    """
    if labels is None:
        raise TypeError("labels must be an integer array `[...]`, got None")
    _, ent, logp = _compute(logits, labels, temperature, return_entropy, implementation,
                            vocab_axis, check_labels)
    return (logp, ent) if return_entropy else logp


def _accepts_old_max_keyword(fn):
    """merge_partials' first argument was named `max` (shadowing the builtin) up to 0.1.0:
    the old keyword still works, with a DeprecationWarning."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "max" in kwargs:
            warnings.warn("merge_partials(max=...) is deprecated: the argument is now named "
                          "`maximum`", DeprecationWarning, stacklevel=2)
            kwargs["maximum"] = kwargs.pop("max")
        return fn(*args, **kwargs)

    return wrapper


@_accepts_old_max_keyword
@_common.public
def merge_partials(maximum: jax.Array, sumexp: jax.Array, shifted_sum: jax.Array | None = None,
                   *, axis: int = -1) -> tuple[jax.Array, ...]:
    r"""Merges partial softmax statistics of disjoint vocabulary slices along `axis`.

    Slice i of a row's logits z gives :math:`m_i = \max z`, :math:`s_i = \sum e^{z - m_i}`
    and, for the entropy, :math:`u_i = \sum (z - m_i)\, e^{z - m_i}`. Merging:

    .. math::
        m = \max_i m_i, \quad s = \sum_i s_i e^{m_i - m}, \quad
        u = \sum_i e^{m_i - m} (u_i + (m_i - m) s_i)

    and then :math:`\mathrm{lse} = m + \log s`, :math:`H = \log s - u / s`. The identity is
    `(-inf, 0, 0)`: a partial whose max is `-inf` (an empty or all `-inf` slice) changes
    nothing whatever its other entries, and a row with no finite entry merges to
    `(-inf, 0, 0)`. The shard-local results of this package are partials already:
    `(logsumexp(z_i), 1, -entropy(z_i))`, e.g. gathered across a mesh axis with
    `jax.lax.all_gather(..., axis_name, axis=-1)` for vocabulary-parallel logits. Pure JAX and
    differentiable; gradients stay finite at `-inf` entries.

    Args:
      maximum: `[..., S, ...]` float partial maxima (`-inf` for an empty slice).
      sumexp: partial sums of `exp(z - maximum)`, the shape of `maximum`.
      shifted_sum: optional partial sums of `(z - maximum) * exp(z - maximum)`, the shape
        of `maximum`.
      axis: the axis of `maximum` that indexes the slices.

    Returns:
      `(maximum, sumexp)` or, with `shifted_sum`, `(maximum, sumexp, shifted_sum)`, each
      with `axis` removed, in float32 (or float64 for float64 inputs).

    Raises:
      ValueError if the shapes differ.

    Example:
      >>> z = jax.random.normal(jax.random.key(0), (4, 3000))
      >>> parts = jnp.stack([logsumexp(c) for c in jnp.split(z, 3, axis=-1)], -1)
      >>> m, s = merge_partials(parts, jnp.ones_like(parts))
      >>> lse = m + jnp.log(s)  # == logsumexp(z)
    """
    arrays = [a for a in (maximum, sumexp, shifted_sum) if a is not None]
    shapes = [jnp.shape(a) for a in arrays]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"maximum, sumexp and shifted_sum must share one shape, got {shapes}")
    dtype = jnp.promote_types(jnp.result_type(*arrays), jnp.float32)  # at least float32
    arrays = [jnp.asarray(a, dtype) for a in arrays]
    return _xla_red.merge_stats(arrays[0], arrays[1], arrays[2] if len(arrays) == 3 else None,
                                axis)
