"""Validation rules and messages shared by both frontends, on plain Python values.

Imports neither JAX nor PyTorch: `jax_fusedloss._common` (the JAX API) and `torch_ref._checks`
(the PyTorch frontend) add only what needs their framework (a traced value, an array's dtype)
and call these for the rest, so both give the same errors with the same messages.
"""
from __future__ import annotations

import math
import operator

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
REDUCTIONS = ("mean", "sum", "none")
NORMALIZATIONS = ("full", "topk")
LAYOUTS = ("dv", "vd")  # linear_cross_entropy's weight: [D, V] or [V, D]
FLOAT_DTYPE_NAMES = "float32, bfloat16, float16"


def interval(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def check_float(value, name: str, *, lo: float = -math.inf, hi: float = math.inf,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` (a Python number, a NumPy scalar or a one-element array or tensor) as a float
    in the interval from lo to hi, open at either end as asked (an infinite end is always
    open). TypeError naming `name` for a bool, a string, None or a non-number; ValueError for
    NaN or a value outside the interval."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{name}={value!r} must be a number")
    try:
        f = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}={value!r} must be a Python number") from e
    lo_open = lo_open or lo == -math.inf
    hi_open = hi_open or hi == math.inf
    if not ((f > lo if lo_open else f >= lo) and (f < hi if hi_open else f <= hi)):
        # NaN fails every comparison
        raise ValueError(f"{name}={value!r} must lie in {interval(lo, hi, lo_open, hi_open)}")
    return f


def check_int(value, name: str, *, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int:
    """`value` as an int in [lo, hi] (by default int32's range, which the kernels compare
    labels in). TypeError naming `name` for a bool or a non-integer; ValueError outside."""
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        i = operator.index(value)
    except TypeError as e:
        raise TypeError(f"{name}={value!r} must be an integer") from e
    if not lo <= i <= hi:
        what = (" (int32, as the kernels compare labels)" if (lo, hi) == (INT32_MIN, INT32_MAX)
                else "")
        raise ValueError(f"{name}={i} must lie in [{lo}, {hi}]{what}")
    return i


def check_choice(value, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {choices}")


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool")
    return value


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0 ** -126  # float32's smallest normal number


def inverse_temperature(temperature: float) -> float:
    """1 / T as the KD kernels and the XLA twin multiply by it in float32: at least
    FLOAT32_TINY. A reciprocal that underflows (T above about 8.5e37) gave 0 * inf = NaN at
    the online softmax's initial max of -inf, where the student softmax at such T is uniform:
    with the clamp, (z - max) / T still rounds to 0 for every logit below about 1e30."""
    return max(1.0 / temperature, FLOAT32_TINY)


def check_temperature_squared(temperature: float, temperature_squared: bool) -> float:
    """distill_loss's KD weight factor: T**2 with `temperature_squared` (ValueError naming
    `temperature` where it overflows float32), else 1."""
    if not temperature_squared:
        return 1.0
    if temperature * temperature > FLOAT32_MAX:
        raise ValueError(f"temperature={temperature!r} with temperature_squared=True: T**2 "
                         f"overflows float32 (the KD term's weight); T**2 needs temperature <= "
                         f"{FLOAT32_MAX ** 0.5:.6g}")
    return temperature * temperature


def check_ce_options(label_smoothing, z_loss, logit_softcap, *, check=check_float):
    """cross_entropy's float options, as every op that has them checks them (cross_entropy,
    distill_loss, linear_cross_entropy): label_smoothing in [0, 1], z_loss >= 0,
    logit_softcap in (0, inf) or None. `check` is `check_float` or a frontend's stricter
    version of it (the JAX API's rejects traced values too)."""
    smoothing = check(label_smoothing, "label_smoothing", lo=0.0, hi=1.0)
    z_loss = check(z_loss, "z_loss", lo=0.0)
    softcap = None if logit_softcap is None else check(logit_softcap, "logit_softcap", lo=0.0,
                                                       lo_open=True)
    return smoothing, z_loss, softcap


# ----------------------------------------------------------------------------- shapes
def check_rows_shape(shape: tuple[int, ...], name: str, last: str = "V") -> None:
    """A `[..., V]` operand (`last` names its last axis: "V" the vocabulary, "D" the hidden
    dimension of linear_cross_entropy's `hidden`): at least one axis, a nonempty last one."""
    what = {"V": "the vocabulary axis V", "D": "the hidden dimension D"}.get(last, last)
    if len(shape) < 1:
        raise ValueError(f"{name}.shape={shape} must have at least one axis [..., {last}]")
    if shape[-1] < 1:
        raise ValueError(f"{name}.shape={shape}: its last axis ({what}) must not be empty")


def float_dtype_error(name: str, dtype) -> TypeError:
    hint = (f" (the kernels compute in float32: pass {name}.astype(float32))"
            if str(dtype) == "float64" else "")
    return TypeError(f"{name}.dtype={dtype} must be one of {FLOAT_DTYPE_NAMES}{hint}")


def integer_dtype_error(name: str, dtype) -> TypeError:
    return TypeError(f"{name}.dtype={dtype} must be an integer type")


def check_shape_equal(name: str, shape: tuple[int, ...], expected: str,
                      expected_shape: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected_shape):
        raise ValueError(f"{name}.shape={tuple(shape)} must equal {expected}="
                         f"{tuple(expected_shape)}")


def check_same_dtype(name: str, dtype, ref_name: str, ref_dtype) -> None:
    if dtype != ref_dtype:
        raise TypeError(f"{name}.dtype={dtype} must equal {ref_name}.dtype={ref_dtype}")


def check_linear_weight(hidden_shape: tuple[int, ...], weight_shape: tuple[int, ...],
                        weight_layout: str) -> int:
    """linear_cross_entropy's weight for `[..., D]` hidden states: `[D, V]` ("dv") or `[V, D]`
    ("vd") with a nonempty vocabulary; returns V."""
    check_choice(weight_layout, "weight_layout", LAYOUTS)
    weight_shape = tuple(weight_shape)
    if len(weight_shape) != 2:
        raise ValueError(f"weight.shape={weight_shape} must be 2-D: [D, V] for "
                         f"weight_layout='dv', [V, D] for 'vd'")
    d_axis = 0 if weight_layout == "dv" else 1
    if weight_shape[d_axis] != hidden_shape[-1]:
        raise ValueError(f"weight.shape={weight_shape} with weight_layout={weight_layout!r} "
                         f"needs weight.shape[{d_axis}] == hidden.shape[-1]={hidden_shape[-1]}")
    vocab = weight_shape[1 - d_axis]
    if vocab < 1:
        raise ValueError(f"weight.shape={weight_shape}: the vocabulary axis must not be empty")
    return vocab


def check_teacher_shapes(logits_shape: tuple[int, ...], ids_shape: tuple[int, ...],
                         logprobs_shape: tuple[int, ...], mask_shape: tuple[int, ...] | None,
                         max_k: int | None = None) -> None:
    """kd_loss / distill_loss: teacher tensors `[..., K]` over the student's `[..., V]` rows
    (the kernels index them by the logits' rows, so a mismatch would read out of bounds)."""
    lead, vocab = tuple(logits_shape[:-1]), logits_shape[-1]
    ids_shape = tuple(ids_shape)
    if len(ids_shape) != len(logits_shape) or ids_shape[:-1] != lead:
        raise ValueError(f"teacher_ids.shape={ids_shape} must be [..., K] with [...] equal to "
                         f"student_logits.shape[:-1]={lead}")
    k = ids_shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"teacher_ids.shape[-1]={k} (K) must lie in [1, V] with "
                         f"V=student_logits.shape[-1]={vocab}")
    if max_k is not None and k > max_k:
        raise ValueError(f"teacher_ids.shape[-1]={k} (K) must be at most {max_k}: the kernels "
                         f"hold a row's teacher entries in one tile (Triton's 2**20-element "
                         f"limit); jax_fusedloss.kd_loss runs larger K on its XLA twin")
    check_shape_equal("teacher_logprobs", logprobs_shape, "teacher_ids.shape", ids_shape)
    if mask_shape is not None:
        check_shape_equal("mask", mask_shape, "teacher_ids.shape", ids_shape)


# ----------------------------------------------------------------------------- num_items
def check_num_items(num_items, reduction: str) -> bool:
    """The checks on `num_items` that need no framework: None, or with reduction="mean" an
    int >= 1 or an array. Returns whether it is an array (whose shape, and where it can be
    read, value the caller checks)."""
    if num_items is None:
        return False
    if reduction != "mean":
        raise ValueError(f"num_items applies to reduction='mean' only, got "
                         f"reduction={reduction!r}")
    if hasattr(num_items, "shape"):
        return True
    if isinstance(num_items, bool) or not isinstance(num_items, int):
        raise TypeError(f"num_items must be an int or a scalar array, got "
                        f"{type(num_items).__name__}")
    check_int(num_items, "num_items", lo=1)
    return False


def check_scalar_shape(shape: tuple[int, ...], name: str) -> None:
    if tuple(shape) != ():
        raise ValueError(f"{name}.shape={tuple(shape)} must be () (a scalar)")
