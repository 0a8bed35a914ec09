"""Fused cross-entropy: public function, validation, its op hooks and the Triton launches."""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _op, _sharding, _triton_jax, _weights
from jax_fusedloss._xla import chunks as _xla_chunks
from jax_fusedloss._xla import cross_entropy as _xla_ce
from jax_fusedloss._xla import reductions as _xla_red


class CEOptions(NamedTuple):
    ignore_index: int
    reduction: str
    smoothing: float
    z_loss: float
    softcap: float | None
    return_lse: bool
    implementation: str
    vocab_axis: str | tuple[str, ...] | None = None
    # Triton gradients overwrite the logits they come from (aliased): only for logits that are
    # dead afterwards (linear_cross_entropy's chunks); a caller's logits would be copied first.
    in_place: bool = False


# ----------------------------------------------------------------------------- Triton launches
def _plans():
    from jax_fusedloss.kernels import cross_entropy

    return cross_entropy


def _plan_options(opts: CEOptions) -> dict:
    return dict(ignore_index=opts.ignore_index, smoothing=opts.smoothing, z_loss=opts.z_loss,
                softcap=opts.softcap, num_sms=_triton_jax.num_sms())


def _triton_rows_fwd(x, y, row_scale, opts: CEOptions, write_grad: bool):
    """Per-row (loss, lse, coef) and, if write_grad, the unit-cotangent gradient."""
    plan = functools.partial(_plans().ce_fwd_plan, write_grad=write_grad,
                             itemsize=x.dtype.itemsize, in_place=write_grad and opts.in_place,
                             **_plan_options(opts))
    return _triton_jax.run_rows(plan, ("x", "y", "row_scale"), x, y, row_scale)


def _triton_rows_bwd(x, y, lse, coef, opts: CEOptions):
    plan = functools.partial(_plans().ce_bwd_plan, softcap=opts.softcap,
                             num_sms=_triton_jax.num_sms(), in_place=opts.in_place)
    return _triton_jax.run_rows(plan, ("x", "y", "lse", "coef"), x, y, lse, coef)[0]


def scale_rows(grad: jax.Array, cot: jax.Array) -> jax.Array:
    """grad * cot[:, None] in place (rows with cot == 1 are skipped) through a Triton kernel."""
    def plan(n, vocab):
        return _plans().scale_rows_plan(n, vocab, grad.dtype.itemsize)

    return _triton_jax.run_rows(plan, ("grad", "cot"), grad, cot)[0]


def _triton_slice_stats(x, y, opts: CEOptions):
    """Per-row (max, sum exp, sum z, z[y] or 0) of `[N, V]` through ce_partial_kernel; y may lie
    outside [0, V) (a label in another device's vocabulary slice)."""
    plan = functools.partial(_plans().ce_partials_plan, softcap=opts.softcap,
                             smoothing=opts.smoothing, num_sms=_triton_jax.num_sms())
    (part,) = _triton_jax.run_rows(plan, ("x", "y"), x, y)
    m, s = _xla_red.merge_stats(part[..., 0], part[..., 1], None, axis=1)
    return m, s, part[..., 2].sum(axis=1), part[..., 3].sum(axis=1)


# ----------------------------------------------------------------------------- row functions
def _vp_fwd(slice_stats, x, y, row_scale, opts: CEOptions, axes):
    """Vocabulary-parallel forward: slice statistics merged across `axes` with O(N)
    all-reduces, then the row finish."""
    m, s, sumz, zy = slice_stats(x, y - _sharding.slice_offset(x.shape[1], axes), opts)
    m, s, _, sumz, zy = _sharding.merge_across(axes, m, s, sums=(sumz, zy))
    lse, lse_lo = _xla_chunks.lse_parts(m, s)
    loss, coef = _xla_ce.finish(lse, lse_lo, zy, sumz, y, row_scale, opts,
                                _sharding.global_vocab(x.shape[1], axes))
    return loss, lse, coef


