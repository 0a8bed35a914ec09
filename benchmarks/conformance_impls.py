"""The columns of the conformance suite: adapters that run one case on one implementation.

An adapter declares the ops and options it supports (anything else: "n/a") and returns the
op's value and the gradient of `loss_scale * sum(value)` w.r.t. the logits, as framework
arrays (`as_f64` converts them, only the rows a case looks at). Ours: jax_fusedloss through
Triton (`ours_jax_triton`; Triton's interpreter without a GPU), the same kernels from PyTorch
(`ours_torch_ref`) and the pure-JAX twin (`ours_jax_xla`). Anchors: optax and the naive
formulas (tests/reference) in plain JAX at the input dtype and in float32;
`torch.nn.functional` at the input dtype and in float32; on a CUDA GPU also Liger-Kernel (as
benchmarks.torch_impls calls it), Cut Cross-Entropy and torch.compile. An implementation without
a "logprobs" op runs log-prob cases at temperature 1 as minus its per-token cross-entropy.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
from typing import Callable

import numpy as np

from benchmarks.conformance_cases import IGNORE, Inputs

CE_OPTS = frozenset({"reduction", "label_smoothing", "z_loss", "ignore_index", "loss_scale"})
ALL = {"ce": CE_OPTS, "logprobs": frozenset({"temperature", "loss_scale"}),
       "kd": frozenset({"temperature", "loss_scale"})}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    ours: bool
    ops: dict                        # op -> frozenset of the options it supports
    run: Callable                    # (op, Inputs, opts) -> (value, grad)
    gpu_only: bool = False
    probe: Callable = lambda: None   # raises ImportError when not installed


def _options(impl: Impl, op: str) -> frozenset | None:
    if op in impl.ops:
        return impl.ops[op]
    if op == "logprobs" and "ce" in impl.ops:  # minus the per-token cross-entropy, T = 1
        return frozenset({"loss_scale"})
    return None


def unsupported(impl: Impl, op: str, required: set) -> str | None:
    """Why `impl` cannot run a case (an "n/a" cell), or None."""
    have = _options(impl, op)
    if have is None:
        return f"no {op} op"
    missing = sorted(required - have)
    return f"no option {', '.join(missing)}" if missing else None


def run_cell(impl: Impl, op: str, inp: Inputs, opts: dict):
    """(value, grad) of `impl` on one case (log-probs as minus the per-token cross-entropy for
    an implementation without a log-prob op)."""
    if op in impl.ops:
        return impl.run(op, inp, opts)
    value, grad = impl.run("ce", inp, dict(opts, reduction="none",
                                           loss_scale=-opts["loss_scale"]))
    return -value, grad


# ----------------------------------------------------------------------------- conversions
def to_torch(a: np.ndarray, device: str):
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def as_f64(a, rows=None) -> np.ndarray:
    """A jax/torch/numpy array (its `rows` only, when given) as float64 numpy."""
    if hasattr(a, "detach"):  # torch
        a = a.detach()
        a = a[rows] if rows is not None else a
        return a.float().cpu().numpy().astype(np.float64)
    import jax.numpy as jnp

    a = a[rows] if rows is not None else a
    return np.asarray(jnp.asarray(a).astype(jnp.float32)).astype(np.float64)


def release_memory() -> None:
    """Hands torch's cached GPU blocks back, so that the next implementation (JAX or torch) has
    the memory for the largest case."""
    if "torch" in sys.modules:
        import torch

        try:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except RuntimeError:  # a faulted context: the next cells record their own errors
            pass


# ----------------------------------------------------------------------------- JAX columns
def _jax_call(fn: Callable, inp: Inputs, opts: dict):
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(inp.x)
    value, vjp = jax.vjp(jax.jit(fn), x)
    (grad,) = vjp(jnp.full(value.shape, opts["loss_scale"], value.dtype))
    return value, grad


def _run_ours_jax(implementation: str, op: str, inp: Inputs, opts: dict):
    import jax.numpy as jnp

    import jax_fusedloss as jfl

    if opts["vocab_parallel"]:
        return _vocab_parallel(implementation, inp, opts)
    y = jnp.asarray(inp.labels)
    if op == "ce":
        fn = lambda x: jfl.cross_entropy(
            x, y, ignore_index=IGNORE, reduction=opts["reduction"], z_loss=opts["z_loss"],
            label_smoothing=opts["label_smoothing"], implementation=implementation)
    elif op == "logprobs":
        fn = lambda x: jfl.token_logprobs(x, y, temperature=opts["temperature"],
                                          implementation=implementation)
    else:
        ids, lp = jnp.asarray(inp.ids), jnp.asarray(inp.lp)
        fn = lambda x: jfl.kd_loss(x, ids, lp, temperature=opts["temperature"],
                                   reduction=opts["reduction"], implementation=implementation)
    return _jax_call(fn, inp, opts)


def _run_jax_naive(upcast: bool, op: str, inp: Inputs, opts: dict):
    """tests/reference/jax_ref's naive formulas at the input dtype (or float32)."""
    import jax.numpy as jnp

    from tests.reference import jax_ref

    y = jnp.asarray(inp.labels)
    pre = (lambda x: x.astype(jnp.float32)) if upcast else (lambda x: x)
    if op == "ce":
        fn = lambda x: jax_ref.cross_entropy(
            pre(x), y, ignore_index=IGNORE, reduction=opts["reduction"],
            label_smoothing=opts["label_smoothing"], z_loss=opts["z_loss"])
    elif op == "logprobs":
        fn = lambda x: jax_ref.token_logprobs(pre(x), y, temperature=opts["temperature"])
    else:
        ids, lp = jnp.asarray(inp.ids), jnp.asarray(inp.lp)
        fn = lambda x: jax_ref.kd_loss(pre(x), ids, lp, temperature=opts["temperature"],
                                       reduction=opts["reduction"])
    return _jax_call(fn, inp, opts)


