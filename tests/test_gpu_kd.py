"""GPU only: kd_loss and distill_loss through the compiled kernels, from JAX (jax-triton) and
from PyTorch, against each other and the float64 reference at V=128256, K=64, on the fused row
path (N=4096) and the split path (N=8)."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import jax_fusedloss  # noqa: E402
import torch_ref  # noqa: E402
from tests.helpers import assert_close, assert_grad_close, from_torch  # noqa: E402
from tests.reference import torch_oracle  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
V, K = 128256, 64
REF_ROWS = 32  # the float64 reference runs on this many rows
VALUE_TOL = dict(rtol=5e-5, atol=1e-4)  # float32 accumulation over 128K entries


def _inputs(n, dtype, seed=0):
    """Student logits, a correlated teacher's top-K (ids int32, float32 log-probs), a mask
    with about 10% of entries off (and one token with none), labels with 10% ignored, and
    per-token weights."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(n, V, device=DEV, generator=g) * 2.0).to(getattr(torch, dtype))
    ids = torch.empty(n, K, dtype=torch.int32, device=DEV)
    lp = torch.empty(n, K, dtype=torch.float32, device=DEV)
    for lo in range(0, n, 1024):  # the teacher's float32 logits a block of rows at a time
        hi = min(n, lo + 1024)
        t = x[lo:hi].float() + torch.randn(hi - lo, V, device=DEV, generator=g)
        top_lp, top_ids = torch.topk(torch.log_softmax(t, dim=-1), K, dim=-1)
        ids[lo:hi], lp[lo:hi] = top_ids.to(torch.int32), top_lp
    mask = torch.rand(n, K, device=DEV, generator=g) > 0.1
    mask[n // 2] = False
    y = torch.randint(0, V, (n,), device=DEV, generator=g, dtype=torch.int32)
    y[torch.rand(n, device=DEV, generator=g) < 0.1] = -100
    w = torch.rand(n, device=DEV, generator=g)
    return x, ids, lp, mask, y, w


def _jax(t):
    return from_torch(t)


def _rows(n):
    rows = torch.arange(0, n, max(1, n // REF_ROWS), device=DEV)
    return torch.unique(torch.cat([rows, torch.tensor([n // 2], device=DEV)]))


def _reference(fn, x, ids, lp, mask, y, rows, **opts):
    """float64 per-token loss and the gradient of its sum, on a subset of rows."""
    xr = x[rows].double().requires_grad_(True)
    if fn == "kd":
        loss = torch_oracle.kd_loss_reference(xr, ids[rows], lp[rows], mask[rows],
                                              reduction="none", dtype=torch.float64, **opts)
    else:
        loss = torch_oracle.distill_loss_reference(xr, y[rows].long(), ids[rows], lp[rows],
                                                   mask[rows], reduction="none",
                                                   dtype=torch.float64, **opts)
    loss.sum().backward()
    return loss.detach(), xr.grad


def _check(fn, n, dtype, **opts):
    x, ids, lp, mask, y, w = _inputs(n, dtype)
    rows = _rows(n)
    rloss, rgrad = _reference(fn, x, ids, lp, mask, y, rows, **opts)
    jfn = jax_fusedloss.kd_loss if fn == "kd" else jax_fusedloss.distill_loss
    lead = () if fn == "kd" else (_jax(y),)
    teacher = (_jax(ids), _jax(lp), _jax(mask.to(torch.int8)))

    def per_token(a):
        return jfn(a, *lead, *teacher, reduction="none", implementation="triton", **opts)

    # Forward only (no gradient write), then a weighted sum under differentiation: the
    # backward rescales every row of the fused gradient by its weight.
    tok = np.asarray(jax.jit(per_token)(_jax(x)))
    idx = rows.cpu().numpy()
    assert_close(tok[idx], rloss.cpu(), **VALUE_TOL, what=f"jax {fn} per-token loss")
    grad = jax.jit(jax.grad(lambda a, w: jnp.sum(w * per_token(a))))(_jax(x), _jax(w))
    assert_grad_close(torch.from_dlpack(grad)[rows].float().cpu(),
                      (rgrad * w[rows, None].double()).cpu(), dtype, what=f"jax {fn} grad")
    del grad
    total = jax.jit(lambda a: jfn(a, *lead, *teacher, reduction="sum", implementation="triton",
                                  **opts))(_jax(x))
    xt = x.clone().requires_grad_(True)
    tf = torch_ref.kd_loss if fn == "kd" else torch_ref.distill_loss
    targs = (ids, lp, mask) if fn == "kd" else (y, ids, lp, mask)
    tloss = tf(xt, *targs, reduction="sum", **opts)
    tloss.backward()
    assert_close(np.asarray(total), tloss.detach().cpu(), rtol=1e-5, what="jax vs torch_ref sum")
    assert_grad_close(xt.grad[rows].float().cpu(), rgrad.cpu(), dtype, what="torch_ref grad")
    if fn == "kd":
        assert torch.all(xt.grad[n // 2] == 0), "a token without teacher entries"


# Each case compiles its kernels twice (jax-triton and torch): few cases, each covering much.
@pytest.mark.parametrize("n", [4096, 8])
@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_kd_llama3_vocab(n, normalize):
    _check("kd", n, "bfloat16", normalize=normalize, temperature=1.0 if n == 8 else 2.0)


def test_kd_float32():
    _check("kd", 4096, "float32", normalize="full", temperature=1.5)


@pytest.mark.parametrize("n,temperature,normalize", [(4096, 1.0, "full"), (4096, 2.0, "full"),
                                                     (8, 2.0, "topk")])
def test_distill_llama3_vocab(n, temperature, normalize):
    _check("distill", n, "bfloat16", alpha=0.5, temperature=temperature, normalize=normalize,
           temperature_squared=temperature != 1.0)
