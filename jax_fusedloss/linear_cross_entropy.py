"""Fused linear cross-entropy: the cross-entropy of `hidden @ weight (+ bias)` without keeping
`[N, V]` logits, on the LM-head skeleton (`_lm_head`: the token and vocabulary walks, the memory
modes, partitioning, the custom_vjp). This module holds only what is cross-entropy's: its row
functions (`cross_entropy._row_fns`), the "mean" weighting, the outputs and the cotangent
folding, and the public function.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _lm_head, _weights
from jax_fusedloss._lm_head import MODES, DEFAULT_MODE
from jax_fusedloss._xla import cross_entropy as _xla_ce
from jax_fusedloss._xla.chunks import lse_parts
from jax_fusedloss.cross_entropy import CEOptions, _row_cotangent, _row_fns

# Each chunk's logits gradient overwrites the chunk's logits (a temporary of the walk): the
# Triton cross-entropy launches alias them (CEOptions.in_place). False only to compare.
_IN_PLACE = True


def default_chunk_size(n: int, vocab: int, dim: int, dtype, mode: str = DEFAULT_MODE) -> int:
    """Tokens per chunk when `chunk_size=None` (`jax_fusedloss.kernels.linear_ce.chunk_rows`):
    the largest power of two C (at most N) whose `[C, V]` logits fit `CHUNK_BUDGET_BYTES` (128
    MiB: 512 rows at V=128256 in bf16; their gradient overwrites them in place), but for 16-bit
    logits at least 4096 rows with mode="fast" and 1024 with "lean", and with "low_precision"
    the largest multiple of 128 rows within 192 MiB of logits (768 at V=128256: each chunk's
    update of dW reads and writes all of dW, so fewer, longer chunks are faster, and the
    chunk's logits are the mode's memory). `dim` does not change it."""
    del dim
    return _lm_head.default_chunk(n, vocab, dtype, mode)


@dataclasses.dataclass(frozen=True)
class _LinearCE(_lm_head.HeadOp):
    """Cross-entropy's hooks: the forward row function takes (labels, row_scale) and gives
    (loss, lse, coef [N, 5]); the backward's takes (labels, lse, coef with the cotangents
    folded in, as `cross_entropy._CrossEntropy.recompute` does). The op's aux arrays are
    (labels, per-token weights, "mean" denominator) (`_weights`)."""

    def row_fns(self, impl):
        return _row_fns(self.opts._replace(implementation=impl, in_place=_IN_PLACE), impl)

    def row_inputs(self, y, w, denom):
        return y, _weights.row_scale(w, denom)

    def stat_shapes(self):
        return ((), (), (5,))  # loss, lse, coef (kernels.cross_entropy.COEF_FIELDS)

    def primal(self, stats, y, w, denom):
        return _weights.reduce(stats[0], y, w, denom, self.opts.ignore_index,
                               self.opts.reduction), stats[1]

    def per_row_cotangent(self):
        return self.opts.reduction == "none" or self.opts.return_lse

    def row_cotangent_scales(self):
        return not self.opts.return_lse  # the lse's cotangent would add a softmax term

    def bwd_rows(self, aux, stats, cts):
        (y, *_), (_, lse, coef) = aux, stats
        cot = _row_cotangent(cts[0], y.shape[0], self.opts)
        # (a, b, c) scale with the loss cotangent; the lse_lo fields (3, 4) stay exact.
        coef = coef.at[:, :3].multiply(cot[:, None]).at[:, 0].add(cts[1].astype(jnp.float32))
        return y, lse, coef

    def shift(self, rows, offset):
        y, lse, coef = rows
        return y - offset, lse, coef

    def gemm_stats(self):
        if self.opts.softcap is not None or self.opts.smoothing > 0:
            return None  # (the fused GEMM keeps neither a tanh nor the sum of the logits)
        return 1.0, False

    def gemm_finish(self, m, s, u, zy, rows, vocab):
        y, row_scale = rows
        lse, lse_lo = lse_parts(m, s)
        loss, coef = _xla_ce.finish(lse, lse_lo, zy, None, y, row_scale, self.opts, vocab)
        return loss, lse, coef

    def gemm_grad_supported(self):
        return self.opts.softcap is None  # (the fused gradient GEMM has no tanh)

    def gemm_grad(self, rows):
        y, lse, coef = rows
        w = coef[:, 4]
        lse_lo = jnp.where(w != 0.0, coef[:, 3] / jnp.where(w != 0.0, w, 1.0), 0.0)
        zero = jnp.zeros_like(lse)
        return (jnp.stack([lse, lse_lo, coef[:, 0], zero, -coef[:, 1], -coef[:, 2]], axis=1),
                y, 1.0, False)


def _check_inputs(hidden, weight, labels, bias, weight_layout):
    vocab = _lm_head.check_head(hidden, weight, bias, weight_layout)
    _common.check_int_array(labels, "labels", hidden.shape[:-1], "hidden.shape[:-1]")
    return vocab


@_common.public
def linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    weight_layout: str = "dv",
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
    mode: str = DEFAULT_MODE,
    implementation: str | None = None,
    chunk_size: int | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Cross-entropy of the logits `hidden @ weight (+ bias)` without keeping `[N, V]` logits.

    Equal to `cross_entropy(hidden @ W + bias, labels, ...)` (same options, same loss; see
    `cross_entropy` for the formula), computed a block of logits at a time: no more than
    `chunk_size * V` logits exist at once (with the Triton kernels their gradient overwrites
    them in place). The gradients w.r.t. `hidden`, `weight` and `bias` come from one of three
    walks, chosen by `mode`, which trades speed, memory and precision:

    - "fast" (default): three matmuls; dW summed over the chunks in a float32 `[D, V]` buffer
      (the memory it costs beyond one chunk's logits).
    - "low_precision": three matmuls; dW summed in the weight's dtype, rounded once per chunk
      (as Liger does); nothing weight-sized beyond the returned gradient.
    - "lean": four matmuls (the logits are recomputed in the backward); dW exact to float32
      accumulation, each entry rounded once; nothing beyond one block of logits (and the
      weight's and dW's blocks).

    "fast" and "low_precision" compute the gradients for a unit cotangent in the forward (three
    matmuls per chunk: logits, `g W^T`, `h^T g`) and the backward scales them; "lean" computes
    dH so in the forward (two matmuls per chunk), keeps per-row statistics, and its backward
    walks blocks of vocabulary columns over all tokens, writing each block of dW once. float16
    inputs, `reduction="none"` and `return_lse=True` (per-token cotangents) recompute the
    logits in the backward, with the cotangent applied before anything is rounded to float16
    (no entry a loss scale would save is flushed); "lean" with `reduction="none"` in bfloat16
    or float32 keeps its forward dH (each row scaled by its cotangent in the backward).
    Measured numbers: the README's LM-head table and the docs' performance page.

    Args:
      hidden: `[..., D]` float32, bfloat16 or float16.
      weight: `[D, V]` (weight_layout="dv", Flax's `nnx.Linear(D, V).kernel`) or `[V, D]`
        ("vd", a tied embedding table), same dtype as `hidden`; never transposed in memory.
      labels: `[...]` integer class ids in `[0, V)`, or `ignore_index`. A label outside both
        makes that token's loss NaN and, since its gradient row enters `h^T g`, all of dW NaN;
        nothing is read out of bounds.
      bias: optional `[V]` float bias added to the logits (in the logits' dtype).
      weight_layout: "dv" or "vd".
      ignore_index, reduction, label_smoothing, z_loss, logit_softcap, return_lse: as in
        `cross_entropy`; "mean" divides by the number of non-ignored tokens of the batch.
      check_labels: as in `cross_entropy`.
      weights, where, num_items: per-token weights, a bool mask (False: ignored) and the
        denominator of "mean", as in `cross_entropy`; a weight joins the per-row scale of the
        fused gradient (no extra pass, no recompute). No gradient w.r.t. them.
      mode: "fast", "low_precision" or "lean" (the table above).
      implementation: None (Triton cross-entropy kernels on a CUDA GPU, XLA elsewhere),
        "triton" or "xla"; the matmuls are XLA's either way.
      chunk_size: the memory knob: tokens per chunk of the forward's walk (>= 1), and the
        lean backward's blocks hold as many logits (`chunk_size * V`); None for
        `default_chunk_size`: `[C, V]` logits within
        `jax_fusedloss.kernels.linear_ce.CHUNK_BUDGET_BYTES` (128 MiB), but for 16-bit logits
        at least 4096 rows ("fast") or 1024 ("lean"), and in "low_precision" as many rows as
        192 MiB of logits hold (a multiple of 128), where each chunk's update of dW reads and
        writes all of dW or the chunk's GEMM runs short (fewer, longer chunks are faster); the
        lean backward's blocks then keep the 128 MiB budget. A ragged
        last chunk is allowed.
      vocab_axis: inside `jax.shard_map` only: the mesh axis name (or names) over which the
        vocabulary of `weight` (and `bias`) is split, device i of those axes holding rows
        (for "vd"; columns for "dv") `[i * V_local, (i + 1) * V_local)`; `labels` are global
        ids. Softmax statistics are merged with O(C) all-reduces, dH is summed over those
        axes and each device gets dW/db of its slice. Tokens sharded across other manual axes
        need nothing: the gradient of a weight that does not vary across them is summed
        across them. Under `jax.jit` with sharded inputs nothing is needed: tokens-sharded
        `hidden` and vocabulary-sharded `weight` partition themselves (docs: multi-GPU).

    Returns:
      The float32 loss (scalar, or `[...]` for "none"); `(loss, lse)` with `return_lse`.

    Raises:
      TypeError / ValueError at trace time naming the argument: shapes that do not match,
      mismatched or non-float dtypes, an unknown layout, mode, option or implementation, a
      chunk_size that is not a positive int. NotImplementedError for second-order derivatives.

    Example:
      >>> h = jax.random.normal(jax.random.key(0), (4, 8, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 1000)) * 0.1
      >>> y = jax.random.randint(jax.random.key(2), (4, 8), 0, 1000)
      >>> loss, (dh, dw) = jax.value_and_grad(linear_cross_entropy, (0, 1))(h, w, y)
      >>> lean = linear_cross_entropy(h, w, y, mode="lean")
    """
    vocab = _check_inputs(hidden, weight, labels, bias, weight_layout)
    _common.check_choice(reduction, "reduction", _common.REDUCTIONS)
    _common.check_choice(mode, "mode", MODES)
    _common.check_implementation(implementation)
    smoothing, zl, logit_softcap = _common.check_ce_options(label_smoothing, z_loss, logit_softcap)
    ignore_index = _common.check_static_int(ignore_index, "ignore_index")
    vocab_axis = _common.check_vocab_axis(vocab_axis, weight, "weight")
    lead = labels.shape
    _weights.check(weights, where, num_items, reduction, lead)
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    if chunk_size is not None:
        chunk_size = _common.check_static_int(chunk_size, "chunk_size", lo=1)
    if n == 0:
        loss = jnp.zeros(lead, jnp.float32) if reduction == "none" else jnp.float32(0.0)
        return (loss, jnp.zeros(lead, jnp.float32)) if return_lse else loss
    ce_opts = CEOptions(ignore_index=ignore_index, reduction=reduction, smoothing=smoothing,
                        z_loss=zl, softcap=logit_softcap, return_lse=return_lse,
                        implementation="", vocab_axis=vocab_axis)
    head = _lm_head.head_options(n, vocab, hidden.dtype, weight_layout, mode, chunk_size,
                                   hidden.shape[-1])
    if vocab_axis is not None:
        vocab *= jax.lax.axis_size(vocab_axis)
    y = _common.labels_to_int32(labels.reshape(-1), ignore_index, vocab)
    _common.check_labels(labels, vocab, ignore_index, enabled=check_labels)
    rows = _weights.prepare(y, lead, ignore_index, reduction, weights, where, num_items)
    loss, lse = _lm_head.apply(_LinearCE(ce_opts, head), implementation, h, weight, bias, *rows)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, lse.reshape(lead)) if return_lse else loss