def _row_fns(opts: CEOptions, impl: str) -> dict[str, _sharding.RowFns]:
    """The row functions of one implementation: fwd, fwd_grad, bwd and scale (rescale a saved
    gradient by per-row cotangents), each with its vocabulary-parallel form."""
    if impl == "triton":
        stats, fwd = _triton_slice_stats, functools.partial(_triton_rows_fwd, write_grad=False)
        bwd = _triton_rows_bwd
    else:
        stats, fwd, bwd = _xla_ce.slice_stats, _xla_ce.rows_fwd, _xla_ce.rows_bwd

    def bwd_vp(x, y, lse, coef, axes):
        return (bwd(x, y - _sharding.slice_offset(x.shape[1], axes), lse, coef, opts),)

    def fwd_grad_vp(x, y, row_scale, axes):
        loss, lse, coef = _vp_fwd(stats, x, y, row_scale, opts, axes)
        return (loss, lse, coef) + bwd_vp(x, y, lse, coef, axes)

    def fwd_grad(x, y, row_scale):
        if impl == "triton":
            return _triton_rows_fwd(x, y, row_scale, opts, write_grad=True)
        if x.dtype == jnp.float32 and _xla_chunks.whole_rows():
            return _xla_ce.rows_fwd_grad_whole(x, y, row_scale, opts)
        loss, lse, coef = fwd(x, y, row_scale, opts)
        return loss, lse, coef, bwd(x, y, lse, coef, opts)

    R, X = _sharding.ROW, _sharding.LIKE_X
    return dict(
        fwd=_sharding.RowFns(lambda x, y, r: fwd(x, y, r, opts),
                             functools.partial(_vp_fwd, stats, opts=opts), (R, R, R)),
        fwd_grad=_sharding.RowFns(fwd_grad, fwd_grad_vp, (R, R, R, X)),
        bwd=_sharding.RowFns(lambda x, y, lse, coef: (bwd(x, y, lse, coef, opts),), bwd_vp, (X,)),
        scale=scale_row_fns(impl),
    )


def scale_row_fns(impl: str) -> _sharding.RowFns:
    """(grad, cot) -> grad * cot[:, None]: a saved unit-cotangent gradient rescaled per row
    (each vocabulary slice alike), for every op that writes its gradient in the forward."""
    def scale(grad, cot):
        if impl == "triton":
            return (scale_rows(grad, cot),)
        return ((grad.astype(jnp.float32) * cot[:, None]).astype(grad.dtype),)

    return _sharding.RowFns(scale, lambda g, c, axes: scale(g, c), (_sharding.LIKE_X,))


def _call(opts: CEOptions, role: str, *arrays):
    return _sharding.run(functools.partial(_row_fns, opts), opts, role, *arrays)


# ----------------------------------------------------------------------------- the op
def _row_cotangent(g_loss, n, opts: CEOptions):
    return g_loss.astype(jnp.float32) if opts.reduction == "none" else jnp.broadcast_to(
        g_loss.astype(jnp.float32), (n,))


