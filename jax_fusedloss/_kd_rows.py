"""Top-K distillation's options and row functions (kd_loss, distill_loss and their LM-head
forms): the Triton launches, the XLA twins, their vocabulary-parallel forms, and the
(K+1)-bucket "tail" rows (kernels/kd_tail.py and their XLA twin `_xla/kd_tail.py`; the
vocabulary-parallel tail rows are XLA's)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _sharding, _triton_jax, _validate
from jax_fusedloss._xla import chunks as _xla_chunks
from jax_fusedloss._xla import kd as _xla_kd
from jax_fusedloss._xla import kd_tail as _xla_tail
from jax_fusedloss.cross_entropy import scale_row_fns

DIVERGENCES = ("kl", "jsd")


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
    # the (K+1)-bucket forms (_xla/kd_tail.py): tail bucket on, "kl" or "jsd", jsd's beta
    tail: bool = False
    divergence: str = "kl"
    beta: float = 0.5
    # the fused forward's gradient overwrites the logits (kernels/kd.py kd_fwd_plan's
    # in_place): only for logits that are dead after the call (the LM head's chunks)
    in_place: bool = False


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
                              itemsize=x.dtype.itemsize, in_place=write_grad and opts.in_place)

    return _triton_jax.run_rows(plan, ("x", "ids", "lp", "y", "row_scale"), x, ids, lp, y,
                                row_scale)


def _slice_options(x, opts: KDOptions) -> dict:
    return dict(temperature=opts.temperature, normalize=opts.normalize, distill=opts.distill,
                num_sms=_triton_jax.num_sms(), smoothing=opts.smoothing, softcap=opts.softcap,
                itemsize=x.dtype.itemsize)


def _triton_vocab_stats(x, opts: KDOptions, gather=None):
    """`_xla_kd.vocab_stats` of `[N, V]` logits through kd_partial_kernel (kd_partials_plan):
    the partials of each row's splits merged here (one split for many rows). With `gather` =
    (ids [N, K], y [N], off), x being the columns [off, off + V) of a vocabulary slice, also
    the raw logits at the labels and ids, float32 [N, K + 1] (0 outside the slice), read by
    the same launch: (stats, gathered)."""
    from jax_fusedloss.kernels import kd

    k = None if gather is None else gather[0].shape[-1]

    def plan(n, vocab):
        return kd.kd_partials_plan(n, vocab, gather_k=k, **_slice_options(x, opts))

    if gather is None:
        outs = _triton_jax.run_rows(plan, ("x",), x)
    else:
        ids, y, off = gather
        outs = _triton_jax.run_rows(plan, ("x", "ids", "y", "offset"), x, ids, y,
                                    _row_offsets(off, x.shape[0]))
    part = outs[0]
    m_i = part[..., 0]
    m = m_i.max(axis=1)
    shift = jnp.where(jnp.isneginf(m_i), -jnp.inf, m_i - _xla_chunks.safe_max(m)[:, None])
    inv_temp = _validate.inverse_temperature(opts.temperature)
    s = (part[..., 1] * jnp.exp(shift)).sum(axis=1)
    s_kd = (part[..., 2] * jnp.exp(shift * inv_temp)).sum(axis=1)
    sumz = part[..., 3].sum(axis=1)
    stats = (m, s if opts.distill else None, s_kd if _xla_kd.kd_stats_needed(opts) else None,
             sumz if opts.distill and opts.smoothing > 0 else None)
    return stats if gather is None else (stats, outs[1])


def _triton_slice_bwd(x, ids, lp, y, stats, opts: KDOptions, axes):
    """The unit-cotangent gradient of a vocabulary slice (rows weighted by stats[:, 3:5]) from
    the merged statistics, through kd_bwd_kernel: no collective (each device gathers the
    logits at the teacher ids in its own slice)."""
    vocab = x.shape[1]
    return triton_block_bwd(x, ids, lp, y, stats, opts, _sharding.slice_offset(vocab, axes),
                            _sharding.global_vocab(vocab, axes))


def _row_offsets(off, n: int):
    """A block's or slice's first global column `off` as the kernels' `offset` input: one
    int32 a row."""
    return jnp.broadcast_to(off, (n,)).astype(jnp.int32)


def _local_ids(ids, off, vocab: int):
    """Teacher ids as columns of the `vocab` logits starting at global column `off`; -1 (no
    entry) for ids outside them."""
    local = ids - off
    return jnp.where((local >= 0) & (local < vocab), local, -1)


def triton_block_bwd(x, ids, lp, y, stats, opts: KDOptions, off, total: int):
    """The gradient of the columns `[off, off + V)` of rows of `total` columns (x [N, V]; ids
    and labels y global; stats the rows' complete statistics with the cotangent folded into
    the row weights): a device's vocabulary slice, or a block of the LM head's vocabulary
    walk."""
    if opts.tail:
        return _triton_tail_bwd(x, ids, lp, y, stats, opts, off, total)
    from jax_fusedloss.kernels import kd

    n, vocab = x.shape
    ids_local = _local_ids(ids, off, vocab)

    def plan(rows, v):
        return kd.kd_bwd_plan(rows, v, ids.shape[-1], vocab_total=total,
                              ignore_index=opts.ignore_index, z_loss=opts.z_loss,
                              **_slice_options(x, opts))

    return _triton_jax.run_rows(plan, ("x", "ids", "lp", "y", "stats", "offset"), x, ids_local,
                                lp, y, stats, _row_offsets(off, n))[0]


# ----------------------------------------------------------------------------- row functions
def _vp_gathers(x, ids, y, opts: KDOptions, axes, vocab_stats=None):
    """Slice offset, global vocabulary, the vocabulary statistics merged over the slices,
    x[ids] and x[y] of a vocabulary slice: one pmax of O(N) and one all-reduce of O(N * K)
    (the sums and the gathered logits as two operands of one psum: no concatenated copy).
    `vocab_stats`: None for `_xla_kd.vocab_stats` and XLA gathers, or `_triton_vocab_stats`,
    whose launch gathers the slice's logits at the labels and ids as it walks the slice."""
    vocab = x.shape[1]
    off = _sharding.slice_offset(vocab, axes)
    walk = _xla_kd.needs_vocab_pass(opts)
    if walk and vocab_stats is not None:
        (m, s, s_kd, sumz), got = vocab_stats(x, opts, (ids.astype(jnp.int32),
                                                        y.astype(jnp.int32), off))
    else:
        got = jnp.concatenate([_xla_kd.slice_gather(x, y[:, None], off),
                               _xla_kd.slice_gather(x, ids, off)], axis=1)
        m, s, s_kd, sumz = (_xla_kd.vocab_stats(x, opts) if walk
                            else (jnp.full(y.shape, -jnp.inf, jnp.float32), None, None, None))
    m_all = jax.lax.pmax(m, axes)
    shift = jnp.where(jnp.isneginf(m), -jnp.inf, m - _xla_chunks.safe_max(m_all))
    weights = (jnp.exp(shift), jnp.exp(shift * _validate.inverse_temperature(opts.temperature)),
               1.0)  # sums relative to m
    sums = [a * w for a, w in zip((s, s_kd, sumz), weights) if a is not None]
    if sums:
        total, got = jax.lax.psum((jnp.stack(sums, axis=-1), got), axes)
        merged = iter(total[..., i] for i in range(len(sums)))
    else:
        got = jax.lax.psum(got, axes)
    vstats = (m_all,) + tuple(None if a is None else next(merged) for a in (s, s_kd, sumz))
    return off, _sharding.global_vocab(vocab, axes), vstats, got[..., 1:], got[..., 0]


