"""The op skeleton: one custom_vjp for every row-wise loss, and the shared call scaffolding.

An op (cross_entropy, kd_loss / distill_loss, logsumexp / entropy / token_logprobs) supplies a
`RowOp`: a frozen dataclass holding its options (so it is hashable, the custom_vjp's static
argument) with a few hooks: its row functions (`call`, through `_sharding.run`, which is where
partitioning lives), what it feeds them besides the logits (`row_inputs`: e.g. the per-row
weights of a "mean"), how it reduces their rows to its outputs (`primal`), which statistics
the backward needs (`saved`), the per-row cotangent (`row_cotangent`) and how a gradient is
recomputed from them (`recompute`). Everything else is written once here:

- the gradient-in-forward policy: where `fuses_grad`, the forward also writes the gradient
  for a unit cotangent (one read of the logits for forward + backward); the backward then
  returns it as is when every row's cotangent is exactly 1 and rescales it per row otherwise,
  except for float16 logits, whose gradient is recomputed with the cotangent folded in before
  rounding (a rescale would flush entries below float16's smallest subnormal before a loss
  scale could save them), for which the forward keeps the logits (`keeps_logits`);
- typed residuals (`Residuals`);
- the guard that turns a second-order derivative into a clear NotImplementedError;
- flattening leading axes, the empty batch and the dispatch by implementation name
  (`apply`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _triton_jax

SECOND_ORDER_MESSAGE = (
    "jax_fusedloss: second-order derivatives (grad of grad, hessian, jvp of a gradient) are not "
    "supported: the gradient comes from fused kernels that are first-order only. Differentiate "
    "the naive formula (e.g. optax.softmax_cross_entropy_with_integer_labels) for those.")


@jax.custom_jvp
def first_order_only(*arrays):
    """Identity on the backward's inputs; differentiating it (a second-order derivative of an
    op) raises `_common.UnsupportedError` (a NotImplementedError, which the dispatcher does
    not fall through) with SECOND_ORDER_MESSAGE instead of an error about
    custom_partitioning or custom_jvp the user never wrote."""
    return arrays


@first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise _common.UnsupportedError(SECOND_ORDER_MESSAGE)


class Residuals(NamedTuple):
    """What an op's forward keeps for its backward."""
    grad: jax.Array | None  # the gradient for a unit cotangent, written by the forward
    x: jax.Array | None  # the `[N, V]` logits, when the backward may recompute the gradient
    inputs: tuple  # the other row inputs the recompute reads (labels, teacher entries, ...)
    stats: tuple  # per-row statistics of the forward (lse, gradient coefficients, ...)


def keeps_logits(dtype) -> bool:
    """Whether a forward that wrote the unit-cotangent gradient also keeps the logits, to
    recompute the gradient for other cotangents: float16 only. float32 and bfloat16 gradients
    are rescaled instead (one more rounding, at most about 1 ulp; bfloat16 has float32's
    exponent range, so a loss scale flushes nothing), because keeping the logits alive until
    the backward would cost the N*V memory the fused path exists to save."""
    return jnp.dtype(dtype) == jnp.float16


