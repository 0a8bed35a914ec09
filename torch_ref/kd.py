"""Top-K distillation from PyTorch over the same Triton kernels."""
from __future__ import annotations

import torch

from jax_fusedloss import _validate
from jax_fusedloss.kernels import kd as k
from torch_ref import _checks, _launch
from torch_ref._checks import no_double_backward
from torch_ref._launch import run_plan
from torch_ref.cross_entropy import check_ce_options, scaled_saved_grad


def _rows(x, ids, lp, y, row_scale, temperature, normalize, distill, ignore_index, write_grad,
          smoothing=0.0, z_loss=0.0, softcap=None):
    """Per-row loss [N] (and the unit-cotangent gradient) from kd_fwd_plan."""
    n, vocab = x.shape
    plan = k.kd_fwd_plan(n, vocab, ids.shape[1], temperature=temperature, normalize=normalize,
                         distill=distill, ignore_index=ignore_index,
                         num_sms=_launch.num_sms(x), write_grad=write_grad,
                         smoothing=smoothing, z_loss=z_loss, softcap=softcap,
                         itemsize=x.element_size())
    outs = run_plan(plan, x=x, ids=ids, lp=lp, y=y, row_scale=row_scale)
    return outs[0], outs[2] if write_grad else None


class _KD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, lp, y, row_scale, temperature, normalize, distill, ignore_index,
                reduction, write_grad, ce_options):
        x = logits.reshape(-1, logits.shape[-1]).contiguous()
        loss, grad = _rows(x, ids, lp, y, row_scale, temperature, normalize, distill,
                           ignore_index, write_grad, *ce_options)
        ctx.reduction, ctx.shape = reduction, logits.shape
        ctx.options = (temperature, normalize, distill, ignore_index)
        ctx.ce_options = ce_options
        if grad is not None and x.dtype == torch.float16:  # see backward
            ctx.save_for_backward(grad.view(logits.shape), x, ids, lp, y, row_scale)
        else:
            ctx.save_for_backward(None if grad is None else grad.view(logits.shape))
        return loss if reduction == "none" else loss.sum()

    @staticmethod
    def backward(ctx, g):
        """The forward wrote the gradient for a unit cotangent (the saved tensor is never
        changed, so a retained graph can run backward again). float32/bfloat16: rescaled.
        float16: returned as is for a cotangent of exactly 1, else recomputed from the logits with
        the cotangent folded into the row weights before rounding (one more pass over them),
        so a loss scale does not flush small fp16 entries."""
        no_double_backward("kd_loss / distill_loss")
        saved = ctx.saved_tensors
        per_row = ctx.reduction == "none"
        if len(saved) == 1 or bool((g == 1).all()):  # one read (a sync on CUDA)
            return (scaled_saved_grad(saved[0], g, per_row),) + (None,) * 11
        _, x, ids, lp, y, row_scale = saved
        cot = (g.reshape(-1) if per_row else g.reshape(1).expand(x.shape[0])).float()
        _, grad = _rows(x, ids, lp, y, (row_scale * cot[:, None]).contiguous(), *ctx.options,
                        True, *ctx.ce_options)
        return (grad.view(ctx.shape),) + (None,) * 11


MAX_K = 65536  # as jax_fusedloss.kd.MAX_TRITON_K (this package does not import JAX)


def _check_teacher(student_logits, teacher_ids, teacher_logprobs, mask) -> None:
    """The JAX API's checks (jax_fusedloss.kd.check_teacher): the kernels index the teacher
    tensors by the logits' rows, so a shape mismatch would read out of bounds."""
    _checks.check_logits(student_logits, "student_logits")
    for name, a in (("teacher_ids", teacher_ids), ("teacher_logprobs", teacher_logprobs),
                    ("mask", mask)):
        if a is not None and not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(a).__name__}")
        if a is not None:
            _checks.check_same_device(name, a, student_logits, "student_logits")
    if not _checks.is_integer_dtype(teacher_ids.dtype):
        raise _validate.integer_dtype_error("teacher_ids", teacher_ids.dtype)
    _validate.check_teacher_shapes(tuple(student_logits.shape), tuple(teacher_ids.shape),
                                   tuple(teacher_logprobs.shape),
                                   None if mask is None else tuple(mask.shape), max_k=MAX_K)
    if not teacher_logprobs.dtype.is_floating_point:
        raise TypeError(f"teacher_logprobs.dtype={teacher_logprobs.dtype} must be a float type")


