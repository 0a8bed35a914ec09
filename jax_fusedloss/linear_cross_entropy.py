"""Fused linear cross-entropy: hidden states and output projection to a loss, token chunk by
token chunk, so that no `[N, V]` logits (or their gradient) outlive one chunk.

Design (token chunks whose logits live briefly): for each chunk of `C` tokens,
`logits = h_chunk @ W (+ b)` by XLA's matmul (cuBLAS on a GPU), then the cross-entropy row
functions of `cross_entropy.py` give the chunk's per-token loss and the gradient w.r.t. its
logits (the Triton forward writes that gradient in the same pass, in place over the chunk's
logits: `CEOptions.in_place`, so a chunk costs one `[C, V]` temporary), then `dH_chunk = g @ W^T`
and `dW += h_chunk^T @ g` (float32 accumulator), `db += sum_rows(g)`. Under differentiation
the forward of the `custom_vjp` computes the loss *and* dH, dW, db in one loop over the
chunks (three matmuls per chunk in all); the backward only scales them by the scalar cotangent
of a "mean" or "sum" loss. A per-token cotangent ("none") or a differentiable lse
(`return_lse`) cannot be folded into dW afterwards, so there the forward keeps only O(N)
statistics and the backward recomputes each chunk's logits (four matmuls per chunk).

Across devices (`_sharding.call_dims`, one custom_partitioning rule over named dimensions
"n d, d v, v, n, n -> ..."): with the tokens of `hidden` sharded each device runs the chunk
loop on its own tokens and dW/db are summed across the token axes (one weight-sized
all-reduce, as data parallelism needs anyway); with the weight sharded over the vocabulary each
chunk runs the cross-entropy's vocabulary-parallel row functions (O(C) all-reduces of softmax
statistics per chunk), dW/db stay local to their slice and dH is summed across the vocabulary
axes (one `[N, D]` all-reduce). Inside shard_map the same loop runs on the local shards, with
`vocab_axis` naming the vocabulary axes; the backward sums each gradient over the manual axes
its input does not vary over. "mean" divides by the count of the whole batch under jit (of the
local shard inside shard_map, as `cross_entropy`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _sharding, _triton_jax, _validate
from jax_fusedloss.kernels import linear_ce as _chunking
from jax_fusedloss.cross_entropy import CEOptions, _denominator, _row_cotangent, _row_fns

ACCUMULATIONS = ("float32", "input")
# Each chunk's logits gradient overwrites the chunk's logits (a temporary of the loop): the
# Triton cross-entropy launches alias them (CEOptions.in_place). False only to compare.
_IN_PLACE = True


class LCEOptions(NamedTuple):
    ce: CEOptions
    layout: str
    chunk: int
    accumulation: str
    implementation: str


def default_chunk_size(n: int, vocab: int, dim: int, dtype,
                       accumulation: str = "float32") -> int:
    """Tokens per chunk when `chunk_size=None`: `jax_fusedloss.kernels.linear_ce.chunk_rows`,
    the largest power of two C (at most N) whose `[C, V]` logits fit `CHUNK_BUDGET_BYTES` (128
    MiB: 512 rows at V=128256 in bf16; their gradient overwrites them in place), but for 16-bit
    logits at least 256 rows per byte of dW's accumulator (512 with accumulation="input", 1024
    with "float32"), below which the per-chunk dW update turns memory-bound. `dim` does not
    change it: the chunk's `[C, D]` slices of the hidden states are far smaller than its
    logits."""
    del dim
    itemsize = jnp.dtype(dtype).itemsize
    dw_itemsize = 4 if accumulation == "float32" else itemsize
    return _chunking.chunk_rows(n, vocab, itemsize, dw_itemsize)


# ----------------------------------------------------------------------------- chunk algebra
def _logits(h, w, b, layout: str):
    """h [C, D] times W ([D, V] or [V, D], contracted in place: no transposed copy) + b."""
    contract = ((1,), (0,)) if layout == "dv" else ((1,), (1,))
    z = jax.lax.dot_general(h, w, (contract, ((), ())))
    return z if b is None else z + b.astype(z.dtype)


def _grads(h, w, g, layout: str, dw_dtype):
    """(dH [C, D] in h's dtype, dW contribution in W's layout as dw_dtype) of logits grad g.

    `dw + _grads(...)[1]` in one dtype is what XLA's GPU GEMM rewriter folds into a single
    cuBLAS GEMM with beta=1 (fp32 arithmetic, one rounding, no dW-sized temporary)."""
    contract = ((1,), (1,)) if layout == "dv" else ((1,), (0,))
    dh = jax.lax.dot_general(g, w, (contract, ((), ())),
                             preferred_element_type=jnp.float32).astype(h.dtype)
    if layout == "dv":  # h^T g: [D, V]
        dw = jax.lax.dot_general(h, g, (((0,), (0,)), ((), ())), preferred_element_type=dw_dtype)
    else:  # g^T h: [V, D]
        dw = jax.lax.dot_general(g, h, (((0,), (0,)), ((), ())), preferred_element_type=dw_dtype)
    return dh, dw


def _chunks(n: int, chunk: int, body, init):
    """Runs `carry = body(start, size, carry)` over the chunks of n rows: a fori_loop over the
    full chunks (dynamic slices of the inputs, no copies) and one static call for the tail."""
    full = n // chunk
    carry = init
    if full:
        carry = jax.lax.fori_loop(0, full, lambda i, c: body(i * chunk, chunk, c), carry)
    if n % chunk:
        carry = body(full * chunk, n % chunk, carry)
    return carry


def _rows(a, start, size):
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)


def _put(buf, start, val):
    return jax.lax.dynamic_update_slice_in_dim(buf, val.astype(buf.dtype), start, axis=0)


def _chunk_fns(opts: LCEOptions, impl: str):
    return _row_fns(opts.ce._replace(implementation=impl, in_place=_IN_PLACE), impl)


def _setup(h, y, opts: LCEOptions):
    denom = _denominator(y, opts.ce)
    return denom, jnp.broadcast_to(1.0 / denom, y.shape).astype(jnp.float32)


def _zeros(shape, dtype, vma):
    return _sharding._pcast_to(jnp.zeros(shape, dtype), frozenset(vma))


# ----------------------------------------------------------------------------- the chunk loop
def _loop(role: str, ce, opts: LCEOptions, h, w, b, y, *rows, vocab_axes=()):
    """One pass over the token chunks of (this device's) hidden states.

    role "fwd" (rows: row_scale): per-row (loss, lse, coef); "fwd_grad": the same and the
    unit-cotangent (dH, dW, db); "bwd" (rows: lse, coef, cotangents folded in): (dH, dW, db).
    `ce(role, z, y, *rows)` is the cross-entropy row function for one chunk's logits `z` (its
    vocabulary-parallel form when the weight is a vocabulary slice). dW/db are partial sums of
    this device's tokens, dH of its vocabulary slice: the callers sum them across devices."""
    n, f32 = h.shape[0], jnp.float32
    vma = frozenset().union(*(_sharding.varying_axes(a) for a in (h, w, b, y) + rows
                              if a is not None))
    row_vma = vma - frozenset(vocab_axes)
    stats, grads = role != "bwd", role != "fwd"
    init = ()
    if stats:
        init += (_zeros((n,), f32, row_vma), _zeros((n,), f32, row_vma),
                 _zeros((n, 5), f32, row_vma))  # coef: kernels.cross_entropy.COEF_FIELDS
    if grads:
        dw_dtype = f32 if opts.accumulation == "float32" else w.dtype
        init += (_zeros(h.shape, h.dtype, vma), _zeros(w.shape, dw_dtype, vma),
                 None if b is None else _zeros(b.shape, f32, vma))

    def body(start, size, carry):
        hc = _rows(h, start, size)
        z = _logits(hc, w, b, opts.layout)
        outs = ce(role, z, _rows(y, start, size), *(_rows(r, start, size) for r in rows))
        new = ()
        if stats:
            new += tuple(_put(buf, start, o) for buf, o in zip(carry[:3], outs[:3]))
        if grads:
            dh, dw, db = carry[-3:]
            g = outs[-1]
            dh_c, dw_c = _grads(hc, w, g, opts.layout, dw.dtype)
            if db is not None:
                db = db + jnp.sum(g.astype(f32), axis=0)
            new += (_put(dh, start, dh_c), dw + dw_c, db)
        return new

    return _chunks(n, min(opts.chunk, n), body, init)


