"""The LM-head skeleton: losses of the logits `hidden @ weight (+ bias)` that never keep them.

A hidden-state op (`linear_cross_entropy`, and the RL / distillation forms that grow on it)
supplies a `HeadOp`: its options and a few hooks naming the row functions of its logits op (the
same `fwd` / `fwd_grad` / `bwd` row functions, with their vocabulary-parallel forms, that the
logits op runs through `_op`). Everything else is written once here:

- **The walks.** The *token walk* (`_token_walk`) takes `C` tokens at a time: a chunk's logits
  `[C, V]` by XLA's matmul, the row function, then (roles with gradients) `dH_chunk = g W^T`
  and `dW += h_chunk^T g`, `db += sum_rows(g)`. The *vocabulary walk* (`_vocab_walk`, the
  backward of the "lean" mode) takes `B` vocabulary columns at a time over all tokens (or
  row chunks of them): the block's logits, its gradient from the forward's per-row statistics
  (the row function's backward on labels shifted by the block's first column, as a vocabulary
  slice of a sharded head), `dW[:, block] = h^T g` written once (a full-K matmul: float32
  accumulation inside the GEMM, one rounding), `dH += g W_block^T` in float32 (in column
  pieces under the fused GEMMs, `_dh_update`).
- **The memory modes** (`MODES`), one knob named for what the user gives up:
  "fast": the gradient for a unit cotangent is computed in the forward's token walk (three
  matmuls in all), dW summed over the chunks in a float32 `[D, V]` buffer; the backward only
  scales. Fastest; costs a weight-sized float32 buffer.
  "low_precision": the same walk with dW summed in the weight's dtype (each chunk's product
  computed in float32 and rounded into the sum, as Liger does). As fast, no float32 buffer;
  dW rounded once per chunk.
  "lean": the forward's token walk keeps per-row statistics and computes dH for a unit
  cotangent (`g W^T` per chunk, one full-K matmul: no float32 `[N, D]` sum); the backward
  scales dH in place and runs the vocabulary walk for dW (and db) alone, the cotangent folded
  in (four matmuls in all). No weight-sized temporary and dW exact to float32 accumulation;
  the price is the fourth matmul.
  float16 inputs and per-token cotangents (a loss per token, a differentiable lse) never take
  the gradient-in-forward walk of "fast" and "low_precision": a gradient for a unit cotangent
  rounded to float16 flushes entries a loss scale would have saved, and a per-token cotangent
  cannot be folded into dW afterwards. There the forward keeps statistics and the backward
  recomputes with the cotangent folded in: the token walk with dW summed in float32 ("fast")
  or the weight's dtype ("low_precision"), the vocabulary walk with dH summed in float32 as
  well ("lean"). "lean" keeps dH in the forward under a per-token cotangent that only scales
  each row's gradient (`HeadOp.row_cotangent_scales`: a loss per token without its lse): its
  backward scales dH's rows and folds the cotangent into the vocabulary walk's dW.
- **Partitioning** (`_sharding.call_dims`, one custom_partitioning rule over named dimensions
  "n d, d v, v, n... -> ..."): with the tokens of `hidden` sharded each device walks its own
  tokens and dW/db are summed across the token axes in the weight's dtype (a weight-sized
  all-reduce, as data parallelism needs anyway, at the bytes of XLA's own bf16 gradient); with
  the weight sharded over the vocabulary each device walks its slice (the token walk merges
  softmax statistics with O(C) all-reduces; the vocabulary walk needs none: the statistics are
  global), dW/db stay local and dH is summed across the vocabulary axes. Inside shard_map the
  same walks run on the local shards, `vocab_axis` naming the vocabulary axes.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_fusedloss import _common, _op, _sharding, _triton_jax, _validate
from jax_fusedloss._xla import reductions as _xla_red
from jax_fusedloss.cross_entropy import scale_row_fns
from jax_fusedloss.kernels import linear_ce as _plans

MODES = ("fast", "lean", "low_precision")
DEFAULT_MODE = "fast"


class HeadOptions(NamedTuple):
    layout: str  # "dv" ([D, V]) or "vd" ([V, D])
    mode: str
    chunk: int  # tokens per chunk of the token walk
    stats_chunk: int  # ... of a forward that keeps statistics only (role "fwd")
    block: int  # vocabulary columns per block of the vocabulary walk
    block_rows: int  # tokens per chunk inside a block (N: all at once)


@dataclasses.dataclass(frozen=True)
class HeadOp:
    """Hooks of one hidden-state op. `opts` is the logits op's options (a NamedTuple with
    `implementation` and `vocab_axis` fields), `head` the walk's."""
    opts: Any
    head: HeadOptions

    def row_fns(self, impl: str) -> dict[str, _sharding.RowFns]:
        """The logits op's row functions of implementation `impl` (fwd, fwd_grad, bwd)."""
        raise NotImplementedError

    def row_inputs(self, *aux) -> tuple:
        """The `[N, ...]` arrays the forward row function takes after the logits."""
        raise NotImplementedError

    def stat_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Trailing shapes of the forward row function's per-row float32 outputs."""
        raise NotImplementedError

    def primal(self, stats: tuple, *aux) -> Any:
        raise NotImplementedError

    def per_row_cotangent(self) -> bool:
        """Whether the outputs' cotangents differ per row (no gradient in the forward)."""
        raise NotImplementedError

    def row_cotangent_scales(self) -> bool:
        """Whether a per-row cotangent only scales each row's unit-cotangent gradient (one
        differentiable per-row output, e.g. a loss per token): then "lean" still computes dH
        in the forward and its backward scales the rows. False where two outputs' cotangents
        mix (a loss and its lse, log-probs and entropy)."""
        return False

    def dh_cotangent(self, aux: tuple, cts) -> jax.Array:
        """The factor (a scalar or one per row) by which the backward scales the forward's
        dH: the first output's cotangent."""
        del aux
        return cts[0].astype(jnp.float32)

    def bwd_rows(self, aux: tuple, stats: tuple, cts) -> tuple:
        """The `[N, ...]` arrays of the backward row function, cotangents folded in."""
        raise NotImplementedError

    def shift(self, rows: tuple, offset) -> tuple:
        """The backward's rows for the vocabulary block starting at column `offset`."""
        raise NotImplementedError

    def shift_block(self, rows: tuple, offset, size: int) -> tuple:
        """The backward's rows for the `size` vocabulary columns starting at `offset` (the
        vocabulary walk calls this; default `shift`). An op whose backward row function
        treats a label outside the block as an error (token log-probs) needs the width."""
        return self.shift(rows, offset)

    def gemm_stats(self) -> tuple[float, bool] | None:
        """(temperature, entropy) where the statistics-only forward may run the fused GEMM
        (`kernels.head_gemm`: the logits' softmax partials in the GEMM's epilogue, no logits
        written), whose merged partials `gemm_finish` turns into the forward's statistics;
        None (the default): the matmul and row-function walk."""
        return None

    def gemm_finish(self, m, s, u, zy, rows: tuple, vocab: int) -> tuple:
        """The forward's statistics from a row's merged softmax partials over all `vocab`
        columns (max m, s, u as `_xla.reductions.merge_stats`), its label's logit zy and the
        forward's row inputs `rows` (`row_inputs`; the labels first)."""
        raise NotImplementedError

    def gemm_grad_supported(self) -> bool:
        """Whether the vocabulary walk's blocks may run `kernels.head_gemm.head_grad_kernel`
        (the block's logits and their gradient in one GEMM, the weight read in place) with
        `gemm_grad`'s coefficients; False (the default): the matmul and the backward row
        function."""
        return False

    def gemm_grad(self, rows: tuple) -> tuple:
        """From a block's backward rows (`shift_block`'s) head_grad_kernel's per-row (coef
        [N, GRAD_FIELDS], labels relative to the block, 1/T, whether any B is nonzero)."""
        raise NotImplementedError

    def _replace(self, implementation: str) -> "HeadOp":
        return dataclasses.replace(self, opts=self.opts._replace(implementation=implementation))