def _prepare(student_logits, teacher_ids, teacher_logprobs, mask, active=None):
    vocab, n_k = student_logits.shape[-1], teacher_ids.shape[-1]
    ids = teacher_ids.reshape(-1, n_k)
    if ids.dtype == torch.uint64:
        raise TypeError("teacher_ids.dtype=torch.uint64 is not supported: use int64")
    valid = (ids >= 0) & (ids < vocab)  # at the ids' own width, before narrowing
    if mask is not None:
        valid = valid & (mask.reshape(-1, n_k) != 0)
    if active is not None:
        valid = valid & active[:, None]
    wide = ids.to(torch.int64)
    ids32 = torch.where(valid, wide, torch.full_like(wide, -1)).to(torch.int32).contiguous()
    lp = teacher_logprobs.reshape(-1, n_k).float().contiguous()
    return ids32, lp, valid.any(dim=1)


def _check(temperature, normalize, reduction, num_items) -> float:
    """The options shared by kd_loss and distill_loss, as jax_fusedloss.kd.check_options."""
    t = _checks.check_float(temperature, "temperature", lo=0.0, lo_open=True)
    _checks.check_choice(normalize, "normalize", _validate.NORMALIZATIONS)
    _checks.check_choice(reduction, "reduction", _checks.REDUCTIONS)
    _checks.check_num_items(num_items, reduction)
    return t


def _needs_grad(logits: torch.Tensor) -> bool:
    """Whether the forward should write the gradient (skipped under torch.no_grad())."""
    return logits.requires_grad and torch.is_grad_enabled()


def _denominator(count, num_items):
    if num_items is not None:
        return torch.as_tensor(num_items, device=count.device).float()
    return count.clamp(min=1).float()


def kd_loss(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
            teacher_logprobs: torch.Tensor, mask: torch.Tensor | None = None, *,
            temperature: float = 1.0, normalize: str = "full", reduction: str = "mean",
            num_items=None) -> torch.Tensor:
    """`jax_fusedloss.kd_loss` from PyTorch, on the same Triton kernels (see its docs).

    Validated as the JAX API (shapes, dtypes, options); the gradient is first-order only."""
    _check_teacher(student_logits, teacher_ids, teacher_logprobs, mask)
    temperature = _check(temperature, normalize, reduction, num_items)
    ids, lp, has_entry = _prepare(student_logits, teacher_ids, teacher_logprobs, mask)
    n = ids.shape[0]
    scale = (1.0 / _denominator(has_entry.sum(), num_items) if reduction == "mean"
             else torch.ones((), device=ids.device))
    row_scale = torch.stack([torch.zeros(n, device=ids.device), scale.expand(n)], 1).contiguous()
    y = torch.zeros(n, dtype=torch.int32, device=ids.device)
    loss = _KD.apply(student_logits, ids, lp, y, row_scale, float(temperature), normalize,
                     False, -1, reduction, _needs_grad(student_logits), (0.0, 0.0, None))
    return loss.reshape(student_logits.shape[:-1]) if reduction == "none" else loss


def distill_loss(student_logits: torch.Tensor, labels: torch.Tensor, teacher_ids: torch.Tensor,
                 teacher_logprobs: torch.Tensor, mask: torch.Tensor | None = None, *,
                 alpha: float, temperature: float = 1.0, ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 logit_softcap: float | None = None, normalize: str = "full",
                 reduction: str = "mean", num_items=None,
                 temperature_squared: bool = False) -> torch.Tensor:
    """`jax_fusedloss.distill_loss` from PyTorch, on the same Triton kernels (see its docs).

    Validated as the JAX API (shapes, dtypes, options; labels range-checked at their own width
    before they are narrowed to int32); the gradient is first-order only."""
    _check_teacher(student_logits, teacher_ids, teacher_logprobs, mask)
    _checks.check_int_tensor(labels, "labels", student_logits.shape[:-1],
                             "student_logits.shape[:-1]")
    _checks.check_same_device("labels", labels, student_logits, "student_logits")
    temperature = _check(temperature, normalize, reduction, num_items)
    alpha = _checks.check_float(alpha, "alpha", lo=0.0, hi=1.0)
    ignore_index = _checks.check_int(ignore_index, "ignore_index")
    ce_options = check_ce_options(label_smoothing, z_loss, logit_softcap)
    y = _checks.labels_to_int32(labels, ignore_index, student_logits.shape[-1])
    active = y != ignore_index
    ids, lp, has_entry = _prepare(student_logits, teacher_ids, teacher_logprobs, mask, active)
    n = ids.shape[0]
    ce_w = torch.full((), float(alpha), device=ids.device)
    kd_w = torch.full((), (1.0 - alpha) * (temperature**2 if temperature_squared else 1.0),
                      device=ids.device)
    if reduction == "mean":
        ce_w = ce_w / _denominator(active.sum(), num_items)
        kd_w = kd_w / _denominator(has_entry.sum(), num_items)
    row_scale = torch.stack([ce_w.expand(n), kd_w.expand(n)], 1).contiguous()
    loss = _KD.apply(student_logits, ids, lp, y, row_scale, float(temperature), normalize, True,
                     int(ignore_index), reduction, _needs_grad(student_logits), ce_options)
    return loss.reshape(labels.shape) if reduction == "none" else loss

