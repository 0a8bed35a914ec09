"""How every op partitions across devices: one custom_partitioning rule for all row functions.

Every op is built from *row functions* `f(x, *rows) -> outs` over logits `x: [N, V]` and row
arrays `rows[i]: [N, ...]` (labels, per-row statistics, teacher entries); each output is either
a row array `[N, ...]` or an array shaped like `x` (a gradient). Such a function partitions the
same way for every op:

- token axis sharded: each device runs `f` on its own rows; nothing is communicated;
- vocabulary axis sharded: each device runs the op's *vocabulary-parallel* variant
  `f_vp(x_slice, *rows, axes=...)`, which computes partial statistics of its slice, merges them
  across `axes` with O(N) (O(N*K) for top-K) collectives and writes the gradient of its own
  slice. Row outputs come back replicated over `axes`, gradients keep the logits' sharding.

`partitioned()` wraps a row function in `jax.experimental.custom_partitioning` with a Shardy
sharding rule so that XLA's SPMD partitioner applies this under `jit` with any `NamedSharding`
(Auto axes), `call_rows()` adds the Explicit-axes case (through `jax.sharding.auto_axes`) and
the `shard_map` case (local shards; the vocabulary axis named by the caller).

Limits, each falling back to a correct but communicating layout (XLA all-gathers the axis):
a sharded axis whose size is not divisible by its number of shards is gathered; row arrays are
laid out like the logits' token axis. On the CPU, Triton's interpreter runs in a host callback,
which JAX drops from a custom-partitioned sub-computation, so partitioned programs over more
than one device run the XLA twin's row functions there (`spmd_fallback`); the compiled
jax-triton call has no such limit.
"""
from __future__ import annotations

import functools
import string
from typing import Callable, NamedTuple, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROW, LIKE_X = "row", "like_x"


class RowFns(NamedTuple):
    """One implementation of one op's row function, with its vocabulary-parallel variant.

    `local(x, *rows)` computes the outputs of `[N, V]` logits; `vocab_parallel(x, *rows, axes)`
    does the same for a vocabulary slice of each row, with collectives over the mesh `axes`
    that split the vocabulary (slice i of the axes' linear index holds columns
    `[i * V_local, (i + 1) * V_local)`); None makes a vocabulary-sharded input be gathered.
    """
    local: Callable
    vocab_parallel: Callable | None
    out_kinds: tuple[str, ...]  # ROW or LIKE_X per output


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _shards(mesh, axes) -> int:
    return functools.reduce(lambda a, b: a * b, (mesh.shape[a] for a in axes), 1)


def _layout(mesh, x_shape, x_sharding, has_vp: bool):
    """(row axes, vocab axes) the partitioned call runs with, given the logits' sharding."""
    spec = tuple(x_sharding.spec) + (None,) * (2 - len(x_sharding.spec))
    rows, vocab = _axes(spec[0]), _axes(spec[1])
    if rows and x_shape[0] % _shards(mesh, rows):
        rows = ()
    if vocab and (not has_vp or x_shape[1] % _shards(mesh, vocab)):
        vocab = ()
    return rows, vocab


def auto_mesh(mesh):
    """`mesh` with every axis of type Auto (the same devices and names).

    custom_partitioning hands its callbacks the mesh of the arguments' shardings, with their
    axis types, and traces the partitioned body under the caller's context mesh (`jax.set_mesh`
    around the compile). With Explicit axes the body then carries sharding-in-types annotations
    (Shardy `Sharding` custom calls) into the per-device program, which is built after XLA's
    sharding passes: nothing removes them and the backend rejects them (jax 0.11.2: "No
    registered implementation for untyped custom call to Sharding" on CPU; on GPUs an abort
    inside an all-reduce). The per-device body needs no propagation: Auto axes
    (`auto_traced`)."""
    types = getattr(mesh, "axis_types", ())
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(types))


def auto_traced(fn: Callable, mesh) -> Callable:
    """`fn` traced with the Auto-axes form of `mesh` as the context mesh (auto_mesh)."""
    abstract = auto_mesh(mesh).abstract_mesh

    def traced(*args):
        with jax.sharding.use_abstract_mesh(abstract):
            return fn(*args)
    return traced


def _row_sharding(mesh, rows, ndim: int):
    return NamedSharding(mesh, P(_entry(rows), *([None] * (ndim - 1))))


