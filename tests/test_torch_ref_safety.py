"""torch_ref safety (issue 12): repeated backward through a retained graph, create_graph,
shape validation before any kernel reads, the JAX API's option checks, and labels wider than
int32 range-checked at their own width. Values against float64 NumPy references."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_ref

V = 300


def np_ce_grad(x, y):
    """float64 gradient of the summed cross-entropy."""
    x = x.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p


def np_kd_grad(x, ids, lp, t):
    """float64 gradient of the summed "full" KL over the teacher's entries."""
    s = x.astype(np.float64) / t
    q = np.exp(s - s.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    p = np.exp(lp.astype(np.float64))
    g = p.sum(-1, keepdims=True) * q
    np.add.at(g, (np.arange(len(x))[:, None].repeat(ids.shape[1], 1), ids), -p)
    return g / t


def inputs(seed, n=4):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(n, V)).astype(np.float32) * 2)
    y = torch.from_numpy(rng.integers(0, V, size=n).astype(np.int64))
    ids = torch.from_numpy(np.stack([rng.choice(V, 6, replace=False) for _ in range(n)]))
    lp = torch.log_softmax(torch.randn(n, 6, generator=torch.Generator().manual_seed(seed)), -1)
    return x, y, ids, lp


def close(a, b, what, rtol=2e-5):
    a = a.detach().double().numpy()
    atol = rtol * float(np.abs(b).max())
    err = np.abs(a - b).max()
    assert np.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max abs error {err:.3g}"


# ----------------------------------------------------------------------------- repeated backward
LOSSES = {
    "ce-mean": lambda x, y, ids, lp: torch_ref.cross_entropy(x, y, reduction="sum"),
    "ce-none": lambda x, y, ids, lp: torch_ref.cross_entropy(x, y, reduction="none"),
    "kd-none": lambda x, y, ids, lp: torch_ref.kd_loss(x, ids, lp, reduction="none",
                                                       temperature=2.0),
    "kd-sum": lambda x, y, ids, lp: torch_ref.kd_loss(x, ids, lp, reduction="sum",
                                                      temperature=2.0),
}


def reference_grad(name, x, y, ids, lp):
    if name.startswith("ce"):
        return np_ce_grad(x.numpy(), y.numpy())
    return np_kd_grad(x.numpy(), ids.numpy(), lp.numpy(), 2.0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_second_backward_through_retained_graph(name, interpreter):
    """Two autograd.grad calls on one graph with a cotangent != 1: both equal cot * grad, and
    the first result is not changed by the second call (the saved unit-cotangent gradient was
    rescaled in place: cot**2 the second time, and the first result overwritten)."""
    x, y, ids, lp = inputs(1)
    x.requires_grad_(True)
    w = torch.tensor([3.0, 0.5, 1.0, -2.0])
    loss = LOSSES[name](x, y, ids, lp)
    total = (loss * w).sum() if loss.dim() else loss * 3.0
    scale = (w[:, None] if loss.dim() else torch.tensor(3.0)).double().numpy()
    ref = reference_grad(name, x.detach(), y, ids, lp) * scale
    (g1,) = torch.autograd.grad(total, x, retain_graph=True)
    g1_copy = g1.clone()
    (g2,) = torch.autograd.grad(total, x, retain_graph=True)
    close(g1, ref, "first grad")
    close(g2, ref, "second grad")
    assert torch.equal(g1, g1_copy), "the second backward changed the first result"
    total.backward(retain_graph=True)
    total.backward()
    close(x.grad, 2 * ref, "two accumulated backward calls")


@pytest.mark.parametrize("name", ["ce-mean", "kd-sum"])
def test_unit_cotangent_backward_twice(name, interpreter):
    x, y, ids, lp = inputs(2)
    x.requires_grad_(True)
    loss = LOSSES[name](x, y, ids, lp)
    for _ in range(3):
        loss.backward(retain_graph=True)
    close(x.grad, 3 * reference_grad(name, x.detach(), y, ids, lp), "three backward calls")


@pytest.mark.parametrize("fn", ["ce", "lse", "kd"])
def test_create_graph_double_backward_raises(fn, interpreter):
    """The kernels' gradient is first-order only: create_graph=True raises a clear error
    instead of returning the gradient as a constant (second-order terms silently wrong)."""
    x, y, ids, lp = inputs(3)
    x.requires_grad_(True)
    loss = {"ce": lambda: torch_ref.cross_entropy(x, y),
            "lse": lambda: torch_ref.logsumexp(x).sum(),
            "kd": lambda: torch_ref.kd_loss(x, ids, lp)}[fn]()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)


# ----------------------------------------------------------------------------- shapes
def test_kd_teacher_rows_must_match(interpreter):
    """Fewer rows of teacher entries than logits read past the teacher tensors before."""
    x, y, ids, lp = inputs(4)
    with pytest.raises(ValueError, match="teacher_ids.shape"):
        torch_ref.kd_loss(x, ids[:2], lp[:2])
    with pytest.raises(ValueError, match="teacher_logprobs.shape"):
        torch_ref.kd_loss(x, ids, lp[:2])
    with pytest.raises(ValueError, match="mask.shape"):
        torch_ref.kd_loss(x, ids, lp, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="labels.shape"):
        torch_ref.distill_loss(x, y[:2], ids, lp, alpha=0.5)
    with pytest.raises(TypeError, match="teacher_ids.dtype"):
        torch_ref.kd_loss(x, ids.float(), lp)
    with pytest.raises(TypeError, match="teacher_logprobs.dtype"):
        torch_ref.kd_loss(x, ids, ids)
    with pytest.raises(ValueError, match="K"):
        torch_ref.kd_loss(x[:, :4], ids[:, :5] % 4, lp[:, :5])


