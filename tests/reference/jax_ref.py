"""Naive formulas in plain JAX: the oracle of the JAX tests (no torch needed).

Every function computes at the dtype of the logits it is given and materialises the full
softmax; the tests call them on float64 logits inside `x64()` and take reference gradients
from `jax.vjp` (`value_and_vjp`). Definitions follow the public docstrings:
`jax_fusedloss.cross_entropy`, `kd_loss`, `distill_loss`, `logsumexp`, `entropy`,
`token_logprobs` and `linear_cross_entropy`. Out-of-range labels give NaN where the library
documents NaN; ignored tokens give 0.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


@contextlib.contextmanager
def x64():
    """float64 inside the block (jax.enable_x64 as a context manager)."""
    with jax.enable_x64(True):
        yield


def value_and_vjp(fn, x, cotangents):
    """(fn(x), the gradient of sum(cot * out) w.r.t. x) with `cotangents` a pytree matching
    fn's outputs, or a function of the outputs returning one (a cotangent may be a Python
    float, broadcast to its output's shape)."""
    out, vjp = jax.vjp(fn, x)
    if callable(cotangents):
        cotangents = cotangents(out)
    cts = jax.tree.map(lambda o, c: jnp.broadcast_to(jnp.asarray(c, o.dtype), o.shape), out,
                       cotangents)
    return out, vjp(cts)[0]


def softcap(z: jax.Array, c: float | None) -> jax.Array:
    return z if c is None else c * jnp.tanh(z / c)


def _take(z, idx):
    return jnp.take_along_axis(z, idx[..., None], axis=-1)[..., 0]


def _reduce(per_token, count, reduction, num_items=None):
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return jnp.sum(per_token)
    denom = num_items if num_items is not None else jnp.maximum(jnp.sum(count), 1)
    return jnp.sum(per_token) / jnp.asarray(denom, per_token.dtype)


# ----------------------------------------------------------------------------- cross-entropy
def cross_entropy(logits, labels, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, z_loss: float = 0.0,
                  logit_softcap: float | None = None, return_lse: bool = False):
    """(1-eps)(lse - z_y) + eps(lse - mean z) + z_loss lse^2 of z = softcap(logits): 0 at
    ignored tokens, NaN at other labels outside [0, V); "mean" over non-ignored tokens."""
    z = softcap(logits, logit_softcap)
    vocab = z.shape[-1]
    lse = jax.nn.logsumexp(z, axis=-1)
    ignored = labels == ignore_index
    bad = ~ignored & ((labels < 0) | (labels >= vocab))
    zy = _take(z, jnp.clip(labels, 0, vocab - 1))
    eps = label_smoothing
    loss = (1 - eps) * (lse - zy) + eps * (lse - jnp.mean(z, axis=-1)) + z_loss * lse**2
    loss = jnp.where(ignored, 0.0, jnp.where(bad, jnp.nan, loss))
    loss = _reduce(loss, ~ignored, reduction)
    return (loss, lse) if return_lse else loss


def linear_cross_entropy(hidden, weight, labels, bias=None, *, weight_layout: str = "dv",
                         **options):
    """cross_entropy of hidden @ weight (+ bias); weight `[D, V]` ("dv") or `[V, D]` ("vd")."""
    w = weight if weight_layout == "dv" else weight.T
    logits = hidden @ w.astype(hidden.dtype)
    if bias is not None:
        logits = logits + bias.astype(hidden.dtype)
    return cross_entropy(logits, labels, **options)


