"""distill_loss: label cross-entropy plus top-K distillation in one pass over the logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _op, _validate
from jax_fusedloss.cross_entropy import check_ce_options
from jax_fusedloss.kd import (KDOptions, check_divergence, check_options, check_teacher,
                              prepare_entries, row_scales, run_rows, token_weights)


@_common.public
def distill_loss(
    student_logits: jax.Array,
    labels: jax.Array,
    teacher_ids: jax.Array,
    teacher_logprobs: jax.Array,
    mask: jax.Array | None = None,
    *,
    alpha: float,
    temperature: float = 1.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    normalize: str = "full",
    reduction: str = "mean",
    num_items: int | jax.Array | None = None,
    temperature_squared: bool = False,
    check_labels: bool = False,
    tail: bool = False,
    divergence: str = "kl",
    beta: float = 0.5,
    weights: jax.Array | None = None,
    where: jax.Array | None = None,
    implementation: str | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array:
    r"""`alpha * cross_entropy + (1 - alpha) * kd_loss`, reading the student logits once.

    Per token with label :math:`y`, logits :math:`x`, :math:`z = c \tanh(x / c)` when
    `logit_softcap=c` is set (else :math:`z = x`), :math:`\mathrm{lse} = \log\sum_j e^{z_j}`,
    :math:`\epsilon` = `label_smoothing`, :math:`\lambda_z` = `z_loss` and
    :math:`c_T = T^2` when `temperature_squared` else 1:

    .. math::
        \ell = \alpha \, \mathrm{CE}(z, y) + (1 - \alpha)\, c_T\, \mathrm{KL}_T(z), \qquad
        \mathrm{CE} = (1-\epsilon)(\mathrm{lse} - z_y)
            + \epsilon(\mathrm{lse} - \tfrac{1}{V}\sum_j z_j) + \lambda_z \mathrm{lse}^2

    where CE is `cross_entropy`'s per-token loss of z (temperature 1) and
    :math:`\mathrm{KL}_T(z)` is `kd_loss`'s per-token value for the student logits z at
    temperature T. The softcap transforms the logits both terms see and comes first: the KD
    term's student log-probabilities are `log_softmax(z / T)`, i.e. the temperature divides
    the capped logits (the cap is part of the model's logits, as in Gemma 2; the temperature
    is the distillation's). Label smoothing and the z-loss belong to the cross-entropy term
    only. With all three at their defaults this is
    :math:`\alpha(\mathrm{logsumexp}(x) - x_y) + (1-\alpha) c_T \mathrm{KL}_T(x)`.

    One Triton program walks a row once, keeping two online softmaxes (of z and of z / T; one
    when T = 1), and under differentiation writes the combined gradient
    :math:`\alpha\,\partial\mathrm{CE} + (1-\alpha)\,c_T\,\partial\mathrm{KL}_T` in the
    same program, so forward + backward read the logits once and write the gradient once.

    The :math:`T^2` factor (Hinton et al., 2015) keeps the KD gradient's scale independent of
    T; it is off by default and applied only when `temperature_squared=True`.

    A token whose label is `ignore_index` is skipped by both terms (its teacher entries count
    as masked). A label outside `[0, V)` that is not `ignore_index` gives that token NaN loss
    and a NaN gradient row, as in `cross_entropy`; teacher entries follow `kd_loss`'s rules
    (masked and out-of-range ids add nothing; repeated ids count once per entry).

    Reductions: "none" returns the float32 per-token :math:`\ell`; "sum" adds them; "mean"
    divides the cross-entropy sum by the number of non-ignored tokens and the KD sum by the
    number of tokens with at least one counting teacher entry (each 0 when its count is 0),
    or both by `num_items` when given.

    `tail`, `divergence` and `beta` choose the KD term :math:`\mathrm{KL}_T` exactly as in
    `kd_loss` (the (K+1)-bucket "kl" or "jsd" of the student's softmax of z / T).

    Per-token weights (`weights`, `where`; no gradient flows to them) multiply each token's
    :math:`\ell`; `where=False` makes a token ignored (as its label being `ignore_index`).
    With weights "mean" divides each term's sum by the sum of the weights of the tokens it
    counts (a zero sum counts as 1) unless `num_items` is given. They are per-row scales of
    the fused gradient.

    Args:
      student_logits: `[..., V]` float32, bfloat16 or float16.
      labels: `[...]` integer class ids in `[0, V)`, or `ignore_index`.
      teacher_ids: `[..., K]` integer token ids, `1 <= K <= V`.
      teacher_logprobs: `[..., K]` float teacher log-probabilities at those ids.
      mask: `[..., K]` bool or 0/1: which teacher entries count; None = all.
      alpha: weight of the cross-entropy, in [0, 1].
      temperature: T > 0 (a Python float) of the KD term.
      ignore_index: label value whose tokens are skipped.
      label_smoothing: epsilon in [0, 1] of the cross-entropy term (as `cross_entropy`).
      z_loss: coefficient of `lse**2` in the cross-entropy term, >= 0 (as `cross_entropy`).
      logit_softcap: c > 0 for `z = c * tanh(student_logits / c)`, the logits both terms see,
        or None (as `cross_entropy`).
      normalize: "full" or "topk" (see `kd_loss`).
      reduction: "mean", "sum" or "none".
      num_items: denominator of both "mean" terms (an int >= 1 or a positive scalar array).
      temperature_squared: multiply the KD term by T**2 (a ValueError naming `temperature`
        where T**2 overflows float32, T > 1.8e19).
      check_labels: debugging aid: raise a ValueError naming the first label outside
        `[0, V)` that is not `ignore_index` (its index and value, and how many there are),
        checked at run time through `jax.debug.callback` (under `jax.jit` JAX re-raises it as
        a `JaxRuntimeError` carrying that message); costs a device-to-host sync per call.
      tail, divergence, beta: the KD term's form (see `kd_loss`).
      weights: optional float `[...]` per-token weights, broadcast against `labels.shape`.
      where: optional bool `[...]`: False tokens are ignored.
      implementation: None (Triton on a CUDA GPU, XLA elsewhere), "triton" or "xla".
      vocab_axis: inside `jax.shard_map` only, the mesh axis (or axes) splitting the
        vocabulary (see `cross_entropy`); under `jax.jit` the op partitions itself.

    Returns:
      The float32 loss (scalar, or `[...]` for "none"); its gradient w.r.t. `student_logits`
      has the logits' dtype, and the other inputs get zero cotangents.

    Raises:
      TypeError / ValueError at trace time for bad shapes, dtypes or options (as `kd_loss`,
      plus labels, alpha and the cross-entropy options).

    Example:
      >>> student = jax.random.normal(jax.random.key(0), (4, 8, 1000))
      >>> labels = jax.random.randint(jax.random.key(1), (4, 8), 0, 1000)
      >>> teacher = jax.nn.log_softmax(jax.random.normal(jax.random.key(2), (4, 8, 1000)))
      >>> logprobs, ids = jax.lax.top_k(teacher, 16)
      >>> loss = distill_loss(student, labels, ids, logprobs, alpha=0.5, temperature=2.0)

    References:
      Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network", 2015.
    """
    student_logits = _common.as_logits(student_logits, "student_logits")
    check_teacher(student_logits, teacher_ids, teacher_logprobs, mask)
    _common.check_int_array(labels, "labels", student_logits.shape[:-1],
                            "student_logits.shape[:-1]")
    t = check_options(temperature, normalize, reduction, num_items, implementation)
    tail, divergence, beta = check_divergence(tail, divergence, beta, normalize)
    alpha = _common.check_static_float(alpha, "alpha", lo=0.0, hi=1.0)
    ignore_index = _common.check_static_int(ignore_index, "ignore_index")
    smoothing, z_loss, softcap = check_ce_options(label_smoothing, z_loss, logit_softcap)
    vocab_axis = _common.check_vocab_axis(vocab_axis, student_logits, "student_logits")
    lead = labels.shape
    vocab = _common.vocab_size(student_logits, vocab_axis)
    y = _common.labels_to_int32(labels.reshape(-1), ignore_index, vocab)
    _common.check_labels(labels, vocab, ignore_index, enabled=check_labels)
    w, keep = token_weights(weights, where, lead)
    if keep is not None:  # where=False: the token is ignored by both terms
        y = jnp.where(keep, y, jnp.int32(ignore_index))
    active = y != ignore_index
    x, ids, lp, has_entry = prepare_entries(student_logits, teacher_ids, teacher_logprobs, mask,
                                            active, vocab_axis)
    n = x.shape[0]
    if n == 0:
        return _op.empty_loss(lead, reduction)
    kd_w = (1.0 - float(alpha)) * _validate.check_temperature_squared(t, temperature_squared)
    row_scale = row_scales(n, ((alpha, active), (kd_w, has_entry)), w, reduction, num_items)
    opts = KDOptions(temperature=t, normalize=normalize, reduction=reduction, distill=True,
                     ignore_index=int(ignore_index), implementation="",
                     vocab_axis=vocab_axis, smoothing=smoothing,
                     z_loss=z_loss, softcap=softcap, tail=tail, divergence=divergence,
                     beta=beta)
    loss = run_rows(x, ids, lp, y, row_scale, opts, implementation)
    return loss.reshape(lead) if reduction == "none" else loss