@dataclasses.dataclass(frozen=True)
class _CrossEntropy(_op.RowOp):
    """(x, y) -> (loss, lse). Row functions: x, y, row_scale -> loss, lse, coef [N, 3]
    (+ grad); the weighting rule (`_weights`): row i gets w_i / denominator, where "mean"'s
    denominator is the count (or weight sum) of the counted labels, or `num_items`.
    The recompute folds the cotangents into the coefficients: a * cot + g_lse for the softmax
    term (lse's own gradient is the softmax), b * cot and c * cot (coef [N, 5] = (a, b, c,
    lse_lo * w, w): the last two carry the lse's low part and stay as they are)."""
    opts: CEOptions
    num_aux = 3  # labels, per-token weights [N], the denominator (a scalar)

    @property
    def fuses_grad(self) -> bool:
        # A differentiable lse needs a recompute for its cotangent: no fused gradient there.
        # The XLA twin fuses on CPU (whole rows): there a float32 row's exponentials are
        # computed once for the loss and the gradient (_xla_ce.rows_fwd_grad_whole).
        return (self.opts.implementation == "triton" or _xla_chunks.whole_rows()) and \
            not self.opts.return_lse

    def call(self, role, *arrays):
        return _call(self.opts, role, *arrays)

    def row_inputs(self, y, w, denom):
        return y, _weights.row_scale(w, denom)

    def primal(self, outs, y, w, denom):
        loss, lse, _ = outs
        return _weights.reduce(loss, y, w, denom, self.opts.ignore_index,
                               self.opts.reduction), lse

    def saved(self, outs):
        return outs[1:]  # lse, coef

    def row_cotangent(self, cts, n):
        return _row_cotangent(cts[0], n, self.opts)

    def recompute(self, res, cot, cts):
        (y, *_), (lse, coef) = res.inputs, res.stats
        # (a, b, c) scale with the loss cotangent; the lse_lo fields (3, 4) stay exact.
        c = coef.at[:, :3].multiply(cot[:, None]).at[:, 0].add(cts[1].astype(jnp.float32))
        return _call(self.opts, "bwd", res.x, y, lse, c)[0]


# ----------------------------------------------------------------------------- public API
check_ce_options = _common.check_ce_options  # shared with distill_loss