def _partition_body(role: str, opts: LCEOptions, has_bias: bool, mesh, rows, vocab):
    """What each device runs under the partitioner: the chunk loop on its tokens (and weight
    slice), then dW/db summed over the token axes and dH over the vocabulary axes."""
    impl = opts.implementation
    if impl == "triton" and mesh is not None and mesh.size > 1 and not _triton_jax.on_cuda_gpu():
        impl = "xla"  # the interpreter's host callbacks cannot run in a partitioned program
    fns = _chunk_fns(opts, impl)

    def ce(role, z, *r):
        return fns[role].vocab_parallel(z, *r, axes=vocab) if vocab else fns[role].local(z, *r)

    def local(h, w, *rest):
        b, rest = (rest[0], rest[1:]) if has_bias else (None, rest)
        outs = _loop(role, ce, opts, h, w, b, *rest, vocab_axes=vocab)
        if role == "fwd":
            return outs
        dh, dw, db = outs[-3:]
        if vocab:
            dh = jax.lax.psum(dh.astype(jnp.float32), vocab).astype(dh.dtype)
        if rows:
            dw = jax.lax.psum(dw, rows)
            db = None if db is None else jax.lax.psum(db, rows)
        return outs[:-3] + (dh, dw) + (() if db is None else (db,))

    return local