@dataclasses.dataclass(frozen=True)
class RowOp:
    """Hooks of one op. `opts` is the op's options, a hashable NamedTuple with an
    `implementation` field ("triton" or "xla" once `apply` has dispatched, "" before) and a
    `vocab_axis` field; subclasses add only hooks (and at most a few hashable fields)."""
    opts: Any

    num_aux = 0  # how many arrays follow the logits in the op's call (labels, ...)
    auto_family = "loss"  # its row in kernels.launch.AUTO_XLA_MAX_ROWS

    def _replace(self, implementation: str) -> "RowOp":
        """This op with `opts.implementation` set (what `_common.dispatch_op` calls)."""
        return dataclasses.replace(self, opts=self.opts._replace(implementation=implementation))

    @property
    def fuses_grad(self) -> bool:
        """Whether the forward writes the unit-cotangent gradient (role "fwd_grad")."""
        return False

    def call(self, role: str, *arrays) -> tuple:
        """Runs the row function `role` ("fwd", "fwd_grad", "bwd", "scale") on `[N, ...]`
        arrays; returns its outputs."""
        raise NotImplementedError

    def row_inputs(self, *aux) -> tuple:
        """The arrays the forward row function takes after the logits."""
        return aux

    def primal(self, outs: tuple, *aux) -> Any:
        """The op's outputs from the forward row function's outputs (the gradient excluded)."""
        raise NotImplementedError

    def saved(self, outs: tuple) -> tuple:
        """The per-row statistics the recompute needs, from the forward's outputs."""
        raise NotImplementedError

    def row_cotangent(self, cts, n: int) -> jax.Array:
        """float32 `[N]` (or `[N, k]`) cotangent per row from the outputs' cotangents."""
        raise NotImplementedError

    def recompute(self, res: Residuals, cot: jax.Array, cts) -> jax.Array:
        """The gradient for the row cotangents `cot` from the logits and saved statistics."""
        raise NotImplementedError


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(op: RowOp, x, *aux):
    return op.primal(op.call("fwd", x, *op.row_inputs(*aux)), *aux)


def _apply_fwd(op: RowOp, x, *aux):
    x, aux = first_order_only(x, aux)  # the forward is differentiated only for a second order
    inputs = op.row_inputs(*aux)
    if op.fuses_grad:
        *outs, grad = op.call("fwd_grad", x, *inputs)
        if keeps_logits(x.dtype):
            return op.primal(outs, *aux), Residuals(grad, x, inputs, op.saved(outs))
        return op.primal(outs, *aux), Residuals(grad, None, (), ())
    outs = op.call("fwd", x, *inputs)
    return op.primal(outs, *aux), Residuals(None, x, inputs, op.saved(outs))


def _apply_bwd(op: RowOp, res: Residuals, cts):
    """The gradient policy: recompute without a saved gradient; with one, return it for unit
    cotangents, else rescale it per row or, where the logits were kept (float16), recompute
    (one `jax.lax.cond`, so only one branch runs; under `vmap` with batched cotangents both
    run)."""
    res, cts = first_order_only(res, cts)
    n = (res.grad if res.grad is not None else res.x).shape[0]
    cot = op.row_cotangent(cts, n)
    if res.grad is None:
        grad = op.recompute(res, cot, cts)
    elif res.x is None:
        grad = op.call("scale", res.grad, cot)[0]
    else:
        grad = jax.lax.cond(jnp.all(cot == 1.0), lambda: res.grad,
                            lambda: op.recompute(res, cot, cts))
    return (grad,) + (None,) * op.num_aux


_apply.defvjp(_apply_fwd, _apply_bwd)


def apply(op: RowOp, implementation: str | None, x: jax.Array, *aux):
    """Runs `op` on `[N, V]` logits and its `[N, ...]` aux arrays with the requested
    implementation, or the best available one when None: on a CUDA GPU Triton, except for
    few rows where XLA is measured faster by the host wall clock
    (`kernels.launch.auto_prefers_xla`); a missing optional dependency, or what an
    implementation cannot do, falls through to the next."""
    if implementation is None and _triton_jax.on_cuda_gpu():
        from jax_fusedloss.kernels import launch

        if launch.auto_prefers_xla(x.shape[0], x.shape[-1], op.auto_family,
                                   _triton_jax.call_kind()):
            implementation = "xla"  # measured faster for few rows (launch.AUTO_XLA_MAX_ROWS)
    return _common.dispatch_op(lambda *args: _apply(args[-1], *args[:-1]), implementation, x,
                               *aux, opts=op)


def empty_loss(lead: tuple[int, ...], reduction: str) -> jax.Array:
    """The loss of an empty batch: zeros `[...]` for "none", else a float32 0."""
    return jnp.zeros(lead, jnp.float32) if reduction == "none" else jnp.float32(0.0)


def unflatten(rows: jax.Array | None, lead: tuple[int, ...]) -> jax.Array | None:
    """float32 `[N]` per-row results -> `[...]` (None stays None)."""
    return None if rows is None else rows.reshape(lead)
