"""Validation and implementation dispatch shared by every op (trace-time only)."""
from __future__ import annotations

import functools
import inspect
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_fusedloss import _sharding, _triton_jax, _validate
from jax_fusedloss._validate import (INT32_MAX, INT32_MIN, REDUCTIONS,  # noqa: F401 (re-exported)
                                     check_bool, check_choice)

IMPLEMENTATIONS = ("triton", "xla")
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class UnsupportedError(NotImplementedError):
    """What no implementation can do (a second-order derivative): `dispatch` re-raises it at
    once instead of trying the next implementation, whose own NotImplementedError (e.g.
    "needs a CUDA GPU") would hide the real reason."""


def check_logits(x, name: str = "logits", last: str = "V") -> None:
    """A float `[..., V]` array (`last`: the last axis' letter, see check_rows_shape)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    _validate.check_rows_shape(tuple(x.shape), name, last)
    if x.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise _validate.float_dtype_error(name, x.dtype)


def as_logits(x, name: str = "logits"):
    """`x` as a JAX array of float32, bfloat16 or float16 logits, checked (check_logits).

    A NumPy (or other non-JAX) array becomes a JAX array first, by JAX's own rule: with
    `jax_enable_x64` off (the default) float64 becomes float32, as everywhere in JAX. A float64
    JAX array (x64 on) is refused: the kernels compute in float32.
    """
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    check_logits(x, name)
    return x


def check_int_array(x, name: str, shape: tuple[int, ...], expected: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise _validate.integer_dtype_error(name, x.dtype)
    _validate.check_shape_equal(name, tuple(x.shape), expected, tuple(shape))


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
    implementation re-raises. An UnsupportedError (what no implementation can do) is
    re-raised at once.
    """
    check_implementation(implementation)
    order = [implementation] if implementation else [default_implementation()]
    order += [name for name in IMPLEMENTATIONS if implementation is None and name not in order]
    for i, name in enumerate(order):
        try:
            return impls[name](*args, **kwargs)
        except NotImplementedError as e:
            if isinstance(e, UnsupportedError) or implementation is not None or \
                    i == len(order) - 1:
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


def check_axis_name(axis):
    """vocab_axis: None, a mesh axis name, or a tuple of names (returned as given, hashable)."""
    if axis is None or isinstance(axis, str):
        return axis
    if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) for a in axis):
        return tuple(axis)
    raise TypeError(f"vocab_axis={axis!r} must be None, a mesh axis name or a tuple of names")


def check_vocab_axis(vocab_axis, x, name: str):
    """`check_axis_name(vocab_axis)`, then ValueErrors naming `vocab_axis` where it cannot be
    right: outside shard_map (no such axis bound); inside `shard_map(..., check_vma=False)`,
    where JAX tracks no varying axes (so the split cannot be checked) and transposes an output
    replicated over `vocab_axis` by dividing its cotangent by the axis size, which the fused
    backward (no collective under differentiation) would pass on as a gradient too small by
    that factor; and where `x` (the logits, or linear_cross_entropy's weight) does not vary
    over every one of those axes: its vocabulary is then not split across them, and treating
    it as split would count every column once per device (a loss larger by log(axis size))."""
    axes = check_axis_name(vocab_axis)
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else axes
    try:
        jax.lax.axis_size(names)
    except NameError as e:
        raise ValueError(f"vocab_axis={axes!r} names no mesh axis bound here: vocab_axis is "
                         f"for use inside jax.shard_map only (under jax.jit the ops partition "
                         f"themselves from the inputs' shardings)") from e
    if not _vma_checked():
        raise ValueError(f"vocab_axis={axes!r} needs jax.shard_map's check_vma=True (the "
                         f"default): with check_vma=False JAX tracks no varying axes to check "
                         f"the split against, and its gradient convention would scale the "
                         f"gradient by 1 / (size of vocab_axis)")
    varying = _sharding.varying_axes(x)
    missing = [a for a in names if a not in varying]
    if missing:
        raise ValueError(
            f"vocab_axis={axes!r}: {name} does not vary over mesh axis {missing} (it varies "
            f"over {sorted(varying)}), so its vocabulary is not split across it: vocab_axis "
            f"must name the mesh axes that split the last axis of {name} in shard_map's "
            f"in_specs (use vocab_axis=None when only the tokens are split)")
    return axes


def _vma_checked() -> bool:
    """Whether JAX tracks varying manual axes here (shard_map's check_vma, on by default)."""
    from jax._src import config

    flag = getattr(config, "_check_vma", None)
    return True if flag is None else bool(flag.value)


def _reject_traced(value, name: str, kind: str) -> None:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python {kind}, got a traced value "
                        f"({type(value).__name__}): it is fixed at trace time, so pass a Python "
                        f"{'float' if kind == 'number' else kind} or mark it static, e.g. "
                        f"jax.jit(..., static_argnames=...)")


def check_static_bool(value, name: str) -> bool:
    """`value` as a Python bool: TypeError naming `name` for anything else, a traced value
    included (a flag shapes the computation at trace time)."""
    _reject_traced(value, name, "bool")
    return check_bool(value, name)


def as_array(x):
    """An array-like with `__jax_array__` (a Flax `nnx.Param` or other `nnx.Variable`) as the
    array it holds, as `jnp` functions take it; anything else as given (validated later)."""
    if isinstance(x, jax.Array) or not hasattr(x, "__jax_array__"):
        return x
    return jnp.asarray(x)