def _run(role: str, opts: LCEOptions, h, w, b, y, *rows):
    """The chunk loop of `role` (see `_loop`) partitioned across devices: inside shard_map on
    the local shards (vocabulary-parallel over `vocab_axis`; gradients summed across devices by
    the backward), elsewhere through `_sharding.call_dims`."""
    vocab_axes = _sharding._axes(opts.ce.vocab_axis)
    args = (h, w) + (() if b is None else (b,)) + (y,) + rows
    if vocab_axes or _sharding.varying_axes(h) or _sharding.varying_axes(w):
        outs = _partition_body(role, opts, b is not None, None, (), vocab_axes)(*args)
    else:
        outs = _call_partitioned(role, opts, args, b is not None, len(rows))
    return tuple(outs) + ((None,) if role != "fwd" and b is None else ())


def _call_partitioned(role: str, opts: LCEOptions, args, has_bias: bool, n_rows: int):
    wd = "dv" if opts.layout == "dv" else "vd"
    bias = ("v",) if has_bias else ()
    in_dims = ("nd", wd) + bias + ("n",) * (1 + n_rows)
    if role == "bwd":
        in_dims = in_dims[:-1] + ("nc",)
    out_dims = ("n", "n", "nc") if role != "bwd" else ()
    if role != "fwd":
        out_dims += ("nd", wd) + bias
    body = functools.partial(_partition_body, role, opts, has_bias)
    return _sharding.call_dims(body, in_dims, out_dims, *args)


# ----------------------------------------------------------------------------- custom_vjp
def _recompute(opts: LCEOptions) -> bool:
    """Per-token cotangents (reduction "none") or a differentiable lse: recompute the logits
    in the backward instead of computing the gradients in the forward."""
    return opts.ce.reduction == "none" or opts.ce.return_lse


def _reduce(loss, denom, opts: LCEOptions):
    return loss if opts.ce.reduction == "none" else jnp.sum(loss) / denom


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _lce(h, w, b, y, opts: LCEOptions):
    denom, row_scale = _setup(h, y, opts)
    loss, lse, _ = _run("fwd", opts, h, w, b, y, row_scale)
    return _reduce(loss, denom, opts), lse


def _lce_fwd(h, w, b, y, opts: LCEOptions):
    denom, row_scale = _setup(h, y, opts)
    if _recompute(opts):
        loss, lse, coef = _run("fwd", opts, h, w, b, y, row_scale)
        return (_reduce(loss, denom, opts), lse), (h, w, b, y, lse, coef)
    loss, lse, _, dh, dw, db = _run("fwd_grad", opts, h, w, b, y, row_scale)
    dw = dw.astype(w.dtype)
    db = None if db is None else db.astype(b.dtype)
    return (_reduce(loss, denom, opts), lse), (dh, dw, db, h, w, b)