def _run_optax(op: str, inp: Inputs, opts: dict):
    import jax.numpy as jnp
    import optax

    y = jnp.asarray(inp.labels)
    per_token = lambda x: optax.softmax_cross_entropy_with_integer_labels(x, y)
    fn = per_token if opts["reduction"] == "none" else lambda x: jnp.mean(per_token(x))
    return _jax_call(fn, inp, opts)


# ----------------------------------------------------------------------------- torch columns
def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_call(fn: Callable, inp: Inputs, opts: dict):
    import torch

    x = to_torch(inp.x, _device()).requires_grad_(True)
    value = fn(x)
    (grad,) = torch.autograd.grad(value.sum() * opts["loss_scale"], x)
    return value, grad


def _labels(inp: Inputs, name: str = "labels"):
    return to_torch(getattr(inp, name).astype(np.int64), _device())


def _run_torch_ref(op: str, inp: Inputs, opts: dict):
    import torch_ref

    y = _labels(inp)
    if op == "ce":
        fn = lambda x: torch_ref.cross_entropy(
            x, y, ignore_index=IGNORE, reduction=opts["reduction"], z_loss=opts["z_loss"],
            label_smoothing=opts["label_smoothing"])
    elif op == "logprobs":
        fn = lambda x: torch_ref.token_logprobs(x, y, temperature=opts["temperature"])
    else:
        ids, lp = _labels(inp, "ids"), to_torch(inp.lp, _device())
        fn = lambda x: torch_ref.kd_loss(x, ids, lp, temperature=opts["temperature"],
                                         reduction=opts["reduction"])
    return _torch_call(fn, inp, opts)


def _run_torch(upcast: bool, compiled: bool, op: str, inp: Inputs, opts: dict):
    """torch.nn.functional.cross_entropy (at the input dtype, or float32); the naive formulas
    of tests/reference/torch_oracle for the other ops."""
    import torch
    import torch.nn.functional as F

    from tests.reference import torch_oracle

    y = _labels(inp)
    pre = (lambda x: x.float()) if upcast else (lambda x: x)
    if op == "ce":
        fn = lambda x: F.cross_entropy(pre(x), y, ignore_index=IGNORE,
                                       reduction=opts["reduction"],
                                       label_smoothing=opts["label_smoothing"])
    elif op == "logprobs":
        fn = lambda x: torch_oracle.reductions_reference(
            pre(x), y, temperature=opts["temperature"], dtype=pre(x).dtype)[2]
    else:
        ids, lp = _labels(inp, "ids"), to_torch(inp.lp, _device())
        fn = lambda x: torch_oracle.kd_loss_reference(
            pre(x), ids, lp, temperature=opts["temperature"], reduction=opts["reduction"],
            dtype=pre(x).dtype)
    if compiled:
        x = to_torch(inp.x, _device()).requires_grad_(True)
        value = _compiled_ce()(x, y, opts["reduction"], opts["label_smoothing"])
        (grad,) = torch.autograd.grad(value.sum() * opts["loss_scale"], x)
        return value, grad
    return _torch_call(fn, inp, opts)


@functools.cache
def _compiled_ce():
    """torch.compile of F.cross_entropy at the input dtype, compiled once per dtype, reduction
    and smoothing (dynamic shapes)."""
    import torch
    import torch.nn.functional as F

    torch._dynamo.config.cache_size_limit = 64  # else it falls back to eager after 8 variants

    def ce(x, y, reduction: str, smoothing: float):
        return F.cross_entropy(x, y, ignore_index=IGNORE, reduction=reduction,
                               label_smoothing=smoothing)

    return torch.compile(ce, dynamic=True)