def row_fns(opts: KDOptions, impl: str) -> dict[str, _sharding.RowFns]:
    """fwd: (x, ids, lp, y, row_scale) -> (loss, stats); fwd_grad adds the unit-cotangent
    gradient; bwd: (x, ids, lp, y, stats) -> grad. The vocabulary-parallel forms: each
    slice's statistics (Triton: kd_partial_kernel; XLA: vocab_stats) merged with O(N)
    all-reduces and x at the teacher ids and labels with one O(N*K) all-reduce, the rows
    finished from those (O(N*K), `_xla_kd.rows_fwd`), then the slice's gradient (Triton:
    kd_bwd_kernel from the merged statistics, no collective; XLA: rows_bwd)."""
    if opts.tail:
        return _tail_row_fns(opts, impl)
    if impl == "triton":
        vocab_stats = _triton_vocab_stats

        def fwd(x, ids, lp, y, rs):
            return _triton_rows_fwd(x, ids, lp, y, rs, opts, write_grad=False)

        def fwd_grad(x, ids, lp, y, rs):
            return _triton_rows_fwd(x, ids, lp, y, rs, opts, write_grad=True)

        def bwd_vp(x, ids, lp, y, stats, axes):
            return (_triton_slice_bwd(x, ids, lp, y, stats, opts, axes),)
    else:
        vocab_stats = None

        def fwd(x, ids, lp, y, rs):
            return _xla_kd.rows_fwd(x, ids, lp, y, rs, opts)

        def fwd_grad(x, ids, lp, y, rs):
            loss, stats = fwd(x, ids, lp, y, rs)
            return loss, stats, _xla_kd.rows_bwd(x, ids, lp, y, stats, opts)

        def bwd_vp(x, ids, lp, y, stats, axes):
            off, vocab, _, xk, _ = _vp_gathers(x, ids, y, opts, axes)
            return (_xla_kd.rows_bwd(x, ids, lp, y, stats, opts, offset=off, vocab=vocab,
                                     xk=xk),)

    def fwd_vp(x, ids, lp, y, rs, axes):
        _, vocab, vstats, xk, xy = _vp_gathers(x, ids, y, opts, axes, vocab_stats)
        return _xla_kd.rows_fwd(x, ids, lp, y, rs, opts, vocab=vocab, vstats=vstats, xk=xk,
                                xy=xy)

    def bwd(x, ids, lp, y, st):
        return (_xla_kd.rows_bwd(x, ids, lp, y, st, opts),)

    return _assemble(impl, fwd, fwd_grad, bwd, fwd_vp, bwd_vp)