# ----------------------------------------------------------------------------- distillation
def kd_tokens(student_logits, teacher_ids, teacher_logprobs, mask=None, *,
              temperature: float = 1.0, normalize: str = "full"):
    """Per-token KL(teacher || softmax(student / T)) over the counting top-K entries (mask set,
    id in [0, V)), and whether each token has one. Entries are summed as given: a repeated id
    counts once per entry, and its gradient column sums them (the gather's vjp)."""
    s = student_logits / temperature
    vocab = s.shape[-1]
    valid = (teacher_ids >= 0) & (teacher_ids < vocab)
    if mask is not None:
        valid = valid & (mask != 0)
    sk = jnp.take_along_axis(s, jnp.where(valid, teacher_ids, 0), axis=-1)
    has_entry = valid.any(-1)
    if normalize == "full":
        norm = jax.nn.logsumexp(s, axis=-1, keepdims=True)
    else:  # tokens without a counting entry take a finite stand-in (their terms are all 0)
        z = jnp.where(valid, sk, -jnp.inf)
        norm = jax.nn.logsumexp(jnp.where(has_entry[..., None], z, 0.0), axis=-1, keepdims=True)
    lp = teacher_logprobs.astype(s.dtype)
    p = jnp.where(valid, jnp.exp(lp), 0.0)
    term = jnp.where(p > 0, p * (jnp.where(p > 0, lp, 0.0) - (sk - norm)), 0.0)
    return term.sum(-1), has_entry


def kd_loss(student_logits, teacher_ids, teacher_logprobs, mask=None, *,
            temperature: float = 1.0, normalize: str = "full", reduction: str = "mean",
            num_items=None):
    """"mean" divides by the tokens with a counting entry (or num_items)."""
    per_token, has_entry = kd_tokens(student_logits, teacher_ids, teacher_logprobs, mask,
                                     temperature=temperature, normalize=normalize)
    return _reduce(per_token, has_entry, reduction, num_items)


def distill_loss(student_logits, labels, teacher_ids, teacher_logprobs, mask=None, *,
                 alpha: float, temperature: float = 1.0, ignore_index: int = -100,
                 normalize: str = "full", reduction: str = "mean", num_items=None,
                 temperature_squared: bool = False, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, logit_softcap: float | None = None):
    """alpha CE(z, y) + (1 - alpha) c KL_T(z) with z = softcap(student) seen by both terms,
    smoothing and z-loss in the CE term, c = T^2 with temperature_squared; an ignored token's
    teacher entries are masked; "mean" divides each term by its own count (or num_items)."""
    z = softcap(student_logits, logit_softcap)
    active = labels != ignore_index
    kd_mask = active[..., None] if mask is None else (mask != 0) & active[..., None]
    kd, has_entry = kd_tokens(z, teacher_ids, teacher_logprobs, kd_mask,
                              temperature=temperature, normalize=normalize)
    ce = cross_entropy(z, labels, ignore_index=ignore_index, reduction="none",
                       label_smoothing=label_smoothing, z_loss=z_loss)
    kd_w = (1.0 - alpha) * (temperature**2 if temperature_squared else 1.0)
    if reduction != "mean":
        return _reduce(alpha * ce + kd_w * kd, None, reduction)
    return (alpha * _reduce(ce, active, "mean", num_items)
            + kd_w * _reduce(kd, has_entry, "mean", num_items))


# ----------------------------------------------------------------------------- reductions
def reductions(logits, labels=None, *, temperature: float = 1.0):
    """(lse, entropy, log-prob of the labels or None) of z = logits / T. -inf logits add
    nothing to the entropy (and keep the vjp finite); labels outside [0, V) give NaN."""
    z = logits / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    p = jnp.exp(z - lse[..., None])
    ent = lse - jnp.sum(p * jnp.where(jnp.isneginf(z), 0.0, z), axis=-1)
    if labels is None:
        return lse, ent, None
    vocab = z.shape[-1]
    bad = (labels < 0) | (labels >= vocab)
    logp = jnp.where(bad, jnp.nan, _take(z, jnp.clip(labels, 0, vocab - 1)) - lse)
    return lse, ent, logp


def logsumexp(logits, *, temperature: float = 1.0):
    return reductions(logits, temperature=temperature)[0]


def entropy(logits, *, temperature: float = 1.0):
    return reductions(logits, temperature=temperature)[1]


def token_logprobs(logits, labels, *, temperature: float = 1.0, return_entropy: bool = False):
    _, ent, logp = reductions(logits, labels, temperature=temperature)
    return (logp, ent) if return_entropy else logp