@_common.public
def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    return_lse: bool = False,
    check_labels: bool = False,
    weights: jax.Array | None = None,
    where: jax.Array | None = None,
    num_items: int | jax.Array | None = None,
    implementation: str | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Fused softmax cross-entropy over the last axis, without `[N, V]` float32 temporaries.

    For a token with label :math:`y` that is not `ignore_index`, with
    :math:`z = c \tanh(x / c)` when `logit_softcap=c` is set (else :math:`z = x`),
    :math:`\mathrm{lse} = \log\sum_j e^{z_j}` and :math:`\epsilon` = `label_smoothing`:

    .. math::
        \ell = (1-\epsilon)(\mathrm{lse} - z_y) + \epsilon(\mathrm{lse} - \tfrac{1}{V}\sum_j z_j)
               + \lambda_z \mathrm{lse}^2

    which is `torch.nn.functional.cross_entropy(..., label_smoothing=eps)` plus PaLM's z-loss
    (Chowdhery et al., 2022). Ignored tokens add 0 and get a zero gradient.

    The logits are read once per pass with an online softmax (Milakov & Gimelshein, 2018).
    Under differentiation the Triton forward also writes the gradient for a unit cotangent, so
    forward + backward reads the logits once and writes their gradient once. For any other
    cotangent (a loss scale, per-token weights) float32 and bfloat16 rows are rescaled (one
    more rounding; bfloat16's exponent range flushes nothing under a loss scale), and float16
    logits' gradients are recomputed with the cotangent applied before rounding (one more read
    of the logits), so no fp16 entry is flushed before a loss scale can save it.

    Args:
      logits: `[..., V]` float32, bfloat16 or float16.
      labels: `[...]` integer class ids in `[0, V)`, or `ignore_index`.
      ignore_index: label value whose tokens are skipped.
      reduction: "mean" (over non-ignored tokens; 0 when there are none), "sum" or "none"
        (float32 `[...]`, 0 at ignored tokens).
      label_smoothing: epsilon in [0, 1].
      z_loss: coefficient of `lse**2`, >= 0.
      logit_softcap: c > 0 for `c * tanh(logits / c)` (Gemma-2 style), or None.
      return_lse: also return float32 `[...]` lse of z for every token, ignored or not
        (differentiable too).
      check_labels: debugging aid: raise a ValueError naming the first label outside
        `[0, V)` that is not `ignore_index` (its index and value, and how many there are),
        checked at run time through `jax.debug.callback` (under `jax.jit` JAX re-raises it as
        a `JaxRuntimeError` carrying that message); costs a device-to-host sync per call.
      weights: optional float `[...]` per-token weights (broadcast against `labels`): each
        token's loss is multiplied by its weight (any sign), folded into the fused gradient
        (no extra pass); "mean" then divides by the sum of the counted tokens' weights (taken
        as 1 where it is 0). The weights get no gradient.
      where: optional bool `[...]` (broadcast against `labels`, optax's convention): False
        counts as ignored.
      num_items: the denominator of "mean" (an int >= 1 or a scalar array) instead of the
        count or weight sum, e.g. the token count of a whole accumulated batch when this call
        sees one micro-batch (as `kd_loss`); no gradient.
      implementation: None (Triton on a CUDA GPU, XLA elsewhere), "triton" or "xla".
      vocab_axis: inside `jax.shard_map` only: the mesh axis name (or names) over which the
        vocabulary axis of `logits` is split, device i of those axes holding columns
        `[i * V_local, (i + 1) * V_local)`; `labels` are global ids. Partial statistics are
        merged with one all-gather of O(N) floats and each device gets the gradient of its
        slice. Under `jax.jit` with sharded inputs nothing is needed: the op partitions itself
        (see the README's Multi-GPU section). A ValueError naming `vocab_axis` outside
        shard_map, under `shard_map(..., check_vma=False)`, or for an axis the logits do not
        vary over (their vocabulary is not split across it).

    Returns:
      The float32 loss (scalar, or `[...]` for "none"); `(loss, lse)` with `return_lse`.
      Its gradient w.r.t. `logits` has the logits' dtype.

    Raises:
      TypeError / ValueError at trace time for non-float logits, non-integer labels, a shape
      mismatch, an unknown option, a traced or non-bool `return_lse` / `check_labels`, or a
      `vocab_axis` that does not split the logits. NotImplementedError for a second-order
      derivative (grad of grad, `jax.hessian`).

    A label outside `[0, V)` that is not `ignore_index` is never used as an address: that
    token's loss is NaN (so a "mean" or "sum" is NaN too, loudly) and its gradient row is NaN;
    other tokens' per-token losses and gradient rows are unaffected. `check_labels=True` finds
    such a label.

    Example:
      >>> logits = jax.random.normal(jax.random.key(0), (4, 8, 1000))
      >>> labels = jax.random.randint(jax.random.key(1), (4, 8), 0, 1000)
      >>> loss, grad = jax.value_and_grad(cross_entropy)(logits, labels)
    """
    logits = _common.as_logits(logits)
    _common.check_int_array(labels, "labels", logits.shape[:-1], "logits.shape[:-1]")
    _common.check_choice(reduction, "reduction", _common.REDUCTIONS)
    _common.check_implementation(implementation)
    smoothing, z_loss, softcap = check_ce_options(label_smoothing, z_loss, logit_softcap)
    ignore_index = _common.check_static_int(ignore_index, "ignore_index")
    vocab_axis = _common.check_vocab_axis(vocab_axis, logits, "logits")
    opts = CEOptions(ignore_index=ignore_index, reduction=reduction, smoothing=smoothing,
                     z_loss=z_loss, softcap=softcap, return_lse=bool(return_lse),
                     implementation="", vocab_axis=vocab_axis)
    lead = labels.shape
    _weights.check(weights, where, num_items, reduction, lead)
    x = _common.flatten_rows(logits)
    vocab = _common.vocab_size(logits, vocab_axis)
    y = _common.labels_to_int32(labels.reshape(-1), ignore_index, vocab)
    _common.check_labels(labels, vocab, ignore_index, enabled=check_labels)
    if x.shape[0] == 0:
        loss = _op.empty_loss(lead, reduction)
        return (loss, jnp.zeros(lead, jnp.float32)) if return_lse else loss
    rows = _weights.prepare(y, lead, ignore_index, reduction, weights, where, num_items)
    loss, lse = _op.apply(_CrossEntropy(opts), implementation, x, *rows)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, lse.reshape(lead)) if return_lse else loss