def public(fn: Callable) -> Callable:
    """The public boundary of an op, by `fn`'s annotations: every argument annotated as a
    `jax.Array` (possibly `| None`) goes through `as_array`, every one annotated `bool` through
    `check_static_bool`, before `fn` runs."""
    sig = inspect.signature(fn)
    arrays = [n for n, p in sig.parameters.items() if "jax.Array" in str(p.annotation)]
    flags = [n for n, p in sig.parameters.items() if p.annotation in ("bool", bool)]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        values = bound.arguments
        for name in arrays:
            if name in values:
                values[name] = as_array(values[name])
        for name in flags:
            if name in values:
                check_static_bool(values[name], name)
        return fn(*bound.args, **bound.kwargs)

    return wrapper


def check_static_float(value, name: str, *, lo: float = -math.inf, hi: float = math.inf,
                       lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` as a Python float in the interval from lo to hi (`_validate.check_float`: open
    at either end as asked, NaN rejected). TypeError naming `name` for a traced value too
    (options shape the kernels at trace time: pass a Python number, or mark the argument
    static under jit)."""
    _reject_traced(value, name, "number")
    return _validate.check_float(value, name, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open)


def check_static_int(value, name: str, *, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int:
    """`value` as a Python int in [lo, hi] (`_validate.check_int`: by default int32's range,
    which the kernels compare labels in); TypeError naming `name` for a traced value too."""
    _reject_traced(value, name, "int")
    return _validate.check_int(value, name, lo=lo, hi=hi)


def check_ce_options(label_smoothing, z_loss, logit_softcap) -> tuple[float, float,
                                                                      float | None]:
    """cross_entropy's float options as static Python floats (`_validate.check_ce_options`)."""
    return _validate.check_ce_options(label_smoothing, z_loss, logit_softcap,
                                      check=check_static_float)


def labels_to_int32(labels: jax.Array, ignore_index: int | None, vocab: int) -> jax.Array:
    """Integer labels of any width as int32 for the kernels, range-checked at their own width
    first: a label equal to `ignore_index` stays ignore_index, one in [0, vocab) keeps its
    value, and any other one (e.g. int64 2**32 + 1, which `astype(int32)` would wrap to 1)
    becomes a negative sentinel that is never ignore_index, so the kernels report it as out of
    range (NaN loss). int8/16/32 and uint8/16 labels are exact in int32 and only cast.

    `ignore_index` None: no label is ignored (token_logprobs)."""
    dtype = jnp.dtype(labels.dtype)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"labels.dtype={dtype} must be an integer type")
    if ignore_index is not None:
        ignore_index = check_static_int(ignore_index, "ignore_index")
    info = jnp.iinfo(dtype)
    if info.min >= INT32_MIN and info.max <= INT32_MAX:
        return labels.astype(jnp.int32)
    in_range = labels < vocab if vocab <= info.max else jnp.ones(labels.shape, bool)
    if info.min < 0:
        in_range = in_range & (labels >= 0)
    narrowed = jnp.where(in_range, labels, 0).astype(jnp.int32)  # exact where in range
    sentinel = -2 if ignore_index == -1 else -1
    out = jnp.where(in_range, narrowed, jnp.int32(sentinel))
    if ignore_index is not None and info.min <= ignore_index <= info.max:
        out = jnp.where(labels == ignore_index, jnp.int32(ignore_index), out)
    return out


def check_labels(labels: jax.Array, vocab: int, ignore_index: int | None, *,
                 enabled: bool) -> None:
    """`check_labels=True` of the ops with labels: a run-time check (a `jax.debug.callback`,
    so it runs under jit, grad, vmap and shard_map) that raises a ValueError naming the first
    label outside `[0, vocab)` that is not `ignore_index`, by its index in `labels`, and how
    many there are. Under jit JAX re-raises it as a JaxRuntimeError carrying that message. A
    debugging aid: it costs a device-to-host sync per call. `enabled` False: nothing."""
    if not enabled or labels.size == 0:
        return
    flat = labels.reshape(-1)
    y = labels_to_int32(flat, ignore_index, vocab)  # wide labels range-checked at their width
    bad = (y < 0) | (y >= vocab)
    if ignore_index is not None:
        bad = bad & (y != ignore_index)
    first = jnp.argmax(bad)
    host = functools.partial(_raise_bad_label, shape=tuple(labels.shape), vocab=vocab,
                             ignore_index=ignore_index)
    jax.debug.callback(host, jnp.sum(bad), first, flat[first])


def _raise_bad_label(count, first, value, *, shape, vocab, ignore_index) -> None:
    if int(count):
        index = ", ".join(str(int(i)) for i in np.unravel_index(int(first), shape))
        ignored = "" if ignore_index is None else f" and is not ignore_index={ignore_index}"
        raise ValueError(f"labels[{index}]={int(value)} lies outside [0, {vocab}){ignored}: "
                         f"{int(count)} such label(s) (found by check_labels=True)")


def vocab_size(logits, vocab_axis) -> int:
    """The vocabulary the labels index: the logits' last axis, times the size of `vocab_axis`
    inside shard_map when the vocabulary is split across it."""
    vocab = logits.shape[-1]
    return vocab if vocab_axis is None else vocab * jax.lax.axis_size(vocab_axis)


def flatten_rows(x: jax.Array) -> jax.Array:
    """[..., V] -> [N, V] (a free reshape for contiguous JAX arrays)."""
    return x.reshape(-1, x.shape[-1])
