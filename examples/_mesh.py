"""The examples' device mesh: batch over "data", the LM head's vocabulary over "model".

`--mesh data=2` splits every batch over two devices (data parallel, parameters replicated);
`--mesh data=1,model=2` also splits the vocabulary of the tied embedding / LM head, so the
logits `[B, T, V]` come out laid out `P("data", None, "model")` and `jax_fusedloss` merges the
per-slice softmax statistics with O(B*T) all-reduces instead of gathering the logits. Every
other parameter and all optimiser state besides the head's are replicated. The mesh axes are
`Auto`: XLA's partitioner propagates the layout from the arrays placed here.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "model")
# The tied embedding table `[V, D]` is the LM head (`logits = h @ table.T`): splitting its rows
# over "model" is splitting the head's `[D, V]` weight by columns. Matched by these consecutive
# keys in any state tree (the model's, and the optimiser's moments that mirror it).
HEAD_PATH = ("embed", "embedding")
HEAD_SPEC = P("model", None)
BATCH_SPEC = P("data")
LOGITS_SPEC = P("data", None, "model")
# A collective's result: one array (`f32[4,64]{1,0} all-reduce(`) or a tuple of them (XLA's
# combiners merge many small all-reduces into one: `(f32[64]{0}, f32[4,64]{1,0}) all-reduce(`).
_COLLECTIVE = re.compile(r"=\s*(\w+\[[\d,]*\][^\s]*|\([^()]*\))\s*(all-gather|all-to-all|"
                         r"collective-permute|all-reduce|reduce-scatter)(-start)?\(")
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,model=2"` -> `{"data": 2, "model": 2}`; an axis left out has size 1.

    Raises:
      ValueError: an entry that is not `name=size`, an axis name other than "data" and
        "model", a repeated axis or a size below 1.
    """
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for item in text.split(","):
        name, eq, size = item.strip().partition("=")
        if not eq or not size.strip().isdigit():
            raise ValueError(f"--mesh entry {item!r} must be NAME=SIZE with SIZE a positive "
                             f"integer, e.g. --mesh data=2,model=2")
        name = name.strip()
        if name not in AXES:
            raise ValueError(f"--mesh axis {name!r} is unknown: the axes are {', '.join(AXES)} "
                             f"(batch and LM-head vocabulary)")
        if name in seen:
            raise ValueError(f"--mesh axis {name!r} is given twice in {text!r}")
        if int(size) < 1:
            raise ValueError(f"--mesh {name}={size}: a size must be at least 1")
        seen.add(name)
        sizes[name] = int(size)
    return sizes


def make_mesh(sizes: dict[str, int]) -> Mesh:
    """A `("data", "model")` mesh with `Auto` axes over all of this process's devices.

    Raises:
      ValueError: the product of the sizes is not `jax.device_count()`.
    """
    n = jax.device_count()
    if math.prod(sizes.values()) != n:
        shown = ",".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"--mesh {shown} holds {math.prod(sizes.values())} devices but JAX "
                         f"sees {n} ({jax.default_backend()}); the sizes must multiply to {n} "
                         "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N)")
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES,
                         axis_types=(AxisType.Auto,) * len(AXES))


def describe(mesh: Mesh) -> str:
    """`"data=2 x model=2 (4 cpu devices)"`."""
    axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return f"{axes} ({mesh.size} {mesh.devices.flat[0].platform} devices)"


def check_sizes(mesh: Mesh, *, batch: int, vocab: int) -> None:
    """Raises `ValueError` unless the batch splits evenly over "data" and the vocabulary
    over "model"."""
    data, model = mesh.shape["data"], mesh.shape["model"]
    if batch % data:
        raise ValueError(f"--batch {batch} is not a multiple of the mesh's data={data}")
    if vocab % model:
        raise ValueError(f"the tokenizer's vocabulary of {vocab} tokens is not a multiple of the "
                         f"mesh's model={model}: pick a --vocab that the corpus fills and "
                         f"{model} divides")