def _scale(g, cot):
    return None if g is None else (g.astype(jnp.float32) * cot).astype(g.dtype)


def _finish(grads, h, w, b):
    """Gradients in their inputs' dtypes; inside shard_map summed over the devices whose
    partial sums they are (`_sharding.sum_to_varying`; a no-op elsewhere)."""
    dh, dw, db = grads
    out = [_sharding.sum_to_varying(dh.astype(h.dtype), h),
           _sharding.sum_to_varying(dw.astype(w.dtype), w)]
    out.append(None if b is None else _sharding.sum_to_varying(db.astype(b.dtype), b))
    return tuple(out) + (None,)


def _lce_bwd(opts: LCEOptions, res, cts):
    g_loss, g_lse = cts
    if not _recompute(opts):
        dh, dw, db, h, w, b = res
        cot = g_loss.astype(jnp.float32)
        return _finish((_scale(dh, cot), _scale(dw, cot), _scale(db, cot)), h, w, b)
    h, w, b, y, lse, coef = res
    cot = _row_cotangent(g_loss, h.shape[0], opts.ce)
    coef = coef * cot[:, None]
    coef = coef.at[:, 0].add(g_lse.astype(jnp.float32))
    return _finish(_run("bwd", opts, h, w, b, y, lse, coef), h, w, b)


_lce.defvjp(_lce_fwd, _lce_bwd)


# ----------------------------------------------------------------------------- public API
def _check_inputs(hidden, weight, labels, bias, weight_layout):
    _common.check_logits(hidden, "hidden", "D")
    if not hasattr(weight, "shape") or not hasattr(weight, "dtype"):
        raise TypeError(f"weight must be an array, got {type(weight).__name__}")
    vocab = _validate.check_linear_weight(hidden.shape, weight.shape, weight_layout)
    _validate.check_same_dtype("weight", weight.dtype, "hidden", hidden.dtype)
    _common.check_int_array(labels, "labels", hidden.shape[:-1], "hidden.shape[:-1]")
    if bias is not None:
        _common.check_logits(bias, "bias")
        _validate.check_shape_equal("bias", bias.shape, "(V,)", (vocab,))
    return vocab


