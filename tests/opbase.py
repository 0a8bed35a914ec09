"""One test base for every op: an adapter per op, one grid and one comparison.

An adapter (a subclass of `Op`) says how to build an op's random inputs, how to call it from
JAX (`implementation="triton"` or `"xla"`) and from torch_ref, and its naive reference in
plain JAX (tests/reference/jax_ref.py). `Op.check` runs one implementation, takes the value
and the gradient of `sum_k sum(w_k * out_k)` (w_k random per token for per-token outputs, 1 for
a scalar), and compares them with the float64 reference and its `jax.vjp` gradient at the
per-dtype tolerances of tests/helpers.py. `grid` parametrises a test over implementation x
launch path x dtype x shape x option set (or any other axes).

"triton" is Triton's interpreter without a GPU and the compiled kernels on one; torch_ref
runs on the device the JAX arrays live on. Nothing here is specific to the CPU: the same grid
runs on a GPU (`python -m pytest -q tests/test_cross_entropy.py tests/test_kd.py
tests/test_reductions.py` there).
"""
from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import VALUE_RTOL, assert_close, assert_grad_close, to_numpy, to_torch
from tests.reference import jax_ref

IMPLS = ("triton", "xla", "torch_ref")
JAX_IMPLS = ("triton", "xla")
DTYPES = ("float32", "bfloat16", "float16")
# The split path is a Triton launch choice: "xla" runs once.
IMPL_PATHS = (("triton", "rows"), ("triton", "split"), ("torch_ref", "rows"),
              ("torch_ref", "split"), ("xla", "rows"))


def grid(impl_paths=IMPL_PATHS, **axes):
    """Parametrises a test `(impl, path, <axes>...)` over every implementation and launch path
    x the product of the named axes (e.g. `dtype=DTYPES, shape=SHAPES, opt=[...]`). `path`
    goes through conftest's fixture of that name, which forces the launch path."""
    names = ["impl", "path", *axes]
    cases = [pytest.param(i, p, *values, id="-".join(str(v).replace(" ", "")
                                                   for v in (*values, i, p)))
             for (i, p), values in itertools.product(impl_paths, itertools.product(*axes.values()))]
    return pytest.mark.parametrize(",".join(names), cases, indirect=["path"])


