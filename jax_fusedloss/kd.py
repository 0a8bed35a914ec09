"""Top-K knowledge distillation: kd_loss and the op (`_Distill`) shared with distill_loss.

distill_loss (jax_fusedloss/distill.py) runs the same machinery with a label cross-entropy
folded into the same pass over the student logits; the row functions and options live in
`_kd_rows`, the checks and row preparation in `_kd_inputs`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _op, _sharding
from jax_fusedloss._kd_inputs import (NORMALIZATIONS, check_divergence, check_options,  # noqa: F401
                                      check_teacher, mean_denominator, prepare_entries,
                                      row_scales, token_weights)
from jax_fusedloss._kd_rows import DIVERGENCES, KDOptions, row_fns  # noqa: F401


def _call(opts: KDOptions, role: str, *arrays):
    return _sharding.run(functools.partial(row_fns, opts), opts, role, *arrays)


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
        # the XLA tail rows' forward writes the gradient too (no second walk)
        return self.opts.implementation == "triton" or self.opts.tail

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
    tail: bool = False,
    divergence: str = "kl",
    beta: float = 0.5,
    weights: jax.Array | None = None,
    where: jax.Array | None = None,
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

    The truncated KL above is not a divergence (it goes negative). `tail=True` (needs
    normalize="full") makes it one: the distinct counting ids :math:`d \in \mathcal{D}` and a
    tail bucket form a (K+1)-way categorical on each side,

    .. math::
        P_d = \sum_{k \in \mathcal{K},\, i_k = d} p_k, \quad
        P_t = \max(0, 1 - \textstyle\sum_{k \in \mathcal{K}} p_k), \quad
        Q_d = \mathrm{softmax}(s)_d, \quad
        Q_t = \textstyle\sum_{j \notin \mathcal{D}} \mathrm{softmax}(s)_j

    (:math:`Q_t` summed over the tail columns themselves, not as :math:`1 - \sum_d Q_d`; an id
    listed twice is one bucket; :math:`P_t = 0` when the ids cover the whole vocabulary) and,
    over the K+1 buckets b (zero-mass terms add nothing),

    .. math::
        \text{"kl"}: \sum_b P_b (\log P_b - \log Q_b), \qquad
        \text{"jsd"}: \sum_b \beta P_b \log\frac{P_b}{M_b}
            + (1 - \beta) Q_b \log\frac{Q_b}{M_b}, \quad M_b = \beta P_b + (1 - \beta) Q_b

    Both are >= 0 (up to rounding) and 0 exactly when the student matches the teacher on the
    ids and the tail. With :math:`G_b = \partial F / \partial Q_b` (kl: :math:`-P_b / Q_b`;
    jsd: :math:`(1 - \beta) \log(Q_b / M_b)`) and :math:`C = \sum_b G_b Q_b` the gradient
    w.r.t. :math:`s_j` is :math:`\mathrm{softmax}(s)_j (G_{b(j)} - C)`, divided by T for
    `student_logits`. divergence="jsd" requires tail=True. The tail forms run on Triton
    kernels (kernels/kd_tail.py) or their XLA twin, both writing the gradient in the forward;
    with `vocab_axis` they run the XLA rows on each slice.

    Per-token weights: each token's loss is multiplied by `weights` (no gradient flows to
    them); `where=False` counts a token as absent (its entries masked). "mean" then divides by
    the sum of the weights of the counted tokens (rows with a counting entry and `where` True;
    a zero sum counts as 1) unless `num_items` is given. The weights are per-row scales of the
    fused gradient: no extra pass over the logits.

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
      tail: add the tail bucket (above); requires normalize="full".
      divergence: "kl" (forward KL(teacher || student), the default) or "jsd" (requires
        tail=True).
      beta: the Jensen-Shannon weight in (0, 1) of "jsd" (0.5: the symmetric JSD).
      weights: optional float `[...]` per-token weights, broadcast against the tokens'
        shape `student_logits.shape[:-1]`; any sign.
      where: optional bool `[...]` (optax's convention): False tokens are ignored.
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
      verl RFC #7856 (the K+1 tail bucket); Agarwal et al., "On-Policy Distillation of
      Language Models" (GKD), 2024 (the generalised JSD).
    """
    student_logits = _common.as_logits(student_logits, "student_logits")
    check_teacher(student_logits, teacher_ids, teacher_logprobs, mask)
    t = check_options(temperature, normalize, reduction, num_items, implementation)
    tail, divergence, beta = check_divergence(tail, divergence, beta, normalize)
    vocab_axis = _common.check_vocab_axis(vocab_axis, student_logits, "student_logits")
    lead = student_logits.shape[:-1]
    w, keep = token_weights(weights, where, lead)
    x, ids, lp, has_entry = prepare_entries(student_logits, teacher_ids, teacher_logprobs, mask,
                                            keep, vocab_axis)
    n = x.shape[0]
    if n == 0:
        return _op.empty_loss(lead, reduction)
    row_scale = row_scales(n, ((0.0, None), (1.0, has_entry)), w, reduction, num_items)
    opts = KDOptions(temperature=t, normalize=normalize, reduction=reduction, distill=False,
                     ignore_index=-1, implementation="",
                     vocab_axis=vocab_axis, tail=tail,
                     divergence=divergence, beta=beta)
    loss = run_rows(x, ids, lp, jnp.zeros((n,), jnp.int32), row_scale, opts, implementation)
    return loss.reshape(lead) if reduction == "none" else loss
