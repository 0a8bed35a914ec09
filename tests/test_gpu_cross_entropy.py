"""cross_entropy on a CUDA GPU: compiled kernels through jax-triton and torch at real sizes."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import jax_fusedloss
import torch_ref
from tests.helpers import VALUE_RTOL, assert_close, assert_grad_close, from_torch
from tests.reference import torch_oracle

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(n, v, dtype, seed=0, ignore_frac=0.1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(n, v, device=DEV, generator=g) * 2.0).to(getattr(torch, dtype))
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    y[torch.rand(n, device=DEV, generator=g) < ignore_frac] = -100
    return x, y


def _jax(t):
    return from_torch(t)


def _reference(x, y, rows, **opts):
    """float64 plain-PyTorch loss ('none') and gradient of sum(loss) on a subset of rows."""
    xr = x[rows].double().requires_grad_(True)
    loss = torch_oracle.cross_entropy_reference(xr, y[rows], reduction="none",
                                                dtype=torch.float64, **opts)
    loss.sum().backward()
    return loss.detach(), xr.grad


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [4096, 8])
@pytest.mark.parametrize("opts", [{}, dict(label_smoothing=0.1, z_loss=1e-4, logit_softcap=30.0)],
                         ids=["plain", "combined"])
def test_cross_framework_llama3_vocab(dtype, n, opts):
    v = 128256
    x, y = _inputs(n, v, dtype)
    rows = torch.arange(0, n, max(1, n // 64), device=DEV)
    rloss, rgrad = _reference(x, y, rows, **opts)
    f = jax.jit(jax.value_and_grad(
        lambda a, b: jax_fusedloss.cross_entropy(a, b, reduction="sum", implementation="triton",
                                                 **opts)))
    per_tok = jax.jit(lambda a, b: jax_fusedloss.cross_entropy(
        a, b, reduction="none", implementation="triton", **opts))(_jax(x), _jax(y))
    total, grad = f(_jax(x), _jax(y))
    idx = rows.cpu().numpy()
    assert_close(np.asarray(per_tok)[idx], rloss.cpu(), rtol=VALUE_RTOL[dtype], atol=1e-4,
                 what="jax per-token loss")
    assert_grad_close(torch.from_dlpack(grad)[rows].float().cpu(), rgrad.cpu(), dtype,
                      what="jax grad")
    xt = x.clone().requires_grad_(True)
    tloss = torch_ref.cross_entropy(xt, y, reduction="sum", **opts)
    tloss.backward()
    assert_close(np.asarray(total), tloss.detach().cpu(), rtol=1e-5, what="jax vs torch_ref sum")
    assert_grad_close(xt.grad[rows].float().cpu(), rgrad.cpu(), dtype, what="torch_ref grad")


@pytest.mark.parametrize("n,v", [(16896, 128256), (8448, 256000), (8448, 256001)])
def test_more_than_2_31_elements(n, v):
    """N * V > 2^31: int64 row offsets; checks the last rows against float64. At V=256000 the
    gradient comes from the one-launch split kernel (rows of 500 KiB), aligned and not."""
    from jax_fusedloss.kernels import launch

    assert n * v > 2**31
    assert (launch.split_fused_config(n, v, 2, 132) is not None) == (v > 200000)
    x, y = _inputs(n, v, "bfloat16", seed=3)
    rows = torch.arange(n - 8, n, device=DEV)
    rloss, rgrad = _reference(x, y, rows)
    per_tok = jax.jit(lambda a, b: jax_fusedloss.cross_entropy(
        a, b, reduction="none", implementation="triton"))(_jax(x), _jax(y))
    assert_close(np.asarray(per_tok)[-8:], rloss.cpu(), rtol=2e-5, atol=1e-4,
                 what="last rows' loss")
    grad = jax.jit(jax.grad(lambda a, b: jax_fusedloss.cross_entropy(
        a, b, reduction="sum", implementation="triton")))(_jax(x), _jax(y))
    assert_grad_close(torch.from_dlpack(grad)[-8:].float().cpu(), rgrad.cpu(), "bfloat16",
                      what="last rows' grad")


def test_auto_implementation_is_triton_and_scaled_cotangent():
    from jax_fusedloss import _common

    assert _common.default_implementation() == "triton"
    x, y = _inputs(64, 50257, "bfloat16", seed=5)
    rows = torch.arange(64, device=DEV)
    _, rgrad = _reference(x, y, rows)
    n_valid = int((y != -100).sum())
    grad = jax.jit(jax.grad(lambda a: 0.5 * jax_fusedloss.cross_entropy(a, _jax(y))))(_jax(x))
    assert_grad_close(torch.from_dlpack(grad).float().cpu(), 0.5 * rgrad.cpu() / n_valid,
                      "bfloat16", what="scaled mean grad")


@pytest.mark.parametrize("v,kernel,keep", [(151936, "ce_fwd_kernel", 2),
                                           (128256, "ce_fwd_kernel", 1),
                                           (256000, "ce_split_fused_kernel", 1),
                                           (255999, "ce_split_fused_kernel", 1)])
def test_kept_tiles_in_place_equals_out_of_place(v, kernel, keep):
    """The fused forward + gradient that keeps tiles in registers (launch.keep_tiles,
    SPLIT_FUSED_KEEP) writing its gradient over the logits (linear_cross_entropy's chunks)
    gives the same loss, lse, coefficients and gradient, bit for bit, as with a separate
    gradient buffer (compiled kernels, torch_ref's plan executor)."""
    from jax_fusedloss.kernels import cross_entropy as ce
    from torch_ref import _launch

    n = 2048
    x, y = _inputs(n, v, "bfloat16", seed=v)
    y = y.to(torch.int32)
    scale = torch.rand(n, device=DEV)
    outs = {}
    for in_place in (False, True):
        plan = ce.ce_fwd_plan(n, v, ignore_index=-100, smoothing=0.0, z_loss=1e-4, softcap=None,
                              num_sms=_launch.num_sms(x), write_grad=True, itemsize=2,
                              in_place=in_place)
        step = plan.launches[0]
        assert step.kernel.__name__ == kernel and step.constexprs["KEEP"] == keep
        xi = x.clone()
        outs[in_place] = _launch.run_plan(plan, x=xi, y=y, row_scale=scale)
        assert (outs[in_place][3].data_ptr() == xi.data_ptr()) == in_place
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
