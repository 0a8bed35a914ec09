"""Every kernel family at small shapes on a CUDA GPU, for compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m tests.sanitizer_check torch
    compute-sanitizer --tool racecheck --error-exitcode 1 python -m tests.sanitizer_check torch
    compute-sanitizer --tool memcheck --error-exitcode 1 python -m tests.sanitizer_check jax
    compute-sanitizer --tool memcheck --error-exitcode 1 python -m tests.sanitizer_check lm_head

Shapes cover the row path and the split path (few rows), an odd vocabulary (5003, no vector
alignment), a tile-sized one (4096), rows long enough for the fused pass's prefetch (65537, the
row path) and, in float32, for the one-launch split forward + gradient (114689, torch only),
ignored and out-of-range labels and teacher ids, and
both gradient routes (unit and non-unit cotangents). Prints "ok" at the end.
"""
from __future__ import annotations

import os
import sys


def run_torch() -> None:
    import torch

    import torch_ref

    dev = "cuda"
    # (264, 114689): float32 rows of 448 KiB take the one-launch split forward + gradient
    for n, v in ((300, 5003), (3, 5003), (257, 4096), (2, 70000), (264, 65537), (264, 114689)):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(n, v, device=dev) * 2).to(dtype).requires_grad_(True)
            y = torch.randint(0, v, (n,), device=dev)
            y[0] = -100
            if n > 2:
                y[1] = v + 7  # out of range: NaN row, never an address
            ids = torch.randint(-2, v + 2, (n, 16), device=dev)
            lp = torch.log_softmax(torch.randn(n, 16, device=dev), -1)
            losses = [
                torch_ref.cross_entropy(x, y, label_smoothing=0.1, z_loss=1e-4,
                                        logit_softcap=30.0, reduction="none").nan_to_num().sum(),
                torch_ref.cross_entropy(x, y.clamp(min=-100, max=v - 1)) * 3.0,
                torch_ref.logsumexp(x, temperature=0.7).sum(),
                torch_ref.token_logprobs(x, y.clamp(0, v - 1), return_entropy=True)[1].sum(),
                torch_ref.kd_loss(x, ids, lp, temperature=2.0),
                torch_ref.kd_loss(x, ids, lp, normalize="topk"),
                torch_ref.distill_loss(x, y.clamp(min=-100, max=v - 1), ids, lp, alpha=0.4),
            ]
            for loss in losses:
                (g,) = torch.autograd.grad(loss, x)
                assert g.shape == x.shape
    torch.cuda.synchronize()


def run_jax() -> None:
    import jax
    import jax.numpy as jnp

    import jax_fusedloss as jfl

    for n, v in ((300, 5003), (3, 5003), (257, 4096), (2, 70000), (264, 65537)):
        for dtype in (jnp.bfloat16, jnp.float32):
            x = (jax.random.normal(jax.random.key(0), (n, v)) * 2).astype(dtype)
            y = jax.random.randint(jax.random.key(1), (n,), 0, v).at[0].set(-100)
            ids = jax.random.randint(jax.random.key(2), (n, 16), -2, v + 2)
            lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (n, 16)))
            fns = [
                lambda x: jfl.cross_entropy(x, y, label_smoothing=0.1, z_loss=1e-4,
                                            logit_softcap=30.0) * 3.0,
                lambda x: jfl.cross_entropy(x, y, return_lse=True)[1].sum(),
                lambda x: jfl.logsumexp(x, temperature=0.7).sum(),
                lambda x: jfl.token_logprobs(x, jnp.maximum(y, 0), return_entropy=True)[1].sum(),
                lambda x: jfl.kd_loss(x, ids, lp, temperature=2.0),
                lambda x: jfl.distill_loss(x, y, ids, lp, alpha=0.4),
            ]
            for f in fns:
                jax.block_until_ready(jax.jit(jax.value_and_grad(f))(x))


def run_lm_head() -> None:
    """The hidden-state forms in every mode, both walks: row-path chunks (>= 264 rows), few-row
    chunks, and several vocabulary blocks (chunk_size=64 at V=5003: square blocks)."""
    import jax
    import jax.numpy as jnp

    import jax_fusedloss as jfl

    n, d, v = 300, 64, 5003
    k = jax.random.split(jax.random.key(0), 5)
    h = jax.random.normal(k[0], (n, d)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, v)) * 0.1).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, v)
    cot = jax.random.normal(k[3], (n,))
    ids = jax.random.randint(k[4], (n, 16), -2, v + 2)
    lp = jax.nn.log_softmax(jax.random.normal(k[4], (n, 16)))
    for mode in ("fast", "low_precision", "lean"):
        for chunk in (None, 64):
            o = dict(mode=mode, chunk_size=chunk)
            fns = [
                lambda h, w: jfl.linear_cross_entropy(h, w, y, **o) * 3.0,
                lambda h, w: jnp.sum(cot * jfl.linear_token_logprobs(
                    h, w, y, temperature=0.9, return_entropy=True, **o)[0]),
                lambda h, w: jnp.sum(sum(jfl.linear_token_logprobs(
                    h, w, y, return_entropy=True, **o))),
                lambda h, w: jfl.linear_kd_loss(h, w, ids, lp, **o),
                lambda h, w: jfl.linear_distill_loss(h, w, y, ids, lp, alpha=0.4, **o),
            ]
            for f in fns:
                jax.block_until_ready(jax.jit(jax.value_and_grad(f, (0, 1)))(h, w))


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    {"torch": run_torch, "jax": run_jax, "lm_head": run_lm_head}[sys.argv[1]]()
    print("ok")
