"""GPU only: the compiled reduction kernels from JAX (jax-triton) and from PyTorch agree with
each other and with the float64 reference at realistic sizes, on both launch paths."""
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
from jax_fusedloss import _triton_jax  # noqa: E402
from jax_fusedloss.kernels.reductions import reduction_config  # noqa: E402
from tests.helpers import assert_close, assert_grad_close  # noqa: E402
from tests.reference import torch_oracle  # noqa: E402

SIZES = [(n, v) for v in (128256, 256000) for n in (1, 8, 64, 4096)]
REF_ROWS = 16  # the float64 reference runs on at most this many rows
TEMPERATURE = 0.8  # for token_logprobs; logsumexp runs at temperature 1
VALUE_TOL = dict(rtol=5e-5, atol=1e-4)  # float32 accumulation over up to 256K entries


def inputs(n, vocab, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    logits = (jax.random.normal(keys[0], (n, vocab), jnp.float32) * 2.0).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[1], (n,), 0, vocab, jnp.int32)
    weights = {k: jax.random.normal(keys[i + 2], (n,))
               for i, k in enumerate(("lse", "ent", "logp"))}
    return logits, labels, weights


def run_jax(logits, labels, weights):
    def f(x):
        lse = jax_fusedloss.logsumexp(x, implementation="triton")
        logp, ent = jax_fusedloss.token_logprobs(x, labels, temperature=TEMPERATURE,
                                                 return_entropy=True, implementation="triton")
        outs = {"lse": lse, "ent": ent, "logp": logp}
        return sum(jnp.sum(o * weights[k]) for k, o in outs.items()), outs

    (_, outs), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(logits)
    return {k: np.asarray(v) for k, v in outs.items()}, grad


def run_torch(x, y, w):
    x = x.clone().requires_grad_(True)
    lse = torch_ref.logsumexp(x)
    logp, ent = torch_ref.token_logprobs(x, y, temperature=TEMPERATURE, return_entropy=True)
    outs = {"lse": lse, "ent": ent, "logp": logp}
    sum((o * w[k]).sum() for k, o in outs.items()).backward()
    return {k: o.detach() for k, o in outs.items()}, x.grad


def run_reference(x, y, w):
    x = x.double().requires_grad_(True)
    lse, _, _ = torch_oracle.reductions_reference(x, y)
    _, ent, logp = torch_oracle.reductions_reference(x, y, temperature=TEMPERATURE)
    outs = {"lse": lse, "ent": ent, "logp": logp}
    sum((o * w[k].double()).sum() for k, o in outs.items()).backward()
    return {k: o.detach() for k, o in outs.items()}, x.grad


@pytest.mark.gpu
@pytest.mark.parametrize("n,vocab", SIZES, ids=str)
def test_compiled_values_and_grads(n, vocab):
    cfg = reduction_config(n, vocab, _triton_jax.num_sms())
    assert (cfg.num_splits > 1) == (n <= 64), cfg  # both paths run (132 SMs on H100/H200)
    logits, labels, weights = inputs(n, vocab)
    j_outs, j_grad = run_jax(logits, labels, weights)
    x = torch.from_dlpack(logits)
    y = torch.from_dlpack(labels).long()
    w = {k: torch.from_dlpack(v) for k, v in weights.items()}
    t_outs, t_grad = run_torch(x, y, w)
    for k in j_outs:
        assert_close(j_outs[k], t_outs[k], rtol=1e-6, atol=1e-6, what=f"jax vs torch {k}")
    rows = torch.as_tensor(np.unique(np.linspace(0, n - 1, min(n, REF_ROWS)).astype(np.int64)),
                           device=x.device)
    r_outs, r_grad = run_reference(x[rows], y[rows], {k: v[rows] for k, v in w.items()})
    for k in r_outs:
        assert_close(j_outs[k][rows.cpu().numpy()], r_outs[k], **VALUE_TOL, what=f"jax {k}")
    assert j_grad.dtype == jnp.bfloat16 and t_grad.dtype == torch.bfloat16
    assert_grad_close(torch.from_dlpack(j_grad)[rows], r_grad, "bfloat16", what="jax grad")
    assert_grad_close(t_grad[rows], r_grad, "bfloat16", what="torch grad")
    diff = (torch.from_dlpack(j_grad).float() - t_grad.float()).abs().max().item()
    scale = t_grad.float().abs().max().item()
    assert diff <= 1e-2 * scale, f"jax vs torch grad: max abs diff {diff:.3g}, scale {scale:.3g}"