def make_labels(seed, shape, vocab, ignore_index=-100, frac_ignored=0.3):
    """Random int32 labels in [0, vocab), a fraction of them `ignore_index`."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, vocab, size=shape)
    y[rng.random(shape) < frac_ignored] = ignore_index
    return jnp.asarray(y, jnp.int32)


def weights(seed, lead, names):
    """One random normal cotangent per token for each output name."""
    keys = jax.random.split(jax.random.key(seed), len(names))
    return {k: jax.random.normal(key, lead) for k, key in zip(names, keys)}


def _objective(outs, w):
    """sum_k sum(w_k * out_k), a scalar output with weight 1 (the unit-cotangent path)."""
    return sum((o * w[k]).sum() if o.ndim else o for k, o in outs.items())


def _torch(a):
    return to_torch(a) if isinstance(a, jax.Array) else a


class Op:
    """The adapter of one op. Subclasses set `name`, `outputs` (every output name the op can
    return), `input_keys` (the keyword arguments of `check` that build inputs rather than
    options) and implement `inputs`, `jax`, `torch` and `reference`."""

    name = ""
    outputs: tuple[str, ...] = ("loss",)
    input_keys: tuple[str, ...] = ()
    value_atol = 1e-5

    # ------------------------------------------------------------------ the four hooks
    def inputs(self, seed, shape, dtype, scale, opts, **kw) -> dict:
        """Random inputs by name, "x" (the logits) first."""
        raise NotImplementedError

    def jax(self, impl, x, inputs, opts) -> dict:
        """Outputs by name of the JAX API on logits x."""
        raise NotImplementedError

    def torch(self, x, inputs, opts) -> dict:
        """Outputs by name of torch_ref on tensor x (inputs and opts as tensors)."""
        raise NotImplementedError

    def reference(self, x, inputs, opts) -> dict:
        """Outputs by name of the plain-JAX formula at x's dtype (float64)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared machinery
    def run(self, impl, inputs, opts, w=None, grad=True):
        """(outputs by name, gradient w.r.t. x of the objective or None without `grad`)."""
        if impl == "torch_ref":
            x = to_torch(inputs["x"]).requires_grad_(grad)
            rest = {k: _torch(v) for k, v in inputs.items() if k != "x"}
            outs = self.torch(x, rest, {k: _torch(v) for k, v in opts.items()})
            if grad:
                _objective(outs, {k: to_torch(v) for k, v in w.items()}).backward()
            return {k: o.detach() for k, o in outs.items()}, x.grad
        if not grad:
            return jax.jit(lambda x: self.jax(impl, x, inputs, opts))(inputs["x"]), None

        def f(x):
            outs = self.jax(impl, x, inputs, opts)
            return _objective(outs, w), outs

        (_, outs), g = jax.jit(jax.value_and_grad(f, has_aux=True))(inputs["x"])
        return outs, g

    def expected(self, inputs, opts, w):
        """The float64 reference outputs and their jax.vjp gradient for the same objective."""
        with jax_ref.x64():
            x = jnp.asarray(to_numpy(inputs["x"]), jnp.float64)
            opts = tuple(sorted((k, float(v) if isinstance(v, jax.Array) else v)
                                for k, v in opts.items()))
            rest = {k: v for k, v in inputs.items() if k != "x"}
            return _reference_vjp(self, opts, x, rest, w)

    def check(self, impl, dtype, shape, *, seed=0, scale=2.0, inputs=None, forward=False,
              **kw):
        """Values and gradient of `impl` against the float64 reference; `forward` also checks
        the values outside differentiation. Returns (outputs, gradient) as numpy."""
        opts = {k: v for k, v in kw.items() if k not in self.input_keys}
        if inputs is None:
            inputs = self.inputs(seed, shape, dtype, scale, opts,
                                 **{k: v for k, v in kw.items() if k in self.input_keys})
        w = weights(seed + 3, inputs["x"].shape[:-1], self.outputs)
        outs, grad = self.run(impl, inputs, opts, w)
        routs, rgrad = self.expected(inputs, opts, w)
        assert set(outs) == set(routs), f"{self.name} {impl}: outputs {set(outs)}"
        what = f"{self.name} {impl}"
        for k, out in outs.items():
            assert str(out.dtype).split(".")[-1] == "float32", f"{what} {k} dtype {out.dtype}"
            assert_close(out, routs[k], rtol=VALUE_RTOL[dtype], atol=self.value_atol,
                         what=f"{what} {k}")
        if forward:
            plain, _ = self.run(impl, inputs, opts, grad=False)
            for k, out in plain.items():
                assert_close(out, routs[k], rtol=VALUE_RTOL[dtype], atol=self.value_atol,
                             what=f"{what} {k}, forward only")
        assert to_numpy(grad).shape == inputs["x"].shape
        assert str(grad.dtype).split(".")[-1] == dtype, f"grad dtype {grad.dtype} != {dtype}"
        assert_grad_close(grad, rgrad, dtype, what=f"{what} grad")
        return {k: to_numpy(o) for k, o in outs.items()}, to_numpy(grad)


# Without LLVM's optimisations: compiling is then ~40% faster, which is most of the reference's
# cost at test sizes.
@functools.partial(jax.jit, static_argnums=(0, 1),
                   compiler_options={"xla_backend_optimization_level": 0})
def _reference_vjp(op, opts, x, inputs, w):
    """Op.expected's computation, compiled once per op, options and shapes (the grid repeats
    each for every implementation and dtype: the reference always runs at float64)."""
    def f(x):
        return op.reference(x, inputs, dict(opts))

    return jax_ref.value_and_vjp(f, x, lambda outs: {k: w[k] if o.ndim else 1.0
                                                     for k, o in outs.items()})


def check_rejected(fn, args, kwargs, exc, match):
    """fn(*args, **kwargs) fails at trace time (under jax.eval_shape) with `exc` whose message
    contains `match` literally."""
    with pytest.raises(exc, match=re.escape(match)):
        jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)


def spec(shape, dtype=jnp.float32):
    """An abstract argument for check_rejected."""
    return jax.ShapeDtypeStruct(shape, dtype)