@_common.public
def linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    weight_layout: str = "dv",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    return_lse: bool = False,
    check_labels: bool = False,
    implementation: str | None = None,
    chunk_size: int | None = None,
    accumulation: str = "float32",
    vocab_axis: str | tuple[str, ...] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Cross-entropy of the logits `hidden @ weight (+ bias)` without keeping `[N, V]` logits.

    Equal to `cross_entropy(hidden @ W + bias, labels, ...)` (same options, same loss; see
    `cross_entropy` for the formula), computed `chunk_size` tokens at a time: each chunk's
    logits `[C, V]` exist only while that chunk is processed (with the Triton kernels their
    gradient overwrites them in place: one `[C, V]` temporary per chunk). Under
    differentiation the forward also computes the gradients w.r.t. `hidden`, `weight` and
    `bias` (three matmuls per chunk: logits, `g W^T`, `h^T g`) and the backward scales them by
    the cotangent; with `reduction="none"` or `return_lse=True` the backward recomputes each
    chunk's logits instead (one more matmul per chunk). dW and db accumulate in float32 (a
    `weight`-sized float32 buffer during the forward) and are returned in their inputs' dtypes.

    Args:
      hidden: `[..., D]` float32, bfloat16 or float16.
      weight: `[D, V]` (weight_layout="dv", Flax's `nnx.Linear(D, V).kernel`) or `[V, D]`
        ("vd", a tied embedding table), same dtype as `hidden`; never transposed in memory.
      labels: `[...]` integer class ids in `[0, V)`, or `ignore_index`.
      bias: optional `[V]` float bias added to the logits (in the logits' dtype).
      weight_layout: "dv" or "vd".
      ignore_index, reduction, label_smoothing, z_loss, logit_softcap, return_lse: as in
        `cross_entropy`; "mean" divides by the number of non-ignored tokens of the batch.
      check_labels: as in `cross_entropy`.
      implementation: None (Triton cross-entropy kernels on a CUDA GPU, XLA elsewhere),
        "triton" or "xla"; the matmuls are XLA's either way.
      chunk_size: tokens per chunk (>= 1), or None for `default_chunk_size`: the chunk's
        logits within `jax_fusedloss.kernels.linear_ce.CHUNK_BUDGET_BYTES` (128 MiB), but at
        least 512 rows ("input") or 1024 ("float32") for 16-bit logits. The knob between
        memory (C * V * itemsize bytes of temporary) and speed (each chunk reads and writes
        all of dW once: fewer, longer chunks are faster). A ragged last chunk is allowed.
      accumulation: "float32" (default) sums dW over the chunks in a float32 `[D, V]` buffer,
        rounded to weight's dtype once at the end; "input" sums it in weight's dtype (each
        chunk's product computed in float32 and rounded into the sum, as Liger does), which
        saves `D * V * (4 - itemsize)` bytes of peak memory for bf16/fp16 weights at the cost
        of one rounding per chunk. db always accumulates in float32. Same for float32.
      vocab_axis: inside `jax.shard_map` only: the mesh axis name (or names) over which the
        vocabulary of `weight` (and `bias`) is split, device i of those axes holding rows
        (for "vd"; columns for "dv") `[i * V_local, (i + 1) * V_local)`; `labels` are global
        ids. Each chunk's softmax statistics are merged with O(C) all-reduces, dH is summed
        over those axes and each device gets dW/db of its slice. Tokens sharded across other
        manual axes need nothing: the gradient of a weight that does not vary across them is
        summed across them. Under `jax.jit` with sharded inputs nothing is needed: tokens-
        sharded `hidden` and vocabulary-sharded `weight` partition themselves (see the
        README's "Fused linear cross-entropy" section).

    Returns:
      The float32 loss (scalar, or `[...]` for "none"); `(loss, lse)` with `return_lse`.

    Raises:
      TypeError / ValueError at trace time naming the argument: shapes that do not match,
      mismatched or non-float dtypes, an unknown layout, option or implementation, a chunk_size
      that is not a positive int.

    Example:
      >>> h = jax.random.normal(jax.random.key(0), (4, 8, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 1000)) * 0.1
      >>> y = jax.random.randint(jax.random.key(2), (4, 8), 0, 1000)
      >>> loss, (dh, dw) = jax.value_and_grad(linear_cross_entropy, (0, 1))(h, w, y)
    """
    vocab = _check_inputs(hidden, weight, labels, bias, weight_layout)
    _common.check_choice(reduction, "reduction", _common.REDUCTIONS)
    _common.check_implementation(implementation)
    smoothing, zl, logit_softcap = _common.check_ce_options(label_smoothing, z_loss, logit_softcap)
    ignore_index = _common.check_static_int(ignore_index, "ignore_index")
    vocab_axis = _common.check_vocab_axis(vocab_axis, weight, "weight")
    _common.check_choice(accumulation, "accumulation", ACCUMULATIONS)
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    if chunk_size is None:
        chunk = default_chunk_size(n, vocab, h.shape[1], hidden.dtype, accumulation)
    else:
        chunk = min(_common.check_static_int(chunk_size, "chunk_size", lo=1), max(n, 1))
    if n == 0:
        zero = 0.0 * (jnp.sum(hidden) + jnp.sum(weight))
        loss = jnp.zeros(lead, jnp.float32) + zero if reduction == "none" else zero
        return (loss, jnp.zeros(lead, jnp.float32)) if return_lse else loss
    ce_opts = CEOptions(ignore_index=ignore_index, reduction=reduction, smoothing=smoothing,
                        z_loss=zl, softcap=logit_softcap, return_lse=bool(return_lse),
                        implementation="", vocab_axis=vocab_axis)
    opts = LCEOptions(ce=ce_opts, layout=weight_layout, chunk=chunk, accumulation=accumulation,
                      implementation="")
    if vocab_axis is not None:
        vocab *= jax.lax.axis_size(vocab_axis)
    y = _common.labels_to_int32(labels.reshape(-1), ignore_index, vocab)
    _common.check_labels(labels, vocab, ignore_index, enabled=check_labels)
    loss, lse = _common.dispatch_op(_lce, implementation, h, weight, bias, y, opts=opts)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, lse.reshape(lead)) if return_lse else loss