def _rule(n_rows_in: Sequence[int], out_ndims: Sequence[tuple[str, int]]) -> str:
    """Shardy rule: x is "n v", row arrays "n" plus their own factors, outputs likewise."""
    letters = iter(c for c in string.ascii_lowercase if c not in "nv")
    ins = ["n v"] + [" ".join(["n"] + [next(letters) for _ in range(nd - 1)]) for nd in n_rows_in]
    outs = ["n v" if kind == LIKE_X else " ".join(["n"] + [next(letters) for _ in range(nd - 1)])
            for kind, nd in out_ndims]
    return ", ".join(ins) + " -> " + ", ".join(outs)


def partitioned(fns: RowFns, fallback: RowFns | None, in_ndims: tuple[int, ...],
                out_ndims: tuple[int, ...]) -> Callable:
    """The custom-partitioned form of `fns.local` for row arrays of `in_ndims` dimensions.

    `fallback` (or None) is used instead of `fns` when a partitioned program spans more than
    one device and `fns` cannot run there (the interpreter's host callbacks)."""
    kinds = fns.out_kinds

    @custom_partitioning
    def call(x, *rows):
        return tuple(fns.local(x, *rows))

    def out_shardings(mesh, rows_axes, x_sharding):
        return tuple(x_sharding if kind == LIKE_X else _row_sharding(mesh, rows_axes, nd)
                     for kind, nd in zip(kinds, out_ndims))

    def infer(mesh, arg_shapes, result_shape):
        mesh = auto_mesh(mesh)
        x = arg_shapes[0]
        rows, vocab = _layout(mesh, x.shape, x.sharding, fns.vocab_parallel is not None)
        x_sharding = NamedSharding(mesh, P(_entry(rows), _entry(vocab)))
        return out_shardings(mesh, rows, x_sharding)

    def partition(mesh, arg_shapes, result_shape):
        mesh = auto_mesh(mesh)
        x = arg_shapes[0]
        use = fns if fallback is None or mesh.size == 1 else fallback
        rows, vocab = _layout(mesh, x.shape, x.sharding, use.vocab_parallel is not None)
        x_sharding = NamedSharding(mesh, P(_entry(rows), _entry(vocab)))
        arg_shardings = (x_sharding,) + tuple(_row_sharding(mesh, rows, nd) for nd in in_ndims)

        def lower(x, *rows_in):
            if vocab:
                return tuple(use.vocab_parallel(x, *rows_in, axes=vocab))
            return tuple(use.local(x, *rows_in))

        return (mesh, auto_traced(lower, mesh), out_shardings(mesh, rows, x_sharding),
                arg_shardings)

    call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                       sharding_rule=_rule(in_ndims, list(zip(kinds, out_ndims))))
    return call


def varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def match_varying(out, like):
    """`out` with the varying manual axes of `like` (a custom_vjp cotangent must carry its
    primal's type inside shard_map; kernel outputs carry none)."""
    return _pcast_to(out, varying_axes(like))


def _pcast_to(out, axes: frozenset):
    missing = tuple(sorted(axes - varying_axes(out)))
    if not missing:
        return out
    return jax.lax.pcast(out, missing, to="varying")