def check_head(hidden, weight, bias, weight_layout: str) -> int:
    """Trace-time checks of a hidden-state op's `hidden` `[..., D]`, `weight` (`[D, V]` or
    `[V, D]`, hidden's dtype) and optional `bias` `[V]`; returns V."""
    _common.check_logits(hidden, "hidden", "D")
    if not hasattr(weight, "shape") or not hasattr(weight, "dtype"):
        raise TypeError(f"weight must be an array, got {type(weight).__name__}")
    vocab = _validate.check_linear_weight(hidden.shape, weight.shape, weight_layout)
    _validate.check_same_dtype("weight", weight.dtype, "hidden", hidden.dtype)
    if bias is not None:
        _common.check_logits(bias, "bias")
        _validate.check_shape_equal("bias", bias.shape, "(V,)", (vocab,))
    return vocab


def fuses_grad(op: HeadOp, dtype) -> bool:
    """Whether the forward computes gradients for a unit cotangent (all three in "fast" and
    "low_precision", dH alone in "lean"; see the module doc)."""
    if jnp.dtype(dtype) == jnp.float16:
        return False
    if op.head.mode == "lean" and op.row_cotangent_scales():
        return True
    return not op.per_row_cotangent()


def default_chunk(n: int, vocab: int, dtype, mode: str) -> int:
    """Tokens per chunk of the token walk for `mode` (`kernels.linear_ce.chunk_rows`)."""
    return _plans.chunk_rows(n, vocab, jnp.dtype(dtype).itemsize, mode)