def _run_liger(op: str, inp: Inputs, opts: dict):
    import torch

    from benchmarks.torch_impls import _liger_cross_entropy

    y = _labels(inp)
    if (opts["reduction"], opts["label_smoothing"], opts["z_loss"]) == ("mean", 0.0, 0.0):
        liger = _liger_cross_entropy()  # the call benchmarks.torch_impls times
    else:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss(ignore_index=IGNORE, reduction=opts["reduction"],
                                      label_smoothing=opts["label_smoothing"],
                                      lse_square_scale=opts["z_loss"])

    def fn(x):
        out = liger(x.clone(), y)  # Liger writes its gradient into its input
        if isinstance(out, torch.Tensor):
            return out
        return out.loss if hasattr(out, "loss") else out[0]  # a (loss, z_loss, ...) output

    return _torch_call(fn, inp, opts)


def _run_cce(op: str, inp: Inputs, opts: dict):
    """Cut Cross-Entropy takes embeddings e [N, D] and a classifier c [V, D]: with e the
    identity (D = N rounded up to 16) and c = logits^T, e @ c^T is the logits exactly and the
    classifier's gradient is the logits' gradient, transposed."""
    import torch
    from cut_cross_entropy import linear_cross_entropy

    n, vocab = inp.x.shape
    if n > 1024:
        raise NotImplementedError("n/a: identity embedding needs N <= 1024")
    if str(inp.x.dtype) not in ("bfloat16", "float16"):  # its backward refuses float32
        raise NotImplementedError("n/a: backward needs bf16 or fp16 embeddings")
    d = -(-n // 16) * 16
    x = to_torch(inp.x, _device())
    c = torch.zeros(vocab, d, dtype=x.dtype, device=x.device)
    c[:, :n] = x.t()
    c.requires_grad_(True)
    e = torch.eye(n, d, dtype=x.dtype, device=x.device)
    value = linear_cross_entropy(e, c, _labels(inp), ignore_index=IGNORE,
                                 reduction=opts["reduction"])
    (grad,) = torch.autograd.grad(value.sum() * opts["loss_scale"], c)
    return value, grad[:, :n].t()


# ----------------------------------------------------------------------------- vocab-parallel
def _vocab_parallel(implementation: str, inp: Inputs, opts: dict):
    """Runs benchmarks.conformance_vp in a subprocess: the vocabulary split over 4 CPU devices
    (or over every GPU when there are 2 or more) inside jax.shard_map with vocab_axis."""
    import jax

    from jax_fusedloss._triton_jax import on_cuda_gpu

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if on_cuda_gpu():
        if jax.device_count() < 2:
            raise NotImplementedError("n/a: needs 2+ GPUs (the CPU run covers it)")
    else:
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
        if implementation == "triton":
            env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.npz")
        np.savez(path, x=inp.x.view(np.uint16) if inp.x.dtype.name == "bfloat16" else inp.x,
                 labels=inp.labels, bf16=inp.x.dtype.name == "bfloat16",
                 opts=repr({k: v for k, v in opts.items()}))
        proc = subprocess.run([sys.executable, "-m", "benchmarks.conformance_vp",
                               implementation, path], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"vocab-parallel subprocess failed: {proc.stderr[-400:]}")
        out = np.load(os.path.join(tmp, "out.npz"))
        return out["value"], out["grad"]


# ----------------------------------------------------------------------------- the columns
def _probe(module: str) -> Callable:
    def probe():
        __import__(module)

    return probe


_KD_LP = {"kd": ALL["kd"], "logprobs": ALL["logprobs"]}
IMPLS = (
    Impl("ours_jax_triton", True, {**ALL, "ce": CE_OPTS | {"vocab_parallel"}},
         functools.partial(_run_ours_jax, "triton")),
    Impl("ours_torch_ref", True, ALL, _run_torch_ref, probe=_probe("torch_ref")),
    Impl("ours_jax_xla", True, {**ALL, "ce": CE_OPTS | {"vocab_parallel"}},
         functools.partial(_run_ours_jax, "xla")),
    Impl("optax", False, {"ce": frozenset({"reduction", "loss_scale"})}, _run_optax,
         probe=_probe("optax")),
    Impl("jax_naive", False, ALL, functools.partial(_run_jax_naive, False)),
    Impl("jax_naive_fp32", False, ALL, functools.partial(_run_jax_naive, True)),
    Impl("torch", False, {"ce": CE_OPTS - {"z_loss"}, **_KD_LP},
         functools.partial(_run_torch, False, False)),
    Impl("torch_fp32", False, {"ce": CE_OPTS - {"z_loss"}, **_KD_LP},
         functools.partial(_run_torch, True, False)),
    Impl("liger", False, {"ce": CE_OPTS}, _run_liger, gpu_only=True,
         probe=_probe("liger_kernel")),
    Impl("cut_cross_entropy", False, {"ce": frozenset({"reduction", "ignore_index",
                                                       "loss_scale"})},
         _run_cce, gpu_only=True, probe=_probe("cut_cross_entropy")),
    Impl("torch_compile", False, {"ce": CE_OPTS - {"z_loss"}},
         functools.partial(_run_torch, False, True), gpu_only=True),
)
BY_NAME = {i.name: i for i in IMPLS}
OURS = tuple(i.name for i in IMPLS if i.ours)