def _explicit_axes(x) -> bool:
    """Whether x is sharded over a mesh with Explicit axes (call_rows and call_dims then run the
    partitioned form in Auto mode; its bodies are traced on Auto axes, see auto_mesh)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return False
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def call_rows(fns: RowFns, fallback: RowFns | None, x, *rows, vocab_axis=None):
    """Runs an op's row function so that it partitions without gathering the logits.

    Inside shard_map (`x` varies over manual axes) the row function runs on the local shard,
    with `vocab_axis` (a mesh axis name or tuple of names) marking the vocabulary as sliced
    across those axes. Elsewhere the custom-partitioned form runs; with Explicit mesh axes it
    runs in Auto mode and its outputs get the shardings the rule gives.
    """
    vocab_axes = _axes(vocab_axis)
    if varying_axes(x) or vocab_axes:
        if vocab_axes:
            if fns.vocab_parallel is None:
                raise NotImplementedError("this op has no vocabulary-parallel form")
            outs = fns.vocab_parallel(x, *rows, axes=vocab_axes)
        else:
            outs = fns.local(x, *rows)
        row_axes = varying_axes(x) - frozenset(vocab_axes)
        return tuple(match_varying(o, x) if kind == LIKE_X else _pcast_to(o, row_axes)
                     for o, kind in zip(outs, fns.out_kinds))
    plain = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, *rows)]
    avals = jax.eval_shape(lambda *a: tuple(fns.local(*a)), *plain)
    fn = partitioned(fns, fallback, tuple(r.ndim for r in rows), tuple(a.ndim for a in avals))
    fn = rowwise(fn)
    if not _explicit_axes(x):
        return fn(x, *rows)
    spec = tuple(jax.typeof(x).sharding.spec)
    spec = spec + (None,) * (2 - len(spec))
    outs_spec = tuple(P(*spec) if kind == LIKE_X else P(spec[0], *([None] * (a.ndim - 1)))
                      for kind, a in zip(fns.out_kinds, avals))
    return jax.sharding.auto_axes(fn, out_sharding=outs_spec)(x, *rows)


def rowwise(fn: Callable[..., tuple[jax.Array, ...]]) -> Callable[..., tuple[jax.Array, ...]]:
    """`_triton_jax.rowwise`: custom_partitioning has no batching rule either."""
    from jax_fusedloss import _triton_jax

    return _triton_jax.rowwise(fn)


def slice_offset(vocab_local: int, axes: tuple[str, ...]):
    """First global column of this device's vocabulary slice (int32)."""
    return (jax.lax.axis_index(axes) * vocab_local).astype(jax.numpy.int32)


def global_vocab(vocab_local: int, axes: tuple[str, ...]) -> int:
    return vocab_local * jax.lax.axis_size(axes)


def merge_across(axes: tuple[str, ...], m, s, u=None, sums: Sequence[jax.Array] = ()):
    """Merges per-device softmax partials over the mesh `axes` with two O(N) all-reduces (a max,
    then one sum of every column): (max, sum exp(z - max)[, sum (z - max) exp(z - max)]) merged
    as in `merge_partials` (a partial whose max is -inf is the identity), plain `sums` added.
    Returns (m, s, u or None, *sums), replicated over `axes`."""
    jnp = jax.numpy
    m_all = jax.lax.pmax(m, axes)
    ref = jnp.where(jnp.isneginf(m_all), 0.0, m_all)
    dead = jnp.isneginf(m)
    shift = jnp.where(dead, 0.0, m) - ref
    w = jnp.where(dead, 0.0, jnp.exp(shift))
    cols = [jnp.where(dead, 0.0, s) * w]
    if u is not None:
        cols.append(jnp.where(dead, 0.0, w * (u + shift * s)))
    total = jax.lax.psum(jnp.stack(cols + list(sums), axis=-1), axes)
    u_out = total[..., 1] if u is not None else None
    rest = total[..., len(cols):]
    return (m_all, total[..., 0], u_out) + tuple(rest[..., i] for i in range(len(sums)))


def run(row_fns: Callable[[str], dict[str, RowFns]], opts, role: str, *arrays):
    """Runs row function `role` of the implementation `opts.implementation`, partitioned across
    devices (`call_rows`), with `row_fns(implementation)` giving an op's row functions. Where
    the Triton path runs in the interpreter, the XLA twin's row functions are the fallback for
    partitioned programs over several devices."""
    from jax_fusedloss import _triton_jax

    fallback = None
    if opts.implementation == "triton" and not _triton_jax.on_cuda_gpu():
        fallback = row_fns("xla")[role]
    return call_rows(row_fns(opts.implementation)[role], fallback, *arrays,
                     vocab_axis=opts.vocab_axis)


# ----------------------------------------------------------------------------- named dimensions
# Ops whose operands are not all logits-shaped (the fused linear loss: hidden `[N, D]`, weight
# `[D, V]`, bias `[V]`) name each operand's and result's dimensions by letters: "n" the tokens,
# "v" the vocabulary, any other letter a dimension that stays whole ("d", "c"). The same rule as
# above applies: "n" is split like the first operand that has it, "v" like the first that has
# it, and a result without "n" (a weight gradient) is summed across the token axes by the op.
def dims_layout(mesh, dims: Sequence[str], shapes, specs) -> tuple[tuple, tuple]:
    """(row axes, vocab axes) for operands with named `dims`, their `shapes` and partition
    `specs`: an axis split that does not divide its dimension is dropped (gathered). Where the
    tokens and the vocabulary are split over the same axes (an FSDP rule sharding the LM head
    over the data axis on V), the tokens are gathered and the op runs vocabulary-parallel: the
    hidden states (`N * D`) cost less to gather than the weight (`V * D`, and its gradient
    all-reduced back). 2 x H100, N=8192 per GPU, D=4096, V=128256: 46 ms gathering the weight,
    XLA's own naive head 43 ms gathering the tokens."""

    def axes_of(letter):
        for d, shape, spec in zip(dims, shapes, specs):
            if letter in d:
                spec = tuple(spec) + (None,) * (len(d) - len(tuple(spec)))
                i = d.index(letter)
                ax = _axes(spec[i])
                return ax if ax and not shape[i] % _shards(mesh, ax) else ()
        return ()

    rows, vocab = axes_of("n"), axes_of("v")
    return (() if set(rows) & set(vocab) else rows), vocab


