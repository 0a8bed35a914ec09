"""Top-K distillation from PyTorch over the same Triton kernels."""
from __future__ import annotations

import torch

from jax_fusedloss import _validate
from jax_fusedloss.kernels import kd as k
from torch_ref import _checks, _kd_rows64, _launch, _weights
from torch_ref._kd_rows64 import Form
from torch_ref._checks import no_double_backward
from torch_ref._launch import run_plan
from torch_ref.cross_entropy import check_ce_options, scaled_saved_grad


def _rows(x, ids, lp, y, row_scale, form: Form, write_grad, want_stats=False):
    """Per-row loss [N], the unit-cotangent gradient (or None) and, with want_stats, the
    per-row statistics (or None): kd_fwd_plan, or the float64 rows of _kd_rows64 for
    tail=True."""
    if form.tail:
        loss, stats = _kd_rows64.tail_fwd(x, ids, lp, y, row_scale, form)
        grad = _kd_rows64.block_grad(x, 0, ids, lp, y, stats, form, x.shape[1]) \
            if write_grad else None
        return loss, grad, stats
    n, vocab = x.shape
    plan = k.kd_fwd_plan(n, vocab, ids.shape[1], temperature=form.temperature,
                         normalize=form.normalize, distill=form.distill,
                         ignore_index=form.ignore_index, num_sms=_launch.num_sms(x),
                         write_grad=write_grad, smoothing=form.smoothing, z_loss=form.z_loss,
                         softcap=form.softcap, itemsize=x.element_size())
    outs = run_plan(plan, x=x, ids=ids, lp=lp, y=y, row_scale=row_scale)
    return outs[0], outs[2] if write_grad else None, outs[1] if want_stats else None


class _KD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, lp, y, row_scale, form, reduction, write_grad):
        x = logits.reshape(-1, logits.shape[-1]).contiguous()
        loss, grad, _ = _rows(x, ids, lp, y, row_scale, form, write_grad)
        ctx.reduction, ctx.shape, ctx.form = reduction, logits.shape, form
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
            return (scaled_saved_grad(saved[0], g, per_row),) + (None,) * 7
        _, x, ids, lp, y, row_scale = saved
        cot = (g.reshape(-1) if per_row else g.reshape(1).expand(x.shape[0])).float()
        _, grad, _ = _rows(x, ids, lp, y, (row_scale * cot[:, None]).contiguous(), ctx.form,
                           True)
        return (grad.view(ctx.shape),) + (None,) * 7


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


DIVERGENCES = ("kl", "jsd")


