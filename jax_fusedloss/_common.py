"""Validation and implementation dispatch shared by every op (trace-time only)."""
from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from jax_fusedloss import _triton_jax

IMPLEMENTATIONS = ("triton", "xla")
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_logits(x, name: str = "logits") -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim < 1:
        raise ValueError(f"{name}.shape={x.shape} must have at least one axis [..., V]")
    if x.shape[-1] < 1:
        raise ValueError(f"{name}.shape={x.shape}: the vocabulary axis must not be empty")
    if x.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name}.dtype={x.dtype} must be one of float32, bfloat16, float16")


def check_int_array(x, name: str, shape: tuple[int, ...], expected: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}.dtype={x.dtype} must be an integer type")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must equal {expected}={tuple(shape)}")


def check_choice(value, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {choices}")


def check_implementation(implementation) -> None:
    if implementation is not None:
        check_choice(implementation, "implementation", IMPLEMENTATIONS)


def default_implementation() -> str:
    """"triton" on a CUDA GPU, "xla" elsewhere."""
    return "triton" if _triton_jax.on_cuda_gpu() else "xla"


def dispatch(impls: Mapping[str, Callable], implementation: str | None, *args, **kwargs):
    """Runs the requested implementation, or the best available one when None.

    An implementation raises NotImplementedError for what it cannot do; with
    implementation=None the dispatcher then falls through to the next, while a forced
    implementation re-raises.
    """
    check_implementation(implementation)
    order = [implementation] if implementation else [default_implementation()]
    order += [name for name in IMPLEMENTATIONS if implementation is None and name not in order]
    for i, name in enumerate(order):
        try:
            return impls[name](*args, **kwargs)
        except NotImplementedError:
            if implementation is not None or i == len(order) - 1:
                raise
    raise AssertionError("unreachable")


def dispatch_op(op: Callable, implementation: str | None, *arrays, opts):
    """dispatch() for an op `op(*arrays, opts)` whose options carry an `implementation` field:
    each candidate runs op with that field set, the Triton one only where it can run."""

    def bind(name: str) -> Callable:
        def run():
            if name == "triton":
                _triton_jax.check_triton_available()
            return op(*arrays, opts._replace(implementation=name))

        return run

    return dispatch({name: bind(name) for name in IMPLEMENTATIONS}, implementation)


def flatten_rows(x: jax.Array) -> jax.Array:
    """[..., V] -> [N, V] (a free reshape for contiguous JAX arrays)."""
    return x.reshape(-1, x.shape[-1])
