"""Top-K distillation from hidden states on the LM-head skeleton (`_lm_head`: walks, memory
modes, partitioning, the custom_vjp): distillation's hooks (`_LinearKD`, the row functions of
kd_loss / distill_loss) and the shared body of the public functions in `linear_kd.py`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _lm_head, _sharding, _validate
from jax_fusedloss._kd_inputs import (check_divergence, check_options, check_teacher_arrays,
                                      row_scales, teacher_rows, token_weights)
from jax_fusedloss._kd_rows import KDOptions, row_fns, stats_width, triton_block_bwd
from jax_fusedloss._lm_head import MODES
from jax_fusedloss._xla import kd as _xla_kd
from jax_fusedloss._xla import kd_tail as _xla_tail
from jax_fusedloss.kd import MAX_TRITON_K


@dataclasses.dataclass(frozen=True)
class _LinearKD(_lm_head.HeadOp):
    """Distillation's hooks. Forward rows (ids, lp, y, row_scale) -> (loss, stats); backward
    rows (ids, lp, y, stats with the cotangent folded into the row weights 3:5, offset): the
    offset [N] (one value) is the first global column of the logits the backward row function
    sees, so the teacher ids and labels stay global in every block of the vocabulary walk (a
    shifted label could land on `ignore_index`)."""
    vocab: int = 0  # the global vocabulary

    def row_fns(self, impl):
        # each chunk's logits are a temporary of the walk: the fused KD forward's gradient
        # overwrites them
        opts = self.opts._replace(implementation=impl, in_place=True)
        fns = dict(row_fns(opts, impl))
        rows_bwd = _xla_tail.rows_bwd if opts.tail else _xla_kd.rows_bwd
        vocab, vp = self.vocab, fns["bwd"].vocab_parallel

        def bwd(z, ids, lp, y, st, off):
            o = off[0]
            if impl == "triton":  # kd_bwd_kernel / tail_bwd_kernel on the block
                return (triton_block_bwd(z, ids, lp, y, st, opts, o, vocab),)
            return (rows_bwd(z, ids, lp, y, st, opts, offset=o, vocab=vocab,
                             xk=_xla_kd.slice_gather(z, ids, o)),)

        def bwd_vp(z, ids, lp, y, st, off, axes):
            del off  # the token walk's: 0 (vp finds its slice's offset itself)
            return vp(z, ids, lp, y, st, axes=axes)

        fns["bwd"] = _sharding.RowFns(bwd, bwd_vp, (_sharding.LIKE_X,))
        return fns

    def row_inputs(self, ids, lp, y, row_scale):
        return ids, lp, y, row_scale

    def stat_shapes(self):
        return ((), (stats_width(self.opts),))

    def primal(self, stats, *aux):
        loss = stats[0]
        return (loss if self.opts.reduction == "none" else jnp.sum(loss),)

    def per_row_cotangent(self):
        return self.opts.reduction == "none"

    def row_cotangent_scales(self):
        return True  # one output, the loss (per token with reduction="none")

    def bwd_rows(self, aux, stats, cts):
        ids, lp, y, _ = aux
        n = ids.shape[0]
        cot = jnp.broadcast_to(cts[0].astype(jnp.float32), (n,))
        st = stats[1].at[:, 3:5].multiply(cot[:, None])
        return ids, lp, y, st, jnp.zeros((n,), jnp.int32)

    def shift(self, rows, offset):
        *rest, off = rows
        return (*rest, jnp.broadcast_to(offset, off.shape).astype(jnp.int32))


def run_linear(hidden, weight, labels, teacher_ids, teacher_logprobs, mask, *, bias,
               weight_layout, alpha, temperature, ignore_index, smoothing_opts, normalize,
               reduction, num_items, temperature_squared, tail, divergence, beta, weights,
               where, mode, implementation, chunk_size, vocab_axis):
    """The body of linear_kd_loss (labels None, alpha None) and linear_distill_loss."""
    vocab = _lm_head.check_head(hidden, weight, bias, weight_layout)
    lead = hidden.shape[:-1]
    check_teacher_arrays(lead + (vocab,), teacher_ids, teacher_logprobs, mask)
    distill = labels is not None
    if distill:
        _common.check_int_array(labels, "labels", lead, "hidden.shape[:-1]")
    t = check_options(temperature, normalize, reduction, num_items, implementation)
    tail, divergence, beta = check_divergence(tail, divergence, beta, normalize)
    _common.check_choice(mode, "mode", MODES)
    smoothing, z_loss, softcap = _common.check_ce_options(*smoothing_opts)
    ignore_index = _common.check_static_int(ignore_index, "ignore_index")
    vocab_axis = _common.check_vocab_axis(vocab_axis, weight, "weight")
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    if n == 0:
        return jnp.zeros(lead, jnp.float32) if reduction == "none" else jnp.float32(0.0)
    if chunk_size is not None:
        chunk_size = _common.check_static_int(chunk_size, "chunk_size", lo=1)
    head = _lm_head.head_options(n, vocab, hidden.dtype, weight_layout, mode, chunk_size,
                                   hidden.shape[-1])
    if vocab_axis is not None:
        vocab *= jax.lax.axis_size(vocab_axis)
    w, keep = token_weights(weights, where, lead)
    if distill:
        y = _common.labels_to_int32(labels.reshape(-1), ignore_index, vocab)
        if keep is not None:
            y = jnp.where(keep, y, jnp.int32(ignore_index))
        active = y != ignore_index
    else:
        y, active = jnp.zeros((n,), jnp.int32), keep
    ids, lp, has_entry = teacher_rows(teacher_ids, teacher_logprobs, mask, vocab, active)
    kd_w = 1.0 if not distill else (1.0 - alpha) * _validate.check_temperature_squared(
        t, temperature_squared)
    ce_term = (alpha, active) if distill else (0.0, None)
    row_scale = row_scales(n, (ce_term, (kd_w, has_entry)), w, reduction, num_items)
    opts = KDOptions(temperature=t, normalize=normalize, reduction=reduction, distill=distill,
                     ignore_index=ignore_index if distill else -1, implementation="",
                     vocab_axis=vocab_axis, smoothing=smoothing if distill else 0.0,
                     z_loss=z_loss if distill else 0.0, softcap=softcap, tail=tail,
                     divergence=divergence, beta=beta)
    if teacher_ids.shape[-1] > MAX_TRITON_K:
        if implementation == "triton":
            raise NotImplementedError(
                f'implementation="triton" runs at most {MAX_TRITON_K} teacher entries: use '
                'implementation="xla" or None')
        implementation = "xla"
    loss, = _lm_head.apply(_LinearKD(opts, head, vocab=vocab), implementation, h, weight, bias,
                           ids, lp, y, row_scale)
    return loss.reshape(lead) if reduction == "none" else loss