def check_divergence(tail, divergence, beta, normalize) -> tuple[bool, str, float]:
    """(tail, divergence, beta) as jax_fusedloss._kd_inputs.check_divergence: "jsd" needs
    tail=True, tail needs normalize="full"."""
    tail = _checks.check_bool(tail, "tail")
    _checks.check_choice(divergence, "divergence", DIVERGENCES)
    beta = _checks.check_float(beta, "beta", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    if divergence == "jsd" and not tail:
        raise ValueError('divergence="jsd" requires tail=True (the generalised Jensen-Shannon '
                         "divergence is taken over the K+1 buckets: the teacher's ids and the "
                         "tail)")
    if tail and normalize != "full":
        raise ValueError(f'tail=True requires normalize="full", got normalize={normalize!r} '
                         "(a student renormalised over the teacher's ids has no tail)")
    return tail, divergence, beta


def token_weights(weights, where, lead, ref):
    """(float32 [N] weights or None, bool [N] where or None) of the distillation ops."""
    return _weights.token_weights(weights, where, lead, ref, "the tokens' shape ")


def row_scales(terms, w, reduction, num_items):
    """float32 [N, 2] row weights of (cross-entropy, KD): `terms` ((coef, counted [N]),
    (coef, counted)), counted None for a term the op lacks (jax_fusedloss._kd_inputs)."""
    cols = [torch.zeros(terms[1][1].shape, device=terms[1][1].device) if counted is None
            else _weights.kd_column(coef, counted, w, reduction, num_items)
            for coef, counted in terms]
    return torch.stack(cols, 1).contiguous()


def _needs_grad(logits: torch.Tensor) -> bool:
    """Whether the forward should write the gradient (skipped under torch.no_grad())."""
    return logits.requires_grad and torch.is_grad_enabled()


def kd_loss(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
            teacher_logprobs: torch.Tensor, mask: torch.Tensor | None = None, *,
            temperature: float = 1.0, normalize: str = "full", reduction: str = "mean",
            num_items=None, tail: bool = False, divergence: str = "kl", beta: float = 0.5,
            weights: torch.Tensor | None = None,
            where: torch.Tensor | None = None) -> torch.Tensor:
    """`jax_fusedloss.kd_loss` from PyTorch, on the same Triton kernels (see its docs).

    Validated as the JAX API (shapes, dtypes, options); the gradient is first-order only.
    `weights` / `where` as in JAX (per-row scales of the fused gradient, no gradient).
    `tail=True` (divergence "kl" or "jsd") runs float64 torch rows (torch_ref/_kd_rows64.py)
    instead of the Triton kernels."""
    _check_teacher(student_logits, teacher_ids, teacher_logprobs, mask)
    temperature = _check(temperature, normalize, reduction, num_items)
    tail, divergence, beta = check_divergence(tail, divergence, beta, normalize)
    lead = student_logits.shape[:-1]
    w, keep = token_weights(weights, where, lead, student_logits)
    ids, lp, has_entry = _prepare(student_logits, teacher_ids, teacher_logprobs, mask, keep)
    n = ids.shape[0]
    row_scale = row_scales(((0.0, None), (1.0, has_entry)), w, reduction, num_items)
    y = torch.zeros(n, dtype=torch.int32, device=ids.device)
    form = Form(float(temperature), normalize, False, -1, tail=tail, divergence=divergence,
                beta=beta)
    loss = _KD.apply(student_logits, ids, lp, y, row_scale, form, reduction,
                     _needs_grad(student_logits))
    return loss.reshape(lead) if reduction == "none" else loss


def distill_loss(student_logits: torch.Tensor, labels: torch.Tensor, teacher_ids: torch.Tensor,
                 teacher_logprobs: torch.Tensor, mask: torch.Tensor | None = None, *,
                 alpha: float, temperature: float = 1.0, ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 logit_softcap: float | None = None, normalize: str = "full",
                 reduction: str = "mean", num_items=None,
                 temperature_squared: bool = False, check_labels: bool = False,
                 tail: bool = False, divergence: str = "kl", beta: float = 0.5,
                 weights: torch.Tensor | None = None,
                 where: torch.Tensor | None = None) -> torch.Tensor:
    """`jax_fusedloss.distill_loss` from PyTorch, on the same Triton kernels (see its docs).

    Validated as the JAX API (shapes, dtypes, options; labels range-checked at their own width
    before they are narrowed to int32); the gradient is first-order only. `check_labels`,
    `weights` / `where` and `tail` / `divergence` / `beta` as in `kd_loss` and JAX."""
    _check_teacher(student_logits, teacher_ids, teacher_logprobs, mask)
    _checks.check_int_tensor(labels, "labels", student_logits.shape[:-1],
                             "student_logits.shape[:-1]")
    _checks.check_same_device("labels", labels, student_logits, "student_logits")
    temperature = _check(temperature, normalize, reduction, num_items)
    tail, divergence, beta = check_divergence(tail, divergence, beta, normalize)
    alpha = _checks.check_float(alpha, "alpha", lo=0.0, hi=1.0)
    ignore_index = _checks.check_int(ignore_index, "ignore_index")
    ce_options = check_ce_options(label_smoothing, z_loss, logit_softcap)
    vocab = student_logits.shape[-1]
    _checks.check_labels(labels, vocab, ignore_index,
                         _checks.check_bool(check_labels, "check_labels"))
    kd_w = (1.0 - alpha) * _validate.check_temperature_squared(temperature, temperature_squared)
    w, keep = token_weights(weights, where, labels.shape, student_logits)
    y = _checks.labels_to_int32(labels, ignore_index, vocab)
    if keep is not None:
        y = torch.where(keep, y, torch.full_like(y, ignore_index)).contiguous()
    active = y != ignore_index
    ids, lp, has_entry = _prepare(student_logits, teacher_ids, teacher_logprobs, mask, active)
    row_scale = row_scales(((alpha, active), (kd_w, has_entry)), w, reduction, num_items)
    form = Form(float(temperature), normalize, True, int(ignore_index), *ce_options, tail=tail,
                divergence=divergence, beta=beta)
    loss = _KD.apply(student_logits, ids, lp, y, row_scale, form, reduction,
                     _needs_grad(student_logits))
    return loss.reshape(labels.shape) if reduction == "none" else loss
