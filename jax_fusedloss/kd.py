"""Top-K knowledge distillation: kd_loss, the op hooks shared with distill_loss, the launches.

distill_loss (jax_fusedloss/distill.py) runs the same machinery with a label cross-entropy
folded into the same pass over the student logits.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _op, _sharding, _triton_jax, _validate
from jax_fusedloss._xla import chunks as _xla_chunks
from jax_fusedloss._xla import kd as _xla_kd
from jax_fusedloss.cross_entropy import scale_row_fns

NORMALIZATIONS = _validate.NORMALIZATIONS


class KDOptions(NamedTuple):
    temperature: float
    normalize: str
    reduction: str
    distill: bool  # a label cross-entropy term is part of the row loss (distill_loss)
    ignore_index: int
    implementation: str
    vocab_axis: str | tuple[str, ...] | None = None
    # distill_loss's cross-entropy options (cross_entropy's meaning): smoothing and z-loss of
    # the cross-entropy term; the softcap of the logits both terms see (kd_loss: the defaults).
    smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None


# ----------------------------------------------------------------------------- Triton launches
def _triton_rows_fwd(x, ids, lp, y, row_scale, opts: KDOptions, write_grad: bool):
    """Per-row (loss, stats) and, if write_grad, the unit-cotangent gradient: kd_fwd_plan."""
    from jax_fusedloss.kernels import kd

    def plan(n, vocab):
        return kd.kd_fwd_plan(n, vocab, ids.shape[-1], temperature=opts.temperature,
                              normalize=opts.normalize, distill=opts.distill,
                              ignore_index=opts.ignore_index, num_sms=_triton_jax.num_sms(),
                              write_grad=write_grad, smoothing=opts.smoothing,
                              z_loss=opts.z_loss, softcap=opts.softcap,
                              itemsize=x.dtype.itemsize)

    return _triton_jax.run_rows(plan, ("x", "ids", "lp", "y", "row_scale"), x, ids, lp, y,
                                row_scale)


# ----------------------------------------------------------------------------- row functions
def _vp_gathers(x, ids, y, opts: KDOptions, axes):
    """Slice offset, global vocabulary, the vocabulary statistics (vocab_stats) merged over
    the slices, x[ids] and x[y] of a vocabulary slice: one pmax and one psum of O(N * K)."""
    vocab = x.shape[1]
    off = _sharding.slice_offset(vocab, axes)
    xk = _xla_kd.slice_gather(x, ids, off)
    xy = _xla_kd.slice_gather(x, y[:, None], off)[:, 0]
    m, s, s_kd, sumz = (_xla_kd.vocab_stats(x, opts) if _xla_kd.needs_vocab_pass(opts)
                        else (jnp.full(y.shape, -jnp.inf, jnp.float32), None, None, None))
    m_all = jax.lax.pmax(m, axes)
    shift = jnp.where(jnp.isneginf(m), -jnp.inf, m - _xla_chunks.safe_max(m_all))
    weights = (jnp.exp(shift), jnp.exp(shift * _validate.inverse_temperature(opts.temperature)),
               1.0)  # sums relative to m
    sums = [a * w for a, w in zip((s, s_kd, sumz), weights) if a is not None]
    total = jax.lax.psum(jnp.stack(sums + [xy, *xk.T], axis=-1), axes)
    merged = iter(total[..., i] for i in range(len(sums)))
    vstats = (m_all,) + tuple(None if a is None else next(merged) for a in (s, s_kd, sumz))
    return (off, _sharding.global_vocab(vocab, axes), vstats, total[..., len(sums) + 1:],
            total[..., len(sums)])


def _row_fns(opts: KDOptions, impl: str) -> dict[str, _sharding.RowFns]:
    """fwd: (x, ids, lp, y, row_scale) -> (loss, stats); fwd_grad adds the unit-cotangent
    gradient; bwd: (x, ids, lp, y, stats) -> grad. The vocabulary-parallel forms run the XLA
    formulation on each slice: statistics merged with O(N) all-reduces, x at the teacher ids
    with one O(N*K) all-reduce."""
    if impl == "triton":
        def fwd(x, ids, lp, y, rs):
            return _triton_rows_fwd(x, ids, lp, y, rs, opts, write_grad=False)

        def fwd_grad(x, ids, lp, y, rs):
            return _triton_rows_fwd(x, ids, lp, y, rs, opts, write_grad=True)
    else:
        def fwd(x, ids, lp, y, rs):
            return _xla_kd.rows_fwd(x, ids, lp, y, rs, opts)

        def fwd_grad(x, ids, lp, y, rs):
            loss, stats = fwd(x, ids, lp, y, rs)
            return loss, stats, _xla_kd.rows_bwd(x, ids, lp, y, stats, opts)

    def fwd_vp(x, ids, lp, y, rs, axes):
        _, vocab, vstats, xk, xy = _vp_gathers(x, ids, y, opts, axes)
        return _xla_kd.rows_fwd(x, ids, lp, y, rs, opts, vocab=vocab, vstats=vstats, xk=xk,
                                xy=xy)

    def bwd_vp(x, ids, lp, y, stats, axes):
        off, vocab, _, xk, _ = _vp_gathers(x, ids, y, opts, axes)
        return (_xla_kd.rows_bwd(x, ids, lp, y, stats, opts, offset=off, vocab=vocab, xk=xk),)

    def fwd_grad_vp(x, ids, lp, y, rs, axes):
        loss, stats = fwd_vp(x, ids, lp, y, rs, axes)
        return (loss, stats) + bwd_vp(x, ids, lp, y, stats, axes)

    R, X = _sharding.ROW, _sharding.LIKE_X
    return dict(
        fwd=_sharding.RowFns(fwd, fwd_vp, (R, R)),
        fwd_grad=_sharding.RowFns(fwd_grad, fwd_grad_vp, (R, R, X)),
        bwd=_sharding.RowFns(lambda x, ids, lp, y, st: (_xla_kd.rows_bwd(x, ids, lp, y, st, opts),),
                             bwd_vp, (X,)),
        scale=scale_row_fns(impl),
    )


def _call(opts: KDOptions, role: str, *arrays):
    return _sharding.run(functools.partial(_row_fns, opts), opts, role, *arrays)


# ----------------------------------------------------------------------------- the op
def _reduce(loss_rows, opts: KDOptions):
    return loss_rows if opts.reduction == "none" else jnp.sum(loss_rows)


@dataclasses.dataclass(frozen=True)
class _Distill(_op.RowOp):
    """(x, ids, lp, y, row_scale) -> loss, for kd_loss and distill_loss. Row functions: ->
    loss, stats [N, 5] (+ grad); the weighting rule is the caller's `row_scale` [N, 2] (the
    cross-entropy and KD terms' weights, already divided by a "mean"'s denominators), so the
    rows are summed. The recompute scales the row weights (stats[:, 3:5]) by the cotangent."""
    opts: KDOptions
    num_aux = 4

    @property
    def fuses_grad(self) -> bool:
        return self.opts.implementation == "triton"

    def call(self, role, *arrays):
        return _call(self.opts, role, *arrays)

    def primal(self, outs, *aux):
        return _reduce(outs[0], self.opts)

    def saved(self, outs):
        return outs[1:]  # stats

    def row_cotangent(self, g, n):
        g = g.astype(jnp.float32)
        return g if self.opts.reduction == "none" else jnp.broadcast_to(g, (n,))

    def recompute(self, res, cot, cts):
        ids, lp, y, _ = res.inputs
        scaled = res.stats[0].at[:, 3:5].multiply(cot[:, None])
        return _call(self.opts, "bwd", res.x, ids, lp, y, scaled)[0]


# The KD kernels hold a row's teacher entries in one [BLOCK_K, 16] tile (BLOCK_K the next power
# of two >= K): Triton caps a tensor at 2**20 elements, so more entries do not compile on a GPU.
MAX_TRITON_K = 65536


def run_rows(x, ids, lp, y, row_scale, opts: KDOptions, implementation: str | None):
    """Dispatches the per-row machinery; returns the reduced loss or float32 [N] per row. More
    than MAX_TRITON_K teacher entries: implementation=None runs the XLA twin, "triton" raises
    NotImplementedError."""
    k = ids.shape[1]
    if k > MAX_TRITON_K:
        if implementation == "triton":
            raise NotImplementedError(
                f'implementation="triton" takes at most {MAX_TRITON_K} teacher entries per '
                f"token (the kernels' tile limit), got teacher_ids.shape[-1]={k}: use "
                f'implementation="xla" (or None) or fewer entries')
        implementation = "xla"
    return _op.apply(_Distill(opts), implementation, x, ids, lp, y, row_scale)


# ----------------------------------------------------------------------------- validation
def check_teacher(student_logits, teacher_ids, teacher_logprobs, mask) -> None:
    """Trace-time checks shared by kd_loss and distill_loss."""
    _common.check_logits(student_logits, "student_logits")
    for name, a in (("teacher_ids", teacher_ids), ("teacher_logprobs", teacher_logprobs),
                    ("mask", mask)):
        if a is not None and not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if not jnp.issubdtype(teacher_ids.dtype, jnp.integer):
        raise _validate.integer_dtype_error("teacher_ids", teacher_ids.dtype)
    _validate.check_teacher_shapes(student_logits.shape, teacher_ids.shape,
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


def prepare_entries(student_logits, teacher_ids, teacher_logprobs, mask, active=None,
                    vocab_axis=None):
    """Rows [N, V], int32 ids [N, K] with -1 at every entry that does not count (masked, out
    of [0, V), or in an inactive row), float32 log-probs [N, K] and whether each row has a
    counting entry [N]."""
    k = teacher_ids.shape[-1]
    vocab = student_logits.shape[-1]
    if vocab_axis is not None:  # inside shard_map: the logits are one slice of the vocabulary
        vocab *= jax.lax.axis_size(vocab_axis)
    ids = teacher_ids.reshape(-1, k)
    valid = (ids >= 0) & (ids < vocab)
    if mask is not None:
        valid = valid & (mask.reshape(-1, k) != 0)
    if active is not None:
        valid = valid & active[:, None]
    ids32 = jnp.where(valid, jnp.where(valid, ids, 0).astype(jnp.int32), -1)
    lp = teacher_logprobs.reshape(-1, k).astype(jnp.float32)
    return _common.flatten_rows(student_logits), ids32, lp, valid.any(axis=1)


def mean_denominator(count: jax.Array, num_items) -> jax.Array:
    """num_items as float32 when given, else max(count, 1) (so nothing counted gives 0)."""
    if num_items is not None:
        return jnp.asarray(num_items).astype(jnp.float32)
    return jnp.maximum(count, 1).astype(jnp.float32)


# ----------------------------------------------------------------------------- public API
@_common.public
def kd_loss(
    student_logits: jax.Array,
    teacher_ids: jax.Array,
    teacher_logprobs: jax.Array,
    mask: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    normalize: str = "full",
    reduction: str = "mean",
    num_items: int | jax.Array | None = None,
    implementation: str | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array:
    r"""Forward KL(teacher || student) over the teacher's top-K tokens, fused over the vocabulary.

    Per token, with :math:`s = x / T` the student logits at temperature `temperature`, the
    teacher entries :math:`(i_k, \ell_k)` (ids and log-probabilities), :math:`p_k = e^{\ell_k}`
    and :math:`\mathcal{K}` the entries that count (mask set, id in `[0, V)`):

    .. math::
        \mathrm{KL} = \sum_{k \in \mathcal{K},\, p_k > 0} p_k (\ell_k - s_{i_k} + L), \qquad
        L = \log\sum_{j=1}^{V} e^{s_j} \;(\text{"full"}) \text{ or }
            \log\sum_{k \in \mathcal{K}} e^{s_{i_k}} \;(\text{"topk"})

    "full" compares with the student's full softmax; "topk" renormalises the student over the
    teacher's ids. The teacher's probabilities are used as given (not renormalised). The
    gradient w.r.t. `student_logits` is :math:`(P\,\mathrm{softmax}(s)_j -
    \sum_{i_k = j} p_k) / T` with :math:`P = \sum_{k \in \mathcal{K}} p_k` ("full", dense
    over V), or nonzero only at the teacher's ids ("topk"). Teacher inputs, the mask and
    `num_items` get zero cotangents. No temperature**2 factor is applied.

    Under differentiation the Triton forward writes the gradient for a unit cotangent in the
    same pass: forward + backward read the logits once and write their gradient once. Other
    cotangents (a loss scale, weights) rescale float32 and bfloat16 gradients and recompute
    float16 ones with the cotangent applied before rounding (one more read of the logits).

    Repeated ids: every entry is its own term (the sums above run over entries, not distinct
    ids), so an id listed twice counts twice in KL and, for "topk", twice in L; its gradient
    column sums the entries' contributions. This is what autograd of the naive gather formula
    gives. Ids outside `[0, V)` count as masked: they add nothing and are never read.

    Args:
      student_logits: `[..., V]` float32, bfloat16 or float16.
      teacher_ids: `[..., K]` integer token ids, `1 <= K <= V` (more than 65536 entries run
        on the XLA twin: the Triton kernels' tile limit).
      teacher_logprobs: `[..., K]` float teacher log-probabilities at those ids (any float
        dtype, used in float32). Entries with probability 0 (log-prob -inf) add nothing.
      mask: `[..., K]` bool or 0/1: which entries count; None = all. An entry counts where
        `mask != 0`, so a float mask's NaN or 0.5 counts as True.
      temperature: T > 0, a Python float, dividing the student logits (as a multiply by
        1 / T in float32, at least float32's smallest normal number: above T = 8.5e37 the
        student softmax is uniform to float32 precision either way).
      normalize: "full" or "topk".
      reduction: "mean" (the sum over tokens divided by the number of tokens with at least
        one counting entry, 0 when there is none, or by `num_items`), "sum" or "none" (float32
        `[...]`).
      num_items: the denominator of "mean" (an int >= 1 or a positive scalar array), e.g. the
        token count of a whole accumulated batch when this call sees one micro-batch. An int
        is checked; an array's value cannot be at trace time: 0 gives an inf (or NaN) loss and
        gradient, a negative one flips their sign.
      implementation: None (Triton on a CUDA GPU, XLA elsewhere), "triton" or "xla".
      vocab_axis: inside `jax.shard_map` only, the mesh axis (or axes) splitting the
        vocabulary (see `cross_entropy`); teacher ids stay global. Under `jax.jit` the op
        partitions itself.

    Returns:
      The float32 loss (scalar, or `[...]` for "none"); its gradient w.r.t. `student_logits`
      has the logits' dtype.

    Raises:
      TypeError / ValueError at trace time for non-float logits, non-integer ids, K > V,
      shapes that do not match, temperature <= 0, or an unknown option.

    Example:
      >>> student = jax.random.normal(jax.random.key(0), (4, 8, 1000))
      >>> teacher = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (4, 8, 1000)))
      >>> logprobs, ids = jax.lax.top_k(teacher, 16)
      >>> loss, grad = jax.value_and_grad(kd_loss)(student, ids, logprobs)

    References:
      Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network", 2015.
    """
    student_logits = _common.as_logits(student_logits, "student_logits")
    check_teacher(student_logits, teacher_ids, teacher_logprobs, mask)
    t = check_options(temperature, normalize, reduction, num_items, implementation)
    vocab_axis = _common.check_vocab_axis(vocab_axis, student_logits, "student_logits")
    lead = student_logits.shape[:-1]
    x, ids, lp, has_entry = prepare_entries(student_logits, teacher_ids, teacher_logprobs, mask,
                                            vocab_axis=vocab_axis)
    n = x.shape[0]
    if n == 0:
        return _op.empty_loss(lead, reduction)
    scale = jnp.float32(1.0)
    if reduction == "mean":
        scale = 1.0 / mean_denominator(jnp.sum(has_entry), num_items)
    row_scale = jnp.stack([jnp.zeros((n,), jnp.float32), jnp.broadcast_to(scale, (n,))], axis=1)
    opts = KDOptions(temperature=t, normalize=normalize, reduction=reduction, distill=False,
                     ignore_index=-1, implementation="",
                     vocab_axis=vocab_axis)
    loss = run_rows(x, ids, lp, jnp.zeros((n,), jnp.int32), row_scale, opts, implementation)
    return loss.reshape(lead) if reduction == "none" else loss