def _assemble(impl, fwd, fwd_grad, bwd, fwd_vp, bwd_vp) -> dict[str, _sharding.RowFns]:
    """The role table of one implementation's KD rows; the vocabulary-parallel fused gradient
    is the slice's forward followed by its backward."""
    def fwd_grad_vp(x, ids, lp, y, rs, axes):
        loss, stats = fwd_vp(x, ids, lp, y, rs, axes)
        return (loss, stats) + bwd_vp(x, ids, lp, y, stats, axes)

    R, X = _sharding.ROW, _sharding.LIKE_X
    return dict(
        fwd=_sharding.RowFns(fwd, fwd_vp, (R, R)),
        fwd_grad=_sharding.RowFns(fwd_grad, fwd_grad_vp, (R, R, X)),
        bwd=_sharding.RowFns(bwd, bwd_vp, (X,)),
        scale=scale_row_fns(impl),
    )


def _triton_tail_fwd(x, ids, lp, y, row_scale, opts: KDOptions, write_grad: bool):
    """Per-row (loss, stats) of the tail forms and, if write_grad, the unit-cotangent gradient:
    kd_tail.tail_fwd_plan."""
    from jax_fusedloss.kernels import kd_tail

    def plan(n, vocab):
        return kd_tail.tail_fwd_plan(n, vocab, ids.shape[-1], write_grad=write_grad,
                                     num_sms=_triton_jax.num_sms(), itemsize=x.dtype.itemsize,
                                     in_place=write_grad and opts.in_place,
                                     **_tail_kernel_options(opts))

    return _triton_jax.run_rows(plan, ("x", "ids", "lp", "y", "row_scale"), x, ids, lp, y,
                                row_scale)