def test_ce_and_reductions_shapes_and_dtypes(interpreter):
    x, y, _, _ = inputs(5)
    with pytest.raises(ValueError, match="labels.shape"):
        torch_ref.cross_entropy(x, y[:3])
    with pytest.raises(TypeError, match="labels.dtype"):
        torch_ref.cross_entropy(x, y.float())
    with pytest.raises(TypeError, match="labels.dtype"):
        torch_ref.token_logprobs(x, y.float())
    with pytest.raises(TypeError, match="logits.dtype"):
        torch_ref.logsumexp(x.double())
    with pytest.raises(ValueError, match="labels.shape"):
        torch_ref.token_logprobs(x, y[:1])


# ----------------------------------------------------------------------------- options
NAN, INF = math.nan, math.inf
BAD_OPTIONS = [
    ("ce", dict(logit_softcap=0.0), "logit_softcap"),
    ("ce", dict(logit_softcap=-1.0), "logit_softcap"),
    ("ce", dict(logit_softcap=INF), "logit_softcap"),
    ("ce", dict(logit_softcap=NAN), "logit_softcap"),
    ("ce", dict(z_loss=-1e-4), "z_loss"),
    ("ce", dict(z_loss=NAN), "z_loss"),
    ("ce", dict(label_smoothing=2.0), "label_smoothing"),
    ("ce", dict(label_smoothing=-0.1), "label_smoothing"),
    ("ce", dict(label_smoothing=NAN), "label_smoothing"),
    ("ce", dict(ignore_index=2**31), "ignore_index"),
    ("ce", dict(reduction="avg"), "reduction"),
    ("kd", dict(temperature=INF), "temperature"),
    ("kd", dict(temperature=0.0), "temperature"),
    ("kd", dict(temperature=NAN), "temperature"),
    ("kd", dict(num_items=0), "num_items"),
    ("kd", dict(num_items=torch.tensor(0.0)), "num_items"),
    ("kd", dict(num_items=3, reduction="sum"), "num_items"),
    ("kd", dict(normalize="soft"), "normalize"),
    ("distill", dict(alpha=2.0), "alpha"),
    ("distill", dict(alpha=NAN), "alpha"),
    ("distill", dict(alpha=0.5, ignore_index=-(2**40)), "ignore_index"),
    ("distill", dict(alpha=0.5, temperature=-1.0), "temperature"),
    ("lse", dict(temperature=INF), "temperature"),
    ("lse", dict(temperature=NAN), "temperature"),
]


@pytest.mark.parametrize("fn,opts,name", BAD_OPTIONS,
                         ids=[f"{f}-{n}-{o.get(n, o)}" for f, o, n in BAD_OPTIONS])
def test_options_validated_as_the_jax_api(fn, opts, name, interpreter):
    x, y, ids, lp = inputs(6)
    call = {"ce": lambda: torch_ref.cross_entropy(x, y, **opts),
            "kd": lambda: torch_ref.kd_loss(x, ids, lp, **opts),
            "distill": lambda: torch_ref.distill_loss(x, y, ids, lp, **opts),
            "lse": lambda: torch_ref.logsumexp(x, **opts)}[fn]
    with pytest.raises(ValueError, match=name):
        call()


def test_valid_edge_options_accepted(interpreter):
    x, y, ids, lp = inputs(7)
    torch_ref.cross_entropy(x, y, label_smoothing=1.0, z_loss=0.0, logit_softcap=1e-3)
    torch_ref.kd_loss(x, ids, lp, num_items=torch.tensor(5), temperature=1e-3)
    torch_ref.distill_loss(x, y, ids, lp, alpha=0.0, ignore_index=2**31 - 1)


# ----------------------------------------------------------------------------- wide labels
def test_int64_labels_checked_at_own_width(interpreter):
    """int64 2**32 + 1 was scored as class 1 and -2**32 - 100 as ignored after .to(int32):
    both are out of range, so NaN (the documented policy), on every op taking labels."""
    x, _, ids, lp = inputs(8)
    y = torch.tensor([2**32 + 1, -(2**32) - 100, 1, -100])
    loss = torch_ref.cross_entropy(x, y, reduction="none")
    assert torch.isnan(loss[:2]).all() and torch.isfinite(loss[2]) and loss[3] == 0, loss
    ref = torch_ref.cross_entropy(x[2:3], torch.tensor([1]), reduction="none")
    assert torch.equal(loss[2:3], ref)
    logp = torch_ref.token_logprobs(x, y.abs() % (2**33))
    assert torch.isnan(logp[:2]).all() and torch.isfinite(logp[2:]).all(), logp
    loss = torch_ref.distill_loss(x, y, ids, lp, alpha=0.5, reduction="none")
    assert torch.isnan(loss[:2]).all() and torch.isfinite(loss[2]) and loss[3] == 0, loss
    ignored = torch_ref.cross_entropy(x, torch.tensor([-1, 2**32 - 1, 3, 4]), ignore_index=-1,
                                      reduction="none")
    assert ignored[0] == 0 and torch.isnan(ignored[1]), ignored


def test_uint_and_narrow_labels(interpreter):
    x, _, _, _ = inputs(9)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        y = torch.tensor([1, 2, 3, 250], dtype=dtype)
        loss = torch_ref.cross_entropy(x, y, reduction="none")
        ref = torch_ref.cross_entropy(x, y.long(), reduction="none")
        assert torch.equal(loss, ref), dtype
    with pytest.raises(TypeError, match="uint64"):
        torch_ref.cross_entropy(x, torch.tensor([1, 2, 3, 4], dtype=torch.uint64))