def head_options(n: int, vocab: int, dtype, layout: str, mode: str,
                 chunk_size: int | None, d: int | None = None) -> HeadOptions:
    """The walks' sizes for N tokens and this device's `vocab` columns: the token walk's chunk
    (`chunk_size`, validated by the caller, or `default_chunk`), the chunk of a forward that
    keeps statistics only (no dW per chunk, so nothing gains from long chunks: by default
    "low_precision"'s, 640 rows at V=151936 in bf16, a rollout-scoring call's memory), and the
    vocabulary walk's blocks of `chunk_size * V` logits (by default the 128 MiB budget:
    `kernels.linear_ce.budget_rows`)."""
    itemsize = jnp.dtype(dtype).itemsize
    if chunk_size is None:
        chunk = default_chunk(n, vocab, dtype, mode)
        stats_chunk = min(chunk, default_chunk(n, vocab, dtype, "low_precision"))
        block_chunk = _plans.budget_rows(vocab, itemsize)
    else:
        chunk = stats_chunk = block_chunk = min(chunk_size, max(n, 1))
    block, block_rows = _plans.vocab_block(n, vocab, block_chunk, _waves(mode, d))
    return HeadOptions(layout=layout, mode=mode, chunk=chunk, stats_chunk=stats_chunk,
                       block=block, block_rows=block_rows)


def _waves(mode: str, d: int | None) -> tuple[int, int, int, int] | None:
    """`kernels.linear_ce.vocab_block`'s `waves` for lean's blocks of hidden size `d` on a GPU
    with TMA (where kernels/head_gemm's persistent GEMMs run them), else None."""
    if mode != "lean" or d is None or not (WAVE_BLOCKS and _triton_jax.has_tma()):
        return None
    from jax_fusedloss.kernels import head_gemm as _gemm  # imports triton

    return (_triton_jax.num_sms(), d, _gemm.GPU_CONFIG["BM"], _gemm.GPU_CONFIG["BN"])


# ----------------------------------------------------------------------------- chunk algebra
def _vocab_dim(layout: str) -> int:
    return 1 if layout == "dv" else 0


def _logits(h, w, b, layout: str):
    """h [C, D] times W ([D, V] or [V, D], contracted in place: no transposed copy) + b."""
    contract = ((1,), (0,)) if layout == "dv" else ((1,), (1,))
    z = jax.lax.dot_general(h, w, (contract, ((), ())))
    return z if b is None else z + b.astype(z.dtype)


def _dh(g, w, layout: str, dtype=jnp.float32):
    """g [C, V] W^T as `dtype` (float32 arithmetic, rounded once to `dtype`)."""
    contract = ((1,), (1,)) if layout == "dv" else ((1,), (0,))
    return jax.lax.dot_general(g, w, (contract, ((), ())), preferred_element_type=dtype)


def _dw(h, g, layout: str, dtype):
    """This chunk's dW in W's layout as `dtype` (`acc + _dw(...)` in one dtype is what XLA's
    GEMM rewriter folds into one GEMM with beta=1: float32 arithmetic, one rounding)."""
    if layout == "dv":  # h^T g: [D, V]
        return jax.lax.dot_general(h, g, (((0,), (0,)), ((), ())), preferred_element_type=dtype)
    return jax.lax.dot_general(g, h, (((0,), (0,)), ((), ())), preferred_element_type=dtype)


def _chunks(n: int, chunk: int, body, init, static_first: bool = False):
    """Runs `carry = body(start, size, carry)` over the chunks of n: one static call for the
    ragged tail first, then a fori_loop over the full chunks (dynamic slices of the inputs, no
    copies). Tail first: after the loop, a tail's update of a loop-carried accumulator (dW)
    made XLA copy the whole accumulator (H100, N=8192 in chunks of 768: 1.1 GiB of
    temporaries instead of 0.2). `static_first`: the first call is a static one even without
    a tail (the first full chunk), for a carry that the first call creates (`init` holds None
    there)."""
    full = n // chunk
    carry = init
    first = 0
    if n % chunk:
        carry = body(full * chunk, n % chunk, carry)
    elif static_first and full:
        carry = body(0, chunk, carry)
        first = 1
    if full > first:
        carry = jax.lax.fori_loop(first, full, lambda i, c: body(i * chunk, chunk, c), carry)
    return carry


def _slice(a, start, size, axis=0):
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=axis)


def _put(buf, start, val, axis=0):
    return jax.lax.dynamic_update_slice_in_dim(buf, val.astype(buf.dtype), start, axis=axis)


def _zeros(shape, dtype, vma):
    return _sharding._pcast_to(jnp.zeros(shape, dtype), frozenset(vma))


def _vma(*arrays) -> frozenset:
    return frozenset().union(*(_sharding.varying_axes(a) for a in arrays if a is not None))


# ----------------------------------------------------------------------------- the walks
class _Role(NamedTuple):
    walk: str  # "token" or "vocab"
    rows: str  # the row function it runs ("fwd", "fwd_grad", "bwd")
    stats: bool  # returns the forward's per-row statistics
    dh: bool  # returns dH
    dw: bool  # returns dW (and db)