def dims_spec(d: str, rows, vocab) -> P:
    return P(*(_entry(rows) if c == "n" else _entry(vocab) if c == "v" else None for c in d))


def partitioned_dims(body: Callable, in_dims: tuple[str, ...],
                     out_dims: tuple[str, ...]) -> Callable:
    """custom_partitioning of an op over operands and results with named dims (see above).

    `body(mesh, row_axes, vocab_axes)` returns the function each device runs on its shards
    (`mesh` None and both axes empty: the whole arrays); it owns the collectives: summing its
    results without "n" over `row_axes` and merging vocabulary partials over `vocab_axes`."""

    @custom_partitioning
    def call(*args):
        return tuple(body(None, (), ())(*args))

    def layout(mesh, arg_shapes):
        return dims_layout(mesh, in_dims, [a.shape for a in arg_shapes],
                           [a.sharding.spec for a in arg_shapes])

    def shardings(mesh, dims, rows, vocab):
        return tuple(NamedSharding(mesh, dims_spec(d, rows, vocab)) for d in dims)

    def infer(mesh, arg_shapes, result_shape):
        mesh = auto_mesh(mesh)
        return shardings(mesh, out_dims, *layout(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        mesh = auto_mesh(mesh)
        rows, vocab = layout(mesh, arg_shapes)
        return (mesh, auto_traced(body(mesh, rows, vocab), mesh),
                shardings(mesh, out_dims, rows, vocab), shardings(mesh, in_dims, rows, vocab))

    rule = ", ".join(" ".join(d) for d in in_dims) + " -> " + ", ".join(
        " ".join(d) for d in out_dims)
    call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                       sharding_rule=rule)
    return _map_batched(call)


def _map_batched(fn: Callable) -> Callable:
    """`fn` under vmap as a sequential map over the batch (custom_partitioning has no batching
    rule; results without "n" cannot be folded into rows)."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        def one(batched):
            it = iter(batched)
            return wrapped(*(next(it) if b else a for a, b in zip(args, in_batched)))

        outs = jax.lax.map(one, tuple(a for a, b in zip(args, in_batched) if b))
        return outs, tuple(True for _ in outs)

    return wrapped


def call_dims(body: Callable, in_dims: tuple[str, ...], out_dims: tuple[str, ...], *args):
    """Runs `partitioned_dims(body, in_dims, out_dims)` on `args`; with Explicit mesh axes in
    Auto mode, its results getting the shardings the rule gives."""
    fn = partitioned_dims(body, tuple(in_dims), tuple(out_dims))
    explicit = [a for a in args if _explicit_axes(a)]
    if not explicit:
        return fn(*args)
    mesh = jax.typeof(explicit[0]).sharding.mesh
    rows, vocab = dims_layout(mesh, in_dims, [a.shape for a in args],
                              [jax.typeof(a).sharding.spec for a in args])
    run = jax.sharding.auto_axes(fn, out_sharding=tuple(dims_spec(d, rows, vocab)
                                                        for d in out_dims))
    if jax.sharding.get_abstract_mesh().empty:  # jit of explicitly sharded arrays without
        # jax.set_mesh: auto_axes would leave the body's types Explicit
        with jax.sharding.use_abstract_mesh(mesh):
            return run(*args)
    return run(*args)


def sum_to_varying(out, like):
    """Inside shard_map: `out` summed over the manual axes it varies over and `like` does not
    (a replicated weight's gradient from sharded tokens), then cast to vary like `like`."""
    extra = tuple(sorted(varying_axes(out) - varying_axes(like)))
    if extra:
        out = jax.lax.psum(out, extra)
    return match_varying(out, like)
