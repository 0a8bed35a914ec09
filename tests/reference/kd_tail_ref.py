"""Naive plain-JAX oracles of the distillation forms added by issue 30: the (K+1)-bucket
"kl" / "jsd" divergences (kd_loss / distill_loss with tail=True), per-token weights, and the
linear forms (logits = hidden @ W + b). Each materialises the full softmax and a `[..., K, V]`
one-hot of the teacher's ids; run them on float64 inputs inside `jax_ref.x64()`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from tests.reference import jax_ref


def tail_tokens(student_logits, teacher_ids, teacher_logprobs, mask=None, *,
                temperature=1.0, divergence="kl", beta=0.5):
    """Per-token divergence over the K+1 buckets (kd_loss's docstring) and has_entry."""
    s = student_logits / temperature
    vocab = s.shape[-1]
    q = jax.nn.softmax(s, axis=-1)
    valid = (teacher_ids >= 0) & (teacher_ids < vocab)
    if mask is not None:
        valid = valid & (mask != 0)
    p = jnp.where(valid, jnp.exp(teacher_logprobs.astype(s.dtype)), 0.0)
    onehot = (teacher_ids[..., None] == jnp.arange(vocab)) & valid[..., None]  # [..., K, V]
    teacher = jnp.sum(jnp.where(onehot, p[..., None], 0.0), axis=-2)  # P_d over the vocabulary
    in_ids = onehot.any(-2)
    p_tail = jnp.where(in_ids.all(-1), 0.0, jnp.maximum(0.0, 1.0 - p.sum(-1)))
    q_tail = jnp.sum(jnp.where(in_ids, 0.0, q), axis=-1)
    big_p = jnp.concatenate([jnp.where(in_ids, teacher, 0.0), p_tail[..., None]], axis=-1)
    big_q = jnp.concatenate([jnp.where(in_ids, q, 0.0), q_tail[..., None]], axis=-1)
    used = jnp.concatenate([in_ids, jnp.ones_like(in_ids[..., :1])], axis=-1)
    if divergence == "kl":
        safe_q = jnp.where(used, big_q, 1.0)
        term = xlogy(big_p, big_p) - xlogy(big_p, safe_q)
    else:
        m = beta * big_p + (1 - beta) * big_q
        safe_m = jnp.where(used & (m > 0), m, 1.0)
        term = (beta * (xlogy(big_p, big_p) - xlogy(big_p, safe_m))
                + (1 - beta) * (xlogy(big_q, big_q) - xlogy(big_q, safe_m)))
    return jnp.where(used, term, 0.0).sum(-1), valid.any(-1)


def _weighted_reduce(per_token, counted, weights, reduction, num_items):
    w = jnp.ones(per_token.shape, per_token.dtype) if weights is None else weights
    per_token = w * per_token
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    if num_items is not None:
        return per_token.sum() / num_items
    den = jnp.where(counted, w, 0.0).sum()
    if weights is None:
        den = jnp.maximum(den, 1.0)
    return per_token.sum() / jnp.where(den == 0, 1.0, den)


def kd_loss(student_logits, teacher_ids, teacher_logprobs, mask=None, *, temperature=1.0,
            normalize="full", reduction="mean", num_items=None, tail=False, divergence="kl",
            beta=0.5, weights=None, where=None):
    lead = student_logits.shape[:-1]
    w = _weights(weights, where, lead, student_logits.dtype)
    if where is not None:
        keep = jnp.broadcast_to(where, lead)[..., None]
        mask = keep if mask is None else (mask != 0) & keep
    if tail:
        tok, has = tail_tokens(student_logits, teacher_ids, teacher_logprobs, mask,
                               temperature=temperature, divergence=divergence, beta=beta)
    else:
        tok, has = jax_ref.kd_tokens(student_logits, teacher_ids, teacher_logprobs, mask,
                                     temperature=temperature, normalize=normalize)
    return _weighted_reduce(tok, has, w, reduction, num_items)


def _weights(weights, where, lead, dtype):
    if weights is None and where is None:
        return None
    w = jnp.ones(lead, dtype) if weights is None else jnp.broadcast_to(weights, lead)
    w = w.astype(dtype)
    return w if where is None else jnp.where(jnp.broadcast_to(where, lead), w, 0.0)


def distill_loss(student_logits, labels, teacher_ids, teacher_logprobs, mask=None, *, alpha,
                 temperature=1.0, ignore_index=-100, normalize="full", reduction="mean",
                 num_items=None, temperature_squared=False, label_smoothing=0.0, z_loss=0.0,
                 logit_softcap=None, tail=False, divergence="kl", beta=0.5, weights=None,
                 where=None):
    lead = labels.shape
    w = _weights(weights, where, lead, student_logits.dtype)
    if where is not None:
        labels = jnp.where(jnp.broadcast_to(where, lead), labels, ignore_index)
    z = jax_ref.softcap(student_logits, logit_softcap)
    active = labels != ignore_index
    kd_mask = active[..., None] if mask is None else (mask != 0) & active[..., None]
    if tail:
        kd, has = tail_tokens(z, teacher_ids, teacher_logprobs, kd_mask,
                              temperature=temperature, divergence=divergence, beta=beta)
    else:
        kd, has = jax_ref.kd_tokens(z, teacher_ids, teacher_logprobs, kd_mask,
                                    temperature=temperature, normalize=normalize)
    ce = jax_ref.cross_entropy(z, labels, ignore_index=ignore_index, reduction="none",
                               label_smoothing=label_smoothing, z_loss=z_loss)
    kd_w = (1.0 - alpha) * (temperature ** 2 if temperature_squared else 1.0)
    if reduction != "mean":
        return _weighted_reduce(alpha * ce + kd_w * kd, None, w, reduction, None)
    return (alpha * _weighted_reduce(ce, active, w, "mean", num_items)
            + kd_w * _weighted_reduce(kd, has, w, "mean", num_items))


def linear_logits(hidden, weight, bias=None, weight_layout="dv"):
    z = hidden @ (weight if weight_layout == "dv" else weight.T)
    return z if bias is None else z + bias


def gathered_tokens(logits, teacher_ids, teacher_logprobs, *, temperature=1.0, tail=False,
                    divergence="kl", beta=0.5):
    """The naive per-token divergence without a one-hot (distinct, valid ids: a teacher's top-K
    from jax.lax.top_k): full float32 log-softmax, a gather, and for the tail the log-sum-exp of
    the logits with the ids set to -inf. What "naive XLA" means in the GPU test and benchmark."""
    s = logits.astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(s, axis=-1)
    lq = jnp.take_along_axis(s, teacher_ids, axis=-1) - lse[..., None]
    lp = teacher_logprobs.astype(jnp.float32)
    p = jnp.exp(lp)
    if not tail:
        return jnp.sum(p * (lp - lq), axis=-1)
    rows = jnp.arange(s.shape[0])[:, None]
    lqt = jax.nn.logsumexp(s.at[rows, teacher_ids].set(-jnp.inf), axis=-1) - lse
    pt = jnp.maximum(0.0, 1.0 - p.sum(-1))
    lpt = jnp.log(jnp.where(pt > 0, pt, 1.0))
    big_lp = jnp.concatenate([lp, lpt[:, None]], axis=-1)
    big_lq = jnp.concatenate([lq, lqt[:, None]], axis=-1)
    big_p = jnp.concatenate([p, pt[:, None]], axis=-1)
    if divergence == "kl":
        return jnp.sum(jnp.where(big_p > 0, big_p * (big_lp - big_lq), 0.0), axis=-1)
    lm = jnp.logaddexp(jnp.log(beta) + jnp.where(big_p > 0, big_lp, -jnp.inf),
                       jnp.log1p(-beta) + big_lq)
    term = (jnp.where(big_p > 0, beta * big_p * (big_lp - lm), 0.0)
            + (1 - beta) * jnp.exp(big_lq) * (big_lq - lm))
    return term.sum(-1)