ROLES = {
    "fwd": _Role("token", "fwd", True, False, False),
    "fwd_grad": _Role("token", "fwd_grad", True, True, True),  # "fast", "low_precision"
    "fwd_dh": _Role("token", "fwd_grad", True, True, False),  # "lean"'s forward
    "bwd": _Role("token", "bwd", False, True, True),
    "bwd_lean": _Role("vocab", "bwd", False, True, True),  # "lean", recomputing everything
    "bwd_dw": _Role("vocab", "bwd", False, False, True),  # "lean" after "fwd_dh"
}


def _token_walk(role: str, op: HeadOp, ce, h, w, b, *rows, vocab_axes=()):
    """One pass over the token chunks of (this device's) hidden states: (stats..., dH, dW, db)
    as `ROLES[role]` asks (None where it does not).

    "fwd": the forward row function's per-row statistics; "fwd_grad": the same and the
    unit-cotangent (dH, dW, db); "fwd_dh": the statistics and dH; "bwd" (rows:
    `op.bwd_rows`): (dH, dW, db). `ce(role, z, *rows)` runs the row function on one chunk's
    logits (its vocabulary-parallel form when the weight is a vocabulary slice). dW/db are
    this device's tokens' sums, dH its slice's."""
    n, f32, head, spec = h.shape[0], jnp.float32, op.head, ROLES[role]
    vma = _vma(h, w, b, *rows)
    row_vma = vma - frozenset(vocab_axes)
    n_stats = len(op.stat_shapes()) if spec.stats else 0
    init = tuple(_zeros((n,) + s, f32, row_vma) for s in op.stat_shapes()) if spec.stats else ()
    dw_dtype = f32 if head.mode == "fast" else w.dtype
    init += (_zeros(h.shape, h.dtype, vma) if spec.dh else None,
             _zeros(w.shape, dw_dtype, vma) if spec.dw else None,
             _zeros(b.shape, f32, vma) if spec.dw and b is not None else None)

    def body(start, size, carry):
        hc = _slice(h, start, size)
        outs = ce(spec.rows, _logits(hc, w, b, head.layout),
                  *(_slice(r, start, size) for r in rows))
        new = tuple(_put(buf, start, o) for buf, o in zip(carry[:n_stats], outs[:n_stats]))
        dh, dw, db = carry[-3:]
        g = outs[-1]
        if dh is not None:
            # written in dH's dtype by the GEMM (the same one rounding as a float32 product
            # cast after it), no float32 chunk beside the logits: "low_precision"'s memory
            dh = _put(dh, start, _dh(g, w, head.layout, dh.dtype))
        if dw is not None:
            dw = dw + _dw(hc, g, head.layout, dw.dtype)
        if db is not None:
            db = db + jnp.sum(g.astype(f32), axis=0)
        return new + (dh, dw, db)

    outs = _chunks(n, min(head.stats_chunk if role == "fwd" else head.chunk, n), body, init)
    dw = outs[-2]  # dW leaves the walk in W's dtype ("fast": its float32 sum rounded once here)
    return outs[:-2] + (None if dw is None else dw.astype(w.dtype), outs[-1])


