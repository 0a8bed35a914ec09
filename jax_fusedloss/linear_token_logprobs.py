"""Token log-probs (and entropy) of `hidden @ weight (+ bias)` without keeping `[N, V]` logits,
on the LM-head skeleton (`_lm_head`). This module holds only what is the log-probs': the row
functions of `token_logprobs` (`reductions._row_fns`), the outputs, the folding of per-token
cotangents and the label shift of the vocabulary walk, and the public function.

The cotangents of RL losses (PPO, GRPO: nonlinear functions of the log-probs) differ per token
and are known only in the backward, so the forward keeps per-row statistics (lse and its low
part, the entropy) and the backward recomputes the logits with the cotangents folded in: the
token walk ("fast", "low_precision") or the vocabulary walk ("lean"). One exception: "lean"
log-probs alone at temperature 1 (a GRPO loss without an entropy bonus). There a token's
cotangent only scales its row's gradient `onehot - softmax`, which is minus the gradient of
the token's cross-entropy, so the forward runs cross-entropy's fused row function (statistics
and the gradient written over the chunk's logits) and computes dH for a unit cotangent as
`linear_cross_entropy` does; the backward scales dH's rows by minus the cotangents and walks
the vocabulary for dW alone (no float32 `[N, D]` sum).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _lm_head, _sharding
from jax_fusedloss._xla import reductions as _xla_red
from jax_fusedloss._lm_head import DEFAULT_MODE, MODES
from jax_fusedloss.cross_entropy import CEOptions
from jax_fusedloss.cross_entropy import _row_fns as _ce_row_fns
from jax_fusedloss.linear_cross_entropy import _check_inputs
from jax_fusedloss.reductions import RedOptions, _row_fns


def _logprob_grad_fns(opts: RedOptions, impl: str) -> _sharding.RowFns:
    """The lean forward's row function for log-probs alone at temperature 1: cross-entropy's
    fused one (labels -1, out of range, are its ignored rows: loss 0, gradient 0), its outputs
    mapped to this op's statistics (lse, logp, lse_lo) and its gradient `softmax - onehot`
    (minus the log-prob's; `dh_cotangent` flips the sign)."""
    ce = _ce_row_fns(CEOptions(ignore_index=-1, reduction="none", smoothing=0.0, z_loss=0.0,
                               softcap=None, return_lse=False, implementation=impl,
                               vocab_axis=opts.vocab_axis, in_place=True), impl)["fwd_grad"]

    def mapped(fn):  # fn(z, y, row_scale[, axes=]) -> (loss, lse, coef, g)
        def run(z, y, **axes):
            loss, lse, coef, g = fn(z, y, jnp.ones(y.shape, jnp.float32), **axes)
            return lse, jnp.where(y < 0, jnp.nan, -loss), coef[:, 3], g
        return run

    return _sharding.RowFns(mapped(ce.local), mapped(ce.vocab_parallel), ce.out_kinds)


@dataclasses.dataclass(frozen=True)
class _LinearLogprobs(_lm_head.HeadOp):
    """token_logprobs' hooks. Forward row function: (labels) -> (lse, [entropy,] logp, lse_lo);
    backward: (lse with lse_lo [N, 2], entropy, cotangents [N, 3] = (g_lse, g_entropy,
    g_logp), labels). Labels arrive in `[0, V)` or as -1 (out of range, `linear_token_logprobs`
    maps every such label there)."""

    def row_fns(self, impl):
        opts = self.opts._replace(implementation=impl)
        fns = _row_fns(opts, impl, True)
        if self.row_cotangent_scales():
            fns = dict(fns, fwd_grad=_logprob_grad_fns(opts, impl))
        return fns

    def row_inputs(self, y):
        return (y,)

    def stat_shapes(self):
        return ((),) * (3 + self.opts.entropy)

    def primal(self, stats, y):
        return (stats[-2], stats[1]) if self.opts.entropy else (stats[-2],)

    def per_row_cotangent(self):
        return True

    def row_cotangent_scales(self):
        return not self.opts.entropy and self.opts.temperature == 1.0

    def dh_cotangent(self, aux, cts):
        (y,) = aux
        g = cts[0].astype(jnp.float32)
        # minus: the forward's dH is cross-entropy's; NaN rows as the recompute's (bwd_rows)
        return jnp.where((y < 0) & (g != 0), jnp.nan, -g)

    def bwd_rows(self, aux, stats, cts):
        (y,) = aux
        lse, lse_lo = stats[0], stats[-1]
        g_logp = cts[0].astype(jnp.float32)
        g_ent = cts[1].astype(jnp.float32) if self.opts.entropy else jnp.zeros_like(g_logp)
        # An out-of-range label's row is NaN where its log-prob's cotangent is nonzero (as
        # token_logprobs); through g_lse, so every walk and vocabulary block sees it.
        g_lse = jnp.where((y < 0) & (g_logp != 0), jnp.nan, 0.0)
        ent = stats[1] if self.opts.entropy else lse  # read only with the entropy
        return (jnp.stack([lse, lse_lo], axis=1), ent,
                jnp.stack([g_lse, g_ent, g_logp], axis=1), y)

    def gemm_stats(self):
        return self.opts.temperature, self.opts.entropy

    def gemm_finish(self, m, s, u, zy, rows, vocab):
        return tuple(o for o in _xla_red.finish(m, s, u, zy, rows[0], vocab) if o is not None)

    def gemm_grad_supported(self):
        return True

    def gemm_grad(self, rows):
        lse, ent, cot, y = rows
        t = 1.0 / self.opts.temperature
        g_lse, g_ent, g_logp = cot[:, 0], cot[:, 1], cot[:, 2]
        if self.opts.entropy:
            a, b = t * (g_lse - g_logp - g_ent * ent), -t * g_ent
        else:
            a, b = t * (g_lse - g_logp), jnp.zeros_like(g_lse)
        coef = jnp.stack([lse[:, 0], lse[:, 1], a, b, t * g_logp, jnp.zeros_like(a)], axis=1)
        return coef, y, t, self.opts.entropy

    def shift_block(self, rows, offset, size):
        """A block that does not own a row's label: the label term leaves (its softmax part
        joins g_lse), as the vocabulary-parallel backward of token_logprobs does."""
        lse, ent, cot, y = rows
        local = y - offset
        owned = (local >= 0) & (local < size)
        g_lse, g_ent, g_logp = cot[:, 0], cot[:, 1], cot[:, 2]
        cot = jnp.stack([jnp.where(owned, g_lse, g_lse - g_logp), g_ent,
                         jnp.where(owned, g_logp, 0.0)], axis=1)
        return lse, ent, cot, jnp.where(owned, local, 0)


@_common.public
def linear_token_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    weight_layout: str = "dv",
    temperature: float = 1.0,
    return_entropy: bool = False,
    mode: str = DEFAULT_MODE,
    implementation: str | None = None,
    chunk_size: int | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Log-probs of `labels` (and the entropy) under the LM head, without `[N, V]` logits.

    Equal to `token_logprobs(hidden @ W + bias, labels, ...)`: with
    :math:`z = (h W + b) / T` (`temperature` T),

    .. math::
        \log p_y = z_y - \mathrm{lse}(z), \qquad H = \mathrm{lse}(z) - \sum_j p_j z_j

    computed a chunk of logits at a time. The quantities of RL fine-tuning from hidden states
    (PPO, GRPO, policy gradients): differentiable w.r.t. `hidden`, `weight` and `bias` for any
    per-token cotangents (a clipped ratio, advantages, an entropy bonus). The forward keeps
    only per-token statistics; the backward recomputes the logits with the cotangents folded
    in (four matmuls in all), walking token chunks ("fast": dW summed in float32;
    "low_precision": in the weight's dtype) or vocabulary blocks ("lean": dW exact to float32
    accumulation, no weight-sized temporary). "lean" without the entropy at temperature 1
    computes dH in the forward instead (for a unit cotangent, each row scaled by its cotangent
    in the backward: no float32 `[N, D]` sum). Without `return_entropy` nothing of the entropy
    is computed.

    Per-token weights have no option here: the outputs are per token, so multiply them (the
    weight then reaches the gradient as part of the cotangent, at no extra cost).

    Args:
      hidden: `[..., D]` float32, bfloat16 or float16.
      weight: `[D, V]` (weight_layout="dv") or `[V, D]` ("vd", a tied embedding), same dtype
        as `hidden`; never transposed in memory.
      labels: `[...]` integer token ids in `[0, V)`.
      bias: optional `[V]` float bias added to the logits (in the logits' dtype).
      weight_layout: "dv" or "vd".
      temperature: a static float > 0 dividing the logits (the sampling temperature).
      return_entropy: also return the entropy `[...]` (from the same pass; its cotangent
        joins the same backward).
      mode: "fast", "low_precision" or "lean" (see `linear_cross_entropy`).
      implementation: None (Triton kernels on a CUDA GPU, XLA elsewhere), "triton" or "xla";
        the matmuls are XLA's either way.
      chunk_size: tokens per chunk of the walks (>= 1); None for
        `linear_cross_entropy.default_chunk_size` in the backward's token walk, and for the
        forward (statistics only, no dW per chunk) at most "low_precision"'s default (192 MiB
        of 16-bit logits: 640 rows at V=151936), whatever the mode.
      vocab_axis: inside `jax.shard_map` only: the mesh axis (or axes) splitting the
        vocabulary of `weight` (and `bias`), as in `linear_cross_entropy`; labels are global.
        Under `jax.jit` tokens-sharded `hidden` and vocabulary-sharded `weight` partition
        themselves.

    Returns:
      float32 `[...]` log-probs, or `(logprobs, entropy)`. A label outside `[0, V)` is never
      used as an address: its log-prob is NaN, and its gradient row (and so all of dW) is NaN
      only where that log-prob's cotangent is nonzero (so `jnp.where(valid, logp, 0)` masks it
      cleanly); its entropy is unaffected. Neither output has a gradient w.r.t. `labels`.

    Raises:
      TypeError / ValueError at trace time naming the argument: shapes that do not match,
      mismatched or non-float dtypes, a bad temperature, an unknown layout, mode or
      implementation, a chunk_size that is not a positive int. NotImplementedError for
      second-order derivatives.

    Example:
      >>> h = jax.random.normal(jax.random.key(0), (4, 8, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 1000)) * 0.1
      >>> y = jax.random.randint(jax.random.key(2), (4, 8), 0, 1000)
      >>> logp, ent = linear_token_logprobs(h, w, y, return_entropy=True)
      >>> adv = jax.random.normal(jax.random.key(3), (4, 8))
      >>> dh, dw = jax.grad(lambda h, w: -jnp.mean(
      ...     adv * linear_token_logprobs(h, w, y)), (0, 1))(h, w)
    """
    vocab = _check_inputs(hidden, weight, labels, bias, weight_layout)
    _common.check_choice(mode, "mode", MODES)
    _common.check_implementation(implementation)
    temperature = _common.check_static_float(temperature, "temperature", lo=0.0, lo_open=True)
    vocab_axis = _common.check_vocab_axis(vocab_axis, weight, "weight")
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    if n == 0:
        empty = jnp.zeros(lead, jnp.float32)
        return (empty, empty) if return_entropy else empty
    if chunk_size is not None:
        chunk_size = _common.check_static_int(chunk_size, "chunk_size", lo=1)
    head = _lm_head.head_options(n, vocab, hidden.dtype, weight_layout, mode, chunk_size,
                                   hidden.shape[-1])
    opts = RedOptions(temperature=temperature, entropy=return_entropy, implementation="",
                      vocab_axis=vocab_axis)
    if vocab_axis is not None:
        vocab *= jax.lax.axis_size(vocab_axis)
    y = _common.labels_to_int32(labels.reshape(-1), None, vocab)
    y = jnp.where((y < 0) | (y >= vocab), -1, y)  # one out-of-range value for every walk
    outs = _lm_head.apply(_LinearLogprobs(opts, head), implementation, h, weight, bias, y)
    outs = tuple(o.reshape(lead) for o in outs)
    return outs if return_entropy else outs[0]
