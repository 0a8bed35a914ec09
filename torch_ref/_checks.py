"""Validation shared by torch_ref's functions: the rules and messages of
jax_fusedloss/_validate.py (which the JAX API uses too, and which imports no framework) plus
the checks that need torch (tensor types, dtypes, devices)."""
from __future__ import annotations

import torch

from jax_fusedloss import _validate
from jax_fusedloss._validate import (INT32_MAX, INT32_MIN, REDUCTIONS,  # noqa: F401 (re-exported)
                                     check_bool, check_ce_options, check_choice, check_float,
                                     check_int)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_logits(x, name: str = "logits") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    _validate.check_rows_shape(tuple(x.shape), name)
    if x.dtype not in FLOAT_DTYPES:
        raise _validate.float_dtype_error(name, x.dtype)


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_int_tensor(x, name: str, shape, expected: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(x).__name__}")
    if not is_integer_dtype(x.dtype):
        raise _validate.integer_dtype_error(name, x.dtype)
    _validate.check_shape_equal(name, tuple(x.shape), expected, tuple(shape))


def check_same_device(name: str, x: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def check_num_items(num_items, reduction: str):
    """None, an int >= 1 or a one-element tensor (positive, checked where it is on the CPU)."""
    if not _validate.check_num_items(num_items, reduction):
        return num_items
    if not isinstance(num_items, torch.Tensor):
        raise TypeError(f"num_items must be an int or a scalar tensor, got "
                        f"{type(num_items).__name__}")
    if num_items.numel() != 1:
        _validate.check_scalar_shape(tuple(num_items.shape), "num_items")
    if num_items.device.type == "cpu" and not float(num_items) >= 1:
        raise ValueError(f"num_items={float(num_items)} must be >= 1")
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


def check_labels(labels: torch.Tensor, vocab: int, ignore_index: int | None,
                 enabled: bool) -> None:
    """`check_labels=True` (jax_fusedloss._common.check_labels, same message): a ValueError
    naming the first label outside `[0, vocab)` that is not `ignore_index` and how many there
    are; one device-to-host read. `enabled` False: nothing."""
    if not enabled or labels.numel() == 0:
        return
    flat = labels.reshape(-1)
    y = labels_to_int32(flat, ignore_index, vocab)
    bad = (y < 0) | (y >= vocab)
    if ignore_index is not None:
        bad = bad & (y != ignore_index)
    count = int(bad.sum())
    if count:
        first = int(torch.argmax(bad.to(torch.int8)))
        index = ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(first),
                                                                  tuple(labels.shape)))
        ignored = "" if ignore_index is None else f" and is not ignore_index={ignore_index}"
        raise ValueError(f"labels[{index}]={int(flat[first])} lies outside [0, {vocab})"
                         f"{ignored}: {count} such label(s) (found by check_labels=True)")


def no_double_backward(op: str) -> None:
    """Raises inside an autograd.Function's backward run with create_graph=True (grad mode
    is on there only then): the kernels' gradient is not differentiable again, and returning
    it as a constant would make second-order terms silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"torch_ref {op}: backward with create_graph=True (double backward) "
                           f"is not supported; the gradient comes from Triton kernels and is "
                           f"first-order only")