def _key_names(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def spec_for(path: tuple, ndim: int) -> P:
    """The layout of one state leaf (`path`: its tree path): the head's table split by
    vocabulary, everything else replicated."""
    names, n = _key_names(path), len(HEAD_PATH)
    is_head = ndim == 2 and any(names[i:i + n] == HEAD_PATH for i in range(len(names)))
    return HEAD_SPEC if is_head else P()


def shardings(tree: Any, mesh: Mesh) -> Any:
    """A `NamedSharding` per leaf of a state tree (see `spec_for`)."""
    return jax.tree.map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec_for(path, np.ndim(leaf))), tree)


def shard_(obj: nnx.Module | nnx.Optimizer, mesh: Mesh) -> None:
    """Moves the state of a module or optimiser onto `mesh` in place.

    Raises:
      RuntimeError: a module with no LM-head table to split (so the head would silently stay
        replicated).
    """
    state = nnx.state(obj)
    tree = shardings(state, mesh)
    if isinstance(obj, nnx.Module) and not any(
            s.spec == HEAD_SPEC for s in jax.tree.leaves(tree)):
        raise RuntimeError(f"no {'.'.join(HEAD_PATH)} table of rank 2 in the model's state: "
                           "the LM head cannot be split over 'model'")
    nnx.update(obj, jax.device_put(state, tree))


def placer(mesh: Mesh):
    """Host batch `[B, ...]` -> array split over "data" along its first axis."""
    sharding = NamedSharding(mesh, BATCH_SPEC)
    return lambda a: jax.device_put(a, sharding)


def logits_sharding(mesh: Mesh) -> NamedSharding:
    """Where the training step pins the logits `[B, T, V]`."""
    return NamedSharding(mesh, LOGITS_SPEC)


def big_collectives(hlo: str, limit: int) -> list[str]:
    """The collectives in compiled HLO text with a result (or, for a tuple, an element) of at
    least `limit` elements."""
    def largest(result: str) -> int:
        return max((math.prod(int(d) for d in a.split(",") if d)
                    for a in _ARRAY.findall(result)), default=0)

    return [m.group(0)[:160] for m in _COLLECTIVE.finditer(hlo) if largest(m.group(1)) >= limit]


def logits_report(model: nnx.Module, objective: Callable[..., Any], mesh: Mesh, x: jax.Array,
                  y: jax.Array) -> dict:
    """Compiles the loss and its gradient on `mesh` once and says how the logits are laid out.

    `objective(on_logits=hook)` must build the training step's loss function, calling `hook`
    on the logits while tracing (see `_common.ce_objective`). Returns `logits_spec`: the
    partition spec the compiled program gives the logits the loss receives (read with
    `jax.debug.inspect_array_sharding`); and `logits_collectives`: every collective in the
    compiled loss + gradient (the training step minus the optimiser update) whose result holds
    at least one device's share of the logits. It must be empty, or something gathered the
    logits. (Parameter- and activation-sized collectives stay below that share while
    `d_model * model < V` and `d_model < B * T / devices`.) `hlo_collectives` counts the
    collectives of any size there.
    """
    specs: list[str] = []

    def hook(logits: jax.Array) -> None:
        jax.debug.inspect_array_sharding(
            logits, callback=lambda s: specs.append(str(getattr(s, "spec", s))))

    loss_fn = objective(on_logits=hook)
    graphdef, state = nnx.split(model)
    grad = jax.jit(jax.value_and_grad(
        lambda state, x, y: loss_fn(nnx.merge(graphdef, state), None, x, y)))
    hlo = grad.lower(state, x, y).compile().as_text()
    b, t = x.shape
    limit = b * t * model.embed.num_embeddings // mesh.size
    return dict(logits_spec=specs[0] if specs else None,
                logits_collectives=big_collectives(hlo, limit),
                hlo_collectives=len(big_collectives(hlo, 0)))