def _triton_tail_bwd(x, ids, lp, y, stats, opts: KDOptions, off=None, total: int | None = None):
    """The tail forms' unit-cotangent gradient from the rows' statistics (tail_bwd_plan): of
    whole rows, or (`off`, `total`) of the columns [off, off + V) of rows of `total` columns
    (ids and labels y global), a block of the LM head's vocabulary walk."""
    from jax_fusedloss.kernels import kd_tail

    names, arrays = ("x", "ids", "lp", "y", "stats"), (x, ids, lp, y, stats)
    if off is not None:
        names += ("offset",)
        arrays = (x, _local_ids(ids, off, x.shape[1]), lp, y, stats,
                  _row_offsets(off, x.shape[0]))

    def plan(rows, vocab):
        return kd_tail.tail_bwd_plan(rows, vocab, ids.shape[-1], num_sms=_triton_jax.num_sms(),
                                     offset="offset" if off is not None else "",
                                     vocab_total=total, **_tail_kernel_options(opts))

    return _triton_jax.run_rows(plan, names, *arrays)[0]


def _tail_kernel_options(opts: KDOptions) -> dict:
    return dict(temperature=opts.temperature, divergence=opts.divergence, beta=opts.beta,
                distill=opts.distill, ignore_index=opts.ignore_index,
                smoothing=opts.smoothing, z_loss=opts.z_loss, softcap=opts.softcap)


def _tail_row_fns(opts: KDOptions, impl: str) -> dict[str, _sharding.RowFns]:
    """row_fns of the (K+1)-bucket forms: kernels/kd_tail.py ("triton", its forward writing
    the gradient too) or the XLA rows of `_xla/kd_tail.py`; both share one statistics layout.
    The vocabulary-parallel forms are the XLA rows on each slice for either."""
    if impl == "triton":
        def fwd(x, ids, lp, y, rs):
            return _triton_tail_fwd(x, ids, lp, y, rs, opts, write_grad=False)

        def fwd_grad(x, ids, lp, y, rs):
            return _triton_tail_fwd(x, ids, lp, y, rs, opts, write_grad=True)

        def bwd(x, ids, lp, y, st):
            return (_triton_tail_bwd(x, ids, lp, y, st, opts),)
    else:
        def fwd(x, ids, lp, y, rs):
            return _xla_tail.rows_fwd(x, ids, lp, y, rs, opts)

        def bwd(x, ids, lp, y, st):
            return (_xla_tail.rows_bwd(x, ids, lp, y, st, opts),)

        def fwd_grad(x, ids, lp, y, rs):
            loss, stats = fwd(x, ids, lp, y, rs)
            return (loss, stats) + bwd(x, ids, lp, y, stats)

    def fwd_vp(x, ids, lp, y, rs, axes):
        off, vocab, vstats, xk, xy = _vp_gathers(x, ids, y, opts, axes)
        return _xla_tail.rows_fwd(x, ids, lp, y, rs, opts, vocab=vocab, offset=off,
                                  vstats=vstats, xk=xk, xy=xy,
                                  psum=lambda a: jax.lax.psum(a, axes))

    def bwd_vp(x, ids, lp, y, st, axes):
        off, vocab, _, xk, _ = _vp_gathers(x, ids, y, opts, axes)
        return (_xla_tail.rows_bwd(x, ids, lp, y, st, opts, offset=off, vocab=vocab, xk=xk),)

    return _assemble(impl, fwd, fwd_grad, bwd, fwd_vp, bwd_vp)


def stats_width(opts: KDOptions) -> int:
    """Fields of the per-row statistics the forward rows return (9: kernels/kd.py's
    STATS_FIELDS, not imported here since that module imports triton)."""
    return _xla_tail.TAIL_FIELDS if opts.tail else 9
