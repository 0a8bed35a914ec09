"""Validation shared by torch_ref's functions: the same rules and messages as the JAX API's
(jax_fusedloss/_common.py), without importing JAX."""
from __future__ import annotations

import math
import operator

import torch

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(value, name: str, *, lo: float = -math.inf, hi: float = math.inf,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` (a Python number or a one-element tensor) as a float in the interval from lo to
    hi, open at either end as asked (an infinite end is always open); NaN is rejected."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{name}={value!r} must be a number")
    try:
        f = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}={value!r} must be a Python number") from e
    lo_open = lo_open or lo == -math.inf
    hi_open = hi_open or hi == math.inf
    if not ((f > lo if lo_open else f >= lo) and (f < hi if hi_open else f <= hi)):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{name}={value!r} must lie in {interval}")
    return f


def check_int(value, name: str, *, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int:
    """`value` as an int in [lo, hi] (by default int32's range, which the kernels compare
    labels in)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        i = operator.index(value)
    except TypeError as e:
        raise TypeError(f"{name}={value!r} must be an integer") from e
    if not lo <= i <= hi:
        raise ValueError(f"{name}={i} must lie in [{lo}, {hi}]")
    return i


def check_choice(value, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {choices}")


def check_logits(x, name: str = "logits") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have at least one axis [..., V]")
    if x.shape[-1] < 1:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: the vocabulary axis must not be empty")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}.dtype={x.dtype} must be one of float32, bfloat16, float16")


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_int_tensor(x, name: str, shape, expected: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(x).__name__}")
    if not is_integer_dtype(x.dtype):
        raise TypeError(f"{name}.dtype={x.dtype} must be an integer type")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must equal {expected}={tuple(shape)}")


def check_same_device(name: str, x: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def check_num_items(num_items, reduction: str):
    """None, an int >= 1 or a one-element tensor (positive, checked where it is on the CPU)."""
    if num_items is None:
        return None
    if reduction != "mean":
        raise ValueError(f"num_items applies to reduction='mean' only, got "
                         f"reduction={reduction!r}")
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items.shape={tuple(num_items.shape)} must be () (a scalar)")
        if num_items.device.type == "cpu" and not float(num_items) >= 1:
            raise ValueError(f"num_items={float(num_items)} must be >= 1")
        return num_items
    if isinstance(num_items, bool) or not isinstance(num_items, int):
        raise TypeError(f"num_items must be an int or a scalar tensor, got "
                        f"{type(num_items).__name__}")
    if num_items < 1:
        raise ValueError(f"num_items={num_items} must be >= 1")
    return num_items


def labels_to_int32(labels: torch.Tensor, ignore_index: int | None, vocab: int) -> torch.Tensor:
    """Flattened int32 labels for the kernels, range-checked at their own width first: a label
    equal to ignore_index stays ignore_index, one in [0, vocab) keeps its value, any other
    (e.g. int64 2**32 + 1, which a cast to int32 would wrap to 1) becomes a negative sentinel
    that is never ignore_index, so the kernels report it as out of range (NaN loss)."""
    y = labels.reshape(-1)
    if y.dtype in (torch.int8, torch.int16, torch.int32, torch.uint8):
        return y.to(torch.int32).contiguous()
    if y.dtype == torch.uint64:  # a cast to int64 could wrap a label onto ignore_index
        raise TypeError("labels.dtype=torch.uint64 is not supported: use int64")
    y = y.to(torch.int64)  # uint16 and uint32 exactly
    in_range = (y >= 0) & (y < vocab)
    sentinel = -2 if ignore_index == -1 else -1
    out = torch.where(in_range, y, torch.full_like(y, sentinel))
    if ignore_index is not None:
        out = torch.where(y == ignore_index, torch.full_like(y, ignore_index), out)
    return out.to(torch.int32).contiguous()


def no_double_backward(op: str) -> None:
    """Raises inside an autograd.Function's backward run with create_graph=True (grad mode
    is on there only then): the kernels' gradient is not differentiable again, and returning
    it as a constant would make second-order terms silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"torch_ref {op}: backward with create_graph=True (double backward) "
                           f"is not supported; the gradient comes from Triton kernels and is "
                           f"first-order only")