def _vocab_walk(op: HeadOp, bwd, h, w, b, *rows, vocab_axes=(), with_dh: bool = True,
                fused: bool = False, dw_gemm: bool = False):
    """The lean backward: (dH, dW, db) from the backward row function `bwd(z, *rows)` over
    blocks of `op.head.block` vocabulary columns (see the module doc); dH is None without
    `with_dh` (the forward computed it). dH accumulates in float32; each block of dW is one
    full-K matmul over the tokens (row chunks of `block_rows` tokens sum into a float32
    `[D, B]` block) written once in W's dtype. `fused`: each block's logits and gradient from
    `_gemm_grad` (the weight read in place) instead of the matmul and `bwd`. `dw_gemm`: a
    block over all tokens whose gradient TMA can address has its dW written into dW in place
    by `_gemm_dw` (no block buffer, no copy); when every block is, the first creates dW (no
    zeros written first: 0.6-0.8 ms of a lean call on an H100)."""
    n, f32, head = h.shape[0], jnp.float32, op.head
    vdim = _vocab_dim(head.layout)
    vocab = w.shape[vdim]
    vma = _vma(h, w, b, *rows)
    first = _sharding.slice_offset(vocab, vocab_axes) if vocab_axes else jnp.int32(0)
    chunk = min(head.block_rows, n)
    cols = min(head.block, vocab)
    fresh = dw_gemm and chunk >= n and all(
        _dw_gemm_ok(c, h.dtype) for c in (cols, vocab % cols) if c)
    d = h.shape[1]
    pieces = DH_PIECES if with_dh and fused and d % DH_PIECES == 0 else 1
    init = (tuple(_zeros((n, d // pieces), f32, vma) for _ in range(pieces))
            if with_dh else None,
            None if fresh else _zeros(w.shape, w.dtype, vma),
            None if b is None else _zeros(b.shape, f32, vma))

    def block(start, size, carry):
        dh, dw, db = carry
        wb = _slice(w, start, size, axis=vdim)
        bb = None if b is None else _slice(b, start, size)
        shifted = op.shift_block(rows, first + start, size)
        in_place = dw_gemm and chunk >= n and _dw_gemm_ok(size, h.dtype)

        def part(r0, rs, acc):
            dh, dwb, dbb = acc
            hc = _slice(h, r0, rs)
            block_rows = tuple(_slice(r, r0, rs) for r in shifted)
            if fused:
                g = _gemm_grad(op, hc, w, b, start, size, *block_rows)
            else:
                g = bwd(_logits(hc, wb, bb, head.layout), *block_rows)
            if dh is not None:
                dh = _dh_update(dh, r0, g, w if pieces > 1 else wb, start, size, head.layout)
            if dbb is not None:
                dbb = dbb + jnp.sum(g.astype(f32), axis=0)
            if dwb is None:  # the whole block in one GEMM: float32 inside, W's dtype out
                return dh, g if in_place else _dw(hc, g, head.layout, w.dtype), dbb
            return dh, dwb + _dw(hc, g, head.layout, f32), dbb

        dbb0 = None if b is None else _zeros((size,), f32, vma)
        if chunk >= n:  # all tokens at once: dW's block straight from one GEMM
            dh, dwb, dbb = part(0, n, (dh, None, dbb0))
        else:
            dwb0 = _zeros(wb.shape, f32, vma)
            dh, dwb, dbb = _chunks(n, chunk, part, (dh, dwb0, dbb0))
        if in_place:  # (dwb is the block's gradient g)
            dw = _gemm_dw(h, dwb, dw, start, head.layout, w, vma)
        else:
            dw = _put(dw, start, dwb, axis=vdim)
        db = None if db is None else _put(db, start, dbb)
        return dh, dw, db

    dh, dw, db = _chunks(vocab, cols, block, init, static_first=fresh)
    return (None if dh is None else jnp.concatenate(dh, axis=1)), dw, db


def _dh_update(dh: tuple, r0, g, w, start, size: int, layout: str) -> tuple:
    """`dH[r0:r0 + rows] += g W_block^T` on dH kept as `len(dh)` float32 column pieces, one
    GEMM per piece (`w`: the whole weight, whose block [start, start + size) XLA copies out for
    cuBLAS; or the block itself, in one piece). Each piece's copy of its weight slice is ordered
    after the previous piece's GEMM (an optimization barrier), so only one slice is alive: with
    the [D, V] RL head of issue 29, a 69 MB copy becomes 35 MB (benchmarks/NOTES.md)."""
    rs, width = g.shape[0], dh[0].shape[1]
    vdim = _vocab_dim(layout)
    out = []
    for k, piece in enumerate(dh):
        if len(dh) > 1:
            if out:
                out[-1], w = jax.lax.optimization_barrier((out[-1], w))
            at = (start, k * width) if vdim == 0 else (k * width, start)
            wk = jax.lax.dynamic_slice(w, at, (size, width) if vdim == 0 else (width, size))
        else:
            wk = w
        out.append(_put(piece, r0, _slice(piece, r0, rs) + _dh(g, wk, layout)))
    return tuple(out)


# The fused GEMMs of kernels/head_gemm where they apply (`_gemm_applies`): the statistics-only
# forward (softmax partials in the GEMM's epilogue) and lean's vocabulary blocks (their logits'
# gradient in the epilogue); False: the matmuls and the row functions (the benchmarks' A/B).
GEMM_EPILOGUE = True
# Under GEMM_EPILOGUE, lean's dW blocks written into dW by a GEMM of ours (`_gemm_dw`) rather
# than XLA's dot then a copy; False: the copy (the benchmarks' A/B).
DW_IN_PLACE = True
# Column pieces of the vocabulary walk's float32 dH under the fused GEMMs (`_dh_update`); 1:
# one piece (the benchmarks' A/B).
DH_PIECES = 2
# On a GPU with TMA, lean's blocks sized for whole waves of those GEMMs (`_waves`); False: the
# budget's columns (the benchmarks' A/B).
WAVE_BLOCKS = True


def _gemm_applies(op: HeadOp, impl: str, h, w, stats: bool = True) -> bool:
    """Whether the fused GEMMs of kernels/head_gemm can run this op's statistics (`stats`)
    or, with `stats=False`, its vocabulary walk's blocks (their gradient where
    op.gemm_grad_supported(), their dW always): Triton on a GPU with TMA (sm_90 on) or
    interpreted, 16-bit inputs whose rows TMA can address."""
    if not GEMM_EPILOGUE or impl != "triton" or (stats and op.gemm_stats() is None):
        return False
    if not (_triton_jax.has_tma() or (not _triton_jax.on_cuda_gpu()
                                      and _triton_jax.interpreter_enabled())):
        return False  # (an A100: the matmul walk)
    from jax_fusedloss.kernels import head_gemm as _gemm  # imports triton

    vocab = w.shape[_vocab_dim(op.head.layout)]
    return _gemm.tma_ok(h.shape[1], vocab, op.head.layout, jnp.dtype(h.dtype).itemsize)


def _dw_gemm_ok(cols: int, dtype) -> bool:
    from jax_fusedloss.kernels import head_gemm as _gemm  # imports triton

    return _gemm.dw_ok(cols, jnp.dtype(dtype).itemsize)


def _gemm_launch(kernel, tiles, *, inputs, scalars, out_shapes, aliases=None, **constexprs):
    """Launches one of kernels/head_gemm's persistent GEMMs: `tiles(cfg)` output tiles over
    at most one program per SM (a few in the interpreter), the config's tiles, warps and
    stages, Triton's global scratch (its TMA descriptors), float32 dots and hand rounding in
    the interpreter, a flattened and warp-specialised tile loop on the GPU; under vmap, one
    batch element at a time."""
    from jax_fusedloss.kernels import head_gemm as _gemm  # imports triton

    gpu = _triton_jax.on_cuda_gpu()
    cfg = _gemm.config(gpu)
    grid = max(1, min(_triton_jax.num_sms() if gpu else _gemm.CPU_PROGRAMS, tiles(cfg)))

    def launch(*arrays):
        return _triton_jax.launch(
            kernel, grid=(grid,), inputs=list(arrays), scalars=scalars, out_shapes=out_shapes,
            input_output_aliases=aliases, partial_alias=bool(aliases),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            scratch=_gemm.SCRATCH_BYTES,
            constexprs=dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                            PROGRAMS=grid, F32_DOT=not gpu, FLATTEN=gpu, WARP_SPECIALIZE=gpu,
                            **constexprs))

    # vmapped (inside shard_map, where no custom_partitioning maps the batch first): one
    # element at a time, as jax-triton has no batching rule
    return _sharding._map_batched(launch)(*inputs)


def _bias_arg(b, dtype):
    """The bias as the GEMMs take it (in the inputs' dtype; a dummy without one)."""
    return jnp.zeros((1,), dtype) if b is None else b.astype(dtype)


def _gemm_grad(op: HeadOp, hc, w, b, start, size: int, *rows):
    """The gradient of the logits of vocabulary columns [start, start + size) for the tokens
    `hc` from the block's backward rows, through head_gemm.head_grad_kernel."""
    from jax_fusedloss.kernels import head_gemm as _gemm  # imports triton

    coef, labels, inv_temp, log_term = op.gemm_grad(rows)
    (n, d), layout = hc.shape, op.head.layout
    (g,) = _gemm_launch(
        _gemm.head_grad_kernel, lambda cfg: _gemm.tiles(n, size, cfg),
        inputs=[hc, w, _bias_arg(b, hc.dtype), labels.astype(jnp.int32),
                coef.astype(jnp.float32), jnp.asarray(start, jnp.int32).reshape(1)],
        scalars=[n, size, d, w.shape[_vocab_dim(layout)], float(inv_temp)],
        out_shapes=[jax.ShapeDtypeStruct((n, size), hc.dtype)],
        DV=layout == "dv", HAS_BIAS=b is not None, LOG_TERM=bool(log_term),
        TMA_STORE=_gemm.grad_tma_store(size, jnp.dtype(hc.dtype).itemsize))
    return g


def _gemm_dw(h, g, dw, start, layout: str, w, vma: frozenset):
    """`dW[block] = h^T g` for the vocabulary block of columns [start, start + g.shape[1])
    over all tokens `h`, written into `dw` in place through head_gemm.head_dw_kernel; with
    `dw` None into a new buffer shaped as the weight `w`, whose other columns are left
    unwritten (for the walk's other blocks to fill). `vma`: the result's varying axes inside
    shard_map (a loop carry's type; kernel outputs carry none)."""
    from jax_fusedloss.kernels import head_gemm as _gemm  # imports triton

    (n, d), size = h.shape, g.shape[1]
    (out,) = _gemm_launch(
        _gemm.head_dw_kernel, lambda cfg: _gemm.tiles(size, d, cfg),
        inputs=[g.astype(h.dtype), h, jnp.asarray(start, jnp.int32).reshape(1),
                jnp.zeros((1,), w.dtype) if dw is None else dw],
        scalars=[n, size, d, w.shape[_vocab_dim(layout)]],
        out_shapes=[jax.ShapeDtypeStruct(w.shape, w.dtype)],
        aliases=None if dw is None else {3: 0}, DV=layout == "dv")
    return _sharding._pcast_to(out, vma)


def _gemm_walk(op: HeadOp, h, w, b, *rows, vocab_axes=()):
    """The forward's statistics from kernels/head_gemm's fused GEMM over token chunks of at
    most `head_gemm.chunk_rows` (its partials' budget), merged per row, then across the
    vocabulary axes (a slice of a sharded head), then `op.gemm_finish`."""
    from jax_fusedloss.kernels import head_gemm as _gemm  # imports triton

    temperature, entropy = op.gemm_stats()
    cfg = _gemm.config(_triton_jax.on_cuda_gpu())
    (n, d), layout = h.shape, op.head.layout
    vocab = w.shape[_vocab_dim(layout)]
    tiles = _gemm.part_tiles(vocab, cfg)
    y = rows[0]
    local_y = y - _sharding.slice_offset(vocab, vocab_axes) if vocab_axes else y
    bias = _bias_arg(b, h.dtype)

    def partials(hc, yc):
        count = hc.shape[0]
        (part,) = _gemm_launch(
            _gemm.head_stats_kernel, lambda cfg: _gemm.tiles(count, vocab, cfg),
            inputs=[hc, w, bias, yc], scalars=[count, vocab, d, float(1.0 / temperature)],
            out_shapes=[jax.ShapeDtypeStruct((count, tiles, _gemm.FIELDS), jnp.float32)],
            DV=layout == "dv", HAS_BIAS=b is not None, ENTROPY=entropy)
        m, s, u = _xla_red.merge_stats(part[..., 0], part[..., 1], part[..., 2], axis=1)
        return m, s, u, jnp.sum(part[..., 3], axis=1)

    vma = _vma(h, w, b, *rows) - frozenset(vocab_axes)

    def body(start, size, carry):
        got = partials(_slice(h, start, size), _slice(local_y, start, size))
        return tuple(_put(buf, start, g) for buf, g in zip(carry, got))

    init = tuple(_zeros((n,), jnp.float32, vma) for _ in range(4))
    m, s, u, zy = _chunks(n, _gemm.chunk_rows(n, vocab, cfg), body, init)
    if vocab_axes:
        m, s, u, zy = _sharding.merge_across(vocab_axes, m, s, u if entropy else None,
                                             sums=(zy,))
        vocab = _sharding.global_vocab(vocab, vocab_axes)
    return op.gemm_finish(m, s, u if entropy else None, zy, rows, vocab)


# ----------------------------------------------------------------------------- partitioning
def _partition_body(role: str, op: HeadOp, has_bias: bool, mesh, rows, vocab):
    """What each device runs under the partitioner: the walk on its tokens (and weight slice),
    then dW/db summed over the token axes (in W's and b's dtype) and dH over the vocabulary
    axes."""
    impl = op.opts.implementation
    if impl == "triton" and mesh is not None and mesh.size > 1 and not _triton_jax.on_cuda_gpu():
        impl = "xla"  # the interpreter's host callbacks cannot run in a partitioned program
    fns, spec = op.row_fns(impl), ROLES[role]

    def ce(role, z, *r):
        return fns[role].vocab_parallel(z, *r, axes=vocab) if vocab else fns[role].local(z, *r)

    def local(h, w, *rest):
        b, rest = (rest[0], rest[1:]) if has_bias else (None, rest)
        if role == "fwd" and _gemm_applies(op, impl, h, w):
            return _gemm_walk(op, h, w, b, *rest, vocab_axes=vocab)
        if spec.walk == "vocab":
            gemm = _gemm_applies(op, impl, h, w, stats=False)
            outs = _vocab_walk(op, lambda z, *r: fns["bwd"].local(z, *r)[0], h, w, b, *rest,
                               vocab_axes=vocab, with_dh=spec.dh,
                               fused=gemm and op.gemm_grad_supported(),
                               dw_gemm=gemm and DW_IN_PLACE)
        else:
            outs = _token_walk(role, op, ce, h, w, b, *rest, vocab_axes=vocab)
        *stats, dh, dw, db = outs
        if dh is not None and vocab:
            dh = jax.lax.psum(dh.astype(jnp.float32), vocab).astype(dh.dtype)
        if dw is not None and rows:  # in W's dtype: the all-reduce moves XLA's own bytes
            dw = jax.lax.psum(dw, rows)
            db = None if db is None else jax.lax.psum(db, rows)
        return tuple(stats) + tuple(x for x in (dh, dw, db) if x is not None)

    return local


def _letters(ndim: int, pool: list) -> str:
    return "n" + "".join(pool.pop(0) for _ in range(ndim - 1))


def _run(role: str, op: HeadOp, h, w, b, *rows):
    """The walk of `role` (`ROLES`) partitioned across devices: inside shard_map on the local
    shards (vocabulary-parallel over `vocab_axis`; gradients summed across devices by the
    backward), elsewhere through `_sharding.call_dims`. Returns the statistics ("fwd"), else
    the statistics the role has and (dH, dW, db), None where the role has none."""
    spec = ROLES[role]
    vocab_axes = _sharding._axes(op.opts.vocab_axis)
    has_bias = b is not None
    args = (h, w) + ((b,) if has_bias else ()) + rows
    if vocab_axes or _sharding.varying_axes(h) or _sharding.varying_axes(w):
        outs = _partition_body(role, op, has_bias, None, (), vocab_axes)(*args)
    else:
        wd = "dv" if op.head.layout == "dv" else "vd"
        pool = list("cefgijklm")
        in_dims = ("nd", wd) + (("v",) if has_bias else ()) + tuple(
            _letters(r.ndim, pool) for r in rows)
        out_dims = tuple(_letters(1 + len(s), pool) for s in op.stat_shapes()) \
            if spec.stats else ()
        out_dims += (("nd",) if spec.dh else ()) + ((wd,) if spec.dw else ()) \
            + (("v",) if spec.dw and has_bias else ())
        body = functools.partial(_partition_body, role, op, has_bias)
        outs = _sharding.call_dims(body, in_dims, out_dims, *args)
    outs = list(outs)
    n_stats = len(op.stat_shapes()) if spec.stats else 0
    if role == "fwd":
        return tuple(outs)
    stats, rest = outs[:n_stats], iter(outs[n_stats:])
    dh = next(rest) if spec.dh else None
    dw = next(rest) if spec.dw else None
    db = next(rest) if spec.dw and has_bias else None
    return tuple(stats) + (dh, dw, db)


# ----------------------------------------------------------------------------- custom_vjp
def _scale(g, cot, impl: str):
    """A saved unit-cotangent gradient times the cotangent (a scalar, or one per row of g), in
    g's dtype. With Triton on a GPU the rows are rescaled in place (untouched where the
    cotangent is 1: a loss that is the program's output costs nothing), so the saved buffer
    becomes the returned one."""
    if g is None:
        return None
    if impl == "triton" and g.ndim == 2 and _triton_jax.on_cuda_gpu():
        cots = jnp.broadcast_to(cot, g.shape[:1]).astype(jnp.float32)
        return _sharding.call_rows(scale_row_fns("triton"), None, g, cots)[0]
    cot = cot.reshape(cot.shape + (1,) * (g.ndim - cot.ndim))
    return (g.astype(jnp.float32) * cot).astype(g.dtype)


def _finish(grads, h, w, b):
    """Gradients in their inputs' dtypes; inside shard_map summed over the devices whose
    partial sums they are (`_sharding.sum_to_varying`; a no-op elsewhere)."""
    dh, dw, db = grads
    out = (_sharding.sum_to_varying(dh.astype(h.dtype), h),
           _sharding.sum_to_varying(dw.astype(w.dtype), w),
           None if b is None else _sharding.sum_to_varying(db.astype(b.dtype), b))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(op: HeadOp, h, w, b, *aux):
    return op.primal(_run("fwd", op, h, w, b, *op.row_inputs(*aux)), *aux)


def _forward_role(op: HeadOp, dtype) -> str:
    """The forward's walk. "lean" keeps dH in the forward even where the fused statistics GEMM
    could run it (then the vocabulary walk computes dH too): lean cross-entropy on an H100
    (N=8192, D=4096, V=128256, [V, D], bf16) took 56.4 ms that way against 54.2-55.2
    (benchmarks/NOTES.md, twenty-first session)."""
    if not fuses_grad(op, dtype):
        return "fwd"
    return "fwd_dh" if op.head.mode == "lean" else "fwd_grad"


def _head_fwd(op: HeadOp, h, w, b, *aux):
    h, w, b, aux = _op.first_order_only(h, w, b, aux)
    rows = op.row_inputs(*aux)
    role = _forward_role(op, h.dtype)
    if role == "fwd":
        stats = _run("fwd", op, h, w, b, *rows)
        return op.primal(stats, *aux), ((), (h, w, b), aux, tuple(stats))
    *stats, dh, dw, db = _run(role, op, h, w, b, *rows)
    stats = tuple(stats[:len(op.stat_shapes())])
    return op.primal(stats, *aux), ((dh, dw, db), (h, w, b), aux, stats)


def _head_bwd(op: HeadOp, res, cts):
    grads, (h, w, b), aux, stats = res
    grads, cts = _op.first_order_only(grads, cts)
    role, impl = _forward_role(op, h.dtype), op.opts.implementation
    zero_aux = (None,) * len(aux)
    if role == "fwd_grad":  # the backward only scales
        cot = cts[0].astype(jnp.float32)
        dh, dw, db = grads
        return _finish((_scale(dh, cot, impl), _scale(dw, cot, impl),
                        None if db is None else db * cot), h, w, b) + zero_aux
    rows = op.bwd_rows(aux, stats, cts)
    if role == "fwd_dh":  # "lean": dH from the forward, scaled; dW (and db) by the vocab walk
        _, dw, db = _run("bwd_dw", op, h, w, b, *rows)
        dh = _scale(grads[0], op.dh_cotangent(aux, cts), impl)
        return _finish((dh, dw, db), h, w, b) + zero_aux
    walk = "bwd_lean" if op.head.mode == "lean" else "bwd"
    return _finish(_run(walk, op, h, w, b, *rows), h, w, b) + zero_aux


_head.defvjp(_head_fwd, _head_bwd)


def apply(op: HeadOp, implementation: str | None, h, w, b, *aux):
    """Runs the hidden-state op on `[N, D]` hidden states with the requested implementation of
    its row functions (None: Triton on a CUDA GPU, XLA elsewhere; the matmuls are XLA's)."""
    return _common.dispatch_op(lambda *args: _head(args[-1], *args[:-1]), implementation,
                               h, w, b, *aux, opts=op)
