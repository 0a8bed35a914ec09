"""The PyTorch side of the benchmark: torch_ref (our kernels), plain PyTorch and Liger-Kernel.

Every implementation is a function of the op's inputs (see `make_inputs`) returning the op's
value; `objective` turns it into the timed function of a mode. `torch.nn.functional
.cross_entropy` and `torch.logsumexp` run on the logits as given; the other plain-PyTorch
formulas upcast to float32 first, as such code usually does.

Liger-Kernel only enters for cross-entropy: its KL-divergence and JSD losses take the full
`[N, V]` teacher distribution, not top-K ids and log-probabilities, so they do not compute
what `kd_loss` computes. Liger's cross-entropy writes the gradient into the logits' buffer
under differentiation (see `MUTATES_INPUT`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks import shapes
from benchmarks.shapes import Problem

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MUTATES_INPUT = {"liger"}  # under fwd_bwd these overwrite the logits with their gradient


def make_inputs(p: Problem, seed: int, device: str,
                logits: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The op's inputs for `p` (the same recipe as `benchmarks.jax_impls.make_inputs`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if logits is None:
        logits = torch.randn(p.n, p.v, dtype=DTYPES[p.dtype], device=device, generator=gen)
        logits.mul_(2)
    kind = shapes.input_kind(p.op)
    out = [logits]
    if kind in ("labels", "both"):
        out.append(torch.randint(0, p.v, (p.n,), device=device, generator=gen))
    if kind in ("teacher", "both"):
        start = torch.randint(0, p.v, (p.n, 1), device=device, generator=gen)
        out.append((start + torch.arange(p.k, device=device) * (p.v // p.k)) % p.v)
        teacher = torch.randn(p.n, p.k, device=device, generator=gen)
        out.append(torch.log_softmax(teacher, dim=-1) + math.log(0.9))
    return tuple(out)


def _log_softmax32(x):
    return torch.log_softmax(x.float(), dim=-1)


def _kd_reference(x, ids, logprobs, temperature=1.0):
    student = torch.gather(torch.log_softmax(x.float() / temperature, dim=-1), -1, ids)
    return (logprobs.exp() * (logprobs - student)).sum(-1).mean()


def _distill_reference(x, y, ids, logprobs):
    """alpha * cross-entropy + (1 - alpha) * KD at the suite's temperature, on float32."""
    a = shapes.DISTILL_ALPHA
    return (a * F.cross_entropy(x.float(), y)
            + (1 - a) * _kd_reference(x, ids, logprobs, shapes.DISTILL_TEMPERATURE))


def _entropy_reference(x):
    logp = _log_softmax32(x)
    return -(logp.exp() * logp).sum(-1)


def _token_logprobs_reference(x, y):
    return torch.gather(_log_softmax32(x), -1, y[:, None])[:, 0]


def _baselines(op: str) -> dict[str, Callable]:
    if op == "cross_entropy":
        return {"torch": lambda x, y: F.cross_entropy(x, y)}
    if op == "logsumexp":
        return {"torch": lambda x: torch.logsumexp(x, dim=-1)}
    return {"torch_fp32": {"kd_loss": _kd_reference, "distill_loss": _distill_reference,
                           "entropy": _entropy_reference,
                           "token_logprobs": _token_logprobs_reference}[op]}


def _liger_cross_entropy() -> Callable:
    """Liger's public functional cross-entropy, or (if its package fails to import) the
    autograd.Function under it, with Liger 0.8.5's positional arguments."""
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction,
        #  softcap, return_z_loss, return_token_accuracy, return_predicted_tokens) -> (loss, ...)
        return lambda x, y: LigerCrossEntropyFunction.apply(
            x, y, None, -100, 0.0, 0.0, "mean", None, False, False, False)[0]
    return lambda x, y: liger_cross_entropy(x, y)


def implementations(op: str, names: set[str] | None,
                    cuda: bool) -> tuple[dict[str, Callable], list[str]]:
    """({impl name: fn(*inputs) -> value}, notes about what was skipped and why).

    `names=None` selects every implementation that can run here: torch_ref and Liger need a
    CUDA device (on the CPU, torch_ref would run through Triton's interpreter).
    """
    impls, notes = {}, []

    def wanted(name: str, needs_cuda: bool) -> bool:
        return name in names if names else (cuda or not needs_cuda)

    if wanted("torch_ref", True):
        try:
            import torch_ref
        except ImportError as e:
            notes.append(f"torch_ref: import failed ({e}); skipped")
        else:
            fn, options = getattr(torch_ref, op), shapes.op_options(op)
            impls["torch_ref"] = (lambda *args, fn=fn: fn(*args, **options)) if options else fn
    impls.update({k: f for k, f in _baselines(op).items() if wanted(k, False)})
    if op == "cross_entropy" and wanted("liger", True):
        try:
            impls["liger"] = _liger_cross_entropy()
        except Exception as e:  # noqa: BLE001 - any import problem means: skip the baseline
            notes.append(f"liger: import failed ({type(e).__name__}: {e}); skipped")
    return impls, notes


def objective(fn: Callable, mode: str) -> Callable:
    """fwd: the op without autograd. fwd_bwd: its mean's value and gradient w.r.t. the logits.

    For fwd_bwd the logits must be a leaf with `requires_grad=True`.
    """
    if mode == "fwd":
        def forward(*args):
            with torch.no_grad():
                return fn(*args)

        return forward

    def forward_backward(x, *rest):
        value = fn(x, *rest)
        if value.ndim:
            value = value.mean()
        (grad,) = torch.autograd.grad(value, x)
        return value, grad

    return forward_backward
