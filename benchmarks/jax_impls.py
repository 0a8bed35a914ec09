"""The JAX side of the benchmark: jax_fusedloss and the plain-JAX baselines, per op.

Every implementation is a function of the op's inputs (see `make_inputs`) returning the op's
value; `objective` turns it into the timed function of a mode. Baselines compute the same
quantity the obvious way: optax's cross-entropy on the logits as given and on float32-upcast
logits, and `jax.nn` formulas on float32-upcast logits (XLA fuses the upcast into the
reductions, so it costs no extra pass over memory).
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable

import jax
import jax.numpy as jnp

from benchmarks import shapes
from benchmarks.shapes import Problem

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
# impl name -> implementation= ("jax_fusedloss_triton" only by name: on a CPU it runs the
# kernels through Triton's interpreter, which checks the plumbing, not the speed)
OURS = {"jax_fusedloss": None, "jax_fusedloss_xla": "xla", "jax_fusedloss_triton": "triton"}


def make_inputs(p: Problem, seed: int, logits: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """The op's inputs for problem `p`: logits [N, V] (std 2) and, per op, labels or top-K.

    kd_loss gets K distinct teacher ids per row (evenly spaced from a random start) and
    teacher log-probabilities whose top-K mass is 0.9; distill_loss labels, then those.
    `logits` reuses a buffer of the right shape and dtype.
    """
    key_x, key_y = jax.random.split(jax.random.key(seed))
    if logits is None:
        logits = random_logits(key_x, p.n, p.v, p.dtype)
    kind = shapes.input_kind(p.op)
    out = [logits]
    if kind in ("labels", "both"):  # distill_loss's labels independent of the teacher ids
        key_l = jax.random.fold_in(key_y, 1) if kind == "both" else key_y
        out.append(jax.random.randint(key_l, (p.n,), 0, p.v, jnp.int32))
    if kind in ("teacher", "both"):
        start = jax.random.randint(key_y, (p.n, 1), 0, p.v, jnp.int32)
        out.append((start + jnp.arange(p.k, dtype=jnp.int32) * (p.v // p.k)) % p.v)
        teacher = jax.random.normal(key_x, (p.n, p.k), jnp.float32)
        out.append(jax.nn.log_softmax(teacher, axis=-1) + jnp.log(0.9))
    return tuple(out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, n, v, dtype):
    return jax.random.normal(key, (n, v), DTYPES[dtype]) * 2


def random_logits(key, n: int, v: int, dtype: str) -> jax.Array:
    """[n, v] logits drawn directly in `dtype` (no float32 [N, V] temporary)."""
    return _normal(key, n, v, dtype)


def _ours(op: str, implementation: str | None) -> Callable:
    import jax_fusedloss

    fn = getattr(jax_fusedloss, op)
    return lambda *args: fn(*args, implementation=implementation, **shapes.op_options(op))


def _log_softmax32(x):
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)


def _kd_reference(x, ids, logprobs, temperature=1.0):
    """KL(teacher top-K || student) with the student (at `temperature`) normalised over the
    full vocabulary."""
    student = jnp.take_along_axis(
        jax.nn.log_softmax(x.astype(jnp.float32) / temperature, axis=-1), ids, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(logprobs) * (logprobs - student), axis=-1))


def _distill_reference(x, y, ids, logprobs):
    """alpha * cross-entropy + (1 - alpha) * KD at the suite's temperature, on float32."""
    ce = -jnp.mean(jnp.take_along_axis(_log_softmax32(x), y[:, None], axis=-1))
    a = shapes.DISTILL_ALPHA
    return a * ce + (1 - a) * _kd_reference(x, ids, logprobs, shapes.DISTILL_TEMPERATURE)


def _entropy_reference(x):
    logp = _log_softmax32(x)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _token_logprobs_reference(x, y):
    return jnp.take_along_axis(_log_softmax32(x), y[:, None], axis=-1)[:, 0]


def _baselines(op: str, dtype: str) -> dict[str, Callable]:
    if op == "cross_entropy":
        optax = importlib.import_module("optax")
        ce = optax.softmax_cross_entropy_with_integer_labels
        out = {"optax": lambda x, y: jnp.mean(ce(x, y))}
        if dtype != "fp32":
            out["optax_fp32"] = lambda x, y: jnp.mean(ce(x.astype(jnp.float32), y))
        return out
    if op == "logsumexp":
        return {"jnp_fp32": lambda x: jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)}
    return {"jnp_fp32": {"kd_loss": _kd_reference, "distill_loss": _distill_reference,
                         "entropy": _entropy_reference,
                         "token_logprobs": _token_logprobs_reference}[op]}


def implementations(op: str, dtype: str, names: set[str] | None,
                    on_gpu: bool) -> tuple[dict[str, Callable], list[str]]:
    """({impl name: fn(*inputs) -> value}, notes about what was skipped and why).

    `names=None` selects the defaults: jax_fusedloss (Triton on a GPU) and every baseline;
    the XLA twin `jax_fusedloss_xla` is a default only off the GPU.
    """
    impls, notes = {}, []
    default_ours = {"jax_fusedloss"} if on_gpu else {"jax_fusedloss_xla"}
    for name, implementation in OURS.items():
        if name not in (names or default_ours):
            continue
        try:
            impls[name] = _ours(op, implementation)
        except ImportError as e:
            notes.append(f"{name}: import failed ({e})")
    try:
        baselines = _baselines(op, dtype)
    except ImportError as e:
        notes.append(f"{op} baselines: import failed ({e}); skipped")
        baselines = {}
    impls.update({k: f for k, f in baselines.items() if not names or k in names})
    return impls, notes


def objective(fn: Callable, mode: str) -> Callable:
    """fwd: the op itself. fwd_bwd: value and gradient w.r.t. the logits of its mean."""
    if mode == "fwd":
        return fn

    def mean_value(x, *rest):
        value = fn(x, *rest)
        return value if value.ndim == 0 else jnp.mean(value)

    return jax.value_and_grad(mean_value)
