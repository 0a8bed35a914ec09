"""linear_kd_loss and linear_distill_loss: kd_loss and distill_loss of the logits
`hidden @ weight (+ bias)` without keeping `[N, V]` logits (the hooks: `_linear_kd`)."""
from __future__ import annotations

import jax

from jax_fusedloss import _common
from jax_fusedloss._common import check_static_float
from jax_fusedloss._linear_kd import run_linear
from jax_fusedloss._lm_head import DEFAULT_MODE


@_common.public
def linear_kd_loss(
    hidden: jax.Array,
    weight: jax.Array,
    teacher_ids: jax.Array,
    teacher_logprobs: jax.Array,
    mask: jax.Array | None = None,
    *,
    bias: jax.Array | None = None,
    weight_layout: str = "dv",
    temperature: float = 1.0,
    normalize: str = "full",
    reduction: str = "mean",
    num_items: int | jax.Array | None = None,
    tail: bool = False,
    divergence: str = "kl",
    beta: float = 0.5,
    weights: jax.Array | None = None,
    where: jax.Array | None = None,
    mode: str = DEFAULT_MODE,
    implementation: str | None = None,
    chunk_size: int | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array:
    r"""`kd_loss` of the student logits `hidden @ weight (+ bias)`, never keeping `[N, V]`.

    Equal to `kd_loss(hidden @ W + bias, teacher_ids, teacher_logprobs, mask, ...)` with the
    same options and formulas (the truncated forward KL; with `tail=True` the (K+1)-bucket
    "kl" or "jsd"; per-token `weights` / `where`), computed a chunk of logits at a time on the
    LM head's walks, with gradients w.r.t. `hidden`, `weight` and `bias` (teacher inputs,
    mask and weights get none). `mode`, `chunk_size`, `weight_layout`, `bias` and
    `vocab_axis` mean what they mean in `linear_cross_entropy`: "fast" (gradients for a unit
    cotangent in the forward, dW summed in float32), "low_precision" (dW summed in the
    weight's dtype), "lean" (statistics and dH in the forward; the backward walks vocabulary
    blocks for dW, four matmuls). float16 inputs, and `reduction="none"` outside "lean",
    recompute in the backward.

    Args:
      hidden: `[..., D]` float32, bfloat16 or float16.
      weight: `[D, V]` ("dv") or `[V, D]` ("vd"), hidden's dtype.
      teacher_ids, teacher_logprobs, mask: `[..., K]`, as in `kd_loss`.
      bias: optional `[V]`.
      weight_layout, mode, chunk_size, vocab_axis: as in `linear_cross_entropy`.
      temperature, normalize, reduction, num_items, tail, divergence, beta, weights, where:
        as in `kd_loss`.
      implementation: None, "triton" or "xla": the row functions' (the matmuls are XLA's).

    Returns:
      The float32 loss (scalar, or `[...]` for "none").

    Raises:
      TypeError / ValueError at trace time naming the argument (as `kd_loss` and
      `linear_cross_entropy`).

    Example:
      >>> h = jax.random.normal(jax.random.key(0), (4, 8, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 1000)) * 0.1
      >>> teacher = jax.nn.log_softmax(jax.random.normal(jax.random.key(2), (4, 8, 1000)))
      >>> lp, ids = jax.lax.top_k(teacher, 16)
      >>> loss, (dh, dw) = jax.value_and_grad(linear_kd_loss, (0, 1))(h, w, ids, lp, tail=True)
    """
    return run_linear(hidden, weight, None, teacher_ids, teacher_logprobs, mask, bias=bias,
                      weight_layout=weight_layout, alpha=None, temperature=temperature,
                      ignore_index=-100, smoothing_opts=(0.0, 0.0, None), normalize=normalize,
                      reduction=reduction, num_items=num_items, temperature_squared=False,
                      tail=tail, divergence=divergence, beta=beta, weights=weights, where=where,
                      mode=mode, implementation=implementation, chunk_size=chunk_size,
                      vocab_axis=vocab_axis)


@_common.public
def linear_distill_loss(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    teacher_ids: jax.Array,
    teacher_logprobs: jax.Array,
    mask: jax.Array | None = None,
    *,
    alpha: float,
    bias: jax.Array | None = None,
    weight_layout: str = "dv",
    temperature: float = 1.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    normalize: str = "full",
    reduction: str = "mean",
    num_items: int | jax.Array | None = None,
    temperature_squared: bool = False,
    tail: bool = False,
    divergence: str = "kl",
    beta: float = 0.5,
    weights: jax.Array | None = None,
    where: jax.Array | None = None,
    mode: str = DEFAULT_MODE,
    implementation: str | None = None,
    chunk_size: int | None = None,
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array:
    r"""`distill_loss` of the student logits `hidden @ weight (+ bias)`, never keeping `[N, V]`.

    Equal to `distill_loss(hidden @ W + bias, labels, teacher_ids, teacher_logprobs, mask,
    alpha=alpha, ...)`: :math:`\alpha\,\mathrm{CE} + (1 - \alpha)\,c_T\,\mathrm{KL}_T` per
    token with every option of `distill_loss` (see its formulas; the KD term as `kd_loss`,
    `tail`/`divergence`/`beta` included), per-token `weights` / `where`, and the LM head's
    walks and memory modes as `linear_kd_loss`. Gradients w.r.t. `hidden`, `weight`, `bias`.

    Args:
      hidden, weight, bias, weight_layout, mode, chunk_size, vocab_axis, implementation: as in
        `linear_kd_loss`.
      labels: `[...]` integer class ids in `[0, V)`, or `ignore_index`.
      teacher_ids, teacher_logprobs, mask, alpha: as in `distill_loss`.
      temperature, ignore_index, label_smoothing, z_loss, logit_softcap: as in `distill_loss`.
      normalize, reduction, num_items, temperature_squared: as in `distill_loss`.
      tail, divergence, beta, weights, where: as in `distill_loss` (and `kd_loss`).

    Returns:
      The float32 loss (scalar, or `[...]` for "none").

    Raises:
      TypeError / ValueError at trace time naming the argument.

    Example:
      >>> h = jax.random.normal(jax.random.key(0), (4, 8, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 1000)) * 0.1
      >>> y = jax.random.randint(jax.random.key(2), (4, 8), 0, 1000)
      >>> teacher = jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (4, 8, 1000)))
      >>> lp, ids = jax.lax.top_k(teacher, 16)
      >>> loss = linear_distill_loss(h, w, y, ids, lp, alpha=0.5, tail=True, mode="lean")
    """
    alpha = check_static_float(alpha, "alpha", lo=0.0, hi=1.0)
    return run_linear(hidden, weight, labels, teacher_ids, teacher_logprobs, mask, bias=bias,
                      weight_layout=weight_layout, alpha=alpha, temperature=temperature,
                      ignore_index=ignore_index,
                      smoothing_opts=(label_smoothing, z_loss, logit_softcap),
                      normalize=normalize, reduction=reduction, num_items=num_items,
                      temperature_squared=temperature_squared, tail=tail,
                      divergence=divergence, beta=beta, weights=weights, where=where, mode=mode,
                      implementation=implementation, chunk_size=chunk_size,
                      vocab_axis=vocab_axis)

